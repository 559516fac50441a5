"""`gpt2attn attention`: heatmaps (or JSON) of one layer's attention weights over a text."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

from ..files import write_atomic, write_text_atomic
from ..shipped import DEFAULT_MODEL_DIR
from . import load_tokenizer_of, model_folder

HELP = "draw the attention weights of one layer (all heads, or one) over a text, as PNG or JSON"


def add_arguments(parser) -> None:
    parser.add_argument("text", help="the input text")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                        help="model folder or hub name, with tokenizer files (default: the shipped default model)")
    parser.add_argument("--layer", type=int, default=-1, help="block index; negative counts from the end (default -1)")
    parser.add_argument("--head", type=int, help="draw only this head (default: all heads as a grid)")
    parser.add_argument("--format", choices=["png", "json"], default="png")
    parser.add_argument("--out", help="output file (needed for png; json goes to stdout without it)")


def run(args) -> int:
    if args.format == "png" and not args.out:
        raise ValueError("--out FILE is needed for a png (or use --format json)")
    if args.out and Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; give a file name")
    ids, tokens, weights, layer, heads = attention_weights(args.model, args.text, args.layer, args.head)
    if args.format == "json":
        doc = {"model": str(args.model), "layer": layer, "heads": heads, "ids": ids, "tokens": tokens,
               "weights": [[[round(w, 6) for w in row] for row in head] for head in weights.tolist()]}
        text = json.dumps(doc) + "\n"
        if args.out:
            write_text_atomic(args.out, text)
        else:
            sys.stdout.write(text)
    else:
        from ..tokenizer import visible

        draw([visible(t) for t in tokens], weights, layer, heads, args.out)
    if args.out:
        print(f"wrote {args.out}: layer {layer}, {len(heads)} head(s), {len(tokens)} tokens", file=sys.stderr)
    return 0


def attention_weights(src, text: str, layer: int, head: int | None):
    """Returns (ids, token texts, weights (n_heads_drawn, T, T) float32, layer, head indices)."""
    import torch

    from .. import inspect
    from ..model import GPT2LMHeadModel
    from ..tokenizer import encode

    src = model_folder(src)  # a folder, or a hub name's cached folder
    tokenizer = load_tokenizer_of(src)
    model = GPT2LMHeadModel.from_pretrained(src).eval()
    cfg = model.config
    ids = encode(tokenizer, text)
    if not ids:
        raise ValueError("the text gives no tokens")
    if len(ids) > cfg.n_positions:
        raise ValueError(f"the text is {len(ids)} tokens; this model's context is {cfg.n_positions}")
    if not -cfg.n_layer <= layer < cfg.n_layer:
        raise ValueError(f"--layer {layer} is out of range for {cfg.n_layer} layers")
    layer %= cfg.n_layer
    if head is not None and not 0 <= head < cfg.n_head:
        raise ValueError(f"--head {head} is out of range for {cfg.n_head} heads (0..{cfg.n_head - 1})")
    with torch.no_grad():
        _, acts = inspect.run_with_cache(model, torch.tensor([ids]), layers=[layer], names=["weights"])
    weights = acts[f"h.{layer}.attn.weights"][0].float()  # (nh, T, T)
    heads = list(range(cfg.n_head)) if head is None else [head]
    return ids, [tokenizer.decode([i]) for i in ids], weights[heads], layer, heads


def draw(tokens: list[str], weights, layer: int, heads: list[int], out: str) -> None:
    """One heatmap per head (query rows, key columns) in a grid, one shared colour bar."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ValueError("drawing needs matplotlib: pip install matplotlib (or use --format json)") from e

    T = len(tokens)
    cols = math.ceil(math.sqrt(len(heads)))
    rows = math.ceil(len(heads) / cols)
    cell = max(3.0, 0.14 * T + 1.0)  # inches per heatmap: ~0.14 in per token keeps labels apart
    fontsize = 9 if T <= 24 else 7
    fig, axes = plt.subplots(rows, cols, figsize=(cols * cell + 1.2, rows * cell + 0.6),
                             squeeze=False, layout="constrained")
    vmax = float(weights.max())
    for ax, head, w in zip(axes.flat, heads, weights):
        image = ax.imshow(w.numpy(), cmap="viridis", vmin=0.0, vmax=vmax)
        ax.set_title(f"layer {layer}, head {head}", fontsize=fontsize + 2)
        ax.set_xticks(range(T), tokens, rotation=90, fontsize=fontsize)
        ax.set_yticks(range(T), tokens, fontsize=fontsize)
        ax.set_xlabel("key", fontsize=fontsize + 1)
        ax.set_ylabel("query", fontsize=fontsize + 1)
    for ax in axes.flat[len(heads):]:
        ax.axis("off")
    fig.colorbar(image, ax=axes, shrink=0.6, label="attention weight")
    try:
        write_atomic(out, lambda f: fig.savefig(f, format="png", dpi=100, bbox_inches="tight"))
    finally:
        plt.close(fig)
