"""The fixture of metrics.h's test: random features and logits, and what guided-diffusion's evaluator
formulas (evaluations/evaluator.py: FIDStatistics.frechet_distance with scipy's sqrtm and its offset
retry, compute_inception_score with its parts of 5,000 rows, ManifoldEstimator's precision and
recall with k = 3 and its DistanceBlock's fp16 distances, fp32 for a block where they are not
finite), ported here to NumPy, give for them.

    python3 scripts/make_metrics_fixture.py [OUT]   (default dev/fixtures/metrics/evaluator.safetensors)

Tensors (F32): ref [120, 24], sample [100, 24], few [12, 24] (fewer rows than dimensions: a singular
covariance), logits [100, 10], offset_ref [150, 16] and offset_sample [100, 16] (features about 30,
where fp16's rounding moves the distances, three rows of them past fp16's range). Metadata (decimal
strings, 17 digits): fid (ref against sample), fid_few (few against sample), inception_score (logits,
parts of 5,000 rows: one part), inception_score_split_30 (parts of 30 rows: 30, 30, 30, 10),
precision, recall (ref, sample), precision_blocks, recall_blocks (offset_ref, offset_sample in blocks
of 64 rows and columns: some blocks fp16's, the blocks holding a row past fp16's range fp32's); and
fid_few_exact, the Fréchet distance of few against sample in 40-digit arithmetic (mpmath: the
covariances, their square roots from their eigenvectors, the singular values of R1 R2), against
which scipy's sqrtm of the singular product is off by about 2e-8. Needs numpy, scipy and mpmath.
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


def inception_score(logits, split_size=5000):
    """compute_inception_score on softmax(logits): consecutive parts of split_size rows, the last one
    what is left."""
    z = logits - logits.max(axis=1, keepdims=True)
    preds = np.exp(z) / np.exp(z).sum(axis=1, keepdims=True)
    scores = []
    for i in range(0, len(preds), split_size):
        part = preds[i:i + split_size]
        kl = part * (np.log(part) - np.log(np.expand_dims(np.mean(part, 0), 0)))
        scores.append(np.exp(np.mean(np.sum(kl, 1))))
    return float(np.mean(scores))


def rounded_distances(u, v):
    """_batch_pairwise_distances with every result rounded to u's and v's dtype (float16 or float32):
    the squares rounded, the norms' sums and the matrix product's (its products exact) in float64,
    each rounded once, as metrics.h does. TensorFlow's half matmul accumulates in float32, whose own
    rounding can move a product lying within it of a float16 tie to the other side: this fixture
    takes the exact product's rounding, the same with any BLAS. (scripts/fid_inception.py puts
    gpu_rounded_distances in its place on a GPU.)"""
    dtype = u.dtype
    norm_u, norm_v = ((x * x).astype(np.float64).sum(1).astype(dtype) for x in (u, v))
    dots = (u.astype(np.float64) @ v.astype(np.float64).T).astype(dtype)
    return np.maximum(norm_u[:, None] - dtype.type(2) * dots + norm_v[None, :], dtype.type(0))


def pairwise(u, v):
    """DistanceBlock.pairwise_distances of one block of float32 features: in float16, or, where any of
    that is not finite, in float32."""
    with np.errstate(over="ignore", invalid="ignore"):
        d = rounded_distances(u.astype(np.float16), v.astype(np.float16))
        if not np.isfinite(d).all():
            d = rounded_distances(u, v)
    return d.astype(np.float32)


def manifold_radii(features, k, block):
    """ManifoldEstimator.manifold_radii: each row's (k+1)-th smallest distance, block x block."""
    n = len(features)
    radii = np.zeros(n, dtype=np.float32)
    for b1 in range(0, n, block):
        rows = np.concatenate([pairwise(features[b1:b1 + block], features[b2:b2 + block])
                               for b2 in range(0, n, block)], axis=1)
        radii[b1:b1 + block] = np.partition(rows, k, axis=1)[:, k]
    return radii


def precision_recall(ref, sample, k=3, block=10000):
    """ManifoldEstimator.manifold_radii and evaluate_pr on float32 features (as the evaluator's
    activations), blocks of `block` rows and columns: (precision, recall)."""
    ref, sample = ref.astype(np.float32), sample.astype(np.float32)
    radii_ref, radii_sample = manifold_radii(ref, k, block), manifold_radii(sample, k, block)
    ref_in, sample_in = np.zeros(len(ref), dtype=bool), np.zeros(len(sample), dtype=bool)
    for b1 in range(0, len(ref), block):
        for b2 in range(0, len(sample), block):
            d = pairwise(ref[b1:b1 + block], sample[b2:b2 + block])
            ref_in[b1:b1 + block] |= np.any(d <= radii_sample[None, b2:b2 + block], axis=1)
            sample_in[b2:b2 + block] |= np.any(d <= radii_ref[b1:b1 + block, None], axis=0)
    return float(sample_in.mean()), float(ref_in.mean())


def main():
    out = sys.argv[1] if len(sys.argv) > 1 else "dev/fixtures/metrics/evaluator.safetensors"
    rng = np.random.default_rng(11)
    mixing = rng.normal(size=(24, 24))
    ref = (rng.normal(size=(120, 24)) @ mixing).astype(np.float32)  # correlated features
    sample = (rng.normal(size=(100, 24)) @ (mixing + 0.3 * rng.normal(size=(24, 24))) + 0.5).astype(np.float32)
    few = (rng.normal(size=(12, 24)) @ mixing).astype(np.float32)
    logits = (3 * rng.normal(size=(100, 10))).astype(np.float32)
    # features far from 0 (as Inception's, all positive): fp16's steps in their norms (8 at their
    # 14,500) move their distances; three rows past fp16's range send the blocks they are in to fp32
    offset_ref = (2 * rng.normal(size=(150, 16)) + 30).astype(np.float32)
    offset_sample = (2.4 * rng.normal(size=(100, 16)) + 30.5).astype(np.float32)
    offset_ref[[70, 140]] *= 3
    offset_sample[10] *= 3
    f64 = lambda x: x.astype(np.float64)  # noqa: E731
    precision, recall = precision_recall(ref, sample)
    precision_blocks, recall_blocks = precision_recall(offset_ref, offset_sample, block=64)
    values = dict(fid=frechet_distance(statistics(f64(ref)), statistics(f64(sample))),
                  fid_few=frechet_distance(statistics(f64(few)), statistics(f64(sample))),
                  fid_few_exact=exact_frechet_distance(f64(few), f64(sample)),
                  inception_score=inception_score(f64(logits)),
                  inception_score_split_30=inception_score(f64(logits), 30),
                  precision=precision, recall=recall, precision_blocks=precision_blocks, recall_blocks=recall_blocks)
    tensors = [(name, list(x.shape), x.astype("<f4").tobytes())
               for name, x in (("ref", ref), ("sample", sample), ("few", few), ("logits", logits),
                               ("offset_ref", offset_ref), ("offset_sample", offset_sample))]
    write_safetensors(out, tensors, {k: repr(float(v)) for k, v in values.items()})
    print(f"wrote {out}: " + ", ".join(f"{k} {v:.6g}" for k, v in values.items()))


if __name__ == "__main__":
    main()
