"""The shape of the TOML file: a tree of frozen msgspec Structs, one per table.

Each struct's ``__post_init__`` checks what a single table can check on its own (bounds,
URL syntax, ordering of two of its values); checks spanning tables (templates against
event routes, namespaces against each other) are in ``validate``.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal

import msgspec

from layered_cache._config.checks import (
    LOG_LEVELS,
    AtLeastOne,
    NonEmpty,
    Port,
    bad,
    check_jitter,
    check_threshold,
    cluster_url_problem,
    credentials_clash,
    host_and_port,
    host_problem,
    is_number,
    positive,
    relay_url_problem,
    sasl_mechanism_problem,
    tls_files_problem,
    url_problem,
)
from layered_cache._config.names import purge_url_problem, stream_problem
from layered_cache._config.units import Duration, Rate
from layered_cache._keys import (
    validate_prefix,
)
from layered_cache._redact import redact, redact_url

__all__ = [
    "BackplaneConfig",
    "BreakerConfig",
    "Config",
    "EventRoute",
    "HotConfig",
    "HttpConfig",
    "InvalidateTarget",
    "KafkaConfig",
    "L1Config",
    "L2Config",
    "LoggingConfig",
    "MetricsConfig",
    "NamespaceConfig",
    "PurgeConfig",
    "RedisConfig",
    "StaleConfig",
    "StampedeConfig",
]


class _Section(msgspec.Struct, frozen=True, forbid_unknown_fields=True, kw_only=True):
    """Base of every config table: immutable, unknown keys are errors (typos fail loudly)."""


class BreakerConfig(_Section, frozen=True):
    """Circuit breaker around Redis: open after `failures` errors in a row, retry after `reset`."""

    failures: AtLeastOne = 3
    reset: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        positive(self, "reset")


# A spin longer than this costs more CPU than the sleep it saves (``_busypoll``).
_MAX_BUSY_POLL = 0.001


class RedisConfig(_Section, frozen=True):
    url: str = "redis://127.0.0.1:6379/0"
    cluster: bool = False
    # Cluster only: more "host:port" seeds besides the URL's node, so a client that
    # starts (or re-discovers the slot map) while that one node is down still connects.
    nodes: list[str] = msgspec.field(default_factory=list)
    timeout: Duration = Duration(0.1)
    connect_timeout: Duration = Duration(0.5)
    prefix: str = ""
    username: str | None = None  # Redis 6+ ACL user
    password: str | None = None  # prefer LAYERED_CACHE_REDIS_PASSWORD over the file
    ssl_ca_certs: str | None = None  # CA bundle for rediss:// (TLS)
    ssl_certfile: str | None = None  # client certificate (mutual TLS)
    ssl_keyfile: str | None = None
    # 0 would make every Redis call wait forever for a connection.
    max_connections: AtLeastOne = 64
    # After sending a request-path command on a single node, poll its socket this long
    # for the reply before the event loop sleeps for it (``_busypoll``); 0s: never.
    busy_poll: Duration = Duration(0.0001)
    breaker: BreakerConfig = BreakerConfig()

    def __post_init__(self) -> None:
        if problem := url_problem(self.url):
            raise bad("url", f"{problem}, got {redact_url(self.url)!r}")
        if self.cluster and (problem := cluster_url_problem(self.url)):
            raise bad("url", f"{problem}, got {redact_url(self.url)!r}")
        if problem := credentials_clash(self.url, self.username, self.password):
            raise bad("url", problem)
        if found := tls_files_problem(self):
            raise bad(*found)
        positive(self, "timeout", "connect_timeout")
        if self.busy_poll > _MAX_BUSY_POLL:
            raise bad("busy_poll", f"must be <= 1ms, got {self.busy_poll * 1e6:g}us")
        if self.busy_poll > self.timeout / 10:
            # A poll holds the event loop: other commands' replies wait behind it, and
            # near ``timeout`` that would fail them.
            raise bad("busy_poll", f"must be <= timeout / 10 ({self.timeout * 1e5:g}us), "
                      f"got {self.busy_poll * 1e6:g}us")
        if self.nodes and not self.cluster:
            raise bad("nodes", "seed nodes are for a cluster: set cluster = true, or drop nodes")
        for node in self.nodes:
            host, port = host_and_port(node)
            if not host or not is_number(port) or not 0 < int(port) < 65536:
                raise bad("nodes", f'expected "host:port", got {redact(node)!r}')
        try:
            validate_prefix(self.prefix)
        except ValueError as exc:
            raise bad("prefix", str(exc)) from None


SecurityProtocol = Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"]
SaslMechanism = Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "GSSAPI", "OAUTHBEARER"]


class KafkaConfig(_Section, frozen=True):
    bootstrap_servers: NonEmpty = "127.0.0.1:9092"
    topics: Annotated[list[NonEmpty], msgspec.Meta(min_length=1)] = msgspec.field(
        default_factory=lambda: ["catalog-events"]
    )
    group_id: NonEmpty = "cache-invalidator"
    dead_letter_topic: NonEmpty = "catalog-events.dlq"
    client_id: NonEmpty = "layered-cache-invalidator"
    security_protocol: SecurityProtocol = "PLAINTEXT"
    sasl_mechanism: SaslMechanism | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    max_batch: AtLeastOne = 1000
    # The consumer fetches twice this per partition, a signed 32-bit field on the wire:
    # past it aiokafka's fetcher died on its first request, the daemon started all the same.
    max_event_bytes: Annotated[int, msgspec.Meta(ge=1, le=(2**31 - 1) // 2)] = 1_000_000
    # -1 = no health server, 0 = an ephemeral port.
    health_port: Port = 9464
    health_host: str = "0.0.0.0"  # bind address of the daemon's /healthz /readyz /metrics
    # Consumer-group timing and start position (the daemon; tests shorten the timeouts).
    auto_offset_reset: Literal["earliest", "latest", "none"] = "earliest"
    session_timeout: Duration = Duration(10.0)
    heartbeat_interval: Duration = Duration(3.0)
    rebalance_timeout: Duration = Duration(10.0)
    retry_max_backoff: Duration = Duration(5.0)

    def __post_init__(self) -> None:
        for server in self.bootstrap_servers.split(","):
            host, _, port = server.strip().rpartition(":")
            if not host or not is_number(port) or not 0 < int(port) < 65536:
                raise bad("bootstrap_servers", f'expected "host:port[,host:port...]", '
                          f"got {redact(self.bootstrap_servers)!r}")
        positive(
            self, "session_timeout", "heartbeat_interval", "rebalance_timeout", "retry_max_backoff"
        )
        if self.heartbeat_interval >= self.session_timeout:
            raise bad(
                "heartbeat_interval",
                f"must be shorter than session_timeout ({self.session_timeout:g}s), "
                "or the group evicts a healthy daemon",
            )
        for name in ("session_timeout", "heartbeat_interval", "rebalance_timeout"):
            if getattr(self, name) > _KAFKA_MAX_MS / 1000:  # a 32-bit ms field on the wire
                raise bad(name, f"must be at most {_KAFKA_MAX_MS // 86_400_000}d (Kafka's limit)")
        for topic in (*self.topics, self.dead_letter_topic):
            if not _TOPIC.fullmatch(topic):
                raise bad("topics", f"{topic!r} is not a Kafka topic name ({_TOPIC_RULE})")
        if self.dead_letter_topic in self.topics:
            # The daemon would read its own dead letters back: one poison event, for ever.
            raise bad("dead_letter_topic", f"{self.dead_letter_topic!r} is also in topics")
        if problem := sasl_mechanism_problem(self.security_protocol, self.sasl_mechanism):
            raise bad("sasl_mechanism", problem)
        if problem := host_problem(self.health_host):
            raise bad("health_host", problem)


_KAFKA_MAX_MS = 2**31 - 1
_TOPIC = re.compile(r"[A-Za-z0-9._-]{1,249}")
_TOPIC_RULE = "1-249 of A-Z a-z 0-9 . _ -"

# An invalidation waits at most ``coalesce`` more to reach L1: past this it stops being
# a burst's batching and becomes staleness.
_MAX_COALESCE = 0.1


class BackplaneConfig(_Section, frozen=True):
    """The Redis Stream that carries invalidated keys to every instance's L1."""

    enabled: bool = True
    stream: str = "layered_cache:invalidations"
    maxlen: Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)] = 100_000  # XADD MAXLEN: int64
    block: Duration = Duration(1.0)
    # After a read that returned entries, the listener waits this long before the next
    # one, so a burst of writes (this instance's own set() calls too) wakes it once per
    # interval instead of once per entry. Adds at most this to an invalidation's way to
    # L1; 0 reads again at once.
    coalesce: Duration = Duration(0.001)
    # Read the stream through a relay (``layered-cache relay``, docs/operations.md,
    # "Fan-out") at this redis:// URL instead of from Redis; "" reads it directly.
    relay: str = ""

    def __post_init__(self) -> None:
        # Its value is not quoted: a URL may hold a password (masked where it is found).
        if self.relay and (problem := relay_url_problem(self.relay)):
            raise bad("relay", problem)
        if problem := stream_problem(self.stream):
            raise bad("stream", problem)
        positive(self, "block")  # XREAD BLOCK 0 blocks forever
        if self.coalesce > _MAX_COALESCE:  # (a negative one is refused by Duration)
            raise bad("coalesce", f"must be <= 100ms, got {self.coalesce:g}s")


class LoggingConfig(_Section, frozen=True):
    format: Literal["console", "json"] = "console"
    level: str = "info"  # any case: LAYERED_CACHE_LOG_LEVEL=INFO is common
    redact_keys: bool = False

    def __post_init__(self) -> None:
        if self.level.strip().lower() not in LOG_LEVELS:
            raise bad("level", f"must be one of {', '.join(LOG_LEVELS)}, got {self.level!r}")


class PurgeConfig(_Section, frozen=True):
    """HTTP caches (Varnish) told to drop a key's or a tag's responses after every
    invalidation, by the cache and by the daemon (docs/http.md). Empty ``urls``: off."""

    urls: list[NonEmpty] = msgspec.field(default_factory=list)
    timeout: Duration = Duration(2.0)
    retries: Annotated[int, msgspec.Meta(ge=0, le=10)] = 3
    queue: AtLeastOne = 10_000  # pending purges; beyond it they are dropped (counted)
    # Each purge is sent again this much later (0 = never): an instance whose L1 was
    # still dropping the old value may have refilled the gateway after the first one.
    repeat_after: Duration = Duration(1.0)

    def __post_init__(self) -> None:
        positive(self, "timeout")
        for url in self.urls:
            if not url.startswith(("http://", "https://")):
                raise bad("urls", f"must start with http:// or https://, got {redact_url(url)!r}")
            if problem := purge_url_problem(url):
                raise bad("urls", f"{problem}, got {redact_url(url)!r}")


class MetricsConfig(_Section, frozen=True):
    enabled: bool = True


class L1Config(_Section, frozen=True):
    ttl: Duration = Duration(5.0)
    jitter: float = 0.2
    max_entries: AtLeastOne = 10_000

    def __post_init__(self) -> None:
        check_jitter(self.jitter)
        positive(self, "ttl")


class L2Config(_Section, frozen=True):
    ttl: Duration = Duration(600.0)
    jitter: float = 0.1

    def __post_init__(self) -> None:
        check_jitter(self.jitter)
        positive(self, "ttl")


class HotConfig(_Section, frozen=True):
    """Hot-key replica sharding: static `keys` and/or detection above `threshold`."""

    replicas: Annotated[int, msgspec.Meta(ge=1, le=64)] = 8
    threshold: Rate | None = None
    keys: list[NonEmpty] = msgspec.field(default_factory=list)
    window: Duration = Duration(1.0)
    cooldown: Duration = Duration(10.0)

    def __post_init__(self) -> None:
        # A zero threshold makes every key hot; a zero window divides by zero.
        positive(self, "threshold", "window")
        check_threshold(self.threshold, self.window)  # so does one read per window


class StampedeConfig(_Section, frozen=True):
    lease_ttl: Duration = Duration(5.0)
    # A lease waiter re-reads L2 after a random pause within [min, max] (random, so the
    # waiters of many processes don't re-read in lock step). The file may still call it
    # ``retry`` (deprecated, see ``config.deprecated``).
    reread_pause: list[Duration] = msgspec.field(
        default_factory=lambda: [Duration(0.05), Duration(0.15)]
    )
    max_wait: Duration = Duration(3.0)
    early_refresh_beta: float = 1.0
    load_timeout: Duration | None = None

    def __post_init__(self) -> None:
        pause = self.reread_pause
        if len(pause) != 2 or pause[0] > pause[1] or pause[1] <= 0:
            raise bad(
                "reread_pause", 'must be [min, max] with 0 <= min <= max, e.g. ["50ms", "150ms"]'
            )
        if not 0 <= self.early_refresh_beta <= 100:
            raise bad("early_refresh_beta", f"must be within 0..100, got {self.early_refresh_beta}")
        positive(self, "lease_ttl", "load_timeout")

    @property
    def retry(self) -> list[Duration]:
        """The old name of ``reread_pause``, for code that still reads it (read-only)."""
        return self.reread_pause


class StaleConfig(_Section, frozen=True):
    max_age: Duration = Duration(0.0)


class HttpConfig(_Section, frozen=True):
    """Cache-Control of HTTP responses that serve one namespace's values (docs/http.md):
    browsers keep them ``max_age``, shared caches (CDN, gateway) ``s_maxage``."""

    max_age: Duration = Duration(0.0)
    s_maxage: Duration | None = None
    stale_while_revalidate: Duration | None = None
    private: bool = False  # only the browser may store it (per-user data)
    no_store: bool = False  # nobody may store it: the response says only "no-store"

    def __post_init__(self) -> None:
        # Cache-Control counts whole seconds (RFC 9111 delta-seconds): "1500ms" would
        # have to be rounded one way or the other, so it is refused instead.
        for name in ("max_age", "s_maxage", "stale_while_revalidate"):
            value = getattr(self, name)
            if value is not None and value != int(value):
                raise bad(name, f"must be whole seconds (Cache-Control counts them): {value:g}s")
        if self.private and self.s_maxage is not None:
            raise bad("s_maxage", "private responses are never stored by shared caches; drop one")
        ages = (self.s_maxage, self.stale_while_revalidate)
        if self.no_store and (any(a is not None for a in ages) or self.max_age or self.private):
            raise bad("no_store", "no_store sends only 'no-store': drop the ages and private")


class NamespaceConfig(_Section, frozen=True):
    key: str
    cache: bool = True
    l1: L1Config | bool = True
    l2: L2Config | bool = True
    hot: HotConfig | bool = False
    stampede: StampedeConfig = StampedeConfig()
    stale: StaleConfig = StaleConfig()
    # At most 1 TiB, more than any Redis string: ``warm`` reads lines of 8x this, and
    # past sys.maxsize ``readline`` raised OverflowError with a traceback.
    max_value_bytes: Annotated[int, msgspec.Meta(ge=1, le=2**40)] = 1_000_000
    tags: bool = False  # entries may carry tags (list pages, searches): docs/tags.md
    http: HttpConfig | None = None  # Cache-Control/ETag of responses: docs/http.md


class InvalidateTarget(_Section, frozen=True):
    """One key an event invalidates, ``{ namespace = "book", key = { id = "book_id" } }``
    (template field -> event field), or one tag, ``{ tag = "book:{book_id}" }`` (event
    fields in braces): every entry carrying it (docs/tags.md)."""

    namespace: str | None = None
    key: dict[str, NonEmpty] | None = None
    tag: str | None = None


class EventRoute(_Section, frozen=True):
    """``invalidate = []`` is allowed: it acknowledges a type that invalidates nothing
    (committed, not dead-lettered as an unknown type would be)."""

    type: NonEmpty
    invalidate: list[InvalidateTarget]


class Config(_Section, frozen=True):
    redis: RedisConfig = RedisConfig()
    kafka: KafkaConfig = KafkaConfig()
    backplane: BackplaneConfig = BackplaneConfig()
    logging: LoggingConfig = LoggingConfig()
    metrics: MetricsConfig = MetricsConfig()
    purge: PurgeConfig = PurgeConfig()
    namespaces: dict[str, NamespaceConfig] = msgspec.field(default_factory=dict)
    events: list[EventRoute] = msgspec.field(default_factory=list)
    source: str = "<memory>"
    # Accepted but probably wrong (an L1 TTL longer than the L2 TTL): shown by
    # ``layered-cache config check`` and issued as ``ConfigWarning``.
    warnings: list[str] = msgspec.field(default_factory=list)
