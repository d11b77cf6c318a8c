// test_reference.cu: the CPU layer references (dev/*.cu) on small random shapes, awkward ones
// included. For every layer and every input: the backward pass against central finite
// differences of L = <forward(inputs), r> with a random r (so d_out = r), relative error
// <= 1e-6; backward accumulates (a second call doubles the gradient); and each gradient comes out
// the same when the others are NULL. Also the timestep embedding against its formula.
#define DEV_NO_MAIN
#include "../conv2d.cu"
#include "../linear.cu"
#include "../groupnorm.cu"
#include "../attention.cu"
#include "../resample.cu"
#include "../embedding.cu"
#include "../loss.cu"
#include "check.h"

#define FD_STEP 1e-5
#define FD_TOLERANCE 1e-6
#define FD_SAMPLES 100  // entries of each input checked (all of them when it has fewer)
#define MAX_INPUTS 4

// A layer under test: its shape, its inputs (filled at random, perturbed by the finite
// differences) and adapters calling the reference.
typedef struct TestLayer TestLayer;
struct TestLayer {
    int N, H, W, Cin, Cout, k, stride, heads, legacy, silu;
    int count;  // inputs
    double *in[MAX_INPUTS];
    size_t n[MAX_INPUTS];
    const char *names[MAX_INPUTS];
    int64_t *index;                                // embedding rows
    double *out;                                   // written by forward
    size_t out_n;
    void (*forward)(TestLayer *L);
    void (*backward)(TestLayer *L, const double *d_out, double **grads);  // grads[i] NULL: not wanted
};

static double max_fd_error;

static void add_input(TestLayer *L, const char *name, size_t n, double lo, double hi) {
    L->names[L->count] = name;
    L->n[L->count] = n;
    L->in[L->count] = dev_alloc(n);
    dev_fill_uniform(L->in[L->count++], n, lo, hi);
}

static double inner(const double *a, const double *b, size_t n) {
    double s = 0;
    for (size_t i = 0; i < n; i++) s += a[i] * b[i];
    return s;
}

// Runs the checks on a layer whose inputs and out are set up; frees them.
static void check_layer(const char *name, TestLayer *L) {
    check_case(name);
    double *r = dev_alloc(L->out_n), *grads[MAX_INPUTS], *again[MAX_INPUTS];
    dev_fill_uniform(r, L->out_n, -1, 1);
    for (int i = 0; i < L->count; i++) grads[i] = dev_alloc(L->n[i]), again[i] = dev_alloc(L->n[i]);
    L->forward(L);
    L->backward(L, r, grads);

    printf("  %s:", name);
    for (int i = 0; i < L->count; i++) {
        int samples = L->n[i] < FD_SAMPLES ? (int)L->n[i] : FD_SAMPLES;
        double analytic[FD_SAMPLES], numeric[FD_SAMPLES];
        for (int s = 0; s < samples; s++) {
            size_t j = samples == (int)L->n[i] ? (size_t)s : (size_t)dev_random_int(L->n[i]);
            double v = L->in[i][j];
            L->in[i][j] = v + FD_STEP;
            L->forward(L);
            double plus = inner(L->out, r, L->out_n);
            L->in[i][j] = v - FD_STEP;
            L->forward(L);
            double minus = inner(L->out, r, L->out_n);
            L->in[i][j] = v;
            analytic[s] = grads[i][j];
            numeric[s] = (plus - minus) / (2 * FD_STEP);
        }
        double err = dev_rel_error(analytic, numeric, samples);
        printf(" d_%s %.1e", L->names[i], err);
        if (err > max_fd_error) max_fd_error = err;
        CHECK(err <= FD_TOLERANCE);
    }
    printf("\n");
    L->forward(L);

    // Accumulation: a second call adds the same gradient again.
    for (int i = 0; i < L->count; i++) memcpy(again[i], grads[i], L->n[i] * sizeof(double));
    L->backward(L, r, again);
    for (int i = 0; i < L->count; i++) {
        for (size_t j = 0; j < L->n[i]; j++) again[i][j] -= 2 * grads[i][j];
        CHECK(dev_norm(again[i], L->n[i]) <= 1e-13 * dev_norm(grads[i], L->n[i]));
    }
    // Each gradient alone, the others NULL: the same values.
    for (int i = 0; i < L->count; i++) {
        double *only[MAX_INPUTS] = {NULL};
        only[i] = again[i];
        memset(again[i], 0, L->n[i] * sizeof(double));
        L->backward(L, r, only);
        CHECK(dev_rel_error(again[i], grads[i], L->n[i]) == 0);
    }
    for (int i = 0; i < L->count; i++) free(L->in[i]), free(grads[i]), free(again[i]);
    free(r), free(L->out), free(L->index);
}

// ----------------------------------------------------------------------------------------------
// Adapters: input 0 is the activation; the rest are the layer's parameters.

static void cpu_conv_forward(TestLayer *L) {
    ref_conv2d_forward(L->out, L->in[0], L->in[1], L->count > 2 ? L->in[2] : NULL, L->N, L->H, L->W, L->Cin, L->Cout, L->k,
                       L->stride);
}
static void cpu_conv_backward(TestLayer *L, const double *d_out, double **g) {
    ref_conv2d_backward(g[0], g[1], L->count > 2 ? g[2] : NULL, d_out, L->in[0], L->in[1], L->N, L->H, L->W, L->Cin, L->Cout,
                        L->k, L->stride);
}

static void test_conv(int N, int H, int W, int Cin, int Cout, int k, int stride, int bias) {
    TestLayer L = {N, H, W, Cin, Cout, k, stride};
    add_input(&L, "in", (size_t)N * H * W * Cin, -1, 1);
    add_input(&L, "weight", (size_t)Cout * Cin * k * k, -0.3, 0.3);
    if (bias) add_input(&L, "bias", Cout, -0.5, 0.5);
    L.out_n = (size_t)N * ref_conv2d_out_size(H, k, stride) * ref_conv2d_out_size(W, k, stride) * Cout;
    L.out = dev_alloc(L.out_n);
    L.forward = cpu_conv_forward, L.backward = cpu_conv_backward;
    check_layer(dev_name("conv2d N%d %dx%d %d->%d k%d stride %d%s", N, H, W, Cin, Cout, k, stride, bias ? "" : " no bias"), &L);
}

static void cpu_linear_forward(TestLayer *L) {
    ref_linear_forward(L->out, L->in[0], L->in[1], L->count > 2 ? L->in[2] : NULL, L->N, L->Cin, L->Cout);
}
static void cpu_linear_backward(TestLayer *L, const double *d_out, double **g) {
    ref_linear_backward(g[0], g[1], L->count > 2 ? g[2] : NULL, d_out, L->in[0], L->in[1], L->N, L->Cin, L->Cout);
}

static void test_linear(int N, int in, int out, int bias) {
    TestLayer L = {N, 1, 1, in, out};
    add_input(&L, "in", (size_t)N * in, -1, 1);
    add_input(&L, "weight", (size_t)out * in, -0.3, 0.3);
    if (bias) add_input(&L, "bias", out, -0.5, 0.5);
    L.out_n = (size_t)N * out;
    L.out = dev_alloc(L.out_n);
    L.forward = cpu_linear_forward, L.backward = cpu_linear_backward;
    check_layer(dev_name("linear N%d %d->%d%s", N, in, out, bias ? "" : " no bias"), &L);
}

static void cpu_group_norm_forward(TestLayer *L) {
    ref_group_norm_forward(L->out, L->in[0], L->in[1], L->in[2], L->count > 3 ? L->in[3] : NULL, L->N, L->H * L->W, L->Cin,
                           L->silu);
}
static void cpu_group_norm_backward(TestLayer *L, const double *d_out, double **g) {
    ref_group_norm_backward(g[0], g[1], g[2], L->count > 3 ? g[3] : NULL, d_out, L->in[0], L->in[1], L->in[2],
                            L->count > 3 ? L->in[3] : NULL, L->N, L->H * L->W, L->Cin, L->silu);
}

static void test_group_norm(int N, int H, int W, int C, int scale_shift, int silu) {
    TestLayer L = {N, H, W, C, C};
    L.silu = silu;
    add_input(&L, "in", (size_t)N * H * W * C, -1, 2);
    add_input(&L, "gamma", C, 0.8, 1.2);
    add_input(&L, "beta", C, -0.3, 0.3);
    if (scale_shift) add_input(&L, "scale_shift", (size_t)N * 2 * C, -0.5, 0.5);
    L.out_n = (size_t)N * H * W * C;
    L.out = dev_alloc(L.out_n);
    L.forward = cpu_group_norm_forward, L.backward = cpu_group_norm_backward;
    check_layer(dev_name("group_norm N%d %dx%d C%d%s%s", N, H, W, C, scale_shift ? " scale_shift" : "", silu ? " silu" : ""), &L);
}

static void cpu_attention_forward(TestLayer *L) { ref_attention_forward(L->out, L->in[0], L->N, L->H * L->W, L->Cout, L->heads, L->legacy); }
static void cpu_attention_backward(TestLayer *L, const double *d_out, double **g) {
    ref_attention_backward(g[0], d_out, L->in[0], L->N, L->H * L->W, L->Cout, L->heads, L->legacy);
}

static void test_attention(int N, int T, int C, int heads, int legacy) {
    TestLayer L = {N, T, 1, 3 * C, C};
    L.heads = heads, L.legacy = legacy;
    add_input(&L, "qkv", (size_t)N * T * 3 * C, -1.5, 1.5);
    L.out_n = (size_t)N * T * C;
    L.out = dev_alloc(L.out_n);
    L.forward = cpu_attention_forward, L.backward = cpu_attention_backward;
    check_layer(dev_name("attention %s N%d T%d C%d heads %d", legacy ? "legacy" : "new order", N, T, C, heads), &L);
}

static void cpu_avgpool_forward(TestLayer *L) { ref_avgpool_forward(L->out, L->in[0], L->N, L->H, L->W, L->Cin); }
static void cpu_avgpool_backward(TestLayer *L, const double *d_out, double **g) {
    if (g[0]) ref_avgpool_backward(g[0], d_out, L->N, L->H, L->W, L->Cin);
}
static void cpu_upsample_forward(TestLayer *L) { ref_upsample_forward(L->out, L->in[0], L->N, L->H, L->W, L->Cin); }
static void cpu_upsample_backward(TestLayer *L, const double *d_out, double **g) {
    if (g[0]) ref_upsample_backward(g[0], d_out, L->N, L->H, L->W, L->Cin);
}

static void test_resample(int N, int H, int W, int C, int up) {
    TestLayer L = {N, H, W, C, C};
    add_input(&L, "in", (size_t)N * H * W * C, -1, 1);
    L.out_n = up ? (size_t)N * 4 * H * W * C : (size_t)N * (H / 2) * (W / 2) * C;
    L.out = dev_alloc(L.out_n);
    L.forward = up ? cpu_upsample_forward : cpu_avgpool_forward, L.backward = up ? cpu_upsample_backward : cpu_avgpool_backward;
    check_layer(dev_name("%s N%d %dx%d C%d", up ? "upsample" : "avgpool", N, H, W, C), &L);
}

static void cpu_silu_forward(TestLayer *L) { ref_silu_forward(L->out, L->in[0], L->n[0]); }
static void cpu_silu_backward(TestLayer *L, const double *d_out, double **g) {
    if (g[0]) ref_silu_backward(g[0], d_out, L->in[0], L->n[0]);
}

static void test_silu(size_t n) {
    TestLayer L = {0};
    add_input(&L, "in", n, -6, 6);
    L.out_n = n;
    L.out = dev_alloc(n);
    L.forward = cpu_silu_forward, L.backward = cpu_silu_backward;
    check_layer(dev_name("silu n%zu", n), &L);
}

static void cpu_embedding_forward(TestLayer *L) { ref_embedding_forward(L->out, L->in[0], L->index, L->N, L->Cout); }
static void cpu_embedding_backward(TestLayer *L, const double *d_out, double **g) {
    if (g[0]) ref_embedding_backward(g[0], d_out, L->index, L->N, L->Cout);
}

// Rows drawn with repeats (N > rows), so the scatter-add must add them up.
static void test_embedding(int rows, int dim, int N) {
    TestLayer L = {N};
    L.Cout = dim;
    add_input(&L, "table", (size_t)rows * dim, -1, 1);
    L.index = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    for (int n = 0; n < N; n++) L.index[n] = dev_random_int(rows);
    L.out_n = (size_t)N * dim;
    L.out = dev_alloc(L.out_n);
    L.forward = cpu_embedding_forward, L.backward = cpu_embedding_backward;
    check_layer(dev_name("label embedding %d rows dim %d N%d", rows, dim, N), &L);
}

// The loss as a layer with one output: out = mse(in, target), d_out scales d loss.
static void cpu_mse_forward(TestLayer *L) { L->out[0] = ref_mse_forward(L->in[0], L->in[1], L->n[0]); }
static void cpu_mse_backward(TestLayer *L, const double *d_out, double **g) {
    if (!g[0]) return;
    double *d = dev_alloc(L->n[0]);
    ref_mse_backward(d, L->in[0], L->in[1], L->n[0]);
    for (size_t i = 0; i < L->n[0]; i++) g[0][i] += d_out[0] * d[i];
    free(d);
}

static void test_mse(size_t n) {
    TestLayer L = {0};
    add_input(&L, "out", n, -2, 2);
    add_input(&L, "target", n, -2, 2);
    L.count = 1;  // no gradient for the target
    L.out_n = 1;
    L.out = dev_alloc(1);
    L.forward = cpu_mse_forward, L.backward = cpu_mse_backward;
    double *target = L.in[1];
    check_layer(dev_name("mse n%zu", n), &L);
    free(target);
}

// The sinusoid against its formula written another way: t 10000^(-i/half); an odd dim ends in 0.
static void test_timestep_embedding(int dim) {
    check_case(dev_name("timestep embedding dim %d", dim));
    int64_t t[4] = {0, 1, 537, 999};
    double *out = dev_alloc(4 * (size_t)dim), *want = dev_alloc(4 * (size_t)dim);
    int half = dim / 2;
    for (int n = 0; n < 4; n++)
        for (int i = 0; i < half; i++) {
            want[n * dim + i] = cos(t[n] * pow(10000.0, -(double)i / half));
            want[n * dim + half + i] = sin(t[n] * pow(10000.0, -(double)i / half));
        }
    for (size_t i = 0; i < 4 * (size_t)dim; i++) out[i] = NAN;
    ref_timestep_embedding(out, t, 4, dim);
    double err = dev_rel_error(out, want, 4 * (size_t)dim);
    printf("  timestep embedding dim %d: rel err %.1e\n", dim, err);
    CHECK(err <= 1e-12);
    CHECK(out[0] == 1 && out[half] == 0);  // t = 0: cos 0, sin 0
    free(out), free(want);
}

int main(void) {
    test_conv(2, 5, 7, 3, 32, 3, 1, 1);
    test_conv(1, 1, 1, 32, 64, 3, 1, 1);
    test_conv(2, 7, 5, 32, 32, 3, 2, 1);
    test_conv(1, 6, 6, 64, 32, 3, 2, 1);
    test_conv(1, 1, 1, 32, 32, 3, 2, 1);
    test_conv(2, 3, 3, 96, 96, 1, 1, 1);
    test_conv(1, 5, 3, 32, 64, 1, 2, 1);
    test_conv(1, 4, 5, 32, 96, 3, 1, 0);

    test_linear(3, 64, 256, 1);
    test_linear(2, 96, 32, 1);
    test_linear(1, 32, 1, 0);

    test_group_norm(2, 7, 1, 32, 0, 0);
    test_group_norm(2, 3, 5, 64, 1, 1);
    test_group_norm(1, 1, 1, 96, 1, 0);
    test_group_norm(2, 3, 3, 64, 0, 1);
    test_group_norm(1, 1, 1, 32, 1, 1);
    test_group_norm(2, 2, 3, 96, 0, 0);

    for (int legacy = 1; legacy >= 0; legacy--) {
        test_attention(2, 5, 32, 1, legacy);
        test_attention(1, 7, 64, 2, legacy);
        test_attention(2, 4, 96, 3, legacy);
        test_attention(1, 1, 64, 2, legacy);
    }

    test_resample(2, 4, 6, 32, 0);
    test_resample(1, 5, 7, 3, 0);
    test_resample(1, 2, 2, 64, 0);
    test_resample(2, 3, 5, 32, 1);
    test_resample(1, 1, 1, 64, 1);

    test_silu(257);
    test_embedding(5, 32, 9);
    test_mse(50);
    test_timestep_embedding(32);
    test_timestep_embedding(33);
    test_timestep_embedding(7);

    check_case_end();
    printf("max finite-difference rel err %.2e (tolerance %.0e)\n", max_fd_error, FD_TOLERANCE);
    return check_summary();
}
