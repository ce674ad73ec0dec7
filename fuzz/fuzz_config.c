/* fuzz/fuzz_config: libFuzzer harness for dsv4_config_parse.
 *
 * Any input must either be rejected with a message or give a config that
 * survives the writer: to_json, parse again, and get the same struct back
 * (a mismatch aborts, so the fuzzer reports it).  Truncation of an accepted
 * config must also stay valid.
 * Replay: build-xxx/fuzz/fuzz_config -runs=0 fuzz/corpus/config/
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "model/config.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    dsv4_config cfg;
    dsv4_err err;
    err.msg[0] = 0;
    if (dsv4_config_parse(&cfg, (const char *)data, size, "fuzz", &err)) {
        if (!err.msg[0]) abort(); /* every rejection must say why */
        return 0;
    }
    char *text = dsv4_config_to_json(&cfg);
    if (!text) abort();
    dsv4_config back;
    if (dsv4_config_parse(&back, text, strlen(text), "fuzz-roundtrip", &err)) {
        fprintf(stderr, "round trip rejected: %s\n%s\n", err.msg, text);
        abort();
    }
    char diff[64];
    if (!dsv4_config_equal(&cfg, &back, diff, sizeof diff)) {
        fprintf(stderr, "round trip changed %s\n", diff);
        abort();
    }
    free(text);
    if (dsv4_config_truncate(&back, 1, &err)) {
        fprintf(stderr, "truncate to 1 failed: %s\n", err.msg);
        abort();
    }
    return 0;
}
