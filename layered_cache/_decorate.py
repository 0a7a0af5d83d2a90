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
changes the value). A ``staticmethod`` is wrapped after the decorator ran, so in a class
body only its first call tells it from a method: a first argument that is no receiver
(``Prices.of("premium", 1)`` of a static ``of(cls, id)``) is refused then
(``KeyArguments``).

A function with ``ignore=`` is not refreshed early (XFetch): the refresh would run in
the background after the request that made the call returned, with that request's
session, closed by then or in use again (``_loader_call.RequestBound``); its value is
reloaded at expiry instead, by a reader with a session of its own.

Of the annotations, only the return annotation is read (the value type); the parameters'
are not evaluated at all: with postponed annotations (``from __future__ import
annotations``) a session's type imported under ``if TYPE_CHECKING:`` names nothing at run
time, and the key needs no type. A return annotation that names what does not exist yet
(a classmethod's ``-> Book`` in ``Book``'s own body) is read at the first call instead,
once; still unresolved then, every call is a TypeError that says to pass ``value_type=``.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, ParamSpec, TypeVar

from layered_cache._loader_call import RequestBound
from layered_cache._namespace import Namespace, check_tags
from layered_cache._tags import TagsOf

__all__ = ["KeyArguments", "bind_key_fields", "cached"]

T = TypeVar("T")
P = ParamSpec("P")

_VARIADIC = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
# A method's receiver, as its first parameter: not an argument the key could hold.
_RECEIVERS = ("self", "cls")


class KeyArguments:
    """A call of a ``cached`` function as its arguments by name (the key fields among
    them). A first parameter exempt as a method's receiver is checked at the first
    call: a static method's ``cls`` is an argument like any other (a price tier), and
    two calls that differ only in it would share one entry."""

    def __init__(
        self,
        signature: inspect.Signature,
        fn: Callable[..., Any],
        receiver: bool,
        fields: tuple[str, ...],
        declare_later: Callable[[], None] | None = None,
        *,
        request_bound: bool = False,
    ):
        # Arguments in ``ignore=``: its calls' loaders are ``RequestBound``.
        self.request_bound = request_bound
        self._signature = signature
        self._fn = fn
        self._receiver = receiver
        self._declare_later = declare_later
        # One test per call until the first call's checks passed; none after.
        self._unchecked = receiver or declare_later is not None
        self._fields = fields

    def of(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The key fields of this call, and only them: the receiver and the ``ignore``d
        arguments are no key fields (a template refuses a field it doesn't name)."""
        if self._unchecked:
            self._first_call(args)
        bound = self._signature.bind(*args, **kwargs)
        bound.apply_defaults()
        arguments = bound.arguments
        return {name: arguments[name] for name in self._fields}

    def _first_call(self, args: tuple[Any, ...]) -> None:
        """What decoration could not settle: the receiver, and a return annotation that
        named nothing yet. Either raising, the next call checks again."""
        if self._receiver:
            self._check_receiver(args)
            self._receiver = False
        # Read once: the first calls of a sync function come from several threads at
        # once, and one that found it set then saw another's None (a TypeError).
        declare_later = self._declare_later
        if declare_later is not None:
            declare_later()  # twice at worst, the same type: the second a no-op
            self._declare_later = None
        self._unchecked = False

    def _check_receiver(self, args: tuple[Any, ...]) -> None:
        """A method's receiver (an instance, or a class for a classmethod) has this very
        method on its class; a static method's first argument has not (a ``str`` has a
        ``find`` too: only this function, under its decorators, counts)."""
        fn, first = self._fn, next(iter(self._signature.parameters))
        if not (args and _receives(args[0], fn)):
            shown = repr(args[0])[:60] if args else "nothing (a keyword?)"
            raise TypeError(
                f"{_name(fn)}: its first parameter {first!r} was left out of the key as a "
                f"method's receiver, but this call passed {shown} for it: a static method's "
                "parameters are all arguments; rename it (then it is a key field or goes in "
                "ignore=)"
            ) from None


def _receives(first: object, fn: Callable[..., Any]) -> bool:
    """Whether ``first`` is an instance of the class whose body defined ``fn`` (or of a
    subclass: ``super().method()``), or that class itself, or a class whose metaclass it
    is, with ``fn``'s name there not a ``staticmethod``. The class is known by its
    qualified name, not by what its attribute holds: decorators above ``cached`` (with
    or without ``functools.wraps``, a ``property``) change that."""
    defined_in = str(getattr(fn, "__qualname__", "")).rpartition(".")[0]
    name = _attribute(fn)
    classes = type(first).__mro__
    if isinstance(first, type):
        classes = first.__mro__ + classes
    for klass in classes:
        if klass.__qualname__ == defined_in and name in vars(klass):
            return not isinstance(vars(klass)[name], staticmethod)
    return False


def _attribute(fn: Callable[..., Any]) -> str:
    """The name ``fn`` has on its class (``__x`` is stored as ``_Cls__x``)."""
    name = str(getattr(fn, "__name__", ""))
    owner = str(getattr(fn, "__qualname__", "")).split(".")[-2].lstrip("_")
    if name.startswith("__") and not name.endswith("__") and owner:
        return f"_{owner}{name}"
    return name


# Declares a value type for a namespace: (type, who declares it, for the error).
Declare = Callable[[Any, str], None]


def bind_key_fields(
    namespace: Namespace,
    fn: Callable[..., Any],
    value_type: Any = None,
    ignore: Iterable[str] = (),
    declare: Declare | None = None,
) -> KeyArguments:
    """Checks shared by the async and sync decorators: every key field is a parameter
    of ``fn``, and ``fn`` has no other (see the module doc); ``value_type`` (or else
    ``fn``'s return annotation) is declared as the namespace's value type, through
    ``declare`` (by default on ``namespace``). Returns what binds its calls."""
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
    receiver = _refuse_unkeyed_parameters(namespace, fn, signature, ignored)
    bound = bool(ignored)
    if declare is None:
        declare = functools.partial(_declare_on, namespace)
    if value_type is not None:
        declare(value_type, _name(fn))
        return KeyArguments(signature, fn, receiver, template.fields, request_bound=bound)
    try:
        _declare_returned(namespace, fn, declare, later=False)
    except NameError:  # a name defined after fn (its own class): at the first call
        later = functools.partial(_declare_returned, namespace, fn, declare, later=True)
        return KeyArguments(signature, fn, receiver, template.fields, later, request_bound=bound)
    return KeyArguments(signature, fn, receiver, template.fields, request_bound=bound)


def _declare_on(namespace: Namespace, value_type: Any, by: str) -> None:
    namespace._declare_type(value_type, by=by)


def _declare_returned(
    namespace: Namespace, fn: Callable[..., Any], declare: Declare, *, later: bool
) -> None:
    """Declares ``fn``'s return annotation, if it has one. At the first call (``later``),
    a name it still can't find is the caller's to fix: the TypeError says how."""
    try:
        declared = _return_annotation(fn)
    except NameError as error:
        if not later:
            raise
        raise TypeError(
            f"namespace {namespace.name!r}: {_name(fn)}'s return annotation can't be "
            f"resolved at its first call either ({error}: imported only under "
            "TYPE_CHECKING, or local to a function?), so the value type is unknown; "
            f"declare it: cached({namespace.name!r}, value_type=...)"
        ) from None
    if declared is not None:
        declare(declared, _name(fn))


def _return_annotation(fn: Callable[..., Any]) -> Any:
    """``fn``'s return annotation evaluated, as ``typing.get_type_hints`` would (strings
    and forward references in it, in ``fn``'s module), without evaluating the
    parameters' annotations (see the module doc). None without one."""
    # A ``functools.partial`` keeps its function's annotations there.
    annotated = fn.func if isinstance(fn, functools.partial) else fn
    annotations = getattr(annotated, "__annotations__", None) or {}
    if "return" not in annotations:
        return None
    unwrapped = inspect.unwrap(annotated)  # where get_type_hints finds the globals
    only_return = _Annotated({"return": annotations["return"]}, annotated)
    globalns = getattr(unwrapped, "__globals__", {})
    return typing.get_type_hints(only_return, globalns).get("return")


class _Annotated:
    """Something ``typing.get_type_hints`` reads annotations from: these ones, with the
    type parameters of ``fn`` (``def f[T](...) -> list[T]``) they may name."""

    def __init__(self, annotations: dict[str, Any], fn: Callable[..., Any]):
        self.__annotations__ = annotations
        self.__type_params__ = getattr(fn, "__type_params__", ())


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
) -> bool:
    """Every parameter of ``fn`` is a key field, a method's ``self``/``cls``, or
    named in ``ignore``. Returns whether the first one was exempt as a receiver."""
    template = namespace.policy.template
    keyed = set(template.fields) | ignored
    params = list(signature.parameters.values())
    first = params[0] if params else None
    receiver = bool(
        first and first.name in _RECEIVERS and first.kind not in _VARIADIC and _in_class_body(fn)
    )
    if receiver:
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
    return receiver


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
    tags: TagsOf | None = None,
) -> Callable[P, Awaitable[T]]:
    """``fn`` cached in ``namespace``; ``tags``, as ``get_or_load``'s, checked now: every
    writer of a tagged entry must give its tags (docs/tags.md), a decorated function too.
    With ``ignore=``, not refreshed early (the module doc)."""
    check_tags(namespace.policy, tags)
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(
            f"{_name(fn)} is not an async function: LayeredCache.cached caches "
            "`async def` functions (for a plain `def`, use SyncLayeredCache.cached)"
        )
    arguments = bind_key_fields(namespace, fn, value_type, ignore)
    bound = arguments.request_bound

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        fields = arguments.of(args, kwargs)
        if bound:  # its ignored arguments are the request's: no early refresh with them
            return await namespace.get_or_load(fields, RequestBound(fn, args, kwargs), tags)
        return await namespace.get_or_load(fields, lambda: fn(*args, **kwargs), tags)

    return wrapper


def cached_sync(
    namespace: Namespace,
    fn: Callable[P, T],
    value_type: Any,
    ignore: Iterable[str],
    tags: TagsOf | None,
    get_or_load: Callable[[str, Mapping[str, object], Callable[[], T], TagsOf | None], T],
    declare: Declare,
) -> Callable[P, T]:
    """``cached`` for a plain function, through the sync API's ``get_or_load``; the
    value type through ``declare`` (on whichever inner cache runs then)."""
    check_tags(namespace.policy, tags)
    if inspect.iscoroutinefunction(fn):
        raise TypeError(f"{_name(fn)} is async: use LayeredCache.cached, not the sync API")
    arguments = bind_key_fields(namespace, fn, value_type, ignore, declare)
    bound = arguments.request_bound

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        fields = arguments.of(args, kwargs)
        if bound:  # as in ``cached``; ``SyncLayeredCache.get_or_load`` keeps the mark
            return get_or_load(namespace.name, fields, RequestBound(fn, args, kwargs), tags)
        return get_or_load(namespace.name, fields, lambda: fn(*args, **kwargs), tags)

    return wrapper


def _name(fn: Callable[..., Any]) -> str:
    """How errors name ``fn``: a ``functools.partial`` or a callable object has no
    ``__qualname__`` of its own."""
    return str(getattr(fn, "__qualname__", None) or repr(fn))
