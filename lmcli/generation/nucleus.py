"""Top-p (nucleus) truncation, exactly as transformers' TopPLogitsWarper computes it, at a fraction of its
cost on a CPU row.

The reference sorts the row ascending, takes the softmax of the sorted row and its running sum, and drops
the least likely tokens while that sum stays <= 1 - p, never the best. Dropped tokens are therefore a prefix
of the ascending order, and the sums depend only on the sorted values (one array, however ties are
ordered), so the mask is "every token <= the last dropped value" unless a group of tied tokens straddles
the cut: which of them go then follows torch.sort's own order of the ties, and only torch.sort tells it.

Each row takes the cheapest road that is certain (`TopP._cut_by_bounds`, `TopP._drop_row`):
1. No sort: the row's probabilities from one exp pass (float64 sums) and its best tokens (those within
   NEAR of the best logit, else topk) give the running sums around the cut; bounds on every rounding the
   reference can make (below) decide whether the cut falls between two values (mask by value) or inside
   a tie group (road 3).
2. If the bounds leave it open: numpy's sort of the values (no indices), the reference's softmax and
   running sum on them, then the mask by value.
3. Ties straddling the cut: torch.sort with indices, as the reference.

The bounds of road 1 assume of torch's CPU kernels only what any IEEE implementation does: exp of the
shifted logit (a float subtraction) within 16 ulp; softmax = those exps divided by (or times the
reciprocal of) their float sum, summed in any order (so its error is within 2 gamma_n, Higham's
bound for any summation tree, gamma_n = n u / (1 - n u), here doubled for headroom); the running sum at
the row's precision or wider, in any association (within gamma_n again); and the comparison with 1 - p
made by torch itself on the extreme values the reference could have rounded to. With n = 49,152 float32
logits the bounds are about 1% of the running sum, and on the target job's rows they decided about 85%
of the rows.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lmcli.settings.table import SETTINGS

NEAR = 12.0  # the cut is looked for first among the tokens this close to the best logit (e^-12 as likely)...
MOST_CLOSE = 4096  # ...when there are no more of them than this; then among the MOST_TOP best
MOST_TOP = 512


class TopP:
    """Nucleus: the smallest set of most likely tokens whose total probability is >= p."""

    needs_history = False
    same_on_any_thread = True

    def __init__(self, top_p: float):
        self.top_p = SETTINGS["top_p"].require(top_p)

    def __call__(self, input_ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        if (logits.device.type == "cpu" and logits.dim() == 2 and logits.dtype in (torch.float32, torch.float64)
                and not logits.requires_grad):
            drop = torch.stack([self._drop_row(row) for row in logits.detach()])  # (B, V)
        else:
            drop = self._drop_by_order(logits)
        return logits.masked_fill(drop, float("-inf"))

    def _drop_sorted(self, sorted_logits: torch.Tensor) -> torch.Tensor:
        """[B, V] ascending logits -> which of them to drop: the least likely tokens while what they add up
        to stays within 1 - p (the softmax over the sorted row, as transformers sums it); never the best."""
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= 1 - self.top_p
        drop_sorted[..., -1] = False
        return drop_sorted

    def _drop_by_order(self, logits: torch.Tensor) -> torch.Tensor:
        """The reference itself: [B, V] -> the mask, through torch.sort's order."""
        sorted_logits, order = torch.sort(logits, dim=-1)  # ascending
        drop_sorted = self._drop_sorted(sorted_logits)
        return drop_sorted.scatter(-1, order, drop_sorted)

    def _drop_row(self, row: torch.Tensor) -> torch.Tensor:
        """One row [V] -> its mask [V] bool, by the cheapest certain road (the module docstring)."""
        road, last = self._cut_by_bounds(row)
        if road == "order":
            return self._drop_by_order(row[None])[0]
        if last is None:
            values = np.sort(row.contiguous().numpy())  # ascending, as torch.sort's values
            count = int(self._drop_sorted(torch.from_numpy(values)[None]).sum())
            if count == 0:
                return torch.zeros_like(row, dtype=torch.bool)
            if int(np.searchsorted(values, values[count - 1], side="right")) != count:
                return self._drop_by_order(row[None])[0]  # ties straddle the cut
            last = torch.from_numpy(values[count - 1:count])
        return row <= last

    def _cut_by_bounds(self, row: torch.Tensor) -> tuple[str, torch.Tensor | None]:
        """("value", w) when the dropped tokens are surely those <= w; ("order", None) when a tie group
        surely straddles the cut; ("open", None) when the bounds cannot tell."""
        n = row.shape[0]
        u = torch.finfo(row.dtype).eps / 2
        if n < 2 or n * u > 0.05:
            return "open", None  # one token, or a row so long that bounds of n u each would tell nothing
        best = float(row.max())
        if not math.isfinite(best):
            return "open", None  # nan or inf: the reference's softmax is nan or one-hot; sort it
        shifted = (row - best).clamp_(min=-1e4)  # (V,) <= 0; a banned token's -inf made finite, its exp still 0
        exps = shifted.exp()
        total = float(exps.sum(dtype=torch.float64))
        # Each exp's error: 16 ulp, plus the subtraction's rounding magnified by |shifted| (a float dot,
        # itself within 1%).
        spread = 16 * total - 1.01 * float(torch.dot(exps, shifted))
        close = torch.nonzero(shifted > -NEAR)[:, 0]  # usually a few hundred tokens
        if len(close) <= MOST_CLOSE:
            found = self._decide(torch.from_numpy(-np.sort(-row[close].numpy())), best, total, spread, n, u)
            if found is not None:
                return found
        # The best tokens by count (the last value's ties may go on below them, which the cut allows).
        found = self._decide(torch.topk(row, min(MOST_TOP, n)).values, best, total, spread, n, u)
        return found if found is not None else ("open", None)

    def _decide(self, top: torch.Tensor, best: float, total: float, spread: float, n: int,
                u: float) -> tuple[str, torch.Tensor | None] | None:
        """The cut from the best values `top` (descending: every token above its last value); None when it
        lies below them."""
        values = top.numpy()
        exps = (top - best).exp().double().numpy()  # (k,)
        first = np.searchsorted(-values, -values, side="left")  # each token's group starts here
        above = np.concatenate([[0.0], np.cumsum(exps)])[first]  # mass of the tokens better than each
        estimate = (total - above) / total  # the running sum through each token's group
        starts = np.nonzero((first == np.arange(len(values))) & (first > 0) & (estimate <= 1 - self.top_p))[0]
        if len(starts) == 0:
            return None
        cut = int(starts[0])  # the best group whose sum is within 1 - p: the last dropped, by estimate
        better = int(first[cut - 1])  # the group just above it
        through_cut = total - above[cut]
        one_more = through_cut + exps[cut - 1]  # and the first token of the group above
        through_better = total - above[better]
        wide = 2 * 1.02 * u * spread + 4 * n * 2.0**-53 * total + n * 1e-37  # exps' and float64 sums' errors
        gamma = n * u / (1 - n * u)
        low_total, high_total = (total - wide) * (1 - 2 * gamma), (total + wide) * (1 + 2 * gamma)
        if low_total <= 0:
            return None

        def dropped(*masses: float) -> list[bool | None]:  # each running sum <= 1 - p: surely, surely not, open
            ends = []
            for mass in masses:
                slack = wide + 3.01 * u * mass
                low = max(0.0, (mass - slack) / high_total * (1 - gamma))
                high = (mass + slack) / low_total * (1 + gamma)
                ends += [_toward(low, -math.inf, top.dtype), _toward(high, math.inf, top.dtype)]
            within = (torch.tensor(ends, dtype=top.dtype) <= 1 - self.top_p).tolist()  # the reference's comparison
            return [within[i] if within[i] == within[i + 1] else None for i in range(0, len(within), 2)]

        at_cut, at_one_more, at_better = dropped(through_cut, one_more, through_better)
        if at_cut is True and at_one_more is False:
            return "value", top[cut:cut + 1]
        if at_one_more is True and at_better is False:
            return "order", None  # the cut is inside the group above: its ties are ordered by torch.sort
        return "open", None  # found, not proven: a wider look would find the same


def _toward(value: float, direction: float, dtype: torch.dtype) -> float:
    """`value` rounded to `dtype` away from the interval's inside (down for a low end, up for a high one)."""
    if dtype == torch.float64:
        return value
    rounded = np.float32(value)
    if (rounded > value and direction < 0) or (rounded < value and direction > 0):
        rounded = np.nextafter(rounded, np.float32(direction))
    return float(rounded)
