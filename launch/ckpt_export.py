"""`launch/ckpt.py export`: a checkpoint's parameters to one safetensors file or a Hugging Face folder.

Public names: `export`, `TOKENIZER_FILES`.

    export("runs/a", out="model.safetensors")                # the latest step, ember's parameter names
    export("runs/a", step=200, out="runs/a/hf", hf=True)     # config.json + model.safetensors (+ tokenizer)

Nothing is replaced without `overwrite=True`: an existing `out` file, or in an `hf` folder any file
the export would write, is refused before anything is written (a `ValueError` naming it). A run
trained with LoRA (`--lora.rank R`) exports merged weights with `hf`. A run that read its tokenizer
from a Hugging Face folder (`--data.tokenizer model`, or its `--init_from` folder) takes that folder's
tokenizer files and chat template into the `hf` folder, and its `bos_token_id` / `eos_token_id`; a
byte-tokenizer run gets a `tokenizer.json` of the same ids (`ember.data.bpe.bytes_as_bpe`); a BPE run
(trained in memory, never saved) gets none, said in one line on stderr.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from typing import Any, List, Mapping, Optional

from ember.launch.ckpt_tools import checkpoint_root, lora_of_run, missing_step_message, model_config_from_dict

__all__ = ["TOKENIZER_FILES", "export"]

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "chat_template.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
                   "generation_config.json")
"""What `transformers`' `save_pretrained` of a tokenizer (and a generation config) writes; copied when present."""

_TOKEN_IDS = ("bos_token_id", "eos_token_id")
"""`config.json` entries carried from the run's Hugging Face folder: they name its tokenizer's ids."""

_HF_FILES = ("config.json", "model.safetensors")


def _refuse_existing(paths: List[str], out: str) -> None:
    """Raise a ValueError naming the paths that exist (export replaces them only with --overwrite)."""
    existing = [p for p in paths if os.path.lexists(p)]
    if not existing:
        return
    kind = "a folder" if os.path.isdir(out) else "a file"
    where = (f"{out} already exists ({kind})" if existing == [out] else
             f"{out} already holds {', '.join(os.path.basename(p) for p in existing)}")
    raise ValueError(f"{where}; export never replaces files: pass another --out, or --overwrite to replace "
                     f"{'them' if len(existing) > 1 else 'it'}.")


def _tokenizer_folder(config: Optional[Mapping[str, Any]]) -> Optional[str]:
    """The Hugging Face folder the run read its tokenizer from, per its saved run config (None: none)."""
    config = config or {}
    data = config.get("data") or {}
    if data.get("tokenizer") == "model" and data.get("tokenizer_path"):
        return data["tokenizer_path"]
    init = config.get("init_from")
    return init if init and os.path.isfile(os.path.join(init, "config.json")) else None


def _copy_tokenizer(source: Optional[str], out: str) -> List[str]:
    """Copy `source`'s tokenizer files into `out`; the names copied (a note on stderr if `source` is gone)."""
    if source is None:
        return []
    if not os.path.isdir(source):
        print(f"note: the run read its tokenizer from {source}, which is not here (run the export where the run "
              f"ran, or copy its {', '.join(TOKENIZER_FILES[:2])} into {out})", file=sys.stderr)
        return []
    copied = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(source, name))]
    for name in copied:
        shutil.copyfile(os.path.join(source, name), os.path.join(out, name))
    return copied


_BYTES_FILES = ("tokenizer.json", "tokenizer_config.json")
"""What an export of a byte-tokenizer run writes for its tokenizer (`_write_byte_tokenizer`)."""


def _tokenizer_kind(config: Optional[Mapping[str, Any]]) -> str:
    """The run's `data.tokenizer` ("bytes", "bpe", "model"), per its saved run config."""
    return ((config or {}).get("data") or {}).get("tokenizer") or "bytes"


def _write_byte_tokenizer(out: str) -> dict:
    """The byte tokenizer (256 bytes, EOS 256) as files `transformers.AutoTokenizer` loads; its config.json ids."""
    from ember.data import ByteTokenizer
    from ember.data.bpe import bytes_as_bpe

    tokenizer = ByteTokenizer(eos=True)
    bytes_as_bpe(tokenizer).save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "clean_up_tokenization_spaces": False}, fh, indent=2)
    return {"eos_token_id": tokenizer.eos_id}


def _no_tokenizer_note(kind: str) -> None:
    """One line on stderr: this export has no tokenizer, and why."""
    print(f"note: no tokenizer written: the run trained its --data.tokenizer {kind} in memory and saved none, so "
          f"transformers' AutoTokenizer has nothing to load from this folder (the weights load as they are)",
          file=sys.stderr)


def _token_ids(source: Optional[str]) -> dict:
    """`bos_token_id` / `eos_token_id` of `source`'s config.json (empty when it has none)."""
    file = os.path.join(source or "", "config.json")
    if source is None or not os.path.isfile(file):
        return {}
    with open(file) as fh:
        hf = json.load(fh)
    return {k: hf[k] for k in _TOKEN_IDS if k in hf}


def export(directory: str, *, step: Optional[int] = None, out: str, hf: bool = False, overwrite: bool = False) -> str:
    """Write the parameters of `step` (default: the latest) to `out`; returns `out`.

    Args:
        directory: a run directory (`--out` of launch/train.py) or its `checkpoints/` folder.
        step: the step to export; None for the latest.
        out: a `.safetensors` file, or with `hf` a folder.
        hf: write a Hugging Face folder (config.json, model.safetensors, the run's tokenizer files).
        overwrite: replace existing files; without it any existing one is refused, nothing written.

    Raises:
        ValueError: `out` exists (or files in it would be replaced) without `overwrite`; `hf` of a step
            with no model config.
        CheckpointError: no such step, or no checkpoint in `directory`.
    """
    import torch

    from ember.core import random
    from ember.core.checkpoint import CheckpointError, CheckpointManager
    from ember.models.hf import save_safetensors

    if not overwrite and not (hf and os.path.isdir(out)):  # before anything is read (a folder: below)
        _refuse_existing([out], out)
    root = checkpoint_root(directory)
    with CheckpointManager(root, read_only=True) as ckpt:
        steps = ckpt.all_steps()
        if step is not None and steps and step not in steps:
            raise CheckpointError(missing_step_message(str(ckpt.directory), step, steps))
        meta = ckpt.read_meta(step)
        if not hf:
            params = ckpt.restore_params(meta.step)
            seen, tensors = set(), {}
            for name, t in params.items():  # safetensors refuses two names for one tensor (tied weights)
                tensors[name] = t.clone() if id(t) in seen else t
                seen.add(id(t))
            header = {"step": str(meta.step), "model": json.dumps(meta.model), "format": "ember-params"}
            save_safetensors(tensors, out, metadata=header)
            return out
        from ember.models import build_model, to_hf

        if not meta.model or not meta.model.get("config"):
            raise ValueError(f"step {meta.step} records no model config, so --hf cannot rebuild the model; "
                             f"export plain safetensors (drop --hf) instead.")
        source = _tokenizer_folder(meta.config)
        kind = None if source else _tokenizer_kind(meta.config)  # a tokenizer ember built: bytes or a BPE
        names = _HF_FILES + tuple(n for n in TOKENIZER_FILES if source and os.path.isfile(os.path.join(source, n)))
        names += _BYTES_FILES if kind == "bytes" else ()
        if not overwrite and os.path.isdir(out):  # every file this export would write
            _refuse_existing([os.path.join(out, n) for n in names], out)
        model = build_model(meta.model["family"], model_config_from_dict(meta.model["config"]))
        adapted = lora_of_run(model, meta.config)  # a LoRA run's params: {"base": ..., "lora": ...}
        with torch.device("meta"):
            like = adapted.param_shapes() if adapted else model.init(random.key(0))  # shapes only: no memory
        params = ckpt.restore_params(meta.step, like=like, model_info=meta.model)
        ids = _token_ids(source)
        if kind == "bytes":
            os.makedirs(out, exist_ok=True)
            ids = _write_byte_tokenizer(out)
        to_hf(model, adapted.merged(params) if adapted else params, out, extra_config=ids)
        _copy_tokenizer(source, out)
        if kind not in (None, "bytes"):
            _no_tokenizer_note(kind)
        return out
