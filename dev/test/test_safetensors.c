// test_safetensors.c: the readers of checkpoint.h (safetensors and state.bin) on the committed
// corpus (dev/test/corpus/{safetensors,state}: every good_* file accepted, every bad_* refused with
// one line) and on files made here: escapes, limits, a FIFO, non-finite values. Built with
// AddressSanitizer and UBSan, so a read outside a file's bytes fails the test too.
#include <dirent.h>
#include <sys/wait.h>

#include "checkpoint.h"
#include "check.h"

static char tmp_dir[] = "/tmp/test_safetensors_XXXXXX";

// Writes a safetensors file from a header text and data bytes; returns its path.
static const char *write_file(const char *name, const char *header, const void *data, size_t data_bytes) {
    static char path[512];
    snprintf(path, sizeof path, "%s/%s", tmp_dir, name);
    FILE *f = fopen(path, "wb");
    uint64_t n = strlen(header);
    fwrite(&n, 8, 1, f), fwrite(header, 1, n, f);
    if (data_bytes) fwrite(data, 1, data_bytes, f);
    fclose(f);
    return path;
}

// Runs one reader on every file of a corpus folder; counts the files whose verdict is wrong.
static int check_corpus(const char *folder, int is_state) {
    DIR *d = opendir(folder);
    if (!d) return printf("  cannot open %s\n", folder), 1;
    int wrong = 0, files = 0;
    struct dirent *e;
    char path[1024], err[512];
    while ((e = readdir(d))) {
        int good = strncmp(e->d_name, "good_", 5) == 0;
        if (!good && strncmp(e->d_name, "bad_", 4) != 0) continue;
        snprintf(path, sizeof path, "%s/%s", folder, e->d_name);
        err[0] = '\0';
        int r;
        if (is_state) {
            MappedFile m;
            StateHeader h;
            r = map_regular_file(path, "training state", &m, err, sizeof err);
            if (r == 0) r = state_check(m.bytes, m.size, &h, err, sizeof err), unmap_file(&m);
        } else {
            SafeTensorsFile f;
            r = safetensors_open(path, &f, err, sizeof err);
            if (r == 0) safetensors_close(&f);
        }
        files++;
        if (good && r != 0) wrong++, printf("  %s refused: %s\n", e->d_name, err);
        if (!good && (r == 0 || !err[0] || strchr(err, '\n'))) wrong++, printf("  %s not refused with one line\n", e->d_name);
    }
    closedir(d);
    printf("  %d files in %s\n", files, folder);
    return wrong + (files == 0);
}

// Hostile .pt files built here byte by byte: a buffer, a stored zip of named entries laid out as
// torch.save writes them, and a state_dict pickle of one float tensor.
typedef struct {
    uint8_t bytes[4096];
    size_t n;
} Bytes;

static void put(Bytes *b, const void *p, size_t n) {
    if (b->n + n > sizeof b->bytes) printf("  a test file outgrew its buffer\n"), exit(1);
    memcpy(b->bytes + b->n, p, n), b->n += n;
}
static void put_le(Bytes *b, uint64_t v, int n) {
    for (int i = 0; i < n; i++) put(b, &(uint8_t){(uint8_t)(v >> 8 * i)}, 1);
}
static void put_text(Bytes *b, const char *s) { put(b, s, strlen(s)); }

typedef struct {
    const char *name;
    const Bytes *data;
} ZipItem;

// A zip local header (stored, no extra field), the central directory's record of one entry, and
// the directory's end record; dates and CRCs zero (the reader checks neither).
static void zip_local(Bytes *z, const char *name, uint64_t size) {
    put_le(z, 0x04034b50, 4), put_le(z, 20, 2), put_le(z, 0, 2), put_le(z, 0, 2);  // signature, version, flags, method
    put_le(z, 0, 4), put_le(z, 0, 4), put_le(z, size, 4), put_le(z, size, 4);      // time and date, CRC, sizes
    put_le(z, strlen(name), 2), put_le(z, 0, 2), put_text(z, name);                // name, extra field
}
static void zip_central(Bytes *z, const char *name, uint64_t size, uint64_t local) {
    put_le(z, 0x02014b50, 4), put_le(z, 20, 2), put_le(z, 20, 2), put_le(z, 0, 2), put_le(z, 0, 2);  // ..., flags, method
    put_le(z, 0, 4), put_le(z, 0, 4), put_le(z, size, 4), put_le(z, size, 4);                      // time and date, CRC, sizes
    put_le(z, strlen(name), 2), put_le(z, 0, 2), put_le(z, 0, 2), put_le(z, 0, 2);                 // name, extra, comment, disk
    put_le(z, 0, 2), put_le(z, 0, 4), put_le(z, local, 4), put_text(z, name);                      // attributes, local header
}
static void zip_end(Bytes *z, int entries, uint64_t dir_at) {
    uint64_t dir_size = z->n - dir_at;
    put_le(z, 0x06054b50, 4), put_le(z, 0, 2), put_le(z, 0, 2), put_le(z, entries, 2), put_le(z, entries, 2);
    put_le(z, dir_size, 4), put_le(z, dir_at, 4), put_le(z, 0, 2);
}

static void zip_of(Bytes *z, const ZipItem *items, int n) {
    uint64_t at[8];
    z->n = 0;
    for (int i = 0; i < n; i++) at[i] = z->n, zip_local(z, items[i].name, items[i].data->n), put(z, items[i].data->bytes, items[i].data->n);
    uint64_t dir_at = z->n;
    for (int i = 0; i < n; i++) zip_central(z, items[i].name, items[i].data->n, at[i]);
    zip_end(z, n, dir_at);
}

static void pickle_text(Bytes *p, const char *s) { put_le(p, 0x8c, 1), put_le(p, strlen(s), 1), put_text(p, s); }  // SHORT_BINUNICODE
static void pickle_int(Bytes *p, int64_t v) { put_le(p, 0x8a, 1), put_le(p, 8, 1), put_le(p, (uint64_t)v, 8); }     // LONG1 of 8 bytes

// {name: _rebuild_tensor_v2(FloatStorage KEY of numel, 0, shape, stride, False, None)}, protocol 2.
static void pickle_tensor(Bytes *p, const char *name, const char *key, int64_t numel, int ndim, const int64_t *shape, const int64_t *stride) {
    p->n = 0;
    put_text(p, "\x80\x02}"), pickle_text(p, name), put_text(p, "ctorch._utils\n_rebuild_tensor_v2\n((");
    pickle_text(p, "storage"), put_text(p, "ctorch\nFloatStorage\n"), pickle_text(p, key), pickle_text(p, "cpu"), pickle_int(p, numel);
    put_text(p, "tQ"), pickle_int(p, 0), put_text(p, "(");
    for (int d = 0; d < ndim; d++) pickle_int(p, shape[d]);
    put_text(p, "t(");
    for (int d = 0; d < ndim; d++) pickle_int(p, stride[d]);
    put_text(p, "t\x89NtRs.");
}

// pt_parse on a heap copy of exactly the file's bytes (so that AddressSanitizer sees a read one
// byte past the end); *count gets the tensors of an accepted file, *first the first one's value.
static int parse_pt(const Bytes *b, int *count, float *first, char *err, size_t err_len) {
    uint8_t *copy = (uint8_t *)malloc(b->n);
    memcpy(copy, b->bytes, b->n);
    SafeTensorsFile f;
    int r = pt_parse(copy, b->n, &f, err, err_len);
    if (r == 0) {
        float values[16];
        *count = f.count;
        *first = f.count >= 1 && f.tensors[0].numel <= 16 && safetensors_get_float(&f.tensors[0], values) == 0 ? values[0] : NAN;
        safetensors_close(&f);
    }
    free(copy);
    return r;
}

int main(void) {
    if (!mkdtemp(tmp_dir)) return printf("mkdtemp failed\n"), 1;
    char err[512], header[4096];
    SafeTensorsFile f;

    check_case("corpus: every good safetensors file is read, every bad one refused with one line");
    CHECK(check_corpus("dev/test/corpus/safetensors", 0) == 0);

    check_case("corpus: every good .pt file (torch.save's zip and legacy formats) is read, every bad one refused with one line");
    CHECK(check_corpus("dev/test/corpus/pt", 0) == 0);

    check_case(".pt: a state_dict's tensors, their dtypes, shapes and values (a view at an offset into its storage)");
    const char *pt_files[2] = {"dev/test/corpus/pt/good_zip.pt", "dev/test/corpus/pt/good_legacy.pt"};
    for (int i = 0; i < 2; i++) {
        float w[6], b[3];
        CHECK(safetensors_open(pt_files[i], &f, err, sizeof err) == 0 && f.count == 2 && f.meta_count == 0);
        const SafeTensor *weight = safetensors_find(&f, "a.weight"), *bias = safetensors_find(&f, "a.bias");
        CHECK(weight && bias && strcmp(weight->dtype, "F32") == 0 && weight->ndim == 2 && weight->shape[0] == 2 && weight->shape[1] == 3 &&
              strcmp(bias->dtype, "F16") == 0 && bias->ndim == 1 && bias->shape[0] == 3);
        CHECK(weight && bias && safetensors_get_float(weight, w) == 0 && safetensors_get_float(bias, b) == 0 && w[0] == 0.5f &&
              w[5] == -0.125f && b[0] == -2.0f && b[2] == 4.0f);  // the bias: storage elements 1..3 of (1, -2, 0.5, 4)
        safetensors_close(&f);
    }

    check_case(".pt written by torch.save (zip and legacy): views at offsets into shared storages, a Parameter, fp16 and bf16");
    const char *torch_files[2] = {"dev/test/corpus/pt/good_torch_views.pt", "dev/test/corpus/pt/good_torch_views_legacy.pt"};
    for (int i = 0; i < 2; i++) {  // scripts/make_pt_fixtures.py: base = arange(10) * 0.25, each tensor's values from it
        static const struct { const char *name; int first, count; } views[] = {
            {"view", 2, 3}, {"whole", 0, 10}, {"row", 5, 5}, {"half", 0, 6}, {"bf16", 0, 4}, {"param", 0, 3}};
        CHECK(safetensors_open(torch_files[i], &f, err, sizeof err) == 0 && f.count == 6);
        for (int v = 0; v < 6; v++) {
            const SafeTensor *t = safetensors_find(&f, views[v].name);
            float values[10];
            int ok = t && t->numel == views[v].count && safetensors_get_float(t, values) == 0;
            for (int j = 0; ok && j < views[v].count; j++) ok = values[j] == 0.25f * (views[v].first + j);
            if (!ok) printf("  %s: %s differs\n", torch_files[i], views[v].name);
            CHECK(ok);
        }
        safetensors_close(&f);
    }

    check_case(".pt of the reference model's state_dict (fp32, fp16, bf16; zip and legacy) holds the fixture's weights");
    const char *models[2] = {"seed", "adm"}, *kinds[5] = {"fp32", "fp32_legacy", "fp16", "fp16_legacy", "bf16"};
    for (int m = 0; m < 2; m++) {
        SafeTensorsFile want;
        snprintf(header, sizeof header, "dev/fixtures/unet_%s.safetensors", models[m]);
        CHECK(safetensors_open(header, &want, err, sizeof err) == 0);
        for (int k = 0; k < 5; k++) {
            char path[256];
            snprintf(path, sizeof path, "dev/fixtures/pt/unet_%s_%s.pt", models[m], kinds[k]);
            if (safetensors_open(path, &f, err, sizeof err) != 0) { printf("  %s\n", err); CHECK(0); continue; }
            double tolerance = k < 2 ? 0 : k < 4 ? 0x1p-11 : 0x1p-8;  // float's rounding to fp16 / bf16 (relative)
            int same = f.count > 50, compared = 0;
            for (int i = 0; same && i < f.count; i++) {
                const SafeTensor *got = &f.tensors[i], *ref = safetensors_find(&want, got->name);
                same = ref && ref->numel == got->numel && ref->ndim == got->ndim;
                float *a = (float *)malloc(got->numel * sizeof(float)), *b = (float *)malloc(got->numel * sizeof(float));
                same = same && a && b && safetensors_get_float(got, a) == 0 && safetensors_get_float(ref, b) == 0;
                for (int64_t j = 0; same && j < got->numel; j++) same = fabsf(a[j] - b[j]) <= tolerance * fabsf(b[j]) + (k < 2 ? 0 : 1e-7f);
                if (!same) printf("  %s: %s differs from the fixture's\n", path, got->name);
                compared += same;
                free(a), free(b);
            }
            if (same) printf("  %s: %d tensors equal the fixture's%s\n", path, compared, k < 2 ? " bit for bit" : " to their rounding");
            CHECK(same);
            safetensors_close(&f);
        }
        safetensors_close(&want);
    }

    check_case(".pt zip: a name twice anywhere in the directory is refused (Python's zipfile reads the last entry, zip_find the first)");
    {
        const int64_t shape[1] = {2}, stride[1] = {1};
        Bytes first, last, ones, twos, order = {"little", 6}, z;
        float one[2] = {1, 1}, two[2] = {2, 2}, value = 0;
        pickle_tensor(&first, "first", "0", 2, 1, shape, stride), pickle_tensor(&last, "last", "0", 2, 1, shape, stride);
        ones.n = twos.n = 0, put(&ones, one, sizeof one), put(&twos, two, sizeof two);
        int count = 0;
        ZipItem plain[3] = {{"archive/data.pkl", &first}, {"archive/data/0", &ones}, {"archive/byteorder", &order}};
        zip_of(&z, plain, 3);  // the same file with each name once: read
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) == 0 && count == 1 && value == 1);
        ZipItem pkl[3] = {{"archive/data.pkl", &first}, {"archive/data/0", &ones}, {"archive/data.pkl", &last}};
        zip_of(&z, pkl, 3);  // data.pkl twice, another entry between them
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) != 0 && strstr(err, "archive/data.pkl appears twice"));
        ZipItem storage[4] = {{"archive/data.pkl", &first}, {"archive/data/0", &ones}, {"archive/byteorder", &order}, {"archive/data/0", &twos}};
        zip_of(&z, storage, 4);  // a storage twice, another entry between them
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) != 0 && strstr(err, "archive/data/0 appears twice"));
    }

    check_case(".pt zip: a local header in the file's last 30 bytes is refused before its name is read (past the end)");
    {
        Bytes z = {{0}, 0};  // the directory's one entry, its end record, then the entry's local header and nothing more
        const char *name = "archive/data.pkl";
        zip_central(&z, name, 0, 46 + strlen(name) + 22);
        zip_end(&z, 1, 0);
        zip_local(&z, name, 0);
        z.n -= strlen(name);  // the header's 30 bytes end the file; its name would be the 16 after
        int count = 0;
        float value = 0;
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) != 0 && strstr(err, "local header is missing"));
    }

    check_case(".pt: sizes whose product passes 2^63 ([2^24, 2^40]) are refused, not wrapped to 0 elements");
    {
        const int64_t fits[2] = {2, 3}, fits_stride[2] = {3, 1};
        const int64_t huge[2] = {(int64_t)1 << 24, (int64_t)1 << 40}, huge_stride[2] = {(int64_t)1 << 40, 1};
        Bytes pickle, data = {{0}, 24}, z;
        int count = 0;
        float value = 0;
        pickle_tensor(&pickle, "w", "0", 6, 2, fits, fits_stride);
        ZipItem items[2] = {{"archive/data.pkl", &pickle}, {"archive/data/0", &data}};
        zip_of(&z, items, 2);
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) == 0 && count == 1 && value == 0);
        pickle_tensor(&pickle, "w", "0", 6, 2, huge, huge_stride);
        zip_of(&z, items, 2);
        CHECK(parse_pt(&z, &count, &value, err, sizeof err) != 0 && strstr(err, "more than 2^40 elements"));
    }

    check_case(".pt: a memo slot past the pickle's length is refused (a few bytes would cost a memo of 2^22 slots)");
    {
        const int64_t shape[1] = {2}, stride[1] = {1};
        const char *memo_put[2] = {"q\x00", "r\xff\xff\x3f\x00"};  // after the dict: slot 0, as a pickler numbers it; slot 2^22 - 1
        const size_t memo_put_bytes[2] = {2, 5};
        Bytes pickle, memo, data = {{0}, 8}, z;
        ZipItem items[2] = {{"archive/data.pkl", &memo}, {"archive/data/0", &data}};
        pickle_tensor(&pickle, "w", "0", 2, 1, shape, stride);  // "\x80\x02}" (protocol 2, the dict), then its item
        for (int i = 0; i < 2; i++) {
            memo.n = 0, put(&memo, pickle.bytes, 3), put(&memo, memo_put[i], memo_put_bytes[i]), put(&memo, pickle.bytes + 3, pickle.n - 3);
            zip_of(&z, items, 2);
            int count = 0;
            float value = -1;
            int r = parse_pt(&z, &count, &value, err, sizeof err);
            CHECK(i == 0 ? r == 0 && count == 1 && value == 0 : r != 0 && strstr(err, "memo slot past the pickle's length") != NULL);
        }
    }

    check_case("corpus: every good training state is read, every bad one refused with one line");
    CHECK(check_corpus("dev/test/corpus/state", 1) == 0);

    check_case("safetensors: escapes decode to UTF-8, names and metadata are found");
    CHECK(safetensors_open("dev/test/corpus/safetensors/good_escapes.safetensors", &f, err, sizeof err) == 0);
    CHECK(f.count == 1 && safetensors_find(&f, "caf\xc3\xa9 \xf0\x9f\x98\x80 \"q\" \\ / \n") != NULL);
    CHECK(safetensors_metadata(&f, "k\tey") && strcmp(safetensors_metadata(&f, "k\tey"), "v\xe2\x82\xac" "l") == 0);
    float one;
    CHECK(safetensors_get_float(&f.tensors[0], &one) == 0 && one == 1.0f);
    safetensors_close(&f);

    check_case("safetensors: tensors sorted by name are found by name; the data tiles in any order");
    float values[3] = {1, 2, 3};
    const char *path = write_file("order.safetensors",
                                  "{\"c\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                                  "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[8,12]},"
                                  "\"b\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}", values, sizeof values);
    CHECK(safetensors_open(path, &f, err, sizeof err) == 0);
    float got[3];
    const char *names[3] = {"c", "b", "a"};
    for (int i = 0; i < 3; i++) CHECK(safetensors_get_float(safetensors_find(&f, names[i]), &got[i]) == 0 && got[i] == values[i]);
    CHECK(safetensors_find(&f, "d") == NULL);
    safetensors_close(&f);

    check_case("safetensors: what the writer writes reads back unchanged (names, shapes, values, escaped metadata)");
    float weights[6] = {0.5f, -1.25f, 3e-8f, 7, -0.0f, 1e30f}, bias[2] = {1, -2};
    int weight_shape[4] = {2, 1, 1, 3}, bias_shape[1] = {2};
    SafeTensorOut out[2] = {{"conv.weight", 4, weight_shape, 6, weights, NULL}, {"conv.bias", 1, bias_shape, 2, bias, NULL}};
    MetaPair written_meta[2] = {{"note", "\"quoted\" \\ tab\t caf\xc3\xa9"}, {"image_size", "64"}};
    snprintf(header, sizeof header, "%s/written.safetensors", tmp_dir);
    CHECK(safetensors_write(header, out, 2, written_meta, 2) == 0);
    CHECK(safetensors_open(header, &f, err, sizeof err) == 0);
    const SafeTensor *w = safetensors_find(&f, "conv.weight"), *b = safetensors_find(&f, "conv.bias");
    float read_w[6], read_b[2];
    CHECK(f.count == 2 && w && b && w->ndim == 4 && w->shape[0] == 2 && w->shape[3] == 3 && b->ndim == 1 && b->shape[0] == 2);
    CHECK(w && b && safetensors_get_float(w, read_w) == 0 && safetensors_get_float(b, read_b) == 0);
    CHECK(memcmp(read_w, weights, sizeof weights) == 0 && memcmp(read_b, bias, sizeof bias) == 0);
    CHECK(safetensors_metadata(&f, "note") && strcmp(safetensors_metadata(&f, "note"), written_meta[0].value) == 0);
    CHECK(safetensors_metadata(&f, "image_size") && strcmp(safetensors_metadata(&f, "image_size"), "64") == 0);
    CHECK(f.file.size % 8 == 0);  // 8 + header + 32 data bytes: the header pads the data to 8-byte alignment
    safetensors_close(&f);
    snprintf(header, sizeof header, "%s/no such folder/x.safetensors", tmp_dir);
    CHECK(safetensors_write(header, out, 2, written_meta, 2) == -1 && errno == ENOENT);

    check_case("safetensors: NaN or infinite values are reported by the conversion");
    float bad[2] = {1, INFINITY};
    path = write_file("inf.safetensors", "{\"x\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}", bad, sizeof bad);
    CHECK(safetensors_open(path, &f, err, sizeof err) == 0 && safetensors_get_float(&f.tensors[0], got) == -2);
    safetensors_close(&f);

    check_case("safetensors: at most 4096 metadata entries; more is refused, not read");
    size_t cap = 64 * 5000;
    char *big = (char *)malloc(cap);
    for (int keys = 4096; keys <= 4097; keys++) {
        size_t len = (size_t)snprintf(big, cap, "{\"__metadata__\":{");
        for (int k = 0; k < keys; k++) len += (size_t)snprintf(big + len, cap - len, "%s\"key%d\":\"%d\"", k ? "," : "", k, k);
        snprintf(big + len, cap - len, "}}");
        path = write_file("metadata.safetensors", big, NULL, 0);
        int r = safetensors_open(path, &f, err, sizeof err);
        CHECK(keys == 4096 ? r == 0 && f.meta_count == 4096 && strcmp(safetensors_metadata(&f, "key4095"), "4095") == 0
                           : r != 0 && strstr(err, "4096") != NULL);
        if (r == 0) safetensors_close(&f);
    }
    free(big);

    check_case("safetensors: a FIFO, a folder or a missing file is refused at once");
    snprintf(header, sizeof header, "%s/fifo.safetensors", tmp_dir);
    CHECK(mkfifo(header, 0600) == 0);
    pid_t child = fork();
    if (child == 0) {  // if the open blocked, the alarm would end the child and fail the case
        alarm(20);
        _exit(safetensors_open(header, &f, err, sizeof err) != 0 && strstr(err, "not a regular file") ? 0 : 1);
    }
    int status = -1;
    waitpid(child, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    CHECK(safetensors_open(tmp_dir, &f, err, sizeof err) != 0 && strstr(err, "not a regular file"));
    CHECK(safetensors_open("/nonexistent/x.safetensors", &f, err, sizeof err) != 0 && strstr(err, "cannot open"));

    check_case("state: a valid state's header and moments are read back");
    MappedFile m;
    StateHeader h;
    CHECK(map_regular_file("dev/test/corpus/state/good_state.bin", "training state", &m, err, sizeof err) == 0);
    CHECK(state_check(m.bytes, m.size, &h, err, sizeof err) == 0 && h.step == 5 && h.storage == 3 && h.loader_next == 2 &&
          strcmp(h.noise_schedule, "linear") == 0);
    unmap_file(&m);

    snprintf(header, sizeof header, "rm -rf %s", tmp_dir);
    CHECK(system(header) == 0);
    return check_summary();
}
