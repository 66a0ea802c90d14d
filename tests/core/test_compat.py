"""ember.core.compat: every use of another project's internals is listed, gated, tested, and safe to fail.

Each `WORKAROUNDS` entry names a test; the tests here fail when a torch release makes an entry
unnecessary (then drop it or narrow its gate) or breaks it.
"""

import contextlib
import importlib.util
import inspect
import io
import json
import pathlib
import re
import subprocess
import sys
import textwrap
import tokenize
import warnings
from contextlib import contextmanager
from unittest import mock

import pytest
import torch

import ember.core.compat as compat
from ember.core import jit
from ember.core.compat import WORKAROUNDS, gated_on, measured_here, patch_enabled
from isa_probe_counter import COUNT_ISA_PROBES

ROOT = pathlib.Path(__file__).resolve().parents[2]
# A private name: `torch._x`, a private module anywhere under torch (`torch.distributed._x`; aten op names
# under `torch.ops` are not modules), torch_xla's and jax's private parts.
PRIVATE = re.compile(r"\btorch\.(?!ops\.)(?:\w+\.)*(?!_foreach_|__)_\w|torch_xla\._|\b_XLAC\b|jax\._src")


def _code_without_strings(path: pathlib.Path) -> list:
    """(line number, code) of every token that is neither a string nor a comment."""
    tokens = tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
    kept = {}
    for tok in tokens:
        if tok.type not in (tokenize.STRING, tokenize.COMMENT):
            kept.setdefault(tok.start[0], []).append(tok.string)
    return [(n, " ".join(parts).replace(" . ", ".")) for n, parts in kept.items()]


def test_no_private_names_outside_the_compat_package():
    found = []
    for folder in ("core", "models", "optim", "data", "launch"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            if (ROOT / "core" / "compat") in path.parents:
                continue
            found += [f"{path.relative_to(ROOT)}:{n}: {code}" for n, code in _code_without_strings(path)
                      if PRIVATE.search(code)]
    assert not found, "private torch / torch_xla / jax names outside core/compat:\n" + "\n".join(found)


@pytest.mark.parametrize("name", sorted(WORKAROUNDS))
def test_every_workaround_names_its_upstream_gate_and_test(name):
    w = WORKAROUNDS[name]
    assert w.kind in ("patch", "access", "refusal")
    assert re.fullmatch(r"https://github\.com/[\w-]+/[\w-]+/(issues|pull)/\d+", w.upstream), w.upstream
    first, last = w.torch
    assert first in w.measured and last in w.measured, "a range ends where it was measured"
    assert set(w.measured) <= {"2.9", "2.10", "2.11", "2.12", "2.13", "2.14", "2.15"}, "measured only on releases a CI line or a note tests"
    file, _, test = w.test.partition("::")
    source = (ROOT / file).read_text()
    assert not test or f"def {test}(" in source, f"{w.test} does not exist"


def test_a_patch_runs_on_every_release_of_its_range_and_nowhere_else(monkeypatch):
    first, last = WORKAROUNDS["cpp_kernel_batching"].torch
    for version, inside in [("2.8.1", False), (f"{first}.0+cpu", True), ("2.12.0+cu130", True),
                            (f"{last}.1", True), ("2.99.0", False)]:
        monkeypatch.setattr(torch, "__version__", version)
        assert patch_enabled("cpp_kernel_batching") is inside, version
    monkeypatch.setattr(torch, "__version__", "2.9.0+cpu")
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "frees_after_last_read,cpp_kernel_batching")
    assert not patch_enabled("cpp_kernel_batching")
    monkeypatch.setenv("EMBER_DISABLE_PATCHES", "all")
    assert not patch_enabled("vec_isa_probe_memo")


@pytest.mark.parametrize("version, warns", [("2.8.1", True), ("2.9.0", False), ("2.12.0+cu130", False),
                                            ("2.15.0+cu132", False), ("2.16.0", True)])
def test_a_torch_outside_the_tested_range_warns_once(monkeypatch, version, warns):
    monkeypatch.setattr(torch, "__version__", torch.torch_version.TorchVersion(version))
    monkeypatch.setattr(compat, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compat.check_torch_version()
        compat.check_torch_version()
    messages = [str(w.message) for w in caught]
    assert len(messages) == int(warns), messages
    if warns:
        assert "tested on torch 2.9.0 to 2.15.0" in messages[0] and version.split("+")[0] in messages[0]


@contextmanager
def _inductor_codegen_breaks():
    """A stand-in for a patch that meets an Inductor it does not know: codegen raises inside it."""
    def broken(*args, **kwargs):
        raise TypeError("result() got an unexpected keyword argument 'timeout'")

    with mock.patch("torch._inductor.graph.GraphLowering.codegen", broken):
        yield


def test_a_failing_patch_warns_once_and_the_step_still_compiles(monkeypatch, tmp_path):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # compile for real, not from the cache
    monkeypatch.setattr(compat, "_failed", set())
    monkeypatch.setattr(compat, "_warned", set())
    monkeypatch.setattr("ember.core.jit_backends.traced.batched_cpu_kernels", _inductor_codegen_breaks)
    others = [name for name, w in WORKAROUNDS.items() if w.kind == "patch" and name != "cpp_kernel_batching"
              and patch_enabled(name)]
    assert patch_enabled("cpp_kernel_batching")
    with pytest.warns(RuntimeWarning, match=r"patch\(es\) \['cpp_kernel_batching'\] failed on torch "
                                            r".*unexpected keyword argument 'timeout'.*"
                                            r"EMBER_DISABLE_PATCHES=cpp_kernel_batching to"):
        out = jit(lambda x: (x * 3).sin())(torch.ones(4))
    torch.testing.assert_close(out, torch.ones(4).mul(3).sin())
    assert not patch_enabled("cpp_kernel_batching")  # off for the rest of the process: no second try
    assert [name for name in others if patch_enabled(name)] == others  # the culprit alone is off
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        torch.testing.assert_close(jit(lambda x: x.cos() * 2)(torch.ones(3)), torch.ones(3).cos() * 2)


_PATCHES = ["cpp_kernel_batching", "shared_subgraph", "gloo_all_gather_out"]  # on from torch 2.9 to 2.15
_CASES = {  # which patches entered make the compile fail -> the patches turned off
    "one breaks": (lambda on: "shared_subgraph" in on, ["shared_subgraph"]),
    "two clash": (lambda on: {"cpp_kernel_batching", "shared_subgraph"} <= on, ["cpp_kernel_batching"]),
    "two break": (lambda on: bool(on & {"cpp_kernel_batching", "shared_subgraph"}), _PATCHES),
}


@pytest.mark.parametrize("case", _CASES)
def test_compiling_with_turns_off_the_failing_patch_alone(monkeypatch, case):
    """After a failure each patch is left out in turn: the first whose absence compiles is named and goes
    off (of two that clash, the first), the rest stay on, and the result is that compile; where no single
    patch is to blame, every patch goes off, named, and the plain compile is the result."""
    monkeypatch.setattr(compat, "_failed", set())
    monkeypatch.setattr(compat, "_warned", set())
    fails, off = _CASES[case]
    assert all(patch_enabled(n) for n in _PATCHES)
    entered = []

    def patch(name):
        @contextmanager
        def enter():
            entered.append(name)
            try:
                yield
            finally:
                entered.remove(name)
        return name, enter

    def compile_fn():
        if fails(set(entered)):
            raise TypeError("an internal changed its signature")
        return list(entered)

    with pytest.warns(RuntimeWarning, match=re.escape(f"patch(es) {off} failed") +
                      r".*TypeError: an internal changed its signature"):
        got = compat.compiling_with([patch(n) for n in _PATCHES], compile_fn)
    kept = [n for n in _PATCHES if n not in off]
    assert got == kept and compat._failed == set(off)
    assert [n for n in _PATCHES if patch_enabled(n)] == kept


def test_a_compile_that_fails_without_patches_raises_its_own_error_and_blames_none(monkeypatch):
    monkeypatch.setattr(compat, "_failed", set())
    patches = [(n, contextlib.nullcontext) for n in _PATCHES]

    def compile_fn():
        raise RuntimeError("the step's own error")

    with pytest.raises(RuntimeError, match="the step's own error"):
        compat.compiling_with(patches, compile_fn)
    assert not compat._failed


def test_an_error_of_the_step_itself_is_not_blamed_on_a_patch(monkeypatch):
    monkeypatch.setattr(compat, "_failed", set())
    with pytest.raises(RuntimeError, match="reads a tensor's value"):
        jit(lambda x: x * x.sum().item())(torch.ones(3))
    assert not compat._failed


_ISA_CHILD = COUNT_ISA_PROBES + textwrap.dedent("""
    import json
    isa.valid_vec_isa_list()
    print(json.dumps({"probes": len(probes)}))
""")



@pytest.mark.slow
def test_isa_memo_is_needed_exactly_where_gated(tmp_path):
    """Plain Inductor, two processes on one cache: the second repeats its ISA subprocesses exactly
    where ember's memo is gated on. If this fails on a gated torch, that release remembers them."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no vector ISA for Inductor to check")
    if not measured_here("vec_isa_probe_memo"):
        pytest.skip("not measured on this torch: the memo's own tests check its results")
    env = {"PATH": "/usr/bin:/bin", "TORCHINDUCTOR_CACHE_DIR": str(tmp_path)}
    runs = [json.loads(subprocess.run([sys.executable, "-c", _ISA_CHILD], env=env, capture_output=True,
                                      text=True, check=True).stdout.strip().splitlines()[-1])
            for _ in range(2)]
    assert runs[0]["probes"] > 0
    assert (runs[1]["probes"] > 0) == gated_on("vec_isa_probe_memo"), runs


def test_traced_inductor_names_exist():
    """The names `compat/inductor.py` reaches, and no public replacement yet (pytorch/pytorch#188734)."""
    assert callable(torch._TorchCompileInductorWrapper)
    assert isinstance(torch.compiler._is_compiling_flag, bool)
    from torch._dynamo.utils import counters
    from torch._guards import TracingContext, tracing  # noqa: F401
    from torch._subclasses.fake_tensor import DataDependentOutputException, FakeTensorMode  # noqa: F401

    assert "unique_graphs" in counters["stats"] or isinstance(counters["stats"], dict)
    assert "tracer" not in inspect.signature(torch.compile).parameters, (
        "torch.compile takes a tracer now: try it in place of compat/inductor.py's make_fx path")


def test_pytree_has_no_public_module():
    assert importlib.util.find_spec("torch.utils.pytree") is None, (
        "torch ships a public pytree module now: build core/pytree.py on it and drop compat/pytree.py")


def test_functional_collectives_are_still_private():
    import torch.distributed as dist

    assert not hasattr(dist, "functional_collectives") and importlib.util.find_spec(
        "torch.distributed.functional_collectives") is None, (
        "torch released its functional collectives: import them there and drop compat/functional_collectives.py")
    from ember.core.compat import functional_collectives as funcol

    assert all(callable(getattr(funcol, n)) for n in funcol.__all__)


def test_cuda_memory_history_is_still_private():
    memory = torch.cuda.memory
    assert not hasattr(memory, "record_memory_history") and not hasattr(memory, "dump_snapshot"), (
        "torch made the memory history public: call it there and drop compat/cuda_memory.py")
    assert callable(memory._record_memory_history) and callable(memory._dump_snapshot)


def test_dispatch_modes_are_still_private():
    import torch.overrides

    assert not hasattr(torch.overrides, "TorchDispatchMode"), (
        "torch ships TorchDispatchMode publicly: import it there and drop compat/dispatch_mode.py")


def test_dtensor_folds_a_split_sequence_exactly_outside_its_gate(tmp_path):
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("cp",))
        x = distribute_tensor(torch.randn(2, 4, 3), mesh, [Shard(1)])  # (B, T, d), T split
        w = distribute_tensor(torch.randn(5, 3), mesh, [Replicate()])
        try:
            folds = tuple(torch.nn.functional.linear(x, w).shape) == (2, 4, 5)
        except RuntimeError:
            folds = False
    finally:
        dist.destroy_process_group()
    assert folds != gated_on("dtensor_sequence_fold"), f"torch {torch.__version__}: move the gate's range"


def test_checkpoint_still_fails_under_func_grad():
    """Why remat runs plainly inside a torch.func transform (compat/functorch.py): torch's own
    checkpoint does not run under `torch.func.grad` either. When it does, remat can recompute there."""
    import torch.utils.checkpoint as ckpt

    if not measured_here("functorch_levels"):
        pytest.skip("not measured on this torch: the remat tests check its results")

    def loss(w, x):
        return ckpt.checkpoint(lambda w, x: (x @ w).tanh().sum(), w, x, use_reentrant=False)

    with pytest.raises(Exception, match="saved tensor hooks|saved_tensors_hooks"):
        torch.func.grad(loss)(torch.ones(3, 3), torch.ones(2, 3))


_DTENSOR_CHILD = textwrap.dedent("""
    import json, torch
    from torch.distributed.tensor import DTensor
    prop = DTensor._op_dispatcher.sharding_propagator
    per_dim = getattr(prop, "op_single_dim_strategy_funcs", {})
    sdpa = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
    gather = torch.ops.aten.gather.default
    src = __import__("inspect").getsource(per_dim[gather].func) if gather in per_dim else ""
    print(json.dumps({"sdpa_cpu_rule": sdpa in prop.op_strategy_funcs or sdpa in per_dim,
                      "gather_offers_mask_partial": "_MaskPartial" in src or gather in prop.op_strategy_funcs}))
""")


def test_dtensor_rules_are_still_missing():
    """Plain torch still lacks a CPU SDPA rule and still offers gather a masked-partial output."""
    if not measured_here("dtensor_rules"):
        pytest.skip("not measured on this torch: the DTensor tests check the rules' results")
    out = subprocess.run([sys.executable, "-c", _DTENSOR_CHILD], capture_output=True, text=True, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"sdpa_cpu_rule": False, "gather_offers_mask_partial": True}, got


def test_the_masked_partial_placement_is_found_on_every_release():
    """Its name and module moved twice (2.9, 2.10, 2.11): the gather rule must find it on each."""
    from torch.distributed.tensor import Partial

    from ember.core.compat.dtensor_rules import mask_partial_class

    assert issubclass(mask_partial_class(), Partial) and "MaskPartial" in mask_partial_class().__name__


def test_deterministic_algorithms_still_write_inductor_config():
    from ember.core.compat.inductor_deterministic import inductor_deterministic, kept_inductor_deterministic

    before = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled())
    if inductor_deterministic() is None:  # torch 2.9 has no such setting: nothing to keep, nothing gated
        with kept_inductor_deterministic():
            torch.use_deterministic_algorithms(True)
        torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])
        assert not gated_on("inductor_deterministic")
        return
    mine = "the user's own value"
    from torch._inductor import config

    saved, config.deterministic = config.deterministic, mine
    try:
        with kept_inductor_deterministic():
            torch.use_deterministic_algorithms(True)
            torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])
        kept = inductor_deterministic()
        torch.use_deterministic_algorithms(*before[:1], warn_only=before[1])
        overwritten = inductor_deterministic() != mine
    finally:
        config.deterministic = saved
    if gated_on("inductor_deterministic"):
        assert kept == mine
    if measured_here("inductor_deterministic"):
        assert overwritten, "torch no longer writes Inductor's deterministic setting: drop the entry"


def test_grouped_mm_float32_traces_exactly_outside_its_gate():
    """A trace of the grouped GEMM (fake tensors, as `jit` traces a step) takes float32 exactly where
    `grouped_mm_float32` is off; eagerly it is exact on every release, and bfloat16 traces everywhere."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from ember.core.compat.grouped_mm import grouped_mm

    x, w = torch.randn(12, 8), torch.randn(3, 8, 16)
    ends = torch.tensor([4, 4, 10], dtype=torch.int32)
    expected = torch.cat([x[:4] @ w[0], x[4:10] @ w[2]])
    assert torch.equal(grouped_mm(x, w, ends)[:10], expected)
    make_fx(grouped_mm, tracing_mode="fake")(x.bfloat16(), w.bfloat16(), ends)
    if not measured_here("grouped_mm_float32"):
        pytest.skip("not measured on this torch: the MoE tests check its results")
    try:
        make_fx(grouped_mm, tracing_mode="fake")(x, w, ends)
        traced = True
    except RuntimeError as error:
        assert "BF16" in str(error), error
        traced = False
    assert traced != gated_on("grouped_mm_float32")
