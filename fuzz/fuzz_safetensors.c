/* fuzz/fuzz_safetensors: libFuzzer harness for the safetensors header validator.
 *
 * Feeds arbitrary bytes to dsv4_st_parse_buffer.  Bad input must come back as
 * an error, never a crash, leak or sanitizer report; accepted input must
 * describe tensors that lie inside the buffer with consistent sizes (checked
 * here, abort on violation so the fuzzer records it).
 * Run: make fuzz && ./build/fuzz/fuzz_safetensors fuzz/corpus/safetensors/
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "model/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dsv4_tensor *t = NULL;
    int n = 0;
    dsv4_err err;
    if (dsv4_st_parse_buffer(data, size, "fuzz", &t, &n, &err) < 0) {
        /* errors are one line of text naming the input */
        if (strncmp(err.msg, "fuzz: ", 6) != 0 || strchr(err.msg, '\n')) abort();
        return 0;
    }
    for (int i = 0; i < n; i++) {
        const uint8_t *p = t[i].data;
        size_t elems = 1;
        for (int d = 0; d < t[i].ndim; d++)
            elems *= (size_t)t[i].shape[d];
        if (!t[i].name[0] || t[i].ndim < 0 || t[i].ndim > DSV4_ST_MAX_DIMS) abort();
        if (elems * dsv4_dtype_size(t[i].dtype) != t[i].nbytes) abort();
        if (p < data + 8 || p > data + size || t[i].nbytes > (size_t)(data + size - p)) abort();
        /* touch the first and last byte so ASan checks the range */
        if (t[i].nbytes) {
            volatile uint8_t a = p[0], b = p[t[i].nbytes - 1];
            (void)a, (void)b;
        }
    }
    dsv4_st_free_table(t, n);
    return 0;
}
