"""The ``cached`` decorators' shared half: key fields come from the decorated function's
parameters, and its return annotation declares the namespace's value type.

Checked when the function is decorated (at import), not at its first call: a missing
key parameter or a conflicting value type is a bug in the code, not in a request.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

from layered_cache._namespace import Namespace

__all__ = ["bind_key_fields", "cached"]

T = TypeVar("T")
P = ParamSpec("P")


def bind_key_fields(
    namespace: Namespace, fn: Callable[..., Any], value_type: Any = None
) -> inspect.Signature:
    """Checks shared by the async and sync decorators: every key field is a parameter
    of ``fn``; ``value_type`` (or else ``fn``'s return annotation) is declared as the
    namespace's value type. Returns the signature to bind calls with."""
    template = namespace.policy.template
    signature = inspect.signature(fn)
    missing = [f for f in template.fields if f not in signature.parameters]
    if missing:
        raise KeyError(
            f"namespace {namespace.name!r}: {fn.__qualname__} has no parameter for key "
            f"field(s) {missing} of template {template.template!r}"
        )
    declared = value_type
    if declared is None:
        declared = typing.get_type_hints(fn).get("return")
    if declared is not None:
        namespace._declare_type(declared, by=fn.__qualname__)
    return signature


def cached(
    namespace: Namespace, fn: Callable[P, Awaitable[T]], value_type: Any = None
) -> Callable[P, Awaitable[T]]:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{fn.__qualname__} is not an async function: LayeredCache.cached caches "
            "`async def` functions (for a plain `def`, use SyncLayeredCache.cached)"
        )
    signature = bind_key_fields(namespace, fn, value_type)

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return await namespace.get_or_load(bound.arguments, lambda: fn(*args, **kwargs))

    return wrapper
