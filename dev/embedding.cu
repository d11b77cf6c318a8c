// dev/embedding.cu: the UNet's conditioning inputs: guided-diffusion's sinusoidal timestep
// embedding, SiLU (time_embed's and every emb_layers' activation) and the class-label embedding
// (label_emb). CPU reference in double.
#include "common.h"

// guided-diffusion's timestep_embedding(t, dim), max_period 10000: with half = dim/2 and
// f_i = exp(-ln(10000) i / half), out[n] = [cos(t_n f_0 .. t_n f_{half-1}) | sin(t_n f_0 ..)],
// plus one zero when dim is odd. No gradient (t is an integer).
static void ref_timestep_embedding(double *out, const int64_t *t, int N, int dim) {
    int half = dim / 2;
    for (int n = 0; n < N; n++) {
        double *o = out + (size_t)n * dim;
        for (int i = 0; i < half; i++) {
            double arg = (double)t[n] * exp(-log(10000.0) * i / half);
            o[i] = cos(arg);
            o[half + i] = sin(arg);
        }
        if (dim % 2) o[dim - 1] = 0;
    }
}

// out[i] = SiLU(in[i]) = in[i] sigmoid(in[i])
static void ref_silu_forward(double *out, const double *in, size_t n) {
    for (size_t i = 0; i < n; i++) out[i] = dev_silu(in[i]);
}

// d_in[i] += d_out[i] SiLU'(in[i]), SiLU'(x) = sigmoid(x) (1 + x (1 - sigmoid(x)))
static void ref_silu_backward(double *d_in, const double *d_out, const double *in, size_t n) {
    for (size_t i = 0; i < n; i++) d_in[i] += d_out[i] * dev_silu_grad(in[i]);
}

// out[n][j] = table[index[n]][j]  (nn.Embedding; table [rows][dim])
static void ref_embedding_forward(double *out, const double *table, const int64_t *index, int N, int dim) {
    for (int n = 0; n < N; n++) memcpy(out + (size_t)n * dim, table + (size_t)index[n] * dim, dim * sizeof(double));
}

// d_table[index[n]][j] += d_out[n][j]  (rows repeated in index add up)
static void ref_embedding_backward(double *d_table, const double *d_out, const int64_t *index, int N, int dim) {
    for (int n = 0; n < N; n++)
        for (int j = 0; j < dim; j++) d_table[(size_t)index[n] * dim + j] += d_out[(size_t)n * dim + j];
}
