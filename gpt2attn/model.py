"""GPT2Model and GPT2LMHeadModel: ids -> embeddings -> blocks -> ln_f (-> lm_head).

State-dict keys and shapes equal `transformers`' GPT-2, so HF checkpoints load with
`load_state_dict` and the other way round.
"""

from __future__ import annotations

import warnings
from contextlib import nullcontext
from typing import Any

from torch import Tensor, nn
from torch.autograd.graph import save_on_cpu
from torch.utils.checkpoint import checkpoint

from .cache import KVCache, as_cache, takes_past_key_values, write_back
from .attention import packed_causal_mask
from .config import GPT2Config
from .generation import GenerationMixin
from .inputs import (
    check_forward_kwargs, check_ids, check_inputs, encoder_attention, kept_positions, layer_head_masks,
    positions, self_attention_mask,
)
from .layers import Block, LMHead, init_weights
from .losses import lm_loss
from .outputs import BaseModelOutput, CausalLMOutput
from .pretrained import GPT2PreTrainedModel


class GPT2Model(GPT2PreTrainedModel):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        if getattr(config, "pruned_heads", None):  # a transformers 4 key; its checkpoints have smaller shapes
            raise ValueError(f"pruned_heads={config.pruned_heads!r}: models with pruned attention heads are not supported")
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.n_positions, config.n_embd)
        self.drop = nn.Dropout(config.embd_pdrop)
        self.h = nn.ModuleList(Block(config, layer_idx=i) for i in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon)
        # see activation_checkpointing_enable; transformers 4's configs could switch it on
        self.gradient_checkpointing = bool(getattr(config, "gradient_checkpointing", False))
        self.gradient_checkpointing_kwargs = {"use_reentrant": False}
        self.checkpoint_every = 1
        self.checkpoint_offload = False
        init_weights(self, config)

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | list | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        **kwargs: Any,
    ) -> BaseModelOutput | tuple:
        """Arguments left at None take the config's value (use_cache, output_attentions,
        output_hidden_states, return_dict), as in transformers; return_dict=False gives the tuple.
        **kwargs: the extra keywords transformers' forward takes (see check_forward_kwargs); with a
        registered attention function (attn_implementation) they are handed down to it."""
        attention_kwargs = check_forward_kwargs(kwargs, self.config._attn_implementation)
        cfg = self.config
        use_cache = cfg.use_cache if use_cache is None else use_cache
        output_attentions = cfg.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = cfg.output_hidden_states if output_hidden_states is None else output_hidden_states
        return_dict = cfg.return_dict if return_dict is None else return_dict
        if self.gradient_checkpointing and self.training and use_cache:
            warnings.warn("use_cache=True is incompatible with gradient checkpointing; setting use_cache=False")
            use_cache = False

        device = self.wte.weight.device
        input_ids, inputs_embeds = check_inputs(cfg, input_ids, inputs_embeds, self.wte.weight.dtype, device)
        B, T = input_ids.shape if input_ids is not None else inputs_embeds.shape[:2]
        given, cache = cache, as_cache(cache, cfg, self.wte.weight.dtype)
        if cache is None and use_cache:
            cache = KVCache(cfg.n_layer)
        past_len = cache.length if cache is not None else 0
        if cache is not None and cache.batch_size is not None and cache.batch_size != B:
            raise ValueError(f"past_key_values hold batch size {cache.batch_size}, input has batch size {B}")
        # Sequences packed into a row (position ids restarting) attend each within its own, as
        # transformers' mask creation makes them without a padding mask or a cache.
        packed = position_ids is not None and attention_mask is None and cache is None
        position_ids = positions(position_ids, B, T, past_len, cfg.n_positions, device)  # (B|1, T)

        # ids -> embeddings: tokens + positions (+ token types, which share wte as in transformers)
        if inputs_embeds is None:
            inputs_embeds = self.wte(input_ids)  # (B, T, C)
        x = inputs_embeds + self.wpe(position_ids)
        if token_type_ids is not None:
            x = x + self.wte(check_ids("token_type_ids", token_type_ids, B, T, cfg.vocab_size, device))
        x = self.drop(x)

        # the masks every block uses
        if packed:
            mask = packed_causal_mask(position_ids.expand(B, T))  # (B, 1, T, T), None if nothing is packed
        else:
            mask = self_attention_mask(attention_mask, B, T, past_len, cfg.n_head)  # None: plain causal
        head_mask = layer_head_masks(head_mask, cfg.n_layer, cfg.n_head, x.dtype)
        encoder_mask = encoder_attention(cfg, encoder_hidden_states, encoder_attention_mask, B)

        # -> blocks
        checkpointing = self.gradient_checkpointing and self.training
        if checkpointing and self.gradient_checkpointing_kwargs.get("use_reentrant") and not x.requires_grad:
            x.requires_grad_(True)  # reentrant checkpointing only backpropagates into blocks whose input needs grad
        all_hidden = [] if output_hidden_states else None
        all_weights = [] if output_attentions else None
        all_cross = [] if output_attentions else None
        for i, block in enumerate(self.h):
            if all_hidden is not None:
                all_hidden.append(x)
            layer_head_mask = head_mask[i] if head_mask is not None else None
            if checkpointing and i % self.checkpoint_every == 0:
                offload = self.checkpoint_offload  # what the block saves for backward goes to host memory
                with save_on_cpu(pin_memory=x.is_cuda, device_type=x.device.type) if offload else nullcontext():
                    x, weights, cross = checkpoint(block, x, None, mask, layer_head_mask, output_attentions,
                                                   encoder_hidden_states, encoder_mask,
                                                   **self.gradient_checkpointing_kwargs, **attention_kwargs)
            else:
                x, weights, cross = block(x, cache, mask, layer_head_mask, output_attentions,
                                          encoder_hidden_states, encoder_mask, **attention_kwargs)
            if all_weights is not None:
                all_weights.append(weights)
                if cross is not None:
                    all_cross.append(cross)
        if cache is not None:
            cache.advance(T)
            cache = write_back(given, cache, past_len)  # a DynamicCache passed in grows, as in transformers
        # -> ln_f
        x = self.ln_f(x)
        if all_hidden is not None:
            all_hidden.append(x)

        out = BaseModelOutput(
            last_hidden_state=x,
            cache=cache if use_cache else None,
            hidden_states=tuple(all_hidden) if all_hidden is not None else None,
            attentions=tuple(all_weights) if all_weights is not None else None,
            cross_attentions=tuple(all_cross) if all_cross is not None else None,  # () without encoder states
        )
        return out if return_dict else out.to_tuple()


class GPT2LMHeadModel(GPT2PreTrainedModel, GenerationMixin):
    def __init__(self, config: GPT2Config):
        super().__init__(config)
        self.transformer = GPT2Model(config)
        self.lm_head = LMHead(config.n_embd, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.tie_weights()
        else:
            init_weights(self.lm_head, config)

    accepts_loss_kwargs = True  # transformers' Trainer passes num_items_in_batch to forward
    output_modalities = ("text",)
    _tied_weights_keys = {"lm_head.weight": "transformer.wte.weight"}  # target: source, as transformers 5

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head

    def set_output_embeddings(self, new_embeddings: nn.Linear) -> None:
        self.lm_head = new_embeddings

    @takes_past_key_values
    def forward(
        self,
        input_ids: Tensor | list | None = None,
        cache: KVCache | tuple | None = None,
        attention_mask: Tensor | None = None,
        token_type_ids: Tensor | None = None,
        position_ids: Tensor | None = None,
        head_mask: Tensor | None = None,
        inputs_embeds: Tensor | None = None,
        encoder_hidden_states: Tensor | None = None,
        encoder_attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        use_cache: bool | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        num_items_in_batch: int | Tensor | None = None,
        logits_to_keep: int | Tensor = 0,
        **kwargs: Any,
    ) -> CausalLMOutput | tuple:
        """logits_to_keep, as in transformers: an int N computes the logits of the last N positions
        only (0: all of them), a 1-D tensor those of the positions it lists, a 2-D one per row
        (integer: positions (B, K); bool (B, T): the True positions, flattened to (K, V)).
        shift_labels (B, T), a keyword: targets already aligned with the logits (position t's target at
        t), as sequence-parallel trainers pass them; the loss then uses them instead of shifting
        labels. (A keyword, not a parameter, as in transformers: Trainer takes every parameter whose
        name holds "label" for a label column the batch must carry.)"""
        shift_labels = kwargs.pop("shift_labels", None)
        out = self.transformer(
            input_ids,
            cache=cache,
            attention_mask=attention_mask,
            token_type_ids=token_type_ids,
            position_ids=position_ids,
            head_mask=head_mask,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            use_cache=use_cache,
            output_attentions=output_attentions,
            output_hidden_states=output_hidden_states,
            return_dict=True,
            **kwargs,  # checked there; with a registered attention function, handed down to it
        )
        logits = self.lm_head(kept_positions(out.last_hidden_state, logits_to_keep))  # (B, T, vocab), T as kept
        loss = None
        if shift_labels is not None:
            loss = lm_loss(logits, shift_labels, self.config.vocab_size, num_items_in_batch, shifted=True)
        elif labels is not None:
            loss = lm_loss(logits, labels, self.config.vocab_size, num_items_in_batch)
        out = CausalLMOutput(loss, logits, out.cache, out.hidden_states, out.attentions, out.cross_attentions)
        return_dict = self.config.return_dict if return_dict is None else return_dict
        return out if return_dict else out.to_tuple()
