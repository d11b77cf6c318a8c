// test_metrics.c: the mathematics of sample quality (metrics.h) against known answers, independent
// computations and guided-diffusion's evaluator formulas ported to NumPy
// (dev/fixtures/metrics/evaluator.safetensors, made by scripts/make_metrics_fixture.py): the symmetric
// eigensolver, the Fréchet distance (a set against itself, a shifted copy, two Gaussians of known
// distance, a singular covariance), the Inception Score and its parts of 5,000 rows, fp16 rounding,
// the evaluator's fp16 distances and their fp32 fallback, precision and recall. Run from the
// repository root.
#include <stdio.h>

#include "check.h"
#include "checkpoint.h"
#include "metrics.h"

static uint64_t rng_state = 88172645463325252ull;

// A normal draw (Box-Muller on xorshift64 uniforms): the tests' inputs, fresh numbers, never zeros.
static double normal(void) {
    double u[2];
    for (int i = 0; i < 2; i++) {
        rng_state ^= rng_state << 13, rng_state ^= rng_state >> 7, rng_state ^= rng_state << 17;
        u[i] = ((rng_state >> 11) + 0.5) / 9007199254740992.0;
    }
    return sqrt(-2 * log(u[0])) * cos(6.283185307179586 * u[1]);
}

static double relative(double got, double want) { return fabs(got - want) / fabs(want); }

// Random features [n][dim], mixed by a random matrix so that they are correlated.
static float *random_features(int n, int dim) {
    double *mix = malloc(sizeof(double) * dim * dim);
    float *f = malloc(sizeof(float) * n * dim);
    for (int i = 0; i < dim * dim; i++) mix[i] = normal();
    for (int r = 0; r < n; r++) {
        double z[64];
        for (int i = 0; i < dim; i++) z[i] = normal();
        for (int j = 0; j < dim; j++) {
            double s = 0;
            for (int i = 0; i < dim; i++) s += z[i] * mix[i * dim + j];
            f[r * dim + j] = (float)s;
        }
    }
    free(mix);
    return f;
}

static double fid_of_features(const float *a, int na, const float *b, int nb, int dim) {
    double *mu1 = malloc(sizeof(double) * dim), *s1 = malloc(sizeof(double) * dim * dim);
    double *mu2 = malloc(sizeof(double) * dim), *s2 = malloc(sizeof(double) * dim * dim), d = NAN;
    if (feature_statistics(a, na, dim, mu1, s1) != 0 || feature_statistics(b, nb, dim, mu2, s2) != 0 ||
        frechet_distance(mu1, s1, mu2, s2, dim, &d) != 0)
        d = NAN;
    free(mu1), free(s1), free(mu2), free(s2);
    return d;
}

static double metadata_number(const SafeTensorsFile *f, const char *key) {
    const char *v = safetensors_metadata(f, key);
    return v ? strtod(v, NULL) : NAN;
}

static float *fixture_tensor(const SafeTensorsFile *f, const char *name, int64_t *rows, int64_t *cols) {
    const SafeTensor *t = safetensors_find(f, name);
    if (!t || t->ndim != 2) return NULL;
    float *x = malloc(sizeof(float) * t->numel);
    if (safetensors_get_float(t, x) != 0) return free(x), NULL;
    *rows = t->shape[0], *cols = t->shape[1];
    return x;
}

// The Inception Score computed directly: softmax, then in each part [begin[s], begin[s + 1]) the mean
// over its rows of sum_y p (log p - log p(y)), a logarithm per entry; exp of each, averaged.
static double direct_inception_score(const float *logits, int classes, const int64_t *begin, int parts) {
    double score = 0, *p = malloc(sizeof(double) * classes), *marginal = malloc(sizeof(double) * classes);
    for (int s = 0; s < parts; s++) {
        int64_t rows = begin[s + 1] - begin[s];
        double kl = 0;
        for (int pass = 0; pass < 2; pass++) {
            if (pass == 0) memset(marginal, 0, sizeof(double) * classes);
            for (int64_t r = begin[s]; r < begin[s + 1]; r++) {
                double sum = 0;
                for (int c = 0; c < classes; c++) sum += p[c] = exp((double)logits[r * classes + c]);
                for (int c = 0; c < classes; c++) {
                    if (pass == 0) marginal[c] += p[c] / sum / rows;
                    else kl += p[c] / sum * (log(p[c] / sum) - log(marginal[c])) / rows;
                }
            }
        }
        score += exp(kl) / parts;
    }
    free(p), free(marginal);
    return score;
}

// The value of fp16 bit pattern b (sign bit clear): e = 0 subnormal f 2^-24, else (1024 + f) 2^(e-25).
static double half_value(int b) {
    int e = b >> 10, f = b & 1023;
    return e ? ldexp(1024 + f, e - 25) : ldexp(f, -24);
}

// x rounded to fp16 by search: the nearest of the 31,744 finite fp16 values (ties to the even bit
// pattern), infinity from 65520 (halfway to the next step past 65504): independent of half_round.
static double nearest_half(double x) {
    double a = fabs(x);
    if (a >= 65520) return copysign(INFINITY, x);
    int lo = 0, hi = 0x7bff;  // half_value(lo) <= a < half_value(hi), or a is the largest
    if (a >= half_value(hi)) return copysign(half_value(hi), x);
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (half_value(mid) <= a) lo = mid;
        else hi = mid;
    }
    double below = a - half_value(lo), above = half_value(hi) - a;
    return copysign(half_value(below < above || (below == above && lo % 2 == 0) ? lo : hi), x);
}

// The evaluator's fp16 distance of rows u and v (dim values), step by step with nearest_half (h):
// |u|^2 = h(sum h(h(u_i)^2)), u.v = h(sum h(u_i) h(v_i)), max(h(h(|u|^2 - h(2 u.v)) + |v|^2), 0).
static double independent_half_distance(const float *u, const float *v, int dim) {
    double nu = 0, nv = 0, dot = 0;
    for (int i = 0; i < dim; i++) {
        double a = nearest_half(u[i]), b = nearest_half(v[i]);
        nu += nearest_half(a * a), nv += nearest_half(b * b), dot += a * b;
    }
    double d = nearest_half(nearest_half(nearest_half(nu) - nearest_half(2 * nearest_half(dot))) + nearest_half(nv));
    return d < 0 ? 0 : d;
}

// The same in fp32, in float arithmetic: |u|^2 and u.v summed in double and rounded to float once.
static float independent_float_distance(const float *u, const float *v, int dim) {
    double nu = 0, nv = 0, dot = 0;
    for (int i = 0; i < dim; i++) {
        float a = u[i] * u[i], b = v[i] * v[i];
        nu += a, nv += b, dot += (double)u[i] * v[i];
    }
    float twice = 2.0f * (float)dot, d = (float)nu - twice;
    d = d + (float)nv;
    return d < 0 ? 0 : d;
}

int main(void) {
    check_case("symmetric_eigen: A V = V diag(w) and V^T V = I to 1e-12, a random symmetric 40x40");
    {
        enum { N = 40 };
        static double a[N * N], copy[N * N], v[N * N], w[N];
        for (int i = 0; i < N; i++)
            for (int j = 0; j <= i; j++) a[i * N + j] = a[j * N + i] = normal();
        memcpy(copy, a, sizeof a);
        CHECK(symmetric_eigen(copy, N, w, v) == 0);
        double worst = 0, scale = 0;
        for (int i = 0; i < N; i++) scale = fmax(scale, fabs(w[i]));
        for (int i = 0; i < N; i++)
            for (int k = 0; k < N; k++) {
                double av = 0, vtv = 0;
                for (int j = 0; j < N; j++) av += a[i * N + j] * v[j * N + k], vtv += v[j * N + i] * v[j * N + k];
                worst = fmax(worst, fabs(av - v[i * N + k] * w[k]) / scale);
                worst = fmax(worst, fabs(vtv - (i == k)));
            }
        printf("  worst %.1e\n", worst);
        CHECK(worst < 1e-12);
    }

    check_case("FID of a set against itself is 0 (<= 1e-6), with 300 rows and with 10 rows of 16 dimensions (singular)");
    {
        float *f = random_features(300, 16);
        double full = fid_of_features(f, 300, f, 300, 16), singular = fid_of_features(f, 10, f, 10, 16);
        printf("  %.2e, %.2e\n", full, singular);
        CHECK(fabs(full) <= 1e-6 && fabs(singular) <= 1e-6);
        free(f);
    }

    check_case("FID against a shifted copy is the squared shift (1e-9 relative)");
    {
        float *a = random_features(200, 12), *b = malloc(sizeof(float) * 200 * 12);
        double shift[12], want = 0;
        for (int i = 0; i < 12; i++) shift[i] = normal();
        for (int r = 0; r < 200; r++)
            for (int i = 0; i < 12; i++) b[r * 12 + i] = (float)(a[r * 12 + i] + shift[i]);
        // b's values are rounded to float: the squared shift b really has, from its mean
        for (int i = 0; i < 12; i++) {
            double mean_shift = 0;
            for (int r = 0; r < 200; r++) mean_shift += (double)b[r * 12 + i] - a[r * 12 + i];
            want += (mean_shift / 200) * (mean_shift / 200);
        }
        double got = fid_of_features(a, 200, b, 200, 12);
        printf("  %.9f against %.9f\n", got, want);
        CHECK(relative(got, want) <= 1e-6);
        free(a), free(b);
    }

    check_case("FID of two Gaussians sharing eigenvectors: |mu1 - mu2|^2 + sum (sqrt a_i - sqrt b_i)^2 (1e-10 relative)");
    {
        enum { D = 20 };
        static double q[D * D], sym[D * D], w[D], s1[D * D], s2[D * D], mu1[D], mu2[D], ev1[D], ev2[D];
        for (int i = 0; i < D; i++)
            for (int j = 0; j <= i; j++) sym[i * D + j] = sym[j * D + i] = normal();
        CHECK(symmetric_eigen(sym, D, w, q) == 0);  // q: a random orthogonal matrix
        double want = 0;
        for (int i = 0; i < D; i++) {
            ev1[i] = exp(normal()), ev2[i] = i < 5 ? 0 : exp(normal());  // s2 of rank 15
            mu1[i] = normal(), mu2[i] = normal();
            want += (mu1[i] - mu2[i]) * (mu1[i] - mu2[i]) + (sqrt(ev1[i]) - sqrt(ev2[i])) * (sqrt(ev1[i]) - sqrt(ev2[i]));
        }
        for (int i = 0; i < D; i++)
            for (int j = 0; j < D; j++) {
                double x = 0, y = 0;
                for (int k = 0; k < D; k++) x += q[i * D + k] * ev1[k] * q[j * D + k], y += q[i * D + k] * ev2[k] * q[j * D + k];
                s1[i * D + j] = x, s2[i * D + j] = y;
            }
        double got = NAN;
        CHECK(frechet_distance(mu1, s1, mu2, s2, D, &got) == 0);
        printf("  %.12f against %.12f\n", got, want);
        CHECK(relative(got, want) <= 1e-10);
    }

    check_case("Inception Score: equal logits give 1; 5 classes, each image sure of one, evenly in every part, give 5");
    {
        enum { N = 100, K = 5 };
        static float logits[N * K];
        for (int i = 0; i < N * K; i++) logits[i] = 0.25f;
        double flat = inception_score(logits, N, K, INCEPTION_SCORE_SPLIT);
        for (int r = 0; r < N; r++)
            for (int c = 0; c < K; c++) logits[r * K + c] = c == r % K ? 60.0f : -60.0f;
        double sure = inception_score(logits, N, K, INCEPTION_SCORE_SPLIT), parts_of_10 = inception_score(logits, N, K, 10);
        printf("  %.12f, %.12f, in parts of 10 rows %.12f\n", flat, sure, parts_of_10);
        CHECK(fabs(flat - 1) <= 1e-12 && fabs(sure - 5) <= 1e-9 && fabs(parts_of_10 - 5) <= 1e-9);
        CHECK(isnan(inception_score(logits, 0, K, INCEPTION_SCORE_SPLIT)) && isnan(inception_score(logits, N, K, 0)));
    }

    check_case("Inception Score of 12,000 rows: the mean over parts of 5,000, 5,000 and 2,000 rows, computed directly (1e-12); "
               "10 equal parts differ");
    {
        enum { N = 12000, K = 6 };
        float *logits = malloc(sizeof(float) * N * K);
        for (int r = 0; r < N; r++)  // the favoured class changes every 1,000 rows: the parts see different mixtures
            for (int c = 0; c < K; c++) logits[r * K + c] = (float)(normal() + (c == (r / 1000) % K ? 4 : 0));
        const int64_t evaluator_parts[4] = {0, 5000, 10000, 12000};
        int64_t equal_parts[11];
        for (int s = 0; s <= 10; s++) equal_parts[s] = (int64_t)N * s / 10;
        double got = inception_score(logits, N, K, INCEPTION_SCORE_SPLIT), want = direct_inception_score(logits, K, evaluator_parts, 3);
        double ten = direct_inception_score(logits, K, equal_parts, 10);
        printf("  %.12f, directly %.12f; 10 equal parts %.12f\n", got, want, ten);
        CHECK(relative(got, want) <= 1e-12);
        CHECK(relative(ten, want) > 1e-2);
        CHECK(relative(inception_score(logits, N, K, N / 10), ten) <= 1e-12);  // parts of 1,200 rows: the 10 equal parts
        free(logits);
    }

    check_case("fp16 rounding: every finite fp16 value kept, each halfway point to the even one, either side of it to the nearer, "
               "65520 and up to infinity");
    {
        int bad = 0;
        for (int b = 0; b <= 0x7bff; b++) {
            double x = half_value(b), next = b < 0x7bff ? half_value(b + 1) : 65536, mid = (x + next) / 2;
            double even = b % 2 == 0 ? x : next, rounded_mid = b < 0x7bff ? even : (b % 2 == 0 ? x : INFINITY);
            bad += half_round(x) != x || half_round(-x) != -x;
            bad += half_round(mid) != rounded_mid || half_round(-mid) != -rounded_mid;
            bad += half_round(nextafter(mid, 0)) != x || half_round(nextafter(mid, INFINITY)) != (b < 0x7bff ? next : INFINITY);
        }
        printf("  %d wrong\n", bad);
        CHECK(bad == 0);
        CHECK(half_round(65504) == 65504 && half_round(65519.99) == 65504 && half_round(65520) == INFINITY && half_round(-1e9) == -INFINITY);
        CHECK(isnan(half_round(NAN)) && half_round(INFINITY) == INFINITY && half_round(0x1p-25) == 0 && half_round(0x1.8p-25) == 0x1p-24);
    }

    check_case("the evaluator's fp16 distances: 100 against 101 is 8; a block of 37 x 23 rows equals a step-by-step fp16 computation");
    {
        const float u[1] = {100}, v[1] = {101};
        float d = -1;
        // |u|^2 = 10000, |v|^2 = h(10201) = 10200, u.v = h(10100) = 10096 (a tie: even), 10000 - 20192 + 10200 = 8
        CHECK(manifold_distances(u, 1, v, 1, 1, &d, 1) == 0 && d == 8);
        enum { M = 37, N = 23, D = 20 };
        float *a = random_features(M, D), *b = random_features(N, D), *got = malloc(sizeof(float) * M * N);
        for (int i = 0; i < M * D; i++) a[i] = a[i] + 10;  // far from 0: fp16's steps show
        for (int i = 0; i < N * D; i++) b[i] = b[i] + 10;
        for (int i = 0; i < M * N; i++) got[i] = NAN;
        CHECK(manifold_distances(a, M, b, N, D, got, N) == 0);
        int differ = 0, moved = 0;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                double exact = 0;
                for (int k = 0; k < D; k++) exact += ((double)a[i * D + k] - b[j * D + k]) * ((double)a[i * D + k] - b[j * D + k]);
                differ += got[i * N + j] != independent_half_distance(a + i * D, b + j * D, D);
                moved += fabs(got[i * N + j] - exact) > 1e-3 * exact;
            }
        printf("  %d of %d differ; %d moved by fp16 by more than 0.1%%\n", differ, M * N, moved);
        CHECK(differ == 0 && moved > 0);
        free(a), free(b), free(got);
    }

    check_case("a block with a norm past fp16's 65504 is computed in fp32, all of it; the block without that row in fp16");
    {
        const float u[3 * 2] = {200, 200, 1, 2, 100, 0}, v[2 * 2] = {201, 199, 101, 0};
        float d[3 * 2], alone = -1;
        // |(200, 200)|^2 = 80000: infinite in fp16. In fp32: 80000 - 2 80000 + 80002 = 2, 5 - 2 599 + 80002 = 78809,
        // 10000 - 2 20100 + 80002 = 49802, and (100, 0) to (101, 0) 1
        CHECK(manifold_distances(u, 3, v, 2, 2, d, 2) == 1);
        CHECK(d[0] == 2 && d[2] == 78809 && d[4] == 49802 && d[5] == 1);
        CHECK(manifold_distances(u + 4, 1, v + 2, 1, 2, &alone, 1) == 0 && alone == 8);  // and 8 in fp16
        int bad = 0;
        for (int i = 0; i < 3; i++)
            for (int j = 0; j < 2; j++) bad += d[i * 2 + j] != independent_float_distance(u + i * 2, v + j * 2, 2);
        enum { M = 30, N = 40, D = 16 };
        float *a = random_features(M, D), *b = random_features(N, D), *got = malloc(sizeof(float) * M * N);
        for (int i = 0; i < D; i++) b[17 * D + i] *= 200;  // one row past fp16's range
        CHECK(manifold_distances(a, M, b, N, D, got, N) == 1);
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) bad += got[i * N + j] != independent_float_distance(a + i * D, b + j * D, D);
        printf("  %d differ from fp32 computed directly\n", bad);
        CHECK(bad == 0);
        free(a), free(b), free(got);
    }

    check_case("where 2 x.y alone passes fp16's range (the norms do not), the distance is the evaluator's 0 and the block stays fp16");
    {
        // |200|^2 = 40000 and |199|^2 = 39601 fit fp16; 2 (200 199) = 79600 does not: 40000 - inf + 39601 = -inf, and
        // tf.maximum(-inf, 0) = 0, a finite value: the block is not recomputed in fp32 (where it is 1)
        const float u[2] = {200, 1}, v[2] = {199, 2};
        float d[4];
        CHECK(manifold_distances(u, 2, v, 2, 1, d, 2) == 0);
        CHECK(d[0] == 0 && d[1] == 39200 && d[2] == 39232 && d[3] == 1);  // fp16 steps of 32 there
    }

    check_case("precision and recall: identical sets give 1 and 1, sets far apart 0 and 0");
    {
        float *a = random_features(60, 8), *far = malloc(sizeof(float) * 60 * 8);
        for (int i = 0; i < 60 * 8; i++) far[i] = a[i] + 1000.0f;
        double p = -1, r = -1, pf = -1, rf = -1;
        CHECK(precision_recall(a, 60, a, 60, 8, 3, MANIFOLD_BLOCK, &p, &r) == 0 && p == 1 && r == 1);
        CHECK(precision_recall(a, 60, far, 60, 8, 3, MANIFOLD_BLOCK, &pf, &rf) == 0 && pf == 0 && rf == 0);
        CHECK(precision_recall(a, 60, a, 60, 8, 3, 7, &p, &r) == 0 && p == 1 && r == 1);  // in blocks of 7 rows and columns
        CHECK(precision_recall(a, 3, a, 60, 8, 3, MANIFOLD_BLOCK, &p, &r) == -1);         // k = 3 needs 4 rows
        CHECK(precision_recall(a, 60, a, 60, 8, 3, 0, &p, &r) == -1);
        free(a), free(far);
    }

    check_case("against guided-diffusion's formulas in NumPy (scipy's sqrtm) and 40-digit arithmetic: FID, FID of a singular "
               "covariance, IS in parts of 5,000 and of 30 rows, precision, recall (fp16 distances), and in blocks of 64 "
               "(fp16 and fp32 blocks)");
    {
        SafeTensorsFile f;
        char err[512];
        if (safetensors_open("dev/fixtures/metrics/evaluator.safetensors", &f, err, sizeof err) != 0) {
            printf("  %s\n", err);
            CHECK(0);
        } else {
            int64_t nr = 0, ns = 0, nf = 0, nl = 0, d = 0, d2 = 0, d3 = 0, classes = 0, nor = 0, nos = 0, od = 0, od2 = 0;
            float *ref = fixture_tensor(&f, "ref", &nr, &d), *sample = fixture_tensor(&f, "sample", &ns, &d2);
            float *few = fixture_tensor(&f, "few", &nf, &d3), *logits = fixture_tensor(&f, "logits", &nl, &classes);
            float *offset_ref = fixture_tensor(&f, "offset_ref", &nor, &od), *offset_sample = fixture_tensor(&f, "offset_sample", &nos, &od2);
            int complete = ref && sample && few && logits && offset_ref && offset_sample && d == d2 && d == d3 && od == od2;
            CHECK(complete);
            if (complete) {
                double fid = fid_of_features(ref, (int)nr, sample, (int)ns, (int)d);
                double fid_few = fid_of_features(few, (int)nf, sample, (int)ns, (int)d);
                double is = inception_score(logits, nl, (int)classes, INCEPTION_SCORE_SPLIT), is30 = inception_score(logits, nl, (int)classes, 30);
                double p = -1, r = -1, pb = -1, rb = -1, p1 = -1, r1 = -1;
                CHECK(precision_recall(ref, nr, sample, ns, (int)d, 3, MANIFOLD_BLOCK, &p, &r) == 0);
                CHECK(precision_recall(offset_ref, nor, offset_sample, nos, (int)od, 3, 64, &pb, &rb) == 0);
                CHECK(precision_recall(offset_ref, nor, offset_sample, nos, (int)od, 3, MANIFOLD_BLOCK, &p1, &r1) == 0);
                printf("  FID %.10f (NumPy %.10f), singular %.10f (%.10f; exactly %.10f)\n", fid, metadata_number(&f, "fid"), fid_few,
                       metadata_number(&f, "fid_few"), metadata_number(&f, "fid_few_exact"));
                printf("  IS %.10f (%.10f), in parts of 30 %.10f (%.10f)\n", is, metadata_number(&f, "inception_score"), is30,
                       metadata_number(&f, "inception_score_split_30"));
                printf("  precision %.4f (%.4f), recall %.4f (%.4f); in blocks of 64: %.4f (%.4f), %.4f (%.4f); in one block: %.4f, %.4f\n", p,
                       metadata_number(&f, "precision"), r, metadata_number(&f, "recall"), pb, metadata_number(&f, "precision_blocks"), rb,
                       metadata_number(&f, "recall_blocks"), p1, r1);
                CHECK(relative(fid, metadata_number(&f, "fid")) <= 1e-8);
                // a singular covariance: scipy's sqrtm is off by ~2e-8 there; 40-digit arithmetic is the truth
                CHECK(relative(fid_few, metadata_number(&f, "fid_few")) <= 1e-6);
                CHECK(relative(fid_few, metadata_number(&f, "fid_few_exact")) <= 1e-11);
                CHECK(relative(is, metadata_number(&f, "inception_score")) <= 1e-10);
                CHECK(relative(is30, metadata_number(&f, "inception_score_split_30")) <= 1e-10);
                CHECK(p == metadata_number(&f, "precision") && r == metadata_number(&f, "recall"));
                CHECK(pb == metadata_number(&f, "precision_blocks") && rb == metadata_number(&f, "recall_blocks"));
                CHECK(p1 != pb || r1 != rb);  // the blocks matter: in one block every distance is fp32's
            }
            free(ref), free(sample), free(few), free(logits), free(offset_ref), free(offset_sample);
            safetensors_close(&f);
        }
    }
    return check_summary();
}
