// prepare_data.c: turns a folder of images, or the bundled synthetic dataset, into a dataset .bin
// (the format is defined in dataset.h) for train_unet.
//
//   ./prepare_data --input DIR --output FILE.bin [--size 64] [--labels] [--keep_duplicates] [--quiet]
//   ./prepare_data --synthetic shapes --output FILE.bin [--count 10000] [--size 64] [--seed 1]
//
// Folder mode decodes every regular file under DIR with stb_image (JPEG, PNG, BMP, GIF's first
// frame, TGA, PSD, HDR, PNM); a file it cannot read, or an image of more than MAX_PIXELS pixels, is
// skipped with one warning. A file or folder (by device and inode) reached again through a link or
// a hard link is used once and counted as a duplicate, unless --keep_duplicates. Each image becomes
// size x size RGB as guided-diffusion's loader makes it (center_crop_arr: PIL's BOX halvings and
// bicubic resize, written out here, then the centre), or with --resize srgb centre-cropped to a
// square, composited over white where it has alpha and resized in linear light. With --labels, an
// image's class is its first-level folder.
//
// Exit status (the convention of the project's three programs): 0 when done, and for the usage
// (no arguments, -h, --help) on stdout; 2 for a usage error (an unknown option, a bad or missing
// value, options that do not go together); 1 for any other error (an unreadable input, no usable
// image, an output that cannot be written). Errors are one line on stderr.
//
// The dataset is written to FILE.bin.tmp.PID next to FILE.bin and renamed over it only once it is
// complete and synced, so an error or an interrupt never leaves a partial dataset behind. An
// output that is not a regular file, or that is one of the input files, is refused.
#include <dirent.h>
#include <limits.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <time.h>

#include <stb_image.h>
#include <stb_image_resize.h>

#include "data/shapes.h"
#include "cli.h"
#include "dataset.h"

#define MIN_SIDE 8
#define MAX_COUNT 1000000000ull  // --count limit for synthetic datasets
#define MAX_PIXELS (1ull << 26)  // larger input images (more than 8192x8192) are skipped undecoded
#define MAX_JOBS 1024
#define SLOTS_PER_JOB 16         // images a decoding thread has room for in the ring (see Ring)

static const char usage[] =
    "usage: prepare_data --input DIR --output FILE.bin [--size N] [--resize gd|srgb]\n"
    "                    [--jobs N] [--labels [folders|gd]] [--keep_duplicates]\n"
    "                    [--part K/N] [--quiet]\n"
    "       prepare_data --synthetic shapes --output FILE.bin [--count N] [--size N]\n"
    "                    [--seed K]\n"
    "\n"
    "Writes a dataset file for train_unet.\n"
    "  --input DIR        folder of images, searched recursively in sorted order\n"
    "                     (hidden files and folders are skipped); every file\n"
    "                     stb_image can read is used: JPEG, PNG, BMP, GIF (first\n"
    "                     frame), TGA, PSD, HDR, PNM. Unreadable files, and images of\n"
    "                     more than 2^26 pixels (8192x8192), are skipped with a\n"
    "                     warning. Links are followed; each distinct file and folder\n"
    "                     is used once: a second path to one (a symbolic or a hard\n"
    "                     link) is skipped and counted as a duplicate\n"
    "  --keep_duplicates  use a file once for every path to it, walking linked\n"
    "                     folders again (a link back to a folder that contains it is\n"
    "                     still skipped)\n"
    "  --labels [folders|gd]  an image's class: the name of its first-level folder\n"
    "                     under DIR (folders); or, as guided-diffusion's loader, its\n"
    "                     file name's part before the first _ (gd: ImageNet's\n"
    "                     n01440764_10026.JPEG is class n01440764), the classes\n"
    "                     numbered in sorted order\n"
    "  --synthetic shapes the bundled synthetic dataset (circles, squares, triangles;\n"
    "                     labelled)\n"
    "  --count N          synthetic images to write [10000]\n"
    "  --seed K           synthetic dataset seed [1]\n"
    "  --size N           side of the square output images, 8..8192 [64]\n"
    "  --jobs N           images decoded and resized at once, on N threads; the\n"
    "                     output is the same for any N [every core]\n"
    "  --resize gd|srgb   gd: guided-diffusion's center_crop_arr, PIL's pixels (the\n"
    "                     short side halved with BOX while at least 2N, then bicubic\n"
    "                     to N, then the centre N x N; alpha dropped, as PIL's\n"
    "                     convert(\"RGB\")); srgb: the centre square, alpha over\n"
    "                     white, resized in linear light by stb_image_resize [gd]\n"
    "  --output FILE.bin  the dataset file, replaced atomically (a regular file, not\n"
    "                     an input)\n"
    "  --part K/N         only part K of N (0..N-1) of the sorted files, the K-th\n"
    "                     of N equal runs, and every class of the folder: the N\n"
    "                     parts train as one (train_unet --data p0.bin,p1.bin,...)\n"
    "  --quiet            no progress line\n"
    "  --help, -h         this help\n"
    "  --version          the version\n"
    "\n"
    "A hyphen in an option's name may stand for an underscore (--keep-duplicates).\n"
    "Exit status: 0 done (or this help), 1 an error (unreadable input, no usable\n"
    "image, unwritable output), 2 a usage error (unknown option, bad value).\n";

// The temporary output file: die() and the signal handler remove it while it exists.
static char tmp_path[PATH_MAX];
static volatile sig_atomic_t tmp_live = 0;

static bool show_progress = false;  // progress lines go to stderr (a terminal, and no --quiet)
static bool progress_shown = false;  // a progress line is on the terminal now

// Clears the progress line so that the next message starts on a clean line.
static void end_progress_line(void) {
    if (progress_shown) fputs("\r\033[K", stderr);
    progress_shown = false;
}

// One message line on stderr: "prepare_data: <kind>: ", the message, suffix.
static void print_message(const char *kind, const char *suffix, const char *fmt, va_list args) {
    end_progress_line();
    fprintf(stderr, "prepare_data: %s: ", kind);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "%s\n", suffix);
}

// Prints one error line, removes the temporary output and exits.
static void die(const char *fmt, ...) {
    if (tmp_live) unlink(tmp_path);
    va_list args;
    va_start(args, fmt);
    print_message("error", "", fmt, args);
    va_end(args);
    exit(1);
}

// Prints one usage error line, with a pointer to --help, and exits with status 2. Only the option
// parser calls it: nothing has been written yet.
static void usage_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    print_message("error", " (see --help)", fmt, args);
    va_end(args);
    exit(2);
}

// Prints one warning line.
static void warn(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    print_message("warning", "", fmt, args);
    va_end(args);
}

// On SIGINT, SIGTERM or SIGHUP: removes the temporary output, then dies of the signal as usual
// (the signal raised here is delivered when the handler returns and unblocks it).
static void on_signal(int sig) {
    if (tmp_live) unlink(tmp_path);
    signal(sig, SIG_DFL);
    raise(sig);
}

// malloc that dies when memory runs out (and never returns NULL for 0 bytes).
static void *xmalloc(size_t bytes) {
    void *p = malloc(bytes ? bytes : 1);
    if (!p) die("out of memory (%zu bytes)", bytes);
    return p;
}

// realloc that dies when memory runs out.
static void *xrealloc(void *p, size_t bytes) {
    p = realloc(p, bytes);
    if (!p) die("out of memory (%zu bytes)", bytes);
    return p;
}

// A monotonic clock in seconds, for the progress line.
static double seconds(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

// Shows "done/total", images/s and the time left on the terminal, at most twice a second.
static void progress(uint64_t done, uint64_t total) {
    static double start, last;
    if (!show_progress) return;
    double now = seconds();
    if (start == 0) start = now;
    if (done < total && now - last < 0.5) return;
    last = now;
    double rate = now > start ? done / (now - start) : 0, left = rate > 0 ? (total - done) / rate : 0;
    fprintf(stderr, "\rprepare_data: %llu/%llu images (%.0f%%), %.0f images/s, %dh%02dm%02ds left  ", (unsigned long long)done,
            (unsigned long long)total, 100.0 * done / total, rate, (int)(left / 3600), (int)(left / 60) % 60, (int)left % 60);
    progress_shown = true;
}

// ----------------------------------------------------------------------------
// command line

// How an image becomes size x size: guided-diffusion's center_crop_arr (PIL's filters), or a
// centre square resized in linear light by stb_image_resize.
typedef enum { RESIZE_GD, RESIZE_SRGB } Resize;

typedef struct {
    const char *input, *output, *synthetic;
    uint64_t count, seed;
    int size, jobs;
    int part, parts;  // --part K/N (parts 0: the whole folder)
    Resize resize;
    bool labels, name_labels, quiet, keep_duplicates, count_given, seed_given, resize_given, jobs_given;  // name_labels: --labels gd
} Options;

// Parses a decimal integer in lo..hi given to option `name`, or exits with a usage error.
static uint64_t parse_uint(const char *name, const char *s, uint64_t lo, uint64_t hi) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (s[0] < '0' || s[0] > '9' || *end != '\0' || errno != 0 || v < lo || v > hi)
        usage_error("%s must be an integer in %llu..%llu, not '%s'", name, (unsigned long long)lo,
                    (unsigned long long)hi, s);
    return v;
}

// The options, for the hint that follows an unknown one.
static const char *const option_names[] = {"input", "output", "size", "resize", "jobs", "labels", "keep_duplicates", "quiet",
                                           "synthetic", "count", "seed", "part"};

// The length of the name in option argument arg ("--name" or "--name=value": up to the '=').
static size_t name_length(const char *arg) { return strcspn(arg + 2, "="); }

// Whether arg is option `name` ("--name", "--name=..."; a hyphen in it stands for an underscore).
static bool is_option(const char *arg, const char *name) {
    return strncmp(arg, "--", 2) == 0 && cli_name_is(arg + 2, name_length(arg), name + 2);
}

// If argv[*i] is option `name` ("--name value" or "--name=value"), returns its value, advancing *i
// past it; otherwise returns NULL.
static const char *option_value(int argc, char **argv, int *i, const char *name) {
    if (!is_option(argv[*i], name)) return NULL;
    const char *eq = strchr(argv[*i], '=');
    if (eq) return eq + 1;
    if (*i + 1 >= argc) usage_error("%s needs a value", name);
    return argv[++*i];
}

// Whether arg is the switch `name` (an option without a value); "--name=..." is a usage error.
static bool is_switch(const char *arg, const char *name) {
    if (!is_option(arg, name)) return false;
    if (strchr(arg, '=')) usage_error("%s takes no value", name);
    return true;
}

// Reads the options and checks that they make one consistent request. No arguments, -h or --help
// (anywhere) print the usage on stdout and exit 0, --version the version; a usage error exits 2
// (usage_error).
static Options parse_options(int argc, char **argv) {
    Options o = {.count = 10000, .seed = 1, .size = 64};
    bool help = argc < 2;
    for (int i = 1; i < argc; i++) help |= !strcmp(argv[i], "--help") || !strcmp(argv[i], "-h");
    if (help) {
        fputs(usage, stdout);
        exit(0);
    }
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--version")) cli_print_version("prepare_data", NULL), exit(0);
    for (int i = 1; i < argc; i++) {
        const char *v;
        if (is_option(argv[i], "--labels")) {  // --labels [folders], or --labels gd
            const char *eq = strchr(argv[i], '=');
            v = eq ? eq + 1 : i + 1 < argc && (!strcmp(argv[i + 1], "gd") || !strcmp(argv[i + 1], "folders")) ? argv[++i] : "folders";
            if (strcmp(v, "gd") != 0 && strcmp(v, "folders") != 0) usage_error("--labels takes folders or gd, not '%s'", v);
            o.labels = true, o.name_labels = strcmp(v, "gd") == 0;
        } else if (is_switch(argv[i], "--quiet")) {
            o.quiet = true;
        } else if (is_switch(argv[i], "--keep_duplicates")) {
            o.keep_duplicates = true;
        } else if ((v = option_value(argc, argv, &i, "--input"))) {
            o.input = v;
        } else if ((v = option_value(argc, argv, &i, "--output"))) {
            o.output = v;
        } else if ((v = option_value(argc, argv, &i, "--synthetic"))) {
            o.synthetic = v;
        } else if ((v = option_value(argc, argv, &i, "--size"))) {
            o.size = (int)parse_uint("--size", v, MIN_SIDE, DATASET_MAX_SIDE);
        } else if ((v = option_value(argc, argv, &i, "--jobs"))) {
            o.jobs = (int)parse_uint("--jobs", v, 1, MAX_JOBS);
            o.jobs_given = true;
        } else if ((v = option_value(argc, argv, &i, "--resize"))) {
            if (strcmp(v, "gd") != 0 && strcmp(v, "srgb") != 0) usage_error("--resize must be gd or srgb, not '%s'", v);
            o.resize = strcmp(v, "gd") == 0 ? RESIZE_GD : RESIZE_SRGB;
            o.resize_given = true;
        } else if ((v = option_value(argc, argv, &i, "--part"))) {
            const char *slash = strchr(v, '/');
            char k[32];
            if (!slash || (size_t)(slash - v) >= sizeof k) usage_error("--part takes K/N (part K of N, from 0), not '%s'", v);
            snprintf(k, sizeof k, "%.*s", (int)(slash - v), v);
            o.parts = (int)parse_uint("--part's N", slash + 1, 1, DATASET_MAX_PARTS);
            o.part = (int)parse_uint("--part's K", k, 0, (uint64_t)o.parts - 1);
        } else if ((v = option_value(argc, argv, &i, "--count"))) {
            o.count = parse_uint("--count", v, 1, MAX_COUNT);
            o.count_given = true;
        } else if ((v = option_value(argc, argv, &i, "--seed"))) {
            o.seed = parse_uint("--seed", v, 0, UINT64_MAX);
            o.seed_given = true;
        } else if (strncmp(argv[i], "--", 2) == 0) {
            char hint[128];
            size_t len = name_length(argv[i]);
            usage_error("unknown option %.*s%s", (int)len + 2, argv[i],
                        cli_hint(argv[i] + 2, len, option_names, sizeof option_names / sizeof *option_names, hint, sizeof hint));
        } else if (argv[i][0] == '-') {
            usage_error("unknown option %s", argv[i]);
        } else {
            usage_error("unexpected argument '%s'", argv[i]);
        }
    }
    if (o.input && o.synthetic) usage_error("give either --input or --synthetic, not both");
    if (!o.input && !o.synthetic) usage_error("give --input DIR (a folder of images) or --synthetic shapes");
    if (o.input && !o.input[0]) usage_error("--input needs a folder");
    if (o.synthetic && strcmp(o.synthetic, "shapes") != 0)
        usage_error("unknown synthetic dataset '%s' (available: shapes)", o.synthetic);
    if (o.synthetic && o.labels)
        usage_error("--labels applies to --input (the synthetic dataset is always labelled)");
    if (o.synthetic && o.keep_duplicates) usage_error("--keep_duplicates applies only to --input");
    if (o.input && (o.count_given || o.seed_given)) usage_error("--count and --seed apply only to --synthetic");
    if (o.synthetic && (o.resize_given || o.jobs_given || o.parts)) usage_error("--resize, --jobs and --part apply only to --input");
    if (!o.jobs_given) {  // every core
        long cores = sysconf(_SC_NPROCESSORS_ONLN);
        o.jobs = cores < 1 ? 1 : cores > MAX_JOBS ? MAX_JOBS : (int)cores;
    }
    if (!o.output || !o.output[0]) usage_error("--output FILE.bin is required");
    return o;
}

// ----------------------------------------------------------------------------
// finding the image files

// A set of files and folders by identity (device, inode), however many paths lead to each: a hash
// table with open addressing, at most half full.
typedef struct {
    dev_t dev;
    ino_t ino;
    bool used;
} InodeSlot;

typedef struct {
    InodeSlot *slots;
    size_t count, capacity;  // capacity: a power of two
} InodeSet;

// The slot holding (dev, ino), or the free slot where it belongs.
static InodeSlot *inode_slot(InodeSlot *slots, size_t capacity, dev_t dev, ino_t ino) {
    uint64_t h = ((uint64_t)ino ^ (uint64_t)dev * 0x9e3779b97f4a7c15ull) * 0xbf58476d1ce4e5b9ull;
    for (size_t i = (size_t)(h ^ h >> 31) & (capacity - 1);; i = (i + 1) & (capacity - 1))
        if (!slots[i].used || (slots[i].dev == dev && slots[i].ino == ino)) return &slots[i];
}

// Adds the file or folder st describes to the set; returns false if it was there already.
static bool inode_set_add(InodeSet *set, const struct stat *st) {
    if (2 * (set->count + 1) > set->capacity) {
        size_t capacity = set->capacity ? 2 * set->capacity : 1024;
        InodeSlot *slots = calloc(capacity, sizeof *slots);
        if (!slots) die("out of memory");
        for (size_t i = 0; i < set->capacity; i++)
            if (set->slots[i].used)
                *inode_slot(slots, capacity, set->slots[i].dev, set->slots[i].ino) = set->slots[i];
        free(set->slots);
        set->slots = slots, set->capacity = capacity;
    }
    InodeSlot *slot = inode_slot(set->slots, set->capacity, st->st_dev, st->st_ino);
    if (slot->used) return false;
    *slot = (InodeSlot){st->st_dev, st->st_ino, true};
    set->count++;
    return true;
}

// The files found under the input folder, in traversal order, with the class folder of each.
typedef struct {
    char **paths;
    int32_t *classes;  // index into class_names, or -1 without --labels
    bool *repeats;     // with --keep_duplicates: the file was taken before, through another path
    uint64_t count, capacity;
    char **class_names;  // with --labels: the first-level folders, in strcmp order
    uint32_t num_classes;
    uint64_t skipped;            // entries skipped with a warning
    uint64_t duplicate_files;    // files reached again (a link, a hard link): skipped silently,
    uint64_t duplicate_folders;  // folders reached again through a link: not walked again
    bool keep_duplicates;        // --keep_duplicates: take every path to a file, walk every folder link
    InodeSet seen;               // the folders walked and the files taken
    const char *output;          // --output, and its identity when it exists already (else NULL)
    const struct stat *output_st;
} FileList;

// A folder on the way from the input folder down to the one being scanned, to detect symlink loops.
typedef struct Ancestor {
    dev_t dev;
    ino_t ino;
    const struct Ancestor *up;
} Ancestor;

// scandir's order (strcmp: bytewise, the same in every locale) and filter (no hidden entries).
static int by_name(const struct dirent **a, const struct dirent **b) { return strcmp((*a)->d_name, (*b)->d_name); }
static int not_hidden(const struct dirent *e) { return e->d_name[0] != '.'; }

// dir + "/" + name, newly allocated.
static char *join_path(const char *dir, const char *name) {
    size_t n = strlen(dir), bytes = n + strlen(name) + 2;
    char *path = xmalloc(bytes);
    snprintf(path, bytes, "%s%s%s", dir, n && dir[n - 1] == '/' ? "" : "/", name);
    return path;
}

// Adds the regular files under dir to the list, entries in strcmp order, depth first. Symlinks are
// followed; a folder being scanned already (a loop) is skipped with a warning, and a folder or file
// reached a second time (a link to one seen before, a hard link: the same device and inode) is
// skipped silently and counted: the first path in this order is the one used. With
// --keep_duplicates every path is taken (folders reached again are walked again, files reached
// again are marked as repeats), loops still excepted. Dies if a file is the existing output:
// writing it would destroy an input.
// With --labels, each folder directly under the input (depth 0) is a class and files directly in
// the input are skipped.
static void scan_folder(FileList *list, const char *dir, const Ancestor *up, int depth, int32_t cls, bool labels) {
    struct dirent **entries;
    int n = scandir(dir, &entries, not_hidden, by_name);
    if (n < 0) {
        if (depth == 0) die("cannot read input folder %s: %s", dir, strerror(errno));
        warn("skipping %s: cannot read folder: %s", dir, strerror(errno));
        list->skipped++;
        return;
    }
    for (int i = 0; i < n; i++) {
        char *path = join_path(dir, entries[i]->d_name);
        struct stat st;
        bool keep = false;
        if (stat(path, &st) != 0) {
            warn("skipping %s: %s", path, strerror(errno));
            list->skipped++;
        } else if (S_ISDIR(st.st_mode)) {
            bool loop = false;
            for (const Ancestor *a = up; a; a = a->up) loop |= a->dev == st.st_dev && a->ino == st.st_ino;
            if (loop) {
                warn("skipping %s: a link back to a folder that contains it", path);
                list->skipped++;
            } else if (!inode_set_add(&list->seen, &st) && !list->keep_duplicates) {
                list->duplicate_folders++;
            } else {
                int32_t sub_cls = cls;
                if (labels && depth == 0) {
                    list->class_names = xrealloc(list->class_names, (list->num_classes + 1) * sizeof(char *));
                    list->class_names[list->num_classes] = strcpy(xmalloc(strlen(entries[i]->d_name) + 1),
                                                                  entries[i]->d_name);
                    sub_cls = (int32_t)list->num_classes++;
                }
                Ancestor here = {st.st_dev, st.st_ino, up};
                scan_folder(list, path, &here, depth + 1, sub_cls, labels);
            }
        } else if (!S_ISREG(st.st_mode)) {
            warn("skipping %s: not a regular file", path);
            list->skipped++;
        } else if (list->output_st && st.st_ino == list->output_st->st_ino && st.st_dev == list->output_st->st_dev) {
            die("output %s is the input file %s: give another --output", list->output, path);
        } else if (labels && depth == 0) {
            warn("skipping %s: not in a class folder (with --labels, an image's class is its first-level folder)",
                 path);
            list->skipped++;
        } else {
            bool repeat = !inode_set_add(&list->seen, &st);
            if (repeat && !list->keep_duplicates) {
                list->duplicate_files++;
            } else {
                if (list->count == list->capacity) {
                    list->capacity = list->capacity ? 2 * list->capacity : 1024;
                    list->paths = xrealloc(list->paths, list->capacity * sizeof(char *));
                    list->classes = xrealloc(list->classes, list->capacity * sizeof(int32_t));
                    list->repeats = xrealloc(list->repeats, list->capacity * sizeof(bool));
                }
                list->paths[list->count] = path;
                list->repeats[list->count] = repeat;
                list->classes[list->count++] = cls;
                keep = true;
            }
        }
        if (!keep) free(path);
        free(entries[i]);
    }
    free(entries);
}

// ----------------------------------------------------------------------------
// decoding and resizing one image

// The sRGB transfer function and its inverse: linear light in [0,1] <-> 8-bit sRGB.
static float srgb_to_linear[256];

static void init_srgb_table(void) {
    for (int i = 0; i < 256; i++) {
        float c = i / 255.0f;
        srgb_to_linear[i] = c <= 0.04045f ? c / 12.92f : powf((c + 0.055f) / 1.055f, 2.4f);
    }
}

static uint8_t linear_to_srgb(float x) {
    float c = x <= 0.0031308f ? 12.92f * x : 1.055f * powf(x, 1 / 2.4f) - 0.055f;
    return (uint8_t)(c * 255.0f + 0.5f);
}

// Composites the side x side RGBA square at src (stride bytes per row) over white into RGB. The
// blend is done in linear light, where the sRGB resize also blends: compositing first and then
// resizing gives the same result as resizing with alpha and compositing afterwards.
static void composite_on_white(const uint8_t *src, size_t stride, int side, uint8_t *rgb) {
    for (int y = 0; y < side; y++) {
        for (int x = 0; x < side; x++) {
            const uint8_t *p = src + y * stride + 4 * x;
            uint8_t *q = rgb + 3 * ((size_t)y * side + x);
            float a = p[3] / 255.0f;
            for (int c = 0; c < 3; c++)
                q[c] = p[3] == 255 ? p[c] : linear_to_srgb(a * srgb_to_linear[p[c]] + (1.0f - a));
        }
    }
}

// The size a binary PNM file (P5 grey, P6 RGB) of w x h pixels must have: its header, then the
// pixels, 1 or 3 samples each of 1 byte (maxval up to 255) or 2; 0 for other formats. The header
// is read as stb_image reads it: whitespace and # comments before each of width, height and
// maxval, and one byte after maxval. Leaves f at its start.
static uint64_t pnm_file_bytes(FILE *f, int w, int h) {
    rewind(f);
    int p = getc(f), t = getc(f);
    if (p != 'P' || (t != '5' && t != '6')) return rewind(f), 0;
    uint64_t value = 0;  // the last number read: maxval
    int c = getc(f);
    for (int number = 0; number < 3; number++) {
        while (c == '#' || c == ' ' || (c >= '\t' && c <= '\r')) {
            if (c == '#')
                while (c != EOF && c != '\n' && c != '\r') c = getc(f);
            else
                c = getc(f);
        }
        for (value = 0; c >= '0' && c <= '9'; c = getc(f))
            if (value <= 65535) value = 10 * value + (uint64_t)(c - '0');
    }
    uint64_t header = (uint64_t)ftell(f);  // a regular file: ftell does not fail
    rewind(f);
    return header + (uint64_t)w * (uint64_t)h * (t == '6' ? 3 : 1) * (value > 255 ? 2 : 1);
}

// Checks an image file before stb_image decodes it, for what stb does not check: the size (stb
// allocates and fills whatever a header claims: 19 bytes of PPM header can cost gigabytes and
// seconds), and for binary PNM, that the pixels the header promises are all there (stb ignores a
// short read, and the missing pixels would be whatever the heap held). Returns 0, or -1 with the
// reason in why.
static int check_before_decoding(FILE *f, char *why, size_t why_len) {
    int w, h, channels;
    if (!stbi_info_from_file(f, &w, &h, &channels))
        return snprintf(why, why_len, "stb_image cannot decode it (%s)", stbi_failure_reason()), -1;
    if ((uint64_t)w * (uint64_t)h > MAX_PIXELS)
        return snprintf(why, why_len, "%dx%d pixels, more than the limit of %llu (8192x8192)", w, h, MAX_PIXELS), -1;
    struct stat st;
    if (fstat(fileno(f), &st) != 0) return snprintf(why, why_len, "%s", strerror(errno)), -1;
    uint64_t need = pnm_file_bytes(f, w, h);
    if (need > (uint64_t)st.st_size)
        return snprintf(why, why_len, "truncated: %dx%d pixels need %llu bytes, the file has %lld", w, h,
                        (unsigned long long)need, (long long)st.st_size),
               -1;
    return 0;
}

// PIL's resampling (Pillow's Resample.c, as Image.resize runs it on an RGB image), written out so
// that guided-diffusion's preprocessing gives its pixels here: separable, the rows first (only
// those the columns' pass reads) into an 8-bit image, then the columns. Each output pixel's
// weights, for a filter of support s stretched by f = max(in / out, 1), centre c = (i + 0.5) in/out:
// the inputs j from (int)(c - s f + 0.5) (at least 0) to (int)(c + s f + 0.5) (at most in), each
// filter((j - c + 0.5) / f), normalised to sum 1, then to fixed point with 22 fraction bits
// (rounded half away from 0); a pixel is (2^21 + sum of weight * input) >> 22, clamped to 0..255.
typedef enum { PIL_BOX, PIL_BICUBIC } PilFilter;

static double pil_filter(PilFilter f, double x) {
    if (f == PIL_BOX) return x > -0.5 && x <= 0.5 ? 1.0 : 0.0;
    const double a = -0.5;  // Pillow's bicubic
    if (x < 0.0) x = -x;
    if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
    if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
    return 0.0;
}

#define PIL_PRECISION_BITS 22

// One axis's weights: for output i, taps[i] inputs from first[i], their weights at k + i * ksize.
// Returns ksize.
static int pil_coefficients(int in, int out, PilFilter f, int **first, int **taps, int32_t **weights) {
    double scale = (double)in / out, filterscale = scale < 1.0 ? 1.0 : scale;
    double support = (f == PIL_BOX ? 0.5 : 2.0) * filterscale;
    int ksize = (int)ceil(support) * 2 + 1;
    double *k = xmalloc((size_t)ksize * sizeof(double));
    *first = xmalloc((size_t)out * sizeof(int)), *taps = xmalloc((size_t)out * sizeof(int));
    *weights = xmalloc((size_t)out * ksize * sizeof(int32_t));
    for (int i = 0; i < out; i++) {
        double center = (i + 0.5) * scale, sum = 0.0;
        int lo = (int)(center - support + 0.5), hi = (int)(center + support + 0.5);
        if (lo < 0) lo = 0;
        if (hi > in) hi = in;
        for (int j = 0; j < hi - lo; j++) sum += k[j] = pil_filter(f, (j + lo - center + 0.5) / filterscale);
        for (int j = 0; j < ksize; j++) {
            double w = j < hi - lo ? (sum != 0.0 ? k[j] / sum : k[j]) : 0.0;
            (*weights)[(size_t)i * ksize + j] = (int32_t)(w < 0 ? -0.5 + w * (1 << PIL_PRECISION_BITS) : 0.5 + w * (1 << PIL_PRECISION_BITS));
        }
        (*first)[i] = lo, (*taps)[i] = hi - lo;
    }
    free(k);
    return ksize;
}

static uint8_t pil_clip8(int32_t v) {
    v >>= PIL_PRECISION_BITS;  // (an arithmetic shift: negative sums give 0)
    return v < 0 ? 0 : v > 255 ? 255 : (uint8_t)v;
}

// Resizes w x h RGB at in to ow x oh RGB at out (not the same memory) as PIL's Image.resize.
static void pil_resize(const uint8_t *in, int w, int h, uint8_t *out, int ow, int oh, PilFilter f) {
    if (w == ow && h == oh) {  // Image.resize returns a copy
        memcpy(out, in, (size_t)w * h * 3);
        return;
    }
    int *x_first, *x_taps, *y_first, *y_taps;
    int32_t *xk, *yk;
    int xks = pil_coefficients(w, ow, f, &x_first, &x_taps, &xk), yks = pil_coefficients(h, oh, f, &y_first, &y_taps, &yk);
    int row0 = oh ? y_first[0] : 0, rows = oh ? y_first[oh - 1] + y_taps[oh - 1] - row0 : 0;
    const uint8_t *src = in + (size_t)row0 * w * 3;
    uint8_t *wide = NULL;  // the rows pass: rows x ow
    if (ow != w) {
        wide = xmalloc((size_t)rows * ow * 3);
        for (int y = 0; y < rows; y++)
            for (int x = 0; x < ow; x++)
                for (int c = 0; c < 3; c++) {
                    int32_t sum = 1 << (PIL_PRECISION_BITS - 1);
                    const int32_t *k = xk + (size_t)x * xks;
                    for (int j = 0; j < x_taps[x]; j++) sum += src[((size_t)y * w + x_first[x] + j) * 3 + c] * k[j];
                    wide[((size_t)y * ow + x) * 3 + c] = pil_clip8(sum);
                }
        src = wide;
    }
    if (oh != h) {
        for (int y = 0; y < oh; y++)
            for (int x = 0; x < ow; x++)
                for (int c = 0; c < 3; c++) {
                    int32_t sum = 1 << (PIL_PRECISION_BITS - 1);
                    const int32_t *k = yk + (size_t)y * yks;
                    for (int j = 0; j < y_taps[y]; j++) sum += src[((size_t)(y_first[y] - row0 + j) * ow + x) * 3 + c] * k[j];
                    out[((size_t)y * ow + x) * 3 + c] = pil_clip8(sum);
                }
    } else {
        memcpy(out, src, (size_t)oh * ow * 3);
    }
    free(wide), free(x_first), free(x_taps), free(y_first), free(y_taps), free(xk), free(yk);
}

// guided-diffusion's center_crop_arr (image_datasets.py) on w x h RGB: while the short
// side is at least twice size, both sides halved (w // 2, h // 2) with Image.BOX; then both scaled
// by size / short side (Python's round, half to even) with Image.BICUBIC; then the centre
// size x size, from ((h' - size) // 2, (w' - size) // 2). Writes out.
static void gd_center_crop(const uint8_t *rgb, int w, int h, int size, uint8_t *out) {
    uint8_t *owned = NULL;  // rgb once halved
    while ((w < h ? w : h) >= 2 * size) {
        uint8_t *half = xmalloc((size_t)(w / 2) * (h / 2) * 3);
        pil_resize(rgb, w, h, half, w / 2, h / 2, PIL_BOX);
        free(owned);
        rgb = owned = half, w /= 2, h /= 2;
    }
    double scale = (double)size / (w < h ? w : h);
    int sw = (int)nearbyint(w * scale), sh = (int)nearbyint(h * scale);
    if (sw < size) sw = size;  // (a rounding below size, which center_crop_arr would not survive)
    if (sh < size) sh = size;
    uint8_t *scaled = xmalloc((size_t)sw * sh * 3);
    pil_resize(rgb, w, h, scaled, sw, sh, PIL_BICUBIC);
    free(owned);
    int y0 = (sh - size) / 2, x0 = (sw - size) / 2;
    for (int y = 0; y < size; y++) memcpy(out + (size_t)y * size * 3, scaled + ((size_t)(y0 + y) * sw + x0) * 3, (size_t)size * 3);
    free(scaled);
}

// Decodes an image file into size x size RGB. RESIZE_GD: gd_center_crop of its RGB (alpha dropped,
// as guided-diffusion's PIL convert("RGB")). RESIZE_SRGB: centre crop to a square (the longer side
// is cut equally at both ends), alpha composited over white, then resized with stb_image_resize in
// linear light (Mitchell filter when shrinking, Catmull-Rom when enlarging; a crop that has the
// requested size already is copied unfiltered). stb_image gives 8 bits per channel: 16-bit images
// keep their high byte, grey is expanded to RGB, HDR is clamped to [0,1] and encoded with gamma
// 2.2, CMYK JPEGs are converted without a colour profile. Returns 0, or -1 with the reason in why.
static int load_square(const char *path, int size, Resize resize, uint8_t *out, char *why, size_t why_len) {
    FILE *f = fopen(path, "rb");
    if (!f) return snprintf(why, why_len, "%s", strerror(errno)), -1;
    if (check_before_decoding(f, why, why_len) != 0) return fclose(f), -1;
    int w, h, channels;
    if (resize == RESIZE_GD) {  // PIL's convert("RGB"): alpha dropped, grey repeated
        uint8_t *rgb = stbi_load_from_file(f, &w, &h, &channels, 3);
        fclose(f);
        if (!rgb) return snprintf(why, why_len, "stb_image cannot decode it (%s)", stbi_failure_reason()), -1;
        gd_center_crop(rgb, w, h, size, out);
        stbi_image_free(rgb);
        return 0;
    }
    uint8_t *rgba = stbi_load_from_file(f, &w, &h, &channels, 4);
    fclose(f);
    if (!rgba) return snprintf(why, why_len, "stb_image cannot decode it (%s)", stbi_failure_reason()), -1;
    int side = w < h ? w : h;
    uint8_t *square = side == size ? out : xmalloc((size_t)side * side * 3);
    composite_on_white(rgba + 4 * ((size_t)(h - side) / 2 * w + (w - side) / 2), 4 * (size_t)w, side, square);
    stbi_image_free(rgba);
    if (square == out) return 0;  // already the right size: kept as it is, not filtered
    int ok = stbir_resize_uint8_srgb(square, side, side, 0, out, size, size, 0, 3, STBIR_ALPHA_CHANNEL_NONE, 0);
    free(square);
    if (!ok) return snprintf(why, why_len, "out of memory while resizing a %dx%d image", w, h), -1;
    return 0;
}

// ----------------------------------------------------------------------------
// writing the dataset file

// A dataset being written: a temporary file next to the output, renamed over it when complete.
typedef struct {
    const char *path;       // the final name
    char folder[PATH_MAX];  // the folder it is in, synced after the rename
    int fd;
    uint64_t pixels_at;     // where image 0 goes until the header is known (see output_finish)
    uint64_t image_bytes;
} Output;

// The header of a dataset of count size x size RGB images.
static DatasetHeader make_header(uint64_t count, int size, uint32_t num_classes, uint32_t names_bytes) {
    DatasetHeader h = {0};
    memcpy(h.magic, DATASET_MAGIC, 8);
    h.version = DATASET_VERSION;
    h.channels = 3;
    h.count = count;
    h.height = h.width = (uint32_t)size;
    h.num_classes = num_classes;
    h.names_bytes = names_bytes;
    return h;
}

// Checks a header that is about to be written and returns its layout, or dies.
static DatasetLayout checked_layout(const DatasetHeader *h) {
    DatasetLayout layout;
    char err[256];
    if (dataset_layout(h, &layout, err, sizeof err) != 0) die("%s", err);
    return layout;
}

// The size of the class-name table for these names (each followed by a NUL), or dies if too large.
static uint32_t names_size(const char *const *names, uint32_t n) {
    size_t total = 0;
    for (uint32_t i = 0; i < n; i++) total += strlen(names[i]) + 1;
    if (total > DATASET_MAX_NAMES_BYTES)
        die("class names take %zu bytes, more than the limit of %u", total, DATASET_MAX_NAMES_BYTES);
    return (uint32_t)total;
}

// The class-name table: the names, each followed by a NUL.
static char *names_table(const char *const *names, uint32_t n) {
    char *table = xmalloc(names_size(names, n)), *p = table;
    for (uint32_t i = 0; i < n; i++) p = stpcpy(p, names[i]) + 1;
    return table;
}

// pwrite of all n bytes, or dies.
static void write_at(const Output *out, const void *buf, size_t n, uint64_t at) {
    const uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pwrite(out->fd, p, n, (off_t)at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("cannot write %s: %s", tmp_path, k < 0 ? strerror(errno) : "nothing written");
        p += k, n -= (size_t)k, at += (uint64_t)k;
    }
}

// pread of all n bytes, or dies.
static void read_at(const Output *out, void *buf, size_t n, uint64_t at) {
    uint8_t *p = buf;
    while (n > 0) {
        ssize_t k = pread(out->fd, p, n, (off_t)at);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) die("cannot read back %s: %s", tmp_path, k < 0 ? strerror(errno) : "file is short");
        p += k, n -= (size_t)k, at += (uint64_t)k;
    }
}

// Checks the output before anything is read or written: only a regular file may be replaced (the
// new file would take the place of a folder, a device or a pipe). Returns whether it exists, with
// its identity in st; a path that cannot be examined is left for creating the file to report.
static bool check_output(const char *path, struct stat *st) {
    if (stat(path, st) != 0) return false;
    if (S_ISDIR(st->st_mode)) die("output %s is a folder", path);
    if (!S_ISREG(st->st_mode)) die("output %s is not a regular file (a device, a pipe or a socket)", path);
    return true;
}

// A run killed with SIGKILL cannot remove its temporary file: removes the files FILE.bin.tmp.PID in
// folder whose process no longer exists (kill(pid, 0) fails with ESRCH). The file of a live process,
// another run writing the same output now, is left alone. Best effort: one that cannot be removed
// stays, and does no harm.
static void remove_stale_temps(const char *folder, const char *name) {
    DIR *dir = opendir(folder);
    if (!dir) return;  // creating the temporary file reports the problem
    size_t n = strlen(name);
    for (struct dirent *e; (e = readdir(dir));) {
        if (strncmp(e->d_name, name, n) != 0 || strncmp(e->d_name + n, ".tmp.", 5) != 0) continue;
        const char *pid_text = e->d_name + n + 5;
        char *end;
        errno = 0;
        long pid = strtol(pid_text, &end, 10);
        if (pid_text[0] < '1' || pid_text[0] > '9' || *end != '\0' || errno != 0 || pid > INT_MAX) continue;
        struct stat st;
        bool dead = kill((pid_t)pid, 0) != 0 && errno == ESRCH;
        if (dead && fstatat(dirfd(dir), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0 && S_ISREG(st.st_mode))
            unlinkat(dirfd(dir), e->d_name, 0);
    }
    closedir(dir);
}

// Creates the temporary file FILE.bin.tmp.PID, after removing those of killed runs. Images are
// written from offset pixels_at on, the pixel offset of the largest header the dataset can end up
// with.
static void output_open(Output *out, const char *path, uint64_t pixels_at, uint64_t image_bytes) {
    if (snprintf(tmp_path, sizeof tmp_path, "%s.tmp.%ld", path, (long)getpid()) >= (int)sizeof tmp_path)
        die("output path %s is too long", path);
    const char *slash = strrchr(path, '/');
    if (!slash) strcpy(out->folder, ".");
    else snprintf(out->folder, sizeof out->folder, "%.*s", slash == path ? 1 : (int)(slash - path), path);
    remove_stale_temps(out->folder, slash ? slash + 1 : path);
    tmp_live = 1;  // before the file exists, so that no interrupt can miss it
    out->fd = open(tmp_path, O_RDWR | O_CREAT | O_EXCL, 0644);
    if (out->fd < 0) {
        int e = errno;
        tmp_live = 0;
        die("cannot write %s: creating %s: %s", path, tmp_path, strerror(e));
    }
    out->path = path;
    out->pixels_at = pixels_at;
    out->image_bytes = image_bytes;
}

// Writes image `index` (the index-th image kept) to its place in the temporary file.
static void output_image(const Output *out, uint64_t index, const uint8_t *pixels) {
    write_at(out, pixels, out->image_bytes, out->pixels_at + index * out->image_bytes);
}

// Completes the file and renames it over the output; returns its size. The header, class names
// and labels go in front of the pixels, but only now are the image count and the classes known.
// The images were written from the pixel offset the largest possible header would need (every
// file read, every class used; with no labels that is always 64): when files were skipped, the
// pixels are moved down to the real offset, and the temporary file is cut to the exact size.
static uint64_t output_finish(Output *out, const DatasetHeader *h, const char *names, const int32_t *labels) {
    DatasetLayout layout = checked_layout(h);
    uint64_t pixel_bytes = h->count * layout.image_bytes;
    if (layout.pixels_offset < out->pixels_at) {
        size_t chunk = 1 << 24;
        uint8_t *buf = xmalloc(chunk);
        for (uint64_t done = 0; done < pixel_bytes; done += chunk) {
            size_t n = pixel_bytes - done < chunk ? (size_t)(pixel_bytes - done) : chunk;
            read_at(out, buf, n, out->pixels_at + done);
            write_at(out, buf, n, layout.pixels_offset + done);  // below the bytes still to be read
        }
        free(buf);
    }
    uint8_t *front = calloc(1, layout.pixels_offset);  // header, names, labels and zero padding
    if (!front) die("out of memory");
    memcpy(front, h, sizeof *h);
    if (h->num_classes) {
        memcpy(front + layout.names_offset, names, h->names_bytes);
        memcpy(front + layout.labels_offset, labels, 4 * h->count);
    }
    write_at(out, front, layout.pixels_offset, 0);
    free(front);
    if (ftruncate(out->fd, (off_t)layout.file_bytes) != 0) die("cannot write %s: %s", tmp_path, strerror(errno));
    if (fsync(out->fd) != 0) die("cannot write %s: %s", tmp_path, strerror(errno));
    if (close(out->fd) != 0) die("cannot write %s: %s", tmp_path, strerror(errno));
    // No interrupt between the rename and forgetting the temporary name.
    sigset_t block, old;
    sigemptyset(&block);
    sigaddset(&block, SIGINT), sigaddset(&block, SIGTERM), sigaddset(&block, SIGHUP);
    sigprocmask(SIG_BLOCK, &block, &old);
    if (rename(tmp_path, out->path) != 0) die("cannot rename %s to %s: %s", tmp_path, out->path, strerror(errno));
    tmp_live = 0;
    sigprocmask(SIG_SETMASK, &old, NULL);
    // The new name is durable only once the folder is synced too. EINVAL: a file system that cannot
    // sync folders (there is nothing to wait for).
    int dir = open(out->folder, O_RDONLY | O_DIRECTORY);
    if (dir < 0 || (fsync(dir) != 0 && errno != EINVAL))
        die("cannot sync folder %s after writing %s: %s", out->folder, out->path, strerror(errno));
    close(dir);
    return layout.file_bytes;
}

// How many duplicates were skipped or kept, for the summary: "" when there are none, else e.g.
// ", 3 duplicate files and 1 duplicate folder skipped" or ", 3 duplicate files kept".
typedef struct {
    uint64_t files_skipped, folders_skipped, files_kept;
} Duplicates;

// The one line on stdout that says what was written.
static void print_summary(const DatasetHeader *h, const char *path, uint64_t bytes, uint64_t skipped,
                          Duplicates d) {
    char classes[32];
    if (h->num_classes)
        snprintf(classes, sizeof classes, "%u class%s", h->num_classes, h->num_classes == 1 ? "" : "es");
    else
        snprintf(classes, sizeof classes, "unlabelled");
    char files[48] = "", folders[48] = "", repeats[128] = "";  // said only when there are any
    uint64_t nf = d.files_skipped + d.files_kept;
    if (nf) snprintf(files, sizeof files, "%llu duplicate file%s", (unsigned long long)nf, nf == 1 ? "" : "s");
    if (d.folders_skipped)
        snprintf(folders, sizeof folders, "%llu duplicate folder%s", (unsigned long long)d.folders_skipped,
                 d.folders_skipped == 1 ? "" : "s");
    if (nf || d.folders_skipped)
        snprintf(repeats, sizeof repeats, ", %s%s%s %s", files, nf && d.folders_skipped ? " and " : "", folders,
                 d.files_kept ? "kept" : "skipped");
    printf("prepare_data: wrote %llu image%s (%ux%u RGB, %s) to %s, %llu bytes, %llu file%s skipped%s\n",
           (unsigned long long)h->count, h->count == 1 ? "" : "s", h->width, h->height, classes, path,
           (unsigned long long)bytes, (unsigned long long)skipped, skipped == 1 ? "" : "s", repeats);
}

// ----------------------------------------------------------------------------
// the two modes

// With --labels: leaves out the class folders in which no image could be read, so that the labels
// have no gaps, renumbering the labels to match. Returns the number of classes kept and their names.
static uint32_t keep_used_classes(const FileList *list, int32_t *labels, uint64_t count, const char **kept) {
    uint64_t *images = calloc(list->num_classes, sizeof(uint64_t));
    int32_t *renumber = xmalloc(list->num_classes * sizeof(int32_t));
    if (!images) die("out of memory");
    for (uint64_t i = 0; i < count; i++) images[labels[i]]++;
    uint32_t num_classes = 0;
    for (uint32_t c = 0; c < list->num_classes; c++) {
        if (images[c] == 0) {
            warn("leaving out class %s: no readable image has it", list->class_names[c]);
            continue;
        }
        renumber[c] = (int32_t)num_classes;
        kept[num_classes++] = list->class_names[c];
    }
    for (uint64_t i = 0; i < count; i++) labels[i] = renumber[labels[i]];
    free(renumber), free(images);
    return num_classes;
}

// The files decoded by --jobs threads into a ring of slots while this thread writes them in file
// order, so the dataset is the same bytes for any --jobs and memory holds the ring. A decoder takes
// the next file not taken (an atomic counter), waits until its slot's previous file has been written,
// decodes into the slot and marks it; the writer waits for each file's mark in turn. No thread waits
// for a batch's slowest image: a decoder is held back only when it runs a whole ring ahead.
typedef struct {
    const Options *o;
    const FileList *list;
    uint64_t first, last;     // the files first .. last-1
    atomic_uint_least64_t next;
    size_t slots, image_bytes;
    uint8_t *images;          // [slots][image_bytes]: file i in slot (i - first) % slots
    uint64_t *decoded;        // per slot: 1 + the file it holds once decoded, else 0
    uint64_t written;         // the files first .. written-1 are written: their slots are free again
    bool *ok;                 // per slot: decoded
    char (*why)[512];         // per slot: why not
    pthread_mutex_t lock;
    pthread_cond_t slot_free, slot_decoded;
} Ring;

static void *decode_files(void *arg) {
    Ring *r = (Ring *)arg;
    for (uint64_t i; (i = atomic_fetch_add(&r->next, 1)) < r->last;) {
        size_t k = (i - r->first) % r->slots;
        pthread_mutex_lock(&r->lock);
        while (i >= r->written + r->slots) pthread_cond_wait(&r->slot_free, &r->lock);
        pthread_mutex_unlock(&r->lock);
        bool ok = load_square(r->list->paths[i], r->o->size, r->o->resize, r->images + k * r->image_bytes, r->why[k], sizeof r->why[k]) == 0;
        pthread_mutex_lock(&r->lock);
        r->ok[k] = ok, r->decoded[k] = i + 1;
        pthread_cond_broadcast(&r->slot_decoded);
        pthread_mutex_unlock(&r->lock);
    }
    return NULL;
}

// Waits for file i's slot to be decoded; returns the slot.
static size_t wait_decoded(Ring *r, uint64_t i) {
    size_t k = (i - r->first) % r->slots;
    pthread_mutex_lock(&r->lock);
    while (r->decoded[k] != i + 1) pthread_cond_wait(&r->slot_decoded, &r->lock);
    pthread_mutex_unlock(&r->lock);
    return k;
}

// Frees file i's slot for the file a ring later.
static void release_slot(Ring *r, uint64_t i) {
    pthread_mutex_lock(&r->lock);
    r->written = i + 1;
    pthread_cond_broadcast(&r->slot_free);
    pthread_mutex_unlock(&r->lock);
}

// --labels gd: guided-diffusion's classes (image_datasets.py's load_data with class_cond): a file's
// class is its name's part before the first '_' (the whole name without one), the classes numbered
// in the sorted order of those names (Python's sorted: byte order, as strcmp).
static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static void label_by_names(FileList *list) {
    char **prefix = xmalloc(list->count * sizeof(char *)), **sorted = xmalloc(list->count * sizeof(char *));
    for (uint64_t i = 0; i < list->count; i++) {
        const char *slash = strrchr(list->paths[i], '/'), *name = slash ? slash + 1 : list->paths[i];
        size_t n = strcspn(name, "_");
        prefix[i] = memcpy(xmalloc(n + 1), name, n), prefix[i][n] = '\0';
        sorted[i] = prefix[i];
    }
    qsort(sorted, list->count, sizeof *sorted, compare_names);
    list->class_names = xmalloc(list->count * sizeof(char *));
    for (uint64_t i = 0; i < list->count; i++)
        if (i == 0 || strcmp(sorted[i], sorted[i - 1]) != 0) list->class_names[list->num_classes++] = strcpy(xmalloc(strlen(sorted[i]) + 1), sorted[i]);
    for (uint64_t i = 0; i < list->count; i++) {
        char **found = bsearch(&prefix[i], list->class_names, list->num_classes, sizeof(char *), compare_names);
        list->classes[i] = (int32_t)(found - list->class_names);
        free(prefix[i]);
    }
    free(prefix), free(sorted);
}

// Folder mode. The file list is collected first; the images are then decoded on --jobs threads into
// a ring (Ring) and written to the temporary file in order, so memory holds the ring, the paths and
// the labels. output_st: the existing output file, or NULL.
static void prepare_folder(const Options *o, const struct stat *output_st) {
    struct stat st;
    if (stat(o->input, &st) != 0) die("cannot read input folder %s: %s", o->input, strerror(errno));
    if (!S_ISDIR(st.st_mode)) die("input %s is not a folder", o->input);
    FileList list = {.output = o->output, .output_st = output_st, .keep_duplicates = o->keep_duplicates};
    inode_set_add(&list.seen, &st);
    Ancestor root = {st.st_dev, st.st_ino, NULL};
    scan_folder(&list, o->input, &root, 0, -1, o->labels && !o->name_labels);
    if (list.count == 0) die("no files found in %s%s", o->input, o->labels && !o->name_labels ? "'s class folders" : "");
    if (o->name_labels) label_by_names(&list);
    // --part K/N: the files [K count / N, (K + 1) count / N) of the sorted list; the classes are the
    // whole folder's, kept even where this part has no image of them, so that every part has the
    // same class table.
    uint64_t first_file = o->parts ? list.count * o->part / o->parts : 0;
    uint64_t last_file = o->parts ? list.count * (o->part + 1) / o->parts : list.count;
    if (first_file == last_file)
        die("--part %d/%d of the %llu files of %s holds none: choose fewer parts", o->part, o->parts, (unsigned long long)list.count,
            o->input);

    // The largest header the dataset can need: every file read and every class kept.
    const char *const *class_names = (const char *const *)list.class_names;
    DatasetHeader h = make_header(last_file - first_file, o->size, list.num_classes, names_size(class_names, list.num_classes));
    DatasetLayout largest = checked_layout(&h);
    Output out;
    output_open(&out, o->output, largest.pixels_offset, largest.image_bytes);

    Ring ring = {.o = o, .list = &list, .first = first_file, .last = last_file, .slots = (size_t)SLOTS_PER_JOB * o->jobs,
                 .image_bytes = largest.image_bytes, .written = first_file};
    atomic_store(&ring.next, first_file);
    ring.images = xmalloc(ring.slots * ring.image_bytes);
    ring.decoded = calloc(ring.slots, sizeof(uint64_t)), ring.ok = xmalloc(ring.slots * sizeof(bool));
    ring.why = xmalloc(ring.slots * sizeof *ring.why);
    if (!ring.decoded) die("out of memory");
    pthread_mutex_init(&ring.lock, NULL), pthread_cond_init(&ring.slot_free, NULL), pthread_cond_init(&ring.slot_decoded, NULL);
    pthread_t threads[MAX_JOBS];
    int started = 0, error = 0;
    for (; started < o->jobs && (uint64_t)started < last_file - first_file; started++)
        if ((error = pthread_create(&threads[started], NULL, decode_files, &ring)) != 0) break;  // (fewer threads: the same bytes)
    if (started == 0) die("cannot start a decoding thread: %s", strerror(error));
    int32_t *labels = xmalloc(list.count * sizeof(int32_t));
    uint64_t written = 0;
    Duplicates dup = {list.duplicate_files, list.duplicate_folders, 0};
    progress(0, last_file - first_file);  // (the rate's start)
    for (uint64_t i = first_file; i < last_file; i++) {
        size_t k = wait_decoded(&ring, i);
        if (ring.ok[k]) {
            output_image(&out, written, ring.images + k * ring.image_bytes);
            labels[written++] = list.classes[i];
            dup.files_kept += list.repeats[i];  // a repeat that cannot be decoded is counted as skipped
        } else {
            warn("skipping %s: %s", list.paths[i], ring.why[k]);
            list.skipped++;
        }
        release_slot(&ring, i);
        progress(i + 1 - first_file, last_file - first_file);
    }
    for (int t = 0; t < started; t++) pthread_join(threads[t], NULL);
    end_progress_line();
    if (written == 0)
        die("none of the %llu files in %s%s is an image stb_image can read", (unsigned long long)(last_file - first_file), o->input,
            o->parts ? " (of this part)" : "");

    const char **kept = xmalloc(list.num_classes * sizeof(char *));
    uint32_t num_classes = !o->labels ? 0 : o->parts ? list.num_classes : keep_used_classes(&list, labels, written, kept);
    for (uint32_t c = 0; o->labels && o->parts && c < num_classes; c++) kept[c] = list.class_names[c];
    char *names = names_table(kept, num_classes);
    h = make_header(written, o->size, num_classes, names_size(kept, num_classes));
    uint64_t bytes = output_finish(&out, &h, names, labels);
    print_summary(&h, o->output, bytes, list.skipped, dup);

    free(names), free(kept), free(labels), free(ring.images), free(ring.decoded), free(ring.ok), free(ring.why);
    for (uint64_t i = 0; i < list.count; i++) free(list.paths[i]);
    for (uint32_t c = 0; c < list.num_classes; c++) free(list.class_names[c]);
    free(list.paths), free(list.classes), free(list.repeats), free(list.class_names), free(list.seen.slots);
}

// The bundled synthetic dataset: image i and its label come from shapes_render(seed, i, size).
static void prepare_shapes(const Options *o) {
    char *names = names_table(shapes_class_names, SHAPES_NUM_CLASSES);
    uint32_t names_bytes = names_size(shapes_class_names, SHAPES_NUM_CLASSES);
    DatasetHeader h = make_header(o->count, o->size, SHAPES_NUM_CLASSES, names_bytes);
    DatasetLayout layout = checked_layout(&h);
    Output out;
    output_open(&out, o->output, layout.pixels_offset, layout.image_bytes);
    uint8_t *image = xmalloc(layout.image_bytes);
    int32_t *labels = xmalloc(o->count * sizeof(int32_t));
    for (uint64_t i = 0; i < o->count; i++) {
        labels[i] = shapes_render(o->seed, i, o->size, image);
        output_image(&out, i, image);
        progress(i + 1, o->count);
    }
    end_progress_line();
    uint64_t bytes = output_finish(&out, &h, names, labels);
    print_summary(&h, o->output, bytes, 0, (Duplicates){0, 0, 0});
    free(labels), free(image), free(names);
}

// Parses the options, checks the output, arranges for an interrupt to remove the temporary output,
// and runs a mode.
int main(int argc, char **argv) {
    Options o = parse_options(argc, argv);
    struct stat output_st;
    bool output_exists = check_output(o.output, &output_st);
    show_progress = !o.quiet && isatty(STDERR_FILENO);
    init_srgb_table();
    struct sigaction sa = {.sa_handler = on_signal};  // the three signals are blocked while it runs
    sigemptyset(&sa.sa_mask);
    sigaddset(&sa.sa_mask, SIGINT), sigaddset(&sa.sa_mask, SIGTERM), sigaddset(&sa.sa_mask, SIGHUP);
    sigaction(SIGINT, &sa, NULL), sigaction(SIGTERM, &sa, NULL), sigaction(SIGHUP, &sa, NULL);
    // Past a file size limit (ulimit -f), a write fails with EFBIG and die() removes the temporary
    // file, instead of SIGXFSZ killing the process with the file left behind.
    signal(SIGXFSZ, SIG_IGN);
    if (o.synthetic) prepare_shapes(&o);
    else prepare_folder(&o, output_exists ? &output_st : NULL);
    return 0;
}
