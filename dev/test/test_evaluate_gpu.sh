#!/usr/bin/env bash
# test_evaluate_gpu.sh: evaluate's numbers, on a GPU with PyTorch. scripts/fid_inception.py writes
# random Inception weights, the PyTorch features of 100 images and what guided-diffusion's evaluator
# formulas give for two sets of 2500 shape images; then
#   - test_inception_gpu_fp32 and _bf16 check the features (1e-3 relative in FP32), the metrics
#     (FID within 0.1%, the others within 1%) and the GPU mathematics against metrics.h;
#   - evaluate itself gives those numbers from the .bin files, and the same numbers from a folder
#     of the same images as PNG files, from an .npz of them (np.savez) and from saved statistics.
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
T=$TEST_TMP
F=$T/fixture

case_begin "the fixture: random Inception weights, PyTorch's features and the evaluator formulas' numbers"
mkdir -p "$F"
./prepare_data --synthetic shapes --count 2500 --size 64 --seed 1 --output "$F/ref.bin" --quiet >/dev/null
./prepare_data --synthetic shapes --count 2500 --size 48 --seed 2 --output "$F/sample.bin" --quiet >/dev/null
expect_ok python3 scripts/fid_inception.py fixture --ref "$F/ref.bin" --sample "$F/sample.bin" --out "$F"
cat "$LAST_OUT"

for p in fp32 bf16; do
    case_begin "test_inception_gpu_$p: the features, the metrics and the GPU mathematics"
    expect_ok "build/test/test_inception_gpu_$p" "$F"
    sed 's/^/    /' "$LAST_OUT"
done

# The metadata value KEY of the fixture's features.safetensors.
fixture_value() {
    python3 -c 'import json, struct, sys; f = open(sys.argv[1], "rb"); n = struct.unpack("<Q", f.read(8))[0]
print(json.loads(f.read(n))["__metadata__"][sys.argv[2]])' "$F/features.safetensors" "$1"
}
# JSON value KEY of evaluate's output OUT within TOLERANCE (relative) of the fixture's.
close_to_fixture() {
    python3 -c 'import json, sys; got = json.load(open(sys.argv[1]))[sys.argv[2]]; want = float(sys.argv[3])
sys.exit(0 if abs(got - want) <= float(sys.argv[4]) * abs(want) else f"{sys.argv[2]}: {got} against {want}")' "$1" "$2" "$(fixture_value "$2")" "$3" ||
        case_fail "$2 of evaluate is not within $3 of the evaluator formulas'"
}

case_begin "evaluate --json of the two sets: the evaluator formulas' numbers (FID within 0.1%, the others 1%)"
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/ref.bin" --sample "$F/sample.bin" --json --batch 100
cp "$LAST_OUT" "$T/bin.json"
cat "$T/bin.json"
sed 's/^/    /' "$LAST_ERR"
close_to_fixture "$T/bin.json" fid 1e-3
for key in sfid inception_score precision recall; do close_to_fixture "$T/bin.json" "$key" 1e-2; done
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/ref.bin" --sample "$F/sample.bin"
for key in "Inception Score" FID sFID Precision Recall; do expect_grep "^$key: [0-9]+\.[0-9]{4}$" "$LAST_OUT"; done

case_begin "a folder of the same images as PNG files gives the same numbers"
mkdir -p "$T/png"
python3 - "$F/sample.bin" "$T/png" <<'PY'
import os, struct, sys, zlib
sys.path.insert(0, "scripts")
from train_torch import open_dataset
pixels, _, _ = open_dataset(sys.argv[1])
chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
for i, image in enumerate(pixels):
    h, w, _ = image.shape
    raw = b"".join(b"\0" + image[y].tobytes() for y in range(h))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    open(os.path.join(sys.argv[2], f"{i:06d}.png"), "wb").write(png)
PY
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/ref.bin" --sample "$T/png" --json --batch 100
cmp -s "$LAST_OUT" "$T/bin.json" || case_fail "the folder's numbers differ: $(cat "$LAST_OUT")"

case_begin "guided-diffusion's .npz batch of the same images (np.savez, as its image_sample.py writes) gives the same numbers"
python3 -c 'import sys; sys.path.insert(0, "scripts"); import numpy as np; from train_torch import open_dataset
np.savez(sys.argv[2], np.array(open_dataset(sys.argv[1])[0]))' "$F/sample.bin" "$T/sample.npz"
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/ref.bin" --sample "$T/sample.npz" --json --batch 100
cmp -s "$LAST_OUT" "$T/bin.json" || case_fail "the .npz's numbers differ: $(cat "$LAST_OUT")"

case_begin "--save_stats, then the statistics as either set: the same numbers; written whole"
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/ref.bin" --save_stats "$T/ref.stats" --batch 100
expect_grep "wrote the statistics of 2500 images" "$LAST_OUT"
ls "$T" | grep -q '\.tmp\.' && case_fail "a temporary file is left behind"
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$F/sample.bin" --save_stats "$T/sample.stats" --batch 100
expect_ok ./evaluate --ref "$T/ref.stats" --sample "$T/sample.stats" --json --inception "$T/not-needed.pth"
cmp -s "$LAST_OUT" "$T/bin.json" || case_fail "the statistics' numbers differ: $(cat "$LAST_OUT") against $(cat "$T/bin.json")"
expect_ok ./evaluate --inception "$F/inception.pth" --ref "$T/ref.stats" --sample "$F/sample.bin" --json --batch 100
cmp -s "$LAST_OUT" "$T/bin.json" || case_fail "the numbers against saved reference statistics differ: $(cat "$LAST_OUT")"

case_summary
