"""A model folder's own tokenizer: `tokenizer.json`, its special tokens and its chat template.

Public names: `ModelTokenizer`, `load_model_tokenizer`.

`load_model_tokenizer(folder)` reads what a Hugging Face model folder ships: `tokenizer.json`
(through the `tokenizers` library), the special tokens and the chat template of
`tokenizer_config.json` (or `chat_template.jinja`). `encode_chat(messages)` gives the ids
`transformers.AutoTokenizer.apply_chat_template` gives, and a mask that is True on exactly the
assistant turns' tokens (the SFT loss mask).

Example:
    >>> import tempfile, json, pathlib
    >>> from ember.data import train_bpe
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> train_bpe(["hello there, how are you"] * 20, vocab_size=300).save(d / "tokenizer.json")
    >>> _ = (d / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "chat_template":
    ...     "{% for m in messages %}{{ m.role }}: {{ m.content }}{{ eos_token }}{% endfor %}"}))
    >>> tok = load_model_tokenizer(d)
    >>> ids, mask = tok.encode_chat([{"role": "user", "content": "hello"}, {"role": "assistant", "content": "there"}])
    >>> tok.decode(ids[mask])
    'assistant: there<|endoftext|>'
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, Mapping, Optional, Sequence, Tuple

import numpy as np
import tokenizers as hf_tokenizers

from .bpe import BPETokenizer
from .chat_template import ChatTemplate, Message
from .tokenizers import EOS_TOKEN

__all__ = ["ModelTokenizer", "load_model_tokenizer"]

_SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class ModelTokenizer(BPETokenizer):
    """A `tokenizers.Tokenizer` with its special tokens and chat template (ember's `Tokenizer` protocol).

    Args:
        tokenizer: the `tokenizers.Tokenizer` (from `tokenizer.json`).
        special_tokens: `{"bos_token": "<s>", "eos_token": "</s>", ...}`; `eos_token` sets `eos_id`.
        chat_template: the folder's template, or None if it has none.
    """

    def __init__(self, tokenizer: hf_tokenizers.Tokenizer, *, special_tokens: Mapping[str, str],
                 chat_template: Optional[ChatTemplate] = None) -> None:
        super().__init__(tokenizer, eos_token=special_tokens.get("eos_token", EOS_TOKEN))
        self.special_tokens = dict(special_tokens)
        bos = special_tokens.get("bos_token")
        self.bos_id: Optional[int] = None if bos is None else tokenizer.token_to_id(bos)
        self.chat_template = chat_template

    def __repr__(self) -> str:
        return (f"ModelTokenizer(vocab_size={self.vocab_size}, eos={self.eos_token!r}, "
                f"chat_template={'yes' if self.chat_template else 'none'})")

    def _template(self) -> ChatTemplate:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template (tokenizer_config.json has no chat_template and "
                             "there is no chat_template.jinja); pass prompt/completion data, or add a template.")
        return self.chat_template

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = False,
                            **variables: Any) -> np.ndarray:
        """The ids of the rendered conversation (as transformers' `apply_chat_template(tokenize=True)`)."""
        text = self._template().render(messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text)

    def encode_chat(self, messages: Sequence[Message], **variables: Any) -> Tuple[np.ndarray, np.ndarray]:
        """`(ids, assistant_mask)`: the conversation's ids and a bool mask, True on the tokens that
        start inside an assistant turn (its reply and the tokens closing it)."""
        text, spans = self._template().render_with_assistant_spans(messages, **variables)
        encoding = self.tokenizer.encode(text, add_special_tokens=False)
        starts = np.asarray([start for start, _ in encoding.offsets], dtype=np.int64)
        mask = np.zeros(len(starts), dtype=bool)
        for a, b in spans:
            mask |= (starts >= a) & (starts < b)
        return np.asarray(encoding.ids, dtype=np.int32), mask


def _token_text(value: Any) -> Optional[str]:
    """A special token as tokenizer_config.json writes it: a string, or `{"content": ...}`."""
    return value.get("content") if isinstance(value, dict) else value


def _chat_template_source(folder: str, config: Mapping[str, Any]) -> Optional[str]:
    jinja_file = os.path.join(folder, "chat_template.jinja")
    if os.path.isfile(jinja_file):
        with open(jinja_file) as fh:
            return fh.read()
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: the "default" one
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def load_model_tokenizer(folder: str, *, template_variables: Optional[Mapping[str, Any]] = None) -> ModelTokenizer:
    """The tokenizer a Hugging Face model folder ships (see the module docstring).

    Args:
        folder: a folder with `tokenizer.json` (and usually `tokenizer_config.json`).
        template_variables: extra variables the chat template reads (e.g. `{"enable_thinking": False}`).

    Raises:
        ValueError: no `tokenizer.json` (the folder's contents are listed), or a chat template that does
            not parse or reads unknown variables.
    """
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
        found = sorted(os.listdir(folder))[:10] if os.path.isdir(folder) else "no such folder"
        raise ValueError(f"{path} not found (the folder holds {found}); ember reads a model's tokenizer from its "
                         f"tokenizer.json. A slow (sentencepiece) tokenizer can be converted once with transformers: "
                         f"AutoTokenizer.from_pretrained(folder).save_pretrained(folder).")
    config: Dict[str, Any] = {}
    config_file = os.path.join(folder, "tokenizer_config.json")
    if os.path.isfile(config_file):
        with open(config_file) as fh:
            config = json.load(fh)
    special = {k: _token_text(config[k]) for k in _SPECIAL_KEYS if config.get(k) is not None}
    source = _chat_template_source(folder, config)
    template = None if source is None else ChatTemplate(source, special_tokens=special, extra=template_variables,
                                                        name=f"the chat template of {folder}")
    return ModelTokenizer(hf_tokenizers.Tokenizer.from_file(path), special_tokens=special, chat_template=template)
