"""Drawing a token from each row of probabilities: torch.multinomial's tokens, and its random stream,
with less of its work where most probabilities are zero (after top-k or top-p).

For one sample a row, torch.multinomial (CPU) takes an exponential variate q for every entry of
probs, q = -log1p(-u) in double from a uniform u made of the 53 low bits of one 64-bit draw of the
generator, rounded to float, and returns each row's argmax of probs / q (the first of equal ones).
An entry whose probability is zero gives 0 whatever its q, so `draw` takes the same 64-bit draws
(an int64 `random_`, which leaves the generator where multinomial leaves it) and computes q for the
nonzero entries alone: the log that costs most of multinomial's time (about 1 ms of 50257 entries
against 0.3 for the draws, Intel Emerald Rapids VM, 2026-11-29) runs for the few tokens top-k or
top-p leave. Those entries are found, divided and compared in numpy, whose calls on a row of 50257
cost less than torch's: a draw among 50 live tokens took 0.30-0.33 ms instead of 0.6, 0.2-0.3 of
it the draws (the same VM, later that day). `same_as_multinomial()` checks once per process that
this torch's multinomial does what is described here (its tokens and the generator's state after
four draws); where it does not, or where most entries are nonzero, `draw` is torch.multinomial.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import torch
from torch import Tensor

LOW_53 = (1 << 53) - 1  # the bits of a 64-bit draw that make a double in [0, 1)
MOST_LIVE = 1024  # nonzero probabilities (all rows together) above which draw leaves it all to multinomial


def draw(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """torch.multinomial(probs, 1, generator=generator).squeeze(1) for probs (N, V): one token a row."""
    if probs.device.type == "cpu" and probs.dtype == torch.float32 and probs.dim() == 2 and probs.numel():
        p = probs.detach().numpy()  # (N, V)
        if p.min() >= 0 and p.max() < math.inf:  # no negative, infinite or NaN entry: multinomial's errors stay its own
            live = np.flatnonzero(p > 0)  # (n,) flat indices, row by row
            if (live.size <= MOST_LIVE and np.unique(live // p.shape[1]).size == p.shape[0]  # a live entry a row
                    and same_as_multinomial()):
                return sparse_draw(p, live, generator)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def sparse_draw(p: np.ndarray, live: np.ndarray, generator: torch.Generator | None) -> Tensor:
    """multinomial's tokens for p (N, V) whose nonzero entries are at the flat indices `live` (every
    row has one), q computed for those alone."""
    words = torch.empty(p.shape, dtype=torch.int64).random_(generator=generator)  # (N, V): multinomial's draws
    return tokens_of(p, live, words.numpy())


def tokens_of(p: np.ndarray, live: np.ndarray, words: np.ndarray) -> Tensor:
    """argmax of p / q for each row of p (N, V), q the variates of the 64-bit words (N, V), computed
    at the flat indices `live` (p's nonzero entries, each row having one) and where u is 0 (q = 0:
    p / q is inf there, or NaN for a zero probability, which argmax takes first, as multinomial's
    argmax does); elsewhere p / q is 0, which never wins over a live entry's, so each row's argmax
    is that of its computed entries, in order."""
    N, V = p.shape
    u53 = words.reshape(-1) & LOW_53  # (N * V,): u times 2^53
    if not u53.all():  # a u of 0, one draw in 2^53
        live = np.union1d(live, np.flatnonzero(u53 == 0))
    q = np.array([-math.log1p(-(w * 2.0**-53)) for w in u53[live].tolist()],
                 dtype=np.float32)  # (n,): doubles rounded, as multinomial's variates are
    with np.errstate(divide="ignore", invalid="ignore"):  # q = 0: inf, or NaN for a zero probability
        ratio = p.reshape(-1)[live] / q  # (n,)
    starts = np.searchsorted(live, np.arange(N + 1) * V).tolist()  # (N + 1,): where each row's entries begin
    return torch.tensor([live[a + ratio[a:b].argmax()] - row * V
                         for row, (a, b) in enumerate(zip(starts[:-1], starts[1:]))])


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
        if not torch.equal(sparse_draw(probs.numpy(), np.flatnonzero(probs.numpy() > 0), ours), expected):
            return False
    return torch.equal(theirs.get_state(), ours.get_state())
