"""The benchmark's variants with the setup on a GPU: ember's step and the torch.optim baseline, eager."""

import pytest

from ember.launch import benchmark
from ember.launch.run_config import parse_cli


@pytest.mark.parametrize("variant", ["ember_eager", "torch_eager"])
def test_variant_steps_on_the_device(cuda, variant):
    cfg = parse_cli("llama3_tiny", ["--model.n_layers", "1", "--data.batch_size", "2", "--data.seq_len", "16"])
    s = benchmark.build_setup(cfg, device=cuda)
    assert s.batch["inputs"].is_cuda
    v = benchmark.build_variant(variant, s)
    assert v.device == "cuda" and v.step().is_cuda

