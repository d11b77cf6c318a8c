// dev/loss.cu: the training losses. The mean squared error over every element (guided-diffusion's
// "mse" loss on the prediction), CPU reference in double; and the loss of a model with a learned
// variance (learned_loss: the hybrid loss and use_kl's), whose per-value term, train_unet.cu's
// bound_term, is checked against PyTorch by dev/test/test_sampler_fixture.cu: here its sums,
// scales and gradients over a batch are recomputed in double from the same per-value terms.
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

// The learned variance's loss on N random samples of H x W x 3 values (sample 0 at t = 0, the
// decoder's term): the loss and every value's gradient against the host's sums in double.
static void check_learned(int N, int H, int W, int predict, int use_kl) {
    const int C = 3, hw = H * W;
    size_t n = (size_t)N * hw * C;
    NoiseSchedule schedule;
    if (noise_schedule_make(&schedule, 1000, "cosine") != 0) fatal("no schedule");
    TimestepTerms *terms = (TimestepTerms *)malloc_or_die(1000 * sizeof(TimestepTerms));
    for (int t = 0; t < 1000; t++) terms[t] = timestep_terms(&schedule, t);
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    for (int i = 0; i < N; i++) t[i] = i == 0 ? 0 : dev_random_int(1000);
    double *x_t = dev_alloc(n), *target = dev_alloc(n), *out = dev_alloc(2 * n), *d_out = dev_alloc(2 * n);
    uint8_t *pixels = (uint8_t *)malloc_or_die(n);
    for (size_t i = 0; i < n; i++) pixels[i] = (uint8_t)dev_random_int(256);
    dev_fill_x(x_t, n, -2, 2), dev_fill_x(target, n, -2, 2), dev_fill_x(out, 2 * n, -1, 1);
    LearnedLoss loss = {!use_kl, !use_kl, predict, use_kl ? 1000.0f : 1.0f};
    // the host's sums, from the values as the GPU holds them (floatX)
    double squares = 0, bound = 0, per_value = 1.0 / ((double)N * hw * C), per_bound = loss.bound_scale * per_value / M_LN2;
    for (int s = 0; s < N; s++)
        for (int p = 0; p < hw; p++)
            for (int c = 0; c < C; c++) {
                size_t i = ((size_t)s * hw + p) * C + c, o = ((size_t)s * hw + p) * 2 * C + c;
                float prediction = (float)(floatX)out[o], v = (float)(floatX)out[o + C];
                BoundTerm b = bound_term(pixel_value(pixels[i]), (float)(floatX)x_t[i], prediction, v, &terms[t[s]], t[s] == 0, predict, 0);
                double diff = prediction - (double)(floatX)target[i];
                squares += diff * diff, bound += b.value;
                d_out[o] = (loss.frozen_mean ? 0.0 : per_bound * b.d_out) + (loss.mse ? 2 * per_value * diff : 0.0);
                d_out[o + C] = per_bound * b.d_v;
            }
    double want[3] = {(loss.mse ? squares * per_value : 0.0) + bound * per_bound, squares * per_value, bound * per_bound};
    TimestepTerms *terms_gpu = (TimestepTerms *)gpu_malloc(1000 * sizeof(TimestepTerms));
    int64_t *t_gpu = (int64_t *)gpu_malloc(N * sizeof(int64_t));
    cuda_check(cudaMemcpy(terms_gpu, terms, 1000 * sizeof(TimestepTerms), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(t_gpu, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    float *result = (float *)dev_gpu_poisoned(3 * sizeof(float));
    float *partial = (float *)dev_gpu_poisoned((size_t)N * learned_loss_blocks(hw) * 2 * sizeof(float));
    floatX *d_out_gpu = (floatX *)dev_gpu_poisoned(2 * n * sizeof(floatX)), *out_gpu = dev_upload_x(out, 2 * n);
    floatX *x_t_gpu = dev_upload_x(x_t, n), *target_gpu = dev_upload_x(target, n);
    uint8_t *pixels_gpu = (uint8_t *)gpu_malloc(n);
    cuda_check(cudaMemcpy(pixels_gpu, pixels, n, cudaMemcpyHostToDevice));
    learned_loss(result, partial, d_out_gpu, out_gpu, target_gpu, pixels_gpu, x_t_gpu, t_gpu, terms_gpu, N, hw, C, loss);
    cuda_check(cudaStreamSynchronize(gpu.stream));
    double tol = DEV_TOLERANCE, fwd = dev_check_f(result, NULL, want, 3);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dout", dev_check_x(d_out_gpu, NULL, d_out, 2 * n), tol);
    char shape[96];
    const char *predicts[3] = {"eps", "v", "x0"};
    snprintf(shape, sizeof shape, "N%d %dx%d, %s, %s", N, H, W, predicts[predict], use_kl ? "use_kl" : "hybrid");
    dev_row("learned", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(terms_gpu, t_gpu, result, partial, d_out_gpu, out_gpu, pixels_gpu, x_t_gpu, target_gpu, NULL);
    free(pixels), free(x_t), free(target), free(out), free(d_out), free(terms), free(t);
    noise_schedule_free(&schedule);
}

int main(void) {
    dev_begin("loss");
    check_learned(3, 7, 9, PREDICT_EPS, 0);
    check_learned(5, 16, 16, PREDICT_V, 0);
    check_learned(2, 33, 33, PREDICT_X0, 0);
    check_learned(4, 8, 8, PREDICT_EPS, 1);
    check_learned(9, 64, 64, PREDICT_EPS, 0);  // more pixels than the blocks of a sample have threads
    check_mse(1, 1, 1, 1);       // one value: one thread of 65536 works
    check_mse(1, 7, 7, 3);
    check_mse(3, 13, 13, 6);     // learn_sigma's 6 channels
    check_mse(32, 64, 64, 3);    // more values than threads
    time_mse(32, 64, 64, 3);
    return dev_end();
}
#endif  // DEV_NO_MAIN
