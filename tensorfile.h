// tensorfile.h: a tensor file held in memory (SafeTensorsFile): its tensors sorted by name and its
// metadata sorted by key, looked up by name, whichever reader filled it: safetensors (checkpoint.h)
// or PyTorch's .pt (ptfile.h). Plain C11 that also compiles as C++17.
#ifndef TENSORFILE_H
#define TENSORFILE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"  // MappedFile, unmap_file

#define SAFETENSORS_MAX_DIMS 8

typedef struct {
    char *name;
    char dtype[8];  // F64, F32, F16, BF16, I64, I32, ... (see safetensors_dtype_bytes)
    int ndim;
    int64_t shape[SAFETENSORS_MAX_DIMS];
    int64_t numel;
    uint64_t begin, end;  // data offsets
    const uint8_t *data;  // into the file's bytes
} SafeTensor;

typedef struct {
    const char *key, *value;  // heap strings in a file read here; the writer takes any
} MetaPair;

typedef struct {
    MappedFile file;  // the mapped file (safetensors_open), or none (safetensors_parse)
    SafeTensor *tensors;  // sorted by name
    int count;
    MetaPair *meta;  // sorted by key
    int meta_count;
} SafeTensorsFile;

static inline int safetensors_dtype_bytes(const char *dtype) {
    static const char *const names[] = {"F64", "I64", "U64", "F32", "I32", "U32", "F16", "BF16", "I16", "U16", "I8", "U8", "BOOL"};
    static const int bytes[] = {8, 8, 8, 4, 4, 4, 2, 2, 2, 2, 1, 1, 1};
    for (int i = 0; i < 13; i++)
        if (strcmp(dtype, names[i]) == 0) return bytes[i];
    return 0;
}

static inline void safetensors_close(SafeTensorsFile *f) {
    for (int i = 0; i < f->count; i++) free(f->tensors[i].name);
    for (int i = 0; i < f->meta_count; i++) free((void *)f->meta[i].key), free((void *)f->meta[i].value);
    free(f->tensors);
    free(f->meta);
    unmap_file(&f->file);
    memset(f, 0, sizeof *f);
}

static inline int safetensors_by_name(const void *a, const void *b) {
    return strcmp(((const SafeTensor *)a)->name, ((const SafeTensor *)b)->name);
}
static inline int safetensors_by_key(const void *a, const void *b) {
    return strcmp(((const MetaPair *)a)->key, ((const MetaPair *)b)->key);
}

static inline const SafeTensor *safetensors_find(const SafeTensorsFile *f, const char *name) {
    SafeTensor key;
    key.name = (char *)name;
    return f->count ? (const SafeTensor *)bsearch(&key, f->tensors, f->count, sizeof(SafeTensor), safetensors_by_name) : NULL;
}

static inline const char *safetensors_metadata(const SafeTensorsFile *f, const char *key) {
    MetaPair wanted;
    wanted.key = key;
    const MetaPair *found =
        f->meta_count ? (const MetaPair *)bsearch(&wanted, f->meta, f->meta_count, sizeof(MetaPair), safetensors_by_key) : NULL;
    return found ? found->value : NULL;
}

#endif  // TENSORFILE_H
