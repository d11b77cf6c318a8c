"""The samplers' reference: guided-diffusion's own formulas (gaussian_diffusion.py: the beta
schedules, space_timesteps, p_sample with the fixed-small variance, ddim_sample) and
DPM-Solver++(2M)'s second-order multistep update as the DPM-Solver authors write it, and classifier
guidance's condition_mean (p_sample) and condition_score (ddim_sample), in float64 numpy, on random inputs; written to dev/fixtures/samplers/steps.safetensors for
dev/test/test_sampler_fixture.cu, which runs sampler.h's functions on the same inputs.

    python3 scripts/make_sampler_fixture.py          # deterministic: the same bytes every time

The formulations differ from sampler.h's on purpose (posterior mean and variance for DDPM,
reciprocal square roots for DDIM, the D1 difference for DPM-Solver++): matching them checks the
algebra, not just the code.
"""

import math
import os

import numpy as np
from safetensors.numpy import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "fixtures", "samplers", "steps.safetensors")


def betas_for_alpha_bar(T, alpha_bar, max_beta=0.999):
    return np.array([min(1 - alpha_bar((i + 1) / T) / alpha_bar(i / T), max_beta) for i in range(T)], dtype=np.float64)


def named_beta_schedule(name, T):
    if name == "linear":
        scale = 1000 / T
        return np.linspace(scale * 0.0001, scale * 0.02, T, dtype=np.float64)
    return betas_for_alpha_bar(T, lambda t: math.cos((t + 0.008) / 1.008 * math.pi / 2) ** 2)


def space_timesteps(T, count):
    for i in range(1, T + 1):
        if len(range(0, T, i)) == count:
            return list(range(0, T, i))
    raise ValueError(count)


def x0_from_output(x, out, ab, predict_v, clip):
    if predict_v:
        x0 = math.sqrt(ab) * x - math.sqrt(1 - ab) * out
    else:  # _predict_xstart_from_eps
        x0 = math.sqrt(1 / ab) * x - math.sqrt(1 / ab - 1) * out
    return np.clip(x0, -1, 1) if clip else x0


def main():
    rng = np.random.default_rng(20261121)
    tensors, n = {}, 64
    for name in ("linear", "cosine"):
        for T in (1000, 50):
            betas = named_beta_schedule(name, T)
            tensors[f"betas_{name}_{T}"] = betas
            tensors[f"alphas_cumprod_{name}_{T}"] = np.cumprod(1 - betas)
    for count in (50, 7, 1000):
        tensors[f"ddim{count}"] = np.array(space_timesteps(1000, count), dtype=np.int64)

    # Rows of cases: [schedule 0 linear / 1 cosine, t index, t_prev index (-1: clean), eta, predict_v, clip],
    # the values x, out, z [n], and the expected result [n].
    for kind in ("ddpm", "ddim"):
        cases, values, expected = [], [], []
        for _ in range(24):
            s = int(rng.integers(2))
            betas = named_beta_schedule(("linear", "cosine")[s], 1000)
            ab = np.cumprod(1 - betas)
            predict_v, clip = int(rng.integers(2)), int(rng.integers(2))
            x, out, z = rng.standard_normal(n) * 1.5, rng.standard_normal(n), rng.standard_normal(n)
            if kind == "ddpm":  # p_sample: posterior of q(x_{t-1} | x_t, x0) with the fixed small variance
                t = int(rng.integers(1, 1000))
                t_prev, eta = t - 1, 1.0
                x0 = x0_from_output(x, out, ab[t], predict_v, clip)
                coef1 = betas[t] * math.sqrt(ab[t - 1]) / (1 - ab[t])
                coef2 = (1 - ab[t - 1]) * math.sqrt(1 - betas[t]) / (1 - ab[t])
                variance = betas[t] * (1 - ab[t - 1]) / (1 - ab[t])
                result = coef1 * x0 + coef2 * x + math.sqrt(variance) * z
            else:  # ddim_sample on the respaced steps, any eta, down to t_prev (or clean)
                steps = space_timesteps(1000, int(rng.choice([50, 7, 20])))
                k = int(rng.integers(len(steps)))
                t, t_prev, eta = steps[k], steps[k - 1] if k > 0 else -1, float(rng.choice([0.0, 0.5, 1.0]))
                ab_prev = ab[t_prev] if t_prev >= 0 else 1.0
                x0 = x0_from_output(x, out, ab[t], predict_v, clip)
                eps = (math.sqrt(1 / ab[t]) * x - x0) / math.sqrt(1 / ab[t] - 1)  # _predict_eps_from_xstart
                sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab[t])) * math.sqrt(1 - ab[t] / ab_prev)
                result = x0 * math.sqrt(ab_prev) + math.sqrt(1 - ab_prev - sigma ** 2) * eps + (sigma * z if t_prev >= 0 else 0)
                if t_prev < 0:
                    z = np.zeros(n)
            cases.append([s, t, t_prev, eta, predict_v, clip])
            values.append(np.stack([x, out, z]))
            expected.append(result)
        tensors[f"{kind}_cases"] = np.array(cases, dtype=np.float64)
        tensors[f"{kind}_values"] = np.array(values)
        tensors[f"{kind}_expected"] = np.array(expected)

    # DPM-Solver++(2M): x_t = (sigma_t/sigma_s) x - alpha_t (e^-h - 1) m0 - 0.5 alpha_t (e^-h - 1) D1,
    # D1 = (m0 - m1) / r0, r0 = h_last / h (the official multistep second-order update).
    cases, values, expected = [], [], []
    for _ in range(24):
        s = int(rng.integers(2))
        ab = np.cumprod(1 - named_beta_schedule(("linear", "cosine")[s], 1000))
        t_last, t, t_next = sorted(rng.choice(np.arange(1, 1000), 3, replace=False))[::-1]
        lam = lambda q: 0.5 * math.log(q / (1 - q))
        h, h_last = lam(ab[t_next]) - lam(ab[t]), lam(ab[t]) - lam(ab[t_last])
        second = int(rng.integers(2))
        x, m0, m1 = rng.standard_normal(n), rng.standard_normal(n) * 0.8, rng.standard_normal(n) * 0.8
        alpha, sigma_t, sigma_s = math.sqrt(ab[t_next]), math.sqrt(1 - ab[t_next]), math.sqrt(1 - ab[t])
        r0 = h_last / h
        result = sigma_t / sigma_s * x - alpha * math.expm1(-h) * m0
        if second:
            result = result - 0.5 * alpha * math.expm1(-h) * (m0 - m1) / r0
        cases.append([s, t, t_next, r0, second, 0])
        values.append(np.stack([x, m0, m1]))
        expected.append(result)
    tensors["dpm_cases"] = np.array(cases, dtype=np.float64)
    tensors["dpm_values"] = np.array(values)
    tensors["dpm_expected"] = np.array(expected)

    # Classifier guidance with a score g = s grad log p(y | x_t) per value: p_sample with
    # condition_mean (the mean moves by the model's variance times g: the posterior's variance, not
    # clipped, or exp of the learned log variance) and ddim_sample with condition_score (eps from the
    # clipped x0, eps -= sqrt(1 - abar) g, x0 again from eps, not clipped).
    # guided_ddpm rows: [schedule, t, learned, predict_v, clip, 0]; values x, out, v, z, g.
    # guided_ddim rows: [schedule, t, t_prev (-1: clean), eta, predict_v, clip]; values x, out, 0, z, g.
    for kind in ("guided_ddpm", "guided_ddim"):
        cases, values, expected = [], [], []
        for r in range(24):
            s = int(rng.integers(2))
            betas = named_beta_schedule(("linear", "cosine")[s], 1000)
            ab = np.cumprod(1 - betas)
            ab_prev_all = np.append(1.0, ab[:-1])
            predict_v, clip = int(rng.integers(2)), int(rng.integers(2))
            x, out, z = rng.standard_normal(n) * 1.5, rng.standard_normal(n), rng.standard_normal(n)
            v, g = rng.uniform(-1, 1, n), rng.standard_normal(n) * 3
            if kind == "guided_ddpm":
                t, learned = (0 if r % 6 == 0 else int(rng.integers(1, 1000))), r % 2
                x0 = x0_from_output(x, out, ab[t], predict_v, clip)
                posterior_variance = betas * (1 - ab_prev_all) / (1 - ab)
                log_clipped = np.log(np.append(posterior_variance[1], posterior_variance[1:]))
                mean = (betas[t] * np.sqrt(ab_prev_all[t]) / (1 - ab[t])) * x0 + \
                       ((1 - ab_prev_all[t]) * np.sqrt(1 - betas[t]) / (1 - ab[t])) * x
                if learned:
                    frac = (v + 1) / 2
                    log_var = frac * np.log(betas[t]) + (1 - frac) * log_clipped[t]
                    variance = np.exp(log_var)
                else:
                    log_var, variance = np.full(n, log_clipped[t]), np.full(n, posterior_variance[t])
                mean = mean + variance * g  # condition_mean
                result = mean + (t != 0) * np.exp(0.5 * log_var) * z
                cases.append([s, t, learned, predict_v, clip, 0])
            else:
                steps = space_timesteps(1000, int(rng.choice([50, 7, 20])))
                k = int(rng.integers(len(steps)))
                t, t_prev, eta = steps[k], steps[k - 1] if k > 0 else -1, float(rng.choice([0.0, 0.5, 1.0]))
                ab_prev = ab[t_prev] if t_prev >= 0 else 1.0
                x0 = x0_from_output(x, out, ab[t], predict_v, clip)
                eps = (math.sqrt(1 / ab[t]) * x - x0) / math.sqrt(1 / ab[t] - 1)
                eps = eps - math.sqrt(1 - ab[t]) * g  # condition_score
                x0 = math.sqrt(1 / ab[t]) * x - math.sqrt(1 / ab[t] - 1) * eps
                eps = (math.sqrt(1 / ab[t]) * x - x0) / math.sqrt(1 / ab[t] - 1)
                sigma = eta * math.sqrt((1 - ab_prev) / (1 - ab[t])) * math.sqrt(1 - ab[t] / ab_prev)
                result = x0 * math.sqrt(ab_prev) + math.sqrt(1 - ab_prev - sigma ** 2) * eps + (sigma * z if t_prev >= 0 else 0)
                v = np.zeros(n)
                if t_prev < 0:
                    z = np.zeros(n)
                cases.append([s, t, t_prev, eta, predict_v, clip])
            values.append(np.stack([x, out, v, z, g]))
            expected.append(result)
        tensors[f"{kind}_cases"] = np.array(cases, dtype=np.float64)
        tensors[f"{kind}_values"] = np.array(values)
        tensors[f"{kind}_expected"] = np.array(expected)

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file({k: np.ascontiguousarray(v) for k, v in sorted(tensors.items())}, OUT)  # no metadata: its order is not fixed
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
