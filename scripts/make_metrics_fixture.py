"""The fixture of metrics.h's test: random features and logits, and what guided-diffusion's evaluator
formulas (evaluations/evaluator.py: FIDStatistics.frechet_distance with scipy's sqrtm and its offset
retry, compute_inception_score, ManifoldEstimator's precision and recall with k = 3), ported here to
NumPy in float64, give for them.

    python3 scripts/make_metrics_fixture.py [OUT]   (default dev/fixtures/metrics/evaluator.safetensors)

Tensors (F32): ref [120, 24], sample [100, 24], few [12, 24] (fewer rows than dimensions: a singular
covariance), logits [100, 10]. Metadata (decimal strings, 17 digits): fid (ref against sample),
fid_few (few against sample), inception_score (logits, 10 splits), precision, recall (ref, sample);
and fid_few_exact, the same distance in 40-digit arithmetic (mpmath: the covariances, their square
roots from their eigenvectors, the singular values of R1 R2), against which scipy's sqrtm of the
singular product is off by about 2e-8. Needs numpy, scipy and mpmath.
"""

import os
import sys
import warnings

import numpy as np
from scipy import linalg

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_safetensors import write_safetensors  # noqa: E402


def statistics(features):
    return features.mean(axis=0), np.cov(features, rowvar=False)


def frechet_distance(a, b, eps=1e-6):
    """guided-diffusion's FIDStatistics.frechet_distance."""
    (mu1, sigma1), (mu2, sigma2) = a, b
    diff = mu1 - mu2
    covmean = linalg.sqrtm(sigma1.dot(sigma2))
    if not np.isfinite(covmean).all():
        warnings.warn(f"singular product; adding {eps} to the diagonal")
        offset = np.eye(sigma1.shape[0]) * eps
        covmean = linalg.sqrtm((sigma1 + offset).dot(sigma2 + offset))
    if np.iscomplexobj(covmean):
        if not np.allclose(np.diagonal(covmean).imag, 0, atol=1e-3):
            raise ValueError("imaginary component")
        covmean = covmean.real
    return diff.dot(diff) + np.trace(sigma1) + np.trace(sigma2) - 2 * np.trace(covmean)


def exact_frechet_distance(a, b):
    """The Fréchet distance of two feature sets in 40-digit arithmetic: |mu1 - mu2|^2 + tr S1 + tr S2
    - 2 (the sum of the singular values of sqrt(S1) sqrt(S2))."""
    import mpmath as mp
    mp.mp.dps = 40

    def statistics_mp(x):
        x = mp.matrix(x.tolist())
        n, d = x.rows, x.cols
        mu = [mp.fsum(x[r, j] for r in range(n)) / n for j in range(d)]
        s = mp.matrix(d, d)
        for i in range(d):
            for j in range(i, d):
                s[i, j] = s[j, i] = mp.fsum((x[r, i] - mu[i]) * (x[r, j] - mu[j]) for r in range(n)) / (n - 1)
        return mu, s

    def sqrt_psd(s):
        w, q = mp.eigsy(s)
        return q * mp.diag([mp.sqrt(v) if v > 0 else 0 for v in w]) * q.T

    (mu1, s1), (mu2, s2) = statistics_mp(a), statistics_mp(b)
    singular = mp.svd_r(sqrt_psd(s1) * sqrt_psd(s2), compute_uv=False)
    d = len(mu1)
    return float(mp.fsum((mu1[i] - mu2[i]) ** 2 + s1[i, i] + s2[i, i] for i in range(d)) - 2 * mp.fsum(singular))


def inception_score(logits, splits=10):
    """compute_inception_score on softmax(logits), in `splits` parts of equal size."""
    z = logits - logits.max(axis=1, keepdims=True)
    preds = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    n, scores = len(preds), []
    for s in range(splits):
        part = preds[n * s // splits:n * (s + 1) // splits]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def pairwise(u, v):
    """Squared distances, as _batch_pairwise_distances (in float64 here)."""
    d = (u * u).sum(1)[:, None] - 2 * u @ v.T + (v * v).sum(1)[None, :]
    return np.maximum(d, 0.0)


def precision_recall(ref, sample, k=3):
    """ManifoldEstimator.manifold_radii and evaluate_pr: (precision, recall)."""
    radii_ref = np.partition(pairwise(ref, ref), k, axis=1)[:, k]
    radii_sample = np.partition(pairwise(sample, sample), k, axis=1)[:, k]
    d = pairwise(ref, sample)
    ref_in = np.any(d <= radii_sample[None, :], axis=1)
    sample_in = np.any(d <= radii_ref[:, None], axis=0)
    return float(sample_in.mean()), float(ref_in.mean())


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "dev/fixtures/metrics/evaluator.safetensors"
    rng = np.random.default_rng(11)
    mixing = rng.normal(size=(24, 24))
    ref = (rng.normal(size=(120, 24)) @ mixing).astype(np.float32)  # correlated features
    sample = (rng.normal(size=(100, 24)) @ (mixing + 0.3 * rng.normal(size=(24, 24))) + 0.5).astype(np.float32)
    few = (rng.normal(size=(12, 24)) @ mixing).astype(np.float32)
    logits = (3 * rng.normal(size=(100, 10))).astype(np.float32)
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    precision, recall = precision_recall(f64(ref), f64(sample))
    values = dict(fid=frechet_distance(statistics(f64(ref)), statistics(f64(sample))),
                  fid_few=frechet_distance(statistics(f64(few)), statistics(f64(sample))),
                  fid_few_exact=exact_frechet_distance(f64(few), f64(sample)),
                  inception_score=inception_score(f64(logits)), precision=precision, recall=recall)
    tensors = [(name, list(x.shape), x.astype("<f4").tobytes())
               for name, x in (("ref", ref), ("sample", sample), ("few", few), ("logits", logits))]
    write_safetensors(out, tensors, {k: repr(float(v)) for k, v in values.items()})
    print(f"wrote {out}: " + ", ".join(f"{k} {v:.6g}" for k, v in values.items()))


if __name__ == "__main__":
    main()
