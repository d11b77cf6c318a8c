"""The learned variance's reference: guided-diffusion's diffusion math for a model that learns its
variance (improved DDPM), by our PyTorch reference (diffusion_ref.py, float64), on random inputs:

- respacing: space_timesteps(1000, spec) for section counts and "ddimN";
- the variational bound's term of one value (_vb_terms_bpd before its mean over the image: the KL
  of the posterior q(x_{t-1} | x_t, x0) and the model's Gaussian at t > 0, the discretized Gaussian
  decoder's negative log-likelihood at t = 0), in nats, and its derivatives by the model's output
  (through the mean) and by its variance half v, by autograd;
- p_sample with the learned range on a respaced schedule (SpacedDiffusion's betas);
- the schedule sampler loss-second-moment: the distribution of t after a sequence of losses.

Written to dev/fixtures/diffusion/learned.safetensors for dev/test/test_sampler_fixture.cu.

    python3 scripts/make_diffusion_fixture.py        # deterministic: the same bytes every time
"""

import os
import sys

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diffusion_ref import F64, Diffusion, LossSecondMomentResampler, betas_for, bound_terms, respaced, space_timesteps  # noqa: E402

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "dev", "fixtures", "diffusion", "learned.safetensors")
T = 1000
SPECS = ["250", "10,20,30", "ddim25", "50,3", "1000", "7"]


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
        tensors[f"respacing_{i}"] = torch.tensor(space_timesteps(T, spec), dtype=torch.int64)
    diffusions = [Diffusion(betas_for("linear", T)), Diffusion(betas_for("cosine", T))]

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
        value = bound_terms(d, x0, x_t, out, v, t, predict, clip=False)
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
        steps = space_timesteps(T, SPECS[spec])
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

    # The schedule sampler on 8 timesteps: losses [count] (t, loss; t's losses of its own size), and
    # the distribution of t after the first `after[j]` of them (uniform while some t lacks its 10).
    resampler, count, after = LossSecondMomentResampler(8), 240, [20, 90, 160, 240]
    ts = torch.randint(0, 8, (count,), generator=gen)
    losses = as_float32((ts.double() + 1) * (0.2 + rand(count)))
    distributions = []
    for i in range(count):
        resampler.update_with_all_losses([int(ts[i])], [losses[i]])
        if i + 1 in after:
            distributions.append(resampler.weights())
    tensors["resampler_losses"] = torch.stack([ts.double(), losses], dim=1)
    tensors["resampler_after"] = torch.tensor(after, dtype=torch.int64)
    tensors["resampler_p"] = torch.stack(distributions)

    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file({k: v.contiguous() for k, v in sorted(tensors.items())}, OUT,
              metadata={"generator": "scripts/make_diffusion_fixture.py", "seed": "20261125", "specs": ";".join(SPECS)})
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
