#!/usr/bin/env bash
# The test suite on JAX releases other than the one pip picks here: each PYTHON:VERSION pair gets a virtualenv of
# its own (kept in $NNX_VERSIONS_DIR, default /tmp/nnx-jax-versions, for the next run) with `pip install -e
# ".[test]"` and that jax and jaxlib, then runs pytest in it and prints one summary line a pair.
#
#   bash tools/jax_versions.sh python3.11:0.10.2 python3.13:0.11.2 python3.13:0.12.0.1
#   bash tools/jax_versions.sh python3.13:0.12.0.1 -- tests/test_qlora.py   # arguments after -- go to pytest
#
# The floor in pyproject.toml is the oldest release the whole suite passes on (docs/development.md#jax-versions).
set -euo pipefail
cd "$(dirname "$0")/.."
pairs=()
while [[ $# -gt 0 && "$1" != "--" ]]; do pairs+=("$1"); shift; done
[[ $# -gt 0 ]] && shift
if [[ ${#pairs[@]} -eq 0 ]]; then
    echo "usage: bash tools/jax_versions.sh PYTHON:VERSION [...] [-- PYTEST_ARGS]" >&2
    exit 2
fi
root="${NNX_VERSIONS_DIR:-/tmp/nnx-jax-versions}"
mkdir -p "$root"
summary=()
for pair in "${pairs[@]}"; do
    python="${pair%%:*}" version="${pair##*:}"
    venv="$root/$(basename "$python")-jax$version"
    if [[ ! -x "$venv/bin/python" ]]; then
        echo "== $pair: making $venv"
        "$python" -m venv "$venv"
        "$venv/bin/pip" install -q -e ".[test]" "jax==$version" "jaxlib==$version" > "$venv.install.log" 2>&1 \
            || { echo "pip could not install jax $version for $python: $venv.install.log" >&2; exit 2; }
    fi
    log="$root/$(basename "$venv").log"
    echo "== $pair: $("$venv/bin/python" -c 'import jax, sys; print(f"jax {jax.__version__}, Python {sys.version.split()[0]}")')"
    status=0
    "$venv/bin/python" -m pytest -q -p no:cacheprovider "$@" > "$log" 2>&1 || status=$?
    grep -E "^(FAILED|ERROR) " "$log" || true
    summary+=("$pair: $(tail -n 1 "$log") (log: $log)")
    [[ $status -eq 0 ]] || failed=1
done
printf '%s\n' "${summary[@]}"
exit "${failed:-0}"
