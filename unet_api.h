// unet_api.h: the small C API of train_unet.cu, for generate.c and evaluate.c, which link the
// trainer's object (build/train_unet.o): read a checkpoint's configuration (a diffusion model's or
// a noisy classifier's), sample images on the GPU (guided by either or both ways), evaluate the
// model on given inputs; Inception-v3's features of images and the sample-quality mathematics of
// metrics.h on the GPU.
#ifndef UNET_API_H
#define UNET_API_H

#include <stddef.h>
#include <stdint.h>

#include "cli.h"
#include "sampler.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct UnetCheckpoint UnetCheckpoint;
typedef struct UnetSampler UnetSampler;

// What a checkpoint's metadata says about its model and diffusion.
typedef struct {
    int image_size, in_channels, out_channels;
    int num_classes;      // label_emb rows, 0: unconditional; a noisy classifier's: its logits
    int null_class;       // the last row is the null class of classifier-free guidance (train_unet's
                          // checkpoints); guided-diffusion's own have none: every row is a class
    DiffusionConfig diffusion;  // its steps, schedule, prediction and variance (a learned one: the output's second half)
    int64_t parameters;
    int small_size;            // an upsampler's (SuperResModel) low-resolution side, 0: none
    char classifier_pool[16];  // a noisy classifier's pool (EncoderUNetModel), "" for a diffusion model
    char file[4096];      // the weights file read
    char model[1024];     // a file without metadata (a .pt): what was inferred from its tensors and what the flags gave
} UnetInfo;

// --version: the program's name and version, then what the library was built with (the precision,
// the GPU code, the CUDA version).
void unet_print_version(void);

// One error line, "NAME: error: MESSAGE", then exit status 1 (a runtime error: a file, the
// checkpoint, the GPU), or for a bad command line the line ending in " (see --help)" and status 2.
void unet_die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
void unet_usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));

// Option `name`'s value s as a whole number in lo..hi, or the usage error that says so (cli.h's
// cli_read_int, for the programs on this library).
static inline long long unet_int_option(const char *name, const char *s, long long lo, long long hi) {
    long long v;
    if (cli_read_int(s, lo, hi, &v) != 0) unet_usage_error("%s takes a whole number in %lld..%lld, not '%s'", name, lo, hi, s);
    return v;
}

// Opens a checkpoint without a GPU: path is a checkpoint folder (its ema.safetensors, or
// model.safetensors with weights "model"), a .safetensors file or a PyTorch .pt state_dict, of a
// diffusion model or (for unet_eval; info->classifier_pool says so) a noisy classifier. A file
// without metadata (a .pt) is read with `flags` (num_flags "name=value" strings: guided-diffusion's
// flags for the model, as its README gives them; the tensors decide the rest and must agree); a
// file with metadata takes no flags. The file is mapped once and every
// later call reads that mapping, so a trainer deleting or replacing the file meanwhile changes
// nothing here. Its configuration and every tensor (names, shapes, finite values) are checked and
// described in *info. Returns the checkpoint, or NULL with a message.
UnetCheckpoint *unet_checkpoint_open(const char *path, const char *weights, const char *const *flags, int num_flags, UnetInfo *info,
                                     char *err, size_t err_len);
void unet_checkpoint_close(UnetCheckpoint *checkpoint);

// Opens a noisy classifier (train_unet --model classifier, or guided-diffusion's classifier .pt) for
// guiding a diffusion model of images of image_size: path is a checkpoint folder (its
// model.safetensors: classifiers train without an EMA by default), a .safetensors file or a .pt
// state_dict, read with `flags` (guided-diffusion's classifier_ flags, "name=value"; the image size
// is image_size) when it has no metadata. Its classes are info->num_classes. NULL with a message,
// also for a diffusion model or a classifier of another image size.
UnetCheckpoint *unet_classifier_open(const char *path, const char *const *flags, int num_flags, int image_size, UnetInfo *info,
                                     char *err, size_t err_len);

// How a sampler guides: classifier-free guidance with scale `scale` (1: none; otherwise the model's
// last label row is the null class), and classifier guidance (Dhariwal & Nichol) by a noisy
// classifier (NULL: none) with scale `classifier_scale`: every step adds the score
// s d log p(y | x_t) / dx_t of the image's label y (sampler.h's score_guided_x0). Both may be on.
typedef struct {
    float scale;
    const UnetCheckpoint *classifier;
    float classifier_scale;
} UnetGuidance;

// A sampler on the GPU for batches of `batch` images with a checkpoint's weights, running `plan`
// (copied) guided as `guidance` says, with starting noise and draws from `seed`. NULL with a
// message on error (no GPU).
UnetSampler *unet_sampler_create(const UnetCheckpoint *checkpoint, int batch, const SamplePlan *plan, const UnetGuidance *guidance,
                                 uint64_t seed, char *err, size_t err_len);

// The largest batch, at most `limit`, whose sampler (as unet_sampler_create would make it; with
// classifier-free guidance the model runs on twice the batch; with a classifier, it runs too,
// keeping what its backward pass reads) fits in the GPU's free memory, with a tenth of it to spare.
// Returns it, or 0 with a message (no GPU, not even one image fits).
int unet_sampler_max_batch(const UnetCheckpoint *checkpoint, const SamplePlan *plan, const UnetGuidance *guidance, int limit, char *err,
                           size_t err_len);

// Called by unet_sample as the GPU finishes each step of the plan: step 1 .. steps.
typedef void (*UnetProgress)(void *ctx, int step, int steps);

// Samples images first .. first + count - 1 (count <= batch) of the seed with their labels
// ([count]: the classes asked of a class-conditional model or of the classifier; ignored without
// either) and, for an upsampler, their low-resolution images (low_res: [count][s][s][C], 0..255;
// NULL for other models) into pixels ([count][H][W][C], 0..255). Image i
// depends only on (seed, i, its label) and the batch size. progress (nullable) hears of every
// step. Returns the GPU time taken, in ms.
float unet_sample(UnetSampler *sampler, int64_t first, int count, const int *labels, const uint8_t *low_res, uint8_t *pixels,
                  UnetProgress progress, void *ctx);

void unet_sampler_free(UnetSampler *sampler);

// --nll: the likelihood of images under a checkpoint's model in bits per dimension
// (guided-diffusion's calc_bpd_loop, image_nll.py, with clip_denoised): the variational bound's
// terms on every diffusion step, or those the respacing spec keeps (SpacedDiffusion's schedule),
// plus the prior's. pixels: [count][H][W][C]; labels: [count] (a class-conditional model's) or NULL.
// Batches of `batch` images; image i's noise depends only on (seed, i, the step). Writes bpd[count]
// and prior[count] (the prior's part). Returns 0, or -1 with a message (no GPU, a bad spec).
int unet_nll(const UnetCheckpoint *checkpoint, const uint8_t *pixels, const int *labels, int count, int batch, const char *respacing,
             uint64_t seed, double *bpd, double *prior, char *err, size_t err_len);

// --eval: runs a checkpoint's model on the inputs of in_path (x [N][C][H][W] float in PyTorch's
// NCHW layout, t [N] and, for a class-conditional model, y [N], integers) and writes its raw output
// to out_path (out [N][C_out][H][W] F32, NCHW; a classifier's logits [N][classes]); an upsampler
// (SuperResModel) reads low_res [N][C][small][small] too. Every input is checked, shapes before sizes, before
// the GPU is used. Returns 0, or -1 with a message.
int unet_eval(const UnetCheckpoint *checkpoint, const char *in_path, const char *out_path, char *err, size_t err_len);

// ---- sample quality (evaluate.c) ----

typedef struct UnetInception UnetInception;

#define UNET_INCEPTION_FEATURES 2048  // pool: FID, precision and recall
#define UNET_INCEPTION_SPATIAL 2023   // spatial (17 x 17 x 7): sFID
#define UNET_INCEPTION_CLASSES 1008   // logits: the Inception Score

// Opens pytorch-fid's Inception-v3 weights (pt_inception-2015-12-05-6726825d.pth, or the same
// tensors as safetensors) without a GPU: every tensor's name and shape is checked and the BatchNorms
// folded into the convolutions. NULL with a message.
UnetInception *unet_inception_open(const char *path, char *err, size_t err_len);
// Where pytorch-fid keeps those weights: $TORCH_HOME/hub/checkpoints/, else
// $XDG_CACHE_HOME/torch/hub/checkpoints/, else ~/.cache/torch/hub/checkpoints/ (the file's name added).
void unet_inception_default_path(char *path, size_t len);
void unet_inception_close(UnetInception *net);

// The GPU memory the network takes for batches of `batch` images, its weights included.
int64_t unet_inception_gpu_bytes(const UnetInception *net, int batch);

// The largest batch, at most limit (halved from it), whose network takes at most half of the GPU's
// free memory; 0 with a message (no GPU, not even one image fits).
int unet_inception_max_batch(const UnetInception *net, int limit, char *err, size_t err_len);

// The features of count images ([count][height][width][channels] bytes; 1 channel is grey, of 4
// the alpha is left out), in batches of `batch`: pool [count][2048], spatial [count][2023] and
// logits [count][1008] (each NULL: not wanted), fp32. Returns 0, or -1 with a message.
int unet_inception_features(UnetInception *net, const uint8_t *pixels, int64_t count, int height, int width, int channels, int batch,
                            float *pool, float *spatial, float *logits, char *err, size_t err_len);

// metrics.h's feature_statistics, frechet_distance and precision_recall on the GPU (the same
// mathematics; precision and recall's distances as guided-diffusion's evaluator computes them, in
// blocks of block x block rows (its MANIFOLD_BLOCK), each in fp16, or in fp32 where fp16's are not
// finite). Each returns 0, or -1 with a message.
int unet_feature_statistics(const float *features, int64_t n, int dim, double *mean, double *cov, char *err, size_t err_len);
int unet_frechet_distance(const double *mu1, const double *s1, const double *mu2, const double *s2, int dim, double *distance, char *err,
                          size_t err_len);
int unet_precision_recall(const float *ref, int64_t n_ref, const float *sample, int64_t n_sample, int dim, int k, int block,
                          double *precision, double *recall, char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif  // UNET_API_H
