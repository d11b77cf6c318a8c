"""The PyTorch side of `make bench`: one training step of our reference UNet (unet_ref.py) on a
fixed random batch, timed like `train_unet --bench`: forward under bf16 autocast, MSE loss,
backward, the gradient norm, fused AdamW, the EMA of the weights; CUDA events around each step
after warm-up, median of N. The step is guided-diffusion's TrainLoop.run_step, which train_unet's
is: it logs the gradient norm every step (here one multi-tensor norm, not waited for) and updates
an EMA of the weights for each --ema_rate (here one multi-tensor lerp). --bare leaves both out
(forward, loss, backward, AdamW): less work than train_unet's step does.

    python3 scripts/bench_torch.py --preset seed|adm64|... --batch_size 32 --mode eager|compile|reduce-overhead [--steps 50]
                                   [--use_checkpoint] [--ema_rate 0.9999] [--bare]

Modes: eager; torch.compile (default mode); torch.compile(mode="reduce-overhead"), which adds
CUDA graphs. The model is channels-last (NHWC), as ours is. --use_checkpoint: guided-diffusion's
gradient checkpointing, every ResBlock and AttentionBlock recomputed in backward
(torch.utils.checkpoint, non-reentrant), as train_unet's --use_checkpoint.
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch
import torch.utils.checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import AttentionBlock, ResBlock, create_model  # noqa: E402

PRESETS = {
    "seed": dict(image_size="64", num_channels="64", channel_mult="1,2,3,4", num_res_blocks="2",
                 attention_resolutions="16,8", num_head_channels="32", use_scale_shift_norm="False",
                 resblock_updown="False", conv_resample="False", use_new_attention_order="False", dropout="0.0"),
    "adm64": dict(image_size="64", num_channels="192", channel_mult="1,2,3,4", num_res_blocks="3",
                  attention_resolutions="32,16,8", num_head_channels="64", use_scale_shift_norm="True",
                  resblock_updown="True", conv_resample="True", use_new_attention_order="True", dropout="0.1"),
}
# guided-diffusion's released ImageNet models (train_unet's presets of the same names): learned sigma,
# class-conditional on 1000 classes (+ the null class) but adm256u.
for _size, _heads in ((128, dict(num_heads="4", num_head_channels="-1")), (256, dict(num_head_channels="64")),
                      (512, dict(num_head_channels="64"))):
    PRESETS[f"adm{_size}"] = dict(image_size=str(_size), num_channels="256", channel_mult="", num_res_blocks="2",
                                  attention_resolutions="32,16,8", use_scale_shift_norm="True", resblock_updown="True",
                                  conv_resample="True", use_new_attention_order="False", dropout="0.0", learn_sigma="True",
                                  class_cond="True", num_classes="1001", **_heads)
PRESETS["adm256u"] = dict(PRESETS["adm256"], class_cond="False")
# its upsamplers (64_256_upsampler.pt, 128_512_upsampler.pt): the upsampler's channel_mult of the size
PRESETS["adm64_256"] = dict(PRESETS["adm256"], small_size="64", num_channels="192", num_heads="4", num_head_channels="-1")
PRESETS["adm128_512"] = dict(PRESETS["adm512"], small_size="128", num_channels="192", attention_resolutions="32,16")


def time_runs(fn, runs):
    """Milliseconds of each of `runs` calls of fn, by CUDA events around each."""
    times = []
    for _ in range(runs):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return times


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="seed", choices=PRESETS)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--mode", default="eager", choices=["eager", "compile", "reduce-overhead"])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--use_checkpoint", action="store_true")
    parser.add_argument("--ema_rate", default="0.9999", help="EMA decay rates, comma-separated (train_unet's default)")
    parser.add_argument("--bare", action="store_true", help="no gradient norm, no EMA")
    args = parser.parse_args()

    torch.manual_seed(0)
    model = create_model(PRESETS[args.preset]).cuda().to(memory_format=torch.channels_last)
    if args.use_checkpoint:
        for module in model.modules():
            if isinstance(module, (ResBlock, AttentionBlock)):
                module.forward = functools.partial(torch.utils.checkpoint.checkpoint, module.forward, use_reentrant=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0, fused=True)
    n, size = args.batch_size, int(PRESETS[args.preset]["image_size"])
    flags = PRESETS[args.preset]
    x = torch.randn(n, 3, size, size, device="cuda").to(memory_format=torch.channels_last)
    out_channels = 6 if flags.get("learn_sigma") == "True" else 3  # learned sigma: the MSE over all six, a timing proxy
    target = torch.randn(n, out_channels, size, size, device="cuda").to(memory_format=torch.channels_last)
    t = torch.randint(0, 1000, (n,), device="cuda")
    labels = (torch.randint(0, int(flags["num_classes"]) - 1, (n,), device="cuda"),) if flags.get("class_cond") == "True" else ()
    if "small_size" in flags:  # an upsampler: low_res before the labels (SuperResModel.forward(x, t, low_res, y))
        small = int(flags["small_size"])
        labels = (torch.randn(n, 3, small, small, device="cuda").to(memory_format=torch.channels_last),) + labels
    forward = model
    if args.mode != "eager":
        forward = torch.compile(model, mode=None if args.mode == "compile" else "reduce-overhead")

    params = list(model.parameters())
    ema_rates = [] if args.bare else [float(r) for r in args.ema_rate.split(",") if r]
    emas = [[p.detach().clone() for p in params] for _ in ema_rates]

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = forward(x, t, *labels)
        loss = torch.nn.functional.mse_loss(out.float(), target)
        loss.backward()
        grad_norm = None
        if not args.bare:  # the gradient norm, as guided-diffusion logs it (and train_unet decides the step by it)
            grad_norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params if p.grad is not None])))
        optimizer.step()
        with torch.no_grad():
            for ema, rate in zip(emas, ema_rates):  # ema = rate ema + (1 - rate) params
                torch._foreach_lerp_(ema, params, 1.0 - rate)
        optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    began = time.time()
    for _ in range(10):
        step()
    torch.cuda.synchronize()
    warmup_s = time.time() - began
    times = time_runs(step, args.steps)
    median = statistics.median(times)
    print(f"torch {args.mode}{' --use_checkpoint' if args.use_checkpoint else ''}{' --bare' if args.bare else ''}: {args.preset} preset, batch {n}: median {median:.3f} ms/step "
          f"(min {min(times):.3f}, max {max(times):.3f} over {args.steps} steps), {n / median * 1000:.0f} img/s, "
          f"peak memory {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, warm-up {warmup_s:.0f} s")


if __name__ == "__main__":
    main()
