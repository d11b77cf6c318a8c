"""Loss curves of training logs (CSV: step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,
as train_unet and train_torch.py write them) in one PNG, and how far apart they end.

    python3 scripts/plot_log.py OUT.png A.csv[:label] [B.csv[:label] ...] [--smooth N] [--title T]

Needs matplotlib and numpy (Debian: python3-matplotlib). One run's curve needs neither: the trainer
draws it into RUN/loss.svg.

Each log: the raw loss thin and transparent, its trailing geometric mean over N rows bold;
log-scale loss against step. Printed per log: mean and std of the loss over the last 20% of
rows. Each further log is compared with the first: the difference of the means in units of
the first log's row-to-row std (the noise of one logged loss), and in standard errors of the
difference of the two means (|z| < 2: within the noise).
"""

import argparse
import csv
import math
import os
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
except ImportError as e:
    sys.exit(f"plot_log: needs matplotlib and numpy ({e}); on Debian: apt-get install python3-matplotlib")


def read_log(spec):
    """'path[:label]' -> (label, steps, losses); rows with a non-finite loss are dropped."""
    path, label = spec, None
    if not os.path.exists(spec) and ":" in spec:
        path, label = spec.rsplit(":", 1)
    label = label or os.path.basename(path)
    try:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    except OSError as e:
        sys.exit(f"plot_log: cannot read {path}: {e.strerror}")
    if not rows or "step" not in rows[0] or "loss" not in rows[0]:
        sys.exit(f"plot_log: {path} is not a training log (no step,loss columns or no rows)")
    steps = np.array([float(r["step"]) for r in rows])
    losses = np.array([float(r["loss"]) for r in rows])
    finite = np.isfinite(losses)
    if not finite.all():
        print(f"{label}: {np.count_nonzero(~finite)} rows with a non-finite loss left out "
              f"(first at step {steps[~finite][0]:g})")
    if not finite.any():
        sys.exit(f"plot_log: {path} has no finite loss")
    return label, steps[finite], losses[finite]


def moving_average(y, n):
    """Trailing geometric mean over n rows (fewer at the start): the mean of log y, as the plot's
    log scale shows it, so the first, large losses do not hold the curve up for n rows."""
    c = np.cumsum(np.insert(np.log(y), 0, 0.0))
    i = np.arange(1, len(y) + 1)
    lo = np.maximum(i - n, 0)
    return np.exp((c[i] - c[lo]) / (i - lo))


def tail_stats(losses):
    tail = losses[len(losses) - max(1, math.ceil(0.2 * len(losses))):]
    return tail.mean(), tail.std(ddof=1) if len(tail) > 1 else 0.0, len(tail)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="PNG to write")
    p.add_argument("logs", nargs="+", help="CSV log, optionally :label")
    p.add_argument("--smooth", type=int, default=20, help="rows in the moving average")
    p.add_argument("--title", default="training loss")
    a = p.parse_args()
    logs = [read_log(s) for s in a.logs]

    fig, ax = plt.subplots(figsize=(10, 6), dpi=120)
    for i, (label, steps, losses) in enumerate(logs):
        color = f"C{i}"
        ax.plot(steps, losses, color=color, linewidth=0.6, alpha=0.3)
        ax.plot(steps, moving_average(losses, max(1, a.smooth)), color=color, linewidth=2.0,
                label=f"{label} (geometric mean of {a.smooth} rows)")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(a.title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(a.out)
    print(f"wrote {a.out}")

    stats = [tail_stats(losses) for _, _, losses in logs]
    for (label, steps, _), (mean, std, n) in zip(logs, stats):
        print(f"{label}: last 20% ({n} rows, to step {steps[-1]:g}): loss mean {mean:.6f}, std {std:.6f}")
    (label0, _, _), (mean0, std0, n0) = logs[0], stats[0]
    for (label, _, _), (mean, std, n) in zip(logs[1:], stats[1:]):
        diff = mean - mean0
        sigmas = diff / std0 if std0 > 0 else float("inf") * np.sign(diff)
        se = math.sqrt(std0**2 / n0 + std**2 / n)
        z = diff / se if se > 0 else float("inf") * np.sign(diff)
        verdict = "within the noise" if abs(z) < 2 else "outside the noise"
        print(f"{label} - {label0}: mean difference {diff:+.6f} = {sigmas:+.2f} x {label0}'s row std, "
              f"{z:+.2f} standard errors ({verdict})")


if __name__ == "__main__":
    main()
