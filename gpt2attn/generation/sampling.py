"""Drawing a token from each row of probabilities: torch.multinomial's tokens, and its random stream,
with less of its work where most probabilities are zero (after top-k or top-p).

For one sample a row, torch.multinomial (CPU) takes an exponential variate q for every entry of
probs, q = -log1p(-u) in double from a uniform u made of the 53 low bits of one 64-bit draw of the
generator, rounded to float, and returns each row's argmax of probs / q (the first of equal ones).
An entry whose probability is zero gives 0 whatever its q, so `draw` takes the same 64-bit draws
(an int64 `random_`, which leaves the generator where multinomial leaves it) and computes q for the
nonzero entries alone: the log that costs most of multinomial's time (about 1 ms of 50257 entries
against 0.3 for the draws, Intel Emerald Rapids VM, 2026-11-29) runs for the few tokens top-k or
top-p leave. `same_as_multinomial()` checks once per process that this torch's multinomial does what
is described here (its tokens and the generator's state after four draws); where it does not, or
where most entries are nonzero, `draw` is torch.multinomial.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

LOW_53 = (1 << 53) - 1  # the bits of a 64-bit draw that make a double in [0, 1)
MOST_LIVE = 1024  # nonzero probabilities (all rows together) above which draw leaves it all to multinomial


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """torch.multinomial(probs, 1, generator=generator).squeeze(1) for probs (N, V): one token a row."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and probs.numel():
        lo, hi = torch.aminmax(probs)
        if lo >= 0 and hi < math.inf:  # no negative, infinite or NaN entry: multinomial's errors stay its own
            live = probs > 0  # (N, V)
            counts = live.sum(dim=1).tolist()
            if min(counts) > 0 and sum(counts) <= MOST_LIVE and same_as_multinomial():
                return sparse_draw(probs, live, generator)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sparse_draw(probs: Tensor, live: Tensor, generator: torch.Generator | None) -> Tensor:
    """multinomial's tokens for probs (N, V) whose nonzero entries are `live`, q computed for those
    alone."""
    words = torch.empty(probs.shape, dtype=torch.int64).random_(generator=generator)  # (N, V): multinomial's draws
    return tokens_of(probs, live, words)


def tokens_of(probs: Tensor, live: Tensor, words: Tensor) -> Tensor:
    """argmax of probs / q for each row (each with a live entry), q the variates of the 64-bit words
    (N, V), computed where probs are `live` and where u is 0 (q = 0: probs / q is inf there, or NaN
    for a zero probability, which argmax takes first, as multinomial's argmax does); elsewhere
    probs / q is 0, which never wins over a live entry's, so each row's argmax is that of its
    computed entries, in order."""
    u53 = words & LOW_53  # (N, V): u times 2^53
    rows, cols = (live | (u53 == 0)).nonzero(as_tuple=True)  # (n,) each, row by row, in index order
    q = torch.tensor([-math.log1p(-(w * 2.0**-53)) for w in u53[rows, cols].tolist()],
                     dtype=torch.float32)  # (n,): doubles rounded, as multinomial's variates are
    ratio = probs[rows, cols] / q  # (n,)
    ends = torch.bincount(rows).cumsum(0).tolist()  # (N,): every row has a live entry
    return torch.stack([cols[start + ratio[start:end].argmax()] for start, end in zip([0] + ends[:-1], ends)])


@functools.cache
def same_as_multinomial() -> bool:
    """Whether sparse_draw gives this torch's multinomial tokens and leaves its generator in the same
    state, on rows as long as GPT-2's vocabulary (a torch could take another path for other sizes)."""
    probs = torch.zeros(2, 50257)
    probs[:, ::1257] = torch.rand(2, 40, generator=torch.Generator().manual_seed(0))  # 40 live a row
    probs /= probs.sum(dim=1, keepdim=True)
    theirs, ours = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    for _ in range(4):
        expected = torch.multinomial(probs, 1, generator=theirs).squeeze(1)
        if not torch.equal(sparse_draw(probs, probs > 0, ours), expected):
            return False
    return torch.equal(theirs.get_state(), ours.get_state())
