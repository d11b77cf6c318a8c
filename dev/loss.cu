// dev/loss.cu: the training loss, mean squared error over every element (guided-diffusion's
// "mse" loss on the predicted noise; with learn_sigma too, a plain MSE over all output channels).
// CPU reference in double.
#include "common.h"

// loss = sum_i (out[i] - target[i])^2 / n
static double ref_mse_forward(const double *out, const double *target, size_t n) {
    double sum = 0;
    for (size_t i = 0; i < n; i++) sum += (out[i] - target[i]) * (out[i] - target[i]);
    return sum / n;
}

// d_out[i] += 2 (out[i] - target[i]) / n   (d loss / d out)
static void ref_mse_backward(double *d_out, const double *out, const double *target, size_t n) {
    for (size_t i = 0; i < n; i++) d_out[i] += 2 * (out[i] - target[i]) / n;
}
