/* tools/bench: `dsv4 bench` -- prefill and decode throughput of a model on a backend.
 *
 * Runs: (1) the device's copy bandwidth (a large device-to-device copy, bytes read +
 * written) when the backend has a device; (2) prefill of --prompt tokens into one
 * sequence; (3) the other --batch - 1 sequences are clones of it (same context,
 * copied state; a prefill of each would cost B times the device time and measure
 * nothing more), and each then decodes its own random tokens;
 * (4) --gen decode steps, all sequences in one engine step each (timed), then --gen
 * more with per-op timing for the per-op breakdown and the weight bytes per step.
 * Prints prefill tok/s, decode tok/s (steps/s x batch), the per-op breakdown, weight
 * bytes read per step and the achieved bandwidth as a fraction of the copy bandwidth.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "tools/commands.h"
#include "util/err.h"

static void usage(FILE *f) {
    fprintf(f, "usage: dsv4 bench [--model DIR] [--backend cpu|cuda|auto] [--prompt N] [--gen N] [--batch B]\n"
               "                  [--numerics exact|reference] [--threads N] [--copy-gb G]\n"
               "Prefill tok/s, decode tok/s, per-op time, weight bytes per decoded step and achieved\n"
               "bandwidth against the device's measured copy bandwidth.  Defaults: --prompt 512 --gen 32\n"
               "--batch 1 --backend auto --copy-gb 4.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

int dsv4_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *backend = "auto", *numerics = NULL;
    int P = 512, G = 32, B = 1, threads = 0, copy_gb = 4;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 bench: %s needs a value (or is unknown)\n", a);
            usage(stderr);
            return 2;
        }
        const char *v = argv[++i];
        int bad = 0;
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--backend")) backend = v;
        else if (!strcmp(a, "--numerics")) numerics = v;
        else if (!strcmp(a, "--prompt")) bad = parse_int(v, 1, 1 << 24, &P);
        else if (!strcmp(a, "--gen")) bad = parse_int(v, 1, 1 << 20, &G);
        else if (!strcmp(a, "--batch")) bad = parse_int(v, 1, 4096, &B);
        else if (!strcmp(a, "--threads")) bad = parse_int(v, 0, 4096, &threads);
        else if (!strcmp(a, "--copy-gb")) bad = parse_int(v, 1, 64, &copy_gb);
        else {
            fprintf(stderr, "dsv4 bench: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dsv4 bench: %s: '%s' is not a whole number in range\n", a, v);
            return 2;
        }
    }
    dsv4_err err = {{0}};
    dsv4_engine *e = NULL;
    dsv4_seq **seqs = calloc((size_t)B, sizeof *seqs);
    dsv4_step_item *items = calloc((size_t)B, sizeof *items);
    int32_t *ids = malloc(sizeof(int32_t) * ((size_t)P + 2 * G + 1) * B);
    float *lg = NULL;
    int rc = 1;
    if (!seqs || !items || !ids) {
        snprintf(err.msg, sizeof err.msg, "out of memory");
        goto done;
    }
    dsv4_engine_opts o = {.model_dir = model, .numerics = numerics, .backend = backend, .n_threads = threads};
    double t_open = dsv4_now();
    if (dsv4_engine_open(&e, &o, &err)) goto done;
    t_open = dsv4_now() - t_open;
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    lg = malloc(sizeof(float) * (size_t)info.vocab_size * B);
    if (!lg) {
        snprintf(err.msg, sizeof err.msg, "out of memory for logits");
        goto done;
    }
    uint32_t x = 777;
    for (size_t i = 0; i < ((size_t)P + 2 * G + 1) * B; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)((x >> 8) % (uint32_t)info.vocab_size);
    }
    dsv4_engine_perf_info pi;
    dsv4_engine_perf(e, &pi);
    printf("bench: model %s (%d layers) dir %s, backend %s, numerics %s\n", info.model_name, info.n_layers,
           info.model_dir, dsv4_engine_backend_name(e), info.numerics);
    printf("bench: opened in %.1f s", t_open);
    if (pi.device[0])
        printf("; device %s; weights on device %.2f GB; device memory used %.2f / %.2f GB", pi.device,
               pi.weight_bytes / 1e9, pi.mem_used / 1e9, pi.mem_total / 1e9);
    printf("\n");
    double copy_bw = dsv4_engine_copy_bandwidth(e, (size_t)copy_gb << 30);
    if (copy_bw > 0) printf("bench: device copy bandwidth %.0f GB/s (D2D, %d GiB, read + write)\n", copy_bw, copy_gb);
    if (dsv4_seq_new(e, &seqs[0], &err)) goto done;
    /* prefill */
    double t0 = dsv4_now();
    if (dsv4_seq_append(seqs[0], ids, P, lg, 0, &err)) goto done;
    double tp = dsv4_now() - t0;
    printf("bench: prefill %d tokens in %.3f s = %.1f tok/s\n", P, tp, P / tp);
    for (int b = 1; b < B; b++) {
        if (dsv4_seq_clone(seqs[0], P, &seqs[b], &err)) goto done;
    }
    if (B > 1) printf("bench: sequences 2..%d are clones of the first after its prefill\n", B);
    /* decode: one warm-up step, then G timed steps */
    for (int b = 0; b < B; b++)
        items[b] = (dsv4_step_item){seqs[b], ids + (size_t)b * (P + 2 * G + 1) + P, 1, lg + (size_t)b * info.vocab_size};
    if (dsv4_engine_step(e, items, B, &err)) goto done;
    t0 = dsv4_now();
    for (int g = 1; g <= G; g++) {
        for (int b = 0; b < B; b++) items[b].tokens = ids + (size_t)b * (P + 2 * G + 1) + P + g;
        if (dsv4_engine_step(e, items, B, &err)) goto done;
    }
    double td = dsv4_now() - t0;
    /* the same number of steps again with per-op timing (it waits after every op) */
    dsv4_engine_profile(e, 1);
    double t3 = dsv4_now();
    for (int g = G + 1; g <= 2 * G; g++) {
        for (int b = 0; b < B; b++) items[b].tokens = ids + (size_t)b * (P + 2 * G + 1) + P + g;
        if (dsv4_engine_step(e, items, B, &err)) goto done;
    }
    double tprof = dsv4_now() - t3;
    dsv4_engine_perf(e, &pi);
    dsv4_engine_profile(e, 0);
    double step_ms = td / G * 1e3;
    printf("bench: decode batch %d at context %d: %d steps in %.3f s = %.2f ms/step = %.1f tok/s (%.1f tok/s per "
           "sequence)\n",
           B, P, G, td, step_ms, (double)G * B / td, G / td);
    if (pi.n_ops) {
        double tot = 0;
        for (int i = 0; i < pi.n_ops; i++) tot += pi.ms[i];
        printf("bench: per-op time per decode step, from %d more steps with per-op timing (%.2f ms/step there;\n"
               "       each op timed from its start to its completion, host staging included):\n",
               G, tprof / G * 1e3);
        for (int i = 0; i < pi.n_ops; i++)
            if (pi.calls[i])
                printf("  %-16s %8.3f ms  %6.1f%%  %6.1f calls\n", pi.op[i], pi.ms[i] / G,
                       tot > 0 ? 100 * pi.ms[i] / tot : 0, (double)pi.calls[i] / G);
        printf("  %-16s %8.3f ms  (host work between ops: %.3f ms)\n", "sum", tot / G, tprof / G * 1e3 - tot / G);
        double wb = pi.weight_bytes_read / G;
        printf("bench: weight bytes read per decode step %.3f GB; achieved %.0f GB/s", wb / 1e9,
               wb / (step_ms * 1e-3) / 1e9);
        if (copy_bw > 0) printf(" = %.1f%% of the copy bandwidth", 100 * wb / (step_ms * 1e-3) / 1e9 / copy_bw);
        printf("\n");
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 bench: %s\n", err.msg);
    for (int b = 0; b < B; b++)
        if (seqs && seqs[b]) dsv4_seq_free(seqs[b]);
    free(seqs);
    free(items);
    free(ids);
    free(lg);
    dsv4_engine_close(e);
    return rc;
}
