"""`gpt2attn parity SRC`: does a checkpoint give the same numbers in gpt2attn and transformers?"""

from __future__ import annotations

HELP = "compare a checkpoint in gpt2attn and in transformers, layer by layer (non-zero exit on mismatch)"


def add_arguments(parser) -> None:
    parser.add_argument(
        "src", help="HF folder, hub name, .safetensors/.bin file, nanoGPT ckpt.pt, or OpenAI TF checkpoint folder"
    )
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", help="input text (needs tokenizer files in SRC)")
    source.add_argument("--tokens", type=int, default=16, help="N random token ids as input (default 16)")
    parser.add_argument("--batch", type=int, default=2, help="rows of random tokens (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    dtypes = ["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"]
    parser.add_argument("--dtype", choices=dtypes, default="float32", help="run both models in this dtype")
    parser.add_argument("--tol", type=float, help="fp32: relative tolerance (default 1e-4); fp16/bf16: the multiple of "
                        "transformers' own rounding error allowed (default 1.5)")


def run(args) -> int:
    import torch

    from ..formats.state_dict import resolve_dtype
    from ..hub import resolve
    from ..model import GPT2LMHeadModel
    from ..parity import compare, import_transformers, load_reference, tokenize

    if args.tol is not None and not args.tol > 0:
        raise ValueError(f"--tol must be > 0, got {args.tol}")
    try:
        transformers = import_transformers()
    except ImportError as e:
        raise ValueError(str(e)) from None
    path = resolve(args.src)
    ids = tokenize(path if path.is_dir() else path.parent, args.text) if args.text is not None else None
    ours = GPT2LMHeadModel.from_pretrained(path, dtype=args.dtype)
    dtype = resolve_dtype(args.dtype, ours.config)
    reference, hf_source = load_reference(transformers, path, ours, dtype)
    n_positions, vocab = ours.config.n_positions, ours.config.vocab_size
    if ids is not None:
        if not ids:
            raise ValueError("--text gives no tokens")
        input_ids = torch.tensor([ids[:n_positions]])
        described = f"{len(ids[:n_positions])} tokens of --text"
    else:
        if not 1 <= args.tokens <= n_positions or args.batch < 1:
            raise ValueError(f"--tokens must be in [1, {n_positions}] (n_positions) and --batch >= 1")
        g = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(0, vocab, (args.batch, args.tokens), generator=g)
        described = f"{args.batch} x {args.tokens} random tokens (seed {args.seed})"
    report = compare(ours, reference, input_ids, tol=args.tol, hf_source=hf_source)
    report.notes.append(f"input: {described}; dtype: gpt2attn {ours.dtype}, transformers {reference.dtype}; "
                        f"transformers {transformers.__version__}")
    print(report.format())
    return 0 if report.passed else 1
