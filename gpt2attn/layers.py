"""The HF-named building blocks of GPT-2: Conv1D, Attention, MLP, Block.

With `config.add_cross_attention` each Block also attends to an encoder's states
(`crossattention`, after `ln_cross_attn`), between its self-attention and its MLP.

Parameter names and shapes equal `transformers`' GPT-2, so state dicts load as they are.
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import cpu
from . import kernels as cpu_kernels
from .attention import causal_mask, is_registered, padding_mask, registered_attention, scaled_dot_product_attention
from .cache import KVCache
from .config import GPT2Config, check_config, inner_dim


# The plain model's Conv1D multiplies as transformers does, addmm(b, x, W), so that its logits are
# transformers' to the last bit, except within kernel_products(): generate's prompt pass on a model
# whose steps run gpt2attn.kernels' products (generation.decoder) runs there, and Conv1D then takes
# the kernels' product too (quantize("fp32")'s), which sums in another order (within fp32 rounding
# of transformers', as the steps' own) and is faster: on AMD's CPUs, gpt2-small's prompt pass of
# 128 tokens 1.2-1.3x. On Intel's, MKL's product is the faster for a prompt's rows
# (cpu.torch_fp32_prompts), so there only a few rows (drafts, a batch's step) take the kernels'.
# The variable holds, within kernel_products(), the most rows Conv1D gives the kernels; None outside.
_KERNEL_PRODUCTS: contextvars.ContextVar[float | None] = contextvars.ContextVar("gpt2attn_kernel_products", default=None)


def _kernels_take(x: Tensor) -> bool:
    """Whether x goes through gpt2attn.kernels: within kernel_products(), fp32 on the CPU, no autograd."""
    kernel = not torch.compiler.is_compiling() and _KERNEL_PRODUCTS.get() is not None  # (torch.compile traces no ContextVar)
    return kernel and x.device.type == "cpu" and x.dtype == torch.float32 and not torch.is_grad_enabled()


@contextlib.contextmanager
def kernel_products():
    """Within it, the tanh GELU and Conv1D compute fp32 inputs on the CPU without autograd through
    gpt2attn.kernels (Conv1D a prompt's rows only where cpu.torch_fp32_prompts() says no)."""
    token = _KERNEL_PRODUCTS.set(cpu_kernels.TILE_ROWS if cpu.torch_fp32_prompts() else math.inf)
    try:
        yield
    finally:
        _KERNEL_PRODUCTS.reset(token)


class Conv1D(nn.Module):
    """A linear layer whose weight is stored (in, out), as in OpenAI's GPT-2 and HF.

    The argument order is HF's: `Conv1D(nf, nx)` maps nx input features to nf outputs.
    """

    def __init__(self, nf: int, nx: int):
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))
        nn.init.normal_(self.weight, std=0.02)

    def forward(self, x: Tensor) -> Tensor:
        x2 = x.reshape(-1, x.size(-1))  # (N, nx)
        if _kernels_take(x2) and x2.size(0) <= _KERNEL_PRODUCTS.get():
            out = cpu_kernels.cols(x2, self.weight, self.bias)  # (N, nf)
        else:
            out = torch.addmm(self.bias, x2, self.weight)
        return out.view(*x.shape[:-1], self.nf)

    def extra_repr(self) -> str:
        return f"nx={self.weight.size(0)}, nf={self.nf}"


def _quick_gelu(x: Tensor) -> Tensor:
    return x * torch.sigmoid(1.702 * x)


def _identity(x: Tensor) -> Tensor:
    return x


def _gelu_tanh(x: Tensor) -> Tensor:
    # gelu_new, gelu_fast and gelu_pytorch_tanh are all 0.5x(1 + tanh(√(2/π)(x + 0.044715x³))); within
    # kernel_products() the decoding step's own (torch's took 7 ms of gpt2-small's 128-token prompt)
    return cpu_kernels.gelu(x) if _kernels_take(x) else F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "gelu_new": _gelu_tanh,
    "gelu_fast": _gelu_tanh,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_python_tanh": _gelu_tanh,
    "gelu": F.gelu,
    "gelu_python": F.gelu,
    "quick_gelu": _quick_gelu,
    "relu": F.relu,
    "relu6": F.relu6,
    "silu": F.silu,
    "swish": F.silu,
    "mish": F.mish,
    "tanh": torch.tanh,
    "sigmoid": torch.sigmoid,
    "linear": _identity,
}


def no_tap(name: str, x: Tensor) -> Tensor:
    """The default tap: every activation passes through untouched.

    Block, Attention and MLP hand each named activation to `self.tap(name, x)` and go on with
    what it returns; gpt2attn.inspect swaps in taps that record or edit them.
    """
    return x


def get_activation(name: str):
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation_function {name!r}; choose one of {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class Attention(nn.Module):
    """Multi-head attention. Self-attention is causal, with one fused QKV projection (`c_attn`).
    Cross-attention (is_cross_attention) takes queries from `q_attn` over x and keys and values
    from `c_attn` over the encoder's states, unmasked but for the encoder's padding."""

    def __init__(self, config: GPT2Config, layer_idx: int = 0, is_cross_attention: bool = False):
        super().__init__()
        check_config(config)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.layer_idx = layer_idx
        self.is_cross_attention = is_cross_attention
        self.is_causal = not is_cross_attention  # what transformers' attention functions read
        if is_cross_attention:
            self.c_attn = Conv1D(2 * config.n_embd, config.n_embd)  # keys, values
            self.q_attn = Conv1D(config.n_embd, config.n_embd)
        else:
            self.c_attn = Conv1D(3 * config.n_embd, config.n_embd)  # queries, keys, values
        self.c_proj = Conv1D(config.n_embd, config.n_embd)
        self.attn_dropout = nn.Dropout(config.attn_pdrop)
        self.resid_dropout = nn.Dropout(config.resid_pdrop)
        self.scale = self.head_dim**-0.5 if config.scale_attn_weights else 1.0
        if config.scale_attn_by_inverse_layer_idx:
            self.scale /= layer_idx + 1
        self.upcast = config.reorder_and_upcast_attn
        self.tap = no_tap
        # "sdpa", "eager" or a registered function's name (see gpt2attn.attention); textbook: always
        # the textbook formula ("eager", or gpt2attn.inspect asking for the weights), else PyTorch's
        # fused kernel wherever no weights are wanted.
        self.implementation = getattr(config, "_attn_implementation", None) or "sdpa"
        self.textbook = self.implementation == "eager"

    def split_heads(self, x: Tensor) -> Tensor:
        B, T, _ = x.shape
        return x.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)

    def merge_heads(self, x: Tensor) -> Tensor:
        B, _, T, _ = x.shape
        return x.transpose(1, 2).reshape(B, T, self.n_embd)  # (B, T, C)

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
        head_mask: Tensor | None = None,
        output_attentions: bool = False,
        encoder_hidden_states: Tensor | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, Tensor | None]:
        """x: (B, T, C). mask None means plain causal; else bool/additive (B|1, 1|nh, T, T_k).
        Cross-attention: keys are the encoder's T_k positions (B, T_k, C), mask is over them.
        **kwargs go to a registered attention function (forward's extra keywords), as in transformers.

        Returns the output (B, T, C) and, when asked for, the weights (B, nh, T, T_k).
        """
        tap = self.tap
        if self.is_cross_attention:
            q = tap("q", self.split_heads(self.q_attn(x)))  # (B, nh, T, hs)
            k, v = self.encoder_keys_values(encoder_hidden_states, cache)  # (B, nh, T_enc, hs)
        else:
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            q, k, v = self.split_heads(q), self.split_heads(k), self.split_heads(v)  # (B, nh, T, hs)
            q, k, v = tap("q", q), tap("k", k), tap("v", v)
            if cache is not None:
                k, v = cache.update(self.layer_idx, k, v)  # (B, nh, T_k, hs), past + new
        causal = not self.is_cross_attention
        T_q, T_k = q.size(2), k.size(2)
        dropout_p = self.attn_dropout.p if self.training else 0.0

        weights = None
        # A query that may see no key at all (left padding, an encoder row of padding alone) gets
        # what transformers gives it on the same backend: equal weights on every key with the
        # textbook formula ("eager"), nothing at all from PyTorch's fused kernel ("sdpa").
        additive = mask is not None and mask.is_floating_point()  # a caller's 4-D mask: as it is
        if is_registered(self.implementation) and not self.textbook:
            function, takes_mask = registered_attention(self.implementation)
            if head_mask is not None:
                raise ValueError(f"head_mask is not applied by the registered attention function "
                                 f"{self.implementation!r}: use attn_implementation 'eager' or 'sdpa'")
            if takes_mask and causal and mask is None and 1 < T_q < T_k:
                mask = causal_mask(T_q, T_k, q.device)  # every query sees itself, counted from the right
            y, weights = function(self, q, k, v, mask if takes_mask else None, dropout=dropout_p,
                                  scaling=self.scale, **kwargs)  # y: (B, T, nh, hs)
            y = y.transpose(1, 2)  # (B, nh, T, hs)
        elif output_attentions or head_mask is not None or self.upcast or self.textbook or additive:
            if causal and mask is None and T_q > 1:
                mask = causal_mask(T_q, T_k, q.device)
            elif mask is not None and not additive:
                mask = padding_mask(mask, q.dtype)
            y, weights = scaled_dot_product_attention(q, k, v, mask, self.scale, dropout_p, head_mask, self.upcast)
            tapped = tap("weights", weights)
            if tapped is not weights:  # edited: mix the values with the new weights
                y, weights = torch.matmul(tapped, v), tapped
        else:
            # a branch, not a bare comparison: under torch.compile with symbolic sizes SDPA still gets a bool
            is_causal = True if causal and mask is None and T_q == T_k and T_q > 1 else False
            sees_nothing = None
            if mask is not None:  # a padding mask (bool): a query may see no key at all
                sees_nothing = ~mask.any(dim=-1, keepdim=True)  # (B, 1, T_q, 1)
                mask = mask | sees_nothing  # a finite softmax there, whose output is then dropped
            elif causal and 1 < T_q < T_k:  # every query sees itself
                mask = causal_mask(T_q, T_k, q.device)
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal, scale=self.scale
            )
            if sees_nothing is not None:
                y = y.masked_fill(sees_nothing, 0.0)
        y = tap("heads", y)  # (B, nh, T, hs), each head's output before c_proj
        y = self.resid_dropout(self.c_proj(self.merge_heads(y)))
        return tap("out", y), weights

    def encoder_keys_values(self, encoder_hidden_states: Tensor, cache: KVCache | None) -> tuple[Tensor, Tensor]:
        """Cross-attention's keys and values (B, nh, T_enc, hs): computed from the encoder's states
        once, then read from the cache on every later step."""
        if cache is not None and cache.cross_keys[self.layer_idx] is not None:
            return cache.cross_keys[self.layer_idx], cache.cross_values[self.layer_idx]
        k, v = self.c_attn(encoder_hidden_states).split(self.n_embd, dim=2)
        k, v = self.tap("k", self.split_heads(k)), self.tap("v", self.split_heads(v))
        if cache is not None:
            cache.set_cross(self.layer_idx, k, v)
        return k, v


class MLP(nn.Module):
    """c_fc -> activation -> c_proj -> dropout. HF's signature: MLP(intermediate_size, config)."""

    def __init__(self, intermediate_size: int, config: GPT2Config):
        super().__init__()
        self.c_fc = Conv1D(intermediate_size, config.n_embd)
        self.act = get_activation(config.activation_function)
        self.c_proj = Conv1D(config.n_embd, intermediate_size)
        self.dropout = nn.Dropout(config.resid_pdrop)
        self.tap = no_tap

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.tap("hidden", self.act(self.c_fc(x)))  # (B, T, inner)
        return self.tap("out", self.dropout(self.c_proj(hidden)))


class Block(nn.Module):
    """Pre-LayerNorm transformer block: x + attn(ln_1(x)), then x + mlp(ln_2(x))."""

    def __init__(self, config: GPT2Config, layer_idx: int = 0):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.attn = Attention(config, layer_idx)
        self.ln_2 = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        if config.add_cross_attention:
            self.crossattention = Attention(config, layer_idx, is_cross_attention=True)
            self.ln_cross_attn = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.mlp = MLP(inner_dim(config), config)
        self.tap = no_tap

    def forward(
        self,
        x: Tensor,
        cache: KVCache | None = None,
        mask: Tensor | None = None,
        head_mask: Tensor | None = None,
        output_attentions: bool = False,
        encoder_hidden_states: Tensor | None = None,
        encoder_mask: Tensor | None = None,
        **attention_kwargs: Any,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Returns the block's output (B, T, C), the self-attention weights and the
        cross-attention weights (each None unless output_attentions). attention_kwargs go to a
        registered attention function (see Attention.forward)."""
        tap = self.tap
        x = tap("resid_pre", x)
        a, weights = self.attn(tap("ln_1", self.ln_1(x)), cache, mask, head_mask, output_attentions, **attention_kwargs)
        x = tap("resid_mid", x + a)
        cross_weights = None
        if encoder_hidden_states is not None:
            c, cross_weights = self.crossattention(
                self.ln_cross_attn(x), cache, encoder_mask, head_mask, output_attentions, encoder_hidden_states,
                **attention_kwargs,
            )
            x = x + c
        x = tap("resid_post", x + self.mlp(tap("ln_2", self.ln_2(x))))
        return x, weights, cross_weights


def long_side_first(weight: Tensor, x: Tensor, bias: Tensor | None, out: Tensor | None = None) -> Tensor:
    """x (M, K) times weight (N, K)ᵀ plus bias -> (M, N), computed as (weight · xᵀ)ᵀ: a transposed
    view of an (N, M) product (written into `out`, (N, M), when given)."""
    if bias is None:
        return torch.mm(weight, x.t(), out=out).t()
    return torch.addmm(bias[:, None], weight, x.t(), out=out).t()


class LMHead(nn.Linear):
    """The vocabulary projection, nn.Linear(n_embd, vocab_size, bias=False).

    For inference on the CPU, MKL computes the same products up to 2x faster with the vocabulary
    as the long side, weight (V, C) @ hiddenᵀ (C, N), than as hidden @ weightᵀ. So without
    autograd the logits are built from vocabulary slices small enough to stay in cache while each
    is transposed into place. Training and other devices use nn.Linear as it is.
    """

    def forward(self, x: Tensor) -> Tensor:
        autograd = torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)
        rows, vocab = x.numel() // x.size(-1), self.weight.size(0)
        if autograd or x.device.type != "cpu" or rows < 2 or vocab < 8192:
            return super().forward(x)
        h = x.reshape(rows, x.size(-1))  # (N, C)
        out = h.new_empty(rows, vocab)  # (N, V)
        step = min(4096, max(256, 2**18 // rows))  # a (step, N) slice is about 1 MB of floats
        for start in range(0, vocab, step):
            w = self.weight[start : start + step]  # (S, C)
            out[:, start : start + w.size(0)] = long_side_first(w, h, None)
        return out.view(*x.shape[:-1], vocab)


def init_weights(module: nn.Module, config: GPT2Config) -> None:
    """HF/OpenAI init: N(0, initializer_range) weights, zero biases, LayerNorm 1/0, and each
    residual projection (`c_proj`) scaled by 1/sqrt(2 * n_layer)."""
    std = config.initializer_range
    for name, m in module.named_modules():
        if isinstance(m, (Conv1D, nn.Linear)):
            std_here = std / math.sqrt(2 * config.n_layer) if name.endswith("c_proj") else std
            nn.init.normal_(m.weight, mean=0.0, std=std_here)
            if m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Embedding):
            nn.init.normal_(m.weight, mean=0.0, std=std)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
