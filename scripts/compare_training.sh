#!/usr/bin/env bash
# Trains the same configuration with train_unet and with PyTorch (scripts/train_torch.py) and
# compares their loss curves.
#   scripts/compare_training.sh DATA STEPS BATCH DIR [flags for both, e.g. --preset adm64 --seed 1]
# Writes DIR/log.csv (train_unet), DIR/torch.csv, DIR/loss_curves.png; prints the comparison.
# TORCH_FLAGS adds flags for the PyTorch side only (e.g. "--compile reduce-overhead").
set -euo pipefail
if [ $# -lt 4 ]; then
    echo "usage: $0 DATA STEPS BATCH DIR [flags for both trainers]" >&2
    exit 1
fi
data=$1 steps=$2 batch=$3 dir=$4
shift 4
root=$(dirname "$0")/..
mkdir -p "$dir"
common=(--data "$data" --steps "$steps" --batch_size "$batch" --log_interval 10 "$@")
"$root/train_unet" "${common[@]}" --run_dir "$dir" | tee "$dir/train_unet.out"
# shellcheck disable=SC2086
python3 "$root/scripts/train_torch.py" "${common[@]}" ${TORCH_FLAGS:-} --csv "$dir/torch.csv" | tee "$dir/torch.out"
python3 "$root/scripts/plot_log.py" "$dir/loss_curves.png" "$dir/log.csv:train_unet" "$dir/torch.csv:torch" \
    --title "$(basename "$data"), $steps steps, batch $batch $*"
