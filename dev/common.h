// dev/common.h: what the dev files share. The trainer itself (train_unet.cu in library mode: the
// model configuration, the parameter list, the safetensors reader), seeded random fills, the
// relative error, NCHW <-> NHWC transposes and fixture loading. The CPU references are double
// throughout.
#ifndef DEV_COMMON_H
#define DEV_COMMON_H

// One copy of the trainer per program: a file that included train_unet.cu already (it always
// defines PRECISION_NAME) keeps that copy.
#ifndef PRECISION_NAME
#ifndef TRAIN_UNET_LIBRARY
#define TRAIN_UNET_LIBRARY
#endif
#include "../train_unet.cu"
#endif

#include <time.h>

// ----------------------------------------------------------------------------------------------
// Random fills: draw i of a run is random_u64(seed, 0, i). The seed is DEV_SEED when set, else
// fresh from the clock; it is printed on first use so that a failing run can be repeated.

static uint64_t dev_seed, dev_draws;
static int dev_seeded;

static void dev_seed_once(void) {
    if (dev_seeded) return;
    const char *s = getenv("DEV_SEED");
    if (s && *s) {
        dev_seed = strtoull(s, NULL, 10);
    } else {
        struct timespec now;
        clock_gettime(CLOCK_REALTIME, &now);
        dev_seed = ((uint64_t)now.tv_sec * 1000000000ull + (uint64_t)now.tv_nsec) % 1000000000000ull;
    }
    dev_seeded = 1;
    printf("random seed %llu (DEV_SEED=%llu repeats this run)\n", (unsigned long long)dev_seed,
           (unsigned long long)dev_seed);
}

// A uniform double in [lo, hi).
static double dev_uniform(double lo, double hi) {
    dev_seed_once();
    return lo + (hi - lo) * (double)(random_u64(dev_seed, 0, dev_draws++) >> 11) * 0x1.0p-53;
}

// A uniform integer in [0, n).
static int64_t dev_random_int(int64_t n) {
    dev_seed_once();
    return (int64_t)random_below(dev_seed, 0, &dev_draws, (uint64_t)n);
}

static void dev_fill_uniform(double *x, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = dev_uniform(lo, hi);
}

// A zeroed array of n doubles.
static double *dev_alloc(size_t n) {
    double *p = (double *)calloc(n ? n : 1, sizeof(double));
    if (!p) fatal("out of host memory (%zu doubles)", n);
    return p;
}

// ----------------------------------------------------------------------------------------------
// Comparisons and layouts

// ||a - b|| / ||b|| (0 when both are exactly zero; infinite when b is zero and a is not, or on NaN).
static double dev_rel_error(const double *a, const double *b, size_t n) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < n; i++) diff += (a[i] - b[i]) * (a[i] - b[i]), norm += b[i] * b[i];
    if (diff == 0) return 0;
    return norm > 0 && diff == diff ? sqrt(diff / norm) : INFINITY;
}

static double dev_norm(const double *a, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * a[i];
    return sqrt(s);
}

// dst[n][h][w][c] = src[n][c][h][w]
static void dev_nchw_to_nhwc(double *dst, const double *src, int N, int C, int H, int W) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) dst[((size_t)n * H * W + p) * C + c] = src[((size_t)n * C + c) * H * W + p];
}

// dst[n][c][h][w] = src[n][h][w][c]
static void dev_nhwc_to_nchw(double *dst, const double *src, int N, int C, int H, int W) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++)
            for (int p = 0; p < H * W; p++) dst[((size_t)n * C + c) * H * W + p] = src[((size_t)n * H * W + p) * C + c];
}

// Copies tensor `name` of a safetensors file into out as double: F64 as stored, F32, BF16 and F16
// widened (exactly). Exits when it is missing, not floating-point, or not numel elements.
static void dev_load_tensor(const SafeTensorsFile *f, const char *name, double *out, int64_t numel) {
    const SafeTensor *t = safetensors_find(f, name);
    if (!t) fatal("tensor %s is missing", name);
    if (t->numel != numel) fatal("tensor %s has %lld elements, expected %lld", name, (long long)t->numel, (long long)numel);
    if (strcmp(t->dtype, "F64") == 0) {
        memcpy(out, t->data, numel * sizeof(double));
        return;
    }
    float *tmp = (float *)malloc_or_die(numel * sizeof(float));
    if (safetensors_get_float(t, tmp) != 0) fatal("tensor %s: dtype %s is not floating-point", name, t->dtype);
    for (int64_t i = 0; i < numel; i++) out[i] = tmp[i];
    free(tmp);
}

// printf into one of two static buffers, taken in turn: a name given to check_case (check.h keeps
// the pointer until the next case starts) stays valid while the next one is formatted.
static const char *dev_name(const char *fmt, ...) {
    static char buffers[2][256];
    static int turn;
    turn ^= 1;
    va_list args;
    va_start(args, fmt);
    vsnprintf(buffers[turn], sizeof buffers[turn], fmt, args);
    va_end(args);
    return buffers[turn];
}

// ----------------------------------------------------------------------------------------------
// Scalar math shared by the references

// sigmoid(x) = 1 / (1 + e^-x)
static inline double dev_sigmoid(double x) { return 1.0 / (1.0 + exp(-x)); }

// SiLU(x) = x sigmoid(x); SiLU'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
static inline double dev_silu(double x) { return x * dev_sigmoid(x); }
static inline double dev_silu_grad(double x) {
    double s = dev_sigmoid(x);
    return s * (1 + x * (1 - s));
}

#endif  // DEV_COMMON_H
