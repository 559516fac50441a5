"""generate(): settings resolved once, inputs checked, then one of the searches.

Settings start from `model.generation_config` and are overridden by keywords, as in
transformers. The prompt (ids, or embeddings, optionally after a given cache) goes through the
model in one pass on a cache preallocated for the whole request; each step then computes the
logits of the last position only.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..cache import KVCache, as_cache, takes_past_key_values
from ..outputs import ModelOutput
from .config import GenerationConfig, as_generation_config
from .decoder import Decoder
from .processors import build_processors
from .search import beam_search, sample_search

@dataclass
class GenerateDecoderOnlyOutput(ModelOutput):
    """Greedy / sampling with return_dict_in_generate=True, as transformers'."""

    sequences: Tensor
    scores: tuple[Tensor, ...] | None = None  # per step (N, V), after the processors
    logits: tuple[Tensor, ...] | None = None  # per step (N, V), raw
    attentions: tuple[tuple[Tensor, ...], ...] | None = None  # per step, per layer (N, nh, k, T_k)
    hidden_states: tuple[tuple[Tensor, ...], ...] | None = None  # per step, per layer + 1 (N, k, C)
    cache: KVCache | None = None


@dataclass
class GenerateBeamDecoderOnlyOutput(ModelOutput):
    """Beam search with return_dict_in_generate=True, as transformers'."""

    sequences: Tensor
    sequences_scores: Tensor | None = None  # (B * num_return_sequences,), length-penalised log-probabilities
    scores: tuple[Tensor, ...] | None = None  # per step (B * num_beams, V): processed log-probabilities
    logits: tuple[Tensor, ...] | None = None
    beam_indices: Tensor | None = None  # (B * num_return_sequences, new): the row each token came from
    attentions: tuple[tuple[Tensor, ...], ...] | None = None  # per step, per layer (B * num_beams, nh, k, T_k)
    hidden_states: tuple[tuple[Tensor, ...], ...] | None = None
    cache: KVCache | None = None


@takes_past_key_values
def generate(
    model,
    input_ids: Tensor | None = None,
    generation_config: GenerationConfig | None = None,
    attention_mask: Tensor | None = None,
    token_type_ids: Tensor | None = None,
    position_ids: Tensor | None = None,
    inputs_embeds: Tensor | None = None,
    cache: Any = None,
    generator: torch.Generator | None = None,
    stream: bool = False,
    tokenizer: Any = None,
    stopping_criteria: Any = None,
    assistant_model: Any = None,
    **kwargs: Any,
) -> Tensor | GenerateDecoderOnlyOutput | GenerateBeamDecoderOnlyOutput | Iterator[Tensor]:
    """Continue input_ids [B, T] (or inputs_embeds [B, T, C]) as transformers' generate does.

    Keywords are GenerationConfig fields (max_new_tokens, do_sample, num_beams, top_k, ...).
    Returns the sequences [B * num_return_sequences, T + new] (only the new tokens for an
    inputs_embeds prompt), a GenerateDecoderOnlyOutput / GenerateBeamDecoderOnlyOutput with
    return_dict_in_generate=True, or with stream=True an iterator of each step's tokens [B].
    stopping_criteria: transformers' StoppingCriteria (any callables (sequences [M, L], scores) ->
    bool [M]), each asked after every token beside eos and stop_strings; they get scores=None.
    """
    given = model.generation_config if generation_config is None else generation_config
    cfg = as_generation_config(given, base=model.generation_config).update(**kwargs)
    mcfg = model.config
    cfg.check(mcfg.vocab_size, keywords=kwargs)
    if cfg.pad_token_id is None and cfg.eos_ids:
        cfg.pad_token_id = cfg.eos_ids[0]  # as transformers does for open-ended generation
    prompt = _Prompt(model, cfg, input_ids, attention_mask, token_type_ids, inputs_embeds, cache, position_ids)
    if stream and cfg.num_beams > 1:
        raise ValueError("stream=True works with greedy decoding and sampling, not with beam search (num_beams > 1)")
    if cfg.stop_strings is not None and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=... to generate()")
    assisted = assistant_model is not None or cfg.prompt_lookup_num_tokens is not None
    if assisted:
        _check_assisted(cfg, prompt, assistant_model, model, stream)
    if cfg.seed is not None:
        generator = torch.Generator(device=prompt.device).manual_seed(cfg.seed)

    copies = cfg.num_beams if cfg.num_beams > 1 else cfg.num_return_sequences
    prompt.expand(copies)
    N = prompt.batch * copies
    fill = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    if cfg.num_beams > 1:  # what transformers leaves after a finished hypothesis
        fill = (cfg.pad_token_id or cfg.eos_ids[0]) if cfg.eos_ids else -1
    out = prompt.ids.new_full((N, prompt.n_ids + prompt.n_new), fill)  # prompt ids + every new token
    out[:, : prompt.n_ids] = prompt.ids
    # each forward's attention weights / hidden states, kept when the returned dict carries them
    inside = {key: [] for key, wanted in (("attentions", cfg.output_attentions),
                                          ("hidden_states", cfg.output_hidden_states))
              if wanted and cfg.return_dict_in_generate}
    dec = Decoder(model, N, prompt.capacity, prompt.device, prompt.mask, prompt.token_type_ids, prompt.past, inside,
                  prompt.positions, compiled_call(model, cfg, prompt.device))
    chain = build_processors(cfg, prompt.n_ids, mcfg.vocab_size, prompt.padding, prompt.n_ids + prompt.n_new)
    stops = _stopping(cfg, tokenizer, stopping_criteria or [])
    record = {"scores": [], "logits": []} if cfg.return_dict_in_generate else None

    with torch.no_grad():
        logits = dec.forward(prompt.fed_ids, prompt.embeds)  # (N, V)
        if cfg.num_beams > 1:
            sequences, seq_scores, origin = beam_search(dec, logits, out, prompt.n_ids, cfg, chain, stops, generator, record)
            if not cfg.return_dict_in_generate:
                return sequences
            return GenerateBeamDecoderOnlyOutput(
                sequences=sequences,
                sequences_scores=seq_scores if cfg.output_scores else None,
                scores=tuple(record["scores"]) if cfg.output_scores else None,
                logits=tuple(record["logits"]) if cfg.output_logits else None,
                beam_indices=origin,
                cache=dec.cache,
                **_per_step(inside, sequences.size(1) - prompt.n_ids),
            )
    if assisted:
        from .assisted import assisted_search, draft_from_assistant, draft_from_prompt

        if assistant_model is not None:
            draft = draft_from_assistant(assistant_model, out, prompt.capacity, chain, cfg.do_sample, generator,
                                         prompt.mask, prompt.token_type_ids)
        else:
            draft = draft_from_prompt(cfg.prompt_lookup_num_tokens, cfg.max_matching_ngram_size or 2)
        steps = assisted_search(dec, logits, out, prompt.n_ids, cfg, chain, stops, draft, cfg.num_assistant_tokens
                                if assistant_model is not None else cfg.prompt_lookup_num_tokens, generator, record)
    else:
        # greedy steps that nothing in Python watches run in the kernels' loop (the default request's path)
        fused = (dec.step is not None and not stream and not cfg.do_sample and not chain and record is None
                 and not cfg.stop_strings and not stopping_criteria)
        steps = sample_search(dec, logits, out, prompt.n_ids, cfg, chain, stops, fill, generator, record, fused)
    if stream:
        return steps
    n_new = sum(1 for _ in steps)
    sequences = out[:, : prompt.n_ids + n_new]
    if not cfg.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(record["scores"]) if cfg.output_scores else None,
        logits=tuple(record["logits"]) if cfg.output_logits else None,
        cache=dec.cache,
        **_per_step(inside, n_new),
    )


COMPILED_DEVICES = ("cuda", "xpu", "neuron", "tpu")  # where transformers compiles without being told to


def compiled_call(model, cfg: GenerationConfig, device: torch.device):
    """The model's compiled call (GPT2PreTrainedModel.get_compiled_call) when generate compiles its
    one-token steps, as transformers decides it: a "static" cache, a model whose forward compiles as
    one graph, on an accelerator, or on any device when compile_config._compile_all_devices says so;
    else None. The prompt is never compiled (its length changes from one request to the next)."""
    if cfg.cache_implementation != "static" or not getattr(model, "_can_compile_fullgraph", False):
        return None
    if device.type not in COMPILED_DEVICES and not getattr(cfg.compile_config, "_compile_all_devices", False):
        return None
    return model.get_compiled_call(cfg.compile_config)


def _per_step(inside: dict[str, list], n_new: int) -> dict[str, tuple]:
    """The attentions / hidden states of the forwards that chose the n_new tokens, one tuple (per
    layer) a token, as transformers returns them."""
    return {key: tuple(steps[:n_new]) for key, steps in inside.items()}


def compute_transition_scores(sequences: Tensor, scores: tuple[Tensor, ...], beam_indices: Tensor | None = None,
                              normalize_logits: bool = False) -> Tensor:
    """The score of each generated token at the step that chose it, (N, steps), as transformers'
    method of this name: `scores` (one (rows, V) tensor per step, from generate(output_scores=True))
    read at the token, in the row it came from (beam_indices for beams, else the row itself); 0
    after a beam hypothesis ended. normalize_logits log-softmaxes each step's scores first."""
    steps = torch.stack(tuple(scores), dim=1)  # (rows, S, V)
    if normalize_logits:
        steps = steps.log_softmax(dim=-1)
    if beam_indices is None:
        beam_indices = torch.arange(steps.size(0), device=steps.device)[:, None].expand(-1, steps.size(1))
    n_steps = int((beam_indices >= 0).sum(dim=1).max())  # the longest hypothesis
    rows = beam_indices[:, :n_steps]  # (N, n_steps), -1 after a hypothesis ended
    tokens = sequences[:, sequences.size(1) - n_steps :]  # (N, n_steps)
    picked = steps[rows.clamp(min=0), torch.arange(n_steps, device=steps.device), tokens]
    return picked.masked_fill(rows < 0, 0.0)


class _Prompt:
    """The checked prompt: ids and/or embeddings, mask, token types, a cache to continue, lengths."""

    def __init__(self, model, cfg: GenerationConfig, ids, mask, token_types, embeds, past, positions=None):
        mcfg = model.config
        if ids is None and embeds is None:  # transformers starts a single row from bos
            if cfg.bos_token_id is None:
                raise ValueError("generate() needs input_ids or inputs_embeds (or a bos_token_id to start from)")
            ids = torch.full((1, 1), cfg.bos_token_id, dtype=torch.long, device=model.device)
        if ids is not None:
            if not isinstance(ids, Tensor):
                raise TypeError(f"input_ids must be a torch.Tensor, got {type(ids).__name__}")
            if ids.dim() == 1:
                ids = ids.unsqueeze(0)
            if ids.dim() != 2 or ids.dtype.is_floating_point or ids.dtype == torch.bool:
                raise ValueError(f"input_ids must be an integer tensor [B, T], got {ids.dtype} {tuple(ids.shape)}")
            if ids.size(1) == 0 and embeds is None:
                raise ValueError(f"input_ids must hold at least one token, got shape {tuple(ids.shape)}")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= mcfg.vocab_size):
                bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
                raise ValueError(f"input_ids hold {bad}, outside [0, {mcfg.vocab_size})")
            ids = ids.long()
        if embeds is not None:
            if not isinstance(embeds, Tensor) or embeds.dim() != 3 or embeds.size(-1) != mcfg.n_embd or embeds.size(1) == 0:
                raise ValueError(f"inputs_embeds must be a tensor [B, T, n_embd={mcfg.n_embd}], got "
                                 f"{tuple(embeds.shape) if isinstance(embeds, Tensor) else type(embeds).__name__}")
        self.device = (ids if ids is not None else embeds).device
        B = (ids if ids is not None else embeds).size(0)

        past_cache = None
        if past is not None:
            past_cache = as_cache(past, mcfg, model.dtype)  # checked as the forward pass checks it
        past_len = past_cache.length if past_cache is not None else 0
        if past_cache is not None and past_cache.batch_size != B:
            raise ValueError(f"past_key_values hold batch size {past_cache.batch_size}, the prompt has {B}")

        if embeds is not None and ids is None and 0 < past_len < embeds.size(1):
            # transformers' other form: the embeddings of the whole sequence, the cached positions too
            embeds = embeds[:, past_len:]
        if embeds is not None:  # the prompt is the embeddings; input_ids given are the tokens out starts with:
            # the cached ones, or those and the ones the embeddings stand for (as transformers returns them)
            if ids is not None and ids.size(1) not in (past_len, past_len + embeds.size(1)):
                raise ValueError(f"with inputs_embeds of {embeds.size(1)} positions, input_ids must be the "
                                 f"{past_len} cached tokens or those and the {embeds.size(1)} the embeddings "
                                 f"stand for, got {ids.size(1)}")
            if embeds.size(0) != B:
                raise ValueError(f"inputs_embeds have batch size {embeds.size(0)}, input_ids {B}")
            ids = ids if ids is not None else torch.zeros(B, 0, dtype=torch.long, device=self.device)
            fed = None
            n_fed = embeds.size(1)
        else:
            if past_len >= ids.size(1):
                raise ValueError(f"input_ids ({ids.size(1)} tokens) must extend past_key_values ({past_len} tokens)")
            fed = ids[:, past_len:]
            n_fed = fed.size(1)
        T_all = past_len + n_fed  # positions the prompt occupies

        if mask is None and embeds is None and cfg.pad_token_id is not None and cfg.pad_token_id not in cfg.eos_ids \
                and bool((ids == cfg.pad_token_id).any()):
            mask = (ids != cfg.pad_token_id).long()  # transformers infers it the same way
        if mask is not None:
            mask = _check_mask(mask, B, T_all)
        if token_types is not None:
            if not isinstance(token_types, Tensor) or tuple(token_types.shape) != (B, ids.size(1) if embeds is None else n_fed):
                raise ValueError(f"token_type_ids must have the shape of the prompt, got "
                                 f"{tuple(token_types.shape) if isinstance(token_types, Tensor) else token_types!r}")
            token_types = token_types[:, past_len:] if embeds is None else token_types
        if positions is not None:
            if not isinstance(positions, Tensor) or tuple(positions.shape) not in ((B, T_all), (1, T_all)):
                raise ValueError(f"position_ids must be ({B}, {T_all}): one per cached and prompt token, got "
                                 f"{tuple(positions.shape) if isinstance(positions, Tensor) else positions!r}")
            positions = positions.long().expand(B, T_all)

        if cfg.max_new_tokens is not None:
            n_new = cfg.max_new_tokens
        elif cfg.max_length is not None:
            # counted as transformers counts: the ids out starts with (cached ones included) and
            # the embedded positions, unless those ids are the embeddings' own tokens
            counted = ids.size(1) if embeds is None or ids.size(1) == n_fed else ids.size(1) + n_fed
            n_new = cfg.max_length - counted
        else:
            n_new = 20  # transformers' default when neither is set
        if n_new < 1:
            raise ValueError(f"max_length={cfg.max_length} leaves no room after the prompt of "
                             f"{counted} tokens: set max_new_tokens")
        capacity = T_all + n_new
        if capacity > mcfg.n_positions:
            raise ValueError(
                f"prompt of {T_all} tokens + max_new_tokens={n_new} = {capacity} positions, "
                f"but the model has n_positions={mcfg.n_positions}"
            )
        if mask is not None and B > 1 and bool((mask[:, -1] == 0).any()):
            warnings.warn("right-padding was detected in attention_mask: decoder-only models need left padding "
                          "for correct results (pad on the left)", stacklevel=3)
        self.ids, self.fed_ids, self.embeds, self.mask = ids, fed, embeds, mask
        self.token_type_ids, self.past, self.positions = token_types, past_cache, positions
        self.batch, self.n_ids, self.n_new, self.capacity = B, ids.size(1), n_new, capacity
        # left padding of the prompt ids (the repetition penalty skips it), as transformers finds it
        self.padding = None
        if mask is not None and embeds is None:
            first = (mask != 0).int().argmax(dim=1)  # (B,)
            self.padding = torch.arange(ids.size(1), device=self.device)[None, :] < first[:, None]

    def expand(self, copies: int) -> None:
        """Repeat every row `copies` times (beams, or several samples per prompt)."""
        if copies == 1:
            return
        rep = lambda t: None if t is None else t.repeat_interleave(copies, dim=0)  # noqa: E731
        self.ids, self.fed_ids, self.embeds = rep(self.ids), rep(self.fed_ids), rep(self.embeds)
        self.mask, self.token_type_ids, self.padding = rep(self.mask), rep(self.token_type_ids), rep(self.padding)
        self.positions = rep(self.positions)


def _check_mask(mask: Any, B: int, T: int) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"attention_mask must be a torch.Tensor, got {type(mask).__name__}")
    if tuple(mask.shape) != (B, T):
        raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, expected ({B}, {T}) (cached + prompt tokens)")
    values = set(torch.unique(mask).tolist())
    if not values <= {0, 1}:
        raise ValueError(f"attention_mask must hold only 0 (padding) and 1 (token), got values {sorted(values)}")
    empty = (mask == 0).all(dim=1)
    if bool(empty.any()):
        raise ValueError(f"attention_mask rows {empty.nonzero().flatten().tolist()} are all padding: nothing to continue")
    return mask.long()


def _stopping(cfg: GenerationConfig, tokenizer, criteria):
    """sequences [M, L] -> bool [M]: the last token is an eos id, completes a stop string, or one of
    the caller's stopping criteria says the row is done."""
    eos = cfg.eos_ids
    stop_strings = [cfg.stop_strings] if isinstance(cfg.stop_strings, str) else cfg.stop_strings
    if not callable(criteria) and not all(callable(c) for c in criteria):
        raise TypeError("stopping_criteria must be a StoppingCriteriaList or a list of callables "
                        "(sequences, scores) -> bool per row")
    criteria = [criteria] if callable(criteria) else list(criteria)
    if not eos and not stop_strings and not criteria:
        return None

    def stops(seqs: Tensor) -> Tensor:
        hit = torch.zeros(seqs.size(0), dtype=torch.bool, device=seqs.device)
        if eos:
            hit |= torch.isin(seqs[:, -1], torch.tensor(eos, device=seqs.device))
        if stop_strings:
            hit |= torch.tensor([_ends_with_stop(tokenizer, row, stop_strings) for row in seqs.tolist()],
                                dtype=torch.bool, device=seqs.device)
        for criterion in criteria:
            hit |= torch.as_tensor(criterion(seqs, None), dtype=torch.bool, device=seqs.device).expand(seqs.size(0))
        return hit

    return stops


def _ends_with_stop(tokenizer, ids: list[int], stop_strings: list[str]) -> bool:
    """Does a stop string end inside the last token's text?"""
    longest = max(len(s) for s in stop_strings)
    tail = ids[-(longest + 1) :]
    before, text = tokenizer.decode(tail[:-1]), tokenizer.decode(tail)
    return any(text.find(s, max(0, len(before) - len(s) + 1)) != -1 for s in stop_strings)


def _check_assisted(cfg: GenerationConfig, prompt: _Prompt, assistant, model, stream: bool) -> None:
    if assistant is not None and cfg.prompt_lookup_num_tokens is not None:
        raise ValueError("pass assistant_model or prompt_lookup_num_tokens, not both")
    if cfg.num_beams > 1 or cfg.num_return_sequences > 1:
        raise ValueError("assisted decoding (assistant_model / prompt_lookup_num_tokens) decodes greedily or "
                         "samples one sequence: num_beams=1, num_return_sequences=1")
    if prompt.batch != 1 or prompt.embeds is not None or prompt.past is not None:
        raise ValueError("assisted decoding takes one prompt of input_ids (batch size 1), without inputs_embeds "
                         "or past_key_values")
    if assistant is not None and assistant.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"assistant_model has vocab_size {assistant.config.vocab_size}, the model "
                         f"{model.config.vocab_size}: they must share the vocabulary")
