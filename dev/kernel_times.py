#!/usr/bin/env python3
r"""GPU time per kernel over one training step, from Nsight Compute's per-launch durations.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        --launch-count 2600 ./train_unet --bench 1 --batch_size 32 > ncu.csv
    python3 dev/kernel_times.py ncu.csv [MARKER]

One step is the launches between the last two launches of MARKER (a kernel name fragment;
default diffusion_conditions, the step's first kernel); the launch count must cover two steps.
Each kernel is timed alone (ncu serialises launches), so the sum exceeds the step's time.
With --metrics gpu__time_duration.sum,dram__bytes.sum the table adds each kernel's DRAM traffic
and its rate (GB/s: the share of the memory bandwidth a kernel reaches).

    ./train_unet --dry_run --preset P --batch_size B > plan.txt
    python3 dev/kernel_times.py ncu.csv [MARKER] --plan plan.txt

With the same configuration's --dry_run output, a second table gives each 3x3 convolution kernel
the FLOPs of the products the plan gives it (2 N Ho Wo C_in C_out 9 each, forward, input gradient
or weight gradient) and its rate in TFLOP/s (against the GPU's dense BF16 peak: how far it is
from the floor).
"""
import collections
import csv
import re
import sys


# A product in --dry_run's plan ("halo 4x128", "wgmma 128x256 tma x7", "split 128x128 tma x5",
# "mma 128x32", "narrow", "image") and the kernel that runs it, both as (op, family, tile): op 0
# forward, 1 input gradient, 2 weight gradient (ConvOp's order).
PLANNED = re.compile(r"(halo|wgmma|split|mma) (\d+)x(\d+)( tma)?|narrow|image")
KERNELS = [
    (re.compile(r"conv3x3_halo_kernel<(\d), (\d+), (\d+)>"), lambda m: (int(m[1]), "halo", m[2], m[3])),
    (re.compile(r"conv3x3_tma_kernel<(\d), (\d+), (\d+), (\d)>"),
     lambda m: (int(m[1]), "split tma" if m[4] == "1" else "wgmma tma", m[2], m[3])),
    (re.compile(r"conv3x3_wgmma_kernel<(\d), (\d+), (\d+)"), lambda m: (int(m[1]), "wgmma", m[2], m[3])),
    (re.compile(r"conv3x3_igemm_kernel<(\d), (\d+), (\d+)"), lambda m: (int(m[1]), "mma", m[2], m[3])),
    (re.compile(r"conv3x3_narrow_(input|weight)?"), lambda m: ({None: 0, "input": 1, "weight": 2}[m[1]], "narrow", "", "")),
    (re.compile(r"conv3x3_image_kernel"), lambda m: (0, "image", "", "")),
]


def planned_flops(path):
    """FLOPs per (op, family, tile) of the 3x3 convolutions in a --dry_run's kernel table."""
    flops, batch = collections.defaultdict(float), None
    for line in open(path):
        header = re.match(r"kernels of the 3x3 convolutions \(training, batch (\d+)", line)
        if header:
            batch = int(header[1])
            continue
        row = re.match(r"\s+\S+\s+(\d+) -> (\d+)\s+(\d+)x(\d+)\s+s(\d)\s+(.*)$", line)
        if batch is None or not row:
            continue
        c_in, c_out, h, w, stride = (int(row[i]) for i in range(1, 6))
        products = 2.0 * batch * (h // stride) * (w // stride) * c_in * c_out * 9
        for op, found in enumerate(PLANNED.finditer(row[6])):
            if found[1]:
                key = (op, found[1] + (" tma" if found[4] or found[1] == "split" else ""), found[2], found[3])
            else:
                key = (op, found[0], "", "")
            flops[key] += products
    if batch is None:
        sys.exit(f"kernel_times: {path} has no kernel table (./train_unet --dry_run's output, training)")
    return flops


def conv_rates(per_kernel, flops, peak_tflops=989.0):
    """The second table: each 3x3 convolution kernel's time, planned FLOPs and rate."""
    names = ("forward", "input grad", "weight grad")
    print("\n3x3 convolutions (FLOPs from the plan; the dense BF16 peak taken as "
          f"{peak_tflops:.0f} TFLOP/s, an H100 SXM's):")
    for kernel, (count, ms, _) in sorted(per_kernel.items(), key=lambda e: -e[1][1]):
        key = next((make(m) for pattern, make in KERNELS for m in [pattern.search(kernel)] if m), None)
        if key is None:
            continue
        tflop = flops.get(key, 0.0) / 1e12
        rate = f"{tflop:7.3f} TFLOP {tflop / ms * 1e3:6.0f} TFLOP/s ({100 * tflop / ms * 1e3 / peak_tflops:3.0f}%)" if tflop \
            else "  (not in the plan)"
        kind = key[1] + (f" {key[2]}x{key[3]}" if key[2] else "")
        print(f"{ms:8.3f} ms {count:5d}  {names[key[0]]:11s} {kind:19s} {rate}")


def main():
    args = sys.argv[1:]
    plan = None
    if "--plan" in args:
        at = args.index("--plan")
        if at + 1 >= len(args):
            sys.exit(__doc__)
        plan = args[at + 1]
        del args[at:at + 2]
    if len(args) not in (1, 2):
        sys.exit(__doc__)
    marker = args[1] if len(args) == 2 else "diffusion_conditions"
    flops = planned_flops(plan) if plan else None
    rows = [r for r in csv.reader(open(args[0])) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    launch_id, name, metric, value, unit = (header.index(k) for k in ("ID", "Kernel Name", "Metric Name", "Metric Value", "Metric Unit"))
    to_ms = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
    to_gb = {"byte": 1e-9, "Kbyte": 1e-6, "Mbyte": 1e-3, "Gbyte": 1.0}
    launches = collections.OrderedDict()  # launch id -> [name, ms, GB]
    for r in rows:
        entry = launches.setdefault(r[launch_id], [r[name], 0.0, 0.0])
        v = float(r[value].replace(",", ""))
        if r[metric] == "gpu__time_duration.sum":
            entry[1] = v * to_ms[r[unit]]
        elif r[metric] == "dram__bytes.sum":
            entry[2] = v * to_gb[r[unit]]
    launches = list(launches.values())
    has_bytes = any(gb for _, _, gb in launches)
    marks = [i for i, (k, _, _) in enumerate(launches) if marker in k]
    if len(marks) < 2:
        sys.exit(f"kernel_times: fewer than two launches of {marker}: profile more launches")
    per_kernel = collections.defaultdict(lambda: [0, 0.0, 0.0])
    for k, ms, gb in launches[marks[-2]:marks[-1]]:
        entry = per_kernel[re.sub(r"\(.*", "", k)[:90]]
        entry[0] += 1
        entry[1] += ms
        entry[2] += gb
    total = sum(ms for _, ms, _ in per_kernel.values())
    print(f"one step: {marks[-1] - marks[-2]} launches, {total:.3f} ms summed")
    for k, (count, ms, gb) in sorted(per_kernel.items(), key=lambda e: -e[1][1]):
        traffic = f" {gb:8.3f} GB {1e3 * gb / ms:6.0f} GB/s" if has_bytes else ""
        print(f"{ms:8.3f} ms {100 * ms / total:5.1f}% {count:5d}{traffic}  {k}")
    if flops:
        conv_rates(per_kernel, flops)


if __name__ == "__main__":
    main()
