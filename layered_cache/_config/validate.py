"""Checks that span tables, run once every table has been decoded on its own.

Templates compile, namespaces can't build one another's keys, static hot keys are keys
of their template, events name known namespaces and exactly their template fields, each
event type is routed once: what the cache or the daemon would refuse at start is refused
at load. Settings that work but probably don't do what was meant are warnings.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from layered_cache._config.checks import sasl_credentials_problem, ssl_cafile_problem
from layered_cache._config.errors import ConfigError
from layered_cache._config.schema import (
    Config,
    HotConfig,
    InvalidateTarget,
    KafkaConfig,
    L1Config,
    L2Config,
    NamespaceConfig,
)
from layered_cache._keys import MAX_KEY_LENGTH, MAX_TAG_LENGTH, KeyTemplate

__all__ = [
    "CACHE_INVALIDATE", "check_cross_references", "check_namespaces", "daemon_start_problem",
]

CACHE_INVALIDATE = "CacheInvalidate"  # the built-in event type (layered_cache._events)


def check_cross_references(config: Config) -> list[str]:
    """Checks that span tables: the namespaces' (``check_namespaces``), events name known
    namespaces and fields, each event type is routed once. Returns the warnings."""
    source = config.source
    _check_routes(config, check_namespaces(config))
    return [
        warning
        for name, ns in config.namespaces.items()
        for check in (_ttl_warning, _http_warning)
        if (warning := check(source, name, ns))
    ]


def check_namespaces(config: Config) -> dict[str, KeyTemplate]:
    """The namespaces' templates, once they are known to be sound together: each
    compiles and fits the key length limit with the prefix, no two can build one name,
    each static hot key is a key of its template. Run at load and again wherever a cache
    is built from a Config (``_policy.compile_policies``): a Config made or replaced in
    code (``msgspec.structs.replace``) never went through load."""
    source = config.source
    templates: dict[str, KeyTemplate] = {}
    for name, ns in config.namespaces.items():
        _check_name(source, name)
        try:
            templates[name] = KeyTemplate(name, ns.key, config.redis.prefix)
        except ValueError as exc:
            raise ConfigError(f"{source}: namespaces.{name}.key: {exc}") from None
        if (shortest := _shortest_key(templates[name])) > MAX_KEY_LENGTH:
            raise ConfigError(
                f"{source}: namespaces.{name}.key: builds keys of at least {shortest} "
                f"characters with redis.prefix, over the limit of {MAX_KEY_LENGTH}"
            )
    _check_disjoint_namespaces(source, {n: ns.key for n, ns in config.namespaces.items()})
    for name, ns in config.namespaces.items():
        _check_static_hot_keys(source, name, ns, templates[name])
    return templates


# Letters, digits, "_", "-" and ".": no ":" nor whitespace. The replica-count record
# (``_invalidation.recorded_counts``) keeps each namespace's name in the hash that holds
# its ``shape:...`` and ``template:...`` fields: a namespace named ``template:book:{id}``
# overwrote another namespace's entry there and hid a replica-count mismatch. Names also
# reach logs, metrics labels and the CLI, where a newline or a tab would garble them.
_NAME = re.compile(r"[\w.-]+")


def _check_name(source: str, name: str) -> None:
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"{source}: namespaces: {name!r} is not a namespace name: use letters, "
            "digits, '_', '-' and '.' (no ':', no whitespace)"
        )


def _check_routes(config: Config, templates: Mapping[str, KeyTemplate]) -> None:
    """What the daemon's event decoder would refuse at start, refused at load."""
    source = config.source
    seen: dict[str, int] = {}
    for index, route in enumerate(config.events):
        if route.type == CACHE_INVALIDATE:
            raise ConfigError(
                f"{source}: events[{index}].type: {CACHE_INVALIDATE!r} is built in and "
                "cannot be routed"
            )
        if route.type in seen:
            raise ConfigError(
                f"{source}: events[{index}].type: {route.type!r} is already routed by "
                f"events[{seen[route.type]}]; list all its targets in one route"
            )
        seen[route.type] = index
        for t_index, target in enumerate(route.invalidate):
            path = f"events[{index}].invalidate[{t_index}]"
            if target.tag is not None or target.namespace is None or target.key is None:
                _check_tag_target(source, path, target)
                continue
            template = templates.get(target.namespace)
            if template is None:
                raise ConfigError(
                    f"{source}: {path}.namespace: unknown namespace {target.namespace!r}"
                )
            missing = set(template.fields) - set(target.key)
            extra = set(target.key) - set(template.fields)
            if missing or extra:
                raise ConfigError(
                    f"{source}: {path}.key: must map exactly the template fields "
                    f"{sorted(template.fields)} of {target.namespace!r}"
                    f" (missing {sorted(missing)}, unknown {sorted(extra)})"
                )


def _check_static_hot_keys(
    source: str, name: str, ns: NamespaceConfig, template: KeyTemplate
) -> None:
    """``hot.keys`` are key names (without the prefix); one the template can never build
    would silently never be hot. The runtime matches ``redis.prefix`` + the key, so the
    prefixed name is what must parse (``parse`` also applies build's length limit)."""
    if not isinstance(ns.hot, HotConfig):
        return
    for index, key in enumerate(ns.hot.keys):
        if template.parse(template.prefix + key) is None:
            shown = repr(key) if len(key) <= 80 else f"{key[:80]!r}... ({len(key)} characters)"
            raise ConfigError(
                f"{source}: namespaces.{name}.hot.keys[{index}]: {shown} is not a key of "
                f"template {ns.key!r} (a ':' inside a value is written %3A, and with "
                f"redis.prefix a key is at most {MAX_KEY_LENGTH} characters, see docs/keys.md)"
            )


def _ttl_warning(source: str, name: str, ns: NamespaceConfig) -> str | None:
    """An L1 TTL above the L2 TTL is capped by the L2 soft expiry anyway: the setting
    does not do what it says, so say so (a warning: the cache still works)."""
    l1 = L1Config() if ns.l1 is True else ns.l1
    l2 = L2Config() if ns.l2 is True else ns.l2
    if not ns.cache or l1 is False or l2 is False or l1.ttl <= l2.ttl:
        return None
    return (
        f"{source}: namespaces.{name}.l1.ttl: {l1.ttl:g}s is longer than l2.ttl "
        f"{l2.ttl:g}s; L1 entries never outlive the L2 soft expiry, so the L1 TTL is "
        "effectively the L2 TTL"
    )


def _http_warning(source: str, name: str, ns: NamespaceConfig) -> str | None:
    """A namespace that is never cached answers with fresh data every time, so its
    responses are always ``no-store``: an ``http`` policy on it would be ignored."""
    if ns.cache or ns.http is None or ns.http.no_store:
        return None
    return (
        f"{source}: namespaces.{name}.http: ignored, a namespace with cache = false is "
        "always sent with Cache-Control: no-store"
    )


def _check_disjoint_namespaces(source: str, templates: dict[str, str]) -> None:
    """Two namespaces must never be able to produce the same key (one could then read or
    delete the other's values): their leading literals (``book:`` of ``book:{id}``) must
    be non-empty and neither may be a prefix of the other."""
    leads = {name: template.split("{", 1)[0] for name, template in templates.items()}
    for name, lead in leads.items():
        if not lead:
            raise ConfigError(
                f"{source}: namespaces.{name}.key: must start with literal text such as "
                f"'{name}:' so namespaces can't collide"
            )
        for other, other_lead in leads.items():
            if other != name and other_lead.startswith(lead):
                raise ConfigError(
                    f"{source}: namespaces.{other}.key: may produce the same keys as "
                    f"namespace {name!r} ({other_lead!r} starts with {lead!r}); give each "
                    "namespace its own leading text"
                )


_TAG_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def _shortest_key(template: KeyTemplate) -> int:
    """The prefix, the literal text and one character per field."""
    literal = len(template.template) - sum(len(field) + 2 for field in template.fields)
    return len(template.prefix) + literal + len(template.fields)


def _check_tag_target(source: str, path: str, target: InvalidateTarget) -> None:
    """A target is a key (namespace + key) or a tag template, never both or neither;
    a tag template's literal text obeys the key character rules."""
    if target.tag is None or target.namespace is not None or target.key is not None:
        raise ConfigError(
            f"{source}: {path}: a target is either {{ namespace = ..., key = {{...}} }} "
            '(one key) or { tag = "..." } (every entry carrying the tag), not both or a part'
        )
    literal = _TAG_FIELD.sub("x", target.tag)
    if not literal or not re.fullmatch(r"[A-Za-z0-9_.:@/=+\-]+", literal):
        raise ConfigError(
            f"{source}: {path}.tag: {target.tag!r} must be letters, digits and "
            "_ . : @ / = + - with event fields in braces, like \"book:{book_id}\""
        )
    if len(literal) > MAX_TAG_LENGTH:  # each field at least one character: "x"
        raise ConfigError(
            f"{source}: {path}.tag: builds tags of at least {len(literal)} characters, "
            f"over the limit of {MAX_TAG_LENGTH}: every such event would be refused"
        )


def daemon_start_problem(kafka: KafkaConfig) -> str | None:
    """What only the daemon needs, checked by ``config check`` and at the daemon's start
    rather than at every load (the services share the file, not the daemon's Kafka
    password or CA file): ``"kafka.<field>: <problem>"``, or None."""
    if found := sasl_credentials_problem(
        kafka.sasl_mechanism, kafka.sasl_username, kafka.sasl_password
    ):
        return f"kafka.{found[0]}: {found[1]}"
    if kafka.security_protocol in ("SSL", "SASL_SSL") and (
        problem := ssl_cafile_problem(kafka.ssl_cafile)
    ):
        return f"kafka.ssl_cafile: {problem}"
    return None
