"""torch.export and ONNX of GPT2LMHeadModel as a deployed model runs it: a plain forward, the prefill
and the decode step.

They take and return plain tensors, the cache flattened layer by layer (key, value, key, ...), so an
ONNX runtime feeds one step's `present.*` outputs back as the next step's `past.*` inputs:

    forward  input_ids (B, T)                                    -> logits (B, T, V)
    prefill  input_ids (B, T)                                    -> logits, present.{i}.key/value (B, nh, T, hs)
    decode   input_ids (B, 1), past.{i}.key/value (B, nh, P, hs) -> logits (B, 1, V), present.* (B, nh, P + 1, hs)

Batch, sequence and past lengths are dynamic. onnx / onnxscript / onnxruntime are imported lazily.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.export import Dim

from ..model import GPT2LMHeadModel


class Forward(nn.Module):
    """Logits only, no cache."""

    def __init__(self, model: GPT2LMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids, use_cache=False, return_dict=True).logits


class Prefill(nn.Module):
    """The prompt in one pass: logits and every layer's keys/values."""

    def __init__(self, model: GPT2LMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor) -> tuple[Tensor, ...]:
        out = self.model(input_ids, use_cache=True, return_dict=True)
        return (out.logits, *_flatten(out.cache))


class DecodeStep(nn.Module):
    """One new token per row after P cached ones: logits and the keys/values now P + 1 long."""

    def __init__(self, model: GPT2LMHeadModel):
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, *past: Tensor) -> tuple[Tensor, ...]:
        pairs = tuple(zip(past[0::2], past[1::2]))  # ((key, value), ...) per layer
        out = self.model(input_ids, cache=pairs, use_cache=True, return_dict=True)
        return (out.logits, *_flatten(out.cache))


STEPS = {"forward": Forward, "prefill": Prefill, "decode": DecodeStep}


def _flatten(cache) -> list[Tensor]:
    return [t for key_value in cache.to_legacy() for t in key_value]


def _step(model: GPT2LMHeadModel, kind: str) -> nn.Module:
    if kind not in STEPS:
        raise ValueError(f"unknown step {kind!r}; choose one of {', '.join(STEPS)}")
    return STEPS[kind](model).eval()


def io_names(n_layer: int, kind: str) -> tuple[list[str], list[str]]:
    """ONNX input and output names: input_ids [past.{i}.key, past.{i}.value ...] -> logits [present.*]"""
    kv = lambda prefix: [f"{prefix}.{i}.{part}" for i in range(n_layer) for part in ("key", "value")]  # noqa: E731
    inputs = ["input_ids", *(kv("past") if kind == "decode" else [])]
    return inputs, ["logits", *(kv("present") if kind != "forward" else [])]


def example_inputs(model: GPT2LMHeadModel, kind: str, batch: int = 2, seq: int = 5, past: int = 3,
                   seed: int = 0) -> tuple[Tensor, ...]:
    """Random inputs of the step's shapes: (ids (B, T),), or (ids (B, 1), *past) for the decode step."""
    cfg, p = model.config, next(model.parameters())
    g = torch.Generator().manual_seed(seed)
    if kind != "decode":
        return (torch.randint(0, cfg.vocab_size, (batch, seq), generator=g),)
    ids = torch.randint(0, cfg.vocab_size, (batch, 1), generator=g)
    shape = (batch, cfg.n_head, past, cfg.n_embd // cfg.n_head)
    return (ids, *(torch.randn(shape, generator=g).to(p) for _ in range(2 * cfg.n_layer)))


def dynamic_shapes(model: GPT2LMHeadModel, kind: str) -> tuple:
    """Batch and sequence length dynamic; for the decode step batch and past length (one new token)."""
    cfg = model.config
    batch = Dim("batch", min=1, max=1024)
    if kind != "decode":
        return ({0: batch, 1: Dim("seq", min=1, max=cfg.n_positions)},)
    past = Dim("past", min=1, max=cfg.n_positions - 1)
    return ({0: batch}, tuple({0: batch, 2: past} for _ in range(2 * cfg.n_layer)))


def export_program(model: GPT2LMHeadModel, kind: str = "forward") -> torch.export.ExportedProgram:
    """torch.export of one step, dynamic in batch and lengths."""
    step = _step(model, kind)
    return torch.export.export(step, example_inputs(model, kind), dynamic_shapes=dynamic_shapes(model, kind))


def export_onnx(model: GPT2LMHeadModel, path: str | Path, kind: str = "forward") -> Path:
    """Write one step as ONNX (torch.onnx.export with dynamo=True); returns the path."""
    path = Path(path)
    step = _step(model, kind)
    inputs, outputs = io_names(model.config.n_layer, kind)
    program = torch.onnx.export(
        step, example_inputs(model, kind), dynamo=True, dynamic_shapes=dynamic_shapes(model, kind),
        input_names=inputs, output_names=outputs, verbose=False,
    )
    path.parent.mkdir(parents=True, exist_ok=True)
    # onnx_ir itself rather than program.save(): torch reaches onnx_ir through a lazy proxy whose
    # `.save` is shadowed once nnsight has given every object a `.save` (after any nnsight trace).
    import onnx_ir

    n_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    external = path.name + ".data" if n_bytes > 2**31 - 2**20 else None  # a protobuf holds < 2 GB
    tmp = path.with_name(path.name + ".tmp")  # written whole, then renamed into place
    onnx_ir.save(program.model, tmp, external_data=external)
    os.replace(tmp, path)
    return path


def check_onnx(model: GPT2LMHeadModel, path: str | Path, kind: str = "forward", batch: int = 3, seq: int = 7,
               past: int = 4) -> float:
    """Run the ONNX file in onnxruntime on inputs shaped unlike the export's examples; returns the
    largest |difference| from eager over every output."""
    import onnxruntime

    inputs = example_inputs(model, kind, batch=batch, seq=seq, past=past, seed=1)
    names, _ = io_names(model.config.n_layer, kind)
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = session.run(None, {n: t.numpy() for n, t in zip(names, inputs)})
    with torch.no_grad():
        want = _step(model, kind)(*inputs)
    want = (want,) if isinstance(want, Tensor) else want
    if len(got) != len(want):
        raise ValueError(f"{path}: {len(got)} outputs, eager gives {len(want)}")
    return max((torch.from_numpy(g).double() - w.double()).abs().max().item() for g, w in zip(got, want))
