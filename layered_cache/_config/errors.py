"""What a config load reports: an error (unusable) or a warning (usable, probably wrong).

Their own module so that every step of loading (units, schema, env, cross-checks) can
raise them without importing one another.
"""

from __future__ import annotations

from layered_cache._redact import redact

__all__ = ["ConfigError", "ConfigWarning"]


class ConfigWarning(UserWarning):
    """Accepted but probably wrong; also listed in ``Config.warnings``."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message names file, path and problem.

    The message is redacted when the error is made (``redact``), so however it is
    printed later (CLI, daemon, a log line, a traceback) it carries no secret.
    """

    def __init__(self, message: str) -> None:
        super().__init__(redact(message))
