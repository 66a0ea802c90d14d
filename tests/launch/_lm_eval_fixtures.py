"""A tiny local model folder and three local lm-eval tasks (one of each output type), for tests/launch/test_lm_eval.py.

Nothing is downloaded: the model is a random-init `qwen2_tiny` saved as a Hugging Face folder with a BPE trained
here (re-saved by transformers, so `AutoTokenizer` and the folder's `tokenizer.json` split text alike), and each
task reads a JSONL written next to its YAML (`dataset_path: json`).
"""

from __future__ import annotations

import json
import pathlib

TASKS = ("ember_mc", "ember_ppl", "ember_gen")

_YAML = {
    "ember_mc": """task: ember_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "Question: What is {{{{a}}}} plus {{{{a}}}}?\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{label}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "ember_ppl": """task: ember_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "ember_gen": """task: ember_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "What is {{{{a}}}} plus {{{{a}}}}?"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n", " 2"]
  max_gen_toks: 12
  do_sample: false
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
""",
}


def _docs(name: str) -> list:
    if name == "ember_mc":
        return [{"a": a, "choices": [f" {2 * a}", f" {2 * a + 1}", f" {a}"], "label": a % 3} for a in range(6)]
    if name == "ember_ppl":
        long = " ".join(f"{i} plus {i} is {2 * i}." for i in range(60))  # longer than max_length: several windows
        return [{"text": "What is 2 plus 2? 2 plus 2 is 4."}, {"text": long}, {"text": "hello there"}]
    return [{"a": a, "answer": f" {2 * a}"} for a in range(5)]


def write_tasks(root: pathlib.Path) -> str:
    """The three task YAMLs and their JSONL data under `root/tasks`; returns that folder (an --include_path)."""
    folder = root / "tasks"
    folder.mkdir(parents=True, exist_ok=True)
    for name in TASKS:
        data = folder / f"{name}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in _docs(name)))
        (folder / f"{name}.yaml").write_text(_YAML[name].format(data=data))
    return str(folder)


def write_model(root: pathlib.Path) -> str:
    """A Qwen2 folder of `qwen2_tiny`'s shape with a BPE of its own; returns the folder."""
    import torch
    import transformers

    from ember.core import pytree, random
    from ember.data import train_bpe
    from ember.launch.run_config import get_config
    from ember.launch.tiny_chat import SPECIAL_TOKENS
    from ember.models import build_model, to_hf

    folder = root / "model"
    folder.mkdir(parents=True, exist_ok=True)
    cfg = get_config("qwen2_tiny")
    texts = [f"What is {i} plus {i}? {i} plus {i} is {2 * i}.\nQuestion: Answer:" for i in range(200)]
    tokenizer = train_bpe(texts, vocab_size=cfg.model.vocab_size, special_tokens=SPECIAL_TOKENS)
    tokenizer.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}))
    model = build_model(cfg.family, cfg.model)
    # Weights scaled up at random: a plain random init repeats one token, these greedy replies vary and hit " 2".
    params = pytree.tree_map(lambda t: t * (1 + 3 * torch.rand(t.shape, generator=torch.Generator().manual_seed(1))),
                             model.init(random.key(0)))
    to_hf(model, params, str(folder),
          extra_config={"eos_token_id": tokenizer.tokenizer.token_to_id("<|im_end|>"), "bos_token_id": None})
    transformers.AutoTokenizer.from_pretrained(str(folder)).save_pretrained(str(folder))  # as transformers reads it
    return str(folder)
