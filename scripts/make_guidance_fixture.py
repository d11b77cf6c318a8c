"""Classifier guidance's reference: one sampling step of guided-diffusion's classifier_sample.py in
float64 PyTorch, on the committed fixtures' models (scripts/make_fixtures.py: their stored weights,
exact in float64): cond_fn (the gradient of the classifier's log_softmax at the asked labels,
times the scale, by autograd) with p_sample's condition_mean, and with ddim_sample's
condition_score. Written to dev/fixtures/samplers/guided_step.safetensors for
dev/test/test_sampler_gpu.cu, which runs the same step in the GPU sampler's graph.

    python3 scripts/make_guidance_fixture.py      # deterministic: the same bytes every time

Cases (the diffusion model and classifier fixtures, 1000 linear steps, clip_denoised):
    ddpm_fixed    unet_seed (eps, no learned variance: the fixed small variance, whose unclipped
                  posterior variance multiplies the gradient), classifier_attention, t = 500 of
                  all 1000 steps, scale 100 (the random classifier's gradient is small: at scale
                  100 it moves the mean by about 1% of its norm)
    ddpm_learned  unet_adm (learn_sigma, class-conditional: y goes to both models), classifier_attention,
                  t = 300 of all 1000 steps, scale 100: the learned variance multiplies the gradient
    ddim          unet_seed, classifier_attention, DDIM with eta 0 on ddim10's steps, t = 600 to
                  t = 500, scale 3
Tensors per case C (NCHW, float64 results):
    C.x [N,3,H,W] F32   x_t (the step's input; N(0,1) draws)
    C.y [N] I64         the asked labels
    C.t [1] I64         the model's timestep (the original, unrespaced)
    C.scale [1] F64     classifier_scale
    C.mean [N,3,H,W]    the guided step's mean (DDIM: its result)
    C.noise_scale [N,3,H,W]  exp(0.5 log variance) (0 for DDIM with eta 0): the sample is
                        mean + noise_scale z for the step's normal draws z
    C.unguided [N,3,H,W]  the mean without guidance (the test checks that guidance moved it)
"""

import math
import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from diffusion_ref import Diffusion, betas_for, cond_fn, space_timesteps  # noqa: E402
from unet_ref import create_model  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "dev", "fixtures")
OUT = os.path.join(FIXTURES, "samplers", "guided_step.safetensors")
F64 = torch.float64


def load_model(name):
    """A fixture's model in float64 with its stored parameters."""
    path = os.path.join(FIXTURES, f"unet_{name}.safetensors")
    with safe_open(path, "pt") as f:
        cfg = f.metadata()
        model = create_model(cfg).double()
        names = set(model.state_dict())
        model.load_state_dict({k: f.get_tensor(k).double() for k in names}, strict=True)
    return model.eval(), cfg


def x0_of(d, x, eps, t):
    return (torch.sqrt(1 / d.abar[t]) * x - torch.sqrt(1 / d.abar[t] - 1) * eps).clamp(-1, 1)


def ddpm_case(model, cfg, classifier, gen, t, y, scale):
    """p_sample at t with condition_mean: mean + variance * cond_fn (the fixed small variance or the learned one)."""
    d = Diffusion(betas_for("linear", 1000))
    size = int(cfg["image_size"])
    x = torch.randn(len(y), 3, size, size, generator=gen, dtype=torch.float32)
    ts = torch.full((len(y),), t, dtype=torch.int64)
    with torch.no_grad():
        out = model(x.double(), ts, y if cfg.get("class_cond") == "True" else None)
    eps = out[:, :3]
    x0 = x0_of(d, x.double(), eps, t)
    mean = d.mean_x0[t] * x0 + d.mean_xt[t] * x.double()
    if out.shape[1] == 6:  # LEARNED_RANGE
        frac = (out[:, 3:] + 1) / 2
        log_variance = frac * torch.log(d.betas[t]) + (1 - frac) * d.posterior_log_variance_clipped[t]
        variance = torch.exp(log_variance)
    else:  # FIXED_SMALL
        log_variance = d.posterior_log_variance_clipped[t].expand_as(mean)
        variance = d.posterior_variance[t].expand_as(mean)
    guided = mean + variance * cond_fn(classifier, x.double(), ts, y, scale)
    return dict(x=x, y=y, t=torch.tensor([t]), scale=torch.tensor([scale], dtype=F64), mean=guided,
                noise_scale=torch.exp(0.5 * log_variance), unguided=mean)


def ddim_case(model, cfg, classifier, gen, steps, t, y, scale):
    """ddim_sample (eta 0) on the respaced steps at t with condition_score."""
    d = Diffusion(betas_for("linear", 1000))
    kept = space_timesteps(1000, f"ddim{steps}")
    k = kept.index(t)
    a, a_prev = d.abar[t], d.abar[kept[k - 1]] if k > 0 else torch.tensor(1.0, dtype=F64)
    size = int(cfg["image_size"])
    x = torch.randn(len(y), 3, size, size, generator=gen, dtype=torch.float32)
    ts = torch.full((len(y),), t, dtype=torch.int64)
    with torch.no_grad():
        eps_model = model(x.double(), ts)
    x0 = x0_of(d, x.double(), eps_model, t)

    def step(x0):
        eps = (torch.sqrt(1 / a) * x.double() - x0) / torch.sqrt(1 / a - 1)
        return x0 * torch.sqrt(a_prev) + torch.sqrt(1 - a_prev) * eps

    unguided = step(x0)
    eps = (torch.sqrt(1 / a) * x.double() - x0) / torch.sqrt(1 / a - 1)
    eps = eps - torch.sqrt(1 - a) * cond_fn(classifier, x.double(), ts, y, scale)
    guided = step(torch.sqrt(1 / a) * x.double() - torch.sqrt(1 / a - 1) * eps)
    return dict(x=x, y=y, t=torch.tensor([t]), scale=torch.tensor([scale], dtype=F64), mean=guided,
                noise_scale=torch.zeros_like(guided), unguided=unguided)


def main():
    torch.set_grad_enabled(False)
    gen = torch.Generator().manual_seed(20261126)
    seed_model, seed_cfg = load_model("seed")
    adm_model, adm_cfg = load_model("adm")
    classifier, _ = load_model("classifier_attention")
    y = torch.tensor([3, 0], dtype=torch.int64)  # of the classifier's 5 (and the adm model's 10) classes
    cases = {
        "ddpm_fixed": ddpm_case(seed_model, seed_cfg, classifier, gen, 500, y, 100.0),
        "ddpm_learned": ddpm_case(adm_model, adm_cfg, classifier, gen, 300, y, 100.0),
        "ddim": ddim_case(seed_model, seed_cfg, classifier, gen, 10, 600, y, 3.0),
    }
    tensors = {}
    for name, case in cases.items():
        moved = (case["mean"] - case["unguided"]).norm() / case["mean"].norm()
        print(f"{name}: guidance moves the mean by {moved:.3e} of its norm")
        for key, value in case.items():
            tensors[f"{name}.{key}"] = value.clone().contiguous()
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    save_file(tensors, OUT)  # no metadata: its order in the file is not fixed
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")


if __name__ == "__main__":
    main()
