"""Few-step sampling quality on a real dataset: Fashion-MNIST, class-conditional at 32x32.

    python3 scripts/fashion_quality.py [--mnist DIR] [--out DIR] [--steps 4000] [--num 2000]

Needs a GPU, PyTorch (for the feature classifier only), NumPy and Pillow, and the dataset's four
idx files (Debian's dataset-fashion-mnist: /usr/share/datasets/fashion-mnist). Steps:

1. The training images as a dataset .bin: each 28x28 image padded with 2 black pixels a side to
   32x32, grey in all three channels, its class name in the table (written here, prepare_data's
   format; Fashion-MNIST comes as idx files, not image files).
2. Two models trained by train_unet for the same steps, batch and learning rate: guided-diffusion's
   eps prediction (1000 linear steps) and EDM's preconditioning (--precond edm); their ms per step
   is printed beside (the same model and step: the same time).
3. A feature network trained here on the real training images (a small CNN classifier, three
   epochs; its test accuracy printed), whose 128 pooled activations before the last layer are the
   features; the Frechet distance of a set of images' features to the 10,000 real test images'
   (the mean and covariance formula of FID, on this network instead of Inception).
4. Each model sampled by ./generate, --num images (the classes in turn), by the samplers of the
   table: the eps model by DDPM (1000 steps), DDIM-50, DPM-Solver++(2M) on 10, 20 and 50 Karras
   levels and Heun on 18 levels (35 calls), and three of them with x0's clipping the other way
   (guided-diffusion's samplers clip x0 to [-1, 1] at every step, k-diffusion's do not:
   --clip_denoised), DDPM respaced to 50 and 25 steps and Euler ancestral on 50 Karras levels
   (x0 clipped); the EDM model by Heun on 18 levels, DPM-Solver++(2M) on 10, 20 and 50, Euler
   ancestral on 50 and on 1000 levels; and --num real training images as the floor (the distance
   of real images).

Prints one row per sampler: model calls, the distance, and its ratio to the eps model's DDPM-1000
(the EDM model's 1000-step ancestral sampler, Euler ancestral on 1000 Karras levels, is its own
DDPM-1000).
"""

import argparse
import gzip
import os
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from superres_psnr import write as write_dataset  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
CLASSES = ["t-shirt", "trouser", "pullover", "dress", "coat", "sandal", "shirt", "sneaker", "bag", "ankle-boot"]
MODEL = ["--image_size", "32", "--num_channels", "64", "--channel_mult", "1,2,2", "--num_res_blocks", "2",
         "--attention_resolutions", "16", "--num_head_channels", "32", "--class_cond", "True", "--dropout", "0.1"]


def read_idx(path):
    with gzip.open(path, "rb") as f:
        data = f.read()
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], "big") for i in range(dims)]
    return np.frombuffer(data, np.uint8, offset=4 + 4 * dims).reshape(shape)


def as_rgb32(images):
    """[N][28][28] grey -> [N][32][32][3], 2 black pixels a side."""
    padded = np.pad(images, ((0, 0), (2, 2), (2, 2)))
    return np.repeat(padded[..., None], 3, axis=3)


def run(args, log):
    """Runs a command, its output into the log; exits with its tail on failure."""
    with open(log, "w") as f:
        r = subprocess.run(args, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n" + "".join(open(log).readlines()[-10:]))


def features(net, images, device):
    """The feature network's 128 features of uint8 images [N][32][32][3] (channel 0: they are grey)."""
    import torch
    out = []
    with torch.no_grad():
        for i in range(0, len(images), 1000):
            x = torch.from_numpy(images[i:i + 1000, :, :, :1].astype(np.float32) / 127.5 - 1).permute(0, 3, 1, 2).to(device)
            out.append(net(x, features=True).double().cpu().numpy())
    return np.concatenate(out)


def frechet(a, b):
    """|mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a^1/2 S_b S_a^1/2)^1/2), by symmetric eigendecompositions."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    s_a, s_b = np.cov(a, rowvar=False), np.cov(b, rowvar=False)
    w, v = np.linalg.eigh(s_a)
    root_a = (v * np.sqrt(np.clip(w, 0, None))) @ v.T
    m = root_a @ s_b @ root_a
    trace_root = np.sqrt(np.clip(np.linalg.eigvalsh((m + m.T) / 2), 0, None)).sum()
    return float(((mu_a - mu_b) ** 2).sum() + np.trace(s_a) + np.trace(s_b) - 2 * trace_root)


def train_feature_net(train_x, train_y, test_x, test_y, device):
    import torch
    import torch.nn as nn

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                                      nn.Conv2d(64, 128, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
            self.head = nn.Linear(128, 10)

        def forward(self, x, features=False):
            f = self.body(x)
            return f if features else self.head(f)

    torch.manual_seed(0)
    net = Net().to(device)
    opt = torch.optim.Adam(net.parameters(), 1e-3)
    x = torch.from_numpy(train_x[:, :, :, :1].astype(np.float32) / 127.5 - 1).permute(0, 3, 1, 2).to(device)
    y = torch.from_numpy(train_y.astype(np.int64)).to(device)
    for epoch in range(3):
        order = torch.randperm(len(x), device=device)
        for i in range(0, len(x), 256):
            idx = order[i:i + 256]
            loss = nn.functional.cross_entropy(net(x[idx]), y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
    net.eval()
    with torch.no_grad():
        t = torch.from_numpy(test_x[:, :, :, :1].astype(np.float32) / 127.5 - 1).permute(0, 3, 1, 2).to(device)
        accuracy = (net(t).argmax(1).cpu().numpy() == test_y).mean()
    return net, accuracy


def read_samples(folder, num):
    from PIL import Image
    names = sorted(n for n in os.listdir(folder) if n.endswith(".png") and n != "grid.png")[:num]
    return np.stack([np.asarray(Image.open(os.path.join(folder, n)).convert("RGB")) for n in names])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--mnist", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--out", default="build/fashion")
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--num", type=int, default=2000)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    train_x = as_rgb32(read_idx(os.path.join(a.mnist, "train-images-idx3-ubyte.gz")))
    train_y = read_idx(os.path.join(a.mnist, "train-labels-idx1-ubyte.gz")).astype(np.int32)
    test_x = as_rgb32(read_idx(os.path.join(a.mnist, "t10k-images-idx3-ubyte.gz")))
    test_y = read_idx(os.path.join(a.mnist, "t10k-labels-idx1-ubyte.gz")).astype(np.int32)
    data = os.path.join(a.out, "fashion_train.bin")
    write_dataset(data, train_x, train_y, b"".join(n.encode() + b"\0" for n in CLASSES), len(CLASSES))
    print(f"dataset: {data}, {len(train_x)} images of 32x32, {len(CLASSES)} classes", flush=True)

    runs = {}
    for name, extra in (("eps", []), ("edm", ["--precond", "edm"])):
        run_dir = os.path.join(a.out, name)
        start = time.time()
        run(["./train_unet", "--data", data, *MODEL, *extra, "--batch_size", "128", "--lr", "2e-4", "--ema_rate", "0.999",
             "--steps", str(a.steps), "--log_interval", "100", "--save_interval", str(a.steps), "--sample_count", "0",
             "--run_dir", run_dir, "--overwrite", "--seed", "1"], os.path.join(a.out, f"train_{name}.log"))
        rows = [line.split(",") for line in open(os.path.join(run_dir, "log.csv")).read().split("\n")[1:] if line]
        ms = np.median([float(r[5]) for r in rows[len(rows) // 2:]])
        runs[name] = os.path.join(run_dir, "checkpoints", f"step_{a.steps:09d}")
        print(f"trained {name}: {a.steps} steps in {time.time() - start:.0f} s, {ms:.2f} ms a step, last loss {rows[-1][1]}",
              flush=True)

    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    net, accuracy = train_feature_net(train_x, train_y, test_x, test_y, device)
    print(f"feature network: test accuracy {accuracy:.4f}", flush=True)
    reference = features(net, test_x, device)

    table = [("real training images", "-", 0, train_x[np.random.default_rng(0).permutation(len(train_x))[:a.num]])]
    samplers = [("eps", "DDPM", ["--sampler", "ddpm"], 1000), ("eps", "DDIM-50", ["--sampler", "ddim", "--steps", "50"], 50)]
    for model in ("eps", "edm"):
        for steps in (10, 20, 50):
            samplers.append((model, f"DPM-Solver++(2M) Karras {steps}", ["--sampler", "dpm++", "--schedule", "karras", "--steps",
                                                                          str(steps)], steps))
        samplers.append((model, "Heun Karras 18", ["--sampler", "heun", "--steps", "18"], 35))
        if model == "eps":  # guided-diffusion's samplers clip x0 at every step, k-diffusion's do not: both ways
            samplers.append((model, "DDIM-50, x0 not clipped", ["--sampler", "ddim", "--steps", "50", "--clip_denoised", "False"], 50))
            samplers.append((model, "DPM-Solver++(2M) Karras 20, x0 clipped", ["--sampler", "dpm++", "--schedule", "karras", "--steps",
                                                                                  "20", "--clip_denoised", "True"], 20))
            samplers.append((model, "Heun Karras 18, x0 clipped", ["--sampler", "heun", "--steps", "18", "--clip_denoised", "True"], 35))
        # ancestral (stochastic) samplers at few steps, and for the EDM model at 1000 steps, its DDPM-1000
        if model == "eps":
            samplers.append((model, "DDPM respaced 50", ["--sampler", "ddpm", "--steps", "50"], 50))
            samplers.append((model, "DDPM respaced 25", ["--sampler", "ddpm", "--steps", "25"], 25))
        samplers.append((model, "Euler ancestral Karras 50" + (", x0 clipped" if model == "eps" else ""),
                         ["--sampler", "euler_a", "--steps", "50"] + (["--clip_denoised", "True"] if model == "eps" else []), 50))
        if model == "edm":
            samplers.append((model, "Euler ancestral Karras 1000", ["--sampler", "euler_a", "--steps", "1000"], 1000))
    for model, name, flags, calls in samplers:
        folder = os.path.join(a.out, f"samples_{model}_{len(table)}")
        start = time.time()
        run(["./generate", "--checkpoint", runs[model], *flags, "--num", str(a.num), "--out", folder, "--seed", "7"],
            folder + ".log")
        table.append((f"{model}: {name}", calls, time.time() - start, read_samples(folder, a.num)))
        print(f"sampled {model}: {name} in {time.time() - start:.1f} s", flush=True)

    distances = [frechet(features(net, images, device), reference) for _, _, _, images in table]
    base = distances[[name for name, _, _, _ in table].index("eps: DDPM")]
    print(f"\nFashion-MNIST 32x32, class-conditional, {a.steps} steps of batch 128 each model; Frechet distance of {a.num} "
          f"images' features to the 10,000 test images' (feature network's test accuracy {accuracy:.4f})")
    print(f"{'images':42s} {'model calls':>11s} {'distance':>10s} {'/ DDPM':>8s} {'seconds':>8s}")
    for (name, calls, seconds, _), d in zip(table, distances):
        print(f"{name:42s} {str(calls):>11s} {d:10.4f} {d / base:8.3f} {seconds:8.1f}")

if __name__ == "__main__":
    main()
