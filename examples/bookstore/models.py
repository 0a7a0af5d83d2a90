"""Values the bookstore caches. msgspec Structs: the L2 codec encodes them as msgpack and,
with the namespace's value type registered, decodes L2 hits straight back into them."""

from __future__ import annotations

import msgspec


class BookDetail(msgspec.Struct, frozen=True, kw_only=True):
    """The book page: one row of an expensive join (book, author, price, reviews)."""

    id: int
    title: str
    isbn: str
    year: int
    author_id: int
    author: str
    price: str  # a decimal string: money is never a float
    currency: str
    review_count: int
    rating: float | None  # average stars, None without reviews


class CategoryBook(msgspec.Struct, frozen=True, kw_only=True):
    """One book as a category page lists it (its price included: the page dies with it)."""

    id: int
    title: str
    author: str
    price: str
    currency: str


class CategoryPage(msgspec.Struct, frozen=True, kw_only=True):
    """``GET /categories/{slug}``: the category and the first books in it, by title.

    Cached in namespace ``category`` (``tags = true``) tagged ``book:{id}`` for every
    book it shows, so a price change of any of them kills the page."""

    slug: str
    name: str
    book_count: int  # books in the category; ``books`` holds the first page of them
    books: list[CategoryBook]


class Stock(msgspec.Struct, frozen=True, kw_only=True):
    """Units on hand: changes every sale, so it is never cached (``cache = false``)."""

    book_id: int
    on_hand: int
    warehouse: str


class PriceUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``PUT /books/{id}/price``: ``{"price": "9.90"}``."""

    price: str


class StockUpdate(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Body of ``PUT /books/{id}/stock``: ``{"on_hand": 12}``."""

    on_hand: int
