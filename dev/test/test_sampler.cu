// test_sampler.cu: the trainer's diffusion schedules and DDIM/DDPM update on the CPU (train_unet.cu
// in library mode), driven by the optimal denoiser of Gaussian data: for x0 ~ N(mu, s^2) per value,
// x_t ~ N(sqrt(abar) mu, abar s^2 + 1 - abar) and
//   E[eps | x_t] = sqrt(1 - abar) (x_t - sqrt(abar) mu) / (abar s^2 + 1 - abar)
//   E[x0 | x_t]  = mu + sqrt(abar) s^2 (x_t - sqrt(abar) mu) / (abar s^2 + 1 - abar)
// Each step is then linear in x_t, so the mean and deviation the discrete sampler must produce
// follow exactly from a recursion (DDIM with few steps shrinks the deviation a little; with all
// 1000 steps it lands on mu and s). The samples must match the recursion within 5 standard errors.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"
#include <stb_image.h>

static const double MU = 0.3, SIGMA = 0.4;

// The optimal model output at x_t: eps, or v = sqrt(abar) eps - sqrt(1 - abar) x0.
static double optimal_output(double x, double abar, int predict_v) {
    double var = abar * SIGMA * SIGMA + 1 - abar, r = (x - sqrt(abar) * MU) / var;
    double eps = sqrt(1 - abar) * r, x0 = MU + sqrt(abar) * SIGMA * SIGMA * r;
    return predict_v ? sqrt(abar) * eps - sqrt(1 - abar) * x0 : eps;
}

static double gaussian(uint64_t seed, uint64_t i) {
    double u1 = ((random_u64(seed, 1, 2 * i) >> 11) + 0.5) / 9007199254740992.0, u2 = (random_u64(seed, 1, 2 * i + 1) >> 11) / 9007199254740992.0;
    return sqrt(-2 * log(u1)) * cos(2 * M_PI * u2);
}

// The mean and deviation of x_0 after the sampler's steps from x_T ~ N(0, 1): with
// v_t = abar_t s^2 + 1 - abar_t and sigma the step's noise, each step maps deviations from
// sqrt(abar) mu by c = (sqrt(abar_s abar_t) s^2 + sqrt(1 - abar_s - sigma^2) sqrt(1 - abar_t)) / v_t.
static void expected(const SampleSchedule *s, float eta, double *mean, double *sd) {
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

// Samples n values with the schedule's steps and checks their mean and deviation against the
// recursion; `converged` also asks the recursion to land on (mu, s) within 0.005.
static void check_sampler(const char *name, const char *noise_schedule, int steps, float eta, int predict_v, int converged) {
    check_case(name);
    Diffusion d;
    diffusion_schedule(&d, 1000, noise_schedule);
    SampleSchedule s;
    CHECK(ddim_schedule(&d, steps, &s) == 0);
    const int n = 40000;
    uint64_t seed = (uint64_t)time(NULL);
    double sum = 0, sum2 = 0, want_mean, want_sd;
    for (int i = 0; i < n; i++) {
        float x = (float)gaussian(seed, i);
        for (int k = s.count - 1; k >= 0; k--) {
            float out = (float)optimal_output(x, s.abar[k], predict_v), z = (float)gaussian(seed + 1 + k, i);
            x = ddim_update(x, out, (float)s.abar[k], k > 0 ? (float)s.abar[k - 1] : 1.0f, eta, k > 0 ? z : 0.0f, predict_v, 0);
        }
        sum += x, sum2 += (double)x * x;
    }
    expected(&s, eta, &want_mean, &want_sd);
    double mean = sum / n, sd = sqrt(sum2 / n - mean * mean);
    printf("  mean %.4f (recursion %.4f, data %.2f), deviation %.4f (recursion %.4f, data %.2f)\n", mean, want_mean, MU, sd,
           want_sd, SIGMA);
    CHECK(fabs(mean - want_mean) < 5 * want_sd / sqrt(n));        // standard error of the mean
    CHECK(fabs(sd - want_sd) < 5 * want_sd / sqrt(2.0 * n));      // ... and of the deviation
    if (converged) CHECK(fabs(want_mean - MU) < 0.005 && fabs(want_sd - SIGMA) < 0.005);
    free(d.betas), free(d.alphas_cumprod), free(s.timesteps), free(s.abar);
}

int main(void) {
    check_case("schedules: guided-diffusion's linear and cosine betas");
    Diffusion d;
    diffusion_schedule(&d, 1000, "linear");
    CHECK(fabs(d.betas[0] - 1e-4) < 1e-15 && fabs(d.betas[999] - 0.02) < 1e-15 && fabs(d.betas[500] - (1e-4 + 0.0199 * 500 / 999)) < 1e-15);
    CHECK(fabs(d.alphas_cumprod[999] - 4.035829e-05) < 1e-10);  // numpy: cumprod(1 - linspace(1e-4, 0.02, 1000))[-1]
    free(d.betas), free(d.alphas_cumprod);
    diffusion_schedule(&d, 4000, "linear");  // scaled by 1000/T
    CHECK(fabs(d.betas[0] - 2.5e-5) < 1e-15 && fabs(d.betas[3999] - 0.005) < 1e-15);
    free(d.betas), free(d.alphas_cumprod);
    diffusion_schedule(&d, 1000, "cosine");
    double f = cos((0.001 + 0.008) / 1.008 * M_PI / 2), f0 = cos(0.008 / 1.008 * M_PI / 2);
    CHECK(fabs(d.betas[0] - (1 - f * f / (f0 * f0))) < 1e-15 && d.betas[999] == 0.999);
    free(d.betas), free(d.alphas_cumprod);

    check_case("respacing: guided-diffusion's ddimN strides");
    diffusion_schedule(&d, 1000, "linear");
    SampleSchedule s;
    CHECK(ddim_schedule(&d, 50, &s) == 0 && s.count == 50 && s.timesteps[1] == 20 && s.timesteps[49] == 980);
    CHECK(s.abar[1] == d.alphas_cumprod[20]);
    free(s.timesteps), free(s.abar);
    CHECK(ddim_schedule(&d, 7, &s) == 0 && s.timesteps[1] == 143 && s.timesteps[6] == 858);
    free(s.timesteps), free(s.abar);
    CHECK(ddim_schedule(&d, 1000, &s) == 0 && s.timesteps[999] == 999);  // every step
    free(s.timesteps), free(s.abar);
    CHECK(ddim_schedule(&d, 999, &s) != 0);  // no stride gives 999 steps
    free(d.betas), free(d.alphas_cumprod);

    check_sampler("DDIM, 50 steps, eta 0, eps prediction: Gaussian data", "linear", 50, 0.0f, 0, 0);
    check_sampler("DDIM, 50 steps, eta 1: Gaussian data", "linear", 50, 1.0f, 0, 0);
    check_sampler("DDIM, 50 steps, eta 0, cosine schedule, v prediction: Gaussian data", "cosine", 50, 0.0f, 1, 0);
    check_sampler("DDIM, all 1000 steps, eta 0: lands on the data's mean and deviation", "linear", 1000, 0.0f, 0, 1);
    check_sampler("DDPM ancestral (eta 1 over all 1000 steps): lands on the data's mean and deviation", "linear", 1000, 1.0f, 0, 1);

    check_case("sample grid: 10 images of 5x5 in 4 columns, 2-pixel white borders, read back");
    uint8_t images[10 * 5 * 5 * 3];
    for (int i = 0; i < 10 * 75; i++) images[i] = (uint8_t)(i / 75 * 20 + 1);  // image k is all k*20+1
    char path[] = "/tmp/test_grid_XXXXXX";
    close(mkstemp(path));
    CHECK(write_grid_png(path, images, 10, 5) == 0);
    int w, h, c;
    uint8_t *grid = stbi_load(path, &w, &h, &c, 3);
    CHECK(grid && w == 4 * 7 + 2 && h == 3 * 7 + 2);
    for (int k = 0; grid && k < 10; k++) {
        int x = 2 + (k % 4) * 7 + 4, y = 2 + (k / 4) * 7 + 4;  // the tile's last pixel
        CHECK(grid[(y * w + x) * 3] == k * 20 + 1 && grid[((y + 1) * w + x + 1) * 3] == 255);
    }
    stbi_image_free(grid);
    unlink(path);
    return check_summary();
}
