"""Help texts, errors and the README name what the registries hold (mesh axes, model families), and the
cases that used to pass silently say so: ep on a dense model, --data.source stdlib with a path, an eager
first step, tpu_pod's --out without --checkpoint_every; torch's CPU noise is filtered at its source."""

import logging
import pathlib
import re
import warnings

import pytest

from ember import models
from ember.core.mesh import Mesh
from ember.core.partition_specs import MESH_ORDER, ShardingRuleError, for_mesh
from ember.launch import cli, sharded
from ember.launch.quiet import NOISE, quiet_known_noise
from ember.models.hf import _ADAPTERS, from_hf

ROOT = pathlib.Path(__file__).resolve().parents[2]
NUMBERS = {6: "Six", 7: "Seven", 8: "Eight", 9: "Nine", 10: "Ten", 11: "Eleven", 12: "Twelve"}


def test_mesh_help_and_tpu_pod_error_name_every_axis_the_layout_uses(capsys):
    for_mesh(MESH_ORDER)  # the ready-made layout takes every axis of MESH_ORDER
    mesh_help = next(a.help for a in cli.launcher_parser()._actions if "--mesh" in a.option_strings)
    from ember.launch import tpu_pod

    with pytest.raises(SystemExit):
        tpu_pod.main([])
    error = capsys.readouterr().err
    for text in (mesh_help, error):
        assert f"axes {', '.join(MESH_ORDER)};" in text, text


def native_families():
    """Families whose config class is ember's own (a test may have registered one of its own before)."""
    return [f for f in models.list_families()
            if type(models.get_config(f, models.list_archs(f)[0])).__module__.startswith("ember.models.")]


def test_readme_and_from_hf_name_every_native_family_and_each_has_an_hf_adapter():
    families = native_families()
    readme = (ROOT / "README.md").read_text()
    sentence = re.search(r"(\w+) families are native: (.*?)each with", readme, re.S)
    assert sentence and sentence.group(1) == NUMBERS[len(families)], sentence and sentence.group(0)
    assert sorted(re.findall(r"`(\w+)`", sentence.group(2))) == sorted(families)
    assert sorted(re.findall(r"`(\w+)`", from_hf.__doc__.split("become native")[0])) == sorted(families)
    # `launch/ckpt.py export --hf` says "any native family": each family has a Hugging Face adapter
    with_adapter = {a.config_cls for a in _ADAPTERS.values()}
    assert [f for f in families if type(models.get_config(f, models.list_archs(f)[0])) not in with_adapter] == []


def test_ep_on_a_dense_model_says_it_is_data_parallel_and_experts_that_do_not_split_are_refused():
    said = []
    dense, moe = models.build_model("llama3", "tiny"), models.build_model("qwen3_moe", "tiny")
    sharded.check_mesh("eager", Mesh.parse("ep=2", devices=2, backend="dtensor"), dense, say=said.append)
    assert len(said) == 1 and "this model has none: ep acts as one more data-parallel axis" in said[0]
    sharded.check_mesh("eager", Mesh.parse("ep=2", devices=2, backend="dtensor"), moe, say=said.append)
    assert len(said) == 1  # a model with experts: no notice
    experts = moe.config.n_experts
    with pytest.raises(ShardingRuleError, match=f"{experts} experts do not split evenly over ep=3"):
        sharded.check_mesh("eager", Mesh.parse("ep=3", devices=3, backend="dtensor"), moe, say=said.append)


def test_cp_with_experts_or_a_sequence_that_does_not_split_is_refused_before_any_rank_starts():
    mesh = Mesh.parse("cp=2", devices=2, backend="dtensor")
    moe = models.build_model("qwen3_moe", "tiny")
    with pytest.raises(ValueError, match="cp does not run mixture-of-experts models yet"):
        sharded.check_mesh("eager", mesh, moe, say=print, seq_len=32)
    with pytest.raises(ValueError, match=r"multiple of 4 \(--data.seq_len\)"):
        sharded.check_mesh("eager", mesh, models.build_model("llama3", "tiny"), say=print, seq_len=30)


def test_data_source_stdlib_with_a_path_is_refused_and_a_path_alone_names_its_source(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("hello\n" * 100)
    args, overrides = cli.launcher_parser().parse_known_args(["--data.source", "stdlib", "--data.path", str(corpus)])
    with pytest.raises(ValueError, match="--data.source stdlib reads the embedded corpus and no path"):
        cli.read_config(args, overrides, description="")
    args, overrides = cli.launcher_parser().parse_known_args(["--data.path", str(corpus)])
    assert cli.read_config(args, overrides, description="").data.source == "text"


def test_an_eager_first_step_is_not_said_to_compile(capsys):
    import torch

    from ember.launch.loop import train_loop
    from ember.launch.metrics_log import MetricsWriter

    def step(state, batch):
        return state, {"loss": torch.tensor(1.0)}

    class State:
        step = torch.tensor(0)

    for compiled, first_line in ((False, "step 1: eager (not compiled)... ran in"),
                                 (True, "step 1: compiling the step... compiled and ran in")):
        train_loop(step, State(), iter([0] * 2), steps=1, writer=MetricsWriter(None), progress=True, compiled=compiled)
        assert capsys.readouterr().out.startswith(first_line)


def test_tpu_pod_out_without_checkpoint_every_checkpoints_at_the_end(capsys):
    from ember.launch import tpu_pod
    from ember.launch.run_config import get_config

    cfg = tpu_pod._checkpoints_at_the_end(get_config("llama3_tiny").__class__(out="runs/pod"), ["--out", "runs/pod"])
    assert cfg.checkpoint_every == 0 and "checkpoints: at the end, in runs/pod/checkpoints" in capsys.readouterr().out
    assert tpu_pod._checkpoints_at_the_end(cfg.__class__(out=None), []).checkpoint_every == -1
    # the run config's own out (no --out given) writes nothing, as before
    assert tpu_pod._checkpoints_at_the_end(cfg.__class__(out="runs/default"), []).checkpoint_every == -1


def test_known_noise_is_filtered_at_its_source_and_other_lines_are_not(caplog):
    quiet_known_noise()
    logger = logging.getLogger("torch.utils.cpp_extension")
    with caplog.at_level(logging.WARNING, logger="torch.utils.cpp_extension"):
        logger.warning("No CUDA runtime is found, using CUDA_HOME='%s'", "/usr/local")
        logger.warning("another warning")
    assert [r.getMessage() for r in caplog.records] == ["another warning"]
    with warnings.catch_warnings(record=True) as seen:
        quiet_known_noise()  # inside catch_warnings, whose filters were reset
        warnings.warn(f"{NOISE[1]}, we are implicitly creating a replicated DTensor for it.", UserWarning)
        warnings.warn("a real problem", UserWarning)
    assert [str(w.message) for w in seen] == ["a real problem"]
