// dev/adamw.cu: AdamW as PyTorch's torch.optim.AdamW defines it (decoupled weight decay, bias
// correction), one step on fp32 master weights, with the EMA of the weights updated in the same pass.
// CPU reference in double.
#include "common.h"

// One step t (counting from 1) over n parameters, in place:
//   p -= lr wd p
//   m = b1 m + (1 - b1) g;   v = b2 v + (1 - b2) g^2
//   p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
static void ref_adamw_step(double *p, double *m, double *v, const double *g, size_t n, int t, double lr, double beta1,
                           double beta2, double eps, double weight_decay) {
    double bias1 = 1 - pow(beta1, t), bias2 = 1 - pow(beta2, t);
    for (size_t i = 0; i < n; i++) {
        p[i] -= lr * weight_decay * p[i];
        m[i] = beta1 * m[i] + (1 - beta1) * g[i];
        v[i] = beta2 * v[i] + (1 - beta2) * g[i] * g[i];
        p[i] -= lr * (m[i] / bias1) / (sqrt(v[i] / bias2) + eps);
    }
}

// guided-diffusion's update_ema from the new weights: ema = rate ema + (1 - rate) p.
static void ref_ema(double *ema, const double *p, size_t n, double rate) {
    for (size_t i = 0; i < n; i++) ema[i] = rate * ema[i] + (1 - rate) * p[i];
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's adamw_step, given the step state as a training step gives it. params, m,
// v and the EMA are fp32 in both builds, so they are held to the FP32 tolerance 1e-5 in both; the
// compute copy params_x (floatX) to the build's.

typedef struct {
    float *p, *m, *v, *g, *ema;  // ema: NULL for a step without one
    floatX *px;
    int64_t n;
    int step;
    float lr, beta1, beta2, eps, weight_decay, ema_rate;
    StepState *state;  // on the GPU, filled by adam_state
} AdamRun;

// The step state the training step's decision kernel leaves for AdamW: this step's learning rate
// and bias corrections (1 - beta^t on the host in float), no clipping, finite.
static void adam_state(AdamRun *r) {
    StepState h;
    memset(&h, 0, sizeof h);
    h.step = r->step, h.lr = r->lr, h.grad_scale = 1.0f, h.finite = 1;
    h.bias1 = 1.0f - powf(r->beta1, (float)r->step), h.bias2 = 1.0f - powf(r->beta2, (float)r->step);
    r->state = (StepState *)dev_gpu_poisoned(sizeof h);
    cuda_check(cudaMemcpy(r->state, &h, sizeof h, cudaMemcpyHostToDevice));
}

static void adam_run(void *q) {
    AdamRun *r = (AdamRun *)q;
    adamw_step(r->p, r->px, r->m, r->v, r->g, r->n, r->state, r->beta1, r->beta2, r->eps, r->weight_decay, r->ema, r->ema_rate);
}

// grad_scale: the gradients' size (small ones put eps to work); step 1 starts from zero moments.
// ema_rate 0: no EMA in the pass.
static void check_adamw(size_t n, int step, float lr, float weight_decay, double grad_scale, float ema_rate) {
    double *p = dev_alloc(n), *m = dev_alloc(n), *v = dev_alloc(n), *g = dev_alloc(n), *ema = dev_alloc(n);
    dev_fill_f(p, n, -1, 1), dev_fill_f(g, n, -grad_scale, grad_scale), dev_fill_f(ema, n, -1, 1);
    if (step > 1) dev_fill_f(m, n, -0.1 * grad_scale, 0.1 * grad_scale), dev_fill_f(v, n, 0, 0.01 * grad_scale * grad_scale);
    AdamRun r = {dev_upload_f(p, n), dev_upload_f(m, n), dev_upload_f(v, n), dev_upload_f(g, n),
                 ema_rate > 0 ? dev_upload_f(ema, n) : NULL, (floatX *)dev_gpu_poisoned(n * sizeof(floatX)), (int64_t)n, step,
                 lr, 0.9f, 0.999f, 1e-8f, weight_decay, ema_rate};
    adam_state(&r);
    adam_run(&r);
    ref_adamw_step(p, m, v, g, n, step, r.lr, r.beta1, r.beta2, r.eps, r.weight_decay);  // the float values, widened
    ref_ema(ema, p, n, r.ema_rate);
    double tol = DEV_TOLERANCE, fwd = dev_check_f(r.p, NULL, p, n);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "m", dev_check_f(r.m, NULL, m, n), 1e-5);
    dev_errors_add(&e, "v", dev_check_f(r.v, NULL, v, n), 1e-5);
    dev_errors_add(&e, "p_compute", dev_check_x(r.px, NULL, p, n), tol);
    if (r.ema) dev_errors_add(&e, "ema", dev_check_f(r.ema, NULL, ema, n), 1e-5);
    char shape[96];
    snprintf(shape, sizeof shape, "n %zu t%d lr %g wd %g grad~%g ema %g", n, step, lr, weight_decay, grad_scale, ema_rate);
    dev_row("adamw", shape, fwd, 1e-5, &e, -1, -1);
    dev_gpu_free(r.p, r.m, r.v, r.g, r.px, r.state, NULL);
    if (r.ema) dev_gpu_free(r.ema, NULL);
    free(p), free(m), free(v), free(g), free(ema);
}

// The seed model's parameter count.
static void time_adamw(void) {
    Options o = preset_seed();
    ModelConfig c = resolve_model(&o, o.num_classes);
    ParamList params = model_parameters(&c);
    int64_t n = params.numel;
    free(params.specs);
    AdamRun r = {dev_random_f(n, -1, 1), dev_random_f(n, -0.01, 0.01), dev_random_f(n, 0, 1e-4), dev_random_f(n, -0.1, 0.1),
                 dev_random_f(n, -1, 1), (floatX *)gpu_malloc(n * sizeof(floatX)), n, 10, 1e-4f, 0.9f, 0.999f, 1e-8f, 0.0f,
                 0.9999f};
    adam_state(&r);
    double ms = dev_time_ms(adam_run, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "n %lld (seed model), with an EMA", (long long)n);
    dev_timing_row("adamw", shape, ms, -1, dev_finite_f(r.p, n) && dev_finite_x(r.px, n) && dev_finite_f(r.ema, n));
    dev_gpu_free(r.p, r.m, r.v, r.g, r.ema, r.px, r.state, NULL);
}

int main(void) {
    dev_begin("adamw");
    check_adamw(1, 1, 1e-3f, 0.0f, 1, 0.0f);
    check_adamw(1000, 1, 1e-3f, 0.1f, 1, 0.9999f);
    check_adamw(1000, 7, 2e-2f, 0.1f, 1e-6, 0.0f);        // tiny gradients: eps matters
    check_adamw(1002, 3, 1e-3f, 0.1f, 1, 0.9f);           // n % 4 = 2: the last two one at a time
    check_adamw(1000003, 1000, 1e-3f, 0.01f, 0.1, 0.5f);  // (a fast EMA: its update well above rounding)
    time_adamw();
    return dev_end();
}
#endif  // DEV_NO_MAIN
