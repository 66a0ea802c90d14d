"""ember.launch.precision: `--compute_dtype auto` is bf16 only on a CUDA GPU (CPU runs unchanged), `--tf32`
touches only CUDA, the start-of-run line says what computes in which dtype, `--cuda_graph` is refused
where it cannot run."""

import pytest
import torch

from ember.launch import build
from ember.launch.precision import check_cuda_graph, precision_line, resolve_compute_dtype, set_matmul_precision
from ember.launch.run_config import parse_cli

CPU = torch.device("cpu")


def test_auto_is_float32_on_the_cpu_and_explicit_names_are_kept():
    assert parse_cli("llama3_tiny", []).compute_dtype == "auto"
    assert resolve_compute_dtype("auto", CPU) is None and resolve_compute_dtype("float32", CPU) is None
    assert resolve_compute_dtype("bfloat16", CPU) is torch.bfloat16
    assert resolve_compute_dtype("auto", torch.device("xla")) is None
    if not torch.cuda.is_available():
        assert build.compute_dtype(parse_cli("llama3_tiny", [])) is None  # the default run: unchanged on the CPU


def test_tf32_leaves_the_cpu_alone_and_the_line_names_the_precision():
    before = torch.get_float32_matmul_precision()
    assert set_matmul_precision(True, CPU) is None and torch.get_float32_matmul_precision() == before
    cfg = parse_cli("llama3_tiny", [])
    assert precision_line(cfg, CPU) == "precision: float32 (--compute_dtype auto)"
    bf16 = parse_cli("llama3_tiny", ["--compute_dtype", "bfloat16"])
    assert precision_line(bf16, CPU).startswith("precision: bfloat16 compute, float32 master weights, gradients, "
                                                "optimizer and loss (--compute_dtype bfloat16)")


def test_cuda_graph_is_refused_off_inductor_and_off_cuda():
    check_cuda_graph(parse_cli("llama3_tiny", []))  # off: nothing to check
    with pytest.raises(ValueError, match=r"--backend eager compiles none; pass --backend inductor"):
        check_cuda_graph(parse_cli("llama3_tiny", ["--cuda_graph", "True", "--backend", "eager"]))
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"this run is on cpu .*drop --cuda_graph on the CPU"):
            check_cuda_graph(parse_cli("llama3_tiny", ["--cuda_graph", "True"]))


@pytest.mark.gpu
def test_on_a_gpu_auto_is_bf16_and_tf32_is_set_and_reported():
    before = torch.get_float32_matmul_precision()
    cuda = torch.device("cuda")
    try:
        expected = torch.bfloat16 if torch.cuda.is_bf16_supported() else None
        assert resolve_compute_dtype("auto", cuda) is expected
        assert set_matmul_precision(True, cuda) == "high"
        assert precision_line(parse_cli("llama3_tiny", []), cuda).endswith("float32 matmuls TF32 (--tf32 True)")
        assert set_matmul_precision(False, cuda) == "highest"
        with pytest.raises(ValueError, match=r"sharded over a mesh"):
            check_cuda_graph(parse_cli("llama3_tiny", ["--cuda_graph", "True"]), sharding=object())
    finally:
        torch.set_float32_matmul_precision(before)


class _Built(Exception):
    """Raised by the stand-in `jit` once the train step is built: the test needs no step to run."""


@pytest.mark.parametrize("flags, expected", [([], True), (["--deterministic", "False"], False)])
def test_deterministic_flag_reaches_the_compiled_step(monkeypatch, tmp_path, flags, expected):
    from ember.launch import train

    def built(fn, **kwargs):
        raise _Built(kwargs)

    monkeypatch.setattr(train, "jit", built)
    with pytest.raises(_Built) as got:
        train.main(["--model.n_layers", "1", "--data.max_bytes", "100000", "--out", str(tmp_path / "run"), *flags])
    assert got.value.args[0]["deterministic"] is expected and got.value.args[0]["backend"] == "inductor"
