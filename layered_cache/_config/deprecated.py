"""Old key names that files in the field still use: accepted with a warning.

``stampede.retry`` reads like a retry count but is the range of the pause before a lease
waiter re-reads L2; its clear name is ``stampede.reread_pause``. The old name is in the
design contract and in deployed files, so it keeps working: it is renamed in the raw
table before msgspec sees it (the schema knows only the new name), a ``ConfigWarning``
says what to write instead, and setting both is an error (which one would win?).
"""

from __future__ import annotations

from typing import Any

from layered_cache._config.errors import ConfigError

__all__ = ["DEPRECATION", "NEW_NAME", "OLD_NAME", "old_name_in_error", "rename_old_stampede_key"]

OLD_NAME = "retry"
NEW_NAME = "reread_pause"
DEPRECATION = (
    "stampede.retry is deprecated: it is the re-read pause range; use stampede.reread_pause"
)


def rename_old_stampede_key(table: Any, path: str, source: str) -> tuple[Any, str | None]:
    """``table`` (a namespace at ``path``) with ``stampede.retry`` renamed to
    ``stampede.reread_pause``, and the warning to issue (None if the old name is absent).
    Anything that isn't a table is returned as is: decoding reports it with its path."""
    if not isinstance(table, dict):
        return table, None
    stampede = table.get("stampede")
    if not isinstance(stampede, dict) or OLD_NAME not in stampede:
        return table, None
    if NEW_NAME in stampede:
        raise ConfigError(
            f"{source}: {path}.stampede.{OLD_NAME}: is the deprecated name of "
            f"stampede.{NEW_NAME}, which is also set; keep only {NEW_NAME}"
        )
    renamed = {(NEW_NAME if key == OLD_NAME else key): value for key, value in stampede.items()}
    return {**table, "stampede": renamed}, f"{source}: {path}: {DEPRECATION}"


def old_name_in_error(error: ConfigError, path: str) -> ConfigError:
    """An error about the renamed value, naming the key the file actually has."""
    new, old = f"{path}.stampede.{NEW_NAME}", f"{path}.stampede.{OLD_NAME}"
    return ConfigError(str(error).replace(new, old, 1))
