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

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's mse_loss (mse_partial_kernel writes d_out whole and the per-block
// sums; mse_final_kernel the loss). One launch pair computes both, timed as the forward.

typedef struct {
    float *loss, *partial;
    floatX *d_out, *out, *target;
    int64_t count;
} LossRun;

static void loss_run(void *p) {
    LossRun *r = (LossRun *)p;
    mse_loss(r->loss, r->partial, r->d_out, r->out, r->target, r->count);
}

static void check_mse(int N, int H, int W, int C) {
    size_t n = (size_t)N * H * W * C;
    double *out = dev_alloc(n), *target = dev_alloc(n), *d_out = dev_alloc(n);
    dev_fill_x(out, n, -2, 2), dev_fill_x(target, n, -2, 2);
    double loss = ref_mse_forward(out, target, n);
    ref_mse_backward(d_out, out, target, n);
    LossRun r = {(float *)dev_gpu_poisoned(sizeof(float)), (float *)dev_gpu_poisoned(LOSS_BLOCKS * sizeof(float)),
                 (floatX *)dev_gpu_poisoned(n * sizeof(floatX)), dev_upload_x(out, n), dev_upload_x(target, n), (int64_t)n};
    loss_run(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_f(r.loss, NULL, &loss, 1);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dout", dev_check_x(r.d_out, NULL, d_out, n), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d C%d (%zu values)", N, H, W, C, n);
    dev_row("mse", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.loss, r.partial, r.d_out, r.out, r.target, NULL);
    free(out), free(target), free(d_out);
}

static void time_mse(int N, int H, int W, int C) {
    size_t n = (size_t)N * H * W * C;
    LossRun r = {(float *)gpu_malloc(sizeof(float)), (float *)gpu_malloc(LOSS_BLOCKS * sizeof(float)),
                 (floatX *)gpu_malloc(n * sizeof(floatX)), dev_random_x(n, -2, 2), dev_random_x(n, -2, 2), (int64_t)n};
    double ms = dev_time_ms(loss_run, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d C%d (loss and d_out)", N, H, W, C);
    dev_timing_row("mse", shape, ms, -1, dev_finite_f(r.loss, 1) && dev_finite_x(r.d_out, n));
    dev_gpu_free(r.loss, r.partial, r.d_out, r.out, r.target, NULL);
}

int main(void) {
    dev_begin("loss");
    check_mse(1, 1, 1, 1);       // one value: one thread of 65536 works
    check_mse(1, 7, 7, 3);
    check_mse(3, 13, 13, 6);     // learn_sigma's 6 channels
    check_mse(32, 64, 64, 3);    // more values than threads
    time_mse(32, 64, 64, 3);
    return dev_end();
}
#endif  // DEV_NO_MAIN
