"""Build one Inductor graph's C++ kernels as a few shared libraries instead of one library each.

A patch (`WORKAROUNDS["cpp_kernel_batching"]`): on inside ember's own CPU compiles, on torch 2.9 to
2.15, where it shortens the first call (BENCHMARKS.md). Inductor compiles every CPU kernel of a
graph as its own translation unit: one `g++` run each, and on this 2-core machine nearly all of a
run's 0.5 s goes to loading the 120 MB precompiled header and linking, not to the kernel. The tiny
Llama step has 35 distinct kernels: 16 s of `g++` one by one, 2.3 s as one translation unit.

While the wrapper module that Inductor generates is loaded, `AsyncCompile.cpp_pybinding` (called
once per kernel, before `AsyncCompile.wait`) only records the kernel. The first kernel asked for
builds all recorded ones: each kernel's source goes into its own C++ namespace, the kernels are
split into one group per compile worker, and each group is built, cached on disk and loaded by
Inductor's own `CppPythonBindingsCodeCache` (same flags, precompiled header, locks and worker pool)
as one Python extension exposing `kernel_0 ... kernel_n`. The generated wrapper, and so Inductor's
graph cache, is unchanged. A kernel whose source does not have the expected shape, or a group that
fails to build, is built alone the usual way.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import re
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple
from unittest import mock

__all__ = ["batched_cpu_kernels"]

_log = logging.getLogger(__name__)

_ENTRY = re.compile(r'extern\s+"C"\s+void\s+kernel\(')
_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*[<\"][^\n]*$", re.MULTILINE)

_PRELUDE = """
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cstdint>
#include <cstdlib>
#include <sstream>
#include <stdexcept>
#include <type_traits>
"""

# The Python side of the library: Inductor's calling convention (tensors by their data pointer
# through the hook Inductor exports in `_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR`, integers by value).
_BINDINGS = """
static void* (*ember_tensor_data_ptr)(PyObject* obj);

template <typename T> static inline T ember_arg(PyObject* args, Py_ssize_t n) {{
    static_assert(std::is_pointer_v<T>, "arg type must be pointer or integer");
    return static_cast<T>(ember_tensor_data_ptr(PyTuple_GET_ITEM(args, n)));
}}
template <> inline int64_t ember_arg<int64_t>(PyObject* args, Py_ssize_t n) {{
    auto result = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, n));
    if (result == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return result;
}}
template <> inline uintptr_t ember_arg<uintptr_t>(PyObject* args, Py_ssize_t n) {{
    auto result = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, n));
    if (result == reinterpret_cast<void*>(-1) && PyErr_Occurred())
        throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(result);
}}

{wrappers}

static PyMethodDef ember_methods[] = {{
{methods}
    {{NULL, NULL, 0, NULL}}}};

static struct PyModuleDef ember_module = {{PyModuleDef_HEAD_INIT, "kernel", NULL, -1, ember_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR must be set");
        return nullptr;
    }}
    std::istringstream parse(address);
    uintptr_t value = 0;
    parse >> value;
    ember_tensor_data_ptr = reinterpret_cast<decltype(ember_tensor_data_ptr)>(value);
    return PyModule_Create(&ember_module);
}}
"""

_WRAPPER = """
static PyObject* kernel_{i}_py(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes a tuple of {n} arguments");
        ember_k{i}::kernel({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unhandled C++ exception");
        return nullptr;
    }}
}}
"""


class _Kernel:
    """One recorded kernel: its argument types and source, then the callable once built."""

    def __init__(self, argtypes: Sequence[str], source: str) -> None:
        self.argtypes = list(argtypes)
        self.source = source
        self.fn: Optional[Callable[..., Any]] = None


def batchable(source: str) -> bool:
    """Whether a kernel source has the one `extern "C" void kernel(` entry this module renames."""
    return len(_ENTRY.findall(source)) == 1


def combined_source(kernels: Sequence[_Kernel]) -> str:
    """One translation unit: the kernels' includes once, each kernel in `namespace ember_k<i>`,
    then a Python module whose `kernel_<i>` calls kernel i."""
    includes: Dict[str, None] = {}
    bodies, wrappers, methods = [], [], []
    for i, k in enumerate(kernels):
        for line in _INCLUDE.findall(k.source):
            includes[line.strip()] = None
        body = _ENTRY.sub("void kernel(", _INCLUDE.sub("", k.source))
        bodies.append(f"namespace ember_k{i} {{\n{body}\n}}  // namespace ember_k{i}\n")
        args = ", ".join(f"ember_arg<{t.replace('const ', '')}>(args, {n})"
                         for n, t in enumerate(k.argtypes))
        wrappers.append(_WRAPPER.format(i=i, n=len(k.argtypes), args=args))
        methods.append(f'    {{"kernel_{i}", kernel_{i}_py, METH_VARARGS, ""}},')
    return "\n".join([*includes, _PRELUDE, *bodies,
                      _BINDINGS.format(wrappers="".join(wrappers), methods="\n".join(methods))])


def split_evenly(kernels: Sequence[_Kernel], groups: int) -> List[List[_Kernel]]:
    """Consecutive groups of about equal source length (deterministic, so the disk cache hits)."""
    groups = max(1, min(groups, len(kernels)))
    total = sum(len(k.source) for k in kernels)
    out: List[List[_Kernel]] = [[]]
    done = 0
    for k in kernels:
        if out[-1] and len(out) < groups and done >= total * len(out) / groups:
            out.append([])
        out[-1].append(k)
        done += len(k.source)
    return out


class _Batch:
    """The kernels one generated module records; built together when the first one is needed."""

    def __init__(self) -> None:
        # Keyed by (argument types, source): identical kernels (one per layer) are built once.
        self.kernels: Dict[Tuple[Tuple[str, ...], str], _Kernel] = {}
        self.built = False

    def add(self, argtypes: Sequence[str], source: str) -> _Kernel:
        key = (tuple(argtypes), source)
        if key not in self.kernels:
            self.kernels[key] = _Kernel(argtypes, source)
        return self.kernels[key]

    def build(self) -> None:
        from torch._inductor.async_compile import AsyncCompile, get_compile_threads
        from torch._inductor.codecache import CppPythonBindingsCodeCache

        self.built = True
        threads = get_compile_threads()
        submit = AsyncCompile.submit if threads > 1 else None
        groups = split_evenly(list(self.kernels.values()), threads)
        bindings = _torch_classes()[0]
        loads = [bindings.load_async(combined_source(g), submit_fn=submit) for g in groups]
        for group, load in zip(groups, loads):
            try:
                module = load()
                for i, k in enumerate(group):
                    k.fn = getattr(module, f"kernel_{i}")
            except Exception as err:  # built one by one below, which reports a real error itself
                _log.warning("ember: building %d Inductor kernels together failed (%s: %s); "
                             "building them one by one", len(group), type(err).__name__, err)
                for k in group:
                    k.fn = CppPythonBindingsCodeCache.load_pybinding(k.argtypes, k.source)


@functools.lru_cache(maxsize=1)
def _torch_classes() -> Tuple[Any, Any]:
    """(group bindings cache, future of one kernel), subclasses of Inductor's own."""
    from torch._inductor.codecache import CodeCacheFuture, CppPythonBindingsCodeCache

    class GroupBindings(CppPythonBindingsCodeCache):
        """Inductor's C++ binding cache, for a source that already holds its Python module."""

        cache: Dict[str, Any] = {}
        cache_clear = staticmethod(cache.clear)

    class BatchedKernel(CodeCacheFuture):
        """What `cpp_pybinding` returns: `AsyncCompile.wait` swaps it for the built kernel."""

        def __init__(self, batch: _Batch, kernel: _Kernel) -> None:
            self.batch, self.kernel = batch, kernel

        def result(self, *_: Any, **__: Any) -> Callable[..., Any]:  # torch 2.15 passes timeout=
            if not self.batch.built:
                self.batch.build()
            assert self.kernel.fn is not None
            return self.kernel.fn

        def __call__(self, *args: Any) -> Any:  # with one compile thread, `wait` swaps nothing
            return self.result()(*args)

    return GroupBindings, BatchedKernel


@contextlib.contextmanager
def batched_cpu_kernels() -> Iterator[None]:
    """Within the block, each generated Inductor module builds its C++ kernels in a few groups."""
    try:
        from torch._inductor.async_compile import AsyncCompile

        plain = AsyncCompile.cpp_pybinding
        future = _torch_classes()[1]
    except (AttributeError, ImportError):  # another torch's internals: one library per kernel
        yield
        return

    def cpp_pybinding(self: Any, argtypes: List[str], source_code: str) -> Any:
        if not batchable(source_code):
            return plain(self, argtypes, source_code)
        batch = getattr(self, "_ember_kernel_batch", None)
        if batch is None or batch.built:  # one batch per generated module (its AsyncCompile)
            batch = self._ember_kernel_batch = _Batch()
        return future(batch, batch.add(argtypes, source_code))

    with mock.patch.object(AsyncCompile, "cpp_pybinding", cpp_pybinding):
        yield
