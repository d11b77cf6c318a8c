// dev/groupnorm.cu: guided-diffusion's GroupNorm32 (32 groups, eps 1e-5, per-channel affine),
// fused with the two things that follow it in the UNet: the ResBlock's scale-shift
// (use_scale_shift_norm) and SiLU. Activations NHWC viewed as [N][HW][C]. CPU reference in double.
#include "common.h"

#define REF_GROUP_NORM_GROUPS 32
#define REF_GROUP_NORM_EPS 1e-5

// Statistics of group g of image n: the mean and 1/sqrt(var + eps) of the HW x C/32 values
// in[n][p][g C/32 + j], with the biased variance (as PyTorch).
static void ref_group_norm_stats(double *mean, double *rstd, const double *in, int n, int g, int HW, int C) {
    int cg = C / REF_GROUP_NORM_GROUPS;
    const double *x = in + (size_t)n * HW * C + g * cg;
    double sum = 0, sq = 0;
    for (int p = 0; p < HW; p++)
        for (int j = 0; j < cg; j++) sum += x[(size_t)p * C + j];
    *mean = sum / ((double)HW * cg);
    for (int p = 0; p < HW; p++)
        for (int j = 0; j < cg; j++) sq += (x[(size_t)p * C + j] - *mean) * (x[(size_t)p * C + j] - *mean);
    *rstd = 1 / sqrt(sq / ((double)HW * cg) + REF_GROUP_NORM_EPS);
}

// For channel c of group g:  xhat = (in[n][p][c] - mean_ng) rstd_ng
//   u = gamma[c] xhat + beta[c]
//   z = u (1 + scale_shift[n][c]) + scale_shift[n][C + c]     when scale_shift (else z = u)
//   out[n][p][c] = SiLU(z) = z sigmoid(z)                      when silu (else z)
// scale_shift may be NULL; it is [N][2C]: the scales, then the shifts.
static void ref_group_norm_forward(double *out, const double *in, const double *gamma, const double *beta,
                                   const double *scale_shift, int N, int HW, int C, int silu) {
    int cg = C / REF_GROUP_NORM_GROUPS;
    for (int n = 0; n < N; n++)
        for (int g = 0; g < REF_GROUP_NORM_GROUPS; g++) {
            double mean, rstd;
            ref_group_norm_stats(&mean, &rstd, in, n, g, HW, C);
            for (int p = 0; p < HW; p++)
                for (int c = g * cg; c < (g + 1) * cg; c++) {
                    size_t i = ((size_t)n * HW + p) * C + c;
                    double xhat = (in[i] - mean) * rstd, z = gamma[c] * xhat + beta[c];
                    if (scale_shift) z = z * (1 + scale_shift[(size_t)n * 2 * C + c]) + scale_shift[(size_t)n * 2 * C + C + c];
                    out[i] = silu ? dev_silu(z) : z;
                }
        }
}

// Backward of the above, with M = HW C/32 values per group and g = d_out:
//   dz = g SiLU'(z) (or g)                 d_scale_shift[n][c] += sum_p dz u, d_scale_shift[n][C+c] += sum_p dz
//   du = dz (1 + scale[n][c]) (or dz)      d_gamma[c] += sum_{n,p} du xhat,   d_beta[c] += sum_{n,p} du
//   dxhat = du gamma[c]
//   d_in += rstd (dxhat - mean_group(dxhat) - xhat mean_group(dxhat xhat))
// Any of d_in, d_gamma, d_beta, d_scale_shift may be NULL.
static void ref_group_norm_backward(double *d_in, double *d_gamma, double *d_beta, double *d_scale_shift,
                                    const double *d_out, const double *in, const double *gamma, const double *beta,
                                    const double *scale_shift, int N, int HW, int C, int silu) {
    int cg = C / REF_GROUP_NORM_GROUPS;
    double *dxhat = dev_alloc((size_t)HW * cg);  // one group's dxhat, [p][j]
    for (int n = 0; n < N; n++)
        for (int g = 0; g < REF_GROUP_NORM_GROUPS; g++) {
            double mean, rstd, sum_dxhat = 0, sum_dxhat_xhat = 0;
            ref_group_norm_stats(&mean, &rstd, in, n, g, HW, C);
            for (int p = 0; p < HW; p++)
                for (int j = 0; j < cg; j++) {
                    int c = g * cg + j;
                    size_t i = ((size_t)n * HW + p) * C + c;
                    double xhat = (in[i] - mean) * rstd, u = gamma[c] * xhat + beta[c];
                    double scale = scale_shift ? scale_shift[(size_t)n * 2 * C + c] : 0;
                    double z = scale_shift ? u * (1 + scale) + scale_shift[(size_t)n * 2 * C + C + c] : u;
                    double dz = silu ? d_out[i] * dev_silu_grad(z) : d_out[i];
                    if (d_scale_shift) {
                        d_scale_shift[(size_t)n * 2 * C + c] += dz * u;
                        d_scale_shift[(size_t)n * 2 * C + C + c] += dz;
                    }
                    double du = dz * (1 + scale);
                    if (d_gamma) d_gamma[c] += du * xhat;
                    if (d_beta) d_beta[c] += du;
                    dxhat[(size_t)p * cg + j] = du * gamma[c];
                    sum_dxhat += du * gamma[c];
                    sum_dxhat_xhat += du * gamma[c] * xhat;
                }
            if (!d_in) continue;
            double m = (double)HW * cg;
            for (int p = 0; p < HW; p++)
                for (int j = 0; j < cg; j++) {
                    size_t i = ((size_t)n * HW + p) * C + g * cg + j;
                    double xhat = (in[i] - mean) * rstd;
                    d_in[i] += rstd * (dxhat[(size_t)p * cg + j] - sum_dxhat / m - xhat * sum_dxhat_xhat / m);
                }
        }
    free(dxhat);
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's group_norm_forward / group_norm_backward with every NormOptions path:
// SiLU; `add` (the timestep embedding added to the input without scale-shift; its gradient is the
// per-sample channel sums of dx, taken in the model by the conv before, here by channel_sums);
// scale_shift (use_scale_shift_norm; rows of a wider [N][ld] array as in the model); dropout (the
// trainer's keep mask, drawn from its counter-based generator, applied to the reference).
//   forward: y, mean, rstd written whole (and group_norm_recompute gives y again, bit for bit); with
//   GN_GIVEN_SUMS from channel sums a producer gathered (here the host's, in 3 slots) for all of x or,
//   with GN_CONCAT, for its first part; GN_GIVEN_SUMS_B for the second part (in 2 slots); a part
//   without has them taken by group_norm_forward. GN_UPSAMPLED: x is a nearest 2x upsampling, and
//   the sums given for the first part are its source's (each source pixel standing for 4).
//   backward: dx += (GN_WRITE: written), d_scale_shift +=, dgamma, dbeta written; GN_SKIP: a skip's
//   gradient added to dx as well (the residual's, of a block whose input the GroupNorm reads);
//   GN_DX_SUMS: the channel sums of dx as written, left for the bias gradient of the layer before.

enum {
    GN_EMB_ADD = 1, GN_SCALE_SHIFT = 2, GN_WRITE = 4, GN_FAR_MEAN = 8, GN_CONCAT = 16, GN_GIVEN_SUMS = 32, GN_GIVEN_SUMS_B = 64,
    GN_UPSAMPLED = 128, GN_SKIP = 256, GN_DX_SUMS = 512, GN_MANY_SLOTS = 1024
};

typedef struct {
    Norm norm;
    NormOptions o;
    floatX *y, *x, *dx, *dy;
    floatX *skip;     // a gradient added to dx beside the input gradient, or NULL
    float *dx_sums;   // where group_norm_backward leaves dx's partial channel sums, or NULL
    floatX *y_again;  // backward's recomputation of y, or NULL
    float *mean, *rstd, *d_scale_shift;
    GradMode dx_mode;
    int N, HW;
    GatheredSums part_a, part_b;  // group_norm_forward's: the channel sums given, or none
} NormRun;

static void norm_run_forward(void *p) {
    NormRun *r = (NormRun *)p;
    group_norm_forward(&r->norm, r->y, r->mean, r->rstd, r->x, r->N, r->HW, r->o, r->part_a, r->part_b);
}

// The channel sums a producer would gather of x's channels [first, first + width) in `slots` slots of
// each sample's pixels (the layout of GatheredSums), on the GPU; of every other row and column
// (the source's pixels) when x is a nearest 2x upsampling.
static GatheredSums given_sums(const double *x, int N, int H, int W, int C, int first, int width, int slots, int upsampled) {
    int step = upsampled ? 2 : 1, pixels = (H / step) * (W / step);
    size_t numel = (size_t)N * slots * width * 2;
    double *sums = (double *)calloc(numel, sizeof(double));
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h += step)
            for (int w = 0; w < W; w += step)
                for (int c = first; c < first + width; c++) {
                    int slot = (h / step * (W / step) + w / step) * slots / pixels;
                    double v = x[(((size_t)n * H + h) * W + w) * C + c], *at = sums + (((size_t)n * slots + slot) * width + c - first) * 2;
                    at[0] += v, at[1] += v * v;
                }
    double *gpu_sums = (double *)gpu_malloc(numel * sizeof(double));
    cuda_check(cudaMemcpy(gpu_sums, sums, numel * sizeof(double), cudaMemcpyHostToDevice));
    free(sums);
    return {gpu_sums, slots, upsampled ? 4 : 1};
}

static void norm_run_backward(void *p) {
    NormRun *r = (NormRun *)p;
    group_norm_backward(&r->norm, r->dx, r->dx_mode, r->skip, r->dx_sums, r->d_scale_shift, r->dy, r->x, r->y_again, r->mean,
                        r->rstd, r->N, r->HW, r->o);
}

// The scratch a model's plan gives this GroupNorm (and the channel sums of the GN_EMB_ADD check).
static const Scratch *norm_scratch_for(int N, int C) {
    return dev_scratch(0, channel_sum_slots(N) * C, gn_slots(N) * (C * 4 + GN_GROUPS * 2));
}

static void check_norm(int N, int H, int W, int C, int silu, int mode, float dropout) {
    int HW = H * W, ld = 2 * C + 7, add_ld = C + 3;  // the embedding arrays are wider than C, as in the model
    size_t n = (size_t)N * HW * C, nss = (size_t)N * ld, nadd = (size_t)N * add_ld;
    double *x = dev_alloc(n), *gamma = dev_alloc(C), *beta = dev_alloc(C), *dy = dev_alloc(n);
    double *ss = dev_alloc(nss), *add = dev_alloc(nadd);
    dev_fill_x(x, n, mode & GN_FAR_MEAN ? 40 : -1, mode & GN_FAR_MEAN ? 44 : 2), dev_fill_f(gamma, C, 0.5, 1.5);
    if (mode & GN_UPSAMPLED)  // x[n][h][w] = x[n][h - h % 2][w - w % 2]
        for (size_t i = 0; i < n; i++) {
            size_t nn = i / ((size_t)HW * C), h = i / C % HW / W, w = i / C % W;
            x[i] = x[((nn * H + h / 2 * 2) * W + w / 2 * 2) * C + i % C];
        }
    dev_fill_f(beta, C, -0.5, 0.5), dev_fill_x(dy, n, -1, 1);
    dev_fill_f(ss, nss, -0.5, 0.5), dev_fill_f(add, nadd, -1, 1);
    uint64_t seed = random_u64(dev_seed, 7, 0);

    // Reference on x' = x + add, with scale_shift compacted to [N][2C] and dropout applied after.
    double *xin = dev_alloc(n), *ss2 = dev_alloc((size_t)N * 2 * C), *keep = dev_alloc(n), *dy_keep = dev_alloc(n);
    for (size_t i = 0; i < n; i++) {
        size_t nn = i / ((size_t)HW * C);
        int c = (int)(i % C);
        xin[i] = x[i] + (mode & GN_EMB_ADD ? add[nn * add_ld + c] : 0);
        keep[i] = dropout > 0 ? dropout_keep(random_key(seed, 7), (int64_t)i, dropout) : 1;  // the trainer's rule, on the host
        dy_keep[i] = dy[i] * keep[i];
    }
    for (int nn = 0; nn < N; nn++)
        for (int c = 0; c < 2 * C; c++) ss2[(size_t)nn * 2 * C + c] = ss[(size_t)nn * ld + c];
    const double *ss_ref = mode & GN_SCALE_SHIFT ? ss2 : NULL;
    double *y = dev_alloc(n), *dx = dev_alloc(n), *dgamma = dev_alloc(C), *dbeta = dev_alloc(C);
    double *dss2 = dev_alloc((size_t)N * 2 * C), *dss = dev_alloc(nss), *dadd = dev_alloc(nadd);
    ref_group_norm_forward(y, xin, gamma, beta, ss_ref, N, HW, C, silu);
    for (size_t i = 0; i < n; i++) y[i] *= keep[i];
    ref_group_norm_backward(dx, dgamma, dbeta, ss_ref ? dss2 : NULL, dy_keep, xin, gamma, beta, ss_ref, N, HW, C, silu);
    for (int nn = 0; nn < N; nn++)
        for (int c = 0; c < 2 * C; c++) dss[(size_t)nn * ld + c] = dss2[(size_t)nn * 2 * C + c];
    for (size_t i = 0; i < n; i++) dadd[i / ((size_t)HW * C) * add_ld + i % C] += dx[i];
    // Accumulating outputs start random (dx starts at zero with `add`, as in the model, whose
    // per-sample sums of dx are the embedding's gradient).
    double *dx_before = dev_alloc(n), *dss_before = dev_alloc(nss), *dadd_before = dev_alloc(nadd), s;
    if (!(mode & GN_EMB_ADD)) s = dev_rms(dx, n), dev_fill_x(dx_before, n, -s, s);
    // GN_SKIP: dx then holds (dx_before, when added to) + skip before the input gradient
    double *skip = dev_alloc(n), *dx_start = dev_alloc(n);
    if (mode & GN_SKIP) s = dev_rms(dx, n), dev_fill_x(skip, n, -s, s);
    for (size_t i = 0; i < n; i++) dx_start[i] = (mode & GN_WRITE ? 0.0 : dx_before[i]) + skip[i];
    s = dev_rms(dss, nss), dev_fill_f(dss_before, nss, -s, s);
    s = dev_rms(dadd, nadd), dev_fill_f(dadd_before, nadd, -s, s);

    NormRun r;
    memset(&r, 0, sizeof r);
    r.norm.channels = C;
    r.norm.gamma = dev_upload_f(gamma, C), r.norm.beta = dev_upload_f(beta, C);
    r.norm.dgamma = (float *)dev_gpu_poisoned(C * sizeof(float)), r.norm.dbeta = (float *)dev_gpu_poisoned(C * sizeof(float));
    float *ss_gpu = dev_upload_f(ss, nss), *add_gpu = dev_upload_f(add, nadd), *dadd_gpu = dev_upload_f(dadd_before, nadd);
    r.o.silu = silu;
    if (mode & GN_EMB_ADD) r.o.add = add_gpu, r.o.add_ld = add_ld;
    if (mode & GN_SCALE_SHIFT) r.o.scale_shift = ss_gpu, r.o.scale_shift_ld = ld;
    r.o.dropout = dropout, r.o.dropout_stream = 7;
    uint64_t *seed_gpu = (uint64_t *)dev_gpu_poisoned(sizeof(uint64_t));
    cuda_check(cudaMemcpy(seed_gpu, &seed, sizeof seed, cudaMemcpyHostToDevice));
    r.o.dropout_seed = seed_gpu;
    r.x = dev_upload_x(x, n), r.dy = dev_upload_x(dy, n);
    r.dx = mode & GN_WRITE ? (floatX *)dev_gpu_poisoned(n * sizeof(floatX)) : dev_upload_x(dx_before, n);
    r.dx_mode = mode & GN_WRITE ? GRAD_WRITE : GRAD_ADD;
    r.skip = mode & GN_SKIP ? dev_upload_x(skip, n) : NULL;
    r.dx_sums = mode & GN_DX_SUMS ? (float *)dev_gpu_poisoned((size_t)gn_slots(N) * C * sizeof(float)) : NULL;
    r.y = (floatX *)dev_gpu_poisoned(n * sizeof(floatX));
    r.mean = (float *)dev_gpu_poisoned((size_t)N * GN_GROUPS * sizeof(float));
    r.rstd = (float *)dev_gpu_poisoned((size_t)N * GN_GROUPS * sizeof(float));
    r.d_scale_shift = dev_upload_f(dss_before, nss);
    r.N = N, r.HW = HW;
    r.norm.scratch = norm_scratch_for(N, C);
    // GN_CONCAT: the input and its gradient as two channel blocks [x | x2] read in place (a decoder's
    // skip concatenation); the checks below see them put back together.
    floatX *x_whole = r.x, *dx_whole = r.dx, *x_parts = NULL, *dx_parts = NULL;
    int64_t pixels = (int64_t)N * HW;
    int C1 = C / 3 / PACK * PACK;
    if (mode & GN_CONCAT) {
        x_parts = (floatX *)gpu_malloc(n * sizeof(floatX)), dx_parts = (floatX *)gpu_malloc(n * sizeof(floatX));
        split_channels(x_parts, GRAD_WRITE, x_parts + pixels * C1, GRAD_WRITE, x_whole, pixels, C1, C - C1);
        split_channels(dx_parts, GRAD_WRITE, dx_parts + pixels * C1, GRAD_WRITE, dx_whole, pixels, C1, C - C1);
        r.x = x_parts, r.o.x2 = x_parts + pixels * C1, r.dx = dx_parts, r.o.dx2 = dx_parts + pixels * C1, r.o.C1 = C1;
    }
    int width_a = mode & GN_CONCAT ? C1 : C;
    r.part_a = r.part_b = {NULL, 0, 1};
    int slots_a = mode & GN_MANY_SLOTS ? 64 : 3, slots_b = mode & GN_MANY_SLOTS ? 64 : 2;
    if (mode & GN_GIVEN_SUMS) r.part_a = given_sums(x, N, H, W, C, 0, width_a, slots_a, mode & GN_UPSAMPLED);
    if (mode & GN_GIVEN_SUMS_B) r.part_b = given_sums(x, N, H, W, C, C1, C - C1, slots_b, 0);
    norm_run_forward(&r);
    // Backward's recomputations of y from the kept statistics (group_norm_recompute, and the backward's
    // first pass with y): the forward's bits.
    floatX *y_recomputed = (floatX *)dev_gpu_poisoned(n * sizeof(floatX));
    group_norm_recompute(&r.norm, y_recomputed, r.mean, r.rstd, r.x, N, HW, r.o);
    double recompute_err = dev_same_bits(r.y, y_recomputed, n * sizeof(floatX)) ? 0.0 : INFINITY;
    r.y_again = (floatX *)dev_gpu_poisoned(n * sizeof(floatX));
    norm_run_backward(&r);
    double backward_recompute_err = dev_same_bits(r.y, r.y_again, n * sizeof(floatX)) ? 0.0 : INFINITY;
    dev_gpu_free(y_recomputed, r.y_again, NULL);
    if (mode & GN_CONCAT) {
        concat_channels(dx_whole, dx_parts, dx_parts + pixels * C1, pixels, C1, C - C1);
        r.x = x_whole, r.dx = dx_whole;
        dev_gpu_free(x_parts, dx_parts, NULL);
    }
    if (mode & GN_EMB_ADD) channel_sums(r.norm.scratch, dadd_gpu, add_ld, NULL, r.dx, N, HW, C);
    double dx_sums_err = 0.0;
    if (mode & GN_DX_SUMS) {  // against the sums of dx as the GPU wrote it
        double *written = dev_download_x(r.dx, n), *sums = dev_alloc(C);
        for (size_t i = 0; i < n; i++) sums[i % C] += written[i];
        float *total = (float *)dev_gpu_poisoned(C * sizeof(float));
        ChannelSumsGiven given = gn_dx_sums_given(r.dx_sums, N, HW, C);
        channel_sums_total(NULL, 0, total, given, N, C);
        dx_sums_err = dev_check_f(total, NULL, sums, C);
        dev_gpu_free(total, NULL);
        free(written), free(sums);
    }

    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, n);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dx", dev_check_x(r.dx, mode & GN_WRITE && !(mode & GN_SKIP) ? NULL : dx_start, dx, n), tol);
    dev_errors_add(&e, "recompute", recompute_err, 0);
    dev_errors_add(&e, "recompute in backward", backward_recompute_err, 0);
    dev_errors_add(&e, "dgamma", dev_check_f(r.norm.dgamma, NULL, dgamma, C), tol);
    dev_errors_add(&e, "dbeta", dev_check_f(r.norm.dbeta, NULL, dbeta, C), tol);
    if (mode & GN_SCALE_SHIFT) dev_errors_add(&e, "dss", dev_check_f(r.d_scale_shift, dss_before, dss, nss), tol);
    else dev_errors_add(&e, "dss_untouched", dev_check_f(r.d_scale_shift, dss_before, dss, nss), 0);  // dss is zero
    if (mode & GN_EMB_ADD) dev_errors_add(&e, "dadd", dev_check_f(dadd_gpu, dadd_before, dadd, nadd), tol);
    if (mode & GN_DX_SUMS) dev_errors_add(&e, "dx sums", dx_sums_err, tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d C%d%s%s%s", N, H, W, C, silu ? " silu" : "", mode & GN_EMB_ADD ? " add" : "",
             mode & GN_SCALE_SHIFT ? " scale-shift" : "");
    if (mode & GN_WRITE) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " dx written");
    if (mode & GN_SKIP) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " + skip");
    if (mode & GN_DX_SUMS) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " (dx's sums)");
    if (dropout > 0) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " drop%.2g", dropout);
    if (mode & GN_FAR_MEAN) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " x in [40, 44]");
    if (mode & GN_CONCAT) snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " [%d | %d] in place", C1, C - C1);
    if (mode & (GN_GIVEN_SUMS | GN_GIVEN_SUMS_B))
        snprintf(shape + strlen(shape), sizeof shape - strlen(shape), " sums given%s%s%s%s", mode & GN_GIVEN_SUMS ? " a" : "",
                 mode & GN_GIVEN_SUMS_B ? " b" : "", mode & GN_UPSAMPLED ? " (upsampled)" : "",
                 mode & GN_MANY_SLOTS ? " in 64 slots" : "");
    dev_row("groupnorm", shape, fwd, tol, &e, -1, -1);

    dev_gpu_free(r.norm.gamma, r.norm.beta, r.norm.dgamma, r.norm.dbeta, ss_gpu, add_gpu, dadd_gpu, r.x, r.dy, r.dx, r.y,
                 r.mean, r.rstd, r.d_scale_shift, seed_gpu, NULL);
    if (r.skip) dev_gpu_free(r.skip, NULL);
    if (r.dx_sums) dev_gpu_free(r.dx_sums, NULL);
    cuda_check(cudaFree((void *)r.part_a.sums)), cuda_check(cudaFree((void *)r.part_b.sums));  // (NULL: nothing)
    free(x), free(gamma), free(beta), free(dy), free(ss), free(add), free(xin), free(ss2), free(keep), free(dy_keep);
    free(y), free(dx), free(dgamma), free(dbeta), free(dss2), free(dss), free(dadd), free(dx_before), free(dss_before);
    free(dadd_before), free(skip), free(dx_start);
}

static void time_norm(const char *what, int N, int H, int W, int C, int silu, int scale_shift) {
    size_t n = (size_t)N * H * W * C;
    NormRun r;
    memset(&r, 0, sizeof r);
    r.norm.channels = C;
    r.norm.gamma = dev_random_f(C, 0.5, 1.5), r.norm.beta = dev_random_f(C, -0.5, 0.5);
    r.norm.dgamma = (float *)gpu_malloc(C * sizeof(float)), r.norm.dbeta = (float *)gpu_malloc(C * sizeof(float));
    float *ss = dev_random_f((size_t)N * 2 * C, -0.5, 0.5);
    r.o.silu = silu;
    if (scale_shift) r.o.scale_shift = ss, r.o.scale_shift_ld = 2 * C;
    r.x = dev_random_x(n, -1, 2), r.dy = dev_random_x(n, -1, 1);
    r.y = (floatX *)gpu_malloc(n * sizeof(floatX)), r.dx = (floatX *)gpu_malloc(n * sizeof(floatX));
    cuda_check(cudaMemsetAsync(r.dx, 0, n * sizeof(floatX), gpu.stream));
    r.dx_mode = GRAD_ADD;
    r.mean = (float *)gpu_malloc((size_t)N * GN_GROUPS * sizeof(float)), r.rstd = (float *)gpu_malloc((size_t)N * GN_GROUPS * sizeof(float));
    r.d_scale_shift = (float *)gpu_malloc((size_t)N * 2 * C * sizeof(float));
    cuda_check(cudaMemsetAsync(r.d_scale_shift, 0, (size_t)N * 2 * C * sizeof(float), gpu.stream));
    r.N = N, r.HW = H * W;
    r.norm.scratch = norm_scratch_for(N, C);
    double fwd = dev_time_ms(norm_run_forward, &r), bwd = dev_time_ms(norm_run_backward, &r);
    int finite = dev_finite_x(r.y, n) && dev_finite_x(r.dx, n) && dev_finite_f(r.norm.dgamma, C) && dev_finite_f(r.norm.dbeta, C);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d C%d (%s)", N, H, W, C, what);
    dev_timing_row("groupnorm", shape, fwd, bwd, finite);
    dev_gpu_free(r.norm.gamma, r.norm.beta, r.norm.dgamma, r.norm.dbeta, ss, r.x, r.dy, r.y, r.dx, r.mean, r.rstd,
                 r.d_scale_shift, NULL);
}

int main(void) {
    dev_begin("groupnorm");
    check_norm(1, 7, 7, 96, 0, 0, 0);                       // attention's norm
    check_norm(3, 13, 13, 160, 1, 0, 0);                    // in_layers: GroupNorm + SiLU
    // 1x1 image: 3 values per group. (Not 2: with two values xhat = +-1 up to eps, so the exact
    // input gradient is ~eps/var of its terms and fp32 rounding alone is ~1e-4 of it.)
    check_norm(2, 1, 1, 96, 1, 0, 0);
    check_norm(3, 17, 17, 32, 1, 0, 0);                     // 289 rows over 16 chunks
    check_norm(3, 8, 8, 128, 1, GN_EMB_ADD | GN_WRITE, 0);      // out_layers without scale-shift
    check_norm(2, 13, 13, 96, 1, GN_SCALE_SHIFT, 0);        // out_layers with scale-shift
    check_norm(1, 1, 1, 160, 1, GN_SCALE_SHIFT, 0);
    check_norm(2, 16, 16, 64, 1, GN_SCALE_SHIFT | GN_WRITE, 0.1f);  // + dropout
    check_norm(3, 7, 7, 96, 1, GN_EMB_ADD, 0.3f);
    check_norm(2, 4, 4, 512, 0, 0, 0);                      // wide
    check_norm(2, 3, 5, 768, 1, GN_SCALE_SHIFT, 0);         // wider than a block's threads: idle threads
    check_norm(2, 32, 32, 64, 1, GN_FAR_MEAN, 0);           // mean ~36 standard deviations: the statistics' shift
    check_norm(3, 9, 9, 192, 1, GN_CONCAT, 0);              // in_layers of a decoder ResBlock: [h | skip] in place
    check_norm(2, 4, 4, 96, 1, GN_CONCAT | GN_WRITE, 0);
    check_norm(40, 64, 64, 64, 1, GN_EMB_ADD, 0);            // the forward's chunks limited by the batch: 13 a sample
    check_norm(2, 128, 128, 64, 1, GN_SCALE_SHIFT, 0);      // a small batch: 64 chunks a sample (GN_BLOCKS / N, at most 64)
    // statistics from sums a convolution gathered: with the embedding's add (out_layers), and far from 0
    check_norm(3, 8, 8, 128, 1, GN_EMB_ADD | GN_GIVEN_SUMS, 0);
    check_norm(2, 16, 16, 96, 0, GN_FAR_MEAN | GN_GIVEN_SUMS, 0);
    // a decoder's concatenation with sums gathered for one part or both (groups straddling the parts:
    // 6 channels a group, C1 = 64), and a part that is a nearest upsampling (its source's sums)
    check_norm(3, 8, 8, 192, 1, GN_CONCAT | GN_GIVEN_SUMS, 0);
    check_norm(3, 8, 8, 192, 1, GN_CONCAT | GN_GIVEN_SUMS_B, 0);
    check_norm(2, 12, 12, 192, 1, GN_CONCAT | GN_GIVEN_SUMS | GN_GIVEN_SUMS_B | GN_UPSAMPLED | GN_FAR_MEAN, 0);
    check_norm(2, 16, 16, 96, 0, GN_GIVEN_SUMS | GN_UPSAMPLED | GN_EMB_ADD, 0);
    // sums in many slots (a 128x128 halo forward's: 64 a sample): the statistics in a kernel of their own
    check_norm(2, 16, 16, 256, 1, GN_GIVEN_SUMS | GN_MANY_SLOTS | GN_EMB_ADD, 0);
    check_norm(2, 16, 16, 192, 1, GN_CONCAT | GN_GIVEN_SUMS | GN_GIVEN_SUMS_B | GN_MANY_SLOTS | GN_FAR_MEAN, 0);
    // a block's input gradient with its residual's added in the same pass: added to (an encoder's
    // input, which the decoder's skip reads too) or written
    check_norm(2, 9, 9, 96, 0, GN_SKIP, 0);
    check_norm(3, 13, 13, 160, 1, GN_SKIP | GN_WRITE, 0);
    check_norm(2, 16, 16, 64, 1, GN_SKIP | GN_SCALE_SHIFT, 0.1f);
    // out_layers' input gradient with its channel sums (the bias gradient of in_layers' convolution)
    check_norm(3, 16, 16, 96, 1, GN_SCALE_SHIFT | GN_WRITE | GN_DX_SUMS, 0.1f);
    check_norm(2, 1, 1, 768, 1, GN_SCALE_SHIFT | GN_WRITE | GN_DX_SUMS, 0);  // idle threads
    check_norm(40, 64, 64, 64, 1, GN_WRITE | GN_DX_SUMS, 0);
    // a block's input gradient as the last to write it, with its sums (the bias gradient of the block
    // before): the residual's gradient added, written or added to; a decoder's concatenation added to
    check_norm(3, 13, 13, 160, 1, GN_SKIP | GN_WRITE | GN_DX_SUMS, 0);
    check_norm(2, 9, 9, 96, 0, GN_SKIP | GN_DX_SUMS, 0);
    check_norm(3, 8, 8, 192, 1, GN_CONCAT | GN_DX_SUMS, 0);
    time_norm("in_layers", 32, 64, 64, 64, 1, 0);
    time_norm("out_layers scale-shift", 32, 64, 64, 64, 1, 1);
    time_norm("out_layers scale-shift", 32, 8, 8, 512, 1, 1);
    time_norm("in_layers", 128, 64, 64, 64, 1, 0);    // seed:128's largest
    time_norm("in_layers", 128, 64, 64, 128, 1, 0);
    time_norm("in_layers", 128, 16, 16, 192, 1, 0);
    time_norm("in_layers", 128, 8, 8, 256, 1, 0);     // seed:128's smallest
    time_norm("out_layers scale-shift", 32, 32, 32, 384, 1, 1);  // adm64:32's
    time_norm("out_layers scale-shift", 32, 8, 8, 768, 1, 1);
    return dev_end();
}
#endif  // DEV_NO_MAIN
