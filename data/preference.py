"""Preference data: JSONL pairs of a prompt, a chosen and a rejected response, as DPO batches.

Public names: `read_preference_jsonl`, `tokenize_preference_example`, `PreferencePairs`,
`read_preference_pairs`, `make_preference_pipeline`.

Each JSONL line is `{"prompt": ..., "chosen": ..., "rejected": ...}` with text (BOS if the tokenizer
has one, the prompt, then the response and an EOS) or chat messages (TRL's conversational format: the
prompt a list of messages, each response a list holding the assistant's reply, rendered with the
model's chat template). The prompt / response boundary is TRL's: where the tokenized prompt (with the
generation prompt) and the tokenized prompt + response first differ, so a template that renders
anything after the reply (`<|im_end|>\\n`) has it in the response. Each pair is one row of

    chosen_inputs, chosen_targets, rejected_inputs, rejected_targets     (T,) int64

(`targets` the next tokens, -100 on the prompt and the padding), so batching, microbatches and
data-parallel ranks never separate a chosen from its rejected. A pair longer than a window is
truncated at the end (keep the start, as TRL's `max_length`), counted in the log, or refused with
`--data.overflow error`; a prompt that leaves no response token in the window is refused. Every 20th
pair is held out as the eval split. The rows go through the same seeded, resumable grain pipeline as SFT.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Dict, Iterator, List, Mapping, Optional, Tuple

import numpy as np

from .iterator import PipelineIterator
from .pipeline import window_batches
from .sft import IGNORE_INDEX, Overflow, _messages, _split, json_lines
from .tokenizers import Tokenizer

__all__ = ["PreferencePairs", "make_preference_pipeline", "read_preference_jsonl", "read_preference_pairs",
           "tokenize_preference_example"]

log = logging.getLogger(__name__)
SIDES = ("chosen", "rejected")


def _example(where: str, example: Dict[str, Any]) -> Dict[str, Any]:
    missing = [k for k in ("prompt", *SIDES) if k not in example]
    if missing:
        raise ValueError(f"{where}: a preference example needs \"prompt\", \"chosen\" and \"rejected\"; this one lacks "
                         f"{', '.join(repr(k) for k in missing)} (keys: {sorted(example)}). Drop the line or add them.")
    kinds = {k: "text" if isinstance(example[k], str) else "messages" if isinstance(example[k], list) else None
             for k in ("prompt", *SIDES)}
    if None in kinds.values() or len(set(kinds.values())) != 1:
        raise ValueError(f"{where}: prompt, chosen and rejected must all be strings or all be lists of messages; "
                         f"got {', '.join(f'{k} {type(example[k]).__name__}' for k in kinds)}.")
    out = {k: example[k] if kinds[k] == "text" else _messages(example[k]) for k in kinds}
    for side in SIDES:
        empty = not out[side].strip() if kinds[side] == "text" else not "".join(m["content"] or "" for m in out[side])
        if empty:
            raise ValueError(f"{where}: the {side} response is empty; a pair compares two responses: drop the line "
                             f"or fill it in.")
    return out


def read_preference_jsonl(path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """`(file:line, example)` for each pair of a JSONL file; a bad line is refused naming it."""
    for where, example in json_lines(path, source="preference"):
        try:
            yield where, _example(where, example)
        except ValueError as err:
            raise ValueError(str(err) if str(err).startswith(where) else f"{where}: {err}") from None


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    differ = np.nonzero(a[:n] != b[:n])[0]
    return int(differ[0]) if len(differ) else n


def tokenize_preference_example(example: Mapping[str, Any], tokenizer: Tokenizer) -> Tuple[np.ndarray, ...]:
    """`(prompt_ids, chosen_ids, rejected_ids)` with TRL's boundary (see the module docstring)."""
    if isinstance(example["prompt"], list):
        if not hasattr(tokenizer, "apply_chat_template"):
            raise ValueError(f"chat-message pairs are rendered with the model's chat template, but {tokenizer!r} has "
                             f"none; use data.tokenizer=model with data.tokenizer_path the model folder, or text pairs.")
        prompt = tokenizer.apply_chat_template(example["prompt"], add_generation_prompt=True)
        full = [tokenizer.apply_chat_template(example["prompt"] + example[s]) for s in SIDES]
    else:
        bos = getattr(tokenizer, "bos_id", None)
        head = np.asarray([] if bos is None else [bos], dtype=np.int64)
        eos = np.asarray([] if tokenizer.eos_id is None else [tokenizer.eos_id], dtype=np.int64)
        prompt = np.concatenate([head, tokenizer.encode(example["prompt"])])
        full = [np.concatenate([head, tokenizer.encode(example["prompt"] + example[s]), eos]) for s in SIDES]
    prompt, full = np.asarray(prompt, dtype=np.int64), [np.asarray(f, dtype=np.int64) for f in full]
    cut = min(_common_prefix(prompt, f) for f in full)
    return (prompt[:cut], *(f[cut:] for f in full))


def _row(prompt: np.ndarray, response: np.ndarray, seq_len: int) -> Tuple[np.ndarray, np.ndarray]:
    ids = np.concatenate([prompt, response])[:seq_len + 1]
    learnt = np.arange(len(ids)) >= len(prompt)
    inputs = np.zeros(seq_len, dtype=np.int64)
    targets = np.full(seq_len, IGNORE_INDEX, dtype=np.int64)
    n = len(ids) - 1
    inputs[:n] = ids[:-1]
    targets[:n] = np.where(learnt[1:], ids[1:], IGNORE_INDEX)
    return inputs, targets


class PreferencePairs:
    """Tokenized pairs as the grain pipeline reads them: `len`, `seq_len`, `gather(ids) -> batch dict`."""

    def __init__(self, examples: List[Tuple[np.ndarray, ...]], seq_len: int, *, overflow: Overflow = "truncate",
                 names: Optional[List[str]] = None) -> None:
        self.seq_len = seq_len
        rows: Dict[str, List[np.ndarray]] = {f"{s}_{k}": [] for s in SIDES for k in ("inputs", "targets")}
        truncated, first = 0, ""
        for i, (prompt, *responses) in enumerate(examples):
            name = names[i] if names else f"examples[{i}]"
            if len(prompt) >= seq_len:
                raise ValueError(f"{name}: the prompt alone is {len(prompt)} tokens, a window of --data.seq_len "
                                 f"{seq_len} leaves no response token; raise --data.seq_len or shorten the prompt.")
            longest = len(prompt) + max(len(r) for r in responses) - 1
            if longest > seq_len:
                if overflow == "error":
                    raise ValueError(f"{name}: {longest + 1} tokens, more than a window of --data.seq_len {seq_len} "
                                     f"(+1) holds; raise --data.seq_len, or pass --data.overflow truncate to cut "
                                     f"responses at the window's end.")
                truncated, first = truncated + 1, first or name
            for side, response in zip(SIDES, responses):
                inputs, targets = _row(prompt, response, seq_len)
                rows[f"{side}_inputs"].append(inputs)
                rows[f"{side}_targets"].append(targets)
        if truncated:
            log.warning("preference data: %d pair(s) longer than seq_len=%d were cut at the window's end (the first: "
                        "%s)", truncated, seq_len, first)
        if not examples:
            raise ValueError("no preference pair to train on.")
        self.rows = {k: np.stack(v) for k, v in rows.items()}
        self.identical = int(sum((self.rows["chosen_targets"] == self.rows["rejected_targets"]).all(1)
                                 & (self.rows["chosen_inputs"] == self.rows["rejected_inputs"]).all(1)))
        if self.identical:
            log.warning("preference data: %d pair(s) have the chosen response equal to the rejected one (kept: "
                        "they add no gradient to DPO; `identical_pairs` in the metrics counts them)", self.identical)

    def __len__(self) -> int:
        return int(self.rows["chosen_inputs"].shape[0])

    def gather(self, indices: Any) -> Dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return {k: v[idx] for k, v in self.rows.items()}

    def __repr__(self) -> str:
        return f"PreferencePairs({len(self)} pairs of {self.seq_len} tokens, {self.identical} identical)"


def read_preference_pairs(path: str, *, tokenizer: Tokenizer, seq_len: int, overflow: Overflow = "truncate",
                          split: Optional[str] = None) -> PreferencePairs:
    """The tokenized pairs of `path` (every 20th is the eval split; `split=None` keeps them all)."""
    names, examples = [], []
    for where, example in _split(list(read_preference_jsonl(path)), split):
        try:
            examples.append(tokenize_preference_example(example, tokenizer))
        except ValueError as err:  # a role the template does not know, a template's own refusal
            raise ValueError(f"{where}: {err}") from None
        names.append(where)
    return PreferencePairs(examples, seq_len, overflow=overflow, names=names)


def make_preference_pipeline(path: str, *, tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: int = 0,
                             shuffle: bool = True, shard_index: int = 0, shard_count: int = 1,
                             overflow: Overflow = "truncate", repeat: bool = True, split: Optional[str] = None,
                             reference_logps: Optional[Tuple[np.ndarray, np.ndarray]] = None) -> PipelineIterator:
    """A resumable iterator of pair batches (`(B, T)` numpy dicts, keys as in the module docstring).

    `split` ("train" or "eval") keeps that split's pairs (every 20th is eval); None keeps them all.
    `reference_logps`, the reference's summed log-probabilities of every pair's chosen and rejected
    responses in file order (`ember.models.reference_logps` of `read_preference_pairs`), rides along
    as `ref_chosen_logps` / `ref_rejected_logps`: the step then runs no reference.
    """
    pairs = read_preference_pairs(path, tokenizer=tokenizer, seq_len=seq_len, overflow=overflow, split=split)
    if reference_logps is not None:
        chosen, rejected = (np.asarray(x, dtype=np.float32) for x in reference_logps)
        if chosen.shape != (len(pairs),) or rejected.shape != (len(pairs),):
            raise ValueError(f"reference_logps holds {chosen.shape} and {rejected.shape} log-probabilities for "
                             f"{len(pairs)} pairs of {path}; score the same file, split and seq_len.")
        pairs.rows["ref_chosen_logps"], pairs.rows["ref_rejected_logps"] = chosen, rejected
    if len(pairs) // shard_count < batch_size:
        raise ValueError(f"{'the ' + split + ' split of ' if split else ''}{path} holds {len(pairs)} pairs, fewer than "
                         f"a batch of {batch_size} on each of {shard_count} data-parallel rank(s); add pairs or lower "
                         f"--data.batch_size.")
    dataset = window_batches(pairs, batch_size=batch_size, seed=seed, shuffle=shuffle, shard_index=shard_index,
                             shard_count=shard_count, repeat=repeat)
    config = {"preference": os.path.abspath(path), "split": split, "pairs": len(pairs), "seq_len": seq_len,
              "batch_size": batch_size, "seed": int(seed), "shuffle": bool(shuffle), "shard_index": shard_index,
              "shard_count": shard_count, "repeat": bool(repeat)}
    return PipelineIterator(dataset, config=config, batches_per_epoch=len(pairs) // shard_count / batch_size)
