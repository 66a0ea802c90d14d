"""The one place where ember touches torch / torch_xla / jax internals, each entry with its reason.

Every private name ember uses is reached through a module of this package, and every module is
listed in `WORKAROUNDS` with the upstream issue it works around, the range of torch releases it is
on for (each end measured to need it), the releases where it was measured, and the test that fails
when a newer release makes it unnecessary or breaks it (`tests/core/test_compat*.py`).

Entries of kind "patch" change what torch does. They run only inside ember's own compiles, only
inside their range, and only while `EMBER_DISABLE_PATCHES` (a comma-separated list of names, or
`all`) does not name them. A patch that fails is found, named in one warning and dropped alone; the
compile runs with the others (`compiling_with`). Entries of kind "access" only read a private name
that has no public equivalent yet; where that name is gone they fall back or say what is missing.
Entries of kind "refusal" stop a computation torch gets wrong inside their range, wherever ember
meets it, with an error naming the fix (`refuse_where_gated`); naming one in `EMBER_DISABLE_PATCHES`
lifts it (`all` does not).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import warnings
from typing import Callable, ContextManager, Dict, Iterator, Sequence, Tuple, TypeVar

import torch

__all__ = [
    "TESTED_TORCH",
    "WORKAROUNDS",
    "Workaround",
    "check_torch_version",
    "compiling_with",
    "gated_on",
    "measured_here",
    "patch_enabled",
    "refuse_where_gated",
    "torch_minor",
    "warn_once",
]

TESTED_TORCH: Tuple[str, str] = ("2.9.0", "2.15.0")  # oldest and newest torch CI builds and tests

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Workaround:
    """One use of another project's internals: why, for which torch releases, what tests it.

    `torch` is the inclusive range of minor releases it is on for; both ends are among `measured`.
    `measured` lists every release where its test was run: inside the range it was needed there,
    outside it was not. Elsewhere (inside the range but unmeasured) the tests check only results.
    """

    name: str
    kind: str  # "patch" (changes torch's behaviour inside ember's compiles), "access" or "refusal"
    upstream: str  # the upstream issue or gap it works around
    torch: Tuple[str, str]  # (first, last) torch minor release it is on for, both measured
    measured: Tuple[str, ...]  # the minor releases where its need was measured
    test: str  # the test that fails once a release makes it unnecessary or breaks it


_TESTS = "tests/core/test_compat.py"
_TESTED_RANGE = ("2.9", "2.15")  # on for the whole range: measured needed at both ends and between
_MEASURED = ("2.9", "2.13", "2.14", "2.15")  # CI's three lines, and 2.14.1 by hand

WORKAROUNDS: Dict[str, Workaround] = {w.name: w for w in (
    # Inductor builds one shared library per CPU kernel (a g++ run each, mostly PCH load and link).
    # No upstream issue asks to batch them; the nearest are pytorch/pytorch#144293 (precompiled
    # header) and #147323 (splitting one huge translation unit).
    Workaround("cpp_kernel_batching", "patch", "https://github.com/pytorch/pytorch/pull/144293",
               _TESTED_RANGE, _MEASURED, "tests/core/test_compat_inductor_batching.py"),
    # torch 2.13 to 2.15's own lifetimes free a matmul output before the donated write (measured).
    Workaround("frees_after_last_read", "patch", "https://github.com/pytorch/pytorch/pull/196664",
               ("2.9", "2.9"), _MEASURED, "tests/core/test_compat_inductor_frees.py"),
    # Queued `allgather_into_tensor_coalesced` works of gloo corrupt the heap (measured on both:
    # the plain-torch repro in its test aborts); nearest upstream report: the async gloo
    # allgather_coalesced crash, pytorch/pytorch#65237 (closed with the test disabled, #65231).
    Workaround("gloo_all_gather_out", "patch", "https://github.com/pytorch/pytorch/issues/65237",
               _TESTED_RANGE, _MEASURED, "tests/core/test_compat_gloo_all_gather.py"),
    # torch 2.14 and 2.15 leave a `.load_ok` marker per passed check themselves (measured: 0 probes
    # warm); 2.13 repeats every probe in each process (measured: 6 and 6).
    Workaround("vec_isa_probe_memo", "patch", "https://github.com/pytorch/pytorch/issues/140970",
               ("2.9", "2.13"), _MEASURED, f"{_TESTS}::test_isa_memo_is_needed_exactly_where_gated"),
    # pytorch/pytorch#179290 (select, fixed by #179318), #159856 (norm of Partial), #163879
    # (logsumexp), #120333 (SDPA: the CUDA op only; the CPU op has no rule).
    Workaround("dtensor_rules", "patch", "https://github.com/pytorch/pytorch/issues/179290",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_dtensor_rules_are_still_missing"),
    # On a GPU, Inductor's loop reordering asserts on a fused node holding a foreach kernel (the
    # optimizer's update): every compiled step failed on an H200 with torch 2.11. 2.10 and 2.12 were
    # read in their wheels (2.10 asserts, 2.12 holds the fix, pytorch/pytorch#176849).
    Workaround("foreach_loop_reordering", "patch", "https://github.com/pytorch/pytorch/issues/176591",
               ("2.9", "2.11"), ("2.9", "2.11", "2.13", "2.15"),
               "tests/core/test_compat_inductor_loop_order.py"),
    # `torch.compiler.nested_compile_region` acts only under Dynamo; under make_fx it is a plain
    # call (nearest upstream report: reuse of its subgraphs outside torch.compile, #195005).
    Workaround("shared_subgraph", "patch", "https://github.com/pytorch/pytorch/issues/195005",
               _TESTED_RANGE, _MEASURED, "tests/core/test_shared_call.py::test_nested_compile_region_still_inlines_under_make_fx"),
    # No public API hands a graph traced outside Dynamo to Inductor (pytorch/pytorch#188734, open).
    Workaround("fake_tracing", "access", "https://github.com/pytorch/pytorch/pull/188734",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_traced_inductor_names_exist"),
    # Whether a torch.func transform is active (remat runs plainly there: checkpointing does not run
    # under torch.func.grad, #122729) and the tensor under its wrappers (torch_xla annotations).
    Workaround("functorch_levels", "access", "https://github.com/pytorch/pytorch/issues/122729",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_checkpoint_still_fails_under_func_grad"),
    # A checkpoint inside a bridged module recomputes after `functional_call` returned (see stateless.py).
    Workaround("module_reparametrize", "access", "https://github.com/pytorch/pytorch/pull/171061",
               _TESTED_RANGE, _MEASURED, "tests/models/test_bridge_checkpointing.py"),
    Workaround("pytree", "access", "https://github.com/pytorch/pytorch/issues/65761",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_pytree_has_no_public_module"),
    # Traceable, differentiable collectives (pipeline shifts, context-parallel gathers) are not released.
    Workaround("functional_collectives", "access", "https://github.com/pytorch/pytorch/issues/113669",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_functional_collectives_are_still_private"),
    Workaround("dispatch_mode", "access", "https://github.com/albanD/subclass_zoo/issues/9",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_dispatch_modes_are_still_private"),
    # The CUDA allocator's history and snapshot (`--profile.memory`): documented, still underscored.
    Workaround("cuda_memory_history", "access", "https://github.com/pytorch/pytorch/pull/97406",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_cuda_memory_history_is_still_private"),
    Workaround("dynamo_counters", "access", "https://github.com/pytorch/pytorch/pull/185782",
               _TESTED_RANGE, _MEASURED, f"{_TESTS}::test_traced_inductor_names_exist"),
    # A forward-only rolled loop (torch_xla's scan without its AOTAutograd backward), which the
    # scan RFC plans to replace with torch's scan operator (pytorch/xla#8620). It traces again after
    # a pending tensor's handle moved mid-lowering (pytorch/xla#8785; tests/core/test_xla_loop.py).
    Workaround("xla_while_loop", "access", "https://github.com/pytorch/xla/issues/8620",
               ("2.9", "2.9"), ("2.9",), "tests/step_fns/test_train_step_xla.py"),
    Workaround("torch_xla_internals", "access", "https://github.com/pytorch/xla/issues/9276",
               ("2.9", "2.9"), ("2.9",), "tests/core/test_jit_xla.py"),
    # torch.use_deterministic_algorithms(mode) writes `mode` into Inductor's private deterministic
    # setting (#165950, 2.10 on; 2.9 does not, 2.10 to 2.14 unmeasured): ember restores it after its scope.
    Workaround("inductor_deterministic", "access", "https://github.com/pytorch/pytorch/pull/165950",
               ("2.15", "2.15"), ("2.15",), f"{_TESTS}::test_deterministic_algorithms_still_write_inductor_config"),
    # Inductor over DTensor leaves the collectives of a mixture of experts' tensor-parallel matmuls
    # unwaited: `ep=2,tp=2` losses off by 3.6e-4 / 1.6e-2 at steps 1 / 2 on 2.9, 3.5e-4 / 4.6e-3 on
    # 2.10; within 2e-4 on 2.11, 2.12, 2.13 and 2.15. Nearest upstream report: torchtitan#1769.
    Workaround("moe_tensor_parallel", "refusal", "https://github.com/pytorch/torchtitan/issues/1769",
               ("2.9", "2.10"), ("2.9", "2.10", "2.11", "2.12", "2.13", "2.15"),
               "tests/models/test_moe_mistakes.py::test_compiled_moe_under_tensor_parallelism_is_refused_where_gated"),
    # A trace of `torch._grouped_mm` (fake tensors) refuses float32 on 2.9, 2.13 and 2.14.1 (measured;
    # 2.15 traces it): the dropless experts keep their padded path there (`compat/grouped_mm.py`).
    Workaround("grouped_mm_float32", "access", "https://github.com/pytorch/pytorch/pull/162059",
               ("2.9", "2.14"), _MEASURED,
               f"{_TESTS}::test_grouped_mm_float32_traces_exactly_outside_its_gate"),
    # DTensor on 2.9 to 2.11 refuses to fold (B, T) with T split into a matmul's rows ("Attempted to flatten
    # multiple dimensions"), the first Linear of a context-parallel step; 2.12 on fold it as a strided shard
    # (pytorch/pytorch#166483; measured on every release from 2.9 to 2.15 but 2.14).
    Workaround("dtensor_sequence_fold", "refusal", "https://github.com/pytorch/pytorch/pull/166483",
               ("2.9", "2.11"), ("2.9", "2.10", "2.11", "2.12", "2.13", "2.15"),
               f"{_TESTS}::test_dtensor_folds_a_split_sequence_exactly_outside_its_gate"),
    # orbax-checkpoint 0.12.8 closes the event loop of each synchronous call with reads still in flight
    # after one failed (tracebacks from `launch/ckpt.py list` of a damaged step, about half the runs).
    # No upstream report of it; the nearest is the loop orbax runs those calls on, google/orbax#481.
    # Its gate is orbax's release (0.12.8 in every venv), not torch's: on for all of ember's range.
    Workaround("orbax_pending_reads", "patch", "https://github.com/google/orbax/issues/481",
               _TESTED_RANGE, ("2.9", "2.15"), "tests/core/test_compat_orbax_loop.py"),
    # Inductor copies a `while_loop`'s aliased carried inputs (a carry whose leaves start as one tensor)
    # with an unrealized clone, then reads its strides: "NotImplementedError: Pointwise" on 2.9; 2.10 on
    # realize the copy (pytorch/pytorch#164955).
    Workaround("while_loop_aliased_carries", "patch", "https://github.com/pytorch/pytorch/pull/164955",
               ("2.9", "2.9"), ("2.9", "2.10", "2.13", "2.15"), "tests/core/test_compat_inductor_while_loop.py"),
    # A loop over DTensors runs as the Python loop on 2.9 and 2.10, as it did before it rolled
    # (`core/scan_rolled.py`): rolled, 2.10 gave a batch-split stack wrong numbers (test_scan_dtensor's
    # `batch_split`, error 0.9) and 2.9's 4-process pipeline did not finish in 23 min. With a body's literals
    # made by `full` (`compat.scan.constants_as_factories`: AOTAutograd before 2.15 refused a body's literal
    # constant, #185805), 2.11, 2.12 and 2.13 roll the DTensor suites (scan, matrix, MoE, pipeline, context
    # parallel, latent attention, the chunked loss; 2026-12-04 and 12-05); 2.15 needs neither.
    Workaround("dtensor_scan", "access", "https://github.com/pytorch/pytorch/pull/185805",
               ("2.9", "2.10"), ("2.9", "2.10", "2.11", "2.12", "2.13", "2.15"),
               "tests/partition_specs/test_scan_dtensor.py"),
    # Inductor's FX-graph cache bypasses a graph holding `scan` ("Can't cache HigherOrderOperator"; its
    # key already holds the body): a rolled step compiled anew in every process (pytorch/pytorch#149318).
    Workaround("scan_graph_cache", "patch", "https://github.com/pytorch/pytorch/issues/149318",
               _TESTED_RANGE, ("2.9", "2.13", "2.15"),
               "tests/core/test_jit_tracing.py::test_inductor_caches_no_graph_holding_scan_unless_ember_marks_it_where_gated"),
    # Inductor's C++ backend loads a transposed tile before its loop even where the tile's address holds an
    # index loaded inside that loop (a rolled layer's weight slice, transposed): g++ fails the step ("'tmp5'
    # was not declared in this scope"), torch.compile of one line too. Not on 2.9; fixed in 2.13.
    Workaround("cpp_transpose_indirect_index", "patch", "https://github.com/pytorch/pytorch/pull/178962",
               ("2.10", "2.12"), ("2.9", "2.10", "2.11", "2.12", "2.13", "2.15"),
               "tests/core/test_compat_inductor_transpose.py"),
    Workaround("jax_backend_state", "access", "https://github.com/jax-ml/jax/issues/18237",
               _TESTED_RANGE, _MEASURED, "tests/core/test_checkpoint_mesh.py"),
)}


def torch_minor() -> str:
    """`"2.15"` for torch 2.15.0+cu132: the release line a workaround was measured on."""
    major, minor = torch.__version__.split("+")[0].split(".")[:2]
    return f"{major}.{minor}"


def _as_tuple(minor: str) -> Tuple[int, int]:
    major, minor_ = minor.split(".")[:2]
    return int(major), int(minor_)


def gated_on(name: str) -> bool:
    """Whether workaround `name`'s range holds this torch (ignoring `EMBER_DISABLE_PATCHES`)."""
    first, last = WORKAROUNDS[name].torch
    return _as_tuple(first) <= _as_tuple(torch_minor()) <= _as_tuple(last)


def measured_here(name: str) -> bool:
    """Whether workaround `name`'s need was measured on this torch release (tests assert it only then)."""
    return torch_minor() in WORKAROUNDS[name].measured


_warned: set = set()


def warn_once(key: str, message: str) -> None:
    """Warn `message` the first time `key` is seen in this process."""
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def check_torch_version() -> None:
    """Warn once if this torch is outside the tested range (run when `ember.core` is imported)."""
    low, high = TESTED_TORCH
    version = torch.__version__.split("+")[0]
    if not (torch.__version__ >= low and torch.__version__ < _next_minor(high)):
        warn_once("torch_version", (
            f"ember is tested on torch {low} to {high}, but this is torch {version}. It may work; "
            f"if it fails, install a tested torch (`pip install 'torch>={low},<={high}'`)."))


def _next_minor(version: str) -> str:
    major, minor = version.split(".")[:2]
    return f"{major}.{int(minor) + 1}"


_failed: set = set()  # patches that broke a compile in this process


def patch_enabled(name: str) -> bool:
    """Whether patch `name` runs here: this torch in its range, not disabled, not failed before."""
    return gated_on(name) and name not in _failed and not _disabled() & {name, "all"}


def refuse_where_gated(name: str, message: str) -> None:
    """Raise `ValueError(message)` where refusal `name` is on: its range holds this torch and
    `EMBER_DISABLE_PATCHES` does not name it (`all` lifts patches, never a refusal)."""
    if gated_on(name) and name not in _disabled():
        raise ValueError(message)


def _disabled() -> set:
    return {n.strip() for n in os.environ.get("EMBER_DISABLE_PATCHES", "").split(",")}


def compiling_with(patches: Sequence[Tuple[str, Callable[[], ContextManager]]],
                   compile_fn: Callable[[], T], passthrough: Tuple[type, ...] = ()) -> T:
    """`compile_fn()` inside the enabled patches; if it fails with patches on, again without the culprit.

    A patch that breaks (an internal renamed, a signature changed) is found by compiling again with each
    active patch left out in turn: the first of those that succeeds names it (nothing succeeded before it,
    so no compile cache can hide the failure). It warns once, naming itself and the torch version, and
    stays off for the rest of the process; the other patches stay on. If no single patch is to blame the
    compile runs plain: its error is raised if it fails too (the patches were not the cause), else every
    active patch goes off, named. Errors of the `passthrough` types (the user's own, such as reading a
    value while tracing) are raised as is.
    """
    active = [(name, make) for name, make in patches if patch_enabled(name)]
    if not active:
        return compile_fn()
    try:
        with _entered(active):
            return compile_fn()
    except passthrough:
        raise
    except Exception as err:
        first_line = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        failure = f"{type(err).__name__}: {first_line}"
    # each patch left out in turn (one patch alone: leaving it out is the plain compile below)
    for i, (name, _) in enumerate(active if len(active) > 1 else []):
        try:
            with _entered(active[:i] + active[i + 1:]):
                result = compile_fn()
        except passthrough:
            raise
        except Exception:
            continue
        _turn_off([name], failure)
        return result
    result = compile_fn()  # raises the plain path's own error if the patches were not the cause
    _turn_off([name for name, _ in active], failure)
    return result


def _turn_off(names: Sequence[str], failure: str) -> None:
    _failed.update(names)
    warn_once(f"patch-failed:{','.join(names)}", (
        f"ember's torch patch(es) {list(names)} failed on torch {torch.__version__} ({failure}); compiled "
        f"without {'it' if len(names) == 1 else 'them'}, for the rest of this process. Set "
        f"EMBER_DISABLE_PATCHES={','.join(names)} to skip {'it' if len(names) == 1 else 'them'} from the start."))


@contextlib.contextmanager
def _entered(active: Sequence[Tuple[str, Callable[[], ContextManager]]]) -> Iterator[None]:
    with contextlib.ExitStack() as stack:
        for _, make in active:
            stack.enter_context(make())
        yield
