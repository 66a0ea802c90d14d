"""`Sharding`, `shard`, `constrain`: backend-neutral behaviour, checked with a recording lowering."""

import contextlib

import pytest
import torch

from ember.core import TrainState, random
from ember.core.mesh import Mesh
from ember.core.partition_specs import (
    PartitionSpec as P,
    Sharding,
    ShardingRuleError,
    constrain,
    current_sharding,
    for_mesh,
    shard,
    shard_batch,
    specs_like_params,
    use_sharding,
)
from ember.core.pytree import tree_leaves_with_path
from ember.models import build_model
from ember.optim import adafactor, adamw, muon, muon_labels

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)


class Recording:
    """A lowering that keeps tensors as they are and records every spec it is asked for."""

    def __init__(self):
        self.placed, self.constrained, self.entered = [], [], 0

    def place(self, x, spec):
        self.placed.append((tuple(x.shape), spec))
        return x.clone()

    def constrain(self, x, spec):
        self.constrained.append((tuple(x.shape), spec))
        return x

    def local_shape(self, x):
        return tuple(x.shape)

    def gather(self, x):
        return x

    @contextlib.contextmanager
    def context(self):
        self.entered += 1
        yield


def _sharding(text):
    mesh = Mesh.parse(text, backend="xla")
    return Sharding(mesh, for_mesh(mesh.names), lowering=Recording())


def test_constrain_is_identity_without_an_active_sharding():
    x = torch.ones(2, 3)
    assert constrain(x, ("batch", "embed")) is x and current_sharding() is None


def test_the_active_sharding_is_per_thread_and_explicit_arguments_override_it():
    import threading

    outer, explicit = _sharding("dp=2,tp=2"), _sharding("dp=4")
    seen = {}

    def other_thread():
        seen["sharding"] = current_sharding()
        with use_sharding(explicit):
            seen["inner"] = current_sharding()

    with use_sharding(outer):
        worker = threading.Thread(target=other_thread)
        worker.start()
        worker.join()
        assert current_sharding() is outer  # the other thread's push and pop left this one alone
        x = torch.ones(4, 8)
        constrain(x, ("batch", "mlp"))
        constrain(x, ("batch", "mlp"), sharding=explicit)
        constrain(x, ("batch", "mlp"), rules=[("batch", None), ("mlp", "dp")])
    assert seen == {"sharding": None, "inner": explicit}
    assert outer.lowering.constrained == [((4, 8), P("dp", "tp")), ((4, 8), P(None, "dp"))]
    assert explicit.lowering.constrained == [((4, 8), P("dp", None))]
    x = torch.ones(2)
    assert constrain(x, ("batch",), rules=[("batch", "dp")]) is x  # no mesh anywhere: unchanged


def test_a_rule_naming_a_missing_mesh_axis_names_the_method_that_drops_it():
    from ember.core.partition_specs import Rules

    rules = Rules([("batch", "dp"), ("mlp", "tp")])
    with pytest.raises(ShardingRuleError, match=r"`rules.restrict_to\(mesh.names\)` does that"):
        rules.check_mesh(("dp",))
    assert rules.restrict_to(("dp",)).check_mesh(("dp",)) == Rules([("batch", "dp"), ("mlp", None)])


def test_model_gathers_each_parameter_with_the_compute_rules_once_per_forward():
    model = build_model("llama3", "tiny", **LLAMA)
    params = model.init(random.key(0))
    tokens = torch.randint(0, 64, (4, 8))
    s = _sharding("fsdp=2,tp=2")
    with use_sharding(s):
        assert current_sharding() is s
        sharded_logits = model.apply(params, tokens)
    assert current_sharding() is None and s.lowering.entered == 1
    torch.testing.assert_close(sharded_logits, model.apply(params, tokens), rtol=0, atol=0)
    specs = dict(s.lowering.constrained)
    n_params = len(tree_leaves_with_path(params))
    residual = [c for c in s.lowering.constrained if c[1] == P("fsdp", None, None)]
    gathered = [c for c in s.lowering.constrained if c not in residual]
    tied = int(model.config.tie_embeddings)  # a tied head gathers wte a second time
    per_block = len(tree_leaves_with_path(params["blocks"]))  # stacked: each layer gathers its own slices
    assert len(gathered) == n_params - per_block + LLAMA["n_layers"] * per_block + tied
    assert specs[(64, 32)] == P("tp", None)  # compute view of mlp.gate: column parallel, embed whole
    assert specs[(32, 64)] == P(None, "tp")  # mlp.down: row parallel
    assert len(residual) == 1 + 2 * LLAMA["n_layers"]  # after the embedding and after each branch


def test_shard_state_inherits_param_specs_by_structure():
    model = build_model("llama3", "tiny", **LLAMA)
    params = model.init(random.key(0))
    state = TrainState.create(params=params, tx=adamw(1e-3), key=random.key(0))
    s = _sharding("fsdp=2,tp=2")
    placed = shard(state, s, axes=model.axes)
    assert placed.params is not state.params
    param_specs = s.param_specs(model.axes, params)
    specs = specs_like_params(state, params, param_specs)
    flat = dict(tree_leaves_with_path(specs))
    assert flat["params.blocks.mlp.gate.weight"] == P(None, "tp", "fsdp")  # the layers axis whole
    mu = [p for p in flat if p.endswith("mu.blocks.mlp.gate.weight")]
    assert mu and flat[mu[0]] == P(None, "tp", "fsdp")
    assert flat["step"] == P() and flat["key"] == P()
    assert len(s.lowering.placed) == len(tree_leaves_with_path(state))


def test_a_parameter_groups_state_inherits_its_parameters_specs():
    """`partition`'s groups hold the params' structure with the other groups' leaves masked out: each group's
    momentum is placed like its parameter (it was replicated, an FSDP run's optimizer state whole on every process)."""
    model = build_model("llama3", "tiny", **LLAMA)
    params = model.init(random.key(0))
    state = TrainState.create(params=params, tx=muon(1e-3, param_labels=muon_labels(model.axes)), key=random.key(0))
    s = _sharding("fsdp=2,tp=2")
    specs = dict(tree_leaves_with_path(specs_like_params(state, params, s.param_specs(model.axes, params))))
    muon_mu = [p for p in specs if p.endswith("muon.inner_state.0.mu.blocks.mlp.gate.weight")]
    adam_nu = [p for p in specs if p.endswith("adam.inner_state.0.nu.wte.weight")]
    assert muon_mu and specs[muon_mu[0]] == P(None, "tp", "fsdp")
    assert adam_nu and specs[adam_nu[0]] == specs["params.wte.weight"] != P(None, None)
    assert len(specs) == len(tree_leaves_with_path(state))


def test_factored_optimizer_statistics_of_another_shape_are_replicated():
    model = build_model("llama3", "tiny", **LLAMA)
    params = model.init(random.key(0))
    state = TrainState.create(params=params, tx=adafactor(1e-3), key=random.key(0))
    s = _sharding("fsdp=2,tp=2")
    specs = specs_like_params(state, params, s.param_specs(model.axes, params))
    leaves = dict(tree_leaves_with_path(state))
    for path, spec in tree_leaves_with_path(specs):
        assert len(spec) == leaves[path].dim(), path  # every spec has the leaf's rank


def test_tied_parameters_are_placed_once():
    w = torch.ones(4, 4)
    tree = {"a": w, "b": w}
    s = _sharding("dp=2")
    placed = shard(tree, s, axes={"a": ("vocab", "embed"), "b": ("vocab", "embed")})
    assert placed["a"] is placed["b"] and len(s.lowering.placed) == 1


def test_shard_batch_splits_the_batch_dimension():
    s = _sharding("dp=2,tp=2")
    shard_batch({"tokens": torch.zeros(4, 8, dtype=torch.long), "w": torch.zeros(4)}, s)
    assert sorted(spec for _, spec in s.lowering.placed) == [P("dp"), P("dp", None)]


def test_bad_input_is_refused_before_anything_is_placed():
    model = build_model("llama3", "tiny", **LLAMA)
    with pytest.raises(ShardingRuleError, match="names mesh axis 'tp', but the mesh has axes \\('dp',\\)"):
        Sharding(Mesh.parse("dp=2", backend="xla"), [("batch", "dp"), ("mlp", "tp")], lowering=Recording())
    s = Sharding(Mesh.parse("dp=2", backend="xla"), [("batch", "dp"), ("vocab", None)], lowering=Recording())
    with pytest.raises(ShardingRuleError, match="^wte.weight: no rule mentions logical axis 'embed'"):
        shard(model.init(random.key(0)), s, axes=model.axes)
    assert s.lowering.placed == []
    with use_sharding(_sharding("dp=2")), pytest.raises(ShardingRuleError, match="name 2 dimensions"):
        constrain(torch.ones(3), ("batch", "embed"))


def test_nested_dtensor_shardings_keep_implicit_replication_until_the_outer_one_exits():
    """A pipeline's stages enter a sharding of a slice of the mesh inside the step's; torch's
    `implicit_replication()` would switch replication off for the outer one when the inner one exits."""
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, distribute_tensor

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        sharding = Sharding(Mesh((("pp", 1), ("tp", 1))), for_mesh(("pp", "tp")))
        stage = sharding.lowering.slice(["tp"])
        assert stage.mesh.names == ("tp",) and stage.device_mesh.mesh_dim_names == ("tp",)
        x = distribute_tensor(torch.ones(2), sharding.lowering.device_mesh, [Replicate(), Replicate()])
        with use_sharding(sharding):
            with use_sharding(Sharding(stage.mesh, for_mesh(("tp",)), lowering=stage)):
                pass
            assert torch.equal((x + torch.ones(2)).full_tensor(), torch.full((2,), 2.0))  # still replicated
        with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
            x + torch.ones(2)
    finally:
        dist.destroy_process_group()
