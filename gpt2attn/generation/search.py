"""The searches: greedy / sampling one token per row per step, and beam search.

Both fill `out` [N, max_len] (prompt ids first) in place from the logits the Decoder returns,
and record processed scores / raw logits when asked, as transformers' generate does.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch import Tensor

from .. import kernels
from .processors import Processor, apply
from .sampling import draw

FUSED_TOKENS = 16  # tokens a row per call of the decoder's greedy loop (the ~80 us of Python a call: 5 a token)
Stops = Callable[[Tensor], Tensor]  # sequences [M, L] -> bool [M]: does the last token end them?


def sample_search(dec, logits: Tensor, out: Tensor, cur: int, cfg, chain: list[Processor], stops: Stops | None,
                  pad: int, generator, record: dict | None, fused: bool = False) -> Iterator[Tensor]:
    """Greedy (argmax) or sampled tokens until every row stopped or out is full; yields each
    step's tokens [N]. logits [N, V]: the prompt's last position. fused: the tokens after the first
    are greedy, unprocessed, unrecorded, and stop at eos alone, so they come from the decoder's
    kernel loop (Decoder.greedy), FUSED_TOKENS a call, with no Python between them, yielded after each call."""
    N, max_len = out.shape
    unfinished = torch.ones(N, dtype=torch.bool, device=out.device)
    while True:
        scores = apply(chain, out[:, :cur], logits)
        if record is not None:
            record["logits"].append(logits)
            record["scores"].append(scores)
        if cfg.do_sample:
            tokens = draw(scores.softmax(dim=-1), generator)
        else:
            tokens = kernels.argmax(scores)
        if cfg.eos_ids:  # a finished row gets pad; without eos it keeps its tokens, as in transformers
            tokens = tokens.masked_fill(~unfinished, pad)
        out[:, cur] = tokens
        cur += 1
        yield tokens
        if cur == max_len:
            return
        if stops is not None:
            unfinished &= ~stops(out[:, :cur])
            if not unfinished.any():
                return
        if fused:
            eos = torch.tensor(cfg.eos_ids, dtype=torch.long)
            while True:  # FUSED_TOKENS at a time, so that Python (and Ctrl-C) gets a turn between calls
                n = dec.greedy(tokens, out[:, cur : cur + FUSED_TOKENS], unfinished, eos, pad)
                yield from out[:, cur : cur + n].unbind(1)
                cur += n
                if cur == max_len or (cfg.eos_ids and not unfinished.any()):
                    return
                tokens = out[:, cur - 1]
        logits = dec.forward(tokens[:, None])


def beam_search(dec, logits: Tensor, out: Tensor, prompt_len: int, cfg, chain: list[Processor], stops: Stops | None,
                generator, record: dict | None):
    """Beam search over out [B * nb, max_len] (each prompt repeated nb times), as transformers
    runs it: the best 2 * nb continuations (more with several eos ids) of all beams per step,
    finished hypotheses kept by length-penalised score, the running nb continued.

    Returns (sequences [B * nrs, L], sequences_scores [B * nrs], beam_indices [B * nrs, L - prompt_len]).
    """
    nb, nrs = cfg.num_beams, cfg.num_return_sequences
    BN, max_len = out.shape
    B = BN // nb
    device = out.device
    n_keep = max(2, 1 + len(cfg.eos_ids)) * nb  # candidates per prompt: enough that nb stay unfinished
    top_nb = torch.arange(n_keep, device=device) < nb  # (K,): only these may finish a hypothesis
    n_new = max_len - prompt_len

    running = out.view(B, nb, max_len)  # running beams, in place
    running_scores = torch.zeros(B, nb, device=device)
    running_scores[:, 1:] = -1e9  # the first step expands beam 0 only
    running_origin = torch.full((B, nb, n_new), -1, dtype=torch.long, device=device)  # beam (row) of each token
    done = running.clone()  # finished hypotheses
    done_scores = torch.full((B, nb), -1e9, device=device)
    done_origin = running_origin.clone()
    done_full = torch.zeros(B, nb, dtype=torch.bool, device=device)
    improvable = torch.ones(B, 1, dtype=torch.bool, device=device)
    row_offset = torch.arange(B, device=device)[:, None] * nb  # (B, 1)
    lp, early = cfg.length_penalty, cfg.early_stopping

    cur = prompt_len
    while True:
        log_probs = apply(chain, out[:, :cur], logits.log_softmax(dim=-1))  # (B * nb, V)
        if record is not None:
            record["logits"].append(logits)
            record["scores"].append(log_probs)
        V = log_probs.size(-1)
        if cfg.do_sample:
            total = (log_probs.view(B, nb, V) + running_scores[:, :, None]).view(B, nb * V)
            pick = torch.multinomial(total.softmax(dim=-1), n_keep, generator=generator)  # (B, K)
            cand_scores, order = total.gather(1, pick).sort(dim=-1, descending=True)  # best first, as top-k gives
            pick = pick.gather(1, order)
        else:
            # The best K of all nb * V continuations are among each beam's own best K: pick those
            # per row (a quarter of the work of one top-k over nb * V), then the best K of nb * K.
            row_best, row_token = log_probs.topk(n_keep, dim=-1)  # (B * nb, K)
            total = (row_best.view(B, nb, n_keep) + running_scores[:, :, None]).view(B, nb * n_keep)
            cand_scores, best = total.topk(n_keep, dim=-1)  # (B, K)
            pick = (best // n_keep) * V + row_token.view(B, nb * n_keep).gather(1, best)
        beam, token = pick // V, pick % V
        cand = running.gather(1, beam[:, :, None].expand(-1, -1, max_len)).clone()  # (B, K, max_len)
        cand[:, :, cur] = token
        cand_origin = running_origin.gather(1, beam[:, :, None].expand(-1, -1, n_new)).clone()
        cand_origin[:, :, cur - prompt_len] = beam + row_offset
        if cur + 1 >= max_len:
            ends = torch.ones(B, n_keep, dtype=torch.bool, device=device)
        else:
            ends = stops(cand.view(B * n_keep, max_len)[:, : cur + 1]).view(B, n_keep) if stops else \
                torch.zeros(B, n_keep, dtype=torch.bool, device=device)

        # The best nb candidates that did not end go on.
        alive_scores = cand_scores + ends.float() * -1e9
        keep = alive_scores.topk(nb, dim=-1).indices  # (B, nb)
        running_scores = alive_scores.gather(1, keep)
        running_origin = cand_origin.gather(1, keep[:, :, None].expand(-1, -1, n_new))
        running.copy_(cand.gather(1, keep[:, :, None].expand(-1, -1, max_len)))

        # Candidates among the top nb that ended join the finished ones if they beat them.
        just_done = ends & top_nb[None, :]
        final = cand_scores / ((cur + 1 - prompt_len) ** lp)
        final = final + (done_full.all(-1, keepdim=True) & (early is True)).float() * -1e9
        final = final + (~improvable).float() * -1e9
        final = final + (~just_done) * -1e9
        merged = torch.cat((done_scores, final), dim=1).topk(nb, dim=-1).indices  # (B, nb)
        done_scores = torch.cat((done_scores, final), dim=1).gather(1, merged)
        done = torch.cat((done, cand), dim=1).gather(1, merged[:, :, None].expand(-1, -1, max_len))
        done_origin = torch.cat((done_origin, cand_origin), dim=1).gather(1, merged[:, :, None].expand(-1, -1, n_new))
        done_full = torch.cat((done_full, just_done), dim=1).gather(1, merged)

        cur += 1
        # Could a running beam still beat the worst finished hypothesis?
        best_len = (max_len if early == "never" and lp > 0.0 else cur) - prompt_len
        best_possible = running_scores[:, :1] / (best_len**lp)
        worst_done = torch.where(done_full, done_scores.min(dim=1, keepdim=True).values, -1.0e9)
        improvable = improvable & (best_possible > worst_done).any(dim=-1, keepdim=True)
        if not improvable.any() or (done_full.all() and early is True) or ends.all():
            break
        dec.reorder(running_origin[:, :, cur - 1 - prompt_len].reshape(-1))
        logits = dec.forward(out[:, cur - 1 : cur])

    sequences = done[:, :nrs].reshape(B * nrs, max_len)
    scores = done_scores[:, :nrs].reshape(B * nrs)
    origin = done_origin[:, :nrs].reshape(B * nrs, n_new)
    n = int((origin >= 0).sum(dim=1).max())
    return sequences[:, : prompt_len + n], scores, origin[:, :n]
