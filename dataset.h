// dataset.h: the dataset file (.bin) that prepare_data writes and train_unet and check_shapes read.
// One definition of the format, its checks and its mapping, shared by C and CUDA code.
//
// Layout, little-endian, every offset derived from the header:
//   [0, 64)                       DatasetHeader
//   [64, 64 + names_bytes)        class names: num_classes NUL-terminated UTF-8 strings, label order
//   [labels_offset, +4*count)     int32 labels, one per image (only when num_classes > 0),
//                                 labels_offset = align8(64 + names_bytes)
//   [pixels_offset, +count*H*W*C) uint8 pixels, image-major then row, column, channel (NHWC),
//                                 pixels_offset = align64(end of labels, or of names when unlabelled)
// The file ends exactly there: a reader rejects a file of any other size.
#ifndef DATASET_H
#define DATASET_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"  // error_line, map_regular_file

#define DATASET_MAGIC "UNETDSET"
#define DATASET_VERSION 1u
#define DATASET_HEADER_BYTES 64u
#define DATASET_MAX_SIDE 8192u         // largest height or width accepted
#define DATASET_MAX_COUNT UINT32_MAX   // most images: the trainer's loader permutes 32-bit image indices
#define DATASET_MAX_CLASSES 100000u
#define DATASET_MAX_NAMES_BYTES (1u << 24)

typedef struct {
    char magic[8];         // "UNETDSET", no terminator
    uint32_t version;      // DATASET_VERSION
    uint32_t channels;     // 3 (RGB)
    uint64_t count;        // number of images, >= 1
    uint32_t height;       // pixels
    uint32_t width;        // pixels
    uint32_t num_classes;  // 0: unlabelled
    uint32_t names_bytes;  // size of the class-name table (0 when unlabelled)
    uint8_t reserved[24];  // zero
} DatasetHeader;

typedef struct {
    uint64_t names_offset, labels_offset, pixels_offset;
    uint64_t image_bytes;  // height * width * channels
    uint64_t file_bytes;   // the exact size the file must have
} DatasetLayout;

// A dataset file mapped read-only into memory; or a dataset in parts (dataset_open_parts of several
// files), whose header.count is every part's images, numbered part after part, and whose other
// fields are its first part's: read its images and labels with dataset_image and dataset_label.
typedef struct Dataset {
    DatasetHeader header;
    DatasetLayout layout;
    const uint8_t *map;       // the whole file
    const char *class_names;  // num_classes consecutive NUL-terminated strings, or NULL
    const int32_t *labels;    // count labels, or NULL when unlabelled
    const uint8_t *pixels;    // count * image_bytes
    int num_parts;            // 0: one file
    struct Dataset *parts;    // [num_parts], each a file
    uint64_t *part_first;     // [num_parts + 1]: each part's first image; the last, the total
    char **part_paths;        // [num_parts]
} Dataset;

static inline uint64_t dataset_align(uint64_t x, uint64_t a) { return (x + a - 1) / a * a; }

// Checks the header's own fields and derives the layout. Every product is bounded before it is
// formed, so absurd values fail here instead of overflowing, and before a byte past the header is
// read. Returns 0, or -1 with a message.
static inline int dataset_layout(const DatasetHeader *h, DatasetLayout *out, char *err, size_t err_len) {
    if (memcmp(h->magic, DATASET_MAGIC, 8) != 0)
        return error_line(err, err_len, "not a dataset file (bad magic; expected \"%s\")", DATASET_MAGIC);
    if (h->version != DATASET_VERSION)
        return error_line(err, err_len, "unsupported dataset version %u (this build reads %u)", h->version,
                            DATASET_VERSION);
    if (h->channels != 3) return error_line(err, err_len, "%u channels in header, expected 3 (RGB)", h->channels);
    if (h->height < 1 || h->height > DATASET_MAX_SIDE || h->width < 1 || h->width > DATASET_MAX_SIDE)
        return error_line(err, err_len, "image size %ux%u in header is out of range (1..%u)", h->width, h->height,
                            DATASET_MAX_SIDE);
    if (h->count < 1) return error_line(err, err_len, "header says the dataset holds no images");
    if (h->count > DATASET_MAX_COUNT)
        return error_line(err, err_len, "%llu images in header, more than the limit of %u",
                            (unsigned long long)h->count, (unsigned)DATASET_MAX_COUNT);
    if (h->num_classes > DATASET_MAX_CLASSES)
        return error_line(err, err_len, "%u classes in header, more than the limit of %u", h->num_classes,
                            DATASET_MAX_CLASSES);
    if ((h->num_classes == 0) != (h->names_bytes == 0) || h->names_bytes > DATASET_MAX_NAMES_BYTES ||
        h->names_bytes < h->num_classes)
        return error_line(err, err_len, "class-name table of %u bytes does not fit %u classes", h->names_bytes,
                            h->num_classes);
    for (int i = 0; i < 24; i++)
        if (h->reserved[i] != 0) return error_line(err, err_len, "reserved header bytes are not zero");
    // image_bytes <= 2^26 * 3 and count < 2^32, so the file size stays below 2^61: no overflow.
    uint64_t image_bytes = (uint64_t)h->height * h->width * h->channels;
    out->image_bytes = image_bytes;
    out->names_offset = DATASET_HEADER_BYTES;
    out->labels_offset = dataset_align(out->names_offset + h->names_bytes, 8);
    uint64_t labels_end = out->labels_offset + (h->num_classes ? 4 * h->count : 0);
    out->pixels_offset = dataset_align(labels_end, 64);
    out->file_bytes = out->pixels_offset + h->count * image_bytes;
    return 0;
}

// A class name and its label, for finding repeated names by sorting.
typedef struct {
    const char *name;
    uint32_t label;
} DatasetClassName;

// qsort's order for DatasetClassName: by name (strcmp), then by label.
static inline int dataset_compare_names(const void *a, const void *b) {
    const DatasetClassName *x = (const DatasetClassName *)a, *y = (const DatasetClassName *)b;
    int c = strcmp(x->name, y->name);
    return c ? c : (x->label > y->label) - (x->label < y->label);
}

// A class name fit for a one-line message, in out: at most 40 bytes, then "...", with control
// characters (a newline among them) shown as '?'.
static inline const char *dataset_printable_name(const char *name, char out[48]) {
    size_t n = 0;
    for (; name[n] && n < 40; n++) out[n] = (unsigned char)name[n] < 0x20 || name[n] == 0x7f ? '?' : name[n];
    strcpy(out + n, name[n] ? "..." : "");
    return out;
}

// Checks that none of the num_classes class names in the table is empty or repeated: the names
// sorted, then compared with their neighbours, O(n log n). Returns 0, or -1 with a message.
static inline int dataset_check_names(const char *names, uint32_t num_classes, char *err, size_t err_len) {
    DatasetClassName *sorted = (DatasetClassName *)malloc(num_classes * sizeof *sorted);
    if (!sorted) return error_line(err, err_len, "out of memory checking %u class names", num_classes);
    for (uint32_t k = 0; k < num_classes; k++) {
        if (!names[0]) {
            free(sorted);
            return error_line(err, err_len, "class name %u is empty", k);
        }
        sorted[k].name = names;
        sorted[k].label = k;
        names += strlen(names) + 1;
    }
    qsort(sorted, num_classes, sizeof *sorted, dataset_compare_names);
    int result = 0;
    for (uint32_t k = 1; k < num_classes && result == 0; k++)
        if (strcmp(sorted[k - 1].name, sorted[k].name) == 0) {
            char shown[48];
            result = error_line(err, err_len, "class name '%s' appears twice (classes %u and %u)",
                                  dataset_printable_name(sorted[k].name, shown), sorted[k - 1].label, sorted[k].label);
        }
    free(sorted);
    return result;
}

// Checks a whole file in memory: header, size, class-name table (no empty or repeated name) and
// every label.
static inline int dataset_check(const uint8_t *file, uint64_t file_bytes, DatasetHeader *h, DatasetLayout *layout,
                                char *err, size_t err_len) {
    if (file_bytes < DATASET_HEADER_BYTES)
        return error_line(err, err_len, "file is %llu bytes, shorter than the %u-byte header",
                            (unsigned long long)file_bytes, DATASET_HEADER_BYTES);
    memcpy(h, file, sizeof *h);
    if (dataset_layout(h, layout, err, err_len) != 0) return -1;
    if (file_bytes != layout->file_bytes)
        return error_line(err, err_len,
                            "file is %llu bytes but its header (%llu images of %ux%ux%u, %u classes) needs %llu: "
                            "truncated or damaged",
                            (unsigned long long)file_bytes, (unsigned long long)h->count, h->width, h->height,
                            h->channels, h->num_classes, (unsigned long long)layout->file_bytes);
    const char *names = (const char *)file + layout->names_offset;
    uint32_t strings = 0;
    for (uint32_t i = 0; i < h->names_bytes; i++) strings += names[i] == '\0';
    if (h->names_bytes && (strings != h->num_classes || names[h->names_bytes - 1] != '\0'))
        return error_line(err, err_len, "class-name table holds %u names, header says %u classes", strings,
                            h->num_classes);
    if (h->num_classes) {
        if (dataset_check_names(names, h->num_classes, err, err_len) != 0) return -1;
        const int32_t *labels = (const int32_t *)(file + layout->labels_offset);
        for (uint64_t i = 0; i < h->count; i++)
            if (labels[i] < 0 || (uint32_t)labels[i] >= h->num_classes)
                return error_line(err, err_len, "image %llu has label %d, outside 0..%u", (unsigned long long)i,
                                    labels[i], h->num_classes - 1);
    }
    return 0;
}

// Checks a whole file in memory and points ds into it (ds->map = file: nothing is copied, and the
// caller keeps the memory alive and frees it; dataset_close is for dataset_open's datasets).
// Returns 0, or -1 with a message.
static inline int dataset_from_memory(const uint8_t *file, uint64_t file_bytes, Dataset *ds, char *err,
                                      size_t err_len) {
    memset(ds, 0, sizeof *ds);
    if (dataset_check(file, file_bytes, &ds->header, &ds->layout, err, err_len) != 0) return -1;
    ds->map = file;
    ds->class_names = ds->header.num_classes ? (const char *)file + ds->layout.names_offset : NULL;
    ds->labels = ds->header.num_classes ? (const int32_t *)(file + ds->layout.labels_offset) : NULL;
    ds->pixels = file + ds->layout.pixels_offset;
    return 0;
}

// Maps a dataset file read-only and checks it. Returns 0, or -1 with a message naming the file.
static inline int dataset_open(const char *path, Dataset *ds, char *err, size_t err_len) {
    memset(ds, 0, sizeof *ds);
    MappedFile m;
    if (map_regular_file(path, "dataset", &m, err, err_len) != 0) return -1;
    char why[256];
    if (dataset_from_memory(m.bytes, m.size, ds, why, sizeof why) != 0) {
        unmap_file(&m);
        return error_line(err, err_len, "dataset %s: %s", path, why);
    }
    return 0;
}

static inline void dataset_close(Dataset *ds) {
    if (ds->num_parts) {
        for (int k = 0; k < ds->num_parts; k++) dataset_close(&ds->parts[k]), free(ds->part_paths[k]);
        free(ds->parts), free(ds->part_first), free(ds->part_paths);
    } else if (ds->map) {
        munmap((void *)ds->map, ds->layout.file_bytes);
    }
    memset(ds, 0, sizeof *ds);
}

// ----------------------------------------------------------------------------------------------
// A dataset in parts, for a training set written in pieces (folders too large to prepare at once,
// or prepared on several machines): `spec` is one file, files separated by commas
// (a.bin,b.bin), or @LIST, a text file of one path a line (blank lines and lines from '#' skipped;
// a relative path is relative to the list's folder). The parts must agree on everything but their
// image counts: size, channels and the class-name table byte for byte (prepare_data --part K/N
// writes such parts of one folder). Their images are numbered part after part.

#define DATASET_MAX_PARTS 4096

// The files of a dataset: one, or its parts; file k.
static inline int dataset_files(const Dataset *ds) { return ds->num_parts ? ds->num_parts : 1; }
static inline const Dataset *dataset_file(const Dataset *ds, int k) { return ds->num_parts ? &ds->parts[k] : ds; }

// The part of image i and its index there.
static inline const Dataset *dataset_part_of(const Dataset *ds, uint64_t i, uint64_t *at) {
    if (!ds->num_parts) return *at = i, ds;
    int lo = 0, hi = ds->num_parts - 1;
    while (lo < hi) {
        int mid = (lo + hi + 1) / 2;
        if (ds->part_first[mid] <= i) lo = mid;
        else hi = mid - 1;
    }
    *at = i - ds->part_first[lo];
    return &ds->parts[lo];
}

// Image i's pixels, and its label (-1 when unlabelled).
static inline const uint8_t *dataset_image(const Dataset *ds, uint64_t i) {
    uint64_t at;
    const Dataset *p = dataset_part_of(ds, i, &at);
    return p->pixels + at * p->layout.image_bytes;
}

static inline int32_t dataset_label(const Dataset *ds, uint64_t i) {
    uint64_t at;
    const Dataset *p = dataset_part_of(ds, i, &at);
    return p->labels ? p->labels[at] : -1;
}

// folder/item in memory of its own (NULL: out of memory).
static inline char *dataset_join_path(const char *folder, const char *item) {
    size_t size = strlen(folder) + strlen(item) + 2;
    char *path = (char *)malloc(size);
    if (path) snprintf(path, size, "%s/%s", folder, item);
    return path;
}

// The paths a spec names, malloc'd (*count of them). Returns 0, or -1 with a message.
static inline int dataset_spec_paths(const char *spec, char ***paths, int *count, char *err, size_t err_len) {
    char *text = NULL, *folder = NULL;
    *paths = NULL, *count = 0;
    if (spec[0] == '@') {
        MappedFile m;
        if (map_regular_file(spec + 1, "dataset list", &m, err, err_len) != 0) return -1;
        text = (char *)malloc(m.size + 1);
        if (text) memcpy(text, m.bytes, m.size), text[m.size] = '\0';
        unmap_file(&m);
        const char *slash = strrchr(spec + 1, '/');
        folder = strndup(spec + 1, slash ? (size_t)(slash - (spec + 1)) : 0);
    } else {
        size_t n = strlen(spec);
        if (!n || spec[0] == ',' || spec[n - 1] == ',' || strstr(spec, ",,"))
            return error_line(err, err_len, "dataset list '%s' has an empty name", spec);
        text = strdup(spec);
    }
    char **out = (char **)calloc(DATASET_MAX_PARTS, sizeof *out);
    if (!text || !out || (spec[0] == '@' && !folder))
        return free(text), free(folder), free(out), error_line(err, err_len, "out of memory");
    int n = 0, r = 0;
    for (char *save = NULL, *item = strtok_r(text, spec[0] == '@' ? "\n" : ",", &save); item && r == 0;
         item = strtok_r(NULL, spec[0] == '@' ? "\n" : ",", &save)) {
        item[strcspn(item, spec[0] == '@' ? "#\r" : "")] = '\0';
        while (*item == ' ' || *item == '\t') item++;
        for (char *end = item + strlen(item); end > item && (end[-1] == ' ' || end[-1] == '\t');) *--end = '\0';
        if (!item[0]) continue;  // a blank line of a list file (a comma list has none: checked above)
        if (n == DATASET_MAX_PARTS) r = error_line(err, err_len, "dataset list %s names more than %d parts", spec, DATASET_MAX_PARTS);
        else if (folder && folder[0] && item[0] != '/' && !(out[n] = dataset_join_path(folder, item)))
            r = error_line(err, err_len, "out of memory");
        else if (!out[n] && !(out[n] = strdup(item)))
            r = error_line(err, err_len, "out of memory");
        else n++;
    }
    if (r == 0 && n == 0) r = error_line(err, err_len, "dataset list %s names no file", spec);
    free(text), free(folder);
    if (r != 0) {
        for (int k = 0; k < n; k++) free(out[k]);
        return free(out), -1;
    }
    *paths = out, *count = n;
    return 0;
}

// Opens a dataset from a spec (above): one file as dataset_open, several as its parts. Returns 0,
// or -1 with a message naming the file.
static inline int dataset_open_parts(const char *spec, Dataset *ds, char *err, size_t err_len) {
    memset(ds, 0, sizeof *ds);
    if (spec[0] != '@' && !strchr(spec, ',')) return dataset_open(spec, ds, err, err_len);
    char **paths;
    int n;
    if (dataset_spec_paths(spec, &paths, &n, err, err_len) != 0) return -1;
    Dataset *parts = (Dataset *)calloc(n, sizeof *parts);
    uint64_t *first = (uint64_t *)calloc(n + 1, sizeof *first);
    int r = parts && first ? 0 : error_line(err, err_len, "out of memory");
    for (int k = 0; k < n && r == 0; k++) {
        if ((r = dataset_open(paths[k], &parts[k], err, err_len)) != 0) break;
        const DatasetHeader *a = &parts[0].header, *b = &parts[k].header;
        if (a->height != b->height || a->width != b->width || a->channels != b->channels)
            r = error_line(err, err_len, "dataset part %s holds %ux%u images of %u channels; part %s %ux%u of %u", paths[k], b->width,
                           b->height, b->channels, paths[0], a->width, a->height, a->channels);
        else if (a->num_classes != b->num_classes || a->names_bytes != b->names_bytes ||
                 memcmp(parts[0].class_names, parts[k].class_names, a->names_bytes) != 0)
            r = error_line(err, err_len, "dataset part %s has other classes than part %s (%u and %u, or other names): prepare the "
                           "parts of one folder with prepare_data --part", paths[k], paths[0], b->num_classes, a->num_classes);
        else if (first[k] + b->count > DATASET_MAX_COUNT)
            r = error_line(err, err_len, "dataset %s holds more than %u images", spec, (unsigned)DATASET_MAX_COUNT);
        first[k + 1] = first[k] + b->count;
    }
    if (r != 0) {
        for (int k = 0; k < n; k++) {
            if (parts) dataset_close(&parts[k]);
            free(paths[k]);
        }
        return free(parts), free(first), free(paths), -1;
    }
    *ds = parts[0];
    ds->header.count = first[n];
    ds->num_parts = n, ds->parts = parts, ds->part_first = first, ds->part_paths = paths;
    return 0;
}

// The class names of a labelled dataset, in label order: a malloc'd array of num_classes pointers
// into the name table, made in one pass over it (so a name is found in O(1) per image, whatever
// the class count). NULL when out of memory.
static inline const char **dataset_class_names(const Dataset *ds) {
    const char **names = (const char **)malloc(ds->header.num_classes * sizeof *names);
    const char *name = ds->class_names;
    for (uint32_t k = 0; names && k < ds->header.num_classes; k++) names[k] = name, name += strlen(name) + 1;
    return names;
}

#endif  // DATASET_H
