"""`launch/bench_context.py`: the longest sequence from the fitted memory, and the per-process memory it measures
(gloo processes, `llama3_tiny`): splitting the sequence over `cp=2` cuts what a forward and backward keep; the
attention timing's two forms agree."""

import pytest

from ember.launch.bench_context import attention_cost, longest_sequence, measure


def test_longest_sequence_is_the_largest_multiple_within_the_budget():
    assert longest_sequence(10.0, 2.0, 0.0, 30.0, 4) == 8  # (30 - 10) / 2 = 10 tokens, down to a multiple of 4
    assert longest_sequence(0.0, 1.0, 1.0, 110.0, 1) == 10  # T + T^2 <= 110
    assert longest_sequence(50.0, 1.0, 1.0, 40.0, 2) == 0  # the state alone is over the budget


@pytest.mark.slow
def test_cp2_keeps_less_per_process_than_one_process():
    one, two = measure(512, 1, "llama3_tiny"), measure(512, 2, "llama3_tiny")
    assert 0 < two["transient"] < one["transient"], (one, two)
    assert two["held"] > 0 and one["held"] > 0


def test_the_rematerialised_attention_gives_the_kept_ones_gradients():
    got = attention_cost(64, 2, heads=2, head_dim=8, iters=1)
    assert got["grad_diff"] < 1e-5 and got["kept"] > 0 and got["remat"] > 0
