// dev/conv2d.cu: 2-D convolution with k = 1 or 3, zero padding k/2, stride 1 or 2. Activations
// NHWC, weights in PyTorch's layout [Cout][Cin][k][k] (a conv1d weight [Cout][Cin][1] is the same
// memory as k = 1). CPU reference in double.
#include "common.h"

// Output side: (H + 2 (k/2) - k) / stride + 1, as PyTorch's Conv2d(padding = k/2).
static int ref_conv2d_out_size(int H, int k, int stride) { return (H + 2 * (k / 2) - k) / stride + 1; }

// out[n][y][x][o] = bias[o] + sum_{i,ky,kx} weight[o][i][ky][kx] in[n][y s + ky - k/2][x s + kx - k/2][i]
// with s = stride and in = 0 outside the image; bias may be NULL.
static void ref_conv2d_forward(double *out, const double *in, const double *weight, const double *bias, int N, int H,
                               int W, int Cin, int Cout, int k, int stride) {
    int Ho = ref_conv2d_out_size(H, k, stride), Wo = ref_conv2d_out_size(W, k, stride), pad = k / 2;
    for (int n = 0; n < N; n++)
        for (int y = 0; y < Ho; y++)
            for (int x = 0; x < Wo; x++) {
                double *o = out + (((size_t)n * Ho + y) * Wo + x) * Cout;
                for (int co = 0; co < Cout; co++) o[co] = bias ? bias[co] : 0;
                for (int ky = 0; ky < k; ky++) {
                    int iy = y * stride + ky - pad;
                    if (iy < 0 || iy >= H) continue;
                    for (int kx = 0; kx < k; kx++) {
                        int ix = x * stride + kx - pad;
                        if (ix < 0 || ix >= W) continue;
                        const double *p = in + (((size_t)n * H + iy) * W + ix) * Cin;
                        for (int co = 0; co < Cout; co++) {
                            const double *w = weight + (size_t)co * Cin * k * k + ky * k + kx;
                            double sum = 0;
                            for (int ci = 0; ci < Cin; ci++) sum += w[(size_t)ci * k * k] * p[ci];
                            o[co] += sum;
                        }
                    }
                }
            }
}

// With g = d_out and (iy, ix) = (y s + ky - k/2, x s + kx - k/2) inside the image:
// d_in[n][iy][ix][i]       += sum_{o,ky,kx} weight[o][i][ky][kx] g[n][y][x][o]
// d_weight[o][i][ky][kx]   += sum_{n,y,x} g[n][y][x][o] in[n][iy][ix][i]
// d_bias[o]                += sum_{n,y,x} g[n][y][x][o]
// Any of d_in, d_weight, d_bias may be NULL.
static void ref_conv2d_backward(double *d_in, double *d_weight, double *d_bias, const double *d_out, const double *in,
                                const double *weight, int N, int H, int W, int Cin, int Cout, int k, int stride) {
    int Ho = ref_conv2d_out_size(H, k, stride), Wo = ref_conv2d_out_size(W, k, stride), pad = k / 2;
    for (int n = 0; n < N; n++)
        for (int y = 0; y < Ho; y++)
            for (int x = 0; x < Wo; x++) {
                const double *g = d_out + (((size_t)n * Ho + y) * Wo + x) * Cout;
                if (d_bias)
                    for (int co = 0; co < Cout; co++) d_bias[co] += g[co];
                for (int ky = 0; ky < k; ky++) {
                    int iy = y * stride + ky - pad;
                    if (iy < 0 || iy >= H) continue;
                    for (int kx = 0; kx < k; kx++) {
                        int ix = x * stride + kx - pad;
                        if (ix < 0 || ix >= W) continue;
                        size_t pixel = (((size_t)n * H + iy) * W + ix) * Cin;
                        for (int co = 0; co < Cout; co++) {
                            size_t w = (size_t)co * Cin * k * k + ky * k + kx;
                            for (int ci = 0; ci < Cin; ci++) {
                                if (d_in) d_in[pixel + ci] += weight[w + (size_t)ci * k * k] * g[co];
                                if (d_weight) d_weight[w + (size_t)ci * k * k] += g[co] * in[pixel + ci];
                            }
                        }
                    }
                }
            }
}

// PyTorch's weight layout [out][in][k][k] <-> the GPU's [out][k][k][in], by the trainer's param_layout.
static void conv_weight_layout(double *dst, const double *src, int out, int in, int k, int to_gpu) {
    ParamSpec p;
    memset(&p, 0, sizeof p);
    p.ndim = 4, p.shape[0] = out, p.shape[1] = in, p.shape[2] = k, p.shape[3] = k;
    p.numel = (int64_t)out * in * k * k;
    float *a = (float *)malloc_or_die(p.numel * sizeof(float)), *b = (float *)malloc_or_die(p.numel * sizeof(float));
    for (int64_t i = 0; i < p.numel; i++) a[i] = (float)src[i];
    param_layout(&p, a, b, to_gpu);
    for (int64_t i = 0; i < p.numel; i++) dst[i] = b[i];
    free(a), free(b);
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's conv_forward / conv_backward (3x3: the implicit GEMMs; 1x1: cuBLASLt;
// the bias gradient's channel sums) against the reference, then timed at the seed model's largest
// convolutions. (dev/bench_conv.cu checks the 3x3 kernels on channel slices of wider tensors.)
//   conv_forward:  y = conv(x) + b (+ residual, also in place: residual == y)    y written whole
//   conv_backward: dw, db written whole; dx += or (GRAD_WRITE) written, when given;
//                  d_bias_per_sample += ([N][ld])

typedef struct {
    Conv cv;
    floatX *y, *x, *dx, *dy;
    const floatX *residual;
    float *d_per_sample;
    GradMode dx_mode;
    int ld, N, H, W;
} ConvRun;

static void conv_run_forward(void *p) {
    ConvRun *r = (ConvRun *)p;
    conv_forward(&r->cv, r->y, r->x, r->N, r->H, r->W, r->residual);
}

static void conv_run_backward(void *p) {
    ConvRun *r = (ConvRun *)p;
    conv_backward(&r->cv, r->dx, r->dx_mode, r->dy, r->x, r->N, r->H, r->W, r->d_per_sample, r->ld, NULL);
}

// The scratch a model's plan gives this convolution: the weight gradient's slices, the bias
// gradient's partial sums.
static const Scratch *conv_scratch_for(int N, int H, int W, int Cin, int Cout, int k, int stride) {
    int Ho = ref_conv2d_out_size(H, k, stride), Wo = ref_conv2d_out_size(W, k, stride);
    int64_t weight_grad = 0;
    if (k == 3) {
        weight_grad = conv3x3_weight_grad_scratch_floats(N, H, W, Cin, Cout, stride);
    } else {
        int slices = weight_grad_slices(INT64_MAX, N * Ho * Wo, Cout, Cin);
        weight_grad = slices >= 2 ? (int64_t)slices * Cout * Cin : 0;
    }
    return dev_scratch(weight_grad, channel_sum_slots(N) * Cout, 0);
}

enum { RESIDUAL_NONE, RESIDUAL_SEPARATE, RESIDUAL_IN_PLACE };
enum { DX_NONE, DX_ADD, DX_WRITE };

// One check. residual: none, a separate tensor, or y itself (a ResBlock's skip conv writes y, then
// its last conv adds onto it). per_sample: d_bias_per_sample too ([N][Cout + 5]). with_dx: dx NULL,
// added to, or written.
static void check_conv(int N, int H, int W, int Cin, int Cout, int k, int stride, int residual, int per_sample, int with_dx) {
    int Ho = ref_conv2d_out_size(H, k, stride), Wo = ref_conv2d_out_size(W, k, stride), ld = Cout + 5;
    size_t nx = (size_t)N * H * W * Cin, ny = (size_t)N * Ho * Wo * Cout, nw = (size_t)Cout * Cin * k * k, nps = (size_t)N * ld;
    double bound = 1 / sqrt((double)Cin * k * k);
    double *x = dev_alloc(nx), *w = dev_alloc(nw), *b = dev_alloc(Cout), *res = dev_alloc(ny), *dy = dev_alloc(ny);
    dev_fill_x(x, nx, -1, 1), dev_fill_x(w, nw, -bound, bound), dev_fill_x(b, Cout, -0.5, 0.5);
    dev_fill_x(res, ny, -1, 1), dev_fill_x(dy, ny, -1, 1);

    // Reference.
    double *y = dev_alloc(ny), *dx = dev_alloc(nx), *dw = dev_alloc(nw), *db = dev_alloc(Cout), *dps = dev_alloc(nps);
    ref_conv2d_forward(y, x, w, b, N, H, W, Cin, Cout, k, stride);
    if (residual != RESIDUAL_NONE)
        for (size_t i = 0; i < ny; i++) y[i] += res[i];
    ref_conv2d_backward(with_dx ? dx : NULL, dw, db, dy, x, w, N, H, W, Cin, Cout, k, stride);
    for (int n = 0; n < N; n++)
        for (int p = 0; p < Ho * Wo; p++)
            for (int c = 0; c < Cout; c++) dps[(size_t)n * ld + c] += dy[((size_t)n * Ho * Wo + p) * Cout + c];
    // What the accumulating outputs hold before: random values of the gradient's size.
    double *dx_before = dev_alloc(nx), *dps_before = dev_alloc(nps), s;
    s = dev_rms(dx, nx), dev_fill_x(dx_before, nx, -s, s);
    s = dev_rms(dps, nps), dev_fill_f(dps_before, nps, -s, s);

    // The trainer.
    double *w_gpu = dev_alloc(nw);
    conv_weight_layout(w_gpu, w, Cout, Cin, k, 1);
    ConvRun r;
    memset(&r, 0, sizeof r);
    r.cv.in = Cin, r.cv.out = Cout, r.cv.k = k, r.cv.stride = stride;
    r.cv.w = dev_upload_x(w_gpu, nw), r.cv.b = dev_upload_x(b, Cout);
    r.cv.dw = (float *)dev_gpu_poisoned(nw * sizeof(float)), r.cv.db = (float *)dev_gpu_poisoned(Cout * sizeof(float));
    r.x = dev_upload_x(x, nx), r.dy = dev_upload_x(dy, ny);
    r.N = N, r.H = H, r.W = W, r.ld = ld;
    floatX *res_gpu = NULL;
    if (residual == RESIDUAL_IN_PLACE) r.y = dev_upload_x(res, ny), r.residual = r.y;
    else r.y = (floatX *)dev_gpu_poisoned(ny * sizeof(floatX));
    if (residual == RESIDUAL_SEPARATE) r.residual = res_gpu = dev_upload_x(res, ny);
    r.dx = with_dx == DX_ADD ? dev_upload_x(dx_before, nx) : with_dx == DX_WRITE ? (floatX *)dev_gpu_poisoned(nx * sizeof(floatX)) : NULL;
    r.dx_mode = with_dx == DX_WRITE ? GRAD_WRITE : GRAD_ADD;
    r.d_per_sample = per_sample ? dev_upload_f(dps_before, nps) : NULL;
    r.cv.scratch = conv_scratch_for(N, H, W, Cin, Cout, k, stride);
    conv_run_forward(&r);
    conv_run_backward(&r);

    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, ny);
    DevErrors e;
    dev_errors_init(&e);
    if (with_dx) dev_errors_add(&e, "dx", dev_check_x(r.dx, with_dx == DX_ADD ? dx_before : NULL, dx, nx), tol);
    double *dw_gpu = dev_download_f(r.cv.dw, nw), *dw_torch = dev_alloc(nw);
    conv_weight_layout(dw_torch, dw_gpu, Cout, Cin, k, 0);
    dev_errors_add(&e, "dw", dev_error(dw_torch, NULL, dw, nw), tol);
    dev_errors_add(&e, "db", dev_check_f(r.cv.db, NULL, db, Cout), tol);
    if (per_sample) dev_errors_add(&e, "dbias_n", dev_check_f(r.d_per_sample, dps_before, dps, nps), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d %d->%d k%d s%d%s%s", N, H, W, Cin, Cout, k, stride,
             residual == RESIDUAL_SEPARATE ? " +res" : residual == RESIDUAL_IN_PLACE ? " +res(y)" : "", with_dx == DX_ADD ? "" : with_dx == DX_WRITE ? " dx written" : " dx=NULL");
    dev_row("conv2d", shape, fwd, tol, &e, -1, -1);

    dev_gpu_free(r.cv.w, r.cv.b, r.cv.dw, r.cv.db, r.x, r.dy, r.y, NULL);
    if (res_gpu) dev_gpu_free(res_gpu, NULL);
    if (r.dx) dev_gpu_free(r.dx, NULL);
    if (r.d_per_sample) dev_gpu_free(r.d_per_sample, NULL);
    free(x), free(w), free(b), free(res), free(dy), free(y), free(dx), free(dw), free(db), free(dps);
    free(dx_before), free(dps_before), free(w_gpu), free(dw_gpu), free(dw_torch);
}

// A decoder ResBlock's 1x1 skip convolution on its concatenation [a | b] read in place
// (conv1x1_forward_concat, conv1x1_backward_concat) against the reference on the concatenated
// input: y, dw, and the input gradient's two parts (a's added to, b's written). The bias gradient is
// the caller's (the ResBlock copies conv2's, the same sums): db is left as it was.
static void check_conv1x1_concat(int N, int H, int W, int Ca, int Cb, int Cout) {
    int Cin = Ca + Cb;
    size_t P = (size_t)N * H * W, nx = P * Cin, ny = P * Cout, nw = (size_t)Cout * Cin;
    double bound = 1 / sqrt((double)Cin);
    double *x = dev_alloc(nx), *w = dev_alloc(nw), *b = dev_alloc(Cout), *dy = dev_alloc(ny);
    dev_fill_x(x, nx, -1, 1), dev_fill_x(w, nw, -bound, bound), dev_fill_x(b, Cout, -0.5, 0.5), dev_fill_x(dy, ny, -1, 1);
    double *y = dev_alloc(ny), *dx = dev_alloc(nx), *dw = dev_alloc(nw), *db = dev_alloc(Cout);
    ref_conv2d_forward(y, x, w, b, N, H, W, Cin, Cout, 1, 1);
    ref_conv2d_backward(dx, dw, db, dy, x, w, N, H, W, Cin, Cout, 1, 1);
    // The parts, pixel by pixel: [P][Ca] and [P][Cb]; a's gradient starts random (added to).
    double *xa = dev_alloc(P * Ca), *xb = dev_alloc(P * Cb), *dxa = dev_alloc(P * Ca), *dxb = dev_alloc(P * Cb);
    double *dxa_before = dev_alloc(P * Ca), s = dev_rms(dx, nx);
    dev_fill_x(dxa_before, P * Ca, -s, s);
    for (size_t p = 0; p < P; p++) {
        for (int c = 0; c < Ca; c++) xa[p * Ca + c] = x[p * Cin + c], dxa[p * Ca + c] = dx[p * Cin + c];
        for (int c = 0; c < Cb; c++) xb[p * Cb + c] = x[p * Cin + Ca + c], dxb[p * Cb + c] = dx[p * Cin + Ca + c];
    }

    Conv cv;
    memset(&cv, 0, sizeof cv);
    cv.in = Cin, cv.out = Cout, cv.k = 1, cv.stride = 1;
    cv.w = dev_upload_x(w, nw), cv.b = dev_upload_x(b, Cout);  // a 1x1 weight is [out][in] in both layouts
    double *db_before = dev_alloc(Cout), *no_change = dev_alloc(Cout);  // dev_alloc: zeros
    dev_fill_f(db_before, Cout, -1, 1);
    cv.dw = (float *)dev_gpu_poisoned(nw * sizeof(float)), cv.db = dev_upload_f(db_before, Cout);
    cv.scratch = conv_scratch_for(N, H, W, Cin, Cout, 1, 1);
    Act a = {dev_upload_x(xa, P * Ca), dev_upload_x(dxa_before, P * Ca), N, H, W, Ca};
    Act bb = {dev_upload_x(xb, P * Cb), (floatX *)dev_gpu_poisoned(P * Cb * sizeof(floatX)), N, H, W, Cb};
    floatX *y_gpu = (floatX *)dev_gpu_poisoned(ny * sizeof(floatX)), *dy_gpu = dev_upload_x(dy, ny);
    conv1x1_forward_concat(&cv, y_gpu, &a, &bb);
    conv1x1_backward_concat(&cv, dy_gpu, &a, GRAD_ADD, &bb, GRAD_WRITE);

    double tol = DEV_TOLERANCE, fwd = dev_check_x(y_gpu, NULL, y, ny);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "da", dev_check_x(a.dx, dxa_before, dxa, P * Ca), tol);
    dev_errors_add(&e, "db_in", dev_check_x(bb.dx, NULL, dxb, P * Cb), tol);
    dev_errors_add(&e, "dw", dev_check_f(cv.dw, NULL, dw, nw), tol);
    dev_errors_add(&e, "dbias_untouched", dev_check_f(cv.db, db_before, no_change, Cout), 0);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d [%d | %d]->%d k1 in place", N, H, W, Ca, Cb, Cout);
    dev_row("conv2d", shape, fwd, tol, &e, -1, -1);

    dev_gpu_free(cv.w, cv.b, cv.dw, cv.db, a.x, a.dx, bb.x, bb.dx, y_gpu, dy_gpu, NULL);
    free(x), free(w), free(b), free(dy), free(y), free(dx), free(dw), free(db), free(xa), free(xb), free(dxa), free(dxb);
    free(dxa_before), free(db_before), free(no_change);
}

// Forward and backward (dx given, the bias gradient total only) timed separately.
static void time_conv(const char *what, int N, int H, int W, int Cin, int Cout, int k, int stride) {
    int Ho = ref_conv2d_out_size(H, k, stride), Wo = ref_conv2d_out_size(W, k, stride);
    size_t nx = (size_t)N * H * W * Cin, ny = (size_t)N * Ho * Wo * Cout, nw = (size_t)Cout * Cin * k * k;
    double bound = 1 / sqrt((double)Cin * k * k);
    ConvRun r;
    memset(&r, 0, sizeof r);
    r.cv.in = Cin, r.cv.out = Cout, r.cv.k = k, r.cv.stride = stride;
    r.cv.w = dev_random_x(nw, -bound, bound), r.cv.b = dev_random_x(Cout, -0.5, 0.5);
    r.cv.dw = (float *)gpu_malloc(nw * sizeof(float)), r.cv.db = (float *)gpu_malloc(Cout * sizeof(float));
    r.x = dev_random_x(nx, -1, 1), r.dy = dev_random_x(ny, -1, 1);
    r.y = (floatX *)gpu_malloc(ny * sizeof(floatX)), r.dx = (floatX *)gpu_malloc(nx * sizeof(floatX));
    cuda_check(cudaMemsetAsync(r.dx, 0, nx * sizeof(floatX), gpu.stream));
    r.dx_mode = GRAD_ADD;
    r.N = N, r.H = H, r.W = W;
    r.cv.scratch = conv_scratch_for(N, H, W, Cin, Cout, k, stride);
    double fwd = dev_time_ms(conv_run_forward, &r), bwd = dev_time_ms(conv_run_backward, &r);
    int finite = dev_finite_x(r.y, ny) && dev_finite_x(r.dx, nx) && dev_finite_f(r.cv.dw, nw) && dev_finite_f(r.cv.db, Cout);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d %d->%d k%d s%d (%s)", N, H, W, Cin, Cout, k, stride, what);
    dev_timing_row("conv2d", shape, fwd, bwd, finite);
    dev_gpu_free(r.cv.w, r.cv.b, r.cv.dw, r.cv.db, r.x, r.dy, r.y, r.dx, NULL);
}

int main(void) {
    dev_begin("conv2d");
    check_conv(1, 7, 7, 3, 64, 3, 1, RESIDUAL_NONE, 0, DX_ADD);          // the first conv: 3 input channels
    check_conv(3, 13, 13, 96, 3, 3, 1, RESIDUAL_NONE, 0, DX_WRITE);      // the last conv: 3 output channels
    check_conv(2, 13, 13, 64, 64, 3, 2, RESIDUAL_NONE, 0, DX_WRITE);     // stride 2, odd size
    check_conv(2, 8, 8, 32, 32, 3, 2, RESIDUAL_NONE, 0, DX_ADD);         // stride 2, even size
    check_conv(3, 7, 13, 3, 96, 3, 2, RESIDUAL_NONE, 1, DX_NONE);        // stride 2 on 3 channels, dx NULL
    check_conv(1, 1, 1, 64, 160, 3, 1, RESIDUAL_NONE, 0, DX_ADD);        // 1x1 image
    check_conv(3, 7, 7, 160, 96, 1, 1, RESIDUAL_SEPARATE, 0, DX_ADD);    // skip connection + residual
    check_conv(3, 9, 9, 96, 160, 3, 1, RESIDUAL_IN_PLACE, 1, DX_WRITE);  // ResBlock out conv onto its skip
    check_conv(2, 4, 4, 192, 576, 1, 1, RESIDUAL_NONE, 0, DX_WRITE);     // attention qkv
    check_conv(2, 11, 9, 64, 6, 3, 1, RESIDUAL_NONE, 0, DX_ADD);         // learn_sigma's 6 output channels
    check_conv(8, 32, 32, 64, 64, 3, 1, RESIDUAL_NONE, 1, DX_ADD);       // weight gradient in 32 slices of pixels
    check_conv(4, 17, 17, 96, 96, 3, 2, RESIDUAL_NONE, 0, DX_ADD);       // stride 2, sliced weight gradient
    check_conv(4, 32, 32, 64, 128, 1, 1, RESIDUAL_NONE, 0, DX_ADD);      // 1x1 weight gradient in row slices
    check_conv1x1_concat(3, 5, 7, 64, 32, 96);                           // a decoder's skip convolution
    check_conv1x1_concat(4, 32, 32, 128, 64, 64);                        // its weight gradients in row slices
    time_conv("ResBlock conv", 32, 64, 64, 64, 64, 3, 1);
    time_conv("attention qkv", 32, 16, 16, 192, 576, 1, 1);
    return dev_end();
}
#endif  // DEV_NO_MAIN
