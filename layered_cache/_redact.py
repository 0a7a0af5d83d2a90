"""The one redaction rule: no secret reaches any output.

Every path that shows text to a person or a log (CLI text and JSON, ``ConfigError``
messages, structlog events, the daemon's errors, metrics labels) passes it through
:func:`redact`; a URL *value* is shown through :func:`redact_url`. Two layers, because
either alone leaks:

1. **Shape.** Userinfo of anything URL-like (``redis://u:pw@h``, ``Redis://``,
   ``redis//:pw@h``, ``redis:/:pw@h``, a password containing ``@``: everything up to
   the last ``@`` of the run) and the value of password-like query parameters
   (``?password=``, ``token=``...) become ``***``. This covers text we never saw, such
   as a client library's exception.
2. **Known secrets.** Loading a config remembers its secrets (``redis.password``,
   ``kafka.sasl_password``, a URL's userinfo and password parameters, raw and
   percent-decoded, whatever the URL's shape); any later occurrence anywhere in any
   output is replaced. This covers shapes the patterns do not know.

Secrets shorter than ``MIN_SECRET`` characters are only masked by shape: replacing
every ``a`` in every message would make output useless, and such a password is not
a secret anyway.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import unquote

from layered_cache._forklock import ForkSafeLock

__all__ = [
    "MASK",
    "MIN_SECRET",
    "forget_secrets",
    "redact",
    "redact_data",
    "redact_url",
    "remember_secret",
    "remember_url_secrets",
    "replace_quoted",
]

MASK = "***"
MIN_SECRET = 4
_PASSWORD_PARAMS = r"password|passwd|pwd|pass|secret|token|auth|sasl_password|access_key"
_SCHEME = r"[A-Za-z][A-Za-z0-9+.\-]*(?::/{1,3}|/{2,3})"
# scheme (or a damaged form: "redis//", "redis:/"), then userinfo up to the last "@" of
# the whitespace-free run: a password may contain "@".
_USERINFO = re.compile(rf"(?<![A-Za-z0-9+.\-])(?P<scheme>{_SCHEME})(?P<userinfo>\S*)@")
# A password parameter's value runs to the end of the run: it may contain "&" or "#".
_QUERY_SECRET = re.compile(rf"(?i)(?P<key>[?&;](?:{_PASSWORD_PARAMS})=)\S*")
# The same parameter in a URL the config holds: there the value runs to the end of the
# URL, whitespace included (a query parser keeps "a b" whole), not only to the end of a
# whitespace-free run as in text we never saw.
_CONFIGURED_QUERY_SECRET = re.compile(rf"(?i)(?P<key>[?&;](?:{_PASSWORD_PARAMS})=).*")
_PARAM_NAME = re.compile(rf"(?i){_PASSWORD_PARAMS}")
_URL_DELIMITERS = re.compile(r"[/?#@:&;=\s]")
_lock = ForkSafeLock()  # a forked child may load a config with new secrets
_known: tuple[str, ...] = ()


def remember_secret(secret: object) -> None:
    """Mask this value (and its percent-decoded form) in every later output."""
    global _known
    if not isinstance(secret, str):
        return
    forms = {form for form in (secret, unquote(secret)) if len(form) >= MIN_SECRET}
    if not forms - set(_known):
        return
    with _lock:
        # Longest first, so a secret containing another is masked whole.
        _known = tuple(sorted(set(_known) | forms, key=len, reverse=True))


def remember_url_secrets(url: object) -> None:
    """Remember the userinfo and password parameters of a URL of any shape."""
    if not isinstance(url, str):
        return
    run = url.strip()
    scheme_end = _scheme_end(run)
    if "@" in run[scheme_end:]:
        userinfo = run[scheme_end : run.rindex("@")]
        _, colon, password = userinfo.partition(":")
        _remember_with_pieces(password if colon else userinfo)
        # The whole userinfo too: ``redis://{password}@host`` with a ":" in the password
        # reads as user:password, and the first piece must not show when the password
        # is printed whole (a config dict, a log field). Not the user part alone: a user
        # name like "cache" would turn that word into *** in every line.
        remember_secret(userinfo)
    for match in _CONFIGURED_QUERY_SECRET.finditer(run):
        value = run[match.end("key") : match.end()]
        remember_secret(value)  # to the end: the password may hold "&"
        for piece in _query_password_pieces(value):
            _remember_with_pieces(piece)


def _query_password_pieces(value: str) -> list[str]:
    """What a query parser takes as the password, then each fragment after it that no
    parser takes for a parameter. ``?password=A&B?&ssl=false`` is read as the password
    "A" and an empty parameter "B?", but the password written was "A&B?": printed whole
    (a config dict, a log field), "B?" must not show beside the masked "A". A fragment
    holding "=" is another parameter, and the password ends there: its pieces are not
    secrets (``&ssl_cert_reqs=none`` must not turn every "none" into ***)."""
    first, *rest = re.split(r"[&;#]", value)
    pieces = [first]
    for piece in rest:
        if "=" in piece:
            break
        pieces.append(piece)
    return pieces


def _remember_with_pieces(secret: str) -> None:
    """The secret, and each piece a URL parser might cut it into and quote in an error
    (``Port could not be cast to integer value as 'piece'``)."""
    remember_secret(secret)
    for piece in _URL_DELIMITERS.split(secret):
        if not _PARAM_NAME.fullmatch(piece):  # "password" of "?password=" is no secret
            remember_secret(piece)


def forget_secrets() -> None:
    """Tests only: start from an empty set of known secrets."""
    global _known
    with _lock:
        _known = ()


def _scheme_end(url: str) -> int:
    match = re.match(_SCHEME, url)
    return match.end() if match else 0


def redact(text: str) -> str:
    """``text`` with credentials masked by shape (password parameters, then userinfo),
    then every known secret replaced.

    Shapes first: a known secret that is a piece of a parameter's name or a scheme
    (another config's password ``word``, ``redis``) turned ``?password=`` into
    ``?pass***=`` or ``redis://`` into ``***://``, which no longer read as credentials:
    their values showed. Password parameters before userinfo: their value runs to the
    end of the run, ``@`` included (``?password=A;B@C``), where userinfo masking,
    which cuts a URL at its last ``@``, would have left the secret's tail in sight; for
    the same reason a known secret holding an ``@`` is masked before userinfo too."""
    if "=" in text:
        text = _QUERY_SECRET.sub(rf"\g<key>{MASK}", text)
    if "@" in text:
        for secret in _known:
            if "@" in secret and secret in text:
                text = text.replace(secret, MASK)
        text = _USERINFO.sub(_mask_userinfo, text)
    for secret in _known:
        if secret in text:
            text = text.replace(secret, MASK)
    return text


def _mask_userinfo(match: re.Match[str]) -> str:
    # The whole userinfo, username too: in ``redis://A:B@host`` "A" may be a username or
    # the first piece of a password that holds a ":" (``redis://{password}@host``), and
    # no rule can tell which. A username is not worth the risk of showing half a secret.
    return f"{match.group('scheme')}{MASK}@"


def redact_url(url: str) -> str:
    """A URL value fit to show: everything before the last ``@`` after the scheme is
    credentials whatever the URL's shape, and password parameters are masked."""
    scheme_end = _scheme_end(url)
    if "@" in url[scheme_end:]:
        _, _, rest = url[scheme_end:].rpartition("@")
        url = f"{url[:scheme_end]}{MASK}@{rest}"  # username too: see _mask_userinfo
    return redact(url)


def redact_data(data: Any) -> Any:
    """A JSON-like structure with every string redacted (redact values, not the rendered
    text: a masked run must not swallow the JSON's own quotes)."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {key: redact_data(value) for key, value in data.items()}
    if isinstance(data, list | tuple):
        return [redact_data(item) for item in data]
    return data


def replace_quoted(text: str, values: Iterable[str], by: Callable[[str], str]) -> str:
    """``text`` with each of ``values`` it quotes replaced by ``by(value)``; longest
    first, so a value holding another (``book:12`` and ``book:1``) goes whole."""
    for value in sorted(set(values), key=len, reverse=True):
        if value and value in text:
            text = text.replace(value, by(value))
    return text
