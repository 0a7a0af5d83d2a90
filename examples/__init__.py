"""Runnable examples: ``examples.bookstore`` (an ASGI service) and ``examples.demo`` (make demo)."""
