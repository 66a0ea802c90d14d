"""Chat templates: a model folder's Jinja template rendered as transformers renders it, and the
character spans of the assistant turns (what an SFT loss mask covers).

Public names: `ChatTemplate`.

The template comes from `tokenizer_config.json` (`chat_template`) or `chat_template.jinja`. It is
rendered with Jinja2 in a sandbox set up like transformers' `apply_chat_template`: blocks trimmed,
loop controls, `raise_exception`, `strftime_now` and a `tojson` that keeps non-ASCII text; the
special tokens (`bos_token`, `eos_token`, ...) are variables. So the same messages give the same
text, and through the same `tokenizer.json` the same ids.

Roles: a message's role must be one of `STANDARD_ROLES` (system, user, assistant, tool: what
transformers' templates and the OpenAI format use) or one the template itself compares a role with
(Llama 3.1's `ipython`, gpt-oss's `developer`); any other (a typo such as `assitant`) is refused
rather than rendered as a header the model never saw.

Example:
    >>> t = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{{ eos_token }}{% endfor %}"
    ...                  "{% if add_generation_prompt %}<assistant>{% endif %}", special_tokens={"eos_token": "</s>"})
    >>> msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    >>> t.render(msgs)
    '<user>hi</s><assistant>hello</s>'
    >>> text, spans = t.render_with_assistant_spans(msgs)
    >>> [text[a:b] for a, b in spans]
    ['hello</s>']
"""

from __future__ import annotations

import datetime
import json
import difflib
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.sandbox

__all__ = ["ChatTemplate"]

Message = Mapping[str, Any]

STANDARD_ROLES = ("system", "user", "assistant", "tool")
"""Roles every template is taken to accept; a template adds the roles it names (`ChatTemplate.roles`)."""

_RENDER_VARIABLES = ("messages", "add_generation_prompt", "tools", "documents", "continue_final_message")
"""What every render passes (None when not given); the special tokens and `extra` variables are added."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: Optional[int] = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _reads_role(node: jinja2.nodes.Node) -> bool:
    """`m.role`, `m['role']`, a variable called `role`, or one of them through a filter (`m.role | lower`)."""
    if isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        return _reads_role(node.node)
    if isinstance(node, jinja2.nodes.Getattr):
        return node.attr == "role"
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "role"
    return isinstance(node, jinja2.nodes.Name) and node.name == "role"


def _roles_named(ast: jinja2.nodes.Template) -> Set[str]:
    """The strings a template compares a role with: `m.role == 'ipython'`, `role in ['developer', ...]`."""
    roles: Set[str] = set()
    for compare in ast.find_all(jinja2.nodes.Compare):
        operands = [compare.expr, *(op.expr for op in compare.ops)]
        if not any(_reads_role(x) for x in operands):
            continue
        for x in operands:
            items = x.items if isinstance(x, (jinja2.nodes.List, jinja2.nodes.Tuple)) else [x]
            roles |= {c.value for c in items if isinstance(c, jinja2.nodes.Const) and isinstance(c.value, str)}
    return roles


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                       extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """A compiled chat template.

    Args:
        source: the Jinja template text.
        special_tokens: variables naming the tokenizer's special tokens (`{"bos_token": "<s>", ...}`).
        extra: more variables the template reads (for example `{"enable_thinking": False}`).
        name: where the template came from, for error messages.

    Attributes:
        roles: the roles a message may have: `STANDARD_ROLES` and those the template compares a role with.

    Raises:
        ValueError: the template does not parse, or reads a variable that no render provides (each
            unknown name is listed, with the fix).
    """

    def __init__(self, source: str, *, special_tokens: Optional[Mapping[str, str]] = None,
                 extra: Optional[Mapping[str, Any]] = None, name: str = "chat template") -> None:
        env = _environment()
        try:
            ast = env.parse(source)
        except jinja2.exceptions.TemplateSyntaxError as err:
            raise ValueError(f"{name} is not valid Jinja (line {err.lineno}: {err.message}).") from err
        self.variables: Dict[str, Any] = {**(special_tokens or {}), **(extra or {})}
        known = set(_RENDER_VARIABLES) | set(self.variables) | set(env.globals)
        # A name set in one branch only counts as undeclared for jinja2.meta: a name set anywhere is the
        # template's own. A name the template tests with `is defined` is optional (Qwen3's enable_thinking,
        # Llama 3.1's builtin_tools): transformers leaves it undefined, and so does this.
        own = {n.name for n in ast.find_all(jinja2.nodes.Name) if n.ctx in ("store", "param")}
        optional = {t.node.name for t in ast.find_all(jinja2.nodes.Test)
                    if t.name in ("defined", "undefined") and isinstance(t.node, jinja2.nodes.Name)}
        self.roles = frozenset(STANDARD_ROLES) | _roles_named(ast)  # before jinja2.meta, which rewrites the AST
        unknown = sorted(jinja2.meta.find_undeclared_variables(ast) - known - own - optional)
        if unknown:
            raise ValueError(
                f"{name} reads variable(s) {unknown} that no render provides (known: "
                f"{sorted(set(_RENDER_VARIABLES) | set(self.variables))}); pass them as ChatTemplate(extra={{...}}) "
                f"or fix the template."
            )
        self.source = source
        self.name = name
        self._template = env.from_string(source)

    def _check_roles(self, messages: Sequence[Message]) -> None:
        for i, message in enumerate(messages):
            role = message.get("role") if isinstance(message, Mapping) else None
            if role in self.roles:
                continue
            close = difflib.get_close_matches(str(role), sorted(self.roles), n=1)
            raise ValueError(
                f"messages[{i}] has role {role!r}, which {self.name} does not know; expected one of "
                f"{sorted(self.roles)} (the standard roles and those the template names)."
                + (f" Did you mean {close[0]!r}?" if close else " Rename the role, or use a template that names it.")
            )

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = False, **variables: Any) -> str:
        """The conversation as the model reads it (`add_generation_prompt`: end with the assistant's cue).

        Raises:
            ValueError: a message's role is not in `roles`, or the template refused the conversation.
        """
        self._check_roles(messages)
        values = {name: None for name in _RENDER_VARIABLES}
        values.update(self.variables)
        values.update(variables)
        values.update(messages=list(messages), add_generation_prompt=add_generation_prompt)
        try:
            return self._template.render(**values)
        except jinja2.exceptions.TemplateError as err:
            raise ValueError(f"{self.name} refused the conversation: {err}") from err

    def render_with_assistant_spans(self, messages: Sequence[Message],
                                    **variables: Any) -> Tuple[str, List[Tuple[int, int]]]:
        """The rendered conversation and the `(start, end)` character span of each assistant turn.

        A turn's span runs from where the conversation before it, rendered with the generation cue,
        ends, to where the conversation up to it ends: the reply and the tokens that close it
        (`<|im_end|>`, `</s>`), which the model must learn to emit. A template whose render of a prefix
        of the conversation is not a prefix of the whole (Qwen3 drops earlier turns' reasoning) has each
        reply found in the text in order instead, with the end-of-text token after it.

        Raises:
            ValueError: a reply is not in the rendered text (the turn is named).
        """
        text = self.render(messages, **variables)
        spans: List[Tuple[int, int]] = []
        for i, message in enumerate(messages):
            if message.get("role") != "assistant":
                continue
            start = len(self.render(messages[:i], add_generation_prompt=True, **variables)) if i else 0
            upto = self.render(messages[:i + 1], **variables)
            if not text.startswith(upto) or start > len(upto):
                return text, self._spans_in_order(text, messages)
            spans.append((start, len(upto)))
        return text, spans

    def _spans_in_order(self, text: str, messages: Sequence[Message]) -> List[Tuple[int, int]]:
        spans, cursor, eos = [], 0, self.variables.get("eos_token") or ""
        for i, message in enumerate(messages):
            content = str(message.get("content", ""))
            at = text.find(content, cursor)
            if message.get("role") != "assistant":
                cursor = at + len(content) if at >= 0 else cursor  # a turn the template left out moves nothing
                continue
            if at < 0:
                raise ValueError(f"{self.name}: the reply of turn {i} (assistant) is not in the rendered conversation, "
                                 f"so its tokens cannot be masked; check the template's handling of assistant turns.")
            end = at + len(content)
            end += len(eos) if eos and text.startswith(eos, end) else 0
            spans.append((at, end))
            cursor = end
        return spans
