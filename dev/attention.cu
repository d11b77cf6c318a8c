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

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's attention core (attention_bind, attention_forward, attention_backward)
// against the reference, fused (flash attention: BF16 build, 32, 64 or 128 channels per head) or as
// batched products (cuBLAS, softmax kernels). out [N][T][C] and d_qkv [N][T][3C] are written whole;
// the kept rows (lse), the scratch (delta, scores, d_scores) and probs are poisoned too, so a read
// before a write shows.

typedef struct {
    Attention a;
    floatX *qkv, *out, *d_qkv, *d_out;
} AttentionRun;

static void attention_run_forward(void *p) { attention_forward(&((AttentionRun *)p)->a); }
static void attention_run_backward(void *p) { attention_backward(&((AttentionRun *)p)->a); }

// Sets up an Attention as unet_create does: for the fused kernels two rows of numbers per (n, h),
// else scratch, probs and the 12 pointer arrays.
static void attention_setup(AttentionRun *r, int N, int T, int C, int heads, int legacy) {
    Attention *a = &r->a;
    memset(a, 0, sizeof *a);
    a->N = N, a->T = T, a->C = C, a->heads = heads, a->legacy = legacy;
    a->fused = attention_can_fuse(C / heads);
    size_t batch = (size_t)N * heads, tt = batch * T * T;
    if (a->fused) {
        a->lse = (float *)dev_gpu_poisoned(batch * T * sizeof(float));
        a->delta = (float *)dev_gpu_poisoned(batch * T * sizeof(float));
    } else {
        a->scores = (float *)dev_gpu_poisoned(tt * sizeof(float));
        a->probs = (floatX *)dev_gpu_poisoned(tt * sizeof(floatX));
        a->d_scores = (floatX *)dev_gpu_poisoned(tt * sizeof(floatX));
        void **arrays[] = {(void **)&a->q, (void **)&a->k, (void **)&a->v, (void **)&a->p, (void **)&a->ds, (void **)&a->o,
                           (void **)&a->dq, (void **)&a->dk, (void **)&a->dv, (void **)&a->s, (void **)&a->dp_out, (void **)&a->d_o};
        for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) *arrays[i] = dev_gpu_poisoned(batch * sizeof(void *));
    }
    attention_bind(a, r->qkv, r->out, r->d_qkv, r->d_out);
}

static void attention_teardown(AttentionRun *r) {
    Attention *a = &r->a;
    if (a->fused) dev_gpu_free(a->lse, a->delta, NULL);
    else
        dev_gpu_free(a->scores, a->probs, a->d_scores, a->q, a->k, a->v, a->p, a->ds, a->o, a->dq, a->dk, a->dv, a->s,
                     a->dp_out, a->d_o, NULL);
    dev_gpu_free(r->qkv, r->out, r->d_qkv, r->d_out, NULL);
}

static void check_attention(int N, int H, int W, int C, int heads, int legacy) {
    int T = H * W;
    size_t nqkv = (size_t)N * T * 3 * C, nout = (size_t)N * T * C;
    double *qkv = dev_alloc(nqkv), *d_out = dev_alloc(nout), *out = dev_alloc(nout), *d_qkv = dev_alloc(nqkv);
    dev_fill_x(qkv, nqkv, -2, 2), dev_fill_x(d_out, nout, -1, 1);
    ref_attention_forward(out, qkv, N, T, C, heads, legacy);
    ref_attention_backward(d_qkv, d_out, qkv, N, T, C, heads, legacy);

    AttentionRun r;
    r.qkv = dev_upload_x(qkv, nqkv), r.d_out = dev_upload_x(d_out, nout);
    r.out = (floatX *)dev_gpu_poisoned(nout * sizeof(floatX)), r.d_qkv = (floatX *)dev_gpu_poisoned(nqkv * sizeof(floatX));
    attention_setup(&r, N, T, C, heads, legacy);
    attention_run_forward(&r);
    attention_run_backward(&r);

    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.out, NULL, out, nout);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dqkv", dev_check_x(r.d_qkv, NULL, d_qkv, nqkv), tol);
    // The three parts separately (a wrong one hides less in the whole).
    double *g = dev_download_x(r.d_qkv, nqkv), *parts[3][2];
    const char *names[3] = {"dq", "dk", "dv"};
    int ch = C / heads;
    for (int j = 0; j < 3; j++) parts[j][0] = dev_alloc(nout), parts[j][1] = dev_alloc(nout);
    for (int n = 0; n < N; n++)
        for (int t = 0; t < T; t++)
            for (int h = 0; h < heads; h++) {
                int off[3];
                ref_attention_offsets(&off[0], &off[1], &off[2], h, C, heads, legacy);
                for (int j = 0; j < 3; j++)
                    for (int i = 0; i < ch; i++) {
                        size_t from = ((size_t)n * T + t) * 3 * C + off[j] + i, to = ((size_t)n * T + t) * C + h * ch + i;
                        parts[j][0][to] = g[from], parts[j][1][to] = d_qkv[from];
                    }
            }
    // A part that is zero in exact arithmetic (dq and dk at T = 1: one key, so dS = 0) is measured
    // against the whole gradient's size instead of its own.
    double whole = 0;
    for (size_t i = 0; i < nqkv; i++) whole += d_qkv[i] * d_qkv[i];
    for (int j = 0; j < 3; j++) {
        double size = 0, diff = 0;
        for (size_t i = 0; i < nout; i++) size += parts[j][1][i] * parts[j][1][i];
        for (size_t i = 0; i < nout; i++) diff += (parts[j][0][i] - parts[j][1][i]) * (parts[j][0][i] - parts[j][1][i]);
        double err = size > 0 ? dev_error(parts[j][0], NULL, parts[j][1], nout) : diff == diff ? sqrt(diff / whole) : INFINITY;
        dev_errors_add(&e, names[j], err, tol);
        free(parts[j][0]), free(parts[j][1]);
    }
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d (T%d) C%d heads %d %s", N, H, W, T, C, heads, legacy ? "legacy" : "new");
    dev_row("attention", shape, fwd, tol, &e, -1, -1);
    attention_teardown(&r);
    free(qkv), free(d_out), free(out), free(d_qkv), free(g);
}

static void time_attention(int N, int H, int W, int C, int heads, int legacy) {
    int T = H * W;
    size_t nqkv = (size_t)N * T * 3 * C, nout = (size_t)N * T * C;
    AttentionRun r;
    r.qkv = dev_random_x(nqkv, -2, 2), r.d_out = dev_random_x(nout, -1, 1);
    r.out = (floatX *)gpu_malloc(nout * sizeof(floatX)), r.d_qkv = (floatX *)gpu_malloc(nqkv * sizeof(floatX));
    attention_setup(&r, N, T, C, heads, legacy);
    double fwd = dev_time_ms(attention_run_forward, &r), bwd = dev_time_ms(attention_run_backward, &r);
    int finite = dev_finite_x(r.out, nout) && dev_finite_x(r.d_qkv, nqkv);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d (T%d) C%d heads %d %s", N, H, W, T, C, heads, legacy ? "legacy" : "new");
    dev_timing_row("attention", shape, fwd, bwd, finite);
    attention_teardown(&r);
}

int main(void) {
    dev_begin("attention");
    // 1, 2, 3 heads, both orders, T = 1, 49, 256; batch 1, 2, 3 in turn; channels per head 32 to 96.
    const int sides[3] = {1, 7, 16}, channels[3] = {64, 96, 96};
    int batch = 0;
    for (int s = 0; s < 3; s++)
        for (int heads = 1; heads <= 3; heads++)
            for (int legacy = 1; legacy >= 0; legacy--)
                check_attention(1 + batch++ % 3, sides[s], sides[s], channels[heads - 1], heads, legacy);
    check_attention(2, 8, 8, 160, 5, 1);    // 5 heads of 32
    check_attention(1, 32, 32, 128, 2, 0);  // T = 1024: 16 blocks of queries and of keys
    check_attention(2, 10, 10, 64, 2, 1);   // T = 100: a part block of 36 rows
    check_attention(1, 32, 32, 128, 1, 1);  // a head of 128 channels (dK and dV in two halves), T = 1024
    check_attention(3, 10, 10, 384, 3, 0);  // 3 heads of 128, a part block
    time_attention(32, 16, 16, 192, 6, 1);  // the seed preset
    time_attention(32, 8, 8, 256, 8, 1);
    time_attention(32, 32, 32, 384, 6, 0);  // adm64
    time_attention(32, 16, 16, 576, 9, 0);
    time_attention(16, 32, 32, 512, 4, 0);  // adm128's heads of 128
    return dev_end();
}
#endif  // DEV_NO_MAIN
