"""Whole-model test fixtures for the C/CUDA UNet and its noisy classifier, from the PyTorch
reference (unet_ref.py).

Storage precision (read this first):
    parameters, x, target   BF16 in the file. They are drawn in float64 and rounded to bf16
                            (round to nearest even), so every stored value is exactly what
                            the model saw: the model is run in float64 on exactly these
                            rounded values (bf16 -> float64 is exact).
    out, loss, grad.*       float32: the float64 results rounded once to float32.
    t, y                    int64.
So every stored result is the float32 rounding of the exact answer for the stored inputs, and
a consumer that widens the bf16 tensors to float32 (exact) runs on the very same numbers.

Regenerate (deterministic: the same bytes every time with a given machine, device and torch
version; another CPU or torch version may change a result in its last float32 bit, since
float64 sums are rounded in a different order):

    python3 scripts/make_fixtures.py                    # the committed set -> dev/fixtures/
    python3 scripts/make_fixtures.py --out DIR          # the same set -> DIR
    python3 scripts/make_fixtures.py --large --device cuda --out /tmp/fx
                                   # only unet_seed_large.safetensors (~123 MB, not committed),
                                   # the real seed config; for the GPU tests

--device cuda runs the same float64 math on a GPU; results may differ from the CPU files in
the last float32 bit, and the inputs (drawn on the CPU) are identical.

One safetensors file per config. Tensors (PyTorch layouts):
    <param name>        BF16, every parameter under its guided-diffusion state_dict name, random
                        and non-zero (also the zero-initialised convs and the GroupNorm affines);
                        classifier_spatial's out.0.bias then moved where needed to keep every
                        ReLU input 0.1 of their RMS or more from 0 (see keep_off_relu_kink)
    x        [N,3,H,W]  BF16 input, ~N(0,1)
    t        [N] int64  timesteps in [0, 1000)
    y        [N] int64  labels in [0, num_classes), class-conditional configs only
    low_res  [N,3,h,w]  BF16, ~N(0,1), the upsampler's low-resolution input (super_res only)
    target   [N,C,H,W]  BF16, ~N(0,1), C = 6 with learn_sigma else 3
                        classifiers: [N,num_classes], ~N(0,1)
    out      [N,C,H,W]  F32, model(x, t, y)
                        classifiers: [N,num_classes], the logits model(x, t)
    loss     [1]        F32, mean((out - target)^2) over all N*C*H*W elements (with learn_sigma
                        too: a plain MSE over all six channels, not guided-diffusion's VLB);
                        classifiers: over the N*num_classes logits (an MSE, not a cross-entropy)
    grad.<param name>   F32, d loss / d param
    grad.x              F32, d loss / d x
__metadata__ holds the config under guided-diffusion's flag names, spelled as on its command
line (plus conv_resample, num_classes when class-conditional or a classifier, classifier_pool
for a classifier, and fixture_seed). Dropout is 0.

Committed configs (all num_channels 32, channel_mult 1,1, image 8x8, batch 2; 13.05 MB together,
5.70 MB of it the two spatial classifiers):
    adm            num_res_blocks 1: resblock_updown, use_scale_shift_norm, new attention
                   order with num_head_channels 16 (2 heads) at 4x4 in input, middle and
                   output blocks, class-conditional (10 classes), learn_sigma (6 channels)
    seed           num_res_blocks 0: conv_resample False (avg-pool down, nearest up, no
                   convs), no scale-shift, legacy attention with num_head_channels 16 at 8x8
                   and 4x4
    conv_resample  num_res_blocks 0: conv_resample True (strided-conv down, nearest + conv up),
                   use_scale_shift_norm, legacy attention with num_heads 4 (middle block) and
                   num_heads_upsample 2 (output block at 4x4)
    classifier_attention   the classifier (EncoderUNetModel), 5 logits, num_res_blocks 1:
                   resblock_updown, use_scale_shift_norm, legacy attention with
                   num_head_channels 16 (2 heads) at 4x4 in input and middle blocks; head
                   classifier_pool attention: GN, SiLU, AttentionPool2d over the final 4x4 (17
                   tokens: the mean, then the 16 pixels; 2 heads of 16, q-k-v-major order)
    classifier_adaptive    the classifier, 5 logits, num_res_blocks 1: conv_resample True
                   (strided-conv down), no scale-shift, legacy attention with
                   num_head_channels 16 at 4x4; head classifier_pool adaptive: GN, SiLU,
                   average pool, zero-initialised conv1x1 (random here), flatten
    classifier_spatial     classifier_adaptive's body (130,464 parameters), head classifier_pool
                   spatial: the means over the pixels of input_blocks.0 to .3's outputs and the
                   middle block's (5 x 32 = 160 features), Linear(160, 2048), ReLU,
                   Linear(2048, 5): 470,437 parameters, 2.84 MB
    super_res      the upsampler (SuperResModel) from 4x4 to 8x8: num_res_blocks 0, resblock_updown,
                   use_scale_shift_norm, legacy attention with num_head_channels 16 at 4x4,
                   class-conditional (10 classes), learn_sigma; 6 input channels (x, then
                   low_res bilinearly upsampled): 218,150 parameters, 1.33 MB
    classifier_spatial_v2  the same with classifier_pool spatial_v2: Linear(160, 2048),
                   GroupNorm32 on [N, 2048] (32 groups of 64), SiLU, Linear(2048, 5):
                   474,533 parameters, 2.86 MB
Why num_res_blocks 0 in two of them: parameters cost 2 bytes and gradients 4, and a two-level
width-32 model with num_res_blocks 1 has 254k-341k parameters (1.5-2.0 MB); the three
resampling variants (resblock_updown, conv_resample on, off) need three two-level models, at
least 5.2 MB with num_res_blocks 1. The input-block attention and the per-level ResBlocks of
num_res_blocks >= 1 are covered by adm (and by the large fixture). The spatial heads are large
for their body because guided-diffusion fixes their hidden width: Linear(160, 2048) and
Linear(2048, 5) are 340k parameters, 2.04 MB with their gradients.

Sizes: GroupNorm has 32 groups, so 32 channels is the narrowest model. At width 32 each group
holds one channel and GroupNorm removes any per-channel constant, so without scale-shift the
timestep embedding (added as a per-channel constant before a GroupNorm) has no effect in the
seed, classifier_adaptive and both spatial classifier fixtures; the scale-shift configs
exercise the embedding MLP, and the large fixture (width 64, two channels per group) exercises
the plain add.

Some gradients are zero in exact arithmetic for the same reason (a bias feeding a GroupNorm
with one channel per group, e.g. in_layers.2.bias at width 32, or the last output block's
biases before the final GroupNorm, or in the adaptive and attention classifiers the middle
block's last biases before the head's GroupNorm; the spatial heads have no GroupNorm first);
they are stored as ~1e-17. Compare gradients with an absolute floor, not a pure relative
error.

Large fixture (--large): the seed project's config at image 32 instead of 64 (attention
resolutions 16,8 at 64 become 8,4 at 32: the same levels, 8x8 and 4x4 tokens), num_channels
64, channel_mult 1,2,3,4, num_res_blocks 2, num_head_channels 32, no scale-shift, no
conv_resample, batch 2: 20,494,211 parameters.
"""

import argparse
import hashlib
import json
import os
import struct
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import (GroupNorm32, classifier_kwargs, count_parameters, create_model,  # noqa: E402
                      is_classifier, is_super_res, model_kwargs)

BATCH = 2
NUM_TIMESTEPS = 1000
STORE = torch.bfloat16  # parameters, x, target
RESULT = torch.float32  # out, loss, grad.*

# Shared by all committed configs; each entry below overrides some of these.
BASE = dict(
    image_size="8", num_channels="32", num_res_blocks="1", channel_mult="1,1",
    attention_resolutions="", num_heads="1", num_head_channels="-1",
    num_heads_upsample="-1", use_scale_shift_norm="False", resblock_updown="False",
    use_new_attention_order="False", dropout="0.0", class_cond="False",
    learn_sigma="False", conv_resample="True",
)

CONFIGS = {
    "adm": dict(resblock_updown="True", use_scale_shift_norm="True",
                use_new_attention_order="True", num_head_channels="16",
                attention_resolutions="4", class_cond="True", num_classes="10",
                learn_sigma="True"),
    "seed": dict(num_res_blocks="0", conv_resample="False", num_head_channels="16",
                 attention_resolutions="8,4"),
    "conv_resample": dict(num_res_blocks="0", conv_resample="True", use_scale_shift_norm="True",
                          num_heads="4", num_heads_upsample="2", attention_resolutions="4"),
    # The noisy classifier (EncoderUNetModel): logits for num_classes classes.
    "classifier_attention": dict(classifier_pool="attention", num_classes="5",
                                 num_res_blocks="1", resblock_updown="True",
                                 use_scale_shift_norm="True", num_head_channels="16",
                                 attention_resolutions="4"),
    "classifier_adaptive": dict(classifier_pool="adaptive", num_classes="5", num_res_blocks="1",
                                conv_resample="True", num_head_channels="16",
                                attention_resolutions="4"),
    # classifier_adaptive's body with the spatial heads (each config draws from its own seed,
    # so adding these leaves every other file as it was).
    "classifier_spatial": dict(classifier_pool="spatial", num_classes="5", num_res_blocks="1",
                               conv_resample="True", num_head_channels="16",
                               attention_resolutions="4"),
    "classifier_spatial_v2": dict(classifier_pool="spatial_v2", num_classes="5",
                                  num_res_blocks="1", conv_resample="True",
                                  num_head_channels="16", attention_resolutions="4"),
    # The upsampler (SuperResModel): x and the 4x4 low-resolution image, bilinearly upsampled, in.
    "super_res": dict(small_size="4", large_size="8", num_res_blocks="0", resblock_updown="True",
                      use_scale_shift_norm="True", num_head_channels="16", attention_resolutions="4",
                      class_cond="True", num_classes="10", learn_sigma="True"),
}

LARGE = ("seed_large", dict(
    BASE, image_size="32", num_channels="64", channel_mult="1,2,3,4", num_res_blocks="2",
    attention_resolutions="8,4", num_head_channels="32", use_scale_shift_norm="False",
    resblock_updown="False", conv_resample="False"))

DTYPE_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.int64: "I64"}


def tensor_bytes(t):
    """Little-endian bytes of a CPU tensor (numpy has no bfloat16: view it as int16)."""
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return t.numpy().tobytes()


def save_safetensors(path, tensors, metadata):
    """Write a safetensors file with a reproducible layout: metadata and tensors sorted by
    name (the safetensors library orders __metadata__ differently on every run).
    Layout: u64 little-endian header length, JSON header padded with spaces to a multiple
    of 8 bytes, then the tensors' little-endian bytes back to back in header order.
    Written to a temporary name and renamed."""
    header = {"__metadata__": dict(sorted(metadata.items()))}
    blobs, offset = [], 0
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        blob = tensor_bytes(t)
        header[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for blob in blobs:
            f.write(blob)
    os.replace(tmp, path)


def config_seed(name):
    """A fixed seed per config name (stable across Python runs, unlike hash())."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def to_store(v):
    """float64 -> the stored dtype (round to nearest even). Refuses an exact zero, so every
    stored parameter element is non-zero."""
    s = v.to(STORE)
    assert bool((s != 0).all()), "a drawn value rounded to zero"
    return s


def random_parameters(model, gen):
    """Non-zero values keeping activations O(1): weights ~ N(0, 1/fan_in), biases ~ 0.1 N,
    GroupNorm weight ~ 1 + 0.1 N, label embedding ~ N(0, 1); drawn in float64 on the CPU,
    rounded to bf16."""
    norm_params = {f"{m}.{p}" for m, mod in model.named_modules()
                   if isinstance(mod, GroupNorm32) for p in ("weight", "bias")}
    values = {}
    for name, p in model.named_parameters():
        z = torch.randn(p.shape, generator=gen, dtype=torch.float64)
        if name in norm_params:
            v = 1 + 0.1 * z if name.endswith("weight") else 0.1 * z
        elif name == "label_emb.weight":
            v = z
        elif p.dim() >= 2:
            v = z / (p[0].numel() ** 0.5)
        else:
            v = 0.1 * z
        values[name] = to_store(v)
    return values


# The spatial head's ReLU inputs are kept at least this fraction of their RMS from 0 (see
# keep_off_relu_kink).
RELU_MARGIN = 0.1


def keep_off_relu_kink(model, params, x, t):
    """The spatial head's ReLU (out.1) has a kink at 0: a hidden unit that a sample leaves just
    above or below it passes its whole gradient or none, so a model computing in bf16 (errors
    ~1e-2 of the units' scale) puts some units on the other side and gets whole rows of
    out.0.weight's gradient, and all that flows through them, different (PyTorch's own bf16
    autocast, on the CPU, lands 0.18 from this fixture's gradients without this, 0.017 with
    it). Runs the model on x, t and moves each out.0.bias entry whose unit is within
    RELU_MARGIN of the RMS of the ReLU's inputs from 0 in some sample, by multiples of that
    margin rounded to bf16 (the nearest that clears every sample), to at least that far; draws
    nothing from the generator. Updates params and the model; returns how many entries moved."""
    hidden = []
    hook = model.out[0].register_forward_hook(lambda module, inp, out: hidden.append(out.detach()))
    with torch.no_grad():
        model(x.double(), t)
    hook.remove()
    z = hidden[0].cpu()  # [N, 2048]
    bias = params["out.0.bias"].double()
    margin = RELU_MARGIN * z.pow(2).mean().sqrt().item()
    without = z - bias
    new, moved = bias.clone(), 0
    for j in range(bias.numel()):
        # candidates b, b + margin, b - margin, b + 2 margin, ...: a sample rules out two at most
        for k in range(4 * z.shape[0] + 4):
            v = float(bias[j]) + (k + 1) // 2 * margin * (1 if k % 2 else -1)
            v = torch.tensor(v, dtype=torch.float64).to(STORE).double()
            if v != 0 and bool(((without[:, j] + v).abs() >= margin).all()):
                moved += int(v != bias[j])
                new[j] = v
                break
        else:
            raise RuntimeError(f"no out.0.bias[{j}] leaves its unit {margin} from 0")
    params["out.0.bias"] = to_store(new)
    with torch.no_grad():
        model.out[0].bias.copy_(params["out.0.bias"].double())
    return moved


def make_fixture(name, cfg, device):
    cfg = {**cfg, "fixture_seed": str(config_seed(name))}
    gen = torch.Generator().manual_seed(config_seed(name))
    classifier = is_classifier(cfg)
    kw = classifier_kwargs(cfg) if classifier else model_kwargs(cfg)
    model = create_model(cfg).double()
    params = random_parameters(model, gen)
    # bf16 -> float64 is exact: the float64 model runs on exactly the stored values.
    model.load_state_dict({k: v.double() for k, v in params.items()}, strict=True)
    model = model.to(device)

    size = kw["image_size"]
    x = to_store(torch.randn(BATCH, 3, size, size, generator=gen, dtype=torch.float64))
    t = torch.randint(0, NUM_TIMESTEPS, (BATCH,), generator=gen)
    if classifier:  # logits: no labels in, a target per class
        y = None
        target_shape = (BATCH, kw["out_channels"])
    else:
        y = (torch.randint(0, kw["num_classes"], (BATCH,), generator=gen)
             if kw["num_classes"] is not None else None)
        target_shape = (BATCH, kw["out_channels"], size, size)
    target = to_store(torch.randn(target_shape, generator=gen, dtype=torch.float64))
    low_res = None
    if is_super_res(cfg):  # drawn last: the other configs' draws stay as they were
        small = int(cfg["small_size"])
        low_res = to_store(torch.randn(BATCH, 3, small, small, generator=gen, dtype=torch.float64))
    if classifier and kw["pool"] == "spatial":
        keep_off_relu_kink(model, params, x.to(device), t.to(device))

    x64 = x.double().to(device).requires_grad_(True)
    y_in = None if y is None else y.to(device)
    if low_res is not None:
        out = model(x64, t.to(device), low_res.double().to(device), y_in)
    else:
        out = model(x64, t.to(device), y_in)
    loss = ((out - target.double().to(device)) ** 2).mean()
    loss.backward()

    tensors = dict(params)
    tensors.update(x=x, t=t, target=target, out=out.detach().to(RESULT).cpu(),
                   loss=loss.detach().to(RESULT).cpu().reshape(1))
    if y is not None:
        tensors["y"] = y
    if low_res is not None:
        tensors["low_res"] = low_res
    for pname, p in model.named_parameters():
        tensors[f"grad.{pname}"] = p.grad.to(RESULT).cpu()
    tensors["grad.x"] = x64.grad.to(RESULT).cpu()
    return tensors, cfg, loss.item(), count_parameters(model)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--out", metavar="DIR", default=os.path.normpath(os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "..", "dev", "fixtures")),
        help="output directory (default dev/fixtures)")
    parser.add_argument("--large", action="store_true",
                        help="write only the large seed-config fixture (not committed)")
    parser.add_argument("--only", metavar="NAME", help="write only this committed config's fixture (e.g. super_res)")
    args = parser.parse_args()
    if args.device.startswith("cuda"):
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.backends.cudnn.deterministic = True
        torch.backends.cudnn.benchmark = False
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        torch.use_deterministic_algorithms(True, warn_only=True)
    os.makedirs(args.out, exist_ok=True)
    jobs = [LARGE] if args.large else [(n, {**BASE, **o}) for n, o in CONFIGS.items() if args.only in (None, n)]
    total = 0
    for name, cfg in jobs:
        start = time.time()
        tensors, metadata, loss, n_params = make_fixture(name, cfg, args.device)
        path = os.path.join(args.out, f"unet_{name}.safetensors")
        save_safetensors(path, tensors, metadata)
        nbytes = os.path.getsize(path)
        total += nbytes
        print(f"{path}: {nbytes / 1e6:.2f} MB, {n_params:,} parameters, loss {loss:.6f}, "
              f"{time.time() - start:.1f} s")
    print(f"total {total / 1e6:.2f} MB")


if __name__ == "__main__":
    main()
