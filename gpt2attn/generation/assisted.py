"""Assisted (speculative) decoding: draft several tokens cheaply, verify them in one forward of
the model, keep the ones the model itself would have chosen.

Drafts come from a smaller model with the same vocabulary (`assistant_model=`) or from the
text itself (`prompt_lookup_num_tokens=`: what followed the last n-gram where it appeared
before). Greedy, the output equals plain greedy decoding; only the number of forwards changes.
Sampling keeps the model's own distribution, by transformers' rules: drafts of an assistant
are accepted with probability min(1, p / q) (speculative sampling, the model's p against the
assistant's q), and after a rejection the next token is drawn from max(0, p - q), renormalised;
prompt-lookup drafts, which have no q, are kept while they equal the tokens sampled from p.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .decoder import Decoder
from .processors import Processor, apply
from .sampling import draw

# (ids [1, L], at most k) -> (draft tokens [d], d <= k; their processed scores [d, V] when the
# drafts were drawn from a distribution, else None)
Draft = Callable[[Tensor, int], tuple[Tensor, Tensor | None]]


def draft_from_prompt(num_tokens: int, max_ngram: int) -> Draft:
    """Prompt lookup: find the last n tokens (n = max_ngram down to 1) earlier in the text and
    propose what followed their first occurrence."""

    def draft(ids: Tensor, k: int) -> tuple[Tensor, None]:
        seq = ids[0]
        L = seq.numel()
        k = min(k, num_tokens)
        for n in range(min(max_ngram, L - 1), 0, -1):
            windows = seq.unfold(0, n, 1)[:-1]  # every earlier n-gram, (L - n, n)
            starts = (windows == seq[L - n :]).all(dim=1).nonzero().flatten()
            for start in starts.tolist():
                follow = seq[start + n : start + n + k]
                if follow.numel():
                    return follow, None
        return seq[:0], None

    return draft


def draft_from_assistant(assistant, out: Tensor, capacity: int, chain: list[Processor], do_sample: bool,
                         generator: torch.Generator | None = None, mask: Tensor | None = None,
                         token_type_ids: Tensor | None = None) -> Draft:
    """Drafts of a smaller model, on its own preallocated cache kept in step with `out` (the
    prompt's padding mask and token types go along): its logits through the same processors as
    the model's, then the best token, or one sampled (the processed scores then come along, for
    the acceptance test)."""
    dec = Decoder(assistant, 1, capacity, out.device, mask, token_type_ids)

    @torch.no_grad()
    def draft(ids: Tensor, k: int) -> tuple[Tensor, Tensor | None]:
        L = ids.size(1)
        if k == 0:
            return ids[0, :0], None
        dec.rollback(min(dec.length, L - 1))  # forget drafts the model rejected
        logits = dec.forward(ids[:, dec.length :])
        seq, tokens, scores = ids, [], []
        for i in range(k):
            processed = apply(chain, seq, logits)  # (1, V)
            token = choose(processed, do_sample, generator)  # (1,)
            seq = torch.cat((seq, token[:, None]), dim=1)
            tokens.append(token)
            scores.append(processed)
            if i + 1 < k:
                logits = dec.forward(token[:, None])
        return torch.cat(tokens), torch.cat(scores) if do_sample else None

    return draft


def choose(scores: Tensor, do_sample: bool, generator: torch.Generator | None) -> Tensor:
    """The token of each row of processed scores (N, V): the best, or one drawn from their softmax."""
    if do_sample:
        return draw(scores.softmax(dim=-1), generator)
    return scores.argmax(dim=-1)


def accepted(guesses: Tensor, guess_scores: Tensor | None, scores: Tensor, do_sample: bool,
             generator: torch.Generator | None) -> Tensor:
    """The tokens kept from d drafts [d] checked against the model's processed scores (d + 1, V):
    the leading drafts accepted, then one token of the model's own (the first rejected draft's
    replacement, or the token after them all), as transformers' assisted decoding selects them."""
    d = guesses.numel()
    if do_sample and guess_scores is not None:  # speculative sampling
        p, q = scores.softmax(dim=-1), guess_scores.softmax(dim=-1)  # (d + 1, V), (d, V)
        rows = torch.arange(d, device=guesses.device)
        ratio = p[rows, guesses] / q[rows, guesses]  # (d,)
        keep = torch.rand(d, generator=generator, device=ratio.device) <= ratio
        n = int((~keep).cumsum(dim=0).eq(0).sum())
        last = p[n]  # (V,)
        if n < d and bool((p[n] > q[n]).any()):  # after a rejection: max(0, p - q), renormalised
            last = (p[n] - q[n]).clamp(min=0)
            last = last / last.sum()
        token = torch.multinomial(last, 1, generator=generator)  # (1,)
        return torch.cat((guesses[:n], token))
    chosen = choose(scores, do_sample, generator)  # (d + 1,)
    n = int((guesses != chosen[:d]).cumsum(dim=0).eq(0).sum())  # the drafts equal to the model's choices
    return chosen[: n + 1]


def assisted_search(dec: Decoder, logits: Tensor, out: Tensor, cur: int, cfg, chain: list[Processor], stops,
                    draft: Draft, n_draft: int, generator: torch.Generator | None = None,
                    record: dict | None = None) -> Iterator[Tensor]:
    """Decoding of one row, several tokens per forward when the drafts are right; yields each new
    token [1]. logits (1, V): the prompt's last position. record (when generate returns a dict):
    per token, its processed scores and raw logits, as sample_search records them; the Decoder's
    own record (attentions / hidden states) is cut to one entry a token, as transformers splits them."""
    max_len = out.size(1)
    inside = dec.record  # the prompt's forward stays whole: the first token's entry

    def emit(token: Tensor, raw: Tensor, scores: Tensor) -> bool:
        """Write one token (1,) chosen from raw logits / processed scores (1, V); True when done."""
        nonlocal cur
        if record is not None:
            record["logits"].append(raw)
            record["scores"].append(scores)
        out[:, cur] = token
        cur += 1
        return cur == max_len or (stops is not None and bool(stops(out[:, :cur])[0]))

    scores = apply(chain, out[:, :cur], logits)
    token = choose(scores, cfg.do_sample, generator)
    done = emit(token, logits, scores)
    yield token
    while not done:
        # Draft, then check the drafts and the token after them in one forward.
        guesses, guess_scores = draft(out[:, :cur], min(n_draft, max_len - cur - 1))  # (d,)
        d = guesses.numel()
        start = dec.length
        out[0, cur : cur + d] = guesses
        all_logits = dec.forward(out[:, cur - 1 : cur + d], all_positions=True)[0]  # (d + 1, V)
        forward = {key: steps.pop() for key, steps in inside.items()}  # per layer (1, nh, d + 1, T_k) / (1, d + 1, C)
        all_scores = torch.cat([apply(chain, out[:, : cur + i], all_logits[i : i + 1]) for i in range(d + 1)])
        tokens = accepted(guesses, guess_scores, all_scores, cfg.do_sample, generator)
        for i, token in enumerate(tokens[:, None]):  # the forward's query i chose token i
            for key, layers in forward.items():
                inside[key].append(tuple(layer[..., i : i + 1, : start + i + 1] if key == "attentions"
                                         else layer[:, i : i + 1] for layer in layers))
            done = emit(token, all_logits[i : i + 1], all_scores[i : i + 1])
            yield token
            if done:
                break
        dec.rollback(start + len(tokens))  # the token fed first and the accepted drafts stay cached
