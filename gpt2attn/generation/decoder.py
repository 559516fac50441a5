"""Decoder: the model stepping a batch of rows forward on one preallocated KV cache.

The cache is sized for the whole request up front; every forward writes its keys/values in
place, `rollback()` forgets rejected draft tokens and `reorder()` moves beams in place. With left
padding the attention mask and the position ids (as transformers derives them) go along.

The Decoder is the one place that picks how a request decodes, once, when it is made: one new
token per row in one call of gpt2attn.decode_step.DecodeStep (or a greedy request's tokens, 16 a
call: `greedy`, when the search has nothing to do between tokens) when `unfused_reason` finds nothing
in the way (a plain fp32 model in eval as it is, or one `quantize()` made), else the model's
modules, or the model's compiled forward when generate compiles the steps (then on a cache the
model keeps between requests: `kept_cache`). Prompts and drafts of several tokens always run
through the modules.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor, nn

from .. import kernels
from ..attention import is_registered
from ..cache import KVCache
from ..decode_step import DecodeStep
from ..layers import MLP, Attention, Block, Conv1D, LMHead, kernel_products, no_tap
from ..quantize import DECODE_ROWS, Float32Linear, HalfLinear, Int8Linear, Q4Linear

TANH_GELU = ("gelu_new", "gelu_fast", "gelu_pytorch_tanh", "gelu_python_tanh")  # the GELU decode.cpp computes
STEP_LAYERS = (Conv1D, Float32Linear, HalfLinear, Int8Linear, Q4Linear)  # the block products the step reads
STEP_HEADS = (LMHead, nn.Linear, Float32Linear, HalfLinear, Int8Linear, Q4Linear)


def unfused_reason(model: nn.Module, rows: int = 1, token_type_ids: Tensor | None = None,
                   inside: bool = False) -> str | None:
    """Why a request of `rows` rows decodes through the model's modules rather than one DecodeStep
    call per token; None when nothing is in the way. Anything the step would not honour (a hook, a
    tap, training mode, a replaced module, another dtype or device) sends it to the modules, as does
    `inside`: a request for the attention weights or hidden states of every step."""
    cfg, transformer = getattr(model, "config", None), getattr(model, "transformer", None)
    if cfg is None or transformer is None or getattr(model, "lm_head", None) is None:
        return "not a GPT2LMHeadModel"
    if rows > DECODE_ROWS:
        return f"{rows} rows (the step takes at most {DECODE_ROWS})"
    if token_type_ids is not None:
        return "token types"
    if inside:
        return "attention weights or hidden states are asked for"
    if cfg.activation_function not in TANH_GELU:
        return f"activation_function {cfg.activation_function!r} (the step computes the tanh GELU)"
    if cfg.add_cross_attention:
        return "cross-attention"
    if is_registered(getattr(cfg, "_attn_implementation", None)):
        return f"attention runs the registered function {cfg._attn_implementation!r}"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global forward hook"
    for name, module in model.named_modules():
        where = name or "the model"
        if module.training:
            return f"{where} is in training mode (dropout)"
        if module._forward_hooks or module._forward_pre_hooks:
            return f"a forward hook on {where}"
        if getattr(module, "tap", no_tap) is not no_tap:
            return f"a tap on {where}"
    for p in model.parameters():
        if p.dtype != torch.float32 or p.device.type != "cpu" or not p.is_contiguous():
            return "a parameter that is not contiguous fp32 on the CPU"
    for i, block in enumerate(transformer.h):
        kinds = (type(block), type(block.attn), type(block.mlp), type(block.ln_1), type(block.ln_2))
        if kinds != (Block, Attention, MLP, nn.LayerNorm, nn.LayerNorm):
            return f"a module of transformer.h.{i} was replaced"
        for name in ("attn.c_attn", "attn.c_proj", "mlp.c_fc", "mlp.c_proj"):
            layer = block.get_submodule(name)
            if type(layer) not in STEP_LAYERS:
                return f"transformer.h.{i}.{name} is a {type(layer).__name__}"
            if isinstance(layer, Int8Linear) and layer.in_features % kernels.BLOCK:
                return f"int8 layers need inputs in blocks of {kernels.BLOCK}"
    if type(model.lm_head) not in STEP_HEADS or type(transformer.ln_f) is not nn.LayerNorm:
        return "the head or ln_f was replaced"
    if (tuple(transformer.wte.weight.shape) != (cfg.vocab_size, cfg.n_embd)
            or tuple(transformer.wpe.weight.shape) != (cfg.n_positions, cfg.n_embd)):
        return "embeddings of other shapes than the config's"
    if not kernels.available():  # last: a model the step cannot take builds no kernels
        return "the kernels are not available here"
    return None


def kept_cache(model, rows: int, capacity: int, device: torch.device) -> KVCache:
    """The cache a compiled decoding step writes: the one the model kept from an earlier request,
    emptied, when it has the rows and the room, so that the step's shapes, and so its compiled
    graph, stay as they were (transformers reuses its static cache the same way); else a new one,
    kept for the next request."""
    cfg = model.config
    cache = model.__dict__.get("_static_cache")
    if (cache is None or cache.batch_size != rows or cache.keys[0].size(2) < capacity
            or cache.keys[0].dtype != model.dtype or cache.keys[0].device != device):
        cache = KVCache.preallocate(cfg.n_layer, rows, cfg.n_head, capacity, cfg.n_embd // cfg.n_head, model.dtype, device)
        model.__dict__["_static_cache"] = cache
    cache.reset()
    return cache


class Decoder:
    def __init__(self, model, rows: int, capacity: int, device, mask: Tensor | None = None,
                 token_type_ids: Tensor | None = None, past: KVCache | None = None, record: dict | None = None,
                 positions: Tensor | None = None, compiled=None):
        """record: {"attentions": [], "hidden_states": []} (either key) to collect, per forward,
        the per-layer attention weights / hidden states generate() returns. positions (N, T): the
        prompt's position ids, when the caller gives them (later tokens count on from the last).
        compiled: the model's compiled call (GPT2PreTrainedModel.get_compiled_call), which then runs
        every one-token step, on the cache the model keeps between requests (kept_cache)."""
        cfg = model.config
        self.model = model
        self.compiled = compiled
        if compiled is not None:
            self.cache = kept_cache(model, rows, capacity, torch.device(device))
        else:
            self.cache = KVCache.preallocate(cfg.n_layer, rows, cfg.n_head, capacity, cfg.n_embd // cfg.n_head,
                                             model.dtype, device)
        if past is not None:
            self.cache.load(past)
        self.token_type_ids = token_type_ids  # (N, T) for the uncached prompt; new tokens repeat its last column
        # shared[i, j]: how many leading cached positions rows i and j hold identically, because
        # reorder copied them from one row (beams share their history up to where they parted).
        # New tokens go after every shared position, so only a rollback lowers it.
        self.shared = torch.zeros(rows, rows, dtype=torch.long)
        self.record = record or {}
        self.hooked = bool(model._forward_hooks or model._forward_pre_hooks)  # hooks on the model itself
        self.unfused = ("the model's compiled call runs the steps" if compiled is not None
                        else unfused_reason(model, rows, token_type_ids, bool(self.record)))  # None: one call per new token
        self.step = DecodeStep(model) if self.unfused is None else None
        self.mask = self.positions = None
        if mask is not None and not bool(mask.all()):
            self.mask = torch.ones(rows, capacity, dtype=torch.long, device=device)  # (N, capacity)
            self.mask[:, : mask.size(1)] = mask
            self.positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)  # (N, T_mask), as transformers
        if positions is not None:
            self.positions = positions

    @property
    def length(self) -> int:
        return self.cache.length

    @torch.no_grad()
    def forward(self, ids: Tensor | None = None, embeds: Tensor | None = None, all_positions: bool = False) -> Tensor:
        """Run ids (N, k) (or embeds (N, k, C)) after the cache; float32 logits of the last
        position (N, V), or of every position (N, k, V) with all_positions."""
        k = (ids if ids is not None else embeds).size(1)
        if self.step is not None and k == 1 and ids is not None:
            positions = None if self.positions is None else self._positions(1)
            logits = self.step(ids, self.cache, positions, self.mask)  # (N, V)
            return logits[:, None] if all_positions else logits
        kwargs = {}
        if self.mask is not None:
            kwargs["attention_mask"] = self.mask[:, : self.length + k]
        if self.positions is not None:
            kwargs["position_ids"] = self._positions(k)
        if self.token_type_ids is not None:  # the prompt's, then its last column carried forward, as transformers does
            types = self.token_type_ids  # (N, T) before the prompt's forward, (N, 1) after it
            if types.size(1) < k:
                types = torch.cat((types, types[:, -1:].expand(-1, k - types.size(1))), dim=1)  # (N, k)
            kwargs["token_type_ids"] = types
            self.token_type_ids = types[:, -1:]
        kwargs.update(inputs_embeds=embeds, cache=self.cache, use_cache=True, return_dict=True,
                      output_attentions="attentions" in self.record, output_hidden_states="hidden_states" in self.record)
        compiled = self.compiled is not None and k == 1 and ids is not None  # the prompt and drafts run as they are
        if self.hooked or compiled:  # the model's own forward (so its hooks see each step), or its compiled call
            out = (self.compiled if compiled else self.model)(input_ids=ids, **kwargs)  # by keyword, as transformers calls it
            logits = out.logits  # (N, k, V)
        else:  # the last position's logits alone
            with kernel_products() if self.step is not None else contextlib.nullcontext():
                out = self.model.transformer(ids, **kwargs)  # see layers.kernel_products
            h = out.last_hidden_state
            if self.step is not None and not all_positions:  # the steps' own head product
                logits = self.step.logits(h[:, -1])[:, None]  # (N, 1, V)
            else:
                logits = self.model.lm_head(h if all_positions else h[:, -1:])  # (N, k or 1, V)
        for key in self.record:
            self.record[key].append(getattr(out, key))  # per layer: (N, nh, k, T_k) / (N, k, C)
        return (logits if all_positions else logits[:, -1]).float()  # (N, [k,] V)

    def greedy(self, tokens: Tensor, out: Tensor, unfinished: Tensor, eos: Tensor, pad: int) -> int:
        """The fused step's greedy loop (DecodeStep.greedy; self.step must be there): after tokens
        (N,), each row's next tokens into out (N, n) until it is full or no row is unfinished (N,)
        bool (updated in place; eos (n,) ends a row, pad follows). Returns how many tokens each row got."""
        positions = None if self.positions is None else self._positions(1).reshape(-1).clone()  # (N,)
        return self.step.greedy(tokens.clone(), self.cache, positions, self.mask, eos, pad, unfinished, out)

    def _positions(self, k: int) -> Tensor:
        """Position ids (N, k) of the next k tokens: the prompt's from its mask, then counting on."""
        start, n_prompt = self.length, self.positions.size(1)
        known = self.positions[:, start : start + k]  # the prompt's, as far as the k reach into it
        extra = k - known.size(1)
        if extra == 0:
            return known
        first = max(start, n_prompt) - n_prompt + 1  # how far past the prompt's last the first extra one is
        offsets = torch.arange(first, first + extra, device=self.positions.device)
        return torch.cat((known, self.positions[:, -1:] + offsets), dim=1)  # (N, k)

    def rollback(self, length: int) -> None:
        """Forget every cached token from `length` on (drafts the model rejected)."""
        self.cache.length = length
        self.shared.clamp_(max=length)  # positions from here on will be each row's own

    def reorder(self, rows: Tensor) -> None:
        """Row i continues from row rows[i] (beam search), in place. Of each row that changes,
        only the positions after the history it shares with its new source are copied."""
        rows = rows.cpu()
        self.shared.fill_diagonal_(self.length)
        self.cache.reorder(rows, start=self.shared[torch.arange(rows.numel()), rows].tolist())
        self.shared = self.shared[rows][:, rows]  # rows i, j now share what their sources shared
