// metrics.h: the mathematics of sample quality on the CPU, as guided-diffusion's evaluator
// (evaluations/evaluator.py) computes it from Inception-v3 features:
//   - feature statistics: the mean and the covariance (unbiased, as np.cov) of a set of features;
//   - the Fréchet distance of two statistics (FID on the 2048-d pool features, sFID on the spatial
//     ones):  |mu1 - mu2|^2 + tr S1 + tr S2 - 2 tr sqrt(S1 S2);
//   - the Inception Score of classifier logits: exp(mean_x KL(p(y|x) || p(y))) in each consecutive
//     part of 5,000 rows (the last part what is left), averaged over the parts;
//   - precision and recall over k-nearest-neighbour manifolds (k = 3): a sample is "precise" when it
//     falls inside the ball of some reference feature whose radius is that feature's distance to its
//     k-th nearest reference neighbour; a reference is "recalled" when it falls inside some sample's
//     ball, the radii taken among the samples. The squared distances are the evaluator's: in blocks
//     of 10,000 x 10,000, each in fp16 (its rounding emulated exactly), or in fp32 when some value of
//     the block's fp16 distances is not finite.
// The statistics, the Fréchet distance and the Inception Score are in double precision. These are
// the reference implementations, plain loops: the truth the program's faster paths and the tests
// are checked against. Header-only C (C11), no dependencies beyond libm.
#ifndef METRICS_H
#define METRICS_H

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define INCEPTION_SCORE_SPLIT 5000  // the Inception Score's rows a part (compute_inception_score's split_size)
#define MANIFOLD_BLOCK 10000        // rows and columns of a block of precision and recall's distances (ManifoldEstimator's batches)

// Mean [dim] and covariance [dim][dim] of n feature rows [n][dim] (n >= 2), the covariance with
// the 1/(n-1) of np.cov: two passes (the mean, then the centred products), all sums in double.
// Returns 0, or -1 when n < 2 or memory runs out.
static inline int feature_statistics(const float *features, int64_t n, int dim, double *mean, double *cov) {
    if (n < 2) return -1;
    double *centred = (double *)malloc((size_t)dim * sizeof(double));
    if (!centred) return -1;
    memset(mean, 0, (size_t)dim * sizeof(double));
    memset(cov, 0, (size_t)dim * dim * sizeof(double));
    for (int64_t r = 0; r < n; r++)
        for (int i = 0; i < dim; i++) mean[i] += features[r * dim + i];
    for (int i = 0; i < dim; i++) mean[i] /= (double)n;
    for (int64_t r = 0; r < n; r++) {
        for (int i = 0; i < dim; i++) centred[i] = features[r * dim + i] - mean[i];
        for (int i = 0; i < dim; i++)
            for (int j = i; j < dim; j++) cov[(size_t)i * dim + j] += centred[i] * centred[j];
    }
    for (int i = 0; i < dim; i++)
        for (int j = i; j < dim; j++) cov[(size_t)j * dim + i] = cov[(size_t)i * dim + j] /= (double)(n - 1);
    free(centred);
    return 0;
}

// Eigenvalues (w [n]) and, when vectors is not NULL, eigenvectors (the columns of vectors [n][n]) of
// the symmetric matrix a [n][n], which is destroyed: cyclic Jacobi rotations. Each rotation zeroes
// one off-diagonal a_pq with the angle of cot 2θ = (a_qq - a_pp) / (2 a_pq); an a_pq too small to
// change either diagonal entry (or below 1e-17 of the matrix's norm) is set to 0 instead, and the
// sweeps end when one rotates nothing (at most 100). Accurate for the singular and nearly singular
// covariances FID meets. Returns 0, or -1 when it did not converge.
static inline int symmetric_eigen(double *a, int n, double *w, double *vectors) {
    if (vectors) {
        memset(vectors, 0, (size_t)n * n * sizeof(double));
        for (int i = 0; i < n; i++) vectors[(size_t)i * n + i] = 1;
    }
    double norm = 0;
    for (size_t i = 0; i < (size_t)n * n; i++) norm += a[i] * a[i];
    double negligible = 1e-17 * sqrt(norm);
    int rotations = 1, sweep;
    for (sweep = 0; sweep < 100 && rotations; sweep++) {
        rotations = 0;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                double apq = a[(size_t)p * n + q], app = a[(size_t)p * n + p], aqq = a[(size_t)q * n + q];
                if (apq == 0) continue;
                if (fabs(apq) <= negligible || (fabs(app) + 100 * fabs(apq) == fabs(app) && fabs(aqq) + 100 * fabs(apq) == fabs(aqq))) {
                    a[(size_t)p * n + q] = a[(size_t)q * n + p] = 0;
                    continue;
                }
                rotations++;
                double theta = (aqq - app) / (2 * apq);
                double t = (theta >= 0 ? 1 : -1) / (fabs(theta) + sqrt(theta * theta + 1));  // tan θ, the smaller root
                double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) {  // columns p and q: A <- A J
                    double akp = a[(size_t)k * n + p], akq = a[(size_t)k * n + q];
                    a[(size_t)k * n + p] = c * akp - s * akq;
                    a[(size_t)k * n + q] = s * akp + c * akq;
                }
                for (int k = 0; k < n; k++) {  // rows p and q: A <- J^T A
                    double apk = a[(size_t)p * n + k], aqk = a[(size_t)q * n + k];
                    a[(size_t)p * n + k] = c * apk - s * aqk;
                    a[(size_t)q * n + k] = s * apk + c * aqk;
                }
                if (vectors)
                    for (int k = 0; k < n; k++) {
                        double vkp = vectors[(size_t)k * n + p], vkq = vectors[(size_t)k * n + q];
                        vectors[(size_t)k * n + p] = c * vkp - s * vkq;
                        vectors[(size_t)k * n + q] = s * vkp + c * vkq;
                    }
            }
    }
    for (int i = 0; i < n; i++) w[i] = a[(size_t)i * n + i];
    return rotations ? -1 : 0;
}

// The square root of a symmetric positive semi-definite matrix s [n][n] into root: V diag(sqrt w) V^T
// from s's eigenvectors, an eigenvalue below n * DBL_EPSILON of the largest taken as 0 (rounding's,
// which a square root would magnify to 1e-8 of the scale; the rank cut-off of np.linalg.matrix_rank).
// Returns 0, or -1.
static inline int symmetric_sqrt(const double *s, int n, double *root) {
    size_t nn = (size_t)n * n;
    double *work = (double *)malloc(nn * sizeof(double)), *vectors = (double *)malloc(nn * sizeof(double));
    double *w = (double *)malloc((size_t)n * sizeof(double));
    int r = -1;
    if (work && vectors && w) {
        memcpy(work, s, nn * sizeof(double));
        r = symmetric_eigen(work, n, w, vectors);
    }
    if (r == 0) {
        double largest = 0;
        for (int k = 0; k < n; k++) largest = w[k] > largest ? w[k] : largest;
        for (int k = 0; k < n; k++) w[k] = w[k] > n * DBL_EPSILON * largest ? sqrt(w[k]) : 0;
        for (int i = 0; i < n; i++)
            for (int j = i; j < n; j++) {
                double sum = 0;
                for (int k = 0; k < n; k++) sum += vectors[(size_t)i * n + k] * w[k] * vectors[(size_t)j * n + k];
                root[(size_t)i * n + j] = root[(size_t)j * n + i] = sum;
            }
    }
    free(work), free(vectors), free(w);
    return r;
}

// The sum of the singular values of the n x n matrix whose rows are a's rows (a is destroyed):
// one-sided Jacobi, rotating pairs of rows until every pair is orthogonal (to 1e-15 of their
// norms; at most 100 sweeps), the singular values then the rows' norms. Returns 0, or -1.
static inline int singular_value_sum(double *a, int n, double *sum) {
    int rotations = 1;
    for (int sweep = 0; sweep < 100 && rotations; sweep++) {
        rotations = 0;
        for (int p = 0; p < n; p++)
            for (int q = p + 1; q < n; q++) {
                double *x = a + (size_t)p * n, *y = a + (size_t)q * n, xx = 0, yy = 0, xy = 0;
                for (int k = 0; k < n; k++) xx += x[k] * x[k], yy += y[k] * y[k], xy += x[k] * y[k];
                if (fabs(xy) <= 1e-15 * sqrt(xx * yy)) continue;
                rotations++;
                double zeta = (yy - xx) / (2 * xy);
                double t = (zeta >= 0 ? 1 : -1) / (fabs(zeta) + sqrt(zeta * zeta + 1));
                double c = 1 / sqrt(t * t + 1), s = t * c;
                for (int k = 0; k < n; k++) {
                    double xk = x[k], yk = y[k];
                    x[k] = c * xk - s * yk;
                    y[k] = s * xk + c * yk;
                }
            }
    }
    double total = 0;
    for (int p = 0; p < n; p++) {
        double norm = 0;
        for (int k = 0; k < n; k++) norm += a[(size_t)p * n + k] * a[(size_t)p * n + k];
        total += sqrt(norm);
    }
    *sum = total;
    return rotations ? -1 : 0;
}

// The Fréchet distance between N(mu1, s1) and N(mu2, s2) (dim-dimensional):
//   d = |mu1 - mu2|^2 + tr s1 + tr s2 - 2 tr sqrt(s1 s2).
// With R1 = sqrt(s1) and R2 = sqrt(s2), s1 s2 is similar to (R1 R2)(R1 R2)^T, so tr sqrt(s1 s2) is
// the sum of the singular values of R1 R2: computed so (two symmetric square roots, one product,
// one-sided Jacobi), no square root of a rounded near-zero eigenvalue magnifies its error, and a
// singular s1 or s2 (fewer features than dimensions) needs no offset on the diagonal, which
// pytorch-fid and guided-diffusion add and retry with when scipy's sqrtm fails. Returns 0 with
// *distance, or -1 (no convergence, memory).
static inline int frechet_distance(const double *mu1, const double *s1, const double *mu2, const double *s2, int dim,
                                   double *distance) {
    size_t nn = (size_t)dim * dim;
    double *root1 = (double *)malloc(nn * sizeof(double)), *root2 = (double *)malloc(nn * sizeof(double));
    double *product = (double *)malloc(nn * sizeof(double)), trace_root = 0;
    int r = root1 && root2 && product && symmetric_sqrt(s1, dim, root1) == 0 && symmetric_sqrt(s2, dim, root2) == 0 ? 0 : -1;
    if (r == 0) {
        for (int i = 0; i < dim; i++)  // product = (R1 R2)^T = R2 R1: its rows are R1 R2's columns
            for (int j = 0; j < dim; j++) {
                double sum = 0;
                for (int k = 0; k < dim; k++) sum += root2[(size_t)i * dim + k] * root1[(size_t)k * dim + j];
                product[(size_t)i * dim + j] = sum;
            }
        r = singular_value_sum(product, dim, &trace_root);
    }
    if (r == 0) {
        double d = -2 * trace_root;
        for (int i = 0; i < dim; i++) d += (mu1[i] - mu2[i]) * (mu1[i] - mu2[i]) + s1[(size_t)i * dim + i] + s2[(size_t)i * dim + i];
        *distance = d;
    }
    free(root1), free(root2), free(product);
    return r;
}

// The Inception Score of n rows of logits [n][classes] (the evaluator's compute_inception_score):
// p(y|x) = softmax(logits); the rows in consecutive parts of split_size rows, the last part what is
// left (12,000 rows in parts of 5,000: 5,000, 5,000 and 2,000), in each exp(mean_x sum_y p(y|x)
// (log p(y|x) - log p(y))) with p(y) the part's mean of p(y|x); the mean over the parts. 0 log 0 = 0.
// One pass a part, no logarithm per entry: with log p(y|x) = l_y - top - log(sum of exp(l - top))
// from the row's logits, the part's sum of KL terms is sum_x sum_y p log p - m sum_y p(y) log p(y)
// for its m rows. Returns the score, or NAN when there are no rows, split_size < 1 or memory runs out.
static inline double inception_score(const float *logits, int64_t n, int classes, int64_t split_size) {
    if (n < 1 || split_size < 1) return NAN;
    double *e = (double *)malloc((size_t)classes * sizeof(double)), *marginal = (double *)malloc((size_t)classes * sizeof(double));
    if (!e || !marginal) {
        free(e), free(marginal);
        return NAN;
    }
    double score = 0;
    int64_t parts = 0;
    for (int64_t begin = 0; begin < n; begin += split_size, parts++) {
        int64_t end = n - begin < split_size ? n : begin + split_size;
        double rows = (double)(end - begin), p_log_p = 0, marginal_log = 0;
        memset(marginal, 0, (size_t)classes * sizeof(double));
        for (int64_t r = begin; r < end; r++) {  // softmax from the row's largest logit
            const float *l = logits + r * classes;
            double top = l[0], sum = 0;
            for (int c = 1; c < classes; c++) top = l[c] > top ? l[c] : top;
            for (int c = 0; c < classes; c++) sum += e[c] = exp(l[c] - top);
            double log_sum = log(sum);
            for (int c = 0; c < classes; c++) {
                double p = e[c] / sum;
                marginal[c] += p;
                if (p > 0) p_log_p += p * (l[c] - top - log_sum);
            }
        }
        for (int c = 0; c < classes; c++)
            if (marginal[c] > 0) marginal_log += marginal[c] / rows * log(marginal[c] / rows);
        score += exp((p_log_p - rows * marginal_log) / rows);
    }
    free(e), free(marginal);
    return score / (double)parts;
}

// x rounded to the nearest float16 value, ties to even, as a double (IEEE binary16: 11 significant
// bits, steps of 2^-24 below 2^-14, infinity from 65520, halfway past the largest value 65504, up);
// NaN stays NaN. Rounded once from x, so h(a + b), h(a - b) and h(a b) of fp16 values a and b (exact
// in double) are fp16 arithmetic's results.
static inline double half_round(double x) {
    double a = fabs(x);
    if (!(a < 65520)) return a == a ? copysign(INFINITY, x) : x;
    int e;
    frexp(a, &e);  // a in [2^(e-1), 2^e): fp16's step there is 2^(e-11), and 2^-24 below 2^-13
    double step = ldexp(1, (e < -13 ? -13 : e) - 11);
    return copysign(nearbyint(a / step) * step, x);
}

// x rounded to the nearest float (fp32) value, ties to even, as a double.
static inline double float_round(double x) { return (float)x; }

// A block of the evaluator's squared distances with every result rounded by r (half_round or
// float_round): rows u [m][dim] cast, rows v [n][dim] cast; |u|^2 = r(sum_i r(u_i^2));
// u.v = r(sum_i u_i v_i) (the products exact, the sums in double, rounded once: a matrix product
// accumulating in fp32); d[i][j] (row stride ld) = max(r(r(|u|^2 - r(2 u.v)) + |v|^2), 0), a NaN
// staying NaN as in tf.maximum. ur, vr, nu, nv: room for the cast rows and their norms. Returns
// whether every d is finite after the max, as the evaluator checks it: where 2 u.v alone overflows
// fp16 the sum is -inf, which the max makes a finite 0 (the evaluator's distance there).
static inline int rounded_distances(const float *u, int64_t m, const float *v, int64_t n, int dim, double (*r)(double), float *d,
                                    int64_t ld, double *ur, double *vr, double *nu, double *nv) {
    for (int set = 0; set < 2; set++) {
        const float *x = set ? v : u;
        double *xr = set ? vr : ur, *norms = set ? nv : nu;
        for (int64_t row = 0; row < (set ? n : m); row++) {
            double sum = 0;
            for (int k = 0; k < dim; k++) {
                double c = xr[row * dim + k] = r(x[row * dim + k]);
                sum += r(c * c);
            }
            norms[row] = r(sum);
        }
    }
    int finite = 1;
    for (int64_t i = 0; i < m; i++)
        for (int64_t j = 0; j < n; j++) {
            double dot = 0;
            for (int k = 0; k < dim; k++) dot += ur[i * dim + k] * vr[j * dim + k];
            double dist = r(r(nu[i] - r(2 * r(dot))) + nv[j]);
            dist = dist < 0 ? 0 : dist;  // -inf too (2 u.v past fp16's range, the norms not): 0, finite
            d[i * ld + j] = (float)dist;
            finite &= isfinite(dist) != 0;
        }
    return finite;
}

// The evaluator's squared distances (its DistanceBlock) of rows u [m][dim] against rows v [n][dim]
// into d [m][n] (row stride ld): in fp16, every result rounded to fp16 (rounded_distances with
// half_round), or, when any of the block's fp16 distances is not finite (a feature or a norm past
// fp16's 65504), the whole block in fp32. Returns 1 when the block is fp32's, 0 when it is fp16's, -1
// when memory runs out.
static inline int manifold_distances(const float *u, int64_t m, const float *v, int64_t n, int dim, float *d, int64_t ld) {
    double *ur = (double *)malloc((size_t)m * dim * sizeof(double)), *vr = (double *)malloc((size_t)n * dim * sizeof(double));
    double *nu = (double *)malloc((size_t)m * sizeof(double)), *nv = (double *)malloc((size_t)n * sizeof(double));
    int r = -1;
    if (ur && vr && nu && nv) {
        r = !rounded_distances(u, m, v, n, dim, half_round, d, ld, ur, vr, nu, nv);
        if (r) rounded_distances(u, m, v, n, dim, float_round, d, ld, ur, vr, nu, nv);
    }
    free(ur), free(vr), free(nu), free(nv);
    return r;
}

// qsort's order of distances, NaN last (as np.partition's).
static inline int compare_distances(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y || (isnan(x) && !isnan(y))) - (x < y || (isnan(y) && !isnan(x)));
}

// The k-NN radii of a feature set [n][dim] (n > k), as ManifoldEstimator.manifold_radii: a block of
// rows' distances to every row, block x block by manifold_distances, then each row's (k+1)-th
// smallest (its own distance, about 0, among them, as np.partition at kth = k). Returns 0, or -1
// when memory runs out.
static inline int manifold_radii(const float *features, int64_t n, int dim, int k, int64_t block, float *radii) {
    int64_t rows = n < block ? n : block;
    float *d = (float *)malloc((size_t)rows * n * sizeof(float));
    int r = d ? 0 : -1;
    for (int64_t first = 0; first < n && r == 0; first += block) {
        int64_t m = n - first < block ? n - first : block;
        for (int64_t col = 0; col < n && r == 0; col += block) {
            int64_t cols = n - col < block ? n - col : block;
            if (manifold_distances(features + first * dim, m, features + col * dim, cols, dim, d + col, n) < 0) r = -1;
        }
        for (int64_t i = 0; i < m && r == 0; i++) {
            qsort(d + i * n, (size_t)n, sizeof(float), compare_distances);
            radii[first + i] = d[i * n + k];
        }
    }
    free(d);
    return r;
}

// Precision and recall (guided-diffusion's ManifoldEstimator.evaluate_pr with k = nhood): the share
// of the samples inside some reference's ball, and of the references inside some sample's ball, the
// balls' squared radii those of manifold_radii in each set; the distances, references' rows against
// samples' columns, block x block by manifold_distances (the evaluator's block: MANIFOLD_BLOCK).
// Both sets need more than k rows. Returns 0, or -1 (too few rows, block < 1, memory).
static inline int precision_recall(const float *ref, int64_t n_ref, const float *sample, int64_t n_sample, int dim, int k, int64_t block,
                                   double *precision, double *recall) {
    if (k < 1 || block < 1 || n_ref <= k || n_sample <= k) return -1;
    int64_t rows = n_ref < block ? n_ref : block, cols = n_sample < block ? n_sample : block;
    float *ref_radii = (float *)malloc((size_t)n_ref * sizeof(float)), *sample_radii = (float *)malloc((size_t)n_sample * sizeof(float));
    float *d = (float *)malloc((size_t)rows * cols * sizeof(float));
    unsigned char *ref_in = (unsigned char *)calloc((size_t)n_ref, 1), *sample_in = (unsigned char *)calloc((size_t)n_sample, 1);
    int r = -1;
    if (ref_radii && sample_radii && d && ref_in && sample_in && manifold_radii(ref, n_ref, dim, k, block, ref_radii) == 0 &&
        manifold_radii(sample, n_sample, dim, k, block, sample_radii) == 0)
        r = 0;
    for (int64_t i0 = 0; i0 < n_ref && r == 0; i0 += block)
        for (int64_t j0 = 0; j0 < n_sample && r == 0; j0 += block) {
            int64_t m = n_ref - i0 < block ? n_ref - i0 : block, n = n_sample - j0 < block ? n_sample - j0 : block;
            if (manifold_distances(ref + i0 * dim, m, sample + j0 * dim, n, dim, d, n) < 0) r = -1;
            for (int64_t i = 0; i < m && r == 0; i++)
                for (int64_t j = 0; j < n; j++) {
                    if (d[i * n + j] <= ref_radii[i0 + i]) sample_in[j0 + j] = 1;
                    if (d[i * n + j] <= sample_radii[j0 + j]) ref_in[i0 + i] = 1;
                }
        }
    if (r == 0) {
        int64_t precise = 0, recalled = 0;
        for (int64_t j = 0; j < n_sample; j++) precise += sample_in[j];
        for (int64_t i = 0; i < n_ref; i++) recalled += ref_in[i];
        *precision = (double)precise / (double)n_sample;
        *recall = (double)recalled / (double)n_ref;
    }
    free(ref_radii), free(sample_radii), free(d), free(ref_in), free(sample_in);
    return r;
}

#endif  // METRICS_H
