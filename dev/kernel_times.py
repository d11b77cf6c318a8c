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


if __name__ == "__main__":
    main()
