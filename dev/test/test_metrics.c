// test_metrics.c: the mathematics of sample quality (metrics.h) against known answers and against
// guided-diffusion's evaluator formulas ported to NumPy (dev/fixtures/metrics/evaluator.safetensors, made by
// scripts/make_metrics_fixture.py): the symmetric eigensolver, the Fréchet distance (a set against
// itself, a shifted copy, two Gaussians of known distance, a singular covariance), the Inception
// Score, precision and recall. Run from the repository root.
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

    check_case("Inception Score: equal logits give 1; 5 classes, each image sure of one, evenly in every split, give 5");
    {
        enum { N = 100, K = 5 };
        static float logits[N * K];
        for (int i = 0; i < N * K; i++) logits[i] = 0.25f;
        double flat = inception_score(logits, N, K, 10);
        for (int r = 0; r < N; r++)
            for (int c = 0; c < K; c++) logits[r * K + c] = c == r % K ? 60.0f : -60.0f;
        double sure = inception_score(logits, N, K, 10);
        printf("  %.12f, %.12f\n", flat, sure);
        CHECK(fabs(flat - 1) <= 1e-12 && fabs(sure - 5) <= 1e-9);
        CHECK(isnan(inception_score(logits, 5, K, 10)));  // fewer images than splits
    }

    check_case("precision and recall: identical sets give 1 and 1, sets far apart 0 and 0");
    {
        float *a = random_features(60, 8), *far = malloc(sizeof(float) * 60 * 8);
        for (int i = 0; i < 60 * 8; i++) far[i] = a[i] + 1000.0f;
        double p = -1, r = -1, pf = -1, rf = -1;
        CHECK(precision_recall(a, 60, a, 60, 8, 3, &p, &r) == 0 && p == 1 && r == 1);
        CHECK(precision_recall(a, 60, far, 60, 8, 3, &pf, &rf) == 0 && pf == 0 && rf == 0);
        CHECK(precision_recall(a, 3, a, 60, 8, 3, &p, &r) == -1);  // k = 3 needs 4 rows
        free(a), free(far);
    }

    check_case("against guided-diffusion's formulas in NumPy (scipy's sqrtm) and 40-digit arithmetic: FID, FID of a singular "
               "covariance, IS, precision, recall");
    {
        SafeTensorsFile f;
        char err[512];
        if (safetensors_open("dev/fixtures/metrics/evaluator.safetensors", &f, err, sizeof err) != 0) {
            printf("  %s\n", err);
            CHECK(0);
        } else {
            int64_t nr = 0, ns = 0, nf = 0, nl = 0, d = 0, d2 = 0, d3 = 0, classes = 0;
            float *ref = fixture_tensor(&f, "ref", &nr, &d), *sample = fixture_tensor(&f, "sample", &ns, &d2);
            float *few = fixture_tensor(&f, "few", &nf, &d3), *logits = fixture_tensor(&f, "logits", &nl, &classes);
            CHECK(ref && sample && few && logits && d == d2 && d == d3);
            if (ref && sample && few && logits && d == d2 && d == d3) {
                double fid = fid_of_features(ref, (int)nr, sample, (int)ns, (int)d);
                double fid_few = fid_of_features(few, (int)nf, sample, (int)ns, (int)d);
                double is = inception_score(logits, nl, (int)classes, 10), p = -1, r = -1;
                CHECK(precision_recall(ref, nr, sample, ns, (int)d, 3, &p, &r) == 0);
                printf("  FID %.10f (NumPy %.10f), singular %.10f (%.10f; exactly %.10f), IS %.10f (%.10f), precision %.4f (%.4f), recall %.4f (%.4f)\n",
                       fid, metadata_number(&f, "fid"), fid_few, metadata_number(&f, "fid_few"),
                       metadata_number(&f, "fid_few_exact"), is,
                       metadata_number(&f, "inception_score"), p, metadata_number(&f, "precision"), r, metadata_number(&f, "recall"));
                CHECK(relative(fid, metadata_number(&f, "fid")) <= 1e-8);
                // a singular covariance: scipy's sqrtm is off by ~2e-8 there; 40-digit arithmetic is the truth
                CHECK(relative(fid_few, metadata_number(&f, "fid_few")) <= 1e-6);
                CHECK(relative(fid_few, metadata_number(&f, "fid_few_exact")) <= 1e-11);
                CHECK(relative(is, metadata_number(&f, "inception_score")) <= 1e-10);
                CHECK(p == metadata_number(&f, "precision") && r == metadata_number(&f, "recall"));
            }
            free(ref), free(sample), free(few), free(logits);
            safetensors_close(&f);
        }
    }
    return check_summary();
}
