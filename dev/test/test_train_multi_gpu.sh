#!/usr/bin/env bash
# test_train_multi_gpu.sh: training on many GPUs (one process each, NCCL). On any GPU machine: a
# team of one rank trains exactly as a process alone (through NCCL, its all-reduces in the step's
# graph, the id file; or met over TCP), and --gpus beyond the machine's GPUs is one error line. With two GPUs or
# more: 2 GPUs at batch B against 1 GPU at batch 2B (losses, weights equal on both ranks), resume
# of a 2-GPU checkpoint on 1 GPU, two ranks started by hand (RANK, WORLD_SIZE, LOCAL_RANK), a killed
# rank stopping the other within 60 s, two machines rehearsed as two process groups met over TCP
# (training as --gpus 2; either rank killed: the other stops naming it, the last checkpoint
# resumes; on four GPUs, four nodes where rank 2 is killed: the three others name it), and
# Ctrl-C on --gpus saving one checkpoint; the schedule
# sampler loss-second-moment fed every rank's losses (a team of one exactly as alone; two ranks
# holding the same history); --microbatch with the all-reduce (a team of one exactly as alone; two
# ranks as the whole batch); the noisy classifier on 2 GPUs and in pieces, as its whole batch.
# The launchers, each skipped with one line where it is not installed: on one GPU, a team of one
# started by torchrun (its agent's store), mpirun and srun's variables trains exactly as alone, and
# torchrun's restart continues the failed attempt's run from its checkpoint to the same log and
# weights; on two, torchrun (--standalone, and two nodes with c10d) and mpirun train as --gpus 2,
# and a resume on two nodes where only rank 0's run folder holds the checkpoint continues the run.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
./prepare_data --synthetic shapes --count 300 --size 32 --seed 5 --output "$TEST_TMP/s.bin" --quiet >/dev/null
# test_train_gpu.sh's small model: dropout, label dropout, warm-up, cosine decay and clipping, so
# that every random draw and the team's loss and gradient norm take part.
ARGS=(--data "$TEST_TMP/s.bin" --image_size 32 --num_channels 32 --channel_mult 1,2 --num_res_blocks 1
      --attention_resolutions 16 --num_head_channels 32 --class_cond --cfg_dropout 0.2 --dropout 0.1
      --lr 1e-3 --warmup_steps 5 --lr_decay cosine --grad_clip 1.0 --log_interval 1 --sample_count 0 --seed 3)
train() { ./train_unet "${ARGS[@]}" "$@"; }
rows() { cut -d, -f1-4 "$1/log.csv" | tail -n +2; }  # step, loss, lr, gradient norm

# The largest relative difference of the losses of two logs (their common steps).
loss_gap() {
    python3 - "$1" "$2" <<'PY'
import csv, sys
a, b = ({int(r["step"]): float(r["loss"]) for r in csv.DictReader(open(p))} for p in sys.argv[1:3])
steps = sorted(set(a) & set(b))
print(max(abs(a[s] - b[s]) / abs(b[s]) for s in steps) if steps else "none")
PY
}
below() { python3 -c "import sys; sys.exit(0 if '$1' != 'none' and float('$1') < float('$2') else 1)"; }

case_begin "a team of one rank (RANK=0 WORLD_SIZE=1 LOCAL_RANK=0) trains exactly as a process alone"
expect_ok train --batch_size 8 --steps 12 --run_dir "$TEST_TMP/alone"
expect_ok env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ./train_unet "${ARGS[@]}" --batch_size 8 --steps 12 --run_dir "$TEST_TMP/team1"
[ "$(rows "$TEST_TMP/team1" | wc -l)" = 12 ] || case_fail "the team's log.csv has $(rows "$TEST_TMP/team1" | wc -l) steps, not 12"
cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/team1") || case_fail "the logged losses differ"
for f in model.safetensors state.bin; do
    cmp -s "$TEST_TMP/alone/checkpoints/step_000000012/$f" "$TEST_TMP/team1/checkpoints/step_000000012/$f" || case_fail "$f differs"
done
ls "$TEST_TMP/team1" | grep -q nccl_id && case_fail "the NCCL id file was left in the run folder"

# The schedule sampler on 50 timesteps: full after a few dozen steps of 16 images.
LSM=(--diffusion_steps 50 --schedule_sampler loss-second-moment --learn_sigma True --log_interval 5 --sample_steps 10)
case_begin "the TCP rendezvous (MASTER_ADDR and MASTER_PORT, or --rdzv): a team of one rank meets there and trains exactly as alone"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
expect_ok env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT="$port" ./train_unet "${ARGS[@]}" --batch_size 8 --steps 12 \
    --run_dir "$TEST_TMP/team1_tcp"
expect_grep "^rendezvous: 1 rank met at 127.0.0.1:$port$" "$LAST_OUT"
cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/team1_tcp") || case_fail "the logged losses differ (MASTER_ADDR)"
expect_ok env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ./train_unet "${ARGS[@]}" --batch_size 8 --steps 12 --rdzv "localhost:$port" \
    --run_dir "$TEST_TMP/team1_rdzv"
expect_grep "^rendezvous: 1 rank met at localhost:$port$" "$LAST_OUT"
cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/team1_rdzv") || case_fail "the logged losses differ (--rdzv)"

case_begin "loss-second-moment: a team of one (the losses gathered through NCCL) trains exactly as a process alone"
expect_ok train "${LSM[@]}" --batch_size 16 --steps 80 --run_dir "$TEST_TMP/lsm_alone"
expect_ok env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ./train_unet "${ARGS[@]}" "${LSM[@]}" --batch_size 16 --steps 80 --run_dir "$TEST_TMP/lsm_team1"
for f in model.safetensors state.bin; do
    cmp -s "$TEST_TMP/lsm_alone/checkpoints/step_000000080/$f" "$TEST_TMP/lsm_team1/checkpoints/step_000000080/$f" || case_fail "$f differs"
done

case_begin "--microbatch: a team of one (each bucket's pieces summed before its all-reduce) trains exactly as a process alone"
expect_ok train --batch_size 8 --microbatch 2 --steps 12 --run_dir "$TEST_TMP/pieces_alone"
expect_ok env RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 ./train_unet "${ARGS[@]}" --batch_size 8 --microbatch 2 --steps 12 --run_dir "$TEST_TMP/pieces_team1"
cmp -s <(rows "$TEST_TMP/pieces_alone") <(rows "$TEST_TMP/pieces_team1") || case_fail "the logged losses differ"
for f in model.safetensors state.bin; do
    cmp -s "$TEST_TMP/pieces_alone/checkpoints/step_000000012/$f" "$TEST_TMP/pieces_team1/checkpoints/step_000000012/$f" || case_fail "$f differs"
done

# The launchers, for real where installed: a team of one rank started by each trains exactly as a
# process alone; a torchrun restart continues its run. (Each skipped with one line where absent.)
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
# torchrun's first attempt stops after step $STOP (saving a checkpoint) and fails; its restart runs the command as given.
cat >"$TEST_TMP/attempt.sh" <<'SH'
#!/bin/sh
if [ "$TORCHELASTIC_RESTART_COUNT" = 0 ]; then ./train_unet "$@" --stop_step "$STOP"; exit 1; fi
exec ./train_unet "$@"
SH
if command -v torchrun >/dev/null 2>&1; then
    case_begin "torchrun --standalone --nproc_per_node 1: a team of one met in torchrun's agent store trains exactly as alone"
    expect_ok torchrun --standalone --nproc_per_node 1 --no-python ./train_unet "${ARGS[@]}" --batch_size 8 --steps 12 --run_dir "$TEST_TMP/torchrun1"
    expect_grep "^rendezvous: 1 rank met in torchrun's store at " "$LAST_OUT"
    cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/torchrun1") || case_fail "the logged losses differ"
    cmp -s "$TEST_TMP/alone/checkpoints/step_000000012/model.safetensors" "$TEST_TMP/torchrun1/checkpoints/step_000000012/model.safetensors" ||
        case_fail "the weights differ"

    case_begin "torchrun --max-restarts 1: the restart continues the failed attempt's run from its last checkpoint, as a run that never failed"
    expect_ok env STOP=7 torchrun --standalone --nproc_per_node 1 --max-restarts 1 --no-python sh "$TEST_TMP/attempt.sh" "${ARGS[@]}" \
        --batch_size 8 --steps 12 --save_interval 5 --run_dir "$TEST_TMP/restarted"
    expect_grep "^torchrun restart 1: continuing the run from .*/restarted/checkpoints/step_000000007$" "$LAST_OUT"
    expect_grep "^resumed from .*step_000000007 at step 7$" "$LAST_OUT"
    cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/restarted") || case_fail "the logged losses differ from the run that never failed"
    cmp -s "$TEST_TMP/alone/checkpoints/step_000000012/model.safetensors" "$TEST_TMP/restarted/checkpoints/step_000000012/model.safetensors" ||
        case_fail "the weights differ from the run that never failed"
else
    echo "torchrun is not installed: its cases are not run"
fi
if command -v mpirun >/dev/null 2>&1; then
    case_begin "mpirun -np 1 -x MASTER_ADDR -x MASTER_PORT: a team of one met over TCP trains exactly as alone"
    port=$(free_port)
    expect_ok mpirun --allow-run-as-root --oversubscribe -np 1 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$port" ./train_unet "${ARGS[@]}" \
        --batch_size 8 --steps 12 --run_dir "$TEST_TMP/mpirun1"
    cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/mpirun1") || case_fail "the logged losses differ"
else
    echo "mpirun is not installed: its case is not run"
fi
case_begin "srun's variables (SLURM_PROCID, SLURM_STEP_NUM_TASKS, SLURM_LOCALID, its job and step) for one task: trains exactly as alone"
expect_ok env SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=1 SLURM_LOCALID=0 SLURM_JOB_ID=41 SLURM_STEP_ID=0 SLURM_NTASKS=1 \
    MASTER_ADDR=127.0.0.1 MASTER_PORT="$(free_port)" ./train_unet "${ARGS[@]}" --batch_size 8 --steps 12 --run_dir "$TEST_TMP/srun1"
cmp -s <(rows "$TEST_TMP/alone") <(rows "$TEST_TMP/srun1") || case_fail "the logged losses differ"

case_begin "--gpus beyond this machine's GPUs: one error line"
expect_fail train --batch_size 8 --steps 2 --gpus $((gpus + 1)) --run_dir "$TEST_TMP/too_many"
expect_grep "^train_unet: error: --gpus $((gpus + 1)), but this machine shows $gpus GPU" "$LAST_ERR"

if [ "$gpus" -lt 2 ]; then
    echo "the cases on two GPUs are not run: this machine shows $gpus"
    case_summary
    exit $?
fi

case_begin "2 GPUs at batch 8 equal 1 GPU at batch 16: the same losses within bf16 noise, equal weights on both ranks"
expect_ok train --batch_size 16 --steps 50 --run_dir "$TEST_TMP/one"
expect_ok train --batch_size 8 --gpus 2 --steps 50 --run_dir "$TEST_TMP/two"
expect_grep "^training on 2 GPUs" "$LAST_OUT"
grep -c "weights hash" "$LAST_ERR" | grep -qx 2 || case_fail "expected a weights hash from each of the 2 ranks"
[ "$(grep "weights hash" "$LAST_ERR" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
[ "$(rows "$TEST_TMP/two" | wc -l)" = 50 ] || case_fail "log.csv of the 2-GPU run has $(rows "$TEST_TMP/two" | wc -l) steps"
gap=$(loss_gap "$TEST_TMP/one/log.csv" "$TEST_TMP/two/log.csv")
echo "  largest relative loss difference over 50 steps: $gap"
below "$gap" 0.02 || case_fail "losses differ by $gap (relative) between 2x8 and 1x16"
first=$(loss_gap <(head -2 "$TEST_TMP/one/log.csv") <(head -2 "$TEST_TMP/two/log.csv"))
below "$first" 1e-3 || case_fail "step 1's losses differ by $first (the same images, noise and weights)"

case_begin "loss-second-moment on 2 GPUs: both ranks draw from the same history (equal weights), its losses near 1 GPU's"
expect_ok train "${LSM[@]}" --batch_size 16 --steps 80 --run_dir "$TEST_TMP/lsm_one"
expect_ok train "${LSM[@]}" --batch_size 8 --gpus 2 --steps 80 --run_dir "$TEST_TMP/lsm_two"
[ "$(grep "weights hash" "$LAST_ERR" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
first=$(loss_gap <(head -2 "$TEST_TMP/lsm_one/log.csv") <(head -2 "$TEST_TMP/lsm_two/log.csv"))
echo "  steps 1-5: relative loss difference $first"
below "$first" 1e-2 || case_fail "the first interval's losses differ by $first (the same draws before the history is full)"

case_begin "--microbatch on 2 GPUs: pieces of 2 train as the whole batch of 8 a GPU (losses within rounding, equal weights on both ranks)"
expect_ok train --batch_size 8 --microbatch 2 --gpus 2 --steps 50 --run_dir "$TEST_TMP/two_pieces"
[ "$(grep "weights hash" "$LAST_ERR" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
gap=$(loss_gap "$TEST_TMP/two/log.csv" "$TEST_TMP/two_pieces/log.csv")
echo "  largest relative loss difference over 50 steps: $gap"
below "$gap" 0.02 || case_fail "losses differ by $gap (relative) between pieces and the whole batch"

case_begin "the noisy classifier on 2 GPUs at batch 8 equals 1 GPU at batch 16 (equal weights on both ranks); --microbatch 4 the whole batch"
CLS=(--data "$TEST_TMP/s.bin" --image_size 32 --model classifier --classifier_width 32 --classifier_depth 1
     --classifier_attention_resolutions 16 --lr 1e-3 --log_interval 1 --seed 3)
expect_ok ./train_unet "${CLS[@]}" --batch_size 16 --steps 30 --run_dir "$TEST_TMP/cls_one"
expect_ok ./train_unet "${CLS[@]}" --batch_size 8 --gpus 2 --steps 30 --run_dir "$TEST_TMP/cls_two"
[ "$(grep "weights hash" "$LAST_ERR" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
gap=$(loss_gap "$TEST_TMP/cls_one/log.csv" "$TEST_TMP/cls_two/log.csv")
first=$(loss_gap <(head -2 "$TEST_TMP/cls_one/log.csv") <(head -2 "$TEST_TMP/cls_two/log.csv"))
echo "  largest relative loss difference over 30 steps: $gap (step 1: $first)"
below "$gap" 0.02 || case_fail "losses differ by $gap (relative) between 2x8 and 1x16"
below "$first" 1e-3 || case_fail "step 1's losses differ by $first (the same images, noise and weights)"
expect_ok ./train_unet "${CLS[@]}" --batch_size 16 --microbatch 4 --steps 30 --run_dir "$TEST_TMP/cls_pieces"
gap=$(loss_gap "$TEST_TMP/cls_one/log.csv" "$TEST_TMP/cls_pieces/log.csv")
echo "  --microbatch 4 against the whole batch of 16: largest relative loss difference $gap"
below "$gap" 0.02 || case_fail "losses differ by $gap (relative) between pieces and the whole batch"

case_begin "a 2-GPU checkpoint resumed on 1 GPU at the same images a step continues the same loss curve"
expect_ok train --batch_size 8 --gpus 2 --steps 50 --stop_step 30 --run_dir "$TEST_TMP/resumed"
expect_ok train --batch_size 16 --steps 50 --run_dir "$TEST_TMP/resumed" --resume_checkpoint latest
expect_grep "resumed from .*step_000000030 at step 30" "$LAST_OUT"
gap=$(loss_gap <(sed -n '1p;32,$p' "$TEST_TMP/resumed/log.csv") "$TEST_TMP/one/log.csv")
echo "  largest relative loss difference, steps 31-50: $gap"
below "$gap" 0.02 || case_fail "the resumed run's losses differ by $gap from the 1-GPU run's"
expect_fail train --batch_size 8 --steps 50 --run_dir "$TEST_TMP/resumed" --resume_checkpoint latest
expect_grep "another configuration: --batch_size 8 \(checkpoint: 16\)" "$LAST_ERR"
expect_ok train --batch_size 8 --gpus 2 --steps 60 --run_dir "$TEST_TMP/resumed" --resume_checkpoint latest
expect_grep "resumed from .*step_000000050 at step 50" "$LAST_OUT"

case_begin "two ranks started by hand (RANK, WORLD_SIZE, LOCAL_RANK) train as --gpus 2 does"
for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r ./train_unet "${ARGS[@]}" --batch_size 8 --steps 50 --run_dir "$TEST_TMP/hand" \
        >"$TEST_TMP/hand$r.out" 2>&1 &
    pids[$r]=$!
done
wait "${pids[0]}" || case_fail "rank 0 exited $?"
wait "${pids[1]}" || case_fail "rank 1 exited $?"
cmp -s <(rows "$TEST_TMP/two") <(rows "$TEST_TMP/hand") || case_fail "the logged losses differ from --gpus 2's"
[ -s "$TEST_TMP/hand1.out" ] && ! grep -qv "weights hash" "$TEST_TMP/hand1.out" ||
    { grep -v "weights hash" "$TEST_TMP/hand1.out" | head -3; case_fail "rank 1 printed more than its weights hash"; }

# Waits up to 300 s for a line matching $2 in file $1.
wait_for() { for _ in $(seq 3000); do grep -qE "$2" "$1" 2>/dev/null && return 0; sleep 0.1; done; return 1; }

case_begin "--gpus 2: a rank killed mid-run stops the other within 60 s, and the launcher says which"
# (train_unet itself in the background, not through train(): $! must be the launcher)
./train_unet "${ARGS[@]}" --batch_size 8 --gpus 2 --steps 1000000 --run_dir "$TEST_TMP/killed" >"$TEST_TMP/killed.out" \
    2>"$TEST_TMP/killed.err" &
launcher=$!
wait_for "$TEST_TMP/killed.out" "^step 20/" || case_fail "no step 20 in 300 s"
kill -9 "$(pgrep -P $launcher | sort -n | tail -n 1)"  # the second rank started
start=$(date +%s)
wait $launcher; rc=$?
took=$(( $(date +%s) - start ))
[ $rc != 0 ] || case_fail "the launcher exited 0"
[ $took -le 60 ] || case_fail "it took $took s to stop"
expect_grep "rank [01] was killed by signal 9; stopping the other ranks" "$TEST_TMP/killed.err"
expect_grep "rank [01]: error: another rank of this run failed; stopping in step" "$TEST_TMP/killed.err"
pgrep -f "$TEST_TMP/killed" >/dev/null && case_fail "a rank is still running"

case_begin "ranks started by hand: one killed, the other stops within 60 s with one line"
for r in 0 1; do
    RANK=$r WORLD_SIZE=2 LOCAL_RANK=$r ./train_unet "${ARGS[@]}" --batch_size 8 --steps 1000000 --run_dir "$TEST_TMP/hand_killed" \
        >"$TEST_TMP/hk$r.out" 2>"$TEST_TMP/hk$r.err" &
    pids[$r]=$!
done
wait_for "$TEST_TMP/hk0.out" "^step 20/" || case_fail "no step 20 in 300 s"
kill -9 "${pids[1]}"
start=$(date +%s)
wait "${pids[0]}"; rc=$?
took=$(( $(date +%s) - start ))
[ $rc = 1 ] || case_fail "rank 0 exited $rc, not 1"
[ $took -le 60 ] || case_fail "it took $took s to stop"
expect_grep "^train_unet rank 0: error: step [0-9]+ has not finished after [0-9]+ s: another rank" "$TEST_TMP/hk0.err"
[ "$(grep -c error "$TEST_TMP/hk0.err")" = 1 ] || case_fail "rank 0 printed $(grep -c error "$TEST_TMP/hk0.err") error lines"

# Two machines rehearsed on one: two process groups (setsid), each rank alone on its GPU as local
# rank 0 (CUDA_VISIBLE_DEVICES), in a run folder of its own (no shared file system), met over TCP.
# (A script runs without job control, so its background child leads no process group and setsid
# makes it one without forking: $! is the rank itself.)
# start_nodes NAME PORT OPTIONS...: node r's rank r in $TEST_TMP/NAME$r/run, its pid in nodes[r];
# NODES nodes (2 when not set), a GPU each.
start_nodes() {
    local name=$1 port=$2 r
    shift 2
    for r in $(seq 0 $((${NODES:-2} - 1))); do
        mkdir -p "$TEST_TMP/$name$r"
        CUDA_VISIBLE_DEVICES=$r RANK=$r WORLD_SIZE=${NODES:-2} LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=$port setsid ./train_unet "${ARGS[@]}" \
            "$@" --run_dir "$TEST_TMP/$name$r/run" >"$TEST_TMP/$name$r/out" 2>"$TEST_TMP/$name$r/err" &
        nodes[$r]=$!
    done
}

case_begin "two nodes rehearsed as two process groups (one GPU each, own run folders, TCP on 127.0.0.1) train as --gpus 2 does"
port=$(free_port)
start_nodes node "$port" --batch_size 8 --steps 50
wait "${nodes[0]}" || case_fail "node 0's rank exited $?"
wait "${nodes[1]}" || case_fail "node 1's rank exited $?"
expect_grep "^rendezvous: 2 ranks met at 127.0.0.1:$port$" "$TEST_TMP/node0/out"
cmp -s <(rows "$TEST_TMP/two") <(rows "$TEST_TMP/node0/run") || case_fail "the logged losses differ from --gpus 2's"
[ "$(cat "$TEST_TMP"/node[01]/err | grep -c "weights hash")" = 2 ] || case_fail "expected a weights hash from each of the 2 ranks"
[ "$(cat "$TEST_TMP"/node[01]/err | grep "weights hash" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
[ -e "$TEST_TMP/node1/run" ] && case_fail "node 1's rank wrote a run folder"

case_begin "no shared disk: a resume on two nodes where only rank 0's folder holds the checkpoint continues as --gpus 2's run"
start_nodes shareless "$(free_port)" --batch_size 8 --steps 50 --stop_step 30
wait "${nodes[0]}" || case_fail "node 0's rank exited $?"
wait "${nodes[1]}" || case_fail "node 1's rank exited $?"
start_nodes shareless "$(free_port)" --batch_size 8 --steps 50 --resume_checkpoint latest
wait "${nodes[0]}" || case_fail "node 0's rank exited $? on resume"
wait "${nodes[1]}" || { case_fail "node 1's rank exited $? on resume"; head -3 "$TEST_TMP/shareless1/err"; }
expect_grep "^resumed from .*step_000000030 at step 30$" "$TEST_TMP/shareless0/out"
cmp -s <(rows "$TEST_TMP/two") <(rows "$TEST_TMP/shareless0/run") || case_fail "the logged losses differ from --gpus 2's"
[ "$(cat "$TEST_TMP"/shareless[01]/err | grep "weights hash" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
[ -e "$TEST_TMP/shareless1/run" ] && case_fail "node 1's rank wrote a run folder"

if command -v torchrun >/dev/null 2>&1; then
    case_begin "torchrun --nproc_per_node 2 (its agent's store) trains as --gpus 2 does"
    expect_ok torchrun --standalone --nproc_per_node 2 --no-python ./train_unet "${ARGS[@]}" --batch_size 8 --steps 50 --run_dir "$TEST_TMP/torchrun2"
    cmp -s <(rows "$TEST_TMP/two") <(rows "$TEST_TMP/torchrun2") || case_fail "the logged losses differ from --gpus 2's"

    case_begin "torchrun as two nodes (--nnodes 2 --rdzv-backend c10d, one GPU each, own run folders) trains as --gpus 2 does"
    port=$(free_port)
    for k in 0 1; do
        mkdir -p "$TEST_TMP/tnode$k"
        CUDA_VISIBLE_DEVICES=$k torchrun --nnodes 2 --node_rank $k --nproc_per_node 1 --rdzv-backend c10d --rdzv-endpoint "127.0.0.1:$port" \
            --no-python ./train_unet "${ARGS[@]}" --batch_size 8 --steps 50 --run_dir "$TEST_TMP/tnode$k/run" \
            >"$TEST_TMP/tnode$k/out" 2>"$TEST_TMP/tnode$k/err" &
        nodes[$k]=$!
    done
    wait "${nodes[0]}" || case_fail "node 0's torchrun exited $?"
    wait "${nodes[1]}" || case_fail "node 1's torchrun exited $?"
    written=$(ls -d "$TEST_TMP"/tnode[01]/run 2>/dev/null)  # (c10d chooses which node's worker is rank 0)
    [ "$(echo "$written" | wc -w)" = 1 ] || case_fail "run folders written: $written (rank 0's alone expected)"
    cmp -s <(rows "$TEST_TMP/two") <(rows $written) || case_fail "the logged losses differ from --gpus 2's"
else
    echo "torchrun is not installed: its cases on two GPUs are not run"
fi
if command -v mpirun >/dev/null 2>&1; then
    case_begin "mpirun -np 2 -x MASTER_ADDR -x MASTER_PORT trains as --gpus 2 does"
    expect_ok mpirun --allow-run-as-root --oversubscribe -np 2 -x MASTER_ADDR=127.0.0.1 -x MASTER_PORT="$(free_port)" ./train_unet "${ARGS[@]}" \
        --batch_size 8 --steps 50 --run_dir "$TEST_TMP/mpirun2"
    cmp -s <(rows "$TEST_TMP/two") <(rows "$TEST_TMP/mpirun2") || case_fail "the logged losses differ from --gpus 2's"
else
    echo "mpirun is not installed: its case on two GPUs is not run"
fi

# A rank that dies stops the others, which name it: its connection from the rendezvous closes.
# Rank 0, which saves, survives rank 1 and resumes from its last checkpoint; rank 1 survives rank 0
# in a run that saves only at its end.
for victim in 1 0; do
    survivor=$((1 - victim))
    case_begin "two nodes over TCP: rank $victim killed mid-run, rank $survivor stops within 60 s with one line naming it$([ $victim = 1 ] && echo ", the last checkpoint resumes")"
    start_nodes "killed$victim" "$(free_port)" --batch_size 8 --steps 1000000 --save_interval $([ $victim = 1 ] && echo 10 || echo 1000000)
    wait_for "$TEST_TMP/killed${victim}0/out" "^step 20/" || case_fail "no step 20 in 300 s"
    kill -9 "${nodes[$victim]}"
    start=$(date +%s)
    wait "${nodes[$survivor]}"; rc=$?
    took=$(( $(date +%s) - start ))
    wait "${nodes[$victim]}"
    [ $rc = 1 ] || case_fail "rank $survivor exited $rc, not 1"
    [ $took -le 60 ] || case_fail "it took $took s to stop"
    expect_grep "^train_unet rank $survivor: error: rank $victim of this run has stopped; stopping in step [0-9]+$" "$TEST_TMP/killed$victim$survivor/err"
    [ "$(grep -c error "$TEST_TMP/killed$victim$survivor/err")" = 1 ] || case_fail "rank $survivor printed more than one error line"
    if [ $victim = 1 ]; then
        expect_ok train --batch_size 16 --steps 40 --run_dir "$TEST_TMP/killed10/run" --resume_checkpoint latest
        expect_grep "^resumed from .*step_0000000[0-9]0 at step [0-9]+0$" "$LAST_OUT"
    fi
done

if [ "$gpus" -ge 4 ]; then
    case_begin "four nodes over TCP: rank 2 killed mid-run, ranks 0, 1 and 3 stop within 60 s, each with one line naming rank 2"
    NODES=4 start_nodes killed4 "$(free_port)" --batch_size 4 --steps 1000000 --save_interval 1000000
    wait_for "$TEST_TMP/killed40/out" "^step 20/" || case_fail "no step 20 in 300 s"
    kill -9 "${nodes[2]}"
    start=$(date +%s)
    for r in 0 1 3; do
        wait "${nodes[$r]}"; rc=$?
        [ $rc = 1 ] || case_fail "rank $r exited $rc, not 1"
        expect_grep "^train_unet rank $r: error: rank 2 of this run has stopped; stopping in step [0-9]+$" "$TEST_TMP/killed4$r/err"
        [ "$(grep -c error "$TEST_TMP/killed4$r/err")" = 1 ] || case_fail "rank $r printed more than one error line"
    done
    took=$(( $(date +%s) - start ))
    [ $took -le 60 ] || case_fail "it took $took s to stop"
    wait "${nodes[2]}"
fi

case_begin "--gpus 2: Ctrl-C (SIGINT to the launcher) stops both ranks after one step, saves a checkpoint, exits 0"
./train_unet "${ARGS[@]}" --batch_size 8 --gpus 2 --steps 1000000 --run_dir "$TEST_TMP/int" >"$TEST_TMP/int.out" \
    2>"$TEST_TMP/int.err" &
launcher=$!
wait_for "$TEST_TMP/int.out" "^step 10/" || case_fail "no step 10 in 300 s"
kill -INT $launcher
wait $launcher; rc=$?
[ $rc = 0 ] || { case_fail "exit status $rc"; head -3 "$TEST_TMP/int.err"; }
expect_grep "^stopped at step [0-9]+: checkpoint .*/checkpoints/step_" "$TEST_TMP/int.out"
[ "$(grep -c "weights hash" "$TEST_TMP/int.err")" = 2 ] || case_fail "expected a weights hash from each of the 2 ranks"
[ "$(grep "weights hash" "$TEST_TMP/int.err" | awk '{print $6}' | sort -u | wc -l)" = 1 ] || case_fail "the ranks' weights differ"
case_summary
