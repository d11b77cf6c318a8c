#!/usr/bin/env bash
# test_generate.sh: generate's command line: every bad input is one error line and a non-zero
# exit, checked before the GPU is touched; with a GPU, samples from the fixtures' weights.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
UNCOND=dev/fixtures/unet_conv_resample.safetensors  # unconditional, eps
SIGMA=dev/fixtures/unet_adm.safetensors             # 10 classes (no null class), learned variance

case_begin "--help"
expect_ok ./generate --help
expect_grep "^usage: generate --checkpoint" "$LAST_OUT"

case_begin "bad input: one error line each"
expect_fail ./generate
expect_fail ./generate --checkpoint "$TEST_TMP/none"
expect_fail ./generate --checkpoint "$UNCOND" --sampler euler
expect_fail ./generate --checkpoint "$UNCOND" --steps 0
expect_fail ./generate --checkpoint "$UNCOND" --eta 2
expect_fail ./generate --checkpoint "$UNCOND" --weights best
expect_fail ./generate --checkpoint "$UNCOND" --num
expect_fail ./generate --checkpoint "$UNCOND" --frobnicate 1
expect_fail ./generate --checkpoint "$UNCOND" --guidance 3
expect_grep "unconditional" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --class 1
expect_fail ./generate --checkpoint "$SIGMA" --class 10
expect_grep "0\.\.9" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --guidance 2
expect_grep "no null class" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA"
expect_grep "learn_sigma" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --steps 999
head -c 5000 "$UNCOND" >"$TEST_TMP/cut.safetensors"
expect_fail ./generate --checkpoint "$TEST_TMP/cut.safetensors"
expect_grep "truncated" "$LAST_ERR"
expect_absent samples/grid.png

if nvidia-smi -L >/dev/null 2>&1; then
    case_begin "samples from the fixture's weights: PNGs and a grid, the same for the same seed"
    for sampler in ddim ddpm dpm++; do
        expect_ok ./generate --checkpoint "$UNCOND" --sampler $sampler --num 5 --batch 2 --out "$TEST_TMP/$sampler"
        [ -f "$TEST_TMP/$sampler/000004.png" ] && [ -f "$TEST_TMP/$sampler/grid.png" ] || case_fail "$sampler: files missing"
    done
    expect_ok ./generate --checkpoint "$UNCOND" --num 5 --batch 5 --out "$TEST_TMP/again"
    cmp -s "$TEST_TMP/ddim/000003.png" "$TEST_TMP/again/000003.png" || case_fail "another batch size gave another image"
else
    case_begin "without a GPU: one clear error line"
    expect_fail ./generate --checkpoint "$UNCOND" --num 2 --out "$TEST_TMP/out"
    expect_grep "no usable CUDA GPU" "$LAST_ERR"
fi
case_summary
