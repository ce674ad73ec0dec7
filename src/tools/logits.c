/* tools/logits: `dsv4 logits` -- next-token logits for a token sequence.
 *
 * Writes float32 little-endian logits, T x vocab, row t = the distribution after
 * tokens 0..t, and prints one summary line.  --trace writes one JSON line per
 * MoE layer and token (chosen experts, their weights, indexer picks).
 */
#include <ctype.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "tools/commands.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 logits [--model DIR] (--tokens 5,17,42 | --tokens-file F) --out FILE\n"
            "                   [--numerics exact|reference] [--set NAME=VALUE ...] [--trace FILE]\n"
            "                   [--backend cpu] [--threads N] [--chunk N]\n"
            "  Runs the tokens through the model and writes float32 little-endian logits,\n"
            "  T x vocab (row t = next-token logits after tokens 0..t), then prints a summary.\n"
            "  --model DIR      checkpoint directory (default: the embedded default model)\n"
            "  --tokens LIST    token ids separated by commas\n"
            "  --tokens-file F  token ids separated by commas and/or whitespace\n"
            "  --numerics P     numerics profile (default exact); `dsv4 switches` lists switches\n"
            "  --set NAME=VALUE override one switch (repeatable)\n"
            "  --trace FILE     JSON lines: per layer and token, experts, weights, indexer picks\n"
            "  --chunk N        prefill in chunks of N tokens (default: all at once; same result)\n"
            "  --bench P,D      speed run instead: prefill P pseudo-random tokens (last logits only), then\n"
            "                   decode D tokens one at a time (logits each); prints tok/s; no --tokens/--out\n");
}

/* Parses ids separated by commas/whitespace.  Returns count or -1 (message in err). */
static int parse_ids(const char *s, int32_t **out, int *n, char *err, size_t errn) {
    int cap = 64, cnt = 0;
    int32_t *v = malloc(sizeof *v * (size_t)cap);
    if (!v) return snprintf(err, errn, "out of memory"), -1;
    const char *p = s;
    for (;;) {
        while (*p && (isspace((unsigned char)*p) || *p == ',')) p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX ||
            (*end && !isspace((unsigned char)*end) && *end != ',')) {
            const char *e = p;
            while (*e && !isspace((unsigned char)*e) && *e != ',') e++;
            snprintf(err, errn, "token %d: '%.*s' is not a non-negative integer id", cnt, (int)(e - p), p);
            free(v);
            return -1;
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, sizeof *v * (size_t)cap);
            if (!nv) {
                free(v);
                return snprintf(err, errn, "out of memory"), -1;
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
        p = end;
    }
    *out = v;
    *n = cnt;
    return cnt;
}

static char *read_file(const char *path, char *err, size_t errn) {
    FILE *f = fopen(path, "rb");
    if (!f) return snprintf(err, errn, "%s: %s", path, strerror(errno)), NULL;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        size_t got = fread(b + n, 1, cap - n - 1, f);
        n += got;
        if (n < cap - 1) break;
        cap *= 2;
        char *nb = realloc(b, cap);
        if (!nb) {
            free(b);
            b = NULL;
        } else
            b = nb;
    }
    int bad = ferror(f);
    fclose(f);
    if (!b || bad) {
        free(b);
        return snprintf(err, errn, "%s: read error", path), NULL;
    }
    b[n] = 0;
    return b;
}

typedef struct {
    FILE *f;
} trace_ctx;

static void trace_json(const dsv4_trace_event *ev, void *user) {
    trace_ctx *t = user;
    fprintf(t->f, "{\"layer\":%d,\"pos\":%lld,\"token\":%d,\"hash\":%s,\"experts\":[", ev->layer, (long long)ev->pos,
            ev->token, ev->is_hash ? "true" : "false");
    double sum = 0;
    for (int i = 0; i < ev->n_experts; i++) fprintf(t->f, "%s%d", i ? "," : "", ev->experts[i]);
    fprintf(t->f, "],\"weights\":[");
    for (int i = 0; i < ev->n_experts; i++) {
        fprintf(t->f, "%s%.9g", i ? "," : "", ev->weights[i]);
        sum += ev->weights[i];
    }
    fprintf(t->f, "],\"weight_sum\":%.9g", sum);
    if (ev->picks) {
        fprintf(t->f, ",\"picks\":[");
        for (int i = 0; i < ev->n_picks; i++) fprintf(t->f, "%s%d", i ? "," : "", ev->picks[i]);
        fprintf(t->f, "]");
    }
    fprintf(t->f, "}\n");
}

/* --bench: prefill P tokens (last-row logits), then D single-token decode steps. */
static int run_bench(const char *model, const char *numerics, const char **sets, int n_sets, const char *backend,
                     int threads, int P, int D) {
    dsv4_err err = {{0}};
    dsv4_engine *e = NULL;
    dsv4_seq *s = NULL;
    int32_t *ids = NULL;
    float *lg = NULL;
    int rc = 1;
    dsv4_engine_opts o = {.model_dir = model, .numerics = numerics, .sets = sets, .n_sets = n_sets,
                          .backend = backend, .n_threads = threads};
    if (dsv4_engine_open(&e, &o, &err) || dsv4_seq_new(e, &s, &err)) goto fail;
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    ids = malloc(sizeof *ids * ((size_t)P + D));
    lg = malloc(sizeof *lg * (size_t)info.vocab_size);
    if (!ids || !lg) {
        snprintf(err.msg, sizeof err.msg, "out of memory");
        goto fail;
    }
    uint32_t x = 12345;
    for (int i = 0; i < P + D; i++) {
        x = x * 1664525u + 1013904223u;
        ids[i] = (int32_t)((x >> 8) % (uint32_t)info.vocab_size);
    }
    double t0 = dsv4_now();
    if (dsv4_seq_append(s, ids, P, lg, 0, &err)) goto fail;
    double t1 = dsv4_now();
    for (int i = 0; i < D; i++)
        if (dsv4_seq_append(s, ids + P + i, 1, lg, 0, &err)) goto fail;
    double t2 = dsv4_now();
    printf("bench: model=%s numerics=%s prefill %d tokens %.3fs = %.2f tok/s, decode %d tokens %.3fs = %.2f tok/s, "
           "state %zu bytes\n",
           info.model_name, info.numerics, P, t1 - t0, P / (t1 - t0 > 0 ? t1 - t0 : 1e-9), D, t2 - t1,
           D ? D / (t2 - t1 > 0 ? t2 - t1 : 1e-9) : 0.0, dsv4_seq_state_bytes(s));
    rc = 0;
fail:
    if (rc) fprintf(stderr, "dsv4 logits: %s\n", err.msg);
    free(ids);
    free(lg);
    dsv4_seq_free(s);
    dsv4_engine_close(e);
    return rc;
}

int dsv4_cmd_logits(int argc, char **argv) {
    const char *model = NULL, *tokens = NULL, *tokens_file = NULL, *out = NULL, *numerics = NULL, *trace = NULL;
    const char *backend = NULL, *bench = NULL;
    int threads = 0, chunk = 0, n_sets = 0;
    const char **sets = calloc((size_t)argc + 1, sizeof *sets);
    if (!sets) return 1;
    int rc = 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            free(sets);
            return 0;
        }
        const char **dst = NULL;
        int *idst = NULL;
        if (!strcmp(a, "--model")) dst = &model;
        else if (!strcmp(a, "--tokens")) dst = &tokens;
        else if (!strcmp(a, "--tokens-file")) dst = &tokens_file;
        else if (!strcmp(a, "--out")) dst = &out;
        else if (!strcmp(a, "--numerics")) dst = &numerics;
        else if (!strcmp(a, "--trace")) dst = &trace;
        else if (!strcmp(a, "--backend")) dst = &backend;
        else if (!strcmp(a, "--bench")) dst = &bench;
        else if (!strcmp(a, "--set")) dst = &sets[n_sets];
        else if (!strcmp(a, "--threads")) idst = &threads;
        else if (!strcmp(a, "--chunk")) idst = &chunk;
        else {
            fprintf(stderr, "dsv4 logits: unknown option '%s' (see --help)\n", a);
            goto done;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 logits: %s needs a value\n", a);
            goto done;
        }
        const char *v = argv[++i];
        if (dst) {
            *dst = v;
            if (dst == &sets[n_sets]) n_sets++;
        } else {
            char *end;
            long x = strtol(v, &end, 10);
            if (*end || x < 0 || x > 1 << 20) {
                fprintf(stderr, "dsv4 logits: %s expects a non-negative integer, got '%s'\n", a, v);
                goto done;
            }
            *idst = (int)x;
        }
    }
    if (bench) {
        int P = 0, D = 0;
        char tail = 0;
        if (sscanf(bench, "%d,%d%c", &P, &D, &tail) != 2 || P < 1 || D < 0 || P > 1 << 20 || D > 1 << 20) {
            fprintf(stderr, "dsv4 logits: --bench expects PREFILL,DECODE (e.g. 512,64), got '%s'\n", bench);
            goto done;
        }
        rc = run_bench(model, numerics, sets, n_sets, backend, threads, P, D);
        goto done;
    }
    if (!!tokens + !!tokens_file != 1) {
        fprintf(stderr, "dsv4 logits: give exactly one of --tokens or --tokens-file\n");
        goto done;
    }
    if (!out) {
        fprintf(stderr, "dsv4 logits: --out FILE is required\n");
        goto done;
    }
    char msg[512];
    int32_t *ids = NULL;
    int T = 0;
    char *text = NULL;
    if (tokens_file && !(text = read_file(tokens_file, msg, sizeof msg))) {
        fprintf(stderr, "dsv4 logits: %s\n", msg);
        goto done;
    }
    if (parse_ids(text ? text : tokens, &ids, &T, msg, sizeof msg) < 0) {
        fprintf(stderr, "dsv4 logits: %s%s%s\n", tokens_file ? tokens_file : "--tokens", ": ", msg);
        free(text);
        goto done;
    }
    free(text);
    if (T == 0) {
        fprintf(stderr, "dsv4 logits: no token ids given\n");
        free(ids);
        goto done;
    }
    rc = 1;
    dsv4_err err = {{0}};
    dsv4_engine *e = NULL;
    dsv4_seq *s = NULL;
    float *logits = NULL;
    FILE *tf = NULL, *of = NULL;
    trace_ctx tc = {0};
    dsv4_engine_opts o = {.model_dir = model, .numerics = numerics, .sets = sets, .n_sets = n_sets,
                          .backend = backend, .n_threads = threads};
    if (dsv4_engine_open(&e, &o, &err)) {
        fprintf(stderr, "dsv4 logits: %s\n", err.msg);
        goto cleanup;
    }
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    if (trace) {
        if (!(tf = fopen(trace, "w"))) {
            fprintf(stderr, "dsv4 logits: %s: %s\n", trace, strerror(errno));
            goto cleanup;
        }
        tc.f = tf;
        dsv4_engine_set_trace(e, trace_json, &tc);
    }
    logits = malloc(sizeof(float) * (size_t)T * (size_t)info.vocab_size);
    if (!logits) {
        fprintf(stderr, "dsv4 logits: out of memory for %d x %d logits\n", T, info.vocab_size);
        goto cleanup;
    }
    if (dsv4_seq_new(e, &s, &err)) {
        fprintf(stderr, "dsv4 logits: %s\n", err.msg);
        goto cleanup;
    }
    double t0 = dsv4_now();
    int step = chunk > 0 ? chunk : T;
    for (int at = 0; at < T; at += step) {
        int n = T - at < step ? T - at : step;
        if (dsv4_seq_append(s, ids + at, n, logits + (size_t)at * info.vocab_size, 1, &err)) {
            fprintf(stderr, "dsv4 logits: %s\n", err.msg);
            goto cleanup;
        }
    }
    double dt = dsv4_now() - t0;
    if (!(of = fopen(out, "wb"))) {
        fprintf(stderr, "dsv4 logits: %s: %s\n", out, strerror(errno));
        goto cleanup;
    }
    size_t nvals = (size_t)T * info.vocab_size;
    if (fwrite(logits, sizeof(float), nvals, of) != nvals || fclose(of) != 0) {
        of = NULL;
        fprintf(stderr, "dsv4 logits: %s: write failed\n", out);
        goto cleanup;
    }
    of = NULL;
    const float *last = logits + (size_t)(T - 1) * info.vocab_size;
    int am = 0;
    for (int i = 1; i < info.vocab_size; i++)
        if (last[i] > last[am]) am = i;
    printf("logits: T=%d vocab=%d numerics=%s time=%.3fs (%.1f tok/s) argmax_last=%d (%.4f) state=%zu bytes -> %s\n",
           T, info.vocab_size, info.numerics, dt, T / (dt > 0 ? dt : 1e-9), am, last[am], dsv4_seq_state_bytes(s), out);
    rc = 0;
cleanup:
    if (of) fclose(of);
    if (tf) fclose(tf);
    free(logits);
    dsv4_seq_free(s);
    dsv4_engine_close(e);
    free(ids);
done:
    free(sets);
    return rc;
}
