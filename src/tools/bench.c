/* tools/bench: `dsv4 bench` -- prefill and decode throughput of a model on a backend.
 *
 * Runs: (1) the device's copy bandwidth (a large device-to-device copy, bytes read +
 * written) when the backend has a device; then for each --prompt length P (a comma
 * list): (2) prefill of P random tokens into one sequence (timed); for each --batch
 * size B (a comma list): (3) B clones of that sequence (same context, copied state; a
 * prefill of each would cost B times the device time and measure nothing more), each
 * decoding its own random tokens; (4) --warmup untimed steps (default 8: a device backend
 * builds its CUDA graphs for each new shape there, e.g. a ratio-4 compressor's first emit
 * at the 4th step, which cost ~4 ms once on 20 Flash layers), --gen decode steps with all B
 * sequences in one engine step each (timed), then --gen more with per-op timing for
 * the per-op breakdown and the weight bytes per step.  The model is loaded once.
 * Prints prefill tok/s, decode tok/s (steps/s x batch), the per-op breakdown, weight
 * bytes read per step and the achieved bandwidth as a fraction of the copy bandwidth.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "engine/engine.h"
#include "tools/commands.h"
#include "util/err.h"

static void usage(FILE *f) {
    fprintf(f, "usage: dsv4 bench [--model DIR] [--backend cpu|cuda|auto] [--prompt N[,N...]] [--gen N]\n"
               "                  [--batch B[,B...]] [--numerics exact|reference] [--set NAME=VALUE ...]\n"
               "                  [--threads N] [--copy-gb G] [--op-profile 0|1] [--warmup N] [--greedy 0|1]\n"
               "Prefill tok/s, decode tok/s, per-op time, weight bytes per decoded step and achieved\n"
               "bandwidth against the device's measured copy bandwidth, for every prompt length and batch\n"
               "size listed (the model is loaded once).  --op-profile 0 skips the second pass with per-op\n"
               "timing (the weight bytes then come from the timed steps).  --warmup: untimed decode steps\n"
               "first (a device backend builds its CUDA graphs for new shapes in them, e.g. a ratio-4\n"
               "compressor's first emit at the 4th step; the timed steps then show the steady state a long\n"
               "generation sees).  --set: a numerics switch over the profile\n"
               "(`dsv4 switches`; e.g. moe.dot=mma), repeatable.  --greedy 1: at batch 1 also greedy decoding\n"
               "with the picks on the device (the host records a step while the device runs the one before),\n"
               "timed against the host-picking loop, whose tokens it must match.  Defaults: --prompt 512\n"
               "--gen 32 --batch 1 --backend auto --copy-gb 4 --op-profile 1 --warmup 8 --greedy 1.\n");
}

static int parse_int(const char *s, int lo, int hi, int *out) {
    char *end;
    long v = strtol(s, &end, 10);
    if (!*s || *end || v < lo || v > hi) return -1;
    *out = (int)v;
    return 0;
}

/* "N" or "N,N,..." (at most max values, each in [lo, hi]) */
static int parse_list(const char *s, int lo, int hi, int *out, int max, int *n) {
    char buf[32];
    *n = 0;
    for (const char *p = s;;) {
        const char *c = strchr(p, ',');
        size_t len = c ? (size_t)(c - p) : strlen(p);
        if (len == 0 || len >= sizeof buf || *n == max) return -1;
        memcpy(buf, p, len);
        buf[len] = 0;
        if (parse_int(buf, lo, hi, &out[(*n)++])) return -1;
        if (!c) return 0;
        p = c + 1;
    }
}

#define MAX_LIST 8

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* One decode measurement: B clones of s0 (context P) decode W untimed steps, G timed steps,
 * then G more with per-op timing.  ids: tokens for the clones ([B][W + 2G]). */
static int bench_decode(dsv4_engine *e, dsv4_seq *s0, int P, int B, int W, int G, const int32_t *ids, float *lg,
                        int vocab, double copy_bw, int op_profile, double *wb_out, dsv4_err *err) {
    const size_t stride = (size_t)W + 2 * (size_t)G; /* token ids per clone: warm-up, timed, profiled */
    dsv4_seq **seqs = calloc((size_t)B, sizeof *seqs);
    dsv4_step_item *items = calloc((size_t)B, sizeof *items);
    double *step_s = calloc((size_t)G, sizeof *step_s);
    int rc = -1;
    if (!seqs || !items || !step_s) {
        dsv4_errf(err, "out of memory for %d sequences", B);
        goto out;
    }
    for (int b = 0; b < B; b++)
        if (dsv4_seq_clone(s0, P, &seqs[b], err)) goto out;
    /* W warm-up steps, then G timed steps */
    for (int w = 0; w < W; w++) {
        for (int b = 0; b < B; b++)
            items[b] = (dsv4_step_item){seqs[b], ids + (size_t)b * stride + w, 1, lg + (size_t)b * vocab};
        if (dsv4_engine_step(e, items, B, err)) goto out;
    }
    for (int b = 0; b < B; b++) items[b] = (dsv4_step_item){seqs[b], NULL, 1, lg + (size_t)b * vocab};
    dsv4_engine_perf_info p0, p1;
    dsv4_engine_perf(e, &p0);
    double t0 = dsv4_now(), tp = t0;
    for (int g = 1; g <= G; g++) {
        for (int b = 0; b < B; b++) items[b].tokens = ids + (size_t)b * stride + W + g - 1;
        if (dsv4_engine_step(e, items, B, err)) goto out;
        double tn = dsv4_now(); /* a step returns with its logits on the host: its wall time */
        step_s[g - 1] = tn - tp;
        tp = tn;
    }
    double td = dsv4_now() - t0;
    dsv4_engine_perf(e, &p1);
    /* the same number of steps again with per-op timing (it waits after every op) */
    if (op_profile) dsv4_engine_profile(e, 1);
    double t3 = dsv4_now();
    for (int g = G + 1; g <= 2 * G && op_profile; g++) {
        for (int b = 0; b < B; b++) items[b].tokens = ids + (size_t)b * stride + W + g - 1;
        if (dsv4_engine_step(e, items, B, err)) {
            dsv4_engine_profile(e, 0);
            goto out;
        }
    }
    double tprof = dsv4_now() - t3;
    dsv4_engine_perf_info pi;
    dsv4_engine_perf(e, &pi);
    if (!op_profile) pi.n_ops = 0;
    dsv4_engine_profile(e, 0);
    double step_ms = td / G * 1e3;
    printf("bench: decode batch %d at context %d: %d steps in %.3f s = %.2f ms/step = %.1f tok/s (%.1f tok/s per "
           "sequence)\n",
           B, P, G, td, step_ms, (double)G * B / td, G / td);
    qsort(step_s, (size_t)G, sizeof *step_s, cmp_double);
    printf("bench: decode step times (each step's wall time, after %d warm-up steps): min %.3f / median %.3f / max "
           "%.3f ms\n",
           W, step_s[0] * 1e3, (G % 2 ? step_s[G / 2] : 0.5 * (step_s[G / 2 - 1] + step_s[G / 2])) * 1e3,
           step_s[G - 1] * 1e3);
    if (p1.graph_launches + p1.graph_inst > p0.graph_launches + p0.graph_inst || p1.wait_s > p0.wait_s) {
        char gpu[96] = "device time inside them not measured (DSV4_CUDA_GRAPH_TIMES=1)";
        if (p1.graph_gpu_s > p0.graph_gpu_s)
            snprintf(gpu, sizeof gpu, "%.3f ms of device time inside them", (p1.graph_gpu_s - p0.graph_gpu_s) / G * 1e3);
        printf("bench: per decode step: %.1f graph launches (%.1f updated in place, %.1f new executables), "
               "%s; host waited %.3f ms for the device\n",
               (double)(p1.graph_launches - p0.graph_launches) / G, (double)(p1.graph_updates - p0.graph_updates) / G,
               (double)(p1.graph_inst - p0.graph_inst) / G, gpu, (p1.wait_s - p0.wait_s) / G * 1e3);
    }
    if (p1.comb_fused + p1.comb_alone > p0.comb_fused + p0.comb_alone) /* DSV4_CUDA_HC_COMB=1 (docs/CUDA.md) */
        printf("bench: per decode step: %.1f MoE combines formed inside the next hc kernel, %.1f launched alone\n",
               (double)(p1.comb_fused - p0.comb_fused) / G, (double)(p1.comb_alone - p0.comb_alone) / G);
    if (p1.issue_s > p0.issue_s)
        printf("bench: host time per decode step: %.3f ms inside ops, %.3f ms ending graph captures (update or "
               "instantiate, launch), %.3f ms elsewhere (forward pass, waits, copies out)\n",
               (p1.issue_s - p0.issue_s) / G * 1e3, (p1.segment_s - p0.segment_s) / G * 1e3,
               step_ms - ((p1.issue_s - p0.issue_s) + (p1.segment_s - p0.segment_s)) / G * 1e3);
    if (pi.n_ops) {
        double tot = 0;
        for (int i = 0; i < pi.n_ops; i++) tot += pi.ms[i];
        printf("bench: per-op time per decode step, from %d more steps with per-op timing (%.2f ms/step there;\n"
               "       each op timed from its start to its completion, host staging included):\n",
               G, tprof / G * 1e3);
        for (int i = 0; i < pi.n_ops; i++)
            if (pi.calls[i])
                printf("  %-16s %8.3f ms  %6.1f%%  %6.1f calls  (host %.3f ms)\n", pi.op[i], pi.ms[i] / G,
                       tot > 0 ? 100 * pi.ms[i] / tot : 0, (double)pi.calls[i] / G, pi.host_ms[i] / G);
        printf("  %-16s %8.3f ms  (host work between ops: %.3f ms)\n", "sum", tot / G, tprof / G * 1e3 - tot / G);
    }
    /* the bytes of the profiled steps where they ran, else of the timed steps (the backend's counter
     * runs from the last profile switch: --op-profile 0 leaves it running over the timed steps too) */
    double wb = op_profile ? pi.weight_bytes_read / G : (p1.weight_bytes_read - p0.weight_bytes_read) / G;
    *wb_out = wb;
    if (wb > 0) {
        printf("bench: weight bytes read per decode step %.3f GB; achieved %.0f GB/s", wb / 1e9,
               wb / (step_ms * 1e-3) / 1e9);
        if (copy_bw > 0) printf(" = %.1f%% of the copy bandwidth", 100 * wb / (step_ms * 1e-3) / 1e9 / copy_bw);
        printf("\n");
    }
    fflush(stdout);
    rc = 0;
out:
    for (int b = 0; b < B; b++)
        if (seqs && seqs[b]) dsv4_seq_free(seqs[b]);
    free(seqs);
    free(items);
    free(step_s);
    return rc;
}

/* Greedy decoding at batch 1 (dsv4_seq_greedy: the picks stay on the device, the host records
 * each step while the device runs the one before) against the step API with the host picking
 * (one engine step a token, its logits row read back): two clones of s0, the same first token,
 * W untimed steps then G timed ones each; the two token streams must be identical. */
static int bench_greedy(dsv4_engine *e, dsv4_seq *s0, int P, int W, int G, int32_t first, float *lg, int vocab,
                        double copy_bw, double wb, dsv4_err *err) {
    dsv4_seq *a = NULL, *h = NULL;
    int32_t *ta = calloc((size_t)(W + G), sizeof *ta), *th = calloc((size_t)(W + G), sizeof *th);
    int rc = -1;
    double tg = 0, thost = 0;
    if (!ta || !th) {
        dsv4_errf(err, "greedy: out of memory");
        goto out;
    }
    if (dsv4_seq_clone(s0, P, &a, err) || dsv4_seq_clone(s0, P, &h, err)) goto out;
    /* the host loop first, so that the device picks' steps are a trace's last (tools/device/ktrace_report.py
     * reads the last N passes) */
    int32_t tok = first;
    double t0 = dsv4_now();
    for (int s = 0; s < W + G; s++) {
        if (s == W) t0 = dsv4_now();
        dsv4_step_item it = {h, &tok, 1, lg};
        if (dsv4_engine_step(e, &it, 1, err)) goto out;
        th[s] = tok = dsv4_argmax_row(lg, vocab);
    }
    thost = dsv4_now() - t0;
    if (W > 0 && dsv4_seq_greedy(a, first, W, ta, err)) goto out;
    t0 = dsv4_now();
    if (dsv4_seq_greedy(a, W > 0 ? ta[W - 1] : first, G, ta + W, err)) goto out;
    tg = dsv4_now() - t0;
    int same = !memcmp(ta, th, sizeof(int32_t) * (size_t)(W + G));
    double ms = tg / G * 1e3;
    printf("bench: greedy decode batch 1 at context %d (device picks, dsv4_seq_greedy): %d steps in %.3f s = %.2f "
           "ms/step = %.1f tok/s", P, G, tg, ms, G / tg);
    if (wb > 0 && copy_bw > 0) printf(" = %.1f%% of the copy bandwidth", 100 * wb / (ms * 1e-3) / 1e9 / copy_bw);
    printf("\nbench: greedy decode with host picks (one engine step a token, logits read back): %.2f ms/step; "
           "tokens of the two %s over %d steps\n", thost / G * 1e3, same ? "identical" : "DIFFERENT", W + G);
    fflush(stdout);
    if (!same) {
        dsv4_errf(err, "greedy: device picks differ from host picks");
        goto out;
    }
    rc = 0;
out:
    if (a) dsv4_seq_free(a);
    if (h) dsv4_seq_free(h);
    free(ta), free(th);
    return rc;
}

int dsv4_cmd_bench(int argc, char **argv) {
    const char *model = NULL, *backend = "auto", *numerics = NULL;
    enum { MAX_SETS = 32 };
    const char *sets[MAX_SETS];
    int n_sets = 0;
    int prompts[MAX_LIST] = {512}, batches[MAX_LIST] = {1}, np = 1, nb = 1;
    int G = 32, W = 8, threads = 0, copy_gb = 4, op_profile = 1, greedy = 1;
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
        else if (!strcmp(a, "--set")) {
            if (n_sets == MAX_SETS) {
                fprintf(stderr, "dsv4 bench: more than %d --set\n", MAX_SETS);
                return 2;
            }
            sets[n_sets++] = v;
        } else if (!strcmp(a, "--prompt")) bad = parse_list(v, 1, 1 << 24, prompts, MAX_LIST, &np);
        else if (!strcmp(a, "--gen")) bad = parse_int(v, 1, 1 << 20, &G);
        else if (!strcmp(a, "--batch")) bad = parse_list(v, 1, 4096, batches, MAX_LIST, &nb);
        else if (!strcmp(a, "--threads")) bad = parse_int(v, 0, 4096, &threads);
        else if (!strcmp(a, "--copy-gb")) bad = parse_int(v, 1, 64, &copy_gb);
        else if (!strcmp(a, "--op-profile")) bad = parse_int(v, 0, 1, &op_profile);
        else if (!strcmp(a, "--warmup")) bad = parse_int(v, 0, 1 << 16, &W);
        else if (!strcmp(a, "--greedy")) bad = parse_int(v, 0, 1, &greedy);
        else {
            fprintf(stderr, "dsv4 bench: unknown option %s\n", a);
            usage(stderr);
            return 2;
        }
        if (bad) {
            fprintf(stderr, "dsv4 bench: %s: '%s' is not a whole number in range%s\n", a, v,
                    strcmp(a, "--prompt") && strcmp(a, "--batch") ? "" : " (or a comma list of at most 8)");
            return 2;
        }
    }
    int Pmax = 0, Bmax = 0;
    for (int i = 0; i < np; i++) Pmax = prompts[i] > Pmax ? prompts[i] : Pmax;
    for (int i = 0; i < nb; i++) Bmax = batches[i] > Bmax ? batches[i] : Bmax;
    dsv4_err err = {{0}};
    dsv4_engine *e = NULL;
    dsv4_seq *s0 = NULL;
    size_t nid = (size_t)Pmax + ((size_t)W + 2 * (size_t)G) * Bmax;
    int32_t *ids = malloc(sizeof(int32_t) * nid);
    float *lg = NULL;
    int rc = 1;
    if (!ids) {
        snprintf(err.msg, sizeof err.msg, "out of memory");
        goto done;
    }
    dsv4_engine_opts o = {.model_dir = model,
                          .numerics = numerics,
                          .sets = sets,
                          .n_sets = n_sets,
                          .backend = backend,
                          .n_threads = threads};
    double t_open = dsv4_now();
    if (dsv4_engine_open(&e, &o, &err)) goto done;
    t_open = dsv4_now() - t_open;
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    lg = dsv4_engine_host_alloc(e, sizeof(float) * (size_t)info.vocab_size * Bmax); /* pinned on a device */
    if (!lg) {
        snprintf(err.msg, sizeof err.msg, "out of memory for logits");
        goto done;
    }
    uint32_t x = 777;
    for (size_t i = 0; i < nid; i++) {
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
    fflush(stdout);
    for (int ip = 0; ip < np; ip++) {
        int P = prompts[ip];
        if (dsv4_seq_new(e, &s0, &err)) goto done;
        double t0 = dsv4_now();
        if (dsv4_seq_append(s0, ids, P, lg, 0, &err)) goto done;
        double tp = dsv4_now() - t0;
        printf("bench: prefill %d tokens in %.3f s = %.1f tok/s\n", P, tp, P / tp);
        fflush(stdout);
        for (int ib = 0; ib < nb; ib++) {
            int B = batches[ib];
            if (B > 1) printf("bench: batch %d = %d clones of the sequence prefilled above\n", B, B);
            double wb = 0;
            if (bench_decode(e, s0, P, B, W, G, ids + Pmax, lg, info.vocab_size, copy_bw, op_profile, &wb, &err))
                goto done;
            if (B == 1 && greedy &&
                bench_greedy(e, s0, P, W, G, ids[Pmax], lg, info.vocab_size, copy_bw, wb, &err))
                goto done;
        }
        dsv4_seq_free(s0);
        s0 = NULL;
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 bench: %s\n", err.msg);
    if (s0) dsv4_seq_free(s0);
    free(ids);
    if (e) dsv4_engine_host_free(e, lg);
    dsv4_engine_close(e);
    return rc;
}
