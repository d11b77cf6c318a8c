// check_shapes.c: runs the shapes checker (data/shapes.c) over dataset files, images and folders of
// images, and reports how many images are valid shape images, per class. For a labelled dataset it
// also reports how often the checker's class agrees with the label (matched by class name).
//
//   ./check_shapes [--verbose] [--min_pass P] [--grid S [--count N]] [--classes_in_turn] PATH...
//
// PATH is a dataset .bin (every image is checked), an image file stb_image reads, or a folder (its
// image files, in name order, not recursive). The command line follows the other programs' (cli.h):
// usage on stdout for no arguments, -h or --help; one error line "check_shapes: error: ..." on
// stderr, exit 1 for an error (unreadable input) and 2 for a usage error; exit 3 when the pass rate
// is below --min_pass.
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <stb_image.h>

#include "cli.h"
#include "data/shapes.h"
#include "dataset.h"

static const char usage[] =
    "usage: check_shapes [--verbose] [--min_pass P] [--grid S [--count N]]\n"
    "                    [--classes_in_turn] PATH...\n"
    "\n"
    "Counts the valid shape images (one circle, square or triangle of a palette\n"
    "colour on a clean plain background) among the images of each PATH: a dataset\n"
    ".bin, an image file or a folder of images (its image files in name order, not\n"
    "recursive). For a labelled dataset it also compares class and label.\n"
    "  --verbose          one line per failing image (and per label disagreement)\n"
    "  --min_pass P       exit 3 when fewer than P percent of the images are valid\n"
    "  --grid S           each image is a sample grid of train_unet (SxS tiles,\n"
    "                     2-pixel borders)\n"
    "  --count N          with --grid: only the first N tiles\n"
    "  --classes_in_turn  the images (in the order checked: tiles row by row, a\n"
    "                     folder's files by name) were asked for as classes 0, 1, 2,\n"
    "                     0, ... (circle, square, triangle), as generate and\n"
    "                     train_unet's grids do for a class-conditional model: also\n"
    "                     compare class and request\n"
    "  --help, -h         this help\n"
    "  --version          the version\n"
    "\n"
    "A hyphen in an option's name may stand for an underscore (--min-pass). Exit\n"
    "status: 0 when it ran (and the pass rate reached --min_pass), 1 an error (an\n"
    "unreadable input, no images), 2 a usage error (unknown option, bad value), 3 a\n"
    "pass rate below --min_pass.\n";


typedef struct {
    int verbose;
    int in_turn;  // images without a label are labelled class 0, 1, 2, 0, ... in the order checked
    long images, valid, per_class[SHAPES_NUM_CLASSES];
    long labelled, agree;  // valid images that carry a label, and those whose label agrees
} Tally;

// Prints one error line, "check_shapes: error: MESSAGE" and a suffix, and exits with `status`.
static void exit_with_error(int status, const char *suffix, const char *fmt, va_list args) __attribute__((noreturn));
static void exit_with_error(int status, const char *suffix, const char *fmt, va_list args) {
    fputs("check_shapes: error: ", stderr);
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "%s\n", suffix);
    exit(status);
}

// An error (an unreadable input): exit status 1.
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(1, "", fmt, args);
}

// A bad command line: the line ends in "(see --help)", exit status 2.
static void usage_error(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void usage_error(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    exit_with_error(2, " (see --help)", fmt, args);
}

// Checks one image and counts it. label is the dataset's class name for it, or NULL.
static void check_one(Tally *t, const uint8_t *rgb, int w, int h, const char *path, long index, const char *label) {
    char why[256];
    int cls = shapes_check(rgb, w, h, why, sizeof why);
    if (!label && t->in_turn) label = shapes_class_names[t->images % SHAPES_NUM_CLASSES];
    t->images++;
    if (cls < 0) {
        if (t->verbose) {
            if (index >= 0) printf("%s[%ld]: %s\n", path, index, why);
            else printf("%s: %s\n", path, why);
        }
        return;
    }
    t->valid++;
    t->per_class[cls]++;
    if (!label) return;
    t->labelled++;
    if (strcmp(label, shapes_class_names[cls]) == 0) t->agree++;
    else if (t->verbose) printf("%s[%ld]: valid %s but labelled %s\n", path, index, shapes_class_names[cls], label);
}

// Checks every image of a dataset file.
static void check_dataset(Tally *t, const char *path) {
    Dataset ds;
    char err[512];
    if (dataset_open(path, &ds, err, sizeof err) != 0) die("%s", err);
    const DatasetHeader *hd = &ds.header;
    const char **names = ds.labels ? dataset_class_names(&ds) : NULL;
    if (ds.labels && !names) die("out of memory for the %u class names of %s", hd->num_classes, path);
    for (uint64_t i = 0; i < hd->count; i++) {
        const char *label = names ? names[ds.labels[i]] : NULL;
        check_one(t, ds.pixels + i * ds.layout.image_bytes, (int)hd->width, (int)hd->height, path, (long)i, label);
    }
    free(names);
    dataset_close(&ds);
}

// A sample grid as train_unet writes it: tiles of grid_size pixels, 2-pixel borders around and
// between them, row by row; grid_count > 0 checks only the first grid_count tiles.
static int grid_size, grid_count;

// Checks one image file, converted to RGB (each tile of it with --grid).
static void check_image(Tally *t, const char *path) {
    int w, h, channels;
    uint8_t *rgb = stbi_load(path, &w, &h, &channels, 3);
    if (!rgb) die("cannot read image %s: %s", path, stbi_failure_reason());
    if (!grid_size) {
        check_one(t, rgb, w, h, path, -1, NULL);
    } else {
        int cols = (w - 2) / (grid_size + 2), rows = (h - 2) / (grid_size + 2), tiles = cols * rows;
        if (cols < 1 || rows < 1) die("%s (%dx%d) holds no %dx%d tile", path, w, h, grid_size, grid_size);
        if (grid_count > 0 && grid_count < tiles) tiles = grid_count;
        uint8_t *tile = malloc((size_t)grid_size * grid_size * 3);
        if (!tile) die("out of memory");
        for (int i = 0; i < tiles; i++) {
            int x0 = 2 + (i % cols) * (grid_size + 2), y0 = 2 + (i / cols) * (grid_size + 2);
            for (int y = 0; y < grid_size; y++)
                memcpy(tile + (size_t)y * grid_size * 3, rgb + ((size_t)(y0 + y) * w + x0) * 3, (size_t)grid_size * 3);
            check_one(t, tile, grid_size, grid_size, path, i, NULL);
        }
        free(tile);
    }
    stbi_image_free(rgb);
}

// Is the file a dataset: named *.bin, or starting with the dataset magic?
static int is_dataset(const char *path) {
    size_t len = strlen(path);
    if (len >= 4 && strcmp(path + len - 4, ".bin") == 0) return 1;
    char magic[8];
    FILE *f = fopen(path, "rb");
    int yes = f && fread(magic, 1, 8, f) == 8 && memcmp(magic, DATASET_MAGIC, 8) == 0;
    if (f) fclose(f);
    return yes;
}

static int compare_names(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// Checks the image files of a folder (those stb_image recognises), in name order.
static void check_folder(Tally *t, const char *path) {
    DIR *dir = opendir(path);
    if (!dir) die("cannot open folder %s: %s", path, strerror(errno));
    char **files = NULL;
    size_t n = 0;
    for (struct dirent *e; (e = readdir(dir));) {
        char *file;
        if (asprintf(&file, "%s/%s", path, e->d_name) < 0) die("out of memory");
        struct stat st;
        int w, h, c;
        if (stat(file, &st) == 0 && S_ISREG(st.st_mode) && stbi_info(file, &w, &h, &c)) {
            files = realloc(files, (n + 1) * sizeof *files);
            if (!files) die("out of memory");
            files[n++] = file;
        } else {
            free(file);
        }
    }
    closedir(dir);
    qsort(files, n, sizeof *files, compare_names);
    for (size_t i = 0; i < n; i++) {
        check_image(t, files[i]);
        free(files[i]);
    }
    free(files);
}

// A number in lo..hi given to option `name` (a whole one when `whole`), or a usage error.
static double number_option(const char *name, const char *value, double lo, double hi, int whole) {
    char *end;
    double v = strtod(value, &end);
    if (*end || end == value || !(v >= lo && v <= hi) || (whole && v != (double)(long)v))
        usage_error("%s takes a%s number in %g..%g, not '%s'", name, whole ? " whole" : "", lo, hi, value);
    return v;
}

int main(int argc, char **argv) {
    static const char *const names[] = {"verbose", "min_pass", "grid", "count", "classes_in_turn"};
    Tally t = {0};
    double min_pass = -1;
    const char **paths = calloc(argc, sizeof *paths);
    int num_paths = 0;
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) fputs(usage, stdout), exit(0);
    if (argc < 2) fputs(usage, stdout), exit(0);
    for (int i = 1; i < argc; i++)
        if (strcmp(argv[i], "--version") == 0) cli_print_version("check_shapes", NULL), exit(0);
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (arg[0] != '-' || arg[1] == '\0') {  // a path ("-" too, which names a file)
            paths[num_paths++] = arg;
            continue;
        }
        if (arg[1] != '-') usage_error("unknown option %s", arg);
        const char *eq = strchr(arg, '=');
        size_t len = eq ? (size_t)(eq - arg - 2) : strlen(arg + 2);
        const char *name = NULL;
        for (size_t k = 0; k < sizeof names / sizeof *names; k++)
            if (cli_name_is(arg + 2, len, names[k])) name = names[k];
        char hint[128];
        if (!name) usage_error("unknown option %.*s%s", (int)len + 2, arg, cli_hint(arg + 2, len, names, 5, hint, sizeof hint));
        int takes_value = strcmp(name, "verbose") != 0 && strcmp(name, "classes_in_turn") != 0;
        if (!takes_value) {
            if (eq) usage_error("--%s takes no value", name);
            if (name[0] == 'v') t.verbose = 1;
            else t.in_turn = 1;
            continue;
        }
        if (!eq && i + 1 >= argc) usage_error("--%s needs a value", name);
        const char *value = eq ? eq + 1 : argv[++i];
        if (strcmp(name, "min_pass") == 0) min_pass = number_option("--min_pass", value, 0, 100, 0);
        else if (strcmp(name, "grid") == 0) grid_size = (int)number_option("--grid", value, 1, 100000, 1);
        else grid_count = (int)number_option("--count", value, 1, 100000, 1);
    }
    if (num_paths == 0) usage_error("no PATH given (a dataset .bin, an image or a folder)");

    for (int i = 0; i < num_paths; i++) {
        struct stat st;
        if (stat(paths[i], &st) != 0) die("cannot open %s: %s", paths[i], strerror(errno));
        if (S_ISDIR(st.st_mode)) check_folder(&t, paths[i]);
        else if (is_dataset(paths[i])) check_dataset(&t, paths[i]);
        else check_image(&t, paths[i]);
    }
    free(paths);
    if (t.images == 0) die("no images found");

    double pct = 100.0 * t.valid / t.images;
    printf("%ld images, %ld valid (%.2f%%):", t.images, t.valid, pct);
    for (int c = 0; c < SHAPES_NUM_CLASSES; c++)
        printf(" %s %ld%s", shapes_class_names[c], t.per_class[c], c + 1 < SHAPES_NUM_CLASSES ? "," : "\n");
    if (t.labelled)
        printf("labels agree with the checker on %ld of %ld valid labelled images (%.2f%%)\n", t.agree, t.labelled,
               100.0 * t.agree / t.labelled);
    if (pct < min_pass) {
        printf("pass rate %.2f%% is below --min_pass %g%%\n", pct, min_pass);
        return 3;
    }
    return 0;
}
