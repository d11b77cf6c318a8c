// dev/concat.cu: the UNet decoder's skip connections: channel concatenation of the running
// activation a [P][Ca] and the skip b [P][Cb] (P = N H W pixels, NHWC). CPU reference in double.
// (The residuals' gradients are added by GroupNorm's backward: dev/groupnorm.cu checks them.)
#include "common.h"

// y[p] = [a[p][0 .. Ca) | b[p][0 .. Cb)]
static void ref_concat_forward(double *y, const double *a, const double *b, size_t P, int Ca, int Cb) {
    for (size_t p = 0; p < P; p++) {
        for (int c = 0; c < Ca; c++) y[p * (Ca + Cb) + c] = a[p * Ca + c];
        for (int c = 0; c < Cb; c++) y[p * (Ca + Cb) + Ca + c] = b[p * Cb + c];
    }
}

// da[p][c] += dy[p][c];  db[p][c] += dy[p][Ca + c]
static void ref_concat_backward(double *da, double *db, const double *dy, size_t P, int Ca, int Cb) {
    for (size_t p = 0; p < P; p++) {
        for (int c = 0; c < Ca; c++) da[p * Ca + c] += dy[p * (Ca + Cb) + c];
        for (int c = 0; c < Cb; c++) db[p * Cb + c] += dy[p * (Ca + Cb) + Ca + c];
    }
}

#ifndef DEV_NO_MAIN
// ----------------------------------------------------------------------------------------------
// GPU check: the trainer's concat_channels (y written whole) and split_channels (da, db each added
// to or written), as the blocks' forward and backward call them.

typedef struct {
    floatX *y, *a, *b, *dy, *da, *db;
    int64_t P;
    int Ca, Cb;
    GradMode a_mode, b_mode;
} ConcatRun;

static void concat_run_forward(void *p) {
    ConcatRun *r = (ConcatRun *)p;
    concat_channels(r->y, r->a, r->b, r->P, r->Ca, r->Cb);
}

static void concat_run_backward(void *p) {
    ConcatRun *r = (ConcatRun *)p;
    split_channels(r->da, r->a_mode, r->db, r->b_mode, r->dy, r->P, r->Ca, r->Cb);
}

static void check_concat(int N, int H, int W, int Ca, int Cb, GradMode a_mode, GradMode b_mode) {
    size_t P = (size_t)N * H * W, na = P * Ca, nb = P * Cb, ny = P * (Ca + Cb);
    double *a = dev_alloc(na), *b = dev_alloc(nb), *dy = dev_alloc(ny), *y = dev_alloc(ny);
    double *da = dev_alloc(na), *db = dev_alloc(nb), *da_before = dev_alloc(na), *db_before = dev_alloc(nb);
    dev_fill_x(a, na, -1, 1), dev_fill_x(b, nb, -1, 1), dev_fill_x(dy, ny, -1, 1);
    dev_fill_x(da_before, na, -1, 1), dev_fill_x(db_before, nb, -1, 1);
    ref_concat_forward(y, a, b, P, Ca, Cb);
    ref_concat_backward(da, db, dy, P, Ca, Cb);
    floatX *da_gpu = a_mode == GRAD_ADD ? dev_upload_x(da_before, na) : (floatX *)dev_gpu_poisoned(na * sizeof(floatX));
    floatX *db_gpu = b_mode == GRAD_ADD ? dev_upload_x(db_before, nb) : (floatX *)dev_gpu_poisoned(nb * sizeof(floatX));
    ConcatRun r = {(floatX *)dev_gpu_poisoned(ny * sizeof(floatX)), dev_upload_x(a, na), dev_upload_x(b, nb), dev_upload_x(dy, ny),
                   da_gpu, db_gpu, (int64_t)P, Ca, Cb, a_mode, b_mode};
    concat_run_forward(&r);
    concat_run_backward(&r);
    double tol = DEV_TOLERANCE, fwd = dev_check_x(r.y, NULL, y, ny);
    DevErrors e;
    dev_errors_init(&e);
    dev_errors_add(&e, "da", dev_check_x(r.da, a_mode == GRAD_ADD ? da_before : NULL, da, na), tol);
    dev_errors_add(&e, "db", dev_check_x(r.db, b_mode == GRAD_ADD ? db_before : NULL, db, nb), tol);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d %d+%d da %s db %s", N, H, W, Ca, Cb, a_mode == GRAD_ADD ? "+=" : "=",
             b_mode == GRAD_ADD ? "+=" : "=");
    dev_row("concat", shape, fwd, tol, &e, -1, -1);
    dev_gpu_free(r.y, r.a, r.b, r.dy, r.da, r.db, NULL);
    free(a), free(b), free(dy), free(y), free(da), free(db), free(da_before), free(db_before);
}

static void time_concat(int N, int H, int W, int Ca, int Cb) {
    size_t P = (size_t)N * H * W, na = P * Ca, nb = P * Cb, ny = P * (Ca + Cb);
    ConcatRun r = {(floatX *)gpu_malloc(ny * sizeof(floatX)), dev_random_x(na, -1, 1), dev_random_x(nb, -1, 1),
                   dev_random_x(ny, -1, 1), (floatX *)gpu_malloc(na * sizeof(floatX)), (floatX *)gpu_malloc(nb * sizeof(floatX)),
                   (int64_t)P, Ca, Cb, GRAD_ADD, GRAD_ADD};
    cuda_check(cudaMemsetAsync(r.da, 0, na * sizeof(floatX), gpu.stream));
    cuda_check(cudaMemsetAsync(r.db, 0, nb * sizeof(floatX), gpu.stream));
    double fwd = dev_time_ms(concat_run_forward, &r), bwd = dev_time_ms(concat_run_backward, &r);
    char shape[96];
    snprintf(shape, sizeof shape, "N%d %dx%d %d+%d", N, H, W, Ca, Cb);
    dev_timing_row("concat", shape, fwd, bwd, dev_finite_x(r.y, ny) && dev_finite_x(r.da, na) && dev_finite_x(r.db, nb));
    dev_gpu_free(r.y, r.a, r.b, r.dy, r.da, r.db, NULL);
}

int main(void) {
    dev_begin("concat");
    check_concat(1, 7, 7, 64, 64, GRAD_ADD, GRAD_ADD);
    check_concat(3, 13, 13, 96, 160, GRAD_WRITE, GRAD_WRITE);  // as in the model: both written
    check_concat(2, 1, 1, 256, 192, GRAD_WRITE, GRAD_ADD);
    check_concat(3, 5, 3, 3, 5, GRAD_ADD, GRAD_WRITE);         // narrow, odd
    check_concat(2, 3, 3, 8, 3, GRAD_WRITE, GRAD_WRITE);       // one count a multiple of PACK, the other not
    time_concat(32, 64, 64, 64, 64);
    return dev_end();
}
#endif  // DEV_NO_MAIN
