// generate.c: images from a trained checkpoint, without Python. The samplers are sampler.h's
// plans (shared with the trainer's sample grids), run on the GPU by train_unet.cu's C API
// (unet_api.h): one captured CUDA graph per step, no host work inside the loop.
//
//   ./generate --checkpoint DIR|FILE.safetensors [--sampler ddim|ddpm|dpm++] [--steps N] [--num N] ...
//
// Image i's starting noise and every draw it needs depend only on (--seed, i): the same seed and
// --batch give the same images (another --batch gives the same noise; the model's products may
// then round differently in the last bits). Without --batch, the batch is the largest that fits
// in the GPU's free memory (at most --num), and a terminal shows a progress bar. --classifier
// guides the sampling with a noisy classifier's gradient (guided-diffusion's classifier_sample.py).
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "dataset.h"
#include "png.h"
#include "sampler.h"
#include "unet_api.h"

static const char usage[] =
    "usage: generate --checkpoint DIR|FILE.safetensors|FILE.pt [options]\n"
    "\n"
    "Samples images from a checkpoint of train_unet (or any guided-diffusion UNet\n"
    "saved as safetensors with its flags in the metadata) and writes one PNG per\n"
    "image and a grid. A model with a learned variance (learn_sigma) samples ddpm\n"
    "with its own variance, one without with beta_t (guided-diffusion's default);\n"
    "the other samplers use the mean. Pixels are ((x + 1) * 127.5) truncated to\n"
    "0..255, as guided-diffusion's scripts write samples.\n"
    "  --checkpoint PATH   a checkpoint folder, a .safetensors file, or a PyTorch .pt\n"
    "                      state_dict (read without running its pickle)\n"
    "  --weights ema|model the folder's EMA weights or its raw weights [ema]\n"
    "  --sampler S         ddim, ddpm (ancestral, every step), dpm++ (DPM-Solver++\n"
    "                      2M), euler_a (Euler ancestral) or heun (EDM's sampler,\n"
    "                      2N - 1 model calls); euler_a and heun on Karras levels\n"
    "                      [ddim; an EDM model's: heun]\n"
    "  --steps N           sampling steps: ddim 50, dpm++ 20, euler_a 30, heun 18 by\n"
    "                      default; ddpm all diffusion steps, or N respaced as\n"
    "                      --respacing N\n"
    "  --schedule karras   ddim, dpm++: the steps on Karras et al.'s noise levels, as\n"
    "                      k-diffusion samples (x0 not clipped); else guided-\n"
    "                      diffusion's spacing (ddim, ddpm) or log-SNR's (dpm++);\n"
    "                      an EDM model's (precond edm) only levels\n"
    "  --sigma_min S, --sigma_max S, --rho R  Karras levels: sigma from sigma_max\n"
    "                      to sigma_min [the model's own range; EDM's 0.002 to\n"
    "                      80], rho [7]\n"
    "  --s_churn C, --s_tmin S, --s_tmax S, --s_noise K  heun's churn (EDM's): noise\n"
    "                      raising sigma by min(C / N, sqrt 2 - 1) of itself on\n"
    "                      levels in [s_tmin, s_tmax], times K [0, 0, inf, 1]\n"
    "  --respacing SPEC    ddim and ddpm: guided-diffusion's timestep_respacing:\n"
    "                      ddimN (every s-th step, N of them) or section counts N or\n"
    "                      N1,N2,... (N_i evenly spaced steps in each of equal\n"
    "                      sections)\n"
    "  --spacing S         ddim and ddpm: --steps spaced leading (ddimN's), trailing\n"
    "                      (ending at the last step) or linspace (Lin et al. 2023)\n"
    "  --eta E             the noise of ddim (0: deterministic) [0] and euler_a [1]\n"
    "  --clip_denoised BOOL  each step's x0 clipped to [-1, 1] (guided-diffusion's\n"
    "                      flag) [True on its spacings, False on Karras levels]\n"
    "  --sigma_small BOOL  a model without a learned variance: ddpm and --nll with\n"
    "                      the posterior's beta_tilde_t instead of beta_t\n"
    "                      (guided-diffusion's flag) [the checkpoint's, else False]\n"
    "  --class K|all       class-conditional models: one class, or all in turn [all]\n"
    "  --guidance W        classifier-free guidance scale (1: plain conditional\n"
    "                      sampling) [1]\n"
    "  --classifier PATH   classifier guidance by a noisy classifier (train_unet\n"
    "                      --model classifier: a checkpoint folder or its\n"
    "                      .safetensors; or guided-diffusion's classifier .pt): each\n"
    "                      step adds s grad log p(y|x_t) for the image's class y, to\n"
    "                      ddpm's mean times its variance, to the others' eps\n"
    "                      times -sqrt(1 - abar); with --guidance too, both\n"
    "  --classifier_scale S  the scale s of classifier guidance [1]\n"
    "  --low_res FILE.bin  an upsampler (train_unet --super_res): the images to\n"
    "                      upsample, a dataset .bin of its small size; the first\n"
    "                      --num of them, each with its label when the model is\n"
    "                      class-conditional and --class is not given\n"
    "  --upsampler PATH    the cascade: the images sampled, then upsampled by this\n"
    "                      upsampler (its --weights as the model's; no guidance),\n"
    "                      which must take the model's size as its small size; the\n"
    "                      images written are the upsampler's, and base_grid.png\n"
    "                      the model's\n"
    "  --up_steps N        the upsampler's steps with --sampler (default as --steps)\n"
    "  --num N             images [64]\n"
    "  --batch B           images per model call (default: the largest that fits in\n"
    "                      the GPU's free memory, at most --num; give it to get the\n"
    "                      same bits on another GPU)\n"
    "  --seed S            the seed of every image's noise and draws [0]\n"
    "  --out DIR           output folder: 000000.png ... and grid.png [samples]\n"
    "  --bench R           time the sampling of --num images R times after a warm-up,\n"
    "                      print the median images/s (GPU time) and write no images\n"
    "  --help, -h          this help\n"
    "  --version           the version and what it was built with\n"
    "\n"
    "       generate --checkpoint PATH --nll DATA.bin [--num N] [--respacing SPEC]\n"
    "prints the likelihood of the first --num images of a dataset under the model in\n"
    "bits per dimension (guided-diffusion's calc_bpd_loop, clip_denoised): their mean\n"
    "and its standard error; every diffusion step, or those --respacing keeps.\n"
    "\n"
    "       generate --checkpoint PATH --eval IN.safetensors --output OUT.safetensors\n"
    "runs the model once on IN's x [N,C,H,W] (float, NCHW), t [N] and,\n"
    "class-conditional, y [N], and writes its raw output out [N,C_out,H,W] (F32,\n"
    "NCHW): for comparing with PyTorch.\n"
    "\n"
    "A .pt holds no metadata: its tensors give the channels, multipliers, blocks,\n"
    "attention levels, scale-shift, up/down blocks, classes and learned sigma; give\n"
    "guided-diffusion's flags for the rest as its README writes them for the model:\n"
    "--image_size and --num_head_channels (or --num_heads) always,\n"
    "--use_new_attention_order, --diffusion_steps, --noise_schedule, --predict when\n"
    "not the defaults (False, 1000, linear, eps); an upsampler's .pt --large_size and\n"
    "--small_size instead of --image_size. The other model flags are checked\n"
    "against the tensors; --use_fp16 is accepted and changes nothing. A classifier\n"
    ".pt takes guided-diffusion's --classifier_width, --classifier_depth,\n"
    "--classifier_attention_resolutions, --classifier_use_scale_shift_norm,\n"
    "--classifier_resblock_updown and --classifier_pool the same way (its image size\n"
    "is the model's; --classifier_use_fp16 changes nothing).\n"
    "\n"
    "A hyphen in an option's name may stand for an underscore.\n";

// guided-diffusion's flags for a checkpoint without metadata (a .pt), as its README gives them
// for each released model; passed on as "name=value".
static const char *const model_flag_names[] = {"image_size", "num_channels", "num_res_blocks", "channel_mult", "attention_resolutions",
    "num_heads", "num_head_channels", "num_heads_upsample", "use_new_attention_order", "use_scale_shift_norm", "resblock_updown",
    "dropout", "class_cond", "learn_sigma", "diffusion_steps", "noise_schedule", "predict", "sigma_small", "use_fp16", "large_size",
    "small_size"};
#define NUM_MODEL_FLAG_NAMES ((int)(sizeof model_flag_names / sizeof *model_flag_names))
// guided-diffusion's classifier flags, for a classifier .pt.
static const char *const classifier_flag_names[] = {"classifier_width", "classifier_depth", "classifier_attention_resolutions",
    "classifier_use_scale_shift_norm", "classifier_resblock_updown", "classifier_pool", "classifier_use_fp16"};
#define NUM_CLASSIFIER_FLAG_NAMES ((int)(sizeof classifier_flag_names / sizeof *classifier_flag_names))

typedef struct {
    const char *checkpoint, *weights, *sampler, *class_name, *out, *eval, *output, *respacing, *nll, *spacing, *classifier, *low_res, *upsampler;
    const char *schedule;  // "karras", or NULL: the sampler's own spacing
    int steps, up_steps, num, batch, bench;
    double eta, guidance, classifier_scale;  // eta < 0: the sampler's default
    double sigma_min, sigma_max, rho;        // Karras levels (0: the model's own sigma_min, sigma_max)
    double s_churn, s_tmin, s_tmax, s_noise; // heun's churn
    int classifier_scale_given;
    int clip_denoised;  // x0 clipped to [-1, 1] at every step: 1, 0, or -1 the sampler's default
    long long seed;
    char *model_flags[NUM_MODEL_FLAG_NAMES], *classifier_flags[NUM_CLASSIFIER_FLAG_NAMES];  // "name=value"
    int num_model_flags, num_classifier_flags;
} Options;

static double real_option(const char *name, const char *s, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi))
        unet_usage_error("%s takes a number in %g..%g, not '%s'", name, lo, hi, s);
    return v;
}

// The sampler's options, checked once the model is known: --sampler's default is ddim, or heun for
// an EDM model (precond edm), which samples on Karras levels only and has neither a DDPM sampler, a
// classifier's guidance nor a likelihood (its noise levels are continuous).
static void check_sampler_options(Options *o, int edm) {
    if (!o->sampler) o->sampler = edm ? "heun" : "ddim";
    if (edm && strcmp(o->sampler, "ddpm") == 0)
        unet_usage_error("an EDM model (precond edm) samples on Karras levels: --sampler heun (its default), dpm++, euler_a or ddim, "
                         "not ddpm");
    if (edm && (o->respacing[0] || o->spacing || o->classifier || o->nll))
        unet_usage_error("an EDM model (precond edm) has continuous noise levels: it takes neither --respacing, --spacing, "
                         "--classifier nor --nll");
    if (edm) o->schedule = "karras";
    if (strcmp(o->sampler, "ddim") != 0 && strcmp(o->sampler, "ddpm") != 0 && strcmp(o->sampler, "dpm++") != 0 &&
        strcmp(o->sampler, "euler_a") != 0 && strcmp(o->sampler, "heun") != 0)
        unet_usage_error("--sampler must be ddim, ddpm, dpm++, euler_a or heun, not '%s'", o->sampler);
    if (strcmp(o->sampler, "heun") != 0 && (o->s_churn || o->s_tmin || o->s_tmax != INFINITY || o->s_noise != 1))
        unet_usage_error("--s_churn, --s_tmin, --s_tmax and --s_noise are heun's churn: they need --sampler heun");
    if (o->schedule && strcmp(o->schedule, "karras") != 0) unet_usage_error("--schedule must be karras, not '%s'", o->schedule);
    if (strcmp(o->sampler, "euler_a") == 0 || strcmp(o->sampler, "heun") == 0) o->schedule = "karras";  // (their only levels)
    if (o->schedule && strcmp(o->sampler, "ddpm") == 0)
        unet_usage_error("--schedule karras goes with --sampler ddim, dpm++, euler_a or heun: ddpm steps through the model's own variances");
    if (o->schedule && (o->respacing[0] || o->spacing))
        unet_usage_error("--schedule karras places the steps itself: it goes with neither --respacing nor --spacing");
    if (!o->schedule && (o->sigma_min || o->sigma_max || o->rho != 7))
        unet_usage_error("--sigma_min, --sigma_max and --rho set Karras levels: they need --schedule karras, or --sampler euler_a or heun");
    if (o->sigma_min && o->sigma_max && o->sigma_min >= o->sigma_max)
        unet_usage_error("--sigma_min %g is not below --sigma_max %g", o->sigma_min, o->sigma_max);
    if (o->spacing && strcmp(o->spacing, "leading") != 0 && strcmp(o->spacing, "trailing") != 0 && strcmp(o->spacing, "linspace") != 0)
        unet_usage_error("--spacing must be leading, trailing or linspace, not '%s'", o->spacing);
    if (o->spacing && (o->respacing[0] || strcmp(o->sampler, "dpm++") == 0))
        unet_usage_error("--spacing spaces ddim's and ddpm's --steps: it goes with neither --respacing nor --sampler dpm++");
    if (o->respacing[0] && (strcmp(o->sampler, "dpm++") == 0 || o->steps))
        unet_usage_error("--respacing gives ddim's and ddpm's steps: it goes with neither --sampler dpm++ nor --steps");
    if (o->nll && (o->eval || o->bench || o->steps || strcmp(o->sampler, "ddim") != 0 || o->schedule || o->guidance != 1.0 || o->classifier ||
                  o->low_res || o->clip_denoised != -1))
        unet_usage_error("--nll measures a likelihood: it goes with --num, --batch, --respacing and --seed only");
}

// Parses the command line (--name VALUE or --name=VALUE, a hyphen in a name standing for an
// underscore); no arguments, -h or --help print the usage, --version the version.
static Options parse_options(int argc, char **argv) {
    static const char *const names[] = {"checkpoint", "weights", "sampler", "class", "out", "eval", "output", "respacing", "nll",
                                        "schedule", "sigma_min", "sigma_max", "rho", "s_churn", "s_tmin", "s_tmax", "s_noise", "spacing",
                                        "classifier", "low_res", "upsampler", "steps", "up_steps", "num", "batch", "bench", "seed", "eta",
                                        "clip_denoised", "classifier_scale", "guidance"};
    Options o;
    memset(&o, 0, sizeof o);  // batch 0: the largest that fits
    o.weights = "ema", o.sampler = NULL, o.class_name = "all", o.out = "samples", o.respacing = "", o.num = 64;
    o.guidance = 1.0, o.classifier_scale = 1.0, o.eta = -1, o.rho = 7, o.s_tmax = INFINITY, o.s_noise = 1, o.clip_denoised = -1;
    if (argc < 2) fputs(usage, stdout), exit(0);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) fputs(usage, stdout), exit(0);
        if (strcmp(a, "--version") == 0) unet_print_version(), exit(0);
        if (a[0] == '-' && a[1] != '-') unet_usage_error("unknown option %s", a);
        if (strncmp(a, "--", 2) != 0) unet_usage_error("unexpected argument '%s'", a);
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);  // "--name"
        const char *name = NULL;
        int count = (int)(sizeof names / sizeof *names);
        for (int k = 0; k < count; k++)
            if (cli_name_is(a + 2, len - 2, names[k])) name = names[k];
        char hint[128];
        int model_flag = -1, classifier_flag = -1;
        for (int k = 0; !name && k < NUM_MODEL_FLAG_NAMES; k++)
            if (cli_name_is(a + 2, len - 2, model_flag_names[k])) model_flag = k, name = model_flag_names[k];
        for (int k = 0; !name && k < NUM_CLASSIFIER_FLAG_NAMES; k++)
            if (cli_name_is(a + 2, len - 2, classifier_flag_names[k])) classifier_flag = k, name = classifier_flag_names[k];
        if (!name) unet_usage_error("unknown option %.*s%s", (int)len, a, cli_hint(a + 2, len - 2, names, count, hint, sizeof hint));
        if (!eq && i + 1 >= argc) unet_usage_error("--%s needs a value", name);
        const char *v = eq ? eq + 1 : argv[++i];
        char flag[40];
        snprintf(flag, sizeof flag, "--%s", name);
        if (model_flag >= 0 || classifier_flag >= 0) {
            char **pairs = model_flag >= 0 ? o.model_flags : o.classifier_flags;
            int *count = model_flag >= 0 ? &o.num_model_flags : &o.num_classifier_flags;
            for (int k = 0; k < *count; k++)
                if (strncmp(pairs[k], name, strlen(name)) == 0 && pairs[k][strlen(name)] == '=') unet_usage_error("--%s is given twice", name);
            size_t bytes = strlen(name) + strlen(v) + 2;
            char *pair = (char *)malloc(bytes);
            if (!pair) unet_die("out of memory");
            snprintf(pair, bytes, "%s=%s", name, v);
            pairs[(*count)++] = pair;
        } else if (strcmp(name, "checkpoint") == 0) o.checkpoint = v;
        else if (strcmp(name, "weights") == 0) o.weights = v;
        else if (strcmp(name, "sampler") == 0) o.sampler = v;
        else if (strcmp(name, "class") == 0) o.class_name = v;
        else if (strcmp(name, "out") == 0) o.out = v;
        else if (strcmp(name, "eval") == 0) o.eval = v;
        else if (strcmp(name, "output") == 0) o.output = v;
        else if (strcmp(name, "respacing") == 0) o.respacing = v;
        else if (strcmp(name, "nll") == 0) o.nll = v;
        else if (strcmp(name, "spacing") == 0) o.spacing = v;
        else if (strcmp(name, "schedule") == 0) o.schedule = v;
        else if (strcmp(name, "sigma_min") == 0) o.sigma_min = real_option(flag, v, 1e-6, 1e6);
        else if (strcmp(name, "sigma_max") == 0) o.sigma_max = real_option(flag, v, 1e-6, 1e6);
        else if (strcmp(name, "rho") == 0) o.rho = real_option(flag, v, 0.1, 100);
        else if (strcmp(name, "s_churn") == 0) o.s_churn = real_option(flag, v, 0, 1000);
        else if (strcmp(name, "s_tmin") == 0) o.s_tmin = real_option(flag, v, 0, 1e6);
        else if (strcmp(name, "s_tmax") == 0) o.s_tmax = real_option(flag, v, 0, 1e6);
        else if (strcmp(name, "s_noise") == 0) o.s_noise = real_option(flag, v, 0, 10);
        else if (strcmp(name, "classifier") == 0) o.classifier = v;
        else if (strcmp(name, "low_res") == 0) o.low_res = v;
        else if (strcmp(name, "upsampler") == 0) o.upsampler = v;
        else if (strcmp(name, "up_steps") == 0) o.up_steps = (int)unet_int_option(flag, v, 1, 100000);
        else if (strcmp(name, "steps") == 0) o.steps = (int)unet_int_option(flag, v, 1, 100000);
        else if (strcmp(name, "num") == 0) o.num = (int)unet_int_option(flag, v, 1, 1000000);
        else if (strcmp(name, "batch") == 0) o.batch = (int)unet_int_option(flag, v, 1, 65536);
        else if (strcmp(name, "bench") == 0) o.bench = (int)unet_int_option(flag, v, 1, 1000);
        else if (strcmp(name, "seed") == 0) o.seed = unet_int_option(flag, v, 0, (1ll << 62));
        else if (strcmp(name, "eta") == 0) o.eta = real_option(flag, v, 0, 1);
        else if (strcmp(name, "clip_denoised") == 0) {
            if (strcmp(v, "True") != 0 && strcmp(v, "False") != 0) unet_usage_error("--clip_denoised takes True or False, not '%s'", v);
            o.clip_denoised = strcmp(v, "True") == 0;
        }
        else if (strcmp(name, "classifier_scale") == 0) o.classifier_scale = real_option(flag, v, -1000, 1000), o.classifier_scale_given = 1;
        else o.guidance = real_option(flag, v, 0, 100);  // the last of names
    }
    if (!o.checkpoint) unet_usage_error("--checkpoint is required");
    if (strcmp(o.weights, "ema") != 0 && strcmp(o.weights, "model") != 0)
        unet_usage_error("--weights must be ema or model, not '%s'", o.weights);
    if ((o.eval != NULL) != (o.output != NULL))
        unet_usage_error("--eval IN.safetensors and --output OUT.safetensors go together");
    if (o.eval && (o.classifier || o.low_res))
        unet_usage_error("--eval runs the model on its file's inputs: it goes without --classifier and --low_res");
    if (o.up_steps && !o.upsampler) unet_usage_error("--up_steps is the cascade's: it needs --upsampler");
    if (o.upsampler && (o.eval || o.nll || o.low_res))
        unet_usage_error("--upsampler upsamples the images sampled: it goes without --eval, --nll and --low_res");
    if (!o.classifier && (o.classifier_scale_given || o.num_classifier_flags))
        unet_usage_error("--%.*s is classifier guidance's: it needs --classifier",
                         o.classifier_scale_given ? 16 : (int)strcspn(o.classifier_flags[0], "="),
                         o.classifier_scale_given ? "classifier_scale" : o.classifier_flags[0]);
    if (o.batch > o.num) o.batch = o.num;
    return o;
}

// The progress bar: on a terminal (stderr), once sampling has run 2 s, redrawn at most 10 times a
// second: the share of all images' steps done, the images finished and the time so far.
typedef struct {
    int tty, shown, num, done, batch_images;  // done: images finished before this batch
    double start, drawn;
} Progress;

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void show_progress(void *ctx, int step, int steps) {
    Progress *p = (Progress *)ctx;
    double now = now_seconds();
    if (!p->tty || now - p->start < 2.0 || (now - p->drawn < 0.1 && step < steps)) return;
    double share = (p->done + (double)p->batch_images * step / steps) / p->num;
    int filled = (int)(share * 30), finished = p->done + (step == steps ? p->batch_images : 0);
    fprintf(stderr, "\rgenerate: [%.*s%*s] %3.0f%%  %d/%d images  %.0f s", filled, "##############################", 30 - filled,
            "", 100 * share, finished, p->num, now - p->start);
    p->shown = 1, p->drawn = now;
}

// Samples images 0 .. num - 1 in batches of `batch` with a sampler, labels [num] and, for an
// upsampler, their low-resolution images low [num][per_low values] (else NULL), into images
// [num][per_image values]; says each batch on stdout unless `quiet` or the progress bar shows.
// Returns the GPU time in ms.
static double sample_batches(UnetSampler *sampler, int num, int batch, const int *labels, const uint8_t *low, size_t per_low,
                             uint8_t *images, size_t per_image, int quiet, Progress *progress) {
    double ms = 0;
    progress->num = num, progress->start = now_seconds(), progress->shown = 0;
    for (int first = 0; first < num; first += batch) {
        int n = num - first < batch ? num - first : batch;
        progress->done = first, progress->batch_images = n;
        ms += unet_sample(sampler, first, n, labels + first, low ? low + first * per_low : NULL, images + (size_t)first * per_image,
                          progress->tty ? show_progress : NULL, progress);
        if (!quiet && !progress->shown) printf("generate: %d/%d images\n", first + n, num), fflush(stdout);
    }
    if (progress->shown) fputc('\n', stderr);
    return ms;
}

// --sampler's kind, its default steps and eta.
static SamplerKind sampler_kind(const Options *o) {
    return strcmp(o->sampler, "ddpm") == 0      ? SAMPLER_DDPM
           : strcmp(o->sampler, "dpm++") == 0   ? SAMPLER_DPM_SOLVER_PP
           : strcmp(o->sampler, "euler_a") == 0 ? SAMPLER_EULER_ANCESTRAL
           : strcmp(o->sampler, "heun") == 0    ? SAMPLER_HEUN
                                                : SAMPLER_DDIM;
}
static int default_steps(SamplerKind kind) {
    return kind == SAMPLER_DPM_SOLVER_PP ? 20 : kind == SAMPLER_EULER_ANCESTRAL ? 30 : kind == SAMPLER_HEUN ? 18 : kind == SAMPLER_DDPM ? 0 : 50;
}

// An EDM model's sigma_data (the Karras levels' KarrasLevels.sigma_data), or 0 for a discrete-time model.
static double edm_sigma_data(const UnetInfo *info) {
    return info->diffusion.predict == PREDICT_EDM ? info->diffusion.sigma_data : 0.0;
}

// The plan of `count` steps of the sampler on a model's schedule: on Karras levels (--schedule
// karras; euler_a's only), as k-diffusion samples, x0 not clipped; else on guided-diffusion's
// spacings (respacing: a spec, or NULL), x0 clipped to [-1, 1] as its samplers do (--clip_denoised
// sets either). Returns 0, or -1
// when the steps or levels do not fit the schedule.
static int make_plan(const Options *o, SamplePlan *plan, const NoiseSchedule *schedule, SamplerKind kind, int count, const char *respacing,
                     const UnetInfo *info) {
    float eta = (float)(o->eta >= 0 ? o->eta : kind == SAMPLER_EULER_ANCESTRAL ? 1.0 : 0.0);
    if (o->schedule) {
        KarrasLevels levels = {o->sigma_min, o->sigma_max, o->rho, o->s_churn, o->s_tmin, o->s_tmax, o->s_noise, edm_sigma_data(info)};
        return sample_plan_karras(plan, schedule, kind, count, levels, eta, info->diffusion.predict, o->clip_denoised == 1);
    }
    return sample_plan_make(plan, schedule, kind, count, respacing, eta, info->diffusion.predict, o->clip_denoised != 0,
                            info->diffusion.variance);
}

// Exits with one line for Karras levels that do not fit a model's schedule: --sigma_min or
// --sigma_max beyond the other end of the model's own range.
static void check_levels(const Options *o, const NoiseSchedule *schedule, const UnetInfo *info) {
    const char *file = info->file;
    KarrasLevels levels = {o->sigma_min, o->sigma_max, o->rho, 0, 0, 0, 1, edm_sigma_data(info)};
    KarrasLevels own = levels;
    own.sigma_min = own.sigma_max = 0;
    double lo, hi, own_lo, own_hi;
    karras_range(schedule, levels, &lo, &hi);
    karras_range(schedule, own, &own_lo, &own_hi);
    if (lo >= hi)
        unet_die("%s: Karras levels from sigma_min %g to sigma_max %g are empty (its own range: %g to %g)", file, lo, hi, own_lo, own_hi);
}

// The cascade's second stage, before the GPU is used: the upsampler --upsampler, checked against
// the base model (its small size is the base's size; a class-conditional one needs the base's
// classes), and its plan (the sampler's kind and eta, --up_steps or the sampler's default).
static UnetCheckpoint *upsampler_open(const Options *o, const UnetInfo *base, int classes, SamplerKind kind, UnetInfo *info,
                                      NoiseSchedule *schedule, SamplePlan *plan) {
    char err[1024];
    UnetCheckpoint *ck = unet_checkpoint_open(o->upsampler, o->weights, NULL, 0, info, err, sizeof err);
    if (!ck) unet_die("%s", err);
    if (!info->small_size)
        unet_die("--upsampler %s is no upsampler (no small_size: train one with train_unet --super_res)", info->file);
    if (info->small_size != base->image_size || info->in_channels != base->in_channels)
        unet_die("--upsampler %s upsamples %dx%d images; %s makes %dx%d", info->file, info->small_size, info->small_size, base->file,
                 base->image_size, base->image_size);
    int up_classes = info->num_classes - info->null_class;
    if (up_classes && up_classes != classes)
        unet_die("--upsampler %s is conditioned on %d classes; the images sampled have %d", info->file, up_classes, classes);
    if (noise_schedule_make(schedule, info->diffusion.steps, info->diffusion.schedule) != 0)
        unet_die("%s: unknown noise_schedule '%s' in its metadata", info->file, info->diffusion.schedule);
    int count = o->up_steps ? o->up_steps : default_steps(kind);
    if (o->schedule) check_levels(o, schedule, info);
    if (make_plan(o, plan, schedule, kind, count, NULL, info) != 0)
        unet_die("--up_steps %d: no spacing of the upsampler's %d diffusion steps gives that many", count, info->diffusion.steps);
    return ck;
}

static int compare_doubles(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

// --nll: bits per dimension of the first --num images of a dataset, their mean and its standard
// error (and the prior's part of it), one line.
static int likelihood(const Options *o, UnetCheckpoint *checkpoint, const UnetInfo *info) {
    Dataset data;
    char err[1024];
    if (dataset_open(o->nll, &data, err, sizeof err) != 0) unet_die("%s", err);
    const DatasetHeader *h = &data.header;
    if ((int)h->width != info->image_size || (int)h->height != info->image_size || (int)h->channels != info->in_channels)
        unet_die("dataset %s holds %ux%u images of %u channels; %s's model takes %dx%d of %d", o->nll, h->width, h->height,
                 h->channels, info->file, info->image_size, info->image_size, info->in_channels);
    int classes = info->num_classes - info->null_class;
    if (classes && !data.labels) unet_die("%s is class-conditional, and dataset %s has no labels", info->file, o->nll);
    if (classes && (int)h->num_classes > classes)
        unet_die("dataset %s has %u classes; %s's model knows %d", o->nll, h->num_classes, info->file, classes);
    int count = (uint64_t)o->num < h->count ? o->num : (int)h->count;
    int *labels = NULL;
    if (classes) {
        labels = malloc(count * sizeof(int));
        if (!labels) unet_die("out of memory");
        for (int i = 0; i < count; i++) labels[i] = (int)data.labels[i];
    }
    int batch = o->batch ? (o->batch < count ? o->batch : count) : (count < 64 ? count : 64);
    double *bpd = malloc(count * sizeof(double)), *prior = malloc(count * sizeof(double));
    if (!bpd || !prior) unet_die("out of memory");
    printf("generate: bits/dim of %d images of %s under %s (%s%s), batches of %d\n", count, o->nll, info->file,
           o->respacing[0] ? "respaced " : "every step", o->respacing, batch);
    fflush(stdout);
    if (unet_nll(checkpoint, data.pixels, labels, count, batch, o->respacing, (uint64_t)o->seed, bpd, prior, err, sizeof err) != 0)
        unet_die("%s", err);
    double mean = 0, mean_prior = 0, var = 0;
    for (int i = 0; i < count; i++) mean += bpd[i] / count, mean_prior += prior[i] / count;
    for (int i = 0; i < count; i++) var += (bpd[i] - mean) * (bpd[i] - mean) / (count > 1 ? count - 1 : 1);
    printf("bits/dim %.4f +- %.4f (standard error of the mean over %d images; the prior's part %.6f)\n", mean, sqrt(var / count), count,
           mean_prior);
    free(bpd), free(prior), free(labels);
    dataset_close(&data);
    unet_checkpoint_close(checkpoint);
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGXFSZ, SIG_IGN);  // a write past the file-size limit fails (EFBIG, "File too large") and is said
    Options o = parse_options(argc, argv);
    char err[1024];
    UnetInfo info;
    UnetCheckpoint *checkpoint = unet_checkpoint_open(o.checkpoint, o.weights, (const char *const *)o.model_flags, o.num_model_flags,
                                                      &info, err, sizeof err);
    if (!checkpoint) unet_die("%s", err);
    check_sampler_options(&o, info.diffusion.predict == PREDICT_EDM);
    if (info.model[0]) printf("%s: %s\n", info.file, info.model);
    const char *file = info.file;
    if (o.eval) {
        if (unet_eval(checkpoint, o.eval, o.output, err, sizeof err) != 0) unet_die("%s", err);
        printf("generate: wrote %s\n", o.output);
        unet_checkpoint_close(checkpoint);
        return 0;
    }
    if (info.classifier_pool[0])
        unet_die("%s is a noisy classifier (classifier_pool %s), not a diffusion model: give it with --classifier", file,
                 info.classifier_pool);
    if (info.small_size && o.nll) unet_die("%s is an upsampler: --nll of one is not built yet", file);
    if (info.small_size && !o.low_res)
        unet_die("%s is an upsampler (SuperResModel, %dx%d to %dx%d): give the images to upsample with --low_res FILE.bin", file,
                 info.small_size, info.small_size, info.image_size, info.image_size);
    if (!info.small_size && o.low_res) unet_die("--low_res is for an upsampler; %s is none (no small_size)", file);
    if (o.nll) return likelihood(&o, checkpoint, &info);
    Dataset low;  // an upsampler's low-resolution images
    memset(&low, 0, sizeof low);
    if (o.low_res) {
        if (dataset_open(o.low_res, &low, err, sizeof err) != 0) unet_die("%s", err);
        const DatasetHeader *h = &low.header;
        if ((int)h->width != info.small_size || (int)h->height != info.small_size || (int)h->channels != info.in_channels)
            unet_die("--low_res %s holds %ux%u images of %u channels; %s upsamples %dx%d of %d", o.low_res, h->width, h->height,
                     h->channels, file, info.small_size, info.small_size, info.in_channels);
        if ((uint64_t)o.num > h->count) o.num = (int)h->count;
        if (o.batch > o.num) o.batch = o.num;
    }
    int classes = info.num_classes - info.null_class, fixed_class = -1;
    UnetCheckpoint *classifier = NULL;
    if (o.classifier) {  // its classes are the labels asked for: the model's too, when it has them
        UnetInfo classifier_info;
        classifier = unet_classifier_open(o.classifier, (const char *const *)o.classifier_flags, o.num_classifier_flags, info.image_size,
                                          &classifier_info, err, sizeof err);
        if (!classifier) unet_die("%s", err);
        if (classifier_info.model[0]) printf("%s: %s\n", classifier_info.file, classifier_info.model);
        if (classes && classes != classifier_info.num_classes)
            unet_die("%s knows %d classes and the classifier %s %d: they must be the same classes", file, classes, classifier_info.file,
                     classifier_info.num_classes);
        if (o.guidance != 1.0 && !classes) unet_die("%s is unconditional: --guidance needs a class-conditional model", file);
        classes = classifier_info.num_classes;
    }
    if (!classes && (strcmp(o.class_name, "all") != 0 || o.guidance != 1.0))
        unet_die("%s is unconditional: --class and --guidance need a class-conditional model (or --classifier)", file);
    if (o.guidance != 1.0 && !info.null_class)
        unet_die("%s has no null class (trained without --cfg_dropout's label): classifier-free guidance needs one", file);
    long long k;
    if (classes && strcmp(o.class_name, "all") != 0) {
        if (cli_read_int(o.class_name, 0, classes - 1, &k) != 0)
            unet_die("--class takes all or a class in 0..%d of %s, not '%s'", classes - 1, file, o.class_name);
        fixed_class = (int)k;
    }

    NoiseSchedule schedule;
    SamplePlan plan;
    if (noise_schedule_make(&schedule, info.diffusion.steps, info.diffusion.schedule) != 0)
        unet_die("%s: unknown noise_schedule '%s' in its metadata", file, info.diffusion.schedule);
    SamplerKind kind = sampler_kind(&o);
    int count = o.steps ? o.steps : default_steps(kind);
    char spaced[32];
    if (o.spacing) {  // Lin et al.'s spacings of the steps, as respacing specs (sampler.h)
        snprintf(spaced, sizeof spaced, "%s%d", o.spacing, count ? count : info.diffusion.steps);
        o.respacing = spaced;
    }
    if (o.schedule) check_levels(&o, &schedule, &info);
    if (make_plan(&o, &plan, &schedule, kind, count, o.respacing, &info) != 0) {
        if (o.spacing)
            unet_die("--spacing %s: %d steps do not fit the %d diffusion steps", o.spacing, count ? count : info.diffusion.steps,
                     info.diffusion.steps);
        if (o.respacing[0])
            unet_die("--respacing '%s' keeps no steps of the %d diffusion steps (ddimN, or section counts N or N1,N2,... each at "
                             "most the section's length)", o.respacing, info.diffusion.steps);
        unet_die("--steps %d: no spacing of the %d diffusion steps gives that many", count, info.diffusion.steps);
    }
    UnetCheckpoint *up_checkpoint = NULL;
    UnetInfo up_info;
    NoiseSchedule up_schedule;
    SamplePlan up_plan;
    if (o.upsampler) up_checkpoint = upsampler_open(&o, &info, classes, kind, &up_info, &up_schedule, &up_plan);
    UnetGuidance guidance = {(float)o.guidance, classifier, (float)o.classifier_scale};
    int up_batch = o.batch;  // the cascade's upsampler: --batch, else the largest of its own that fits
    if (!o.batch) {
        o.batch = unet_sampler_max_batch(checkpoint, &plan, &guidance, o.num, err, sizeof err);
        if (!o.batch) unet_die("%s", err);
    }
    UnetSampler *sampler = unet_sampler_create(checkpoint, o.batch, &plan, &guidance, (uint64_t)o.seed, err, sizeof err);
    if (!sampler) unet_die("%s", err);
    UnetSampler *up_sampler = NULL;  // the cascade's upsampler (no guidance; draws from a seed made from --seed)
    if (up_checkpoint) {
        UnetGuidance none = {1.0f, NULL, 0.0f};
        if (!up_batch) up_batch = unet_sampler_max_batch(up_checkpoint, &up_plan, &none, o.num, err, sizeof err);
        if (!up_batch) unet_die("%s", err);
        up_sampler = unet_sampler_create(up_checkpoint, up_batch, &up_plan, &none, random_u64((uint64_t)o.seed, 1, 0), err, sizeof err);
        if (!up_sampler) unet_die("%s", err);
    }
    // The output folder only once the model is on the GPU: a run that cannot sample leaves none.
    if (!o.bench && mkdir(o.out, 0777) != 0 && errno != EEXIST) unet_die("cannot create %s: %s", o.out, strerror(errno));
    int S = info.image_size;
    size_t per_image = (size_t)S * S * info.in_channels;
    unsigned char *images = malloc((size_t)o.num * per_image);
    int *labels = malloc((size_t)o.num * sizeof(int));
    if (!images || !labels) unet_die("out of memory");
    for (int i = 0; i < o.num; i++) labels[i] = fixed_class >= 0 ? fixed_class : classes ? i % classes : 0;
    if (low.labels && classes && fixed_class < 0) {  // each low-resolution image's own class
        if ((int)low.header.num_classes > classes)
            unet_die("--low_res %s has %u classes; %s knows %d", o.low_res, low.header.num_classes, file, classes);
        for (int i = 0; i < o.num; i++) labels[i] = (int)low.labels[i];
    }
    size_t per_low = (size_t)info.small_size * info.small_size * info.in_channels;
    char guided[96] = "";
    if (o.guidance != 1.0) snprintf(guided, sizeof guided, ", classifier-free guidance %g", o.guidance);
    if (classifier)
        snprintf(guided + strlen(guided), sizeof guided - strlen(guided), ", classifier guidance %g", o.classifier_scale);
    printf("generate: %d images of %dx%d from %s (%lld parameters), %s with %d steps%s, batches of %d\n", o.num, S, S, file,
           (long long)info.parameters, o.sampler, plan.count, guided, o.batch);
    uint8_t *base_images = NULL;  // the cascade: the base model's images, which the upsampler's become
    if (up_sampler) {
        printf("generate: then upsampled to %dx%d by %s (%lld parameters), %s with %d steps, batches of %d\n", up_info.image_size,
               up_info.image_size, up_info.file, (long long)up_info.parameters, o.sampler, up_plan.count, up_batch);
        base_images = images, S = up_info.image_size;
        images = malloc((size_t)o.num * S * S * info.in_channels);
        if (!images) unet_die("out of memory");
    }
    int runs = o.bench ? o.bench + 1 : 1;  // --bench: a warm-up, then the timed runs
    double *seconds = malloc(runs * sizeof(double));
    if (!seconds) unet_die("out of memory");
    Progress progress = {!o.bench && isatty(STDERR_FILENO), 0, o.num, 0, 0, now_seconds(), 0.0};
    for (int run = 0; run < runs; run++) {
        const uint8_t *low_images = o.low_res ? low.pixels : NULL;
        double ms = sample_batches(sampler, o.num, o.batch, labels, low_images, per_low, base_images ? base_images : images, per_image,
                                   o.bench, &progress);
        if (up_sampler)  // the base images as the upsampler's low-resolution ones
            ms += sample_batches(up_sampler, o.num, up_batch, labels, base_images, per_image, images, (size_t)S * S * info.in_channels,
                                 o.bench, &progress);
        seconds[run] = ms / 1000.0;
    }
    per_image = (size_t)S * S * info.in_channels;
    unet_sampler_free(sampler);
    unet_sampler_free(up_sampler);
    unet_checkpoint_close(checkpoint);
    unet_checkpoint_close(classifier);
    unet_checkpoint_close(up_checkpoint);
    if (o.bench) {
        qsort(seconds + 1, o.bench, sizeof(double), compare_doubles);
        double median = seconds[1 + o.bench / 2];
        printf("generate: bench: median %.3f s for %d images (%.1f images/s; min %.3f s, max %.3f s over %d runs)\n", median, o.num,
               o.num / median, seconds[1], seconds[o.bench], o.bench);
    } else {
        char path[4400];
        for (int i = 0; i < o.num; i++) {
            snprintf(path, sizeof path, "%s/%06d.png", o.out, i);
            if (write_png(path, S, S, images + (size_t)i * per_image) != 0)
                unet_die("cannot write %s: %s", path, strerror(errno));
        }
        if (base_images) {
            snprintf(path, sizeof path, "%s/base_grid.png", o.out);
            if (write_grid_png(path, base_images, o.num, info.image_size, 0) != 0) unet_die("cannot write %s: %s", path, strerror(errno));
        }
        snprintf(path, sizeof path, "%s/grid.png", o.out);
        if (write_grid_png(path, images, o.num, S, 0) != 0) unet_die("cannot write %s: %s", path, strerror(errno));
        printf("generate: wrote %d images and %s; sampling took %.2f s on the GPU (%.1f images/s)\n", o.num, path, seconds[0],
               o.num / seconds[0]);
    }
    free(images), free(labels), free(seconds), free(base_images);
    if (o.low_res) dataset_close(&low);
    if (up_checkpoint) noise_schedule_free(&up_schedule), sample_plan_free(&up_plan);
    noise_schedule_free(&schedule);
    sample_plan_free(&plan);
    return 0;
}
