"""Bits per dimension of a dataset's images under a checkpoint's model, by our PyTorch reference:
guided-diffusion's calc_bpd_loop (image_nll.py, clip_denoised) on the model of scripts/unet_ref.py,
with the diffusion math of diffusion_ref.py and the same noise as generate --nll (the project's
counter-based draws), so that the two numbers differ only by their arithmetic.

    python3 scripts/nll_torch.py CHECKPOINT DATA.bin [--num N] [--respacing SPEC] [--seed S]

CHECKPOINT: a checkpoint folder (its ema.safetensors) or a .safetensors file. Needs PyTorch and
the safetensors package; runs on CUDA when there is a GPU. Prints one line as generate --nll does.
"""

import argparse
import math
import os
import struct
import sys

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diffusion_ref import (RNG_NLL, Diffusion, betas_for, bound_terms, normal_sample, prior_terms,  # noqa: E402
                           respaced, space_timesteps)
from unet_ref import create_model  # noqa: E402


def read_dataset(path, num):
    """The first num images (N, H, W, C uint8) and labels (or None) of a dataset .bin (dataset.h's layout)."""
    with open(path, "rb") as f:
        head = f.read(64)
        if head[:8] != b"UNETDSET":
            sys.exit(f"nll_torch: {path} is not a dataset")
        _, channels, count, height, width, classes, names_bytes = struct.unpack("<IIQIIII", head[8:40])
        n = min(num, count)
        labels_offset = (64 + names_bytes + 7) // 8 * 8
        pixels_offset = ((labels_offset + 4 * count if classes else 64 + names_bytes) + 63) // 64 * 64
        labels = None
        if classes:
            f.seek(labels_offset)
            labels = np.frombuffer(f.read(4 * n), dtype=np.int32).copy()
        f.seek(pixels_offset)
        pixels = np.frombuffer(f.read(n * height * width * channels), dtype=np.uint8).reshape(n, height, width, channels)
    return pixels, labels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint")
    p.add_argument("data")
    p.add_argument("--num", type=int, default=64)
    p.add_argument("--respacing", default="")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--batch", type=int, default=64)
    args = p.parse_args()
    path = os.path.join(args.checkpoint, "ema.safetensors") if os.path.isdir(args.checkpoint) else args.checkpoint
    with safe_open(path, "pt") as f:
        meta = f.metadata()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = create_model(meta).to(device).eval()
    weights = load_file(path)
    model.load_state_dict({k: v.float() for k, v in weights.items() if k in model.state_dict()}, strict=True)
    T = int(meta.get("diffusion_steps", 1000))
    base = Diffusion(betas_for(meta.get("noise_schedule", "linear"), T))
    steps = space_timesteps(T, args.respacing) if args.respacing else list(range(T))
    d = respaced(base, steps)
    predict = {"eps": 0, "v": 1, "x0": 2}[meta.get("predict", "eps")]
    learned = meta.get("learn_sigma", "False") == "True"
    pixels, labels = read_dataset(args.data, args.num)
    N, H, W, C = pixels.shape
    per_image = H * W * C
    bpd = []
    for first in range(0, N, args.batch):
        n = min(args.batch, N - first)
        # pixel / 127.5 - 1 as train_unet.cu's pixel_value, fmaf(pixel, 1/127.5f, -1): exact in double, rounded once
        x0 = torch.from_numpy((pixels[first:first + n] * float(np.float32(1 / 127.5)) - 1.0).astype(np.float32)).double()
        y = torch.from_numpy(labels[first:first + n]).long().to(device) if labels is not None and meta.get("class_cond") == "True" else None
        bits = torch.zeros(n, dtype=torch.float64)
        index = np.arange(first * per_image, (first + n) * per_image, dtype=np.uint64)
        for k, t in enumerate(steps):
            eps = torch.from_numpy(normal_sample(args.seed, RNG_NLL << 48 | k, index).reshape(n, H, W, C)).double()
            x_t = torch.sqrt(d.abar[k]) * x0 + torch.sqrt(1 - d.abar[k]) * eps
            with torch.no_grad():
                out = model(x_t.float().permute(0, 3, 1, 2).to(device), torch.full((n,), t, device=device), y)
            out = out.double().cpu().permute(0, 2, 3, 1)
            v = out[..., C:] if learned else None
            terms = bound_terms(d, x0, x_t, out[..., :C], v, k, predict, clip=True)
            bits += terms.reshape(n, -1).mean(1) / math.log(2)
        bits += prior_terms(d, x0).reshape(n, -1).mean(1) / math.log(2)
        bpd += bits.tolist()
    mean = sum(bpd) / len(bpd)
    se = math.sqrt(sum((b - mean) ** 2 for b in bpd) / max(len(bpd) - 1, 1) / len(bpd))
    print(f"bits/dim {mean:.4f} +- {se:.4f} (standard error of the mean over {len(bpd)} images; PyTorch reference)")


if __name__ == "__main__":
    main()
