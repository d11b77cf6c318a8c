#!/usr/bin/env bash
# test_generate.sh: generate's command line: every bad input is one error line and a non-zero
# exit, checked before the GPU is touched; with a GPU, samples from the fixtures' weights.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
UNCOND=dev/fixtures/unet_conv_resample.safetensors  # unconditional, eps
SIGMA=dev/fixtures/unet_adm.safetensors             # 10 classes (no null class), learned variance

case_begin "a .pt: the flags its tensors cannot give are asked for, those they contradict refused, before the GPU (an upsampler's sizes too)"
PT=dev/fixtures/pt/unet_adm_fp16.pt
expect_fail ./generate --checkpoint "$PT" --image_size 8
expect_grep "num_head_channels or --num_heads: a state_dict does not say" "$LAST_ERR"
expect_fail ./generate --checkpoint "$PT" --num_head_channels 16
expect_grep "image_size: a state_dict does not say the images' size" "$LAST_ERR"
expect_fail ./generate --checkpoint "$PT" --image_size 8 --num_head_channels 16 --num_res_blocks 2
expect_grep "num_res_blocks 2 does not fit its tensors" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --image_size 8
expect_grep "holds its model's configuration: --image_size and the other model flags are for files without it" "$LAST_ERR"
expect_fail ./generate --checkpoint "$PT" --image_size 8 --image_size 16
expect_grep "image_size is given twice" "$LAST_ERR"
UP_PT=dev/fixtures/pt/unet_super_res_fp16.pt
expect_fail ./generate --checkpoint "$UP_PT" --image_size 8 --num_head_channels 16
expect_grep "large_size and --small_size: a UNet of 6 input channels is an upsampler" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UP_PT" --large_size 8 --small_size 4 --num_head_channels 16
expect_grep "an upsampler \(SuperResModel, 4x4 to 8x8\)" "$LAST_OUT"
expect_grep "give the images to upsample with --low_res FILE.bin" "$LAST_ERR"

case_begin "the command-line convention: the usage on stdout and exit 0 for no arguments, -h and --help; the docs' copy is the same"
expect_usage ./generate --num 3
expect_grep "^usage: generate --checkpoint" "$TEST_TMP/generate.help"

case_begin "usage errors: one line ending in (see --help), exit 2; an unknown option is named as such"
expect_exit 2 ./generate --bogus
[ "$(cat "$LAST_ERR")" = "generate: error: unknown option --bogus (see --help)" ] || case_fail "unknown option: $(cat "$LAST_ERR")"
expect_exit 2 ./generate --checkpoint "$UNCOND" --bogus=1
[ "$(cat "$LAST_ERR")" = "generate: error: unknown option --bogus (see --help)" ] || case_fail "unknown option=value: $(cat "$LAST_ERR")"
expect_exit 2 ./generate -x
[ "$(cat "$LAST_ERR")" = "generate: error: unknown option -x (see --help)" ] || case_fail "unknown short option: $(cat "$LAST_ERR")"
while IFS= read -r args; do
    # shellcheck disable=SC2086
    expect_exit 2 ./generate $args
    grep -q "^generate: error: .* (see --help)$" "$LAST_ERR" || case_fail "no usage error line for: $args"
done <<LIST
--num 4
--checkpoint $UNCOND --sampler euler
--checkpoint $UNCOND --steps 0
--checkpoint $UNCOND --eta 2
--checkpoint $UNCOND --weights best
--checkpoint $UNCOND --num
--checkpoint $UNCOND --frobnicate 1
--checkpoint $UNCOND --bench 0
--checkpoint $UNCOND --eval x.safetensors
--checkpoint $UNCOND stray
--checkpoint $UNCOND --clip_denoised maybe
--checkpoint $UNCOND --nll x.bin --clip_denoised True
LIST
expect_exit 2 ./generate --checkpoint "$UNCOND" --num
expect_grep "needs a value" "$LAST_ERR"

case_begin "an EDM checkpoint (precond edm): ddpm, --respacing, --spacing, a classifier and --nll refused before the GPU; a bad precond"
with_metadata() {  # with_metadata IN OUT KEY VALUE: IN's tensors with KEY set to VALUE in the metadata
    python3 - "$@" <<'PY'
import json, struct, sys
src, dst, key, value = sys.argv[1:]
b = open(src, "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h = json.loads(b[8:8 + n])
h["__metadata__"][key] = value
j = json.dumps(h).encode()
j += b" " * (-len(j) % 8)
open(dst, "wb").write(struct.pack("<Q", len(j)) + j + b[8 + n:])
PY
}
with_metadata "$UNCOND" "$TEST_TMP/edm.safetensors" precond edm
for args in "--sampler ddpm" "--respacing 10" "--spacing trailing" "--nll x.bin" "--classifier $UNCOND"; do
    # shellcheck disable=SC2086
    expect_exit 2 ./generate --checkpoint "$TEST_TMP/edm.safetensors" $args
    expect_grep "^generate: error: an EDM model \(precond edm\)" "$LAST_ERR"
done
with_metadata "$UNCOND" "$TEST_TMP/precond.safetensors" precond ve
expect_fail ./generate --checkpoint "$TEST_TMP/precond.safetensors"
expect_grep "metadata precond 've' is neither ddpm nor edm" "$LAST_ERR"

case_begin "runtime errors (files, the checkpoint, the GPU): one error line each, exit 1"
expect_exit 1 ./generate --checkpoint "$TEST_TMP/none"
expect_exit 1 ./generate --checkpoint "$UNCOND" --guidance 3
expect_grep "unconditional" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --class 1
expect_fail ./generate --checkpoint "$SIGMA" --class 10
expect_grep "0\.\.9" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --guidance 2
expect_grep "no null class" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --sampler ddpm --respacing 600,600
expect_grep "respacing '600,600' keeps no steps" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --spacing linspace --steps 1
expect_grep "spacing linspace: 1 steps do not fit" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --sigma_small True --sampler ddpm
expect_grep "sigma_small chooses a fixed variance: .*unet_adm.safetensors learns its own" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --sigma_small maybe
expect_grep "sigma_small maybe: " "$LAST_ERR"
expect_fail ./generate --checkpoint "$PT" --image_size 8 --num_head_channels 16 --sigma_small True
expect_grep "sigma_small chooses a fixed variance: .*unet_adm_fp16.pt learns its own" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --spacing trailing --respacing 10
expect_exit 2 ./generate --checkpoint "$UNCOND" --spacing middle
expect_exit 2 ./generate --checkpoint "$SIGMA" --sampler dpm++ --respacing 10
expect_grep "goes with neither --sampler dpm\+\+ nor --steps" "$LAST_ERR"
# Karras levels: with ddim, dpm++ and euler_a (its own); their values checked before the GPU
expect_exit 2 ./generate --checkpoint "$UNCOND" --schedule exponential
expect_grep "schedule must be karras, not 'exponential'" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --schedule karras --sampler ddpm
expect_grep "schedule karras goes with --sampler ddim, dpm\+\+, euler_a or heun" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --sampler euler_a --respacing 10
expect_grep "places the steps itself" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --sigma_max 80
expect_grep "need --schedule karras, or --sampler euler_a or heun" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --schedule karras --sigma_min 5 --sigma_max 1
expect_grep "sigma_min 5 is not below --sigma_max 1" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --schedule karras --rho 0
expect_grep "rho takes a number in 0.1..100, not '0'" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --sampler dpm++ --s_churn 40
expect_grep "heun's churn: they need --sampler heun" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --sampler heun --s_noise -1
expect_grep "s_noise takes a number in 0..10" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --sampler euler_a --sigma_min 1000
expect_grep "Karras levels from sigma_min 1000 to sigma_max [0-9.]+ are empty \(its own range: " "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --steps 999
grep -q 'see --help' "$LAST_ERR" && case_fail "a checkpoint's error reads as a usage error: $(cat "$LAST_ERR")"
head -c 5000 "$UNCOND" >"$TEST_TMP/cut.safetensors"
expect_fail ./generate --checkpoint "$TEST_TMP/cut.safetensors"
expect_grep "truncated" "$LAST_ERR"
expect_absent samples/grid.png

case_begin "classifier guidance: a bad pairing or flag is one error line, before the GPU"
CLASSIFIER=dev/fixtures/unet_classifier_attention.safetensors  # 5 classes, 8x8
expect_exit 2 ./generate --checkpoint "$UNCOND" --classifier_scale 3
expect_grep "classifier_scale is classifier guidance's: it needs --classifier" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --classifier_depth 2
expect_grep "classifier_depth is classifier guidance's: it needs --classifier" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --nll "$TEST_TMP/none.bin"
expect_fail ./generate --checkpoint "$CLASSIFIER"
expect_grep "is a noisy classifier \(classifier_pool attention\), not a diffusion model: give it with --classifier" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --classifier "$UNCOND"
expect_grep "is a diffusion model, not a noisy classifier" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --classifier "$CLASSIFIER"
expect_grep "knows 10 classes and the classifier .* 5: they must be the same classes" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --class 5
expect_grep "class in 0\.\.4" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --classifier_pool adaptive
expect_grep "holds its model's configuration" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --guidance 2
expect_grep "unconditional: --guidance needs a class-conditional model" "$LAST_ERR"
expect_absent samples/grid.png

case_begin "an upsampler (SuperResModel): --low_res or --upsampler missing, of the wrong size, or of another model is one line"
UPSAMPLER=dev/fixtures/unet_super_res.safetensors  # 8x8 from 4x4
./prepare_data --synthetic shapes --size 8 --count 3 --output "$TEST_TMP/low8.bin" --quiet >/dev/null
expect_fail ./generate --checkpoint "$UPSAMPLER" --num 2
expect_grep "is an upsampler \(SuperResModel, 4x4 to 8x8\): give the images to upsample with --low_res FILE.bin" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UPSAMPLER" --low_res "$TEST_TMP/low8.bin"
expect_grep "holds 8x8 images of 3 channels; .* upsamples 4x4 of 3" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --low_res "$TEST_TMP/low8.bin"
expect_grep "low_res is for an upsampler; .* is none" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UPSAMPLER" --low_res "$TEST_TMP/low8.bin" --eval x.safetensors --output y.safetensors
expect_exit 2 ./generate --checkpoint "$UNCOND" --up_steps 10
expect_grep "up_steps is the cascade's: it needs --upsampler" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UPSAMPLER" --upsampler "$UPSAMPLER" --low_res "$TEST_TMP/low8.bin"
expect_fail ./generate --checkpoint "$UNCOND" --upsampler "$UNCOND"
expect_grep "is no upsampler \(no small_size" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --upsampler "$UPSAMPLER"
expect_grep "upsamples 4x4 images; .* makes 8x8" "$LAST_ERR"

# safetensors files for --eval, written with the standard library: NAME=DTYPE:SHAPE:VALUE ...
write_inputs() {
    python3 - "$@" <<'PY'
import json, struct, sys
path, tensors, header, blobs, at = sys.argv[1], sys.argv[2:], {}, b"", 0
for spec in tensors:
    name, rest = spec.split("=")
    dtype, shape, value = rest.split(":")
    shape = [int(d) for d in shape.split(",")]
    n = 1
    for d in shape: n *= d
    data = struct.pack("<%d%s" % (n, "f" if dtype == "F32" else "q"), *([float(value)] * n if dtype == "F32" else [int(value)] * n))
    header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
    blobs += data; at += len(data)
h = json.dumps(header).encode(); h += b" " * (-len(h) % 8)
open(path, "wb").write(struct.pack("<Q", len(h)) + h + blobs)
PY
}
case_begin "--eval: bad inputs are one error line each, before the GPU"
write_inputs "$TEST_TMP/no_x.safetensors" t=I64:2:5
write_inputs "$TEST_TMP/shape.safetensors" x=F32:2,3,4,8:0.5 t=I64:2:5
write_inputs "$TEST_TMP/late.safetensors" x=F32:2,3,8,8:0.5 t=I64:2:1000
write_inputs "$TEST_TMP/no_y.safetensors" x=F32:2,3,8,8:0.5 t=I64:2:5
for f in no_x shape late; do
    expect_fail ./generate --checkpoint "$UNCOND" --eval "$TEST_TMP/$f.safetensors" --output "$TEST_TMP/out.safetensors"
done
expect_grep "outside 0..999" "$LAST_ERR"
expect_fail ./generate --checkpoint "$SIGMA" --eval "$TEST_TMP/no_y.safetensors" --output "$TEST_TMP/out.safetensors"
expect_grep "y must hold" "$LAST_ERR"
write_inputs "$TEST_TMP/no_low.safetensors" x=F32:2,3,8,8:0.5 t=I64:2:5 y=I64:2:1
expect_fail ./generate --checkpoint "$UPSAMPLER" --eval "$TEST_TMP/no_low.safetensors" --output "$TEST_TMP/out.safetensors"
expect_grep "the model is an upsampler: low_res must be \[2, 3, 4, 4\] \(NCHW\)" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --eval "$TEST_TMP/no_y.safetensors"
expect_absent "$TEST_TMP/out.safetensors"

case_begin "--eval: an x of 2^32 + 2 images is a shape error, said before any size is allocated"
# x [2^32 + 2, 3, 2, 2] U8: a sparse file of 51 GB whose floats would take 206 GB of host memory.
python3 - "$TEST_TMP/huge.safetensors" <<'PY'
import json, struct, sys
n = (2**32 + 2) * 3 * 2 * 2
h = json.dumps({"x": {"dtype": "U8", "shape": [2**32 + 2, 3, 2, 2], "data_offsets": [0, n]},
                "t": {"dtype": "I64", "shape": [1], "data_offsets": [n, n + 8]}}).encode()
h += b" " * (-len(h) % 8)
with open(sys.argv[1], "wb") as f:
    f.write(struct.pack("<Q", len(h)) + h)
    f.truncate(8 + len(h) + n + 8)
PY
expect_fail ./generate --checkpoint "$UNCOND" --eval "$TEST_TMP/huge.safetensors" --output "$TEST_TMP/out.safetensors"
expect_grep "x must be \[N, 3, 8, 8\] \(NCHW\) with N from 1 to 65536" "$LAST_ERR"
rm -f "$TEST_TMP/huge.safetensors"

case_begin "--nll: a dataset that does not fit the model, or a bad request, is one error line, before the GPU"
./prepare_data --synthetic shapes --size 8 --count 6 --output "$TEST_TMP/s8.bin" --quiet >/dev/null
./prepare_data --synthetic shapes --size 16 --count 2 --output "$TEST_TMP/s16.bin" --quiet >/dev/null
expect_fail ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/missing.bin"
expect_fail ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s16.bin"
expect_grep "holds 16x16 images of 3 channels; .* takes 8x8 of 3" "$LAST_ERR"
expect_exit 2 ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s8.bin" --sampler ddpm
expect_grep "nll measures a likelihood" "$LAST_ERR"
expect_fail ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s8.bin" --respacing 600,600
expect_grep "respacing '600,600' keeps no steps" "$LAST_ERR"

if nvidia-smi -L >/dev/null 2>&1; then
    case_begin "--nll: bits per dimension and their standard error, the same again for the same seed; respaced; learned variance"
    expect_ok ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s8.bin" --respacing 20 --num 6 --batch 4
    expect_grep '^bits/dim [0-9]+\.[0-9]+ \+- [0-9]+\.[0-9]+ \(standard error of the mean over 6 images' "$LAST_OUT"
    grep '^bits/dim' "$LAST_OUT" >"$TEST_TMP/nll_first"
    expect_ok ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s8.bin" --respacing 20 --num 6 --batch 4
    grep '^bits/dim' "$LAST_OUT" | cmp -s - "$TEST_TMP/nll_first" || case_fail "the same seed gave another likelihood"
    expect_ok ./generate --checkpoint "$SIGMA" --nll "$TEST_TMP/s8.bin" --num 3
    expect_grep '^bits/dim [0-9]+\.[0-9]+ \+- ' "$LAST_OUT"

    case_begin "samples from the fixture's weights: PNGs and a grid, the same for the same seed and batch"
    for sampler in ddim ddpm dpm++; do
        expect_ok ./generate --checkpoint "$UNCOND" --sampler $sampler --num 5 --batch 2 --out "$TEST_TMP/$sampler"
        [ -f "$TEST_TMP/$sampler/000004.png" ] && [ -f "$TEST_TMP/$sampler/grid.png" ] || case_fail "$sampler: files missing"
    done
    expect_ok ./generate --checkpoint "$UNCOND" --num 5 --batch 2 --out "$TEST_TMP/again"
    cmp -s "$TEST_TMP/ddim/000003.png" "$TEST_TMP/again/000003.png" || case_fail "the same seed gave another image"
    expect_ok ./generate --checkpoint "$UNCOND" --sampler ddpm --sigma_small False --num 5 --batch 2 --out "$TEST_TMP/large"
    cmp -s "$TEST_TMP/ddpm/000003.png" "$TEST_TMP/large/000003.png" || case_fail "ddpm's default is not the large variance"
    expect_ok ./generate --checkpoint "$UNCOND" --sampler ddpm --sigma_small True --num 5 --batch 2 --out "$TEST_TMP/small"
    cmp -s "$TEST_TMP/ddpm/000003.png" "$TEST_TMP/small/000003.png" && case_fail "--sigma_small True changed nothing"
    expect_ok ./generate --checkpoint "$UNCOND" --num 4 --batch 2 --bench 2 --out "$TEST_TMP/bench"
    expect_grep "images/s" "$LAST_OUT"
    expect_absent "$TEST_TMP/bench"

    case_begin "classifier guidance: samples of an unconditional model guided to the classes in turn; scale 0 samples as unguided"
    for sampler in ddpm ddim dpm++; do
        expect_ok ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --classifier_scale 10 --sampler $sampler --num 5 \
            --batch 3 --out "$TEST_TMP/guided_$sampler"
        expect_grep "classifier guidance 10" "$LAST_OUT"
        [ -f "$TEST_TMP/guided_$sampler/000004.png" ] || case_fail "$sampler: files missing"
    done
    cmp -s "$TEST_TMP/ddim/000003.png" "$TEST_TMP/guided_ddim/000003.png" && case_fail "classifier guidance changed nothing"
    expect_ok ./generate --checkpoint "$UNCOND" --classifier "$CLASSIFIER" --classifier_scale 0 --num 5 --batch 2 --out "$TEST_TMP/scale0"
    cmp -s "$TEST_TMP/ddim/000003.png" "$TEST_TMP/scale0/000003.png" || case_fail "scale 0 gave another image than no classifier"

    case_begin "--eval on a fixture's inputs reproduces PyTorch's output (BF16 build: 2e-2)"
    for fixture in dev/fixtures/*.safetensors; do
        expect_ok ./generate --checkpoint "$fixture" --eval "$fixture" --output "$TEST_TMP/eval.safetensors"
        python3 - "$fixture" "$TEST_TMP/eval.safetensors" <<'PY' || case_fail "$fixture: output differs"
import json, math, struct, sys
def read(path, name):
    b = open(path, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; h = json.loads(b[8:8 + n]); t = h[name]
    s, e = t["data_offsets"]; return struct.unpack("<%df" % ((e - s) // 4), b[8 + n + s:8 + n + e])
ref, out = read(sys.argv[1], "out"), read(sys.argv[2], "out")
err = math.sqrt(sum((a - b) ** 2 for a, b in zip(out, ref)) / sum(b * b for b in ref))
print("  %s: relative error %.2e" % (sys.argv[1], err)); sys.exit(0 if len(out) == len(ref) and err <= 2e-2 else 1)
PY
    done

    case_begin "--eval of torch.save's .pt of a fixture's weights (zip and legacy) gives the safetensors' output, bit for bit"
    for name in seed adm; do
        flags=(--image_size 8 --num_head_channels 16)
        [ $name = adm ] && flags+=(--use_new_attention_order True --learn_sigma True --class_cond True)
        expect_ok ./generate --checkpoint "dev/fixtures/unet_$name.safetensors" --eval "dev/fixtures/unet_$name.safetensors" --output "$TEST_TMP/st.safetensors"
        for kind in fp32 fp32_legacy; do
            expect_ok ./generate --checkpoint "dev/fixtures/pt/unet_${name}_$kind.pt" "${flags[@]}" --eval "dev/fixtures/unet_$name.safetensors" \
                --output "$TEST_TMP/pt.safetensors"
            expect_grep "inferred from the tensors: num_channels 32 channel_mult 1,1" "$LAST_OUT"
            python3 - "$TEST_TMP/st.safetensors" "$TEST_TMP/pt.safetensors" <<'PY' || case_fail "unet_${name}_$kind.pt: another output than the safetensors'"
import json, struct, sys
def out_bytes(path):  # the tensor's bytes (the metadata names the checkpoint read)
    b = open(path, "rb").read(); n = struct.unpack("<Q", b[:8])[0]; s, e = json.loads(b[8:8 + n])["out"]["data_offsets"]
    return b[8 + n + s:8 + n + e]
sys.exit(0 if out_bytes(sys.argv[1]) == out_bytes(sys.argv[2]) else 1)
PY
        done
    done
else
    case_begin "without a GPU: one clear error line, exit 1, and no output folder or file left"
    expect_exit 1 ./generate --checkpoint "$UNCOND" --num 2 --out "$TEST_TMP/out"
    expect_grep "^generate: error: no NVIDIA GPU or driver found" "$LAST_ERR"
    expect_absent "$TEST_TMP/out"
    expect_fail ./generate --checkpoint "$UNCOND" --eval "$UNCOND" --output "$TEST_TMP/eval.safetensors"
    expect_absent "$TEST_TMP/eval.safetensors"
    expect_exit 1 ./generate --checkpoint "$UNCOND" --nll "$TEST_TMP/s8.bin"
    expect_grep "^generate: error: no NVIDIA GPU or driver found" "$LAST_ERR"
    ls "$TEST_TMP" | grep -q '\.tmp\.' && case_fail "a temporary file was left: $(ls "$TEST_TMP")"
fi
case_summary
