"""Runtime checking of jaxtyping annotations that stays out of the way of `torch.compile`.

Public names: `typechecked`.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from ..trace_context import here


def typechecked(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Check jaxtyping annotations with beartype in eager mode; skip checks under torch.compile.

    jaxtyping + beartype checks fail under `torch.compile` (and give false errors without
    `fullgraph`), so the wrapper calls `fn` unchecked while Dynamo traces (`here().tracer == "dynamo"`).

    Args:
        fn: a function annotated with jaxtyping types, e.g. `Float[torch.Tensor, "b t d"]`.

    Returns:
        The wrapped function.

    Raises:
        jaxtyping.TypeCheckError: (a `TypeError`, when called eagerly) an argument or the return
            value does not match its annotation, shapes included.

    Example:
        >>> import torch
        >>> from jaxtyping import Float
        >>> from ember.core.testing import typechecked
        >>> @typechecked
        ... def attend(q: Float[torch.Tensor, "b t d"], k: Float[torch.Tensor, "b s d"]
        ...            ) -> Float[torch.Tensor, "b t s"]:
        ...     return q @ k.transpose(1, 2)   # (b, t, d) @ (b, d, s) -> (b, t, s)
        >>> attend(torch.ones(2, 3, 4), torch.ones(2, 5, 4)).shape
        torch.Size([2, 3, 5])
        >>> try:
        ...     attend(torch.ones(2, 3, 4), torch.ones(2, 5, 8))
        ... except TypeError as e:
        ...     print(type(e).__name__)
        TypeCheckError
    """
    from beartype import beartype
    from jaxtyping import jaxtyped

    checked = jaxtyped(typechecker=beartype)(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if here().tracer == "dynamo":
            return fn(*args, **kwargs)
        return checked(*args, **kwargs)

    return wrapper
