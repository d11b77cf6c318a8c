"""The reference of sampler.h's samplers on Karras noise levels: k-diffusion's formulas (Crowson's
k-diffusion, sampling.py and external.py, as published; written out here in float64 NumPy) run
whole on a toy model, written to dev/fixtures/samplers/karras.safetensors for
dev/test/test_sampler_fixture.cu, which runs sample_plan_karras and sample_loop on the same model,
starting noise and draws.

    python3 scripts/make_karras_fixture.py      # deterministic: the same bytes every time

What is ported: get_sigmas_karras (then 0); DiscreteEpsDDPMDenoiser and DiscreteVDDPMDenoiser on
guided-diffusion's linear and cosine schedules (sigma = sqrt((1 - abar) / abar), the model called
with x c_in at the quantized t, the t of the nearest log sigma: sigma_to_t with quantize); and
sample_euler (no churn), sample_euler_ancestral, sample_dpmpp_2m and sample_heun (EDM's sampler,
with its churn), started from x = z sigma_max.
The toy model's output is tanh(w[t] x + b[t]) per value, its w and b random per t.

Tensors (F32, the inputs rounded to float32 before the reference runs on them): cases [C, 11]
(schedule 0 linear / 1 cosine, predict_v, sampler 0 euler / 1 euler_ancestral / 2 dpmpp_2m / 3
heun, steps, sigma_min, sigma_max, rho, 0 for the schedule's own sigma_min and sigma_max; heun's
s_churn, s_tmin, s_tmax, s_noise), start [C, n] (unit normal z), noise [C, 25, n] (the draws per
step of euler_ancestral and heun), expected [C, n] (the final x), timesteps [C, 50] (the model's t
per call, -1 past the last), model_w, model_b [1000].
"""

import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_safetensors import write_safetensors  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "fixtures", "samplers", "karras.safetensors")
MAX_STEPS = 25


def alphas_cumprod(name, T=1000):
    """guided-diffusion's get_named_beta_schedule, cumulative product of 1 - beta."""
    if name == "linear":
        betas = np.linspace(0.0001 * 1000 / T, 0.02 * 1000 / T, T, dtype=np.float64)
    else:
        f = lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2
        betas = np.array([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)])
    return np.cumprod(1 - betas)


def get_sigmas_karras(n, sigma_min, sigma_max, rho=7.0):
    ramp = np.linspace(0, 1, n)
    min_inv_rho, max_inv_rho = sigma_min ** (1 / rho), sigma_max ** (1 / rho)
    return np.append((max_inv_rho + ramp * (min_inv_rho - max_inv_rho)) ** rho, 0.0)


class DiscreteDenoiser:
    """DiscreteEpsDDPMDenoiser (c_skip 1, c_out -sigma) or DiscreteVDDPMDenoiser (c_skip 1/(sigma^2+1),
    c_out -sigma/sqrt(sigma^2+1)), both c_in 1/sqrt(sigma^2+1), at the quantized t."""

    def __init__(self, abar, predict_v, w, b):
        self.sigmas = np.sqrt((1 - abar) / abar)
        self.log_sigmas = np.log(self.sigmas)
        self.predict_v, self.w, self.b = predict_v, w, b
        self.called = []

    def sigma_to_t(self, sigma):
        return int(np.argmin(np.abs(math.log(sigma) - self.log_sigmas)))

    def __call__(self, x, sigma):
        t = self.sigma_to_t(sigma)
        self.called.append(t)
        c_in = 1 / math.sqrt(sigma ** 2 + 1)
        out = np.tanh(self.w[t] * (x * c_in) + self.b[t])
        if self.predict_v:
            return x / (sigma ** 2 + 1) - out * sigma / math.sqrt(sigma ** 2 + 1)
        return x - out * sigma


def sample_euler(model, x, sigmas, noise):
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i])
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigmas[i + 1] - sigmas[i])
    return x


def get_ancestral_step(sigma_from, sigma_to, eta=1.0):
    sigma_up = min(sigma_to, eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5)
    sigma_down = (sigma_to ** 2 - sigma_up ** 2) ** 0.5
    return sigma_down, sigma_up


def sample_euler_ancestral(model, x, sigmas, noise):
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i])
        sigma_down, sigma_up = get_ancestral_step(sigmas[i], sigmas[i + 1])
        d = (x - denoised) / sigmas[i]
        x = x + d * (sigma_down - sigmas[i])
        if sigmas[i + 1] > 0:
            x = x + noise[i] * sigma_up
    return x


def sample_dpmpp_2m(model, x, sigmas, noise):
    sigma_fn, t_fn = (lambda t: math.exp(-t)), (lambda sigma: -math.log(sigma))
    old_denoised = None
    for i in range(len(sigmas) - 1):
        denoised = model(x, sigmas[i])
        if sigmas[i + 1] == 0:  # sigma_fn(inf) = 0, expm1(-inf) = -1
            x = denoised
        else:
            t, t_next = t_fn(sigmas[i]), t_fn(sigmas[i + 1])
            h = t_next - t
            if old_denoised is None:
                x = (sigma_fn(t_next) / sigma_fn(t)) * x - math.expm1(-h) * denoised
            else:
                r = (t - t_fn(sigmas[i - 1])) / h
                denoised_d = (1 + 1 / (2 * r)) * denoised - (1 / (2 * r)) * old_denoised
                x = (sigma_fn(t_next) / sigma_fn(t)) * x - math.expm1(-h) * denoised_d
        old_denoised = denoised
    return x


def sample_heun(model, x, sigmas, noise, s_churn=0.0, s_tmin=0.0, s_tmax=float("inf"), s_noise=1.0):
    for i in range(len(sigmas) - 1):
        gamma = min(s_churn / (len(sigmas) - 1), 2 ** 0.5 - 1) if s_tmin <= sigmas[i] <= s_tmax else 0.0
        eps = noise[i] * s_noise
        sigma_hat = sigmas[i] * (gamma + 1)
        if gamma > 0:
            x = x + eps * (sigma_hat ** 2 - sigmas[i] ** 2) ** 0.5
        denoised = model(x, sigma_hat)
        d = (x - denoised) / sigma_hat
        dt = sigmas[i + 1] - sigma_hat
        if sigmas[i + 1] == 0:  # Euler method
            x = x + d * dt
        else:
            x_2 = x + d * dt
            denoised_2 = model(x_2, sigmas[i + 1])
            d_2 = (x_2 - denoised_2) / sigmas[i + 1]
            x = x + (d + d_2) / 2 * dt
    return x


def main():
    rng = np.random.default_rng(20261129)
    n = 64
    f32 = lambda a: np.asarray(a, dtype=np.float32).astype(np.float64)
    w, b = f32(rng.uniform(0.5, 1.5, 1000)), f32(rng.normal(0, 0.3, 1000))
    schedules = [alphas_cumprod("linear"), alphas_cumprod("cosine")]
    samplers = [sample_euler, sample_euler_ancestral, sample_dpmpp_2m, sample_heun]
    no_churn = (0.0, 0.0, float("inf"), 1.0)
    rows = [(s, v, k, steps, 0.0, 0.0, 7.0) + no_churn for s in (0, 1) for v in (0, 1) for k in (0, 1, 2, 3) for steps in (10, 25)]
    rows += [(0, 0, 2, 20, 0.05, 20.0, 3.0) + no_churn, (1, 1, 1, 12, 0.1, 40.0, 5.0) + no_churn]
    # Heun with churn: EDM's ImageNet settings but S_tmax below the first level (the first step
    # without churn: see sample_plan_karras on merging its churn into the starting noise)
    rows += [(0, 0, 3, 18, 0.002, 80.0, 7.0, 40.0, 0.05, 50.0, 1.003), (1, 1, 3, 12, 0.0, 0.0, 7.0, 30.0, 0.0, 20.0, 1.0)]
    cases, start, noise, expected, timesteps = [], [], [], [], []
    for s, v, k, steps, sigma_min, sigma_max, rho, s_churn, s_tmin, s_tmax, s_noise in rows:
        abar = schedules[s]
        model = DiscreteDenoiser(abar, v, w, b)
        lo = sigma_min or model.sigmas[0]
        hi = sigma_max or model.sigmas[-1]
        sigmas = get_sigmas_karras(steps, lo, hi, rho)
        z = f32(rng.standard_normal(n))
        draws = f32(np.concatenate([rng.standard_normal((steps, n)), np.zeros((MAX_STEPS - steps, n))]) if k in (1, 3) else
                    np.zeros((MAX_STEPS, n)))
        churn = dict(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise) if k == 3 else {}
        x = samplers[k](model, z * sigmas[0], sigmas, draws, **churn)
        cases.append([s, v, k, steps, sigma_min, sigma_max, rho, s_churn, s_tmin, min(s_tmax, 1e30), s_noise])
        start.append(z), noise.append(draws), expected.append(x)
        timesteps.append(model.called + [-1] * (2 * MAX_STEPS - len(model.called)))
    tensors = {"cases": np.array(cases), "start": np.array(start), "noise": np.array(noise), "expected": np.array(expected),
               "timesteps": np.array(timesteps, dtype=np.float64), "model_w": w, "model_b": b}
    write_safetensors(OUT, [(name, a.shape, np.ascontiguousarray(a, dtype="<f4").tobytes()) for name, a in tensors.items()], {})
    print(f"wrote {OUT}: {len(rows)} cases")


if __name__ == "__main__":
    main()
