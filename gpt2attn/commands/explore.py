"""`gpt2attn explore`: one self-contained HTML page with every layer and head over a text."""

from __future__ import annotations

import sys
from pathlib import Path

from ..generation import DEFAULT_MODEL_DIR
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
    parser.add_argument("--out", required=True, help="the HTML file to write")


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
    from ..explore import explore
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
    model = GPT2LMHeadModel.from_pretrained(src).eval()
    page = explore(model, tokenizer, text, position=args.position, generate=args.generate, name=page_name(args.model),
                   sentence_b_start=split)
    page.save(args.out)
    print(f"wrote {args.out}: {model.config.n_layer} layers x {model.config.n_head} heads, "
          f"{len(page.html) / 1e6:.1f} MB", file=sys.stderr)
    return 0
