"""Single-value checks the schema's ``__post_init__`` methods share.

A check names its field with ``FIELD_MARK`` because msgspec reports a ``__post_init__``
error at the table, not at the field; the loader (``load.convert``) moves the marked
field into the dotted path (``namespaces.book.hot.window: must be > 0``).
"""

from __future__ import annotations

import ipaddress
import os
import re
import ssl
from typing import Annotated
from urllib.parse import SplitResult, parse_qsl, urlsplit

import msgspec

from layered_cache._config.units import Duration

__all__ = [
    "FIELD_MARK",
    "LOG_LEVELS",
    "AtLeastOne",
    "NonEmpty",
    "Port",
    "bad",
    "check_jitter",
    "check_threshold",
    "cluster_url_problem",
    "credentials_clash",
    "host_and_port",
    "host_problem",
    "is_number",
    "positive",
    "relay_url_problem",
    "sasl_credentials_problem",
    "sasl_mechanism_problem",
    "ssl_cafile_problem",
    "tls_files_problem",
    "url_problem",
]

FIELD_MARK = "@field "

AtLeastOne = Annotated[int, msgspec.Meta(ge=1)]
Port = Annotated[int, msgspec.Meta(ge=-1, le=65535)]
NonEmpty = Annotated[str, msgspec.Meta(min_length=1)]
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def bad(field: str, problem: str) -> ValueError:
    """The error a ``__post_init__`` raises for ``field`` (see the module doc)."""
    return ValueError(f"{FIELD_MARK}{field}: {problem}")


MIN_DURATION = 0.001  # Redis counts TTLs and timeouts in whole milliseconds


def positive(section: msgspec.Struct, *fields: str) -> None:
    """Durations (and rates) that the runtime divides by, sleeps for, or passes to Redis
    or Kafka as a timeout: zero would spin, block forever or be refused. A duration
    under a millisecond is refused too: a TTL Redis would round up to 1 ms, a timeout no
    round trip meets (``redis.timeout = 1e-9`` failed every command)."""
    for field in fields:
        value = getattr(section, field)
        if value is not None and value <= 0:
            raise bad(field, f"must be > 0, got {value:g}")
        if isinstance(value, Duration) and value < MIN_DURATION:
            raise bad(field, f"must be at least 1ms, got {value:g}s")


def check_threshold(threshold: float | None, window: float) -> None:
    """``hot.threshold`` against ``hot.window``: rates are counted in windows, so one
    read already measures ``1 / window`` reads/s. A threshold at or below that ("100/h",
    "30/m" with the default 1 s window) made every key hot on its first L2 read: 9
    copies in Redis of every key read, and the hot set full of cold keys."""
    if threshold is None or threshold * window > 1.0:
        return
    raise bad(
        "threshold",
        f"{_per(threshold)} is at most one read per hot.window ({window:g}s), so every key "
        f"read once would be hot: set it above {_per(1.0 / window)} (one read per window), "
        f"or hot.window above {1.0 / threshold:g}s",
    )


def _per(rate: float) -> str:
    """A rate as the file would likely write it: "2/s", "30/m", "100/h"."""
    if rate >= 1.0:
        return f"{rate:g}/s"
    per_minute = rate * 60.0
    if abs(per_minute - round(per_minute)) < 1e-9:
        return f"{per_minute:g}/m"
    return f"{rate * 3600.0:g}/h"


def check_jitter(jitter: float) -> None:
    """A jitter of 1 or more could make a TTL zero or negative."""
    if not 0.0 <= jitter < 1.0:
        raise bad("jitter", f"must be >= 0 and < 1, got {jitter}")


def url_problem(url: str) -> str | None:
    """What redis-py's ``from_url`` would refuse (its errors quote parts of the URL, so
    they are refused here, where the message is redacted)."""
    if not url.startswith(("redis://", "rediss://", "unix://")):
        return "must start with redis://, rediss:// or unix://"
    try:
        parsed = urlsplit(url)
        parsed.port  # noqa: B018 - the property raises for a port that is not 0..65535
    except ValueError:
        return (
            "the port must be a number within 0..65535, and an IPv6 host in brackets "
            "(a password containing '/' must be percent-encoded)"
        )
    if problem := (
        _query_problem(parsed.query)
        or _credentials_twice(parsed)
        or _tls_query_problem(parsed)
    ):
        return problem
    if parsed.scheme == "unix":
        return None if parsed.path else "a unix:// URL needs the socket path"
    if not parsed.hostname:
        return "the URL has no host"
    database = parsed.path.strip("/")
    if database and not is_number(database):
        return "the path must be a database number such as /0"
    if database and int(database) > _MAX_DATABASE:
        return f"a database number is at most {_MAX_DATABASE} (Redis's own limit)"
    if database and "db" in dict(parse_qsl(parsed.query)):
        # redis-py lets the query win: /3?db=1 reached database 1.
        return "the URL names its database twice (the path /N and ?db=): keep one"
    return None


def _credentials_twice(parsed: SplitResult) -> str | None:
    """A username or password both before the ``@`` and in the query: redis-py keeps one
    silently (which one changed between its versions), so the file can't say which."""
    query = dict(parse_qsl(parsed.query))
    for part, given in (("password", parsed.password), ("username", parsed.username)):
        if given and part in query:
            return f"the URL gives its {part} twice (before the @ and in its query): keep one"
    return None


def relay_url_problem(url: str) -> str | None:
    """What a backplane relay's URL (``backplane.relay``, ``relay --upstream``) must not
    hold beyond ``url_problem``'s: credentials or options. The relay has no password and
    speaks RESP2 only, and redis-py lets a URL's query win over the client's own
    settings: ``?protocol=3`` sent HELLO 3 and a password AUTH at every connect, both
    refused, and the listener never connected while the cache served on."""
    if not url.startswith("redis://"):
        # The relay listens on plain TCP, on the host or pod network (no TLS).
        return "must be a redis:// URL"
    if problem := url_problem(url):
        return problem
    parsed = urlsplit(url)
    if parsed.username or parsed.password:
        return "a relay has no credentials: the URL must not name a user or a password"
    if any(name != "db" for name, _ in parse_qsl(parsed.query, keep_blank_values=True)):
        return "a relay's URL takes no options (?protocol=, ?socket_timeout=, ...): only /N or ?db="
    return None


def host_and_port(address: str) -> tuple[str, str]:
    """``"host:port"`` split at its last colon, an IPv6 host's brackets dropped
    (``"[::1]:7000"``: they kept the brackets, a host no resolver knows)."""
    host, _, port = address.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    return host, port


def is_number(text: str) -> bool:
    """ASCII digits only: ``isdigit`` is also true of "３" and "³" (int() fails on the latter).
    For database numbers and ports alike."""
    return text.isascii() and text.isdigit()


_MAX_DATABASE = 2**31 - 1  # Redis counts its databases in a C int


# What a URL's query may set: redis-py's ``from_url`` turns every parameter into a
# connection keyword, and an unknown one (``?foo=bar``) or a bad value only failed at the
# first connection, with a traceback; the [redis] section holds the other settings.
_QUERY_VALUES: dict[str, tuple[str, ...] | None] = {  # None: any value
    "db": None,  # checked below: a number (how a unix:// URL picks its database)
    "username": None,
    "password": None,  # masked like a password in the URL's userinfo (``_redact``)
    "protocol": ("2", "3"),
    "ssl_cert_reqs": ("none", "optional", "required"),
    "ssl_check_hostname": ("true", "false"),
}


def _query_problem(query: str) -> str | None:
    pairs = parse_qsl(query, keep_blank_values=True)
    if len({name for name, _ in pairs}) < len(pairs):
        return "the URL's query sets a parameter twice: keep one"  # redis-py takes the last
    for name, value in pairs:
        if name not in _QUERY_VALUES:
            return (
                f"the URL's query may set only {', '.join(_QUERY_VALUES)}, not "
                f"{_named(name)}: set timeouts, TLS files and the rest in the config's own "
                "options"
            )
        allowed = _QUERY_VALUES[name]
        if allowed is not None and value not in allowed:
            return f"?{name}= must be one of {', '.join(allowed)}"
        if name == "db" and (not is_number(value) or int(value) > _MAX_DATABASE):
            return f"?db= must be a database number up to {_MAX_DATABASE}"
    return None


# Connection options redis-py reads from a URL's query (``URL_QUERY_ARGUMENT_PARSERS``)
# and a few more it passes on: named in the refusal. Any other name may be a piece of a
# password holding an unencoded '&' (``?password=77&78=``): never echoed.
_KNOWN_OPTIONS = frozenset({
    "client_name", "decode_responses", "encoding", "health_check_interval", "lib_name",
    "lib_version", "max_connections", "retry_on_error", "retry_on_timeout",
    "socket_connect_timeout", "socket_keepalive", "socket_read_size", "socket_timeout",
    "ssl_ca_certs", "ssl_certfile", "ssl_keyfile", "ssl_min_version", "timeout",
})


def _named(name: str) -> str:
    if name in _KNOWN_OPTIONS:
        return repr(name)
    return "another parameter (not shown: a password holding '&' or '=' must be percent-encoded)"


_TLS_QUERY = ("ssl_cert_reqs", "ssl_check_hostname")
_TLS_FILES = ("ssl_ca_certs", "ssl_certfile", "ssl_keyfile")


def _tls_query_problem(parsed: SplitResult) -> str | None:
    """A TLS option in the query of a plain URL: redis-py passes it on as a keyword that
    only a TLS connection takes, so ``config check`` passed and the cache's first
    connection raised a TypeError (and a TLS URL's query kept on a plain Redis is
    likelier a mistake than a wish)."""
    if parsed.scheme == "rediss":
        return None
    for name, _ in parse_qsl(parsed.query, keep_blank_values=True):
        if name in _TLS_QUERY:
            return (
                f"?{name}= is a TLS option, for a rediss:// URL only: use rediss:// to "
                f"connect over TLS, or drop it for a plain {parsed.scheme}:// connection"
            )
    return None


def tls_files_problem(section: msgspec.Struct) -> tuple[str, str] | None:
    """(field, problem) for a ``redis.ssl_*`` file set beside a ``redis.url`` that is
    not rediss://: the connection would be plaintext and the file silently ignored, so a
    deployment that meant TLS would send its password and values in clear."""
    url: str = getattr(section, "url")  # noqa: B009 - any section with a url
    if url.startswith("rediss://"):
        return None
    for field in _TLS_FILES:
        if getattr(section, field) is not None:
            return field, (
                f"is for a rediss:// (TLS) URL, but redis.url is {url.partition(':')[0]}://, "
                f"a plain connection that would ignore it: use rediss:// to connect over "
                f"TLS, or drop {field}"
            )
    return None


def cluster_url_problem(url: str) -> str | None:
    """What a cluster client refuses of a URL that a single node takes (redis-py's
    cluster client raised it at start, after ``config check`` had passed)."""
    parsed = urlsplit(url)
    if parsed.scheme == "unix":
        return "a cluster is reached over TCP: unix:// is for a single node"
    databases = [parsed.path.strip("/")] + [
        value for name, value in parse_qsl(parsed.query) if name == "db"
    ]
    if any(database not in ("", "0") for database in databases):
        return "a cluster has only database 0: drop the URL's /N or ?db=N"
    return None


def credentials_clash(url: str, username: str | None, password: str | None) -> str | None:
    """The URL names a user or password and so do ``redis.username``/``redis.password``
    (or their env variables): redis-py lets the URL's win, so a password rotated
    through the environment would be silently ignored. Set them in one place."""
    parsed = urlsplit(url)
    query = {name for name, _ in parse_qsl(parsed.query)}
    in_url = {
        "username": bool(parsed.username) or "username" in query,
        "password": parsed.password is not None or "password" in query,
    }
    given = {"username": username is not None, "password": password is not None}
    clash = [name for name in ("username", "password") if in_url[name] and given[name]]
    if not clash:
        return None
    return (
        f"the URL holds a {clash[0]} and so does redis.{clash[0]} (or "
        f"LAYERED_CACHE_REDIS_{clash[0].upper()}): the URL's would win; keep one"
    )


# Mechanisms that authenticate with kafka.sasl_username + sasl_password. (GSSAPI uses
# Kerberos; OAUTHBEARER a token provider given in code through consumer_options.)
_PASSWORD_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512")


def sasl_mechanism_problem(protocol: str, mechanism: str | None) -> str | None:
    """A SASL protocol without a mechanism: aiokafka silently picks PLAIN, which the
    broker may not offer and which needs credentials. The file says what it means."""
    if mechanism is None and protocol.startswith("SASL_"):
        return (
            f"security_protocol {protocol} needs one: set it to PLAIN, SCRAM-SHA-256, "
            "SCRAM-SHA-512, GSSAPI or OAUTHBEARER"
        )
    return None


def sasl_credentials_problem(
    mechanism: str | None, username: str | None, password: str | None
) -> tuple[str, str] | None:
    """(field, problem) for a mechanism aiokafka can't authenticate with (PLAIN: a
    ValueError at the daemon's start, exit 1 with a traceback; SCRAM: a failure at the
    broker, retried forever). Checked by ``config check`` and the daemon's start, after
    the LAYERED_CACHE_KAFKA_SASL_* overrides, so a missing Secret key behind
    LAYERED_CACHE_KAFKA_SASL_PASSWORD is caught - but not at every load: the services
    read the same file and should not need the daemon's Kafka password."""
    if mechanism in _PASSWORD_MECHANISMS:
        for field, value in (("sasl_username", username), ("sasl_password", password)):
            if not value:
                env = f"LAYERED_CACHE_KAFKA_{field.upper()}"
                return field, f"sasl_mechanism {mechanism} needs it: set it here or in {env}"
    return None


_HOST_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


def host_problem(host: str) -> str | None:
    """A bind address must be an IP literal or a host name (RFC 1123 labels); whether a
    name resolves is only known where the daemon runs (its start says so, exit 2). ""
    binds every interface, as asyncio does."""
    if not host:
        return None
    with_scope = host.split("%", 1)[0]  # an IPv6 zone: fe80::1%eth0
    try:
        ipaddress.ip_address(with_scope)
        return None
    except ValueError:
        pass
    labels = host.rstrip(".").split(".")
    if len(host) <= 253 and all(_HOST_LABEL.fullmatch(label) for label in labels):
        return None
    return f"must be an IP address or a host name, got {host!r}"


def ssl_cafile_problem(path: str | None) -> str | None:
    """A CA file aiokafka can't load (missing, unreadable, not PEM): the daemon refuses
    it at start, and ``config check`` says so. Not checked when every config loads: the
    services read the same file and need no Kafka CA on their hosts."""
    if path is None:
        return None
    if not os.path.isfile(path):
        return f"{path!r} is not a file (missing, or not mounted where the daemon runs)"
    try:
        ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError, ValueError) as exc:
        return f"{path!r} can't be loaded as a CA file: {exc}"
    return None
