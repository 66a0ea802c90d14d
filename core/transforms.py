"""Function transforms: gradients, vectorisation, activation checkpointing and loops.

Public names: `grad`, `value_and_grad`, `vmap`, `remat`, `remat_scan`, `checkpoint_name`, `scan`,
`shared_call`, `rolled_sum`, `stack_trees`, `unstack_trees`.

`grad`, `value_and_grad` and `vmap` have JAX's calling conventions (`value_and_grad` returns
`(value, grads)`, not torch's `(grads, value)`) and errors that say what the function returned and
how to fix it. `vmap` is `torch.func.vmap`. The gradients are taken with `torch.autograd.grad` on
fresh leaves made inside the call (`ember.core.autograd_grad`: pure from outside, and traced into
the step by `jit`), so `torch.utils.checkpoint`, torch's `scan` and `invoke_subgraph` differentiate;
inside a `torch.func` transform (`vmap`, `jvp`, `torch.func.grad`) or under Dynamo they are
`torch.func.grad`, which composes there. `remat` lives in `ember.core.remat` (its
policies and `checkpoint_name` in `ember.core.remat_policies`),
`scan` / `stack_trees` / `unstack_trees` in `ember.core.scan`, `shared_call` in
`ember.core.shared_call`, `rolled_sum` in `ember.core.scan`, `remat_scan` in
`ember.core.remat_scan`; import all of them from here.

Every transform traces whole under `torch.compile(fullgraph=True)`: the checks look only at the
structure of what a function returns (types, tuple lengths, shapes, dtypes), never at tensor values.

Example:
    >>> import torch
    >>> from ember.core.transforms import grad, value_and_grad
    >>> def loss(w, x):
    ...     return ((x @ w) ** 2).mean()
    >>> w, x = torch.ones(3), torch.ones(2, 3)
    >>> grad(loss)(w, x).tolist()
    [6.0, 6.0, 6.0]
    >>> value, g = value_and_grad(loss)(w, x)
    >>> float(value)
    9.0
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Literal, Optional, Sequence, Tuple, Union, get_args

import torch

from .autograd_grad import autograd_value_and_grad
from .pytree import tree_leaves, tree_leaves_with_path
from .remat import remat as remat
from .remat_policies import checkpoint_name as checkpoint_name
from .remat_scan import remat_scan as remat_scan
from .scan import rolled_sum as rolled_sum
from .scan import scan as scan
from .scan import stack_trees as stack_trees
from .scan import unstack_trees as unstack_trees
from .shared_call import shared_call as shared_call
from .trace_context import here

__all__ = [
    "checkpoint_name",
    "grad",
    "remat",
    "remat_scan",
    "rolled_sum",
    "scan",
    "shared_call",
    "stack_trees",
    "unstack_trees",
    "value_and_grad",
    "vmap",
]

Argnums = Union[int, Tuple[int, ...]]
Randomness = Literal["error", "different", "same"]

_MSG_AUX = (
    "with has_aux=True, `{name}` must return a pair `(loss, aux)` where aux is any pytree, "
    "e.g. `return loss, {{'acc': acc}}`; it returned {got}. Return the pair, or pass "
    "has_aux=False if there is no aux."
)
_MSG_TUPLE_WITHOUT_AUX = (
    "`{name}` returned a tuple of length {n}, but has_aux=False expects a single 0-d loss "
    "tensor. If the function returns `(loss, aux)`, pass has_aux=True; otherwise return only "
    "the loss."
)


def _describe(obj: Any) -> str:
    """A short structural description of a returned value (never reads tensor values)."""
    if isinstance(obj, torch.Tensor):
        return f"a Tensor of shape {tuple(obj.shape)} and dtype {obj.dtype}"
    if isinstance(obj, tuple):
        return f"a tuple of length {len(obj)} ({', '.join(type(o).__name__ for o in obj)})"
    return f"a {type(obj).__name__}"


def _check_loss(out: Any, *, name: str, has_aux: bool) -> None:
    """Raise a helpful error unless `out` is what `torch.func.grad` needs from `name`."""
    if has_aux:
        if not (isinstance(out, tuple) and len(out) == 2):
            raise TypeError(_MSG_AUX.format(name=name, got=_describe(out)))
        loss = out[0]
    else:
        if isinstance(out, tuple):
            raise TypeError(_MSG_TUPLE_WITHOUT_AUX.format(name=name, n=len(out)))
        loss = out
    check_scalar_loss(loss, name=name, what="the first element of the returned pair" if has_aux else "the returned value")


def check_scalar_loss(loss: Any, *, name: str, what: str) -> None:
    """Raise, naming `what` of `name`'s output and the fix, unless `loss` is a 0-d floating-point tensor.

    The one loss check of ember: `grad` / `value_and_grad` and the step builders all use it.
    """
    if not isinstance(loss, torch.Tensor):
        raise TypeError(
            f"`{name}` must return a 0-d floating-point loss tensor; {what} is "
            f"{_describe(loss)}. Return a tensor, e.g. `torch.as_tensor(loss)` or a reduction "
            "such as `.mean()`."
        )
    if loss.dim() != 0:
        raise ValueError(
            f"`{name}` must return a 0-d (scalar) loss tensor; {what} has shape "
            f"{tuple(loss.shape)}. Reduce it first (`.mean()` or `.sum()`, or "
            "ember.core.step_fns.cross_entropy), or use `vmap` / `torch.func.jacrev` for per-element gradients."
        )
    if not (loss.is_floating_point() or loss.is_complex()):
        raise TypeError(
            f"`{name}` must return a floating-point loss; {what} has dtype {loss.dtype}. "
            "Cast it, e.g. `loss.float()`."
        )


def _check_argnums(argnums: Any) -> Argnums:
    if isinstance(argnums, bool) or not isinstance(argnums, (int, tuple)):
        raise TypeError(
            f"argnums must be an int or a tuple of ints, got {argnums!r} "
            f"({type(argnums).__name__}); e.g. argnums=0 or argnums=(0, 1)."
        )
    if isinstance(argnums, tuple):
        if not argnums:
            raise ValueError("argnums=() differentiates nothing; pass at least one index.")
        bad = [a for a in argnums if isinstance(a, bool) or not isinstance(a, int)]
        if bad:
            raise TypeError(f"argnums must be a tuple of ints, got {argnums!r}.")
        if len(set(argnums)) != len(argnums):
            raise ValueError(f"argnums {argnums!r} repeats an index; list each argument once.")
    return argnums


def _checked(fn: Callable, *, has_aux: bool, argnums: Argnums) -> Tuple[Callable, Callable]:
    """Wrap `fn` with the output checks, and return a caller that checks `argnums` first."""
    name = getattr(fn, "__qualname__", None) or type(fn).__name__
    indices = argnums if isinstance(argnums, tuple) else (argnums,)

    @functools.wraps(fn)
    def checked(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        _check_loss(out, name=name, has_aux=has_aux)
        return out

    def call(transform: Callable, *args: Any, **kwargs: Any) -> Any:
        bad = [i for i in indices if not -len(args) <= i < len(args)]
        if bad:
            raise ValueError(
                f"argnums={argnums!r} refers to positional argument {bad[0]}, but `{name}` was "
                f"called with {len(args)} positional argument(s). Differentiated arguments must "
                "be passed positionally."
            )
        for i in indices:
            _check_differentiable(args[i], index=i, argnums=argnums, name=name)
        return transform(*args, **kwargs)

    return checked, call


def _is_inexact(v: Any) -> bool:
    return isinstance(v, torch.Tensor) and (v.is_floating_point() or v.is_complex())


def _check_differentiable(arg: Any, *, index: int, argnums: Argnums, name: str) -> None:
    """Raise, naming the leaf path, unless every leaf of a differentiated arg is a float tensor."""
    if all(_is_inexact(v) for v in tree_leaves(arg)):
        return
    for path, leaf in tree_leaves_with_path(arg):
        if _is_inexact(leaf):
            continue
        where = (
            f"leaf '{path}' of positional argument {index}"
            if path
            else f"positional argument {index}"
        )
        got = f"dtype {leaf.dtype}" if isinstance(leaf, torch.Tensor) else type(leaf).__name__
        raise TypeError(
            f"`{name}` is differentiated with respect to argnums={argnums!r}, but the {where} is "
            f"{'an integer/bool tensor of ' if isinstance(leaf, torch.Tensor) else 'a '}{got}; "
            "only floating-point tensors have gradients. Pass it in an argument that is not "
            "differentiated (or as a keyword argument), or make it a float tensor."
        )


def grad(fn: Callable, argnums: Argnums = 0, *, has_aux: bool = False) -> Callable:
    """Return a function computing the gradient of `fn` with respect to `argnums`.

    `fn` must return a 0-d floating-point loss, or `(loss, aux)` when `has_aux=True`. Arguments
    can be pytrees (a params dict, a `TrainState`); the gradient has the same structure.
    Keyword arguments are passed through undifferentiated (e.g. `key=`).

    Args:
        fn: the function to differentiate.
        argnums: index or tuple of indices of the positional arguments to differentiate.
        has_aux: `fn` returns `(loss, aux)`; aux is returned next to the gradient, undifferentiated.

    Returns:
        A function with `fn`'s signature returning `grads` (a tuple of them when `argnums` is a
        tuple), or `(grads, aux)` when `has_aux=True`.

    Raises:
        TypeError: `argnums` is not an int / tuple of ints, or `fn` returns the wrong structure
            (a tuple without `has_aux`, not a pair with it, a non-tensor or integer loss).
        ValueError: the loss is not 0-d (the message names its shape), or `argnums` is out of range.

    Example:
        >>> import torch
        >>> from ember.core.transforms import grad
        >>> def loss(params, x):
        ...     return (params["w"] * x).sum(), {"n": torch.tensor(x.numel())}
        >>> g, aux = grad(loss, has_aux=True)({"w": torch.zeros(2)}, torch.tensor([1.0, 2.0]))
        >>> g["w"].tolist(), int(aux["n"])
        ([1.0, 2.0], 2)
    """
    value_and_grad_fn = value_and_grad(fn, argnums, has_aux=has_aux)

    @functools.wraps(fn)
    def grad_fn(*args: Any, **kwargs: Any) -> Any:
        out, grads = value_and_grad_fn(*args, **kwargs)
        return (grads, out[1]) if has_aux else grads

    return grad_fn


def value_and_grad(fn: Callable, argnums: Argnums = 0, *, has_aux: bool = False) -> Callable:
    """Return a function computing `fn`'s value and its gradient, JAX's argument order.

    Unlike `torch.func.grad_and_value`, which returns `(grads, value)`, this returns
    `(value, grads)`, and `((value, aux), grads)` with `has_aux=True`, like `jax.value_and_grad`.

    Args:
        fn: the function to differentiate; returns a 0-d loss, or `(loss, aux)` with `has_aux`.
        argnums: index or tuple of indices of the positional arguments to differentiate.
        has_aux: `fn` returns `(loss, aux)`.

    Returns:
        A function with `fn`'s signature returning `(value, grads)`, or `((value, aux), grads)`.

    Raises:
        TypeError: as `grad`.
        ValueError: as `grad`.

    Example:
        >>> import torch
        >>> from ember.core.transforms import value_and_grad
        >>> def loss(w):
        ...     return (w ** 2).sum(), {"w_max": w.max()}
        >>> (value, aux), g = value_and_grad(loss, has_aux=True)(torch.tensor([1.0, 3.0]))
        >>> float(value), float(aux["w_max"]), g.tolist()
        (10.0, 3.0, [2.0, 6.0])
    """
    argnums = _check_argnums(argnums)
    checked, call = _checked(fn, has_aux=has_aux, argnums=argnums)
    inner = torch.func.grad_and_value(checked, argnums=argnums, has_aux=has_aux)
    indices = argnums if isinstance(argnums, tuple) else (argnums,)

    def by_autograd(*args: Any, **kwargs: Any) -> Any:
        out, grads = autograd_value_and_grad(checked, indices, has_aux, args, kwargs)
        return grads if isinstance(argnums, tuple) else grads[0], out

    @functools.wraps(fn)
    def value_and_grad_fn(*args: Any, **kwargs: Any) -> Any:
        grads, value = call(inner if here().torch_func else by_autograd, *args, **kwargs)
        return value, grads

    return value_and_grad_fn


class _NotGiven:
    """The default of an optional alias argument (JAX's spelling of an ember argument)."""

    def __repr__(self) -> str:
        return "<not given>"


_NOT_GIVEN: Any = _NotGiven()

_MSG_AXIS_NAME = (
    "vmap({arg}={value!r}) names the mapped axis for collectives (jax.lax.psum / pmean / all_gather "
    "inside fn), which ember's vmap does not have; drop {arg} and reduce the mapped dim of the output "
    "after vmap instead (e.g. `vmap(fn)(xs).mean(0)`)."
)


def _alias(name: str, value: Any, default: Any, jax_name: str, jax_value: Any) -> Any:
    """`value`, or `jax_value` when the JAX spelling was given (a top-level list becomes a tuple, as JAX reads it)."""
    if jax_value is _NOT_GIVEN:
        return value
    if value is not default:
        raise ValueError(f"vmap got both {name}={value!r} and {jax_name}={jax_value!r}, which are one argument "
                         f"({jax_name} is JAX's spelling of {name}); pass only one.")
    return tuple(jax_value) if isinstance(jax_value, list) else jax_value


def vmap(
    fn: Callable,
    in_dims: Union[int, None, Sequence[Any]] = 0,
    out_dims: Union[int, None, Sequence[Any]] = 0,
    *,
    randomness: Randomness = "error",
    chunk_size: Optional[int] = None,
    in_axes: Union[int, None, Sequence[Any]] = _NOT_GIVEN,
    out_axes: Union[int, None, Sequence[Any]] = _NOT_GIVEN,
    axis_name: Any = None,
    spmd_axis_name: Any = None,
) -> Callable:
    """Vectorise `fn` over a dimension of its inputs (`torch.func.vmap`).

    Inputs and outputs may be pytrees; `in_dims` / `out_dims` are an int, `None` (not mapped) or a
    pytree prefix of the positional arguments / outputs, exactly as in `torch.func.vmap`. JAX's
    spellings `in_axes` / `out_axes` are accepted and mean the same (a top-level list is read as a
    tuple, as JAX does). Unlike `jax.vmap`, keyword arguments are passed through unmapped.

    Args:
        fn: the function to vectorise.
        in_dims: which dimension of each input to map over (`None`: broadcast the input).
        out_dims: where the mapped dimension goes in each output (`None`: the output is not mapped).
        randomness: what torch's global RNG does under vmap: `"error"` (default: ember code draws
            randomness from keys, so use `vmap` over split keys instead), `"different"` or `"same"`.
        chunk_size: map this many elements at a time to bound memory (`None`: all at once).
        in_axes: JAX's name for `in_dims` (give one of the two).
        out_axes: JAX's name for `out_dims` (give one of the two).
        axis_name: must be None. JAX names the mapped axis for collectives inside `fn`
            (`lax.psum(x, "batch")`); ember's vmap has none, so a name would mean nothing.
        spmd_axis_name: must be None (JAX's sharding of the mapped axis; ember shards by rules).

    Returns:
        The vectorised function.

    Raises:
        ValueError: `randomness` is not one of the choices, `chunk_size` is not positive, or both
            spellings of one argument are given.
        TypeError: `axis_name` or `spmd_axis_name` is given.

    Example:
        >>> import torch
        >>> from ember.core.transforms import grad, vmap
        >>> per_example = vmap(grad(lambda w, x: (w * x).sum()), in_dims=(None, 0))
        >>> per_example(torch.zeros(2), torch.tensor([[1.0, 2.0], [3.0, 4.0]])).tolist()
        [[1.0, 2.0], [3.0, 4.0]]
    """
    for jax_arg, value in (("axis_name", axis_name), ("spmd_axis_name", spmd_axis_name)):
        if value is not None:
            raise TypeError(_MSG_AXIS_NAME.format(arg=jax_arg, value=value))
    in_dims = _alias("in_dims", in_dims, 0, "in_axes", in_axes)
    out_dims = _alias("out_dims", out_dims, 0, "out_axes", out_axes)
    choices = get_args(Randomness)
    if randomness not in choices:
        raise ValueError(
            f"randomness must be one of {', '.join(repr(c) for c in choices)}, got {randomness!r}."
        )
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}.")
    return torch.func.vmap(
        fn, in_dims=in_dims, out_dims=out_dims, randomness=randomness, chunk_size=chunk_size
    )
