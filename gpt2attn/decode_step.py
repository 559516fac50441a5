"""A whole decoding step in one call: every row's next-token logits, with no Python between layers.

Run through its modules, a decoding step of gpt2-small is about a hundred small torch calls and
49 weight products entered from Python, several milliseconds beyond reading the weights.
`DecodeStep` describes the model's weights once, as C structs (gpt2attn.kernels.Model, one
pointer per tensor, no copy), and runs the step

    ids (B,) -> wte + wpe -> n_layer x [x += attn(ln_1(x)); x += mlp(ln_2(x))] -> ln_f -> lm_head -> logits (B, V)

in gpt2attn/kernels/decode.cpp, on all of torch's threads in one parallel region, writing each
layer's new key and value into the preallocated KV cache where the modules would have put them.

It reads a plain model's own fp32 parameters (Conv1D's (in, out) weights, the head's (V, C)) as
they are, or the weights `model.quantize(mode)` keeps. Which models and requests it serves is
decided once per request, by gpt2attn.generation.decoder (`unfused_reason`). Its reference is the
model's own forward: tests compare the two (logits, and every cached key and value).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from . import kernels
from .cache import KVCache
from .config import inner_dim
from .layers import Conv1D
from .quantize import Float32Linear, HalfLinear, Int8Linear, Q4Linear


class DecodeStep:
    """The weights of a GPT2LMHeadModel as decode.cpp reads them; call it with the next token of
    every row and the cache. The caller has checked that the model fits (see unfused_reason)."""

    def __init__(self, model: nn.Module):
        cfg, transformer = model.config, model.transformer
        self.keep: list[Tensor] = []  # every tensor a pointer below points into
        layers = (kernels.Layer * cfg.n_layer)()
        for i, block in enumerate(transformer.h):
            layers[i] = kernels.Layer(
                self._vector(block.ln_1.weight), self._vector(block.ln_1.bias),
                self._matrix(block.attn.c_attn), self._matrix(block.attn.c_proj),
                self._vector(block.ln_2.weight), self._vector(block.ln_2.bias),
                self._matrix(block.mlp.c_fc), self._matrix(block.mlp.c_proj),
                block.attn.scale,
            )
        self.layers = layers
        self.model = kernels.Model(
            cfg.n_layer, cfg.n_embd, cfg.n_head, inner_dim(cfg), cfg.vocab_size, cfg.n_positions,
            cfg.layer_norm_epsilon, self._vector(transformer.wte.weight), self._vector(transformer.wpe.weight),
            self._vector(transformer.ln_f.weight), self._vector(transformer.ln_f.bias),
            self._matrix(model.lm_head), layers,
        )
        self.vocab_size = cfg.vocab_size

    @torch.no_grad()
    def __call__(self, ids: Tensor, cache: KVCache, positions: Tensor | None = None,
                 key_mask: Tensor | None = None) -> Tensor:
        """ids (B, 1) after the cache's tokens -> fp32 logits (B, V); the cache advances by one.
        positions (B, 1): each row's position id (None: the cache's length); key_mask (B, capacity):
        1 where a row may attend to a cached entry (None: everywhere)."""
        logits = torch.empty(ids.size(0), self.vocab_size, dtype=torch.float32)
        kernels.decode_step(self.model, ids.reshape(-1).contiguous(),
                            None if positions is None else positions.reshape(-1).contiguous(), key_mask,
                            cache.length, cache.block, logits)
        cache.advance(1)
        return logits

    @torch.no_grad()
    def greedy(self, tokens: Tensor, cache: KVCache, positions: Tensor | None, key_mask: Tensor | None,
               eos: Tensor, pad: int, unfinished: Tensor, out: Tensor) -> int:
        """generate's greedy loop in one call (kernels.decode_greedy): after tokens (B,), each row's
        argmax into out (B, n), or pad once a row has given one of eos (n,), until out is full or no
        row is unfinished (B,) bool; tokens, positions (B,) and unfinished are updated in place.
        Returns how many tokens each row got; the cache advances by as many. Raises ValueError, with
        the tokens before it kept, for a step the single step would raise for."""
        logits = torch.empty(tokens.numel(), self.vocab_size, dtype=torch.float32)
        done, error = kernels.decode_greedy(self.model, tokens, positions, key_mask, cache.length, cache.block, logits,
                                            out.size(1), eos, pad, unfinished, out)
        cache.advance(done)
        if error is not None:
            raise ValueError(error)
        return done

    @torch.no_grad()
    def logits(self, hidden: Tensor) -> Tensor:
        """hidden (B, C) fp32 (any strides), final states after ln_f -> logits (B, V) through the head's product
        that every step takes, so a prompt's last logits come from the same kernel as the steps'
        (the plain model's one row of gpt2-small: 5.1 ms, torch's one-row product 13.1 ms, 2 threads,
        AMD EPYC Zen 4, 2026-11-27)."""
        return kernels.product(self.model.lm_head, hidden)

    def _vector(self, t: Tensor) -> int:
        t = t.detach()
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
        self.keep.append(t)
        return t.data_ptr()

    def _matrix(self, layer: nn.Module) -> kernels.Matrix:
        """A Conv1D, nn.Linear or quantize() layer as decode.cpp's Matrix: its weight in the layout it holds."""
        scale = None
        if isinstance(layer, Q4Linear):
            weight, kind = layer.grouped, kernels.ROWS_Q4K  # (out, in/256 * 144) bytes, by groups of 16 rows
        elif isinstance(layer, Int8Linear):
            weight, scale, kind = layer.grouped, layer.scale, kernels.ROWS_Q8  # int8 rows by groups of 16
        elif isinstance(layer, HalfLinear):
            weight, kind = layer.weight16, kernels.ROWS[layer.weight16.dtype]  # (out, in)
        elif isinstance(layer, (Conv1D, Float32Linear, nn.Linear)):
            conv = isinstance(layer, Conv1D) or (isinstance(layer, Float32Linear) and layer.conv)
            weight, kind = layer.weight.detach(), kernels.COLS_F32 if conv else kernels.ROWS[torch.float32]
        else:
            raise TypeError(f"{type(layer).__name__}: the decoding step takes Conv1D, nn.Linear or quantize() layers")
        self.keep += [t for t in (weight, scale, layer.bias) if t is not None]
        return kernels.matrix(weight, None if layer.bias is None else layer.bias.detach(), kind, scale)
