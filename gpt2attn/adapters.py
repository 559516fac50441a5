"""transformers' PEFT integration on the model itself: add_adapter, load_adapter, set_adapter, ...

    model.add_adapter(LoraConfig(target_modules=["c_attn"]))   # as on transformers' GPT-2
    model.save_pretrained(folder)                              # adapter_config.json + adapter_model.safetensors
    other.load_adapter(folder)                                 # either library's model, either library's folder

Each method does what transformers' PeftAdapterMixin does, with PEFT's own functions (inject the
adapter's layers, set or disable them, read and write their weights): PEFT puts the same LoRA layers
on our Conv1D as on transformers' (gpt2attn/interop/peft.py), so files and outputs are the same.
(transformers 5.24's own methods ask for peft >= 0.22, which is not released: on its GPT-2 they
raise; its PEFT-format files, the same as PEFT's, are what ours read and write.) peft is imported
inside the methods: `import gpt2attn` does not import it.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from torch import Tensor, nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what PEFT's and transformers' adapter files put before each key


def _peft() -> Any:
    """peft; importing it brings LoRA for our Conv1D (gpt2attn/interop/peft.py) through the import
    hooks (with GPT2ATTN_NO_IMPORT_HOOKS=1, import that bridge by hand first)."""
    return importlib.import_module("peft")


class AdapterMixin:
    """The adapter methods of transformers' models (PEFT's LoRA and friends), for GPT2PreTrainedModel."""

    _hf_peft_config_loaded = False  # becomes True with the first adapter, as in transformers

    def _tuner_layers(self) -> list[nn.Module]:
        from peft.tuners.tuners_utils import BaseTunerLayer

        if not self._hf_peft_config_loaded:
            raise ValueError("No adapter loaded. Please load an adapter first.")
        return [m for m in self.modules() if isinstance(m, BaseTunerLayer)]

    def add_adapter(self, adapter_config: Any, adapter_name: str | None = None) -> None:
        """Inject a fresh adapter (a PEFT config such as LoraConfig) and make it the active one."""
        peft = _peft()
        adapter_name = adapter_name or "default"
        if self._hf_peft_config_loaded and adapter_name in self.peft_config:
            raise ValueError(f"Adapter with name {adapter_name} already exists. Please use a different name.")
        if not isinstance(adapter_config, peft.PeftConfig):
            raise TypeError(f"adapter_config should be an instance of PeftConfig. Got {type(adapter_config)} instead.")
        adapter_config.base_model_name_or_path = self.__dict__.get("name_or_path")
        peft.inject_adapter_in_model(adapter_config, self, adapter_name)
        self._hf_peft_config_loaded = True
        self.set_adapter(adapter_name)

    def _adapter_modules(self) -> list[nn.Module]:
        """The tuner layers and the modules_to_save wrappers: what disable_adapters and
        enable_adapters switch on and off together."""
        from peft.utils import ModulesToSaveWrapper

        return self._tuner_layers() + [m for m in self.modules() if isinstance(m, ModulesToSaveWrapper)]

    def set_adapter(self, adapter_name: list[str] | str) -> None:
        """Make these adapters (a name or a list) the active ones, the others inactive. A
        modules_to_save wrapper that holds no copy for them runs its original module, as in PEFT
        (PEFT's own set_adapter, which switches the wrappers and the tuner layers together)."""
        from peft.functional import set_adapter

        self._tuner_layers()
        missing = {adapter_name} if isinstance(adapter_name, str) else set(adapter_name)
        missing -= set(self.peft_config)
        if missing:
            raise ValueError(f"adapter(s) {sorted(missing)} not found; loaded adapters: {list(self.peft_config)}")
        set_adapter(self, adapter_name)

    def disable_adapters(self) -> None:
        """Run the base model alone (the adapters stay loaded)."""
        for module in self._adapter_modules():
            module.enable_adapters(enabled=False)

    def enable_adapters(self) -> None:
        """Run the active adapters again after disable_adapters, modules_to_save copies included."""
        for module in self._adapter_modules():
            module.enable_adapters(enabled=True)

    def active_adapters(self) -> list[str]:
        """The names of the adapters in use (a list, as several can be active together)."""
        layers = self._tuner_layers()
        active = layers[0].active_adapter if layers else []
        return [active] if isinstance(active, str) else list(active)

    def delete_adapter(self, adapter_names: list[str] | str) -> None:
        """Remove these adapters; with none left the model is its base model again."""
        from peft.functional import delete_adapter
        from peft.mapping import PEFT_TYPE_TO_PREFIX_MAPPING

        names = [adapter_names] if isinstance(adapter_names, str) else list(adapter_names)
        self._tuner_layers()
        missing = [n for n in names if n not in self.peft_config]
        if missing:
            raise ValueError(f"adapter(s) {missing} not found; loaded adapters: {list(self.peft_config)}")
        for name in names:
            delete_adapter(self, adapter_name=name, prefix=PEFT_TYPE_TO_PREFIX_MAPPING[self.peft_config[name].peft_type])
            del self.peft_config[name]
        if not self.peft_config:
            del self.peft_config
            self._hf_peft_config_loaded = False
            self._unwrap_adapter_modules()

    def _unwrap_adapter_modules(self) -> None:
        """Put each module PEFT wrapped back in its place (a LoRA layer's base layer, a
        modules_to_save wrapper's original module), so that state_dict() and save_pretrained()
        give the base model's keys again (not ...c_attn.base_layer.weight)."""
        from peft.tuners.tuners_utils import BaseTunerLayer
        from peft.utils import ModulesToSaveWrapper

        for name, module in list(self.named_modules()):
            if isinstance(module, BaseTunerLayer):
                base = module.get_base_layer()
            elif isinstance(module, ModulesToSaveWrapper):
                base = module.original_module
            else:
                continue
            parent, _, child = name.rpartition(".")
            setattr(self.get_submodule(parent), child, base)

    def get_adapter_state_dict(self, adapter_name: str | None = None, state_dict: dict | None = None) -> dict:
        """The adapter's weights (the active one's by default), keyed as in the model without the adapter name."""
        from peft import get_peft_model_state_dict

        self._tuner_layers()
        adapter_name = adapter_name if adapter_name is not None else self.active_adapters()[0]
        return get_peft_model_state_dict(self, state_dict=state_dict, adapter_name=adapter_name)

    def load_adapter(self, peft_model_id: str | Path | None = None, adapter_name: str | None = None,
                     peft_config: Any = None, adapter_state_dict: dict[str, Tensor] | None = None,
                     low_cpu_mem_usage: bool = False, is_trainable: bool = False, hotswap: bool | str = "auto",
                     local_files_only: bool = False, adapter_kwargs: dict[str, Any] | None = None,
                     load_config: Any = None, **kwargs: Any) -> None:
        """Add the adapter saved in peft_model_id (a folder with adapter_config.json and
        adapter_model.safetensors, written by either library or by PEFT), or given as
        peft_config + adapter_state_dict, under adapter_name ("default"), and make it active. Unless
        is_trainable, the model goes to eval mode with the adapter frozen, as in transformers.
        Hotswapping an adapter in place (hotswap=True) is not supported."""
        _peft()
        from peft import PeftConfig, inject_adapter_in_model, set_peft_model_state_dict
        from peft.tuners.tuners_utils import BaseTunerLayer

        if hotswap is True:
            raise ValueError("hotswap=True: replacing an adapter's weights in place is not supported; "
                             "delete_adapter and load it again")
        if load_config is not None or kwargs:
            unknown = sorted(kwargs) + (["load_config"] if load_config is not None else [])
            raise TypeError(f"load_adapter got {unknown}, which gpt2attn does not take")
        adapter_name = adapter_name or "default"
        if self._hf_peft_config_loaded and adapter_name in self.peft_config:
            raise ValueError(f"Adapter with name {adapter_name} already exists. Please use a different name.")
        if peft_model_id is None and (peft_config is None or adapter_state_dict is None):
            raise ValueError("load_adapter needs peft_model_id, or peft_config and adapter_state_dict")
        options = {"local_files_only": local_files_only, **(adapter_kwargs or {})}
        if peft_config is None:
            peft_config = PeftConfig.from_pretrained(str(peft_model_id), **options)
        if adapter_state_dict is None:
            adapter_state_dict = _read_adapter_weights(peft_model_id, options)
        peft_config.inference_mode = not is_trainable
        inject_adapter_in_model(peft_config, self, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage)
        self._hf_peft_config_loaded = True
        weights = {k.removeprefix(PEFT_PREFIX): v for k, v in adapter_state_dict.items()}
        result = set_peft_model_state_dict(self, weights, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage)
        unexpected = [k for k in result.unexpected_keys if adapter_name in k or "lora" in k]
        if unexpected:
            raise ValueError(f"{peft_model_id or 'adapter_state_dict'}: adapter weights {unexpected[:3]} fit no module")
        self.set_adapter(adapter_name)
        if not is_trainable:
            self.eval()
            for module in self.modules():
                if isinstance(module, BaseTunerLayer):
                    module.requires_grad_(False)

    def save_adapter(self, folder: Path) -> None:
        """What save_pretrained writes for a model with adapters, as transformers does: the active
        adapter's config and weights (keys prefixed base_model.model.), not the base model."""
        from safetensors.torch import save_file

        active = self.active_adapters()
        if len(active) > 1:
            raise ValueError(f"adapters {active} are active together; save them one at a time (set_adapter)")
        weights = {PEFT_PREFIX + k: v.contiguous() for k, v in self.get_adapter_state_dict(active[0]).items()}
        self.peft_config[active[0]].save_pretrained(str(folder))
        save_file(weights, str(Path(folder) / ADAPTER_WEIGHTS), metadata={"format": "pt"})


def _read_adapter_weights(peft_model_id: str | Path, options: dict[str, Any]) -> dict[str, Tensor]:
    """adapter_model.safetensors from a folder, or from the hub through PEFT's own loader."""
    from peft.utils import load_peft_weights

    folder = Path(peft_model_id)
    if folder.is_dir() and not (folder / ADAPTER_WEIGHTS).is_file():
        raise FileNotFoundError(f"{folder}: no {ADAPTER_WEIGHTS} in the adapter folder")
    return load_peft_weights(str(peft_model_id), device="cpu", **{k: v for k, v in options.items()
                                                                   if k != "local_files_only"})
