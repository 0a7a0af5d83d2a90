"""``python -m examples.bookstore [--host H] [--port P]``: serve the bookstore with uvicorn."""

from __future__ import annotations

import argparse

import uvicorn

from examples.bookstore.app import create_app


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m examples.bookstore")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    args = parser.parse_args()
    uvicorn.run(create_app(), host=args.host, port=args.port, log_level="info")


if __name__ == "__main__":
    main()
