// fid.cuh: the statistics of features (mean, covariance), the Fréchet distance and k-NN precision and
// recall on the GPU (cuSOLVER; in double where metrics.h, their CPU reference, is; precision and
// recall's distances in the evaluator's fp16, fp32 where they are not finite). Needs only gpu.cuh;
// train_unet.cu includes it at its top (one translation unit).
#include <cusolverDn.h>

// ---- statistics and the Fréchet distance (double where metrics.h is) ----

static cusolverDnHandle_t solver;

static void cusolver_check_(cusolverStatus_t status, const char *what, const char *file, int line) {
    if (status != CUSOLVER_STATUS_SUCCESS) fatal("cuSOLVER: status %d (%s at %s:%d)", (int)status, what, file, line);
}
#define cusolver_check(call) cusolver_check_((call), #call, __FILE__, __LINE__)

// column_sums[d] += sum over the rows of x[rows][dim] of x[r][d], in double, rows in order.
__global__ void column_sums_kernel(double *column_sums, const float *x, int64_t rows, int dim) {
    int d = blockIdx.x * blockDim.x + threadIdx.x;
    if (d >= dim) return;
    double sum = 0;
    for (int64_t r = 0; r < rows; r++) sum += x[r * dim + d];
    column_sums[d] += sum;
}

// centred[r][d] = x[r][d] - mean[d], in double.
__global__ void centre_kernel(double *centred, const float *x, const double *mean, int64_t rows, int dim) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < rows * dim; i += (int64_t)gridDim.x * blockDim.x)
        centred[i] = x[i] - mean[i % dim];
}

// The lower triangle of a symmetric dim x dim matrix (column-major, as DSYRK leaves it) copied to
// the upper one, every entry times `scale`.
__global__ void symmetrise_kernel(double *a, int dim, double scale) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)dim * dim; i += (int64_t)gridDim.x * blockDim.x) {
        int row = (int)(i % dim), col = (int)(i / dim);
        if (row < col) continue;
        double v = a[i] * scale;
        a[i] = v, a[(int64_t)row * dim + col] = v;
    }
}

#define STATISTICS_CHUNK_ROWS 8192

// metrics.h's feature_statistics on the GPU: the mean in double, then the centred products summed
// by DSYRK over chunks of rows, divided by n - 1.
extern "C" int unet_feature_statistics(const float *features, int64_t n, int dim, double *mean, double *cov, char *err, size_t err_len) {
    if (n < 2) return error_line(err, err_len, "statistics need at least 2 feature rows, not %lld", (long long)n);
    if (api_gpu_ready(err, err_len) != 0) return -1;
    int64_t chunk = n < STATISTICS_CHUNK_ROWS ? n : STATISTICS_CHUNK_ROWS;
    float *rows = (float *)gpu_malloc(chunk * dim * sizeof(float));
    double *centred = (double *)gpu_malloc(chunk * dim * sizeof(double)), *d_mean = (double *)gpu_malloc(dim * sizeof(double));
    double *d_cov = (double *)gpu_malloc((size_t)dim * dim * sizeof(double));
    cuda_check(cudaMemsetAsync(d_mean, 0, dim * sizeof(double), gpu.stream));
    for (int pass = 0; pass < 2; pass++) {
        for (int64_t first = 0; first < n; first += chunk) {
            int64_t m = n - first < chunk ? n - first : chunk;
            cuda_check(cudaMemcpyAsync(rows, features + first * dim, m * dim * sizeof(float), cudaMemcpyHostToDevice, gpu.stream));
            if (pass == 0) {
                column_sums_kernel<<<(dim + 255) / 256, 256, 0, gpu.stream>>>(d_mean, rows, m, dim);
                cuda_check_launch();
                continue;
            }
            centre_kernel<<<blocks_for(m * dim, 256), 256, 0, gpu.stream>>>(centred, rows, d_mean, m, dim);
            cuda_check_launch();
            double one = 1.0, beta = first == 0 ? 0.0 : 1.0;
            cublas_check(cublasDsyrk(gpu.blas, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, dim, (int)m, &one, centred, dim, &beta, d_cov, dim));
        }
        if (pass == 0) {
            cuda_check(cudaMemcpyAsync(mean, d_mean, dim * sizeof(double), cudaMemcpyDeviceToHost, gpu.stream));
            cuda_check(cudaStreamSynchronize(gpu.stream));
            for (int d = 0; d < dim; d++) mean[d] /= (double)n;
            cuda_check(cudaMemcpyAsync(d_mean, mean, dim * sizeof(double), cudaMemcpyHostToDevice, gpu.stream));
        }
    }
    symmetrise_kernel<<<blocks_for((int64_t)dim * dim, 256), 256, 0, gpu.stream>>>(d_cov, dim, 1.0 / (double)(n - 1));
    cuda_check_launch();
    cuda_check(cudaMemcpyAsync(cov, d_cov, (size_t)dim * dim * sizeof(double), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cudaFree(rows), cudaFree(centred), cudaFree(d_mean), cudaFree(d_cov);
    return 0;
}

// The columns of v (column-major, n x n) times w_k^(1/2) each, w_k taken as 0 below n eps of the
// largest (symmetric_sqrt's cut-off): with root = scaled v^T, V diag(sqrt w) V^T.
__global__ void scale_eigenvectors_kernel(double *scaled, const double *v, const double *w, int n) {
    double largest = w[n - 1];  // syevd's eigenvalues ascend
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)n * n; i += (int64_t)gridDim.x * blockDim.x) {
        double wk = w[i / n];
        scaled[i] = wk > n * DBL_EPSILON * largest ? v[i] * sqrt(wk) : 0.0;
    }
}

// root = sqrt(s) (n x n, symmetric positive semi-definite) as metrics.h's symmetric_sqrt: s's
// eigenvectors by cuSOLVER's DSYEVD, then V diag(sqrt w) V^T. work: 2 n^2 doubles, plus cuSOLVER's.
static void gpu_symmetric_sqrt(double *root, const double *s, int n, double *work, double *w, int *info) {
    double *vectors = work, *scaled = work + (size_t)n * n;
    cuda_check(cudaMemcpyAsync(vectors, s, (size_t)n * n * sizeof(double), cudaMemcpyDeviceToDevice, gpu.stream));
    int lwork = 0;
    cusolver_check(cusolverDnDsyevd_bufferSize(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, vectors, n, w, &lwork));
    double *solver_work = (double *)gpu_malloc((size_t)lwork * sizeof(double));
    cusolver_check(cusolverDnDsyevd(solver, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, vectors, n, w, solver_work, lwork, info));
    scale_eigenvectors_kernel<<<blocks_for((int64_t)n * n, 256), 256, 0, gpu.stream>>>(scaled, vectors, w, n);
    cuda_check_launch();
    double one = 1.0, zero = 0.0;
    cublas_check(cublasDgemm(gpu.blas, CUBLAS_OP_N, CUBLAS_OP_T, n, n, n, &one, scaled, n, vectors, n, &zero, root, n));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    cudaFree(solver_work);
}

// metrics.h's frechet_distance on the GPU: the sum of the singular values of sqrt(s1) sqrt(s2) by
// cuSOLVER's DGESVD (values only).
extern "C" int unet_frechet_distance(const double *mu1, const double *s1, const double *mu2, const double *s2, int dim, double *distance,
                                     char *err, size_t err_len) {
    if (api_gpu_ready(err, err_len) != 0) return -1;
    if (!solver) {
        cusolver_check(cusolverDnCreate(&solver));
        cusolver_check(cusolverDnSetStream(solver, gpu.stream));
    }
    size_t nn = (size_t)dim * dim;
    double *d_s = (double *)gpu_malloc(nn * sizeof(double)), *roots = (double *)gpu_malloc(2 * nn * sizeof(double));
    double *work = (double *)gpu_malloc(2 * nn * sizeof(double)), *w = (double *)gpu_malloc(2 * (size_t)dim * sizeof(double));
    int *info = (int *)gpu_malloc(3 * sizeof(int)), h_info[3];
    for (int k = 0; k < 2; k++) {
        cuda_check(cudaMemcpyAsync(d_s, k ? s2 : s1, nn * sizeof(double), cudaMemcpyHostToDevice, gpu.stream));
        gpu_symmetric_sqrt(roots + k * nn, d_s, dim, work, w, info + k);
    }
    double one = 1.0, zero = 0.0;  // product = R1 R2
    cublas_check(cublasDgemm(gpu.blas, CUBLAS_OP_N, CUBLAS_OP_N, dim, dim, dim, &one, roots, dim, roots + nn, dim, &zero, work, dim));
    int lwork = 0;
    cusolver_check(cusolverDnDgesvd_bufferSize(solver, dim, dim, &lwork));
    double *solver_work = (double *)gpu_malloc((size_t)lwork * sizeof(double));
    cusolver_check(cusolverDnDgesvd(solver, 'N', 'N', dim, dim, work, dim, w, NULL, dim, NULL, dim, solver_work, lwork, w + dim, info + 2));
    double *singular = (double *)malloc_or_die(dim * sizeof(double));
    cuda_check(cudaMemcpyAsync(singular, w, dim * sizeof(double), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaMemcpyAsync(h_info, info, 3 * sizeof(int), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    int r = 0;
    if (h_info[0] != 0 || h_info[1] != 0 || h_info[2] != 0) r = error_line(err, err_len, "the Fréchet distance's eigen- or singular values did not converge");
    double d = 0;
    for (int i = 0; i < dim; i++) d += (mu1[i] - mu2[i]) * (mu1[i] - mu2[i]) + s1[(size_t)i * dim + i] + s2[(size_t)i * dim + i] - 2 * singular[i];
    *distance = d;
    free(singular);
    cudaFree(d_s), cudaFree(roots), cudaFree(work), cudaFree(w), cudaFree(info), cudaFree(solver_work);
    return r;
}

// ---- precision and recall: guided-diffusion's ManifoldEstimator, its distances as its DistanceBlock's ----
// Squared distances a block of block x block at a time (the evaluator's 10,000), as metrics.h's
// manifold_distances: in fp16 (h: rounded to fp16), the features cast to fp16,
//   |x|^2 = h(sum_i h(x_i^2))             (the squares summed in double, rounded once)
//   x.y   = h(x . y)                      (cuBLAS: fp16 operands, fp32 accumulation; rounded here)
//   d     = max(h(h(|x|^2 - h(2 x.y)) + |y|^2), 0)
// or, when any d of the block is not finite (a feature or a norm past fp16's 65504), the whole block
// again with fp32's rounding (its product by cuBLAS in fp32, no TF32). A row's radius is its (k+1)-th
// smallest distance to its own set (its own distance among them), merged block by block.
#define MANIFOLD_MAX_K 7

// A feature set on the GPU: its rows in fp32 and in fp16, their squared norms in each, its rows'
// k + 1 smallest distances so far (best [count][k + 1], ascending) and radii, and whether each row
// lies in the other set's manifold.
typedef struct {
    float *rows, *norms32, *best, *radii;
    __half *halves, *norms16;
    unsigned char *inside;
    int64_t count;
} ManifoldSet;

// A warp a row of x [rows][dim]: halves = h(x), norms16 = h(sum_i h(h(x_i)^2)), norms32 =
// f(sum_i f(x_i^2)), the sums in double (each lane's, then a fixed shuffle tree).
__global__ void manifold_rows_kernel(__half *halves, __half *norms16, float *norms32, const float *x, int64_t rows, int dim) {
    int lane = threadIdx.x % 32;
    for (int64_t row = (blockIdx.x * (int64_t)blockDim.x + threadIdx.x) / 32; row < rows; row += (int64_t)gridDim.x * blockDim.x / 32) {
        double sum16 = 0, sum32 = 0;
        for (int i = lane; i < dim; i += 32) {
            float v = x[row * dim + i];
            __half h = __float2half_rn(v);
            halves[row * dim + i] = h;
            sum16 += __half2float(__hmul_rn(h, h));
            sum32 += __fmul_rn(v, v);
        }
        for (int offset = 16; offset > 0; offset /= 2) {
            sum16 += __shfl_down_sync(0xffffffff, sum16, offset);
            sum32 += __shfl_down_sync(0xffffffff, sum32, offset);
        }
        if (lane == 0) norms16[row] = __double2half(sum16), norms32[row] = __double2float_rn(sum32);
    }
}

// d [m][n] holds a block's products x.y in fp32; each becomes its fp16 distance
// max(h(h(|x|^2 - h(2 h(x.y))) + |y|^2), 0) as a float (a NaN stays NaN, as in tf.maximum).
// *nonfinite = 1 where one is not finite (set by any thread, never cleared: no order matters).
__global__ void manifold_half_distances_kernel(float *d, int64_t m, int64_t n, const __half *x_norms, const __half *y_norms, int *nonfinite) {
    const __half two = __float2half_rn(2.0f);
    int found = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * n; i += (int64_t)gridDim.x * blockDim.x) {
        __half dot = __float2half_rn(d[i]);
        float dist = __half2float(__hadd_rn(__hsub_rn(x_norms[i / n], __hmul_rn(two, dot)), y_norms[i % n]));
        d[i] = dist < 0.0f ? 0.0f : dist;  // -inf too (2 x.y past fp16's range, the norms not): 0, finite
        found |= !isfinite(d[i]);
    }
    if (found) *nonfinite = 1;
}

// d [m][n] holds a block's products x.y in fp32; each becomes max(f(f(|x|^2 - 2 x.y) + |y|^2), 0).
__global__ void manifold_float_distances_kernel(float *d, int64_t m, int64_t n, const float *x_norms, const float *y_norms) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < m * n; i += (int64_t)gridDim.x * blockDim.x) {
        float dist = __fadd_rn(__fsub_rn(x_norms[i / n], __fmul_rn(2.0f, d[i])), y_norms[i % n]);
        d[i] = dist < 0.0f ? 0.0f : dist;
    }
}

// One CUDA block a row of a block of distances d [rows][n], a row of a set against n of its rows:
// merges them into best (the row's k + 1 smallest so far, ascending; none when fresh); radius =
// the (k+1)-th, the row's radius once every block of its row is in.
__global__ void manifold_radii_kernel(float *radii, float *best, const float *d, int64_t n, int k, int fresh) {
    __shared__ float others[256][MANIFOLD_MAX_K + 1];
    int64_t row = blockIdx.x;
    const float *dist = d + row * n;
    float mine[MANIFOLD_MAX_K + 1];
    for (int q = 0; q <= k; q++) mine[q] = threadIdx.x == 0 && !fresh ? best[row * (k + 1) + q] : INFINITY;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
        float x = dist[c];
        for (int q = 0; q <= k; q++)  // insert into the sorted k + 1 smallest
            if (x < mine[q]) {
                float t = mine[q];
                mine[q] = x, x = t;
            }
    }
    for (int q = 0; q <= k; q++) others[threadIdx.x][q] = mine[q];
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int t = 1; t < blockDim.x; t++)
        for (int q = 0; q <= k; q++) {
            float x = others[t][q];
            for (int p = 0; p <= k; p++)
                if (x < mine[p]) {
                    float s = mine[p];
                    mine[p] = x, x = s;
                }
        }
    for (int q = 0; q <= k; q++) best[row * (k + 1) + q] = mine[q];
    radii[row] = mine[k];
}

// One CUDA block a row of a block of distances d [rows][n] between references (rows) and samples
// (columns), both ways at once: row_inside[r] = 1 when reference r lies within some sample's radius
// (recall), col_inside[c] = 1 when sample c lies within the reference's radius (precision). Both only
// ever set to 1, by any block of any column block: no order matters.
__global__ void manifold_cross_kernel(unsigned char *row_inside, unsigned char *col_inside, const float *d, int64_t n, const float *row_radii,
                                      const float *col_radii) {
    int64_t row = blockIdx.x;
    const float *dist = d + row * n;
    float radius = row_radii[row];
    int found = 0;
    for (int64_t c = threadIdx.x; c < n; c += blockDim.x) {
        found |= dist[c] <= col_radii[c];
        if (dist[c] <= radius) col_inside[c] = 1;
    }
    found = __syncthreads_or(found);
    if (threadIdx.x == 0 && found) row_inside[row] = 1;
}

// A set of count feature rows (host memory) on the GPU, with its fp16 rows and norms; k + 1 distances kept a row.
static void manifold_set_open(ManifoldSet *s, const float *features, int64_t count, int dim, int k) {
    s->count = count;
    s->rows = (float *)gpu_malloc(count * dim * sizeof(float));
    s->halves = (__half *)gpu_malloc(count * dim * sizeof(__half));
    s->norms32 = (float *)gpu_malloc(count * sizeof(float));
    s->norms16 = (__half *)gpu_malloc(count * sizeof(__half));
    s->best = (float *)gpu_malloc(count * (k + 1) * sizeof(float));
    s->radii = (float *)gpu_malloc(count * sizeof(float));
    s->inside = (unsigned char *)gpu_malloc(count);
    cuda_check(cudaMemsetAsync(s->inside, 0, count, gpu.stream));
    cuda_check(cudaMemcpyAsync(s->rows, features, count * dim * sizeof(float), cudaMemcpyHostToDevice, gpu.stream));
    manifold_rows_kernel<<<blocks_for(count * 32, 256), 256, 0, gpu.stream>>>(s->halves, s->norms16, s->norms32, s->rows, count, dim);
    cuda_check_launch();
}

static void manifold_set_close(ManifoldSet *s) {
    cudaFree(s->rows), cudaFree(s->halves), cudaFree(s->norms32), cudaFree(s->norms16), cudaFree(s->best), cudaFree(s->radii);
    cudaFree(s->inside);
}

// The distances of x's rows x0 .. x0 + m - 1 against y's rows y0 .. y0 + n - 1 into d [m][n]: fp16's,
// or fp32's when one of fp16's is not finite (nonfinite: an int on the GPU; read back once a block).
// Returns 1 when the block is fp32's, else 0.
static int manifold_block(float *d, const ManifoldSet *x, int64_t x0, int64_t m, const ManifoldSet *y, int64_t y0, int64_t n, int dim,
                          int *nonfinite) {
    float one = 1.0f, zero = 0.0f;  // d^T = y_block x_block^T, column-major: d row-major
    cublas_check(cublasGemmEx(gpu.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, dim, &one, y->halves + y0 * dim, CUDA_R_16F, dim,
                              x->halves + x0 * dim, CUDA_R_16F, dim, &zero, d, CUDA_R_32F, (int)n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    cuda_check(cudaMemsetAsync(nonfinite, 0, sizeof(int), gpu.stream));
    manifold_half_distances_kernel<<<blocks_for(m * n, 256), 256, 0, gpu.stream>>>(d, m, n, x->norms16 + x0, y->norms16 + y0, nonfinite);
    cuda_check_launch();
    int fp32 = 0;
    cuda_check(cudaMemcpyAsync(&fp32, nonfinite, sizeof(int), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    if (!fp32) return 0;
    cublas_check(cublasSgemm(gpu.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n, (int)m, dim, &one, y->rows + y0 * dim, dim, x->rows + x0 * dim, dim,
                             &zero, d, (int)n));
    manifold_float_distances_kernel<<<blocks_for(m * n, 256), 256, 0, gpu.stream>>>(d, m, n, x->norms32 + x0, y->norms32 + y0);
    cuda_check_launch();
    return 1;
}

extern "C" int unet_precision_recall(const float *ref, int64_t n_ref, const float *sample, int64_t n_sample, int dim, int k, int block,
                                     double *precision, double *recall, char *err, size_t err_len) {
    if (k < 1 || k > MANIFOLD_MAX_K) return error_line(err, err_len, "precision and recall take k in 1..%d, not %d", MANIFOLD_MAX_K, k);
    if (block < 1) return error_line(err, err_len, "precision and recall's blocks need at least 1 row, not %d", block);
    if (n_ref <= k || n_sample <= k)
        return error_line(err, err_len, "precision and recall need more than k = %d images in each set, not %lld and %lld", k,
                          (long long)n_ref, (long long)n_sample);
    if (api_gpu_ready(err, err_len) != 0) return -1;
    ManifoldSet sets[2];
    manifold_set_open(&sets[0], ref, n_ref, dim, k);
    manifold_set_open(&sets[1], sample, n_sample, dim, k);
    int64_t widest = n_ref > n_sample ? n_ref : n_sample, side = widest < block ? widest : block;
    float *d = (float *)gpu_malloc(side * side * sizeof(float));
    int *nonfinite = (int *)gpu_malloc(sizeof(int));
    for (int s = 0; s < 2; s++) {  // each set's radii: a block of rows against all of the set, block by block
        const ManifoldSet *x = &sets[s];
        for (int64_t x0 = 0; x0 < x->count; x0 += block)
            for (int64_t y0 = 0; y0 < x->count; y0 += block) {
                int64_t m = x->count - x0 < block ? x->count - x0 : block, n = x->count - y0 < block ? x->count - y0 : block;
                manifold_block(d, x, x0, m, x, y0, n, dim, nonfinite);
                manifold_radii_kernel<<<(unsigned)m, 256, 0, gpu.stream>>>(x->radii + x0, x->best + x0 * (k + 1), d, n, k, y0 == 0);
                cuda_check_launch();
            }
    }
    // the references against the samples, once: samples in the references' manifold (precision), references in the samples' (recall)
    for (int64_t x0 = 0; x0 < n_ref; x0 += block)
        for (int64_t y0 = 0; y0 < n_sample; y0 += block) {
            int64_t m = n_ref - x0 < block ? n_ref - x0 : block, n = n_sample - y0 < block ? n_sample - y0 : block;
            manifold_block(d, &sets[0], x0, m, &sets[1], y0, n, dim, nonfinite);
            manifold_cross_kernel<<<(unsigned)m, 256, 0, gpu.stream>>>(sets[0].inside + x0, sets[1].inside + y0, d, n, sets[0].radii + x0,
                                                                        sets[1].radii + y0);
            cuda_check_launch();
        }
    int64_t hits[2] = {0, 0};
    for (int s = 0; s < 2; s++) {
        unsigned char *h = (unsigned char *)malloc_or_die(sets[s].count);
        cuda_check(cudaMemcpyAsync(h, sets[s].inside, sets[s].count, cudaMemcpyDeviceToHost, gpu.stream));
        cuda_check(cudaStreamSynchronize(gpu.stream));
        for (int64_t i = 0; i < sets[s].count; i++) hits[s] += h[i];
        free(h);
        manifold_set_close(&sets[s]);
    }
    cudaFree(d), cudaFree(nonfinite);
    *precision = (double)hits[1] / (double)n_sample;
    *recall = (double)hits[0] / (double)n_ref;
    return 0;
}
