"""Measurement code behind `launch/bench.py`: the setup, the step variants, timing, FLOPs, memory.

Public names: `Setup`, `Variant`, `build_setup`, `build_variant`, `VARIANTS`, `default_variants`,
`TorchLM`, `jax_params`, `jax_loss_fn`, `initial_losses`, `time_round_robin`, `summarize`, `results`,
`matmul_peak`, `flops_per_token`, `machine_info`, `memory_child`, `xla_child`, `markdown_section`,
`update_markdown`.

Every variant trains the same model (same weights, same batch, AdamW with the run config's
hyperparameters at a constant learning rate, global-norm clipping at 1.0, weight decay on matrices
only) and exposes `step()`, one synchronous training step. `launch/` is not an installed package:
`bench.py` imports this file from its own folder. The plain-JAX model (`_jax_forward`) is written
from the same equations as `ember.models` (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU;
GPT-2: LayerNorm, GELU, learned positions) and runs on the same weights, converted through numpy.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import gc
import math
import os
import platform
import statistics
import time
from typing import Any, Callable, Dict, Iterator, List, Optional

import torch
import torch.nn.functional as F

from ember.core.pytree import tree_flatten, tree_leaves, tree_leaves_with_path, tree_map, tree_unflatten

_FAST_INIT_ABOVE = 20_000_000  # params; ember's counter-RNG init of 129M params takes ~60 s on 2 cores


@dataclasses.dataclass
class Setup:
    """What every variant shares: config, model, initial params, one batch, device."""

    cfg: Any
    model: Any
    params: Any
    batch: Dict[str, torch.Tensor]
    device: torch.device
    init: str


@dataclasses.dataclass
class Variant:
    """One way to run the training step: `step()` runs one step to completion and returns the loss."""

    name: str
    step: Callable[[], Any]
    state_bytes: Callable[[], int]
    clear: Callable[[], None] = lambda: None  # drop what is held between steps but not state (grads)
    notes: str = ""
    device: str = "cpu"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_setup(cfg: Any, *, device: torch.device, init: str = "auto") -> Setup:
    """The model, its initial params (ember init, or a seeded `torch.randn` one for big models) and a batch."""
    import ember.models as models
    from ember.core import random

    model = models.build_model(cfg.family, cfg.model)
    models.check_lm_data(model, seq_len=cfg.data.seq_len)
    shapes = model.param_shapes()
    n = sum(t.numel() for t in tree_leaves(shapes))
    if init == "auto":
        init = "fast" if n > _FAST_INIT_ABOVE else "ember"
    if init == "ember":
        params = model.init(random.key(cfg.seed))
    else:  # values do not matter for timing: N(0, init_std) matrices, unit norm weights, zero biases
        gen, std = torch.Generator().manual_seed(cfg.seed), cfg.model.init_std

        def fill(path: str, meta: torch.Tensor) -> torch.Tensor:
            if path.endswith("bias"):
                return torch.zeros(meta.shape, dtype=meta.dtype)
            if meta.dim() == 1:
                return torch.ones(meta.shape, dtype=meta.dtype)
            return torch.randn(meta.shape, generator=gen, dtype=meta.dtype) * std

        leaves, spec = tree_flatten(shapes)
        paths = [p for p, _ in tree_leaves_with_path(shapes)]
        params = tree_unflatten([fill(p, t) for p, t in zip(paths, leaves)], spec)
    gen = torch.Generator().manual_seed(1234)
    b, t = cfg.data.batch_size, cfg.data.seq_len
    tokens = torch.randint(0, cfg.model.vocab_size, (b, t + 1), generator=gen)  # (B, T+1)
    batch = {"inputs": tokens[:, :-1].contiguous(), "targets": tokens[:, 1:].contiguous()}  # (B, T) each
    to = lambda x: x.to(device)  # noqa: E731
    return Setup(cfg, model, tree_map(to, params), tree_map(to, batch), device, init)


def _optim_cfg(cfg: Any, schedule: str = "constant") -> Any:
    return dataclasses.replace(cfg.optim, name="adamw", schedule=schedule, clip_norm=1.0)


# ---- ember ---------------------------------------------------------------------------------


@contextlib.contextmanager
def _patches_disabled() -> Iterator[None]:
    """`EMBER_DISABLE_PATCHES=all` within the block: ember's torch patches stay off (core/compat)."""
    before = os.environ.get("EMBER_DISABLE_PATCHES")
    os.environ["EMBER_DISABLE_PATCHES"] = "all"
    try:
        yield
    finally:
        if before is None:
            del os.environ["EMBER_DISABLE_PATCHES"]
        else:
            os.environ["EMBER_DISABLE_PATCHES"] = before


def _ember(s: Setup, *, backend: str, donate: str = "state", compute_dtype: Optional[torch.dtype] = None,
           skip_nonfinite: bool = True, patches: bool = True, **jit_options: Any) -> Variant:
    from ember.core import TrainState, jit, random
    from ember.core.step_fns import train_step
    from ember.core.tree_math import tree_bytes
    from ember.models import lm_loss
    from ember.optim.config import from_config

    tx = from_config(_optim_cfg(s.cfg), total_steps=10_000)
    params = tree_map(torch.clone, s.params)
    box = [TrainState.create(params=params, tx=tx, key=random.key(s.cfg.seed, device=s.device))]
    step = jit(train_step(lm_loss(s.model), skip_nonfinite=skip_nonfinite, compute_dtype=compute_dtype),
               backend=backend, donate=donate, **jit_options)

    def run() -> torch.Tensor:
        with contextlib.nullcontext() if patches else _patches_disabled():  # read while compiling
            box[0], metrics = step(box[0], s.batch)
        _sync(s.device)
        return metrics["loss"]

    return Variant("", run, lambda: tree_bytes(box[0]), device=s.device.type,
                   notes=f"ember.core.jit(train_step(skip_nonfinite={skip_nonfinite}), backend={backend!r}, "
                         f"donate={donate!r}{''.join(f', {k}={v!r}' for k, v in jit_options.items())})"
                         + ("" if patches else ", EMBER_DISABLE_PATCHES=all"))


# ---- idiomatic PyTorch on the same model ----------------------------------------------------


class TorchLM(torch.nn.Module):
    """The ember model as a `torch.nn.Module`: ember params as `nn.Parameter`s, forward = `model.apply` + CE."""

    def __init__(self, model: Any, params: Any) -> None:
        super().__init__()
        leaves, self._spec = tree_flatten(params)
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(t.detach().clone()) for t in leaves])
        self.model = model

    def forward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.apply(tree_unflatten(list(self.weights), self._spec), inputs)  # (B, T, V)
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _torch(s: Setup, *, compile: bool, impl: str = "auto", autocast: Optional[torch.dtype] = None) -> Variant:
    module = TorchLM(s.model, s.params)
    o = _optim_cfg(s.cfg)
    groups = [{"params": [p for p in module.parameters() if p.dim() >= 2], "weight_decay": o.weight_decay},
              {"params": [p for p in module.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    kw = dict(lr=o.learning_rate, betas=(o.b1, o.b2), eps=o.eps)
    opt = None
    if impl in ("auto", "fused"):
        try:
            opt, impl = torch.optim.AdamW(groups, fused=True, **kw), "fused"
        except (RuntimeError, ValueError):  # no fused kernel for this device
            if impl == "fused":
                raise
    if opt is None:
        opt, impl = torch.optim.AdamW(groups, foreach=True, **kw), "foreach"
    fwd = torch.compile(module) if compile else module
    params = list(module.parameters())

    def run() -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast(s.device.type, dtype=autocast, enabled=autocast is not None):
            loss = fwd(s.batch["inputs"], s.batch["targets"])
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        _sync(s.device)
        return loss.detach()

    def state_bytes() -> int:
        held = params + [t for st in opt.state.values() for t in st.values() if torch.is_tensor(t)]
        return sum(t.numel() * t.element_size() for t in held)

    how = "torch.compile(module)" if compile else "eager module"
    return Variant("", run, state_bytes, clear=lambda: opt.zero_grad(set_to_none=True), device=s.device.type,
                   notes=f"{how}, torch.optim.AdamW({impl})" + (f", autocast {autocast}" if autocast else ""))


# ---- plain JAX + optax ----------------------------------------------------------------------


def _jax_forward(cfg: Any, p: Any, tokens: Any) -> Any:
    """Logits (B, T, V) of ember's Llama3 / GPT2 written in jax.numpy on ember's param tree."""
    import jax
    import jax.numpy as jnp

    llama = hasattr(cfg, "rope_theta")
    b, t = tokens.shape
    h = cfg.n_heads
    kv = getattr(cfg, "n_kv_heads", h)
    d = cfg.d_model // h

    def lin(q: Any, x: Any) -> Any:
        y = x @ q["weight"].T  # torch layout (out, in)
        return y + q["bias"] if "bias" in q else y

    def norm(q: Any, x: Any) -> Any:
        if llama:  # RMSNorm
            return q["weight"] * (x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + cfg.norm_eps))
        mu = jnp.mean(x, -1, keepdims=True)
        var = jnp.mean((x - mu) ** 2, -1, keepdims=True)
        return (x - mu) * jax.lax.rsqrt(var + cfg.layer_norm_eps) * q["weight"] + q.get("bias", 0.0)

    pos = jnp.arange(t)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d)) if llama else None
    if llama:
        ang = pos[:, None].astype(jnp.float32) * inv_freq  # (T, D/2)
        ang = jnp.concatenate([ang, ang], -1)[:, None, :]  # (T, 1, D): rotate-half pairing
        cos, sin = jnp.cos(ang), jnp.sin(ang)

    def rope(x: Any) -> Any:  # (B, T, H, D)
        x1, x2 = jnp.split(x, 2, -1)
        return x * cos + jnp.concatenate([-x2, x1], -1) * sin

    def attn(q: Any, x: Any) -> Any:
        qh = lin(q["wq"], x).reshape(b, t, h, d)  # (B, T, H, D)
        kh = lin(q["wk"], x).reshape(b, t, kv, d)  # (B, T, KV, D)
        vh = lin(q["wv"], x).reshape(b, t, kv, d)
        if llama:
            qh, kh = rope(qh), rope(kh)
        kh, vh = jnp.repeat(kh, h // kv, axis=2), jnp.repeat(vh, h // kv, axis=2)  # (B, T, H, D): head i uses kv i//rep
        out = jax.nn.dot_product_attention(qh, kh, vh, is_causal=True)  # (B, T, H, D)
        return lin(q["wo"], out.reshape(b, t, h * d))

    def mlp(q: Any, x: Any) -> Any:
        if llama:
            return lin(q["down"], jax.nn.silu(lin(q["gate"], x)) * lin(q["up"], x))
        return lin(q["proj"], jax.nn.gelu(lin(q["fc"], x), approximate=cfg.activation == "gelu_tanh"))

    x = p["wte"]["weight"][tokens]  # (B, T, d)
    if not llama:
        x = x + p["wpe"]["weight"][pos]
    for blk in p["blocks"]:
        x = x + attn(blk["attn"], norm(blk["ln_1"], x))
        x = x + mlp(blk["mlp"], norm(blk["ln_2"], x))
    x = norm(p["ln_f"], x)
    head = p["lm_head"]["weight"] if "lm_head" in p else p["wte"]["weight"]
    return x @ head.T  # (B, T, V)


def jax_params(s: Setup) -> Any:
    """ember params as jax arrays (via numpy); stacked (scan_layers) blocks become a list."""
    import jax.numpy as jnp

    p = tree_map(lambda x: jnp.asarray(x.detach().cpu().numpy()), s.params)
    if isinstance(p["blocks"], dict):
        n = s.cfg.model.n_layers
        p = dict(p, blocks=[tree_map(lambda x, i=i: x[i], p["blocks"]) for i in range(n)])
    return p


def jax_loss_fn(s: Setup) -> Callable[..., Any]:
    """`loss(params, inputs, targets)`: mean next-token cross-entropy of the JAX model."""
    import jax
    import jax.numpy as jnp

    def loss(params: Any, inputs: Any, targets: Any) -> Any:
        logits = _jax_forward(s.cfg.model, params, inputs)
        logz = jax.nn.logsumexp(logits, -1)  # (B, T)
        return jnp.mean(logz - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0])

    return loss


def _jax(s: Setup) -> Variant:
    import jax
    import jax.numpy as jnp
    import optax

    o = _optim_cfg(s.cfg)
    loss_fn = jax_loss_fn(s)
    decay = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                                                  weight_decay=o.weight_decay, mask=decay))

    def step(state: Any, inputs: Any, targets: Any) -> Any:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    jstep = jax.jit(step, donate_argnums=0)
    params = jax_params(s)
    box = [(params, tx.init(params))]
    inputs, targets = (jnp.asarray(s.batch[k].cpu().numpy()) for k in ("inputs", "targets"))

    def run() -> Any:
        box[0], loss = jstep(box[0], inputs, targets)
        return loss.block_until_ready()

    nbytes = lambda: sum(x.nbytes for x in jax.tree.leaves(box[0]))  # noqa: E731
    return Variant("", run, nbytes, device=str(jax.devices()[0].platform),
                   notes="jax.jit(donate_argnums=0), optax.chain(clip_by_global_norm, adamw)")


VARIANTS: Dict[str, Callable[[Setup], Variant]] = {
    "ember_inductor_donated": lambda s: _ember(s, backend="inductor"),
    "ember_inductor": lambda s: _ember(s, backend="inductor", donate="none"),
    "ember_inductor_donated_noskip": lambda s: _ember(s, backend="inductor", skip_nonfinite=False),
    "ember_inductor_dynamo": lambda s: _ember(s, backend="inductor", tracer="dynamo"),
    "ember_inductor_nondeterministic": lambda s: _ember(s, backend="inductor", deterministic=False),
    "ember_inductor_no_patches": lambda s: _ember(s, backend="inductor", patches=False),
    "ember_eager": lambda s: _ember(s, backend="eager"),
    "ember_inductor_bf16": lambda s: _ember(s, backend="inductor", compute_dtype=torch.bfloat16),
    "torch_compiled": lambda s: _torch(s, compile=True),
    "torch_compiled_foreach": lambda s: _torch(s, compile=True, impl="foreach"),
    "torch_eager": lambda s: _torch(s, compile=False),
    "torch_compiled_bf16": lambda s: _torch(s, compile=True, autocast=torch.bfloat16),
    "jax": _jax,
}
"""Every in-process variant; `ember_xla` runs in its own process (`xla_child`)."""


def default_variants(device: torch.device) -> List[str]:
    """The variants run without `--variants`: bf16 ones only on a GPU, `jax` only if optax imports."""
    names = ["ember_inductor_donated", "ember_eager", "torch_compiled", "torch_eager"]
    if device.type == "cuda":
        names += ["ember_inductor_bf16", "torch_compiled_bf16"]
    try:
        import optax  # noqa: F401

        names.append("jax")
    except ImportError:
        pass
    return names


def build_variant(name: str, s: Setup) -> Variant:
    """Variant `name` built on `s`; unknown names list the valid ones."""
    if name not in VARIANTS:
        raise ValueError(f"unknown variant {name!r}; valid: {', '.join(sorted(VARIANTS))}, ember_xla.")
    v = VARIANTS[name](s)
    v.name = name
    return v


# ---- timing, FLOPs, summary -----------------------------------------------------------------


def time_round_robin(variants: List[Variant], *, warmup: int, iters: int) -> Dict[str, Dict[str, Any]]:
    """First call (cold compile) of each, `warmup` more rounds, then `iters` rounds with rotating order."""
    out: Dict[str, Dict[str, Any]] = {}
    for v in variants:
        t0 = time.perf_counter()
        loss = float(v.step())  # host sync
        out[v.name] = {"first_call_s": time.perf_counter() - t0, "first_loss": loss, "times": []}
    for _ in range(warmup):
        for v in variants:
            v.step()
    gc.collect()
    for i in range(iters):
        for v in variants[i % len(variants):] + variants[: i % len(variants)]:
            t0 = time.perf_counter()
            v.step()
            out[v.name]["times"].append(time.perf_counter() - t0)
    for v in variants:  # one more step each: the loss after the same number of steps
        out[v.name]["last_loss"] = float(v.step())
    return out


def matmul_peak(device: torch.device, *, reps: int = 10) -> Dict[str, Any]:
    """Best achieved FLOP/s of a large matmul (fp32 2048^3 on CPU, bf16 8192^3 on a GPU) over `reps` tries.

    On a shared machine any one try can be slowed by other processes; the best one is the peak.
    """
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (2048, torch.float32)
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    _sync(device)
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        a @ b
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return {"flops": 2 * n**3 / best, "matmul": f"{n}x{n}x{n} {str(dtype).replace('torch.', '')}"}


def flops_per_token(s: Setup) -> Dict[str, float]:
    """Training FLOPs per token, `6 N + 12 L d T` (PaLM, Chowdhery et al. 2022, appendix B).

    N counts the parameters that take part in a matmul: all except learned position tables and an
    untied input embedding (a lookup). 12 L d T is attention's QK^T and AV (forward + backward),
    counted without causal halving, as PaLM does.
    """
    c = s.cfg.model
    n = sum(t.numel() for t in tree_leaves(s.params))
    n -= s.params["wpe"]["weight"].numel() if "wpe" in s.params else 0
    n -= s.params["wte"]["weight"].numel() if "lm_head" in s.params else 0
    return {"n_matmul_params": n, "flops_per_token": 6 * n + 12 * c.n_layers * c.d_model * s.cfg.data.seq_len}


def _pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * q
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(timed: Dict[str, Dict[str, Any]], *, tokens: int, flops_tok: float, peak: float,
              baseline: str) -> Dict[str, Dict[str, Any]]:
    """Per variant: median/IQR ms, tokens/s, FLOP/s, MFU, ratio to `baseline`, first-call seconds, losses."""
    out = {}
    for name, r in timed.items():
        med = statistics.median(r["times"])
        out[name] = {"median_ms": 1e3 * med, "p25_ms": 1e3 * _pct(r["times"], 0.25),
                     "p75_ms": 1e3 * _pct(r["times"], 0.75), "tokens_per_s": tokens / med,
                     "flops_per_s": flops_tok * tokens / med, "mfu": flops_tok * tokens / med / peak,
                     "first_call_s": r["first_call_s"], "first_loss": r["first_loss"],
                     "last_loss": r["last_loss"], "times_ms": [1e3 * t for t in r["times"]]}
    base = out.get(baseline)
    for r in out.values():
        r["ratio_vs_baseline"] = r["median_ms"] / base["median_ms"] if base else None
    return out


def initial_losses(s: Setup, *, jax: bool) -> Dict[str, float]:
    """Loss of ember's model at the initial params (no key), and of the JAX model on the same weights."""
    from ember.models import lm_loss

    with torch.no_grad():
        out = {"ember": float(lm_loss(s.model)(s.params, s.batch, key=None)[0])}
    if jax:
        import jax as _jax

        inputs, targets = (s.batch[k].cpu().numpy() for k in ("inputs", "targets"))
        out["jax"] = float(_jax.jit(jax_loss_fn(s))(jax_params(s), inputs, targets))
        out["abs_diff"] = abs(out["jax"] - out["ember"])
    return out


def results(s: Setup, timed: Dict[str, Dict[str, Any]], *, peak: Dict[str, Any], **extra: Any) -> Dict[str, Any]:
    """The results dict written as JSON: setup, machine, peak, FLOPs and the per-variant summary."""
    fl = flops_per_token(s)
    tokens = s.cfg.data.batch_size * s.cfg.data.seq_len
    baseline = "torch_compiled" if "torch_compiled" in timed else next(iter(timed))
    return {**extra, "machine": machine_info(), "model": f"{s.cfg.family} {s.cfg.model}", "init": s.init,
            "n_params": sum(t.numel() for t in tree_leaves(s.params)), "batch": s.cfg.data.batch_size,
            "seq_len": s.cfg.data.seq_len, "tokens_per_step": tokens, "device": str(s.device), "peak": peak,
            **fl, "baseline": baseline,
            "variants": summarize(timed, tokens=tokens, flops_tok=fl["flops_per_token"], peak=peak["flops"],
                                  baseline=baseline)}


def machine_info() -> Dict[str, Any]:
    """Platform, torch version, CPU count, GPU name, date, and how bench.py set up glibc's malloc."""
    return {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "malloc": os.environ.get("EMBER_BENCH_MALLOC", "default"),
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M")}


# ---- memory and XLA, each in a fresh process ------------------------------------------------


def _rss(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def memory_child(s: Setup, name: str, *, warmup: int = 2, steps: int = 3) -> Dict[str, Any]:
    """Transient memory at peak of variant `name`: peak during steady steps minus what is held between them.

    CPU: the kernel's RSS high-water mark (`VmHWM`) is reset after the compile and warm-up steps
    (`/proc/self/clear_refs` = 5), so compiler memory does not count; the baseline is RSS after
    warm-up with gradients freed (run under a fixed `MALLOC_MMAP_THRESHOLD_`, so freed tensors
    leave RSS). `getrusage(RUSAGE_SELF).ru_maxrss` cannot serve: it counts the compiler's peak, and
    Linux carries it across fork + exec (every child reported its parent's 2.1 GiB here). GPU:
    `max_memory_allocated` after `reset_peak_memory_stats`, minus `memory_allocated`.
    """
    rss_start = _rss()
    v = build_variant(name, s)
    rss_state = _rss()
    first = time.perf_counter()
    v.step()
    first = time.perf_counter() - first
    for _ in range(warmup):
        v.step()
    v.clear()
    gc.collect()
    out: Dict[str, Any] = {"variant": name, "state_bytes": v.state_bytes(), "rss_before_state": rss_start,
                           "rss_after_state": rss_state, "first_call_s": first}
    cuda = v.device == "cuda"
    if cuda:
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    else:
        base = _rss()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
    for _ in range(steps):
        v.step()
    peak = torch.cuda.max_memory_allocated() if cuda else _rss("VmHWM")
    out.update(kind="cuda_allocated" if cuda else "cpu_rss", baseline_bytes=base, peak_bytes=peak,
               transient_bytes=peak - base)
    return out


def first_call_child(s: Setup, name: str) -> Dict[str, Any]:
    """Seconds from building variant `name` to the end of its first step (trace, compile or cache load, run)."""
    start = time.perf_counter()
    build_variant(name, s).step()
    return {"variant": name, "first_call_s": time.perf_counter() - start}


def xla_child(s: Setup, *, steps: int) -> Dict[str, Any]:
    """ember's step under `backend="xla"` with a warmup-cosine lr: compile count/time and steady step time."""
    import torch_xla

    from ember.core import TrainState, jit, random, xla
    from ember.core.step_fns import train_step
    from ember.models import lm_loss
    from ember.optim.config import from_config

    dev = torch_xla.device()  # start the runtime before any backward pass
    tx = from_config(_optim_cfg(s.cfg, "warmup_cosine"), total_steps=steps + 1)
    state = TrainState.create(params=tree_map(lambda x: x.to(dev), s.params), tx=tx, key=random.key(s.cfg.seed, device=dev))
    batch = tree_map(lambda x: x.to(dev), s.batch)
    step = jit(train_step(lm_loss(s.model), skip_nonfinite=True), backend="xla", donate="state")
    c0 = xla.compile_count()
    t0 = time.perf_counter()
    state, m = step(state, batch)
    first_loss, lrs = float(m["loss"].cpu()), [float(m["lr"].cpu())]  # host sync
    first = time.perf_counter() - t0
    after_first, global_after_first = step.compile_count, xla.compile_count() - c0
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        state, m = step(state, batch)
        lrs.append(float(m["lr"].cpu()))  # host sync: waits for the step
        times.append(time.perf_counter() - t0)
    return {"first_call_s": first, "first_loss": first_loss, "last_loss": float(m["loss"].cpu()),
            "compiles_first_call": after_first, "compiles_after_first_call": step.compile_count - after_first,
            "xla_compiles_global_first": global_after_first,
            "xla_compiles_global_after": xla.compile_count() - c0 - global_after_first,
            "steps": steps, "median_ms": 1e3 * statistics.median(times), "p25_ms": 1e3 * _pct(times, 0.25),
            "p75_ms": 1e3 * _pct(times, 0.75), "lr_first": lrs[0], "lr_max": max(lrs), "lr_last": lrs[-1]}


# ---- Markdown -------------------------------------------------------------------------------


def _mib(x: Optional[float]) -> str:
    return "" if x is None else f"{x / 2**20:.1f}"


def markdown_section(res: Dict[str, Any]) -> str:
    """The `## <config>` section for BENCHMARKS.md: command, machine, table, memory, XLA, losses."""
    m, base = res["machine"], res["baseline"]
    lines = [f"## {res.get('title', res['config'])}", "", f"`{res['command']}`", "",
             f"{m['date']}; {m['platform']}; torch {m['torch']}; {m['cpu_count']} CPUs ({m['torch_threads']} torch "
             f"threads){'; GPU ' + m['gpu'] if m['gpu'] else ''}"
             f"; malloc: {m.get('malloc', 'default')}. Model: {res['model']}; batch {res['batch']} x "
             f"seq {res['seq_len']}; {res['n_params'] / 1e6:.2f}M params ({res['init']} init). Peak: "
             f"{res['peak']['flops'] / 1e9:.1f} GFLOP/s ({res['peak']['matmul']} matmul). FLOPs/token "
             f"{res['flops_per_token'] / 1e6:.2f}M (6N + 12LdT). {res['iters']} timed rounds after {res['warmup']} "
             f"warm-up, round-robin in one process; the machine is shared, so numbers are noisy.", "",
             f"| variant | median ms | IQR ms | vs {base} | tokens/s | GFLOP/s | MFU | first call s | first loss "
             f"| transient MiB | state MiB |", "|" + "---|" * 11]
    mem = res.get("memory", {})
    for name, r in res["variants"].items():
        mm = mem.get(name, {})
        ratio = "" if r["ratio_vs_baseline"] is None else f"{r['ratio_vs_baseline']:.2f}x"
        lines.append(f"| {name} | {r['median_ms']:.1f} | {r['p25_ms']:.1f}-{r['p75_ms']:.1f} | {ratio} | "
                     f"{r['tokens_per_s']:,.0f} | {r['flops_per_s'] / 1e9:.2f} | {100 * r['mfu']:.1f}% | "
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
    text = open(path).read() if os.path.exists(path) else _INTRO
    parts = text.split("\n## ")
    head, sections = parts[0], ["## " + p for p in parts[1:]]
    sections = [p for p in sections if p.splitlines()[0] != title]
    sections.append(section)
    with open(path, "w") as f:
        f.write(head.rstrip("\n") + "\n\n" + "\n".join(p.rstrip("\n") + "\n" for p in sections))
