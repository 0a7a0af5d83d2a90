#!/usr/bin/env bash
# `make test-stress`: the whole suite STRESS_RUNS times in a row (default 5) while a
# load generator keeps every core busy, as on a shared CI machine. Any red run fails it.
# The load is one busy-loop process per core (stress-ng --cpu N where installed): the
# point is CPU contention with the tests' own servers, not a benchmark.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
runs=${STRESS_RUNS:-5}
cores=$(nproc)
load_pids=()
stop_load() { for pid in "${load_pids[@]}"; do kill "$pid" 2>/dev/null || true; done; }
trap stop_load EXIT
if command -v stress-ng >/dev/null; then
    stress-ng --cpu "$cores" --quiet & load_pids+=($!)
else
    for _ in $(seq "$cores"); do
        python3 -c 'while True: pass' & load_pids+=($!)
    done
fi
echo "test-stress: $runs runs, $cores busy-loop load processes"
passed=0
for run in $(seq "$runs"); do
    start=$(date +%s)
    if make test PYTEST_ARGS="${PYTEST_ARGS:-}" > ".run/stress-$run.log" 2>&1; then
        passed=$((passed + 1))
        verdict=passed
    else
        verdict=FAILED
    fi
    # The suite's summary, then the Valkey smoke run's.
    summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed)|(passed|failed|error).* in [0-9.]+s' ".run/stress-$run.log" | paste -sd ';' || true)
    echo "run $run/$runs: $verdict in $(( $(date +%s) - start )) s: $summary"
done
echo "test-stress: $passed of $runs runs passed (logs: .run/stress-N.log)"
[ "$passed" -eq "$runs" ]
