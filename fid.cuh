// fid.cuh: the statistics of features (mean, covariance), the Fréchet distance and k-NN precision and
// recall on the GPU (cuSOLVER; in double where metrics.h, their CPU reference, is). Needs only
// gpu.cuh; train_unet.cu includes it at its top (one translation unit).
#include <cusolverDn.h>

// ---- statistics, the Fréchet distance, precision and recall (double where metrics.h is) ----

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

// Precision and recall: squared distances |x|^2 + |y|^2 - 2 x.y (clamped at 0, as guided-diffusion's
// ManifoldEstimator computes them, in fp32), a chunk of rows against all of the other set's at a time.
#define MANIFOLD_MAX_K 7

// norms[r] = |x_r|^2.
__global__ void squared_norms_kernel(float *norms, const float *x, int64_t rows, int dim) {
    for (int64_t r = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; r < rows; r += (int64_t)gridDim.x * blockDim.x) {
        float sum = 0.0f;
        for (int d = 0; d < dim; d++) sum += x[r * dim + d] * x[r * dim + d];
        norms[r] = sum;
    }
}

// One block a row of dots[rows][cols] (x_r . y_c, x and y one set): radii[r] = the (k+1)-th smallest
// squared distance of row r (its own 0 first): manifold_radii's radius.
__global__ void manifold_radii_kernel(float *radii, const float *dots, const float *x_norms, const float *y_norms, int64_t cols, int k) {
    __shared__ float best[256][MANIFOLD_MAX_K + 1];
    int64_t row = blockIdx.x;
    const float *d = dots + row * cols;
    float mine[MANIFOLD_MAX_K + 1];
    for (int q = 0; q <= k; q++) mine[q] = INFINITY;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        float dist = fmaxf(x_norms[row] + y_norms[c] - 2.0f * d[c], 0.0f);
        for (int q = 0; q <= k; q++)  // insert into the sorted k + 1 smallest
            if (dist < mine[q]) {
                float t = mine[q];
                mine[q] = dist, dist = t;
            }
    }
    for (int q = 0; q <= k; q++) best[threadIdx.x][q] = mine[q];
    __syncthreads();
    if (threadIdx.x != 0) return;
    for (int t = 1; t < blockDim.x; t++)
        for (int q = 0; q <= k; q++) {
            float dist = best[t][q];
            for (int p = 0; p <= k; p++)
                if (dist < mine[p]) {
                    float s = mine[p];
                    mine[p] = dist, dist = s;
                }
        }
    radii[row] = mine[k];
}

// One block a row of dots[rows][cols] between the references x and the samples y, both ways at once:
// row_inside[r] = 1 when reference r lies in the samples' manifold (some distance at most that
// sample's radius: recall), col_inside[c] = 1 when sample c lies in the references' (at most the
// reference's radius: precision). col_inside, zeroed before, is only ever set to 1, by any block: no
// order matters.
__global__ void manifold_cross_kernel(unsigned char *row_inside, unsigned char *col_inside, const float *dots, const float *x_norms,
                                      const float *y_norms, int64_t cols, const float *row_radii, const float *col_radii) {
    int64_t row = blockIdx.x;
    const float *d = dots + row * cols;
    float radius = row_radii[row];
    int found = 0;
    for (int64_t c = threadIdx.x; c < cols; c += blockDim.x) {
        float dist = fmaxf(x_norms[row] + y_norms[c] - 2.0f * d[c], 0.0f);
        found |= dist <= col_radii[c];
        if (dist <= radius) col_inside[c] = 1;
    }
    found = __syncthreads_or(found);
    if (threadIdx.x == 0) row_inside[row] = (unsigned char)found;
}

// dots[m][n_y] = rows first .. first + m - 1 of x against all of y's: x_chunk y^T (fp32).
static void manifold_dots(float *dots, const float *x, int64_t first, int64_t m, const float *y, int64_t n_y, int dim) {
    float one = 1.0f, zero = 0.0f;
    cublas_check(cublasSgemm(gpu.blas, CUBLAS_OP_T, CUBLAS_OP_N, (int)n_y, (int)m, dim, &one, y, dim, x + first * dim, dim, &zero, dots,
                             (int)n_y));
}

// Each row's radius among its own set (n rows of x on the GPU), a chunk of rows at a time.
static void manifold_radii(float *radii, const float *x, const float *norms, int64_t n, int dim, int k, float *dots, int64_t chunk) {
    for (int64_t first = 0; first < n; first += chunk) {
        int64_t m = n - first < chunk ? n - first : chunk;
        manifold_dots(dots, x, first, m, x, n, dim);
        manifold_radii_kernel<<<(unsigned)m, 256, 0, gpu.stream>>>(radii + first, dots, norms + first, norms, n, k);
        cuda_check_launch();
    }
}

// The references (set 0) against the samples (set 1), a chunk of references at a time: inside[s][i]
// set to 1 when item i of set s lies in the other set's manifold (inside zeroed before).
static void manifold_cross(unsigned char *const inside[2], const float *const features[2], const float *const norms[2],
                           const int64_t counts[2], const float *const radii[2], int dim, float *dots, int64_t chunk) {
    for (int64_t first = 0; first < counts[0]; first += chunk) {
        int64_t m = counts[0] - first < chunk ? counts[0] - first : chunk;
        manifold_dots(dots, features[0], first, m, features[1], counts[1], dim);
        manifold_cross_kernel<<<(unsigned)m, 256, 0, gpu.stream>>>(inside[0] + first, inside[1], dots, norms[0] + first, norms[1], counts[1],
                                                                    radii[0] + first, radii[1]);
        cuda_check_launch();
    }
}

extern "C" int unet_precision_recall(const float *ref, int64_t n_ref, const float *sample, int64_t n_sample, int dim, int k,
                                     double *precision, double *recall, char *err, size_t err_len) {
    if (k < 1 || k > MANIFOLD_MAX_K) return error_line(err, err_len, "precision and recall take k in 1..%d, not %d", MANIFOLD_MAX_K, k);
    if (n_ref <= k || n_sample <= k)
        return error_line(err, err_len, "precision and recall need more than k = %d images in each set, not %lld and %lld", k,
                          (long long)n_ref, (long long)n_sample);
    if (api_gpu_ready(err, err_len) != 0) return -1;
    const float *sets[2] = {ref, sample};
    int64_t counts[2] = {n_ref, n_sample};
    float *features[2], *norms[2], *radii[2];
    unsigned char *inside[2];
    for (int s = 0; s < 2; s++) {
        features[s] = (float *)gpu_malloc(counts[s] * dim * sizeof(float));
        norms[s] = (float *)gpu_malloc(counts[s] * sizeof(float));
        radii[s] = (float *)gpu_malloc(counts[s] * sizeof(float));
        inside[s] = (unsigned char *)gpu_malloc(counts[s]);
        cuda_check(cudaMemsetAsync(inside[s], 0, counts[s], gpu.stream));
        cuda_check(cudaMemcpyAsync(features[s], sets[s], counts[s] * dim * sizeof(float), cudaMemcpyHostToDevice, gpu.stream));
        squared_norms_kernel<<<blocks_for(counts[s], 256), 256, 0, gpu.stream>>>(norms[s], features[s], counts[s], dim);
        cuda_check_launch();
    }
    int64_t widest = n_ref > n_sample ? n_ref : n_sample, chunk = ((int64_t)64 << 20) / widest;  // 256 MB of dots
    if (chunk < 1) chunk = 1;
    float *dots = (float *)gpu_malloc(chunk * widest * sizeof(float));
    for (int s = 0; s < 2; s++) manifold_radii(radii[s], features[s], norms[s], counts[s], dim, k, dots, chunk);
    // the references against the samples, once: samples in the references' manifold (precision), references in the samples' (recall)
    manifold_cross(inside, features, norms, counts, radii, dim, dots, chunk);
    int64_t hits[2] = {0, 0};
    for (int s = 0; s < 2; s++) {
        unsigned char *h = (unsigned char *)malloc_or_die(counts[s]);
        cuda_check(cudaMemcpyAsync(h, inside[s], counts[s], cudaMemcpyDeviceToHost, gpu.stream));
        cuda_check(cudaStreamSynchronize(gpu.stream));
        for (int64_t i = 0; i < counts[s]; i++) hits[s] += h[i];
        free(h);
        cudaFree(features[s]), cudaFree(norms[s]), cudaFree(radii[s]), cudaFree(inside[s]);
    }
    cudaFree(dots);
    *precision = (double)hits[1] / (double)n_sample;
    *recall = (double)hits[0] / (double)n_ref;
    return 0;
}
