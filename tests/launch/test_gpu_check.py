"""The device check (`make gpu-check`, launch/gpu_check.sh) in its CPU mode: the same entry points at toy
sizes, eager, so the check cannot rot between the rare runs on a GPU. Also: the check's pytest stage
selects every test marked `gpu`, a timeout reads as a finding, and every test that starts several
processes hides the GPUs from them (gloo on the CPU, so the suite passes on a host with one GPU)."""

from __future__ import annotations

import ast
import json
import os
import pathlib
import re
import signal
import subprocess
import sys

import pytest

from ember.launch.device_check import gpu_tests, summary

pytestmark = pytest.mark.xdist_group("gpu_check")  # one worker runs the module: its shared fixture runs once

ROOT = pathlib.Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
STAGES = ["env", "a", "c1", "t", "d", "b1"]  # one of each entry point; a2, c2 and b2 rerun a, c1 and b1's


def _is_gpu_mark(node: ast.AST) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr == "gpu" and isinstance(n.value, ast.Attribute)
               and n.value.attr == "mark" for n in ast.walk(node))


def gpu_marked_tests() -> set:
    """`file::[Class::]test` of every test marked gpu (decorator, `pytestmark`, or a `pytest.param` mark)."""
    found = set()
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text())
        rel = path.relative_to(ROOT).as_posix()
        whole = any(isinstance(n, ast.Assign) and any(getattr(t, "id", "") == "pytestmark" for t in n.targets)
                    and _is_gpu_mark(n.value) for n in tree.body)

        def visit(body, prefix, marked):
            for n in body:
                if isinstance(n, ast.ClassDef) and n.name.startswith("Test"):
                    visit(n.body, f"{prefix}{n.name}::", marked or any(map(_is_gpu_mark, n.decorator_list)))
                elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name.startswith("test"):
                    if marked or any(map(_is_gpu_mark, n.decorator_list)):
                        found.add(f"{rel}::{prefix}{n.name}")

        visit(tree.body, "", whole)
    return found


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    """One CPU-mode run of launch/gpu_check.sh over STAGES (about 40 s on 2 idle cores): (results rows, log, out)."""
    out, work = tmp_path_factory.mktemp("gpu_check_out"), tmp_path_factory.mktemp("gpu_check_work")
    marked_files = sorted({t.split("::")[0] for t in gpu_marked_tests()})
    xla = {"PJRT_DEVICE", "CPU_NUM_DEVICES", "XLA_FLAGS"}
    env = {**{k: v for k, v in os.environ.items() if k not in xla}, "GPU_CHECK_MODE": "cpu", "STAGES": " ".join(STAGES),
           "PY": sys.executable, "OUT": str(out), "GPU_CHECK_WORK": str(work), "GPU_CHECK_BUDGET_S": "900",
           "GPU_TESTS": " ".join(marked_files), "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.Popen(["bash", str(ROOT / "launch" / "gpu_check.sh")], env=env, cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        stdout, _ = proc.communicate(timeout=900)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # anything a stage left behind
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, stdout[-6000:]
    rows = [line.split("\t") for line in (work / "results.tsv").read_text().splitlines() if line.strip()]
    return rows, (out / "gpu_check.log").read_text(), out


@pytest.mark.slow  # shares one CPU-mode run of the check (about 40 s on 2 idle cores)
def test_every_stage_is_ok_and_the_summary_has_every_figure(check):
    rows, log, out = check
    assert [r[0] for r in rows] == STAGES, rows
    bad = {stage: status for stage, status, _ in rows if status != "ok"}
    assert not bad, f"stages not ok: {bad}\n" + log[-6000:]
    text = (out / "summary.md").read_text()
    for stage in STAGES:
        assert f"| {stage} | ok |" in text, text
    for line in ("## Device check: cpu, torch ", "first step (trace + compile + run)", "sample ok",
                 "same bits twice in-process: True", "RNG as on the CPU: True", "checkpoint round trip bitwise: True",
                 "| variant | first call cold s | first call warm s | median ms (IQR) |", "| torch_eager | ",
                 "| ember_eager | ", "qwen3_moe_tiny against its dense twin", "| moe dropless | ",
                 "MoE / dense step time"):
        assert line in text, f"{line!r} missing from summary.md:\n{text}"
    assert "===== summary (also in summary.md) =====" in log
    assert (out / "metrics_a.jsonl").is_file()


@pytest.mark.slow  # shares one CPU-mode run of the check (about 40 s on 2 idle cores)
def test_the_pytest_stage_selects_every_gpu_marked_test(check):
    _, log, _ = check
    found = summary.results_in(summary.sections(log)["t"])["gpu_tests"][-1]
    selected = {node.split("[")[0] for node in found["selected"]}
    want = gpu_marked_tests()
    assert want, "no test is marked gpu: the AST scan of tests/ is broken"
    assert selected == want, f"marked but not selected: {sorted(want - selected)}; selected but not marked: " \
                             f"{sorted(selected - want)}"
    assert found["skipped"] == len(found["selected"]) and found["failed"] == 0  # no CUDA here: each skips
    # On the device the stage runs the marker over the whole suite, not over a list of files.
    assert gpu_tests.DEFAULT_PATHS == ["tests"] and gpu_tests.pytest_args(["tests"])[:2] == ["-m", "gpu"]
    assert "$m.gpu_tests ${GPU_TESTS:-tests}" in (ROOT / "launch" / "gpu_check.sh").read_text()


def test_a_timed_out_stage_is_reported_as_a_finding_with_what_it_finished():
    first = {"variant": "torch_compiled_bf16", "phase": "cold", "first_call_s": 41.5, "first_loss": 10.9}
    log = ("===== [b1] 10:00:00 timeout 200s: python -m ember.launch.device_check.step_compare --phase cold\n"
           f"RESULT compare_first_call {json.dumps(first)}\n"
           "Fatal Python error: Aborted\n\nThread 0x1 (most recent call first):\n  File \"inductor.py\", line 1\n"
           "===== [b1] TIMEOUT after 200s, 200.1s\n")
    text = summary.summarize(log, [["b1", "TIMEOUT after 200s", "200.1"]], [], command="make gpu-check", mode="gpu")
    assert "| b1 | TIMEOUT after 200s | 200.1 | Fatal Python error: Aborted; first calls done: torch_compiled_bf16 " \
           "41.5 s |" in text, text
    assert "| torch_compiled_bf16 | 41.5 | - | - | - | - | - |" in text, text


_STARTS_RANKS = re.compile(r"\"--nproc-per-node\"|\bmp\.spawn\(|\bstart_processes\(")


def test_tests_that_start_ranks_hide_the_gpus_from_them():
    """N ranks on a host with fewer GPUs would each take GPU 0 (NCCL refuses): they run over gloo on the CPU."""
    offenders = [p.relative_to(ROOT).as_posix() for p in sorted(TESTS.rglob("*.py"))
                 if _STARTS_RANKS.search(p.read_text()) and "CUDA_VISIBLE_DEVICES" not in p.read_text()]
    assert not offenders, (f"these tests start several processes but leave the GPUs visible: {offenders}; "
                           "set CUDA_VISIBLE_DEVICES=\"\" in the ranks' environment (as tests/launch/test_torchrun.py "
                           "does)")
