// test_unet_fixtures.cu: the CPU reference UNet (dev/unet.cu) against the whole-model fixtures of
// scripts/make_fixtures.py (PyTorch's guided-diffusion UNet run in float64), and against finite
// differences on configurations the fixtures do not cover (a UNet and a classifier of each head).
//
//   test_unet_fixtures [DIR]      every DIR/*.safetensors (default dev/fixtures)
//
// Per fixture: the parameter names and shapes equal model_parameters()'s; out and loss, and the
// gradients of the loss (grouped by top-level module, then grad.x), within a relative error of
// 1e-5. The fixtures store float32 roundings of float64 results, so a correct reference lands
// within ~6e-8. A classifier's fixture (metadata classifier_pool) holds its logits: out and target
// [N, classes].
#include "../unet.cu"
#include "check.h"
#include <dirent.h>

#define TOLERANCE 1e-5
// Some gradients are zero in exact arithmetic (a bias feeding a GroupNorm with one channel per
// group, e.g. in_layers.2.bias at width 32: the norm removes any per-channel constant; at width 32
// without scale-shift also the whole timestep MLP); PyTorch's float64 and ours both leave rounding
// noise there. Each gradient is therefore compared as ||a - b|| / max(||b||, FLOOR G), G the norm
// of all the fixture's gradients together. In the committed fixtures the zero gradients are
// <= 4e-17 G and our difference from them <= 6e-17 G, while every real gradient tensor is
// >= 1.5e-3 G: with FLOOR = 1e-8 a zero gradient may be off by 1e-5 FLOOR G = 1e-13 G (~2000 times
// the noise, far below any real gradient), and every real one is compared purely relatively.
#define FLOOR 1e-8
#define FD_STEP 1e-5
#define FD_TOLERANCE 1e-6

// The fixture's tensors that are not parameters or their gradients.
static int is_data_tensor(const char *name) {
    static const char *const data[] = {"x", "t", "y", "low_res", "target", "out", "loss", "grad.x"};
    for (int i = 0; i < 8; i++)
        if (strcmp(name, data[i]) == 0) return 1;
    return 0;
}

// Every parameter (and grad.<parameter>) in the fixture with its PyTorch shape, and nothing else.
static void check_names(const char *fixture, const SafeTensorsFile *f, const RefUNet *m) {
    check_case(dev_name("%s: parameter names and shapes = model_parameters()", fixture));
    for (int i = 0; i < m->params.count; i++) {
        const ParamSpec *p = &m->params.specs[i];
        for (int gradient = 0; gradient < 2; gradient++) {
            char name[128];
            snprintf(name, sizeof name, "%s%s", gradient ? "grad." : "", p->name);
            const SafeTensor *t = safetensors_find(f, name);
            int same = t && t->ndim == p->ndim;
            for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->shape[d];
            if (!same) printf("  %s: %s\n", name, t ? "shape differs" : "missing from the fixture");
            CHECK(same);
        }
    }
    for (int i = 0; i < f->count; i++) {
        const char *name = f->tensors[i].name;
        const char *param = strncmp(name, "grad.", 5) == 0 ? name + 5 : name;
        int known = is_data_tensor(name) || ref_unet_find(m, param) >= 0;
        if (!known) printf("  %s: in the fixture, not in model_parameters()\n", name);
        CHECK(known);
    }
}

static double *load(const SafeTensorsFile *f, const char *name, int64_t numel) {
    double *out = dev_alloc(numel);
    dev_load_tensor(f, name, out, numel);
    return out;
}

// The top-level module of a parameter name: "input_blocks.3.0.in_layers.2.weight" -> "input_blocks".
static int same_group(const char *name, const char *group) {
    size_t n = strlen(group);
    return strncmp(name, group, n) == 0 && name[n] == '.';
}

static void test_fixture(const char *dir, const char *file) {
    char path[1024], err[512];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    SafeTensorsFile f;
    check_case(dev_name("%s: opens", file));
    if (safetensors_open(path, &f, err, sizeof err) != 0) {
        printf("  %s\n", err);
        CHECK(0);
        return;
    }
    ModelConfig config;
    if (model_config_from_metadata(&f, path, &config, err, sizeof err) != 0) {
        printf("  %s\n", err);
        CHECK(0);
        safetensors_close(&f);
        return;
    }
    RefUNet m;
    ref_unet_init(&m, &config);
    check_names(file, &f, &m);
    if (check_case_failed) {
        ref_unet_free(&m);
        safetensors_close(&f);
        return;
    }

    const SafeTensor *xt = safetensors_find(&f, "x");
    if (!xt || xt->ndim != 4 || xt->shape[1] != config.in_channels || xt->shape[2] != config.image_size ||
        xt->shape[3] != config.image_size)
        fatal("%s: x is not [N, %d, %d, %d]", file, config.in_channels, config.image_size, config.image_size);
    // The output's side So: the image's, or 1 for a classifier's logits ([N, classes] is NCHW and
    // NHWC at once).
    int N = (int)xt->shape[0], S = config.image_size, Cin = config.in_channels, Cout = config.out_channels;
    int So = config.pool ? 1 : S;
    size_t in_n = (size_t)N * Cin * S * S, out_n = (size_t)N * Cout * So * So;
    for (int i = 0; i < m.params.count; i++) dev_load_tensor(&f, m.params.specs[i].name, m.param[i], m.params.specs[i].numel);
    double *x_nchw = load(&f, "x", in_n), *x = dev_alloc(in_n), *target = load(&f, "target", out_n);
    double *want_out = load(&f, "out", out_n), *want_loss = load(&f, "loss", 1), *want_dx = load(&f, "grad.x", in_n);
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t)), *y = NULL;
    if (safetensors_get_int64(safetensors_find(&f, "t"), t) != 0) fatal("%s: t is not an integer tensor", file);
    if (config.num_classes) {
        y = (int64_t *)malloc_or_die(N * sizeof(int64_t));
        if (safetensors_get_int64(safetensors_find(&f, "y"), y) != 0) fatal("%s: y is not an integer tensor", file);
    }
    dev_nchw_to_nhwc(x, x_nchw, N, Cin, S, S);
    double *low = NULL;
    if (config.low_res) {  // the upsampler's low-resolution input
        size_t n_low = (size_t)N * Cin * config.low_res * config.low_res;
        double *low_nchw = load(&f, "low_res", n_low);
        low = dev_alloc(n_low);
        dev_nchw_to_nhwc(low, low_nchw, N, Cin, config.low_res, config.low_res);
        free(low_nchw);
    }
    m.low_res = low;

    // Forward, loss and backward; the loss and its gradient in NCHW like the fixture.
    double *out = dev_alloc(out_n), *out_nchw = dev_alloc(out_n), *d_out_nchw = dev_alloc(out_n), *d_out = dev_alloc(out_n);
    double *d_x = dev_alloc(in_n), *d_x_nchw = dev_alloc(in_n);
    ref_unet_forward(&m, x, t, y, out, N);
    dev_nhwc_to_nchw(out_nchw, out, N, Cout, So, So);
    double loss = ref_mse_forward(out_nchw, target, out_n);
    ref_mse_backward(d_out_nchw, out_nchw, target, out_n);
    dev_nchw_to_nhwc(d_out, d_out_nchw, N, Cout, So, So);
    ref_unet_zero_grad(&m);
    ref_unet_backward(&m, d_out, d_x);
    dev_nhwc_to_nchw(d_x_nchw, d_x, N, Cin, S, S);

    check_case(dev_name("%s: forward (out, loss)", file));
    double e_out = dev_rel_error(out_nchw, want_out, out_n), e_loss = dev_rel_error(&loss, want_loss, 1);
    CHECK(e_out <= TOLERANCE);
    CHECK(e_loss <= TOLERANCE);

    // The scale of the whole gradient, for the floor.
    double scale = 0;
    for (int i = 0; i < f.count; i++)
        if (strncmp(f.tensors[i].name, "grad.", 5) == 0) {
            double *g = load(&f, f.tensors[i].name, f.tensors[i].numel), norm = dev_norm(g, f.tensors[i].numel);
            scale += norm * norm;
            free(g);
        }
    scale = sqrt(scale);

    static const char *const groups[] = {"time_embed", "label_emb", "input_blocks", "middle_block", "output_blocks", "out"};
    double worst = 0, worst_zero = 0;
    const char *worst_name = "";
    for (int g = 0; g < 6; g++) {
        int first = 1;
        for (int i = 0; i < m.params.count; i++) {
            const ParamSpec *p = &m.params.specs[i];
            if (!same_group(p->name, groups[g])) continue;
            if (first) check_case(dev_name("%s: grad %s.*", file, groups[g])), first = 0;
            char name[128];
            snprintf(name, sizeof name, "grad.%s", p->name);
            double *want = load(&f, name, p->numel), diff = 0, norm = dev_norm(want, p->numel);
            for (int64_t j = 0; j < p->numel; j++) diff += (m.grad[i][j] - want[j]) * (m.grad[i][j] - want[j]);
            double e = sqrt(diff) / fmax(norm, FLOOR * scale);
            if (!(e <= TOLERANCE)) printf("  %s: rel err %.2e (norm %.2e)\n", name, e, norm);
            CHECK(e <= TOLERANCE);
            if (norm < FLOOR * scale) {
                if (sqrt(diff) / scale > worst_zero) worst_zero = sqrt(diff) / scale;
            } else if (e > worst) {
                worst = e, worst_name = m.params.specs[i].name;
            }
            free(want);
        }
    }
    check_case(dev_name("%s: grad.x", file));
    double e_dx = dev_rel_error(d_x_nchw, want_dx, in_n);
    CHECK(e_dx <= TOLERANCE);
    printf("  %s: %d parameter tensors; rel err out %.1e, loss %.1e, grad.x %.1e, parameter grads max %.1e (%s); "
           "zero grads max |err|/G %.1e (G %.2e)\n",
           file, m.params.count, e_out, e_loss, e_dx, worst, worst_name, worst_zero, scale);

    free(x_nchw), free(x), free(target), free(want_out), free(want_loss), free(want_dx), free(t), free(y), free(low);
    free(out), free(out_nchw), free(d_out_nchw), free(d_out), free(d_x), free(d_x_nchw);
    ref_unet_free(&m);
    safetensors_close(&f);
}

// ----------------------------------------------------------------------------------------------
// Finite differences on configurations the fixtures do not cover (see main): the loss's gradient
// in a few random entries of the parameters (and one entry of each of the head's, out.*) and of x,
// against central differences.

typedef struct {
    RefUNet *m;
    const double *x, *target;
    const int64_t *t, *y;
    int N;
    size_t out_n;
} ModelLossInputs;

static double unet_loss(const ModelLossInputs *in) {
    double *out = dev_alloc(in->out_n);
    ref_unet_forward(in->m, in->x, in->t, in->y, out, in->N);
    double loss = ref_mse_forward(out, in->target, in->out_n);
    free(out);
    return loss;
}

// Central difference of the loss in *v.
static double finite_difference(const ModelLossInputs *in, double *v) {
    double saved = *v;
    *v = saved + FD_STEP;
    double plus = unet_loss(in);
    *v = saved - FD_STEP;
    double minus = unet_loss(in);
    *v = saved;
    return (plus - minus) / (2 * FD_STEP);
}

// The model of the options o (dropout 0, no learned sigma), with `classes` labels when class_cond;
// or, with pool (adaptive, attention, spatial, spatial_v2), the classifier of that body with
// `classes` logits.
static void test_finite_differences(const char *what, Options o, const char *pool, int classes) {
    ModelConfig c = resolve_model(&o, classes);
    char err[256];
    if (pool && classifier_config(&c, pool, classes, err, sizeof err) != 0) fatal("%s", err);
    RefUNet m;
    ref_unet_init(&m, &c);
    check_case(dev_name("finite differences: %s, %d tensors", what, m.params.count));

    // Parameters as make_fixtures.py draws them (uniform instead of normal): weights of variance
    // ~1/fan_in, GroupNorm scales ~1, biases ~0.1, label embedding ~1.
    for (int i = 0; i < m.params.count; i++) {
        const ParamSpec *p = &m.params.specs[i];
        int gn_scale = p->ndim == 1 && strcmp(p->name + strlen(p->name) - 6, "weight") == 0;
        double r = p->ndim >= 2 ? sqrt(3.0 * p->shape[0] / p->numel) : 0.17;
        if (strcmp(p->name, "label_emb.weight") == 0) r = 1.7;
        dev_fill_uniform(m.param[i], p->numel, (gn_scale ? 1 : 0) - r, (gn_scale ? 1 : 0) + r);
    }
    int N = 2, S = c.image_size, So = c.pool ? 1 : S;
    size_t in_n = (size_t)N * S * S * c.in_channels, out_n = (size_t)N * So * So * c.out_channels;
    double *x = dev_alloc(in_n), *target = dev_alloc(out_n), *out = dev_alloc(out_n), *d_out = dev_alloc(out_n), *d_x = dev_alloc(in_n);
    dev_fill_uniform(x, in_n, -1.7, 1.7);
    dev_fill_uniform(target, out_n, -1.7, 1.7);
    int64_t t[2] = {dev_random_int(1000), dev_random_int(1000)}, y[2] = {0, 0};
    if (c.num_classes) y[0] = dev_random_int(c.num_classes), y[1] = dev_random_int(c.num_classes);
    ModelLossInputs in = {&m, x, target, t, c.num_classes ? y : NULL, N, out_n};

    ref_unet_forward(&m, x, t, in.y, out, N);
    // The spatial head's ReLU inputs moved (by out.0.bias) 1e-2 of their RMS or more from its kink,
    // so that no step of FD_STEP crosses it (each moves them by ~1e-5).
    if (ref_unet_relu_margin(&m, 1e-2, NULL)) ref_unet_forward(&m, x, t, in.y, out, N);
    ref_mse_backward(d_out, out, target, out_n);
    ref_unet_zero_grad(&m);
    ref_unet_backward(&m, d_out, d_x);

    // The head's parameters first (one entry each), then random ones.
    int head[16], heads = 0;
    for (int i = 0; i < m.params.count && heads < 16; i++)
        if (strncmp(m.params.specs[i].name, "out.", 4) == 0) head[heads++] = i;
    enum { PARAM_ENTRIES = 24, X_ENTRIES = 6 };
    double analytic[PARAM_ENTRIES + X_ENTRIES], numeric[PARAM_ENTRIES + X_ENTRIES];
    const char *name[PARAM_ENTRIES + X_ENTRIES];
    int64_t where[PARAM_ENTRIES + X_ENTRIES];
    for (int e = 0; e < PARAM_ENTRIES + X_ENTRIES; e++) {
        int i = e >= PARAM_ENTRIES ? -1 : e < heads ? head[e] : (int)dev_random_int(m.params.count);
        name[e] = i >= 0 ? m.params.specs[i].name : "x";
        where[e] = dev_random_int(i >= 0 ? m.params.specs[i].numel : (int64_t)in_n);
        double *v = i >= 0 ? &m.param[i][where[e]] : &x[where[e]];
        analytic[e] = i >= 0 ? m.grad[i][where[e]] : d_x[where[e]];  // forward passes leave the gradients alone
        numeric[e] = finite_difference(&in, v);
    }
    double e_param = dev_rel_error(analytic, numeric, PARAM_ENTRIES);
    double e_x = dev_rel_error(analytic + PARAM_ENTRIES, numeric + PARAM_ENTRIES, X_ENTRIES);
    printf("  finite differences: %d parameter entries rel err %.1e, %d x entries rel err %.1e\n", PARAM_ENTRIES, e_param,
           X_ENTRIES, e_x);
    if (!(e_param <= FD_TOLERANCE && e_x <= FD_TOLERANCE))
        for (int e = 0; e < PARAM_ENTRIES + X_ENTRIES; e++)
            printf("  %-44s [%6lld] analytic % .10e numeric % .10e\n", name[e], (long long)where[e], analytic[e], numeric[e]);
    CHECK(e_param <= FD_TOLERANCE);
    CHECK(e_x <= FD_TOLERANCE);
    free(x), free(target), free(out), free(d_out), free(d_x);
    ref_unet_free(&m);
}

// Image 8, batch 2, dropout 0, no learned sigma; the rest as each test gives it.
static Options fd_options(int num_channels, const char *channel_mult, const char *attention_resolutions) {
    Options o = guided_diffusion_defaults();
    o.image_size = 8, o.num_channels = num_channels, o.channel_mult = channel_mult, o.num_res_blocks = 1;
    o.attention_resolutions = attention_resolutions, o.dropout = 0, o.class_cond = 0, o.learn_sigma = 0;
    return o;
}

static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

int main(int argc, char **argv) {
    const char *dir = argc > 1 ? argv[1] : "dev/fixtures";
    DIR *d = opendir(dir);
    char *files[256];
    int count = 0;
    struct dirent *e;
    while (d && (e = readdir(d)) && count < 256) {
        size_t n = strlen(e->d_name);
        if (n > 12 && strcmp(e->d_name + n - 12, ".safetensors") == 0) files[count++] = strdup(e->d_name);
    }
    if (d) closedir(d);
    check_case(dev_name("fixtures found in %s", dir));
    CHECK(count > 0);
    qsort(files, count, sizeof files[0], compare_names);
    for (int i = 0; i < count; i++) test_fixture(dir, files[i]), free(files[i]);

    // The UNet at width 64 (two channels per group, so the plain embedding add before the GroupNorm
    // matters), no scale-shift, two levels with a channel change (a 1x1 skip conv in the input
    // blocks), conv resampling, new-order attention with num_heads 2 / num_heads_upsample 4,
    // class-conditional.
    Options o = fd_options(64, "1,2", "4");
    o.num_heads = 2, o.num_head_channels = -1, o.num_heads_upsample = 4, o.use_new_attention_order = 1;
    o.use_scale_shift_norm = 0, o.resblock_updown = 0, o.conv_resample = 1, o.class_cond = 1;
    test_finite_differences("width 64, mult 1,2, no scale-shift, new-order heads 2/4", o, NULL, 5);
    // The attention-pool classifier on 64 channels at 4x4 (T = 17 tokens, 2 heads of 32 in the new
    // order) after legacy-order attention blocks of the same heads, scale-shift, average-pool
    // downsampling, 3 classes.
    o = fd_options(32, "1,2", "4");
    o.num_heads = 1, o.num_head_channels = 32, o.use_new_attention_order = 0;
    o.use_scale_shift_norm = 1, o.resblock_updown = 0, o.conv_resample = 0;
    test_finite_differences("attention-pool classifier, 64 channels at 4x4, legacy blocks", o, "attention", 3);
    // The adaptive-pool classifier of width 64, attention at 8x8 with 4 heads in the new order,
    // ResBlock downsampling, no scale-shift, 4 classes.
    o = fd_options(64, "1,1", "8");
    o.num_heads = 4, o.num_head_channels = -1, o.use_new_attention_order = 1;
    o.use_scale_shift_norm = 0, o.resblock_updown = 1, o.conv_resample = 1;
    test_finite_differences("adaptive-pool classifier, width 64, resblock down, new-order heads 4", o, "adaptive", 4);
    // The spatial classifiers: features of five sources (input_blocks.0's conv, a ResBlock with
    // attention at 8x8, the downsampling, a ResBlock at 4x4 that changes the channels, the middle
    // block; 32 + 32 + 32 + 64 + 64 = 224 channels), Linear(224, 2048), then ReLU (spatial) or
    // GroupNorm and SiLU on [N, 2048] (spatial_v2), Linear(2048, classes).
    o = fd_options(32, "1,2", "8");
    o.num_heads = 2, o.num_head_channels = -1, o.use_new_attention_order = 0;
    o.use_scale_shift_norm = 1, o.resblock_updown = 0, o.conv_resample = 1;
    test_finite_differences("spatial-pool classifier, mult 1,2, scale-shift, strided-conv down", o, "spatial", 3);
    // spatial_v2 on width 64 (two channels per group), ResBlock downsampling, no scale-shift,
    // attention at 4x4 (64 + 64 + 64 + 64 + 64 = 320 features).
    o = fd_options(64, "1,1", "4");
    o.num_heads = 1, o.num_head_channels = 32, o.use_new_attention_order = 1;
    o.use_scale_shift_norm = 0, o.resblock_updown = 1, o.conv_resample = 1;
    test_finite_differences("spatial_v2-pool classifier, width 64, resblock down, new-order heads", o, "spatial_v2", 4);
    return check_summary();
}
