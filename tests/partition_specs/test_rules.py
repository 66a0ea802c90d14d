"""Rule resolution: Flax's `logical_to_mesh_axes` as the oracle, and the errors where Flax guesses."""

import random as pyrandom

import pytest

from ember.core.partition_specs import PartitionSpec, Rules, ShardingRuleError, resolve, resolve_tree

flax_spmd = pytest.importorskip("flax.linen.spmd")

LOGICAL = ["batch", "sequence", "embed", "mlp", "heads", "vocab"]
MESH = ["dp", "fsdp", "tp"]


def _random_rules(rng: pyrandom.Random):
    rules = []
    for _ in range(rng.randint(1, 9)):
        kind = rng.random()
        if kind < 0.2:
            mesh = None
        elif kind < 0.7:
            mesh = rng.choice(MESH)
        else:
            mesh = tuple(rng.sample(MESH, 2))
        rules.append((rng.choice(LOGICAL), mesh))
    return rules


def _random_axes(rng: pyrandom.Random):
    names = rng.sample(LOGICAL, rng.randint(1, 4))
    return tuple(None if rng.random() < 0.15 else n for n in names)


def _flax(axes, rules):
    """Flax's assignment, with its 'unassigned' marker kept so we can see where it guessed."""
    raw = flax_spmd._logical_to_mesh_axes(axes, rules)
    unassigned = [i for i, r in enumerate(raw) if isinstance(r, flax_spmd._UnassignedAxis)]
    spec = flax_spmd.logical_to_mesh_axes(axes, rules)
    return PartitionSpec(*spec), unassigned


def test_agrees_with_flax_on_random_rule_sets_and_errors_where_flax_guesses():
    rng = pyrandom.Random(0)
    agreed = raised = 0
    for _ in range(3000):
        rules, axes = _random_rules(rng), _random_axes(rng)
        expected, unassigned = _flax(axes, rules)
        if not unassigned:
            assert resolve(axes, rules) == expected, (axes, rules)
            agreed += 1
            continue
        with pytest.raises(ShardingRuleError) as err:
            resolve(axes, rules, name="w")
        first = axes[unassigned[0]]
        if any(name == first for name, _ in rules):
            assert "twice in one tensor" in str(err.value) and f"('{first}', None)" in str(err.value)
        else:
            assert f"no rule mentions logical axis '{first}'" in str(err.value)
        raised += 1
    assert agreed > 500 and raised > 500  # both branches are really exercised


@pytest.mark.parametrize(
    "axes, rules, expected",
    [
        # Flax's own docstring example (plus an explicit fallback for 'features', which Flax replicates silently).
        (("batch", "length", "heads", "features"),
         [("batch", "X"), ("features", "X"), ("heads", "Y"), ("batch", "Z"), ("length", None), ("features", None)],
         PartitionSpec("X", None, "Y", None)),
        # MaxText-style: batch over two mesh axes; embed falls back once fsdp is taken.
        (("batch", "embed"), [("batch", ("dp", "fsdp")), ("embed", "fsdp"), ("embed", None)],
         PartitionSpec(("dp", "fsdp"), None)),
        # Precedence is by rule order, not by dimension order (Flax semantics).
        (("embed", "mlp"), [("mlp", "tp"), ("embed", "tp"), ("embed", None)], PartitionSpec(None, "tp")),
        # None dimensions are never sharded.
        ((None, "embed"), [("embed", "fsdp")], PartitionSpec(None, "fsdp")),
    ],
)
def test_known_cases_match_flax(axes, rules, expected):
    assert resolve(axes, rules) == expected
    assert PartitionSpec(*flax_spmd.logical_to_mesh_axes(axes, rules)) == expected


def test_size_one_mesh_axes_are_dropped():
    rules = [("batch", ("dp", "fsdp")), ("mlp", "tp"), ("embed", "fsdp"), ("embed", None)]
    sizes = {"dp": 1, "fsdp": 4, "tp": 1}
    assert resolve(("batch", "embed"), rules, mesh_sizes=sizes) == PartitionSpec("fsdp", None)
    assert resolve(("mlp", "embed"), rules, mesh_sizes=sizes) == PartitionSpec(None, "fsdp")


def test_blocked_rule_error_names_tensor_rule_and_fix():
    with pytest.raises(ShardingRuleError, match=r"blocks.0.mlp.w1: rule 1 \('mlp', 'fsdp'\) would use mesh axis "
                                                r"'fsdp' twice in one tensor \(dimension 'embed' already has it"):
        resolve(("embed", "mlp"), [("embed", "fsdp"), ("mlp", "fsdp")], name="blocks.0.mlp.w1")


def test_unplaced_parameter_error_names_parameter_and_axis():
    axes = {"wte": ("vocab", "embed"), "ln": ("norm",)}
    with pytest.raises(ShardingRuleError, match=r"^ln: no rule mentions logical axis 'norm'.*\('norm', None\)"):
        resolve_tree(axes, [("vocab", "tp"), ("embed", None)])


def test_unknown_mesh_axis_in_a_rule():
    with pytest.raises(ShardingRuleError, match=r"rule 0 \('mlp', 'tpp'\) names mesh axis 'tpp', but the mesh "
                                                r"has axes \('dp', 'tp'\); fix the name, add tpp=1"):
        resolve(("mlp",), [("mlp", "tpp")], mesh_sizes={"dp": 2, "tp": 2})


def test_indivisible_dimension_names_parameter_and_sizes():
    with pytest.raises(ShardingRuleError, match=r"attn.wk.weight: dimension 0 \('kv_heads'\) has size 6, which does "
                                                r"not divide by tp=4; change"):
        resolve(("kv_heads", "embed"), [("kv_heads", "tp"), ("embed", None)], mesh_sizes={"tp": 4},
                shape=(6, 8), name="attn.wk.weight")
    with pytest.raises(ShardingRuleError, match=r"size 6, which does not divide by dp=2 x fsdp=2 = 4"):
        resolve(("batch",), [("batch", ("dp", "fsdp"))], mesh_sizes={"dp": 2, "fsdp": 2}, shape=(6,), name="x")


@pytest.mark.parametrize(
    "bad, match",
    [
        ({"mlp": "tp"}, "ordered list of \\(logical_axis, mesh_axes\\) pairs"),
        ([("mlp",)], "rule 0 is \\('mlp',\\)"),
        ([("mlp", 3)], "mesh_axes must be a mesh axis name"),
        ([("mlp", ("tp", "tp"))], "names mesh axis 'tp' twice"),
    ],
)
def test_malformed_rules(bad, match):
    with pytest.raises(ShardingRuleError, match=match):
        Rules(bad)


def test_same_logical_name_on_two_dimensions_is_an_error():
    with pytest.raises(ShardingRuleError, match="logical axis 'embed' names two dimensions"):
        resolve(("embed", "embed"), [("embed", "fsdp")])
    with pytest.raises(ValueError, match="occur more than once"):  # Flax refuses it too
        flax_spmd.logical_to_mesh_axes(("embed", "embed"), [("embed", "fsdp")])


def test_partition_spec_normalises_like_jax():
    jax_sharding = pytest.importorskip("jax.sharding")
    assert PartitionSpec(("tp",), (), None) == PartitionSpec("tp", None, None)
    jp = jax_sharding.PartitionSpec(("dp", "fsdp"), None, "tp")
    assert PartitionSpec(*jp) == PartitionSpec(("dp", "fsdp"), None, "tp")
    assert PartitionSpec("fsdp", ("dp", "tp")).used_mesh_axes() == ("fsdp", "dp", "tp")
