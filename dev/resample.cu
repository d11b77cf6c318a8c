// dev/resample.cu: the UNet's weightless resampling, NHWC: 2x2 average pooling with stride 2
// (Downsample without conv, and the down ResBlock) and nearest-neighbour 2x upsampling (Upsample
// before its optional conv, and the up ResBlock), H, W the input's sides; and the upsampler's
// (SuperResModel's) bilinear upsampling of its low-resolution image and the area downsampling that
// makes that image in training. CPU reference in double.
#include "common.h"

// out[n][y][x][c] = (in[n][2y][2x][c] + in[n][2y][2x+1][c] + in[n][2y+1][2x][c] + in[n][2y+1][2x+1][c]) / 4,
// out [N][H/2][W/2][C] (an odd last row or column is dropped, as AvgPool2d(2, 2)).
static void ref_avgpool_forward(double *out, const double *in, int N, int H, int W, int C) {
    int Ho = H / 2, Wo = W / 2;
    for (int n = 0; n < N; n++)
        for (int y = 0; y < Ho; y++)
            for (int x = 0; x < Wo; x++)
                for (int c = 0; c < C; c++) {
                    const double *p = in + (((size_t)n * H + 2 * y) * W + 2 * x) * C + c;
                    out[(((size_t)n * Ho + y) * Wo + x) * C + c] = (p[0] + p[C] + p[(size_t)W * C] + p[(size_t)W * C + C]) / 4;
                }
}

// d_in[n][2y+dy][2x+dx][c] += d_out[n][y][x][c] / 4 for dy, dx in {0, 1}.
static void ref_avgpool_backward(double *d_in, const double *d_out, int N, int H, int W, int C) {
    int Ho = H / 2, Wo = W / 2;
    for (int n = 0; n < N; n++)
        for (int y = 0; y < Ho; y++)
            for (int x = 0; x < Wo; x++)
                for (int c = 0; c < C; c++) {
                    double g = d_out[(((size_t)n * Ho + y) * Wo + x) * C + c] / 4;
                    double *p = d_in + (((size_t)n * H + 2 * y) * W + 2 * x) * C + c;
                    p[0] += g, p[C] += g, p[(size_t)W * C] += g, p[(size_t)W * C + C] += g;
                }
}

// out[n][y][x][c] = in[n][y/2][x/2][c], out [N][2H][2W][C].
static void ref_upsample_forward(double *out, const double *in, int N, int H, int W, int C) {
    for (int n = 0; n < N; n++)
        for (int y = 0; y < 2 * H; y++)
            for (int x = 0; x < 2 * W; x++)
                for (int c = 0; c < C; c++)
                    out[(((size_t)n * 2 * H + y) * 2 * W + x) * C + c] = in[(((size_t)n * H + y / 2) * W + x / 2) * C + c];
}

// d_in[n][y][x][c] += sum_{dy,dx in {0,1}} d_out[n][2y+dy][2x+dx][c]
static void ref_upsample_backward(double *d_in, const double *d_out, int N, int H, int W, int C) {
    for (int n = 0; n < N; n++)
        for (int y = 0; y < 2 * H; y++)
            for (int x = 0; x < 2 * W; x++)
                for (int c = 0; c < C; c++)
                    d_in[(((size_t)n * H + y / 2) * W + x / 2) * C + c] += d_out[(((size_t)n * 2 * H + y) * 2 * W + x) * C + c];
}

// PyTorch's F.interpolate(mode="bilinear", align_corners=False) from s x s to S x S: output row i
// reads input rows u0 = floor(u) and u1 = min(u0 + 1, s - 1) at u = max((i + 1/2) s/S - 1/2, 0),
// weighted 1 - (u - u0) and u - u0; columns alike. out [N][S][S][C] from in [N][s][s][C].
static void ref_bilinear_taps(int i, int s, int S, int *t0, int *t1, double *w1) {
    double u = fmax((i + 0.5) * s / S - 0.5, 0.0);
    *t0 = (int)u, *t1 = *t0 + (*t0 < s - 1), *w1 = u - *t0;
}

// forward: up = the weighted sum of each output's four taps in lo; backward (its transpose):
// lo += each output's gradient in up, back to its taps with the same weights.
static void ref_upsample_bilinear(double *lo, double *up, int N, int s, int S, int C, int backward) {
    for (int n = 0; n < N; n++)
        for (int i = 0; i < S; i++)
            for (int j = 0; j < S; j++) {
                int u0, u1, v0, v1;
                double lu, lv;
                ref_bilinear_taps(i, s, S, &u0, &u1, &lu), ref_bilinear_taps(j, s, S, &v0, &v1, &lv);
                size_t tap[4] = {(size_t)u0 * s + v0, (size_t)u0 * s + v1, (size_t)u1 * s + v0, (size_t)u1 * s + v1};
                double weight[4] = {(1 - lu) * (1 - lv), (1 - lu) * lv, lu * (1 - lv), lu * lv};
                double *p = lo + (size_t)n * s * s * C, *q = up + (((size_t)n * S + i) * S + j) * C;
                for (int c = 0; c < C; c++) {
                    if (!backward) q[c] = 0;
                    for (int k = 0; k < 4; k++) {
                        if (backward) p[tap[k] * C + c] += weight[k] * q[c];
                        else q[c] += weight[k] * p[tap[k] * C + c];
                    }
                }
            }
}

static void ref_upsample_bilinear_forward(double *out, const double *in, int N, int s, int S, int C) {
    ref_upsample_bilinear((double *)in, out, N, s, S, C, 0);
}

static void ref_upsample_bilinear_backward(double *d_in, const double *d_out, int N, int s, int S, int C) {
    ref_upsample_bilinear(d_in, (double *)d_out, N, s, S, C, 1);
}

// F.interpolate(mode="area") from S x S to s x s (s divides S): the mean of each f x f block, f = S / s.
static void ref_downsample_area(double *lo, const double *x, int N, int S, int s, int C) {
    int f = S / s;
    for (int n = 0; n < N; n++)
        for (int i = 0; i < s; i++)
            for (int j = 0; j < s; j++)
                for (int c = 0; c < C; c++) {
                    double sum = 0;
                    for (int a = 0; a < f; a++)
                        for (int b = 0; b < f; b++) sum += x[(((size_t)n * S + i * f + a) * S + j * f + b) * C + c];
                    lo[(((size_t)n * s + i) * s + j) * C + c] = sum / (f * f);
                }
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's resample_forward / resample_backward (2x2 average pooling and nearest
// 2x upsampling). y written whole; dx += (checked against what it held before), or with GRAD_WRITE
// written (over poison).

typedef struct {
    floatX *y, *x, *dx, *dy;
    int up, N, H, W, C;
    GradMode mode;
} ResampleRun;

static void resample_run_forward(void *p) {
    ResampleRun *r = (ResampleRun *)p;
    resample_forward(r->up, r->y, r->x, r->N, r->H, r->W, r->C);
}

static void resample_run_backward(void *p) {
    ResampleRun *r = (ResampleRun *)p;
    resample_backward(r->up, r->dx, r->mode, r->dy, r->N, r->H, r->W, r->C);
}

static size_t resample_out_numel(int up, int N, int H, int W, int C) {
    return up ? (size_t)N * 2 * H * 2 * W * C : (size_t)N * (H / 2) * (W / 2) * C;
}

static void check_resample(int up, int N, int H, int W, int C, GradMode mode) {
    size_t nx = (size_t)N * H * W * C, ny = resample_out_numel(up, N, H, W, C);
    double *x = dev_alloc(nx), *dy = dev_alloc(ny), *y = dev_alloc(ny), *dx = dev_alloc(nx), *dx_before = dev_alloc(nx), s;
    dev_fill_x(x, nx, -1, 1), dev_fill_x(dy, ny, -1, 1);
    if (up) ref_upsample_forward(y, x, N, H, W, C), ref_upsample_backward(dx, dy, N, H, W, C);
    else ref_avgpool_forward(y, x, N, H, W, C), ref_avgpool_backward(dx, dy, N, H, W, C);
    s = dev_rms(dx, nx), dev_fill_x(dx_before, nx, -s, s);

    floatX *dx_gpu = mode == GRAD_ADD ? dev_upload_x(dx_before, nx) : (floatX *)dev_gpu_poisoned(nx * sizeof(floatX));
    ResampleRun r = {(floatX *)dev_gpu_poisoned(ny * sizeof(floatX)), dev_upload_x(x, nx), dx_gpu, dev_upload_x(dy, ny), up,
                     N, H, W, C, mode};
    resample_run_forward(&r);
    resample_run_backward(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, ny);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dx", dev_check_x(r.dx, mode == GRAD_ADD ? dx_before : NULL, dx, nx), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "%s N%d %dx%d C%d%s", up ? "up" : "down", N, H, W, C, mode == GRAD_WRITE ? " dx written" : "");
    dev_row(up ? "upsample" : "avgpool", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.y, r.x, r.dx, r.dy, NULL);
    free(x), free(dy), free(y), free(dx), free(dx_before);
}

static void time_resample(const char *what, int up, int N, int H, int W, int C) {
    size_t nx = (size_t)N * H * W * C, ny = resample_out_numel(up, N, H, W, C);
    ResampleRun r = {(floatX *)gpu_malloc(ny * sizeof(floatX)), dev_random_x(nx, -1, 1), (floatX *)gpu_malloc(nx * sizeof(floatX)),
                     dev_random_x(ny, -1, 1), up, N, H, W, C, GRAD_ADD};
    cuda_check(cudaMemsetAsync(r.dx, 0, nx * sizeof(floatX), gpu.stream));
    double fwd = dev_time_ms(resample_run_forward, &r), bwd = dev_time_ms(resample_run_backward, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "%s N%d %dx%d C%d (%s)", up ? "up" : "down", N, H, W, C, what);
    dev_timing_row(up ? "upsample" : "avgpool", shape, fwd, bwd, dev_finite_x(r.y, ny) && dev_finite_x(r.dx, nx));
    dev_gpu_free(r.y, r.x, r.dx, r.dy, NULL);
}

// The trainer's upsample_bilinear (forward only: the upsampler's conditioning) from s x s to S x S,
// into channels [C, 2C) of a 2C-channel tensor (as the model's input) whose first C stay as they were.
static void check_bilinear(int N, int s, int S, int C) {
    size_t n_lo = (size_t)N * s * s * C, n_up = (size_t)N * S * S * C;
    double *lo = dev_alloc(n_lo), *up = dev_alloc(n_up), *both = dev_alloc(2 * n_up), *want = dev_alloc(2 * n_up);
    dev_fill_x(lo, n_lo, -1, 1), dev_fill_x(both, 2 * n_up, -1, 1);
    ref_upsample_bilinear_forward(up, lo, N, s, S, C);
    for (size_t p = 0; p < n_up / C; p++)
        for (int c = 0; c < 2 * C; c++) want[p * 2 * C + c] = c < C ? both[p * 2 * C + c] : up[p * C + c - C];
    floatX *y = dev_upload_x(both, 2 * n_up), *x = dev_upload_x(lo, n_lo);
    upsample_bilinear(y, 2 * C, C, x, N, s, S, C);
    double err = dev_check_x(y, NULL, want, 2 * n_up);
    // The reference's backward (the whole model's, dev/unet.cu) is the forward's transpose:
    // <up(lo), g> = <lo, up^T(g)> for a random g.
    double *g = dev_alloc(n_up), *d_lo = dev_alloc(n_lo), left = 0, right = 0;
    dev_fill_x(g, n_up, -1, 1);
    ref_upsample_bilinear_backward(d_lo, g, N, s, S, C);
    for (size_t i = 0; i < n_up; i++) left += up[i] * g[i];
    for (size_t i = 0; i < n_lo; i++) right += lo[i] * d_lo[i];
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "adjoint", fabs(left - right) / fabs(left), 1e-12);
    free(g), free(d_lo);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d -> %dx%d C%d, into channels %d..%d of %d", N, s, s, S, S, C, C, 2 * C - 1, 2 * C);
    dev_row("bilinear", shape, err, DEV_TOLERANCE, &e, -1, -1);
    dev_gpu_free(y, x, NULL);
    free(lo), free(up), free(both), free(want);
}

// The trainer's downsample_area (the upsampler's low-resolution input in training), S x S to s x s.
static void check_area(int N, int S, int s, int C) {
    size_t n_x = (size_t)N * S * S * C, n_lo = (size_t)N * s * s * C;
    double *x = dev_alloc(n_x), *lo = dev_alloc(n_lo);
    dev_fill_x(x, n_x, -1, 1);
    ref_downsample_area(lo, x, N, S, s, C);
    floatX *d_x = dev_upload_x(x, n_x), *d_lo = (floatX *)dev_gpu_poisoned(n_lo * sizeof(floatX));
    downsample_area(d_lo, d_x, N, S, s, C);
    DevErrors e;
    dev_errors_init(&e);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d -> %dx%d C%d", N, S, S, s, s, C);
    dev_row("area", shape, dev_check_x(d_lo, NULL, lo, n_lo), DEV_TOLERANCE, &e, -1, -1);
    dev_gpu_free(d_x, d_lo, NULL);
    free(x), free(lo);
}

int main(void) {
    dev_begin("resample");
    check_area(2, 8, 4, 3);
    check_area(3, 256, 64, 3);
    check_area(1, 12, 12, 3);  // f = 1: a copy
    check_bilinear(2, 4, 8, 3);    // the fixture's upsampler
    check_bilinear(1, 64, 256, 3); // guided-diffusion's 64 -> 256
    check_bilinear(2, 5, 8, 3);    // a side that does not divide (PyTorch's rule holds for any)
    check_resample(0, 3, 8, 8, 96, GRAD_ADD);
    check_resample(0, 3, 2, 2, 160, GRAD_ADD);   // to 1x1
    check_resample(1, 3, 1, 1, 96, GRAD_ADD);    // 1x1 up to 2x2
    check_resample(1, 1, 7, 7, 160, GRAD_ADD);
    check_resample(1, 2, 13, 13, 3, GRAD_ADD);
    check_resample(1, 2, 5, 5, 160, GRAD_WRITE);
    time_resample("64 -> 32", 0, 32, 64, 64, 64);
    time_resample("32 -> 64", 1, 32, 32, 32, 128);
    // Odd sides last (the model never pools one: image_size is divisible by 2^(levels-1)): the last
    // row and column are dropped, as AvgPool2d(2, 2), so their gradient is zero.
    check_resample(0, 1, 7, 7, 64, GRAD_ADD);
    check_resample(0, 2, 13, 13, 3, GRAD_WRITE);  // written: the dropped row and column as zeros
    check_resample(0, 2, 6, 9, 32, GRAD_ADD);     // even by odd
    check_resample(0, 2, 7, 9, 96, GRAD_WRITE);
    return dev_end();
}
#endif  // DEV_NO_MAIN
