"""ember.data: corpora, tokenizers and resumable, sharded grain pipelines.

Sources: `stdlib_corpus` (the embedded default corpus: the running interpreter's stdlib `.py`
files), `text_files`, `load_token_bin` / `write_token_bin` (nanoGPT `.bin`), `hf_text_from_disk`
(Hugging Face datasets saved on disk), and `load_source` (any of these from one string).
Tokenizers: `ByteTokenizer`, `train_bpe` / `BPETokenizer`, a model folder's own
`load_model_tokenizer` / `ModelTokenizer` with its `ChatTemplate`. Fine-tuning data: `read_sft_jsonl`,
`pack_sft`, `make_sft_pipeline` (packed, loss on replies only); preference pairs `read_preference_jsonl`,
`tokenize_preference_example`, `PreferencePairs`, `read_preference_pairs`, `make_preference_pipeline` (DPO and its variants). Pipeline: `make_pipeline` (or
`tokenize_documents` -> `TokenWindows` -> `window_batches` -> `PipelineIterator`), `ContextOrder`
(the sequence order of context parallelism), `prefetch`, and collators (`to_torch`, `@collator`, `get_collator`).
"""

from .bpe import BPETokenizer as BPETokenizer
from .bpe import train_bpe as train_bpe
from .collate import Collator as Collator
from .collate import available_collators as available_collators
from .collate import collator as collator
from .collate import get_collator as get_collator
from .collate import identity_collate as identity_collate
from .collate import to_torch as to_torch
from .config import DataConfig as DataConfig
from .context_order import ContextOrder as ContextOrder
from .config import TorchBatches as TorchBatches
from .config import build_batches as build_batches
from .config import build_tokenizer as build_tokenizer
from .config import corpus_note as corpus_note
from .config import source_from_path as source_from_path
from .hf_disk import HFTextColumn as HFTextColumn
from .hf_disk import hf_text_from_disk as hf_text_from_disk
from .iterator import PipelineIterator as PipelineIterator
from .iterator import ensure_absl_flags_parsed as ensure_absl_flags_parsed
from .model_tokenizer import ModelTokenizer as ModelTokenizer
from .model_tokenizer import load_model_tokenizer as load_model_tokenizer
from .pipeline import GatherWindows as GatherWindows
from .pipeline import make_pipeline as make_pipeline
from .pipeline import shard_window_ids as shard_window_ids
from .pipeline import window_batches as window_batches
from .prefetch import Prefetcher as Prefetcher
from .chat_template import ChatTemplate as ChatTemplate
from .preference import PreferencePairs as PreferencePairs
from .preference import make_preference_pipeline as make_preference_pipeline
from .preference import read_preference_jsonl as read_preference_jsonl
from .preference import read_preference_pairs as read_preference_pairs
from .preference import tokenize_preference_example as tokenize_preference_example
from .sft import make_sft_pipeline as make_sft_pipeline
from .sft import pack_sft as pack_sft
from .sft import read_sft_jsonl as read_sft_jsonl
from .prefetch import prefetch as prefetch
from .sources import load_source as load_source
from .splits import split_of as split_of
from .stdlib_corpus import stdlib_corpus as stdlib_corpus
from .stdlib_corpus import stdlib_root as stdlib_root
from .text_files import TextFiles as TextFiles
from .text_files import text_files as text_files
from .token_bin import TokenBin as TokenBin
from .token_bin import load_token_bin as load_token_bin
from .token_bin import token_dtype as token_dtype
from .token_bin import write_token_bin as write_token_bin
from .token_stream import iter_document_tokens as iter_document_tokens
from .token_stream import tokenize_documents as tokenize_documents
from .tokenizers import ByteTokenizer as ByteTokenizer
from .tokenizers import Tokenizer as Tokenizer
from .windows import TokenWindows as TokenWindows
from .windows import num_windows as num_windows
from .windows import split_inputs_targets as split_inputs_targets

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "ChatTemplate",
    "Collator",
    "ContextOrder",
    "DataConfig",
    "GatherWindows",
    "HFTextColumn",
    "ModelTokenizer",
    "PipelineIterator",
    "PreferencePairs",
    "Prefetcher",
    "TextFiles",
    "TokenBin",
    "TokenWindows",
    "Tokenizer",
    "TorchBatches",
    "available_collators",
    "build_batches",
    "build_tokenizer",
    "collator",
    "corpus_note",
    "ensure_absl_flags_parsed",
    "get_collator",
    "hf_text_from_disk",
    "identity_collate",
    "iter_document_tokens",
    "load_model_tokenizer",
    "load_source",
    "load_token_bin",
    "make_pipeline",
    "make_preference_pipeline",
    "make_sft_pipeline",
    "num_windows",
    "pack_sft",
    "prefetch",
    "read_preference_jsonl",
    "read_preference_pairs",
    "read_sft_jsonl",
    "shard_window_ids",
    "source_from_path",
    "split_inputs_targets",
    "split_of",
    "stdlib_corpus",
    "stdlib_root",
    "text_files",
    "to_torch",
    "token_dtype",
    "tokenize_documents",
    "tokenize_preference_example",
    "train_bpe",
    "window_batches",
    "write_token_bin",
]
