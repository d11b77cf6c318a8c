#!/usr/bin/env bash
# evaluate against guided-diffusion's evaluator at several sample counts, on a GPU with PyTorch.
#
#   scripts/evaluator_parity.sh [COUNT ...]      (default: 1000 10000 50000)
#
# For each COUNT: two sets of COUNT synthetic shape images (64x64 and 48x48), random Inception
# weights, PyTorch's float32 features of both (TF32 off) and the evaluator's formulas on them
# (scripts/fid_inception.py fixture: make_metrics_fixture.py's port of evaluations/evaluator.py),
# then `./evaluate --json` on the same images and weights. Prints one row a metric: ours, the
# evaluator's and the relative difference. Needs ./prepare_data and ./evaluate built.
set -euo pipefail
cd "$(dirname "$0")/.."
counts=("$@")
[ ${#counts[@]} -gt 0 ] || counts=(1000 10000 50000)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

printf '%8s  %-16s %14s %14s %10s\n' images metric evaluate evaluator relative
for n in "${counts[@]}"; do
    ./prepare_data --synthetic shapes --count "$n" --size 64 --seed 1 --output "$dir/ref.bin" --quiet >/dev/null
    ./prepare_data --synthetic shapes --count "$n" --size 48 --seed 2 --output "$dir/sample.bin" --quiet >/dev/null
    python3 scripts/fid_inception.py fixture --ref "$dir/ref.bin" --sample "$dir/sample.bin" --out "$dir/fixture" >/dev/null
    ./evaluate --inception "$dir/fixture/inception.pth" --ref "$dir/ref.bin" --sample "$dir/sample.bin" --json > "$dir/ours.json"
    python3 - "$n" "$dir/ours.json" "$dir/fixture/features.safetensors" <<'PY'
import json, struct, sys
n, ours_path, fixture_path = sys.argv[1:]
ours = json.load(open(ours_path))
with open(fixture_path, "rb") as f:
    theirs = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))["__metadata__"]
for key in ("fid", "sfid", "inception_score", "precision", "recall"):
    a, b = float(ours[key]), float(theirs[key])
    print(f"{n:8}  {key:<16} {a:14.6f} {b:14.6f} {abs(a - b) / abs(b) if b else abs(a):10.2e}")
PY
done
