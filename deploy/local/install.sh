#!/usr/bin/env bash
# install.sh PYTHON REQUIREMENT...: pip-install REQUIREMENTs into PYTHON's venv through uv.
#
# Why uv: the dev extras (mypy, Django, moto, confluent-kafka, ...) took pip ~90 s on a
# fresh clone, which is what CI runs on; uv takes ~10 s for the same versions (both
# resolve from PyPI). uv comes from PyPI into the venv itself; if it can't be had or
# fails, pip installs as before, so a machine without uv's index still gets a venv.
set -euo pipefail
python=$1
shift
if "$python" -m pip install -q 'uv>=0.5' 2>/dev/null \
    && "$python" -m uv pip install --python "$python" -q "$@"; then
  exit 0
fi
echo "install.sh: uv failed; installing with pip" >&2
exec "$python" -m pip install -q "$@"
