"""The PyTorch side of `make bench`'s sampling row: guided-diffusion's DDIM (ddim_sample with
eta 0, space_timesteps' "ddimN" respacing, x0 clipped to [-1, 1]) on our reference UNet
(unet_ref.py), one batch of N images, the model under bf16 autocast, channels-last. CUDA events
around each whole sampling run after a warm-up run; median of R runs.

With --guidance W (classifier-free guidance) the model is class-conditional (--classes K, plus the
null class K) and runs on the doubled batch, the images with their labels (classes in turn) and
then with the null class, as generate does: eps = uncond + W (cond - uncond).

With --classifier_scale S (classifier guidance, guided-diffusion's classifier_sample.py: cond_fn
with ddim_sample's condition_score) the model is unconditional and a noisy classifier of the same
images (train_unet's default: guided-diffusion's --classifier_width 128 --classifier_depth 2
--classifier_attention_resolutions 32,16,8 --classifier_use_scale_shift_norm True
--classifier_resblock_updown True --classifier_pool attention, --classes logits) gives each step
the gradient of its log-softmax at the images' classes (in turn) by autograd: eps -= sqrt(1 - a)
S grad. Compiled, the classifier is its own compiled module (its forward and its backward, CUDA-graphed
with reduce-overhead) and the update takes the gradient as an input.

    python3 scripts/sample_torch.py --preset seed --num 256 --steps 50 --mode eager|compile|reduce-overhead [--runs 5]
                                    [--guidance 3 --classes 3] [--classifier_scale 1 --classes 3]

The weights are PyTorch's initialisation (the time does not depend on them).
"""

import argparse
import math
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import PRESETS, time_runs  # noqa: E402
from unet_ref import create_model  # noqa: E402

# train_unet's default classifier (guided-diffusion's classifier flags) in unet_ref's names.
CLASSIFIER = dict(num_channels="128", num_res_blocks="2", attention_resolutions="32,16,8", use_scale_shift_norm="True",
                  resblock_updown="True", classifier_pool="attention", num_head_channels="64", channel_mult="")


def linear_alphas_cumprod(T):
    scale = 1000 / T
    betas = torch.linspace(scale * 1e-4, scale * 0.02, T, dtype=torch.float64)
    return torch.cumprod(1 - betas, 0)


def respaced(T, count):
    """space_timesteps(T, "ddim<count>"): t = 0, s, 2s, ... with the smallest stride s giving count."""
    for stride in range(1, T + 1):
        if len(range(0, T, stride)) == count:
            return list(range(0, T, stride))
    raise ValueError(f"no stride gives {count} of {T} steps")


def ddim_step(model, x, t, coef, y=None, guidance=1.0, score=None):
    """One DDIM step (eta 0): x0 = (x - sqrt(1 - a) eps) / sqrt(a), clipped; eps recomputed from x0;
    x_prev = sqrt(a_prev) x0 + sqrt(1 - a_prev) eps. coef: sqrt(a), sqrt(1 - a), sqrt(a_prev), sqrt(1 - a_prev).
    Guided: y holds the labels then the null class (2N), and the output is uncond + w (cond - uncond).
    score (classifier guidance's S grad log p(y | x)): eps -= sqrt(1 - a) score after the clipping, x0 again."""
    with torch.autocast("cuda", dtype=torch.bfloat16):
        if y is None:
            out = model(x, t).float()
        else:
            cond, uncond = model(torch.cat([x, x]), torch.cat([t, t]), y).float().chunk(2)
            out = uncond + guidance * (cond - uncond)
    x0 = ((x - coef[1] * out) / coef[0]).clamp(-1, 1)
    eps = (x - coef[0] * x0) / coef[1]
    if score is not None:  # condition_score
        eps = eps - coef[1] * score
        x0 = (x - coef[1] * eps) / coef[0]
    return coef[2] * x0 + coef[3] * eps


def classifier_gradient(classifier, x, t, y, scale):
    """guided-diffusion's cond_fn: S d log_softmax(classifier(x, t))[y] / dx, the classifier under bf16 autocast."""
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = classifier(x_in, t)
        selected = torch.log_softmax(logits.float(), dim=-1)[torch.arange(len(y), device=y.device), y].sum()
        return torch.autograd.grad(selected, x_in)[0] * scale


@torch.no_grad()
def ddim_sample(step, x, t, coefs, mark_step, score=None):
    """The steps in turn; t [steps][N] and coefs [steps][4] already on the GPU; score(x, t) classifier guidance's."""
    for k in range(t.shape[0]):
        mark_step()
        if score is None:
            x = step(x, t[k], coefs[k]).clone()  # clone: a CUDA-graph output is overwritten by the next replay
        else:
            x = step(x, t[k], coefs[k], score(x, t[k]).clone()).clone()
    return x


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="seed", choices=PRESETS)
    parser.add_argument("--num", type=int, default=256)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--mode", default="eager", choices=["eager", "compile", "reduce-overhead"])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--guidance", type=float, default=1.0)
    parser.add_argument("--classes", type=int, default=3)
    parser.add_argument("--classifier_scale", type=float, default=None)
    args = parser.parse_args()

    torch.manual_seed(0)
    flags = dict(PRESETS[args.preset])
    y = None
    if args.guidance != 1.0:
        flags.update(class_cond="True", num_classes=str(args.classes + 1))
        labels = torch.arange(args.num, device="cuda") % args.classes
        y = torch.cat([labels, torch.full_like(labels, args.classes)])
    model = create_model(flags).cuda().eval().to(memory_format=torch.channels_last)

    def step(x, t, coef, score=None):
        return ddim_step(model, x, t, coef, y, args.guidance, score)

    score = None
    if args.classifier_scale is not None:
        classifier = create_model(dict(CLASSIFIER, image_size=flags["image_size"], num_classes=str(args.classes)))
        classifier = classifier.cuda().eval().to(memory_format=torch.channels_last)
        for p in classifier.parameters():
            p.requires_grad_(False)
        classes = torch.arange(args.num, device="cuda") % args.classes
        if args.mode != "eager":
            classifier = torch.compile(classifier, mode=None if args.mode == "compile" else "reduce-overhead")
        score = lambda x, t: classifier_gradient(classifier, x, t, classes, args.classifier_scale)  # noqa: E731

    mark_step = lambda: None  # noqa: E731
    if args.mode != "eager":  # the whole step compiled: the model and the update
        step = torch.compile(step, mode=None if args.mode == "compile" else "reduce-overhead")
        if args.mode == "reduce-overhead":
            mark_step = torch.compiler.cudagraph_mark_step_begin
    size = int(PRESETS[args.preset]["image_size"])
    abar = linear_alphas_cumprod(1000)
    timesteps = respaced(1000, args.steps)[::-1]  # from the noisiest
    rows = []
    for k, timestep in enumerate(timesteps):
        a, a_prev = abar[timestep].item(), abar[timesteps[k + 1]].item() if k + 1 < len(timesteps) else 1.0
        rows.append([math.sqrt(a), math.sqrt(1 - a), math.sqrt(a_prev), math.sqrt(1 - a_prev)])
    coefs = torch.tensor(rows, device="cuda", dtype=torch.float32)
    t = torch.tensor(timesteps, device="cuda", dtype=torch.long)[:, None].expand(-1, args.num).contiguous()
    noise = torch.randn(args.num, 3, size, size, device="cuda").to(memory_format=torch.channels_last)

    began = time.time()
    ddim_sample(step, noise, t, coefs, mark_step, score)
    torch.cuda.synchronize()
    warmup_s = time.time() - began
    seconds = [ms / 1000 for ms in time_runs(lambda: ddim_sample(step, noise, t, coefs, mark_step, score), args.runs)]
    median = statistics.median(seconds)
    guided = f", guidance {args.guidance:g} (batch {2 * args.num})" if y is not None else ""
    if score is not None:
        guided += f", classifier guidance {args.classifier_scale:g} ({args.classes} classes)"
    print(f"torch {args.mode}: {args.preset} preset{guided}, DDIM {args.steps} steps, {args.num} images in one batch: median "
          f"{median:.3f} s ({args.num / median:.1f} images/s; min {min(seconds):.3f} s, max {max(seconds):.3f} s over "
          f"{args.runs} runs), warm-up {warmup_s:.0f} s")


if __name__ == "__main__":
    main()
