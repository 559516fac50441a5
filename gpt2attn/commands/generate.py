"""gpt2attn generate: continue a prompt, streaming the decoded text to stdout."""

from __future__ import annotations

import sys
from collections.abc import Iterator

HELP = "continue a prompt with a model, streaming the text"


def add_arguments(parser):
    parser.add_argument("prompt", help="text to continue")
    parser.add_argument("--model", default=None, help="model folder or hub name (config.json, weights, tokenizer); default: the built-in model")
    parser.add_argument("--max-new-tokens", type=int, default=300,
                        help="tokens to add (default 300); past the model's context the window slides")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--repetition-penalty", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random)")
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--greedy", action="store_true", help="take the most likely token instead of sampling")
    parser.add_argument("--quantize", choices=["int8", "bf16"], default=None,
                        help="int8: quantized matrix products for faster CPU decoding (see gpt2attn.quantize)")


def run(args) -> int:
    import torch

    from . import model_folder
    from ..generation import DEFAULT_MODEL_DIR
    from ..model import GPT2LMHeadModel
    from ..tokenizer import encode, load_tokenizer

    folder = model_folder(args.model) if args.model else DEFAULT_MODEL_DIR  # a folder, or a hub name's cached one
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tokenizer = load_tokenizer(folder)
    model = GPT2LMHeadModel.from_pretrained(folder, quantize=args.quantize).eval()
    prompt_ids = encode(tokenizer, args.prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    seed = args.seed if args.seed is not None else torch.seed()
    sampling = dict(do_sample=not args.greedy, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty, eos_token_id=eos_id)
    for i in range(args.num_samples):
        if i:
            print("\n---------------")
        generator = torch.Generator().manual_seed(seed + i)
        tokens = continue_ids(model, prompt_ids, args.max_new_tokens, generator=generator, **sampling)
        _print_stream(tokenizer, prompt_ids, tokens)
    print()
    return 0


def continue_ids(model, prompt_ids: list[int], max_new_tokens: int, **sampling) -> Iterator[int]:
    """Yield up to max_new_tokens new token ids (fewer if eos comes).

    The model sees at most n_positions tokens. A prompt longer than that is cut to its last
    n_positions - 1; when the text outgrows the context, decoding starts again from its last
    n_positions // 2 tokens (a sliding window, as nanoGPT's sampler crops to block_size).
    """
    import torch

    n_ctx = model.config.n_positions
    ids = list(prompt_ids)
    context = ids[-(n_ctx - 1) :]
    remaining = max_new_tokens
    while remaining > 0:
        n = min(remaining, n_ctx - len(context))
        for step in model.generate(torch.tensor([context]), max_new_tokens=n, stream=True, **sampling):
            token = int(step[0])
            ids.append(token)
            yield token
            if token == sampling.get("eos_token_id"):
                return
        remaining -= n
        context = ids[-(n_ctx // 2) :]


def _print_stream(tokenizer, prompt_ids, tokens) -> None:
    """Print the prompt, then each new piece of decoded text as soon as it is whole."""
    ids = list(prompt_ids)
    shown = tokenizer.decode(ids)
    sys.stdout.write(shown)
    sys.stdout.flush()
    for token in tokens:
        ids.append(token)
        text = tokenizer.decode(ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        sys.stdout.write(text[len(shown) :])
        sys.stdout.flush()
        shown = text
