// test_dataloader.cu: the trainer's data loader on the CPU (train_unet.cu in library mode):
// shuffling, flips, labels, exact save/restore of the position, damaged files, files changed
// after they were checked or while they are read, and datasets in parts.

#define TRAIN_UNET_LIBRARY
#include "../../train_unet.cu"
#include "check.h"

// Writes a dataset file whose image i is filled with a pattern that identifies it: pixel (y, x, c)
// = (i * 7 + y * 3 + x * 5 + c) mod 251. Labels are i mod num_classes. With `first`, its images are
// images first .. first + count - 1 of such a file (a part of one).
static void write_dataset(const char *path, uint64_t count, uint32_t side, uint32_t num_classes, uint64_t first = 0) {
    DatasetHeader h;
    memset(&h, 0, sizeof h);
    memcpy(h.magic, DATASET_MAGIC, 8);
    h.version = DATASET_VERSION, h.channels = 3, h.count = count, h.height = side, h.width = side;
    char names[256] = "";
    uint32_t names_bytes = 0;
    for (uint32_t k = 0; k < num_classes; k++) names_bytes += sprintf(names + names_bytes, "class%u", k) + 1;
    h.num_classes = num_classes, h.names_bytes = names_bytes;
    DatasetLayout layout;
    char err[256];
    if (dataset_layout(&h, &layout, err, sizeof err) != 0) fatal("%s", err);
    uint8_t *file = (uint8_t *)calloc(layout.file_bytes, 1);
    memcpy(file, &h, sizeof h);
    memcpy(file + layout.names_offset, names, names_bytes);
    for (uint64_t i = 0; i < count; i++) {
        uint64_t n = first + i;
        if (num_classes) ((int32_t *)(file + layout.labels_offset))[i] = (int32_t)(n % num_classes);
        for (uint64_t j = 0; j < layout.image_bytes; j++) {
            uint64_t c = j % 3, x = (j / 3) % side, y = j / 3 / side;
            file[layout.pixels_offset + i * layout.image_bytes + j] = (uint8_t)((n * 7 + y * 3 + x * 5 + c) % 251);
        }
    }
    FILE *f = fopen(path, "wb");
    fwrite(file, 1, layout.file_bytes, f);
    fclose(f);
    free(file);
}

// Which image a served buffer holds, and whether it was flipped (-1 when it matches neither).
static int64_t identify(const uint8_t *img, uint32_t side, uint64_t count, int *flipped) {
    for (uint64_t i = 0; i < count; i++) {
        for (int f = 0; f < 2; f++) {
            int ok = 1;
            for (uint32_t y = 0; y < side && ok; y++)
                for (uint32_t x = 0; x < side && ok; x++)
                    for (uint32_t c = 0; c < 3 && ok; c++) {
                        uint32_t sx = f ? side - 1 - x : x;
                        ok = img[(y * side + x) * 3 + c] == (uint8_t)((i * 7 + y * 3 + sx * 5 + c) % 251);
                    }
            if (ok) return *flipped = f, (int64_t)i;
        }
    }
    return -1;
}

static void test_epochs(const char *path) {
    const uint64_t count = 50;
    const uint32_t side = 5;
    write_dataset(path, count, side, 3);
    DataLoader loader;
    char err[256];
    check_case("loader: every image once per epoch, labels follow images, about half flipped");
    CHECK(loader_open(&loader, path, NULL, 10, 0, 1, 1, 1234, 0, err, sizeof err) == 0);
    int seen[2][50] = {{0}}, flips = 0, bad = 0, label_ok = 1;
    for (int step = 0; step < 10; step++) {  // two epochs of five batches
        loader_next_batch(&loader);
        for (int b = 0; b < 10; b++) {
            int flipped;
            int64_t id = identify(loader.batch_pixels + b * side * side * 3, side, count, &flipped);
            if (id < 0) { bad++; continue; }
            seen[step / 5][id]++;
            flips += flipped;
            label_ok &= loader.batch_labels[b] == (int32_t)(id % 3);
        }
    }
    CHECK(bad == 0);
    CHECK(label_ok);
    for (int e = 0; e < 2; e++)
        for (uint64_t i = 0; i < count; i++) CHECK(seen[e][i] == 1);
    CHECK(flips > 20 && flips < 80);  // 100 fair coin flips: 20..80 fails with probability ~1e-9
    loader_close(&loader);

    check_case("loader: the order depends on the seed and the epoch, and the same seed repeats it");
    uint32_t first[3][50];
    uint64_t seeds[3] = {1234, 1234, 99};
    for (int run = 0; run < 3; run++) {
        CHECK(loader_open(&loader, path, NULL, 10, 0, 1, 0, seeds[run], 0, err, sizeof err) == 0);
        memcpy(first[run], loader.order, sizeof first[run]);
        if (run == 0) {
            loader_shuffle(&loader, 1);
            CHECK(memcmp(first[0], loader.order, sizeof first[0]) != 0);
        }
        loader_close(&loader);
    }
    CHECK(memcmp(first[0], first[1], sizeof first[0]) == 0);
    CHECK(memcmp(first[0], first[2], sizeof first[0]) != 0);

    check_case("loader: without --random_flip nothing is flipped; an unlabelled dataset gives label -1");
    write_dataset(path, 7, 4, 0);
    CHECK(loader_open(&loader, path, NULL, 3, 0, 1, 0, 5, 0, err, sizeof err) == 0);
    int any_flipped = 0, labels_unset = 1;
    for (int step = 0; step < 7; step++) {  // 21 images: three epochs, batches straddling the ends
        loader_next_batch(&loader);
        for (int b = 0; b < 3; b++) {
            int flipped = 1;
            CHECK(identify(loader.batch_pixels + b * 4 * 4 * 3, 4, 7, &flipped) >= 0);
            any_flipped |= flipped;
            labels_unset &= loader.batch_labels[b] == -1;
        }
    }
    CHECK(!any_flipped);
    CHECK(labels_unset);
    CHECK(loader.position.epoch == 2 && loader.position.next == 7);  // the next epoch starts on demand
    loader_close(&loader);
}

static void test_resume(const char *path) {
    check_case("loader: a saved position restored in a new loader gives the same batches");
    write_dataset(path, 37, 6, 4);
    DataLoader a, b;
    char err[256];
    CHECK(loader_open(&a, path, NULL, 8, 0, 1, 1, 77, 0, err, sizeof err) == 0);
    for (int step = 0; step < 11; step++) loader_next_batch(&a);  // mid-epoch, past two epoch ends
    LoaderPosition saved = a.position;
    CHECK(loader_open(&b, path, NULL, 8, 0, 1, 1, 77, 0, err, sizeof err) == 0);
    CHECK(loader_seek(&b, saved, err, sizeof err) == 0);
    int same = 1;
    for (int step = 0; step < 12; step++) {
        loader_next_batch(&a);
        loader_next_batch(&b);
        same &= memcmp(a.batch_pixels, b.batch_pixels, 8 * a.data.layout.image_bytes) == 0;
        same &= memcmp(a.batch_labels, b.batch_labels, 8 * sizeof(int32_t)) == 0;
    }
    CHECK(same);
    LoaderPosition past = {0, 38};
    CHECK(loader_seek(&b, past, err, sizeof err) != 0 && strstr(err, "past") != NULL);
    loader_close(&a);
    loader_close(&b);
}

static void test_ranks(const char *path) {
    check_case("loader: 3 ranks at batch 4 take, side by side, the batches of one at batch 12, and keep its position");
    write_dataset(path, 29, 5, 3);
    DataLoader one, ranks[3];
    char err[256];
    CHECK(loader_open(&one, path, NULL, 12, 0, 1, 1, 9, 0, err, sizeof err) == 0);
    for (int r = 0; r < 3; r++) CHECK(loader_open(&ranks[r], path, NULL, 4, r, 3, 1, 9, 0, err, sizeof err) == 0);
    size_t image_bytes = one.data.layout.image_bytes;
    int same = 1;
    for (int step = 0; step < 7; step++) {  // 84 images: epoch ends inside rank batches and between them
        loader_next_batch(&one);
        for (int r = 0; r < 3; r++) {
            loader_next_batch(&ranks[r]);
            same &= memcmp(ranks[r].batch_pixels, one.batch_pixels + r * 4 * image_bytes, 4 * image_bytes) == 0;
            same &= memcmp(ranks[r].batch_labels, one.batch_labels + r * 4, 4 * sizeof(int32_t)) == 0;
            same &= ranks[r].position.epoch == one.position.epoch && ranks[r].position.next == one.position.next;
        }
    }
    CHECK(same);
    CHECK(one.position.epoch == 2);
    loader_close(&one);
    for (int r = 0; r < 3; r++) loader_close(&ranks[r]);
}

// Rewrites bytes of a valid file, then expects loader_open to refuse it with a message containing
// `expect`, leaving nothing allocated.
static void expect_refused(const char *path, const char *name, size_t offset, const void *bytes, size_t len,
                           long truncate_to, const char *expect) {
    check_case(name);
    write_dataset(path, 20, 8, 2);
    FILE *f = fopen(path, "r+b");
    fseek(f, (long)offset, SEEK_SET);
    if (len) fwrite(bytes, 1, len, f);
    fclose(f);
    if (truncate_to >= 0) CHECK(truncate(path, truncate_to) == 0);
    DataLoader loader;
    char err[256] = "";
    CHECK(loader_open(&loader, path, NULL, 4, 0, 1, 1, 1, 0, err, sizeof err) == -1);
    if (!strstr(err, expect)) printf("  message was: %s\n", err);
    CHECK(strstr(err, expect) != NULL);
    CHECK(strchr(err, '\n') == NULL);
}

static void test_damaged(const char *path) {
    uint32_t u32;
    uint64_t u64;
    expect_refused(path, "damaged: wrong magic", 0, "NOTADATA", 8, -1, "bad magic");
    expect_refused(path, "damaged: truncated", 0, NULL, 0, 1000, "truncated");
    expect_refused(path, "damaged: shorter than the header", 0, NULL, 0, 10, "shorter than");
    expect_refused(path, "damaged: empty file", 0, NULL, 0, 0, "shorter than");
    u32 = 2;
    expect_refused(path, "damaged: unknown version", 8, &u32, 4, -1, "version");
    u32 = 9;
    expect_refused(path, "damaged: height inconsistent with the size", 24, &u32, 4, -1, "truncated");
    u32 = 4000000000u;
    expect_refused(path, "damaged: absurd width", 28, &u32, 4, -1, "out of range");
    u64 = 1000;
    expect_refused(path, "damaged: count inconsistent with the size", 16, &u64, 8, -1, "truncated");
    u64 = 0x7fffffffffffffffull;
    expect_refused(path, "damaged: absurd count", 16, &u64, 8, -1, "limit");
    u64 = 0;
    expect_refused(path, "damaged: zero images", 16, &u64, 8, -1, "no images");
    u32 = 4;
    expect_refused(path, "damaged: channels", 12, &u32, 4, -1, "channels");
    u32 = 3;
    expect_refused(path, "damaged: class count disagrees with the name table", 32, &u32, 4, -1, "names");
    int32_t label = 2;  // the first label sits right after the 16-byte name table, at 80
    expect_refused(path, "damaged: label out of range", 80, &label, 4, -1, "label 2");
    check_case("damaged: a missing file");
    DataLoader loader;
    char err[256];
    CHECK(loader_open(&loader, "/nonexistent/data.bin", NULL, 4, 0, 1, 1, 1, 0, err, sizeof err) == -1);
    CHECK(strstr(err, "No such file") != NULL);
}

// A change made to a dataset file while a loader reads it.
typedef void (*DatasetChange)(const char *path, const DataLoader *loader);
typedef struct {
    const char *path;
    DatasetChange change;
} ServeAfter;

// Opens the dataset, makes the change, then serves two epochs of batches (run in a child).
static void serve_after(const void *arg) {
    const ServeAfter *a = (const ServeAfter *)arg;
    DataLoader loader;
    char err[512];
    if (loader_open(&loader, a->path, NULL, 4, 0, 1, 1, 1, 0, err, sizeof err) != 0) _exit(99);
    a->change(a->path, &loader);
    for (uint64_t i = 0; i < 2 * loader.data.header.count / 4; i++) loader_next_batch(&loader);
}

static void cut_short(const char *path, const DataLoader *) {
    if (truncate(path, 100) != 0) _exit(98);
}

static void rewrite_label(const char *path, const DataLoader *loader) {  // image 7's label becomes 7, past the 2 classes
    int32_t label = 7;
    int fd = open(path, O_WRONLY);
    if (fd < 0 || pwrite(fd, &label, 4, loader->data.layout.labels_offset + 7 * 4) != 4) _exit(98);
    close(fd);
}

static void test_changed(const char *path) {
    check_case("changed: a file replaced between main's checks and the loader's open is refused");
    write_dataset(path, 20, 8, 2);
    DataLoader loader;
    char err[512], out[1024];
    CHECK(loader_open(&loader, path, NULL, 4, 0, 1, 1, 1, 0, err, sizeof err) == 0);
    DatasetHeader checked = loader.data.header;
    loader_close(&loader);
    write_dataset(path, 20, 8, 3);  // another file under the same name: 3 classes
    CHECK(loader_open(&loader, path, &checked, 4, 0, 1, 1, 1, 0, err, sizeof err) == -1);
    CHECK(strstr(err, "changed since it was checked") && strstr(err, "now 20 of 8x8, 3 classes") && !strchr(err, '\n'));
    printf("  %s\n", err);
    write_dataset(path, 20, 8, 2);
    CHECK(loader_open(&loader, path, &checked, 4, 0, 1, 1, 1, 0, err, sizeof err) == 0);
    loader_close(&loader);

    check_case("changed: a dataset cut short while it is read ends the process with one line, not SIGBUS");
    write_dataset(path, 200, 8, 2);  // 38 KB: the pixels run over several pages past the cut
    ServeAfter cut = {path, cut_short};
    CHECK(check_in_child(serve_after, &cut, out, sizeof out) == 1);
    CHECK(strstr(out, "error: dataset") && strstr(out, "changed while training (it was cut short)") && check_lines(out) == 1);
    printf("  %s", out);

    check_case("changed: a label rewritten in place while it is read ends the process with one line");
    write_dataset(path, 200, 8, 2);
    ServeAfter relabel = {path, rewrite_label};
    CHECK(check_in_child(serve_after, &relabel, out, sizeof out) == 1);
    CHECK(strstr(out, "changed while training: image 7 has label 7, outside 0..1") && check_lines(out) == 1);
    printf("  %s", out);
}

// Every random draw of the trainer comes from rng_stream(purpose, sub-stream): the purpose stands in
// the stream's top bits whatever the sub-stream (an epoch, a parameter, a layer, a step), so two
// purposes never share a stream. (The data order's stream 1 + 16 * epoch once met the
// initialisation's 1000 + parameter at epoch 63.)
// A dataset in parts serves what the whole file serves: the same batches, flips and labels, epoch
// after epoch, given as a comma list or a list file; parts that disagree are refused in one line.
static void test_parts(const char *dir) {
    check_case("parts: a dataset in 3 parts (a.bin,b.bin,c.bin or @list) serves the whole file's batches and labels, 3 epochs");
    char whole[512], a[512], b[512], c[512], spec[2048], list[512], err[512], mismatched[512];
    snprintf(whole, sizeof whole, "%s/whole.bin", dir), snprintf(a, sizeof a, "%s/a.bin", dir);
    snprintf(b, sizeof b, "%s/b.bin", dir), snprintf(c, sizeof c, "%s/c.bin", dir), snprintf(list, sizeof list, "%s/parts.txt", dir);
    write_dataset(whole, 23, 4, 3), write_dataset(a, 7, 4, 3, 0), write_dataset(b, 1, 4, 3, 7), write_dataset(c, 15, 4, 3, 8);
    FILE *f = fopen(list, "w");
    fprintf(f, "# the parts, relative to this list's folder\na.bin\n\nb.bin  \nc.bin\n");
    fclose(f);
    snprintf(spec, sizeof spec, "%s,%s,%s", a, b, c);
    char at_list[520];
    snprintf(at_list, sizeof at_list, "@%s", list);
    for (int form = 0; form < 2; form++) {
        DataLoader one, parts;
        CHECK(loader_open(&one, whole, NULL, 5, 0, 1, 1, 9, 0, err, sizeof err) == 0);
        CHECK(loader_open(&parts, form ? at_list : spec, &one.data.header, 5, 0, 1, 1, 9, 0, err, sizeof err) == 0);
        CHECK(parts.data.num_parts == 3 && parts.data.header.count == 23);
        int same = 1;
        for (int batch = 0; batch < 3 * 23 / 5 + 1; batch++) {
            loader_next_batch(&one), loader_next_batch(&parts);
            same &= memcmp(one.batch_pixels, parts.batch_pixels, 5 * one.data.layout.image_bytes) == 0;
            same &= memcmp(one.batch_labels, parts.batch_labels, 5 * sizeof(int32_t)) == 0;
        }
        CHECK(same && parts.position.epoch == one.position.epoch && parts.position.next == one.position.next);
        loader_close(&one), loader_close(&parts);
    }

    check_case("parts: parts of other sizes or classes, a missing part, an empty name or list: one line each");
    snprintf(mismatched, sizeof mismatched, "%s/other.bin", dir);
    write_dataset(mismatched, 4, 4, 2);  // two classes
    DataLoader l;
    snprintf(spec, sizeof spec, "%s,%s", a, mismatched);
    CHECK(loader_open(&l, spec, NULL, 2, 0, 1, 1, 9, 0, err, sizeof err) != 0 && strstr(err, "has other classes than part"));
    write_dataset(mismatched, 4, 5, 3);  // 5x5
    CHECK(loader_open(&l, spec, NULL, 2, 0, 1, 1, 9, 0, err, sizeof err) != 0 && strstr(err, "holds 5x5 images"));
    snprintf(spec, sizeof spec, "%s,%s/none.bin", a, dir);
    CHECK(loader_open(&l, spec, NULL, 2, 0, 1, 1, 9, 0, err, sizeof err) != 0 && strstr(err, "none.bin"));
    snprintf(spec, sizeof spec, "%s,,%s", a, b);
    CHECK(loader_open(&l, spec, NULL, 2, 0, 1, 1, 9, 0, err, sizeof err) != 0 && strstr(err, "empty name"));
    f = fopen(list, "w");
    fprintf(f, "# nothing\n\n");
    fclose(f);
    CHECK(loader_open(&l, at_list, NULL, 2, 0, 1, 1, 9, 0, err, sizeof err) != 0 && strstr(err, "names no file"));
    CHECK(!strchr(err, '\n'));
    unlink(whole), unlink(a), unlink(b), unlink(c), unlink(list), unlink(mismatched);
}

static void test_random_streams(void) {
    check_case("random streams: no two purposes share a stream, at any epoch, parameter, layer or step");
    const uint64_t subs[] = {0, 1, 9, 63, 1000, 123456789, ((uint64_t)1 << 48) - 1};
    for (int p = RNG_SHUFFLE; p <= RNG_BENCH_BATCH; p++)
        for (size_t i = 0; i < sizeof subs / sizeof subs[0]; i++) {
            uint64_t stream = rng_stream((RandomPurpose)p, subs[i]);
            CHECK(stream >> 48 == (uint64_t)p && (stream & (((uint64_t)1 << 48) - 1)) == subs[i]);
        }
    CHECK(rng_stream(RNG_SHUFFLE, 63) != rng_stream(RNG_INIT, 9));
}

int main(void) {
    test_random_streams();
    char path[] = "/tmp/test_dataloader_XXXXXX";
    int fd = mkstemp(path);
    close(fd);
    test_epochs(path);
    test_resume(path);
    test_ranks(path);
    test_damaged(path);
    test_changed(path);
    unlink(path);
    char dir[] = "/tmp/test_dataloader_parts_XXXXXX";
    if (!mkdtemp(dir)) fatal("cannot make a temporary folder");
    test_parts(dir);
    rmdir(dir);
    return check_summary();
}
