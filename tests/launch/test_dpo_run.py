"""The README's "Preference optimization" commands, shorter: `launch/tiny_chat.py` writes a Qwen2 folder and
its pairs here, `--config dpo` raises the held-out reward accuracy above chance (full weights and LoRA), the
export loads in transformers with ember's logits, the README's script runs, a resumed run repeats the bits of
one that never stopped, and bad input is one line."""

import json
import os
import pathlib
import re
import shutil
import sys

import pytest
import torch

from ember.core import pytree
from ember.core.checkpoint import CheckpointManager
from ember.launch import train
from ember.launch.build import build_model as build_run_model
from ember.launch.build import initial_state
from ember.launch.metrics_log import read_metrics
from ember.launch.run_config import parse_cli
from ember.launch.throughput import THROUGHPUT_KEYS
from ember.models import from_hf, to_lora

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))  # tests/: _processes
from _processes import run_in_own_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _readme_runs import readme_section, run_readme_commands  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("dpo_run")]

ROOT = pathlib.Path(__file__).resolve().parents[2]
SHORT = ["--steps", "40", "--eval_every", "20", "--eval_batches", "4", "--log_every", "10", "--sample_tokens", "0",
         "--backend", "eager"]
"""Appended to the README's training commands: 40 eager steps, the held-out pairs evaluated twice."""
HEADING = "## Preference optimization"


@pytest.fixture(scope="module")
def readme_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("dpo_readme")
    return root, run_readme_commands(root, HEADING, SHORT)


@pytest.mark.parametrize("run", ["runs/dpo", "runs/dpo_lora"])
def test_dpo_raises_the_held_out_reward_accuracy_above_chance(readme_runs, run):
    _, histories = readme_runs
    evals = [r for r in histories[run] if "eval_loss" in r]
    assert len(evals) == 3 and evals[0]["eval_loss"] == pytest.approx(0.6931, abs=1e-4)  # the policy is the reference
    assert evals[-1]["eval_rewards/accuracies"] > 0.6 and evals[-1]["eval_rewards/margins"] > 0, evals
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]
    trained = [r for r in histories[run] if "loss" in r]
    assert all(r["tokens"] == 4 for r in trained)  # pairs per step


def _model_metrics(row):
    """A metrics row without the throughput, time and memory keys, which differ from run to run."""
    return {k: v for k, v in row.items() if k not in THROUGHPUT_KEYS}


def test_the_full_run_holds_one_frozen_reference_and_the_lora_run_none(readme_runs):
    root, _ = readme_runs
    folder = str(root / "runs/tiny_chat/model")
    full = parse_cli("dpo", ["--init_from", folder, "--data.path", "x.jsonl"])
    lora = parse_cli("dpo", ["--init_from", folder, "--data.path", "x.jsonl", "--lora.rank", "8"])
    a, b = initial_state(full, build_run_model(full)), initial_state(lora, build_run_model(lora))
    size = lambda tree: sum(t.numel() * t.element_size() for t in {id(t): t for t in pytree.tree_leaves(tree)}.values())
    assert size(a.frozen) == size(a.params) and not hasattr(b, "frozen")  # a LoRA policy's reference is its base
    assert size(b) < size(a.params) + size(a.frozen)  # base + adapters + their moments: no second copy of the base
    with CheckpointManager(root / "runs/dpo/checkpoints", read_only=True) as saved:
        restored, *_ = saved.restore(like=a)
    assert all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(restored.frozen), pytree.tree_leaves(a.frozen)))


def test_the_lora_export_loads_in_transformers_with_embers_logits(readme_runs):
    transformers = pytest.importorskip("transformers")
    root, _ = readme_runs
    base, _ = from_hf(root / "runs/tiny_chat/model")
    model = to_lora(base, rank=8, alpha=16.0, targets=("wq", "wv"))
    with CheckpointManager(root / "runs/dpo_lora/checkpoints", read_only=True) as saved:
        params = saved.restore_params(like=model.param_shapes())
    tokens = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(0))
    theirs = transformers.AutoModelForCausalLM.from_pretrained(root / "runs/dpo_lora/hf").eval()
    with torch.no_grad():
        torch.testing.assert_close(model.apply(params, tokens), theirs(tokens).logits, rtol=0, atol=1e-4)


def test_the_readme_script_composes_the_step_by_hand(readme_runs, monkeypatch, capsys):
    root, _ = readme_runs
    section = readme_section(HEADING).split("\n## ", 1)[0]
    source = re.search(r"```python\n(.*?)```", section, re.S).group(1).replace("range(30)", "range(3)")
    monkeypatch.chdir(root)
    exec(compile(source, "dpo_by_hand.py", "exec"), {"__name__": "__main__"})
    assert re.search(r"reward accuracy \d\.\d\d, margin -?\d\.\d{3}", capsys.readouterr().out)


def test_a_resumed_dpo_run_repeats_the_bits_of_one_that_never_stopped(readme_runs, tmp_path):
    root, _ = readme_runs
    folder = str(root / "runs/tiny_chat/model")
    common = ["--config", "dpo", "--init_from", folder, "--data.path", str(root / "runs/tiny_chat/prefs.jsonl"),
              "--data.seq_len", "128", "--optim.learning_rate", "1e-4", "--backend", "eager", "--eval_every", "0",
              "--sample_tokens", "0", "--checkpoint_every", "2", "--keep", "0", "--log_every", "1"]
    train.main(common + ["--steps", "4", "--out", str(tmp_path / "straight")])
    shutil.copytree(tmp_path / "straight", tmp_path / "stopped")
    shutil.rmtree(tmp_path / "stopped" / "checkpoints" / "4")  # as if the run had stopped after step 2
    train.main(common + ["--steps", "4", "--out", str(tmp_path / "stopped"), "--resume"])
    cfg = parse_cli("dpo", ["--init_from", folder, "--data.path", "x.jsonl"])
    like = initial_state(cfg, build_run_model(cfg))
    states = []
    for run in ("straight", "stopped"):
        with CheckpointManager(tmp_path / run / "checkpoints", read_only=True) as saved:
            states.append(saved.restore(4, like=like)[0])
    assert all(torch.equal(x, y) for x, y in zip(pytree.tree_leaves(states[0]), pytree.tree_leaves(states[1])))
    rows = [[_model_metrics(json.loads(line)) for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
            for run in ("straight", "stopped")]
    assert [r["step"] for r in rows[1]] == [1, 2, 3, 4] and rows[0] == rows[1]


def test_a_reference_precomputed_once_gives_the_steps_of_the_frozen_copy(readme_runs, tmp_path):
    """`--dpo.precompute_reference` scores every pair with the starting weights before training: the same losses
    and rewards as the frozen copy, and a state that holds no reference."""
    root, _ = readme_runs
    folder = str(root / "runs/tiny_chat/model")
    pairs = tmp_path / "prefs.jsonl"  # 60 of the pairs (3 held out): scoring them all, eagerly, is what this adds
    pairs.write_text("".join((root / "runs/tiny_chat/prefs.jsonl").read_text().splitlines(keepends=True)[:60]))
    common = ["--config", "dpo", "--init_from", folder, "--data.path", str(pairs), "--data.seq_len", "128",
              "--data.batch_size", "2", "--optim.learning_rate", "1e-4", "--backend", "eager", "--steps", "3",
              "--eval_every", "3", "--eval_batches", "1", "--log_every", "1", "--sample_tokens", "0"]
    frozen = train.main(common + ["--out", str(tmp_path / "frozen")])
    precomputed = train.main(common + ["--out", str(tmp_path / "precomputed"), "--dpo.precompute_reference"])
    assert len(frozen) == len(precomputed) == 5  # 3 steps, 2 evaluations
    for a, b in zip(map(_model_metrics, frozen), map(_model_metrics, precomputed)):
        assert a.keys() == b.keys()
        for name in a:
            assert a[name] == pytest.approx(b[name], abs=2e-5), name
    cfg = parse_cli("dpo", ["--init_from", folder, "--data.path", "x.jsonl", "--dpo.precompute_reference"])
    assert not hasattr(initial_state(cfg, build_run_model(cfg)), "frozen")


def test_two_ranks_under_fsdp_equal_one_process(readme_runs, tmp_path):
    """`--nproc-per-node 2 --mesh fsdp=2` (gloo, the policy and its reference split alike, checkpoints, the
    held-out evaluation) gives one process's metrics."""
    root, _ = readme_runs
    common = ["--config", "dpo", "--init_from", str(root / "runs/tiny_chat/model"), "--data.path",
              str(root / "runs/tiny_chat/prefs.jsonl"), "--data.seq_len", "128", "--optim.learning_rate", "1e-4",
              "--backend", "eager", "--steps", "3", "--eval_every", "3", "--eval_batches", "1", "--log_every", "1",
              "--sample_tokens", "0", "--checkpoint_every", "3"]
    env = {**{k: v for k, v in os.environ.items() if k not in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS")},
           "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    for out, extra in (("one", []), ("two", ["--nproc-per-node", "2", "--mesh", "fsdp=2"])):
        proc = run_in_own_group([sys.executable, str(ROOT / "launch" / "train.py"), *common, *extra, "--out",
                                 str(tmp_path / out)], env=env, timeout=900)
        assert proc.returncode == 0, proc.stderr[-4000:]
    one, two = (read_metrics(tmp_path / out) for out in ("one", "two"))
    assert [r["step"] for r in one] == [r["step"] for r in two] == [0, 1, 2, 3, 3]
    for a, b in zip(map(_model_metrics, one), map(_model_metrics, two)):
        for name in a:
            assert a[name] == pytest.approx(b[name], abs=1e-4, rel=1e-6), name


@pytest.mark.parametrize("argv, match", [
    (["--config", "dpo", "--dpo.loss", "sigmod"], r"--dpo.loss: unknown preference loss 'sigmod'.*'sigmoid'"),
    (["--config", "llama3_tiny", "--dpo.beta", "0.5", "--dry-run"], r"--dpo\.\* flags set the objective of a run on "
                                                                     r"preference pairs, but data.source=stdlib"),
])
def test_bad_preference_flags_are_one_line(readme_runs, argv, match):
    root, _ = readme_runs
    if argv[1] == "dpo":
        argv = argv + ["--init_from", str(root / "runs/tiny_chat/model")]
    with pytest.raises(ValueError, match=match) as err:  # run_main prints it as one `error:` line, exit 2
        train.main(argv)
    assert "\n" not in str(err.value)
