"""A user's pytest session: `run_on_backends` on eager, Inductor and XLA after a CPU backward pass.

Autograd sizes its per-device queues at the process's first backward pass; one that ran before the
torch_xla runtime started (an earlier test) used to break every XLA backward in the session
(pytorch/xla#4174). The user's file runs in its own pytest process, as a user's suite would: no
ember conftest, the tests in file order.
"""

import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

USER_TESTS = textwrap.dedent(
    """
    import torch
    from ember import optim
    from ember.core import TrainState, random
    from ember.core.jit import jit
    from ember.core.pytree import tree_map
    from ember.core.step_fns import cross_entropy, train_step
    from ember.core.testing import assert_pure, run_on_backends


    def test_a_cpu_backward_runs_first():
        x = torch.ones(3, requires_grad=True)
        (x * 2).sum().backward()
        assert x.grad.tolist() == [2.0, 2.0, 2.0]


    def loss_fn(params, batch, *, key):
        return cross_entropy(torch.tanh(batch["x"] @ params["w1"]) @ params["w2"], batch["y"])


    def make_state_and_batch():
        k1, k2 = random.split(random.key(0))
        params = {"w1": random.normal(k1, (4, 8)) * 0.3, "w2": random.normal(k2, (8, 3)) * 0.3}
        state = TrainState.create(params=params, tx=optim.adamw(1e-2), key=random.key(1))
        batch = {"x": random.normal(random.key(2), (4, 4)), "y": random.randint(random.key(3), (4,), 0, 3)}
        return state, batch


    def test_train_step_matches_on_every_backend():
        state, batch = make_state_and_batch()
        out = run_on_backends(train_step(loss_fn), state, batch, backends=("eager", "inductor", "xla"),
                              steps=2)
        assert int(out["xla"][0].step) == 2


    def test_a_donating_xla_step_is_pure():
        import torch_xla

        state, batch = make_state_and_batch()
        dev = torch_xla.device()
        state, batch = (tree_map(lambda t: t.to(dev) if isinstance(t, torch.Tensor) else t, tree)
                        for tree in (state, batch))
        assert_pure(jit(train_step(loss_fn), backend="xla", donate="state"), state, batch)
    """
)


@pytest.mark.xla
def test_run_on_backends_with_xla_after_a_cpu_backward_in_a_users_session(tmp_path):
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    (tmp_path / "test_user_steps.py").write_text(USER_TESTS)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_user_steps.py"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0 and "3 passed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]


def _python_block_after(readme: str, heading: str) -> str:
    return readme.split(heading, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


@pytest.mark.xla
@pytest.mark.slow
def test_the_readmes_testing_example_passes_after_a_backward_test(tmp_path):
    """The README's "Testing your steps" block, on the README's own step, in a user's session."""
    pytest.importorskip("torch_xla", reason="torch_xla is not installed (pip install -e .[xla])")
    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    backward_first = "def test_a_cpu_backward_runs_first():\n    (torch.ones(2, requires_grad=True) * 3).sum().backward()\n\n\n"
    user_file = (_python_block_after(readme, "## Composing a step").replace("print(", "_ = (")
                 + "\n\n" + backward_first + _python_block_after(readme, "## Testing your steps"))
    (tmp_path / "test_readme_steps.py").write_text(user_file)
    env = dict(os.environ, PJRT_DEVICE="CPU", CPU_NUM_DEVICES="1")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "test_readme_steps.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and "3 passed" in proc.stdout, (proc.stdout + proc.stderr)[-4000:]
