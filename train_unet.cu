// train_unet.cu: trains guided-diffusion's UNet on NVIDIA GPUs: one translation unit, one binary.
//
// The subsystems the model does not need are headers included at the top (gpu.cuh, config.cuh,
// team.cuh, inception.cuh, fid.cuh), each with a "defines:" line. Then, in data-flow order, each
// section under a line of dashes:
//   the kernels, each layer's forward and backward side by side with its math: channel sums;
//     convolution, its planner and its kernel families (FP32, mma.sync, wgmma, the TMA, split
//     products, halo, image, narrow, running a plan); linear layers; GroupNorm; attention; the
//     classifier head's tokens; resampling; concat; elementwise; the timestep and class embeddings;
//     the loss (and block_sum_256); the update (AdamW, the gradient norm and clipping, EMA);
//     diffusion's per-value kernels (model input, q_sample, a sampling step, the likelihood's terms);
//   the blocks (ResBlock, AttentionBlock, ...: each a struct with its forward and backward);
//   the model (guided-diffusion's architecture and state_dict names, forward, backward);
//   initialisation; profiling; the data loader; diffusion training (schedules, the schedule
//   sampler); the trainer (one step as a CUDA graph); sampling on the GPU; the likelihood;
//   checkpoints.cuh (built on the model: checkpoint folders, a .pt's architecture);
//   run folders; the command line; the training run;
//   unet_api.cuh (the C API for generate.c and evaluate.c); main (weak: generate and evaluate link
//   this object and bring their own).
// Built with -DTRAIN_UNET_LIBRARY it has no main, command line or training run: tests and dev/
// include it so. checkpoint.h reads checkpoint files, dataset.h the dataset, sampler.h holds the
// schedules and samplers' math (plain C, shared with generate.c).
//
// Activations are NHWC (channels last). PRECISION_BF16 (the default) keeps activations in bf16
// with fp32 master weights and fp32 accumulation; PRECISION_FP32 is fp32 throughout.
#include <ctype.h>
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <mma.h>
#include <cuda_runtime.h>
#include <cudaTypedefs.h>  // CUtensorMap, cuTensorMapEncodeTiled's type
#include <dirent.h>
#include <errno.h>
#include <float.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/file.h>
#include <time.h>
#include <unistd.h>

#include "checkpoint.h"
#include "cli.h"
#include "dataset.h"
#include "loss_plot.h"
#include "png.h"
#include "random.h"
#include "sampler.h"
#include "unet_api.h"

// Built with TRAIN_UNET_LIBRARY this file is a library of static functions for the program that
// includes it (a test, a dev/ check), each of which uses a
// different part of it: there a function that program never calls is expected, so nvcc's "declared
// but never referenced" (#177) is off for this file's definitions, and back on at its end for the
// includer's own. The trainer's build keeps it (and library builds leave out main's code).
#ifdef TRAIN_UNET_LIBRARY
#pragma nv_diag_suppress 177
#endif

#include "gpu.cuh"        // defines: floatX and Pack, error lines, random streams, host helpers, the GPU context, matrix products
#include "config.cuh"     // defines: the option table, presets, ModelConfig, its resolution from options or metadata
#include "team.cuh"       // defines: many GPUs: the team's collectives, launchers' environments, the rendezvous, launch_gpus
#include "inception.cuh"  // defines: Inception-v3's features (evaluate, FID during training)
#include "fid.cuh"        // defines: feature statistics, the Fréchet distance, precision and recall on the GPU

// ----------------------------------------------------------------------------------------------
// Per-channel sums of a [rows][C] tensor, by sample: per_sample[n][c] = sum over the sample's rows,
// total[c] = sum over samples (the bias gradient of a layer whose output gradient it is). Two
// passes in a fixed order, so the result is the same on every run.

// The sums passes here and GroupNorm's take a sample's rows in chunks, a block each, and add the
// chunks' partial sums in a second pass: CHUNKS_LEAST chunks a sample, or with few samples about
// `blocks` blocks over the batch, at most CHUNKS_MOST a sample (a thread's loads wait for each
// other, so the memory is kept busy by many blocks). The partial sums' room, in (sample, chunk)
// slots, must hold any batch up to the plan's N (a model runs smaller batches than its plan's, which
// take more chunks a sample): at most max(blocks, CHUNKS_LEAST N).
#define CHUNKS_LEAST 16
#define CHUNKS_MOST 64
static int chunks_for_batch(int N, int blocks) {
    int chunks = blocks / N;
    return chunks < CHUNKS_LEAST ? CHUNKS_LEAST : chunks > CHUNKS_MOST ? CHUNKS_MOST : chunks;
}
static int64_t chunk_slots(int N, int blocks) { return CHUNKS_LEAST * (int64_t)N > blocks ? CHUNKS_LEAST * (int64_t)N : blocks; }

// The channel sums: about 512 blocks, so that small batches still fill the GPU (the chunk counts
// measured in dev/NOTES.md, v).
#define CHANNEL_SUM_BLOCKS 512
static int channel_sum_max_chunks(int N) { return chunks_for_batch(N, CHANNEL_SUM_BLOCKS); }
static int64_t channel_sum_slots(int N) { return chunk_slots(N, CHANNEL_SUM_BLOCKS); }

// Thread t sums vector (t mod vecs) of its chunk's rows t/vecs, t/vecs + rows_per_pass, ...; then
// one thread per channel adds up the rows in shared memory. Rows wider than the block (the
// timestep projections of all ResBlocks) take one thread per vector over all the chunk's rows.
template <typename V>
__global__ void channel_sums_partial_kernel(float *partial, const floatX *x, int rows_per_sample, int C) {
    __shared__ float sums[256][PACK];
    const int per = sizeof(V) / sizeof(floatX), vecs = C / per;
    int n = blockIdx.y, chunk = blockIdx.x;
    int begin = (int)((int64_t)rows_per_sample * chunk / gridDim.x), end = (int)((int64_t)rows_per_sample * (chunk + 1) / gridDim.x);
    float *out = partial + ((int64_t)n * gridDim.x + chunk) * C;
    if (vecs > (int)blockDim.x) {
        for (int lane = threadIdx.x; lane < vecs; lane += blockDim.x) {
            float acc[sizeof(V) / sizeof(floatX)] = {0};
            for (int r = begin; r < end; r++) {
                V v = ((const V *)x)[((int64_t)n * rows_per_sample + r) * vecs + lane];
                for (int j = 0; j < per; j++) acc[j] += (float)v.v[j];
            }
            for (int j = 0; j < per; j++) out[lane * per + j] = acc[j];
        }
        return;
    }
    int lane = threadIdx.x % vecs, row0 = threadIdx.x / vecs, rows_per_pass = blockDim.x / vecs;
    float acc[sizeof(V) / sizeof(floatX)] = {0};
    if (row0 < rows_per_pass)
        for (int r = begin + row0; r < end; r += rows_per_pass) {
            V v = ((const V *)x)[((int64_t)n * rows_per_sample + r) * vecs + lane];
            for (int j = 0; j < per; j++) acc[j] += (float)v.v[j];
        }
    for (int j = 0; j < per; j++) sums[threadIdx.x][j] = acc[j];
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float total = 0.0f;
        for (int r = 0; r < rows_per_pass; r++) total += sums[r * vecs + c / per][c % per];
        out[c] = total;
    }
}

// The partial sums [N][chunks][ld] added up over the first C channels of each row (ld >= C): a block
// per 32 channels, its threads (channel, slice of samples); each thread sums its samples' chunks in
// order, then the slices are added in order. Deterministic. (The samples of a slice are summed one
// after the other: 32 slices keep that chain short.)
#define REDUCE_SLICES 32

__global__ void __launch_bounds__(32 * REDUCE_SLICES)
    channel_sums_final_kernel(float *per_sample, int per_sample_ld, float *total, const float *partial, int N, int chunks, int ld, int C) {
    __shared__ float totals[REDUCE_SLICES][32];
    int c = blockIdx.x * 32 + threadIdx.x, slice = threadIdx.y;
    float all = 0.0f;
    if (c < C)
        for (int n = slice; n < N; n += REDUCE_SLICES) {
            float s = 0.0f;
            for (int k0 = 0; k0 < chunks; k0 += CHUNKS_LEAST)
#pragma unroll
                for (int k = k0; k < k0 + CHUNKS_LEAST; k++)  // CHUNKS_LEAST chunks' loads in flight at once
                    if (k < chunks) s += partial[((int64_t)n * chunks + k) * ld + c];
            if (per_sample) per_sample[(int64_t)n * per_sample_ld + c] += s;
            all += s;
        }
    totals[slice][threadIdx.x] = all;
    __syncthreads();
    if (slice == 0 && c < C) {
        for (int k = 1; k < REDUCE_SLICES; k++) all += totals[k][threadIdx.x];
        if (total) total[c] = all;
    }
}

// Partial channel sums [N][chunks][ld] that a kernel left beside the tensor it wrote (GroupNorm's
// backward, of its dx: ld its channels, of which a tensor read as a concatenation's first part has the
// first C), and the second pass alone over them.
typedef struct {
    const float *partial;
    int chunks, ld;
} ChannelSumsGiven;

static void channel_sums_total(float *per_sample, int per_sample_ld, float *total, ChannelSumsGiven sums, int N, int C) {
    channel_sums_final_kernel<<<(C + 31) / 32, dim3(32, REDUCE_SLICES), 0, gpu.stream>>>(per_sample, per_sample_ld, total, sums.partial,
                                                                                         N, sums.chunks, sums.ld, C);
    cuda_check_launch();
}

static void channel_sums(const Scratch *s, float *per_sample, int per_sample_ld, float *total, const floatX *x, int N, int rows_per_sample, int C) {
    int chunks = rows_per_sample < channel_sum_max_chunks(N) ? rows_per_sample : channel_sum_max_chunks(N);
    if (C % PACK == 0)
        channel_sums_partial_kernel<Pack><<<dim3(chunks, N), 256, 0, gpu.stream>>>(s->channel_sums, x, rows_per_sample, C);
    else
        channel_sums_partial_kernel<Scalar><<<dim3(chunks, N), 256, 0, gpu.stream>>>(s->channel_sums, x, rows_per_sample, C);
    cuda_check_launch();
    channel_sums_total(per_sample, per_sample_ld, total, {s->channel_sums, chunks, C}, N, C);
}

// ----------------------------------------------------------------------------------------------
// Convolution: k = 3 (stride 1 or 2) or k = 1 (stride 1), zero padding k/2, NHWC, weights
// [out][k][k][in], bias [out]. With m an output pixel (n, ho, wo), tap t = 3 kh + kw and
// patch(m, t) = x[n][ho s + kh - 1][wo s + kw - 1] (zero outside the image), Ho = (H - 1)/s + 1:
//   forward       y[m][co]       = sum_{t,ci} patch(m, t)[ci] w[co][t][ci] + b[co] (+ residual[m][co])
//   input grad    dx[p][ci]   (+)= sum_{t,co} dy[m][co] w[co][t][ci] over the (m, t) whose patch reads p
//   weight grad   dW[co][t][ci]  = sum_m dy[m][co] patch(m, t)[ci],   db[co] = sum_m dy[m][co]
// A 3x3 convolution is an implicit GEMM, out[M][Ng] = sum_k A[M][k] B[k][Ng], its operands gathered
// tile by tile straight from the NHWC tensors (no patch matrix in memory):
//   forward       M = output pixels, Ng = C_out,    k = (t, ci)   A = patches of x, B = w
//   input grad    M = input pixels,  Ng = C_in,     k = (t, co)   A = gathered dy,  B = w
//   weight grad   M = C_out,         Ng = 9 C_in,   k = pixel     A = dy^T,         B = patches of x
// Each tensor has its own pixel stride (ld: elements from one pixel to the next), so a kernel reads
// or writes a channel slice of a wider tensor. The weight gradient's sum over pixels is split into
// slices written to scratch, then added in a fixed order: deterministic. A 1x1 convolution is a
// plain product on x (cuBLASLt). The 3x3 products run on seven kernel families, each under a
// sub-banner below: mma.sync (every GPU), wgmma, the TMA, split products and halo (sm_90a), image
// and narrow (the model's first and last convolutions), and the FP32 build's. Which one runs a
// product is the planner's choice (conv_plan, next: its table says what each family takes, why it
// exists and what it gained). The image, halo and wgmma kernels (the last for whole tiles of a
// forward) also leave the channel sums of their output for the GroupNorm that reads it
// (conv_forward_gathering); after the others GroupNorm runs a sums pass of its own.

typedef struct {
    int in, out, k, stride;
    floatX *w, *b;     // [out][k][k][in], [out] (compute copies)
    float *dw, *db;    // fp32 gradients
    const Scratch *scratch;
    int weight;        // its weight's index in the parameter list, which names it
} Conv;

// cp.async: 16-byte copies from global to shared memory that hold no registers while in flight
// (the convolution's operand tiles, GroupNorm's rows).
__device__ __forceinline__ uint32_t conv_smem_address(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }

// 16 bytes global -> shared, bypassing L1; zero-fills when !valid (src then only needs to be a valid address).
__device__ __forceinline__ void conv_cp_async16(void *dst, const void *src, bool valid) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(conv_smem_address(dst)), "l"(src), "r"(valid ? 16 : 0)
                 : "memory");
}
__device__ __forceinline__ void conv_cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int pending>
__device__ __forceinline__ void conv_cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory"); }

static int conv_out_size(int size, int k, int stride) { return (size + 2 * (k / 2) - k) / stride + 1; }

// The weight gradient's tile, BM x BN over (C_out, 9 C_in), and how many blocks of it share a
// multiprocessor (128 x 256: one; the others two), and its slices of the pixel sum. The slices are planned for a
// GPU of CONV_PLAN_SMS multiprocessors (an H100's or H200's 132; a constant, so that the plan needs
// no GPU and the sums come out the same on every GPU): the count, of slices of at least 4 CONV_SLICE_STEPs of pixels, that
// minimises a model of the time (for at most 8 output channels, the narrow kernel's: whole strips of
// CONV_NARROW_ROW pixels, about CONV_NARROW_BLOCKS_PER_SM blocks of 64 channels a multiprocessor),
//   waves x steps per slice x step time  +  the slices' round trip through scratch (written, then added),
// waves = ceil(tiles x slices / blocks at once). A last wave that leaves most multiprocessors idle
// costs as much as a full one, so the block count is fitted to whole waves. The two constants are an
// H100's, measured (dev/NOTES.md).
#define CONV_SLICE_STEP 64             // pixels: a multiple of every tile's k step
#define CONV_NARROW_ROW 128            // the narrow kernels' strips of pixels (input and weight gradients)
#define CONV_NARROW_BLOCKS_PER_SM 3    // the narrow kernels' blocks on a multiprocessor at once
#define CONV_PLAN_SMS 132
#define CONV_PLAN_STEP_US 1.0          // one multiprocessor's k step over 128 x 256 outputs
#define CONV_PLAN_SCRATCH_BYTES_PER_US 2.5e6

// 128 x 256 tiles (conv3x3_tma_kernel's; the kernels without the TMA run them as two 128 x 128 tiles,
// with the same slices), or 64-row ones where 128-row ones would leave a quarter of their rows or
// more empty (C_out = 64, 96, 192). Both choices measured against the others: dev/NOTES.md (g, qq).
static void conv_weight_grad_tile(int C_in, int C_out, int *BM, int *BN, int *blocks_per_sm) {
    int padded = (C_out + 127) / 128 * 128;
    if (C_out <= 32) *BM = 32, *BN = 128;
    else if (9 * C_in <= 32) *BM = 128, *BN = 32;
    else if (4 * (padded - C_out) < padded) *BM = 128, *BN = 256;
    else *BM = 64, *BN = 128;  // two of them: 1.07-1.24x of one 64 x 256 block per multiprocessor (H100)
    if (blocks_per_sm) *blocks_per_sm = *BN == 256 ? 1 : 2;
}

static int conv3x3_weight_grad_slices(int N, int H, int W, int C_in, int C_out, int stride, int *pixels_per_slice) {
    int BM, BN, per_sm;
    conv_weight_grad_tile(C_in, C_out, &BM, &BN, &per_sm);
    int64_t pixels = (int64_t)N * conv_out_size(H, 3, stride) * conv_out_size(W, 3, stride);
    int steps = (int)((pixels + CONV_SLICE_STEP - 1) / CONV_SLICE_STEP);
    if (C_out <= 8 && stride == 1) {  // the narrow kernel's: whole strips, its blocks of 64 channels at once
        int chunks = (C_in + 63) / 64, want = (CONV_NARROW_BLOCKS_PER_SM * CONV_PLAN_SMS + chunks - 1) / chunks;
        int strips = (int)((pixels + CONV_NARROW_ROW - 1) / CONV_NARROW_ROW), per = (strips + want - 1) / want;
        if (pixels_per_slice) *pixels_per_slice = per * CONV_NARROW_ROW;
        return (strips + per - 1) / per;
    }
    int tiles = ((C_out + BM - 1) / BM) * ((9 * C_in + BN - 1) / BN), at_once = CONV_PLAN_SMS * per_sm;
    double step_us = CONV_PLAN_STEP_US * BM * BN * per_sm / (128 * 256);
    double slice_us = 8.0 * C_out * 9 * C_in / CONV_PLAN_SCRATCH_BYTES_PER_US;
    int best_per = steps;
    double best_us = INFINITY;
    for (int want = 1; want <= steps / 4 || want == 1; want++) {
        int per = (steps + want - 1) / want, slices = (steps + per - 1) / per;
        double us = (double)((tiles * slices + at_once - 1) / at_once) * per * step_us + (slices > 1 ? slices * slice_us : 0);
        if (us < best_us) best_us = us, best_per = per;
    }
    if (pixels_per_slice) *pixels_per_slice = best_per * CONV_SLICE_STEP;
    return (steps + best_per - 1) / best_per;
}

// The scratch floats conv3x3_backward_weight needs for this shape (0: none).
static int64_t conv3x3_weight_grad_scratch_floats(int N, int H, int W, int C_in, int C_out, int stride) {
    int slices = conv3x3_weight_grad_slices(N, H, W, C_in, C_out, stride, NULL);
    return slices > 1 ? (int64_t)slices * C_out * 9 * C_in : 0;
}

enum { CONV_FORWARD, CONV_INPUT_GRAD, CONV_WEIGHT_GRAD };

// Split products. A forward or input-gradient product of 128 x 128 tiles whose grid fills at most half a
// wave of CONV_PLAN_SMS multiprocessors (seed:32's 8x8 level: 32 blocks, each running all 36 k steps)
// splits its k (taps x channels) into slices of ceil(steps / slices) k steps (the last may be shorter),
// slices = up to two blocks per multiprocessor, at most k steps / CONV_SPLIT_MIN_STEPS; each slice's
// products go to scratch in fp32 and conv_split_finish_kernel adds them in order with the bias and
// residual, or what dx held. Into 4 or more slices only: two measured slower than one (H100,
// dev/NOTES.md (f)). BF16 sm_90a kernels only (other GPUs' kernels do not split); planned
// for CONV_PLAN_SMS like the weight gradient, so the bits are the same on every Hopper GPU. A call
// whose scratch is too small (a batch other than the plan's) runs unsplit: its last bits may then
// differ from the plan's batch. 1: not split.
#define CONV_SPLIT_MAX 8
#define CONV_SPLIT_MIN 4
#define CONV_SPLIT_MIN_STEPS 4
static int conv3x3_split_slices(int op, int N, int H, int W, int C_in, int C_out, int stride, int *k_per_slice) {
#if defined(PRECISION_FP32)
    (void)op, (void)N, (void)H, (void)W, (void)C_in, (void)C_out, (void)stride, (void)k_per_slice;
    return 1;
#else
    int C = op == CONV_FORWARD ? C_in : C_out, Ng = op == CONV_FORWARD ? C_out : C_in;
    if (C % 64 != 0 || Ng < 128 || (op == CONV_INPUT_GRAD && stride != 1)) return 1;  // (stride 2: parity-ordered rows)
    int64_t M = op == CONV_FORWARD ? (int64_t)N * conv_out_size(H, 3, stride) * conv_out_size(W, 3, stride) : (int64_t)N * H * W;
    int64_t blocks = (M + 127) / 128 * ((Ng + 127) / 128);
    int steps = 9 * C / 64, slices = (int)(2 * CONV_PLAN_SMS / blocks);
    if (blocks > CONV_PLAN_SMS / 2) return 1;
    if (slices > CONV_SPLIT_MAX) slices = CONV_SPLIT_MAX;
    if (slices > steps / CONV_SPLIT_MIN_STEPS) slices = steps / CONV_SPLIT_MIN_STEPS;
    if (slices < CONV_SPLIT_MIN) return 1;
    int per = (steps + slices - 1) / slices;
    if (k_per_slice) *k_per_slice = per * 64;
    return (steps + per - 1) / per;
#endif
}

// The scratch floats a split product of this shape needs (0: none).
static int64_t conv3x3_split_scratch_floats(int op, int N, int H, int W, int C_in, int C_out, int stride) {
    int slices = conv3x3_split_slices(op, N, H, W, C_in, C_out, stride, NULL);
    if (slices < 2) return 0;
    int64_t M = op == CONV_FORWARD ? (int64_t)N * conv_out_size(H, 3, stride) * conv_out_size(W, 3, stride) : (int64_t)N * H * W;
    return slices * M * (op == CONV_FORWARD ? C_out : C_in);
}

// ----------------------------------------------------------------------------------------------
// Convolution: the planner. Which kernel runs a 3x3 product, with which tile and slices, is one pure
// host function of the product (its shape, and what its operands allow) and of the GPU: conv_plan.
// It tries the kernel families in this order and takes the first that takes the product (each
// family's rule, what it takes, is its case in conv_family_takes):
//   family   products       why it exists                                             measured (dev/NOTES.md)
//   image    forward        3 input channels: too few for 16-byte loads              j
//   narrow   all three      at most 8 output channels (the output head): the input   j, rr
//                           halo read once, every tap from shared memory; the
//                           gradients as short mma.sync products
//   halo     fwd, dgrad     each input element read into shared memory about once    e, ww
//            (k <= 9 x 256) instead of once a tap (not where the TMA's 128 x 256
//                           tiles cover the product's width)
//   split    fwd, dgrad     grids of at most half a wave: k in 4-8 slices            f
//   wgmma    all three      Hopper's warpgroup products; operands through the TMA    g
//                           where its boxes fit
//   mma      all three      every other GPU and shape (mma.sync)                     the base
//   fp32     all three      the FP32 build: one thread per output value              the reference precision
// Every family but mma and fp32 is a product the base runs too; each gains on the shapes it takes
// (the letters: the entries of dev/NOTES.md that measured the gain).
// A dev tool may force a family by name (conv_dev): the plan then takes that family or refuses.

#define CONV_IMAGE_CHANNELS 3  // the model's input: RGB

enum { CONV_IMAGE, CONV_NARROW, CONV_HALO, CONV_SPLIT, CONV_WGMMA, CONV_MMA, CONV_FP32, CONV_FAMILIES, CONV_NONE = -1 };
static const char *const conv_family_names[CONV_FAMILIES] = {"image", "narrow", "halo", "split", "wgmma", "mma", "fp32"};

// What the planner knows of one product: its shape, and what its operands and output allow.
typedef struct {
    int op, N, H, W, C_in, C_out, stride;
    bool vec_a, vec_b;          // each operand loads in 16-byte chunks (channels, pixel stride, address)
    bool pair_store, vec_store; // the output (and a residual) stores 4, and 16, bytes at a time (16: the bias read so too)
    bool out_aligned;           // the output's pixel stride a multiple of 8 elements, its address of 16 bytes
    bool bias, bias_aligned;    // forward: a bias, on a 4-byte boundary
    bool residual;              // forward: a residual added
    int64_t split_floats;       // the scratch a split product may use
} ConvProblem;

// The GPU as the planner sees it: Hopper's sm_90a kernels, the TMA, the multiprocessors.
typedef struct {
    bool sm90a, tma;
    int sms;
} ConvTarget;

// The planner's answer: the family, its tile (BM x BN; the halo kernel's rows of output a tile), and
// the slices of k or of the pixel sum (1: none).
typedef struct {
    int family;  // CONV_NONE: the forced family does not take the product
    int BM, BN, rows, slices, k_per_slice;
    bool tma;  // wgmma and split: the operands through the TMA
} ConvPlan;

// What a dev tool may ask (dev/bench_conv.cu): a family forced by name (-1: none), and a GPU of `sms`
// multiprocessors assumed for plans and persistent grids (0: this GPU's; 1 gives the widest tiles and
// makes every persistent kernel loop over its tiles).
static struct {
    int family, sms;
} conv_dev = {-1, 0};

#if !defined(PRECISION_FP32)  // (the TMA: the BF16 build's sm_90a kernels only)
// A box of `pixels` consecutive pixels of N images of H x W, as imgs x rows x cols (box dimensions 3,
// 2, 1), for tiles and k steps that start at multiples of `pixels`: a segment of one row, whole rows of
// one image, or whole images. False where none fits.
static bool conv_pixel_box(int H, int W, int pixels, uint32_t *cols, uint32_t *rows, uint32_t *imgs) {
    *cols = (uint32_t)(W < pixels ? W : pixels), *rows = *imgs = 1;
    if (W >= pixels) return W % pixels == 0;
    if (pixels % W != 0) return false;
    *rows = (uint32_t)(pixels / W);
    if (H % (int)*rows == 0) return true;
    *rows = (uint32_t)H, *imgs = (uint32_t)(pixels / (H * W));
    return pixels % (H * W) == 0;
}

// Whether conv3x3_tma_kernel takes this product (given the wgmma tiles, operands in 16-byte chunks):
// stride 1, 64-channel boxes along k (forward, input gradient) or along each tap's columns (weight
// gradient), and pixel boxes for the tile (128 rows) or the k step (64 pixels).
static bool conv_tma_takes(const ConvProblem *q, const ConvTarget *t) {
    uint32_t cols, rows, imgs;
    int k_channels = q->op == CONV_INPUT_GRAD ? q->C_out : q->C_in;
    return t->tma && q->stride == 1 && k_channels % 64 == 0 &&
           conv_pixel_box(q->H, q->W, q->op == CONV_WEIGHT_GRAD ? 64 : 128, &cols, &rows, &imgs);
}
#endif

// The width of the wgmma kernels' tiles (128 rows) for a forward or input-gradient product M x Ng:
// 64 for a product 64 wide, else the width of 128, 192 (forward only: its B tile is K-major) or 256
// that pads the product's width least (the wider on a tie), narrowed to 128 when the wider one leaves
// multiprocessors idle. (Unused in the FP32 build, which plans no wgmma kernels.)
__attribute__((unused)) static int conv_wgmma_width(bool fwd, int64_t M, int Ng, const ConvTarget *t) {
    if (Ng == 64) return 64;
    int BN = 128;
    for (int bn = 192; bn <= 256; bn += 64)
        if ((bn != 192 || fwd) && (Ng + bn - 1) / bn * bn <= (Ng + BN - 1) / BN * BN) BN = bn;
    return (M + 127) / 128 * ((Ng + BN - 1) / BN) < t->sms ? 128 : BN;
}

// Whether family f takes the product, and if so its tile (and a split product's slices) in *plan.
static bool conv_family_takes(int f, const ConvProblem *q, const ConvTarget *t, ConvPlan *plan) {
#if defined(PRECISION_FP32)
    (void)t;
    return f == CONV_FP32;
#else
    const int op = q->op, fwd = op == CONV_FORWARD, wgrad = op == CONV_WEIGHT_GRAD;
    const int Ng = fwd ? q->C_out : op == CONV_INPUT_GRAD ? q->C_in : 9 * q->C_in, k_channels = fwd ? q->C_in : q->C_out;
    const int64_t M = fwd ? (int64_t)q->N * conv_out_size(q->H, 3, q->stride) * conv_out_size(q->W, 3, q->stride)
                          : (int64_t)q->N * q->H * q->W;
    const bool hopper = t->sm90a && q->vec_a && q->vec_b;
    int wgrad_BM, wgrad_BN;
    conv_weight_grad_tile(q->C_in, q->C_out, &wgrad_BM, &wgrad_BN, NULL);
    switch (f) {
    case CONV_IMAGE:  // (shared memory: 42 KB at most)
        return fwd && q->C_in == CONV_IMAGE_CHANNELS && q->stride == 1 && q->C_out % 64 == 0 && q->C_out <= 256 && !q->residual &&
               q->bias && q->out_aligned;
    case CONV_NARROW: {  // (the input gradient: dx stored 16 bytes at a time; the weight gradient: x read in 16-byte
                         // chunks, in strips of CONV_NARROW_ROW pixels inside one image, whole strips a slice)
        if (q->C_out > 8 || q->stride != 1) return false;
        if (fwd) return q->C_in % 64 == 0 && q->C_in <= 512 && q->vec_a && !q->residual && q->bias;
        if (!wgrad) return q->C_in % 64 == 0 && q->vec_store;
        uint32_t cols, rows, imgs;
        return q->C_in % 64 == 0 && q->vec_b && conv_pixel_box(q->H, q->W, CONV_NARROW_ROW, &cols, &rows, &imgs) && imgs == 1 &&
               plan->k_per_slice % CONV_NARROW_ROW == 0;
    }
    case CONV_HALO:  // (a pixel's channels stored 16 bytes at a time; k of at most 9 x 256: wgmma's tiles are faster on
                     // longer ones; nor where the TMA's 128 x 256 tiles cover the product's width: they read 80 bytes
                     // of shared memory a cycle of products to the halo's 96; dev/NOTES.md v, ww)
        if (wgrad || !hopper || q->stride != 1 || q->W % 64 != 0 || q->C_in % 64 != 0 || q->C_out % 64 != 0 || !q->pair_store ||
            !q->vec_store || (q->bias && !q->bias_aligned) || k_channels > 256 ||
            (Ng % 256 == 0 && conv_tma_takes(q, t) && conv_wgmma_width(fwd, M, Ng, t) == 256))
            return false;
        plan->BN = fwd && Ng % 192 == 0 ? 192 : Ng % 128 == 0 ? 128 : 64;
        plan->rows = plan->BN == 64 ? 8 : 4;
        return true;
    case CONV_SPLIT: {
        if (wgrad || !hopper || Ng < 64 || k_channels % 64 != 0) return false;
        int k_per_slice, slices = conv3x3_split_slices(op, q->N, q->H, q->W, q->C_in, q->C_out, q->stride, &k_per_slice);
        if (slices < 2 || (int64_t)slices * M * Ng > q->split_floats) return false;
        plan->BM = plan->BN = 128, plan->slices = slices, plan->k_per_slice = k_per_slice, plan->tma = conv_tma_takes(q, t);
        return true;
    }
    case CONV_WGMMA:
        if (wgrad) {  // 32-wide tiles run on mma.sync
            if (!hopper || q->H >= 32768 || q->W >= 32768 || wgrad_BM == 32 || wgrad_BN == 32) return false;
            plan->BM = wgrad_BM, plan->tma = conv_tma_takes(q, t);
            plan->BN = plan->tma ? wgrad_BN : 128;
            return true;
        }
        if (!hopper || Ng < 64 || k_channels % 64 != 0) return false;
        plan->BM = 128, plan->BN = conv_wgmma_width(fwd, M, Ng, t), plan->tma = conv_tma_takes(q, t);
        return true;
    case CONV_MMA:
        if (wgrad) {  // the weight gradient's tile, a 64-row one as two blocks of 64 x 256, a 128 x 256 one as 128 x 128
            plan->BM = wgrad_BM, plan->BN = wgrad_BN;
            if (wgrad_BM == 64) plan->BN = 256;
            else if (wgrad_BN == 256) plan->BN = 128;
        } else {  // 128 x 128 is the fastest, also where its last column of tiles is partly empty (Ng = 192), except at Ng = 64
            plan->BM = Ng > 32 && Ng <= 64 ? 256 : 128;
            plan->BN = Ng <= 32 ? 32 : Ng <= 64 ? 64 : 128;
        }
        return true;
    default:
        return false;
    }
#endif
}

// The plan of a product on a GPU: the first family that takes it, or the one forced (family >= 0),
// CONV_NONE when that one does not.
static ConvPlan conv_plan(const ConvProblem *q, const ConvTarget *t, int forced) {
    ConvPlan base = {CONV_NONE, 0, 0, 0, 1, 0, false};  // a weight gradient's slices: the same whichever kernel runs it
    if (q->op == CONV_WEIGHT_GRAD)
        base.slices = conv3x3_weight_grad_slices(q->N, q->H, q->W, q->C_in, q->C_out, q->stride, &base.k_per_slice);
    for (int f = 0; f < CONV_FAMILIES; f++) {
        ConvPlan plan = base;
        plan.family = f;
        if ((forced < 0 || f == forced) && conv_family_takes(f, q, t, &plan)) return plan;
    }
    ConvPlan none = {CONV_NONE, 0, 0, 0, 1, 0, false};
    return none;
}

// One line for a plan: "halo 4x192", "wgmma 128x256 tma", "split 128x128 x4", "mma 128x32 x3", "fp32".
static const char *conv_plan_text(const ConvPlan *p, char *out, size_t len) {
    if (p->family == CONV_NONE) return snprintf(out, len, "none"), out;
    int n = snprintf(out, len, "%s", conv_family_names[p->family]);
    if (p->family == CONV_HALO) n += snprintf(out + n, len - n, " %dx%d", p->rows, p->BN);
    else if (p->BM) n += snprintf(out + n, len - n, " %dx%d", p->BM, p->BN);
    if (p->tma) n += snprintf(out + n, len - n, " tma");
    if (p->slices > 1) snprintf(out + n, len - n, " x%d", p->slices);
    return out;
}

// A layer's product as the model runs it, for listings and tests: its tensors 16-byte aligned with
// the channels as pixel strides, a bias and no residual, the split scratch as the plan sizes it.
static ConvProblem conv_layer_problem(int op, int N, int size, int C_in, int C_out, int stride) {
    bool vec_in = C_in % 8 == 0, vec_out = C_out % 8 == 0;
    ConvProblem q = {op, N, size, size, C_in, C_out, stride, false, false, false, false, false, false, false, false, INT64_MAX};
    if (op == CONV_FORWARD) q.vec_a = q.vec_b = vec_in, q.pair_store = C_out % 2 == 0, q.vec_store = q.out_aligned = vec_out;
    else if (op == CONV_INPUT_GRAD) q.vec_a = vec_out, q.vec_b = vec_in, q.pair_store = C_in % 2 == 0, q.vec_store = q.out_aligned = vec_in;
    else q.vec_a = vec_out, q.vec_b = vec_in;
    q.bias = q.bias_aligned = op == CONV_FORWARD;
    return q;
}

// The GPU as the plans see it (a dev tool's multiprocessors where it sets them), and the plan a
// product runs with, kept for dev tools to check (conv_last_plan).
static int conv_sms(void) { return conv_dev.sms ? conv_dev.sms : gpu.num_sms; }
static ConvPlan conv_last_plan;

static ConvPlan conv_choose(const ConvProblem *q, bool tma_available) {
    ConvTarget t = {gpu.sm90a != 0, tma_available, conv_sms()};
    conv_last_plan = conv_plan(q, &t, conv_dev.family);
    return conv_last_plan;
}

// Raises a kernel's limit of dynamic shared memory to smem bytes at its first launch (configured:
// its launcher's flag, one a kernel).
template <typename Kernel>
static void allow_dynamic_smem(Kernel kernel, bool *configured, size_t smem) {
    if (!*configured) {
        cuda_check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
        *configured = true;
    }
}

#if defined(PRECISION_FP32)
// ---- 3x3 convolution: the FP32 build (one thread per output value) ----

// FP32: one thread per output value, on CUDA cores.

// y[m][co] = b[co] + sum_{t,ci} patch(m, t)[ci] w[co][t][ci] (+ residual[m][co]).
__global__ void conv3x3_forward_kernel(float *y, int ldy, const float *x, int ldx, const float *w, const float *bias,
                                       const float *residual, int ldr, int N, int H, int W, int C_in, int C_out, int stride,
                                       int Ho, int Wo) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)N * Ho * Wo * C_out) return;
    int co = (int)(i % C_out), m = (int)(i / C_out), wo = m % Wo, ho = (m / Wo) % Ho, n = m / (Wo * Ho);
    float sum = 0.0f;
    for (int kh = 0; kh < 3; kh++) {
        int h = ho * stride + kh - 1;
        if (h < 0 || h >= H) continue;
        for (int kw = 0; kw < 3; kw++) {
            int ww = wo * stride + kw - 1;
            if (ww < 0 || ww >= W) continue;
            const float *xp = x + ((int64_t)(n * H + h) * W + ww) * ldx, *wp = w + ((int64_t)co * 9 + kh * 3 + kw) * C_in;
            for (int ci = 0; ci < C_in; ci++) sum += xp[ci] * wp[ci];
        }
    }
    sum += bias[co];
    if (residual) sum += residual[(int64_t)m * ldr + co];
    y[(int64_t)m * ldy + co] = sum;
}

// dx[n][h][w][ci] (+)= sum over the taps (kh, kw) with (h + 1 - kh, w + 1 - kw) = s (ho, wo) inside dy
// of sum_co dy[n][ho][wo][co] w[co][kh][kw][ci].
__global__ void conv3x3_backward_input_kernel(float *dx, int lddx, GradMode mode, const float *dy, int lddy, const float *w,
                                              int N, int H, int W, int C_in, int C_out, int stride, int Ho, int Wo) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (int64_t)N * H * W * C_in) return;
    int ci = (int)(i % C_in), p = (int)(i / C_in), ww = p % W, h = (p / W) % H, n = p / (W * H);
    float sum = 0.0f;
    for (int kh = 0; kh < 3; kh++) {
        int hs = h + 1 - kh;
        if (hs < 0 || hs % stride || hs / stride >= Ho) continue;
        for (int kw = 0; kw < 3; kw++) {
            int ws = ww + 1 - kw;
            if (ws < 0 || ws % stride || ws / stride >= Wo) continue;
            const float *g = dy + ((int64_t)(n * Ho + hs / stride) * Wo + ws / stride) * lddy;
            const float *wp = w + (kh * 3 + kw) * C_in + ci;
            for (int co = 0; co < C_out; co++) sum += g[co] * wp[(int64_t)co * 9 * C_in];
        }
    }
    dx[(int64_t)p * lddx + ci] = mode == GRAD_ADD ? dx[(int64_t)p * lddx + ci] + sum : sum;
}

// out[slice][co][t][ci] = sum over the slice's output pixels m of dy[m][co] patch(m, t)[ci].
__global__ void conv3x3_backward_weight_kernel(float *out, const float *dy, int lddy, const float *x, int ldx, int N, int H,
                                               int W, int C_in, int C_out, int stride, int Ho, int Wo, int pixels_per_slice) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, taps_in = 9 * C_in;
    if (i >= C_out * taps_in) return;
    int co = i / taps_in, tap = (i / C_in) % 9, ci = i % C_in, kh = tap / 3, kw = tap % 3, pixels = N * Ho * Wo;
    int first = blockIdx.y * pixels_per_slice, last = min(pixels, first + pixels_per_slice);
    float sum = 0.0f;
    for (int m = first; m < last; m++) {
        int wo = m % Wo, ho = (m / Wo) % Ho, n = m / (Wo * Ho), h = ho * stride + kh - 1, ww = wo * stride + kw - 1;
        if (h < 0 || h >= H || ww < 0 || ww >= W) continue;
        sum += dy[(int64_t)m * lddy + co] * x[((int64_t)(n * H + h) * W + ww) * ldx + ci];
    }
    out[(int64_t)blockIdx.y * C_out * taps_in + i] = sum;
}

static int conv3x3_forward(floatX *y, int ldy, const floatX *x, int ldx, const floatX *w, const floatX *bias,
                           const floatX *residual, int ldr, int N, int H, int W, int C_in, int C_out, int stride, float *split,
                           int64_t split_floats, double *sums, int64_t sums_numel) {
    (void)split, (void)split_floats, (void)sums, (void)sums_numel;  // never split; gathers no channel sums
    ConvProblem q = {CONV_FORWARD, N, H, W, C_in, C_out, stride};
    conv_choose(&q, false);  // (the FP32 family, recorded for dev tools)
    int Ho = conv_out_size(H, 3, stride), Wo = conv_out_size(W, 3, stride);
    int64_t total = (int64_t)N * Ho * Wo * C_out;
    conv3x3_forward_kernel<<<(unsigned)((total + 255) / 256), 256, 0, gpu.stream>>>(y, ldy, x, ldx, w, bias, residual, ldr, N,
                                                                                  H, W, C_in, C_out, stride, Ho, Wo);
    cuda_check_launch();
    return 0;
}

static void conv3x3_backward_input(floatX *dx, int lddx, GradMode mode, const floatX *dy, int lddy, const floatX *w, int N,
                                   int H, int W, int C_in, int C_out, int stride, float *split, int64_t split_floats) {
    (void)split, (void)split_floats;  // never split
    ConvProblem q = {CONV_INPUT_GRAD, N, H, W, C_in, C_out, stride};
    conv_choose(&q, false);
    int Ho = conv_out_size(H, 3, stride), Wo = conv_out_size(W, 3, stride);
    int64_t total = (int64_t)N * H * W * C_in;
    conv3x3_backward_input_kernel<<<(unsigned)((total + 255) / 256), 256, 0, gpu.stream>>>(dx, lddx, mode, dy, lddy, w, N, H,
                                                                                         W, C_in, C_out, stride, Ho, Wo);
    cuda_check_launch();
}

static void conv3x3_backward_weight(float *dw, float *scratch, const floatX *dy, int lddy, const floatX *x, int ldx, int N,
                                    int H, int W, int C_in, int C_out, int stride) {
    ConvProblem q = {CONV_WEIGHT_GRAD, N, H, W, C_in, C_out, stride};
    ConvPlan plan = conv_choose(&q, false);
    int Ho = conv_out_size(H, 3, stride), Wo = conv_out_size(W, 3, stride), slices = plan.slices, total = C_out * 9 * C_in;
    dim3 grid((total + 255) / 256, slices);
    conv3x3_backward_weight_kernel<<<grid, 256, 0, gpu.stream>>>(slices > 1 ? scratch : dw, dy, lddy, x, ldx, N, H, W, C_in,
                                                                 C_out, stride, Ho, Wo, plan.k_per_slice);
    cuda_check_launch();
    if (slices > 1) sum_slices(dw, scratch, slices, total);
}

#else
// ---- 3x3 convolution: mma.sync (every GPU; the BF16 build's base) ----

// BF16: the implicit GEMMs on tensor cores.

#define CONV_PAD 8        // elements added to each shared-memory line: ldmatrix reads 8 lines without bank conflicts
#define CONV_THREADS 256  // 8 warps

static bool conv_aligned16(const void *p) { return ((uintptr_t)p & 15) == 0; }

// n / d for 0 <= n < 2^31 as a multiply-high and a shift (d >= 1).
typedef struct {
    uint32_t mul, shift;
} ConvDivisor;

static ConvDivisor conv_divisor(int d) {
    ConvDivisor f;
    f.shift = 0;
    while ((1u << f.shift) < (uint32_t)d) f.shift++;
    f.mul = (uint32_t)(((1ull << 32) * ((1ull << f.shift) - (uint64_t)d)) / (uint64_t)d + 1);
    return f;
}

__device__ __forceinline__ int conv_div(int n, ConvDivisor f) {
    return (int)((__umulhi((uint32_t)n, f.mul) + (uint32_t)n) >> f.shift);
}

// One convolution as the product out[M][Ng] = A B over K (see the top of the section). Pixel counts
// (N H W) stay below 2^31; element offsets are 64-bit.
typedef struct {
    int N, H, W, C_in, C_out, stride, Ho, Wo;
    int M, Ng, K, k_per_slice;  // k_per_slice: a multiple of the tile's BK
    ConvDivisor div_out_pixels, div_Wo, div_in_pixels, div_W, div_C_in, div_C_out;  // Ho*Wo, Wo, H*W, W, C_in, C_out
    const floatX *x, *dy, *w, *bias, *residual;
    int ldx, lddy, ldr, ldo;
    floatX *out;     // y (forward) or dx (input gradient)
    float *out_f;    // weight gradient: [slice][C_out][9 C_in]
    int pair_store;  // two adjacent output values may be written as one aligned pair
    int vec_store;   // 8 adjacent ones as 16 aligned bytes (out's rows: ldo % 8 == 0, 16-byte aligned; so are the
                     // forward's residual rows and bias, which the store reads 16 bytes at a time)
    int add_out;     // the input gradient is added to what out holds (GRAD_ADD), else written over it
    // The wgmma kernel's stride-2 input gradient numbers its rows (input pixels) by parity class: class
    // c = 2 (h % 2) + w % 2 holds rows [class_start[c], class_start[c + 1]), in (n, h / 2, w / 2) order.
    int parity_rows, class_start[5];
    // Forward, where the kernel gathers them (conv3x3_forward): the channel sums of y as stored, per
    // tile of pixels inside one image, for the GroupNorm that reads y next:
    //   sums[(tile C_out + c) 2 + 0, 1] = (sum y, sum y^2) over the tile's pixels, channel c
    double *sums;
    int sum_rows;        // the wgmma kernels' slots: 128 rows (a tile), or 64 (a warpgroup's)
    int64_t sums_numel;  // (host) the doubles sums holds
} ConvGemm;

template <bool transpose>
__device__ __forceinline__ void conv_ldmatrix_x4(uint32_t r[4], const floatX *p) {
    if (transpose)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(conv_smem_address(p)));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(conv_smem_address(p)));
}

// c += a b for a 16x16 bf16 tile of A (row-major) and a 16x8 tile of B (column-major), fp32 c.
__device__ __forceinline__ void conv_mma_bf16(float c[4], const uint32_t a[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Operand load: element (row, k) of A or B (rows count M for A, Ng for B) lives at an offset from its
// tensor, or is zero (padding, or past the product's edge: offset -1). A thread's rows stay the same
// through the k loop, so what depends on the row alone is worked out once (ConvRow), and each k step
// adds only what depends on k. (This is where a normalisation of x can be applied as it loads.)

typedef struct {
    int a, b, c;
} ConvRow;

#define CONV_NO_ROW (-(1 << 29))  // a row past the edge: every bounds check on it fails

// Offset of x[n][h][w][c] for output pixel `pixel` = (n, ho, wo) and (h, w) = (ho s - 1 + kh, wo s - 1 + kw),
// or -1 in the padding.
__device__ __forceinline__ int64_t conv_patch_offset(const ConvGemm &p, int pixel, int kh, int kw, int c) {
    int n = conv_div(pixel, p.div_out_pixels), rest = pixel - n * (p.Ho * p.Wo);
    int ho = conv_div(rest, p.div_Wo), wo = rest - ho * p.Wo;
    int h = ho * p.stride + kh - 1, w = wo * p.stride + kw - 1;
    if (h < 0 || h >= p.H || w < 0 || w >= p.W) return -1;
    return ((int64_t)(n * p.H + h) * p.W + w) * p.ldx + c;
}

template <int OP, bool IS_A>
__device__ __forceinline__ ConvRow conv_row(const ConvGemm &p, int row) {
    ConvRow r = {-1, CONV_NO_ROW, CONV_NO_ROW};
    if (row >= (IS_A ? p.M : p.Ng)) return r;
    if (IS_A && OP == CONV_FORWARD) {  // output pixel (n, ho, wo): a = pixel index of x at (ho s - 1, wo s - 1), b, c = those
        int n = conv_div(row, p.div_out_pixels), rest = row - n * (p.Ho * p.Wo);
        int ho = conv_div(rest, p.div_Wo), wo = rest - ho * p.Wo;
        r.b = ho * p.stride - 1, r.c = wo * p.stride - 1, r.a = (n * p.H + r.b) * p.W + r.c;
    } else if (IS_A && OP == CONV_INPUT_GRAD) {  // input pixel (n, h, w): a = n Ho, b = h + 1, c = w + 1
        int n = conv_div(row, p.div_in_pixels), rest = row - n * (p.H * p.W);
        int h = conv_div(rest, p.div_W);
        r.a = n * p.Ho, r.b = h + 1, r.c = rest - h * p.W + 1;
    } else if (!IS_A && OP == CONV_WEIGHT_GRAD) {  // column t C_in + ci: a = kh, b = kw, c = ci
        int tap = conv_div(row, p.div_C_in);
        r.a = tap / 3, r.b = tap % 3, r.c = row - tap * p.C_in;
    } else {
        r.a = row;  // a channel
    }
    return r;
}

template <int OP, bool IS_A>
__device__ __forceinline__ int64_t conv_offset(const ConvGemm &p, ConvRow r, int k) {
    if (k >= p.K || (r.a < 0 && !(IS_A && OP == CONV_FORWARD))) return -1;
    if (IS_A && OP == CONV_FORWARD) {  // patch(m, t)[ci], k = t C_in + ci
        int tap = conv_div(k, p.div_C_in), kh = tap / 3, kw = tap - 3 * kh;
        int h = r.b + kh, w = r.c + kw;
        if ((unsigned)h >= (unsigned)p.H || (unsigned)w >= (unsigned)p.W) return -1;
        return (int64_t)(r.a + kh * p.W + kw) * p.ldx + (k - tap * p.C_in);
    }
    if (IS_A && OP == CONV_INPUT_GRAD) {  // dy[n][ho][wo][co] with (h, w) = (ho s + kh - 1, wo s + kw - 1), k = t C_out + co
        int tap = conv_div(k, p.div_C_out), kh = tap / 3, kw = tap - 3 * kh;
        int hs = r.b - kh, ws = r.c - kw;
        if (hs < 0 || ws < 0 || ((hs | ws) & (p.stride - 1))) return -1;
        int ho = p.stride == 1 ? hs : hs >> 1, wo = p.stride == 1 ? ws : ws >> 1;
        if (ho >= p.Ho || wo >= p.Wo) return -1;
        return ((int64_t)(r.a + ho) * p.Wo + wo) * p.lddy + (k - tap * p.C_out);
    }
    if (IS_A) return (int64_t)k * p.lddy + r.a;                   // weight grad: dy[pixel k][co]
    if (OP == CONV_FORWARD) return (int64_t)r.a * p.K + k;        // w[co][k]
    if (OP == CONV_INPUT_GRAD) {                                  // w[co][t][ci], k = t C_out + co
        int tap = conv_div(k, p.div_C_out);
        return ((int64_t)(k - tap * p.C_out) * 9 + tap) * p.C_in + r.a;
    }
    return conv_patch_offset(p, k, r.a, r.b, r.c);  // weight grad: patch(pixel k, t)[ci]
}

// A shared tile of rows [row0, row0 + R) x k [k0, k0 + BK) of an operand, laid out [R][BK + PAD] when
// K_MAJOR (k contiguous in memory), else [BK][R + PAD] (rows contiguous). VEC: 16-byte cp.async chunks
// of 8 elements along the contiguous side (channel counts and strides multiples of 8, so a chunk is all
// inside or all outside); otherwise one element at a time through registers. Each thread copies the
// same UNITS (row, k - k0) places at every k step; it keeps their ConvRows when they are few (KEEP).
template <int OP, bool IS_A, int R, int BK, bool K_MAJOR, bool VEC>
struct ConvOperand {
    static constexpr int E = VEC ? 8 : 1, LD = K_MAJOR ? BK + CONV_PAD : R + CONV_PAD;
    static constexpr int PER_LINE = (K_MAJOR ? BK : R) / E, LINES = K_MAJOR ? R : BK;
    static constexpr int UNITS = (LINES * PER_LINE + CONV_THREADS - 1) / CONV_THREADS;
    static constexpr bool KEEP = UNITS <= 4;
    static_assert(CONV_THREADS % PER_LINE == 0, "a thread's place along a line is fixed");
    ConvRow rows[KEEP ? UNITS : 1];
    int along, line0, row0;

    __device__ __forceinline__ int row_of(int i) const {
        return row0 + (K_MAJOR ? line0 + i * (CONV_THREADS / PER_LINE) : along);
    }

    __device__ __forceinline__ void init(const ConvGemm &p, int first_row) {
        along = (threadIdx.x % PER_LINE) * E, line0 = threadIdx.x / PER_LINE, row0 = first_row;
#pragma unroll
        for (int i = 0; i < (KEEP ? UNITS : 0); i++) rows[i] = conv_row<OP, IS_A>(p, row_of(i));
    }

    __device__ __forceinline__ void load(floatX *tile, const floatX *src, const ConvGemm &p, int k0) const {
#pragma unroll
        for (int i = 0; i < UNITS; i++) {
            int line = line0 + i * (CONV_THREADS / PER_LINE);
            if ((LINES * PER_LINE) % CONV_THREADS != 0 && line >= LINES) break;
            ConvRow r = KEEP ? rows[KEEP ? i : 0] : conv_row<OP, IS_A>(p, row_of(i));
            int64_t off = conv_offset<OP, IS_A>(p, r, k0 + (K_MAJOR ? along : line));
            floatX *dst = tile + line * LD + along;
            if (VEC) conv_cp_async16(dst, off >= 0 ? src + off : src, off >= 0);
            else *dst = off >= 0 ? src[off] : __float2bfloat16(0.0f);
        }
    }
};

// The forward's or input gradient's output pair (row, n), (row, n + 1) from the products v0, v1, as
// stored (rounded; the second 0 unless `both`): see conv_store_pair.
template <int OP>
__device__ __forceinline__ __nv_bfloat162 conv_output_pair(const ConvGemm &p, int row, int n, float v0, float v1, bool both) {
    const floatX *o = p.out + (int64_t)row * p.ldo + n;
    if (OP == CONV_FORWARD) {
        v0 += __bfloat162float(p.bias[n]);
        if (both) v1 += __bfloat162float(p.bias[n + 1]);
        if (p.residual) {
            const floatX *r = p.residual + (int64_t)row * p.ldr + n;
            v0 += __bfloat162float(r[0]);
            if (both) v1 += __bfloat162float(r[1]);
        }
    } else if (p.add_out) {
        v0 += __bfloat162float(o[0]);
        if (both) v1 += __bfloat162float(o[1]);
    }
    return __floats2bfloat162_rn(v0, both ? v1 : 0.0f);
}

// Store: the block's accumulators, two adjacent columns at a time. (This is where bias, embedding
// and residual adds happen as the output is written; the halo kernel has a store of its own, which an
// add fused here needs too.) PARTIAL: fp32 partial sums of a slice of k instead (the weight gradient, a
// split product). Row m of the product is row `row` of the output (the same but for parity-ordered rows):
//   forward       y[row][n] = acc + bias[n] (+ residual[row][n])
//   input grad    dx[row][n] (+)= acc   (added when p.add_out: GRAD_ADD)
//   weight grad   out_f[slice][row][n] = acc
// Returns the two values as stored (rounded to floatX; 0 where nothing is stored), for the forward's
// channel sums.
template <int OP, bool PARTIAL = OP == CONV_WEIGHT_GRAD>
__device__ __forceinline__ float2 conv_store_pair(const ConvGemm &p, int m, int row, int n, float v0, float v1) {
    if (m >= p.M || n >= p.Ng) return make_float2(0.0f, 0.0f);
    bool both = n + 1 < p.Ng, pair = both && p.pair_store;
    if (PARTIAL) {  // fp32 partial sums, [slice][M][Ng]: the weight gradient's, or a split product's
        float *o = p.out_f + ((int64_t)blockIdx.z * p.M + row) * p.Ng + n;
        if (pair) *(float2 *)o = make_float2(v0, v1);
        else {
            o[0] = v0;
            if (both) o[1] = v1;
        }
        return make_float2(0.0f, 0.0f);
    }
    floatX *o = p.out + (int64_t)row * p.ldo + n;
    __nv_bfloat162 stored = conv_output_pair<OP>(p, row, n, v0, v1, both);
    if (pair) *(__nv_bfloat162 *)o = stored;
    else {
        o[0] = stored.x;
        if (both) o[1] = stored.y;
    }
    return __bfloat1622float2(stored);
}

// A stored tile's channel sums (ConvGemm.sums), in a fixed order, for the kernels whose 8 warps all
// hold the same BN columns of the tile. Each thread sums its pixels of 8 pairs of columns at a time,
// columns 8 (j0 + j) + 2 (lane % 4) + 0, 1 for j < 8, as it stores them: v[4 j + 0, 1] are the pair's
// sums, v[4 j + 2, 3] its sums of squares. conv_warp_sums_8 adds those of the 8 lanes that share the
// columns (lane / 4) in a reduce-scatter, so that lane ends with pair j = lane / 4 summed (three
// exchanges of halves: 28 shuffles, not 96), and keeps the warp's sums in shared memory; then
// conv_tile_sums_store has thread c add column c's eight warp sums in double and write (sum y,
// sum y^2) to out[2 c], out[2 c + 1].
template <int BN>
__device__ __forceinline__ float2 (&conv_warp_sums())[CONV_THREADS / 32][BN] {
    __shared__ float2 warp_sums[CONV_THREADS / 32][BN];  // (sum, sum of squares) per warp and column
    return warp_sums;
}

// One exchange of the reduce-scatter: the lane whose bit HALF is set keeps the upper HALF values and
// sends the lower, the other lane the reverse; each adds what it receives to what it keeps.
template <int HALF>
__device__ __forceinline__ void conv_sums_exchange(float (&v)[32]) {
    const int upper = threadIdx.x & HALF;
#pragma unroll
    for (int k = 0; k < HALF; k++) v[k] = (upper ? v[k + HALF] : v[k]) + __shfl_xor_sync(0xffffffffu, upper ? v[k] : v[k + HALF], HALF);
}

template <int BN>
__device__ __forceinline__ void conv_warp_sums_8(int j0, float (&v)[32]) {
    const int lane = threadIdx.x % 32;
    conv_sums_exchange<16>(v), conv_sums_exchange<8>(v), conv_sums_exchange<4>(v);
    const int column = 8 * (j0 + lane / 4) + 2 * (lane % 4);
    conv_warp_sums<BN>()[threadIdx.x / 32][column] = make_float2(v[0], v[2]);
    conv_warp_sums<BN>()[threadIdx.x / 32][column + 1] = make_float2(v[1], v[3]);
}

// Every thread of the block calls it, after its conv_warp_sums_8 calls; the barrier before the
// next tile's calls is the caller's. The tile's first `columns` columns are written: for one slot of
// all 8 warps' pixels, or with warps_per_slot = 4 (images of 64 pixels under 128-row tiles) for the
// first warpgroup's slot and, when `second` is not NULL, the second's there.
template <int BN>
__device__ __forceinline__ void conv_tile_sums_store(double *out, int columns, int warps_per_slot = 8, double *second = NULL) {
    __syncthreads();
    for (int i = threadIdx.x; i < (second ? 2 : 1) * columns; i += CONV_THREADS) {
        int slot = i / columns, c = i - slot * columns;
        double a = 0.0, b = 0.0, *to = slot ? second : out;
        for (int w = slot * warps_per_slot; w < (slot + 1) * warps_per_slot; w++)
            a += conv_warp_sums<BN>()[w][c].x, b += conv_warp_sums<BN>()[w][c].y;
        to[2 * c] = a, to[2 * c + 1] = b;
    }
}

// A 4 x 4 transpose of 32-bit words within each quad of lanes (t = lane % 4): lane t's w[j] becomes
// lane j's w[t]. An mma fragment's stores are 4 bytes a lane, a pixel's 8 channels from its quad, so
// one instruction writes half sectors of 8 pixels; after the transpose a lane holds 8 consecutive
// channels of its pixel, one 16-byte store (the input convolution's 4-byte stores cost ~2x:
// dev/NOTES.md j). Two exchanges of 2 x 2 blocks: lanes t, t ^ 1 swap the words whose
// bit 0 differs from their own, then lanes t, t ^ 2 those whose bit 1 does.
__device__ __forceinline__ void conv_quad_transpose(uint32_t (&w)[4]) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int bit = 1; bit <= 2; bit *= 2)
#pragma unroll
        for (int j = 0; j < 4; j++) {
            if (j & bit) continue;  // the pair (j, j + bit): this lane sends the one whose bit differs from t's
            const bool upper = t & bit;
            uint32_t got = __shfl_xor_sync(0xffffffffu, upper ? w[j] : w[j + bit], bit);
            w[j] = upper ? got : w[j], w[j + bit] = upper ? w[j + bit] : got;
        }
}

// The other way: 16 bytes of a row at columns c + 8 t .. c + 8 t + 7 (t = lane % 4), one load a lane,
// quad-transposed into an mma fragment's layout, word i then holding columns c + 8 i + 2 t + 0, 1 (the
// transpose is its own inverse); zeros where !valid. For the stores' addends (bias, residual, what dx
// holds): 8 columns a load, where loading each fragment's pair took 8 loads (two-byte ones in
// conv_output_pair) that the store waited for. Every lane of the warp calls it (the shuffles).
__device__ __forceinline__ void conv_load_fragment_pairs(uint32_t (&w)[4], const floatX *row_at_c, bool valid) {
    uint4 u = valid ? *(const uint4 *)(row_at_c + 8 * (threadIdx.x % 4)) : make_uint4(0, 0, 0, 0);
    w[0] = u.x, w[1] = u.y, w[2] = u.z, w[3] = u.w;
    conv_quad_transpose(w);
}

__device__ __forceinline__ float2 conv_unpack_pair(uint32_t word) { return __bfloat1622float2(*(const __nv_bfloat162 *)&word); }

// The tile shape of a kernel: a BM x BN tile of out per block, WARPS_M x WARPS_N warps of
// (BM/WARPS_M) x (BN/WARPS_N), k in steps of BK through a STAGES-deep cp.async ring.
template <int OP, int BM, int BN, int BK, int WARPS_M, int WARPS_N, bool VEC_A, bool VEC_B>
struct ConvTile {
    static constexpr bool A_K_MAJOR = OP != CONV_WEIGHT_GRAD, B_K_MAJOR = OP == CONV_FORWARD;
    static constexpr int STAGES = BK >= 64 ? 3 : 4;  // two blocks per multiprocessor
    static constexpr int LDA = A_K_MAJOR ? BK + CONV_PAD : BM + CONV_PAD;
    static constexpr int LDB = B_K_MAJOR ? BK + CONV_PAD : BN + CONV_PAD;
    static constexpr int A_TILE = A_K_MAJOR ? BM * LDA : BK * LDA, B_TILE = B_K_MAJOR ? BN * LDB : BK * LDB;
    static constexpr int WM = BM / WARPS_M, WN = BN / WARPS_N, MI = WM / 16, NI = WN / 8;
    static constexpr size_t SMEM = (size_t)STAGES * (A_TILE + B_TILE) * sizeof(floatX);
    static_assert(WARPS_M * WARPS_N * 32 == CONV_THREADS && MI >= 1 && NI % 2 == 0, "tile shape");
};

// The tensor-core kernel; blockIdx.z is the slice of k (the weight gradient's pixels) the block sums.
template <int OP, int BM, int BN, int BK, int WARPS_M, int WARPS_N, bool VEC_A, bool VEC_B>
__global__ void __launch_bounds__(CONV_THREADS, 2) conv3x3_igemm_kernel(const ConvGemm p) {
    typedef ConvTile<OP, BM, BN, BK, WARPS_M, WARPS_N, VEC_A, VEC_B> Tile;
    constexpr int STAGES = Tile::STAGES;
    extern __shared__ __align__(16) unsigned char conv_smem[];
    floatX *As = (floatX *)conv_smem, *Bs = As + STAGES * Tile::A_TILE;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const int k_tiles = (p.K + BK - 1) / BK, kt0 = blockIdx.z * (p.k_per_slice / BK);
    const int kt1 = min(k_tiles, kt0 + p.k_per_slice / BK);
    const floatX *a_src = OP == CONV_FORWARD ? p.x : p.dy, *b_src = OP == CONV_WEIGHT_GRAD ? p.x : p.w;
    ConvOperand<OP, true, BM, BK, Tile::A_K_MAJOR, VEC_A> a_operand;
    ConvOperand<OP, false, BN, BK, Tile::B_K_MAJOR, VEC_B> b_operand;
    a_operand.init(p, m0), b_operand.init(p, n0);
    auto load_stage = [&](int kt) {
        if (kt < kt1) {
            int stage = (kt - kt0) % STAGES;
            a_operand.load(As + stage * Tile::A_TILE, a_src, p, kt * BK);
            b_operand.load(Bs + stage * Tile::B_TILE, b_src, p, kt * BK);
        }
        conv_cp_async_commit();
    };

    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int wm0 = (warp / WARPS_N) * Tile::WM, wn0 = (warp % WARPS_N) * Tile::WN;
    const int quad = lane >> 3, r8 = lane & 7;  // ldmatrix: which 8x8 matrix this lane addresses, and its line
    float acc[Tile::MI][Tile::NI][4] = {};

    for (int s = 0; s < STAGES - 1; s++) load_stage(kt0 + s);
    for (int kt = kt0; kt < kt1; kt++) {
        conv_cp_async_wait<STAGES - 2>();
        __syncthreads();
        load_stage(kt + STAGES - 1);
        const floatX *a_tile = As + ((kt - kt0) % STAGES) * Tile::A_TILE;
        const floatX *b_tile = Bs + ((kt - kt0) % STAGES) * Tile::B_TILE;
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t a[Tile::MI][4], b[Tile::NI][2];
#pragma unroll
            for (int mi = 0; mi < Tile::MI; mi++) {  // matrices (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15), (8-15, 8-15)
                int row = wm0 + mi * 16 + (quad & 1) * 8, k = kk + (quad >> 1) * 8;
                if (Tile::A_K_MAJOR) conv_ldmatrix_x4<false>(a[mi], a_tile + (row + r8) * Tile::LDA + k);
                else conv_ldmatrix_x4<true>(a[mi], a_tile + (k + r8) * Tile::LDA + row);
            }
#pragma unroll
            for (int ni = 0; ni < Tile::NI; ni += 2) {  // matrices (cols 0-7, k 0-7), (0-7, 8-15), (8-15, 0-7), (8-15, 8-15)
                int col = wn0 + ni * 8 + (quad >> 1) * 8, k = kk + (quad & 1) * 8;
                uint32_t r[4];
                if (Tile::B_K_MAJOR) conv_ldmatrix_x4<false>(r, b_tile + (col + r8) * Tile::LDB + k);
                else conv_ldmatrix_x4<true>(r, b_tile + (k + r8) * Tile::LDB + col);
                b[ni][0] = r[0], b[ni][1] = r[1], b[ni + 1][0] = r[2], b[ni + 1][1] = r[3];
            }
#pragma unroll
            for (int mi = 0; mi < Tile::MI; mi++)
#pragma unroll
                for (int ni = 0; ni < Tile::NI; ni++) conv_mma_bf16(acc[mi][ni], a[mi], b[ni][0], b[ni][1]);
        }
    }
    conv_cp_async_wait<0>();

#pragma unroll
    for (int mi = 0; mi < Tile::MI; mi++)
#pragma unroll
        for (int ni = 0; ni < Tile::NI; ni++) {
            int m = m0 + wm0 + mi * 16 + lane / 4, n = n0 + wn0 + ni * 8 + (lane % 4) * 2;
            conv_store_pair<OP>(p, m, m, n, acc[mi][ni][0], acc[mi][ni][1]);
            conv_store_pair<OP>(p, m + 8, m + 8, n, acc[mi][ni][2], acc[mi][ni][3]);
        }
}

// ---- 3x3 convolution: wgmma (sm_90a) ----

// Hopper (sm_90a): the same implicit GEMMs on wgmma, the warpgroup-wide asynchronous tensor-core
// product that reads both operands straight from shared memory. A block of two warpgroups computes a
// BM x BN tile of out (ConvWgmmaTile: each warpgroup 64 rows by WN columns), in k steps of 64 through
// a cp.async ring of STAGES swizzled tiles (ConvWgmmaOperand); each k step is four m64nWNk16 products.
// The store and the slices are those of conv3x3_igemm_kernel.

// d[BN / 2] += A (64 x 16, from shared memory) B (16 x BN) for one warpgroup, BN = 64, 128, 192 or 256;
// TRANS_A / TRANS_B: the operand is stored M- or N-major (1) instead of K-major (0). The accumulators
// are the asm's operands %0 .. %(BN / 2 - 1), the descriptors and flags the four after them; the
// three 1s: add to d, and neither operand negated.
#define CONV_WGMMA_D8(i) "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), \
                         "+f"(d[i + 6]), "+f"(d[i + 7])
#define CONV_WGMMA_D32(i) CONV_WGMMA_D8(i), CONV_WGMMA_D8(i + 8), CONV_WGMMA_D8(i + 16), CONV_WGMMA_D8(i + 24)
#define CONV_WGMMA_P32 "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15" \
    ", %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31"
#define CONV_WGMMA_P64 CONV_WGMMA_P32 \
    ", %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47" \
    ", %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define CONV_WGMMA_P96 CONV_WGMMA_P64 \
    ", %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79" \
    ", %80, %81, %82, %83, %84, %85, %86, %87, %88, %89, %90, %91, %92, %93, %94, %95"
#define CONV_WGMMA_P128 CONV_WGMMA_P96 \
    ", %96, %97, %98, %99, %100, %101, %102, %103, %104, %105, %106, %107, %108, %109, %110, %111" \
    ", %112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define CONV_WGMMA(N, OPERANDS, ...)                                                                \
    asm volatile("wgmma.mma_async.sync.aligned.m64n" #N "k16.f32.bf16.bf16 {" OPERANDS ";\n"           \
                 : __VA_ARGS__                                                                          \
                 : "l"(a), "l"(b), "n"(TRANS_A), "n"(TRANS_B))

template <int BN, int TRANS_A, int TRANS_B>
__device__ __forceinline__ void conv_wgmma(float *d, uint64_t a, uint64_t b) {
    static_assert(BN == 64 || BN == 128 || BN == 192 || BN == 256, "the tile widths built");
    if constexpr (BN == 64)
        CONV_WGMMA(64, CONV_WGMMA_P32 "}, %32, %33, 1, 1, 1, %34, %35", CONV_WGMMA_D32(0));
    else if constexpr (BN == 128)
        CONV_WGMMA(128, CONV_WGMMA_P64 "}, %64, %65, 1, 1, 1, %66, %67", CONV_WGMMA_D32(0), CONV_WGMMA_D32(32));
    else if constexpr (BN == 192)
        CONV_WGMMA(192, CONV_WGMMA_P96 "}, %96, %97, 1, 1, 1, %98, %99", CONV_WGMMA_D32(0), CONV_WGMMA_D32(32),
                   CONV_WGMMA_D32(64));
    else
        CONV_WGMMA(256, CONV_WGMMA_P128 "}, %128, %129, 1, 1, 1, %130, %131", CONV_WGMMA_D32(0), CONV_WGMMA_D32(32),
                   CONV_WGMMA_D32(64), CONV_WGMMA_D32(96));
}

// A wgmma shared-memory descriptor: the start address, the byte offsets between 64-element groups along
// the leading dimension and between groups of 8 lines (each >> 4), and the 128-byte swizzle (mode 1).
__device__ __forceinline__ uint64_t conv_wgmma_descriptor(const floatX *start, uint32_t leading_bytes) {
    return (uint64_t)((conv_smem_address(start) & 0x3FFFF) >> 4) | (uint64_t)(leading_bytes >> 4) << 16 |
           (uint64_t)(1024 >> 4) << 32 | 1ull << 62;
}

// The wgmma kernel's operand tiles: 16-byte chunks copied by cp.async into lines of 64 elements (128
// bytes, no padding), a K-major tile as [R][64], an M- or N-major one as [R / 64][64 k][64]; chunk c of
// line l is stored at chunk c ^ (l % 8), the 128-byte swizzle that the tensor cores undo as they read.
// What depends on a thread's rows alone is worked out once, so that a k step costs a test and an add
// per chunk. The forward and input gradient need their k channels (C_in, C_out) to be a multiple of
// 64: a k step then lies in one tap t = (kh, kw), at channels [c0, c0 + 64), and a tap moves the
// gathered pixel by the same offset for every row:
//   forward       patch(m, t) = x at (ho s - 1, wo s - 1) + (kh, kw)
//   input grad    dy at ((h + 1 - kh) / s, (w + 1 - kw) / s) = dy at ((h + 1) / s, (w + 1) / s) - (kh / s, kw / s)
//                 (integer division; taps where h + 1 - kh or w + 1 - kw is not a multiple of s read nothing)
typedef struct {
    int k0, tap, c0;  // the k step [k0, k0 + 64); forward and input gradient: its tap and first channel
    const int2 *pixels;  // weight gradient: the step's 64 pixels (conv_pixel_entry)
} ConvStep;

// The input pixel (n H + h) W + w of parity-ordered row m (ConvGemm.class_start), m < M.
__device__ __forceinline__ int conv_parity_pixel(const ConvGemm &p, int m) {
    int c = 0;
    while (m >= p.class_start[c + 1]) c++;
    int ph = c >> 1, pw = c & 1, Hc = (p.H - ph + 1) / 2, Wc = (p.W - pw + 1) / 2, r = m - p.class_start[c];
    int n = r / (Hc * Wc), rest = r - n * (Hc * Wc), hh = rest / Wc;
    return (n * p.H + 2 * hh + ph) * p.W + 2 * (rest - hh * Wc) + pw;
}

// The weight gradient's table entry for output pixel `pixel` (one of a k step's 64): x's pixel index
// at tap (0, 0), which is (h, w) = (ho s - 1, wo s - 1), and h, w in 16 bits each (both -32768 past
// the last pixel: no tap lies inside). Images stay below 32768 pixels a side.
__device__ __forceinline__ int2 conv_pixel_entry(const ConvGemm &p, int pixel) {
    if (pixel >= p.K) return make_int2(0, (int)0x80008000u);
    int n = conv_div(pixel, p.div_out_pixels), rest = pixel - n * (p.Ho * p.Wo), ho = conv_div(rest, p.div_Wo);
    int h = ho * p.stride - 1, w = (rest - ho * p.Wo) * p.stride - 1;
    return make_int2((n * p.H + h) * p.W + w, (int)((uint32_t)h << 16 | ((uint32_t)w & 0xffffu)));
}

template <int OP, bool IS_A, int R, bool PARITY>
struct ConvWgmmaOperand {
    static constexpr bool K_MAJOR = IS_A ? OP != CONV_WEIGHT_GRAD : OP == CONV_FORWARD;
    static constexpr bool TAPS = IS_A && OP != CONV_WEIGHT_GRAD;      // rows gathered through the taps
    static constexpr bool PATCHES = !IS_A && OP == CONV_WEIGHT_GRAD;  // k lines (pixels) gathered one by one
    static constexpr int PER_LINE = K_MAJOR ? 8 : R / 8, LINES = K_MAJOR ? R : 64;
    static constexpr int UNITS = LINES * PER_LINE / CONV_THREADS, LINE_STEP = CONV_THREADS / PER_LINE;
    static_assert(LINES * PER_LINE % CONV_THREADS == 0 && CONV_THREADS % PER_LINE == 0 && LINE_STEP % 8 == 0,
                  "a thread's chunks lie LINE_STEP lines apart, at the same place in the swizzle");
    int64_t base[TAPS ? UNITS : 1];  // element offset of each unit's chunk at tap 0 (TAPS), or of unit 0
    uint32_t ok[TAPS ? UNITS : 1];   // TAPS: bit t = tap t lies inside the image; else bit i = unit i's row exists
    int64_t unit_stride;             // not TAPS: from one unit's chunk to the next
    ConvRow column;                  // PATCHES: the thread's column (t, ci)
    int line0, along, dst0;

    __device__ __forceinline__ void init(const ConvGemm &p, int first_row) {
        along = threadIdx.x % PER_LINE * 8, line0 = threadIdx.x / PER_LINE;
        dst0 = (K_MAJOR ? 0 : along / 64 * 64 * 64) + line0 * 64 + ((K_MAJOR ? along : along % 64) / 8 ^ (line0 & 7)) * 8;
        if constexpr (TAPS) {
#pragma unroll
            for (int i = 0; i < UNITS; i++) {
                int row = first_row + line0 + i * LINE_STEP;
                base[i] = 0, ok[i] = 0;
                if (row >= p.M) continue;
                int n, h, w, limit_h, limit_w;  // the tap-0 pixel (h, w), and the tensor's size
                if (OP == CONV_FORWARD) {
                    n = conv_div(row, p.div_out_pixels);
                    int rest = row - n * (p.Ho * p.Wo), ho = conv_div(rest, p.div_Wo);
                    h = ho * p.stride - 1, w = (rest - ho * p.Wo) * p.stride - 1, limit_h = p.H, limit_w = p.W;
                    base[i] = ((int64_t)(n * p.H + h) * p.W + w) * p.ldx + along;
                } else {
                    int pixel = PARITY ? conv_parity_pixel(p, row) : row;
                    n = conv_div(pixel, p.div_in_pixels);
                    int rest = pixel - n * (p.H * p.W), hi = conv_div(rest, p.div_W);
                    h = hi + 1, w = rest - hi * p.W + 1, limit_h = p.Ho, limit_w = p.Wo;
                    base[i] = ((int64_t)(n * p.Ho + h / p.stride) * p.Wo + w / p.stride) * p.lddy + along;
                }
                for (int t = 0; t < 9; t++) {
                    int kh = t / 3, kw = t % 3;
                    int hh = OP == CONV_FORWARD ? h + kh : h - kh, ww = OP == CONV_FORWARD ? w + kw : w - kw;
                    bool inside = hh >= 0 && ww >= 0;
                    if (OP == CONV_FORWARD) inside = inside && hh < limit_h && ww < limit_w;
                    else
                        inside = inside && hh % p.stride == 0 && ww % p.stride == 0 && hh / p.stride < limit_h &&
                                 ww / p.stride < limit_w;
                    ok[i] |= (uint32_t)inside << t;
                }
            }
        } else if constexpr (PATCHES) {
            column = conv_row<OP, false>(p, first_row + along);
        } else {
            ok[0] = 0;
            if (OP == CONV_FORWARD) {  // w[co][k]: rows co
                base[0] = (int64_t)(first_row + line0) * p.K + along, unit_stride = (int64_t)LINE_STEP * p.K;
                for (int i = 0; i < UNITS; i++) ok[0] |= (uint32_t)(first_row + line0 + i * LINE_STEP < p.Ng) << i;
            } else if (OP == CONV_INPUT_GRAD) {  // w[co][t][ci]: k lines co (of the step's tap), columns ci
                base[0] = (int64_t)line0 * 9 * p.C_in + first_row + along, unit_stride = (int64_t)LINE_STEP * 9 * p.C_in;
                ok[0] = first_row + along < p.Ng ? ~0u : 0u;
            } else {  // dy[pixel][co]: k lines pixels, columns co
                base[0] = (int64_t)line0 * p.lddy + first_row + along, unit_stride = (int64_t)LINE_STEP * p.lddy;
                ok[0] = first_row + along < p.M ? ~0u : 0u;
            }
        }
    }

    __device__ __forceinline__ void load(floatX *tile, const floatX *src, const ConvGemm &p, ConvStep st) const {
        int64_t step;  // what the k step adds to every unit's offset
        if (OP == CONV_FORWARD && TAPS) step = ((int64_t)(st.tap / 3) * p.W + st.tap % 3) * p.ldx + st.c0;
        else if (OP == CONV_INPUT_GRAD && TAPS)
            step = -((int64_t)(st.tap / 3 / p.stride) * p.Wo + st.tap % 3 / p.stride) * p.lddy + st.c0;
        else if (OP == CONV_FORWARD) step = st.k0;
        else if (OP == CONV_INPUT_GRAD) step = ((int64_t)st.c0 * 9 + st.tap) * p.C_in;
        else step = (int64_t)st.k0 * p.lddy;
#pragma unroll
        for (int i = 0; i < UNITS; i++) {
            int64_t off;
            bool valid;
            if constexpr (TAPS) {
                off = base[i] + step, valid = ok[i] >> st.tap & 1;
            } else if constexpr (PATCHES) {  // column (kh, kw, ci) = (a, b, c)
                int2 e = st.pixels[line0 + i * LINE_STEP];
                int h = (e.y >> 16) + column.a, w = (int)(int16_t)(e.y & 0xffff) + column.b;
                valid = column.a >= 0 && (unsigned)h < (unsigned)p.H && (unsigned)w < (unsigned)p.W;
                off = (int64_t)(e.x + column.a * p.W + column.b) * p.ldx + column.c;
            } else {
                off = base[0] + i * unit_stride + step, valid = ok[0] >> i & 1;
                if (OP == CONV_WEIGHT_GRAD) valid = valid && st.k0 + line0 + i * LINE_STEP < p.K;
            }
            conv_cp_async16(tile + dst0 + i * LINE_STEP * 64, valid ? src + off : src, valid);
        }
    }
};

#define CONV_WGMMA_BK 64

// A BM x BN tile: BM = 128, each warpgroup 64 rows by BN; or BM = 64 (a product only 64 rows high, the
// weight gradient of 64 output channels), each warpgroup the 64 rows by half of BN. A 128 x 128 tile
// takes a 3-stage ring, so that two blocks share a multiprocessor; the others 4 stages.
template <int BM, int BN>
struct ConvWgmmaTile {
    static_assert(BM == 128 || (BM == 64 && BN % 128 == 0), "a warpgroup's columns start at a 64-column group");
    static constexpr int WN = BM == 128 ? BN : BN / 2;  // a warpgroup's width
    static constexpr int STAGES = BM == 128 && BN == 128 ? 3 : 4;
    static constexpr int A_TILE = BM * CONV_WGMMA_BK, B_TILE = BN * CONV_WGMMA_BK;  // elements
    static constexpr size_t SMEM = (size_t)STAGES * (A_TILE + B_TILE) * sizeof(floatX) + 1024;  // + alignment to 1024
    static constexpr int BLOCKS_PER_SM = 2 * SMEM <= 227 * 1024 ? 2 : 1;
};

// The warpgroup's part of a BM x BN tile: its 64 rows of A (BM = 128, each warpgroup all WN = BN
// columns), or its WN = BN / 2 columns of B (BM = 64, each warpgroup all 64 rows). In a stage's tiles, in
// either layout, they start group_row x 64 or group_col x 64 elements in.
template <int BM, int BN>
struct ConvWgmmaGroup {
    int row, col;  // the first row and column of the tile
    __device__ __forceinline__ ConvWgmmaGroup() {
        int group = threadIdx.x / 128;
        row = BM == 128 ? group * 64 : 0, col = BM == 128 ? 0 : group * ConvWgmmaTile<BM, BN>::WN;
    }
};

// One k step of a warpgroup: its four m64nWNk16 products from its part of the step's A and B tiles
// (ConvWgmmaOperand's layouts), committed as one group. A k16 step moves 32 bytes along a K-major line,
// or 16 lines (2048 bytes) of an M/N-major tile, whose 64-element groups lie BK lines apart.
template <int OP, int BM, int BN>
__device__ __forceinline__ void conv_wgmma_k_step(float (&acc)[ConvWgmmaTile<BM, BN>::WN / 2], const floatX *a_tile,
                                                  const floatX *b_tile) {
    constexpr int BK = CONV_WGMMA_BK, WN = ConvWgmmaTile<BM, BN>::WN;
    constexpr bool A_K_MAJOR = OP != CONV_WEIGHT_GRAD, B_K_MAJOR = OP == CONV_FORWARD;
    constexpr int A_STEP = A_K_MAJOR ? 16 : 16 * 64, B_STEP = B_K_MAJOR ? 16 : 16 * 64;
    constexpr uint32_t A_LEADING = A_K_MAJOR ? 16 : BK * 128, B_LEADING = B_K_MAJOR ? 16 : BK * 128;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
    for (int s = 0; s < BK / 16; s++)
        conv_wgmma<WN, A_K_MAJOR ? 0 : 1, B_K_MAJOR ? 0 : 1>(acc, conv_wgmma_descriptor(a_tile + s * A_STEP, A_LEADING),
                                                             conv_wgmma_descriptor(b_tile + s * B_STEP, B_LEADING));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
}

// The wgmma kernels' store of a BM x BN tile at (m0, n0). Accumulator j of 4 (per 8 columns): rows
// lane / 4 and + 8 of the warp's 16, columns 2 (lane % 4) + 0, 1. Where out takes 16-byte stores
// (p.vec_store), 32 columns inside the product at a time go out transposed within each quad
// (conv_quad_transpose: a lane's 8 consecutive columns of its row); else, and for fp32 partial sums,
// pair by pair through conv_store_pair. A forward with sums (BM = 128: the 8 warps hold all BN
// columns) gathers them per slot of p.sum_rows rows.
template <int OP, int BM, int BN, bool PARITY, bool PARTIAL>
__device__ __forceinline__ void conv_wgmma_store(const ConvGemm &p, const float (&acc)[ConvWgmmaTile<BM, BN>::WN / 2], int m0,
                                                 int n0) {
    constexpr int WN = ConvWgmmaTile<BM, BN>::WN;
    constexpr bool SUMS = OP == CONV_FORWARD && !PARTIAL && BM == 128;
    const ConvWgmmaGroup<BM, BN> group;
    const int lane = threadIdx.x % 32, m = m0 + group.row + (threadIdx.x % 128) / 32 * 16 + lane / 4;
    const int row0 = PARITY && m < p.M ? conv_parity_pixel(p, m) : m;
    const int row8 = PARITY && m + 8 < p.M ? conv_parity_pixel(p, m + 8) : m + 8;
    static_assert(!SUMS || WN % 64 == 0, "sums of 8 column pairs at a time");
#pragma unroll
    for (int j0 = 0; j0 < WN / 8; j0 += 8) {
        float v[32];  // the sums (conv_warp_sums_8)
#pragma unroll
        for (int jq = j0; jq < j0 + 8 && jq < WN / 8; jq += 4) {  // columns nq .. nq + 31
            const int nq = n0 + group.col + jq * 8;
            if (!PARTIAL && WN % 32 == 0 && p.vec_store && nq + 32 <= p.Ng) {
                // What the products add, read 16 bytes a lane (conv_load_fragment_pairs): forward the bias
                // (+ residual), input gradient what dx holds when added to. Each value is then rounded once
                // from (acc + bias) + residual, or acc + dx, as conv_output_pair rounds it.
                const bool in0 = m < p.M, in8 = m + 8 < p.M, add = OP == CONV_FORWARD ? p.residual != NULL : p.add_out;
                floatX *out0 = p.out + (int64_t)row0 * p.ldo + nq, *out8 = p.out + (int64_t)row8 * p.ldo + nq;
                uint32_t bias[4] = {}, add0[4] = {}, add8[4] = {};
                if (OP == CONV_FORWARD) conv_load_fragment_pairs(bias, p.bias + nq, true);
                if (add) {
                    const floatX *from0 = OP == CONV_FORWARD ? p.residual + (int64_t)row0 * p.ldr + nq : out0;
                    const floatX *from8 = OP == CONV_FORWARD ? p.residual + (int64_t)row8 * p.ldr + nq : out8;
                    conv_load_fragment_pairs(add0, from0, in0), conv_load_fragment_pairs(add8, from8, in8);
                }
                uint32_t words[2][4];  // rows m, m + 8: columns nq + 8 j + 2 (lane % 4) + 0, 1, then nq + 8 (lane % 4) ..
#pragma unroll
                for (int j = jq; j < jq + 4; j++) {
                    float2 u0 = make_float2(acc[4 * j], acc[4 * j + 1]), u8 = make_float2(acc[4 * j + 2], acc[4 * j + 3]);
                    if (OP == CONV_FORWARD) {
                        float2 b = conv_unpack_pair(bias[j - jq]);
                        u0.x += b.x, u0.y += b.y, u8.x += b.x, u8.y += b.y;
                    }
                    if (add) {
                        float2 r0 = conv_unpack_pair(add0[j - jq]), r8 = conv_unpack_pair(add8[j - jq]);
                        u0.x += r0.x, u0.y += r0.y, u8.x += r8.x, u8.y += r8.y;
                    }
                    __nv_bfloat162 a = in0 ? __floats2bfloat162_rn(u0.x, u0.y) : __nv_bfloat162();
                    __nv_bfloat162 b = in8 ? __floats2bfloat162_rn(u8.x, u8.y) : __nv_bfloat162();
                    words[0][j - jq] = *(const uint32_t *)&a, words[1][j - jq] = *(const uint32_t *)&b;
                    if constexpr (SUMS) {
                        float2 fa = in0 ? __bfloat1622float2(a) : make_float2(0.0f, 0.0f);
                        float2 fb = in8 ? __bfloat1622float2(b) : make_float2(0.0f, 0.0f);
                        float *w = v + 4 * (j - j0);
                        w[0] = fa.x + fb.x, w[1] = fa.y + fb.y, w[2] = fa.x * fa.x + fb.x * fb.x, w[3] = fa.y * fa.y + fb.y * fb.y;
                    }
                }
                conv_quad_transpose(words[0]), conv_quad_transpose(words[1]);
                if (in0) *(uint4 *)(out0 + 8 * (lane % 4)) = make_uint4(words[0][0], words[0][1], words[0][2], words[0][3]);
                if (in8) *(uint4 *)(out8 + 8 * (lane % 4)) = make_uint4(words[1][0], words[1][1], words[1][2], words[1][3]);
                continue;
            }
#pragma unroll
            for (int j = jq; j < jq + 4 && j < WN / 8; j++) {
                int n = n0 + group.col + j * 8 + (lane % 4) * 2;
                float2 a = conv_store_pair<OP, PARTIAL>(p, m, row0, n, acc[4 * j], acc[4 * j + 1]);
                float2 b = conv_store_pair<OP, PARTIAL>(p, m + 8, row8, n, acc[4 * j + 2], acc[4 * j + 3]);
                if constexpr (SUMS) {
                    float *w = v + 4 * (j - j0);
                    w[0] = a.x + b.x, w[1] = a.y + b.y, w[2] = a.x * a.x + b.x * b.x, w[3] = a.y * a.y + b.y * b.y;
                }
            }
        }
        if constexpr (SUMS)
            if (p.sums) conv_warp_sums_8<BN>(j0, v);
    }
    if constexpr (SUMS)
        if (p.sums) {  // a slot of 128 rows, or two of 64 (ConvGemm.sum_rows; the second none past the product)
            double *first = p.sums + ((int64_t)(m0 / p.sum_rows) * p.Ng + n0) * 2;
            if (p.sum_rows == 128) conv_tile_sums_store<BN>(first, min(BN, p.Ng - n0));
            else conv_tile_sums_store<BN>(first, min(BN, p.Ng - n0), 4, m0 + 64 < p.M ? first + (int64_t)p.Ng * 2 : NULL);
        }
}

// PARITY: the input gradient's rows are parity-ordered (ConvGemm.parity_rows). SPLIT: a split forward or
// input-gradient product (conv3x3_split_slices), each slice of k into out_f in fp32.
template <int OP, int BM, int BN, bool PARITY, bool SPLIT>
__global__ void __launch_bounds__(CONV_THREADS, (ConvWgmmaTile<BM, BN>::BLOCKS_PER_SM)) conv3x3_wgmma_kernel(const ConvGemm p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef ConvWgmmaTile<BM, BN> Tile;
    constexpr int BK = CONV_WGMMA_BK, STAGES = Tile::STAGES, WN = Tile::WN;
    extern __shared__ __align__(16) unsigned char conv_smem[];
    floatX *As = (floatX *)(conv_smem + (1024 - conv_smem_address(conv_smem) % 1024) % 1024);  // swizzle atoms: 1024 bytes
    floatX *Bs = As + STAGES * Tile::A_TILE;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const floatX *a_src = OP == CONV_FORWARD ? p.x : p.dy, *b_src = OP == CONV_WEIGHT_GRAD ? p.x : p.w;
    ConvWgmmaOperand<OP, true, BM, PARITY> a_operand;
    ConvWgmmaOperand<OP, false, BN, false> b_operand;
    a_operand.init(p, m0), b_operand.init(p, n0);

    // The k steps the block runs, j = 0 .. steps - 1. Weight gradient, or a split product: its slice. Input
    // gradient with parity-ordered rows: only the taps that reach some row of the block (1, 2 or 4;
    // fewer at the image's edges), each in C_out / 64 steps. Otherwise all of k.
    __shared__ uint32_t block_taps;
    int steps = p.K / BK, first_tile = 0;  // forward and input gradient: C is a multiple of 64
    uint32_t taps = 0x1ff;
    if (OP == CONV_WEIGHT_GRAD || SPLIT) {  // a slice of k: of the pixels, or of a split product's taps x channels
        first_tile = blockIdx.z * (p.k_per_slice / BK);
        steps = min((p.K + BK - 1) / BK, first_tile + p.k_per_slice / BK) - first_tile;
    } else if (PARITY) {
        if (threadIdx.x == 0) block_taps = 0;
        __syncthreads();
        uint32_t mine = 0;
        for (int i = 0; i < a_operand.UNITS; i++) mine |= a_operand.ok[i];
        atomicOr(&block_taps, mine);  // an OR: the same in any order
        __syncthreads();
        taps = block_taps, steps = __popc(taps) * (p.C_out / BK);
    }
    // Step j's tap and first channel c0: the (j BK / C)-th tap of `taps` (tap j BK / C when all 9 run).
    auto step_of = [&](int j) {
        ConvStep st = {(first_tile + j) * BK, 0, 0, NULL};
        if (OP != CONV_WEIGHT_GRAD) {
            const int C = OP == CONV_FORWARD ? p.C_in : p.C_out;
            int which = conv_div(st.k0, OP == CONV_FORWARD ? p.div_C_in : p.div_C_out);
            st.c0 = st.k0 - which * C, st.tap = which;
            if (PARITY) {
                uint32_t rest = taps;
                for (; which > 0; which--) rest &= rest - 1;
                st.tap = __ffs(rest) - 1, st.k0 = st.tap * C + st.c0;
            }
        }
        return st;
    };

    // Weight gradient: a table of each k step's 64 pixels (x's pixel at tap 0 and its (h, w)), written
    // by threads 0-63 in the iteration before the one that loads the step, so a __syncthreads lies
    // between; slot j % 4 is rewritten 4 steps later, after every read of it.
    __shared__ int2 pixel_table[OP == CONV_WEIGHT_GRAD ? 4 : 1][64];
    auto fill_pixels = [&](int j) {
        if (OP == CONV_WEIGHT_GRAD && threadIdx.x < 64 && j < steps)
            pixel_table[j % 4][threadIdx.x] = conv_pixel_entry(p, (first_tile + j) * BK + threadIdx.x);
    };
    auto load_stage = [&](int j) {
        if (j < steps) {
            int stage = j % STAGES;
            ConvStep st = step_of(j);
            if (OP == CONV_WEIGHT_GRAD) st.pixels = pixel_table[j % 4];
            a_operand.load(As + stage * Tile::A_TILE, a_src, p, st);
            b_operand.load(Bs + stage * Tile::B_TILE, b_src, p, st);
        }
        conv_cp_async_commit();
    };

    const ConvWgmmaGroup<BM, BN> group;
    float acc[WN / 2] = {};

    // The ring: once step j's products are issued, step j + STAGES - 2 is loaded into the stage that
    // step j - 2 used, which every warpgroup has finished reading (wgmma.wait_group 1 leaves only step
    // j - 1's products running).
    for (int s = 0; s < STAGES - 1; s++) fill_pixels(s);
    if (OP == CONV_WEIGHT_GRAD) __syncthreads();
    for (int s = 0; s < STAGES - 2; s++) load_stage(s);
    for (int j = 0; j < steps; j++) {
        conv_cp_async_wait<STAGES - 3>();
        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes, seen by wgmma
        __syncthreads();
        conv_wgmma_k_step<OP, BM, BN>(acc, As + (j % STAGES) * Tile::A_TILE + group.row * 64,
                                      Bs + (j % STAGES) * Tile::B_TILE + group.col * 64);
        load_stage(j + STAGES - 2);  // (while the products run)
        fill_pixels(j + STAGES - 1);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    conv_cp_async_wait<0>();
    conv_wgmma_store<OP, BM, BN, PARITY, OP == CONV_WEIGHT_GRAD || SPLIT>(p, acc, m0, n0);
#else
    __trap();  // launched only where gpu.sm90a says the sm_90a code runs
#endif
}

// Launches a kernel of the 3x3 products with one block a BM x BN tile of the product (and blockIdx.z
// the slice of k), with smem bytes of dynamic shared memory.
template <typename Kernel>
static void conv_launch_grid(Kernel kernel, bool *configured, size_t smem, const ConvGemm &p, int BM, int BN, int slices) {
    allow_dynamic_smem(kernel, configured, smem);
    dim3 grid((p.M + BM - 1) / BM, (p.Ng + BN - 1) / BN, slices);
    kernel<<<grid, CONV_THREADS, smem, gpu.stream>>>(p);
    cuda_check_launch();
}

template <int OP, int BM, int BN, bool PARITY, bool SPLIT = false>
static void conv_launch_wgmma_kernel(const ConvGemm &p, int slices) {
    static bool configured = false;
    conv_launch_grid(conv3x3_wgmma_kernel<OP, BM, BN, PARITY, SPLIT>, &configured, ConvWgmmaTile<BM, BN>::SMEM, p, BM, BN, slices);
}

template <int OP, int BM, int BN>
static void conv_launch_wgmma(const ConvGemm &p, int slices) {
    if constexpr (OP == CONV_INPUT_GRAD)
        if (p.parity_rows) return conv_launch_wgmma_kernel<OP, BM, BN, true>(p, slices);
    conv_launch_wgmma_kernel<OP, BM, BN, false>(p, slices);
}

// ---- 3x3 convolution: the TMA (sm_90a) ----

// The products through the Tensor Memory Accelerator (TMA, sm_90a). conv3x3_wgmma_kernel spends its
// issue slots on its loads: every thread works out 8 addresses and border tests a k step (the weight
// gradient ~290 instructions a step; ncu, H100: the schedulers issue every 1.9 cycles, the tensor cores
// ~40% busy). Here one thread asks the TMA for each k step's tiles, each a box of a tensor map
// (conv_tensor_map) that the TMA fills with zeros where it lies outside the tensor. Stride 1 only:
//   forward      A = x [N][H][W][C_in] at tap t = (kh, kw), channels [c0, c0 + 64): the box of the tile's 128
//                    pixels (imgs x rows x cols, conv_pixel_box) shifted by (kh - 1, kw - 1), x 64 channels;
//                B = w [C_out][9 C_in]: the box of BN rows (output channels) x 64 columns at (n0, t C_in + c0)
//   input grad   A = dy [N][H][W][C_out] likewise, shifted by (1 - kh, 1 - kw) (dx at p sums dy at p + 1 - k);
//                B = w: for each 64 columns of the tile (input channels from n0 + 64 g) the box of 64 rows
//                    (output channels c0 ..) x 64 columns at (c0, t C_in + n0 + 64 g)
//   weight grad  A = dy [pixels][C_out]: the box of 64 pixels x 64 channels at (k0, m0 + 64 g), g < BM / 64;
//                B = x: for the 64 columns from n0 + 64 g (one tap t, channels [c, c + 64)) the box of the
//                    k step's 64 pixels (rows x cols of one image, conv_pixel_box) shifted by the tap
// A shifted box reads zeros past the image's border, which is the convolution's padding. With the
// 128-byte swizzle the boxes land in the layouts of ConvWgmmaOperand's tiles, so the k step and the
// store are the wgmma kernel's. Stage s's barrier full[s] completes when its bytes have arrived; the
// stage of step j - 1 is refilled (with step j + STAGES - 1) after a __syncthreads shows both warpgroups
// done with it. SPLIT: a split forward or input-gradient product's slice of k (conv3x3_split_slices),
// into out_f in fp32. (Stride 2 stays on conv3x3_wgmma_kernel.)
// A stage's barrier: one arrival (thread 0's, with the bytes to expect), then the TMA's bytes.
__device__ __forceinline__ void conv_mbarrier_init(uint64_t *bar) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], 1;\n" ::"r"(conv_smem_address(bar)) : "memory");
}
__device__ __forceinline__ void conv_mbarrier_expect_bytes(uint64_t *bar, uint32_t bytes) {  // the one arrival
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(conv_smem_address(bar)), "r"(bytes) : "memory");
}
// Waits until the barrier's phase of this parity has completed (a stage's j-th use: parity j % 2).
__device__ __forceinline__ void conv_mbarrier_wait(uint64_t *bar, uint32_t parity) {
    asm volatile("{\n .reg .pred done;\n waiting:\n mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n"
                 " @!done bra waiting;\n}\n" ::"r"(conv_smem_address(bar)), "r"(parity) : "memory");
}
// The box of `map` at coordinates (c0, c1[, c2, c3]) (innermost first) into dst; its bytes count towards bar.
__device__ __forceinline__ void conv_tma_load_2d(floatX *dst, const CUtensorMap *map, int c0, int c1, uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];\n"
                 ::"r"(conv_smem_address(dst)), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(conv_smem_address(bar))
                 : "memory");
}
__device__ __forceinline__ void conv_tma_load_4d(floatX *dst, const CUtensorMap *map, int c0, int c1, int c2, int c3,
                                                 uint64_t *bar) {
    asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes"
                 " [%0], [%1, {%2, %3, %4, %5}], [%6];\n"
                 ::"r"(conv_smem_address(dst)), "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3),
                 "r"(conv_smem_address(bar))
                 : "memory");
}

template <int OP, int BM, int BN, bool SPLIT>
__global__ void __launch_bounds__(CONV_THREADS, (ConvWgmmaTile<BM, BN>::BLOCKS_PER_SM))
    conv3x3_tma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap b_map, const ConvGemm p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef ConvWgmmaTile<BM, BN> Tile;
    constexpr int BK = CONV_WGMMA_BK, STAGES = Tile::STAGES, WN = Tile::WN;
    extern __shared__ __align__(16) unsigned char conv_smem[];
    floatX *As = (floatX *)(conv_smem + (1024 - conv_smem_address(conv_smem) % 1024) % 1024);  // swizzle atoms: 1024 bytes
    floatX *Bs = As + STAGES * Tile::A_TILE;
    __shared__ __align__(8) uint64_t full[STAGES];
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, first_step = blockIdx.z * (p.k_per_slice / BK);
    const int steps = min((p.K + BK - 1) / BK, first_step + p.k_per_slice / BK) - first_step;
    __builtin_assume(steps > 0);  // (every slice has steps): no path around the products
    // The B boxes a step loads: the columns past Ng are not loaded (what a stage held there reaches only
    // columns that are not stored); the forward's one box of BN rows reads zeros past C_out.
    const int b_boxes = OP == CONV_FORWARD ? 1 : min(BN / 64, (p.Ng - n0 + 63) / 64);

    // The pixel (n, h, w) where a box of pixels starts: the tile's first row (forward, input gradient),
    // or the k step's first pixel (weight gradient; k0 = its first k).
    auto pixel_of = [&](int first, int *n, int *h, int *w) {
        *n = conv_div(first, p.div_in_pixels);
        int rest = first - *n * p.H * p.W;
        *h = conv_div(rest, p.div_W), *w = rest - *h * p.W;
    };
    int tile_n = 0, tile_h = 0, tile_w = 0;
    if (OP != CONV_WEIGHT_GRAD) pixel_of(m0, &tile_n, &tile_h, &tile_w);
    // Step j's boxes into its stage (thread 0).
    auto load_stage = [&](int j) {
        if (j >= steps) return;
        const int stage = j % STAGES, k0 = (first_step + j) * BK;
        floatX *a = As + stage * Tile::A_TILE, *b = Bs + stage * Tile::B_TILE;
        const uint32_t a_bytes = BM * BK * sizeof(floatX);
        const uint32_t b_bytes = (OP == CONV_FORWARD ? BN : b_boxes * 64) * BK * sizeof(floatX);
        conv_mbarrier_expect_bytes(&full[stage], a_bytes + b_bytes);
        if (OP == CONV_WEIGHT_GRAD) {
            int n, h, w;
            pixel_of(k0, &n, &h, &w);
#pragma unroll
            for (int g = 0; g < BM / 64; g++) conv_tma_load_2d(a + g * 64 * 64, &a_map, m0 + 64 * g, k0, &full[stage]);
            for (int g = 0; g < b_boxes; g++) {
                int tap = conv_div(n0 + 64 * g, p.div_C_in), c = n0 + 64 * g - tap * p.C_in;
                conv_tma_load_4d(b + g * 64 * 64, &b_map, c, w - 1 + tap % 3, h - 1 + tap / 3, n, &full[stage]);
            }
        } else {
            const int C = OP == CONV_FORWARD ? p.C_in : p.C_out;
            const int tap = conv_div(k0, OP == CONV_FORWARD ? p.div_C_in : p.div_C_out), c0 = k0 - tap * C;
            const int dh = OP == CONV_FORWARD ? tap / 3 - 1 : 1 - tap / 3, dw = OP == CONV_FORWARD ? tap % 3 - 1 : 1 - tap % 3;
            conv_tma_load_4d(a, &a_map, c0, tile_w + dw, tile_h + dh, tile_n, &full[stage]);
            if (OP == CONV_FORWARD) conv_tma_load_2d(b, &b_map, tap * p.C_in + c0, n0, &full[stage]);
            else
                for (int g = 0; g < b_boxes; g++)
                    conv_tma_load_2d(b + g * 64 * 64, &b_map, tap * p.C_in + n0 + 64 * g, c0, &full[stage]);
        }
    };
    if (threadIdx.x == 0) {
        for (int s = 0; s < STAGES; s++) conv_mbarrier_init(&full[s]);
        asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
    }
    __syncthreads();
    if (threadIdx.x == 0)
        for (int j = 0; j < STAGES - 1; j++) load_stage(j);
    const ConvWgmmaGroup<BM, BN> group;
    float acc[WN / 2] = {};
    for (int j = 0; j < steps; j++) {
        conv_mbarrier_wait(&full[j % STAGES], (uint32_t)(j / STAGES) & 1);
        conv_wgmma_k_step<OP, BM, BN>(acc, As + (j % STAGES) * Tile::A_TILE + group.row * 64,
                                      Bs + (j % STAGES) * Tile::B_TILE + group.col * 64);
        asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");  // step j - 1's products done in this warpgroup
        __syncthreads();                                                    // ... and in the other
        if (threadIdx.x == 0) load_stage(j + STAGES - 1);                  // into step j - 1's stage
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    conv_wgmma_store<OP, BM, BN, false, OP == CONV_WEIGHT_GRAD || SPLIT>(p, acc, m0, n0);
#else
    __trap();  // launched only where gpu.sm90a says the sm_90a code runs
#endif
}

// cuTensorMapEncodeTiled, the driver's, looked up once at run time (nothing links libcuda); false
// where the driver has none.
static PFN_cuTensorMapEncodeTiled_v12000 conv_encode_tiled;
static bool conv_tma_available(void) {
    static int available = -1;
    if (available < 0) {
        void *fn = NULL;
        cudaDriverEntryPointQueryResult found;
        available = cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &found) ==
                        cudaSuccess &&
                    found == cudaDriverEntryPointSuccess && fn;
        conv_encode_tiled = (PFN_cuTensorMapEncodeTiled_v12000)fn;
    }
    return available;
}

// The tensor map of a bf16 tensor of `rank` dimensions (sizes innermost first, the byte strides of
// dimensions 1 .. rank - 1), read in boxes of `box` elements with the 128-byte swizzle, zeros outside.
static CUtensorMap conv_tensor_map(const floatX *base, int rank, const uint64_t *sizes, const uint64_t *strides,
                                   const uint32_t *box) {
    CUtensorMap map;
    const uint32_t element_strides[4] = {1, 1, 1, 1};
    CUresult r = conv_encode_tiled(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (uint32_t)rank, (void *)base, sizes, strides, box,
                                   element_strides, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                                   CU_TENSOR_MAP_L2_PROMOTION_L2_128B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
    if (r != CUDA_SUCCESS) fatal("cuTensorMapEncodeTiled failed (error %d)", (int)r);
    return map;
}

// Launches conv3x3_tma_kernel (the slices: the weight gradient's, or a split product's) with its tensor
// maps: the pixels of x or dy as [N][H][W][C] with their channel stride, dy as [pixels][C_out] (weight
// gradient), w as [C_out][9 C_in].
template <int OP, int BM, int BN, bool SPLIT = false>
static void conv_launch_tma(const ConvGemm &p, int slices) {
    typedef ConvWgmmaTile<BM, BN> Tile;
    auto kernel = conv3x3_tma_kernel<OP, BM, BN, SPLIT>;
    static bool configured = false;
    allow_dynamic_smem(kernel, &configured, Tile::SMEM);
    const uint64_t e = sizeof(floatX);
    uint32_t cols, rows, imgs;
    conv_pixel_box(p.H, p.W, OP == CONV_WEIGHT_GRAD ? 64 : 128, &cols, &rows, &imgs);
    const floatX *image = OP == CONV_INPUT_GRAD ? p.dy : p.x;  // the pixels read through boxes
    const int C = OP == CONV_INPUT_GRAD ? p.C_out : p.C_in, ld = OP == CONV_INPUT_GRAD ? p.lddy : p.ldx;
    const uint64_t image_sizes[4] = {(uint64_t)C, (uint64_t)p.W, (uint64_t)p.H, (uint64_t)p.N};
    const uint64_t image_strides[3] = {ld * e, p.W * ld * e, (uint64_t)p.H * p.W * ld * e};
    const uint32_t image_box[4] = {64, cols, rows, imgs};
    CUtensorMap image_map = conv_tensor_map(image, 4, image_sizes, image_strides, image_box), other;
    if (OP == CONV_WEIGHT_GRAD) {
        const uint64_t sizes[2] = {(uint64_t)p.C_out, (uint64_t)p.K}, strides[1] = {p.lddy * e};
        const uint32_t box[2] = {64, 64};
        other = conv_tensor_map(p.dy, 2, sizes, strides, box);
    } else {
        const uint64_t sizes[2] = {(uint64_t)9 * p.C_in, (uint64_t)p.C_out}, strides[1] = {9 * p.C_in * e};
        const uint32_t box[2] = {64, OP == CONV_FORWARD ? (uint32_t)BN : 64};
        other = conv_tensor_map(p.w, 2, sizes, strides, box);
    }
    dim3 grid((p.M + BM - 1) / BM, (p.Ng + BN - 1) / BN, slices);
    if (OP == CONV_WEIGHT_GRAD) kernel<<<grid, CONV_THREADS, Tile::SMEM, gpu.stream>>>(other, image_map, p);
    else kernel<<<grid, CONV_THREADS, Tile::SMEM, gpu.stream>>>(image_map, other, p);
    cuda_check_launch();
}

// The channel sums a forward gathers (ConvGemm.sums) in tiles_per_image tiles of each image: kept
// when asked for and they fit (q->sums_numel), and the tiles are returned (GroupNorm's slots a
// sample); else 0, and q->sums is cleared.
static int conv_sum_slots(ConvGemm *q, int tiles_per_image) {
    if (q->sums && tiles_per_image > 0 && (int64_t)q->N * tiles_per_image * q->Ng * 2 <= q->sums_numel) return tiles_per_image;
    q->sums = NULL;
    return 0;
}

// The forward or input-gradient product on 128 x BN tiles: through the TMA (tma), else gathered.
// Returns the slots of the channel sums gathered (a forward's, where a tile, or each half of one,
// lies inside an image).
template <int OP, int BN>
static int conv_launch_wgmma_tiles(const ConvGemm &p, bool tma) {
    ConvGemm q = p;
    int HW = p.Ho * p.Wo;
    q.sum_rows = HW % 128 == 0 ? 128 : 64;
    int slots = conv_sum_slots(&q, HW % q.sum_rows == 0 ? HW / q.sum_rows : 0);
    if (tma) conv_launch_tma<OP, 128, BN>(q, 1);
    else conv_launch_wgmma<OP, 128, BN>(q, 1);
    return slots;
}

// ---- 3x3 convolution: split products (sm_90a) ----

// A split product's result (see conv3x3_split_slices): out[m][n] = sum over the slices, in order, of
// out_f[slice][m][n], + bias[n] (+ residual[m][n]) forward, + what dx held when adding.
template <int OP>
__global__ void conv_split_finish_kernel(const ConvGemm p, int slices) {
    int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, total = (int64_t)p.M * p.Ng;
    if (i >= total) return;
    int m = (int)(i / p.Ng), n = (int)(i % p.Ng);
    float v = 0.0f;
    for (int s = 0; s < slices; s++) v += p.out_f[s * total + i];
    floatX *o = p.out + (int64_t)m * p.ldo + n;
    if (OP == CONV_FORWARD) {
        v += (float)p.bias[n];
        if (p.residual) v += (float)p.residual[(int64_t)m * p.ldr + n];
    } else if (p.add_out) {
        v += (float)*o;
    }
    *o = (floatX)v;
}

// A split product (conv3x3_split_slices, planned as CONV_SPLIT): each slice's products of 128 x 128
// tiles into scratch in fp32, through the TMA (plan->tma) or gathered, then added in order with the
// bias and residual, or what dx held, by conv_split_finish_kernel. Gathers no channel sums.
template <int OP>
static void conv_launch_split(const ConvGemm &p, const ConvPlan *plan, float *split) {
    ConvGemm q = p;
    q.k_per_slice = plan->k_per_slice, q.out_f = split, q.pair_store = p.Ng % 2 == 0;  // (scratch is 8-byte aligned)
    if (plan->tma) conv_launch_tma<OP, 128, 128, true>(q, plan->slices);
    else conv_launch_wgmma_kernel<OP, 128, 128, false, true>(q, plan->slices);
    conv_split_finish_kernel<OP><<<(unsigned)(((int64_t)p.M * p.Ng + 255) / 256), 256, 0, gpu.stream>>>(q, plan->slices);
    cuda_check_launch();
}

// ---- 3x3 convolution: halo (sm_90a) ----

// The halo kernel (sm_90a): the stride-1 forward and input gradient for images a multiple of 64 pixels
// wide and channel counts that are multiples of 64, reading each input element into shared memory
// about once instead of once per tap (conv3x3_wgmma_kernel gathers its A tile anew for every tap). A
// block computes ROWS output rows x 64 columns x BN channels of one image, each warpgroup ROWS / 2 of
// the rows. For each 64-channel chunk of its input (x, or dy for the input gradient) it copies the
// halo, the tile plus one pixel on every side ((ROWS + 2) x 66 pixels, zero outside the image), into
// shared memory once; the nine taps are nine shifted views of it, each wgmma's A operand. With halo
// pixel (i, j) the image's (h0 - 1 + i, w0 - 1 + j):
//   forward       y(h0 + r, w0 + c)  = bias + sum_{t, chunk} x-halo(r + kh, c + kw) w[:, t, chunk] (+ residual)
//   input grad    dx(h0 + r, w0 + c) = sum_{t, chunk} dy-halo(r + 2 - kh, c + 2 - kw) w[chunk, t, :]
// The halo is stored as one 128-byte line per pixel with the 128-byte swizzle of the wgmma kernel's
// tiles (16-byte chunk j of line q at chunk j ^ (q % 8)). The swizzle is a function of the address, so
// a view of one row's 64 pixels may start at any line. The B tiles (one tap of one chunk) are
// ConvWgmmaOperand's, in a ring of B_STAGES. The blocks are persistent: block b runs items b,
// b + gridDim.x, ... (an item is a tile and a group of BN output channels), and its k steps (item,
// chunk, tap) run as one sequence, so the next item's loads overlap this one's last steps and store.
template <int ROWS, int BN>
struct ConvHaloTile {
    static constexpr int HALO_W = 66, HALO_PIXELS = (ROWS + 2) * HALO_W;
    // elements; a halo buffer is a whole number of 1024-byte swizzle atoms
    static constexpr int HALO = (HALO_PIXELS * 64 + 511) / 512 * 512, B_STAGES = 4, B_TILE = BN * 64;
    static constexpr size_t SMEM = (size_t)(2 * HALO + B_STAGES * B_TILE) * sizeof(floatX) + 1024;
    static constexpr int BLOCKS_PER_SM = 2 * SMEM <= 227 * 1024 ? 2 : 1;  // 1 for the tiles built (8 x 64, 4 x 128, 4 x 192)
    static_assert(ROWS % 2 == 0, "each warpgroup takes ROWS / 2 rows");
};

template <int OP, int ROWS, int BN>
__global__ void __launch_bounds__(CONV_THREADS, (ConvHaloTile<ROWS, BN>::BLOCKS_PER_SM)) conv3x3_halo_kernel(const ConvGemm p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
    typedef ConvHaloTile<ROWS, BN> Tile;
    constexpr int STAGES = Tile::B_STAGES;
    constexpr bool B_K_MAJOR = OP == CONV_FORWARD;
    constexpr int B_STEP = B_K_MAJOR ? 16 : 16 * 64;  // a k16 step along the B tile (as in conv3x3_wgmma_kernel)
    constexpr uint32_t B_LEADING = B_K_MAJOR ? 16 : CONV_WGMMA_BK * 128;
    extern __shared__ __align__(16) unsigned char conv_smem[];
    floatX *Bs = (floatX *)(conv_smem + (1024 - conv_smem_address(conv_smem) % 1024) % 1024);  // swizzle atoms: 1024 bytes
    floatX *halos = Bs + STAGES * Tile::B_TILE;
    const floatX *src = OP == CONV_FORWARD ? p.x : p.dy;
    const int ld = OP == CONV_FORWARD ? p.ldx : p.lddy, C = OP == CONV_FORWARD ? p.C_in : p.C_out;  // k channels
    const int tiles_w = p.W / 64, tiles_h = (p.H + ROWS - 1) / ROWS, groups = p.Ng / BN;
    const int items = p.N * tiles_h * tiles_w * groups, chunks = C / 64;
    const int steps = ((items - 1 - (int)blockIdx.x) / (int)gridDim.x + 1) * 9 * chunks;

    // Item i of this block: image n, first row h0 and column w0, first output channel n0.
    struct Item {
        int n, h0, w0, n0;
    };
    auto item_of = [&](int i) {
        int item = blockIdx.x + i * gridDim.x, tile = item / groups;
        Item it = {tile / tiles_w / tiles_h, tile / tiles_w % tiles_h * ROWS, tile % tiles_w * 64, item % groups * BN};
        return it;
    };
    // The loads run ahead of the products: B tiles STAGES - 2 steps, halos most of a chunk. Each has a
    // cursor (item, chunk's first channel c0, tap) that moves one step, or one chunk, at a time.
    struct Cursor {
        int i, c0, tap;
    };
    auto next_chunk = [&](Cursor &at) {
        at.tap = 0, at.c0 += 64;
        if (at.c0 == C) at.c0 = 0, at.i++;
    };
    // The next chunk's halo, into buffer `halo` (64 channels of a pixel a line, swizzled).
    Cursor halo_at = {0, 0, 0};
    auto load_halo = [&](floatX *halo) {
        Item it = item_of(halo_at.i);
        const floatX *from = src + ((int64_t)it.n * p.H * p.W) * ld + halo_at.c0;
        for (int e = threadIdx.x; e < Tile::HALO_PIXELS * 8; e += CONV_THREADS) {
            int q = e / 8, part = e % 8, h = it.h0 - 1 + q / Tile::HALO_W, w = it.w0 - 1 + q % Tile::HALO_W;
            bool inside = (unsigned)h < (unsigned)p.H && (unsigned)w < (unsigned)p.W;
            conv_cp_async16(halo + q * 64 + (part ^ (q & 7)) * 8, inside ? from + ((int64_t)h * p.W + w) * ld + part * 8 : src,
                            inside);
        }
        next_chunk(halo_at);
    };
    ConvWgmmaOperand<OP, false, BN, false> b_operand;
    Cursor b_at = {0, 0, 0};
    int b_loaded = 0, b_item = -1;  // steps whose B tile is loaded; the item b_operand is set up for
    auto load_b = [&]() {  // the next step's B tile: its tap of its chunk, its item's output channels
        if (b_loaded < steps) {
            if (b_at.i != b_item) b_operand.init(p, item_of(b_at.i).n0), b_item = b_at.i;
            ConvStep st = {b_at.tap * C + b_at.c0, b_at.tap, b_at.c0, NULL};
            b_operand.load(Bs + b_loaded % STAGES * Tile::B_TILE, p.w, p, st);
            if (++b_at.tap == 9) next_chunk(b_at);
            b_loaded++;
        }
        conv_cp_async_commit();
    };

    const int group = threadIdx.x / 128;
    float acc[ROWS / 2][BN / 2] = {};
    // The store: accumulator j of 4 (per 8 columns) holds pixels lane / 4 and + 8 of the warp's 16,
    // output channels n0 + 8 j + 2 (lane % 4) + 0, 1. Forward: + bias (+ residual), and the tile's
    // channel sums when asked (p.sums; the k steps' barriers separate one item's from the next's);
    // input gradient: + what dx holds when add_out. 64 channels at a time, so that the sums of only 16
    // columns are live beside the accumulators.
    auto store = [&](int i) {
        Item it = item_of(i);
        const int lane = threadIdx.x % 32, column = it.w0 + (threadIdx.x % 128) / 32 * 16 + lane / 4;
        const int co = it.n0 + (lane % 4) * 2;  // the first of the thread's output channels
        const bool add_out = OP == CONV_FORWARD ? p.residual != NULL : p.add_out;
#pragma unroll
        for (int jb = 0; jb < BN / 64; jb++) {  // 64 of the tile's channels at a time: j = 8 jb .. 8 jb + 7
            float v[32] = {};  // the stored values' sums (conv_warp_sums_8)
            float2 bias[8];
#pragma unroll
            for (int j = 0; j < 8; j++)
                bias[j] = OP == CONV_FORWARD ? __bfloat1622float2(*((const __nv_bfloat162 *)(p.bias + co) + 32 * jb + 4 * j))
                                             : make_float2(0.0f, 0.0f);
#pragma unroll
            for (int r = 0; r < ROWS / 2; r++) {
                int h = it.h0 + group * (ROWS / 2) + r;
                if (h >= p.H) continue;
#pragma unroll
                for (int half = 0; half < 2; half++) {  // pixels lane / 4, and 8 further
                    int64_t pixel = (int64_t)(it.n * p.H + h) * p.W + column + 8 * half;
                    floatX *out = p.out + pixel * p.ldo + it.n0 + 64 * jb;  // the pixel's 64 channels
                    // what is added: the residual's pixel, or out's own (an input gradient added to dx)
                    const __nv_bfloat162 *add =
                        (const __nv_bfloat162 *)((OP == CONV_FORWARD && add_out ? p.residual + pixel * p.ldr : out - it.n0 - 64 * jb) + co) +
                        32 * jb;
                    uint32_t words[2][4];  // channels 8 j + 2 (lane % 4) + 0, 1, then (transposed) 8 (lane % 4) + 32 k ..
#pragma unroll
                    for (int j = 0; j < 8; j++) {
                        const int a = 4 * (8 * jb + j) + 2 * half;  // the accumulators of channels co + 8 (8 jb + j) + 0, 1
                        float2 u = make_float2(acc[r][a] + bias[j].x, acc[r][a + 1] + bias[j].y);
                        if (add_out) {
                            float2 b = __bfloat1622float2(add[4 * j]);
                            u.x += b.x, u.y += b.y;
                        }
                        __nv_bfloat162 stored = __floats2bfloat162_rn(u.x, u.y);
                        words[j / 4][j % 4] = *(const uint32_t *)&stored;
                        float2 y = __bfloat1622float2(stored);
                        v[4 * j] += y.x, v[4 * j + 1] += y.y, v[4 * j + 2] += y.x * y.x, v[4 * j + 3] += y.y * y.y;
                    }
#pragma unroll
                    for (int k = 0; k < 2; k++) {
                        conv_quad_transpose(words[k]);
                        *(uint4 *)(out + 32 * k + 8 * (lane % 4)) = make_uint4(words[k][0], words[k][1], words[k][2], words[k][3]);
                    }
                }
            }
            if constexpr (OP == CONV_FORWARD)
                if (p.sums) conv_warp_sums_8<BN>(8 * jb, v);
        }
        if constexpr (OP == CONV_FORWARD)  // the tile's slot: its place among the image's tiles
            if (p.sums)
                conv_tile_sums_store<BN>(p.sums + ((((int64_t)it.n * tiles_h + it.h0 / ROWS) * tiles_w + it.w0 / 64) * p.Ng + it.n0) * 2,
                                         BN);
    };

    // Step s (tap s % 9 of chunk s / 9 of the sequence) waits for its B tile, loaded STAGES - 2 steps
    // before with, at a chunk's first tap, the chunk's halo among the loads before it. Once its products
    // are issued (so that their addresses and copies do not delay them) it loads the B tile of step
    // s + STAGES - 2 into the slot step s - 2 used, and at a chunk's second tap the next chunk's halo
    // into the buffer the chunk before this one used: every warpgroup has finished reading both
    // (wgmma.wait_group 1 leaves only step s - 1's products running).
    load_halo(halos);
    for (int j = 0; j < STAGES - 2; j++) load_b();
    for (int i = 0, s = 0, chunk = 0; s < steps; i++) {
        for (int c0 = 0; c0 < C; c0 += 64, chunk++) {
            const floatX *halo = halos + chunk % 2 * Tile::HALO;
            for (int tap = 0; tap < 9; tap++, s++) {
                conv_cp_async_wait<STAGES - 3>();
                asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // cp.async's writes, seen by wgmma
                __syncthreads();
                // The descriptors' start addresses count 16 bytes (8 elements) a unit; adding to the field
                // cannot carry out of it, as every view ends inside its buffer and shared memory stays
                // below 256 KB. (Base offset 0: the swizzle pattern starts on a 1024-byte boundary.)
                const int kh = tap / 3, kw = tap % 3, first_row = group * (ROWS / 2);
                const int q0 = OP == CONV_FORWARD ? (first_row + kh) * Tile::HALO_W + kw
                                                  : (first_row + 2 - kh) * Tile::HALO_W + 2 - kw;
                const uint64_t a_desc = conv_wgmma_descriptor(halo + q0 * 64, 16);
                const uint64_t b_desc = conv_wgmma_descriptor(Bs + s % STAGES * Tile::B_TILE, B_LEADING);
                asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
                for (int r = 0; r < ROWS / 2; r++)  // the warpgroup's row r: its view starts r halo rows later
#pragma unroll
                    for (int k = 0; k < 4; k++)  // k16 step k: channels [16 k, 16 k + 16) of the chunk
                        conv_wgmma<BN, 0, B_K_MAJOR ? 0 : 1>(acc[r], a_desc + (r * Tile::HALO_W * 64 + k * 16) / 8,
                                                             b_desc + k * B_STEP / 8);
                asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
                if (tap == 1 && s + 8 < steps) load_halo(halos + (chunk + 1) % 2 * Tile::HALO);  // (while the products run)
                load_b();
                asm volatile("wgmma.wait_group.sync.aligned 1;\n" ::: "memory");
            }
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        store(i);
#pragma unroll
        for (int r = 0; r < ROWS / 2; r++)
#pragma unroll
            for (int j = 0; j < BN / 2; j++) acc[r][j] = 0.0f;
    }
    conv_cp_async_wait<0>();
#else
    __trap();  // launched only where gpu.sm90a says the sm_90a code runs
#endif
}

// The halo kernel (planned as CONV_HALO where it applies: both operands in 16-byte chunks, output
// pairs aligned): BN = 192 (forward only: its B tile is K-major) or 128 in 4-row tiles where the
// output channels allow, else BN = 64 in 8-row tiles; as many blocks as run at once, or one per item
// when fewer. (H100, dev/bench_conv: 8-row tiles for BN = 64 ran 1.00-1.10x of 4-row ones, BN = 192
// 1.12-1.18x of BN = 64 on adm64's 192-channel forwards.) Returns the slots of the channel sums gathered.
template <int OP, int ROWS, int BN>
static int conv_launch_halo(const ConvGemm &p) {
    typedef ConvHaloTile<ROWS, BN> Tile;
    auto kernel = conv3x3_halo_kernel<OP, ROWS, BN>;
    static bool configured = false;
    allow_dynamic_smem(kernel, &configured, Tile::SMEM);
    ConvGemm q = p;
    int slots = conv_sum_slots(&q, (p.H + ROWS - 1) / ROWS * (p.W / 64));
    int64_t items = (int64_t)p.N * ((p.H + ROWS - 1) / ROWS) * (p.W / 64) * (p.Ng / BN);
    int64_t at_once = (int64_t)conv_sms() * Tile::BLOCKS_PER_SM;
    kernel<<<(int)(items < at_once ? items : at_once), CONV_THREADS, Tile::SMEM, gpu.stream>>>(q);
    cuda_check_launch();
    return slots;
}

// ---- 3x3 convolution: image (the input convolution) ----

// The model's input convolution (input_blocks.0: 3 image channels in, too few for the other kernels'
// 16-byte loads; their scalar path took 214 us of a sampling step at batch 256) as a product of its
// own on the tensor cores: y = A W^T + bias over k = 27 (3 x 3 taps x 3 channels, padded to 32), row m
// of A being pixel m's patch:
//   A[m][k] = x[n][h + kh - 1][w + kw - 1][ci],  k = 3 (3 kh + kw) + ci   (zero outside the image)
// A tile is 4 rows x 64 columns of an image and 64 output channels; warp w takes row w / 2, columns
// 32 (w % 2) .. + 31, as two m16n8k16 row blocks of 16 pixels. The tile's input patch (6 x 66 pixels,
// zero outside the image) goes to shared memory through registers loaded a tile ahead, and a thread
// builds its A fragments from it: each fragment slot's pixel and k are fixed, so its place in the
// patch is an offset worked out once. The weights stay in shared memory as [C_out][k], rows padded to
// CONV_IMAGE_LDW (conflict-free fragment loads). A row block's 16 pixels x 64 channels go out through
// a staging area of the warp's, as whole 128-byte pixels in 16-byte stores: the fragments' own 4-byte
// stores, 8 pixels apart, cost ~2x (dev/NOTES.md j). Where p.sums is set, the tile's
// channel sums are gathered from the stored values as the other kernels gather them
// (conv_warp_sums_8); a slot per 4 x 64 tile of an image.
#define CONV_IMAGE_PATCH (6 * 66 * CONV_IMAGE_CHANNELS)                            // values
#define CONV_IMAGE_FETCH ((CONV_IMAGE_PATCH + CONV_THREADS - 1) / CONV_THREADS)  // of them a thread copies
#define CONV_IMAGE_LDW 40
#define CONV_IMAGE_LDS 72  // a staged pixel's 64 channels, padded: conflict-free fragment writes

struct ConvImageTile {
    int n, h0, w0, c0, slot;
};

__device__ inline ConvImageTile conv_image_tile(const ConvGemm &p, int t, int tiles_w, int tiles_per_image) {
    ConvImageTile it;
    int groups = p.C_out / 64;
    it.c0 = t % groups * 64, t /= groups;
    it.slot = t % tiles_per_image, it.n = t / tiles_per_image;
    it.h0 = it.slot / tiles_w * 4, it.w0 = it.slot % tiles_w * 64;
    return it;
}

// The patch values this thread copies: patch[i], i = threadIdx.x + j CONV_THREADS, is x at row
// h0 - 1 + i / (66 * 3), column w0 - 1 + i / 3 % 66, channel i % 3.
__device__ inline void conv_image_fetch(const ConvGemm &p, const ConvImageTile &it, floatX (&v)[CONV_IMAGE_FETCH]) {
    for (int j = 0; j < CONV_IMAGE_FETCH; j++) {
        int i = threadIdx.x + j * CONV_THREADS, h = it.h0 - 1 + i / (66 * 3), w = it.w0 - 1 + i / 3 % 66;
        bool inside = i < CONV_IMAGE_PATCH && h >= 0 && h < p.H && w >= 0 && w < p.W;
        v[j] = inside ? p.x[((int64_t)(it.n * p.H + h) * p.W + w) * p.ldx + i % 3] : __float2bfloat16(0.0f);
    }
}

__global__ void __launch_bounds__(CONV_THREADS, 2) conv3x3_image_kernel(ConvGemm p) {
    extern __shared__ float4 image_smem[];
    floatX *weights = (floatX *)image_smem;  // [C_out][CONV_IMAGE_LDW]
    float *bias = (float *)(weights + p.C_out * CONV_IMAGE_LDW);
    floatX *patch = (floatX *)(bias + p.C_out);  // [6][66][3]
    __shared__ __align__(16) floatX staging[CONV_THREADS / 32][16 * CONV_IMAGE_LDS];  // a warp's row block [16][64]
    for (int i = threadIdx.x; i < p.C_out * CONV_IMAGE_LDW; i += CONV_THREADS) {
        int c = i / CONV_IMAGE_LDW, k = i % CONV_IMAGE_LDW;
        weights[i] = k < 27 ? p.w[(int64_t)c * 27 + k] : __float2bfloat16(0.0f);
    }
    for (int c = threadIdx.x; c < p.C_out; c += CONV_THREADS) bias[c] = __bfloat162float(p.bias[c]);
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4;
    // The patch offsets of the thread's A slots, from its pixel's patch corner: k = 16 s + 8 half + 2 t
    // + e for k step s (-1: k past 27, zero).
    int offset[2][2][2];
    for (int s = 0; s < 2; s++)
        for (int half = 0; half < 2; half++)
            for (int e = 0; e < 2; e++) {
                int k = 16 * s + 8 * half + 2 * t + e, tap = k / 3;
                offset[s][half][e] = k < 27 ? ((tap / 3) * 66 + tap % 3) * 3 + k % 3 : -1;
            }
    const int tiles_w = (p.W + 63) / 64, tiles_per_image = (p.H + 3) / 4 * tiles_w;
    const int tiles = p.N * tiles_per_image * (p.C_out / 64), row = warp / 2;
    floatX ahead[CONV_IMAGE_FETCH];
    if (blockIdx.x < tiles) conv_image_fetch(p, conv_image_tile(p, blockIdx.x, tiles_w, tiles_per_image), ahead);
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        ConvImageTile it = conv_image_tile(p, tile, tiles_w, tiles_per_image);
        __syncthreads();  // the last tile's patch read
        for (int j = 0; j < CONV_IMAGE_FETCH; j++)
            if (threadIdx.x + j * CONV_THREADS < CONV_IMAGE_PATCH) patch[threadIdx.x + j * CONV_THREADS] = ahead[j];
        __syncthreads();
        if (tile + gridDim.x < tiles) conv_image_fetch(p, conv_image_tile(p, tile + gridDim.x, tiles_w, tiles_per_image), ahead);
        float v[32] = {};  // the stored values' sums (conv_warp_sums_8)
#pragma unroll 1
        for (int block = 0; block < 2; block++) {
            const int column = 32 * (warp % 2) + 16 * block;  // of the block's rows g, g + 8: pixels column + g, + 8
            uint32_t a[2][4];
#pragma unroll
            for (int s = 0; s < 2; s++)
#pragma unroll
                for (int half = 0; half < 2; half++)
#pragma unroll
                    for (int low = 0; low < 2; low++) {
                        const floatX *corner = patch + (row * 66 + column + g + 8 * low) * 3;
                        const int *o = offset[s][half];
                        __nv_bfloat162 pair = __halves2bfloat162(o[0] >= 0 ? corner[o[0]] : __float2bfloat16(0.0f),
                                                                 o[1] >= 0 ? corner[o[1]] : __float2bfloat16(0.0f));
                        a[s][2 * half + low] = *(uint32_t *)&pair;
                    }
#pragma unroll
            for (int j = 0; j < 8; j++) {
                const int c = it.c0 + 8 * j;  // the n-tile's columns c .. c + 7
                float acc[4] = {bias[c + 2 * t], bias[c + 2 * t + 1], bias[c + 2 * t], bias[c + 2 * t + 1]};
#pragma unroll
                for (int s = 0; s < 2; s++) {
                    const floatX *w = weights + (c + g) * CONV_IMAGE_LDW + 16 * s + 2 * t;
                    conv_mma_bf16(acc, a[s], *(const uint32_t *)w, *(const uint32_t *)(w + 8));
                }
#pragma unroll
                for (int low = 0; low < 2; low++) {
                    __nv_bfloat162 stored = __floats2bfloat162_rn(acc[2 * low], acc[2 * low + 1]);
                    *(__nv_bfloat162 *)&staging[warp][(g + 8 * low) * CONV_IMAGE_LDS + 8 * j + 2 * t] = stored;
                    bool inside = it.h0 + row < p.H && it.w0 + column + g + 8 * low < p.W;
                    float2 f = inside ? __bfloat1622float2(stored) : make_float2(0.0f, 0.0f);
                    v[4 * j] += f.x, v[4 * j + 1] += f.y, v[4 * j + 2] += f.x * f.x, v[4 * j + 3] += f.y * f.y;
                }
            }
            __syncwarp();
#pragma unroll
            for (int i = lane; i < 16 * 8; i += 32) {  // 16 bytes: pixel i / 8's channels 8 (i % 8) ..
                int h = it.h0 + row, w = it.w0 + column + i / 8;
                if (h < p.H && w < p.W)
                    *(uint4 *)(p.out + ((int64_t)(it.n * p.H + h) * p.W + w) * p.ldo + it.c0 + 8 * (i % 8)) =
                        *(const uint4 *)&staging[warp][i / 8 * CONV_IMAGE_LDS + 8 * (i % 8)];
            }
            __syncwarp();  // read before the next row block writes
        }
        if (p.sums) {
            conv_warp_sums_8<64>(0, v);
            conv_tile_sums_store<64>(p.sums + (((int64_t)it.n * tiles_per_image + it.slot) * p.C_out + it.c0) * 2, 64);
        }
    }
}

// ---- 3x3 convolution: narrow (the output head) ----

// The output head's convolution (C_out = 3 or 6 channels out of 64 or more: the other kernels read
// each input pixel once per tap, 9 times; theirs took 386 us of a sampling step at batch 256) as a
// product of its own on the tensor cores: y = A W^T + bias over k = 9 C_in in the weights' order
// (tap = 3 kh + kw, then ci), A[m][k] = x[n][h + kh - 1][w + kw - 1][ci] (zero outside the image).
// A tile is 4 rows x 64 columns of an image; its input halo, 6 x 66 pixels of 64 channels at a time
// (zero outside the image), is copied to shared memory once, and every tap reads it there: tap
// (kh, kw) of tile pixel (r, c) is halo pixel (r + kh, c + kw). Warp w takes row w / 2, columns
// 32 (w % 2) .. + 31 as two m16n8k16 row blocks, A by ldmatrix from the halo (pixels padded to
// CONV_NARROW_LD channels: conflict-free), B from the weights in shared memory as [8][9 C_in + 8]
// (the one n8 tile: columns past C_out zero). Three blocks a multiprocessor overlap one another's
// copies.
#define CONV_NARROW_LD 72
#define CONV_NARROW_HALO (6 * 66 * CONV_NARROW_LD)  // values

__global__ void __launch_bounds__(CONV_THREADS, CONV_NARROW_BLOCKS_PER_SM) conv3x3_narrow_kernel(ConvGemm p) {
    extern __shared__ float4 narrow_smem[];
    floatX *halo = (floatX *)narrow_smem, *weights = halo + CONV_NARROW_HALO;
    const int K = 9 * p.C_in, ldw = K + 8;
    for (int i = threadIdx.x; i < 8 * ldw; i += CONV_THREADS) {
        int c = i / ldw, k = i % ldw;
        weights[i] = c < p.C_out && k < K ? p.w[(int64_t)c * K + k] : __float2bfloat16(0.0f);
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, t = lane % 4, row = warp / 2;
    const float bias0 = 2 * t < p.C_out ? __bfloat162float(p.bias[2 * t]) : 0.0f;
    const float bias1 = 2 * t + 1 < p.C_out ? __bfloat162float(p.bias[2 * t + 1]) : 0.0f;
    const int tiles_w = (p.W + 63) / 64, tiles_per_image = (p.H + 3) / 4 * tiles_w, tiles = p.N * tiles_per_image;
    for (int tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
        const int n = tile / tiles_per_image, h0 = tile % tiles_per_image / tiles_w * 4, w0 = tile % tiles_w * 64;
        float acc[2][4] = {{bias0, bias1, bias0, bias1}, {bias0, bias1, bias0, bias1}};
        for (int c0 = 0; c0 < p.C_in; c0 += 64) {
            __syncthreads();  // the halo's last readers are done
            for (int i = threadIdx.x; i < 6 * 66 * 8; i += CONV_THREADS) {  // 8 copies of 16 bytes a pixel
                int pixel = i / 8, h = h0 - 1 + pixel / 66, w = w0 - 1 + pixel % 66;
                bool inside = h >= 0 && h < p.H && w >= 0 && w < p.W;
                const floatX *from = inside ? p.x + ((int64_t)(n * p.H + h) * p.W + w) * p.ldx + c0 + 8 * (i % 8) : p.x;
                conv_cp_async16(halo + pixel * CONV_NARROW_LD + 8 * (i % 8), from, inside);
            }
            conv_cp_async_commit();
            conv_cp_async_wait<0>();
            __syncthreads();
#pragma unroll 1
            for (int tap = 0; tap < 9; tap++)
#pragma unroll
                for (int kc = 0; kc < 64; kc += 16) {
                    const floatX *wk = weights + g * ldw + tap * p.C_in + c0 + kc + 2 * t;
                    uint32_t b0 = *(const uint32_t *)wk, b1 = *(const uint32_t *)(wk + 8);
#pragma unroll
                    for (int block = 0; block < 2; block++) {
                        // lane l gives the address of row l % 8 + 8 (l / 8 % 2) of the block's 16 pixels, channels
                        // kc + 8 (l / 16) ..: the four 8 x 8 matrices of A's fragment in order
                        int pixel = 32 * (warp % 2) + 16 * block + lane % 8 + 8 * (lane / 8 % 2);
                        const floatX *at = halo + ((row + tap / 3) * 66 + pixel + tap % 3) * CONV_NARROW_LD + kc + 8 * (lane / 16);
                        uint32_t a[4];
                        conv_ldmatrix_x4<false>(a, at);
                        conv_mma_bf16(acc[block], a, b0, b1);
                    }
                }
        }
#pragma unroll
        for (int block = 0; block < 2; block++)
#pragma unroll
            for (int low = 0; low < 2; low++) {
                int h = h0 + row, w = w0 + 32 * (warp % 2) + 16 * block + g + 8 * low;
                if (h >= p.H || w >= p.W) continue;
                floatX *y = p.out + ((int64_t)(n * p.H + h) * p.W + w) * p.ldo;
                if (2 * t < p.C_out) y[2 * t] = __float2bfloat16(acc[block][2 * low]);
                if (2 * t + 1 < p.C_out) y[2 * t + 1] = __float2bfloat16(acc[block][2 * low + 1]);
            }
    }
}

// Takes the forward when it is the output head's: few output channels (at most 8), C_in a multiple
// of 64 (at most 512: 131 KB of shared memory), x in 16-byte rows, no residual. Gathers no sums.
static void conv_launch_narrow(const ConvGemm &p) {
    static bool configured = false;
    allow_dynamic_smem(conv3x3_narrow_kernel, &configured, (CONV_NARROW_HALO + 8 * (9 * 512 + 8)) * sizeof(floatX));
    int smem = (CONV_NARROW_HALO + 8 * (9 * p.C_in + 8)) * (int)sizeof(floatX);
    int64_t tiles = (int64_t)p.N * ((p.H + 3) / 4) * ((p.W + 63) / 64), at_once = (int64_t)conv_sms() * CONV_NARROW_BLOCKS_PER_SM;
    conv3x3_narrow_kernel<<<(int)(tiles < at_once ? tiles : at_once), CONV_THREADS, smem, gpu.stream>>>(p);
    cuda_check_launch();
}

// The output head's input gradient: with at most 8 output channels a value is a sum of only 9 C_out
// products, too short a k for the other kernels' tiles (mma's 128 x 128 tiles over k = 9 C_out ran it
// at 0.33-0.38x of cuDNN; a kernel of fp32 products on the CUDA cores, 1.5-1.6x faster, was bound by its
// shared-memory reads: dev/NOTES.md u and rr). Here on the tensor cores, with k
// laid out as 8 tap + co (co padded to 8, k to 80: five k16 steps, zeros past the weights):
//   dx[n][h][w][ci] (+)= sum_{kh, kw, co} dy[n][h + 1 - kh][w + 1 - kw][co] w[co][kh][kw][ci]
//   A[px][8 tap + co] = dys[2 - kh][px + 2 - kw][co],   B[8 tap + co][ci] = ws[ci][8 tap + co]
// A block takes 64 channels (blockIdx.y) and their weights to shared memory once, then strips of
// CONV_NARROW_ROW pixels of one row (blockIdx.x, + gridDim.x, ...): each strip's dy, its three rows
// around them (zero outside the image; dys[r][j] is dy at row h - 1 + r, column w0 - 1 + j), is read
// into registers while the strip before it is multiplied, then written to shared memory (two
// buffers). Warp i takes pixels 16 i .. 16 i + 15 as mma.sync m16n8k16 products, 8 channels a
// product; an A fragment's word (pixel, co pair 2 (lane % 4) of tap 2 s or 2 s + 1) is one 32-bit load.
#define CONV_NARROW_TAPS 80  // k: 9 taps x 8 channels, padded to five k16 steps
#define CONV_NARROW_LDW 88   // a channel's k in shared memory, padded: conflict-free B fragment loads
#define CONV_NARROW_DY (3 * (CONV_NARROW_ROW + 2) * 4)                            // a strip's dy, in pairs of channels
#define CONV_NARROW_FETCH ((CONV_NARROW_DY + CONV_THREADS - 1) / CONV_THREADS)  // of them a thread reads

// dy's channels co, co + 1 at `pixel` (NULL: outside the image) as one word of two bf16, zero past C_out.
__device__ __forceinline__ uint32_t conv_narrow_pair(const ConvGemm &p, const floatX *pixel, int co) {
    const floatX zero = __float2bfloat16(0.0f);
    __nv_bfloat162 v = __halves2bfloat162(pixel && co < p.C_out ? pixel[co] : zero, pixel && co + 1 < p.C_out ? pixel[co + 1] : zero);
    return *(const uint32_t *)&v;
}

__global__ void __launch_bounds__(CONV_THREADS, CONV_NARROW_BLOCKS_PER_SM) conv3x3_narrow_input_grad_kernel(ConvGemm p) {
    static_assert(CONV_THREADS / 32 * 16 == CONV_NARROW_ROW, "16 pixels a warp");
    __shared__ __align__(16) floatX dys[2][3][CONV_NARROW_ROW + 2][8];
    __shared__ __align__(16) floatX ws[64][CONV_NARROW_LDW];
    const int tiles_w = (p.W + CONV_NARROW_ROW - 1) / CONV_NARROW_ROW, strips = p.N * p.H * tiles_w, c0 = blockIdx.y * 64;
    const floatX zero = __float2bfloat16(0.0f);
    for (int i = threadIdx.x; i < 64 * CONV_NARROW_TAPS; i += CONV_THREADS) {
        int c = i % 64, k = i / 64, tap = k / 8, co = k % 8;
        ws[c][k] = tap < 9 && co < p.C_out ? p.w[((int64_t)co * 9 + tap) * p.C_in + c0 + c] : zero;
    }
    // dy of a strip: pair i = threadIdx.x + f CONV_THREADS of the flattened dys[3][ROW + 2][4 pairs]
    uint32_t fetched[CONV_NARROW_FETCH];
    auto fetch = [&](int strip) {
        const int n = strip / (p.H * tiles_w), h = strip / tiles_w % p.H, w0 = strip % tiles_w * CONV_NARROW_ROW;
#pragma unroll
        for (int f = 0; f < CONV_NARROW_FETCH; f++) {
            int i = threadIdx.x + f * CONV_THREADS, j = i / 4 % (CONV_NARROW_ROW + 2), r = i / 4 / (CONV_NARROW_ROW + 2);
            int hh = h - 1 + r, ww = w0 - 1 + j;
            bool inside = i < CONV_NARROW_DY && hh >= 0 && hh < p.H && ww >= 0 && ww < p.W;
            fetched[f] = conv_narrow_pair(p, inside ? p.dy + ((int64_t)(n * p.H + hh) * p.W + ww) * p.lddy : NULL, 2 * (i % 4));
        }
    };
    auto keep = [&](int buffer) {
#pragma unroll
        for (int f = 0; f < CONV_NARROW_FETCH; f++)
            if (threadIdx.x + f * CONV_THREADS < CONV_NARROW_DY) ((uint32_t *)dys[buffer])[threadIdx.x + f * CONV_THREADS] = fetched[f];
    };
    if (blockIdx.x < strips) fetch(blockIdx.x), keep(0);
    __syncthreads();
    const int lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, px = threadIdx.x / 32 * 16 + g;  // rows px, px + 8
    for (int strip = blockIdx.x, buffer = 0; strip < strips; strip += gridDim.x, buffer ^= 1) {
        if (strip + gridDim.x < strips) fetch(strip + gridDim.x);
        const int n = strip / (p.H * tiles_w), h = strip / tiles_w % p.H, w0 = strip % tiles_w * CONV_NARROW_ROW;
        float acc[8][4] = {};  // [8 channels c0 + 8 j ..][c fragment]
#pragma unroll
        for (int s = 0; s < CONV_NARROW_TAPS / 16; s++) {
            uint32_t a[4];
#pragma unroll
            for (int half = 0; half < 2; half++) {  // k 16 s + 8 half + 2 t, + 1: tap 2 s + half, co 2 t, 2 t + 1
                const int tap = 2 * s + half, r = 2 - tap / 3, shift = 2 - tap % 3;
                a[2 * half] = tap < 9 ? *(const uint32_t *)&dys[buffer][r][px + shift][2 * t] : 0u;
                a[2 * half + 1] = tap < 9 ? *(const uint32_t *)&dys[buffer][r][px + 8 + shift][2 * t] : 0u;
            }
#pragma unroll
            for (int j = 0; j < 8; j++)
                conv_mma_bf16(acc[j], a, *(const uint32_t *)&ws[8 * j + g][16 * s + 2 * t],
                              *(const uint32_t *)&ws[8 * j + g][16 * s + 8 + 2 * t]);
        }
        // Store: fragment j holds channels 8 j + 2 t, + 1 of pixels px, px + 8; transposed within each
        // quad (conv_quad_transpose, the values' low and high halves apart) a lane holds channels
        // 32 q + 8 t .. + 7.
#pragma unroll
        for (int row = 0; row < 2; row++) {
            const int w = w0 + px + 8 * row;
#pragma unroll
            for (int q = 0; q < 2; q++) {
                uint32_t lo[4], hi[4];
#pragma unroll
                for (int j = 0; j < 4; j++)
                    lo[j] = __float_as_uint(acc[4 * q + j][2 * row]), hi[j] = __float_as_uint(acc[4 * q + j][2 * row + 1]);
                conv_quad_transpose(lo), conv_quad_transpose(hi);
                if (w >= p.W) continue;
                Pack *at = (Pack *)(p.out + ((int64_t)(n * p.H + h) * p.W + w) * p.ldo + c0 + 32 * q + 8 * t), v;
                if (p.add_out) v = *at;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    v.v[2 * j] = (floatX)((p.add_out ? (float)v.v[2 * j] : 0.0f) + __uint_as_float(lo[j]));
                    v.v[2 * j + 1] = (floatX)((p.add_out ? (float)v.v[2 * j + 1] : 0.0f) + __uint_as_float(hi[j]));
                }
                *at = v;
            }
        }
        if (strip + gridDim.x < strips) keep(buffer ^ 1);  // (its buffer's last reader was the strip before this one)
        __syncthreads();
    }
}

// As many blocks as run at once, spread over the groups of 64 channels.
static void conv_launch_narrow_input_grad(const ConvGemm &p) {
    int64_t strips = (int64_t)p.N * p.H * ((p.W + CONV_NARROW_ROW - 1) / CONV_NARROW_ROW), chunks = p.C_in / 64;
    int64_t per_chunk = ((int64_t)conv_sms() * CONV_NARROW_BLOCKS_PER_SM + chunks - 1) / chunks;
    dim3 grid((unsigned)(strips < per_chunk ? strips : per_chunk), (unsigned)chunks);
    conv3x3_narrow_input_grad_kernel<<<grid, CONV_THREADS, 0, gpu.stream>>>(p);
    cuda_check_launch();
}

// The output head's weight gradient (at most 8 output channels), on the tensor cores as its input
// gradient is:
//   dw[co][kh][kw][ci] = sum_{n, h, w} x[n][h][w][ci] dy[n][h + 1 - kh][w + 1 - kw][co]   (dy zero outside)
// as products over k = the pixels of x: D[ci][8 tap + co] += A[ci][px] B[px][co] for each tap, A = x^T,
// B = dy shifted by the tap. Block (slice, 64 channels) runs its slice's pixels (conv3x3_weight_grad_slices:
// whole strips) as strips of 128 (conv_pixel_box: a row segment, or whole rows of one image), R x S
// pixels at (n, h0, w0). A strip's x (128 x 64 channels, through cp.async) and dy's window around it
// (win[rr][cc] dy at (h0 - 1 + rr, w0 - 1 + cc), zero outside the image: (R + 2) x (S + 2) pixels of 8
// channels, read into registers) are fetched while the strip before it is multiplied, into the other
// of two buffers. Warp i takes channels 16 (i % 4) .. + 15 and the strip's pixels 64 (i / 4) .. + 63:
// each k16 step an A fragment (ldmatrix.trans of x) and nine B fragments, one a tap (ldmatrix.trans of
// the window's rows for its 16 pixels, shifted by the tap). At the end warps 4-7 add theirs to warps
// 0-3's (a fixed order), which store the block's sums: its slice's (out_f[slice]) or dw itself.
#define CONV_NARROW_WINDOW 390  // the largest window: 3 x 130 pixels of a 128-pixel row segment
#define CONV_NARROW_LDX 72      // a pixel's 64 channels in shared memory, padded: conflict-free ldmatrix
#define CONV_NARROW_WIN_FETCH ((CONV_NARROW_WINDOW * 4 + CONV_THREADS - 1) / CONV_THREADS)  // pairs of channels a thread reads

static size_t conv_narrow_weight_grad_smem(void) {
    return (2 * CONV_NARROW_ROW * CONV_NARROW_LDX + 2 * CONV_NARROW_WINDOW * 8) * sizeof(floatX);
}

__global__ void __launch_bounds__(CONV_THREADS, CONV_NARROW_BLOCKS_PER_SM) conv3x3_narrow_weight_grad_kernel(ConvGemm p, int S) {
    extern __shared__ __align__(16) unsigned char conv_smem[];
    floatX(*xs)[CONV_NARROW_ROW][CONV_NARROW_LDX] = (floatX(*)[CONV_NARROW_ROW][CONV_NARROW_LDX])conv_smem;
    floatX(*win)[CONV_NARROW_WINDOW][8] = (floatX(*)[CONV_NARROW_WINDOW][8])(conv_smem + 2 * sizeof(xs[0]));
    const int R = CONV_NARROW_ROW / S, c0 = blockIdx.y * 64, first = blockIdx.x * p.k_per_slice;
    const int strips = (min(p.K, first + p.k_per_slice) - first) / CONV_NARROW_ROW, window = (R + 2) * (S + 2);
    uint32_t fetched[CONV_NARROW_WIN_FETCH];  // pair i = threadIdx.x + f CONV_THREADS of the flattened window [pixels][4 pairs]
    auto fetch = [&](int strip, int buffer) {  // x through cp.async into xs[buffer]; dy's window into registers
        const int at = first + strip * CONV_NARROW_ROW, n = at / (p.H * p.W), h0 = at / p.W % p.H, w0 = at % p.W;
        for (int i = threadIdx.x; i < CONV_NARROW_ROW * 8; i += CONV_THREADS)
            conv_cp_async16(&xs[buffer][i / 8][i % 8 * 8], p.x + (int64_t)(at + i / 8) * p.ldx + c0 + i % 8 * 8, true);
        conv_cp_async_commit();
#pragma unroll
        for (int f = 0; f < CONV_NARROW_WIN_FETCH; f++) {
            int i = threadIdx.x + f * CONV_THREADS, cc = i / 4 % (S + 2), rr = i / 4 / (S + 2), h = h0 - 1 + rr, w = w0 - 1 + cc;
            bool inside = i < window * 4 && h >= 0 && h < p.H && w >= 0 && w < p.W;
            fetched[f] = conv_narrow_pair(p, inside ? p.dy + ((int64_t)(n * p.H + h) * p.W + w) * p.lddy : NULL, 2 * (i % 4));
        }
    };
    auto keep = [&](int buffer) {
#pragma unroll
        for (int f = 0; f < CONV_NARROW_WIN_FETCH; f++)
            if (threadIdx.x + f * CONV_THREADS < window * 4) ((uint32_t *)win[buffer])[threadIdx.x + f * CONV_THREADS] = fetched[f];
    };
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, m0 = warp % 4 * 16, px0 = warp / 4 * 64;
    float acc[9][4] = {};  // [tap][c fragment]: channels c0 + m0 + lane / 4 (+ 8), output channels 2 (lane % 4) + 0, 1
    if (strips > 0) fetch(0, 0), keep(0);
    for (int strip = 0, buffer = 0; strip < strips; strip++, buffer ^= 1) {
        if (strip + 1 < strips) fetch(strip + 1, buffer ^ 1);
        else conv_cp_async_commit();  // (an empty group: the wait below always leaves one)
        conv_cp_async_wait<1>();
        __syncthreads();  // this strip's x and window in shared memory for every thread
#pragma unroll
        for (int k = 0; k < 4; k++) {  // pixels px0 + 16 k .. + 15
            uint32_t a[4];  // A[ci][px] = x[px][ci]: matrices (px 0-7, ci 0-7), (px 0-7, ci 8-15), (px 8-15, ci 0-7), (8-15, 8-15)
            const int apx = px0 + 16 * k + (lane & 7) + (lane >> 4) * 8;
            conv_ldmatrix_x4<true>(a, &xs[buffer][apx][m0 + (lane >> 3 & 1) * 8]);
            const int bpx = px0 + 16 * k + lane % 16, ri = bpx / S, ci = bpx % S;  // B: lanes 0-15 one tap, 16-31 the next
#pragma unroll
            for (int tap = 0; tap < 9; tap += 2) {
                const int mine = lane < 16 || tap == 8 ? tap : tap + 1, kh = mine / 3, kw = mine % 3;
                uint32_t b[4];
                conv_ldmatrix_x4<true>(b, win[buffer][(ri + 2 - kh) * (S + 2) + ci + 2 - kw]);
                conv_mma_bf16(acc[tap], a, b[0], b[1]);
                if (tap < 8) conv_mma_bf16(acc[tap + 1], a, b[2], b[3]);
            }
        }
        if (strip + 1 < strips) keep(buffer ^ 1);  // (its last reader was the strip before this one)
        __syncthreads();
    }
    // Warps 4-7's sums to shared memory (over x's buffers), added to warps 0-3's in that order.
    float(*partial)[32][9 * 4] = (float(*)[32][9 * 4])conv_smem;
    if (warp >= 4)
        for (int i = 0; i < 9 * 4; i++) partial[warp - 4][lane][i] = acc[i / 4][i % 4];
    __syncthreads();
    if (warp >= 4) return;
    float *out = p.out_f + (int64_t)blockIdx.x * p.M * p.Ng;  // (one slice: dw itself)
    for (int tap = 0; tap < 9; tap++)
        for (int j = 0; j < 4; j++) {
            const int ci = c0 + m0 + lane / 4 + (j >= 2 ? 8 : 0), co = 2 * (lane % 4) + j % 2;
            if (co < p.C_out) out[(int64_t)co * p.Ng + tap * p.C_in + ci] = acc[tap][j] + partial[warp][lane][tap * 4 + j];
        }
}

// Its launch: a block for each slice of the plan (p.k_per_slice pixels) and 64 input channels.
static void conv_launch_narrow_weight_grad(const ConvGemm &p, int slices) {
    static bool configured = false;
    allow_dynamic_smem(conv3x3_narrow_weight_grad_kernel, &configured, conv_narrow_weight_grad_smem());
    uint32_t cols, rows, imgs;
    conv_pixel_box(p.H, p.W, CONV_NARROW_ROW, &cols, &rows, &imgs);
    conv3x3_narrow_weight_grad_kernel<<<dim3(slices, p.C_in / 64), CONV_THREADS, conv_narrow_weight_grad_smem(), gpu.stream>>>(
        p, (int)cols);
    cuda_check_launch();
}

// The model's input convolution (planned as CONV_IMAGE). Returns the slots of the channel sums gathered.
static int conv_launch_image(const ConvGemm &p) {
    int smem = p.C_out * (CONV_IMAGE_LDW * (int)sizeof(floatX) + (int)sizeof(float)) + CONV_IMAGE_PATCH * (int)sizeof(floatX);
    ConvGemm q = p;  // (shared memory: 42 KB at most, no opt-in needed)
    int tiles_per_image = (p.H + 3) / 4 * ((p.W + 63) / 64);
    int slots = conv_sum_slots(&q, tiles_per_image);
    int64_t tiles = (int64_t)p.N * tiles_per_image * (p.C_out / 64), at_once = (int64_t)conv_sms() * 2;
    conv3x3_image_kernel<<<(int)(tiles < at_once ? tiles : at_once), CONV_THREADS, smem, gpu.stream>>>(q);
    cuda_check_launch();
    return slots;
}

static ConvGemm conv_gemm(int op, int N, int H, int W, int C_in, int C_out, int stride) {
    ConvGemm p;
    memset(&p, 0, sizeof p);
    p.N = N, p.H = H, p.W = W, p.C_in = C_in, p.C_out = C_out, p.stride = stride;
    p.Ho = conv_out_size(H, 3, stride), p.Wo = conv_out_size(W, 3, stride);
    p.div_out_pixels = conv_divisor(p.Ho * p.Wo), p.div_Wo = conv_divisor(p.Wo);
    p.div_in_pixels = conv_divisor(H * W), p.div_W = conv_divisor(W);
    p.div_C_in = conv_divisor(C_in), p.div_C_out = conv_divisor(C_out);
    int out_pixels = N * p.Ho * p.Wo;
    if (op == CONV_FORWARD) p.M = out_pixels, p.Ng = C_out, p.K = 9 * C_in;
    else if (op == CONV_INPUT_GRAD) p.M = N * H * W, p.Ng = C_in, p.K = 9 * C_out;
    else p.M = C_out, p.Ng = 9 * C_in, p.K = out_pixels;
    p.k_per_slice = (p.K + CONV_SLICE_STEP - 1) / CONV_SLICE_STEP * CONV_SLICE_STEP;
    return p;
}

template <int OP, int BM, int BN, int BK, int WARPS_M, int WARPS_N, bool VEC_A, bool VEC_B>
static void conv_launch_tile(const ConvGemm &p, int slices) {
    static bool configured = false;
    conv_launch_grid(conv3x3_igemm_kernel<OP, BM, BN, BK, WARPS_M, WARPS_N, VEC_A, VEC_B>, &configured,
                     ConvTile<OP, BM, BN, BK, WARPS_M, WARPS_N, VEC_A, VEC_B>::SMEM, p, BM, BN, slices);
}

// The kernel for the operands' alignment: 16-byte loads where both allow them.
template <int OP, int BM, int BN, int BK, int WARPS_M, int WARPS_N>
static void conv_launch(const ConvGemm &p, bool vec_a, bool vec_b, int slices) {
    if (vec_a && vec_b) conv_launch_tile<OP, BM, BN, BK, WARPS_M, WARPS_N, true, true>(p, slices);
    else if (vec_a) conv_launch_tile<OP, BM, BN, BK, WARPS_M, WARPS_N, true, false>(p, slices);
    else if (vec_b) conv_launch_tile<OP, BM, BN, BK, WARPS_M, WARPS_N, false, true>(p, slices);
    else conv_launch_tile<OP, BM, BN, BK, WARPS_M, WARPS_N, false, false>(p, slices);
}

// ---- 3x3 convolution: running a plan ----

// Runs a plan (conv_plan): the family's launcher with the plan's tile and slices; vec_a, vec_b say
// which mma.sync kernel loads in 16-byte chunks. Returns the slots of the channel sums gathered (0:
// none). A forced family that does not take the product (CONV_NONE) runs nothing.
template <int OP>
static int conv_run(const ConvPlan *plan, const ConvGemm &p, bool vec_a, bool vec_b, float *split) {
    const int BM = plan->BM, BN = plan->BN;
    switch (plan->family) {
    case CONV_NONE:
        return 0;
    case CONV_IMAGE:
        if constexpr (OP == CONV_FORWARD) return conv_launch_image(p);
        break;
    case CONV_NARROW:
        if constexpr (OP == CONV_FORWARD) return conv_launch_narrow(p), 0;
        if constexpr (OP == CONV_INPUT_GRAD) return conv_launch_narrow_input_grad(p), 0;
        if constexpr (OP == CONV_WEIGHT_GRAD) return conv_launch_narrow_weight_grad(p, plan->slices), 0;
        break;
    case CONV_HALO:
        if constexpr (OP == CONV_FORWARD)
            if (BN == 192) return conv_launch_halo<OP, 4, 192>(p);
        if constexpr (OP != CONV_WEIGHT_GRAD) return BN == 128 ? conv_launch_halo<OP, 4, 128>(p) : conv_launch_halo<OP, 8, 64>(p);
        break;
    case CONV_SPLIT:
        if constexpr (OP != CONV_WEIGHT_GRAD) return conv_launch_split<OP>(p, plan, split), 0;
        break;
    case CONV_WGMMA:
        if constexpr (OP == CONV_WEIGHT_GRAD) {
            if (plan->tma && BM == 128) conv_launch_tma<OP, 128, 256>(p, plan->slices);
            else if (plan->tma) conv_launch_tma<OP, 64, 128>(p, plan->slices);
            else if (BM == 128) conv_launch_wgmma<OP, 128, 128>(p, plan->slices);
            else conv_launch_wgmma<OP, 64, 128>(p, plan->slices);
            return 0;
        } else {
            if (BN == 64) return conv_launch_wgmma_tiles<OP, 64>(p, plan->tma);
            if (BN == 256) return conv_launch_wgmma_tiles<OP, 256>(p, plan->tma);
            if constexpr (OP == CONV_FORWARD)
                if (BN == 192) return conv_launch_wgmma_tiles<OP, 192>(p, plan->tma);
            return conv_launch_wgmma_tiles<OP, 128>(p, plan->tma);
        }
    case CONV_MMA:
        if constexpr (OP == CONV_WEIGHT_GRAD) {
            if (BM == 32) conv_launch<OP, 32, 128, 32, 1, 8>(p, vec_a, vec_b, plan->slices);
            else if (BN == 32) conv_launch<OP, 128, 32, 32, 4, 2>(p, vec_a, vec_b, plan->slices);
            else if (BM == 128) conv_launch<OP, 128, 128, 64, 2, 4>(p, vec_a, vec_b, plan->slices);
            else conv_launch<OP, 64, 256, 32, 2, 4>(p, vec_a, vec_b, plan->slices);
        } else {
            if (BN == 32) conv_launch<OP, 128, 32, 32, 4, 2>(p, vec_a, vec_b, 1);
            else if (BN == 128) conv_launch<OP, 128, 128, 64, 2, 4>(p, vec_a, vec_b, 1);
            else conv_launch<OP, 256, 64, 32, 4, 2>(p, vec_a, vec_b, 1);
        }
        return 0;
    }
    static const char *const op_names[3] = {"forward", "input gradient", "weight gradient"};
    fatal("internal error: the %s kernel has no %s launch", conv_family_names[plan->family], op_names[OP]);
    return 0;
}

// The GPU's TMA, for the plans: only asked where the sm_90a kernels run.
static bool conv_tma_here(void) { return gpu.sm90a && conv_tma_available(); }

static int conv3x3_forward(floatX *y, int ldy, const floatX *x, int ldx, const floatX *w, const floatX *bias,
                           const floatX *residual, int ldr, int N, int H, int W, int C_in, int C_out, int stride, float *split,
                           int64_t split_floats, double *sums, int64_t sums_numel) {
    ConvGemm p = conv_gemm(CONV_FORWARD, N, H, W, C_in, C_out, stride);
    p.x = x, p.ldx = ldx, p.w = w, p.bias = bias, p.residual = residual, p.ldr = ldr, p.out = y, p.ldo = ldy;
    p.pair_store = ldy % 2 == 0 && ((uintptr_t)y & 3) == 0 && (!residual || (ldr % 2 == 0 && ((uintptr_t)residual & 3) == 0));
    p.vec_store = p.pair_store && ldy % 8 == 0 && conv_aligned16(y) && conv_aligned16(bias) &&
                  (!residual || (ldr % 8 == 0 && conv_aligned16(residual)));
    p.sums = sums, p.sums_numel = sums_numel;
    bool vec = C_in % 8 == 0 && ldx % 8 == 0 && conv_aligned16(x) && conv_aligned16(w);
    ConvProblem q = {CONV_FORWARD, N, H, W, C_in, C_out, stride, vec, vec, p.pair_store != 0, p.vec_store != 0,
                     ldy % 8 == 0 && conv_aligned16(y), bias != NULL, ((uintptr_t)bias & 3) == 0, residual != NULL, split_floats};
    ConvPlan plan = conv_choose(&q, conv_tma_here());
    return conv_run<CONV_FORWARD>(&plan, p, vec, vec, split);
}

// The stride-2 input gradient's rows numbered by parity class (ConvGemm.class_start), for the wgmma
// kernel: a block's rows then share their taps (1, 2 or 4 of the 9), and it runs only those.
static void conv_parity_order(ConvGemm *p) {
    p->parity_rows = 1, p->class_start[0] = 0;
    for (int c = 0; c < 4; c++) {
        int Hc = (p->H - (c >> 1) + 1) / 2, Wc = (p->W - (c & 1) + 1) / 2;
        p->class_start[c + 1] = p->class_start[c] + p->N * Hc * Wc;
    }
}

static void conv3x3_backward_input(floatX *dx, int lddx, GradMode mode, const floatX *dy, int lddy, const floatX *w, int N,
                                   int H, int W, int C_in, int C_out, int stride, float *split, int64_t split_floats) {
    ConvGemm p = conv_gemm(CONV_INPUT_GRAD, N, H, W, C_in, C_out, stride);
    if (stride == 2) conv_parity_order(&p);  // read by the wgmma kernel only
    p.dy = dy, p.lddy = lddy, p.w = w, p.out = dx, p.ldo = lddx, p.add_out = mode == GRAD_ADD;
    p.pair_store = lddx % 2 == 0 && ((uintptr_t)dx & 3) == 0;
    p.vec_store = lddx % 8 == 0 && conv_aligned16(dx);
    bool vec_a = C_out % 8 == 0 && lddy % 8 == 0 && conv_aligned16(dy), vec_b = C_in % 8 == 0 && conv_aligned16(w);
    ConvProblem q = {CONV_INPUT_GRAD, N, H, W, C_in, C_out, stride, vec_a, vec_b, p.pair_store != 0, p.vec_store != 0,
                     p.vec_store != 0, false, false, false, split_floats};
    ConvPlan plan = conv_choose(&q, conv_tma_here());
    conv_run<CONV_INPUT_GRAD>(&plan, p, vec_a, vec_b, split);
}

static void conv3x3_backward_weight(float *dw, float *scratch, const floatX *dy, int lddy, const floatX *x, int ldx, int N,
                                    int H, int W, int C_in, int C_out, int stride) {
    ConvGemm p = conv_gemm(CONV_WEIGHT_GRAD, N, H, W, C_in, C_out, stride);
    bool vec_a = C_out % 8 == 0 && lddy % 8 == 0 && conv_aligned16(dy);
    bool vec_b = C_in % 8 == 0 && ldx % 8 == 0 && conv_aligned16(x);
    ConvProblem q = {CONV_WEIGHT_GRAD, N, H, W, C_in, C_out, stride, vec_a, vec_b, false, false, false, false, false, false, 0};
    ConvPlan plan = conv_choose(&q, conv_tma_here());
    p.k_per_slice = plan.k_per_slice;
    p.dy = dy, p.lddy = lddy, p.x = x, p.ldx = ldx, p.out_f = plan.slices > 1 ? scratch : dw;
    p.pair_store = p.Ng % 2 == 0 && ((uintptr_t)p.out_f & 7) == 0;
    conv_run<CONV_WEIGHT_GRAD>(&plan, p, vec_a, vec_b, NULL);
    if (plan.slices > 1) sum_slices(dw, scratch, plan.slices, (int64_t)C_out * 9 * C_in);
}
#endif

// y = conv(x) + b (+ residual, a tensor shaped like y, when given; it may be y itself). sums (not
// NULL): also gather y's channel sums there (sums_numel doubles at most) for the GroupNorm that reads
// y (group_norm_forward's GatheredSums); returns their slots a sample, or 0 where the kernel that ran
// gathers none (1x1 products, and the 3x3 kernels the convolution section's top names).
static int conv_forward_gathering(const Conv *cv, floatX *y, const floatX *x, int N, int H, int W, const floatX *residual,
                                  double *sums, int64_t sums_numel) {
    if (cv->k == 3)
        return conv3x3_forward(y, cv->out, x, cv->in, cv->w, cv->b, residual, cv->out, N, H, W, cv->in, cv->out, cv->stride,
                               cv->scratch->conv_split, cv->scratch->conv_split_numel, sums, sums_numel);
    matmul({.M = N * H * W, .N = cv->out, .K = cv->in, .a = x, .lda = cv->in, .b = cv->w, .ldb = cv->in, .trans_b = 1,
            .d = y, .ldd = cv->out, .c = residual, .ldc = cv->out, .beta = 1.0f, .bias = cv->b});
    return 0;
}

static void conv_forward(const Conv *cv, floatX *y, const floatX *x, int N, int H, int W, const floatX *residual) {
    conv_forward_gathering(cv, y, x, N, H, W, residual, NULL, 0);
}

// The 3x3 weight gradient and the bias gradient (d_bias_per_sample: also per sample), begun on the
// side stream; the next side_join() waits for them. Nothing without parameter gradients (no dw).
// dy_sums (not NULL): dy's partial channel sums, left by the kernel that wrote dy: no pass over dy.
static void conv_backward_params_side(const Conv *cv, const floatX *dy, const floatX *x, int N, int H, int W,
                                      float *d_bias_per_sample, int per_sample_ld, const ChannelSumsGiven *dy_sums) {
    if (!cv->dw) return;
    int Ho = conv_out_size(H, cv->k, cv->stride), Wo = conv_out_size(W, cv->k, cv->stride);
    side_begin();
    if (cv->k == 3)
        conv3x3_backward_weight(cv->dw, cv->scratch->weight_grad, dy, cv->out, x, cv->in, N, H, W, cv->in, cv->out, cv->stride);
    if (dy_sums) channel_sums_total(d_bias_per_sample, per_sample_ld, cv->db, *dy_sums, N, cv->out);
    else channel_sums(cv->scratch, d_bias_per_sample, per_sample_ld, cv->db, dy, N, Ho * Wo, cv->out);
    side_end();
}

// dx (+)= the input gradient (the mode says which), on the main stream.
static void conv_backward_input(const Conv *cv, floatX *dx, GradMode mode, const floatX *dy, int N, int H, int W) {
    if (cv->k == 3)
        conv3x3_backward_input(dx, cv->in, mode, dy, cv->out, cv->w, N, H, W, cv->in, cv->out, cv->stride,
                               cv->scratch->conv_split, cv->scratch->conv_split_numel);
    else
        matmul({.M = N * H * W, .N = cv->in, .K = cv->out, .a = dy, .lda = cv->out, .b = cv->w, .ldb = cv->in, .d = dx,
                .ldd = cv->in, .c = mode == GRAD_ADD ? dx : NULL, .ldc = cv->in, .beta = 1.0f});
}

// dW, db and dx (+)= (when dx is given; the mode says which) from dy. d_bias_per_sample (nullable,
// [N][ld]) receives the per-sample sums of dy too: the gradient of a per-sample channel offset added to y.
// The bias gradient and a 3x3 convolution's weight gradient run on the side stream, beside the input
// gradient (a 1x1 convolution's weight gradient is cuBLAS's: on the main stream). dy_sums (not NULL):
// dy's partial channel sums, left by the kernel that wrote dy.
static void conv_backward(const Conv *cv, floatX *dx, GradMode mode, const floatX *dy, const floatX *x, int N, int H, int W,
                          float *d_bias_per_sample, int per_sample_ld, const ChannelSumsGiven *dy_sums) {
    conv_backward_params_side(cv, dy, x, N, H, W, d_bias_per_sample, per_sample_ld, dy_sums);
    if (cv->k == 1) weight_gradient(cv->scratch, cv->dw, cv->in, dy, x, N * H * W, cv->out, cv->in);  // cuBLAS: the main stream
    if (dx) conv_backward_input(cv, dx, mode, dy, N, H, W);
    side_join();
}

// ----------------------------------------------------------------------------------------------
// Linear layers (the timestep MLP): y[N][out] = x W^T + b, W [out][in]; as a 1x1 convolution on
// N pixels, so it shares the convolution's code.

// ----------------------------------------------------------------------------------------------
// GroupNorm with 32 groups, fused with what follows it in the model:
//   x' = x + add[n][c]                          (optional: the timestep embedding without scale-shift)
//   z  = (x' - mean_g) * rstd_g * gamma[c] + beta[c]   mean, variance over the group's H*W*C/32 values,
//                                                       rstd = 1/sqrt(var + 1e-5), statistics in fp32/fp64
//   u  = z * (1 + scale[n][c]) + shift[n][c]    (optional: scale-shift norm)
//   y  = silu(u) = u * sigmoid(u)               (optional)
//   y  = y * keep / (1 - p)                     (optional dropout; keep drawn from (seed, element))
// Backward, with du = dy * keep/(1-p) * silu'(u), dz = du * (1 + scale), g = dz * gamma:
//   d_shift = sum_hw du, d_scale = sum_hw du z, d_gamma = sum_{n,hw} dz xhat, d_beta = sum_{n,hw} dz
//   dx' = rstd * (g - mean_g(g) - xhat * mean_g(g xhat))
// Statistics are reduced in fixed-order passes: a partial sum per (sample, chunk of rows), then the
// total; so results are deterministic.

#define GN_GROUPS 32
#define GN_EPS 1e-5f
#define GN_THREADS 256

typedef struct {
    int channels;
    float *gamma, *beta;     // fp32 master parameters
    float *dgamma, *dbeta;
    const Scratch *scratch;
} Norm;

typedef struct {
    const float *add; int add_ld;                  // [N][add_ld], or NULL
    const float *scale_shift; int scale_shift_ld;  // [N][ld]: scale at [0, C), shift at [C, 2C), or NULL
    int silu;
    float dropout;                  // probability of zeroing an output (training only)
    const uint64_t *dropout_seed;   // on the GPU: the step's seed (a training step can be a replayed graph)
    uint64_t dropout_stream;        // the layer's own random stream
    int64_t dropout_first;          // dropout's number for element 0: the elements before it in the step's batch
                                    // on all GPUs (the draws of N GPUs at batch B are those of one at N B)
    // A decoder's skip concatenation read in place (x2 not NULL): the input's channels [0, C1) are x's
    // ([N][HW][C1]) and [C1, C) are x2's ([N][HW][C - C1]); backward delivers their gradients to dx
    // and dx2 likewise. C1 is a multiple of PACK, so a thread's channels lie in one of the two.
    const floatX *x2;
    floatX *dx2;
    int C1;
} NormOptions;

// sigmoid(x) = 1 / (1 + e^-x). The BF16 build takes the fast intrinsics: their relative error (about
// 1e-6) is far below bf16's rounding, and GroupNorm's kernels run 10-20% faster (dev/NOTES.md,
// b). The FP32 build keeps expf and IEEE division.
#if defined(PRECISION_FP32)
__device__ inline float sigmoidf_(float x) { return 1.0f / (1.0f + expf(-x)); }
#else
__device__ inline float sigmoidf_(float x) { return __fdividef(1.0f, 1.0f + __expf(-x)); }
#endif

// Dropout's multipliers for elements i and i + 1 (i even) of the stream with key `key` (random_key):
// 0 with probability p, else 1/(1 - p). One 64-bit draw serves the pair, draw i/2: its top 24 bits
// are element i's uniform, the next 24 element i + 1's (the splitmix rounds were most of GroupNorm's
// work with dropout).
__host__ __device__ inline void dropout_keep_pair(uint64_t key, int64_t i, float p, float keep[2]) {
    uint64_t draw = random_draw(key, (uint64_t)i >> 1);
    float u0 = (float)(draw >> 40) * (1.0f / 16777216.0f), u1 = (float)((draw >> 16) & 0xffffff) * (1.0f / 16777216.0f);
    keep[0] = u0 >= p ? 1.0f / (1.0f - p) : 0.0f;
    keep[1] = u1 >= p ? 1.0f / (1.0f - p) : 0.0f;
}

// Dropout's multiplier for element i alone (the CPU references').
__host__ __device__ inline float dropout_keep(uint64_t key, int64_t i, float p) {
    float keep[2];
    dropout_keep_pair(key, i & ~(int64_t)1, p, keep);
    return keep[i & 1];
}

// The rows [begin, end) of chunk `chunk` of a sample with `rows` rows.
__device__ inline void chunk_rows(int rows, int chunk, int chunks, int *begin, int *end) {
    *begin = (int)((int64_t)rows * chunk / chunks);
    *end = (int)((int64_t)rows * (chunk + 1) / chunks);
}

// The thread layout of the GroupNorm kernels: a block of GN_THREADS threads covers one chunk of one
// sample's rows; thread t owns the PACK channels from c0 = (t % packs) PACK in rows begin + t / packs,
// + rows_per_pass, ... (packs = C / PACK; the threads past packs * rows_per_pass idle). A thread's
// channels are fixed, so their constants are loaded once, before its rows.
typedef struct {
    int n, c0, first, rows_per_pass, end;  // rows first, first + rows_per_pass, ... < end of sample n
} GnThread;

__device__ inline GnThread gn_thread(int HW, int C) {
    GnThread t;
    int packs = C / PACK, begin;
    t.n = blockIdx.y, t.c0 = threadIdx.x % packs * PACK, t.rows_per_pass = GN_THREADS / packs;
    chunk_rows(HW, blockIdx.x, gridDim.x, &begin, &t.end);
    t.first = (int)threadIdx.x / packs < t.rows_per_pass ? begin + threadIdx.x / packs : t.end;
    return t;
}

// A thread's rows come through a ring of GN_AHEAD shared-memory slots of its own, copied there by
// cp.async GN_AHEAD passes ahead of use: that many loads in flight per thread without registers held
// for them (one row ahead in registers reached ~2 TB/s on the large layers; four rows in registers
// cost blocks a multiprocessor and spilled). Pass i uses slot i % GN_AHEAD; each pass commits one
// cp.async group per kernel (its streams' copies together), so that waiting for all but the newest
// GN_AHEAD - 1 groups means pass i's row has arrived. The first passes' copies are started before the
// kernel gathers its constants. Only this thread reads its slots, so no barrier is needed. The
// backward passes keep a ring for each tensor they read (x, dy, and dx where the input gradient is
// added to: read through the ring, not waited for at each row, 1.3% off seed:128's step on an H200;
// eight slots deep instead of four were no faster, dev/NOTES.md w).
#define GN_AHEAD 4
typedef Pack GnRing[GN_AHEAD][GN_THREADS];

// Starts copying row r of a thread's column (its PACK channels of one sample) into pass i's slot;
// nothing past the thread's rows.
__device__ inline void gn_fetch(GnRing &ring, int i, const floatX *column, int r, int end, int ld) {
    if (r < end) conv_cp_async16(&ring[i % GN_AHEAD][threadIdx.x], column + (int64_t)r * ld, true);
}

// Pass i's row, once its copy has arrived (the groups of passes after it may still be in flight).
__device__ inline Pack gn_arrived(const GnRing &ring, int i) {
    conv_cp_async_wait<GN_AHEAD - 1>();
    return ring[i % GN_AHEAD][threadIdx.x];
}

// Where a thread's column of the input x (or of its gradient) starts in sample n, and its row
// stride: C, or the width of the concatenation's part that holds channel c0 (NormOptions.x2).
template <typename T>
__device__ inline T *gn_column(T *x, T *x2, int C1, int n, int HW, int C, int c0, int *ld) {
    if (x2 && c0 >= C1) {
        *ld = C - C1;
        return x2 + (int64_t)n * HW * (C - C1) + (c0 - C1);
    }
    *ld = x2 ? C1 : C;
    return x + (int64_t)n * HW * *ld + c0;
}

// Block reductions in a fixed order (so that results are the same on every run): the threads' values
// go to shared memory as sh[q][row C + c] (row = t / packs); thread c, c + GN_THREADS, ... then adds
// channel c's values in row order.
__host__ __device__ inline int gn_rows(int C) { return GN_THREADS / (C / PACK); }

// GroupNorm's statistics come from channel sums per slot of a sample's pixels, in double:
//   sums[((n slots + s) C + c) 2 + 0, 1] = (sum x, sum x^2) over slot s's pixels of sample n, channel c
// Their slots are group_norm_sums_kernel's chunks of rows, or the tiles of the convolution that wrote
// x and gathered them as it stored x (conv3x3_forward's sums); group_norm_apply_kernel turns them into
// each group's mean and rstd (group_norm_statistics) before it normalises.

// The channel sums of one chunk (a slot of the layout above). A thread sums its rows in fp32 about a
// shift, its first row's x (the sums of x - shift stay near the spread of x, so a large mean costs
// no precision), and the block adds the threads' sums in double:
//   sum x = s + rows shift,  sum x^2 = ss + 2 shift s + rows shift^2   (s, ss: sums of d = x - shift)
__global__ void group_norm_sums_kernel(double *__restrict__ sums, const floatX *__restrict__ x, NormOptions o, int HW, int C) {
    __shared__ union {
        GnRing ring;                      // the rows, then (after a barrier)
        double sh[2][GN_THREADS * PACK];  // the threads' sums
    } shared;
    double(*sh)[GN_THREADS * PACK] = shared.sh;
    GnThread t = gn_thread(HW, C);
    int ld;
    const floatX *column = gn_column(x, o.x2, o.C1, t.n, HW, C, t.c0, &ld);
    for (int i = 0; i < GN_AHEAD; i++) gn_fetch(shared.ring, i, column, t.first + i * t.rows_per_pass, t.end, ld), conv_cp_async_commit();
    float shift[PACK], s[PACK] = {}, ss[PACK] = {};
    int rows = 0;
    for (int r = t.first; r < t.end; r += t.rows_per_pass, rows++) {
        Pack p = gn_arrived(shared.ring, rows);
        if (rows == 0)
            for (int j = 0; j < PACK; j++) shift[j] = (float)p.v[j];
        for (int j = 0; j < PACK; j++) {
            float d = (float)p.v[j] - shift[j];
            s[j] += d, ss[j] = fmaf(d, d, ss[j]);
        }
        gn_fetch(shared.ring, rows, column, r + GN_AHEAD * t.rows_per_pass, t.end, ld), conv_cp_async_commit();
    }
    if (rows == 0)
        for (int j = 0; j < PACK; j++) shift[j] = 0.0f;
    __syncthreads();  // every thread's ring read: sh may overwrite it
    for (int j = 0; j < PACK; j++) {
        double c = shift[j];
        sh[0][threadIdx.x * PACK + j] = s[j] + rows * c;
        sh[1][threadIdx.x * PACK + j] = ss[j] + 2.0 * c * s[j] + rows * c * c;
    }
    __syncthreads();
    double *out = sums + ((int64_t)t.n * gridDim.x + blockIdx.x) * C * 2;
    for (int c = threadIdx.x; c < C; c += GN_THREADS) {
        double a = 0.0, b = 0.0;
        for (int r = 0; r < gn_rows(C); r++) a += sh[0][r * C + c], b += sh[1][r * C + c];
        out[2 * c] = a, out[2 * c + 1] = b;
    }
}

// Where the apply kernel's statistics come from: channel sums (the layout above) of the input's
// channels in two parts, [0, C1) and [C1, C) (a concatenation's, NormOptions.x2; else one part of all
// C channels, C1 = C). Part p's sums[p] hold slots[p] slots of its own channels only, each summed
// pixel standing for repeat[p] pixels of the input (4 where the part is a nearest 2x upsampling and
// the sums are its source's: each source pixel appears 4 times in it).
typedef struct {
    const double *sums[2];
    int slots[2], repeat[2], C1;
} GnSums;

// Each group's mean and rstd of sample n from its channel sums, with the add option applied:
// x' = x + add[n][c], so per channel
//   sum x' = sum x + HW add,  sum x'^2 = sum x^2 + 2 add sum x + HW add^2
// and then mean = sum x' / count, var = sum x'^2 / count - mean^2 over the group's count = HW C / 32
// values, rstd = 1 / sqrt(var + eps). A group may take channels from both parts.

// Group g's (slot, channel) terms i = first, first + stride, ... of each part in turn, added to a
// (sum x') and b (sum x'^2).
__device__ inline void gn_group_terms(double &a, double &b, const GnSums &s, const NormOptions &o, int n, int HW, int C, int g,
                                      int first, int stride) {
    const int per_group = C / GN_GROUPS;
    for (int p = 0; p < 2; p++) {
        int from = p ? s.C1 : 0, width = p ? C - s.C1 : s.C1;
        int lo = max(g * per_group, from), hi = min((g + 1) * per_group, from + width);
        if (lo >= hi) continue;
        for (int i = first; i < s.slots[p] * (hi - lo); i += stride) {
            int slot = i / (hi - lo), c = lo + i % (hi - lo);
            const double *at = s.sums[p] + (((int64_t)n * s.slots[p] + slot) * width + c - from) * 2;
            double add = o.add ? o.add[(int64_t)n * o.add_ld + c] : 0.0, repeat = s.repeat[p];
            a += repeat * at[0], b += repeat * (at[1] + 2.0 * add * at[0]);
            if (slot == 0) a += HW * add, b += HW * add * add;
        }
    }
}

__device__ inline void gn_mean_rstd(float *mean, float *rstd, double a, double b, double count) {
    double m = a / count, var = fmax(b / count - m * m, 0.0);
    *mean = (float)m, *rstd = (float)(1.0 / sqrt(var + GN_EPS));
}

// In the apply kernel: eight threads take a group's terms in turn and a shuffle tree adds theirs (a
// fixed order). Every thread calls it.
__device__ inline void group_norm_statistics(float *mean, float *rstd, const GnSums &s, const NormOptions &o, int n, int HW,
                                             int C) {
    static_assert(GN_THREADS == 8 * GN_GROUPS, "eight threads a group");
    const int g = threadIdx.x / 8, part = threadIdx.x % 8;
    double a = 0.0, b = 0.0;
    gn_group_terms(a, b, s, o, n, HW, C, g, part, 8);
    for (int offset = 4; offset > 0; offset /= 2) a += __shfl_xor_sync(0xffffffffu, a, offset), b += __shfl_xor_sync(0xffffffffu, b, offset);
    if (part == 0) gn_mean_rstd(&mean[g], &rstd[g], a, b, (double)HW * (C / GN_GROUPS));
}

// The statistics in a kernel of their own, for sums in many slots (GN_STATS_TERMS terms a group or
// more: a 128x128 halo forward leaves 64 slots a sample), where each of the apply kernel's eight
// threads a group would wait for one load after another before any block normalises: a block of
// GN_STATS_THREADS per (group, sample) takes a few terms a thread, then a fixed-order tree, into
// sample_mean, sample_rstd ([N][32]), which the apply kernel then reads.
#define GN_STATS_THREADS 128
#define GN_STATS_TERMS 128
__global__ void __launch_bounds__(GN_STATS_THREADS)
    group_norm_statistics_kernel(float *sample_mean, float *sample_rstd, GnSums s, NormOptions o, int HW, int C) {
    __shared__ double warp_sums[2][GN_STATS_THREADS / 32];
    const int g = blockIdx.x, n = blockIdx.y, lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    double a = 0.0, b = 0.0;
    gn_group_terms(a, b, s, o, n, HW, C, g, threadIdx.x, GN_STATS_THREADS);
    for (int offset = 16; offset > 0; offset /= 2)
        a += __shfl_xor_sync(0xffffffffu, a, offset), b += __shfl_xor_sync(0xffffffffu, b, offset);
    if (lane == 0) warp_sums[0][warp] = a, warp_sums[1][warp] = b;
    __syncthreads();
    if (threadIdx.x == 0) {
        a = b = 0.0;
        for (int w = 0; w < GN_STATS_THREADS / 32; w++) a += warp_sums[0][w], b += warp_sums[1][w];
        gn_mean_rstd(&sample_mean[n * GN_GROUPS + g], &sample_rstd[n * GN_GROUPS + g], a, b, (double)HW * (C / GN_GROUPS));
    }
}

// The element function of channels c0 .. c0+PACK-1 of sample n (group statistics sample_mean[g],
// sample_rstd[g]) as two affine maps of the input x, folded once per thread so that an element costs
// two fused multiply-adds and a thread keeps 4 PACK constants (as PyTorch's GroupNorm folds them):
//   xhat = x a + b,   a = rstd, b = (add - mean) rstd
//   u    = x s + t,   s = a gamma (1 + scale), t = (b gamma + beta)(1 + scale) + shift
// u is z = xhat gamma + beta after the scale-shift (scale = shift = 0 without it).
typedef struct {
    float a[PACK], b[PACK], s[PACK], t[PACK];
    uint64_t dropout_key;  // the layer's dropout stream under the step's seed (random_key), or 0
} GroupNormAffine;

__device__ inline GroupNormAffine group_norm_affine(const float *sample_mean, const float *sample_rstd, const float *gamma,
                                                    const float *beta, const NormOptions &o, int n, int c0, int C) {
    GroupNormAffine k;
    k.dropout_key = o.dropout > 0.0f ? random_key(*o.dropout_seed, o.dropout_stream) : 0;
    int per_group = C / GN_GROUPS;
    for (int j = 0; j < PACK; j++) {
        int c = c0 + j, g = c / per_group;
        float add = o.add ? o.add[(int64_t)n * o.add_ld + c] : 0.0f;
        float scale = o.scale_shift ? 1.0f + o.scale_shift[(int64_t)n * o.scale_shift_ld + c] : 1.0f;
        float shift = o.scale_shift ? o.scale_shift[(int64_t)n * o.scale_shift_ld + C + c] : 0.0f;
        k.a[j] = sample_rstd[g], k.b[j] = (add - sample_mean[g]) * sample_rstd[g];
        k.s[j] = k.a[j] * gamma[c] * scale, k.t[j] = (k.b[j] * gamma[c] + beta[c]) * scale + shift;
    }
    return k;
}

// The dropout multipliers of a thread's PACK elements from element `at` (even, as C and c0 are
// multiples of PACK) of the layer's output, from the thread's key (computed once: the stream's two
// splitmix rounds are the same for all its elements); 1 without dropout.
__device__ inline void group_norm_keep(float keep[PACK], const NormOptions &o, uint64_t dropout_key, int64_t at) {
    for (int j = 0; j < PACK; j += 2) {
        if (o.dropout > 0.0f) dropout_keep_pair(dropout_key, o.dropout_first + at + j, o.dropout, &keep[j]);
        else keep[j] = keep[j + 1] = 1.0f;
    }
}

// The element function after the affine map, y = dropout(SiLU(u)) (each as the options say; keep
// from group_norm_keep), and its slope dy/du = keep silu'(u), silu'(u) = s (1 + u (1 - s)),
// s = sigmoid(u): one sigmoid and one dropout multiplier for both. Forward, recompute and backward all take
// y from here, so a recomputed y has the forward's bits.
__device__ inline float group_norm_element(float u, const NormOptions &o, float keep, float *slope) {
    float y = u, d = 1.0f;
    if (o.silu) {
        float s = sigmoidf_(u);
        y = u * s, d = s * (1.0f + u * (1.0f - s));
    }
    if (o.dropout > 0.0f) y *= keep, d *= keep;
    *slope = d;
    return y;
}

// Normalises one chunk and applies the fused options. The statistics come from the channel sums
// (group_norm_statistics; block 0 of the sample writes them to sample_mean, sample_rstd), or, with
// no sums (s.sums[0] NULL: a backward recomputing y), from sample_mean, sample_rstd: y comes out the
// same bit for bit.
// Five blocks per multiprocessor (54 registers would allow four): 10-15% faster on the large shapes,
// measured (dev/NOTES.md b).
__global__ void __launch_bounds__(GN_THREADS, 5)
    group_norm_apply_kernel(floatX *__restrict__ y, float *sample_mean, float *sample_rstd, const floatX *__restrict__ x,
                            GnSums s, const float *gamma, const float *beta, NormOptions o, int HW, int C) {
    __shared__ float mean[GN_GROUPS], rstd[GN_GROUPS];
    __shared__ GnRing ring;
    int n = blockIdx.y;
    GnThread t = gn_thread(HW, C);
    int ld;
    const floatX *column = gn_column(x, o.x2, o.C1, n, HW, C, t.c0, &ld);
    for (int i = 0; i < GN_AHEAD; i++) gn_fetch(ring, i, column, t.first + i * t.rows_per_pass, t.end, ld), conv_cp_async_commit();
    if (s.sums[0]) group_norm_statistics(mean, rstd, s, o, n, HW, C);
    else if (threadIdx.x < GN_GROUPS)
        mean[threadIdx.x] = sample_mean[n * GN_GROUPS + threadIdx.x], rstd[threadIdx.x] = sample_rstd[n * GN_GROUPS + threadIdx.x];
    __syncthreads();
    if (s.sums[0] && blockIdx.x == 0 && threadIdx.x < GN_GROUPS)
        sample_mean[n * GN_GROUPS + threadIdx.x] = mean[threadIdx.x], sample_rstd[n * GN_GROUPS + threadIdx.x] = rstd[threadIdx.x];
    GroupNormAffine k = group_norm_affine(mean, rstd, gamma, beta, o, n, t.c0, C);
    for (int r = t.first, i = 0; r < t.end; r += t.rows_per_pass, i++) {
        Pack p = gn_arrived(ring, i), q;
        int64_t at = ((int64_t)n * HW + r) * C + t.c0;
        float slope, keep[PACK];
        group_norm_keep(keep, o, k.dropout_key, at);
        for (int j = 0; j < PACK; j++) q.v[j] = (floatX)group_norm_element((float)p.v[j] * k.s[j] + k.t[j], o, keep[j], &slope);
        *(Pack *)&y[at] = q;
        gn_fetch(ring, i, column, r + GN_AHEAD * t.rows_per_pass, t.end, ld), conv_cp_async_commit();
    }
}

// A sample's rows come in chunks of at least 8 row passes of a block, at most CHUNKS_LEAST of them,
// or with fewer than 16 samples up to GN_BLOCKS / N (chunks_for_batch): about GN_BLOCKS blocks over
// the batch, two on each multiprocessor (the backward kernels' registers allow two). Few partial
// sums, and on small images few blocks: more chunks for small images (filling the GPU with blocks
// of one or two row passes) measured slower, the partial sums' reductions growing with them, and so
// did 512 blocks at batch 16 and 32; at batch 8, 256 blocks instead of 128 took about 3.5% off
// adm256:8's step (H200, dev/NOTES.md v).
// The forward's chunks (statistics and normalise) are never more than GN_BLOCKS blocks over the
// batch. Once the GPU has a few blocks a multiprocessor, long chunks cost less than many short ones:
// each block fills its ring and adds up its sums once (sampling at batch 256, against no limit: 306.0
// -> 320.1 images/s with 512 blocks, 321.8 with 256; seed:128 26.674 -> 26.260 ms with 512;
// dev/NOTES.md h and i). With many samples the statistics' partial sums are then grouped
// by the batch size: they round a little differently.
#define GN_BLOCKS 256
static int64_t gn_slots(int N) { return chunk_slots(N, GN_BLOCKS); }

static int gn_chunks(int HW, int C, int N) {
    int chunks = HW / (gn_rows(C) * 8), most = chunks_for_batch(N, GN_BLOCKS);
    return chunks < 1 ? 1 : chunks > most ? most : chunks;
}

static int gn_forward_chunks(int HW, int C, int N) {
    int chunks = gn_chunks(HW, C, N);
    return N * chunks > GN_BLOCKS ? (GN_BLOCKS + N - 1) / N : chunks;
}

// Channel sums a producer gathered for GroupNorm's input, or a part of it: [N][slots][channels][2]
// (the layout above; slots 0: none), each summed pixel standing for `repeat` pixels of the input.
typedef struct {
    const double *sums;
    int slots, repeat;
} GatheredSums;

// part_a: the sums gathered for x's channels [0, C1), or all C of them without o.x2; part_b: for x2's
// [C1, C). A part without them has them taken here, in a pass of group_norm_sums_kernel over it
// alone into the scratch (so a part's gathered sums must lie elsewhere when the other part has none);
// with none at all, in one pass over the whole input.
static void group_norm_forward(const Norm *norm, floatX *y, float *mean, float *rstd, const floatX *x, int N, int HW,
                               NormOptions o, GatheredSums part_a, GatheredSums part_b) {
    int C = norm->channels, C1 = o.x2 ? o.C1 : C, chunks = gn_forward_chunks(HW, C, N);
    double *scratch = norm->scratch->gn_partials;
    GnSums s = {{part_a.sums, part_b.sums}, {part_a.slots, part_b.slots}, {part_a.repeat, part_b.repeat}, C1};
    if (!part_a.slots && (!o.x2 || !part_b.slots)) {
        group_norm_sums_kernel<<<dim3(chunks, N), GN_THREADS, 0, gpu.stream>>>(scratch, x, o, HW, C);
        cuda_check_launch();
        s = {{scratch, NULL}, {chunks, 0}, {1, 1}, C};
    } else if (!part_a.slots || (o.x2 && !part_b.slots)) {
        int p = part_a.slots ? 1 : 0, width = p ? C - C1 : C1, part_chunks = gn_forward_chunks(HW, width, N);
        NormOptions whole = {};
        group_norm_sums_kernel<<<dim3(part_chunks, N), GN_THREADS, 0, gpu.stream>>>(scratch, p ? o.x2 : x, whole, HW, width);
        cuda_check_launch();
        s.sums[p] = scratch, s.slots[p] = part_chunks, s.repeat[p] = 1;
    }
    if ((int64_t)max(s.slots[0], s.slots[1]) * (C / GN_GROUPS) >= GN_STATS_TERMS) {  // many terms: a kernel of their own
        group_norm_statistics_kernel<<<dim3(GN_GROUPS, N), GN_STATS_THREADS, 0, gpu.stream>>>(mean, rstd, s, o, HW, C);
        cuda_check_launch();
        s = {};  // (none: the apply kernel reads them)
    }
    group_norm_apply_kernel<<<dim3(chunks, N), GN_THREADS, 0, gpu.stream>>>(y, mean, rstd, x, s, norm->gamma, norm->beta, o,
                                                                            HW, C);
    cuda_check_launch();
}

// y again, as group_norm_forward wrote it, from x and the statistics it kept: for a backward that
// did not keep y.
static void group_norm_recompute(const Norm *norm, floatX *y, float *mean, float *rstd, const floatX *x, int N, int HW,
                                 NormOptions o) {
    int C = norm->channels;
    GnSums kept = {};  // none: the statistics kept
    group_norm_apply_kernel<<<dim3(gn_chunks(HW, C, N), N), GN_THREADS, 0, gpu.stream>>>(y, mean, rstd, x, kept, norm->gamma,
                                                                                      norm->beta, o, HW, C);
    cuda_check_launch();
}

// The backward passes' dynamic shared memory: `rings` rings of rows (x, dy and, when the input
// gradient is added to, dx), at least the sums pass's block reduction (4 GN_THREADS PACK floats).
static size_t gn_backward_smem(int rings) {
    size_t ring_bytes = rings * sizeof(GnRing), sum_bytes = 4 * GN_THREADS * PACK * sizeof(float);
    return ring_bytes > sum_bytes ? ring_bytes : sum_bytes;
}

// Backward, pass 1: per (sample, chunk) the channel sums du, du z, dz, dz xhat and the group sums
// g, g xhat (g = dz gamma). Layout: channels [n][chunk][c][4], then groups after N*chunks*C*4. The
// elements add up two sums per channel, du and du xhat; the four follow from them, since
// dz = du (1 + scale) and z = xhat gamma + beta: sum du z = gamma sum du xhat + beta sum du.
// With y (not NULL) the pass also writes y as forward did, from the x it reads anyway.
// (Both backward passes run two blocks a multiprocessor: __launch_bounds__ lets them keep 128
// registers a thread; without it seed:128's step was 0.8% slower, H200, dev/NOTES.md v.)
__global__ void __launch_bounds__(GN_THREADS, 2)
    group_norm_backward_sums_kernel(double *partial, floatX *__restrict__ y, const floatX *__restrict__ dy, const floatX *__restrict__ x,
                                    const float *mean, const float *rstd, const float *gamma, const float *beta, NormOptions o, int HW,
                                    int C) {
    extern __shared__ __align__(16) unsigned char gn_smem[];  // gn_backward_smem(2) bytes:
    GnRing *ring = (GnRing *)gn_smem;  // the rows of x and dy, then (after a barrier) the sums:
    float *shared = (float *)gn_smem;  // [2][threads PACK] floats, then [2][C] doubles
    GnThread t = gn_thread(HW, C);
    int64_t sample = (int64_t)t.n * HW * C + t.c0;  // y and dy: [N][HW][C]
    int ld;
    const floatX *column = gn_column(x, o.x2, o.C1, t.n, HW, C, t.c0, &ld);
    for (int i = 0; i < GN_AHEAD; i++) {
        int r = t.first + i * t.rows_per_pass;
        gn_fetch(ring[0], i, column, r, t.end, ld), gn_fetch(ring[1], i, dy + sample, r, t.end, C), conv_cp_async_commit();
    }
    GroupNormAffine k = group_norm_affine(mean + t.n * GN_GROUPS, rstd + t.n * GN_GROUPS, gamma, beta, o, t.n, t.c0, C);
    float acc[2][PACK] = {};
    for (int r = t.first, i = 0; r < t.end; r += t.rows_per_pass, i++) {
        Pack xp = gn_arrived(ring[0], i), dp = ring[1][i % GN_AHEAD][threadIdx.x], yp;  // dy: in x's group
        int64_t at = sample + (int64_t)r * C;
        float keep[PACK];
        group_norm_keep(keep, o, k.dropout_key, at);
        for (int j = 0; j < PACK; j++) {
            float v = (float)xp.v[j], slope;
            yp.v[j] = (floatX)group_norm_element(v * k.s[j] + k.t[j], o, keep[j], &slope);
            float du = (float)dp.v[j] * slope;
            acc[0][j] += du, acc[1][j] += du * (v * k.a[j] + k.b[j]);
        }
        if (y) *(Pack *)&y[at] = yp;
        int next = r + GN_AHEAD * t.rows_per_pass;
        gn_fetch(ring[0], i, column, next, t.end, ld), gn_fetch(ring[1], i, dy + sample, next, t.end, C), conv_cp_async_commit();
    }
    __syncthreads();  // every thread's ring read: the sums may overwrite it
    float(*sh)[GN_THREADS * PACK] = (float(*)[GN_THREADS * PACK])shared;
    for (int q = 0; q < 2; q++)
        for (int j = 0; j < PACK; j++) sh[q][threadIdx.x * PACK + j] = acc[q][j];
    __syncthreads();
    int chunks = gridDim.x;
    double *channel_out = partial + ((int64_t)t.n * chunks + blockIdx.x) * C * 4;
    double weighted[2][PACK] = {};  // gamma_c sum dz, gamma_c sum dz xhat of channel threadIdx.x + k GN_THREADS
    for (int k = 0; k < PACK; k++) {
        int c = threadIdx.x + k * GN_THREADS;
        if (c >= C) break;
        double du = 0, du_xhat = 0, scale = o.scale_shift ? 1.0 + o.scale_shift[(int64_t)t.n * o.scale_shift_ld + c] : 1.0;
        for (int r = 0; r < gn_rows(C); r++) du += sh[0][r * C + c], du_xhat += sh[1][r * C + c];
        channel_out[c * 4 + 0] = du, channel_out[c * 4 + 1] = gamma[c] * du_xhat + beta[c] * du;
        channel_out[c * 4 + 2] = scale * du, channel_out[c * 4 + 3] = scale * du_xhat;
        weighted[0][k] = gamma[c] * scale * du, weighted[1][k] = gamma[c] * scale * du_xhat;
    }
    __syncthreads();
    // Group sums from the channel sums: sum g = sum_c gamma_c sum dz, likewise g xhat.
    double(*group_sh)[GN_THREADS * PACK] = (double(*)[GN_THREADS * PACK])shared;  // [2][C], in the same memory
    for (int k = 0; k < PACK; k++)
        if (threadIdx.x + k * GN_THREADS < C)
            group_sh[0][threadIdx.x + k * GN_THREADS] = weighted[0][k], group_sh[1][threadIdx.x + k * GN_THREADS] = weighted[1][k];
    __syncthreads();
    if (threadIdx.x < GN_GROUPS) {
        int per_group = C / GN_GROUPS;
        double a = 0.0, b = 0.0;
        for (int c = threadIdx.x * per_group; c < (threadIdx.x + 1) * per_group; c++) a += group_sh[0][c], b += group_sh[1][c];
        double *group_out = partial + (int64_t)gridDim.y * chunks * C * 4 + (((int64_t)t.n * chunks + blockIdx.x) * GN_GROUPS + threadIdx.x) * 2;
        group_out[0] = a, group_out[1] = b;
    }
}

// Backward, pass 2: dx' (+)= rstd (g - mean_g(g) - xhat mean_g(g xhat)) for one chunk. With g = dz gamma
// = du (1 + scale) gamma and xhat = x a + b this is  dx' (+)= du s + x e + f,  e = -rstd a mean_g(g xhat),
// f = -rstd (mean_g(g) + b mean_g(g xhat)). Its grid is the sums' one. skip (not NULL, [N][HW][C] like
// dy): a gradient that reached the input around the layer (a residual's), added too: dx = skip + dx',
// or with GRAD_ADD dx = round(dx + skip) + dx' (the two additions' roundings as separate passes made them).
// dx_sums (not NULL): the chunk's channel sums of dx as written, [N][chunks][C] (the bias gradient of the
// layer that produced x, whose output gradient dx is), added up as channel_sums_partial_kernel adds.
__global__ void __launch_bounds__(GN_THREADS, 2)
    group_norm_backward_input_kernel(floatX *__restrict__ dx, GradMode mode, const floatX *__restrict__ skip, float *dx_sums,
                                     const floatX *__restrict__ dy, const floatX *__restrict__ x, const double *partial, const float *mean,
                                     const float *rstd, const float *gamma, const float *beta, NormOptions o, int HW, int C) {
    __shared__ float mean_g[GN_GROUPS], mean_gx[GN_GROUPS];
    extern __shared__ __align__(16) unsigned char gn_smem[];  // gn_backward_smem(2 + (mode == GRAD_ADD) + (skip != NULL)) bytes:
    GnRing *ring = (GnRing *)gn_smem;                          // the rows of x, dy, dx (when added to) and skip
    int n = blockIdx.y, chunks = gridDim.x, per_group = C / GN_GROUPS;
    GnThread t = gn_thread(HW, C);
    int64_t sample = (int64_t)n * HW * C + t.c0;  // dy: [N][HW][C]
    int ld, dx_ld;
    const floatX *column = gn_column(x, o.x2, o.C1, n, HW, C, t.c0, &ld);
    floatX *dx_column = gn_column(dx, o.dx2, o.C1, n, HW, C, t.c0, &dx_ld);
    const bool add = mode == GRAD_ADD;
    const int skip_ring = add ? 3 : 2;
    for (int i = 0; i < GN_AHEAD; i++) {
        int r = t.first + i * t.rows_per_pass;
        gn_fetch(ring[0], i, column, r, t.end, ld), gn_fetch(ring[1], i, dy + sample, r, t.end, C);
        if (add) gn_fetch(ring[2], i, dx_column, r, t.end, dx_ld);
        if (skip) gn_fetch(ring[skip_ring], i, skip + sample, r, t.end, C);
        conv_cp_async_commit();
    }
    if (threadIdx.x < GN_GROUPS) {
        const double *groups = partial + (int64_t)gridDim.y * chunks * C * 4;
        double a = 0, b = 0, count = (double)HW * per_group;
        for (int k0 = 0; k0 < chunks; k0 += CHUNKS_LEAST)
#pragma unroll
            for (int k = k0; k < k0 + CHUNKS_LEAST; k++)  // (unrolled over all CHUNKS_MOST, these loops
                if (k < chunks) {                      // made seed:128's step 6% slower)
                    a += groups[(((int64_t)n * chunks + k) * GN_GROUPS + threadIdx.x) * 2 + 0];
                    b += groups[(((int64_t)n * chunks + k) * GN_GROUPS + threadIdx.x) * 2 + 1];
                }
        mean_g[threadIdx.x] = (float)(a / count), mean_gx[threadIdx.x] = (float)(b / count);
    }
    __syncthreads();
    GroupNormAffine k = group_norm_affine(mean + n * GN_GROUPS, rstd + n * GN_GROUPS, gamma, beta, o, n, t.c0, C);
    float e[PACK], f[PACK];
    for (int j = 0; j < PACK; j++) {
        int g = (t.c0 + j) / per_group;
        e[j] = -k.a[j] * k.a[j] * mean_gx[g], f[j] = -k.a[j] * (mean_g[g] + k.b[j] * mean_gx[g]);
    }
    float written[PACK] = {};  // the sums of dx as written (dx_sums)
    for (int r = t.first, i = 0; r < t.end; r += t.rows_per_pass, i++) {
        Pack xp = gn_arrived(ring[0], i), dp = ring[1][i % GN_AHEAD][threadIdx.x], out, sp;  // the others: in x's group
        if (add) out = ring[2][i % GN_AHEAD][threadIdx.x];
        if (skip) sp = ring[skip_ring][i % GN_AHEAD][threadIdx.x];
        int64_t at = sample + (int64_t)r * C;
        float keep[PACK];
        group_norm_keep(keep, o, k.dropout_key, at);
        for (int j = 0; j < PACK; j++) {
            float v = (float)xp.v[j], slope;
            group_norm_element(v * k.s[j] + k.t[j], o, keep[j], &slope);
            float d = (float)dp.v[j] * slope * k.s[j] + v * e[j] + f[j];
            if (skip) out.v[j] = add ? (floatX)((float)out.v[j] + (float)sp.v[j]) : sp.v[j];
            out.v[j] = (floatX)(add || skip ? (float)out.v[j] + d : d);
            if (dx_sums) written[j] += (float)out.v[j];
        }
        *(Pack *)&dx_column[(int64_t)r * dx_ld] = out;
        int next = r + GN_AHEAD * t.rows_per_pass;
        gn_fetch(ring[0], i, column, next, t.end, ld), gn_fetch(ring[1], i, dy + sample, next, t.end, C);
        if (add) gn_fetch(ring[2], i, dx_column, next, t.end, dx_ld);
        if (skip) gn_fetch(ring[skip_ring], i, skip + sample, next, t.end, C);
        conv_cp_async_commit();
    }
    if (dx_sums) {  // (in the fixed order of the sums kernels: the threads' rows, then the block's)
        float *sh = (float *)gn_smem;  // [rows][C], over the rings
        __syncthreads();               // every thread's ring read
        for (int j = 0; j < PACK; j++) sh[threadIdx.x * PACK + j] = written[j];
        __syncthreads();
        float *out = dx_sums + ((int64_t)n * chunks + blockIdx.x) * C;
        for (int c = threadIdx.x; c < C; c += GN_THREADS) {
            float total = 0.0f;
            for (int r = 0; r < gn_rows(C); r++) total += sh[r * C + c];
            out[c] = total;
        }
    }
}

// Backward, pass 3: d_gamma, d_beta (over samples and chunks) and d_scale_shift (over chunks), in
// the fixed order of channel_sums_final_kernel. On a layer of GN_PARAMS_BESIDE elements (N HW C) or
// more it runs beside pass 2, on the side stream; on a smaller one before it, on the same stream,
// where the side stream's fork and join cost more than the kernel takes (one H100: seed:32's step
// 1.7% faster than with all of them beside; with all on the same stream adm128:16's was 0.9 ms
// slower; dev/NOTES.md vv).
#define GN_PARAMS_BESIDE (1 << 22)
__global__ void __launch_bounds__(32 * REDUCE_SLICES)
    group_norm_backward_params_kernel(float *dgamma, float *dbeta, float *d_scale_shift, int ld, const double *partial, int N, int chunks,
                                      int C) {
    __shared__ double totals[REDUCE_SLICES][32][2];
    int c = blockIdx.x * 32 + threadIdx.x, slice = threadIdx.y;
    double dg = 0, db = 0;
    if (c < C)
        for (int n = slice; n < N; n += REDUCE_SLICES) {
            double du = 0, duz = 0;
            for (int k0 = 0; k0 < chunks; k0 += CHUNKS_LEAST)
#pragma unroll
                for (int k = k0; k < k0 + CHUNKS_LEAST; k++)  // CHUNKS_LEAST chunks' loads in flight at once
                    if (k < chunks) {
                        const double *p = partial + (((int64_t)n * chunks + k) * C + c) * 4;
                        du += p[0], duz += p[1], db += p[2], dg += p[3];
                    }
            if (d_scale_shift) d_scale_shift[(int64_t)n * ld + c] += (float)duz, d_scale_shift[(int64_t)n * ld + C + c] += (float)du;
        }
    totals[slice][threadIdx.x][0] = dg, totals[slice][threadIdx.x][1] = db;
    __syncthreads();
    if (slice == 0 && c < C) {
        for (int k = 1; k < REDUCE_SLICES; k++) dg += totals[k][threadIdx.x][0], db += totals[k][threadIdx.x][1];
        dgamma[c] = (float)dg;
        dbeta[c] = (float)db;
    }
}

// dx (+)= (the input gradient; the mode says which) + skip (not NULL: a gradient that reached the input
// around the layer, [N][HW][C] like dy, instead of a pass of its own adding it to dx), d_scale_shift +=
// (when scale-shift is on, [N][ld] like the input); y (not NULL): y again, as group_norm_forward wrote it
// (group_norm_recompute's work, done by the first pass, which reads x anyway). dx_sums (not NULL,
// [N][gn_chunks][C]): receives the partial channel sums of dx as written (gn_dx_sums_given says how
// to read them).
static void group_norm_backward(const Norm *norm, floatX *dx, GradMode mode, const floatX *skip, float *dx_sums, float *d_scale_shift,
                                const floatX *dy, const floatX *x, floatX *y, const float *mean, const float *rstd, int N, int HW,
                                NormOptions o) {
    int C = norm->channels, chunks = gn_chunks(HW, C, N);
    double *partials = norm->scratch->gn_partials;
    if (skip && o.x2) fatal("internal error: GroupNorm's backward adds a skip only to an input of one part");
    static bool input_configured;  // four rings are 64 KB in the BF16 build: beyond the default limit with the static part
    allow_dynamic_smem(group_norm_backward_input_kernel, &input_configured, gn_backward_smem(4));
    group_norm_backward_sums_kernel<<<dim3(chunks, N), GN_THREADS, gn_backward_smem(2), gpu.stream>>>(
        partials, y, dy, x, mean, rstd, norm->gamma, norm->beta, o, HW, C);
    cuda_check_launch();
    if (norm->dgamma) {  // the parameter gradients (when the model has them): beside on large layers
        const bool beside = (int64_t)N * HW * C >= GN_PARAMS_BESIDE;
        if (beside) side_begin();
        group_norm_backward_params_kernel<<<(C + 31) / 32, dim3(32, REDUCE_SLICES), 0, gpu.stream>>>(
            norm->dgamma, norm->dbeta, o.scale_shift ? d_scale_shift : NULL, o.scale_shift_ld, partials, N, chunks, C);
        cuda_check_launch();
        if (beside) side_end();
    }
    group_norm_backward_input_kernel<<<dim3(chunks, N), GN_THREADS, gn_backward_smem(2 + (mode == GRAD_ADD) + (skip != NULL)),
                                       gpu.stream>>>(dx, mode, skip, dx_sums, dy, x, partials, mean, rstd,
                                                     norm->gamma, norm->beta, o, HW, C);
    cuda_check_launch();
    side_join();
}

// The partial channel sums group_norm_backward left in dx_sums for an input of N x HW x C.
static ChannelSumsGiven gn_dx_sums_given(const float *dx_sums, int N, int HW, int C) { return {dx_sums, gn_chunks(HW, C, N), C}; }

// ----------------------------------------------------------------------------------------------
// Attention core (guided-diffusion's QKVAttention and QKVAttentionLegacy) over T = H*W tokens:
// for each sample n and head h with ch = C/heads channels,
//   S = Q K^T,  P = softmax(S / sqrt(ch)) (rows, fp32),  O = P V       (q, k each scaled by ch^-1/4)
// Q, K, V are channel slices of qkv [N][T][3C]: legacy order puts head h's q, k, v at
// h*3ch + {0, ch, 2ch}; the new order puts q at h*ch, k at C + h*ch, v at 2C + h*ch. O is written
// head-major into [N][T][C]. Backward:
//   dP = dO V^T,  dS = P * (dP - rowsum(dP * P)) / sqrt(ch),  dQ = dS K,  dK = dS^T Q,  dV = P^T dO
// with rowsum(dP * P) = rowsum(dO * O). Two ways to compute it:
// - fused (BF16 build, ch = 32, 64 or 128): flash attention. No T x T matrix reaches memory: a block
//   holds 64 queries (or keys) and runs through the other side 64 at a time, the softmax done
//   online (a running maximum and denominator per row). Forward keeps one number per row,
//   lse = log2 of the softmax denominator (in the units of S log2(e) / sqrt(ch)), so that backward
//   recomputes P = exp2(S log2(e) / sqrt(ch) - lse). Backward is two kernels, each writing its
//   gradients whole (no atomics: deterministic): per block of queries dQ (and rowsum(dO * O)),
//   then per block of keys dK and dV (at 128 channels a head, per half of the channels: a block
//   that kept all of dK's and dV's accumulators would need more registers than a thread has).
// - batched products (the FP32 build, other ch): S in fp32 and P in memory, cuBLAS batched
//   products over (n, h) given by arrays of pointers, softmax kernels between them.

typedef struct {
    int N, T, C, heads, legacy;
    int fused;
    const floatX *qkv;      // [N][T][3C]
    floatX *out;            // [N][T][C]
    floatX *d_qkv;          // [N][T][3C] (NULL: forward only)
    const floatX *d_out;    // [N][T][C]
    // fused: [N*heads][T] fp32
    float *lse;       // kept for the backward
    float *delta;     // backward scratch: rowsum(dO * O)
    // batched products:
    float *scores;    // [N*heads][T][T] fp32 scratch: S, then dP
    floatX *probs;    // [N*heads][T][T] P, kept for the backward
    floatX *d_scores; // [N*heads][T][T] scratch: dS
    // pointer arrays, one entry per (n, h)
    const floatX **q, **k, **v, **p, **ds;
    floatX **o, **dq, **dk, **dv;
    void **s, **dp_out;
    const floatX **d_o;
} Attention;

#if defined(PRECISION_FP32)
static int attention_can_fuse(int ch) {  // no bf16 tensor-core products in the FP32 build
    (void)ch;
    return 0;
}
#else
static int attention_can_fuse(int ch) { return ch == 32 || ch == 64 || ch == 128; }
#endif

// Channel offsets of head h's q, k and v within a row of qkv.
__host__ __device__ inline int3 attention_offsets(const Attention &a, int h) {
    int ch = a.C / a.heads;
    if (a.legacy) return make_int3(h * 3 * ch, h * 3 * ch + ch, h * 3 * ch + 2 * ch);
    return make_int3(h * ch, a.C + h * ch, 2 * a.C + h * ch);
}

#if !defined(PRECISION_FP32)
#define ATTN_TILE 64      // queries or keys per block, and per shared-memory tile
#define ATTN_THREADS 128  // four warps of 16 rows each

// Copies rows [first, first + 64) of a [T][ld] tensor's D channels at `base` into a tile of
// 64 lines of D + CONV_PAD elements (zeros past T); cp.async, committed by the caller.
template <int D>
__device__ inline void attention_load_tile(floatX *tile, const floatX *base, int64_t ld, int first, int T) {
    constexpr int CHUNKS = D / 8;  // 16-byte chunks per line
    for (int i = threadIdx.x; i < ATTN_TILE * CHUNKS; i += ATTN_THREADS) {
        int r = i / CHUNKS, c = i % CHUNKS, t = first + r;
        conv_cp_async16(tile + r * (D + CONV_PAD) + c * 8, base + (int64_t)(t < T ? t : 0) * ld + c * 8, t < T);
    }
}

// A-operand fragments of a warp's 16 lines (from line row0) of a tile, k = channel: a[kk] is k step kk.
template <int D>
__device__ inline void attention_fragments(uint32_t a[D / 16][4], const floatX *tile, int row0) {
    int lane = threadIdx.x % 32, quad = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
        conv_ldmatrix_x4<false>(a[kk], tile + (row0 + (quad & 1) * 8 + r8) * (D + CONV_PAD) + kk * 16 + (quad >> 1) * 8);
}

// acc[16][64] += A B^T: the warp's 16 rows (fragments a, k = channel) against the tile's 64 lines.
template <int D>
__device__ inline void attention_mma_lines(float acc[8][4], const uint32_t a[D / 16][4], const floatX *tile) {
    int lane = threadIdx.x % 32, quad = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++)
#pragma unroll
        for (int ni = 0; ni < 8; ni += 2) {
            uint32_t r[4];
            conv_ldmatrix_x4<false>(r, tile + (ni * 8 + (quad >> 1) * 8 + r8) * (D + CONV_PAD) + kk * 16 + (quad & 1) * 8);
            conv_mma_bf16(acc[ni], a[kk], r[0], r[1]);
            conv_mma_bf16(acc[ni + 1], a[kk], r[2], r[3]);
        }
}

__device__ inline uint32_t attention_pack(float lo, float hi) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *(uint32_t *)&v;
}

// acc[16][D] += W B: W [16][64] in the accumulator layout of attention_mma_lines (rounded to bf16:
// the accumulators of two 8-column tiles are one A fragment), B the tile's 64 lines x D channels
// (lines LD elements apart: a part of a wider tile's channels when LD is that tile's).
template <int D, int LD = D + CONV_PAD>
__device__ inline void attention_mma_weights(float acc[D / 8][4], const float w[8][4], const floatX *tile) {
    int lane = threadIdx.x % 32, quad = lane >> 3, r8 = lane & 7;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t a[4] = {attention_pack(w[2 * j][0], w[2 * j][1]), attention_pack(w[2 * j][2], w[2 * j][3]),
                         attention_pack(w[2 * j + 1][0], w[2 * j + 1][1]), attention_pack(w[2 * j + 1][2], w[2 * j + 1][3])};
#pragma unroll
        for (int ni = 0; ni < D / 8; ni += 2) {
            uint32_t r[4];
            conv_ldmatrix_x4<true>(r, tile + (j * 16 + (quad & 1) * 8 + r8) * LD + ni * 8 + (quad >> 1) * 8);
            conv_mma_bf16(acc[ni], a, r[0], r[1]);
            conv_mma_bf16(acc[ni + 1], a, r[2], r[3]);
        }
    }
}

// Writes a warp's [16][D] accumulators as bf16 to rows row0.. of a [T][ld] tensor at `base` (rows < T).
template <int D>
__device__ inline void attention_store_rows(floatX *base, int64_t ld, int row0, int T, const float acc[D / 8][4],
                                            const float row_scale[2]) {
    int lane = threadIdx.x % 32;
#pragma unroll
    for (int r = 0; r < 2; r++) {
        int t = row0 + lane / 4 + 8 * r;
        if (t >= T) continue;
#pragma unroll
        for (int ni = 0; ni < D / 8; ni++)
            *(uint32_t *)(base + t * ld + ni * 8 + 2 * (lane % 4)) =
                attention_pack(acc[ni][2 * r] * row_scale[r], acc[ni][2 * r + 1] * row_scale[r]);
    }
}

// The pipeline of the three kernels: a ring of two stages, each two tiles (K and V, or Q and dO).
// The block's own rows (read once, into registers) come in stage 1, beside tile 0 in stage 0. Each
// step waits for the copies in flight and for every warp (attention_wait_copies), takes its own
// rows at the first step, then starts the copy of the next tile into the other stage, which
// overlaps the products of this one. 4 tiles, in dynamic shared memory: 36 KB at 64 channels a head,
// 68 KB at 128.
__host__ __device__ constexpr size_t attention_smem(int D) { return 4 * ATTN_TILE * (D + CONV_PAD) * sizeof(floatX); }
extern __shared__ __align__(16) unsigned char attention_tiles[];
__device__ inline void attention_wait_copies() {
    conv_cp_async_wait<0>();
    __syncthreads();
}

// Starts the copy of tile j + 1's K and V into stage (j + 1) % 2, when there is one.
template <int D>
__device__ inline void attention_next_keys(floatX (*kv_tiles)[2][ATTN_TILE * (D + CONV_PAD)], const floatX *k, const floatX *v,
                                           int64_t ld, int j, int tiles, int T) {
    if (j + 1 < tiles) {
        attention_load_tile<D>(kv_tiles[(j + 1) % 2][0], k, ld, (j + 1) * ATTN_TILE, T);
        attention_load_tile<D>(kv_tiles[(j + 1) % 2][1], v, ld, (j + 1) * ATTN_TILE, T);
    }
    conv_cp_async_commit();
}

// Forward: one block per (n, h) and 64 queries; each warp 16 queries against all keys.
//   m = running max of s = S log2(e)/sqrt(ch), l = running sum of exp2(s - m), O = running sum of exp2(s - m) V;
//   a new max m' rescales l and O by exp2(m - m'). At the end O / l is written and lse = m + log2(l) kept.
template <int D>
__global__ void __launch_bounds__(ATTN_THREADS) attention_forward_kernel(Attention a, float scale_log2) {
    constexpr int LD = D + CONV_PAD;
    auto kv_tiles = (floatX(*)[2][ATTN_TILE * LD])attention_tiles;  // [stage][K, V]; stage 1 first holds Q
    int tiles = (a.T + ATTN_TILE - 1) / ATTN_TILE, b = blockIdx.x / tiles, q0 = blockIdx.x % tiles * ATTN_TILE;
    int n = b / a.heads, h = b % a.heads, lane = threadIdx.x % 32, row0 = threadIdx.x / 32 * 16;
    int3 off = attention_offsets(a, h);
    const floatX *qkv = a.qkv + (int64_t)n * a.T * 3 * a.C;
    int64_t ld = 3 * a.C;
    attention_load_tile<D>(kv_tiles[1][0], qkv + off.x, ld, q0, a.T);
    attention_load_tile<D>(kv_tiles[0][0], qkv + off.y, ld, 0, a.T);
    attention_load_tile<D>(kv_tiles[0][1], qkv + off.z, ld, 0, a.T);
    conv_cp_async_commit();

    uint32_t q[D / 16][4];
    float o[D / 8][4] = {}, m[2] = {-INFINITY, -INFINITY}, l[2] = {0.0f, 0.0f};
    for (int j = 0; j < tiles; j++) {
        attention_wait_copies();
        if (j == 0) {
            attention_fragments<D>(q, kv_tiles[1][0], row0);
            __syncthreads();
        }
        attention_next_keys<D>(kv_tiles, qkv + off.y, qkv + off.z, ld, j, tiles, a.T);
        float s[8][4] = {};
        attention_mma_lines<D>(s, q, kv_tiles[j % 2][0]);
#pragma unroll
        for (int r = 0; r < 2; r++) {  // this thread's two rows: lane / 4 and lane / 4 + 8
            float tile_max = -INFINITY;
#pragma unroll
            for (int ni = 0; ni < 8; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) {
                    int key = j * ATTN_TILE + ni * 8 + 2 * (lane % 4) + e;
                    float v = key < a.T ? s[ni][2 * r + e] * scale_log2 : -INFINITY;
                    s[ni][2 * r + e] = v, tile_max = fmaxf(tile_max, v);
                }
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 1));
            tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffff, tile_max, 2));
            float m_new = fmaxf(m[r], tile_max), rescale = exp2f(m[r] - m_new), sum = 0.0f;
#pragma unroll
            for (int ni = 0; ni < 8; ni++)
#pragma unroll
                for (int e = 0; e < 2; e++) sum += s[ni][2 * r + e] = exp2f(s[ni][2 * r + e] - m_new);
            l[r] = l[r] * rescale + sum, m[r] = m_new;
#pragma unroll
            for (int ni = 0; ni < D / 8; ni++) o[ni][2 * r] *= rescale, o[ni][2 * r + 1] *= rescale;
        }
        attention_mma_weights<D>(o, s, kv_tiles[j % 2][1]);
    }
    float inv_l[2];
#pragma unroll
    for (int r = 0; r < 2; r++) {
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 1);
        l[r] += __shfl_xor_sync(0xffffffff, l[r], 2);
        inv_l[r] = 1.0f / l[r];
        int t = q0 + row0 + lane / 4 + 8 * r;
        if (lane % 4 == 0 && t < a.T) a.lse[(int64_t)b * a.T + t] = m[r] + log2f(l[r]);
    }
    attention_store_rows<D>(a.out + (int64_t)n * a.T * a.C + h * D, a.C, q0 + row0, a.T, o, inv_l);
}

// Backward, per (n, h) and 64 queries: delta = rowsum(dO * O) for them (kept for the key blocks), then
// over all keys: P recomputed, dP = dO V^T, dS = P (dP - delta) / sqrt(ch), dQ = sum dS K.
template <int D>
__global__ void __launch_bounds__(ATTN_THREADS) attention_backward_dq_kernel(Attention a, float scale_log2, float scale) {
    constexpr int LD = D + CONV_PAD;
    auto kv_tiles = (floatX(*)[2][ATTN_TILE * LD])attention_tiles;  // [stage][K, V]; stage 1 first holds Q, dO
    __shared__ float row_lse[ATTN_TILE], row_delta[ATTN_TILE];
    int tiles = (a.T + ATTN_TILE - 1) / ATTN_TILE, b = blockIdx.x / tiles, q0 = blockIdx.x % tiles * ATTN_TILE;
    int n = b / a.heads, h = b % a.heads, lane = threadIdx.x % 32, row0 = threadIdx.x / 32 * 16;
    int3 off = attention_offsets(a, h);
    const floatX *qkv = a.qkv + (int64_t)n * a.T * 3 * a.C;
    const floatX *d_out = a.d_out + (int64_t)n * a.T * a.C + h * D, *out = a.out + (int64_t)n * a.T * a.C + h * D;
    int64_t ld = 3 * a.C;
    attention_load_tile<D>(kv_tiles[1][0], qkv + off.x, ld, q0, a.T);
    attention_load_tile<D>(kv_tiles[1][1], d_out, a.C, q0, a.T);
    attention_load_tile<D>(kv_tiles[0][0], qkv + off.y, ld, 0, a.T);
    attention_load_tile<D>(kv_tiles[0][1], qkv + off.z, ld, 0, a.T);
    conv_cp_async_commit();
    {  // delta: two threads per row, each half of its channels, 8 at a time
        int r = threadIdx.x / 2, t = q0 + r;
        float sum = 0.0f;
        if (t < a.T)
            for (int c = threadIdx.x % 2 * 8; c < D; c += 16) {
                Pack x = *(const Pack *)(d_out + (int64_t)t * a.C + c), y = *(const Pack *)(out + (int64_t)t * a.C + c);
#pragma unroll
                for (int i = 0; i < PACK; i++) sum += (float)x.v[i] * (float)y.v[i];
            }
        sum += __shfl_xor_sync(0xffffffff, sum, 1);
        if (threadIdx.x % 2 == 0) {
            row_delta[r] = sum, row_lse[r] = t < a.T ? a.lse[(int64_t)b * a.T + t] : 0.0f;
            if (t < a.T) a.delta[(int64_t)b * a.T + t] = sum;
        }
    }

    uint32_t q[D / 16][4], d_o[D / 16][4];
    float dq[D / 8][4] = {}, lse[2], delta[2];
    for (int j = 0; j < tiles; j++) {
        attention_wait_copies();
        if (j == 0) {
            attention_fragments<D>(q, kv_tiles[1][0], row0), attention_fragments<D>(d_o, kv_tiles[1][1], row0);
            for (int r = 0; r < 2; r++) lse[r] = row_lse[row0 + lane / 4 + 8 * r], delta[r] = row_delta[row0 + lane / 4 + 8 * r];
            __syncthreads();
        }
        attention_next_keys<D>(kv_tiles, qkv + off.y, qkv + off.z, ld, j, tiles, a.T);
        float s[8][4] = {}, dp[8][4] = {};
        attention_mma_lines<D>(s, q, kv_tiles[j % 2][0]);
        attention_mma_lines<D>(dp, d_o, kv_tiles[j % 2][1]);
#pragma unroll
        for (int ni = 0; ni < 8; ni++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                int key = j * ATTN_TILE + ni * 8 + 2 * (lane % 4) + i % 2;
                float p = key < a.T ? exp2f(s[ni][i] * scale_log2 - lse[i / 2]) : 0.0f;
                s[ni][i] = p * (dp[ni][i] - delta[i / 2]) * scale;  // dS
            }
        attention_mma_weights<D>(dq, s, kv_tiles[j % 2][0]);
    }
    const float one[2] = {1.0f, 1.0f};
    attention_store_rows<D>(a.d_qkv + (int64_t)n * a.T * 3 * a.C + off.x, ld, q0 + row0, a.T, dq, one);
}

// The key blocks' kernel writes a head's channels in this many parts (each recomputing P and dP):
// at 128 channels two, so that dK's and dV's accumulators fit a thread's registers.
__host__ __device__ constexpr int attention_dkdv_parts(int D) { return D > 64 ? 2 : 1; }

// Backward, per (n, h), 64 keys and a part of the channels (D_PART of D), over all queries (each
// warp 16 keys, so the products are transposed: rows are keys): P^T recomputed, dV = sum P^T dO,
// dP^T = V dO^T, dS^T = P^T (dP^T - delta) / sqrt(ch), dK = sum dS^T Q.
template <int D>
__global__ void __launch_bounds__(ATTN_THREADS) attention_backward_dkdv_kernel(Attention a, float scale_log2, float scale) {
    constexpr int LD = D + CONV_PAD, D_PART = D / attention_dkdv_parts(D);
    auto qdo_tiles = (floatX(*)[2][ATTN_TILE * LD])attention_tiles;  // [stage][Q, dO]; stage 1 first holds K, V
    __shared__ float row_lse[2][ATTN_TILE], row_delta[2][ATTN_TILE];
    int part = blockIdx.x % attention_dkdv_parts(D), block = blockIdx.x / attention_dkdv_parts(D);
    int tiles = (a.T + ATTN_TILE - 1) / ATTN_TILE, b = block / tiles, k0 = block % tiles * ATTN_TILE;
    int n = b / a.heads, h = b % a.heads, lane = threadIdx.x % 32, row0 = threadIdx.x / 32 * 16;
    int3 off = attention_offsets(a, h);
    const floatX *qkv = a.qkv + (int64_t)n * a.T * 3 * a.C, *d_out = a.d_out + (int64_t)n * a.T * a.C + h * D;
    int64_t ld = 3 * a.C;
    // Query tile i into stage i % 2: Q, dO, and lse (+infinity past T: P = 0 there) and delta.
    auto load_queries = [&](int i) {
        int st = i % 2, t0 = i * ATTN_TILE;
        attention_load_tile<D>(qdo_tiles[st][0], qkv + off.x, ld, t0, a.T);
        attention_load_tile<D>(qdo_tiles[st][1], d_out, a.C, t0, a.T);
        for (int r = threadIdx.x; r < ATTN_TILE; r += ATTN_THREADS) {
            int t = t0 + r;
            row_lse[st][r] = t < a.T ? a.lse[(int64_t)b * a.T + t] : INFINITY;
            row_delta[st][r] = t < a.T ? a.delta[(int64_t)b * a.T + t] : 0.0f;
        }
    };
    attention_load_tile<D>(qdo_tiles[1][0], qkv + off.y, ld, k0, a.T);
    attention_load_tile<D>(qdo_tiles[1][1], qkv + off.z, ld, k0, a.T);
    load_queries(0);
    conv_cp_async_commit();

    uint32_t k[D / 16][4], v[D / 16][4];
    float dk[D_PART / 8][4] = {}, dv[D_PART / 8][4] = {};
    for (int i = 0; i < tiles; i++) {
        attention_wait_copies();
        if (i == 0) {
            attention_fragments<D>(k, qdo_tiles[1][0], row0), attention_fragments<D>(v, qdo_tiles[1][1], row0);
            __syncthreads();
        }
        if (i + 1 < tiles) load_queries(i + 1);
        conv_cp_async_commit();
        const floatX *q_tile = qdo_tiles[i % 2][0], *do_tile = qdo_tiles[i % 2][1];
        float p[8][4] = {}, dp[8][4] = {};
        attention_mma_lines<D>(p, k, q_tile);  // S^T
        attention_mma_lines<D>(dp, v, do_tile);
#pragma unroll
        for (int ni = 0; ni < 8; ni++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                int col = ni * 8 + 2 * (lane % 4) + e % 2;  // the query within the tile
                p[ni][e] = exp2f(p[ni][e] * scale_log2 - row_lse[i % 2][col]);
                dp[ni][e] = p[ni][e] * (dp[ni][e] - row_delta[i % 2][col]) * scale;  // dS^T
            }
        attention_mma_weights<D_PART, LD>(dv, p, do_tile + part * D_PART);
        attention_mma_weights<D_PART, LD>(dk, dp, q_tile + part * D_PART);
    }
    const float one[2] = {1.0f, 1.0f};
    floatX *d_qkv = a.d_qkv + (int64_t)n * a.T * 3 * a.C + part * D_PART;
    attention_store_rows<D_PART>(d_qkv + off.y, ld, k0 + row0, a.T, dk, one);
    attention_store_rows<D_PART>(d_qkv + off.z, ld, k0 + row0, a.T, dv, one);
}

// Launches kernel<D>(a, ...) over every (n, h), 64 rows and `parts` parts of the channels.
#define ATTENTION_LAUNCH_D(D, kernel, parts, a, ...)                                                      \
    do {                                                                                                 \
        static bool configured_;                                                                         \
        allow_dynamic_smem(kernel<D>, &configured_, attention_smem(D));                                  \
        int blocks_ = (a)->N * (a)->heads * (((a)->T + ATTN_TILE - 1) / ATTN_TILE) * (parts);            \
        kernel<D><<<blocks_, ATTN_THREADS, attention_smem(D), gpu.stream>>>(*(a), __VA_ARGS__);          \
        cuda_check_launch();                                                                             \
    } while (0)
// ... for the layer's channels a head (attention_can_fuse's), `parts` a function of them.
#define ATTENTION_LAUNCH(kernel, parts, a, ...)                                                           \
    do {                                                                                                 \
        int ch_ = (a)->C / (a)->heads;                                                                   \
        if (ch_ == 32) ATTENTION_LAUNCH_D(32, kernel, parts(32), a, __VA_ARGS__);                        \
        else if (ch_ == 64) ATTENTION_LAUNCH_D(64, kernel, parts(64), a, __VA_ARGS__);                   \
        else if (ch_ == 128) ATTENTION_LAUNCH_D(128, kernel, parts(128), a, __VA_ARGS__);                \
        else fatal("attention: no fused kernel for heads of %d channels", ch_);                         \
    } while (0)
__host__ __device__ constexpr int attention_one_part(int) { return 1; }
#endif

__global__ void softmax_forward_kernel(floatX *probs, const float *scores, int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float *s = scores + (int64_t)row * T;
    float m = -INFINITY, sum = 0.0f;
    for (int i = lane; i < T; i += 32) m = fmaxf(m, s[i] * scale);
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o));
    for (int i = lane; i < T; i += 32) sum += expf(s[i] * scale - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    for (int i = lane; i < T; i += 32) probs[(int64_t)row * T + i] = (floatX)(expf(s[i] * scale - m) / sum);
}

__global__ void softmax_backward_kernel(floatX *d_scores, const float *d_probs, const floatX *probs, int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    const float *dp = d_probs + (int64_t)row * T;
    const floatX *p = probs + (int64_t)row * T;
    float dot = 0.0f;
    for (int i = lane; i < T; i += 32) dot += dp[i] * (float)p[i];
    for (int o = 16; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffff, dot, o);
    for (int i = lane; i < T; i += 32) d_scores[(int64_t)row * T + i] = (floatX)((float)p[i] * (dp[i] - dot) * scale);
}

// Fills the batched products' pointer arrays for one attention layer.
__global__ void attention_pointers_kernel(Attention a) {
    int b = blockIdx.x * blockDim.x + threadIdx.x;
    if (b >= a.N * a.heads) return;
    int n = b / a.heads, h = b % a.heads, ch = a.C / a.heads;
    int3 off = attention_offsets(a, h);
    int64_t base = (int64_t)n * a.T * 3 * a.C, tt = (int64_t)b * a.T * a.T, o_off = (int64_t)n * a.T * a.C + h * ch;
    a.q[b] = a.qkv + base + off.x, a.k[b] = a.qkv + base + off.y, a.v[b] = a.qkv + base + off.z;
    a.s[b] = a.scores + tt, a.p[b] = a.probs + tt;
    a.o[b] = a.out + o_off;
    if (!a.d_qkv) return;
    a.dq[b] = a.d_qkv + base + off.x, a.dk[b] = a.d_qkv + base + off.y, a.dv[b] = a.d_qkv + base + off.z;
    a.dp_out[b] = a.scores + tt, a.ds[b] = a.d_scores + tt, a.d_o[b] = a.d_out + o_off;
}

// Points an attention layer at its tensors: qkv and out, and their gradients (NULL: forward only).
// The batched products' scratch, probs and pointer arrays must be in place.
static void attention_bind(Attention *a, const floatX *qkv, floatX *out, floatX *d_qkv, const floatX *d_out) {
    a->qkv = qkv, a->out = out, a->d_qkv = d_qkv, a->d_out = d_out;
    if (a->fused) return;
    attention_pointers_kernel<<<(a->N * a->heads + 63) / 64, 64, 0, gpu.stream>>>(*a);
    cuda_check_launch();
}

static void attention_forward(const Attention *a) {
    int ch = a->C / a->heads, batch = a->N * a->heads, T = a->T;
#if !defined(PRECISION_FP32)
    if (a->fused) {
        ATTENTION_LAUNCH(attention_forward_kernel, attention_one_part, a, (float)M_LOG2E / sqrtf((float)ch));
        return;
    }
#endif
    matmul_batched(a->s, CUDA_R_32F, T, a->q, 0, 3 * a->C, a->k, 1, 3 * a->C, T, T, ch, 0.0f, batch);
    softmax_forward_kernel<<<(batch * T + 7) / 8, 256, 0, gpu.stream>>>(a->probs, a->scores, batch * T, T, 1.0f / sqrtf((float)ch));
    cuda_check_launch();
    matmul_batched((void *const *)a->o, CUDA_FLOATX, a->C, a->p, 0, T, a->v, 0, 3 * a->C, T, ch, T, 0.0f, batch);
}

// d_qkv = (the gradient of the core at dO), written whole.
static void attention_backward(const Attention *a) {
    int ch = a->C / a->heads, batch = a->N * a->heads, T = a->T;
#if !defined(PRECISION_FP32)
    if (a->fused) {
        float scale = 1.0f / sqrtf((float)ch);
        ATTENTION_LAUNCH(attention_backward_dq_kernel, attention_one_part, a, (float)M_LOG2E * scale, scale);
        ATTENTION_LAUNCH(attention_backward_dkdv_kernel, attention_dkdv_parts, a, (float)M_LOG2E * scale, scale);
        return;
    }
#endif
    matmul_batched(a->dp_out, CUDA_R_32F, T, a->d_o, 0, a->C, a->v, 1, 3 * a->C, T, T, ch, 0.0f, batch);
    softmax_backward_kernel<<<(batch * T + 7) / 8, 256, 0, gpu.stream>>>(a->d_scores, a->scores, a->probs, batch * T, T,
                                                                         1.0f / sqrtf((float)ch));
    cuda_check_launch();
    matmul_batched((void *const *)a->dq, CUDA_FLOATX, 3 * a->C, a->ds, 0, T, a->k, 0, 3 * a->C, T, ch, T, 0.0f, batch);
    matmul_batched((void *const *)a->dk, CUDA_FLOATX, 3 * a->C, a->ds, 1, T, a->q, 0, 3 * a->C, T, ch, T, 0.0f, batch);
    matmul_batched((void *const *)a->dv, CUDA_FLOATX, 3 * a->C, a->p, 1, T, a->d_o, 0, a->C, T, ch, T, 0.0f, batch);
}

// ----------------------------------------------------------------------------------------------
// The classifier head's tokens (PoolHead): from x [N][HW][C], T tokens a sample,
//   tokens[n][0][c] = mean_p x[n][p][c] + pos[c][0],   tokens[n][1 + p][c] = x[n][p][c] + pos[c][1 + p]
// (AttentionPool2d, pos its positional_embedding [C][T], T = 1 + HW), or with T = 1 and no pos the
// mean alone (the adaptive pool; the spatial pools' features, a source's C columns of rows ld
// wide). Backward:
//   dx[n][p][c] (+)= d tokens[n][0][c] / HW + d tokens[n][1 + p][c],   d pos[c][t] = sum_n d tokens[n][t][c].
// A thread per (sample, channel) walks the pixels (the heads' maps are small: 8x8 at most in
// guided-diffusion's classifiers; the spatial pools' first sources are larger, but one pass over them),
// the sums in a fixed order. Tokens: rows of ld elements (C but for the spatial pools' features).
__global__ void pool_tokens_forward_kernel(floatX *tokens, int ld, const floatX *x, const float *pos, int N, int HW, int C, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) return;
    int n = i / C, c = i % C;
    const floatX *column = x + (int64_t)n * HW * C + c;
    floatX *out = tokens + (int64_t)n * T * ld + c;
    float sum = 0.0f;
    for (int p = 0; p < HW; p++) sum += (float)column[(int64_t)p * C];
    out[0] = (floatX)(sum / HW + (pos ? pos[(int64_t)c * T] : 0.0f));
    if (T > 1)
        for (int p = 0; p < HW; p++) out[(int64_t)(1 + p) * ld] = (floatX)((float)column[(int64_t)p * C] + pos[(int64_t)c * T + 1 + p]);
}

__global__ void pool_tokens_backward_kernel(floatX *dx, GradMode mode, const floatX *d_tokens, int ld, int N, int HW, int C, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= N * C) return;
    int n = i / C, c = i % C;
    const floatX *d = d_tokens + (int64_t)n * T * ld + c;
    float d_mean = (float)d[0] / HW;
    for (int p = 0; p < HW; p++) {
        floatX *at = dx + ((int64_t)n * HW + p) * C + c;
        float v = d_mean + (T > 1 ? (float)d[(int64_t)(1 + p) * ld] : 0.0f);
        *at = (floatX)(mode == GRAD_ADD ? (float)*at + v : v);
    }
}

__global__ void pool_positions_backward_kernel(float *d_pos, const floatX *d_tokens, int N, int C, int T) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    int t = i / C, c = i % C;
    float sum = 0.0f;
    for (int n = 0; n < N; n++) sum += (float)d_tokens[((int64_t)n * T + t) * C + c];
    d_pos[(int64_t)c * T + t] = sum;
}

static void pool_tokens_forward(floatX *tokens, int ld, const floatX *x, const float *pos, int N, int HW, int C, int T) {
    pool_tokens_forward_kernel<<<blocks_for((size_t)N * C, 256), 256, 0, gpu.stream>>>(tokens, ld, x, pos, N, HW, C, T);
    cuda_check_launch();
}

// dx (+)= as the mode says; d_pos (attention pool: not NULL) written whole.
static void pool_tokens_backward(floatX *dx, GradMode mode, float *d_pos, const floatX *d_tokens, int ld, int N, int HW, int C, int T) {
    pool_tokens_backward_kernel<<<blocks_for((size_t)N * C, 256), 256, 0, gpu.stream>>>(dx, mode, d_tokens, ld, N, HW, C, T);
    cuda_check_launch();
    if (!d_pos) return;
    pool_positions_backward_kernel<<<blocks_for((size_t)T * C, 256), 256, 0, gpu.stream>>>(d_pos, d_tokens, N, C, T);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------------------------
// Resampling without weights, NHWC: 2x2 average pooling (down) and nearest-neighbour 2x (up).
//   pool: y[n][i][j] = (x[2i][2j] + x[2i][2j+1] + x[2i+1][2j] + x[2i+1][2j+1]) / 4;  dx = dy / 4 to each
//   up:   y[n][i][j] = x[i/2][j/2];                                                 dx = sum of its 4 dy
// Then the upsampler's (SuperResModel's), forward only: its low-resolution image upsampled
// bilinearly into the model's input, and in training made by area downsampling.

// One thread per output (forward) or input (backward) pixel and vector of channels; V is Pack, or
// Scalar when C % PACK != 0. H, W: the input's size. Odd sizes drop the last row or column, as
// PyTorch's AvgPool2d does.
template <typename V>
__global__ void avg_pool_forward_kernel(floatX *y, const floatX *x, int N, int H, int W, int C) {
    const int per = sizeof(V) / sizeof(floatX), vecs = C / per, Ho = H / 2, Wo = W / 2, total = N * Ho * Wo * vecs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int v = i % vecs, p = i / vecs, j = p % Wo, r = (p / Wo) % Ho, n = p / (Wo * Ho);
        const V *at = (const V *)x + ((int64_t)(n * H + 2 * r) * W + 2 * j) * vecs + v;
        V a = at[0], b = at[vecs], c = at[(int64_t)W * vecs], d = at[(int64_t)W * vecs + vecs], out;
        for (int k = 0; k < per; k++)
            out.v[k] = (floatX)(((float)a.v[k] + (float)b.v[k] + (float)c.v[k] + (float)d.v[k]) * 0.25f);
        ((V *)y)[i] = out;
    }
}

template <typename V>
__global__ void avg_pool_backward_kernel(floatX *dx, GradMode mode, const floatX *dy, int N, int H, int W, int C) {
    const int per = sizeof(V) / sizeof(floatX), vecs = C / per, Ho = H / 2, Wo = W / 2, total = N * H * W * vecs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int v = i % vecs, p = i / vecs, w = p % W, h = (p / W) % H, n = p / (W * H);
        bool dropped = h / 2 >= Ho || w / 2 >= Wo;  // a dropped row or column: no gradient
        V g, acc;
        if (!dropped) g = ((const V *)dy)[((int64_t)(n * Ho + h / 2) * Wo + w / 2) * vecs + v];
        if (mode == GRAD_ADD) acc = ((V *)dx)[i];
        for (int k = 0; k < per; k++) {
            float d = dropped ? 0.0f : 0.25f * (float)g.v[k];
            acc.v[k] = (floatX)(mode == GRAD_ADD ? (float)acc.v[k] + d : d);
        }
        ((V *)dx)[i] = acc;
    }
}

template <typename V>
__global__ void upsample_forward_kernel(floatX *y, const floatX *x, int N, int H, int W, int C) {
    const int per = sizeof(V) / sizeof(floatX), vecs = C / per, total = N * 4 * H * W * vecs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int v = i % vecs, p = i / vecs, w = p % (2 * W), h = (p / (2 * W)) % (2 * H), n = p / (4 * W * H);
        ((V *)y)[i] = ((const V *)x)[((int64_t)(n * H + h / 2) * W + w / 2) * vecs + v];
    }
}

template <typename V>
__global__ void upsample_backward_kernel(floatX *dx, GradMode mode, const floatX *dy, int N, int H, int W, int C) {
    const int per = sizeof(V) / sizeof(floatX), vecs = C / per, total = N * H * W * vecs;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < total; i += gridDim.x * blockDim.x) {
        int v = i % vecs, p = i / vecs, w = p % W, h = (p / W) % H, n = p / (W * H);
        const V *at = (const V *)dy + ((int64_t)(n * 2 * H + 2 * h) * 2 * W + 2 * w) * vecs + v;
        int64_t row = (int64_t)2 * W * vecs;
        V a = at[0], b = at[vecs], c = at[row], d = at[row + vecs], acc;
        if (mode == GRAD_ADD) acc = ((V *)dx)[i];
        for (int k = 0; k < per; k++) {
            float sum = (float)a.v[k] + (float)b.v[k] + (float)c.v[k] + (float)d.v[k];
            acc.v[k] = (floatX)(mode == GRAD_ADD ? (float)acc.v[k] + sum : sum);
        }
        ((V *)dx)[i] = acc;
    }
}

static void resample_forward(int up, floatX *y, const floatX *x, int N, int H, int W, int C) {
    int64_t out = up ? (int64_t)N * 4 * H * W * C : (int64_t)N * (H / 2) * (W / 2) * C;
    if (up) LAUNCH_VECTORISED(upsample_forward_kernel, out, C, y, x, N, H, W, C);
    else LAUNCH_VECTORISED(avg_pool_forward_kernel, out, C, y, x, N, H, W, C);
}

// dx (+)= the gradient through the resampling of an H x W input.
static void resample_backward(int up, floatX *dx, GradMode mode, const floatX *dy, int N, int H, int W, int C) {
    int64_t in = (int64_t)N * H * W * C;
    if (up) LAUNCH_VECTORISED(upsample_backward_kernel, in, C, dx, mode, dy, N, H, W, C);
    else LAUNCH_VECTORISED(avg_pool_backward_kernel, in, C, dx, mode, dy, N, H, W, C);
}

// SuperResModel's conditioning: the low-resolution image lo [N][s][s][C] bilinearly upsampled to
// S x S, as PyTorch's F.interpolate(mode="bilinear") (align_corners=False): output row i samples the
// input at u = max((i + 1/2) s/S - 1/2, 0), between rows u0 = floor(u) and min(u0 + 1, s - 1)
// with weights 1 - (u - u0) and u - u0; columns the same way. Written into channels [at, at + C) of
// y [N][S][S][ld]. Forward only: the low-resolution image is data (no gradient reaches it).
__global__ void upsample_bilinear_kernel(floatX *y, int ld, int at, const floatX *lo, int N, int s, int S, int C) {
    float scale = (float)s / (float)S;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)N * S * S * C; i += (int64_t)gridDim.x * blockDim.x) {
        int c = (int)(i % C), col = (int)(i / C % S), row = (int)(i / C / S % S);
        int64_t n = i / C / S / S;
        float u = fmaxf((row + 0.5f) * scale - 0.5f, 0.0f), v = fmaxf((col + 0.5f) * scale - 0.5f, 0.0f);
        int u0 = (int)u, v0 = (int)v, u1 = u0 + (u0 < s - 1), v1 = v0 + (v0 < s - 1);
        float lu = u - u0, lv = v - v0;
        const floatX *p = lo + n * s * s * C + c;
        float top = (1.0f - lv) * (float)p[((int64_t)u0 * s + v0) * C] + lv * (float)p[((int64_t)u0 * s + v1) * C];
        float bottom = (1.0f - lv) * (float)p[((int64_t)u1 * s + v0) * C] + lv * (float)p[((int64_t)u1 * s + v1) * C];
        y[(i / C) * ld + at + c] = (floatX)((1.0f - lu) * top + lu * bottom);
    }
}

static void upsample_bilinear(floatX *y, int ld, int at, const floatX *lo, int N, int s, int S, int C) {
    upsample_bilinear_kernel<<<blocks_for((size_t)N * S * S * C, 256), 256, 0, gpu.stream>>>(y, ld, at, lo, N, s, S, C);
    cuda_check_launch();
}

// The upsampler's training input (guided-diffusion's load_superres_data: F.interpolate(mode="area")):
// x [N][S][S][C] downsampled to lo [N][s][s][C] by the mean of each f x f block, f = S / s (s divides S).
__global__ void downsample_area_kernel(floatX *lo, const floatX *x, int N, int S, int s, int C) {
    int f = S / s;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < (int64_t)N * s * s * C; i += (int64_t)gridDim.x * blockDim.x) {
        int c = (int)(i % C), col = (int)(i / C % s), row = (int)(i / C / s % s);
        const floatX *p = x + ((i / C / s / s * S + (int64_t)row * f) * S + (int64_t)col * f) * C + c;
        float sum = 0.0f;
        for (int a = 0; a < f; a++)
            for (int b = 0; b < f; b++) sum += (float)p[((int64_t)a * S + b) * C];
        lo[i] = (floatX)(sum / (float)(f * f));
    }
}

static void downsample_area(floatX *lo, const floatX *x, int N, int S, int s, int C) {
    downsample_area_kernel<<<blocks_for((size_t)N * s * s * C, 256), 256, 0, gpu.stream>>>(lo, x, N, S, s, C);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------------------------
// Channel concatenation of the skip connections: y[p] = [a[p] (Ca channels) | b[p] (Cb)];
// backward splits dy into da (+)= and db (+)= (each with its own GradMode). A thread moves one V at a time: a Pack of 16 bytes when
// both channel counts are multiples of PACK, else a Scalar.

template <typename V>
__global__ void concat_kernel(floatX *y, const floatX *a, const floatX *b, int64_t pixels, int Ca, int Cb) {
    const int per = sizeof(V) / sizeof(floatX), va = Ca / per, vb = Cb / per, vecs = va + vb;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < pixels * vecs; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t p = i / vecs;
        int c = (int)(i - p * vecs);
        ((V *)y)[i] = c < va ? ((const V *)a)[p * va + c] : ((const V *)b)[p * vb + c - va];
    }
}

template <typename V>
__global__ void split_kernel(floatX *da, GradMode a_mode, floatX *db, GradMode b_mode, const floatX *dy, int64_t pixels, int Ca,
                             int Cb) {
    const int per = sizeof(V) / sizeof(floatX), va = Ca / per, vb = Cb / per, vecs = va + vb;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < pixels * vecs; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t p = i / vecs;
        int c = (int)(i - p * vecs);
        V *d = c < va ? &((V *)da)[p * va + c] : &((V *)db)[p * vb + c - va];
        V g = ((const V *)dy)[i];
        if ((c < va ? a_mode : b_mode) == GRAD_ADD) {
            V sum = *d;
            for (int j = 0; j < per; j++) g.v[j] = (floatX)((float)sum.v[j] + (float)g.v[j]);
        }
        *d = g;
    }
}

// (Ca | Cb is a multiple of PACK, a power of two, exactly when both are.)
static void concat_channels(floatX *y, const floatX *a, const floatX *b, int64_t pixels, int Ca, int Cb) {
    LAUNCH_VECTORISED(concat_kernel, pixels * (Ca + Cb), Ca | Cb, y, a, b, pixels, Ca, Cb);
}

static void split_channels(floatX *da, GradMode a_mode, floatX *db, GradMode b_mode, const floatX *dy, int64_t pixels, int Ca,
                           int Cb) {
    LAUNCH_VECTORISED(split_kernel, pixels * (Ca + Cb), Ca | Cb, da, a_mode, db, b_mode, dy, pixels, Ca, Cb);
}

// ----------------------------------------------------------------------------------------------
// Elementwise: SiLU and its backward dx (+)= dy * s (1 + x (1 - s)), s = sigmoid(x).

// y += x over n fp32 values (parameter gradients: the pieces of a step's batch).
__global__ void add_floats_kernel(float *y, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) y[i] += x[i];
}

static void add_floats(float *y, const float *x, int64_t n) {
    if (n <= 0) return;
    add_floats_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(y, x, n);
    cuda_check_launch();
}

__global__ void silu_forward_kernel(floatX *y, const floatX *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = (float)x[i];
        y[i] = (floatX)(v * sigmoidf_(v));
    }
}

__global__ void silu_backward_kernel(floatX *dx, const floatX *dy, const floatX *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float v = (float)x[i], s = sigmoidf_(v);
        dx[i] = (floatX)((float)dx[i] + (float)dy[i] * s * (1.0f + v * (1.0f - s)));
    }
}

// y = max(x, 0);  dx = dy where x > 0, else 0 (written).
__global__ void relu_forward_kernel(floatX *y, const floatX *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        y[i] = (float)x[i] > 0.0f ? x[i] : (floatX)0.0f;
}

__global__ void relu_backward_kernel(floatX *dx, const floatX *dy, const floatX *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        dx[i] = (float)x[i] > 0.0f ? dy[i] : (floatX)0.0f;
}

// out = in rounded to the activation type: the weights' compute copy, an fp32 gradient as floatX.
__global__ void float_to_floatx_kernel(floatX *out, const float *in, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        out[i] = (floatX)in[i];
}

// ----------------------------------------------------------------------------------------------
// The timestep and class embeddings. guided-diffusion's sinusoid of dim D, half = D/2:
//   e[n][i] = cos(t_n f_i), e[n][half + i] = sin(t_n f_i), f_i = exp(-ln(10000) i / half)
// (computed in double: the fp32 argument would be off by ~1e-4 at t ~ 1000), t_n the integer
// timestep, or an EDM model's continuous c_noise (time not NULL; EDM's PositionalEmbedding is this
// sinusoid), then the label row:
//   emb[n] += label_emb[y_n];  backward: d_label_emb[k] = sum over n with y_n = k of d_emb[n].

__global__ void timestep_embedding_kernel(floatX *e, const int64_t *t, const float *time, int N, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x, half = D / 2;
    if (i >= N * D) return;
    int n = i / D, j = i % D;
    if (j >= 2 * half) { e[i] = (floatX)0.0f; return; }
    double f = exp(-log(10000.0) * (j % half) / half), arg = (time ? (double)time[n] : (double)t[n]) * f;
    e[i] = (floatX)(j < half ? cos(arg) : sin(arg));
}

__global__ void label_embedding_forward_kernel(floatX *emb, const float *table, const int *labels, int N, int D) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N * D) emb[i] = (floatX)((float)emb[i] + table[(int64_t)labels[i / D] * D + i % D]);
}

__global__ void label_embedding_backward_kernel(float *d_table, const floatX *d_emb, const int *labels, int N, int rows, int D) {
    int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= D) return;
    for (int k = 0; k < rows; k++) d_table[(int64_t)k * D + j] = 0.0f;
    for (int n = 0; n < N; n++) d_table[(int64_t)labels[n] * D + j] += (float)d_emb[(int64_t)n * D + j];
}

// y[n][e] += bias[e] (fp32 rows): the ResBlocks' embedding projections' biases, after their one product.
__global__ void add_rows_kernel(float *y, const floatX *bias, int N, int E) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < N * E) y[i] += (float)bias[i % E];
}

// ----------------------------------------------------------------------------------------------
// The loss: guided-diffusion's training_losses (the prediction's MSE and, with a learned variance,
// the variational bound's term, whose math the likelihood shares) and the noisy classifier's
// cross-entropy; each sums per block, then in one final block, every sum in a fixed order.

// The sum of every thread's v in a block of 256 threads, in a fixed order (a tree in shared
// memory); valid in thread 0. Used by the loss and the gradient norm.
template <typename T>
__device__ T block_sum_256(T v) {
    __shared__ T sums[256];
    sums[threadIdx.x] = v;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride /= 2) {
        if (threadIdx.x < stride) sums[threadIdx.x] += sums[threadIdx.x + stride];
        __syncthreads();
    }
    return sums[0];
}

// Model input from a pixel: x = pixel / 127.5 - 1, uint8 [0, 255] -> [-1, 1], in one rounding (fma)
// so that the host and the device agree to the bit. The loss's x0 is the float (in the BF16 build
// the model's input is rounded again: bf16 would move a pixel by up to half the decoder's bin).
__host__ __device__ inline float pixel_value(uint8_t pixel) { return fmaf((float)pixel, 1.0f / 127.5f, -1.0f); }

__host__ __device__ inline floatX pixel_to_model_input(uint8_t pixel) { return (floatX)pixel_value(pixel); }

// The variational bound's term of one value (improved DDPM, guided-diffusion's _vb_terms_bpd before
// its mean over the image), in nats, for a model output `out` (its prediction) and `v` (its learned
// variance, sampler.h's learned_log_variance) at x_t:
//   x0' from out as predicted;  mean' = mean_x0 x0' + mean_xt x_t;  log_var' = the learned range at v
//   t > 0:  KL(q(x_{t-1} | x_t, x0) || N(mean', e^log_var'))
//           = (-1 + log_var' - log_var_q + e^(log_var_q - log_var') + (mean_q - mean')^2 e^-log_var') / 2
//           (log_var_q: the posterior's, log_var_min)
//   t = 0:  -log of the discretized Gaussian decoder's likelihood of x0 (decoder_log_likelihood)
// with its derivatives by out (through mean') and by v (through log_var'). clip: x0' clipped to [-1,
// 1] (guided-diffusion's clip_denoised: its likelihood's default; training never clips).
typedef struct {
    float value, d_out, d_v;
} BoundTerm;

// The standard normal CDF as guided-diffusion approximates it, 0.5 (1 + tanh(sqrt(2/pi) (x + 0.044715
// x^3))), and its derivative in *slope.
__host__ __device__ inline float approx_normal_cdf(float x, float *slope) {
    const float k = 0.7978845608f;  // sqrt(2/pi)
    float g = k * (x + 0.044715f * x * x * x), sech = 1.0f / coshf(g);  // 1 - tanh^2, without its cancellation
    *slope = 0.5f * sech * sech * k * (1.0f + 3.0f * 0.044715f * x * x);
    return 0.5f * (1.0f + tanhf(g));
}

// log p(x) of guided-diffusion's discretized Gaussian decoder (discretized_gaussian_log_likelihood):
// x, a pixel in [-1, 1], is the bin [x - 1/255, x + 1/255] of N(mean, e^(2 log_scale)), the first and
// the last bins open-ended; probabilities clamped at 1e-12. Its derivatives by mean and log_scale
// (zero where the clamp holds) go to *d_mean and *d_log_scale.
__host__ __device__ inline float decoder_log_likelihood(float x, float mean, float log_scale, float *d_mean, float *d_log_scale) {
    float inv = expf(-log_scale), centered = x - mean;
    float plus_in = inv * (centered + 1.0f / 255.0f), min_in = inv * (centered - 1.0f / 255.0f), slope_plus, slope_min;
    float cdf_plus = approx_normal_cdf(plus_in, &slope_plus), cdf_min = approx_normal_cdf(min_in, &slope_min);
    float value, by_plus, by_min;  // d value / d cdf_plus, d cdf_min
    if (x < -0.999f) {
        value = logf(fmaxf(cdf_plus, 1e-12f)), by_plus = cdf_plus > 1e-12f ? 1.0f / cdf_plus : 0.0f, by_min = 0.0f;
    } else if (x > 0.999f) {
        value = logf(fmaxf(1.0f - cdf_min, 1e-12f)), by_plus = 0.0f, by_min = 1.0f - cdf_min > 1e-12f ? -1.0f / (1.0f - cdf_min) : 0.0f;
    } else {
        float delta = cdf_plus - cdf_min;
        value = logf(fmaxf(delta, 1e-12f)), by_plus = delta > 1e-12f ? 1.0f / delta : 0.0f, by_min = -by_plus;
    }
    // d plus_in / d mean = -inv, d plus_in / d log_scale = -plus_in (and min_in likewise)
    *d_mean = -inv * (by_plus * slope_plus + by_min * slope_min);
    *d_log_scale = -(by_plus * slope_plus * plus_in + by_min * slope_min * min_in);
    return value;
}

__host__ __device__ inline BoundTerm bound_term(float x0, float x_t, float out, float v, const TimestepTerms *tt, int first_step,
                                                int predict, int clip) {
    float x0_by_out = predict == PREDICT_EPS ? -tt->sqrt_one_minus_abar / tt->sqrt_abar
                    : predict == PREDICT_V   ? -tt->sqrt_one_minus_abar
                                             : 1.0f;  // d x0' / d out
    float x0_model = predict == PREDICT_EPS ? (x_t - tt->sqrt_one_minus_abar * out) / tt->sqrt_abar
                   : predict == PREDICT_V   ? tt->sqrt_abar * x_t - tt->sqrt_one_minus_abar * out
                                            : out;
    if (clip && fabsf(x0_model) > 1.0f) x0_model = copysignf(1.0f, x0_model), x0_by_out = 0.0f;
    float mean = tt->mean_x0 * x0_model + tt->mean_xt * x_t;
    float log_var = learned_log_variance(v, tt->log_var_min, tt->log_var_range);
    BoundTerm b;
    float d_mean, d_log_var;
    if (first_step) {
        float d_log_scale;
        b.value = -decoder_log_likelihood(x0, mean, 0.5f * log_var, &d_mean, &d_log_scale);
        d_mean = -d_mean, d_log_var = -0.5f * d_log_scale;
    } else {
        // -1 + e^u - u with u = log_var_q - log_var' = -f log_var_range as expm1(u) - u, and the means'
        // gap as mean_x0 (x0 - x0'): late in the schedule the range is narrow and mean_x0 small, where
        // the direct forms would cancel most digits (of u^2 / 2, of the mean_xt x_t both means hold)
        float gap = tt->mean_x0 * (x0 - x0_model), precision = expf(-log_var);
        float u = -0.5f * (v + 1.0f) * tt->log_var_range;
        b.value = 0.5f * (expm1f(u) - u + gap * gap * precision);
        d_mean = -gap * precision;
        d_log_var = -0.5f * (expm1f(u) + gap * gap * precision);
    }
    b.d_out = d_mean * tt->mean_x0 * x0_by_out;
    b.d_v = d_log_var * 0.5f * tt->log_var_range;
    return b;
}

// The training loss (guided-diffusion's training_losses), per sample n of D = H W C values, then
// over the batch of N with each sample's weight w_n (the schedule sampler's 1 / (T p_t); 1 for t
// drawn uniformly):
//   mse_n = (1/D) sum (out - target)^2
//   vb_n  = (s / (D ln 2)) sum bound_term    (a learned variance: the output [N][H][W][2C] holds the
//                                             prediction's C channels, then the variance's)
//   loss_n = mse_n + vb_n;  L = (1/N) sum_n w_n loss_n
// The prediction alone (eps, v, x0): mse_n. Hybrid (RESCALED_MSE): the mean is frozen in the bound
// (only the variance half learns from it), s = T/1000 (1 without rescale_learned_sigmas). use_kl
// (RESCALED_KL): loss_n = vb_n, the bound through both halves, s = T (1 without rescaling).
typedef struct {
    int learned, mse, frozen_mean, predict;
    float bound_scale;  // s
} LossKind;

static LossKind loss_kind(const DiffusionConfig *d) {
    int learned = d->variance == VARIANCE_LEARNED_RANGE;
    return {learned, d->loss != LOSS_KL, d->loss == LOSS_HYBRID, d->predict, d->bound_scale};
}

// What the loss reads besides the output and the target.
typedef struct {
    const uint8_t *pixels;        // x0 as pixels [N][H][W][C] (a learned variance's bound; NULL without)
    const floatX *x_t;            // [N][H][W][C] (the same)
    const TimestepTerms *terms;   // [T] (the same)
    const int64_t *t;             // [N], the samples' timesteps (NULL: all counted in the first quarter)
    int T;
    const float *weights;         // [N], w_n (NULL: 1)
    // A step's batch in pieces (--microbatch): these N samples are piece `piece` of the step's
    // `step_batch` (0: N, one piece), L's divisor; the first piece writes the terms, the others add.
    int step_batch, piece;
    int x_t_ld;                   // x_t's values a pixel (0: C; an upsampler's input: 2C, the low-resolution image's after)
} LossInputs;

// What it writes besides the output's gradient (GPU arrays).
#define LOSS_TERMS 19
typedef struct {
    float *terms;    // [LOSS_TERMS]: L; the means of w_n mse_n and w_n vb_n (a classifier's: of acc@1 and acc@k);
                     // for each quarter of t (t < T/4, ...; guided-diffusion's loss_q0..q3) the sum of w_n loss_n,
                     // then the count of samples; a classifier's: then the quarters' sums of acc@1, of acc@k
    float *samples;  // [N][2]: each sample's t and loss_n (unweighted: the schedule sampler's history)
    float *partial;  // [N][loss_blocks(hw)][2], at least [N][3]: scratch
} LossOutputs;

// The blocks of a sample for loss_partial_kernel: a block per 256 pixels, at most 32.
static int loss_blocks(int hw) { return (hw + 255) / 256 < 32 ? (hw + 255) / 256 : 32; }

static LossOutputs loss_outputs_create(int N, int hw) {
    LossOutputs l;
    size_t partial = (size_t)N * (loss_blocks(hw) * 2 > 3 ? loss_blocks(hw) * 2 : 3);
    l.terms = (float *)gpu_malloc(((size_t)LOSS_TERMS + 2 * N + partial) * sizeof(float));
    l.samples = l.terms + LOSS_TERMS, l.partial = l.samples + 2 * N;
    cuda_check(cudaMemset(l.terms, 0, LOSS_TERMS * sizeof(float)));
    return l;
}

// Blocks (x) of a sample (y): each writes its values' gradient (of the batch's L) whole, and its sums
// of the squared errors and of the bound's terms into partial[n][block][2].
__global__ void loss_partial_kernel(float *partial, floatX *d_out, const floatX *out, const floatX *target, LossInputs in, int hw,
                                    int C, LossKind kind) {
    int n = blockIdx.y, N = in.step_batch ? in.step_batch : gridDim.y, out_C = kind.learned ? 2 * C : C;
    float per_value = (in.weights ? in.weights[n] : 1.0f) / ((float)N * hw * C), per_bound = kind.bound_scale * per_value / (float)M_LN2;
    float squares = 0.0f, bound = 0.0f;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < hw; p += gridDim.x * blockDim.x)
        for (int c = 0; c < C; c++) {
            int64_t i = ((int64_t)n * hw + p) * C + c, o = ((int64_t)n * hw + p) * out_C + c;
            float prediction = (float)out[o], d = 0.0f;
            if (kind.mse) {
                float diff = prediction - (float)target[i];
                squares += diff * diff, d = 2.0f * per_value * diff;
            }
            if (kind.learned) {
                int64_t xi = ((int64_t)n * hw + p) * (in.x_t_ld ? in.x_t_ld : C) + c;
                BoundTerm b = bound_term(pixel_value(in.pixels[i]), (float)in.x_t[xi], prediction, (float)out[o + C], &in.terms[in.t[n]],
                                         in.t[n] == 0, kind.predict, 0);
                if (!kind.frozen_mean) d += per_bound * b.d_out;
                bound += b.value;
                d_out[o + C] = (floatX)(per_bound * b.d_v);
            }
            d_out[o] = (floatX)d;
        }
    squares = block_sum_256(squares);
    bound = block_sum_256(bound);
    float *sums = partial + 2 * ((int64_t)n * gridDim.x + blockIdx.x);
    if (threadIdx.x == 0) sums[0] = squares, sums[1] = bound;
}

// One block of 256 threads: each sample's terms from its blocks' sums, then the batch's, every sum
// in a fixed order (a later piece of the step's batch adds its sums to the earlier pieces').
__global__ void loss_final_kernel(LossOutputs l, LossInputs in, int N, int blocks, float values, LossKind kind) {
    float sums[LOSS_TERMS] = {0};  // L, mse, vb, the quarters' sums, their counts (before / N)
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        float squares = 0.0f, bound = 0.0f;
        for (int b = 0; b < blocks; b++) squares += l.partial[2 * (n * blocks + b)], bound += l.partial[2 * (n * blocks + b) + 1];
        float mse = squares / values, vb = kind.bound_scale * bound / (values * (float)M_LN2), loss = (kind.mse ? mse : 0.0f) + vb;
        float w = in.weights ? in.weights[n] : 1.0f;
        int t = in.t ? (int)in.t[n] : 0, quarter = min(4 * t / max(in.T, 1), 3);
        l.samples[2 * n] = (float)t, l.samples[2 * n + 1] = loss;
        sums[0] += w * loss, sums[1] += w * mse, sums[2] += w * vb, sums[3 + quarter] += w * loss, sums[7 + quarter] += 1.0f;
    }
    float divisor = (float)(in.step_batch ? in.step_batch : N);
    for (int k = 0; k < LOSS_TERMS; k++) {
        float total = block_sum_256(sums[k]);
        if (threadIdx.x == 0) l.terms[k] = (in.piece ? l.terms[k] : 0.0f) + (k < 3 ? total / divisor : total);
    }
}

// The loss of N samples of hw pixels of C channels (the output has 2C with a learned variance); the
// output's gradient into d_out.
static void training_loss(const LossOutputs *l, floatX *d_out, const floatX *out, const floatX *target, const LossInputs *in, int N,
                          int hw, int C, LossKind kind) {
    int blocks = loss_blocks(hw);
    loss_partial_kernel<<<dim3(blocks, N), 256, 0, gpu.stream>>>(l->partial, d_out, out, target, *in, hw, C, kind);
    loss_final_kernel<<<1, 256, 0, gpu.stream>>>(*l, *in, N, blocks, (float)hw * C, kind);
    cuda_check_launch();
}

// The noisy classifier's loss (guided-diffusion's classifier_train.py): the cross-entropy of each
// sample's K logits z against its label y, and whether y is its top logit (acc@1) or among its top
// k = min(5, K) (acc@k; the label's rank is the number of logits above its own):
//   loss_n = logsumexp(z) - z_y,   L = (1/B) sum_n loss_n,   dL/dz_j = (softmax(z)_j - [j = y]) / B
// over the step's batch of B. A warp a sample writes its gradient whole and (loss_n, acc@1_n, acc@k_n)
// into partial[n][3]; then one block adds them up in a fixed order, over the batch and per quarter
// of t (LossOutputs.terms, the classifier's layout).
__global__ void classifier_loss_kernel(float *partial, floatX *d_out, const floatX *logits, const int *labels, int N, int K,
                                       float per_sample) {
    int n = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (n >= N) return;
    const floatX *z = logits + (int64_t)n * K;
    int y = labels[n], above = 0;
    float zy = (float)z[y], m = -INFINITY, sum = 0.0f;
    for (int j = lane; j < K; j += 32) m = fmaxf(m, (float)z[j]), above += (float)z[j] > zy;
    for (int o = 16; o > 0; o /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, o)), above += __shfl_xor_sync(0xffffffff, above, o);
    for (int j = lane; j < K; j += 32) sum += expf((float)z[j] - m);
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(0xffffffff, sum, o);
    for (int j = lane; j < K; j += 32) d_out[(int64_t)n * K + j] = (floatX)((expf((float)z[j] - m) / sum - (j == y)) * per_sample);
    if (lane == 0)
        partial[3 * n] = m + logf(sum) - zy, partial[3 * n + 1] = above < 1, partial[3 * n + 2] = above < (K < 5 ? K : 5);
}

__global__ void classifier_loss_final_kernel(LossOutputs l, LossInputs in, int N) {
    float sums[LOSS_TERMS] = {0};  // L, acc@1, acc@k, the quarters' loss sums, counts, acc@1 and acc@k sums (before / N)
    for (int n = threadIdx.x; n < N; n += blockDim.x) {
        float loss = l.partial[3 * n], top1 = l.partial[3 * n + 1], topk = l.partial[3 * n + 2];
        int t = (int)in.t[n], quarter = min(4 * t / max(in.T, 1), 3);
        sums[0] += loss, sums[1] += top1, sums[2] += topk;
        sums[3 + quarter] += loss, sums[7 + quarter] += 1.0f, sums[11 + quarter] += top1, sums[15 + quarter] += topk;
    }
    float divisor = (float)(in.step_batch ? in.step_batch : N);
    for (int k = 0; k < LOSS_TERMS; k++) {
        float total = block_sum_256(sums[k]);
        if (threadIdx.x == 0) l.terms[k] = (in.piece ? l.terms[k] : 0.0f) + (k < 3 ? total / divisor : total);
    }
}

// The classifier's loss of N samples' K logits (labels and in->t on the GPU); the logits' gradient
// into d_out.
static void classifier_loss(const LossOutputs *l, floatX *d_out, const floatX *logits, const int *labels, const LossInputs *in, int N,
                            int K) {
    float per_sample = 1.0f / (float)(in->step_batch ? in->step_batch : N);
    classifier_loss_kernel<<<(N + 7) / 8, 256, 0, gpu.stream>>>(l->partial, d_out, logits, labels, N, K, per_sample);
    classifier_loss_final_kernel<<<1, 256, 0, gpu.stream>>>(*l, *in, N);
    cuda_check_launch();
}

// ----------------------------------------------------------------------------------------------
// The update: AdamW with the first EMA in its pass, the global gradient norm that decides the step
// (finite, clipped), and the EMA of the other rates.

// AdamW as PyTorch defines it, on the fp32 master weights, refreshing the compute copy:
//   g = grad * clip scale;  p -= lr wd p;  m = b1 m + (1 - b1) g;  v = b2 v + (1 - b2) g^2
//   p -= lr (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// and, in the same pass (ema not NULL), the first EMA of the weights from the new p (ema_kernel's
// update, without reading p again). A step whose loss or gradient is not finite changes nothing.

// What a training step reads and writes on the GPU besides tensors. The host fills the first part
// before the step; the step fills the second. Kept in one struct, copied in and out by the step
// itself, so that the step can be one CUDA graph replayed with new values.
typedef struct {
    int64_t step;          // the step being taken, from 1
    float lr, bias1, bias2;  // AdamW: learning rate, 1 - beta1^step, 1 - beta2^step
    float grad_clip;       // clip the global gradient norm to this (0: off)
    uint64_t noise_seed;   // draws of this step: timesteps, noise, label dropout
    int weighted_draw;     // timesteps drawn from the schedule sampler's distribution (else uniformly)
    int stop;              // this rank was asked to stop; after the step: some rank was (all stop)
    float loss, grad_norm, grad_scale;  // results: loss, norm before clipping, the scale applied
    float mse, vb;         // the loss's terms: the prediction's MSE, the variational bound's term (0 without)
    float quarter_loss[4], quarter_count[4];  // per quarter of t: the sum of the samples' weighted losses, their count
    float terms[LOSS_TERMS];  // the loss's terms as LossOutputs.terms holds them (a classifier's log reads them)
    int finite;            // loss and gradients finite: parameters and EMA updated (in the next step: trainer_plan_update)
} StepState;

// One parameter's update (the math above), in place.
__device__ inline void adamw_update(float *p, float *m, float *v, float g, float lr, float bias1, float bias2, float beta1,
                                    float beta2, float eps, float weight_decay) {
    float q = *p * (1.0f - lr * weight_decay);
    float mi = beta1 * *m + (1.0f - beta1) * g, vi = beta2 * *v + (1.0f - beta2) * g * g;
    q -= lr * (mi / bias1) / (sqrtf(vi / bias2) + eps);
    *m = mi, *v = vi, *p = q;
}

// Four parameters a thread per iteration: 16-byte loads and stores (the compute copy's 4 values in
// one store). The update is bound by memory, 38 bytes a parameter with the EMA: one parameter a
// thread moved 3.3 TB/s on an H200, four 4.0 (dev/NOTES.md v). The last n % 4 one at a time.
typedef struct __align__(4 * sizeof(floatX)) {
    floatX v[4];
} FloatX4;

__global__ void adamw_kernel(float *params, floatX *params_x, float *m, float *v, const float *grads, int64_t n,
                             const StepState *s, float beta1, float beta2, float eps, float weight_decay, float *ema,
                             float ema_rate) {
    if (!s->finite) return;
    float lr = s->lr, bias1 = s->bias1, bias2 = s->bias2, scale = s->grad_scale;
    int64_t first = blockIdx.x * (int64_t)blockDim.x + threadIdx.x, stride = (int64_t)gridDim.x * blockDim.x;
    for (int64_t i = first; i < n / 4; i += stride) {
        float4 g = ((const float4 *)grads)[i], p = ((float4 *)params)[i], mi = ((float4 *)m)[i], vi = ((float4 *)v)[i];
        adamw_update(&p.x, &mi.x, &vi.x, g.x * scale, lr, bias1, bias2, beta1, beta2, eps, weight_decay);
        adamw_update(&p.y, &mi.y, &vi.y, g.y * scale, lr, bias1, bias2, beta1, beta2, eps, weight_decay);
        adamw_update(&p.z, &mi.z, &vi.z, g.z * scale, lr, bias1, bias2, beta1, beta2, eps, weight_decay);
        adamw_update(&p.w, &mi.w, &vi.w, g.w * scale, lr, bias1, bias2, beta1, beta2, eps, weight_decay);
        ((float4 *)params)[i] = p, ((float4 *)m)[i] = mi, ((float4 *)v)[i] = vi;
        if (params_x) {
            FloatX4 c = {{(floatX)p.x, (floatX)p.y, (floatX)p.z, (floatX)p.w}};
            ((FloatX4 *)params_x)[i] = c;
        }
        if (ema) {
            float4 e = ((float4 *)ema)[i];
            e.x = ema_rate * e.x + (1.0f - ema_rate) * p.x, e.y = ema_rate * e.y + (1.0f - ema_rate) * p.y;
            e.z = ema_rate * e.z + (1.0f - ema_rate) * p.z, e.w = ema_rate * e.w + (1.0f - ema_rate) * p.w;
            ((float4 *)ema)[i] = e;
        }
    }
    for (int64_t i = n / 4 * 4 + first; i < n; i += stride) {
        adamw_update(&params[i], &m[i], &v[i], grads[i] * scale, lr, bias1, bias2, beta1, beta2, eps, weight_decay);
        if (params_x) params_x[i] = (floatX)params[i];
        if (ema) ema[i] = ema_rate * ema[i] + (1.0f - ema_rate) * params[i];
    }
}

// AdamW's step over n parameters (every array 16-byte aligned, as gpu_malloc's and the parameter
// storage's are), with the first EMA (ema not NULL) and the compute copy (params_x not NULL).
static void adamw_step(float *params, floatX *params_x, float *m, float *v, const float *grads, int64_t n, const StepState *s,
                       float beta1, float beta2, float eps, float weight_decay, float *ema, float ema_rate) {
    adamw_kernel<<<blocks_for((size_t)(n + 3) / 4, 256), 256, 0, gpu.stream>>>(params, params_x, m, v, grads, n, s, beta1, beta2,
                                                                            eps, weight_decay, ema, ema_rate);
    cuda_check_launch();
}

// The global gradient norm, in two fixed-order passes: sums of squares per block, then the total;
// the second pass also decides the step: finite (loss and norm) and the clipping scale.
#define NORM_BLOCKS 1024

__global__ void grad_norm_partial_kernel(double *partial, const float *grads, int64_t n) {
    double s = 0;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        s += (double)grads[i] * grads[i];
    s = block_sum_256(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

// terms: the loss's (LossOutputs.terms), averaged over the ranks.
__global__ void step_decide_kernel(StepState *s, const double *partial, const float *terms) {
    __shared__ double sums[NORM_BLOCKS];
    for (int i = threadIdx.x; i < NORM_BLOCKS; i += blockDim.x) sums[i] = partial[i];
    __syncthreads();
    for (int stride = NORM_BLOCKS / 2; stride > 0; stride /= 2) {
        for (int i = threadIdx.x; i < stride; i += blockDim.x) sums[i] += sums[i + stride];
        __syncthreads();
    }
    if (threadIdx.x == 0) {
        float norm = (float)sqrt(sums[0]);
        s->loss = terms[0], s->mse = terms[1], s->vb = terms[2];
        for (int q = 0; q < 4; q++) s->quarter_loss[q] = terms[3 + q], s->quarter_count[q] = terms[7 + q];
        for (int k = 0; k < LOSS_TERMS; k++) s->terms[k] = terms[k];
        s->grad_norm = norm;
        s->finite = isfinite(norm) && isfinite(terms[0]);
        s->grad_scale = s->grad_clip > 0.0f && norm > s->grad_clip ? s->grad_clip / (norm + 1e-6f) : 1.0f;
    }
}

// EMA of the weights, guided-diffusion's update_ema: ema = rate ema + (1 - rate) params.
__global__ void ema_kernel(float *ema, const float *params, int64_t n, float rate, const StepState *s) {
    if (!s->finite) return;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        ema[i] = rate * ema[i] + (1.0f - rate) * params[i];
}

// ----------------------------------------------------------------------------------------------
// Diffusion's per-value kernels: the model's input from pixels, the training draws (timesteps, labels
// dropped for guidance), x_t = q_sample(x0, t, eps) with the regression target, a sampling step of
// sampler.h's plan, and the likelihood's terms. Their callers are with diffusion training, sampling
// and the likelihood below.

__global__ void images_to_model_input_kernel(floatX *out, const uint8_t *pixels, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        out[i] = pixel_to_model_input(pixels[i]);
}

static void images_to_model_input(floatX *out, const uint8_t *pixels, size_t n, cudaStream_t stream) {
    int threads = 256, blocks = (int)((n + threads - 1) / threads);
    if (blocks > 65535) blocks = 65535;
    images_to_model_input_kernel<<<blocks, threads, 0, stream>>>(out, pixels, n);
    cuda_check_launch();
}

// The draws are numbered by sample in the step's batch on all GPUs (first_sample: this GPU's first),
// so that N GPUs at batch B draw what one GPU at batch N B draws.

// Classifier-free guidance's label dropout: sample n's label (its draw `draw`) replaced by the null
// class with probability cfg_dropout.
__device__ inline void drop_label(int *labels, int n, uint64_t draw, float cfg_dropout, int null_label, const StepState *s) {
    if (cfg_dropout > 0.0f && (random_u64(s->noise_seed, rng_stream(RNG_LABEL_DROP, 0), draw) >> 40) * (1.0f / 16777216.0f) < cfg_dropout)
        labels[n] = null_label;
}

// Timesteps t ~ U[0, T), each sample's loss weight 1, or with the schedule sampler's distribution
// (s->weighted_draw) t ~ p (the first t whose cumulative probability exceeds a uniform draw) and the
// weight 1 / (T p_t); for classifier-free guidance, labels replaced by the null class with
// probability cfg_dropout.
__global__ void diffusion_conditions_kernel(int64_t *t, float *weights, int *labels, int N, int64_t first_sample, int T,
                                            const double *distribution, float cfg_dropout, int null_label, const StepState *s) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    uint64_t draw = (uint64_t)(first_sample + n), r = random_u64(s->noise_seed, rng_stream(RNG_TIMESTEP, 0), draw);
    if (s->weighted_draw) {
        const double *p = distribution, *cdf = distribution + T;
        double u = (double)(r >> 11) * 0x1p-53 * cdf[T - 1];
        int lo = 0, hi = T - 1;
        while (lo < hi) {
            int mid = (lo + hi) / 2;
            if (cdf[mid] > u) hi = mid;
            else lo = mid + 1;
        }
        t[n] = lo, weights[n] = (float)(1.0 / (T * p[lo]));
    } else {
        t[n] = (int64_t)(r % (uint64_t)T), weights[n] = 1.0f;
    }
    drop_label(labels, n, draw, cfg_dropout, null_label, s);
}

// EDM's draws (sampler.h's EDM block): ln sigma = p_mean + p_std z, z ~ N(0, 1) from the timesteps'
// stream, the model's timestep input c_noise = ln(sigma) / 4 (time), each sample's weight 1, t the
// quarter of z's distribution it fell in (0: the least noisy, z < -0.674; the log's loss quarters,
// LossInputs.T = 4), and the labels dropped as above.
__global__ void edm_conditions_kernel(int64_t *t, float *time, float *sigma, float *weights, int *labels, int N, int64_t first_sample,
                                      float p_mean, float p_std, float cfg_dropout, int null_label, const StepState *s) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= N) return;
    uint64_t draw = (uint64_t)(first_sample + n);
    float z = normal_sample(s->noise_seed, rng_stream(RNG_TIMESTEP, 0), draw), log_sigma = p_mean + p_std * z;
    sigma[n] = expf(log_sigma), time[n] = 0.25f * log_sigma, weights[n] = 1.0f;
    t[n] = (z >= -0.6744898f) + (z >= 0.0f) + (z >= 0.6744898f);
    drop_label(labels, n, draw, cfg_dropout, null_label, s);
}

// x_t and the regression target from x0 (all [N][per_sample] of C channels; target NULL: x_t only, for a
// classifier). x_t's pixels are ld values apart (ld = C, or an upsampler's input of 2C: x_t first).
__global__ void diffusion_inputs_kernel(floatX *x_t, int C, int ld, floatX *target, const floatX *x0, const int64_t *t,
                                        const TimestepTerms *terms, int predict, int64_t per_sample, int64_t n, int64_t first_sample,
                                        const StepState *s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        const TimestepTerms *tt = &terms[t[i / per_sample]];
        float a = tt->sqrt_abar, b = tt->sqrt_one_minus_abar;
        float eps = normal_sample(s->noise_seed, rng_stream(RNG_NOISE, 0), first_sample * per_sample + i);
        float x = (float)x0[i];
        x_t[i / C * ld + i % C] = (floatX)(a * x + b * eps);
        if (target) target[i] = (floatX)(predict == PREDICT_V ? a * eps - b * x : predict == PREDICT_X0 ? x : eps);
    }
}

// EDM's training input and target (edm_training_pair) from x0 at each sample's sigma, the noise drawn
// as diffusion_inputs_kernel draws it (the same layouts).
__global__ void edm_inputs_kernel(floatX *x_t, int C, int ld, floatX *target, const floatX *x0, const float *sigma, float sigma_data,
                                  int64_t per_sample, int64_t n, int64_t first_sample, const StepState *s) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float eps = normal_sample(s->noise_seed, rng_stream(RNG_NOISE, 0), first_sample * per_sample + i), input, goal;
        edm_training_pair((float)x0[i], eps, sigma[i / per_sample], sigma_data, &input, &goal);
        x_t[i / C * ld + i % C] = (floatX)input, target[i] = (floatX)goal;
    }
}

typedef struct {
    int step;        // the plan's next step
    int64_t offset;  // the batch's first value: first image * values per image
} SampleCursor;

// The starting noise: scale (the plan's start_scale) times unit normal draws.
__global__ void sample_start_kernel(float *x, int64_t n, uint64_t seed, float scale, const SampleCursor *c) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        x[i] = scale * normal_sample(seed, rng_stream(RNG_SAMPLE_START, 0), c->offset + i);
}

// A step's inputs: x (n values of C channels) as the model's input, times the step's input_scale
// (both halves when guided; its pixels ld values apart: an upsampler's hold the low-resolution
// image's channels after x's) and the classifier's (when given), and the step's timestep for every
// image of either batch (n is more than both), and its continuous time (time not NULL: an EDM model).
__global__ void sample_inputs_kernel(floatX *input, int C, int ld, int64_t *t, float *time, int batch, floatX *classifier_input,
                                     int64_t *classifier_t, int classifier_batch, const float *x, int64_t n, int guided,
                                     const SampleStep *steps, const SampleCursor *c) {
    int timestep = steps[c->step].timestep;
    float step_time = steps[c->step].time, scale = steps[c->step].input_scale;
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        floatX v = (floatX)(x[i] * scale);
        int64_t at = i / C * ld + i % C;
        input[at] = v;
        if (guided) input[n / C * ld + at] = v;
        if (classifier_input) classifier_input[i] = (floatX)x[i];
        if (i < batch) t[i] = timestep;
        if (i < batch && time) time[i] = step_time;
        if (i < classifier_batch) classifier_t[i] = timestep;
    }
}

// One step of the plan for every value, from the model's output (guided: uncond + w (cond -
// uncond), the second half being the unconditional) and classifier guidance's score (NULL: none);
// x is written. x has C channels; the output has C (the prediction) or, with a learned variance,
// 2C: then a value's variance is the conditional output's (as GLIDE's guided sampling keeps it).
__global__ void sample_step_kernel(float *x, SampleMemory *memory, const floatX *out, const floatX *score, int64_t n, int C, int out_channels,
                                   int guided, float guidance, SamplePlan plan, const SampleStep *steps, const SampleCursor *c,
                                   uint64_t seed) {
    const SampleStep st = steps[c->step];
    int64_t n_out = n / C * out_channels;  // the unconditional half's offset
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        int64_t j = i / C * out_channels + i % C;
        float o = guided ? guided_output((float)out[j], (float)out[n_out + j], guidance) : (float)out[j];
        float v = plan.learned ? (float)out[j + C] : 0.0f, g = score ? (float)score[i] : 0.0f;
        float z = st.noisy ? normal_sample(seed, rng_stream(RNG_SAMPLE_NOISE, (uint64_t)c->step), c->offset + i) : 0.0f;
        x[i] = sample_step_value(&plan, &st, x[i], o, v, g, z, &memory[i]);
    }
}

__global__ void sample_advance_kernel(SampleCursor *c) { c->step++; }

__global__ void to_pixels_kernel(uint8_t *pixels, const float *x, int64_t n) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x)
        pixels[i] = pixel_from_value(x[i]);
}

__global__ void likelihood_inputs_kernel(float *x0, float *x_t, floatX *input, int64_t *t, const uint8_t *pixels, int64_t n,
                                         int batch, int timestep, TimestepTerms tt, int k, uint64_t seed, int64_t first_value) {
    for (int64_t i = blockIdx.x * (int64_t)blockDim.x + threadIdx.x; i < n; i += (int64_t)gridDim.x * blockDim.x) {
        float x = pixel_value(pixels[i]);
        float x_k = tt.sqrt_abar * x + tt.sqrt_one_minus_abar * normal_sample(seed, rng_stream(RNG_NLL, (uint64_t)k), first_value + i);
        x0[i] = x, x_t[i] = x_k, input[i] = (floatX)x_k;
        if (i < batch) t[i] = timestep;
    }
}

// Blocks (x) of an image (y): the bound's terms of its values, summed into partial[n][block]. The
// variance (a VarianceType) is the output's second half when learned; a fixed one is an end of the
// learned range: the large v = 1 (log beta_t; at t = 0 log beta_tilde_1, v = -1), the small v = -1.
__global__ void likelihood_terms_kernel(float *partial, const floatX *out, const float *x0, const float *x_t, TimestepTerms tt,
                                        int first_step, int hw, int C, int out_channels, int predict, int variance) {
    int n = blockIdx.y;
    float sum = 0.0f;
    for (int p = blockIdx.x * blockDim.x + threadIdx.x; p < hw; p += gridDim.x * blockDim.x)
        for (int c = 0; c < C; c++) {
            int64_t i = ((int64_t)n * hw + p) * C + c, o = ((int64_t)n * hw + p) * out_channels + c;
            float v = variance == VARIANCE_LEARNED_RANGE                 ? (float)out[o + C]
                    : variance == VARIANCE_FIXED_LARGE && !first_step ? 1.0f
                                                                      : -1.0f;
            sum += bound_term(x0[i], x_t[i], (float)out[o], v, &tt, first_step, predict, 1).value;
        }
    sum = block_sum_256(sum);
    if (threadIdx.x == 0) partial[(int64_t)n * gridDim.x + blockIdx.x] = sum;
}

__global__ void likelihood_add_kernel(double *bits, const float *partial, int batch, int blocks, double per_value) {
    int n = blockIdx.x * blockDim.x + threadIdx.x;
    if (n >= batch) return;
    double s = 0;
    for (int b = 0; b < blocks; b++) s += partial[(int64_t)n * blocks + b];
    bits[n] += s * per_value;
}

// ----------------------------------------------------------------------------------------------
// Blocks: guided-diffusion's modules, each a struct with its parameters and the activations its
// backward needs, and its forward and backward side by side. forward reads `in` and writes `out`;
// backward reads out->dx and delivers in->dx: its first write to it in `in_grad` mode (written,
// unless a block later in the model, earlier in backward, wrote it first: the concatenation that
// reads a skip tensor, or the ResBlock that reads that concatenation in place), its later ones
// added. A gradient inside a block has one producer, which writes it. No block's gradient is
// zeroed first.

// An activation and its gradient, NHWC. Where a GroupNorm reads x (plan_gathered_sums), x's producer
// gathers x's channel sums for it as it stores x, into `sums`, and says in sum_slots, at every
// forward, how many slots a sample they have (0: none; conv_forward_act). In backward the same
// GroupNorm, the last to write dx, leaves dx's partial channel sums in dx_sums for the bias gradient
// of x's producer (plan_gradient_sums; act_dx_sums reads them): sums over the GroupNorm's whole
// input, dx_sums_ld channels a row, of which x's C come first (more than C when x is the first part
// of a concatenation).
typedef struct Act {
    floatX *x, *dx;
    int N, H, W, C;
    double *sums;  // NULL: nobody needs them
    int64_t sums_numel;
    int sum_slots;
    struct Act *upsampled_from;  // x is this one's nearest 2x upsampling: its sums stand for x's
    float *dx_sums;              // [N][dx_sum_chunks][dx_sums_ld]; NULL: the bias gradient takes a pass of its own
    int dx_sum_chunks, dx_sums_ld;
} Act;

static int64_t act_numel(const Act *a) { return (int64_t)a->N * a->H * a->W * a->C; }

// out->x = conv(x) + b (+ residual), gathering out's channel sums where the plan wants them.
static void conv_forward_act(const Conv *cv, Act *out, const floatX *x, int N, int H, int W, const floatX *residual) {
    out->sum_slots = conv_forward_gathering(cv, out->x, x, N, H, W, residual, out->sums, out->sums_numel);
}

// The channel sums gathered for a GroupNorm reading a (none: slots 0); a nearest 2x upsampling's are
// its source's, each source pixel standing for 4 of a's.
static GatheredSums act_sums(const Act *a) {
    if (a->upsampled_from) return {a->upsampled_from->sums, a->upsampled_from->sum_slots, 4};
    return {a->sums, a->sum_slots, 1};
}

static const GatheredSums NO_SUMS = {NULL, 0, 1};

// The channel sums of a->dx that its last writer left (in `given`), or NULL.
static const ChannelSumsGiven *act_dx_sums(const Act *a, ChannelSumsGiven *given) {
    if (!a->dx_sums) return NULL;
    *given = {a->dx_sums, a->dx_sum_chunks, a->dx_sums_ld};
    return given;
}

// What the ResBlocks read besides their input: every block's timestep projection side by side
// (one matrix product computes them all, one their gradients), and dropout's seed for the step.
typedef struct {
    float *out, *d_out;  // [N][total] fp32: emb_layers(emb) of every ResBlock, and its gradient
    int total;
    int scale_shift;     // use_scale_shift_norm: each block's columns are (scale, shift), else one add
    float dropout;
    const uint64_t *dropout_seed;  // on the GPU (a training step is a replayed graph)
    int64_t first_sample;          // this GPU's first sample in the step's batch on all GPUs (dropout's numbering)
} BlockEmbedding;

// input_blocks.0: a 3x3 convolution of the image.
typedef struct {
    Conv conv;
} ConvBlock;

static void conv_block_forward(ConvBlock *b, const Act *in, Act *out) {
    conv_forward_act(&b->conv, out, in->x, in->N, in->H, in->W, NULL);
}

// input_gradient 0: no in->dx (the model's input, whose gradient training never reads).
static void conv_block_backward(ConvBlock *b, const Act *in, const Act *out, GradMode in_grad, int input_gradient) {
    ChannelSumsGiven given;
    conv_backward(&b->conv, input_gradient ? in->dx : NULL, in_grad, out->dx, in->x, in->N, in->H, in->W, NULL, 0, act_dx_sums(out, &given));
}

// A 1x1 convolution of a concatenation [a | b] read in place (a.C + b.C = cv->in): with Wa, Wb the
// weight's first a.C and last b.C columns,  y = a Wa^T + b Wb^T + bias;  backward dWa = dy^T a,
// dWb = dy^T b, and the parts' gradients a.dx (+)= dy Wa, b.dx (+)= dy Wb (each in its own mode). The
// bias gradient, the sum of dy, is the caller's (a ResBlock's conv2 adds into the same output).
static void conv1x1_forward_concat(const Conv *cv, floatX *y, const Act *a, const Act *b) {
    int M = a->N * a->H * a->W;
    matmul({.M = M, .N = cv->out, .K = a->C, .a = a->x, .lda = a->C, .b = cv->w, .ldb = cv->in, .trans_b = 1, .d = y,
            .ldd = cv->out, .bias = cv->b});
    matmul({.M = M, .N = cv->out, .K = b->C, .a = b->x, .lda = b->C, .b = cv->w + a->C, .ldb = cv->in, .trans_b = 1, .d = y,
            .ldd = cv->out, .c = y, .ldc = cv->out, .beta = 1.0f});
}

static void conv1x1_backward_concat(const Conv *cv, const floatX *dy, const Act *a, GradMode a_mode, const Act *b,
                                    GradMode b_mode) {
    int M = a->N * a->H * a->W;
    weight_gradient(cv->scratch, cv->dw, cv->in, dy, a->x, M, cv->out, a->C);
    weight_gradient(cv->scratch, cv->dw + a->C, cv->in, dy, b->x, M, cv->out, b->C);
    matmul({.M = M, .N = a->C, .K = cv->out, .a = dy, .lda = cv->out, .b = cv->w, .ldb = cv->in, .d = a->dx, .ldd = a->C,
            .c = a_mode == GRAD_ADD ? a->dx : NULL, .ldc = a->C, .beta = 1.0f});
    matmul({.M = M, .N = b->C, .K = cv->out, .a = dy, .lda = cv->out, .b = cv->w + a->C, .ldb = cv->in, .d = b->dx,
            .ldd = b->C, .c = b_mode == GRAD_ADD ? b->dx : NULL, .ldc = b->C, .beta = 1.0f});
}

// The skip connection before each output block: out = [in | skip] along channels; backward
// splits out->dx back into both. Read in place (in_place): the ResBlock after it, which has a skip
// convolution, reads in and skip where they are (ResBlock.cat_a, cat_b) and delivers their gradients
// itself; the concatenation then has no memory and no work (the copy and the split cost 1.1 ms of a
// seed:128 step, dev/NOTES.md).
typedef struct {
    Act *skip;          // an encoder block's output
    GradMode skip_grad; // how backward delivers skip->dx (as Block.in_grad for in->dx)
    int in_place;
} ConcatBlock;

static void concat_block_forward(ConcatBlock *b, const Act *in, Act *out) {
    if (!b->in_place) concat_channels(out->x, in->x, b->skip->x, (int64_t)in->N * in->H * in->W, in->C, b->skip->C);
}

static void concat_block_backward(ConcatBlock *b, const Act *in, const Act *out, GradMode in_grad) {
    if (!b->in_place)
        split_channels(in->dx, in_grad, b->skip->dx, b->skip_grad, out->dx, (int64_t)in->N * in->H * in->W, in->C, b->skip->C);
}

// guided-diffusion's ResBlock:
//   h0 = SiLU(GroupNorm1(x)); [resampled: h0r, and x as xr]; h1 = conv1(h0)    (in_layers)
//   h2 = dropout(SiLU(GroupNorm2(h1) + e)), or with scale-shift
//        dropout(SiLU(GroupNorm2(h1) (1 + scale) + shift))                      (out_layers, emb_layers)
//   out = conv2(h2) + skip(x), skip a 1x1 conv when the channel count changes (skip_connection)
// Training keeps conv1's input (h0, or h0r when resampling) for its weight gradient: recomputing h0
// in a GroupNorm pass of its own cost ~1 ms of a seed:128 step (H100, dev/NOTES.md (f)),
// for memory we have (the step stays below PyTorch's peak). h2 is not kept: GroupNorm 2's backward
// recomputes it from h1 and the statistics, the same values bit for bit.
typedef struct {
    Norm norm1, norm2;
    Conv conv1, conv2, conv3;  // in_layers.2, out_layers.3, skip_connection
    int has_skip_conv;
    int resample;              // -1 down, +1 up, 0 none
    int emb_offset;            // its columns in BlockEmbedding
    uint64_t dropout_stream;
    Act h0, h0r, xr, h1, h2;
    float *mean1, *rstd1, *mean2, *rstd2;
    // Its input a concatenation read in place (ConcatBlock.in_place), [cat_a | cat_b], when cat_a is
    // not NULL; backward delivers their gradients in the concatenation's modes.
    Act *cat_a, *cat_b;
    GradMode cat_a_grad, cat_b_grad;
} ResBlock;

// out_layers' GroupNorm options: the timestep embedding as an add or a scale-shift, SiLU, dropout.
static NormOptions res_block_norm2(const ResBlock *r, const BlockEmbedding *e, int training) {
    NormOptions o = {0};
    o.silu = 1;
    if (e->scale_shift) o.scale_shift = e->out + r->emb_offset, o.scale_shift_ld = e->total;
    else o.add = e->out + r->emb_offset, o.add_ld = e->total;
    if (training && e->dropout > 0.0f) {
        o.dropout = e->dropout, o.dropout_seed = e->dropout_seed, o.dropout_stream = r->dropout_stream;
        o.dropout_first = e->first_sample * r->h2.H * r->h2.W * r->h2.C;
    }
    return o;
}

static const NormOptions NORM_SILU = {NULL, 0, NULL, 0, 1, 0.0f, NULL, 0, 0, NULL, NULL, 0};
static const NormOptions NORM_PLAIN = {NULL, 0, NULL, 0, 0, 0.0f, NULL, 0, 0, NULL, NULL, 0};

// in_layers' GroupNorm options, for an input in in, or in the concatenation's parts read in place:
// then x, dx name the first part and the options the second.
static NormOptions res_block_norm1(const ResBlock *r) {
    NormOptions o = NORM_SILU;
    if (r->cat_a) o.x2 = r->cat_b->x, o.dx2 = r->cat_b->dx, o.C1 = r->cat_a->C;
    return o;
}

static void res_block_forward(ResBlock *r, const BlockEmbedding *e, const Act *in, Act *out, int training) {
    int N = in->N, H = in->H, W = in->W, Ho = out->H, Wo = out->W;
    const floatX *x = r->cat_a ? r->cat_a->x : in->x;
    group_norm_forward(&r->norm1, r->h0.x, r->mean1, r->rstd1, x, N, H * W, res_block_norm1(r), act_sums(r->cat_a ? r->cat_a : in),
                       r->cat_a ? act_sums(r->cat_b) : NO_SUMS);
    const floatX *h = r->h0.x, *skip = in->x;
    if (r->resample) {
        resample_forward(r->resample > 0, r->h0r.x, r->h0.x, N, H, W, in->C);
        resample_forward(r->resample > 0, r->xr.x, in->x, N, H, W, in->C);
        h = r->h0r.x, skip = r->xr.x;
    }
    conv_forward_act(&r->conv1, &r->h1, h, N, Ho, Wo, NULL);
    group_norm_forward(&r->norm2, r->h2.x, r->mean2, r->rstd2, r->h1.x, N, Ho * Wo, res_block_norm2(r, e, training),
                       act_sums(&r->h1), NO_SUMS);
    if (r->cat_a) conv1x1_forward_concat(&r->conv3, out->x, r->cat_a, r->cat_b);
    else if (r->has_skip_conv) conv_forward(&r->conv3, out->x, skip, N, Ho, Wo, NULL);
    if (r->has_skip_conv) skip = out->x;
    conv_forward_act(&r->conv2, out, r->h2.x, N, Ho, Wo, skip);
}

// --use_checkpoint (TRAINING_RECOMPUTE): the inner activations that backward reads (h0 or h0r, xr,
// h1), made again from the input just before backward, as forward made them: the same kernels on
// the same values, so the same bits (GroupNorm 1 applies the statistics forward kept).
static void res_block_recompute(ResBlock *r, const Act *in, const Act *out) {
    int N = in->N, H = in->H, W = in->W;
    group_norm_recompute(&r->norm1, r->h0.x, r->mean1, r->rstd1, r->cat_a ? r->cat_a->x : in->x, N, H * W, res_block_norm1(r));
    if (r->resample) {
        resample_forward(r->resample > 0, r->h0r.x, r->h0.x, N, H, W, in->C);
        resample_forward(r->resample > 0, r->xr.x, in->x, N, H, W, in->C);
    }
    conv_forward(&r->conv1, r->h1.x, r->resample ? r->h0r.x : r->h0.x, N, out->H, out->W, NULL);
}

static void res_block_backward(ResBlock *r, const BlockEmbedding *e, const Act *in, const Act *out, GradMode in_grad,
                               int training) {
    int N = in->N, H = in->H, W = in->W, Ho = out->H, Wo = out->W;
    const floatX *h = r->resample ? r->h0r.x : r->h0.x, *skip = r->resample ? r->xr.x : in->x;
    floatX *dh = r->resample ? r->h0r.dx : r->h0.dx, *dskip = r->resample ? r->xr.dx : in->dx;
    GradMode skip_mode = r->resample ? GRAD_WRITE : in_grad;  // xr is the block's own
    conv_backward_input(&r->conv2, r->h2.dx, GRAD_WRITE, out->dx, N, Ho, Wo);
    // The skip convolution adds into conv2's output: its bias gradient is conv2's, copied below.
    // An identity skip's gradient is out->dx itself: GroupNorm 1's backward adds it to dx (or, resampled,
    // resample_backward reads it there).
    const bool identity = !r->cat_a && !r->has_skip_conv;
    if (r->cat_a) conv1x1_backward_concat(&r->conv3, out->dx, r->cat_a, r->cat_a_grad, r->cat_b, r->cat_b_grad);
    else if (r->has_skip_conv) {
        weight_gradient(r->conv3.scratch, r->conv3.dw, r->conv3.in, out->dx, skip, N * Ho * Wo, r->conv3.out, r->conv3.in);
        conv_backward_input(&r->conv3, dskip, skip_mode, out->dx, N, Ho, Wo);
    }
    // GroupNorm 2's backward recomputes h2 for conv2's weight gradient, which then runs beside conv1's
    // backward.
    float *d_emb = e->d_out ? e->d_out + r->emb_offset : NULL;  // (none without parameter gradients)
    // It also leaves the channel sums of h1.dx for conv1's bias gradient.
    float *h1_sums = r->conv1.dw ? r->norm2.scratch->gn_dx_sums : NULL;
    group_norm_backward(&r->norm2, r->h1.dx, GRAD_WRITE, NULL, h1_sums, d_emb, r->h2.dx, r->h1.x, r->h2.x, r->mean2, r->rstd2, N, Ho * Wo,
                        res_block_norm2(r, e, training));
    ChannelSumsGiven out_given, h1_given = gn_dx_sums_given(h1_sums, N, Ho * Wo, r->conv1.out);
    conv_backward_params_side(&r->conv2, out->dx, r->h2.x, N, Ho, Wo, NULL, 0, act_dx_sums(out, &out_given));
    if (r->has_skip_conv && r->conv3.db) {
        side_begin();
        cuda_check(cudaMemcpyAsync(r->conv3.db, r->conv2.db, r->conv2.out * sizeof(float), cudaMemcpyDeviceToDevice, gpu.stream));
        side_end();
    }
    float *d_add = e->scale_shift ? NULL : d_emb;
    const floatX *x = r->cat_a ? r->cat_a->x : in->x;
    floatX *dx = r->cat_a ? r->cat_a->dx : in->dx;
    NormOptions o1 = res_block_norm1(r);
    // conv1's parameter gradients (side stream) run beside its input gradient and on beside GroupNorm
    // 1's backward, whose end joins them: nothing until then writes what they read (h1.dx, h).
    conv_backward_params_side(&r->conv1, r->h1.dx, h, N, Ho, Wo, d_add, e->total, &h1_given);
    conv_backward_input(&r->conv1, dh, GRAD_WRITE, r->h1.dx, N, Ho, Wo);
    if (r->resample) {
        resample_backward(r->resample > 0, r->h0.dx, GRAD_WRITE, r->h0r.dx, N, H, W, in->C);
        resample_backward(r->resample > 0, in->dx, in_grad, identity ? out->dx : r->xr.dx, N, H, W, in->C);
    }
    const bool skip_here = identity && !r->resample;  // (else dx already holds the skip's gradient)
    group_norm_backward(&r->norm1, dx, skip_here ? in_grad : GRAD_ADD, skip_here ? out->dx : NULL, r->cat_a ? r->cat_a->dx_sums : in->dx_sums,
                        NULL, r->h0.dx, x, NULL, r->mean1, r->rstd1, N, H * W, o1);
}

// guided-diffusion's AttentionBlock: h0 = GroupNorm(x), h1 = qkv(h0) (1x1 conv1d to 3C),
// h2 = attention(h1), out = proj_out(h2) + x (proj_out zero-initialised). Backward recomputes h0.
typedef struct {
    Norm norm;
    Conv qkv, proj;
    Act h0, h1, h2;
    float *mean, *rstd;
    Attention attention;  // reads h1, writes h2
} AttentionBlock;

static void attention_block_forward(AttentionBlock *a, const Act *in, Act *out) {
    int N = in->N, H = in->H, W = in->W;
    group_norm_forward(&a->norm, a->h0.x, a->mean, a->rstd, in->x, N, H * W, NORM_PLAIN, act_sums(in), NO_SUMS);
    conv_forward(&a->qkv, a->h1.x, a->h0.x, N, H, W, NULL);
    attention_forward(&a->attention);
    conv_forward(&a->proj, out->x, a->h2.x, N, H, W, in->x);
}

// --use_checkpoint: h1 and h2 (and the attention's saved values) again, before backward.
static void attention_block_recompute(AttentionBlock *a, const Act *in) {
    int N = in->N, H = in->H, W = in->W;
    group_norm_recompute(&a->norm, a->h0.x, a->mean, a->rstd, in->x, N, H * W, NORM_PLAIN);
    conv_forward(&a->qkv, a->h1.x, a->h0.x, N, H, W, NULL);
    attention_forward(&a->attention);
}

static void attention_block_backward(AttentionBlock *a, const Act *in, const Act *out, GradMode in_grad) {
    int N = in->N, H = in->H, W = in->W;
    ChannelSumsGiven given;
    conv_backward(&a->proj, a->h2.dx, GRAD_WRITE, out->dx, a->h2.x, N, H, W, NULL, 0, act_dx_sums(out, &given));
    attention_backward(&a->attention);
    group_norm_recompute(&a->norm, a->h0.x, a->mean, a->rstd, in->x, N, H * W, NORM_PLAIN);
    conv_backward(&a->qkv, a->h0.dx, GRAD_WRITE, a->h1.dx, a->h0.x, N, H, W, NULL, 0, NULL);
    group_norm_backward(&a->norm, in->dx, in_grad, out->dx, in->dx_sums, NULL, a->h0.dx, in->x, NULL, a->mean, a->rstd, N, H * W,
                        NORM_PLAIN);
}

// guided-diffusion's Downsample: a stride-2 3x3 conv (conv_resample), else 2x2 average pooling.
typedef struct {
    Conv conv;
    int has_conv;
} Downsample;

static void downsample_forward(Downsample *d, const Act *in, Act *out) {
    if (d->has_conv) conv_forward_act(&d->conv, out, in->x, in->N, in->H, in->W, NULL);
    else resample_forward(0, out->x, in->x, in->N, in->H, in->W, in->C);
}

static void downsample_backward(Downsample *d, const Act *in, const Act *out, GradMode in_grad) {
    ChannelSumsGiven given;
    if (d->has_conv) conv_backward(&d->conv, in->dx, in_grad, out->dx, in->x, in->N, in->H, in->W, NULL, 0, act_dx_sums(out, &given));
    else resample_backward(0, in->dx, in_grad, out->dx, in->N, in->H, in->W, in->C);
}

// guided-diffusion's Upsample: nearest 2x (into `up`, which backward recomputes), then a 3x3 conv
// when conv_resample.
typedef struct {
    Conv conv;
    int has_conv;
    Act up;
} Upsample;

static void upsample_forward(Upsample *u, const Act *in, Act *out) {
    resample_forward(1, u->has_conv ? u->up.x : out->x, in->x, in->N, in->H, in->W, in->C);
    if (u->has_conv) conv_forward_act(&u->conv, out, u->up.x, in->N, 2 * in->H, 2 * in->W, NULL);
}

static void upsample_backward(Upsample *u, const Act *in, const Act *out, GradMode in_grad) {
    if (u->has_conv) {
        resample_forward(1, u->up.x, in->x, in->N, in->H, in->W, in->C);
        ChannelSumsGiven given;
        conv_backward(&u->conv, u->up.dx, GRAD_WRITE, out->dx, u->up.x, in->N, 2 * in->H, 2 * in->W, NULL, 0, act_dx_sums(out, &given));
    }
    resample_backward(1, in->dx, in_grad, u->has_conv ? u->up.dx : out->dx, in->N, in->H, in->W, in->C);
}

// The output head (out): h0 = SiLU(GroupNorm(x)), out = conv(h0) (zero-initialised); backward
// recomputes h0.
typedef struct {
    Norm norm;
    Conv conv;
    Act h0;
    float *mean, *rstd;
} OutputHead;

static void output_head_forward(OutputHead *o, const Act *in, Act *out) {
    int N = in->N, H = in->H, W = in->W;
    group_norm_forward(&o->norm, o->h0.x, o->mean, o->rstd, in->x, N, H * W, NORM_SILU, act_sums(in), NO_SUMS);
    conv_forward(&o->conv, out->x, o->h0.x, N, H, W, NULL);
}

static void output_head_backward(OutputHead *o, const Act *in, const Act *out, GradMode in_grad) {
    int N = in->N, H = in->H, W = in->W;
    group_norm_recompute(&o->norm, o->h0.x, o->mean, o->rstd, in->x, N, H * W, NORM_SILU);
    conv_backward(&o->conv, o->h0.dx, GRAD_WRITE, out->dx, o->h0.x, N, H, W, NULL, 0, NULL);
    group_norm_backward(&o->norm, in->dx, in_grad, NULL, in->dx_sums, NULL, o->h0.dx, in->x, NULL, o->mean, o->rstd, N, H * W, NORM_SILU);
}

// The classifier's head (walk_pool_head): h0 = SiLU(GroupNorm(x)), then
//   adaptive:  tokens = the mean of h0's pixels [N][1][C], out = proj(tokens);
//   attention: tokens = [mean, h0's pixels] + positions [N][1 + HW][C], qkv_out = qkv(tokens),
//              attended = attention(qkv_out), token0 = attended's first token, out = proj(token0).
// Backward needs no h0 (its gradient comes from the tokens'), so h0 is transient. The spatial
// pools instead read every input block's output and the middle block's (x, the last source):
//   features = [the mean of each source's pixels] [N][F], hidden = linear(features) [N][2048],
//   hidden_act = ReLU(hidden) (spatial) or SiLU(GroupNorm(hidden)) (spatial_v2), out = proj(hidden_act);
// backward hands x its gradient and each other source its own when backward reaches that source's
// block (pool_head_source_backward: the source's gradient is whole only then).
typedef struct {
    int pool;
    Norm norm;                       // GroupNorm: out.0 (spatial_v2: out.1, on hidden)
    Conv qkv, linear, proj;          // (qkv: attention; linear: the spatial pools' first)
    float *positions, *d_positions;  // attention: positional_embedding [C][1 + HW] (fp32) and its gradient
    Act h0, tokens, qkv_out, attended, token0;
    const Act *sources[MAX_SKIPS + 1];  // spatial pools: every input block's output, then x
    int source_blocks[MAX_SKIPS], num_sources;  // (the blocks of all but x)
    Act features, hidden, hidden_act;   // (features' gradient kept until backward reaches the first source)
    float *mean, *rstd;
    Attention attention;  // reads qkv_out, writes attended
} PoolHead;

static void pool_head_forward(PoolHead *h, const Act *in, Act *out) {
    int N = in->N, HW = in->H * in->W, C = in->C, T = h->tokens.W;
    if (h->pool == POOL_SPATIAL || h->pool == POOL_SPATIAL_V2) {
        for (int s = 0, at = 0; s < h->num_sources; at += h->sources[s++]->C) {
            const Act *a = h->sources[s];
            pool_tokens_forward(h->features.x + at, h->features.C, a->x, NULL, N, a->H * a->W, a->C, 1);
        }
        conv_forward(&h->linear, h->hidden.x, h->features.x, N, 1, 1, NULL);
        if (h->pool == POOL_SPATIAL_V2)
            group_norm_forward(&h->norm, h->hidden_act.x, h->mean, h->rstd, h->hidden.x, N, 1, NORM_SILU, NO_SUMS, NO_SUMS);
        else {
            relu_forward_kernel<<<blocks_for(act_numel(&h->hidden), 256), 256, 0, gpu.stream>>>(h->hidden_act.x, h->hidden.x,
                                                                                                 act_numel(&h->hidden));
            cuda_check_launch();
        }
        conv_forward(&h->proj, out->x, h->hidden_act.x, N, 1, 1, NULL);
        return;
    }
    group_norm_forward(&h->norm, h->h0.x, h->mean, h->rstd, in->x, N, HW, NORM_SILU, act_sums(in), NO_SUMS);
    pool_tokens_forward(h->tokens.x, C, h->h0.x, h->positions, N, HW, C, T);
    if (h->pool == POOL_ADAPTIVE) {
        conv_forward(&h->proj, out->x, h->tokens.x, N, 1, 1, NULL);
        return;
    }
    conv_forward(&h->qkv, h->qkv_out.x, h->tokens.x, N, 1, T, NULL);
    attention_forward(&h->attention);
    size_t row = C * sizeof(floatX);
    cuda_check(cudaMemcpy2DAsync(h->token0.x, row, h->attended.x, T * row, row, N, cudaMemcpyDeviceToDevice, gpu.stream));
    conv_forward(&h->proj, out->x, h->token0.x, N, 1, 1, NULL);
}

static void pool_head_backward(PoolHead *h, const Act *in, const Act *out, GradMode in_grad) {
    int N = in->N, HW = in->H * in->W, C = in->C, T = h->tokens.W;
    if (h->pool == POOL_SPATIAL || h->pool == POOL_SPATIAL_V2) {
        conv_backward(&h->proj, h->hidden_act.dx, GRAD_WRITE, out->dx, h->hidden_act.x, N, 1, 1, NULL, 0, NULL);
        if (h->pool == POOL_SPATIAL_V2)
            group_norm_backward(&h->norm, h->hidden.dx, GRAD_WRITE, NULL, NULL, NULL, h->hidden_act.dx, h->hidden.x, NULL, h->mean,
                                h->rstd, N, 1, NORM_SILU);
        else {
            relu_backward_kernel<<<blocks_for(act_numel(&h->hidden), 256), 256, 0, gpu.stream>>>(h->hidden.dx, h->hidden_act.dx, h->hidden.x,
                                                                                                  act_numel(&h->hidden));
            cuda_check_launch();
        }
        conv_backward(&h->linear, h->features.dx, GRAD_WRITE, h->hidden.dx, h->features.x, N, 1, 1, NULL, 0, NULL);
        pool_tokens_backward(in->dx, in_grad, NULL, h->features.dx + h->features.C - C, h->features.C, N, HW, C, 1);
        return;
    }
    if (h->pool == POOL_ADAPTIVE) conv_backward(&h->proj, h->tokens.dx, GRAD_WRITE, out->dx, h->tokens.x, N, 1, 1, NULL, 0, NULL);
    else {
        conv_backward(&h->proj, h->token0.dx, GRAD_WRITE, out->dx, h->token0.x, N, 1, 1, NULL, 0, NULL);
        size_t row = C * sizeof(floatX);  // only token 0 has a gradient
        cuda_check(cudaMemsetAsync(h->attended.dx, 0, (size_t)N * T * row, gpu.stream));
        cuda_check(cudaMemcpy2DAsync(h->attended.dx, T * row, h->token0.dx, row, row, N, cudaMemcpyDeviceToDevice, gpu.stream));
        attention_backward(&h->attention);
        conv_backward(&h->qkv, h->tokens.dx, GRAD_WRITE, h->qkv_out.dx, h->tokens.x, N, 1, T, NULL, 0, NULL);
    }
    pool_tokens_backward(h->h0.dx, GRAD_WRITE, h->d_positions, h->tokens.dx, C, N, HW, C, T);
    group_norm_backward(&h->norm, in->dx, in_grad, NULL, NULL, NULL, h->h0.dx, in->x, NULL, h->mean, h->rstd, N, HW, NORM_SILU);
}

// A spatial pool's gradient of the output of `block`, one of its sources, added to what the blocks
// after it delivered (called as backward reaches the block, before its own backward).
static void pool_head_source_backward(const PoolHead *h, int block) {
    for (int s = 0, at = 0; s + 1 < h->num_sources; at += h->sources[s++]->C) {
        if (h->source_blocks[s] != block) continue;
        const Act *a = h->sources[s];
        pool_tokens_backward(a->dx, GRAD_ADD, NULL, h->features.dx + at, h->features.C, a->N, a->H * a->W, a->C, 1);
    }
}

// ----------------------------------------------------------------------------------------------
// The model: guided-diffusion's UNetModel assembled from the blocks, in data-flow order.
//
// One walk over the architecture, in the order of UNetModel.__init__, names every parameter as
// guided-diffusion's state_dict does (PyTorch shapes) and, when building, creates the blocks:
//   time_embed, label_emb; input_blocks: conv, then per level ResBlocks (+ attention), then a
//   Downsample or down-ResBlock, each block's output kept as a skip; middle_block: ResBlock,
//   attention, ResBlock; output_blocks: concat [h, skip], ResBlock (+ attention) (+ Upsample or
//   up-ResBlock on the last block of a level); out: GroupNorm, SiLU, conv.
// All ResBlocks' emb_layers weights sit side by side on the GPU, so one matrix product computes
// every block's timestep projection, and one computes their gradients.

// One parameter tensor as guided-diffusion's state_dict names it, shape in PyTorch's layout.
typedef struct {
    char name[96];
    int ndim;
    int shape[4];
    int64_t numel;
    int64_t offset;  // element offset in the GPU parameter arrays
} ParamSpec;

typedef struct {
    ParamSpec *specs;
    int count, capacity;
    int64_t numel;
} ParamList;

typedef enum { BLOCK_CONV, BLOCK_CONCAT, BLOCK_RES, BLOCK_ATTENTION, BLOCK_DOWN, BLOCK_UP, BLOCK_OUT, BLOCK_POOL, NUM_BLOCK_KINDS } BlockKind;
static const char *const block_kind_names[NUM_BLOCK_KINDS] = {"conv", "concat", "resblock", "attention", "downsample",
                                                               "upsample", "out", "pool"};

typedef struct {
    BlockKind kind;
    Act *in;           // the previous block's output (the model's input for the first)
    GradMode in_grad;  // how its backward's first write delivers in->dx (plan_gradient_modes)
    Act out;           // out.dx holds its gradient only from its delivery to this block's backward
    int param_count;   // the parameters walked up to it, its own included (they come before their block)
    union {
        ConvBlock conv;
        ConcatBlock concat;
        ResBlock res;
        AttentionBlock attention;
        Downsample down;
        Upsample up;
        OutputHead head;
        PoolHead pool;
    };
} Block;

typedef struct {
    int64_t used;
    char *base;  // NULL while measuring
} Arena;

// Takes bytes from an arena (256-byte aligned); while measuring it only counts.
static void *arena_take(Arena *a, int64_t bytes) {
    void *p = a->base ? a->base + a->used : NULL;
    a->used += (bytes + 255) / 256 * 256;
    return p;
}

typedef struct {
    ModelConfig config;
    int batch;
    int training;     // 0: forward only (no gradients, no AdamW state)
    int recompute;    // training that recomputes the blocks' inner activations in backward (TRAINING_RECOMPUTE)
    int parameter_gradients;  // backward computes the parameters' gradients (not with TRAINING_INPUT_GRADIENT)
    int input_gradient;  // backward computes input.dx (unet_create's default; the trainer's step skips it)
    ParamList params;
    int64_t storage;  // floats per parameter array: the parameters and 256-byte alignment gaps
    int64_t emb_bias_offset, emb_total;  // the ResBlocks' emb_layers, side by side: weights at 0, then biases
    // The memory plan (see unet_plan): one GPU allocation in six regions.
    char *memory;
    Arena parameters, acts, grads, scratch_region;
    // The gradients of the activations inside a block live only while its backward runs, and so do
    // the values that backward recomputes (forward only: every activation inside a block, while its
    // forward runs). Every block takes them from the start of two shared regions, each the size of
    // the largest block's.
    Arena inner_grads, transient;
    int64_t inner_grads_size, transient_size;
    // parameters: fp32 master, compute copy (the master itself in FP32), gradients, AdamW moments
    float *master, *grad, *adam_m, *adam_v;
    floatX *compute;
    // blocks and activations
    Block *blocks;
    int num_blocks, capacity;
    Act input, *output;
    Act low_res;                // SuperResModel: the low-resolution images, upsampled into input's last channels
    int64_t *timesteps;         // [N]
    float *time;                // [N]: an EDM model's timestep input, c_noise (continuous_time), else unused
    int continuous_time;        // an EDM model: the timestep embedding reads time, not timesteps
    int *labels;                // [N]
    Conv time_embed0, time_embed2, emb_all;
    float *label_table, *d_label_table;
    Act t_sinusoid, t_hidden, t_hidden_silu, emb, emb_silu;
    BlockEmbedding embedding;  // every ResBlock's timestep projection, [N][emb_total] fp32, and dropout's seed
    floatX *d_emb_out_x;
    Act target;
    uint64_t *zero_seed;     // on the GPU: dropout's seed until the trainer points the embedding at the step's
    Scratch scratch;
    // the largest scratch any layer needs, in elements (noted by the walk)
    int64_t weight_grad_numel, conv_split_numel, channel_sums_numel, gn_partials_numel, gn_dx_sums_numel, scores_numel;
} UNet;

typedef struct {
    const ModelConfig *c;
    ParamList *params;
    UNet *m;   // NULL: list the parameters only
    Act *cur;  // the activation the next block reads
    int size;  // its side
    int emb_offset;
} Walk;

static int param_add(ParamList *list, const char *prefix, const char *leaf, int ndim, const int *shape) {
    if (list->count == list->capacity) {
        list->capacity = list->capacity ? 2 * list->capacity : 256;
        list->specs = (ParamSpec *)realloc(list->specs, list->capacity * sizeof(ParamSpec));
        if (!list->specs) fatal("out of host memory");
    }
    ParamSpec *p = &list->specs[list->count];
    snprintf(p->name, sizeof p->name, "%s%s", prefix, leaf);
    p->ndim = ndim;
    p->numel = 1;
    for (int i = 0; i < ndim; i++) p->shape[i] = shape[i], p->numel *= shape[i];
    p->offset = -1;
    list->numel += p->numel;
    return list->count++;
}

static floatX *param_compute(const UNet *m, int index) { return m->compute + m->params.specs[index].offset; }
static float *param_master(const UNet *m, int index) { return m->master + m->params.specs[index].offset; }
static float *param_grad(const UNet *m, int index) { return m->grad ? m->grad + m->params.specs[index].offset : NULL; }

// A convolution's weight [out][in][k...] (dims = 1 or 2 spatial dimensions) and bias [out]; when
// building, the Conv that uses them.
static Conv walk_conv(Walk *w, const char *prefix, int in, int out, int k, int stride, int dims) {
    int weight_shape[4] = {out, in, k, k}, bias_shape[1] = {out};
    int weight = param_add(w->params, prefix, "weight", 2 + dims, weight_shape);
    param_add(w->params, prefix, "bias", 1, bias_shape);
    Conv cv = {in, out, k, stride, NULL, NULL, NULL, NULL, w->m ? &w->m->scratch : NULL, weight};
    if (w->m && w->m->compute) {
        cv.w = param_compute(w->m, weight), cv.b = param_compute(w->m, weight + 1);
        cv.dw = param_grad(w->m, weight), cv.db = param_grad(w->m, weight + 1);
    }
    return cv;
}

static Conv walk_linear(Walk *w, const char *prefix, int in, int out) {
    int weight_shape[2] = {out, in}, bias_shape[1] = {out};
    int weight = param_add(w->params, prefix, "weight", 2, weight_shape);
    param_add(w->params, prefix, "bias", 1, bias_shape);
    Conv cv = {in, out, 1, 1, NULL, NULL, NULL, NULL, w->m ? &w->m->scratch : NULL, weight};
    if (w->m && w->m->compute) {
        cv.w = param_compute(w->m, weight), cv.b = param_compute(w->m, weight + 1);
        cv.dw = param_grad(w->m, weight), cv.db = param_grad(w->m, weight + 1);
    }
    return cv;
}

static Norm walk_norm(Walk *w, const char *prefix, int channels) {
    int shape[1] = {channels};
    int weight = param_add(w->params, prefix, "weight", 1, shape);
    param_add(w->params, prefix, "bias", 1, shape);
    Norm n = {channels, NULL, NULL, NULL, NULL, w->m ? &w->m->scratch : NULL};
    if (w->m && w->m->compute) {
        n.gamma = param_master(w->m, weight), n.beta = param_master(w->m, weight + 1);
        n.dgamma = param_grad(w->m, weight), n.dbeta = param_grad(w->m, weight + 1);
    }
    return n;
}

static void note_scratch(int64_t *have, int64_t need) { if (need > *have) *have = need; }

// An activation from `values`, and its gradient from `grads` when the model trains and `grads` is
// given (a block's output: placed later, by plan_block_gradients).
static Act act_take(UNet *m, Arena *values, Arena *grads, int N, int H, int W, int C) {
    Act a = {NULL, NULL, N, H, W, C};
    int64_t bytes = act_numel(&a) * (int64_t)sizeof(floatX);
    a.x = values ? (floatX *)arena_take(values, bytes) : NULL;
    if (m->training && grads) a.dx = (floatX *)arena_take(grads, bytes);
    return a;
}

static Act act_alloc(UNet *m, int N, int H, int W, int C) { return act_take(m, &m->acts, &m->grads, N, H, W, C); }

// An activation inside the block being planned (the last one walk_block began): values from
// `values`, gradient in the shared region of inner gradients.
static Act act_take_inner(UNet *m, Arena *values, int N, int H, int W, int C) {
    Act a = act_take(m, values, &m->inner_grads, N, H, W, C);
    note_scratch(&m->inner_grads_size, m->inner_grads.used);
    return a;
}

// One whose values nobody reads after the block's forward, or its backward recomputes: in the
// shared transient region.
static Act act_alloc_transient(UNet *m, int N, int H, int W, int C) {
    Act a = act_take_inner(m, &m->transient, N, H, W, C);
    note_scratch(&m->transient_size, m->transient.used);
    return a;
}

// Where the values inside a block that its backward reads go: kept among the activations, or in the
// transient region when nobody keeps them (forward only, or a backward that recomputes them first:
// --use_checkpoint, res_block_recompute and attention_block_recompute).
static int keeps_inner(const UNet *m) { return m->training && !m->recompute; }

static Act act_alloc_inner(UNet *m, int N, int H, int W, int C) {
    return keeps_inner(m) ? act_take_inner(m, &m->acts, N, H, W, C) : act_alloc_transient(m, N, H, W, C);
}

static void *inner_take(UNet *m, int64_t bytes) {
    if (keeps_inner(m)) return arena_take(&m->acts, bytes);
    void *p = arena_take(&m->transient, bytes);
    note_scratch(&m->transient_size, m->transient.used);
    return p;
}

static float *stats_alloc(UNet *m) { return (float *)arena_take(&m->acts, (int64_t)m->batch * GN_GROUPS * sizeof(float)); }

// Appends a block reading the walk's current activation; the new block's output becomes current.
// stored 0: the block's output has no memory (a concatenation read in place).
static Block *walk_block(Walk *w, BlockKind kind, int out_channels, int out_size, int stored) {
    UNet *m = w->m;
    if (m->num_blocks == m->capacity) fatal("internal error: more blocks than planned (%d)", m->capacity);
    Block *b = &m->blocks[m->num_blocks++];
    memset(b, 0, sizeof *b);
    b->kind = kind;
    b->in = w->cur;
    b->param_count = w->params->count;
    // its gradient: plan_block_gradients
    b->out = act_take(m, stored ? &m->acts : NULL, NULL, m->batch, out_size, out_size, out_channels);
    m->inner_grads.used = m->transient.used = 0;  // its inner activations start the shared regions
    return b;
}

// Notes the scratch a convolution on a size x size input needs: a split 3x3 product's partial sums,
// and in training its weight gradient's slices and its bias gradient's partial sums.
// Told of every convolution the walk plans: its weight's name, the batch, its input's side, and
// whether the model trains. --dry_run lists the kernels of the 3x3 ones with it, and the planner's
// test checks every preset's shapes. NULL: nobody listens.
static void (*conv_visitor)(void *ctx, const char *name, const Conv *cv, int N, int size, int training);
static void *conv_visitor_ctx;

static void walk_conv_scratch(Walk *w, const Conv *cv, int size) {
    UNet *m = w->m;
    if (conv_visitor) conv_visitor(conv_visitor_ctx, w->params->specs[cv->weight].name, cv, m->batch, size, m->training);
    int N = m->batch, o = conv_out_size(size, cv->k, cv->stride);
    int in = cv->in, out = cv->out, s = cv->stride;
    if (cv->k == 3) note_scratch(&m->conv_split_numel, conv3x3_split_scratch_floats(CONV_FORWARD, N, size, size, in, out, s));
    if (!m->training) return;
    if (cv->k == 3) note_scratch(&m->conv_split_numel, conv3x3_split_scratch_floats(CONV_INPUT_GRAD, N, size, size, in, out, s));
    if (!m->parameter_gradients) return;
    if (cv->k == 3) note_scratch(&m->weight_grad_numel, conv3x3_weight_grad_scratch_floats(N, size, size, cv->in, cv->out, cv->stride));
    else {
        int slices = weight_grad_slices(INT64_MAX, N * o * o, cv->out, cv->in);
        if (slices >= 2) note_scratch(&m->weight_grad_numel, (int64_t)slices * cv->out * cv->in);
    }
    note_scratch(&m->channel_sums_numel, channel_sum_slots(N) * cv->out);
}

// The GroupNorm kernels give a thread PACK channels of a row, a block's threads one row at least:
// at most GN_THREADS PACK channels (2048 in the BF16 build, 1024 in FP32: there adm512's widest
// decoder norms and spatial_v2's hidden layer do not fit, and planning them stops with one line).
static int group_norm_fits(int channels) { return channels / PACK <= GN_THREADS; }

static void walk_norm_scratch(Walk *w, int channels) {
    if (!group_norm_fits(channels))
        fatal("GroupNorm over %d channels: the %s build's kernels take at most %d", channels, PRECISION_NAME, GN_THREADS * PACK);
    note_scratch(&w->m->gn_partials_numel, gn_slots(w->m->batch) * (channels * 4 + GN_GROUPS * 2));
    note_scratch(&w->m->gn_dx_sums_numel, gn_slots(w->m->batch) * channels);
}

// The block's output becomes the walk's current activation.
static void walk_advance(Walk *w, Block *b, int size) {
    w->cur = &b->out;
    w->size = size;
}

static void param_child(char *out, size_t len, const char *prefix, const char *child) {
    snprintf(out, len, "%s%s", prefix, child);
}

// guided-diffusion's ResBlock: in_layers (GroupNorm, SiLU, [resample], conv3x3), emb_layers (SiLU,
// linear to out or 2*out with scale-shift), out_layers (GroupNorm, SiLU, dropout, zero conv3x3),
// skip_connection (1x1 conv when the channel count changes; resampled x when up/down).
static void walk_res_block(Walk *w, const char *prefix, int in, int out, int resample) {
    const ModelConfig *c = w->c;
    char name[128];
    int emb_dim = 4 * c->model_channels, emb_out = c->use_scale_shift_norm ? 2 * out : out;
    param_child(name, sizeof name, prefix, "in_layers.0."); Norm norm1 = walk_norm(w, name, in);
    param_child(name, sizeof name, prefix, "in_layers.2."); Conv conv1 = walk_conv(w, name, in, out, 3, 1, 2);
    param_child(name, sizeof name, prefix, "emb_layers.1."); walk_linear(w, name, emb_dim, emb_out);
    param_child(name, sizeof name, prefix, "out_layers.0."); Norm norm2 = walk_norm(w, name, out);
    param_child(name, sizeof name, prefix, "out_layers.3."); Conv conv2 = walk_conv(w, name, out, out, 3, 1, 2);
    Conv conv3 = {0};
    if (out != in) param_child(name, sizeof name, prefix, "skip_connection."), conv3 = walk_conv(w, name, in, out, 1, 1, 2);
    int emb_offset = w->emb_offset;
    w->emb_offset += emb_out;
    if (!w->m) return;
    UNet *m = w->m;
    int size = w->size, out_size = resample > 0 ? 2 * size : resample < 0 ? size / 2 : size, N = m->batch;
    Block *b = walk_block(w, BLOCK_RES, out, out_size, 1);
    ResBlock *r = &b->res;
    r->norm1 = norm1, r->conv1 = conv1, r->norm2 = norm2, r->conv2 = conv2, r->conv3 = conv3;
    r->has_skip_conv = out != in, r->resample = resample, r->emb_offset = emb_offset;
    r->dropout_stream = rng_stream(RNG_DROPOUT, (uint64_t)(b - m->blocks));
    if (resample) r->xr = act_alloc_inner(m, N, out_size, out_size, in);
    r->h1 = act_alloc_inner(m, N, out_size, out_size, out);
    // Forward only, h2 takes the place of h0 and h0r, dead by the time it is written; training keeps
    // conv1's input (h0, or h0r when resampling) for its weight gradient.
    int64_t h2_start = m->transient.used;
    r->h0 = resample ? act_alloc_transient(m, N, size, size, in) : act_alloc_inner(m, N, size, size, in);
    if (resample) r->h0r = act_alloc_inner(m, N, out_size, out_size, in);
    if (!m->training) m->transient.used = h2_start;
    r->h2 = act_alloc_transient(m, N, out_size, out_size, out);
    r->mean1 = stats_alloc(m), r->rstd1 = stats_alloc(m), r->mean2 = stats_alloc(m), r->rstd2 = stats_alloc(m);
    walk_conv_scratch(w, &conv1, out_size), walk_conv_scratch(w, &conv2, out_size);
    if (r->has_skip_conv) walk_conv_scratch(w, &conv3, out_size);
    walk_norm_scratch(w, in), walk_norm_scratch(w, out);
    walk_advance(w, b, out_size);
}

// An attention core over T tokens of `channels` in `heads` (legacy: QKVAttentionLegacy's order)
// for the model's batch: what it keeps for backward (the fused kernels' row statistics, or the
// unfused products' probabilities and pointer arrays; kept: among the activations even when the
// model recomputes, for a block whose backward does not) and the scores' scratch. unet_create binds
// it to its tensors (attention_bind).
static void attention_plan(UNet *m, Attention *a, int T, int channels, int heads, int legacy, int kept) {
    int N = m->batch;
    a->N = N, a->T = T, a->C = channels, a->heads = heads, a->legacy = legacy;
    a->fused = attention_can_fuse(channels / heads);
    int64_t batch = (int64_t)N * heads, tt = batch * T * T;
    if (a->fused) {
        a->lse = (float *)arena_take(&m->acts, batch * T * sizeof(float));
        if (m->training) a->delta = (float *)arena_take(&m->acts, batch * T * sizeof(float));
    } else {
        a->probs = (floatX *)(kept ? arena_take(&m->acts, tt * sizeof(floatX)) : inner_take(m, tt * sizeof(floatX)));
        note_scratch(&m->scores_numel, tt);
        void **arrays[] = {(void **)&a->q, (void **)&a->k, (void **)&a->v, (void **)&a->p, (void **)&a->ds, (void **)&a->o,
                           (void **)&a->dq, (void **)&a->dk, (void **)&a->dv, (void **)&a->s, (void **)&a->dp_out, (void **)&a->d_o};
        for (size_t i = 0; i < sizeof arrays / sizeof arrays[0]; i++) *arrays[i] = arena_take(&m->acts, batch * sizeof(void *));
    }
}

// guided-diffusion's AttentionBlock: GroupNorm, qkv (1x1 conv1d to 3C), attention, proj_out
// (zero conv1d), residual.
static void walk_attention(Walk *w, const char *prefix, int channels, int heads) {
    char name[128];
    param_child(name, sizeof name, prefix, "norm."); Norm norm = walk_norm(w, name, channels);
    param_child(name, sizeof name, prefix, "qkv."); Conv qkv = walk_conv(w, name, channels, 3 * channels, 1, 1, 1);
    param_child(name, sizeof name, prefix, "proj_out."); Conv proj = walk_conv(w, name, channels, channels, 1, 1, 1);
    if (!w->m) return;
    UNet *m = w->m;
    int size = w->size, N = m->batch, T = size * size;
    Block *b = walk_block(w, BLOCK_ATTENTION, channels, size, 1);
    AttentionBlock *ab = &b->attention;
    ab->norm = norm, ab->qkv = qkv, ab->proj = proj;
    ab->h0 = act_alloc_transient(m, N, size, size, channels);   // normalised
    ab->h1 = act_alloc_inner(m, N, size, size, 3 * channels);   // qkv
    ab->h2 = act_alloc_inner(m, N, size, size, channels);       // attention output
    ab->mean = stats_alloc(m), ab->rstd = stats_alloc(m);
    attention_plan(m, &ab->attention, T, channels, heads, !w->c->use_new_attention_order, 0);
    walk_norm_scratch(w, channels);
    walk_conv_scratch(w, &qkv, size), walk_conv_scratch(w, &proj, size);
    walk_advance(w, b, size);
}

// guided-diffusion's Downsample (stride-2 conv, or 2x2 average pooling) and Upsample (nearest,
// then a conv when conv_resample).
static void walk_resample(Walk *w, const char *prefix, int channels, int up) {
    Conv cv = {0};
    if (w->c->conv_resample) cv = walk_conv(w, prefix, channels, channels, 3, up ? 1 : 2, 2);
    if (!w->m) return;
    int size = w->size, out_size = up ? 2 * size : size / 2, has_conv = w->c->conv_resample;
    Block *b = walk_block(w, up ? BLOCK_UP : BLOCK_DOWN, channels, out_size, 1);
    if (up) {
        b->up.conv = cv, b->up.has_conv = has_conv;
        if (has_conv) b->up.up = act_alloc_transient(w->m, w->m->batch, out_size, out_size, channels);
    } else {
        b->down.conv = cv, b->down.has_conv = has_conv;
    }
    if (has_conv) walk_conv_scratch(w, &cv, up ? out_size : size);
    walk_advance(w, b, out_size);
}

// The classifier's head (EncoderUNetModel.out) on the middle block's `channels`: GroupNorm and
// SiLU (out.0), then
//   adaptive:  the mean over the pixels, a 1x1 convolution to the classes (out.3, zero-initialised);
//   attention: AttentionPool2d (out.2): tokens = [the pixels' mean, the pixels] + positional_embedding
//              ([C][1 + HW]), qkv_proj (1x1 conv1d to 3C), attention in heads of num_head_channels
//              (QKVAttention's order), c_proj (1x1 conv1d to the classes) on token 0 alone (the only
//              one returned);
// or, without GroupNorm first, from the means of every input block's output (the sources: the
// skips' blocks) and of `channels` (F values a sample):
//   spatial:    out.0 (Linear F -> SPATIAL_HIDDEN), ReLU, out.2 (Linear to the classes);
//   spatial_v2: out.0 (Linear F -> SPATIAL_HIDDEN), out.1 (GroupNorm), SiLU, out.3 (Linear).
static void walk_pool_head(Walk *w, int channels, const int *source_channels, const int *source_blocks, int num_sources) {
    const ModelConfig *c = w->c;
    int size = c->image_size >> (c->num_levels - 1), T = size * size + 1, classes = c->out_channels;  // (w->size: only when building)
    int spatial = c->pool == POOL_SPATIAL || c->pool == POOL_SPATIAL_V2, features = channels, hidden = SPATIAL_HIDDEN;
    for (int s = 0; s < num_sources; s++) features += source_channels[s];
    Norm norm = {0};
    Conv qkv = {0}, linear = {0}, proj;
    int positions = -1;
    if (spatial) {
        linear = walk_linear(w, "out.0.", features, hidden);
        if (c->pool == POOL_SPATIAL_V2) norm = walk_norm(w, "out.1.", hidden);
        proj = walk_linear(w, c->pool == POOL_SPATIAL_V2 ? "out.3." : "out.2.", hidden, classes);
    } else norm = walk_norm(w, "out.0.", channels);
    if (c->pool == POOL_ATTENTION) {
        int shape[2] = {channels, T};
        positions = param_add(w->params, "out.2.", "positional_embedding", 2, shape);
        qkv = walk_conv(w, "out.2.qkv_proj.", channels, 3 * channels, 1, 1, 1);
        proj = walk_conv(w, "out.2.c_proj.", channels, classes, 1, 1, 1);
    } else if (c->pool == POOL_ADAPTIVE) proj = walk_conv(w, "out.3.", channels, classes, 1, 1, 2);
    if (!w->m) return;
    UNet *m = w->m;
    int N = m->batch;
    const Act *in = w->cur;
    Block *b = walk_block(w, BLOCK_POOL, classes, 1, 1);
    PoolHead *h = &b->pool;
    h->pool = c->pool, h->norm = norm, h->qkv = qkv, h->linear = linear, h->proj = proj;
    h->mean = stats_alloc(m), h->rstd = stats_alloc(m);
    walk_conv_scratch(w, &proj, 1);
    // What backward reads is always kept (nothing recomputes it: the head is small).
    if (spatial) {
        for (int s = 0; s < num_sources; s++) h->sources[s] = &m->blocks[source_blocks[s]].out, h->source_blocks[s] = source_blocks[s];
        h->sources[num_sources] = in, h->num_sources = num_sources + 1;
        h->features = act_take(m, &m->acts, &m->acts, N, 1, 1, features);  // (its gradient outlives the block's backward)
        h->hidden = act_take_inner(m, &m->acts, N, 1, 1, hidden);
        h->hidden_act = act_take_inner(m, &m->acts, N, 1, 1, hidden);
        walk_conv_scratch(w, &linear, 1);
        if (c->pool == POOL_SPATIAL_V2) walk_norm_scratch(w, hidden);
        walk_advance(w, b, 1);
        return;
    }
    h->h0 = act_alloc_transient(m, N, size, size, channels);
    walk_norm_scratch(w, channels);
    if (c->pool == POOL_ATTENTION) {
        if (m->compute) h->positions = param_master(m, positions), h->d_positions = param_grad(m, positions);
        h->tokens = act_take_inner(m, &m->acts, N, 1, T, channels);
        h->qkv_out = act_take_inner(m, &m->acts, N, 1, T, 3 * channels);
        h->attended = act_take_inner(m, &m->acts, N, 1, T, channels);
        h->token0 = act_take_inner(m, &m->acts, N, 1, 1, channels);
        attention_plan(m, &h->attention, T, channels, channels / c->num_head_channels, 0, 1);
        walk_conv_scratch(w, &qkv, size);  // (its N (1 + HW) rows as N HW: the scratch only caps the slices)
    } else h->tokens = act_take_inner(m, &m->acts, N, 1, 1, channels);
    walk_advance(w, b, 1);
}

static int heads_for(const ModelConfig *c, int channels, int decoder) {
    return c->num_head_channels != -1 ? channels / c->num_head_channels : decoder ? c->num_heads_upsample : c->num_heads;
}

// The whole walk (see the top of this section).
static void unet_walk(const ModelConfig *c, ParamList *params, UNet *m) {
    Walk w = {c, params, m, m ? &m->input : NULL, c->image_size, 0};
    int emb_dim = 4 * c->model_channels;
    Conv te0 = walk_linear(&w, "time_embed.0.", c->model_channels, emb_dim);
    Conv te2 = walk_linear(&w, "time_embed.2.", emb_dim, emb_dim);
    int label = -1;
    if (c->num_classes) {
        int shape[2] = {c->num_classes, emb_dim};
        label = param_add(params, "label_emb.", "weight", 2, shape);
    }
    if (m) {
        m->time_embed0 = te0, m->time_embed2 = te2;
        if (m->compute && label >= 0) m->label_table = param_master(m, label), m->d_label_table = param_grad(m, label);
    }
    char name[128];
    int ch = c->level_channels[0], skip_channels[MAX_SKIPS], skip_blocks[MAX_SKIPS], num_skips = 0, block = 1;
    Conv conv_in = walk_conv(&w, "input_blocks.0.0.", model_input_channels(c), ch, 3, 1, 2);
    if (m) {
        Block *b = walk_block(&w, BLOCK_CONV, ch, w.size, 1);
        b->conv.conv = conv_in;
        walk_conv_scratch(&w, &conv_in, w.size);
        walk_advance(&w, b, w.size);
    }
    skip_channels[num_skips] = ch, skip_blocks[num_skips++] = m ? m->num_blocks - 1 : 0;
    for (int level = 0; level < c->num_levels; level++) {
        for (int r = 0; r < c->num_res_blocks; r++, block++) {
            snprintf(name, sizeof name, "input_blocks.%d.0.", block);
            walk_res_block(&w, name, ch, c->level_channels[level], 0);
            ch = c->level_channels[level];
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "input_blocks.%d.1.", block);
                walk_attention(&w, name, ch, heads_for(c, ch, 0));
            }
            skip_channels[num_skips] = ch, skip_blocks[num_skips++] = m ? m->num_blocks - 1 : 0;
        }
        if (level != c->num_levels - 1) {
            if (c->resblock_updown) snprintf(name, sizeof name, "input_blocks.%d.0.", block), walk_res_block(&w, name, ch, ch, -1);
            else snprintf(name, sizeof name, "input_blocks.%d.0.op.", block), walk_resample(&w, name, ch, 0);
            skip_channels[num_skips] = ch, skip_blocks[num_skips++] = m ? m->num_blocks - 1 : 0;
            block++;
        }
    }
    walk_res_block(&w, "middle_block.0.", ch, ch, 0);
    walk_attention(&w, "middle_block.1.", ch, heads_for(c, ch, 0));
    walk_res_block(&w, "middle_block.2.", ch, ch, 0);
    if (c->pool) {
        walk_pool_head(&w, ch, skip_channels, skip_blocks, num_skips);
        if (m) m->emb_total = w.emb_offset;
        return;
    }
    block = 0;
    for (int level = c->num_levels - 1; level >= 0; level--) {
        for (int r = 0; r <= c->num_res_blocks; r++, block++) {
            int skip = skip_channels[--num_skips];
            // [h, skip] along channels, read in place by the ResBlock when it has a skip convolution
            // (its widths differ); GroupNorm's threads then need h's width a multiple of PACK, as
            // every width GroupNorm takes (a multiple of 32) is.
            int in_place = ch + skip != c->level_channels[level] && ch % PACK == 0;
            Block *cat = NULL;
            if (m) {
                cat = walk_block(&w, BLOCK_CONCAT, ch + skip, w.size, !in_place);
                cat->concat.skip = &m->blocks[skip_blocks[num_skips]].out, cat->concat.in_place = in_place;
                walk_advance(&w, cat, w.size);
            }
            snprintf(name, sizeof name, "output_blocks.%d.0.", block);
            walk_res_block(&w, name, ch + skip, c->level_channels[level], 0);
            if (m && in_place) {
                ResBlock *r = &m->blocks[m->num_blocks - 1].res;
                r->cat_a = cat->in, r->cat_b = cat->concat.skip;
            }
            ch = c->level_channels[level];
            int layer = 1;
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "output_blocks.%d.%d.", block, layer++);
                walk_attention(&w, name, ch, heads_for(c, ch, 1));
            }
            if (level > 0 && r == c->num_res_blocks) {
                if (c->resblock_updown) snprintf(name, sizeof name, "output_blocks.%d.%d.", block, layer), walk_res_block(&w, name, ch, ch, 1);
                else snprintf(name, sizeof name, "output_blocks.%d.%d.conv.", block, layer), walk_resample(&w, name, ch, 1);
            }
        }
    }
    Norm out_norm = walk_norm(&w, "out.0.", ch);
    Conv out_conv = walk_conv(&w, "out.2.", c->level_channels[0], c->out_channels, 3, 1, 2);
    if (m) {
        Block *b = walk_block(&w, BLOCK_OUT, c->out_channels, w.size, 1);
        b->head.norm = out_norm, b->head.conv = out_conv;
        b->head.h0 = act_alloc_transient(m, m->batch, w.size, w.size, ch);
        b->head.mean = stats_alloc(m), b->head.rstd = stats_alloc(m);
        walk_norm_scratch(&w, ch), walk_conv_scratch(&w, &out_conv, w.size);
        walk_advance(&w, b, w.size);
        m->emb_total = w.emb_offset;
    }
}

// Every parameter of the UNet in state_dict order, with PyTorch shapes.
static ParamList model_parameters(const ModelConfig *c) {
    ParamList list = {0};
    unet_walk(c, &list, NULL);
    return list;
}

// An upper bound on the block count: per level, input blocks make 2 blocks each plus a
// downsample; output blocks at most 4 (concat, ResBlock, attention, upsample).
static int max_blocks(const ModelConfig *c) { return 8 + c->num_levels * (2 * c->num_res_blocks + 1 + 4 * (c->num_res_blocks + 1)); }

// GPU parameter layout: conv weights [out][k][k][in] (PyTorch: [out][in][k][k]); every other
// tensor as PyTorch has it. `to_gpu` converts one tensor's values between the two.
static void param_layout(const ParamSpec *p, const float *src, float *dst, int to_gpu) {
    if (p->ndim != 4) { memcpy(dst, src, p->numel * sizeof(float)); return; }
    int out = p->shape[0], in = p->shape[1], kk = p->shape[2] * p->shape[3];
    for (int o = 0; o < out; o++)
        for (int i = 0; i < in; i++)
            for (int k = 0; k < kk; k++) {
                int64_t torch = ((int64_t)o * in + i) * kk + k, gpu_at = ((int64_t)o * kk + k) * in + i;
                if (to_gpu) dst[gpu_at] = src[torch];
                else dst[torch] = src[gpu_at];
            }
}

static int is_emb_layer(const char *name, const char *leaf) {
    const char *at = strstr(name, "emb_layers.1.");
    return at && strcmp(at + strlen("emb_layers.1."), leaf) == 0;
}

// Lays the parameters out in one array: the emb_layers weights first, then their biases, then the
// rest in order, each of those 256-byte aligned for the matrix products. Sets every offset and the
// biases' start; returns the array's length, alignment gaps (kept at zero) included.
static int64_t param_offsets(ParamList *params, int64_t *emb_bias_offset) {
    int64_t at = 0;
    for (int pass = 0; pass < 3; pass++) {
        if (pass == 1) *emb_bias_offset = at = (at + 63) / 64 * 64;  // the weights start at 0
        for (int i = 0; i < params->count; i++) {
            ParamSpec *p = &params->specs[i];
            int weight = is_emb_layer(p->name, "weight"), bias = is_emb_layer(p->name, "bias");
            if ((pass == 0 && weight) || (pass == 1 && bias) || (pass == 2 && !weight && !bias)) {
                if (pass == 2) at = (at + 63) / 64 * 64;
                p->offset = at;
                at += p->numel;
            }
        }
    }
    return at;
}

// Which convolutions gather GroupNorm's channel sums as they store their output, and where (Act.sums):
//   - a ResBlock's conv1, for its GroupNorm 2: into the scratch;
//   - a block's output that the next block starts by normalising (a ResBlock reading it whole, an
//     AttentionBlock, the output head): into the scratch, which nothing writes between;
//   - a part of a concatenation that a decoder ResBlock reads in place (a skip tensor, from long
//     before), or the source of a nearest upsampling that is one: into buffers of its own among the
//     activations, room for a slot per 128 pixels of an image (the convolutions' tiles; more slots
//     than fit: none gathered). group_norm_forward's pass for a part without sums writes the scratch.
// Run after the scratch is taken.
static void plan_gathered_sums(UNet *m) {
    const Scratch *s = &m->scratch;
    for (int i = 0; i < m->num_blocks; i++) {
        Block *b = &m->blocks[i];
        if (b->kind == BLOCK_UP && !b->up.has_conv) b->out.upsampled_from = b->in;
        if (b->kind == BLOCK_RES) b->res.h1.sums = s->gn_partials, b->res.h1.sums_numel = s->gn_partials_numel;
        const Block *next = i + 1 < m->num_blocks ? &m->blocks[i + 1] : NULL;
        if (next && next->in == &b->out &&
            (next->kind == BLOCK_ATTENTION || next->kind == BLOCK_OUT || (next->kind == BLOCK_RES && !next->res.cat_a)))
            b->out.sums = s->gn_partials, b->out.sums_numel = s->gn_partials_numel;
    }
    for (int i = 0; i < m->num_blocks; i++) {
        const ResBlock *r = &m->blocks[i].res;
        if (m->blocks[i].kind != BLOCK_RES || !r->cat_a) continue;
        Act *parts[2] = {r->cat_a, r->cat_b};
        for (int p = 0; p < 2; p++) {
            Act *a = parts[p]->upsampled_from ? parts[p]->upsampled_from : parts[p];
            int64_t slots = a->H * a->W / 128 > 1 ? a->H * a->W / 128 : 1;
            a->sums_numel = a->N * slots * a->C * 2;
            a->sums = (double *)arena_take(&m->acts, a->sums_numel * (int64_t)sizeof(double));
        }
    }
}

// Whether block i's output is one of a spatial pool head's sources (the classifier's last block).
static bool spatial_pool_source(const UNet *m, int i) {
    const Block *last = &m->blocks[m->num_blocks - 1];
    for (int s = 0; last->kind == BLOCK_POOL && s + 1 < last->pool.num_sources; s++)
        if (last->pool.source_blocks[s] == i) return true;
    return false;
}

// Which blocks' output gradients come with their channel sums, for the bias gradient of the layer
// that wrote the output (Act.dx_sums): where the next block begins with a GroupNorm of that output (a
// ResBlock, an AttentionBlock, the output head; or a ResBlock reading it in place as a concatenation's
// first part), that GroupNorm's backward writes the gradient last (every other reader comes later in
// the model, so earlier in backward) and sums it as it writes, in place of a pass over it. The
// producer: a ResBlock's conv2 (its skip convolution's bias gradient is conv2's), an AttentionBlock's
// proj_out, the first convolution, a resampling convolution. Not a spatial pool's source (the pool
// adds its gradient after the next block's, pool_head_source_backward). Each output's sums have a
// buffer of their own among the activations: the producer's bias gradient reads them on the side
// stream while the GroupNorm of the block before may already write its own.
static void plan_gradient_sums(UNet *m) {
    if (!m->parameter_gradients) return;
    for (int i = 0; i + 1 < m->num_blocks; i++) {
        Block *b = &m->blocks[i];
        if (spatial_pool_source(m, i)) continue;
        const Block *next = &m->blocks[i + 1], *after = i + 2 < m->num_blocks ? &m->blocks[i + 2] : NULL;
        const bool biased = b->kind == BLOCK_RES || b->kind == BLOCK_ATTENTION || b->kind == BLOCK_CONV ||
                            (b->kind == BLOCK_DOWN && b->down.has_conv) || (b->kind == BLOCK_UP && b->up.has_conv);
        int channels = 0;  // the GroupNorm's input's
        if (next->in == &b->out && (next->kind == BLOCK_ATTENTION || next->kind == BLOCK_OUT || (next->kind == BLOCK_RES && !next->res.cat_a)))
            channels = b->out.C;
        if (next->kind == BLOCK_CONCAT && next->concat.in_place && after && after->kind == BLOCK_RES && after->res.cat_a == &b->out)
            channels = next->out.C;
        Act *a = &b->out;
        if (!biased || !channels) continue;
        a->dx_sum_chunks = gn_chunks(a->H * a->W, channels, a->N), a->dx_sums_ld = channels;
        a->dx_sums = (float *)arena_take(&m->acts, (int64_t)a->N * a->dx_sum_chunks * channels * sizeof(float));
    }
}

// Whether a block after block i (in the model's order; before it in backward's) delivers a's gradient.
static int gradient_delivered_after(const UNet *m, int i, const Act *a) {
    for (int j = i + 1; j < m->num_blocks; j++) {
        const Block *b = &m->blocks[j];
        if (b->in == a || (b->kind == BLOCK_CONCAT && b->concat.skip == a)) return 1;
    }
    return 0;
}

// Each block's first delivery of an input gradient writes it, unless an earlier one in backward (a
// skip tensor's concatenation) did: then it adds. So no gradient between blocks needs zeroing.
static void plan_gradient_modes(UNet *m) {
    for (int i = 0; i < m->num_blocks; i++) {
        Block *b = &m->blocks[i];
        b->in_grad = gradient_delivered_after(m, i, b->in) ? GRAD_ADD : GRAD_WRITE;
        if (b->kind == BLOCK_CONCAT) b->concat.skip_grad = gradient_delivered_after(m, i, b->concat.skip) ? GRAD_ADD : GRAD_WRITE;
        if (b->kind == BLOCK_CONCAT && b->concat.in_place)  // the next block delivers them, no other between
            m->blocks[i + 1].res.cat_a_grad = b->in_grad, m->blocks[i + 1].res.cat_b_grad = b->concat.skip_grad;
    }
}

// The gradients between blocks share one area, each for its lifetime only. Backward runs the
// blocks last to first; the gradient of block j's output is first written by its last consumer in
// the model's order (the next block, or for a skip tensor a decoder's concatenation, or the
// ResBlock after it when that reads it in place; for the model's output the loss, before
// backward) and last read by block j's backward. In the order they begin, each takes the lowest
// offset that no gradient alive at the same time holds (first fit), so the area is about the
// largest set alive at once (the skip tensors' gradients, which live from the decoder back to the
// encoder) instead of all of them.
static void plan_block_gradients(UNet *m) {
    if (!m->training) return;
    int n = m->num_blocks;
    int64_t *offset = (int64_t *)malloc_or_die(3 * n * sizeof(int64_t)), *bytes = offset + n, *begin = offset + 2 * n, area = 0;
    for (int j = 0; j < n; j++) {
        int consumer = j == n - 1 ? n : j;  // the loss: before block n - 1's backward
        for (int i = j + 1; i < n; i++) {
            const Block *b = &m->blocks[i];
            if (b->in == &m->blocks[j].out || (b->kind == BLOCK_CONCAT && b->concat.skip == &m->blocks[j].out))
                consumer = b->kind == BLOCK_CONCAT && b->concat.in_place ? i + 1 : i;  // read in place by the next block
        }
        begin[j] = n - 1 - consumer;  // backward's step (block n - 1 - t at step t); alive until step n - 1 - j
        int none = m->blocks[j].kind == BLOCK_CONCAT && m->blocks[j].concat.in_place;  // no gradient of its own
        bytes[j] = none ? 0 : (act_numel(&m->blocks[j].out) * (int64_t)sizeof(floatX) + 255) / 256 * 256;
        offset[j] = -1;
    }
    for (int64_t step = -1; step < n; step++)  // place them in the order they begin
        for (int j = n - 1; j >= 0; j--) {
            if (begin[j] != step) continue;
            int64_t at = 0;
            for (int moved = 1; moved;) {  // past every placed one alive at the same time that overlaps [at, at + bytes)
                moved = 0;
                for (int k = 0; k < n; k++)
                    if (offset[k] >= 0 && begin[k] <= n - 1 - j && begin[j] <= n - 1 - k && at < offset[k] + bytes[k] &&
                        offset[k] < at + bytes[j])
                        at = offset[k] + bytes[k], moved = 1;
            }
            offset[j] = at;
            if (at + bytes[j] > area) area = at + bytes[j];
        }
    char *base = (char *)arena_take(&m->grads, area);
    for (int j = 0; j < n; j++) m->blocks[j].out.dx = base && bytes[j] ? (floatX *)(base + offset[j]) : NULL;
    free(offset);
}

// The model's memory, planned once from the config and batch: one GPU allocation in six regions,
// each with its lifetime.
//   parameters   fp32 master and compute copy; when training, their gradients and AdamW's two
//                moments: the whole run.
//   activations  the input, every block's output and what its backward reads and does not
//                recompute (TRAINING_RECOMPUTE: of a ResBlock's or AttentionBlock's inside, only
//                the GroupNorm statistics): from the forward pass to the end of the backward.
//   gradients    the gradients of the activations between blocks (when training): each written by
//                the first block that delivers it (plan_gradient_modes); a block output's only
//                from that delivery to its own block's backward, in an area they share by lifetime
//                (plan_block_gradients).
//   inner grads  the gradients of the activations inside a block: while that block's backward runs,
//                each written by its one producer; every block's start at the same place (the largest
//                block's size).
//   transient    the activations inside a block that its backward recomputes (forward only, or
//                TRAINING_RECOMPUTE: all of them): while that block's forward or backward runs;
//                shared as the inner grads are.
//   scratch      the largest weight-gradient slices, partial sums (split 3x3 products' too: also
//                forward only) and attention scores of any layer: each buffer borrowed by one layer
//                call at a time (the side stream's weight gradient and the main stream's split
//                product use different buffers).
// unet_lay_out takes every buffer from its region, in one fixed order; with no memory behind the
// regions (unet_plan) it only measures them, so the plan needs no GPU.
static void unet_lay_out(UNet *m) {
    const ModelConfig *c = &m->config;
    int batch = m->batch, training = m->training, size = c->image_size, emb_dim = 4 * c->model_channels;
    m->parameters.used = m->acts.used = m->grads.used = m->scratch_region.used = m->inner_grads.used = m->transient.used = 0;
    m->inner_grads_size = m->transient_size = 0;
    m->weight_grad_numel = m->conv_split_numel = m->channel_sums_numel = m->gn_partials_numel = m->gn_dx_sums_numel = 0;
    m->scores_numel = 0;
    m->num_blocks = 0;

    int64_t n = m->storage;
    m->master = (float *)arena_take(&m->parameters, n * sizeof(float));
    if (m->parameter_gradients) {
        m->grad = (float *)arena_take(&m->parameters, n * sizeof(float));
        m->adam_m = (float *)arena_take(&m->parameters, n * sizeof(float));  // (each 256-byte aligned for AdamW's vectors;
        m->adam_v = (float *)arena_take(&m->parameters, n * sizeof(float));  // state.bin stores them side by side)
    }
    if (sizeof(floatX) == sizeof(float)) m->compute = (floatX *)m->master;
    else m->compute = (floatX *)arena_take(&m->parameters, n * sizeof(floatX));

    m->input = act_alloc(m, batch, size, size, model_input_channels(c));
    if (c->low_res) m->low_res = act_take(m, &m->acts, NULL, batch, c->low_res, c->low_res, c->in_channels);
    m->target = c->pool ? act_alloc(m, batch, 1, 1, c->out_channels) : act_alloc(m, batch, size, size, c->out_channels);
    m->t_sinusoid = act_alloc(m, batch, 1, 1, c->model_channels);
    m->t_hidden = act_alloc(m, batch, 1, 1, emb_dim);
    m->t_hidden_silu = act_alloc(m, batch, 1, 1, emb_dim);
    m->emb = act_alloc(m, batch, 1, 1, emb_dim);
    m->emb_silu = act_alloc(m, batch, 1, 1, emb_dim);
    ParamList again = {0};
    unet_walk(c, &again, m);
    free(again.specs);
    m->output = &m->blocks[m->num_blocks - 1].out;
    plan_gradient_modes(m);
    plan_block_gradients(m);
    int64_t E = m->emb_total;
    m->embedding.out = (float *)arena_take(&m->acts, (int64_t)batch * E * sizeof(float));
    if (m->parameter_gradients) {
        m->embedding.d_out = (float *)arena_take(&m->acts, (int64_t)batch * E * sizeof(float));
        m->d_emb_out_x = (floatX *)arena_take(&m->acts, (int64_t)batch * E * sizeof(floatX));
        note_scratch(&m->channel_sums_numel, channel_sum_slots(batch) * (E > emb_dim ? E : emb_dim));
    }
    m->timesteps = (int64_t *)arena_take(&m->acts, batch * sizeof(int64_t));
    m->time = (float *)arena_take(&m->acts, batch * sizeof(float));
    m->labels = (int *)arena_take(&m->acts, batch * sizeof(int));
    m->zero_seed = (uint64_t *)arena_take(&m->acts, sizeof(uint64_t));

    Scratch *s = &m->scratch;
    s->weight_grad = (float *)arena_take(&m->scratch_region, m->weight_grad_numel * sizeof(float));
    s->weight_grad_numel = m->weight_grad_numel;
    s->conv_split = (float *)arena_take(&m->scratch_region, m->conv_split_numel * sizeof(float));
    s->conv_split_numel = m->conv_split_numel;
    s->channel_sums = (float *)arena_take(&m->scratch_region, m->channel_sums_numel * sizeof(float));
    s->gn_partials = (double *)arena_take(&m->scratch_region, m->gn_partials_numel * sizeof(double));
    s->gn_partials_numel = m->gn_partials_numel;
    if (m->parameter_gradients) s->gn_dx_sums = (float *)arena_take(&m->scratch_region, m->gn_dx_sums_numel * sizeof(float));
    s->scores = (float *)arena_take(&m->scratch_region, m->scores_numel * sizeof(float));
    if (training) s->d_scores = (floatX *)arena_take(&m->scratch_region, m->scores_numel * sizeof(floatX));
    plan_gathered_sums(m);
    plan_gradient_sums(m);
}

// unet_plan's and unet_create's `training`: 0 forward only, 1 training, TRAINING_RECOMPUTE training
// whose ResBlocks and AttentionBlocks recompute their inner activations in backward instead of
// keeping them from forward (guided-diffusion's use_checkpoint; res_block_recompute and
// attention_block_recompute), TRAINING_INPUT_GRADIENT a backward pass for the input's gradient
// alone (classifier guidance): the activations kept as for training, no parameter gradients, no
// AdamW state; every layer's weight-gradient work finds no dw and does nothing.
#define TRAINING_RECOMPUTE 2
#define TRAINING_INPUT_GRADIENT 3

// The plan of a model for batches of `batch` images, on the host: its parameter list, its blocks
// and the size of each memory region (nothing on the GPU).
static void unet_plan(UNet *m, const ModelConfig *c, int batch, int training) {
    int64_t pixels = (int64_t)batch * c->image_size * c->image_size;
    if (pixels > INT32_MAX)
        fatal("a batch of %d images of %dx%d is %lld pixels; the kernels count pixels in 32 bits (at most %d): use a smaller batch",
              batch, c->image_size, c->image_size, (long long)pixels, INT32_MAX);
    memset(m, 0, sizeof *m);
    m->config = *c;
    m->input_gradient = training != 0;
    m->batch = batch;
    m->training = training != 0;
    m->recompute = training == TRAINING_RECOMPUTE;
    m->parameter_gradients = training == 1 || training == TRAINING_RECOMPUTE;
    m->capacity = max_blocks(c);
    m->blocks = (Block *)calloc(m->capacity, sizeof(Block));
    if (!m->blocks) fatal("out of host memory");
    m->params = model_parameters(c);
    m->storage = param_offsets(&m->params, &m->emb_bias_offset);
    unet_lay_out(m);
}

// The values of the batch's images (an upsampler's input holds as many again: the low-resolution
// image upsampled).
static int64_t image_values(const UNet *m) { return (int64_t)m->batch * m->input.H * m->input.W * m->config.in_channels; }

static int64_t unet_memory_bytes(const UNet *m) {
    return m->parameters.used + m->acts.used + m->transient_size + m->grads.used + m->inner_grads_size + m->scratch_region.used;
}

// Prints the plan's regions and their total (--dry_run, the bench).
static void print_memory_plan(FILE *f, const UNet *m, const char *what) {
    const double MiB = 1048576.0;
    fprintf(f, "memory plan (%s, batch %d): parameters %.1f MiB, activations %.1f MiB, gradients %.1f MiB, "
            "scratch %.1f MiB; total %.1f MiB\n", what, m->batch, m->parameters.used / MiB, (m->acts.used + m->transient_size) / MiB,
            (m->grads.used + m->inner_grads_size) / MiB, m->scratch_region.used / MiB, unet_memory_bytes(m) / MiB);
}

// The training model's unet_create mode (--use_checkpoint).
static int training_mode(const TrainConfig *train) { return train->recompute ? TRAINING_RECOMPUTE : 1; }

// The pieces' gradient sum of --microbatch (Trainer.grad_sum): bytes.
static int64_t gradient_sum_bytes(const TrainConfig *train, const UNet *plan) {
    return train->batch_size > train->piece ? plan->storage * (int64_t)sizeof(float) : 0;
}

// The training model's plan for the options (a piece of the batch with --microbatch, recomputing with
// --use_checkpoint), and its total the other way round (other_bytes; -1: not given).
static void print_training_plan(FILE *f, const UNet *plan, const TrainConfig *train, int64_t other_bytes) {
    char what[128];
    int pieces = train->batch_size / plan->batch;
    snprintf(what, sizeof what, "training%s%s", plan->recompute ? ", recomputing (--use_checkpoint)" : "",
             pieces > 1 ? ", one piece of the batch (--microbatch)" : "");
    print_memory_plan(f, plan, what);
    if (pieces > 1)
        fprintf(f, "memory plan (gradient sum of the %d pieces): %.1f MiB\n", pieces, gradient_sum_bytes(train, plan) / 1048576.0);
    if (other_bytes >= 0)
        fprintf(f, "memory plan (%s --use_checkpoint instead): total %.1f MiB\n", plan->recompute ? "without" : "with",
                other_bytes / 1048576.0);
}

// Builds the model: its plan, then the one allocation, then every buffer in it. Parameters start
// at zero (unet_init_parameters or a checkpoint sets them).
static void unet_create(UNet *m, const ModelConfig *c, int batch, int training) {
    unet_plan(m, c, batch, training);
    m->memory = (char *)gpu_malloc(unet_memory_bytes(m));
    m->parameters.base = m->memory;
    m->acts.base = m->parameters.base + m->parameters.used;
    m->transient.base = m->acts.base + m->acts.used;
    m->grads.base = m->transient.base + m->transient_size;
    m->inner_grads.base = m->grads.base + m->grads.used;
    m->scratch_region.base = m->inner_grads.base + m->inner_grads_size;
    unet_lay_out(m);
    cuda_check(cudaMemset(m->parameters.base, 0, m->parameters.used));
    cuda_check(cudaMemset(m->zero_seed, 0, sizeof(uint64_t)));
    m->embedding.total = (int)m->emb_total, m->embedding.scale_shift = c->use_scale_shift_norm;
    m->embedding.dropout = c->dropout, m->embedding.dropout_seed = m->zero_seed;
    m->emb_all.in = 4 * c->model_channels, m->emb_all.out = (int)m->emb_total, m->emb_all.k = 1, m->emb_all.stride = 1;
    m->emb_all.w = m->compute, m->emb_all.b = m->compute + m->emb_bias_offset;
    if (m->grad) m->emb_all.dw = m->grad, m->emb_all.db = m->grad + m->emb_bias_offset;
    m->emb_all.scratch = &m->scratch;
    for (int i = 0; i < m->num_blocks; i++) {
        Block *b = &m->blocks[i];
        Attention *a = b->kind == BLOCK_ATTENTION ? &b->attention.attention
                       : b->kind == BLOCK_POOL && b->pool.pool == POOL_ATTENTION ? &b->pool.attention : NULL;
        if (!a) continue;
        a->scores = m->scratch.scores, a->d_scores = m->scratch.d_scores;
        if (b->kind == BLOCK_ATTENTION) attention_bind(a, b->attention.h1.x, b->attention.h2.x, b->attention.h1.dx, b->attention.h2.dx);
        else attention_bind(a, b->pool.qkv_out.x, b->pool.attended.x, b->pool.qkv_out.dx, b->pool.attended.dx);
    }
}

// Frees what unet_plan and unet_create allocated.
static void unet_destroy(UNet *m) {
    if (m->memory) cudaFree(m->memory);
    free(m->blocks);
    free(m->params.specs);
    memset(m, 0, sizeof *m);
}

// Refreshes the compute copy of the parameters from the fp32 master (BF16 builds).
static void unet_sync_compute(UNet *m) {
    if ((void *)m->compute == (void *)m->master) return;
    float_to_floatx_kernel<<<blocks_for(m->storage, 256), 256, 0, gpu.stream>>>(m->compute, m->master, m->storage);
    cuda_check_launch();
}

static void block_forward(UNet *m, Block *b, int training) {
    switch (b->kind) {
    case BLOCK_CONV: conv_block_forward(&b->conv, b->in, &b->out); break;
    case BLOCK_CONCAT: concat_block_forward(&b->concat, b->in, &b->out); break;
    case BLOCK_RES: res_block_forward(&b->res, &m->embedding, b->in, &b->out, training); break;
    case BLOCK_ATTENTION: attention_block_forward(&b->attention, b->in, &b->out); break;
    case BLOCK_DOWN: downsample_forward(&b->down, b->in, &b->out); break;
    case BLOCK_UP: upsample_forward(&b->up, b->in, &b->out); break;
    case BLOCK_OUT: output_head_forward(&b->head, b->in, &b->out); break;
    case BLOCK_POOL: pool_head_forward(&b->pool, b->in, &b->out); break;
    case NUM_BLOCK_KINDS: break;
    }
}

static void block_backward(UNet *m, Block *b, int training) {
    if (m->recompute && b->kind == BLOCK_RES) res_block_recompute(&b->res, b->in, &b->out);
    if (m->recompute && b->kind == BLOCK_ATTENTION) attention_block_recompute(&b->attention, b->in);
    switch (b->kind) {
    case BLOCK_CONV:
        conv_block_backward(&b->conv, b->in, &b->out, b->in_grad, b->in != &m->input || m->input_gradient);
        break;
    case BLOCK_CONCAT: concat_block_backward(&b->concat, b->in, &b->out, b->in_grad); break;
    case BLOCK_RES: res_block_backward(&b->res, &m->embedding, b->in, &b->out, b->in_grad, training); break;
    case BLOCK_ATTENTION: attention_block_backward(&b->attention, b->in, &b->out, b->in_grad); break;
    case BLOCK_DOWN: downsample_backward(&b->down, b->in, &b->out, b->in_grad); break;
    case BLOCK_UP: upsample_backward(&b->up, b->in, &b->out, b->in_grad); break;
    case BLOCK_OUT: output_head_backward(&b->head, b->in, &b->out, b->in_grad); break;
    case BLOCK_POOL: pool_head_backward(&b->pool, b->in, &b->out, b->in_grad); break;
    case NUM_BLOCK_KINDS: break;
    }
}

// The forward pass on m->input (NHWC), m->timesteps and m->labels (and SuperResModel's
// m->low_res, upsampled into the input's last channels first); the result is m->output.
// before_block(ctx, i), when given, runs before block i's forward: training waits there for the
// update of the block's parameters (trainer_wait_update).
static void unet_forward_watched(UNet *m, int training, void (*before_block)(void *ctx, int block), void *ctx) {
    const ModelConfig *c = &m->config;
    int N = m->batch, D = 4 * c->model_channels;
    if (c->low_res) upsample_bilinear(m->input.x, m->input.C, c->in_channels, m->low_res.x, N, c->low_res, c->image_size, c->in_channels);
    timestep_embedding_kernel<<<(N * c->model_channels + 255) / 256, 256, 0, gpu.stream>>>(m->t_sinusoid.x, m->timesteps,
                                                                                          m->continuous_time ? m->time : NULL, N,
                                                                                          c->model_channels);
    cuda_check_launch();
    conv_forward(&m->time_embed0, m->t_hidden.x, m->t_sinusoid.x, N, 1, 1, NULL);
    silu_forward_kernel<<<blocks_for(N * D, 256), 256, 0, gpu.stream>>>(m->t_hidden_silu.x, m->t_hidden.x, N * D);
    conv_forward(&m->time_embed2, m->emb.x, m->t_hidden_silu.x, N, 1, 1, NULL);
    if (c->num_classes) {
        label_embedding_forward_kernel<<<(N * D + 255) / 256, 256, 0, gpu.stream>>>(m->emb.x, m->label_table, m->labels, N, D);
        cuda_check_launch();
    }
    silu_forward_kernel<<<blocks_for(N * D, 256), 256, 0, gpu.stream>>>(m->emb_silu.x, m->emb.x, N * D);
    cuda_check_launch();
    int E = (int)m->emb_total;
    matmul({.M = N, .N = E, .K = D, .a = m->emb_silu.x, .lda = D, .b = m->emb_all.w, .ldb = D, .trans_b = 1,
            .d = m->embedding.out, .ldd = E, .d_fp32 = 1});
    add_rows_kernel<<<(N * E + 255) / 256, 256, 0, gpu.stream>>>(m->embedding.out, m->emb_all.b, N, E);
    cuda_check_launch();
    for (int i = 0; i < m->num_blocks; i++) {
        if (before_block) before_block(ctx, i);
        block_forward(m, &m->blocks[i], training);
    }
}

static void unet_forward(UNet *m, int training) { unet_forward_watched(m, training, NULL, NULL); }

// The backward pass from m->output->dx: every parameter gradient into m->grad (when the model has
// them), and m->input.dx (if m->input_gradient).
// after_block(ctx, i), when given, runs after block i's backward (blocks go last to first): many
// GPUs start averaging the gradients that are final while the rest of backward runs.
static void unet_backward(UNet *m, int training, void (*after_block)(void *ctx, int block), void *ctx) {
    const ModelConfig *c = &m->config;
    int N = m->batch, D = 4 * c->model_channels, E = (int)m->emb_total;
    // The blocks write their gradients (see Block.in_grad); the embedding MLP's SiLU backward adds
    // into its input's (silu_backward_kernel), and the ResBlocks add their projections' per sample.
    if (m->parameter_gradients) {
        cuda_check(cudaMemsetAsync(m->emb.dx, 0, act_numel(&m->emb) * sizeof(floatX), gpu.stream));
        cuda_check(cudaMemsetAsync(m->t_hidden.dx, 0, act_numel(&m->t_hidden) * sizeof(floatX), gpu.stream));
        cuda_check(cudaMemsetAsync(m->embedding.d_out, 0, (size_t)N * E * sizeof(float), gpu.stream));
    }
    const Block *last = &m->blocks[m->num_blocks - 1];
    int spatial = last->kind == BLOCK_POOL && (last->pool.pool == POOL_SPATIAL || last->pool.pool == POOL_SPATIAL_V2);
    for (int i = m->num_blocks - 1; i >= 0; i--) {
        if (spatial) pool_head_source_backward(&last->pool, i);
        block_backward(m, &m->blocks[i], training);
        if (after_block) after_block(ctx, i);
    }
    if (!m->parameter_gradients) return;  // the embedding's gradients reach parameters only
    // The timestep projections of all ResBlocks at once, then the embedding MLP.
    float_to_floatx_kernel<<<blocks_for((int64_t)N * E, 256), 256, 0, gpu.stream>>>(m->d_emb_out_x, m->embedding.d_out, (int64_t)N * E);
    cuda_check_launch();
    conv_backward(&m->emb_all, m->emb_silu.dx, GRAD_WRITE, m->d_emb_out_x, m->emb_silu.x, N, 1, 1, NULL, 0, NULL);
    silu_backward_kernel<<<blocks_for(N * D, 256), 256, 0, gpu.stream>>>(m->emb.dx, m->emb_silu.dx, m->emb.x, N * D);
    cuda_check_launch();
    if (c->num_classes) {
        label_embedding_backward_kernel<<<(D + 127) / 128, 128, 0, gpu.stream>>>(m->d_label_table, m->emb.dx, m->labels, N, c->num_classes, D);
        cuda_check_launch();
    }
    conv_backward(&m->time_embed2, m->t_hidden_silu.dx, GRAD_WRITE, m->emb.dx, m->t_hidden_silu.x, N, 1, 1, NULL, 0, NULL);
    silu_backward_kernel<<<blocks_for(N * D, 256), 256, 0, gpu.stream>>>(m->t_hidden.dx, m->t_hidden_silu.dx, m->t_hidden.x, N * D);
    cuda_check_launch();
    conv_backward(&m->time_embed0, NULL, GRAD_ADD, m->t_hidden.dx, m->t_sinusoid.x, N, 1, 1, NULL, 0, NULL);
}

// Copies parameters given in PyTorch layout (host, fp32, checkpoint order) to the GPU.
static void unet_set_parameters(UNet *m, const float *const *values) {
    int64_t biggest = 0;
    for (int i = 0; i < m->params.count; i++) note_scratch(&biggest, m->params.specs[i].numel);
    float *staged = (float *)malloc_or_die(biggest * sizeof(float));
    for (int i = 0; i < m->params.count; i++) {
        const ParamSpec *p = &m->params.specs[i];
        param_layout(p, values[i], staged, 1);
        cuda_check(cudaMemcpy(m->master + p->offset, staged, p->numel * sizeof(float), cudaMemcpyHostToDevice));
    }
    free(staged);
    unet_sync_compute(m);
}

#ifdef TRAIN_UNET_LIBRARY
// Copies one parameter's gradient (or value, with `values`) to the host in PyTorch layout: for the
// GPU tests (the trainer itself never reads a parameter back).
static void unet_get_parameter(const UNet *m, int index, int gradient, float *out) {
    const ParamSpec *p = &m->params.specs[index];
    float *staged = (float *)malloc_or_die(p->numel * sizeof(float));
    cuda_check(cudaMemcpy(staged, (gradient ? m->grad : m->master) + p->offset, p->numel * sizeof(float), cudaMemcpyDeviceToHost));
    param_layout(p, staged, out, 0);
    free(staged);
}
#endif

// ----------------------------------------------------------------------------------------------
// Initialisation as PyTorch initialises guided-diffusion's UNetModel, from a seed: Conv and Linear
// weights and biases ~ U(-1/sqrt(fan_in), 1/sqrt(fan_in)) (kaiming_uniform with a = sqrt(5), and
// the matching bias rule), fan_in = in * k * k; Embedding ~ N(0, 1); GroupNorm weight 1, bias 0;
// the zero-initialised convs (out_layers.3, proj_out, the UNet's out.2 and the adaptive classifier's
// out.3: 2D convolutions of the head; the spatial classifiers' Linear layers are not) zero;
// the attention pool's positional_embedding ~ N(0, 1) / sqrt(C). Counter-based: parameter i,
// element j is a pure function of (seed, i, j).

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), k = strlen(suffix);
    return n >= k && strcmp(s + n - k, suffix) == 0;
}

static double uniform01(uint64_t seed, uint64_t stream, uint64_t index) {
    return ((random_u64(seed, stream, index) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

static void init_parameter(const ParamSpec *p, int index, uint64_t seed, float *out) {
    int is_bias = ends_with(p->name, "bias"), is_positions = strcmp(p->name, "out.2.positional_embedding") == 0;
    const ParamSpec *layer_weight = is_bias ? p - 1 : p;  // (a bias follows its layer's weight)
    // The output head's (out.*, the UNet's or a classifier's) GroupNorms are the layers whose weight
    // is a vector (a classifier's out.0, out.2 and out.3 may be Linear layers).
    int head = strncmp(p->name, "out.", 4) == 0;
    int is_norm = strstr(p->name, "in_layers.0.") || strstr(p->name, "out_layers.0.") || strstr(p->name, ".norm.") ||
                  (head && layer_weight->ndim == 1);
    int is_zero = strstr(p->name, "out_layers.3.") || strstr(p->name, "proj_out.") ||
                  ((strncmp(p->name, "out.2.", 6) == 0 || strncmp(p->name, "out.3.", 6) == 0) && layer_weight->ndim == 4);
    if (is_zero || (is_norm && is_bias)) {
        memset(out, 0, p->numel * sizeof(float));
    } else if (is_norm) {
        for (int64_t j = 0; j < p->numel; j++) out[j] = 1.0f;
    } else if (strncmp(p->name, "label_emb.", 10) == 0 || is_positions) {  // Box-Muller
        double scale = is_positions ? 1.0 / sqrt((double)p->shape[0]) : 1.0;
        for (int64_t j = 0; j < p->numel; j++) {
            double u1 = uniform01(seed, rng_stream(RNG_INIT, index), 2 * j), u2 = uniform01(seed, rng_stream(RNG_INIT, index), 2 * j + 1);
            out[j] = (float)(scale * sqrt(-2.0 * log(u1)) * cos(2.0 * M_PI * u2));
        }
    } else {
        // A bias takes its weight's fan_in: the weight is the previous tensor, [out][in][k...].
        const ParamSpec *w = is_bias ? p - 1 : p;
        int64_t fan_in = w->numel / w->shape[0];
        double bound = 1.0 / sqrt((double)fan_in);
        for (int64_t j = 0; j < p->numel; j++) out[j] = (float)((2.0 * uniform01(seed, rng_stream(RNG_INIT, index), j) - 1.0) * bound);
    }
}

static void unet_init_parameters(UNet *m, uint64_t seed) {
    float **values = (float **)malloc_or_die(m->params.count * sizeof(float *));
    for (int i = 0; i < m->params.count; i++) {
        values[i] = (float *)malloc_or_die(m->params.specs[i].numel * sizeof(float));
        init_parameter(&m->params.specs[i], i, seed, values[i]);
    }
    unet_set_parameters(m, values);
    for (int i = 0; i < m->params.count; i++) free(values[i]);
    free(values);
}

// ----------------------------------------------------------------------------------------------
// Profiling a step, block by block.

// A training step's model FLOPs on m's batch, the count model-FLOP utilisation takes: 2 FLOPs per
// multiply-add of every convolution and matrix product in forward (the 3x3 and 1x1 convolutions, the
// linear layers, attention's Q K^T and P V), and twice that in backward (input and weight
// gradients), less the input gradient of the image, which training does not compute. GroupNorm, the
// elementwise kernels and --use_checkpoint's recomputation are not counted.
static double conv_flops(const Conv *cv, int N, int out_side) {
    return 2.0 * N * out_side * out_side * cv->in * cv->out * cv->k * cv->k;
}

static double unet_training_flops(const UNet *m) {
    int N = m->batch, channels = m->config.model_channels, D = 4 * channels;
    double forward = 2.0 * N * ((double)channels * D + (double)D * D + (double)D * m->emb_total), image_gradient = 0.0;
    for (int i = 0; i < m->num_blocks; i++) {
        const Block *b = &m->blocks[i];
        int side = b->out.H;
        switch (b->kind) {
        case BLOCK_CONV: forward += image_gradient = conv_flops(&b->conv.conv, N, side); break;
        case BLOCK_RES:
            forward += conv_flops(&b->res.conv1, N, side) + conv_flops(&b->res.conv2, N, side);
            if (b->res.has_skip_conv) forward += conv_flops(&b->res.conv3, N, side);
            break;
        case BLOCK_ATTENTION: {
            double T = (double)side * side;
            forward += conv_flops(&b->attention.qkv, N, side) + conv_flops(&b->attention.proj, N, side) + 4.0 * N * T * T * b->out.C;
            break;
        }
        case BLOCK_DOWN: if (b->down.has_conv) forward += conv_flops(&b->down.conv, N, side); break;
        case BLOCK_UP: if (b->up.has_conv) forward += conv_flops(&b->up.conv, N, side); break;
        case BLOCK_OUT: forward += conv_flops(&b->head.conv, N, side); break;
        case BLOCK_POOL: {
            double T = (double)b->pool.tokens.W;
            forward += conv_flops(&b->pool.proj, N, 1) + (b->pool.linear.out ? conv_flops(&b->pool.linear, N, 1) : 0.0);
            if (b->pool.pool == POOL_ATTENTION) forward += 2.0 * N * T * b->pool.qkv.in * b->pool.qkv.out + 4.0 * N * T * T * b->pool.qkv.in;
            break;
        }
        case BLOCK_CONCAT: case NUM_BLOCK_KINDS: break;
        }
    }
    return 3.0 * forward - (m->input_gradient ? 0.0 : image_gradient);
}

// The dense BF16 tensor-core peak of a GPU, from its data sheet, by its name (TFLOP/s; 0: unknown).
static double bf16_peak_tflops(const char *name) {
    if (strstr(name, "H100") && strstr(name, "PCIe")) return 756.0;
    if (strstr(name, "H100") && strstr(name, "NVL")) return 835.0;
    if (strstr(name, "H100") || strstr(name, "H200")) return 989.4;
    if (strstr(name, "A100")) return 312.0;
    return 0.0;
}

// Where a step's time goes: each block's forward and backward timed with events (one eager step),
// summed by kind of block.
static void print_profile(UNet *m) {
    float forward[NUM_BLOCK_KINDS] = {0}, backward[NUM_BLOCK_KINDS] = {0}, ms;
    int count[NUM_BLOCK_KINDS] = {0};
    cudaEvent_t a, b;
    cuda_check(cudaEventCreate(&a));
    cuda_check(cudaEventCreate(&b));
    unet_forward(m, 1);  // the embedding and all blocks, to get the activations; then per block again
    for (int pass = 0; pass < 2; pass++)
        for (int j = 0; j < m->num_blocks; j++) {
            int i = pass == 0 ? j : m->num_blocks - 1 - j;
            Block *l = &m->blocks[i];
            cuda_check(cudaEventRecord(a, gpu.stream));
            if (pass == 0) block_forward(m, l, 1);
            else block_backward(m, l, 1);
            cuda_check(cudaEventRecord(b, gpu.stream));
            cuda_check(cudaEventSynchronize(b));
            cuda_check(cudaEventElapsedTime(&ms, a, b));
            (pass == 0 ? forward : backward)[l->kind] += ms;
            count[l->kind] += pass == 0;
        }
    printf("profile (one eager step, GPU time by kind of block):\n  %-11s %6s %10s %10s\n", "block", "count", "fwd ms", "bwd ms");
    for (int k = 0; k < NUM_BLOCK_KINDS; k++)
        if (count[k]) printf("  %-11s %6d %10.3f %10.3f\n", block_kind_names[k], count[k], forward[k], backward[k]);
    // The parts of the first ResBlock's backward.
    Block *first = NULL;
    for (int i = 0; i < m->num_blocks && !first; i++)
        if (m->blocks[i].kind == BLOCK_RES) first = &m->blocks[i];
    ResBlock *l = &first->res;
    const Act *out = &first->out;
    int N = m->batch, H = out->H, W = out->W, C = l->conv2.in;
    NormOptions o = res_block_norm2(l, &m->embedding, 1);
    const Scratch *s = &m->scratch;
    printf("  first ResBlock (%dx%d, %d -> %d channels), parts in ms:\n", H, W, l->conv1.in, l->conv1.out);
    static const char *const parts[] = {"conv forward", "conv backward", "  weight gradient", "  bias gradient",
                                        "  input gradient", "group norm forward", "group norm backward"};
    for (int part = 0; part < 7; part++) {
        cuda_check(cudaEventRecord(a, gpu.stream));
        switch (part) {
        case 0: conv_forward(&l->conv2, out->x, l->h2.x, N, H, W, NULL); break;
        case 1: conv_backward(&l->conv2, l->h2.dx, GRAD_WRITE, out->dx, l->h2.x, N, H, W, NULL, 0, NULL); break;
        case 2: conv3x3_backward_weight(l->conv2.dw, s->weight_grad, out->dx, C, l->h2.x, C, N, H, W, C, C, 1); break;
        case 3: channel_sums(s, NULL, 0, l->conv2.db, out->dx, N, H * W, l->conv2.out); break;
        case 4:
            conv3x3_backward_input(l->h2.dx, C, GRAD_WRITE, out->dx, C, l->conv2.w, N, H, W, C, C, 1, s->conv_split,
                                   s->conv_split_numel);
            break;
        case 5: group_norm_forward(&l->norm2, l->h2.x, l->mean2, l->rstd2, l->h1.x, N, H * W, o, NO_SUMS, NO_SUMS); break;
        case 6:  // as res_block_backward runs it: recomputing h2 and leaving h1.dx's sums too
            group_norm_backward(&l->norm2, l->h1.dx, GRAD_WRITE, NULL, l->conv1.dw ? s->gn_dx_sums : NULL, m->embedding.d_out + l->emb_offset,
                                l->h2.dx, l->h1.x, l->h2.x, l->mean2, l->rstd2, N, H * W, o);
            break;
        }
        cuda_check(cudaEventRecord(b, gpu.stream));
        cuda_check(cudaEventSynchronize(b));
        cuda_check(cudaEventElapsedTime(&ms, a, b));
        printf("    %-20s %8.3f\n", parts[part], ms);
    }
}

static int compare_floats(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

static int compare_int64(const void *a, const void *b) {
    int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
    return (x > y) - (x < y);
}

// ----------------------------------------------------------------------------------------------
// The data loader: maps a dataset file, serves shuffled batches of uint8 NHWC images and int32
// labels in host buffers (pinned for fast copies when a GPU is used); the trainer converts them to
// the model's input on the GPU (images_to_model_input).
//
// Order: epoch e visits the images in a Fisher-Yates permutation drawn from (seed, e); image i of
// that order is flipped horizontally when bit 0 of random(seed, flip stream, e*count + i) is set.
// Both are pure functions of the position (epoch, next), so saving those two numbers and seeking
// back to them reproduces every later batch exactly. Batches run on across epoch boundaries.
//
// Many GPUs: a step takes the next world * batch_size images of the order, and rank r's batch is
// the r-th batch_size of them; every rank moves past all of them, so the position stays one.

typedef struct {
    uint64_t epoch;  // epochs completed
    uint64_t next;   // index into the epoch's order of the next image to serve
} LoaderPosition;

typedef struct {
    Dataset data;
    const char *path;
    int batch_size;          // images per batch of this rank
    int rank, world;         // this rank's batch among the step's world batches
    int random_flip;
    uint64_t seed;
    LoaderPosition position;
    uint32_t *order;         // the current epoch's permutation of 0..count-1
    uint8_t *batch_pixels;   // [batch_size][height][width][3]
    int32_t *batch_labels;   // [batch_size], -1 when the dataset is unlabelled
    int pinned;              // batch buffers are page-locked (cudaMallocHost)
    int read_ahead;          // after each batch, ask the kernel for the next one's pages (loader_read_ahead)
} DataLoader;

// Draws epoch `epoch`'s order: a uniform random permutation (Fisher-Yates).
static void loader_shuffle(DataLoader *loader, uint64_t epoch) {
    uint64_t n = loader->data.header.count, counter = 0;
    for (uint64_t i = 0; i < n; i++) loader->order[i] = (uint32_t)i;
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = random_below(loader->seed, rng_stream(RNG_SHUFFLE, epoch), &counter, i + 1);
        uint32_t t = loader->order[i];
        loader->order[i] = loader->order[j];
        loader->order[j] = t;
    }
}

// Moves to a saved position (epoch, next); next must be at most the image count.
static int loader_seek(DataLoader *loader, LoaderPosition position, char *err, size_t err_len) {
    if (position.next > loader->data.header.count)
        return error_line(err, err_len, "data position %" PRIu64 " is past the dataset's %" PRIu64 " images",
                            position.next, loader->data.header.count);
    loader->position = position;
    loader_shuffle(loader, position.epoch);
    return 0;
}

// A dataset file truncated while it is mapped raises SIGBUS at the first read of a lost page. The
// handler ends the process with one line instead of a crash; the last checkpoint stays intact (every
// checkpoint is written whole, then renamed). A fault anywhere else gets the default action. It
// watches the dataset the last loader_open mapped (each file of one in parts).
static struct {
    const Dataset *data;
    char message[600];
    size_t length;
} watched_dataset;

static void on_dataset_fault(int sig, siginfo_t *info, void *) {
    const uint8_t *at = (const uint8_t *)info->si_addr;
    const Dataset *d = watched_dataset.data;
    for (int k = 0; d && k < dataset_files(d); k++) {
        const Dataset *file = dataset_file(d, k);
        if (at >= file->map && at < file->map + file->layout.file_bytes) {
            ssize_t written = write(STDERR_FILENO, watched_dataset.message, watched_dataset.length);
            (void)written;  // nothing more can be done about a failed write here
            _exit(1);
        }
    }
    signal(sig, SIG_DFL);  // the fault comes again on return, with the default action
}

static void watch_dataset(const Dataset *data, const char *path) {
    watched_dataset.data = data;
    int n = snprintf(watched_dataset.message, sizeof watched_dataset.message, "%s: error: dataset %.400s changed while training "
                     "(it was cut short); the last checkpoint is intact\n", program_name, path);
    watched_dataset.length = n < (int)sizeof watched_dataset.message ? n : sizeof watched_dataset.message - 1;
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_sigaction = on_dataset_fault;
    sa.sa_flags = SA_SIGINFO;
    sigaction(SIGBUS, &sa, NULL);
}

// Opens and checks a dataset (`path`: one file or its parts, dataset_open_parts's spec), watches its
// mapping (watch_dataset) and allocates the batch buffers.
// `checked` is the header the caller checked the file against the run's options with (NULL: none):
// the file opened here must have the same, or it was replaced in between. Returns 0, or -1 with a
// message.
static int loader_open(DataLoader *loader, const char *path, const DatasetHeader *checked, int batch_size, int rank, int world,
                       int random_flip, uint64_t seed, int pinned, char *err, size_t err_len) {
    memset(loader, 0, sizeof *loader);
    if (dataset_open_parts(path, &loader->data, err, err_len) != 0) return -1;
    const DatasetHeader *h = &loader->data.header;  // count <= DATASET_MAX_COUNT: the order's 32-bit indices hold it
    if (checked && memcmp(checked, h, sizeof *h) != 0) {
        error_line(err, err_len, "dataset %s changed since it was checked (%" PRIu64 " images of %ux%u, %u classes, now %" PRIu64
                     " of %ux%u, %u classes): start again", path, checked->count, checked->width, checked->height,
                     checked->num_classes, h->count, h->width, h->height, h->num_classes);
        dataset_close(&loader->data);
        return -1;
    }
    watch_dataset(&loader->data, path);
    loader->path = path;
    loader->batch_size = batch_size;
    loader->rank = rank, loader->world = world;
    loader->random_flip = random_flip;
    loader->seed = seed;
    loader->pinned = pinned;
    loader->read_ahead = 1;
    loader->order = (uint32_t *)malloc_or_die(h->count * sizeof(uint32_t));
    size_t pixel_bytes = (size_t)batch_size * loader->data.layout.image_bytes;
    size_t label_bytes = (size_t)batch_size * sizeof(int32_t);
    if (pinned) {
        cuda_check(cudaMallocHost((void **)&loader->batch_pixels, pixel_bytes));
        cuda_check(cudaMallocHost((void **)&loader->batch_labels, label_bytes));
    } else {
        loader->batch_pixels = (uint8_t *)malloc_or_die(pixel_bytes);
        loader->batch_labels = (int32_t *)malloc_or_die(label_bytes);
    }
    LoaderPosition start = {0, 0};
    return loader_seek(loader, start, err, err_len);
}

static void loader_close(DataLoader *loader) {
    if (loader->pinned) {
        cudaFreeHost(loader->batch_pixels);
        cudaFreeHost(loader->batch_labels);
    } else {
        free(loader->batch_pixels);
        free(loader->batch_labels);
    }
    free(loader->order);
    if (watched_dataset.data == &loader->data) watched_dataset.data = NULL;
    dataset_close(&loader->data);
    memset(loader, 0, sizeof *loader);
}

// Asks the kernel to read this rank's images of the next step into the page cache now
// (madvise(MADV_WILLNEED) on their pages), so that a dataset larger than memory is read while the
// GPU runs the step, all of a batch's reads at once, instead of page fault by page fault in the next
// loader_next_batch. Images past the end of the epoch (whose order is not drawn yet) are left to
// their faults.
static void loader_read_ahead(const DataLoader *loader) {
    const DatasetHeader *h = &loader->data.header;
    size_t image_bytes = loader->data.layout.image_bytes;
    uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
    for (int b = 0; b < loader->batch_size; b++) {
        uint64_t at = loader->position.next + (uint64_t)loader->rank * loader->batch_size + b;
        if (at >= h->count) break;
        uintptr_t begin = (uintptr_t)dataset_image(&loader->data, loader->order[at]), first = begin & ~(page - 1);
        madvise((void *)first, begin + image_bytes - first, MADV_WILLNEED);  // (advice: a failure changes nothing)
    }
}

// Fills the batch buffers with this rank's batch_size images (and labels) of the next step and
// advances the position past the step's images on every rank.
static void loader_next_batch(DataLoader *loader) {
    const DatasetHeader *h = &loader->data.header;
    size_t image_bytes = loader->data.layout.image_bytes, row_bytes = (size_t)h->width * h->channels;
    for (int64_t i = 0; i < (int64_t)loader->world * loader->batch_size; i++) {
        if (loader->position.next == h->count) {
            loader->position.epoch++;
            loader->position.next = 0;
            loader_shuffle(loader, loader->position.epoch);
        }
        uint64_t slot = loader->position.epoch * h->count + loader->position.next;
        uint32_t image = loader->order[loader->position.next++];
        int64_t b = i - (int64_t)loader->rank * loader->batch_size;  // this rank's image b
        if (b < 0 || b >= loader->batch_size) continue;
        const uint8_t *src = dataset_image(&loader->data, image);
        uint8_t *dst = loader->batch_pixels + b * image_bytes;
        int flip = loader->random_flip && (random_u64(loader->seed, rng_stream(RNG_FLIP, 0), slot) & 1);
        if (!flip) {
            memcpy(dst, src, image_bytes);
        } else {
            for (uint32_t y = 0; y < h->height; y++)
                for (uint32_t x = 0; x < h->width; x++)
                    memcpy(dst + y * row_bytes + x * h->channels, src + y * row_bytes + (h->width - 1 - x) * h->channels,
                           h->channels);
        }
        int32_t label = h->num_classes ? dataset_label(&loader->data, image) : -1;
        if (h->num_classes && (label < 0 || (uint32_t)label >= h->num_classes))  // checked at open: rewritten since
            fatal("dataset %s changed while training: image %u has label %d, outside 0..%u", loader->path, image, label,
                  h->num_classes - 1);
        loader->batch_labels[b] = label;
    }
    if (loader->read_ahead) loader_read_ahead(loader);
}

// ----------------------------------------------------------------------------------------------
// Diffusion training, on guided-diffusion's schedules (sampler.h): t drawn uniformly in [0, T),
// noise eps ~ N(0, I), x_t = sqrt(abar_t) x0 + sqrt(1 - abar_t) eps, and the model's output
// regressed on eps (--predict eps), on v = sqrt(abar_t) eps - sqrt(1 - abar_t) x0 (--predict v) or
// on x0 (--predict x0). A model with a learned variance (learn_sigma) adds the variational bound's
// term (improved DDPM's hybrid loss, below).

// The training's diffusion: its configuration, its schedule and each timestep's terms (sampler.h's
// TimestepTerms) on the GPU.
typedef struct {
    DiffusionConfig config;
    NoiseSchedule schedule;
    TimestepTerms *terms;  // [steps], GPU
} Diffusion;

static void diffusion_create(Diffusion *d, const DiffusionConfig *config) {
    int steps = config->steps;
    d->config = *config;
    if (noise_schedule_make(&d->schedule, steps, config->schedule) != 0) fatal("unknown noise schedule '%s'", config->schedule);
    TimestepTerms *host = (TimestepTerms *)malloc_or_die(steps * sizeof(TimestepTerms));
    for (int t = 0; t < steps; t++) host[t] = timestep_terms(&d->schedule, t);
    d->terms = (TimestepTerms *)gpu_malloc(steps * sizeof(TimestepTerms));
    cuda_check(cudaMemcpy(d->terms, host, steps * sizeof(TimestepTerms), cudaMemcpyHostToDevice));
    free(host);
}

// guided-diffusion's LossSecondMomentResampler (--schedule_sampler loss-second-moment): the last
// LOSS_HISTORY losses of each timestep. Until every t has them, t is drawn uniformly; then
//   p_t = 0.999 w_t / sum_s w_s + 0.001 / T,  w_t = sqrt(mean of t's losses^2),
// and each sample's loss is weighted by 1 / (T p_t), which keeps the loss's expectation. Kept on the
// host in double, as there: after each step every rank adds every rank's (t, loss) in the order of
// the samples (update_with_all_losses), so all ranks hold the same history; it is saved in state.bin.
#define LOSS_HISTORY 10
#define LOSS_HISTORY_UNIFORM 0.001

typedef struct {
    int steps;         // T
    int32_t *counts;   // [T]: the losses held of each t
    float *losses;     // [T][LOSS_HISTORY], oldest first
} LossHistory;

static void loss_history_create(LossHistory *h, int steps) {
    h->steps = steps;
    h->counts = (int32_t *)calloc(steps, sizeof(int32_t));
    h->losses = (float *)calloc((size_t)steps * LOSS_HISTORY, sizeof(float));
    if (!h->counts || !h->losses) fatal("out of host memory");
}

// One sample's loss: appended, the oldest dropped once t holds LOSS_HISTORY.
static void loss_history_add(LossHistory *h, int t, float loss) {
    float *row = h->losses + (size_t)t * LOSS_HISTORY;
    if (h->counts[t] < LOSS_HISTORY) {
        row[h->counts[t]++] = loss;
        return;
    }
    memmove(row, row + 1, (LOSS_HISTORY - 1) * sizeof(float));
    row[LOSS_HISTORY - 1] = loss;
}

// The distribution of the next draws: p[0..T) and its cumulative sums in p[T..2T). Returns 0 (and
// leaves p alone) while some t lacks its history: then t is drawn uniformly.
static int loss_history_distribution(const LossHistory *h, double *p) {
    int T = h->steps;
    for (int t = 0; t < T; t++)
        if (h->counts[t] < LOSS_HISTORY) return 0;
    double total = 0, cumulative = 0;
    for (int t = 0; t < T; t++) {
        double squares = 0;
        for (int k = 0; k < LOSS_HISTORY; k++) squares += (double)h->losses[t * LOSS_HISTORY + k] * h->losses[t * LOSS_HISTORY + k];
        p[t] = sqrt(squares / LOSS_HISTORY);
        total += p[t];
    }
    if (!(total > 0)) return 0;  // every loss 0: nothing to weight by
    for (int t = 0; t < T; t++) {
        p[t] = (1.0 - LOSS_HISTORY_UNIFORM) * p[t] / total + LOSS_HISTORY_UNIFORM / T;
        cumulative += p[t];
        p[T + t] = cumulative;
    }
    return 1;
}


// ----------------------------------------------------------------------------------------------
// The trainer: one training step as a CUDA graph (the last step's AdamW and EMA beside the forward,
// batch copied in, noised, forward, loss, backward, gradient norm, results copied out), the schedule
// around it, checkpoints.

#define MAX_UPDATE_CHUNKS 16  // trainer_plan_update's chunks: at most 13 (the first, 11 of a twelfth, the rest)

typedef struct {
    ModelConfig config;
    TrainConfig train;
    UNet m;
    Diffusion diffusion;
    uint8_t *pixels;       // the pinned host batch the step copies in ([batch][H][W][3])
    int32_t *labels;       // [batch], with pixels
    uint8_t *d_pixels;
    floatX *x0;
    // --microbatch: the model runs on pieces of the batch (m.batch images each), one after the
    // other; their parameter gradients are summed in grad_sum (GPU [storage] fp32) and the last
    // piece's are added to it before the optimiser (gradient_accumulate)
    int pieces;
    float *grad_sum;
    float *ema[MAX_EMA_RATES];  // [storage] fp32 each, GPU layout like master: one a rate of train.ema_rates
    StepState *host_state, *state;  // pinned, GPU
    // A step's parameter update runs in the next step, beside its forward (trainer_plan_update)
    StepState *update_state;  // GPU: the decision (learning rate, gradient scale, finite) of the step whose update waits
    int update_pending;       // a step ran since the last trainer_settle: its update waits for the next step
    int update_chunks;
    int64_t update_to[MAX_UPDATE_CHUNKS];  // chunk c updates the storage from update_to[c - 1] (0 for the first) to update_to[c]
    int update_block[MAX_UPDATE_CHUNKS];   // the first block whose forward reads chunk c (num_blocks: none)
    cudaEvent_t update_fork, update_done[MAX_UPDATE_CHUNKS];
    int update_waited;        // while the step is captured: the chunks the main stream waits for so far
    double *norm_partial;
    int classifier;        // the noisy classifier (--model classifier): its loss, on the labels
    LossKind loss_kind;
    LossOutputs loss;
    float *sample_weights;  // GPU [batch_size]: each sample's weight in the loss
    float *sigma;           // GPU [a piece's images]: an EDM model's noise levels (edm_conditions_kernel)
    // --schedule_sampler loss-second-moment: the history, the distribution of the step's draws
    // (p then its cumulative sums, [2][T], pinned and GPU) and every rank's (t, loss) of the step
    // ([world][batch][2], GPU and pinned)
    int weighted_draws;
    LossHistory history;
    double *distribution_host, *distribution;
    float *gathered, *gathered_host;
    cudaGraphExec_t graph;
    cudaEvent_t done;      // recorded after each step
    // A classifier's evaluations (--val_data): the batch (the validation loader's pinned buffers),
    // a state of their own (the draws' seed), the loss's outputs and its terms on the host, and the
    // graph of one evaluation
    const uint8_t *eval_pixels;
    const int32_t *eval_labels;
    StepState *eval_state_host, *eval_state;
    LossOutputs eval_loss;
    float *eval_terms;
    cudaGraphExec_t eval_graph;
    int num_buckets;       // many GPUs: the gradients' all-reduce in pieces (team_plan_buckets)
    int bucket_block[MAX_SKIPS];
    int64_t bucket_from[MAX_SKIPS];
    int others_wait;       // rank 0 wrote a checkpoint or samples since the last step: the next may wait long
                           // (on the other ranks: rank 0 itself comes to that step last, and waits as on any other)
    double slowest_wait;   // a team's longest wait on an ordinary step so far (seconds)
    int64_t step;          // steps completed
} Trainer;

// The parameters' update beside the next step's forward. AdamW with the EMAs is bound by memory
// (38 bytes a parameter: 5.3 ms of adm128:16's step on an H100) and the forward mostly by its
// products, so step k's update runs at the start of step k + 1 on the lowest-priority stream
// (gpu.update), in chunks of the parameters in the order the forward reads them: block i's forward
// waits only for the chunks up to the one holding its parameters, the backward for all of them.
// The parameters lie in the forward's order (param_offsets: the emb_layers first, which the
// forward's start reads with the time and class embeddings, then the rest in order), so chunk 0
// runs to the end of the first block's parameters, and each later one at least a twelfth of the
// storage (the last: what is left). The values are an update's at the end of the step: the same kernels on the same numbers,
// with step k's decision (update_state, the step's state copied at its end). What reads the
// parameters between steps (a checkpoint, samples, an evaluation, the weights' hash) applies the
// pending update first (trainer_settle).
static void trainer_plan_update(Trainer *tr) {
    const UNet *m = &tr->m;
    const ParamList *params = &m->params;
    int64_t from = 0, chunk = (m->storage + 11) / 12, end = 0;  // end: of the parameters walked so far
    int n = 0, first = -1, k = 0;  // first: the first block that reads the open chunk
    for (int i = 0; i < m->num_blocks; i++) {
        for (; k < m->blocks[i].param_count; k++) {
            int64_t to = params->specs[k].offset + params->specs[k].numel;
            if (to > end) end = to;
        }
        int64_t needed = (end + 63) / 64 * 64 < m->storage ? (end + 63) / 64 * 64 : m->storage;  // block i's forward reads up to here
        if (needed > from && first < 0) first = i;
        if (needed > from && (n == 0 || needed - from >= chunk)) tr->update_to[n] = from = needed, tr->update_block[n++] = first, first = -1;
        if (n == MAX_UPDATE_CHUNKS) fatal("internal: the update's plan needs more than %d chunks", MAX_UPDATE_CHUNKS);
    }
    if (from < m->storage) tr->update_to[n] = m->storage, tr->update_block[n++] = first >= 0 ? first : m->num_blocks;
    tr->update_chunks = n;
    for (k = 0; k < params->count; k++)  // the forward's start reads every block's emb_layers: chunk 0 must hold them
        if ((is_emb_layer(params->specs[k].name, "weight") || is_emb_layer(params->specs[k].name, "bias")) &&
            params->specs[k].offset + params->specs[k].numel > tr->update_to[0])
            fatal("internal: %s lies past the update's first chunk", params->specs[k].name);
}

// Step k's update of the storage [from, to) by its decision (update_state), on gpu.stream: AdamW
// with the first EMA, then the others.
static void trainer_update_range(Trainer *tr, int64_t from, int64_t to) {
    UNet *m = &tr->m;
    const TrainConfig *train = &tr->train;
    floatX *copy = (void *)m->compute == (void *)m->master ? NULL : m->compute + from;
    adamw_step(m->master + from, copy, m->adam_m + from, m->adam_v + from, m->grad + from, to - from, tr->update_state, train->beta1,
               train->beta2, train->adam_eps, train->weight_decay, train->num_ema ? tr->ema[0] + from : NULL,
               train->num_ema ? train->ema_rates[0] : 0.0f);
    for (int i = 1; i < train->num_ema; i++)  // (the first: in AdamW's pass)
        ema_kernel<<<blocks_for(to - from, 256), 256, 0, gpu.stream>>>(tr->ema[i] + from, m->master + from, to - from,
                                                                        train->ema_rates[i], tr->update_state);
    cuda_check_launch();
}

// At a step's start: the last step's update, chunk by chunk on the update stream.
static void trainer_enqueue_update(Trainer *tr) {
    cuda_check(cudaEventRecord(tr->update_fork, gpu.main));
    cuda_check(cudaStreamWaitEvent(gpu.update, tr->update_fork, 0));
    gpu.stream = gpu.update;
    for (int c = 0; c < tr->update_chunks; c++) {
        trainer_update_range(tr, c ? tr->update_to[c - 1] : 0, tr->update_to[c]);
        cuda_check(cudaEventRecord(tr->update_done[c], gpu.update));
    }
    gpu.stream = gpu.main;
    tr->update_waited = 0;
}

// The main stream waits for the chunks that block `block`'s forward reads (unet_forward_watched's
// before_block; INT_MAX: all of them).
static void trainer_wait_update(void *ctx, int block) {
    Trainer *tr = (Trainer *)ctx;
    while (tr->update_waited < tr->update_chunks && tr->update_block[tr->update_waited] <= block)
        cuda_check(cudaStreamWaitEvent(gpu.main, tr->update_done[tr->update_waited++], 0));
}

// Applies the pending update now, and marks it applied (the next step's chunks then change nothing).
static void trainer_settle(Trainer *tr) {
    if (!tr->update_pending) return;
    trainer_update_range(tr, 0, tr->m.storage);
    cuda_check(cudaMemsetAsync(&tr->update_state->finite, 0, sizeof(int), gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    tr->update_pending = 0;
}

// Many GPUs: the gradients' all-reduce in buckets, each begun beside backward as soon as backward
// has passed the blocks whose parameters it holds. The parameters lie in guided-diffusion's order
// (param_offsets; the emb_layers apart, at the start), the decoder last, so once backward has done
// output_blocks.J (whose first block is the J-th concatenation) the storage from output_blocks.J's
// first parameter to the end is final: bucket J runs from there to bucket J + 1. The rest (the
// encoder, the middle block, the embeddings) follows backward.
static void team_plan_buckets(Trainer *tr) {
    const UNet *m = &tr->m;
    int n = 0;
    for (int i = 0; i < m->num_blocks; i++)
        if (m->blocks[i].kind == BLOCK_CONCAT) tr->bucket_block[n] = i, tr->bucket_from[n++] = m->storage;
    tr->num_buckets = 0;
    if (n == 0) return;  // no decoder (a classifier): the whole all-reduce after backward
    for (int k = 0; k < m->params.count; k++) {
        const ParamSpec *p = &m->params.specs[k];
        int j;
        if (!is_emb_layer(p->name, "weight") && !is_emb_layer(p->name, "bias") && sscanf(p->name, "output_blocks.%d.", &j) == 1 &&
            j >= 0 && j < n && p->offset < tr->bucket_from[j])
            tr->bucket_from[j] = p->offset;
    }
    for (int k = 0; k < m->params.count; k++) {  // the order this relies on
        const ParamSpec *p = &m->params.specs[k];
        int decoder = strncmp(p->name, "output_blocks.", 14) == 0 || strncmp(p->name, "out.", 4) == 0;
        if (!is_emb_layer(p->name, "weight") && !is_emb_layer(p->name, "bias") && (p->offset >= tr->bucket_from[0]) != decoder)
            fatal("internal: parameter %s lies out of the decoder's order", p->name);
    }
    for (int j = 0; j + 1 < n; j++)
        if (tr->bucket_from[j] >= tr->bucket_from[j + 1]) fatal("internal: output_blocks.%d's parameters out of order", j);
    tr->num_buckets = n;
}

// Gradient accumulation over the pieces of a step's batch (--microbatch). The backward kernels write
// the parameter gradients (they never add), so the sum lives apart, in grad_sum: after each piece
// but the last its gradients go there (the first piece's copied, the others' added), and the last
// piece's are added to it in place (gradient_add_pieces), with many GPUs bucket by bucket just
// before each bucket's all-reduce. It costs one more fp32 copy of the parameters and a pass over it
// per piece.
static void gradient_accumulate(Trainer *tr, int piece) {
    if (piece == 0)
        cuda_check(cudaMemcpyAsync(tr->grad_sum, tr->m.grad, tr->m.storage * sizeof(float), cudaMemcpyDeviceToDevice, gpu.stream));
    else add_floats(tr->grad_sum, tr->m.grad, tr->m.storage);
}

static void gradient_add_pieces(Trainer *tr, int64_t from, int64_t to) {
    if (tr->pieces > 1) add_floats(tr->m.grad + from, tr->grad_sum + from, to - from);
}

static void team_reduce_bucket(Trainer *tr, int j) {
    int64_t to = j + 1 < tr->num_buckets ? tr->bucket_from[j + 1] : tr->m.storage;
    gradient_add_pieces(tr, tr->bucket_from[j], to);
    team_average_beside(tr->m.grad + tr->bucket_from[j], to - tr->bucket_from[j]);
}

// unet_backward's after_block: block i done, its bucket (if it begins one) goes to the all-reduce.
static void team_reduce_after_block(void *ctx, int block) {
    Trainer *tr = (Trainer *)ctx;
    for (int j = 0; j < tr->num_buckets; j++)
        if (tr->bucket_block[j] == block) team_reduce_bucket(tr, j);
}

// After backward: the rest of the gradients, and the main stream waits for all of them.
static void team_reduce_rest(Trainer *tr) {
    int64_t to = tr->num_buckets ? tr->bucket_from[0] : tr->m.storage;
    gradient_add_pieces(tr, 0, to);
    team_average_beside(tr->m.grad, to);
    team_join_beside();
}

static void trainer_create(Trainer *tr, const ModelConfig *c, const DiffusionConfig *d, const TrainConfig *train, uint8_t *pixels,
                           int32_t *labels) {
    memset(tr, 0, sizeof *tr);
    tr->config = *c, tr->train = *train;
    tr->pixels = pixels, tr->labels = labels;
    tr->pieces = train->batch_size / train->piece;
    unet_create(&tr->m, c, train->piece, training_mode(train));
    if (tr->pieces > 1) {
        tr->grad_sum = (float *)gpu_malloc(tr->m.storage * sizeof(float));
        cuda_check(cudaMemset(tr->grad_sum, 0, tr->m.storage * sizeof(float)));
    }
    tr->m.input_gradient = 0;  // the noisy images' gradient: a 3-channel input gradient nothing reads
    diffusion_create(&tr->diffusion, d);
    for (int i = 0; i < train->num_ema; i++) {
        tr->ema[i] = (float *)gpu_malloc(tr->m.storage * sizeof(float));
    }
    cuda_check(cudaMallocHost((void **)&tr->host_state, sizeof(StepState)));
    memset(tr->host_state, 0, sizeof(StepState));
    tr->state = (StepState *)gpu_malloc(sizeof(StepState));
    tr->update_state = (StepState *)gpu_malloc(sizeof(StepState));
    cuda_check(cudaMemset(tr->update_state, 0, sizeof(StepState)));  // (not finite: nothing to update before step 1)
    cuda_check(cudaEventCreateWithFlags(&tr->update_fork, cudaEventDisableTiming));
    for (int c = 0; c < MAX_UPDATE_CHUNKS; c++) cuda_check(cudaEventCreateWithFlags(&tr->update_done[c], cudaEventDisableTiming));
    trainer_plan_update(tr);
    tr->m.embedding.dropout_seed = &tr->state->noise_seed;  // dropout draws from the step's seed too
    tr->m.embedding.first_sample = (int64_t)team.rank * train->batch_size;
    cuda_check(cudaEventCreateWithFlags(&tr->done, cudaEventDisableTiming));
    if (team.comm) team_plan_buckets(tr);
    tr->norm_partial = (double *)gpu_malloc(NORM_BLOCKS * sizeof(double));
    tr->classifier = c->pool != POOL_NONE;
    int T = d->steps;
    tr->loss_kind = loss_kind(d);
    tr->loss = loss_outputs_create(train->batch_size, c->image_size * c->image_size);
    tr->sample_weights = (float *)gpu_malloc(train->batch_size * sizeof(float));
    if (d->predict == PREDICT_EDM) tr->sigma = (float *)gpu_malloc(tr->m.batch * sizeof(float)), tr->m.continuous_time = 1;
    tr->weighted_draws = d->timesteps == TIMESTEPS_LOSS_SECOND_MOMENT;
    if (tr->weighted_draws) {
        loss_history_create(&tr->history, T);
        cuda_check(cudaMallocHost((void **)&tr->distribution_host, 2 * T * sizeof(double)));
        tr->distribution = (double *)gpu_malloc(2 * T * sizeof(double));
        size_t gathered = (size_t)team.world * train->batch_size * 2 * sizeof(float);
        tr->gathered = (float *)gpu_malloc(gathered);
        cuda_check(cudaMallocHost((void **)&tr->gathered_host, gathered));
    }
    int64_t n = image_values(&tr->m) * tr->pieces;
    tr->d_pixels = (uint8_t *)gpu_malloc(n);
    tr->x0 = (floatX *)gpu_malloc(n * sizeof(floatX));
}

// A classifier's evaluations on the batches that appear in these buffers (a loader's).
static void trainer_add_evaluation(Trainer *tr, const uint8_t *pixels, const int32_t *labels) {
    tr->eval_pixels = pixels, tr->eval_labels = labels;
    cuda_check(cudaMallocHost((void **)&tr->eval_state_host, sizeof(StepState)));
    memset(tr->eval_state_host, 0, sizeof(StepState));
    tr->eval_state = (StepState *)gpu_malloc(sizeof(StepState));
    tr->eval_loss = loss_outputs_create(tr->train.batch_size, 1);
    cuda_check(cudaMallocHost((void **)&tr->eval_terms, LOSS_TERMS * sizeof(float)));
}

// Every EMA starts from the current weights.
static void trainer_reset_ema(Trainer *tr) {
    for (int i = 0; i < tr->train.num_ema; i++)
        cuda_check(cudaMemcpy(tr->ema[i], tr->m.master, tr->m.storage * sizeof(float), cudaMemcpyDeviceToDevice));
}

// The kernels of one step, in stream order (captured once as the step's graph). With --microbatch
// the model runs once per piece of the batch, each piece numbered within the step's batch as the
// whole batch would be (its images, noise, timesteps, labels and dropout the same), the loss of
// each over the whole batch's count so that the pieces' gradients add up to the whole batch's.
// The batch's images from the host (pixels: [batch_size][H][W][3]) into tr->x0, in the model's range.
static void trainer_enqueue_images(Trainer *tr, const uint8_t *pixels) {
    size_t bytes = (size_t)tr->train.batch_size * (image_values(&tr->m) / tr->m.batch);
    cuda_check(cudaMemcpyAsync(tr->d_pixels, pixels, bytes, cudaMemcpyHostToDevice, gpu.stream));
    images_to_model_input(tr->x0, tr->d_pixels, bytes, gpu.stream);
}

// Piece `piece` of the batch (tr->x0, labels on the host) into the model's input: its labels, its
// timesteps and x_t (drawn from the seed in `state`; a classifier without --noised: the clean
// images at t = 0), and a diffusion model's regression target.
static void trainer_enqueue_piece(Trainer *tr, int piece, const int32_t *labels, const StepState *state) {
    UNet *m = &tr->m;
    const TrainConfig *train = &tr->train;
    int N = m->batch;
    int64_t n = image_values(m), per_image = n / N, first = (int64_t)piece * N, first_sample = (int64_t)team.rank * train->batch_size + first;
    m->embedding.first_sample = first_sample;  // dropout's numbering, in forward and backward
    if (tr->config.num_classes || tr->classifier)
        cuda_check(cudaMemcpyAsync(m->labels, labels + first, N * sizeof(int), cudaMemcpyHostToDevice, gpu.stream));
    if (tr->classifier && !train->noised) {
        cuda_check(cudaMemsetAsync(m->timesteps, 0, N * sizeof(int64_t), gpu.stream));
        cuda_check(cudaMemcpyAsync(m->input.x, tr->x0 + first * per_image, n * sizeof(floatX), cudaMemcpyDeviceToDevice, gpu.stream));
        return;
    }
    const ModelConfig *c = &tr->config;
    const DiffusionConfig *d = &tr->diffusion.config;
    if (d->predict == PREDICT_EDM) {
        edm_conditions_kernel<<<(N + 127) / 128, 128, 0, gpu.stream>>>(m->timesteps, m->time, tr->sigma, tr->sample_weights + first,
            m->labels, N, first_sample, d->p_mean, d->p_std, train->cfg_dropout, c->num_classes - 1, state);
        edm_inputs_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(m->input.x, c->in_channels, m->input.C, m->target.x,
            tr->x0 + first * per_image, tr->sigma, d->sigma_data, per_image, n, first_sample, state);
        cuda_check_launch();
        return;
    }
    int T = tr->diffusion.schedule.steps;
    diffusion_conditions_kernel<<<(N + 127) / 128, 128, 0, gpu.stream>>>(m->timesteps, tr->sample_weights + first, m->labels, N,
        first_sample, T, tr->distribution, train->cfg_dropout, c->num_classes - 1, state);
    diffusion_inputs_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(m->input.x, c->in_channels, m->input.C,
        tr->classifier ? NULL : m->target.x, tr->x0 + first * per_image, m->timesteps, tr->diffusion.terms,
        tr->diffusion.config.predict, per_image, n, first_sample, state);
    cuda_check_launch();
    if (c->low_res) downsample_area(m->low_res.x, tr->x0 + first * per_image, N, c->image_size, c->low_res, c->in_channels);
}

static void trainer_enqueue_step(Trainer *tr) {
    UNet *m = &tr->m;
    const TrainConfig *train = &tr->train;
    int N = m->batch, B = train->batch_size;
    int64_t per_image = image_values(m) / N;
    trainer_enqueue_update(tr);
    cuda_check(cudaMemcpyAsync(tr->state, tr->host_state, sizeof(StepState), cudaMemcpyHostToDevice, gpu.stream));
    team_max(&tr->state->stop, 1, gpu.stream);
    trainer_enqueue_images(tr, tr->pixels);
    int T = tr->diffusion.schedule.steps;
    if (tr->weighted_draws)
        cuda_check(cudaMemcpyAsync(tr->distribution, tr->distribution_host, 2 * T * sizeof(double), cudaMemcpyHostToDevice, gpu.stream));
    for (int piece = 0; piece < tr->pieces; piece++) {
        int64_t first = (int64_t)piece * N;
        float *weights = tr->sample_weights + first;
        trainer_enqueue_piece(tr, piece, tr->labels, tr->state);
        if (piece == 0) {  // the first forward beside the last step's update
            trainer_wait_update(tr, 0);
            unet_forward_watched(m, 1, trainer_wait_update, tr);
            trainer_wait_update(tr, INT_MAX);
        } else unet_forward(m, 1);
        LossInputs inputs = {tr->d_pixels + first * per_image, m->input.x, tr->diffusion.terms, m->timesteps,
                             tr->diffusion.config.predict == PREDICT_EDM ? 4 : T, weights, B, piece, m->input.C};
        LossOutputs outputs = tr->loss;
        outputs.samples += 2 * first;
        if (tr->classifier) classifier_loss(&outputs, m->output->dx, m->output->x, m->labels, &inputs, N, tr->config.out_channels);
        else training_loss(&outputs, m->output->dx, m->output->x, m->target.x, &inputs, N, m->input.H * m->input.W,
                           tr->config.in_channels, tr->loss_kind);
        int last = piece == tr->pieces - 1;
        unet_backward(m, 1, last && team.comm ? team_reduce_after_block : NULL, tr);
        if (!last) gradient_accumulate(tr, piece);
    }
    if (tr->weighted_draws) {  // every rank's (t, loss), in the order of the samples, for the history
        team_gather(tr->loss.samples, tr->gathered, 2 * B, gpu.stream);
        cuda_check(cudaMemcpyAsync(tr->gathered_host, tr->gathered, (size_t)team.world * B * 2 * sizeof(float), cudaMemcpyDeviceToHost,
                                   gpu.stream));
    }
    if (team.comm) team_reduce_rest(tr);  // the gradient of the loss over every rank's images
    else gradient_add_pieces(tr, 0, m->storage);
    team_average(tr->loss.terms, LOSS_TERMS, gpu.stream);
    grad_norm_partial_kernel<<<NORM_BLOCKS, 256, 0, gpu.stream>>>(tr->norm_partial, m->grad, m->storage);
    step_decide_kernel<<<1, 1024, 0, gpu.stream>>>(tr->state, tr->norm_partial, tr->loss.terms);
    cuda_check_launch();
    cuda_check(cudaMemcpyAsync(tr->update_state, tr->state, sizeof(StepState), cudaMemcpyDeviceToDevice, gpu.stream));  // (the next step's update)
    cuda_check(cudaMemcpyAsync(tr->host_state, tr->state, sizeof(StepState), cudaMemcpyDeviceToHost, gpu.stream));
}

// The kernels of a classifier's evaluation: the batch in, noised, the forward pass and the loss
// (its gradient unused), the terms averaged over the ranks and copied out; no backward, no step.
static void trainer_enqueue_evaluation(Trainer *tr) {
    UNet *m = &tr->m;
    int N = m->batch;
    cuda_check(cudaMemcpyAsync(tr->eval_state, tr->eval_state_host, sizeof(StepState), cudaMemcpyHostToDevice, gpu.stream));
    trainer_enqueue_images(tr, tr->eval_pixels);
    for (int piece = 0; piece < tr->pieces; piece++) {
        trainer_enqueue_piece(tr, piece, tr->eval_labels, tr->eval_state);
        unet_forward(m, 0);
        LossInputs inputs = {NULL, NULL, NULL, m->timesteps, tr->diffusion.schedule.steps, NULL, tr->train.batch_size, piece};
        classifier_loss(&tr->eval_loss, m->output->dx, m->output->x, m->labels, &inputs, N, tr->config.out_channels);
    }
    team_average(tr->eval_loss.terms, LOSS_TERMS, gpu.stream);
    cuda_check(cudaMemcpyAsync(tr->eval_terms, tr->eval_loss.terms, LOSS_TERMS * sizeof(float), cudaMemcpyDeviceToHost, gpu.stream));
}

// The learning rate at a step (from 1): linear warm-up over warmup_steps, then constant, or with
// --lr_decay cosine a half cosine from lr down to min_lr at the last step.
static float learning_rate(const TrainConfig *train, int64_t step) {
    if (train->warmup_steps > 0 && step <= train->warmup_steps) return train->lr * (float)step / (float)train->warmup_steps;
    if (train->lr_decay != LR_COSINE || train->steps <= train->warmup_steps) return train->lr;
    double progress = (double)(step - train->warmup_steps) / (double)(train->steps - train->warmup_steps);
    return (float)(train->min_lr + (train->lr - train->min_lr) * 0.5 * (1.0 + cos(M_PI * fmin(progress, 1.0))));
}

// A team's step collectives once before the graph is captured, outside it: NCCL connects the ranks
// at a communicator's first collective (not a thing to do inside a capture), and the wait, watched,
// is the point where every rank has its model, data and checkpoint ready. The values are the
// zeroed gradients and scratch that the step overwrites.
static void team_warm_up(Trainer *tr, int64_t step) {
    team_max(&tr->state->stop, 1, gpu.stream);
    for (int j = tr->num_buckets - 1; j >= 0; j--) team_reduce_bucket(tr, j);
    team_reduce_rest(tr);
    team_average(tr->loss.terms, LOSS_TERMS, gpu.stream);
    if (tr->weighted_draws) team_gather(tr->loss.samples, tr->gathered, 2 * tr->train.batch_size, gpu.stream);
    cuda_check(cudaEventRecord(tr->done, gpu.stream));
    team_wait(tr->done, TEAM_START_TIMEOUT, step);
}

// The kernels that enqueue(tr) puts on the stream, captured as a graph to replay.
static cudaGraphExec_t trainer_capture(Trainer *tr, void (*enqueue)(Trainer *)) {
    cudaGraph_t graph;
    cudaGraphExec_t exec;
    cuda_check(cudaStreamBeginCapture(gpu.stream, cudaStreamCaptureModeGlobal));
    enqueue(tr);
    cuda_check(cudaStreamEndCapture(gpu.stream, &graph));
    cuda_check(cudaGraphInstantiate(&exec, graph, cudaGraphInstantiateFlagUseNodePriority));  // (the update's low priority)
    cuda_check(cudaGraphDestroy(graph));
    return exec;
}

// Runs step tr->step + 1 (its batch already in tr->pixels) and waits for it; the results are in
// tr->host_state. The first call captures the step as a graph; every call replays it. A stop asked
// for by a signal goes in with the step, and comes out as stop when any rank was asked.
static void trainer_step(Trainer *tr) {
    const TrainConfig *train = &tr->train;
    int64_t step = tr->step + 1;
    StepState *h = tr->host_state;
    h->step = step;
    h->lr = learning_rate(train, step);
    h->bias1 = 1.0f - powf(train->beta1, (float)step);
    h->bias2 = 1.0f - powf(train->beta2, (float)step);
    h->grad_clip = train->grad_clip;
    h->noise_seed = random_u64((uint64_t)train->seed, rng_stream(RNG_STEP_SEED, 0), (uint64_t)step);
    h->weighted_draw = tr->weighted_draws && loss_history_distribution(&tr->history, tr->distribution_host);
    h->stop = stop_requested;
    int ordinary = tr->graph && !tr->others_wait;
    double timeout = !tr->graph ? TEAM_START_TIMEOUT
                   : !ordinary  ? TEAM_SLOW_STEP_TIMEOUT
                                : fmax(TEAM_STEP_TIMEOUT, 50.0 * tr->slowest_wait);
    if (!tr->graph && team.comm) team_warm_up(tr, step);
    if (!tr->graph) tr->graph = trainer_capture(tr, trainer_enqueue_step);
    cuda_check(cudaGraphLaunch(tr->graph, gpu.stream));
    cuda_check(cudaEventRecord(tr->done, gpu.stream));
    double waited = team_wait(tr->done, timeout, step);
    if (ordinary) tr->slowest_wait = fmax(tr->slowest_wait, waited);
    if (tr->weighted_draws && h->finite)  // (a step that is not finite changes nothing)
        for (int i = 0; i < team.world * train->batch_size; i++)
            loss_history_add(&tr->history, (int)tr->gathered_host[2 * i], tr->gathered_host[2 * i + 1]);
    tr->step = step;
    tr->update_pending = 1;
    tr->others_wait = 0;
}

// A classifier's evaluation after step tr->step (--val_data, every --eval_interval steps): the
// index-th batch of the validation data (its position a function of the index, so that a resumed
// run evaluates on the same batches; no flips), noised with draws of its own (the step seed's
// sub-stream 1), through the model without backward (guided-diffusion's forward_backward_log with
// prefix "val"). Returns the loss's terms, averaged over the ranks (host memory, until the next).
static const float *trainer_evaluate(Trainer *tr, DataLoader *val, int64_t index) {
    const TrainConfig *train = &tr->train;
    uint64_t count = val->data.header.count, seen = (uint64_t)index * team.world * train->batch_size;
    char err[512];
    trainer_settle(tr);
    if (loader_seek(val, {seen / count, seen % count}, err, sizeof err) != 0) fatal("%s", err);
    loader_next_batch(val);
    tr->eval_state_host->noise_seed = random_u64((uint64_t)train->seed, rng_stream(RNG_STEP_SEED, 1), (uint64_t)tr->step);
    if (!tr->eval_graph) tr->eval_graph = trainer_capture(tr, trainer_enqueue_evaluation);
    cuda_check(cudaGraphLaunch(tr->eval_graph, gpu.stream));
    cuda_check(cudaEventRecord(tr->done, gpu.stream));
    team_wait(tr->done, TEAM_SLOW_STEP_TIMEOUT, tr->step);
    return tr->eval_terms;
}

// ----------------------------------------------------------------------------------------------
// Sampling on the GPU (the trainer's sample grids, generate): sampler.h's plan, with one step
// captured as a CUDA graph and replayed once per step, no host work in between. The plan's step
// index lives on the GPU, so each replay reads its own timestep and coefficients. With
// classifier-free guidance the model runs on twice the batch: the images with their labels,
// then the same images with the null class. With classifier guidance a noisy classifier's
// forward and backward passes give each step the score s d log p(y | x_t) / dx_t of the asked
// labels (sampler.h's score_guided_x0). An upsampler (SuperResModel) is given each batch's
// low-resolution images, which its forward pass upsamples into its input's last channels. Image
// i's starting noise and every draw it needs depend only on (seed, i): the same seed and batch size
// give the same images.


typedef struct {
    UNet m;                 // forward only; batch: images, twice that when guided
    int images, guided, null_label;
    float guidance;
    UNet classifier;        // classifier guidance: the noisy classifier (batch: images), input gradient
    int classifier_guided;  // only (TRAINING_INPUT_GRADIENT); its weights go into classifier.master
    float classifier_scale;
    float *classifier_partial;  // classifier_loss_kernel's per-image values, unread
    uint64_t seed;
    SamplePlan plan;        // its steps also on the GPU:
    SampleStep *steps;
    SampleCursor *cursor;   // GPU
    float *x;               // GPU, [images][H][W][C]
    SampleMemory *memory;   // GPU, a value's (sample_step_value)
    uint8_t *pixels;        // GPU
    uint8_t *low_pixels;    // GPU: an upsampler's low-resolution images of the batch, [images][s][s][C]
    cudaEvent_t start, stop;
    cudaEvent_t *step_done; // [plan.count], made when progress is first asked for
    cudaGraphExec_t graph;  // one step of the plan
} GpuSampler;

// Classifier guidance's score of the classifier's input x_t (its timesteps and labels y set), into
// classifier.input.dx: g = s d log p(y | x_t) / dx_t by its forward pass, the logits z's gradient
// d (s log softmax(z)_y) / dz = s (onehot(y) - softmax(z)) (classifier_loss_kernel's cross-entropy
// gradient times -s) and its backward pass, which computes no parameter gradients.
static void classifier_score(GpuSampler *s) {
    UNet *c = &s->classifier;
    unet_forward(c, 0);
    classifier_loss_kernel<<<(c->batch + 7) / 8, 256, 0, gpu.stream>>>(s->classifier_partial, c->output->dx, c->output->x, c->labels,
                                                                         c->batch, c->output->C, -s->classifier_scale);
    cuda_check_launch();
    unet_backward(c, 0, NULL, NULL);
}

// The GPU memory gpu_sampler_create takes for batches of `images`: the forward-only model's plan
// (twice the batch when guided), the classifier's (classifier guidance), and the sampler's own buffers.
static int64_t gpu_sampler_bytes(const ModelConfig *c, int images, int steps, int guided, const ModelConfig *classifier) {
    UNet m;
    unet_plan(&m, c, guided ? 2 * images : images, 0);
    int64_t n = (int64_t)images * c->image_size * c->image_size * c->in_channels;
    int64_t low = (int64_t)images * c->low_res * c->low_res * c->in_channels;  // an upsampler's low-resolution images
    int64_t bytes = unet_memory_bytes(&m) + n * (int64_t)(sizeof(float) + sizeof(SampleMemory)) + n + low + steps * (int64_t)sizeof(SampleStep);
    unet_destroy(&m);
    if (classifier) {
        unet_plan(&m, classifier, images, TRAINING_INPUT_GRADIENT);
        bytes += unet_memory_bytes(&m) + 3 * images * (int64_t)sizeof(float);
        unet_destroy(&m);
    }
    return bytes;
}

// A sampler for batches of `images` images of the model c (its weights go into s->m.master, then
// unet_sync_compute). guidance != 1 needs the model's null class (its last label row). classifier
// (nullable): classifier guidance by that noisy classifier with scale classifier_scale (its weights
// go into s->classifier.master, then unet_sync_compute).
static void gpu_sampler_create(GpuSampler *s, const ModelConfig *c, int images, const SamplePlan *plan, float guidance,
                               const ModelConfig *classifier, float classifier_scale, uint64_t seed) {
    memset(s, 0, sizeof *s);
    s->images = images, s->guided = guidance != 1.0f, s->guidance = guidance, s->null_label = c->num_classes - 1, s->seed = seed;
    unet_create(&s->m, c, s->guided ? 2 * images : images, 0);
    if (classifier) {
        s->classifier_guided = 1, s->classifier_scale = classifier_scale;
        unet_create(&s->classifier, classifier, images, TRAINING_INPUT_GRADIENT);
        s->classifier_partial = (float *)gpu_malloc(3 * images * sizeof(float));
    }
    s->m.continuous_time = plan->predict == PREDICT_EDM;
    s->plan = *plan;
    s->plan.steps = NULL;  // the host's copy stays with the caller
    s->steps = (SampleStep *)gpu_malloc(plan->count * sizeof(SampleStep));
    cuda_check(cudaMemcpy(s->steps, plan->steps, plan->count * sizeof(SampleStep), cudaMemcpyHostToDevice));
    int64_t n = (int64_t)images * c->image_size * c->image_size * c->in_channels;
    s->cursor = (SampleCursor *)gpu_malloc(sizeof(SampleCursor));
    s->x = (float *)gpu_malloc(n * sizeof(float));
    s->memory = (SampleMemory *)gpu_malloc(n * sizeof(SampleMemory));
    cuda_check(cudaMemset(s->x, 0, n * sizeof(float)));
    cuda_check(cudaMemset(s->memory, 0, n * sizeof(SampleMemory)));
    s->pixels = (uint8_t *)gpu_malloc(n);
    if (c->low_res) s->low_pixels = (uint8_t *)gpu_malloc((size_t)images * c->low_res * c->low_res * c->in_channels);
    cuda_check(cudaEventCreate(&s->start));
    cuda_check(cudaEventCreate(&s->stop));
}

static void gpu_sampler_destroy(GpuSampler *s) {
    if (s->graph) cudaGraphExecDestroy(s->graph);
    for (int j = 0; s->step_done && j < s->plan.count; j++) cudaEventDestroy(s->step_done[j]);
    free(s->step_done);
    cudaEventDestroy(s->start), cudaEventDestroy(s->stop);
    cudaFree(s->steps), cudaFree(s->cursor), cudaFree(s->x), cudaFree(s->memory), cudaFree(s->pixels), cudaFree(s->classifier_partial), cudaFree(s->low_pixels);
    unet_destroy(&s->m);
    if (s->classifier_guided) unet_destroy(&s->classifier);
    memset(s, 0, sizeof *s);
}

// Readies a batch of images first .. first + count - 1 (count <= s->images; the batch's other slots
// sample copies of labels[0] and low_res's first image; labels: [count], NULL when neither model
// takes labels; low_res: an upsampler's low-resolution images [count][s][s][C], else NULL): the
// cursor at the plan's first step, the labels and low-resolution images on the GPU, the step's
// graph captured (the first time).
static void gpu_sampler_begin(GpuSampler *s, int64_t first, int count, const int *labels, const uint8_t *low_res) {
    UNet *m = &s->m;
    const ModelConfig *mc = &m->config;
    int B = s->images;
    int64_t per_image = image_values(m) / m->batch, n = B * per_image;
    if (mc->low_res) {  // as model inputs, in both halves when guided
        size_t per_low = (size_t)mc->low_res * mc->low_res * mc->in_channels;
        cuda_check(cudaMemcpy(s->low_pixels, low_res, count * per_low, cudaMemcpyHostToDevice));
        for (int b = count; b < B; b++) cuda_check(cudaMemcpy(s->low_pixels + b * per_low, low_res, per_low, cudaMemcpyHostToDevice));
        for (int half = 0; half < m->batch / B; half++) images_to_model_input(m->low_res.x + half * B * per_low, s->low_pixels, B * per_low, gpu.stream);
    }
    SampleCursor cursor = {0, first * per_image};
    cuda_check(cudaMemcpy(s->cursor, &cursor, sizeof cursor, cudaMemcpyHostToDevice));
    int *batch_labels = (int *)malloc_or_die(m->batch * sizeof(int));
    for (int b = 0; b < B; b++) batch_labels[b] = labels ? labels[b < count ? b : 0] : 0;
    for (int b = B; b < m->batch; b++) batch_labels[b] = s->null_label;
    if (m->config.num_classes) cuda_check(cudaMemcpy(m->labels, batch_labels, m->batch * sizeof(int), cudaMemcpyHostToDevice));
    if (s->classifier_guided) cuda_check(cudaMemcpy(s->classifier.labels, batch_labels, B * sizeof(int), cudaMemcpyHostToDevice));
    free(batch_labels);
    if (s->graph) return;
    UNet *c = s->classifier_guided ? &s->classifier : NULL;
    cudaGraph_t graph;
    cuda_check(cudaStreamBeginCapture(gpu.stream, cudaStreamCaptureModeGlobal));
    sample_inputs_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(m->input.x, mc->in_channels, m->input.C, m->timesteps,
                                                                      m->continuous_time ? m->time : NULL, m->batch,
                                                                      c ? c->input.x : NULL,
                                                                      c ? c->timesteps : NULL, c ? B : 0, s->x, n, s->guided, s->steps,
                                                                      s->cursor);
    unet_forward(m, 0);
    if (c) classifier_score(s);
    sample_step_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(s->x, s->memory, m->output->x, c ? c->input.dx : NULL, n, mc->in_channels,
                                                                    m->output->C, s->guided, s->guidance, s->plan, s->steps, s->cursor,
                                                                    s->seed);
    sample_advance_kernel<<<1, 1, 0, gpu.stream>>>(s->cursor);
    cuda_check(cudaStreamEndCapture(gpu.stream, &graph));
    cuda_check(cudaGraphInstantiate(&s->graph, graph, 0));
    cuda_check(cudaGraphDestroy(graph));
}

// Runs the plan's steps from s->x (progress as in gpu_sampler_run).
static void gpu_sampler_steps(GpuSampler *s, UnetProgress progress, void *ctx) {
    if (progress && !s->step_done) {
        s->step_done = (cudaEvent_t *)malloc_or_die(s->plan.count * sizeof(cudaEvent_t));
        for (int j = 0; j < s->plan.count; j++) cuda_check(cudaEventCreateWithFlags(&s->step_done[j], cudaEventDisableTiming));
    }
    int reported = 0;
    for (int j = 0; j < s->plan.count; j++) {
        cuda_check(cudaGraphLaunch(s->graph, gpu.stream));
        if (!progress) continue;
        cuda_check(cudaEventRecord(s->step_done[j], gpu.stream));
        while (reported < j && cudaEventQuery(s->step_done[reported]) == cudaSuccess) progress(ctx, ++reported, s->plan.count);
    }
    for (; progress && reported < s->plan.count; reported++) {
        cuda_check(cudaEventSynchronize(s->step_done[reported]));
        progress(ctx, reported + 1, s->plan.count);
    }
}

// Samples images first .. first + count - 1 (as gpu_sampler_begin) into pixels (host,
// [count][H][W][C]). progress (nullable) is called as each step finishes on the GPU (an event
// after every step, polled while the steps are queued). Returns the GPU time of the batch in ms
// (events around the whole loop).
static float gpu_sampler_run(GpuSampler *s, int64_t first, int count, const int *labels, const uint8_t *low_res, uint8_t *pixels,
                             UnetProgress progress, void *ctx) {
    gpu_sampler_begin(s, first, count, labels, low_res);
    int64_t per_image = image_values(&s->m) / s->m.batch, n = s->images * per_image;
    cuda_check(cudaEventRecord(s->start, gpu.stream));
    sample_start_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(s->x, n, s->seed, s->plan.start_scale, s->cursor);
    cuda_check_launch();
    gpu_sampler_steps(s, progress, ctx);
    to_pixels_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(s->pixels, s->x, n);
    cuda_check_launch();
    cuda_check(cudaEventRecord(s->stop, gpu.stream));
    cuda_check(cudaMemcpy(pixels, s->pixels, count * per_image, cudaMemcpyDeviceToHost));
    float ms;
    cuda_check(cudaEventElapsedTime(&ms, s->start, s->stop));
    return ms;
}

// ----------------------------------------------------------------------------------------------
// The likelihood in bits per dimension (guided-diffusion's calc_bpd_loop, its image_nll.py): for an
// image x0, at every kept step k of the (respaced) schedule, x_k = sqrt(abar_k) x0 + sqrt(1 - abar_k)
// eps with fresh noise, and the variational bound's term of the model's output there (bound_term,
// x0' clipped as clip_denoised), summed over the steps and the image's D values; plus the prior's,
// KL(q(x_K | x0) || N(0, I)); all in bits per dimension (divided by D ln 2). A model without a
// learned variance has its diffusion's fixed one (DiffusionConfig.variance; guided-diffusion's
// default, the large: log beta_k, and at k = 0 log beta_tilde_1).

typedef struct {
    UNet m;                // forward only
    int steps;             // kept
    int *timesteps;        // [steps]: the model's t of each
    TimestepTerms *terms;  // [steps]: of the respaced schedule
    double abar_last;      // the prior's: the last kept step's
    DiffusionConfig diffusion;
    float *x0, *x_t;       // GPU, [batch][H][W][C]
    float *partial;        // GPU, [batch][loss_blocks(H W)]
    double *bits;          // GPU, [batch]: each image's sum so far
} Likelihood;

// A likelihood run for batches of `batch` images of model c, on the steps `kept` keeps of a schedule
// (its weights go into l->m.master, then unet_sync_compute).
static void likelihood_create(Likelihood *l, const ModelConfig *c, const DiffusionConfig *d, int batch, const SampleSchedule *kept) {
    memset(l, 0, sizeof *l);
    unet_create(&l->m, c, batch, 0);
    NoiseSchedule respaced;
    if (noise_schedule_respaced(kept, &respaced) != 0) fatal("out of host memory");
    l->steps = kept->count, l->diffusion = *d, l->abar_last = kept->abar[kept->count - 1];
    l->timesteps = (int *)malloc_or_die(kept->count * sizeof(int));
    l->terms = (TimestepTerms *)malloc_or_die(kept->count * sizeof(TimestepTerms));
    for (int k = 0; k < kept->count; k++) l->timesteps[k] = kept->timesteps[k], l->terms[k] = timestep_terms(&respaced, k);
    noise_schedule_free(&respaced);
    int64_t n = act_numel(&l->m.input);
    l->x0 = (float *)gpu_malloc(2 * n * sizeof(float));
    l->x_t = l->x0 + n;
    l->partial = (float *)gpu_malloc((size_t)batch * loss_blocks(c->image_size * c->image_size) * sizeof(float));
    l->bits = (double *)gpu_malloc(batch * sizeof(double));
}

static void likelihood_destroy(Likelihood *l) {
    cudaFree(l->x0), cudaFree(l->partial), cudaFree(l->bits);
    free(l->timesteps), free(l->terms);
    unet_destroy(&l->m);
    memset(l, 0, sizeof *l);
}

// Bits per dimension of a batch: pixels (GPU, [batch][H][W][C]; labels already in m.labels), images
// numbered from `first` for their noise; bits[batch] (host) gets the bound's sum, prior excluded.
static void likelihood_run(Likelihood *l, const uint8_t *pixels, int64_t first, uint64_t seed, double *bits) {
    UNet *m = &l->m;
    int N = m->batch, hw = m->input.H * m->input.W, C = m->input.C, blocks = loss_blocks(hw);
    int64_t n = act_numel(&m->input);
    cuda_check(cudaMemsetAsync(l->bits, 0, N * sizeof(double), gpu.stream));
    for (int k = 0; k < l->steps; k++) {
        likelihood_inputs_kernel<<<blocks_for(n, 256), 256, 0, gpu.stream>>>(l->x0, l->x_t, m->input.x, m->timesteps, pixels, n, N,
                                                                              l->timesteps[k], l->terms[k], k, seed, first * (n / N));
        unet_forward(m, 0);
        likelihood_terms_kernel<<<dim3(blocks, N), 256, 0, gpu.stream>>>(l->partial, m->output->x, l->x0, l->x_t, l->terms[k], k == 0,
                                                                         hw, C, m->output->C, l->diffusion.predict, l->diffusion.variance);
        likelihood_add_kernel<<<(N + 127) / 128, 128, 0, gpu.stream>>>(l->bits, l->partial, N, blocks, 1.0 / ((double)n / N * M_LN2));
        cuda_check_launch();
    }
    cuda_check(cudaMemcpyAsync(bits, l->bits, N * sizeof(double), cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
}

// The prior's term of an image of `values` pixels, in bits per dimension: KL(N(sqrt(abar) x0, 1 -
// abar) || N(0, 1)) = (-1 - log(1 - abar) + (1 - abar) + abar x0^2) / 2 per value.
static double likelihood_prior(const uint8_t *pixels, int64_t values, double abar) {
    double sum = 0;
    for (int64_t i = 0; i < values; i++) {
        double x = pixel_value(pixels[i]);
        sum += 0.5 * (-1.0 - log(1.0 - abar) + (1.0 - abar) + abar * x * x);
    }
    return sum / (values * M_LN2);
}

// ----------------------------------------------------------------------------------------------
#include "checkpoints.cuh"  // defines: checkpoint folders (metadata, saving, resuming), a .pt's architecture from its tensors

// ----------------------------------------------------------------------------------------------
// Run folders: one run each, held by one trainer at a time (a lock), checked before anything in
// them is read or written, and changed only through handles that no symlink redirects.

// A run folder holds one run. What in it shows that a run was started there (a checkpoint, log.csv,
// config.txt or samples/) into what; 0 when it holds none (it may not exist yet).
static int run_folder_contents(const char *run_dir, char *what, size_t len) {
    char path[4096];
    struct stat st;
    what[0] = '\0';
    if (latest_checkpoint(run_dir, path, sizeof path) == 0) return snprintf(what, len, "%s", path), 1;
    const char *marks[] = {"log.csv", "config.txt", "samples"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", run_dir, marks[i]);
        if (lstat(path, &st) == 0) return snprintf(what, len, "%s", path), 1;
    }
    return 0;
}

// Whether --resume_checkpoint names a checkpoint from elsewhere: neither `latest` nor a step folder
// of this run folder's checkpoints/ (the same folder, found by its real path; the step a folder
// itself, not a link).
static int resume_from_elsewhere(const Options *o) {
    if (!o->resume_checkpoint[0] || strcmp(o->resume_checkpoint, "latest") == 0) return 0;
    char given[4096], parent[4096], checkpoints[4096], ours[PATH_MAX], theirs[PATH_MAX];
    snprintf(given, sizeof given, "%s", o->resume_checkpoint);
    for (size_t n = strlen(given); n > 1 && given[n - 1] == '/'; n--) given[n - 1] = '\0';  // the step itself, not what a link leads to
    const char *step = given + parent_folder(given, parent, sizeof parent);
    struct stat st;
    if (checkpoint_step(step) < 0 || lstat(given, &st) != 0 || !S_ISDIR(st.st_mode)) return 1;
    snprintf(checkpoints, sizeof checkpoints, "%s/checkpoints", o->run_dir);
    return !realpath(checkpoints, ours) || !realpath(parent, theirs) || strcmp(ours, theirs) != 0;
}

// One trainer per run folder: it holds an exclusive lock (flock) on RUN/train.lock for its whole run,
// which the kernel releases when the process ends, however it ends: there is never a stale lock to
// clean by hand. The holder writes its process id into the file, for the refusal's message. With
// take 0 the lock is only tried and released (--dry_run, and the --gpus launcher before it starts
// the ranks, rank 0 of which takes it): a folder or lock file that does not exist yet is free.
// Exits with one line when another process holds it.
#define RUN_LOCK "train.lock"
static int run_lock = -1;  // the lock this process holds, left open until it ends

static void lock_run_folder(const char *run_dir, int take) {
    if (run_lock >= 0) return;
    int run = open_folder(AT_FDCWD, run_dir);
    int fd = run < 0 ? -1 : openat(run, RUN_LOCK, take ? O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC : O_RDONLY | O_NOFOLLOW | O_CLOEXEC, 0666);
    int e = errno;
    if (run >= 0) close(run);
    if (fd < 0 && !take && e == ENOENT) return;
    if (fd < 0) fatal("cannot open %s/%s: %s", run_dir, RUN_LOCK, strerror(e));
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        if (errno != EWOULDBLOCK) fatal("cannot lock %s/%s: %s", run_dir, RUN_LOCK, strerror(errno));
        char text[32] = "";
        ssize_t n = pread(fd, text, sizeof text - 1, 0);
        long pid = n > 0 ? (text[n] = '\0', strtol(text, NULL, 10)) : 0;
        char holder[48] = "another process";
        if (pid > 0) snprintf(holder, sizeof holder, "process %ld", pid);
        fatal("run folder %s is in use by another trainer (%s holds %s): wait for it to end, or choose another --run_dir", run_dir,
              holder, RUN_LOCK);
    }
    if (!take) {
        close(fd);
        return;
    }
    char text[32];
    int n = snprintf(text, sizeof text, "%d\n", (int)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, text, n, 0) != n) fatal("cannot write %s/%s: %s", run_dir, RUN_LOCK, strerror(errno));
    run_lock = fd;
}

// Checks that this process may write in the run folder, or create it (--dry_run says what the run
// would meet): the folder, or its parent when it does not exist yet, and checkpoints/ when it does.
static void check_run_folder_writable(const char *run_dir) {
    char where[4096];
    struct stat st;
    if (lstat(run_dir, &st) == 0) snprintf(where, sizeof where, "%s", run_dir);
    else parent_folder(run_dir, where, sizeof where);  // the folder the run would create it in
    if (faccessat(AT_FDCWD, where, W_OK | X_OK, AT_EACCESS) != 0)
        fatal("run folder %s cannot be written: %s: %s", run_dir, where, strerror(errno));
    snprintf(where, sizeof where, "%s/checkpoints", run_dir);
    if (lstat(where, &st) == 0 && faccessat(AT_FDCWD, where, W_OK | X_OK, AT_EACCESS) != 0)
        fatal("run folder %s cannot be written: %s: %s", run_dir, where, strerror(errno));
}

// Whether `path` lies in `folder` (or is it), by real paths: its name (a symlink's own name, so the
// link an --overwrite would remove counts) or what it leads to. 0 when either does not exist.
static int lies_in_folder(const char *path, const char *folder) {
    char given[4096], parent[4096], real_folder[PATH_MAX], real[PATH_MAX];
    if (!realpath(folder, real_folder)) return 0;
    size_t n = strlen(real_folder);
    snprintf(given, sizeof given, "%s", path);
    for (size_t k = strlen(given); k > 1 && given[k - 1] == '/'; k--) given[k - 1] = '\0';
    const char *name = given + parent_folder(given, parent, sizeof parent);
    for (int i = 0; i < 2; i++) {  // the name's folder (the name not . or ..), then what the path leads to
        if (i == 0 && (strcmp(name, ".") == 0 || strcmp(name, "..") == 0)) continue;
        if (!realpath(i == 0 ? parent : path, real)) continue;
        if (strncmp(real, real_folder, n) == 0 && (real[n] == '\0' || real[n] == '/' || real_folder[n - 1] == '/')) return 1;
    }
    return 0;
}

// Checks before anything is read or written that the run folder may take this run. It must be a
// folder or not exist yet, itself and its checkpoints/ no symlink, locked by no other trainer. A new
// run (no --resume_checkpoint) refuses a folder that holds one, unless --overwrite; so does a resume
// from a checkpoint elsewhere, which starts a new run: only `latest` or a step of the run folder
// itself continues its run. --overwrite refuses an --init_from inside the run folder: clearing it
// could remove the weights before the run reads them.
static void check_run_folder(const Options *o) {
    struct stat st;
    char what[4096];
    if (lstat(o->run_dir, &st) == 0) {
        if (S_ISLNK(st.st_mode)) fatal("run folder %s is a symbolic link: give the folder itself as --run_dir", o->run_dir);
        if (!S_ISDIR(st.st_mode)) fatal("run folder %s exists and is not a folder", o->run_dir);
        snprintf(what, sizeof what, "%s/checkpoints", o->run_dir);
        if (lstat(what, &st) == 0 && !S_ISDIR(st.st_mode))
            fatal("%s is not a folder (a symbolic link is refused: it could lead into another run's checkpoints)", what);
    }
    lock_run_folder(o->run_dir, 0);
    if (o->dry_run) check_run_folder_writable(o->run_dir);
    int held = run_folder_contents(o->run_dir, what, sizeof what);
    if (held && resume_from_elsewhere(o))
        fatal("--resume_checkpoint %s is not a checkpoint of run folder %s, which holds another run (%s): continue that run with "
              "latest or one of its own steps, or start a new run from the checkpoint in an empty or new --run_dir",
              o->resume_checkpoint, o->run_dir, what);
    if (held && !o->resume_checkpoint[0] && !o->overwrite)
        fatal("run folder %s already holds a run (%s): continue it with --resume_checkpoint latest, start over with "
              "--overwrite, or choose another --run_dir", o->run_dir, what);
    if (o->overwrite && o->init_from[0] && lies_in_folder(o->init_from, o->run_dir))
        fatal("--init_from %s lies inside run folder %s, which --overwrite clears before the weights are read: copy them out of "
              "the run folder first, or choose another --run_dir", o->init_from, o->run_dir);
}

// The file by which a torchrun restart knows its run folder (continue_after_restart).
#define TORCHRUN_MARK "torchrun_run_id"

// The run folder, taken for this run (rank 0's, before anything in it is written): created if it
// is missing, locked (lock_run_folder), and checked again (check_run_folder) now that no other
// trainer can change it; a `latest` checked before the lock must still be the latest.
static void take_run_folder(const Options *o, const ResumePoint *resume) {
    if (make_dir_synced(o->run_dir) != 0) fatal("cannot create run folder %s: %s", o->run_dir, strerror(errno));
    lock_run_folder(o->run_dir, 1);
    check_run_folder(o);
    char latest[4096];
    if (resume && strcmp(o->resume_checkpoint, "latest") == 0 &&
        (latest_checkpoint(o->run_dir, latest, sizeof latest) != 0 || strcmp(latest, resume->dir) != 0))
        fatal("run folder %s changed while this trainer started (its latest checkpoint is no longer %s): start it again",
              o->run_dir, resume->dir);
}

// Folder `name` of the run folder, opened to be cleared; a symlink there is removed as a link (-1).
static int open_to_clear(int run, const char *name) {
    int fd = open_folder(run, name);
    struct stat st;
    if (fd < 0 && fstatat(run, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISLNK(st.st_mode)) unlinkat(run, name, 0);
    return fd;
}

// --overwrite: removes what an earlier run left in the run folder (its checkpoints and set-aside
// branches, sample grids, log, configuration, loss.svg and fid.svg) and nothing else, through
// handles: a symlink among them is removed as a link, never followed.
static void clear_run_folder(const char *run_dir) {
    int run = open_folder(AT_FDCWD, run_dir);
    if (run < 0) return;
    int checkpoints = open_to_clear(run, "checkpoints"), samples = open_to_clear(run, "samples");
    DIR *d = checkpoints >= 0 ? list_folder(checkpoints) : NULL;
    struct dirent *e;
    while (d && (e = readdir(d))) {
        if (checkpoint_step(e->d_name) >= 0) remove_checkpoint(checkpoints, e->d_name);
        else if (strncmp(e->d_name, "step_", 5) == 0) delete_folder(checkpoints, e->d_name);
    }
    if (d) closedir(d);
    d = samples >= 0 ? list_folder(samples) : NULL;
    while (d && (e = readdir(d)))
        if (strncmp(e->d_name, "step_", 5) == 0 && strstr(e->d_name, ".png")) unlinkat(samples, e->d_name, 0);
    if (d) closedir(d);
    const char *files[] = {"log.csv", "config.txt", "loss.svg", "fid.svg", TORCHRUN_MARK};
    for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) unlinkat(run, files[i], 0);
    if (checkpoints >= 0) fsync(checkpoints), close(checkpoints);
    if (samples >= 0) close(samples);
    fsync(run);
    close(run);
}

// A torchrun restart (--max-restarts: TORCHELASTIC_RESTART_COUNT > 0) runs the failed attempt's
// command again. Where the run folder is that attempt's (its TORCHRUN_MARK file, written when a run
// starts under torchrun, holds this torchrun run's TORCHELASTIC_RUN_ID), rank 0 continues the run:
// from its latest checkpoint, as --resume_checkpoint latest, whatever the command said about where
// to start (--overwrite, --init_from, a checkpoint); with none yet, from the command's start again,
// over the attempt's files (cleared under the run folder's lock). Any other folder meets the usual
// checks, as on the first attempt.
static void continue_after_restart(Options *o) {
    const char *run_id = getenv("TORCHELASTIC_RUN_ID"), *restart = getenv("TORCHELASTIC_RESTART_COUNT");
    if (!run_id || !restart || atoi(restart) <= 0) return;
    char path[4400], mark[256] = "";
    snprintf(path, sizeof path, "%s/" TORCHRUN_MARK, o->run_dir);
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);
    ssize_t n = fd < 0 ? -1 : read(fd, mark, sizeof mark - 1);
    if (fd >= 0) close(fd);
    if (n <= 0 || strcmp(mark, run_id) != 0) return;
    lock_run_folder(o->run_dir, 1);
    char latest[4096];
    if (latest_checkpoint(o->run_dir, latest, sizeof latest) == 0) {
        o->resume_checkpoint = "latest", o->overwrite = 0, o->init_from = "";
        printf("torchrun restart %s: continuing the run from %s\n", restart, latest);
    } else {
        clear_run_folder(o->run_dir);
        printf("torchrun restart %s: the failed attempt left no checkpoint; the run starts again\n", restart);
    }
}

// ----------------------------------------------------------------------------------------------
// The command line: usage, parsing in order, the values that are not the model's, the summaries.
// Only main uses this part and the training run below, so a library build (TRAIN_UNET_LIBRARY)
// leaves them out, all but resolve_model.

// The model configuration of the options, for the command line: a bad value ends the program with
// one usage error line. The tests and dev/ make their models with it too.
static ModelConfig resolve_model(Options *o, int label_rows) {
    ModelConfig c;
    char err[512];
    if (model_config_from_options(o, label_rows, &c, err, sizeof err) != 0) usage_error("%s", err);
    return c;
}

#ifndef TRAIN_UNET_LIBRARY

static void print_usage(FILE *f) {
    fprintf(f,
            "usage: train_unet --data FILE.bin [options]   train a UNet on a dataset\n"
            "       train_unet --dry_run [options]          check and print a configuration\n"
            "       train_unet --bench N [options]          time N training steps\n"
            "\n"
            "Options take a value as --name VALUE or --name=VALUE, under guided-diffusion's\n"
            "names (a hyphen may stand for an underscore: --batch-size). Booleans accept\n"
            "True/False, 1/0, yes/no; a boolean given alone means True. Defaults, in\n"
            "brackets, are the seed preset's.\n\n");
    Options d = preset_seed();
    for (int i = 0; i < NUM_OPTIONS; i++) {
        const OptionSpec *s = &option_specs[i];
        char value[64] = "", help[600];
        const char *p = (const char *)&d + s->offset;
        switch (s->type) {
        case OPT_INT: snprintf(value, sizeof value, "%d", *(const int *)p); break;
        case OPT_LONG: snprintf(value, sizeof value, "%lld", *(const long long *)p); break;
        case OPT_FLOAT: snprintf(value, sizeof value, "%g", *(const float *)p); break;
        case OPT_BOOL: snprintf(value, sizeof value, "%s", *(const int *)p ? "True" : "False"); break;
        case OPT_STRING: snprintf(value, sizeof value, "%s", *(const char *const *)p); break;
        case OPT_SWITCH: break;
        }
        snprintf(help, sizeof help, "%s%s%s%s", s->help, value[0] ? " [" : "", value, value[0] ? "]" : "");
        cli_print_wrapped(f, help, fprintf(f, "  --%s", s->name), 28);
    }
    cli_print_wrapped(f, "this help", fprintf(f, "  --help, -h"), 28);
    cli_print_wrapped(f, "the version and what it was built with", fprintf(f, "  --version"), 28);
    fprintf(f, "\nPresets:\n");
    cli_print_wrapped(f, "64x64, 64 channels, mult 1,2,3,4, 2 blocks, attention at 16,8 with 32-channel heads, no conv "
                         "resampling, linear schedule", fprintf(f, "  seed"), 10);
    cli_print_wrapped(f, "guided-diffusion's ImageNet-64 model: 192 channels, 3 blocks, attention at 32,16,8 with "
                         "64-channel heads, scale-shift norm, resblock up/down, new attention order, dropout 0.1, cosine "
                         "schedule", fprintf(f, "  adm64"), 10);
    cli_print_wrapped(f, "guided-diffusion's ImageNet-128 model: 256 channels, mult 1,1,2,3,4, 2 blocks, attention at 32,16,8 "
                         "with 4 heads, scale-shift norm, resblock up/down, learned sigma, linear schedule, class-conditional",
                      fprintf(f, "  adm128"), 10);
    cli_print_wrapped(f, "its ImageNet-256 model: the same at 256x256, mult 1,1,2,2,4,4, 64-channel heads; adm256u: unconditional",
                      fprintf(f, "  adm256"), 10);
    cli_print_wrapped(f, "its ImageNet-512 model: the same at 512x512, mult 0.5,1,1,2,2,4,4", fprintf(f, "  adm512"), 10);
    cli_print_wrapped(f, "its upsampler from 64x64 to 256x256 (--super_res 64): 192 channels, mult 1,1,2,2,4,4, 2 blocks, "
                         "attention at 32,16,8 with 4 heads, scale-shift norm, resblock up/down, learned sigma, linear "
                         "schedule, class-conditional", fprintf(f, "  adm64_256"), 10);
    cli_print_wrapped(f, "its upsampler from 128x128 to 512x512: the same, attention at 32,16 with 64-channel heads",
                      fprintf(f, "  adm128_512"), 10);
}

// The options given on the command line (the others are the preset's, or the dataset's).
static unsigned char options_given[NUM_OPTIONS];

static int option_given(const char *name) { return options_given[find_option(name, strlen(name)) - option_specs]; }

static void set_option(Options *o, const OptionSpec *s, const char *value) {
    char err[512];
    if (option_from_string(o, s, value, err, sizeof err) != 0) usage_error("%s", err);
}

// Parses the command line: the preset first, then every flag in order.
static Options parse_options(int argc, char **argv) {
    const char *preset = "seed";
    if (argc < 2) print_usage(stdout), exit(0);  // no arguments: the usage, as --help
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) print_usage(stdout), exit(0);
        if (strcmp(argv[i], "--version") == 0) unet_print_version(), exit(0);
        if (strncmp(argv[i], "--preset=", 9) == 0) preset = argv[i] + 9;
        else if (strcmp(argv[i], "--preset") == 0 && i + 1 < argc) preset = argv[i + 1];
    }
    Options o;
    if (preset_options(preset, &o) != 0)
        usage_error("unknown preset '%s' (seed, adm64, adm128, adm256, adm256u, adm512, adm64_256 or adm128_512)", preset);

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (arg[0] == '-' && arg[1] != '-') usage_error("unknown option %s", arg);
        if (strncmp(arg, "--", 2) != 0) usage_error("unexpected argument '%s'", arg);
        const char *name = arg + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        const OptionSpec *s = find_option(name, len);
        if (!s) {
            const char *names[NUM_OPTIONS];
            char hint[128];
            for (int k = 0; k < NUM_OPTIONS; k++) names[k] = option_specs[k].name;
            usage_error("unknown option --%.*s%s", (int)len, name, cli_hint(name, len, names, NUM_OPTIONS, hint, sizeof hint));
        }
        options_given[s - option_specs] = 1;
        const char *value = eq ? eq + 1 : NULL;
        if (s->type == OPT_SWITCH) {
            if (value) usage_error("--%s takes no value", s->name);
        } else if (!value && s->type == OPT_BOOL) {
            int ignored;  // a boolean alone means True; one followed by a boolean word takes it
            if (i + 1 < argc && parse_bool(argv[i + 1], &ignored) == 0) value = argv[++i];
            else value = "True";
        } else if (!value) {
            if (i + 1 >= argc) usage_error("--%s needs a value", s->name);
            value = argv[++i];
        }
        set_option(&o, s, value);
    }
    return o;
}

// Checks the training values that are not part of the model.
// The steps between FIDs (--eval_num): --eval_interval, or when it is not given --sample_interval's
// (0: only at the end).
static int fid_interval(const Options *o) { return option_given("eval_interval") ? o->eval_interval : o->sample_interval; }

static void validate_training(const Options *o) {
    if (o->diffusion_steps < 1 || o->diffusion_steps > 100000) usage_error("--diffusion_steps %d is out of range (1..100000)", o->diffusion_steps);
    if (strcmp(o->noise_schedule, "linear") != 0 && strcmp(o->noise_schedule, "cosine") != 0)
        usage_error("--noise_schedule '%s' must be linear or cosine", o->noise_schedule);
    if (strcmp(o->noise_schedule, "linear") == 0 && o->diffusion_steps <= 20)  // beta_T = 20/T: 1 or more
        usage_error("--noise_schedule linear with --diffusion_steps %d ends at beta = %g: the last step keeps nothing of the image "
                    "(its eps prediction divides by zero); use more than 20 steps, or cosine", o->diffusion_steps,
                    20.0 / o->diffusion_steps);
    if (o->use_kl && !o->learn_sigma) usage_error("--use_kl needs --learn_sigma True (the bound's variance is the model's)");
    if (o->sigma_small && o->learn_sigma) usage_error("--sigma_small chooses a fixed variance: a model with --learn_sigma True learns its own");
    if (!(o->lr > 0)) usage_error("--lr %g must be positive", o->lr);
    if (!(o->weight_decay >= 0)) usage_error("--weight_decay %g must not be negative", o->weight_decay);
    if (prediction_from_name(o->predict) < 0) usage_error("--predict '%s' must be eps, v or x0", o->predict);
    if (strcmp(o->precond, "ddpm") != 0 && strcmp(o->precond, "edm") != 0) usage_error("--precond '%s' must be ddpm or edm", o->precond);
    if (strcmp(o->precond, "edm") == 0) {
        const char *why = strcmp(o->predict, "eps") != 0 ? "--predict (its network F has its own target)"
                          : o->learn_sigma ? "--learn_sigma True (its sampler needs no variance)"
                          : strcmp(o->schedule_sampler, "uniform") != 0 ? "--schedule_sampler (its noise levels are drawn from p_mean, p_std)"
                          : o->super_res ? "--super_res (an upsampler)" : NULL;
        if (why) usage_error("--precond edm does not go with %s", why);
        if (!edm_values_valid(o->sigma_data, o->p_mean, o->p_std))
            usage_error("--sigma_data and --p_std must be positive and --p_mean finite (below 1000 each)");
    }
    if (strcmp(o->schedule_sampler, "uniform") != 0 && strcmp(o->schedule_sampler, "loss-second-moment") != 0)
        usage_error("--schedule_sampler '%s' must be uniform or loss-second-moment", o->schedule_sampler);
    if (!(o->beta1 >= 0 && o->beta1 < 1) || !(o->beta2 >= 0 && o->beta2 < 1)) usage_error("--beta1 and --beta2 must be in [0, 1)");
    if (!(o->adam_eps > 0)) usage_error("--adam_eps %g must be positive", o->adam_eps);
    if (o->warmup_steps < 0) usage_error("--warmup_steps %d must not be negative", o->warmup_steps);
    if (strcmp(o->lr_decay, "none") != 0 && strcmp(o->lr_decay, "cosine") != 0) usage_error("--lr_decay '%s' must be none or cosine", o->lr_decay);
    if (!(o->min_lr >= 0 && o->min_lr <= o->lr)) usage_error("--min_lr %g must be in [0, lr]", o->min_lr);
    if (!(o->grad_clip >= 0)) usage_error("--grad_clip %g must not be negative", o->grad_clip);
    if (!(o->cfg_dropout >= 0 && o->cfg_dropout < 1)) usage_error("--cfg_dropout %g must be in [0, 1)", o->cfg_dropout);
    if (o->cfg_dropout > 0 && !o->class_cond) usage_error("--cfg_dropout needs --class_cond");
    if (o->keep < 0) usage_error("--keep %d must not be negative", o->keep);
    if (o->max_bad_steps < 1) usage_error("--max_bad_steps %d must be positive", o->max_bad_steps);
    if (!o->run_dir[0] || strlen(o->run_dir) > 3000) usage_error("--run_dir must be 1 to 3000 characters");
    if (strlen(o->resume_checkpoint) > 3000) usage_error("--resume_checkpoint must be at most 3000 characters");
    if (o->overwrite && o->resume_checkpoint[0]) usage_error("--overwrite starts a new run: it does not go with --resume_checkpoint");
    if (o->init_from[0] && o->resume_checkpoint[0])
        usage_error("--init_from starts a new run from given weights: it does not go with --resume_checkpoint");
    if (o->sample_interval < 0) usage_error("--sample_interval %d must not be negative", o->sample_interval);
    if (o->sample_count < 0 || o->sample_count > 10000) usage_error("--sample_count %d is out of range (0..10000)", o->sample_count);
    if (o->sample_steps < 1 || o->sample_steps > o->diffusion_steps || !respacing_stride(o->diffusion_steps, o->sample_steps))
        usage_error("--sample_steps %d: no even spacing of the %d diffusion steps (--diffusion_steps) gives that many",
                    o->sample_steps, o->diffusion_steps);
    if (o->batch_size < 1 || o->batch_size > 65536) usage_error("--batch_size %d is out of range (1..65536)", o->batch_size);
    if (o->microbatch != -1 && (o->microbatch < 1 || o->batch_size % o->microbatch != 0))
        usage_error("--microbatch %d must divide --batch_size %d (pieces of equal size), or be -1 for the whole batch at once",
                    o->microbatch, o->batch_size);
    if (o->gpus < 1 || o->gpus > 1024) usage_error("--gpus %d is out of range (1..1024)", o->gpus);
    char host[256];
    if (o->rdzv[0] && rendezvous_address(o->rdzv, host, sizeof host) < 0)
        usage_error("--rdzv '%s' must be host:port: a host name or IPv4 address, or an IPv6 address in brackets ([::1]:29500), and a "
                    "port of 1..65535 in digits", o->rdzv);
    if (o->rdzv_timeout < 1 || o->rdzv_timeout > 86400) usage_error("--rdzv_timeout %d is out of range (1..86400 seconds)", o->rdzv_timeout);
    if ((int64_t)o->batch_size * o->gpus > 65536)
        usage_error("--batch_size %d on %d GPUs is over 65536 images a step", o->batch_size, o->gpus);
    double rates[8];
    int classifier = strcmp(o->model, "classifier") == 0, n = parse_number_list(o->ema_rate, rates, 8);
    if (n < (classifier ? 0 : 1))  // (a classifier's may be empty: no EMA, its default)
        usage_error("--ema_rate '%s' must be 1 to 8 rates separated by commas", o->ema_rate);
    if (classifier && strcmp(o->schedule_sampler, "uniform") != 0) usage_error("--model classifier draws t uniformly: --schedule_sampler uniform");
    if (o->val_data[0] && !classifier) usage_error("--val_data evaluates a classifier: it needs --model classifier");
    if (o->eval_interval < 1) usage_error("--eval_interval %d must be positive", o->eval_interval);
    if (o->eval_num && classifier) usage_error("--eval_num is a diffusion model's FID: a classifier evaluates on --val_data");
    if (o->eval_num && (o->eval_num <= 2048 || o->eval_num > 1000000))
        usage_error("--eval_num %d: FID needs more images than its 2048 features (and at most 1000000)", o->eval_num);
    if (o->eval_num && o->super_res) usage_error("--eval_num: FID during training is not built for an upsampler (score its samples with evaluate)");
    if (o->eval_num && fid_interval(o) % o->log_interval != 0)
        usage_error("--eval_interval %d must be a multiple of --log_interval %d: FID goes into log.csv's rows", fid_interval(o), o->log_interval);
    if (strlen(o->inception) > 3000) usage_error("--inception must be at most 3000 characters");
    for (int i = 0; i < n; i++)
        if (rates[i] >= 1) usage_error("EMA rate %g must be below 1", rates[i]);
    if (o->log_interval < 1) usage_error("--log_interval %d must be positive", o->log_interval);
    if (o->save_interval < 1) usage_error("--save_interval %d must be positive", o->save_interval);
    if (o->steps < 1) usage_error("--steps %lld must be positive", o->steps);
    if (o->stop_step < 0) usage_error("--stop_step %lld must not be negative", o->stop_step);
    if (o->seed < 0) usage_error("--seed %lld must not be negative", o->seed);
}

// Checks a dataset (--data) against the options and takes what the command line leaves to it: square
// images, of --image_size when given, else of the size the model then takes (and with it
// guided-diffusion's channel_mult for that size, unless --channel_mult is given or the size is the
// preset's); for --class_cond labels and as many classes as --num_classes, whose value it then
// takes. Where the dataset has labels and --class_cond is not given, it says once (when `say`) that
// the model could be conditioned on them: it is never switched on silently.
static void check_dataset(const DatasetHeader *h, Options *o, int say) {
    if (h->height != h->width) fatal("dataset %s holds %ux%u images; the model needs square ones", o->data, h->width, h->height);
    if (option_given("image_size") && (int)h->width != o->image_size)
        fatal("dataset %s holds %ux%u images but --image_size is %d", o->data, h->width, h->height, o->image_size);
    if (!option_given("image_size") && (int)h->width != o->image_size) {
        o->image_size = (int)h->width;
        if (!option_given("channel_mult")) o->channel_mult = "";  // model_config_from_options: the size's default
        if (say) {
            const char *mult = o->channel_mult[0] ? o->channel_mult : default_channel_mult(o->image_size);
            printf("image_size %d from dataset %s", o->image_size, o->data);
            if (mult && !option_given("channel_mult")) printf(", and the default channel_mult for that size, %s", mult);
            printf(" (--image_size and --channel_mult choose others)\n");
        }
    }
    if (strcmp(o->model, "classifier") == 0) {
        if (h->num_classes == 0) fatal("--model classifier needs labels, and dataset %s has none (prepare it with --labels)", o->data);
        if (option_given("num_classes") && o->num_classes != (int)h->num_classes)
            fatal("--num_classes %d disagrees with the %u classes of dataset %s", o->num_classes, h->num_classes, o->data);
        o->num_classes = (int)h->num_classes;
        return;
    }
    if (say && h->num_classes > 0 && !option_given("class_cond"))
        printf("dataset %s has %u classes; the model is unconditional (--class_cond True conditions it on them)\n", o->data,
               h->num_classes);
    if (o->class_cond && h->num_classes == 0)
        fatal("--class_cond needs labels, and dataset %s has none (prepare it with --labels)", o->data);
    if (o->class_cond && o->num_classes && o->num_classes != (int)h->num_classes)
        fatal("--num_classes %d disagrees with the %u classes of dataset %s", o->num_classes, h->num_classes, o->data);
    if (o->class_cond) o->num_classes = (int)h->num_classes;
}

// The model a run trains: the diffusion UNet (its label embedding with a row for the null class,
// classifier-free guidance's), or with --model classifier the noisy classifier of the classifier
// flags, with classifier_train.py's defaults where the command line leaves them: lr 3e-4, no EMA;
// and no sample grids (nothing to sample). A bad value ends the program with one usage error line.
static ModelConfig resolve_run_model(Options *o) {
    if (strcmp(o->model, "diffusion") == 0) return resolve_model(o, o->num_classes ? o->num_classes + 1 : 0);
    if (strcmp(o->model, "classifier") != 0) usage_error("--model '%s' must be diffusion or classifier", o->model);
    for (int i = 0; i < NUM_OPTIONS; i++)
        if (option_specs[i].group & DIFFUSION_ONLY && options_given[i])
            usage_error("--%s is a diffusion model's flag: --model classifier does not take it", option_specs[i].name);
    if (option_given("sample_count") && o->sample_count) usage_error("--model classifier makes no sample grids: leave out --sample_count");
    if (!option_given("lr")) o->lr = 3e-4f;
    if (!option_given("ema_rate")) o->ema_rate = "";
    o->sample_count = 0;
    classifier_model_flags(o);
    ModelConfig c = resolve_model(o, 0);
    char err[512];
    if (classifier_config(&c, o->classifier_pool, o->num_classes, err, sizeof err) != 0) usage_error("%s", err);
    return c;
}

// Checks a classifier's validation dataset (--val_data) against the model: images of its size,
// labels of its classes.
static void check_val_dataset(const DatasetHeader *h, const Options *o) {
    if ((int)h->width != o->image_size || (int)h->height != o->image_size)
        fatal("validation dataset %s holds %ux%u images; the classifier takes %dx%d", o->val_data, h->width, h->height, o->image_size,
              o->image_size);
    if ((int)h->num_classes != o->num_classes)
        fatal("validation dataset %s has %u classes; the classifier tells %d apart", o->val_data, h->num_classes, o->num_classes);
}

// Prints the resolved configuration under guided-diffusion's flag names, one "name value" a line.
static void print_config(FILE *f, const Options *o) {
    for (int i = 0; i < NUM_OPTIONS; i++) {
        const OptionSpec *s = &option_specs[i];
        const char *p = (const char *)o + s->offset;
        fprintf(f, "%-24s ", s->name);
        switch (s->type) {
        case OPT_INT: fprintf(f, "%d\n", *(const int *)p); break;
        case OPT_LONG: fprintf(f, "%lld\n", *(const long long *)p); break;
        case OPT_FLOAT: fprintf(f, "%g\n", *(const float *)p); break;
        case OPT_BOOL: fprintf(f, "%s\n", *(const int *)p ? "True" : "False"); break;
        case OPT_STRING: fprintf(f, "%s\n", *(const char *const *)p); break;
        case OPT_SWITCH: fprintf(f, "%s\n", *(const int *)p ? "True" : "False"); break;
        }
    }
}

// Formats n with thousands separators (20494211 -> "20,494,211").
static const char *with_commas(int64_t n, char *buf, size_t len) {
    char digits[32];
    int d = snprintf(digits, sizeof digits, "%" PRId64, n), j = 0;
    for (int i = 0; i < d && j + 2 < (int)len; i++) {
        if (i > 0 && (d - i) % 3 == 0) buf[j++] = ',';
        buf[j++] = digits[i];
    }
    buf[j] = '\0';
    return buf;
}

static void print_model_summary(FILE *f, const ModelConfig *c, const ParamList *params) {
    char buf[32];
    fprintf(f, "model: %dx%d, %d levels:", c->image_size, c->image_size, c->num_levels);
    for (int l = 0; l < c->num_levels; l++)
        fprintf(f, " %d@%d%s", c->level_channels[l], c->image_size >> l, c->level_attention[l] ? "+attn" : "");
    fprintf(f, ", %d parameter tensors\n", params->count);
    fprintf(f, "parameters: %s\n", with_commas(params->numel, buf, sizeof buf));
}

// --dry_run: the kernels of each 3x3 convolution of the training step, as conv_plan picks them for an
// H100 or H200 (sm_90a, the TMA, CONV_PLAN_SMS multiprocessors); 1x1 convolutions are cuBLASLt's.
static void print_conv_plan(void *, const char *name, const Conv *cv, int N, int size, int training) {
    if (cv->k != 3) return;
    ConvTarget hopper = {true, true, CONV_PLAN_SMS};
    char text[3][48] = {"", "", ""};
    for (int op = 0; op < (training ? 3 : 1); op++) {
        ConvProblem q = conv_layer_problem(op, N, size, cv->in, cv->out, cv->stride);
        ConvPlan plan = conv_plan(&q, &hopper, -1);
        conv_plan_text(&plan, text[op], sizeof text[op]);
    }
    int len = (int)strlen(name) - (int)strlen(".weight");
    printf("  %-32.*s %4d -> %-4d %3dx%-3d s%d   %-20s %-20s %s\n", len, name, cv->in, cv->out, size, size, cv->stride, text[0],
           text[1], text[2]);
}

static void print_conv_plans(const Options *o, const ModelConfig *c) {
    printf("kernels of the 3x3 convolutions (training, batch %d, as planned for an H100 or H200):\n", o->batch_size);
    printf("  %-32s %12s %7s %3s   %-20s %-20s %s\n", "layer", "channels", "size", "", "forward", "input grad", "weight grad");
    UNet plan;
    conv_visitor = print_conv_plan;
    unet_plan(&plan, c, o->batch_size, 1);
    conv_visitor = NULL;
    unet_destroy(&plan);
}

// ----------------------------------------------------------------------------------------------
// The training run: a run folder with config.txt, log.csv and checkpoints/, held by one trainer at a
// time; a progress line every log_interval steps; checkpoints every save_interval steps and at the
// end; SIGINT, SIGTERM or SIGHUP finish the step, save and exit 0 (a second SIGINT exits at once).

// The batch of the sample grids' forward-only model.
static int grid_batch(const Options *o) { return o->sample_count < 64 ? o->sample_count : 64; }

// What a run will allocate on the GPU, from the plans (--dry_run): the training model, its EMA
// copies, the forward-only model that draws the sample grids, and FID's evaluation (fid_bytes:
// --eval_num's sampler and Inception-v3, at most).
static void print_run_memory(const Options *o, const ModelConfig *c, const TrainConfig *train, int64_t fid_bytes) {
    UNet plan;
    unet_plan(&plan, c, train->piece, train->recompute ? 1 : TRAINING_RECOMPUTE);  // the other way, for comparison
    int64_t other = unet_memory_bytes(&plan);
    unet_destroy(&plan);
    unet_plan(&plan, c, train->piece, training_mode(train));
    print_training_plan(stdout, &plan, train, other);
    plan.input_gradient = 0;  // as the trainer's
    printf("model FLOPs: %.1f GFLOP a training step on each GPU (convolutions and matrix products, forward and backward)\n",
           unet_training_flops(&plan) * (o->batch_size / plan.batch) / 1e9);
    int64_t ema = (int64_t)train->num_ema * plan.storage * sizeof(float);
    int64_t total = unet_memory_bytes(&plan) + ema + gradient_sum_bytes(train, &plan);
    unet_destroy(&plan);
    printf("memory plan (EMA weights): %.1f MiB\n", ema / 1048576.0);
    if (o->sample_count) {
        unet_plan(&plan, c, grid_batch(o), 0);
        print_memory_plan(stdout, &plan, "sample grids, at most");
        total += unet_memory_bytes(&plan);
        unet_destroy(&plan);
    }
    if (o->eval_num) {
        printf("memory plan (FID's sampler and Inception-v3, at most: the sampler's batch is halved until it fits): %.1f MiB\n",
               fid_bytes / 1048576.0);
        total += fid_bytes;
    }
    printf("memory plan: %.1f MiB in all\n", total / 1048576.0);
}

// A sampler of the first EMA's weights during training (the sample grids', FID's), made at the first
// call: DDIM with --sample_steps (an EDM model: Heun on (--sample_steps + 1) / 2 of EDM's Karras
// levels, as many model calls less one), batches of `batch` images halved until its forward-only model fits
// in the GPU memory the training left free (a big model at a large batch leaves little), its noise
// from sub-stream `sub_stream` of RNG_GRID_SEED; then, at every call, loaded with the EMA's weights.
static void ema_sampler_load(GpuSampler *sampler, Trainer *tr, int steps, int batch, uint64_t sub_stream) {
    const ModelConfig *c = &tr->config;
    trainer_settle(tr);
    if (!sampler->m.blocks) {
        SamplePlan plan;
        const DiffusionConfig *d = &tr->diffusion.config;
        KarrasLevels edm = {0.0, 0.0, 7.0, 0.0, 0.0, INFINITY, 1.0, d->sigma_data};
        if ((d->predict == PREDICT_EDM ? sample_plan_karras(&plan, &tr->diffusion.schedule, SAMPLER_HEUN, (steps + 1) / 2, edm, 0.0f,
                                                            PREDICT_EDM, 0)
                                       : sample_plan_make(&plan, &tr->diffusion.schedule, SAMPLER_DDIM, steps, NULL, 0.0f, d->predict, 1,
                                                          d->variance)) != 0)
            fatal("out of memory");
        size_t free_bytes, total_bytes;
        cuda_check(cudaMemGetInfo(&free_bytes, &total_bytes));
        const int64_t margin = 512LL << 20;  // for cuBLAS's workspace and the captured graph's own memory
        while (batch > 1 && gpu_sampler_bytes(c, batch, plan.count, 0, NULL) + margin > (int64_t)free_bytes) batch /= 2;
        gpu_sampler_create(sampler, c, batch, &plan, 1.0f, NULL, 0.0f, random_u64(tr->train.seed, rng_stream(RNG_GRID_SEED, sub_stream), 0));
        sample_plan_free(&plan);
    }
    cuda_check(cudaMemcpy(sampler->m.master, tr->ema[0], tr->m.storage * sizeof(float), cudaMemcpyDeviceToDevice));
    unet_sync_compute(&sampler->m);
}

// An image area-downsampled by an integer factor and rounded to pixels (block means, as
// F.interpolate's "area"; scripts/superres_psnr.py downsample makes the same): an upsampler's
// low-resolution input, as generate --low_res reads it from a file.
static void downsample_area_pixels(uint8_t *low, const uint8_t *image, int size, int low_size, int channels) {
    int f = size / low_size;
    for (int y = 0; y < low_size; y++)
        for (int x = 0; x < low_size; x++)
            for (int c = 0; c < channels; c++) {
                double sum = 0;
                for (int dy = 0; dy < f; dy++)
                    for (int dx = 0; dx < f; dx++) sum += image[((size_t)(y * f + dy) * size + x * f + dx) * channels + c];
                low[((size_t)y * low_size + x) * channels + c] = (uint8_t)lrint(sum / (f * f));
            }
}

// Nearest-neighbour enlargement of a low_size image to size (a whole factor): a grid's tile.
static void enlarge_nearest_pixels(uint8_t *out, const uint8_t *low, int low_size, int size, int channels) {
    int f = size / low_size;
    for (int y = 0; y < size; y++)
        for (int x = 0; x < size; x++)
            memcpy(out + ((size_t)y * size + x) * channels, low + ((size_t)(y / f) * low_size + x / f) * channels, channels);
}

// A grid of sample_count images from the first EMA's weights, DDIM with sample_steps steps and
// the same starting noise every time (so grids compare over a run), into run_dir/samples/.
// Class-conditional models get the classes in turn. An upsampler upsamples the first sample_count
// images of `originals` (the validation set when there is one, else the training set; each with its
// label), and its grid shows three tiles an image: the low-resolution input (enlarged), the sample
// and the original. The sampler is made at the first grid.
static void write_samples(Trainer *tr, const Options *o, GpuSampler *sampler, const Dataset *originals, const char *run_dir) {
    const ModelConfig *c = &tr->config;
    int count = o->sample_count, size = c->image_size, low_size = c->low_res;
    if (low_size && (uint64_t)count > originals->header.count) count = (int)originals->header.count;
    ema_sampler_load(sampler, tr, o->sample_steps, grid_batch(o), 0);
    int *labels = NULL, classes = c->num_classes - 1;  // without the null class
    if (classes > 0) {
        labels = (int *)malloc_or_die(count * sizeof(int));
        for (int i = 0; i < count; i++) labels[i] = low_size ? dataset_label(originals, i) : i % classes;
    }
    int64_t per_image = (int64_t)size * size * 3, per_low = (int64_t)low_size * low_size * 3;
    uint8_t *low = low_size ? (uint8_t *)malloc_or_die(count * per_low) : NULL;
    for (int i = 0; i < count && low; i++)
        downsample_area_pixels(low + i * per_low, dataset_image(originals, i), size, low_size, 3);
    uint8_t *pixels = (uint8_t *)malloc_or_die(count * per_image);
    for (int first = 0; first < count; first += sampler->images) {
        int n = count - first < sampler->images ? count - first : sampler->images;
        gpu_sampler_run(sampler, first, n, labels ? labels + first : NULL, low ? low + first * per_low : NULL, pixels + first * per_image,
                        NULL, NULL);
    }
    int tiles = count, cols = 0;
    uint8_t *grid_images = pixels;
    if (low_size) {  // low-resolution input | sample | original, for each image
        tiles = 3 * count, cols = 3 * (int)ceil(sqrt((double)count));
        grid_images = (uint8_t *)malloc_or_die(tiles * per_image);
        for (int i = 0; i < count; i++) {
            uint8_t *tile = grid_images + 3 * i * per_image;
            enlarge_nearest_pixels(tile, low + i * per_low, low_size, size, 3);
            memcpy(tile + per_image, pixels + i * per_image, per_image);
            memcpy(tile + 2 * per_image, dataset_image(originals, i), per_image);
        }
    }
    char path[4096];
    snprintf(path, sizeof path, "%s/samples", run_dir);
    mkdir(path, 0777);
    snprintf(path, sizeof path, "%s/samples/step_%09lld.png", run_dir, (long long)tr->step);
    if (write_grid_png(path, grid_images, tiles, size, cols) != 0) fatal("cannot write %s: %s", path, strerror(errno));
    printf("samples: %s\n", path);
    if (grid_images != pixels) free(grid_images);
    free(pixels);
    free(low);
    free(labels);
}

// FID during training (--eval_num): the reference statistics of the first 50000 training images,
// made once at the start of the run, and at every evaluation --eval_num images sampled from the
// first EMA's weights (DDIM with --sample_steps, the classes in turn, the same starting noise every
// time), their Inception features and the Fréchet distance, all on the GPU (the sample-quality
// section's functions, which evaluate uses too), printed, put in log.csv's row and drawn into
// run/fid.svg. Only rank 0 evaluates; the others wait at the next step.
#define FID_REFERENCE_IMAGES 50000
#define FID_SAMPLE_BATCH 256     // the sampler's images at a time, at most (halved until it fits)
#define FID_INCEPTION_BATCH 100  // Inception's, at most
typedef struct {
    UnetInception *net;
    LossLog chart;         // the FIDs so far (log.csv's, on resume), drawn into run/fid.svg
    char chart_path[4400];
    const char *run_dir;
    int batch;             // Inception's images at a time
    double *mu, *sigma;    // the training images' statistics
    int64_t reference_count;
    GpuSampler sampler;    // made at the first evaluation
    double fid;            // the last one, and its step (-1: none yet)
    int64_t step;
} FidEvaluation;

// The fid column of log.csv's rows (those a resumed run kept) into log.
static void fid_log_read(LossLog *log, const char *path) {
    FILE *f = fopen(path, "r");
    char line[1024];
    int column = -1;
    if (f && fgets(line, sizeof line, f)) {  // the header: fid's column
        int k = 0;
        for (char *field = strtok(line, ",\n"); field; field = strtok(NULL, ",\n"), k++)
            if (strcmp(field, "fid") == 0) column = k;
    }
    while (f && column >= 0 && fgets(line, sizeof line, f)) {
        const char *field = line;
        for (int k = 0; k < column && field; k++) field = strchr(field, ','), field = field ? field + 1 : NULL;
        char *end;
        double fid = field ? strtod(field, &end) : NAN;
        if (field && end != field && loss_log_add(log, strtoll(line, NULL, 10), fid, NAN) != 0) fatal("out of host memory");
    }
    if (f) fclose(f);
}

// The GPU memory an evaluation takes at most, beside the training's: its sampler (DDIM with
// `steps` steps) and the Inception network (net: loaded, not yet on the GPU) with its input images,
// at their largest batches.
static int64_t fid_memory_bytes(const ModelConfig *c, int steps, const UnetInception *net) {
    int64_t image_bytes = (int64_t)c->image_size * c->image_size * 3;
    return gpu_sampler_bytes(c, FID_SAMPLE_BATCH, steps, 0, NULL) + unet_inception_gpu_bytes(net, FID_INCEPTION_BATCH) +
           FID_INCEPTION_BATCH * image_bytes;
}

static void fid_evaluation_open(FidEvaluation *fe, const Options *o, const Dataset *data) {
    char err[1024], path[4096];
    memset(fe, 0, sizeof *fe);
    fe->step = -1;
    fe->run_dir = o->run_dir;
    snprintf(fe->chart_path, sizeof fe->chart_path, "%s/fid.svg", o->run_dir);
    snprintf(path, sizeof path, "%s/log.csv", o->run_dir);
    fid_log_read(&fe->chart, path);
    if (o->inception[0]) snprintf(path, sizeof path, "%s", o->inception);
    else unet_inception_default_path(path, sizeof path);
    fe->net = unet_inception_open(path, err, sizeof err);
    if (!fe->net) fatal("%s", err);
    double start = now_seconds();
    fe->reference_count = data->header.count < FID_REFERENCE_IMAGES ? (int64_t)data->header.count : FID_REFERENCE_IMAGES;
    if (!(fe->batch = unet_inception_max_batch(fe->net, FID_INCEPTION_BATCH, err, sizeof err))) fatal("%s", err);
    const int dim = UNET_INCEPTION_FEATURES;
    float *pool = (float *)malloc_or_die(fe->reference_count * dim * sizeof(float));
    fe->mu = (double *)malloc_or_die(dim * sizeof(double));
    fe->sigma = (double *)malloc_or_die((size_t)dim * dim * sizeof(double));
    for (int k = 0, done = 0; done < fe->reference_count; k++) {  // the first images, part by part of a dataset in parts
        const Dataset *part = dataset_file(data, k);
        int64_t n = (int64_t)part->header.count < fe->reference_count - done ? (int64_t)part->header.count : fe->reference_count - done;
        if (unet_inception_features(fe->net, part->pixels, n, data->header.height, data->header.width, data->header.channels, fe->batch,
                                    pool + (int64_t)done * dim, NULL, NULL, err, sizeof err) != 0)
            fatal("%s", err);
        done += (int)n;
    }
    if (unet_feature_statistics(pool, fe->reference_count, dim, fe->mu, fe->sigma, err, sizeof err) != 0) fatal("%s", err);
    free(pool);
    printf("FID: the reference statistics of %lld training images in %.1f s (Inception-v3 of %s)\n", (long long)fe->reference_count,
           now_seconds() - start, path);
}

// The FID of --eval_num samples from the first EMA at this step, into fe->fid.
static void fid_evaluate(FidEvaluation *fe, Trainer *tr, const Options *o) {
    const ModelConfig *c = &tr->config;
    double start = now_seconds();
    GpuSampler *sampler = &fe->sampler;
    ema_sampler_load(sampler, tr, o->sample_steps, FID_SAMPLE_BATCH, 1);  // (--eval_num is over 2048)
    int n = o->eval_num, size = c->image_size, classes = c->num_classes - 1, dim = UNET_INCEPTION_FEATURES;  // (less the null class)
    int64_t per_image = (int64_t)size * size * 3;
    uint8_t *pixels = (uint8_t *)malloc_or_die(sampler->images * per_image);
    int *labels = (int *)malloc_or_die(sampler->images * sizeof(int));
    float *pool = (float *)malloc_or_die((size_t)n * dim * sizeof(float));
    double *mu = (double *)malloc_or_die(dim * sizeof(double)), *sigma = (double *)malloc_or_die((size_t)dim * dim * sizeof(double));
    char err[1024];
    for (int first = 0; first < n; first += sampler->images) {
        int count = n - first < sampler->images ? n - first : sampler->images;
        for (int i = 0; i < count; i++) labels[i] = classes > 0 ? (first + i) % classes : 0;
        gpu_sampler_run(sampler, first, count, classes > 0 ? labels : NULL, NULL, pixels, NULL, NULL);
        if (unet_inception_features(fe->net, pixels, count, size, size, 3, fe->batch, pool + (size_t)first * dim, NULL, NULL, err, sizeof err) != 0)
            fatal("%s", err);
    }
    if (unet_feature_statistics(pool, n, dim, mu, sigma, err, sizeof err) != 0 ||
        unet_frechet_distance(fe->mu, fe->sigma, mu, sigma, dim, &fe->fid, err, sizeof err) != 0)
        fatal("%s", err);
    fe->step = tr->step;
    printf("FID at step %lld: %.4f (%d samples against %lld training images, %.1f s)\n", (long long)tr->step, fe->fid, n,
           (long long)fe->reference_count, now_seconds() - start);
    if (loss_log_add(&fe->chart, tr->step, fe->fid, NAN) != 0) fatal("out of host memory");
    if (loss_plot_write_quantity(fe->chart_path, fe->run_dir, "FID", fe->chart.points, fe->chart.count, err, sizeof err) != 0)
        fprintf(stderr, "train_unet: warning: %s\n", err);
    free(pixels), free(labels), free(pool), free(mu), free(sigma);
}

static void fid_evaluation_close(FidEvaluation *fe) {
    loss_log_free(&fe->chart);
    if (fe->sampler.m.blocks) gpu_sampler_destroy(&fe->sampler);
    unet_inception_close(fe->net);
    free(fe->mu), free(fe->sigma);
}

static void on_stop_signal(int sig) {
    if (sig == SIGUSR1) {
        peer_lost = 1;
        return;
    }
    if (stop_requested && sig == SIGINT) _exit(130);
    stop_requested = 1;
}

#define LOG_HEADER "step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,mse,vb,loss_q0,loss_q1,loss_q2,loss_q3"
#define CLASSIFIER_LOG_HEADER                                                                                            \
    "step,loss,lr,grad_norm,img_per_s,ms_per_step,gpu_mem_gib,acc1,acc5,loss_q0,loss_q1,loss_q2,loss_q3,acc1_q0,acc1_q1,acc1_q2," \
    "acc1_q3,acc5_q0,acc5_q1,acc5_q2,acc5_q3,val_loss,val_acc1,val_acc5,val_loss_q0,val_loss_q1,val_loss_q2,val_loss_q3,"     \
    "val_acc1_q0,val_acc1_q1,val_acc1_q2,val_acc1_q3,val_acc5_q0,val_acc5_q1,val_acc5_q2,val_acc5_q3"

// A classifier's results over a log interval, from the loss's terms (LossOutputs.terms in the
// classifier's layout) of each step or evaluation: the sums of the batches' means (L, acc@1, acc@k)
// and of the quarters' sums (loss, acc@1, acc@k) and counts. log.csv gets the means over the
// interval's batches and per quarter over its samples (empty where there were none: no evaluation
// in the interval, no t in the quarter); guided-diffusion logs "acc@5", here acc5 is top-min(5, K).
typedef struct {
    double mean[3], quarter[3][4], count[4];
    int batches;
} ClassifierLog;

static void classifier_log_add(ClassifierLog *l, const float *terms) {
    for (int k = 0; k < 3; k++) l->mean[k] += terms[k];
    for (int q = 0; q < 4; q++)
        l->quarter[0][q] += terms[3 + q], l->count[q] += terms[7 + q], l->quarter[1][q] += terms[11 + q], l->quarter[2][q] += terms[15 + q];
    l->batches++;
}

// Its columns: the means from `first` (1: the training steps', whose loss has its own column), then
// the quarters'.
static void classifier_log_columns(FILE *f, const ClassifierLog *l, int first) {
    for (int k = first; k < 3; k++)
        if (l->batches) fprintf(f, ",%.6f", l->mean[k] / l->batches);
        else fputc(',', f);
    for (int k = 0; k < 3; k++)
        for (int q = 0; q < 4; q++)
            if (l->count[q] > 0) fprintf(f, ",%.6f", l->quarter[k][q] / l->count[q]);
            else fputc(',', f);
}

// The progress line's part: "  acc@1 A  acc@k B", and the evaluations' "  val loss L acc@1 A" when
// the interval had some.
static void classifier_log_say(char *out, size_t len, const ClassifierLog *train, const ClassifierLog *val, int classes) {
    int k = classes < 5 ? classes : 5, n = snprintf(out, len, "  acc@1 %.4f  acc@%d %.4f", train->mean[1] / train->batches, k,
                                                    train->mean[2] / train->batches);
    if (val->batches && n > 0 && (size_t)n < len)
        snprintf(out + n, len - n, "  val loss %.4f acc@1 %.4f acc@%d %.4f", val->mean[0] / val->batches, val->mean[1] / val->batches, k,
                 val->mean[2] / val->batches);
}

// Writes a small file whole under a temporary name, syncs it and renames it into place; exits on
// an error. `fill` writes the content.
static void write_file_atomically(const char *path, void (*fill)(FILE *, const void *), const void *arg) {
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.tmp.%d", path, (int)getpid());
    FILE *f = fopen(tmp, "w");
    if (!f) fatal("cannot write %s: %s", tmp, strerror(errno));
    fill(f, arg);
    int failed = fflush(f) != 0 || fsync(fileno(f)) != 0;
    if (fclose(f) != 0 || failed || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        fatal("cannot write %s: %s", path, strerror(e));
    }
}

// log.csv of a resumed run: the header, then the old file's rows up to the resumed step.
typedef struct {
    const char *old_path;
    int64_t resumed_step;
    const char *header;
} LogStart;

static void fill_log(FILE *f, const void *arg) {
    const LogStart *start = (const LogStart *)arg;
    char line[512];
    fprintf(f, "%s\n", start->header);
    FILE *old = start->resumed_step > 0 ? fopen(start->old_path, "r") : NULL;
    while (old && fgets(line, sizeof line, old))
        if (line[0] >= '0' && line[0] <= '9' && strtoll(line, NULL, 10) <= start->resumed_step) fputs(line, f);
    if (old) fclose(old);
}

// Opens log.csv for appending; on resume keeps only the rows up to the resumed step. With FID during
// training (fid), a diffusion model's rows end in a fid column (empty where none was computed).
static FILE *open_log(const char *run_dir, int64_t resumed_step, int classifier, int fid) {
    char path[4096];
    snprintf(path, sizeof path, "%s/log.csv", run_dir);
    LogStart start = {path, resumed_step, classifier ? CLASSIFIER_LOG_HEADER : fid ? LOG_HEADER ",fid" : LOG_HEADER};
    write_file_atomically(path, fill_log, &start);
    FILE *f = fopen(path, "a");
    if (!f) fatal("cannot write %s: %s", path, strerror(errno));
    return f;
}

static void fill_config(FILE *f, const void *o) { print_config(f, (const Options *)o); }
static void fill_text(FILE *f, const void *text) { fputs((const char *)text, f); }

static void write_config(const char *run_dir, const Options *o) {
    char path[4096];
    snprintf(path, sizeof path, "%s/config.txt", run_dir);
    write_file_atomically(path, fill_config, o);
}

// The checkpoint --resume_checkpoint names ("latest": the newest in the run folder) into rp->dir,
// and everything in it checked (check_resume). Exits with one line on a problem.
// --init_from: the weights a new run starts from, checked on the host before the GPU: every
// parameter of the model in the file with its shape (a file's extra tensors are ignored), except a
// label_emb of another class count, which stays as initialised (fine-tuning on other classes).
typedef struct {
    char file[4400];
    ParamList loaded;    // the parameters read from it, at the GPU layout's offsets: all, or all but label_emb.weight
    int label_rows;      // the file's label_emb rows when they differ from the model's (0: same, or none)
} InitFrom;

static int check_init_from(const Options *o, const ModelConfig *c, InitFrom *init, char *err, size_t err_len) {
    struct stat st;
    memset(init, 0, sizeof *init);
    ParamList layout = model_parameters(c);  // with the offsets unet_create gives them
    int64_t emb_bias_offset;
    param_offsets(&layout, &emb_bias_offset);
    const ParamList *params = &layout;
    snprintf(init->file, sizeof init->file, stat(o->init_from, &st) == 0 && S_ISDIR(st.st_mode) ? "%.4000s/ema.safetensors" : "%.4000s",
             o->init_from);
    SafeTensorsFile f;
    if (safetensors_open(init->file, &f, err, err_len) != 0) return -1;
    init->loaded.specs = (ParamSpec *)malloc_or_die(params->count * sizeof(ParamSpec));
    for (int i = 0; i < params->count; i++) {
        const ParamSpec *p = &params->specs[i];
        const SafeTensor *t = strcmp(p->name, "label_emb.weight") == 0 ? safetensors_find(&f, p->name) : NULL;
        if (t && t->ndim == 2 && t->shape[1] == p->shape[1] && t->shape[0] != p->shape[0]) init->label_rows = (int)t->shape[0];
        else init->loaded.specs[init->loaded.count++] = *p;
    }
    int r = read_tensors(&init->loaded, &f, init->file, 0, NULL, err, err_len);
    safetensors_close(&f);
    free(layout.specs);
    return r;
}

static void find_resume_point(const Options *o, const ModelConfig *c, const TrainConfig *train, const ParamList *params, ResumePoint *rp) {
    char err[2048];
    memset(rp, 0, sizeof *rp);
    if (strcmp(o->resume_checkpoint, "latest") == 0) {
        if (latest_checkpoint(o->run_dir, rp->dir, sizeof rp->dir) != 0)
            fatal("--resume_checkpoint latest: no checkpoint in %s/checkpoints", o->run_dir);
    } else {
        snprintf(rp->dir, sizeof rp->dir, "%s", o->resume_checkpoint);
    }
    rp->elsewhere = resume_from_elsewhere(o);
    if (check_resume(o, c, train, params, rp, err, sizeof err) != 0) fatal("%s", err);
}

// run_dir/loss.svg: the loss curve, drawn again at each log interval from every point logged so far
// (a resumed run starts from the rows log.csv kept). A chart that cannot be written is one warning,
// not the end of the run.
typedef struct {
    LossLog log;
    char path[4400];
    const char *title;
    int warned;
} LossChart;

static void loss_chart_draw(LossChart *c) {
    char err[4600];
    if (loss_plot_write(c->path, c->title, c->log.points, c->log.count, err, sizeof err) != 0 && !c->warned++)
        fprintf(stderr, "train_unet: warning: %s (tried again at each log interval)\n", err);
}

static void loss_chart_open(LossChart *c, const char *run_dir) {
    char log_path[4400], err[4600];
    memset(c, 0, sizeof *c);
    c->title = run_dir;
    snprintf(c->path, sizeof c->path, "%s/loss.svg", run_dir);
    snprintf(log_path, sizeof log_path, "%s/log.csv", run_dir);
    if (loss_log_read_csv(&c->log, log_path, err, sizeof err) != 0) fatal("%s", err);
    loss_chart_draw(c);
}

static void loss_chart_add(LossChart *c, int64_t step, double loss, double lr) {
    if (loss_log_add(&c->log, step, loss, lr) != 0) fatal("out of host memory");
    loss_chart_draw(c);
}

// A hash of the weights (FNV-1a over the fp32 master values): printed by every rank of a team at
// the end, equal when the ranks stayed in step.
static uint64_t weights_hash(const UNet *m) {
    float *host = (float *)malloc_or_die(m->storage * sizeof(float));
    cuda_check(cudaMemcpy(host, m->master, m->storage * sizeof(float), cudaMemcpyDeviceToHost));
    uint64_t h = 0xcbf29ce484222325ULL;
    const uint8_t *bytes = (const uint8_t *)host;
    for (size_t i = 0; i < (size_t)m->storage * sizeof(float); i++) h = (h ^ bytes[i]) * 0x100000001b3ULL;
    free(host);
    return h;
}

// Stop signals (SIGINT, SIGTERM, SIGHUP) end the run after the step they come in; SIGUSR1, from
// --gpus, says that another rank failed (on_stop_signal).
static void catch_stop_signals(void) {
    catch_signals(on_stop_signal);
    catch_signal(SIGUSR1, on_stop_signal);
}

// A team starts from rank 0's state: rank 0 alone reads a resume's checkpoint or --init_from's
// weights (the others need neither on their machines) and sends what it read to the others: the
// weights, the EMAs, AdamW's moments, the step, the data position and the schedule sampler's loss
// history. A fresh start sends only the header: every rank initialised the same weights from the
// seed. Each rank checks the header against its own model first, and stops with one line where it
// differs (a rank started with other options).
typedef struct {
    int64_t storage, step;
    int32_t num_ema, history_steps, from_files;
    LoaderPosition position;
} StartState;

static void team_share_start(Trainer *tr, LoaderPosition *position, int from_files) {
    if (!team.comm) return;
    UNet *m = &tr->m;
    int history_steps = tr->weighted_draws ? tr->history.steps : 0;
    StartState mine = {m->storage, tr->step, tr->train.num_ema, history_steps, from_files, *position}, got;
    size_t history_bytes = (size_t)history_steps * (sizeof(int32_t) + LOSS_HISTORY * sizeof(float));
    uint8_t *staged;  // the header, then the history
    cuda_check(cudaMalloc(&staged, sizeof got + history_bytes));
    cuda_check(cudaMemcpy(staged, &mine, sizeof mine, cudaMemcpyHostToDevice));
    team_broadcast(staged, sizeof got, gpu.stream);
    cuda_check(cudaMemcpyAsync(&got, staged, sizeof got, cudaMemcpyDeviceToHost, gpu.stream));
    cuda_check(cudaStreamSynchronize(gpu.stream));
    if (got.storage != mine.storage || got.num_ema != mine.num_ema || got.history_steps != mine.history_steps)
        fatal("rank 0's model has %lld values, %d EMAs and a loss history of %d timesteps; this rank's %lld, %d and %d: start "
              "every rank with the same options", (long long)got.storage, got.num_ema, got.history_steps, (long long)mine.storage,
              mine.num_ema, mine.history_steps);
    if (got.from_files) {
        size_t bytes = m->storage * sizeof(float);
        team_broadcast(m->master, bytes, gpu.stream);
        for (int i = 0; i < tr->train.num_ema; i++) team_broadcast(tr->ema[i], bytes, gpu.stream);
        team_broadcast(m->adam_m, bytes, gpu.stream);
        team_broadcast(m->adam_v, bytes, gpu.stream);
        if (history_steps) {
            uint8_t *history = staged + sizeof got;
            size_t counts = history_steps * sizeof(int32_t);
            cuda_check(cudaMemcpy(history, tr->history.counts, counts, cudaMemcpyHostToDevice));
            cuda_check(cudaMemcpy(history + counts, tr->history.losses, history_bytes - counts, cudaMemcpyHostToDevice));
            team_broadcast(history, history_bytes, gpu.stream);
            cuda_check(cudaMemcpyAsync(tr->history.counts, history, counts, cudaMemcpyDeviceToHost, gpu.stream));
            cuda_check(cudaMemcpyAsync(tr->history.losses, history + counts, history_bytes - counts, cudaMemcpyDeviceToHost, gpu.stream));
        }
        cuda_check(cudaStreamSynchronize(gpu.stream));
        unet_sync_compute(m);
        tr->step = got.step;
        *position = got.position;
    }
    cuda_check(cudaFree(staged));
}

// The training run, from a checked resume point, or from a fresh initialisation when resume is
// NULL, on the dataset whose header main checked. In a team resume and init are rank 0's alone
// (NULL on the others, which take its state: team_share_start); every rank trains and only rank 0
// writes, in the run folder it holds (take_run_folder): the run folder's files, sample grids,
// checkpoints (the same files as one GPU's) and the progress lines.
static void run_training(const Options *o, const ModelConfig *config, const DiffusionConfig *diffusion, const TrainConfig *train,
                         const ParamList *params, const ResumePoint *resume, const InitFrom *init, const DatasetHeader *checked,
                         const DatasetHeader *val_checked) {
    char err[1024], saved[4400] = "";
    int lead = team.rank == 0;
    if (lead && o->overwrite) clear_run_folder(o->run_dir);  // never with a resume (validate_training)
    if (lead && resume && !resume->elsewhere) set_aside_later_checkpoints(o->run_dir, resume->step);
    DataLoader loader, val_loader, *val = val_checked ? &val_loader : NULL;  // (opened first: the training data is the one
    if (val && loader_open(val, o->val_data, val_checked, o->batch_size, team.rank, team.world, 0, (uint64_t)o->seed, 1, err,  // watched)
                           sizeof err) != 0)
        fatal("%s", err);
    if (loader_open(&loader, o->data, checked, o->batch_size, team.rank, team.world, o->random_flip, (uint64_t)o->seed, 1, err,
                    sizeof err) != 0)
        fatal("%s", err);
    Trainer tr;
    trainer_create(&tr, config, diffusion, train, loader.batch_pixels, loader.batch_labels);
    if (val) trainer_add_evaluation(&tr, val->batch_pixels, val->batch_labels);
    LoaderPosition position = {0, 0};
    if (resume) {
        if (load_checkpoint(&tr, resume, err, sizeof err) != 0) fatal("%s", err);
        position = resume->position;
        printf("%s %s at step %lld\n", resume->elsewhere ? "new run started from" : "resumed from", resume->dir, (long long)tr.step);
    } else {
        unet_init_parameters(&tr.m, (uint64_t)o->seed);
        if (init) {  // the file's weights over the initialised ones (all but a label_emb of other classes)
            float *staged = (float *)malloc_or_die(tr.m.storage * sizeof(float));
            cuda_check(cudaMemcpy(staged, tr.m.master, tr.m.storage * sizeof(float), cudaMemcpyDeviceToHost));
            if (read_parameters(&init->loaded, init->file, 0, staged, err, sizeof err) != 0) fatal("%s", err);
            cuda_check(cudaMemcpy(tr.m.master, staged, tr.m.storage * sizeof(float), cudaMemcpyHostToDevice));
            free(staged);
            unet_sync_compute(&tr.m);
            printf("new run started from the weights of %s\n", init->file);
        }
        trainer_reset_ema(&tr);
    }
    team_share_start(&tr, &position, resume || init);
    if (loader_seek(&loader, position, err, sizeof err) != 0) fatal("%s", err);
    FILE *log = NULL;
    LossChart chart;
    if (lead) {
        prune_checkpoints(o->run_dir, 0);  // what a crashed save or removal left
        write_config(o->run_dir, o);
        if (getenv("TORCHELASTIC_RUN_ID")) {  // (continue_after_restart)
            char path[4400];
            snprintf(path, sizeof path, "%s/" TORCHRUN_MARK, o->run_dir);
            write_file_atomically(path, fill_text, getenv("TORCHELASTIC_RUN_ID"));
        }
        log = open_log(o->run_dir, tr.step, tr.classifier, o->eval_num > 0);
        loss_chart_open(&chart, o->run_dir);
    }
    FidEvaluation fid;  // --eval_num: rank 0's
    memset(&fid, 0, sizeof fid);
    if (lead && o->eval_num) fid_evaluation_open(&fid, o, &loader.data);

    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, team.local_rank));
    char buf[32];
    if (team.world > 1)
        printf("training on %d GPUs (rank 0: %s), %s: %s parameters, %lld steps of %d images (%d a GPU), run folder %s\n",
               team.world, prop.name, PRECISION_NAME, with_commas(params->numel, buf, sizeof buf), o->steps,
               o->batch_size * team.world, o->batch_size, o->run_dir);
    else
        printf("training on %s (%s): %s parameters, %lld steps of %d images, run folder %s\n", prop.name, PRECISION_NAME,
               with_commas(params->numel, buf, sizeof buf), o->steps, o->batch_size, o->run_dir);
    GpuSampler sampler;  // made at the first grid
    memset(&sampler, 0, sizeof sampler);
    const Dataset *grid_originals = val ? &val->data : &loader.data;  // an upsampler's grid's images
    double interval_loss = 0, interval_mse = 0, interval_vb = 0, started = now_seconds(), interval_start = started;
    double interval_quarter[4] = {0}, interval_quarter_count[4] = {0};  // per quarter of t: sums of the weighted losses, counts
    ClassifierLog train_log = {}, val_log = {};  // a classifier's: its steps', its evaluations'
    int interval_steps = 0, bad_in_row = 0;
    int64_t bad_total = 0, first_step = tr.step;
    int64_t last = o->stop_step > 0 && o->stop_step < o->steps ? o->stop_step : o->steps;
    int global_batch = o->batch_size * o->gpus;
    // A team stops together: after the step in which any rank was asked to (StepState.stop).
    while (tr.step < last && !(team.comm ? tr.host_state->stop : stop_requested)) {
        loader_next_batch(&loader);
        trainer_step(&tr);
        const StepState *s = tr.host_state;
        if (!s->finite) {  // the loss and the norm are the team's: every rank comes here at the same step
            bad_in_row++, bad_total++;
            if (lead)
                fprintf(stderr, "train_unet: warning: step %lld skipped: loss %g, gradient norm %g (not finite); weights unchanged\n",
                        (long long)tr.step, s->loss, s->grad_norm);
            if (bad_in_row >= o->max_bad_steps && !lead) exit(1);  // rank 0 says why
            if (bad_in_row >= o->max_bad_steps)
                fatal("stopping: %d non-finite steps in a row (at step %lld); the last good checkpoint is %s", bad_in_row,
                      (long long)tr.step, saved[0] ? saved : "none (no checkpoint was saved in this run)");
            continue;
        }
        bad_in_row = 0;
        interval_loss += s->loss, interval_mse += s->mse, interval_vb += s->vb, interval_steps++;
        for (int q = 0; q < 4; q++) interval_quarter[q] += s->quarter_loss[q], interval_quarter_count[q] += s->quarter_count[q];
        if (tr.classifier) classifier_log_add(&train_log, s->terms);
        if (val && tr.step % o->eval_interval == 0) classifier_log_add(&val_log, trainer_evaluate(&tr, val, tr.step / o->eval_interval - 1));
        if (o->eval_num && ((fid_interval(o) && tr.step % fid_interval(o) == 0) || tr.step == o->steps)) {
            double eval_start = now_seconds();
            if (lead) fid_evaluate(&fid, &tr, o);
            interval_start += now_seconds() - eval_start;  // the log's speed is the training's
            tr.others_wait = !lead;
        }
        if (lead && (tr.step % o->log_interval == 0 || tr.step == o->steps)) {
            double t = now_seconds(), ms = 1000.0 * (t - interval_start) / fmax(interval_steps, 1);
            double img_s = global_batch * 1000.0 / ms, eta = (o->steps - tr.step) * ms / 1000.0;
            double mem = gpu_bytes_allocated / 1073741824.0;
            char terms[192] = "";
            if (tr.diffusion.config.variance == VARIANCE_LEARNED_RANGE)
                snprintf(terms, sizeof terms, " (mse %.4f, vb %.4f)", interval_mse / interval_steps, interval_vb / interval_steps);
            if (tr.classifier) classifier_log_say(terms, sizeof terms, &train_log, &val_log, tr.config.out_channels);
            printf("step %lld/%lld  loss %.4f%s  lr %.3g  grad norm %.3f  %.0f img/s  %.1f ms/step  ETA %.0fh%02.0fm%s\n",
                   (long long)tr.step, o->steps, interval_loss / interval_steps, terms, s->lr, s->grad_norm, img_s, ms,
                   floor(eta / 3600), fmod(eta / 60, 60), bad_total ? "  (non-finite steps skipped so far: see warnings)" : "");
            fprintf(log, "%lld,%.6f,%.6g,%.6f,%.1f,%.3f,%.3f", (long long)tr.step, interval_loss / interval_steps, s->lr,
                    s->grad_norm, img_s, ms, mem);
            if (tr.classifier) {
                classifier_log_columns(log, &train_log, 1), classifier_log_columns(log, &val_log, 0);
                train_log = {}, val_log = {};
            } else {
                fprintf(log, ",%.6f,%.6f", interval_mse / interval_steps, interval_vb / interval_steps);
                for (int q = 0; q < 4; q++)  // (empty when no sample's t fell in the quarter)
                    if (interval_quarter_count[q] > 0) fprintf(log, ",%.6f", interval_quarter[q] / interval_quarter_count[q]);
                    else fputc(',', log);
                if (o->eval_num && fid.step == tr.step) fprintf(log, ",%.4f", fid.fid);
                else if (o->eval_num) fputc(',', log);
            }
            fputc('\n', log);
            fflush(log);
            fflush(stdout);
            loss_chart_add(&chart, tr.step, interval_loss / interval_steps, s->lr);
            interval_loss = interval_mse = interval_vb = 0, interval_steps = 0, interval_start = t;
            for (int q = 0; q < 4; q++) interval_quarter[q] = interval_quarter_count[q] = 0;
        }
        if (o->sample_count && o->sample_interval && tr.step % o->sample_interval == 0 && tr.step < last) {
            if (lead) write_samples(&tr, o, &sampler, grid_originals, o->run_dir);
            tr.others_wait = !lead;
        }
        if (tr.step % o->save_interval == 0 && tr.step < last) {
            if (lead) {
                if (save_checkpoint(&tr, o, o->run_dir, &loader.position, saved, sizeof saved, err, sizeof err) != 0) fatal("%s", err);
                printf("saved %s\n", saved);
            }
            tr.others_wait = !lead;
        }
    }
    trainer_settle(&tr);
    if (team.world > 1)
        fprintf(stderr, "train_unet rank %d: weights hash %016" PRIx64 " at step %lld\n", team.rank, weights_hash(&tr.m), (long long)tr.step);
    if (lead) {
        if (tr.step > first_step || !saved[0]) {
            if (save_checkpoint(&tr, o, o->run_dir, &loader.position, saved, sizeof saved, err, sizeof err) != 0) fatal("%s", err);
        }
        if (o->sample_count && tr.step > first_step) write_samples(&tr, o, &sampler, grid_originals, o->run_dir);
        printf("%s at step %lld: checkpoint %s (%.0f s; %lld non-finite steps skipped)\n",
               tr.step < o->steps ? "stopped" : "done", (long long)tr.step, saved, now_seconds() - started, (long long)bad_total);
        fclose(log);
        loss_log_free(&chart.log);
        if (o->eval_num) fid_evaluation_close(&fid);
    }
    loader_close(&loader);
    if (val) loader_close(val);
}

// --bench N: the training step on one fixed random batch (no data loading), as training replays
// it; after 10 warm-up steps, N steps are timed one by one with events; prints the median. In a
// team every rank times its own steps (they wait for each other in the all-reduce) and rank 0
// prints; images/s counts every rank's images.
static void run_bench(const Options *o, const ModelConfig *config, const DiffusionConfig *diffusion, const TrainConfig *train,
                      const ParamList *params) {
    uint8_t *pixels;
    int32_t *labels;
    size_t n = (size_t)o->batch_size * config->image_size * config->image_size * 3;
    cuda_check(cudaMallocHost((void **)&pixels, n));
    cuda_check(cudaMallocHost((void **)&labels, o->batch_size * sizeof(int32_t)));
    for (size_t i = 0; i < n; i++) pixels[i] = (uint8_t)(random_u64(1, rng_stream(RNG_BENCH_BATCH, 0), i) >> 56);
    int classes = config->pool ? config->out_channels : config->num_classes - 1;  // (a diffusion model's: not the null class)
    for (int i = 0; i < o->batch_size; i++) labels[i] = classes > 0 ? (int32_t)(random_u64(1, rng_stream(RNG_BENCH_BATCH, 1), i) % classes) : 0;
    Trainer tr;
    trainer_create(&tr, config, diffusion, train, pixels, labels);
    print_training_plan(stdout, &tr.m, train, -1);
    unet_init_parameters(&tr.m, (uint64_t)o->seed);
    trainer_reset_ema(&tr);
    for (int i = 0; i < 10; i++) trainer_step(&tr);
    float first_loss = tr.host_state->loss;
    cudaEvent_t start, stop;
    cuda_check(cudaEventCreate(&start));
    cuda_check(cudaEventCreate(&stop));
    float *ms = (float *)malloc_or_die(o->bench * sizeof(float));
    for (int i = 0; i < o->bench; i++) {
        cuda_check(cudaEventRecord(start, gpu.stream));
        trainer_step(&tr);
        cuda_check(cudaEventRecord(stop, gpu.stream));
        cuda_check(cudaEventSynchronize(stop));
        cuda_check(cudaEventElapsedTime(&ms[i], start, stop));
    }
    qsort(ms, o->bench, sizeof(float), compare_floats);
    float median = ms[o->bench / 2];
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, team.local_rank));
    char buf[32];
    printf("bench: %s, %s preset, batch %d, %s, %s parameters", prop.name, o->preset, o->batch_size, PRECISION_NAME,
           with_commas(params->numel, buf, sizeof buf));
    if (team.world > 1) printf(", %d GPUs (a process each, over NCCL)", team.world);
    printf("\n");
    printf("bench: loss %.4f at step 10, %.4f at step %d (one fixed batch, fresh noise each step)\n", first_loss,
           tr.host_state->loss, 10 + o->bench);
    printf("bench: median %.3f ms/step (min %.3f, max %.3f over %d steps), %.0f img/s, GPU memory %.2f GiB\n", median,
           ms[0], ms[o->bench - 1], o->bench, o->batch_size * team.world / (median / 1000.0), gpu_bytes_allocated / 1073741824.0);
    double flops = unet_training_flops(&tr.m) * tr.pieces, tflops = flops / (median * 1e-3) / 1e12, peak = bf16_peak_tflops(prop.name);
    printf("bench: %.1f GFLOP a step on each GPU (the model's convolutions and matrix products, forward and backward), %.1f TFLOP/s",
           flops / 1e9, tflops);
    if (peak > 0) printf(", %.1f%% of the %s's dense BF16 peak (%.0f TFLOP/s)", 100.0 * tflops / peak, prop.name, peak);
    printf("\n");
    free(ms);
    if (getenv("UNET_PROFILE")) print_profile(&tr.m);
}

#endif  // TRAIN_UNET_LIBRARY: the command line and the training run

// ----------------------------------------------------------------------------------------------
#include "unet_api.cuh"  // defines: the C API of unet_api.h, for generate and evaluate

// ----------------------------------------------------------------------------------------------
// main

#ifndef TRAIN_UNET_LIBRARY

// --bench_loader N: the data loader alone, on the host: N batches of --batch_size from the start of
// the data order, twice, each from a cold page cache (the file's pages dropped with
// posix_fadvise(POSIX_FADV_DONTNEED) first): with the read-ahead training uses (loader_read_ahead)
// and without. Prints images/s, the disk's MB/s and the step time each pass would keep up with.
static int run_bench_loader(const Options *o, int batches) {
    char err[512];
    printf("bench_loader: %d batches of %d from %s, each pass from a cold page cache\n", batches, o->batch_size, o->data);
    for (int pass = 0; pass < 2; pass++) {
        DataLoader loader;
        if (loader_open(&loader, o->data, NULL, o->batch_size, 0, 1, o->random_flip, (uint64_t)o->seed, 0, err, sizeof err) != 0)
            fatal("%s", err);
        int dropped = 1;
        for (int k = 0; k < dataset_files(&loader.data); k++) {
            const char *path = loader.data.num_parts ? loader.data.part_paths[k] : o->data;
            int fd = open(path, O_RDONLY | O_CLOEXEC);
            if (fd < 0) fatal("cannot open %s: %s", path, strerror(errno));
            dropped &= posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED) == 0;
            close(fd);
        }
        loader.read_ahead = pass == 0;
        double start = now_seconds();
        for (int i = 0; i < batches; i++) loader_next_batch(&loader);
        double seconds = now_seconds() - start, images = (double)batches * o->batch_size;
        printf("  read-ahead %-3s: %.0f images/s, %.1f MB/s, %.3f ms a batch%s\n", pass == 0 ? "on" : "off", images / seconds,
               images * loader.data.layout.image_bytes / seconds / 1e6, 1e3 * seconds / batches,
               dropped ? "" : " (the page cache could not be dropped: not cold)");
        loader_close(&loader);
    }
    return 0;
}

// Weak, so that generate, which links this same object for its C API, brings its own main.
__attribute__((weak)) int main(int argc, char **argv) {
    signal(SIGXFSZ, SIG_IGN);  // a write past the file-size limit fails (EFBIG, "File too large") and is said
    Options o = parse_options(argc, argv);
    int launched = team_from_environment(&team);  // a rank of a team that a launcher (or --gpus) started
    if (launched) {
        if (o.gpus > 1 && o.gpus != team.world)
            usage_error("--gpus %d starts processes itself; under a launcher (a world of %d) leave it out", o.gpus, team.world);
        o.gpus = team.world;
        static char name[64];
        snprintf(name, sizeof name, "%s rank %d", program_name, team.rank);
        if (team.world > 1) program_name = name;
        if (team.rank != 0 && !freopen("/dev/null", "w", stdout)) fatal("cannot open /dev/null: %s", strerror(errno));
    }
    Dataset data = {};
    char err[512];
    if (o.data[0]) {  // the dataset decides the image size and the classes
        if (dataset_open_parts(o.data, &data, err, sizeof err) != 0) fatal("%s", err);
        check_dataset(&data.header, &o, launched || o.gpus == 1 || o.dry_run);
    }
    ModelConfig model = resolve_run_model(&o);
    validate_training(&o);
    char rdzv[300] = "";  // a team's rendezvous: --rdzv, else torchrun's MASTER_ADDR and MASTER_PORT, else the run folder's file
    int agent_store = 0;  // rdzv is torchrun's agent store
    if (launched || o.gpus > 1) rendezvous_from_environment(o.rdzv, rdzv, sizeof rdzv, &agent_store);
    DiffusionConfig diffusion = diffusion_config(&o, &model);
    TrainConfig train = train_config(&o);
    Dataset val_data = {};
    if (o.val_data[0]) {
        if (dataset_open_parts(o.val_data, &val_data, err, sizeof err) != 0) fatal("%s", err);
        check_val_dataset(&val_data.header, &o);
    }
    if (o.bench < 0) usage_error("--bench %d must be positive", o.bench);
    if (o.bench_loader < 0) usage_error("--bench_loader %d must be positive", o.bench_loader);
    if (o.bench_loader && !o.data[0]) usage_error("--bench_loader times --data's loader: give --data FILE.bin");
    if (o.bench_loader) return run_bench_loader(&o, o.bench_loader);
    if (!o.dry_run && !o.bench && !o.data[0]) usage_error("training needs --data FILE.bin (or --dry_run, or --bench N)");
    ParamList params = model_parameters(&model);

    // Everything a run will read or write is checked here, before the GPU, and by --dry_run too.
    ResumePoint resume;
    static char origin[PATH_MAX];  // a checkpoint from elsewhere by its real path: config.txt records it
    if (launched && !o.bench && !o.dry_run && team.rank == 0) continue_after_restart(&o);
    if (!o.bench && team.rank == 0) check_run_folder(&o);
    if (!o.bench && resume_from_elsewhere(&o) && realpath(o.resume_checkpoint, origin)) o.resume_checkpoint = origin;
    int reads_start = !o.bench && team.rank == 0;  // the checkpoint or weights a run starts from: rank 0's (team_share_start)
    if (reads_start && o.resume_checkpoint[0]) {
        find_resume_point(&o, &model, &train, &params, &resume);
        if (data.map && resume.position.next > data.header.count)
            fatal("%s stopped at image %" PRIu64 " of an epoch, past the %" PRIu64 " images of dataset %s: another dataset?",
                  resume.dir, resume.position.next, data.header.count, o.data);
        if (resume.changes[0] && (launched || o.gpus == 1 || o.dry_run)) printf("resume: changed since the checkpoint: %s\n", resume.changes);
    }
    InitFrom init;
    int64_t fid_bytes = 0;  // --eval_num's GPU memory, for --dry_run's plan
    if (reads_start && o.init_from[0]) {
        if (check_init_from(&o, &model, &init, err, sizeof err) != 0) fatal("--init_from: %s", err);
        if (init.label_rows && (launched || o.gpus == 1 || o.dry_run))
            printf("init_from: %s has %d label_emb rows, this model %d: label_emb starts from its initialisation, the rest from the file\n",
                   init.file, init.label_rows, model.num_classes);
    }
    if (!o.bench && o.eval_num) {  // FID's weights and reference, checked before anything is written
        if (data.map && data.header.count <= UNET_INCEPTION_FEATURES)
            fatal("--eval_num: dataset %s holds %" PRIu64 " images: FID's reference needs more than %d (its features' dimension)", o.data,
                  data.header.count, UNET_INCEPTION_FEATURES);
        char inception[4096];
        if (o.inception[0]) snprintf(inception, sizeof inception, "%s", o.inception);
        else unet_inception_default_path(inception, sizeof inception);
        UnetInception *net = unet_inception_open(inception, err, sizeof err);
        if (!net) fatal("--eval_num: %s", err);
        if (o.dry_run) fid_bytes = fid_memory_bytes(&model, o.sample_steps, net);
        unet_inception_close(net);
        if (launched || o.gpus == 1 || o.dry_run) {
            char every[64] = "";
            if (fid_interval(&o)) snprintf(every, sizeof every, "every %d steps and ", fid_interval(&o));
            printf("FID: %d samples %sat the end, Inception-v3 weights %s\n", o.eval_num, every, inception);
        }
    }

    if (o.dry_run) {
        print_config(stdout, &o);
        printf("precision: %s\n", PRECISION_NAME);
        print_model_summary(stdout, &model, &params);
        print_run_memory(&o, &model, &train, fid_bytes);
        print_conv_plans(&o, &model);
        if (data.map)
            printf("dataset: %s, %" PRIu64 " images of %ux%u, %u classes\n", o.data, data.header.count,
                   data.header.width, data.header.height, data.header.num_classes);
        if (val_data.map)
            printf("validation dataset: %s, %" PRIu64 " images, evaluated on a batch every %d steps\n", o.val_data,
                   val_data.header.count, o.eval_interval);
        if (o.resume_checkpoint[0])
            printf("resume: %s at step %lld, checked%s\n", resume.dir, (long long)resume.step,
                   resume.elsewhere ? "; from outside the run folder, it starts a new run there" : "");
        if (o.init_from[0]) printf("init_from: %s, checked: %d tensors start from it\n", init.file, init.loaded.count);
        dataset_close(&data), dataset_close(&val_data);
        free(params.specs);
        return 0;
    }

    if (gpu_available(err, sizeof err) != 0) fatal("%s; --dry_run checks a configuration without one", err);
    int devices = 0;
    cuda_check(cudaGetDeviceCount(&devices));
    if (!launched && o.gpus > 1) {
        if (o.gpus > devices) fatal("--gpus %d, but this machine shows %d GPU%s", o.gpus, devices, devices == 1 ? "" : "s");
        dataset_close(&data), dataset_close(&val_data);
        free(params.specs);
        return launch_gpus(o.gpus, argv);
    }
    // A launcher that gives each rank its own GPU (srun --gpus-per-task) leaves it one to see.
    if (devices == 1) team.local_rank = 0;
    if (team.local_rank >= devices)
        fatal("local rank %d needs GPU %d, but this machine shows %d GPUs", team.local_rank, team.local_rank, devices);
    gpu_init(team.local_rank);
    if (!o.bench) catch_stop_signals();
    if (!o.bench && team.rank == 0) take_run_folder(&o, o.resume_checkpoint[0] ? &resume : NULL);
    if (launched) {  // the rendezvous (rdzv, checked above)
        char config[512];
        snprintf(config, sizeof config, "parameters %lld; batch_size %d; microbatch %d; steps %lld; seed %lld; dataset %" PRIu64
                 " images of %ux%u; precision %s", (long long)params.numel, o.batch_size, o.microbatch, o.steps, o.seed,
                 data.map ? data.header.count : 0, data.header.width, data.header.height, PRECISION_NAME);
        team_join(o.run_dir, rdzv, agent_store, o.rdzv_timeout, config);
    }
    if (o.bench) {
        run_bench(&o, &model, &diffusion, &train, &params);
    } else {
        DatasetHeader checked = data.header, val_checked = val_data.header;
        dataset_close(&data), dataset_close(&val_data);
        run_training(&o, &model, &diffusion, &train, &params, reads_start && o.resume_checkpoint[0] ? &resume : NULL,
                     reads_start && o.init_from[0] ? &init : NULL,
                     &checked, o.val_data[0] ? &val_checked : NULL);
    }
    team_leave();
    free(params.specs);
    return 0;
}

#else
#pragma nv_diag_default 177  // the includer's own unreferenced functions are reported (see the top)
#endif  // TRAIN_UNET_LIBRARY
