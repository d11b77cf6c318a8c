// test_sampler_fixture.cu: sampler.h against the reference of scripts/make_sampler_fixture.py
// (guided-diffusion's formulas in float64: beta schedules, space_timesteps, p_sample's posterior,
// ddim_sample, and DPM-Solver++(2M)'s official second-order update), on the fixture's random
// cases. Each step is computed in float, so the tolerance is 1e-5 relative per case.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

static SafeTensorsFile fixture;

static double *tensor(const char *name, int64_t *numel) {
    const SafeTensor *t = safetensors_find(&fixture, name);
    if (!t) fatal("sampler fixture: no tensor %s", name);
    double *out = (double *)malloc_or_die(t->numel * sizeof(double));
    if (strcmp(t->dtype, "F64") == 0) memcpy(out, t->data, t->numel * sizeof(double));
    else if (strcmp(t->dtype, "I64") == 0) for (int64_t i = 0; i < t->numel; i++) out[i] = (double)((const int64_t *)t->data)[i];
    else fatal("sampler fixture: %s is %s", name, t->dtype);
    if (numel) *numel = t->numel;
    return out;
}

// Runs every case of one kind (ddpm, ddim, dpm) and returns the worst relative error.
static double run_cases(const char *kind, const NoiseSchedule *schedules) {
    char name[64];
    int64_t rows_numel = 0, values_numel = 0;
    snprintf(name, sizeof name, "%s_cases", kind);
    double *cases = tensor(name, &rows_numel);
    snprintf(name, sizeof name, "%s_values", kind);
    double *values = tensor(name, &values_numel);
    snprintf(name, sizeof name, "%s_expected", kind);
    double *expected = tensor(name, NULL);
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
    noise_schedule_free(&schedules[0]), noise_schedule_free(&schedules[1]), noise_schedule_free(&linear);
    safetensors_close(&fixture);
    return check_summary();
}
