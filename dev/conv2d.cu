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
