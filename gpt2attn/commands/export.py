"""`gpt2attn export SRC OUT.onnx [--with-cache]`: ONNX files of a model, checked in onnxruntime."""

from __future__ import annotations

from pathlib import Path

HELP = "export a model to ONNX (the forward, or the prefill and decode step with --with-cache) and check it"


def add_arguments(parser) -> None:
    parser.add_argument("src", help="any checkpoint gpt2attn loads (HF folder, hub name, nanoGPT, OpenAI TF)")
    parser.add_argument("out", help="the .onnx file to write; with --with-cache the decode step goes to OUT.decode.onnx")
    parser.add_argument("--with-cache", action="store_true",
                        help="write the prefill (logits + present keys/values) and the decode step (past in, present out)")
    parser.add_argument("--atol", type=float, default=1e-4,
                        help="largest |onnxruntime - eager| accepted over every output (default 1e-4)")


def run(args) -> int:
    from ..interop.export import check_onnx, export_onnx
    from ..model import GPT2LMHeadModel

    model = GPT2LMHeadModel.from_pretrained(args.src, dtype="float32").eval()
    out = Path(args.out)
    if out.suffix != ".onnx":
        raise ValueError(f"OUT must end in .onnx, got {out}")
    files = {"prefill": out, "decode": out.with_suffix(".decode.onnx")} if args.with_cache else {"forward": out}
    failed = False
    for kind, path in files.items():
        export_onnx(model, path, kind)
        diff = check_onnx(model, path, kind)
        ok = diff <= args.atol
        failed |= not ok
        print(f"{kind}: {path} ({path.stat().st_size / 1e6:.1f} MB), onnxruntime vs eager max |diff| {diff:.2e} "
              f"{'PASS' if ok else 'FAIL'}")
    return 1 if failed else 0
