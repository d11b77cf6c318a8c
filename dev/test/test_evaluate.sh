#!/usr/bin/env bash
# test_evaluate.sh: evaluate's command line without a GPU: the usage, and every bad input (a set
# too small for FID, images of mixed sizes, a folder without images, a file that is neither a
# dataset nor statistics, missing weights) is one error line and a non-zero exit before the GPU
# is touched. (dev/test/test_evaluate_gpu.sh checks the numbers.)
cd "$(dirname "$0")/../.." || exit 1
. dev/test/lib.sh
T=$TEST_TMP

# PNG files of the given sizes (python3's standard library only): write_pngs DIR NAME:WxH...
write_pngs() {
    python3 - "$@" <<'PY'
import struct, sys, zlib
folder = sys.argv[1]
for spec in sys.argv[2:]:
    name, size = spec.split(":")
    w, h = map(int, size.split("x"))
    raw = b"".join(b"\0" + bytes((x * 7 + y * 3) % 256 for x in range(3 * w)) for y in range(h))
    chunk = lambda kind, data: struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    png = b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")
    open(f"{folder}/{name}", "wb").write(png)
PY
}

case_begin "the command-line convention: the usage on stdout and exit 0 for no arguments, -h and --help; the docs' copy is the same"
expect_usage ./evaluate --ref x.bin
expect_grep "^usage: evaluate --ref REF --sample SAMPLES" "$T/evaluate.help"

case_begin "usage errors: one line ending in (see --help), exit 2"
expect_exit 2 ./evaluate --sample x.bin
expect_grep "^evaluate: error: --ref is required \(see --help\)$" "$LAST_ERR"
expect_exit 2 ./evaluate --ref x.bin
expect_grep "give --sample \(to evaluate it\) or --save_stats" "$LAST_ERR"
expect_exit 2 ./evaluate --ref x.bin --sample y.bin --save_stats z.stats
expect_exit 2 ./evaluate --ref x.bin --save_stats z.stats --json
expect_grep "json prints results: --save_stats has none" "$LAST_ERR"
expect_exit 2 ./evaluate --ref x.bin --sample y.bin --batch 0
expect_grep "batch takes a whole number in 1..1024, not '0'" "$LAST_ERR"
expect_exit 2 ./evaluate --ref x.bin --sampel y.bin
expect_grep "unknown option --sampel; did you mean --sample\?" "$LAST_ERR"

case_begin "a set the metrics cannot use: too few images for precision and recall, missing, neither a dataset nor statistics"
./prepare_data --synthetic shapes --count 100 --size 16 --output "$T/small.bin" --quiet >/dev/null
./prepare_data --synthetic shapes --count 3 --size 16 --output "$T/three.bin" --quiet >/dev/null
expect_exit 1 ./evaluate --ref "$T/three.bin" --sample "$T/small.bin"
expect_grep "ref .*three.bin holds 3 images: precision and recall need more than 3 \(their nearest neighbours\)" "$LAST_ERR"
./prepare_data --synthetic shapes --count 2049 --size 8 --output "$T/enough.bin" --quiet >/dev/null
expect_exit 1 ./evaluate --ref "$T/enough.bin" --sample "$T/three.bin"
expect_grep "sample .*three.bin holds 3 images" "$LAST_ERR"
expect_exit 1 ./evaluate --ref "$T/missing.bin" --sample "$T/small.bin"
expect_grep "cannot open .*missing.bin: No such file or directory" "$LAST_ERR"
echo "not a dataset" >"$T/text.bin"
expect_exit 1 ./evaluate --ref "$T/text.bin" --sample "$T/small.bin"
expect_grep "a set is a dataset .bin, a folder of images, a batch .npz or a .stats file" "$LAST_ERR"
cp "$T/enough.bin" "$T/fake.stats"
expect_exit 1 ./evaluate --ref "$T/enough.bin" --sample "$T/fake.stats"
[ "$(grep -c '' "$LAST_ERR")" = 1 ] || case_fail "a .stats that is not safetensors: $(cat "$LAST_ERR")"
expect_exit 1 ./evaluate --ref "$T/enough.bin" --save_stats "$T/out.stats" --num 3
expect_grep "holds 3 images: precision and recall need more than 3" "$LAST_ERR"
expect_absent "$T/out.stats"

case_begin "a folder: images of mixed sizes and a folder without images are refused, generate's grids left out"
mkdir -p "$T/mixed" "$T/empty" "$T/grids"
write_pngs "$T/mixed" 000000.png:16x16 000001.png:16x16 000002.png:17x16
expect_exit 1 ./evaluate --ref "$T/mixed" --sample "$T/small.bin"
expect_grep "images of mixed sizes in .*mixed: .*000000.png is 16x16, .*000002.png 17x16 \(resize them to one size first\)" "$LAST_ERR"
expect_exit 1 ./evaluate --ref "$T/empty" --sample "$T/small.bin"
expect_grep "folder .*empty holds no images" "$LAST_ERR"
write_pngs "$T/grids" 000000.png:16x16 grid.png:64x64 base_grid.png:32x32
expect_exit 1 ./evaluate --ref "$T/grids" --sample "$T/small.bin"
expect_grep "ref .*grids holds 1 images: precision and recall need more than 3" "$LAST_ERR"

case_begin "guided-diffusion's .npz batches: arr_0's images read in place; compressed, misshapen or short ones refused"
# write_npz FILE N H W C [DESCR] [MODE]: np.savez's layout (a stored zip of arr_0.npy) from python3's standard library;
# MODE deflated compresses it, short cuts the array's last byte, other names the entry other.npy
write_npz() {
    python3 - "$@" <<'PY'
import sys, zipfile
path, n, h, w, c = sys.argv[1], *map(int, sys.argv[2:6])
descr = sys.argv[6] if len(sys.argv) > 6 else "|u1"
mode = sys.argv[7] if len(sys.argv) > 7 else ""
header = "{'descr': '%s', 'fortran_order': False, 'shape': (%d, %d, %d, %d), }" % (descr, n, h, w, c)
header += " " * ((64 - (10 + len(header) + 1) % 64) % 64) + "\n"
data = bytes((i * 7) % 256 for i in range(n * h * w * c * (4 if descr == "<f4" else 1)))
npy = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + (data[:-1] if mode == "short" else data)
with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED if mode == "deflated" else zipfile.ZIP_STORED) as z:
    z.writestr("other.npy" if mode == "other" else "arr_0.npy", npy)
PY
}
write_npz "$T/small.npz" 3 8 8 3
expect_exit 1 ./evaluate --ref "$T/small.npz" --sample "$T/small.bin"
expect_grep "ref .*small.npz holds 3 images: precision and recall need more than 3" "$LAST_ERR"
write_npz "$T/deflated.npz" 100 8 8 3 "|u1" deflated
expect_exit 1 ./evaluate --ref "$T/deflated.npz" --sample "$T/small.bin"
expect_grep "deflated.npz: zip entry arr_0.npy is compressed: only stored entries are read" "$LAST_ERR"
write_npz "$T/float.npz" 10 8 8 3 "<f4"
expect_exit 1 ./evaluate --ref "$T/float.npz" --sample "$T/small.bin"
expect_grep "float.npz: arr_0 must be uint8 \[N, H, W, C\] in C order" "$LAST_ERR"
write_npz "$T/short.npz" 10 8 8 3 "|u1" short
expect_exit 1 ./evaluate --ref "$T/short.npz" --sample "$T/small.bin"
expect_grep "short.npz: arr_0 holds fewer bytes than its shape \[10, 8, 8, 3\] needs" "$LAST_ERR"
write_npz "$T/other.npz" 10 8 8 3 "|u1" other
expect_exit 1 ./evaluate --ref "$T/other.npz" --sample "$T/small.bin"
expect_grep "other.npz holds no arr_0.npy" "$LAST_ERR"
cp "$T/small.bin" "$T/not_a_zip.npz"
expect_exit 1 ./evaluate --ref "$T/not_a_zip.npz" --sample "$T/small.bin"
[ "$(grep -c '' "$LAST_ERR")" = 1 ] || case_fail "an .npz that is no zip: $(cat "$LAST_ERR")"

case_begin "the weights: pytorch-fid's file where it keeps it, else one line saying where to get it"
expect_exit 1 env HOME="$T/home" TORCH_HOME= XDG_CACHE_HOME= ./evaluate --ref "$T/enough.bin" --sample "$T/enough.bin"
expect_grep "cannot open the Inception weights $T/home/.cache/torch/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth: No such file" "$LAST_ERR"
expect_grep "the README says where to get it" "$LAST_ERR"
expect_exit 1 env TORCH_HOME="$T/torch" ./evaluate --ref "$T/enough.bin" --sample "$T/enough.bin"
expect_grep "$T/torch/hub/checkpoints/pt_inception-2015-12-05-6726825d.pth" "$LAST_ERR"
expect_exit 1 ./evaluate --ref "$T/enough.bin" --sample "$T/enough.bin" --inception "$T/small.bin"
[ "$(grep -c '' "$LAST_ERR")" = 1 ] || case_fail "a weights file that is not one: $(cat "$LAST_ERR")"

case_summary
