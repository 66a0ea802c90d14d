"""Generation with a KV cache for the Llama-layout families (Llama 3, Qwen2, Qwen3, Mistral, Gemma, and the
mixtures of experts built on them: Qwen3-MoE, dots1, Mixtral, DeepSeek-V3).

Public names: `Decoder`, `init_cache`, `prefill`, `decode_step`.

`prefill(model, cache, params, prompt)` runs the prompt once and fills the cache;
`decode_step(model, cache, params, token, position)` runs one new token against it. Both are pure
`(cache, params, tokens, position) -> (cache, logits (B, V))` functions: the cache is a pytree of
fixed-size buffers (`ember.models.layers.kv_cache`, laid out as the model's `cache_widths()` says:
keys and values, or DeepSeek-V3's latents) and `position` a 0-d tensor, so the compiled
decode step is one graph for every position, and the cache can be donated to it. `Decoder` compiles
both once per model and samples with them (greedy, temperature, top-k, top-p, stop tokens).

Example:
    >>> import torch
    >>> from ember.core import random
    >>> from ember.models import build_model
    >>> model = build_model("llama3", "tiny")
    >>> params = model.init(random.key(0))
    >>> decoder = Decoder(model, backend="eager")
    >>> out = decoder.generate(params, torch.tensor([[1, 2, 3]]), max_new_tokens=5, temperature=0.0)
    >>> out.shape
    torch.Size([1, 8])
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core import random
from ..core.jit import jit
from ..core.step_fns.sample import sample_token
from ..core.types import Key, Params
from .layers.kv_cache import CachedCall, init_cache_buffers
from .layers.stacked import as_list
from .llama3.config import Llama3Config

__all__ = ["Decoder", "decode_step", "init_cache", "prefill"]

Cache = Dict[str, Tensor]


def _check_family(model: Any) -> None:
    if not isinstance(getattr(model, "config", None), Llama3Config):
        raise TypeError(f"KV-cache generation supports the Llama-layout families (llama3, qwen2, qwen3, mistral, "
                        f"gemma, and the mixtures of experts on them), got "
                        f"{type(model).__name__}; ember.core.step_fns.generate samples any model without a cache.")


def init_cache(model: Any, *, batch: int, slots: int, dtype: torch.dtype = torch.float32,
               device: Optional[torch.device] = None) -> Cache:
    """An empty cache for `batch` sequences of up to `slots` tokens (prompt and generated)."""
    _check_family(model)
    c = model.config
    if slots > c.max_seq_len:
        raise ValueError(f"a cache of {slots} slots is longer than the model's max_seq_len={c.max_seq_len}; "
                         f"generate fewer tokens or raise max_seq_len.")
    return init_cache_buffers(model.cache_widths(), n_layers=c.n_layers, batch=batch, slots=slots, dtype=dtype,
                              device=device)


def _forward(model: Any, cache: Cache, params: Params, tokens: Tensor, position: Tensor) -> Tuple[Cache, Tensor]:
    call = CachedCall(cache, position)
    positions = position + torch.arange(tokens.shape[1], device=tokens.device)  # (T,)
    h = model.features(params, tokens, positions=positions, kv_cache=call)  # (B, T, d)
    name, head = model.head()
    return call.cache(), head(params[name], h[:, -1]).float()  # (B, V): the next token's logits


def _check_unstacked(model: Any) -> None:
    if model.config.scan_layers:
        raise ValueError("prefill / decode_step run the layers one by one: build the model with scan_layers=False "
                         "(ember.models.layers.as_list(model, params) gives both), or use Decoder, which does both.")


def prefill(model: Any, cache: Cache, params: Params, prompt: Tensor,
            position: Optional[Tensor] = None) -> Tuple[Cache, Tensor]:
    """Run `prompt` (B, T) from slot `position` (default 0): the filled cache and the next token's logits (B, V)."""
    _check_unstacked(model)
    position = torch.zeros((), dtype=torch.long, device=prompt.device) if position is None else position
    return _forward(model, cache, params, prompt, position)


def decode_step(model: Any, cache: Cache, params: Params, token: Tensor, position: Tensor) -> Tuple[Cache, Tensor]:
    """Run one token per row, `token` (B,), at slot `position` (0-d): the cache and the next logits (B, V)."""
    _check_unstacked(model)
    return _forward(model, cache, params, token[:, None], position)


class Decoder:
    """`prefill` and `decode_step` of one model, compiled once each by `ember.core.jit`, and sampling.

    Args:
        model: a Llama-layout model (with `scan_layers=True`, its stacked blocks are unstacked first).
        backend: `jit`'s backend ("inductor", "eager", "xla").

    Attributes:
        prefill, decode: the `Jitted` functions (`decode.compile_count` stays 1 however many tokens).
    """

    def __init__(self, model: Any, *, backend: str = "inductor") -> None:
        _check_family(model)
        self.given = model
        self.model = as_list(model)[0]
        m = self.model
        self.prefill = jit(lambda cache, params, prompt, position: prefill(m, cache, params, prompt, position),
                           backend=backend)
        self.decode = jit(lambda cache, params, token, position: decode_step(m, cache, params, token, position),
                          backend=backend, donate="state")

    def generate(self, params: Params, prompt: Tensor, *, max_new_tokens: int, key: Optional[Key] = None,
                 temperature: float = 1.0, top_k: Optional[int] = None, top_p: Optional[float] = None,
                 stop_tokens: Sequence[int] = (), cache_dtype: Optional[torch.dtype] = None,
                 vocab_size: Optional[int] = None) -> Tensor:
        """`prompt` (B, T0) extended by up to `max_new_tokens` sampled tokens: (B, T0 + n).

        A row that samples one of `stop_tokens` keeps that token and is padded with it; generation
        ends early once every row has stopped (checked every 8 tokens). Token `i` uses
        `fold_in(key, i)`, as `ember.core.step_fns.generate` does. With `vocab_size` (the
        tokenizer's), ids past it (a padded embedding's rows) are never drawn.
        """
        params = as_list(self.given, params)[1]
        b, t0 = prompt.shape
        dtype = cache_dtype or params["wte"]["weight"].dtype
        cache = init_cache(self.model, batch=b, slots=t0 + max_new_tokens, dtype=dtype, device=prompt.device)
        zero = torch.zeros((), dtype=torch.long, device=prompt.device)
        cache, logits = self.prefill(cache, params, prompt, zero)
        stops = torch.tensor(list(stop_tokens), dtype=prompt.dtype, device=prompt.device)
        done = torch.zeros(b, dtype=torch.bool, device=prompt.device)
        out = [prompt]
        for i in range(max_new_tokens):
            step_key = None if key is None else random.fold_in(key, i)
            token = sample_token(logits, key=step_key, temperature=temperature, top_k=top_k, top_p=top_p,
                                 vocab_size=vocab_size).to(prompt.dtype)
            if len(stops):
                token = torch.where(done, out[-1][:, -1], token)  # a stopped row repeats its stop token
                done = done | torch.isin(token, stops)
            out.append(token[:, None])
            if i + 1 == max_new_tokens or (len(stops) and i % 8 == 7 and bool(done.all())):
                break
            cache, logits = self.decode(cache, params, token, zero + (t0 + i))
        return torch.cat(out, dim=1)
