"""Build a tiny chat model folder and a chat JSONL from this machine alone, for the fine-tune example.

    python launch/tiny_chat.py --out runs/tiny_chat
    python launch/tiny_chat.py --family gemma --out runs/tiny_gemma   # any native family's `tiny` arch

writes
    runs/tiny_chat/model/       a Hugging Face Qwen2 folder: config.json, model.safetensors (random
                                init, `qwen2_tiny`'s shape), tokenizer.json (a byte-level BPE trained
                                here) and tokenizer_config.json with a ChatML chat template
    runs/tiny_chat/chat.jsonl   conversations about the standard library: "What is the json module
                                for?" answered with the first line of the module's own docstring
    runs/tiny_chat/prefs.jsonl  preference pairs on the same questions: chosen, that answer; rejected,
                                its words in reverse order (`--config tiny_chat_dpo` learns to prefer prose)

Nothing is downloaded: the text is the running interpreter's standard library. transformers loads the
folder (`AutoModelForCausalLM`, `AutoTokenizer`) like any released checkpoint; `--config tiny_chat_sft`
fine-tunes it. `--config qwen3_moe_tiny` writes a Qwen3-MoE folder instead, which the same SFT flags
fine-tune with `--config qwen3_moe_tiny`; `--family gemma` (qwen3, dots1, ...) that family's `tiny`
architecture, which `--config sft --init_from FOLDER` fine-tunes.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import json
import os
import sys
from typing import Dict, List, Optional, Tuple

CHATML = ("{%- if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
          "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SYSTEM = "You answer questions about Python's standard library in one line."
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _modules():
    """(dotted name, path) of the standard library's modules and packages, two levels deep, tests left out."""
    from ember.data import stdlib_root

    root = stdlib_root()
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        depth = 0 if rel == "." else rel.count(os.sep) + 1
        dirnames[:] = sorted(d for d in dirnames if depth < 1 and not d.startswith(("_", "test", "idlelib", "site-")))
        package = [] if rel == "." else rel.split(os.sep)
        for name in sorted(filenames):
            if name.endswith(".py") and not name.startswith("_") or (name == "__init__.py" and package):
                parts = package + ([] if name == "__init__.py" else [name[:-3]])
                yield ".".join(parts), os.path.join(dirpath, name)


@functools.lru_cache(maxsize=2)  # parsing the standard library takes seconds: a process reads it once
def conversations(limit: int = 400) -> Tuple[Dict[str, list], ...]:
    """One conversation per standard-library module whose docstring starts with a sentence."""
    out = []
    for module, path in _modules():
        with open(path, encoding="utf-8", errors="replace") as fh:
            try:
                doc = ast.get_docstring(ast.parse(fh.read()))
            except SyntaxError:
                continue
        first = (doc or "").strip().split("\n")[0].strip()
        if len(first) < 12:
            continue
        out.append({"messages": [{"role": "system", "content": SYSTEM},
                                 {"role": "user", "content": f"What is the {module} module for?"},
                                 {"role": "assistant", "content": first}]})
        if len(out) == limit:
            break
    return tuple(out)


def preference_pairs(convs: Tuple[Dict[str, list], ...]) -> List[Dict[str, list]]:
    """TRL's conversational pairs: the question, its answer (chosen), the answer's words reversed (rejected;
    a one-word answer spelled backwards)."""
    pairs = []
    for conv in convs:
        *prompt, answer = conv["messages"]
        words = answer["content"].split()
        wrong = " ".join(reversed(words)) if len(words) > 1 else answer["content"][::-1]
        pairs.append({"prompt": prompt, "chosen": [answer], "rejected": [{"role": "assistant", "content": wrong}]})
    return pairs


def build(out: str, *, seed: int = 0, config: str = "qwen2_tiny", family: Optional[str] = None) -> str:
    """Write the folder and the JSONL under `out` (see the module docstring); returns the model folder.

    `config` names the run config whose model the folder holds (e.g. `qwen3_moe_tiny` for a Qwen3-MoE one);
    `family` instead that family's `tiny` architecture, with the same vocabulary."""
    from ember.core import random
    from ember.data import train_bpe
    from ember.launch.run_config import get_config
    from ember.models import build_model, get_config as model_config, to_hf

    convs = conversations()
    model_dir = os.path.join(out, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(out, "chat.jsonl"), "w") as fh:
        fh.writelines(json.dumps(c) + "\n" for c in convs)
    with open(os.path.join(out, "prefs.jsonl"), "w") as fh:
        fh.writelines(json.dumps(p) + "\n" for p in preference_pairs(convs))
    cfg = get_config(config)
    if family:
        cfg = dataclasses.replace(cfg, family=family, model=model_config(family, "tiny").replace(
            vocab_size=cfg.model.vocab_size))
    texts = [m["content"] for c in convs for m in c["messages"]] + ["system", "user", "assistant"]
    tokenizer = train_bpe(texts, vocab_size=cfg.model.vocab_size, special_tokens=SPECIAL_TOKENS)
    tokenizer.save(os.path.join(model_dir, "tokenizer.json"))
    with open(os.path.join(model_dir, "tokenizer_config.json"), "w") as fh:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>",
                   "pad_token": "<|endoftext|>", "chat_template": CHATML}, fh, indent=2)
    model = build_model(cfg.family, cfg.model)
    eos = tokenizer.tokenizer.token_to_id("<|im_end|>")
    to_hf(model, model.init(random.key(seed)), model_dir, extra_config={"eos_token_id": eos, "bos_token_id": None})
    return model_dir


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/tiny_chat", help="where to write model/ and chat.jsonl")
    p.add_argument("--seed", type=int, default=0, help="seed of the random init")
    p.add_argument("--config", default="qwen2_tiny", help="the run config whose model the folder holds")
    p.add_argument("--family", default=None, help="a native family (gemma, qwen3, ...): its tiny arch instead")
    args = p.parse_args(argv)
    folder = build(args.out, seed=args.seed, config=args.config, family=args.family)
    print(f"wrote {folder}, {os.path.join(args.out, 'chat.jsonl')} and {os.path.join(args.out, 'prefs.jsonl')}")


if __name__ == "__main__":
    sys.exit(main())
