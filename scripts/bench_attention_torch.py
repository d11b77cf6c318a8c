"""PyTorch's attention on the shapes of dev/attention.cu's timing rows, bf16 on the GPU: the peer of
the trainer's fused attention core. Per shape: forward, and forward + backward minus forward, in ms
(median of 25 after warm-up, CUDA events), for
  sdpa    torch.nn.functional.scaled_dot_product_attention (flash attention where it applies)
  einsum  guided-diffusion's QKVAttention (scripts/unet_ref.py's form: einsum, fp32 softmax, einsum)
Usage: python3 scripts/bench_attention_torch.py"""
import os
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_torch import time_runs  # noqa: E402

SHAPES = [(32, 16, 16, 192, 6), (32, 8, 8, 256, 8), (32, 32, 32, 384, 6), (32, 16, 16, 576, 9)]  # N, H, W, C, heads


def median_ms(fn, runs=25):
    for _ in range(3):
        fn()
    return statistics.median(time_runs(fn, runs))


def sdpa(q, k, v):  # [N, heads, T, ch]
    return F.scaled_dot_product_attention(q, k, v)


def einsum(q, k, v):  # [N*heads, ch, T] as QKVAttention holds them
    scale = q.shape[1] ** -0.25
    w = torch.einsum("bct,bcs->bts", q * scale, k * scale)
    w = torch.softmax(w.float(), dim=-1).type(w.dtype)
    return torch.einsum("bts,bcs->bct", w, v)


def time_core(core, shape):
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    grad = torch.randn_like(core(q, k, v))
    fwd = median_ms(lambda: core(q, k, v))
    both = median_ms(lambda: torch.autograd.grad(core(q, k, v), (q, k, v), grad))
    return fwd, both - fwd


print(f"{torch.cuda.get_device_name()}, PyTorch {torch.__version__}")
print(f"{'shape':36} {'sdpa fwd':>9} {'bwd':>7} {'einsum fwd':>11} {'bwd':>7}")
for N, H, W, C, heads in SHAPES:
    T, ch = H * W, C // heads
    s = time_core(sdpa, (N, heads, T, ch))
    e = time_core(einsum, (N * heads, ch, T))
    print(f"N{N} {H}x{W} (T{T}) C{C} heads {heads:<10} {s[0]:9.3f} {s[1]:7.3f} {e[0]:11.3f} {e[1]:7.3f}")
