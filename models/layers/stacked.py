"""Repeated layers: `Sequential` (a list of params), `Stacked` (one stacked tree) and `Stacks`
(consecutive `Stacked` runs: dense blocks, then mixture-of-experts ones).

Public names: `Sequential`, `Stacked`, `Stacks`, `as_list`.

Both give layer `i` the same init key (derived from the path `"<prefix>.<i>.<param>"`) and the
same apply key (`split(key, n)[i]`), so for the same weights the two forms compute the same thing:

    Sequential.repeat(block, 4).init(k)       -> [tree_0, tree_1, tree_2, tree_3]   ("blocks.2.attn.wq.weight")
    Stacked(block, 4).init(k)                 -> tree with a leading (4,) dim on every leaf ("blocks.attn.wq.weight")
    stack_trees(Sequential form) == Stacked form, bit for bit

`Stacked` runs its layers with `ember.core.transforms.remat_scan` over the leading "layers"
dimension (its axes get a leading `"layers"` name, so the rules can shard or replicate it):
one `scan` node forward and one backward, a layer compiled once whatever the depth (Inductor and
torch_xla). The carry may be a pytree: a mixture of experts' layers carry their router statistics
beside the activations. `remat="full"` (or another policy of `ember.core.remat_policies`) makes the backward
recompute each layer's activations from its input, keeping only what the policy names; the default
`"none"` keeps what each layer's own autograd graph would keep. `Sequential` runs its layers one after
the other, each wrapped in `ember.core.transforms.remat`: unrolled in the step's graph, so its compile
time grows with depth (BENCHMARKS.md, "Blocks stacked by default").

Under a mesh with `pp` (the rule `("layers", "pp")`), `Stacked` runs its layers as pipeline stages
(`ember.core.partition_specs.pipeline`, with the active `Sharding`'s `PipelineSchedule`); the stages keep every
activation for the backward (GPipe), whatever `remat` says. A layer carrying `(x, totals)` (a mixture of
experts' router statistics) runs there when it names how two totals add, `layer.merge_totals(a, b)`:
each microbatch's totals are summed after the stages. `Stacks` pipelines each run on its own.

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models.layers import Linear, Stacked
    >>> stack = Stacked(Linear(4, 4, in_axis="embed", out_axis="embed"), num_layers=3)
    >>> stack.axes["weight"]
    ('layers', 'embed', 'embed')
    >>> stack.apply(stack.init(random.key(0)), torch.ones(2, 4)).shape
    torch.Size([2, 4])
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Any, List, Optional, Sequence, Tuple, Union

from torch import Tensor

from ...core import pytree, random
from ...core.partition_specs import current_sharding
from ...core.partition_specs.pipeline import PipelineError, PipelineSchedule, pipeline
from ...core.remat_policies import remat_policy
from ...core.transforms import remat as _remat
from ...core.transforms import remat_scan
from ...core.transforms import stack_trees, unstack_trees
from ...core.types import Key, Params, PyTree
from .module import Module

__all__ = ["Sequential", "Stacked", "Stacks", "as_list"]


def _apply_layer(layer: Module, carry: PyTree, xs: Tuple[Params, Optional[Tensor]], kwargs: Any) -> PyTree:
    return layer.apply(xs[0], carry, key=xs[1], **kwargs)


def _layer_keys(stack: Module, key: Optional[Key], n: int) -> Optional[Tensor]:
    """One key per layer of `stack`, `(n,)` int64; None where none of them draws (`Module.draws`)."""
    return None if key is None or not stack.draws else random.split(key, n)


def _pipeline_stages() -> int:
    """The `pp` degree of the active sharding's mesh (1 without one)."""
    sharding = current_sharding()
    return 1 if sharding is None else sharding.mesh.sizes().get("pp", 1)


def _refuse_unstacked(what: str) -> None:
    if _pipeline_stages() > 1:
        raise PipelineError(
            f"the mesh has pp={_pipeline_stages()} but the model's layers are {what}, not one stack the stages can "
            f"split: build it with scan_layers=True (--model.scan_layers true) and every block alike.")


@dataclasses.dataclass(frozen=True)
class Sequential(Module):
    """Layers applied one after the other; params are a list (paths `"<prefix>.<i>.<...>"`).

    Attributes:
        layers: the layers, each `(x, **kwargs) -> x` of the same shape.
        remat: a remat policy for each layer (`"none"`, `"full"`, `"dots_saveable"`, `"save:<tags>"`;
            `True` means `"full"`).
    """

    layers: Tuple[Module, ...]
    remat: Union[str, bool] = "none"

    reads_key = False

    @classmethod
    def repeat(cls, layer: Module, num_layers: int, *, remat: Union[str, bool] = "none") -> "Sequential":
        """`num_layers` copies of `layer` (each with its own parameters)."""
        return cls(tuple([layer] * num_layers), remat=remat)

    def validate(self) -> None:
        if not isinstance(self.layers, tuple) or not all(isinstance(m, Module) for m in self.layers):
            raise TypeError("Sequential.layers must be a tuple of Modules.")
        remat_policy(self.remat)

    def declare(self):
        return {str(i): layer for i, layer in enumerate(self.layers)}

    def param_specs(self) -> PyTree:
        """A list with one declaration tree per layer (`{}` for a layer without parameters)."""
        return [layer.param_specs() for layer in self.layers]

    def init_at(self, key: Key, path: str) -> Params:
        """Layer `i` is initialised at path `"<path>.<i>"`."""
        return [layer.init_at(key, f"{path}.{i}" if path else str(i)) for i, layer in enumerate(self.layers)]

    def apply(self, params: Params, x: PyTree, *, key: Optional[Key] = None, **kwargs: Any) -> PyTree:
        """Args: x: the first layer's input; key: split into one key per layer. Returns: the last output."""
        _refuse_unstacked("a list (Sequential)")
        keys = _layer_keys(self, key, len(self.layers))
        for i, layer in enumerate(self.layers):
            x = _remat(layer.apply, policy=self.remat)(params[i] if layer.has_params else {}, x,
                                                        key=None if keys is None else keys[i], **kwargs)
        return x


@dataclasses.dataclass(frozen=True)
class Stacked(Module):
    """`num_layers` copies of `layer` whose params are stacked along a leading "layers" dimension.

    Attributes:
        layer: the repeated layer, `(x, **kwargs) -> x` of the same shape.
        num_layers: how many copies.
        remat: a remat policy for each layer (as in `Sequential`).
    """

    layer: Module
    num_layers: int
    remat: Union[str, bool] = "none"

    reads_key = False

    def validate(self) -> None:
        if not isinstance(self.layer, Module):
            raise TypeError(f"Stacked.layer must be a Module, got {type(self.layer).__name__}.")
        if not isinstance(self.num_layers, int) or self.num_layers <= 0:
            raise ValueError(f"Stacked.num_layers must be a positive int, got {self.num_layers!r}.")
        remat_policy(self.remat)

    def declare(self):
        return {"layer": self.layer}

    def param_specs(self) -> PyTree:
        """The layer's declarations with a leading `num_layers` dim and a leading "layers" axis name.

        These stacked declarations describe shapes and axes; `init` still initialises layer by
        layer with the per-layer initializers.
        """
        return pytree.tree_map(lambda p: p.stacked(self.num_layers), self.layer.param_specs())

    def init_at(self, key: Key, path: str, *, first: int = 0) -> Params:
        """Layer `i` is initialised at path `"<path>.<first + i>"` (as in `Sequential`), then stacked."""
        per_layer = [self.layer.init_at(key, f"{path}.{first + i}" if path else str(first + i))
                     for i in range(self.num_layers)]
        return stack_trees(per_layer, what=f"{path or 'Stacked'} layers")  # leaves: (L, ...)

    def apply(self, params: Params, x: PyTree, *, key: Optional[Key] = None, **kwargs: Any) -> PyTree:
        """Args: x: the first layer's input; key: split into one key per layer. Returns: the last output."""
        return self.apply_with_keys(params, x, _layer_keys(self, key, self.num_layers), **kwargs)

    def apply_with_keys(self, params: Params, x: PyTree, keys: Optional[Tensor], **kwargs: Any) -> PyTree:
        """`apply` with the layers' keys given, `(num_layers,)` or None."""

        if _pipeline_stages() > 1:
            return self._pipelined(params, x, keys, kwargs)
        # x may be a tree: a mixture of experts' router statistics ride along with the activations
        return remat_scan(functools.partial(_apply_layer, self.layer), x, (params, keys), kwargs,
                          policy=self.remat, name="ember.Stacked", length=self.num_layers)

    def _pipelined(self, params: Params, x: PyTree, keys: Optional[Tensor], kwargs: Any) -> PyTree:
        """The layers as `pp` stages (`ember.core.partition_specs.pipeline`): per-example kwargs (`(B, T)` segment ids,
        masks, positions) travel with their microbatch; the rest reach every layer as they are."""
        h, totals, merge = x, None, getattr(self.layer, "merge_totals", None)
        if not isinstance(x, Tensor):
            if merge is None or not (isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], Tensor)):
                raise PipelineError(
                    f"pp runs stacks whose layers carry a tensor, or (tensor, totals) with the layer naming how two "
                    f"totals add (merge_totals); {type(self.layer).__name__} carries {type(x).__name__}: give it "
                    f"merge_totals, or drop pp from the mesh for this model.")
            h, totals = x
        per_example = {k: v for k, v in kwargs.items() if isinstance(v, Tensor) and v.dim() >= 2
                       and v.shape[0] == h.shape[0]}
        shared = {k: v for k, v in kwargs.items() if k not in per_example}
        stages = _pipeline_stages()
        schedule = current_sharding().pipeline or PipelineSchedule()
        layers = {"params": params} if keys is None else {"params": params, "key": keys}

        def layer_fn(p, carry, **rows):
            return self.layer.apply(p["params"], carry, key=p.get("key"), **shared, **rows)

        return pipeline(layer_fn, layers, h, stages=stages, microbatches=schedule.microbatches or stages,
                        repeats=schedule.repeats, batch_kwargs=per_example, totals=totals,
                        merge=None if totals is None else merge)

    def stack(self, per_layer: Sequence[Params]) -> Params:
        """This module's params from a list of per-layer params (`Sequential`'s layout)."""
        return stack_trees(list(per_layer), what="blocks",
                           fix="Blocks that differ cannot be scanned: load with scan_layers=False (a list of blocks).")

    def unstack(self, params: Params) -> List[Params]:
        """The per-layer params (`Sequential`'s layout) of this module's params."""
        return unstack_trees(params)


@dataclasses.dataclass(frozen=True)
class Stacks(Module):
    """Consecutive runs of identical layers, each a `Stacked` (one rolled loop each way): dense blocks
    first, then mixture-of-experts ones. Params are a list with one stacked tree per run.

    Layer `i`, counted over all runs, is initialised and keyed as in `Sequential` (path
    `"<prefix>.<i>"`, apply key `split(key, n)[i]`), so the three forms compute the same thing.
    `Stacks.of(layers)` groups a list of layers, and returns a plain `Stacked` for a single run.

    Attributes:
        stacks: the runs, in order.
    """

    stacks: Tuple[Stacked, ...]

    reads_key = False

    @classmethod
    def of(cls, layers: Sequence[Module], *, remat: Union[str, bool] = "none") -> Module:
        """`layers` as consecutive stacks of equal layers (a `Stacked` when they are all equal)."""
        runs = [Stacked(layer, len(list(group)), remat=remat) for layer, group in itertools.groupby(layers)]
        return runs[0] if len(runs) == 1 else cls(tuple(runs))

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.stacks)

    def validate(self) -> None:
        if not isinstance(self.stacks, tuple) or not self.stacks or not all(isinstance(s, Stacked) for s in self.stacks):
            raise TypeError(f"Stacks.stacks must be a non-empty tuple of Stacked, got {self.stacks!r}.")

    def declare(self):
        return {str(i): s for i, s in enumerate(self.stacks)}

    def param_specs(self) -> PyTree:
        """A list with each run's stacked declarations."""
        return [s.param_specs() for s in self.stacks]

    def _runs(self) -> List[Tuple[int, Stacked]]:
        """Each run with the index of its first layer among all layers."""
        firsts = itertools.accumulate((s.num_layers for s in self.stacks), initial=0)
        return list(zip(firsts, self.stacks))

    def init_at(self, key: Key, path: str) -> Params:
        return [s.init_at(key, path, first=first) for first, s in self._runs()]

    def apply(self, params: Params, x: PyTree, *, key: Optional[Key] = None, **kwargs: Any) -> PyTree:
        """Args: x: the first layer's input; key: split into one key per layer. Returns: the last output."""
        keys = _layer_keys(self, key, self.num_layers)
        for (first, s), p in zip(self._runs(), params):
            x = s.apply_with_keys(p, x, None if keys is None else keys[first:first + s.num_layers], **kwargs)
        return x

    def stack(self, per_layer: Sequence[Params]) -> Params:
        """This module's params from a list of per-layer params (`Sequential`'s layout)."""
        return [s.stack(per_layer[first:first + s.num_layers]) for first, s in self._runs()]

    def unstack(self, params: Params) -> List[Params]:
        """The per-layer params (`Sequential`'s layout) of this module's params."""
        return [layer for s, p in zip(self.stacks, params) for layer in s.unstack(p)]


def as_list(model: Any, params: Optional[Params] = None) -> Tuple[Any, Optional[Params]]:
    """A stacked model's twin with its blocks as a list (`scan_layers=False`), and `params` unstacked to
    match; a model whose blocks are a list, and its params, as they are.

    For what runs the layers one by one: KV-cache decoding, the torch baselines, Hugging Face's layout.
    """
    if not model.config.scan_layers:
        return model, params
    listed = type(model)(model.config.replace(scan_layers=False))
    if params is not None:
        params = {**params, "blocks": model.children["blocks"].unstack(params["blocks"])}
    return listed, params
