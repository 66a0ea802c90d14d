"""Path-pattern rules: logical axes for parameters that have none, from their dotted names.

Public names: `axes_from_rules`, `AxesRule`, `DefaultAxes`.

A module bridged from plain PyTorch (`ember.models.bridge.from_torch`) has no `Param`
declarations, so its parameters carry no logical axes. An ordered list of `(regex, axes)` pairs
gives them some: a parameter takes the axes of the first rule whose regex `re.search`es its dotted
name (`(r"blocks\\.\\d+\\.attn\\.w[qkv]\\.weight$", ("heads", "embed"))`). From there the
ordinary logical-axis rules (`rules.py`) place it on the mesh like any ember layer.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Literal, Mapping, Sequence, Tuple, Union

from ..types import LogicalAxes

__all__ = ["AxesRule", "DefaultAxes", "axes_from_rules"]

AxesRule = Tuple[str, LogicalAxes]
"""`(regex, axes)`: parameters whose dotted name matches `regex` (`re.search`) get `axes`."""

DefaultAxes = Union[LogicalAxes, Literal["replicated"], None]

_MSG_UNPLACED = (
    "parameter '{name}' (shape {shape}) matches none of the axes rules, and no default_axes was "
    "given. Rules, in order:\n{rules}\nAdd a rule whose regex matches '{name}' (matched with "
    "re.search against the dotted name), or pass default_axes=(...) or "
    "default_axes='replicated' to from_torch."
)


def _check_rules(rules: Sequence[Any]) -> List[Tuple[re.Pattern, LogicalAxes, str]]:
    if isinstance(rules, (str, bytes)) or not isinstance(rules, Sequence):
        raise TypeError(
            f"axes_rules must be a list of (regex, axes_tuple) pairs, got {type(rules).__name__}, "
            f"e.g. [(r'\\.q_proj\\.weight$', ('heads', 'embed'))]."
        )
    out = []
    for i, rule in enumerate(rules):
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2 and isinstance(rule[0], str)
                and isinstance(rule[1], tuple)):
            raise TypeError(
                f"axes_rules[{i}] must be a (regex: str, axes: tuple) pair, got {rule!r}, e.g. "
                f"(r'\\.q_proj\\.weight$', ('heads', 'embed'))."
            )
        pattern, axes = rule
        if not all(a is None or isinstance(a, str) for a in axes):
            raise TypeError(f"axes_rules[{i}] axes {axes!r} must hold str or None per dimension.")
        try:
            compiled = re.compile(pattern)
        except re.error as e:
            raise ValueError(f"axes_rules[{i}] regex {pattern!r} does not compile: {e}.") from e
        out.append((compiled, tuple(axes), pattern))
    return out


def axes_from_rules(
    shapes: Mapping[str, Sequence[int]],
    rules: Sequence[AxesRule],
    *,
    default_axes: DefaultAxes = None,
) -> Dict[str, LogicalAxes]:
    """Logical axes for each named parameter from ordered path-pattern rules (first match wins).

    Args:
        shapes: dotted parameter name -> shape.
        rules: ordered `(regex, axes)` pairs; the regex is `re.search`ed in the dotted name and
            `axes` needs one name (or None) per dimension.
        default_axes: axes for a parameter no rule matches: a tuple (its length must equal the
            parameter's rank), `"replicated"` (all None), or None to raise.

    Returns:
        Dotted name -> axes tuple, in the order of `shapes`.

    Raises:
        ValueError: a parameter matches no rule and there is no default (the message names it and
            lists the rules), or a matched rule / the default has the wrong number of axes.
        TypeError: a rule is not a `(str, tuple)` pair.

    Example:
        >>> axes_from_rules({"fc.weight": (8, 4), "fc.bias": (8,)}, [(r"weight$", ("mlp", "embed"))],
        ...                 default_axes="replicated")
        {'fc.weight': ('mlp', 'embed'), 'fc.bias': (None,)}
    """
    compiled = _check_rules(rules)
    if isinstance(default_axes, str) and default_axes != "replicated":
        raise ValueError(f"default_axes must be a tuple, 'replicated' or None, got {default_axes!r}.")
    if default_axes is not None and default_axes != "replicated" and not isinstance(default_axes, tuple):
        raise TypeError(
            f"default_axes must be a tuple of axis names, 'replicated' or None, got {default_axes!r}."
        )
    out: Dict[str, LogicalAxes] = {}
    for name, shape in shapes.items():
        ndim = len(shape)
        for regex, axes, pattern in compiled:
            if regex.search(name):
                if len(axes) != ndim:
                    raise ValueError(
                        f"axes rule ({pattern!r}, {axes}) gives {len(axes)} axes to parameter '{name}' of "
                        f"shape {tuple(shape)} ({ndim} dims); give one axis name (or None) per dimension, "
                        f"or make the regex stricter so it does not match '{name}'."
                    )
                out[name] = axes
                break
        else:
            if default_axes is None:
                listing = "\n".join(f"  {i}: ({p!r}, {a})" for i, (_, a, p) in enumerate(compiled)) or "  (none)"
                raise ValueError(_MSG_UNPLACED.format(name=name, shape=tuple(shape), rules=listing))
            if default_axes == "replicated":
                out[name] = (None,) * ndim
            elif len(default_axes) != ndim:
                raise ValueError(
                    f"default_axes {default_axes} has {len(default_axes)} axes but parameter '{name}' has "
                    f"shape {tuple(shape)} ({ndim} dims); add a rule for '{name}' or use "
                    f"default_axes='replicated'."
                )
            else:
                out[name] = default_axes
    return out
