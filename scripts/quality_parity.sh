#!/usr/bin/env bash
# Quality parity: trains one configuration with train_unet and with PyTorch (scripts/train_torch.py),
# from the same seed and flags for the same steps, then samples both with the same sampler
# (./generate, DDIM 50 steps, eta 0, the same --seed, --num and --batch, from each one's first EMA)
# and scores the samples with ./check_shapes; prints a markdown table and the commands it ran.
#   scripts/quality_parity.sh DATA STEPS BATCH DIR [flags for both trainers]
# e.g. TORCH_FLAGS="--compile reduce-overhead" scripts/quality_parity.sh data/shapes.bin 2000 64 build/quality \
#          --class_cond True --cfg_dropout 0.1 --lr 2e-4 --warmup_steps 200 --ema_rate 0.995 --seed 0
# Flags for both must be ones both trainers take (train_torch.py --help). Environment:
#   QUALITY_NUM (1000) images per trainer, QUALITY_SEED (0) and QUALITY_BATCH (250) generate's
#   --seed and --batch; TORCH_FLAGS flags for train_torch.py only (e.g. "--compile reduce-overhead");
#   UNET_FLAGS flags for train_unet only (e.g. "--overwrite" to train again into DIR/run).
# Writes in DIR: run/ (train_unet's run folder: log.csv, checkpoints/step_N), torch.csv and
# torch_ema.safetensors (train_torch.py's log and --save), samples_train_unet/ and samples_torch/
# (generate's images; its grid.png moved out to grid_train_unet.png, grid_torch.png, so that the
# folders hold only the samples check_shapes counts), *.out (the console output of each program),
# quality.md (the table, the checker's lines and the commands).
set -euo pipefail
usage="usage: $0 DATA STEPS BATCH DIR [flags for both trainers]"
if [ $# -lt 4 ]; then
    echo "$usage" >&2
    exit 1
fi
data=$1 steps=$2 batch=$3 dir=$4
shift 4
if ! [[ $steps =~ ^[1-9][0-9]*$ && $batch =~ ^[1-9][0-9]*$ ]]; then
    echo "$0: STEPS and BATCH must be positive whole numbers, not '$steps' and '$batch'" >&2
    echo "$usage" >&2
    exit 1
fi
num=${QUALITY_NUM:-1000} seed=${QUALITY_SEED:-0} sample_batch=${QUALITY_BATCH:-250}
if ! [[ $num =~ ^[1-9][0-9]*$ && $sample_batch =~ ^[1-9][0-9]*$ && $seed =~ ^[0-9]+$ ]]; then
    echo "$0: QUALITY_NUM ($num) and QUALITY_BATCH ($sample_batch) must be positive whole numbers," \
        "QUALITY_SEED ($seed) a whole number" >&2
    exit 1
fi
root=$(cd "$(dirname "$0")/.." && pwd)
for exe in train_unet generate check_shapes; do
    if [ ! -x "$root/$exe" ]; then
        echo "$0: $root/$exe is not built: run make first" >&2
        exit 1
    fi
done
if ! python3 -c 'import torch' 2>/dev/null; then  # before train_unet's minutes, not after
    echo "$0: python3 cannot import torch: scripts/train_torch.py needs PyTorch" >&2
    exit 1
fi
read -r -a torch_extra <<< "${TORCH_FLAGS:-}"
read -r -a unet_extra <<< "${UNET_FLAGS:-}"
mkdir -p "$dir"
run_dir=$dir/run
torch_file=$dir/torch_ema.safetensors

commands=()
note() {  # prints a command as it will run (shell-quoted) and keeps it for the summary
    local line
    printf -v line '%q ' "$@"
    commands+=("${line% }")
    echo "+ ${line% }"
}

# 1. Training, both trainers, the same flags.
common=(--data "$data" --steps "$steps" --batch_size "$batch" --log_interval 10 "$@")
unet_cmd=("$root/train_unet" "${common[@]}" ${unet_extra[@]+"${unet_extra[@]}"} --run_dir "$run_dir")
torch_cmd=(python3 "$root/scripts/train_torch.py" "${common[@]}" ${torch_extra[@]+"${torch_extra[@]}"}
           --csv "$dir/torch.csv" --save "$torch_file")
note "${unet_cmd[@]}"
"${unet_cmd[@]}" | tee "$dir/train_unet.out"
note "${torch_cmd[@]}"
"${torch_cmd[@]}" | tee "$dir/torch.out"

# train_unet's checkpoint of the last step (generate reads its ema.safetensors: the first EMA rate).
printf -v unet_ckpt '%s/checkpoints/step_%09d' "$run_dir" "$steps"
if [ ! -f "$unet_ckpt/ema.safetensors" ]; then
    echo "$0: train_unet left no checkpoint $unet_ckpt (in $run_dir/checkpoints:" \
        "$(cd "$run_dir/checkpoints" 2>/dev/null && echo step_*))" >&2
    exit 1
fi
if [ ! -f "$torch_file" ]; then
    echo "$0: train_torch.py wrote no $torch_file" >&2
    exit 1
fi
# The resolved configuration says whether the model is class-conditional (then generate asks
# for the classes in turn, and check_shapes compares class and request).
class_cond=$(awk '$1 == "class_cond" { print $2 }' "$run_dir/config.txt")
check_flags=()
[ "$class_cond" = True ] && check_flags=(--classes-in-turn)

# 2. Sampling with the same sampler, 3. scoring.
declare -A checked
for who in train_unet torch; do
    if [ "$who" = train_unet ]; then ckpt=$unet_ckpt; else ckpt=$torch_file; fi
    out=$dir/samples_$who
    note rm -rf "$out"
    rm -rf "$out"
    gen_cmd=("$root/generate" --checkpoint "$ckpt" --sampler ddim --steps 50 --eta 0 --num "$num"
             --batch "$sample_batch" --seed "$seed" --out "$out")
    note "${gen_cmd[@]}"
    "${gen_cmd[@]}" | tee "$dir/generate_$who.out"
    note mv "$out/grid.png" "$dir/grid_$who.png"
    mv "$out/grid.png" "$dir/grid_$who.png"
    check_cmd=("$root/check_shapes" ${check_flags[@]+"${check_flags[@]}"} "$out")
    note "${check_cmd[@]}"
    checked[$who]=$("${check_cmd[@]}" | tee "$dir/check_shapes_$who.out")
done

# The mean loss over the last 400 steps of a log (each row the mean over the steps since the row
# before, so the rows are weighted by their steps), the last step logged, and the window's steps.
loss_tail() {
    awk -F, 'NR > 1 && $1 ~ /^[0-9]+$/ { step[++n] = $1; loss[n] = $2 }
        END {
            if (n == 0) { print "? ? 0"; exit }
            last = step[n]; start = last > 400 ? last - 400 : 0
            prev = 0; sum = 0; w = 0
            for (i = 1; i <= n; i++) {
                if (prev >= start) { sum += loss[i] * (step[i] - prev); w += step[i] - prev }
                prev = step[i]
            }
            printf "%s %.6f %d\n", last, w ? sum / w : 0, w
        }' "$1"
}

# The checker's "N images, K valid (P%): ..." and "labels agree ... on A of B ... (P%)" lines.
valid_of() { sed -n 's/^\([0-9]*\) images, \([0-9]*\) valid (\([0-9.]*\)%).*/\2 of \1 (\3%)/p' <<< "$1"; }
agree_of() {
    sed -n 's/^labels agree with the checker on \([0-9]*\) of \([0-9]*\) .*(\([0-9.]*\)%)$/\3% (\1 of \2)/p' <<< "$1"
}

{
    echo
    echo "Quality parity: $(basename "$data"), batch $batch, flags: $*"
    echo "(TORCH_FLAGS: ${TORCH_FLAGS:-none}; samples: generate DDIM 50 steps, eta 0, --num $num --seed $seed" \
        "--batch $sample_batch, each trainer's first EMA)"
    echo
    if [ "$class_cond" = True ]; then
        echo "| trainer | steps | valid of $num | class as asked | mean loss, last 400 steps |"
        echo "| --- | --- | --- | --- | --- |"
    else
        echo "| trainer | steps | valid of $num | mean loss, last 400 steps |"
        echo "| --- | --- | --- | --- |"
    fi
    for who in train_unet torch; do
        log=$dir/torch.csv name="PyTorch (train_torch.py)"
        [ "$who" = train_unet ] && log=$run_dir/log.csv name=train_unet
        read -r last mean window < <(loss_tail "$log")
        valid=$(valid_of "${checked[$who]}")
        row="| $name | $last | ${valid:-?} |"
        if [ "$class_cond" = True ]; then
            agree=$(agree_of "${checked[$who]}")
            row="$row ${agree:-—} |"  # no valid image: nothing to compare
        fi
        [ "$window" -eq 400 ] || mean="$mean (last $window steps)"
        echo "$row $mean |"
    done
    echo
    echo "check_shapes${check_flags[*]:+ ${check_flags[*]}}:"
    for who in train_unet torch; do
        echo "- $who: $(awk '{ printf "%s%s", (NR > 1 ? "; " : ""), $0 }' <<< "${checked[$who]}")"
    done
    echo
    echo "Commands:"
    echo
    echo '```sh'
    printf '%s\n' "${commands[@]}"
    echo '```'
} | tee "$dir/quality.md"
