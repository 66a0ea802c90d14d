"""Ready-made layouts on a Llama: which parameter lands where, for every mesh in the test matrix."""

import pytest

from ember.core.mesh import Mesh
from ember.core.partition_specs import (
    Layout,
    PartitionSpec as P,
    ShardingRuleError,
    data_parallel,
    for_mesh,
    fsdp,
    resolve,
    resolve_tree,
    tensor_parallel,
)
from ember.core.pytree import tree_leaves_with_path
from ember.models import build_model

LLAMA = dict(vocab_size=64, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2, ffn_dim=64, max_seq_len=16)

# mesh -> {param path: storage spec}, {logical axes: compute spec}
EXPECTED = {
    "dp=2": ({"wte.weight": P(None, None), "blocks.0.attn.wq.weight": P(None, None),
              "blocks.0.ln_1.weight": P(None)},
             {("batch", "sequence", "embed"): P("dp", None, None), ("mlp", "embed"): P(None, None)}),
    "tp=2": ({"wte.weight": P("tp", None), "blocks.0.attn.wq.weight": P("tp", None),
              "blocks.0.attn.wk.weight": P("tp", None), "blocks.0.attn.wo.weight": P(None, "tp"),
              "blocks.0.mlp.gate.weight": P("tp", None), "blocks.0.mlp.down.weight": P(None, "tp"),
              "blocks.0.ln_1.weight": P(None)},
             {("batch", "sequence", "embed"): P(None, None, None), ("mlp", "embed"): P("tp", None)}),
    "fsdp=4": ({"wte.weight": P(None, "fsdp"), "blocks.0.attn.wq.weight": P(None, "fsdp"),
                "blocks.0.attn.wo.weight": P("fsdp", None), "blocks.0.ln_1.weight": P("fsdp")},
               {("batch", "sequence", "embed"): P("fsdp", None, None), ("mlp", "embed"): P(None, None)}),
    "dp=2,tp=2": ({"blocks.0.mlp.up.weight": P("tp", None), "blocks.0.mlp.down.weight": P(None, "tp"),
                   "wte.weight": P("tp", None)},
                  {("batch", "sequence", "embed"): P("dp", None, None), ("heads", "embed"): P("tp", None)}),
    "fsdp=2,tp=2": ({"wte.weight": P("tp", "fsdp"), "blocks.1.attn.wq.weight": P("tp", "fsdp"),
                     "blocks.1.attn.wo.weight": P("fsdp", "tp"), "blocks.1.mlp.gate.weight": P("tp", "fsdp"),
                     "blocks.1.mlp.down.weight": P("fsdp", "tp"), "ln_f.weight": P("fsdp")},
                    {("batch", "sequence", "embed"): P("fsdp", None, None), ("mlp", "embed"): P("tp", None)}),
}


def _as_stacked(path, spec):
    """A list layout's `blocks.{i}.` entry as the stacked layout holds it: one leaf, a whole "layers" axis first."""
    if not path.startswith("blocks."):
        return path, spec
    return "blocks." + path.split(".", 2)[2], P(None, *spec)


@pytest.mark.parametrize("scan_layers", [True, False], ids=["stacked", "list"])
@pytest.mark.parametrize("mesh_text", list(EXPECTED))
def test_for_mesh_places_llama_as_megatron_and_fsdp_would(mesh_text, scan_layers):
    mesh = Mesh.parse(mesh_text, backend="xla")
    model = build_model("llama3", "tiny", **LLAMA, scan_layers=scan_layers)
    layout = for_mesh(mesh.names)
    specs = dict(tree_leaves_with_path(resolve_tree(model.axes, layout.params, mesh_sizes=mesh.sizes(),
                                                    shapes=model.param_shapes())))
    params_expected, compute_expected = EXPECTED[mesh_text]
    for path, spec in params_expected.items():
        path, spec = _as_stacked(path, spec) if scan_layers else (path, spec)
        assert specs[path] == spec, path
    for axes, spec in compute_expected.items():
        assert resolve(axes, layout.compute, mesh_sizes=mesh.sizes()) == spec, axes
    # Every parameter is placed, and nothing is split over a mesh axis the mesh lacks.
    assert len(specs) == len(tree_leaves_with_path(model.param_shapes()))
    assert all(set(s.used_mesh_axes()) <= set(mesh.names) for s in specs.values())


def test_gpt2_and_stacked_layers_are_placed_too():
    mesh = Mesh.parse("fsdp=2,tp=2", backend="xla")
    for model in (build_model("gpt2", "tiny"), build_model("llama3", "tiny", **LLAMA)):
        specs = resolve_tree(model.axes, for_mesh(mesh.names).params, mesh_sizes=mesh.sizes(),
                             shapes=model.param_shapes())
        leaves = dict(tree_leaves_with_path(specs))
        assert any(s.used_mesh_axes() for s in leaves.values())
    # Stacked params lead with the (replicated) "layers" axis.
    assert leaves["blocks.attn.wq.weight"] == P(None, "tp", "fsdp")


def test_single_axis_layouts():
    assert resolve(("mlp", "embed"), fsdp().params) == P(None, "fsdp")
    assert resolve(("mlp", "embed"), fsdp().compute) == P(None, None)
    assert resolve(("embed", "mlp"), tensor_parallel().params) == P(None, "tp")
    assert resolve(("batch", "sequence"), tensor_parallel().compute) == P(None, None)
    assert resolve(("batch", "embed"), data_parallel().compute) == P("dp", None)
    assert resolve(("heads", "embed"), tensor_parallel("model").params) == P("model", None)
    assert Layout.same([("batch", "dp")]).params == Layout.same([("batch", "dp")]).compute


def test_indivisible_model_on_a_mesh_names_the_parameter():
    model = build_model("llama3", "tiny", **{**LLAMA, "vocab_size": 66})
    with pytest.raises(ShardingRuleError, match=r"^blocks.attn.wq.weight: dimension 1 \('heads'\) has size 32, "
                                                r"which does not divide by tp=3; change"):
        resolve_tree(model.axes, for_mesh(("tp",)).params, mesh_sizes={"tp": 3}, shapes=model.param_shapes())
    with pytest.raises(ShardingRuleError, match="mesh axis 'sp' is not used by the ready-made layout"):
        for_mesh(("dp", "sp"))


def test_path_pattern_rules_give_a_bridged_module_axes_the_layout_can_place():
    import torch

    from ember.models.bridge import from_torch

    class Attn(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.wq, self.wk, self.wv = (torch.nn.Linear(8, 8, bias=False) for _ in range(3))
            self.wo = torch.nn.Linear(8, 8, bias=False)

    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList([torch.nn.Module() for _ in range(2)])
    for b in net.blocks:
        b.attn = Attn()
        b.norm = torch.nn.LayerNorm(8)
    rules = [(r"blocks\.\d+\.attn\.w[qkv]\.weight$", ("heads", "embed")),
             (r"blocks\.\d+\.attn\.wo\.weight$", ("embed", "heads"))]
    model, params = from_torch(net, axes_rules=rules, default_axes="replicated")
    specs = dict(tree_leaves_with_path(resolve_tree(model.axes, for_mesh(("fsdp", "tp")).params,
                                                    mesh_sizes={"fsdp": 2, "tp": 2}, shapes=params)))
    assert specs["blocks.1.attn.wk.weight"] == P("tp", "fsdp")
    assert specs["blocks.1.attn.wo.weight"] == P("fsdp", "tp")
    assert specs["blocks.0.norm.weight"] == P(None)
