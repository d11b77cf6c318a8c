#!/usr/bin/env bash
# test_corpus.sh: the committed test corpus (dev/test/corpus, see its README.md) through the
# programs that read it: every good_* file is accepted, every bad_* file refused with exactly one
# error line that names the file.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
train() { ./train_unet --run_dir "$TEST_TMP/run" "$@"; }  # a run folder of its own (see test_train_cli.sh)
TRAIN=train
MODEL_8X8=(--image_size 8 --channel_mult "1,2" --attention_resolutions 4)  # the corpus datasets hold 8x8 images

case_begin "dataset corpus: train_unet --dry_run accepts every good_* file"
for f in dev/test/corpus/dataset/good_*; do
    expect_ok "$TRAIN" --dry_run --data "$f" "${MODEL_8X8[@]}"
done

case_begin "dataset corpus: train_unet --dry_run refuses every bad_* file with one error line naming it"
for f in dev/test/corpus/dataset/bad_*; do
    expect_fail "$TRAIN" --dry_run --data "$f" "${MODEL_8X8[@]}"
    if [ -s "$LAST_ERR" ] && ! grep -qF "dataset $f" "$LAST_ERR"; then
        case_fail "the error for $f does not name it: $(cat "$LAST_ERR")"
    fi
done
case_begin "safetensors corpus: generate and a resume refuse every bad_* file with one error line naming it"
for f in dev/test/corpus/safetensors/bad_*; do
    expect_fail ./generate --checkpoint "$f"
    grep -qF "$f" "$LAST_ERR" || case_fail "the error for $f does not name it: $(cat "$LAST_ERR")"
    dir=$TEST_TMP/resume_$(basename "$f" .safetensors); mkdir -p "$dir"; cp "$f" "$dir/model.safetensors"
    expect_fail "$TRAIN" --dry_run --resume_checkpoint "$dir"
    grep -qF "$dir/model.safetensors" "$LAST_ERR" || case_fail "the error for $dir does not name it: $(cat "$LAST_ERR")"
done

case_begin ".pt corpus: generate refuses every bad_* file with one error line naming it (nothing in it is run)"
for f in dev/test/corpus/pt/bad_*; do
    expect_fail ./generate --checkpoint "$f"
    grep -qF "$f" "$LAST_ERR" || case_fail "the error for $f does not name it: $(cat "$LAST_ERR")"
done

# A checkpoint with one metadata value or one weight changed: python3 rewrites a fixture's header.
edit_fixture() {  # edit_fixture OUT PYTHON: runs PYTHON on the header (dict h) and the data (bytearray d)
    python3 - dev/fixtures/unet_conv_resample.safetensors "$TEST_TMP/$1.safetensors" "$2" <<'PY'
import json, struct, sys
b = open(sys.argv[1], "rb").read()
n = struct.unpack("<Q", b[:8])[0]
h, d = json.loads(b[8:8 + n]), bytearray(b[8 + n:])
exec(sys.argv[3])
t = json.dumps(h).encode()
t += b" " * (-len(t) % 8)
open(sys.argv[2], "wb").write(struct.pack("<Q", len(t)) + t + d)
PY
}
case_begin "checkpoint metadata and weights: every value checked before use, one error line"
for edit in 'diffusion_steps="0"' 'diffusion_steps="-5"' 'diffusion_steps="99999999999"' 'diffusion_steps="12abc"' \
            'num_channels="2147483616"' 'num_channels="-32"' 'channel_mult="1,2,1e308"' 'predict="xstart"' \
            'noise_schedule="quadratic"' 'image_size="abc"' 'num_heads="0"'; do
    key=${edit%%=*} value=${edit#*=}
    edit_fixture bad "h['__metadata__']['$key'] = $value"
    expect_fail ./generate --checkpoint "$TEST_TMP/bad.safetensors" --sampler dpm++
    grep -q "bad.safetensors.*$key" "$LAST_ERR" || case_fail "$edit: $(cat "$LAST_ERR")"
    grep -q "see --help" "$LAST_ERR" && case_fail "$edit: reported as a command-line error: $(cat "$LAST_ERR")"
done
edit_fixture nan 'at = h["time_embed.0.weight"]["data_offsets"][0]; d[at:at + 4] = struct.pack("<f", float("nan"))'
expect_fail ./generate --checkpoint "$TEST_TMP/nan.safetensors"
expect_grep 'NaN or infinite' "$LAST_ERR"
case_summary
