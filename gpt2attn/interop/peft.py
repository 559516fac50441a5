"""LoRA through PEFT on gpt2attn's Conv1D, exactly as PEFT does it for transformers' Conv1D.

    # once peft is imported (gpt2attn.interop.hooks imports this module), as for transformers' GPT-2:
    model = get_peft_model(model, LoraConfig(target_modules=["c_attn", "c_proj", "c_fc"]))

PEFT picks the LoRA layer for a module by its class, and knows transformers' `Conv1D` but not ours.
Importing this module adds ours to the dispatcher LoRA uses for every config: our Conv1D gets
PEFT's own `lora.Linear` with `fan_in_fan_out=True`, the layer PEFT gives transformers' Conv1D, so
adapter files, training and `merge_and_unload` are the same in both libraries.
"""

from __future__ import annotations

import warnings
from typing import Any

import peft.tuners.lora.model as _lora_model
from peft.tuners.lora.layer import Linear as _LoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..layers import Conv1D


class LoraConv1D(_LoraLinear):
    """PEFT's LoRA layer around our Conv1D, whose weight is stored (in, out)."""

    def _get_in_out_features(self, module: nn.Module) -> tuple[int, int]:
        if isinstance(module, Conv1D):
            return tuple(module.weight.shape)  # (in, out)
        return super()._get_in_out_features(module)


def _dispatch(default):
    def dispatch(target: nn.Module, adapter_name: str, config: Any, parameter_name: str | None = None, **kwargs: Any):
        base = target.get_base_layer() if isinstance(target, BaseTunerLayer) else target
        if parameter_name is not None or not isinstance(base, Conv1D):
            return default(target, adapter_name, config=config, parameter_name=parameter_name, **kwargs)
        if not config.fan_in_fan_out:
            warnings.warn("fan_in_fan_out is set to False but the target module is `Conv1D`. Setting fan_in_fan_out to True.")
            config.fan_in_fan_out = True
        return LoraConv1D(target, adapter_name, is_target_conv_1d_layer=True, config=config, **kwargs)

    dispatch.gpt2attn_default = default  # marks the wrapper, so a second import does not wrap it twice
    return dispatch


if not hasattr(_lora_model.dispatch_default, "gpt2attn_default"):
    _lora_model.dispatch_default = _dispatch(_lora_model.dispatch_default)
