"""Supervised fine-tuning data: JSONL conversations, a loss on the assistant tokens only, packed windows.

Public names: `read_sft_jsonl`, `tokenize_sft_example`, `PackedWindows`, `pack_sft`, `make_sft_pipeline`.

Each JSONL line is `{"messages": [{"role": ..., "content": ...}, ...]}` (rendered with the model's
chat template) or `{"prompt": ..., "completion": ...}` (BOS if the tokenizer has one, the prompt, then
the completion and an EOS, which are trained on). A message's content is a string or, in the OpenAI
format, a list of `{"type": "text", "text": ...}` parts, joined with newlines (as vLLM does for a
template that takes strings); other parts (images, audio) are refused, as are roles the chat template
does not know (`ember.data.chat_template`). Errors name the file and line (`sft.jsonl:8`).
Every 20th example is held out as the eval split.
Examples are packed in order into windows of `seq_len` tokens; each window carries

    inputs, targets   (T,) int64   targets are -100 where nothing is learnt (prompts, padding)
    segment_ids       (T,) int64   1, 2, ... per document in the window, 0 for padding
    positions         (T,) int64   restarting at 0 with each document

so attention never crosses a document boundary (`segment_ids`) and rotary positions are those of
the document alone: a packed batch gives the loss and gradients of its documents run one by one.
The windows go through the same sharded, shuffled, resumable grain pipeline as pretraining text.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, Iterator, List, Literal, Mapping, Optional, Sequence, Tuple

import numpy as np

from .iterator import PipelineIterator
from .pipeline import window_batches
from .tokenizers import Tokenizer

__all__ = ["PackedWindows", "make_sft_pipeline", "pack_sft", "read_sft_jsonl", "tokenize_sft_example"]

IGNORE_INDEX = -100
"""The target of a position that is not learnt (what `cross_entropy` ignores)."""

Overflow = Literal["truncate", "error"]
log = logging.getLogger(__name__)


def _text(content: Any, at: str) -> str:
    """A message's content as one string: a string as is, text parts joined with newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{at} is {type(content).__name__} {json.dumps(content)[:40]}; expected a string or a "
                         f"list of {{\"type\": \"text\", \"text\": ...}} parts.")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        if kind != "text" or not isinstance(part.get("text"), str):
            raise ValueError(f"{at}[{j}] is a {kind!r} part; SFT trains on text only: keep the "
                             f"{{\"type\": \"text\", \"text\": ...}} parts, or drop the example.")
        texts.append(part["text"])
    return "\n".join(texts)


def _messages(messages: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """The messages with string content (see `_text`; None only beside `tool_calls`); other keys are kept."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise ValueError(f"messages[{i}].role is {m.get('role')!r}; expected a string such as \"user\".")
        if m["content"] is None and m.get("tool_calls"):
            out.append(dict(m))
            continue
        out.append({**m, "content": _text(m["content"], f"messages[{i}].content")})
    return out


_NOT_TEXT = ("{where}: not text (a NUL byte): data.source={source} reads a JSONL file of UTF-8 text, one JSON example a "
             "line; pass --data.path FILE.jsonl (a token file: --data.source bin).")


def _decoded(raw: bytes, where: str, source: str = "sft") -> str:
    """One line of a JSONL file as text; a binary line or another encoding is refused naming the line."""
    if b"\0" in raw:
        raise ValueError(_NOT_TEXT.format(where=where, source=source))
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{where}: not UTF-8 (byte 0x{raw[err.start]:02x} at column {err.start + 1}); data.source={source} "
                         f"reads a JSONL file of UTF-8 text: convert the file to UTF-8 "
                         f"(e.g. iconv -f latin1 -t utf-8) or point --data.path at another.") from None


def json_lines(path: str, *, source: str = "sft") -> Iterator[Tuple[str, Dict[str, Any]]]:
    """`(file:line, object)` for each non-empty line of a JSONL file of UTF-8 JSON objects (`data.source=source`)."""
    if not os.path.isfile(path):
        what = "SFT" if source == "sft" else source.capitalize()
        raise ValueError(f"{what} data {os.fspath(path)!r} is not a file; data.source={source} reads one "
                         f"JSONL file (--data.path FILE.jsonl).")
    with open(os.fspath(path), "rb") as fh:
        if b"\0" in fh.read(8192):  # a binary file: refused before a "line" of it (maybe all of it) is read
            raise ValueError(_NOT_TEXT.format(where=f"{path} (its first 8192 bytes)", source=source))
        fh.seek(0)
        for number, raw in enumerate(fh, start=1):
            where = f"{path}:{number}"
            line = _decoded(raw, where, source)
            if not line.strip():
                continue
            try:
                example = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{where}: not a JSON object ({err.msg}); each line must be one example.") from None
            if not isinstance(example, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(example).__name__}.")
            yield where, example


def _read_lines(path: str) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """`(file:line, example)` for each example of a JSONL file (see `read_sft_jsonl`)."""
    for where, example in json_lines(path):
        messages = example.get("messages")
        if isinstance(messages, list) and all(isinstance(m, dict) and "role" in m and "content" in m
                                               for m in messages) and messages:
            try:
                messages = _messages(messages)
            except ValueError as err:
                raise ValueError(f"{where}: {err}") from None
            yield where, {"messages": messages}
        elif isinstance(example.get("prompt"), str) and isinstance(example.get("completion"), str):
            yield where, {"prompt": example["prompt"], "completion": example["completion"]}
        else:
            raise ValueError(
                f"{where}: expected \"messages\" (a non-empty list of {{\"role\", \"content\"}} objects) or "
                f"\"prompt\" and \"completion\" strings, got keys {sorted(example)}."
            )


def read_sft_jsonl(path: str) -> Iterator[Dict[str, Any]]:
    """The examples of a JSONL file, one per non-empty line (messages' content as strings).

    Raises:
        ValueError: a line that is not JSON, or holds neither a `messages` list nor `prompt` and
            `completion` strings, or a message whose content is not text (the file and line are named).
    """
    for _, example in _read_lines(path):
        yield example


def tokenize_sft_example(example: Mapping[str, Any], tokenizer: Tokenizer) -> Tuple[np.ndarray, np.ndarray]:
    """`(ids, learnt)`: the example's token ids and a bool mask of the tokens the loss is on.

    Conversations need a tokenizer with a chat template (`ember.data.load_model_tokenizer`); a
    prompt/completion pair is `prompt + completion + EOS` with the completion and EOS learnt.
    """
    if "messages" in example:
        if not hasattr(tokenizer, "encode_chat"):
            raise ValueError(f"conversations (\"messages\") are rendered with the model's chat template, but "
                             f"{tokenizer!r} has none; use data.tokenizer=model with data.tokenizer_path set to the "
                             f"model folder, or prompt/completion lines.")
        return tokenizer.encode_chat(_messages(list(example["messages"])))
    bos = getattr(tokenizer, "bos_id", None)
    prompt = np.concatenate([np.asarray([] if bos is None else [bos], dtype=np.int32), tokenizer.encode(example["prompt"])])
    completion = tokenizer.encode(example["completion"])
    eos = [] if tokenizer.eos_id is None else [tokenizer.eos_id]
    ids = np.concatenate([prompt, completion, np.asarray(eos, dtype=np.int32)]).astype(np.int32)
    learnt = np.zeros(len(ids), dtype=bool)
    learnt[len(prompt):] = True
    return ids, learnt


def pack_sft(examples: Sequence[Tuple[np.ndarray, np.ndarray]], seq_len: int, *,
             overflow: Overflow = "truncate", names: Optional[Sequence[str]] = None) -> Dict[str, np.ndarray]:
    """Pack `(ids, learnt)` examples, in order, into `(N, seq_len)` windows (see the module docstring).

    An example of `n` tokens fills `n - 1` positions (each predicts the next token). One that does not
    fit a window is cut to `seq_len + 1` tokens (`overflow="truncate"`, counted in the log) or refused
    (`"error"`). `names` says where each example came from (`file:line`) in those messages; without
    it an example is `examples[i]`.
    """
    rows: List[List[Tuple[np.ndarray, np.ndarray]]] = [[]]
    used, truncated, first = 0, 0, ""
    for index, (ids, learnt) in enumerate(examples):
        if len(ids) < 2:
            continue
        if len(ids) - 1 > seq_len:
            name = names[index] if names is not None else f"examples[{index}]"
            if overflow == "error":
                raise ValueError(f"{name}: {len(ids)} tokens, more than a window of --data.seq_len {seq_len} (+1) "
                                 f"holds; raise --data.seq_len, or pass --data.overflow truncate to cut such "
                                 f"examples to {seq_len + 1} tokens.")
            ids, learnt, truncated = ids[:seq_len + 1], learnt[:seq_len + 1], truncated + 1
            first = first or name
        if used + len(ids) - 1 > seq_len:
            rows.append([])
            used = 0
        rows[-1].append((ids, learnt))
        used += len(ids) - 1
    if truncated:
        log.warning("SFT packing: %d example(s) longer than seq_len=%d were truncated (the first: %s)",
                    truncated, seq_len, first)
    rows = [r for r in rows if r]
    out = {k: np.zeros((len(rows), seq_len), dtype=np.int64) for k in ("inputs", "targets", "segment_ids", "positions")}
    out["targets"][:] = IGNORE_INDEX
    for r, row in enumerate(rows):
        at = 0
        for segment, (ids, learnt) in enumerate(row, start=1):
            n = len(ids) - 1
            out["inputs"][r, at:at + n] = ids[:-1]
            out["targets"][r, at:at + n] = np.where(learnt[1:], ids[1:], IGNORE_INDEX)
            out["segment_ids"][r, at:at + n] = segment
            out["positions"][r, at:at + n] = np.arange(n)
            at += n
    return out


class PackedWindows:
    """Packed SFT windows as the grain pipeline reads them: `len`, `seq_len`, `gather(ids) -> batch dict`."""

    def __init__(self, packed: Mapping[str, np.ndarray]) -> None:
        self.packed = dict(packed)
        self.seq_len = int(self.packed["inputs"].shape[1])
        self.num_tokens = int((self.packed["segment_ids"] > 0).sum())
        if not len(self):
            raise ValueError("no SFT example has two or more tokens: there is nothing to train on.")

    def __len__(self) -> int:
        return int(self.packed["inputs"].shape[0])

    def gather(self, indices: Any) -> Dict[str, np.ndarray]:
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        return {k: v[idx] for k, v in self.packed.items()}

    def __repr__(self) -> str:
        return f"PackedWindows({len(self)} windows of {self.seq_len} tokens, {self.num_tokens} real)"


EVAL_EVERY = 20
"""Example `i` is in the eval split when `i % EVAL_EVERY == EVAL_EVERY - 1` (a file of fewer examples
gives both splits all of them)."""


def _split(examples: List[Any], split: Optional[str]) -> List[Any]:
    if split is None or len(examples) < EVAL_EVERY:
        return examples
    return [e for i, e in enumerate(examples) if (i % EVAL_EVERY == EVAL_EVERY - 1) == (split == "eval")]


def _check_enough_windows(path: str, split: Optional[str], examples: int, windows: int, *, seq_len: int,
                          batch_size: int, shard_count: int) -> None:
    """Refuse a split that packs into fewer windows than one batch, naming the split and the flags that help."""
    if windows // shard_count >= batch_size:
        return
    ranks = f" on each of {shard_count} data-parallel ranks" if shard_count > 1 else ""
    what = (f"the eval split of {path} (every {EVAL_EVERY}th example: {examples} of them)" if split == "eval" else
            f"{'the train split of ' if split == 'train' else ''}{path} ({examples} examples)")
    fix = ("add examples, lower --data.batch_size, or pass --eval_every 0 to train without evaluating" if split == "eval"
           else "add examples, or lower --data.batch_size or --data.seq_len")
    packs = f"{windows} window{'s' if windows != 1 else ''} of --data.seq_len {seq_len}"
    raise ValueError(f"{what} packs into {packs}, fewer than a batch of {batch_size}{ranks} (--data.batch_size "
                     f"{batch_size * shard_count}); {fix}.")


def make_sft_pipeline(path: str, *, tokenizer: Tokenizer, seq_len: int, batch_size: int, seed: int = 0,
                      shuffle: bool = True, shard_index: int = 0, shard_count: int = 1,
                      overflow: Overflow = "truncate", repeat: bool = True,
                      split: Optional[str] = None, context_parallel: int = 1) -> PipelineIterator:
    """A resumable iterator of packed SFT batches (`(B, T)` numpy dicts, keys as in the module docstring).

    `split` ("train" or "eval") keeps that split's examples (see `EVAL_EVERY`); None keeps them all.
    `context_parallel` above 1 reorders each sequence for the mesh's `cp` (`ember.data.ContextOrder`).
    """
    names, examples = [], []
    for where, example in _split(list(_read_lines(path)), split):
        try:
            examples.append(tokenize_sft_example(example, tokenizer))
        except ValueError as err:  # a role the template does not know, a template's own refusal
            raise ValueError(f"{where}: {err}") from None
        names.append(where)
    windows = PackedWindows(pack_sft(examples, seq_len, overflow=overflow, names=names))
    _check_enough_windows(path, split, len(examples), len(windows), seq_len=seq_len, batch_size=batch_size,
                          shard_count=shard_count)
    dataset = window_batches(windows, batch_size=batch_size, seed=seed, shuffle=shuffle, shard_index=shard_index,
                             shard_count=shard_count, repeat=repeat, context_parallel=context_parallel)
    config = {"sft": os.path.abspath(path), "split": split, "windows": len(windows), "num_tokens": windows.num_tokens,
              "seq_len": seq_len, "batch_size": batch_size, "seed": int(seed), "shuffle": bool(shuffle),
              "shard_index": shard_index, "shard_count": shard_count, "repeat": bool(repeat)}
    return PipelineIterator(dataset, config=config, batches_per_epoch=len(windows) // shard_count / batch_size)
