"""PyTorch .pt files for the .pt reader's tests, written by torch.save itself:

- dev/fixtures/pt/unet_{seed,adm}_{fp32,fp16,bf16}{,_legacy}.pt: the state_dict of our reference
  model (unet_ref.py) holding the weights of dev/fixtures/unet_{seed,adm}.safetensors, as
  torch.save(model.state_dict()) writes it (fp16/bf16: every tensor cast); the zip format, and the
  legacy one (_use_new_zipfile_serialization=False) for fp32 and fp16;
- dev/fixtures/pt/unet_classifier_{attention,adaptive}_fp16{,_legacy}.pt: the same for the noisy
  classifier's fixtures (its EncoderUNetModel), fp16 only; unet_super_res_fp16{,_legacy}.pt for
  the upsampler's (SuperResModel);
- dev/test/corpus/pt/good_torch_views{,_legacy}.pt: a small dict of tensors that share storages
  and start at offsets into them (views), a Parameter, fp16 and bf16 values; values
  arange(n) * 0.25 (see dev/test/test_safetensors.c).

    python3 scripts/make_pt_fixtures.py      # needs PyTorch and safetensors
    python3 scripts/make_pt_fixtures.py super_res   # only that fixture's files
"""

import os
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from unet_ref import create_model  # noqa: E402


def main():
    out = os.path.join(ROOT, "dev", "fixtures", "pt")
    os.makedirs(out, exist_ok=True)
    every = ("fp32", "fp16", "bf16")
    only = sys.argv[1] if len(sys.argv) > 1 else None
    for name, labels in (("seed", every), ("adm", every), ("classifier_attention", ("fp16",)), ("classifier_adaptive", ("fp16",)),
                         ("super_res", ("fp16",))):
        if only not in (None, name):
            continue
        path = os.path.join(ROOT, "dev", "fixtures", f"unet_{name}.safetensors")
        with safe_open(path, "pt") as f:
            meta = f.metadata()
        model = create_model(meta)
        weights = load_file(path)
        model.load_state_dict({k: v for k, v in weights.items() if k in model.state_dict()}, strict=True)
        state = model.state_dict()
        for dtype, label in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
            if label not in labels:
                continue
            cast = type(state)((k, v.to(dtype)) for k, v in state.items())
            cast._metadata = state._metadata
            torch.save(cast, os.path.join(out, f"unet_{name}_{label}.pt"))
            if label != "bf16":
                torch.save(cast, os.path.join(out, f"unet_{name}_{label}_legacy.pt"), _use_new_zipfile_serialization=False)
    if only:
        return
    base = torch.arange(10, dtype=torch.float32) * 0.25
    views = {"view": base[2:5], "whole": base, "row": base.view(2, 5)[1],
             "half": (torch.arange(6, dtype=torch.float32) * 0.25).half().view(2, 3),
             "bf16": (torch.arange(4, dtype=torch.float32) * 0.25).bfloat16(),
             "param": torch.nn.Parameter(torch.arange(3, dtype=torch.float32) * 0.25)}
    corpus = os.path.join(ROOT, "dev", "test", "corpus", "pt")
    torch.save(views, os.path.join(corpus, "good_torch_views.pt"))
    torch.save(views, os.path.join(corpus, "good_torch_views_legacy.pt"), _use_new_zipfile_serialization=False)
    for f in sorted(os.listdir(out)):
        print(f, os.path.getsize(os.path.join(out, f)))
    print("torch", torch.__version__)


if __name__ == "__main__":
    main()
