#!/usr/bin/env bash
# test_layout.sh: the shape of the source tree, as DESIGN.md sets it: no circle among the project's
# own #include "..." (a header that needs another's types includes it, never the other way round
# too), no source file over 512 KB, and each .cuh that train_unet.cu includes opens with its
# "// NAME.cuh: what it is" line. Reads the files only: no build, no GPU. The checks first run on
# small trees made here that break each rule, so a check that cannot fail fails.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
T=$TEST_TMP
MAX_BYTES=524288  # 512 KB

# The source files under ROOT with the given name endings (sorted, relative to ROOT), leaving out
# build outputs, run folders and hidden folders (.git, virtual environments).
source_files() {
    local root=$1; shift
    local names=() e
    for e in "$@"; do names+=(${names[0]+-o} -name "*.$e"); done
    (cd "$root" && find . \( -path ./build -o -path ./run -o -path ./samples -o \( -name '.?*' -type d \) \) -prune \
        -o -type f \( "${names[@]}" \) -print | sed 's|^\./||' | LC_ALL=C sort)
}

# Prints the first circle in ROOT's include graph as "a.h -> b.h -> a.h" and returns 1, or prints
# nothing. An include names a file relative to the including file's folder, else to ROOT (-I.);
# one that names neither (a system header in quotes, a generated file) is no edge.
include_cycle() {
    local root=$1 list
    list=$(source_files "$root" c h cu cuh) || return 2
    [ -n "$list" ] || return 0
    # shellcheck disable=SC2016
    (cd "$root" && printf '%s\n' "$list" | tr '\n' '\0' | xargs -0 awk '
        function normal(p,   parts, n, i, out, k, stack) {
            n = split(p, parts, "/"); k = 0
            for (i = 1; i <= n; i++) {
                if (parts[i] == "" || parts[i] == ".") continue
                if (parts[i] == ".." && k > 0 && stack[k] != "..") { k--; continue }
                stack[++k] = parts[i]
            }
            out = ""
            for (i = 1; i <= k; i++) out = out (i > 1 ? "/" : "") stack[i]
            return out
        }
        function exists(p,   line, r) { r = (getline line < p); close(p); return r >= 0 }
        function visit(n,   list, k, i, m, j) {
            color[n] = 1; path[++depth] = n; at[n] = depth
            k = split(adj[n], list, "\n")
            for (i = 1; i <= k; i++) {
                m = list[i]
                if (m == "") continue
                if (color[m] == 1) {
                    cycle = ""
                    for (j = at[m]; j <= depth; j++) cycle = cycle path[j] " -> "
                    cycle = cycle m
                    return 1
                }
                if (color[m] == 0 && visit(m)) return 1
            }
            color[n] = 2; depth--
            return 0
        }
        FNR == 1 { if (!(FILENAME in seen)) { seen[FILENAME] = 1; order[++files] = FILENAME } }
        /^[ \t]*#[ \t]*include[ \t]*"/ {
            name = $0; sub(/^[^"]*"/, "", name); sub(/".*$/, "", name)
            dir = FILENAME; if (!sub(/\/[^\/]*$/, "", dir)) dir = "."
            to = normal(dir "/" name)
            if (!exists(to)) { to = normal(name); if (!exists(to)) next }
            if (!((FILENAME, to) in edge)) { edge[FILENAME, to] = 1; adj[FILENAME] = adj[FILENAME] to "\n" }
            if (!(to in seen)) { seen[to] = 1; order[++files] = to }
        }
        END {
            for (f = 1; f <= files; f++)
                if (color[order[f]] == 0 && visit(order[f])) { print cycle; exit 1 }
        }')
}

# Prints "PATH: N bytes" for each source file under ROOT over MAX_BYTES; returns 1 if any.
big_files() {
    local root=$1 f bytes found=0
    while IFS= read -r f; do
        bytes=$(wc -c <"$root/$f")
        if [ "$bytes" -gt "$MAX_BYTES" ]; then echo "$f: $bytes bytes"; found=1; fi
    done < <(source_files "$root" c h cu cuh py sh)
    return $found
}

# Prints each .cuh that ROOT/train_unet.cu includes whose first line is not "// NAME.cuh: ..."
# (or that is missing); returns 1 if any.
cuh_without_heading() {
    local root=$1 name found=0
    while IFS= read -r name; do
        if [ ! -f "$root/$name" ]; then echo "$name: missing"; found=1
        elif ! head -n 1 "$root/$name" | grep -qE "^// ${name//./\\.}: ."; then
            echo "$name: its first line is \"$(head -n 1 "$root/$name" | cut -c1-60)\""; found=1
        fi
    done < <(sed -nE 's/^[ \t]*#[ \t]*include[ \t]*"([^"]+\.cuh)".*/\1/p' "$root/train_unet.cu")
    return $found
}

case_begin "the checks catch a circle, a file over 512 KB and a .cuh without its first line"
mkdir -p "$T/bad/sub" "$T/good/sub"
printf '#include "b.h"\n' >"$T/bad/a.h"
printf '#include <stdio.h>\n#include "sub/c.h"\n' >"$T/bad/b.h"
printf '// c.h\n  #  include "../a.h"  // back to the top: a circle of three\n' >"$T/bad/sub/c.h"
printf '#include "a.h"\n#include "missing.h"\n' >"$T/bad/main.c"
out=$(include_cycle "$T/bad") && case_fail "a circle a.h -> b.h -> sub/c.h -> a.h passed"
[ "$out" = "a.h -> b.h -> sub/c.h -> a.h" ] || case_fail "the circle named as \"$out\""
printf '#include "b.h"\n' >"$T/good/a.h"  # the same tree without the way back
printf '#include "sub/c.h"\n' >"$T/good/b.h"
printf '#include "d.h"\n' >"$T/good/sub/c.h"   # sub/d.h, found next to sub/c.h
printf '// d.h\n' >"$T/good/sub/d.h"
printf '#include "a.h"\n#include "sub/c.h"\n#include "b.h"\n' >"$T/good/main.c"
out=$(include_cycle "$T/good") || case_fail "a tree without a circle failed: $out"
head -c $((MAX_BYTES + 1)) /dev/zero | tr '\0' '\n' >"$T/bad/huge.py"
head -c "$MAX_BYTES" /dev/zero | tr '\0' '\n' >"$T/good/huge.py"
mkdir -p "$T/good/build" && head -c $((MAX_BYTES + 1)) /dev/zero >"$T/good/build/generated.c"  # build/ is not source
out=$(big_files "$T/bad") && case_fail "a file of 512 KB + 1 byte passed"
[ "$out" = "huge.py: $((MAX_BYTES + 1)) bytes" ] || case_fail "the big file named as \"$out\""
out=$(big_files "$T/good") || case_fail "a file of exactly 512 KB (or one in build/) failed: $out"
printf '#include "ok.cuh"  // defines: ...\n#include "bare.cuh"\n#include "gone.cuh"\n' >"$T/bad/train_unet.cu"
printf '// ok.cuh: what it is\n' >"$T/bad/ok.cuh"
printf '#pragma once\n' >"$T/bad/bare.cuh"
out=$(cuh_without_heading "$T/bad") && case_fail "a .cuh without its first line, and a missing one, passed"
printf '%s\n' "$out" | grep -q '^bare.cuh: its first line is "#pragma once"$' || case_fail "bare.cuh not named: $out"
printf '%s\n' "$out" | grep -q '^gone.cuh: missing$' || case_fail "gone.cuh not named: $out"
printf '%s\n' "$out" | grep -q '^ok.cuh' && case_fail "ok.cuh named: $out"

case_begin "no circle among the project's own #include \"...\" (*.c *.h *.cu *.cuh)"
out=$(include_cycle .) || case_fail "include circle: $out"

case_begin "no source file (*.c *.h *.cu *.cuh *.py *.sh) over 512 KB ($MAX_BYTES bytes)"
out=$(big_files .) || while IFS= read -r line; do case_fail "over 512 KB: $line"; done <<<"$out"

case_begin "each .cuh that train_unet.cu includes opens with \"// NAME.cuh: what it is\""
out=$(cuh_without_heading .) || while IFS= read -r line; do case_fail "$line"; done <<<"$out"

case_summary
