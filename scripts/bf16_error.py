"""How far PyTorch's own bf16 autocast lands from each fixture (the float64 truth), to set the
BF16 build's tolerance against the same fixtures: its output, its worst parameter gradient and
its input gradient, each as ||a - ref|| / ||ref|| (gradients that are zero in exact arithmetic
measured against 1e-2 of the largest gradient norm, as dev/test/test_unet_gpu.cu does).

    python3 scripts/bf16_error.py [FIXTURE.safetensors ...]    (default: dev/fixtures/*; needs CUDA)
"""

import glob
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import create_model  # noqa: E402


def rel(a, ref, floor=0.0):
    return (a.double() - ref.double()).norm().item() / max(ref.double().norm().item(), floor)


def main():
    paths = sys.argv[1:] or sorted(glob.glob(os.path.join(os.path.dirname(__file__), "..", "dev", "fixtures", "*.safetensors")))
    for path in paths:
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        d = load_file(path, device="cuda")
        model = create_model(meta).cuda()
        model.load_state_dict({k: v.float() for k, v in d.items() if k in model.state_dict()}, strict=True)
        x = d["x"].float().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, d["t"], d.get("y"))
        loss = ((out.float() - d["target"].float()) ** 2).mean()
        loss.backward()
        largest = max(d["grad." + n].double().norm().item() for n, _ in model.named_parameters())
        worst = max((rel(p.grad, d["grad." + n], 1e-2 * largest), n) for n, p in model.named_parameters())
        print(f"{os.path.basename(path)}: output {rel(out.float(), d['out']):.2e}, loss {rel(loss, d['loss'].reshape(())):.2e}, "
              f"worst parameter gradient {worst[0]:.2e} ({worst[1]}), input gradient {rel(x.grad, d['grad.x']):.2e}")


if __name__ == "__main__":
    main()
