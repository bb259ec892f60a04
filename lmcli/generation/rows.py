"""Prompts -> batches -> one `model.generate` call -> results (text, logprobs, finish reasons).

A single `lmcli generate PROMPT` is a job of one row, so both paths share
`generate_batch`, and a row gives the same result alone or in a batch.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from lmcli.errors import TokenizerError
from lmcli.settings.generation_settings import GenerationSettings, RowError, input_hash

if TYPE_CHECKING:
    import torch

    from lmcli.generation.loop import TokenEvent
    from lmcli.io.tokenizer import Tokenizer


class GeneratingModel(Protocol):
    """What rows need of a model (lmcli.models.base.BaseModel and the encoder-decoders are ones): rows sit
    below the models and know them only through this."""

    config: Any

    @property
    def device(self) -> torch.device: ...

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor: ...


@dataclass
class PreparedRow:
    """A row ready for the model: tokenised, with the seed it will use."""

    id: int | str
    prompt: str | list[dict]  # chat messages for an OpenAI chat request
    settings: GenerationSettings
    prompt_ids: list[int]
    seed: int | None
    input_hash: str
    dropped_tokens: int = 0  # cut from the start of a prompt longer than the context


def fit_to_context(ids: list[int], context: int, settings: GenerationSettings) -> tuple[list[int], int]:
    """A prompt longer than the model's context, cut once before generation so the KV cache is used:
    its start is dropped, leaving room for max_new_tokens (up to half the context). Returns (ids, dropped);
    RowError when settings.truncate is False."""
    if len(ids) <= context:
        return ids, 0
    if not settings.truncate:
        raise RowError(f"the prompt has {len(ids)} tokens but the model's context holds {context} "
                       "(drop --no-truncate to keep its end)")
    keep = context - min(settings.max_new_tokens, context // 2)
    return ids[-keep:], len(ids) - keep


def truncation_warning(row: PreparedRow, context: int) -> str:
    return (f"warning: the prompt has {len(row.prompt_ids) + row.dropped_tokens} tokens but the context holds "
            f"{context}; its first {row.dropped_tokens} tokens were dropped (use --no-truncate to refuse instead)")


def encode_prompt(tokenizer: Tokenizer, prompt: str | list[dict], settings: GenerationSettings) -> list[int]:
    if isinstance(prompt, list):  # the messages of an OpenAI chat request
        return list(tokenizer.encode_chat(prompt, add_generation_prompt=True))
    if not settings.chat:
        return list(tokenizer.encode(prompt))
    messages = [{"role": "system", "content": settings.system}] if settings.system is not None else []
    messages.append({"role": "user", "content": prompt})
    return list(tokenizer.encode_chat(messages, add_generation_prompt=True))


def require_chat_template(tokenizer: Tokenizer) -> None:
    if not tokenizer.chat_template:
        raise TokenizerError("this checkpoint's tokenizer has no chat template, so --chat cannot be used")


def prepare_row(tokenizer: Tokenizer, row_id: int | str, prompt: str | list[dict], settings: GenerationSettings,
                hash_: str | None = None, context: int | None = None,
                prompt_ids: list[int] | None = None) -> PreparedRow:
    """Tokenise a prompt (unless its `prompt_ids` are given), fit it to `context` tokens (fit_to_context)
    and fix its seed; raises RowError for an empty prompt, or one too long with truncation off."""
    ids = encode_prompt(tokenizer, prompt, settings) if prompt_ids is None else prompt_ids
    if not ids:
        raise RowError("the prompt is empty (it encodes to no tokens)")
    ids, dropped = fit_to_context(ids, context, settings) if context is not None else (ids, 0)
    seed = settings.seed
    if seed is None and not settings.greedy:
        seed = secrets.randbelow(2**32)  # recorded in the output, so the row can be reproduced
    return PreparedRow(row_id, prompt, settings, ids, seed, hash_ or input_hash(prompt, settings), dropped)


@dataclass
class RowResult:
    """A row as it generates: its tokens, its text, and why it stopped."""

    row: PreparedRow
    text: Any  # streaming.RowText
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict] | None = None
    finish_reason: str | None = None  # "eos", "length" or "stop"
    error: str | None = None  # the constraint's engine failed on this row (its text is then not valid)
    started: float = 0.0
    first_token_at: float | None = None
    finished_at: float | None = None
    speculation: dict | None = None  # a speculating job row's counts (lmcli.generation.speculative_setup.row_counts)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def to_json(self) -> dict:
        out = {
            "id": self.row.id,
            "prompt": self.row.prompt,
            "completion": self.text.text,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.row.prompt_ids),
            "completion_tokens": len(self.tokens),
            "seed": self.row.seed,
            "settings": self.row.settings.used(),  # what decided the text: flags, row, model or lmcli defaults
        }
        if self.logprobs is not None:
            out["logprobs"] = self.logprobs
        if self.error is not None:
            out["error"] = self.error
        if self.speculation is not None:
            out["speculation"] = self.speculation
        out["input_hash"] = self.row.input_hash
        return out


def plan_batches(rows: list[PreparedRow], batch_size: int) -> Iterator[list[PreparedRow]]:
    """Batches of rows that can share one `generate` call, with little padding to waste."""
    groups: dict[tuple, list[PreparedRow]] = {}
    for row in rows:
        groups.setdefault(row.settings.batch_key(), []).append(row)
    for group in groups.values():
        # Similar max_new_tokens first (finished rows still ride along until the
        # batch ends), then similar prompt lengths (less left padding).
        group.sort(key=lambda r: (r.settings.max_new_tokens, len(r.prompt_ids)))
        for start in range(0, len(group), batch_size):
            yield group[start : start + batch_size]


@dataclass
class BatchPolicy:
    """How a batch's rows choose their tokens: built once per `generate` call from its rows' settings."""

    do_sample: bool
    processors: list  # the whole chain (each row's constraint, penalties, then temperature and truncation)
    stop_at_eos: set[int]
    pad_id: int

    def end_row(self, row: int) -> str | None:
        """Batch row `row` has ended: its processors' per-row state is dropped (sampling.end_row); what
        went wrong with it (a constraint's engine gave up on its text), or None."""
        from lmcli.generation.sampling import end_row

        return end_row(self.processors, row)


def batch_policy(model: GeneratingModel, tokenizer: Tokenizer, rows: list[PreparedRow], width: int) -> BatchPolicy:
    """The policy of rows sharing `batch_key()`, left-padded to `width` prompt tokens."""
    from lmcli.generation.sampling import RowConstraints, SamplingSettings

    settings = rows[0].settings
    eos_ids = tokenizer.eos_token_ids
    stop_at_eos = set() if settings.ignore_eos else set(eos_ids)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos_ids[0] if eos_ids else 0)
    vocab_size = model.config.vocab_size if settings.logit_bias else None
    bias = settings.logit_bias_ids(tokenizer, vocab_size) if vocab_size is not None else {}
    # The whole chain (penalties, then temperature and truncation) is built here, in transformers'
    # order; generate()'s own temperature/top_k/top_p stay neutral.
    # An encoder-decoder's prompt is its encoder's input: the text the processors see, and the one
    # the new tokens continue, is the decoder's (its start token, then what it generates).
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    # Each row's constraint (None: a free row) is the chain's first step, built by the same factory.
    wanted = [r.settings.constraint for r in rows]
    constraints = None
    if any(constraint is not None for constraint in wanted):
        constraints = RowConstraints(tokenizer, wanted, model.config.vocab_size)
    do_sample, processors = SamplingSettings.of(settings, logit_bias=bias).policy(
        prompt_length=1 if encoder_decoder else width,
        pad_counts=[0 if encoder_decoder else width - len(r.prompt_ids) for r in rows],
        eos_token_ids=sorted(stop_at_eos), vocab_size=vocab_size, constraints=constraints,
        rules=settings.model_defaults.rules,
        max_length=(1 if encoder_decoder else width) + max(r.settings.max_new_tokens for r in rows),
    )
    return BatchPolicy(do_sample, processors, stop_at_eos, pad_id)


def new_result(tokenizer: Tokenizer, row: PreparedRow, started: float, encoder_decoder: bool = False) -> RowResult:
    from lmcli.generation.streaming import RowText

    return RowResult(row, RowText(tokenizer, row.settings.stop, () if encoder_decoder else row.prompt_ids),
                     started=started, logprobs=[] if row.settings.logprobs is not None else None)


def take_token(result: RowResult, token: int, stop_at_eos: set[int],
               on_text: Callable[[RowResult, str], None] | None) -> str | None:
    """Add a row's new token; returns why the row stops now ("eos", "stop", "length"), or None."""
    result.tokens.append(token)
    if result.first_token_at is None:
        result.first_token_at = time.perf_counter()
    if token in stop_at_eos:
        return "eos"
    piece = result.text.push(token)
    if piece and on_text:
        on_text(result, piece)
    if result.text.stopped:
        return "stop"
    if len(result.tokens) >= result.row.settings.max_new_tokens:
        return "length"
    return None


def finish_row(result: RowResult, reason: str, on_text: Callable[[RowResult, str], None] | None,
               on_done: Callable[[RowResult], None] | None, error: str | None = None) -> None:
    """End a row: the rest of its text, its finish reason, then `on_done`. `error`: its constraint's engine failed."""
    result.error = error
    piece = result.text.finish()
    if piece and on_text:
        on_text(result, piece)
    result.finish_reason = reason
    result.finished_at = time.perf_counter()
    if on_done:
        on_done(result)


def generate_batch(
    model: GeneratingModel,
    tokenizer: Tokenizer,
    rows: list[PreparedRow],
    *,
    on_text: Callable[[RowResult, str], None] | None = None,
    on_done: Callable[[RowResult], None] | None = None,
    run: Callable[..., Any] | None = None,
    stop: Callable[[], bool] | None = None,
) -> list[RowResult]:
    """Generate every row in one `model.generate` call (rows must share `batch_key()`).

    Rows end on their own: at EOS, at their own stop strings or at their own
    max_new_tokens. `on_text(result, piece)` gets each row's final text as it
    appears; `on_done(result)` is called the step a row finishes. `run` stands
    in for `model.generate` (same arguments): a chat continues its KV cache so.
    Beam rows (num_beams > 1) are searched by `model.generate` on a cache of their
    own, `run` is not called for them (a chat's cache stays as it was), and
    `stop()`, asked before each step, ends their search early (a plain run stops
    through `run`'s on_token instead).
    """
    import torch

    if rows[0].settings.beams > 1:
        return _beam_batch(model, tokenizer, rows, on_text, on_done, stop)
    device = model.device
    width = max(len(r.prompt_ids) for r in rows)
    policy = batch_policy(model, tokenizer, rows, width)
    pad_id, stop_at_eos = policy.pad_id, policy.stop_at_eos
    # Left padding, masked out: generate() gives each row what it gives alone.
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows], device=device)
    attention_mask = None
    if any(len(r.prompt_ids) < width for r in rows):
        attention_mask = torch.tensor(
            [[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows], device=device
        )
    top_logprobs = rows[0].settings.logprobs
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    started = time.perf_counter()
    results = [new_result(tokenizer, r, started, encoder_decoder) for r in rows]

    def finish(row: int, reason: str) -> None:
        error = policy.end_row(row)  # e.g. a constraint's engine gave up on the row (one of its limits)
        finish_row(results[row], reason, on_text, on_done, error)

    def on_token(event: TokenEvent) -> torch.Tensor:
        token_ids = event.token_id.tolist()
        steps = logprob_steps(tokenizer, event, top_logprobs) if top_logprobs is not None else None
        ended = [False] * len(results)
        for i, result in enumerate(results):
            if not result.done:
                if steps is not None and result.logprobs is not None:
                    result.logprobs.append(steps(i))
                reason = take_token(result, token_ids[i], stop_at_eos, on_text)
                if reason is not None:
                    finish(i, reason)
            ended[i] = result.done
        return torch.tensor(ended, device=event.token_id.device)

    from lmcli.kernels import lora

    with lora.routed(lora.routing_for(model, [r.settings.lora for r in rows])):  # each row's adapters
        _run_batch(run or model.generate, input_ids, rows, policy, attention_mask, stop_at_eos, pad_id, on_token)
    for i, result in enumerate(results):
        if not result.done:  # generate stopped before the row's own limit (e.g. the context is full)
            finish(i, "length")
    return results


def _run_batch(generate: Callable[..., Any], input_ids: Any, rows: list[PreparedRow], policy: BatchPolicy,
               attention_mask: Any, stop_at_eos: set[int], pad_id: int, on_token: Callable[..., Any]) -> None:
    generate(
        input_ids,
        max_new_tokens=max(r.settings.max_new_tokens for r in rows),
        do_sample=policy.do_sample,
        attention_mask=attention_mask,
        eos_token_id=sorted(stop_at_eos) or None,
        pad_token_id=pad_id,
        seed=[r.seed for r in rows] if policy.do_sample else None,
        logits_processors=policy.processors,
        on_token=on_token,
        ignore_output=True,  # on_token has seen every token already
    )


def _beam_batch(model: GeneratingModel, tokenizer: Tokenizer, rows: list[PreparedRow],
                on_text: Callable[[RowResult, str], None] | None, on_done: Callable[[RowResult], None] | None,
                stop: Callable[[], bool] | None) -> list[RowResult]:
    """generate_batch() by beam search (generation/beams.py): the best beam of each row, whose text is
    known only at the end, then told to `on_text` token by token as a sampled row's would be. The rows
    share num_beams and max_new_tokens (batch_key), so each gives what it gives alone. `stop`: the
    search's should_stop (then each row is its best running beam so far)."""
    import torch

    settings = rows[0].settings
    k = settings.beams
    width = max(len(r.prompt_ids) for r in rows)
    # The processors see each beam as a row: each row's policy (its padding) once per beam.
    policy = batch_policy(model, tokenizer, [r for r in rows for _ in range(k)], width)
    pad_id, stop_at_eos = policy.pad_id, policy.stop_at_eos
    input_ids = torch.tensor([[pad_id] * (width - len(r.prompt_ids)) + r.prompt_ids for r in rows], device=model.device)
    attention_mask = torch.tensor([[0] * (width - len(r.prompt_ids)) + [1] * len(r.prompt_ids) for r in rows],
                                  device=model.device)
    encoder_decoder = getattr(model.config, "is_encoder_decoder", False)
    started = time.perf_counter()
    results = [new_result(tokenizer, r, started, encoder_decoder) for r in rows]
    from lmcli.kernels import lora

    with lora.routed(lora.routing_for(model, [r.settings.lora for r in rows for _ in range(k)])):
        out = _beam_generate(model, input_ids, settings, attention_mask, stop_at_eos, pad_id, policy, k, stop)
    new_tokens = out[:, 1:] if encoder_decoder else out[:, width:]  # (B, n): after the start token or the prompt
    for result, tokens in zip(results, new_tokens.tolist()):
        reason = "length"
        for token in tokens:
            ended = take_token(result, token, stop_at_eos, on_text)
            if ended is not None:
                reason = ended
                break
        finish_row(result, reason, on_text, on_done)
    return results


def _beam_generate(model: GeneratingModel, input_ids: Any, settings: GenerationSettings, attention_mask: Any,
                   stop_at_eos: set[int], pad_id: int, policy: BatchPolicy, k: int,
                   stop: Callable[[], bool] | None = None) -> Any:
    return model.generate(input_ids, max_new_tokens=settings.max_new_tokens, do_sample=False,
                         attention_mask=attention_mask, eos_token_id=sorted(stop_at_eos) or None, pad_token_id=pad_id,
                         logits_processors=policy.processors, num_beams=k,
                         length_penalty=1.0 if settings.length_penalty is None else settings.length_penalty,
                         early_stopping=bool(settings.early_stopping) if settings.early_stopping != "never" else "never",
                         renormalize_logits=bool(settings.model_defaults.rules.get("renormalize_logits")),
                         **({"should_stop": stop} if stop is not None else {}))


def logprob_steps(tokenizer: Tokenizer, event: TokenEvent, k: int) -> Callable[[int], dict[str, Any]]:
    """Per-row logprob entries for this step, from the raw logits (before temperature)."""
    import torch

    logprobs = torch.log_softmax(event.logits.float(), dim=-1)
    chosen = logprobs.gather(1, event.token_id.view(-1, 1).to(logprobs.device)).view(-1).tolist()
    token_ids = event.token_id.tolist()
    k = min(k, logprobs.shape[-1])
    top = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    top_values, top_ids = top[0].tolist(), top[1].tolist()

    def entry(token_id: int, logprob: float) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "id": token_id, "logprob": round(logprob, 5)}

    def step(i: int) -> dict:
        out = entry(token_ids[i], chosen[i])
        out["top"] = [entry(t, v) for t, v in zip(top_ids[i], top_values[i])]
        return out

    return step
