"""The ``cached`` decorators' shared half: key fields come from the decorated function's
parameters, and its return annotation declares the namespace's value type.

Checked when the function is decorated (at import), not at its first call: a missing
key parameter, a parameter the key leaves out, or a conflicting value type is a bug in
the code, not in a request.

The key template names every argument: a parameter it does not name would let calls that
differ only in that argument share one entry (``book_detail(1, "fr")`` answered with the
value of ``book_detail(1, "en")``), so it is refused, defaults and ``*args``/``**kwargs``
included. A method's ``self``/``cls`` (its first parameter) is exempt: the entry lives
in L2, shared by every instance and process, so it can't be keyed on one object. Only a
method's: a function defined outside a class body whose first parameter happens to be
named ``cls`` (a category) or ``self`` is keyed on it like on any other argument, or
refused. So is what the caller names in ``ignore=`` (a database session: it never
changes the value).
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, ParamSpec, TypeVar

from layered_cache._namespace import Namespace

__all__ = ["bind_key_fields", "cached"]

T = TypeVar("T")
P = ParamSpec("P")

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
# A method's receiver, as its first parameter: not an argument the key could hold.
_RECEIVERS = ("self", "cls")


def bind_key_fields(
    namespace: Namespace,
    fn: Callable[..., Any],
    value_type: Any = None,
    ignore: Iterable[str] = (),
) -> inspect.Signature:
    """Checks shared by the async and sync decorators: every key field is a parameter
    of ``fn``, and ``fn`` has no other (see the module doc); ``value_type`` (or else
    ``fn``'s return annotation) is declared as the namespace's value type. Returns the
    signature to bind calls with."""
    template = namespace.policy.template
    signature = inspect.signature(fn)
    parameters = signature.parameters
    missing = [f for f in template.fields if f not in parameters or parameters[f].kind in _VARIADIC]
    if missing:
        raise KeyError(
            f"namespace {namespace.name!r}: {_name(fn)} has no parameter for key "
            f"field(s) {missing} of template {template.template!r}"
        )
    ignored = _ignored(namespace, fn, signature, ignore)
    _refuse_unkeyed_parameters(namespace, fn, signature, ignored)
    declared = value_type
    if declared is None:
        # A ``functools.partial`` keeps its function's return annotation there.
        annotated = fn.func if isinstance(fn, functools.partial) else fn
        declared = typing.get_type_hints(annotated).get("return")
    if declared is not None:
        namespace._declare_type(declared, by=_name(fn))
    return signature


def _ignored(
    namespace: Namespace,
    fn: Callable[..., Any],
    signature: inspect.Signature,
    ignore: Iterable[str],
) -> set[str]:
    """``ignore``: parameters the caller says do not change the value (a database
    session, a request). Each must be a named parameter of ``fn`` and not a key field:
    a typo would otherwise hide the very mistake the check is for."""
    if isinstance(ignore, str):
        raise TypeError(f"ignore must be a list of parameter names, not the string {ignore!r}")
    names = set(ignore)
    where = f"namespace {namespace.name!r}: {_name(fn)}"
    for name in sorted(names):
        parameter = signature.parameters.get(name)
        if parameter is None or parameter.kind in _VARIADIC:
            raise TypeError(f"{where}: ignore names {name!r}, which is not a named parameter")
        if name in namespace.policy.template.fields:
            raise TypeError(f"{where}: ignore names {name!r}, a field of the key")
    return names


def _refuse_unkeyed_parameters(
    namespace: Namespace,
    fn: Callable[..., Any],
    signature: inspect.Signature,
    ignored: set[str],
) -> None:
    """Every parameter of ``fn`` is a key field, a method's ``self``/``cls``, or
    named in ``ignore``."""
    template = namespace.policy.template
    keyed = set(template.fields) | ignored
    params = list(signature.parameters.values())
    first = params[0] if params else None
    if first and first.name in _RECEIVERS and first.kind not in _VARIADIC and _in_class_body(fn):
        params = params[1:]
    variadic = [_shown(p) for p in params if p.kind in _VARIADIC]
    named = [p.name for p in params if p.kind not in _VARIADIC and p.name not in keyed]
    where = f"namespace {namespace.name!r}: {_name(fn)}"
    why = (
        f"key template {template.template!r}, so calls that differ only in them "
        "would share one cache entry"
    )
    if named:
        widened = template.template + "".join(f":{{{name}}}" for name in named)
        raise TypeError(
            f"{where} has parameter(s) {named} that are not fields of the {why}; "
            f"add them to the template (namespaces.{namespace.name}.key, e.g. {widened!r}), "
            f"or, if they never change the value (a database session), say so: "
            f"cached({namespace.name!r}, ignore={tuple(named)!r})"
        )
    if variadic:
        raise TypeError(
            f"{where} takes {' and '.join(variadic)}, whose arguments are not part of the "
            f"{why}; give the function one named parameter per key field "
            f"({', '.join(template.fields)}) instead"
        )


def _in_class_body(fn: Callable[..., Any]) -> bool:
    """Whether ``fn`` was defined in a class body (``Books.detail``, also
    ``outer.<locals>.Books.detail``), not at module level or in a function
    (``outer.<locals>.detail``): decorated, a method is still a plain function, and its
    qualified name is the one thing that tells."""
    parts = str(getattr(fn, "__qualname__", "")).split(".")
    return len(parts) >= 2 and parts[-2] != "<locals>"


def _shown(parameter: inspect.Parameter) -> str:
    stars = "*" if parameter.kind is inspect.Parameter.VAR_POSITIONAL else "**"
    return stars + parameter.name


def cached(
    namespace: Namespace,
    fn: Callable[P, Awaitable[T]],
    value_type: Any = None,
    ignore: Iterable[str] = (),
) -> Callable[P, Awaitable[T]]:
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{_name(fn)} is not an async function: LayeredCache.cached caches "
            "`async def` functions (for a plain `def`, use SyncLayeredCache.cached)"
        )
    signature = bind_key_fields(namespace, fn, value_type, ignore)

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        return await namespace.get_or_load(bound.arguments, lambda: fn(*args, **kwargs))

    return wrapper


def _name(fn: Callable[..., Any]) -> str:
    """How errors name ``fn``: a ``functools.partial`` or a callable object has no
    ``__qualname__`` of its own."""
    return str(getattr(fn, "__qualname__", None) or repr(fn))
