// dev/resample.cu: the UNet's weightless resampling, NHWC: 2x2 average pooling with stride 2
// (Downsample without conv, and the down ResBlock) and nearest-neighbour 2x upsampling (Upsample
// before its optional conv, and the up ResBlock). H, W are the input's sides. CPU reference in
// double.
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

int main(void) {
    dev_begin("resample");
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
