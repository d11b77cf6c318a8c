#!/usr/bin/env python3
r"""GPU time per kernel over one training step, from Nsight Compute's per-launch durations.

    ncu --clock-control none --cache-control none --metrics gpu__time_duration.sum --csv \
        --launch-count 2600 ./train_unet --bench 1 --batch_size 32 > ncu.csv
    python3 dev/kernel_times.py ncu.csv [MARKER]

One step is the launches between the last two launches of MARKER (a kernel name fragment;
default diffusion_conditions, the step's first kernel); the launch count must cover two steps.
Each kernel is timed alone (ncu serialises launches), so the sum exceeds the step's time.
"""
import collections
import csv
import re
import sys


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    marker = sys.argv[2] if len(sys.argv) == 3 else "diffusion_conditions"
    rows = [r for r in csv.reader(open(sys.argv[1])) if len(r) > 10]
    header, rows = rows[0], rows[1:]
    name, value, unit = (header.index(k) for k in ("Kernel Name", "Metric Value", "Metric Unit"))
    to_ms = {"ns": 1e-6, "nsecond": 1e-6, "us": 1e-3, "usecond": 1e-3, "ms": 1.0, "msecond": 1.0}
    launches = [(r[name], float(r[value].replace(",", "")) * to_ms[r[unit]]) for r in rows]
    marks = [i for i, (k, _) in enumerate(launches) if marker in k]
    if len(marks) < 2:
        sys.exit(f"kernel_times: fewer than two launches of {marker}: profile more launches")
    per_kernel = collections.defaultdict(lambda: [0, 0.0])
    for k, ms in launches[marks[-2]:marks[-1]]:
        entry = per_kernel[re.sub(r"\(.*", "", k)[:90]]
        entry[0] += 1
        entry[1] += ms
    total = sum(ms for _, ms in per_kernel.values())
    print(f"one step: {marks[-1] - marks[-2]} launches, {total:.3f} ms summed")
    for k, (count, ms) in sorted(per_kernel.items(), key=lambda e: -e[1][1]):
        print(f"{ms:8.3f} ms {100 * ms / total:5.1f}% {count:5d}  {k}")


if __name__ == "__main__":
    main()
