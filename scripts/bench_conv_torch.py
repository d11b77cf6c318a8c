#!/usr/bin/env python3
"""Times PyTorch/cuDNN on the 3x3 convolution shapes that dev/bench_conv.cu --bench printed, and joins both.

  make bench-conv                                                  # builds, checks, and runs the two below
  build/dev/bench_conv --bench > ours.txt
  python3 scripts/bench_conv_torch.py ours.txt --save cudnn.txt    # needs a GPU; prints the joined table
  python3 scripts/bench_conv_torch.py ours.txt --cudnn cudnn.txt   # join only, from saved rows

Ours must be a complete run (its last line "N passed, N failed") of a BF16 build: an FP32 build's
rows are joined too, with a warning (cuDNN's stay bf16).

cuDNN rows: channels_last bf16, torch.backends.cudnn.benchmark = True; forward F.conv2d with bias,
input gradient torch.nn.grad.conv2d_input, weight gradient torch.nn.grad.conv2d_weight; CUDA
events, 3 warm-ups, median of 20. Same row format as ours, impl=cudnn. ratio = cuDNN ms / ours ms
(above 1: ours is faster).
"""
import argparse
import re
import statistics
import sys

KEYS = ("op", "N", "H", "W", "Cin", "Cout", "stride")


def parse_rows(path):
    rows = {}
    for line in open(path):
        if not line.startswith("conv "):
            continue
        fields = dict(re.findall(r"(\w+)=(\S+)", line))
        rows[tuple(fields[k] for k in KEYS)] = fields
    return rows


def time_cudnn(rows):
    import torch
    import torch.nn.functional as F

    torch.backends.cudnn.benchmark = True
    out = []
    for key in sorted({k[1:] for k in rows}, key=lambda s: tuple(int(v) for v in s)):
        N, H, W, Cin, Cout, stride = (int(v) for v in key)
        dev, bf16, cl = "cuda", torch.bfloat16, torch.channels_last
        x = torch.randn(N, Cin, H, W, device=dev, dtype=bf16).to(memory_format=cl)
        w = (torch.randn(Cout, Cin, 3, 3, device=dev, dtype=bf16) / (9 * Cin) ** 0.5).to(memory_format=cl)
        b = torch.randn(Cout, device=dev, dtype=bf16)
        y = F.conv2d(x, w, b, stride=stride, padding=1)
        dy = torch.randn_like(y).to(memory_format=cl)
        ops = {
            "fwd": lambda: F.conv2d(x, w, b, stride=stride, padding=1),
            "dgrad": lambda: torch.nn.grad.conv2d_input(x.shape, w, dy, stride=stride, padding=1),
            "wgrad": lambda: torch.nn.grad.conv2d_weight(x, w.shape, dy, stride=stride, padding=1),
        }
        Ho = (H - 1) // stride + 1
        flops = 2.0 * N * Ho * Ho * Cout * 9 * Cin
        for op, fn in ops.items():
            for _ in range(3):
                fn()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(20)]
            for start, stop in events:
                start.record()
                fn()
                stop.record()
            torch.cuda.synchronize()
            ms = statistics.median(s.elapsed_time(e) for s, e in events)
            line = (f"conv impl=cudnn op={op} N={N} H={H} W={W} Cin={Cin} Cout={Cout} stride={stride} "
                    f"ms={ms:.4f} tflops={flops / (ms * 1e-3) / 1e12:.1f}")
            print(line, flush=True)
            out.append(line)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ours")
    ap.add_argument("--cudnn", help="saved cuDNN rows (no GPU needed)")
    ap.add_argument("--save", help="write the cuDNN rows here")
    args = ap.parse_args()
    ours = parse_rows(args.ours)
    if not re.search(r"^\d+ passed, \d+ failed$", open(args.ours).read(), re.M):
        sys.exit(f"{args.ours}: no final 'N passed, N failed' line: bench_conv did not finish")
    if not ours:
        sys.exit(f"{args.ours}: no 'conv impl=ours' rows")
    precisions = {o.get("precision", "BF16") for o in ours.values()}
    if precisions != {"BF16"}:
        print(f"warning: ours ran in {','.join(sorted(precisions))}, cuDNN in bf16: not a like-for-like comparison")
    if args.cudnn:
        cudnn_path = args.cudnn
    else:
        lines = time_cudnn(ours)
        cudnn_path = args.save or "/tmp/bench_conv_cudnn.txt"
        with open(cudnn_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    cudnn = parse_rows(cudnn_path)
    print(f"{'op':6} {'N':>4} {'H':>3} {'Cin':>5} {'Cout':>5} {'s':>2} {'ours ms':>9} {'cuDNN ms':>9} {'ratio':>6} "
          f"{'ours TF/s':>9} {'cuDNN TF/s':>10}  presets")
    slower = []
    for key, o in ours.items():
        c = cudnn.get(key)
        if not c:
            continue
        ratio = float(c["ms"]) / float(o["ms"])
        print(f"{o['op']:6} {o['N']:>4} {o['H']:>3} {o['Cin']:>5} {o['Cout']:>5} {o['stride']:>2} {float(o['ms']):9.4f} "
              f"{float(c['ms']):9.4f} {ratio:6.2f} {float(o['tflops']):9.1f} {float(c['tflops']):10.1f}  {o.get('presets', '')}")
        if ratio < 1:
            slower.append(ratio)
    for op in ("fwd", "dgrad", "wgrad"):
        keys = [k for k in ours if k[0] == op and k in cudnn]
        total_ours = sum(float(ours[k]["ms"]) for k in keys)
        total_cudnn = sum(float(cudnn[k]["ms"]) for k in keys)
        if keys:
            print(f"total {op}: ours {total_ours:.3f} ms, cuDNN {total_cudnn:.3f} ms, ratio {total_cudnn / total_ours:.2f}")
    print(f"{len(slower)} rows below 1.0x")


if __name__ == "__main__":
    main()
