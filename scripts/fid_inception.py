"""pytorch-fid's Inception-v3 written out in PyTorch, the reference evaluate's network is checked and
timed against: torchvision's Inception3 with pytorch-fid's FIDInceptionA, C, E_1 and E_2 blocks
(average pools without the padding in the count; a max pool in the last block), the same module
names, so pytorch-fid's pt_inception-2015-12-05-6726825d.pth loads into it with strict=True.

    python3 scripts/fid_inception.py fixture --ref REF.bin --sample SAMPLE.bin --out DIR
        random weights (DIR/inception.pth, torch.save), the features of REF's first 100 images in
        fp32 (DIR/features.safetensors: pool [100, 2048], spatial [100, 2023], logits [100, 1008])
        and, in its metadata, what guided-diffusion's evaluator formulas (make_metrics_fixture.py's
        NumPy port) give for REF against SAMPLE: fid, sfid, inception_score, precision, recall.
    python3 scripts/fid_inception.py weights --out FILE.pth
        random weights alone (for scripts/bench_fid.sh when pytorch-fid's are not at hand).
    python3 scripts/fid_inception.py fid --ref REF.bin --sample SAMPLE.bin --weights FILE.pth
        FID as pytorch-fid computes it (fp32, batches of 50, np.cov, scipy's sqrtm), timed: the
        peer of `evaluate` in scripts/bench_fid.sh.

What comes out of the network per image (as evaluate's): pool, the 2048 features of the last
average pool; spatial, the first 7 channels of Mixed_6d's 1x1 branch (TF's mixed_6/conv) at 17x17
in (y, x, channel) order; logits, pool times fc.weight without the bias (as guided-diffusion's
evaluator uses the graph's softmax/logits/MatMul).
"""

import argparse
import os
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_torch import open_dataset  # noqa: E402
from unet_safetensors import write_safetensors  # noqa: E402


class BasicConv2d(nn.Module):
    """A convolution without bias, BatchNorm (eps 0.001) and ReLU."""

    def __init__(self, cin, cout, kernel, stride=1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=0.001)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class InceptionA(nn.Module):
    def __init__(self, cin, pool_features):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 64, 1)
        self.branch5x5_1 = BasicConv2d(cin, 48, 1)
        self.branch5x5_2 = BasicConv2d(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, padding=1)
        self.branch_pool = BasicConv2d(cin, pool_features, 1)

    def forward(self, x):
        pool = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return torch.cat([self.branch1x1(x), self.branch5x5_2(self.branch5x5_1(x)),
                          self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))), self.branch_pool(pool)], 1)


class InceptionB(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3 = BasicConv2d(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = BasicConv2d(cin, 64, 1)
        self.branch3x3dbl_2 = BasicConv2d(64, 96, 3, padding=1)
        self.branch3x3dbl_3 = BasicConv2d(96, 96, 3, stride=2)

    def forward(self, x):
        return torch.cat([self.branch3x3(x), self.branch3x3dbl_3(self.branch3x3dbl_2(self.branch3x3dbl_1(x))),
                          F.max_pool2d(x, 3, stride=2)], 1)


class InceptionC(nn.Module):
    def __init__(self, cin, c7):
        super().__init__()
        self.branch1x1 = BasicConv2d(cin, 192, 1)
        self.branch7x7_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7_2 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7_3 = BasicConv2d(c7, 192, (7, 1), padding=(3, 0))
        self.branch7x7dbl_1 = BasicConv2d(cin, c7, 1)
        self.branch7x7dbl_2 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_3 = BasicConv2d(c7, c7, (1, 7), padding=(0, 3))
        self.branch7x7dbl_4 = BasicConv2d(c7, c7, (7, 1), padding=(3, 0))
        self.branch7x7dbl_5 = BasicConv2d(c7, 192, (1, 7), padding=(0, 3))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x):
        b7 = self.branch7x7_3(self.branch7x7_2(self.branch7x7_1(x)))
        d = x
        for layer in (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5):
            d = layer(d)
        pool = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return torch.cat([self.branch1x1(x), b7, d, self.branch_pool(pool)], 1)


class InceptionD(nn.Module):
    def __init__(self, cin):
        super().__init__()
        self.branch3x3_1 = BasicConv2d(cin, 192, 1)
        self.branch3x3_2 = BasicConv2d(192, 320, 3, stride=2)
        self.branch7x7x3_1 = BasicConv2d(cin, 192, 1)
        self.branch7x7x3_2 = BasicConv2d(192, 192, (1, 7), padding=(0, 3))
        self.branch7x7x3_3 = BasicConv2d(192, 192, (7, 1), padding=(3, 0))
        self.branch7x7x3_4 = BasicConv2d(192, 192, 3, stride=2)

    def forward(self, x):
        b7 = self.branch7x7x3_4(self.branch7x7x3_3(self.branch7x7x3_2(self.branch7x7x3_1(x))))
        return torch.cat([self.branch3x3_2(self.branch3x3_1(x)), b7, F.max_pool2d(x, 3, stride=2)], 1)


class InceptionE(nn.Module):
    """FIDInceptionE_1 (an average pool) or, with max_pool, FIDInceptionE_2."""

    def __init__(self, cin, max_pool):
        super().__init__()
        self.max_pool = max_pool
        self.branch1x1 = BasicConv2d(cin, 320, 1)
        self.branch3x3_1 = BasicConv2d(cin, 384, 1)
        self.branch3x3_2a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1 = BasicConv2d(cin, 448, 1)
        self.branch3x3dbl_2 = BasicConv2d(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = BasicConv2d(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = BasicConv2d(384, 384, (3, 1), padding=(1, 0))
        self.branch_pool = BasicConv2d(cin, 192, 1)

    def forward(self, x):
        a = self.branch3x3_1(x)
        d = self.branch3x3dbl_2(self.branch3x3dbl_1(x))
        if self.max_pool:
            pool = F.max_pool2d(x, 3, stride=1, padding=1)
        else:
            pool = F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=False)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(a), self.branch3x3_2b(a), self.branch3x3dbl_3a(d),
                          self.branch3x3dbl_3b(d), self.branch_pool(pool)], 1)


class FIDInception(nn.Module):
    def __init__(self):
        super().__init__()
        self.Conv2d_1a_3x3 = BasicConv2d(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = BasicConv2d(32, 32, 3)
        self.Conv2d_2b_3x3 = BasicConv2d(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = BasicConv2d(64, 80, 1)
        self.Conv2d_4a_3x3 = BasicConv2d(80, 192, 3)
        self.Mixed_5b = InceptionA(192, 32)
        self.Mixed_5c = InceptionA(256, 64)
        self.Mixed_5d = InceptionA(288, 64)
        self.Mixed_6a = InceptionB(288)
        self.Mixed_6b = InceptionC(768, 128)
        self.Mixed_6c = InceptionC(768, 160)
        self.Mixed_6d = InceptionC(768, 160)
        self.Mixed_6e = InceptionC(768, 192)
        self.Mixed_7a = InceptionD(768)
        self.Mixed_7b = InceptionE(1280, False)
        self.Mixed_7c = InceptionE(2048, True)
        self.fc = nn.Linear(2048, 1008)

    def forward(self, images):
        """images: [N, 3, H, W] in [0, 1]. Returns pool [N, 2048], spatial [N, 2023], logits [N, 1008]."""
        x = F.interpolate(images, size=(299, 299), mode="bilinear", align_corners=False)
        x = 2 * x - 1
        x = self.Conv2d_2b_3x3(self.Conv2d_2a_3x3(self.Conv2d_1a_3x3(x)))
        x = F.max_pool2d(x, 3, stride=2)
        x = F.max_pool2d(self.Conv2d_4a_3x3(self.Conv2d_3b_1x1(x)), 3, stride=2)
        for block in (self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a, self.Mixed_6b, self.Mixed_6c, self.Mixed_6d):
            x = block(x)
        spatial = x[:, :7].permute(0, 2, 3, 1).reshape(len(x), -1)
        for block in (self.Mixed_6e, self.Mixed_7a, self.Mixed_7b, self.Mixed_7c):
            x = block(x)
        pool = x.mean(dim=(2, 3))
        return pool, spatial, pool @ self.fc.weight.t()


def random_model(seed, calibration):
    """Random weights that keep the activations in range through the 94 layers: He-scaled
    convolutions, BatchNorms near identity, and the classifier scaled for logits of spread ~3 on
    the calibration images."""
    torch.manual_seed(seed)
    model = FIDInception()
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Conv2d):
                fan_in = m.weight[0].numel()
                m.weight.normal_(0, (2.0 / fan_in) ** 0.5)
            elif isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.8, 1.2)
                m.bias.normal_(0, 0.1)
                m.running_mean.normal_(0, 0.1)
                m.running_var.uniform_(0.5, 1.5)
        model.fc.weight.normal_(0, 1)
        model.fc.bias.normal_(0, 1)
        model.eval()
        pool, _, logits = model(calibration)
        model.fc.weight.mul_(3.0 / logits.std().item())
    return model


def images_tensor(pixels, device):
    return torch.from_numpy(np.array(pixels)).to(device).permute(0, 3, 1, 2).float() / 255


def features(model, pixels, device, batch=50):
    """The features of [N, H, W, 3] uint8 images, as float64 NumPy arrays."""
    outs = [[], [], []]
    with torch.no_grad():
        for i in range(0, len(pixels), batch):
            for o, f in zip(outs, model(images_tensor(pixels[i:i + batch], device))):
                o.append(f.double().cpu().numpy())
    return [np.concatenate(o) for o in outs]


def rounded_once(x, dtype):
    """float64 x rounded once to dtype. PyTorch takes float64 to float16 through float32, two
    roundings that can land a value next to an float16 halfway point on the wrong side: so round to
    float32 toward zero, mark an inexact result in its last bit (round to odd), then to float16."""
    if dtype == torch.float32:
        return x.float()
    f = x.float()
    f = torch.where(f.double().abs() > x.abs(), torch.nextafter(f, torch.zeros_like(f)), f)
    f = (f.view(torch.int32) | (f.double() != x).int()).view(torch.float32)
    return f.half()


def gpu_rounded_distances(u, v, device="cuda"):
    """make_metrics_fixture.rounded_distances in PyTorch: the squares rounded to u's dtype, their
    sums and the products' in float64, each rounded once, then the same float16 (or float32)
    operations in the same order (PyTorch rounds each operation's result, as NumPy does)."""
    dtype = torch.float16 if u.dtype == np.float16 else torch.float32
    x, y = (torch.from_numpy(np.ascontiguousarray(a)).to(device) for a in (u, v))
    norm_u, norm_v = (rounded_once((a * a).double().sum(1), dtype) for a in (x, y))
    dots = rounded_once(x.double() @ y.double().T, dtype)
    return torch.clamp(norm_u[:, None] - 2 * dots + norm_v[None, :], min=0).cpu().numpy()


def fixture(args):
    import make_metrics_fixture
    from make_metrics_fixture import frechet_distance, inception_score, precision_recall, statistics
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # the distances on the GPU: minutes less at 50,000 images
        make_metrics_fixture.rounded_distances = gpu_rounded_distances
    ref, _, _ = open_dataset(args.ref)
    sample, _, _ = open_dataset(args.sample)
    model = random_model(args.seed, images_tensor(ref[:50], "cpu")).to(device)
    os.makedirs(args.out, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out, "inception.pth"))
    ref_pool, ref_spatial, _ = features(model, ref, device)
    pool, spatial, logits = features(model, sample, device)
    precision, recall = precision_recall(ref_pool, pool)
    values = dict(fid=frechet_distance(statistics(ref_pool), statistics(pool)),
                  sfid=frechet_distance(statistics(ref_spatial), statistics(spatial)),
                  inception_score=inception_score(logits), precision=precision, recall=recall)
    first = [f.astype("<f4") for f in features(model, ref[:100], device)]
    tensors = [(name, list(x.shape), x.tobytes()) for name, x in zip(("pool", "spatial", "logits"), first)]
    path = os.path.join(args.out, "features.safetensors")
    write_safetensors(path, tensors, {k: repr(float(v)) for k, v in values.items()})
    print(f"wrote {args.out}/inception.pth and {path}: " + ", ".join(f"{k} {v:.6g}" for k, v in values.items()))


def weights(args):
    model = random_model(args.seed, torch.rand(50, 3, 64, 64, generator=torch.Generator().manual_seed(args.seed)))
    torch.save(model.state_dict(), args.out)
    print(f"wrote {args.out}")


def fid(args):
    """pytorch-fid's way: fp32 (its defaults: cuDNN may use TF32), batches of 50, then np.cov and
    scipy's sqrtm. Prints FID and the seconds it took, features and statistics apart."""
    from make_metrics_fixture import frechet_distance, statistics
    device = "cuda"
    model = FIDInception()
    model.load_state_dict(torch.load(args.weights, map_location="cpu"))
    model = model.to(device).eval()
    start = time.time()
    sets = [open_dataset(path)[0] for path in (args.ref, args.sample)]
    pools = [features(model, pixels, device, batch=50)[0] for pixels in sets]
    torch.cuda.synchronize()
    middle = time.time()
    distance = frechet_distance(statistics(pools[0]), statistics(pools[1]))
    end = time.time()
    print(f"FID {distance:.6f}: features of {sum(len(s) for s in sets)} images {middle - start:.2f} s, "
          f"statistics and distance {end - middle:.2f} s, total {end - start:.2f} s")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    f = sub.add_parser("fixture")
    f.add_argument("--ref", required=True)
    f.add_argument("--sample", required=True)
    f.add_argument("--out", required=True)
    f.add_argument("--seed", type=int, default=0)
    w = sub.add_parser("weights")
    w.add_argument("--out", required=True)
    w.add_argument("--seed", type=int, default=0)
    d = sub.add_parser("fid")
    d.add_argument("--ref", required=True)
    d.add_argument("--sample", required=True)
    d.add_argument("--weights", required=True)
    args = parser.parse_args()
    {"fixture": fixture, "weights": weights, "fid": fid}[args.command](args)


if __name__ == "__main__":
    main()
