// ptfile.h: PyTorch's state_dict files (torch.save), read as untrusted input without executing
// anything, into the same SafeTensorsFile the safetensors reader fills (no metadata: a .pt holds
// none), so that every reader of a checkpoint file takes either. Both formats torch.save writes:
//   zip (PyTorch 1.6 and later): a stored (uncompressed) zip archive, ARCHIVE/data.pkl the
//     state_dict's pickle, ARCHIVE/data/KEY each storage's raw bytes (little-endian);
//   legacy (_use_new_zipfile_serialization=False): five pickles in a row (a magic number, the
//     protocol 1001, the system's sizes and byte order, the state_dict, the list of storage keys),
//     then each storage as its element count (int64) and its bytes.
// The pickle reader is a stack machine that knows the few opcodes and globals a state_dict uses:
// collections.OrderedDict, torch._utils._rebuild_tensor_v2 and _rebuild_parameter, and the storage
// types (Float, Half, BFloat16, Double, Long); any other global, opcode or shape of object is refused
// with one line. Containers nest at most PT_MAX_DEPTH deep and every count is bounded, so no input
// costs more than time and memory linear in its size. Plain C: the fuzz target compiles it too.
// The tensor file it fills is tensorfile.h's; checkpoint.h's safetensors_open takes either format,
// so a reader of checkpoints includes checkpoint.h rather than this.
#ifndef PTFILE_H
#define PTFILE_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "fileio.h"      // error_line
#include "tensorfile.h"  // SafeTensorsFile, safetensors_close, _dtype_bytes, _by_name

#define PT_MAX_DEPTH 32           // containers inside containers
#define PT_MAX_VALUES (1 << 22)   // values a pickle makes
#define PT_MAX_MEMO (1 << 22)     // memo slots
#define PT_MAX_STORAGES 10000     // storages a file holds (a state_dict has one a tensor)

typedef enum { PV_NONE, PV_BOOL, PV_INT, PV_BIGINT, PV_FLOAT, PV_STRING, PV_TUPLE, PV_LIST, PV_DICT, PV_GLOBAL, PV_STORAGE, PV_TENSOR } PtKind;
typedef enum { PG_ORDERED_DICT, PG_REBUILD_TENSOR, PG_REBUILD_PARAMETER, PG_STORAGE } PtGlobal;

typedef struct {
    PtKind kind;
    int depth;             // containers: 1 + the deepest item's depth
    int64_t i;             // BOOL, INT; GLOBAL: its PtGlobal; STORAGE: its index; TENSOR: its storage
    const uint8_t *bytes;  // STRING, BIGINT: into the pickle (not terminated)
    uint64_t len;
    int *items, count, capacity;  // TUPLE, LIST; DICT: key, value, key, value...
    char dtype[8];         // GLOBAL of a storage type, STORAGE, TENSOR
    int64_t offset, ndim, shape[SAFETENSORS_MAX_DIMS], stride[SAFETENSORS_MAX_DIMS];  // TENSOR (offset in elements)
} PtValue;

typedef struct {
    char key[64];
    char dtype[8];
    int64_t numel;
    const uint8_t *data;  // found after the pickle: a zip entry, or the legacy file's bytes
} PtStorage;

typedef struct {
    PtStorage *items;
    int count, capacity;
} PtStorages;

// One pickle's machine: the values it made, its stack, marks and memo.
typedef struct {
    const uint8_t *begin, *p, *end;  // the pickle's first byte, the next one read, the file's end
    PtValue *values;
    int count, capacity;
    int *stack, depth, stack_capacity;
    int *marks, num_marks, marks_capacity;
    int *memo, memo_size;
    PtStorages *storages;  // shared by the pickles of one file
    char error[400];
} Pickle;

static inline int pt_fail(Pickle *k, const char *fmt, const char *detail) {
    if (!k->error[0]) snprintf(k->error, sizeof k->error, fmt, detail);
    return -1;
}

static inline int pt_grow(void **array, int *capacity, int needed, size_t item) {
    if (needed <= *capacity) return 0;
    int grown = *capacity ? 2 * *capacity : 64;
    while (grown < needed) grown *= 2;
    void *p = realloc(*array, (size_t)grown * item);
    if (!p) return -1;
    *array = p, *capacity = grown;
    return 0;
}

// A new value of a kind; its index, or -1.
static inline int pt_new(Pickle *k, PtKind kind) {
    if (k->count >= PT_MAX_VALUES) return pt_fail(k, "more than %s values", "4194304");
    if (pt_grow((void **)&k->values, &k->capacity, k->count + 1, sizeof(PtValue)) != 0) return pt_fail(k, "out of memory%s", "");
    PtValue *v = &k->values[k->count];
    memset(v, 0, sizeof *v);
    v->kind = kind;
    return k->count++;
}

static inline int pt_push(Pickle *k, int value) {
    if (value < 0) return -1;
    if (pt_grow((void **)&k->stack, &k->stack_capacity, k->depth + 1, sizeof(int)) != 0) return pt_fail(k, "out of memory%s", "");
    k->stack[k->depth++] = value;
    return 0;
}

static inline int pt_pop(Pickle *k) {
    int floor = k->num_marks ? k->marks[k->num_marks - 1] : 0;
    if (k->depth <= floor) return pt_fail(k, "an opcode takes more values than the stack holds%s", "");
    return k->stack[--k->depth];
}

// Adds item to container c (a list, tuple or dict), keeping the nesting bounded.
static inline int pt_add(Pickle *k, int c, int item) {
    PtValue *v = &k->values[c];
    if (k->values[item].depth + 1 > PT_MAX_DEPTH) return pt_fail(k, "containers nested more than %s deep", "32");
    if (k->values[item].depth + 1 > v->depth) v->depth = k->values[item].depth + 1;
    if (pt_grow((void **)&v->items, &v->capacity, v->count + 1, sizeof(int)) != 0) return pt_fail(k, "out of memory%s", "");
    v->items[v->count++] = item;
    return 0;
}

// Pops the values above the last mark into a new tuple or list; pushes it.
static inline int pt_collect(Pickle *k, PtKind kind) {
    if (!k->num_marks) return pt_fail(k, "a container without its mark%s", "");
    int from = k->marks[--k->num_marks], c = pt_new(k, kind);
    for (int i = from; c >= 0 && i < k->depth; i++)
        if (pt_add(k, c, k->stack[i]) != 0) return -1;
    k->depth = from;
    return pt_push(k, c);
}

static inline int pt_take(Pickle *k, uint64_t n, const uint8_t **at) {
    if ((uint64_t)(k->end - k->p) < n) return pt_fail(k, "the pickle ends inside an opcode%s", "");
    *at = k->p, k->p += n;
    return 0;
}

static inline uint64_t pt_le(const uint8_t *b, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = v << 8 | b[i];
    return v;
}

static inline int pt_text_is(const PtValue *v, const char *text) {
    return v->kind == PV_STRING && v->len == strlen(text) && memcmp(v->bytes, text, v->len) == 0;
}

// GLOBAL "module\nname\n": one of the state_dict's globals, or refused.
static inline int pt_global(Pickle *k) {
    const uint8_t *line = k->p, *nl1 = (const uint8_t *)memchr(line, '\n', (size_t)(k->end - line));
    const uint8_t *nl2 = nl1 ? (const uint8_t *)memchr(nl1 + 1, '\n', (size_t)(k->end - nl1 - 1)) : NULL;
    if (!nl2 || nl2 - line > 200) return pt_fail(k, "a global's name is unterminated or too long%s", "");
    char name[208];
    snprintf(name, sizeof name, "%.*s.%.*s", (int)(nl1 - line), (const char *)line, (int)(nl2 - nl1 - 1), (const char *)nl1 + 1);
    k->p = nl2 + 1;
    static const char *const storages[][2] = {{"torch.FloatStorage", "F32"}, {"torch.HalfStorage", "F16"},
                                              {"torch.BFloat16Storage", "BF16"}, {"torch.DoubleStorage", "F64"},
                                              {"torch.LongStorage", "I64"}};
    int v = pt_new(k, PV_GLOBAL);
    if (v < 0) return -1;
    PtValue *g = &k->values[v];
    if (strcmp(name, "collections.OrderedDict") == 0) g->i = PG_ORDERED_DICT;
    else if (strcmp(name, "torch._utils._rebuild_tensor_v2") == 0) g->i = PG_REBUILD_TENSOR;
    else if (strcmp(name, "torch._utils._rebuild_parameter") == 0) g->i = PG_REBUILD_PARAMETER;
    else {
        int found = 0;
        for (int i = 0; i < 5 && !found; i++)
            if (strcmp(name, storages[i][0]) == 0) g->i = PG_STORAGE, snprintf(g->dtype, sizeof g->dtype, "%s", storages[i][1]), found = 1;
        if (!found) {
            for (char *c = name; *c; c++)
                if (*c < 32 || *c > 126) *c = '?';
            return pt_fail(k, "it names %s, which is not part of a state_dict: refused (nothing was run)", name);
        }
    }
    return pt_push(k, v);
}

// BINPERSID's id: ('storage', storage type, key, location, numel[, view metadata]) -> a storage.
static inline int pt_storage(Pickle *k, int id) {
    int v = pt_new(k, PV_STORAGE);  // (first: pt_new may move the values)
    if (v < 0) return -1;
    const PtValue *t = &k->values[id];
    if (t->kind != PV_TUPLE || t->count < 5 || t->count > 6 || !pt_text_is(&k->values[t->items[0]], "storage"))
        return pt_fail(k, "a persistent id that is not a storage%s", "");
    const PtValue *type = &k->values[t->items[1]], *key = &k->values[t->items[2]], *numel = &k->values[t->items[4]];
    if (type->kind != PV_GLOBAL || type->i != PG_STORAGE || key->kind != PV_STRING || key->len < 1 || key->len > 63 ||
        k->values[t->items[3]].kind != PV_STRING || numel->kind != PV_INT || numel->i < 0 || numel->i > ((int64_t)1 << 40) ||
        (t->count == 6 && k->values[t->items[5]].kind != PV_NONE))
        return pt_fail(k, "a storage's persistent id of unexpected types%s", "");
    char name[64];
    snprintf(name, sizeof name, "%.*s", (int)key->len, (const char *)key->bytes);
    if (memchr(key->bytes, 0, key->len) || strchr(name, '/')) return pt_fail(k, "a storage key with a NUL or a slash%s", "");
    PtStorages *all = k->storages;
    int s = 0;
    while (s < all->count && strcmp(all->items[s].key, name) != 0) s++;
    if (s == all->count) {
        if (s >= PT_MAX_STORAGES) return pt_fail(k, "more than %s storages", "10000");
        if (pt_grow((void **)&all->items, &all->capacity, s + 1, sizeof(PtStorage)) != 0) return pt_fail(k, "out of memory%s", "");
        PtStorage *n = &all->items[all->count++];
        memset(n, 0, sizeof *n);
        snprintf(n->key, sizeof n->key, "%s", name);
        snprintf(n->dtype, sizeof n->dtype, "%s", type->dtype);
        n->numel = numel->i;
    } else if (strcmp(all->items[s].dtype, type->dtype) != 0 || all->items[s].numel != numel->i) {
        return pt_fail(k, "storage %s named twice with different types or sizes", name);
    }
    k->values[v].i = s;
    snprintf(k->values[v].dtype, sizeof k->values[v].dtype, "%s", type->dtype);
    return pt_push(k, v);
}

// _rebuild_tensor_v2(storage, offset, size, stride, requires_grad, hooks[, metadata]) -> a tensor.
static inline int pt_tensor(Pickle *k, int args) {
    int v = pt_new(k, PV_TENSOR);  // (first: pt_new may move the values)
    if (v < 0) return -1;
    const PtValue *a = &k->values[args];
    if (a->kind != PV_TUPLE || a->count < 6 || a->count > 7) return pt_fail(k, "_rebuild_tensor_v2 with unexpected arguments%s", "");
    const PtValue *storage = &k->values[a->items[0]], *offset = &k->values[a->items[1]];
    const PtValue *size = &k->values[a->items[2]], *stride = &k->values[a->items[3]];
    if (storage->kind != PV_STORAGE || offset->kind != PV_INT || offset->i < 0 || size->kind != PV_TUPLE || stride->kind != PV_TUPLE ||
        size->count != stride->count || size->count > SAFETENSORS_MAX_DIMS)
        return pt_fail(k, "_rebuild_tensor_v2 with unexpected arguments%s", "");
    PtValue *t = &k->values[v];
    t->i = storage->i, t->offset = offset->i, t->ndim = size->count;
    memcpy(t->dtype, storage->dtype, sizeof t->dtype);
    for (int d = 0; d < size->count; d++) {
        const PtValue *n = &k->values[size->items[d]], *s = &k->values[stride->items[d]];
        if (n->kind != PV_INT || s->kind != PV_INT || n->i < 0 || n->i > ((int64_t)1 << 40) || s->i < 0 || s->i > ((int64_t)1 << 40))
            return pt_fail(k, "a tensor's size or stride out of range%s", "");
        t->shape[d] = n->i, t->stride[d] = s->i;
    }
    return pt_push(k, v);
}

// REDUCE: the callable and its arguments, both popped; the result pushed.
static inline int pt_reduce(Pickle *k) {
    int args = pt_pop(k), callable = args < 0 ? -1 : pt_pop(k);
    if (callable < 0) return -1;
    const PtValue *f = &k->values[callable], *a = &k->values[args];
    if (f->kind != PV_GLOBAL || a->kind != PV_TUPLE) return pt_fail(k, "a call of something that is not a known global%s", "");
    if (f->i == PG_ORDERED_DICT) {
        if (a->count != 0) return pt_fail(k, "OrderedDict called with arguments%s", "");
        return pt_push(k, pt_new(k, PV_DICT));
    }
    if (f->i == PG_REBUILD_TENSOR) return pt_tensor(k, args);
    if (f->i == PG_REBUILD_PARAMETER) {  // (tensor, requires_grad, hooks): the tensor
        if (a->count != 3 || k->values[a->items[0]].kind != PV_TENSOR) return pt_fail(k, "_rebuild_parameter with unexpected arguments%s", "");
        return pt_push(k, a->items[0]);
    }
    return pt_fail(k, "a storage type called as a function%s", "");
}

// Runs one pickle from k->p to its STOP; *result gets the value it made. Returns 0, or -1 with k->error.
static inline int pt_run(Pickle *k, int *result) {
    const uint8_t *b;
    for (;;) {
        if (k->p >= k->end) return pt_fail(k, "the pickle ends before its STOP%s", "");
        uint8_t op = *k->p++;
        int r = 0, v, w;
        switch (op) {
        case 0x80: r = pt_take(k, 1, &b) || b[0] < 2 || b[0] > 5 ? pt_fail(k, "a pickle protocol this does not read%s", "") : 0; break;  // PROTO
        case 0x95: r = pt_take(k, 8, &b); break;                            // FRAME (its length: the frame is read in line)
        case '.': if (k->depth != 1 || k->num_marks) return pt_fail(k, "the pickle stops with other than one value%s", "");
            *result = k->stack[0];
            k->depth = 0;
            return 0;
        case '(': r = pt_grow((void **)&k->marks, &k->marks_capacity, k->num_marks + 1, sizeof(int));
            if (r == 0) k->marks[k->num_marks++] = k->depth;
            break;
        case 'N': r = pt_push(k, pt_new(k, PV_NONE)); break;
        case 0x88: case 0x89: v = pt_new(k, PV_BOOL); if (v >= 0) k->values[v].i = op == 0x88; r = pt_push(k, v); break;  // NEWTRUE, NEWFALSE
        case 'J': case 'K': case 'M': {                                     // BININT (4 bytes, signed), BININT1, BININT2
            int n = op == 'J' ? 4 : op == 'K' ? 1 : 2;
            if ((r = pt_take(k, n, &b)) != 0) break;
            v = pt_new(k, PV_INT);
            if (v >= 0) k->values[v].i = n == 4 ? (int64_t)(int32_t)pt_le(b, 4) : (int64_t)pt_le(b, n);
            r = pt_push(k, v);
            break;
        }
        case 0x8a: {                                                        // LONG1: n bytes, two's complement
            if ((r = pt_take(k, 1, &b)) != 0) break;
            int n = b[0];
            if ((r = pt_take(k, n, &b)) != 0) break;
            v = pt_new(k, n <= 8 ? PV_INT : PV_BIGINT);
            if (v < 0) return -1;
            if (n > 8) k->values[v].bytes = b, k->values[v].len = n;
            else if (n > 0) k->values[v].i = (int64_t)(pt_le(b, n) << (64 - 8 * n)) >> (64 - 8 * n);
            r = pt_push(k, v);
            break;
        }
        case 'G': r = pt_take(k, 8, &b); if (r == 0) r = pt_push(k, pt_new(k, PV_FLOAT)); break;  // BINFLOAT (its value unused)
        case 'X': case 0x8c: case 'C': case 'U': {  // BINUNICODE (4-byte length), SHORT_BINUNICODE, SHORT_BINBYTES, SHORT_BINSTRING
            int n = op == 'X' ? 4 : 1;
            if ((r = pt_take(k, n, &b)) != 0) break;
            uint64_t len = pt_le(b, n);
            if ((r = pt_take(k, len, &b)) != 0) break;
            v = pt_new(k, PV_STRING);
            if (v >= 0) k->values[v].bytes = b, k->values[v].len = len;
            r = pt_push(k, v);
            break;
        }
        case 'c': r = pt_global(k); break;
        case '}': r = pt_push(k, pt_new(k, PV_DICT)); break;
        case ']': r = pt_push(k, pt_new(k, PV_LIST)); break;
        case ')': r = pt_push(k, pt_new(k, PV_TUPLE)); break;
        case 't': r = pt_collect(k, PV_TUPLE); break;
        case 'l': r = pt_collect(k, PV_LIST); break;
        case 0x85: case 0x86: case 0x87: {                                  // TUPLE1..3
            int n = op - 0x84, items[3];
            for (int i = n - 1; i >= 0; i--)
                if ((items[i] = pt_pop(k)) < 0) return -1;
            v = pt_new(k, PV_TUPLE);
            for (int i = 0; v >= 0 && i < n && r == 0; i++) r = pt_add(k, v, items[i]);
            r = r ? r : pt_push(k, v);
            break;
        }
        case 'a': case 'e': case 's': case 'u': {  // APPEND, APPENDS, SETITEM, SETITEMS: into the container below
            int many = op == 'e' || op == 'u', dict = op == 's' || op == 'u';
            int from = many ? (k->num_marks ? k->marks[--k->num_marks] : -1) : k->depth - (dict ? 2 : 1);
            if (from < 1 || from > k->depth || (dict && (k->depth - from) % 2)) return pt_fail(k, "an append or set without its items%s", "");
            int floor = k->num_marks ? k->marks[k->num_marks - 1] : 0;
            if (from - 1 < floor) return pt_fail(k, "an append or set without its container%s", "");
            w = k->stack[from - 1];
            if (k->values[w].kind != (dict ? PV_DICT : PV_LIST)) return pt_fail(k, "an append or set into the wrong kind of value%s", "");
            for (int i = from; i < k->depth && r == 0; i++) r = pt_add(k, w, k->stack[i]);
            k->depth = from;
            break;
        }
        case 'b': {                                                         // BUILD: a dict's state (torch's _metadata), ignored
            int state = pt_pop(k);
            if (state < 0) return -1;
            if (k->depth < 1 || k->values[k->stack[k->depth - 1]].kind != PV_DICT) return pt_fail(k, "BUILD of other than a dict%s", "");
            break;
        }
        case 'R': r = pt_reduce(k); break;
        case 'Q': v = pt_pop(k); r = v < 0 ? -1 : pt_storage(k, v); break;  // BINPERSID
        case 'q': case 'r': case 0x94: {                                    // BINPUT, LONG_BINPUT, MEMOIZE
            uint64_t slot = (uint64_t)k->memo_size;
            if (op != 0x94 && (r = pt_take(k, op == 'q' ? 1 : 4, &b)) != 0) break;
            if (op != 0x94) slot = pt_le(b, op == 'q' ? 1 : 4);
            if (k->depth < 1) return pt_fail(k, "a memo write with an empty stack%s", "");
            if (slot >= PT_MAX_MEMO) return pt_fail(k, "a memo slot beyond %s", "4194304");
            // a pickler numbers its slots 0, 1, 2...: each slot before this one took at least a byte, so
            // a slot past the bytes read so far is none a pickler writes (and would cost memory, not bytes)
            if (slot > (uint64_t)(k->p - k->begin)) return pt_fail(k, "a memo slot past the pickle's length%s", "");
            if ((int)slot >= k->memo_size) {
                int *grown = (int *)realloc(k->memo, (slot + 1) * sizeof(int));
                if (!grown) return pt_fail(k, "out of memory%s", "");
                for (int i = k->memo_size; i <= (int)slot; i++) grown[i] = -1;
                k->memo = grown, k->memo_size = (int)slot + 1;
            }
            k->memo[slot] = k->stack[k->depth - 1];
            break;
        }
        case 'h': case 'j': {                                               // BINGET, LONG_BINGET
            if ((r = pt_take(k, op == 'h' ? 1 : 4, &b)) != 0) break;
            uint64_t slot = pt_le(b, op == 'h' ? 1 : 4);
            if (slot >= (uint64_t)k->memo_size || k->memo[slot] < 0) return pt_fail(k, "a memo read of an empty slot%s", "");
            r = pt_push(k, k->memo[slot]);
            break;
        }
        default: {
            char name[8];
            snprintf(name, sizeof name, "0x%02x", op);
            return pt_fail(k, "opcode %s is not one a state_dict uses: refused", name);
        }
        }
        if (r != 0) return pt_fail(k, "the pickle is damaged%s", "");
    }
}

static inline void pt_free(Pickle *k) {
    for (int i = 0; i < k->count; i++) free(k->values[i].items);
    free(k->values), free(k->stack), free(k->marks), free(k->memo);
    k->values = NULL, k->stack = k->marks = k->memo = NULL;
    k->count = k->capacity = k->depth = k->stack_capacity = k->num_marks = k->marks_capacity = k->memo_size = 0;
}

// Runs the pickle at bytes[*at...] (the machine reset first); *at moves past its STOP.
static inline int pt_run_at(Pickle *k, const uint8_t *bytes, uint64_t size, uint64_t *at, int *result) {
    pt_free(k);
    k->begin = k->p = bytes + *at, k->end = bytes + size;
    int r = pt_run(k, result);
    *at = (uint64_t)(k->p - bytes);
    return r;
}

// The state_dict (the top value: a dict of names and tensors) into f's tensors, each pointing into
// its storage's bytes (found by the caller). Returns 0, or -1 with a message.
static inline int pt_state_dict(Pickle *k, int top, SafeTensorsFile *f, char *err, size_t err_len) {
    const PtValue *d = &k->values[top];
    if (d->kind != PV_DICT || d->count == 0) return error_line(err, err_len, "the pickle holds no state_dict (a dict of names and tensors)");
    f->tensors = (SafeTensor *)calloc(d->count / 2, sizeof(SafeTensor));
    if (!f->tensors) return error_line(err, err_len, "out of memory");
    for (int i = 0; i < d->count; i += 2) {
        const PtValue *name = &k->values[d->items[i]], *t = &k->values[d->items[i + 1]];
        if (name->kind != PV_STRING || name->len == 0 || name->len > 1000 || memchr(name->bytes, 0, name->len))
            return error_line(err, err_len, "the state_dict has a key that is not a name");
        SafeTensor *out = &f->tensors[f->count];
        if (!(out->name = (char *)malloc(name->len + 1))) return error_line(err, err_len, "out of memory");
        memcpy(out->name, name->bytes, name->len), out->name[name->len] = '\0';
        f->count++;
        if (t->kind != PV_TENSOR) return error_line(err, err_len, "state_dict entry %s is not a tensor", out->name);
        const PtStorage *s = &k->storages->items[t->i];
        int elem = safetensors_dtype_bytes(t->dtype);
        int64_t expected = 1;
        for (int j = (int)t->ndim - 1; j >= 0; j--) {  // contiguous (C order; a dimension of size 1 may have any stride)
            if (t->shape[j] != 1 && t->stride[j] != expected)
                return error_line(err, err_len, "tensor %s is not contiguous (strides other than its shape's)", out->name);
            // the bound before the product: two sizes of up to 2^40 each would overflow int64 (to 0, say)
            if (t->shape[j] != 0 && expected > ((int64_t)1 << 40) / t->shape[j])
                return error_line(err, err_len, "tensor %s has more than 2^40 elements", out->name);
            expected *= t->shape[j];
        }
        int64_t numel = expected;
        if (t->offset > s->numel || numel > s->numel - t->offset)
            return error_line(err, err_len, "tensor %s runs past the end of its storage %s (elements %lld + %lld of %lld)", out->name, s->key,
                              (long long)t->offset, (long long)numel, (long long)s->numel);
        snprintf(out->dtype, sizeof out->dtype, "%s", t->dtype);
        out->ndim = (int)t->ndim, out->numel = numel;
        for (int j = 0; j < out->ndim; j++) out->shape[j] = t->shape[j];
        out->data = s->data + t->offset * elem;
        out->begin = 0, out->end = (uint64_t)numel * elem;
    }
    qsort(f->tensors, f->count, sizeof(SafeTensor), safetensors_by_name);
    for (int i = 1; i < f->count; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0) return error_line(err, err_len, "tensor %s appears twice", f->tensors[i].name);
    return 0;
}

// ----------------------------------------------------------------------------------------------
// The zip format: the central directory (found from its end record, zip64 where torch writes it),
// every entry stored (method 0), inside the file, its local header's name equal to the directory's,
// and no two entries' bytes overlapping.

typedef struct {
    char name[256];
    uint64_t begin, size;  // the entry's data
} ZipEntry;

static inline int zip_entry_order(const void *a, const void *b) {
    const ZipEntry *x = (const ZipEntry *)a, *y = (const ZipEntry *)b;
    return (x->begin > y->begin) - (x->begin < y->begin);
}

static inline int zip_entry_by_name(const void *a, const void *b) {
    return strcmp(((const ZipEntry *)a)->name, ((const ZipEntry *)b)->name);
}

static inline int zip_read(const uint8_t *bytes, uint64_t size, ZipEntry **entries, int *count, char *err, size_t err_len) {
    *entries = NULL, *count = 0;
    int64_t end = -1;  // the end of central directory record: its signature within the last 64 KiB + 22 bytes
    for (int64_t at = (int64_t)size - 22; at >= 0 && at >= (int64_t)size - 22 - 65535; at--)
        if (pt_le(bytes + at, 4) == 0x06054b50) {
            end = at;
            break;
        }
    if (end < 0) return error_line(err, err_len, "no zip directory at its end: truncated, or not a zip file");
    uint64_t n = pt_le(bytes + end + 10, 2), dir_size = pt_le(bytes + end + 12, 4), dir_at = pt_le(bytes + end + 16, 4);
    if (n == 0xffff || dir_size == 0xffffffff || dir_at == 0xffffffff) {  // zip64: its locator just before
        if (end < 20 || pt_le(bytes + end - 20, 4) != 0x07064b50) return error_line(err, err_len, "a zip64 directory without its locator");
        uint64_t at64 = pt_le(bytes + end - 20 + 8, 8);
        if (size < 56 || at64 > size - 56 || pt_le(bytes + at64, 4) != 0x06064b50) return error_line(err, err_len, "a zip64 end record out of place");
        n = pt_le(bytes + at64 + 32, 8), dir_size = pt_le(bytes + at64 + 40, 8), dir_at = pt_le(bytes + at64 + 48, 8);
    }
    if (dir_at > size || dir_size > size - dir_at || n > 1000000 || n > dir_size / 46)
        return error_line(err, err_len, "a zip directory out of the file's bounds");
    ZipEntry *e = (ZipEntry *)calloc(n ? n : 1, sizeof(ZipEntry));
    if (!e) return error_line(err, err_len, "out of memory");
    uint64_t at = dir_at, dir_end = dir_at + dir_size;
    int r = 0;
    for (uint64_t i = 0; r == 0 && i < n; i++) {
        if (dir_end - at < 46 || pt_le(bytes + at, 4) != 0x02014b50) { r = error_line(err, err_len, "a damaged zip directory entry"); break; }
        uint64_t method = pt_le(bytes + at + 10, 2), csize = pt_le(bytes + at + 20, 4), usize = pt_le(bytes + at + 24, 4);
        uint64_t name_len = pt_le(bytes + at + 28, 2), extra_len = pt_le(bytes + at + 30, 2), comment_len = pt_le(bytes + at + 32, 2);
        uint64_t local = pt_le(bytes + at + 42, 4);
        if (dir_end - at - 46 < name_len + extra_len + comment_len) { r = error_line(err, err_len, "a damaged zip directory entry"); break; }
        const uint8_t *extra = bytes + at + 46 + name_len;
        for (uint64_t x = 0; x + 4 <= extra_len;) {  // zip64's sizes and offset, those that are 0xffffffff, in this order
            uint64_t id = pt_le(extra + x, 2), len = pt_le(extra + x + 2, 2), y = x + 4;
            if (len > extra_len - x - 4) break;
            if (id == 1) {
                if (usize == 0xffffffff && y + 8 <= x + 4 + len) usize = pt_le(extra + y, 8), y += 8;
                if (csize == 0xffffffff && y + 8 <= x + 4 + len) csize = pt_le(extra + y, 8), y += 8;
                if (local == 0xffffffff && y + 8 <= x + 4 + len) local = pt_le(extra + y, 8);
            }
            x += 4 + len;
        }
        if (name_len == 0 || name_len >= sizeof e[i].name) { r = error_line(err, err_len, "a zip entry name of %llu bytes", (unsigned long long)name_len); break; }
        memcpy(e[i].name, bytes + at + 46, name_len);
        if (memchr(e[i].name, 0, name_len)) { r = error_line(err, err_len, "a zip entry name with a NUL"); break; }
        if (method != 0 || csize != usize) { r = error_line(err, err_len, "zip entry %s is compressed: only stored entries are read (as torch.save and np.savez write them)", e[i].name); break; }
        // the local header and the name after it, 30 + name_len bytes, inside the file before either is read
        if (local > size || size - local < 30 + name_len || pt_le(bytes + local, 4) != 0x04034b50 || pt_le(bytes + local + 26, 2) != name_len ||
            memcmp(bytes + local + 30, e[i].name, name_len) != 0) {
            r = error_line(err, err_len, "zip entry %s: its local header is missing or names another", e[i].name);
            break;
        }
        uint64_t data = local + 30 + name_len + pt_le(bytes + local + 28, 2);
        if (data > size || usize > size - data) { r = error_line(err, err_len, "zip entry %s runs past the end of the file", e[i].name); break; }
        e[i].begin = data, e[i].size = usize;
        at += 46 + name_len + extra_len + comment_len;
    }
    if (r == 0) {  // no two entries share bytes (the data, or a header inside another's data), nor a name
        ZipEntry *sorted = (ZipEntry *)malloc((n ? n : 1) * sizeof(ZipEntry));
        if (!sorted) r = error_line(err, err_len, "out of memory");
        if (sorted) memcpy(sorted, e, n * sizeof(ZipEntry)), qsort(sorted, n, sizeof(ZipEntry), zip_entry_order);
        for (uint64_t i = 1; r == 0 && i < n; i++)
            if (sorted[i].begin < sorted[i - 1].begin + sorted[i - 1].size + 30)
                r = error_line(err, err_len, "zip entries %s and %s overlap", sorted[i - 1].name, sorted[i].name);
        // any name twice is refused, wherever the two lie: Python's zipfile would read the last, zip_find the first
        if (sorted) qsort(sorted, n, sizeof(ZipEntry), zip_entry_by_name);
        for (uint64_t i = 1; r == 0 && i < n; i++)
            if (strcmp(sorted[i - 1].name, sorted[i].name) == 0) r = error_line(err, err_len, "zip entry %s appears twice", sorted[i].name);
        free(sorted);
    }
    if (r != 0) return free(e), -1;
    *entries = e, *count = (int)n;
    return 0;
}

static inline const ZipEntry *zip_find(const ZipEntry *e, int n, const char *name) {
    for (int i = 0; i < n; i++)
        if (strcmp(e[i].name, name) == 0) return &e[i];
    return NULL;
}

// ----------------------------------------------------------------------------------------------

// Whether bytes begin as a file torch.save writes (a zip archive, or a legacy file's first pickle).
static inline int pt_is_torch_file(const uint8_t *bytes, uint64_t size) {
    return size >= 4 && ((bytes[0] == 'P' && bytes[1] == 'K' && bytes[2] == 3 && bytes[3] == 4) || (bytes[0] == 0x80 && bytes[1] == 2));
}

// Parses a torch.save file held in memory (bytes owned by the caller, outliving f) into f's
// tensors. Returns 0, or -1 with a message.
static inline int pt_parse(const uint8_t *bytes, uint64_t size, SafeTensorsFile *f, char *err, size_t err_len) {
    memset(f, 0, sizeof *f);
    Pickle k;
    memset(&k, 0, sizeof k);
    PtStorages storages = {NULL, 0, 0};
    int top = -1, r = 0;
    k.storages = &storages;
    char why[480] = "";
    if (size >= 4 && bytes[0] == 'P' && bytes[1] == 'K') {
        ZipEntry *e;
        int n;
        r = zip_read(bytes, size, &e, &n, why, sizeof why);
        const ZipEntry *pkl = NULL;
        char prefix[256] = "";
        for (int i = 0; r == 0 && i < n && !pkl; i++) {  // ARCHIVE/data.pkl
            const char *slash = strchr(e[i].name, '/');
            if (slash && strcmp(slash, "/data.pkl") == 0) pkl = &e[i], snprintf(prefix, sizeof prefix, "%.*s", (int)(slash - e[i].name), e[i].name);
        }
        if (r == 0 && !pkl) r = error_line(why, sizeof why, "a zip file without ARCHIVE/data.pkl: not written by torch.save");
        char name[400];
        snprintf(name, sizeof name, "%s/byteorder", prefix);
        const ZipEntry *order = r == 0 ? zip_find(e, n, name) : NULL;
        if (order && !(order->size == 6 && memcmp(bytes + order->begin, "little", 6) == 0))
            r = error_line(why, sizeof why, "the tensors are stored big-endian");
        uint64_t at = 0;
        if (r == 0 && pt_run_at(&k, bytes + pkl->begin, pkl->size, &at, &top) != 0) r = error_line(why, sizeof why, "data.pkl: %s", k.error);
        if (r == 0 && at != pkl->size) r = error_line(why, sizeof why, "data.pkl: bytes after the pickle's STOP");
        for (int s = 0; r == 0 && s < storages.count; s++) {
            snprintf(name, sizeof name, "%s/data/%s", prefix, storages.items[s].key);
            const ZipEntry *d = zip_find(e, n, name);
            int elem = safetensors_dtype_bytes(storages.items[s].dtype);
            if (!d) r = error_line(why, sizeof why, "storage %s has no entry %s", storages.items[s].key, name);
            else if (d->size / elem < (uint64_t)storages.items[s].numel)
                r = error_line(why, sizeof why, "storage %s holds %llu bytes, fewer than its %lld elements", storages.items[s].key,
                               (unsigned long long)d->size, (long long)storages.items[s].numel);
            else storages.items[s].data = bytes + d->begin;
        }
        free(e);
    } else if (pt_is_torch_file(bytes, size)) {
        // legacy: magic, protocol 1001, system info, the object, the storage keys; then the storages
        static const uint8_t magic[10] = {0x6c, 0xfc, 0x9c, 0x46, 0xf9, 0x20, 0x6a, 0xa8, 0x50, 0x19};
        uint64_t at = 0;
        int v, keys = -1;
        if (pt_run_at(&k, bytes, size, &at, &v) != 0) r = error_line(why, sizeof why, "%s", k.error);
        else if (k.values[v].kind != PV_BIGINT || k.values[v].len != 10 || memcmp(k.values[v].bytes, magic, 10) != 0)
            r = error_line(why, sizeof why, "not a file torch.save wrote (its magic number is missing)");
        if (r == 0 && (pt_run_at(&k, bytes, size, &at, &v) != 0 || k.values[v].kind != PV_INT || k.values[v].i != 1001))
            r = error_line(why, sizeof why, "a legacy torch file of a protocol other than 1001");
        if (r == 0 && pt_run_at(&k, bytes, size, &at, &v) != 0) r = error_line(why, sizeof why, "its system information: %s", k.error);
        if (r == 0) {  // {'protocol_version': 1001, 'little_endian': True, 'type_sizes': {...}}
            const PtValue *info = &k.values[v];
            int little = 0;
            for (int i = 0; info->kind == PV_DICT && i < info->count; i += 2)
                if (pt_text_is(&k.values[info->items[i]], "little_endian"))
                    little = k.values[info->items[i + 1]].kind == PV_BOOL && k.values[info->items[i + 1]].i;
            if (!little) r = error_line(why, sizeof why, "the tensors are not stored little-endian");
        }
        if (r == 0 && pt_run_at(&k, bytes, size, &at, &top) != 0) r = error_line(why, sizeof why, "the state_dict's pickle: %s", k.error);
        Pickle list;  // the keys, in the order the storages follow (the object's machine stays for pt_state_dict)
        memset(&list, 0, sizeof list);
        list.storages = &storages;
        if (r == 0 && (pt_run_at(&list, bytes, size, &at, &keys) != 0 || list.values[keys].kind != PV_LIST))
            r = error_line(why, sizeof why, "the storage keys' pickle: %s", list.error[0] ? list.error : "not a list");
        for (int i = 0; r == 0 && i < list.values[keys].count; i++) {
            const PtValue *key = &list.values[list.values[keys].items[i]];
            int s = 0;
            while (s < storages.count && !(key->kind == PV_STRING && key->len == strlen(storages.items[s].key) &&
                                         memcmp(key->bytes, storages.items[s].key, key->len) == 0))
                s++;
            if (s == storages.count || storages.items[s].data) { r = error_line(why, sizeof why, "a storage key that names no storage, or twice"); break; }
            int elem = safetensors_dtype_bytes(storages.items[s].dtype);
            if (size - at < 8 || pt_le(bytes + at, 8) != (uint64_t)storages.items[s].numel ||
                (size - at - 8) / elem < (uint64_t)storages.items[s].numel) {
                r = error_line(why, sizeof why, "storage %s: its size is not the one named, or the file ends inside it", storages.items[s].key);
                break;
            }
            storages.items[s].data = bytes + at + 8;
            at += 8 + (uint64_t)storages.items[s].numel * elem;
        }
        for (int s = 0; r == 0 && s < storages.count; s++)
            if (!storages.items[s].data) r = error_line(why, sizeof why, "storage %s is not in the file", storages.items[s].key);
        if (r == 0 && at != size) r = error_line(why, sizeof why, "%llu bytes after the last storage", (unsigned long long)(size - at));
        pt_free(&list);
    } else {
        r = error_line(why, sizeof why, "not a file torch.save writes (neither a zip archive nor a legacy pickle)");
    }
    if (r == 0) r = pt_state_dict(&k, top, f, why, sizeof why);
    pt_free(&k);
    free(storages.items);
    if (r != 0) {
        safetensors_close(f);
        return error_line(err, err_len, "%s", why);
    }
    return 0;
}

#endif  // PTFILE_H
