"""Generation: the schedulers that decide which rows run (loop.py: plain generate(); continuous.py:
a job's rows in one running batch; speculative*.py: guesses checked in one pass) over the one decoding
step that runs them (step.py), and token choice (sampling.py and its processors, a constraint's mask
among them).

`generate(model, x, ...)` is what `model.generate` does (also `lmcli.generate`): the plain loop, or
speculation when asked for (`prompt_lookup=K`, `draft_model=`). The models never import this layer:
`model.generate` is bound here (models.py: the classes lmcli.loading builds), and everything they share
with it (the slot contract, the numerics record) sits below, in lmcli.models.
"""

from __future__ import annotations

from typing import Any


def generate(model: Any, *args: Any, **kwargs: Any) -> Any:
    """Prompt ids [B, T] (left-padded, with `attention_mask`) -> [B, T + n], under inference mode.

    The signature, its arguments and errors are `lmcli.generation.loop.generate`'s; `prompt_lookup=K`
    decodes speculatively by prompt lookup, guessing up to K tokens a pass, and `draft_model=` (a model
    with the same tokenizer, `num_draft_tokens=` its K) with a draft: the same greedy tokens, or the same
    sampling distribution (`lmcli.generation.speculative.generate`, which also takes `stats=`).
    `num_beams=N` (N > 1) searches with N beams, as transformers' beam search (`lmcli.generation.beams`:
    `length_penalty`, `early_stopping`, `num_return_sequences`, `output_scores`).
    """
    import torch

    with torch.inference_mode():
        if kwargs.get("num_beams", 1) != 1 or "num_return_sequences" in kwargs:
            from lmcli.generation import beams

            if kwargs.pop("prompt_lookup", None) is not None or kwargs.pop("draft_model", None) is not None:
                raise ValueError("beam search (num_beams > 1) does not speculate: no prompt_lookup or draft_model")
            return beams.from_generate_call(model, args, kwargs)
        for key in ("num_beams", "length_penalty", "early_stopping", "renormalize_logits"):  # one beam: the plain loop
            kwargs.pop(key, None)
        lookup = kwargs.pop("prompt_lookup", None)
        if lookup is not None or kwargs.get("draft_model") is not None:
            from lmcli.generation import speculative

            if lookup is not None:
                if kwargs.get("draft_model") is not None or "num_draft_tokens" in kwargs:
                    raise ValueError("prompt_lookup=K is its own num_draft_tokens and takes no draft_model")
                kwargs["num_draft_tokens"] = lookup
            return speculative.generate(model, *args, **kwargs)
        from lmcli.generation import loop

        kwargs.pop("draft_model", None)
        return loop.generate(model, *args, **kwargs)
