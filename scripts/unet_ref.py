"""PyTorch reference of guided-diffusion's UNetModel and of its noisy-image classifier
EncoderUNetModel (openai/guided-diffusion, unet.py).

Written independently, but with the same constructor arguments, submodule names and
parameter shapes, so state_dicts move between this module and guided-diffusion with
load_state_dict(strict=True). Only the 2-D case is implemented (no dims, use_fp16,
use_checkpoint: they do not change the math or the parameters).

The classifier (EncoderUNetModel) is the UNet's time_embed, input_blocks and middle_block
(the same blocks, built by the same code), no label_emb and no output_blocks, then a head
`out` chosen by classifier_pool (adaptive, attention, spatial, spatial_v2) giving logits
[N, num_classes]; forward(x, t). create_model builds it when the flags have a non-empty
classifier_pool; its other flags are the UNet's names (see classifier_kwargs).

Precision: in float32 this computes what guided-diffusion computes. In float64
(model.double()) everything, including the timestep sinusoid, GroupNorm and softmax,
stays in float64; that is how the test fixtures are made.

    python3 scripts/unet_ref.py --image_size 64 --num_channels 64 --channel_mult 1,2,3,4 ...
prints the parameter count for a config given with guided-diffusion's flag names (with
--classifier_pool attention --num_head_channels 64 --num_classes 1000: the classifier's).
"""

import argparse
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from unet_safetensors import str2bool  # one definition, standard library only (scripts/ is on the path)


def _compute_dtype(dtype):
    """float16/bfloat16 -> float32; float32 and float64 unchanged."""
    return torch.promote_types(dtype, torch.float32)


class GroupNorm32(nn.GroupNorm):
    """GroupNorm with 32 groups, eps 1e-5, computed in at least float32:
    y = (x - mean_g) / sqrt(var_g + eps) * weight_c + bias_c, with mean/var (biased)
    over the C/32 channels of group g and all pixels of one image."""

    def __init__(self, channels):
        super().__init__(32, channels)

    def forward(self, x):
        return super().forward(x.to(_compute_dtype(x.dtype))).type(x.dtype)


def zero_module(module):
    """Zero a module's parameters (guided-diffusion's init for the last conv of each
    residual branch and of the network)."""
    for p in module.parameters():
        p.detach().zero_()
    return module


def timestep_embedding(t, dim, max_period=10000, dtype=torch.float32):
    """Sinusoidal embedding, [N] -> [N, dim]:
    half = dim // 2, freq_i = exp(-ln(max_period) * i / half) for i < half,
    emb = [cos(t * freq_0..half-1), sin(t * freq_0..half-1)], one zero column if dim is odd.
    Computed in `dtype` (float32 reproduces guided-diffusion bit for bit)."""
    half = dim // 2
    freqs = torch.exp(
        -math.log(max_period) * torch.arange(half, dtype=dtype, device=t.device) / half
    )
    args = t[:, None].to(dtype) * freqs[None]
    emb = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        emb = torch.cat([emb, torch.zeros_like(emb[:, :1])], dim=-1)
    return emb


class TimestepBlock(nn.Module):
    """A module whose forward takes the embedding as a second argument."""


class TimestepEmbedSequential(nn.Sequential, TimestepBlock):
    """Sequential that hands the embedding to the children that take it."""

    def forward(self, x, emb):
        for layer in self:
            x = layer(x, emb) if isinstance(layer, TimestepBlock) else layer(x)
        return x


class Upsample(nn.Module):
    """Nearest-neighbour 2x upsampling, then (use_conv) a 3x3 conv, padding 1."""

    def __init__(self, channels, use_conv, out_channels=None):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        if use_conv:
            self.conv = nn.Conv2d(channels, self.out_channels, 3, padding=1)

    def forward(self, x):
        x = F.interpolate(x, scale_factor=2, mode="nearest")
        return self.conv(x) if self.use_conv else x


class Downsample(nn.Module):
    """2x downsampling: a 3x3 conv with stride 2, padding 1 (use_conv), else 2x2 average
    pooling. Sizes must stay even at every level, or the skip concatenation fails."""

    def __init__(self, channels, use_conv, out_channels=None):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_conv = use_conv
        if use_conv:
            self.op = nn.Conv2d(channels, self.out_channels, 3, stride=2, padding=1)
        else:
            assert channels == self.out_channels
            self.op = nn.AvgPool2d(kernel_size=2, stride=2)

    def forward(self, x):
        return self.op(x)


class ResBlock(TimestepBlock):
    """Residual block conditioned on the embedding e:

        h = conv3x3(SiLU(GN(x)))                  in_layers (0 GN, 1 SiLU, 2 conv)
            (up/down: resample between SiLU and conv: conv(upd(SiLU(GN(x)))), x = upd(x))
        s = Linear(SiLU(e))                       emb_layers (0 SiLU, 1 linear)
        scale-shift:  h = GN(h) * (1 + s[:C]) + s[C:], then SiLU, dropout, conv
        otherwise:    h = h + s, then GN, SiLU, dropout, conv
                                                  out_layers (0 GN, 1 SiLU, 2 dropout, 3 conv=0)
        out = skip(x) + h                         skip: identity, 1x1 conv or (use_conv) 3x3 conv
    """

    def __init__(self, channels, emb_channels, dropout, out_channels=None, use_conv=False,
                 use_scale_shift_norm=False, up=False, down=False):
        super().__init__()
        self.channels = channels
        self.out_channels = out_channels or channels
        self.use_scale_shift_norm = use_scale_shift_norm
        c_out = self.out_channels

        self.in_layers = nn.Sequential(
            GroupNorm32(channels), nn.SiLU(), nn.Conv2d(channels, c_out, 3, padding=1)
        )
        self.updown = up or down
        if up:
            self.h_upd = Upsample(channels, False)
            self.x_upd = Upsample(channels, False)
        elif down:
            self.h_upd = Downsample(channels, False)
            self.x_upd = Downsample(channels, False)
        else:
            self.h_upd = self.x_upd = nn.Identity()

        self.emb_layers = nn.Sequential(
            nn.SiLU(), nn.Linear(emb_channels, 2 * c_out if use_scale_shift_norm else c_out)
        )
        self.out_layers = nn.Sequential(
            GroupNorm32(c_out), nn.SiLU(), nn.Dropout(p=dropout),
            zero_module(nn.Conv2d(c_out, c_out, 3, padding=1)),
        )
        if c_out == channels:
            self.skip_connection = nn.Identity()
        elif use_conv:
            self.skip_connection = nn.Conv2d(channels, c_out, 3, padding=1)
        else:
            self.skip_connection = nn.Conv2d(channels, c_out, 1)

    def forward(self, x, emb):
        if self.updown:
            h = self.in_layers[:-1](x)
            h = self.in_layers[-1](self.h_upd(h))
            x = self.x_upd(x)
        else:
            h = self.in_layers(x)
        s = self.emb_layers(emb).type(h.dtype)[:, :, None, None]
        if self.use_scale_shift_norm:
            scale, shift = s.chunk(2, dim=1)
            h = self.out_layers[0](h) * (1 + scale) + shift
            h = self.out_layers[1:](h)
        else:
            h = self.out_layers(h + s)
        return self.skip_connection(x) + h


def _attend(q, k, v):
    """q, k, v: [B*heads, ch, T] -> [B*heads, ch, T].
    w = softmax_s((q_t / ch^1/4) . (k_s / ch^1/4)), out_t = sum_s w_ts v_s.
    The softmax runs in at least float32."""
    scale = 1 / math.sqrt(math.sqrt(q.shape[1]))
    w = torch.einsum("bct,bcs->bts", q * scale, k * scale)
    w = torch.softmax(w.to(_compute_dtype(w.dtype)), dim=-1).type(w.dtype)
    return torch.einsum("bts,bcs->bct", w, v)


class QKVAttentionLegacy(nn.Module):
    """qkv channels ordered head-major: [head 0: q k v | head 1: q k v | ...],
    each of q, k, v being ch = C/heads channels."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        b, width, t = qkv.shape
        ch = width // (3 * self.n_heads)
        q, k, v = qkv.reshape(b * self.n_heads, 3 * ch, t).split(ch, dim=1)
        return _attend(q, k, v).reshape(b, -1, t)


class QKVAttention(nn.Module):
    """qkv channels ordered q-k-v-major (use_new_attention_order):
    [q: head 0..H-1 | k: head 0..H-1 | v: head 0..H-1], each head ch = C/heads channels."""

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads

    def forward(self, qkv):
        b, width, t = qkv.shape
        ch = width // (3 * self.n_heads)
        q, k, v = (z.reshape(b * self.n_heads, ch, t) for z in qkv.chunk(3, dim=1))
        return _attend(q, k, v).reshape(b, -1, t)


class AttentionBlock(nn.Module):
    """Self-attention over the H*W pixels: out = x + proj_out(attention(qkv(GN(x)))),
    qkv a 1x1 Conv1d C -> 3C, proj_out a zero-initialised 1x1 Conv1d C -> C.
    Heads: C / num_head_channels if num_head_channels != -1, else num_heads."""

    def __init__(self, channels, num_heads=1, num_head_channels=-1,
                 use_new_attention_order=False):
        super().__init__()
        self.channels = channels
        if num_head_channels == -1:
            self.num_heads = num_heads
        else:
            assert channels % num_head_channels == 0, (channels, num_head_channels)
            self.num_heads = channels // num_head_channels
        self.norm = GroupNorm32(channels)
        self.qkv = nn.Conv1d(channels, 3 * channels, 1)
        attention = QKVAttention if use_new_attention_order else QKVAttentionLegacy
        self.attention = attention(self.num_heads)
        self.proj_out = zero_module(nn.Conv1d(channels, channels, 1))

    def forward(self, x):
        b, c, hgt, wid = x.shape
        x = x.reshape(b, c, hgt * wid)
        h = self.proj_out(self.attention(self.qkv(self.norm(x))))
        return (x + h).reshape(b, c, hgt, wid)


def _block_makers(emb_dim, dropout, use_scale_shift_norm, num_head_channels,
                  use_new_attention_order):
    """The two block constructors with a model's shared settings:
    resblock(c_in, c_out, up=/down=) and attention(channels, heads)."""

    def resblock(c_in, c_out, **updown):
        return ResBlock(c_in, emb_dim, dropout, out_channels=c_out,
                        use_scale_shift_norm=use_scale_shift_norm, **updown)

    def attention(c, heads):
        return AttentionBlock(c, num_heads=heads, num_head_channels=num_head_channels,
                              use_new_attention_order=use_new_attention_order)

    return resblock, attention


def _input_and_middle(in_channels, model_channels, channel_mult, num_res_blocks,
                      attention_resolutions, conv_resample, resblock_updown, num_heads,
                      resblock, attention):
    """input_blocks and middle_block, built alike by UNetModel and EncoderUNetModel.
    Returns (input_blocks, middle_block, chans, ds): chans the output channels of every
    input block in order (the UNet's skip stack; chans[-1] is also the middle block's), ds
    the downsampling factor of the last level (2^(levels-1))."""
    ch = int(channel_mult[0] * model_channels)
    input_blocks = nn.ModuleList(
        [TimestepEmbedSequential(nn.Conv2d(in_channels, ch, 3, padding=1))]
    )
    chans = [ch]
    ds = 1
    for level, mult in enumerate(channel_mult):
        for _ in range(num_res_blocks):
            layers = [resblock(ch, int(mult * model_channels))]
            ch = int(mult * model_channels)
            if ds in attention_resolutions:
                layers.append(attention(ch, num_heads))
            input_blocks.append(TimestepEmbedSequential(*layers))
            chans.append(ch)
        if level != len(channel_mult) - 1:
            down = (resblock(ch, ch, down=True) if resblock_updown
                    else Downsample(ch, conv_resample, out_channels=ch))
            input_blocks.append(TimestepEmbedSequential(down))
            chans.append(ch)
            ds *= 2
    middle_block = TimestepEmbedSequential(
        resblock(ch, ch), attention(ch, num_heads), resblock(ch, ch)
    )
    return input_blocks, middle_block, chans, ds


class UNetModel(nn.Module):
    """The guided-diffusion UNet.

    emb = time_embed(sinusoid(t, model_channels)) [+ label_emb(y)]      (dim 4*model_channels)
    input_blocks:  conv3x3(in -> mult[0]*C), then per level: num_res_blocks x
                   [ResBlock (+ AttentionBlock if ds in attention_resolutions)],
                   and between levels a Downsample (or a down ResBlock if resblock_updown);
                   every input block's output is pushed on a skip stack.
    middle_block:  ResBlock, AttentionBlock, ResBlock.
    output_blocks: per level (reversed): num_res_blocks+1 x
                   [h = cat([h, skip.pop()], channels); ResBlock (+ Attention)],
                   the last block of each level but the top one ending in an Upsample
                   (or an up ResBlock).
    out:           GN, SiLU, zero-initialised conv3x3 -> out_channels.
    """

    def __init__(self, image_size, in_channels, model_channels, out_channels, num_res_blocks,
                 attention_resolutions, dropout=0, channel_mult=(1, 2, 4, 8),
                 conv_resample=True, num_classes=None, num_heads=1, num_head_channels=-1,
                 num_heads_upsample=-1, use_scale_shift_norm=False, resblock_updown=False,
                 use_new_attention_order=False):
        super().__init__()
        if num_heads_upsample == -1:
            num_heads_upsample = num_heads
        self.image_size = image_size
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.out_channels = out_channels
        self.num_classes = num_classes
        emb_dim = 4 * model_channels
        resblock, attention = _block_makers(emb_dim, dropout, use_scale_shift_norm,
                                            num_head_channels, use_new_attention_order)

        self.time_embed = nn.Sequential(
            nn.Linear(model_channels, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        if num_classes is not None:
            self.label_emb = nn.Embedding(num_classes, emb_dim)

        input_blocks, middle_block, skip_chans, ds = _input_and_middle(
            in_channels, model_channels, channel_mult, num_res_blocks, attention_resolutions,
            conv_resample, resblock_updown, num_heads, resblock, attention)
        self.input_blocks = input_blocks
        self.middle_block = middle_block
        input_ch, ch = skip_chans[0], skip_chans[-1]

        self.output_blocks = nn.ModuleList()
        for level, mult in reversed(list(enumerate(channel_mult))):
            for i in range(num_res_blocks + 1):
                layers = [resblock(ch + skip_chans.pop(), int(model_channels * mult))]
                ch = int(model_channels * mult)
                if ds in attention_resolutions:
                    layers.append(attention(ch, num_heads_upsample))
                if level and i == num_res_blocks:
                    layers.append(resblock(ch, ch, up=True) if resblock_updown
                                  else Upsample(ch, conv_resample, out_channels=ch))
                    ds //= 2
                self.output_blocks.append(TimestepEmbedSequential(*layers))

        self.out = nn.Sequential(
            GroupNorm32(ch), nn.SiLU(),
            zero_module(nn.Conv2d(input_ch, out_channels, 3, padding=1)),
        )

    def forward(self, x, timesteps, y=None):
        """x [N, in_channels, H, W], timesteps [N], y [N] labels (class-conditional only)
        -> [N, out_channels, H, W]."""
        assert (y is not None) == (self.num_classes is not None)
        dtype = self.time_embed[0].weight.dtype
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, dtype=dtype))
        if self.num_classes is not None:
            emb = emb + self.label_emb(y)
        skips = []
        h = x
        for block in self.input_blocks:
            h = block(h, emb)
            skips.append(h)
        h = self.middle_block(h, emb)
        for block in self.output_blocks:
            h = block(torch.cat([h, skips.pop()], dim=1), emb)
        return self.out(h)


class SuperResModel(UNetModel):
    """guided-diffusion's upsampler: a UNet of twice the image channels in, the second half the
    low-resolution image bilinearly upsampled to the image's size (F.interpolate, align_corners
    False).

    forward(x [N, C, H, W], timesteps, low_res [N, C, h, w], y) = UNetModel(cat([x, up(low_res)]), ...)
    """

    def __init__(self, image_size, in_channels, *args, **kwargs):
        super().__init__(image_size, in_channels * 2, *args, **kwargs)

    def forward(self, x, timesteps, low_res=None, y=None):
        upsampled = F.interpolate(low_res, x.shape[2:], mode="bilinear")
        return super().forward(torch.cat([x, upsampled], dim=1), timesteps, y)


class AttentionPool2d(nn.Module):
    """The attention-pool head of the classifier (pool "attention"), on x [B, C, H, W]:

        tokens = [mean over the H*W pixels, pixel 0, ..., pixel H*W-1]   [B, C, T], T = H*W + 1
        tokens = tokens + positional_embedding                           [C, T] parameter
        out    = c_proj(QKVAttention(qkv_proj(tokens)))[:, :, 0]          [B, output_dim]

    qkv_proj a 1x1 Conv1d C -> 3C, c_proj a 1x1 Conv1d C -> output_dim; the attention is
    always the q-k-v-major order (QKVAttention), with C / num_heads_channels heads; only the
    mean token's output is kept. spacial_dim (guided-diffusion's spelling) is H = W."""

    def __init__(self, spacial_dim, embed_dim, num_heads_channels, output_dim=None):
        super().__init__()
        self.positional_embedding = nn.Parameter(
            torch.randn(embed_dim, spacial_dim ** 2 + 1) / embed_dim ** 0.5
        )
        self.qkv_proj = nn.Conv1d(embed_dim, 3 * embed_dim, 1)
        self.c_proj = nn.Conv1d(embed_dim, output_dim or embed_dim, 1)
        assert embed_dim % num_heads_channels == 0, (embed_dim, num_heads_channels)
        self.num_heads = embed_dim // num_heads_channels
        self.attention = QKVAttention(self.num_heads)

    def forward(self, x):
        b, c, hgt, wid = x.shape
        x = x.reshape(b, c, hgt * wid)
        x = torch.cat([x.mean(dim=-1, keepdim=True), x], dim=-1)
        x = x + self.positional_embedding[None].to(x.dtype)
        x = self.c_proj(self.attention(self.qkv_proj(x)))
        return x[:, :, 0]


POOLS = ("adaptive", "attention", "spatial", "spatial_v2")


class EncoderUNetModel(nn.Module):
    """guided-diffusion's noisy-image classifier: the UNet's time_embed, input_blocks and
    middle_block (built as UNetModel builds them), no label_emb, no output_blocks, and a head
    `out` chosen by pool, giving logits [N, out_channels]:

    adaptive    out = GN, SiLU, AdaptiveAvgPool2d(1), zero-initialised conv1x1 -> out_channels,
                Flatten                                  (out.0 GN, out.3 conv)
    attention   out = GN, SiLU, AttentionPool2d(image_size / ds, ch, num_head_channels,
                out_channels), ds the last level's downsampling (out.0 GN, out.2 pool);
                needs num_head_channels != -1
    spatial     features = [mean over (H, W) of every input block's output, then of the middle
                block's], concatenated along channels -> [N, sum of their channels];
                out = Linear(-> 2048), ReLU, Linear(2048 -> out_channels)  (out.0, out.2)
    spatial_v2  the same features; out = Linear(-> 2048), GN(2048) on [N, 2048] (32 groups of
                64 features), SiLU, Linear(2048 -> out_channels)     (out.0, out.1 GN, out.3)

    num_heads_upsample is accepted (as guided-diffusion's constructor does) and unused.
    """

    def __init__(self, image_size, in_channels, model_channels, out_channels, num_res_blocks,
                 attention_resolutions, dropout=0, channel_mult=(1, 2, 4, 8),
                 conv_resample=True, num_heads=1, num_head_channels=-1, num_heads_upsample=-1,
                 use_scale_shift_norm=False, resblock_updown=False,
                 use_new_attention_order=False, pool="adaptive"):
        super().__init__()
        if pool not in POOLS:
            raise ValueError(f"pool {pool!r}: one of {', '.join(POOLS)}")
        self.image_size = image_size
        self.in_channels = in_channels
        self.model_channels = model_channels
        self.out_channels = out_channels
        self.pool = pool
        emb_dim = 4 * model_channels
        resblock, attention = _block_makers(emb_dim, dropout, use_scale_shift_norm,
                                            num_head_channels, use_new_attention_order)

        self.time_embed = nn.Sequential(
            nn.Linear(model_channels, emb_dim), nn.SiLU(), nn.Linear(emb_dim, emb_dim)
        )
        input_blocks, middle_block, chans, ds = _input_and_middle(
            in_channels, model_channels, channel_mult, num_res_blocks, attention_resolutions,
            conv_resample, resblock_updown, num_heads, resblock, attention)
        self.input_blocks = input_blocks
        self.middle_block = middle_block
        ch = chans[-1]
        feature_size = sum(chans) + ch  # the spatial heads' input: every block's mean

        if pool == "adaptive":
            self.out = nn.Sequential(
                GroupNorm32(ch), nn.SiLU(), nn.AdaptiveAvgPool2d((1, 1)),
                zero_module(nn.Conv2d(ch, out_channels, 1)), nn.Flatten(),
            )
        elif pool == "attention":
            assert num_head_channels != -1, "pool attention needs num_head_channels"
            self.out = nn.Sequential(
                GroupNorm32(ch), nn.SiLU(),
                AttentionPool2d(image_size // ds, ch, num_head_channels, out_channels),
            )
        elif pool == "spatial":
            self.out = nn.Sequential(
                nn.Linear(feature_size, 2048), nn.ReLU(), nn.Linear(2048, out_channels)
            )
        else:  # spatial_v2
            self.out = nn.Sequential(
                nn.Linear(feature_size, 2048), GroupNorm32(2048), nn.SiLU(),
                nn.Linear(2048, out_channels),
            )

    def forward(self, x, timesteps, y=None):
        """x [N, in_channels, H, W], timesteps [N] -> logits [N, out_channels].
        y is only there so callers of UNetModel can pass None; the classifier takes none."""
        assert y is None, "the classifier takes no labels"
        dtype = self.time_embed[0].weight.dtype
        emb = self.time_embed(timestep_embedding(timesteps, self.model_channels, dtype=dtype))
        spatial = self.pool.startswith("spatial")
        features = []
        h = x
        for block in self.input_blocks:
            h = block(h, emb)
            if spatial:
                features.append(h.mean(dim=(2, 3)))
        h = self.middle_block(h, emb)
        if spatial:
            features.append(h.mean(dim=(2, 3)))
            h = torch.cat(features, dim=-1)
        return self.out(h)


NUM_CLASSES = 1000

# Flag defaults of guided-diffusion's command line (model_and_diffusion_defaults),
# plus this project's extensions conv_resample, num_classes (label_emb's rows, or the
# classifier's logits) and classifier_pool ("": the diffusion UNet; else the classifier's
# head, see EncoderUNetModel).
DEFAULTS = dict(
    image_size=64, num_channels=128, num_res_blocks=2, num_heads=4, num_heads_upsample=-1,
    num_head_channels=-1, attention_resolutions="16,8", channel_mult="", dropout=0.0,
    class_cond=False, use_scale_shift_norm=True, resblock_updown=False,
    use_new_attention_order=False, learn_sigma=False, conv_resample=True,
    num_classes=NUM_CLASSES, classifier_pool="", small_size="",
)

DEFAULT_CHANNEL_MULT = {
    512: (0.5, 1, 1, 2, 2, 4, 4),
    256: (1, 1, 2, 2, 4, 4),
    128: (1, 1, 2, 3, 4),
    64: (1, 2, 3, 4),
}


# guided-diffusion's sr_create_model: the upsampler's, by its large size.
SUPER_RES_CHANNEL_MULT = {512: (1, 1, 2, 2, 4, 4), 256: (1, 1, 2, 2, 4, 4), 64: (1, 2, 3, 4)}


def model_kwargs(args):
    """guided-diffusion flags (strings or native values; missing ones take DEFAULTS;
    unknown ones, e.g. diffusion flags, are ignored) -> UNetModel keyword arguments."""
    a = {**DEFAULTS, **args}
    image_size = int(a["image_size"])
    mult = str(a["channel_mult"]).strip()
    if mult == "":
        defaults = SUPER_RES_CHANNEL_MULT if is_super_res(args) else DEFAULT_CHANNEL_MULT
        if image_size not in defaults:
            raise ValueError(f"no default channel_mult for image_size {image_size}")
        channel_mult = defaults[image_size]
    else:
        channel_mult = tuple(int(m) for m in mult.split(","))
    attention_ds = tuple(image_size // int(r)
                         for r in str(a["attention_resolutions"]).split(",") if r.strip())
    class_cond = str2bool(a["class_cond"])
    return dict(
        image_size=image_size,
        in_channels=3,
        model_channels=int(a["num_channels"]),
        out_channels=6 if str2bool(a["learn_sigma"]) else 3,
        num_res_blocks=int(a["num_res_blocks"]),
        attention_resolutions=attention_ds,
        dropout=float(a["dropout"]),
        channel_mult=channel_mult,
        conv_resample=str2bool(a["conv_resample"]),
        num_classes=int(a["num_classes"]) if class_cond else None,
        num_heads=int(a["num_heads"]),
        num_head_channels=int(a["num_head_channels"]),
        num_heads_upsample=int(a["num_heads_upsample"]),
        use_scale_shift_norm=str2bool(a["use_scale_shift_norm"]),
        resblock_updown=str2bool(a["resblock_updown"]),
        use_new_attention_order=str2bool(a["use_new_attention_order"]),
    )


def is_classifier(args):
    """Whether the flags describe the classifier: classifier_pool given and not empty."""
    return str({**DEFAULTS, **args}["classifier_pool"]).strip() != ""


def classifier_kwargs(args):
    """guided-diffusion flags -> EncoderUNetModel keyword arguments. The UNet's flag names
    and parsing (model_kwargs: channel_mult's default per image size, attention_resolutions
    as downsampling factors), plus classifier_pool (the head: adaptive, attention, spatial,
    spatial_v2) and num_classes (out_channels: the logits, 1000 by default as in
    guided-diffusion's create_classifier). class_cond and learn_sigma are ignored. Unlike
    create_classifier, which fixes num_head_channels 64, that flag is read too (it is
    needed, != -1, for pool attention)."""
    a = {**DEFAULTS, **args}
    pool = str(a["classifier_pool"]).strip()
    if pool not in POOLS:
        raise ValueError(f"classifier_pool {pool!r}: one of {', '.join(POOLS)}")
    kw = model_kwargs(args)
    del kw["num_classes"]
    kw.update(out_channels=int(a["num_classes"]), pool=pool)
    return kw


def create_classifier(args):
    """EncoderUNetModel from a dict of guided-diffusion flags (see classifier_kwargs)."""
    return EncoderUNetModel(**classifier_kwargs(args))


def is_super_res(args):
    """Whether the flags describe the upsampler: small_size given and not empty (image_size is
    then its large_size)."""
    return str({**DEFAULTS, **args}["small_size"]).strip() != ""


def create_model(args):
    """From a dict of guided-diffusion flags: UNetModel (see model_kwargs), the upsampler
    SuperResModel when small_size is set (its image_size the large size), or the classifier
    EncoderUNetModel when classifier_pool is set (see classifier_kwargs)."""
    if is_classifier(args):
        return create_classifier(args)
    if is_super_res(args):
        return SuperResModel(**model_kwargs(args))
    return UNetModel(**model_kwargs(args))


def count_parameters(model):
    return sum(p.numel() for p in model.parameters())


def main():
    parser = argparse.ArgumentParser(
        description="Parameter count of a guided-diffusion UNet (or, with --classifier_pool, "
                    "of its classifier).")
    for name, default in DEFAULTS.items():
        parser.add_argument(f"--{name}", default=str(default))
    args = vars(parser.parse_args())
    model = create_model(args)
    print(f"parameters: {count_parameters(model):,}")


if __name__ == "__main__":
    main()
