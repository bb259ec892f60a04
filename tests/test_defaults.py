"""Every command with the user's defaults (issue 31, "The suite runs the user's defaults").

tests/conftest.py turns features off for the rest of the suite (`TURNED_OFF` below); a user has none of
that. Here each command (generate, chat, a JSONL job, info, bench) runs once per architecture family, in a
subprocess, with a fresh LMCLI_CACHE_DIR and every other LMCLI_* variable removed, exactly as a user's
first and later runs: isolation comes from the cache directory, not from turning features off.

- Decoder: the real default model (its GGUF, through the packed cache on every start path: the embedded
  default, `-c FILE.gguf`, `-m NAME`, a draft model, chat, a job, info and bench, first writing the entry
  and then mapping it). The reference is the same command with the features off (LMCLI_COMPILE=0,
  LMCLI_PACKED_CACHE=0), the path test_real_models checks against transformers.
- Encoder-decoder: a tiny T5 with a tokenizer.json (test_encdec_cli's), against transformers' generate.

The last test is the rule: a behaviour-changing variable conftest.py sets must name its test here.
"""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from cli_fixtures import REPO, subprocess_env
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from test_encdec_cli import _reference_text, t5_dir  # noqa: F401 (fixture)

PROMPT = "The capital of France is"
TESTS = Path(__file__).resolve().parent

# Each variable conftest.py sets for the whole session that changes what lmcli does, and the test here
# that runs lmcli with that variable unset (its default). test_conftest_turns_off_nothing_untested checks it.
TURNED_OFF = {
    "LMCLI_PACKED_CACHE": "test_every_start_path_of_the_default_model_with_the_defaults",
    "LMCLI_COMPILE": "test_generate_with_the_defaults_encoder_decoder",  # and every decoder test here
    "LMCLI_PROMPT_CACHE": "test_generate_twice_with_the_defaults_reuses_the_prompt_blocks",
}
# Variables conftest.py sets that keep the suite to itself (where it writes, what it reaches), not what
# lmcli computes, each with why.
ISOLATION = {"LMCLI_CACHE_DIR": "each test here gives its own fresh cache directory",
             "HF_HUB_OFFLINE": "nothing is downloaded in the suite; a user's Hub access is tested against "
                               "a local server (test_hub.py)"}
FEATURES_OFF = {"LMCLI_COMPILE": "0", "LMCLI_PACKED_CACHE": "0", "LMCLI_PROMPT_CACHE": "off"}


def _env(cache: Path, off: bool = False) -> dict[str, str]:
    """A user's environment: no LMCLI_* variable but the cache directory (and, for the reference, the
    features off)."""
    env = {name: value for name, value in subprocess_env().items() if not name.startswith("LMCLI_")}
    env["LMCLI_CACHE_DIR"] = str(cache)
    return {**env, **FEATURES_OFF} if off else env


def _lmcli(cache: Path, *args: str, stdin: str | None = None, off: bool = False,
           timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "lmcli", *args], input=stdin, capture_output=True, text=True,
                          env=_env(cache, off), cwd=REPO, timeout=timeout)


def _ok(result: subprocess.CompletedProcess, quiet: bool = True) -> str:
    """stdout of a run that succeeded; `quiet`: with nothing on stderr (no note, warning or progress)."""
    assert result.returncode == 0, result.stderr
    if quiet:
        assert result.stderr == "", result.stderr
    return result.stdout


def _job_rows(tmp_path: Path, prompts: list[str], new: int) -> Path:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": f"r{i}", "prompt": p, "max_new_tokens": new, "temperature": 0})
                            + "\n" for i, p in enumerate(prompts)))
    return rows


def _completions(out: Path) -> dict[str, str]:
    return {row["id"]: row["completion"] for row in map(json.loads, out.read_text().splitlines())}


# --- decoder: the real default model ------------------------------------------------------------------


@pytest.fixture(scope="module")
def user_cache(tmp_path_factory) -> Path:
    """One fresh cache for this module's runs of the default model, as one user's: the first run probes the
    kernels and writes the packed entry (seconds on a busy machine), the later ones reuse them. The
    features-off references use it too (they neither read nor write the packed entry)."""
    return tmp_path_factory.mktemp("user") / "cache"


def test_every_start_path_of_the_default_model_with_the_defaults(smollm2_gguf, user_cache):
    """generate with the defaults: a first start writes the packed entry, later ones map it, whether the
    model is the embedded default, a path or a name, or a draft model beside it; each prints the
    features-off text and nothing on stderr; `info` shows the entry; then a draft model beside it."""
    args = ("--greedy", "-n", "8", PROMPT)
    want = _ok(_lmcli(user_cache, "generate", *args, off=True))
    assert want.strip() and not (user_cache / "packed").exists()
    assert _ok(_lmcli(user_cache, "generate", *args)) == want  # the first start: the entry written
    [entry] = (user_cache / "packed").glob("*.lmpk")
    written = entry.stat().st_mtime_ns
    for start in (["-c", str(smollm2_gguf)], ["-m", "smollm2-135m"]):
        assert _ok(_lmcli(user_cache, "generate", *start, *args)) == want, start
    assert list((user_cache / "packed").glob("*.lmpk")) == [entry] and entry.stat().st_mtime_ns == written  # mapped
    shown = _ok(_lmcli(user_cache, "info"))
    assert "SmolLM2" in shown and "its loaded weights, packed, " in shown and entry.name in shown
    # A draft model loads through the packed cache too (here the same file, loaded in bfloat16: an entry of
    # its own key, which replaces the model's; a real draft is another file).
    draft = _lmcli(user_cache, "generate", "--draft-model", str(smollm2_gguf), *args)
    assert _ok(draft, quiet=False) == want and "speculation will be slower" in draft.stderr  # its own size
    assert len(draft.stderr.strip().splitlines()) == 1, draft.stderr


def test_generate_twice_with_the_defaults_reuses_the_prompt_blocks(smollm2_gguf, user_cache):
    """The prompt cache is on by default: a first run computes its whole prompt (so it is the cache-off
    run: `--stats` shows nothing restored) and writes the prompt's blocks under the cache directory; a
    second run of the same prompt reads them from disk and prints the same text."""
    system = "You answer in one short sentence. " + "Be precise, be polite, be brief. " * 12
    args = ("generate", "--stats", "--chat", "--system", system, "--greedy", "-n", "6", "Name a fruit.")
    first = _lmcli(user_cache, *args)
    assert re.search(r"prefill (\d+) of \1 tokens computed ·", first.stderr), first.stderr
    assert list((user_cache / "prompts").rglob("*.lmpb"))
    second = _lmcli(user_cache, *args)
    assert _ok(second, quiet=False) == _ok(first, quiet=False) and first.stdout.strip()
    assert "from disk" in second.stderr, second.stderr


def test_chat_with_the_defaults_decoder(smollm2_gguf, user_cache):
    turns = "Hi there.\nName a colour.\n"
    want = _ok(_lmcli(user_cache, "chat", "--greedy", "-n", "6", stdin=turns, off=True))
    assert _ok(_lmcli(user_cache, "chat", "--greedy", "-n", "6", stdin=turns)) == want and want.strip()


def test_a_job_with_the_defaults_decoder(smollm2_gguf, user_cache, tmp_path):
    rows = _job_rows(tmp_path, [PROMPT, "Water boils at"], 6)
    outs = {}
    for name, off in (("off", True), ("defaults", False)):
        outs[name] = tmp_path / f"{name}.jsonl"
        _ok(_lmcli(user_cache, "generate", "--input", str(rows), "--output", str(outs[name]), off=off), quiet=False)
    assert _completions(outs["defaults"]) == _completions(outs["off"]) and len(_completions(outs["off"])) == 2


def test_bench_with_the_defaults_decoder(smollm2_gguf, user_cache):
    """`bench --quick` compares engines for minutes; its smallest run: lmcli alone, the GGUF's own format,
    a few tokens, one round. Each engine runs in a subprocess of its own, with the caller's environment."""
    result = _lmcli(user_cache, "bench", "--quick", "--engines", "lmcli", "--formats", "native",
                    "--no-quality", "-n", "2", "--prompt-tokens", "4", "--prefill-tokens", "4", "--contexts", "",
                    "--scaling-batches", "", "--batch-size", "2", "--repeats", "1", "--json")
    engines = json.loads(_ok(result, quiet=False))["engines"]
    assert list(engines) == ["lmcli native"], engines
    assert "error" not in engines["lmcli native"] and engines["lmcli native"]["load_s"] > 0


# --- encoder-decoder: a tiny T5 ---------------------------------------------------------------------------


def test_generate_with_the_defaults_encoder_decoder(t5_dir, tmp_path):
    """Issue 31, defect 1: with no LMCLI_COMPILE, every encoder-decoder run stopped with `internal error:
    TypeError: EncoderDecoderModel.compile_decode() got an unexpected keyword argument 'builds'`."""
    prompt = "translate English to German: the house is wonderful"
    _, want = _reference_text(t5_dir, prompt, 5)
    assert _ok(_lmcli(tmp_path / "cache", "generate", "-c", str(t5_dir), "--greedy", "-n", "5", prompt)) == want + "\n"


def test_chat_with_the_defaults_encoder_decoder(t5_dir, tmp_path):
    """This T5 has no chat template: chat ends with the usual one-line error (test_encdec_cli's), not an
    internal one."""
    result = _lmcli(tmp_path / "cache", "chat", "-c", str(t5_dir), "--greedy", "-n", "3", stdin="Hi\n")
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 1 and len(lines) == 1 and "no chat template" in lines[0], result.stderr


def test_a_job_with_the_defaults_encoder_decoder(t5_dir, tmp_path):
    prompts = ["summarize: a cat sat on the mat and slept", "the quick brown fox"]
    rows, out = _job_rows(tmp_path, prompts, 6), tmp_path / "out.jsonl"
    _ok(_lmcli(tmp_path / "cache", "generate", "-c", str(t5_dir), "--input", str(rows), "--output", str(out)),
        quiet=False)
    assert _completions(out) == {f"r{i}": _reference_text(t5_dir, p, 6)[1] for i, p in enumerate(prompts)}


def test_info_with_the_defaults_encoder_decoder(t5_dir, tmp_path):
    shown = _ok(_lmcli(tmp_path / "cache", "info", str(t5_dir)))
    assert "encoder: 2 layers, 4 heads of 8, feed-forward 64" in shown


# --- the rule ------------------------------------------------------------------------------------------------


def _conftest_variables(source: str | None = None) -> set[str]:
    """The variables tests/conftest.py (or `source`) sets: os.environ[...] = ..., os.environ.setdefault(...)."""
    found = set()
    for node in ast.walk(ast.parse(source if source is not None else (TESTS / "conftest.py").read_text())):
        target = None
        if isinstance(node, ast.Assign):
            for t in node.targets:
                if isinstance(t, ast.Subscript) and ast.unparse(t.value) == "os.environ":
                    target = t.slice
        elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("os.environ.setdefault",
                                                                         "os.environ.update", "os.putenv"):
            target = node.args[0] if node.args else None
        if isinstance(target, ast.Constant) and isinstance(target.value, str):
            found.add(target.value)
        elif target is not None:
            found.add(f"<not a literal: {ast.unparse(target)}>")
    return found


def test_conftest_turns_off_nothing_untested():
    """A variable conftest.py sets for the whole suite either only isolates (ISOLATION) or has a test here,
    named in TURNED_OFF, that runs lmcli with it unset."""
    tests_here = {node.name for node in ast.parse(Path(__file__).read_text()).body
                  if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}
    variables = _conftest_variables()
    assert {"LMCLI_CACHE_DIR", "LMCLI_PACKED_CACHE", "LMCLI_COMPILE"} <= variables  # the parser sees them
    for variable in variables:
        assert variable in ISOLATION or TURNED_OFF.get(variable) in tests_here, (
            f"tests/conftest.py sets {variable}; add a test with the defaults for it to tests/test_defaults.py "
            "and name it in TURNED_OFF")
    assert os.environ.get("LMCLI_CACHE_DIR")  # this session's isolation, which _env replaces for each run


def test_the_rule_sees_each_way_of_setting_a_variable():
    source = ("import os\nos.environ['LMCLI_A'] = '0'\nos.environ.setdefault('LMCLI_B', '1')\n"
              "os.putenv('LMCLI_C', '1')\nname = 'X'\nos.environ[name] = '1'\n")
    assert _conftest_variables(source) == {"LMCLI_A", "LMCLI_B", "LMCLI_C", "<not a literal: name>"}
