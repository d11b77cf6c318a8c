// test_unet_gpu_reference.cu: the trainer's whole model on the GPU against the CPU reference
// (dev/unet.cu, double) on configurations the fixtures do not cover: 64 and 96 channels, odd image
// sizes, four levels, every option; and the noisy classifier (EncoderUNetModel) with each pool, its
// logits [N][classes] under the same MSE loss against a random target. (A GroupNorm over a single value, e.g. 32 channels at 1x1,
// divides rounding noise by sqrt(eps): the per-layer checks in dev/ cover 1x1 inputs instead.) Random bf16-exact parameters (the zero-initialised
// layers too), inputs, timesteps and labels, fresh each run (DEV_SEED repeats one). Tolerances
// as in test_unet_gpu.cu: FP32 1e-5; BF16 2e-2 for the output, 8e-2 for gradients (a gradient
// that is zero in exact arithmetic against 1e-2 of the largest gradient norm).
#include "../unet.cu"
#include "check.h"

static const double TOLERANCE = sizeof(floatX) == 4 ? 1e-5 : 2e-2, TOLERANCE_GRAD = sizeof(floatX) == 4 ? 1e-5 : 8e-2;

typedef struct {
    const char *name;
    int image_size, num_channels, num_res_blocks, num_heads, num_heads_upsample, num_head_channels;
    const char *channel_mult, *attention_resolutions;
    int use_scale_shift_norm, resblock_updown, conv_resample, use_new_attention_order, classes, batch;
    const char *pool;  // a classifier's (adaptive, attention, spatial, spatial_v2; classes: its logits), or NULL: the UNet
} TestConfig;

static const TestConfig CONFIGS[] = {
    {"64 channels, no scale-shift, 5 classes, legacy attention with 2 heads", 16, 64, 1, 2, -1, -1, "1,2", "8", 0, 0, 0, 0, 5, 3},
    {"96 channels, 14x14, scale-shift, resblock up/down, new order, 32-channel heads", 14, 96, 2, 4, -1, 32, "1,2", "7", 1, 1, 0, 1, 0, 2},
    {"4 levels down to 2x2, conv resampling, 4 heads down and 2 up, 3 classes", 16, 64, 1, 4, 2, -1, "1,1,1,2", "4,2", 0, 0, 1, 0, 3, 2},
    {"64x64, scale-shift: the sm_90a halo convolutions at 64 pixels wide", 64, 64, 1, 2, -1, -1, "1,2", "32", 1, 0, 0, 0, 0, 1},
    {"classifier, attention pool: 128 channels at 8x8, 65 tokens in 2 heads of 64, legacy blocks", 16, 64, 1, 1, -1, 64, "1,2",
     "8", 1, 1, 0, 0, 10, 3, "attention"},
    {"classifier, attention pool: 64 channels at 4x4, 17 tokens in 2 heads of 32, new-order blocks", 16, 32, 1, 1, -1, 32, "1,2,2",
     "8,4", 0, 0, 1, 1, 7, 2, "attention"},
    {"classifier, adaptive pool: 96 channels at 7x7, 3 heads, average-pool down", 14, 96, 2, 3, -1, -1, "1,1", "7", 1, 0, 0, 0, 4, 2,
     "adaptive"},
    // the spatial pools: the means of every input block's output and the middle block's, Linear(F, 2048)
    {"classifier, spatial pool: 16 to 4x4, 64 to 128 channels, resblock down, F = 704 features", 16, 64, 1, 2, -1, -1, "1,2,2", "8",
     1, 1, 0, 0, 6, 3, "spatial"},
    {"classifier, spatial_v2 pool: 14 to 7x7, 96 channels, strided-conv down, new order, F = 672 features", 14, 96, 2, 1, -1,
     32, "1,1", "7", 0, 0, 1, 1, 5, 2, "spatial_v2"},
};

static ModelConfig make_config(const TestConfig *t) {
    Options o = preset_seed();
    o.image_size = t->image_size, o.num_channels = t->num_channels, o.num_res_blocks = t->num_res_blocks;
    o.num_heads = t->num_heads, o.num_heads_upsample = t->num_heads_upsample, o.num_head_channels = t->num_head_channels;
    o.channel_mult = t->channel_mult, o.attention_resolutions = t->attention_resolutions;
    o.use_scale_shift_norm = t->use_scale_shift_norm, o.resblock_updown = t->resblock_updown;
    o.conv_resample = t->conv_resample, o.use_new_attention_order = t->use_new_attention_order;
    o.class_cond = t->classes > 0 && !t->pool;
    ModelConfig c = resolve_model(&o, t->classes);
    char err[256];
    if (t->pool && classifier_config(&c, t->pool, t->classes, err, sizeof err) != 0) fatal("%s", err);
    return c;
}

// Parameters of the scale PyTorch's initialisation gives (twice as wide), with the zero-initialised
// layers random too; GroupNorm weights near 1, biases near 0. All exactly representable in floatX.
// The head's GroupNorm: out.0 (the UNet's, the adaptive and attention pools'), out.1 (spatial_v2's),
// none (spatial's: out.0 is a Linear layer).
static void random_parameters(RefUNet *r) {
    int pool = r->config.pool;
    const char *head_norm = pool == POOL_SPATIAL ? NULL : pool == POOL_SPATIAL_V2 ? "out.1." : "out.0.";
    for (int i = 0; i < r->params.count; i++) {
        const ParamSpec *p = &r->params.specs[i];
        int norm = strstr(p->name, "in_layers.0.") || strstr(p->name, "out_layers.0.") || strstr(p->name, ".norm.") ||
                   (head_norm && strncmp(p->name, head_norm, 6) == 0);
        double bound = p->ndim >= 2 ? 2.0 / sqrt((double)(p->numel / p->shape[0])) : 0.2;
        if (strncmp(p->name, "label_emb.", 10) == 0) bound = 1.0;
        for (int64_t j = 0; j < p->numel; j++) {
            double v = dev_uniform(-bound, bound) + (norm && ends_with(p->name, "weight") ? 1.0 : 0.0);
            r->param[i][j] = dev_round_x(v);
        }
    }
}

static void test_config(const TestConfig *t) {
    ModelConfig c = make_config(t);
    int N = t->batch, S = c.image_size, So = c.pool ? 1 : S;  // So: the output's side (a classifier's logits: 1)
    RefUNet r;
    ref_unet_init(&r, &c);
    random_parameters(&r);
    int64_t in_count = (int64_t)N * S * S * c.in_channels, out_count = (int64_t)N * So * So * c.out_channels;
    double *x = dev_alloc(in_count), *target = dev_alloc(out_count), *out = dev_alloc(out_count);
    double *d_out = dev_alloc(out_count), *d_x = dev_alloc(in_count);
    for (int64_t i = 0; i < in_count; i++) x[i] = dev_round_x(dev_uniform(-1, 1));
    for (int64_t i = 0; i < out_count; i++) target[i] = dev_round_x(dev_uniform(-1, 1));
    int64_t steps[16], labels64[16];
    int labels[16];
    for (int n = 0; n < N; n++) steps[n] = dev_random_int(1000), labels64[n] = c.num_classes ? dev_random_int(c.num_classes) : 0, labels[n] = (int)labels64[n];

    // The reference: forward, the MSE loss and its gradient, backward. The spatial head's ReLU inputs
    // are kept 0.1 of their RMS from its kink (moving out.0.bias where needed), far beyond what
    // bf16 changes: a unit on the other side of it in one sample changes a row of out.0.weight's
    // gradient whole.
    int moved = 0;
    if (c.pool == POOL_SPATIAL) {
        ref_unet_forward(&r, x, steps, NULL, out, N);
        moved = ref_unet_relu_margin(&r, 0.1, dev_round_x);
    }
    ref_unet_forward(&r, x, steps, c.num_classes ? labels64 : NULL, out, N);
    double loss = 0;
    for (int64_t i = 0; i < out_count; i++) loss += (out[i] - target[i]) * (out[i] - target[i]), d_out[i] = 2 * (out[i] - target[i]) / out_count;
    loss /= out_count;
    ref_unet_zero_grad(&r);
    memset(d_x, 0, in_count * sizeof(double));
    ref_unet_backward(&r, d_out, d_x);

    // The trainer.
    UNet m;
    unet_create(&m, &c, N, 1);
    float **values = (float **)malloc_or_die(r.params.count * sizeof(float *));
    for (int i = 0; i < r.params.count; i++) {
        values[i] = (float *)malloc_or_die(r.params.specs[i].numel * sizeof(float));
        for (int64_t j = 0; j < r.params.specs[i].numel; j++) values[i][j] = (float)r.param[i][j];
    }
    unet_set_parameters(&m, values);
    dev_copy_x(m.input.x, x, in_count);
    dev_copy_x(m.target.x, target, out_count);
    cuda_check(cudaMemcpy(m.timesteps, steps, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    cuda_check(cudaMemcpy(m.labels, labels, N * sizeof(int), cudaMemcpyHostToDevice));
    unet_forward(&m, 1);
    // the MSE over every output channel (the fixture's loss), every sample weighted 1
    LossOutputs loss_out = loss_outputs_create(N, So * So);
    LossInputs no_inputs = {NULL, NULL, NULL, NULL, 0, NULL};
    LossKind mse_only = {0, 1, 0, PREDICT_EPS, 1.0f};
    training_loss(&loss_out, m.output->dx, m.output->x, m.target.x, &no_inputs, N, So * So, c.out_channels, mse_only);
    unet_backward(&m, 1, NULL, NULL);
    cuda_check(cudaDeviceSynchronize());

    check_case(t->name);
    double *gpu_out = dev_download_x(m.output->x, out_count), *gpu_dx = dev_download_x(m.input.dx, in_count);
    float gpu_loss;
    cuda_check(cudaMemcpy(&gpu_loss, loss_out.terms, sizeof gpu_loss, cudaMemcpyDeviceToHost));
    double out_err = dev_rel_error(gpu_out, out, out_count), loss_err = fabs(gpu_loss - loss) / loss;
    double dx_err = dev_rel_error(gpu_dx, d_x, in_count), worst = 0;
    const char *worst_name = "";
    float *g = (float *)malloc_or_die(m.params.numel * sizeof(float));
    double *gd = dev_alloc(m.params.numel), largest = 0;
    for (int i = 0; i < r.params.count; i++) largest = fmax(largest, dev_norm(r.grad[i], r.params.specs[i].numel));
    for (int i = 0; i < r.params.count; i++) {
        const ParamSpec *p = &r.params.specs[i];
        unet_get_parameter(&m, i, 1, g);
        for (int64_t j = 0; j < p->numel; j++) gd[j] = g[j] - r.grad[i][j];
        // gradients that are zero in exact arithmetic (at 32 channels a bias before a GroupNorm) are
        // measured against 1e-2 of the largest gradient norm, as in test_unet_gpu.cu
        double e = dev_norm(gd, p->numel) / fmax(dev_norm(r.grad[i], p->numel), 1e-2 * largest);
        if (!(e <= worst)) worst = e, worst_name = p->name;
    }
    printf("  output %.2e, loss %.2e, input gradient %.2e, worst parameter gradient %.2e (%s)\n", out_err, loss_err,
           dx_err, worst, worst_name);
    if (c.pool == POOL_SPATIAL)
        printf("  (%d of out.0.bias's %d entries moved away from the ReLU's kink)\n", moved, SPATIAL_HIDDEN);
    CHECK(out_err <= TOLERANCE);
    CHECK(loss_err <= TOLERANCE);
    CHECK(dx_err <= TOLERANCE_GRAD);
    CHECK(worst <= TOLERANCE_GRAD);
    for (int i = 0; i < r.params.count; i++) free(values[i]);
    free(values), free(g), free(gd), free(gpu_out), free(gpu_dx), free(x), free(target), free(out), free(d_out), free(d_x);
    ref_unet_free(&r);
}

int main(void) {
    gpu_init(0);
    dev_seed_once();
    for (size_t i = 0; i < sizeof CONFIGS / sizeof CONFIGS[0]; i++) {
        if (CONFIGS[i].pool && strcmp(CONFIGS[i].pool, "spatial_v2") == 0 && !group_norm_fits(SPATIAL_HIDDEN)) {
            printf("skip %s: its GroupNorm over %d channels is beyond the %s build's kernels\n", CONFIGS[i].name, SPATIAL_HIDDEN,
                   PRECISION_NAME);
            continue;
        }
        test_config(&CONFIGS[i]);
    }
    return check_summary();
}
