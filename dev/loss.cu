// dev/loss.cu: the training loss (train_unet.cu's training_loss), recomputed on the host in double
// per sample as guided-diffusion's training_losses defines it: the MSE of the prediction (the eps,
// v or x0 model's whole loss), and with a learned variance the bound's term (the hybrid loss and
// use_kl's), each sample weighted (the schedule sampler's 1 / (T p_t)), with the per-quarter sums
// and each sample's unweighted loss. The per-value bound term, bound_term, is checked against
// PyTorch by dev/test/test_sampler_fixture.cu; here its sums, scales and gradients over a batch.
#include "common.h"

// The MSE over every value, for the whole-model references (dev/test/test_unet_fixtures.cu):
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

// The host's loss of N samples of D = hw C values (guided-diffusion's training_losses): terms as
// LossOutputs.terms, samples[n] = {t_n, loss_n}, d_out the gradient of L (out holds 2C channels a
// pixel with a learned variance, C without). The inputs are the values as the GPU holds them.
static void ref_training_loss(double *terms, double *samples, double *d_out, const double *out, const double *target,
                              const uint8_t *pixels, const double *x_t, const TimestepTerms *t_terms, const int64_t *t, int T,
                              const double *weights, int N, int hw, int C, LossKind kind) {
    int out_C = kind.learned ? 2 * C : C;
    double D = (double)hw * C;
    memset(terms, 0, LOSS_TERMS * sizeof(double));
    for (int n = 0; n < N; n++) {
        double w = weights ? weights[n] : 1.0, per_value = w / (N * D), per_bound = kind.bound_scale * per_value / M_LN2;
        double squares = 0, bound = 0;
        for (int p = 0; p < hw; p++)
            for (int c = 0; c < C; c++) {
                size_t i = ((size_t)n * hw + p) * C + c, o = ((size_t)n * hw + p) * out_C + c;
                double diff = out[o] - target[i];
                d_out[o] = kind.mse ? 2 * per_value * diff : 0.0;
                if (kind.mse) squares += diff * diff;
                if (kind.learned) {
                    BoundTerm b = bound_term(pixel_value(pixels[i]), (float)x_t[i], (float)out[o], (float)out[o + C], &t_terms[t[n]],
                                             t[n] == 0, kind.predict, 0);
                    bound += b.value;
                    if (!kind.frozen_mean) d_out[o] += per_bound * b.d_out;
                    d_out[o + C] = per_bound * b.d_v;
                }
            }
        double mse = squares / D, vb = kind.bound_scale * bound / (D * M_LN2), loss = (kind.mse ? mse : 0.0) + vb;
        int quarter = t ? (int)(4 * t[n] / T) : 0;
        samples[2 * n] = t ? (double)t[n] : 0.0, samples[2 * n + 1] = loss;
        terms[0] += w * loss / N, terms[1] += w * mse / N, terms[2] += w * vb / N;
        terms[3 + quarter] += w * loss, terms[7 + quarter] += 1;
    }
}

// The noisy classifier's loss (classifier_train.py) on the host: per sample the cross-entropy of
// its K logits z against label y, loss_n = log sum_j exp(z_j) - z_y, and whether y's rank (the
// logits above z_y) is below 1 and below k = min(5, K); terms in the classifier's layout of
// LossOutputs.terms (L and the means of acc@1, acc@k; per quarter of t the sums of loss_n, the
// counts, the sums of acc@1 and of acc@k); d_out = (softmax(z) - onehot(y)) / N.
static void ref_classifier_loss(double *terms, double *d_out, const double *logits, const int *labels, const int64_t *t, int T,
                                int N, int K) {
    memset(terms, 0, LOSS_TERMS * sizeof(double));
    for (int n = 0; n < N; n++) {
        const double *z = logits + (size_t)n * K;
        double top = z[0], sum = 0;
        int y = labels[n], above = 0;
        for (int j = 0; j < K; j++) top = fmax(top, z[j]), above += z[j] > z[y];
        for (int j = 0; j < K; j++) sum += exp(z[j] - top);
        for (int j = 0; j < K; j++) d_out[(size_t)n * K + j] = (exp(z[j] - top) / sum - (j == y)) / N;
        double loss = top + log(sum) - z[y], top1 = above < 1, topk = above < (K < 5 ? K : 5);
        int quarter = (int)(4 * t[n] / T);
        terms[0] += loss / N, terms[1] += top1 / N, terms[2] += topk / N;
        terms[3 + quarter] += loss, terms[7 + quarter] += 1, terms[11 + quarter] += top1, terms[15 + quarter] += topk;
    }
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU checks: training_loss on random samples (sample 0 at t = 0, the decoder's term), against the
// host's sums; and its time at the trainer's eps shape.

typedef struct {
    LossOutputs outputs;
    LossInputs inputs;
    floatX *d_out, *out, *target;
    int N, hw, C;
    LossKind kind;
} LossRun;

static void loss_run(void *p) {
    LossRun *r = (LossRun *)p;
    training_loss(&r->outputs, r->d_out, r->out, r->target, &r->inputs, r->N, r->hw, r->C, r->kind);
}

// kind.learned: the bound's term too (T = 1000 steps of the cosine schedule); weighted: random
// weights in [0.1, 3) instead of none.
static void check_loss(int N, int H, int W, int C, LossKind kind, int weighted) {
    const int T = 1000, hw = H * W, out_C = kind.learned ? 2 * C : C;
    size_t n = (size_t)N * hw * C, out_n = (size_t)N * hw * out_C;
    NoiseSchedule schedule;
    if (noise_schedule_make(&schedule, T, "cosine") != 0) fatal("no schedule");
    TimestepTerms *terms = (TimestepTerms *)malloc_or_die(T * sizeof(TimestepTerms));
    for (int t = 0; t < T; t++) terms[t] = timestep_terms(&schedule, t);
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    for (int i = 0; i < N; i++) t[i] = i == 0 ? 0 : dev_random_int(T);
    double *x_t = dev_alloc(n), *target = dev_alloc(n), *out = dev_alloc(out_n), *d_out = dev_alloc(out_n), *weights = dev_alloc(N);
    uint8_t *pixels = (uint8_t *)malloc_or_die(n);
    for (size_t i = 0; i < n; i++) pixels[i] = (uint8_t)dev_random_int(256);
    dev_fill_x(x_t, n, -2, 2), dev_fill_x(target, n, -2, 2), dev_fill_x(out, out_n, -1, 1), dev_fill_f(weights, N, 0.1, 3);
    double want[LOSS_TERMS], want_samples[128];
    if (N > 64) fatal("check_loss: at most 64 samples");
    ref_training_loss(want, want_samples, d_out, out, target, pixels, x_t, terms, t, T, weighted ? weights : NULL, N, hw, C, kind);
    double references_agree = 0;  // the MSE alone, unweighted: the per-sample sums equal the whole-model reference's
    if (!kind.learned && !weighted) {
        double *d_whole = dev_alloc(n), whole = ref_mse_forward(out, target, n);
        ref_mse_backward(d_whole, out, target, n);
        references_agree = fabs(whole - want[0]) / whole + dev_rel_error(d_whole, d_out, n);
        free(d_whole);
    }

    LossRun r;
    r.outputs = loss_outputs_create(N, hw);
    dev_poison(r.outputs.terms, (LOSS_TERMS + 2 * N) * sizeof(float));
    TimestepTerms *terms_gpu = (TimestepTerms *)gpu_malloc(T * sizeof(TimestepTerms));
    int64_t *t_gpu = (int64_t *)gpu_malloc(N * sizeof(int64_t));
    uint8_t *pixels_gpu = (uint8_t *)gpu_malloc(n);
    cuda_check(cudaMemcpy(terms_gpu, terms, T * sizeof(TimestepTerms), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(t_gpu, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(pixels_gpu, pixels, n, cudaMemcpyHostToDevice));
    float *weights_gpu = dev_upload_f(weights, N);
    floatX *x_t_gpu = dev_upload_x(x_t, n);
    r.inputs = {pixels_gpu, x_t_gpu, terms_gpu, t_gpu, T, weighted ? weights_gpu : NULL};
    r.d_out = (floatX *)dev_gpu_poisoned(out_n * sizeof(floatX)), r.out = dev_upload_x(out, out_n), r.target = dev_upload_x(target, n);
    r.N = N, r.hw = hw, r.C = C, r.kind = kind;
    loss_run(&r);
    cuda_check(cudaStreamSynchronize(gpu.stream));
    double tol = DEV_TOLERANCE, fwd = dev_check_f(r.outputs.terms, NULL, want, LOSS_TERMS);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dout", dev_check_x(r.d_out, NULL, d_out, out_n), tol);
    dev_errors_add(&e, "samples", dev_check_f(r.outputs.samples, NULL, want_samples, 2 * N), tol);
    dev_errors_add(&e, "refs", references_agree, 1e-12);
    char shape[128];
    const char *predicts[3] = {"eps", "v", "x0"};
    snprintf(shape, sizeof shape, "N%d %dx%d C%d, %s%s%s", N, H, W, C, predicts[kind.predict],
             !kind.learned ? "" : kind.mse ? ", hybrid" : ", use_kl", weighted ? ", weighted" : "");
    dev_row(kind.learned ? "learned" : "mse", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(terms_gpu, t_gpu, pixels_gpu, weights_gpu, x_t_gpu, r.outputs.terms, r.d_out, r.out, r.target, NULL);
    free(pixels), free(x_t), free(target), free(out), free(d_out), free(weights), free(terms), free(t);
    noise_schedule_free(&schedule);
}

// classifier_loss on random logits (bf16-exact, so ties between logits are as likely as on the GPU)
// and labels, against the host's.
static void check_classifier_loss(int N, int K) {
    const int T = 1000;
    size_t n = (size_t)N * K;
    double *logits = dev_alloc(n), *d_out = dev_alloc(n), want[LOSS_TERMS];
    int *labels = (int *)malloc_or_die(N * sizeof(int));
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    dev_fill_x(logits, n, -4, 4);
    for (int i = 0; i < N; i++) labels[i] = dev_random_int(K), t[i] = dev_random_int(T);
    ref_classifier_loss(want, d_out, logits, labels, t, T, N, K);
    LossOutputs outputs = loss_outputs_create(N, 1);
    dev_poison(outputs.terms, LOSS_TERMS * sizeof(float));
    int64_t *t_gpu = (int64_t *)gpu_malloc(N * sizeof(int64_t));
    int *labels_gpu = (int *)gpu_malloc(N * sizeof(int));
    cuda_check(cudaMemcpy(t_gpu, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(labels_gpu, labels, N * sizeof(int), cudaMemcpyHostToDevice));
    LossInputs inputs = {NULL, NULL, NULL, t_gpu, T, NULL};
    floatX *d_gpu = (floatX *)dev_gpu_poisoned(n * sizeof(floatX)), *logits_gpu = dev_upload_x(logits, n);
    classifier_loss(&outputs, d_gpu, logits_gpu, labels_gpu, &inputs, N, K);
    cuda_check(cudaStreamSynchronize(gpu.stream));
    double tol = DEV_TOLERANCE, fwd = dev_check_f(outputs.terms, NULL, want, LOSS_TERMS);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dout", dev_check_x(d_gpu, NULL, d_out, n), tol);
    char shape[64];
    snprintf(shape, sizeof shape, "N%d K%d", N, K);
    dev_row("classifier", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(outputs.terms, t_gpu, labels_gpu, d_gpu, logits_gpu, NULL);
    free(logits), free(d_out), free(labels), free(t);
}

// The eps model's loss at a trainer's shape (every sample weighted 1, as a uniform draw of t gives).
static void time_loss(int N, int H, int W, int C) {
    size_t n = (size_t)N * H * W * C;
    LossRun r;
    r.outputs = loss_outputs_create(N, H * W);
    int64_t *t = (int64_t *)gpu_malloc(N * sizeof(int64_t));
    cuda_check(cudaMemset(t, 0, N * sizeof(int64_t)));
    float *weights = dev_random_f(N, 1, 1);
    r.inputs = {NULL, NULL, NULL, t, 1000, weights};
    r.d_out = (floatX *)gpu_malloc(n * sizeof(floatX)), r.out = dev_random_x(n, -2, 2), r.target = dev_random_x(n, -2, 2);
    r.N = N, r.hw = H * W, r.C = C, r.kind = {0, 1, 0, PREDICT_EPS, 1.0f};
    double ms = dev_time_ms(loss_run, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d C%d (loss and d_out)", N, H, W, C);
    dev_timing_row("mse", shape, ms, -1, dev_finite_f(r.outputs.terms, 3) && dev_finite_x(r.d_out, n));
    dev_gpu_free(r.outputs.terms, t, weights, r.d_out, r.out, r.target, NULL);
}

int main(void) {
    dev_begin("loss");
    LossKind mse_only = {0, 1, 0, PREDICT_EPS, 1.0f};
    check_loss(1, 1, 1, 1, mse_only, 0);   // one value
    check_loss(1, 7, 7, 3, mse_only, 0);
    check_loss(3, 13, 13, 6, mse_only, 1);  // six channels, all predicted (the model tests' loss)
    check_loss(32, 64, 64, 3, mse_only, 1);  // more pixels than the blocks of a sample have threads
    check_loss(3, 7, 9, 3, {1, 1, 1, PREDICT_EPS, 1.0f}, 0);
    check_loss(5, 16, 16, 3, {1, 1, 1, PREDICT_V, 1.0f}, 1);
    check_loss(2, 33, 33, 3, {1, 1, 1, PREDICT_X0, 1.0f}, 0);
    check_loss(4, 8, 8, 3, {1, 0, 0, PREDICT_EPS, 1000.0f}, 1);  // use_kl: the bound through both halves
    check_loss(9, 64, 64, 3, {1, 1, 1, PREDICT_EPS, 1.0f}, 1);
    check_classifier_loss(1, 1);
    check_classifier_loss(5, 3);     // shapes' three classes (acc@k: all of them)
    check_classifier_loss(37, 1000);  // ImageNet's, more logits than a warp has lanes
    check_classifier_loss(300, 10);   // more samples than the final block has threads
    time_loss(32, 64, 64, 3);
    return dev_end();
}
#endif  // DEV_NO_MAIN
