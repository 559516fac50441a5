"""GPT2PreTrainedModel: what every gpt2attn model class shares, the surface transformers' models
have around their forward pass. Loading and saving (gpt2attn/loader.py, formats/hf.py), CPU
inference in fp32, fp16, bf16, int8 or q4 (quantize.py), the zero-copy bridge to transformers (bridge.py), embeddings and
their resizing, activation checkpointing switches, parameter counts. model.py builds on it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from .config import GPT2Config, as_torch_dtype, check_config, is_int
from .generation.config import GenerationConfig, compile_options
from .generation.mixin import GenerationMixin
from .formats.hf import save_pretrained
from .adapters import AdapterMixin
from .attention import is_registered, registered_attention
from .bridge import from_transformers, to_transformers
from .layers import init_weights
from .loader import from_pretrained
from .quantize import quantize


class GPT2PreTrainedModel(AdapterMixin, nn.Module):
    """What every GPT-2 model shares: the config, checkpoint files, embeddings access and resizing,
    gradient checkpointing; the class attributes transformers' GPT2PreTrainedModel has."""

    config_class = GPT2Config
    base_model_prefix = "transformer"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = True
    _keys_to_ignore_on_save = None  # read by transformers.Trainer when it resumes from a checkpoint
    _keys_to_ignore_on_load_missing = None  # (transformers' loader) no weight may be missing silently
    _keys_to_ignore_on_load_unexpected = None
    model_tags: list[str] | None = None  # the hub's tags for this model (TRL's trainers add theirs)
    input_modalities = "text"
    generation_config_class = GenerationConfig  # what generate() and generation_config take

    # The attention backends (transformers' attn_implementation): "sdpa", PyTorch's fused kernel
    # wherever no attention weights are wanted; "eager", the textbook formula of attention.py
    # everywhere; or the name of a function registered in transformers' AttentionInterface, which
    # every layer then calls with forward's extra keywords (how TGI and vLLM plug in their kernels).
    # transformers' utilities (and accelerate, PEFT, TRL) read these flags.
    _supports_sdpa = True
    _supports_flash_attn = False
    _supports_flex_attn = False
    _supports_attention_backend = True
    _can_compile_fullgraph = True  # the forward traces as one graph (tests/ecosystem/test_export.py)
    _is_stateful = False  # the cache can be cropped, so assisted decoding may roll back
    _no_split_modules = ["Block"]  # what device_map="auto" keeps on one device
    _keep_in_fp32_modules: set[str] = set()  # no module must stay in fp32 when the rest is fp16
    _keep_in_fp32_modules_strict: set[str] = set()
    _tied_weights_keys = None  # GPT2LMHeadModel's: {"lm_head.weight": "transformer.wte.weight"}

    def __init__(self, config: GPT2Config):
        super().__init__()
        check_config(config)  # gpt2attn's GPT2Config, transformers' or any config with GPT-2's fields
        config._attn_implementation = checked_attn_implementation(getattr(config, "_attn_implementation", None))
        self.config = config
        self.name_or_path = getattr(config, "name_or_path", "")  # what adapters record as their base model

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: Any, dtype: Any = None, device: Any = None,
                        quantize: str | None = None, **kwargs: Any):
        """Load from an HF folder, a hub name, a state dict or an OpenAI TF checkpoint;
        quantize='fp32', 'fp16', 'bf16', 'int8' or 'q4' applies gpt2attn.quantize (CPU inference) as
        the weights are read, one matrix at a time (see gpt2attn.loader)."""
        loaded = from_pretrained(cls, pretrained_model_name_or_path, dtype=dtype, device=device, quantize=quantize,
                                 **kwargs)
        model, info = loaded if kwargs.get("output_loading_info") else (loaded, None)
        if isinstance(pretrained_model_name_or_path, (str, os.PathLike)):  # as transformers records it
            model.config.name_or_path = model.name_or_path = str(pretrained_model_name_or_path)
        return (model, info) if info is not None else model

    def quantize(self, mode: str = "int8"):
        """Make the model decode fast on the CPU, in place, with weights in 'fp32', 'fp16', 'bf16',
        'int8' or 'q4'; see gpt2attn.quantize."""
        return quantize(self, mode)

    def save_pretrained(self, save_directory: Any, **kwargs: Any) -> None:
        """Write an HF model folder (config.json + safetensors) that `transformers` opens; with
        adapters loaded (add_adapter / load_adapter), the active adapter only, as transformers does."""
        if self._hf_peft_config_loaded:
            if kwargs.get("is_main_process", True):
                Path(save_directory).mkdir(parents=True, exist_ok=True)
                self.save_adapter(save_directory)
            return
        save_pretrained(self, save_directory, **kwargs)

    @classmethod
    def can_generate(cls) -> bool:
        """Whether generate() continues text with this class: those with GenerationMixin among their bases."""
        return issubclass(cls, GenerationMixin)

    # --- attention backend -----------------------------------------------------------------

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        """The backend a request names, checked ("sdpa" for None), as transformers answers it; a name
        gpt2attn cannot run is a ValueError naming it. is_init_check: transformers' own, unused here."""
        return checked_attn_implementation(requested_attention)

    def set_attn_implementation(self, attn_implementation: str | dict, allow_all_kernels: bool = False) -> None:
        """Switch every attention layer to "sdpa", "eager" or a function registered in transformers'
        AttentionInterface (a dict: its "" entry; GPT-2 has no sub-models), recording the choice in
        config._attn_implementation as transformers does.
        allow_all_kernels is for transformers' hub kernels, which are never loaded here."""
        if isinstance(attn_implementation, dict):
            attn_implementation = attn_implementation.get("", self.config._attn_implementation)
        name = checked_attn_implementation(attn_implementation)
        self.config._attn_implementation = name
        for module in self.modules():
            if hasattr(module, "textbook"):
                module.implementation, module.textbook = name, name == "eager"

    @classmethod
    def _from_config(cls, config: Any, attn_implementation: str | None = None, dtype: Any = None,
                     torch_dtype: Any = None, **kwargs: Any):
        """cls(config) with random weights, as AutoModel.from_config builds it: attn_implementation
        and the dtype recorded in the config first, the weights in dtype (default: the config's
        dtype, as in transformers; float32 where it has none)."""
        if kwargs:
            raise TypeError(f"_from_config() got unexpected keyword arguments {sorted(kwargs)}")
        if attn_implementation is not None:
            config._attn_implementation = attn_implementation
        dtype = dtype if dtype is not None else torch_dtype
        if dtype in (None, "auto"):
            dtype = getattr(config, "dtype", None)
        config.dtype = dtype = None if dtype == "auto" else as_torch_dtype(dtype)
        model = cls(config)
        return model.to(dtype) if dtype is not None else model

    def get_compiled_call(self, compile_config: Any = None) -> Any:
        """torch.compile(self.__call__) with compile_config's options (transformers' CompileConfig,
        or a dict; None: CompileConfig's defaults), kept for later calls while the options stay the
        same, as transformers' method of this name. generate() runs its one-token steps through it
        when it compiles them (cache_implementation="static"; see generation.generate.compiled_call)."""
        options = compile_options(compile_config)
        if self.__dict__.get("_compiled_call") is None or self.__dict__.get("_last_compile_options") != options:
            self._last_compile_options = options
            self._compiled_call = torch.compile(self.__call__, **options)
        return self._compiled_call

    def post_init(self) -> None:
        """transformers' last step of a model's __init__. Each class's __init__ here has already
        initialised its weights, so this only ties the head to wte (when the config ties them):
        calling it again, as code written for transformers does, keeps every trained weight."""
        self.tie_weights()

    def init_weights(self) -> None:
        """Draw every weight afresh (transformers' init: N(0, initializer_range), scaled c_proj,
        zero biases, LayerNorm 1/0), then tie the head to wte when the config ties them."""
        init_weights(self, self.config)
        self.tie_weights()

    def add_model_tags(self, tags: list[str] | str) -> None:
        """Add tags (a str or a list) to model_tags, each once, keeping the ones there."""
        tags = [tags] if isinstance(tags, str) else tags
        if self.model_tags is None:
            self.model_tags = []
        for tag in tags:
            if tag not in self.model_tags:
                self.model_tags.append(tag)

    def to_transformers(self, attn_implementation: str | None = None) -> Any:
        """transformers' model of the same class sharing these very parameters (no copy)."""
        return to_transformers(self, attn_implementation)

    @classmethod
    def from_transformers(cls, hf_model: Any):
        """This class built around a transformers model's own parameters (no copy)."""
        return from_transformers(cls, hf_model)

    # --- the model's parts, as transformers names them ---------------------------------------

    def get_decoder(self) -> nn.Module:
        """The GPT2Model at the core (GPT-2 is a decoder)."""
        return self.base_model

    def set_decoder(self, decoder: nn.Module) -> None:
        """Put another GPT2Model at the core of a head model."""
        if self.base_model is self:
            raise ValueError(f"{type(self).__name__} is the decoder itself; set_decoder is for the models around one")
        setattr(self, self.base_model_prefix, decoder)

    def get_encoder(self, modality: str | None = None) -> nn.Module:
        """GPT-2 has no encoder: the model itself, as transformers answers for decoder-only models.
        As there, modality is None or one of "image", "video" and "audio" (a model without such an
        encoder is its own); anything else, "text" included, is refused."""
        if modality not in (None, "image", "video", "audio"):
            raise ValueError(f"modality={modality!r}: get_encoder takes None, 'image', 'video' or 'audio', "
                             f"as in transformers")
        return self

    @property
    def dummy_inputs(self) -> dict[str, Tensor]:
        """transformers' three-row batch of token ids for a trial forward pass."""
        return {"input_ids": torch.tensor([[7, 6, 0, 0, 1], [1, 2, 3, 0, 0], [0, 0, 0, 4, 5]])}

    def get_parameter_or_buffer(self, target: str) -> Tensor:
        """The parameter or buffer at this dotted name (AttributeError when neither)."""
        for getter in (self.get_parameter, self.get_buffer):
            try:
                return getter(target)
            except AttributeError:
                pass
        raise AttributeError(f"`{target}` is neither a parameter, buffer, nor extra state.")

    def named_non_persistent_buffers(self, recurse: bool = True, remove_duplicate: bool = True):
        """named_buffers(), only those left out of the state dict."""
        for name, tensor in self.named_buffers(recurse=recurse, remove_duplicate=remove_duplicate):
            owner, _, leaf = name.rpartition(".")
            if leaf in self.get_submodule(owner)._non_persistent_buffers_set:
                yield name, tensor

    # --- embeddings -----------------------------------------------------------------------

    def get_input_embeddings(self) -> nn.Embedding:
        return self.base_model.wte

    def set_input_embeddings(self, value: nn.Embedding) -> None:
        self.base_model.wte = value

    def get_output_embeddings(self) -> nn.Linear | None:
        """The vocabulary projection; None for a model without one."""
        return None

    def tie_weights(self) -> None:
        """Make the output embeddings use the input embeddings' weight, when the config ties them."""
        head = self.get_output_embeddings()
        if head is not None and self.config.tie_word_embeddings:
            head.weight = self.get_input_embeddings().weight

    def resize_token_embeddings(
        self, new_num_tokens: int | None = None, pad_to_multiple_of: int | None = None, mean_resizing: bool = True
    ) -> nn.Embedding:
        """Give wte (and an untied head) new_num_tokens rows, rounded up to a multiple of
        pad_to_multiple_of; config.vocab_size follows. Rows past the old vocabulary are
        initialised as transformers 5 does: with mean_resizing, drawn near the old rows' mean
        (a normal with their covariance scaled by 1e-9), else N(0, initializer_range)."""
        wte = self.get_input_embeddings()
        if new_num_tokens is None and pad_to_multiple_of is None:
            return wte
        n = wte.num_embeddings if new_num_tokens is None else new_num_tokens
        if not is_int(n) or n < 1:
            raise ValueError(f"new_num_tokens must be a positive integer, got {new_num_tokens!r}")
        if pad_to_multiple_of is not None:
            if not is_int(pad_to_multiple_of) or pad_to_multiple_of < 1:
                # transformers' wording (its tests match it): "... which is not and integer"
                raise ValueError(f"Asking to pad the embedding matrix to a multiple of `{pad_to_multiple_of}`, which is "
                                 f"not and integer. Please make sure to pass an integer (pad_to_multiple_of >= 1)")
            n = -(-n // pad_to_multiple_of) * pad_to_multiple_of
        head = self.get_output_embeddings()
        w = wte.weight
        if n != w.size(0):
            resize_rows(wte, nn.Embedding(n, w.size(1), device=w.device, dtype=w.dtype), mean_resizing, self.config)
            if head is not None and head.weight is not wte.weight:
                h = head.weight
                new_head = nn.Linear(h.size(1), n, bias=False, device=h.device, dtype=h.dtype)
                resize_rows(head, new_head, mean_resizing, self.config)
        wte.num_embeddings = n
        if head is not None:
            head.out_features = n
        self.config.vocab_size = n
        self.vocab_size = n  # transformers records it on the model too
        self.tie_weights()
        return wte

    # --- training -------------------------------------------------------------------------

    def activation_checkpointing_enable(self, activation_checkpointing_kwargs: dict[str, Any] | None = None,
                                        every_n_layers: int = 1, offload: bool = False) -> None:
        """Recompute blocks' activations in the backward pass instead of keeping them, as
        transformers 5 does: every block, or every every_n_layers-th one (blocks 0, n, 2n, ...).
        activation_checkpointing_kwargs go to torch.utils.checkpoint.checkpoint (default
        {"use_reentrant": False}); offload keeps what the checkpointed blocks save in host memory."""
        if not is_int(every_n_layers) or every_n_layers < 1:
            raise ValueError(f"every_n_layers must be a positive int, got {every_n_layers!r}")
        body = self.base_model
        body.gradient_checkpointing = True
        body.gradient_checkpointing_kwargs = dict(activation_checkpointing_kwargs or {"use_reentrant": False})
        body.checkpoint_every = every_n_layers
        body.checkpoint_offload = offload

    def activation_checkpointing_disable(self) -> None:
        self.base_model.gradient_checkpointing = False

    @property
    def is_activation_checkpointing(self) -> bool:
        return self.base_model.gradient_checkpointing

    def enable_input_require_grads(self) -> None:
        """Make the input embeddings' output require grad, as transformers does for adapters over
        frozen embeddings (reentrant checkpointing needs a block input that requires grad)."""
        def require_grad(module: nn.Module, inputs: Any, output: Tensor) -> None:
            output.requires_grad_(True)

        self.disable_input_require_grads()
        self._input_require_grads = self.get_input_embeddings().register_forward_hook(require_grad)

    def disable_input_require_grads(self) -> None:
        hook = self.__dict__.pop("_input_require_grads", None)
        if hook is not None:
            hook.remove()

    def get_memory_footprint(self, return_buffers: bool = True) -> int:
        """Bytes held by the parameters (and buffers), each tensor counted once."""
        tensors = {id(t): t for t in (*self.parameters(), *(self.buffers() if return_buffers else ()))}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    # transformers 4's names, which transformers 5 keeps as aliases and most training scripts call
    def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs: dict[str, Any] | None = None,
                                      **kwargs: Any) -> None:
        self.activation_checkpointing_enable(gradient_checkpointing_kwargs, **kwargs)

    def gradient_checkpointing_disable(self) -> None:
        self.activation_checkpointing_disable()

    @property
    def is_gradient_checkpointing(self) -> bool:
        return self.is_activation_checkpointing

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
    def tp_plan(self) -> dict[str, str]:
        """transformers' tensor-parallel plan: none (tensor parallelism is out of scope)."""
        return {}

    @property
    def pp_plan(self) -> dict[str, Any]:
        """transformers' pipeline-parallel plan: none."""
        return {}

    @property
    def base_model(self) -> nn.Module:
        """The GPT2Model at the core (the model itself for a GPT2Model)."""
        return getattr(self, self.base_model_prefix, self)

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def num_parameters(self, only_trainable: bool = False, exclude_embeddings: bool = False) -> int:
        """Distinct parameters (a tied head counts once), as transformers counts them:
        only_trainable skips frozen ones, exclude_embeddings skips wte and wpe."""
        embeddings = {id(m.weight) for m in self.modules() if isinstance(m, nn.Embedding)}
        return sum(
            p.numel()
            for p in self.parameters()
            if (p.requires_grad or not only_trainable) and not (exclude_embeddings and id(p) in embeddings)
        )


def checked_attn_implementation(name: str | None) -> str:
    """The attention backend a model runs: "sdpa" when none is asked for; a name other than "sdpa"
    and "eager" must be registered in transformers' AttentionInterface (gpt2attn.attention)."""
    if name is None:
        return "sdpa"
    if is_registered(name):
        registered_attention(name)  # raises, naming it, unless registered
    return name


def resize_rows(old: nn.Module, new: nn.Module, mean_resizing: bool, config: GPT2Config) -> None:
    """Give `old` (an embedding or a head, rows = tokens) the weight of `new`, a freshly built
    module of the new size: the old rows copied, the added ones initialised."""
    n_old, n_new = old.weight.size(0), new.weight.size(0)
    with torch.no_grad():
        if n_new > n_old and mean_resizing:
            new.weight[n_old:] = rows_near_mean(old.weight, n_new - n_old)
        elif n_new > n_old:
            init_weights(new, config)
        n = min(n_old, n_new)
        new.weight[:n] = old.weight[:n]
    old.weight.data = new.weight.data


def rows_near_mean(weight: Tensor, count: int) -> Tensor:
    """count rows drawn from a normal with the rows' mean and 1e-9 times their covariance (the
    mean alone when that covariance is not positive definite), as transformers 5 draws them."""
    w = weight.detach().float()  # (V, C)
    mean = w.mean(dim=0)
    centered = w - mean
    covariance = 1e-9 * (centered.T @ centered / w.size(0))  # (C, C)
    if torch.linalg.cholesky_ex(covariance).info == 0:
        normal = torch.distributions.MultivariateNormal(mean, covariance_matrix=covariance)
        rows = normal.sample((count,))
    else:
        rows = mean.expand(count, -1)
    return rows.to(weight.dtype)
