#!/usr/bin/env python3
"""Checks scripts/unet_safetensors.py (the safetensors writer train_torch.py --save uses) with the
standard library only:

    python3 scripts/test_unet_safetensors.py

1. A round trip: tensors and metadata written, read back byte for byte; the header 8-byte padded.
2. Failures leave nothing behind: a bad tensor, an unwritable folder; a file already there stays.
3. model_metadata for the class-conditional seed preset spells every key as train_unet writes it.
4. When ./generate is built: the committed PyTorch fixtures (dev/fixtures/unet_{seed,conv_resample},
   names and shapes from unet_ref.py), rewritten as F32 through the writer with model_metadata's
   flags, are accepted by generate's checkpoint reader (unet_inspect: metadata -> model, every
   tensor's name, shape and finite values). Without a GPU, generate stops after that check with
   "no NVIDIA GPU"; with one, `generate --eval` on the rewritten file must give the same bytes as
   on the fixture itself.
5. When torch is installed: train_torch.save_weights on the seed preset's model (class-conditional,
   channels-last as train_torch trains it) through ./generate the same way.
Prints ok/FAIL per check, then "N passed, N failed" (dev/test/run_tests.sh runs it with the CPU tests),
and exits 1 on a failure.
"""

import os
import shutil
import struct
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True  # leave no __pycache__ in scripts/
HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from unet_safetensors import model_metadata, read_safetensors, write_safetensors  # noqa: E402

passes = failures = 0


def check(ok, what):
    global passes, failures
    print(("ok   " if ok else "FAIL ") + what, flush=True)
    passes += bool(ok)
    failures += not ok


def f32(values):
    return struct.pack(f"<{len(values)}f", *values)


def expect_raise(fn, what):
    try:
        fn()
    except (ValueError, TypeError, OSError):
        return check(True, what)
    check(False, what + " (no error)")


# The seed preset's flags as train_torch.py resolves them (bench_torch.PRESETS["seed"] over
# unet_ref.DEFAULTS), class-conditional on shapes: 3 classes + the null class.
SEED_FLAGS = dict(image_size="64", num_channels="64", channel_mult="1,2,3,4", num_res_blocks="2",
                  attention_resolutions="16,8", num_head_channels="32", use_scale_shift_norm="False",
                  resblock_updown="False", conv_resample="False", use_new_attention_order="False", dropout="0.0",
                  num_heads=4, num_heads_upsample=-1, class_cond=True, learn_sigma=False, num_classes=4)

# What train_unet's checkpoint_metadata writes for `--class_cond True` on shapes (train_unet.cu).
SEED_EXPECTED = {
    "image_size": "64", "num_channels": "64", "num_res_blocks": "2", "channel_mult": "1,2,3,4",
    "attention_resolutions": "16,8", "num_heads": "4", "num_head_channels": "32", "num_heads_upsample": "4",
    "use_scale_shift_norm": "False", "resblock_updown": "False", "use_new_attention_order": "False",
    "conv_resample": "False", "dropout": "0", "class_cond": "True", "num_classes": "4", "null_class": "True",
    "learn_sigma": "False", "diffusion_steps": "1000", "noise_schedule": "linear", "predict": "eps",
}


def generate_accepts(path, tmp, fixture=None):
    """Runs ./generate on path: (accepted, output). Accepted: it read the checkpoint and either
    had no GPU to go on with, or (with --eval on a fixture) ran."""
    exe = os.path.join(ROOT, "generate")
    if fixture:
        cmd = [exe, "--checkpoint", path, "--eval", fixture, "--output", os.path.join(tmp, "out.safetensors")]
    else:
        cmd = [exe, "--checkpoint", path, "--num", "3", "--batch", "3", "--out", os.path.join(tmp, "samples")]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    out = (r.stdout + r.stderr).strip()
    return r.returncode == 0 or "no NVIDIA GPU or driver found" in out, r.returncode, out


def main():
    tmp = tempfile.mkdtemp(prefix="test_unet_safetensors_")
    try:
        run(tmp)
    finally:
        shutil.rmtree(tmp)
    print(f"{passes} passed, {failures} failed")
    return 1 if failures else 0


def run(tmp):
    # 1. Round trip.
    path = os.path.join(tmp, "a.safetensors")
    tensors = [("b.weight", [2, 3], f32([1, 2, 3, 4, 5, 6])), ("a", [1], f32([-0.5])), ("scalar", [], f32([7])),
               ("empty", [0, 4], b""), ("caf\u00e9 \"q\"", [2], bytearray(f32([1e-30, 3e38])))]
    meta = {"k": "v", "unicode \u20ac": "line\nbreak \"quoted\" \\"}
    write_safetensors(path, tensors, meta)
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    check(n % 8 == 0 and raw[8:8 + n].rstrip(b" ").endswith(b"}"), "header padded with spaces to 8 bytes")
    got_meta, got = read_safetensors(path)
    check(got_meta == meta, "metadata read back")
    check(list(got) == [t[0] for t in tensors], "tensors in the order given")
    check(all(got[name] == ("F32", shape, bytes(data)) for name, shape, data in tensors), "dtype, shapes and bytes")
    check(raw[8 + n:] == b"".join(bytes(t[2]) for t in tensors), "data back to back after the header")
    check(sorted(os.listdir(tmp)) == ["a.safetensors"], "no temporary file left")

    # 2. Failures leave nothing half-written.
    expect_raise(lambda: write_safetensors(path, [("x", [3], f32([1, 2]))], {}), "wrong byte count refused")
    expect_raise(lambda: write_safetensors(path, [("x", [1], f32([1])), ("x", [1], f32([1]))], {}),
                 "duplicate name refused")
    expect_raise(lambda: write_safetensors(path, [("__metadata__", [1], f32([1]))], {}), "the name __metadata__ refused")
    expect_raise(lambda: write_safetensors(path, [], {"k": 1}), "a metadata value that is no string refused")
    expect_raise(lambda: write_safetensors(os.path.join(tmp, "no", "such.safetensors"), tensors, {}),
                 "a missing folder refused")
    check(open(path, "rb").read() == raw, "the file already there unchanged after the failures")
    check(sorted(os.listdir(tmp)) == ["a.safetensors"], "no temporary file left after the failures")

    # 3. The metadata train_unet writes, for the class-conditional seed preset.
    m = model_metadata(SEED_FLAGS, num_classes=4, diffusion_steps=1000, noise_schedule="linear", predict="eps",
                       extra={"step": "2000"})
    check({k: m[k] for k in SEED_EXPECTED} == SEED_EXPECTED and m["step"] == "2000",
          "seed preset metadata as train_unet spells it")
    unconditional = model_metadata({**SEED_FLAGS, "class_cond": "False"}, num_classes=1, diffusion_steps=1000,
                                    noise_schedule="linear", predict="eps")
    check(unconditional["class_cond"] == "False" and unconditional["num_classes"] == "0"
          and unconditional["null_class"] == "False", "unconditional: num_classes 0, no null class")
    check(model_metadata({**SEED_FLAGS, "channel_mult": ""}, 4, 1000, "linear", "eps")["channel_mult"] == "1,2,3,4",
          "an empty channel_mult resolved as train_unet does")
    check(model_metadata({**SEED_FLAGS, "learn_sigma": "True"}, 4, 1000, "linear", "eps")["learn_sigma"] == "True",
          "learn_sigma recorded as train_unet records it")
    expect_raise(lambda: model_metadata(SEED_FLAGS, 4, 1000, "linear", "eps", extra={"num_classes": "9"}),
                 "extra metadata cannot replace a model key")

    # 4. The fixtures through the writer, read by generate.
    if not os.access(os.path.join(ROOT, "generate"), os.X_OK):
        print("skip ./generate is not built: the C reader checks are left out")
    else:
        for name in ("seed", "conv_resample"):
            fixture = os.path.join(ROOT, "dev", "fixtures", f"unet_{name}.safetensors")
            fmeta, ften = read_safetensors(fixture)
            params = []
            for tname, (dtype, shape, data) in ften.items():
                if tname in ("x", "t", "y", "target", "out", "loss") or tname.startswith("grad."):
                    continue
                assert dtype == "BF16", (tname, dtype)
                # bf16 -> f32 is exact: the bf16 bits are the high half of the f32's.
                params.append((tname, shape, b"".join(b"\0\0" + data[i:i + 2] for i in range(0, len(data), 2))))
            meta = model_metadata(fmeta, num_classes=fmeta.get("num_classes", 0), diffusion_steps=1000,
                                  noise_schedule="linear", predict="eps", extra={"format": "test"})
            rewritten = os.path.join(tmp, f"{name}.safetensors")
            write_safetensors(rewritten, params, meta)
            ok, rc, out = generate_accepts(rewritten, tmp)
            check(ok, f"generate reads the fixture {name} rewritten ({len(params)} tensors): {out.splitlines()[-1]}")
            ok, rc, out = generate_accepts(rewritten, tmp, fixture)
            if ok and rc == 0:  # a GPU: the same output as from the fixture's own bf16 weights
                mine = read_safetensors(os.path.join(tmp, "out.safetensors"))[1]["out"]
                generate_accepts(fixture, tmp, fixture)
                theirs = read_safetensors(os.path.join(tmp, "out.safetensors"))[1]["out"]
                check(mine == theirs, f"generate --eval: the rewritten {name} gives the fixture's output bytes")

    # 5. train_torch.save_weights on the real model, when torch is here.
    try:
        import torch  # noqa: F401
    except ImportError:
        print("skip torch is not installed: train_torch.save_weights is not run")
        return
    import train_torch
    from unet_ref import DEFAULTS, create_model
    torch.manual_seed(0)
    model = create_model(SEED_FLAGS).to(memory_format=torch.channels_last)
    weights = [p.detach().clone() for p in model.parameters()]
    meta = model_metadata({**DEFAULTS, **SEED_FLAGS}, num_classes=4, diffusion_steps=1000, noise_schedule="linear",
                          predict="eps")
    saved = os.path.join(tmp, "torch.safetensors")
    train_torch.save_weights(saved, model, weights, meta)
    _, got = read_safetensors(saved)
    state = model.state_dict()
    check(sorted(got) == sorted(state) and all(
        got[k][1] == list(v.shape) and got[k][2] == v.contiguous().numpy().astype("<f4").tobytes()
        for k, v in state.items()), "save_weights: every state_dict tensor, name, shape and C-order bytes")
    if os.access(os.path.join(ROOT, "generate"), os.X_OK):
        ok, rc, out = generate_accepts(saved, tmp)
        check(ok, f"generate reads save_weights' seed preset file: {out.splitlines()[-1] if out else ''}")


if __name__ == "__main__":
    sys.exit(main())
