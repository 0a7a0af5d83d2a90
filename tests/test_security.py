"""Security: no code execution from Redis, tenants and namespaces stay apart."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as redis

from layered_cache import ConfigError, LayeredCache, parse_config
from tests.helpers import CountingLoader, eventually, make_config
from tests.servers import free_port

PACKAGES = [
    Path(__file__).resolve().parent.parent / name for name in ("layered_cache", "consumers")
]


def test_no_pickle_eval_or_exec_anywhere_in_the_packages() -> None:
    pattern = re.compile(
        r"\bimport pickle\b|\bpickle\.|(?<![.\w])eval\(|(?<![.\w])exec\(|marshal\.loads|yaml\.load\("
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
            "redis-server",
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
async def test_tls_and_acl_credentials_work_and_are_never_logged(
    tmp_path: Path, prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    password = "s3cret-Passw0rd"
    process, port, cert = _tls_redis(tmp_path, password)
    try:
        tls = {"ssl_ca_certs": str(cert), "username": "cache", "password": password}
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
