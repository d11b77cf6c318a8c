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
