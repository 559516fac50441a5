"""One self-contained HTML page with every layer and head of a model over a text.

    page = explore(model, tokenizer, "To be, or not to be", generate=10)
    page.save("page.html")          # or str(page); in a notebook the page shows itself

The page (page.html beside this file, with the data filled in) has four views:

    model view      every layer x head as a thumbnail of its attention pattern
    head view       one layer's chosen heads: queries and keys in two columns, lines by weight
    prediction      the next-token top-5 at a position, and per head the change of the log-prob
                    of the model's top token there when that head is zeroed
    decoding        with generate=N: each greedy step's new query row over the cached keys

Weights are stored exactly to the 3 digits the page prints: round(w * 1000) as uint16, only the
causal (lower) triangle, per head zlib-compressed and base64-encoded; the browser inflates a head
when it is shown (DecompressionStream), so a page opens fast whatever its size. Thumbnails are a
separate small block: each head max-pooled to at most THUMB x THUMB cells, one byte per cell.
Nothing is fetched: scripts, styles and data are all inside the file.
"""

from __future__ import annotations

import base64
import html
import json
import zlib
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
            generate: int = 0, name: str = "") -> Page:
    """The page for `text`. position: the query whose prediction the ablation table explains
    (negative counts from the end; default the last). generate: greedy steps for the decoding
    view. name: the model's name shown on the page. Bad input is a ValueError naming it."""
    if hasattr(tokenizer, "backend_tokenizer"):  # a transformers fast tokenizer: the Tokenizer inside
        tokenizer = tokenizer.backend_tokenizer
    data = page_data(model, tokenizer, text, position, generate)
    data["model"] = name
    blob = json.dumps(data, separators=(",", ":")).replace("</", "<\\/")  # no "</script>" inside the data
    return Page(TEMPLATE.read_text(encoding="utf-8").replace("/*DATA*/", blob))


@torch.no_grad()
def page_data(model: GPT2LMHeadModel, tokenizer: Tokenizer, text: str, position: int = -1, generate: int = 0) -> dict:
    """Everything the page shows, as JSON-ready values (see the module docstring for the encoding)."""
    if not isinstance(model, GPT2LMHeadModel):
        raise ValueError(f"explore needs a gpt2attn GPT2LMHeadModel, got {type(model).__name__}")
    cfg = model.config
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
    model.eval()
    device = model.lm_head.weight.device

    out = model(torch.tensor([ids], device=device), output_attentions=True, output_hidden_states=True, use_cache=False)
    weights = torch.stack(out.attentions)[:, 0].float().cpu()  # (L, nh, T, T)
    logp = out.logits[0].float().log_softmax(-1)  # (T, V)
    top = logp.topk(min(TOP_K, logp.size(-1)))  # (T, k)
    target = int(top.indices[position, 0])
    effects = head_effects(model, out.hidden_states, position, target) - logp[position, target]  # (L, nh)

    return {
        "n_layer": cfg.n_layer,
        "n_head": cfg.n_head,
        "tokens": token_labels(tokenizer, ids),
        "ids": ids,
        "scale": SCALE,
        "threshold": THRESHOLD,
        "position": position,
        "top": [[[label, round(p, 4)] for label, p in zip(token_labels(tokenizer, row_ids), row_p)]
                for row_ids, row_p in zip(top.indices.tolist(), top.values.exp().tolist())],
        "target": token_labels(tokenizer, [target])[0],
        "effects": [[round(e, 4) for e in row] for row in effects.tolist()],
        "attn": [[pack(triangle(w)) for w in layer] for layer in weights],
        "thumbs": thumbnails(weights),
        "steps": decode_steps(model, tokenizer, ids, generate) if generate else None,
    }


def head_effects(model: GPT2LMHeadModel, hidden: tuple[Tensor, ...], position: int, token: int) -> Tensor:
    """log p(token) at `position` with each head zeroed in turn, (L, nh). One batch per layer: row
    b zeroes head b (as inspect.zero_head does to attn.weights), starting from the clean run's
    input to that layer (hidden[L]) and cut after `position`, which no earlier query sees."""
    base, nh = model.transformer, model.config.n_head
    keep = 1.0 - torch.eye(nh, device=hidden[0].device, dtype=hidden[0].dtype)[:, :, None, None]  # (nh, nh, 1, 1)
    rows = []
    for layer, block in enumerate(base.h):
        x = hidden[layer][:, : position + 1].expand(nh, -1, -1)  # (nh, P+1, C)
        x, _, _ = block(x, head_mask=keep)
        for later in base.h[layer + 1:]:
            x, _, _ = later(x)
        logits = model.lm_head(base.ln_f(x[:, -1]))  # (nh, V)
        rows.append(logits.float().log_softmax(-1)[:, token])
    return torch.stack(rows).cpu()


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


def pack(values: Tensor) -> str:
    """round(w * SCALE) as uint16, low bytes then high bytes (the high ones are nearly all zero,
    which zlib packs well), zlib, base64."""
    q = np.round(values.numpy().astype(np.float64) * SCALE).astype("<u2")
    planes = q.view(np.uint8).reshape(-1, 2).T  # (2, n): low bytes, high bytes
    return base64.b64encode(zlib.compress(planes.tobytes(), 6)).decode("ascii")


def thumbnails(weights: Tensor) -> dict:
    """Every head max-pooled to (S, S) cells, S = min(T, THUMB), 0..255 per cell; one block."""
    L, nh, T, _ = weights.shape
    size = min(T, THUMB)
    pooled = F.adaptive_max_pool2d(weights.reshape(L * nh, 1, T, T), size)  # (L*nh, 1, S, S)
    cells = (pooled.clamp(0, 1) * 255).round().to(torch.uint8).numpy()
    return {"size": size, "data": base64.b64encode(zlib.compress(cells.tobytes(), 6)).decode("ascii")}
