"""`gpt2attn parity A [B]`: does a checkpoint give the same numbers in gpt2attn and transformers? Or
with B: where, layer by layer, does source B (a bf16 or quantized copy, say) depart from A?"""

from __future__ import annotations

HELP = "compare a checkpoint in gpt2attn and in transformers, or with a second source, layer by layer (non-zero exit on mismatch)"


def add_arguments(parser) -> None:
    parser.add_argument(
        "src", help="HF folder, hub name, .safetensors/.bin file (llm.c or PyTorch), nanoGPT ckpt.pt, or OpenAI TF "
        "checkpoint folder"
    )
    parser.add_argument("other", nargs="?", help="a second source of any of these kinds, also loaded by gpt2attn, as "
                        "the reference (default: SRC in transformers)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text", help="input text (needs tokenizer files in SRC)")
    source.add_argument("--tokens", type=int, default=16, help="N random token ids as input (default 16)")
    parser.add_argument("--batch", type=int, default=2, help="rows of random tokens (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    dtypes = ["float32", "fp32", "float16", "fp16", "bfloat16", "bf16"]
    parser.add_argument("--dtype", choices=dtypes, default="float32",
                        help="run both models in this dtype (a bf16 source in float32 shows its rounding alone)")
    parser.add_argument("--tol", type=float, help="fp32: relative tolerance (default 1e-4); fp16/bf16: the multiple of "
                        "transformers' own rounding error allowed (default 1.5)")


def run(args) -> int:
    import torch

    from ..formats.state_dict import resolve_dtype
    from ..hub import resolve
    from ..model import GPT2LMHeadModel
    from ..parity import check_same_shape, compare, import_transformers, load_reference, tokenize

    if args.tol is not None and not args.tol > 0:
        raise ValueError(f"--tol must be > 0, got {args.tol}")
    path = resolve(args.src)
    ids = tokenize(path if path.is_dir() else path.parent, args.text) if args.text is not None else None
    ours = GPT2LMHeadModel.from_pretrained(path, dtype=args.dtype)
    if args.other is not None:  # both in gpt2attn: the departure is the weights'
        reference = GPT2LMHeadModel.from_pretrained(args.other, dtype=args.dtype)
        check_same_shape(ours, reference, args.src, args.other)
        reference_name, described = "B", f"A: {args.src}, B (the reference): {args.other}, both in gpt2attn"
    else:
        try:
            transformers = import_transformers()
        except ImportError as e:
            raise ValueError(str(e)) from None
        reference, described = load_reference(transformers, path, ours, resolve_dtype(args.dtype, ours.config))
        reference_name = "transformers"
    n_positions, vocab = ours.config.n_positions, ours.config.vocab_size
    if ids is not None:
        if not ids:
            raise ValueError("--text gives no tokens")
        input_ids = torch.tensor([ids[:n_positions]])
        inputs = f"{len(ids[:n_positions])} tokens of --text"
    else:
        if not 1 <= args.tokens <= n_positions or args.batch < 1:
            raise ValueError(f"--tokens must be in [1, {n_positions}] (n_positions) and --batch >= 1")
        g = torch.Generator().manual_seed(args.seed)
        input_ids = torch.randint(0, vocab, (args.batch, args.tokens), generator=g)
        inputs = f"{args.batch} x {args.tokens} random tokens (seed {args.seed})"
    report = compare(ours, reference, input_ids, tol=args.tol, described=described, reference_name=reference_name)
    if args.other is not None:
        report.notes.append(f"input: {inputs}; dtype: A {ours.dtype}, B {reference.dtype}")
    else:
        report.notes.append(f"input: {inputs}; dtype: gpt2attn {ours.dtype}, transformers {reference.dtype}; "
                            f"transformers {transformers.__version__}")
    print(report.format())
    return 0 if report.passed else 1
