"""The learned variance's reference: guided-diffusion's diffusion math for a model that learns its
variance (improved DDPM), written here from its formulas in float64 PyTorch, on random inputs:

- respacing: space_timesteps(1000, spec) for section counts and "ddimN";
- the variational bound's term of one value (_vb_terms_bpd before its mean over the image: the KL
  of the posterior q(x_{t-1} | x_t, x0) and the model's Gaussian at t > 0, the discretized Gaussian
  decoder's negative log-likelihood at t = 0), in nats, and its derivatives by the model's output
  (through the mean) and by its variance half v, by autograd;
- p_sample with the learned range on a respaced schedule (SpacedDiffusion's betas).

Written to dev/fixtures/diffusion/learned.safetensors for dev/test/test_sampler_fixture.cu.

    python3 scripts/make_diffusion_fixture.py        # deterministic: the same bytes every time
"""

import math
import os

import torch
from safetensors.torch import save_file

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "fixtures", "diffusion", "learned.safetensors")
T = 1000
SPECS = ["250", "10,20,30", "ddim25", "50,3", "1000", "7"]
F64 = torch.float64


def betas(name):
    if name == "linear":
        return torch.linspace(0.0001, 0.02, T, dtype=F64)
    f = lambda s: math.cos((s + 0.008) / 1.008 * math.pi / 2) ** 2  # noqa: E731
    return torch.tensor([min(1 - f((i + 1) / T) / f(i / T), 0.999) for i in range(T)], dtype=F64)


def space_timesteps(spec):
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

    def x0_from_output(self, x_t, out, t, predict):
        a = self.abar[t]
        if predict == 0:  # eps
            return torch.sqrt(1 / a) * x_t - torch.sqrt(1 / a - 1) * out
        if predict == 1:  # v
            return torch.sqrt(a) * x_t - torch.sqrt(1 - a) * out
        return out

    def p_mean_variance(self, x_t, out, v, t, predict, clip):
        x0 = self.x0_from_output(x_t, out, t, predict)
        if clip:
            x0 = x0.clamp(-1, 1)
        mean = self.mean_x0[t] * x0 + self.mean_xt[t] * x_t
        frac = (v + 1) / 2
        log_var = frac * torch.log(self.betas[t]) + (1 - frac) * self.posterior_log_variance_clipped[t]
        return mean, log_var


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


def as_float32(x):
    """The inputs as the float32 values the C side computes with: the reference then measures only
    the error of its arithmetic (the decoder's x0 - mean, a few thousandths, would otherwise carry
    the inputs' own rounding as a relative 1e-5)."""
    return x.float().double()


def main():
    torch.manual_seed(20261125)
    gen = torch.Generator().manual_seed(20261125)
    rand = lambda *shape: torch.rand(*shape, generator=gen, dtype=F64)  # noqa: E731
    randn = lambda *shape: torch.randn(*shape, generator=gen, dtype=F64)  # noqa: E731
    randint = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=gen))  # noqa: E731
    tensors, n = {}, 96
    for i, spec in enumerate(SPECS):
        tensors[f"respacing_{i}"] = torch.tensor(space_timesteps(spec), dtype=torch.int64)
    diffusions = [Diffusion(betas("linear")), Diffusion(betas("cosine"))]

    # The bound's term: rows [schedule, t, predict], values [x0, x_t, out, v], expected [value, d_out, d_v].
    cases, values, expected = [], [], []
    for r in range(40):
        s, predict = randint(0, 2), randint(0, 3)
        t = 0 if r % 4 == 0 else randint(1, T)
        d = diffusions[s]
        x0 = torch.round((rand(n) * 2 - 1) * 127.5) / 127.5  # pixels, as the loader gives them
        x0[:4] = torch.tensor([-1.0, 1.0, -1.0 + 1 / 127.5, 1.0 - 1 / 127.5], dtype=F64)
        eps = randn(n)
        x_t = torch.sqrt(d.abar[t]) * x0 + torch.sqrt(1 - d.abar[t]) * eps
        # a model's output: the truth with an error (for x0 growing with the noise; at t = 0 the
        # decoder's mean stays within a few pixel bins, where float32 keeps its bins' probabilities)
        truth = [eps, torch.sqrt(d.abar[t]) * eps - torch.sqrt(1 - d.abar[t]) * x0, x0][predict]
        out = truth + randn(n) * (0.3 * torch.sqrt(1 - d.abar[t]) if predict == 2 else 0.5)
        v = rand(n) * 1.8 - 0.9
        x0, x_t, out, v = (as_float32(a) for a in (x0, x_t, out, v))
        out.requires_grad_(True), v.requires_grad_(True)
        mean, log_var = d.p_mean_variance(x_t, out, v, t, predict, clip=False)
        if t == 0:
            value = -discretized_gaussian_log_likelihood(x0, mean, 0.5 * log_var)
        else:
            true_mean = d.mean_x0[t] * x0 + d.mean_xt[t] * x_t
            value = normal_kl(true_mean, d.posterior_log_variance_clipped[t], mean, log_var)
        d_out, d_v = torch.autograd.grad(value.sum(), (out, v))
        cases.append([s, t, predict])
        values.append(torch.stack([x0, x_t, out.detach(), v.detach()]))
        expected.append(torch.stack([value.detach(), d_out, d_v]))
    tensors["bound_cases"] = torch.tensor(cases, dtype=F64)
    tensors["bound_values"] = torch.stack(values)
    tensors["bound_expected"] = torch.stack(expected)

    # p_sample with the learned range on a respaced schedule: rows [schedule, spec (index into
    # SPECS), k (the kept step), predict, clip], values [x, out, v, z], expected x_prev (no noise at k = 0).
    cases, values, expected = [], [], []
    for r in range(32):
        s, spec, predict, clip = randint(0, 2), randint(0, len(SPECS)), randint(0, 3), randint(0, 2)
        steps = space_timesteps(SPECS[spec])
        k = 0 if r % 8 == 0 else randint(0, len(steps))
        d = respaced(diffusions[s], steps)
        x = as_float32(randn(n) * 1.2)
        out, v, z = (as_float32(a) for a in (randn(n) * (0.5 if predict == 2 else 1.0), rand(n) * 2 - 1, randn(n)))
        mean, log_var = d.p_mean_variance(x, out, v, k, predict, clip=bool(clip))
        result = mean + (torch.exp(0.5 * log_var) * z if k > 0 else 0)
        cases.append([s, spec, k, predict, clip])
        values.append(torch.stack([x, out, v, z]))
        expected.append(result)
    tensors["learned_ddpm_cases"] = torch.tensor(cases, dtype=F64)
    tensors["learned_ddpm_values"] = torch.stack(values)
    tensors["learned_ddpm_expected"] = torch.stack(expected)

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, OUT,
              metadata={"generator": "scripts/make_diffusion_fixture.py", "seed": "20261125", "specs": ";".join(SPECS)})
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
