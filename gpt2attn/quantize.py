"""int8 decoding on the CPU, and a check for bf16 before it runs tens of times slower.

    model = GPT2LMHeadModel.from_pretrained(src, quantize="int8")   # or model.quantize("int8")

`quantize(model, "int8")` replaces, in place, every `Conv1D` (attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj) by an `Int8Conv1D` and the `lm_head` by an `Int8Linear` (`Int8TiedLinear` when it
shares the token embedding), under the same names: the
model stays a gpt2attn model, so generate, the KV cache and the inspect taps (which live on Block,
Attention and MLP, around these layers) work unchanged. Embeddings, LayerNorms, attention itself
and the residual stream stay fp32.

The kernel, for every layer: fbgemm's dynamic int8 linear (`quantized::linear_dynamic`). Weights
are int8, one scale per output channel, packed once for the CPU; each call quantizes its input
to 8 bits with one scale and zero point for the whole input (7 bits with `reduce_range`, so AVX2's
int16 pair sums cannot saturate), multiplies in int32 and returns fp32 with the bias added.
Weight-only and dynamic-activation int8 were measured per layer shape of gpt2-small on this project's AVX2
CPU (`python scripts/bench.py generate --quantize int8 --layers`, which prints the per-layer table): the
dynamic kernel was the fastest for every shape at 1, 8 and 512 rows (1.1-7x fp32; level with it
only for the 768x768 projection at one row), while the weight-only kernels (torch's
`_weight_int8pack_mm`, torchao 0.18's `Int8WeightOnlyConfig`) and torchao's dynamic
`Int8DynamicActivationInt8WeightConfig` were slower than fp32, or at best level with it, for
every shape here. So every layer takes the dynamic kernel, and torchao is not a dependency.
Packing goes through `torch.quantize_per_channel`, which torch 2.13 marks deprecated (its warning
is silenced here); the kernel itself is not.

`state_dict()` of a quantized model has Hugging Face's keys and shapes; each quantized weight is
the fp32 tensor it computes with (int8 times its scale), and a tied head gives the embedding it
was quantized from. So `save_pretrained` writes an ordinary fp32 folder that transformers opens,
and `from_pretrained(folder, quantize="int8")` rebuilds the very same int8 weights: no int8 format
on disk, as fbgemm's packed layout belongs to the CPU that packed it and quantizing at load costs
a few CPU seconds for gpt2-small (3.5 s measured on this project's shared machine). Quantized
layers are for inference: no gradients flow through them.

bf16: matrix products in bf16 are fast only on CPUs with AMX or AVX512-BF16; elsewhere torch
emulates them (a 512x768x3072 product: 112 ms in fp32, 8747 ms in bf16 in one run on this
project's AMD EPYC with AVX2). `cpu_bf16_report()` says which this CPU is, and `quantize(model, "bf16")` casts the
model to bf16 only where it pays, raising otherwise.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

from .layers import Conv1D

MODES = ("int8", "bf16")
KERNEL = "fbgemm dynamic int8 (quantized::linear_dynamic)"


class Int8Linear(nn.Module):
    """y = x Wᵀ + b with W in int8 (per output channel) and x quantized on each call.

    Built from an fp32 weight (out, in) and bias; keeps only fbgemm's packed copy of them.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.has_bias = bias is not None
        self.kernel = KERNEL
        self._pack(weight, bias)

    def _pack(self, weight: Tensor, bias: Tensor | None) -> None:
        weight = weight.detach().float()
        scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).double()  # (out,)
        zero = torch.zeros(weight.size(0), dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates creating quantized tensors
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        self.packed = torch.ops.quantized.linear_prepack(qweight, None if bias is None else bias.detach().float())

    def forward(self, x: Tensor) -> Tensor:
        out = torch.ops.quantized.linear_dynamic(x.reshape(-1, self.in_features), self.packed, True)  # (N, out)
        return out.view(*x.shape[:-1], self.out_features)

    def int8_weight(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """(int8 weight (out, in), fp32 scale per output channel (out,), bias or None)."""
        qweight, bias = torch.ops.quantized.linear_unpack(self.packed)
        return qweight.int_repr(), qweight.q_per_channel_scales().float(), bias

    def dequantized_weight(self) -> Tensor:
        """The fp32 weight (out, in) this layer computes with."""
        w8, scale, _ = self.int8_weight()
        return w8.float() * scale[:, None]

    # state_dict: the layer's own layout and names, fp32, so checkpoints stay Hugging Face's.
    def _weight_for_state_dict(self) -> Tensor:
        return self.dequantized_weight()

    def _weight_from_state_dict(self, weight: Tensor) -> Tensor:
        return weight

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self._weight_for_state_dict()
        if self.has_bias:
            destination[prefix + "bias"] = self.int8_weight()[2]

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = [prefix + "weight"] + ([prefix + "bias"] if self.has_bias else [])
        missing = [name for name in names if name not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        weight = self._weight_from_state_dict(state_dict[prefix + "weight"])
        if tuple(weight.shape) != (self.out_features, self.in_features):
            error_msgs.append(f"size mismatch for {prefix}weight: {tuple(state_dict[prefix + 'weight'].shape)} "
                              f"does not fit {self.in_features} inputs and {self.out_features} outputs")
            return
        self._pack(weight, state_dict.get(prefix + "bias"))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Int8Conv1D(Int8Linear):
    """Int8Linear standing in for a Conv1D: its state_dict weight is (in, out), as Conv1D's."""

    def __init__(self, conv: Conv1D):
        super().__init__(conv.weight.t(), conv.bias)

    def _weight_for_state_dict(self) -> Tensor:
        return self.dequantized_weight().t()

    def _weight_from_state_dict(self, weight: Tensor) -> Tensor:
        return weight.t()


class Int8TiedLinear(Int8Linear):
    """An int8 LM head quantized from the token embedding it is tied to; its state_dict weight is
    that embedding (so a checkpoint keeps the tie and stores the matrix once)."""

    def __init__(self, weight: nn.Parameter):
        super().__init__(weight, None)
        self._tied = (weight,)  # a tuple, so nn.Module does not register it as this layer's parameter

    def _weight_for_state_dict(self) -> Tensor:
        return self._tied[0]


def quantize(model: nn.Module, mode: str = "int8") -> nn.Module:
    """Quantize `model` in place for CPU inference and return it; mode is 'int8' or 'bf16'."""
    if mode not in MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; choose one of {', '.join(MODES)}")
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"quantize({mode!r}) is for models on the CPU; this one is on {param.device}")
    if mode == "bf16":
        fast, report = cpu_bf16_report()
        if not fast:
            raise RuntimeError(f"not casting to bf16: {report}. Use quantize('int8') for decoding, or stay in fp32")
        return model.to(torch.bfloat16)
    if param.dtype != torch.float32:
        raise ValueError(f"quantize('int8') needs an fp32 model, this one is {param.dtype}")
    if torch.backends.quantized.engine == "none":
        raise RuntimeError("torch has no quantized engine on this CPU (torch.backends.quantized.engine is 'none')")
    for name, module in list(model.named_modules()):
        if isinstance(module, Int8Linear):
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        if isinstance(module, Conv1D):
            setattr(parent, child, Int8Conv1D(module))
        elif name.endswith("lm_head") and isinstance(module, nn.Linear):
            wte = getattr(getattr(model, "transformer", None), "wte", None)
            tied = wte is not None and module.weight is wte.weight
            setattr(parent, child, Int8TiedLinear(module.weight) if tied else Int8Linear(module.weight, module.bias))
    return model


def kernels(model: nn.Module) -> dict[str, str]:
    """Module name -> the kernel its matrix product runs on, for every quantized layer."""
    return {name: m.kernel for name, m in model.named_modules() if isinstance(m, Int8Linear)}


def cpu_bf16_report() -> tuple[bool, str]:
    """(whether this CPU multiplies bf16 natively, a sentence saying what it has)."""
    flags = _cpu_flags()
    native = sorted(flags & {"amx_bf16", "avx512_bf16"})
    capability = torch.backends.cpu.get_cpu_capability()
    if native:
        return True, f"this CPU has {' and '.join(native)} (torch capability {capability}): bf16 matrix products are native"
    return False, (
        f"this CPU has neither amx_bf16 nor avx512_bf16 (torch capability {capability}), so torch emulates "
        f"bf16 matrix products, tens of times slower than fp32"
    )


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:  # not Linux: no way to tell here, so no native bf16 is claimed
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.partition(":")[2].split())
    return set()
