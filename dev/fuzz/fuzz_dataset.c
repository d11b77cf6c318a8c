// fuzz_dataset.c: libFuzzer target for the dataset reader (dataset.h). Any bytes must be refused
// with a one-line message, or accepted as a dataset whose every part a reader touches (class
// names, labels, pixels) lies inside the bytes and agrees with the header. A crash, a leak, a
// sanitizer report or an abort() below is a finding. Built and run by `make fuzz`.
#include <stdlib.h>

#include "dataset.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Dataset ds;
    char err[256] = "";
    if (dataset_from_memory(data, size, &ds, err, sizeof err) != 0) {
        if (!err[0] || strchr(err, '\n')) abort();  // a refusal is one non-empty line
        return 0;
    }
    const DatasetHeader *h = &ds.header;
    if (ds.layout.file_bytes != size) abort();
    // Every class name non-empty, each starting where the one before ended, the last ending the table.
    const char *names_end = (const char *)data + ds.layout.names_offset + h->names_bytes, *next = ds.class_names;
    const char **names = h->num_classes ? dataset_class_names(&ds) : NULL;
    if (h->num_classes && !names) return 0;  // out of memory: not a finding
    for (uint32_t k = 0; k < h->num_classes; k++) {
        if (names[k] != next || !names[k][0]) abort();
        next = names[k] + strlen(names[k]) + 1;
    }
    free(names);
    if (h->num_classes && next != names_end) abort();
    for (uint64_t i = 0; ds.labels && i < h->count; i++)
        if (ds.labels[i] < 0 || (uint32_t)ds.labels[i] >= h->num_classes) abort();
    // The first and last pixel bytes: inside the buffer, or AddressSanitizer says so.
    volatile uint8_t sink = ds.pixels[0];
    sink = ds.pixels[h->count * ds.layout.image_bytes - 1];
    (void)sink;
    return 0;
}
