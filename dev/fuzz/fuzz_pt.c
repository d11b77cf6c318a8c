// fuzz_pt.c: libFuzzer target for the PyTorch .pt reader (ptfile.h: the zip directory, the pickle
// machine, the legacy layout). Any bytes must be refused with a one-line message, or accepted as
// tensors that lie inside the input. A crash, a leak, a sanitizer report or an abort() below is a
// finding. Built and run by `make fuzz`.
#include "checkpoint.h"

static volatile uint8_t sink;  // where the tensors' bytes are summed, so that every one is read

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    SafeTensorsFile f;
    char err[512] = "";
    if (pt_parse(data, size, &f, err, sizeof err) != 0) {
        if (!err[0] || strchr(err, '\n')) abort();  // a refusal is one non-empty line
        return 0;
    }
    for (int i = 0; i < f.count; i++) {
        const SafeTensor *t = &f.tensors[i];
        uint64_t bytes = (uint64_t)t->numel * safetensors_dtype_bytes(t->dtype);
        if (t->data < data || t->data > data + size || bytes > (uint64_t)(data + size - t->data)) abort();
        uint8_t sum = 0;
        for (uint64_t b = 0; b < bytes; b++) sum ^= t->data[b];  // every byte readable (ASan)
        sink = sum;
    }
    safetensors_close(&f);
    return 0;
}
