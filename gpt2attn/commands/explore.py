"""`gpt2attn explore`: one self-contained HTML page with every layer and head over a text."""

from __future__ import annotations

import sys
from pathlib import Path

from ..shipped import DEFAULT_MODEL_DIR
from . import load_tokenizer_of, model_folder

HELP = "write one self-contained HTML page with every layer and head, head ablations and decoding steps"


def add_arguments(parser) -> None:
    parser.add_argument("text", help="the input text")
    parser.add_argument("--model", default=str(DEFAULT_MODEL_DIR),
                        help="model folder or hub name, with tokenizer files (default: the shipped default model)")
    parser.add_argument("--generate", type=int, default=0, metavar="N",
                        help="greedy steps to show one by one over the KV cache (default 0: no decoding view)")
    parser.add_argument("--position", type=int, default=-1, metavar="P",
                        help="the query whose prediction the head-ablation table explains (default -1, the last)")
    pair = parser.add_mutually_exclusive_group()
    pair.add_argument("--text-b", metavar="TEXT",
                      help="a second segment, appended to the text: the page gets the sentence-pair filter (A/B)")
    pair.add_argument("--sentence-b-start", type=int, metavar="N",
                      help="the token where the text's second segment starts, for the sentence-pair filter")
    parser.add_argument("--ablate", default="all", metavar="LAYERS",
                        help="the layers whose heads the ablation table zeroes one by one: all (default), none, or "
                             "ranges such as 0-5,10 (each layer costs a pass through it and every later block; "
                             "the cost is printed before they start)")
    parser.add_argument("--out", required=True, help="the HTML file to write")


def layer_list(text: str) -> list[int] | None:
    """--ablate's value: None for all, [] for none, else the layers of ranges like '0-5,10'."""
    if text == "all":
        return None
    if text == "none":
        return []
    layers = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise ValueError(f"--ablate {text}: give all, none, or layers and ranges such as 0-5,10")
        layers += range(int(first), int(last if dash else first) + 1)
    return layers


def page_name(model: str) -> str:
    """The model's name on the page: as given, except the shipped default model, which is named
    as such rather than by its path on this machine."""
    if Path(model).resolve() == Path(DEFAULT_MODEL_DIR).resolve():
        return "gpt2attn default model (char-level Shakespeare)"
    return model


def sentence_pair(tokenizer, a: str, b: str) -> tuple[str, int]:
    """The text a + b and the token where b starts; b must not merge with a's last token."""
    from ..tokenizer import encode

    if not b:
        raise ValueError("--text-b is empty")
    split = len(encode(tokenizer, a))
    if encode(tokenizer, a + b)[:split] != encode(tokenizer, a):
        raise ValueError(f"--text-b {b!r}: its first token merges with the text's last one; start it with a space")
    return a + b, split


def run(args) -> int:
    from tqdm import tqdm

    from ..explore import ablation_cost, explore
    from ..model import GPT2LMHeadModel

    if Path(args.out).is_dir():
        raise ValueError(f"--out {args.out} is a folder; give a file name")
    if args.generate < 0:
        raise ValueError(f"--generate {args.generate}: give 0 or more steps")
    src = model_folder(args.model)
    try:
        tokenizer = load_tokenizer_of(src)
    except FileNotFoundError as e:  # a folder with weights but no tokenizer files
        raise ValueError(str(e)) from None
    text, split = args.text, args.sentence_b_start
    if args.text_b is not None:
        text, split = sentence_pair(tokenizer, args.text, args.text_b)
    ablate = layer_list(args.ablate)
    model = GPT2LMHeadModel.from_pretrained(src).eval()
    L, nh = model.config.n_layer, model.config.n_head
    if ablate is not None and any(layer >= L for layer in ablate):
        raise ValueError(f"--ablate {args.ablate}: this model's layers are 0 to {L - 1}")
    layers = range(L) if ablate is None else sorted(set(ablate))
    cost = ablation_cost(L, layers)

    def progress(n: int) -> None:
        if n == 0:  # the input is good and the ablations start: say what they cost, then show a bar on a terminal
            print(f"head ablations: {len(layers)} of {L} layers x {nh} heads, {cost} block passes (a forward pass "
                  f"is {L}); --ablate LAYERS or none for fewer", file=sys.stderr, flush=True)
        bar.update(n)

    with tqdm(total=cost, unit="block", desc="ablations", disable=None, leave=False) as bar:
        page = explore(model, tokenizer, text, position=args.position, generate=args.generate,
                       name=page_name(args.model), sentence_b_start=split, ablate=ablate, progress=progress)
    page.save(args.out)
    print(f"wrote {args.out}: {model.config.n_layer} layers x {model.config.n_head} heads, "
          f"{len(page.html) / 1e6:.1f} MB", file=sys.stderr)
    return 0
