"""Our PyTorch reference of guided-diffusion's diffusion math (gaussian_diffusion.py, respace.py,
losses.py), written from its formulas, in float64: the beta schedules, space_timesteps, the
arrays of GaussianDiffusion and SpacedDiffusion's respaced ones, p_mean_variance with the learned
range, the variational bound's terms (normal_kl, discretized_gaussian_log_likelihood) and the
likelihood's prior; classifier guidance's cond_fn (classifier_sample.py); guided-diffusion's
LossSecondMomentResampler (resample.py); and the project's counter-based normal draws (random.h,
sampler.h's normal_sample), so that a likelihood computed here sees the noise train_unet.cu's does.

Used by make_diffusion_fixture.py (fixtures for dev/test/test_sampler_fixture.cu),
make_guidance_fixture.py, guided_torch.py (classifier-guided sampling against generate's) and
nll_torch.py (bits per dimension against generate --nll).
"""

import math

import numpy as np
import torch

F64 = torch.float64


def betas_for(name, T):
    if name == "linear":
        scale = 1000 / T
        return torch.linspace(scale * 0.0001, scale * 0.02, T, dtype=F64)
    f = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return torch.tensor([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)], dtype=F64)


def space_timesteps(T, spec):
    """The steps a respacing spec keeps: "ddimN" (a stride), or section counts "N1,N2,..."."""
    if spec.startswith("ddim"):
        want = int(spec[4:])
        for i in range(1, T):
            if len(range(0, T, i)) == want:
                return list(range(0, T, i))
        raise ValueError(spec)
    counts = [int(c) for c in spec.split(",")]
    size_per, extra, start, kept = T // len(counts), T % len(counts), 0, []
    for i, count in enumerate(counts):
        size = size_per + (1 if i < extra else 0)
        stride = (size - 1) / (count - 1) if count > 1 else 1
        position = 0.0
        for _ in range(count):
            kept.append(start + round(position))
            position += stride
        start += size
    return sorted(set(kept))


class Diffusion:
    """The arrays of GaussianDiffusion for a beta schedule."""

    def __init__(self, b):
        self.betas = b
        self.abar = torch.cumprod(1 - b, 0)
        self.abar_prev = torch.cat([torch.ones(1, dtype=F64), self.abar[:-1]])
        self.posterior_variance = b * (1 - self.abar_prev) / (1 - self.abar)
        self.posterior_log_variance_clipped = torch.log(torch.cat([self.posterior_variance[1:2], self.posterior_variance[1:]]))
        self.mean_x0 = b * torch.sqrt(self.abar_prev) / (1 - self.abar)
        self.mean_xt = (1 - self.abar_prev) * torch.sqrt(1 - b) / (1 - self.abar)
        # FIXED_LARGE, the variance of a model that does not learn its own
        self.fixed_large_log_variance = torch.log(torch.cat([self.posterior_variance[1:2], b[1:]]))

    def x0_from_output(self, x_t, out, t, predict):
        a = self.abar[t]
        if predict == 0:  # eps
            return torch.sqrt(1 / a) * x_t - torch.sqrt(1 / a - 1) * out
        if predict == 1:  # v
            return torch.sqrt(a) * x_t - torch.sqrt(1 - a) * out
        return out

    def p_mean_variance(self, x_t, out, v, t, predict, clip):
        """The model's mean and log variance at step t; v (the output's variance half) None: FIXED_LARGE."""
        x0 = self.x0_from_output(x_t, out, t, predict)
        if clip:
            x0 = x0.clamp(-1, 1)
        mean = self.mean_x0[t] * x0 + self.mean_xt[t] * x_t
        if v is None:
            return mean, self.fixed_large_log_variance[t].expand_as(mean)
        frac = (v + 1) / 2
        return mean, frac * torch.log(self.betas[t]) + (1 - frac) * self.posterior_log_variance_clipped[t]


def cond_fn(classifier, x, t, y, scale):
    """guided-diffusion's classifier_sample.py cond_fn: scale times the gradient of log p(y | x) at x."""
    with torch.enable_grad():
        x_in = x.detach().requires_grad_(True)
        log_probs = torch.log_softmax(classifier(x_in, t), dim=-1)
        selected = log_probs[range(len(log_probs)), y.view(-1)]
        return torch.autograd.grad(selected.sum(), x_in)[0] * scale


def respaced(d, steps):
    """SpacedDiffusion: the betas of the kept steps, 1 - abar_k / abar_(previous kept)."""
    last, new = 1.0, []
    for t in steps:
        new.append(1 - d.abar[t].item() / last)
        last = d.abar[t].item()
    return Diffusion(torch.tensor(new, dtype=F64))


def approx_standard_normal_cdf(x):
    return 0.5 * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


def discretized_gaussian_log_likelihood(x, means, log_scales):
    centered = x - means
    inv_stdv = torch.exp(-log_scales)
    cdf_plus = approx_standard_normal_cdf(inv_stdv * (centered + 1.0 / 255.0))
    cdf_min = approx_standard_normal_cdf(inv_stdv * (centered - 1.0 / 255.0))
    log_cdf_plus = torch.log(cdf_plus.clamp(min=1e-12))
    log_one_minus_cdf_min = torch.log((1.0 - cdf_min).clamp(min=1e-12))
    cdf_delta = cdf_plus - cdf_min
    return torch.where(x < -0.999, log_cdf_plus,
                       torch.where(x > 0.999, log_one_minus_cdf_min, torch.log(cdf_delta.clamp(min=1e-12))))


def normal_kl(mean1, logvar1, mean2, logvar2):
    return 0.5 * (-1.0 + logvar2 - logvar1 + torch.exp(logvar1 - logvar2) + (mean1 - mean2) ** 2 * torch.exp(-logvar2))


def bound_terms(d, x0, x_t, out, v, t, predict, clip):
    """The variational bound's term of every value at step t, in nats (_vb_terms_bpd before its mean)."""
    mean, log_var = d.p_mean_variance(x_t, out, v, t, predict, clip)
    if t == 0:
        return -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_var)
    true_mean = d.mean_x0[t] * x0 + d.mean_xt[t] * x_t
    return normal_kl(true_mean, d.posterior_log_variance_clipped[t], mean, log_var)


def prior_terms(d, x0):
    """KL(q(x_T | x0) || N(0, I)) of every value, in nats (_prior_bpd before its mean)."""
    a = d.abar[-1]
    return normal_kl(torch.sqrt(a) * x0, torch.log(1 - a), torch.zeros_like(x0), torch.zeros_like(x0))


class LossSecondMomentResampler:
    """resample.py's importance sampling of t: the last `history` losses of each timestep; uniform
    until every t has them, then p_t proportional to sqrt(mean of t's losses^2), mixed with
    `uniform` of the uniform distribution."""

    def __init__(self, T, history=10, uniform=0.001):
        self.history, self.uniform = history, uniform
        self.losses = torch.zeros(T, history, dtype=F64)
        self.counts = torch.zeros(T, dtype=torch.int64)

    def weights(self):
        T = len(self.counts)
        if not bool((self.counts == self.history).all()):
            return torch.ones(T, dtype=F64) / T
        w = torch.sqrt(torch.mean(self.losses ** 2, dim=-1))
        w = w / w.sum() * (1 - self.uniform) + self.uniform / T
        return w / w.sum()

    def update_with_all_losses(self, ts, losses):
        for t, loss in zip(ts, losses):
            if self.counts[t] == self.history:
                self.losses[t, :-1] = self.losses[t, 1:].clone()
                self.losses[t, -1] = loss
            else:
                self.losses[t, self.counts[t]] = loss
                self.counts[t] += 1


# The project's counter-based draws (random.h): splitmix64's finaliser over (seed, stream, index).
M64 = (1 << 64) - 1
RNG_NLL = 13  # RandomPurpose in train_unet.cu: the likelihood's noise; sub-stream: the kept step


def mix64(z):
    z = np.asarray(z, dtype=np.uint64)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xbf58476d1ce4e5b9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94d049bb133111eb)
    return z ^ (z >> np.uint64(31))


def random_u64(seed, stream, index):
    with np.errstate(over="ignore"):
        key = mix64(np.uint64(seed) ^ mix64(np.uint64((stream + 0x9e3779b97f4a7c15) & M64)))
        return mix64(key + np.asarray(index, dtype=np.uint64))


def normal_sample(seed, stream, index):
    """sampler.h's normal_sample: Box-Muller on two 24-bit uniforms, in float32."""
    index = np.asarray(index, dtype=np.uint64)
    with np.errstate(over="ignore"):
        u1 = ((random_u64(seed, stream, 2 * index) >> np.uint64(40)).astype(np.float32) + np.float32(0.5)) * np.float32(2.0 ** -24)
        u2 = (random_u64(seed, stream, 2 * index + np.uint64(1)) >> np.uint64(40)).astype(np.float32) * np.float32(2.0 ** -24)
    return np.sqrt(np.float32(-2.0) * np.log(u1)) * np.cos(np.float32(2 * math.pi) * u2)
