"""Extras: the daemon and the Prometheus export say what to install when it is missing.

Each case runs in a fresh interpreter with the dependency blocked (``sys.modules[name]
= None`` makes ``import name`` fail as if it were not installed), so this process's own
imports don't hide the failure.
"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def run_without(modules: list[str], code: str) -> subprocess.CompletedProcess[str]:
    block = "".join(f"sys.modules[{name!r}] = None\n" for name in modules)
    return subprocess.run(
        [sys.executable, "-c", f"import sys\n{block}{code}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.parametrize("missing", ["aiokafka", "prometheus_client"])
def test_the_daemon_without_its_extra_is_an_import_error_naming_the_extra(missing: str) -> None:
    result = run_without([missing], "from layered_cache.daemon import Daemon")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("layered_cache._extras.MissingExtraError:"), result.stderr
    assert "pip install 'layered-cache[daemon]'" in last and missing in last


def test_prometheus_without_its_extra_is_an_import_error_naming_the_extra() -> None:
    result = run_without(["prometheus_client"], "import layered_cache.prometheus")
    last = result.stderr.strip().splitlines()[-1]
    assert "ImportError" in last or "MissingExtraError" in last, result.stderr
    assert "pip install 'layered-cache[prometheus]'" in last


def test_the_missing_extra_error_is_an_import_error() -> None:
    code = (
        "try:\n"
        "    from layered_cache.daemon import Daemon\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__mro__[1].__name__, exc.name)\n"
    )
    result = run_without(["aiokafka"], code)
    assert result.stdout.split() == ["ImportError", "aiokafka"], result.stderr


def test_the_daemon_command_without_its_extra_is_one_line_and_exit_2(tmp_path: Path) -> None:
    code = (
        "from layered_cache.cli import main\n"
        f"sys.exit(main(['daemon', '--config', {str(tmp_path / 'none.toml')!r}]))\n"
    )
    result = run_without(["aiokafka"], code)
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        "layered-cache daemon: error: the daemon needs the optional dependencies of the "
        "'daemon' extra (aiokafka is not installed): pip install 'layered-cache[daemon]'"
    ]


def test_the_django_backend_without_its_extra_is_an_import_error_naming_the_extra() -> None:
    result = run_without(["django"], "import layered_cache.django")
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("layered_cache._extras.MissingExtraError:"), result.stderr
    assert "pip install 'layered-cache[django]'" in last


def test_the_library_imports_without_any_extra() -> None:
    code = (
        "import layered_cache, layered_cache._cache, layered_cache.cli, layered_cache.sync\n"
        "import layered_cache._backplane, layered_cache._logs, layered_cache.daemon.main\n"
        "print('ok')\n"
    )
    result = run_without(["aiokafka", "cramjam", "prometheus_client", "django"], code)
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr


def test_core_dependencies_leave_the_extras_out_and_dev_installs_them_all() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = " ".join(project["dependencies"])
    extras = project["optional-dependencies"]
    for package in ("aiokafka", "cramjam", "prometheus-client"):
        assert package not in core
        assert any(package in requirement for requirement in extras["daemon"])
    assert any("prometheus-client" in requirement for requirement in extras["prometheus"])
    assert any(
        "[" in requirement
        and {"daemon", "prometheus"} <= set(requirement[requirement.index("[") + 1 : -1].split(","))
        for requirement in extras["dev"]
    )
