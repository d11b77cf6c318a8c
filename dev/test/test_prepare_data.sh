#!/usr/bin/env bash
# test_prepare_data.sh: prepare_data end to end: image formats, cropping, alpha, labels, bad inputs,
# each distinct file once (links, hard links, --keep_duplicates), the command-line convention (usage,
# exit status 0/1/2), the atomic writer and the synthetic dataset. Run from the repository root after `make`;
# PREPARE_DATA=path runs another build (a sanitizer build, say). Test images are written by Python's
# standard library (zlib for PNG), the dataset files are read back by Python too.
cd "$(dirname "$0")/../.." || exit 1
source dev/test/lib.sh
PD=${PREPARE_DATA:-./prepare_data}
[ -x "$PD" ] || { echo "$PD not built (run make)"; echo "0 passed, 1 failed"; exit 1; }
T=$TEST_TMP

CORPUS=dev/test/corpus/prepare_data  # small bad input files, described where they are used

# imgs.py: writers for the test images and a reader for dataset files.
cat >"$T/imgs.py" <<'EOF'
import os, random, struct, sys, zlib

def samples(seed, n, maxval=255):
    r = random.Random(seed)
    return [r.randint(0, maxval) for _ in range(n)]

def png(path, w, h, ctype, data, depth=8, palette=None):
    ch = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}[ctype]
    raw = b''
    for y in range(h):
        row = data[y * w * ch:(y + 1) * w * ch]
        raw += b'\0' + (bytes(row) if depth == 8 else b''.join(struct.pack('>H', v) for v in row))
    def chunk(kind, d):
        return struct.pack('>I', len(d)) + kind + d + struct.pack('>I', zlib.crc32(kind + d))
    body = chunk(b'IHDR', struct.pack('>IIBBBBB', w, h, depth, ctype, 0, 0, 0))
    if palette: body += chunk(b'PLTE', bytes(palette))
    body += chunk(b'IDAT', zlib.compress(raw)) + chunk(b'IEND', b'')
    open(path, 'wb').write(b'\x89PNG\r\n\x1a\n' + body)

def bmp(path, w, h, rgb):  # 24-bit, rows bottom-up in BGR order, padded to 4 bytes
    stride = (3 * w + 3) // 4 * 4
    rows = b''
    for y in reversed(range(h)):
        row = b''.join(bytes(rgb[3 * (y * w + x):3 * (y * w + x) + 3][::-1]) for x in range(w))
        rows += row + b'\0' * (stride - 3 * w)
    info = struct.pack('<IiiHHIIiiII', 40, w, h, 1, 24, 0, len(rows), 2835, 2835, 0, 0)
    open(path, 'wb').write(b'BM' + struct.pack('<IHHI', 54 + len(rows), 0, 0, 54) + info + rows)

def pnm(path, w, h, data, grey=False):
    open(path, 'wb').write(b'P%d\n%d %d\n255\n' % (5 if grey else 6, w, h) + bytes(data))

def tga(path, w, h, rgb):  # uncompressed true colour, top-left origin, BGR
    head = struct.pack('<BBBHHBHHHHBB', 0, 0, 2, 0, 0, 0, 0, 0, w, h, 24, 0x20)
    open(path, 'wb').write(head + b''.join(bytes(rgb[i:i + 3][::-1]) for i in range(0, len(rgb), 3)))

def hdr(path, w, h, rgbe):  # Radiance, flat (unencoded) scanlines
    open(path, 'wb').write(b'#?RADIANCE\nFORMAT=32-bit_rle_rgbe\n\n-Y %d +X %d\n' % (h, w) + bytes(rgbe))

def read(path):
    b = open(path, 'rb').read()
    magic, version, ch, count, h, w, ncls, nbytes = struct.unpack_from('<8sIIQIIII', b)
    assert magic == b'UNETDSET' and version == 1 and ch == 3, (magic, version, ch)
    assert b[40:64] == bytes(24), 'reserved bytes not zero'
    align = lambda x, a: (x + a - 1) // a * a
    labels_at = align(64 + nbytes, 8)
    pixels_at = align(labels_at + (4 * count if ncls else 0), 64)
    assert len(b) == pixels_at + count * h * w * 3, ('size', len(b), pixels_at + count * h * w * 3)
    names = [n.decode() for n in b[64:64 + nbytes].split(b'\0')[:-1]]
    assert len(names) == ncls, (names, ncls)
    labels = list(struct.unpack_from('<%di' % count, b, labels_at)) if ncls else []
    assert all(0 <= l < ncls for l in labels), labels
    n = h * w * 3
    return dict(count=count, h=h, w=w, names=names, labels=labels,
                images=[b[pixels_at + i * n:pixels_at + (i + 1) * n] for i in range(count)])

def near(a, b, tol):
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= tol
EOF
export PYTHONPATH=$T

# Runs Python code (with imgs imported) as a check of the current case.
check_py() {
    python3 -c "from imgs import *
$1" >"$T/py.out" 2>&1 || { case_fail "check failed:"; tail -3 "$T/py.out" | sed 's/^/    /'; }
}
# Every temporary file prepare_data may have left in a folder.
expect_no_temp() {
    local left; left=$(find "$1" -maxdepth 1 -name '*.tmp.*' | head -1)
    [ -z "$left" ] || case_fail "temporary file left behind: $left"
}

# A folder holding one image of each kind, in sorted name order.
mkdir -p "$T/formats"
python3 -c "
from imgs import *
d = '$T/formats/'
rgb = samples(1, 8 * 8 * 3)
png(d + 'a_rgb.png', 8, 8, 2, rgb)
png(d + 'b_wide.png', 16, 8, 2, samples(2, 16 * 8 * 3))
png(d + 'c_tall.png', 8, 12, 2, samples(3, 8 * 12 * 3))
png(d + 'd_grey.png', 8, 8, 0, samples(4, 64))
png(d + 'e_grey_alpha.png', 8, 8, 4, [v for i in range(64) for v in (90, 0 if i % 2 else 255)])
png(d + 'f_rgb16.png', 8, 8, 2, samples(6, 192, 65535), depth=16)
png(d + 'g_rgba.png', 8, 8, 6, [v for i in range(64) for v in (0, 0, 0, (0, 128, 255)[i % 3])])
png(d + 'h_one_pixel.png', 1, 1, 2, [200, 100, 50])
png(d + 'i_palette.png', 8, 8, 3, [i % 3 for i in range(64)], palette=[255, 0, 0, 0, 255, 0, 0, 0, 255])
bmp(d + 'j.bmp', 8, 8, rgb)
pnm(d + 'k.ppm', 8, 8, rgb)
pnm(d + 'l.pgm', 8, 8, samples(4, 64), grey=True)
tga(d + 'm.tga', 8, 8, rgb)
hdr(d + 'n.hdr', 8, 8, [v for i in range(64) for v in ((128, 128, 128, 128) if i % 2 else (128, 128, 128, 131))])
png(d + 'o_checker.png', 16, 16, 0, [255 * ((x + y) % 2) for y in range(16) for x in range(16)])
"

case_begin "every format decodes to the right pixels (--resize srgb: alpha over white, resized in linear light)"
expect_ok "$PD" --input "$T/formats" --output "$T/formats.bin" --size 8 --resize srgb
expect_grep "wrote 15 images \(8x8 RGB, unlabelled\)" "$LAST_OUT"
check_py "
d = read('$T/formats.bin'); im = d['images']
assert d['count'] == 15 and d['h'] == 8 and d['w'] == 8 and d['names'] == [], d['count']
rgb = bytes(samples(1, 192))
assert im[0] == rgb, 'same-size RGB must be copied unchanged'
wide = samples(2, 16 * 8 * 3)
assert im[1] == bytes(wide[3 * (y * 16 + x) + c] for y in range(8) for x in range(4, 12) for c in range(3)), 'wide crop'
tall = samples(3, 8 * 12 * 3)
assert im[2] == bytes(tall[2 * 24:10 * 24]), 'tall crop'
assert im[3] == bytes(v for g in samples(4, 64) for v in (g, g, g)), 'grey'
assert im[4] == bytes(v for i in range(64) for v in ((255,) * 3 if i % 2 else (90,) * 3)), 'grey+alpha'
assert im[5] == bytes(v >> 8 for v in samples(6, 192, 65535)), '16-bit keeps the high byte'
# black at alpha 0, 128, 255 over white, in linear light: white, 188, black
assert near(im[6], [v for i in range(64) for v in ((255, 188, 0)[i % 3],) * 3], 1), list(im[6][:9])
assert im[7] == bytes([200, 100, 50] * 64), 'a 1x1 image fills the square'
assert im[8] == bytes(v for i in range(64) for v in ((255, 0, 0), (0, 255, 0), (0, 0, 255))[i % 3]), 'palette'
assert im[9] == rgb and im[10] == rgb and im[12] == rgb, 'BMP, PPM, TGA'
assert im[11] == im[3], 'PGM'
# HDR 4.0 clamps to white, 0.5 becomes 255 * 0.5^(1/2.2)
assert im[13] == bytes(v for i in range(64) for v in ((186,) * 3 if i % 2 else (255,) * 3)), list(im[13][:6])
# a black and white checkerboard shrunk averages in linear light (188), not in sRGB (128)
assert all(170 <= v <= 205 for v in im[14]), list(im[14][:12])
"

case_begin "--resize gd (the default): guided-diffusion's center_crop_arr: alpha dropped, BOX halvings, bicubic, centre crop"
expect_ok "$PD" --input "$T/formats" --output "$T/formats_gd.bin" --size 8
check_py "
d = read('$T/formats_gd.bin'); im = d['images']
assert d['count'] == 15 and d['h'] == 8 and d['w'] == 8
assert im[0] == bytes(samples(1, 192)), 'same-size RGB must be copied unchanged'
assert im[4] == bytes([90] * 192), 'grey+alpha: the alpha dropped (PIL convert(\"RGB\"))'
assert im[6] == bytes(192), 'RGBA: the alpha dropped'
# the 16x16 checkerboard halved with BOX: every 2x2 block's mean in sRGB, (0 + 255 + 1) >> 1, twice
assert im[14] == bytes([128] * 192), list(im[14][:12])
"
if python3 -c "import PIL, numpy" 2>/dev/null; then
    mkdir -p "$T/gd"
    python3 - "$T/gd" <<'PY'
import sys
import numpy as np
from PIL import Image
rng = np.random.default_rng(7)
# sizes that halve zero to three times, odd sides, wide and tall, smaller than the output
for i, (w, h) in enumerate([(64, 64), (97, 131), (250, 67), (301, 299), (40, 25), (513, 1000), (33, 33), (129, 64)]):
    smooth = np.stack(np.meshgrid(np.linspace(0, 255, w), np.linspace(0, 255, h)), -1)
    noise = rng.integers(0, 256, (h, w, 3))
    arr = np.concatenate([smooth, noise[..., :1]], -1) if i % 2 else noise
    Image.fromarray(arr.astype(np.uint8), "RGB").save(f"{sys.argv[1]}/{i:02d}.png")
PY
    for size in 32 17; do
        case_begin "--resize gd at size $size equals guided-diffusion's center_crop_arr through PIL, byte for byte"
        expect_ok "$PD" --input "$T/gd" --output "$T/gd$size.bin" --size $size --quiet
        check_py "
import glob
import numpy as np
from PIL import Image
def center_crop_arr(pil_image, image_size):  # guided-diffusion's image_datasets.py
    while min(*pil_image.size) >= 2 * image_size:
        pil_image = pil_image.resize(tuple(x // 2 for x in pil_image.size), resample=Image.BOX)
    scale = image_size / min(*pil_image.size)
    pil_image = pil_image.resize(tuple(round(x * scale) for x in pil_image.size), resample=Image.BICUBIC)
    arr = np.array(pil_image)
    crop_y, crop_x = (arr.shape[0] - image_size) // 2, (arr.shape[1] - image_size) // 2
    return arr[crop_y:crop_y + image_size, crop_x:crop_x + image_size]
d = read('$T/gd$size.bin')
for path, got in zip(sorted(glob.glob('$T/gd/*.png')), d['images']):
    want = center_crop_arr(Image.open(path).convert('RGB'), $size)
    got = np.frombuffer(got, np.uint8).reshape(want.shape)
    assert (got == want).all(), (path, int((got != want).sum()), int(np.abs(got.astype(int) - want).max()))
"
    done
else
    echo "PIL or NumPy is not installed (Debian's python3-pil, python3-numpy): the comparisons with PIL are not run"
fi

case_begin "--jobs: 1, 3 and 16 threads write the same bytes (skipped files and warnings in file order too)"
mkdir -p "$T/jobs_in" && cp "$T"/formats/* "$CORPUS"/* "$T/jobs_in/"
for j in 1 3 16; do
    expect_ok "$PD" --input "$T/jobs_in" --output "$T/jobs$j.bin" --size 8 --jobs $j --quiet
    cp "$LAST_ERR" "$T/jobs$j.err"
done
cmp -s "$T/jobs1.bin" "$T/jobs3.bin" && cmp -s "$T/jobs1.bin" "$T/jobs16.bin" || case_fail "the datasets differ"
cmp -s "$T/jobs1.err" "$T/jobs3.err" && cmp -s "$T/jobs1.err" "$T/jobs16.err" || case_fail "the warnings differ"
grep -q "skipping" "$T/jobs1.err" || case_fail "no file was skipped: the case does not see the order of the warnings"
expect_exit 2 "$PD" --input "$T/formats" --output "$T/x.bin" --jobs 0
expect_grep "jobs must be an integer in 1..1024, not '0'" "$LAST_ERR"
expect_exit 2 "$PD" --synthetic shapes --output "$T/x.bin" --jobs 2
expect_grep "resize, --jobs and --part apply only to --input" "$LAST_ERR"

case_begin "shrinking and enlarging give the requested size"
expect_ok "$PD" --input "$T/formats" --output "$T/formats32.bin" --size 32 --quiet
check_py "
d = read('$T/formats32.bin')
assert d['count'] == 15 and d['h'] == 32 and d['w'] == 32
assert d['images'][7] == bytes([200, 100, 50] * 32 * 32)
"

case_begin "runs are deterministic"
expect_ok "$PD" --input "$T/formats" --output "$T/again.bin" --size 8
cmp -s "$T/formats_gd.bin" "$T/again.bin" || case_fail "two runs wrote different files"
expect_ok "$PD" --input "$T/formats" --output "$T/again.bin" --size 8 --resize srgb
cmp -s "$T/formats.bin" "$T/again.bin" || case_fail "two runs wrote different files (--resize srgb)"

case_begin "corrupt and non-image files are skipped with one warning each"
mkdir -p "$T/mixed/sub"
cp "$T/formats/a_rgb.png" "$T/formats/j.bmp" "$T/mixed/"
head -c 60 "$T/formats/a_rgb.png" >"$T/mixed/sub/truncated.png"
printf 'hello\n' >"$T/mixed/notes.txt"
printf '\x89PNG\r\n\x1a\ngarbage' >"$T/mixed/bad.png"
mkfifo "$T/mixed/pipe"
expect_ok timeout 20 "$PD" --input "$T/mixed" --output "$T/mixed.bin" --size 8
[ "$(grep -c '' "$LAST_ERR")" = 4 ] || case_fail "expected 4 warning lines, got: $(cat "$LAST_ERR")"
expect_grep "^prepare_data: warning: skipping $T/mixed/bad.png: " "$LAST_ERR"
expect_grep "^prepare_data: warning: skipping $T/mixed/notes.txt: " "$LAST_ERR"
expect_grep "^prepare_data: warning: skipping $T/mixed/pipe: not a regular file" "$LAST_ERR"
expect_grep "^prepare_data: warning: skipping $T/mixed/sub/truncated.png: " "$LAST_ERR"
expect_grep "wrote 2 images .*, 4 files skipped" "$LAST_OUT"
check_py "d = read('$T/mixed.bin'); assert d['count'] == 2 and d['images'][0] == d['images'][1]"

case_begin "hidden files are ignored and symlink loops are not followed"
mkdir -p "$T/links/a/.hidden_dir"
cp "$T/formats/a_rgb.png" "$T/links/a/x.png"
cp "$T/formats/a_rgb.png" "$T/links/a/.hidden_dir/y.png"
printf 'junk' >"$T/links/.hidden_file"
ln -s .. "$T/links/a/up"
ln -s a "$T/links/b"
expect_ok "$PD" --input "$T/links/" --output "$T/links.bin" --size 8
expect_grep "skipping $T/links/a/up: a link back" "$LAST_ERR"
expect_grep "wrote 1 image .*, 1 duplicate folder skipped$" "$LAST_OUT"  # b is a second way to a

# Class folders: cats (2 images), dogs (1 image in a sub-folder), empty (no readable image).
mkdir -p "$T/classes/cats" "$T/classes/dogs/puppies" "$T/classes/empty"
cp "$T/formats/a_rgb.png" "$T/classes/cats/1.png"
cp "$T/formats/d_grey.png" "$T/classes/cats/2.png"
cp "$T/formats/h_one_pixel.png" "$T/classes/dogs/puppies/3.png"
printf 'nothing' >"$T/classes/empty/readme.txt"
printf 'loose' >"$T/classes/loose.png"

case_begin "--labels: classes are the first-level folders, in sorted order"
expect_ok "$PD" --input "$T/classes" --output "$T/classes.bin" --size 8 --labels
expect_grep "skipping $T/classes/loose.png: not in a class folder" "$LAST_ERR"
expect_grep "leaving out class empty" "$LAST_ERR"
expect_grep "wrote 3 images \(8x8 RGB, 2 classes\)" "$LAST_OUT"
check_py "
d = read('$T/classes.bin')
assert d['names'] == ['cats', 'dogs'] and d['labels'] == [0, 0, 1], (d['names'], d['labels'])
assert d['images'][2] == bytes([200, 100, 50] * 64)
"

case_begin "--labels: skipped files leave the same dataset as without them"
mkdir -p "$T/clean/cats" "$T/clean/dogs"
cp "$T/classes/cats/"*.png "$T/clean/cats/"
cp "$T/classes/dogs/puppies/3.png" "$T/clean/dogs/"
cp -r "$T/clean" "$T/noisy"
for i in $(seq 10 40); do printf 'x' >"$T/noisy/cats/z$i.png"; done
expect_ok "$PD" --input "$T/clean" --output "$T/clean.bin" --size 8 --labels
expect_ok "$PD" --input "$T/noisy" --output "$T/noisy.bin" --size 8 --labels
expect_grep "31 files skipped" "$LAST_OUT"
cmp -s "$T/clean.bin" "$T/noisy.bin" || case_fail "skipped files changed the dataset"

case_begin "--part K/N: the parts of a folder, in order, are its dataset: the same images and labels, every class in each"
for k in 0 1 2; do expect_ok "$PD" --input "$T/clean" --output "$T/part$k.bin" --size 8 --labels --part $k/3; done
check_py "
whole, parts = read('$T/clean.bin'), [read('$T/part%d.bin' % k) for k in range(3)]
assert [len(p['images']) for p in parts] == [1, 1, 1], [len(p['images']) for p in parts]
assert sum((p['images'] for p in parts), []) == whole['images']
assert sum((p['labels'] for p in parts), []) == whole['labels'] and all(p['names'] == whole['names'] for p in parts)
"
expect_fail "$PD" --input "$T/clean" --output "$T/part9.bin" --size 8 --part 0/4
expect_grep "holds none: choose fewer parts" "$LAST_ERR"
expect_absent "$T/part9.bin"

case_begin "--labels gd: guided-diffusion's classes, the file name before the first _, numbered in sorted order"
mkdir -p "$T/named/more"
python3 -c "
from imgs import *
d = '$T/named/'
for name, seed in [('n02_0001.png', 1), ('n01_0002.png', 2), ('cat.png', 3), ('more/n01_7_x.png', 4), ('n02_.png', 5)]:
    png(d + name, 8, 8, 2, samples(seed, 192))
"
expect_ok "$PD" --input "$T/named" --output "$T/named.bin" --size 8 --labels gd
expect_grep "wrote 5 images \(8x8 RGB, 3 classes\)" "$LAST_OUT"
# files in name order: cat.png, more/n01_7_x.png, n01_0002.png, n02_.png, n02_0001.png
check_py "
d = read('$T/named.bin')
assert d['names'] == ['cat.png', 'n01', 'n02'] and d['labels'] == [0, 1, 1, 2, 2], (d['names'], d['labels'])
assert d['images'][0] == bytes(samples(3, 192)) and d['images'][1] == bytes(samples(4, 192))
"
expect_ok "$PD" --input "$T/named" --output "$T/named2.bin" --size 8 --labels=gd
cmp -s "$T/named.bin" "$T/named2.bin" || case_fail "--labels=gd differs from --labels gd"
expect_ok "$PD" --input "$T/classes" --output "$T/folders.bin" --size 8 --labels folders
cmp -s "$T/classes.bin" "$T/folders.bin" || case_fail "--labels folders differs from --labels"
expect_exit 2 "$PD" --input "$T/named" --output "$T/x.bin" --labels=names
expect_grep "labels takes folders or gd, not 'names'" "$LAST_ERR"

case_begin "without --labels, class folders are just searched"
expect_ok "$PD" --input "$T/classes" --output "$T/unlabelled.bin" --size 8
check_py "d = read('$T/unlabelled.bin'); assert d['count'] == 3 and d['names'] == [] and d['labels'] == []"

case_begin "an empty folder is an error and leaves no file"
mkdir -p "$T/empty" "$T/out1"
printf 'x' >"$T/empty/.hidden.png"
expect_exit 1 "$PD" --input "$T/empty" --output "$T/out1/x.bin"
expect_grep "^prepare_data: error: no files found in $T/empty" "$LAST_ERR"
expect_absent "$T/out1/x.bin"
expect_no_temp "$T/out1"

case_begin "a folder without one readable image is an error and leaves no file"
mkdir -p "$T/junk"
printf 'x' >"$T/junk/a.png"
"$PD" --input "$T/junk" --output "$T/out1/x.bin" >"$LAST_OUT" 2>"$LAST_ERR"
rc=$?; [ $rc = 1 ] || case_fail "expected exit 1, got $rc"
expect_grep "^prepare_data: error: none of the 1 files" "$LAST_ERR"
expect_absent "$T/out1/x.bin"
expect_no_temp "$T/out1"

case_begin "a missing input, or a file as input, is an error"
expect_exit 1 "$PD" --input "$T/no_such_dir" --output "$T/out1/x.bin"
expect_grep "error: cannot read input folder .*No such file" "$LAST_ERR"
expect_exit 1 "$PD" --input "$T/formats/a_rgb.png" --output "$T/out1/x.bin"
expect_grep "error: input .* is not a folder" "$LAST_ERR"
expect_absent "$T/out1/x.bin"

case_begin "an unwritable output is an error and leaves no file"
expect_exit 1 "$PD" --input "$T/formats" --output "$T/no_such_dir/x.bin"
expect_grep "error: cannot write $T/no_such_dir/x.bin" "$LAST_ERR"
expect_exit 1 "$PD" --input "$T/formats" --output "$T/formats/a_rgb.png/x.bin"
expect_grep "Not a directory" "$LAST_ERR"
expect_exit 1 "$PD" --input "$T/formats" --output "$T/out1"
expect_grep "is a folder" "$LAST_ERR"
expect_no_temp "$T/formats"

case_begin "a usage error is one error line pointing to --help, exit status 2"
for bad in "--size 0" "--size 7" "--size 8193" "--size abc" "--size -8" "--size" "--count 5" "--seed 1" \
           "--synthetic circles" "--synthetic shapes --labels" "--synthetic shapes --count 0" \
           "--synthetic shapes --keep_duplicates" "--labels=1" "--quiet=yes" "--keep_duplicates=1" "stray" \
           "--output" "--part 3/3" "--part 1" "--part 0/0" "--part a/2" "--synthetic shapes --part 0/2"; do
    # shellcheck disable=SC2086
    expect_exit 2 "$PD" --input "$T/formats" --output "$T/out1/x.bin" $bad
    expect_grep "^prepare_data: error: .* \(see --help\)$" "$LAST_ERR"
done
expect_exit 2 "$PD" --output "$T/out1/x.bin"
expect_exit 2 "$PD" --input "$T/formats"
expect_exit 2 "$PD" --input "$T/formats" --output ""
expect_exit 2 "$PD" --input "$T/formats" --synthetic shapes --output "$T/out1/x.bin"
expect_absent "$T/out1/x.bin"
[ -s "$LAST_OUT" ] && case_fail "a usage error printed on stdout: $(head -1 "$LAST_OUT")"

case_begin "an unknown option: 'unknown option --x (see --help)', with the nearest known one if any, exit status 2"
for bad in --bogus --bogus=1 -x --Size:--size; do
    near=${bad#*:}; bad=${bad%%:*}
    hint=""; [ "$near" != "$bad" ] && hint="; did you mean $near?"
    expect_exit 2 "$PD" --input "$T/formats" --output "$T/out1/x.bin" "$bad"
    [ "$(cat "$LAST_ERR")" = "prepare_data: error: unknown option ${bad%%=*}$hint (see --help)" ] ||
        case_fail "for $bad: $(cat "$LAST_ERR")"
done
expect_absent "$T/out1/x.bin"

case_begin "no arguments, -h and --help print the usage on stdout, exit status 0; the docs' copy is the same"
expect_usage "$PD" --input "$T/formats" --bogus
expect_grep "^usage: prepare_data --input DIR" "$TEST_TMP/prepare_data.help"
expect_exit 0 "$PD" --synthetic shapes -h --output "$T/out1/x.bin"
cmp -s "$LAST_OUT" "$TEST_TMP/prepare_data.help" || case_fail "-h among other options did not print the usage"
expect_absent "$T/out1/x.bin"

case_begin "an existing output is replaced, --size=N form accepted"
cp "$T/formats/a_rgb.png" "$T/out1/x.bin"
expect_ok "$PD" --input="$T/classes" --output="$T/out1/x.bin" --size=16
check_py "d = read('$T/out1/x.bin'); assert d['count'] == 3 and d['h'] == 16"
expect_no_temp "$T/out1"

case_begin "--synthetic shapes writes count labelled images, deterministically"
expect_ok "$PD" --synthetic shapes --count 50 --size 32 --seed 7 --output "$T/shapes.bin"
expect_grep "wrote 50 images \(32x32 RGB, 3 classes\)" "$LAST_OUT"
check_py "
d = read('$T/shapes.bin')
assert d['count'] == 50 and d['h'] == 32 and d['names'] == ['circle', 'square', 'triangle'], d['names']
assert set(d['labels']) <= {0, 1, 2} and len(set(d['images'])) > 1
"
expect_ok "$PD" --synthetic shapes --count 50 --size 32 --seed 7 --output "$T/shapes2.bin"
cmp -s "$T/shapes.bin" "$T/shapes2.bin" || case_fail "same seed, different files"
expect_ok "$PD" --synthetic shapes --count 50 --size 32 --seed 8 --output "$T/shapes3.bin"
cmp -s "$T/shapes.bin" "$T/shapes3.bin" && case_fail "different seeds, same files"

case_begin "check_shapes: a dataset's labels agree; a grid in turn of the classes (circle, square, triangle)"
expect_ok ./check_shapes "$T/shapes.bin"
expect_grep "labels agree with the checker on ([0-9]+) of \1 " "$LAST_OUT"
# 12 dataset images as a 4x3 grid with 2-pixel white borders (train_unet's and generate's layout):
# in turn of the classes, then shifted by one
check_py "
d = read('$T/shapes.bin')
by = [[im for im, l in zip(d['images'], d['labels']) if l == c] for c in range(3)]
def grid(path, tiles):
    s, W, H = 32, 4 * 34 + 2, 3 * 34 + 2
    g = bytearray([255] * (W * H * 3))
    for i, im in enumerate(tiles):
        x0, y0 = 2 + (i % 4) * 34, 2 + (i // 4) * 34
        for y in range(s): g[((y0 + y) * W + x0) * 3:((y0 + y) * W + x0 + s) * 3] = im[y * s * 3:(y + 1) * s * 3]
    png(path, W, H, 2, g)
grid('$T/in_turn.png', [by[i % 3][i // 3] for i in range(12)])
grid('$T/shifted.png', [by[(i + 1) % 3][i // 3] for i in range(12)])
"
expect_ok ./check_shapes --grid 32 --classes-in-turn "$T/in_turn.png"
expect_grep "^12 images, 12 valid" "$LAST_OUT"
expect_grep "labels agree with the checker on 12 of 12 " "$LAST_OUT"
expect_ok ./check_shapes --grid 32 --count 6 --classes-in-turn "$T/shifted.png"
expect_grep "labels agree with the checker on 0 of 6 " "$LAST_OUT"

case_begin "check_shapes: a class's name is found in constant time, whatever the class count"
# 100,000 classes and a million 1x1 images, each labelled with the last class: a lookup that walks
# the name table from the start (about 3 * 10^11 steps) takes many minutes, the table of names one
# pass. The time limit is some hundred times what the table needs on a slow machine.
python3 - "$T/classes.bin" <<'PY'
import struct, sys
classes, count = 100000, 1000000
names = b"".join(b"class%d\0" % k for k in range(classes))
labels_at = (64 + len(names) + 7) // 8 * 8
pixels_at = (labels_at + 4 * count + 63) // 64 * 64
header = b"UNETDSET" + struct.pack("<IIQIIII", 1, 3, count, 1, 1, classes, len(names)) + bytes(24)
body = bytearray(header + names)
body += bytes(labels_at - len(body)) + struct.pack("<i", classes - 1) * count
body += bytes(pixels_at - len(body)) + bytes(3 * count)
open(sys.argv[1], "wb").write(body)
PY
expect_ok timeout 120 ./check_shapes --min-pass 0 "$T/classes.bin"
expect_grep "^1000000 images, 0 valid" "$LAST_OUT"

case_begin "an interrupt leaves neither the output nor a temporary file"
mkdir -p "$T/out2"
for sig in INT TERM; do
    timeout -s $sig 0.5 "$PD" --synthetic shapes --count 1000000 --size 64 --output "$T/out2/big.bin" \
        >/dev/null 2>&1
    rc=$?
    [ $rc = 124 ] || case_fail "SIG$sig: expected the run to be interrupted, got exit $rc"
    expect_absent "$T/out2/big.bin"
    expect_no_temp "$T/out2"
done

case_begin "an input file as --output is refused and left as it was (same path, another path, links)"
mkdir -p "$T/same"
cp "$T/formats/a_rgb.png" "$T/same/a.png"
cp "$T/formats/j.bmp" "$T/same/b.bmp"
cp "$T/same/a.png" "$T/a.orig"
cp "$T/same/b.bmp" "$T/b.orig"
ln -s "$T/same/a.png" "$T/link_to_a.png"
ln "$T/same/b.bmp" "$T/hard_link_to_b.bmp"
for out in "$T/same/a.png" "$T/same/../same/a.png" "$T/link_to_a.png" "$T/hard_link_to_b.bmp"; do
    expect_exit 1 "$PD" --input "$T/same" --output "$out" --size 8
    expect_grep "^prepare_data: error: output $out is the input file $T/same/(a.png|b.bmp)" "$LAST_ERR"
done
cmp -s "$T/same/a.png" "$T/a.orig" && cmp -s "$T/same/b.bmp" "$T/b.orig" || case_fail "an input file was changed"
[ -L "$T/link_to_a.png" ] || case_fail "the link given as --output was replaced"
expect_no_temp "$T/same"
expect_no_temp "$T"

case_begin "a device or a pipe as --output is refused, not replaced"
mkdir -p "$T/out4"
# As root, a broken build would replace /dev/null itself: a device node of our own when we can make one.
if mknod "$T/out4/null" c 1 3 2>/dev/null; then dev=$T/out4/null; else dev=/dev/null; fi
expect_exit 1 "$PD" --synthetic shapes --count 2 --size 8 --output "$dev"
expect_grep "^prepare_data: error: output $dev is not a regular file" "$LAST_ERR"
[ -c "$dev" ] || case_fail "$dev is no longer a device"
mkfifo "$T/out4/fifo"
expect_exit 1 "$PD" --input "$T/formats" --size 8 --output "$T/out4/fifo"
expect_grep "^prepare_data: error: output $T/out4/fifo is not a regular file" "$LAST_ERR"
[ -p "$T/out4/fifo" ] || case_fail "the pipe was replaced"
expect_no_temp "$T/out4"

# bad_huge_header.ppm: the 19-byte header of a 23000x23000 PPM. bad_huge.png: 124 bytes, a 23000x23000
# grey PNG with the data of its first rows only. Decoding either would cost gigabytes.
case_begin "an image of more than 8192x8192 pixels is skipped before it is decoded"
mkdir -p "$T/huge"
cp "$CORPUS/bad_huge_header.ppm" "$CORPUS/bad_huge.png" "$T/formats/a_rgb.png" "$T/huge/"
expect_ok "$PD" --input "$T/huge" --output "$T/huge.bin" --size 8
expect_grep "^prepare_data: warning: skipping $T/huge/bad_huge.png: 23000x23000 pixels, more than the limit" "$LAST_ERR"
expect_grep "^prepare_data: warning: skipping $T/huge/bad_huge_header.ppm: 23000x23000 pixels, more than the limit" \
    "$LAST_ERR"
expect_grep "wrote 1 image .*, 2 files skipped" "$LAST_OUT"

# bad_header_only.ppm: the header of a 4x4 PPM, without its pixels.
case_begin "a PNM file shorter than its header says is skipped, not filled from stale memory"
mkdir -p "$T/short"
cp "$CORPUS/bad_header_only.ppm" "$T/formats/a_rgb.png" "$T/short/"
check_py "
d = '$T/short/'
open(d + 'short16.pgm', 'wb').write(b'P5 4 4 65535\n' + bytes(16))  # 16 of its 32 bytes
open(d + 'short.ppm', 'wb').write(b'P6\n4 4\n255\n' + bytes(47))   # one byte short
open(d + 'whole16.pgm', 'wb').write(b'P5\n# a comment\n4 4\n65535\n' + bytes(32))
"
expect_ok "$PD" --input "$T/short" --output "$T/short.bin" --size 8
for f in bad_header_only.ppm short.ppm short16.pgm; do
    expect_grep "^prepare_data: warning: skipping $T/short/$f: truncated" "$LAST_ERR"
done
expect_grep "wrote 2 images .*, 3 files skipped" "$LAST_OUT"

case_begin "each folder and file is used once, however many links lead to it"
# An 18-level DAG: each folder holds two links to the next, the last one image: 2^18 paths to it.
mkdir -p "$T/dag/d18"
cp "$T/formats/a_rgb.png" "$T/dag/d18/image.png"
for i in $(seq 0 17); do
    mkdir -p "$T/dag/d$i"
    ln -s "../d$((i + 1))" "$T/dag/d$i/a"
    ln -s "../d$((i + 1))" "$T/dag/d$i/b"
done
expect_ok "$PD" --input "$T/dag/d0" --output "$T/dag.bin" --size 8
expect_grep "wrote 1 image .*, 0 files skipped, 18 duplicate folders skipped$" "$LAST_OUT"
[ -s "$LAST_ERR" ] && case_fail "expected no warnings: $(head -2 "$LAST_ERR")"
# Files reached through several links (as in an icon theme) and hard links, silently.
mkdir -p "$T/icons"
cp "$T/formats/a_rgb.png" "$T/icons/a.png"
cp "$T/formats/j.bmp" "$T/icons/e.bmp"
ln -s a.png "$T/icons/b.png"
ln -s "$T/icons/a.png" "$T/icons/c.png"
ln "$T/icons/a.png" "$T/icons/d.png"
expect_ok "$PD" --input "$T/icons" --output "$T/icons.bin" --size 8
expect_grep "wrote 2 images .*, 0 files skipped, 3 duplicate files skipped$" "$LAST_OUT"
[ -s "$LAST_ERR" ] && case_fail "expected no warnings: $(head -2 "$LAST_ERR")"
# The first path in sorted order wins: with --labels, an image linked from cats into dogs is a cat.
mkdir -p "$T/linked/cats" "$T/linked/dogs"
cp "$T/formats/a_rgb.png" "$T/linked/cats/1.png"
cp "$T/formats/h_one_pixel.png" "$T/linked/dogs/2.png"
ln -s ../cats/1.png "$T/linked/dogs/0.png"
expect_ok "$PD" --input "$T/linked" --output "$T/linked.bin" --size 8 --labels
check_py "
d = read('$T/linked.bin')
assert d['labels'] == [0, 1] and d['images'][1] == bytes([200, 100, 50] * 64), d['labels']
"

case_begin "each distinct file once: links and hard links skipped and counted, --keep_duplicates keeps them"
# pics: a.png b.bmp c.png sub/d.png, plus a hard link to b, a symlink to a, and a symlink to sub (a
# folder walked already, not a loop). In sorted order: a.png b.bmp c.png hard_b.bmp sub/ sym_a.png z_sub/
mkdir -p "$T/pics/sub"
check_py "
d = '$T/pics/'
png(d + 'a.png', 8, 8, 2, samples(11, 192))
bmp(d + 'b.bmp', 8, 8, samples(12, 192))
png(d + 'c.png', 8, 8, 2, samples(13, 192))
png(d + 'sub/d.png', 8, 8, 2, samples(14, 192))
"
ln "$T/pics/b.bmp" "$T/pics/hard_b.bmp"
ln -s a.png "$T/pics/sym_a.png"
ln -s sub "$T/pics/z_sub"
expect_ok "$PD" --input "$T/pics" --output "$T/pics.bin" --size 8
expect_grep "^prepare_data: wrote 4 images \(8x8 RGB, unlabelled\) to $T/pics.bin, [0-9]+ bytes, 0 files skipped, \
2 duplicate files and 1 duplicate folder skipped$" "$LAST_OUT"
[ -s "$LAST_ERR" ] && case_fail "expected no warnings: $(head -2 "$LAST_ERR")"
check_py "
d = read('$T/pics.bin')
want = [bytes(samples(k, 192)) for k in (11, 12, 13, 14)]  # a, b, c, sub/d: first paths in sorted order
assert d['images'] == want, 'images or order differ'
"
expect_ok "$PD" --input "$T/pics" --output "$T/pics_again.bin" --size 8
cmp -s "$T/pics.bin" "$T/pics_again.bin" || case_fail "two runs wrote different files"
expect_ok "$PD" --input "$T/pics" --output "$T/pics_all.bin" --size 8 --keep_duplicates
expect_grep "^prepare_data: wrote 7 images \(8x8 RGB, unlabelled\) to $T/pics_all.bin, [0-9]+ bytes, 0 files skipped, \
3 duplicate files kept$" "$LAST_OUT"
[ -s "$LAST_ERR" ] && case_fail "expected no warnings: $(head -2 "$LAST_ERR")"
check_py "
d = read('$T/pics_all.bin')
a, b, c, dd = [bytes(samples(k, 192)) for k in (11, 12, 13, 14)]
# every path in sorted order: a b c hard_b sub/d sym_a z_sub/d
assert d['images'] == [a, b, c, b, dd, a, dd], 'images or order differ'
"
expect_exit 2 "$PD" --input "$T/pics" --output "$T/pics_all2.bin" --size 8 --keep_duplicates=
expect_ok "$PD" --input "$T/pics" --output "$T/pics_all2.bin" --size 8 --keep_duplicates
cmp -s "$T/pics_all.bin" "$T/pics_all2.bin" || case_fail "two --keep_duplicates runs wrote different files"
# A loop stays a loop with --keep_duplicates: skipped with a warning, not followed.
ln -s .. "$T/pics/sub/up"
expect_ok "$PD" --input "$T/pics" --output "$T/pics_loop.bin" --size 8 --keep_duplicates
expect_grep "skipping $T/pics/sub/up: a link back" "$LAST_ERR"
expect_grep "wrote 7 images .*, 2 files skipped, 3 duplicate files kept$" "$LAST_OUT"  # sub/up, z_sub/up
cmp -s "$T/pics_all.bin" "$T/pics_loop.bin" || case_fail "the loop changed the dataset"
rm "$T/pics/sub/up"
# With --labels, a class folder that is a link to another is a class of its own only with --keep_duplicates.
mkdir -p "$T/cls/cats"
cp "$T/pics/a.png" "$T/cls/cats/"
ln -s cats "$T/cls/dogs"
expect_ok "$PD" --input "$T/cls" --output "$T/cls.bin" --size 8 --labels
expect_grep "wrote 1 image \(8x8 RGB, 1 class\) .*, 1 duplicate folder skipped$" "$LAST_OUT"
expect_ok "$PD" --input "$T/cls" --output "$T/cls.bin" --size 8 --labels --keep_duplicates
expect_grep "wrote 2 images \(8x8 RGB, 2 classes\) .*, 1 duplicate file kept$" "$LAST_OUT"
check_py "d = read('$T/cls.bin'); assert d['names'] == ['cats', 'dogs'] and d['labels'] == [0, 1], d"

case_begin "a file size limit (SIGXFSZ) is one error line, leaves no temporary file and the old output"
mkdir -p "$T/out5"
printf 'old' >"$T/out5/big.bin"
expect_exit 1 bash -c 'ulimit -f 64 && exec "$@"' - "$PD" --synthetic shapes --count 100 --size 32 \
    --output "$T/out5/big.bin"
expect_grep "^prepare_data: error: cannot write $T/out5/big.bin.tmp.[0-9]+: File too large" "$LAST_ERR"
[ "$(cat "$T/out5/big.bin")" = old ] || case_fail "the previous output was changed"
expect_no_temp "$T/out5"

case_begin "temporary files of killed runs (kill -9) are removed, those of running ones kept"
mkdir -p "$T/out6"
true & dead=$!
wait $dead  # now a PID of no process
for f in "out.bin.tmp.$dead" "out.bin.tmp.$$" "other.bin.tmp.$dead"; do printf 'x' >"$T/out6/$f"; done
expect_ok "$PD" --synthetic shapes --count 2 --size 8 --output "$T/out6/out.bin"
expect_absent "$T/out6/out.bin.tmp.$dead"
[ -e "$T/out6/out.bin.tmp.$$" ] || case_fail "the temporary file of a running process (this shell) was removed"
[ -e "$T/out6/other.bin.tmp.$dead" ] || case_fail "the temporary file of another output was removed"

case_begin "the output's folder is synced after the rename"
# sync_log.so logs the program's rename() and fsync() calls, in order, to $SYNC_LOG.
cat >"$T/sync_log.c" <<'END'
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/stat.h>
static void note(const char *what) {
    FILE *f = fopen(getenv("SYNC_LOG"), "a");
    if (f) fprintf(f, "%s\n", what), fclose(f);
}
int rename(const char *from, const char *to) {
    int r = ((int (*)(const char *, const char *))dlsym(RTLD_NEXT, "rename"))(from, to);
    note("rename");
    return r;
}
int fsync(int fd) {
    struct stat st;
    note(fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) ? "fsync folder" : "fsync file");
    return ((int (*)(int))dlsym(RTLD_NEXT, "fsync"))(fd);
}
END
if ! ${CC:-cc} -shared -fPIC -o "$T/sync_log.so" "$T/sync_log.c" -ldl; then
    case_fail "cannot build sync_log.so"
else
    # (An AddressSanitizer build wants its runtime loaded first; this preload is harmless to it.)
    expect_ok env SYNC_LOG="$T/sync.log" LD_PRELOAD="$T/sync_log.so" ASAN_OPTIONS=verify_asan_link_order=0 \
        "$PD" --synthetic shapes --count 2 --size 8 --output "$T/out6/synced.bin"
    [ "$(tr '\n' ' ' <"$T/sync.log")" = "fsync file rename fsync folder " ] ||
        case_fail "expected fsync of the file, rename, fsync of the folder; got: $(tr '\n' ' ' <"$T/sync.log")"
fi

case_summary
