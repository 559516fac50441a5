"""CPU inference: the weights of every matrix product in fp32, fp16, bf16, int8 or 4 bits (q4),
decoded at the speed of reading them.

    model = GPT2LMHeadModel.from_pretrained(src, quantize="int8")   # or model.quantize("fp16"), ...

`quantize(model, mode)` replaces, in place, every `Conv1D` (attn.c_attn, attn.c_proj, mlp.c_fc,
mlp.c_proj) and the `lm_head` by a `CpuLinear` under the same name, holding its weight as `mode`:

    fp32  the very same parameters (no copy; still trainable: with gradients on, plain torch)
    fp16  16-bit copies as (out, in) rows, widened to fp32 inside the kernel (F16C); fp32 sums
    bf16  the same in bfloat16 (widened by a 16-bit shift: any AVX2 CPU does it at full speed)
    int8  int8, one scale per output channel (the fp32 weight rounded to 255 levels per row)
    q4    llama.cpp's Q4_K (gpt2attn.q4_k): 4.5 bits a weight, 16 levels per 32 weights with a
          6-bit scale and min, for the blocks' attn.c_proj, mlp.c_fc and mlp.c_proj; int8 (as
          above) where llama.cpp's q4_K_M spends more bits (the head, attn.c_attn, mlp.c_proj in
          some blocks) and for rows Q4_K cannot hold (gpt2attn.q4_k.keeps_8_bits)

The layers are replaced one at a time, each fp32 Conv1D let go (and malloc's freed pages handed
back) before the next is read, and each packed weight goes after the one before in a WeightArena
(huge pages, in the order a step reads them): the model then holds `mode`'s weights and no fp32
copy of them. from_pretrained(src, quantize=mode) leaves the matrices unread until each is packed
(the `read` argument), so whatever the file, its fp32 matrices are never all in memory at once
(docs/cpu-decoding.md, Memory). A model already in fp16 or bf16 is widened the same way: what
stays becomes fp32, and each matrix is widened only as it is packed. A head tied to the
embedding goes first: once its copy is packed, the embedding's pages of a mapped file are
unmapped (memory.release_file_pages), and lookups map back the rows they use.

The model stays a gpt2attn model: generate, the KV cache and the inspect taps (on Block,
Attention and MLP, around these layers) work unchanged. Embeddings, LayerNorms and attention stay
fp32. generate() decodes a quantized model, as a plain fp32 one, in one call per token
(gpt2attn.decode_step); a forward of the modules takes, in each layer, per call:
  - at most DECODE_ROWS rows (decoding: batch x new tokens): gpt2attn.kernels' products, which
    read each weight once on all of torch's threads (fp32 in the layer's own layout, Conv1D's
    (in, out) or the head's (out, in); 16-bit and int8 as (out, in) rows; int8 with the input
    quantized per call in blocks of 32 values, as llama.cpp's q8_0; q4 the input quantized per
    256 values, as llama.cpp's Q8_K, times Q4_K rows). Where the kernels cannot run
    (see gpt2attn.kernels), their plain-torch references compute the same sums: int8 then too
    quantizes the input in blocks of 32, so its results equal the kernels' to fp32 rounding;
    so does q4's, per 256;
  - more rows (a prompt): fp32 and 16-bit weights through the same kernels in register tiles
    (16-bit weights widened in registers; without the kernels, torch's product on the weight
    widened to fp32), except fp32 on Intel's CPUs, where torch's product (MKL) is the faster (see
    Float32Linear), and bf16 on a CPU that multiplies bf16 itself, which takes torch's bf16
    product (see HalfLinear); int8 through the same kernel as decoding (each row quantized in blocks of 32 alike, every
    row in one pass over the weights), so the one int8 copy serves prompts and steps, and a
    prompt's products equal decoding's to the bit (an int8 layer whose input width is not a multiple of 32 takes
    torch's fp32 product on its dequantized weight instead); q4's Q4_K layers through the same
    kernel as their decoding too (every row in one pass over the weights).
Weight-only int8 through torch or torchao and fbgemm for decoding were measured slower
(`python scripts/bench.py step --layers`).

`state_dict()` keeps Hugging Face's keys and shapes in fp32: each weight is the fp32 tensor it
computes with (the 16-bit or int8 weight widened back), and a tied head gives the embedding it was
made from. So `save_pretrained` writes an ordinary fp32 folder that transformers opens, and
`from_pretrained(folder, quantize=mode)` rebuilds the very same weights (q4: nearly; its search,
run again on the dequantized weights, may move a sub-block in a few thousand by a level; a GGUF
written as 'q4' keeps the very Q4_K blocks). The 16-bit, int8 and q4 layers are for inference: no
gradients flow through them.

bf16 prompts ask gpt2attn.cpu.bf16_prompts_native() whether this CPU's own bf16 products (AMX,
or AVX512-BF16 on AMD) beat the kernels' tiles; bf16 decoding does not need them.
"""

from __future__ import annotations

import contextvars
import ctypes
import math
import mmap
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu
from . import kernels as cpu_kernels
from . import q4_k
from .layers import Conv1D
from .memory import release_file_pages, release_free_memory

MODES = ("fp32", "fp16", "bf16", "int8", "q4")
HALF = {"fp16": torch.float16, "bf16": torch.bfloat16}
MODEL_DTYPES = (torch.float32, torch.float16, torch.bfloat16)  # what a model quantize() takes may hold
DECODE_ROWS = cpu_kernels.TILE_ROWS  # calls with at most this many rows take the matrix-vector kernels


class CpuLinear(nn.Module):
    """A Conv1D (`conv`, weight (in, out)) or nn.Linear (weight (out, in)) for CPU inference:
    y = x W + b through `decode`, gpt2attn.kernels' product (a step's few rows and a prompt's, in
    register tiles, alike), wherever `_decodes` says it takes x, else through `prefill` (torch's
    product, which autograd and torch.compile follow). Subclasses hold the weight."""

    def __init__(self, in_features: int, out_features: int, conv: bool):
        super().__init__()
        self.in_features, self.out_features, self.conv = in_features, out_features, conv

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, self.in_features)  # (N, in)
        kernel = not torch.compiler.is_compiling() and self._decodes(x2)
        y = self.decode(x2) if kernel else self.prefill(x2)  # (N, out)
        return y.view(*x.shape[:-1], self.out_features)

    def _decodes(self, x: Tensor) -> bool:
        """Whether `decode` takes x: the kernel's product, or its plain-torch reference where the
        kernels cannot run (the same sums either way)."""
        return x.dtype == torch.float32 and x.device.type == "cpu"

    @property
    def kernel(self) -> str:
        decode = self.decode_kernel if cpu_kernels.available() else f"plain torch ({self.decode_reference})"
        return f"decode: {decode}; prefill: {self.prefill_kernel}"

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, kernel={self.kernel}"


class Float32Linear(CpuLinear):
    """The layer's own fp32 parameters, shared (not copied): state_dict and ties stay as they were.
    A prompt (more than DECODE_ROWS rows) takes the kernels' register tiles, or torch's product
    where gpt2attn.cpu.torch_fp32_prompts() says MKL's is the faster (`torch_prompts`: Intel's CPUs)."""

    decode_reference = "torch fp32"

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, conv: bool):
        super().__init__(*(weight.shape if conv else weight.shape[::-1]), conv)
        self.weight, self.bias = weight, bias
        self.decode_kernel = f"gpt2attn fp32 {'cols' if conv else 'rows'}"
        self.torch_prompts = cpu.torch_fp32_prompts()

    @property
    def prefill_kernel(self) -> str:
        tiles = cpu_kernels.available() and not self.torch_prompts
        return f"{self.decode_kernel}, register tiles" if tiles else "torch (MKL) fp32"

    def _decodes(self, x: Tensor) -> bool:  # with gradients wanted, only autograd's path will do
        wants_grad = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        prompt_to_torch = self.torch_prompts and x.size(0) > DECODE_ROWS
        return not wants_grad and not prompt_to_torch and self.weight.dtype == torch.float32 and super()._decodes(x)

    def decode(self, x: Tensor) -> Tensor:  # the kernels read raw memory: no autograd to detach from
        return (cpu_kernels.cols if self.conv else cpu_kernels.rows)(x, self.weight, self.bias)

    def prefill(self, x: Tensor) -> Tensor:
        if self.conv:
            return torch.addmm(self.bias, x, self.weight)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(CpuLinear):
    """A layer whose weight is held in a form of its own (`_pack`); state_dict gives and takes the
    layer's fp32 weight in its HF layout (`hf_weight`). `tied`: the weight is a tied embedding's,
    which state_dict then gives as it is (so a checkpoint keeps the tie)."""

    def __init__(self, weight: Tensor, bias: Tensor | None, conv: bool = False, tied: bool = False):
        super().__init__(*(weight.shape if conv else weight.shape[::-1]), conv)
        self.has_bias = bias is not None
        self._tied = (weight,) if tied else None  # a tuple, so nn.Module does not register it
        self._pack(weight.detach().float(), None if bias is None else bias.detach().float())

    def _pack(self, weight: Tensor, bias: Tensor | None) -> None:
        raise NotImplementedError

    def _slot(self, name: str, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """self.<name>, a tensor of `shape` and `dtype` for the caller to fill: the one held there (a
        reload refills it, as load_state_dict refills a parameter), else a new one, in quantize()'s
        WeightArena while one is open."""
        held = getattr(self, name, None)
        if not (isinstance(held, Tensor) and held.shape == shape and held.dtype == dtype):
            arena = _ARENA.get()
            held = torch.empty(shape, dtype=dtype) if arena is None else arena.empty(shape, dtype)
            setattr(self, name, held)
        return held

    def hf_weight(self) -> Tensor:
        raise NotImplementedError

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        destination[prefix + "weight"] = self._tied[0] if self._tied else self.hf_weight()
        if self.has_bias:
            destination[prefix + "bias"] = self.bias

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        names = [prefix + "weight"] + ([prefix + "bias"] if self.has_bias else [])
        missing = [name for name in names if name not in state_dict]
        if missing:
            missing_keys.extend(missing)
            return
        weight = state_dict[prefix + "weight"]
        shape = (self.in_features, self.out_features) if self.conv else (self.out_features, self.in_features)
        if tuple(weight.shape) != shape:
            error_msgs.append(f"size mismatch for {prefix}weight: {tuple(weight.shape)} "
                              f"does not fit {self.in_features} inputs and {self.out_features} outputs")
            return
        bias = state_dict.get(prefix + "bias")
        self._pack(weight.detach().float(), None if bias is None else bias.detach().float())


class HalfLinear(PackedLinear):
    """The weight in 16 bits (fp16 or bf16) as (out, in) rows (a Conv1D's is transposed once), the
    layout of the head's kernel, which every 16-bit product then shares (the (in, out) layout
    measured no faster for 16-bit decoding); products accumulate in fp32.

    A prompt (more than DECODE_ROWS rows) takes the kernels' register tiles (each weight widened
    once for several input rows), except bf16 where gpt2attn.cpu.bf16_prompts_native() says the CPU's
    own bf16 products are faster (`native_bf16`: AMX, or AVX512-BF16 on AMD's Zen 4 and Zen 5), where
    torch's bf16 product (oneDNN) runs on the weight as it is, the input rounded to bf16 and the
    output too (fp32 sums between): on Zen 4, 1.6x the rows tiles then (2026-11-27), with logits
    about three times further from fp32's (see docs/cpu-decoding.md)."""

    decode_reference = "torch (MKL) fp32 on the widened weight"

    def __init__(self, weight: Tensor, bias: Tensor | None, dtype: torch.dtype, conv: bool = False,
                 tied: bool = False):
        self.weight_dtype = dtype
        super().__init__(weight, bias, conv, tied)
        self.decode_kernel = f"gpt2attn {str(dtype).removeprefix('torch.')} rows"
        self.native_bf16 = dtype == torch.bfloat16 and cpu.bf16_prompts_native()

    @property
    def prefill_kernel(self) -> str:
        if self.native_bf16:
            return "torch (oneDNN) bf16, the CPU's own: input and output rounded to bf16, fp32 sums"
        return f"{self.decode_kernel}, register tiles" if cpu_kernels.available() else self.decode_reference

    def _pack(self, weight: Tensor, bias: Tensor | None) -> None:
        rows = weight.t() if self.conv else weight  # (out, in)
        self._slot("weight16", rows.shape, self.weight_dtype).copy_(rows)  # rounded as laid out: no temporary
        self.bias = bias

    def hf_weight(self) -> Tensor:
        w = self.weight16.float()
        return w.t() if self.conv else w

    def _decodes(self, x: Tensor) -> bool:  # a prompt on a CPU that multiplies bf16 itself: prefill's oneDNN
        return super()._decodes(x) and not (self.native_bf16 and x.size(0) > DECODE_ROWS)

    def decode(self, x: Tensor) -> Tensor:
        return cpu_kernels.rows(x, self.weight16, self.bias)

    def prefill(self, x: Tensor) -> Tensor:
        if self.native_bf16:
            y = F.linear(x.to(torch.bfloat16), self.weight16).float()
            return y if self.bias is None else y + self.bias
        return cpu_kernels.rows_reference(x, self.weight16, self.bias)


class Int8Linear(PackedLinear):
    """y = x Wᵀ + b with W in int8, one scale per output channel (row of W (out, in)).

    `Int8Linear(weight (out, in), bias)` quantizes an nn.Linear's weight; conv=True takes a
    Conv1D's (in, out)."""

    prefill_kernel = "gpt2attn int8 rows by groups of 16, every row of a prompt in one pass (input in blocks of 32)"
    decode_kernel = "gpt2attn int8 rows (input in blocks of 32)"
    decode_reference = "the int8 rows' reference, input in blocks of 32"

    def _pack(self, weight: Tensor, bias: Tensor | None) -> None:
        weight = weight.t() if self.conv else weight  # (out, in)
        absmax = torch.linalg.vector_norm(weight, float("inf"), dim=1)  # max |w| per row, no |w| copy
        scale = (absmax / 127).clamp(min=1e-12).double()  # (out,)
        zero = torch.zeros(weight.size(0), dtype=torch.long)
        with warnings.catch_warnings():  # torch 2.13 deprecates creating quantized tensors
            warnings.simplefilter("ignore", UserWarning)
            qweight = torch.quantize_per_channel(weight, scale, zero, 0, torch.qint8)
        # the int8 (out, in) rows by groups of 16, as the kernel reads them, and their scales: the
        # one copy prompts and steps both read
        levels, scales = qweight.int_repr(), qweight.q_per_channel_scales()
        del qweight  # before the copies: no more than two int8 copies at once
        cpu_kernels.group_rows_q8(levels, out=self._slot("grouped", levels.shape, torch.uint8))
        self._slot("scale", scales.shape, torch.float32).copy_(scales)
        self.bias = bias

    @property
    def weight8(self) -> Tensor:
        """The int8 weight (out, in), each row's own (made when asked from `grouped`, the same
        weights in the kernel's order)."""
        return cpu_kernels.ungroup_rows_q8(self.grouped)

    def int8_weight(self) -> tuple[Tensor, Tensor, Tensor | None]:
        """(int8 weight (out, in), fp32 scale per output channel (out,), bias or None)."""
        return self.weight8, self.scale, self.bias

    def dequantized_weight(self) -> Tensor:
        """The fp32 weight (out, in) this layer computes with."""
        return self.weight8.float() * self.scale[:, None]

    def hf_weight(self) -> Tensor:
        w = self.dequantized_weight()
        return w.t() if self.conv else w

    def _decodes(self, x: Tensor) -> bool:
        return self.in_features % cpu_kernels.BLOCK == 0 and super()._decodes(x)

    @property
    def kernel(self) -> str:
        if self.in_features % cpu_kernels.BLOCK:
            return f"torch fp32 on the dequantized weight ({self.in_features} inputs: not in blocks of 32)"
        return super().kernel

    def decode(self, x: Tensor) -> Tensor:
        return cpu_kernels.rows_q8(x, self.grouped, self.scale, self.bias)

    def prefill(self, x: Tensor) -> Tensor:
        if self._decodes(x):  # under torch.compile too: the input in blocks of 32 all the same
            return self.decode(x)
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)


class Q4Linear(PackedLinear):
    """y = x Wᵀ + b with W (out, in) held as llama.cpp's Q4_K super-blocks (gpt2attn.q4_k): 4.5 bits
    a weight, a 6-bit scale and min per 32. in_features must be a multiple of 256."""

    prefill_kernel = "gpt2attn q4_K rows, every row in one pass"
    decode_kernel = "gpt2attn q4_K rows (input per 256, as llama.cpp's Q8_K)"
    decode_reference = "the q4_K rows' reference, input per 256 (Q8_K)"

    def _pack(self, weight: Tensor, bias: Tensor | None) -> None:
        rows = weight.t() if self.conv else weight  # (out, in)
        grouped = q4_k.group_rows(q4_k.quantize_rows(rows.contiguous()))  # (out, in/256 * 144) uint8
        self._slot("grouped", grouped.shape, torch.uint8).copy_(grouped)
        self.bias = bias

    @property
    def blocks(self) -> Tensor:
        """The Q4_K super-blocks (out, in/256 * 144) uint8, each row's own, as a GGUF file holds
        them (made when asked from `grouped`, the same bytes in the kernels' order)."""
        return q4_k.ungroup_rows(self.grouped)

    def dequantized_weight(self) -> Tensor:
        """The fp32 weight (out, in) this layer computes with."""
        return q4_k.dequantize_rows(self.blocks, self.in_features)

    def hf_weight(self) -> Tensor:
        w = self.dequantized_weight()
        return w.t() if self.conv else w

    def decode(self, x: Tensor) -> Tensor:
        return cpu_kernels.rows_q4k(x, self.grouped, self.bias)

    def prefill(self, x: Tensor) -> Tensor:
        # `decode` takes a prompt's rows too, reading each weight once for all of them (measured no
        # slower than dequantizing the weight for MKL's fp32 product, and no fp32 copy);
        # torch.compile and other dtypes come here, to the dequantized weight
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return F.linear(x, self.dequantized_weight().to(x.dtype), bias)


class WeightArena:
    """Memory for the weights quantize() packs, each placed after the one before, so they lie in
    the order a decoding step reads them, in chunks asked to be backed by 2 MiB pages (Linux's
    transparent huge pages, where they are `always` or `madvise`). A step then reads long runs
    through few TLB entries (how much faster: docs/cpu-decoding.md, Memory). A chunk's untouched
    tail takes no memory; the tail of its last huge page does (at most 2 MiB a chunk). Where mmap
    cannot make such chunks (no anonymous private mappings or huge-page advice: not Linux),
    tensors stay where torch put them."""

    CHUNK = 256 << 20  # bytes of address space a chunk takes (memory only as it fills)
    PAGE = 2 << 20

    def __init__(self):
        self.chunk: memoryview | None = None
        self.used = 0

    def empty(self, shape: torch.Size, dtype: torch.dtype) -> Tensor:
        """A new tensor (contents undefined) after the last one, or torch's own where no chunk can be made."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes and (self.chunk is None or self.used + nbytes > len(self.chunk)):
            self.chunk = _huge_chunk(max(self.CHUNK, nbytes + self.PAGE), self.PAGE)
            self.used = 0
        if nbytes == 0 or self.chunk is None:
            return torch.empty(shape, dtype=dtype)
        bytes_ = torch.frombuffer(self.chunk[self.used : self.used + nbytes], dtype=torch.uint8)
        self.used += -(-nbytes // 64) * 64  # the next starts on a cache line
        return bytes_.view(dtype).view(shape)


def _huge_chunk(size: int, page: int) -> memoryview | None:
    """`size` bytes of anonymous private memory advised to be backed by huge pages, from a
    page-aligned start (None where this platform's mmap cannot)."""
    flags = getattr(mmap, "MAP_PRIVATE", None), getattr(mmap, "MAP_ANONYMOUS", None)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if None in flags or advice is None:
        return None
    try:
        region = mmap.mmap(-1, size + page, flags=flags[0] | flags[1])
    except OSError:
        return None
    try:
        region.madvise(advice)
    except OSError:  # a kernel without transparent huge pages: still one run in step order
        pass
    view = memoryview(region)
    start = -ctypes.addressof(ctypes.c_char.from_buffer(region)) % page
    return view[start : start + size]


_ARENA: contextvars.ContextVar[WeightArena | None] = contextvars.ContextVar("gpt2attn_weight_arena", default=None)


def checked_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown quantize mode {mode!r}; choose one of {', '.join(MODES)}")
    return mode


def packed_layers(model: nn.Module) -> list[str]:
    """The names of the layers quantize() replaces: every Conv1D, and an nn.Linear lm_head."""
    return [name for name, module in model.named_modules()
            if isinstance(module, Conv1D) or (name.endswith("lm_head") and isinstance(module, nn.Linear))]


def quantize(model: nn.Module, mode: str = "int8", read: Callable[[str], Tensor] | None = None) -> nn.Module:
    """Make `model` (fp32, fp16 or bf16, on the CPU) decode fast in `mode` ('fp32', 'fp16', 'bf16', 'int8' or 'q4'),
    in place, and return it: see this module's docstring.

    A model in fp16 or bf16 (as `from_pretrained` gives a 16-bit checkpoint by default) is widened
    as it goes: what stays (embeddings, LayerNorms, biases) becomes fp32 first, and each matrix is
    widened only as its layer is packed, so no fp32 copy of the whole model is ever made.

    read: for a model whose layers' weights are still on the meta device (the loader's, with
    from_pretrained(quantize=)), the fp32 weight of a state-dict key, called as its layer is packed."""
    checked_mode(mode)
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"quantize({mode!r}) is for models on the CPU; this one is on {param.device}")
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point() and not p.is_meta}
    if not dtypes <= set(MODEL_DTYPES):
        other = sorted(str(d) for d in dtypes - set(MODEL_DTYPES))
        raise ValueError(f"quantize({mode!r}) takes an fp32, fp16 or bf16 model; "
                         f"this one has {', '.join(other)} weights")
    cpu_kernels.library()  # build the kernels now (or warn once that plain torch will do)
    wte = getattr(getattr(model, "transformer", None), "wte", None)
    n_layer = getattr(getattr(model, "config", None), "n_layer", 0)
    names = packed_layers(model)  # names, not modules: a list of the old layers would keep every fp32 weight alive
    _widen_the_rest(model, names, wte)
    # A head tied to the embedding first (a stable sort): its copy made, the embedding's pages can
    # go (release_file_pages) before the layers' are read. The arena then holds the head, then the
    # layers in a step's order: a step reads the head last, just before the next step's first layer.
    embedding = None if wte is None else wte.weight
    names.sort(key=lambda name: model.get_submodule(name).weight is not embedding)
    arena = _ARENA.set(WeightArena())
    try:
        _replace_layers(model, names, mode, wte, n_layer, read)
    finally:
        _ARENA.reset(arena)
    return model


def _widen_the_rest(model: nn.Module, names: list[str], wte: nn.Module | None) -> None:
    """A 16-bit model's parameters that no layer packs (and a tied embedding, which lookups read)
    made fp32 in place, the same Parameter objects; the packed matrices are widened one at a time."""
    packed = {id(model.get_submodule(name).weight) for name in names} - {id(getattr(wte, "weight", None))}
    for p in model.parameters():
        if id(p) not in packed and p.dtype in HALF.values():
            p.data = p.data.float()


def _replace_layers(model: nn.Module, names: list[str], mode: str, wte: nn.Module | None, n_layer: int,
                    read: Callable[[str], Tensor] | None) -> None:
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module = getattr(parent, child)
        conv = isinstance(module, Conv1D)
        tied = not conv and wte is not None and module.weight is wte.weight
        weight = module.weight
        if weight.is_meta and read is not None:  # read now, just before it is packed
            weight = nn.Parameter(read(f"{name}.weight"), requires_grad=weight.requires_grad)
        stored = weight  # the tensor as the model (or the file) had it
        if weight.dtype != torch.float32:  # a 16-bit model's matrix: widened now, just before it is packed
            weight = nn.Parameter(weight.detach().float(), requires_grad=weight.requires_grad)
        if mode == "fp32":
            layer = Float32Linear(weight, module.bias, conv)
        elif mode == "int8" or (mode == "q4" and q4_k.keeps_8_bits(name, weight.shape[0 if conv else 1], n_layer)):
            layer = Int8Linear(weight, module.bias, conv, tied)
        elif mode == "q4":
            layer = Q4Linear(weight, module.bias, conv, tied)
        else:
            layer = HalfLinear(weight, module.bias, HALF[mode], conv, tied)
        setattr(parent, child, layer.train(module.training))
        # The layer reads its own copy: the old weight's pages of a file's map go now, also where
        # the map stays (a tied embedding, which lookups still read; one map of a pytorch_model.bin)
        if mode != "fp32" or stored is not weight:
            release_file_pages(stored)
        del module, weight, stored  # the old weight's last references: it goes now
        release_free_memory()  # and the temporaries' pages, before the next layer's are taken


def kernels(model: nn.Module) -> dict[str, str]:
    """Module name -> the kernels its matrix products run on, for every layer quantize() made."""
    return {name: m.kernel for name, m in model.named_modules() if isinstance(m, CpuLinear)}
