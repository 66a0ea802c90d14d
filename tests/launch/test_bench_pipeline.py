"""`launch/bench_pipeline.py`'s figures that need no timing: memory per device by pipeline degree."""

import importlib.util
import pathlib

from ember.launch.run_config import get_config

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_pipeline", ROOT / "launch" / "bench_pipeline.py")
bench_pipeline = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_pipeline)


def test_memory_per_device_falls_with_the_stages_by_the_blocks_share():
    rows = bench_pipeline.memory_rows("125m", get_config("llama3_125m").model)
    assert [mesh for _, mesh, _ in rows] == ["dp=1", "pp=2", "pp=4"]
    whole, pp2, pp4 = (gib for *_, gib in rows)
    blocks = 2 * (whole - pp2)  # what pp=2 halves: the stacked blocks; embeddings and norms stay whole
    assert abs(pp4 - (whole - 0.75 * blocks)) < 1e-6 and 0 < blocks < whole
