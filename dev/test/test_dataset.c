// test_dataset.c: the dataset file format (dataset.h): layout arithmetic, class names, and random
// damage to the header, which must always be refused cleanly or accepted consistently (run under
// AddressSanitizer: a read past the mapping fails the run).
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>
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

// A labelled file in memory: count images of side x side, the class-name table `names` (names_bytes
// bytes holding `classes` strings) and label i % classes for image i. Returns the buffer (free it)
// and its size in *bytes, or NULL when the header is refused.
static uint8_t *build_file(uint64_t count, uint32_t side, uint32_t classes, const char *names, uint32_t names_bytes,
                           uint64_t *bytes) {
    DatasetHeader h = make_header(count, side, side, classes, names_bytes);
    DatasetLayout l;
    char err[256];
    if (dataset_layout(&h, &l, err, sizeof err) != 0) return NULL;
    uint8_t *file = calloc(l.file_bytes, 1);
    memcpy(file, &h, sizeof h);
    memcpy(file + l.names_offset, names, names_bytes);
    for (uint64_t i = 0; i < count; i++) ((int32_t *)(file + l.labels_offset))[i] = (int32_t)(i % classes);
    for (uint64_t j = 0; j < count * l.image_bytes; j++) file[l.pixels_offset + j] = (uint8_t)(j * 31);
    *bytes = l.file_bytes;
    return file;
}

// Writes a valid file with two classes "cat" and "dog" and returns its size.
static uint64_t write_valid(const char *path, uint64_t count, uint32_t side) {
    uint64_t bytes;
    uint8_t *file = build_file(count, side, 2, "cat\0dog\0", 8, &bytes);
    if (!file) return 0;
    FILE *f = fopen(path, "wb");
    fwrite(file, 1, bytes, f);
    fclose(f);
    free(file);
    return bytes;
}

// dataset_check on a file of two 2x2 images with this class-name table; the message goes to err.
static int check_names(uint32_t classes, const char *names, uint32_t names_bytes, char *err, size_t err_len) {
    uint64_t bytes;
    uint8_t *file = build_file(2, 2, classes, names, names_bytes, &bytes);
    DatasetHeader h;
    DatasetLayout l;
    err[0] = '\0';
    int result = file ? dataset_check(file, bytes, &h, &l, err, err_len) : -1;
    free(file);
    return result;
}

// dataset_open on a FIFO, in a child process that an alarm ends if open() waits for a writer (which
// none will ever be). Returns 1 when the child was refused promptly with one line naming the cause.
static int fifo_refused(const char *fifo) {
    fflush(stdout);
    pid_t child = fork();
    if (child == 0) {
        alarm(10);  // a safety net only: a correct open returns at once
        Dataset ds;
        char err[256] = "";
        int ok = dataset_open(fifo, &ds, err, sizeof err) != 0 && strstr(err, "not a regular file") &&
                 !strchr(err, '\n');
        _exit(ok ? 0 : 1);
    }
    int status;
    if (child < 0 || waitpid(child, &status, 0) != child) return 0;
    if (WIFSIGNALED(status) && WTERMSIG(status) == SIGALRM) printf("  dataset_open blocked on the FIFO\n");
    return WIFEXITED(status) && WEXITSTATUS(status) == 0;
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

    check_case("layout: more than 2^32-1 images is refused from the header alone, before any label is read");
    h = make_header(UINT32_MAX, 1, 1, 2, 8);
    CHECK(dataset_layout(&h, &l, err, sizeof err) == 0);
    h = make_header((uint64_t)UINT32_MAX + 1, 1, 1, 2, 8);
    CHECK(dataset_layout(&h, &l, err, sizeof err) != 0 && strstr(err, "4294967296 images") && strstr(err, "limit"));
    h = make_header(UINT64_MAX, DATASET_MAX_SIDE, DATASET_MAX_SIDE, 0, 0);
    CHECK(dataset_layout(&h, &l, err, sizeof err) != 0 && strstr(err, "limit"));

    check_case("check: an empty class name is refused, first, middle or last");
    CHECK(check_names(2, "\0dog\0", 5, err, sizeof err) != 0 && strcmp(err, "class name 0 is empty") == 0);
    CHECK(check_names(3, "cat\0\0dog\0", 9, err, sizeof err) != 0 && strcmp(err, "class name 1 is empty") == 0);
    CHECK(check_names(2, "cat\0\0", 5, err, sizeof err) != 0 && strcmp(err, "class name 1 is empty") == 0);

    check_case("check: a repeated class name is refused, naming both classes");
    CHECK(check_names(3, "cat\0dog\0cat\0", 12, err, sizeof err) != 0 &&
          strcmp(err, "class name 'cat' appears twice (classes 0 and 2)") == 0);
    CHECK(check_names(2, "a\nb\0a\nb\0", 8, err, sizeof err) != 0 &&
          strcmp(err, "class name 'a?b' appears twice (classes 0 and 1)") == 0);  // still one line
    CHECK(check_names(2, "cat\0cats\0", 9, err, sizeof err) == 0);

    check_case("check: 100,000 distinct class names pass; one repeat among them is found");
    enum { MANY = 100000, NAME_BYTES = 12 };  // "class000000" and its NUL
    char *many = malloc((size_t)MANY * NAME_BYTES);
    for (int k = 0; k < MANY; k++) sprintf(many + (size_t)k * NAME_BYTES, "class%06d", (k * 7919) % MANY);
    CHECK(check_names(MANY, many, MANY * NAME_BYTES, err, sizeof err) == 0);
    memcpy(many + (size_t)99998 * NAME_BYTES, many + 5 * NAME_BYTES, NAME_BYTES);
    CHECK(check_names(MANY, many, MANY * NAME_BYTES, err, sizeof err) != 0 &&
          strcmp(err, "class name 'class039595' appears twice (classes 5 and 99998)") == 0);
    free(many);

    check_case("open: a valid file maps, with its class names, labels and pixels");
    char path[] = "/tmp/test_dataset_XXXXXX";
    close(mkstemp(path));
    uint64_t size = write_valid(path, 9, 4);
    Dataset ds;
    CHECK(dataset_open(path, &ds, err, sizeof err) == 0);
    CHECK(ds.header.count == 9 && ds.layout.file_bytes == size);
    const char **names = dataset_class_names(&ds);
    CHECK(names && strcmp(names[0], "cat") == 0 && strcmp(names[1], "dog") == 0);
    free((void *)names);
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
            const char **names = ds.header.num_classes ? dataset_class_names(&ds) : NULL;
            for (uint32_t k = 0; names && k < ds.header.num_classes; k++) (void)strlen(names[k]);
            free((void *)names);
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

    check_case("open: a FIFO is refused at once, without waiting for a writer");
    char fifo_dir[] = "/tmp/test_dataset_fifo_XXXXXX", fifo[64];
    CHECK(mkdtemp(fifo_dir) != NULL);
    snprintf(fifo, sizeof fifo, "%s/data.bin", fifo_dir);
    CHECK(mkfifo(fifo, 0600) == 0);
    CHECK(fifo_refused(fifo));
    unlink(fifo);
    rmdir(fifo_dir);
    return check_summary();
}
