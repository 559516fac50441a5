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
    parser.add_argument("--greedy", action="store_true", help="take the most likely token instead of sampling")
    parser.add_argument("--num-samples", type=int, default=1, help="continuations to write, each with its own seed")
    parser.add_argument("--seed", type=int, default=None, help="seed for sampling (default: random); sample i uses seed + i")
    parser.add_argument("--stop", action="append", default=None, metavar="TEXT", help="stop once TEXT is written (repeatable)")
    parser.add_argument("--prompt-lookup", type=int, default=None, metavar="N",
                        help="greedy only: draft N tokens at a time from earlier text and verify them in one pass")
    # Unset settings come from the model's generation config (generation_config.json, else its defaults).
    for flag, kind in (("--temperature", float), ("--top-k", int), ("--top-p", float), ("--min-p", float),
                       ("--typical-p", float), ("--repetition-penalty", float), ("--no-repeat-ngram-size", int),
                       ("--min-new-tokens", int), ("--num-beams", int), ("--length-penalty", float)):
        parser.add_argument(flag, type=kind, default=None, help="default: the model's generation config")
    parser.add_argument("--quantize", choices=["fp32", "fp16", "bf16", "int8", "q4"], default=None,
                        help="CPU decoding at the memory's read rate with weights in this precision "
                             "(see gpt2attn.quantize, docs/cpu-decoding.md)")


SETTINGS = ("temperature", "top_k", "top_p", "min_p", "typical_p", "repetition_penalty", "no_repeat_ngram_size",
            "min_new_tokens", "num_beams", "length_penalty")


def run(args) -> int:
    import torch

    from . import load_tokenizer_of, model_folder
    from ..shipped import DEFAULT_MODEL_DIR
    from ..model import GPT2LMHeadModel
    from ..tokenizer import encode

    folder = model_folder(args.model) if args.model else DEFAULT_MODEL_DIR  # a folder, or a hub name's cached one
    if args.num_samples < 1:
        raise ValueError(f"--num-samples must be >= 1, got {args.num_samples}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    tokenizer = load_tokenizer_of(folder)
    model = GPT2LMHeadModel.from_pretrained(folder, quantize=args.quantize).eval()
    if tokenizer.get_vocab_size() > model.config.vocab_size:
        raise ValueError(f"{folder}: the tokenizer has {tokenizer.get_vocab_size()} tokens but the model's "
                         f"vocabulary only {model.config.vocab_size} (vocab_size): they do not belong together")
    prompt_ids = encode(tokenizer, args.prompt)
    if not prompt_ids:
        raise ValueError("the prompt encodes to no tokens")
    settings = {name: getattr(args, name) for name in SETTINGS if getattr(args, name) is not None}
    settings["do_sample"] = not args.greedy
    eos_id = tokenizer.token_to_id("<|endoftext|>")
    if eos_id is not None:
        settings["eos_token_id"] = eos_id
    if args.stop:
        settings.update(stop_strings=args.stop, tokenizer=tokenizer)
    if args.prompt_lookup is not None:
        settings["prompt_lookup_num_tokens"] = args.prompt_lookup
        if not args.greedy:
            raise ValueError("--prompt-lookup needs --greedy (assisted decoding is greedy)")
    cfg = model.generation_config.update(**{k: v for k, v in settings.items() if k != "tokenizer"})
    cfg.check(model.config.vocab_size, keywords=settings)  # bad settings fail here, before any output
    seed = args.seed if args.seed is not None else torch.seed()
    for i in range(args.num_samples):
        if i:
            print("\n---------------")
        generator = torch.Generator().manual_seed(seed + i)  # every sample its own seed
        tokens = continue_ids(model, prompt_ids, args.max_new_tokens, generator=generator, **settings)
        _print_stream(tokenizer, prompt_ids, tokens)
    print()
    return 0


def continue_ids(model, prompt_ids: list[int], max_new_tokens: int, **settings) -> Iterator[int]:
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
    beams = (settings.get("num_beams") or model.generation_config.num_beams) > 1
    while remaining > 0:
        n = min(remaining, n_ctx - len(context))
        if beams:  # beam search gives its best sequence at the end
            out = model.generate(torch.tensor([context]), max_new_tokens=n, **settings)
            steps = out[0, len(context) :, None]
        else:
            steps = model.generate(torch.tensor([context]), max_new_tokens=n, stream=True, **settings)
        produced = 0
        for step in steps:
            token = int(step[0])
            ids.append(token)
            produced += 1
            yield token
        if produced < n or token == settings.get("eos_token_id"):  # eos or a stop string ended it
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
