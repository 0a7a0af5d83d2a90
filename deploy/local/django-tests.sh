#!/usr/bin/env bash
# Fetch Django's own cache tests (tests/cache/ of the Django sdist, not in the wheel) for
# the installed Django version into DIR/cache, once per version. tests/test_django_suite.py
# runs their BaseCacheTests against layered_cache.django.
# Usage: deploy/local/django-tests.sh PYTHON DIR
set -euo pipefail
python=$1
dir=$2
version=$("$python" -c 'import django; print(django.__version__)')
if [[ -f "$dir/cache/tests.py" && "$(cat "$dir/VERSION" 2>/dev/null)" == "$version" ]]; then
    exit 0
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
if ! "$python" -m pip download -q "django==$version" --no-deps --no-binary :all: -d "$work" 2>/dev/null; then
    echo "django-tests: could not download the Django $version sdist; tests/test_django_suite.py will skip" >&2
    exit 0
fi
tar -xzf "$work"/[Dd]jango-"$version".tar.gz -C "$work" "django-$version/tests/cache"
rm -rf "$dir"
mkdir -p "$dir"
cp -r "$work/django-$version/tests/cache" "$dir/cache"
echo "$version" > "$dir/VERSION"
echo "django-tests: Django $version tests/cache in $dir"
