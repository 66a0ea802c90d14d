"""ember.launch.device_check: the Python stages of `make gpu-check` (`launch/gpu_check.sh`).

    env_probe     versions, the GPU, every native extension in one process, the measured matmul peak
    repeat        the run config's compiled step twice from one seed: bitwise repeat, eager and CPU references
    moe_step      qwen3_moe_tiny (dropless) against its dense twin of the same active parameters
    step_compare  ember's compiled step against `torch.compile(module)` + fused AdamW in one process
    gpu_tests     `pytest -m gpu` over the test suite, with a count of what ran
    summary       the table a person pastes into BENCHMARKS.md, from the check's log

Each stage runs as `python -m ember.launch.device_check.<name>` and prints one line
`RESULT <name> {json}` that `summary` reads back; a stage that fails says why on that line too.
"""
