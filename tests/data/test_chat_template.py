"""A model folder's tokenizer and chat template against transformers' `apply_chat_template`
(the same ids), and the assistant-only loss mask (exactly the assistant turns)."""

from __future__ import annotations

import json
import os

import pytest

from ember.data import train_bpe
from ember.data.chat_template import ChatTemplate
from ember.data.model_tokenizer import load_model_tokenizer

transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<s>", "</s>", "<|begin_of_text|>",
           "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]

TEMPLATES = {  # written for these tests in the style of each family's template
    "chatml": (
        "{%- if messages[0].role != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
        "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "llama3": (
        "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n"
        "{{ m.content | trim }}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"),
    "thinking": (  # earlier replies lose their reasoning, the last one keeps an empty block: prefixes differ
        "{%- for m in messages %}{%- if m.role == 'assistant' %}"
        "{%- set content = m.content.split('</think>')[-1].lstrip('\n') %}"
        "{%- if loop.last %}<|im_start|>assistant\n<think>\n\n</think>\n\n{{ content }}<|im_end|>\n"
        "{%- else %}<|im_start|>assistant\n{{ content }}<|im_end|>\n{% endif %}"
        "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}<|im_start|>assistant\n"
        "{%- if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"),
    "inst": (
        "{%- if messages[0].role == 'system' %}{% set system = messages[0].content + '\n\n' %}"
        "{% set turns = messages[1:] %}{% else %}{% set system = '' %}{% set turns = messages %}{% endif %}"
        "{{- bos_token }}{% for m in turns %}"
        "{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
        "{% if m.role == 'user' %}[INST] {% if loop.first %}{{ system }}{% endif %}{{ m.content }} [/INST]"
        "{% else %} {{ m.content }}{{ eos_token }}{% endif %}{% endfor %}"),
}

CONVERSATIONS = [
    [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 + 2?"},
     {"role": "assistant", "content": "4."}],
    [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke."}, {"role": "assistant", "content": "Why did the tensor cross the mesh?"}],
    [{"role": "system", "content": "You speak French."}, {"role": "user", "content": "Un café ☕ ?"},
     {"role": "assistant", "content": "Oui, un café."}, {"role": "user", "content": "Merci"},
     {"role": "assistant", "content": "De rien !"}],
]


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    text = [m["content"] for conv in CONVERSATIONS for m in conv] * 20
    train_bpe(text, vocab_size=400, special_tokens=SPECIAL).save(path / "tokenizer.json")
    eos = {"chatml": "<|im_end|>", "thinking": "<|im_end|>", "llama3": "<|eot_id|>", "inst": "</s>"}[request.param]
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>" if request.param ==
              "llama3" else "<s>", "eos_token": eos, "chat_template": TEMPLATES[request.param]}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return str(path)


def _hf_ids(hf, messages, **kw):
    out = hf.apply_chat_template(messages, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_ids_equal_transformers_apply_chat_template(folder, conversation):
    messages = CONVERSATIONS[conversation]
    ours, hf = load_model_tokenizer(folder), transformers.AutoTokenizer.from_pretrained(folder)
    assert ours.apply_chat_template(messages).tolist() == _hf_ids(hf, messages)
    prompt = messages[:-1]
    assert (ours.apply_chat_template(prompt, add_generation_prompt=True).tolist()
            == _hf_ids(hf, prompt, add_generation_prompt=True))
    assert ours.eos_id == hf.eos_token_id


@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_the_mask_covers_exactly_the_assistant_turns(folder, conversation):
    messages = CONVERSATIONS[conversation]
    tok = load_model_tokenizer(folder)
    ids, mask = tok.encode_chat(messages)
    assert ids.tolist() == tok.apply_chat_template(messages).tolist()
    text, spans = tok.chat_template.render_with_assistant_spans(messages)
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    assert len(spans) == len(replies)
    runs, current = [], []  # the masked tokens, as contiguous runs
    for i, on in enumerate(mask.tolist() + [False]):
        if on:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    assert [tok.decode(ids[r]) for r in runs] == [text[a:b] for a, b in spans]
    for (a, b), reply in zip(spans, replies):
        assert reply in text[a:b] and tok.eos_token in text[a:b]  # the reply and what closes it
    assert not any(m["content"] in tok.decode(ids[~mask]) for m in messages if m["role"] == "assistant"
                   and all(m["content"] not in o["content"] for o in messages if o["role"] != "assistant"))


def test_optional_variables_are_left_undefined():
    t = ChatTemplate(TEMPLATES["thinking"], special_tokens={"eos_token": "<|im_end|>"})
    prompt = [{"role": "user", "content": "hi"}]
    assert t.render(prompt, add_generation_prompt=True).endswith("<|im_start|>assistant")
    assert t.render(prompt, add_generation_prompt=True, enable_thinking=False).endswith("</think>\n\n")


def test_bad_templates_name_the_fix(tmp_path):
    with pytest.raises(ValueError, match=r"reads variable\(s\) \['date_string', 'persona'\].*ChatTemplate\(extra="):
        ChatTemplate("{{ persona }}{{ date_string }}{% for m in messages %}{{ m.content }}{% endfor %}")
    assert ChatTemplate("{{ persona }}", extra={"persona": "x"}).render([]) == "x"
    with pytest.raises(ValueError, match=r"not valid Jinja \(line 1"):
        ChatTemplate("{% for m in messages %}")
    inst = ChatTemplate(TEMPLATES["inst"], special_tokens={"bos_token": "<s>", "eos_token": "</s>"})
    with pytest.raises(ValueError, match=r"refused the conversation: roles must alternate"):
        inst.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    os.makedirs(tmp_path / "empty")
    with pytest.raises(ValueError, match=r"tokenizer\.json not found \(the folder holds \[\]\)"):
        load_model_tokenizer(tmp_path / "empty")


ROLE_TEMPLATES = [  # (template, the roles it accepts beyond system / user / assistant / tool)
    (TEMPLATES["chatml"], set()),
    ("{% for m in messages %}{% if m.role == 'ipython' or m['role'] == 'tool' %}<|ipython|>{% endif %}"
     "{{ m.content }}{% endfor %}", {"ipython"}),
    ("{% for m in messages %}{% set role = m.role | lower %}{% if role in ['developer', 'system'] %}#{% endif %}"
     "{{ m.content }}{% endfor %}", {"developer"}),
]


@pytest.mark.parametrize("source, extra", ROLE_TEMPLATES, ids=["chatml", "ipython", "developer"])
def test_roles_are_the_standard_ones_and_those_the_template_names(source, extra):
    t = ChatTemplate(source, special_tokens={"eos_token": "</s>"})
    assert t.roles == {"system", "user", "assistant", "tool"} | extra
    for role in sorted(t.roles):
        t.render([{"role": role, "content": "x"}])
    with pytest.raises(ValueError, match=r"^messages\[1\] has role 'narrator', which chat template does not know; "
                                         r"expected one of \[.*'user'\] \(the standard roles and those the template "
                                         r"names\)\. Rename the role, or use a template that names it\.$"):
        t.render([{"role": "user", "content": "x"}, {"role": "narrator", "content": "y"}])
    with pytest.raises(ValueError, match=r"has role 'Assistant'.*Did you mean 'assistant'\?"):
        t.render([{"role": "Assistant", "content": "y"}])
