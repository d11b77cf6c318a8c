// dev/embedding.cu: the UNet's conditioning inputs: guided-diffusion's sinusoidal timestep
// embedding, SiLU (time_embed's and every emb_layers' activation) and the class-label embedding
// (label_emb). CPU reference in double.
#include "common.h"

// guided-diffusion's timestep_embedding(t, dim), max_period 10000: with half = dim/2 and
// f_i = exp(-ln(10000) i / half), out[n] = [cos(t_n f_0 .. t_n f_{half-1}) | sin(t_n f_0 ..)],
// plus one zero when dim is odd, at any real t_n (EDM's c_noise is one). No gradient (t is an input).
static void ref_sinusoid_embedding(double *out, const double *t, int N, int dim) {
    int half = dim / 2;
    for (int n = 0; n < N; n++) {
        double *o = out + (size_t)n * dim;
        for (int i = 0; i < half; i++) {
            double arg = t[n] * exp(-log(10000.0) * i / half);
            o[i] = cos(arg);
            o[half + i] = sin(arg);
        }
        if (dim % 2) o[dim - 1] = 0;
    }
}

// The same at integer timesteps.
static void ref_timestep_embedding(double *out, const int64_t *t, int N, int dim) {
    double *values = (double *)malloc_or_die(N * sizeof(double));
    for (int n = 0; n < N; n++) values[n] = (double)t[n];
    ref_sinusoid_embedding(out, values, N, dim);
    free(values);
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

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's timestep_embedding_kernel (written whole), silu_forward_kernel (written
// whole) / silu_backward_kernel (dx +=), label_embedding_forward_kernel (emb += its table row) and
// label_embedding_backward_kernel (d_table written whole, repeated labels adding up).

typedef struct {
    floatX *e;
    int64_t *t;
    float *time;  // EDM's continuous timestep input (NULL: t)
    int N, D;
} TimestepRun;

static void timestep_run(void *p) {
    TimestepRun *r = (TimestepRun *)p;
    timestep_embedding_kernel<<<(r->N * r->D + 255) / 256, 256, 0, gpu.stream>>>(r->e, r->t, r->time, r->N, r->D);
    cuda_check_launch();
}

typedef struct {
    floatX *y, *x, *dx, *dy;
    int64_t n;
} SiluRun;

static void silu_run_forward(void *p) {
    SiluRun *r = (SiluRun *)p;
    silu_forward_kernel<<<blocks_for(r->n, 256), 256, 0, gpu.stream>>>(r->y, r->x, r->n);
    cuda_check_launch();
}

static void silu_run_backward(void *p) {
    SiluRun *r = (SiluRun *)p;
    silu_backward_kernel<<<blocks_for(r->n, 256), 256, 0, gpu.stream>>>(r->dx, r->dy, r->x, r->n);
    cuda_check_launch();
}

typedef struct {
    floatX *emb, *d_emb;
    float *table, *d_table;
    int *labels;
    int N, rows, D;
} LabelRun;

static void label_run_forward(void *p) {
    LabelRun *r = (LabelRun *)p;
    label_embedding_forward_kernel<<<(r->N * r->D + 255) / 256, 256, 0, gpu.stream>>>(r->emb, r->table, r->labels, r->N, r->D);
    cuda_check_launch();
}

static void label_run_backward(void *p) {
    LabelRun *r = (LabelRun *)p;
    label_embedding_backward_kernel<<<(r->D + 127) / 128, 128, 0, gpu.stream>>>(r->d_table, r->d_emb, r->labels, r->N, r->rows, r->D);
    cuda_check_launch();
}

// Timesteps: 0 and 999 first, the rest random in [0, 1000); or (continuous) EDM's c_noise = ln(sigma)
// / 4 for sigma from 0.002 to 80 and beyond, as floats.
static void check_timestep(int N, int D, int continuous) {
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    float *time = (float *)malloc_or_die(N * sizeof(float));
    double *values = dev_alloc(N);
    for (int n = 0; n < N; n++) {
        t[n] = n == 0 ? 0 : n == 1 ? 999 : dev_random_int(1000);
        time[n] = (float)(log(n == 0 ? 0.002 : n == 1 ? 80.0 : exp(-7.0 + 12.0 * dev_random_int(1 << 20) / (double)(1 << 20))) / 4);
        values[n] = continuous ? (double)time[n] : (double)t[n];
    }
    double *e = dev_alloc((size_t)N * D);
    ref_sinusoid_embedding(e, values, N, D);
    TimestepRun r = {(floatX *)dev_gpu_poisoned((size_t)N * D * sizeof(floatX)), (int64_t *)gpu_malloc(N * sizeof(int64_t)),
                     continuous ? (float *)gpu_malloc(N * sizeof(float)) : NULL, N, D};
    cuda_check(cudaMemcpy(r.t, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    if (continuous) cuda_check(cudaMemcpy(r.time, time, N * sizeof(float), cudaMemcpyHostToDevice));
    timestep_run(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.e, NULL, e, (size_t)N * D);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d dim %d%s", N, D, continuous ? " c_noise" : "");
    dev_row("timestep", shape, fwd, tol, NULL, -1, -1);
    dev_gpu_free(r.e, r.t, r.time, NULL);
    free(t), free(time), free(values), free(e);
}

static void check_silu(size_t n) {
    double *x = dev_alloc(n), *dy = dev_alloc(n), *y = dev_alloc(n), *dx = dev_alloc(n), *dx_before = dev_alloc(n), s;
    dev_fill_x(x, n, -6, 6), dev_fill_x(dy, n, -1, 1);
    ref_silu_forward(y, x, n);
    ref_silu_backward(dx, dy, x, n);
    s = dev_rms(dx, n), dev_fill_x(dx_before, n, -s, s);
    SiluRun r = {(floatX *)dev_gpu_poisoned(n * sizeof(floatX)), dev_upload_x(x, n), dev_upload_x(dx_before, n),
                 dev_upload_x(dy, n), (int64_t)n};
    silu_run_forward(&r);
    silu_run_backward(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, n);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dx", dev_check_x(r.dx, dx_before, dx, n), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "n %zu", n);
    dev_row("silu", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.y, r.x, r.dx, r.dy, NULL);
    free(x), free(dy), free(y), free(dx), free(dx_before);
}

static void check_label(int N, int rows, int D) {
    size_t ne = (size_t)N * D, nt = (size_t)rows * D;
    int64_t *index = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    int *labels = (int *)malloc_or_die(N * sizeof(int));
    for (int n = 0; n < N; n++) labels[n] = (int)(index[n] = n == 0 ? rows - 1 : dev_random_int(rows));
    double *table = dev_alloc(nt), *d_emb = dev_alloc(ne), *emb_before = dev_alloc(ne), *emb = dev_alloc(ne), *d_table = dev_alloc(nt);
    dev_fill_f(table, nt, -2, 2), dev_fill_x(d_emb, ne, -1, 1), dev_fill_x(emb_before, ne, -1, 1);
    ref_embedding_forward(emb, table, index, N, D);
    ref_embedding_backward(d_table, d_emb, index, N, D);
    // The GPU adds into emb (the timestep MLP's output): its result is rounded once to floatX.
    for (size_t i = 0; i < ne; i++) emb[i] = dev_round_x(emb_before[i] + emb[i]) - emb_before[i];
    LabelRun r = {dev_upload_x(emb_before, ne), dev_upload_x(d_emb, ne), dev_upload_f(table, nt),
                  (float *)dev_gpu_poisoned(nt * sizeof(float)), (int *)gpu_malloc(N * sizeof(int)), N, rows, D};
    cuda_check(cudaMemcpy(r.labels, labels, N * sizeof(int), cudaMemcpyHostToDevice));
    label_run_forward(&r);
    label_run_backward(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.emb, emb_before, emb, ne);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "dtable", dev_check_f(r.d_table, NULL, d_table, nt), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %d rows dim %d", N, rows, D);
    dev_row("label_emb", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.emb, r.d_emb, r.table, r.d_table, r.labels, NULL);
    free(index), free(labels), free(table), free(d_emb), free(emb_before), free(emb), free(d_table);
}

static void time_embeddings(int N, int model_channels, int rows) {
    int D = 4 * model_channels;
    int64_t *t = (int64_t *)malloc_or_die(N * sizeof(int64_t));
    int *labels = (int *)malloc_or_die(N * sizeof(int));
    for (int n = 0; n < N; n++) t[n] = dev_random_int(1000), labels[n] = (int)dev_random_int(rows);
    TimestepRun tr = {(floatX *)gpu_malloc((size_t)N * model_channels * sizeof(floatX)), (int64_t *)gpu_malloc(N * sizeof(int64_t)),
                      NULL, N, model_channels};
    cuda_check(cudaMemcpy(tr.t, t, N * sizeof(int64_t), cudaMemcpyHostToDevice));
    double ms = dev_time_ms(timestep_run, &tr);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d dim %d", N, model_channels);
    dev_timing_row("timestep", shape, ms, -1, dev_finite_x(tr.e, (size_t)N * model_channels));

    size_t n = (size_t)N * D;
    SiluRun sr = {(floatX *)gpu_malloc(n * sizeof(floatX)), dev_random_x(n, -6, 6), (floatX *)gpu_malloc(n * sizeof(floatX)),
                  dev_random_x(n, -1, 1), (int64_t)n};
    cuda_check(cudaMemsetAsync(sr.dx, 0, n * sizeof(floatX), gpu.stream));
    double f = dev_time_ms(silu_run_forward, &sr), b = dev_time_ms(silu_run_backward, &sr);
    snprintf(shape, sizeof shape, "n %zu (N%d x %d)", n, N, D);
    dev_timing_row("silu", shape, f, b, dev_finite_x(sr.y, n) && dev_finite_x(sr.dx, n));

    LabelRun lr = {dev_random_x(n, -1, 1), dev_random_x(n, -1, 1), dev_random_f((size_t)rows * D, -2, 2),
                   (float *)gpu_malloc((size_t)rows * D * sizeof(float)), (int *)gpu_malloc(N * sizeof(int)), N, rows, D};
    cuda_check(cudaMemcpy(lr.labels, labels, N * sizeof(int), cudaMemcpyHostToDevice));
    f = dev_time_ms(label_run_forward, &lr), b = dev_time_ms(label_run_backward, &lr);
    snprintf(shape, sizeof shape, "N%d %d rows dim %d", N, rows, D);
    dev_timing_row("label_emb", shape, f, b, dev_finite_x(lr.emb, n) && dev_finite_f(lr.d_table, (size_t)rows * D));
    dev_gpu_free(tr.e, tr.t, sr.y, sr.x, sr.dx, sr.dy, lr.emb, lr.d_emb, lr.table, lr.d_table, lr.labels, NULL);
    free(t), free(labels);
}

int main(void) {
    dev_begin("embedding");
    check_timestep(1, 64, 0);
    check_timestep(3, 33, 0);     // odd: ends in a zero
    check_timestep(32, 160, 0);
    check_timestep(32, 160, 1);   // EDM's c_noise
    check_timestep(3, 33, 1);
    check_silu(1);
    check_silu(3 * 256);
    check_silu(100003);
    check_label(1, 1, 256);
    check_label(32, 10, 256);  // repeated labels add up
    check_label(3, 1000, 640); // rows no label picks stay zero
    time_embeddings(32, 64, 1000);
    return dev_end();
}
#endif  // DEV_NO_MAIN
