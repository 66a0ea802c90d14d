"""One measurement of `launch/bench_scale.py`, in the fresh process it starts for it (`--child SPEC`).

Public names: `run_child`, `flag`.
"""

def flag(name, value):
    """One command-line override: booleans are flags (`--model.scan-layers` / `--model.no-scan-layers`)."""
    if isinstance(value, bool):
        section, _, field = name.rpartition(".")
        spelled = field.replace("_", "-") if value else "no-" + field.replace("_", "-")
        return f"--{section}.{spelled}" if section else f"--{spelled}"
    return f"--{name}={value}"


def run_child(spec):
    """The measurement `spec` (a dict: `what` and its arguments) names, run in this process; its result."""
    if spec["what"] == "packed_attention":
        from ember.launch.benchmark.scaling import packed_attention_child

        return packed_attention_child(seq_len=spec["seq_len"],
                                      flags=[flag(k, v) for k, v in spec.get("overrides", {}).items()])
    if spec["what"] == "torch_primitives":
        from ember.launch.benchmark.primitives import primitives_child

        return primitives_child(spec["variant"])
    if spec["what"] == "bridged_checkpointing":
        from ember.launch.benchmark.bridged import bridged_checkpointing_child

        return bridged_checkpointing_child(spec["checkpointing"], **spec["shape"])
    if spec["what"] == "loss_memory":
        from ember.launch.benchmark.scaling import loss_memory_child

        return loss_memory_child(spec["variant"], vocab=spec["vocab"], tokens=spec["tokens"],
                                 d_model=spec["d_model"], chunk_size=spec["chunk_size"])
    from ember.launch.benchmark.scaling import compile_child, scan_steady_child, step_memory_child
    from ember.launch.run_config import parse_cli

    if spec["what"] == "scan_steady":
        return scan_steady_child({name: parse_cli(spec["config"], [flag(k, v) for k, v in overrides.items()])
                                  for name, overrides in spec["variants"].items()})

    config = parse_cli(spec["config"], [flag(k, v) for k, v in spec["overrides"].items()])
    if spec["what"] == "generate":
        from ember.launch.benchmark.scaling import generate_child

        return generate_child(config, new_tokens=spec["new_tokens"])
    if spec["what"] == "step_memory":
        return {**step_memory_child(config), **spec["overrides"]}
    return {**compile_child(config, backend=spec["backend"]), **spec["overrides"]}
