"""Writing a UNet's weights as a safetensors file that ./generate and train_unet read, in plain
Python (standard library only: no torch, numpy or safetensors package needed to run or test it).

    write_safetensors(path, [(name, shape, data), ...], metadata)
        data: the tensor's float32 values as little-endian bytes (anything bytes() accepts),
        C order (PyTorch's contiguous layout), len(data) == 4 * prod(shape).
    model_metadata(flags, num_classes=..., diffusion_steps=..., noise_schedule=..., predict=...)
        the __metadata__ strings generate reads (train_unet.cu: model_config_from_metadata,
        diffusion_from_metadata, unet_inspect's null_class), spelled as train_unet's
        checkpoint_metadata spells them.

The file: an 8-byte little-endian header length, the JSON header {"__metadata__": {...},
"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...} padded with spaces
to a multiple of 8 bytes (so the data starts 8-byte aligned, as checkpoint.h's writer does), then
the tensors' bytes back to back in the order given. It is written to PATH.tmp.PID, synced and
renamed over PATH, and the folder synced: a failure leaves nothing under PATH.

    python3 scripts/test_unet_safetensors.py     checks it (no torch needed)
"""

import json
import math
import os
import struct

# The model flags generate reads from a checkpoint's metadata, in train_unet's order
# (train_unet.cu: model_flags and checkpoint_metadata).
MODEL_FLAG_KEYS = ("image_size", "num_channels", "num_res_blocks", "channel_mult", "attention_resolutions",
                   "num_heads", "num_head_channels", "num_heads_upsample", "use_scale_shift_norm",
                   "resblock_updown", "use_new_attention_order", "conv_resample", "dropout", "class_cond",
                   "num_classes", "null_class", "learn_sigma")

# guided-diffusion's channel_mult for an image size when none is given (script_util.create_model).
DEFAULT_CHANNEL_MULT = {512: "0.5,1,1,2,2,4,4", 256: "1,1,2,2,4,4", 128: "1,1,2,3,4", 64: "1,2,3,4"}

F32 = 4  # bytes per value


def str2bool(v):
    """guided-diffusion's str2bool (and train_unet's parse_bool): yes/true/t/y/1, no/false/f/n/0."""
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in ("yes", "true", "t", "y", "1"):
        return True
    if s in ("no", "false", "f", "n", "0"):
        return False
    raise ValueError(f"boolean value expected, got {v!r}")


def _number_list(text, what):
    """'1, 2,3' -> '1,2,3' (each a positive number, written back as given without spaces)."""
    parts = [p.strip() for p in str(text).split(",") if p.strip()]
    for p in parts:
        if not (math.isfinite(float(p)) and float(p) > 0):
            raise ValueError(f"{what} {text!r}: every entry must be a positive number")
    return ",".join(parts)


def model_metadata(flags, num_classes, diffusion_steps, noise_schedule, predict, extra=None):
    """The metadata of a checkpoint of guided-diffusion's UNet, as train_unet writes it.

    flags: the model's guided-diffusion flags (strings or native values): image_size,
        num_channels, num_res_blocks, channel_mult, attention_resolutions, num_heads,
        num_head_channels, num_heads_upsample, use_scale_shift_norm, resblock_updown,
        use_new_attention_order, conv_resample, dropout, class_cond; learn_sigma if any.
    num_classes: rows of label_emb (the dataset's classes + the null class) when class_cond,
        ignored otherwise (0 is written, as train_unet does).
    extra: more string entries (training configuration, step, ...): they may not replace a
        model or diffusion key.
    Returns a dict of strings."""
    f = dict(flags)
    image_size = int(f["image_size"])
    channel_mult = str(f.get("channel_mult", "")).strip()
    if channel_mult == "":
        if image_size not in DEFAULT_CHANNEL_MULT:
            raise ValueError(f"no default channel_mult for image_size {image_size}")
        channel_mult = DEFAULT_CHANNEL_MULT[image_size]
    num_heads = int(f.get("num_heads", 4))
    num_heads_upsample = int(f.get("num_heads_upsample", -1))
    if num_heads_upsample == -1:  # train_unet stores the resolved count
        num_heads_upsample = num_heads
    class_cond = str2bool(f.get("class_cond", False))
    if class_cond and int(num_classes) < 2:
        raise ValueError(f"class_cond with {num_classes} label_emb rows: at least one class and the null class")
    if noise_schedule not in ("linear", "cosine"):
        raise ValueError(f"noise_schedule {noise_schedule!r}: linear or cosine")
    if predict not in ("eps", "v"):
        raise ValueError(f"predict {predict!r}: eps or v")
    if not 1 <= int(diffusion_steps) <= 100000:
        raise ValueError(f"diffusion_steps {diffusion_steps}: 1 to 100000")
    truth = lambda b: "True" if b else "False"  # noqa: E731
    m = {
        "image_size": str(image_size),
        "num_channels": str(int(f["num_channels"])),
        "num_res_blocks": str(int(f["num_res_blocks"])),
        "channel_mult": _number_list(channel_mult, "channel_mult"),
        "attention_resolutions": _number_list(f.get("attention_resolutions", ""), "attention_resolutions"),
        "num_heads": str(num_heads),
        "num_head_channels": str(int(f.get("num_head_channels", -1))),
        "num_heads_upsample": str(num_heads_upsample),
        "use_scale_shift_norm": truth(str2bool(f["use_scale_shift_norm"])),
        "resblock_updown": truth(str2bool(f["resblock_updown"])),
        "use_new_attention_order": truth(str2bool(f["use_new_attention_order"])),
        "conv_resample": truth(str2bool(f["conv_resample"])),
        "dropout": f"{float(f.get('dropout', 0.0)):g}",  # train_unet: "%g"
        "class_cond": truth(class_cond),
        "num_classes": str(int(num_classes) if class_cond else 0),
        "null_class": truth(class_cond),  # the last label_emb row is the unconditional label
        "learn_sigma": truth(str2bool(f.get("learn_sigma", False))),
        "diffusion_steps": str(int(diffusion_steps)),
        "noise_schedule": noise_schedule,
        "predict": predict,
    }
    for k, v in (extra or {}).items():
        if k in m:
            raise ValueError(f"metadata key {k!r} would replace the model's")
        m[str(k)] = str(v)
    return m


def _header(tensors, metadata):
    """The padded JSON header (bytes) and the list of data blobs, checked."""
    header = {"__metadata__": {}}
    for k, v in metadata.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise TypeError(f"metadata must map strings to strings: {k!r}: {v!r}")
        if "\0" in k or "\0" in v:
            raise ValueError(f"metadata {k!r}: NUL characters are refused by the readers")
        header["__metadata__"][k] = v
    blobs, offset = [], 0
    for name, shape, data in tensors:
        if not isinstance(name, str) or not name or name == "__metadata__" or "\0" in name:
            raise ValueError(f"bad tensor name {name!r}")
        if name in header:
            raise ValueError(f"tensor {name} given twice")
        shape = [int(d) for d in shape]
        if len(shape) > 8 or any(d < 0 for d in shape):
            raise ValueError(f"tensor {name}: bad shape {shape}")
        blob = memoryview(data).cast("B")  # any bytes-like object, without a copy
        numel = math.prod(shape)
        if blob.nbytes != F32 * numel:
            raise ValueError(f"tensor {name}: {blob.nbytes} bytes for shape {shape} ({numel} float32 values need "
                             f"{F32 * numel})")
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + blob.nbytes]}
        blobs.append(blob)
        offset += blob.nbytes
    text = json.dumps(header, separators=(",", ":")).encode("ascii")  # non-ASCII as \u escapes
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    return text, blobs


def write_safetensors(path, tensors, metadata):
    """Writes tensors [(name, shape, little-endian float32 bytes), ...] and metadata {str: str}
    to path, atomically (a temporary file in the same folder, synced, renamed over path)."""
    text, blobs = _header(tensors, metadata)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(text)))
            f.write(text)
            for blob in blobs:
                f.write(blob)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_safetensors(path):
    """(metadata, {name: (dtype, shape, bytes)}) of a safetensors file, checked as checkpoint.h
    checks it (header bounds, tiling offsets, string metadata). For tests and inspection."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short")
    n = struct.unpack("<Q", raw[:8])[0]
    if n < 2 or n > len(raw) - 8:
        raise ValueError(f"{path}: header length {n} does not fit the file")
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    metadata = header.pop("__metadata__", {})
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
        raise ValueError(f"{path}: metadata values must be strings")
    sizes = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4}
    tensors, spans = {}, []
    for name, e in header.items():
        if set(e) != {"dtype", "shape", "data_offsets"}:
            raise ValueError(f"{path}: tensor {name}: entry keys {sorted(e)}")
        b, end = e["data_offsets"]
        if end - b != sizes[e["dtype"]] * math.prod(e["shape"]):
            raise ValueError(f"{path}: tensor {name}: offsets do not hold its values")
        tensors[name] = (e["dtype"], list(e["shape"]), data[b:end])
        spans.append((b, end, name))
    at = 0
    for b, end, name in sorted(spans):
        if b != at:
            raise ValueError(f"{path}: tensor {name} begins at {b}, not {at}")
        at = end
    if at != len(data):
        raise ValueError(f"{path}: {len(data) - at} bytes after the last tensor")
    return metadata, tensors
