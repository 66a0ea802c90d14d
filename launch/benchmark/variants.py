"""The named ways to run the training step: ember's jitted step under each backend, and the baselines.

Public names: `VARIANTS`, `build_variant`, `default_variants`, `ember_variant`.

A variant is built on a `Setup` and trains a private copy of its params; `ember_xla` is not here
because it needs its own process (`children.xla_child`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch

from ember.core import TrainState, jit, random
from ember.core.pytree import tree_map
from ember.core.step_fns import train_step
from ember.core.tree_math import tree_bytes
from ember.models import lm_loss
from ember.models.layers import as_list
from ember.optim.config import from_config

from .jax_baseline import jax_variant
from .setup import Setup, Variant, bench_optim_config, sync
from .torch_baseline import torch_variant


@contextlib.contextmanager
def _patches_disabled() -> Iterator[None]:
    """`EMBER_DISABLE_PATCHES=all` within the block: ember's torch patches stay off (core/compat)."""
    before = os.environ.get("EMBER_DISABLE_PATCHES")
    os.environ["EMBER_DISABLE_PATCHES"] = "all"
    try:
        yield
    finally:
        if before is None:
            del os.environ["EMBER_DISABLE_PATCHES"]
        else:
            os.environ["EMBER_DISABLE_PATCHES"] = before


def ember_variant(s: Setup, *, backend: str, donate: str = "state", compute_dtype: Optional[torch.dtype] = None,
                  skip_nonfinite: bool = True, patches: bool = True, optimizer: str = "adamw",
                  **jit_options: Any) -> Variant:
    """`ember.core.jit(train_step(...))` with `backend`, `donate` and any other jit option, training with
    `optimizer` (`--optim.name`)."""
    tx = from_config(bench_optim_config(s.cfg, name=optimizer), total_steps=10_000, axes=s.model.axes)
    params = tree_map(torch.clone, s.params)
    box = [TrainState.create(params=params, tx=tx, key=random.key(s.cfg.seed, device=s.device))]
    step = jit(train_step(lm_loss(s.model), skip_nonfinite=skip_nonfinite, compute_dtype=compute_dtype),
               backend=backend, donate=donate, **jit_options)

    def run() -> torch.Tensor:
        with contextlib.nullcontext() if patches else _patches_disabled():  # read while compiling
            box[0], metrics = step(box[0], s.batch)
        sync(s.device)
        return metrics["loss"]

    return Variant("", run, lambda: tree_bytes(box[0]), device=s.device.type,
                   dtype=str(compute_dtype or torch.float32).replace("torch.", ""),
                   notes=f"ember.core.jit(train_step(skip_nonfinite={skip_nonfinite}), backend={backend!r}, "
                         f"donate={donate!r}{''.join(f', {k}={v!r}' for k, v in jit_options.items())})"
                         + ("" if patches else ", EMBER_DISABLE_PATCHES=all")
                         + ("" if optimizer == "adamw" else f", --optim.name {optimizer}"))


def _listed_variant(s: Setup, compute_dtype: Optional[torch.dtype] = None) -> Variant:
    """The donated Inductor step on `s`'s model with its layers as a list (`scan_layers=False`), same weights."""
    if not s.cfg.model.scan_layers:
        raise ValueError("ember_inductor_list compares the list of blocks with the stacked default, but the run "
                         "config already has scan_layers=False: drop --model.scan_layers False.")
    model, params = as_list(s.model, s.params)
    listed = dataclasses.replace(s, model=model, params=params)
    variant = ember_variant(listed, backend="inductor", compute_dtype=compute_dtype)
    variant.notes += f" with model.scan_layers=False (remat {s.cfg.model.remat!r})"
    return variant


VARIANTS: Dict[str, Callable[[Setup], Variant]] = {
    "ember_inductor_donated": lambda s: ember_variant(s, backend="inductor"),
    "ember_inductor": lambda s: ember_variant(s, backend="inductor", donate="none"),
    "ember_inductor_donated_noskip": lambda s: ember_variant(s, backend="inductor", skip_nonfinite=False),
    "ember_inductor_nondeterministic": lambda s: ember_variant(s, backend="inductor", deterministic=False),
    "ember_inductor_list": _listed_variant,
    "ember_inductor_bf16_list": lambda s: _listed_variant(s, compute_dtype=torch.bfloat16),
    "ember_inductor_no_patches": lambda s: ember_variant(s, backend="inductor", patches=False),
    "ember_eager": lambda s: ember_variant(s, backend="eager"),
    # Muon for the hidden matrices, AdamW for the rest (--optim.name muon), against the AdamW rows above
    "ember_inductor_muon": lambda s: ember_variant(s, backend="inductor", optimizer="muon"),
    "ember_eager_muon": lambda s: ember_variant(s, backend="eager", optimizer="muon"),
    # Inductor's own realize_reads_threshold (4) instead of ember's default (16): the update's new moments written
    # twice (BENCHMARKS.md, "Why the 125M update writes its moments twice")
    "ember_inductor_reads4": lambda s: ember_variant(s, backend="inductor", options={"realize_reads_threshold": 4}),
    "ember_inductor_bf16": lambda s: ember_variant(s, backend="inductor", compute_dtype=torch.bfloat16),
    # the donated step replayed as one CUDA graph (a CUDA GPU only): opt-in until measured to win
    "ember_inductor_cudagraph": lambda s: ember_variant(s, backend="inductor", cuda_graph=True),
    "ember_inductor_bf16_cudagraph": lambda s: ember_variant(s, backend="inductor", compute_dtype=torch.bfloat16,
                                                             cuda_graph=True),
    "torch_compiled": lambda s: torch_variant(s, compile=True),
    "torch_compiled_foreach": lambda s: torch_variant(s, compile=True, impl="foreach"),
    "torch_eager": lambda s: torch_variant(s, compile=False),
    "torch_compiled_bf16": lambda s: torch_variant(s, compile=True, autocast=torch.bfloat16),
    "jax": jax_variant,
}
"""Every in-process variant; `ember_xla` runs in its own process (`xla_child`)."""


def default_variants(device: torch.device) -> List[str]:
    """The variants run without `--variants`: bf16 ones only on a GPU, `jax` only if optax imports."""
    names = ["ember_inductor_donated", "ember_eager", "torch_compiled", "torch_eager"]
    if device.type == "cuda":
        names += ["ember_inductor_bf16", "torch_compiled_bf16"]
    try:
        import optax  # noqa: F401

        names.append("jax")
    except ImportError:
        pass
    return names


def build_variant(name: str, s: Setup) -> Variant:
    """Variant `name` built on `s`; unknown names list the valid ones."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(sorted(VARIANTS))}, ember_xla.")
    v = VARIANTS[name](s)
    v.name = name
    return v
