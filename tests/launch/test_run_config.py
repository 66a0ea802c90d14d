"""Tests for ember.launch.run_config: registry, CLI overrides (tyro), serialisation, subclassing."""

import dataclasses
import json

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


def test_typo_in_field_exits_with_suggestion(capsys):
    with pytest.raises(SystemExit):
        C.parse_cli("test_toy", ["--model.widht", "3"])
    err = capsys.readouterr()
    assert "--model.width" in (err.err + err.out)


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
def test_bad_values_are_refused_before_any_work_naming_the_flag(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        C.parse_cli("llama3_tiny", argv)
    assert exit_info.value.code == 2
    err = " ".join(capsys.readouterr().err.replace("│", " ").split())
    assert message in err and "Pass --" in err


def test_configs_built_in_code_are_checked_too():
    from ember.data import DataConfig
    from ember.optim import OptimConfig

    with pytest.raises(ValueError, match=r"^optim.learning_rate=nan: .* Pass --optim.learning_rate"):
        OptimConfig(learning_rate=float("nan"))
    with pytest.raises(ValueError, match=r"^data.seq_len=0"):
        DataConfig(seq_len=0)
    with pytest.raises(ValueError, match=r"^eval_batches=0"):
        C.TrainConfig(eval_batches=0)
