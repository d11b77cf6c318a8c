// evaluate.c: sample quality in numbers, as guided-diffusion's evaluator (evaluations/evaluator.py)
// reports it: FID, sFID, the Inception Score, precision and recall, from the features of
// pytorch-fid's Inception-v3 computed on the GPU by train_unet.cu's C API (unet_api.h).
//
//   ./evaluate --ref DATA.bin --sample samples/         FID ... of generate's images against a dataset
//   ./evaluate --ref DATA.bin --save_stats DATA.stats   the reference's statistics, kept for later
//
// A set is a dataset .bin, a folder of images, guided-diffusion's .npz batch (arr_0) or a statistics
// file (.stats, written by --save_stats: safetensors holding mu, sigma, mu_s, sigma_s in double, the
// pool features and the Inception Score). The mathematics is metrics.h's (on the GPU where it is heavy: the statistics,
// the matrix square roots, the k-NN distances).
#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <stb_image.h>

#include "checkpoint.h"
#include "cli.h"
#include "dataset.h"
#include "metrics.h"
#include "unet_api.h"

#define INCEPTION_FILE "pt_inception-2015-12-05-6726825d.pth"
#define NEIGHBOURS 3   // precision and recall's k
#define STATS_KIND "inception-statistics"

static const char usage[] =
    "usage: evaluate --ref REF --sample SAMPLES [options]\n"
    "       evaluate --ref REF --save_stats FILE.stats [options]\n"
    "\n"
    "Sample quality as guided-diffusion's evaluator reports it: the Inception Score\n"
    "of SAMPLES, FID and sFID between REF and SAMPLES, and precision and recall\n"
    "(k = 3), from the features of pytorch-fid's Inception-v3 on the GPU. REF and\n"
    "SAMPLES are each a dataset .bin, a folder of images (PNG, JPEG, BMP, TGA, PNM;\n"
    "in name order; generate's grid.png and base_grid.png left out; all of one\n"
    "size), guided-diffusion's .npz batch (its samples, its reference batches: the\n"
    "images of arr_0) or a statistics file written by --save_stats. Each set needs 4\n"
    "images at least; below 2049 FID's covariances are singular, taken as they are.\n"
    "  --ref PATH          the reference set\n"
    "  --sample PATH       the set to judge\n"
    "  --save_stats FILE   write REF's statistics to FILE (.stats) and stop\n"
    "  --inception FILE    pytorch-fid's Inception weights\n"
    "                      (" INCEPTION_FILE ") [where pytorch-fid\n"
    "                      keeps it: $TORCH_HOME/hub/checkpoints/, else\n"
    "                      ~/.cache/torch/hub/checkpoints/]\n"
    "  --num N             the first N images of each set [all]\n"
    "  --batch B           images per Inception batch (default: the largest that fits\n"
    "                      in half of the GPU's free memory, at most 200)\n"
    "  --json              the results as one JSON object instead of lines\n"
    "  --help, -h          this help\n"
    "  --version           the version and what it was built with\n"
    "\n"
    "A hyphen in an option's name may stand for an underscore.\n";

typedef struct {
    const char *ref, *sample, *save_stats, *inception;
    long long num;
    int batch, json;
} Options;

static Options parse_options(int argc, char **argv) {
    static const char *const names[] = {"ref", "sample", "save_stats", "inception", "num", "batch", "json"};
    int count = (int)(sizeof names / sizeof *names);
    Options o;
    memset(&o, 0, sizeof o);
    if (argc < 2) fputs(usage, stdout), exit(0);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) fputs(usage, stdout), exit(0);
        if (strcmp(a, "--version") == 0) unet_print_version(), exit(0);
        if (strncmp(a, "--", 2) != 0) unet_usage_error(a[0] == '-' ? "unknown option %s" : "unexpected argument '%s'", a);
        const char *eq = strchr(a, '=');
        size_t len = eq ? (size_t)(eq - a) : strlen(a);
        const char *name = NULL;
        for (int k = 0; k < count; k++)
            if (cli_name_is(a + 2, len - 2, names[k])) name = names[k];
        char hint[128];
        if (!name) unet_usage_error("unknown option %.*s%s", (int)len, a, cli_hint(a + 2, len - 2, names, count, hint, sizeof hint));
        if (strcmp(name, "json") == 0) {
            if (eq) unet_usage_error("--json takes no value");
            o.json = 1;
            continue;
        }
        if (!eq && i + 1 >= argc) unet_usage_error("--%s needs a value", name);
        const char *v = eq ? eq + 1 : argv[++i];
        if (strcmp(name, "ref") == 0) o.ref = v;
        else if (strcmp(name, "sample") == 0) o.sample = v;
        else if (strcmp(name, "save_stats") == 0) o.save_stats = v;
        else if (strcmp(name, "inception") == 0) o.inception = v;
        else if (strcmp(name, "num") == 0) o.num = unet_int_option("--num", v, 1, 1ll << 40);
        else o.batch = (int)unet_int_option("--batch", v, 1, 1024);
    }
    if (!o.ref) unet_usage_error("--ref is required");
    if (!o.sample == !o.save_stats) unet_usage_error("give --sample (to evaluate it) or --save_stats (to keep REF's statistics), one of them");
    if (o.save_stats && o.json) unet_usage_error("--json prints results: --save_stats has none");
    static char default_path[4096];
    if (!o.inception) unet_inception_default_path(default_path, sizeof default_path), o.inception = default_path;
    return o;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// UNET_PROFILE=1: how long a part took (the features and the metrics are always said).
static void profile_phase(const char *what, double since) {
    if (getenv("UNET_PROFILE")) fprintf(stderr, "evaluate: %s in %.2f s\n", what, now_seconds() - since);
}

// ---- the sets ----

// One set's images (a dataset's, or a folder's files) or statistics, and what was computed from them.
typedef struct {
    const char *path;
    int is_stats;
    Dataset data;              // a .bin
    char **files;              // a folder's images, in name order
    SafeTensorsFile stats;     // a .stats file
    MappedFile npz;            // guided-diffusion's batch .npz
    const uint8_t *pixels;     // a .bin's or an .npz's images, [count][height][width][channels]
    int64_t count;
    int height, width, channels;
    float *pool, *spatial, *logits;          // the features ([count][...]; logits only for the samples)
    double *mu, *sigma, *mu_s, *sigma_s;     // FID's and sFID's statistics
    double inception_score;
} FeatureSet;

static int name_order(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static int is_image_name(const char *name) {
    static const char *const extensions[] = {".png", ".jpg", ".jpeg", ".bmp", ".tga", ".ppm", ".pgm", ".pnm"};
    const char *dot = strrchr(name, '.');
    if (!dot || strcmp(name, "grid.png") == 0 || strcmp(name, "base_grid.png") == 0) return 0;
    for (size_t i = 0; i < sizeof extensions / sizeof *extensions; i++)
        if (strcasecmp(dot, extensions[i]) == 0) return 1;
    return 0;
}

// A folder's images: their names in order and their size, which every one must have. They are read
// as RGB (stb_image converts grey and drops alpha, as pytorch-fid's convert("RGB")).
static void open_folder(FeatureSet *s, long long num) {
    DIR *dir = opendir(s->path);
    if (!dir) unet_die("cannot open folder %s: %s", s->path, strerror(errno));
    int capacity = 0;
    struct dirent *e;
    while ((e = readdir(dir))) {
        if (!is_image_name(e->d_name)) continue;
        if (s->count == capacity) {
            capacity = capacity ? 2 * capacity : 1024;
            s->files = realloc(s->files, capacity * sizeof(char *));
            if (!s->files) unet_die("out of memory");
        }
        size_t bytes = strlen(s->path) + strlen(e->d_name) + 2;
        s->files[s->count] = malloc(bytes);
        if (!s->files[s->count]) unet_die("out of memory");
        snprintf(s->files[s->count++], bytes, "%s/%s", s->path, e->d_name);
    }
    closedir(dir);
    if (s->count == 0) unet_die("folder %s holds no images (.png, .jpg, .jpeg, .bmp, .tga, .ppm, .pgm, .pnm)", s->path);
    qsort(s->files, s->count, sizeof(char *), name_order);
    if (num && s->count > num) s->count = num;
    for (int64_t i = 0; i < s->count; i++) {  // every size from the files' headers, before anything is decoded
        int w, h, c;
        if (!stbi_info(s->files[i], &w, &h, &c)) unet_die("cannot read image %s: %s", s->files[i], stbi_failure_reason());
        if (i == 0) s->width = w, s->height = h, s->channels = 3;
        else if (w != s->width || h != s->height)
            unet_die("images of mixed sizes in %s: %s is %dx%d, %s %dx%d (resize them to one size first)", s->path, s->files[0], s->width,
                     s->height, s->files[i], w, h);
    }
}

// Reads images first .. first + n - 1 of a folder into pixels ([n][h][w][3]).
static void read_folder_images(const FeatureSet *s, int64_t first, int n, uint8_t *pixels) {
    size_t per_image = (size_t)s->height * s->width * 3;
    for (int i = 0; i < n; i++) {
        const char *file = s->files[first + i];
        int w, h, c;
        uint8_t *image = stbi_load(file, &w, &h, &c, 3);
        if (!image) unet_die("cannot read image %s: %s", file, stbi_failure_reason());
        if (w != s->width || h != s->height) unet_die("image %s changed size while it was read", file);
        memcpy(pixels + i * per_image, image, per_image);
        stbi_image_free(image);
    }
}

static int ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && strcmp(s + n - m, suffix) == 0;
}

// A statistics tensor of the given shape as double into *out (allocated).
static void read_stats_tensor(const FeatureSet *s, const char *name, int64_t rows, int64_t cols, double **out) {
    const SafeTensor *t = safetensors_find(&s->stats, name);
    if (!t || t->numel != rows * cols || t->shape[0] != rows)
        unet_die("%s: %s is missing or misshapen (not a statistics file of this evaluate?)", s->path, name);
    *out = malloc(t->numel * sizeof(double));
    if (!*out) unet_die("out of memory");
    int r = safetensors_get_double(t, *out);
    if (r) unet_die(r == -2 ? "%s: %s holds NaN or infinite values" : "%s: %s is not F64 or F32", s->path, name);
}

static void open_stats(FeatureSet *s) {
    char err[1024];
    if (safetensors_open(s->path, &s->stats, err, sizeof err) != 0) unet_die("%s", err);
    const char *kind = safetensors_metadata(&s->stats, "kind"), *score = safetensors_metadata(&s->stats, "inception_score");
    if (!kind || strcmp(kind, STATS_KIND) != 0) unet_die("%s is not a statistics file of evaluate --save_stats (its kind is not %s)", s->path, STATS_KIND);
    const SafeTensor *pool = safetensors_find(&s->stats, "pool");
    if (!pool || pool->ndim != 2 || pool->shape[1] != UNET_INCEPTION_FEATURES || strcmp(pool->dtype, "F32") != 0)
        unet_die("%s: pool must be [N, %d] F32", s->path, UNET_INCEPTION_FEATURES);
    s->count = pool->shape[0];
    s->pool = malloc(pool->numel * sizeof(float));
    if (!s->pool) unet_die("out of memory");
    if (safetensors_get_float(pool, s->pool) != 0) unet_die("%s: pool holds NaN or infinite values", s->path);
    read_stats_tensor(s, "mu", UNET_INCEPTION_FEATURES, 1, &s->mu);
    read_stats_tensor(s, "sigma", UNET_INCEPTION_FEATURES, UNET_INCEPTION_FEATURES, &s->sigma);
    read_stats_tensor(s, "mu_s", UNET_INCEPTION_SPATIAL, 1, &s->mu_s);
    read_stats_tensor(s, "sigma_s", UNET_INCEPTION_SPATIAL, UNET_INCEPTION_SPATIAL, &s->sigma_s);
    s->inception_score = score ? strtod(score, NULL) : NAN;
    s->is_stats = 1;
}

// guided-diffusion's sample and reference batches (image_sample.py's samples_NxHxWx3.npz, the
// evaluator's VIRTUAL_*.npz): np.savez's zip of stored .npy files, the images in arr_0, uint8
// [N][H][W][C] in C order (C = 1, 3 or 4), read in place from the mapped file.
static void open_npz(FeatureSet *s) {
    char err[1024];
    if (map_regular_file(s->path, "batch", &s->npz, err, sizeof err) != 0) unet_die("%s", err);
    ZipEntry *entries;
    int n;
    if (zip_read(s->npz.bytes, s->npz.size, &entries, &n, err, sizeof err) != 0) unet_die("%s: %s", s->path, err);
    const ZipEntry *arr = zip_find(entries, n, "arr_0.npy");
    if (!arr) unet_die("%s holds no arr_0.npy: not an image batch as guided-diffusion writes them (np.savez of [N, H, W, 3] uint8)", s->path);
    const uint8_t *npy = s->npz.bytes + arr->begin;
    uint64_t size = arr->size, header_len = 0, at = 0;
    if (size >= 10 && memcmp(npy, "\x93NUMPY", 6) == 0)  // version 1: a 2-byte header length; 2 and 3: 4 bytes
        header_len = npy[6] == 1 ? (uint64_t)npy[8] | (uint64_t)npy[9] << 8
                                 : size >= 12 ? (uint64_t)npy[8] | (uint64_t)npy[9] << 8 | (uint64_t)npy[10] << 16 | (uint64_t)npy[11] << 24 : 0,
        at = npy[6] == 1 ? 10 : 12;
    if (!header_len || header_len > 4096 || at + header_len > size) unet_die("%s: arr_0.npy is not a .npy array", s->path);
    char header[4097];
    memcpy(header, npy + at, header_len);
    header[header_len] = '\0';
    for (char *c = header; *c; c++)  // shown in an error line: printable, one line
        if (*c < 0x20 || *c == 0x7f) *c = ' ';
    for (size_t len = strlen(header); len && header[len - 1] == ' ';) header[--len] = '\0';
    const char *shape = strstr(header, "'shape': (");
    long long dims[5] = {0};
    int ndim = 0;
    for (const char *p = shape ? shape + 10 : NULL; p && ndim < 5 && *p != ')';) {
        char *end;
        dims[ndim] = strtoll(p, &end, 10);
        if (end == p) break;
        ndim++, p = end + strspn(end, ", ");
    }
    if (!strstr(header, "'descr': '|u1'") || !strstr(header, "'fortran_order': False") || ndim != 4 ||
        !(dims[3] == 1 || dims[3] == 3 || dims[3] == 4) || dims[0] < 1 || dims[1] < 1 || dims[2] < 1 || dims[1] > 8192 || dims[2] > 8192)
        unet_die("%s: arr_0 must be uint8 [N, H, W, C] in C order, C 1, 3 or 4; its header says %s", s->path, header);
    uint64_t bytes = (uint64_t)dims[0] * dims[1] * dims[2] * dims[3];
    if (bytes / dims[0] != (uint64_t)(dims[1] * dims[2] * dims[3]) || bytes > size - at - header_len)
        unet_die("%s: arr_0 holds fewer bytes than its shape [%lld, %lld, %lld, %lld] needs", s->path, dims[0], dims[1], dims[2], dims[3]);
    s->pixels = npy + at + header_len;
    s->count = dims[0], s->height = (int)dims[1], s->width = (int)dims[2], s->channels = (int)dims[3];
    free(entries);
}

// Opens a set (no GPU yet): a statistics file, a folder of images, guided-diffusion's .npz batch or a dataset .bin.
static void open_set(FeatureSet *s, const char *path, long long num) {
    memset(s, 0, sizeof *s);
    s->path = path;
    s->inception_score = NAN;
    struct stat st;
    char err[1024];
    if (stat(path, &st) != 0) unet_die("cannot open %s: %s", path, strerror(errno));
    if (S_ISDIR(st.st_mode)) return open_folder(s, num);
    if (ends_with(path, ".stats")) return open_stats(s);
    if (ends_with(path, ".npz")) open_npz(s);
    else {
        if (dataset_open(path, &s->data, err, sizeof err) != 0)
            unet_die("%s (a set is a dataset .bin, a folder of images, a batch .npz or a .stats file of evaluate --save_stats)", err);
        s->pixels = s->data.pixels, s->count = s->data.header.count, s->height = s->data.header.height, s->width = s->data.header.width;
        s->channels = s->data.header.channels;
    }
    if (num && s->count > num) s->count = num;
}

// A set's features, a chunk of images at a time (a folder's decoded into a buffer).
static void compute_features(FeatureSet *s, UnetInception *net, int batch, int want_logits) {
    size_t per_image = (size_t)s->height * s->width * s->channels;
    s->pool = malloc(s->count * UNET_INCEPTION_FEATURES * sizeof(float));
    s->spatial = malloc(s->count * UNET_INCEPTION_SPATIAL * sizeof(float));
    s->logits = want_logits ? malloc(s->count * UNET_INCEPTION_CLASSES * sizeof(float)) : NULL;
    int chunk = s->files ? 4 * batch : (int)(s->count < (1 << 30) ? s->count : (1 << 30));
    uint8_t *decoded = s->files ? malloc(chunk * per_image) : NULL;
    if (!s->pool || !s->spatial || (want_logits && !s->logits) || (s->files && !decoded)) unet_die("out of memory");
    double start = now_seconds();
    char err[1024];
    for (int64_t first = 0; first < s->count; first += chunk) {
        int n = s->count - first < chunk ? (int)(s->count - first) : chunk;
        const uint8_t *pixels = s->pixels + first * per_image;
        if (s->files) read_folder_images(s, first, n, decoded), pixels = decoded;
        if (unet_inception_features(net, pixels, n, s->height, s->width, s->channels, batch, s->pool + first * UNET_INCEPTION_FEATURES,
                                    s->spatial + first * UNET_INCEPTION_SPATIAL,
                                    want_logits ? s->logits + first * UNET_INCEPTION_CLASSES : NULL, err, sizeof err) != 0)
            unet_die("%s", err);
    }
    double seconds = now_seconds() - start;
    fprintf(stderr, "evaluate: %s: the features of %lld images of %dx%d in %.2f s (%.0f images/s)\n", s->path, (long long)s->count,
            s->width, s->height, seconds, s->count / seconds);
    free(decoded);
}

// FID's and sFID's statistics of a set's features, and its Inception Score when it has logits.
static void compute_statistics(FeatureSet *s) {
    char err[1024];
    s->mu = malloc(UNET_INCEPTION_FEATURES * sizeof(double));
    s->sigma = malloc((size_t)UNET_INCEPTION_FEATURES * UNET_INCEPTION_FEATURES * sizeof(double));
    s->mu_s = malloc(UNET_INCEPTION_SPATIAL * sizeof(double));
    s->sigma_s = malloc((size_t)UNET_INCEPTION_SPATIAL * UNET_INCEPTION_SPATIAL * sizeof(double));
    if (!s->mu || !s->sigma || !s->mu_s || !s->sigma_s) unet_die("out of memory");
    if (unet_feature_statistics(s->pool, s->count, UNET_INCEPTION_FEATURES, s->mu, s->sigma, err, sizeof err) != 0 ||
        unet_feature_statistics(s->spatial, s->count, UNET_INCEPTION_SPATIAL, s->mu_s, s->sigma_s, err, sizeof err) != 0)
        unet_die("%s", err);
    if (s->logits) s->inception_score = inception_score(s->logits, s->count, UNET_INCEPTION_CLASSES, INCEPTION_SCORE_SPLIT);
}

static void save_stats(const FeatureSet *s, const char *path, const char *inception) {
    int f = UNET_INCEPTION_FEATURES, sp = UNET_INCEPTION_SPATIAL, n = (int)s->count;
    int mu_shape[1] = {f}, sigma_shape[2] = {f, f}, mu_s_shape[1] = {sp}, sigma_s_shape[2] = {sp, sp}, pool_shape[2] = {n, f};
    SafeTensorOut tensors[5] = {
        {"mu", 1, mu_shape, f, NULL, s->mu},
        {"sigma", 2, sigma_shape, (int64_t)f * f, NULL, s->sigma},
        {"mu_s", 1, mu_s_shape, sp, NULL, s->mu_s},
        {"sigma_s", 2, sigma_s_shape, (int64_t)sp * sp, NULL, s->sigma_s},
        {"pool", 2, pool_shape, s->count * f, s->pool, NULL},
    };
    char images[32], score[40];
    snprintf(images, sizeof images, "%lld", (long long)s->count);
    snprintf(score, sizeof score, "%.17g", s->inception_score);
    const char *slash = strrchr(inception, '/');
    MetaPair meta[5] = {{"kind", STATS_KIND}, {"images", images}, {"source", s->path}, {"inception", slash ? slash + 1 : inception},
                        {"inception_score", score}};
    char tmp[4200];  // written whole under a temporary name, then renamed: never a partial file
    snprintf(tmp, sizeof tmp, "%.4000s.tmp.%d", path, (int)getpid());
    if (safetensors_write(tmp, tensors, 5, meta, 5) != 0 || rename(tmp, path) != 0) {
        int e = errno;
        unlink(tmp);
        unet_die("cannot write %s: %s", path, strerror(e));
    }
}

// Any number of images the metrics are defined for, as guided-diffusion's evaluator takes: a
// covariance (FID's, of fewer images than features a singular one, which frechet_distance takes as
// it is) and precision and recall's NEIGHBOURS nearest neighbours besides an image itself.
static void check_count(const FeatureSet *s, const char *option) {
    if (s->count <= NEIGHBOURS)
        unet_die("%s %s holds %lld images: precision and recall need more than %d (their nearest neighbours)", option, s->path,
                 (long long)s->count, NEIGHBOURS);
}

int main(int argc, char **argv) {
    signal(SIGXFSZ, SIG_IGN);  // a write past the file-size limit fails (EFBIG) and is said
    Options o = parse_options(argc, argv);
    FeatureSet ref, sample;
    open_set(&ref, o.ref, o.num);
    check_count(&ref, "--ref");
    if (o.save_stats && ref.is_stats) unet_die("--ref %s is already a statistics file", o.ref);
    if (o.sample) {
        open_set(&sample, o.sample, o.num);
        check_count(&sample, "--sample");
    }
    UnetInception *net = NULL;
    int batch = o.batch;
    char err[1024];
    double start = now_seconds();
    if (!ref.is_stats || (o.sample && !sample.is_stats)) {
        net = unet_inception_open(o.inception, err, sizeof err);
        if (!net) unet_die("%s", err);
        profile_phase("the Inception weights read", start), start = now_seconds();
        if (!batch) {  // (which starts the GPU; with --batch, the first features do)
            if (!(batch = unet_inception_max_batch(net, 200, err, sizeof err))) unet_die("%s", err);
            profile_phase("the GPU ready", start);
        }
    }
    if (!ref.is_stats) {
        compute_features(&ref, net, batch, o.save_stats != NULL);
        start = now_seconds();
        compute_statistics(&ref);
        profile_phase("the reference's statistics", start);
    }
    if (o.save_stats) {
        save_stats(&ref, o.save_stats, o.inception);
        printf("evaluate: wrote the statistics of %lld images of %s to %s\n", (long long)ref.count, o.ref, o.save_stats);
        return 0;
    }
    if (!sample.is_stats) {
        compute_features(&sample, net, batch, 1);
        start = now_seconds();
        compute_statistics(&sample);
        profile_phase("the samples' statistics", start);
    }
    unet_inception_close(net);
    double metrics_start = now_seconds(), fid, sfid, precision, recall;
    if (unet_frechet_distance(ref.mu, ref.sigma, sample.mu, sample.sigma, UNET_INCEPTION_FEATURES, &fid, err, sizeof err) != 0 ||
        unet_frechet_distance(ref.mu_s, ref.sigma_s, sample.mu_s, sample.sigma_s, UNET_INCEPTION_SPATIAL, &sfid, err, sizeof err) != 0)
        unet_die("%s", err);
    profile_phase("FID and sFID", metrics_start);
    if (unet_precision_recall(ref.pool, ref.count, sample.pool, sample.count, UNET_INCEPTION_FEATURES, NEIGHBOURS, MANIFOLD_BLOCK, &precision,
                              &recall, err, sizeof err) != 0)
        unet_die("%s", err);
    fprintf(stderr, "evaluate: FID, sFID, precision and recall in %.2f s\n", now_seconds() - metrics_start);
    if (o.json)
        printf("{\"inception_score\": %.10g, \"fid\": %.10g, \"sfid\": %.10g, \"precision\": %.10g, \"recall\": %.10g}\n",
               sample.inception_score, fid, sfid, precision, recall);
    else
        printf("Inception Score: %.4f\nFID: %.4f\nsFID: %.4f\nPrecision: %.4f\nRecall: %.4f\n", sample.inception_score, fid, sfid, precision,
               recall);
    return 0;
}
