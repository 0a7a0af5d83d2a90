"""deploy/ files stay in step with the code: YAML parses, every config they carry validates
against the real schema, commands name real entry points, referenced files exist."""

from __future__ import annotations

import configparser
import importlib.util
import json
import re
import shlex
import tomllib
import urllib.parse
from copy import deepcopy
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml  # type: ignore[import-untyped]

from layered_cache import load_config, parse_config
from layered_cache._config import ENV_OVERRIDES
from tests.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CONFIG_PATH = "/etc/layered-cache/layered_cache.toml"
YAML_FILES = sorted([*DEPLOY.glob("*.yaml"), *DEPLOY.glob("k8s/*.yaml")])
TOML_FILES = sorted([*DEPLOY.glob("config/*.toml"), ROOT / "examples/bookstore/bookstore.toml"])
# Env the example service reads besides LAYERED_CACHE_* (examples/bookstore/app.py, db.py).
APP_ENV = {"REDIS_URL", "KAFKA_BOOTSTRAP", "BOOKSTORE_CONFIG", "DATABASE_URL", "BOOKSTORE_QUERY_DELAY"}


def _docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]


def _k8s(kind: str) -> list[dict[str, Any]]:
    return [doc for p in DEPLOY.glob("k8s/*.yaml") for doc in _docs(p) if doc.get("kind") == kind]


def _compose() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    return doc


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = (DEPLOY / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            instruction, _, args = line.partition(" ")
            result.append((instruction.upper(), args.strip()))
    return result


def _pyproject() -> dict[str, Any]:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def assert_entry_point(argv: list[str]) -> None:
    """``python -m MODULE ...`` names an importable module with a ``__main__``; a bare
    command names a script declared in pyproject's [project.scripts]."""
    assert argv, "empty command"
    if argv[0] in ("python", "python3") or argv[0].endswith("/python"):
        assert argv[1] == "-m", argv
        module = argv[2]
        spec = importlib.util.find_spec(module)
        assert spec is not None, f"module {module!r} is not importable"
        if spec.submodule_search_locations:  # a package: needs __main__
            assert importlib.util.find_spec(f"{module}.__main__") is not None, module
    else:
        scripts = _pyproject()["project"]["scripts"]
        assert argv[0] in scripts, f"{argv[0]!r} is not a [project.scripts] entry"
        target = scripts[argv[0]].split(":")[0]
        assert importlib.util.find_spec(target) is not None, target


def assert_config_flag(argv: list[str]) -> str:
    assert "--config" in argv, argv
    return argv[argv.index("--config") + 1]


# -- YAML -------------------------------------------------------------------------------


def test_there_are_deploy_files() -> None:
    names = {p.relative_to(DEPLOY).as_posix() for p in YAML_FILES}
    assert {"compose.yaml", "k8s/deployment.yaml", "k8s/configmap.yaml", "k8s/pdb.yaml",
            "k8s/secret.yaml"} <= names
    assert (DEPLOY / "Dockerfile").is_file()
    assert (DEPLOY / "systemd/layered-cache-invalidator.service").is_file()


@pytest.mark.parametrize("path", YAML_FILES, ids=lambda p: p.relative_to(DEPLOY).as_posix())
def test_yaml_parses(path: Path) -> None:
    docs = _docs(path)
    assert docs, f"{path} has no documents"
    if path.parent.name == "k8s" and path.name != "kustomization.yaml":
        for doc in docs:
            assert {"apiVersion", "kind", "metadata"} <= set(doc), path
            assert doc["metadata"].get("name"), path


# The oldest Kubernetes minor we support and the newest whose schemas kubernetes-validate
# ships: a field removed or renamed on the way fails one of the two.
K8S_VERSIONS = ("1.30.0", "1.37.0")
K8S_MANIFESTS = sorted(set(DEPLOY.glob("k8s/*.yaml")) - {DEPLOY / "k8s/kustomization.yaml"})


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_MANIFESTS, ids=lambda p: p.name)
def test_manifests_validate_against_the_kubernetes_schemas(path: Path, version: str) -> None:
    """Strict: an unknown field (a typo such as ``livenessProb``) fails too, where the
    API server would silently drop it."""
    for doc in _docs(path):
        kubernetes_validate.validate(doc, version, strict=True)


def test_the_schema_check_catches_a_typo_and_a_wrong_type() -> None:
    (deployment,) = _docs(DEPLOY / "k8s/deployment.yaml")
    typo = deepcopy(deployment)
    typo["spec"]["template"]["spec"]["containers"][0]["livenessProb"] = {}
    wrong_type = deepcopy(deployment)
    wrong_type["spec"]["replicas"] = "two"
    for broken in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kubernetes_validate.validate(broken, K8S_VERSIONS[-1], strict=True)


def test_kustomization_lists_every_manifest() -> None:
    (kustomization,) = _docs(DEPLOY / "k8s/kustomization.yaml")
    listed = set(kustomization["resources"])
    present = {p.name for p in DEPLOY.glob("k8s/*.yaml")} - {"kustomization.yaml"}
    assert listed == present


# -- configs ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", TOML_FILES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_example_configs_validate(path: Path) -> None:
    config = load_config(path, env={})  # unknown keys, bad durations etc. raise ConfigError
    assert config.namespaces
    for route in config.events:
        assert route.invalidate


def _configmap_config() -> Any:
    (configmap,) = [cm for cm in _k8s("ConfigMap") if cm["metadata"]["name"] == "layered-cache-config"]
    text = configmap["data"]["layered_cache.toml"]
    return parse_config(tomllib.loads(text), source="k8s/configmap.yaml", env={})


def test_configmap_config_validates() -> None:
    config = _configmap_config()
    assert config.kafka.topics and config.kafka.group_id


def test_example_configs_agree_on_key_names() -> None:
    """The example files describe one bookstore: the same key templates, replica counts
    and backplane stream, so copying any of them keeps daemon and services in step."""
    from layered_cache._policy import compile_policy

    def names(config: Any) -> dict[str, tuple[str, int]]:
        return {
            name: (ns.key, compile_policy(name, ns, "").replicas)
            for name, ns in config.namespaces.items()
        }

    shipped = load_config(DEPLOY / "config/layered_cache.toml", env={})
    for other in (_configmap_config(), load_config(DEPLOY / "config/cluster-sasl.toml", env={})):
        assert names(other) == names(shipped)
        assert other.backplane.stream == shipped.backplane.stream


def test_compose_gives_daemon_and_service_the_same_config() -> None:
    services = _compose()["services"]
    mounts = [
        next(v for v in services[name]["volumes"] if v.endswith(".toml:" + CONFIG_PATH + ":ro"))
        for name in ("invalidator", "bookstore")
    ]
    assert mounts[0] == mounts[1]


# -- Kubernetes -------------------------------------------------------------------------


def _daemon_deployment() -> dict[str, Any]:
    (deployment,) = [d for d in _k8s("Deployment") if d["metadata"]["name"] == "layered-cache-invalidator"]
    return deployment


def test_deployment_runs_the_daemon_with_probes_and_resources() -> None:
    deployment = _daemon_deployment()
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    argv = [*container.get("command", []), *container.get("args", [])]
    assert_entry_point(argv)
    assert argv[:2] == ["layered-cache", "daemon"]
    assert assert_config_flag(argv) == CONFIG_PATH
    # The config file is the ConfigMap, mounted where --config points.
    mount = next(m for m in container["volumeMounts"] if CONFIG_PATH.startswith(m["mountPath"]))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["configMap"]["name"] == "layered-cache-config"
    items = {i["path"]: i["key"] for i in volume["configMap"].get("items", [])}
    assert items.get(Path(CONFIG_PATH).name, Path(CONFIG_PATH).name) == "layered_cache.toml"
    # Probes hit the daemon's health port and paths.
    health_port = _configmap_config().kafka.health_port
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    probe_paths = set()
    for probe in ("livenessProbe", "readinessProbe"):
        get = container[probe]["httpGet"]
        port = get["port"]
        assert (ports[port] if isinstance(port, str) else port) == health_port
        probe_paths.add(get["path"])
    assert probe_paths <= {"/healthz", "/readyz"}
    source = (ROOT / "layered_cache/daemon/health.py").read_text()
    for path in probe_paths:
        assert f'"{path}"' in source, f"the daemon serves no {path}"
    requests = container["resources"]["requests"]
    assert requests["cpu"] and requests["memory"]
    assert pod["securityContext"]["runAsNonRoot"] is True


def test_secret_env_uses_real_overrides_and_existing_keys() -> None:
    container = _daemon_deployment()["spec"]["template"]["spec"]["containers"][0]
    secrets = {s["metadata"]["name"]: s for s in _k8s("Secret")}
    used = set()
    for env in container.get("env", []):
        assert env["name"] in ENV_OVERRIDES, f"{env['name']} is not a config env override"
        ref = env.get("valueFrom", {}).get("secretKeyRef")
        if ref:
            secret = secrets[ref["name"]]
            assert ref["key"] in {**secret.get("stringData", {}), **secret.get("data", {})}
            used.add(env["name"])
    assert {"LAYERED_CACHE_REDIS_PASSWORD", "LAYERED_CACHE_KAFKA_SASL_PASSWORD"} <= used


def test_pdb_and_service_select_the_daemon_pods() -> None:
    labels = _daemon_deployment()["spec"]["template"]["metadata"]["labels"]
    assert _daemon_deployment()["spec"]["selector"]["matchLabels"].items() <= labels.items()
    (pdb,) = _k8s("PodDisruptionBudget")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert "minAvailable" in pdb["spec"] or "maxUnavailable" in pdb["spec"]
    for service in _k8s("Service"):
        if service["metadata"]["name"] != "layered-cache-relay":
            assert service["spec"]["selector"].items() <= labels.items()


def test_the_relay_service_reaches_the_relay_on_its_own_node() -> None:
    (relay,) = [d for d in _k8s("DaemonSet") if d["metadata"]["name"] == "layered-cache-relay"]
    (service,) = [s for s in _k8s("Service") if s["metadata"]["name"] == "layered-cache-relay"]
    labels = relay["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["internalTrafficPolicy"] == "Local"
    (container,) = relay["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["layered-cache", "relay"]
    listen = container["args"][container["args"].index("--listen") + 1]
    assert listen.endswith(":6390") and service["spec"]["ports"][0]["port"] == 6390
    # Ready only while it follows the stream: it answers PING (deploy/healthcheck.py);
    # a TCP probe passed while it closed every connection (test_relay.py).
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe == ["python", "/app/healthcheck.py", "redis://127.0.0.1:6390"]


# -- Dockerfile -------------------------------------------------------------------------


def test_dockerfile_names_real_entry_points_and_files() -> None:
    instructions = _dockerfile_instructions()
    froms = [args for ins, args in instructions if ins == "FROM"]
    args = dict(a.split("=", 1) for ins, a in instructions if ins == "ARG" and "=" in a)
    assert all("python:3.11-slim" in f.replace("${PYTHON_IMAGE}", args.get("PYTHON_IMAGE", "")) for f in froms)
    users = [a for ins, a in instructions if ins == "USER"]
    assert users and users[-1].split(":")[0] not in ("root", "0")
    cmd = [a for ins, a in instructions if ins == "CMD"][-1]
    argv = json.loads(cmd)  # exec form: signals reach python directly
    entrypoint = [json.loads(a) for ins, a in instructions if ins == "ENTRYPOINT"]
    argv = [*(entrypoint[-1] if entrypoint else []), *argv]
    assert_entry_point(argv)
    assert argv[:2] == ["layered-cache", "daemon"]
    config_path = assert_config_flag(argv)
    # The default config is baked in where CMD looks, from a file that validates.
    copies = [a.split() for ins, a in instructions if ins == "COPY" and not a.startswith("--from")]
    baked = [c for c in copies if c[-1] == config_path]
    assert baked, f"nothing is copied to {config_path}"
    for copy in copies:
        for source in copy[:-1]:
            if "[" in source:  # a glob such as README.m[d]: may match nothing
                continue
            assert (ROOT / source).exists(), f"COPY source {source} missing"
    # The installed extras exist in pyproject.
    extras = _pyproject()["project"]["optional-dependencies"]
    for match in re.finditer(r"\[([a-z,]+)\]", " ".join(a for ins, a in instructions if ins == "RUN")):
        for extra in match.group(1).split(","):
            assert extra in extras, f"extra {extra!r} not in pyproject"


# -- compose ----------------------------------------------------------------------------


def test_compose_services_and_references() -> None:
    compose = _compose()
    services = compose["services"]
    assert {"redis", "kafka", "invalidator", "bookstore"} <= set(services)
    redis_cmd = " ".join(services["redis"]["command"])
    # The shipped config has a tagged namespace: a policy that never evicts the loading
    # set (docs/operations.md, "Redis"; doctor names it under allkeys-*).
    assert "--maxmemory-policy volatile-lfu" in redis_cmd
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka")
    assert "controller" in kafka["environment"]["KAFKA_PROCESS_ROLES"]  # KRaft, no ZooKeeper
    for name, service in services.items():
        build = service.get("build")
        if build:
            context = DEPLOY / build["context"]
            assert context.is_dir(), name
            assert (context / build.get("dockerfile", "Dockerfile")).is_file(), name
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith((".", "/")):
                assert (DEPLOY / source).exists(), f"{name}: volume source {source} missing"
                if source.endswith(".toml"):
                    load_config(DEPLOY / source, env={})
        for dependency in service.get("depends_on", {}):
            assert dependency in services, f"{name} depends on unknown {dependency}"
        for var in service.get("environment", {}) if isinstance(service.get("environment"), dict) else []:
            if var.startswith("LAYERED_CACHE_"):
                assert var in ENV_OVERRIDES, f"{name}: {var} is not a config env override"
            elif name in ("invalidator", "bookstore"):
                assert var in APP_ENV, f"{name}: {var} is read by nothing"
        command = service.get("command")
        if name in ("invalidator", "bookstore") and command:
            assert_entry_point(command if isinstance(command, list) else shlex.split(command))
    # The bookstore reads the mounted config, the daemon the image default path.
    assert services["bookstore"]["environment"]["BOOKSTORE_CONFIG"] == CONFIG_PATH
    assert any(v.endswith(f":{CONFIG_PATH}:ro") for v in services["invalidator"]["volumes"])


# -- systemd ----------------------------------------------------------------------------


def test_systemd_unit_runs_the_daemon() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.optionxform = str  # type: ignore[assignment,method-assign]
    unit.read(DEPLOY / "systemd/layered-cache-invalidator.service")
    service = unit["Service"]
    argv = shlex.split(service["ExecStart"])
    assert argv[0].endswith("/bin/layered-cache")
    assert argv[1] == "daemon"
    assert_entry_point(["layered-cache", *argv[1:]])
    assert assert_config_flag(argv) == CONFIG_PATH
    assert service["KillSignal"] == "SIGTERM"
    assert service["Restart"] == "on-failure"
    assert "2" in service["RestartPreventExitStatus"].split()  # config error: no restart loop
    assert service.get("User") or service.get("DynamicUser") == "yes"  # never root
    assert unit["Install"]["WantedBy"] == "multi-user.target"


def test_kafka_codec_library_is_a_runtime_dependency_the_image_installs() -> None:
    """snappy, lz4 and zstd batches need cramjam (aiokafka's codec library): it must come
    with the daemon's extra, next to aiokafka, and the image must install that extra."""
    daemon = _pyproject()["project"]["optional-dependencies"]["daemon"]
    names = [d.split(">")[0].split("=")[0].strip() for d in daemon]
    assert "cramjam" in names and "aiokafka" in names
    runs = [a for ins, a in _dockerfile_instructions() if ins == "RUN"]
    assert any("pip wheel" in r and '".[' in r and "daemon" in r for r in runs)
    assert any("pip install" in r and "layered_cache[" in r and "daemon" in r for r in runs)


# -- the image: what compose and the docs use ---------------------------------------------


def _extra(name: str) -> list[str]:
    deps = _pyproject()["project"]["optional-dependencies"][name]
    return [re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower() for d in deps]


def _installed_extras() -> set[str]:
    """The extras the image's runtime stage installs (``layered_cache[a,b]``)."""
    runs = [a for ins, a in _dockerfile_instructions() if ins == "RUN" and "pip install" in a]
    found = {e for r in runs for m in re.finditer(r"layered_cache\[([a-z,]+)\]", r) for e in m.group(1).split(",")}
    assert found, "the image installs no layered_cache extras"
    return found


def test_the_image_has_asyncpg_for_database_url_and_the_kafka_codecs() -> None:
    """compose (and docs/operations.md) run the bookstore on PostgreSQL: DATABASE_URL
    needs asyncpg; the daemon reads snappy/lz4/zstd batches with cramjam."""
    extras = _installed_extras()
    assert {"daemon", "prometheus", "example"} <= extras
    assert "asyncpg" in _extra("example")
    assert {"cramjam", "aiokafka"} <= set(_extra("daemon"))
    # The build stage makes wheels for the same extras the runtime stage installs.
    wheel = next(a for ins, a in _dockerfile_instructions() if ins == "RUN" and "pip wheel" in a)
    assert set(re.search(r'"\.\[([a-z,]+)\]"', wheel).group(1).split(",")) == extras  # type: ignore[union-attr]


def _header_commands() -> list[list[str]]:
    """The commands the Dockerfile's header shows (``docker run ... layered-cache CMD``);
    an empty list is the image's default command."""
    commands = []
    for line in (DEPLOY / "Dockerfile").read_text().splitlines():
        if line.startswith("#") and "docker run" in line:
            argv = shlex.split(line.lstrip("# "))
            commands.append(argv[argv.index("layered-cache") + 1 :])
    assert len(commands) >= 2, "the header shows the daemon and the bookstore"
    return commands


def _health_url(argv: list[str]) -> str:
    """Where the process ``argv`` serves /healthz, from the code and the baked config."""
    if not argv:  # the default CMD
        argv = json.loads([a for ins, a in _dockerfile_instructions() if ins == "CMD"][-1])
    assert_entry_point(argv)
    if argv[:2] == ["layered-cache", "daemon"]:
        config = load_config(DEPLOY / "config/layered_cache.toml", env={})
        assert '"/healthz"' in (ROOT / "layered_cache/daemon/health.py").read_text()
        return f"http://127.0.0.1:{config.kafka.health_port}/healthz"
    assert argv[:3] == ["python", "-m", "examples.bookstore"], argv
    main = (ROOT / "examples/bookstore/__main__.py").read_text()
    default = re.search(r'"--port", type=int, default=(\d+)', main)
    assert default, "examples.bookstore has no --port default"
    port = argv[argv.index("--port") + 1] if "--port" in argv else default.group(1)
    assert 'Route("/healthz"' in (ROOT / "examples/bookstore/app.py").read_text()
    return f"http://127.0.0.1:{port}/healthz"


def _healthcheck_module() -> Any:
    spec = importlib.util.spec_from_file_location("healthcheck", DEPLOY / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_healthcheck_fits_every_command_the_header_shows() -> None:
    instructions = _dockerfile_instructions()
    (check,) = [a for ins, a in instructions if ins == "HEALTHCHECK"]
    timeout = float(re.search(r"--timeout=(\d+)s", check).group(1))  # type: ignore[union-attr]
    argv = json.loads(check.split("CMD", 1)[1])
    assert argv[0] == "python"
    script = argv[1]
    copies = [a.split() for ins, a in instructions if ins == "COPY" and not a.startswith("--from")]
    assert ["deploy/healthcheck.py", script] in copies
    healthcheck = _healthcheck_module()
    urls = argv[2:] or list(healthcheck.DEFAULT_URLS)
    for command in _header_commands():
        assert _health_url(command) in urls, f"the HEALTHCHECK does not probe {command or 'CMD'}"
    assert healthcheck.PROBE_TIMEOUT * len(urls) < timeout
    # compose's bookstore probes its own port with the same script.
    bookstore = _compose()["services"]["bookstore"]
    test = bookstore["healthcheck"]["test"]
    assert test[1:3] == ["python", script]
    assert test[3:] == [_health_url(bookstore["command"])]


def test_healthcheck_script_is_healthy_when_one_url_answers_200(tmp_path: Path) -> None:
    import http.server
    import subprocess
    import sys
    import threading

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200 if self.path == "/healthz" else 503)
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        live = f"http://127.0.0.1:{server.server_address[1]}"
        dead = f"http://127.0.0.1:{free_port()}/healthz"

        def run(*urls: str) -> int:
            cmd = [sys.executable, str(DEPLOY / "healthcheck.py"), *urls]
            return subprocess.run(cmd, timeout=10, check=False).returncode

        assert run(dead, f"{live}/healthz") == 0
        assert run(dead) == 1
        assert run(f"{live}/failing") == 1
    finally:
        server.shutdown()


def test_compose_runs_the_bookstore_on_its_postgres() -> None:
    services = _compose()["services"]
    postgres, bookstore = services["postgres"], services["bookstore"]
    assert postgres["image"].startswith("postgres:")
    assert "pg_isready" in " ".join(postgres["healthcheck"]["test"])
    url = urllib.parse.urlparse(bookstore["environment"]["DATABASE_URL"])
    assert url.scheme in ("postgres", "postgresql")  # examples/bookstore/db.py: PostgreSQL
    env = postgres["environment"]
    assert (url.hostname, url.port or 5432) == ("postgres", 5432)
    assert (url.username, url.password) == (env["POSTGRES_USER"], env["POSTGRES_PASSWORD"])
    assert url.path.lstrip("/") == env["POSTGRES_DB"]
    assert bookstore["depends_on"]["postgres"]["condition"] == "service_healthy"
    # The explicit depends_on replaces the shared one: it must keep redis and the topics.
    assert {"redis", "kafka-topics"} <= set(bookstore["depends_on"])
