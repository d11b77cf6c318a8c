#!/usr/bin/env bash
# test_cli.sh: the command-line conventions the five programs share (cli.h): hyphens for
# underscores, the nearest option for an unknown one, --version, help at most 80 columns with each
# default once; and, without a GPU, make's GPU targets and the test runner's GPU mode say so and
# exit 0, and the runner's time limit stops a test that hangs. CPU only.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
T=$TEST_TMP

# A stand-in nvidia-smi that finds no GPU, first on PATH: "no GPU" on any machine.
mkdir -p "$T/no_gpu"
printf '#!/bin/sh\necho "NVIDIA-SMI has failed" >&2\nexit 9\n' >"$T/no_gpu/nvidia-smi"
chmod +x "$T/no_gpu/nvidia-smi"
without_gpu() { PATH="$T/no_gpu:$PATH" "$@"; }

case_begin "a hyphen stands for an underscore in every program's option names"
expect_ok ./train_unet --dry_run --batch-size 8 --num-res-blocks=1 --use-scale-shift-norm --run-dir "$T/run"
expect_grep '^batch_size +8$' "$LAST_OUT"
expect_grep '^num_res_blocks +1$' "$LAST_OUT"
expect_grep '^use_scale_shift_norm +True$' "$LAST_OUT"
expect_ok ./prepare_data --synthetic shapes --count 3 --size 16 --output "$T/tiny.bin" --quiet
expect_exit 2 ./prepare_data --synthetic shapes --keep-duplicates --output "$T/x.bin"
expect_grep 'keep_duplicates applies only to --input' "$LAST_ERR"
expect_exit 2 ./check_shapes --min-pass 101 --classes-in-turn "$T/tiny.bin"
expect_grep '^check_shapes: error: --min_pass takes a number in 0..100' "$LAST_ERR"
expect_ok ./check_shapes --min-pass=0 --classes-in-turn "$T/tiny.bin"

case_begin "an unknown option: one line naming the nearest known one"
expect_exit 2 ./train_unet --batchsize 8
[ "$(cat "$LAST_ERR")" = "train_unet: error: unknown option --batchsize; did you mean --batch_size? (see --help)" ] ||
    case_fail "train_unet: $(cat "$LAST_ERR")"
expect_exit 2 ./train_unet --dry_run --lerning_rate=1
expect_grep '^train_unet: error: unknown option --lerning_rate \(see --help\)$' "$LAST_ERR"  # nothing near: no hint
expect_exit 2 ./generate --checkpont x
expect_grep '^generate: error: unknown option --checkpont; did you mean --checkpoint\? \(see --help\)$' "$LAST_ERR"
expect_exit 2 ./prepare_data --ouptut x.bin
expect_grep '^prepare_data: error: unknown option --ouptut; did you mean --output\? \(see --help\)$' "$LAST_ERR"
expect_exit 2 ./check_shapes --min x.bin
expect_grep '^check_shapes: error: unknown option --min; did you mean --min_pass\? \(see --help\)$' "$LAST_ERR"

case_begin "--version: the version, and for the CUDA programs the precision and GPU code"
for p in train_unet generate evaluate prepare_data check_shapes; do
    expect_exit 0 "./$p" --version
    [ -s "$LAST_ERR" ] && case_fail "$p --version wrote on stderr"
    expect_grep "^$p [0-9]+\.[0-9]+\.[0-9]+" "$LAST_OUT"
done
./train_unet --version >"$T/v" && expect_grep '^built with (BF16|FP32), GPU code (sm|compute)_[0-9]+' "$T/v"
./generate --version >"$T/v" && expect_grep '^built with (BF16|FP32), GPU code (sm|compute)_[0-9]+' "$T/v"
./evaluate --version >"$T/v" && expect_grep '^built with (BF16|FP32), GPU code (sm|compute)_[0-9]+' "$T/v"

case_begin "help: at most 80 columns, every option listed, each default once"
for p in train_unet generate evaluate prepare_data check_shapes; do
    "./$p" --help >"$T/$p.help"
    awk -v p="$p" 'length($0) > 80 { print "  " p ": " length($0) " columns: " $0; bad = 1 } END { exit bad }' "$T/$p.help" ||
        case_fail "$p --help has lines wider than 80 columns"
    expect_grep '^  --version' "$T/$p.help"
done
grep -qE '\[""\]|\(default' "$T/train_unet.help" && case_fail "train_unet --help shows an empty or a doubled default"
for o in verbose min_pass grid count classes_in_turn; do expect_grep "^  --$o" "$T/check_shapes.help"; done

case_begin "check_shapes follows the others: error: lines, -x is an option, usage for no arguments"
expect_usage ./check_shapes "$T/tiny.bin"
expect_exit 2 ./check_shapes -x "$T/tiny.bin"
[ "$(cat "$LAST_ERR")" = "check_shapes: error: unknown option -x (see --help)" ] || case_fail "-x: $(cat "$LAST_ERR")"
expect_exit 1 ./check_shapes "$T/missing.bin"
expect_grep '^check_shapes: error: cannot open .*missing.bin' "$LAST_ERR"
expect_exit 2 ./check_shapes --grid 2.5 "$T/tiny.bin"
expect_grep '^check_shapes: error: --grid takes a whole number' "$LAST_ERR"

case_begin "without a GPU: make dev, make test-gpu and the runners say so once, build nothing and exit 0"
for target in dev test-gpu dev-memcheck; do
    expect_ok without_gpu make -s --no-print-directory "$target"
    [ "$(cat "$LAST_OUT")" = "no GPU: skipped (nvidia-smi finds none)" ] || case_fail "make $target: $(head -3 "$LAST_OUT")"
done
expect_ok without_gpu dev/run_dev.sh
[ "$(cat "$LAST_OUT")" = "no GPU: skipped (nvidia-smi finds none)" ] || case_fail "run_dev.sh: $(head -3 "$LAST_OUT")"
expect_ok without_gpu dev/test/run_tests.sh gpu
expect_grep '^no GPU: skipped' "$LAST_OUT"
count=$(sed -n 's/^no GPU: skipped (nvidia-smi finds none): \([0-9][0-9]*\) GPU tests$/\1/p' "$LAST_OUT")
[ -n "$count" ] && [ "$count" -gt 0 ] || case_fail "run_tests.sh gpu did not say how many GPU tests it skipped"
expect_grep "^0 passed, 0 failed, $count skipped\$" "$LAST_OUT"

case_begin "the test runner stops a test that hangs and names it"
printf '#!/bin/sh\nsleep 600\n' >"$T/hangs.sh"
chmod +x "$T/hangs.sh"
TEST_TIMEOUT=1 dev/test/run_tests.sh "$T/hangs.sh" >"$LAST_OUT" 2>&1 && case_fail "the runner passed a hung test"
expect_grep "^FAIL $T/hangs.sh: timed out after 1 s" "$LAST_OUT"
expect_grep '^0 passed, 1 failed$' "$LAST_OUT"

case_summary
