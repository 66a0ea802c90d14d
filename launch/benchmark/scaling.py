"""Child-process measurements for `launch/bench_scale.py`: loss and step memory, cold compile time.

Public names: `loss_memory_child`, `compile_child`, `step_memory_child`, `scan_steady_child`,
`generate_child`, `packed_attention_child`.

Each runs in a fresh process (started by `bench_scale.py` with a pinned `MALLOC_MMAP_THRESHOLD_`, so
freed tensors leave the resident set, and with its own empty Inductor cache for compile times).
"""

from __future__ import annotations

import gc
import time
from typing import Any, Dict, Sequence

import torch

from ember.core import TrainState, jit, random
from ember.core.step_fns import chunked_cross_entropy, cross_entropy, train_step
from ember.core.transforms import value_and_grad

from .children import memory_peak


def loss_memory_child(variant: str, *, vocab: int, tokens: int, d_model: int, chunk_size: int,
                      backend: str = "inductor") -> Dict[str, Any]:
    """Transient memory at peak of the compiled loss + gradient w.r.t. hidden states and head weight.

    `variant` is `plain` (whole `(tokens, vocab)` fp32 logits, `cross_entropy`) or `chunked`
    (`chunked_cross_entropy`, `chunk_size` tokens at a time). CPU: VmHWM reset after warm-up minus
    RSS before the measured call; GPU: `max_memory_allocated` minus `memory_allocated`.
    """
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    k = random.split(random.key(0), 3)
    leaves = {"hidden": random.normal(k[0], (tokens, d_model)).to(device),
              "weight": (random.normal(k[1], (vocab, d_model)) * 0.02).to(device)}
    labels = random.randint(k[2], (tokens,), 0, vocab).to(device)

    def head(p, h):
        return h @ p["weight"].T

    def loss(p):
        if variant == "plain":
            return cross_entropy(head(p, p["hidden"]), labels, reduction="sum_and_count").mean()
        out = chunked_cross_entropy(head, {"weight": p["weight"]}, p["hidden"], labels, chunk_size=chunk_size)
        return out.mean()

    fn = value_and_grad(loss)
    fn = jit(fn, backend=backend) if backend != "eager" else fn
    for _ in range(2):  # compile, then one warm call
        fn(leaves)
    gc.collect()
    out = []
    base, peak = memory_peak(lambda: out.append(fn(leaves)), cuda=device.type == "cuda")
    return {"variant": variant, "vocab": vocab, "tokens": tokens, "d_model": d_model, "chunk_size": chunk_size,
            "transient_bytes": peak - base, "logits_bytes": tokens * vocab * 4, "loss": float(out[0][0])}


def _step_and_inputs(config: Any, *, backend: str, donate: str = "none"):
    """`config`'s compiled train step (AdamW) with a fresh state and one random batch, on `backend`'s device."""
    import ember.models as models
    from ember import optim

    model = models.build_model(config.family, config.model)
    params = model.init(random.key(0))
    b, t = config.data.batch_size, config.data.seq_len
    tokens = random.randint(random.key(1), (b, t + 1), 0, config.model.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    state = TrainState.create(params=params, tx=optim.adamw(1e-3), key=random.key(2))
    step = jit(train_step(models.lm_loss(model), microbatches=config.microbatches), backend=backend, donate=donate)
    if backend == "xla":
        from ember.core.device import device_for, to_device

        dev = device_for("xla")
        state, batch = to_device(state, dev), to_device(batch, dev)
    return step, state, batch


def compile_child(config: Any, *, backend: str = "inductor") -> Dict[str, Any]:
    """Seconds of the first call of the compiled train step (trace + compile + run) for `config`, and
    of the second call (run only): their difference is the compile time, which the run time of a
    deeper or more accumulated step does not inflate."""
    step, state, batch = _step_and_inputs(config, backend=backend)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        _, metrics = step(state, batch)
        loss = float(metrics["loss"].cpu())  # host sync: the step has run
        times.append(time.perf_counter() - start)
    return {"first_call_s": times[0], "warm_call_s": times[1], "loss": loss}


def step_memory_child(config: Any) -> Dict[str, Any]:
    """Transient memory at peak of `config`'s compiled train step (Inductor, state donated), after two warm calls.

    Measured as in `loss_memory_child`; it includes the gradients and the optimizer's temporaries
    (the same for every remat policy) and every activation kept for the backward pass.
    """
    step, state, batch = _step_and_inputs(config, backend="inductor", donate="state")
    for _ in range(2):  # compile, then one warm call
        state, metrics = step(state, batch)
    gc.collect()
    out = []
    base, peak = memory_peak(lambda: out.append(step(state, batch)), cuda=False)
    return {"transient_bytes": peak - base, "loss": float(out[0][1]["loss"])}


def scan_steady_child(configs: Dict[str, Any], *, rounds: int = 5, calls: int = 5) -> Dict[str, Any]:
    """Median warm step seconds of each config's compiled train step, all built in this process and
    timed alternately (`rounds` rounds of `calls` calls each), with each one's first loss."""
    runs = {}
    for name, config in configs.items():
        step, state, batch = _step_and_inputs(config, backend="inductor", donate="state")
        for _ in range(3):  # compile, then warm calls
            state, metrics = step(state, batch)
        runs[name] = [step, state, batch, float(metrics["loss"])]
    times: Dict[str, list] = {name: [] for name in configs}
    for _ in range(rounds):
        for name, run in runs.items():
            step, state, batch, _ = run
            start = time.perf_counter()
            for _ in range(calls):
                state, metrics = step(state, batch)
            float(metrics["loss"])  # host sync
            times[name].append((time.perf_counter() - start) / calls)
            run[1] = state
    return {name: {"step_s": sorted(times[name])[rounds // 2], "loss": runs[name][3]} for name in configs}


def generate_child(config: Any, *, new_tokens: int, prompt_len: int = 16) -> Dict[str, Any]:
    """Tokens per second of greedy generation of `new_tokens` tokens after a `prompt_len`-token prompt:
    ember's uncached loop (the whole prefix again for every token, eager), and the KV-cache `Decoder`
    eager and compiled (Inductor; timed after a warm-up generation, so compiling is not counted)."""
    import ember.models as models
    from ember.core.step_fns import generate
    from ember.models.generation import Decoder

    longest = max(config.model.max_seq_len, prompt_len + new_tokens)  # room for the whole generation
    model = models.build_model(config.family, config.model.replace(max_seq_len=longest))
    params = model.init(random.key(0))
    prompt = random.randint(random.key(1), (1, prompt_len), 0, config.model.vocab_size)
    runs = {"uncached": lambda: generate(model.apply, params, prompt, max_new_tokens=new_tokens, temperature=0.0)}
    for backend in ("eager", "inductor"):
        decoder = Decoder(model, backend=backend)
        runs[f"cached_{backend}"] = (lambda d: lambda: d.generate(params, prompt, max_new_tokens=new_tokens,
                                                                    temperature=0.0))(decoder)
    out: Dict[str, Any] = {}
    with torch.no_grad():
        for name, run in runs.items():
            run()  # warm-up (compiles the cached_inductor pair)
            start = time.perf_counter()
            tokens = run()
            out[name] = {"tokens_per_s": new_tokens / (time.perf_counter() - start), "tokens": tokens}
    reference = out["uncached"]["tokens"]
    return {name: {"tokens_per_s": r["tokens_per_s"], "same_tokens": bool(torch.equal(r.pop("tokens"), reference))}
            for name, r in out.items()}


def packed_attention_child(*, seq_len: int, batch: int = 2, heads: int = 8, head_dim: int = 64, docs: int = 4,
                           rounds: int = 5, flags: Sequence[str] = ()) -> Dict[str, Any]:
    """Seconds of compiled attention forward + backward (`value_and_grad`, Inductor) at `seq_len`:
    unmasked causal, packed (`docs` documents a row: `dot_product_attention` with `segment_ids`, and
    the same mask in one SDPA call) and the dense fallback (scores, softmax, @ v, as
    `dot_product_attention` computes under DTensor with a mask)."""
    from ember.models.layers.attention import _explicit_attention, attention_mask, dot_product_attention

    k = random.split(random.key(0), 3)
    q, kk, v = (random.normal(k[i], (batch, heads, seq_len, head_dim)) for i in range(3))
    segment_ids = (torch.arange(seq_len) * docs // seq_len)[None].expand(batch, seq_len) + 1
    variants = {
        "unmasked": lambda q, k, v: dot_product_attention(q, k, v),
        "packed": lambda q, k, v: dot_product_attention(q, k, v, segment_ids=segment_ids),
        "packed_one_call": lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask(seq_len, segment_ids=segment_ids)),
        "dense": lambda q, k, v: _explicit_attention(q, k, v, attention_mask(seq_len, segment_ids=segment_ids),
                                                     causal=True, dropout=0.0, key=None),
    }
    fns = {name: jit(value_and_grad(lambda qkv, f=f: f(*qkv).square().mean()), backend="inductor")
           for name, f in variants.items()}
    times: Dict[str, list] = {name: [] for name in fns}
    for fn in fns.values():
        fn((q, kk, v))  # compile
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn((q, kk, v))
            times[name].append(time.perf_counter() - start)
    out = {name: sorted(t)[rounds // 2] for name, t in times.items()}
    return {**out, **_packed_step_times(seq_len, docs=docs, rounds=rounds, flags=flags)}


def _packed_step_times(seq_len: int, *, docs: int, rounds: int, flags: Sequence[str]) -> Dict[str, float]:
    """Median seconds of `llama3_tiny`'s compiled train step (`flags`: run-config overrides) at `seq_len`,
    batch 2: plain windows, and the same tokens as `docs` packed documents a row (`segment_ids`,
    restarting `positions`)."""
    from ember.launch.run_config import parse_cli

    config = parse_cli("llama3_tiny", [*flags, f"--data.seq_len={seq_len}", "--data.batch_size=2",
                                       f"--model.max_seq_len={seq_len}"])
    step, state, batch = _step_and_inputs(config, backend="inductor", donate="state")
    doc = (torch.arange(seq_len) * docs // seq_len)[None].expand(2, seq_len)
    starts = torch.searchsorted(doc[0].contiguous(), torch.arange(docs))  # each document's first position
    packed = {**batch, "segment_ids": doc + 1, "positions": torch.arange(seq_len)[None] - starts[doc]}
    times: Dict[str, list] = {"step_unmasked": [], "step_packed": []}
    for name, b in (("step_unmasked", batch), ("step_packed", packed)):
        for _ in range(2):  # compile, warm
            state, _ = step(state, b)
    for _ in range(rounds):
        for name, b in (("step_unmasked", batch), ("step_packed", packed)):
            start = time.perf_counter()
            state, metrics = step(state, b)
            float(metrics["loss"])
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[rounds // 2] for name, t in times.items()}
