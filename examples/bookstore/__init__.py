"""The bookstore example: a small ASGI service that uses every part of layered_cache.

    python -m examples.bookstore            # serve on 127.0.0.1:8000 (SQLite, seeded)

See README.md next to this file.
"""

from examples.bookstore.app import BookstoreSettings, create_app
from examples.bookstore.db import Database, open_database
from examples.bookstore.models import BookDetail, CategoryPage, Stock

__all__ = [
    "BookDetail",
    "BookstoreSettings",
    "CategoryPage",
    "Database",
    "Stock",
    "create_app",
    "open_database",
]
