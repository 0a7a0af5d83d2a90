"""Django's async cache API on ``layered_cache.django``: every ``a*`` method is the
backend's own sync method run by ``sync_to_async`` (thread-sensitive, as Django's own
``aget``/``aset`` are), so it keeps that method's promises.

Django's ``BaseCache`` builds several async methods out of others instead: ``aincr``
is ``aget`` then ``aset`` (an increment racing another is lost, and the ``aset`` resets
the remaining timeout to the default), ``aset_many`` is one ``aset`` per key (an
uncacheable value after the first key leaves the earlier ones written, and it returns
``[]`` whatever failed), ``aget_or_set`` is ``aget`` + ``aadd`` (every concurrent miss
calls ``default``). Those compositions bypass the backend's ``incr`` (atomic under the
key's lock), ``set_many`` (every value encoded before the first write) and
``get_or_set`` (one ``default`` call for the fleet). So each method is listed here,
also those Django already delegates (``aget``, ``aset``, ...): a Django release that
composes one of them too can't bypass the backend unseen.

``aclose`` stays Django's: ``close`` does nothing (the shared cache outlives requests).
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from asgiref.sync import sync_to_async

__all__ = ["AsyncMethods"]

AsyncMethod = Callable[..., Coroutine[Any, Any, Any]]


def _on_a_thread(name: str) -> AsyncMethod:
    """``a{name}``: the backend's ``name`` on Django's sync thread, awaited."""

    async def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        # thread_sensitive: the thread Django runs sync code of the request on, where
        # its database connections live (a get_or_set default may query the ORM).
        call = sync_to_async(getattr(self, name), thread_sensitive=True)
        return await call(*args, **kwargs)

    method.__name__ = method.__qualname__ = f"a{name}"
    method.__doc__ = f"``{name}`` from async code (``sync_to_async``), with its promises."
    return method


class AsyncMethods:
    """The async half of ``LayeredCacheBackend`` (a mixin, before ``BaseCache``)."""

    aget = _on_a_thread("get")
    aget_many = _on_a_thread("get_many")
    ahas_key = _on_a_thread("has_key")
    aset = _on_a_thread("set")
    aset_many = _on_a_thread("set_many")
    aadd = _on_a_thread("add")
    atouch = _on_a_thread("touch")
    aincr = _on_a_thread("incr")
    adecr = _on_a_thread("decr")
    adelete = _on_a_thread("delete")
    adelete_many = _on_a_thread("delete_many")
    aget_or_set = _on_a_thread("get_or_set")
    aincr_version = _on_a_thread("incr_version")
    adecr_version = _on_a_thread("decr_version")
    aclear = _on_a_thread("clear")
