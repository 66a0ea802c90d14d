"""`DataConfig`, the data section of a run config, and the tokenizer and batches it builds.

Public names: `DataConfig`, `build_tokenizer`, `build_batches`, `corpus_note`, `source_from_path`.

These are the data half of `launch/train.py`, importable so a user's own script builds the same
data in two lines instead of copying the launcher.

Example:
    >>> cfg = DataConfig(max_bytes=50_000, seq_len=16, batch_size=2)
    >>> tok = build_tokenizer(cfg)
    >>> batches = build_batches(cfg, tokenizer=tok)
    >>> next(batches)["inputs"].shape
    torch.Size([2, 16])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Optional

from ..core.config_checks import check_fields, non_negative_int, optional, positive_int
from .bpe import train_bpe
from .collate import Collator, get_collator
from .iterator import PipelineIterator
from .model_tokenizer import load_model_tokenizer
from .pipeline import make_pipeline
from .preference import make_preference_pipeline
from .sft import make_sft_pipeline
from .sources import check_source_kind, load_source, source_kind
from .text_files import text_files
from .tokenizers import ByteTokenizer, Tokenizer

__all__ = ["DataConfig", "TorchBatches", "build_batches", "build_tokenizer", "corpus_note", "source_from_path"]

STDLIB_BYTES = 4_000_000  # the standard-library corpus read when `max_bytes` is None: a fast start

Split = Literal["train", "eval"]


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Where tokens come from and how they are batched."""

    source: Literal["stdlib", "text", "bin", "hf", "sft", "preference"] = "stdlib"
    """stdlib: the running Python's own standard library sources (no download); text: files or a
    glob at `path`; bin: a nanoGPT-style token .bin memmap; hf: a Hugging Face dataset saved to disk;
    sft: a JSONL file of conversations or prompt/completion pairs, packed, the loss on replies only;
    preference: a JSONL file of prompt / chosen / rejected pairs (DPO and its variants, `--config dpo`).
    On the command line, left at stdlib with a data.path, the path decides (`source_from_path`)."""
    path: Optional[str] = None
    """Path for text / bin / hf / sft / preference sources."""
    tokenizer: Literal["bytes", "bpe", "model"] = "bytes"
    """bytes: 256 byte values (+ EOS); bpe: a byte-level BPE trained locally on the corpus; model: the
    `tokenizer.json` and chat template of the model folder at `tokenizer_path`. A run started from
    weights (`--init_from`) reads the tokenizer they came with unless this is given."""
    tokenizer_path: Optional[str] = None
    """The model folder of `tokenizer=model` (usually the `--init_from` folder)."""
    vocab_size: int = 512
    """Vocabulary size of the BPE tokenizer (ignored for bytes)."""
    max_bytes: Optional[int] = None
    """Cap on corpus bytes read (stdlib: whole files; text: the first bytes). None: 4 MB of the stdlib
    corpus (a fast start), all of a text corpus."""
    seq_len: int = 128
    """Tokens per training window."""
    overflow: Literal["truncate", "error"] = "truncate"
    """An SFT example (a preference pair) longer than a window: cut it (counted in the log) or stop with an error."""
    batch_size: int = 16
    """Windows per batch (global, across data-parallel ranks)."""
    num_workers: int = 0
    """grain worker processes (0 = in the main process)."""
    collate: str = "torch"
    """Registered collator turning numpy batches into what the step takes (`@ember.data.collator`)."""
    seed: int = 0
    """Shuffle seed."""

    def __post_init__(self) -> None:
        check_fields(self, "data.", vocab_size=positive_int, max_bytes=optional(positive_int), seq_len=positive_int,
                     batch_size=positive_int, num_workers=non_negative_int, seed=non_negative_int)


def source_from_path(cfg: DataConfig) -> DataConfig:
    """`cfg` with the source a command line's `--data.path` alone names (stdlib reads no path): .bin ->
    bin, a save_to_disk folder -> hf, else text; a .jsonl path must name its source. Applied when
    flags are parsed, not to saved configs, so a resumed run reads what it read before."""
    if cfg.source != "stdlib" or cfg.path is None:
        return cfg
    if str(cfg.path).endswith(".jsonl"):
        raise ValueError(f"data.path={cfg.path!r} is JSONL but data.source is stdlib, which reads no path; "
                         f"pass --data.source sft (conversations), --data.source preference (chosen / rejected "
                         f"pairs) or --data.source text (plain text).")
    return dataclasses.replace(cfg, source=source_kind(cfg.path))


def _source(cfg: DataConfig, split: Split) -> Any:
    if cfg.source == "stdlib":
        return load_source("stdlib", split=split, max_bytes=cfg.max_bytes or STDLIB_BYTES)
    if cfg.path is None:
        raise ValueError(
            f"data.source={cfg.source!r} needs data.path (a file, directory or glob); "
            f"got none. Pass --data.path PATH, or use --data.source stdlib."
        )
    check_source_kind(cfg.source, cfg.path)
    return load_source(cfg.path, split=split, max_bytes=cfg.max_bytes)


def corpus_note(cfg: DataConfig) -> Optional[str]:
    """A line for the console when `max_bytes` leaves part of a text corpus unread, else None."""
    if cfg.source != "text" or cfg.path is None or cfg.max_bytes is None:
        return None
    try:
        docs = text_files(cfg.path, max_bytes=cfg.max_bytes)  # sizes only: nothing is read
    except FileNotFoundError:
        return None
    if not docs.unread_bytes:
        return None
    read = docs.total_bytes()
    return (f"data: reading the first {read / 1e6:.1f} MB of the {(read + docs.unread_bytes) / 1e6:.1f} MB at "
            f"{cfg.path} (--data.max_bytes {cfg.max_bytes}); without it the whole corpus is read")


def build_tokenizer(cfg: DataConfig) -> Tokenizer:
    """Bytes (256 values + EOS), or a byte-level BPE of `cfg.vocab_size` trained on the train split."""
    if cfg.tokenizer == "bytes":
        return ByteTokenizer(eos=True)
    if cfg.tokenizer == "model":
        if cfg.tokenizer_path is None:
            raise ValueError("data.tokenizer=model reads the tokenizer of a model folder, but data.tokenizer_path is "
                             "not set; pass --data.tokenizer_path FOLDER (the folder of --init_from).")
        return load_model_tokenizer(cfg.tokenizer_path)
    if cfg.source in ("sft", "preference"):
        raise ValueError(f"data.tokenizer=bpe trains a tokenizer on text, not on {cfg.source} examples; use "
                         "--data.tokenizer model --data.tokenizer_path FOLDER, or bytes.")
    docs = _source(cfg, "train")
    return train_bpe(list(docs), cfg.vocab_size)


class TorchBatches:
    """Collated batches over a `PipelineIterator`, forwarding its checkpoint state."""

    def __init__(self, it: PipelineIterator, *, collate: Collator, device: Any = None) -> None:
        self.pipeline = it
        self.collate = collate
        self.device = device

    def __iter__(self) -> "TorchBatches":
        return self

    def __next__(self) -> dict:
        return self.collate(next(self.pipeline), device=self.device)

    def get_state(self) -> dict:
        """The pipeline's state after the last batch handed out (JSON-serialisable)."""
        return self.pipeline.get_state()

    def set_state(self, state: dict) -> None:
        """Resume the pipeline from a state returned by `get_state`."""
        self.pipeline.set_state(state)


def build_batches(
    cfg: DataConfig,
    *,
    tokenizer: Tokenizer,
    split: Split = "train",
    shard_index: int = 0,
    shard_count: int = 1,
    device: Any = None,
    context_parallel: int = 1,
    reference_logps: Optional[Mapping[str, Any]] = None,
) -> TorchBatches:
    """An endless iterator of `{"inputs", "targets"}` (B, T) int64 torch batches for this rank.

    The train split is shuffled and repeats over epochs; the eval split is read in order, so each
    evaluation sees the same batches. `cfg.batch_size` is global: each of `shard_count` ranks gets
    `batch_size // shard_count` rows. `cfg.collate` names the registered collator applied to
    each numpy batch (default "torch"). SFT batches (`source="sft"`) also hold `segment_ids` and
    `positions` (`ember.data.sft`). `context_parallel` is the mesh's `cp`: above 1 every sequence comes
    in its balanced order, with its `positions` (`ember.data.ContextOrder`). Preference pairs
    (`source="preference"`) carry `reference_logps[split]`, when given (`ember.data.make_preference_pipeline`).
    """
    collate = get_collator(cfg.collate)
    if cfg.batch_size % shard_count:
        raise ValueError(
            f"data.batch_size={cfg.batch_size} is global and must divide evenly over {shard_count} "
            f"data-parallel ranks; use a multiple of {shard_count}."
        )
    if cfg.source in ("sft", "preference") and cfg.path is None:
        raise ValueError(f"data.source={cfg.source} needs data.path (a JSONL file); pass --data.path FILE.jsonl.")
    if cfg.source == "preference":  # pairs, every 20th held out; a pair is one row of each side
        if context_parallel > 1:
            raise ValueError("data.source=preference does not run under a context-parallel mesh (cp) yet; drop cp "
                             "from --mesh (dp, fsdp and tp shard preference runs).")
        it = make_preference_pipeline(cfg.path, tokenizer=tokenizer, seq_len=cfg.seq_len,
                                      batch_size=cfg.batch_size // shard_count, seed=cfg.seed, shuffle=split == "train",
                                      shard_index=shard_index, shard_count=shard_count, overflow=cfg.overflow,
                                      split=split, reference_logps=(reference_logps or {}).get(split))
        return TorchBatches(it, collate=collate, device=device)
    if cfg.source == "sft":  # every 20th example is the eval split (ember.data.sft.EVAL_EVERY)
        it = make_sft_pipeline(cfg.path, tokenizer=tokenizer, seq_len=cfg.seq_len,
                               batch_size=cfg.batch_size // shard_count, seed=cfg.seed, shuffle=split == "train",
                               shard_index=shard_index, shard_count=shard_count, overflow=cfg.overflow, split=split,
                               context_parallel=context_parallel)
        return TorchBatches(it, collate=collate, device=device)
    it = make_pipeline(
        _source(cfg, split),
        tokenizer=tokenizer,
        seq_len=cfg.seq_len,
        batch_size=cfg.batch_size // shard_count,
        seed=cfg.seed,
        shuffle=split == "train",
        shard_index=shard_index,
        shard_count=shard_count,
        num_workers=cfg.num_workers if split == "train" else 0,
        repeat=True,
        context_parallel=context_parallel,
    )
    return TorchBatches(it, collate=collate, device=device)
