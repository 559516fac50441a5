"""GPT2Model and GPT2LMHeadModel: ids -> embeddings -> blocks -> ln_f (-> lm_head).

State-dict keys and shapes equal `transformers`' GPT-2, so HF checkpoints load with
`load_state_dict` and the other way round.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from .attention import causal_mask
from .cache import KVCache
from .config import GPT2Config
from .layers import Block, init_weights
from .outputs import BaseModelOutput, CausalLMOutput


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
            out[:, start : start + w.size(0)] = torch.mm(w, h.t()).t()
        return out.view(*x.shape[:-1], vocab)


class GPT2PreTrainedModel(nn.Module):
    """What both models share: the config, checkpoint files, gradient checkpointing."""

    def __init__(self, config: GPT2Config):
        super().__init__()
        config.validate()
        self.config = config

    @classmethod
    def from_pretrained(cls, src: Any, dtype: Any = None, device: Any = None, **kwargs: Any):
        """Load from an HF folder, a hub name, a state dict or an OpenAI TF checkpoint."""
        from .checkpoint import from_pretrained

        return from_pretrained(cls, src, dtype=dtype, device=device, **kwargs)

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None:
        """Write an HF model folder (config.json + safetensors) that `transformers` opens."""
        from .checkpoint import save_pretrained

        save_pretrained(self, save_directory, **kwargs)

    def gradient_checkpointing_enable(self) -> None:
        self.base_model.gradient_checkpointing = True

    def gradient_checkpointing_disable(self) -> None:
        self.base_model.gradient_checkpointing = False

    def configure_optimizers(self, weight_decay: float, learning_rate: float, betas: tuple[float, float],
                             device_type: str | None = None) -> torch.optim.AdamW:
        """AdamW that decays only matrices and embeddings (>= 2-D), not biases or LayerNorm
        gains; fused on CUDA and CPU, where torch has a fused kernel."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        device_type = device_type or self.device.type
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=device_type in ("cuda", "cpu"))

    @property
    def base_model(self) -> "GPT2Model":
        return self

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self) -> int:
        """Distinct parameters (a tied head counts once)."""
        return sum(p.numel() for p in self.parameters())


class GPT2Model(GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config, layer_idx=i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        self.gradient_checkpointing = False
        init_weights(self, config)

    def get_input_embeddings(self) -> nn.Embedding:
        return self.wte

    def forward(
        self,
        input_ids: Tensor | None = None,
        past_key_values: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> BaseModelOutput:
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        if self.gradient_checkpointing and self.training and use_cache:
            warnings.warn("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False

        B, T = _check_inputs(cfg, input_ids, inputs_embeds)
        cache = _as_cache(past_key_values, cfg.n_layer)
        if cache is None and use_cache:
            cache = KVCache(cfg.n_layer)
        past_len = cache.length if cache is not None else 0
        if cache is not None and cache.batch_size not in (None, B):
            raise ValueError(f"past_key_values hold batch size {cache.batch_size}, input has batch size {B}")

        # Embeddings: tokens + positions (+ token types, which share wte as in HF).
        if position_ids is None:
            if past_len + T > cfg.n_positions:
                raise ValueError(
                    f"sequence too long: {past_len} cached + {T} new = {past_len + T} positions, "
                    f"but the model has n_positions={cfg.n_positions}"
                )
            device = input_ids.device if input_ids is not None else inputs_embeds.device
            position_ids = torch.arange(past_len, past_len + T, device=device).unsqueeze(0)  # (1, T)
        else:
            _check_ids("position_ids", position_ids, B, T, cfg.n_positions)
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        x = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            _check_ids("token_type_ids", token_type_ids, B, T, cfg.vocab_size)
            x = x + self.wte(token_type_ids)
        x = self.drop(x)

        mask = _build_mask(attention_mask, B, T, past_len, cfg.n_head)
        head_mask = _layer_head_masks(head_mask, cfg.n_layer, cfg.n_head, x.dtype)

        all_hidden = [] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        for i, block in enumerate(self.h):
            if all_hidden is not None:
                all_hidden.append(x)
            layer_head_mask = head_mask[i] if head_mask is not None else None
            if self.gradient_checkpointing and self.training:
                x, weights = checkpoint(block, x, None, mask, layer_head_mask, output_attentions, use_reentrant=False)
            else:
                x, weights = block(x, cache, mask, layer_head_mask, output_attentions)
            if all_weights is not None:
                all_weights.append(weights)
        if cache is not None:
            cache.advance(T)
        x = self.ln_f(x)
        if all_hidden is not None:
            all_hidden.append(x)

        return BaseModelOutput(
            last_hidden_state=x,
            past_key_values=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_weights) if all_weights is not None else None,
            cross_attentions=() if output_attentions else None,  # as transformers, without cross-attention
        )


class GPT2LMHeadModel(GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()
        else:
            init_weights(self.lm_head, config)

    @property
    def base_model(self) -> GPT2Model:
        return self.transformer

    def get_input_embeddings(self) -> nn.Embedding:
        return self.transformer.wte

    def tie_weights(self) -> None:
        """Make lm_head use wte's weight (again, e.g. after loading with assign=True)."""
        self.lm_head.weight = self.transformer.wte.weight

    def forward(
        self,
        input_ids: Tensor | None = None,
        past_key_values: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool = False,
        output_hidden_states: bool = False,
    ) -> CausalLMOutput:
        out = self.transformer(
            input_ids,
            past_key_values=past_key_values,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
        )
        logits = self.lm_head(out.last_hidden_state)  # (B, T, vocab)
        loss = None
        if labels is not None:
            loss = lm_loss(logits, labels, self.config.vocab_size)
        return CausalLMOutput(loss, logits, out.past_key_values, out.hidden_states, out.attentions, out.cross_attentions)

    def generate(self, input_ids: Tensor, **kwargs: Any) -> Any:
        """Greedy or sampled continuation of input_ids; see gpt2attn.generation.generate."""
        from .generation import generate

        return generate(self, input_ids, **kwargs)


def lm_loss(logits: Tensor, labels: Tensor, vocab_size: int) -> Tensor:
    """Next-token cross-entropy: position t predicts labels[t+1]; label -100 is ignored."""
    if labels.shape != logits.shape[:2]:
        raise ValueError(f"labels have shape {tuple(labels.shape)}, expected {tuple(logits.shape[:2])}")
    bad = (labels != -100) & ((labels < 0) | (labels >= vocab_size))
    if bad.any():
        raise ValueError(f"labels hold {labels[bad][0].item()}: labels must be -100 or in [0, {vocab_size})")
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    return F.cross_entropy(shift_logits, shift_labels, ignore_index=-100)


# --- input checks and masks ------------------------------------------------------------


def _check_inputs(cfg: GPT2Config, input_ids: Tensor | None, inputs_embeds: Tensor | None) -> tuple[int, int]:
    """Exactly one of input_ids (B, T) / inputs_embeds (B, T, C), valid; returns (B, T)."""
    if (input_ids is None) == (inputs_embeds is None):
        raise ValueError("pass exactly one of input_ids and inputs_embeds (got both or neither)")
    if input_ids is not None:
        if input_ids.dim() != 2 or input_ids.size(1) == 0:
            raise ValueError(f"input_ids must be [batch, seq_len] with seq_len > 0, got shape {tuple(input_ids.shape)}")
        _check_ids("input_ids", input_ids, *input_ids.shape, cfg.vocab_size)
        return input_ids.shape
    if inputs_embeds.dim() != 3 or inputs_embeds.size(-1) != cfg.n_embd or inputs_embeds.size(1) == 0:
        raise ValueError(
            f"inputs_embeds must be [batch, seq_len, n_embd={cfg.n_embd}], got shape {tuple(inputs_embeds.shape)}"
        )
    return inputs_embeds.shape[:2]


def _check_ids(name: str, ids: Tensor, B: int, T: int, limit: int) -> None:
    """ids must be integers in [0, limit) shaped (B, T) or (1, T)."""
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"{name} must be an integer tensor, got {ids.dtype}")
    if ids.dim() != 2 or ids.size(1) != T or ids.size(0) not in (1, B):
        raise ValueError(f"{name} has shape {tuple(ids.shape)}, expected ({B}, {T})")
    lo, hi = ids.min().item(), ids.max().item()
    if lo < 0 or hi >= limit:
        bad = lo if lo < 0 else hi
        raise ValueError(f"{name} holds {bad}, outside [0, {limit})")


def _as_cache(past: Any, n_layer: int) -> KVCache | None:
    """None, our KVCache, HF's legacy tuple of (key, value) pairs, or an HF DynamicCache."""
    if past is None or isinstance(past, KVCache):
        cache = past
    elif isinstance(past, (tuple, list)):
        cache = KVCache.from_legacy(past) if len(past) > 0 else None
    elif hasattr(past, "layers"):  # transformers' DynamicCache
        cache = KVCache.from_legacy([(layer.keys, layer.values) for layer in past.layers])
    else:
        raise ValueError(
            f"past_key_values must be a KVCache, a tuple of (key, value) pairs or a transformers "
            f"DynamicCache, got {type(past).__name__}"
        )
    if cache is not None and len(cache) != n_layer:
        raise ValueError(f"past_key_values have {len(cache)} layers, the model has {n_layer}")
    return cache


def _build_mask(attention_mask: Tensor | None, B: int, T: int, past_len: int, n_head: int) -> Tensor | None:
    """The mask every layer uses: None for plain causal attention, else bool (B, 1, T, T_k).

    A 2-D padding mask (1 = token, 0 = padding) over all T_k = past_len + T positions is
    combined with the causal mask; a 4-D mask (bool or additive) is used as it is.
    """
    if attention_mask is None:
        return None
    T_k = past_len + T
    if attention_mask.dim() == 2:
        if tuple(attention_mask.shape) != (B, T_k):
            raise ValueError(
                f"attention_mask has shape {tuple(attention_mask.shape)}, expected ({B}, {T_k}) "
                f"= (batch, cached {past_len} + new {T} positions)"
            )
        keep = attention_mask.bool()
        if keep.all():
            return None
        allowed = causal_mask(T, T_k, attention_mask.device) & keep[:, None, None, :]  # (B, 1, T, T_k)
        # A query that may see no key at all (padding at the left edge) sees every key instead,
        # so its softmax stays finite; nothing real attends to that position.
        return allowed | ~allowed.any(dim=-1, keepdim=True)
    if attention_mask.dim() == 4:
        b, h, q, k = attention_mask.shape
        if b not in (1, B) or h not in (1, n_head) or q != T or k != T_k:
            raise ValueError(
                f"4-D attention_mask has shape {tuple(attention_mask.shape)}, expected "
                f"({B} or 1, 1 or {n_head}, {T}, {T_k})"
            )
        return attention_mask
    raise ValueError(f"attention_mask must be 2-D [batch, seq] or 4-D, got shape {tuple(attention_mask.shape)}")


def _layer_head_masks(head_mask: Tensor | None, n_layer: int, n_head: int, dtype: torch.dtype) -> Tensor | None:
    """[n_head] or [n_layer, n_head] multipliers -> (n_layer, 1, nh, 1, 1)."""
    if head_mask is None:
        return None
    if head_mask.dim() == 1 and head_mask.size(0) == n_head:
        head_mask = head_mask.expand(n_layer, n_head)
    if tuple(head_mask.shape) != (n_layer, n_head):
        raise ValueError(f"head_mask has shape {tuple(head_mask.shape)}, expected ({n_head},) or ({n_layer}, {n_head})")
    return head_mask.to(dtype)[:, None, :, None, None]
