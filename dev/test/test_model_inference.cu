// test_model_inference.cu: the model configuration inferred from a state_dict's tensors alone
// (train_unet.cu's infer_model_config, for .pt files, which carry no metadata): for the fixtures'
// models (their safetensors and torch.save's .pt of the same weights) and for the presets with
// every option the shapes decide (class-conditional, learned variance, scale-shift, ResBlock or
// convolution resampling, average pooling, several blocks a level, multipliers of 0.5) and for
// the configurations of guided-diffusion's released models, the inferred configuration equals the
// true one; likewise for the noisy classifier (its fixtures, a .pt of one, each head, guided-diffusion's
// released classifiers' configurations), whose flags given with a .pt are checked against the
// tensors; the upsampler (its fixture, a .pt of it, guided-diffusion's released upsamplers'
// configurations) with its sizes given as guided-diffusion's --large_size and --small_size; what
// shapes cannot say is refused with one line naming the flag to give.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// A state_dict of the model's parameter names and shapes, without data (what inference reads).
static SafeTensorsFile shapes_only(const ModelConfig *c) {
    ParamList params = model_parameters(c);
    SafeTensorsFile f;
    memset(&f, 0, sizeof f);
    f.tensors = (SafeTensor *)calloc(params.count, sizeof(SafeTensor));
    for (int i = 0; i < params.count; i++) {
        SafeTensor *t = &f.tensors[f.count++];
        t->name = strdup(params.specs[i].name);
        snprintf(t->dtype, sizeof t->dtype, "F32");
        t->ndim = params.specs[i].ndim, t->numel = params.specs[i].numel;
        for (int d = 0; d < t->ndim; d++) t->shape[d] = params.specs[i].shape[d];
    }
    qsort(f.tensors, f.count, sizeof(SafeTensor), safetensors_by_name);
    free(params.specs);
    return f;
}

// The flags a user gives for a .pt: the image size and the heads (as the model has them).
static Options given_for(const ModelConfig *c) {
    Options o = guided_diffusion_defaults();
    o.image_size = c->image_size, o.num_heads = c->num_heads, o.num_head_channels = c->num_head_channels;
    o.num_heads_upsample = c->num_heads_upsample, o.use_new_attention_order = c->use_new_attention_order, o.dropout = c->dropout;
    o.super_res = c->low_res;  // an upsampler's small size (its .pt's --small_size)
    return o;
}

static int same_config(const ModelConfig *a, const ModelConfig *b) { return memcmp(a, b, sizeof *a) == 0; }

static int infers(const char *what, const SafeTensorsFile *f, const ModelConfig *truth) {
    Options given = given_for(truth);
    InferredModel got;
    char err[512];
    if (infer_model_config(f, &given, 1, &got, err, sizeof err) != 0) return printf("  %s: %s\n", what, err), 0;
    if (!same_config(&got.config, truth)) return printf("  %s: another configuration inferred\n", what), 0;
    return 1;
}

// A released model's configuration from its flags (r), inferred back from tensors of its shapes.
static int infers_from_flags(const char *what, Options *r) {
    ModelConfig truth;
    char err[512];
    if (model_config_from_options(r, r->num_classes, &truth, err, sizeof err) != 0) return printf("  %s: %s\n", what, err), 0;
    SafeTensorsFile f = shapes_only(&truth);
    int ok = infers(what, &f, &truth);
    safetensors_close(&f);
    return ok;
}

int main(void) {
    char err[512];
    check_case("the fixtures' models: inferred from their safetensors and from torch.save's .pt of the same weights");
    const char *names[3] = {"seed", "adm", "conv_resample"};
    for (int i = 0; i < 3; i++) {
        char path[256];
        SafeTensorsFile f;
        ModelConfig truth;
        snprintf(path, sizeof path, "dev/fixtures/unet_%s.safetensors", names[i]);
        CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && model_config_from_metadata(&f, path, &truth, err, sizeof err) == 0);
        CHECK(infers(path, &f, &truth));
        safetensors_close(&f);
        for (int k = 0; i < 2 && k < 2; k++) {
            snprintf(path, sizeof path, "dev/fixtures/pt/unet_%s_%s.pt", names[i], k ? "fp16_legacy" : "fp32");
            CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && infers(path, &f, &truth));
            safetensors_close(&f);
        }
    }

    check_case("the upsampler (SuperResModel): its fixture and a .pt of it with --large_size/--small_size; 6 channels without them refused");
    {
        SafeTensorsFile f;
        ModelConfig truth;
        const char *path = "dev/fixtures/unet_super_res.safetensors", *pt = "dev/fixtures/pt/unet_super_res_fp16.pt";
        CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && model_config_from_metadata(&f, path, &truth, err, sizeof err) == 0);
        CHECK(truth.low_res == 4 && infers(path, &f, &truth));
        safetensors_close(&f);
        UnetInfo info;
        const char *flags[3] = {"large_size=8", "small_size=4", "num_head_channels=16"};
        UnetCheckpoint *ck = unet_checkpoint_open(pt, "ema", flags, 3, &info, err, sizeof err);
        CHECK(ck && info.small_size == 4 && info.image_size == 8 && strstr(info.model, "an upsampler (SuperResModel, 4x4 to 8x8)"));
        if (ck) printf("  %s\n", info.model);
        unet_checkpoint_close(ck);
        const char *no_sizes[2] = {"image_size=8", "num_head_channels=16"};
        CHECK(!unet_checkpoint_open(pt, "ema", no_sizes, 2, &info, err, sizeof err) && strstr(err, "--large_size and --small_size"));
        printf("  %s\n", err);
    }

    check_case("presets and variations: every flag the shapes decide is inferred");
    struct { const char *preset, *mult, *attention; int blocks, class_cond, learn_sigma, scale_shift, updown, conv, size; } cases[] = {
        {"seed", NULL, NULL, -1, 0, 0, -1, -1, -1, 0},      {"adm64", NULL, NULL, -1, 1, 1, -1, -1, -1, 0},
        {"seed", "1,1,2,3", "16", 3, 1, 0, 0, 1, 1, 0},     {"seed", "1,2", "", 1, 0, 1, 1, 0, 0, 32},
        {"adm64", "0.5,1,2", "32,16", 2, 0, 0, 1, 1, 0, 0},  {"seed", "1,2,2,2", "16,8", 2, 0, 1, 0, 0, 1, 32},
        {"seed", "1", "", 4, 1, 1, 1, 0, 1, 16}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        Options o = strcmp(cases[i].preset, "adm64") == 0 ? preset_adm64() : preset_seed();
        if (cases[i].size) o.image_size = cases[i].size;
        if (cases[i].mult) o.channel_mult = cases[i].mult;
        if (cases[i].attention) o.attention_resolutions = cases[i].attention;
        if (cases[i].blocks >= 0) o.num_res_blocks = cases[i].blocks;
        if (cases[i].scale_shift >= 0) o.use_scale_shift_norm = cases[i].scale_shift;
        if (cases[i].updown >= 0) o.resblock_updown = cases[i].updown;
        if (cases[i].conv >= 0) o.conv_resample = cases[i].conv;
        o.class_cond = cases[i].class_cond, o.num_classes = 11, o.learn_sigma = cases[i].learn_sigma;
        ModelConfig truth;
        if (model_config_from_options(&o, o.num_classes, &truth, err, sizeof err) != 0) {
            printf("  case %zu: %s\n", i, err);
            CHECK(0);
            continue;
        }
        if (truth.resblock_updown && !truth.conv_resample) truth.conv_resample = 1;  // the same model: inferred as the default
        SafeTensorsFile f = shapes_only(&truth);
        char what[64];
        snprintf(what, sizeof what, "case %zu (%s, mult %s)", i, cases[i].preset, o.channel_mult);
        CHECK(infers(what, &f, &truth));
        safetensors_close(&f);
    }

    check_case("guided-diffusion's released upsamplers (64_256, 128_512), with its README's flags: inferred from their shapes");
    struct { const char *name; int large, small, heads, head_channels; const char *attention; } upsamplers[] = {
        {"64_256_upsampler", 256, 64, 4, -1, "32,16,8"}, {"128_512_upsampler", 512, 128, 4, 64, "32,16"}};
    for (size_t i = 0; i < sizeof upsamplers / sizeof upsamplers[0]; i++) {
        Options r = guided_diffusion_defaults();
        r.image_size = upsamplers[i].large, r.super_res = upsamplers[i].small, r.num_channels = 192, r.num_res_blocks = 2;
        r.num_heads = upsamplers[i].heads, r.num_head_channels = upsamplers[i].head_channels, r.attention_resolutions = upsamplers[i].attention;
        r.channel_mult = "", r.learn_sigma = 1, r.resblock_updown = 1, r.use_scale_shift_norm = 1, r.class_cond = 1, r.num_classes = 1000;
        CHECK(infers_from_flags(upsamplers[i].name, &r));
    }

    check_case("guided-diffusion's released models, with the flags its README gives for each: inferred from their shapes");
    struct { const char *name; int size, channels, blocks, heads, head_channels, new_order, class_cond; } released[] = {
        {"64x64_diffusion", 64, 192, 3, 4, 64, 1, 1},     {"128x128_diffusion", 128, 256, 2, 4, -1, 0, 1},
        {"256x256_diffusion", 256, 256, 2, 4, 64, 0, 1},  {"256x256_diffusion_uncond", 256, 256, 2, 4, 64, 0, 0},
        {"512x512_diffusion", 512, 256, 2, 4, 64, 0, 1}};
    for (size_t i = 0; i < sizeof released / sizeof released[0]; i++) {
        Options r = guided_diffusion_defaults();
        r.image_size = released[i].size, r.num_channels = released[i].channels, r.num_res_blocks = released[i].blocks;
        r.num_heads = released[i].heads, r.num_head_channels = released[i].head_channels, r.use_new_attention_order = released[i].new_order;
        r.attention_resolutions = "32,16,8", r.channel_mult = "", r.learn_sigma = 1, r.resblock_updown = 1, r.use_scale_shift_norm = 1;
        r.class_cond = released[i].class_cond, r.num_classes = 1000;
        CHECK(infers_from_flags(released[i].name, &r));
    }

    check_case("the noisy classifier: the fixtures' (their safetensors and a .pt) and guided-diffusion's released ones, its README's flags");
    const char *heads[2] = {"attention", "adaptive"};
    for (int i = 0; i < 2; i++) {
        char path[256];
        SafeTensorsFile f;
        ModelConfig truth;
        snprintf(path, sizeof path, "dev/fixtures/unet_classifier_%s.safetensors", heads[i]);
        CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && model_config_from_metadata(&f, path, &truth, err, sizeof err) == 0);
        CHECK(truth.pool != POOL_NONE && infers(path, &f, &truth));
        safetensors_close(&f);
        snprintf(path, sizeof path, "dev/fixtures/pt/unet_classifier_%s_fp16.pt", heads[i]);
        CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && infers(path, &f, &truth));
        safetensors_close(&f);
    }
    // --classifier_depth 2 --classifier_width 128 --classifier_pool attention, ... at 64, 128, 256 and 512; then the other heads at 64
    const char *pools[7] = {"attention", "attention", "attention", "attention", "adaptive", "spatial", "spatial_v2"};
    for (int i = 0; i < 7; i++) {
        int size = i < 4 ? 64 << i : 64;
        Options r = guided_diffusion_defaults();
        r.image_size = size, r.num_classes = 1000, r.classifier_pool = pools[i];
        classifier_model_flags(&r);
        ModelConfig truth;
        char what[64];
        snprintf(what, sizeof what, "%dx%d_classifier, %s", size, size, pools[i]);
        if (named_model_config(&r, &truth, err, sizeof err) != 0) {
            printf("  %s: %s\n", what, err);
            CHECK(0);
            continue;
        }
        SafeTensorsFile f = shapes_only(&truth);
        Options given = guided_diffusion_defaults();
        given.image_size = size;  // the heads: not given (a classifier's are 64 channels)
        InferredModel got;
        int ok = infer_model_config(&f, &given, 0, &got, err, sizeof err) == 0 && same_config(&got.config, &truth);
        if (!ok) printf("  %s: %s\n", what, err);
        CHECK(ok);
        safetensors_close(&f);
    }

    check_case("a classifier's .pt with guided-diffusion's flags: its classifier_ flags and the model flags checked against the tensors");
    {
        SafeTensorsFile f;
        const char *path = "dev/fixtures/pt/unet_classifier_attention_fp16.pt";
        CHECK(safetensors_open(path, &f, err, sizeof err) == 0);
        struct { const char *flags[4]; int fits; } uses[] = {
            {{"image_size=8", "num_head_channels=16", "classifier_width=32", "classifier_use_fp16=True"}, 1},
            {{"image_size=8", "num_head_channels=16", "classifier_pool=attention", "classifier_depth=1"}, 1},
            {{"image_size=8", "num_head_channels=16", "classifier_width=64", NULL}, 0},
            {{"image_size=8", "num_head_channels=16", "num_channels=64", NULL}, 0},
            {{"image_size=8", "num_head_channels=16", "classifier_pool=adaptive", NULL}, 0}};
        for (size_t i = 0; i < sizeof uses / sizeof uses[0]; i++) {
            int n = uses[i].flags[3] ? 4 : 3;
            ModelConfig c;
            DiffusionConfig d;
            char described[1024];
            int r = model_from_tensors_and_flags(&f, path, uses[i].flags, n, &c, &d, described, sizeof described, err, sizeof err);
            printf("  %s %s: %s\n", uses[i].flags[2], n == 4 ? uses[i].flags[3] : "", r == 0 ? described : err);
            CHECK((r == 0) == uses[i].fits && (r != 0 || c.pool == POOL_ATTENTION));
        }
        safetensors_close(&f);
    }

    check_case("classifier guidance's open: a classifier's .pt takes the model's image size; a diffusion model, or a classifier of "
               "another size, is one line each");
    {
        UnetInfo info;
        const char *flags[1] = {"num_head_channels=16"};
        UnetCheckpoint *ck = unet_classifier_open("dev/fixtures/pt/unet_classifier_attention_fp16.pt", flags, 1, 8, &info, err, sizeof err);
        CHECK(ck && info.num_classes == 5 && strcmp(info.classifier_pool, "attention") == 0 && strstr(info.model, "image_size 8"));
        if (ck) printf("  %s\n", info.model);
        unet_checkpoint_close(ck);
        ck = unet_classifier_open("dev/fixtures/unet_classifier_adaptive.safetensors", NULL, 0, 8, &info, err, sizeof err);
        CHECK(ck && info.num_classes == 5 && strcmp(info.classifier_pool, "adaptive") == 0);
        unet_checkpoint_close(ck);
        CHECK(!unet_classifier_open("dev/fixtures/unet_classifier_adaptive.safetensors", NULL, 0, 16, &info, err, sizeof err) &&
              strstr(err, "classifies 8x8 images; the diffusion model makes 16x16") && !strchr(err, '\n'));
        printf("  %s\n", err);
        CHECK(!unet_classifier_open("dev/fixtures/unet_seed.safetensors", NULL, 0, 8, &info, err, sizeof err) &&
              strstr(err, "is a diffusion model, not a noisy classifier"));
        printf("  %s\n", err);
        ck = unet_checkpoint_open("dev/fixtures/unet_classifier_attention.safetensors", "ema", NULL, 0, &info, err, sizeof err);
        CHECK(ck && strcmp(info.classifier_pool, "attention") == 0 && info.num_classes == 5);  // (for --eval)
        unet_checkpoint_close(ck);
    }

    check_case("what shapes cannot say, or a file that is no UNet: one line naming what to give");
    Options o = preset_seed();
    ModelConfig truth = resolve_model(&o, 0);
    InferredModel got;
    SafeTensorsFile f = shapes_only(&truth);
    Options given = given_for(&truth);
    CHECK(infer_model_config(&f, &given, 0, &got, err, sizeof err) != 0 && strstr(err, "--num_head_channels") && !strchr(err, '\n'));
    printf("  %s\n", err);
    given.image_size = 0;
    CHECK(infer_model_config(&f, &given, 1, &got, err, sizeof err) != 0 && strstr(err, "--image_size"));
    printf("  %s\n", err);
    safetensors_close(&f);
    CHECK(safetensors_open("dev/test/corpus/pt/good_zip.pt", &f, err, sizeof err) == 0);
    given = given_for(&truth);
    CHECK(infer_model_config(&f, &given, 1, &got, err, sizeof err) != 0 && strstr(err, "not a guided-diffusion UNet"));
    printf("  %s\n", err);
    safetensors_close(&f);
    return check_summary();
}
