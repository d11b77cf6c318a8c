// generate.c: images from a trained checkpoint, without Python. The samplers are sampler.h's
// (shared with the trainer); the model runs on the GPU through train_unet.cu's C API (unet_api.h).
//
//   ./generate --checkpoint DIR|FILE.safetensors [--sampler ddim|ddpm|dpm++] [--steps N] [--num N] ...
//
// Image i's starting noise and every draw it needs depend only on (--seed, i): the same seed and
// --batch give the same images (another --batch gives the same noise; the model's products may
// then round differently in the last bits).
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "sampler.h"
#include "unet_api.h"

static const char usage[] =
    "usage: generate --checkpoint DIR|FILE.safetensors [options]\n"
    "\n"
    "Samples images from a checkpoint of train_unet (or any guided-diffusion UNet saved as safetensors\n"
    "with its flags in the metadata) and writes one PNG per image and a grid.\n"
    "  --checkpoint PATH   a checkpoint folder, or a .safetensors file\n"
    "  --weights ema|model the folder's EMA weights (default) or its raw weights\n"
    "  --sampler S         ddim (default), ddpm (ancestral, every step) or dpm++ (DPM-Solver++ 2M)\n"
    "  --steps N           sampling steps: ddim 50, dpm++ 20 by default; ddpm uses all diffusion steps\n"
    "  --eta E             DDIM's noise, 0 (default, deterministic) to 1\n"
    "  --class K|all       class-conditional models: one class, or all in turn (default all)\n"
    "  --guidance W        classifier-free guidance scale (1: plain conditional sampling, default)\n"
    "  --num N             images (default 64)\n"
    "  --batch B           images per model call (default 64)\n"
    "  --seed S            (default 0)\n"
    "  --out DIR           output folder (default samples): 000000.png ... and grid.png\n"
    "\n"
    "       generate --checkpoint PATH --eval IN.safetensors --output OUT.safetensors\n"
    "runs the model once on IN's x [N,C,H,W] (float, NCHW), t [N] and, class-conditional, y [N], and\n"
    "writes its raw output out [N,C_out,H,W] (F32, NCHW): for comparing with PyTorch.\n";

static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("generate: error: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(1);
}

typedef struct {
    const char *checkpoint, *weights, *sampler, *class_name, *out, *eval, *output;
    int steps, num, batch;
    double eta, guidance;
    long long seed;
} Options;

static long long parse_int(const char *name, const char *s, long long lo, long long hi) {
    char *end;
    errno = 0;
    long long v = strtoll(s, &end, 10);
    if (end == s || *end || errno || v < lo || v > hi) die("%s takes a whole number in %lld..%lld, not '%s'", name, lo, hi, s);
    return v;
}

static double parse_real(const char *name, const char *s, double lo, double hi) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (end == s || *end || errno || !(v >= lo && v <= hi)) die("%s takes a number in %g..%g, not '%s'", name, lo, hi, s);
    return v;
}

static Options parse_options(int argc, char **argv) {
    Options o = {NULL, "ema", "ddim", "all", "samples", NULL, NULL, 0, 64, 64, 0.0, 1.0, 0};
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) fputs(usage, stdout), exit(0);
        if (strncmp(a, "--", 2) != 0) die("unexpected argument '%s' (see --help)", a);
        if (i + 1 >= argc) die("%s needs a value (see --help)", a);
        const char *v = argv[++i];
        if (strcmp(a, "--checkpoint") == 0) o.checkpoint = v;
        else if (strcmp(a, "--weights") == 0) o.weights = v;
        else if (strcmp(a, "--sampler") == 0) o.sampler = v;
        else if (strcmp(a, "--class") == 0) o.class_name = v;
        else if (strcmp(a, "--out") == 0) o.out = v;
        else if (strcmp(a, "--eval") == 0) o.eval = v;
        else if (strcmp(a, "--output") == 0) o.output = v;
        else if (strcmp(a, "--steps") == 0) o.steps = (int)parse_int(a, v, 1, 100000);
        else if (strcmp(a, "--num") == 0) o.num = (int)parse_int(a, v, 1, 1000000);
        else if (strcmp(a, "--batch") == 0) o.batch = (int)parse_int(a, v, 1, 4096);
        else if (strcmp(a, "--seed") == 0) o.seed = parse_int(a, v, 0, (1ll << 62));
        else if (strcmp(a, "--eta") == 0) o.eta = parse_real(a, v, 0, 1);
        else if (strcmp(a, "--guidance") == 0) o.guidance = parse_real(a, v, 0, 100);
        else die("unknown option '%s' (see --help)", a);
    }
    if (!o.checkpoint) die("--checkpoint is required (see --help)");
    if (strcmp(o.weights, "ema") != 0 && strcmp(o.weights, "model") != 0) die("--weights must be ema or model, not '%s'", o.weights);
    if (strcmp(o.sampler, "ddim") != 0 && strcmp(o.sampler, "ddpm") != 0 && strcmp(o.sampler, "dpm++") != 0)
        die("--sampler must be ddim, ddpm or dpm++, not '%s'", o.sampler);
    if ((o.eval != NULL) != (o.output != NULL)) die("--eval IN.safetensors and --output OUT.safetensors go together");
    if (o.batch > o.num) o.batch = o.num;
    return o;
}

// What the sampling loop's callbacks need: the model, this batch's labels, the guidance.
typedef struct {
    UnetModel *model;
    int batch, first, per_image, guided, null_label;
    float guidance;
    int *labels, *null_labels;
    int64_t *t;
    float *uncond;
    uint64_t seed;
} Batch;

// The model's output at timestep t for the whole batch; with guidance, uncond + w (cond - uncond).
static void batch_model(void *ctx, const float *x, int t, float *out) {
    Batch *b = (Batch *)ctx;
    for (int i = 0; i < b->batch; i++) b->t[i] = t;
    unet_forward_nhwc(b->model, x, b->t, b->labels, out);
    if (!b->guided) return;
    unet_forward_nhwc(b->model, x, b->t, b->null_labels, b->uncond);
    size_t n = (size_t)b->batch * b->per_image;
    for (size_t i = 0; i < n; i++) out[i] = guided_output(out[i], b->uncond[i], b->guidance);
}

// Standard normal draw for value i of the batch at step k (stream 0: the starting noise).
static float batch_noise(void *ctx, int k, size_t i) {
    Batch *b = (Batch *)ctx;
    uint64_t image = (uint64_t)b->first + i / b->per_image, at = image * b->per_image + i % b->per_image;
    double u1 = ((random_u64(b->seed, 2 * (uint64_t)k + 1, at) >> 11) + 0.5) / 9007199254740992.0;
    double u2 = (random_u64(b->seed, 2 * (uint64_t)k + 2, at) >> 11) / 9007199254740992.0;
    return (float)(sqrt(-2 * log(u1)) * cos(2 * M_PI * u2));
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

int main(int argc, char **argv) {
    unet_set_program_name("generate");
    Options o = parse_options(argc, argv);
    char file[4096], err[1024];
    UnetInfo info;
    if (unet_inspect(o.checkpoint, o.weights, &info, file, sizeof file, err, sizeof err) != 0) die("%s", err);
    if (o.eval) {
        if (unet_eval(file, o.eval, o.output, err, sizeof err) != 0) die("%s", err);
        printf("generate: wrote %s\n", o.output);
        return 0;
    }
    int classes = info.num_classes - info.null_class, fixed_class = -1;
    if (!classes && (strcmp(o.class_name, "all") != 0 || o.guidance != 1.0))
        die("%s is unconditional: --class and --guidance need a class-conditional model", file);
    if (o.guidance != 1.0 && !info.null_class)
        die("%s has no null class (trained without --cfg_dropout's label): classifier-free guidance needs one", file);
    if (classes && strcmp(o.class_name, "all") != 0) fixed_class = (int)parse_int("--class", o.class_name, 0, classes - 1);
    if (info.out_channels != info.in_channels) die("%s predicts a learned variance (learn_sigma): not supported for sampling", file);

    NoiseSchedule schedule;
    SampleSchedule steps;
    if (noise_schedule_make(&schedule, info.diffusion_steps, info.noise_schedule) != 0)
        die("%s: unknown noise_schedule '%s' in its metadata", file, info.noise_schedule);
    SamplerKind kind = strcmp(o.sampler, "ddpm") == 0 ? SAMPLER_DDPM : strcmp(o.sampler, "dpm++") == 0 ? SAMPLER_DPM_SOLVER_PP : SAMPLER_DDIM;
    int count = kind == SAMPLER_DDPM ? info.diffusion_steps : o.steps ? o.steps : kind == SAMPLER_DDIM ? 50 : 20;
    int made = kind == SAMPLER_DPM_SOLVER_PP ? sample_schedule_log_snr(&schedule, count, &steps) : sample_schedule_make(&schedule, count, &steps);
    if (made != 0) die("--steps %d: no even spacing of the %d diffusion steps gives that many", count, info.diffusion_steps);
    if (mkdir(o.out, 0777) != 0 && errno != EEXIST) die("cannot create %s: %s", o.out, strerror(errno));

    UnetModel *model = unet_load(file, o.batch, err, sizeof err);
    if (!model) die("%s", err);
    int S = info.image_size, per_image = S * S * info.in_channels;
    size_t batch_values = (size_t)o.batch * per_image;
    float *x = malloc(batch_values * sizeof(float));
    unsigned char *images = malloc((size_t)o.num * per_image);
    Batch b = {model, o.batch, 0, per_image, info.null_class && o.guidance != 1.0, classes, (float)o.guidance,
               calloc(o.batch, sizeof(int)), calloc(o.batch, sizeof(int)), calloc(o.batch, sizeof(int64_t)),
               malloc(batch_values * sizeof(float)), (uint64_t)o.seed};
    if (!x || !images || !b.labels || !b.null_labels || !b.t || !b.uncond) die("out of memory");
    for (int i = 0; i < o.batch; i++) b.null_labels[i] = classes;
    printf("generate: %d images of %dx%d from %s (%lld parameters), %s with %d steps\n", o.num, S, S, file,
           (long long)info.parameters, o.sampler, steps.count);
    double started = now();
    for (int first = 0; first < o.num; first += o.batch) {
        int n = o.num - first < o.batch ? o.num - first : o.batch;  // a short last batch fills its tail with copies
        b.first = first;
        for (int i = 0; i < o.batch; i++) b.labels[i] = fixed_class >= 0 ? fixed_class : classes ? (first + (i < n ? i : 0)) % classes : 0;
        for (size_t i = 0; i < batch_values; i++) x[i] = batch_noise(&b, -1, i);
        if (sample_loop(kind, &steps, (float)o.eta, strcmp(info.predict, "v") == 0, 1, batch_model, batch_noise, &b, x, batch_values) != 0)
            die("out of memory");
        for (size_t i = 0; i < (size_t)n * per_image; i++) {
            float v = (x[i] + 1.0f) * 127.5f;
            images[(size_t)first * per_image + i] = (unsigned char)(v < 0 ? 0 : v > 255 ? 255 : v + 0.5f);
        }
        printf("generate: %d/%d images\n", first + n, o.num);
        fflush(stdout);
    }
    double seconds = now() - started;
    char path[4400];
    for (int i = 0; i < o.num; i++) {
        snprintf(path, sizeof path, "%s/%06d.png", o.out, i);
        if (write_png(path, S, S, images + (size_t)i * per_image) != 0) die("cannot write %s: %s", path, strerror(errno));
    }
    snprintf(path, sizeof path, "%s/grid.png", o.out);
    if (write_grid_png(path, images, o.num, S) != 0) die("cannot write %s: %s", path, strerror(errno));
    printf("generate: wrote %d images and %s in %.1f s (%.1f images/s)\n", o.num, path, seconds, o.num / seconds);
    unet_free(model);
    free(x), free(images), free(b.labels), free(b.null_labels), free(b.t), free(b.uncond);
    noise_schedule_free(&schedule);
    sample_schedule_free(&steps);
    return 0;
}
