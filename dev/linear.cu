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
