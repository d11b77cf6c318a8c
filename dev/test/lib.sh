# lib.sh: the shell side of the test harness (see check.h). Source it, then:
#   case_begin NAME          start a case
#   expect_fail CMD...       CMD must exit non-zero and print exactly one line on stderr
#   expect_ok CMD...         CMD must exit 0
#   expect_exit N CMD...     CMD must exit with status N, and print exactly one line on stderr when N is not 0
#   expect_grep PATTERN FILE FILE must contain PATTERN (extended regex)
#   expect_absent PATH       PATH must not exist
#   expect_usage PROGRAM ARGS...  the help convention: see below
#   case_summary             prints "N passed, N failed" and returns non-zero on failures
# The last command's stdout and stderr are in $LAST_OUT and $LAST_ERR.
CASE_NAME=""; CASE_FAILED=0; CASES_PASSED=0; CASES_FAILED=0
TEST_TMP=$(mktemp -d); trap 'rm -rf "$TEST_TMP"' EXIT
LAST_OUT=$TEST_TMP/last.out; LAST_ERR=$TEST_TMP/last.err

case_end() {
    [ -n "$CASE_NAME" ] || return 0
    if [ "$CASE_FAILED" = 0 ]; then CASES_PASSED=$((CASES_PASSED + 1)); echo "ok   $CASE_NAME"
    else CASES_FAILED=$((CASES_FAILED + 1)); echo "FAIL $CASE_NAME"; fi
    CASE_NAME=""
}
case_begin() { case_end; CASE_NAME=$1; CASE_FAILED=0; }
case_fail() { CASE_FAILED=1; echo "  $*"; }

expect_fail() {
    "$@" >"$LAST_OUT" 2>"$LAST_ERR"; local rc=$?
    local lines; lines=$(grep -c '' "$LAST_ERR")
    if [ $rc = 0 ]; then case_fail "expected failure, got exit 0: $*"
    elif [ $rc -ge 128 ]; then case_fail "crashed with signal $((rc - 128)): $*"; cat "$LAST_ERR"
    elif [ "$lines" != 1 ]; then case_fail "expected one error line, got $lines: $*"; sed 's/^/    /' "$LAST_ERR"; fi
}
expect_ok() {
    "$@" >"$LAST_OUT" 2>"$LAST_ERR"; local rc=$?
    if [ $rc != 0 ]; then case_fail "expected exit 0, got $rc: $*"; sed 's/^/    /' "$LAST_ERR" | head -5; fi
}
expect_exit() {
    local want=$1; shift
    "$@" >"$LAST_OUT" 2>"$LAST_ERR"; local rc=$?
    local lines; lines=$(grep -c '' "$LAST_ERR")
    if [ $rc != "$want" ]; then case_fail "expected exit $want, got $rc: $*"; sed 's/^/    /' "$LAST_ERR" | head -5
    elif [ "$want" != 0 ] && [ "$lines" != 1 ]; then case_fail "expected one error line, got $lines: $*"; sed 's/^/    /' "$LAST_ERR"; fi
}
expect_grep() { grep -qE -- "$1" "$2" || { case_fail "'$1' not in $(basename "$2"):"; sed 's/^/    /' "$2" | head -5; }; }
expect_absent() { [ ! -e "$1" ] || case_fail "$1 exists but should not"; }
case_summary() { case_end; echo "$CASES_PASSED passed, $CASES_FAILED failed"; [ "$CASES_FAILED" = 0 ]; }

# The command-line convention's help, for PROGRAM (NAME its file name): no arguments, -h, --help,
# and -h or --help after the other ARGS each print exactly what --help prints, on stdout, nothing on
# stderr, exit 0; and the docs' copy of the usage is that text too: the first code block under the
# heading "### `NAME`", which README.md and docs/*.md together must hold exactly once.
expect_usage() {
    local program=$1 name; name=$(basename "$1"); shift
    local help=$TEST_TMP/$name.help copy=$TEST_TMP/$name.copy
    "$program" --help >"$help" 2>"$LAST_ERR" || case_fail "$name --help: exit $?"
    local args
    for args in "" -h --help "$* -h" "$* --help"; do
        # shellcheck disable=SC2086
        expect_exit 0 "$program" $args
        [ -s "$LAST_ERR" ] && case_fail "'$args' wrote on stderr: $(head -1 "$LAST_ERR")"
        cmp -s "$LAST_OUT" "$help" || case_fail "'$args' did not print the usage"
    done
    local heading="### \`$name\`" file found="" count=0 n
    for file in README.md docs/*.md; do
        [ -f "$file" ] || continue
        n=$(grep -cxF -- "$heading" "$file")
        if [ "$n" -gt 0 ]; then count=$((count + n)); found="$found${found:+, }$file"; fi
    done
    if [ "$count" = 0 ]; then case_fail "no heading $heading in README.md or docs/*.md"; return
    elif [ "$count" != 1 ]; then case_fail "heading $heading found $count times (in $found), expected once"; return; fi
    awk -v heading="$heading" '$0 == heading { on = 1; next } on && /^```/ { if (inside) exit; inside = 1; next } inside' \
        "$found" >"$copy"
    [ -s "$copy" ] || { case_fail "no usage block under $heading in $found"; return; }
    diff "$copy" "$help" >"$TEST_TMP/$name.diff" ||
        { case_fail "$found's usage of $name (under $heading) differs from its --help:"; head -8 "$TEST_TMP/$name.diff" | sed 's/^/    /'; }
}
