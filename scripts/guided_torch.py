"""Classifier guidance by our PyTorch reference: guided-diffusion's classifier_sample.py (its
cond_fn, p_sample_loop with condition_mean, ddim_sample_loop with condition_score, SpacedDiffusion
giving both networks the original timesteps) on guided-diffusion .pt files, from the noise that
generate draws (the project's counter-based draws), so that its images and `generate
--classifier`'s differ only by their arithmetic.

    python3 scripts/guided_torch.py make DIR [--seed 0]
    python3 scripts/guided_torch.py compare DIR --out SAMPLES... [--sampler ddim|ddpm] [--steps 25]
                                    [--classifier_scale S] [--num N] [--seed S] [--precise] [--autocast]

make: writes DIR/model.pt and DIR/classifier.pt (torch.save of a state_dict, as guided-diffusion's
releases) with random weights at guided-diffusion's released 64x64 flags (MODEL_FLAGS: the class-conditional
model with a learned variance and its classifier; the zero-initialised output layers drawn like
the others, so that both networks' outputs depend on their inputs; the classifier's logits spread
as a trained one's, LOGIT_GAIN), and DIR/flags, the flags
generate needs for them. compare: samples with guided-diffusion's loops in PyTorch (the networks
in float32 without TF32; with --precise in float64; the samplers' arithmetic in float64) and
prints how far generate's images in each SAMPLES folder (made with DIR/flags and the same --sampler, --steps,
--classifier_scale, --num, --seed) are from them, in pixel levels, and how far guidance moved the
reference's images (the same loop at scale 0). Images are quantized as guided-diffusion's scripts
do, ((x + 1) * 127.5).clamp(0, 255) truncated to uint8. --autocast also runs the loop with both
networks under bfloat16 autocast and prints how far that lands from the float32 loop: what bfloat16
arithmetic alone does to these images. Needs PyTorch; runs on CUDA when there is a GPU.
"""

import argparse
import functools
import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddim_torch import read_png  # noqa: E402
from diffusion_ref import Diffusion, betas_for, cond_fn, normal_sample, respaced, space_timesteps  # noqa: E402
from unet_ref import create_classifier, create_model  # noqa: E402

RNG_SAMPLE_START, RNG_SAMPLE_NOISE = 10, 11  # RandomPurpose in gpu.cuh

# guided-diffusion's README, 64x64 ImageNet: MODEL_FLAGS (at 128 channels, not 192: the FP32 build's
# GroupNorm takes at most 1024 channels) and CLASSIFIER_FLAGS; use_fp16 left out.
MODEL_FLAGS = dict(attention_resolutions="32,16,8", class_cond=True, diffusion_steps=1000, dropout=0.1, image_size=64,
                   learn_sigma=True, noise_schedule="cosine", num_channels=128, num_head_channels=64, num_res_blocks=3,
                   resblock_updown=True, use_new_attention_order=True, use_scale_shift_norm=True)
CLASSIFIER_FLAGS = dict(classifier_attention_resolutions="32,16,8", classifier_depth=4, classifier_width=128,
                        classifier_pool="attention", classifier_resblock_updown=True, classifier_use_scale_shift_norm=True)

LOGIT_GAIN = 30.0  # make's classifier: its random logits' spread times this


def classifier_args(size):
    """guided-diffusion's create_classifier: its flags as the UNet's (num_head_channels 64)."""
    c = CLASSIFIER_FLAGS
    return dict(image_size=size, num_channels=c["classifier_width"], num_res_blocks=c["classifier_depth"],
                attention_resolutions=c["classifier_attention_resolutions"], num_head_channels=64,
                use_scale_shift_norm=c["classifier_use_scale_shift_norm"], resblock_updown=c["classifier_resblock_updown"],
                classifier_pool=c["classifier_pool"], num_classes=1000)


def redraw_zeros(model):
    """Draws the zero-initialised weights (the output convolutions) as PyTorch initialises a layer."""
    for module in model.modules():
        if isinstance(module, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)) and not module.weight.any():
            module.reset_parameters()


def make(args):
    torch.manual_seed(args.seed)
    os.makedirs(args.dir, exist_ok=True)
    model = create_model(MODEL_FLAGS)
    classifier = create_classifier(classifier_args(MODEL_FLAGS["image_size"]))
    for m in (model, classifier):
        redraw_zeros(m.eval())
    with torch.no_grad():  # logits as far apart as a trained classifier's, so that guidance moves the images at its scales
        classifier.out[2].c_proj.weight.mul_(LOGIT_GAIN)
        classifier.out[2].c_proj.bias.mul_(LOGIT_GAIN)
    torch.save(model.state_dict(), os.path.join(args.dir, "model.pt"))
    torch.save(classifier.state_dict(), os.path.join(args.dir, "classifier.pt"))
    line = " ".join(f"--{k} {v}" for k, v in {**MODEL_FLAGS, **CLASSIFIER_FLAGS}.items())
    with open(os.path.join(args.dir, "flags"), "w") as f:
        f.write(f"--checkpoint {args.dir}/model.pt --classifier {args.dir}/classifier.pt {line}\n")


def sample(model, classifier, d, steps, x, y, scale, sampler, seed, dtype, device, bf16=False):
    """classifier_sample.py's loop: x [N,H,W,C] float64 starting noise -> the samples (float64);
    bf16: both networks under torch.autocast's bfloat16 (as a BF16 build computes them)."""
    n = x.shape[0]
    per_image = x[0].numel()
    index = np.arange(n * per_image, dtype=np.uint64)
    for j, k in enumerate(reversed(range(len(steps)))):  # plan step j at the respaced index k
        t = torch.full((n,), steps[k], device=device)    # the networks' (original) timestep
        x_in = x.permute(0, 3, 1, 2).to(device, dtype)
        with torch.no_grad(), torch.autocast(device, torch.bfloat16, enabled=bf16):
            out = model(x_in, t, y).double().cpu().permute(0, 2, 3, 1)
        with torch.autocast(device, torch.bfloat16, enabled=bf16):
            g = cond_fn(classifier, x_in, t, y, scale).double().cpu().permute(0, 2, 3, 1)
        eps, v = out[..., :3], out[..., 3:]
        x0 = d.x0_from_output(x, eps, k, 0).clamp(-1, 1)
        if sampler == "ddpm":  # p_sample with condition_mean
            mean, log_var = d.p_mean_variance(x, eps, v, k, 0, True)
            mean = mean + torch.exp(log_var) * g
            if k == 0:
                x = mean
            else:
                z = torch.from_numpy(normal_sample(seed, RNG_SAMPLE_NOISE << 48 | j, index).reshape(x.shape)).double()
                x = mean + torch.exp(0.5 * log_var) * z
        else:  # ddim_sample (eta 0) with condition_score
            a, a_prev = d.abar[k], d.abar_prev[k]
            e = (torch.sqrt(1 / a) * x - x0) / torch.sqrt(1 / a - 1) - torch.sqrt(1 - a) * g
            x0 = torch.sqrt(1 / a) * x - torch.sqrt(1 / a - 1) * e
            x = x0 * torch.sqrt(a_prev) + torch.sqrt(1 - a_prev) * e
    return x


def to_pixels(x):
    """guided-diffusion's image_sample.py and classifier_sample.py: ((x + 1) * 127.5).clamp(0, 255).to(uint8)."""
    return ((x + 1) * 127.5).clamp(0, 255).to(torch.uint8).numpy()


@functools.lru_cache(maxsize=1)
def networks(folder, dtype, device):
    """make's model and classifier, read once (compare may be called for several samplers and scales)."""
    for name in ("model.pt", "classifier.pt"):
        if not os.path.exists(os.path.join(folder, name)):
            sys.exit(f"guided_torch: {folder}/{name} missing: run `guided_torch.py make {folder}` first")
    model = create_model(MODEL_FLAGS).eval()
    model.load_state_dict(torch.load(os.path.join(folder, "model.pt"), map_location="cpu"))
    classifier = create_classifier(classifier_args(MODEL_FLAGS["image_size"])).eval()
    classifier.load_state_dict(torch.load(os.path.join(folder, "classifier.pt"), map_location="cpu"))
    return model.to(device, dtype), classifier.to(device, dtype)


def compare(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    dtype = torch.float64 if args.precise else torch.float32
    size = MODEL_FLAGS["image_size"]
    model, classifier = networks(args.dir, dtype, device)
    steps = space_timesteps(1000, f"ddim{args.steps}" if args.sampler == "ddim" else str(args.steps))
    d = respaced(Diffusion(betas_for(MODEL_FLAGS["noise_schedule"], 1000)), steps)
    y = torch.arange(args.num, device=device) % 1000  # generate's --class all: image i is class i
    index = np.arange(args.num * size * size * 3, dtype=np.uint64)
    x = torch.from_numpy(normal_sample(args.seed, RNG_SAMPLE_START << 48, index).reshape(args.num, size, size, 3)).double()
    guided = to_pixels(sample(model, classifier, d, steps, x, y, args.classifier_scale, args.sampler, args.seed, dtype, device))
    unguided = to_pixels(sample(model, classifier, d, steps, x, y, 0.0, args.sampler, args.seed, dtype, device))
    moved = np.abs(unguided.astype(np.int32) - guided.astype(np.int32)).mean()
    if args.autocast:  # how far bfloat16 arithmetic alone takes the same loop
        bf16 = to_pixels(sample(model, classifier, d, steps, x, y, args.classifier_scale, args.sampler, args.seed, dtype, device, True))
        diff = np.abs(bf16.astype(np.int32) - guided.astype(np.int32))
        print(f"PyTorch under bfloat16 autocast: {args.sampler} {len(steps)} steps, classifier scale {args.classifier_scale:g}, "
              f"{args.num} images against its float32 loop: mean {diff.mean():.3f} levels, largest {diff.max()}, "
              f"{(diff > 1).mean() * 100:.2f}% more than 1 apart")
    for out in args.out:
        ours = np.stack([read_png(os.path.join(out, f"{i:06d}.png")) for i in range(args.num)])
        diff = np.abs(ours.astype(np.int32) - guided.astype(np.int32))
        print(f"{out}: {args.sampler} {len(steps)} steps, classifier scale {args.classifier_scale:g}, {args.num} images against "
              f"guided-diffusion's loop: mean {diff.mean():.3f} levels, largest {diff.max()}, {(diff > 1).mean() * 100:.2f}% more "
              f"than 1 apart; guidance moved the reference by {moved:.2f} levels")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    m = sub.add_parser("make")
    m.add_argument("dir")
    m.add_argument("--seed", type=int, default=0)
    c = sub.add_parser("compare")
    c.add_argument("dir")
    c.add_argument("--out", required=True, nargs="+", help="generate's output folders (e.g. of the BF16 and FP32 builds)")
    c.add_argument("--sampler", choices=("ddim", "ddpm"), default="ddim")
    c.add_argument("--steps", type=int, default=25)
    c.add_argument("--classifier_scale", type=float, default=1.0)
    c.add_argument("--num", type=int, default=8)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--precise", action="store_true", help="the reference's networks in float64")
    c.add_argument("--autocast", action="store_true", help="also the same loop under bfloat16 autocast, against the reference")
    args = p.parse_args()
    make(args) if args.command == "make" else compare(args)


if __name__ == "__main__":
    main()
