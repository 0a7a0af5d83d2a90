"""``cached``: the key template names every argument that can change the result.

A parameter the template does not name would let two different calls share one entry
(``book_detail(1, "fr")`` answered with ``book_detail(1, "en")``'s value), so it is
refused when the function is decorated, by both the async and the sync decorator.
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from layered_cache import LayeredCache
from layered_cache.sync import SyncLayeredCache
from tests.helpers import eventually, make_config

_UNUSED_REDIS = "redis://127.0.0.1:1/0"  # decoration needs no server: nothing connects


def _cache() -> LayeredCache:
    return LayeredCache.from_config(make_config(_UNUSED_REDIS, "decorate:"))


def test_a_cached_function_with_a_parameter_outside_the_key_is_refused_at_decoration() -> None:
    cache = _cache()
    with pytest.raises(TypeError) as error:

        @cache.cached("book")  # template book:{id}
        async def book_detail(id: int, lang: str) -> str:
            return f"book {id} in {lang}"

    message = str(error.value)
    assert "book_detail" in message and "'lang'" in message, message
    assert "'book:{id}'" in message and "'book:{id}:{lang}'" in message, message  # the fix


def test_a_parameter_with_a_default_outside_the_key_is_refused_too() -> None:
    cache = _cache()
    with pytest.raises(TypeError, match=r"book_detail.*\['currency', 'lang'\]"):

        @cache.cached("book")
        async def book_detail(id: int, currency: str = "EUR", *, lang: str = "en") -> str:
            return f"book {id} in {lang}, {currency}"


def test_star_args_and_star_star_kwargs_of_a_cached_function_are_refused() -> None:
    cache = _cache()
    with pytest.raises(TypeError, match=r"book_detail.*\*args"):

        @cache.cached("book")
        async def book_detail(id: int, *args: str) -> str:
            return "x"

    with pytest.raises(TypeError, match=r"book_list.*\*\*kwargs"):

        @cache.cached("book")
        async def book_list(id: int, **kwargs: str) -> str:
            return "x"


def test_a_cached_method_keys_on_its_fields_not_on_self_but_refuses_other_parameters() -> None:
    """``self``/``cls`` can't be part of a key shared by every process (L2), so they are
    not asked for; any other parameter outside the template still is."""
    cache = _cache()

    class Books:
        @cache.cached("book")
        async def detail(self, id: int) -> str:
            return f"book {id}"

    assert Books.detail.__name__ == "detail"
    with pytest.raises(TypeError, match=r"Shop\.detail.*'lang'"):

        class Shop:
            @cache.cached("book")
            async def detail(self, id: int, lang: str) -> str:
                return f"book {id} in {lang}"


def test_a_function_whose_first_parameter_is_named_cls_is_keyed_on_it_outside_a_class() -> None:
    """Only a method's receiver is exempt. ``cls`` was exempt by its name alone, so
    ``price("premium", 1)`` and ``price("budget", 1)`` shared one entry."""
    cache = _cache()
    with pytest.raises(TypeError, match=r"price.*\['cls'\]"):

        @cache.cached("book")
        async def price(cls: str, id: int) -> str:
            return f"{cls} price of {id}"

    namespaces = {"price": {"key": "price:{cls}:{id}"}}
    keyed = LayeredCache.from_config(make_config(_UNUSED_REDIS, "decorate:", namespaces))

    @keyed.cached("price")
    async def tier_price(cls: str, id: int) -> str:  # keyed on cls: accepted
        return f"{cls} price of {id}"


def test_the_sync_decorator_refuses_a_parameter_outside_the_key_too(
    redis_url: str, prefix: str
) -> None:
    refused = pytest.raises(TypeError, match=r"book_detail.*'lang'.*'book:\{id\}:\{lang\}'")
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as cache, refused:

        @cache.cached("book")
        def book_detail(id: int, lang: str = "en") -> str:
            return f"book {id} in {lang}"


def test_a_parameter_named_in_ignore_stays_out_of_the_key_on_purpose() -> None:
    """A database session never changes the value: ``ignore`` says so explicitly."""
    cache = _cache()

    @cache.cached("book", ignore=("session",))
    async def book_detail(id: int, session: object) -> str:
        return f"book {id}"

    assert book_detail.__name__ == "book_detail"


@pytest.mark.parametrize(
    ("ignore", "error"),
    [
        (("sesion",), "'sesion', which is not a named parameter"),  # a typo
        (("id",), "'id', a field of the key"),
        ("session", "not the string"),
    ],
)
def test_a_wrong_ignore_is_refused_at_decoration(ignore: object, error: str) -> None:
    cache = _cache()
    with pytest.raises(TypeError, match=error):

        @cache.cached("book", ignore=ignore)  # type: ignore[arg-type]
        async def book_detail(id: int, session: object) -> str:
            return f"book {id}"


async def test_a_partial_is_cached_by_the_parameters_it_leaves(redis_url: str, prefix: str) -> None:
    """A ``functools.partial`` (the session bound) has no ``__qualname__``: the decorator
    failed with AttributeError while naming it."""
    import functools

    calls = 0

    async def by_session(session: object, id: int) -> str:
        nonlocal calls
        calls += 1
        return f"v{id}"

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        book = cache.cached("book")(functools.partial(by_session, None))
        assert await book(id=1) == "v1" and await book(id=1) == "v1"
        assert calls == 1


async def test_a_static_method_whose_first_parameter_is_cls_is_refused_at_its_first_call(
    redis_url: str, prefix: str
) -> None:
    """``staticmethod`` wraps the function after the decorator ran, so a static
    ``of(cls, id)`` in a class body looked like a classmethod and left ``cls`` out of
    the key: ``of("premium", 1)`` and ``of("budget", 1)`` shared one entry. Its first
    call tells (a receiver has the method as an attribute) and is refused; methods,
    classmethods and private methods are served as before."""
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Prices:
            @staticmethod
            @cache.cached("book")
            async def of(cls: str, id: int) -> str:
                return f"{cls} price of {id}"

            @classmethod
            @cache.cached("book")
            async def titled(cls, id: int) -> str:
                return f"{cls.__name__} {id}"

            @cache.cached("book")
            async def __hidden(self, id: int) -> str:
                return f"hidden {id}"

            async def shown(self, id: int) -> str:
                return await self.__hidden(id)

        with pytest.raises(TypeError, match=r"'cls'.*'premium'.*static method"):
            await Prices.of("premium", 1)
        with pytest.raises(TypeError, match=r"'cls'.*'budget'"):
            await Prices.of("budget", 1)  # refused every time, never cached
        assert await Prices.titled(2) == "Prices 2"
        assert await Prices().shown(3) == "hidden 3"
        assert await Prices.titled(2) == "Prices 2"  # checked once, then served


def test_the_sync_decorator_refuses_a_static_method_keyed_without_its_cls_too(
    redis_url: str, prefix: str
) -> None:
    with SyncLayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Prices:
            @staticmethod
            @cache.cached("book")
            def of(cls: str, id: int) -> str:
                return f"{cls} price of {id}"

        with pytest.raises(TypeError, match=r"'cls'.*'premium'"):
            Prices.of("premium", 1)


async def test_a_static_method_named_like_a_method_of_its_first_argument_is_refused_too(
    redis_url: str, prefix: str
) -> None:
    """The check is ``inspect.getattr_static(args[0], fn.__name__)``: "a receiver has the
    method as an attribute". A static method whose name is also a method of its first
    argument's type (``find``, ``count``, ``index``, ``format`` on a ``str`` tier;
    ``get``, ``items``, ``copy`` on a dict) passes it: ``cls`` stays out of the key and
    the budget tier is served the premium tier's price."""

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Prices:
            @staticmethod
            @cache.cached("book")
            async def find(cls: str, id: int) -> str:
                return f"{cls} price of {id}"

        with pytest.raises(TypeError, match=r"'cls'.*'premium'"):
            await Prices.find("premium", 1)  # refused, as the static ``of`` is


async def test_a_cached_method_a_subclass_overrides_is_still_served_through_super(
    redis_url: str, prefix: str
) -> None:
    """The receiver check looks along the class's bases: a subclass that overrides a
    cached method and calls ``super()`` passes its own instance, whose class holds the
    override, not the cached function."""
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Books:
            @cache.cached("book")
            async def detail(self, id: int) -> str:
                return f"book {id}"

        class Shop(Books):
            async def detail(self, id: int) -> str:
                return (await super().detail(id)).upper()

        assert await Shop().detail(4) == "BOOK 4"
        assert await Books().detail(4) == "book 4"


async def test_a_cached_method_under_a_decorator_without_wraps_is_still_a_method(
    redis_url: str, prefix: str
) -> None:
    """Promise (README "a method's self/cls, defined in a class body, excepted"; module
    doc of _decorate): a method's receiver is exempt from the key. ``cached`` inside an
    ordinary decorator that does not use ``functools.wraps`` (a hand-written logging or
    auth decorator) is still a method defined in a class body, called with its own
    instance. Before 059952b, ``getattr_static(self, "detail")`` accepted it; now
    ``_receives`` wants ``inspect.unwrap(vars(Books)["detail"])`` to be the cached
    function, and the outer wrapper has no ``__wrapped__``: every call raises TypeError
    ("a static method's parameters are all arguments")."""

    def logged(fn: Any) -> Any:
        async def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            return await fn(self, *args, **kwargs)

        return inner

    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Books:
            @logged
            @cache.cached("book")
            async def detail(self, id: int) -> str:
                return f"book {id}"

        assert await Books().detail(1) == "book 1"


async def test_a_cached_method_of_a_metaclass_accepts_its_class_as_receiver(
    redis_url: str, prefix: str
) -> None:
    """Promise: a method's ``self``/``cls`` defined in a class body is excepted from the
    key. A method defined on a metaclass receives the class as ``cls``. ``_receives``
    takes a type as its own owner (``owner = first if isinstance(first, type)``) and
    searches only ``Books.__mro__``, never ``type(Books).__mro__`` where the method
    lives; the old ``getattr_static(Books, "detail")`` looked at the metaclass too."""
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        class Registry(type):
            @cache.cached("book")
            async def detail(cls, id: int) -> str:
                return f"{cls.__name__} {id}"

        class Books(metaclass=Registry):
            pass

        assert await Books.detail(2) == "Books 2"


def test_a_sync_cached_method_under_property_is_still_a_method(
    redis_url: str, prefix: str
) -> None:
    """Promise: a method's ``self`` is excepted from the key. A ``@property`` over a
    sync-cached getter (a per-site setting with a field-less key) is a method defined
    in a class body; ``_receives`` finds ``vars(Site)["settings"]``, a ``property``,
    which is not ``callable``, and refuses every access with TypeError. The old check
    (``getattr_static``) accepted it."""
    namespaces = {"settings": {"key": "settings"}}
    with SyncLayeredCache.from_config(make_config(redis_url, prefix, namespaces)) as cache:

        class Site:
            @property
            @cache.cached("settings")
            def settings(self) -> str:
                return "on"

        assert Site().settings == "on"


# -- fcf1bfc: abandoned loaders counted, then new loaders queue for the pool ---------


# -- annotations: only the return annotation is evaluated, at the first call if need be --


def _module(name: str, source: str, **names: object) -> types.ModuleType:
    """``source`` run as the module ``name`` (its own globals, as an imported file has),
    with ``names`` set in it first; left in ``sys.modules`` for the test's duration."""
    module = types.ModuleType(name)
    module.__dict__.update(names)
    sys.modules[name] = module
    exec(compile(source, f"<{name}>", "exec"), module.__dict__)
    return module


@pytest.fixture
def _drop_modules() -> Iterator[None]:
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        del sys.modules[name]


_TYPE_CHECKING_ONLY = '''
from __future__ import annotations
from typing import TYPE_CHECKING
if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncSession

@cache.cached("book", ignore=("session",))
async def book_detail(id: int, session: AsyncSession) -> dict[str, int]:
    return {"id": id}
'''


@pytest.mark.usefixtures("_drop_modules")
def test_a_parameter_annotation_imported_only_for_type_checking_does_not_break_decoration(
) -> None:
    """A session parameter whose type is imported under ``if TYPE_CHECKING:`` (the usual
    way with postponed annotations), left out of the key: the module imports, although
    the name does not exist at run time (the return annotation is all that is read)."""
    module = _module("decorate_typing_only", _TYPE_CHECKING_ONLY, cache=_cache())
    assert module.book_detail.__name__ == "book_detail"


_SELF_TYPED = '''
from __future__ import annotations
import msgspec

class Book(msgspec.Struct):
    id: int
    price: str

    @classmethod
    @cache.cached("book")
    async def load(cls, id: int) -> Book:
        return cls(id=id, price="9.90")
'''


@pytest.mark.usefixtures("_drop_modules")
async def test_a_cached_classmethod_returning_its_own_class_can_be_decorated(
    redis_url: str, prefix: str
) -> None:
    """An active-record loader, ``Book.load(id) -> Book``: the annotation names a class
    that does not exist yet while its body runs, so it is read at the first call, and
    an L2 hit (no L1 here) still comes back as a ``Book``, not a dict."""
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    async with LayeredCache.from_config(config) as cache:
        Book = _module("decorate_self_typed", _SELF_TYPED, cache=cache).Book
        loaded = await Book.load(1)
        hit = await Book.load(1)
        stats = cache.stats()["book"]
    assert loaded == hit == Book(id=1, price="9.90")
    assert isinstance(hit, Book) and stats["l2_hit"] == 1, (hit, stats)


_SYNC_SELF_TYPED = _SELF_TYPED.replace("async def", "def")


@pytest.mark.usefixtures("_drop_modules")
def test_a_sync_cached_classmethod_returning_its_own_class_decodes_an_l2_hit_into_it(
    redis_url: str, prefix: str
) -> None:
    config = make_config(redis_url, prefix, {"book": {"key": "book:{id}", "l1": False}})
    with SyncLayeredCache.from_config(config) as cache:
        Book = _module("decorate_sync_self_typed", _SYNC_SELF_TYPED, cache=cache).Book
        Book.load(1)
        hit = Book.load(1)
    assert isinstance(hit, Book) and hit == Book(id=1, price="9.90"), hit


async def test_a_return_annotation_that_never_resolves_is_a_type_error_naming_value_type(
) -> None:
    """Read at the first call, the annotation still names nothing: the error says which
    function and how to declare the type instead, at every call (nothing is cached
    under an undeclared type)."""
    cache = _cache()

    @cache.cached("book")
    async def book_detail(id: int) -> Unknown:  # type: ignore[name-defined]  # noqa: F821
        raise AssertionError("not called")

    for _ in range(2):
        with pytest.raises(TypeError, match=r"book_detail.*Unknown.*value_type="):
            await book_detail(1)


# -- what a result shares with L1 (README, "Results are shared") ----------------------


async def test_changing_the_loaders_object_or_the_one_given_to_set_never_changes_a_later_hit(
    redis_url: str, prefix: str
) -> None:
    """L1 keeps the value decoded back from the bytes written, not the loader's object
    nor ``set()``'s: their owners may change them afterwards. A result is L1's own
    object, though, the filling call's as every hit's: read-only (not copied per hit)."""
    catalog = {1: {"id": 1, "price": "9.90"}}  # an in-process store the loader hands out
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:

        @cache.cached("book")
        async def book_detail(id: int) -> dict[str, Any]:
            return catalog[id]

        first = await book_detail(1)
        catalog[1]["price"] = "0.00"  # the loader's object, changed by its owner
        given = {"id": 2, "price": "5.00"}
        await cache.set("book", {"id": 2}, given)
        given["price"] = "0.00"
        hits = [await book_detail(1), await book_detail(2)]
        stats = cache.stats()["book"]
    assert hits == [{"id": 1, "price": "9.90"}, {"id": 2, "price": "5.00"}]
    assert stats["l1_hit"] == 2 and stats["load"] == 1, stats
    assert hits[0] is first  # shared with L1: the README says to treat it as read-only


def test_two_threads_making_the_first_call_of_a_lazily_typed_function_both_succeed() -> None:
    """A sync app (threads) whose cached function's return annotation names a class
    defined after it: two requests make its first call at once. The check that a
    declaration is due and its call were two reads of one attribute, which the other
    thread set to None in between (forced here: this thread paused on the call's line),
    and the call raised ``TypeError: 'NoneType' object is not callable``."""
    from layered_cache import _decorate
    from layered_cache._decorate import bind_key_fields

    cache = LayeredCache.from_config(make_config("redis://127.0.0.1:1/0", "lazy:"))
    module = types.ModuleType("lazy_return_race")
    sys.modules["lazy_return_race"] = module
    source = "from __future__ import annotations\ndef load(id: int) -> Later:\n    return None\n"
    exec(source, module.__dict__)
    arguments = bind_key_fields(cache.namespace("book"), module.load)
    exec("class Later:\n    pass\n", module.__dict__)  # defined after decoration
    code = _decorate.KeyArguments._first_call.__code__
    lines = Path(code.co_filename).read_text().splitlines()
    call_line = next(  # the line that calls the declaration, in either version of it
        n for n, text in enumerate(lines, 1)
        if n > code.co_firstlineno
        and text.strip().startswith(("declare_later()", "self._declare_later()"))
    )
    at_call, first_done = threading.Event(), threading.Event()
    errors: list[BaseException] = []

    def pause_before_the_call(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is code and event == "line" and frame.f_lineno == call_line:
            at_call.set()
            first_done.wait(5)
        return pause_before_the_call if frame.f_code is code or event == "call" else None

    def second() -> None:
        sys.settrace(pause_before_the_call)
        try:
            arguments.of((1,), {})
        except BaseException as exc:
            errors.append(exc)
        finally:
            sys.settrace(None)

    thread = threading.Thread(target=second)
    thread.start()
    try:
        assert at_call.wait(5), "the second thread never reached the declaration"
        arguments.of((2,), {})  # the other thread's first call: declares, then None
    finally:
        first_done.set()
        thread.join(5)
        sys.modules.pop("lazy_return_race", None)
    assert not errors, f"a concurrent first call raised {errors[0]!r}"
    assert cache.namespace("book").policy.codec.value_type is module.Later


# -- early refresh and ignore= (README, "Early refresh") ------------------------------


class Session:
    """A request-scoped database session: usable only inside its ``with``; counts the
    queries made on it once closed (a finished request's session, used by a refresh)."""

    def __init__(self, db: dict[int, str]) -> None:
        self.db = db
        self.open = False
        self.used_closed = 0

    def __enter__(self) -> Session:
        self.open = True
        return self

    def __exit__(self, *exc: object) -> None:
        self.open = False

    def price(self, id: int) -> str:
        if not self.open:
            self.used_closed += 1
            raise RuntimeError("session is closed")
        return self.db[id]


def _refreshing_config(redis_url: str, prefix: str) -> Any:
    """L2 only, 5 s, XFetch on: with the draw near 1 (``_NEAR_1``), -ln(1 - rand) ~ 34,
    so a 0.2 s load is refreshed ~7 s before expiry: at the first L2 hit."""
    book = {"key": "book:{id}", "l1": False, "l2": {"ttl": "5s", "jitter": 0},
            "stampede": {"early_refresh_beta": 1.0}}  # fmt: skip
    return make_config(redis_url, prefix, {"book": book})


def _near_1() -> float:
    return 1.0 - 1e-15


async def test_a_cached_function_with_an_ignored_session_is_reloaded_at_expiry_not_early(
    redis_url: str, prefix: str
) -> None:
    """Request 2's L2 hit would start an XFetch refresh calling the function with request
    2's session, closed once request 2 returned: the refresh always failed (a load_error)
    and never refreshed. No early refresh then: the value is reloaded at expiry, by a
    request with a session of its own."""
    db = {1: "v1"}
    shift = [0.0]  # added to the cache's clock: past the soft expiry without waiting 5 s
    sessions: list[Session] = []
    clock = lambda: time.time() + shift[0]  # noqa: E731
    config = _refreshing_config(redis_url, prefix)
    async with LayeredCache.from_config(config, rand=_near_1, clock=clock) as cache:

        @cache.cached("book", ignore=["session"])
        async def price(session: Session, id: int) -> str:
            await asyncio.sleep(0.2)  # a slow query: delta 0.2 s for XFetch
            return session.price(id)

        async def request() -> str:
            with Session(db) as session:
                sessions.append(session)
                return await price(session, 1)

        assert await request() == "v1"  # a miss, loaded
        db[1] = "v2"
        assert await request() == "v1"  # an L2 hit inside the XFetch window
        await asyncio.sleep(0.5)  # a refresh started by it would have run its query
        stats = cache.stats()["book"]
        shift[0] = 6.0  # expired
        after_expiry = await request()
    assert [s.used_closed for s in sessions] == [0, 0, 0]
    assert stats["early_refresh"] == 0 and stats["load_error"] == 0, stats
    assert after_expiry == "v2"


async def test_a_cached_function_without_ignore_is_still_refreshed_early(
    redis_url: str, prefix: str
) -> None:
    db = {1: "v1"}
    async with LayeredCache.from_config(_refreshing_config(redis_url, prefix), rand=_near_1) as cache:

        @cache.cached("book")
        async def price(id: int) -> str:
            await asyncio.sleep(0.2)
            return db[id]

        assert await price(1) == "v1"
        db[1] = "v2"
        assert await price(1) == "v1"  # an L2 hit: starts the refresh, served the current

        async def refreshed() -> bool:
            return await cache.get("book", {"id": 1}) == "v2"

        assert await eventually(refreshed, 5)
        assert cache.stats()["book"]["early_refresh"] == 1


def test_a_sync_cached_function_with_an_ignored_session_is_not_refreshed_early(
    redis_url: str, prefix: str
) -> None:
    """The sync API wraps the loader for its thread pool (``SyncLayeredCache
    .get_or_load``): what tells the refresh the arguments are the request's survives it."""
    db = {1: "v1"}
    sessions: list[Session] = []
    config = _refreshing_config(redis_url, prefix)
    with SyncLayeredCache.from_config(config, rand=_near_1) as cache:

        @cache.cached("book", ignore=["session"])
        def price(session: Session, id: int) -> str:
            time.sleep(0.2)
            return session.price(id)

        def request() -> str:
            with Session(db) as session:
                sessions.append(session)
                return price(session, 1)

        assert request() == "v1"
        db[1] = "v2"
        assert request() == "v1"  # an L2 hit inside the XFetch window
        time.sleep(0.5)  # a refresh started by it would have run its query
        stats = cache.stats()["book"]
    assert [s.used_closed for s in sessions] == [0, 0]
    assert stats["early_refresh"] == 0 and stats["load_error"] == 0, stats


def test_a_sync_cached_function_without_ignore_is_still_refreshed_early(
    redis_url: str, prefix: str
) -> None:
    db = {1: "v1"}
    with SyncLayeredCache.from_config(_refreshing_config(redis_url, prefix), rand=_near_1) as cache:

        @cache.cached("book")
        def price(id: int) -> str:
            time.sleep(0.2)
            return db[id]

        assert price(1) == "v1"
        db[1] = "v2"
        assert price(1) == "v1"  # an L2 hit: starts the refresh, served the current
        deadline = time.monotonic() + 5
        while cache.get("book", {"id": 1}) != "v2" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert cache.get("book", {"id": 1}) == "v2"
        assert cache.stats()["book"]["early_refresh"] == 1


def _stale_after_load_timeout(redis_url: str, prefix: str) -> object:
    """L2 only, 200 ms TTL, stale values served for a minute past it when a load takes
    longer than load_timeout (100 ms); no XFetch at all (beta 0)."""
    return make_config(redis_url, prefix, {"book": {
        "key": "book:{id}", "l1": False, "l2": {"ttl": "200ms", "jitter": 0},
        "stale": {"max_age": "1m"},
        "stampede": {"load_timeout": "100ms", "early_refresh_beta": 0,
                     "lease_ttl": "5s", "max_wait": "3s"},
    }})  # fmt: skip


async def test_a_cached_function_with_an_ignored_session_reloads_at_expiry_with_a_live_session(
    redis_url: str, prefix: str
) -> None:
    """Found by a review of this session's fix (2026-12-06). README (decorator, `ignore=`):
    a cached function with an ignored session "is not
    refreshed early: a refresh runs in the background after the request that made the
    call returned, and would call the function with that request's session, closed by
    then or in use by the request again; its value is reloaded at expiry, by a request
    with a session of its own" (also README, XFetch guarantee; ``_refresh.RequestBound``).

    Scenario: the namespace serves stale after ``load_timeout`` (100 ms). At expiry a
    request reloads (its query takes 300 ms); after 100 ms it is served the stale value
    and returns, closing its session, while its load runs on in the background
    (``MissPath.load_and_fill``: ``_finish_fill``) and then queries that closed session.
    Promised: no call with a finished request's session; the value reloaded at expiry.
    Happens: every reload at expiry uses a closed session and fails (a load_error), so
    every request serves the stale value, for all of ``stale.max_age`` (1 minute)."""
    db = {1: "v1"}
    sessions: list[Session] = []
    async with LayeredCache.from_config(_stale_after_load_timeout(redis_url, prefix)) as cache:

        @cache.cached("book", ignore=["session"])
        async def price(session: Session, id: int) -> str:
            await asyncio.sleep(0.3)  # a slow query
            return session.price(id)

        async def request() -> str:
            with Session(db) as session:
                sessions.append(session)
                return await price(session, 1)

        assert await request() == "v1"  # a miss: loaded in full (no stale value yet)
        db[1] = "v2"
        await asyncio.sleep(0.3)  # expired (soft), within stale.max_age
        served = [await request()]  # the reload at expiry: stale after 100 ms
        await asyncio.sleep(0.5)  # its load ran on, past the request
        served.append(await request())
        await asyncio.sleep(0.5)
        served.append(await request())
        stats = cache.stats()["book"]
    assert [s.used_closed for s in sessions] == [0] * len(sessions), (
        f"a reload at expiry called the function with a finished request's (closed) "
        f"session: {[s.used_closed for s in sessions]}; served {served}; stats {stats}"
    )
    assert served[-1] == "v2", f"the value was never reloaded: served {served}"


def _long_lease_config(redis_url: str, prefix: str) -> Any:
    return make_config(redis_url, prefix, {"book": {
        "key": "book:{id}", "l1": False,
        "stampede": {"lease_ttl": "30s", "max_wait": "20s", "early_refresh_beta": 0},
    }})  # fmt: skip


def test_a_sync_cached_call_that_timed_out_keeps_its_lease_while_its_loader_thread_runs(
    redis_url: str, prefix: str
) -> None:
    """README (stampede): one load per key (per expiry) fleet-wide, under the lease;
    ``_sync_loaders`` doc: "A caller that gives up (SyncTimeoutError ...) leaves its load
    running (it fills for the others)". Found by a review of this session's fix
    (2026-12-06), which had a cancelled ignore= call's load end with it.

    Scenario: a sync ``@cached(ignore=["session"])`` function whose query is slow; the
    call times out (SyncTimeoutError, timeout=0.5 s). Its loader is a thread: it can't be
    stopped and runs on (with the request's session). Since 37bd0dd the lease is given
    back at once (the asyncio task was cancelled), so a second caller (another instance
    of the cache, as another worker) takes the lease and runs the same slow query again
    while the first still runs: two loads of one key at once fleet-wide.
    Promised: while a load of the key is running, others wait on its lease."""
    first_running, release_first = threading.Event(), threading.Event()
    calls: list[str] = []
    second_loaded = threading.Event()
    try:
        with SyncLayeredCache.from_config(_long_lease_config(redis_url, prefix), timeout=0.5) as a, \
                SyncLayeredCache.from_config(_long_lease_config(redis_url, prefix), timeout=30) as b:

            @a.cached("book", ignore=["session"])
            def price_a(session: str, id: int) -> str:
                calls.append(session)
                first_running.set()
                release_first.wait(20)  # a hung query: the thread runs on
                return "v1"

            @b.cached("book", ignore=["session"])
            def price_b(session: str, id: int) -> str:
                calls.append(session)
                second_loaded.set()
                return "v1"

            from layered_cache._loopthread import SyncTimeoutError

            with pytest.raises(SyncTimeoutError):
                price_a("s1", 1)
            assert first_running.is_set()
            result: list[str] = []
            waiter = threading.Thread(target=lambda: result.append(price_b("s2", 1)))
            waiter.start()
            # The first load still runs: the second caller must wait on its lease.
            second_ran = second_loaded.wait(3.0)
            release_first.set()
            waiter.join(30)
    finally:
        release_first.set()
    assert not second_ran, (
        f"a second load of the key ran while the first (timed out, its thread still "
        f"querying) was running: loader calls {calls}"
    )



async def test_a_cancelled_ignore_call_whose_query_runs_in_a_thread_keeps_its_lease_until_it_ends(
    redis_url: str, prefix: str
) -> None:
    """As above, async: a ``@cached(ignore=["session"])`` function running a sync
    driver's query in a thread (``asyncio.to_thread``, the usual way). The request is
    cancelled (its client went away); the query's thread can't be cancelled and runs on.
    Since 37bd0dd the lease is given back as soon as the task is cancelled, so the next
    request of the key (here another instance, as another worker would) runs the same
    slow query again at once, while the first still runs. Before, the first load ran
    on and filled L2 for the others (one load per key fleet-wide)."""
    first_running, release_first = __import__("threading").Event(), __import__("threading").Event()
    calls: list[str] = []
    config = _long_lease_config(redis_url, prefix)
    try:
        async with LayeredCache.from_config(config) as a, LayeredCache.from_config(config) as b:

            def query(session: str) -> str:
                calls.append(session)
                if session == "s1":
                    first_running.set()
                    release_first.wait(20)  # a hung query
                return "v1"

            @a.cached("book", ignore=["session"])
            async def price_a(session: str, id: int) -> str:
                return await asyncio.to_thread(query, session)

            @b.cached("book", ignore=["session"])
            async def price_b(session: str, id: int) -> str:
                return await asyncio.to_thread(query, session)

            call = asyncio.ensure_future(price_a("s1", 1))
            await asyncio.to_thread(first_running.wait, 10)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            second = asyncio.ensure_future(price_b("s2", 1))
            await asyncio.sleep(3.0)  # the first query still runs
            second_ran = "s2" in calls
            release_first.set()
            await asyncio.wait_for(second, 25)
    finally:
        release_first.set()
    assert not second_ran, (
        f"a second load of the key ran while the first (its caller cancelled, its "
        f"query's thread still running) held no lease: loader calls {calls}"
    )
