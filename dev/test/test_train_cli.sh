#!/usr/bin/env bash
# test_train_cli.sh: train_unet's command line without a GPU: parameter counts, validation of
# every value, damaged datasets (through an AddressSanitizer build), and the no-GPU message.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
# Every run gets a run folder of its own under $TEST_TMP (a --run_dir given later overrides it), so
# that a run folder in the working tree never changes what a test sees.
train() { ./train_unet --run_dir "$TEST_TMP/run" "$@"; }
train_asan() { build/test/train_unet_asan --run_dir "$TEST_TMP/run" "$@"; }
TRAIN=train
TRAIN_ASAN=train_asan

params() { "$TRAIN" --dry_run "$@" | sed -n 's/^parameters: //p'; }
case_begin "dry_run: parameter counts equal guided-diffusion's"
[ "$(params)" = 20,494,211 ] || case_fail "seed: $(params)"
[ "$(params --conv_resample 1)" = 22,080,323 ] || case_fail "seed + conv_resample: $(params --conv_resample 1)"
[ "$(params --preset adm64)" = 295,131,267 ] || case_fail "adm64: $(params --preset adm64)"
# guided-diffusion's released ImageNet models (1000 classes, + the null row of 1024)
for p in adm128=421,530,630 adm256=553,839,110 adm256u=552,814,086 adm512=558,998,662; do
    [ "$(params --preset "${p%%=*}")" = "${p#*=}" ] || case_fail "${p%%=*}: $(params --preset "${p%%=*}")"
done
# class-conditional: label_emb adds (classes + 1 null row) x 4*num_channels
[ "$(params --class_cond True --num_classes 3)" = 20,495,235 ] || case_fail "seed + 3 classes: $(params --class_cond True --num_classes 3)"
# the noisy classifier with guided-diffusion's flags for 256x256 (EncoderUNetModel, attention pool, 1000 classes)
[ "$(params --model classifier --image_size 256)" = 54,096,360 ] || case_fail "classifier 256: $(params --model classifier --image_size 256)"
# the upsampler, guided-diffusion's 64_256_upsampler.pt flags (SuperResModel: 6 input channels; its
# PyTorch count 311,795,910, plus our null class's row of 768)
UP=(--image_size 256 --super_res 64 --num_channels 192 --num_res_blocks 2 --attention_resolutions 32,16,8 --num_heads 4
    --num_head_channels -1 --use_scale_shift_norm True --resblock_updown True --learn_sigma True --class_cond True --num_classes 1000
    --conv_resample True --channel_mult "")
[ "$(params "${UP[@]}")" = 311,796,678 ] || case_fail "upsampler 64 -> 256: $(params "${UP[@]}")"
# and its 128_512_upsampler.pt's (the upsampler's own channel_mult at 512: 1,1,2,2,4,4; PyTorch 308,835,270)
UP512=(--image_size 512 --super_res 128 --num_channels 192 --num_res_blocks 2 --attention_resolutions 32,16 --num_head_channels 64
       --use_scale_shift_norm True --resblock_updown True --learn_sigma True --class_cond True --num_classes 1000 --conv_resample True
       --channel_mult "")
[ "$(params "${UP512[@]}")" = 308,836,038 ] || case_fail "upsampler 128 -> 512: $(params "${UP512[@]}")"
# the presets of both upsamplers: the same models
[ "$(params --preset adm64_256)" = 311,796,678 ] || case_fail "--preset adm64_256: $(params --preset adm64_256)"
[ "$(params --preset adm128_512)" = 308,836,038 ] || case_fail "--preset adm128_512: $(params --preset adm128_512)"

case_begin "dry_run: flags override the preset in any order, --flag=value and bare booleans"
expect_ok "$TRAIN" --num_channels=128 --preset adm64 --dry_run --use_scale_shift_norm False --resblock_updown
expect_grep '^num_channels +128$' "$LAST_OUT"
expect_grep '^use_scale_shift_norm +False$' "$LAST_OUT"
expect_grep '^resblock_updown +True$' "$LAST_OUT"
expect_grep '^num_res_blocks +3$' "$LAST_OUT"

case_begin "dry_run: an empty channel_mult takes guided-diffusion's default for the size"
expect_ok "$TRAIN" --dry_run --image_size 128 --channel_mult "" --attention_resolutions 16
expect_grep '^channel_mult +1,1,2,3,4$' "$LAST_OUT"

case_begin "bad values: one error line each, ending in (see --help), exit 2"
while IFS= read -r args; do
    # shellcheck disable=SC2086
    expect_exit 2 "$TRAIN" --dry_run $args
    grep -q "^train_unet: error: .* (see --help)$" "$LAST_ERR" || case_fail "no usage error line for: $args"
done <<'LIST'
--num_channels 48
--learn_sigma True --sigma_small True
--model classifier --sigma_small True
--num_channels 0
--image_size 60
--image_size abc
--channel_mult 1,2,x
--channel_mult 1,0.3
--attention_resolutions 12
--super_res 24
--super_res 64
--model classifier --super_res 16
--num_head_channels 48
--num_head_channels -1 --num_heads 5
--num_heads 0
--rdzv nohost
--rdzv node-1:0
--rdzv_timeout 0
--dropout 1.5
--class_cond True
--diffusion_steps 0
--noise_schedule quadratic
--diffusion_steps 20 --noise_schedule linear
--schedule_sampler importance
--lr -1
--batch_size 0
--microbatch 5
--microbatch 0
--batch_size 8 --microbatch 16
--gpus 0
--gpus 4 --batch_size 20000
--ema_rate 0.9,1.2
--log_interval 0
--steps 0
--use_scale_shift_norm maybe
--preset adm1024
--no_such_flag 1
--dry_run=1
stray
--num_res_blocks
--model gan
--model classifier --class_cond True
--model classifier --classifier_pool pyramid
--model classifier --classifier_width 48
--model classifier --sample_count 4
--model classifier --schedule_sampler loss-second-moment
--model classifier --ema_rate 1.5
--model classifier --eval_interval 0
--val_data data/shapes.bin
LIST

make_bad() {  # make_bad NAME PYTHON-EXPR-ON-bytearray-b: a copy of a small valid dataset, damaged
    python3 - "$TEST_TMP/$1.bin" "$2" <<'PY'
import struct, sys
count, side = 4, 8
names = b"a\0b\0"
header = b"UNETDSET" + struct.pack("<IIQIIII", 1, 3, count, side, side, 2, len(names)) + bytes(24)
labels_off = (64 + len(names) + 7) // 8 * 8
pixels_off = (labels_off + 4 * count + 63) // 64 * 64
b = bytearray(header + names)
b += bytes(labels_off - len(b)) + struct.pack("<4i", 0, 1, 0, 1)
b += bytes(pixels_off - len(b)) + bytes(range(256)) * (count * side * side * 3 // 256)
exec(sys.argv[2])
open(sys.argv[1], "wb").write(b)
PY
}
case_begin "damaged datasets: one error line, non-zero exit, clean under AddressSanitizer"
make_bad good 'pass'
expect_ok "$TRAIN_ASAN" --dry_run --data "$TEST_TMP/good.bin" --image_size 8 --channel_mult 1,2 --attention_resolutions 4
expect_grep '^dataset: .*4 images of 8x8, 2 classes' "$LAST_OUT"
make_bad magic 'b[0:8] = b"GARBAGE!"'
make_bad truncated 'del b[-100:]'
make_bad extended 'b += bytes(10)'
make_bad height 'b[24:28] = struct.pack("<I", 9)'
make_bad absurd 'b[28:32] = struct.pack("<I", 4000000000)'
make_bad count 'b[16:24] = struct.pack("<Q", 2**62)'
make_bad label 'b[72:76] = struct.pack("<i", 7)'
make_bad header_only 'del b[40:]'
for bad in magic truncated extended height absurd count label header_only; do
    expect_fail "$TRAIN_ASAN" --dry_run --data "$TEST_TMP/$bad.bin" --image_size 8 --channel_mult 1,2 --attention_resolutions 4
    grep -q "AddressSanitizer\|runtime error" "$LAST_ERR" && case_fail "sanitizer report for $bad"
done
expect_exit 1 "$TRAIN" --dry_run --data "$TEST_TMP/missing.bin"

# region MiB of a "memory plan (what, batch N): ..." line.
plan_region() { sed -n "s/^memory plan ($2, batch [0-9]*): .*$3 \([0-9.]*\) MiB.*/\1/p" "$1"; }
# plan_adds_up FILE: the training model's, the sample grids', the EMA's and the gradient sum's memory
# add up to the "in all" line.
plan_adds_up() {
    awk '/^memory plan \(training|^memory plan \(sample grids/ { sub(/.*total /, ""); sum += $1 }
         /^memory plan \(EMA|^memory plan \(gradient sum/ { sub(/.*: /, ""); sum += $1 }
         /^memory plan: .* in all/ { total = $3 }
         END { exit !(total > 0 && sum - total < 0.3 && total - sum < 0.3) }' "$1" ||
        case_fail "the parts do not add up: $(grep '^memory plan' "$1")"
}
case_begin "dry_run: the memory plan scales with the batch, and its parts add up to the total"
"$TRAIN" --dry_run --batch_size 32 > "$TEST_TMP/plan32.txt" && "$TRAIN" --dry_run --batch_size 64 > "$TEST_TMP/plan64.txt" ||
    case_fail "dry_run failed"
a32=$(plan_region "$TEST_TMP/plan32.txt" training activations) a64=$(plan_region "$TEST_TMP/plan64.txt" training activations)
p32=$(plan_region "$TEST_TMP/plan32.txt" training parameters) p64=$(plan_region "$TEST_TMP/plan64.txt" training parameters)
g=$(plan_region "$TEST_TMP/plan32.txt" "sample grids, at most" gradients)
awk -v a=$a32 -v b=$a64 -v p=$p32 -v q=$p64 -v g=$g \
    'BEGIN { exit !(a > 100 && b > 1.9 * a && b < 2.1 * a && p == q && p > 300 && g == 0) }' ||
    case_fail "activations $a32 -> $a64 MiB, parameters $p32 -> $p64 MiB, sample-grid gradients $g MiB"
plan_adds_up "$TEST_TMP/plan32.txt"

case_begin "dry_run: --microbatch plans the model for a piece and adds the gradient sum; --use_checkpoint keeps less"
expect_ok "$TRAIN" --dry_run --batch_size 32 --microbatch 8
cp "$LAST_OUT" "$TEST_TMP/plan_pieces.txt"
expect_grep '^memory plan \(training, one piece of the batch \(--microbatch\), batch 8\)' "$LAST_OUT"
expect_grep '^memory plan \(gradient sum of the 4 pieces\): [0-9.]+ MiB$' "$LAST_OUT"
a8=$(plan_region "$TEST_TMP/plan_pieces.txt" "training, one piece of the batch (--microbatch)" activations)
awk -v a=$a8 -v b=$a32 'BEGIN { exit !(a > 0 && a > 0.2 * b && a < 0.3 * b) }' ||
    case_fail "a piece of 8 takes $a8 MiB of activations, the batch of 32 $a32 MiB"
plan_adds_up "$TEST_TMP/plan_pieces.txt"
expect_ok "$TRAIN" --dry_run --batch_size 32 --use_checkpoint
expect_grep '^memory plan \(without --use_checkpoint instead\): total [0-9.]+ MiB$' "$LAST_OUT"
r32=$(plan_region "$LAST_OUT" "training, recomputing (--use_checkpoint)" activations)
awk -v a=$r32 -v b=$a32 'BEGIN { exit !(a > 0 && a < 0.6 * b) }' || case_fail "recomputing keeps $r32 MiB of activations, without $a32 MiB"
grep -q "^memory plan (with --use_checkpoint instead): total" "$TEST_TMP/plan32.txt" || case_fail "no plan with --use_checkpoint beside the plan without"

case_begin "the deepest model the limits allow: 8 levels of 8 residual blocks, clean under AddressSanitizer"
expect_ok "$TRAIN_ASAN" --dry_run --image_size 128 --channel_mult 1,1,1,1,1,1,1,1 --num_res_blocks 8
grep -q "AddressSanitizer\|runtime error" "$LAST_ERR" && case_fail "sanitizer report: $(head -3 "$LAST_ERR")"
expect_fail "$TRAIN" --dry_run --num_res_blocks 9
expect_fail "$TRAIN" --dry_run --image_size 256 --channel_mult 1,1,1,1,1,1,1,1,1

case_begin "a batch of more than 2^31 pixels is refused when planned, before the GPU"
expect_exit 1 "$TRAIN" --dry_run --image_size 4096 --batch_size 128 --channel_mult 1,1,1,1,1,1,1,1 --attention_resolutions ""
expect_grep "2147483648 pixels; the kernels count pixels in 32 bits" "$LAST_ERR"
expect_ok "$TRAIN" --dry_run --image_size 4096 --batch_size 127 --channel_mult 1,1,1,1,1,1,1,1 --attention_resolutions ""

case_begin "dataset and flags must agree"
expect_fail "$TRAIN" --dry_run --data "$TEST_TMP/good.bin" --image_size 64
expect_grep 'holds 8x8 images but --image_size is 64' "$LAST_ERR"
make_bad unlabelled 'b[32:40] = bytes(8); del b[64:128]'
expect_fail "$TRAIN" --dry_run --data "$TEST_TMP/unlabelled.bin" --image_size 8 --channel_mult 1,2 --attention_resolutions 4 --class_cond
expect_grep 'needs labels' "$LAST_ERR"
expect_fail "$TRAIN" --dry_run --data "$TEST_TMP/unlabelled.bin" --model classifier --classifier_attention_resolutions 4
expect_grep '^train_unet: error: --model classifier needs labels, and dataset .* has none' "$LAST_ERR"
expect_ok "$TRAIN" --dry_run --data data/shapes.bin --model classifier
expect_grep '^num_classes +3$' "$LAST_OUT"
expect_grep '^ema_rate +$' "$LAST_OUT"
expect_grep '^lr +0.0003$' "$LAST_OUT"
expect_grep '^num_channels +128$' "$LAST_OUT"

case_begin "without --image_size the dataset's is taken, with the default channel_mult for it, and said"
./prepare_data --synthetic shapes --size 32 --count 20 --output "$TEST_TMP/s32.bin" --quiet
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s32.bin"
expect_grep "^image_size 32 from dataset $TEST_TMP/s32.bin, and the default channel_mult for that size, 1,2,2,2 " "$LAST_OUT"
expect_grep '^image_size +32$' "$LAST_OUT"
expect_grep '^channel_mult +1,2,2,2$' "$LAST_OUT"
expect_grep '^class_cond +False$' "$LAST_OUT"
[ "$(grep -c '^dataset .* has 3 classes; the model is unconditional (--class_cond True conditions it on them)$' "$LAST_OUT")" = 1 ] ||
    case_fail "not one note that the dataset has labels"
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s32.bin" --class_cond True --channel_mult 1,2,2
grep -q 'unconditional' "$LAST_OUT" && case_fail "a note on the labels for a class-conditional model"
expect_grep '^channel_mult +1,2,2$' "$LAST_OUT"
expect_grep '^image_size 32 from dataset .* \(--image_size and --channel_mult choose others\)$' "$LAST_OUT"
expect_ok "$TRAIN" --dry_run --data data/shapes.bin --class_cond False  # the preset's size: nothing to say
grep -q 'from dataset\|unconditional' "$LAST_OUT" && case_fail "a note where the dataset changed nothing"
./prepare_data --synthetic shapes --size 48 --count 5 --output "$TEST_TMP/s48.bin" --quiet
expect_exit 2 "$TRAIN" --dry_run --data "$TEST_TMP/s48.bin"
expect_grep 'no default --channel_mult for image size 48; give one' "$LAST_ERR"
# a classifier's validation data: the model's size and classes
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s32.bin" --model classifier --val_data "$TEST_TMP/s32.bin" --classifier_attention_resolutions 8
expect_grep "^validation dataset: $TEST_TMP/s32.bin, 20 images, evaluated on a batch every 5 steps" "$LAST_OUT"
expect_fail "$TRAIN" --dry_run --data data/shapes.bin --model classifier --val_data "$TEST_TMP/s32.bin"
expect_grep 'validation dataset .* holds 32x32 images; the classifier takes 64x64' "$LAST_ERR"

case_begin "the bundled dataset: class-conditional with its 3 classes plus the null class"
expect_ok "$TRAIN" --dry_run --data data/shapes.bin --class_cond
expect_grep '^dataset: data/shapes.bin, 10000 images of 64x64, 3 classes' "$LAST_OUT"
expect_grep '^parameters: 20,495,235$' "$LAST_OUT"

if ! nvidia-smi -L >/dev/null 2>&1; then
    case_begin "without a GPU a real run is one clear error line, exit 1"
    expect_exit 1 "$TRAIN" --data data/shapes.bin --steps 1
    expect_grep '^train_unet: error: no NVIDIA GPU or driver found' "$LAST_ERR"
    expect_exit 1 "$TRAIN" --bench 2
    expect_grep 'no NVIDIA GPU or driver found' "$LAST_ERR"
fi

case_begin "run folder: a new run refuses a folder that holds a run, unless told to resume or to overwrite"
mkdir -p "$TEST_TMP/held/checkpoints/step_000000010"
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/held"
expect_grep 'already holds a run .*step_000000010.*--resume_checkpoint latest.*--overwrite' "$LAST_ERR"
rm -r "$TEST_TMP/held/checkpoints"; echo "step,loss" >"$TEST_TMP/held/log.csv"
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/held"
expect_grep 'log.csv' "$LAST_ERR"
expect_ok "$TRAIN" --dry_run --run_dir "$TEST_TMP/held" --overwrite
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/held" --overwrite --resume_checkpoint latest
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/held/log.csv"
expect_grep 'not a folder' "$LAST_ERR"
expect_ok "$TRAIN" --dry_run --run_dir "$TEST_TMP/new_folder"
expect_absent "$TEST_TMP/new_folder"

case_begin "run folder: one trainer at a time; --dry_run and a starting run name the holder of the lock"
mkdir -p "$TEST_TMP/busy"
# A holder of the lock as a trainer holds it (flock on train.lock, its process id in the file); the
# test goes on once the id is written, so it never races the holder.
flock "$TEST_TMP/busy/train.lock" sh -c 'echo $$ >"$1"; exec sleep 600' sh "$TEST_TMP/busy/train.lock" &
holder=$!
for _ in $(seq 6000); do [ -s "$TEST_TMP/busy/train.lock" ] && break; sleep 0.01; done
held_by=$(cat "$TEST_TMP/busy/train.lock")
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/busy"
expect_grep "run folder .*/busy is in use by another trainer \(process $held_by holds train.lock\)" "$LAST_ERR"
expect_fail "$TRAIN" --data data/shapes.bin --steps 1 --run_dir "$TEST_TMP/busy"  # refused before the GPU is looked for
expect_grep "is in use by another trainer" "$LAST_ERR"
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/busy" --overwrite
kill "$held_by" "$holder" 2>/dev/null; wait "$holder" 2>/dev/null
expect_ok "$TRAIN" --dry_run --run_dir "$TEST_TMP/busy"  # released with its holder: nothing stale to clean

case_begin "run folder: a symlink as the run folder or its checkpoints/ is refused"
mkdir -p "$TEST_TMP/real_run"; ln -s "$TEST_TMP/real_run" "$TEST_TMP/link_run"
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/link_run"
expect_grep "is a symbolic link" "$LAST_ERR"
mkdir -p "$TEST_TMP/other_run/checkpoints"; ln -s "$TEST_TMP/other_run/checkpoints" "$TEST_TMP/real_run/checkpoints"
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/real_run" --overwrite
expect_grep "checkpoints is not a folder \(a symbolic link is refused" "$LAST_ERR"

case_begin "run folder: --dry_run says so when the folder, or the one to create it in, cannot be written"
mkdir -p "$TEST_TMP/open/ro" && chmod 755 "$TEST_TMP" "$TEST_TMP/open" && chmod 555 "$TEST_TMP/open/ro"
as_user=()  # root may write anywhere: the check runs as an unprivileged user then
[ "$(id -u)" = 0 ] && as_user=(setpriv --reuid=65534 --regid=65534 --clear-groups)
if "${as_user[@]}" test -x ./train_unet 2>/dev/null; then
    expect_fail "${as_user[@]}" ./train_unet --dry_run --run_dir "$TEST_TMP/open/ro"
    expect_grep "run folder .*/open/ro cannot be written: .*Permission denied" "$LAST_ERR"
    expect_fail "${as_user[@]}" ./train_unet --dry_run --run_dir "$TEST_TMP/open/ro/new"
    expect_grep "cannot be written: .*/open/ro: Permission denied" "$LAST_ERR"
    chmod 777 "$TEST_TMP/open/ro"
    expect_ok "${as_user[@]}" ./train_unet --dry_run --run_dir "$TEST_TMP/open/ro/new"
else
    echo "  (the unprivileged user cannot reach ./train_unet here: checked as this user only)"
    expect_ok "$TRAIN" --dry_run --run_dir "$TEST_TMP/open/ro/new"
fi
expect_fail "$TRAIN" --dry_run --run_dir "$TEST_TMP/no/such/parent"
expect_grep "cannot be written: .*/no/such: No such file or directory" "$LAST_ERR"
chmod 700 "$TEST_TMP"

case_begin "dry_run checks --resume_checkpoint before the GPU: one error line naming the file"
mkdir -p "$TEST_TMP/garbage"; echo garbage >"$TEST_TMP/garbage/model.safetensors"
expect_fail "$TRAIN" --dry_run --resume_checkpoint "$TEST_TMP/garbage"
expect_grep 'garbage/model.safetensors' "$LAST_ERR"
mkdir -p "$TEST_TMP/fifo"; mkfifo "$TEST_TMP/fifo/model.safetensors"
expect_fail timeout 60 ./train_unet --run_dir "$TEST_TMP/run" --dry_run --resume_checkpoint "$TEST_TMP/fifo"
expect_grep 'not a regular file' "$LAST_ERR"
expect_fail "$TRAIN" --dry_run --resume_checkpoint "$TEST_TMP/nowhere"
expect_fail "$TRAIN" --dry_run --resume_checkpoint latest --run_dir "$TEST_TMP/empty_run"
expect_grep 'no checkpoint' "$LAST_ERR"
mkdir -p "$TEST_TMP/foreign"; cp dev/fixtures/unet_seed.safetensors "$TEST_TMP/foreign/model.safetensors"
expect_fail "$TRAIN" --dry_run --resume_checkpoint "$TEST_TMP/foreign"
expect_grep 'not a checkpoint of this trainer' "$LAST_ERR"

case_begin "the command-line convention: usage on stdout and exit 0 for no arguments, -h and --help; usage errors exit 2"
expect_usage ./train_unet --data x.bin
expect_grep '^usage: train_unet --data FILE.bin' "$TEST_TMP/train_unet.help"
expect_exit 2 ./train_unet --bogus
[ "$(cat "$LAST_ERR")" = "train_unet: error: unknown option --bogus (see --help)" ] || case_fail "unknown option: $(cat "$LAST_ERR")"
expect_exit 2 ./train_unet --dry_run --bogus=3
[ "$(cat "$LAST_ERR")" = "train_unet: error: unknown option --bogus (see --help)" ] || case_fail "unknown option=value: $(cat "$LAST_ERR")"
expect_exit 2 ./train_unet -x
[ "$(cat "$LAST_ERR")" = "train_unet: error: unknown option -x (see --help)" ] || case_fail "unknown short option: $(cat "$LAST_ERR")"
expect_exit 2 "$TRAIN" --steps 10
expect_grep 'needs --data' "$LAST_ERR"
expect_exit 2 "$TRAIN" --dry_run --batch_size
expect_grep 'needs a value' "$LAST_ERR"
expect_exit 1 "$TRAIN" --dry_run --data "$TEST_TMP/missing.bin"
grep -q 'see --help' "$LAST_ERR" && case_fail "a runtime error reads as a usage error: $(cat "$LAST_ERR")"

case_begin "a launcher's variables: incomplete or out of range is one error line; --gpus under a launcher is refused"
expect_exit 1 env RANK=0 WORLD_SIZE=2 ./train_unet --dry_run
expect_grep "^train_unet: error: LOCAL_RANK is unset: a launcher sets RANK, WORLD_SIZE and LOCAL_RANK together" "$LAST_ERR"
expect_exit 1 env RANK=2 WORLD_SIZE=2 LOCAL_RANK=0 ./train_unet --dry_run
expect_grep "RANK 2 is not below WORLD_SIZE 2" "$LAST_ERR"
expect_exit 1 env OMPI_COMM_WORLD_SIZE=2 OMPI_COMM_WORLD_RANK=x OMPI_COMM_WORLD_LOCAL_RANK=0 ./train_unet --dry_run
expect_grep "OMPI_COMM_WORLD_RANK is 'x'" "$LAST_ERR"
expect_exit 2 env RANK=0 WORLD_SIZE=2 LOCAL_RANK=0 ./train_unet --dry_run --gpus 3
expect_grep "under a launcher \(a world of 2\) leave it out" "$LAST_ERR"
expect_ok env RANK=1 WORLD_SIZE=2 LOCAL_RANK=1 ./train_unet --dry_run --run_dir "$TEST_TMP/rank1"
[ -s "$LAST_OUT" ] && case_fail "rank 1 printed on stdout (only rank 0 does)"
expect_ok env SLURM_PROCID=3 ./train_unet --dry_run --run_dir "$TEST_TMP/slurm_batch"  # no srun step: a process alone
expect_grep "^gpus +1$" "$LAST_OUT"
expect_ok env SLURM_STEP_NUM_TASKS=1 SLURM_PROCID=0 SLURM_LOCALID=0 ./train_unet --dry_run --gpus 2 --run_dir "$TEST_TMP/srun_pty"
expect_grep "^gpus +2$" "$LAST_OUT"  # a shell inside a one-task srun step is a process alone: --gpus may start ranks

case_begin "--init_from: a .pt or safetensors of the same model is checked by --dry_run; another model's refused naming tensors"
# the seed fixture's model (dev/fixtures/unet_seed.safetensors), and torch.save's .pt of its weights
SEED_FIXTURE=(--image_size 8 --num_channels 32 --channel_mult 1,1 --num_res_blocks 0 --attention_resolutions 8,4 --num_head_channels 16
              --use_scale_shift_norm False)
for f in dev/fixtures/pt/unet_seed_fp32.pt dev/fixtures/pt/unet_seed_fp16_legacy.pt dev/fixtures/unet_seed.safetensors; do
    expect_ok "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --init_from "$f"
    expect_grep "^init_from: $f, checked: 72 tensors start from it" "$LAST_OUT"
done
expect_fail "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --num_channels 64 --init_from dev/fixtures/pt/unet_seed_fp32.pt
expect_grep "^train_unet: error: --init_from: .*unet_seed_fp32.pt does not match the model \([0-9]+ problems\): time_embed.0.weight is F16|F32 \[128,32\], expected F32 \[256,64\]" "$LAST_ERR"
expect_fail "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --init_from dev/test/corpus/pt/bad_os_system.pt
expect_grep "os.system, which is not part of a state_dict" "$LAST_ERR"
expect_exit 2 "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --init_from dev/fixtures/pt/unet_seed_fp32.pt --resume_checkpoint latest
# the adm fixture: 10 label_emb rows; a model of 4 classes (+ the null class) keeps its own label_emb
ADM_FIXTURE=(--image_size 8 --num_channels 32 --channel_mult 1,1 --num_res_blocks 1 --attention_resolutions 4 --num_head_channels 16
             --use_new_attention_order True --resblock_updown True --use_scale_shift_norm True --learn_sigma True --class_cond True)
expect_ok "$TRAIN" --dry_run "${ADM_FIXTURE[@]}" --num_classes 4 --init_from dev/fixtures/pt/unet_adm_fp32.pt
expect_grep "^init_from: .*unet_adm_fp32.pt has 10 label_emb rows, this model 5: label_emb starts from its initialisation" "$LAST_OUT"

case_begin "run folder: --overwrite refuses an --init_from inside the run folder it would clear, by --dry_run and before the GPU"
mkdir -p "$TEST_TMP/own/checkpoints/step_000000010" && echo "step,loss" >"$TEST_TMP/own/log.csv"
cp dev/fixtures/unet_seed.safetensors "$TEST_TMP/own/checkpoints/step_000000010/ema.safetensors"
expect_fail "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --overwrite --init_from "$TEST_TMP/own/checkpoints/step_000000010" --run_dir "$TEST_TMP/own"
expect_grep "^train_unet: error: --init_from .*/own/checkpoints/step_000000010 lies inside run folder .*/own, which --overwrite clears" "$LAST_ERR"
expect_fail "$TRAIN" "${SEED_FIXTURE[@]}" --data "$TEST_TMP/good.bin" --steps 1 --overwrite --run_dir "$TEST_TMP/own" \
    --init_from "$TEST_TMP/own/checkpoints/step_000000010/"
expect_grep "lies inside run folder .*/own, which --overwrite clears" "$LAST_ERR"
[ -f "$TEST_TMP/own/checkpoints/step_000000010/ema.safetensors" ] && [ -f "$TEST_TMP/own/log.csv" ] || case_fail "the run folder was changed"
ln -s "$PWD/dev/fixtures/unet_seed.safetensors" "$TEST_TMP/own/seed.safetensors"  # a link there, which clearing may remove
expect_fail "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --overwrite --init_from "$TEST_TMP/own/seed.safetensors" --run_dir "$TEST_TMP/own"
expect_grep "lies inside run folder" "$LAST_ERR"
expect_ok "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --overwrite --init_from dev/fixtures/unet_seed.safetensors --run_dir "$TEST_TMP/own"
expect_ok "$TRAIN" --dry_run "${SEED_FIXTURE[@]}" --init_from "$TEST_TMP/own/seed.safetensors" --run_dir "$TEST_TMP/other_own"

case_begin "a launcher's MASTER_ADDR and MASTER_PORT are checked as --rdzv is: one error line naming the variable, before the GPU"
launched() { env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 "$@"; }  # as torchrun starts a rank
for port in 70000 0 -1 abc " 80" +80 65536 080x; do
    expect_exit 1 launched MASTER_ADDR=localhost MASTER_PORT="$port" ./train_unet --dry_run --run_dir "$TEST_TMP/run"
    grep -qF "train_unet: error: MASTER_PORT is '$port': the rendezvous port must be a number in 1..65535" "$LAST_ERR" ||
        case_fail "MASTER_PORT '$port': $(cat "$LAST_ERR")"
done
for addr in "bad host!" a:b:c:80 "[::1" "node-1:29500"; do
    expect_exit 1 launched MASTER_ADDR="$addr" MASTER_PORT=29500 ./train_unet --dry_run --run_dir "$TEST_TMP/run"
    grep -qF "train_unet: error: MASTER_ADDR is '$addr': the rendezvous host must be" "$LAST_ERR" ||
        case_fail "MASTER_ADDR '$addr': $(cat "$LAST_ERR")"
done
expect_exit 1 launched MASTER_ADDR=localhost MASTER_PORT=abc ./train_unet --data data/shapes.bin --steps 1 --run_dir "$TEST_TMP/run"
expect_grep "MASTER_PORT is 'abc'" "$LAST_ERR"  # a real run too, before the GPU is looked for
expect_exit 1 env MASTER_ADDR=localhost MASTER_PORT=70000 ./train_unet --dry_run --gpus 2 --run_dir "$TEST_TMP/run"  # what --gpus passes on
expect_grep "MASTER_PORT is '70000'" "$LAST_ERR"
expect_ok launched MASTER_ADDR=localhost MASTER_PORT=29500 ./train_unet --dry_run --run_dir "$TEST_TMP/run"
expect_ok launched MASTER_ADDR=::1 MASTER_PORT=29500 ./train_unet --dry_run --run_dir "$TEST_TMP/run"
expect_ok launched MASTER_ADDR=10.0.0.2 MASTER_PORT=1 ./train_unet --dry_run --run_dir "$TEST_TMP/run"
expect_ok launched MASTER_ADDR=localhost MASTER_PORT=abc ./train_unet --dry_run --rdzv localhost:29500 --run_dir "$TEST_TMP/run"  # --rdzv overrides
expect_ok env MASTER_ADDR=localhost MASTER_PORT=abc ./train_unet --dry_run --run_dir "$TEST_TMP/run"  # no launcher: not used
# --rdzv: the same forms refused, as usage errors
for rdzv in "host: 80" host:+80 "[::1:80" a:b:c:80 "[]:80" host:70000 host:-1 host:abc "bad host!:80"; do
    expect_exit 2 ./train_unet --dry_run --rdzv "$rdzv" --run_dir "$TEST_TMP/run"
    grep -qF "train_unet: error: --rdzv '$rdzv' must be host:port" "$LAST_ERR" || case_fail "--rdzv '$rdzv': $(cat "$LAST_ERR")"
done
expect_ok ./train_unet --dry_run --rdzv "[::1]:29500" --run_dir "$TEST_TMP/run"

case_begin "a torchrun restart continues its own run folder (its torchrun_run_id): from the latest checkpoint, or over again; another folder as usual"
restarted() { env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 TORCHELASTIC_RUN_ID=job7 TORCHELASTIC_RESTART_COUNT=1 "$@"; }
mkdir -p "$TEST_TMP/attempt/checkpoints/step_000000010" && echo "step,loss" >"$TEST_TMP/attempt/log.csv"
printf job7 >"$TEST_TMP/attempt/torchrun_run_id"
# (the checkpoint is an empty folder: its check fails, with one line, after the restart has taken it)
expect_exit 1 restarted ./train_unet --data data/shapes.bin --overwrite --run_dir "$TEST_TMP/attempt"
expect_grep "^torchrun restart 1: continuing the run from .*/attempt/checkpoints/step_000000010$" "$LAST_OUT"
expect_grep "^train_unet: error: .*attempt/checkpoints/step_000000010/model.safetensors" "$LAST_ERR"
[ -f "$TEST_TMP/attempt/log.csv" ] || case_fail "--overwrite cleared the run folder on a restart that continues it"
rmdir "$TEST_TMP/attempt/checkpoints/step_000000010"
expect_exit 1 restarted ./train_unet --data data/shapes.bin --init_from "$TEST_TMP/missing.safetensors" --run_dir "$TEST_TMP/attempt"
expect_grep "^torchrun restart 1: the failed attempt left no checkpoint; the run starts again$" "$LAST_OUT"
expect_grep "^train_unet: error: --init_from: .*missing.safetensors" "$LAST_ERR"
[ -e "$TEST_TMP/attempt/log.csv" ] || [ -e "$TEST_TMP/attempt/torchrun_run_id" ] && case_fail "the failed attempt's files were not cleared"
mkdir -p "$TEST_TMP/other_job/checkpoints/step_000000010" && echo "step,loss" >"$TEST_TMP/other_job/log.csv"
printf job6 >"$TEST_TMP/other_job/torchrun_run_id"
expect_exit 1 restarted ./train_unet --data data/shapes.bin --run_dir "$TEST_TMP/other_job"
expect_grep "already holds a run" "$LAST_ERR"
grep -q "torchrun restart" "$LAST_OUT" && case_fail "a restart took another torchrun run's folder"
expect_exit 1 env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 TORCHELASTIC_RUN_ID=job6 TORCHELASTIC_RESTART_COUNT=0 ./train_unet --data data/shapes.bin \
    --run_dir "$TEST_TMP/other_job"
expect_grep "already holds a run" "$LAST_ERR"  # the first attempt: the usual checks

case_begin "--bench_loader: the loader alone on the host, cold, with and without its read-ahead; needs --data"
expect_ok ./train_unet --data data/shapes.bin --bench_loader 5 --batch_size 16
expect_grep "^bench_loader: 5 batches of 16 from data/shapes.bin" "$LAST_OUT"
expect_grep "^  read-ahead on : [0-9]+ images/s, [0-9.]+ MB/s, [0-9.]+ ms a batch" "$LAST_OUT"
expect_grep "^  read-ahead off: [0-9]+ images/s" "$LAST_OUT"
expect_exit 2 ./train_unet --bench_loader 5
expect_grep "bench_loader times --data's loader: give --data FILE.bin" "$LAST_ERR"
expect_exit 2 ./train_unet --data data/shapes.bin --bench_loader -1
expect_grep "bench_loader -1 must be positive" "$LAST_ERR"

case_begin "--eval_num (FID during training): bad values are usage errors; the weights and the dataset's size checked by --dry_run"
expect_exit 2 "$TRAIN" --dry_run --eval_num 2048
expect_grep "eval_num 2048: FID needs more images than its 2048 features" "$LAST_ERR"
expect_exit 2 "$TRAIN" --dry_run --eval_num 3000 --model classifier
expect_grep "eval_num is a diffusion model's FID: a classifier evaluates on --val_data" "$LAST_ERR"
expect_exit 2 "$TRAIN" --dry_run --eval_num 3000 --image_size 32 --super_res 16
expect_grep "FID during training is not built for an upsampler" "$LAST_ERR"
expect_exit 2 "$TRAIN" --dry_run --eval_num 3000 --eval_interval 15 --log_interval 10
expect_grep "eval_interval 15 must be a multiple of --log_interval 10" "$LAST_ERR"
expect_exit 1 "$TRAIN" --dry_run --data "$TEST_TMP/s32.bin" --eval_num 3000
expect_grep "dataset .*s32.bin holds 20 images: FID's reference needs more than 2048" "$LAST_ERR"
./prepare_data --synthetic shapes --size 32 --count 2049 --output "$TEST_TMP/s2049.bin" --quiet >/dev/null
without_weights() { HOME="$TEST_TMP/home" TORCH_HOME="" XDG_CACHE_HOME="" "$TRAIN" "$@"; }  # where pytorch-fid keeps none
expect_exit 1 without_weights --dry_run --data "$TEST_TMP/s2049.bin" --eval_num 3000
expect_grep "eval_num: cannot open the Inception weights $TEST_TMP/home/.cache/torch/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth" "$LAST_ERR"
build/test/test_inception --write "$TEST_TMP/inception.safetensors"
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s2049.bin" --eval_num 3000 --inception "$TEST_TMP/inception.safetensors"
expect_grep "^FID: 3000 samples every 5000 steps and at the end, Inception-v3 weights .*inception.safetensors$" "$LAST_OUT"
expect_grep "^memory plan \(FID's sampler and Inception-v3, at most: .*\): [0-9]+\.[0-9] MiB$" "$LAST_OUT"
fid=$(sed -n "s/^memory plan (FID's sampler and Inception-v3, at most: .*): \([0-9.]*\) MiB$/\1/p" "$LAST_OUT")
all=$(sed -n 's/^memory plan: \([0-9.]*\) MiB in all$/\1/p' "$LAST_OUT")
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s2049.bin"
without=$(sed -n 's/^memory plan: \([0-9.]*\) MiB in all$/\1/p' "$LAST_OUT")
awk -v a="$all" -v b="$without" -v f="$fid" 'BEGIN { exit !(f > 50 && a - b > f - 0.2 && a - b < f + 0.2) }' ||
    case_fail "the plan in all ($all MiB) is not the plan without FID ($without MiB) and FID's ($fid MiB)"
expect_ok "$TRAIN" --dry_run --data "$TEST_TMP/s2049.bin" --eval_num 3000 --inception "$TEST_TMP/inception.safetensors" --sample_interval 0
expect_grep "^FID: 3000 samples at the end" "$LAST_OUT"

case_begin "--help lists every guided-diffusion flag"
expect_ok "$TRAIN" --help
for flag in image_size num_channels num_res_blocks channel_mult attention_resolutions num_heads num_head_channels \
    use_new_attention_order use_scale_shift_norm resblock_updown dropout class_cond diffusion_steps noise_schedule \
    lr weight_decay batch_size ema_rate log_interval save_interval resume_checkpoint data conv_resample preset dry_run; do
    expect_grep "^  --$flag " "$LAST_OUT"
done
case_summary
