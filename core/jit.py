"""`jit`: ember's one compilation entry point (eager, Inductor or torch_xla), with state donation.

Public names: `jit`, `Jitted`, `Backend`, `Donate`.

Backends:
    - `"eager"`: calls `fn` as is (for debugging), with the same donation semantics.
    - `"inductor"`: traces `fn` once per input signature (pytree structure and static fields,
      shapes, strides, dtypes, devices, which arguments alias, non-tensor leaves, grad mode and
      autocast) with `make_fx` on fake tensors, as `jax.jit` does, and compiles that ATen graph
      with Inductor (`compile_fx`), optionally with `mode` or `options`. Tensor *values* never
      recompile, so pass tunables such as the learning rate as tensors. Tracing is strict like
      `torch.compile(fullgraph=True)`: reading a value (`.item()`, `if loss > 0`) fails at trace
      time. It is several times faster than Dynamo for a whole training step (tiny Llama:
      3-4 s vs 23 s) and, unlike Dynamo's work, the compiled graph is found in Inductor's on-disk
      cache by the next process (see BENCHMARKS.md). While tracing, `torch.compiler.is_compiling()`
      is True, as under `torch.export`. Inputs that are tensor subclasses (DTensor) or require
      grad go through `torch.compile(fn, fullgraph=True, dynamic=False)` instead.
      `Jitted.compile_count` counts the graphs handed to Inductor.
    - `"xla"`: arguments must already live on the XLA device (`torch_xla.device()`; a CPU tensor
      raises `ValueError` naming its path). Each call first materialises any pending work on its
      input tensors, then traces `fn` lazily and cuts one graph whose outputs are exactly the
      call's output tensors. torch_xla caches compiled graphs by hash, so the step compiles once
      per input signature: call 1 compiles, later calls with the same shapes compile zero times
      (tested: `[1, 0, 0, ...]` over 20 steps, also after an lr change). Without the input sync,
      a state built on the device (`TrainState.create` over XLA params makes its zeros lazily)
      folds its own initialisation into call 1's graph and the step compiles again at call 2
      (measured: `[1, 1, 0, 0]`). A global `torch_xla.sync()` instead of the targeted one would
      also pick up any other live tensor with pending work (intermediates kept alive by reference
      cycles until the garbage collector runs), and the compile count then varied between
      identical runs. The same sync also gives every 0-d input its own computed buffer unless it
      already holds what the previous call returned: torch_xla uploads a 0-d host tensor
      (`torch.tensor(0.9).to(dev)`, as optimizer hyperparameters are made) into a read-only
      buffer that it caches by value and shares with every equal scalar, including constants the
      step creates while tracing; the graph's hash covers both which buffers are shared and
      which are read-only, so a state holding such scalars compiled once at call 1 and again at
      call 2 (measured on a Llama + AdamW step: `[1, 1, 0, 0]`; now `[1, 0, 0, 0]`).
      `Jitted.compile_count` counts graphs compiled during the step itself
      (torch_xla counter `UncachedCompile`), not the inputs' materialisation. Start the XLA
      runtime (`torch_xla.device()`) before the process runs any backward pass, even on CPU:
      autograd sizes its per-device queues on first use (ember rewords the resulting error).

Donation (`donate="state"`): the first positional argument (a pytree of tensors, usually a
`TrainState`) is donated. `fn` must return a tuple or list whose first element is the new state,
with the same structure and the same shape and dtype at every leaf. The wrapper copies the new
leaves into the donated tensors (one `copy_` per leaf, inside the compiled graph, where Inductor
re-inplaces it into the kernels that compute the new values, so no second copy of params and
optimizer state is allocated) and returns the donated state itself as the first output: its
tensors keep their storage (`data_ptr`) and now hold the new values. The old values are gone:
after the call, any reference to the donated state (or its tensors) sees the new state. Do not
keep the old state around expecting the old numbers; clone it first if you need them. On XLA the
same in-place copy makes torch_xla alias each donated input buffer to its output. A new leaf may
be its own donated leaf unchanged (a key, a hyperparameter), but not another donated leaf (moved
or swapped leaves raise `ValueError`), nor a view of one.

Known Inductor issue (torch 2.9, CPU): Inductor may fuse the copy into a donated leaf with the
kernel computing its new value. If that kernel reads the same donated leaf (or another one
written earlier) at *other* indices (`flip`, `roll`, a transpose, a tiny matvec it decomposes into
elementwise code), it reads already-overwritten values. A training step is not affected: new
params and optimizer state read params and moments at the same index, and gradients come from the
backward pass, whose kernels finish before the update. Such a step is tested against eager here;
for unusual state updates, compare donated Inductor with `backend="eager"` once, or use
`donate="none"`. (`torch._foreach_copy_` is worse: it also mis-orders same-index reads of other
donated leaves, so ember copies leaf by leaf.)

Example:
    >>> import torch
    >>> from ember.core.jit import jit
    >>> def step(state, x):
    ...     new = {"w": state["w"] - 0.5 * x}
    ...     return new, (new["w"] ** 2).sum()
    >>> fast = jit(step, backend="eager", donate="state")
    >>> state = {"w": torch.ones(3)}
    >>> ptr = state["w"].data_ptr()
    >>> state, loss = fast(state, torch.ones(3))
    >>> state["w"].tolist(), state["w"].data_ptr() == ptr
    ([0.5, 0.5, 0.5], True)
"""

from __future__ import annotations

import difflib
import functools
import time
import types
import weakref
from typing import Any, Callable, Dict, Literal, Optional, Tuple, get_args

import torch
import torch.utils._pytree as _pytree
from torch import Tensor

from ._fx_compile import FxCompiled
from .pytree import keystr, tree_flatten, tree_flatten_with_path, tree_leaves

__all__ = ["Backend", "Donate", "Jitted", "jit"]

Backend = Literal["eager", "inductor", "xla"]
Donate = Literal["none", "state"]
_BACKENDS: Tuple[str, ...] = get_args(Backend)
_DONATES: Tuple[str, ...] = get_args(Donate)

_MSG_NOT_A_PYTREE = (
    "jit(donate='state') donates the first positional argument, which must be a pytree of tensors "
    "(a TrainState, dict, list, tuple or @ember.core.pytree.dataclass), got {got}. Pass the state "
    "as a pytree, e.g. `params = dict(module.named_parameters())` instead of an nn.Module, or use "
    "donate='none'."
)
_MSG_BAD_OUTPUT = (
    "jit(donate='state') expects fn to return a tuple or list whose first element is the new "
    "state, e.g. `return new_state, metrics`, got {got}. Return `(new_state, ...)`, or use "
    "donate='none'."
)
_MSG_SHAPE_CHANGED = (
    "jit(donate='state') cannot donate state leaf '{path}': its new value must fit the donated "
    "buffer, but {what} changed from {old} to {new}. Keep every state leaf's shape and dtype "
    "fixed across steps (cast back, e.g. `.to(old.dtype)`), or use donate='none'."
)

_MSG_AUTOGRAD_BEFORE_XLA = (
    "jit(backend='xla'): autograd failed on the XLA device because this process ran a backward "
    "pass (even on CPU) before the torch_xla runtime started; autograd then sized its device "
    "queues when XLA had 0 devices. Start the runtime first: call `torch_xla.device()` (after "
    "ember.core.xla.xla_cpu_devices(n) if you need n CPU devices) before any backward, e.g. "
    "before computing an eager reference. Under SPMD, build the `Sharding` (XlaLowering enables "
    "SPMD and primes autograd) before any backward instead."
)


def _choice_error(arg: str, value: Any, choices: Tuple[str, ...]) -> ValueError:
    valid = ", ".join(repr(c) for c in choices)
    return ValueError(f"jit({arg}=...) must be one of {valid}; got {value!r}.")


def _inductor_config_error(
    mode: Optional[str], options: Optional[Dict[str, Any]], err: Exception
) -> str:
    msg = str(err)
    if msg.startswith("Unexpected optimization option"):
        from torch._inductor import config

        known = list(config.get_config_copy())
        unknown = [k for k in (options or {}) if k.replace("-", "_") not in known]
        hints = {k: difflib.get_close_matches(k.replace("-", "_"), known, n=3) for k in unknown}
        return (
            f"jit(options=...) has keys Inductor does not know: {unknown} (closest known: {hints}). "
            f"Options are torch._inductor.config names, e.g. {{'max_autotune': True}}."
        )
    first_line = msg.splitlines()[0][:300] if msg else type(err).__name__
    return f"jit(mode={mode!r}, options={options!r}) was rejected by Inductor: {first_line}"


class _CountingInductor(torch._TorchCompileInductorWrapper):
    """Inductor as a `torch.compile` backend that counts the graphs it is asked to compile."""

    def __init__(self, mode: Optional[str], options: Optional[Dict[str, Any]]) -> None:
        try:
            super().__init__(mode, dict(options) if options else None, False)
        except RuntimeError as err:  # unknown mode or option, or an option of the wrong type
            raise ValueError(_inductor_config_error(mode, options, err)) from err
        self.count = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: Any) -> Any:
        self.count += 1
        return super().__call__(gm, example_inputs)


def _donatable(state: Any, out: Any) -> bool:
    """Whether `out[0]` can be copied into `state` leaf by leaf.

    Runs inside the traced function: under `torch.compile` every test is on static metadata
    (structure, shapes, dtypes, which tensor object is which) and is decided at trace time, so it
    costs nothing per call.
    """
    if not isinstance(out, (tuple, list)) or len(out) == 0:
        return False
    old, old_spec = tree_flatten(state)
    new, new_spec = tree_flatten(out[0])
    if old_spec != new_spec:
        return False
    for o, n in zip(old, new):
        if not (isinstance(o, Tensor) and isinstance(n, Tensor)):
            return False
        if o.shape != n.shape or o.dtype != n.dtype or o.device != n.device:
            return False
    return _moved_leaf(old, new) is None


def _moved_leaf(old: list, new: list) -> Optional[Tuple[int, int]]:
    """`(i, j)` if new leaf `i` *is* donated leaf `j != i` (a leaf moved or swapped), else None.

    Copying leaf by leaf would then read donated leaf `j` after it was overwritten (and under
    Inductor 2.9 even an explicit `.clone()` does not help: clones are removed as no-ops). A dict
    keyed by the tensors (identity hashing) finds this in O(n) and traces under Dynamo, where
    `id()` of a traced intermediate does not. A leaf returned unchanged at its own position is
    fine (a no-op copy).
    """
    position = {t: i for i, t in enumerate(old)}
    for i, n in enumerate(new):
        j = position.get(n, i)
        if j != i:
            return i, j
    return None


def _with_first(out: Any, first: Any) -> Any:
    if isinstance(out, list):
        return [first, *out[1:]]
    if hasattr(out, "_replace"):  # NamedTuple
        return out._replace(**{out._fields[0]: first})
    return (first, *out[1:])


def _donation_error(state: Any, out: Any) -> Exception:
    """The precise error for an output `_donatable` rejected (runs eagerly, on the error path)."""
    if not isinstance(out, (tuple, list)) or len(out) == 0:
        return TypeError(_MSG_BAD_OUTPUT.format(got=f"{type(out).__name__} {_short(out)}"))
    old, old_spec = tree_flatten_with_path(state)
    new, new_spec = tree_flatten_with_path(out[0])
    if old_spec != new_spec:
        old_paths, new_paths = [keystr(p) for p, _ in old], [keystr(p) for p, _ in new]
        gone = sorted(set(old_paths) - set(new_paths))[:5]
        added = sorted(set(new_paths) - set(old_paths))[:5]
        detail = (
            f"paths missing from the new state: {gone}; new paths: {added}"
            if gone or added
            else f"same paths but different containers or static fields:\n  {old_spec}\nvs\n  {new_spec}"
        )
        return ValueError(
            f"jit(donate='state') needs the new state (first output) to have the same pytree "
            f"structure as the donated state: {detail}. Return a state built with `.replace(...)` "
            f"from the input state, or use donate='none'."
        )
    for (path, o), (_, n) in zip(old, new):
        p = keystr(path)
        for leaf, which in ((o, "donated"), (n, "new")):
            if not isinstance(leaf, Tensor):
                return TypeError(
                    f"jit(donate='state') can only donate tensors, but the {which} state's leaf "
                    f"'{p}' is a {type(leaf).__name__} ({_short(leaf)}). Make it a tensor (e.g. "
                    f"torch.tensor(x)) or a static field (`pytree.field(static=True)`), or use "
                    f"donate='none'."
                )
        for what, a, b in (("shape", tuple(o.shape), tuple(n.shape)), ("dtype", o.dtype, n.dtype),
                           ("device", o.device, n.device)):
            if a != b:
                return ValueError(_MSG_SHAPE_CHANGED.format(path=p, what=what, old=a, new=b))
    moved = _moved_leaf([o for _, o in old], [n for _, n in new])
    if moved is not None:
        i, j = moved
        return ValueError(
            f"jit(donate='state') cannot donate: the new state's leaf '{keystr(new[i][0])}' is the "
            f"donated leaf '{keystr(old[j][0])}' itself (a leaf moved to another position). The "
            f"donated buffers are overwritten leaf by leaf, so it would read an overwritten buffer. "
            f"Use donate='none' for this function."
        )
    raise AssertionError("internal: _donatable rejected an output that _donation_error accepts")


def _short(obj: Any, n: int = 80) -> str:
    text = repr(obj)
    return text if len(text) <= n else text[: n - 3] + "..."


def _fresh_code(fn: Callable, name: str) -> Callable:
    """A copy of `fn` with its own code object.

    Dynamo keeps compiled graphs (and counts recompiles against `recompile_limit`) per code
    object; a private copy per `Jitted` keeps two jits of the same function from sharing them.
    """
    code = fn.__code__.replace(co_name=name, co_qualname=name)
    return types.FunctionType(code, fn.__globals__, name, fn.__defaults__, fn.__closure__)


def _make_entry(fn: Callable, donate: str) -> Callable:
    """The function that gets traced: `fn`, plus the in-place copy into the donated state."""
    if donate == "none":

        def entry(*args: Any, **kwargs: Any) -> Tuple[Any, bool]:
            return fn(*args, **kwargs), True

    else:

        def entry(state: Any, *args: Any, **kwargs: Any) -> Tuple[Any, bool]:
            out = fn(state, *args, **kwargs)
            if not _donatable(state, out):
                return out, False  # the wrapper raises the precise error; the state is untouched
            # One copy_ per leaf, not torch._foreach_copy_: Inductor 2.9 (CPU) orders a fused
            # foreach copy into graph inputs wrongly when a new leaf reads another donated leaf
            # (e.g. Adam's param update reading m and v when m and v are written first) or
            # reads its own buffer at other indices (flip, matvec); per-leaf copies are right.
            for dst, src in zip(tree_leaves(state), tree_leaves(out[0])):
                dst.copy_(src)
            return _with_first(out, state), True

    name = "ember_jit_" + "".join(c if c.isalnum() else "_" for c in getattr(fn, "__name__", "fn"))
    return _fresh_code(entry, name)


def _own_scalar_buffers(inputs: list, owned: Dict[int, Tuple[weakref.ref, Any]]) -> None:
    """Give each 0-d XLA input its own computed buffer, unless it holds what the last call returned.

    torch_xla uploads a 0-d host tensor (`torch.tensor(0.9).to(dev)`) into a read-only device
    buffer that it caches by value and shares with every other scalar of that value and dtype,
    including the Python-number constants a traced step creates (`x * 0.9`, `torch.full((),
    0.1)`). The graph's hash covers which parameters share a buffer and which are read-only, so a
    step traced from such scalars differs from the same step traced from its own outputs (which
    are private and writable), and the second call compiled again. Multiplying in place by one (a
    no-op on the values; `logical_or` with itself for bool) leaves the tensor objects, and so a
    donated state's identity, unchanged; the caller's `xla.sync(inputs)` then materialises the
    results as new, private buffers. Tensors still holding the data the previous call returned
    (the usual state leaves after call 1; `owned` maps their `id` to a weak reference and the data
    id torch_xla gave them) are skipped, so a steady-state step launches no extra graph. Views are
    skipped: their value is an IR node on their base, which the sync computes anyway.
    """
    import torch_xla

    data_id = torch_xla._XLAC._unique_id_for_ir_and_data
    seen = set()
    with torch.no_grad():
        for t in inputs:
            if t.ndim != 0 or id(t) in seen or t._is_view():
                continue
            seen.add(id(t))
            entry = owned.get(id(t))
            if entry is not None and entry[0]() is t and entry[1] == data_id(t):
                continue
            if t.dtype == torch.bool:
                t.logical_or_(t)
            else:
                t.mul_(1)


class Jitted:
    """A function prepared by `jit`: call it like `fn`; see the module docstring for semantics.

    Attributes:
        fn: the wrapped function.
        backend: `"eager"`, `"inductor"` or `"xla"`.
        donate: `"none"` or `"state"`.
    """

    def __init__(
        self,
        fn: Callable,
        *,
        backend: Backend,
        donate: Donate,
        mode: Optional[str],
        options: Optional[Dict[str, Any]],
    ) -> None:
        self.fn, self.backend, self.donate = fn, backend, donate
        self._entry = _make_entry(fn, donate)
        self._compile_seconds = 0.0
        self._xla_compiles = 0
        # id -> (weak reference, torch_xla data id) of the 0-d tensors the last XLA call returned.
        self._xla_owned: Dict[int, Tuple[weakref.ref, Any]] = {}
        self._counter: Optional[_CountingInductor] = None
        if backend == "inductor":
            self._counter = _CountingInductor(mode, options)
            self._traced = FxCompiled(self._entry, self._counter)
            self._dynamo = torch.compile(
                self._entry, backend=self._counter, fullgraph=True, dynamic=False
            )
            self._call = self._call_inductor
        elif backend == "xla":
            from . import xla

            xla.require_torch_xla("jit(backend='xla')")
            self._call = self._entry
        else:
            self._call = self._entry
        functools.update_wrapper(self, fn, updated=())

    @property
    def compile_count(self) -> int:
        """Graphs compiled so far by this function: 0 for eager, Inductor graphs, or XLA graphs."""
        if self._counter is not None:
            return self._counter.count
        return self._xla_compiles

    @property
    def compile_seconds(self) -> float:
        """Total wall time of the calls that compiled (tracing + compiling + that call's run)."""
        return self._compile_seconds

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", repr(self.fn))
        return f"Jitted({name}, backend={self.backend!r}, donate={self.donate!r})"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        state = args[0] if args else None
        if self.donate == "state":
            if not args:
                raise TypeError(
                    "jit(donate='state') donates the first positional argument, but the call got "
                    "none. Call it as `fn(state, ...)`, or use donate='none'."
                )
            if not (isinstance(state, Tensor) or not _pytree.tree_is_leaf(state)):
                raise TypeError(_MSG_NOT_A_PYTREE.format(got=f"{type(state).__module__}."
                                                             f"{type(state).__qualname__}"))
        before = self.compile_count
        start = time.perf_counter()
        if self.backend == "xla":
            out, ok = self._call_xla(args, kwargs)
        else:
            out, ok = self._call(*args, **kwargs)
        if self.compile_count != before:
            self._compile_seconds += time.perf_counter() - start
        if not ok:
            raise _donation_error(state, out)
        return out

    def _call_inductor(self, *args: Any, **kwargs: Any) -> Tuple[Any, bool]:
        leaves, spec = tree_flatten((args, kwargs))
        if FxCompiled.accepts(leaves):
            out, ok = self._traced(leaves, spec)
            if ok and self.donate == "state":
                out = _with_first(out, args[0])  # the donated containers themselves, as eager returns
            return out, ok
        return self._dynamo(*args, **kwargs)  # DTensor inputs, or inputs that require grad

    def _call_xla(self, args: tuple, kwargs: dict) -> Tuple[Any, bool]:
        from . import xla

        torch_xla = xla.require_torch_xla("jit(backend='xla')")

        inputs = []
        for path, leaf in tree_flatten_with_path((args, kwargs))[0]:
            if not isinstance(leaf, Tensor):
                continue
            inputs.append(leaf)
            if leaf.device.type != "xla":
                where = ("args." if path[0].idx == 0 else "kwargs.") + keystr(path[1:])
                raise ValueError(
                    f"jit(backend='xla') expects every tensor argument on the XLA device, but "
                    f"{where} is on {leaf.device}. Move inputs first, e.g. "
                    f"`tree_map(lambda t: t.to(torch_xla.device()), batch)`."
                )
        # Materialise pending work on the inputs (e.g. optimizer zeros made lazily on the device)
        # so the step is traced from device data: otherwise call 1 would fold the inputs' own
        # computation into its graph and call 2 would compile again. 0-d inputs uploaded from the
        # host first get their own buffer (see _own_scalar_buffers), in the same graph.
        _own_scalar_buffers(inputs, self._xla_owned)
        xla.sync(inputs)
        before = xla.compile_count()
        try:
            out = self._entry(*args, **kwargs)
        except RuntimeError as err:
            if "device_ready_queues_" in str(err):
                raise RuntimeError(_MSG_AUTOGRAD_BEFORE_XLA) from err
            raise
        # Cut one graph whose outputs are exactly this call's outputs. A global torch_xla.sync()
        # would also pick up any other live tensor with pending work (e.g. intermediates kept
        # alive by a reference cycle until the garbage collector runs), making the graph, and
        # so the compile count, depend on GC timing.
        outputs = [t for t in tree_leaves(out) if isinstance(t, Tensor)]
        xla.sync(outputs)
        self._xla_compiles += xla.compile_count() - before
        data_id = torch_xla._XLAC._unique_id_for_ir_and_data
        self._xla_owned = {
            id(t): (weakref.ref(t), data_id(t))
            for t in outputs
            if t.ndim == 0 and t.device.type == "xla"
        }
        return out


def jit(
    fn: Optional[Callable] = None,
    *,
    backend: Backend = "inductor",
    donate: Donate = "none",
    mode: Optional[str] = None,
    options: Optional[Dict[str, Any]] = None,
) -> Any:
    """Prepare `fn` to run eagerly, under Inductor, or under torch_xla, optionally donating its state.

    Args:
        fn: the function, usually a pure `step(state, batch) -> (state, metrics)`. If omitted,
            returns a decorator: `@jit(backend="eager")`.
        backend: `"eager"`, `"inductor"` (traced per signature, compiled by Inductor) or
            `"xla"` (inputs on `torch_xla.device()`, one graph cut per call).
        donate: `"none"`, or `"state"` to write the new first output into the first argument's
            tensors and return those (see the module docstring; the old values are overwritten).
        mode: `torch.compile` mode (`"max-autotune"`, ...); inductor only.
        options: Inductor config options (`{"max_autotune": True}`); inductor only; not with `mode`.

    Returns:
        A `Jitted` callable with the signature of `fn`, exposing `compile_count` and
        `compile_seconds`; or a decorator producing one when `fn` is None.

    Raises:
        ValueError: `backend` or `donate` is not a valid choice, or `mode`/`options` are given for
            a backend other than inductor, or both are given.
        TypeError: `fn` is not callable or is already a `Jitted`.
        ImportError: `backend="xla"` and torch_xla is not installed.

    Example:
        >>> import torch
        >>> from ember.core.jit import jit
        >>> double = jit(lambda x: 2 * x, backend="eager")
        >>> double(torch.ones(2)).tolist(), double.compile_count
        ([2.0, 2.0], 0)
    """
    if backend not in _BACKENDS:
        raise _choice_error("backend", backend, _BACKENDS)
    if donate not in _DONATES:
        raise _choice_error("donate", donate, _DONATES)
    if backend != "inductor" and (mode is not None or options is not None):
        raise ValueError(
            f"jit(mode=..., options=...) configure Inductor and apply only to backend='inductor', "
            f"got backend={backend!r} with mode={mode!r}, options={options!r}. Drop them, or use "
            f"backend='inductor'."
        )
    if mode is not None and options is not None:
        raise ValueError(
            f"jit takes either mode or options, not both (got mode={mode!r}, options={options!r}); "
            f"fold the mode's settings into options."
        )
    if fn is None:
        return functools.partial(jit, backend=backend, donate=donate, mode=mode, options=options)
    if isinstance(fn, Jitted):
        raise TypeError(
            f"jit got a function that is already jitted ({fn!r}); wrapping twice would compile "
            f"twice. Pass the original function (`jitted.fn`) instead."
        )
    if not callable(fn):
        raise TypeError(f"jit(fn) expects a callable, got {type(fn).__name__} {_short(fn)}.")
    return Jitted(fn, backend=backend, donate=donate, mode=mode, options=options)
