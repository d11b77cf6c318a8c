// check_shapes.c: runs the shapes checker (data/shapes.c) over dataset files, images and folders of
// images, and reports how many images are valid shape images, per class. For a labelled dataset it
// also reports how often the checker's class agrees with the label (matched by class name).
//
//   ./check_shapes [--verbose] [--min-pass P] PATH...
//
// PATH is a dataset .bin (every image is checked), an image file stb_image reads, or a folder (its
// image files, in name order, not recursive). --verbose prints one line per failing image (and per
// label disagreement). Exit status: 0 when it ran, 1 when --min-pass P is given and fewer than P
// percent of the images are valid, 2 on bad arguments or unreadable input (one line on stderr).
#include <dirent.h>
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <stb_image.h>

#include "data/shapes.h"
#include "dataset.h"

typedef struct {
    int verbose;
    int in_turn;  // images without a label are labelled class 0, 1, 2, 0, ... in the order checked
    long images, valid, per_class[SHAPES_NUM_CLASSES];
    long labelled, agree;  // valid images that carry a label, and those whose label agrees
} Tally;

// Prints one error line and exits with status 2.
static void die(const char *fmt, ...) __attribute__((format(printf, 1, 2), noreturn));
static void die(const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fputs("check_shapes: ", stderr);
    vfprintf(stderr, fmt, args);
    fputc('\n', stderr);
    va_end(args);
    exit(2);
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

int main(int argc, char **argv) {
    Tally t = {0};
    double min_pass = -1;
    const char **paths = calloc(argc, sizeof *paths);
    int num_paths = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            printf("usage: check_shapes [--verbose] [--min-pass P] PATH...\n\n"
                   "Counts the valid shape images (one circle, square or triangle of a palette colour\n"
                   "on a clean plain background) among the images of each PATH: a dataset .bin, an image\n"
                   "file or a folder of images. For a labelled dataset it also compares class and label.\n"
                   "  --verbose     one line per failing image (and per label disagreement)\n"
                   "  --min-pass P  exit 1 when fewer than P percent of the images are valid\n"
                   "  --grid S      each image is a sample grid of train_unet (SxS tiles, 2-pixel borders)\n"
                   "  --count N     with --grid: only the first N tiles\n"
                   "  --classes-in-turn  the images (in the order checked: tiles row by row, a folder's files\n"
                   "                by name) were asked for as classes 0, 1, 2, 0, ... (circle, square, triangle),\n"
                   "                as generate and train_unet's grids do for a class-conditional model:\n"
                   "                also compare class and request\n");
            return 0;
        } else if (strcmp(argv[i], "--verbose") == 0) {
            t.verbose = 1;
        } else if (strcmp(argv[i], "--classes-in-turn") == 0) {
            t.in_turn = 1;
        } else if (strcmp(argv[i], "--min-pass") == 0) {
            char *end;
            if (i + 1 >= argc) die("--min-pass needs a percentage");
            min_pass = strtod(argv[++i], &end);
            if (*end || end == argv[i] || !(min_pass >= 0 && min_pass <= 100))
                die("--min-pass takes a percentage in 0..100, not '%s'", argv[i]);
        } else if (strcmp(argv[i], "--grid") == 0 || strcmp(argv[i], "--count") == 0) {
            char *end;
            if (i + 1 >= argc) die("%s needs a number", argv[i]);
            long v = strtol(argv[i + 1], &end, 10);
            if (*end || end == argv[i + 1] || v < 1 || v > 100000) die("%s takes a positive number, not '%s'", argv[i], argv[i + 1]);
            *(argv[i][2] == 'g' ? &grid_size : &grid_count) = (int)v;
            i++;
        } else if (strncmp(argv[i], "--", 2) == 0) {
            die("unknown option %s (usage: check_shapes [--verbose] [--min-pass P] PATH...)", argv[i]);
        } else {
            paths[num_paths++] = argv[i];
        }
    }
    if (num_paths == 0) die("usage: check_shapes [--verbose] [--min-pass P] PATH... (dataset .bin, image or folder)");

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
        printf("pass rate %.2f%% is below --min-pass %g%%\n", pct, min_pass);
        return 1;
    }
    return 0;
}
