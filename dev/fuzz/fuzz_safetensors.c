// fuzz_safetensors.c: libFuzzer target for the safetensors reader (checkpoint.h): the header's
// length, its JSON, the tensors' dtypes, shapes and offsets, the metadata. Any bytes must be refused
// with a one-line message, or accepted as a file whose every tensor lies inside the data section,
// is found by its name, and converts as a reader converts it. A crash, a leak, a sanitizer report
// or an abort() below is a finding. Built and run by `make fuzz`.
#include "checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    SafeTensorsFile f;
    char err[512] = "";
    if (safetensors_parse(data, size, &f, err, sizeof err) != 0) {
        if (!err[0] || strchr(err, '\n')) abort();  // a refusal is one non-empty line
        return 0;
    }
    for (int i = 0; i < f.count; i++) {
        const SafeTensor *t = &f.tensors[i];
        if (t->data < data + 8 || t->data + (t->end - t->begin) > data + size) abort();
        if (safetensors_find(&f, t->name) != t) abort();
        float *values = (float *)malloc(t->numel * sizeof(float) + 1);
        int64_t *integers = (int64_t *)malloc(t->numel * sizeof(int64_t) + 1);
        safetensors_get_float(t, values);  // reads every byte of the tensor: ASan checks the bounds
        safetensors_get_int64(t, integers);
        free(values), free(integers);
    }
    for (int i = 0; i < f.meta_count; i++)
        if (safetensors_metadata(&f, f.meta[i].key) != f.meta[i].value) abort();
    safetensors_close(&f);
    return 0;
}
