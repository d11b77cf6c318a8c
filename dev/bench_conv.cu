// dev/bench_conv.cu: the trainer's implicit-GEMM 3x3 convolutions (train_unet.cu, section
// "Convolution") against a double-precision CPU reference, in the build's precision: forward, input
// gradient (accumulated) and weight gradient (deterministic), on channel slices of wider tensors, the
// channel sums the forward gathers for GroupNorm where its kernel does,
// odd sizes, 3 and 6 channels, stride 2, residuals, wide layers and random shapes. With --bench,
// their timings on every distinct 3x3 convolution of the seed and adm64 presets at batch 32 and
// 128, for scripts/bench_conv_torch.py (`make bench-conv` runs both and joins them with cuDNN's).
//   build/dev/bench_conv                                         the checks
//   build/dev/bench_conv --bench [--kernel K] [--check]             the timings (after the checks with --check)
//   build/dev/bench_conv --bench [--kernel K] N H Cin Cout stride   the timings of one shape (W = H)
//   build/dev/bench_conv --bench [--kernel K] --presets P[:B],...   the timings of train_unet presets' 3x3
//                                                                   convolutions at batch B (adm128:16), or 32 and 128
// --kernel K forces the planner's family K (image, narrow, halo, split, wgmma, mma, fp32: see
// train_unet.cu's "Convolution: the planner"); a shape it does not take is timed as "kernel=none".
// Check lines: "PASS|FAIL <case> <fp32|bf16> <fwd|dgrad|wgrad> err=... (tol ...) [kernel]", each naming
// the kernel that ran; the last line is "N passed, N failed". Bench lines: "conv impl=ours
// op=fwd|dgrad|wgrad N= H= W= Cin= Cout= stride= ms= tflops= precision= presets= kernel=".
// DEV_SEED=<n> repeats a run's random inputs.
#define DEV_NO_MAIN
#include "conv2d.cu"  // the reference: ref_conv2d_forward, ref_conv2d_backward, conv_weight_layout

static const char *type_name(void) { return sizeof(floatX) == 4 ? "fp32" : "bf16"; }

// ----------------------------------------------------------------------------------------------
// Checks

typedef struct {
    const char *name;
    int N, H, W, C_in, C_out, stride;
    int x_ld_extra, x_off, y_ld_extra, y_off;  // channel slices: ld = C + extra, the slice at channel off
    int dy_ld_extra, dy_off, dx_ld_extra, dx_off;
    int residual, r_ld_extra;
} CheckCase;

// One tensor of `pixels` x ld channels with the slice [off, off + C) in use.
typedef struct {
    int64_t pixels;
    int C, ld, off;
} Slab;

static Slab slab(int64_t pixels, int C, int extra, int off) {
    Slab s = {pixels, C, C + extra, off};
    return s;
}
static size_t slab_size(Slab s) { return (size_t)s.pixels * s.ld; }
static int in_slice(Slab s, size_t i) {
    int c = (int)(i % s.ld);
    return c >= s.off && c < s.off + s.C;
}

// A case's inputs as the device holds them (floatX values, in double) and its references.
typedef struct {
    int Ho, Wo;
    Slab xs, ys, dys, dxs, rs;
    double *x, *w, *bias, *residual, *dy;  // residual NULL without one
    double *y_init;                        // y before the forward: NaN in the slice, sentinels outside
    double *dx_init;                       // dx before the input gradient (which adds to it)
    double *y_ref, *dx_ref, *dw_ref;       // dense: [pixel][C], [C_out][9][C_in]
} CheckProblem;

static double *random_x(size_t n, double scale) {
    double *v = dev_alloc(n);
    dev_fill_x(v, n, -scale, scale);
    return v;
}

static CheckProblem make_problem(const CheckCase *c) {
    CheckProblem p;
    p.Ho = conv_out_size(c->H, 3, c->stride), p.Wo = conv_out_size(c->W, 3, c->stride);
    int64_t in_pixels = (int64_t)c->N * c->H * c->W, out_pixels = (int64_t)c->N * p.Ho * p.Wo;
    p.xs = slab(in_pixels, c->C_in, c->x_ld_extra, c->x_off), p.dxs = slab(in_pixels, c->C_in, c->dx_ld_extra, c->dx_off);
    p.ys = slab(out_pixels, c->C_out, c->y_ld_extra, c->y_off), p.dys = slab(out_pixels, c->C_out, c->dy_ld_extra, c->dy_off);
    p.rs = slab(out_pixels, c->C_out, c->r_ld_extra, 0);
    size_t nw = (size_t)c->C_out * 9 * c->C_in;
    p.x = random_x(slab_size(p.xs), 1), p.dy = random_x(slab_size(p.dys), 1);
    p.w = random_x(nw, 1 / sqrt(9.0 * c->C_in)), p.bias = random_x(c->C_out, 0.5);
    p.residual = c->residual ? random_x(slab_size(p.rs), 1) : NULL;
    p.dx_init = random_x(slab_size(p.dxs), 1), p.y_init = random_x(slab_size(p.ys), 1);
    for (size_t i = 0; i < slab_size(p.ys); i++)
        if (in_slice(p.ys, i)) p.y_init[i] = NAN;  // what the forward must write
    // The reference on dense copies of the slices, weights in PyTorch's layout.
    double *x = dev_alloc((size_t)in_pixels * c->C_in), *dy = dev_alloc((size_t)out_pixels * c->C_out);
    for (int64_t i = 0; i < in_pixels; i++)
        for (int ci = 0; ci < c->C_in; ci++) x[i * c->C_in + ci] = p.x[i * p.xs.ld + p.xs.off + ci];
    for (int64_t i = 0; i < out_pixels; i++)
        for (int co = 0; co < c->C_out; co++) dy[i * c->C_out + co] = p.dy[i * p.dys.ld + p.dys.off + co];
    double *w_torch = dev_alloc(nw), *dw_torch = dev_alloc(nw);
    conv_weight_layout(w_torch, p.w, c->C_out, c->C_in, 3, 0);
    p.y_ref = dev_alloc((size_t)out_pixels * c->C_out), p.dx_ref = dev_alloc((size_t)in_pixels * c->C_in), p.dw_ref = dev_alloc(nw);
    ref_conv2d_forward(p.y_ref, x, w_torch, p.bias, c->N, c->H, c->W, c->C_in, c->C_out, 3, c->stride);
    if (p.residual)
        for (int64_t i = 0; i < out_pixels; i++)
            for (int co = 0; co < c->C_out; co++) p.y_ref[i * c->C_out + co] += p.residual[i * p.rs.ld + co];
    ref_conv2d_backward(p.dx_ref, dw_torch, NULL, dy, x, w_torch, c->N, c->H, c->W, c->C_in, c->C_out, 3, c->stride);
    conv_weight_layout(p.dw_ref, dw_torch, c->C_out, c->C_in, 3, 1);
    free(x), free(dy), free(w_torch), free(dw_torch);
    return p;
}

static void free_problem(CheckProblem *p) {
    double *all[] = {p->x, p->w, p->bias, p->residual, p->dy, p->y_init, p->dx_init, p->y_ref, p->dx_ref, p->dw_ref};
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) free(all[i]);
}

// The error of the slice of `got` (a whole downloaded slab) against ref (dense [pixel][C]) plus, when
// accumulate, what the slab held before (init): dev_error's measure. NaN when anything outside the
// slice differs from init.
static double slice_error(const double *got, const double *init, const double *ref, Slab s, int accumulate) {
    size_t n = (size_t)s.pixels * s.C;
    double *g = dev_alloc(n), *before = accumulate ? dev_alloc(n) : NULL;
    for (size_t i = 0; i < slab_size(s); i++) {
        if (!in_slice(s, i)) {
            if (!(got[i] == init[i])) {
                free(g), free(before);
                return NAN;
            }
            continue;
        }
        size_t j = i / s.ld * s.C + i % s.ld - s.off;
        g[j] = got[i];
        if (before) before[j] = init[i];
    }
    double err = dev_error(g, before, ref, n);
    free(g), free(before);
    return err;
}

// The kernel the last product ran (conv_last_plan), as check and bench lines name it; which pass of
// the checks runs (see run_checks); how often each family ran in it.
static char kernel_ran[48];
static const char *pass_name = "";
static int family_runs[CONV_FAMILIES];

// Notes the plan of the product just run: 0 when it ran, or -1 when the family forced for this pass
// does not take it (nothing ran: its checks are left out).
static int note_kernel(void) {
    conv_plan_text(&conv_last_plan, kernel_ran, sizeof kernel_ran);
    if (conv_last_plan.family == CONV_NONE) return -1;
    family_runs[conv_last_plan.family]++;
    return 0;
}

// One check line; err <= tol passes (NaN never does). In a pass that forces a family, a product that
// ran another fails.
static void report(const char *name, const char *op, double err, double tol, const char *extra) {
    int ok = err <= tol && (conv_dev.family < 0 || conv_last_plan.family == conv_dev.family);
    if (ok) dev_checks_passed++;
    else dev_checks_failed++;
    printf("%s %-28s %-4s %-5s err=%.3g (tol %.0e)%s [%s]%s\n", ok ? "PASS" : "FAIL", name, type_name(), op, err, tol, extra,
           kernel_ran, pass_name);
    fflush(stdout);
}

// The scratch a split forward or input-gradient product of this shape needs (floats; 0: not split).
static int64_t split_scratch_floats(int N, int H, int W, int C_in, int C_out, int stride) {
    int64_t f = conv3x3_split_scratch_floats(CONV_FORWARD, N, H, W, C_in, C_out, stride);
    int64_t d = conv3x3_split_scratch_floats(CONV_INPUT_GRAD, N, H, W, C_in, C_out, stride);
    return f > d ? f : d;
}

// The forward's gathered channel sums (conv3x3_forward: sums[n][slot][c] = (sum y, sum y^2) over the
// slot's pixels) against what y holds as stored (`got`, the downloaded slab): each sample's slots
// added up, the larger of the two sums' errors (dev_error's measure).
static double sums_error(const double *sums, int slots, const double *got, Slab ys, int N) {
    int C = ys.C;
    int64_t per_sample = ys.pixels / N;
    double *total = dev_alloc((size_t)N * C * 2), *ref = dev_alloc((size_t)N * C * 2);
    for (int n = 0; n < N; n++)
        for (int c = 0; c < C; c++) {
            double *t = total + ((size_t)n * C + c) * 2, *r = ref + ((size_t)n * C + c) * 2;
            for (int s = 0; s < slots; s++)
                t[0] += sums[(((size_t)n * slots + s) * C + c) * 2], t[1] += sums[(((size_t)n * slots + s) * C + c) * 2 + 1];
            for (int64_t i = 0; i < per_sample; i++) {
                double y = got[(n * per_sample + i) * ys.ld + ys.off + c];
                r[0] += y, r[1] += y * y;
            }
        }
    double err[2];
    for (int k = 0; k < 2; k++) {  // column k of the [N C][2] arrays
        double *tk = dev_alloc((size_t)N * C), *rk = dev_alloc((size_t)N * C);
        for (size_t i = 0; i < (size_t)N * C; i++) tk[i] = total[2 * i + k], rk[i] = ref[2 * i + k];
        err[k] = dev_error(tk, NULL, rk, (size_t)N * C);
        free(tk), free(rk);
    }
    free(total), free(ref);
    return err[0] > err[1] || err[0] != err[0] ? err[0] : err[1];
}

static void check_case(const CheckCase *c) {
    CheckProblem p = make_problem(c);
    size_t nw = (size_t)c->C_out * 9 * c->C_in;
    floatX *x = dev_upload_x(p.x, slab_size(p.xs)), *w = dev_upload_x(p.w, nw), *bias = dev_upload_x(p.bias, c->C_out);
    floatX *dy = dev_upload_x(p.dy, slab_size(p.dys)), *res = p.residual ? dev_upload_x(p.residual, slab_size(p.rs)) : NULL;
    floatX *y = dev_upload_x(p.y_init, slab_size(p.ys)), *dx = dev_upload_x(p.dx_init, slab_size(p.dxs));
    // A split product's scratch (conv3x3_split_slices: the small grids of these cases split), poisoned.
    int64_t split_n = split_scratch_floats(c->N, c->H, c->W, c->C_in, c->C_out, c->stride);
    float *split = (float *)dev_gpu_poisoned((split_n ? split_n : 1) * sizeof(float));

    // The forward, asked for y's channel sums (room for a slot a pixel, poisoned).
    int64_t sums_n = p.ys.pixels * c->C_out * 2;
    double *sums_gpu = (double *)dev_gpu_poisoned(sums_n * sizeof(double));
    int slots = conv3x3_forward(y + c->y_off, p.ys.ld, x + c->x_off, p.xs.ld, w, bias, res, p.rs.ld, c->N, c->H, c->W, c->C_in,
                                c->C_out, c->stride, split, split_n, sums_gpu, sums_n);
    int ran = note_kernel();
    double *got = dev_download_x(y, slab_size(p.ys));
    if (ran == 0) report(c->name, "fwd", slice_error(got, p.y_init, p.y_ref, p.ys, 0), DEV_TOLERANCE, "");
    if (slots) {  // fp32 sums over a tile's pixels: far tighter than the bf16 tolerance
        double *sums = (double *)malloc((size_t)c->N * slots * c->C_out * 2 * sizeof(double)), err;
        cuda_check(cudaMemcpy(sums, sums_gpu, (size_t)c->N * slots * c->C_out * 2 * sizeof(double), cudaMemcpyDeviceToHost));
        err = sums_error(sums, slots, got, p.ys, c->N);
        char extra[32];
        snprintf(extra, sizeof extra, " slots=%d", slots);
        report(c->name, "sums", err, 1e-5, extra);
        free(sums);
    }
    free(got);

    conv3x3_backward_input(dx + c->dx_off, p.dxs.ld, GRAD_ADD, dy + c->dy_off, p.dys.ld, w, c->N, c->H, c->W, c->C_in, c->C_out,
                           c->stride, split, split_n);
    ran = note_kernel();
    got = dev_download_x(dx, slab_size(p.dxs));
    if (ran == 0) report(c->name, "dgrad", slice_error(got, p.dx_init, p.dx_ref, p.dxs, 1), DEV_TOLERANCE, "");
    free(got);

    // The weight gradient overwrites dw: twice from poisoned dw and scratch, bit for bit the same.
    size_t scratch_n = conv3x3_weight_grad_scratch_floats(c->N, c->H, c->W, c->C_in, c->C_out, c->stride);
    float *dw = (float *)dev_gpu_poisoned(nw * sizeof(float)), *scratch = (float *)dev_gpu_poisoned(scratch_n * sizeof(float));
    double *runs[2];
    for (int run = 0; run < 2; run++) {
        conv3x3_backward_weight(dw, scratch, dy + c->dy_off, p.dys.ld, x + c->x_off, p.xs.ld, c->N, c->H, c->W, c->C_in, c->C_out,
                                c->stride);
        ran = note_kernel();
        runs[run] = dev_download_f(dw, nw);
        dev_poison(dw, nw * sizeof(float));
    }
    int same = memcmp(runs[0], runs[1], nw * sizeof(double)) == 0;
    char extra[64];
    snprintf(extra, sizeof extra, " slices=%zu%s", scratch_n ? scratch_n / nw : 1, same ? "" : " NOT DETERMINISTIC");
    if (ran == 0) report(c->name, "wgrad", same ? dev_error(runs[0], NULL, p.dw_ref, nw) : NAN, DEV_TOLERANCE, extra);
    free(runs[0]), free(runs[1]);
    dev_gpu_free(x, w, bias, dy, y, dx, dw, scratch, split, sums_gpu, res, NULL);  // res last: NULL without a residual
    free_problem(&p);
}

static const CheckCase check_cases[] = {
    // name                     N   H   W  Cin  Cout s  x+ xoff y+ yoff dy+ dyoff dx+ dxoff res r+
    {"basic 64->64",            2,  8,  8,   64,   64, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"odd 7x5 32->96",          3,  7,  5,   32,   96, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"stride2 9x11 64->128",    2,  9, 11,   64,  128, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"stride2 8x8 128->128",    2,  8,  8,  128,  128, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"1x1 images 64->64",       4,  1,  1,   64,   64, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"1x1 stride2 32->64",      3,  1,  1,   32,   64, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"2x3 stride2 64->32",      2,  2,  3,   64,   32, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"input conv 3->64",        2, 16, 16,    3,   64, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"input conv 3->192 odd",   2, 13,  9,    3,  192, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    // the input convolution's kernel of its own (conv3x3_image_kernel): x and y slices, a whole image
    {"input conv 3->64 slices", 2, 11, 40,    3,   64, 1,  5,  2, 64, 64,  0,  0,  0,  0, 0, 0},
    {"input conv 64x64 3->256", 1, 64, 64,    3,  256, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"output conv 64->3",       2, 16, 16,   64,    3, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"output conv 192->3 odd",  2, 11,  7,  192,    3, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"output conv 128->6 slices", 3, 9, 13, 128,    6, 1, 64, 64,  5,  3,  0,  0,  0,  0, 1, 3},
    // the output head's kernels of its own (conv3x3_narrow_kernel and conv3x3_narrow_input_grad_kernel):
    // channel chunks, partial tiles, slices
    {"output conv 192->6 odd",  2, 11, 70,  192,    6, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"output conv 128->3 slices", 2, 9, 13, 128,    3, 1, 64, 64,  5,  3,  0,  0,  0,  0, 0, 0},
    {"output conv 64x64 64->3", 1, 64, 64,   64,    3, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"6->40 stride2",           2, 12, 10,    6,   40, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"3->3",                    2,  5,  6,    3,    3, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"slices 64->96",           2, 10,  9,   64,   96, 1, 128, 64, 64, 32, 32, 32, 64, 64, 1, 32},
    {"slices stride2",          2,  9,  9,  128,   64, 2, 64, 64, 192, 128, 64, 0, 128, 8, 1, 64},
    {"unaligned ld 32->32",     2,  7,  6,   32,   32, 1,  3,  1,  5,  3,  3,  2,  1,  1, 1, 1},
    {"tiles 128->192 res",      4, 24, 24,  128,  192, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"tiles 320->192",          2, 15, 13,  320,  192, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"tiles 192->320",          2, 15, 13,  192,  320, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"many pixels 64->64",      8, 32, 32,   64,   64, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"many pixels 256->128",    6, 31, 33,  256,  128, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    {"wide 1536->768",          1,  4,  5, 1536,  768, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"wide 576->1344 stride2",  1,  5,  4,  576, 1344, 2,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    // enough 128-pixel rows of tiles for every multiprocessor: the wgmma kernels' 192 and 256 wide tiles
    {"sm_90a tiles 64->192",    2, 12, 11,   64,  192, 1, 64, 64, 64,  8,  0,  0,  0,  0, 1, 0},
    {"sm_90a tiles 256->64",    2, 12, 11,  256,   64, 1,  0,  0,  0,  0, 64, 64, 64, 64, 0, 0},
    {"stride2 odd 13x7 192->128", 3, 13, 7, 192,  128, 2,  0,  0,  0,  0, 64,  0, 64, 64, 0, 0},
    // widths a multiple of 64, stride 1: the halo kernel (tiles of 8 or 4 rows x 64 pixels; 5 and 10
    // rows leave partial tiles), 64, 128 and 192 wide column groups, 1 to 3 channel chunks
    {"halo 64x64 64->64",       1, 64, 64,   64,   64, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
    {"halo 10x128 128->192",    2, 10, 128, 128,  192, 1, 64, 64, 64,  0, 128, 64, 64, 64, 1, 64},
    {"halo 5x64 192->128",      3,  5, 64,  192,  128, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    // through the TMA (stride 1; pixel boxes of whole rows, or whole images; products not split): the
    // weight gradient in 4-row boxes with slices of x and dy, an A box wholly past C_out (576 = 4.5 x 128)
    // and a last column tile of one 64-column box; forward and input gradient in 8-row boxes with a
    // residual and slices everywhere, and boxes of two 8x8 images, the last half past the batch
    {"tma 16x16 192->576",      3, 16, 16,  192,  576, 1, 64, 64,  0,  0, 64, 64,  0,  0, 0, 0},
    {"tma 16x16 64->1152 res",  4, 16, 16,   64, 1152, 1, 64, 64, 64, 64, 64, 64, 64, 64, 1, 64},
    {"tma 8x8 images 64->128", 17,  8,  8,   64,  128, 1,  0,  0,  0,  0,  0,  0,  0,  0, 0, 0},
    // not split, 64-pixel images under 128-row tiles: the forward's channel sums in two slots a tile,
    // the last tile's second half past the batch
    {"8x8 images 64->256",     67,  8,  8,   64,  256, 1,  0,  0,  0,  0,  0,  0,  0,  0, 1, 0},
};

// The fixed cases, then 8 random ones (small images, channel counts of the presets and odd ones,
// slices at the end of wider x, dy and dx).
static void run_check_cases(void) {
    for (size_t i = 0; i < sizeof check_cases / sizeof check_cases[0]; i++) check_case(&check_cases[i]);
    static const int channels[] = {3, 6, 8, 16, 32, 64, 96, 128, 192, 256};
    for (int i = 0; i < 8; i++) {
        CheckCase c;
        memset(&c, 0, sizeof c);
        c.N = 1 + (int)dev_random_int(3), c.H = 1 + (int)dev_random_int(13), c.W = 1 + (int)dev_random_int(13);
        c.C_in = channels[dev_random_int(10)], c.C_out = channels[dev_random_int(10)];
        c.stride = 1 + (int)dev_random_int(2), c.residual = (int)dev_random_int(2);
        c.x_ld_extra = 8 * (int)dev_random_int(4), c.x_off = c.x_ld_extra;
        c.dy_ld_extra = 8 * (int)dev_random_int(4), c.dx_ld_extra = c.dy_ld_extra;
        c.name = dev_name("random %dx%dx%d %d->%d s%d%s", c.N, c.H, c.W, c.C_in, c.C_out, c.stride, c.residual ? " res" : "");
        check_case(&c);
    }
}

// On a GPU that runs the sm_90a (wgmma) kernels, every case of the BF16 build three times: with the
// kernels and tiles the planner picks; as for a GPU of one multiprocessor (the widest tiles, and every
// persistent kernel looping over its tiles); and with the mma.sync family forced, as other GPUs run it.
// Each pass says how often each family ran; the first must have run every family of the build (the
// fixed cases are chosen so that each takes some of them), or the planner lost one.
// The families this build runs on this GPU: fp32 alone in the FP32 build; in the BF16 build image,
// narrow and mma everywhere, and halo, split and wgmma where the sm_90a kernels run.
static bool family_expected(int f) {
    if (sizeof(floatX) == 4) return f == CONV_FP32;
    return f == CONV_IMAGE || f == CONV_NARROW || f == CONV_MMA || (gpu.sm90a && f != CONV_FP32);
}

static void run_checks(void) {
    int passes = gpu.sm90a && sizeof(floatX) == 2 ? 3 : 1;
    for (int pass = 0; pass < passes; pass++) {
        conv_dev.sms = pass == 1 ? 1 : 0, conv_dev.family = pass == 2 ? CONV_MMA : -1;
        pass_name = passes == 1 ? "" : pass == 0 ? " (planned)" : pass == 1 ? " (one multiprocessor)" : " (mma forced)";
        memset(family_runs, 0, sizeof family_runs);
        run_check_cases();
        printf("kernels run%s:", pass_name);
        for (int f = 0; f < CONV_FAMILIES; f++) printf(" %s %d", conv_family_names[f], family_runs[f]);
        printf("\n");
        int missing = 0;
        for (int f = 0; pass == 0 && f < CONV_FAMILIES; f++) missing += family_runs[f] == 0 && family_expected(f);
        if (pass == 0 && missing) dev_checks_failed++, printf("FAIL %d kernel families never ran%s\n", missing, pass_name);
        else if (pass == 0) dev_checks_passed++, printf("PASS every kernel family of this build and GPU ran%s\n", pass_name);
    }
    conv_dev.sms = 0, conv_dev.family = -1;
}

// ----------------------------------------------------------------------------------------------
// Benchmark: the 3x3 convolutions of train_unet's presets, as its walk plans them (unet_walk's
// conv_visitor), each distinct shape once, with the presets it occurs in.

enum { MAX_SHAPES = 128 };

typedef struct {
    int H, C_in, C_out, stride;
    int N;  // the batch it is timed at (0: 32 and 128)
    char presets[64];
} BenchShape;

typedef struct {
    BenchShape s[MAX_SHAPES];
    int count;
} BenchShapes;

static void add_shape_at(BenchShapes *list, const char *preset, int N, int H, int C_in, int C_out, int stride) {
    for (int i = 0; i < list->count; i++) {
        BenchShape *s = &list->s[i];
        if (s->N != N || s->H != H || s->C_in != C_in || s->C_out != C_out || s->stride != stride) continue;
        if (!strstr(s->presets, preset)) {
            size_t at = strlen(s->presets);
            snprintf(s->presets + at, sizeof s->presets - at, ",%s", preset);
        }
        return;
    }
    if (list->count == MAX_SHAPES) fatal("more than %d convolution shapes", MAX_SHAPES);
    BenchShape *s = &list->s[list->count++];
    s->N = N, s->H = H, s->C_in = C_in, s->C_out = C_out, s->stride = stride;
    snprintf(s->presets, sizeof s->presets, "%s", preset);
}

static void add_shape(BenchShapes *list, const char *preset, int H, int C_in, int C_out, int stride) {
    add_shape_at(list, preset, 0, H, C_in, C_out, stride);
}

// The preset (and batch) add_preset_shapes is walking, for the visitor.
static char visited_preset[32];
static int visited_batch;

static void visit_conv(void *ctx, const char *name, const Conv *cv, int N, int size, int training) {
    (void)name, (void)N, (void)training;
    if (cv->k == 3) add_shape_at((BenchShapes *)ctx, visited_preset, visited_batch, size, cv->in, cv->out, cv->stride);
}

// Uniform values in [-scale, scale), drawn on the GPU (the largest inputs hold 200M values; the
// host fills of common.h would take minutes).
__global__ void bench_fill_kernel(floatX *x, int64_t n, uint64_t seed, uint64_t stream, float scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = (floatX)(scale * ((float)(random_u64(seed, stream, (uint64_t)i) >> 40) * (2.0f / 16777216.0f) - 1.0f));
}

static floatX *bench_random(int64_t n, float scale) {
    static uint64_t stream;
    floatX *d = (floatX *)gpu_malloc(n * sizeof(floatX));
    bench_fill_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(d, n, dev_seed, stream++, scale);
    cuda_check_launch();
    return d;
}

enum { OP_FORWARD, OP_INPUT_GRAD, OP_WEIGHT_GRAD, OPS };
static const char *const op_names[OPS] = {"fwd", "dgrad", "wgrad"};

// One timed launch: dense tensors (ld = channels), no residual.
typedef struct {
    int op, N, H, W, C_in, C_out, stride;
    floatX *x, *y, *dy, *dx, *w, *bias;
    float *dw, *scratch, *split;
    int64_t split_n;
} BenchRun;

static void bench_launch(void *ctx) {
    const BenchRun *r = (const BenchRun *)ctx;
    if (r->op == OP_FORWARD)
        conv3x3_forward(r->y, r->C_out, r->x, r->C_in, r->w, r->bias, NULL, 0, r->N, r->H, r->W, r->C_in, r->C_out, r->stride,
                        r->split, r->split_n, NULL, 0);
    else if (r->op == OP_INPUT_GRAD)
        conv3x3_backward_input(r->dx, r->C_in, GRAD_ADD, r->dy, r->C_out, r->w, r->N, r->H, r->W, r->C_in, r->C_out, r->stride,
                               r->split, r->split_n);
    else
        conv3x3_backward_weight(r->dw, r->scratch, r->dy, r->C_out, r->x, r->C_in, r->N, r->H, r->W, r->C_in, r->C_out, r->stride);
}

// The median of 20 runs after 3 warm-ups (DEV_QUICK: one run), between CUDA events recorded back to
// back on the trainer's stream, as scripts/bench_conv_torch.py times cuDNN. (dev_time_ms waits after
// each run, so each of its times includes a launch latency: microseconds that matter here.)
static double bench_time_ms(DevFn fn, void *ctx) {
    enum { WARMUP = 3, RUNS = 20 };
    int warmup = dev_quick() ? 0 : WARMUP, runs = dev_quick() ? 1 : RUNS;
    cudaEvent_t start[RUNS], stop[RUNS];
    double times[RUNS];
    for (int i = 0; i < runs; i++) cuda_check(cudaEventCreate(&start[i])), cuda_check(cudaEventCreate(&stop[i]));
    for (int i = 0; i < warmup; i++) fn(ctx);
    for (int i = 0; i < runs; i++) {
        cuda_check(cudaEventRecord(start[i], gpu.stream));
        fn(ctx);
        cuda_check(cudaEventRecord(stop[i], gpu.stream));
    }
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cuda_check(cudaGetLastError());
    for (int i = 0; i < runs; i++) {
        float ms;
        cuda_check(cudaEventElapsedTime(&ms, start[i], stop[i]));
        times[i] = ms;
        cuda_check(cudaEventDestroy(start[i])), cuda_check(cudaEventDestroy(stop[i]));
    }
    qsort(times, runs, sizeof(double), dev_compare_doubles);
    return times[runs / 2];
}

static void bench_shape(const BenchShape *s, int N) {
    BenchRun r;
    r.N = N, r.H = s->H, r.W = s->H, r.C_in = s->C_in, r.C_out = s->C_out, r.stride = s->stride;
    int Ho = conv_out_size(r.H, 3, r.stride), Wo = conv_out_size(r.W, 3, r.stride);
    int64_t nx = (int64_t)N * r.H * r.W * r.C_in, ny = (int64_t)N * Ho * Wo * r.C_out, nw = (int64_t)r.C_out * 9 * r.C_in;
    size_t nscratch = conv3x3_weight_grad_scratch_floats(N, r.H, r.W, r.C_in, r.C_out, r.stride);
    r.x = bench_random(nx, 1), r.dy = bench_random(ny, 1), r.w = bench_random(nw, 1 / sqrtf(9.0f * r.C_in));
    r.bias = bench_random(r.C_out, 0.5f);
    r.y = (floatX *)gpu_malloc(ny * sizeof(floatX)), r.dx = (floatX *)gpu_malloc(nx * sizeof(floatX));
    cuda_check(cudaMemsetAsync(r.dx, 0, nx * sizeof(floatX), gpu.stream));
    r.dw = (float *)gpu_malloc(nw * sizeof(float)), r.scratch = (float *)gpu_malloc(nscratch * sizeof(float));
    r.split_n = split_scratch_floats(N, r.H, r.W, r.C_in, r.C_out, r.stride);
    r.split = (float *)gpu_malloc((r.split_n ? r.split_n : 1) * sizeof(float));
    double flops = 2.0 * N * Ho * Wo * r.C_out * 9.0 * r.C_in;
    for (int op = 0; op < OPS; op++) {
        r.op = op;
        double ms = bench_time_ms(bench_launch, &r);
        note_kernel();
        for (char *c = kernel_ran; *c; c++) *c = *c == ' ' ? '_' : *c;  // one word: key=value lines
        printf("conv impl=ours op=%s N=%d H=%d W=%d Cin=%d Cout=%d stride=%d ms=%.4f tflops=%.1f precision=%s presets=%s "
               "kernel=%s\n", op_names[op], N, r.H, r.W, r.C_in, r.C_out, r.stride, ms, flops / (ms * 1e-3) / 1e12, PRECISION_NAME,
               s->presets, kernel_ran);
        fflush(stdout);
    }
    dev_gpu_free(r.x, r.y, r.dy, r.dx, r.w, r.bias, r.dw, r.scratch, r.split, NULL);
}

// The shapes of a list of presets: "adm128:16,adm256:8" at those batches (the presets column names
// them with theirs), "seed,adm64" timed at 32 and 128 (BenchShape.N 0).
static void add_preset_shapes(BenchShapes *list, const char *presets) {
    char copy[256];
    snprintf(copy, sizeof copy, "%s", presets);
    for (char *item = strtok(copy, ","); item; item = strtok(NULL, ",")) {
        char name[16];
        int batch = 0, fields = sscanf(item, "%15[^:]:%d", name, &batch);
        Options o;
        ModelConfig c;
        char err[256];
        if (fields < 1 || (fields == 2 && batch < 1) || preset_options(name, &o) != 0)
            fatal("--presets: '%s' is not PRESET:BATCH with a train_unet preset", item);
        if (model_config_from_options(&o, o.class_cond ? o.num_classes + 1 : 0, &c, err, sizeof err) != 0) fatal("%s", err);
        if (batch) snprintf(visited_preset, sizeof visited_preset, "%s:%d", name, batch);
        else snprintf(visited_preset, sizeof visited_preset, "%s", name);
        visited_batch = batch;
        UNet plan;
        conv_visitor = visit_conv, conv_visitor_ctx = list;
        unet_plan(&plan, &c, batch ? batch : 32, 1);
        conv_visitor = NULL;
        unet_destroy(&plan);
    }
}

// The presets' shapes at batch 32 and 128, the one shape `only` (N H Cin Cout stride), or the
// shapes of `presets` (add_preset_shapes).
static void run_bench(const int *only, const char *presets) {
    static BenchShapes list;
    static const int mult[] = {1, 2, 3};  // adm64's channel multipliers of its downsampling levels
    int batches[2] = {32, 128}, num_batches = 2;
    if (only) {
        add_shape(&list, "one", only[1], only[2], only[3], only[4]);
        batches[0] = only[0], num_batches = 1;
    } else if (presets) {
        add_preset_shapes(&list, presets);
    } else {
        add_preset_shapes(&list, "seed,adm64");
        // Neither preset has a stride-2 conv (adm64 resamples in ResBlocks): adm64's Downsample
        // convs as they are with resblock_updown off.
        for (int level = 0; level < 3; level++) add_shape(&list, "adm64-s2", 64 >> level, 192 * mult[level], 192 * mult[level], 2);
    }
    for (int b = 0; b < num_batches; b++)
        for (int i = 0; i < list.count; i++)
            if (list.s[i].N == 0) bench_shape(&list.s[i], batches[b]);
            else if (b == 0) bench_shape(&list.s[i], list.s[i].N);
}

static void usage(void) {
    fprintf(stderr, "usage: bench_conv                                          the checks\n"
                    "       bench_conv --bench [--kernel K] [--check]           the timings (after the checks with --check)\n"
                    "       bench_conv --bench [--kernel K] N H Cin Cout stride the timings of one shape\n"
                    "       bench_conv --bench [--kernel K] --presets P[:B],... the timings of train_unet presets' shapes\n"
                    "                                                          (at batch B, else at 32 and 128)\n"
                    "--kernel K: time the planner's family K (image, narrow, halo, split, wgmma, mma, fp32) where it applies\n");
    exit(2);
}

int main(int argc, char **argv) {
    int bench = argc > 1 && strcmp(argv[1], "--bench") == 0, forced = -1;
    int named = bench && argc > 3 && strcmp(argv[2], "--kernel") == 0;
    for (int f = 0; named && f < CONV_FAMILIES; f++)
        if (strcmp(argv[3], conv_family_names[f]) == 0) forced = f;
    if (named && forced < 0) usage();
    int rest = argc - 2 - 2 * named, check = !bench, one = bench && rest == 5, only[5];
    char **args = argv + 2 + 2 * named;
    const char *presets = NULL;
    if (argc > 1 && !bench) usage();
    if (bench && rest == 1 && strcmp(args[0], "--check") == 0) check = 1;
    else if (bench && rest == 2 && strcmp(args[0], "--presets") == 0) presets = args[1];
    else if (bench && rest != 0 && !one) usage();
    for (int i = 0; one && i < 5; i++) {
        only[i] = atoi(args[i]);
        if (only[i] < 1 || (i == 4 && only[i] > 2)) usage();
    }
    dev_begin("bench_conv");
    if (check) run_checks();
    conv_dev.family = forced;
    if (bench) run_bench(one ? only : NULL, presets);
    return dev_end();
}
