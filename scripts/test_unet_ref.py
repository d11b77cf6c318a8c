"""Self-check of the PyTorch reference UNet (unet_ref.py) and the fixtures in dev/fixtures.

    python3 scripts/test_unet_ref.py [FIXTURE_DIR]     # default dev/fixtures

Checks the parameter counts of the known configs, guided-diffusion's state_dict names and
shapes, and that every fixture in the directory loads back (strict), stores its parameters,
x and target as bf16 (so exactly bf16 values) and its results as float32, and reproduces its
out, loss and gradients in float64 (to float32 rounding) and in float32 (to ~1e-5).
Ends with "N passed, N failed".
"""

import glob
import json
import os
import struct
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import count_parameters, create_model  # noqa: E402

FIXTURES = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "..", "dev", "fixtures"))
COMMITTED = ["unet_adm.safetensors", "unet_classifier_adaptive.safetensors",
             "unet_classifier_attention.safetensors", "unet_classifier_spatial.safetensors",
             "unet_classifier_spatial_v2.safetensors", "unet_conv_resample.safetensors",
             "unet_seed.safetensors", "unet_super_res.safetensors"]
# 13.05 MB: 6.02 MB for the first five, 2.84 + 2.86 MB for the spatial classifiers (their
# Linear(160, 2048) and Linear(2048, 5), 340k parameters, are 2.04 MB with the gradients), 1.33 MB
# for the upsampler.
COMMITTED_BYTES = 13.5e6

SEED = dict(image_size="64", num_channels="64", channel_mult="1,2,3,4", num_res_blocks="2",
            attention_resolutions="16,8", num_head_channels="32",
            use_scale_shift_norm="False", resblock_updown="False", conv_resample="False")
ADM64 = dict(image_size="64", num_channels="192", channel_mult="1,2,3,4", num_res_blocks="3",
             attention_resolutions="32,16,8", num_head_channels="64",
             use_scale_shift_norm="True", resblock_updown="True", conv_resample="True")

passed = failed = 0


def check(name, ok, detail=""):
    global passed, failed
    if ok:
        passed += 1
        print(f"ok    {name}")
    else:
        failed += 1
        print(f"FAIL  {name} {detail}")


def rel_err(a, ref, floor=0.0):
    """||a - ref|| / max(||ref||, floor); NaN anywhere gives inf."""
    err = (a.double() - ref.double()).norm().item()
    scale = max(ref.double().norm().item(), floor)
    return err / scale if scale > 0 and err == err else float("inf")


def test_parameter_counts():
    for name, cfg, expected in [
        ("seed", SEED, 20_494_211),
        ("seed+conv_resample", {**SEED, "conv_resample": "True"}, 22_080_323),
        ("adm64", ADM64, 295_131_267),
    ]:
        n = count_parameters(create_model(cfg))
        check(f"parameter count {name} = {expected:,}", n == expected, f"got {n:,}")


def test_state_dict_names():
    seed = {k: tuple(v.shape) for k, v in create_model(SEED).state_dict().items()}
    expected = {
        "time_embed.0.weight": (256, 64),
        "time_embed.2.weight": (256, 256),
        "input_blocks.0.0.weight": (64, 3, 3, 3),
        "input_blocks.1.0.in_layers.0.weight": (64,),
        "input_blocks.1.0.in_layers.2.weight": (64, 64, 3, 3),
        "input_blocks.1.0.emb_layers.1.weight": (64, 256),
        "input_blocks.1.0.out_layers.3.weight": (64, 64, 3, 3),
        "input_blocks.4.0.skip_connection.weight": (128, 64, 1, 1),
        "input_blocks.7.1.qkv.weight": (3 * 192, 192, 1),
        "input_blocks.7.1.proj_out.weight": (192, 192, 1),
        "middle_block.1.qkv.weight": (3 * 256, 256, 1),
        "middle_block.1.norm.weight": (256,),
        "output_blocks.0.0.in_layers.0.weight": (512,),
        "output_blocks.2.2.conv.weight": None,  # absent without conv_resample
        "out.0.weight": (64,),
        "out.2.weight": (3, 64, 3, 3),
        "input_blocks.3.0.op.weight": None,
        "label_emb.weight": None,
    }
    for key, shape in expected.items():
        got = seed.get(key)
        check(f"seed state_dict {key} {shape}", got == shape, f"got {got}")

    conv = create_model({**SEED, "conv_resample": "True"}).state_dict()
    check("conv_resample adds input_blocks.3.0.op.weight [64,64,3,3]",
          tuple(conv["input_blocks.3.0.op.weight"].shape) == (64, 64, 3, 3))
    check("conv_resample adds output_blocks.2.2.conv.weight [256,256,3,3]",
          tuple(conv["output_blocks.2.2.conv.weight"].shape) == (256, 256, 3, 3))

    adm = {k: tuple(v.shape) for k, v in
           create_model({**ADM64, "class_cond": "True", "learn_sigma": "True"})
           .state_dict().items()}
    for key, shape in {
        "label_emb.weight": (1000, 768),
        "input_blocks.4.0.emb_layers.1.weight": (2 * 192, 768),  # down ResBlock, scale-shift
        "output_blocks.3.2.in_layers.2.weight": (768, 768, 3, 3),  # up ResBlock
        "out.2.weight": (6, 192, 3, 3),
    }.items():
        check(f"adm64 state_dict {key} {shape}", adm.get(key) == shape, f"got {adm.get(key)}")
    check("adm64 has no op/conv resample weights",
          not any(k.endswith(("op.weight", "conv.weight")) for k in adm))


def run(model, d, dtype):
    model = model.to(dtype)
    x = d["x"].to(dtype).requires_grad_(True)
    if "low_res" in d:  # the upsampler
        out = model(x, d["t"], d["low_res"].to(dtype), d.get("y"))
    else:
        out = model(x, d["t"], d.get("y"))
    loss = ((out - d["target"].to(dtype)) ** 2).mean()
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    grads["x"] = x.grad
    return out.detach(), loss.detach(), grads


def dtype_of(path):
    """The dtype strings of a safetensors header, by tensor name."""
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
    return {k: v["dtype"] for k, v in header.items() if k != "__metadata__"}


def test_fixtures(directory):
    paths = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if directory == FIXTURES:
        names = [os.path.basename(p) for p in paths]
        check(f"committed fixtures are {COMMITTED}", names == COMMITTED, f"found {names}")
        total = sum(os.path.getsize(p) for p in paths)
        check(f"committed fixtures total {total / 1e6:.2f} MB <= {COMMITTED_BYTES / 1e6} MB",
              total <= COMMITTED_BYTES)
    else:
        check("fixtures present", len(paths) >= 1, f"found none in {directory}")
    for path in paths:
        name = os.path.basename(path)
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        d = load_file(path)
        names = list(create_model(meta).state_dict())
        check(f"{name}: every parameter and its gradient present",
              all(k in d and f"grad.{k}" in d for k in names) and "grad.x" in d)
        check(f"{name}: no parameter element is zero", all(bool((d[k] != 0).all()) for k in names))

        # Inputs exactly bf16 (stored as BF16, so widening to float32/64 is exact), results
        # float32, indices int64 -- both in the file header and as loaded.
        header = dtype_of(path)
        want = {k: "BF16" for k in names + ["x", "target"] + (["low_res"] if "low_res" in d else [])}
        want.update({k: "F32" for k in d if k.startswith("grad.") or k in ("out", "loss")})
        want.update({k: "I64" for k in ("t", "y") if k in d})
        bad = sorted(k for k in d if header.get(k) != want.get(k))
        check(f"{name}: params/x/target BF16, out/loss/grad F32, t/y I64", not bad,
              f"{bad[:5]}")
        exact = all(torch.equal(d[k].float().to(torch.bfloat16).float(), d[k].float())
                    for k in names + ["x", "target"])
        check(f"{name}: params/x/target are bf16-exact", exact)
        params = {k: d[k] for k in names}

        grad_scale = torch.cat([d[k].flatten() for k in d if k.startswith("grad.")]).norm()
        for dtype, tol in [(torch.float64, 1e-6), (torch.float32, 2e-5)]:
            model = create_model(meta)
            model.load_state_dict(params, strict=True)
            out, loss, grads = run(model, d, dtype)
            label = f"{name} {str(dtype).split('.')[-1]}"
            e_out = rel_err(out, d["out"])
            check(f"{label}: out rel err {e_out:.1e} <= {tol}", e_out <= tol)
            e_loss = rel_err(loss.reshape(1), d["loss"])
            check(f"{label}: loss rel err {e_loss:.1e} <= {tol}", e_loss <= tol)
            # Per tensor, relative, with a floor of 1e-3 of the whole gradient's norm. The
            # gradients that are zero in exact arithmetic (stored as ~1e-17, see
            # make_fixtures.py) are pure rounding noise in float32: for them the error is
            # measured against the whole gradient's norm.
            scale = grad_scale.item()
            worst = max((rel_err(g, d[f"grad.{k}"], 1e-3 * scale
                                 if d[f"grad.{k}"].norm() > 1e-9 * scale else scale), k)
                        for k, g in grads.items())
            check(f"{label}: grads worst rel err {worst[0]:.1e} ({worst[1]}) <= {tol}",
                  worst[0] <= tol)


if __name__ == "__main__":
    torch.manual_seed(0)
    test_parameter_counts()
    test_state_dict_names()
    test_fixtures(os.path.normpath(sys.argv[1]) if len(sys.argv) > 1 else FIXTURES)
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)
