#!/usr/bin/env bash
# run_tests.sh [all|cpu|gpu|TEST...]: runs the test programs and scripts (all of them, the CPU or the
# GPU ones, or those named), then prints the total as "N passed, N failed" (and ", N skipped" when
# GPU tests could not run). Run from the repo root after `make` has built the binaries and
# build/test/*. Each test runs under a time limit, TEST_TIMEOUT seconds (default 1800, far above
# any test's time on a slow machine): a test that hangs fails with its name instead of hanging CI.
set -u
mode=${1:-all}
timeout_s=${TEST_TIMEOUT:-1800}
cpu_tests=(build/test/test_dataset build/test/test_safetensors build/test/test_shapes build/test/test_dataloader
           dev/test/test_prepare_data.sh dev/test/test_train_cli.sh dev/test/test_generate.sh dev/test/test_corpus.sh
           dev/test/test_cli.sh dev/test/test_layout.sh
           build/test/test_reference build/test/test_unet_fixtures build/test/test_checkpoint build/test/test_conv_plan
           build/test/test_sampler build/test/test_sampler_fixture build/test/test_loss_plot build/test/test_metrics
           build/test/test_inception dev/test/test_evaluate.sh build/test/test_rendezvous build/test/test_update_plan
           scripts/test_unet_safetensors.py)
gpu_tests=(build/test/test_dataloader_gpu build/test/test_unet_gpu_fp32 build/test/test_unet_gpu_bf16
           build/test/test_unet_gpu_reference_fp32 build/test/test_unet_gpu_reference_bf16
           build/test/test_sampler_gpu_fp32 build/test/test_sampler_gpu_bf16 dev/test/test_train_gpu.sh
           dev/test/test_train_multi_gpu.sh dev/test/test_evaluate_gpu.sh dev/test/test_guidance_gpu.sh)
case $mode in
    all|cpu|gpu) named=() ;;
    *) named=("$@"); mode=named ;;
esac

passed=0; failed=0; skipped=0
run() {  # runs one test program, adds up its "N passed, N failed" line
    echo "== $1"
    local out; out=$(mktemp)
    timeout --kill-after=10 "$timeout_s" "$1" 2>&1 | tee "$out"
    local rc=${PIPESTATUS[0]}
    local line; line=$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$out" | tail -n 1)
    rm -f "$out"
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then
        echo "FAIL $1: timed out after $timeout_s s (TEST_TIMEOUT)"; failed=$((failed + 1)); return
    fi
    if [ -z "$line" ]; then
        echo "FAIL $1: exited $rc without a summary line"; failed=$((failed + 1)); return
    fi
    local p f; read -r p _ f _ <<<"${line//,/}"
    passed=$((passed + p)); failed=$((failed + f))
    if [ "$rc" != 0 ] && [ "$f" = 0 ]; then echo "FAIL $1: exited $rc"; failed=$((failed + 1)); fi
}

if [ "$mode" = named ]; then
    for t in "${named[@]}"; do run "$t"; done
fi
if [ "$mode" = all ] || [ "$mode" = cpu ]; then
    for t in "${cpu_tests[@]}"; do run "$t"; done
fi
if [ "$mode" = all ] || [ "$mode" = gpu ]; then
    if nvidia-smi -L >/dev/null 2>&1; then
        for t in "${gpu_tests[@]}"; do run "$t"; done
    else
        echo "no GPU: skipped (nvidia-smi finds none): ${#gpu_tests[@]} GPU tests"; skipped=${#gpu_tests[@]}
    fi
fi
if [ "$skipped" -gt 0 ]; then echo "$passed passed, $failed failed, $skipped skipped"
else echo "$passed passed, $failed failed"; fi
[ "$failed" = 0 ]
