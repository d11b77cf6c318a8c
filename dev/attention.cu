// dev/attention.cu: the core of guided-diffusion's attention (QKVAttentionLegacy and QKVAttention):
// softmax attention over the T = H W pixels, per image and head, from the qkv 1x1 conv's output.
// Activations [N][T][channels]. CPU reference in double.
#include "common.h"

// Channels of head h's q, k and v within a row of 3C qkv channels, each ch = C/heads wide:
//   legacy (QKVAttentionLegacy): [head 0: q k v | head 1: q k v | ...] -> h 3ch, h 3ch + ch, h 3ch + 2ch
//   new (QKVAttention):          [q: heads 0.. | k: heads 0.. | v: heads 0..] -> h ch, C + h ch, 2C + h ch
static void ref_attention_offsets(int *q, int *k, int *v, int h, int C, int heads, int legacy) {
    int ch = C / heads;
    *q = legacy ? h * 3 * ch : h * ch;
    *k = legacy ? h * 3 * ch + ch : C + h * ch;
    *v = legacy ? h * 3 * ch + 2 * ch : 2 * C + h * ch;
}

// One row of attention weights: w[s] = softmax_s((q_t ch^-1/4) . (k_s ch^-1/4)) over the keys s < T,
// for query t of image n, with q and k the channel offsets of the head.
static void ref_attention_weights(double *w, const double *qkv, int n, int t, int T, int C, int ch, int q, int k) {
    const double *qt = qkv + ((size_t)n * T + t) * 3 * C + q;
    double scale = 1 / sqrt(sqrt((double)ch)), max = -INFINITY, sum = 0;
    for (int s = 0; s < T; s++) {
        const double *ks = qkv + ((size_t)n * T + s) * 3 * C + k;
        double dot = 0;
        for (int i = 0; i < ch; i++) dot += qt[i] * ks[i];
        w[s] = dot * scale * scale;
        if (w[s] > max) max = w[s];
    }
    for (int s = 0; s < T; s++) sum += w[s] = exp(w[s] - max);
    for (int s = 0; s < T; s++) w[s] /= sum;
}

// out[n][t][h ch + i] = sum_s w_nht[s] v[n][s][head h's v channel i], w as in ref_attention_weights,
// ch = C / heads; qkv [N][T][3C] in the legacy or the new channel order, out [N][T][C].
static void ref_attention_forward(double *out, const double *qkv, int N, int T, int C, int heads, int legacy) {
    int ch = C / heads;
    double *w = dev_alloc(T);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < heads; h++) {
            int q, k, v;
            ref_attention_offsets(&q, &k, &v, h, C, heads, legacy);
            for (int t = 0; t < T; t++) {
                ref_attention_weights(w, qkv, n, t, T, C, ch, q, k);
                double *o = out + ((size_t)n * T + t) * C + h * ch;
                for (int i = 0; i < ch; i++) o[i] = 0;
                for (int s = 0; s < T; s++)
                    for (int i = 0; i < ch; i++) o[i] += w[s] * qkv[((size_t)n * T + s) * 3 * C + v + i];
            }
        }
    free(w);
}

// Backward, per image n, head h and query t, with g = d_out[n][t][h ch ..] and a = ch^-1/2:
//   dv_s += w[s] g                       dw[s] = g . v_s
//   dl[s] = w[s] (dw[s] - sum_r w[r] dw[r])     (softmax)
//   dq_t += a sum_s dl[s] k_s            dk_s += a dl[s] q_t
// accumulated into d_qkv [N][T][3C] (which may be NULL: nothing to do).
static void ref_attention_backward(double *d_qkv, const double *d_out, const double *qkv, int N, int T, int C, int heads,
                                   int legacy) {
    if (!d_qkv) return;
    int ch = C / heads;
    double a = 1 / sqrt((double)ch), *w = dev_alloc(T), *dw = dev_alloc(T);
    for (int n = 0; n < N; n++)
        for (int h = 0; h < heads; h++) {
            int q, k, v;
            ref_attention_offsets(&q, &k, &v, h, C, heads, legacy);
            for (int t = 0; t < T; t++) {
                ref_attention_weights(w, qkv, n, t, T, C, ch, q, k);
                const double *g = d_out + ((size_t)n * T + t) * C + h * ch;
                double sum = 0;
                for (int s = 0; s < T; s++) {
                    size_t row = ((size_t)n * T + s) * 3 * C;
                    dw[s] = 0;
                    for (int i = 0; i < ch; i++) {
                        dw[s] += g[i] * qkv[row + v + i];
                        d_qkv[row + v + i] += w[s] * g[i];
                    }
                    sum += w[s] * dw[s];
                }
                size_t tq = ((size_t)n * T + t) * 3 * C + q;
                for (int s = 0; s < T; s++) {
                    size_t sk = ((size_t)n * T + s) * 3 * C + k;
                    double dl = w[s] * (dw[s] - sum);
                    for (int i = 0; i < ch; i++) {
                        d_qkv[tq + i] += a * dl * qkv[sk + i];
                        d_qkv[sk + i] += a * dl * qkv[tq + i];
                    }
                }
            }
        }
    free(w);
    free(dw);
}
