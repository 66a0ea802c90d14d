"""`LeafDependencies`: which group each result comes from, and what each block's tensors went through."""

from __future__ import annotations

import torch

from ember.core.leaf_dependencies import REST, LeafDependencies


def test_results_take_their_inputs_group_and_an_op_mixing_groups_is_recorded():
    a, b, shared = torch.ones(2), torch.ones(2), torch.tensor(3.0)
    mode = LeafDependencies()
    mode.tag(a, 0)
    mode.tag(b, 1)
    mode.tag(shared, None)
    with mode:
        scaled = a * shared
        pair = torch._foreach_add([a, b], 1.0)  # one op per element: no mixing
    assert mode.group_of(scaled) == 0 and [mode.group_of(t) for t in pair] == [0, 1]
    assert mode.mixed is None
    assert mode.logs[0][1:] == mode.logs[1]  # block 1 went through what block 0 did after its product
    with mode:
        torch.stack([a, b])
    assert mode.mixed == "aten::stack"


def test_the_rest_may_not_mix_with_a_block():
    a, rest = torch.ones(2), torch.ones(2)
    mode = LeafDependencies()
    mode.tag(a, 0)
    mode.tag(rest, REST)
    with mode:
        a + rest
    assert mode.mixed == "aten::add.Tensor"
