"""The command line of ``layered-cache``: every command, flag and help text in one place.

Each subparser sets ``handler`` (called with the parsed arguments and stdout) to its
command group's ``cmd_*`` function. A ``config`` attribute, when a command has one, is
the config file ``main`` loads first to set logging up; ``daemon`` names its file
``daemon_config`` because the daemon sets its own logging up.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, TextIO

from layered_cache.cli.config_check import cmd_config_check
from layered_cache.cli.daemon import cmd_daemon
from layered_cache.cli.doctor import cmd_doctor
from layered_cache.cli.hotkeys import cmd_hotkeys
from layered_cache.cli.inspect_key import cmd_inspect
from layered_cache.cli.invalidate import cmd_invalidate
from layered_cache.cli.relay import cmd_relay
from layered_cache.cli.warm import cmd_warm

__all__ = ["Handler", "build_parser"]

Handler = Callable[[argparse.Namespace, TextIO], int]
if TYPE_CHECKING:  # argparse's class is generic only to type checkers
    _Commands = argparse._SubParsersAction[argparse.ArgumentParser]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layered-cache", description="Inspect and operate a layered_cache deployment."
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_config(commands)
    _add_keyed(commands)
    _add_hotkeys(commands)
    _add_doctor(commands)
    _add_warm(commands)
    _add_daemon(commands)
    _add_relay(commands)
    return parser


def _add_config(commands: _Commands) -> None:
    config = commands.add_parser("config", help="configuration tools")
    config_commands = config.add_subparsers(dest="config_command", required=True, metavar="ACTION")
    check = config_commands.add_parser(
        "check", help="validate a config file and print the effective policies"
    )
    check.add_argument("file", metavar="FILE")
    check.add_argument("--json", action="store_true", help="print the effective config as JSON")
    check.set_defaults(handler=cmd_config_check, needs_config=False)


def _keyed(
    commands: _Commands, name: str, help_text: str, handler: Handler
) -> argparse.ArgumentParser:
    """A command on one key: ``NAMESPACE [field=value ...] --config FILE``. No field is
    how a template without placeholders (``key = "settings"``) names its one key; a
    field a template has and the command lacks is ``parse_fields``' error, naming it."""
    sub = commands.add_parser(name, help=help_text)
    sub.add_argument("namespace", metavar="NAMESPACE")
    sub.add_argument("fields", nargs="*", metavar="field=value")
    sub.add_argument("--config", required=True, metavar="FILE")
    sub.set_defaults(handler=handler)
    return sub


def _add_keyed(commands: _Commands) -> None:
    inspect = _keyed(
        commands, "inspect", "show a key in Redis: TTLs, replicas, lease, envelope", cmd_inspect
    )
    inspect.add_argument("--json", action="store_true")
    _keyed(
        commands,
        "invalidate",
        "delete a key, its replicas and lease; drop L1 everywhere",
        cmd_invalidate,
    )


def _add_hotkeys(commands: _Commands) -> None:
    hotkeys = commands.add_parser("hotkeys", help="static hot keys and their replicas in Redis")
    hotkeys.add_argument("--config", required=True, metavar="FILE")
    hotkeys.add_argument("--json", action="store_true")
    hotkeys.set_defaults(handler=cmd_hotkeys)


def _add_doctor(commands: _Commands) -> None:
    doctor = commands.add_parser(
        "doctor", help="each Redis master's maxmemory-policy and what a full Redis does"
    )
    doctor.add_argument("--config", required=True, metavar="FILE")
    doctor.add_argument("--json", action="store_true")
    doctor.set_defaults(handler=cmd_doctor)


def _add_warm(commands: _Commands) -> None:
    warm = commands.add_parser("warm", help="bulk fill a namespace from a JSONL file")
    warm.add_argument("namespace", metavar="NAMESPACE")
    warm.add_argument("--from", dest="source", required=True, metavar="FILE",
                      help='JSONL: one {"key": {...fields}, "value": ...} per line; '
                           '"-" reads standard input')  # fmt: skip
    warm.add_argument("--config", required=True, metavar="FILE")
    warm.add_argument("--concurrency", type=int, default=32, help="parallel writes (32)")
    warm.add_argument("--start-line", type=int, default=1, metavar="K",
                      help="skip the lines before K (resume where a stopped run said)")  # fmt: skip
    warm.set_defaults(handler=cmd_warm)


def _add_daemon(commands: _Commands) -> None:
    daemon = commands.add_parser(
        "daemon", help="run the Kafka invalidation daemon (see docs/daemon.md)"
    )
    daemon.add_argument("--config", dest="daemon_config", required=True, metavar="FILE")
    daemon.add_argument("--log-format", choices=["json", "console"], default=None,
                        help="override logging.format (and LAYERED_CACHE_LOG_FORMAT)")  # fmt: skip
    daemon.add_argument("--health-port", type=_health_port, default=None,
                        help="override kafka.health_port (0 = ephemeral, -1 = off)")  # fmt: skip
    daemon.set_defaults(handler=cmd_daemon)


def _health_port(text: str) -> int:
    """-1 (off), 0 (ephemeral) or a TCP port: a port past 65535 failed at bind time
    with a traceback."""
    try:
        port = int(text)
    except ValueError:
        port = -2
    if not -1 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"must be -1 (off), 0 (ephemeral) or a port up to 65535, got {text!r}"
        )
    return port


def _add_relay(commands: _Commands) -> None:
    relay = commands.add_parser(
        "relay", help="run a backplane relay for the instances of a host (docs/operations.md)"
    )
    relay.add_argument("--config", required=True, metavar="FILE")
    relay.add_argument("--listen", default="127.0.0.1:6390", metavar="HOST:PORT",
                       help="where instances connect (port 0: any free one)")  # fmt: skip
    relay.add_argument("--upstream", default=None, metavar="URL",
                       help="follow another relay (redis://HOST:PORT), not Redis")  # fmt: skip
    relay.add_argument("--keep", type=int, default=10_000, metavar="N",
                       help="entries held in memory; older positions read Redis")  # fmt: skip
    relay.add_argument("--status-every", type=float, default=60.0, metavar="SECONDS",
                       help="log the relay's counters this often (60)")  # fmt: skip
    relay.set_defaults(handler=cmd_relay)
