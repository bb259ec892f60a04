"""`lmcli bench --markdown`: the engine table as Markdown, against figures written out here."""

from __future__ import annotations

from lmcli.bench.report import markdown_report

RESULTS = {
    "checkpoint": "/models/SmolLM2-135M-Instruct.Q4_1.gguf",
    "float_dtype": "float32",
    "native_format": "Q4_1",
    "machine": {"cpu": "Some CPU", "logical_cpus": 2, "torch": "2.13.0+cpu", "torch_cpu_capability": "AVX512",
                "extensions": ["avx2", "amx_tile"], "read_bandwidth_bytes_per_s": 15.44e9},
    "settings": {"batch_sizes": [1, 8], "prefill_tokens": 256, "new_tokens": 16, "prompt_tokens": 32, "repeats": 1},
    "engines": {
        "lmcli native": {"prefill_tokens_per_s": 462.4, "ttft_s": 0.5536, "decode_b1_tokens_per_s": 58.84,
                         "decode_b8_tokens_per_s": 190.24, "peak_rss_bytes": 397 * 2**20,
                         "vs_transformers": {"decode_b1_tokens_per_s": 2.871},
                         "vs_llama.cpp": {"decode_b1_tokens_per_s": 0.8346}},
        "transformers": {"prefill_tokens_per_s": 652.0, "ttft_s": 0.393, "decode_b1_tokens_per_s": 20.5,
                         "decode_b8_tokens_per_s": 106.1, "peak_rss_bytes": 954 * 2**20},
        "llama.cpp": {"unavailable": "llama_cpp is not installed"},
    },
}


def test_the_table_holds_the_figures():
    lines = markdown_report(RESULTS, "lmcli bench --quick --markdown").splitlines()
    assert lines[0] == ("CPU: Some CPU · 2 logical CPUs · torch 2.13.0+cpu capability AVX512 · extensions avx2 amx_tile · "
                        "read bandwidth 15.4 GB/s")
    assert "`lmcli bench --quick --markdown` on SmolLM2-135M-Instruct.Q4_1.gguf" in lines[2]
    assert "prefill 256 tokens (b1), decode 16 tokens after 32, median of 1 interleaved round(s)" in lines[2]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines if line.startswith("|")]
    assert rows[0] == ["engine", "prefill tok/s", "TTFT ms", "decode b1 tok/s", "decode b8 tok/s", "peak RSS MiB",
                       "b1 vs transformers", "b1 vs llama.cpp"]
    assert rows[1] == ["---", "---:", "---:", "---:", "---:", "---:", "---:", "---:"]
    assert rows[2] == ["lmcli Q4_1", "462", "554", "58.8", "190.2", "397", "2.87x", "0.83x"]
    assert rows[3] == ["transformers float32", "652", "393", "20.5", "106.1", "954", "", ""]
    assert rows[4][0].startswith("llama.cpp") and set(rows[4][1:]) == {"n/a"}
