"""`lmcli bench` runs both implementations side by side (a smoke test: no timing assertions)."""

from tiny import save_reference

from lmcli import bench


def test_bench_compares_with_transformers(tmp_path, capsys):
    save_reference("llama", tmp_path)
    results = bench.main(str(tmp_path), max_new_tokens=4, prompt_tokens=8, batch_size=2, repeats=1)
    assert set(results) == {"lmcli", "transformers"}
    for figures in results.values():
        assert figures["prefill_tokens_per_s"] > 0 and figures["decode_tokens_per_s"] > 0
    output = capsys.readouterr().out
    assert "decode tok/s" in output
    assert "greedy tokens identical: yes" in output
