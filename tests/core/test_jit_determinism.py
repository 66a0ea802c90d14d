"""A compiled step is a pure function, bit for bit: repeated calls on the same state and batch give
`torch.equal` outputs on a multi-threaded CPU (an embedding's backward, dropout and keys included).

Runs in a fresh process with 2 threads and without the suite's global deterministic setting, so
only `jit`'s own scoped setting is in force.
"""

import json
import subprocess
import sys
import textwrap

import pytest

_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    torch.set_num_threads(2)
    from ember import optim
    from ember.core import TrainState, jit, random
    from ember.core.step_fns import cross_entropy, train_step
    from ember.core.pytree import tree_leaves
    from ember.models import build_model

    deterministic = sys.argv[1] == "1"
    model = build_model("gpt2", "tiny", dropout=0.1, vocab_size=512, n_layers=1)
    tx = optim.adamw(1e-3)
    start = TrainState.create(params=model.init(random.key(0)), tx=tx, key=random.key(1))

    def loss_fn(params, batch, *, key):
        return cross_entropy(model.apply(params, batch["inputs"], key=key), batch["targets"])

    step = jit(train_step(loss_fn), deterministic=deterministic)
    g = torch.Generator().manual_seed(0)
    batch = {"inputs": torch.randint(0, 512, (8, 64), generator=g),
             "targets": torch.randint(0, 512, (8, 64), generator=g)}
    first = None
    differing = 0
    for _ in range(12):
        leaves = [t for t in tree_leaves(step(start, batch)) if isinstance(t, torch.Tensor)]
        if first is None:
            first = leaves
        else:
            differing += any(not torch.equal(a, b) for a, b in zip(first, leaves))
    print(json.dumps({"differing_calls": differing, "compiles": step.compile_count}))
""")


def _run(deterministic: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, deterministic], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_repeated_calls_of_a_compiled_step_give_the_same_bits():
    got = _run("1")
    assert got == {"differing_calls": 0, "compiles": 1}, got


# --- what jit(deterministic=True) puts in force, checked on CPU (the GPU checks are marked gpu) ---

import logging  # noqa: E402
import threading  # noqa: E402

import torch  # noqa: E402
from torch.nn.attention import SDPBackend  # noqa: E402

from ember.core import jit  # noqa: E402
from ember.core.jit_backends import determinism  # noqa: E402

USER_SETTINGS = [  # (deterministic algorithms, warn_only, flash SDPA enabled)
    (False, False, True),
    (True, True, True),
    (True, True, False),
]


def _settings() -> tuple:
    return (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
            torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.cudnn_sdp_enabled(),
            torch.utils.deterministic.fill_uninitialized_memory)


@pytest.mark.parametrize("enabled,warn_only,flash", USER_SETTINGS, ids=["off", "warn_only", "warn_only_no_flash"])
def test_a_deterministic_step_is_strict_inside_and_restores_the_users_settings(enabled, warn_only, flash):
    seen = []

    def step(x):
        seen.append(_settings())  # runs while the step is traced: the settings the graph is made under
        return x * 2

    before = _settings()
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cuda.enable_flash_sdp(flash)
    try:
        user = _settings()
        jit(step)(torch.ones(3))
        after = _settings()
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        torch.backends.cuda.enable_flash_sdp(before[2])
    # strict, cuDNN attention off, the user's flash choice kept, no NaN filling of fresh buffers
    assert seen == [(True, False, flash, False, False)]
    assert after == user


def test_the_sdpa_backends_under_deterministic_have_deterministic_backward_passes():
    with determinism.deterministic_algorithms():
        inside = determinism.deterministic_sdpa_backends()
        cudnn = torch.backends.cuda.cudnn_sdp_enabled()
    assert inside == [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
    assert not cudnn
    assert torch.backends.cuda.cudnn_sdp_enabled()  # as torch starts: all on again after the scope


def test_a_nested_scope_or_another_threads_leaves_the_outer_scopes_settings_in_force():
    user = _settings()
    with determinism.deterministic_algorithms():
        inside = _settings()
        with determinism.deterministic_algorithms():  # a jitted function called by another's Python
            assert _settings() == inside
        assert _settings() == inside

        def enter_and_leave():
            with determinism.deterministic_algorithms():
                pass

        worker = threading.Thread(target=enter_and_leave)
        worker.start()
        worker.join()
        assert _settings() == inside  # the settings are the process's: a thread restores what it found
    assert _settings() == user


def test_deterministic_false_leaves_every_setting_as_the_user_has_it():
    seen = []

    def step(x):
        seen.append(_settings())
        return x + 1

    user = _settings()
    jit(step, deterministic=False)(torch.ones(3))
    assert seen == [user]


def test_an_op_without_a_deterministic_kernel_is_named_with_the_fix():
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(RuntimeError) as raised:
            torch.zeros(3).put_(torch.tensor([0]), torch.tensor([1.0]))  # no deterministic kernel anywhere
    finally:
        torch.use_deterministic_algorithms(True, warn_only=True)  # the suite's setting (conftest)
    err = determinism.determinism_error(raised.value, "cuda")
    assert err is not None and "\n" not in str(err)
    assert "put_" in str(err) and "deterministic=False" in str(err)
    assert determinism.determinism_error(RuntimeError("shapes do not match"), "cuda") is None


def test_the_gpu_notice_is_one_line_logged_once_per_process(monkeypatch, caplog):
    monkeypatch.setattr(determinism, "_noticed", set())
    with caplog.at_level(logging.WARNING, logger="ember"):
        first = determinism.notice_once("cuda")
        again = determinism.notice_once("cuda")
        on_cpu = determinism.notice_once("cpu")
    assert first is not None and "\n" not in first and "deterministic=False" in first
    assert again is None and on_cpu is None
    assert [r.getMessage() for r in caplog.records] == [first]


def test_cublas_workspace_config_is_set_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert determinism.ensure_cublas_workspace_config() == ":4096:8"
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    assert determinism.ensure_cublas_workspace_config() == ":16:8"


_GPU_CHILD = textwrap.dedent("""
    import json, sys
    import torch
    from ember import optim
    from ember.core import TrainState, jit, random, to_device
    from ember.core.step_fns import cross_entropy, train_step
    from ember.core.pytree import tree_leaves
    from ember.models import build_model

    model = build_model("llama3", "tiny", vocab_size=512)
    tx = optim.adamw(1e-3)
    params = to_device(model.init(random.key(0)), "cuda")
    start = TrainState.create(params=params, tx=tx, key=random.key(1, device="cuda"))

    def loss_fn(params, batch, *, key):
        return cross_entropy(model.apply(params, batch["inputs"]), batch["targets"])

    step = jit(train_step(loss_fn, compute_dtype=torch.bfloat16))
    g = torch.Generator().manual_seed(0)
    batch = {k: torch.randint(0, 512, (8, 128), generator=g).cuda() for k in ("inputs", "targets")}
    runs = [[t.cpu() for t in tree_leaves(step(start, batch)) if isinstance(t, torch.Tensor)] for _ in range(2)]
    same = all(torch.equal(a, b) for a, b in zip(*runs))
    print(json.dumps({"same_bits": same, "compiles": step.compile_count}))
""")


@pytest.mark.gpu
def test_a_compiled_llama3_step_repeats_bit_for_bit_on_cuda():
    proc = subprocess.run([sys.executable, "-c", _GPU_CHILD], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"same_bits": True, "compiles": 1}
    assert proc.stderr.count("ember: jit(deterministic=True) on cuda") == 1  # the notice, once
