"""gpt2attn generate: continue a prompt, streaming the decoded text to stdout."""

from __future__ import annotations

import sys
from pathlib import Path

HELP = "continue a prompt with a model, streaming the text"


def add_arguments(parser):
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--model", default=None, help="model folder (config.json, weights, tokenizer); default: the built-in model")
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--greedy", action="store_true", help="take the most likely token instead of sampling")


def run(args) -> int:
    import torch

    from ..generation import DEFAULT_MODEL_DIR
    from ..model import GPT2LMHeadModel
    from ..tokenizer import load_tokenizer

    folder = Path(args.model) if args.model else DEFAULT_MODEL_DIR
    if not folder.exists():
        hint = "" if args.model else " (the built-in model is missing; pass --model FOLDER)"
        raise FileNotFoundError(f"no model at {folder}{hint}")
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    tokenizer = load_tokenizer(folder)
    model = GPT2LMHeadModel.from_pretrained(folder).eval()
    prompt_ids = tokenizer.encode(args.prompt).ids
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    seed = args.seed if args.seed is not None else torch.seed()
    for i in range(args.num_samples):
        if i:
            print("\n---------------")
        steps = model.generate(
            torch.tensor([prompt_ids]),
            max_new_tokens=min(args.max_new_tokens, model.config.n_positions - len(prompt_ids)),
            do_sample=not args.greedy,
            temperature=args.temperature,
            top_k=args.top_k,
            top_p=args.top_p,
            repetition_penalty=args.repetition_penalty,
            eos_token_id=eos_id,
            seed=seed + i,
            stream=True,
        )
        _print_stream(tokenizer, prompt_ids, steps)
    print()
    return 0


def _print_stream(tokenizer, prompt_ids, steps) -> None:
    """Print the prompt, then each new piece of decoded text as soon as it is whole."""
    ids = list(prompt_ids)
    shown = tokenizer.decode(ids)
    sys.stdout.write(shown)
    sys.stdout.flush()
    for tokens in steps:
        ids.append(int(tokens[0]))
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        sys.stdout.write(text[len(shown) :])
        sys.stdout.flush()
        shown = text
