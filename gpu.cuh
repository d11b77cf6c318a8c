// gpu.cuh: the GPU base of train_unet.cu: the activation type (floatX, Pack), error lines and exits,
// the random streams, host helpers (time, synced files), the GPU context (stream, cuBLAS and cuBLASLt
// handles) and matrix products on the tensor cores. Generic: it knows nothing of the model.
// train_unet.cu includes it at its top (one translation unit, one binary).

// ----------------------------------------------------------------------------------------------
// Precision and error checks

#if defined(PRECISION_FP32)
typedef float floatX;
#define PRECISION_NAME "FP32"
#else
typedef __nv_bfloat16 floatX;
#define PRECISION_NAME "BF16"
#endif

// Kernels move activations 16 bytes at a time (a Pack) where the channel count allows, else
// one element at a time (a Scalar); both have the same shape for templates.
#define PACK (16 / (int)sizeof(floatX))  // elements in 16 bytes
typedef struct {
    floatX v[PACK];
} __align__(16) Pack;
typedef struct {
    floatX v[1];
} Scalar;

// The name error lines start with: the program's own (train_unet, generate, a test or a dev/ check),
// or a rank's ("train_unet rank 1").
static const char *program_name = program_invocation_short_name;

// Prints one error line, "PROGRAM: error: MESSAGE" and a suffix.
static void print_error(const char *suffix, const char *fmt, va_list args) {
    fprintf(stderr, "%s: error: ", program_name);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "%s\n", suffix);
}

// Prints one error line, then exits with `status`.
static void exit_with_error(int status, const char *suffix, const char *fmt, va_list args) __attribute__((noreturn));
static void exit_with_error(int status, const char *suffix, const char *fmt, va_list args) {
    print_error(suffix, fmt, args);
    exit(status);
}

// Prints one error line and exits with status 1: every failure the user can cause ends here (or,
// for a bad command line, in usage_error, with status 2).
static void fatal(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(1, "", fmt, args);
}

// A bad command line: one error line ending in "(see --help)", exit status 2.
static void usage_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(2, " (see --help)", fmt, args);
}

static void cuda_check_(cudaError_t err, const char *what, const char *file, int line) {
    if (err != cudaSuccess) fatal("CUDA: %s (%s at %s:%d)", cudaGetErrorString(err), what, file, line);
}
#define cuda_check(call) cuda_check_((call), #call, __FILE__, __LINE__)
#define cuda_check_launch() cuda_check_(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

static void *malloc_or_die(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) fatal("out of host memory (%zu bytes)", bytes);
    return p;
}

// ----------------------------------------------------------------------------------------------
// Random numbers: counter-based (random.h), so any draw is a pure function of (seed, stream,
// index) and the state to save for an exact resume is only the counters.

// The random streams, all of them: random_u64(seed, stream, index) with stream = purpose << 48 |
// sub-stream (an epoch, a parameter tensor, a layer, a sampling step, each below 2^48), so that
// adding a draw to one purpose never shifts another and no two purposes can ever meet.
typedef enum {
    RNG_SHUFFLE = 1,   // the data order; sub-stream: the epoch
    RNG_FLIP,          // the flips; index: epoch * count + position
    RNG_INIT,          // initialisation; sub-stream: the parameter tensor
    RNG_STEP_SEED,     // index: the step; the step's own seed, from which the next four draw (sub-stream 1: the
                       // seed of a classifier's evaluation after that step)
    RNG_NOISE,         // the training noise eps
    RNG_TIMESTEP,      // the training timesteps
    RNG_LABEL_DROP,    // classifier-free guidance's label dropout
    RNG_DROPOUT,       // dropout; sub-stream: the layer
    RNG_GRID_SEED,     // the seed of the EMA samplers during training; sub-stream 0: the sample grids, 1: FID
    RNG_SAMPLE_START,  // a sampler's starting noise
    RNG_SAMPLE_NOISE,  // a sampler's noise; sub-stream: the step of the plan
    RNG_BENCH_BATCH,   // --bench's fixed random batch: pixels, then labels
    RNG_NLL,           // the likelihood's noise; sub-stream: the kept step
} RandomPurpose;

__host__ __device__ inline uint64_t rng_stream(RandomPurpose purpose, uint64_t sub_stream) {
    return (uint64_t)purpose << 48 | sub_stream;
}

// ----------------------------------------------------------------------------------------------
// Host helpers: the time, and files and folders made durable (synced) before they are relied on.

static double now_seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Syncs a file or folder by name, so that what was written to it, or renamed into it, is durable.
static int fsync_path(const char *path) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    int r = fsync(fd);
    close(fd);
    return r;
}

// The folder that holds path, into parent: its last component removed, trailing slashes ignored
// ("run/" -> ".", "/a/b" -> "/a", "/a" -> "/"). Returns the offset of the last component in path.
static size_t parent_folder(const char *path, char *parent, size_t len) {
    snprintf(parent, len, "%s", path);
    for (size_t n = strlen(parent); n > 1 && parent[n - 1] == '/'; n--) parent[n - 1] = '\0';
    char *slash = strrchr(parent, '/');
    size_t last = slash ? (size_t)(slash - parent) + 1 : 0;
    if (slash == parent) slash[1] = '\0';
    else if (slash) *slash = '\0';
    else snprintf(parent, len, ".");
    return last;
}

// Creates a folder if it is missing and syncs its parent, so that the new name is durable.
// Returns 0, or -1 with errno set.
static int make_dir_synced(const char *path) {
    if (mkdir(path, 0777) != 0) {
        struct stat st;
        if (errno != EEXIST) return -1;
        if (stat(path, &st) == 0 && S_ISDIR(st.st_mode)) return 0;
        errno = ENOTDIR;
        return -1;
    }
    char parent[4096];
    parent_folder(path, parent, sizeof parent);
    return fsync_path(parent);
}

static int write_all(FILE *f, const void *data, size_t bytes) { return fwrite(data, 1, bytes, f) == bytes ? 0 : -1; }

// ----------------------------------------------------------------------------------------------
// The GPU context: the stream kernels are launched on, cuBLAS and cuBLASLt handles and their workspace.

typedef struct {
    cudaStream_t stream;      // where kernels go now: main, or side between side_begin and side_end
    cudaStream_t main, side;  // the side stream runs work beside the main stream's (side_begin)
    cudaStream_t update;      // lowest priority: a step's parameter update beside the next step's forward (Trainer)
    cudaEvent_t fork, join;
    int side_pending;         // side work ended and not yet joined
    cublasHandle_t blas;
    cublasLtHandle_t lt;
    void *workspace;
    size_t workspace_bytes;
    int num_sms;
    int sm90a;  // the code this GPU runs has Hopper's sm_90a instructions (wgmma): the convolutions use them
} Gpu;
static Gpu gpu;

// Writes 1 where the code run was built for sm_90a (an H100 or H200, and a build for it), else 0.
__global__ void sm90a_probe_kernel(int *out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    *out = 1;
#else
    *out = 0;
#endif
}

static const cudaDataType CUDA_FLOATX = sizeof(floatX) == 4 ? CUDA_R_32F : CUDA_R_16BF;

static void cublas_check_(cublasStatus_t status, const char *what, const char *file, int line) {
    if (status != CUBLAS_STATUS_SUCCESS) fatal("cuBLAS: status %d (%s at %s:%d)", (int)status, what, file, line);
}
#define cublas_check(call) cublas_check_((call), #call, __FILE__, __LINE__)

// Every device allocation goes through here, so the footprint can be reported.
static size_t gpu_bytes_allocated;

static void *gpu_malloc(size_t bytes) {
    void *p = NULL;
    cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
    if (err != cudaSuccess) fatal("cannot allocate %.2f GiB on the GPU (%s)", bytes / 1073741824.0, cudaGetErrorString(err));
    gpu_bytes_allocated += bytes;
    return p;
}

// Whether there is a GPU to run on: 0, or -1 with a message. Without a driver the CUDA runtime
// says "driver version is insufficient", which misleads: cudaDriverGetVersion gives 0 then.
static int gpu_available(char *err, size_t err_len) {
    int driver = 0, devices = 0;
    if (cudaDriverGetVersion(&driver) != cudaSuccess || driver == 0)
        return error_line(err, err_len, "no NVIDIA GPU or driver found (no NVIDIA driver is installed)");
    cudaError_t e = cudaGetDeviceCount(&devices);
    if (e == cudaErrorInsufficientDriver)
        return error_line(err, err_len, "the NVIDIA driver supports CUDA %d.%d, older than the CUDA %d.%d this program was built "
                            "with: update the driver", driver / 1000, driver % 1000 / 10, CUDART_VERSION / 1000, CUDART_VERSION % 1000 / 10);
    if (e != cudaSuccess || devices == 0)
        return error_line(err, err_len, "no NVIDIA GPU or driver found (the CUDA runtime says: %s)",
                            e != cudaSuccess ? cudaGetErrorString(e) : "no devices");
    return 0;
}

// Makes GPU `device` ready: its streams, cuBLAS, and whether sm_90a code runs on it. Without a GPU,
// one error line says so.
static void gpu_init(int device) {
    char err[512];
    if (gpu_available(err, sizeof err) != 0) fatal("%s", err);
    cuda_check(cudaSetDevice(device));
    cuda_check(cudaDeviceGetAttribute(&gpu.num_sms, cudaDevAttrMultiProcessorCount, device));
    // The model's work at the highest priority, the update beside it at the lowest: its blocks take
    // what the model's kernels leave of the GPU (a graph keeps the priorities its kernels were
    // captured with when instantiated with cudaGraphInstantiateFlagUseNodePriority: trainer_capture).
    int lowest, highest;
    cuda_check(cudaDeviceGetStreamPriorityRange(&lowest, &highest));
    cuda_check(cudaStreamCreateWithPriority(&gpu.main, cudaStreamDefault, highest));
    cuda_check(cudaStreamCreateWithPriority(&gpu.side, cudaStreamDefault, highest));
    cuda_check(cudaStreamCreateWithPriority(&gpu.update, cudaStreamDefault, lowest));
    cuda_check(cudaEventCreateWithFlags(&gpu.fork, cudaEventDisableTiming));
    cuda_check(cudaEventCreateWithFlags(&gpu.join, cudaEventDisableTiming));
    gpu.stream = gpu.main;
    cublas_check(cublasCreate(&gpu.blas));
    cublas_check(cublasSetStream(gpu.blas, gpu.stream));
    cublas_check(cublasLtCreate(&gpu.lt));
    gpu.workspace_bytes = 64 << 20;
    gpu.workspace = gpu_malloc(gpu.workspace_bytes);
    cublas_check(cublasSetWorkspace(gpu.blas, gpu.workspace, gpu.workspace_bytes));
    sm90a_probe_kernel<<<1, 1, 0, gpu.stream>>>((int *)gpu.workspace);
    cuda_check_launch();
    cuda_check(cudaMemcpyAsync(&gpu.sm90a, gpu.workspace, sizeof(int), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
}

// The GPU made ready for the C API's models (unet_api.h, the evaluator's). Returns 0, or -1 with a message (no GPU).
static int api_gpu_ready(char *err, size_t err_len) {
    if (gpu_available(err, err_len) != 0) return -1;
    if (!gpu.blas) gpu_init(0);
    return 0;
}

// Work beside the main stream, as a fork and a join (also inside a captured graph): between
// side_begin() and side_end() kernels go to the side stream, which starts after everything launched
// on the main stream so far; what the main stream launches next runs beside them, until side_join()
// makes it wait for them (a join with nothing begun since the last one is nothing). Only our own
// kernels go to the side stream: cuBLAS, its handle and its workspace stay on the main stream.
static void side_begin(void) {
    cuda_check(cudaEventRecord(gpu.fork, gpu.main));
    cuda_check(cudaStreamWaitEvent(gpu.side, gpu.fork, 0));
    gpu.stream = gpu.side;
}

static void side_end(void) {
    cuda_check(cudaEventRecord(gpu.join, gpu.side));
    gpu.stream = gpu.main;
    gpu.side_pending = 1;
}

static void side_join(void) {
    if (gpu.side_pending) cuda_check(cudaStreamWaitEvent(gpu.main, gpu.join, 0));
    gpu.side_pending = 0;
}

static int blocks_for(size_t n, int threads) {
    size_t blocks = (n + threads - 1) / threads;
    return (int)(blocks < 65536 * 16 ? blocks : 65536 * 16);
}

// Launches kernel<Pack> when the channel count C allows 16-byte vectors, else kernel<Scalar>, with
// a thread per vector of the `elements` values.
#define LAUNCH_VECTORISED(kernel, elements, C, ...)                                                            \
    do {                                                                                                       \
        if ((C) % PACK == 0) kernel<Pack><<<blocks_for((elements) / PACK, 256), 256, 0, gpu.stream>>>(__VA_ARGS__); \
        else kernel<Scalar><<<blocks_for(elements, 256), 256, 0, gpu.stream>>>(__VA_ARGS__);                   \
        cuda_check_launch();                                                                                   \
    } while (0)

// How a backward pass delivers an input gradient: written over what the tensor holds (its only
// producer: no zeroing first) or added to it (one of several).
typedef enum { GRAD_WRITE, GRAD_ADD } GradMode;

// Scratch: memory a layer borrows for the length of one call. The model's memory plan sizes it for
// its largest layer and owns it (unet_create); layers reach it through their Conv or Norm.
typedef struct {
    float *weight_grad;        // a weight gradient's partial sums over slices of the pixels
    int64_t weight_grad_numel; // (0: a 1x1 layer's gradient is one product)
    float *conv_split;         // a split 3x3 forward or input-gradient product's partial sums
    int64_t conv_split_numel;
    float *channel_sums;       // per-channel partial sums, [N][chunks][C] in channel_sum_slots(N) C floats
    double *gn_partials;       // GroupNorm: forward's channel sums [N][slots][C][2], backward's [N][chunks][4C + 2 groups]
    int64_t gn_partials_numel; // (doubles)
    float *gn_dx_sums;         // GroupNorm's backward: channel sums of the dx it writes, [N][chunks][C] in gn_slots(N) C floats
    float *scores;             // attention, [N*heads][T][T]: S, then dP
    floatX *d_scores;          // attention, [N*heads][T][T]: dS
} Scratch;

// ----------------------------------------------------------------------------------------------
// Matrix products on the tensor cores (bf16 operands, fp32 accumulation; fp32 throughout in the
// FP32 build). Row-major: D[M][N] = op(A)[M][K] op(B)[K][N] (+ bias[N]) + beta C, then max(D, 0) with relu.
// A is stored [M][K] with row stride lda, or [K][M] when trans_a; B is [K][N], or [N][K] when
// trans_b. cuBLAS is column-major, so the call computes D^T = op(B)^T op(A)^T.

typedef struct {
    int M, N, K;
    const void *a; int lda, trans_a;  // floatX (fp16 where fp16 is set)
    const void *b; int ldb, trans_b;
    void *d; int ldd, d_fp32;         // D in fp32 (else as A and B)
    const void *c; int ldc; float beta;  // C shaped and typed like D (it may be D); NULL: no C
    const void *bias;                 // [N] added to every row, typed as A, or NULL
    int relu;                         // D = max(D, 0) (in cuBLASLt's epilogue)
    int fp16;                         // A, B, the bias and D (unless d_fp32) in fp16 instead of floatX (Inception's)
} Matmul;

// What cuBLASLt plans a product by: the shape, strides, types and operand alignments. Its
// descriptors and chosen algorithm are made once per distinct key and kept (MATMUL_PLANS of them,
// the oldest replaced when full).
typedef struct {
    int M, N, K, lda, trans_a, ldb, trans_b, ldd, d_fp32, ldc, has_c, has_bias, relu, fp16;
    uint32_t alignment[4];  // of B, A, C, D: the largest power of two up to 256 dividing the address
} MatmulKey;

typedef struct {
    MatmulKey key;
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t layout_b, layout_a, layout_c, layout_d;
    cublasLtMatmulAlgo_t algo;
} MatmulPlan;

#define MATMUL_PLANS 512
static MatmulPlan matmul_plans[MATMUL_PLANS];
static int matmul_plan_count, matmul_plan_oldest;

static uint32_t address_alignment(const void *p) {
    uint32_t bytes = 256;
    while ((uintptr_t)p % bytes) bytes /= 2;
    return bytes;
}

static void matmul_plan_destroy(MatmulPlan *p) {
    cublasLtMatrixLayoutDestroy(p->layout_d);
    cublasLtMatrixLayoutDestroy(p->layout_c);
    cublasLtMatrixLayoutDestroy(p->layout_a);
    cublasLtMatrixLayoutDestroy(p->layout_b);
    cublasLtMatmulDescDestroy(p->desc);
}

static void matmul_plan_create(MatmulPlan *p, const MatmulKey *k) {
    p->key = *k;
    cublasOperation_t op_b = k->trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, op_a = k->trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    cudaDataType type = k->fp16 ? CUDA_R_16F : CUDA_FLOATX, d_type = k->d_fp32 ? CUDA_R_32F : type;
    cublas_check(cublasLtMatmulDescCreate(&p->desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_b, sizeof op_b));
    cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_a, sizeof op_a));
    if (k->has_bias || k->relu) {
        cublasLtEpilogue_t epilogue = !k->relu ? CUBLASLT_EPILOGUE_BIAS : k->has_bias ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_RELU;
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof epilogue));
    }
    if (k->has_bias) {
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &type, sizeof type));
    }
    cublas_check(cublasLtMatrixLayoutCreate(&p->layout_b, type, k->trans_b ? k->K : k->N, k->trans_b ? k->N : k->K, k->ldb));
    cublas_check(cublasLtMatrixLayoutCreate(&p->layout_a, type, k->trans_a ? k->M : k->K, k->trans_a ? k->K : k->M, k->lda));
    cublas_check(cublasLtMatrixLayoutCreate(&p->layout_c, d_type, k->N, k->M, k->has_c ? k->ldc : k->ldd));
    cublas_check(cublasLtMatrixLayoutCreate(&p->layout_d, d_type, k->N, k->M, k->ldd));
    cublasLtMatmulPreference_t preference;
    cublas_check(cublasLtMatmulPreferenceCreate(&preference));
    cublas_check(cublasLtMatmulPreferenceSetAttribute(preference, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                      &gpu.workspace_bytes, sizeof gpu.workspace_bytes));
    cublasLtMatmulPreferenceAttributes_t alignment[4] = {
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES};
    for (int i = 0; i < 4; i++)
        cublas_check(cublasLtMatmulPreferenceSetAttribute(preference, alignment[i], &k->alignment[i], sizeof k->alignment[i]));
    cublasLtMatmulHeuristicResult_t heuristic;
    int found = 0;
    cublas_check(cublasLtMatmulAlgoGetHeuristic(gpu.lt, p->desc, p->layout_b, p->layout_a, p->layout_c, p->layout_d,
                                                preference, 1, &heuristic, &found));
    if (!found) fatal("cuBLASLt has no algorithm for a %dx%dx%d product", k->M, k->N, k->K);
    p->algo = heuristic.algo;
    cublasLtMatmulPreferenceDestroy(preference);
}

static const MatmulPlan *matmul_plan(const Matmul *mm) {
    MatmulKey k;
    memset(&k, 0, sizeof k);  // compared with memcmp
    k.M = mm->M, k.N = mm->N, k.K = mm->K, k.lda = mm->lda, k.trans_a = mm->trans_a, k.ldb = mm->ldb, k.trans_b = mm->trans_b;
    k.ldd = mm->ldd, k.d_fp32 = mm->d_fp32, k.ldc = mm->ldc, k.has_c = mm->c != NULL, k.has_bias = mm->bias != NULL, k.relu = mm->relu;
    k.fp16 = mm->fp16;
    const void *operands[4] = {mm->b, mm->a, mm->c ? mm->c : mm->d, mm->d};
    for (int i = 0; i < 4; i++) k.alignment[i] = address_alignment(operands[i]);
    for (int i = 0; i < matmul_plan_count; i++)
        if (memcmp(&matmul_plans[i].key, &k, sizeof k) == 0) return &matmul_plans[i];
    MatmulPlan *p;
    if (matmul_plan_count < MATMUL_PLANS) {
        p = &matmul_plans[matmul_plan_count++];
    } else {
        p = &matmul_plans[matmul_plan_oldest];
        matmul_plan_oldest = (matmul_plan_oldest + 1) % MATMUL_PLANS;
        matmul_plan_destroy(p);
    }
    matmul_plan_create(p, &k);
    return p;
}

static void matmul(Matmul mm) {
    const MatmulPlan *p = matmul_plan(&mm);
    if (mm.bias)
        cublas_check(cublasLtMatmulDescSetAttribute(p->desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &mm.bias, sizeof mm.bias));
    float alpha = 1.0f, beta = mm.c ? mm.beta : 0.0f;
    cublas_check(cublasLtMatmul(gpu.lt, p->desc, &alpha, mm.b, p->layout_b, mm.a, p->layout_a, &beta, mm.c ? mm.c : mm.d,
                                p->layout_c, mm.d, p->layout_d, &p->algo, gpu.workspace, gpu.workspace_bytes, gpu.stream));
}

// The same product for a batch of matrices given by device arrays of pointers (attention heads).
static void matmul_batched(void *const *d, cudaDataType d_type, int ldd, const floatX *const *a, int trans_a, int lda,
                           const floatX *const *b, int trans_b, int ldb, int M, int N, int K, float beta, int batch) {
    float alpha = 1.0f;
    cublas_check(cublasGemmBatchedEx(gpu.blas, trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                     N, M, K, &alpha, (const void *const *)b, CUDA_FLOATX, ldb, (const void *const *)a,
                                     CUDA_FLOATX, lda, &beta, d, d_type, ldd, batch, CUBLAS_COMPUTE_32F,
                                     CUBLAS_GEMM_DEFAULT));
}

// The weight gradient of a layer, dW[out][K] = dy^T[out][M] x[M][K] (fp32), a reduction over all M
// rows of the batch. A single product would run on a handful of output tiles for M ~ 10^5, so
// the rows are split into slices computed as one batched product into scratch, then summed in a
// fixed order; rows left over after the slices are added by one more product. A model that computes
// no parameter gradients (TRAINING_INPUT_GRADIENT) has no dw: nothing is done.

#define WEIGHT_GRAD_SLICE_ROWS 4096
#define WEIGHT_GRAD_MAX_SLICES 64

static int weight_grad_slices(int64_t scratch_numel, int M, int out, int K) {
    int64_t slices = M / WEIGHT_GRAD_SLICE_ROWS, cap = scratch_numel / ((int64_t)out * K);
    if (slices > WEIGHT_GRAD_MAX_SLICES) slices = WEIGHT_GRAD_MAX_SLICES;
    return (int)(slices < cap ? slices : cap);
}

// out[i] = sum over slices k, in order, of slices[k][i] (the weight gradients' partial sums; also
// the 3x3 convolutions'), for the n floats of a slice; out's rows of `cols` values lie ld apart
// (ld = cols: contiguous).
__global__ void sum_slices_kernel(float *out, int cols, int ld, const float *slices, int count, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float s = 0.0f;
        for (int k = 0; k < count; k++) s += slices[k * n + i];
        out[ld == cols ? i : i / cols * ld + i % cols] = s;
    }
}

static void sum_slices_strided(float *out, int cols, int ld, const float *slices, int count, int64_t n) {
    sum_slices_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(out, cols, ld, slices, count, n);
    cuda_check_launch();
}

static void sum_slices(float *out, const float *slices, int count, int64_t n) { sum_slices_strided(out, 1, 1, slices, count, n); }

static void weight_gradient(const Scratch *s, float *dw, int ldw, const floatX *dy, const floatX *x, int M, int out, int K) {
    if (!dw) return;
    int slices = weight_grad_slices(s->weight_grad_numel, M, out, K);
    if (slices < 2) {
        matmul({.M = out, .N = K, .K = M, .a = dy, .lda = out, .trans_a = 1, .b = x, .ldb = K, .d = dw, .ldd = ldw, .d_fp32 = 1});
        return;
    }
    int rows = M / slices;
    float alpha = 1.0f, beta = 0.0f;
    cublas_check(cublasGemmStridedBatchedEx(gpu.blas, CUBLAS_OP_N, CUBLAS_OP_T, K, out, rows, &alpha, x, CUDA_FLOATX, K,
                                            (int64_t)rows * K, dy, CUDA_FLOATX, out, (int64_t)rows * out, &beta,
                                            s->weight_grad, CUDA_R_32F, K, (int64_t)out * K, slices,
                                            CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    sum_slices_strided(dw, K, ldw, s->weight_grad, slices, (int64_t)out * K);
    int done = rows * slices;
    if (done < M)
        matmul({.M = out, .N = K, .K = M - done, .a = dy + (int64_t)done * out, .lda = out, .trans_a = 1,
                .b = x + (int64_t)done * K, .ldb = K, .d = dw, .ldd = ldw, .d_fp32 = 1, .c = dw, .ldc = ldw, .beta = 1.0f});
}
