// inception.cuh: Inception-v3's features on the GPU (evaluate, FID during training): a second network
// with its own convolution path, forward only. Needs only gpu.cuh; train_unet.cu includes it at its
// top (one translation unit).

// ----------------------------------------------------------------------------------------------
// Sample quality: Inception-v3's features (evaluate, and FID during training), and the statistics,
// Fréchet distance and k-NN precision/recall of metrics.h on the GPU.
//
// The network is the one the FID community computes features with: pytorch-fid's port of the
// TensorFlow graph of 2015-12-05 (torchvision's Inception3 with its FIDInceptionA, C, E_1 and E_2
// blocks: average pools that leave the padding out of the count, and a max pool in the last
// block), forward only, its weights pytorch-fid's pt_inception-2015-12-05-6726825d.pth. Images are
// resized to 299x299 (bilinear, as F.interpolate with align_corners=False) from [0, 1] and scaled to
// [-1, 1]. What comes out, per image:
//   pool:    the 2048 features of the final average pool (FID, precision and recall);
//   spatial: the first 7 channels of Mixed_6d's 1x1 branch (TF's mixed_6/conv) at 17x17, 2023
//            values (sFID, as guided-diffusion's evaluator takes them);
//   logits:  pool times the classifier's weights, without its bias (guided-diffusion's evaluator
//            multiplies by the graph's softmax/logits/MatMul weights only), for the Inception Score.
// Every layer is a BasicConv2d: a convolution without bias, BatchNorm (eps 0.001, its running
// statistics) and ReLU. The BatchNorm is folded into the convolution as the weights are read:
//   w' = w g / sqrt(var + eps),  b' = beta - mean g / sqrt(var + eps),
// so a layer is one matrix product, D[pixels][C_out] = relu(P[pixels][K] W'^T + b') with P[pixel]
// the patch (ky, kx, c) of the input (K = kh kw C_in, zero outside the image): by cuBLASLt with the
// bias and ReLU in its epilogue, on the input itself for a 1x1 convolution of stride 1, else on the
// patches gathered first; or, where that costs more, by a kernel of its own (inception_conv_kind).
// A block's branches write their channel slices of its output: the concatenation costs nothing.
//
// One walk over the architecture (inception_walk) both reads the weights (loading: every tensor's
// name and shape checked, no GPU) and runs the network, so the two cannot disagree.

#define INCEPTION_SIZE 299            // the side images are resized to
#define INCEPTION_FEATURES 2048       // pool
#define INCEPTION_CLASSES 1008        // logits
#define INCEPTION_SPATIAL_SIDE 17
#define INCEPTION_SPATIAL_CHANNELS 7
#define INCEPTION_SPATIAL (INCEPTION_SPATIAL_SIDE * INCEPTION_SPATIAL_SIDE * INCEPTION_SPATIAL_CHANNELS)
#define INCEPTION_BN_EPS 0.001
#define INCEPTION_MAX_CONVS 128

// The activations' type: fp16 in the BF16 build (bf16's 8-bit fraction moved FID by 0.3% against
// fp32 features; fp16's 11 bits keep it within 0.1%), fp32 in the FP32 build; products accumulate in fp32.
#if defined(PRECISION_FP32)
typedef float inceptionX;
#else
typedef __half inceptionX;
#endif
#define INCEPTION_PACK (16 / (int)sizeof(inceptionX))
typedef struct {
    inceptionX v[INCEPTION_PACK];
} __align__(16) InceptionPack;
typedef struct {
    inceptionX v[1];
} InceptionScalar;
#define INCEPTION_MAX_TENSORS 512

typedef struct {
    char name[48];                 // its state_dict prefix, as "Mixed_5b.branch1x1"
    int cin, cout, kh, kw, stride, pad_h, pad_w;
    int k;                         // a patch's length: kh kw cin, rounded up to 8 (16-byte rows)
    inceptionX *host_weight, *weight;  // [cout][k]: [cout][kh][kw][cin], the BatchNorm folded in, zero-padded
    inceptionX *host_bias, *bias;      // [cout]
    double patches_ms, product_ms; // UNET_PROFILE=1: the GPU time of its patches and its product
} InceptionConv;

// A feature map on the GPU: NHWC, the batch's images of h x w x c, a pixel's channels ld apart (a
// slice of a wider map's when ld > c). Its x is NULL while the walk is loading.
typedef struct {
    inceptionX *x;
    int h, w, c, ld;
} InceptionMap;

// A tensor the walk expects, listed when it walks without a file (the tests write weights so).
typedef struct {
    char name[96];
    int ndim;
    int64_t shape[4];
} InceptionTensor;

// Host memory for copies to and from the GPU: pinned where the system gives it (such copies overlap
// the GPU's work), else ordinary memory (*pinned 0).
static void *host_staging_alloc(size_t bytes, int *pinned) {
    void *p = NULL;
    *pinned = cudaMallocHost(&p, bytes) == cudaSuccess;
    if (!*pinned) (void)cudaGetLastError(), p = malloc_or_die(bytes);
    return p;
}

static void host_staging_free(void *p, int pinned) {
    if (pinned) cudaFreeHost(p);
    else free(p);
}

struct UnetInception {
    SafeTensorsFile f;
    char file[4096];
    int loading;                   // the walk reads the weights rather than running the network
    int listing;                   // ... or, without a file, lists the tensors it expects
    InceptionTensor *expected;
    int num_expected;
    char *err;                     // the loading walk's first error
    size_t err_len;
    int failed;
    InceptionConv conv[INCEPTION_MAX_CONVS];
    int num_convs, next;
    float *host_fc, *fc;           // the classifier's weights [1008][2048]
    int64_t map_numel, temp_numel, patch_numel;  // per image, the largest the walk needs
    // On the GPU, for batches of up to `batch` images (n in this one):
    int batch, n, side;
    int64_t temp_used;             // per image, in the block now running
    inceptionX *input, *maps[2], *temp, *patches;
    uint8_t *pixels;
    int64_t pixels_numel;          // the bytes of pixels, and of each staged_pixels slot
    float *pool, *spatial, *logits;
    // Host memory for two batches each way (unet_inception_features): pixels in, features out.
    uint8_t *staged_pixels[2];     // pinned where the system gives it (staged_pixels_pinned), else ordinary
    int staged_pixels_pinned[2];
    float *staged_features[2];     // pinned: a batch's pool, spatial and logits (inception_staged)
    cudaEvent_t staged_done[2];    // the batch staged in slot s has run and its features are out
    int profile;                   // UNET_PROFILE=1: each layer timed (synchronously), the slowest printed at close
    cudaEvent_t marks[2];
    double pools_ms;
};

// UNET_PROFILE=1: a mark on the stream, and the GPU time since the last one added to *ms (the host waits for it).
static void inception_mark(UnetInception *net, double *ms) {
    if (!net->profile) return;
    if (ms) {
        float elapsed;
        cuda_check(cudaEventRecord(net->marks[1], gpu.stream));
        cuda_check(cudaEventSynchronize(net->marks[1]));
        cuda_check(cudaEventElapsedTime(&elapsed, net->marks[0], net->marks[1]));
        *ms += elapsed;
    }
    cuda_check(cudaEventRecord(net->marks[0], gpu.stream));
}

// A tensor of the weights file of the given shape, read as float into values (NULL: not read);
// -1 with the walk's error when missing, misshapen or not finite. Listing, it is recorded instead.
static int inception_tensor(UnetInception *net, const char *name, int ndim, const int64_t *shape, float *values) {
    if (net->listing) {
        if (net->num_expected == INCEPTION_MAX_TENSORS) fatal("Inception: more tensors than INCEPTION_MAX_TENSORS");
        InceptionTensor *t = &net->expected[net->num_expected++];
        snprintf(t->name, sizeof t->name, "%s", name);
        t->ndim = ndim;
        for (int d = 0; d < ndim; d++) t->shape[d] = shape[d];
        return -1;
    }
    if (net->failed) return -1;
    const SafeTensor *t = safetensors_find(&net->f, name);
    char want[96] = "", have[96] = "";
    for (int d = 0; d < ndim; d++) snprintf(want + strlen(want), sizeof want - strlen(want), d ? ", %lld" : "%lld", (long long)shape[d]);
    int same = t && t->ndim == ndim;
    for (int d = 0; t && d < t->ndim; d++) {
        snprintf(have + strlen(have), sizeof have - strlen(have), d ? ", %lld" : "%lld", (long long)t->shape[d]);
        same = same && t->shape[d] == shape[d];
    }
    int got = same ? safetensors_get_float(t, values) : 0;
    if (!t)
        net->failed = error_line(net->err, net->err_len, "%s has no tensor %s: it is not pytorch-fid's Inception weights "
                                 "(pt_inception-2015-12-05-6726825d.pth)", net->file, name);
    else if (!same)
        net->failed = error_line(net->err, net->err_len, "%s: %s is [%s]; pytorch-fid's Inception has [%s]", net->file, name, have, want);
    else if (got)
        net->failed = error_line(net->err, net->err_len, got == -2 ? "%s: %s holds NaN or infinite values" : "%s: %s is not floating point",
                                 net->file, name);
    return net->failed;
}

// Images to the network's input: image i ([h][w][c] bytes; c = 1 grey, replicated; else its first
// three channels) resized to 299x299 as F.interpolate(mode="bilinear", align_corners=False) does:
// output pixel o reads the source at s = max((o + 0.5) h / 299 - 0.5, 0), between floor(s) and the
// next pixel (the last one at the edge), then 2 v / 255 - 1.
__global__ void inception_input_kernel(inceptionX *out, const uint8_t *pixels, int n, int h, int w, int c) {
    int64_t total = (int64_t)n * INCEPTION_SIZE * INCEPTION_SIZE * 3;
    float scale_y = (float)h / INCEPTION_SIZE, scale_x = (float)w / INCEPTION_SIZE;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int ch = (int)(i % 3), ox = (int)(i / 3 % INCEPTION_SIZE), oy = (int)(i / 3 / INCEPTION_SIZE % INCEPTION_SIZE);
        int64_t image = i / 3 / INCEPTION_SIZE / INCEPTION_SIZE;
        float sy = fmaxf((oy + 0.5f) * scale_y - 0.5f, 0.0f), sx = fmaxf((ox + 0.5f) * scale_x - 0.5f, 0.0f);
        int y0 = (int)sy, x0 = (int)sx, y1 = y0 + (y0 < h - 1), x1 = x0 + (x0 < w - 1);
        float ly = sy - y0, lx = sx - x0;
        const uint8_t *p = pixels + image * h * w * c + (c == 1 ? 0 : ch);
        float v00 = p[((int64_t)y0 * w + x0) * c] / 255.0f, v01 = p[((int64_t)y0 * w + x1) * c] / 255.0f;
        float v10 = p[((int64_t)y1 * w + x0) * c] / 255.0f, v11 = p[((int64_t)y1 * w + x1) * c] / 255.0f;
        float v = (1.0f - ly) * ((1.0f - lx) * v00 + lx * v01) + ly * ((1.0f - lx) * v10 + lx * v11);
        out[i] = (inceptionX)(2.0f * v - 1.0f);
    }
}

// The patches of a convolution: patches[p][k] for output pixel p = (image, oy, ox) and k = (ky, kx,
// c) < kh kw C of x[image][oy stride - pad_h + ky][ox stride - pad_w + kx][c], 0 outside the image
// and for k from kh kw C up to the padded length kp. V moves a pack of channels where C allows; a
// thread a pack, its indices in 32 bits (the launch checks that they fit).
template <typename V>
__global__ void inception_patches_kernel(inceptionX *patches, int kp, const inceptionX *x, int ld, int pixels, int h, int w, int c, int oh,
                                         int ow, int kh, int kw, int stride, int pad_h, int pad_w) {
    const int width = sizeof(V) / sizeof(inceptionX);
    int vectors = kp / width, total = pixels * vectors, taps = kh * kw * c;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int p = i / vectors, k = (i - p * vectors) * width;
        V v;
        for (int e = 0; e < width; e++) v.v[e] = (inceptionX)0.0f;
        if (k < taps) {
            int ch = k % c, tap = k / c, kx = tap % kw, ky = tap / kw;
            int ox = p % ow, row = p / ow, oy = row % oh, image = row / oh;
            int iy = oy * stride - pad_h + ky, ix = ox * stride - pad_w + kx;
            if (iy >= 0 && iy < h && ix >= 0 && ix < w) v = *(const V *)(x + (((int64_t)image * h + iy) * w + ix) * ld + ch);
        }
        *(V *)(patches + (int64_t)i * width) = v;
    }
}

// The convolutions without a patch matrix, in the BF16 build (fp16 activations):
//
// inception_conv_mma_kernel, for layers whose C_in is a multiple of 16: an implicit GEMM on the
// tensor cores (WMMA 16x16x16, fp16 operands, fp32 accumulation). A block of 8 warps computes a tile
// of 128 output pixels x 64 output channels of D[p][o] = relu(sum_k P[p][k] W[o][k] + b[o]), K
// taken 32 at a time: the tile's patch rows are gathered from x into shared memory 8 channels (16
// bytes) a load (P[p][k] = x[image][oy s - pad_h + ky][ox s - pad_w + kx][c], zero outside the image;
// 8 consecutive k are 8 channels of one tap since C_in is a multiple of 8), the weights beside them;
// each warp multiplies a 32 x 32 part. The accumulators go through shared memory to the bias, the
// ReLU and 16-byte stores into the output's channel slice.
#define CONV_MMA_PIXELS 128
#define CONV_MMA_CHANNELS 64
#define CONV_MMA_K 32
#define CONV_MMA_LD (CONV_MMA_K + 8)                  // shared rows, padded against bank conflicts
#define CONV_MMA_OUT_LD (CONV_MMA_CHANNELS + 4)

#if !defined(PRECISION_FP32)
__global__ void __launch_bounds__(256) inception_conv_mma_kernel(__half *out, int out_ld, const __half *x, int ld, const __half *weight,
                                                                 const __half *bias, int pixels, int h, int w, int c, int oh, int ow,
                                                                 int kw, int stride, int pad_h, int pad_w, int K, int cout) {
    // The operand tiles, and after the products the fp32 results (the same bytes).
    __shared__ __align__(32) unsigned char smem[CONV_MMA_PIXELS * CONV_MMA_OUT_LD * sizeof(float)];
    __half *tile_a = (__half *)smem, *tile_b = tile_a + CONV_MMA_PIXELS * CONV_MMA_LD;
    float *tile_d = (float *)smem;
    int p0 = blockIdx.x * CONV_MMA_PIXELS, o0 = blockIdx.y * CONV_MMA_CHANNELS, t = threadIdx.x, warp = t / 32;
    int vector = t % 4, rows[2], iy0[2], ix0[2];  // this thread loads vector `vector` of patch rows t / 4 and t / 4 + 64
    int64_t base[2];
    for (int r = 0; r < 2; r++) {
        rows[r] = t / 4 + 64 * r;
        int p = p0 + rows[r], ox = p % ow, oy = p / ow % oh, image = p / ow / oh;
        iy0[r] = p < pixels ? oy * stride - pad_h : -1 << 20, ix0[r] = ox * stride - pad_w;
        base[r] = (int64_t)image * h * w;
    }
    nvcuda::wmma::fragment<nvcuda::wmma::accumulator, 16, 16, 16, float> acc[2][2];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++) nvcuda::wmma::fill_fragment(acc[i][j], 0.0f);
    int warp_row = warp / 2 * 32, warp_col = warp % 2 * 32;
    for (int k0 = 0; k0 < K; k0 += CONV_MMA_K) {
        int k = k0 + vector * 8, ch = k % c, tap = k / c, ky = tap / kw, kx = tap % kw;
        for (int r = 0; r < 2; r++) {
            int iy = iy0[r] + ky, ix = ix0[r] + kx;
            uint4 v = make_uint4(0, 0, 0, 0);
            if (k < K && iy >= 0 && iy < h && ix >= 0 && ix < w) v = *(const uint4 *)(x + (base[r] + (int64_t)iy * w + ix) * ld + ch);
            *(uint4 *)(tile_a + rows[r] * CONV_MMA_LD + vector * 8) = v;
        }
        int o = o0 + t / 4;  // the weights: row t / 4 of the tile, the same 8 k
        uint4 v = make_uint4(0, 0, 0, 0);
        if (o < cout && k < K) v = *(const uint4 *)(weight + (int64_t)o * K + k);
        *(uint4 *)(tile_b + (t / 4) * CONV_MMA_LD + vector * 8) = v;
        __syncthreads();
        for (int kk = 0; kk < CONV_MMA_K; kk += 16) {
            nvcuda::wmma::fragment<nvcuda::wmma::matrix_a, 16, 16, 16, __half, nvcuda::wmma::row_major> a[2];
            nvcuda::wmma::fragment<nvcuda::wmma::matrix_b, 16, 16, 16, __half, nvcuda::wmma::col_major> b[2];
            for (int i = 0; i < 2; i++) nvcuda::wmma::load_matrix_sync(a[i], tile_a + (warp_row + 16 * i) * CONV_MMA_LD + kk, CONV_MMA_LD);
            for (int j = 0; j < 2; j++) nvcuda::wmma::load_matrix_sync(b[j], tile_b + (warp_col + 16 * j) * CONV_MMA_LD + kk, CONV_MMA_LD);
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 2; j++) nvcuda::wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 2; j++)
            nvcuda::wmma::store_matrix_sync(tile_d + (warp_row + 16 * i) * CONV_MMA_OUT_LD + warp_col + 16 * j, acc[i][j], CONV_MMA_OUT_LD,
                                    nvcuda::wmma::mem_row_major);
    __syncthreads();
    for (int q = t; q < CONV_MMA_PIXELS * CONV_MMA_CHANNELS / 8; q += blockDim.x) {  // 8 channels a store
        int row = q / (CONV_MMA_CHANNELS / 8), col = q % (CONV_MMA_CHANNELS / 8) * 8, p = p0 + row, o = o0 + col;
        if (p >= pixels || o >= cout) continue;
        __align__(16) __half v[8];
        for (int e = 0; e < 8; e++) v[e] = __float2half(fmaxf(tile_d[row * CONV_MMA_OUT_LD + col + e] + __half2float(bias[o + e]), 0.0f));
        *(uint4 *)(out + (int64_t)p * out_ld + o) = *(const uint4 *)v;
    }
}
#endif

// The first layer (3x3, C_in = 3, C_out = 32: too narrow for the tensor cores' 16-channel steps),
// directly: a thread an output pixel, its 32 sums over the 27 inputs in fp32 (all in registers: the
// sizes are constants), the weights in shared memory; the block's outputs are staged in shared
// memory and stored a pack at a time.
#define CONV_FIRST_IN 3
#define CONV_FIRST_OUT 32
#define CONV_FIRST_TAPS (3 * 3 * CONV_FIRST_IN)
#define CONV_FIRST_PIXELS 128
__global__ void __launch_bounds__(CONV_FIRST_PIXELS) inception_conv_first_kernel(inceptionX *out, int out_ld, const inceptionX *x, int ld,
                                                                                 const inceptionX *weight, int kp, const inceptionX *bias,
                                                                                 int pixels, int h, int w, int oh, int ow, int stride, int pad) {
    __shared__ float weights[CONV_FIRST_OUT][CONV_FIRST_TAPS], biases[CONV_FIRST_OUT];
    __shared__ __align__(16) inceptionX staged[CONV_FIRST_PIXELS][CONV_FIRST_OUT];
    for (int i = threadIdx.x; i < CONV_FIRST_OUT * CONV_FIRST_TAPS; i += blockDim.x)
        weights[i / CONV_FIRST_TAPS][i % CONV_FIRST_TAPS] = (float)weight[i / CONV_FIRST_TAPS * kp + i % CONV_FIRST_TAPS];
    for (int i = threadIdx.x; i < CONV_FIRST_OUT; i += blockDim.x) biases[i] = (float)bias[i];
    __syncthreads();
    int p0 = blockIdx.x * CONV_FIRST_PIXELS, p = p0 + threadIdx.x;
    if (p < pixels) {
        int ox = p % ow, oy = p / ow % oh, image = p / ow / oh;
        float input[CONV_FIRST_TAPS];
#pragma unroll
        for (int k = 0; k < CONV_FIRST_TAPS; k++) {
            int iy = oy * stride - pad + k / (3 * CONV_FIRST_IN), ix = ox * stride - pad + k / CONV_FIRST_IN % 3;
            input[k] = iy >= 0 && iy < h && ix >= 0 && ix < w ? (float)x[(((int64_t)image * h + iy) * w + ix) * ld + k % CONV_FIRST_IN] : 0.0f;
        }
#pragma unroll
        for (int o = 0; o < CONV_FIRST_OUT; o++) {
            float sum = biases[o];
#pragma unroll
            for (int k = 0; k < CONV_FIRST_TAPS; k++) sum += input[k] * weights[o][k];
            staged[threadIdx.x][o] = (inceptionX)fmaxf(sum, 0.0f);
        }
    }
    __syncthreads();
    const int packs = CONV_FIRST_OUT / INCEPTION_PACK;
    for (int q = threadIdx.x; q < CONV_FIRST_PIXELS * packs; q += blockDim.x) {
        int row = q / packs, col = q % packs * INCEPTION_PACK;
        if (p0 + row < pixels) *(InceptionPack *)(out + (int64_t)(p0 + row) * out_ld + col) = *(const InceptionPack *)&staged[row][col];
    }
}

// 3x3 pooling of stride `stride` and padding `pad`: the largest of the window's in-image values
// (max), or their mean, the padding left out of the count (F.avg_pool2d's count_include_pad=False).
template <typename V>
__global__ void inception_pool_kernel(inceptionX *out, int out_ld, const inceptionX *x, int ld, int n, int h, int w, int c, int oh, int ow,
                                      int stride, int pad, int is_max) {
    const int width = sizeof(V) / sizeof(inceptionX);
    int64_t total = (int64_t)n * oh * ow * c / width;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < total; i += (int64_t)gridDim.x * blockDim.x) {
        int ch = (int)(i * width % c);
        int64_t p = i * width / c;
        int ox = (int)(p % ow), oy = (int)(p / ow % oh);
        int64_t image = p / ((int64_t)ow * oh);
        float acc[sizeof(V) / sizeof(inceptionX)];
        for (int e = 0; e < width; e++) acc[e] = is_max ? -INFINITY : 0.0f;
        int count = 0;
        for (int ky = 0; ky < 3; ky++)
            for (int kx = 0; kx < 3; kx++) {
                int iy = oy * stride - pad + ky, ix = ox * stride - pad + kx;
                if (iy < 0 || iy >= h || ix < 0 || ix >= w) continue;
                V v = *(const V *)(x + ((image * h + iy) * w + ix) * ld + ch);
                for (int e = 0; e < width; e++) acc[e] = is_max ? fmaxf(acc[e], (float)v.v[e]) : acc[e] + (float)v.v[e];
                count++;
            }
        V o;
        for (int e = 0; e < width; e++) o.v[e] = (inceptionX)(is_max ? acc[e] : acc[e] / count);
        *(V *)(out + p * out_ld + ch) = o;
    }
}

// The pool features: pool[image][c] = the mean over the final 8x8 map's pixels, in fp32.
__global__ void inception_mean_kernel(float *pool, const inceptionX *x, int n, int pixels, int c) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)n * c; i += (int64_t)gridDim.x * blockDim.x) {
        const inceptionX *p = x + i / c * pixels * c + i % c;
        float sum = 0.0f;
        for (int q = 0; q < pixels; q++) sum += (float)p[(int64_t)q * c];
        pool[i] = sum / pixels;
    }
}

// The spatial features: spatial[image][(y, x, c)] = x's channels c < 7 at 17x17, in fp32.
__global__ void inception_spatial_kernel(float *spatial, const inceptionX *x, int ld, int n) {
    const int per_image = INCEPTION_SPATIAL;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)n * per_image; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t pixel = i / INCEPTION_SPATIAL_CHANNELS;
        spatial[i] = (float)x[pixel * ld + i % INCEPTION_SPATIAL_CHANNELS];
    }
}

// The walk's memory: a block's output is the ping-pong map its input is not in; its branches'
// intermediate maps come from the temporary arena, emptied as the next block starts. Loading, only
// the sizes are counted (per image).
static InceptionMap inception_output(UnetInception *net, int h, int w, int c) {
    net->side ^= 1, net->temp_used = 0;
    int64_t numel = (int64_t)h * w * c;
    if (numel > net->map_numel) net->map_numel = numel;
    InceptionMap m = {net->loading ? NULL : net->maps[net->side], h, w, c, c};
    return m;
}

static InceptionMap inception_temp(UnetInception *net, int h, int w, int c) {
    InceptionMap m = {net->loading ? NULL : net->temp + net->temp_used * net->n, h, w, c, c};
    net->temp_used += (int64_t)h * w * c;
    if (net->temp_used > net->temp_numel) net->temp_numel = net->temp_used;
    return m;
}

// Channels first .. first + count - 1 of a map.
static InceptionMap inception_slice(InceptionMap m, int first, int count) {
    if (m.x) m.x += first;
    m.c = count;
    return m;
}

// How a layer is computed: one product of cuBLASLt on its input (a 1x1 of stride 1) or on its
// patch matrix; the narrow first layer directly (inception_conv_first_kernel); in the BF16 build
// the layers of large maps (the stem's 147x147, out_pixels >= CONV_MMA_MIN_PIXELS) by the implicit
// GEMM (inception_conv_mma_kernel): there the patch matrix costs more than the kernel loses to
// cuBLASLt's products, on smaller maps less (dev/NOTES.md).
#define CONV_MMA_MIN_PIXELS 10000
typedef enum { INCEPTION_PRODUCT, INCEPTION_PATCHES, INCEPTION_FIRST, INCEPTION_MMA } InceptionConvKind;

static InceptionConvKind inception_conv_kind(int cin, int cout, int kh, int kw, int stride, int pad_h, int pad_w, int out_pixels) {
    if (kh == 1 && kw == 1 && stride == 1) return INCEPTION_PRODUCT;
    if (kh == 3 && kw == 3 && pad_h == pad_w && cin == CONV_FIRST_IN && cout == CONV_FIRST_OUT) return INCEPTION_FIRST;
    if (sizeof(inceptionX) == 2 && cin % 16 == 0 && out_pixels >= CONV_MMA_MIN_PIXELS) return INCEPTION_MMA;
    return INCEPTION_PATCHES;
}

// BasicConv2d `name` (a kh x kw convolution of stride `stride` and zero padding pad_h, pad_w, then
// the folded BatchNorm and ReLU) from `in` into the map or slice `out`. Loading, its weights are read
// and folded; running, it is computed as inception_conv_kind says.
static void inception_conv(UnetInception *net, const char *name, InceptionMap in, InceptionMap out, int kh, int kw, int stride, int pad_h,
                           int pad_w) {
    if ((in.h + 2 * pad_h - kh) / stride + 1 != out.h || (in.w + 2 * pad_w - kw) / stride + 1 != out.w)
        fatal("Inception: %s makes a %dx%d map, not %dx%d", name, (in.h + 2 * pad_h - kh) / stride + 1,
              (in.w + 2 * pad_w - kw) / stride + 1, out.h, out.w);
    InceptionConvKind kind = inception_conv_kind(in.c, out.c, kh, kw, stride, pad_h, pad_w, out.h * out.w);
    if (net->loading) {
        if (net->num_convs == INCEPTION_MAX_CONVS) fatal("Inception: more layers than INCEPTION_MAX_CONVS");
        InceptionConv *l = &net->conv[net->num_convs++];
        snprintf(l->name, sizeof l->name, "%s", name);
        l->cin = in.c, l->cout = out.c, l->kh = kh, l->kw = kw, l->stride = stride, l->pad_h = pad_h, l->pad_w = pad_w;
        l->k = (kh * kw * in.c + 7) / 8 * 8;
        if (kind == INCEPTION_PATCHES && (int64_t)out.h * out.w * l->k > net->patch_numel)
            net->patch_numel = (int64_t)out.h * out.w * l->k;
        int64_t w_shape[4] = {out.c, in.c, kh, kw}, c_shape[1] = {out.c};
        float *w = (float *)malloc_or_die((size_t)out.c * in.c * kh * kw * sizeof(float));
        float *bn = (float *)malloc_or_die(4 * (size_t)out.c * sizeof(float));  // weight, bias, running_mean, running_var
        static const char *const bn_names[4] = {"weight", "bias", "running_mean", "running_var"};
        char tensor[96];
        snprintf(tensor, sizeof tensor, "%s.conv.weight", name);
        inception_tensor(net, tensor, 4, w_shape, w);
        for (int q = 0; q < 4; q++) {
            snprintf(tensor, sizeof tensor, "%s.bn.%s", name, bn_names[q]);
            inception_tensor(net, tensor, 1, c_shape, bn + q * out.c);
        }
        for (int o = 0; !net->failed && !net->listing && o < out.c; o++)
            if (!(bn[3 * out.c + o] >= 0))
                net->failed = error_line(net->err, net->err_len, "%s: %s.bn.running_var has a negative variance", net->file, name);
        if (!net->failed && !net->listing) {
            l->host_weight = (inceptionX *)calloc((size_t)out.c * l->k, sizeof(inceptionX));
            l->host_bias = (inceptionX *)malloc_or_die(out.c * sizeof(inceptionX));
            if (!l->host_weight) fatal("out of host memory");
            for (int o = 0; o < out.c; o++) {
                double g = bn[o] / sqrt(bn[3 * out.c + o] + INCEPTION_BN_EPS);
                l->host_bias[o] = (inceptionX)(bn[out.c + o] - bn[2 * out.c + o] * g);
                for (int ci = 0; ci < in.c; ci++)  // PyTorch's [out][in][ky][kx] to [out][ky][kx][in]
                    for (int t = 0; t < kh * kw; t++)
                        l->host_weight[(size_t)o * l->k + t * in.c + ci] = (inceptionX)(w[((size_t)o * in.c + ci) * kh * kw + t] * g);
            }
        }
        free(w), free(bn);
        return;
    }
    InceptionConv *l = &net->conv[net->next++];
    if (strcmp(l->name, name) != 0) fatal("Inception: the walk ran %s where it loaded %s", name, l->name);
    int packed_in = in.c % INCEPTION_PACK == 0 && in.ld % INCEPTION_PACK == 0 && address_alignment(in.x) >= 16;
    int packed_out = out.ld % INCEPTION_PACK == 0 && address_alignment(out.x) >= 16;
    if ((kind == INCEPTION_FIRST && !packed_out) || (kind == INCEPTION_MMA && !(packed_in && packed_out)))
        fatal("Inception: %s's maps are not aligned to 16 bytes", name);
    inception_mark(net, NULL);
    int pixels = net->n * out.h * out.w;
    const inceptionX *a = in.x;
    int lda = in.ld;
    switch (kind) {
    case INCEPTION_FIRST:
        inception_conv_first_kernel<<<(pixels + CONV_FIRST_PIXELS - 1) / CONV_FIRST_PIXELS, CONV_FIRST_PIXELS, 0, gpu.stream>>>(
            out.x, out.ld, in.x, in.ld, l->weight, l->k, l->bias, pixels, in.h, in.w, out.h, out.w, stride, pad_h);
        cuda_check_launch();
        inception_mark(net, &l->product_ms);
        return;
    case INCEPTION_MMA: {  // (the BF16 build's only: inception_conv_kind)
#if !defined(PRECISION_FP32)
        dim3 grid((pixels + CONV_MMA_PIXELS - 1) / CONV_MMA_PIXELS, (out.c + CONV_MMA_CHANNELS - 1) / CONV_MMA_CHANNELS);
        inception_conv_mma_kernel<<<grid, 256, 0, gpu.stream>>>(out.x, out.ld, in.x, in.ld, l->weight, l->bias, pixels, in.h, in.w, in.c,
                                                                 out.h, out.w, kw, stride, pad_h, pad_w, kh * kw * in.c, out.c);
        cuda_check_launch();
        inception_mark(net, &l->product_ms);
#endif
        return;
    }
    case INCEPTION_PATCHES:
        if ((int64_t)out.h * out.w * l->k > net->patch_numel) fatal("Inception: %s's patches do not fit the workspace", name);
        if ((int64_t)pixels * l->k > INT_MAX) fatal("Inception: %s's patches of a batch of %d take more than 2^31 values", name, net->n);
        if (packed_in)
            inception_patches_kernel<InceptionPack><<<blocks_for((size_t)pixels * l->k / INCEPTION_PACK, 256), 256, 0, gpu.stream>>>(
                net->patches, l->k, in.x, in.ld, pixels, in.h, in.w, in.c, out.h, out.w, kh, kw, stride, pad_h, pad_w);
        else
            inception_patches_kernel<InceptionScalar><<<blocks_for((size_t)pixels * l->k, 256), 256, 0, gpu.stream>>>(
                net->patches, l->k, in.x, in.ld, pixels, in.h, in.w, in.c, out.h, out.w, kh, kw, stride, pad_h, pad_w);
        cuda_check_launch();
        a = net->patches, lda = l->k;
        inception_mark(net, &l->patches_ms);
        break;
    case INCEPTION_PRODUCT:
        break;
    }
    matmul({.M = pixels, .N = out.c, .K = l->k, .a = a, .lda = lda, .b = l->weight, .ldb = l->k, .trans_b = 1, .d = out.x, .ldd = out.ld,
            .bias = l->bias, .relu = 1, .fp16 = sizeof(inceptionX) == 2});
    inception_mark(net, &l->product_ms);
}

// A 3x3 pool of `in` into the map or slice `out`.
static void inception_pool(UnetInception *net, InceptionMap in, InceptionMap out, int stride, int pad, int is_max) {
    if ((in.h + 2 * pad - 3) / stride + 1 != out.h || out.c != in.c) fatal("Inception: a pool's output map is misshapen");
    if (net->loading) return;
    inception_mark(net, NULL);
    int64_t elements = (int64_t)net->n * out.h * out.w * out.c;
    if (in.c % INCEPTION_PACK == 0 && in.ld % INCEPTION_PACK == 0 && out.ld % INCEPTION_PACK == 0 && address_alignment(out.x) >= 16 && address_alignment(in.x) >= 16)
        inception_pool_kernel<InceptionPack><<<blocks_for(elements / INCEPTION_PACK, 256), 256, 0, gpu.stream>>>(out.x, out.ld, in.x, in.ld, net->n, in.h,
                                                                                              in.w, in.c, out.h, out.w, stride, pad, is_max);
    else
        inception_pool_kernel<InceptionScalar><<<blocks_for(elements, 256), 256, 0, gpu.stream>>>(out.x, out.ld, in.x, in.ld, net->n, in.h, in.w,
                                                                                         in.c, out.h, out.w, stride, pad, is_max);
    cuda_check_launch();
    inception_mark(net, &net->pools_ms);
}

// The stem's layers: one convolution or pool each, into a map of its own.
static InceptionMap inception_stem_conv(UnetInception *net, const char *name, InceptionMap x, int cout, int k, int stride, int pad) {
    InceptionMap y = inception_output(net, (x.h + 2 * pad - k) / stride + 1, (x.w + 2 * pad - k) / stride + 1, cout);
    inception_conv(net, name, x, y, k, k, stride, pad, pad);
    return y;
}

static InceptionMap inception_stem_pool(UnetInception *net, InceptionMap x) {
    InceptionMap y = inception_output(net, (x.h - 3) / 2 + 1, (x.w - 3) / 2 + 1, x.c);
    inception_pool(net, x, y, 2, 0, 1);
    return y;
}

// The blocks, named as torchvision's and pytorch-fid's modules; each concatenates its branches in
// the order written. BLOCK_CONV names a branch's layer "block.branch".
#define BLOCK_CONV(branch, in, out, kh, kw, stride, pad_h, pad_w)                         \
    do {                                                                                  \
        char layer_[64];                                                                  \
        snprintf(layer_, sizeof layer_, "%s.%s", block, branch);                          \
        inception_conv(net, layer_, in, out, kh, kw, stride, pad_h, pad_w);               \
    } while (0)

// FIDInceptionA: 1x1 (64) | 1x1 (48), 5x5 (64) | 1x1 (64), 3x3 (96), 3x3 (96) | 3x3 average, 1x1 (pool_features).
static InceptionMap inception_a(UnetInception *net, const char *block, InceptionMap x, int pool_features) {
    int h = x.h, w = x.w;
    InceptionMap y = inception_output(net, h, w, 64 + 64 + 96 + pool_features);
    BLOCK_CONV("branch1x1", x, inception_slice(y, 0, 64), 1, 1, 1, 0, 0);
    InceptionMap t = inception_temp(net, h, w, 48);
    BLOCK_CONV("branch5x5_1", x, t, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch5x5_2", t, inception_slice(y, 64, 64), 5, 5, 1, 2, 2);
    InceptionMap d1 = inception_temp(net, h, w, 64), d2 = inception_temp(net, h, w, 96);
    BLOCK_CONV("branch3x3dbl_1", x, d1, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch3x3dbl_2", d1, d2, 3, 3, 1, 1, 1);
    BLOCK_CONV("branch3x3dbl_3", d2, inception_slice(y, 128, 96), 3, 3, 1, 1, 1);
    InceptionMap p = inception_temp(net, h, w, x.c);
    inception_pool(net, x, p, 1, 1, 0);
    BLOCK_CONV("branch_pool", p, inception_slice(y, 224, pool_features), 1, 1, 1, 0, 0);
    return y;
}

// InceptionB (the grid reduction to 17x17): 3x3 stride 2 (384) | 1x1 (64), 3x3 (96), 3x3 stride 2 (96) | 3x3 max stride 2.
static InceptionMap inception_b(UnetInception *net, const char *block, InceptionMap x) {
    int h = (x.h - 3) / 2 + 1, w = (x.w - 3) / 2 + 1;
    InceptionMap y = inception_output(net, h, w, 384 + 96 + x.c);
    BLOCK_CONV("branch3x3", x, inception_slice(y, 0, 384), 3, 3, 2, 0, 0);
    InceptionMap d1 = inception_temp(net, x.h, x.w, 64), d2 = inception_temp(net, x.h, x.w, 96);
    BLOCK_CONV("branch3x3dbl_1", x, d1, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch3x3dbl_2", d1, d2, 3, 3, 1, 1, 1);
    BLOCK_CONV("branch3x3dbl_3", d2, inception_slice(y, 384, 96), 3, 3, 2, 0, 0);
    inception_pool(net, x, inception_slice(y, 480, x.c), 2, 0, 1);
    return y;
}

// FIDInceptionC: 1x1 (192) | 1x1 (c7), 1x7 (c7), 7x1 (192) | 1x1 (c7), 7x1, 1x7, 7x1 (c7), 1x7 (192) |
// 3x3 average, 1x1 (192).
static InceptionMap inception_c(UnetInception *net, const char *block, InceptionMap x, int c7) {
    int h = x.h, w = x.w;
    InceptionMap y = inception_output(net, h, w, 768);
    BLOCK_CONV("branch1x1", x, inception_slice(y, 0, 192), 1, 1, 1, 0, 0);
    InceptionMap a = inception_temp(net, h, w, c7), b = inception_temp(net, h, w, c7);
    BLOCK_CONV("branch7x7_1", x, a, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch7x7_2", a, b, 1, 7, 1, 0, 3);
    BLOCK_CONV("branch7x7_3", b, inception_slice(y, 192, 192), 7, 1, 1, 3, 0);
    BLOCK_CONV("branch7x7dbl_1", x, a, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch7x7dbl_2", a, b, 7, 1, 1, 3, 0);
    BLOCK_CONV("branch7x7dbl_3", b, a, 1, 7, 1, 0, 3);
    BLOCK_CONV("branch7x7dbl_4", a, b, 7, 1, 1, 3, 0);
    BLOCK_CONV("branch7x7dbl_5", b, inception_slice(y, 384, 192), 1, 7, 1, 0, 3);
    InceptionMap p = inception_temp(net, h, w, x.c);
    inception_pool(net, x, p, 1, 1, 0);
    BLOCK_CONV("branch_pool", p, inception_slice(y, 576, 192), 1, 1, 1, 0, 0);
    return y;
}

// InceptionD (the grid reduction to 8x8): 1x1 (192), 3x3 stride 2 (320) | 1x1 (192), 1x7, 7x1, 3x3 stride 2 (192) |
// 3x3 max stride 2.
static InceptionMap inception_d(UnetInception *net, const char *block, InceptionMap x) {
    int h = (x.h - 3) / 2 + 1, w = (x.w - 3) / 2 + 1;
    InceptionMap y = inception_output(net, h, w, 320 + 192 + x.c);
    InceptionMap a = inception_temp(net, x.h, x.w, 192), b = inception_temp(net, x.h, x.w, 192);
    BLOCK_CONV("branch3x3_1", x, a, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch3x3_2", a, inception_slice(y, 0, 320), 3, 3, 2, 0, 0);
    BLOCK_CONV("branch7x7x3_1", x, a, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch7x7x3_2", a, b, 1, 7, 1, 0, 3);
    BLOCK_CONV("branch7x7x3_3", b, a, 7, 1, 1, 3, 0);
    BLOCK_CONV("branch7x7x3_4", a, inception_slice(y, 320, 192), 3, 3, 2, 0, 0);
    inception_pool(net, x, inception_slice(y, 512, x.c), 2, 0, 1);
    return y;
}

// FIDInceptionE_1 (pool_max 0: 3x3 average) and E_2 (pool_max 1: 3x3 max, stride 1): 1x1 (320) |
// 1x1 (384), then 1x3 and 3x1 (384 each) | 1x1 (448), 3x3 (384), then 1x3 and 3x1 (384 each) | pool, 1x1 (192).
static InceptionMap inception_e(UnetInception *net, const char *block, InceptionMap x, int pool_max) {
    int h = x.h, w = x.w;
    InceptionMap y = inception_output(net, h, w, 320 + 768 + 768 + 192);
    BLOCK_CONV("branch1x1", x, inception_slice(y, 0, 320), 1, 1, 1, 0, 0);
    InceptionMap a = inception_temp(net, h, w, 384);
    BLOCK_CONV("branch3x3_1", x, a, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch3x3_2a", a, inception_slice(y, 320, 384), 1, 3, 1, 0, 1);
    BLOCK_CONV("branch3x3_2b", a, inception_slice(y, 704, 384), 3, 1, 1, 1, 0);
    InceptionMap d1 = inception_temp(net, h, w, 448), d2 = inception_temp(net, h, w, 384);
    BLOCK_CONV("branch3x3dbl_1", x, d1, 1, 1, 1, 0, 0);
    BLOCK_CONV("branch3x3dbl_2", d1, d2, 3, 3, 1, 1, 1);
    BLOCK_CONV("branch3x3dbl_3a", d2, inception_slice(y, 1088, 384), 1, 3, 1, 0, 1);
    BLOCK_CONV("branch3x3dbl_3b", d2, inception_slice(y, 1472, 384), 3, 1, 1, 1, 0);
    InceptionMap p = inception_temp(net, h, w, x.c);
    inception_pool(net, x, p, 1, 1, pool_max);
    BLOCK_CONV("branch_pool", p, inception_slice(y, 1856, 192), 1, 1, 1, 0, 0);
    return y;
}
#undef BLOCK_CONV

// The architecture, once: loading, it reads and checks the weights; running, it computes the
// features of the n images in net->input.
static void inception_walk(UnetInception *net) {
    net->side = 0, net->next = 0, net->temp_used = 0;
    InceptionMap x = {net->input, INCEPTION_SIZE, INCEPTION_SIZE, 3, 3};
    x = inception_stem_conv(net, "Conv2d_1a_3x3", x, 32, 3, 2, 0);
    x = inception_stem_conv(net, "Conv2d_2a_3x3", x, 32, 3, 1, 0);
    x = inception_stem_conv(net, "Conv2d_2b_3x3", x, 64, 3, 1, 1);
    x = inception_stem_pool(net, x);
    x = inception_stem_conv(net, "Conv2d_3b_1x1", x, 80, 1, 1, 0);
    x = inception_stem_conv(net, "Conv2d_4a_3x3", x, 192, 3, 1, 0);
    x = inception_stem_pool(net, x);
    x = inception_a(net, "Mixed_5b", x, 32);
    x = inception_a(net, "Mixed_5c", x, 64);
    x = inception_a(net, "Mixed_5d", x, 64);
    x = inception_b(net, "Mixed_6a", x);
    x = inception_c(net, "Mixed_6b", x, 128);
    x = inception_c(net, "Mixed_6c", x, 160);
    x = inception_c(net, "Mixed_6d", x, 160);
    if (x.h != INCEPTION_SPATIAL_SIDE) fatal("Inception: Mixed_6d's map is %dx%d", x.h, x.w);
    if (!net->loading) {  // its branch1x1 is channels 0..191
        inception_spatial_kernel<<<blocks_for((int64_t)net->n * INCEPTION_SPATIAL, 256), 256, 0, gpu.stream>>>(net->spatial, x.x, x.ld, net->n);
        cuda_check_launch();
    }
    x = inception_c(net, "Mixed_6e", x, 192);
    x = inception_d(net, "Mixed_7a", x);
    x = inception_e(net, "Mixed_7b", x, 0);
    x = inception_e(net, "Mixed_7c", x, 1);
    if (x.c != INCEPTION_FEATURES) fatal("Inception: Mixed_7c makes %d channels", x.c);
    if (net->loading) {
        int64_t fc_shape[2] = {INCEPTION_CLASSES, INCEPTION_FEATURES};
        net->host_fc = (float *)malloc_or_die((size_t)INCEPTION_CLASSES * INCEPTION_FEATURES * sizeof(float));
        inception_tensor(net, "fc.weight", 2, fc_shape, net->host_fc);
        return;
    }
    inception_mean_kernel<<<blocks_for((int64_t)net->n * x.c, 256), 256, 0, gpu.stream>>>(net->pool, x.x, net->n, x.h * x.w, x.c);
    cuda_check_launch();
    float one = 1.0f, zero = 0.0f;  // logits[n][1008] = pool[n][2048] fc^T, in fp32
    cublas_check(cublasSgemm(gpu.blas, CUBLAS_OP_T, CUBLAS_OP_N, INCEPTION_CLASSES, net->n, INCEPTION_FEATURES, &one, net->fc,
                             INCEPTION_FEATURES, net->pool, INCEPTION_FEATURES, &zero, net->logits, INCEPTION_CLASSES));
}

static void inception_free_host(UnetInception *net) {
    for (int i = 0; i < net->num_convs; i++) free(net->conv[i].host_weight), free(net->conv[i].host_bias);
    free(net->host_fc);
    free(net->expected);
}

#ifdef TRAIN_UNET_LIBRARY
// The tensors the walk expects, for tests that write weights: [count] into *tensors (free it).
static int inception_expected_tensors(InceptionTensor **tensors) {
    UnetInception *net = (UnetInception *)calloc(1, sizeof *net);
    if (!net) fatal("out of host memory");
    net->loading = net->listing = 1;
    net->expected = (InceptionTensor *)malloc_or_die(INCEPTION_MAX_TENSORS * sizeof(InceptionTensor));
    char err[16];
    net->err = err, net->err_len = sizeof err;
    inception_walk(net);
    int count = net->num_expected;
    *tensors = net->expected;
    net->expected = NULL;
    inception_free_host(net);
    free(net);
    return count;
}
#endif

extern "C" void unet_inception_default_path(char *path, size_t len) {
    const char *torch_home = getenv("TORCH_HOME"), *cache = getenv("XDG_CACHE_HOME"), *home = getenv("HOME");
    const char *file = "pt_inception-2015-12-05-6726825d.pth";
    if (torch_home && torch_home[0]) snprintf(path, len, "%s/hub/checkpoints/%s", torch_home, file);
    else if (cache && cache[0]) snprintf(path, len, "%s/torch/hub/checkpoints/%s", cache, file);
    else snprintf(path, len, "%s/.cache/torch/hub/checkpoints/%s", home ? home : ".", file);
}

extern "C" UnetInception *unet_inception_open(const char *path, char *err, size_t err_len) {
    UnetInception *net = (UnetInception *)calloc(1, sizeof *net);
    if (!net) fatal("out of host memory");
    snprintf(net->file, sizeof net->file, "%s", path);
    FILE *probe = fopen(path, "rb");  // a file that is not there: the path, and where to get the weights
    if (!probe) {
        error_line(err, err_len, "cannot open the Inception weights %s: %s (pytorch-fid's pt_inception-2015-12-05-6726825d.pth; "
                   "the README says where to get it)", path, strerror(errno));
        free(net);
        return NULL;
    }
    fclose(probe);
    if (safetensors_open(path, &net->f, err, err_len) != 0) return free(net), (UnetInception *)NULL;
    net->loading = 1, net->err = err, net->err_len = err_len;
    inception_walk(net);
    net->loading = 0, net->err = NULL;
    if (net->failed) {
        unet_inception_close(net);
        return NULL;
    }
    return net;
}

// UNET_PROFILE=1: the layers' GPU time, the slowest first (each layer's patches, then its product).
static void inception_print_profile(const UnetInception *net) {
    double total = net->pools_ms;
    int order[INCEPTION_MAX_CONVS];
    for (int i = 0; i < net->num_convs; i++) total += net->conv[i].patches_ms + net->conv[i].product_ms, order[i] = i;
    for (int i = 1; i < net->num_convs; i++)  // insertion sort by time, slowest first
        for (int j = i; j > 0; j--) {
            const InceptionConv *a = &net->conv[order[j - 1]], *b = &net->conv[order[j]];
            if (a->patches_ms + a->product_ms >= b->patches_ms + b->product_ms) break;
            int t = order[j];
            order[j] = order[j - 1], order[j - 1] = t;
        }
    fprintf(stderr, "Inception profile (UNET_PROFILE=1): %.1f ms of GPU time, pools %.1f ms; the slowest layers:\n", total, net->pools_ms);
    fprintf(stderr, "%-26s %5s %5s %4s %10s %10s\n", "layer", "C_in", "C_out", "k", "patches ms", "product ms");
    for (int i = 0; i < net->num_convs && i < 24; i++) {
        const InceptionConv *l = &net->conv[order[i]];
        fprintf(stderr, "%-26s %5d %5d %dx%d %10.2f %10.2f\n", l->name, l->cin, l->cout, l->kh, l->kw, l->patches_ms, l->product_ms);
    }
}

extern "C" void unet_inception_close(UnetInception *net) {
    if (!net) return;
    if (net->profile && net->batch) inception_print_profile(net);
    if (net->marks[0]) cudaEventDestroy(net->marks[0]), cudaEventDestroy(net->marks[1]);
    for (int i = 0; i < net->num_convs; i++) {
        cudaFree(net->conv[i].weight);
        cudaFree(net->conv[i].bias);
    }
    void *gpu_buffers[] = {net->fc, net->input, net->maps[0], net->maps[1], net->temp, net->patches, net->pixels, net->pool,
                           net->spatial, net->logits};
    for (size_t i = 0; i < sizeof gpu_buffers / sizeof *gpu_buffers; i++) cudaFree(gpu_buffers[i]);
    for (int s = 0; s < 2; s++) {
        host_staging_free(net->staged_pixels[s], net->staged_pixels_pinned[s]), cudaFreeHost(net->staged_features[s]);
        if (net->staged_done[s]) cudaEventDestroy(net->staged_done[s]);
    }
    inception_free_host(net);
    safetensors_close(&net->f);
    free(net);
}

// The network on the GPU for batches of up to `batch` images: its weights, the buffers the loading
// walk sized, and the pinned host slots its features are copied out to (made again only for a
// larger batch).
static void inception_to_gpu(UnetInception *net, int batch) {
    if (batch <= net->batch) return;
    void *gpu_buffers[] = {net->input, net->maps[0], net->maps[1], net->temp, net->patches, net->pool, net->spatial, net->logits};
    for (size_t i = 0; i < sizeof gpu_buffers / sizeof *gpu_buffers; i++) cudaFree(gpu_buffers[i]);
    if (!net->fc) {
        for (int i = 0; i < net->num_convs; i++) {
            InceptionConv *l = &net->conv[i];
            l->weight = (inceptionX *)gpu_malloc((size_t)l->cout * l->k * sizeof(inceptionX));
            l->bias = (inceptionX *)gpu_malloc(l->cout * sizeof(inceptionX));
            cuda_check(cudaMemcpy(l->weight, l->host_weight, (size_t)l->cout * l->k * sizeof(inceptionX), cudaMemcpyHostToDevice));
            cuda_check(cudaMemcpy(l->bias, l->host_bias, l->cout * sizeof(inceptionX), cudaMemcpyHostToDevice));
        }
        size_t fc_bytes = (size_t)INCEPTION_CLASSES * INCEPTION_FEATURES * sizeof(float);
        net->fc = (float *)gpu_malloc(fc_bytes);
        cuda_check(cudaMemcpy(net->fc, net->host_fc, fc_bytes, cudaMemcpyHostToDevice));
    }
    net->batch = batch;
    net->profile = getenv("UNET_PROFILE") != NULL;
    if (net->profile && !net->marks[0]) {
        cuda_check(cudaEventCreate(&net->marks[0]));
        cuda_check(cudaEventCreate(&net->marks[1]));
    }
    net->input = (inceptionX *)gpu_malloc((size_t)batch * INCEPTION_SIZE * INCEPTION_SIZE * 3 * sizeof(inceptionX));
    for (int s = 0; s < 2; s++) net->maps[s] = (inceptionX *)gpu_malloc((size_t)batch * net->map_numel * sizeof(inceptionX));
    net->temp = (inceptionX *)gpu_malloc((size_t)batch * net->temp_numel * sizeof(inceptionX));
    net->patches = (inceptionX *)gpu_malloc((size_t)batch * net->patch_numel * sizeof(inceptionX));
    net->pool = (float *)gpu_malloc((size_t)batch * INCEPTION_FEATURES * sizeof(float));
    net->spatial = (float *)gpu_malloc((size_t)batch * INCEPTION_SPATIAL * sizeof(float));
    net->logits = (float *)gpu_malloc((size_t)batch * INCEPTION_CLASSES * sizeof(float));
    for (int s = 0; s < 2; s++) {
        cudaFreeHost(net->staged_features[s]);
        size_t bytes = (size_t)batch * (INCEPTION_FEATURES + INCEPTION_SPATIAL + INCEPTION_CLASSES) * sizeof(float);
        cuda_check(cudaMallocHost((void **)&net->staged_features[s], bytes));
        if (!net->staged_done[s]) cuda_check(cudaEventCreateWithFlags(&net->staged_done[s], cudaEventDisableTiming));
    }
}

// (The input images' own bytes, batch x h x w x c, come on top.)
extern "C" int64_t unet_inception_gpu_bytes(const UnetInception *net, int batch) {
    int64_t weights = (int64_t)INCEPTION_CLASSES * INCEPTION_FEATURES * sizeof(float);
    for (int i = 0; i < net->num_convs; i++) weights += (int64_t)net->conv[i].cout * (net->conv[i].k + 1) * sizeof(inceptionX);
    int64_t per_image = (INCEPTION_SIZE * INCEPTION_SIZE * 3 + 2 * net->map_numel + net->temp_numel + net->patch_numel) * sizeof(inceptionX) +
                        (INCEPTION_FEATURES + INCEPTION_SPATIAL + INCEPTION_CLASSES) * sizeof(float);
    return weights + batch * per_image;
}

// The features of n images already on the GPU (d_pixels: [n][h][w][c] bytes, n <= net->batch), into
// the network's pool, spatial and logits buffers.
static void inception_run(UnetInception *net, const uint8_t *d_pixels, int n, int h, int w, int c) {
    net->n = n;
    int64_t elements = (int64_t)n * INCEPTION_SIZE * INCEPTION_SIZE * 3;
    inception_input_kernel<<<blocks_for(elements, 256), 256, 0, gpu.stream>>>(net->input, d_pixels, n, h, w, c);
    cuda_check_launch();
    inception_walk(net);
}

// The three kinds of features a batch gives, each [n][dims]: pool, spatial and logits.
static const int inception_dims[3] = {INCEPTION_FEATURES, INCEPTION_SPATIAL, INCEPTION_CLASSES};

// Kind k's features in pinned slot `slot`: [net->batch][inception_dims[k]], after the kinds before it.
static float *inception_staged(const UnetInception *net, int slot, int kind) {
    float *f = net->staged_features[slot];
    for (int k = 0; k < kind; k++) f += (size_t)net->batch * inception_dims[k];
    return f;
}

// The images in batch i of `count` in batches of `batch`.
static int inception_batch_images(int64_t count, int batch, int64_t i) { return count - i * batch < batch ? (int)(count - i * batch) : batch; }

// Batch i's features, waited for in its slot, copied to the caller's arrays (out[kind]; NULL: not wanted).
static void inception_unstage(UnetInception *net, int64_t count, int batch, int64_t i, float *const out[3]) {
    int slot = (int)(i % 2), n = inception_batch_images(count, batch, i);
    cuda_check(cudaEventSynchronize(net->staged_done[slot]));
    for (int k = 0; k < 3; k++)
        if (out[k])
            memcpy(out[k] + i * batch * inception_dims[k], inception_staged(net, slot, k), (size_t)n * inception_dims[k] * sizeof(float));
}

// The batches go through two slots each way, so that while the GPU runs batch i the host copies
// batch i + 1's pixels in and batch i - 1's features out: the GPU never waits for the host.
extern "C" int unet_inception_features(UnetInception *net, const uint8_t *pixels, int64_t count, int height, int width, int channels,
                                       int batch, float *pool, float *spatial, float *logits, char *err, size_t err_len) {
    if (height < 1 || width < 1 || (channels != 1 && channels != 3 && channels != 4))
        return error_line(err, err_len, "Inception takes images of 1 (grey), 3 (RGB) or 4 (RGBA) channels, not %d", channels);
    if (api_gpu_ready(err, err_len) != 0) return -1;
    if (batch < 1) batch = 1;
    if (batch > count) batch = (int)(count > 0 ? count : 1);
    inception_to_gpu(net, batch);
    int64_t per_image = (int64_t)height * width * channels;
    if (net->batch * per_image > net->pixels_numel) {
        cudaFree(net->pixels);
        net->pixels_numel = net->batch * per_image;
        net->pixels = (uint8_t *)gpu_malloc(net->pixels_numel);
        for (int s = 0; s < 2; s++) {
            host_staging_free(net->staged_pixels[s], net->staged_pixels_pinned[s]);
            net->staged_pixels[s] = (uint8_t *)host_staging_alloc(net->pixels_numel, &net->staged_pixels_pinned[s]);
        }
    }
    float *out[3] = {pool, spatial, logits}, *features[3] = {net->pool, net->spatial, net->logits};
    int64_t batches = (count + batch - 1) / batch;
    for (int64_t i = 0; i < batches; i++) {
        int n = inception_batch_images(count, batch, i), slot = (int)(i % 2);
        if (i >= 2) inception_unstage(net, count, batch, i - 2, out);  // (which frees the slot's pixels too)
        memcpy(net->staged_pixels[slot], pixels + i * batch * per_image, n * per_image);
        cuda_check(cudaMemcpyAsync(net->pixels, net->staged_pixels[slot], n * per_image, cudaMemcpyHostToDevice, gpu.stream));
        inception_run(net, net->pixels, n, height, width, channels);
        for (int k = 0; k < 3; k++)
            if (out[k])
                cuda_check(cudaMemcpyAsync(inception_staged(net, slot, k), features[k], (size_t)n * inception_dims[k] * sizeof(float),
                                           cudaMemcpyDeviceToHost, gpu.stream));
        cuda_check(cudaEventRecord(net->staged_done[slot], gpu.stream));
    }
    for (int64_t i = batches > 2 ? batches - 2 : 0; i < batches; i++) inception_unstage(net, count, batch, i, out);
    return 0;
}

extern "C" int unet_inception_max_batch(const UnetInception *net, int limit, char *err, size_t err_len) {
    if (api_gpu_ready(err, err_len) != 0) return 0;
    size_t free_bytes, total_bytes;
    cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes));
    int64_t budget = (int64_t)(free_bytes * 0.5);  // half: cuBLASLt and the statistics after it need room too
    int batch = limit;
    while (batch > 1 && unet_inception_gpu_bytes(net, batch) > budget) batch /= 2;
    if (unet_inception_gpu_bytes(net, batch) > budget)
        return error_line(err, err_len, "Inception needs %.2f GiB of GPU memory for one image; %.2f GiB are free",
                          unet_inception_gpu_bytes(net, 1) / 1073741824.0, free_bytes / 1073741824.0), 0;
    return batch;
}
