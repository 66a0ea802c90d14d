"""Markdown for BENCHMARKS.md: one `## <config>` section per run, replaced in place on the next run.

Public names: `markdown_section`, `update_markdown`.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, Dict, Optional


def _mib(x: Optional[float]) -> str:
    return "" if x is None else f"{x / 2**20:.1f}"


def markdown_section(res: Dict[str, Any]) -> str:
    """The `## <config>` section for BENCHMARKS.md: command, machine, table, memory, XLA, losses."""
    m, base = res["machine"], res["baseline"]
    lines = [f"## {res.get('title', res['config'])}", "", f"`{res['command']}`", "",
             f"{m['date']}; {m['platform']}; torch {m['torch']}; {m['cpu_count']} CPUs ({m['torch_threads']} torch "
             f"threads){'; GPU ' + m['gpu'] if m['gpu'] else ''}"
             f"; malloc: {m.get('malloc', 'default')}. Model: {res['model']}; batch {res['batch']} x "
             f"seq {res['seq_len']}; {res['n_params'] / 1e6:.2f}M params ({res['init']} init). Peaks (each row's MFU "
             f"is against its own dtype's): " + ", ".join(f"{p['flops'] / 1e9:.1f} GFLOP/s ({p['matmul']} matmul)"
                                                       for p in res["peaks"].values()) + ". FLOPs/token "
             f"{res['flops_per_token'] / 1e6:.2f}M (6N + 12LdT). {res['iters']} timed rounds after {res['warmup']} "
             f"warm-up, round-robin in one process; the machine is shared, so numbers are noisy.", "",
             f"| variant | median ms | IQR ms | vs {base} | tokens/s | GFLOP/s | MFU | first call s | first loss "
             f"| transient MiB | state MiB |", "|" + "---|" * 11]
    mem = res.get("memory", {})
    for name, r in res["variants"].items():
        mm = mem.get(name, {})
        ratio = "" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.2f}x"
        lines.append(f"| {name} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} | {ratio} | "
                     f"{r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e9:.2f} | {100 * r['mfu']:.1f}% ({r['peak_dtype']}) | "
                     f"{r['first_call_s']:.1f} | {r['first_loss']:.4f} | {_mib(mm.get('transient_bytes'))} | "
                     f"{_mib(mm.get('state_bytes'))} |")
    il, last = res["initial_loss"], [r["last_loss"] for r in res["variants"].values()]
    jax = f", jax {il['jax']:.6f} (|diff| {il['abs_diff']:.2e})" if "jax" in il else ""
    lines += ["", f"Initial loss: ember {il['ember']:.6f}{jax}; loss after {res['warmup'] + res['iters'] + 2} steps: "
              f"{min(last):.4f}-{max(last):.4f} across variants. Variants: "
              + "; ".join(f"`{k}`: {v}" for k, v in res["notes"].items()) + "."]
    if mem:
        lines += ["", "Transient memory = peak during steady steps minus what is held between steps (params and "
                  "optimizer state), one fresh process per variant; gradients count as transient."]
    if "compile_times" in res:
        lines += ["", "First call (build + trace + compile or cache load + one step), each in a fresh process: "
                  "cold = empty Inductor cache, warm = the cache the cold process filled. "
                  + "; ".join(f"`{k}` {v['cold_s']:.1f} s cold, {v['warm_s']:.1f} s warm"
                              for k, v in res["compile_times"].items()) + "."]
    if "ember_xla" in res:
        x = res["ember_xla"]
        lines += ["", f"ember_xla (torch_xla, 1 virtual CPU device, warmup-cosine lr {x['lr_first']:.2e} -> "
                  f"{x['lr_max']:.2e} -> {x['lr_last']:.2e}): first call {x['first_call_s']:.1f} s with "
                  f"{x['compiles_first_call']} compile(s), {x['compiles_after_first_call']} more over {x['steps']} "
                  f"steps; median {x['median_ms']:.1f} ms (IQR {x['p25_ms']:.1f}-{x['p75_ms']:.1f})."]
    return "\n".join(lines) + "\n"


_INTRO = """# ember benchmarks

Produced by `launch/bench.py` (see its docstring). Each section is one run config; `--markdown
BENCHMARKS.md` replaces that config's section. Ratios compare median step times with idiomatic
PyTorch (`torch.compile(module)` + `torch.optim.AdamW`) on the same model, weights and batch.

"""


def update_markdown(path: str, section: str) -> None:
    """Replace the section with the same `## ` title in `path` (or append it; create the file if absent)."""
    title = section.splitlines()[0]
    text = pathlib.Path(path).read_text() if os.path.exists(path) else _INTRO
    parts = text.split("\n## ")
    head, sections = parts[0], ["## " + p for p in parts[1:]]
    sections = [p for p in sections if p.splitlines()[0] != title]
    sections.append(section)
    with open(path, "w") as f:
        f.write(head.rstrip("\n") + "\n\n" + "\n".join(p.rstrip("\n") + "\n" for p in sections))
