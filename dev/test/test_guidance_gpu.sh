#!/usr/bin/env bash
# test_guidance_gpu.sh: classifier guidance against guided-diffusion's own loops on the same weights
# and noise (scripts/guided_torch.py: classifier_sample.py's cond_fn, p_sample_loop's condition_mean
# with a learned variance, ddim_sample_loop's condition_score; both networks in PyTorch float32, TF32
# off), random networks at its released 64x64 flags, at a scale where guidance moves the images by
# 30 levels or more: generate of the FP32 build within 0.3 levels on average, that of this build
# (BF16) no further than PyTorch's own loop under bfloat16 autocast lands from its float32 one.
# Needs PyTorch (skipped with one line without it) and build/test/generate_fp32.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
if ! python3 -c "import torch" 2>/dev/null; then
    echo "skipped: classifier guidance against guided-diffusion's loops needs PyTorch"
    case_summary; exit
fi
SCALE=300
python3 scripts/guided_torch.py make "$TEST_TMP/nets" >/dev/null || { echo "guided_torch.py make failed"; exit 1; }
read -ra FLAGS <"$TEST_TMP/nets/flags"
BUILD=$(./generate --version | grep -o 'built with [A-Z0-9]*' | cut -d' ' -f3)
for sampler in ddim ddpm; do
    for build in ./generate build/test/generate_fp32; do
        out=$TEST_TMP/${sampler}_$(basename "$build")
        "$build" "${FLAGS[@]}" --sampler $sampler --steps 25 --classifier_scale $SCALE --num 8 --batch 8 --out "$out" \
            >"$out.log" 2>&1 || { echo "$build failed: $(tail -1 "$out.log")"; exit 1; }
    done
done
python3 - "$TEST_TMP" "$SCALE" >"$TEST_TMP/compare" <<'PY' || { cat "$TEST_TMP/compare"; exit 1; }
import argparse, sys
sys.path.insert(0, "scripts")
import guided_torch
for sampler in ("ddim", "ddpm"):
    guided_torch.compare(argparse.Namespace(dir=f"{sys.argv[1]}/nets", out=[f"{sys.argv[1]}/{sampler}_{b}" for b in ("generate_fp32", "generate")],
                                            sampler=sampler, steps=25, classifier_scale=float(sys.argv[2]), num=8, seed=0,
                                            precise=False, autocast=True))
PY
sed 's|^[^ ]*/||' "$TEST_TMP/compare" >"$TEST_TMP/lines"
cat "$TEST_TMP/lines"

# The number before "levels" after WORDS on the comparison's first line that starts with START.
levels() { grep -E "^$1" "$TEST_TMP/lines" | head -1 | sed -E "s/.*$2 ([0-9.]+) levels.*/\1/"; }
at_most() { awk -v a="$1" -v b="$2" 'BEGIN { exit !(a != "" && b != "" && a + 0 <= b + 0) }'; }
for sampler in ddim ddpm; do
    case_begin "$sampler, 25 steps, classifier scale $SCALE: the FP32 build within 0.3 levels of guided-diffusion's loop, which guidance moved by 30 or more"
    fp32=$(levels "${sampler}_generate_fp32:" mean) moved=$(levels "${sampler}_generate_fp32:" "moved the reference by")
    at_most "$fp32" 0.3 || case_fail "FP32 build: mean $fp32 levels"
    at_most 30 "$moved" || case_fail "guidance moved the reference by $moved levels only"
    if [ "$BUILD" = BF16 ]; then
        case_begin "$sampler, 25 steps, classifier scale $SCALE: the BF16 build no further from it than PyTorch's own loop under bfloat16 autocast"
        bf16=$(levels "${sampler}_generate:" mean) torch=$(levels "PyTorch under bfloat16 autocast: $sampler " mean)
        at_most "$bf16" "$torch" || case_fail "BF16 build: mean $bf16 levels, PyTorch under bfloat16 autocast $torch"
    fi
done
case_summary
