// test_sampler_fixture.cu: sampler.h against the reference of scripts/make_sampler_fixture.py
// (guided-diffusion's formulas in float64: beta schedules, space_timesteps, p_sample's posterior,
// ddim_sample, and DPM-Solver++(2M)'s official second-order update), and the learned variance
// (train_unet.cu's bound_term, sampler.h's respacing and learned DDPM step) against
// scripts/make_diffusion_fixture.py's (PyTorch, float64, gradients by autograd), and the schedule
// sampler's distribution of t (train_unet.cu's LossHistory) against its LossSecondMomentResampler,
// on the fixtures' random cases; and the samplers on Karras levels run whole against k-diffusion's
// (scripts/make_karras_fixture.py). Each step is computed in float, so the tolerance is 1e-5 relative per case.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

static SafeTensorsFile fixture, learned;

static double *tensor_of(const SafeTensorsFile *file, const char *name, int64_t *numel) {
    const SafeTensor *t = safetensors_find(file, name);
    if (!t) fatal("sampler fixture: no tensor %s", name);
    double *out = (double *)malloc_or_die(t->numel * sizeof(double));
    if (strcmp(t->dtype, "F64") == 0) memcpy(out, t->data, t->numel * sizeof(double));
    else if (strcmp(t->dtype, "I64") == 0) for (int64_t i = 0; i < t->numel; i++) out[i] = (double)((const int64_t *)t->data)[i];
    else if (strcmp(t->dtype, "F32") == 0) for (int64_t i = 0; i < t->numel; i++) out[i] = ((const float *)t->data)[i];
    else fatal("sampler fixture: %s is %s", name, t->dtype);
    if (numel) *numel = t->numel;
    return out;
}

static double *tensor(const char *name, int64_t *numel) { return tensor_of(&fixture, name, numel); }

// ||got - want|| / ||want|| over n values (0 when both are zero).
static double relative_error(const float *got, const double *want, int n) {
    double diff = 0, norm = 0;
    for (int i = 0; i < n; i++) diff += (got[i] - want[i]) * (got[i] - want[i]), norm += want[i] * want[i];
    return diff == 0 ? 0 : sqrt(diff / norm);
}

// The bound's term (value, d_out, d_v) of every case; returns the worst relative error of the three.
static double check_bound_terms(const NoiseSchedule *schedules) {
    int64_t rows_numel = 0, values_numel = 0;
    double *cases = tensor_of(&learned, "bound_cases", &rows_numel), *values = tensor_of(&learned, "bound_values", &values_numel);
    double *expected = tensor_of(&learned, "bound_expected", NULL);
    int rows = (int)(rows_numel / 3), n = (int)(values_numel / rows / 4);
    float *got = (float *)malloc_or_die(3 * n * sizeof(float));
    double worst[3] = {0, 0, 0};
    for (int r = 0; r < rows; r++) {
        const double *c = cases + 3 * r, *x = values + (size_t)r * 4 * n, *want = expected + (size_t)r * 3 * n;
        int t = (int)c[1];
        TimestepTerms tt = timestep_terms(&schedules[(int)c[0]], t);
        for (int i = 0; i < n; i++) {
            BoundTerm b = bound_term((float)x[i], (float)x[n + i], (float)x[2 * n + i], (float)x[3 * n + i], &tt, t == 0, (int)c[2], 0);
            got[i] = b.value, got[n + i] = b.d_out, got[2 * n + i] = b.d_v;
        }
        for (int k = 0; k < 3; k++) worst[k] = fmax(worst[k], relative_error(got + k * n, want + k * n, n));
    }
    printf("  %d cases (t = 0 in every fourth): worst relative error: value %.2e, d_out %.2e, d_v %.2e\n", rows, worst[0], worst[1],
           worst[2]);
    free(cases), free(values), free(expected), free(got);
    return fmax(worst[0], fmax(worst[1], worst[2]));
}

// The schedule sampler's distribution of t after each of the fixture's prefixes of (t, loss) on 8
// timesteps; returns the worst relative error, and in *weighted how many were past the uniform start.
static double check_loss_history(int *weighted, int *prefixes) {
    int64_t numel = 0, count = 0;
    double *losses = tensor_of(&learned, "resampler_losses", &numel), *after = tensor_of(&learned, "resampler_after", &count);
    double *want = tensor_of(&learned, "resampler_p", NULL);
    enum { T = 8 };
    LossHistory h;
    loss_history_create(&h, T);
    double p[2 * T], worst = 0;
    int j = 0;
    *weighted = 0, *prefixes = (int)count;
    for (int i = 0; i < numel / 2; i++) {
        loss_history_add(&h, (int)losses[2 * i], (float)losses[2 * i + 1]);
        if (j >= count || i + 1 != (int)after[j]) continue;
        if (loss_history_distribution(&h, p)) ++*weighted;
        else
            for (int t = 0; t < T; t++) p[t] = 1.0 / T;
        double diff = 0, norm = 0;
        for (int t = 0; t < T; t++) diff += (p[t] - want[j * T + t]) * (p[t] - want[j * T + t]), norm += want[j * T + t] * want[j * T + t];
        worst = fmax(worst, sqrt(diff / norm));
        j++;
    }
    printf("  %d losses on %d timesteps, the distribution after %d prefixes (%d past the uniform start): worst relative error %.2e\n",
           (int)(numel / 2), T, (int)count, *weighted, worst);
    free(losses), free(after), free(want), free(h.counts), free(h.losses);
    return worst;
}

// p_sample with the learned range on a respaced schedule; returns the worst relative error.
static double check_learned_ddpm(const NoiseSchedule *schedules, const char *const *specs) {
    int64_t rows_numel = 0, values_numel = 0;
    double *cases = tensor_of(&learned, "learned_ddpm_cases", &rows_numel);
    double *values = tensor_of(&learned, "learned_ddpm_values", &values_numel);
    double *expected = tensor_of(&learned, "learned_ddpm_expected", NULL);
    int rows = (int)(rows_numel / 5), n = (int)(values_numel / rows / 4);
    float *got = (float *)malloc_or_die(n * sizeof(float));
    double worst = 0;
    SampleMemory unused = {0, 0};  // (DDPM keeps none)
    for (int r = 0; r < rows; r++) {
        const double *c = cases + 5 * r, *x = values + (size_t)r * 4 * n;
        SamplePlan plan;
        CHECK(sample_plan_make(&plan, &schedules[(int)c[0]], SAMPLER_DDPM, 0, specs[(int)c[1]], 1.0f, (int)c[3], (int)c[4], VARIANCE_LEARNED_RANGE) == 0);
        const SampleStep *st = &plan.steps[plan.count - 1 - (int)c[2]];  // kept step k runs at j = count - 1 - k
        for (int i = 0; i < n; i++) got[i] = sample_step_value(&plan, st, (float)x[i], (float)x[n + i], (float)x[2 * n + i], 0.0f, (float)x[3 * n + i], &unused);
        worst = fmax(worst, relative_error(got, expected + (size_t)r * n, n));
        sample_plan_free(&plan);
    }
    printf("  %d cases: worst relative error %.2e\n", rows, worst);
    free(cases), free(values), free(expected), free(got);
    return worst;
}

// A kind's tensor of the steps fixture: KIND_PART (cases, values, expected).
static double *kind_tensor(const char *kind, const char *part, int64_t *numel) {
    char name[64];
    snprintf(name, sizeof name, "%s_%s", kind, part);
    return tensor(name, numel);
}

// The Karras fixture's toy model: out = tanh(w[t] x + b[t]) per value, or as an EDM model's F
// (edm) tanh(EDM_W x_in + EDM_B c_noise) of its input x_in = input_scale x at its time c_noise;
// and its draws per step.
#define EDM_W 0.9f
#define EDM_B 0.3f
typedef struct {
    const double *w, *b, *noise;  // noise: [steps][n] of the case
    int n, heun;                  // heun: call j's draw is step (j + 1) / 2's (its corrector churns the next step)
    int edm;
} ToyModel;

static void toy_model(void *ctx, const float *x, const SampleStep *st, float *out) {
    const ToyModel *m = (const ToyModel *)ctx;
    int t = st->timestep;
    for (int i = 0; i < m->n; i++)
        out[i] = m->edm ? tanhf(EDM_W * (st->input_scale * x[i]) + EDM_B * st->time) : tanhf((float)m->w[t] * x[i] + (float)m->b[t]);
}

static float toy_noise(void *ctx, int j, size_t i) {
    const ToyModel *m = (const ToyModel *)ctx;
    return (float)m->noise[(size_t)(m->heun ? (j + 1) / 2 : j) * m->n + i];
}

// sample_plan_karras's plans run whole (sample_loop) on the toy model, against k-diffusion's
// sample_euler, sample_euler_ancestral, sample_dpmpp_2m and sample_heun (with churn) on the same
// model, starting noise and draws (scripts/make_karras_fixture.py), the discrete models' and the
// EDM model's (NVlabs/edm's EDMPrecond): every call's t must be theirs; returns the worst relative
// error of the final x. Then EDM's training pair (edm_training_pair) against EDMLoss: F's input,
// and the MSE of F against the target equal to EDM's weighted loss.
static double check_karras(const NoiseSchedule *schedules) {
    SafeTensorsFile karras;
    char err[512];
    if (safetensors_open("dev/fixtures/samplers/karras.safetensors", &karras, err, sizeof err) != 0) fatal("%s", err);
    int64_t rows_numel = 0, start_numel = 0, steps_numel = 0;
    double *cases = tensor_of(&karras, "cases", &rows_numel), *start = tensor_of(&karras, "start", &start_numel);
    double *noise = tensor_of(&karras, "noise", NULL), *expected = tensor_of(&karras, "expected", NULL);
    double *timesteps = tensor_of(&karras, "timesteps", &steps_numel);
    ToyModel toy = {tensor_of(&karras, "model_w", NULL), tensor_of(&karras, "model_b", NULL), NULL, 0, 0, 0};
    int rows = (int)(rows_numel / 12), n = (int)(start_numel / rows), max_calls = (int)(steps_numel / rows), max_steps = max_calls / 2;
    const SamplerKind kinds[4] = {SAMPLER_DDIM, SAMPLER_EULER_ANCESTRAL, SAMPLER_DPM_SOLVER_PP, SAMPLER_HEUN};
    const char *names[4] = {"euler (ddim)", "euler_ancestral", "dpmpp_2m", "heun"};
    double worst[4] = {0, 0, 0, 0}, worst_edm = 0;
    float *x = (float *)malloc_or_die(n * sizeof(float));
    toy.n = n;
    for (int r = 0; r < rows; r++) {
        const double *c = cases + 12 * r;
        int kind = (int)c[2], steps = (int)c[3], calls = kind == 3 ? 2 * steps - 1 : steps, edm = (int)c[0] == 2;
        KarrasLevels levels = {c[4], c[5], c[6], c[7], c[8], c[9], c[10], c[11]};
        SamplePlan plan;
        CHECK(sample_plan_karras(&plan, &schedules[edm ? 0 : (int)c[0]], kinds[kind], steps, levels, kind == 1 ? 1.0f : 0.0f,
                                 edm ? PREDICT_EDM : (int)c[1] ? PREDICT_V : PREDICT_EPS, 0) == 0 && plan.count == calls);
        for (int j = 0; j < plan.count; j++) CHECK(plan.steps[j].timestep == (int)timesteps[(size_t)r * max_calls + j]);
        for (int i = 0; i < n; i++) x[i] = (float)start[(size_t)r * n + i];
        toy.noise = noise + (size_t)r * max_steps * n, toy.heun = kind == 3, toy.edm = edm;
        CHECK(sample_loop(&plan, toy_model, 0, toy_noise, &toy, x, n) == 0);
        double e = relative_error(x, expected + (size_t)r * n, n);
        if (edm) worst_edm = fmax(worst_edm, e);
        else worst[kind] = fmax(worst[kind], e);
        sample_plan_free(&plan);
    }
    for (int k = 0; k < 4; k++) printf("  %s: worst relative error of the final x %.2e\n", names[k], worst[k]);
    printf("  the EDM model, every sampler: worst relative error of the final x %.2e\n", worst_edm);
    // EDM's training pair: rows (y, n, sigma, sigma_data, f, EDM's c_in (y + sigma n), weight (D - y)^2)
    int64_t loss_numel = 0;
    double *losses = tensor_of(&karras, "edm_loss", &loss_numel), worst_input = 0, worst_loss = 0;
    for (int64_t i = 0; i < loss_numel / 7; i++) {
        const double *l = losses + 7 * i;
        float input, target;
        edm_training_pair((float)l[0], (float)l[1], (float)l[2], (float)l[3], &input, &target);
        double loss = ((float)l[4] - (double)target) * ((float)l[4] - (double)target);
        worst_input = fmax(worst_input, fabs(input - l[5]) / fmax(fabs(l[5]), 1e-3));
        worst_loss = fmax(worst_loss, fabs(loss - l[6]) / fmax(l[6], 1e-3));
    }
    printf("  EDM's training pair, %lld values: F's input within %.2e, the loss within %.2e of EDMLoss's\n", (long long)(loss_numel / 7),
           worst_input, worst_loss);
    CHECK(loss_numel == 64 * 7 && worst_input < 1e-5 && worst_loss < 1e-5);
    free(cases), free(start), free(noise), free(expected), free(timesteps), free((void *)toy.w), free((void *)toy.b), free(x), free(losses);
    safetensors_close(&karras);
    return fmax(fmax(fmax(worst[0], worst[1]), fmax(worst[2], worst[3])), worst_edm);
}

// Runs every case of one kind (ddpm, ddim, dpm) and returns the worst relative error.
static double run_cases(const char *kind, const NoiseSchedule *schedules) {
    int64_t rows_numel = 0, values_numel = 0;
    double *cases = kind_tensor(kind, "cases", &rows_numel), *values = kind_tensor(kind, "values", &values_numel);
    double *expected = kind_tensor(kind, "expected", NULL);
    int rows = (int)(rows_numel / 6), n = (int)(values_numel / rows / 3);
    double worst = 0;
    for (int r = 0; r < rows; r++) {
        const double *c = cases + 6 * r, *x = values + (size_t)r * 3 * n, *out = x + n, *z = x + 2 * n, *want = expected + (size_t)r * n;
        const double *abar = schedules[(int)c[0]].alphas_cumprod;
        float at = (float)abar[(int)c[1]], aprev = c[2] < 0 ? 1.0f : (float)abar[(int)c[2]];
        double diff = 0, norm = 0;
        for (int i = 0; i < n; i++) {
            float got = strcmp(kind, "dpm") == 0
                            ? dpm_solver_pp_update((float)x[i], (float)out[i], (float)z[i], at, aprev, (float)c[3], (int)c[4])
                            : ddim_update((float)x[i], (float)out[i], at, aprev, (float)c[3], (float)z[i], (int)c[4], (int)c[5]);
            diff += (got - want[i]) * (got - want[i]), norm += want[i] * want[i];
        }
        double e = sqrt(diff / norm);
        if (!(e <= worst)) worst = e;
    }
    free(cases), free(values), free(expected);
    printf("  %s: %d cases, worst relative error %.2e\n", kind, rows, worst);
    return worst;
}

// Classifier guidance's cases (guided_ddpm: p_sample with condition_mean on all 1000 steps, the
// fixed or the learned variance; guided_ddim: ddim_sample with condition_score, respaced): each
// through sample_step_value with the score g. Returns the worst relative error.
static double run_guided_cases(const char *kind, const NoiseSchedule *schedules) {
    int64_t rows_numel = 0, values_numel = 0;
    double *cases = kind_tensor(kind, "cases", &rows_numel), *values = kind_tensor(kind, "values", &values_numel);
    double *expected = kind_tensor(kind, "expected", NULL);
    int rows = (int)(rows_numel / 6), n = (int)(values_numel / rows / 5), ddpm = strcmp(kind, "guided_ddpm") == 0;
    float *got = (float *)malloc_or_die(n * sizeof(float));
    double worst = 0, moved = INFINITY;  // moved: the smallest share of a case's result that g accounts for (t > 0)
    SampleMemory unused = {0, 0};  // (DDPM and DDIM keep none)
    for (int r = 0; r < rows; r++) {
        const double *c = cases + 6 * r, *x = values + (size_t)r * 5 * n, *out = x + n, *v = x + 2 * n, *z = x + 3 * n, *g = x + 4 * n;
        const NoiseSchedule *d = &schedules[(int)c[0]];
        SamplePlan plan;
        SampleStep own, *st = &own;
        if (ddpm) {
            CHECK(sample_plan_make(&plan, d, SAMPLER_DDPM, 0, NULL, 1.0f, (int)c[3] ? PREDICT_V : PREDICT_EPS, (int)c[4],
                                  (int)c[2] ? VARIANCE_LEARNED_RANGE : VARIANCE_FIXED_SMALL) == 0);
            st = &plan.steps[plan.count - 1 - (int)c[1]];
        } else {
            memset(&own, 0, sizeof own);
            own.abar = (float)d->alphas_cumprod[(int)c[1]], own.abar_prev = c[2] < 0 ? 1.0f : (float)d->alphas_cumprod[(int)c[2]];
            own.terms = timestep_terms(d, (int)c[1]);  // (its a and b: x0's)
            own.eta = (float)c[3], own.noisy = c[3] > 0 && c[2] >= 0;
            plan.kind = SAMPLER_DDIM, plan.count = 1, plan.predict = (int)c[4] ? PREDICT_V : PREDICT_EPS, plan.clip = (int)c[5];
            plan.learned = 0, plan.steps = NULL;
        }
        double diff = 0, norm = 0, shift = 0;
        for (int i = 0; i < n; i++) {
            got[i] = sample_step_value(&plan, st, (float)x[i], (float)out[i], (float)v[i], (float)g[i], st->noisy ? (float)z[i] : 0.0f, &unused);
            float unguided = sample_step_value(&plan, st, (float)x[i], (float)out[i], (float)v[i], 0.0f, st->noisy ? (float)z[i] : 0.0f, &unused);
            double want = expected[(size_t)r * n + i];
            diff += (got[i] - want) * (got[i] - want), norm += want * want, shift += (got[i] - unguided) * (got[i] - unguided);
        }
        worst = fmax(worst, sqrt(diff / norm));
        if ((int)c[1] > 0 || (ddpm && (int)c[2])) moved = fmin(moved, sqrt(shift / norm));  // (t = 0: a vanishing variance or 1 - abar)
        if (ddpm) sample_plan_free(&plan);
    }
    printf("  %s: %d cases, worst relative error %.2e; the score moves each result by %.1e of its norm or more\n", kind, rows, worst, moved);
    CHECK(moved > 1e-4);  // the guidance is seen: the check would fail without it
    free(cases), free(values), free(expected), free(got);
    return worst;
}

int main(void) {
    char err[512];
    if (safetensors_open("dev/fixtures/samplers/steps.safetensors", &fixture, err, sizeof err) != 0) fatal("%s", err);

    check_case("schedules: betas and alphas_cumprod equal guided-diffusion's (linear, cosine; T 1000 and 50)");
    const char *names[2] = {"linear", "cosine"};
    int Ts[2] = {1000, 50};
    double worst = 0;
    for (int s = 0; s < 2; s++)
        for (int k = 0; k < 2; k++) {
            NoiseSchedule d;
            CHECK(noise_schedule_make(&d, Ts[k], names[s]) == 0);
            char name[64];
            snprintf(name, sizeof name, "betas_%s_%d", names[s], Ts[k]);
            double *b = tensor(name, NULL);
            snprintf(name, sizeof name, "alphas_cumprod_%s_%d", names[s], Ts[k]);
            double *a = tensor(name, NULL);
            for (int t = 0; t < Ts[k]; t++)
                worst = fmax(worst, fmax(fabs(d.betas[t] - b[t]) / b[t], fabs(d.alphas_cumprod[t] - a[t]) / a[t]));
            free(a), free(b);
            noise_schedule_free(&d);
        }
    printf("  worst relative difference %.1e\n", worst);
    CHECK(worst < 1e-12);

    check_case("respacing: space_timesteps(1000, ddim50 / ddim7 / ddim1000)");
    NoiseSchedule linear;
    CHECK(noise_schedule_make(&linear, 1000, "linear") == 0);
    int counts[3] = {50, 7, 1000};
    for (int k = 0; k < 3; k++) {
        char name[32];
        snprintf(name, sizeof name, "ddim%d", counts[k]);
        int64_t numel = 0;
        double *want = tensor(name, &numel);
        SampleSchedule s = {0, NULL, NULL};
        CHECK(sample_schedule_make(&linear, counts[k], &s) == 0 && s.count == numel);
        for (int i = 0; i < s.count && i < numel; i++) CHECK(s.timesteps[i] == (int)want[i]);
        free(want);
        sample_schedule_free(&s);
    }

    NoiseSchedule schedules[2];
    CHECK(noise_schedule_make(&schedules[0], 1000, "linear") == 0 && noise_schedule_make(&schedules[1], 1000, "cosine") == 0);
    check_case("DDPM (DDIM with eta 1 on consecutive steps) equals guided-diffusion's p_sample posterior");
    CHECK(run_cases("ddpm", schedules) <= 1e-5);
    check_case("DDIM (eta 0, 0.5, 1; respaced; down to clean) equals guided-diffusion's ddim_sample");
    CHECK(run_cases("ddim", schedules) <= 1e-5);
    check_case("DPM-Solver++(2M) step equals the official multistep update (first and second order)");
    CHECK(run_cases("dpm", schedules) <= 1e-5);
    check_case("Karras levels: euler (ddim), euler_ancestral, dpmpp_2m and heun (churn too) run whole equal k-diffusion's on the same model "
               "and noise, discrete-time and EDM's (EDMPrecond); EDM's training pair equals EDMLoss");
    CHECK(check_karras(schedules) <= 1e-5);
    {  // levels it refuses: no steps, rho not positive, sigma_min not below sigma_max; DDPM
        SamplePlan none;
        KarrasLevels own = {0, 0, 7, 0, 0, 0, 1}, crossed = {2.0, 1.0, 7, 0, 0, 0, 1}, flat = {0, 0, 0, 0, 0, 0, 1};
        CHECK(sample_plan_karras(&none, &schedules[0], SAMPLER_DPM_SOLVER_PP, 0, own, 0.0f, PREDICT_EPS, 0) != 0 && !none.steps);
        CHECK(sample_plan_karras(&none, &schedules[0], SAMPLER_DPM_SOLVER_PP, 10, crossed, 0.0f, PREDICT_EPS, 0) != 0);
        CHECK(sample_plan_karras(&none, &schedules[0], SAMPLER_DPM_SOLVER_PP, 10, flat, 0.0f, PREDICT_EPS, 0) != 0);
        CHECK(sample_plan_karras(&none, &schedules[0], SAMPLER_DDPM, 10, own, 0.0f, PREDICT_EPS, 0) != 0);
    }
    check_case("classifier guidance in DDPM (fixed and learned variance, t = 0 too) equals p_sample with condition_mean");
    CHECK(run_guided_cases("guided_ddpm", schedules) <= 1e-5);
    check_case("classifier guidance in DDIM (eta 0, 0.5, 1; respaced; down to clean) equals ddim_sample with condition_score");
    CHECK(run_guided_cases("guided_ddim", schedules) <= 1e-5);

    if (safetensors_open("dev/fixtures/diffusion/learned.safetensors", &learned, err, sizeof err) != 0) fatal("%s", err);
    const char *specs_text = safetensors_metadata(&learned, "specs");
    char specs_copy[256];
    const char *specs[16];
    int num_specs = 0;
    snprintf(specs_copy, sizeof specs_copy, "%s", specs_text ? specs_text : "");
    for (char *p = strtok(specs_copy, ";"); p && num_specs < 16; p = strtok(NULL, ";")) specs[num_specs++] = p;
    check_case("respacing: space_timesteps(1000, spec) for section counts and ddimN");
    CHECK(num_specs == 6);
    for (int k = 0; k < num_specs; k++) {
        char name[32];
        snprintf(name, sizeof name, "respacing_%d", k);
        int64_t numel = 0;
        double *want = tensor_of(&learned, name, &numel);
        SampleSchedule s = {0, NULL, NULL};
        CHECK(sample_schedule_respaced(&linear, specs[k], &s) == 0 && s.count == numel);
        for (int i = 0; i < s.count && i < numel; i++) CHECK(s.timesteps[i] == (int)want[i]);
        printf("  %s: %d steps\n", specs[k], s.count);
        free(want);
        sample_schedule_free(&s);
    }
    const char *bad_specs[] = {"0", "600,600", "ddim999", "ddim", "10,", ",10", "x", "", "5x", "-3"};
    for (size_t k = 0; k < sizeof bad_specs / sizeof bad_specs[0]; k++) {
        SampleSchedule none = {0, NULL, NULL};
        CHECK(sample_schedule_respaced(&linear, bad_specs[k], &none) != 0);
        sample_schedule_free(&none);
    }
    check_case("the variational bound's term and its gradients (KL at t > 0, the decoder at t = 0) equal guided-diffusion's");
    CHECK(check_bound_terms(schedules) <= 1e-5);
    check_case("DDPM with a learned variance on respaced steps equals guided-diffusion's p_sample (LEARNED_RANGE)");
    CHECK(check_learned_ddpm(schedules, specs) <= 1e-5);
    check_case("the schedule sampler loss-second-moment: uniform until every t has 10 losses, then guided-diffusion's p_t");
    int weighted = 0, prefixes = 0;
    CHECK(check_loss_history(&weighted, &prefixes) <= 1e-12);
    CHECK(weighted > 0 && weighted < prefixes);  // both regimes seen

    noise_schedule_free(&schedules[0]), noise_schedule_free(&schedules[1]), noise_schedule_free(&linear);
    safetensors_close(&fixture), safetensors_close(&learned);
    return check_summary();
}
