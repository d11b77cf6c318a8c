// test_dataset.c: the dataset file format (dataset.h): layout arithmetic, class names, and random
// damage to the header, which must always be refused cleanly or accepted consistently (run under
// AddressSanitizer: a read past the mapping fails the run).
#include <stdlib.h>
#include <time.h>

#include "dataset.h"
#include "dev/test/check.h"

static DatasetHeader make_header(uint64_t count, uint32_t h, uint32_t w, uint32_t classes, uint32_t names_bytes) {
    DatasetHeader hd;
    memset(&hd, 0, sizeof hd);
    memcpy(hd.magic, DATASET_MAGIC, 8);
    hd.version = DATASET_VERSION, hd.channels = 3, hd.count = count, hd.height = h, hd.width = w;
    hd.num_classes = classes, hd.names_bytes = names_bytes;
    return hd;
}

// Writes a valid file with two classes "cat" and "dog" and returns its size.
static uint64_t write_valid(const char *path, uint64_t count, uint32_t side) {
    DatasetHeader h = make_header(count, side, side, 2, 8);
    DatasetLayout l;
    char err[256];
    if (dataset_layout(&h, &l, err, sizeof err) != 0) return 0;
    uint8_t *file = calloc(l.file_bytes, 1);
    memcpy(file, &h, sizeof h);
    memcpy(file + l.names_offset, "cat\0dog\0", 8);
    for (uint64_t i = 0; i < count; i++) ((int32_t *)(file + l.labels_offset))[i] = (int32_t)(i & 1);
    for (uint64_t j = 0; j < count * l.image_bytes; j++) file[l.pixels_offset + j] = (uint8_t)(j * 31);
    FILE *f = fopen(path, "wb");
    fwrite(file, 1, l.file_bytes, f);
    fclose(f);
    free(file);
    return l.file_bytes;
}

int main(void) {
    char err[256];
    DatasetLayout l;

    check_case("layout: offsets aligned, sizes exact, unlabelled files have no label section");
    DatasetHeader h = make_header(10, 5, 7, 3, 13);
    CHECK(dataset_layout(&h, &l, err, sizeof err) == 0);
    CHECK(l.names_offset == 64 && l.labels_offset == 80 && l.pixels_offset == 128);
    CHECK(l.image_bytes == 105 && l.file_bytes == 128 + 1050);
    h = make_header(10, 5, 7, 0, 0);
    CHECK(dataset_layout(&h, &l, err, sizeof err) == 0);
    CHECK(l.pixels_offset == 64 && l.file_bytes == 64 + 1050);

    check_case("layout: largest accepted sides do not overflow; a class without a name table is refused");
    h = make_header(1000000, DATASET_MAX_SIDE, DATASET_MAX_SIDE, 0, 0);
    CHECK(dataset_layout(&h, &l, err, sizeof err) == 0);
    CHECK(l.file_bytes == 64 + 1000000ull * DATASET_MAX_SIDE * DATASET_MAX_SIDE * 3);
    h = make_header(10, 8, 8, 2, 0);
    CHECK(dataset_layout(&h, &l, err, sizeof err) != 0 && strstr(err, "class-name table"));

    check_case("open: a valid file maps, with its class names, labels and pixels");
    char path[] = "/tmp/test_dataset_XXXXXX";
    close(mkstemp(path));
    uint64_t size = write_valid(path, 9, 4);
    Dataset ds;
    CHECK(dataset_open(path, &ds, err, sizeof err) == 0);
    CHECK(ds.header.count == 9 && ds.layout.file_bytes == size);
    CHECK(strcmp(dataset_class_name(&ds, 0), "cat") == 0 && strcmp(dataset_class_name(&ds, 1), "dog") == 0);
    CHECK(ds.labels[3] == 1 && ds.pixels[1] == 31);
    dataset_close(&ds);

    check_case("open: 2000 random header corruptions are refused with a message or read consistently");
    srand((unsigned)time(NULL));
    size = write_valid(path, 9, 4);
    FILE *f = fopen(path, "rb");
    uint8_t *orig = malloc(size);
    CHECK(fread(orig, 1, size, f) == size);
    fclose(f);
    int refused = 0, accepted_bad = 0;
    for (int trial = 0; trial < 2000; trial++) {
        uint8_t *copy = malloc(size);
        memcpy(copy, orig, size);
        int flips = 1 + rand() % 4;
        for (int k = 0; k < flips; k++) copy[rand() % 100] ^= (uint8_t)(1 + rand() % 255);  // header, names, labels
        uint64_t keep = rand() % 8 ? size : (uint64_t)(rand() % size);                     // sometimes truncated
        f = fopen(path, "wb");
        fwrite(copy, 1, keep, f);
        fclose(f);
        err[0] = '\0';
        if (dataset_open(path, &ds, err, sizeof err) != 0) {
            refused++;
            if (!err[0] || strchr(err, '\n')) accepted_bad++;
        } else {
            accepted_bad += ds.layout.file_bytes != keep;  // what it accepted must add up
            for (uint32_t k = 0; k < ds.header.num_classes; k++) (void)strlen(dataset_class_name(&ds, k));
            dataset_close(&ds);
        }
        free(copy);
    }
    printf("  %d of 2000 corrupted files refused\n", refused);
    CHECK(refused > 1000 && accepted_bad == 0);
    free(orig);

    check_case("open: a directory and a missing file are refused");
    CHECK(dataset_open("/tmp", &ds, err, sizeof err) != 0 && strstr(err, "not a regular file"));
    CHECK(dataset_open("/nonexistent.bin", &ds, err, sizeof err) != 0 && strstr(err, "cannot open"));
    unlink(path);
    return check_summary();
}
