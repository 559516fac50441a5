"""A whole decoding step in one call: the quantized model's new token for every row, with no
Python between the layers.

After `model.quantize(mode)` every matrix product of a decoding step reads its weight at close to
the memory's speed, but the step still runs 12 blocks of modules: about a hundred small torch
calls and 49 products entered from Python. For gpt2-small that was about 4.5 ms per token, as
long as reading the int8 weights. `DecodeStep` describes the model's weights once, as C structs
(gpt2attn.kernels.Model), and runs the step

    ids (B,) -> wte + wpe -> n_layer x [x += attn(ln_1(x)); x += mlp(ln_2(x))] -> ln_f -> lm_head -> logits (B, V)

in gpt2attn/kernels/step.cpp, on all of torch's threads in one parallel region, writing each
layer's new key and value into the preallocated KV cache where the modules would have put them.

Its reference is the model's own forward: tests compare the two (logits, and every cached key and
value) in every precision. generate() takes this path when it can (see `unfused_reason`): one new
token per row, at most quantize.DECODE_ROWS rows, a preallocated cache, no attention mask or
token types, the model in eval mode with nothing watching its modules (no taps, no hooks).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import kernels as K
from .cache import KVCache
from .config import inner_dim
from .layers import no_tap
from .quantize import DECODE_ROWS, CpuLinear, Float32Linear, HalfLinear, Int8Linear

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")  # all the tanh form step.cpp computes


def unfused_reason(model: nn.Module) -> str | None:
    """Why `model` cannot decode through DecodeStep, or None when it can."""
    cfg = getattr(model, "config", None)
    transformer = getattr(model, "transformer", None)
    if cfg is None or transformer is None or not isinstance(getattr(model, "lm_head", None), CpuLinear):
        return "the model was not quantized (model.quantize(mode))"
    if not K.available():
        return "the kernels are not available here"
    if model.training:
        return "the model is in training mode (dropout)"
    if cfg.activation_function not in ACTIVATIONS:
        return f"activation_function {cfg.activation_function!r} (the step computes the tanh GELU)"
    if cfg.add_cross_attention:
        return "cross-attention"
    for name, module in model.named_modules():
        if module._forward_hooks or module._forward_pre_hooks:
            return f"a forward hook on {name or 'the model'}"
        if getattr(module, "tap", no_tap) is not no_tap:
            return f"a tap on {name}"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook"
    for block in transformer.h:
        for layer in (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj):
            if not isinstance(layer, CpuLinear):
                return "a layer was replaced after quantize()"
            if isinstance(layer, Int8Linear) and layer.in_features % K.BLOCK:
                return f"int8 layers need inputs in blocks of {K.BLOCK}"
    tensors = [transformer.wte.weight, transformer.wpe.weight]
    if any(t.dtype != torch.float32 or t.device.type != "cpu" for t in tensors):
        return "the embeddings are not fp32 on the CPU"
    return None


class DecodeStep:
    """The weights of a quantized GPT2LMHeadModel as step.cpp reads them; call it with the next
    token of every row and the cache."""

    def __init__(self, model: nn.Module):
        why = unfused_reason(model)
        if why is not None:
            raise ValueError(f"DecodeStep: {why}")
        cfg, transformer = model.config, model.transformer
        self.keep: list[Tensor] = []  # every tensor a pointer below points into
        layers = (K.Layer * cfg.n_layer)()
        for i, block in enumerate(transformer.h):
            layers[i] = K.Layer(
                self._vector(block.ln_1.weight), self._vector(block.ln_1.bias),
                self._matrix(block.attn.c_attn), self._matrix(block.attn.c_proj),
                self._vector(block.ln_2.weight), self._vector(block.ln_2.bias),
                self._matrix(block.mlp.c_fc), self._matrix(block.mlp.c_proj),
                block.attn.scale,
            )
        self.layers = layers
        self.model = K.Model(
            cfg.n_layer, cfg.n_embd, cfg.n_head, inner_dim(cfg), cfg.vocab_size, cfg.layer_norm_epsilon, 0.0,
            self._vector(transformer.wte.weight), self._vector(transformer.wpe.weight),
            self._vector(transformer.ln_f.weight), self._vector(transformer.ln_f.bias),
            self._matrix(model.lm_head), layers,
        )
        self.n_positions, self.vocab_size = cfg.n_positions, cfg.vocab_size

    def usable(self, ids: Tensor, cache: KVCache) -> bool:
        """Whether this call can run here: one new token per row, at most DECODE_ROWS rows, on the
        cache's preallocated block with room for it."""
        block = cache.block
        return (ids.dim() == 2 and ids.size(1) == 1 and ids.size(0) <= DECODE_ROWS and block is not None
                and block.size(2) == ids.size(0) and block.dtype == torch.float32 and block.is_contiguous()
                and cache.length < min(block.size(4), self.n_positions) and cache.cross_keys[0] is None)

    @torch.no_grad()
    def __call__(self, ids: Tensor, cache: KVCache) -> Tensor:
        """ids (B, 1) after the cache's tokens -> fp32 logits (B, V); the cache advances by one."""
        ids = ids.reshape(-1).to(torch.int64).contiguous()  # (B,)
        if bool(((ids < 0) | (ids >= self.vocab_size)).any()):
            raise ValueError(f"input_ids must lie in [0, {self.vocab_size}), got {ids.min().item()}..{ids.max().item()}")
        logits = torch.empty(ids.numel(), self.vocab_size, dtype=torch.float32)
        K.decode_step(self.model, ids, cache.length, cache.block, logits)
        cache.advance(1)
        return logits

    def _vector(self, t: Tensor) -> int:
        t = t.detach()
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
        self.keep.append(t)
        return t.data_ptr()

    def _matrix(self, layer: CpuLinear) -> K.Matrix:
        """A quantize() layer as step.cpp's Matrix: its weight in the layout it already holds."""
        if isinstance(layer, Int8Linear):
            weight, scale, kind = layer.weight8, layer.scale, K.Q8_ROWS
        elif isinstance(layer, HalfLinear):
            weight, scale, kind = layer.weight16, None, K.ROWS[layer.weight16.dtype]  # (out, in)
        elif isinstance(layer, Float32Linear):
            weight, scale, kind = layer.weight.detach(), None, (K.COLS if layer.conv else K.ROWS)[torch.float32]
        else:
            raise TypeError(f"{type(layer).__name__} is not a quantize() layer")
        assert weight.is_contiguous() and weight.device.type == "cpu"
        self.keep.append(weight)
        bias = None if layer.bias is None else self._vector(layer.bias)
        return K.Matrix(weight.data_ptr(), None if scale is None else self._vector(scale), bias, kind, 0,
                        layer.in_features, layer.out_features)
