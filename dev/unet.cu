// dev/unet.cu: guided-diffusion's UNetModel on the CPU in double, built from the layer references:
// what the trainer's whole model is checked against (scripts/unet_ref.py is the PyTorch original).
//
// With config.low_res set it is the upsampler, guided-diffusion's SuperResModel: the UNet on x and,
// after its channels, the low-resolution image (m->low_res) bilinearly upsampled to x's size.
// With config.pool set it is instead the noisy classifier, guided-diffusion's EncoderUNetModel: the
// same time embedding, input blocks and middle block, then a pooling head (out.*) giving logits: on
// the middle block's output (adaptive, attention), or on the means of every input block's output
// and the middle block's (spatial, spatial_v2).
//
// The forward pass records a tape. Every activation is a RefTensor (NHWC, [N][H][W][C]; vectors
// such as the embedding and the spatial heads' features are [N][1][1][C], the attention pool's T
// tokens [N][1][T][C]) and every layer applied is a RefOp naming its input and output tensors and
// its parameters. The backward pass walks the tape in reverse, calling each layer's backward; a
// tensor used by several layers (the embedding, a residual input, an input block's output that a
// spatial head also pools) collects all their gradients because every backward accumulates. The
// model is assembled the way unet_ref.py's modules call each other, so the builders below read like
// its forward methods; parameters are looked up by their state_dict names, and every one must be
// used exactly once, which checks this walk against model_parameters().
// The layer files' own checks (their mains) are not part of the whole model.
#ifndef DEV_NO_MAIN
#define DEV_NO_MAIN
#endif
#include "common.h"
#include "conv2d.cu"
#include "linear.cu"
#include "groupnorm.cu"
#include "attention.cu"
#include "resample.cu"
#include "embedding.cu"
#include "loss.cu"

typedef struct {
    double *data, *grad;  // [N][H][W][C]; grad is allocated by the backward pass (NULL: not needed)
    int N, H, W, C;
    int leaf;             // made by the forward pass's caller (x, the timestep sinusoid), not by an op
} RefTensor;

typedef enum {
    REF_CONV, REF_LINEAR, REF_GROUP_NORM, REF_SILU, REF_ATTENTION, REF_AVGPOOL, REF_UPSAMPLE,
    REF_EMBEDDING, REF_ADD, REF_ADD_CHANNELS, REF_CONCAT, REF_POOL_TOKENS, REF_FIRST_TOKEN, REF_RELU, REF_BILINEAR
} RefOpType;

typedef struct {
    RefOpType type;
    int in, in2, out;   // tensor indices; in2: the scale-shift, added or concatenated tensor (-1: none)
    int weight, bias;   // parameter indices (-1: none)
    int k, stride;      // REF_CONV
    int heads, legacy;  // REF_ATTENTION: heads, and QKVAttentionLegacy's channel order (else QKVAttention's)
    int silu;           // REF_GROUP_NORM
} RefOp;

typedef struct {
    ModelConfig config;
    ParamList params;        // model_parameters(&config): state_dict names and PyTorch shapes
    double **param, **grad;  // [params.count], PyTorch layouts; the backward pass accumulates into grad
    int *uses;               // how often the last forward pass used each parameter
    int64_t *labels;         // the last forward pass's y, read by REF_EMBEDDING
    const double *low_res;   // an upsampler's low-resolution images [N][s][s][C], set by the caller before forward
    // the tape of the last forward pass: the activations the backward pass needs
    RefTensor *tensors;
    int num_tensors, tensor_capacity;
    RefOp *ops;
    int num_ops, op_capacity;
    int input, output;  // tensor indices of x and of the model's output
} RefUNet;

// ----------------------------------------------------------------------------------------------
// Layers the model adds to the references: residual sums, the per-channel embedding add, the
// skip concatenation, the classifier heads' tokens and the spatial head's ReLU.

// out[i] = a[i] + b[i]; backward: d_a[i] += d_out[i], d_b[i] += d_out[i] (either may be NULL).
static void ref_add_forward(double *out, const double *a, const double *b, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}
static void ref_add_backward(double *d_a, double *d_b, const double *d_out, size_t n) {
    for (size_t i = 0; i < n; i++) {
        if (d_a) d_a[i] += d_out[i];
        if (d_b) d_b[i] += d_out[i];
    }
}

// out[n][p][c] = in[n][p][c] + e[n][c] (the ResBlock's h + emb_out[:, :, None, None]);
// backward: d_in[n][p][c] += d_out[n][p][c], d_e[n][c] += sum_p d_out[n][p][c].
static void ref_add_channels_forward(double *out, const double *in, const double *e, int N, int HW, int C) {
    for (int n = 0; n < N; n++)
        for (size_t i = (size_t)n * HW * C; i < (size_t)(n + 1) * HW * C; i++) out[i] = in[i] + e[(size_t)n * C + i % C];
}
static void ref_add_channels_backward(double *d_in, double *d_e, const double *d_out, int N, int HW, int C) {
    for (int n = 0; n < N; n++)
        for (size_t i = (size_t)n * HW * C; i < (size_t)(n + 1) * HW * C; i++) {
            if (d_in) d_in[i] += d_out[i];
            if (d_e) d_e[(size_t)n * C + i % C] += d_out[i];
        }
}

// out[r] = [a[r] | b[r]] for each of the `rows` pixels (torch.cat([h, skip], dim=1) in NHWC);
// backward splits d_out the same way (either gradient may be NULL).
static void ref_concat_forward(double *out, const double *a, const double *b, size_t rows, int Ca, int Cb) {
    for (size_t r = 0; r < rows; r++) {
        memcpy(out + r * (Ca + Cb), a + r * Ca, Ca * sizeof(double));
        memcpy(out + r * (Ca + Cb) + Ca, b + r * Cb, Cb * sizeof(double));
    }
}
static void ref_concat_backward(double *d_a, double *d_b, const double *d_out, size_t rows, int Ca, int Cb) {
    for (size_t r = 0; r < rows; r++) {
        if (d_a) ref_add_backward(d_a + r * Ca, NULL, d_out + r * (Ca + Cb), Ca);
        if (d_b) ref_add_backward(d_b + r * Cb, NULL, d_out + r * (Ca + Cb) + Ca, Cb);
    }
}

// The classifier head's tokens from x [N][HW][C] (the SiLU(GroupNorm) of the middle block's output):
// tokens [N][T][C] with T = 1 + HW (AttentionPool2d: the pixels' mean, then the pixels, plus
// positional_embedding pos [C][T]), or T = 1 and pos NULL (the adaptive pool: the mean alone):
//   tokens[n][0][c] = (1/HW) sum_p x[n][p][c] + pos[c][0],   tokens[n][1 + p][c] = x[n][p][c] + pos[c][1 + p]
// backward: d_x[n][p][c] += d_tokens[n][0][c] / HW + d_tokens[n][1 + p][c] (the second when T > 1),
//           d_pos[c][t] += sum_n d_tokens[n][t][c]   (d_x, d_pos may be NULL).
static void ref_pool_tokens_forward(double *tokens, const double *x, const double *pos, int N, int HW, int C, int T) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            const double *xc = x + (size_t)n * HW * C + c;
            double *tc = tokens + (size_t)n * T * C + c, sum = 0;
            for (int p = 0; p < HW; p++) sum += xc[(size_t)p * C];
            tc[0] = sum / HW + (pos ? pos[(size_t)c * T] : 0);
            for (int p = 0; p + 1 < T; p++) tc[(size_t)(1 + p) * C] = xc[(size_t)p * C] + pos[(size_t)c * T + 1 + p];
        }
}
static void ref_pool_tokens_backward(double *d_x, double *d_pos, const double *d_tokens, int N, int HW, int C, int T) {
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            const double *dt = d_tokens + (size_t)n * T * C + c;
            if (d_x)
                for (int p = 0; p < HW; p++)
                    d_x[((size_t)n * HW + p) * C + c] += dt[0] / HW + (T > 1 ? dt[(size_t)(1 + p) * C] : 0);
            if (d_pos)
                for (int t = 0; t < T; t++) d_pos[(size_t)c * T + t] += dt[(size_t)t * C];
        }
}

// out[n][c] = in[n][0][c], the first of T tokens (AttentionPool2d returns token 0 alone);
// backward: d_in[n][0][c] += d_out[n][c], the other tokens get none.
static void ref_first_token_forward(double *out, const double *in, int N, int T, int C) {
    for (int n = 0; n < N; n++) memcpy(out + (size_t)n * C, in + (size_t)n * T * C, C * sizeof(double));
}
static void ref_first_token_backward(double *d_in, const double *d_out, int N, int T, int C) {
    for (int n = 0; n < N; n++) ref_add_backward(d_in + (size_t)n * T * C, NULL, d_out + (size_t)n * C, C);
}

// out[i] = max(in[i], 0) (nn.ReLU, the spatial head's); backward: d_in[i] += d_out[i] where in[i] > 0,
// nothing where in[i] <= 0 (PyTorch's gradient at exactly 0 is 0 too).
static void ref_relu_forward(double *out, const double *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = in[i] > 0 ? in[i] : 0;
}
static void ref_relu_backward(double *d_in, const double *d_out, const double *in, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (in[i] > 0) d_in[i] += d_out[i];
}

// ----------------------------------------------------------------------------------------------
// The tape

static RefTensor *ref_tensor(RefUNet *m, int i) { return i >= 0 ? &m->tensors[i] : NULL; }

static size_t ref_numel(const RefTensor *t) { return (size_t)t->N * t->H * t->W * t->C; }

// A new zeroed activation [N][H][W][C]; returns its index.
static int ref_new_tensor(RefUNet *m, int N, int H, int W, int C) {
    if (m->num_tensors == m->tensor_capacity) {
        m->tensor_capacity = m->tensor_capacity ? 2 * m->tensor_capacity : 256;
        m->tensors = (RefTensor *)realloc(m->tensors, m->tensor_capacity * sizeof(RefTensor));
        if (!m->tensors) fatal("out of host memory");
    }
    RefTensor *t = &m->tensors[m->num_tensors];
    memset(t, 0, sizeof *t);
    t->N = N, t->H = H, t->W = W, t->C = C;
    t->data = dev_alloc(ref_numel(t));
    return m->num_tensors++;
}

// The index of parameter prefix + leaf (e.g. "input_blocks.1.0.in_layers.2." + "weight"), counting
// the use; exits when model_parameters() has no such parameter.
static int ref_param(RefUNet *m, const char *prefix, const char *leaf) {
    char name[128];
    if (snprintf(name, sizeof name, "%s%s", prefix, leaf) >= (int)sizeof name)
        fatal("reference UNet: parameter name %s%s is too long", prefix, leaf);
    for (int i = 0; i < m->params.count; i++)
        if (strcmp(m->params.specs[i].name, name) == 0) return m->uses[i]++, i;
    fatal("reference UNet: no parameter %s in model_parameters()", name);
    return -1;
}

// Runs one op forward (writing its output) or backward (accumulating into the gradients of its
// inputs and parameters; an input whose grad is NULL gets none).
static void ref_op_run(RefUNet *m, const RefOp *op, int backward) {
    RefTensor *x = ref_tensor(m, op->in), *x2 = ref_tensor(m, op->in2), *y = ref_tensor(m, op->out);
    const double *w = op->weight >= 0 ? m->param[op->weight] : NULL, *b = op->bias >= 0 ? m->param[op->bias] : NULL;
    double *dw = op->weight >= 0 ? m->grad[op->weight] : NULL, *db = op->bias >= 0 ? m->grad[op->bias] : NULL;
    double *dx = x ? x->grad : NULL, *dx2 = x2 ? x2->grad : NULL;
    switch (op->type) {
    case REF_CONV:
        if (!backward) ref_conv2d_forward(y->data, x->data, w, b, x->N, x->H, x->W, x->C, y->C, op->k, op->stride);
        else ref_conv2d_backward(dx, dw, db, y->grad, x->data, w, x->N, x->H, x->W, x->C, y->C, op->k, op->stride);
        break;
    case REF_LINEAR:
        if (!backward) ref_linear_forward(y->data, x->data, w, b, x->N, x->C, y->C);
        else ref_linear_backward(dx, dw, db, y->grad, x->data, w, x->N, x->C, y->C);
        break;
    case REF_GROUP_NORM:
        if (!backward)
            ref_group_norm_forward(y->data, x->data, w, b, x2 ? x2->data : NULL, x->N, x->H * x->W, x->C, op->silu);
        else
            ref_group_norm_backward(dx, dw, db, dx2, y->grad, x->data, w, b, x2 ? x2->data : NULL, x->N, x->H * x->W, x->C,
                                    op->silu);
        break;
    case REF_SILU:
        if (!backward) ref_silu_forward(y->data, x->data, ref_numel(x));
        else if (dx) ref_silu_backward(dx, y->grad, x->data, ref_numel(x));
        break;
    case REF_ATTENTION:
        if (!backward) ref_attention_forward(y->data, x->data, x->N, x->H * x->W, y->C, op->heads, op->legacy);
        else ref_attention_backward(dx, y->grad, x->data, x->N, x->H * x->W, y->C, op->heads, op->legacy);
        break;
    case REF_AVGPOOL:
        if (!backward) ref_avgpool_forward(y->data, x->data, x->N, x->H, x->W, x->C);
        else if (dx) ref_avgpool_backward(dx, y->grad, x->N, x->H, x->W, x->C);
        break;
    case REF_UPSAMPLE:
        if (!backward) ref_upsample_forward(y->data, x->data, x->N, x->H, x->W, x->C);
        else if (dx) ref_upsample_backward(dx, y->grad, x->N, x->H, x->W, x->C);
        break;
    case REF_EMBEDDING:
        if (!backward) ref_embedding_forward(y->data, w, m->labels, y->N, y->C);
        else ref_embedding_backward(dw, y->grad, m->labels, y->N, y->C);
        break;
    case REF_ADD:
        if (!backward) ref_add_forward(y->data, x->data, x2->data, ref_numel(y));
        else ref_add_backward(dx, dx2, y->grad, ref_numel(y));
        break;
    case REF_ADD_CHANNELS:
        if (!backward) ref_add_channels_forward(y->data, x->data, x2->data, x->N, x->H * x->W, x->C);
        else ref_add_channels_backward(dx, dx2, y->grad, x->N, x->H * x->W, x->C);
        break;
    case REF_CONCAT:
        if (!backward) ref_concat_forward(y->data, x->data, x2->data, (size_t)x->N * x->H * x->W, x->C, x2->C);
        else ref_concat_backward(dx, dx2, y->grad, (size_t)x->N * x->H * x->W, x->C, x2->C);
        break;
    case REF_POOL_TOKENS:  // y [N][1][T][C]
        if (!backward) ref_pool_tokens_forward(y->data, x->data, w, x->N, x->H * x->W, x->C, y->W);
        else ref_pool_tokens_backward(dx, dw, y->grad, x->N, x->H * x->W, x->C, y->W);
        break;
    case REF_FIRST_TOKEN:  // x [N][1][T][C], y [N][1][1][C]
        if (!backward) ref_first_token_forward(y->data, x->data, x->N, x->W, x->C);
        else if (dx) ref_first_token_backward(dx, y->grad, x->N, x->W, x->C);
        break;
    case REF_RELU:
        if (!backward) ref_relu_forward(y->data, x->data, ref_numel(x));
        else if (dx) ref_relu_backward(dx, y->grad, x->data, ref_numel(x));
        break;
    case REF_BILINEAR:  // x [N][s][s][C] -> y [N][S][S][C]
        if (!backward) ref_upsample_bilinear_forward(y->data, x->data, x->N, x->H, y->H, x->C);
        else if (dx) ref_upsample_bilinear_backward(dx, y->grad, x->N, x->H, y->H, x->C);
        break;
    }
}

// Appends an op whose output is a new tensor [N][H][W][C] and runs it forward; returns the output.
static int ref_apply(RefUNet *m, RefOp op, int N, int H, int W, int C) {
    op.out = ref_new_tensor(m, N, H, W, C);
    if (m->num_ops == m->op_capacity) {
        m->op_capacity = m->op_capacity ? 2 * m->op_capacity : 256;
        m->ops = (RefOp *)realloc(m->ops, m->op_capacity * sizeof(RefOp));
        if (!m->ops) fatal("out of host memory");
    }
    m->ops[m->num_ops++] = op;
    ref_op_run(m, &op, 0);
    return op.out;
}

// An op of the given type on x (and x2) without parameters.
static RefOp ref_op(RefOpType type, int x, int x2) {
    RefOp op = {type, x, x2, -1, -1, -1, 0, 0, 0, 0, 0};
    return op;
}

// ----------------------------------------------------------------------------------------------
// Layers as the model uses them: each takes and returns tensor indices; `name` is the module's
// state_dict prefix, e.g. "input_blocks.1.0.in_layers.2.".

static int ref_conv(RefUNet *m, int x, const char *name, int out_channels, int k, int stride) {
    RefOp op = ref_op(REF_CONV, x, -1);
    op.weight = ref_param(m, name, "weight"), op.bias = ref_param(m, name, "bias"), op.k = k, op.stride = stride;
    RefTensor *t = ref_tensor(m, x);
    return ref_apply(m, op, t->N, ref_conv2d_out_size(t->H, k, stride), ref_conv2d_out_size(t->W, k, stride), out_channels);
}

// nn.Linear on x [N][1][1][in] -> [N][1][1][out_features]; exits unless model_parameters() gives the
// weight as [out_features, in] and the bias as [out_features].
static int ref_linear(RefUNet *m, int x, const char *name, int out_features) {
    RefOp op = ref_op(REF_LINEAR, x, -1);
    op.weight = ref_param(m, name, "weight"), op.bias = ref_param(m, name, "bias");
    RefTensor *t = ref_tensor(m, x);
    const ParamSpec *w = &m->params.specs[op.weight], *b = &m->params.specs[op.bias];
    if (t->H != 1 || t->W != 1 || w->ndim != 2 || w->shape[0] != out_features || w->shape[1] != t->C || b->numel != out_features)
        fatal("reference UNet: %sweight is not [%d, %d] or its input not [N][1][1][%d]", name, out_features, t->C, t->C);
    return ref_apply(m, op, t->N, 1, 1, out_features);
}

// GroupNorm32 (name: its module), then * (1 + scale) + shift when scale_shift >= 0 (a tensor
// [N][1][1][2C]), then SiLU when silu.
static int ref_norm(RefUNet *m, int x, const char *name, int scale_shift, int silu) {
    RefOp op = ref_op(REF_GROUP_NORM, x, scale_shift);
    op.weight = ref_param(m, name, "weight"), op.bias = ref_param(m, name, "bias"), op.silu = silu;
    RefTensor *t = ref_tensor(m, x);
    return ref_apply(m, op, t->N, t->H, t->W, t->C);
}

// Same-shape ops without parameters: SiLU, ReLU, x + x2, x + x2 per channel.
static int ref_same_shape(RefUNet *m, RefOpType type, int x, int x2) {
    RefTensor *t = ref_tensor(m, x);
    return ref_apply(m, ref_op(type, x, x2), t->N, t->H, t->W, t->C);
}

static int ref_concat(RefUNet *m, int a, int b) {
    RefTensor *ta = ref_tensor(m, a), *tb = ref_tensor(m, b);
    if (ta->N != tb->N || ta->H != tb->H || ta->W != tb->W) fatal("reference UNet: concatenating tensors of different sizes");
    return ref_apply(m, ref_op(REF_CONCAT, a, b), ta->N, ta->H, ta->W, ta->C + tb->C);
}

// 2x resampling without weights: up (nearest) when up, else down (2x2 average).
static int ref_resample(RefUNet *m, int x, int up) {
    RefTensor *t = ref_tensor(m, x);
    if (up) return ref_apply(m, ref_op(REF_UPSAMPLE, x, -1), t->N, 2 * t->H, 2 * t->W, t->C);
    return ref_apply(m, ref_op(REF_AVGPOOL, x, -1), t->N, t->H / 2, t->W / 2, t->C);
}

// ----------------------------------------------------------------------------------------------
// The blocks (unet_ref.py's ResBlock, AttentionBlock, Downsample, Upsample)

enum { REF_SAME = 0, REF_DOWN = 1, REF_UP = 2 };

static const char *ref_join(char *buf, size_t len, const char *prefix, const char *child) {
    snprintf(buf, len, "%s%s", prefix, child);
    return buf;
}

// ResBlock(x, emb) with silu_emb = SiLU(emb) (the first layer of every emb_layers, computed once):
//   h = SiLU(GN(x)); up/down: h = upd(h), x = upd(x); h = conv3x3(h)         in_layers, h_upd, x_upd
//   s = Linear(silu_emb)                                                      emb_layers
//   scale-shift: h = SiLU(GN(h) * (1 + s[:C]) + s[C:]); else h = SiLU(GN(h + s))
//   h = conv3x3(h) (dropout is 0)                                             out_layers
//   return skip(x) + h, skip = identity when the channels match, else a 1x1 conv
static int ref_res_block(RefUNet *m, int x, int silu_emb, const char *prefix, int out_channels, int updown) {
    char name[128];
    int h = ref_norm(m, x, ref_join(name, sizeof name, prefix, "in_layers.0."), -1, 1);
    if (updown != REF_SAME) {
        h = ref_resample(m, h, updown == REF_UP);
        x = ref_resample(m, x, updown == REF_UP);
    }
    h = ref_conv(m, h, ref_join(name, sizeof name, prefix, "in_layers.2."), out_channels, 3, 1);
    int scale_shift = m->config.use_scale_shift_norm;
    ref_join(name, sizeof name, prefix, "emb_layers.1.");
    int s = ref_linear(m, silu_emb, name, scale_shift ? 2 * out_channels : out_channels);
    ref_join(name, sizeof name, prefix, "out_layers.0.");
    h = scale_shift ? ref_norm(m, h, name, s, 1) : ref_norm(m, ref_same_shape(m, REF_ADD_CHANNELS, h, s), name, -1, 1);
    h = ref_conv(m, h, ref_join(name, sizeof name, prefix, "out_layers.3."), out_channels, 3, 1);
    if (ref_tensor(m, x)->C != out_channels)
        x = ref_conv(m, x, ref_join(name, sizeof name, prefix, "skip_connection."), out_channels, 1, 1);
    return ref_same_shape(m, REF_ADD, x, h);
}

// The heads of an attention block of C channels: C / num_head_channels, else num_heads (input and
// middle blocks) or num_heads_upsample (output blocks).
static int ref_heads(const ModelConfig *c, int C, int output_block) {
    if (c->num_head_channels != -1) return C / c->num_head_channels;
    return output_block ? c->num_heads_upsample : c->num_heads;
}

// The attention core on qkv [N][H][W][3C] (the T = H W positions), in `heads`, legacy or new order.
static int ref_attention(RefUNet *m, int qkv, int heads, int legacy) {
    RefTensor *t = ref_tensor(m, qkv);
    RefOp op = ref_op(REF_ATTENTION, qkv, -1);
    op.heads = heads, op.legacy = legacy;
    return ref_apply(m, op, t->N, t->H, t->W, t->C / 3);
}

// AttentionBlock: x + proj_out(attention(qkv(GN(x)))), qkv and proj_out 1x1 convolutions.
static int ref_attention_block(RefUNet *m, int x, const char *prefix, int heads) {
    char name[128];
    int C = ref_tensor(m, x)->C;
    int h = ref_norm(m, x, ref_join(name, sizeof name, prefix, "norm."), -1, 0);
    h = ref_conv(m, h, ref_join(name, sizeof name, prefix, "qkv."), 3 * C, 1, 1);
    h = ref_attention(m, h, heads, !m->config.use_new_attention_order);
    h = ref_conv(m, h, ref_join(name, sizeof name, prefix, "proj_out."), C, 1, 1);
    return ref_same_shape(m, REF_ADD, x, h);
}

// The classifier's head (EncoderUNetModel.out) on the middle block's output x [N][S][S][C]:
//   h0 = SiLU(GN(x))                                                         out.0, out.1
//   adaptive:  logits = conv1x1(mean_p h0)                                   out.2 (the pool), out.3
//   attention: AttentionPool2d (out.2): tokens = [mean_p h0, h0's pixels] + positional_embedding
//              ([C][T], T = 1 + S S), qkv_proj (1x1 conv1d to 3C), attention in C / num_head_channels
//              heads, always in QKVAttention's (new) order, logits = c_proj(token 0) (a 1x1 conv1d;
//              PyTorch applies it to every token and returns token 0: the same numbers)
// The spatial heads instead take the mean over the pixels of each of the input blocks' outputs
// (inputs[0..num_inputs): input_blocks.0's convolution, then every input block in order) and of x,
// concatenated along the channels: features [N][F], F the sum of their channels (no GroupNorm first):
//   spatial:    logits = Linear(ReLU(Linear(features)))                      out.0 (F -> 2048), out.2
//   spatial_v2: logits = Linear(SiLU(GN(Linear(features))))                  out.0, out.1 (GroupNorm32
//              on [N][2048]: 32 groups of 64 values, no pixels), out.3
// Returns the logits [N][1][1][out_channels].
static int ref_pool_head(RefUNet *m, int x, const int *inputs, int num_inputs) {
    const ModelConfig *c = &m->config;
    RefTensor *t = ref_tensor(m, x);
    int N = t->N, HW = t->H * t->W, C = t->C;
    if (c->pool == POOL_SPATIAL || c->pool == POOL_SPATIAL_V2) {
        int features = -1;
        for (int i = 0; i <= num_inputs; i++) {
            int source = i < num_inputs ? inputs[i] : x;  // the mean over its pixels: one token, no positions
            int mean = ref_apply(m, ref_op(REF_POOL_TOKENS, source, -1), N, 1, 1, ref_tensor(m, source)->C);
            features = features < 0 ? mean : ref_concat(m, features, mean);
        }
        int h = ref_linear(m, features, "out.0.", SPATIAL_HIDDEN);
        if (c->pool == POOL_SPATIAL) return ref_linear(m, ref_same_shape(m, REF_RELU, h, -1), "out.2.", c->out_channels);
        return ref_linear(m, ref_norm(m, h, "out.1.", -1, 1), "out.3.", c->out_channels);
    }
    int h = ref_norm(m, x, "out.0.", -1, 1);
    RefOp op = ref_op(REF_POOL_TOKENS, h, -1);
    if (c->pool == POOL_ADAPTIVE) return ref_conv(m, ref_apply(m, op, N, 1, 1, C), "out.3.", c->out_channels, 1, 1);
    op.weight = ref_param(m, "out.2.", "positional_embedding");
    const ParamSpec *pos = &m->params.specs[op.weight];
    if (pos->ndim != 2 || pos->shape[0] != C || pos->shape[1] != 1 + HW)
        fatal("reference UNet: out.2.positional_embedding is not [%d, %d] (C, 1 + HW)", C, 1 + HW);
    int tokens = ref_apply(m, op, N, 1, 1 + HW, C);
    int qkv = ref_conv(m, tokens, "out.2.qkv_proj.", 3 * C, 1, 1);
    int attended = ref_attention(m, qkv, C / c->num_head_channels, 0);
    int first = ref_apply(m, ref_op(REF_FIRST_TOKEN, attended, -1), N, 1, 1, C);
    return ref_conv(m, first, "out.2.c_proj.", c->out_channels, 1, 1);
}

// ----------------------------------------------------------------------------------------------
// The model

// Frees the tape of the last forward pass.
static void ref_unet_clear_tape(RefUNet *m) {
    for (int i = 0; i < m->num_tensors; i++) free(m->tensors[i].data), free(m->tensors[i].grad);
    m->num_tensors = m->num_ops = 0;
}

// Allocates the model for a configuration: parameters and gradients zeroed (the caller loads or
// fills the parameters). The reference has no dropout: a configuration with dropout exits.
static void ref_unet_init(RefUNet *m, const ModelConfig *config) {
    memset(m, 0, sizeof *m);
    if (config->dropout != 0) fatal("reference UNet: dropout %g is not supported (it must be 0)", config->dropout);
    m->config = *config;
    m->params = model_parameters(config);
    int count = m->params.count;
    m->param = (double **)malloc_or_die(count * sizeof(double *));
    m->grad = (double **)malloc_or_die(count * sizeof(double *));
    m->uses = (int *)calloc(count, sizeof(int));
    double *param = dev_alloc(m->params.numel), *grad = dev_alloc(m->params.numel);
    for (int i = 0; i < count; i++) {
        m->param[i] = param, m->grad[i] = grad;
        param += m->params.specs[i].numel, grad += m->params.specs[i].numel;
    }
}

static void ref_unet_free(RefUNet *m) {
    ref_unet_clear_tape(m);
    if (m->params.count) free(m->param[0]), free(m->grad[0]);
    free(m->param), free(m->grad), free(m->uses), free(m->labels), free(m->tensors), free(m->ops);
    free(m->params.specs);
    memset(m, 0, sizeof *m);
}

static void ref_unet_zero_grad(RefUNet *m) { memset(m->grad[0], 0, m->params.numel * sizeof(double)); }

// The index of the parameter with this state_dict name, or -1.
static int ref_unet_find(const RefUNet *m, const char *name) {
    for (int i = 0; i < m->params.count; i++)
        if (strcmp(m->params.specs[i].name, name) == 0) return i;
    return -1;
}

// The end of the forward pass: copies the output tensor to out and checks that every parameter
// was used exactly once.
static void ref_unet_output(RefUNet *m, double *out) {
    memcpy(out, m->tensors[m->output].data, ref_numel(&m->tensors[m->output]) * sizeof(double));
    for (int i = 0; i < m->params.count; i++)
        if (m->uses[i] != 1) fatal("reference UNet: parameter %s used %d times", m->params.specs[i].name, m->uses[i]);
}

// out = UNetModel(x, t, y) for N images (unet_ref.py's UNetModel.forward), recording the tape:
//   emb = time_embed(sinusoid(t)) [+ label_emb(y)]
//   input_blocks (every output pushed as a skip), middle_block,
//   output_blocks (each on cat([h, skip.pop()])), out = conv3x3(SiLU(GN(h)))
// x [N][image][image][in_channels], out [N][image][image][out_channels], t [N], y [N] or NULL
// (required exactly when the model is class-conditional).
// A classifier (config.pool: EncoderUNetModel.forward) stops after the middle block and gives
// out = ref_pool_head(h, skips), the logits [N][1][1][out_channels] (out_channels = its classes;
// no y): skips, every input block's output in order, are what the spatial heads pool.
static void ref_unet_forward(RefUNet *m, const double *x, const int64_t *t, const int64_t *y, double *out, int N) {
    const ModelConfig *c = &m->config;
    char name[128];
    if ((y != NULL) != (c->num_classes > 0))
        fatal("reference UNet: labels must be given exactly when the model is class-conditional");
    ref_unet_clear_tape(m);
    memset(m->uses, 0, m->params.count * sizeof(int));

    int sinusoid = ref_new_tensor(m, N, 1, 1, c->model_channels);
    m->tensors[sinusoid].leaf = 1;
    ref_timestep_embedding(m->tensors[sinusoid].data, t, N, c->model_channels);
    int emb = ref_linear(m, sinusoid, "time_embed.0.", 4 * c->model_channels);
    emb = ref_linear(m, ref_same_shape(m, REF_SILU, emb, -1), "time_embed.2.", 4 * c->model_channels);
    if (c->num_classes) {
        free(m->labels);
        m->labels = (int64_t *)malloc_or_die(N * sizeof(int64_t));
        for (int n = 0; n < N; n++) {
            if (y[n] < 0 || y[n] >= c->num_classes) fatal("reference UNet: label %lld out of range", (long long)y[n]);
            m->labels[n] = y[n];
        }
        RefOp op = ref_op(REF_EMBEDDING, -1, -1);
        op.weight = ref_param(m, "label_emb.", "weight");
        emb = ref_same_shape(m, REF_ADD, emb, ref_apply(m, op, N, 1, 1, 4 * c->model_channels));
    }
    int silu_emb = ref_same_shape(m, REF_SILU, emb, -1);

    m->input = ref_new_tensor(m, N, c->image_size, c->image_size, c->in_channels);
    m->tensors[m->input].leaf = 1;
    memcpy(m->tensors[m->input].data, x, ref_numel(&m->tensors[m->input]) * sizeof(double));
    int h = m->input;
    if (c->low_res) {  // SuperResModel: cat([x, F.interpolate(low_res, x's size, "bilinear")], channels)
        if (!m->low_res) fatal("reference UNet: an upsampler needs its low-resolution images (m->low_res)");
        int lo = ref_new_tensor(m, N, c->low_res, c->low_res, c->in_channels);
        m->tensors[lo].leaf = 1;
        memcpy(m->tensors[lo].data, m->low_res, ref_numel(&m->tensors[lo]) * sizeof(double));
        h = ref_concat(m, h, ref_apply(m, ref_op(REF_BILINEAR, lo, -1), N, c->image_size, c->image_size, c->in_channels));
    }

    int skips[4 * MAX_LEVELS * 8], num_skips = 0, block = 1;
    h = ref_conv(m, h, "input_blocks.0.0.", c->level_channels[0], 3, 1);
    skips[num_skips++] = h;
    for (int level = 0; level < c->num_levels; level++) {
        for (int r = 0; r < c->num_res_blocks; r++, block++) {
            snprintf(name, sizeof name, "input_blocks.%d.0.", block);
            h = ref_res_block(m, h, silu_emb, name, c->level_channels[level], REF_SAME);
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "input_blocks.%d.1.", block);
                h = ref_attention_block(m, h, name, ref_heads(c, c->level_channels[level], 0));
            }
            skips[num_skips++] = h;
        }
        if (level == c->num_levels - 1) continue;
        int ch = ref_tensor(m, h)->C;
        if (c->resblock_updown) {
            snprintf(name, sizeof name, "input_blocks.%d.0.", block);
            h = ref_res_block(m, h, silu_emb, name, ch, REF_DOWN);
        } else if (c->conv_resample) {
            snprintf(name, sizeof name, "input_blocks.%d.0.op.", block);
            h = ref_conv(m, h, name, ch, 3, 2);
        } else {
            h = ref_resample(m, h, 0);
        }
        skips[num_skips++] = h;
        block++;
    }

    int ch = ref_tensor(m, h)->C;
    h = ref_res_block(m, h, silu_emb, "middle_block.0.", ch, REF_SAME);
    h = ref_attention_block(m, h, "middle_block.1.", ref_heads(c, ch, 0));
    h = ref_res_block(m, h, silu_emb, "middle_block.2.", ch, REF_SAME);
    if (c->pool) {
        m->output = ref_pool_head(m, h, skips, num_skips);
        ref_unet_output(m, out);
        return;
    }

    block = 0;
    for (int level = c->num_levels - 1; level >= 0; level--) {
        for (int r = 0; r <= c->num_res_blocks; r++, block++) {
            ch = c->level_channels[level];
            snprintf(name, sizeof name, "output_blocks.%d.0.", block);
            h = ref_res_block(m, ref_concat(m, h, skips[--num_skips]), silu_emb, name, ch, REF_SAME);
            int layer = 1;
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "output_blocks.%d.%d.", block, layer++);
                h = ref_attention_block(m, h, name, ref_heads(c, ch, 1));
            }
            if (level == 0 || r != c->num_res_blocks) continue;
            if (c->resblock_updown) {
                snprintf(name, sizeof name, "output_blocks.%d.%d.", block, layer);
                h = ref_res_block(m, h, silu_emb, name, ch, REF_UP);
            } else {
                h = ref_resample(m, h, 1);
                if (c->conv_resample) {
                    snprintf(name, sizeof name, "output_blocks.%d.%d.conv.", block, layer);
                    h = ref_conv(m, h, name, ch, 3, 1);
                }
            }
        }
    }

    h = ref_norm(m, h, "out.0.", -1, 1);
    m->output = ref_conv(m, h, "out.2.", c->out_channels, 3, 1);
    ref_unet_output(m, out);
}

// Backward of the last forward pass, from d_out = d loss / d out [N][image][image][out_channels]
// (a classifier's: [N][1][1][out_channels]):
// accumulates d loss / d parameter into m->grad and, when d_x is not NULL, d loss / d x into d_x.
static void ref_unet_backward(RefUNet *m, const double *d_out, double *d_x) {
    for (int i = 0; i < m->num_tensors; i++) {
        RefTensor *t = &m->tensors[i];
        free(t->grad);
        t->grad = !t->leaf || (i == m->input && d_x) ? dev_alloc(ref_numel(t)) : NULL;
    }
    RefTensor *out = &m->tensors[m->output], *in = &m->tensors[m->input];
    memcpy(out->grad, d_out, ref_numel(out) * sizeof(double));
    for (int i = m->num_ops - 1; i >= 0; i--) ref_op_run(m, &m->ops[i], 1);
    if (d_x) ref_add_backward(d_x, NULL, in->grad, ref_numel(in));
}

// The spatial head's ReLU has a kink at 0: a hidden unit that a sample leaves just above or below 0
// passes a gradient or none on a change too small to matter elsewhere (a finite difference's step,
// the GPU's rounding). Tests move the units away from it: after a forward pass, every out.0.bias[j]
// whose unit j is within margin = fraction * (the RMS of the ReLU's inputs) of 0 in some sample is
// moved by a multiple of margin (then rounded by round_to, when not NULL: to the stored precision)
// until every sample's input j is at least margin from 0. Returns how many biases moved (0 for any
// other head); the caller runs the forward pass again.
static int ref_unet_relu_margin(RefUNet *m, double fraction, double (*round_to)(double)) {
    if (m->config.pool != POOL_SPATIAL) return 0;
    const RefTensor *z = NULL;
    for (int i = 0; i < m->num_ops && !z; i++)
        if (m->ops[i].type == REF_RELU) z = &m->tensors[m->ops[i].in];
    int bias = ref_unet_find(m, "out.0.bias");
    if (!z || bias < 0) fatal("reference UNet: no forward pass of the spatial head to move its ReLU's inputs");
    int N = z->N, H = z->C, moved = 0;
    double *b = m->param[bias], margin = fraction * dev_norm(z->data, ref_numel(z)) / sqrt((double)ref_numel(z));
    for (int j = 0; j < H; j++) {
        // candidates b, b + margin, b - margin, b + 2 margin, ...: each sample's open interval of
        // width 2 margin rules out at most two of them
        int found = 0;
        for (int k = 0; k < 4 * N + 4 && !found; k++) {
            double v = b[j] + (k + 1) / 2 * margin * (k % 2 ? 1 : -1);
            if (round_to) v = round_to(v);
            found = 1;
            for (int n = 0; n < N; n++) found &= fabs(z->data[(size_t)n * H + j] - b[j] + v) >= margin;
            if (found && v != b[j]) b[j] = v, moved++;
        }
        if (!found) fatal("reference UNet: found no out.0.bias[%d] that leaves its unit %g from 0", j, margin);
    }
    return moved;
}
