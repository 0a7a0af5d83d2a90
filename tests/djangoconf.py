"""Django settings for the tests that need Django, configured once per test process.

``DJANGO_TESTS_DIR`` (default ``.run/django-tests``, filled by ``make test-django`` /
``deploy/local/django-tests.sh``) holds Django's own ``tests/cache`` package; when it is
there it is importable as ``cache`` and installed as an app (its models are imported by
its tests)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import django
from django.conf import settings

ROOT = Path(__file__).parent.parent
SUITE_DIR = Path(os.environ.get("DJANGO_TESTS_DIR", ROOT / ".run" / "django-tests"))


def suite_available() -> bool:
    return (SUITE_DIR / "cache" / "tests.py").is_file()


def configure() -> None:
    """Idempotent: the first caller configures Django for the whole process."""
    if settings.configured:
        return
    apps = ["django.contrib.contenttypes"]
    if suite_available():
        sys.path.insert(0, str(SUITE_DIR))
        apps.append("cache")
    settings.configure(
        DEBUG=False,
        SECRET_KEY="layered-cache-tests",
        INSTALLED_APPS=apps,
        DATABASES={"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": ":memory:"}},
        CACHES={"default": {"BACKEND": "django.core.cache.backends.dummy.DummyCache"}},
        # As Django's own test settings (tests/runtests.py, tests/test_sqlite.py): its
        # cache tests expect them (USE_TZ off: no time zone in cache_page keys).
        USE_TZ=False,
        LANGUAGE_CODE="en",
        TEMPLATES=[
            {"BACKEND": "django.template.backends.django.DjangoTemplates", "APP_DIRS": True}
        ],
        ALLOWED_HOSTS=["*"],
        DEFAULT_AUTO_FIELD="django.db.models.AutoField",
    )
    django.setup()
