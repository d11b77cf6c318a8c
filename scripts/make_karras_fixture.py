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
with its churn), started from x = z sigma_max. And the same samplers on an EDM model: NVlabs/edm's
EDMPrecond (networks.py) around a toy F, D = c_skip x + c_out F(c_in x, c_noise); and EDMLoss
(loss.py) for one value: weight (D - y)^2 of y + sigma n, the weight (sigma^2 + s^2) / (sigma s)^2.
The toy model's output is tanh(w[t] x + b[t]) per value, its w and b random per t; the toy F is
tanh(EDM_W x_in + EDM_B c_noise).

Tensors (F32, the inputs rounded to float32 before the reference runs on them): cases [C, 12]
(schedule 0 linear / 1 cosine / 2 none: the EDM model, predict_v, sampler 0 euler / 1
euler_ancestral / 2 dpmpp_2m / 3 heun, steps, sigma_min, sigma_max, rho, 0 for the schedule's own
sigma_min and sigma_max; heun's s_churn, s_tmin, s_tmax, s_noise; the EDM model's sigma_data, 0 for
a discrete one), start [C, n] (unit normal z), noise [C, 25, n] (the draws per step of
euler_ancestral and heun), expected [C, n] (the final x), timesteps [C, 50] (the model's t per
call, -1 past the last; 0 for the EDM model), model_w, model_b [1000]; edm_loss [L, 7] (y, n,
sigma, sigma_data, F's output f, then EDM's c_in (y + sigma n) and weight (D - y)^2).
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


EDM_W, EDM_B = 0.9, 0.3


class EdmDenoiser:
    """NVlabs/edm's EDMPrecond (networks.py) around the toy F: c_skip = s^2 / (sigma^2 + s^2), c_out =
    sigma s / sqrt(sigma^2 + s^2), c_in = 1 / sqrt(s^2 + sigma^2), c_noise = log(sigma) / 4,
    D_x = c_skip x + c_out F(c_in x, c_noise)."""

    def __init__(self, sigma_data):
        self.sigma_data = sigma_data
        self.called = []

    def __call__(self, x, sigma):
        s = self.sigma_data
        self.called.append(0)
        c_skip = s ** 2 / (sigma ** 2 + s ** 2)
        c_out = sigma * s / math.sqrt(sigma ** 2 + s ** 2)
        c_in = 1 / math.sqrt(s ** 2 + sigma ** 2)
        c_noise = math.log(sigma) / 4
        return c_skip * x + c_out * np.tanh(EDM_W * (c_in * x) + EDM_B * c_noise)


def edm_loss(y, n, sigma, s, f):
    """NVlabs/edm's EDMLoss (loss.py) for one value whose F output is f: weight (D_yn - y)^2 of
    y + n sigma, weight = (sigma^2 + s^2) / (sigma s)^2; and F's input c_in (y + n sigma)."""
    c_skip, c_out, c_in = s ** 2 / (sigma ** 2 + s ** 2), sigma * s / math.sqrt(sigma ** 2 + s ** 2), 1 / math.sqrt(s ** 2 + sigma ** 2)
    x = y + n * sigma
    weight = (sigma ** 2 + s ** 2) / (sigma * s) ** 2
    return c_in * x, weight * (c_skip * x + c_out * f - y) ** 2


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
    rows = [(s, v, k, steps, 0.0, 0.0, 7.0) + no_churn + (0.0,) for s in (0, 1) for v in (0, 1) for k in (0, 1, 2, 3)
            for steps in (10, 25)]
    rows += [(0, 0, 2, 20, 0.05, 20.0, 3.0) + no_churn + (0.0,), (1, 1, 1, 12, 0.1, 40.0, 5.0) + no_churn + (0.0,)]
    # Heun with churn: EDM's ImageNet settings but S_tmax below the first level (the first step
    # without churn: see sample_plan_karras on merging its churn into the starting noise)
    rows += [(0, 0, 3, 18, 0.002, 80.0, 7.0, 40.0, 0.05, 50.0, 1.003, 0.0), (1, 1, 3, 12, 0.0, 0.0, 7.0, 30.0, 0.0, 20.0, 1.0, 0.0)]
    # the EDM model: each sampler on EDM's levels (sigma_min, sigma_max 0: EDM's 0.002 and 80), sigma_data 0.5 and 1; Heun with
    # EDM's ImageNet churn
    rows += [(2, 0, k, steps, 0.0, 0.0, 7.0) + no_churn + (0.5,) for k in (0, 1, 2, 3) for steps in (10, 18)]
    rows += [(2, 0, 3, 18, 0.002, 80.0, 7.0, 40.0, 0.05, 50.0, 1.003, 0.5), (2, 0, 2, 12, 0.01, 40.0, 5.0) + no_churn + (1.0,)]
    cases, start, noise, expected, timesteps = [], [], [], [], []
    for s, v, k, steps, sigma_min, sigma_max, rho, s_churn, s_tmin, s_tmax, s_noise, sigma_data in rows:
        if s == 2:
            model = EdmDenoiser(sigma_data)
            lo, hi = sigma_min or 0.002, sigma_max or 80.0
        else:
            model = DiscreteDenoiser(schedules[s], v, w, b)
            lo = sigma_min or model.sigmas[0]
            hi = sigma_max or model.sigmas[-1]
        sigmas = get_sigmas_karras(steps, lo, hi, rho)
        z = f32(rng.standard_normal(n))
        draws = f32(np.concatenate([rng.standard_normal((steps, n)), np.zeros((MAX_STEPS - steps, n))]) if k in (1, 3) else
                    np.zeros((MAX_STEPS, n)))
        churn = dict(s_churn=s_churn, s_tmin=s_tmin, s_tmax=s_tmax, s_noise=s_noise) if k == 3 else {}
        x = samplers[k](model, z * sigmas[0], sigmas, draws, **churn)
        cases.append([s, v, k, steps, sigma_min, sigma_max, rho, s_churn, s_tmin, min(s_tmax, 1e30), s_noise, sigma_data])
        start.append(z), noise.append(draws), expected.append(x)
        timesteps.append(model.called + [-1] * (2 * MAX_STEPS - len(model.called)))
    losses = []
    for i in range(64):  # sigma over EDM's training range and beyond, sigma_data 0.5 and 1
        y, n_, f = f32(rng.uniform(-1, 1)), f32(rng.standard_normal()), f32(rng.normal(0, 1.5))
        sigma, s = f32(math.exp(rng.normal(-1.2, 2.0))), (0.5, 1.0)[i % 2]
        losses.append([y, n_, sigma, s, f, *edm_loss(y, n_, sigma, s, f)])
    tensors = {"cases": np.array(cases), "start": np.array(start), "noise": np.array(noise), "expected": np.array(expected),
               "timesteps": np.array(timesteps, dtype=np.float64), "model_w": w, "model_b": b, "edm_loss": np.array(losses)}
    write_safetensors(OUT, [(name, a.shape, np.ascontiguousarray(a, dtype="<f4").tobytes()) for name, a in tensors.items()], {})
    print(f"wrote {OUT}: {len(rows)} cases")


if __name__ == "__main__":
    main()
