// dev/linear.cu: fully connected layer, weight in PyTorch's layout [out][in]. CPU reference in
// double.
#include "common.h"

// out[n][o] = bias[o] + sum_i weight[o][i] in[n][i]; bias may be NULL.
static void ref_linear_forward(double *out, const double *in, const double *weight, const double *bias, int N,
                               int in_features, int out_features) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < out_features; o++) {
            const double *w = weight + (size_t)o * in_features, *x = in + (size_t)n * in_features;
            double sum = bias ? bias[o] : 0;
            for (int i = 0; i < in_features; i++) sum += w[i] * x[i];
            out[(size_t)n * out_features + o] = sum;
        }
}

// d_in[n][i] += sum_o weight[o][i] d_out[n][o]
// d_weight[o][i] += sum_n d_out[n][o] in[n][i]
// d_bias[o] += sum_n d_out[n][o]
// Any of d_in, d_weight, d_bias may be NULL.
static void ref_linear_backward(double *d_in, double *d_weight, double *d_bias, const double *d_out, const double *in,
                                const double *weight, int N, int in_features, int out_features) {
    for (int n = 0; n < N; n++)
        for (int o = 0; o < out_features; o++) {
            double g = d_out[(size_t)n * out_features + o];
            size_t w = (size_t)o * in_features, x = (size_t)n * in_features;
            if (d_bias) d_bias[o] += g;
            for (int i = 0; i < in_features; i++) {
                if (d_in) d_in[x + i] += weight[w + i] * g;
                if (d_weight) d_weight[w + i] += g * in[x + i];
            }
        }
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's linear layers (the timestep MLP: a Conv with k = 1 on N 1x1 images,
// through conv_forward / conv_backward) and the ResBlocks' timestep projections, all computed in
// one product into fp32 with the bias added by add_rows_kernel (as unet_forward does).

typedef struct {
    Conv cv;
    floatX *y, *x, *dx, *dy;
    int N;
} LinearRun;

static void linear_run_forward(void *p) {
    LinearRun *r = (LinearRun *)p;
    conv_forward(&r->cv, r->y, r->x, r->N, 1, 1, NULL);
}

static void linear_run_backward(void *p) {
    LinearRun *r = (LinearRun *)p;
    conv_backward(&r->cv, r->dx, GRAD_ADD, r->dy, r->x, r->N, 1, 1, NULL, 0, NULL);
}

// out [N][E] fp32 = x [N][D] W^T ([E][D]) + b, as unet_forward computes the emb_layers outputs.
typedef struct {
    float *out;
    floatX *x, *w, *b;
    int N, D, E;
} ProjectionRun;

static void projection_run(void *p) {
    ProjectionRun *r = (ProjectionRun *)p;
    matmul({.M = r->N, .N = r->E, .K = r->D, .a = r->x, .lda = r->D, .b = r->w, .ldb = r->D, .trans_b = 1, .d = r->out,
            .ldd = r->E, .d_fp32 = 1});
    add_rows_kernel<<<(r->N * r->E + 255) / 256, 256, 0, gpu.stream>>>(r->out, r->b, r->N, r->E);
    cuda_check_launch();
}

// One check; with_dx 0: dx NULL (time_embed.0, whose input is the sinusoid).
static void check_linear(int N, int in, int out, int with_dx) {
    size_t nx = (size_t)N * in, ny = (size_t)N * out, nw = (size_t)out * in;
    double bound = 1 / sqrt((double)in);
    double *x = dev_alloc(nx), *w = dev_alloc(nw), *b = dev_alloc(out), *dy = dev_alloc(ny);
    dev_fill_x(x, nx, -1, 1), dev_fill_x(w, nw, -bound, bound), dev_fill_x(b, out, -bound, bound), dev_fill_x(dy, ny, -1, 1);
    double *y = dev_alloc(ny), *dx = dev_alloc(nx), *dw = dev_alloc(nw), *db = dev_alloc(out), *dx_before = dev_alloc(nx);
    ref_linear_forward(y, x, w, b, N, in, out);
    ref_linear_backward(dx, dw, db, dy, x, w, N, in, out);
    double s = dev_rms(dx, nx);
    dev_fill_x(dx_before, nx, -s, s);

    LinearRun r;
    memset(&r, 0, sizeof r);
    r.cv.in = in, r.cv.out = out, r.cv.k = 1, r.cv.stride = 1;
    r.cv.w = dev_upload_x(w, nw), r.cv.b = dev_upload_x(b, out);  // [out][in]: the same on the GPU
    r.cv.dw = (float *)dev_gpu_poisoned(nw * sizeof(float)), r.cv.db = (float *)dev_gpu_poisoned(out * sizeof(float));
    r.x = dev_upload_x(x, nx), r.dy = dev_upload_x(dy, ny), r.y = (floatX *)dev_gpu_poisoned(ny * sizeof(floatX));
    r.dx = with_dx ? dev_upload_x(dx_before, nx) : NULL;
    r.N = N;
    r.cv.scratch = dev_scratch(0, channel_sum_slots(N) * out, 0);
    linear_run_forward(&r);
    linear_run_backward(&r);

    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, ny);
    DevErrors e;
    dev_errors_init(&e);
    if (with_dx) dev_errors_add(&e, "dx", dev_check_x(r.dx, dx_before, dx, nx), tol);
    dev_errors_add(&e, "dw", dev_check_f(r.cv.dw, NULL, dw, nw), tol);
    dev_errors_add(&e, "db", dev_check_f(r.cv.db, NULL, db, out), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %d->%d%s", N, in, out, with_dx ? "" : " dx=NULL");
    dev_row("linear", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.cv.w, r.cv.b, r.cv.dw, r.cv.db, r.x, r.dy, r.y, NULL);
    if (r.dx) dev_gpu_free(r.dx, NULL);
    free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db), free(dx_before);
}

// The emb_layers projection of every ResBlock at once: N x D -> N x E in fp32 (its backward is a
// linear layer's, checked above).
static void check_projection(int N, int D, int E) {
    size_t nx = (size_t)N * D, nw = (size_t)E * D, ny = (size_t)N * E;
    double bound = 1 / sqrt((double)D);
    double *x = dev_alloc(nx), *w = dev_alloc(nw), *b = dev_alloc(E), *y = dev_alloc(ny);
    dev_fill_x(x, nx, -1, 1), dev_fill_x(w, nw, -bound, bound), dev_fill_x(b, E, -bound, bound);
    ref_linear_forward(y, x, w, b, N, D, E);
    ProjectionRun r = {(float *)dev_gpu_poisoned(ny * sizeof(float)), dev_upload_x(x, nx), dev_upload_x(w, nw),
                       dev_upload_x(b, E), N, D, E};
    projection_run(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_f(r.out, NULL, y, ny);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %d->%d fp32 out (emb_layers)", N, D, E);
    dev_row("emb_proj", shape, fwd, tol, NULL, -1, -1);
    dev_gpu_free(r.out, r.x, r.w, r.b, NULL);
    free(x), free(w), free(b), free(y);
}

static void time_linear(const char *what, int N, int in, int out) {
    size_t nx = (size_t)N * in, ny = (size_t)N * out, nw = (size_t)out * in;
    double bound = 1 / sqrt((double)in);
    LinearRun r;
    memset(&r, 0, sizeof r);
    r.cv.in = in, r.cv.out = out, r.cv.k = 1, r.cv.stride = 1;
    r.cv.w = dev_random_x(nw, -bound, bound), r.cv.b = dev_random_x(out, -bound, bound);
    r.cv.dw = (float *)gpu_malloc(nw * sizeof(float)), r.cv.db = (float *)gpu_malloc(out * sizeof(float));
    r.x = dev_random_x(nx, -1, 1), r.dy = dev_random_x(ny, -1, 1), r.y = (floatX *)gpu_malloc(ny * sizeof(floatX));
    r.dx = (floatX *)gpu_malloc(nx * sizeof(floatX));
    cuda_check(cudaMemsetAsync(r.dx, 0, nx * sizeof(floatX), gpu.stream));
    r.N = N;
    r.cv.scratch = dev_scratch(0, channel_sum_slots(N) * out, 0);
    double fwd = dev_time_ms(linear_run_forward, &r), bwd = dev_time_ms(linear_run_backward, &r);
    int finite = dev_finite_x(r.y, ny) && dev_finite_x(r.dx, nx) && dev_finite_f(r.cv.dw, nw) && dev_finite_f(r.cv.db, out);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %d->%d (%s)", N, in, out, what);
    dev_timing_row("linear", shape, fwd, bwd, finite);
    dev_gpu_free(r.cv.w, r.cv.b, r.cv.dw, r.cv.db, r.x, r.dy, r.y, r.dx, NULL);
}

static void time_projection(int N, int D, int E) {
    double bound = 1 / sqrt((double)D);
    ProjectionRun r = {(float *)gpu_malloc((size_t)N * E * sizeof(float)), dev_random_x((size_t)N * D, -1, 1),
                       dev_random_x((size_t)E * D, -bound, bound), dev_random_x(E, -bound, bound), N, D, E};
    double fwd = dev_time_ms(projection_run, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %d->%d (seed emb_layers)", N, D, E);
    dev_timing_row("emb_proj", shape, fwd, -1, dev_finite_f(r.out, (size_t)N * E));
    dev_gpu_free(r.out, r.x, r.w, r.b, NULL);
}

int main(void) {
    dev_begin("linear");
    check_linear(1, 64, 256, 0);    // time_embed.0 at batch 1 (no input gradient)
    check_linear(3, 160, 640, 0);   // time_embed.0, 160 model channels
    check_linear(3, 256, 256, 1);   // time_embed.2
    check_linear(2, 96, 33, 1);     // odd output width
    check_linear(3, 640, 1000, 1);  // emb_layers-like: wide, not a power of two
    check_projection(1, 256, 3712);
    check_projection(3, 640, 1000);
    time_linear("time_embed.2", 32, 256, 256);
    time_projection(32, 256, 3712);
    return dev_end();
}
#endif  // DEV_NO_MAIN
