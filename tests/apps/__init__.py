"""Tiny applications the tests run under real servers (gunicorn)."""
