"""One engine of `lmcli bench`, in its own process: loads it, then serves measurement requests.

The parent (lmcli/bench/main.py) starts `python -m lmcli.bench.worker SPEC_JSON`, writes one JSON request per
line to stdin and reads one JSON reply per line from stdout. Whatever the engine itself prints (Python
or C) is sent to stderr, which the parent keeps and shows if the worker fails.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any, cast

from lmcli import threads
from lmcli.bench.measure import decode_rate, mean_kl_divergence
from lmcli.bench.synthetic import QUALITY_TEXT

threads.configure()  # this worker's own choice, before torch loads (as the CLI makes it); lmcli's follows the load
import torch  # noqa: E402 - after the thread settings: OpenMP reads them when torch loads

PROMPT_SEED = 0


class Unsupported(Exception):
    """This engine cannot do this piece of work (the reply says why; the table shows n/a)."""


def _prompt(vocab_size: int, batch: int, length: int) -> torch.Tensor:
    """The same random prompt ids [batch, length] in every worker (ids >= 3: clear of pad, bos and eos)."""
    generator = torch.Generator().manual_seed(PROMPT_SEED + 1000 * batch + length)
    return torch.randint(3, vocab_size, (batch, length), generator=generator)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def weight_kernels(model: Any) -> dict[str, Any]:
    """How the model's weights are stored and multiplied: weights per stored form, and for each quantized
    format the kernel kernels/plan.py chose on this machine and why (its measurement)."""
    formats = model.weight_formats() if hasattr(model, "weight_formats") else {}
    choices = getattr(model, "kernel_choices", None) or {}
    return {"weights": formats, "why": {kind: choice.describe() for kind, choice in choices.items()}}


class LmcliEngine:
    def __init__(self, spec: dict[str, Any]):
        import inspect

        import lmcli
        from lmcli.loading import resolve_device

        self.device = resolve_device(spec["device"])
        kwargs: dict[str, Any] = {}
        fmt = spec["format"]
        accepts_quantize = "quantize" in inspect.signature(lmcli.load).parameters
        if accepts_quantize:
            kwargs["quantize"] = {"float": "none", "native": None}.get(fmt, fmt)
        elif fmt not in ("float", "native"):
            raise Unsupported("this lmcli has no quantize= in lmcli.load")
        dtype = spec["dtype"] if fmt == "float" else "auto"
        self.model, self.tokenizer = lmcli.load(spec["checkpoint"], model=spec["model"], dtype=dtype,
                                                device=self.device, **kwargs)
        self.vocab_size = self.model.config.vocab_size

    def facts(self) -> dict[str, Any]:
        return {"activation_dtype": str(self.model.dtype).removeprefix("torch."),
                "kernels": weight_kernels(self.model)}

    def generate(self, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
        stamps: list[float] = []

        def stamp(_event) -> None:
            _sync(self.device)
            stamps.append(time.perf_counter())

        start = time.perf_counter()
        out = self.model.generate(prompt.to(self.device), new_tokens, False, on_token=stamp)
        return [s - start for s in stamps], out[:, prompt.shape[1]:].cpu()

    def threads_now(self) -> int:
        return torch.get_num_threads()

    def encode(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise Unsupported("the checkpoint has no tokenizer")
        return self.tokenizer.encode(text)

    def logprobs(self, ids: list[int]) -> torch.Tensor:
        logits = self.model(torch.tensor([ids], device=self.device))[0]  # [T, vocab]
        return torch.log_softmax(logits.float(), -1).cpu()


class TransformersEngine:
    def __init__(self, spec: dict[str, Any]):
        import transformers

        from lmcli.loading import resolve_device, resolve_dtype

        transformers.logging.set_verbosity_error()
        self.device = resolve_device(spec["device"])
        dtype = resolve_dtype(spec["dtype"], self.device)
        path = Path(spec["checkpoint"])
        kwargs: dict[str, Any] = {}
        if path.suffix == ".gguf":
            directory = spec.get("converted")
            if directory is None:  # transformers' own GGUF reader: slow (a minute or more), same weights
                directory, kwargs = path.parent, {"gguf_file": path.name}
        elif path.is_dir():
            directory = path
        else:
            raise Unsupported("transformers needs an HF directory or a .gguf file")
        self.model: Any = cast(Any, transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, **kwargs))
        self.model.generation_config.eos_token_id = None  # always generate the full length, as lmcli is asked to
        self.model = self.model.to(self.device).eval()
        self.vocab_size = self.model.config.get_text_config().vocab_size

    def facts(self) -> dict[str, Any]:
        weights = sum(p.numel() for p in self.model.parameters())
        dtype = str(self.model.dtype).removeprefix("torch.")
        return {"activation_dtype": dtype, "kernels": {"weights": {f"{dtype} nn.Linear": weights}, "why": {}}}

    def generate(self, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
        from transformers import StoppingCriteria

        stamps: list[float] = []
        device = self.device

        class Stamp(StoppingCriteria):
            def __call__(self, input_ids, scores, **kwargs):  # called once per generated token
                _sync(device)
                stamps.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        prompt = prompt.to(device)
        start = time.perf_counter()
        out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                  min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                  stopping_criteria=[Stamp()])
        return [s - start for s in stamps], out[:, prompt.shape[1]:].cpu()

    def threads_now(self) -> int:
        return torch.get_num_threads()


class LlamaCppEngine:
    def __init__(self, spec: dict[str, Any]):
        try:
            import llama_cpp
        except ImportError as exc:
            raise Unsupported(f"llama-cpp-python is not importable ({exc}); see `make bench-deps`") from None
        if not spec["checkpoint"].endswith(".gguf"):
            raise Unsupported("llama.cpp reads GGUF files only")
        self.lib = llama_cpp
        # Default: every CPU of ours, llama.cpp's own count when asked for all cores (its Python binding's
        # default, half the CPUs, would be 1 thread here), so the comparison is not with a choice of lmcli's.
        self.threads = spec["threads"] or len(os.sched_getaffinity(0))
        self.llm = llama_cpp.Llama(model_path=spec["checkpoint"], n_ctx=spec["context"], n_batch=512,
                                   n_threads=self.threads, n_threads_batch=self.threads, n_gpu_layers=0,
                                   verbose=False)
        self.vocab_size = self.llm.n_vocab()

    def facts(self) -> dict[str, Any]:
        return {"activation_dtype": "llama.cpp", "threads": self.threads,
                "kernels": {"weights": {}, "why": {}}, "version": self.lib.__version__}

    def threads_now(self) -> int:
        return self.threads

    def generate(self, prompt: torch.Tensor, new_tokens: int) -> tuple[list[float], torch.Tensor]:
        import numpy as np

        if prompt.shape[0] != 1:
            raise Unsupported("llama-cpp-python's Llama decodes one sequence at a time")
        tokens = prompt[0].tolist()
        stamps, generated = [], []
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(tokens)
        for step in range(new_tokens):
            token = int(np.argmax(self.llm.scores[self.llm.n_tokens - 1]))
            stamps.append(time.perf_counter() - start)
            generated.append(token)
            if step + 1 < new_tokens:
                self.llm.eval([token])
        return stamps, torch.tensor([generated])


def _make_engine(spec: dict[str, Any]):
    return {"lmcli": LmcliEngine, "transformers": TransformersEngine, "llama.cpp": LlamaCppEngine}[spec["engine"]](spec)


def _peak_rss() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _handle(engine, request: dict[str, Any]) -> dict[str, Any]:
    op = request["op"]
    if op == "generate":
        prompt = _prompt(engine.vocab_size, request["batch"], request["context"])
        stamps, tokens = engine.generate(prompt, request["new"])
        reply: dict[str, Any] = {"ttft_s": stamps[0], "decode_tokens_per_s": decode_rate(stamps, request["batch"]),
                                 "threads": engine.threads_now()}  # at the end: lmcli's count follows the load
        if request.get("tokens"):
            reply["tokens"] = tokens.tolist()
        return reply
    if op == "peak_rss":
        return {"peak_rss_bytes": _peak_rss()}
    if op == "greedy":
        continuations = []
        for text in request["texts"]:
            ids = engine.encode(text)
            _, tokens = engine.generate(torch.tensor([ids]), request["new"])
            continuations.append(tokens[0].tolist())
        return {"continuations": continuations}
    if op == "logprobs":  # the float32 reference: kept in a file, not sent through the pipe (T x vocab floats)
        from safetensors.torch import save_file

        ids = _fixed_text_ids(engine, request["tokens"])
        save_file({"logprobs": engine.logprobs(ids).contiguous()}, request["path"])
        return {"tokens": len(ids)}
    if op == "kl":
        from safetensors.torch import load_file

        reference = load_file(request["path"])["logprobs"]
        ids = _fixed_text_ids(engine, request["tokens"])
        return {"mean_kl": mean_kl_divergence(reference, engine.logprobs(ids))}
    raise ValueError(f"unknown request {op!r}")


def _fixed_text_ids(engine, count: int) -> list[int]:
    ids = engine.encode(QUALITY_TEXT)
    while len(ids) < count:  # a tokenizer with long pieces: repeat the text
        ids = ids + ids
    return ids[:count]


def worker_main(spec_json: str) -> None:
    """Serve requests for one engine until stdin closes (see the module docstring)."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the engine prints (Python or C) goes to stderr, not into the protocol
    sys.stdout = sys.stderr
    spec = json.loads(spec_json)
    if spec["threads"] is not None:  # --threads: fixed (else this worker's own choice, made above)
        threads.configure(spec["threads"])

    def send(message: dict[str, Any]) -> None:
        replies.write(json.dumps(message) + "\n")

    started = time.perf_counter()
    try:
        engine = _make_engine(spec)
    except Unsupported as exc:
        send({"unsupported": str(exc)})
        return
    except Exception as exc:  # reported to the parent, which shows it in the table
        send({"error": f"{type(exc).__name__}: {exc}"})
        return
    send({"ready": True, "load_s": time.perf_counter() - started, "peak_rss_after_load_bytes": _peak_rss(),
          **engine.facts()})
    with torch.inference_mode():
        for line in sys.stdin:
            request = json.loads(line)
            try:
                send(_handle(engine, request))
            except Unsupported as exc:
                send({"unsupported": str(exc)})
            except Exception as exc:  # one failed measurement should not end the run
                send({"error": f"{type(exc).__name__}: {exc}"})


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m lmcli.bench.worker SPEC_JSON (internal: run `lmcli bench` instead)")
    worker_main(sys.argv[1])
