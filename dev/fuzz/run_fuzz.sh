#!/usr/bin/env bash
# run_fuzz.sh SECONDS TARGET...: runs each libFuzzer target build/fuzz/fuzz_TARGET for SECONDS on
# its seed corpus dev/test/corpus/TARGET, which it only reads: new inputs go to the scratch corpus
# build/fuzz/corpus_TARGET (kept between runs), a failing input to build/fuzz/crash_TARGET/. A
# target with a dictionary dev/fuzz/fuzz_TARGET.dict (the tokens of its format) is given it.
# Prints one line per target, "fuzz_TARGET: N executions, no crash", with libFuzzer's whole output
# in build/fuzz/fuzz_TARGET.log; exits non-zero if any target crashed, leaked or tripped a sanitizer.
cd "$(dirname "$0")/../.." || exit 1
seconds=$1; shift
failed=0
for t in "$@"; do
    log=build/fuzz/fuzz_$t.log crashes=build/fuzz/crash_$t/
    mkdir -p "build/fuzz/corpus_$t" "$crashes"
    dict=()
    [ -f "dev/fuzz/fuzz_$t.dict" ] && dict=(-dict="dev/fuzz/fuzz_$t.dict")
    "build/fuzz/fuzz_$t" -max_total_time="$seconds" -print_final_stats=1 -detect_leaks=1 "${dict[@]}" \
        -artifact_prefix="$crashes" "build/fuzz/corpus_$t" "dev/test/corpus/$t" >"$log" 2>&1
    rc=$?
    execs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log" | tail -n 1)
    if [ "$rc" = 0 ]; then
        echo "fuzz_$t: ${execs:-?} executions, no crash"
    else
        echo "fuzz_$t: FAILED (exit $rc) after ${execs:-?} executions; input in $crashes, end of $log:"
        tail -n 40 "$log" | sed 's/^/    /'
        failed=1
    fi
done
exit "$failed"
