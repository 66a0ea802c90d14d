"""Any ember model as an lm-eval-harness `LM`: its tasks scored by ember's compiled forward and decoder.

Public names: `EmberLM`, `require_lm_eval`.

    lm = EmberLM.from_path("runs/a")              # a run directory, an exported `--hf` folder, any HF folder
    lm = EmberLM(model, params, tokenizer)        # a live state (a LoRA model scores with its adapters)
    lm_eval.simple_evaluate(model=lm, tasks=["hellaswag"])

`EmberLM` subclasses lm-eval's `TemplateLM`, so contexts and continuations are split into tokens by
lm-eval's own code, as its `HFLM` does: encoding adds the tokenizer's own special tokens (a folder whose
tokenizer adds a BOS gets it, as `AutoTokenizer.encode` would). Requests are sorted by length, padded
on the right to a power-of-two length (up to `max_length`) and to `batch_size` rows, so the compiled
`(params, tokens) -> log-probabilities` forward compiles once per length bucket. Generation is greedy:
through `ember.models.Decoder` (a KV cache, prompts of equal length batched, filled in power-of-two
chunks) for the Llama-layout families on one process, else a greedy loop over the forward; `until`
stop strings and `max_gen_toks` are applied as `HFLM` applies them. With a `sharding` (a DTensor mesh),
every process runs the same requests through the sharded forward; lm-eval sees one process (rank 0).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ember.core import jit, pytree

__all__ = ["EmberLM", "require_lm_eval"]


def require_lm_eval(what: str = "lm-eval tasks") -> Any:
    """The `lm_eval` module, or a one-line ImportError naming the extra that installs it."""
    try:
        import lm_eval
        from lm_eval.api.model import TemplateLM  # noqa: F401
    except ImportError as error:
        raise ImportError(f"{what}: lm-eval-harness is not importable here ({error}); install it with "
                          f"pip install \"ember[eval]\" (or pip install lm_eval).") from None
    return lm_eval


require_lm_eval("lm-eval evaluations (ember.launch.lm_eval_lm)")
from lm_eval import utils as _lm_utils  # noqa: E402
from lm_eval.api.model import TemplateLM  # noqa: E402
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text  # noqa: E402


class _Tokens:
    """encode / decode of an ember tokenizer as `transformers`' fast tokenizer of the same folder does them."""

    def __init__(self, tokenizer: Any) -> None:
        self.ember = tokenizer
        self.fast = getattr(tokenizer, "tokenizer", None)  # a `tokenizers.Tokenizer` (folder / BPE), else bytes
        self.eos_id = tokenizer.eos_id
        self.bos_id = getattr(tokenizer, "bos_id", None)

    def encode(self, text: str, add_special_tokens: bool) -> List[int]:
        if self.fast is not None:
            return list(self.fast.encode(text, add_special_tokens=add_special_tokens).ids)
        return [int(i) for i in self.ember.encode(text)]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool) -> str:
        ids = [int(i) for i in ids]
        if self.fast is not None:
            return self.fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return self.ember.decode(ids, skip_special_tokens=skip_special_tokens)


def _bucket(n: int, cap: int) -> int:
    """The padded length of a row of `n` tokens: the next power of two (at least 8), at most `cap`."""
    return min(cap, max(8, 1 << (max(n, 1) - 1).bit_length()))


def _score_fn(model: Any) -> Any:
    """`(params, batch) -> {"logp", "argmax"}`: each position's log-probability of its target and its argmax."""

    def score(params: Any, batch: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        logits = model.apply(params, batch["tokens"])  # (B, L, V)
        logp = torch.log_softmax(logits.float(), dim=-1)  # (B, L, V) float32, as HFLM's log_softmax
        return {"logp": logp.gather(-1, batch["targets"][..., None])[..., 0],  # (B, L)
                "argmax": logp.argmax(dim=-1)}  # (B, L)

    return score


class EmberLM(TemplateLM):
    """An ember model and its params as an lm-eval `LM` (see the module docstring).

    Args:
        model: any ember model (`apply(params, tokens) -> logits`): a native family, a `LoRAModel`, a bridge.
        params: its params (plain tensors, or DTensors placed by `sharding`).
        tokenizer: an ember tokenizer (`ember.data`: a folder's `ModelTokenizer`, a BPE or the byte tokenizer).
        batch_size: rows per forward (every forward has exactly this many; a multiple of the mesh's batch axes).
        max_length: the longest window; default the model's `max_seq_len`.
        backend: `ember.core.jit`'s backend for the forward and the decoder ("inductor", "eager", "xla").
        sharding: the run's `Sharding` when `params` are sharded (None: one process).
        max_gen_toks: tokens generated when a task does not say.
    """

    def __init__(self, model: Any, params: Any, tokenizer: Any, *, batch_size: int = 8,
                 max_length: Optional[int] = None, backend: str = "inductor", sharding: Any = None,
                 max_gen_toks: int = 256) -> None:
        super().__init__()
        if backend not in ("eager", "inductor", "xla"):
            raise ValueError(f"backend={backend!r}; expected one of 'eager', 'inductor', 'xla'.")
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size}; expected a positive number of rows per forward.")
        self.model, self.params, self.tokens = model, params, _Tokens(tokenizer)
        self._batch_size, self._max_gen_toks = batch_size, max_gen_toks
        self.sharding, self.backend_name = sharding, backend
        config = getattr(getattr(model, "base", model), "config", None)
        self._max_length = max_length or getattr(config, "max_seq_len", None) or 2048
        from ember.launch.sharded import sharded

        self._forward = sharded(jit(_score_fn(model), backend=backend), sharding, returns_state=False)
        self._decoder: Any = None

    @classmethod
    def from_path(cls, path: str, **kwargs: Any) -> "EmberLM":
        """The model at `path` (a Hugging Face folder, an exported `--hf` folder, or an ember run directory), on
        `device` (default: the backend's, `ember.core.device_for`); `kwargs` as the constructor's."""
        from ember.core import device_for
        from ember.launch.lm_eval_load import load_model

        device = kwargs.pop("device", None) or device_for(kwargs.get("backend", "inductor"))
        model, params, tokenizer = load_model(path, device=device)
        return cls(model, params, tokenizer, **kwargs)

    # --- what lm-eval reads -------------------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokens.eos_id if self.tokens.eos_id is not None else 0

    @property
    def prefix_token_id(self) -> int:
        return self.tokens.bos_id if self.tokens.bos_id is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return next(iter(pytree.tree_leaves(self.params))).device

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None,
                   left_truncate_len: Optional[int] = None,
                   **kwargs: Any) -> List[int]:
        """`HFLM.tok_encode`: the tokenizer's special tokens added unless asked not to, or `string` starts with BOS."""
        if add_special_tokens is None:
            prefix = self.tok_decode([self.prefix_token_id], skip_special_tokens=False)
            add_special_tokens = not (prefix and string.startswith(prefix))
        ids = self.tokens.encode(string, add_special_tokens)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens: Sequence[int], skip_special_tokens: bool = True) -> str:
        if isinstance(tokens, int):
            tokens = [tokens]
        return self.tokens.decode(tokens, skip_special_tokens)

    # --- scoring ------------------------------------------------------------------------------------------------
    def _run(self, rows: List[Tuple[List[int], List[int]]]) -> Dict[str, torch.Tensor]:
        """One padded forward of up to `batch_size` (input, target) rows: logp and argmax (B, L) on the CPU."""
        width = _bucket(max(len(x) for x, _ in rows), self.max_length)
        tokens = torch.full((self.batch_size, width), self.eot_token_id, dtype=torch.long)
        targets = torch.zeros((self.batch_size, width), dtype=torch.long)
        for r, (x, y) in enumerate(rows):
            tokens[r, :len(x)], targets[r, :len(y)] = torch.tensor(x), torch.tensor(y)
        device = self.device
        out = self._forward(self.params, {"tokens": tokens.to(device), "targets": targets.to(device)})
        return {k: v.cpu() for k, v in out.items()}  # host sync: the scores go back to lm-eval

    def _loglikelihood_tokens(self, requests: List[Tuple[Any, List[int], List[int]]], disable_tqdm: bool = False,
                              **kwargs: Any) -> List[Tuple[float, bool]]:
        """(log p(continuation | context), greedy) per request, as `HFLM`: windows cut on the left to `max_length`."""
        rows = []
        for _, context, continuation in requests:
            whole = (list(context) + list(continuation))[-(self.max_length + 1):]
            rows.append((whole[:-1], whole[1:], len(continuation)))
        order = sorted(range(len(rows)), key=lambda i: (-len(rows[i][0]), tuple(rows[i][0])))
        results: List[Any] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            out = self._run([rows[i][:2] for i in chunk])
            for r, i in enumerate(chunk):
                inp, tgt, n = rows[i]
                span = slice(len(inp) - n, len(inp))
                greedy = bool((out["argmax"][r, span] == torch.tensor(tgt[-n:])).all())
                results[i] = (float(out["logp"][r, span].sum()), greedy)
        for (key, _, _), answer in zip(requests, results):
            if key is not None:
                self.cache_hook.add_partial("loglikelihood", key, answer)
        return results

    def loglikelihood_rolling(self, requests: List[Any], disable_tqdm: bool = False) -> List[float]:
        """Each document's log-likelihood over disjoint `max_length` windows (lm-eval's rolling windows, as `HFLM`)."""
        windows, counts = [], []
        for (string,) in [req.args for req in requests]:
            doc = [(None,) + w for w in map(_lm_utils.make_disjoint_window, _lm_utils.get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id, max_seq_len=self.max_length,
                context_len=1))]
            windows.extend(doc)
            counts.append(len(doc))
        scores = self._loglikelihood_tokens(windows)
        out, at = [], 0
        for req, n in zip(requests, counts):
            out.append(sum(s for s, _ in scores[at:at + n]))
            at += n
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, out[-1])
        return out

    # --- generation ---------------------------------------------------------------------------------------------
    def generate_until(self, requests: List[Any], disable_tqdm: bool = False) -> List[str]:
        """Greedy continuations, cut at the first `until` string (and the end-of-text token), as `HFLM`."""
        eos = self.tok_decode([self.eot_token_id], skip_special_tokens=False)
        jobs = []
        for context, gen_kwargs in [req.args for req in requests]:
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), self.max_gen_toks)
            if kwargs.get("do_sample") or kwargs.get("temperature", 0.0) > 0:
                raise ValueError(f"generation kwargs {gen_kwargs} ask for sampling; EmberLM generates greedily: set "
                                 f"do_sample: false / temperature: 0 in the task (or --gen_kwargs).")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            n = int(kwargs.pop("max_gen_toks"))
            if n >= self.max_length:
                raise ValueError(f"max_gen_toks={n} leaves no room for a prompt in max_length={self.max_length}; "
                                 f"ask for fewer tokens.")
            ids = self.tok_encode(context, left_truncate_len=self.max_length - n) or [self.prefix_token_id]  # "" too
            jobs.append((ids, until, n))
        texts: List[Any] = [None] * len(jobs)
        groups: Dict[Any, List[int]] = {}
        for i, (ids, until, n) in enumerate(jobs):  # rows that can share a batch: same stops and budget (and length)
            key = (tuple(until), n, len(ids) if self._cached_decoder() else 0)
            groups.setdefault(key, []).append(i)
        for (until, n, _), members in groups.items():
            members.sort(key=lambda i: -len(jobs[i][0]))
            for start in range(0, len(members), self.batch_size):
                chunk = members[start:start + self.batch_size]
                generated = self._generate([jobs[i][0] for i in chunk], n, list(until))
                for i, ids in zip(chunk, generated):
                    texts[i] = postprocess_generated_text(self.tok_decode(ids), list(until), None)
        for req, text in zip(requests, texts):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _cached_decoder(self) -> Any:
        """`ember.models.Decoder` of the model when it has a KV cache and runs on one process, else None."""
        if self._decoder is None:
            from ember.models import LoRAModel
            from ember.models.llama3.config import Llama3Config

            base = self.model.base if isinstance(self.model, LoRAModel) else self.model
            ok = self.sharding is None and isinstance(getattr(base, "config", None), Llama3Config)
            if ok:
                from ember.models.generation import Decoder

                self._decoder = Decoder(base, backend=self.backend_name)
            else:
                self._decoder = False
        return self._decoder or None

    def _stopped(self, ids: List[int], until: List[str]) -> bool:
        return self.eot_token_id in ids or any(s and s in self.tok_decode(ids) for s in until)

    def _generate(self, prompts: List[List[int]], n: int, until: List[str]) -> List[List[int]]:
        """Up to `n` greedy tokens after each prompt, ending at the first end-of-text token (which is dropped)."""
        decoder = self._cached_decoder()
        outs = self._decode_cached(decoder, prompts, n, until) if decoder else self._decode_loop(prompts, n, until)
        return [o[:o.index(self.eot_token_id)] if self.eot_token_id in o else o for o in outs]

    def _decode_loop(self, prompts: List[List[int]], n: int, until: List[str]) -> List[List[int]]:
        """Greedy decoding over the (bucketed) forward, for models without a KV cache."""
        outs: List[List[int]] = [[] for _ in prompts]
        for _ in range(n):
            live = [r for r in range(len(prompts)) if not self._stopped(outs[r], until)]
            if not live:
                break
            rows = [(prompts[r] + outs[r], [0] * (len(prompts[r]) + len(outs[r]))) for r in live]
            argmax = self._run(rows)["argmax"]
            for slot, r in enumerate(live):
                outs[r].append(int(argmax[slot, len(rows[slot][0]) - 1]))
        return outs

    def _decode_cached(self, decoder: Any, prompts: List[List[int]], n: int, until: List[str]) -> List[List[int]]:
        """Greedy decoding with the KV cache: equal-length prompts, filled in power-of-two chunks."""
        from ember.models.generation import init_cache
        from ember.models.layers.stacked import as_list

        params = self.params
        if hasattr(self.model, "merged") and hasattr(self.model, "base"):
            params = self.model.merged(params)  # a LoRA model decodes with its adapters merged in
        params = as_list(decoder.given, params)[1]
        t0, device, b = len(prompts[0]), self.device, self.batch_size
        prompt = torch.tensor([prompts[0]] * b, dtype=torch.long)
        prompt[:len(prompts)] = torch.tensor(prompts)
        prompt = prompt.to(device)
        slots = _bucket(t0 + n, self.max_length)
        dtype = params["wte"]["weight"].dtype
        cache = init_cache(decoder.model, batch=b, slots=slots, dtype=dtype, device=device)
        at, logits = 0, None
        while at < t0:  # chunks of 2^k tokens, largest first: prefill compiles once per chunk length
            size = 1 << ((t0 - at).bit_length() - 1)
            cache, logits = decoder.prefill(cache, params, prompt[:, at:at + size],
                                            torch.tensor(at, dtype=torch.long, device=device))
            at += size
        outs: List[List[int]] = [[] for _ in prompts]
        for i in range(n):
            token = logits.argmax(dim=-1)  # (B,) greedy
            picked = token.tolist()  # host sync: the stop strings are checked on text
            for r in range(len(prompts)):
                if not self._stopped(outs[r], until):
                    outs[r].append(picked[r])
            if i + 1 == n or all(self._stopped(o, until) for o in outs):
                break
            cache, logits = decoder.decode(cache, params, token, torch.tensor(t0 + i, dtype=torch.long, device=device))
        return outs

