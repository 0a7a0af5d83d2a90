"""Invalidation events on the wire: decoding and routing (the typed events producers
use are in ``_event_types``).

One event is one JSON object per Kafka message, tagged by ``type``:

    {"type": "BookPriceChanged", "book_id": 42, "old_price": "12.90", ...}
    {"type": "CacheInvalidate", "namespace": "book", "keys": [{"id": 42}]}

``CacheInvalidate`` is built in. Every other type is *routed by config*
(``[[events]]``): a route names the namespaces an event invalidates and which event
field fills each template field, so a new event type needs config, not code.

Decoding is deliberately lenient about fields nobody routes (an extra or missing
``occurred_at`` must not stop an invalidation: deleting a cache key is always safe) and
strict about the fields that build keys (a wrong key would leave the real one stale).
Anything that cannot be turned into keys raises :class:`PoisonEvent` with a reason the
daemon writes to the dead-letter topic.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from layered_cache._config import Config, EventRoute
from layered_cache._event_types import CACHE_INVALIDATE
from layered_cache._keys import KeyTemplate, tag_problem
from layered_cache._logs import SALT_ENV, redact_key
from layered_cache._policy import compile_policies

__all__ = ["DecodedEvent", "EventDecoder", "PoisonEvent", "Target"]


class PoisonEvent(ValueError):
    """An event that can never be turned into keys; ``reason`` goes to the DLQ headers."""

    def __init__(self, reason: str, event_type: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.event_type = event_type


class _ReceivedInvalidate(msgspec.Struct, frozen=True):
    """A received ``CacheInvalidate``: its keys' members are checked by ``_target``, and
    only those the template names (a key may carry the whole changed row: a price, a
    null, a nested object)."""

    namespace: str
    keys: list[dict[str, Any]]


# -- decoding ---------------------------------------------------------------------------


class Target(msgspec.Struct, frozen=True, array_like=True):
    """One key to invalidate: the full Redis name (prefix included) and its replica count."""

    namespace: str
    key: str
    replicas: int


class DecodedEvent(msgspec.Struct, frozen=True):
    event_type: str
    targets: list[Target]
    tags: list[str] = msgspec.field(default_factory=list)  # tags to invalidate


class _Namespace(msgspec.Struct, frozen=True):
    template: KeyTemplate
    replicas: int


class _CompiledTarget(msgspec.Struct, frozen=True):
    namespace: _Namespace
    # (template field, path of the event field as a tuple: "book.id" -> ("book", "id"))
    fields: tuple[tuple[str, tuple[str, ...]], ...]


# A type routed only to one-field keys read from top-level event fields ("book:{id}" from
# "book_id"), per key: (event field, template, replica count).
_Plan = tuple[tuple[str, KeyTemplate, int], ...]


class _CompiledTag(msgspec.Struct, frozen=True):
    template: str  # "book:{book_id}"
    fields: tuple[tuple[str, tuple[str, ...]], ...]  # ("{book_id}", ("book_id",))


class EventDecoder:
    """Turns raw message bytes into invalidation targets using the config's routes.

    Compiled once: templates, replica counts and field paths are resolved at start-up,
    so decoding an event is one JSON parse plus a dict lookup per routed field.
    """

    def __init__(self, config: Config, *, env: Mapping[str, str] | None = None) -> None:
        self.max_bytes = config.kafka.max_event_bytes
        # With logging.redact_keys a reason names a rejected key value by its hash only
        # (the same keyed hash the logs use), since reasons reach logs and DLQ headers.
        self._redact_salt: bytes | None = None
        if config.logging.redact_keys:
            environ = os.environ if env is None else env
            self._redact_salt = environ.get(SALT_ENV, "").encode()
        # The replica count comes from the same policy the read path uses, so the
        # daemon deletes exactly the replica names a fill may have written.
        self._namespaces: dict[str, _Namespace] = {
            name: _Namespace(policy.template, policy.replicas)
            for name, policy in compile_policies(config).items()
        }
        self._routes: dict[str, list[_CompiledTarget | _CompiledTag]] = {}
        self._plans: dict[str, _Plan] = {}  # the types ``collect`` may route itself
        for route in config.events:
            self._add_route(route)

    @property
    def event_types(self) -> list[str]:
        return sorted([CACHE_INVALIDATE, *self._routes])

    def _add_route(self, route: EventRoute) -> None:
        if route.type == CACHE_INVALIDATE:
            raise ValueError(f"events: {CACHE_INVALIDATE!r} is built in and cannot be routed")
        if route.type in self._routes:
            raise ValueError(f"events: type {route.type!r} is routed twice")
        compiled: list[_CompiledTarget | _CompiledTag] = []
        for target in route.invalidate:
            if target.tag is not None:
                fields = tuple(
                    (match.group(0), tuple(match.group(1).split(".")))
                    for match in _TAG_FIELD.finditer(target.tag)
                )
                compiled.append(_CompiledTag(target.tag, fields))
                continue
            assert target.namespace is not None and target.key is not None  # validated
            namespace = self._namespaces[target.namespace]
            fields = tuple(
                (template_field, tuple(event_field.split(".")))
                for template_field, event_field in target.key.items()
            )
            compiled.append(_CompiledTarget(namespace, fields))
        self._routes[route.type] = compiled
        plan = _plan(compiled)
        if plan is not None:
            self._plans[route.type] = plan

    def collect(self, data: bytes, keys: dict[str, int], tags: list[str]) -> str:
        """Decode one message into a batch: its keys into ``keys`` (key -> replica count;
        a key already there keeps its count: each key once per batch), its tags onto
        ``tags``; returns the event type. Raises ``PoisonEvent`` exactly when ``decode``
        does, with its reason, and then adds nothing.

        The daemon's path. A type routed only to one-field keys (the usual ``book:{id}``
        from ``book_id``) has its keys built here without the ``DecodedEvent`` and
        ``Target`` objects: through them an event cost ~10 µs, a quarter of the DEL of
        its 18 names (bench/daemon_floor.py). Anything else - a missing field, a value of
        another type, a value the template refuses, tags, ``CacheInvalidate``, a parse
        error - goes through ``decode``: whether a message is poison, and why, is
        decided in one place only."""
        if data is not None and len(data) <= self.max_bytes:
            try:
                event = msgspec.json.decode(data)
            except Exception:
                event = None  # poison or not, ``decode`` says (and why)
            if type(event) is dict:
                event_type = event.get("type")
                plan = self._plans.get(event_type) if type(event_type) is str else None
                if plan is not None:
                    found = _planned_keys(plan, event)
                    if found is not None:
                        for key, replicas in found:
                            keys.setdefault(key, replicas)
                        return str(event_type)
        decoded = self.decode(data)
        for target in decoded.targets:
            keys.setdefault(target.key, target.replicas)
        tags += decoded.tags
        return decoded.event_type

    def decode(self, data: bytes | None) -> DecodedEvent:
        """Targets of one message, or ``PoisonEvent`` saying why there are none.

        Total: whatever goes wrong while turning these bytes into targets (deep nesting,
        out-of-range numbers, anything a parser may raise) ends as ``PoisonEvent`` with
        a reason naming the problem, never as another exception."""
        try:
            return self._decode(data)
        except PoisonEvent:
            raise
        except Exception as exc:  # e.g. RecursionError from 2,000 nested '['
            detail = "(detail withheld: redact_keys)" if self._redact_salt is not None else exc
            raise PoisonEvent(f"{type(exc).__name__} while decoding: {detail}") from None

    def _decode(self, data: bytes | None) -> DecodedEvent:
        if data is None:
            raise PoisonEvent("empty message (no value)")
        # Size first: never parse a payload we would reject anyway.
        if len(data) > self.max_bytes:
            raise PoisonEvent(
                f"payload of {len(data)} bytes exceeds max_event_bytes {self.max_bytes}"
            )
        try:
            event = msgspec.json.decode(data)
        except msgspec.ValidationError as exc:
            # Valid JSON that msgspec can't hold, e.g. an integer of 5,000 digits.
            raise PoisonEvent(f"JSON value out of range (ValidationError): {exc}") from None
        except msgspec.DecodeError as exc:
            raise PoisonEvent(f"not JSON (DecodeError): {exc}") from None
        if not isinstance(event, dict):
            raise PoisonEvent(f"not a JSON object but {type(event).__name__}")
        event_type = event.get("type")
        if not isinstance(event_type, str):
            raise PoisonEvent("missing or non-string 'type' field")
        if event_type == CACHE_INVALIDATE:
            return DecodedEvent(event_type, self._generic(event))
        routes = self._routes.get(event_type)
        if routes is None:
            raise PoisonEvent(f"unknown event type {_shown(event_type)}", event_type)
        targets = [
            self._routed(event_type, event, route)
            for route in routes
            if isinstance(route, _CompiledTarget)
        ]
        tags = [
            self._tag(event_type, event, route)
            for route in routes
            if isinstance(route, _CompiledTag)
        ]
        return DecodedEvent(event_type, targets, tags)

    def _tag(self, event_type: str, event: Mapping[str, Any], route: _CompiledTag) -> str:
        """The route's tag template filled from the event in one pass (filled one field
        at a time, a value holding another field's placeholder, ``"{ed}"``, was filled
        in turn: another tag than the event's), checked like a tag."""
        values: dict[str, str] = {}
        for placeholder, path in route.fields:
            value = _field(event_type, event, path)
            if type(value) not in (int, str):
                raise PoisonEvent(
                    f"{event_type}: field {'.'.join(path)!r} of tag {route.template!r} must "
                    f"be an int or str, got {type(value).__name__}",
                    event_type,
                )
            values[placeholder] = str(value)
        tag = _TAG_FIELD.sub(lambda match: values[match.group(0)], route.template)
        if (problem := tag_problem(tag)) is None:
            return tag
        # With redact_keys named by its hash, not by replacing its forms in validate_tag's
        # text: that quotes its first 80 characters, and a longer tag went out in clear.
        salt = self._redact_salt
        shown = _shown(tag, 80) if salt is None else redact_key(tag, salt)
        raise PoisonEvent(f"{event_type}: tag {shown}: {problem}", event_type)

    def _routed(self, event_type: str, event: Mapping[str, Any], route: _CompiledTarget) -> Target:
        fields: dict[str, object] = {}
        for template_field, path in route.fields:
            value: Any = event
            for part in path:
                if not isinstance(value, dict) or part not in value:
                    raise PoisonEvent(
                        f"{event_type}: missing field {'.'.join(path)!r} "
                        f"(key field {template_field!r} of {route.namespace.template.namespace!r})",
                        event_type,
                    )
                value = value[part]
            fields[template_field] = value
        return self._target(event_type, route.namespace, fields)

    def _generic(self, event: Mapping[str, Any]) -> list[Target]:
        try:
            generic = msgspec.convert(event, _ReceivedInvalidate)
        except msgspec.ValidationError as exc:
            raise PoisonEvent(f"{CACHE_INVALIDATE}: {exc}", CACHE_INVALIDATE) from None
        namespace = self._namespaces.get(generic.namespace)
        if namespace is None:
            raise PoisonEvent(
                f"{CACHE_INVALIDATE}: unknown namespace {_shown(generic.namespace)}",
                CACHE_INVALIDATE,
            )
        return [self._target(CACHE_INVALIDATE, namespace, fields) for fields in generic.keys]

    def _target(
        self, event_type: str, namespace: _Namespace, fields: Mapping[str, object]
    ) -> Target:
        template = namespace.template
        for name in template.fields:
            if name not in fields:
                raise PoisonEvent(
                    f"{event_type}: missing key field {name!r} of {template.namespace!r}",
                    event_type,
                )
            value = fields[name]
            # bool is an int subclass: {"id": true} is a producer bug, not book 1.
            if type(value) not in (int, str):
                raise PoisonEvent(
                    f"{event_type}: key field {name!r} of {template.namespace!r} must be an "
                    f"int or str, got {type(value).__name__}",
                    event_type,
                )
        try:
            # Only the template's fields: a CacheInvalidate key naming more (a producer
            # that sends the row it changed) still means the entry those fields name,
            # and a dropped invalidation costs more than a broader one.
            key = template.build({name: fields[name] for name in template.fields})
        except (KeyError, ValueError) as exc:
            reason = self._scrub(str(exc.args[0]), fields)
            raise PoisonEvent(f"{event_type}: {reason}", event_type) from None
        return Target(template.namespace, key, namespace.replicas)

    def _scrub(self, message: str, fields: Mapping[str, object]) -> str:
        """With redact_keys, every key value quoted in ``message`` becomes its hash."""
        if self._redact_salt is None:
            return message
        for value in fields.values():
            if isinstance(value, str) and value:
                hashed = redact_key(value, self._redact_salt)
                for form in (repr(value), repr(value[:40] + "...")):
                    message = message.replace(form, hashed)
        return message


def _plan(compiled: Sequence[_CompiledTarget | _CompiledTag]) -> _Plan | None:
    """The route as a ``_Plan`` if every target is a one-field key filled from a
    top-level event field, else None (``decode`` handles it)."""
    plan = []
    for target in compiled:
        if not isinstance(target, _CompiledTarget) or len(target.fields) != 1:
            return None
        template_field, path = target.fields[0]
        template = target.namespace.template
        if len(path) != 1 or template.fields != (template_field,):
            return None
        plan.append((path[0], template, target.namespace.replicas))
    return tuple(plan)


def _planned_keys(plan: _Plan, event: dict[str, Any]) -> list[tuple[str, int]] | None:
    """The keys of ``event`` by ``plan``, or None for anything but the plain case (an
    absent field, a value neither int nor str - bool included - or one the template
    refuses): ``decode`` then finds the reason."""
    found = []
    for event_field, template, replicas in plan:
        value: Any = event.get(event_field)
        kind = type(value)
        if kind is not int and kind is not str:
            return None
        try:
            found.append((template.build_value(value), replicas))
        except (KeyError, ValueError):
            return None
    return found


_TAG_FIELD = re.compile(r"\{([A-Za-z_][A-Za-z0-9_.]*)\}")


def _field(event_type: str, event: Mapping[str, Any], path: tuple[str, ...]) -> Any:
    value: Any = event
    for part in path:
        if not isinstance(value, dict) or part not in value:
            reason = f"{event_type}: missing field {'.'.join(path)!r} (of a tag)"
            raise PoisonEvent(reason, event_type)
        value = value[part]
    return value


def _shown(text: str, limit: int = 60) -> str:
    """``repr`` of a producer-supplied string, cut: a reason must stay small."""
    if len(text) <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({len(text)} characters)"
