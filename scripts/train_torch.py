"""The PyTorch reference training loop: our UNet (unet_ref.py) trained on a dataset .bin with
guided-diffusion's diffusion math, logging the same CSV as train_unet, so loss curves can be
compared (scripts/compare_training.sh, scripts/plot_log.py).

    python3 scripts/train_torch.py --data data/shapes.bin --preset seed --steps 2000 --batch_size 32 \
        --lr 1e-4 --log_interval 10 --csv OUT.csv [--seed 0] [--class_cond False] [--cfg_dropout 0] \
        [--noise_schedule linear|cosine] [--diffusion_steps 1000] [--predict eps|v] [--learn_sigma False] \
        [--rescale_learned_sigmas True] [--device cuda] \
        [--bf16 True] [--compile none|default|reduce-overhead] [--warmup_steps 0] [--ema_rate 0.9999]
        [--save FILE.safetensors]

Flags carry train_unet's names; model flags (--num_channels, --dropout, ...) override the preset.
The step: t ~ U{0..T-1}, x_t = sqrt(ab_t) x0 + sqrt(1 - ab_t) eps, loss = mean squared error of
model(x_t, t[, y]) against eps (or v = sqrt(ab_t) eps - sqrt(1 - ab_t) x0), AdamW, EMA. With
--learn_sigma True the model has 6 output channels and the loss is guided-diffusion's hybrid
(RESCALED_MSE): the MSE of the first 3 plus the variational bound's term in bits per dimension
(the KL of the posterior and the model's Gaussian, the discretized decoder's NLL at t = 0) with the
mean's output detached and the last 3 interpolating log beta_t and log beta~_t, times T/1000.
Data: each epoch a fresh seeded permutation, batches run across epoch boundaries, random
horizontal flips; the same semantics as train_unet's loader, not the same random draws.
Learning rate: linear warm-up over --warmup_steps (lr * step / warmup_steps at step 1..warmup_steps),
then constant, as train_unet's (without --lr_decay). EMA for every rate of --ema_rate, starting from
the initial weights: ema = rate ema + (1 - rate) params after each step, as train_unet's.
CSV columns: step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,mse,vb (see --help).
--save FILE.safetensors writes, after the last step, the first --ema_rate's EMA weights (what
./generate samples from a train_unet checkpoint folder by default: its ema.safetensors) as fp32
under guided-diffusion's state_dict names, with the model's flags in the metadata as train_unet
writes them, so `./generate --checkpoint FILE.safetensors` samples from it (unet_safetensors.py).
"""

import argparse
import math
import os
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import PRESETS  # noqa: E402
from diffusion_ref import Diffusion, discretized_gaussian_log_likelihood, normal_kl  # noqa: E402
from unet_ref import DEFAULTS, create_model, str2bool  # noqa: E402
from unet_safetensors import model_metadata, write_safetensors  # noqa: E402

PRESET_SCHEDULE = {"seed": "linear", "adm64": "cosine"}
MODEL_FLAGS = ["image_size", "num_channels", "channel_mult", "num_res_blocks", "attention_resolutions",
               "num_heads", "num_head_channels", "num_heads_upsample", "use_new_attention_order",
               "use_scale_shift_norm", "resblock_updown", "conv_resample", "dropout"]
CSV_HEADER = "step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,mse,vb"

# ---------------------------------------------------------------------------------------------
# Dataset .bin (dataset.h is authoritative): 64-byte header, class names, int32 labels, NHWC uint8.

HEADER = np.dtype([("magic", "S8"), ("version", "<u4"), ("channels", "<u4"), ("count", "<u8"),
                   ("height", "<u4"), ("width", "<u4"), ("num_classes", "<u4"), ("names_bytes", "<u4"),
                   ("reserved", "u1", (24,))])
assert HEADER.itemsize == 64


def align(x, a):
    return (x + a - 1) // a * a


def open_dataset(path):
    """Maps a dataset .bin and checks it as dataset_check does. Returns (pixels [N,H,W,3] uint8
    memmap, labels [N] int32 or None, class names)."""
    def fail(msg):
        sys.exit(f"dataset {path}: {msg}")
    size = os.path.getsize(path)
    if size < 64:
        fail(f"file is {size} bytes, shorter than the 64-byte header")
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    h = raw[:64].view(HEADER)[0]
    if h["magic"] != b"UNETDSET":
        fail('not a dataset file (bad magic; expected "UNETDSET")')
    if h["version"] != 1:
        fail(f"unsupported dataset version {h['version']} (this script reads 1)")
    if h["channels"] != 3:
        fail(f"{h['channels']} channels in header, expected 3 (RGB)")
    count, height, width = int(h["count"]), int(h["height"]), int(h["width"])
    classes, names_bytes = int(h["num_classes"]), int(h["names_bytes"])
    if not (1 <= height <= 8192 and 1 <= width <= 8192):
        fail(f"image size {width}x{height} in header is out of range (1..8192)")
    if count < 1:
        fail("header says the dataset holds no images")
    if classes > 100000:
        fail(f"{classes} classes in header, more than the limit of 100000")
    if (classes == 0) != (names_bytes == 0) or names_bytes > (1 << 24) or names_bytes < classes:
        fail(f"class-name table of {names_bytes} bytes does not fit {classes} classes")
    if np.any(h["reserved"]):
        fail("reserved header bytes are not zero")
    image_bytes = height * width * 3
    labels_offset = align(64 + names_bytes, 8)
    pixels_offset = align(labels_offset + (4 * count if classes else 0), 64)
    needed = pixels_offset + count * image_bytes
    if size != needed:
        fail(f"file is {size} bytes but its header ({count} images of {width}x{height}x3, {classes} classes) "
             f"needs {needed}: truncated or damaged")
    names, labels = [], None
    if classes:
        table = bytes(raw[64:64 + names_bytes])
        strings = table.count(b"\0")
        if strings != classes or table[-1:] != b"\0":
            fail(f"class-name table holds {strings} names, header says {classes} classes")
        names = [s.decode("utf-8", "replace") for s in table[:-1].split(b"\0")]
        labels = raw[labels_offset:labels_offset + 4 * count].view("<i4")
        bad = np.flatnonzero((labels < 0) | (labels >= classes))
        if bad.size:
            fail(f"image {bad[0]} has label {labels[bad[0]]}, outside 0..{classes - 1}")
    pixels = raw[pixels_offset:].reshape(count, height, width, 3)
    return pixels, labels, names


class Loader:
    """Batches of (uint8 NHWC images, labels or None): a fresh permutation each epoch, a batch
    may span two epochs, random horizontal flip with p = 0.5."""

    def __init__(self, pixels, labels, batch_size, seed, random_flip):
        self.pixels, self.labels, self.batch_size, self.random_flip = pixels, labels, batch_size, random_flip
        self.rng = np.random.default_rng(seed)
        self.order, self.pos = self.rng.permutation(len(pixels)), 0

    def next(self):
        idx = []
        while len(idx) < self.batch_size:
            if self.pos == len(self.order):
                self.order, self.pos = self.rng.permutation(len(self.pixels)), 0
            take = min(self.batch_size - len(idx), len(self.order) - self.pos)
            idx.extend(self.order[self.pos:self.pos + take])
            self.pos += take
        idx = np.asarray(idx)
        x = np.array(self.pixels[idx])  # a copy, [B,H,W,3]
        if self.random_flip:
            flip = self.rng.random(len(idx)) < 0.5
            x[flip] = x[flip, :, ::-1]
        y = None if self.labels is None else self.labels[idx].astype(np.int64)
        return x, y


# ---------------------------------------------------------------------------------------------
# guided-diffusion's noise schedules (gaussian_diffusion.py), in float64.

def betas_for_alpha_bar(T, alpha_bar, max_beta=0.999):
    return np.array([min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), max_beta) for i in range(T)],
                    dtype=np.float64)


def get_betas(schedule, T):
    if schedule == "linear":
        scale = 1000 / T
        return np.linspace(scale * 0.0001, scale * 0.02, T, dtype=np.float64)
    if schedule == "cosine":
        return betas_for_alpha_bar(T, lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2)
    raise ValueError(f"unknown noise schedule {schedule!r} (linear or cosine)")


# ---------------------------------------------------------------------------------------------

def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="dataset .bin written by prepare_data")
    p.add_argument("--preset", default="seed", choices=PRESETS)
    for name in MODEL_FLAGS:
        p.add_argument(f"--{name}", default=None, help="overrides the preset")
    p.add_argument("--class_cond", type=str2bool, default=False, help="condition on the dataset's labels")
    p.add_argument("--cfg_dropout", type=float, default=0.0,
                   help="probability of replacing a label by the null class (class_cond only)")
    p.add_argument("--diffusion_steps", type=int, default=1000)
    p.add_argument("--noise_schedule", default=None, choices=["linear", "cosine"],
                   help="default: the preset's (seed linear, adm64 cosine)")
    p.add_argument("--predict", default="eps", choices=["eps", "v"])
    p.add_argument("--learn_sigma", type=str2bool, default=False,
                   help="6 output channels trained with guided-diffusion's hybrid loss (MSE + the bound's term)")
    p.add_argument("--rescale_learned_sigmas", type=str2bool, default=True,
                   help="with learn_sigma: the bound's term times diffusion_steps/1000")
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--warmup_steps", type=int, default=0, help="linear learning-rate warm-up steps")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--ema_rate", default="0.9999", help="EMA decay rates, comma-separated (--save writes the first)")
    p.add_argument("--random_flip", type=str2bool, default=True)
    p.add_argument("--log_interval", type=int, default=10)
    p.add_argument("--csv", default="", help="CSV log to write (" + CSV_HEADER + ")")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bf16", type=str2bool, default=True, help="bf16 autocast (fp32 master weights)")
    p.add_argument("--compile", default="none", choices=["none", "default", "reduce-overhead"])
    p.add_argument("--save", default="", metavar="FILE.safetensors",
                   help="after the last step, write the first --ema_rate's EMA weights there, for ./generate")
    a = p.parse_args()
    if a.steps < 1 or a.batch_size < 1 or a.log_interval < 1 or a.diffusion_steps < 1:
        p.error("--steps, --batch_size, --log_interval and --diffusion_steps must be positive")
    if a.warmup_steps < 0:
        p.error(f"--warmup_steps {a.warmup_steps} must not be negative")
    try:
        a.ema_rates = [float(r) for r in a.ema_rate.split(",")]
    except ValueError:
        a.ema_rates = []
    if not 1 <= len(a.ema_rates) <= 8 or not all(0 < r < 1 for r in a.ema_rates):
        p.error(f"--ema_rate '{a.ema_rate}' must be 1 to 8 rates in (0, 1) separated by commas")
    if a.save:  # refuse an unwritable place now, not after the training
        folder = os.path.dirname(os.path.abspath(a.save))
        os.makedirs(folder, exist_ok=True)
        if not os.access(folder, os.W_OK) or os.path.isdir(a.save):
            p.error(f"--save {a.save}: cannot write a file there")
    return a


def learning_rate(a, step):
    """train_unet's learning_rate without --lr_decay: linear warm-up, then constant (step from 1)."""
    if a.warmup_steps > 0 and step <= a.warmup_steps:
        return a.lr * step / a.warmup_steps
    return a.lr


def bound_bits(d, x0, x_t, out, v, t, predict):
    """guided-diffusion's _vb_terms_bpd for a batch (t [n]): the variational bound's term of each
    sample in bits per dimension, for the prediction `out` and the variance half `v` (LEARNED_RANGE),
    in float32 with the float64 tables gathered (as _extract_into_tensor)."""
    def g(table):
        return table.to(x0.device)[t].float().view(-1, 1, 1, 1)
    a = g(d.abar)
    x0_model = torch.sqrt(1 / a) * x_t - torch.sqrt(1 / a - 1) * out if predict == "eps" else \
        torch.sqrt(a) * x_t - torch.sqrt(1 - a) * out
    mean = g(d.mean_x0) * x0_model + g(d.mean_xt) * x_t
    log_var_min, log_var_max = g(d.posterior_log_variance_clipped), g(torch.log(d.betas))
    frac = (v + 1) / 2
    log_var = frac * log_var_max + (1 - frac) * log_var_min
    true_mean = g(d.mean_x0) * x0 + g(d.mean_xt) * x_t
    kl = normal_kl(true_mean, log_var_min, mean, log_var).mean(dim=(1, 2, 3)) / math.log(2.0)
    nll = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_var).mean(dim=(1, 2, 3)) / math.log(2.0)
    return torch.where(t == 0, nll, kl)


def save_weights(path, model, weights, metadata):
    """Writes `weights` (tensors in the order of model.named_parameters(), e.g. an EMA) under the
    model's parameter names as fp32, C order ([out][in][kh][kw] for convolutions, whatever the
    memory format), atomically. The model has no buffers: its state_dict is its parameters."""
    names = [n for n, _ in model.named_parameters()]
    assert sorted(names) == sorted(model.state_dict()), "the model has buffers: save them too"
    tensors = []
    for name, (_, p), w in zip(names, model.named_parameters(), weights):
        assert w.shape == p.shape, name
        values = w.detach().to("cpu", torch.float32).contiguous()
        tensors.append((name, list(values.shape), values.numpy().astype("<f4", copy=False)))
    write_safetensors(path, tensors, metadata)


def main():
    a = parse_args()
    device = torch.device(a.device)
    torch.manual_seed(a.seed)
    pixels, labels, names = open_dataset(a.data)
    count, height, width, _ = pixels.shape

    flags = dict(PRESETS[a.preset])
    flags.update({k: getattr(a, k) for k in MODEL_FLAGS if getattr(a, k) is not None})
    if int(flags["image_size"]) != height or height != width:
        sys.exit(f"--image_size {flags['image_size']} does not match the dataset's {width}x{height} images")
    if a.class_cond and labels is None:
        sys.exit(f"--class_cond: dataset {a.data} has no labels")
    num_classes = len(names) if a.class_cond else 0
    flags.update(class_cond=a.class_cond, num_classes=num_classes + 1, learn_sigma=a.learn_sigma)  # + the null class
    schedule = a.noise_schedule or PRESET_SCHEDULE[a.preset]

    model = create_model(flags).to(device).to(memory_format=torch.channels_last)
    model.train()
    params = [p for p in model.parameters()]
    emas = [[p.detach().clone() for p in params] for _ in a.ema_rates]
    fused = {"fused": True} if device.type == "cuda" else {}
    opt = torch.optim.AdamW(params, lr=a.lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=a.weight_decay, **fused)
    forward = model if a.compile == "none" else torch.compile(
        model, mode=None if a.compile == "default" else "reduce-overhead")

    T = a.diffusion_steps
    if a.save:  # made now, so that a configuration it cannot describe stops before the training
        # What train_unet writes in a checkpoint's metadata, so generate reads the same model:
        # the model flags resolved over guided-diffusion's defaults, label_emb's rows (the
        # dataset's classes + the null class), the diffusion; then the training, for the record.
        save_metadata = model_metadata(
            {**DEFAULTS, **flags}, num_classes=num_classes + 1, diffusion_steps=T, noise_schedule=schedule,
            predict=a.predict, extra={
                "format": "train_torch.py EMA weights", "step": str(a.steps), "ema_rate": f"{a.ema_rates[0]:g}",
                "ema_rates": a.ema_rate, "batch_size": str(a.batch_size), "seed": str(a.seed), "lr": f"{a.lr:g}",
                "warmup_steps": str(a.warmup_steps), "weight_decay": f"{a.weight_decay:g}",
                "cfg_dropout": f"{a.cfg_dropout:g}", "random_flip": str(a.random_flip), "steps": str(a.steps),
                "bf16": str(a.bf16), "compile": a.compile})
    alphas_cumprod = np.cumprod(1.0 - get_betas(schedule, T))
    diffusion = Diffusion(torch.from_numpy(get_betas(schedule, T)))
    bound_scale = T / 1000.0 if a.rescale_learned_sigmas else 1.0
    # As guided-diffusion's _extract_into_tensor: float64 table, gathered, then float32.
    sqrt_ab = torch.from_numpy(np.sqrt(alphas_cumprod)).to(device)
    sqrt_1mab = torch.from_numpy(np.sqrt(1.0 - alphas_cumprod)).to(device)
    loader = Loader(pixels, labels if a.class_cond else None, a.batch_size, a.seed, a.random_flip)
    gen = torch.Generator(device=device).manual_seed(a.seed + 1)  # timesteps, noise, label dropout
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16)

    nparams = sum(p.numel() for p in params)
    print(f"train_torch: {a.preset} preset, {nparams:,} parameters, {count} images {width}x{height}"
          f"{f', {num_classes} classes (+ null, cfg_dropout {a.cfg_dropout})' if a.class_cond else ''}, "
          f"{schedule} schedule T={T}, predict {a.predict}, batch {a.batch_size}, lr {a.lr:g}"
          f"{f' (warm-up {a.warmup_steps} steps)' if a.warmup_steps else ''}, EMA {a.ema_rate}, "
          f"{device}, {'bf16' if a.bf16 else 'fp32'}, compile {a.compile}", flush=True)
    csv = None
    if a.csv:
        os.makedirs(os.path.dirname(os.path.abspath(a.csv)), exist_ok=True)
        csv = open(a.csv, "w")
        csv.write(CSV_HEADER + "\n")

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    sync()
    interval_start, losses, terms = time.perf_counter(), [], []
    for step in range(1, a.steps + 1):
        lr = learning_rate(a, step)
        for group in opt.param_groups:
            group["lr"] = lr
        x_u8, y = loader.next()
        x0 = torch.from_numpy(x_u8).to(device, non_blocking=True).permute(0, 3, 1, 2)
        x0 = (x0.float() / 127.5 - 1.0).contiguous(memory_format=torch.channels_last)
        n = x0.shape[0]
        t = torch.randint(0, T, (n,), device=device, generator=gen)
        eps = torch.randn(x0.shape, device=device, generator=gen).contiguous(memory_format=torch.channels_last)
        ca = sqrt_ab[t].float().view(n, 1, 1, 1)
        cb = sqrt_1mab[t].float().view(n, 1, 1, 1)
        x_t = ca * x0 + cb * eps
        target = eps if a.predict == "eps" else ca * eps - cb * x0
        extra = ()
        if a.class_cond:
            y = torch.from_numpy(y).to(device)
            drop = torch.rand(n, device=device, generator=gen) < a.cfg_dropout
            extra = (torch.where(drop, torch.full_like(y, num_classes), y),)
        with autocast:
            out = forward(x_t, t, *extra)
        if a.learn_sigma:  # the hybrid loss: per sample mse + s vb, vb through the variance half alone
            out, v = out.float()[:, :3], out.float()[:, 3:]
            mse = ((out - target) ** 2).mean(dim=(1, 2, 3))
            vb = bound_scale * bound_bits(diffusion, x0, x_t, out.detach(), v, t, a.predict)
            loss = (mse + vb).mean()
            terms.append(torch.stack([mse.mean().detach(), vb.mean().detach()]))
        else:
            loss = F.mse_loss(out.float(), target)
            terms.append(torch.stack([loss.detach(), torch.zeros_like(loss.detach())]))
        loss.backward()
        last = step % a.log_interval == 0 or step == a.steps
        if last:  # global L2 norm of all gradients, before any clipping
            grad_norm = torch.linalg.vector_norm(
                torch.stack(torch._foreach_norm([p.grad for p in params if p.grad is not None]))).item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for ema, rate in zip(emas, a.ema_rates):
                torch._foreach_lerp_(ema, [p.detach() for p in params], 1.0 - rate)
        losses.append(loss.detach())
        if last:
            sync()
            now = time.perf_counter()
            elapsed, k = now - interval_start, len(losses)
            mean_loss = torch.stack(losses).mean().item()
            mean_mse, mean_vb = torch.stack(terms).mean(dim=0).tolist()
            mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0
            row = (f"{step},{mean_loss:.6f},{lr:.6g},{grad_norm:.6f},{k * a.batch_size / elapsed:.2f},"
                   f"{elapsed / k * 1000:.3f},{mem:.3f},{mean_mse:.6f},{mean_vb:.6f}")
            if csv:
                csv.write(row + "\n")
                csv.flush()
            print(f"step {step}/{a.steps} | loss {mean_loss:.6f} | grad norm {grad_norm:.4f} | "
                  f"{elapsed / k * 1000:.1f} ms/step | {k * a.batch_size / elapsed:.0f} img/s | {mem:.2f} GiB",
                  flush=True)
            if not math.isfinite(mean_loss):
                sys.exit(f"loss is {mean_loss} at step {step}: stopping")
            interval_start, losses, terms = time.perf_counter(), [], []
    if csv:
        csv.close()
    if a.save:
        save_weights(a.save, model, emas[0], save_metadata)
        print(f"train_torch: wrote the EMA {a.ema_rates[0]:g} weights to {a.save}", flush=True)


if __name__ == "__main__":
    main()
