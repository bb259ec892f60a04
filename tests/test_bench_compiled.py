"""`lmcli bench --sections compiled`: its arithmetic (medians, ratios) and the interleaved llama.cpp runs,
with the child processes replaced by stand-ins that return figures the test chose."""

from __future__ import annotations

from types import SimpleNamespace

from rich.console import Console


def test_the_section_interleaves_llama_cpp_at_batch_1_and_reports_the_ratios(monkeypatch):
    from lmcli.bench import compiled as bench_compiled

    calls: list[str] = []
    rates = {"eager": iter([10.0, 30.0, 20.0]), "compiled": iter([60.0, 40.0, 50.0])}

    def child(path, compiled, tokens, env, batch):
        name = "compiled" if compiled else "eager"
        calls.append(f"{name}{batch}")
        first = len([c for c in calls if c == f"{name}{batch}"]) <= 2 and compiled
        rate = 1.0 if first else next(rates[name]) if batch == 1 else 5.0
        return {"first_step_s": 7.0 if first else None, "tokens_per_second": rate, "tokens": [[1, 2]],
                "peak_rss_mib": 300.0}

    def llama(path, tokens, env):
        calls.append("llama")
        return {"tokens_per_second": [25.0, 100.0, 40.0][calls.count("llama") - 1]}

    monkeypatch.setattr(bench_compiled, "_child", child)
    monkeypatch.setattr(bench_compiled, "_llama_cpp_child", llama)
    monkeypatch.setattr(bench_compiled, "_has_llama_cpp", lambda path: True)
    settings = SimpleNamespace(new_tokens=16, threads=None, batch_sizes=[1, 8], repeats=3)
    result = bench_compiled.measure(settings, SimpleNamespace(path="model.gguf"), lambda message: None)
    # rounds at batch 1: eager, compiled, llama.cpp, three times; never llama.cpp at batch 8
    assert calls[2:11] == ["eager1", "compiled1", "llama"] * 3 and calls.count("llama") == 3
    one = result["batches"][1]["tokens_per_second"]
    assert one == {"eager": 20.0, "compiled": 50.0, "llama.cpp": 40.0}  # the medians
    assert "llama.cpp" not in result["batches"][8]["tokens_per_second"]
    console = Console(record=True, width=250)
    bench_compiled.report(result, console)
    text = console.export_text()
    assert "2.50x" in text and "1.25x" in text  # 50/20 and 50/40
