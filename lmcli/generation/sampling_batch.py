"""Token choice for many rows at once (continuous.py's batch), each row's token exactly the one its own
chain and sampler choose for it alone.

Most job rows choose plainly: greedy with no processor, or a draw from the row's own random stream
after a temperature and a top-p at most. Their choices are made together: one argmax over the greedy
rows; for the sampled rows, each row's own Temperature on its logits, one sort of the values of all
the top-p rows and one softmax and cumulative sum over them, then `sample` over all of them with
each row's own generator (one draw per row, as alone). On torch's CPU kernels an argmax, softmax,
cumulative sum or search along a row computes that row the same way whatever other rows the call
holds, and a sort's values do not depend on its order among ties; where ties straddle a row's top-p
cut (which of them go then depends on torch.sort's order) torch.sort's order decides, as in TopP.
A row with anything else (penalties, min-p, a constraint, ...) is not plain: it chooses alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lmcli.generation.sampling import ProcessorChain, Temperature, TopP, row_generators, sample


@dataclass(frozen=True)
class PlainChoice:
    """How a plain row chooses: `generators` None is greedy; else its temperatures (generate()'s own, then
    the row's) and its top-p, if any."""

    temperatures: tuple[Temperature, ...] = ()
    top_p: TopP | None = None
    generators: Sequence[torch.Generator] | None = None


def row_sampler(do_sample: bool, chain: ProcessorChain, seed: Any,
                device: torch.device) -> tuple[Callable[[torch.Tensor], torch.Tensor], PlainChoice | None]:
    """A one-row sampler (scores [1, V] -> token [1]), as sampling.make_sampler makes it, and the row's
    PlainChoice sharing its random stream (None: the row is not plain)."""
    if not do_sample:
        plain = PlainChoice() if not chain.processors else None
        return lambda scores: scores.argmax(dim=-1), plain
    generators = row_generators([seed], 1, device)
    processors = list(chain.processors)
    top_p = processors.pop() if processors and type(processors[-1]) is TopP else None
    plain = None
    if device.type == "cpu" and all(type(p) is Temperature for p in processors):
        plain = PlainChoice(tuple(processors), top_p, generators)  # type: ignore[arg-type]
    return lambda scores: sample(scores, generators), plain


def choose_plain(logits: torch.Tensor, rows: Mapping[int, PlainChoice]) -> dict[int, int]:
    """logits [B, V] float32 and the plain rows by index -> each one's token."""
    tokens: dict[int, int] = {}
    greedy = [b for b, plain in rows.items() if plain.generators is None]
    if greedy:
        tokens.update(zip(greedy, logits[greedy].argmax(dim=-1).tolist()))
    sampled = [b for b, plain in rows.items() if plain.generators is not None]
    if not sampled:
        return tokens
    empty = logits[:1, :0]
    scaled = []
    for b in sampled:
        row = logits[b:b + 1]
        for temperature in rows[b].temperatures:  # in the chain's order, each on the row alone
            row = temperature(empty, row)
        scaled.append(row)
    scores = torch.cat(scaled)  # (k, V)
    cut = [i for i, b in enumerate(sampled) if rows[b].top_p is not None]
    if cut:
        drop = _top_p_drop(scores[cut], [rows[sampled[i]].top_p for i in cut])  # type: ignore[misc]
        scores[cut] = scores[cut].masked_fill(drop, float("-inf"))
    generators = [rows[b].generators[0] for b in sampled]  # type: ignore[index]
    tokens.update(zip(sampled, sample(scores, generators).tolist()))
    return tokens


def _top_p_drop(logits: torch.Tensor, cuts: list[TopP]) -> torch.Tensor:
    """Which tokens each row's TopP drops, logits [k, V] -> [k, V] bool: TopP._drop_by_values for all rows
    at once, each row with its own p (its float32 rounding, as TopP compares), and where ties straddle
    a row's cut, torch.sort's order, as TopP's own fallback."""
    values = torch.from_numpy(np.sort(logits.contiguous().numpy(), axis=-1))  # (k, V) ascending
    keep = torch.tensor([1 - cut.top_p for cut in cuts], dtype=torch.float32)[:, None]  # (k, 1)
    dropped_sorted = values.softmax(dim=-1).cumsum(dim=-1) <= keep
    dropped_sorted[:, -1] = False  # never the best
    drop = torch.zeros_like(logits, dtype=torch.bool)
    tied = []
    for row, count in enumerate(dropped_sorted.sum(dim=-1).tolist()):
        if count == 0:
            continue
        last = values[row, count - 1]
        if int(np.searchsorted(values[row].numpy(), last.item(), side="right")) != count:
            tied.append(row)
            continue
        drop[row] = logits[row] <= last
    if tied:
        # Ties at the cut: which of them go is torch.sort's order, as TopP then takes it (its values are
        # these values, so its mask in sorted order is this row's). One call sorts each row by itself,
        # as alone, the rows spread over torch's threads.
        order = torch.sort(logits[tied], dim=-1).indices  # (t, V)
        drop[tied] = dropped_sorted[tied].scatter(-1, order, dropped_sorted[tied])
    return drop
