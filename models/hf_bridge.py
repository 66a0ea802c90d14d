"""The fallback of `from_hf` for a causal LM with no native ember family: transformers + `from_torch`.

Public names: `bridge_from_hf`, `HFCausalLMLogits`.

The folder is loaded by `transformers.AutoModelForCausalLM` (local files only) and wrapped by the
`from_torch` bridge, so it trains with any ember step; its forward returns the logits tensor, which
`lm_loss` expects. Parameter names stay Hugging Face's, and the Llama-style axes rules place the
usual ones (`HF_LLAMA_AXES_RULES`), the rest replicated. `from_hf` says so in one warning line:
native families get `scan_layers`, remat presets, the chunked loss and `to_hf`; the bridge does not.
"""

from __future__ import annotations

import warnings
from typing import Any, Mapping, Optional, Tuple, Union

import torch
from torch import Tensor

from ..core.types import Params
from .bridge import HF_LLAMA_AXES_RULES, TorchModel, from_torch

__all__ = ["HFCausalLMLogits", "bridge_from_hf"]


class HFCausalLMLogits(torch.nn.Module):
    """A transformers causal LM whose `forward(input_ids)` returns only the logits `(B, T, V)`.

    It holds the model's own submodules (so parameter names are unchanged: `model.layers.0...`,
    `lm_head.weight`) and calls the model without its KV cache.
    """

    def __init__(self, hf_model: torch.nn.Module) -> None:
        super().__init__()
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self._hf = (hf_model,)  # a tuple: not registered twice as a submodule
        self.config = hf_model.config

    def forward(self, input_ids: Tensor, **kwargs: Any) -> Tensor:
        kwargs = {k: v for k, v in kwargs.items() if k in ("attention_mask", "position_ids")}
        return self._hf[0](input_ids=input_ids, use_cache=False, **kwargs).logits


def bridge_from_hf(path: str, hf_config: Mapping[str, Any], *, supported: str, overrides: Mapping[str, Any],
                   dtype: Optional[torch.dtype] = None,
                   device: Union[str, torch.device] = "cpu") -> Tuple[TorchModel, Params]:
    """Load the folder at `path` with transformers and bridge it (see the module docstring)."""
    model_type = hf_config.get("model_type")
    if overrides:
        raise ValueError(
            f"from_hf: {sorted(overrides)} are fields of ember's native families, but model_type "
            f"{model_type!r} has none ({supported} do); drop them, or bridge it with remat rules "
            f"through ember.models.from_torch."
        )
    try:
        import transformers
    except ImportError as err:
        raise ValueError(
            f"model_type {model_type!r} has no native ember family ({supported} do), and the fallback "
            f"through the from_torch bridge needs transformers: pip install transformers."
        ) from err
    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    dtype_arg = {} if dtype is None else {"dtype" if (major, minor) >= (4, 56) else "torch_dtype": dtype}
    try:
        hf_model = transformers.AutoModelForCausalLM.from_pretrained(
            path, local_files_only=True, attn_implementation="sdpa", **dtype_arg)
    except (ValueError, KeyError, OSError) as err:
        raise ValueError(
            f"model_type {model_type!r} has no native ember family ({supported} do), and transformers "
            f"could not load {path} as a causal LM either: {str(err).strip().splitlines()[0]}"
        ) from err
    warnings.warn(
        f"from_hf: model_type {model_type!r} has no native ember family ({supported} do); it is loaded by "
        f"transformers and trains through the from_torch bridge (no scan_layers, remat presets, chunked loss "
        f"or to_hf).", UserWarning, stacklevel=3)
    return from_torch(HFCausalLMLogits(hf_model).to(device), axes_rules=HF_LLAMA_AXES_RULES,
                      default_axes="replicated")
