// sampler.h: what train_unet.cu (training, sample grids) and generate.c share about sampling:
// guided-diffusion's noise schedules and timestep respacing, one step of each sampler as a
// function of one value (so the GPU kernels and the host sampling loop run the same code), and the
// host sampling loop. Plain C (C11); in CUDA code the step functions are also device functions.
#ifndef SAMPLER_H
#define SAMPLER_H

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "random.h"  // HOST_DEVICE, random_u64

// ----------------------------------------------------------------------------------------------
// guided-diffusion's schedules (gaussian_diffusion.py) for T steps, in double:
//   linear: scale = 1000/T, betas = linspace(scale * 1e-4, scale * 0.02, T)
//   cosine: beta_t = min(1 - abar((t+1)/T) / abar(t/T), 0.999), abar(s) = cos((s + 0.008)/1.008 * pi/2)^2
//   alphas_cumprod = cumprod(1 - betas)

typedef struct {
    int steps;
    double *betas, *alphas_cumprod;  // [steps]
} NoiseSchedule;

static inline double cosine_alpha_bar(double s) {
    double c = cos((s + 0.008) / 1.008 * M_PI / 2);
    return c * c;
}

// Returns 0, or -1 for an unknown schedule name, a step count outside 1..100000, or no memory.
// Either way *d can be freed.
static inline int noise_schedule_make(NoiseSchedule *d, int steps, const char *name) {
    int linear = strcmp(name, "linear") == 0;
    memset(d, 0, sizeof *d);
    if ((!linear && strcmp(name, "cosine") != 0) || steps < 1 || steps > 100000) return -1;  // trainer's range
    d->steps = steps;
    d->betas = (double *)malloc(steps * sizeof(double));
    d->alphas_cumprod = (double *)malloc(steps * sizeof(double));
    if (!d->betas || !d->alphas_cumprod) return -1;
    double scale = 1000.0 / steps, start = scale * 0.0001, end = scale * 0.02, product = 1.0;
    for (int t = 0; t < steps; t++) {
        if (linear) d->betas[t] = steps == 1 ? start : start + (end - start) * t / (steps - 1);
        else d->betas[t] = fmin(1.0 - cosine_alpha_bar((t + 1.0) / steps) / cosine_alpha_bar((double)t / steps), 0.999);
        product *= 1.0 - d->betas[t];
        d->alphas_cumprod[t] = product;
    }
    return 0;
}

static inline void noise_schedule_free(NoiseSchedule *d) {
    free(d->betas);
    free(d->alphas_cumprod);
    memset(d, 0, sizeof *d);
}

// ----------------------------------------------------------------------------------------------
// Respacing: guided-diffusion's space_timesteps. "ddimN" keeps t = 0, s, 2s, ... with the smallest
// stride s that gives N steps (N = T keeps every step); section counts "N" or "N1,N2,..." split the
// T steps into that many equal sections (the first T % sections one longer) and keep N_i steps of
// section i, evenly spaced from its first step to its last (positions rounded half to even, as
// Python's round). The model always sees the original t. Sampling runs k = N-1 .. 0 from abar[k]
// to abar[k-1], and from abar[0] to 1: the respaced schedule's betas are 1 - abar[k] / abar[k-1].
// Besides guided-diffusion's specs, the spacings of Lin et al. 2023 ("Common diffusion noise
// schedules and sample steps are flawed", table 2): "leadingN" is ddimN (its noisiest step, T - s,
// falls short of T - 1, though sampling starts from pure noise), "trailingN" ends at T - 1,
// t = round(T - i T/N) - 1 for i = 0 .. N-1, and "linspaceN" keeps round(i (T - 1)/(N - 1)).

typedef struct {
    int count;       // kept steps
    int *timesteps;  // [count], increasing
    double *abar;    // [count]
} SampleSchedule;

// The smallest stride that keeps `steps` of T steps, or 0 when none does.
static inline int respacing_stride(int T, int steps) {
    for (int i = 1; i <= T; i++)
        if ((T + i - 1) / i == steps) return i;
    return 0;
}

// Returns 0, or -1 when no stride gives `steps` steps. Either way *s can be freed.
static inline int sample_schedule_make(const NoiseSchedule *d, int steps, SampleSchedule *s) {
    int stride = respacing_stride(d->steps, steps);
    memset(s, 0, sizeof *s);
    if (!stride) return -1;
    s->count = steps;
    s->timesteps = (int *)malloc(steps * sizeof(int));
    s->abar = (double *)malloc(steps * sizeof(double));
    if (!s->timesteps || !s->abar) return -1;
    for (int k = 0; k < steps; k++) s->timesteps[k] = k * stride, s->abar[k] = d->alphas_cumprod[k * stride];
    return 0;
}

// The steps kept by a respacing spec ("ddimN", "leadingN", "trailingN", "linspaceN" or section
// counts), into s. Returns 0, or -1 for a spec that is not one, asks for no step, or for more steps
// than a section has (or without memory). Either way *s can be freed.
static inline int sample_schedule_respaced(const NoiseSchedule *d, const char *spec, SampleSchedule *s) {
    memset(s, 0, sizeof *s);
    static const char *const named[] = {"ddim", "leading", "trailing", "linspace"};
    for (int k = 0; k < 4; k++) {
        size_t len = strlen(named[k]);
        if (strncmp(spec, named[k], len) != 0) continue;
        char *end;
        long n = strtol(spec + len, &end, 10);
        if (spec[len] < '0' || spec[len] > '9' || *end || n < 1 || n > d->steps) return -1;
        if (k < 2) return sample_schedule_make(d, (int)n, s);
        if (k == 3 && n == 1) return -1;  // linspace needs two ends
        s->timesteps = (int *)malloc(n * sizeof(int));
        s->abar = (double *)malloc(n * sizeof(double));
        if (!s->timesteps || !s->abar) return -1;
        s->count = (int)n;
        for (int i = 0; i < n; i++) {  // increasing t
            int t = k == 2 ? (int)nearbyint(d->steps - (double)(n - 1 - i) * d->steps / n) - 1 : (int)nearbyint((double)i * (d->steps - 1) / (n - 1));
            s->timesteps[i] = t, s->abar[i] = d->alphas_cumprod[t];
        }
        return 0;
    }
    int sections = 1, total = 0;
    for (const char *c = spec; *c; c++) sections += *c == ',';
    if (sections > d->steps) return -1;
    s->timesteps = (int *)malloc(d->steps * sizeof(int));
    s->abar = (double *)malloc(d->steps * sizeof(double));
    if (!s->timesteps || !s->abar) return -1;
    const char *c = spec;
    for (int i = 0, start = 0; i < sections; i++) {
        char *end;
        long count = (*c >= '0' && *c <= '9') ? strtol(c, &end, 10) : -1;
        int size = d->steps / sections + (i < d->steps % sections);
        if (count < 1 || count > size || (*end != ',' && *end != '\0')) return -1;
        double stride = count > 1 ? (double)(size - 1) / (double)(count - 1) : 1.0, position = 0.0;
        for (long k = 0; k < count; k++, position += stride) s->timesteps[total++] = start + (int)nearbyint(position);
        start += size;
        c = end + (*end == ',');
    }
    s->count = total;
    for (int k = 0; k < total; k++) s->abar[k] = d->alphas_cumprod[s->timesteps[k]];
    return 0;
}

// DPM-Solver++'s timesteps: `steps` values of t whose lambda = log(alpha/sigma) are nearest to
// evenly spaced points from lambda(T-1) to lambda(0) (repeats dropped). With guided-diffusion's
// even spacing in t instead, the linear schedule's first steps span most of lambda's range and the
// second-order extrapolation overshoots. Returns 0, or -1 without memory. Either way *s can be freed.
static inline int sample_schedule_log_snr(const NoiseSchedule *d, int steps, SampleSchedule *s) {
    s->count = 0;
    s->timesteps = (int *)malloc(steps * sizeof(int));
    s->abar = (double *)malloc(steps * sizeof(double));
    if (!s->timesteps || !s->abar || steps < 1) return -1;
    double first = 0.5 * log(d->alphas_cumprod[0] / (1 - d->alphas_cumprod[0]));
    double last = 0.5 * log(d->alphas_cumprod[d->steps - 1] / (1 - d->alphas_cumprod[d->steps - 1]));
    s->count = 0;
    for (int k = 0; k < steps; k++) {  // increasing t: lambda from first down to last
        double target = steps == 1 ? last : first + (last - first) * k / (steps - 1), best = INFINITY;
        int t_best = 0;
        for (int t = 0; t < d->steps; t++) {
            double gap = fabs(0.5 * log(d->alphas_cumprod[t] / (1 - d->alphas_cumprod[t])) - target);
            if (gap < best) best = gap, t_best = t;
        }
        if (s->count == 0 || s->timesteps[s->count - 1] != t_best)
            s->timesteps[s->count] = t_best, s->abar[s->count++] = d->alphas_cumprod[t_best];
    }
    return 0;
}

// Karras et al.'s noise levels (EDM, 2022): sigma_min, sigma_max (0: the schedule's own; an EDM
// model's, EDM's 0.002 and 80) and rho; s_churn, s_min, s_max, s_noise, Heun's churn (EDM's S_churn,
// S_tmin, S_tmax, S_noise; see heun_plan), none with s_churn 0; and sigma_data: an EDM model's (its
// F is called as edm_call says), or 0 for a discrete-time model, called at its nearest timestep.
typedef struct {
    double sigma_min, sigma_max, rho;
    double s_churn, s_min, s_max, s_noise;
    double sigma_data;
} KarrasLevels;

// sigma = sqrt((1 - abar) / abar) of timestep t: the noise level of x_ve = x / sqrt(abar).
static inline double schedule_sigma(const NoiseSchedule *d, int t) { return sqrt((1 - d->alphas_cumprod[t]) / d->alphas_cumprod[t]); }

// The levels' range: sigma_min and sigma_max, or the schedule's own sigma(0) and sigma(T-1).
static inline void karras_range(const NoiseSchedule *d, KarrasLevels k, double *lo, double *hi) {
    *lo = k.sigma_min > 0 ? k.sigma_min : k.sigma_data > 0 ? 0.002 : schedule_sigma(d, 0);
    *hi = k.sigma_max > 0 ? k.sigma_max : k.sigma_data > 0 ? 80.0 : schedule_sigma(d, d->steps - 1);
}

// The t whose sigma is nearest to sigma in log sigma, the lower on a tie.
static inline int nearest_timestep(const NoiseSchedule *d, double sigma) {
    double best = INFINITY;
    int t_best = 0;
    for (int t = 0; t < d->steps; t++) {
        double gap = fabs(log(schedule_sigma(d, t)) - log(sigma));
        if (gap < best) best = gap, t_best = t;
    }
    return t_best;
}

// Karras levels for a discrete-time model, as k-diffusion samples one: `steps` levels
//   sigma_i = (sigma_max^(1/rho) + i / (steps - 1) (sigma_min^(1/rho) - sigma_max^(1/rho)))^rho
// then 0 (get_sigmas_karras). A level's abar is 1 / (1 + sigma^2), and the model sees the t whose
// sigma is nearest in log sigma, the lower on a tie (DiscreteSchedule.sigma_to_t, quantized); an
// EDM model (k.sigma_data > 0) sees sigma itself (edm_call; t is 0).
// Returns 0, or -1 for no steps, a rho that is not positive, sigma_min not below sigma_max, or
// without memory. Either way *s can be freed.
static inline int sample_schedule_karras(const NoiseSchedule *d, int steps, KarrasLevels k, SampleSchedule *s) {
    memset(s, 0, sizeof *s);
    double lo, hi;
    karras_range(d, k, &lo, &hi);
    if (steps < 1 || !(k.rho > 0) || !(lo < hi)) return -1;
    s->timesteps = (int *)malloc(steps * sizeof(int));
    s->abar = (double *)malloc(steps * sizeof(double));
    if (!s->timesteps || !s->abar) return -1;
    s->count = steps;
    for (int i = 0; i < steps; i++) {  // from the noisiest: schedule index steps - 1 - i
        double ramp = steps == 1 ? 0.0 : (double)i / (steps - 1);
        double sigma = pow(pow(hi, 1 / k.rho) + ramp * (pow(lo, 1 / k.rho) - pow(hi, 1 / k.rho)), k.rho);
        s->timesteps[steps - 1 - i] = k.sigma_data > 0 ? 0 : nearest_timestep(d, sigma), s->abar[steps - 1 - i] = 1 / (1 + sigma * sigma);
    }
    return 0;
}

static inline void sample_schedule_free(SampleSchedule *s) {
    free(s->timesteps);
    free(s->abar);
    memset(s, 0, sizeof *s);
}

// The schedule of the kept steps (guided-diffusion's SpacedDiffusion): their abar, and the betas
// 1 - abar_k / abar_(k-1) (abar_(-1) = 1). Returns 0, or -1 without memory. Either way *out can be
// freed.
static inline int noise_schedule_respaced(const SampleSchedule *kept, NoiseSchedule *out) {
    out->steps = kept->count;
    out->betas = (double *)malloc(kept->count * sizeof(double));
    out->alphas_cumprod = (double *)malloc(kept->count * sizeof(double));
    if (!out->betas || !out->alphas_cumprod) return -1;
    for (int k = 0; k < kept->count; k++)
        out->alphas_cumprod[k] = kept->abar[k], out->betas[k] = 1.0 - kept->abar[k] / (k > 0 ? kept->abar[k - 1] : 1.0);
    return 0;
}

// Per timestep t of a schedule, what a step of training, sampling or the likelihood needs of
// guided-diffusion's GaussianDiffusion arrays (computed in double, kept in float): the forward
// process, the posterior q(x_{t-1} | x_t, x0) and the range of a learned variance.
typedef struct {
    float sqrt_abar, sqrt_one_minus_abar;  // x_t = sqrt_abar x0 + sqrt_one_minus_abar eps
    float mean_x0, mean_xt;                // the posterior's mean: mean_x0 x0 + mean_xt x_t
    float log_var_min;                     // log beta_tilde_t (at t = 0 beta_tilde_1's: "clipped")
    float log_var_range;                   // log beta_t - log_var_min (learned_log_variance)
    float posterior_variance;              // beta_tilde_t, not clipped (0 at t = 0): FIXED_SMALL's variance
} TimestepTerms;

// With abar_prev = abar_{t-1} (1 at t = 0): beta_tilde_t = beta_t (1 - abar_prev) / (1 - abar_t),
// mean_x0 = beta_t sqrt(abar_prev) / (1 - abar_t), mean_xt = (1 - abar_prev) sqrt(1 - beta_t) / (1 - abar_t).
static inline TimestepTerms timestep_terms(const NoiseSchedule *d, int t) {
    const double *abar = d->alphas_cumprod, *beta = d->betas;
    double prev = t > 0 ? abar[t - 1] : 1.0;
    int tv = t > 0 || d->steps == 1 ? t : 1;  // the clipped posterior variance
    double posterior = beta[tv] * (1.0 - (tv > 0 ? abar[tv - 1] : 1.0)) / (1.0 - abar[tv]);
    TimestepTerms tt;
    tt.sqrt_abar = (float)sqrt(abar[t]), tt.sqrt_one_minus_abar = (float)sqrt(1.0 - abar[t]);
    tt.mean_x0 = (float)(beta[t] * sqrt(prev) / (1.0 - abar[t]));
    tt.mean_xt = (float)((1.0 - prev) * sqrt(1.0 - beta[t]) / (1.0 - abar[t]));
    double log_var_min = posterior > 0 ? log(posterior) : log(beta[t]);  // T = 1: no posterior variance
    tt.log_var_min = (float)log_var_min, tt.log_var_range = (float)(log(beta[t]) - log_var_min);
    tt.posterior_variance = (float)(beta[t] * (1.0 - prev) / (1.0 - abar[t]));
    return tt;
}

// ----------------------------------------------------------------------------------------------
// One step of a sampler for one value x at abar (from the model's output `out`) to abar_prev.
// The model predicts eps, v = sqrt(abar) eps - sqrt(1 - abar) x0, or x0 itself (guided-diffusion's
// predict_xstart); each gives
//   x0 = (x - sqrt(1 - abar) eps) / sqrt(abar)  =  sqrt(abar) x - sqrt(1 - abar) v
// clipped to [-1, 1] when clip is set (guided-diffusion's clip_denoised).

typedef enum { PREDICT_EPS, PREDICT_V, PREDICT_X0, PREDICT_EDM } Prediction;  // PREDICT_EDM: EDM's F (below)

// The prediction a name gives ("eps", "v", "x0"), or -1.
static inline int prediction_from_name(const char *name) {
    return strcmp(name, "eps") == 0 ? PREDICT_EPS : strcmp(name, "v") == 0 ? PREDICT_V : strcmp(name, "x0") == 0 ? PREDICT_X0 : -1;
}

// The reverse process's variance (guided-diffusion's ModelVarType): fixed at the posterior's
// beta_tilde_t (small) or at beta_t (large, guided-diffusion's default), or learned in the range
// between them (the model's output's second half: learned_log_variance).
typedef enum { VARIANCE_FIXED_SMALL, VARIANCE_FIXED_LARGE, VARIANCE_LEARNED_RANGE } VarianceType;

// The training loss (guided-diffusion's LossType): the prediction's MSE; with a learned variance
// the hybrid (RESCALED_MSE: the MSE plus the variational bound's term through the variance only) or
// the bound alone (KL, through both halves).
typedef enum { LOSS_MSE, LOSS_HYBRID, LOSS_KL } LossType;

// How training draws t: uniformly, or by the losses' second moment (guided-diffusion's
// LossSecondMomentResampler).
typedef enum { TIMESTEPS_UNIFORM, TIMESTEPS_LOSS_SECOND_MOMENT } TimestepSampler;

// A model's diffusion, resolved once from the flags or a checkpoint's metadata (guided-diffusion's
// create_gaussian_diffusion): what training, the samplers and the likelihood read. An EDM model
// (predict PREDICT_EDM, --precond edm) has continuous noise levels: steps and schedule are unused.
typedef struct {
    int steps;                // T (diffusion_steps)
    const char *schedule;     // "linear" or "cosine" (noise_schedule_make's names; static text)
    Prediction predict;
    VarianceType variance;
    LossType loss;
    float bound_scale;        // the bound's term's scale s: T/1000 (hybrid) or T (KL) with rescale_learned_sigmas, else 1
    TimestepSampler timesteps;
    float sigma_data, p_mean, p_std;  // EDM's sigma_data and training draws ln sigma ~ N(p_mean, p_std^2)
} DiffusionConfig;

// x0 from the model's output at a step of sqrt(abar) = a, sqrt(1 - abar) = b: eps, v or x0 itself,
// clipped to [-1, 1] when asked.
// (EDM's F: x0 = a x + b out, with the step's a and b, edm_call.)
HOST_DEVICE static inline float predict_x0_ab(float x, float out, float a, float b, int predict, int clip) {
    float x0 = predict == PREDICT_V ? a * x - b * out : predict == PREDICT_X0 ? out : predict == PREDICT_EDM ? a * x + b * out : (x - b * out) / a;
    return clip ? fminf(fmaxf(x0, -1.0f), 1.0f) : x0;
}

// The same from abar (in float: near abar = 1, 1 - abar keeps few digits; a plan's steps carry a
// and b computed in double, sample_step_value's).
HOST_DEVICE static inline float predict_x0(float x, float out, float abar, int predict, int clip) {
    return predict_x0_ab(x, out, sqrtf(abar), sqrtf(1.0f - abar), predict, clip);
}

// DDIM (Song et al.): eps recomputed from x0, then
//   sigma = eta sqrt((1 - abar_prev)/(1 - abar)) sqrt(1 - abar/abar_prev)
//   x_prev = sqrt(abar_prev) x0 + sqrt(1 - abar_prev - sigma^2) eps + sigma z
// eta = 0 is deterministic; eta = 1 over all T steps is DDPM's ancestral sampling with the fixed
// small variance (guided-diffusion's p_sample: the posterior mean and variance of q(x_prev | x, x0)).
HOST_DEVICE static inline float ddim_from_x0(float x, float x0, float abar, float abar_prev, float eta, float z) {
    float eps = (x - sqrtf(abar) * x0) / sqrtf(1.0f - abar);
    float sigma = eta * sqrtf((1.0f - abar_prev) / (1.0f - abar)) * sqrtf(fmaxf(1.0f - abar / abar_prev, 0.0f));
    return sqrtf(abar_prev) * x0 + sqrtf(fmaxf(1.0f - abar_prev - sigma * sigma, 0.0f)) * eps + sigma * z;
}

HOST_DEVICE static inline float ddim_update(float x, float out, float abar, float abar_prev, float eta, float z,
                                            int predict, int clip) {
    return ddim_from_x0(x, predict_x0(x, out, abar, predict, clip), abar, abar_prev, eta, z);
}

// Classifier guidance (Dhariwal & Nichol, guided-diffusion's cond_fn) with a value's score
// g = s d log p(y | x_t) / dx_t (s: the classifier scale). DDPM moves the step's mean by its
// variance times g (condition_mean); DDIM and DPM-Solver++ move eps by -sqrt(1 - abar) g
// (condition_score, after x0's clipping, not clipped again), which moves x0 by
//   x0' = (x - sqrt(1 - abar) (eps - sqrt(1 - abar) g)) / sqrt(abar) = x0 + (1 - abar) / sqrt(abar) g
HOST_DEVICE static inline float score_guided_x0(float x0, float abar, float score) {
    return x0 + (1.0f - abar) / sqrtf(abar) * score;
}

// DPM-Solver++(2M) (Lu et al. 2022), data prediction, multistep, with lambda = log(alpha/sigma),
// alpha = sqrt(abar), sigma = sqrt(1 - abar), h = lambda_prev - lambda (the step), r = h_last / h:
//   D = x0                                        (first order: the first step, and the last)
//   D = (1 + 1/(2r)) x0 - 1/(2r) x0_last          (second order)
//   x_prev = (sigma_prev / sigma) x - alpha_prev (exp(-h) - 1) D
// The last step goes to abar_prev = 1 (sigma_prev = 0), where x_prev = D.
HOST_DEVICE static inline float dpm_solver_pp_update(float x, float x0, float x0_last, float abar, float abar_prev,
                                                     float r, int second_order) {
    float D = second_order ? (1.0f + 0.5f / r) * x0 - (0.5f / r) * x0_last : x0;
    if (abar_prev >= 1.0f) return D;
    float alpha_prev = sqrtf(abar_prev), sigma = sqrtf(1.0f - abar), sigma_prev = sqrtf(1.0f - abar_prev);
    float h = logf(alpha_prev / sigma_prev) - logf(sqrtf(abar) / sigma);
    return (sigma_prev / sigma) * x - alpha_prev * expm1f(-h) * D;
}

// Euler ancestral (k-diffusion's sample_euler_ancestral): in x_ve = x / sqrt(abar), an Euler step of
// the probability-flow ODE from sigma down to sigma_down, then fresh noise of sigma_up, where
// sigma_up = min(sigma_next, eta sqrt(sigma_next^2 (sigma^2 - sigma_next^2) / sigma^2)) and
// sigma_down^2 + sigma_up^2 = sigma_next^2:
//   x_ve' = x0 + sigma_down (x_ve - x0) / sigma + sigma_up z,   x' = sqrt(abar_prev) x_ve'
// down = sigma_down / sigma and up = sigma_up are the step's; the last step (sigma_next = 0) gives x0.
HOST_DEVICE static inline float euler_ancestral_update(float x, float x0, float abar, float abar_prev, float down, float up, float z) {
    return sqrtf(abar_prev) * (x0 + down * (x / sqrtf(abar) - x0) + up * z);
}

// Heun's method (EDM's Algorithm 2, k-diffusion's sample_heun) on the probability-flow ODE
// dx_ve/dsigma = (x_ve - x0) / sigma, one model call a plan step. Step i from sigma_hat to the next
// level t' is two calls: the predictor at sigma_hat (slope d = (x_ve - x0) / sigma_hat; Euler's
// x_e = x_hat + (t' - sigma_hat) d; the last step's only call) and the corrector at t' on x_e
// (slope d' there), x_ve' = x_hat + (t' - sigma_hat) (d + d') / 2, then, before the next step, its
// churn: noise of `up` = (sigma_hat_next^2 - t'^2)^(1/2) S_noise. Written so that no two terms of
// sigma_hat's size cancel in float (a first sigma of 10^4 has them):
//   predictor:  x_e = x0 + ratio (x_hat - x0),             ratio = t' / sigma_hat
//   corrector:  x_ve' = x_e + (t' - sigma_hat) (d' - d) / 2
// The predictor keeps d in memory for the corrector. x enters and leaves in the variance-preserving
// x of the call's abar and of abar_prev (the next call's): x_ve = x / sqrt(abar).
HOST_DEVICE static inline float heun_update(float x, float x0, float abar, float abar_prev, float sigma, float step, float ratio,
                                            int corrector, float up, float z, float *slope) {
    float x_ve = x / sqrtf(abar), d = (x_ve - x0) / sigma;
    if (!corrector) {
        *slope = d;
        return sqrtf(abar_prev) * (x0 + ratio * (x_ve - x0));
    }
    return sqrtf(abar_prev) * (x_ve + 0.5f * step * (d - *slope) + up * z);
}

// lambda = log(alpha / sigma) of a step (abar < 1).
static inline double log_snr_half(double abar) { return 0.5 * log(abar / (1.0 - abar)); }

// A learned variance (improved DDPM's LEARNED_RANGE): the model's second output half v in [-1, 1]
// interpolates the log variance of the step from abar to abar_prev between the posterior's,
// beta_tilde = (1 - abar_prev) / (1 - abar) beta (log_var_min, clipped at the last step to the next
// step's value, as guided-diffusion's posterior_log_variance_clipped), and beta = 1 - abar/abar_prev:
//   log_var = f log beta + (1 - f) log_var_min = log_var_min + f log_var_range,  f = (v + 1) / 2
// with log_var_range = log beta - log_var_min computed in double: late in a schedule the two logs
// differ in their fourth digit, and their difference in float would keep only that one.
HOST_DEVICE static inline float learned_log_variance(float v, float log_var_min, float log_var_range) {
    return log_var_min + 0.5f * (v + 1.0f) * log_var_range;
}

// Classifier-free guidance on the model's output: uncond + w (cond - uncond); w = 1 is the
// conditional output, w = 0 the unconditional.
HOST_DEVICE static inline float guided_output(float cond, float uncond, float w) { return uncond + w * (cond - uncond); }

// ----------------------------------------------------------------------------------------------
// EDM (Karras et al. 2022, NVlabs/edm's EDMPrecond and EDMLoss): the UNet is a network F inside the
// denoiser D of noise level sigma, sigma_data = s (the images' standard deviation):
//   D(x; sigma) = c_skip x + c_out F(c_in x; c_noise),   x = y + sigma n  (y the image, n ~ N(0, I))
//   c_skip = s^2 / (sigma^2 + s^2), c_out = sigma s / sqrt(sigma^2 + s^2), c_in = 1 / sqrt(sigma^2 + s^2)
//   c_noise = ln(sigma) / 4, F's timestep input
// Training draws ln sigma ~ N(P_mean, P_std^2) and weighs (D - y)^2 by lambda = (sigma^2 + s^2) /
// (sigma s)^2 = 1 / c_out^2, so lambda (D - y)^2 = (F - target)^2 with the target
//   (y - c_skip x) / c_out = (sigma y / s - s n) / sqrt(sigma^2 + s^2)
// and the loss is the MSE of F against it (its mean over the values, as guided-diffusion's losses;
// EDM sums them). edm_training_pair: F's input c_in x and that target for one value.
HOST_DEVICE static inline void edm_training_pair(float y, float n, float sigma, float s, float *input, float *target) {
    float r = 1.0f / sqrtf(sigma * sigma + s * s);
    *input = (y + sigma * n) * r;
    *target = (sigma / s * y - s * n) * r;
}

// ----------------------------------------------------------------------------------------------
// A sampling plan: the steps in the order they run (from the noisiest), each with everything its
// update needs, so that one function updates any value at any step. The GPU loop of train_unet.cu
// (sample grids, generate) replays it; sample_loop below runs it on the host (the tests).
// DDPM is guided-diffusion's p_sample on every kept step: the posterior mean of q(x_prev | x, x0)
// from the predicted x0, plus noise of the posterior's variance (DDIM with eta = 1 is the same step)
// or, with a learned variance, the model's.

typedef enum { SAMPLER_DDPM, SAMPLER_DDIM, SAMPLER_DPM_SOLVER_PP, SAMPLER_EULER_ANCESTRAL, SAMPLER_HEUN } SamplerKind;

typedef struct {
    int timestep;           // the model's t (the original, unrespaced)
    float time;             // the model's timestep input: timestep, or an EDM model's c_noise (edm_call)
    float input_scale;      // the model sees input_scale x: 1, or an EDM model's c_in sqrt(1 + sigma^2)
    float x0_x, x0_out;     // an EDM model's x0 = x0_x x + x0_out out (edm_call)
    float abar, abar_prev;  // from abar to abar_prev (1 after the last step)
    float eta;              // DDIM's and Euler ancestral's noise scale
    int noisy;              // draws z: DDIM and Euler ancestral with eta > 0, but not the last step (sigma is 0 there)
    float down, up;         // Euler ancestral: sigma_down / sigma and sigma_up (euler_ancestral_update);
                            // Heun: down the predictor's ratio t' / sigma_hat, up the corrector's churn
    float sigma, step;      // Heun: the call's sigma and its step's length, t' - sigma_hat (heun_update)
    int corrector;          // Heun: the step's second call
    float r;                // DPM-Solver++: h_last / h
    int second_order;       // DPM-Solver++: all steps but the first and the last
    TimestepTerms terms;    // DDPM: the posterior and the learned range of the step (of the respaced schedule)
    float variance, log_variance;  // DDPM with a fixed variance: the step's (the plan's VarianceType)
} SampleStep;

typedef struct {
    SamplerKind kind;
    int count, predict, clip;
    int learned;        // DDPM draws with the model's variance (its second output half)
    float start_scale;  // the starting noise's: 1 (x_T ~ N(0, I), as guided-diffusion's samplers), or on
                        // Karras levels sqrt(1 - abar) of the first (k-diffusion's sigma_max x_ve;
                        // Heun's: with its first churn, see sample_plan_karras)
    SampleStep *steps;  // [count]
} SamplePlan;

// An EDM model's call at sigma (its sigma_data s) on the sampler's x = x_ve / sqrt(1 + sigma^2), x_ve
// = y + sigma n (the Karras levels' abar = 1 / (1 + sigma^2)): F sees c_in x_ve = input_scale x at
// c_noise, and x0 = D = c_skip x_ve + c_out F = x0_x x + x0_out F (in double, then float).
static inline void edm_call(SampleStep *st, double sigma, double s) {
    double r = sqrt(1 + sigma * sigma), q = sqrt(sigma * sigma + s * s);
    st->timestep = 0, st->time = (float)(log(sigma) / 4);
    st->input_scale = (float)(r / q), st->x0_x = (float)(s * s / (q * q) * r), st->x0_out = (float)(sigma * s / q);
}

// A step's model call: a discrete-time model's at its timestep (its time the timestep, its input x
// itself), or an EDM model's (predict PREDICT_EDM) at sigma (edm_call).
static inline void step_model_call(SampleStep *st, int timestep, double sigma, int predict, double sigma_data) {
    if (predict == PREDICT_EDM) edm_call(st, sigma, sigma_data);
    else st->timestep = timestep, st->time = (float)timestep, st->input_scale = 1.0f;
}

// The plan for a sampler on the steps kept in s (sample_schedule_*): see sample_plan_make; an EDM
// model's (predict PREDICT_EDM) of sigma_data on Karras levels. Returns 0, or -1 without memory;
// frees s either way.
static inline int sample_plan_from_schedule(SamplePlan *p, SampleSchedule *s, SamplerKind kind, float eta, int predict, int clip,
                                            VarianceType variance, double sigma_data) {
    p->kind = kind, p->count = s->count, p->predict = predict, p->clip = clip, p->start_scale = 1.0f;
    p->learned = variance == VARIANCE_LEARNED_RANGE && kind == SAMPLER_DDPM;
    NoiseSchedule respaced = {0, NULL, NULL};
    p->steps = s->count > 0 ? (SampleStep *)calloc((size_t)s->count, sizeof(SampleStep)) : NULL;
    if (!p->steps || noise_schedule_respaced(s, &respaced) != 0) {
        free(p->steps), p->steps = NULL;
        noise_schedule_free(&respaced);
        return sample_schedule_free(s), -1;
    }
    double h_last = 0;
    for (int j = 0; j < s->count; j++) {
        int k = s->count - 1 - j;  // the schedule's index, from the last
        SampleStep *st = &p->steps[j];
        step_model_call(st, s->timesteps[k], sqrt((1 - s->abar[k]) / s->abar[k]), predict, sigma_data);
        st->abar = (float)s->abar[k], st->abar_prev = k > 0 ? (float)s->abar[k - 1] : 1.0f;
        st->eta = kind == SAMPLER_DPM_SOLVER_PP ? 0.0f : eta;
        st->noisy = st->eta > 0.0f && k > 0;
        st->terms = timestep_terms(&respaced, k);
        double log_large = k > 0 ? log(respaced.betas[k]) : (double)st->terms.log_var_min;
        st->log_variance = variance == VARIANCE_FIXED_LARGE ? (float)log_large : st->terms.log_var_min;
        st->variance = variance == VARIANCE_FIXED_LARGE ? (float)exp(log_large) : st->terms.posterior_variance;
        if (kind == SAMPLER_DPM_SOLVER_PP) {
            double h = k > 0 ? log_snr_half(s->abar[k - 1]) - log_snr_half(s->abar[k]) : 0.0;
            st->second_order = j > 0 && k > 0;
            st->r = st->second_order ? (float)(h_last / h) : 1.0f;
            h_last = h;
        }
        if (kind == SAMPLER_EULER_ANCESTRAL) {  // sigma^2 = (1 - abar) / abar, the next 0 after the last step
            double from2 = (1 - s->abar[k]) / s->abar[k], to2 = k > 0 ? (1 - s->abar[k - 1]) / s->abar[k - 1] : 0.0;
            double up = fmin(sqrt(to2), eta * sqrt(to2 * (from2 - to2) / from2));
            st->up = (float)up, st->down = (float)(sqrt(fmax(to2 - up * up, 0.0)) / sqrt(from2));
        }
    }
    noise_schedule_free(&respaced);
    sample_schedule_free(s);
    return 0;
}

// The plan for a sampler on a noise schedule: DDIM and DDPM on guided-diffusion's respacing (the
// spec `respacing`, else "ddimN" for DDIM's `steps` and, for DDPM, section count `steps`, all T
// when steps is 0 or T), DPM-Solver++ on log-SNR spacing. `variance`: DDPM's, the model's own
// (LEARNED_RANGE: its second output half) or a fixed one of the respaced schedule, guided-diffusion's
// model_variance: FIXED_LARGE beta_k (at k = 0 beta_tilde_1, log_var_min's clipped value), FIXED_SMALL
// the posterior's beta_tilde_k (0 at k = 0; its log clipped). Returns 0, or -1 when no spacing gives
// those steps (or without memory).
static inline int sample_plan_make(SamplePlan *p, const NoiseSchedule *d, SamplerKind kind, int steps, const char *respacing,
                                   float eta, int predict, int clip, VarianceType variance) {
    SampleSchedule s = {0, NULL, NULL};
    if (kind == SAMPLER_DDPM) eta = 1.0f;
    if (kind == SAMPLER_DDPM && !(respacing && respacing[0]) && (steps == 0 || steps == d->steps)) steps = d->steps, respacing = NULL;
    char counts[16];
    if (kind == SAMPLER_DDPM && !(respacing && respacing[0]) && steps != d->steps) snprintf(counts, sizeof counts, "%d", steps), respacing = counts;
    int made = kind == SAMPLER_DPM_SOLVER_PP     ? sample_schedule_log_snr(d, steps, &s)
               : respacing && respacing[0] ? sample_schedule_respaced(d, respacing, &s)
                                           : sample_schedule_make(d, steps, &s);
    memset(p, 0, sizeof *p);
    if (made != 0) return sample_schedule_free(&s), -1;
    return sample_plan_from_schedule(p, &s, kind, eta, predict, clip, variance, 0.0);
}

// One of Heun's calls: at sigma (the model's t its nearest, x0 from sqrt(abar) = 1 / sqrt(1 + sigma^2)
// and sqrt(1 - abar) = sigma / sqrt(1 + sigma^2) in double; an EDM model's: edm_call), its x left at
// sigma_next's abar, the step's length `step`.
static inline void heun_call(SampleStep *st, const NoiseSchedule *d, double sigma, double sigma_next, double step, int predict,
                             double sigma_data) {
    step_model_call(st, predict == PREDICT_EDM ? 0 : nearest_timestep(d, sigma), sigma, predict, sigma_data);
    st->sigma = (float)sigma, st->step = (float)step;
    st->abar = (float)(1 / (1 + sigma * sigma)), st->abar_prev = (float)(1 / (1 + sigma_next * sigma_next));
    st->terms.sqrt_abar = (float)(1 / sqrt(1 + sigma * sigma)), st->terms.sqrt_one_minus_abar = (float)(sigma / sqrt(1 + sigma * sigma));
}

// Heun's plan (heun_update) on the Karras levels in s, t_0 > ... > t_(N-1), then 0: step i at
// sigma_hat_i = t_i (1 + gamma_i), gamma_i = min(s_churn / N, sqrt(2) - 1) where s_min <= t_i <= s_max
// (else 0), its predictor and corrector calls (the last step its predictor only: 2N - 1 calls).
// The first step's churn joins the starting noise, x_hat_0 ~ N(0, t_0^2 + S_noise^2 (sigma_hat_0^2 -
// t_0^2)) in x_ve: the distribution of EDM's two draws. Returns 0, or -1 without memory; frees s.
static inline int heun_plan(SamplePlan *p, const NoiseSchedule *d, SampleSchedule *s, KarrasLevels k, int predict, int clip) {
    int N = s->count;
    double *t = (double *)malloc((N + 1) * sizeof(double)), *hat = (double *)malloc(N * sizeof(double));
    p->steps = (SampleStep *)calloc((size_t)2 * N - 1, sizeof(SampleStep));
    if (!t || !hat || !p->steps) return free(t), free(hat), free(p->steps), p->steps = NULL, sample_schedule_free(s), -1;
    for (int i = 0; i < N; i++) t[i] = sqrt((1 - s->abar[N - 1 - i]) / s->abar[N - 1 - i]);
    t[N] = 0;
    for (int i = 0; i < N; i++) hat[i] = t[i] * (1 + (k.s_min <= t[i] && t[i] <= k.s_max ? fmin(k.s_churn / N, sqrt(2.0) - 1) : 0.0));
    p->kind = SAMPLER_HEUN, p->count = 2 * N - 1, p->predict = predict, p->clip = clip, p->learned = 0;
    p->start_scale = (float)(sqrt(t[0] * t[0] + k.s_noise * k.s_noise * (hat[0] * hat[0] - t[0] * t[0])) / sqrt(1 + hat[0] * hat[0]));
    SampleStep *st = p->steps;
    for (int i = 0; i < N; i++) {
        heun_call(st, d, hat[i], t[i + 1], t[i + 1] - hat[i], predict, k.sigma_data);  // the predictor
        st->down = (float)(t[i + 1] / hat[i]);
        st++;
        if (i == N - 1) break;
        heun_call(st, d, t[i + 1], hat[i + 1], t[i + 1] - hat[i], predict, k.sigma_data);  // the corrector
        st->corrector = 1, st->up = (float)(sqrt(hat[i + 1] * hat[i + 1] - t[i + 1] * t[i + 1]) * k.s_noise), st->noisy = st->up > 0;
        st++;
    }
    free(t), free(hat);
    sample_schedule_free(s);
    return 0;
}

// The plan of DDIM (eta 0: k-diffusion's sample_euler), DPM-Solver++(2M) (sample_dpmpp_2m), Euler
// ancestral (sample_euler_ancestral, eta 1 by default) or Heun (sample_heun, EDM's sampler:
// heun_plan) on `steps` Karras levels (sample_schedule_karras), from noise of sigma_max. A learned
// variance's second half is not used; an EDM model's plan (predict PREDICT_EDM) needs levels.sigma_data.
// Returns 0, or -1 for levels sample_schedule_karras refuses (or without memory).
static inline int sample_plan_karras(SamplePlan *p, const NoiseSchedule *d, SamplerKind kind, int steps, KarrasLevels levels, float eta,
                                     int predict, int clip) {
    SampleSchedule s = {0, NULL, NULL};
    memset(p, 0, sizeof *p);
    if (kind == SAMPLER_DDPM || (predict == PREDICT_EDM) != (levels.sigma_data > 0) || sample_schedule_karras(d, steps, levels, &s) != 0)
        return sample_schedule_free(&s), -1;
    if (kind == SAMPLER_HEUN) return heun_plan(p, d, &s, levels, predict, clip);
    double first = s.abar[s.count - 1];
    if (sample_plan_from_schedule(p, &s, kind, eta, predict, clip, VARIANCE_FIXED_SMALL, levels.sigma_data) != 0) return -1;
    p->start_scale = (float)sqrt(1 - first);
    return 0;
}

static inline void sample_plan_free(SamplePlan *p) {
    free(p->steps);
    memset(p, 0, sizeof *p);
}

// What a value's update keeps for the next step: DPM-Solver++'s previous x0; Heun's predictor's
// slope (heun_update).
typedef struct {
    float x0_last, slope;
} SampleMemory;

// One value's update at one step of a plan: x from the model's output (after classifier-free
// guidance) and, with a learned variance, the output's variance half v; score: classifier guidance's
// g (0: none; see score_guided_x0); z the value's normal draw (when st->noisy); memory: the value's,
// updated.
HOST_DEVICE static inline float sample_step_value(const SamplePlan *p, const SampleStep *st, float x, float out, float v, float score,
                                                  float z, SampleMemory *memory) {
    int edm = p->predict == PREDICT_EDM;
    float x0 = predict_x0_ab(x, out, edm ? st->x0_x : st->terms.sqrt_abar, edm ? st->x0_out : st->terms.sqrt_one_minus_abar, p->predict,
                             p->clip);
    if (p->kind == SAMPLER_DDPM) {
        const TimestepTerms *tt = &st->terms;
        float log_var = p->learned ? learned_log_variance(v, tt->log_var_min, tt->log_var_range) : st->log_variance;
        float variance = p->learned ? expf(log_var) : st->variance;
        float mean = tt->mean_x0 * x0 + tt->mean_xt * x + variance * score;
        return st->noisy ? mean + expf(0.5f * log_var) * z : mean;
    }
    x0 = score_guided_x0(x0, st->abar, score);
    if (p->kind == SAMPLER_EULER_ANCESTRAL) return euler_ancestral_update(x, x0, st->abar, st->abar_prev, st->down, st->up, z);
    if (p->kind == SAMPLER_HEUN)
        return heun_update(x, x0, st->abar, st->abar_prev, st->sigma, st->step, st->down, st->corrector, st->up, z, &memory->slope);
    if (p->kind != SAMPLER_DPM_SOLVER_PP) return ddim_from_x0(x, x0, st->abar, st->abar_prev, st->eta, z);
    float next = dpm_solver_pp_update(x, x0, memory->x0_last, st->abar, st->abar_prev, st->r, st->second_order);
    memory->x0_last = x0;
    return next;
}

// A sample's value x as an 8-bit pixel the way guided-diffusion's scripts write samples,
// ((x + 1) * 127.5).clamp(0, 255).to(uint8): truncated, not rounded, so that FIDs of our samples
// compare with its published ones (x in [k / 127.5 - 1, (k + 1) / 127.5 - 1) gives k; 255 only from
// x = 1 on). NaN gives 0.
HOST_DEVICE static inline uint8_t pixel_from_value(float x) { return (uint8_t)fminf(fmaxf((x + 1.0f) * 127.5f, 0.0f), 255.0f); }

// A standard normal draw for value i of stream `stream` under `seed` (Box-Muller on two 24-bit
// uniforms), on the host and the GPU alike (to the last bits of cos and log).
HOST_DEVICE static inline float normal_sample(uint64_t seed, uint64_t stream, uint64_t i) {
    float u1 = ((random_u64(seed, stream, 2 * i) >> 40) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = (random_u64(seed, stream, 2 * i + 1) >> 40) * (1.0f / 16777216.0f);
#ifdef __CUDA_ARCH__
    return sqrtf(-2.0f * logf(u1)) * cospif(2.0f * u2);
#else
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
#endif
}

// The plan on the host, for any model: x holds n values of unit starting noise (scaled here by the
// plan's start_scale) and is replaced by the samples. model(ctx, x, st, out) writes the model's
// output for x at step st (its input st->input_scale x, its timestep input st->time; classifier-free
// guidance, if any, inside it): n values, and with a learned variance n more, the variance half
// (value i's at n + i); `scored`: then n more, classifier guidance's score g of each value (see
// score_guided_x0). noise(ctx, j, i) draws z for value i at step j of the plan.
typedef void (*SamplerModel)(void *ctx, const float *x, const SampleStep *st, float *out);
typedef float (*SamplerNoise)(void *ctx, int j, size_t i);

// Returns 0, or -1 without memory.
static inline int sample_loop(const SamplePlan *p, SamplerModel model, int scored, SamplerNoise noise, void *ctx, float *x, size_t n) {
    const float *v = NULL, *score = NULL;
    float *out = (float *)malloc((1 + (p->learned != 0) + (scored != 0)) * n * sizeof(float));
    SampleMemory *memory = (SampleMemory *)calloc(n, sizeof(SampleMemory));
    if (!out || !memory) return free(out), free(memory), -1;
    if (p->learned) v = out + n;
    if (scored) score = out + (p->learned ? 2 : 1) * n;
    for (size_t i = 0; i < n; i++) x[i] *= p->start_scale;
    for (int j = 0; j < p->count; j++) {
        const SampleStep *st = &p->steps[j];
        model(ctx, x, st, out);
        for (size_t i = 0; i < n; i++)
            x[i] = sample_step_value(p, st, x[i], out[i], v ? v[i] : 0.0f, score ? score[i] : 0.0f, st->noisy ? noise(ctx, j, i) : 0.0f,
                                     &memory[i]);
    }
    free(out);
    free(memory);
    return 0;
}

#endif  // SAMPLER_H
