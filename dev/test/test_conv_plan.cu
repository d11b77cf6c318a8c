// test_conv_plan.cu: the 3x3 convolution planner (train_unet.cu's conv_plan) on the CPU: every
// convolution of the presets gets a plan for each product, on Hopper and on other GPUs; the layers
// that have kernels of their own get them (the output head: all three products); a forced family runs
// or is refused, never replaced; the rules' tiles and slices.
#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

static const ConvTarget hopper = {true, true, CONV_PLAN_SMS}, ampere = {false, false, 108};

// What the walk of one model showed: every 3x3 convolution's plans, checked as they come.
typedef struct {
    int convs, refused, ampere_sm90a, forced_wrong, forced_refused;
    int families[CONV_FAMILIES];
    int input_image, head_narrow, forward_64_wrong;
} Seen;

static void visit(void *ctx, const char *name, const Conv *cv, int N, int size, int training) {
    Seen *seen = (Seen *)ctx;
    if (cv->k != 3) return;
    seen->convs++;
    for (int op = 0; op < (training ? 3 : 1); op++) {
        ConvProblem q = conv_layer_problem(op, N, size, cv->in, cv->out, cv->stride);
        ConvPlan h = conv_plan(&q, &hopper, -1), a = conv_plan(&q, &ampere, -1);
        seen->refused += h.family == CONV_NONE || a.family == CONV_NONE;
        if (h.family >= 0) seen->families[h.family]++;
        seen->ampere_sm90a += a.family == CONV_HALO || a.family == CONV_SPLIT || a.family == CONV_WGMMA;
        if (op == CONV_FORWARD && strcmp(name, "input_blocks.0.0.weight") == 0) seen->input_image += h.family == CONV_IMAGE && a.family == CONV_IMAGE;
        if (strcmp(name, "out.2.weight") == 0) seen->head_narrow += h.family == CONV_NARROW && a.family == CONV_NARROW;
        if (op == CONV_FORWARD && size == 64 && cv->stride == 1 && cv->in % 64 == 0 && cv->out % 64 == 0) {  // halo up to k = 9 x 256
            // (unless the TMA's 128 x 256 tiles cover its width)
            bool wide = cv->out % 256 == 0 && conv_wgmma_width(true, (int64_t)N * size * size, cv->out, &hopper) == 256;
            seen->forward_64_wrong += h.family != (cv->in <= 256 && !wide ? CONV_HALO : CONV_WGMMA);
        }
        for (int f = 0; f < CONV_FAMILIES; f++) {  // forced: that family, or refused
            ConvPlan forced = conv_plan(&q, &hopper, f);
            seen->forced_wrong += forced.family != f && forced.family != CONV_NONE;
            seen->forced_refused += forced.family == CONV_NONE;
        }
    }
}

static Seen walk_model(const char *preset, int batch, int training, int conv_resample) {
    Options o = preset_seed();
    if (strcmp(preset, "adm64") == 0) o = preset_adm64();
    o.conv_resample = conv_resample;
    ModelConfig c = resolve_model(&o, 0);
    Seen seen;
    memset(&seen, 0, sizeof seen);
    UNet plan;
    conv_visitor = visit, conv_visitor_ctx = &seen;
    unet_plan(&plan, &c, batch, training);
    conv_visitor = NULL, conv_visitor_ctx = NULL;
    unet_destroy(&plan);
    return seen;
}

int main(void) {
    check_case("every 3x3 convolution of the presets gets a plan for each product, on Hopper and on other GPUs");
    const struct {
        const char *preset;
        int batch, training, conv_resample;
    } models[] = {{"seed", 32, 1, 0}, {"seed", 128, 1, 0}, {"seed", 256, 0, 0}, {"seed", 32, 1, 1}, {"adm64", 32, 1, 0}, {"adm64", 8, 0, 1}};
    int families[CONV_FAMILIES] = {0};
    for (size_t i = 0; i < sizeof models / sizeof models[0]; i++) {
        Seen s = walk_model(models[i].preset, models[i].batch, models[i].training, models[i].conv_resample);
        printf("  %s batch %d%s%s: %d 3x3 convolutions, Hopper's kernels:", models[i].preset, models[i].batch,
               models[i].training ? " training" : " sampling", models[i].conv_resample ? " conv_resample" : "", s.convs);
        for (int f = 0; f < CONV_FAMILIES; f++) printf(" %s %d", conv_family_names[f], s.families[f]), families[f] += s.families[f];
        printf("\n");
        CHECK(s.convs > 20 && s.refused == 0 && s.ampere_sm90a == 0);
        CHECK(s.input_image == 1 && s.head_narrow == (models[i].training ? 3 : 1) && s.forward_64_wrong == 0);
        CHECK(s.forced_wrong == 0 && s.forced_refused > 0);
    }
    for (int f = 0; f < CONV_FAMILIES; f++) CHECK(f == CONV_FP32 || families[f] > 0);  // every BF16 family has work

    check_case("a forced family that cannot take a product is refused, never replaced");
    ConvProblem stride2 = conv_layer_problem(CONV_FORWARD, 32, 32, 128, 128, 2), head = conv_layer_problem(CONV_FORWARD, 32, 64, 64, 3, 1);
    ConvProblem wide = conv_layer_problem(CONV_FORWARD, 32, 64, 64, 64, 1);
    CHECK(conv_plan(&stride2, &hopper, CONV_HALO).family == CONV_NONE);
    CHECK(conv_plan(&wide, &hopper, CONV_IMAGE).family == CONV_NONE && conv_plan(&wide, &hopper, CONV_NARROW).family == CONV_NONE);
    CHECK(conv_plan(&head, &hopper, CONV_WGMMA).family == CONV_NONE && conv_plan(&head, &hopper, CONV_NARROW).family == CONV_NARROW);
    CHECK(conv_plan(&wide, &ampere, CONV_HALO).family == CONV_NONE && conv_plan(&wide, &ampere, CONV_MMA).family == CONV_MMA);
    CHECK(conv_plan(&wide, &hopper, CONV_FP32).family == CONV_NONE);  // the BF16 build has no fp32 kernels
    ConvProblem unaligned = wide;
    unaligned.vec_a = false;  // a tensor whose pixel stride is not 16 bytes: mma.sync's scalar loads
    CHECK(conv_plan(&unaligned, &hopper, -1).family == CONV_MMA);

    check_case("the rules' tiles: the widest wgmma tile unless it leaves multiprocessors idle; halo rows and k; slices");
    ConvProblem adm16 = conv_layer_problem(CONV_FORWARD, 32, 16, 192, 192, 1);  // 64 rows of 128-pixel tiles
    ConvTarget one_sm = hopper;
    one_sm.sms = 1;
    ConvPlan narrowed = conv_plan(&adm16, &hopper, -1), widest = conv_plan(&adm16, &one_sm, -1);
    CHECK(narrowed.family == CONV_WGMMA && narrowed.BN == 128 && widest.family == CONV_WGMMA && widest.BN == 192);
    ConvPlan halo = conv_plan(&wide, &hopper, -1);
    CHECK(halo.family == CONV_HALO && halo.BN == 64 && halo.rows == 8);
    // halo while k has at most 9 x 256 channels (the forward's C_in, the input gradient's C_out), wgmma beyond, and
    // wgmma where its 128 x 256 tiles through the TMA cover the product's width
    ConvProblem k256 = conv_layer_problem(CONV_FORWARD, 16, 128, 256, 192, 1), k512 = conv_layer_problem(CONV_FORWARD, 16, 128, 512, 192, 1);
    ConvProblem dk256 = conv_layer_problem(CONV_INPUT_GRAD, 16, 128, 192, 256, 1), dk512 = conv_layer_problem(CONV_INPUT_GRAD, 16, 128, 192, 512, 1);
    CHECK(conv_plan(&k256, &hopper, -1).family == CONV_HALO && conv_plan(&k512, &hopper, -1).family == CONV_WGMMA);
    CHECK(conv_plan(&dk256, &hopper, -1).family == CONV_HALO && conv_plan(&dk512, &hopper, -1).family == CONV_WGMMA);
    ConvProblem wide256 = conv_layer_problem(CONV_FORWARD, 16, 128, 256, 256, 1), dwide256 = conv_layer_problem(CONV_INPUT_GRAD, 16, 128, 512, 256, 1);
    ConvPlan wide_fwd = conv_plan(&wide256, &hopper, -1), wide_dgrad = conv_plan(&dwide256, &hopper, -1);
    CHECK(wide_fwd.family == CONV_WGMMA && wide_fwd.tma && wide_fwd.BN == 256 && wide_dgrad.family == CONV_WGMMA && wide_dgrad.BN == 256);
    ConvTarget no_tma_halo = hopper;
    no_tma_halo.tma = false;
    CHECK(conv_plan(&wide256, &no_tma_halo, -1).family == CONV_HALO);
    ConvProblem wgrad = conv_layer_problem(CONV_WEIGHT_GRAD, 32, 64, 64, 64, 1);
    ConvPlan wg = conv_plan(&wgrad, &hopper, -1);
    int per, slices = conv3x3_weight_grad_slices(32, 64, 64, 64, 64, 1, &per);
    CHECK(wg.family == CONV_WGMMA && wg.tma && wg.slices == slices && wg.k_per_slice == per && slices > 1);
    // 128 x 256 weight-gradient tiles through the TMA; without it (and on mma.sync) as 128 x 128, the slices the same
    ConvProblem wide_wgrad = conv_layer_problem(CONV_WEIGHT_GRAD, 16, 128, 256, 256, 1);
    ConvTarget no_tma = hopper;
    no_tma.tma = false;
    ConvPlan wide_tma = conv_plan(&wide_wgrad, &hopper, -1), wide_gathered = conv_plan(&wide_wgrad, &no_tma, -1);
    ConvPlan wide_mma = conv_plan(&wide_wgrad, &ampere, -1);
    CHECK(wide_tma.family == CONV_WGMMA && wide_tma.tma && wide_tma.BM == 128 && wide_tma.BN == 256);
    CHECK(wide_gathered.family == CONV_WGMMA && !wide_gathered.tma && wide_gathered.BN == 128 && wide_mma.family == CONV_MMA &&
          wide_mma.BN == 128);
    CHECK(wide_tma.slices == wide_gathered.slices && wide_tma.slices == wide_mma.slices && wide_tma.slices > 1);
    // the output head's weight gradient: whole 128-pixel strips a slice, the same slices on mma.sync; odd images on mma.sync
    ConvProblem head_wgrad = conv_layer_problem(CONV_WEIGHT_GRAD, 16, 128, 256, 6, 1), odd_wgrad = head_wgrad;
    odd_wgrad.W = 13;
    ConvPlan narrow_wg = conv_plan(&head_wgrad, &hopper, -1), narrow_mma = conv_plan(&head_wgrad, &hopper, CONV_MMA);
    CHECK(narrow_wg.family == CONV_NARROW && narrow_wg.slices > 1 && narrow_wg.k_per_slice % CONV_NARROW_ROW == 0);
    CHECK(narrow_mma.family == CONV_MMA && narrow_mma.slices == narrow_wg.slices && narrow_mma.k_per_slice == narrow_wg.k_per_slice);
    CHECK(conv_plan(&odd_wgrad, &hopper, -1).family == CONV_MMA);
    ConvProblem small = conv_layer_problem(CONV_FORWARD, 32, 8, 256, 256, 1);  // seed's 8x8 level: split along k
    ConvPlan split = conv_plan(&small, &hopper, -1);
    CHECK(split.family == CONV_SPLIT && split.slices >= CONV_SPLIT_MIN && split.slices <= CONV_SPLIT_MAX);
    small.split_floats = 0;  // no scratch for it: not split
    CHECK(conv_plan(&small, &hopper, -1).family == CONV_WGMMA);
    char text[4][48];
    printf("  %s; %s; %s; %s\n", conv_plan_text(&narrowed, text[0], 48), conv_plan_text(&widest, text[1], 48),
           conv_plan_text(&wg, text[2], 48), conv_plan_text(&split, text[3], 48));
    return check_summary();
}
