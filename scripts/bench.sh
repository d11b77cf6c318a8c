#!/usr/bin/env bash
# bench.sh [PRESET:BATCH ...]: our training step (./train_unet --bench) and the PyTorch reference
# (scripts/bench_torch.py: eager bf16, torch.compile, torch.compile with CUDA graphs) on the same
# configurations, one after the other in one run; prints a table of medians and the ratios
# (PyTorch time / ours: above 1 means we are faster), and the peak GPU memory of ours and of
# PyTorch's last mode (torch.cuda.max_memory_allocated; ours counts every allocation). Both steps
# are guided-diffusion's: forward, loss, backward, the gradient norm, AdamW, the EMA of the weights.
# Default: seed:32 seed:128. BENCH_MODES="eager compile reduce-overhead" picks the PyTorch modes
# (BENCH_MODES= empty: ours alone, as for a scaling table);
# BENCH_STEPS the steps timed; BENCH_TORCH_FLAGS more flags for bench_torch.py (--bare: PyTorch's
# step without the gradient norm and the EMA, less work than ours).
# Then sampling: DDIM with 50 steps, 256 images of the seed preset in one batch, `generate --bench`
# against scripts/sample_torch.py in the same modes (images/s: above 1 means we are faster), plain,
# with classifier-free guidance 3 on a class-conditional model (the model on 512 a step), and with
# classifier guidance 1 (an unconditional model and train_unet's default noisy classifier, whose
# forward and backward passes run every step).
# BENCH_SAMPLE=0 leaves it out. BENCH_GPUS=N (N > 1) adds a scaling table: each configuration
# trained with --gpus N at the same batch per GPU, its images/s against one GPU's (ideal: N x).
# Each program's output goes to stderr as it runs (what a run cut
# short by a time limit has measured is not lost); the table comes last, on stdout.
set -euo pipefail
cd "$(dirname "$0")/.."
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(seed:32 seed:128)
modes=${BENCH_MODES-eager compile reduce-overhead}
steps=${BENCH_STEPS:-50}
# ratio_cells EXPR OURS MODE=THEIRS...: one table cell per mode, "theirs (ratio)", the ratio being
# EXPR of a = theirs and b = ours (times: a / b; rates: b / a; above 1: we are faster).
ratio_cells() {
    local expr=$1 ours=$2 cell theirs
    shift 2
    for cell in "$@"; do
        theirs=${cell#*=}
        if [ "$theirs" = failed ]; then printf ' %26s' failed
        else printf ' %26s' "$theirs ($(awk -v a="$theirs" -v b="$ours" "BEGIN { printf \"%.2fx\", $expr }"))"; fi
    done
    echo
}
gpus=${BENCH_GPUS:-1}
rows=() memory_cells=() scaling_rows=()
for config in "${configs[@]}"; do
    preset=${config%%:*} batch=${config##*:}
    out=$(./train_unet --bench "$steps" --preset "$preset" --batch_size "$batch" | tee -a /dev/stderr)
    ours=$(sed -n 's/.*median \([0-9.]*\) ms.*/\1/p' <<< "$out")
    memory=$(sed -n 's/.*GPU memory \([0-9.]*\) GiB.*/\1/p' <<< "$out")
    if [ "$gpus" -gt 1 ]; then
        mkdir -p build
        team=$(./train_unet --bench "$steps" --preset "$preset" --batch_size "$batch" --gpus "$gpus" --run_dir build/bench_team |
               tee -a /dev/stderr) || true
        rate() { sed -n 's/.*), \([0-9]*\) img\/s.*/\1/p' <<< "$1"; }
        scaling_rows+=("$preset $batch $(rate "$out") $(rate "$team")")
    fi
    row="$preset $batch $ours"
    for mode in $modes; do
        out=$(python3 scripts/bench_torch.py --preset "$preset" --batch_size "$batch" --mode "$mode" --steps "$steps" \
              ${BENCH_TORCH_FLAGS:-} 2>&1 |
              tee -a /dev/stderr) || true
        theirs=$(sed -n 's/.*median \([0-9.]*\) ms.*/\1/p' <<< "$out")
        row="$row $mode=${theirs:-failed}"
        torch_memory=$(sed -n 's/.*peak memory \([0-9.]*\) GiB.*/\1/p' <<< "$out")
    done
    rows+=("$row")
    memory_cells+=("${memory:-?} / ${torch_memory:-?}")
done
# sample_rows: "ours mode=theirs ..." per sampling row: plain; guided (classifier-free guidance 3 on
# a class-conditional seed model of the 3 shapes classes; both sides run the model on the doubled
# batch, labels then the null class); classifier-guided (scale 1, the classes in turn).
sample_rows=()
if [ "${BENCH_SAMPLE:-1}" != 0 ]; then
    mkdir -p build
    rm -rf build/bench_run_classifier  # one training step of the default noisy classifier
    ./train_unet --data data/shapes.bin --model classifier --steps 1 --run_dir build/bench_run_classifier >&2
    for guidance in 1 3 classifier; do
        run=build/bench_run_g$guidance  # one training step of the seed preset: a checkpoint to sample from
        rm -rf "$run"
        cond=() ours_flags=(--guidance "$guidance") torch_flags=(--guidance "$guidance")
        [ "$guidance" = 3 ] && cond=(--class_cond)
        if [ "$guidance" = classifier ]; then
            ours_flags=(--classifier build/bench_run_classifier/checkpoints/step_000000001 --classifier_scale 1)
            torch_flags=(--classifier_scale 1)
        fi
        ./train_unet --data data/shapes.bin "${cond[@]}" --steps 1 --run_dir "$run" >&2
        ours=$(./generate --checkpoint "$run/checkpoints/step_000000001" --num 256 --batch 256 --steps 50 --bench 5 \
               "${ours_flags[@]}" | tee -a /dev/stderr | sed -n 's/.*(\([0-9.]*\) images\/s.*/\1/p')
        row="$ours"
        for mode in $modes; do
            theirs=$(python3 scripts/sample_torch.py --num 256 --steps 50 --mode "$mode" "${torch_flags[@]}" --classes 3 2>&1 |
                     tee -a /dev/stderr | sed -n 's/.*(\([0-9.]*\) images\/s.*/\1/p')
            row="$row $mode=${theirs:-failed}"
        done
        sample_rows+=("$row")
    done
fi
echo
printf '%-8s %6s %12s' preset batch "ours ms"
for mode in $modes; do printf ' %26s' "$mode ms (ratio)"; done
printf '   GiB ours / %s\n' "${modes##* }"
for i in "${!rows[@]}"; do
    set -- ${rows[$i]}
    printf '%-8s %6s %12s' "$1" "$2" "$3"
    ours=$3; shift 3
    ratio_cells "a / b" "$ours" "$@" | tr -d '\n'
    printf '   %s\n' "${memory_cells[$i]}"
done
if [ ${#scaling_rows[@]} -gt 0 ]; then
    echo
    printf '%-8s %6s %14s %14s %8s\n' preset "batch/GPU" "1 GPU img/s" "$gpus GPUs img/s" scaling
    for row in "${scaling_rows[@]}"; do
        set -- $row
        printf '%-8s %6s %14s %14s %8s\n' "$1" "$2" "$3" "${4:-failed}" \
            "$([ -n "${4:-}" ] && awk -v a="$3" -v b="$4" 'BEGIN { printf "%.2fx", b / a }')"
    done
fi
if [ ${#sample_rows[@]} -gt 0 ]; then
    echo
    printf '%-26s %12s' "sampling: DDIM-50, 256" "ours img/s"
    for mode in $modes; do printf ' %26s' "$mode img/s (ratio)"; done
    echo
    names=("seed preset, batch 256" "class-cond., guidance 3" "classifier guidance 1")
    for i in "${!sample_rows[@]}"; do
        set -- ${sample_rows[$i]}
        printf '%-26s %12s' "${names[$i]}" "$1"
        ratio_cells "b / a" "$@"
    done
fi
