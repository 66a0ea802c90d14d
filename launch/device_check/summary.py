"""The device check's last word: one row per stage, then the figures, as Markdown for BENCHMARKS.md.

    python launch/device_check/summary.py --log OUT/gpu_check.log --results WORK/results.tsv --out OUT

Reads the stages' statuses (`results.tsv`: stage, status, wall seconds), their `RESULT <name> {json}`
lines and output from the log (split at the `===== [stage]` lines `launch/gpu_check.sh` writes),
and `OUT/metrics_a.jsonl`; prints the tables and writes them to `OUT/summary.md`. A stage that
failed or timed out is a finding: its row says what it printed last.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
from typing import Any, Dict, List, Optional

RESULT_PREFIX = "RESULT "  # common.RESULT_PREFIX; this module imports nothing of ember, so it runs as a script
_START = re.compile(r"^===== \[(\w+)\] \d\d:\d\d:\d\d timeout", re.M)
_CAUSE = re.compile(r"^(Fatal Python error: .*|(\w+\.)*\w*(Error|Exception)\b.*|FATAL: .*|error: .*)$", re.M)
_SAME_DEVICE = "Expected all tensors to be on the same device"


def sections(log: str) -> Dict[str, str]:
    """`{stage: the log text from its start line to the next stage's}` (a rerun's text wins)."""
    starts = list(_START.finditer(log))
    return {m.group(1): log[m.start(): starts[i + 1].start() if i + 1 < len(starts) else len(log)]
            for i, m in enumerate(starts)}


def results_in(text: str) -> Dict[str, List[Dict[str, Any]]]:
    """`{name: [dict, ...]}` of the `RESULT name {json}` lines in `text`, in order."""
    out: Dict[str, List[Dict[str, Any]]] = {}
    for m in re.finditer(rf"^{RESULT_PREFIX}(\w+) (\{{.*\}})$", text, re.M):
        out.setdefault(m.group(1), []).append(json.loads(m.group(2)))
    return out


def cause(text: str) -> str:
    """What a failed stage said last: its result's error, else its last error-looking line."""
    for found in results_in(text).values():
        if "error" in found[-1]:
            return found[-1]["error"][:200]
    lines = _CAUSE.findall(text)
    return lines[-1][0][:200] if lines else "no error line (see the log)"


def _metrics(path: str) -> List[Dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _train(text: str, metrics: List[Dict[str, Any]]) -> str:
    first = re.search(r"^step \d+: .*?ran in ([0-9.]+)s", text, re.M)
    resumed = re.search(r"resumed from step (\d+)", text)
    losses = [(r["step"], r["loss"]) for r in metrics if "loss" in r]
    parts = [f"resumed from step {resumed.group(1)}" if resumed else "",
             f"first step (trace + compile + run) {first.group(1)} s" if first else "",
             f"loss {losses[0][1]:.4f} (step {losses[0][0]}) -> {losses[-1][1]:.4f} (step {losses[-1][0]})"
             if losses else "",
             "sample FAILED: device mismatch (a CPU key, CUDA logits)" if _SAME_DEVICE in text
             else ("sample ok" if "--- sample ---" in text else "")]
    return "; ".join(p for p in parts if p)


def _repeat(r: Dict[str, Any]) -> str:
    ck, run = r.get("checkpoint", {}), r["runs"][0]
    return (f"same bits twice in-process: {r['bitwise_same_in_process']}; first call {run['first_call_s']} s, then "
            f"{run['ms_per_step_after']} ms/step; last loss vs eager rel {r['rel_diff_last_loss_vs_eager']:.1e}, "
            f"first loss vs CPU rel {r['rel_diff_first_loss_vs_cpu']:.1e}; RNG as on the CPU: "
            f"{all(r['rng']['same_as_cpu'].values())}; checkpoint round trip bitwise: {ck.get('roundtrip_bitwise')}, "
            f"JAX started: {ck.get('jax_backends_started')}, GPU free GiB {ck.get('gpu_free_gib_before')} -> "
            f"{ck.get('gpu_free_gib_after_save')}; {len(r.get('warnings', {}))} distinct warnings")


def _finding(stage: str, status: str, text: str, metrics: List[Dict[str, Any]]) -> str:
    found = results_in(text)
    if stage in ("a", "a2"):
        done = _train(text, metrics)
        return done if status == "ok" else f"{cause(text)}; {done}"
    if status != "ok":
        first = [f"{r['variant']} {r['first_call_s']} s" for r in found.get("compare_first_call", [])]
        return cause(text) + (f"; first calls done: {', '.join(first)}" if first else "")
    if stage == "env":
        r = found["env"][-1]
        gpu = r.get("gpu", {}).get("name", r["device"])
        jax = r.get("jax_start", {})
        return (f"torch {r['torch']} (CUDA {r['cuda']}), {gpu}; {r['peak_matmul']} matmul at the start: "
                f"{r['peak_tflops']:.3g} TFLOP/s" + (f"; starting JAX took {jax['took_gib']} GiB of GPU memory" if jax else ""))
    if stage in ("c1", "c2"):
        return _repeat(found["repeat"][-1])
    if stage == "t":
        r = found["gpu_tests"][-1]
        return (f"{len(r['selected'])} selected: {r['passed']} passed, {r['failed']} failed, {r['skipped']} skipped"
                + (f"; modules that did not import: {r['collection_errors']}" if r.get("collection_errors") else ""))
    if stage == "d":
        return f"MoE / dense step time {found['moe'][-1]['moe_over_dense']:.2f}x"
    if stage == "b1":
        steady = found["compare"][-1]["steady"]
        base, last = list(steady)[0], list(steady)[-1]
        return f"{last} / {base} step time {steady[last]['median_ms'] / steady[base]['median_ms']:.2f}x"
    if stage == "b2":
        return ", ".join(f"{r['variant']} {r['first_call_s']} s" for r in found.get("compare_first_call", []))
    return ""


def _last(found: Dict[str, List[Dict[str, Any]]], name: str) -> Optional[Dict[str, Any]]:
    rows = [r for r in found.get(name, []) if "error" not in r]
    return rows[-1] if rows else None


def figures(by_stage: Dict[str, str]) -> List[str]:
    """The 125M and MoE tables, from whatever the b1, b2 and d stages printed."""
    lines: List[str] = []
    b1, b2 = results_in(by_stage.get("b1", "")), results_in(by_stage.get("b2", ""))
    cold = {r["variant"]: r["first_call_s"] for r in b1.get("compare_first_call", [])}
    warm = {r["variant"]: r["first_call_s"] for r in b2.get("compare_first_call", [])}
    steady = (_last(b1, "compare") or {}).get("steady", {})
    if cold or warm:
        c = _last(b1, "compare") or {}
        env = _last(results_in(by_stage.get("env", "")), "env") or {}
        also = (f"; env's at the start: {env['peak_tflops']:.3g}" if env.get("peak_matmul") == c.get("peak_matmul")
                and "peak_tflops" in env else "")
        lines += ["", f"{c.get('config', '125M')} ({c.get('batch', '?')} x {c.get('seq_len', '?')} tokens, "
                  f"{c.get('n_params', 0) / 1e6:.1f}M params), one process, round-robin; MFU against the "
                  f"{c.get('peak_matmul', '?')} matmul peak b1 measured in its own process, "
                  f"{c.get('peak_tflops', 0):.3g} TFLOP/s{also}:", "",
                  "| variant | first call cold s | first call warm s | median ms (IQR) | tokens/s | MFU | peak GiB "
                  "| transient GiB: a step; the first call |", "|---|---|---|---|---|---|---|---|"]
        first = {r["variant"]: r.get("first_call_transient_gib", "-") for r in b1.get("compare_first_call", [])}
        for name in dict.fromkeys([*cold, *warm]):
            s = steady.get(name)
            perf = "- | - | - | - | -" if not s else (
                f"{s['median_ms']:.1f} ({s['p25_ms']:.1f}-{s['p75_ms']:.1f}) | {s['tokens_per_s']:,.0f} | "
                f"{100 * s['mfu']:.1f}% | {s['memory'].get('peak_gib', float('nan')):.2f} | "
                f"{s['memory'].get('transient_gib', float('nan')):.2f}")
            lines.append(f"| {name} | {cold.get(name, '-')} | {warm.get(name, '-')} | {perf}; {first.get(name, '-')} |")
    moe = _last(results_in(by_stage.get("d", "")), "moe")
    if moe:
        lines += ["", f"qwen3_moe_tiny against its dense twin ({moe['dtype']}, {moe['backend']}, "
                  f"{moe['tokens_per_step']} tokens per step):", "",
                  "| model | params | first call s | median ms | tokens/s | MFU (active) | loss first -> last |",
                  "|---|---|---|---|---|---|---|"]
        for name, v in moe["variants"].items():
            lines.append(f"| {name} | {v['params']} | {v['first_call_s']} | {v['median_ms']:.2f} | "
                         f"{v['tokens_per_s']:,} | {100 * v['mfu_active']:.2f}% | {v['first_loss']:.4f} -> "
                         f"{v['last_loss']:.4f} |")
    return lines


def summarize(log: str, rows: List[List[str]], metrics: List[Dict[str, Any]], *, command: str, mode: str) -> str:
    """The Markdown text: header (machine, torch, command, date), stage table, figure tables."""
    by_stage = sections(log)
    env = _last(results_in(by_stage.get("env", "")), "env") or {}
    gpu = env.get("gpu", {}).get("name", env.get("device", "unknown device"))
    lines = [f"## Device check: {gpu}, torch {env.get('torch', '?')}", "",
             f"`{command}` (mode {mode}), {datetime.datetime.now().strftime('%Y-%m-%d %H:%M')}.", "",
             "| stage | status | wall s | finding |", "|---|---|---|---|"]
    ran = {row[0] for row in rows}
    for stage, status, wall in rows:
        text = by_stage.get(stage, "")
        run_metrics = metrics if stage == "a2" or "a2" not in ran else []  # the file holds a2's steps too
        try:
            found = _finding(stage, status, text, run_metrics) if status != "skipped (budget)" else ""
        except (KeyError, IndexError, TypeError, ZeroDivisionError) as e:
            found = f"no result line ({type(e).__name__}: {e}); {cause(text)}"
        lines.append(f"| {stage} | {status} | {wall} | {found.replace('|', '/')} |")
    return "\n".join(lines + figures(by_stage)) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--log", required=True)
    p.add_argument("--results", required=True, help="results.tsv: stage, status, wall seconds per line")
    p.add_argument("--out", required=True, help="the report folder: metrics_a.jsonl in, summary.md out")
    p.add_argument("--command", default="make gpu-check")
    p.add_argument("--mode", default="gpu")
    args = p.parse_args(argv)
    with open(args.log, errors="replace") as f:
        log = f.read()
    with open(args.results) as f:
        rows = [line.rstrip("\n").split("\t") for line in f if line.strip()]
    text = summarize(log, rows, _metrics(os.path.join(args.out, "metrics_a.jsonl")), command=args.command,
                     mode=args.mode)
    with open(os.path.join(args.out, "summary.md"), "w") as f:
        f.write(text)
    print("\n===== summary (also in summary.md) =====\n" + text, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
