"""Tests for ember.core.pytree: registered frozen dataclasses, key paths, structure checks."""

import dataclasses

import pytest
import torch

from ember.core import pytree


@pytree.dataclass
class Pair:
    a: torch.Tensor
    b: dict
    name: str = pytree.field(static=True, default="pair")


def test_dataclass_is_frozen_pytree_with_static_fields_out_of_leaves():
    p = Pair(torch.ones(2), {"x": torch.zeros(3)}, name="p")
    leaves, spec = pytree.tree_flatten(p)
    assert [t.shape for t in leaves] == [torch.Size([2]), torch.Size([3])]
    rebuilt = pytree.tree_unflatten([t + 1 for t in leaves], spec)
    assert isinstance(rebuilt, Pair) and rebuilt.name == "p"
    assert rebuilt.b["x"].tolist() == [1.0, 1.0, 1.0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.a = torch.zeros(2)


def test_replace_returns_updated_copy():
    p = Pair(torch.ones(2), {})
    q = p.replace(name="q")
    assert q.name == "q" and p.name == "pair" and q.a is p.a


def test_static_field_change_changes_structure():
    p, q = Pair(torch.ones(1), {}), Pair(torch.ones(1), {}, name="other")
    assert pytree.tree_structure(p) != pytree.tree_structure(q)


def test_tensor_in_static_field_warns():
    with pytest.warns(UserWarning, match="static field but holds a tensor"):
        Pair(torch.ones(1), {}, name=torch.ones(1))


def test_subclass_adds_fields():
    @pytree.dataclass
    class Triple(Pair):
        c: torch.Tensor = None

    t = Triple(torch.ones(1), {}, c=torch.zeros(1))
    assert pytree.tree_paths(t) == ["a", "c"]


TREE = {"blocks": [{"attn": {"wq": torch.ones(2)}}, {"attn": {"wq": torch.ones(3)}}], "wte": torch.ones(1)}


def test_paths_are_dotted():
    assert pytree.tree_paths(TREE) == ["blocks.0.attn.wq", "blocks.1.attn.wq", "wte"]


def test_tree_map_with_path_passes_path_and_extra_trees():
    out = pytree.tree_map_with_path(lambda path, x, y: (path, x.numel() + y.numel()), TREE, TREE)
    assert out["blocks"][1]["attn"]["wq"] == ("blocks.1.attn.wq", 6)


def test_check_same_structure_names_differing_paths():
    other = {"blocks": [{"attn": {"wk": torch.ones(2)}}], "wte": torch.ones(1)}
    with pytest.raises(ValueError, match=r"blocks\.0\.attn\.wq"):
        pytree.check_same_structure(TREE, other, what="mask and params")


def test_registered_dataclass_traces_under_compile():
    @torch.compile(fullgraph=True, backend="eager")
    def f(p):
        return p.replace(a=p.a * 2)

    out = f(Pair(torch.ones(2), {"x": torch.ones(1)}))
    assert isinstance(out, Pair) and out.a.tolist() == [2.0, 2.0]
