// test_inception_gpu.cu DIR: evaluate's GPU paths (train_unet.cu's sample-quality section) against
// their references, in the precision it is built with (test_inception_gpu_fp32, _bf16):
//   - the statistics, the Fréchet distance and precision/recall on the GPU against metrics.h's CPU
//     reference on random features (a singular covariance among them), and their known answers;
//     precision and recall's distances (the evaluator's fp16, fp32 for a block that is not finite
//     in fp16) block by block against metrics.h's, and precision and recall in small blocks, some
//     of them fp32's;
//   - Inception-v3's features of 100 images against PyTorch's (scripts/fid_inception.py, fp32) with
//     the same random weights, and FID, sFID, IS, precision and recall of two sets of 2500 images
//     against guided-diffusion's evaluator formulas on PyTorch's features: DIR is what
//     `scripts/fid_inception.py fixture --ref DIR/ref.bin --sample DIR/sample.bin --out DIR` wrote
//     (dev/test/test_evaluate_gpu.sh makes it and runs this).
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "../../metrics.h"
#include "check.h"

static uint64_t rng_state = 99;
static double uniform(void) {
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return ((rng_state >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}
static double normal(void) { return sqrt(-2 * log(uniform())) * cos(2 * M_PI * uniform()); }

// n correlated features of dim dimensions (rows of a random mixing of normal draws), plus `shift`.
static float *random_features(int64_t n, int dim, double shift) {
    double *mixing = (double *)malloc_or_die((size_t)dim * dim * sizeof(double));
    for (int i = 0; i < dim * dim; i++) mixing[i] = normal() / sqrt(dim);
    float *x = (float *)malloc_or_die(n * dim * sizeof(float));
    double *z = (double *)malloc_or_die(dim * sizeof(double));
    for (int64_t r = 0; r < n; r++) {
        for (int d = 0; d < dim; d++) z[d] = normal();
        for (int d = 0; d < dim; d++) {
            double v = shift;
            for (int k = 0; k < dim; k++) v += z[k] * mixing[k * dim + d];
            x[r * dim + d] = (float)v;
        }
    }
    free(mixing), free(z);
    return x;
}

static double relative(double got, double want) { return fabs(got - want) / fmax(fabs(want), 1e-300); }

// Both statistics (GPU and CPU) of features; the largest difference of the covariances, relative to its largest entry.
static double statistics_difference(const float *x, int64_t n, int dim, double *mean, double *cov) {
    double *cpu_mean = (double *)malloc_or_die(dim * sizeof(double)), *cpu_cov = (double *)malloc_or_die((size_t)dim * dim * sizeof(double));
    char err[512];
    CHECK(unet_feature_statistics(x, n, dim, mean, cov, err, sizeof err) == 0);
    CHECK(feature_statistics(x, n, dim, cpu_mean, cpu_cov) == 0);
    double worst = 0, scale = 0;
    for (int i = 0; i < dim * dim; i++) worst = fmax(worst, fabs(cov[i] - cpu_cov[i])), scale = fmax(scale, fabs(cpu_cov[i]));
    for (int i = 0; i < dim; i++) worst = fmax(worst, fabs(mean[i] - cpu_mean[i]));
    free(cpu_mean), free(cpu_cov);
    return worst / scale;
}

// The relative error ||got - want|| / ||want|| of n values.
static double relative_error(const float *got, const float *want, int64_t n) {
    double diff = 0, norm = 0;
    for (int64_t i = 0; i < n; i++) diff += (double)(got[i] - want[i]) * (got[i] - want[i]), norm += (double)want[i] * want[i];
    return sqrt(diff / norm);
}

static double metadata_number(const SafeTensorsFile *f, const char *key) {
    const char *v = safetensors_metadata(f, key);
    return v ? strtod(v, NULL) : NAN;
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s DIR (the fixture folder of scripts/fid_inception.py fixture)\n", argv[0]);
        return 2;
    }
    const char *dir = argv[1];
    char err[1024], path[4200];
    // The tolerances of the features against PyTorch's fp32, and of the metrics against the fixture's.
    const double feature_tolerance = sizeof(floatX) == 4 ? 1e-3 : 3e-2;
    printf("%s build\n", PRECISION_NAME);

    check_case("GPU statistics and Fréchet distance equal metrics.h's (full rank, singular, known answers)");
    {
        const int dim = 96;
        float *a = random_features(400, dim, 0.0), *b = random_features(300, dim, 0.3), *few = random_features(40, dim, 0.0);
        double *mu[3], *s[3];
        for (int k = 0; k < 3; k++) mu[k] = (double *)malloc_or_die(dim * sizeof(double)), s[k] = (double *)malloc_or_die((size_t)dim * dim * sizeof(double));
        CHECK(statistics_difference(a, 400, dim, mu[0], s[0]) < 1e-12);
        CHECK(statistics_difference(b, 300, dim, mu[1], s[1]) < 1e-12);
        CHECK(statistics_difference(few, 40, dim, mu[2], s[2]) < 1e-12);
        double gpu = 0, cpu = 0;
        for (int pair = 0; pair < 2; pair++) {
            int k = pair == 0 ? 0 : 2;  // a against b, then the singular few against b
            CHECK(unet_frechet_distance(mu[k], s[k], mu[1], s[1], dim, &gpu, err, sizeof err) == 0);
            CHECK(frechet_distance(mu[k], s[k], mu[1], s[1], dim, &cpu) == 0);
            printf("  FID %s: GPU %.12g, CPU %.12g\n", pair ? "singular" : "full rank", gpu, cpu);
            CHECK(relative(gpu, cpu) < 1e-9);
        }
        CHECK(unet_frechet_distance(mu[2], s[2], mu[2], s[2], dim, &gpu, err, sizeof err) == 0);
        printf("  FID of a singular set against itself: %.3g\n", gpu);
        CHECK(fabs(gpu) < 1e-6);
        for (int i = 0; i < dim; i++) mu[1][i] = mu[0][i] + 0.5;  // a shifted copy: the squared shift
        CHECK(unet_frechet_distance(mu[0], s[0], mu[1], s[0], dim, &gpu, err, sizeof err) == 0);
        CHECK(fabs(gpu - 0.25 * dim) < 1e-6);
        for (int k = 0; k < 3; k++) free(mu[k]), free(s[k]);
        free(a), free(b), free(few);
    }

    check_case("GPU distances of a block equal metrics.h's: fp16's (but for fp32 accumulation's rare ties), and fp32's for a block "
               "with a row past fp16's range");
    {
        const int dim = 64, m = 300, n = 200;
        CHECK(api_gpu_ready(err, sizeof err) == 0);
        float *x = random_features(m, dim, 10.0), *y = random_features(n, dim, 10.3);  // far from 0: fp16's steps show
        float *gpu_d = (float *)malloc_or_die((size_t)m * n * sizeof(float)), *cpu_d = (float *)malloc_or_die((size_t)m * n * sizeof(float));
        float *d = (float *)gpu_malloc((size_t)m * n * sizeof(float));
        int *nonfinite = (int *)gpu_malloc(sizeof(int));
        for (int fp32 = 0; fp32 < 2; fp32++) {
            if (fp32)
                for (int i = 0; i < dim; i++) y[57 * dim + i] *= 30;  // its norm past 65504
            ManifoldSet sx, sy;
            manifold_set_open(&sx, x, m, dim, 3);
            manifold_set_open(&sy, y, n, dim, 3);
            CHECK(manifold_block(d, &sx, 0, m, &sy, 0, n, dim, nonfinite) == fp32);
            cuda_check(cudaMemcpyAsync(gpu_d, d, (size_t)m * n * sizeof(float), cudaMemcpyDeviceToHost, gpu.stream));
            cuda_check(cudaStreamSynchronize(gpu.stream));
            CHECK(manifold_distances(x, m, y, n, dim, cpu_d, n) == fp32);
            int64_t differ = 0;
            double worst = 0;  // relative to |x|^2 + |y|^2, the scale of the rounding
            for (int i = 0; i < m; i++)
                for (int j = 0; j < n; j++) {
                    double scale = 0;
                    for (int k = 0; k < dim; k++) scale += (double)x[i * dim + k] * x[i * dim + k] + (double)y[j * dim + k] * y[j * dim + k];
                    differ += gpu_d[i * n + j] != cpu_d[i * n + j];
                    worst = fmax(worst, fabs((double)gpu_d[i * n + j] - cpu_d[i * n + j]) / scale);
                }
            printf("  %s: %lld of %d differ, by at most %.2g of |x|^2 + |y|^2\n", fp32 ? "fp32" : "fp16", (long long)differ, m * n, worst);
            CHECK(fp32 ? worst <= 1e-5 : differ * 100 <= (int64_t)m * n && worst <= 1.0 / 256);
            manifold_set_close(&sx), manifold_set_close(&sy);
        }
        cudaFree(d), cudaFree(nonfinite);
        free(x), free(y), free(gpu_d), free(cpu_d);
    }

    check_case("GPU precision and recall equal metrics.h's (in one block, and in blocks of 64 with rows past fp16's range); identical "
               "sets give 1 and 1");
    {
        const int dim = 16;
        float *ref = random_features(500, dim, 0.0), *sample = random_features(400, dim, 0.4);
        double p_gpu = 0, r_gpu = 0, p_cpu = 0, r_cpu = 0;
        CHECK(unet_precision_recall(ref, 500, sample, 400, dim, 3, MANIFOLD_BLOCK, &p_gpu, &r_gpu, err, sizeof err) == 0);
        CHECK(precision_recall(ref, 500, sample, 400, dim, 3, MANIFOLD_BLOCK, &p_cpu, &r_cpu) == 0);
        printf("  precision GPU %.4f CPU %.4f, recall GPU %.4f CPU %.4f\n", p_gpu, p_cpu, r_gpu, r_cpu);
        CHECK(fabs(p_gpu - p_cpu) <= 0.01 * p_cpu && fabs(r_gpu - r_cpu) <= 0.01 * r_cpu);
        CHECK(p_cpu > 0.05 && p_cpu < 0.95);  // the sets differ: neither share is trivially 0 or 1
        CHECK(unet_precision_recall(ref, 500, ref, 500, dim, 3, MANIFOLD_BLOCK, &p_gpu, &r_gpu, err, sizeof err) == 0);
        CHECK(p_gpu == 1.0 && r_gpu == 1.0);
        free(ref), free(sample);
        const int wide = 32;
        ref = random_features(300, wide, 8.0), sample = random_features(200, wide, 8.3);
        for (int i = 0; i < wide; i++) ref[100 * wide + i] *= 40, sample[150 * wide + i] *= 40;  // their blocks fp32's
        CHECK(unet_precision_recall(ref, 300, sample, 200, wide, 3, 64, &p_gpu, &r_gpu, err, sizeof err) == 0);
        CHECK(precision_recall(ref, 300, sample, 200, wide, 3, 64, &p_cpu, &r_cpu) == 0);
        printf("  in blocks of 64: precision GPU %.4f CPU %.4f, recall GPU %.4f CPU %.4f\n", p_gpu, p_cpu, r_gpu, r_cpu);
        CHECK(fabs(p_gpu - p_cpu) <= 0.01 * p_cpu && fabs(r_gpu - r_cpu) <= 0.01 * r_cpu);
        CHECK(unet_precision_recall(ref, 300, sample, 200, wide, 3, 0, &p_gpu, &r_gpu, err, sizeof err) == -1);
        free(ref), free(sample);
    }

    snprintf(path, sizeof path, "%s/inception.pth", dir);
    UnetInception *net = unet_inception_open(path, err, sizeof err);
    if (!net) printf("  %s\n", err);
    snprintf(path, sizeof path, "%s/features.safetensors", dir);
    SafeTensorsFile want;
    int have_fixture = safetensors_open(path, &want, err, sizeof err) == 0;
    if (!have_fixture) printf("  %s\n", err);
    Dataset sets[2];
    for (int s = 0; s < 2; s++) {
        snprintf(path, sizeof path, "%s/%s.bin", dir, s ? "sample" : "ref");
        if (dataset_open(path, &sets[s], err, sizeof err) != 0) printf("  %s\n", err), have_fixture = 0;
    }
    if (!net || !have_fixture) {
        check_case("the fixture of scripts/fid_inception.py is there");
        CHECK(0);
        check_case_end();
        printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
        return 1;
    }
    const DatasetHeader *h = &sets[0].header;

    check_case("Inception's features of 100 images match PyTorch's (pool, spatial, logits)");
    {
        const int n = 100;
        float *out[3];
        const char *names[3] = {"pool", "spatial", "logits"};
        int64_t widths[3] = {INCEPTION_FEATURES, INCEPTION_SPATIAL, INCEPTION_CLASSES};
        for (int k = 0; k < 3; k++) out[k] = (float *)malloc_or_die(n * widths[k] * sizeof(float));
        CHECK(unet_inception_features(net, sets[0].pixels, n, h->height, h->width, h->channels, 32, out[0], out[1], out[2], err, sizeof err) == 0);
        for (int k = 0; k < 3; k++) {
            const SafeTensor *t = safetensors_find(&want, names[k]);
            CHECK(t && t->numel == n * widths[k]);
            if (!t || t->numel != n * widths[k]) continue;
            float *ref = (float *)malloc_or_die(t->numel * sizeof(float));
            CHECK(safetensors_get_float(t, ref) == 0);
            double e = relative_error(out[k], ref, t->numel);
            printf("  %s: relative error %.3g (at most %.0e)\n", names[k], e, feature_tolerance);
            CHECK(e < feature_tolerance);
            free(ref);
        }
        for (int k = 0; k < 3; k++) free(out[k]);
    }

    check_case("FID, sFID, IS, precision and recall of two sets match the evaluator's formulas on PyTorch's features");
    {
        int64_t n[2] = {(int64_t)sets[0].header.count, (int64_t)sets[1].header.count};
        float *pool[2], *spatial[2], *logits = (float *)malloc_or_die(n[1] * INCEPTION_CLASSES * sizeof(float));
        double *mu[2], *sigma[2], *mu_s[2], *sigma_s[2];
        for (int s = 0; s < 2; s++) {
            pool[s] = (float *)malloc_or_die(n[s] * INCEPTION_FEATURES * sizeof(float));
            spatial[s] = (float *)malloc_or_die(n[s] * INCEPTION_SPATIAL * sizeof(float));
            mu[s] = (double *)malloc_or_die(INCEPTION_FEATURES * sizeof(double));
            sigma[s] = (double *)malloc_or_die((size_t)INCEPTION_FEATURES * INCEPTION_FEATURES * sizeof(double));
            mu_s[s] = (double *)malloc_or_die(INCEPTION_SPATIAL * sizeof(double));
            sigma_s[s] = (double *)malloc_or_die((size_t)INCEPTION_SPATIAL * INCEPTION_SPATIAL * sizeof(double));
            const DatasetHeader *hs = &sets[s].header;
            CHECK(unet_inception_features(net, sets[s].pixels, n[s], hs->height, hs->width, hs->channels, 100, pool[s], spatial[s],
                                          s ? logits : NULL, err, sizeof err) == 0);
            CHECK(unet_feature_statistics(pool[s], n[s], INCEPTION_FEATURES, mu[s], sigma[s], err, sizeof err) == 0);
            CHECK(unet_feature_statistics(spatial[s], n[s], INCEPTION_SPATIAL, mu_s[s], sigma_s[s], err, sizeof err) == 0);
        }
        double got[5];
        CHECK(unet_frechet_distance(mu[0], sigma[0], mu[1], sigma[1], INCEPTION_FEATURES, &got[0], err, sizeof err) == 0);
        CHECK(unet_frechet_distance(mu_s[0], sigma_s[0], mu_s[1], sigma_s[1], INCEPTION_SPATIAL, &got[1], err, sizeof err) == 0);
        got[2] = inception_score(logits, n[1], INCEPTION_CLASSES, INCEPTION_SCORE_SPLIT);
        CHECK(unet_precision_recall(pool[0], n[0], pool[1], n[1], INCEPTION_FEATURES, 3, MANIFOLD_BLOCK, &got[3], &got[4], err, sizeof err) == 0);
        const char *keys[5] = {"fid", "sfid", "inception_score", "precision", "recall"};
        for (int k = 0; k < 5; k++) {
            double w = metadata_number(&want, keys[k]), tolerance = k == 0 ? 1e-3 : 1e-2;
            printf("  %s: %.6f, the evaluator's formulas %.6f (relative %.2g, at most %.0e)\n", keys[k], got[k], w, relative(got[k], w), tolerance);
            CHECK(relative(got[k], w) < tolerance);
        }
        for (int s = 0; s < 2; s++) free(pool[s]), free(spatial[s]), free(mu[s]), free(sigma[s]), free(mu_s[s]), free(sigma_s[s]);
        free(logits);
    }
    unet_inception_close(net);
    safetensors_close(&want);
    for (int s = 0; s < 2; s++) dataset_close(&sets[s]);
    check_case_end();
    printf("%d passed, %d failed\n", check_cases_passed, check_cases_failed);
    return check_cases_failed ? 1 : 0;
}
