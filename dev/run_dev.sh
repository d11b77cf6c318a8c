#!/usr/bin/env bash
# run_dev.sh: runs every per-layer GPU check in build/dev (built by `make dev`; this script builds
# nothing), each program's output as it comes, then one table of all their rows and the total
# "N passed, N failed". A program that exits non-zero or without its summary line counts as a
# failure. DEV_SEED=<n> repeats a run's random inputs (each program prints its seed). Without a GPU
# it says so and exits 0.
set -u
cd "$(dirname "$0")/.."
if ! nvidia-smi -L >/dev/null 2>&1; then echo "no GPU: skipped (nvidia-smi finds none)"; exit 0; fi
passed=0; failed=0
rows=$(mktemp); seeds=$(mktemp)
trap 'rm -f "$rows" "$seeds"' EXIT
programs=(build/dev/*)
if [ ! -x "${programs[0]}" ]; then echo "no programs in build/dev: run make dev"; echo "0 passed, 1 failed"; exit 1; fi
precision=""
for p in "${programs[@]}"; do
    [ -x "$p" ] && [ -f "$p" ] || continue
    echo "== $p"
    out=$(mktemp)
    "$p" 2>&1 | tee "$out"
    rc=${PIPESTATUS[0]}
    grep -E '^\| ' "$out" | grep -vE '^\| layer ' >>"$rows"
    grep -E 'random seed' "$out" | sed "s|^|$(basename "$p"): |" >>"$seeds"
    [ -n "$precision" ] || precision=$(sed -nE 's/^dev\/[a-z0-9_]+: ([A-Z0-9]+) build.*/\1/p' "$out" | head -n 1)
    line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
    rm -f "$out"
    if [ -z "$line" ]; then
        echo "FAIL $p: exited $rc without a summary line"
        printf '| %-10s | %-40s | %-8s | %-58s | %8s | %8s | %-4s |\n' "$(basename "$p")" "(crashed: exit $rc)" - - - - FAIL >>"$rows"
        failed=$((failed + 1)); continue
    fi
    read -r np _ nf _ <<<"${line//,/}"
    passed=$((passed + np)); failed=$((failed + nf))
    if [ "$rc" != 0 ] && [ "$nf" = 0 ]; then echo "FAIL $p: exited $rc"; failed=$((failed + 1)); fi
done
echo
echo "== dev checks, ${precision:-?} build (errors: ||gpu - ref|| / ||ref||; times: median of 25, ms)"
cat "$seeds"
printf '| %-10s | %-40s | %-8s | %-58s | %8s | %8s | %-4s |\n' layer shape "fwd err" "grad errs" "fwd ms" "bwd ms" ok
cat "$rows"
echo "$passed passed, $failed failed"
[ "$failed" = 0 ]
