"""The plain-JAX baseline: ember's Llama3 / GPT-2 in `jax.numpy`, trained with `jax.jit` + optax.

Public names: `jax_params`, `jax_loss_fn`, `jax_variant`, `initial_losses`.

An independent baseline, not ember code: the model is written from the same equations as
`ember.models` (RMSNorm, rotate-half RoPE, GQA causal attention, SwiGLU; GPT-2: LayerNorm, GELU,
learned positions) and runs on the same weights, converted through numpy. `initial_losses` checks
that both give the same loss. jax and optax are imported only when used. The baseline runs on JAX's
default device (the GPU when JAX has CUDA) and says which in its notes and `Variant.device`; it
allocates GPU memory as it needs it, never 75% up front, so the torch variants in the same process
keep theirs.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict

import torch

from ember.core.pytree import tree_map
from ember.models import lm_loss

from .setup import Setup, Variant, bench_optim_config


def _start_jax() -> Any:
    """`jax`, started without preallocating GPU memory (unless the user set XLA_PYTHON_CLIENT_PREALLOCATE)."""
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # read when the GPU backend starts
    import jax

    return jax


def jax_device() -> str:
    """Where the JAX baseline runs, e.g. `"gpu (cuda:0)"` or `"cpu (TFRT_CPU_0)"`."""
    device = _start_jax().devices()[0]
    return f"{device.platform} ({device})"


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


def jax_variant(s: Setup) -> Variant:
    """The JAX model trained by `jax.jit(step, donate_argnums=0)` with `optax.chain(clip_by_global_norm, adamw)`."""
    jax = _start_jax()
    import jax.numpy as jnp
    import optax

    o = bench_optim_config(s.cfg)
    loss_fn = jax_loss_fn(s)
    decay = lambda tree: jax.tree.map(lambda x: x.ndim >= 2, tree)  # noqa: E731
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(o.learning_rate, b1=o.b1, b2=o.b2, eps=o.eps,
                                                                  weight_decay=o.weight_decay, mask=decay))

    def step(state: Any, inputs: Any, targets: Any) -> Any:
        params, opt_state = state
        loss, grads = jax.value_and_grad(loss_fn)(params, inputs, targets)
        updates, opt_state = tx.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), loss

    where = jax_device()
    jstep = jax.jit(step, donate_argnums=0)
    params = jax_params(s)
    box = [(params, tx.init(params))]
    inputs, targets = (jnp.asarray(s.batch[k].cpu().numpy()) for k in ("inputs", "targets"))

    def run() -> Any:
        box[0], loss = jstep(box[0], inputs, targets)
        return loss.block_until_ready()

    nbytes = lambda: sum(x.nbytes for x in jax.tree.leaves(box[0]))  # noqa: E731
    return Variant("", run, nbytes, device=where.split()[0],
                   notes=f"jax.jit(donate_argnums=0), optax.chain(clip_by_global_norm, adamw), on JAX device {where}")


def initial_losses(s: Setup, *, jax: bool) -> Dict[str, float]:
    """Loss of ember's model at the initial params (no key), and of the JAX model on the same weights."""
    with torch.no_grad():
        out = {"ember": float(lm_loss(s.model)(s.params, s.batch, key=None).mean())}
    if jax:
        _jax = _start_jax()

        inputs, targets = (s.batch[k].cpu().numpy() for k in ("inputs", "targets"))
        out["jax"] = float(_jax.jit(jax_loss_fn(s))(jax_params(s), inputs, targets))
        out["abs_diff"] = abs(out["jax"] - out["ember"])
        out["jax_device"] = jax_device()
    return out
