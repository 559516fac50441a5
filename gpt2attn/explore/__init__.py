"""One self-contained HTML page with every layer and head of a model over a text.

    page = explore(model, tokenizer, "To be, or not to be", generate=10)
    page.save("page.html")          # or str(page); in a notebook the page shows itself

The page (page.html beside this file, with the data filled in) has six views:

    model view      the text's tokens, and every layer x head as a thumbnail of its attention pattern
    head view       one layer's chosen heads: queries and keys in two columns, lines by weight
                    (a selected token's lines, or every line when none is selected)
    neuron view     one layer, head and query: q, each key's k, q x k elementwise, q.k, q.k/sqrt(d),
                    the mask and the softmax weight, for every key
    layers          what each layer would predict (the logit lens): each layer's residual stream
                    through ln_f and lm_head, the top token per layer x position and its top-5
    prediction      the next-token top-5 at a position, and per head the change of the log-prob
                    of the model's top token there when that head is zeroed (the chosen layers'
                    heads: ablate=; each layer costs a pass through it and every later block)
    decoding        with generate=N: each greedy step's new query row over the cached keys

With sentence_b_start=b (as bertviz's) the text is two segments, A = tokens 0..b-1 and B = b..T-1,
and the model and head views get a filter: every pair, or only queries of one segment -> keys of one.

Numbers are stored exactly to the 3 digits the page prints: a weight w as round(w * 1000) in
uint16, only the causal (lower) triangle; q and k (any sign) as round(v * 1000) zigzag-coded in
uint32. Each head's block is split into byte planes (low bytes first: the high planes are nearly
all zero and pack to almost nothing), zlib-compressed and base64-encoded; the browser inflates a
head when it is shown (DecompressionStream), so a page opens fast whatever its size. The neuron
view computes q x k, q.k and q.k/sqrt(d) in the browser from the stored q and k (each within
0.0005 of the model's), so a product can differ from the model's by what that rounding carries.
Thumbnails are a separate small block: each head max-pooled to at most THUMB x THUMB cells, one
byte per cell. Nothing is fetched: scripts, styles and data are all inside the file.
"""

from __future__ import annotations

import base64
import html
import json
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor

from ..files import write_text_atomic
from ..model import GPT2LMHeadModel
from ..tokenizer import encode, token_labels

TEMPLATE = Path(__file__).with_name("page.html")
SCALE = 1000  # a weight w is stored as round(w * SCALE): exact to the 3 digits the page prints
THUMB = 48  # thumbnail cells per side, at most
TOP_K = 5
THRESHOLD = 0.1  # the head view's initial threshold for highlighting keys


@dataclass(repr=False)
class Page:
    """The page's HTML (`str(page)`); shows itself in a notebook, in an iframe of its own."""

    html: str

    def __str__(self) -> str:
        return self.html

    def __repr__(self) -> str:
        return f"<gpt2attn explore page, {len(self.html) / 1e6:.1f} MB of HTML>"

    def save(self, path: str | Path) -> None:
        write_text_atomic(path, self.html)

    def _repr_html_(self) -> str:
        # an iframe keeps the page's ids and scripts apart from the notebook's and other pages'
        return f'<iframe srcdoc="{html.escape(self.html)}" style="width:100%;height:720px;border:0"></iframe>'


def explore(model: GPT2LMHeadModel, tokenizer: Tokenizer, text: str, position: int = -1,
            generate: int = 0, name: str = "", sentence_b_start: int | None = None,
            ablate: Sequence[int] | None = None, progress: Callable[[int], object] | None = None) -> Page:
    """The page for `text`. position: the query whose prediction the ablation table explains
    (negative counts from the end; default the last). generate: greedy steps for the decoding
    view. name: the model's name shown on the page. sentence_b_start: the token where a second
    segment starts (1..T-1), for the sentence-pair filter. ablate: the layers whose heads are
    zeroed one by one for the ablation table (default all; see ablation_cost), the others' rows
    left empty; progress(0) is called as they start, after the input is checked, and progress(n)
    as each layer's finish, n its block passes. Bad input is a ValueError naming it."""
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer: the Tokenizer inside
        tokenizer = tokenizer.backend_tokenizer
    data = page_data(model, tokenizer, text, position, generate, sentence_b_start, ablate, progress)
    data["model"] = name
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # no "</script>" inside the data
    title = "gpt2attn explore" + (f" · {html.escape(name)}" if name else "")
    page = TEMPLATE.read_text(encoding="utf-8").replace("<title>gpt2attn explore</title>", f"<title>{title}</title>")
    return Page(page.replace("/*DATA*/", blob))


@torch.no_grad()
def page_data(model: GPT2LMHeadModel, tokenizer: Tokenizer, text: str, position: int = -1, generate: int = 0,
              sentence_b_start: int | None = None, ablate: Sequence[int] | None = None,
              progress: Callable[[int], object] | None = None) -> dict:
    """Everything the page shows, as JSON-ready values (see the module docstring for the encoding)."""
    if not isinstance(model, GPT2LMHeadModel):
        raise ValueError(f"explore needs a gpt2attn GPT2LMHeadModel, got {type(model).__name__}")
    cfg = model.config
    if ablate is not None and any(type(layer) is not int or not 0 <= layer < cfg.n_layer for layer in ablate):
        raise ValueError(f"ablate: this model's layers are 0 to {cfg.n_layer - 1}, got {list(ablate)}")
    layers = range(cfg.n_layer) if ablate is None else sorted(set(ablate))
    if not text:
        raise ValueError("the text is empty")
    ids = encode(tokenizer, text)
    if not ids:
        raise ValueError("the text gives no tokens")
    T = len(ids)
    if T + generate > cfg.n_positions:
        more = f" + {generate} generated" if generate else ""
        raise ValueError(f"the text is {T} tokens{more}; this model's context is {cfg.n_positions}")
    if generate < 0:
        raise ValueError(f"generate must be 0 or more, got {generate}")
    if not -T <= position < T:
        raise ValueError(f"position {position} is out of range for a text of {T} tokens")
    position %= T
    if sentence_b_start is not None and (type(sentence_b_start) is not int or not 0 < sentence_b_start < T):
        raise ValueError(f"sentence_b_start must be a token index from 1 to {T - 1} (the text is {T} tokens), "
                         f"got {sentence_b_start!r}")
    model.eval()
    device = model.lm_head.weight.device

    out = model(torch.tensor([ids], device=device), output_attentions=True, output_hidden_states=True, use_cache=False)
    weights = torch.stack(out.attentions)[:, 0].float().cpu()  # (L, nh, T, T)
    logp = out.logits[0].float().log_softmax(-1)  # (T, V)
    top = logp.topk(min(TOP_K, logp.size(-1)))  # (T, k)
    target = int(top.indices[position, 0])
    effects = head_effects(model, out.hidden_states, position, target, layers, progress) - logp[position, target]
    q, k = queries_keys(model, out.hidden_states)  # (L, nh, T, hs) each

    return {
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "head_size": cfg.n_embd // cfg.n_head,
        "score_scale": [block.attn.scale for block in model.transformer.h],  # score = q.k * scale (1/sqrt(d))
        "tokens": token_labels(tokenizer, ids),
        "ids": ids,
        "scale": SCALE,
        "threshold": THRESHOLD,
        "position": position,
        "sentence_b_start": sentence_b_start,
        "top": [[[label, round(p, 4)] for label, p in zip(token_labels(tokenizer, row_ids), row_p)]
                for row_ids, row_p in zip(top.indices.tolist(), top.values.exp().tolist())],
        "target": token_labels(tokenizer, [target])[0],
        "effects": [[round(e, 4) for e in row] if layer in layers else None  # None: not ablated
                    for layer, row in enumerate(effects.tolist())],
        "attn": [[pack(triangle(w)) for w in layer] for layer in weights],
        "q": [[pack(head, signed=True) for head in layer] for layer in q],
        "k": [[pack(head, signed=True) for head in layer] for layer in k],
        "lens": logit_lens(model, tokenizer, out.hidden_states, out.logits),
        "thumbs": thumbnails(weights),
        "steps": decode_steps(model, tokenizer, ids, generate) if generate else None,
    }


def ablation_cost(n_layer: int, layers: Sequence[int]) -> int:
    """Block passes (each a batch of n_head rows) that head_effects makes for these layers: each
    ablated layer runs its own block and every later one."""
    return sum(n_layer - layer for layer in layers)


def head_effects(model: GPT2LMHeadModel, hidden: tuple[Tensor, ...], position: int, token: int,
                 layers: Sequence[int] | None = None, progress: Callable[[int], object] | None = None) -> Tensor:
    """log p(token) at `position` with each head zeroed in turn, (L, nh); the rows of layers not in
    `layers` (default: all) are NaN. One batch per layer: row b zeroes head b (as inspect.zero_head
    does to attn.weights), starting from the clean run's input to that layer (hidden[L]) and cut
    after `position`, which no earlier query sees. progress(0) as they start, then progress(n) after
    each layer: its n block passes."""
    base, nh, n_layer = model.transformer, model.config.n_head, model.config.n_layer
    keep = 1.0 - torch.eye(nh, device=hidden[0].device, dtype=hidden[0].dtype)[:, :, None, None]  # (nh, nh, 1, 1)
    effects = torch.full((n_layer, nh), float("nan"))
    if progress is not None:
        progress(0)  # starting: the input has been checked
    for layer in range(n_layer) if layers is None else layers:
        x = hidden[layer][:, : position + 1].expand(nh, -1, -1)  # (nh, P+1, C)
        x, _, _ = base.h[layer](x, head_mask=keep)
        for later in base.h[layer + 1:]:
            x, _, _ = later(x)
        logits = model.lm_head(base.ln_f(x[:, -1]))  # (nh, V)
        effects[layer] = logits.float().log_softmax(-1)[:, token].cpu()
        if progress is not None:
            progress(ablation_cost(n_layer, [layer]))
    return effects


def queries_keys(model: GPT2LMHeadModel, hidden: tuple[Tensor, ...]) -> tuple[Tensor, Tensor]:
    """Every layer's queries and keys, (L, nh, T, hs) each, from each layer's input (hidden[L])
    as its attention makes them: ln_1, c_attn, split into heads."""
    qs, ks = [], []
    for layer, block in enumerate(model.transformer.h):
        q, k, _ = block.attn.c_attn(block.ln_1(hidden[layer])).split(model.config.n_embd, dim=2)
        qs.append(block.attn.split_heads(q)[0])  # (nh, T, hs)
        ks.append(block.attn.split_heads(k)[0])
    return torch.stack(qs).float().cpu(), torch.stack(ks).float().cpu()


def logit_lens(model: GPT2LMHeadModel, tokenizer: Tokenizer, hidden: tuple[Tensor, ...], logits: Tensor) -> dict:
    """What each layer would predict: the residual stream after the embeddings and after each
    layer (hidden[0..L-1], then the final logits, which already went through ln_f) through ln_f
    and lm_head. Rows: embeddings, layer 0 .. layer L-1; per row and position the top-5 token ids
    and round(p * SCALE), flat (row, position, rank); labels: the label of each id shown."""
    base = model.transformer
    rows = [model.lm_head(base.ln_f(h[0])) for h in hidden[:-1]] + [logits[0]]  # L+1 x (T, V)
    probs = torch.stack(rows).float().softmax(-1)  # (L+1, T, V)
    top = probs.topk(min(TOP_K, probs.size(-1)))  # (L+1, T, k)
    ids = top.indices.flatten().tolist()
    shown = sorted(set(ids))
    return {
        "k": top.indices.size(-1),
        "ids": ids,
        "p": (top.values * SCALE).round().int().flatten().tolist(),
        "labels": dict(zip(map(str, shown), token_labels(tokenizer, shown))),
    }


@torch.no_grad()
def decode_steps(model: GPT2LMHeadModel, tokenizer: Tokenizer, ids: list[int], n: int) -> dict:
    """n greedy steps with the KV cache. Step s feeds generated token s as the one new query; its
    attention row covers the len(ids) + s cached keys and itself. Per head, the rows of all steps
    are packed one after the other."""
    device = model.lm_head.weight.device
    out = model(torch.tensor([ids], device=device), use_cache=True)
    generated, rows = [], []  # rows[s]: (L, nh, len(ids) + s + 1)
    for _ in range(n):
        token = out.logits[0, -1].argmax()
        generated.append(int(token))
        out = model(token.view(1, 1), past_key_values=out.past_key_values, use_cache=True, output_attentions=True)
        rows.append(torch.stack(out.attentions)[:, 0, :, 0].float().cpu())
    following = int(out.logits[0, -1].argmax())
    L, nh = rows[0].shape[:2]
    return {
        "prompt_len": len(ids),
        "tokens": token_labels(tokenizer, generated),
        "next": token_labels(tokenizer, generated[1:] + [following]),
        "attn": [[pack(torch.cat([r[layer, head] for r in rows])) for head in range(nh)] for layer in range(L)],
    }


def triangle(w: Tensor) -> Tensor:
    """The causal part of a (T, T) pattern, row by row: row i's keys 0..i, T(T+1)/2 values."""
    rows, cols = torch.tril_indices(w.size(0), w.size(1))
    return w[rows, cols]


def pack(values: Tensor, signed: bool = False) -> str:
    """round(v * SCALE), flattened: weights (0..1) as uint16; signed values zigzag-coded
    (0, -1, 1, -2, ... -> 0, 1, 2, 3, ...) as uint32. Split into byte planes, low bytes first
    (the high ones are nearly all zero, which zlib packs well), zlib, base64."""
    q = np.round(values.numpy().astype(np.float64).ravel() * SCALE).astype(np.int64)
    if signed:
        if np.abs(q).max(initial=0) >= 2**31:
            raise ValueError(f"a value of {np.abs(values).max():.4g} is too large to store at 1/{SCALE}")
        q = ((q << 1) ^ (q >> 63)).astype("<u4")  # zigzag: the sign in the lowest bit
    else:
        q = q.astype("<u2")
    planes = q.view(np.uint8).reshape(-1, q.itemsize).T  # (bytes per value, n): low bytes first
    return base64.b64encode(zlib.compress(planes.tobytes(), 6)).decode("ascii")


def thumbnails(weights: Tensor) -> dict:
    """Every head max-pooled to (S, S) cells, S = min(T, THUMB), 0..255 per cell; one block."""
    L, nh, T, _ = weights.shape
    size = min(T, THUMB)
    pooled = F.adaptive_max_pool2d(weights.reshape(L * nh, 1, T, T), size)  # (L*nh, 1, S, S)
    cells = (pooled.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return {"size": size, "data": base64.b64encode(zlib.compress(cells.tobytes(), 6)).decode("ascii")}
