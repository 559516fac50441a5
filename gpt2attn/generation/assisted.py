"""Assisted (speculative) greedy decoding: draft several tokens cheaply, verify them in one
forward of the model, keep the ones its own greedy choice agrees with.

Drafts come from a smaller model with the same vocabulary (`assistant_model=`) or from the
text itself (`prompt_lookup_num_tokens=`: what followed the last n-gram where it appeared
before). The output equals plain greedy decoding; only the number of forwards changes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .decoder import Decoder
from .processors import Processor, apply

Draft = Callable[[Tensor, int], Tensor]  # (ids [1, L], at most k) -> draft tokens [d], d <= k


def draft_from_prompt(num_tokens: int, max_ngram: int) -> Draft:
    """Prompt lookup: find the last n tokens (n = max_ngram down to 1) earlier in the text and
    propose what followed their first occurrence."""

    def draft(ids: Tensor, k: int) -> Tensor:
        seq = ids[0]
        L = seq.numel()
        k = min(k, num_tokens)
        for n in range(min(max_ngram, L - 1), 0, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every earlier n-gram, (L - n, n)
            starts = (windows == seq[L - n :]).all(dim=1).nonzero().flatten()
            for start in starts.tolist():
                follow = seq[start + n : start + n + k]
                if follow.numel():
                    return follow
        return seq[:0]

    return draft


def draft_from_assistant(assistant, out: Tensor, capacity: int) -> Draft:
    """Greedy drafts of a smaller model, on its own preallocated cache kept in step with `out`."""
    dec = Decoder(assistant, 1, capacity, out.device)

    @torch.no_grad()
    def draft(ids: Tensor, k: int) -> Tensor:
        L = ids.size(1)
        if k == 0:
            return ids[0, :0]
        dec.rollback(min(dec.length, L - 1))  # forget drafts the model rejected
        logits = dec.forward(ids[:, dec.length :])
        tokens = []
        for i in range(k):
            token = logits.argmax(dim=-1)  # (1,)
            tokens.append(token)
            if i + 1 < k:
                logits = dec.forward(token[:, None])
        return torch.cat(tokens)

    return draft


def assisted_search(dec: Decoder, logits: Tensor, out: Tensor, cur: int, cfg, chain: list[Processor], stops,
                    draft: Draft, n_draft: int) -> Iterator[Tensor]:
    """Greedy decoding of one row, several tokens per forward when the drafts are right;
    yields each new token [1]."""
    max_len = out.size(1)
    while True:
        token = apply(chain, out[:, :cur], logits).argmax(dim=-1)  # (1,)
        out[:, cur] = token
        cur += 1
        yield token
        if cur == max_len or (stops is not None and bool(stops(out[:, :cur])[0])):
            return
        # Draft, then check the drafts and the token after them in one forward.
        guesses = draft(out[:, :cur], min(n_draft, max_len - cur - 1))  # (d,)
        d = guesses.numel()
        start = dec.length
        out[0, cur : cur + d] = guesses
        all_logits = dec.forward(out[:, cur - 1 : cur + d], all_positions=True)[0]  # (d + 1, V)
        for i in range(d):
            choice = apply(chain, out[:, : cur], all_logits[i : i + 1]).argmax(dim=-1)
            if choice != guesses[i]:
                break
            cur += 1  # the draft is what greedy decoding would choose: keep it
            yield guesses[i : i + 1]
            if stops is not None and bool(stops(out[:, :cur])[0]):
                return
        else:
            i = d
        dec.rollback(start + 1 + i)  # the token fed first and the i accepted drafts stay cached
        logits = all_logits[i : i + 1]
