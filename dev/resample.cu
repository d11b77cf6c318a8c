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
