"""The attention kernel report: the SDPA kernel torch picks for a model's attention on this device and dtype."""

import pytest
import torch

from ember.core import random
from ember.models import build_model
from ember.models.layers.attention_kernel import attention_kernel_report, sdpa_kernel_name

CPU_CASES = [  # (dtype, mask, what torch picks on the CPU)
    (torch.float32, None, "flash (cpu)"),
    (torch.bfloat16, None, "flash (cpu)"),
    (torch.float64, None, "flash (cpu)"),
]


@pytest.mark.parametrize("dtype,mask,kernel", CPU_CASES, ids=[str(c[0]) for c in CPU_CASES])
def test_the_cpu_kernel_is_named_as_torch_picks_it(dtype, mask, kernel):
    q = torch.randn(1, 2, 8, 16, dtype=dtype)
    assert sdpa_kernel_name(q, q, q, attn_mask=mask, is_causal=True) == kernel


def test_math_is_named_when_it_is_the_only_backend():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(1, 2, 8, 16)
    with sdpa_kernel([SDPBackend.MATH]):
        assert sdpa_kernel_name(q, q, q, is_causal=True) == "math"


@pytest.mark.parametrize("family", ["llama3", "gpt2"])
def test_the_report_names_the_models_attention_shape(family):
    model = build_model(family, "tiny")
    params = model.init(random.key(0))
    line = attention_kernel_report(model, params, seq_len=32, device=torch.device("cpu"))
    assert line.startswith("attention: flash (cpu) on cpu (float32, H=") and "T=32" in line, line
    bf16 = attention_kernel_report(model, params, seq_len=32, device=torch.device("cpu"), dtype=torch.bfloat16)
    assert "bfloat16" in bf16


@pytest.mark.gpu
def test_the_report_on_cuda_names_a_fused_kernel_in_bf16():
    model = build_model("llama3", "tiny")
    params = model.init(random.key(0))
    line = attention_kernel_report(model, params, seq_len=256, device=torch.device("cuda"), dtype=torch.bfloat16)
    assert line.startswith(("attention: flash on cuda", "attention: memory-efficient on cuda")), line
    assert "deterministic backward" in line
