// train_unet.cu: trains guided-diffusion's UNet on NVIDIA GPUs, in one file.
//
// Reading order: precision and error checks; random numbers; the model's configuration and its
// parameter list (guided-diffusion's state_dict names and shapes); the data loader; the command
// line; main. Built with -DTRAIN_UNET_LIBRARY it has no main, so tests and tools include it.
//
// Activations are NHWC (channels last). PRECISION_BF16 (the default) keeps activations in bf16
// with fp32 master weights and fp32 accumulation; PRECISION_FP32 is fp32 throughout.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "dataset.h"

// ----------------------------------------------------------------------------------------------
// Precision and error checks

#if defined(PRECISION_FP32)
typedef float floatX;
#define PRECISION_NAME "FP32"
#else
typedef __nv_bfloat16 floatX;
#define PRECISION_NAME "BF16"
#endif

// Prints one error line and exits: every failure the user can cause ends here.
static void fatal(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "train_unet: error: ");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    va_end(args);
    exit(1);
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
// Random numbers: counter-based, so any draw is a pure function of (seed, stream, index) and the
// state to save for an exact resume is only the counters.

// splitmix64's finaliser: a bijective mix of 64 bits.
static inline uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// A random 64-bit value for draw `index` of stream `stream` under `seed`.
static inline uint64_t random_u64(uint64_t seed, uint64_t stream, uint64_t index) {
    return mix64(mix64(seed ^ mix64(stream + 0x9e3779b97f4a7c15ull)) + index);
}

// A uniform integer in [0, n) without modulo bias (Lemire's multiply-shift, with rejection).
static inline uint64_t random_below(uint64_t seed, uint64_t stream, uint64_t *counter, uint64_t n) {
    for (;;) {
        uint64_t x = random_u64(seed, stream, (*counter)++);
        __uint128_t m = (__uint128_t)x * n;
        uint64_t low = (uint64_t)m;
        if (low >= n || low >= (0 - n) % n) return (uint64_t)(m >> 64);
    }
}

// The random streams, one per purpose, so that adding a draw in one never shifts another.
enum { STREAM_SHUFFLE = 1, STREAM_FLIP = 2 };

// ----------------------------------------------------------------------------------------------
// The model's configuration: guided-diffusion's UNetModel arguments, resolved and validated.

#define MAX_LEVELS 8

typedef struct {
    int image_size;
    int in_channels, out_channels;
    int model_channels;
    int num_levels;                       // len(channel_mult)
    int level_channels[MAX_LEVELS];       // int(channel_mult[level] * model_channels)
    int level_attention[MAX_LEVELS];      // attention blocks at this level (downsample rate 2^level)
    int num_res_blocks;
    int num_heads, num_heads_upsample;    // used when num_head_channels == -1
    int num_head_channels;                // -1: fixed head count instead
    int use_scale_shift_norm, resblock_updown, conv_resample, use_new_attention_order;
    float dropout;
    int num_classes;                      // rows of label_emb (dataset classes + the null class), 0: unconditional
} ModelConfig;

// One parameter tensor as guided-diffusion's state_dict names it, shape in PyTorch's layout.
typedef struct {
    char name[96];
    int ndim;
    int shape[4];
    int64_t numel;
} ParamSpec;

typedef struct {
    ParamSpec *specs;
    int count, capacity;
    int64_t numel;
    int time_embed_dim;
} ParamList;

static void param_add(ParamList *list, const char *prefix, const char *leaf, int ndim, const int *shape) {
    if (list->count == list->capacity) {
        list->capacity = list->capacity ? 2 * list->capacity : 256;
        list->specs = (ParamSpec *)realloc(list->specs, list->capacity * sizeof(ParamSpec));
        if (!list->specs) fatal("out of host memory");
    }
    ParamSpec *p = &list->specs[list->count++];
    snprintf(p->name, sizeof p->name, "%s%s", prefix, leaf);
    p->ndim = ndim;
    p->numel = 1;
    for (int i = 0; i < ndim; i++) p->shape[i] = shape[i], p->numel *= shape[i];
    list->numel += p->numel;
}

// A convolution's weight [out][in][k...] (dims = 1 or 2 spatial dimensions) and bias [out].
static void param_conv(ParamList *list, const char *prefix, int in, int out, int k, int dims) {
    int weight[4] = {out, in, k, k};
    int bias[1] = {out};
    param_add(list, prefix, "weight", 2 + dims, weight);
    param_add(list, prefix, "bias", 1, bias);
}

static void param_linear(ParamList *list, const char *prefix, int in, int out) {
    int weight[2] = {out, in};
    int bias[1] = {out};
    param_add(list, prefix, "weight", 2, weight);
    param_add(list, prefix, "bias", 1, bias);
}

static void param_group_norm(ParamList *list, const char *prefix, int channels) {
    int shape[1] = {channels};
    param_add(list, prefix, "weight", 1, shape);
    param_add(list, prefix, "bias", 1, shape);
}

static void param_child(char *out, size_t len, const char *prefix, const char *child) {
    snprintf(out, len, "%s%s", prefix, child);
}

// guided-diffusion's ResBlock: in_layers (GroupNorm, SiLU, conv3x3), emb_layers (SiLU, linear to
// out or 2*out channels with scale-shift), out_layers (GroupNorm, SiLU, dropout, zero conv3x3),
// skip_connection (1x1 conv when the channel count changes). up/down resampling has no weights.
static void param_res_block(ParamList *list, const ModelConfig *c, const char *prefix, int in, int out) {
    char name[96];
    param_child(name, sizeof name, prefix, "in_layers.0."), param_group_norm(list, name, in);
    param_child(name, sizeof name, prefix, "in_layers.2."), param_conv(list, name, in, out, 3, 2);
    param_child(name, sizeof name, prefix, "emb_layers.1.");
    param_linear(list, name, list->time_embed_dim, c->use_scale_shift_norm ? 2 * out : out);
    param_child(name, sizeof name, prefix, "out_layers.0."), param_group_norm(list, name, out);
    param_child(name, sizeof name, prefix, "out_layers.3."), param_conv(list, name, out, out, 3, 2);
    if (out != in) param_child(name, sizeof name, prefix, "skip_connection."), param_conv(list, name, in, out, 1, 2);
}

// guided-diffusion's AttentionBlock: GroupNorm, qkv (1x1 conv1d to 3C), proj_out (zero conv1d).
static void param_attention(ParamList *list, const char *prefix, int channels) {
    char name[96];
    param_child(name, sizeof name, prefix, "norm."), param_group_norm(list, name, channels);
    param_child(name, sizeof name, prefix, "qkv."), param_conv(list, name, channels, 3 * channels, 1, 1);
    param_child(name, sizeof name, prefix, "proj_out."), param_conv(list, name, channels, channels, 1, 1);
}

// Every parameter of the UNet in state_dict order, walking the architecture as UNetModel.__init__
// does: time_embed, label_emb, input_blocks, middle_block, output_blocks, out.
static ParamList model_parameters(const ModelConfig *c) {
    ParamList list = {0};
    list.time_embed_dim = 4 * c->model_channels;
    char name[96];
    param_linear(&list, "time_embed.0.", c->model_channels, list.time_embed_dim);
    param_linear(&list, "time_embed.2.", list.time_embed_dim, list.time_embed_dim);
    if (c->num_classes) {
        int shape[2] = {c->num_classes, list.time_embed_dim};
        param_add(&list, "label_emb.", "weight", 2, shape);
    }
    int ch = c->level_channels[0];
    param_conv(&list, "input_blocks.0.0.", c->in_channels, ch, 3, 2);
    int skip_channels[4 * MAX_LEVELS * 8], num_skips = 0, block = 1;
    skip_channels[num_skips++] = ch;
    for (int level = 0; level < c->num_levels; level++) {
        for (int r = 0; r < c->num_res_blocks; r++, block++) {
            snprintf(name, sizeof name, "input_blocks.%d.0.", block);
            param_res_block(&list, c, name, ch, c->level_channels[level]);
            ch = c->level_channels[level];
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "input_blocks.%d.1.", block);
                param_attention(&list, name, ch);
            }
            skip_channels[num_skips++] = ch;
        }
        if (level != c->num_levels - 1) {
            snprintf(name, sizeof name, c->resblock_updown ? "input_blocks.%d.0." : "input_blocks.%d.0.op.", block);
            if (c->resblock_updown) param_res_block(&list, c, name, ch, ch);
            else if (c->conv_resample) param_conv(&list, name, ch, ch, 3, 2);
            skip_channels[num_skips++] = ch;
            block++;
        }
    }
    param_res_block(&list, c, "middle_block.0.", ch, ch);
    param_attention(&list, "middle_block.1.", ch);
    param_res_block(&list, c, "middle_block.2.", ch, ch);
    block = 0;
    for (int level = c->num_levels - 1; level >= 0; level--) {
        for (int r = 0; r <= c->num_res_blocks; r++, block++) {
            int skip = skip_channels[--num_skips];
            snprintf(name, sizeof name, "output_blocks.%d.0.", block);
            param_res_block(&list, c, name, ch + skip, c->level_channels[level]);
            ch = c->level_channels[level];
            int layer = 1;
            if (c->level_attention[level]) {
                snprintf(name, sizeof name, "output_blocks.%d.%d.", block, layer++);
                param_attention(&list, name, ch);
            }
            if (level > 0 && r == c->num_res_blocks) {
                snprintf(name, sizeof name, c->resblock_updown ? "output_blocks.%d.%d." : "output_blocks.%d.%d.conv.",
                         block, layer);
                if (c->resblock_updown) param_res_block(&list, c, name, ch, ch);
                else if (c->conv_resample) param_conv(&list, name, ch, ch, 3, 2);
            }
        }
    }
    param_group_norm(&list, "out.0.", ch);
    param_conv(&list, "out.2.", c->level_channels[0], c->out_channels, 3, 2);
    return list;
}

// ----------------------------------------------------------------------------------------------
// The data loader: maps a dataset file, serves shuffled batches of uint8 NHWC images and int32
// labels in host buffers (pinned for fast copies when a GPU is used), and converts them on the GPU.
//
// Order: epoch e visits the images in a Fisher-Yates permutation drawn from (seed, e); image i of
// that order is flipped horizontally when bit 0 of random(seed, flip stream, e*count + i) is set.
// Both are pure functions of the position (epoch, next), so saving those two numbers and seeking
// back to them reproduces every later batch exactly. Batches run on across epoch boundaries.

typedef struct {
    uint64_t epoch;  // epochs completed
    uint64_t next;   // index into the epoch's order of the next image to serve
} LoaderPosition;

typedef struct {
    Dataset data;
    int batch_size;
    int random_flip;
    uint64_t seed;
    LoaderPosition position;
    uint32_t *order;         // the current epoch's permutation of 0..count-1
    uint8_t *batch_pixels;   // [batch_size][height][width][3]
    int32_t *batch_labels;   // [batch_size], -1 when the dataset is unlabelled
    int pinned;              // batch buffers are page-locked (cudaMallocHost)
} DataLoader;

// Draws epoch `epoch`'s order: a uniform random permutation (Fisher-Yates).
static void loader_shuffle(DataLoader *loader, uint64_t epoch) {
    uint64_t n = loader->data.header.count, counter = 0;
    for (uint64_t i = 0; i < n; i++) loader->order[i] = (uint32_t)i;
    for (uint64_t i = n - 1; i > 0; i--) {
        uint64_t j = random_below(loader->seed, STREAM_SHUFFLE + 16 * epoch, &counter, i + 1);
        uint32_t t = loader->order[i];
        loader->order[i] = loader->order[j];
        loader->order[j] = t;
    }
}

// Moves to a saved position (epoch, next); next must be at most the image count.
static int loader_seek(DataLoader *loader, LoaderPosition position, char *err, size_t err_len) {
    if (position.next > loader->data.header.count)
        return dataset_fail(err, err_len, "data position %" PRIu64 " is past the dataset's %" PRIu64 " images",
                            position.next, loader->data.header.count);
    loader->position = position;
    loader_shuffle(loader, position.epoch);
    return 0;
}

// Opens and checks a dataset and allocates the batch buffers. Returns 0, or -1 with a message.
static int loader_open(DataLoader *loader, const char *path, int batch_size, int random_flip, uint64_t seed,
                       int pinned, char *err, size_t err_len) {
    memset(loader, 0, sizeof *loader);
    if (dataset_open(path, &loader->data, err, err_len) != 0) return -1;
    const DatasetHeader *h = &loader->data.header;
    if (h->count > UINT32_MAX) {
        dataset_close(&loader->data);
        return dataset_fail(err, err_len, "dataset %s has %" PRIu64 " images, more than the loader's limit of %u",
                            path, h->count, UINT32_MAX);
    }
    loader->batch_size = batch_size;
    loader->random_flip = random_flip;
    loader->seed = seed;
    loader->pinned = pinned;
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
    dataset_close(&loader->data);
    memset(loader, 0, sizeof *loader);
}

// Fills the batch buffers with the next batch_size images (and labels) and advances the position.
static void loader_next_batch(DataLoader *loader) {
    const DatasetHeader *h = &loader->data.header;
    size_t image_bytes = loader->data.layout.image_bytes, row_bytes = (size_t)h->width * h->channels;
    for (int b = 0; b < loader->batch_size; b++) {
        if (loader->position.next == h->count) {
            loader->position.epoch++;
            loader->position.next = 0;
            loader_shuffle(loader, loader->position.epoch);
        }
        uint64_t slot = loader->position.epoch * h->count + loader->position.next;
        uint32_t image = loader->order[loader->position.next++];
        const uint8_t *src = loader->data.pixels + image * image_bytes;
        uint8_t *dst = loader->batch_pixels + b * image_bytes;
        int flip = loader->random_flip && (random_u64(loader->seed, STREAM_FLIP, slot) & 1);
        if (!flip) {
            memcpy(dst, src, image_bytes);
        } else {
            for (uint32_t y = 0; y < h->height; y++)
                for (uint32_t x = 0; x < h->width; x++)
                    memcpy(dst + y * row_bytes + x * h->channels, src + y * row_bytes + (h->width - 1 - x) * h->channels,
                           h->channels);
        }
        loader->batch_labels[b] = loader->data.labels ? loader->data.labels[image] : -1;
    }
}

// Model input from a pixel: x = pixel / 127.5 - 1, uint8 [0, 255] -> [-1, 1], in one rounding (fma)
// so that the host and the device agree to the bit.
__host__ __device__ inline floatX pixel_to_model_input(uint8_t pixel) {
    return (floatX)fmaf((float)pixel, 1.0f / 127.5f, -1.0f);
}

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

// ----------------------------------------------------------------------------------------------
// The command line. Model and training flags carry guided-diffusion's names; a preset sets a
// group of them first, and every flag given explicitly overrides it whatever its position.

typedef struct {
    // guided-diffusion's model flags
    int image_size, num_channels, num_res_blocks;
    const char *channel_mult, *attention_resolutions;
    int num_heads, num_head_channels, num_heads_upsample;
    int use_new_attention_order, use_scale_shift_norm, resblock_updown, conv_resample;
    float dropout;
    int class_cond, num_classes;
    // diffusion
    int diffusion_steps;
    const char *noise_schedule;
    // training
    float lr, weight_decay;
    int batch_size;
    const char *ema_rate;
    int log_interval, save_interval;
    const char *resume_checkpoint;
    // data and run
    const char *data, *preset;
    int random_flip;
    long long steps;
    long long seed;
    int dry_run;
} Options;

typedef enum { OPT_INT, OPT_LONG, OPT_FLOAT, OPT_BOOL, OPT_STRING, OPT_SWITCH } OptionType;

typedef struct {
    const char *name;
    OptionType type;
    size_t offset;  // of the value in Options
    const char *help;
} OptionSpec;

#define OPT(name, type, help) {#name, type, offsetof(Options, name), help}
static const OptionSpec option_specs[] = {
    OPT(data, OPT_STRING, "dataset .bin written by prepare_data (required to train)"),
    OPT(preset, OPT_STRING, "seed | adm64: a model and training configuration to start from (default seed)"),
    OPT(image_size, OPT_INT, "image side in pixels; must equal the dataset's"),
    OPT(num_channels, OPT_INT, "model channels (multiple of 32)"),
    OPT(channel_mult, OPT_STRING, "channel multiplier per level, e.g. 1,2,3,4 (\"\": guided-diffusion's default for the image size)"),
    OPT(num_res_blocks, OPT_INT, "residual blocks per level"),
    OPT(attention_resolutions, OPT_STRING, "resolutions with attention, e.g. 16,8 (\"\": none besides the middle block)"),
    OPT(num_heads, OPT_INT, "attention heads (when num_head_channels is -1)"),
    OPT(num_head_channels, OPT_INT, "channels per attention head, -1 to use num_heads"),
    OPT(num_heads_upsample, OPT_INT, "heads in the decoder's attention, -1: num_heads"),
    OPT(use_new_attention_order, OPT_BOOL, "split qkv before heads (QKVAttention) instead of the legacy order"),
    OPT(use_scale_shift_norm, OPT_BOOL, "timestep embedding as scale and shift of the norm (FiLM)"),
    OPT(resblock_updown, OPT_BOOL, "resample with residual blocks"),
    OPT(conv_resample, OPT_BOOL, "convolution in up/downsampling (guided-diffusion always uses it)"),
    OPT(dropout, OPT_FLOAT, "dropout in residual blocks"),
    OPT(class_cond, OPT_BOOL, "condition on the dataset's labels"),
    OPT(num_classes, OPT_INT, "classes, when there is no --data to read them from"),
    OPT(diffusion_steps, OPT_INT, "diffusion timesteps"),
    OPT(noise_schedule, OPT_STRING, "linear | cosine"),
    OPT(lr, OPT_FLOAT, "AdamW learning rate"),
    OPT(weight_decay, OPT_FLOAT, "AdamW decoupled weight decay"),
    OPT(batch_size, OPT_INT, "images per step"),
    OPT(ema_rate, OPT_STRING, "EMA decay rates, comma-separated"),
    OPT(log_interval, OPT_INT, "steps between progress lines"),
    OPT(save_interval, OPT_INT, "steps between checkpoints"),
    OPT(resume_checkpoint, OPT_STRING, "checkpoint directory to resume from"),
    OPT(random_flip, OPT_BOOL, "random horizontal flips of the training images"),
    OPT(steps, OPT_LONG, "training steps"),
    OPT(seed, OPT_LONG, "random seed (initialisation, data order, noise)"),
    OPT(dry_run, OPT_SWITCH, "check the configuration and dataset, print them and the parameter count, exit"),
};
#define NUM_OPTIONS ((int)(sizeof option_specs / sizeof option_specs[0]))

// The defaults: the seed project's model (clu0/unet.cu) with guided-diffusion's training defaults.
static Options preset_seed(void) {
    Options o;
    memset(&o, 0, sizeof o);
    o.image_size = 64, o.num_channels = 64, o.num_res_blocks = 2;
    o.channel_mult = "1,2,3,4", o.attention_resolutions = "16,8";
    o.num_heads = 4, o.num_head_channels = 32, o.num_heads_upsample = -1;
    o.use_new_attention_order = 0, o.use_scale_shift_norm = 0, o.resblock_updown = 0, o.conv_resample = 0;
    o.dropout = 0.0f, o.class_cond = 0, o.num_classes = 0;
    o.diffusion_steps = 1000, o.noise_schedule = "linear";
    o.lr = 1e-4f, o.weight_decay = 0.0f, o.batch_size = 32, o.ema_rate = "0.9999";
    o.log_interval = 10, o.save_interval = 10000, o.resume_checkpoint = "";
    o.data = "", o.preset = "seed", o.random_flip = 1, o.steps = 100000, o.seed = 0, o.dry_run = 0;
    return o;
}

// ADM ImageNet-64 (guided-diffusion's README), without learned sigma; add --class_cond True.
static Options preset_adm64(void) {
    Options o = preset_seed();
    o.num_channels = 192, o.num_res_blocks = 3, o.attention_resolutions = "32,16,8";
    o.num_head_channels = 64, o.use_new_attention_order = 1, o.use_scale_shift_norm = 1;
    o.resblock_updown = 1, o.conv_resample = 1, o.dropout = 0.1f, o.noise_schedule = "cosine";
    o.preset = "adm64";
    return o;
}

static void print_usage(FILE *f) {
    fprintf(f,
            "usage: train_unet --data FILE.bin [options]      train a UNet on a dataset\n"
            "       train_unet --dry_run [options]             check and print a configuration\n"
            "\n"
            "Options take a value as --name VALUE or --name=VALUE; booleans accept True/False, 1/0,\n"
            "yes/no (a boolean given alone means True). Defaults are the seed preset's.\n\n");
    Options d = preset_seed();
    for (int i = 0; i < NUM_OPTIONS; i++) {
        const OptionSpec *s = &option_specs[i];
        char value[64] = "";
        const char *p = (const char *)&d + s->offset;
        switch (s->type) {
        case OPT_INT: snprintf(value, sizeof value, "%d", *(const int *)p); break;
        case OPT_LONG: snprintf(value, sizeof value, "%lld", *(const long long *)p); break;
        case OPT_FLOAT: snprintf(value, sizeof value, "%g", *(const float *)p); break;
        case OPT_BOOL: snprintf(value, sizeof value, "%s", *(const int *)p ? "True" : "False"); break;
        case OPT_STRING: snprintf(value, sizeof value, "\"%s\"", *(const char *const *)p); break;
        case OPT_SWITCH: break;
        }
        fprintf(f, "  --%-24s %s%s%s%s\n", s->name, s->help, value[0] ? " [" : "", value, value[0] ? "]" : "");
    }
    fprintf(f,
            "\nPresets: seed = 64x64, 64 channels, mult 1,2,3,4, 2 blocks, attention at 16,8 with 32-channel\n"
            "heads, no conv resampling; adm64 = guided-diffusion's ImageNet-64 model (192 channels, 3 blocks,\n"
            "attention at 32,16,8 with 64-channel heads, scale-shift norm, resblock up/down, new attention\n"
            "order, dropout 0.1, cosine schedule). Learned sigma (learn_sigma) is not supported: the model\n"
            "predicts noise only.\n");
}

// Parses a boolean as guided-diffusion's str2bool does (yes/true/t/y/1, no/false/f/n/0).
static int parse_bool(const char *s, int *out) {
    static const char *const yes[] = {"yes", "true", "t", "y", "1"}, *const no[] = {"no", "false", "f", "n", "0"};
    for (int i = 0; i < 5; i++) {
        if (strcasecmp(s, yes[i]) == 0) return *out = 1, 0;
        if (strcasecmp(s, no[i]) == 0) return *out = 0, 0;
    }
    return -1;
}

static void usage_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fprintf(stderr, "train_unet: error: ");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, " (see --help)\n");
    va_end(args);
    exit(2);
}

// Stores one option's value, checking that a number is a whole number (or a real) and nothing else.
static void set_option(Options *o, const OptionSpec *s, const char *value) {
    char *p = (char *)o + s->offset, *end = NULL;
    errno = 0;
    switch (s->type) {
    case OPT_INT: {
        long v = strtol(value, &end, 10);
        if (end == value || *end || errno || v < INT32_MIN || v > INT32_MAX)
            usage_error("--%s needs a whole number, not '%s'", s->name, value);
        *(int *)p = (int)v;
        break;
    }
    case OPT_LONG: {
        long long v = strtoll(value, &end, 10);
        if (end == value || *end || errno) usage_error("--%s needs a whole number, not '%s'", s->name, value);
        *(long long *)p = v;
        break;
    }
    case OPT_FLOAT: {
        double v = strtod(value, &end);
        if (end == value || *end || errno || !isfinite(v)) usage_error("--%s needs a number, not '%s'", s->name, value);
        *(float *)p = (float)v;
        break;
    }
    case OPT_BOOL:
        if (parse_bool(value, (int *)p) != 0) usage_error("--%s needs True or False, not '%s'", s->name, value);
        break;
    case OPT_STRING: *(const char **)p = value; break;
    case OPT_SWITCH: *(int *)p = 1; break;
    }
}

static const OptionSpec *find_option(const char *name, size_t len) {
    for (int i = 0; i < NUM_OPTIONS; i++)
        if (strlen(option_specs[i].name) == len && strncmp(option_specs[i].name, name, len) == 0)
            return &option_specs[i];
    return NULL;
}

// Parses the command line: the preset first, then every flag in order.
static Options parse_options(int argc, char **argv) {
    const char *preset = "seed";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) print_usage(stdout), exit(0);
        if (strncmp(argv[i], "--preset=", 9) == 0) preset = argv[i] + 9;
        else if (strcmp(argv[i], "--preset") == 0 && i + 1 < argc) preset = argv[i + 1];
    }
    Options o;
    if (strcmp(preset, "seed") == 0) o = preset_seed();
    else if (strcmp(preset, "adm64") == 0) o = preset_adm64();
    else usage_error("unknown preset '%s' (seed or adm64)", preset);

    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "--", 2) != 0) usage_error("unexpected argument '%s'", arg);
        const char *name = arg + 2, *eq = strchr(name, '=');
        const OptionSpec *s = find_option(name, eq ? (size_t)(eq - name) : strlen(name));
        if (!s) usage_error("unknown option '%s'", arg);
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

// Parses a comma-separated list of positive numbers; returns the count, or -1 on a bad entry.
static int parse_number_list(const char *s, double *out, int max) {
    int n = 0;
    while (*s) {
        char *end;
        errno = 0;
        double v = strtod(s, &end);
        if (end == s || errno || !isfinite(v) || v <= 0 || n == max) return -1;
        out[n++] = v;
        s = end;
        if (*s == ',') s++;
        else if (*s) return -1;
    }
    return n;
}

// guided-diffusion's channel_mult when none is given (script_util.create_model).
static const char *default_channel_mult(int image_size) {
    switch (image_size) {
    case 512: return "0.5,1,1,2,2,4,4";
    case 256: return "1,1,2,2,4,4";
    case 128: return "1,1,2,3,4";
    case 64: return "1,2,3,4";
    default: return NULL;
    }
}

// Checks every value and resolves the model configuration; a bad value is one error line.
static ModelConfig resolve_model(Options *o) {
    ModelConfig c;
    memset(&c, 0, sizeof c);
    if (o->image_size < 8 || o->image_size > 4096) usage_error("--image_size %d is out of range (8..4096)", o->image_size);
    if (o->num_channels < 32 || o->num_channels % 32)
        usage_error("--num_channels %d must be a positive multiple of 32 (GroupNorm uses 32 groups)", o->num_channels);
    if (o->num_res_blocks < 1 || o->num_res_blocks > 8) usage_error("--num_res_blocks %d is out of range (1..8)", o->num_res_blocks);
    if (!o->channel_mult[0]) {
        o->channel_mult = default_channel_mult(o->image_size);
        if (!o->channel_mult) usage_error("no default --channel_mult for image size %d; give one", o->image_size);
    }
    double mult[MAX_LEVELS];
    int levels = parse_number_list(o->channel_mult, mult, MAX_LEVELS);
    if (levels < 1) usage_error("--channel_mult '%s' must be 1 to %d positive numbers separated by commas", o->channel_mult, MAX_LEVELS);
    if (o->image_size % (1 << (levels - 1)))
        usage_error("--image_size %d must be divisible by 2^%d = %d for %d levels", o->image_size, levels - 1,
                    1 << (levels - 1), levels);
    c.image_size = o->image_size;
    c.in_channels = 3;
    c.out_channels = 3;
    c.model_channels = o->num_channels;
    c.num_levels = levels;
    for (int l = 0; l < levels; l++) {
        c.level_channels[l] = (int)(mult[l] * o->num_channels);
        if (c.level_channels[l] < 32 || c.level_channels[l] % 32)
            usage_error("channel_mult %g x num_channels %d = %d channels at level %d; must be a multiple of 32", mult[l],
                        o->num_channels, c.level_channels[l], l);
    }
    double res[MAX_LEVELS];
    int num_res = o->attention_resolutions[0] ? parse_number_list(o->attention_resolutions, res, MAX_LEVELS) : 0;
    if (num_res < 0) usage_error("--attention_resolutions '%s' must be resolutions separated by commas", o->attention_resolutions);
    for (int i = 0; i < num_res; i++) {
        int level = -1;
        for (int l = 0; l < levels; l++)
            if (res[i] == (double)(o->image_size >> l)) level = l;
        if (level < 0)
            usage_error("attention resolution %g is none of the model's resolutions (%d down to %d)", res[i],
                        o->image_size, o->image_size >> (levels - 1));
        c.level_attention[level] = 1;
    }
    if (o->num_head_channels != -1 && o->num_head_channels < 1)
        usage_error("--num_head_channels %d must be positive or -1", o->num_head_channels);
    if (o->num_heads < 1) usage_error("--num_heads %d must be positive", o->num_heads);
    if (o->num_heads_upsample == -1) o->num_heads_upsample = o->num_heads;
    if (o->num_heads_upsample < 1) usage_error("--num_heads_upsample %d must be positive or -1", o->num_heads_upsample);
    for (int l = 0; l < levels; l++) {  // every attention block's channels split evenly into heads
        int middle = l == levels - 1, ch = c.level_channels[l];
        if (!c.level_attention[l] && !middle) continue;
        if (o->num_head_channels != -1 && ch % o->num_head_channels)
            usage_error("--num_head_channels %d does not divide the %d channels of the attention at resolution %d",
                        o->num_head_channels, ch, o->image_size >> l);
        if (o->num_head_channels == -1 && (ch % o->num_heads || ch % o->num_heads_upsample))
            usage_error("--num_heads %d (or --num_heads_upsample %d) does not divide the %d channels at resolution %d",
                        o->num_heads, o->num_heads_upsample, ch, o->image_size >> l);
    }
    if (!(o->dropout >= 0 && o->dropout < 1)) usage_error("--dropout %g must be in [0, 1)", o->dropout);
    c.num_res_blocks = o->num_res_blocks;
    c.num_heads = o->num_heads;
    c.num_heads_upsample = o->num_heads_upsample;
    c.num_head_channels = o->num_head_channels;
    c.use_scale_shift_norm = o->use_scale_shift_norm;
    c.resblock_updown = o->resblock_updown;
    c.conv_resample = o->conv_resample;
    c.use_new_attention_order = o->use_new_attention_order;
    c.dropout = o->dropout;
    if (o->class_cond && o->num_classes < 1)
        usage_error("--class_cond needs a dataset with labels (--data) or --num_classes");
    c.num_classes = o->class_cond ? o->num_classes + 1 : 0;  // + the null class for classifier-free guidance
    return c;
}

// Checks the training values that are not part of the model.
static void validate_training(const Options *o) {
    if (o->diffusion_steps < 1 || o->diffusion_steps > 100000) usage_error("--diffusion_steps %d is out of range (1..100000)", o->diffusion_steps);
    if (strcmp(o->noise_schedule, "linear") != 0 && strcmp(o->noise_schedule, "cosine") != 0)
        usage_error("--noise_schedule '%s' must be linear or cosine", o->noise_schedule);
    if (!(o->lr > 0)) usage_error("--lr %g must be positive", o->lr);
    if (!(o->weight_decay >= 0)) usage_error("--weight_decay %g must not be negative", o->weight_decay);
    if (o->batch_size < 1 || o->batch_size > 65536) usage_error("--batch_size %d is out of range (1..65536)", o->batch_size);
    double rates[8];
    int n = parse_number_list(o->ema_rate, rates, 8);
    if (n < 1) usage_error("--ema_rate '%s' must be 1 to 8 rates separated by commas", o->ema_rate);
    for (int i = 0; i < n; i++)
        if (rates[i] >= 1) usage_error("EMA rate %g must be below 1", rates[i]);
    if (o->log_interval < 1) usage_error("--log_interval %d must be positive", o->log_interval);
    if (o->save_interval < 1) usage_error("--save_interval %d must be positive", o->save_interval);
    if (o->steps < 1) usage_error("--steps %lld must be positive", o->steps);
    if (o->seed < 0) usage_error("--seed %lld must not be negative", o->seed);
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

// ----------------------------------------------------------------------------------------------
// main

#ifndef TRAIN_UNET_LIBRARY

// Streams the dataset through the GPU input pipeline: pinned batch -> device -> [-1, 1].
// The UNet itself arrives with the model issue; until then this is what a run does.
static void run_input_pipeline(const Options *o, DataLoader *loader) {
    size_t n = (size_t)o->batch_size * loader->data.layout.image_bytes;
    uint8_t *d_pixels;
    floatX *d_input;
    cudaStream_t stream;
    cudaEvent_t start, stop;
    cuda_check(cudaStreamCreate(&stream));
    cuda_check(cudaMalloc((void **)&d_pixels, n));
    cuda_check(cudaMalloc((void **)&d_input, n * sizeof(floatX)));
    cuda_check(cudaEventCreate(&start));
    cuda_check(cudaEventCreate(&stop));
    printf("note: the UNet is not built yet; this run streams %lld batches through the GPU input pipeline\n", o->steps);
    cuda_check(cudaEventRecord(start, stream));
    for (long long step = 1; step <= o->steps; step++) {
        loader_next_batch(loader);
        cuda_check(cudaMemcpyAsync(d_pixels, loader->batch_pixels, n, cudaMemcpyHostToDevice, stream));
        images_to_model_input(d_input, d_pixels, n, stream);
        cuda_check(cudaStreamSynchronize(stream));  // the host batch is reused next step
        if (step % o->log_interval == 0 || step == o->steps) {
            float ms;
            cuda_check(cudaEventRecord(stop, stream));
            cuda_check(cudaEventSynchronize(stop));
            cuda_check(cudaEventElapsedTime(&ms, start, stop));
            printf("step %lld/%lld  epoch %" PRIu64 "  %.0f img/s\n", step, o->steps, loader->position.epoch,
                   o->batch_size * (double)step / (ms / 1000.0));
        }
    }
    cudaFree(d_input);
    cudaFree(d_pixels);
    cudaStreamDestroy(stream);
}

int main(int argc, char **argv) {
    Options o = parse_options(argc, argv);
    Dataset data = {};
    char err[512];
    if (o.data[0]) {  // the dataset decides the image size and the classes
        if (dataset_open(o.data, &data, err, sizeof err) != 0) fatal("%s", err);
        if (data.header.height != data.header.width)
            fatal("dataset %s holds %ux%u images; the model needs square ones", o.data, data.header.width, data.header.height);
        if ((int)data.header.width != o.image_size)
            fatal("dataset %s holds %ux%u images but --image_size is %d", o.data, data.header.width, data.header.height,
                  o.image_size);
        if (o.class_cond && data.header.num_classes == 0)
            fatal("--class_cond needs labels, and dataset %s has none (prepare it with --labels)", o.data);
        if (o.class_cond && o.num_classes && o.num_classes != (int)data.header.num_classes)
            fatal("--num_classes %d disagrees with the %u classes of dataset %s", o.num_classes, data.header.num_classes, o.data);
        if (o.class_cond) o.num_classes = (int)data.header.num_classes;
    }
    ModelConfig model = resolve_model(&o);
    validate_training(&o);
    ParamList params = model_parameters(&model);

    if (o.dry_run) {
        print_config(stdout, &o);
        printf("precision: %s\n", PRECISION_NAME);
        print_model_summary(stdout, &model, &params);
        if (data.map)
            printf("dataset: %s, %" PRIu64 " images of %ux%u, %u classes\n", o.data, data.header.count,
                   data.header.width, data.header.height, data.header.num_classes);
        dataset_close(&data);
        free(params.specs);
        return 0;
    }

    int devices = 0;
    cudaError_t cerr = cudaGetDeviceCount(&devices);
    if (cerr != cudaSuccess || devices == 0)
        fatal("no usable CUDA GPU (the CUDA runtime says: %s); --dry_run checks a configuration without one",
              cerr != cudaSuccess ? cudaGetErrorString(cerr) : "no devices");
    if (!o.data[0]) usage_error("training needs --data FILE.bin");
    dataset_close(&data);

    DataLoader loader;
    if (loader_open(&loader, o.data, o.batch_size, o.random_flip, (uint64_t)o.seed, 1, err, sizeof err) != 0)
        fatal("%s", err);
    cudaDeviceProp prop;
    cuda_check(cudaGetDeviceProperties(&prop, 0));
    printf("GPU: %s, precision %s\n", prop.name, PRECISION_NAME);
    print_model_summary(stdout, &model, &params);
    run_input_pipeline(&o, &loader);
    loader_close(&loader);
    free(params.specs);
    return 0;
}

#endif  // TRAIN_UNET_LIBRARY
