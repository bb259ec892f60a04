"""lmcli: text generation from open language models, from the command line or from Python.

    import lmcli
    model, tokenizer = lmcli.load("path/to/checkpoint")   # HF dir, .safetensors + model, .gguf, or None
    ids = model.generate(torch.tensor([tokenizer.encode("Hello")]), max_new_tokens=20, do_sample=False)

Importing lmcli is cheap: torch and the model code load on first use of these names, and just before
they do, lmcli chooses torch's thread count and OpenMP wait for the machine (lmcli.threads; settings the
user made win, and a program that imported torch first keeps its own).
"""

import sys
from importlib import import_module
from typing import Any

__version__ = "0.1.0"

_LAZY = {
    "load": ("lmcli.loading", "load"),
    "generate": ("lmcli.generation", "generate"),
    "BaseModel": ("lmcli.generation.models", "GeneratingModel"),  # the decoder with generate(), as loaded
    "ModelConfig": ("lmcli.config", "ModelConfig"),
    "LmcliError": ("lmcli.errors", "LmcliError"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        module, attr = _LAZY[name]
        if "torch" not in sys.modules:  # OpenMP reads its settings once, when torch loads
            from lmcli.threads import configure

            configure()
        return getattr(import_module(module), attr)
    raise AttributeError(f"module 'lmcli' has no attribute {name!r}")
