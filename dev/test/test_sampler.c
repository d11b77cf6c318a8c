// test_sampler.c: the diffusion math of sampler.h (shared by train_unet.cu and generate.c) on the
// CPU: guided-diffusion's schedules and respacing, and every sampler driven by the optimal
// denoiser of Gaussian data. For x0 ~ N(mu, s^2) per value, x_t ~ N(sqrt(abar) mu, v),
// v = abar s^2 + 1 - abar, and
//   E[eps | x_t] = sqrt(1 - abar) (x_t - sqrt(abar) mu) / v
//   E[x0 | x_t]  = mu + sqrt(abar) s^2 (x_t - sqrt(abar) mu) / v
// Every step is then affine in x_t, so the mean and deviation a discrete DDIM must produce follow
// exactly from a recursion (few steps shrink the deviation a little; all 1000 land on mu and s):
// its samples must match the recursion within 5 standard errors. DPM-Solver++ with 20 steps (on
// log-SNR spacing) must land within 0.01 of mu and s.
#include <stdint.h>
#include <stdio.h>
#include <time.h>

#include <stb_image.h>

#include "dev/test/check.h"
#include "png.h"
#include "sampler.h"

static const double MU = 0.3, SIGMA = 0.4;

typedef struct {
    const NoiseSchedule *d;
    int predict_v;
    uint64_t seed;
    size_t calls;
} Analytic;

static double gaussian(uint64_t seed, uint64_t stream, uint64_t i) {
    double u1 = ((random_u64(seed, stream, 2 * i) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = (random_u64(seed, stream, 2 * i + 1) >> 11) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

// The optimal model at timestep t: eps, or v = sqrt(abar) eps - sqrt(1 - abar) x0.
static void analytic_model(void *ctx, const float *x, const SampleStep *st, float *out) {
    Analytic *a = (Analytic *)ctx;
    int t = st->timestep;
    double abar = a->d->alphas_cumprod[t];
    a->calls++;
    for (size_t i = 0; i < 40000; i++) {
        double var = abar * SIGMA * SIGMA + 1 - abar, r = (x[i] - sqrt(abar) * MU) / var;
        double eps = sqrt(1 - abar) * r, x0 = MU + sqrt(abar) * SIGMA * SIGMA * r;
        out[i] = (float)(a->predict_v ? sqrt(abar) * eps - sqrt(1 - abar) * x0 : eps);
    }
}

static float analytic_noise(void *ctx, int j, size_t i) { return (float)gaussian(((Analytic *)ctx)->seed, 100 + j, i); }

// The mean and deviation DDIM (any eta) must give, by the recursion of the header comment.
static void ddim_expected(const SampleSchedule *s, float eta, double *mean, double *sd) {
    double m = 0, var = 1;
    for (int k = s->count - 1; k >= 0; k--) {
        double at = s->abar[k], as = k > 0 ? s->abar[k - 1] : 1.0, vt = at * SIGMA * SIGMA + 1 - at;
        double sig = eta * sqrt((1 - as) / (1 - at)) * sqrt(fmax(1 - at / as, 0));
        double c = (sqrt(as * at) * SIGMA * SIGMA + sqrt(fmax(1 - as - sig * sig, 0)) * sqrt(1 - at)) / vt;
        m = sqrt(as) * MU + c * (m - sqrt(at) * MU);
        var = c * c * var + sig * sig;
    }
    *mean = m, *sd = sqrt(var);
}

// Samples 40000 values and checks their mean and deviation: against the DDIM recursion (exact),
// and/or against the data (mu, s) within `tolerance` (a solver's own error).
static void check_sampler(const char *name, SamplerKind kind, const char *schedule, int steps, float eta, int predict_v,
                          int recursion, double tolerance) {
    check_case(name);
    enum { N = 40000 };
    NoiseSchedule d;
    SampleSchedule s;
    CHECK(noise_schedule_make(&d, 1000, schedule) == 0);
    CHECK((kind == SAMPLER_DPM_SOLVER_PP ? sample_schedule_log_snr(&d, steps, &s) : sample_schedule_make(&d, steps, &s)) == 0);
    SamplePlan plan;
    CHECK(sample_plan_make(&plan, &d, kind, steps, NULL, eta, predict_v ? PREDICT_V : PREDICT_EPS, 0, VARIANCE_FIXED_SMALL) == 0 && plan.count == s.count);
    for (int j = 0; j < plan.count; j++) CHECK(plan.steps[j].timestep == s.timesteps[s.count - 1 - j]);
    static float x[N];
    Analytic a = {&d, predict_v, (uint64_t)time(NULL), 0};
    for (size_t i = 0; i < N; i++) x[i] = (float)gaussian(a.seed, 1, i);
    CHECK(sample_loop(&plan, analytic_model, 0, analytic_noise, &a, x, N) == 0);
    CHECK(a.calls == (size_t)s.count);
    sample_plan_free(&plan);
    double sum = 0, sum2 = 0, want_mean = MU, want_sd = SIGMA;
    for (size_t i = 0; i < N; i++) sum += x[i], sum2 += (double)x[i] * x[i];
    double mean = sum / N, sd = sqrt(sum2 / N - mean * mean);
    if (recursion) ddim_expected(&s, kind == SAMPLER_DDPM ? 1.0f : eta, &want_mean, &want_sd);
    printf("  mean %.4f, deviation %.4f (%s: %.4f, %.4f)\n", mean, sd, recursion ? "recursion" : "data", want_mean, want_sd);
    CHECK(fabs(mean - want_mean) < 5 * want_sd / sqrt(N) + tolerance);
    CHECK(fabs(sd - want_sd) < 5 * want_sd / sqrt(2.0 * N) + tolerance);
    if (recursion && tolerance == 0 && steps == 1000) CHECK(fabs(want_mean - MU) < 0.005 && fabs(want_sd - SIGMA) < 0.005);
    noise_schedule_free(&d);
    sample_schedule_free(&s);
}

int main(void) {
    check_case("schedules: guided-diffusion's linear and cosine betas");
    NoiseSchedule d;
    CHECK(noise_schedule_make(&d, 1000, "linear") == 0);
    CHECK(fabs(d.betas[0] - 1e-4) < 1e-15 && fabs(d.betas[999] - 0.02) < 1e-15 && fabs(d.betas[500] - (1e-4 + 0.0199 * 500 / 999)) < 1e-15);
    CHECK(fabs(d.alphas_cumprod[999] - 4.035829e-05) < 1e-10);  // numpy: cumprod(1 - linspace(1e-4, 0.02, 1000))[-1]
    noise_schedule_free(&d);
    CHECK(noise_schedule_make(&d, 4000, "linear") == 0);  // scaled by 1000/T
    CHECK(fabs(d.betas[0] - 2.5e-5) < 1e-15 && fabs(d.betas[3999] - 0.005) < 1e-15);
    noise_schedule_free(&d);
    CHECK(noise_schedule_make(&d, 1000, "cosine") == 0);
    double f = cos((0.001 + 0.008) / 1.008 * M_PI / 2), f0 = cos(0.008 / 1.008 * M_PI / 2);
    CHECK(fabs(d.betas[0] - (1 - f * f / (f0 * f0))) < 1e-15 && d.betas[999] == 0.999);
    noise_schedule_free(&d);
    CHECK(noise_schedule_make(&d, 1000, "quadratic") != 0);
    CHECK(noise_schedule_make(&d, 0, "linear") != 0 && noise_schedule_make(&d, -3, "cosine") != 0 &&
          noise_schedule_make(&d, 100001, "linear") != 0);  // a checkpoint's metadata must not size the arrays

    check_case("respacing: guided-diffusion's ddimN strides");
    SampleSchedule s;
    CHECK(noise_schedule_make(&d, 1000, "linear") == 0);
    CHECK(sample_schedule_make(&d, 50, &s) == 0 && s.count == 50 && s.timesteps[1] == 20 && s.timesteps[49] == 980);
    CHECK(s.abar[1] == d.alphas_cumprod[20]);
    sample_schedule_free(&s);
    CHECK(sample_schedule_make(&d, 7, &s) == 0 && s.timesteps[1] == 143 && s.timesteps[6] == 858);
    sample_schedule_free(&s);
    CHECK(sample_schedule_make(&d, 1000, &s) == 0 && s.timesteps[999] == 999);  // every step
    sample_schedule_free(&s);
    CHECK(sample_schedule_make(&d, 999, &s) != 0);  // no stride gives 999 steps
    CHECK(sample_schedule_log_snr(&d, 20, &s) == 0 && s.count == 20 && s.timesteps[0] == 0 && s.timesteps[19] == 999);
    int increasing = 1;
    for (int k = 1; k < s.count; k++) increasing &= s.timesteps[k] > s.timesteps[k - 1];
    CHECK(increasing);
    sample_schedule_free(&s);
    noise_schedule_free(&d);

    check_case("spacings: trailingN ends at T - 1, linspaceN spans 0 .. T - 1, leadingN is ddimN (Lin et al. 2023)");
    CHECK(noise_schedule_make(&d, 10, "linear") == 0);
    const int trailing[7] = {0, 2, 3, 5, 6, 8, 9}, linspace[7] = {0, 2, 3, 4, 6, 8, 9};  // numpy's, rounding half to even
    CHECK(sample_schedule_respaced(&d, "trailing7", &s) == 0 && s.count == 7 && memcmp(s.timesteps, trailing, sizeof trailing) == 0);
    sample_schedule_free(&s);
    CHECK(sample_schedule_respaced(&d, "linspace7", &s) == 0 && s.count == 7 && memcmp(s.timesteps, linspace, sizeof linspace) == 0);
    sample_schedule_free(&s);
    CHECK(sample_schedule_respaced(&d, "leading5", &s) == 0 && s.count == 5 && s.timesteps[1] == 2 && s.timesteps[4] == 8);
    sample_schedule_free(&s);
    const char *bad[] = {"trailing0", "trailing11", "linspace1", "leading", "trailing5x"};
    for (int k = 0; k < 5; k++) {
        CHECK(sample_schedule_respaced(&d, bad[k], &s) != 0);
        sample_schedule_free(&s);
    }
    noise_schedule_free(&d);
    CHECK(noise_schedule_make(&d, 1000, "linear") == 0);
    CHECK(sample_schedule_respaced(&d, "trailing50", &s) == 0 && s.timesteps[0] == 19 && s.timesteps[1] == 39 && s.timesteps[49] == 999);
    sample_schedule_free(&s);
    CHECK(sample_schedule_respaced(&d, "linspace50", &s) == 0 && s.timesteps[2] == 41 && s.timesteps[48] == 979 && s.timesteps[49] == 999);
    sample_schedule_free(&s);
    noise_schedule_free(&d);

    double tilde_1 = 0;  // beta_tilde_1 of the respaced schedule below
    check_case("plans: DDPM is DDIM with eta 1 on all T steps; no noise on the last step; DPM-Solver++ first order at the ends");
    SamplePlan plan;
    CHECK(noise_schedule_make(&d, 1000, "linear") == 0);
    CHECK(sample_plan_make(&plan, &d, SAMPLER_DDPM, 0, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_SMALL) == 0 && plan.count == 1000 && plan.steps[0].timestep == 999);
    CHECK(plan.steps[0].eta == 1.0f && plan.steps[0].noisy && !plan.steps[999].noisy && plan.steps[999].abar_prev == 1.0f);
    CHECK(plan.steps[0].abar == (float)d.alphas_cumprod[999] && plan.steps[0].abar_prev == (float)d.alphas_cumprod[998]);
    sample_plan_free(&plan);
    CHECK(sample_plan_make(&plan, &d, SAMPLER_DDIM, 50, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_SMALL) == 0 && !plan.steps[0].noisy && plan.steps[1].timestep == 960);
    sample_plan_free(&plan);
    CHECK(sample_plan_make(&plan, &d, SAMPLER_DDIM, 999, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_SMALL) != 0 && !plan.steps);
    CHECK(respacing_stride(1000, 50) == 20 && respacing_stride(1000, 999) == 0);
    CHECK(sample_plan_make(&plan, &d, SAMPLER_DPM_SOLVER_PP, 20, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_SMALL) == 0 && plan.count == 20);
    CHECK(!plan.steps[0].second_order && plan.steps[1].second_order && plan.steps[18].second_order && !plan.steps[19].second_order);
    CHECK(!plan.steps[0].noisy && plan.steps[1].r > 0.5f && plan.steps[1].r < 2.0f);
    sample_plan_free(&plan);
    noise_schedule_free(&d);

    check_case("DDPM's fixed variances on a respaced schedule: large beta_k (beta_tilde_1 at k = 0), small beta_tilde_k; "
               "the step draws with it and classifier guidance moves the mean by it");
    CHECK(noise_schedule_make(&d, 1000, "cosine") == 0);
    SamplePlan large, small;
    CHECK(sample_plan_make(&large, &d, SAMPLER_DDPM, 25, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_LARGE) == 0 && large.count == 25);
    CHECK(sample_plan_make(&small, &d, SAMPLER_DDPM, 25, NULL, 0.0f, PREDICT_EPS, 1, VARIANCE_FIXED_SMALL) == 0 && !small.learned);
    for (int j = 0; j < large.count; j++) {
        const SampleStep *l = &large.steps[j], *m = &small.steps[j];
        int k = large.count - 1 - j;  // the respaced index: beta_k = 1 - abar_k / abar_(k-1), in double
        double abar = d.alphas_cumprod[l->timestep], abar_prev = k > 0 ? d.alphas_cumprod[large.steps[j + 1].timestep] : 1.0;
        double beta = 1.0 - abar / abar_prev, tilde = beta * (1.0 - abar_prev) / (1.0 - abar);
        if (k > 0) CHECK(fabs(l->variance / beta - 1) < 1e-6 && fabs(l->log_variance - log(beta)) < 1e-5 && fabs(m->variance / tilde - 1) < 1e-5);
        if (k > 0) CHECK(fabs(m->log_variance - log(tilde)) < 1e-5 && l->variance > m->variance);
        if (k == 1) tilde_1 = tilde;
        if (k == 0) CHECK(m->variance == 0.0f && fabs(l->variance / tilde_1 - 1) < 1e-5 && l->log_variance == m->log_variance);
        float z = 0.5f, x = 0.25f, out = -0.5f, score = 2.0f;  // the noise and the score enter through the variance alone
        SampleMemory unused = {0, 0};  // (DDPM keeps none)
        float plain = sample_step_value(&large, l, x, out, 0.0f, 0.0f, 0.0f, &unused);
        if (k > 0) CHECK(fabsf(sample_step_value(&large, l, x, out, 0.0f, 0.0f, z, &unused) - plain - expf(0.5f * l->log_variance) * z) < 1e-6f);
        CHECK(fabsf(sample_step_value(&large, l, x, out, 0.0f, score, 0.0f, &unused) - plain - l->variance * score) < 1e-6f);
    }
    sample_plan_free(&large), sample_plan_free(&small);
    noise_schedule_free(&d);

    check_case("pixels as guided-diffusion writes samples: ((x + 1) * 127.5).clamp(0, 255) truncated");
    CHECK(pixel_from_value(-1.0f) == 0 && pixel_from_value(1.0f) == 255 && pixel_from_value(0.999f) == 254 && pixel_from_value(0.0f) == 127);
    CHECK(pixel_from_value(-2.0f) == 0 && pixel_from_value(3.0f) == 255 && pixel_from_value(NAN) == 0 && pixel_from_value(INFINITY) == 255);
    for (int k = 0; k < 255; k++) {  // every level's interval [k, k + 1) / 127.5 - 1 maps to k, its middle too (rounding gave k + 1)
        float low = (float)(k / 127.5 - 1.0), middle = (float)((k + 0.6) / 127.5 - 1.0);
        CHECK(pixel_from_value(nextafterf(low, 2.0f)) == k && pixel_from_value(middle) == k);
    }

    check_case("normal_sample: 200000 draws have mean 0 and deviation 1 (within 5 standard errors)");
    double sum = 0, sum2 = 0;
    for (uint64_t i = 0; i < 200000; i++) {
        double z = normal_sample(7, 20, i);
        sum += z, sum2 += z * z;
    }
    CHECK(fabs(sum / 200000) < 5 / sqrt(200000.0) && fabs(sqrt(sum2 / 200000) - 1) < 5 / sqrt(400000.0));

    check_case("guidance: uncond + w (cond - uncond)");
    CHECK(guided_output(2.0f, 1.0f, 1.0f) == 2.0f && guided_output(2.0f, 1.0f, 0.0f) == 1.0f && guided_output(2.0f, 1.0f, 3.0f) == 4.0f);

    check_sampler("DDPM, all 1000 steps: the recursion, landing on the data", SAMPLER_DDPM, "linear", 1000, 1.0f, 0, 1, 0);
    check_sampler("DDIM, 50 steps, eta 0", SAMPLER_DDIM, "linear", 50, 0.0f, 0, 1, 0);
    check_sampler("DDIM, 50 steps, eta 1", SAMPLER_DDIM, "linear", 50, 1.0f, 0, 1, 0);
    check_sampler("DDIM, 50 steps, eta 0, cosine schedule, v prediction", SAMPLER_DDIM, "cosine", 50, 0.0f, 1, 1, 0);
    check_sampler("DPM-Solver++(2M), 20 steps: the data's mean and deviation within 0.01", SAMPLER_DPM_SOLVER_PP, "linear", 20,
                  0.0f, 0, 0, 0.01);
    check_sampler("DPM-Solver++(2M), 20 steps, cosine, v prediction: within 0.015", SAMPLER_DPM_SOLVER_PP, "cosine", 20, 0.0f, 1,
                  0, 0.015);  // its own error here is ~0.011
    check_case("sample grid: 10 images of 5x5 in 4 columns, 2-pixel white borders, read back");
    uint8_t images[10 * 5 * 5 * 3];
    for (int i = 0; i < 10 * 75; i++) images[i] = (uint8_t)(i / 75 * 20 + 1);  // image k is all k*20+1
    char path[] = "/tmp/test_grid_XXXXXX";
    close(mkstemp(path));
    CHECK(write_grid_png(path, images, 10, 5, 0) == 0);
    int w, h, channels;
    uint8_t *grid = stbi_load(path, &w, &h, &channels, 3);
    CHECK(grid && w == 4 * 7 + 2 && h == 3 * 7 + 2);
    for (int k = 0; grid && k < 10; k++) {
        int x = 2 + (k % 4) * 7 + 4, y = 2 + (k / 4) * 7 + 4;  // the tile's last pixel
        CHECK(grid[(y * w + x) * 3] == k * 20 + 1 && grid[((y + 1) * w + x + 1) * 3] == 255);
    }
    stbi_image_free(grid);
    check_case("sample grid: the same 10 images, 3 columns asked for");
    CHECK(write_grid_png(path, images, 10, 5, 3) == 0);
    grid = stbi_load(path, &w, &h, &channels, 3);
    CHECK(grid && w == 3 * 7 + 2 && h == 4 * 7 + 2);
    for (int k = 0; grid && k < 10; k++) {
        int x = 2 + (k % 3) * 7 + 4, y = 2 + (k / 3) * 7 + 4;
        CHECK(grid[(y * w + x) * 3] == k * 20 + 1);
    }
    stbi_image_free(grid);
    unlink(path);

    return check_summary();
}
