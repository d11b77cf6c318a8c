// checkpoint.h: reading the files a checkpoint is made of, checked as untrusted input: safetensors
// (the weights; also the test fixtures and generate --eval's files) and state.bin (the training
// state). Plain C11 that also compiles as C++17: train_unet.cu includes it, and so do the fuzz
// targets in dev/fuzz, which run these readers under libFuzzer with ASan and UBSan.
//
// Every reader takes the file's bytes and their count, reads nothing outside them, costs time and
// memory linear in their size, and returns 0 or -1 with one line saying what is wrong.
#ifndef CHECKPOINT_H
#define CHECKPOINT_H

#include <math.h>
#include <stddef.h>
#include <stdlib.h>

#include "fileio.h"      // error_line, map_regular_file
#include "ptfile.h"      // PyTorch's .pt files, into the same SafeTensorsFile
#include "tensorfile.h"  // SafeTensorsFile: the tensors and metadata a file holds, found by name

// ----------------------------------------------------------------------------------------------
// safetensors: an 8-byte little-endian header length, a JSON header
// {"name": {"dtype": "F32", "shape": [...], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value", ...}} (white space may pad it), then the data; offsets count
// from the end of the header. As the reference reader (the safetensors library) does, this one
// refuses duplicate keys, anything but white space after the JSON object, metadata values that
// are not strings, and tensors that do not tile the data section exactly (no gaps, no overlaps,
// no trailing bytes).

#define SAFETENSORS_MAX_HEADER (100u << 20)
#define SAFETENSORS_MAX_TENSORS 100000
#define SAFETENSORS_MAX_METADATA 4096
#define SAFETENSORS_MAX_NUMEL ((int64_t)1 << 40)

// A cursor over the JSON header; the first error wins and stops the parse.
typedef struct {
    const char *p, *end;
    char error[160];
} JsonCursor;

static inline int json_fail(JsonCursor *j, const char *what) {
    if (!j->error[0]) snprintf(j->error, sizeof j->error, "%s", what);
    return 0;
}

static inline void json_space(JsonCursor *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}

// Consumes the character c after white space; 1 if it was there. Never fails by itself.
static inline int json_take(JsonCursor *j, char c) {
    json_space(j);
    if (j->p < j->end && *j->p == c) return j->p++, 1;
    return 0;
}

static inline int json_expect(JsonCursor *j, char c, const char *what) { return json_take(j, c) || json_fail(j, what); }

static inline int json_hex4(const char *p) {
    int v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (d < 0) return -1;
        v = 16 * v + d;
    }
    return v;
}

// Parses a JSON string into a new heap string of exactly its decoded size (escapes decoded,
// \uXXXX and surrogate pairs to UTF-8). Refuses control characters, \u0000 (names are C strings)
// and lone surrogates. Returns NULL on error.
static inline char *json_string(JsonCursor *j) {
    if (!json_expect(j, '"', "a string")) return NULL;
    const char *start = j->p;
    size_t bytes = 0;  // an upper bound of the decoded size: escapes only shrink
    while (j->p < j->end && *j->p != '"') {
        if (*j->p == '\\' && j->p + 1 < j->end) j->p++;
        j->p++, bytes++;
    }
    if (j->p >= j->end) return json_fail(j, "a closing quote"), (char *)NULL;
    const char *stop = j->p++;
    char *out = (char *)malloc(bytes + 1), *o = out;
    if (!out) return json_fail(j, "a string that fits in memory"), (char *)NULL;
    for (const char *p = start; p < stop;) {
        unsigned char c = (unsigned char)*p++;
        if (c < 0x20) return free(out), json_fail(j, "no control characters in a string"), (char *)NULL;
        if (c != '\\') { *o++ = (char)c; continue; }
        c = (unsigned char)*p++;
        const char *simple = "\"\\/bfnrt", *decoded = "\"\\/\b\f\n\r\t";
        const char *k = c ? strchr(simple, c) : NULL;
        if (k) { *o++ = decoded[k - simple]; continue; }
        long code = c == 'u' && stop - p >= 4 ? json_hex4(p) : -1;
        if (code >= 0) p += 4;
        if (code >= 0xd800 && code < 0xdc00) {  // a high surrogate: a low one must follow
            long low = stop - p >= 6 && p[0] == '\\' && p[1] == 'u' ? json_hex4(p + 2) : -1;
            code = low >= 0xdc00 && low < 0xe000 ? 0x10000 + ((code - 0xd800) << 10) + (low - 0xdc00) : -1;
            if (code >= 0) p += 6;
        } else if (code >= 0xdc00 && code < 0xe000) {
            code = -1;
        }
        if (code <= 0) return free(out), json_fail(j, "a valid escape (\\u0000 and lone surrogates are refused)"), (char *)NULL;
        if (code < 0x80) *o++ = (char)code;
        else if (code < 0x800) *o++ = (char)(0xc0 | code >> 6), *o++ = (char)(0x80 | (code & 0x3f));
        else if (code < 0x10000)
            *o++ = (char)(0xe0 | code >> 12), *o++ = (char)(0x80 | ((code >> 6) & 0x3f)), *o++ = (char)(0x80 | (code & 0x3f));
        else
            *o++ = (char)(0xf0 | code >> 18), *o++ = (char)(0x80 | ((code >> 12) & 0x3f)),
            *o++ = (char)(0x80 | ((code >> 6) & 0x3f)), *o++ = (char)(0x80 | (code & 0x3f));
    }
    *o = '\0';
    return out;
}

// A whole number in int64 range: an optional minus and decimal digits, nothing else (no fraction
// or exponent). Reads only inside the header.
static inline int json_int(JsonCursor *j, int64_t *out) {
    json_space(j);
    int negative = j->p < j->end && *j->p == '-';
    const char *p = j->p + negative, *digits = p;
    uint64_t v = 0, limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
    for (; p < j->end && *p >= '0' && *p <= '9'; p++) {
        unsigned d = (unsigned)(*p - '0');
        if (v > (limit - d) / 10) return json_fail(j, "an integer in 64-bit range");
        v = 10 * v + d;
    }
    if (p == digits || (p < j->end && (*p == '.' || *p == 'e' || *p == 'E'))) return json_fail(j, "an integer");
    j->p = p;
    *out = negative ? (int64_t)(0 - v) : (int64_t)v;
    return 1;
}

// Parses [n, n, ...] into out (at most max entries); returns the count, or -1.
static inline int json_int_array(JsonCursor *j, int64_t *out, int max) {
    if (!json_expect(j, '[', "an array")) return -1;
    int n = 0;
    if (json_take(j, ']')) return 0;
    do {
        if (n == max) return json_fail(j, "a shorter array"), -1;
        if (!json_int(j, &out[n++])) return -1;
    } while (json_take(j, ','));
    return json_expect(j, ']', "',' or ']'") ? n : -1;
}

// Parses one tensor entry {"dtype": ..., "shape": [...], "data_offsets": [b, e]}: each key once,
// no others; the dtype known; the shape's element count bounded and matching the byte count.
static inline int safetensors_entry(JsonCursor *j, SafeTensor *t, char *err, size_t err_len) {
    int64_t offsets[2];
    int have_dtype = 0, have_shape = 0, have_offsets = 0;
    if (!json_expect(j, '{', "'{' opening a tensor entry")) return -1;
    do {
        char *key = json_string(j);
        if (!key || !json_expect(j, ':', "':'")) return free(key), -1;
        if (strcmp(key, "dtype") == 0 && !have_dtype) {
            char *v = json_string(j);
            if (v && strlen(v) < sizeof t->dtype) snprintf(t->dtype, sizeof t->dtype, "%s", v);
            have_dtype = v != NULL;
            free(v);
        } else if (strcmp(key, "shape") == 0 && !have_shape) {
            t->ndim = json_int_array(j, t->shape, SAFETENSORS_MAX_DIMS);
            have_shape = 1;
        } else if (strcmp(key, "data_offsets") == 0 && !have_offsets) {
            if (json_int_array(j, offsets, 2) != 2) json_fail(j, "two data offsets");
            have_offsets = 1;
        } else {
            json_fail(j, "dtype, shape and data_offsets, each once");
        }
        free(key);
        if (j->error[0]) return -1;
    } while (json_take(j, ','));
    if (!json_expect(j, '}', "',' or '}' in a tensor entry")) return -1;
    if (!have_dtype || !have_shape || !have_offsets)
        return error_line(err, err_len, "tensor %s lacks its %s", t->name, !have_dtype ? "dtype" : !have_shape ? "shape" : "data_offsets");
    int size = safetensors_dtype_bytes(t->dtype);
    if (!size) return error_line(err, err_len, "tensor %s has an unknown dtype", t->name);
    t->numel = 1;
    for (int d = 0; d < t->ndim; d++) {
        if (t->shape[d] < 0 || t->shape[d] > SAFETENSORS_MAX_NUMEL || (t->shape[d] && t->numel > SAFETENSORS_MAX_NUMEL / t->shape[d]))
            return error_line(err, err_len, "tensor %s has an absurd shape", t->name);
        t->numel *= t->shape[d];
    }
    if (offsets[0] < 0 || offsets[1] < offsets[0] || offsets[1] - offsets[0] != t->numel * size)
        return error_line(err, err_len, "tensor %s: data offsets [%lld, %lld] do not hold its %lld %s values", t->name,
                            (long long)offsets[0], (long long)offsets[1], (long long)t->numel, t->dtype);
    t->begin = (uint64_t)offsets[0], t->end = (uint64_t)offsets[1];
    return 0;
}

// Parses the metadata object {"key": "value", ...} (string values only).
static inline int safetensors_metadata_object(JsonCursor *j, SafeTensorsFile *f, int *capacity) {
    if (!json_expect(j, '{', "'{' opening __metadata__")) return -1;
    if (json_take(j, '}')) return 0;
    do {
        char *key = json_string(j), *value = key && json_expect(j, ':', "':'") ? json_string(j) : NULL;
        if (!value) return free(key), json_fail(j, "string metadata values"), -1;
        if (f->meta_count == SAFETENSORS_MAX_METADATA) return free(key), free(value), json_fail(j, "at most 4096 metadata entries"), -1;
        if (f->meta_count == *capacity) {
            *capacity = *capacity ? 2 * *capacity : 32;
            MetaPair *grown = (MetaPair *)realloc(f->meta, *capacity * sizeof(MetaPair));
            if (!grown) return free(key), free(value), json_fail(j, "metadata that fits in memory"), -1;
            f->meta = grown;
        }
        f->meta[f->meta_count].key = key, f->meta[f->meta_count++].value = value;
    } while (json_take(j, ','));
    return json_expect(j, '}', "',' or '}' in __metadata__") ? 0 : -1;
}

static inline int safetensors_by_offset(const void *a, const void *b) {
    const SafeTensor *x = *(const SafeTensor *const *)a, *y = *(const SafeTensor *const *)b;
    return x->begin != y->begin ? (x->begin > y->begin) - (x->begin < y->begin) : (x->end > y->end) - (x->end < y->end);
}

// Sorts the metadata by key and refuses a key given twice.
static inline int safetensors_sort_metadata(SafeTensorsFile *f, char *err, size_t err_len) {
    if (f->meta_count) qsort(f->meta, f->meta_count, sizeof(MetaPair), safetensors_by_key);
    for (int i = 1; i < f->meta_count; i++)
        if (strcmp(f->meta[i - 1].key, f->meta[i].key) == 0)
            return error_line(err, err_len, "metadata key \"%s\" appears twice", f->meta[i].key);
    return 0;
}

// Checks that the tensors tile the data section: sorted by offset, each begins where the one
// before ends, the first at 0, the last at the end of the data. Then points each at its bytes.
static inline int safetensors_check_offsets(SafeTensorsFile *f, const uint8_t *data, uint64_t data_bytes, char *err, size_t err_len) {
    SafeTensor **order = (SafeTensor **)malloc((f->count + 1) * sizeof(SafeTensor *));
    if (!order) return error_line(err, err_len, "out of memory reading the header");
    for (int i = 0; i < f->count; i++) order[i] = &f->tensors[i];
    qsort(order, f->count, sizeof *order, safetensors_by_offset);
    uint64_t at = 0;
    int r = 0;
    for (int i = 0; r == 0 && i < f->count; i++) {
        if (order[i]->begin != at)
            r = error_line(err, err_len, "tensor %s begins at byte %llu of the data, not at %llu where the one before ends "
                             "(overlapping or missing data)", order[i]->name, (unsigned long long)order[i]->begin, (unsigned long long)at);
        at = order[i]->end;
    }
    if (r == 0 && at != data_bytes)
        r = error_line(err, err_len, "the tensors hold %llu bytes of data but the file has %llu after the header",
                         (unsigned long long)at, (unsigned long long)data_bytes);
    for (int i = 0; r == 0 && i < f->count; i++) f->tensors[i].data = data + f->tensors[i].begin;
    free(order);
    return r;
}

// Parses a safetensors file held in memory (bytes stay owned by the caller and must outlive f).
// Returns 0, or -1 with a message.
static inline int safetensors_parse(const uint8_t *bytes, uint64_t size, SafeTensorsFile *f, char *err, size_t err_len) {
    memset(f, 0, sizeof *f);
    uint64_t header_bytes = 0;
    if (size < 8) return error_line(err, err_len, "%llu bytes: too short for a safetensors file", (unsigned long long)size);
    for (int i = 7; i >= 0; i--) header_bytes = header_bytes << 8 | bytes[i];
    if (header_bytes < 2 || header_bytes > SAFETENSORS_MAX_HEADER || header_bytes > size - 8)
        return error_line(err, err_len, "header length %llu does not fit the file's %llu bytes: not a safetensors file, or truncated",
                            (unsigned long long)header_bytes, (unsigned long long)size);
    const uint8_t *data = bytes + 8 + header_bytes;
    JsonCursor j;
    memset(&j, 0, sizeof j);
    j.p = (const char *)bytes + 8, j.end = (const char *)data;
    char why[320] = "";
    int capacity = 0, meta_capacity = 0, have_metadata = 0;
    if (json_expect(&j, '{', "'{' opening the header") && !json_take(&j, '}')) {
        do {
            char *name = json_string(&j);
            if (!name || !json_expect(&j, ':', "':'")) { free(name); break; }
            if (strcmp(name, "__metadata__") == 0) {
                free(name);
                if (have_metadata++) { json_fail(&j, "one __metadata__"); break; }
                if (safetensors_metadata_object(&j, f, &meta_capacity) != 0) break;
                continue;
            }
            if (f->count == SAFETENSORS_MAX_TENSORS) { free(name), json_fail(&j, "at most 100000 tensors"); break; }
            if (f->count == capacity) {
                capacity = capacity ? 2 * capacity : 64;
                SafeTensor *grown = (SafeTensor *)realloc(f->tensors, capacity * sizeof(SafeTensor));
                if (!grown) { free(name), json_fail(&j, "a header that fits in memory"); break; }
                f->tensors = grown;
            }
            SafeTensor *t = &f->tensors[f->count++];
            memset(t, 0, sizeof *t);
            t->name = name;
            if (safetensors_entry(&j, t, why, sizeof why) != 0) break;
        } while (json_take(&j, ','));
        if (!why[0] && !j.error[0]) json_expect(&j, '}', "',' or '}' closing the header");
    }
    json_space(&j);
    if (!why[0] && !j.error[0] && j.p != j.end) json_fail(&j, "only white space after the header's JSON");
    if (!why[0] && j.error[0])
        snprintf(why, sizeof why, "malformed header: expected %s at byte %ld", j.error, (long)(j.p - (const char *)bytes));
    if (!why[0]) {
        if (f->count) qsort(f->tensors, f->count, sizeof(SafeTensor), safetensors_by_name);
        for (int i = 1; !why[0] && i < f->count; i++)
            if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0)
                snprintf(why, sizeof why, "tensor %s appears twice in the header", f->tensors[i].name);
    }
    if (!why[0]) safetensors_sort_metadata(f, why, sizeof why);
    if (!why[0]) safetensors_check_offsets(f, data, size - 8 - header_bytes, why, sizeof why);
    if (why[0]) {
        safetensors_close(f);
        return error_line(err, err_len, "%s", why);
    }
    return 0;
}

// Maps and parses file `path` of folder `dir` (a handle, or AT_FDCWD): a safetensors file, or a
// state_dict that torch.save wrote (ptfile.h); `shown` names it in messages. Returns 0, or -1 with
// a message.
static inline int safetensors_open_at(int dir, const char *path, const char *shown, SafeTensorsFile *f, char *err, size_t err_len) {
    memset(f, 0, sizeof *f);
    MappedFile m;
    if (map_regular_file_at(dir, path, shown, "weights file", &m, err, err_len) != 0) return -1;
    char why[400];
    int torch = pt_is_torch_file(m.bytes, m.size);
    if ((torch ? pt_parse(m.bytes, m.size, f, why, sizeof why) : safetensors_parse(m.bytes, m.size, f, why, sizeof why)) != 0) {
        unmap_file(&m);
        return error_line(err, err_len, "%s: %s", shown, why);
    }
    f->file = m;
    return 0;
}

static inline int safetensors_open(const char *path, SafeTensorsFile *f, char *err, size_t err_len) {
    return safetensors_open_at(AT_FDCWD, path, path, f, err, err_len);
}

static inline float bf16_bits_to_float(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, 4);
    return x;
}

static inline float f16_bits_to_float(uint16_t h) {
    int exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
    float magnitude = exponent == 0    ? ldexpf((float)mantissa, -24)
                      : exponent == 31 ? (mantissa ? NAN : INFINITY)
                                       : ldexpf((float)(mantissa | 0x400), exponent - 25);
    return (h & 0x8000) ? -magnitude : magnitude;
}

// Copies a floating-point tensor (F32, F64, BF16 or F16) into out as float. Returns 0, -1 for
// another dtype, or -2 when a value is NaN or infinite (weights and inputs must be finite).
static inline int safetensors_get_float(const SafeTensor *t, float *out) {
    const uint8_t *d = t->data;
    int kind = strcmp(t->dtype, "F32") == 0 ? 0 : strcmp(t->dtype, "F64") == 0 ? 1 : strcmp(t->dtype, "BF16") == 0 ? 2
             : strcmp(t->dtype, "F16") == 0 ? 3 : -1;
    if (kind < 0) return -1;
    int finite = 1;
    for (int64_t i = 0; i < t->numel; i++) {
        if (kind == 0) memcpy(&out[i], d + 4 * i, 4);
        else if (kind == 1) { double v; memcpy(&v, d + 8 * i, 8); out[i] = (float)v; }
        else { uint16_t v; memcpy(&v, d + 2 * i, 2); out[i] = kind == 2 ? bf16_bits_to_float(v) : f16_bits_to_float(v); }
        finite &= isfinite(out[i]) != 0;
    }
    return finite ? 0 : -2;
}

// Copies a floating-point tensor (F64 or F32) into out as double. Returns 0, -1 for another dtype,
// or -2 when a value is NaN or infinite.
static inline int safetensors_get_double(const SafeTensor *t, double *out) {
    int wide = strcmp(t->dtype, "F64") == 0;
    if (!wide && strcmp(t->dtype, "F32") != 0) return -1;
    int finite = 1;
    for (int64_t i = 0; i < t->numel; i++) {
        if (wide) memcpy(&out[i], t->data + 8 * i, 8);
        else { float v; memcpy(&v, t->data + 4 * i, 4); out[i] = v; }
        finite &= isfinite(out[i]) != 0;
    }
    return finite ? 0 : -2;
}

// Copies an integer tensor (I64 or I32) into out. Returns 0, or -1.
static inline int safetensors_get_int64(const SafeTensor *t, int64_t *out) {
    int wide = strcmp(t->dtype, "I64") == 0;
    if (!wide && strcmp(t->dtype, "I32") != 0) return -1;
    for (int64_t i = 0; i < t->numel; i++) {
        if (wide) memcpy(&out[i], t->data + 8 * i, 8);
        else { int32_t v; memcpy(&v, t->data + 4 * i, 4); out[i] = v; }
    }
    return 0;
}

// ----------------------------------------------------------------------------------------------
// Writing safetensors: fp32 tensors (fp64 where values64 is given) in the order given, the metadata
// first in the header, the data 8-byte aligned. What this writes, the reader above reads back
// unchanged.

typedef struct {
    const char *name;
    int ndim;
    const int *shape;
    int64_t numel;
    const float *values;
    const double *values64;  // instead of values: an F64 tensor
} SafeTensorOut;

// The header as it grows; a failed allocation marks it failed and stops it growing.
typedef struct {
    char *text;
    size_t len, cap;
    int failed;
} HeaderText;

static inline int header_reserve(HeaderText *h, size_t more) {
    if (h->failed) return -1;
    if (h->len + more < h->cap) return 0;
    size_t cap = 2 * (h->len + more) + 256;
    char *grown = (char *)realloc(h->text, cap);
    if (!grown) return h->failed = 1, -1;
    h->text = grown, h->cap = cap;
    return 0;
}

static inline void header_put(HeaderText *h, const char *fmt, ...) {
    va_list args;
    va_start(args, fmt);
    int n = vsnprintf(NULL, 0, fmt, args);
    va_end(args);
    if (n < 0 || header_reserve(h, (size_t)n + 1) != 0) return;
    va_start(args, fmt);
    vsnprintf(h->text + h->len, h->cap - h->len, fmt, args);
    va_end(args);
    h->len += (size_t)n;
}

// A JSON string: quoted, with quotes, backslashes and control characters escaped.
static inline void header_put_string(HeaderText *h, const char *s) {
    if (header_reserve(h, 6 * strlen(s) + 3) != 0) return;
    char *o = h->text + h->len;
    *o++ = '"';
    for (; *s; s++) {
        if ((unsigned char)*s < 0x20) { o += sprintf(o, "\\u%04x", (unsigned char)*s); continue; }
        if (*s == '"' || *s == '\\') *o++ = '\\';
        *o++ = *s;
    }
    *o++ = '"';
    *o = '\0';
    h->len = (size_t)(o - h->text);
}

// Writes the tensors and metadata to path and syncs the file. Returns 0, or -1 with errno set
// (the caller writes to a temporary name and renames, so a failure leaves nothing half-written
// under the final name).
static inline int safetensors_write(const char *path, const SafeTensorOut *tensors, int count, const MetaPair *meta,
                                    int meta_count) {
    HeaderText h = {NULL, 0, 0, 0};
    header_put(&h, "{\"__metadata__\":{");
    for (int i = 0; i < meta_count; i++) {
        if (i) header_put(&h, ",");
        header_put_string(&h, meta[i].key);
        header_put(&h, ":");
        header_put_string(&h, meta[i].value);
    }
    header_put(&h, "}");
    uint64_t offset = 0;
    for (int i = 0; i < count; i++) {
        const SafeTensorOut *t = &tensors[i];
        header_put(&h, ",");
        header_put_string(&h, t->name);
        int bytes = t->values64 ? 8 : 4;
        header_put(&h, ":{\"dtype\":\"%s\",\"shape\":[", t->values64 ? "F64" : "F32");
        for (int d = 0; d < t->ndim; d++) header_put(&h, d ? ",%d" : "%d", t->shape[d]);
        header_put(&h, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset, (unsigned long long)(offset + bytes * t->numel));
        offset += bytes * (uint64_t)t->numel;
    }
    header_put(&h, "}");
    while (h.len % 8) header_put(&h, " ");  // data starts 8-byte aligned
    if (h.failed) return free(h.text), errno = ENOMEM, -1;
    FILE *f = fopen(path, "wb");
    if (!f) return free(h.text), -1;
    uint64_t header_bytes = h.len;
    int ok = fwrite(&header_bytes, 8, 1, f) == 1 && fwrite(h.text, 1, h.len, f) == h.len;
    for (int i = 0; ok && i < count; i++) {
        const SafeTensorOut *t = &tensors[i];
        ok = t->values64 ? fwrite(t->values64, 8, (size_t)t->numel, f) == (size_t)t->numel : fwrite(t->values, 4, (size_t)t->numel, f) == (size_t)t->numel;
    }
    ok = ok && fflush(f) == 0 && fsync(fileno(f)) == 0;
    ok = (fclose(f) == 0) && ok;
    free(h.text);
    return ok ? 0 : -1;
}

// ----------------------------------------------------------------------------------------------
// state.bin, the training state: the StateHeader, then AdamW's m and v as [storage] fp32 each in
// the GPU layout, then the schedule sampler's history if it has one (--schedule_sampler
// loss-second-moment): [history_steps] int32 counts, then [history_steps][history_length] fp32
// losses. Little-endian, as written by the machine that trained. Version 1 (no history, a header
// without its two fields) is still read.

#define STATE_MAGIC "UNETSTAT"
#define STATE_VERSION 2u
#define STATE_MAX_STORAGE ((int64_t)1 << 36)  // parameters: far above any model this trains

typedef struct {
    char magic[8];
    uint32_t version, num_params;
    int64_t step, storage;
    int64_t seed;
    uint64_t loader_epoch, loader_next;
    int32_t batch_size, diffusion_steps;
    char noise_schedule[16], predict[8];
    int32_t history_steps, history_length;  // the schedule sampler's history: both 0 when it has none
} StateHeader;

// The header's size in a file of this version.
static inline size_t state_header_size(uint32_t version) {
    return version == 1 ? offsetof(StateHeader, history_steps) : sizeof(StateHeader);
}

// Where the moments and the history lie in a checked state.
static inline const uint8_t *state_moments(const uint8_t *bytes, const StateHeader *h) { return bytes + state_header_size(h->version); }
static inline const uint8_t *state_history(const uint8_t *bytes, const StateHeader *h) {
    return state_moments(bytes, h) + 2 * (uint64_t)h->storage * sizeof(float);
}

// Checks a training state held in memory on its own (the caller compares it with the model):
// header fields in range, strings terminated and known, the size exact, every moment finite and
// every second moment non-negative. Returns 0, or -1 with a message.
static inline int state_check(const uint8_t *bytes, uint64_t size, StateHeader *h, char *err, size_t err_len) {
    memset(h, 0, sizeof *h);
    if (size < state_header_size(1)) return error_line(err, err_len, "%llu bytes: shorter than a training state's header", (unsigned long long)size);
    memcpy(h, bytes, state_header_size(1));
    if (memcmp(h->magic, STATE_MAGIC, 8) != 0) return error_line(err, err_len, "not a training state (bad magic)");
    if (h->version != 1 && h->version != STATE_VERSION)
        return error_line(err, err_len, "training state version %u, this build reads 1 to %u", h->version, STATE_VERSION);
    if (size < state_header_size(h->version)) return error_line(err, err_len, "%llu bytes: shorter than a training state's header", (unsigned long long)size);
    memcpy(h, bytes, state_header_size(h->version));
    if (h->storage < 1 || h->storage > STATE_MAX_STORAGE || h->num_params < 1 || h->num_params > (uint64_t)h->storage)
        return error_line(err, err_len, "training state of %lld values in %u tensors: out of range", (long long)h->storage, h->num_params);
    if (h->step < 0 || h->seed < 0 || h->batch_size < 1 || h->diffusion_steps < 1 || h->diffusion_steps > 100000 ||
        h->loader_next > UINT32_MAX || h->loader_epoch > (uint64_t)INT64_MAX)
        return error_line(err, err_len, "training state header holds out-of-range values (step, seed, batch, diffusion steps or data position)");
    if ((h->history_steps || h->history_length) && (h->history_steps != h->diffusion_steps || h->history_length < 1 || h->history_length > 1000))
        return error_line(err, err_len, "training state holds a schedule sampler's history of %d timesteps of %d losses: it trained with %d "
                          "diffusion steps", h->history_steps, h->history_length, h->diffusion_steps);
    uint64_t history_bytes = (uint64_t)h->history_steps * (sizeof(int32_t) + (uint64_t)h->history_length * sizeof(float));
    uint64_t expected = state_header_size(h->version) + 2 * (uint64_t)h->storage * sizeof(float) + history_bytes;
    if (size != expected)
        return error_line(err, err_len, "training state is %llu bytes, its header needs %llu: truncated or damaged", (unsigned long long)size,
                          (unsigned long long)expected);
    if (!memchr(h->noise_schedule, 0, sizeof h->noise_schedule) || !memchr(h->predict, 0, sizeof h->predict) ||
        (strcmp(h->noise_schedule, "linear") != 0 && strcmp(h->noise_schedule, "cosine") != 0) ||
        (strcmp(h->predict, "eps") != 0 && strcmp(h->predict, "v") != 0 && strcmp(h->predict, "x0") != 0))
        return error_line(err, err_len, "training state names an unknown noise schedule or prediction target");
    const uint8_t *moments = state_moments(bytes, h);
    for (int64_t i = 0; i < 2 * h->storage; i++) {
        float v;
        memcpy(&v, moments + 4 * i, 4);
        if (!isfinite(v) || (i >= h->storage && v < 0))
            return error_line(err, err_len, "AdamW's %s moment %lld is %g: the training state is damaged", i < h->storage ? "first" : "second",
                                (long long)(i % h->storage), v);
    }
    const uint8_t *history = state_history(bytes, h);
    for (int32_t t = 0; t < h->history_steps; t++) {
        int32_t count;
        memcpy(&count, history + 4 * (uint64_t)t, 4);
        if (count < 0 || count > h->history_length)
            return error_line(err, err_len, "the schedule sampler holds %d losses of timestep %d, at most %d: the training state is damaged",
                              count, t, h->history_length);
    }
    const uint8_t *losses = history + 4 * (uint64_t)h->history_steps;
    for (uint64_t i = 0; i < (uint64_t)h->history_steps * h->history_length; i++) {
        float v;
        memcpy(&v, losses + 4 * i, 4);
        if (!isfinite(v) || v < 0)
            return error_line(err, err_len, "the schedule sampler's loss %llu is %g: the training state is damaged", (unsigned long long)i, v);
    }
    return 0;
}

#endif  // CHECKPOINT_H
