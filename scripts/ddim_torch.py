"""Deterministic DDIM by our PyTorch reference: guided-diffusion's ddim_sample_loop (eta 0,
clip_denoised, SpacedDiffusion's respaced schedule) on a checkpoint's model (scripts/unet_ref.py),
from the starting noise that generate draws (the project's counter-based draws), so that its images
and `generate --sampler ddim`'s differ only by their arithmetic.

    python3 scripts/ddim_torch.py CHECKPOINT --compare DIR [--num N] [--steps 50] [--respacing SPEC] [--seed S]

CHECKPOINT: a checkpoint folder (its ema.safetensors) or a .safetensors file of an unconditional
model; DIR: generate's output for the same checkpoint, --num, --steps (or --respacing) and --seed
(000000.png ...). Prints how far generate's images are from these, in pixel levels (0..255): the
mean and largest difference, and the share of pixels more than one level apart. Needs PyTorch and
the safetensors package; runs on CUDA when there is a GPU.
"""

import argparse
import os
import struct
import sys
import zlib

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diffusion_ref import Diffusion, betas_for, normal_sample, respaced, space_timesteps  # noqa: E402
from unet_ref import create_model  # noqa: E402

RNG_SAMPLE_START = 10  # RandomPurpose in train_unet.cu: a sampler's starting noise


def read_png(path):
    """An 8-bit RGB, non-interlaced PNG (as generate writes them) as an (H, W, 3) uint8 array."""
    data = open(path, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path}: not a PNG"
    at, idat, width, height = 8, b"", 0, 0
    while at < len(data):
        length, kind = struct.unpack(">I4s", data[at:at + 8])
        body = data[at + 8:at + 8 + length]
        if kind == b"IHDR":
            width, height, depth, color, _, _, interlace = struct.unpack(">IIBBBBB", body)
            assert depth == 8 and color == 2 and interlace == 0, f"{path}: not 8-bit RGB"
        elif kind == b"IDAT":
            idat += body
        at += 12 + length
    raw, stride = zlib.decompress(idat), width * 3
    out, prev = np.zeros((height, stride), dtype=np.int32), np.zeros(stride, dtype=np.int32)
    for y in range(height):
        kind, line = raw[y * (stride + 1)], np.frombuffer(raw, np.uint8, stride, y * (stride + 1) + 1).astype(np.int32)
        row = np.zeros(stride, dtype=np.int32)
        for i in range(stride):  # the PNG filters (none, sub, up, average, Paeth)
            a, b, c = (row[i - 3] if i >= 3 else 0), prev[i], (prev[i - 3] if i >= 3 else 0)
            if kind == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                predictor = a if pa <= pb and pa <= pc else b if pb <= pc else c
            else:
                predictor = [0, a, b, (a + b) // 2][kind]
            row[i] = (line[i] + predictor) & 255
        out[y], prev = row, row
    return out.reshape(height, width, 3).astype(np.uint8)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("--compare", required=True, metavar="DIR")
    p.add_argument("--num", type=int, default=16)
    p.add_argument("--steps", type=int, default=50)
    p.add_argument("--respacing", default="")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    path = os.path.join(args.checkpoint, "ema.safetensors") if os.path.isdir(args.checkpoint) else args.checkpoint
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    if meta.get("class_cond") == "True":
        sys.exit("ddim_torch: a class-conditional model; this compares unconditional sampling only")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = create_model(meta).to(device).eval()
    weights = load_file(path)
    model.load_state_dict({k: v.float() for k, v in weights.items() if k in model.state_dict()}, strict=True)
    T, size = int(meta.get("diffusion_steps", 1000)), int(meta["image_size"])
    steps = space_timesteps(T, args.respacing or f"ddim{args.steps}")
    d = respaced(Diffusion(betas_for(meta.get("noise_schedule", "linear"), T)), steps)
    predict = meta.get("predict", "eps")
    per_image = size * size * 3
    index = np.arange(args.num * per_image, dtype=np.uint64)
    x = torch.from_numpy(normal_sample(args.seed, RNG_SAMPLE_START << 48, index).reshape(args.num, size, size, 3)).double()
    for k in reversed(range(len(steps))):  # ddim_sample with eta 0
        with torch.no_grad():
            out = model(x.float().permute(0, 3, 1, 2).to(device), torch.full((args.num,), steps[k], device=device))
        out = out.double().cpu().permute(0, 2, 3, 1)[..., :3]  # a learned variance's mean part
        a, a_prev = d.abar[k], d.abar_prev[k]
        x0 = torch.sqrt(1 / a) * x - torch.sqrt(1 / a - 1) * out if predict == "eps" else \
            torch.sqrt(a) * x - torch.sqrt(1 - a) * out if predict == "v" else out
        x0 = x0.clamp(-1, 1)
        eps = (torch.sqrt(1 / a) * x - x0) / torch.sqrt(1 / a - 1)
        x = x0 * torch.sqrt(a_prev) + torch.sqrt(1 - a_prev) * eps
    ours = ((x + 1) * 127.5).clamp(0, 255).to(torch.uint8).numpy()  # guided-diffusion's quantization, as generate's
    theirs = np.stack([read_png(os.path.join(args.compare, f"{i:06d}.png")) for i in range(args.num)])
    diff = np.abs(ours.astype(np.int32) - theirs.astype(np.int32))
    print(f"DDIM {len(steps)} steps, {args.num} images: generate against guided-diffusion's ddim_sample_loop (PyTorch "
          f"reference, float64 sampler): mean {diff.mean():.3f} levels, largest {diff.max()}, "
          f"{(diff > 1).mean() * 100:.3f}% of values more than 1 apart")


if __name__ == "__main__":
    main()
