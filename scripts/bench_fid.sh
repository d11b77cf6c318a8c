#!/usr/bin/env bash
# bench_fid.sh [COUNT]: the time from start to the numbers of `evaluate` (FID, sFID, IS, precision
# and recall) against pytorch-fid's way to FID alone (scripts/fid_inception.py fid: its network in
# fp32 with PyTorch's defaults, batches of 50, then np.cov and scipy's sqrtm on the CPU), on the same
# two sets of COUNT 64x64 images (default 50000: shape images of seeds 3 and 4, read from .bin files
# by both, so no image decoding is timed). The weights are pytorch-fid's where evaluate finds them
# by default, else random ones of the same shapes (the time is the same). Wall-clock seconds, each
# program's output on stderr, the table last.
set -euo pipefail
cd "$(dirname "$0")/.."
count=${1:-50000}
dir=build/bench_fid
mkdir -p "$dir"
for seed in 3 4; do
    set_file=$dir/shapes_${count}_seed$seed.bin
    [ -f "$set_file" ] || ./prepare_data --synthetic shapes --count "$count" --size 64 --seed "$seed" --output "$set_file" --quiet >&2
done
weights=${TORCH_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/torch}/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth
[ -n "${TORCH_HOME:-}" ] && weights=$TORCH_HOME/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth
if [ ! -f "$weights" ]; then
    weights=$dir/random_inception.pth
    [ -f "$weights" ] || python3 scripts/fid_inception.py weights --out "$weights" >&2
fi
ref=$dir/shapes_${count}_seed3.bin sample=$dir/shapes_${count}_seed4.bin
start=$(date +%s.%N)
ours=$(./evaluate --inception "$weights" --ref "$ref" --sample "$sample" | tee /dev/stderr)
middle=$(date +%s.%N)
theirs=$(python3 scripts/fid_inception.py fid --ref "$ref" --sample "$sample" --weights "$weights" 2>/dev/null | tee /dev/stderr)
end=$(date +%s.%N)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
printf '\nFID of %d against %d 64x64 images, %s (%s)\n' "$count" "$count" "$gpu" "$(basename "$weights")"
seconds() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.2f", b - a }'; }
printf '%-44s %10s %10s\n' "" "seconds" "FID"
printf '%-44s %10s %10s\n' "evaluate (FID, sFID, IS, precision, recall)" "$(seconds "$start" "$middle")" "$(sed -n 's/^FID: //p' <<< "$ours")"
printf '%-44s %10s %10s\n' "pytorch-fid's way (FID)" "$(seconds "$middle" "$end")" "$(sed -n 's/^FID \([0-9.]*\):.*/\1/p' <<< "$theirs")"
awk -v a="$start" -v b="$middle" -v c="$end" 'BEGIN { printf "ratio %.2fx (pytorch-fid'"'"'s way / evaluate)\n", (c - b) / (b - a) }'
