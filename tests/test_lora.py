"""LoRA adapters (io/lora_files.py, kernels/lora.py) against `peft` on transformers' own models, in float32:
each architecture's logits within 1e-5 and its greedy tokens equal, merged and beside the weights; a
scale; two adapters stacked; rsLoRA; a mixture of experts' experts. On int4 weights the unmerged adapter
against the same adapter on the dequantised weights (F.linear); a batch mixing adapters against each row
alone (generate_batch and the continuous scheduler, greedy and seeded); a GGUF LoRA written with the
`gguf` package (as llama.cpp's converter writes it) against peft; and hostile adapter files."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import pytest
import torch
from cli_fixtures import tiny_checkpoint  # noqa: F401 (fixture)
from real_models import smollm2_gguf  # noqa: F401 (fixture)
from tiny import CASES, VOCAB, build_reference, save_reference

import lmcli
from lmcli.io.lora_files import AdapterError, read_adapter
from lmcli.kernels import lora

peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

TOLERANCE = 1e-5
ATTENTION = ["q_proj", "k_proj", "v_proj", "o_proj"]
TARGETS = {"gpt2": ["c_attn", "c_proj", "c_fc"], "mixtral": ATTENTION}
PARAMETERS = {"mixtral": ["gate_up_proj", "down_proj"]}  # transformers' fused experts: peft's target_parameters
PROMPT = torch.tensor([[5, 9, 17, 3, 44, 21, 8, 60]])


def _targets(case: str) -> list[str]:
    return TARGETS.get(CASES[case][0], [*ATTENTION, "gate_proj", "up_proj", "down_proj"])


def _peft_model(hf, case: str, seed: int, rank: int = 4, alpha: float = 8, name: str = "default", **options):
    """A peft LoRA on `hf` with random A and B (large enough to change the tokens)."""
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=_targets(case),
                             target_parameters=PARAMETERS.get(CASES[case][0]), init_lora_weights=False, **options)
    model = hf if isinstance(hf, peft.PeftModel) else None
    if model is None:
        model = peft.get_peft_model(hf, config, adapter_name=name)
    else:
        model.add_adapter(name, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for key, parameter in model.named_parameters():
            if f".{name}." in f"{key}." and "lora_" in key:
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return model.eval()


def _greedy(model, steps: int = 6) -> list[int]:
    ids = PROMPT
    for _ in range(steps):
        with torch.no_grad():
            logits = model(ids)
        logits = logits.logits if hasattr(logits, "logits") else logits
        ids = torch.cat([ids, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return ids[0, PROMPT.shape[1]:].tolist()


def _logits(model) -> torch.Tensor:
    with torch.no_grad():
        out = model(PROMPT)
    return out.logits if hasattr(out, "logits") else out


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """case -> (directory of the base model, transformers model), saved once per module."""
    models: dict = {}

    def get(case: str):
        if case not in models:
            directory = tmp_path_factory.mktemp(case)
            models[case] = (directory, save_reference(case, directory))
        return models[case]

    return get


PARITY_CASES = ["gpt2", "llama", "mistral", "mixtral", "qwen2", "gemma", "gemma2", "gemma3_text"]


@pytest.mark.parametrize("case", PARITY_CASES)
def test_one_adapter_equals_peft_merged_and_beside(case, saved, tmp_path):
    directory, _ = saved(case)
    reference = _peft_model(build_reference(case), case, seed=1)
    reference.save_pretrained(tmp_path / "adapter")
    want, want_tokens = _logits(reference), _greedy(reference)
    with reference.disable_adapter():
        plain = _logits(reference)
    assert (want - plain).abs().max() > 0.1  # the adapter changes the logits (else the test proves nothing)
    for merge in (True, False):
        model, _ = lmcli.load(directory)
        loaded = lora.attach(model, [str(tmp_path / "adapter")], merge=merge)
        assert loaded is not None and loaded.merged == merge
        assert any(isinstance(m, lora.LoraLinear) for m in model.modules()) != merge
        assert (_logits(model) - want).abs().max() <= TOLERANCE, (case, merge)
        assert _greedy(model) == want_tokens


def test_a_scale_stacked_adapters_and_rslora_equal_peft(saved, tmp_path):
    case = "llama"
    directory, _ = saved(case)
    stacked = _peft_model(build_reference(case), case, seed=2, name="first")
    stacked = _peft_model(stacked, case, seed=3, rank=2, alpha=3, name="second", use_rslora=True)
    stacked.save_pretrained(tmp_path / "both")  # first in both/first, second in both/second
    first, second = tmp_path / "both" / "first", tmp_path / "both" / "second"
    if not first.is_dir():  # peft keeps the first adapter at the top
        first = tmp_path / "both"
    stacked.base_model.set_adapter(["first", "second"])
    want = _logits(stacked)
    model, _ = lmcli.load(directory)
    lora.attach(model, [str(first), str(second)], merge=False)
    assert (_logits(model) - want).abs().max() <= TOLERANCE
    assert _greedy(model) == _greedy(stacked)
    assert "rsLoRA" in " ".join(read_adapter(str(second)).notes)

    # A scale: PATH:0.5 is the adapter's update halved (peft's own scaling halved).
    stacked.base_model.set_adapter("first")
    for module in stacked.modules():
        if isinstance(getattr(module, "scaling", None), dict) and "first" in module.scaling:
            module.scaling["first"] *= 0.5
    want = _logits(stacked)
    for merge in (True, False):
        model, _ = lmcli.load(directory)
        lora.attach(model, [f"{first}:0.5"], merge=merge)
        assert (_logits(model) - want).abs().max() <= TOLERANCE
        assert _greedy(model) == _greedy(stacked)


# --- int4 weights: the adapter beside the kernel ---------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A scratch lmcli cache for the module (kernel plans probed once)."""
    directory = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("LMCLI_CACHE_DIR", str(directory))
        yield directory


def _dequantised(directory):
    """The float model with every weight --quantize int4 quantizes replaced by its dequantised int4 form
    (GroupQuantized, as the load quantizes it): what the int4 kernels multiply by, for F.linear."""
    from lmcli.io.group_quantized import GROUP, GroupQuantized

    twin, _ = lmcli.load(directory)
    with torch.no_grad():
        for module in twin.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)) and module.weight.shape[1] % GROUP == 0:
                module.weight.copy_(GroupQuantized.quantize(module.weight.float(), 4).dequantise(torch.float32))
    return twin


def test_int4_adapter_beside_the_kernel_equals_it_on_dequantised_weights(saved, tmp_path, cache):
    case = "llama"
    directory, _ = saved(case)
    _peft_model(build_reference(case), case, seed=4).save_pretrained(tmp_path / "adapter")
    model, _ = lmcli.load(directory, quantize="int4")
    assert model.batch_invariant
    twin = _dequantised(directory)
    base_gap = (_logits(model) - _logits(twin)).abs().max()  # the int4 kernel against F.linear, no adapter
    lora.attach(model, [str(tmp_path / "adapter")], merge=True)  # int4: never merged, whatever is asked
    assert not model.lora.merged
    bases: list = [m.base for m in model.modules() if isinstance(m, lora.LoraLinear)]
    kernels = [base.kernel.name for base in bases if hasattr(base, "kernel")]
    assert kernels, "the adapter sits beside quantized kernels"
    lora.attach(twin, [str(tmp_path / "adapter")], merge=True)
    assert twin.lora.merged
    gap = (_logits(model) - _logits(twin)).abs().max()
    with torch.no_grad():
        effect = (_logits(twin) - _logits(_dequantised(directory))).abs().max()
    assert gap <= 2 * base_gap + 1e-3, (gap, base_gap)
    assert effect > 20 * gap  # the adapter's own effect dwarfs the kernel's rounding


# --- one adapter per row ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_adapters(tiny_checkpoint, tmp_path_factory):
    import transformers

    directory = tmp_path_factory.mktemp("adapters")
    paths = []
    for i, name in enumerate(["alpha", "beta", "gamma"]):
        hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint)
        _peft_model(hf, "llama", seed=10 + i, rank=2 + 2 * i).save_pretrained(directory / name)
        paths.append(str(directory / name))
    return paths


def _rows(tokenizer, choices, sampled: bool):
    from lmcli.generation.rows import prepare_row
    from lmcli.settings.generation_settings import GenerationSettings

    rows = []
    for i, choice in enumerate(choices):
        fields: dict = {"max_new_tokens": 6 + i, "temperature": 0.9 if sampled else 0, "seed": 7 + i}
        if choice is not None:
            fields["lora"] = choice
        rows.append(prepare_row(tokenizer, i, f"row {i} says hello to", GenerationSettings().for_row(fields)))
    return rows


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded"])
def test_mixed_adapters_in_one_batch_equal_each_row_alone(tiny_checkpoint, three_adapters, sampled, cache):
    from lmcli.generation.continuous import ContinuousRun
    from lmcli.generation.rows import generate_batch

    model, tokenizer = lmcli.load(tiny_checkpoint, quantize="int4")
    lora.attach(model, three_adapters, merge=False)
    choices = ["alpha", "beta", None, "gamma", "none", "beta"]
    rows = _rows(tokenizer, choices, sampled)
    alone = {row.id: generate_batch(model, tokenizer, [row])[0].tokens for row in rows}
    assert len({tuple(alone[i]) for i in (0, 1, 3, 4)}) == 4  # the adapters give different text
    together = {r.row.id: r.tokens for r in generate_batch(model, tokenizer, rows)}
    assert together == alone
    got: dict = {}
    run = ContinuousRun(model, tokenizer, 3, on_done=lambda r: got.setdefault(r.row.id, r.tokens),
                        alone=lambda row: pytest.fail("ran alone"))
    run.run(rows, lambda stranded: pytest.fail(f"failed: {stranded}"))
    assert got == alone
    # One row picking the adapter equals a model loaded with only that adapter (PEFT's own numbers aside).
    only, _ = lmcli.load(tiny_checkpoint, quantize="int4")
    lora.attach(only, [three_adapters[1]], merge=False)
    assert generate_batch(only, tokenizer, _rows(tokenizer, [None], sampled))[0].tokens == \
        generate_batch(model, tokenizer, _rows(tokenizer, ["beta"], sampled))[0].tokens


def test_a_row_naming_an_unknown_adapter_is_that_rows_error(tiny_checkpoint, three_adapters, cache):
    from lmcli.settings.generation_settings import RowError

    model, _ = lmcli.load(tiny_checkpoint)
    lora.attach(model, three_adapters[:1], merge=False)
    with pytest.raises(RowError, match="no adapter named 'delta' is loaded"):
        lora.check_row(model, "delta")
    merged, _ = lmcli.load(tiny_checkpoint)
    lora.attach(merged, three_adapters[:1], merge=True)
    with pytest.raises(RowError, match="merged"):
        lora.check_row(merged, "alpha")


# --- GGUF LoRA -----------------------------------------------------------------------------------------------

_GGUF_KINDS = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
               "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}


def _llama_cpp_permute(weights: torch.Tensor, heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's LlamaModel.permute, applied by convert_lora_to_gguf.py to lora_b of q and k."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def test_gguf_lora_converted_from_peft_gives_peft_logits(saved, tmp_path):
    gguf = pytest.importorskip("gguf")
    from safetensors.torch import load_file

    case = "llama"
    directory, _ = saved(case)
    reference = _peft_model(build_reference(case), case, seed=5, alpha=6)
    reference.save_pretrained(tmp_path / "adapter")
    fields = CASES[case][1]
    writer = gguf.GGUFWriter(str(tmp_path / "adapter.gguf"), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", 6.0)
    for name, tensor in load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")).items():
        parts = name.split(".")  # base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight
        layer, module, which = parts[4], parts[6], parts[7]
        if which == "lora_B" and module in ("q_proj", "k_proj"):
            tensor = _llama_cpp_permute(tensor, fields["num_attention_heads" if module == "q_proj"
                                                       else "num_key_value_heads"])
        suffix = "lora_a" if which == "lora_A" else "lora_b"
        writer.add_tensor(f"blk.{layer}.{_GGUF_KINDS[module]}.weight.{suffix}", tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model, _ = lmcli.load(directory)
    lora.attach(model, [str(tmp_path / "adapter.gguf")], merge=False)
    assert (_logits(model) - _logits(reference)).abs().max() <= TOLERANCE
    adapter = read_adapter(str(tmp_path / "adapter.gguf"))
    assert adapter.kind == "gguf" and adapter.ranks == [4] and len(adapter.targets) == 14


# --- hostile adapters --------------------------------------------------------------------------------------------


def _write_adapter(directory: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 2, "lora_alpha": 4, "target_modules": ["q_proj"], **config}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    return directory


def _q(layer: int = 0, rank: int = 2, inputs: int = 32, outputs: int = 32) -> dict[str, torch.Tensor]:
    prefix = f"base_model.model.model.layers.{layer}.self_attn.q_proj"
    return {f"{prefix}.lora_A.weight": torch.randn(rank, inputs), f"{prefix}.lora_B.weight": torch.randn(outputs, rank)}


def _refused(model_dir: Path, adapter: str, match: str, strict: bool = False) -> str:
    model, _ = lmcli.load(model_dir)
    with pytest.raises(AdapterError, match=match) as caught:
        lora.attach(model, [adapter], merge=False, strict=strict, model_names=[str(model_dir)])
    message = str(caught.value)
    assert "\n" not in message
    return message


def test_hostile_and_wrong_adapters_are_one_line_errors(saved, tmp_path, monkeypatch):
    directory, _ = saved("llama")
    good = _write_adapter(tmp_path / "good", _q())
    model, _ = lmcli.load(directory)
    assert lora.attach(model, [str(good)], merge=False) is not None  # the template itself is fine
    _refused(directory, str(_write_adapter(tmp_path / "shape", _q(inputs=31))), "takes 32 inputs")
    _refused(directory, str(_write_adapter(tmp_path / "rank", _q(rank=3))), "rank 3")
    nan = _q()
    nan["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"][0, 0] = float("nan")
    _refused(directory, str(_write_adapter(tmp_path / "nan", nan)), "NaN")
    head = {"base_model.model.lm_head.lora_A.weight": torch.randn(2, 32),
            "base_model.model.lm_head.lora_B.weight": torch.randn(VOCAB, 2)}
    _refused(directory, str(_write_adapter(tmp_path / "head", head)), "not one lmcli adapts")
    _refused(directory, str(_write_adapter(tmp_path / "layer", _q(layer=7))), "past the model's 2 layers")
    _refused(directory, str(_write_adapter(tmp_path / "dora", _q(), use_dora=True)), "DoRA")
    _refused(directory, str(_write_adapter(tmp_path / "odd", _q(), use_magic=1)), "unknown option 'use_magic'")
    # 10^6 targets: a config listing a million modules is read (bounded); a header with a million tensors is not.
    many = _write_adapter(tmp_path / "many", _q(), target_modules=[f"m{i}" for i in range(10**6)])
    assert lora.attach(lmcli.load(directory)[0], [str(many)], merge=False) is not None
    # A million tensors: their header alone is past what lmcli reads (a sparse file of that size) ...
    million = tmp_path / "million"
    million.mkdir()
    (million / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    claimed = 10**6 * 80  # about 80 bytes of JSON per tensor
    with open(million / "adapter_model.safetensors", "wb") as file:
        file.write(struct.pack("<Q", claimed))
        file.truncate(8 + claimed)
    _refused(directory, str(million), "more than the 16 MiB lmcli reads")
    # ... and more tensors than an adapter holds, in a header that is small enough.
    from lmcli.io import lora_files

    monkeypatch.setattr(lora_files, "MAX_TENSORS", 3)
    _refused(directory, str(_write_adapter(tmp_path / "four", {**_q(0), **_q(1)})), "more than the 3")
    # A header bomb: a length of 2**62 bytes in a small file, and a header past what lmcli reads.
    bomb = tmp_path / "bomb"
    bomb.mkdir()
    (bomb / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    (bomb / "adapter_model.safetensors").write_bytes(struct.pack("<Q", 2**62) + b"{}")
    _refused(directory, str(bomb), "header claims")
    # A symlink out of the directory, and a pickle that is never loaded.
    outside = _write_adapter(tmp_path / "outside", _q())
    linked = tmp_path / "linked"
    linked.mkdir()
    (linked / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    (linked / "adapter_model.safetensors").symlink_to(outside / "adapter_model.safetensors")
    _refused(directory, str(linked), "outside the adapter directory")
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text('{"r": 2, "lora_alpha": 4}')
    (pickled / "adapter_model.bin").write_bytes(b"\x80\x04not loaded")
    _refused(directory, str(pickled), "pickle")
    # A base model named in the config that is not the loaded one: a warning, an error under --strict.
    other = _write_adapter(tmp_path / "other", _q(), base_model_name_or_path="meta-llama/Llama-3.1-70B")
    _refused(directory, str(other), "trained on meta-llama/Llama-3.1-70B", strict=True)
    assert lora.attach(lmcli.load(directory)[0], [str(other)], merge=False, model_names=[str(directory)])


def test_info_describes_an_adapter(saved, tmp_path):
    _peft_model(build_reference("llama"), "llama", seed=6, rank=8).save_pretrained(tmp_path / "adapter")
    facts = dict(lora.describe(read_adapter(f"{tmp_path / 'adapter'}:2")))
    assert facts["rank"] == "8" and "q_proj" in facts["targets"] and "14 modules" in facts["targets"]
    assert facts["scale"].startswith("2 ")  # alpha 8 / r 8, times 2
    parameters = 2 * 2 * (8 * (32 + 32)) + 2 * 2 * (8 * (32 + 16)) + 2 * (8 * (32 + 48)) * 2 + 2 * 8 * (48 + 32)
    assert facts["size"].startswith(f"{parameters:,} parameters")
    assert math.isfinite(read_adapter(str(tmp_path / "adapter")).alpha or 0)


# --- the command line ------------------------------------------------------------------------------------------


def test_generate_jobs_and_info_with_lora(tiny_checkpoint, three_adapters, tmp_path):
    """`generate --lora` gives transformers+peft's greedy tokens; a job's rows pick adapters by name (or none),
    each as `generate --lora` gives it alone; an unknown name is that row's error; `info --lora` describes it."""
    import transformers
    from typer.testing import CliRunner

    from lmcli.cli import app
    from lmcli.io.tokenizer import load_tokenizer

    def cli(*args):
        result = CliRunner().invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, result.output
        return result.stdout

    flags = ["-c", tiny_checkpoint, "--greedy", "-n", "6", "--ignore-eos", "--format", "jsonl"]
    tokenizer = load_tokenizer(tiny_checkpoint)
    assert tokenizer is not None
    prompt = "Hello there"
    ids = torch.tensor([tokenizer.encode(prompt)])
    reference = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tiny_checkpoint),
                                               three_adapters[1]).eval()
    want = reference.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)[0, ids.shape[1]:].tolist()
    alone = {}
    for name, path in [("alpha", three_adapters[0]), ("beta", three_adapters[1]), ("none", None)]:
        row = json.loads(cli("generate", *flags, *(["--lora", path] if path else []), prompt))
        alone[name] = row["completion"]
    assert alone["beta"] == tokenizer.decode(want)
    assert len(set(alone.values())) == 3
    rows = tmp_path / "rows.jsonl"
    rows.write_text("\n".join(json.dumps(r) for r in [{"prompt": prompt, "lora": "alpha"}, {"prompt": prompt, "lora": "beta"},
                                                      {"prompt": prompt, "lora": "none"}, {"prompt": prompt, "lora": "zeta"}]))
    out = tmp_path / "out.jsonl"
    job = CliRunner().invoke(app, ["generate", *map(str, flags[:-2]), "--input", str(rows), "-o", str(out),
                                   "--lora", three_adapters[0], "--lora", three_adapters[1]])
    assert job.exit_code == 1 and "1 of 4 rows failed" in job.output  # the row naming no loaded adapter
    results = [json.loads(line) for line in out.read_text().splitlines()]
    by_lora = {r.get("settings", {}).get("lora"): r for r in results}
    assert by_lora["alpha"]["completion"] == alone["alpha"] and by_lora["beta"]["completion"] == alone["beta"]
    assert by_lora["none"]["completion"] == alone["none"]
    assert "no adapter named 'zeta'" in next(r["error"] for r in results if "error" in r)
    info = cli("info", tiny_checkpoint, "--lora", f"{three_adapters[2]}:0.5")
    assert "rank: 6" in info and "q_proj" in info and "adapter: gamma" in info


@pytest.mark.full
def test_server_requests_pick_adapters(tmp_path, smollm2_gguf):
    """`lmcli serve --lora A --lora B`: a request's "lora" picks one (as a local run with that adapter
    alone gives it), none gives the command's stack, "none" the plain model; an unknown name is a 400."""
    import httpx
    from serve_fixtures import API_KEY, serving

    from lmcli.bench.lora import write_random_adapter
    from lmcli.generation.rows import generate_batch, prepare_row
    from lmcli.resolve.model_ref import resolve_model
    from lmcli.settings.generation_settings import GenerationSettings

    resolved = resolve_model(smollm2_gguf)
    model, tokenizer = lmcli.load(resolved)
    paths = [str(write_random_adapter(tmp_path / name, model.config, rank=4, seed=i)) + ":30"
             for i, name in enumerate(["sea", "sky"])]

    def local(specs, prompt):
        loaded, _ = lmcli.load(resolved)
        lora.attach(loaded, specs, merge=False)
        row = prepare_row(tokenizer, 1, prompt, GenerationSettings(temperature=0, max_new_tokens=12))
        return tokenizer.decode(generate_batch(loaded, tokenizer, [row])[0].tokens)

    prompt = "The ocean is"
    with serving(tmp_path, *[f for p in paths for f in ("--lora", p)]) as served:
        def ask(**more):
            response = httpx.post(f"{served.base_url}/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                                  json={"prompt": prompt, "max_tokens": 12, "temperature": 0, **more}, timeout=120)
            return response.status_code, response.json()

        answers = {name: ask(lora=name) for name in ("sea", "sky", "none")}
        assert all(status == 200 for status, _ in answers.values()), answers
        texts = {name: body["choices"][0]["text"] for name, (_, body) in answers.items()}
        status, error = ask(lora="lake")
    assert status == 400 and "no adapter named 'lake'" in error["error"]["message"]
    assert texts["sea"] == local(paths[:1], prompt) and texts["sky"] == local(paths[1:], prompt)
    assert texts["none"] == local([], prompt)
    assert len(set(texts.values())) == 3


def test_the_prompt_cache_never_gives_one_adapters_keys_to_another(tiny_checkpoint, three_adapters, tmp_path):
    """Quantized weights (where the prompt cache is used) and one prompt cache directory: a run with an
    adapter after a run without it (and a run with another adapter) gives what a cache-off run with that
    adapter gives; the adapters' numbers are in the blocks' key."""
    from typer.testing import CliRunner

    from lmcli.cli import app

    blocks = tmp_path / "prompts"
    prompt = "Hello there, this prompt is long enough to fill more than one block of sixteen tokens in it"
    flags = ["-c", str(tiny_checkpoint), "-q", "int8", "--greedy", "-n", "6", "--ignore-eos", "--format", "jsonl"]

    def completion(*extra):
        result = CliRunner().invoke(app, ["generate", *flags, *map(str, extra), prompt])
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)["completion"]

    plain = completion("--prompt-cache", blocks)
    assert any(blocks.rglob("*.lmpb"))  # the blocks were written
    for path in three_adapters[:2]:
        cached = completion("--prompt-cache", blocks, "--lora", path)
        assert cached == completion("--prompt-cache", "off", "--lora", path)
        assert cached != plain
    assert completion("--prompt-cache", blocks) == plain
    # The same adapter directory trained again (its name, rank and alpha the same, its numbers not).
    import shutil

    from safetensors.torch import load_file, save_file

    again = tmp_path / "again"
    shutil.copytree(three_adapters[0], again)
    first = completion("--prompt-cache", blocks, "--lora", again)
    tensors = load_file(again / "adapter_model.safetensors")
    save_file({name: -t if "lora_B" in name else t for name, t in tensors.items()}, again / "adapter_model.safetensors")
    retrained = completion("--prompt-cache", blocks, "--lora", again)
    assert retrained == completion("--prompt-cache", "off", "--lora", again) and retrained != first


@pytest.mark.parametrize("tables", [torch.float32, torch.bfloat16])
def test_beside_update_row_alone_equals_it_in_any_batch_at_1_and_2_threads(tables, monkeypatch):
    """LoraLinear's update (the C++ one where the library is there): a row alone, the same row in a batch
    of rows with other adapters (and none), at 1 and 2 threads, portable and AVX-512 builds: the same bits;
    and the update equals x·Aᵀ·(scale·B)ᵀ in float64 on the tables it holds."""
    generator = torch.Generator().manual_seed(3)
    k, n, r, count = 96, 200, 16, 3
    a = torch.randn(count + 1, r, k, generator=generator) / k**0.5  # (E + 1, R, K)
    b = torch.randn(count + 1, n, r, generator=generator) * 0.1  # (E + 1, N, R)
    a[count], b[count] = 0, 0
    base = torch.nn.Linear(k, n).to(torch.bfloat16)
    module = lora.LoraLinear(base, a, b, frozenset(range(count)), count, tables=tables)
    x = torch.randn(6, 1, k, generator=generator).to(torch.bfloat16)  # 6 rows, one token each
    choices = torch.tensor([0, 2, -1, 1, 0, 2])  # each row's adapter (-1: none)
    with torch.inference_mode():
        held_a = module.a.float() if module.native is None else module.a.float().transpose(1, 2)  # (E + 1, R, K)
        held_b = module.b_t.float().transpose(1, 2)  # (E + 1, N, R)
        for i, e in enumerate(choices.tolist()):  # against float64 on the tables held
            expected = base(x[i]).double() if e < 0 else \
                base(x[i]).double() + x[i].double() @ held_a[e].double().T @ held_b[e].double().T
            with lora.routed(lora.Routing((e,))):
                assert torch.allclose(module(x[i:i + 1])[0].double(), expected, atol=1e-2, rtol=1e-2)
        outputs = []
        for threads in (1, 2):
            for portable in (False, True):
                monkeypatch.setattr(lora, "_PORTABLE", portable)
                torch.set_num_threads(threads)
                with lora.routed(lora.Routing((choices,))):
                    batch = module(x)  # (6, 1, N)
                for i, e in enumerate(choices.tolist()):
                    with lora.routed(lora.Routing((e,))):
                        assert torch.equal(module(x[i:i + 1])[0], batch[i]), (threads, portable, i)
                outputs.append(batch)
        torch.set_num_threads(1)
        assert all(torch.equal(outputs[0], other) for other in outputs[1:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_stacked_row_alone_equals_it_beside_rows_of_other_adapters(dtype):
    """The command's stack on a row alone (no routing: generate, chat) and the same row beside rows that
    pick one adapter or none (a job's mixed batch): the same bits, the stack's updates summed once."""
    generator = torch.Generator().manual_seed(4)
    k, n, r, count = 64, 48, 8, 3
    a = torch.randn(count + 1, r, k, generator=generator) / k**0.5  # (E + 1, R, K)
    b = torch.randn(count + 1, n, r, generator=generator) * 0.3  # (E + 1, N, R)
    a[count], b[count] = 0, 0
    base = _RowLinear(torch.randn(n, k, generator=generator).to(dtype) / k**0.5)
    module = lora.LoraLinear(base, a, b, frozenset(range(count)), count)
    x = torch.randn(4, 2, k, generator=generator).to(dtype)  # 4 rows, two tokens each
    with torch.inference_mode():
        alone = module(x[:1])  # (1, 2, N): every adapter, stacked
        expected = base(x[:1]).double() + sum(x[:1].double() @ a[e].double().T @ b[e].double().T
                                               for e in range(count))
        assert torch.allclose(alone.double(), expected, atol=3e-2, rtol=1e-2)
        with lora.routed(lora.routing_for(_Loaded(count), [None, "a1", "none", None])):
            batch = module(x)  # (4, 2, N)
        assert torch.equal(batch[0], alone[0])
        assert torch.equal(batch[3], module(x[3:])[0])


class _RowLinear(torch.nn.Module):
    """A projection computed row by row (F.linear's BLAS may block float32 rows by the batch's size)."""

    def __init__(self, weight: torch.Tensor):  # (N, K)
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[..., None, :].float() * self.weight.float()).sum(-1).to(x.dtype)  # (..., N)


class _Loaded:
    """What `routing_for` reads of a model: its loaded adapters' names (a0, a1, ...) and device."""

    def __init__(self, count: int):
        self.lora = lora.LoadedAdapters(names=[f"a{i}" for i in range(count)], merged=False, files=[])
        self.device = torch.device("cpu")
