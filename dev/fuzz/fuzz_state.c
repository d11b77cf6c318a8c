// fuzz_state.c: libFuzzer target for the training-state reader (state.bin, checkpoint.h). Any bytes
// must be refused with a one-line message, or accepted as a header (of its version's size) whose
// moments and schedule-sampler history fill the rest of the file exactly. A crash, a leak, a sanitizer report or an abort() below is a finding. Built and
// run by `make fuzz`.
#include "checkpoint.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    StateHeader h;
    char err[512] = "";
    if (state_check(data, size, &h, err, sizeof err) != 0) {
        if (!err[0] || strchr(err, '\n')) abort();  // a refusal is one non-empty line
        return 0;
    }
    uint64_t history = (uint64_t)h.history_steps * (sizeof(int32_t) + (uint64_t)h.history_length * sizeof(float));
    if (size != state_header_size(h.version) + 2 * (uint64_t)h.storage * sizeof(float) + history || !memchr(h.predict, 0, sizeof h.predict))
        abort();
    return 0;
}
