"""The upsampler against plain interpolation, on dataset .bin files (dataset.h's format).

    python3 scripts/superres_psnr.py downsample IN.bin FACTOR OUT.bin
        writes IN's images downsampled by FACTOR (block means, as F.interpolate(mode="area"),
        rounded to pixels), with IN's labels and class names
    python3 scripts/superres_psnr.py psnr ORIGINAL.bin LOW.bin SAMPLES.bin
        the PSNR against ORIGINAL of SAMPLES (the upsampler's images of LOW, e.g. generate's PNGs
        through prepare_data) and of LOW upsampled bicubically and bilinearly (PyTorch's
        F.interpolate, align_corners False): the mean over images of each image's PSNR, in dB

Needs numpy, and torch for psnr.
"""

import struct
import sys

import numpy as np

HEADER = struct.Struct("<8sIIQIIII24x")  # magic, version, channels, count, height, width, classes, names bytes


def align(x, a):
    return (x + a - 1) // a * a


def read(path):
    """(pixels [N][H][W][C] uint8, labels or None, names bytes, header tuple)."""
    data = open(path, "rb").read()
    magic, version, channels, count, height, width, classes, names_bytes = HEADER.unpack_from(data)
    assert magic == b"UNETDSET" and version == 1, f"{path}: not a dataset .bin"
    names = data[64:64 + names_bytes]
    labels_at = align(64 + names_bytes, 8)
    labels = np.frombuffer(data, np.int32, count, labels_at) if classes else None
    pixels_at = align(labels_at + (4 * count if classes else 0), 64)
    pixels = np.frombuffer(data, np.uint8, count * height * width * channels, pixels_at).reshape(count, height, width, channels)
    return pixels, labels, names, classes


def write(path, pixels, labels, names, classes):
    count, height, width, channels = pixels.shape
    out = bytearray(HEADER.pack(b"UNETDSET", 1, channels, count, height, width, classes, len(names)))
    out += names
    out += b"\0" * (align(len(out), 8) - len(out))
    if classes:
        out += labels.astype("<i4").tobytes()
    out += b"\0" * (align(len(out), 64) - len(out))
    out += pixels.astype(np.uint8).tobytes()
    open(path, "wb").write(out)


def psnr(a, b):
    """Each image's PSNR (peak 255), in dB."""
    mse = ((a.astype(np.float64) - b.astype(np.float64)) ** 2).reshape(len(a), -1).mean(axis=1)
    return 10 * np.log10(255.0 ** 2 / np.maximum(mse, 1e-12))


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "downsample":
        pixels, labels, names, classes = read(sys.argv[2])
        f = int(sys.argv[3])
        n, h, w, c = pixels.shape
        low = pixels.reshape(n, h // f, f, w // f, f, c).astype(np.float64).mean(axis=(2, 4))
        write(sys.argv[4], np.rint(low), labels, names, classes)
        print(f"wrote {sys.argv[4]}: {n} images of {h // f}x{w // f}")
    elif len(sys.argv) == 5 and sys.argv[1] == "psnr":
        import torch
        import torch.nn.functional as F
        original, low, samples = (read(p)[0] for p in sys.argv[2:5])
        n = min(len(original), len(samples))
        original, low, samples = original[:n], low[:n], samples[:n]
        lo = torch.from_numpy(low.astype(np.float64)).permute(0, 3, 1, 2)
        size = original.shape[1:3]
        rows = [("upsampler", samples)]
        for mode in ("bicubic", "bilinear"):
            up = F.interpolate(lo, size=size, mode=mode, align_corners=False).clamp(0, 255).round()
            rows.append((mode, up.permute(0, 2, 3, 1).numpy()))
        for name, images in rows:
            p = psnr(images, original)
            print(f"{name:10s} PSNR {p.mean():.2f} dB (median {np.median(p):.2f}, {n} images)")
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main()
