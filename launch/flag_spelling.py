"""What `parse_cli` adds around tyro: the boolean spellings users type, and tyro's errors as one line.

    args = bool_words(["--model.tie_embeddings", "False"], {"model.tie_embeddings": bool})
    # ["--model.no_tie_embeddings"]: tyro's own spelling (`--flag` / `--no-flag`)
    message = one_line(captured_stderr, args, value_of=lambda path: ...)
    # "--steps 'abc' is not an INT (...); pass e.g. --steps 300."

tyro prints a parse error as a box on stderr and exits 2; `parse_cli` captures that text and raises
`ValueError(one_line(...))`, which the launchers print as their usual `error: ...` line.
"""

from __future__ import annotations

import difflib
import re
from typing import Any, Callable, List, Mapping, Optional, Sequence

__all__ = ["bool_words", "one_line"]

_BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False, "off": False}


def bool_words(args: Sequence[str], hints: Mapping[str, Any]) -> List[str]:
    """`args` with `--flag False` / `--flag=true` / `--flag 0` of each bool field (`hints[path] is bool`)
    rewritten as tyro spells them: `--flag` or `--no_flag`.

    Raises:
        ValueError: a bool field's value is no boolean word (true/false, 1/0, yes/no, on/off).
    """
    out, i = [], 0
    while i < len(args):
        arg, i = args[i], i + 1
        name, eq, value = arg[2:].partition("=")
        path = name.replace("-", "_")
        if not arg.startswith("--") or hints.get(path) is not bool:
            out.append(arg)
            continue
        if not eq and i < len(args) and not args[i].startswith("-"):
            value, eq, i = args[i], "=", i + 1  # a bool flag's value: nothing else may follow it
        if eq:
            if value.lower() not in _BOOL_WORDS:
                raise ValueError(f"--{name} {value}: --{name} is true or false; pass --{name} True (or just "
                                 f"--{name}) or --{name} False.")
            head, _, last = path.rpartition(".")
            arg = f"--{name}" if _BOOL_WORDS[value.lower()] else f"--{head + '.' if head else ''}no_{last}"
        out.append(arg)
    return out


def _sections(text: str) -> List[str]:
    """The box's text blocks (between its rules), each joined into one line; the title left out.
    Both of tyro's boxes: drawn with `╭─│` (UTF-8 stdout) or with `-` rules only; colours removed."""
    lines = [line.strip().strip("│╭╮╰╯").strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", text).splitlines()]
    lines = [line for line in lines if line][1:]  # the first is the title
    sections: List[str] = []
    current: List[str] = []
    for row in lines + ["-"]:
        if not row.strip("─-") or row.startswith("For full helptext"):
            if current:
                sections.append(" ".join(current))
            current = []
        else:
            current.append(row)
    return sections


def _typed(flag: str, args: Sequence[str]) -> str:
    """`flag` (tyro's spelling, `--optim.learning-rate`) as the user typed it, with its value."""
    name = flag[2:].replace("-", "_")
    for i, arg in enumerate(args):
        typed, eq, value = arg.partition("=")
        if typed[2:].replace("-", "_") == name:
            value = value if eq else (args[i + 1] if i + 1 < len(args) else "")
            return f"{typed} {value}".strip()
    return flag


def _example(flag: str, value_of: Callable[[str], Any]) -> str:
    value = value_of(flag[2:].replace("-", "_"))
    return f"; pass e.g. {flag} {value}" if value is not None else f"; `--help` shows what {flag} takes"


def one_line(text: str, args: Sequence[str], value_of: Callable[[str], Any]) -> str:
    """tyro's parse error (the captured stderr `text`) as one line naming the flag and its fix.

    Args:
        text: what tyro printed before exiting 2.
        args: the command line it parsed (to find what came before an unexpected argument).
        value_of: dotted field name -> the run config's value (None: unknown), used as the example.
    """
    sections = _sections(text) or [" ".join(text.split())]
    first = sections[0]
    helptext = next((s for s in sections if s.startswith("Argument helptext:")), "")
    m = re.match(r"Error parsing (--\S+): (.*)", first)
    if m:
        flag, reason = m.groups()
        kind = re.match(r"Argument helptext: --\S+ (\S+)", helptext)
        what = f"is not a valid {kind.group(1)}" if kind else "is not valid"
        typed = _typed(flag, args)
        return f"{typed} {what} ({reason}){_example(typed.split()[0], value_of)}."
    m = re.match(r"invalid choice '(.*)' for argument '(--\S+)'\. Expected one of \((.*)\)\.?$", first)
    if m:
        value, flag, choices = m.groups()
        flag = _typed(flag, args).split()[0]
        names = re.findall(r"'([^']*)'", choices) or [c.strip() for c in choices.split(",")]
        close = difflib.get_close_matches(value, names, n=1) or [value_of(flag[2:].replace("-", "_")) or names[0]]
        return f"{flag} {value} is not one of {', '.join(names)}; pass e.g. {flag} {close[0]}."
    m = re.match(r"Missing value for argument '(--\S+)'", first)
    if m:
        flag = _typed(m.group(1), args).split()[0]
        return f"{flag} needs a value{_example(flag, value_of)}."
    m = re.match(r"Unrecognized options?: (.*)", first)
    if m:
        extra = m.group(1).split()[0] if m.group(1).split() else m.group(1)
        before = _before(extra, args)
        after = f" after {before}" if before else ""
        return (f"unexpected argument {extra!r}{after}: each flag takes one value (quote a value with spaces, "
                f"e.g. --sample_prompt \"def main\"); `--help` lists every flag.")
    return f"{first.rstrip('.')}; `--help` lists every flag."


def _before(extra: str, args: Sequence[str]) -> Optional[str]:
    """The flag and value that came before `extra` in `args`, e.g. `--steps 3`."""
    if extra not in args:
        return None
    i = list(args).index(extra)
    if i == 0:
        return None
    start = max((j for j in range(i) if args[j].startswith("--")), default=i - 1)
    return " ".join(args[start:i])
