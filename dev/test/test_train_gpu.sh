#!/usr/bin/env bash
# test_train_gpu.sh: training on the GPU, end to end: a run stopped and resumed equals a run that
# never stopped (every logged loss, learning rate and gradient norm, and the final weights, EMA
# and optimiser state to the byte); SIGINT saves and exits 0; non-finite steps stop the run with
# a clear message; sample grids are written (an upsampler's: low-res | sample | original); bad
# checkpoints are refused with one line; a run folder takes one trainer at a time, SIGHUP saves, a save past the file-size limit keeps the
# previous checkpoint, an older resume sets the later steps aside, a resume from elsewhere starts a
# new run; a learned variance trains, resumes and samples; EDM's preconditioning (--precond edm)
# trains, resumes exactly and samples with Heun from its checkpoint alone; the schedule sampler loss-second-moment
# resumes exactly (its history in state.bin) and logs the loss per quarter of t; --microbatch trains as
# the whole batch does (to rounding), --use_checkpoint as without it (to the byte); the noisy
# classifier trains, evaluates on --val_data, resumes and recomputes to the byte; FID during
# training (--eval_num) lands in log.csv; a run saving every step equals one that does not; a dataset
# in parts trains as the whole file.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
./prepare_data --synthetic shapes --count 300 --size 32 --seed 5 --output "$TEST_TMP/s.bin" --quiet >/dev/null
# A small class-conditional model with dropout, label dropout, two EMA rates, warm-up, cosine
# decay and clipping, so that every random draw and schedule takes part in the comparison.
ARGS=(--data "$TEST_TMP/s.bin" --image_size 32 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1
      --attention_resolutions 16 --num_head_channels 32 --class_cond --cfg_dropout 0.2 --dropout 0.1 --batch_size 8
      --lr 1e-3 --warmup_steps 5 --lr_decay cosine --grad_clip 1.0 --ema_rate 0.99,0.999 --log_interval 1 --seed 3)
train() { ./train_unet "${ARGS[@]}" "$@"; }

case_begin "a run stopped at step 13 and resumed equals one that never stopped"
expect_ok train --steps 30 --run_dir "$TEST_TMP/a"
expect_ok train --steps 30 --stop_step 13 --run_dir "$TEST_TMP/b"
expect_grep "^stopped at step 13: checkpoint" "$LAST_OUT"
expect_ok train --steps 30 --run_dir "$TEST_TMP/b" --resume_checkpoint latest
expect_grep "resumed from .*step_000000013 at step 13" "$LAST_OUT"
cut -d, -f1-4 "$TEST_TMP/a/log.csv" >"$TEST_TMP/a.rows"
cut -d, -f1-4 "$TEST_TMP/b/log.csv" >"$TEST_TMP/b.rows"
[ "$(wc -l <"$TEST_TMP/a.rows")" = 31 ] || case_fail "log.csv of the straight run has $(wc -l <"$TEST_TMP/a.rows") lines, expected 31"
cmp -s "$TEST_TMP/a.rows" "$TEST_TMP/b.rows" || { case_fail "logged losses differ:"; diff "$TEST_TMP/a.rows" "$TEST_TMP/b.rows" | head -6; }
for f in model.safetensors ema.safetensors ema_0.999.safetensors state.bin; do
    cmp -s "$TEST_TMP/a/checkpoints/step_000000030/$f" "$TEST_TMP/b/checkpoints/step_000000030/$f" || case_fail "$f differs"
done
for run in a b; do  # the loss chart, drawn at each log interval (the resumed one from log.csv's rows too)
    grep -q 'id="loss-smoothed"' "$TEST_TMP/$run/loss.svg" && tail -c 16 "$TEST_TMP/$run/loss.svg" | grep -q '</svg>' ||
        case_fail "$run/loss.svg is missing or not a whole chart"
done

case_begin "a run that saves every step equals one that saves only at its end (the update beside the next forward)"
# Each step's parameter update runs in the next step, beside its forward; a checkpoint applies it
# first. Saving every step applies each update alone before the next step: a forward that read a
# parameter before its update, or an update applied twice, would change every later loss.
expect_ok train --steps 30 --save_interval 1 --keep 2 --run_dir "$TEST_TMP/every"
cut -d, -f1-4 "$TEST_TMP/every/log.csv" >"$TEST_TMP/every.rows"
cmp -s "$TEST_TMP/a.rows" "$TEST_TMP/every.rows" || { case_fail "logged losses differ:"; diff "$TEST_TMP/a.rows" "$TEST_TMP/every.rows" | head -6; }
for f in model.safetensors ema.safetensors ema_0.999.safetensors state.bin; do
    cmp -s "$TEST_TMP/a/checkpoints/step_000000030/$f" "$TEST_TMP/every/checkpoints/step_000000030/$f" || case_fail "$f differs"
done

case_begin "a learned variance (hybrid loss, and use_kl) trains, resumes exactly, logs mse and vb, and samples with DDPM"
expect_ok train --learn_sigma True --steps 20 --stop_step 9 --run_dir "$TEST_TMP/sigma"
expect_ok train --learn_sigma True --steps 20 --run_dir "$TEST_TMP/sigma" --resume_checkpoint latest
expect_ok train --learn_sigma True --steps 20 --run_dir "$TEST_TMP/sigma_straight"
cmp -s "$TEST_TMP/sigma/checkpoints/step_000000020/model.safetensors" "$TEST_TMP/sigma_straight/checkpoints/step_000000020/model.safetensors" ||
    case_fail "the resumed learned-variance run's weights differ from the straight run's"
expect_grep '^step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,mse,vb,loss_q0,loss_q1,loss_q2,loss_q3$' "$TEST_TMP/sigma/log.csv"
awk -F, 'NR > 1 && !($9 > 0 && $8 > 0 && ($2 - $8 - $9) ^ 2 < 1e-6) { bad = 1 } END { exit bad }' "$TEST_TMP/sigma/log.csv" ||
    case_fail "log.csv: loss is not mse + vb, or a term is not positive: $(sed -n 2p "$TEST_TMP/sigma/log.csv")"
expect_grep '^step 20/20  loss [0-9.]+ \(mse [0-9.]+, vb [0-9.]+\)' "$LAST_OUT"
expect_ok ./train_unet "${ARGS[@]}" --learn_sigma True --use_kl True --predict x0 --steps 5 --run_dir "$TEST_TMP/kl"
expect_grep 'learn_sigma.*True' "$TEST_TMP/kl/config.txt"
expect_ok ./generate --checkpoint "$TEST_TMP/sigma/checkpoints/step_000000020" --sampler ddpm --steps 20 --num 6 --out "$TEST_TMP/sigma_samples"
expect_grep 'ddpm with 20 steps' "$LAST_OUT"
[ -s "$TEST_TMP/sigma_samples/grid.png" ] || case_fail "no grid from the learned-variance checkpoint"
expect_ok ./generate --checkpoint "$TEST_TMP/sigma/checkpoints/step_000000020" --respacing 10,5 --sampler ddpm --num 2 --out "$TEST_TMP/sigma_10_5"
expect_grep 'ddpm with 15 steps' "$LAST_OUT"

case_begin "EDM (--precond edm): trains, resumes exactly, keeps its preconditioning in the checkpoint, samples with Heun by default"
expect_ok train --precond edm --steps 40 --stop_step 17 --run_dir "$TEST_TMP/edm"
expect_ok train --precond edm --steps 40 --run_dir "$TEST_TMP/edm" --resume_checkpoint latest
expect_ok train --precond edm --steps 40 --run_dir "$TEST_TMP/edm_straight"
for f in model.safetensors ema.safetensors state.bin; do
    cmp -s "$TEST_TMP/edm/checkpoints/step_000000040/$f" "$TEST_TMP/edm_straight/checkpoints/step_000000040/$f" ||
        case_fail "the resumed EDM run's $f differs from the straight run's"
done
# The loss starts near 1 (F's output layer is zero, its target of unit variance) and falls.
awk -F, 'NR > 1 && NR <= 11 { a += $2 } NR > 31 { b += $2 } END { exit !(a / 10 > 0.8 && b < a) }' "$TEST_TMP/edm_straight/log.csv" ||
    case_fail "the EDM loss did not start near 1 and fall: $(cut -d, -f2 "$TEST_TMP/edm_straight/log.csv" | tr '\n' ' ' | head -c 300)"
python3 - "$TEST_TMP/edm/checkpoints/step_000000040/ema.safetensors" <<'PY' || case_fail "the checkpoint's metadata does not say precond edm"
import json, struct, sys
with open(sys.argv[1], "rb") as f:
    meta = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))["__metadata__"]
sys.exit(0 if meta.get("precond") == "edm" and float(meta["sigma_data"]) == 0.5 else 1)
PY
[ -s "$TEST_TMP/edm/samples/step_000000040.png" ] || case_fail "no sample grid from the EDM run"
expect_ok ./generate --checkpoint "$TEST_TMP/edm/checkpoints/step_000000040" --num 4 --out "$TEST_TMP/edm_samples"
expect_grep 'heun with 35 steps' "$LAST_OUT"
[ -s "$TEST_TMP/edm_samples/grid.png" ] || case_fail "no grid from the EDM checkpoint"
expect_ok ./generate --checkpoint "$TEST_TMP/edm/checkpoints/step_000000040" --sampler dpm++ --steps 10 --num 2 --out "$TEST_TMP/edm_dpm"
expect_grep 'dpm\+\+ with 10 steps' "$LAST_OUT"
expect_fail ./generate --checkpoint "$TEST_TMP/edm/checkpoints/step_000000040" --sampler ddpm --num 2 --out "$TEST_TMP/edm_ddpm"
expect_grep 'EDM model .*not ddpm' "$LAST_ERR"

case_begin "the schedule sampler loss-second-moment: its history resumes exactly, draws by it once full, and the quarters are logged"
# 50 timesteps at 16 images a step: every t has its 10 losses after a few dozen steps
LSM=(--learn_sigma True --diffusion_steps 50 --schedule_sampler loss-second-moment --batch_size 16 --steps 120 --log_interval 5
     --sample_steps 10)
expect_ok train "${LSM[@]}" --run_dir "$TEST_TMP/lsm"
expect_ok train "${LSM[@]}" --stop_step 90 --run_dir "$TEST_TMP/lsm_resumed"
expect_ok train "${LSM[@]}" --run_dir "$TEST_TMP/lsm_resumed" --resume_checkpoint latest
for f in model.safetensors state.bin; do
    cmp -s "$TEST_TMP/lsm/checkpoints/step_000000120/$f" "$TEST_TMP/lsm_resumed/checkpoints/step_000000120/$f" ||
        case_fail "$f of the resumed run differs from the straight run's"
done
cmp -s <(cut -d, -f1-4,8- "$TEST_TMP/lsm/log.csv") <(cut -d, -f1-4,8- "$TEST_TMP/lsm_resumed/log.csv") ||
    case_fail "the resumed run's logged losses differ from the straight run's"
# state.bin (checkpoint.h): version 2, a history of 50 timesteps of 10 losses, every count 10 at step 90
python3 - "$TEST_TMP/lsm_resumed/checkpoints/step_000000090/state.bin" <<'PY' || case_fail "state.bin at step 90 holds no full history"
import struct, sys
b = open(sys.argv[1], "rb").read()
version, = struct.unpack_from("<I", b, 8)
steps, length = struct.unpack_from("<ii", b, 88)
storage, = struct.unpack_from("<q", b, 24)
counts = struct.unpack_from("<50i", b, 96 + 8 * storage)
full = version == 2 and (steps, length) == (50, 10) and set(counts) == {10}
if not full:
    print(f"  version {version}, history of {steps} x {length}, counts {counts}")
sys.exit(0 if full else 1)
PY
expect_ok train "${LSM[@]}" --schedule_sampler uniform --run_dir "$TEST_TMP/lsm_uniform"
cmp -s "$TEST_TMP/lsm/checkpoints/step_000000120/model.safetensors" "$TEST_TMP/lsm_uniform/checkpoints/step_000000120/model.safetensors" &&
    case_fail "the weighted draws changed nothing: the weights equal a uniform run's"
awk -F, 'NR > 1 { for (q = 10; q <= 13; q++) if ($q != "") seen[q] = 1; if ($10 != "" && !($10 > 0)) bad = 1 }
         END { exit bad || length(seen) != 4 }' "$TEST_TMP/lsm/log.csv" ||
    case_fail "log.csv: the quarters' losses are missing or not positive: $(sed -n 2p "$TEST_TMP/lsm/log.csv")"

case_begin "--init_from: a new run from a trained run's weights continues its loss; a .pt of other classes trains too"
expect_ok train --steps 60 --run_dir "$TEST_TMP/base"
expect_ok train --steps 5 --run_dir "$TEST_TMP/tuned" --init_from "$TEST_TMP/base/checkpoints/step_000000060/model.safetensors"
expect_grep "^new run started from the weights of .*base/checkpoints/step_000000060/model.safetensors" "$LAST_OUT"
python3 - "$TEST_TMP/base/log.csv" "$TEST_TMP/tuned/log.csv" <<'PY' || case_fail "the fine-tuned run's loss does not continue the base run's"
import csv, sys
base, tuned = ([float(r["loss"]) for r in csv.DictReader(open(p))] for p in sys.argv[1:3])
first, last, now = sum(base[:5]) / 5, sum(base[-5:]) / 5, sum(tuned[:5]) / 5
print(f"  base run: first 5 steps {first:.4f}, last 5 {last:.4f}; fine-tuned, first 5: {now:.4f}")
sys.exit(0 if now < 0.5 * first and now < 2 * last else 1)
PY
./prepare_data --synthetic shapes --count 40 --size 8 --seed 5 --output "$TEST_TMP/s8.bin" --quiet >/dev/null
expect_ok ./train_unet --data "$TEST_TMP/s8.bin" --image_size 8 --num_channels 32 --channel_mult 1,1 --num_res_blocks 1 \
    --attention_resolutions 4 --num_head_channels 16 --use_new_attention_order True --resblock_updown True --use_scale_shift_norm True \
    --learn_sigma True --class_cond True --batch_size 4 --steps 3 --sample_count 0 --run_dir "$TEST_TMP/from_pt" \
    --init_from dev/fixtures/pt/unet_adm_fp16_legacy.pt
expect_grep "has 10 label_emb rows, this model 4: label_emb starts from its initialisation" "$LAST_OUT"
expect_grep "^done at step 3" "$LAST_OUT"

case_begin "SIGINT finishes the step, saves a checkpoint, says where and exits 0"
./train_unet "${ARGS[@]}" --steps 1000000 --run_dir "$TEST_TMP/c" >"$TEST_TMP/c.out" 2>&1 &  # not through a function: $! is train_unet
pid=$!
for _ in $(seq 300); do grep -q "^step 3/" "$TEST_TMP/c.out" && break; sleep 0.1; done
kill -INT $pid
wait $pid
rc=$?
cat "$TEST_TMP/c.out" >"$LAST_OUT"
[ $rc = 0 ] || case_fail "exit status $rc after SIGINT"
expect_grep "^stopped at step [0-9]+: checkpoint .*/checkpoints/step_" "$TEST_TMP/c.out"

case_begin "non-finite losses skip steps (a warning each), then stop the run with one error line"
train --steps 50 --run_dir "$TEST_TMP/d" --lr 1e30 --warmup_steps 0 --grad_clip 0 --max_bad_steps 3 >"$LAST_OUT" 2>"$LAST_ERR"
rc=$?
[ $rc != 0 ] && [ $rc -lt 128 ] || case_fail "exit status $rc"
[ "$(grep -c "skipped: loss" "$LAST_ERR")" = 3 ] || case_fail "expected 3 skipped-step warnings"
tail -n 1 "$LAST_ERR" | grep -q "^train_unet: error: stopping: 3 non-finite steps in a row" || case_fail "no stop message"
[ "$(grep -c "error" "$LAST_ERR")" = 1 ] || case_fail "more than one error line"

case_begin "sample grids every --sample_interval steps and at the end, of the PNG size expected"
expect_ok train --steps 20 --run_dir "$TEST_TMP/f" --sample_count 5 --sample_interval 10 --sample_steps 10
expect_grep "^samples: .*/samples/step_000000010.png" "$LAST_OUT"
for step in 10 20; do
    python3 - "$TEST_TMP/f/samples/step_0000000$step.png" <<'PY' || case_fail "grid of step $step: missing or of the wrong size"
import struct, sys
b = open(sys.argv[1], "rb").read()
w, h = struct.unpack(">II", b[16:24])
sys.exit(0 if b[:8] == b"\x89PNG\r\n\x1a\n" and (w, h) == (3 * 34 + 2, 2 * 34 + 2) else 1)
PY
done

case_begin "bad checkpoints: one error line each"
expect_fail train --steps 40 --run_dir "$TEST_TMP/e" --resume_checkpoint "$TEST_TMP/nowhere"
expect_fail train --steps 40 --run_dir "$TEST_TMP/e" --resume_checkpoint latest
cp -r "$TEST_TMP/a/checkpoints/step_000000030" "$TEST_TMP/damaged"
truncate -s 100 "$TEST_TMP/damaged/state.bin"
expect_fail train --steps 40 --run_dir "$TEST_TMP/e" --resume_checkpoint "$TEST_TMP/damaged"
expect_grep "state.bin" "$LAST_ERR"
expect_fail train --steps 40 --run_dir "$TEST_TMP/e" --resume_checkpoint "$TEST_TMP/a/checkpoints/step_000000030" --num_channels 64
expect_grep "another configuration: --num_channels 64 \(checkpoint: 32\)" "$LAST_ERR"
expect_fail train --steps 40 --run_dir "$TEST_TMP/e" --resume_checkpoint "$TEST_TMP/a/checkpoints/step_000000030" --batch_size 4
expect_grep "another configuration: --batch_size 4 \(checkpoint: 8\)" "$LAST_ERR"

case_begin "run folders: a second run is refused, --overwrite starts over, a resume from an older step sets the later ones aside"
expect_fail train --steps 30 --run_dir "$TEST_TMP/b"
expect_grep "already holds a run" "$LAST_ERR"
expect_ok train --steps 30 --run_dir "$TEST_TMP/b" --resume_checkpoint "$TEST_TMP/b/checkpoints/step_000000013" --lr 2e-3
expect_grep "resume: changed since the checkpoint: --lr 0.002 \(checkpoint: 0.001\)" "$LAST_OUT"
expect_grep "^done at step 30: checkpoint .*step_000000030" "$LAST_OUT"
[ "$(grep -c '^30,' "$TEST_TMP/b/log.csv")" = 1 ] || case_fail "log.csv holds step 30 $(grep -c '^30,' "$TEST_TMP/b/log.csv") times"
expect_grep "^resume: set aside .*step_000000030 as step_000000030.abandoned" "$LAST_OUT"
cmp -s "$TEST_TMP/a/checkpoints/step_000000030/model.safetensors" "$TEST_TMP/b/checkpoints/step_000000030/model.safetensors" &&
    case_fail "step 30 is still the first branch's, not the run's at the higher learning rate"
cmp -s "$TEST_TMP/a/checkpoints/step_000000030/model.safetensors" "$TEST_TMP/b/checkpoints/step_000000030.abandoned/model.safetensors" ||
    case_fail "the abandoned branch's step 30 was not kept aside whole"
expect_ok train --steps 5 --run_dir "$TEST_TMP/b" --overwrite
[ "$(ls "$TEST_TMP/b/checkpoints")" = step_000000005 ] || case_fail "after --overwrite: $(ls "$TEST_TMP/b/checkpoints")"

case_begin "a checkpoint from elsewhere starts a new run in an empty folder, recorded; never into another run's folder"
sum_a=$(cat "$TEST_TMP/a/log.csv" "$TEST_TMP/a/config.txt" | cksum)
expect_fail train --steps 35 --run_dir "$TEST_TMP/b" --resume_checkpoint "$TEST_TMP/a/checkpoints/step_000000030"
expect_grep "is not a checkpoint of run folder .*/b, which holds another run" "$LAST_ERR"
expect_ok train --steps 35 --run_dir "$TEST_TMP/from_a" --resume_checkpoint "$TEST_TMP/a/checkpoints/step_000000030"
expect_grep "^new run started from /.*/a/checkpoints/step_000000030 at step 30" "$LAST_OUT"
expect_grep "^resume_checkpoint +/.*/a/checkpoints/step_000000030$" "$TEST_TMP/from_a/config.txt"
[ -d "$TEST_TMP/from_a/checkpoints/step_000000035" ] || case_fail "no step 35 in the new run: $(ls "$TEST_TMP/from_a/checkpoints")"
[ "$(cat "$TEST_TMP/a/log.csv" "$TEST_TMP/a/config.txt" | cksum)" = "$sum_a" ] || case_fail "the source run's files changed"

case_begin "one trainer per run folder; SIGHUP saves and exits 0; a save past the file-size limit keeps the last checkpoint"
./train_unet "${ARGS[@]}" --steps 1000000 --run_dir "$TEST_TMP/g" >"$TEST_TMP/g.out" 2>&1 &
pid=$!
for _ in $(seq 600); do grep -q "^step 3/" "$TEST_TMP/g.out" && break; sleep 0.1; done
expect_fail train --steps 10 --run_dir "$TEST_TMP/g" --resume_checkpoint latest
expect_grep "run folder .*/g is in use by another trainer \(process $pid holds train.lock\)" "$LAST_ERR"
expect_fail train --steps 10 --run_dir "$TEST_TMP/g" --overwrite
expect_grep "is in use by another trainer" "$LAST_ERR"
kill -HUP $pid
wait $pid
rc=$?
[ $rc = 0 ] || case_fail "exit status $rc after SIGHUP"
expect_grep "^stopped at step [0-9]+: checkpoint .*/checkpoints/step_" "$TEST_TMP/g.out"
last=$(ls "$TEST_TMP/g/checkpoints")
stopped=$((10#${last#step_}))
(ulimit -f 256; exec ./train_unet "${ARGS[@]}" --steps $((stopped + 4)) --save_interval 2 --run_dir "$TEST_TMP/g" \
     --resume_checkpoint latest) >"$LAST_OUT" 2>"$LAST_ERR"
rc=$?
[ $rc = 1 ] || case_fail "exit status $rc with a file-size limit below a checkpoint's size, expected 1"
[ "$(grep -c '' "$LAST_ERR")" = 1 ] && grep -q "^train_unet: error: cannot write checkpoint .*File too large" "$LAST_ERR" ||
    { case_fail "not one error line saying File too large:"; head -3 "$LAST_ERR"; }
[ "$(ls "$TEST_TMP/g/checkpoints")" = "$last" ] || case_fail "checkpoints after the failed save: $(ls "$TEST_TMP/g/checkpoints")"
expect_ok train --steps $((stopped + 4)) --run_dir "$TEST_TMP/g" --resume_checkpoint latest --dry_run
case_begin "--microbatch: the batch in pieces trains as the whole batch (20 steps: losses, gradient norms and weights to rounding)"
# The differences are rounding's (the pieces' sums in another order; in BF16 also the kernels' choices
# for another batch size): far below what a gradient of the wrong scale (the loss over a piece, not the
# batch) or another piece's noise or labels would make. AdamW with an epsilon of 1 steps by about lr
# times the gradient's running mean: the weights move with the gradients. (With a small epsilon it
# steps by lr whatever the gradient's size, and gradients that are zero but for rounding, such as
# attention's key biases, would make the two runs' weights differ by lr a step for no fault of either.)
[ "$(cat build/precision)" = FP32 ] && tolerance=1e-4 || tolerance=2e-2
for variant in eps learned; do
    flags=(--steps 20 --save_interval 10 --lr 0.1 --adam_eps 1)
    [ $variant = learned ] && flags+=(--learn_sigma True)
    expect_ok train "${flags[@]}" --run_dir "$TEST_TMP/whole_$variant"
    expect_ok train "${flags[@]}" --microbatch 2 --run_dir "$TEST_TMP/pieces_$variant"
    python3 - "$TEST_TMP/whole_$variant" "$TEST_TMP/pieces_$variant" $tolerance <<'PY' || case_fail "$variant: the pieces' run is not the whole batch's"
import json, math, struct, sys
whole, pieces, tolerance = sys.argv[1], sys.argv[2], float(sys.argv[3])
def log(run):  # step -> (loss, grad_norm)
    rows = [line.split(",") for line in open(run + "/log.csv").read().split("\n")[1:] if line]
    return {r[0]: (float(r[1]), float(r[3])) for r in rows}
def weights(run, step):
    b = open("%s/checkpoints/step_%09d/model.safetensors" % (run, step), "rb").read()
    n = struct.unpack("<Q", b[:8])[0]
    return {k: struct.unpack("<%df" % ((t["data_offsets"][1] - t["data_offsets"][0]) // 4), b[8 + n + t["data_offsets"][0]:8 + n + t["data_offsets"][1]])
            for k, t in json.loads(b[8:8 + n]).items() if k != "__metadata__"}
a, b = log(whole), log(pieces)
worst_log = max(abs(a[s][i] - b[s][i]) / abs(a[s][i]) for s in a for i in (0, 1))
w10, w20, p20 = weights(whole, 10), weights(whole, 20), weights(pieces, 20)
gap = math.sqrt(sum((x - y) ** 2 for k in w20 for x, y in zip(w20[k], p20[k])))
moved = math.sqrt(sum((x - y) ** 2 for k in w20 for x, y in zip(w20[k], w10[k])))
print("  %d steps: losses and gradient norms within %.1e (relative); weights %.1e of their move over steps 11-20" % (len(a), worst_log, gap / moved))
sys.exit(0 if len(a) == 20 and a.keys() == b.keys() and worst_log <= tolerance and gap / moved <= tolerance else 1)
PY
done

case_begin "the upsampler (--super_res 16: 32x32 from 16x16) with a learned variance: trains, resumes exactly, names its sizes, upsamples, cascades"
UPS=(--super_res 16 --learn_sigma True --steps 20)
expect_ok train "${UPS[@]}" --sample_count 5 --run_dir "$TEST_TMP/up_a"
expect_ok train "${UPS[@]}" --stop_step 9 --run_dir "$TEST_TMP/up_b"
expect_ok train "${UPS[@]}" --run_dir "$TEST_TMP/up_b" --resume_checkpoint latest
cmp -s <(cut -d, -f1-4 "$TEST_TMP/up_a/log.csv") <(cut -d, -f1-4 "$TEST_TMP/up_b/log.csv") || case_fail "the resumed run's losses differ"
for f in model.safetensors ema.safetensors state.bin; do
    cmp -s "$TEST_TMP/up_a/checkpoints/step_000000020/$f" "$TEST_TMP/up_b/checkpoints/step_000000020/$f" || case_fail "$f differs"
done
head -c 20000 "$TEST_TMP/up_a/checkpoints/step_000000020/model.safetensors" | grep -aq '"large_size":"32".*"small_size":"16"\|"small_size":"16".*"large_size":"32"' ||
    case_fail "the checkpoint's metadata names no large_size 32 and small_size 16"
# its grid: 5 images of the training data, each as low-res (enlarged) | sample | original, 9 tiles a row
python3 - "$TEST_TMP/up_a/samples/step_000000020.png" "$TEST_TMP/s.bin" <<'PY' || case_fail "the upsampler's grid is not low-res | sample | original"
import struct, sys, zlib
def png(path):  # an 8-bit RGB PNG's pixels, rows unfiltered
    b = open(path, "rb").read()
    w, h = struct.unpack(">II", b[16:24])
    data, at = b"", 8
    while at < len(b):
        n, kind = struct.unpack(">I4s", b[at:at + 8])
        if kind == b"IDAT": data += b[at + 8:at + 8 + n]
        at += 12 + n
    raw, rows, prev = zlib.decompress(data), [], bytearray(3 * w)
    for y in range(h):
        f, line = raw[y * (3 * w + 1)], bytearray(raw[y * (3 * w + 1) + 1:(y + 1) * (3 * w + 1)])
        for i in range(3 * w):
            a, up, c = line[i - 3] if i >= 3 else 0, prev[i], prev[i - 3] if i >= 3 else 0
            p = a + up - c
            pred = [0, a, up, (a + up) // 2, a if abs(p - a) <= abs(p - up) and abs(p - a) <= abs(p - c) else up if abs(p - up) <= abs(p - c) else c][f]
            line[i] = (line[i] + pred) & 255
        rows.append(line); prev = line
    return w, h, rows
w, h, rows = png(sys.argv[1])
d = open(sys.argv[2], "rb").read()
names = struct.unpack_from("<I", d, 36)[0]
labels_at = (64 + names + 7) // 8 * 8
count = struct.unpack_from("<Q", d, 16)[0]
pixels_at = (labels_at + 4 * count + 63) // 64 * 64
image = d[pixels_at:pixels_at + 32 * 32 * 3]  # the first image, 32x32
def tile(k):  # tile k of the grid, 32x32 RGB
    x0, y0 = 2 + (k % 9) * 34, 2 + (k // 9) * 34
    return bytes(b for y in range(32) for b in rows[y0 + y][3 * x0:3 * (x0 + 32)])
low = [round(sum(image[((2 * y + dy) * 32 + 2 * x + dx) * 3 + c] for dy in (0, 1) for dx in (0, 1)) / 4)
       for y in range(16) for x in range(16) for c in range(3)]
enlarged = bytes(low[((y // 2) * 16 + x // 2) * 3 + c] for y in range(32) for x in range(32) for c in range(3))
ok = (w, h) == (9 * 34 + 2, 2 * 34 + 2) and tile(2) == image and tile(0) == enlarged and tile(1) not in (image, enlarged)
print("  grid %dx%d, original tile %s, low-res tile %s" % (w, h, tile(2) == image, tile(0) == enlarged))
sys.exit(0 if ok else 1)
PY
./prepare_data --synthetic shapes --size 16 --count 3 --output "$TEST_TMP/low16.bin" --quiet >/dev/null
expect_ok ./generate --checkpoint "$TEST_TMP/up_a/checkpoints/step_000000020" --low_res "$TEST_TMP/low16.bin" --num 5 --batch 2 \
    --sampler ddpm --steps 10 --out "$TEST_TMP/up_samples"
expect_grep "generate: 3 images of 32x32" "$LAST_OUT"  # --num: at most the file's images
python3 - "$TEST_TMP/up_samples/000002.png" <<'PY' || case_fail "the upsampled images are not 32x32 PNGs"
import struct, sys
b = open(sys.argv[1], "rb").read(24)
sys.exit(0 if b[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", b[16:24]) == (32, 32) else 1)
PY
# the cascade: a 16x16 model of the same classes, then the upsampler
./prepare_data --synthetic shapes --size 16 --count 40 --output "$TEST_TMP/s16.bin" --quiet >/dev/null
expect_ok ./train_unet --data "$TEST_TMP/s16.bin" --image_size 16 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1 \
    --attention_resolutions 8 --class_cond --batch_size 8 --steps 5 --sample_count 0 --run_dir "$TEST_TMP/base16"
expect_ok ./generate --checkpoint "$TEST_TMP/base16/checkpoints/step_000000005" --upsampler "$TEST_TMP/up_a/checkpoints/step_000000020" \
    --num 3 --sampler ddpm --steps 10 --up_steps 8 --out "$TEST_TMP/cascade"
expect_grep "then upsampled to 32x32 .* ddpm with 8 steps" "$LAST_OUT"
[ -f "$TEST_TMP/cascade/base_grid.png" ] || case_fail "the cascade wrote no base_grid.png"
python3 - "$TEST_TMP/cascade/000002.png" <<'PY' || case_fail "the cascade's images are not 32x32 PNGs"
import struct, sys
b = open(sys.argv[1], "rb").read(24)
sys.exit(0 if b[:8] == b"\x89PNG\r\n\x1a\n" and struct.unpack(">II", b[16:24]) == (32, 32) else 1)
PY

case_begin "--use_checkpoint: the gradients bit for bit, so the log, weights, EMA and optimiser state to the byte"
# ARGS: fused attention (32-channel heads), dropout, labels, skip convolutions read in place; the
# second: resampling ResBlocks, scale-shift, a learned variance, the unfused attention (128-channel head).
for variant in base adm; do
    flags=(--steps 10)
    [ $variant = adm ] && flags+=(--num_channels 64 --num_head_channels -1 --num_heads 1 --use_scale_shift_norm True
                                  --resblock_updown True --use_new_attention_order True --learn_sigma True)
    expect_ok train "${flags[@]}" --run_dir "$TEST_TMP/kept_$variant"
    expect_ok train "${flags[@]}" --use_checkpoint --run_dir "$TEST_TMP/recomputed_$variant"
    cmp -s <(cut -d, -f1-4,8- "$TEST_TMP/kept_$variant/log.csv") <(cut -d, -f1-4,8- "$TEST_TMP/recomputed_$variant/log.csv") ||
        case_fail "$variant: the logged losses or gradient norms differ"
    for f in model.safetensors ema.safetensors state.bin; do
        cmp -s "$TEST_TMP/kept_$variant/checkpoints/step_000000010/$f" "$TEST_TMP/recomputed_$variant/checkpoints/step_000000010/$f" ||
            case_fail "$variant: $f differs"
    done
done

case_begin "the noisy classifier (--model classifier): trains on the labels, resumes exactly, logs its accuracy, recomputes to the byte"
CLS=(--data "$TEST_TMP/s.bin" --model classifier --classifier_width 32 --classifier_depth 1 --classifier_attention_resolutions 8
     --batch_size 8 --log_interval 1 --seed 4 --steps 12 --val_data "$TEST_TMP/s.bin" --eval_interval 3)
expect_ok ./train_unet "${CLS[@]}" --run_dir "$TEST_TMP/cls_a"
expect_grep '^step 12/12  loss [0-9.]+  acc@1 [0-9.]+  acc@3 [0-9.]+  val loss [0-9.]+ acc@1 [0-9.]+ acc@3 [0-9.]+  lr 0.0003 ' "$LAST_OUT"
awk -F, 'NR > 1 && (($1 % 3 == 0) != ($22 != "")) { bad = 1 } END { exit bad }' "$TEST_TMP/cls_a/log.csv" ||
    case_fail "log.csv: val_loss is not there exactly at the evaluations (every 3 steps)"
expect_ok ./train_unet "${CLS[@]}" --stop_step 5 --run_dir "$TEST_TMP/cls_b"
expect_ok ./train_unet "${CLS[@]}" --run_dir "$TEST_TMP/cls_b" --resume_checkpoint latest
expect_ok ./train_unet "${CLS[@]}" --use_checkpoint --run_dir "$TEST_TMP/cls_c"
for run in cls_b cls_c; do
    cmp -s <(cut -d, -f1-4,8- "$TEST_TMP/cls_a/log.csv") <(cut -d, -f1-4,8- "$TEST_TMP/$run/log.csv") || case_fail "$run: the log differs"
    for f in model.safetensors state.bin; do
        cmp -s "$TEST_TMP/cls_a/checkpoints/step_000000012/$f" "$TEST_TMP/$run/checkpoints/step_000000012/$f" || case_fail "$run: $f differs"
    done
done
[ -e "$TEST_TMP/cls_a/checkpoints/step_000000012/ema.safetensors" ] && case_fail "an EMA was kept (a classifier's default is none)"
expect_grep '^step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,acc1,acc5,loss_q0,loss_q1,loss_q2,loss_q3,acc1_q0,acc1_q1,acc1_q2,acc1_q3,acc5_q0,acc5_q1,acc5_q2,acc5_q3,val_loss,val_acc1,val_acc5,val_loss_q0,val_loss_q1,val_loss_q2,val_loss_q3,val_acc1_q0,val_acc1_q1,val_acc1_q2,val_acc1_q3,val_acc5_q0,val_acc5_q1,val_acc5_q2,val_acc5_q3$' "$TEST_TMP/cls_a/log.csv"
awk -F, 'NR > 1 && !($8 >= 0 && $8 <= $9 && $9 == 1) { bad = 1 } END { exit bad || NR != 13 }' "$TEST_TMP/cls_a/log.csv" ||
    case_fail "log.csv: acc1 outside [0, acc5], or acc5 (of 3 classes: top 3) not 1: $(sed -n 2p "$TEST_TMP/cls_a/log.csv")"
grep -aq '"classifier_pool":"attention"' "$TEST_TMP/cls_a/checkpoints/step_000000012/model.safetensors" ||
    case_fail "the checkpoint's metadata does not name the classifier's head"
expect_ok ./train_unet "${CLS[@]}" --classifier_pool adaptive --noised False --microbatch 4 --val_data "" --run_dir "$TEST_TMP/cls_adaptive"
awk -F, 'NR > 1 && $11 != "" { bad = 1 } END { exit bad }' "$TEST_TMP/cls_adaptive/log.csv" ||
    case_fail "--noised False: samples outside the first quarter of t (t = 0)"
pools="spatial spatial_v2"  # (the FP32 build's GroupNorm takes at most 1024 channels: not spatial_v2's 2048)
[ "$(cat build/precision)" = FP32 ] && pools=spatial
for pool in $pools; do  # the means of every input block's output: their gradients added as backward reaches them
    expect_ok ./train_unet "${CLS[@]}" --classifier_pool $pool --steps 6 --run_dir "$TEST_TMP/cls_$pool"
    expect_ok ./train_unet "${CLS[@]}" --classifier_pool $pool --steps 6 --use_checkpoint --run_dir "$TEST_TMP/cls_${pool}_recomputed"
    cmp -s "$TEST_TMP/cls_$pool/checkpoints/step_000000006/model.safetensors" "$TEST_TMP/cls_${pool}_recomputed/checkpoints/step_000000006/model.safetensors" ||
        case_fail "$pool: the weights differ with --use_checkpoint"
done

case_begin "FID during training (--eval_num): the training images' statistics, then the EMA samples' FID every --eval_interval steps in log.csv"
./prepare_data --synthetic shapes --count 2100 --size 32 --seed 6 --output "$TEST_TMP/s2100.bin" --quiet >/dev/null
build/test/test_inception --write "$TEST_TMP/inception.safetensors"
expect_ok ./train_unet --data "$TEST_TMP/s2100.bin" --image_size 32 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1 \
    --attention_resolutions 16 --num_head_channels 32 --batch_size 8 --steps 20 --log_interval 10 --eval_interval 10 --eval_num 2200 \
    --sample_steps 5 --sample_count 0 --inception "$TEST_TMP/inception.safetensors" --run_dir "$TEST_TMP/fid"
expect_grep "^FID: the reference statistics of 2100 training images" "$LAST_OUT"
expect_grep "^FID at step 10: [0-9]+\.[0-9]{4} \(2200 samples against 2100 training images" "$LAST_OUT"
expect_grep "^FID at step 20: [0-9]+\.[0-9]{4} " "$LAST_OUT"
expect_grep ',loss_q3,fid$' "$TEST_TMP/fid/log.csv"
for step in 10 20; do  # the row's fid is the one printed
    printed=$(sed -n "s/^FID at step $step: \([0-9.]*\) .*/\1/p" "$LAST_OUT")
    logged=$(awk -F, -v s=$step '$1 == s { print $NF }' "$TEST_TMP/fid/log.csv")
    [ -n "$printed" ] && [ "$printed" = "$logged" ] || case_fail "step $step: log.csv's fid '$logged', printed '$printed'"
done
grep -q '>FID: ' "$TEST_TMP/fid/fid.svg" && grep -q 'id="loss-smoothed"' "$TEST_TMP/fid/fid.svg" || case_fail "fid.svg is missing or not a chart of the FIDs"
FID_ARGS=(--data "$TEST_TMP/s2100.bin" --image_size 32 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1 --attention_resolutions 16
          --num_head_channels 32 --batch_size 8 --steps 20 --log_interval 10 --eval_interval 10 --eval_num 2200 --sample_steps 5
          --sample_count 0 --inception "$TEST_TMP/inception.safetensors" --run_dir "$TEST_TMP/fid_resumed")
expect_ok ./train_unet "${FID_ARGS[@]}" --stop_step 10
expect_ok ./train_unet "${FID_ARGS[@]}" --resume_checkpoint latest
cmp -s <(cut -d, -f1-4,14 "$TEST_TMP/fid/log.csv") <(cut -d, -f1-4,14 "$TEST_TMP/fid_resumed/log.csv") ||
    case_fail "a resumed run's losses and FIDs differ from the straight run's"
fid_points() { grep -o '<polyline id="loss"[^>]*points="[^"]*"' "$1"; }
[ "$(fid_points "$TEST_TMP/fid_resumed/fid.svg" | grep -o ',' | wc -l)" = 2 ] &&
    [ "$(fid_points "$TEST_TMP/fid_resumed/fid.svg")" = "$(fid_points "$TEST_TMP/fid/fid.svg")" ] ||
    case_fail "the resumed run's fid.svg does not hold both evaluations as the straight run's does"

case_begin "a dataset in parts (--data a.bin,b.bin,c.bin and @list) trains as the whole file: losses, weights, FID's reference"
# The parts are the whole file's images cut in three runs, each with the whole file's class table
# (as prepare_data --part writes them); the loader numbers them part after part.
python3 - "$TEST_TMP/s2100.bin" "$TEST_TMP/part" <<'PY'
import struct, sys
b = open(sys.argv[1], 'rb').read()
count, h, w, ncls, nbytes = struct.unpack_from('<Q', b, 16)[0], *struct.unpack_from('<IIII', b, 24)
align = lambda x, a: (x + a - 1) // a * a
labels_at = align(64 + nbytes, 8)
pixels_at, n = align(labels_at + 4 * count, 64), h * w * 3
cuts = [0, 700, 1500, count]
for k in range(3):
    first, last = cuts[k], cuts[k + 1]
    header = bytearray(b[:labels_at])
    struct.pack_into('<Q', header, 16, last - first)
    labels = b[labels_at + 4 * first:labels_at + 4 * last]
    pad = align(labels_at + len(labels), 64) - labels_at - len(labels)
    with open('%s%d.bin' % (sys.argv[2], k), 'wb') as f:
        f.write(bytes(header) + labels + bytes(pad) + b[pixels_at + first * n:pixels_at + last * n])
PY
PART_ARGS=(--image_size 32 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1 --attention_resolutions 16 --num_head_channels 32
           --class_cond --batch_size 8 --steps 12 --log_interval 1 --eval_interval 12 --eval_num 2200 --sample_steps 5 --sample_count 0
           --inception "$TEST_TMP/inception.safetensors" --seed 4)
printf '%s\n' "$TEST_TMP/part0.bin" "$TEST_TMP/part1.bin" "$TEST_TMP/part2.bin" >"$TEST_TMP/parts.txt"
expect_ok ./train_unet "${PART_ARGS[@]}" --data "$TEST_TMP/s2100.bin" --run_dir "$TEST_TMP/whole"
expect_ok ./train_unet "${PART_ARGS[@]}" --data "$TEST_TMP/part0.bin,$TEST_TMP/part1.bin,$TEST_TMP/part2.bin" --run_dir "$TEST_TMP/parts"
expect_grep "^FID: the reference statistics of 2100 training images" "$LAST_OUT"
expect_ok ./train_unet "${PART_ARGS[@]}" --data "@$TEST_TMP/parts.txt" --run_dir "$TEST_TMP/list"
for run in parts list; do
    cmp -s <(cut -d, -f1-4,8- "$TEST_TMP/whole/log.csv") <(cut -d, -f1-4,8- "$TEST_TMP/$run/log.csv") ||
        case_fail "$run: log.csv's losses or FID differ from the whole file's"
    for f in model.safetensors ema.safetensors state.bin; do
        cmp -s "$TEST_TMP/whole/checkpoints/step_000000012/$f" "$TEST_TMP/$run/checkpoints/step_000000012/$f" || case_fail "$run: $f differs"
    done
done

case_summary
