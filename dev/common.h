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

// ----------------------------------------------------------------------------------------------
// The GPU checks (each dev/<layer>.cu's main, built by `make dev`): the trainer's own kernels on
// random inputs against the CPU references above, and their timings. Inputs are rounded to the
// build's precision first (bf16 or fp32 for activations and conv weights, fp32 for fp32
// parameters), so the reference computes on exactly what the GPU sees. Each check prints one
// table row (dev/run_dev.sh collects them) and the program ends with "N passed, N failed".

// Relative tolerance per tensor (dev/DESIGN.md, Tests): FP32 build 1e-5, BF16 build 1e-2.
#define DEV_TOLERANCE (sizeof(floatX) == 4 ? 1e-5 : 1e-2)

static int dev_checks_passed, dev_checks_failed;

// DEV_QUICK=1 (make dev-memcheck): one timed run, no warm-up.
static int dev_quick(void) {
    const char *s = getenv("DEV_QUICK");
    return s && *s && strcmp(s, "0") != 0;
}

// Sets up the GPU and prints the program's first lines: the build and the seed.
static void dev_begin(const char *layer) {
    gpu_init(0);
    printf("dev/%s: %s build, tolerance %.0e\n", layer, PRECISION_NAME, DEV_TOLERANCE);
    dev_seed_once();
}

// A value rounded to what a floatX (activation, conv weight) or a float holds.
static double dev_round_x(double v) { return (double)(float)(floatX)(float)v; }
static double dev_round_f(double v) { return (double)(float)v; }

// Uniform fills rounded to floatX / float.
static void dev_fill_x(double *x, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = dev_round_x(dev_uniform(lo, hi));
}
static void dev_fill_f(double *x, size_t n, double lo, double hi) {
    for (size_t i = 0; i < n; i++) x[i] = dev_round_f(dev_uniform(lo, hi));
}

// Root mean square of n values (1 when there are none or all are zero: a scale for fills).
static double dev_rms(const double *x, size_t n) {
    double r = n ? dev_norm(x, n) / sqrt((double)n) : 0;
    return r > 0 ? r : 1;
}

// Device memory (freed with cudaFree), filled with 0xff bytes: NaN in fp32 and bf16 alike, so an
// element the kernel under test leaves unwritten fails its check.
static void *dev_gpu_poisoned(size_t bytes) {
    void *p = gpu_malloc(bytes);
    cuda_check(cudaMemsetAsync(p, 0xff, bytes ? bytes : 1, gpu.stream));
    return p;
}

static void dev_poison(void *p, size_t bytes) { cuda_check(cudaMemsetAsync(p, 0xff, bytes, gpu.stream)); }

// Host doubles -> device floatX / float (the values are expected rounded already).
static void dev_copy_x(floatX *d, const double *x, size_t n) {
    floatX *h = (floatX *)malloc_or_die(n * sizeof(floatX));
    for (size_t i = 0; i < n; i++) h[i] = (floatX)(float)x[i];
    cuda_check(cudaMemcpyAsync(d, h, n * sizeof(floatX), cudaMemcpyHostToDevice, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    free(h);
}
static void dev_copy_f(float *d, const double *x, size_t n) {
    float *h = (float *)malloc_or_die(n * sizeof(float));
    for (size_t i = 0; i < n; i++) h[i] = (float)x[i];
    cuda_check(cudaMemcpyAsync(d, h, n * sizeof(float), cudaMemcpyHostToDevice, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    free(h);
}
static floatX *dev_upload_x(const double *x, size_t n) {
    floatX *d = (floatX *)gpu_malloc(n * sizeof(floatX));
    dev_copy_x(d, x, n);
    return d;
}
static float *dev_upload_f(const double *x, size_t n) {
    float *d = (float *)gpu_malloc(n * sizeof(float));
    dev_copy_f(d, x, n);
    return d;
}

// Device floatX / float -> a new host array of doubles (waits for the stream first).
static double *dev_download_x(const floatX *d, size_t n) {
    floatX *h = (floatX *)malloc_or_die(n * sizeof(floatX));
    double *out = dev_alloc(n);
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cuda_check(cudaMemcpy(h, d, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) out[i] = (float)h[i];
    free(h);
    return out;
}
static double *dev_download_f(const float *d, size_t n) {
    float *h = (float *)malloc_or_die(n * sizeof(float));
    double *out = dev_alloc(n);
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cuda_check(cudaMemcpy(h, d, n * sizeof(float), cudaMemcpyDeviceToHost));
    for (size_t i = 0; i < n; i++) out[i] = h[i];
    free(h);
    return out;
}

// The error of a GPU result against the reference: ||gpu - e|| / ||e|| with e = before + ref, where
// `before` (nullable) is what an accumulating output held before the kernel ran: the stored sum is
// what is measured (its rounding is relative to the sum), and an output overwritten instead of
// added to misses by about ||before||. Infinite on NaN or infinity anywhere.
static double dev_error(const double *gpu, const double *before, const double *ref, size_t n) {
    double diff = 0, norm = 0;
    for (size_t i = 0; i < n; i++) {
        double expect = (before ? before[i] : 0) + ref[i], d = gpu[i] - expect;
        diff += d * d, norm += expect * expect;
    }
    if (!(diff == diff) || diff == INFINITY) return INFINITY;
    if (diff == 0) return 0;
    return norm > 0 ? sqrt(diff / norm) : INFINITY;
}

// Device tensors of uniform random values in [lo, hi) (rounded), for the timed runs.
static floatX *dev_random_x(size_t n, double lo, double hi) {
    double *h = dev_alloc(n);
    dev_fill_x(h, n, lo, hi);
    floatX *d = dev_upload_x(h, n);
    free(h);
    return d;
}
static float *dev_random_f(size_t n, double lo, double hi) {
    double *h = dev_alloc(n);
    dev_fill_f(h, n, lo, hi);
    float *d = dev_upload_f(h, n);
    free(h);
    return d;
}

// Downloads a floatX / float result and returns its error (dev_error); frees the download.
static double dev_check_x(const floatX *d, const double *before, const double *ref, size_t n) {
    double *g = dev_download_x(d, n), e = dev_error(g, before, ref, n);
    free(g);
    return e;
}
static double dev_check_f(const float *d, const double *before, const double *ref, size_t n) {
    double *g = dev_download_f(d, n), e = dev_error(g, before, ref, n);
    free(g);
    return e;
}

// Whether every element of a device tensor is finite (the timed runs' outputs).
static int dev_all_finite(double *downloaded, size_t n) {
    int ok = 1;
    for (size_t i = 0; i < n && ok; i++) ok = isfinite(downloaded[i]);
    free(downloaded);
    return ok;
}
static int dev_finite_x(const floatX *d, size_t n) { return dev_all_finite(dev_download_x(d, n), n); }

static int dev_finite_f(const float *d, size_t n) { return dev_all_finite(dev_download_f(d, n), n); }

// Whether two GPU buffers hold the same bytes.
static int dev_same_bits(const void *a, const void *b, size_t bytes) {
    unsigned char *ha = (unsigned char *)malloc_or_die(bytes), *hb = (unsigned char *)malloc_or_die(bytes);
    cuda_check(cudaMemcpy(ha, a, bytes, cudaMemcpyDeviceToHost));
    cuda_check(cudaMemcpy(hb, b, bytes, cudaMemcpyDeviceToHost));
    int same = memcmp(ha, hb, bytes) == 0;
    free(ha), free(hb);
    return same;
}

// The scratch of the layer under test (a model's memory plan sizes its own), in elements:
// weight-gradient slices (floats; 0: a 1x1 layer's gradient is one product), channel sums
// (floats), GroupNorm partial sums (doubles). Poisoned, so that a read before a write shows; the
// previous one is freed.
static Scratch dev_scratch_buffers;

static const Scratch *dev_scratch(int64_t weight_grad, int64_t channel_sums, int64_t gn_partials) {
    Scratch *s = &dev_scratch_buffers;
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cudaFree(s->weight_grad), cudaFree(s->channel_sums), cudaFree(s->gn_partials), cudaFree(s->gn_dx_sums);
    memset(s, 0, sizeof *s);
    s->weight_grad = (float *)dev_gpu_poisoned(weight_grad * sizeof(float));
    s->weight_grad_numel = weight_grad;
    s->channel_sums = (float *)dev_gpu_poisoned(channel_sums * sizeof(float));
    s->gn_partials = (double *)dev_gpu_poisoned(gn_partials * sizeof(double));
    s->gn_partials_numel = gn_partials;
    s->gn_dx_sums = (float *)dev_gpu_poisoned(gn_partials * sizeof(float));  // (room for gn_slots(N) C floats)
    return s;
}

// Frees device buffers given as a NULL-terminated list.
static void dev_gpu_free(void *first, ...) {
    cuda_check(cudaStreamSynchronize(gpu.stream));
    va_list args;
    va_start(args, first);
    for (void *p = first; p; p = va_arg(args, void *)) cuda_check(cudaFree(p));
    va_end(args);
}

// Timing: the median over 25 runs (after 3 warm-up runs) of fn(ctx) on the trainer's stream,
// between CUDA events, in milliseconds. DEV_QUICK: one run, no warm-up.
typedef void (*DevFn)(void *ctx);

static int dev_compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double dev_time_ms(DevFn fn, void *ctx) {
    enum { WARMUP = 3, RUNS = 25 };
    int warmup = dev_quick() ? 0 : WARMUP, runs = dev_quick() ? 1 : RUNS;
    double times[RUNS];
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start));
    cuda_check(cudaEventCreate(&stop));
    for (int i = 0; i < warmup; i++) fn(ctx);
    for (int i = 0; i < runs; i++) {
        cuda_check(cudaEventRecord(start, gpu.stream));
        fn(ctx);
        cuda_check(cudaEventRecord(stop, gpu.stream));
        cuda_check(cudaEventSynchronize(stop));
        float ms;
        cuda_check(cudaEventElapsedTime(&ms, start, stop));
        times[i] = ms;
    }
    cuda_check(cudaGetLastError());
    cuda_check(cudaEventDestroy(start));
    cuda_check(cudaEventDestroy(stop));
    qsort(times, runs, sizeof(double), dev_compare_doubles);
    return times[runs / 2];
}

// The gradient errors of one check, as "name=err ..." for its row.
typedef struct {
    char text[512];
    int ok;
} DevErrors;

static void dev_errors_init(DevErrors *e) {
    e->text[0] = 0;
    e->ok = 1;
}

// Adds one tensor's error; it passes when err <= tolerance (NaN never does).
static void dev_errors_add(DevErrors *e, const char *name, double err, double tolerance) {
    size_t at = strlen(e->text);
    snprintf(e->text + at, sizeof e->text - at, "%s%s=%.1e", at ? " " : "", name, err);
    if (!(err <= tolerance)) e->ok = 0;
}

// One table row: layer | shape | fwd err | grad errs | fwd ms | bwd ms | ok/FAIL. A negative
// fwd_err or time prints as "-". Counts the check; returns whether it passed.
#define DEV_ROW_FORMAT "| %-10s | %-40s | %-8s | %-58s | %8s | %8s | %-4s |\n"

static int dev_row(const char *layer, const char *shape, double fwd_err, double tolerance, const DevErrors *grads,
                   double fwd_ms, double bwd_ms) {
    static int header;
    if (!header) {
        header = 1;
        printf(DEV_ROW_FORMAT, "layer", "shape", "fwd err", "grad errs", "fwd ms", "bwd ms", "ok");
    }
    char fwd[32] = "-", f_ms[32] = "-", b_ms[32] = "-";
    int ok = grads ? grads->ok : 1;
    if (fwd_err >= 0 || fwd_err != fwd_err) {
        snprintf(fwd, sizeof fwd, "%.1e", fwd_err);
        if (!(fwd_err <= tolerance)) ok = 0;
    }
    if (fwd_ms >= 0) snprintf(f_ms, sizeof f_ms, "%.4f", fwd_ms);
    if (bwd_ms >= 0) snprintf(b_ms, sizeof b_ms, "%.4f", bwd_ms);
    printf(DEV_ROW_FORMAT, layer, shape, fwd, grads && grads->text[0] ? grads->text : "-", f_ms, b_ms, ok ? "ok" : "FAIL");
    fflush(stdout);
    if (ok) dev_checks_passed++;
    else dev_checks_failed++;
    return ok;
}

// A timing row: outputs finite (all_finite) passes.
static int dev_timing_row(const char *layer, const char *shape, double fwd_ms, double bwd_ms, int all_finite) {
    DevErrors e;
    dev_errors_init(&e);
    snprintf(e.text, sizeof e.text, "timing; outputs %s", all_finite ? "finite" : "NOT FINITE");
    e.ok = all_finite;
    return dev_row(layer, shape, -1, 0, &e, fwd_ms, bwd_ms);
}

// The last line; the return value is the program's exit status.
static int dev_end(void) {
    cuda_check(cudaDeviceSynchronize());
    printf("%d passed, %d failed\n", dev_checks_passed, dev_checks_failed);
    return dev_checks_failed ? 1 : 0;
}

#endif  // DEV_COMMON_H
