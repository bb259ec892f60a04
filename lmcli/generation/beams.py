"""Beam search: a scheduler beside the plain loop (loop.py), on the same decoding step (step.py).

It follows transformers' `_beam_search` (generation/utils.py, 4.5x) step for step, since published
outputs of translation and summarisation models come from it:

- the prompt runs once per input, its cache rows are then repeated once per beam (`select_rows`);
  an encoder-decoder's encoder ran once per input before this (its `DecoderRun` holds the output);
- each step is one forward pass over all beams of all inputs [B*K rows]; the logits become
  log-softmax scores, the processors run on those, and each beam's running score is added;
- per input, the best `2K` (more with several EOS tokens) continuations over all K beams x V tokens are
  kept; those that hit EOS or the length limit are finished hypotheses, scored `sum / length**length_penalty`
  and kept as the best K; the best K others run on, and the cache's rows follow them (`select_rows`);
- the search stops as transformers' does: `early_stopping=True` once K hypotheses are finished,
  False when the heuristic says no running beam can still beat the worst finished one at its current
  length, "never" with the best length the penalty allows;
- the output is the best `num_return_sequences` hypotheses per input, [B * R, prompt + n], padded
  after their EOS with `pad_token_id` (else the first EOS), and with `output_scores` their scores [B * R].

Rows of different inputs never mix: every choice is made within an input's K beams, so a padded row
gives what it gives alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from lmcli import threads
from lmcli.config import eos_id_list
from lmcli.generation.loop import _validate_inputs
from lmcli.generation.sampling import LogitsProcessor, ProcessorChain
from lmcli.generation.step import Step
from lmcli.models.slots import SlotModel, positions_from_mask

NEG = -1.0e9  # transformers' "never chosen" score


def check_beam_settings(num_beams: Any, length_penalty: Any, early_stopping: Any, num_return_sequences: Any) -> None:
    """ValueError unless the beam settings are what transformers accepts."""
    if isinstance(num_beams, bool) or not isinstance(num_beams, int) or num_beams < 1:
        raise ValueError(f"num_beams must be an integer >= 1, got {num_beams!r}")
    if isinstance(length_penalty, bool) or not isinstance(length_penalty, (int, float)):
        raise ValueError(f"length_penalty must be a number, got {length_penalty!r}")
    if early_stopping not in (True, False, "never"):
        raise ValueError(f"early_stopping must be True, False or 'never', got {early_stopping!r}")
    if (isinstance(num_return_sequences, bool) or not isinstance(num_return_sequences, int)
            or not 1 <= num_return_sequences <= num_beams):
        raise ValueError(f"num_return_sequences must be an integer in [1, num_beams={num_beams}], "
                         f"got {num_return_sequences!r}")


class _Banned:
    """Tokens that are never chosen: -inf in the scores."""

    needs_history = False

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        scores[:, self.token_ids] = float("-inf")
        return scores


def _gather(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """tensor [B, K, ...] -> [B, J, ...] at beams index [B, J] (transformers' _gather_beams)."""
    while index.dim() < tensor.dim():
        index = index.unsqueeze(-1)
    return torch.take_along_dim(tensor, index, dim=1)


def generate(model: SlotModel[Any], x: torch.Tensor, max_new_tokens: int, num_beams: int, *,
             attention_mask: torch.Tensor | None = None, eos_token_id: Any = None, pad_token_id: int | None = None,
             length_penalty: float = 1.0, early_stopping: bool | str = False, num_return_sequences: int = 1,
             logits_processors: Sequence[LogitsProcessor] | None = None, use_cache: bool = True,
             output_scores: bool = False, renormalize_logits: bool = False,
             should_stop: Callable[[], bool] | None = None) -> Any:
    """Prompt ids [B, T] (left-padded, with `attention_mask`) -> the best `num_return_sequences` beams
    per input [B * R, T + n] (an input's R rows together, best first); with `output_scores`, also
    their scores [B * R] float (transformers' `sequences_scores`). `renormalize_logits`: the scores are
    log-softmaxed again after the processors (transformers' LogitNormalization, always its last processor),
    so a banned or forced token's mass is shared out before the beams' sums. `should_stop()` is asked
    before each step (a chat's Ctrl-C); once it says True the search ends and gives each input's best
    running beams so far (no hypothesis is complete then), scored as if they ended there."""
    mask = _validate_inputs(x, max_new_tokens, attention_mask)
    check_beam_settings(num_beams, length_penalty, early_stopping, num_return_sequences)
    processors = list(logits_processors or [])
    banned = list(getattr(model.config, "suppressed_token_ids", None) or [])
    if banned and getattr(model, "suppress_in_logits", False):
        # An encoder-decoder's config.json bad_words_ids: transformers bans them in the log-softmax scores
        # (NoBadWordsLogitsProcessor), which differs from banning them in the logits once scores are summed.
        model.suppress_in_logits = False  # type: ignore[attr-defined]
        processors.insert(0, _Banned(banned))
    chain = ProcessorChain(processors)
    eos = eos_id_list(eos_token_id)
    fill = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    device = model.device
    batch, prompt_len = x.shape
    k = num_beams
    max_length = prompt_len + max_new_tokens
    keep = max(2, 1 + len(eos)) * k  # continuations looked at per input: enough that K never all end
    top_k_mask = torch.arange(keep, device=device) < k  # (2K,): only the first K may become hypotheses

    # Running beams and finished hypotheses, both [B, K, L]; a running beam's score is its log-prob sum.
    running = torch.full((batch, k, max_length), fill, dtype=torch.long, device=device)
    running[:, :, :prompt_len] = x.to(device)[:, None]
    finished_ids = running.clone()
    running_scores = torch.zeros((batch, k), device=device)
    running_scores[:, 1:] = NEG  # only the first beam's continuations at the first step (all beams are equal)
    scores = torch.full((batch, k), NEG, device=device)  # a hypothesis's length-penalised score
    lengths = torch.zeros((batch, k), dtype=torch.long, device=device)  # a hypothesis's new tokens
    done = torch.zeros((batch, k), dtype=torch.bool, device=device)  # a hypothesis is held there
    improvable = torch.ones((batch, 1), dtype=torch.bool, device=device)
    slot_is_token = torch.ones((batch * k, max_length), dtype=torch.bool, device=device)  # (B*K, L)
    slot_is_token[:, :prompt_len] = mask.to(device).repeat_interleave(k, dim=0)
    # Processors see each row's pads as its first token, as in the plain loop (loop.py).
    first_token = running[:, 0, :prompt_len].gather(1, (~mask.to(device)).sum(-1, keepdim=True)).repeat_interleave(k, 0)
    eos_tensor = torch.tensor(eos, dtype=torch.long, device=device)

    step_ = Step.of(model)
    max_positions = model.config.max_position_embeddings
    cache = model.init_cache(batch, min(max_length, max_positions)) if use_cache else None
    group_offset = torch.arange(batch, device=device)[:, None] * k  # (B, 1): an input's first row
    cur_len = prompt_len
    stopped = False
    for step in range(max_new_tokens):
        if should_stop is not None and should_stop():
            stopped = True
            break
        threads.recheck(fresh=step == 0)
        flat = running[:, :, :cur_len].reshape(batch * k, cur_len)  # (B*K, cur_len)
        if step == 0:
            # The prompt once per input, then its rows repeated per beam.
            rows = torch.arange(batch, device=device).repeat_interleave(k)  # (B*K,)
            start = max(0, cur_len - max_positions)
            ids, is_token = x.to(device)[:, start:], mask.to(device)[:, start:]
            positions = positions_from_mask(is_token)
            if cache is not None and cur_len <= max_positions:
                logits = step_.prefill(ids, positions, torch.arange(cur_len, device=device),
                                       slot_is_token[::k], cache)
                cache.select_rows(rows)
            else:
                cache = None
                logits = step_.decode(ids, positions, torch.arange(cur_len - start, device=device), is_token, None)
            if hasattr(model, "select_rows"):
                model.select_rows(rows)  # an encoder-decoder's encoder output, per beam
            logits = logits.index_select(0, rows)  # (B*K, V)
        elif cache is not None and cur_len <= max_positions:
            positions = positions_from_mask(slot_is_token[:, :cur_len])[:, -1:]
            logits = step_.decode(flat[:, -1:], positions, torch.arange(cur_len - 1, cur_len, device=device),
                                  slot_is_token, cache)
        else:
            cache = None  # past max_position_embeddings: the last window, recomputed (as loop.py)
            start = max(0, cur_len - max_positions)
            window = slot_is_token[:, start:cur_len]
            logits = step_.decode(flat[:, start:], positions_from_mask(window),
                                  torch.arange(cur_len - start, device=device), window, None)
        log_probs = torch.log_softmax(logits.float(), dim=-1)  # (B*K, V)
        if chain:
            context = torch.where(slot_is_token[:, :cur_len], flat, first_token)  # (B*K, cur_len)
            log_probs = chain(context, log_probs)
        if renormalize_logits:
            log_probs = torch.log_softmax(log_probs, dim=-1)  # (B*K, V)
        vocab = log_probs.shape[-1]
        totals = (log_probs.view(batch, k, vocab) + running_scores[:, :, None]).view(batch, k * vocab)

        # The best `keep` continuations of each input over all its beams.
        top_scores, top_index = torch.topk(totals, keep)  # (B, 2K)
        source = torch.div(top_index, vocab, rounding_mode="floor")  # (B, 2K): the beam each extends
        top_ids = _gather(running, source)  # (B, 2K, L)
        top_ids[:, :, cur_len] = top_index % vocab
        ends = torch.full_like(top_scores, cur_len + 1 >= max_length, dtype=torch.bool)
        if eos:
            ends |= torch.isin(top_ids[:, :, cur_len], eos_tensor)  # (B, 2K)

        # The best K that did not end run on; the cache's rows follow them.
        alive_scores = top_scores + ends.float() * NEG
        next_beams = torch.topk(alive_scores, k)[1]  # (B, K)
        running = _gather(top_ids, next_beams)
        running_scores = _gather(alive_scores, next_beams)
        beam_rows = (_gather(source, next_beams) + group_offset).view(-1)  # (B*K,)

        # Those of the first K that ended become hypotheses, if they beat the held ones.
        new_done = ends & top_k_mask[None, :]
        penalised = top_scores / float(cur_len + 1 - prompt_len) ** length_penalty
        full = done.all(dim=-1, keepdim=True) & (early_stopping is True)
        penalised = penalised + full.float() * NEG + (~improvable).float() * NEG + (~new_done).float() * NEG
        merged_scores = torch.cat((scores, penalised), dim=1)  # (B, 3K)
        best = torch.topk(merged_scores, k)[1]  # (B, K)
        finished_ids = _gather(torch.cat((finished_ids, top_ids), dim=1), best)
        scores = _gather(merged_scores, best)
        new_lengths = torch.full_like(top_scores, cur_len + 1 - prompt_len, dtype=torch.long)
        lengths = _gather(torch.cat((lengths, new_lengths), dim=1), best)
        done = _gather(torch.cat((done, new_done), dim=1), best)

        if cache is not None:
            cache.select_rows(beam_rows)
        # (A cacheless encoder-decoder's rows need no reorder: a beam stays in its input's group, whose rows are equal.)
        cur_len += 1

        # Can a running beam still beat the worst hypothesis held? (transformers' heuristic)
        if early_stopping == "never" and length_penalty > 0.0:
            best_length = max_length - prompt_len
        else:
            best_length = cur_len - prompt_len
        best_possible = running_scores[:, :1] / float(best_length) ** length_penalty
        worst = torch.where(done, scores.min(dim=1, keepdim=True)[0], torch.tensor(NEG, device=device))
        improvable = improvable & (best_possible > worst).any(dim=-1, keepdim=True)
        all_held = bool(done.all()) and early_stopping is True
        if not bool(improvable.any()) or all_held or bool(ends.all()):
            break

    r = num_return_sequences
    if stopped:  # the running beams, best first (topk's order), instead of the finished ones
        finished_ids, scores = running, running_scores / float(max(1, cur_len - prompt_len)) ** length_penalty
        lengths = torch.full_like(lengths, cur_len - prompt_len)
    out_lengths = lengths[:, :r].reshape(-1)
    width = prompt_len + int(out_lengths.max()) if out_lengths.numel() else prompt_len
    out = finished_ids[:, :r, :width].reshape(batch * r, width)
    if output_scores:
        return out, scores[:, :r].reshape(-1)
    return out


BEAM_KEYWORDS = ("num_beams", "length_penalty", "early_stopping", "num_return_sequences", "output_scores",
                 "renormalize_logits", "should_stop")


def from_generate_call(model: SlotModel[Any], args: tuple, kwargs: dict[str, Any]) -> Any:
    """`model.generate(x, max_new_tokens, do_sample, ..., num_beams=N, ...)` with N > 1: generate()'s
    arguments (loop.generate's signature) bound and checked, then beam search. Sampling, speculation,
    streaming hooks and ignore_output are ValueErrors: beam search does none of them."""
    import inspect

    from lmcli.generation import loop

    beam = {key: kwargs.pop(key) for key in BEAM_KEYWORDS if key in kwargs}
    bound = inspect.signature(loop.generate).bind(model, *args, **kwargs)
    bound.apply_defaults()
    call = bound.arguments
    for name, allowed in (("do_sample", False), ("on_token", None), ("ignore_output", False)):
        if call[name] not in (allowed,):
            raise ValueError(f"beam search (num_beams > 1) takes no {name}={call[name]!r}")
    if call["temperature"] != 1.0 or call["top_k"] is not None or call["top_p"] is not None:
        raise ValueError("beam search (num_beams > 1) takes no temperature, top_k or top_p: it does not sample")
    return generate(model, call["x"], call["max_new_tokens"], beam.pop("num_beams"),
                    attention_mask=call["attention_mask"], eos_token_id=call["eos_token_id"],
                    pad_token_id=call["pad_token_id"], logits_processors=call["logits_processors"],
                    use_cache=call["use_cache"], **beam)
