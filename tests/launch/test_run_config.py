"""Tests for ember.launch.run_config: registry, CLI overrides (tyro), serialisation, subclassing."""

import dataclasses
import json

import re

import pytest

from ember.launch import run_config as C


@dataclasses.dataclass(frozen=True)
class ToyModel:
    width: int = 8
    """hidden width"""
    depth: int = 2


@C.register_config("test_toy")
def _toy():
    return C.TrainConfig(family="toy", model=ToyModel(), steps=7)


@dataclasses.dataclass(frozen=True)
class MyTrain(C.TrainConfig):
    ema_decay: float = 0.99
    """extra field of a user's subclass"""


@C.register_config("test_toy_ema")
def _toy_ema():
    return MyTrain(family="toy", model=ToyModel(width=4))


def test_get_and_list():
    assert "test_toy" in C.list_configs()
    assert C.get_config("test_toy").steps == 7


def test_cli_overrides_nested_model_and_optim_fields():
    cfg = C.parse_cli("test_toy", ["--model.width", "32", "--optim.learning_rate", "0.01", "--data.seq_len=64"])
    assert cfg.model == ToyModel(width=32) and cfg.optim.learning_rate == 0.01 and cfg.data.seq_len == 64
    assert isinstance(cfg, C.TrainConfig) and cfg.steps == 7


def test_subclassed_config_keeps_its_fields():
    cfg = C.parse_cli("test_toy_ema", ["--ema_decay", "0.5"])
    assert isinstance(cfg, MyTrain) and cfg.ema_decay == 0.5 and cfg.model.width == 4


def test_typo_in_field_exits_with_suggestion():
    with pytest.raises(ValueError, match=r"unknown flag --model.widht; did you mean --model.width\?"):
        C.parse_cli("test_toy", ["--model.widht", "3"])


@pytest.mark.parametrize("typo, suggestion", [("--optim.lrr", "--optim.learning_rate"), ("--stepz", "--steps"),
                                              ("--data.sorce", "--data.source")])
def test_flag_typos_suggest_the_nearest_names(typo, suggestion):
    with pytest.raises(ValueError, match=rf"unknown flag {typo}; did you mean .*{suggestion}"):
        C.parse_cli("llama3_tiny", [typo, "3"])


def test_valid_spellings_pass_the_flag_check():
    cfg = C.parse_cli("llama3_tiny", ["--model.n-layers=2", "--data.seq_len", "64", "--model.no-tie-embeddings"])
    assert (cfg.model.n_layers, cfg.data.seq_len, cfg.model.tie_embeddings) == (2, 64, False)


def test_a_config_check_reaches_the_caller_as_its_own_value_error():
    """tyro would box the message; the launcher prints it as one line."""
    with pytest.raises(ValueError, match=r"^steps=-3: expected an int >= 1"):
        C.parse_cli("llama3_tiny", ["--steps", "-3"])
    from ember.optim.config import OptimConfig
    with pytest.raises(ValueError):  # the classes' own checks are back after parsing
        OptimConfig(learning_rate=float("nan"))


@pytest.mark.parametrize("argv, match", [
    (["--keep_best", "eval_loss:best"], "the mode after ':' must be min or max"),
    (["--keep_best", "eval_loss", "--checkpoint_every", "-1"], "checkpoints are off"),
    (["--keep_best", "eval_loss", "--checkpoint_every", "30"], "pass --checkpoint_every 100"),
])
def test_keep_best_is_checked_against_the_checkpoint_and_eval_schedule(argv, match):
    with pytest.raises(ValueError, match=match):
        C.parse_cli("llama3_tiny", argv)


def test_unknown_config_names_close_match():
    with pytest.raises(KeyError, match="did you mean 'test_toy'"):
        C.get_config("test_tyo")


def test_to_dict_is_json():
    d = C.to_dict(C.get_config("test_toy"))
    assert d["model"] == {"__type__": "ToyModel", "width": 8, "depth": 2}
    assert json.loads(json.dumps(d))["optim"]["name"] == "adamw"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--optim.learning_rate", "nan"], "optim.learning_rate=nan: expected a finite number > 0"),
        (["--optim.learning_rate", "-0.001"], "optim.learning_rate=-0.001: expected a finite number > 0"),
        (["--optim.b2", "1.0"], "optim.b2=1.0: expected a number in [0, 1)"),
        (["--optim.clip_norm", "inf"], "optim.clip_norm=inf: expected a finite number > 0, or None"),
        (["--steps", "-3"], "steps=-3: expected an int >= 1"),
        (["--log_every", "0"], "log_every=0: expected an int >= 1"),
        (["--data.batch_size", "0"], "data.batch_size=0: expected an int >= 1"),
        (["--data.num_workers", "-1"], "data.num_workers=-1: expected an int >= 0"),
    ],
    ids=["nan-lr", "negative-lr", "b2-one", "inf-clip", "negative-steps", "log-every-0", "batch-0", "workers"],
)
def test_bad_values_are_refused_before_any_work_naming_the_flag(argv, message):
    with pytest.raises(ValueError, match=re.escape(message) + ".* Pass --"):  # the launcher: one line, exit 2
        C.parse_cli("llama3_tiny", argv)


def test_configs_built_in_code_are_checked_too():
    from ember.data import DataConfig
    from ember.optim import OptimConfig

    with pytest.raises(ValueError, match=r"^optim.learning_rate=nan: .* Pass --optim.learning_rate"):
        OptimConfig(learning_rate=float("nan"))
    with pytest.raises(ValueError, match=r"^data.seq_len=0"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match=r"^eval_batches=0"):
        C.TrainConfig(eval_batches=0)
