"""Our GGUF reading of the two real models equals transformers' own, independently of lmcli's model code.

For SmolLM2-135M-Instruct (llama, Q4_1 + Q8_0) and Gemma 3 270M (gemma3, Q4_K/Q5_0/Q6_K/Q8_0): a
transformers model built from our hf_config, with our tensors loaded strictly, gives the logits that
transformers' `from_pretrained(gguf_file=...)` gives; and our config says what transformers derives.
"""

from __future__ import annotations

import math

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("gguf")

from real_models import GEMMA_PROMPT, SMOLLM2_PROMPT, gemma_gguf, model_reference, smollm2_gguf  # noqa: E402,F401

from lmcli.resolve.default_model import load_gguf_cached  # noqa: E402

PROMPTS = {"smollm2": SMOLLM2_PROMPT, "gemma": GEMMA_PROMPT}
SHARED_FIELDS = ["model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                 "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings",
                 "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "rope_parameters"]
GEMMA_FIELDS = ["sliding_window", "layer_types", "query_pre_attn_scalar", "attn_logit_softcapping",
                "final_logit_softcapping", "hidden_activation"]


@pytest.fixture(scope="module", params=["smollm2", "gemma"])
def model_case(request):
    path = request.getfixturevalue(f"{request.param}_gguf")
    return request.param, path, load_gguf_cached(path, torch.float32)


def _transformers_model_from(checkpoint):
    from transformers.initialization import no_init_weights

    config = transformers.AutoConfig.for_model(**checkpoint.hf_config)
    with no_init_weights():  # every weight is about to be overwritten
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager",
                                                              dtype=torch.float32)
    state = dict(checkpoint.tensors)
    if config.tie_word_embeddings:
        # A tied head is the embedding itself: the checkpoint has no lm_head, the module's state_dict lists it.
        assert "lm_head.weight" not in state
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True)
    return model.eval()


# Gemma 3 under `make test-full`: its block types against gguf in test_quant_gguf.py, the real Gemma's
# tokens against transformers in test_real_models.py.
@pytest.mark.parametrize("model_case", ["smollm2", pytest.param("gemma", marks=pytest.mark.full)], indirect=True)
def test_logits_equal_transformers_own_gguf_loading(model_case):
    name, path, checkpoint = model_case
    reference = model_reference(name, path)
    model = _transformers_model_from(checkpoint)
    with torch.no_grad():
        logits = model(torch.tensor([PROMPTS[name]])).logits
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)
    assert logits[0, -1].argmax() == reference["logits"][0, -1].argmax()


def test_config_says_what_transformers_derives(model_case):
    name, path, checkpoint = model_case
    ours = transformers.AutoConfig.for_model(**checkpoint.hf_config).to_dict()
    theirs = model_reference(name, path)["config"]
    fields = SHARED_FIELDS + (GEMMA_FIELDS if name == "gemma" else [])
    for field in fields:
        assert ours.get(field) == theirs.get(field), (field, ours.get(field), theirs.get(field))
    # float32 in the file: we keep its shortest decimal (1e-05), transformers the float's exact value
    assert math.isclose(ours["rms_norm_eps"], theirs["rms_norm_eps"], rel_tol=1e-6)


def test_dequantised_tensors_are_float32_in_hf_layout(model_case):
    _, _, checkpoint = model_case
    config = checkpoint.hf_config
    q = checkpoint.tensors["model.layers.0.self_attn.q_proj.weight"]
    assert q.dtype == torch.float32
    assert q.shape == (config["num_attention_heads"] * config["head_dim"], config["hidden_size"])
    assert "lm_head.weight" not in checkpoint.tensors  # both models tie their head to the embedding


def test_convert_gguf_makes_a_directory_transformers_loads(smollm2_gguf, tmp_path):
    pytest.importorskip("lmcli.io.tokenizer")
    from lmcli.io.gguf import convert_gguf

    out = convert_gguf(smollm2_gguf, tmp_path / "smollm2")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    model = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    with torch.no_grad():
        logits = model(torch.tensor([SMOLLM2_PROMPT])).logits
    reference = model_reference("smollm2", smollm2_gguf)
    torch.testing.assert_close(logits, reference["logits"], atol=1e-4, rtol=0)
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    text = "The capital of France is Paris."
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == text
