/* fidelity/ab: indexer recall and switch A/B (contract in ab.h). */
#include "fidelity/ab.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "fidelity/common.h"
#include "model/config.h"
#include "text/tokenizer.h"

/* ----- shared: one run of an engine over the tokens ----- */
typedef struct run_out {
    fid_picks picks;
    float *logits;      /* [n_samples][vocab] logits at the last position of each chunk */
    int n_samples;
    double secs;
} run_out;

static void run_free(run_out *r) {
    fid_picks_free(&r->picks);
    free(r->logits);
    memset(r, 0, sizeof *r);
}

/* Runs ids through a fresh sequence in chunks of `every` tokens, recording the
 * indexer picks and routing sums of every token and (if want_logits) the logits
 * at the end of each chunk. */
static int run_engine(dsv4_engine *e, const dsv4_config *cfg, const int32_t *ids, int T, int every, int want_logits,
                      run_out *out, dsv4_err *err) {
    memset(out, 0, sizeof *out);
    if (fid_picks_init(&out->picks, cfg->n_layers, cfg->index_topk, T, cfg->routed_scale, err)) return -1;
    int ns = (T + every - 1) / every;
    if (want_logits) {
        out->logits = malloc(sizeof(float) * (size_t)ns * (size_t)cfg->vocab_size);
        if (!out->logits) {
            run_free(out);
            return dsv4_errf(err, "out of memory for %d x %d logits", ns, cfg->vocab_size);
        }
    }
    dsv4_seq *s = NULL;
    if (dsv4_seq_new(e, &s, err)) {
        run_free(out);
        return -1;
    }
    dsv4_engine_set_trace(e, fid_picks_trace, &out->picks);
    double t0 = dsv4_now();
    int rc = 0;
    for (int at = 0, k = 0; at < T && !rc; at += every, k++) {
        int n = T - at < every ? T - at : every;
        float *lg = want_logits ? out->logits + (size_t)k * cfg->vocab_size : NULL;
        rc = dsv4_seq_append(s, ids + at, n, lg, 0, err);
    }
    out->secs = dsv4_now() - t0;
    out->n_samples = ns;
    dsv4_engine_set_trace(e, NULL, NULL);
    dsv4_seq_free(s);
    if (!rc && !out->picks.trace_ok) rc = dsv4_errf(err, "the engine's trace reported picks outside the table");
    if (rc) run_free(out);
    return rc;
}

/* Tokens: --text FILE through the model's tokenizer.json, else synthetic ids. */
static int get_tokens(const char *text_path, const char *model_dir, int T, uint64_t seed, int vocab, int32_t **out,
                      dsv4_err *err) {
    int32_t *ids = malloc(sizeof *ids * (size_t)T);
    if (!ids) return dsv4_errf(err, "out of memory for %d tokens", T);
    if (!text_path) {
        fid_synthetic_ids(ids, T, seed, 100, vocab > 101 ? vocab : 101);
        *out = ids;
        return 0;
    }
    char tp[4200];
    snprintf(tp, sizeof tp, "%s/tokenizer.json", model_dir);
    dsv4_tokenizer *tok = NULL;
    size_t len = 0;
    char *text = NULL;
    dsv4_ids v = {0};
    int rc = -1;
    if (dsv4_tokenizer_load(&tok, tp, err)) goto done;
    if (!(text = fid_read_file(text_path, &len, err))) goto done;
    if (dsv4_tokenizer_encode(tok, text, len, DSV4_TOK_LOSSY, &v, err)) {
        dsv4_err_prefix(err, "%s", text_path);
        goto done;
    }
    if ((int64_t)v.len < T) {
        dsv4_errf(err, "%s: %zu tokens, but the longest --lengths entry needs %d", text_path, v.len, T);
        goto done;
    }
    memcpy(ids, v.ids, sizeof *ids * (size_t)T);
    rc = 0;
done:
    dsv4_ids_free(&v);
    free(text);
    dsv4_tokenizer_free(tok);
    if (rc) free(ids);
    else *out = ids;
    return rc;
}

static int parse_list(const char *s, int *v, int max, int lo, int hi, const char *what, dsv4_err *err) {
    int n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || x < lo || x > hi)
            return dsv4_errf(err, "%s: '%s' is not a comma-separated list of integers in [%d, %d]", what, s, lo, hi);
        if (n == max) return dsv4_errf(err, "%s: more than %d entries", what, max);
        v[n++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (!n) return dsv4_errf(err, "%s: empty list", what);
    return n;
}

static int open_cfg(dsv4_engine *e, dsv4_config *cfg, dsv4_err *err) {
    dsv4_engine_info info;
    dsv4_engine_get_info(e, &info);
    char p[4200];
    snprintf(p, sizeof p, "%s/config.json", info.model_dir);
    return dsv4_config_load(cfg, p, err);
}

/* ----- indexer-recall ----- */
static void ir_usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 fidelity indexer-recall [--model DIR] [--lengths 256,512,1024] [--set NAME=VALUE ...]\n"
            "                                    [--text FILE] [--seed S] [--window N] [--json F] [--svg F]\n"
            "  recall@k of the indexer's selection with the --set switches (default indexer.keys=fp8)\n"
            "  against the `exact` selection, for every compressed-sparse (ratio 4) layer, by context\n"
            "  length.  The recall at length L is over the queries at positions [L-N, L) (N = --window,\n"
            "  default 64) that see more than topk compressed rows; both runs share one causal pass.\n"
            "  --text FILE  tokenize this text with the model's tokenizer (default: synthetic ids)\n");
}

#define IR_MAX_LEN 32

int fid_cmd_indexer_recall(int argc, char **argv) {
    const char *model = NULL, *lengths_s = "256,512,1024", *text = NULL, *json = NULL, *svg = NULL;
    const char *sets[FID_MAX_SETS];
    int n_sets = 0;
    long seed = 1, window = 64;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return ir_usage(stdout), 0;
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 fidelity indexer-recall: %s needs a value (see --help)\n", a);
            return 2;
        }
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--lengths")) lengths_s = v;
        else if (!strcmp(a, "--text")) text = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--svg")) svg = v;
        else if (!strcmp(a, "--set")) {
            if (n_sets == FID_MAX_SETS) return fprintf(stderr, "dsv4 fidelity indexer-recall: too many --set\n"), 2;
            sets[n_sets++] = v;
        } else if (!strcmp(a, "--seed") || !strcmp(a, "--window")) {
            char *end;
            long x = strtol(v, &end, 10);
            if (!*v || *end || x < (a[2] == 'w' ? 1 : 0) || x > 1L << 30) {
                fprintf(stderr, "dsv4 fidelity indexer-recall: %s expects a positive integer, got '%s'\n", a, v);
                return 2;
            }
            *(a[2] == 's' ? &seed : &window) = x;
        } else {
            fprintf(stderr, "dsv4 fidelity indexer-recall: unknown option '%s' (see --help)\n", a);
            return 2;
        }
    }
    if (!n_sets) sets[n_sets++] = "indexer.keys=fp8";
    dsv4_err err = {{0}};
    int lengths[IR_MAX_LEN];
    int nl = parse_list(lengths_s, lengths, IR_MAX_LEN, 1, 1 << 22, "--lengths", &err);
    if (nl < 0) return fprintf(stderr, "dsv4 fidelity indexer-recall: %s\n", err.msg), 2;
    int T = 0;
    for (int i = 0; i < nl; i++) T = lengths[i] > T ? lengths[i] : T;
    /* the switched spec is checked before anything is loaded */
    char spec_text[512] = "exact";
    for (int i = 0; i < n_sets; i++) {
        size_t l = strlen(spec_text);
        snprintf(spec_text + l, sizeof spec_text - l, ",%s", sets[i]);
    }
    fid_spec sx, sw;
    if (fid_spec_parse(&sx, "exact", &err) || fid_spec_parse(&sw, spec_text, &err))
        return fprintf(stderr, "dsv4 fidelity indexer-recall: %s\n", err.msg), 2;

    int rc = 1;
    dsv4_engine *ex = NULL, *es = NULL;
    int32_t *ids = NULL;
    run_out rx = {0}, rs = {0};
    dsv4_config cfg;
    dsv4_engine_info info;
    int rl[64];
    int n_rl = 0;
    double *recall = NULL;
    int64_t *rows_n = NULL;
    if (fid_spec_open(&sx, model, &ex, &err) || fid_spec_open(&sw, model, &es, &err)) goto done;
    if (open_cfg(ex, &cfg, &err)) goto done;
    dsv4_engine_get_info(ex, &info);
    for (int l = 0; l < cfg.n_layers && n_rl < 64; l++)
        if (cfg.compress_ratio[l] == 4) rl[n_rl++] = l;
    if (!n_rl) {
        dsv4_errf(&err, "%s has no compressed-sparse (ratio 4) layers: nothing to measure", info.model_dir);
        goto done;
    }
    if (get_tokens(text, info.model_dir, T, (uint64_t)seed, cfg.vocab_size, &ids, &err)) goto done;
    if (run_engine(ex, &cfg, ids, T, 256, 0, &rx, &err) || run_engine(es, &cfg, ids, T, 256, 0, &rs, &err)) goto done;
    recall = calloc((size_t)n_rl * nl, sizeof *recall);
    rows_n = calloc((size_t)n_rl * nl, sizeof *rows_n);
    if (!recall || !rows_n) {
        dsv4_errf(&err, "out of memory");
        goto done;
    }
    printf("indexer recall@%d: %s vs exact, model %s, %s, queries [L-%ld, L)\n", cfg.index_topk, spec_text,
           info.model_name, text ? text : "synthetic ids", window);
    printf("%-8s", "layer");
    for (int j = 0; j < nl; j++) printf(" %11s%-7d", "L=", lengths[j]);
    printf("\n");
    for (int i = 0; i < n_rl; i++) {
        printf("%-8d", rl[i]);
        for (int j = 0; j < nl; j++) {
            int64_t hit = 0, tot = 0, L = lengths[j], p0 = L - window < 0 ? 0 : L - window;
            fid_picks_recall(&rx.picks, &rs.picks, rl[i], p0, L, 4, &hit, &tot);
            recall[i * nl + j] = tot ? (double)hit / (double)tot : NAN;
            rows_n[i * nl + j] = tot / (cfg.index_topk ? cfg.index_topk : 1);
            if (tot) printf(" %18.4f", recall[i * nl + j]);
            else printf(" %18s", "n/a");
        }
        printf("\n");
    }
    for (int i = 0; i < n_rl * nl; i++)
        if (recall[i] != recall[i]) {
            printf("(n/a: no query in the window sees more than topk=%d compressed rows; use longer lengths)\n",
                   cfg.index_topk);
            break;
        }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            dsv4_errf(&err, "%s: cannot open for writing", json);
            goto done;
        }
        fprintf(f, "{\"model\":");
        fid_json_str(f, info.model_name);
        fprintf(f, ",\"spec\":");
        fid_json_str(f, spec_text);
        fprintf(f, ",\"topk\":%d,\"window\":%ld,\"text\":", cfg.index_topk, window);
        if (text) fid_json_str(f, text);
        else fprintf(f, "null");
        fprintf(f, ",\"lengths\":[");
        for (int j = 0; j < nl; j++) fprintf(f, "%s%d", j ? "," : "", lengths[j]);
        fprintf(f, "],\"layers\":[");
        for (int i = 0; i < n_rl; i++) {
            fprintf(f, "%s{\"layer\":%d,\"recall\":[", i ? "," : "", rl[i]);
            for (int j = 0; j < nl; j++) {
                double r = recall[i * nl + j];
                if (r == r) fprintf(f, "%s%.6f", j ? "," : "", r);
                else fprintf(f, "%snull", j ? "," : "");
            }
            fprintf(f, "],\"queries\":[");
            for (int j = 0; j < nl; j++) fprintf(f, "%s%lld", j ? "," : "", (long long)rows_n[i * nl + j]);
            fprintf(f, "]}");
        }
        fprintf(f, "]}\n");
        if (fclose(f)) {
            dsv4_errf(&err, "%s: write error", json);
            goto done;
        }
    }
    if (svg) {
        FILE *f = fopen(svg, "w");
        if (!f) {
            dsv4_errf(&err, "%s: cannot open for writing", svg);
            goto done;
        }
        /* recall (0..1) against log2(length), one polyline per layer */
        const int W = 640, H = 360, x0 = 60, y0 = 30, pw = 540, ph = 270;
        static const char *const COL[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"};
        double lmin = log2(lengths[0]), lmax = lmin;
        for (int j = 0; j < nl; j++) {
            double v = log2(lengths[j]);
            lmin = v < lmin ? v : lmin;
            lmax = v > lmax ? v : lmax;
        }
        if (lmax == lmin) lmax = lmin + 1;
        fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" font-family=\"sans-serif\" "
                   "font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n", W, H);
        fprintf(f, "<text x=\"%d\" y=\"18\">indexer recall@%d vs exact: ", x0, cfg.index_topk);
        fid_html_str(f, spec_text);
        fprintf(f, "</text>\n");
        for (int t = 0; t <= 4; t++) {
            int y = y0 + ph - ph * t / 4;
            fprintf(f, "<line x1=\"%d\" y1=\"%d\" x2=\"%d\" y2=\"%d\" stroke=\"#ddd\"/><text x=\"%d\" y=\"%d\" "
                       "text-anchor=\"end\">%.2f</text>\n", x0, y, x0 + pw, y, x0 - 6, y + 4, t / 4.0);
        }
        for (int j = 0; j < nl; j++) {
            int x = x0 + (int)((log2(lengths[j]) - lmin) / (lmax - lmin) * pw);
            fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%d</text>\n", x, y0 + ph + 16, lengths[j]);
        }
        fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">context length (tokens)</text>\n", x0 + pw / 2,
                y0 + ph + 34);
        for (int i = 0; i < n_rl; i++) {
            const char *col = COL[i % 6];
            fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\" points=\"", col);
            for (int j = 0; j < nl; j++) {
                double r = recall[i * nl + j];
                if (r != r) continue;
                fprintf(f, "%d,%d ", x0 + (int)((log2(lengths[j]) - lmin) / (lmax - lmin) * pw),
                        y0 + ph - (int)(r * ph));
            }
            fprintf(f, "\"/>\n<text x=\"%d\" y=\"%d\" fill=\"%s\">layer %d</text>\n", x0 + pw - 60,
                    y0 + ph - 10 - 14 * i, col, rl[i]);
        }
        fprintf(f, "</svg>\n");
        if (fclose(f)) {
            dsv4_errf(&err, "%s: write error", svg);
            goto done;
        }
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 fidelity indexer-recall: %s\n", err.msg);
    free(recall);
    free(rows_n);
    run_free(&rx);
    run_free(&rs);
    free(ids);
    dsv4_engine_close(ex);
    dsv4_engine_close(es);
    return rc;
}

/* ----- ab ----- */
static void ab_usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 fidelity ab --switches NAME=VALUE,... [--combined] [--model DIR]\n"
            "                        [--tokens IDS | --tokens-file F | --random N] [--every N] [--json F]\n"
            "  One row per switch (exact plus that switch; --combined adds all of them together):\n"
            "  mean |logit diff| and KL(exact || switched) at the end of every --every tokens (default\n"
            "  16), argmax agreement there, indexer recall@k over all compressed-sparse layers and\n"
            "  positions that see more than topk rows, the routing invariant (routed weights must sum\n"
            "  to routed_scaling_factor for every token; a violation is FLAGGED) and speed (tok/s).\n"
            "  Default tokens: 256 synthetic ids.\n");
}

#define AB_MAX 32

static void logit_stats(const float *a, const float *b, int V, double *mad, double *kl, int *agree) {
    double ma = -INFINITY, mb = -INFINITY, s = 0;
    int ia = 0, ib = 0;
    for (int v = 0; v < V; v++) {
        if (a[v] > ma) ma = a[v], ia = v;
        if (b[v] > mb) mb = b[v], ib = v;
        s += fabs((double)a[v] - b[v]);
    }
    double za = 0, zb = 0;
    for (int v = 0; v < V; v++) za += exp(a[v] - ma), zb += exp(b[v] - mb);
    double lza = log(za), lzb = log(zb), k = 0;
    for (int v = 0; v < V; v++) {
        double la = a[v] - ma - lza, lb = b[v] - mb - lzb;
        k += exp(la) * (la - lb);
    }
    *mad += s / V;
    *kl += k > 0 ? k : 0;
    *agree += ia == ib;
}

int fid_cmd_ab(int argc, char **argv) {
    const char *model = NULL, *switches = NULL, *tokens = NULL, *tokens_file = NULL, *json = NULL;
    long random_n = 0, every = 16;
    int combined = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return ab_usage(stdout), 0;
        if (!strcmp(a, "--combined")) {
            combined = 1;
            continue;
        }
        if (i + 1 >= argc) return fprintf(stderr, "dsv4 fidelity ab: %s needs a value (see --help)\n", a), 2;
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--switches")) switches = v;
        else if (!strcmp(a, "--tokens")) tokens = v;
        else if (!strcmp(a, "--tokens-file")) tokens_file = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--random") || !strcmp(a, "--every")) {
            char *end;
            long x = strtol(v, &end, 10);
            if (!*v || *end || x < 1 || x > 1L << 22)
                return fprintf(stderr, "dsv4 fidelity ab: %s expects a positive integer, got '%s'\n", a, v), 2;
            *(a[2] == 'r' ? &random_n : &every) = x;
        } else
            return fprintf(stderr, "dsv4 fidelity ab: unknown option '%s' (see --help)\n", a), 2;
    }
    if (!switches)
        return fprintf(stderr, "dsv4 fidelity ab: --switches NAME=VALUE,... is required (see dsv4 switches)\n"), 2;
    dsv4_err err = {{0}};
    /* rows: each switch alone, then optionally all together; all validated up front */
    fid_spec specs[AB_MAX + 1];
    int n_rows = 0;
    char buf[512], all[512] = "exact";
    snprintf(buf, sizeof buf, "%s", switches);
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n_rows == AB_MAX) return fprintf(stderr, "dsv4 fidelity ab: more than %d switches\n", AB_MAX), 2;
        char one[160];
        snprintf(one, sizeof one, "exact,%s", t);
        if (fid_spec_parse(&specs[n_rows], one, &err))
            return fprintf(stderr, "dsv4 fidelity ab: --switches: %s\n", err.msg), 2;
        n_rows++;
        size_t l = strlen(all);
        snprintf(all + l, sizeof all - l, ",%s", t);
    }
    if (!n_rows) return fprintf(stderr, "dsv4 fidelity ab: --switches is empty\n"), 2;
    if (combined && n_rows > 1 && fid_spec_parse(&specs[n_rows++], all, &err))
        return fprintf(stderr, "dsv4 fidelity ab: --combined: %s\n", err.msg), 2;
    int32_t *ids = NULL;
    int T = 0;
    if (tokens || tokens_file) {
        if (random_n) return fprintf(stderr, "dsv4 fidelity ab: give one of --tokens, --tokens-file, --random\n"), 2;
        if (fid_load_tokens(tokens, tokens_file, &ids, &T, &err))
            return fprintf(stderr, "dsv4 fidelity ab: %s\n", err.msg), 2;
    }

    int rc = 1;
    fid_spec sx;
    dsv4_engine *ex = NULL, *es = NULL;
    run_out rx = {0}, rs = {0};
    dsv4_config cfg;
    dsv4_engine_info info;
    FILE *jf = NULL;
    fid_spec_parse(&sx, "exact", &err);
    if (fid_spec_open(&sx, model, &ex, &err) || open_cfg(ex, &cfg, &err)) goto done;
    dsv4_engine_get_info(ex, &info);
    if (!ids) {
        T = random_n ? (int)random_n : 256;
        if (get_tokens(NULL, info.model_dir, T, 1, cfg.vocab_size, &ids, &err)) goto done;
    }
    if (run_engine(ex, &cfg, ids, T, (int)every, 1, &rx, &err)) goto done;
    if (json && !(jf = fopen(json, "w"))) {
        dsv4_errf(&err, "%s: cannot open for writing", json);
        goto done;
    }
    printf("fidelity ab: model %s, %d tokens, logits every %ld tokens (%d samples); exact runs at %.0f tok/s\n",
           info.model_name, T, every, rx.n_samples, T / (rx.secs > 0 ? rx.secs : 1e-9));
    printf("%-34s %11s %11s %8s %9s %-34s %8s\n", "switch", "logit_mad", "KL", "argmax", "recall@k", "routing",
           "tok/s");
    if (jf) {
        fprintf(jf, "{\"model\":");
        fid_json_str(jf, info.model_name);
        fprintf(jf, ",\"tokens\":%d,\"every\":%ld,\"exact_tok_s\":%.3f,\"rows\":[", T, every,
                T / (rx.secs > 0 ? rx.secs : 1e-9));
    }
    int flagged = 0;
    for (int r = 0; r < n_rows; r++) {
        if (fid_spec_open(&specs[r], model, &es, &err)) goto done;
        if (run_engine(es, &cfg, ids, T, (int)every, 1, &rs, &err)) goto done;
        double mad = 0, kl = 0;
        int agree = 0;
        for (int k = 0; k < rx.n_samples; k++)
            logit_stats(rx.logits + (size_t)k * cfg.vocab_size, rs.logits + (size_t)k * cfg.vocab_size,
                        cfg.vocab_size, &mad, &kl, &agree);
        mad /= rx.n_samples;
        kl /= rx.n_samples;
        int64_t hit = 0, tot = 0;
        for (int l = 0; l < cfg.n_layers; l++)
            if (cfg.compress_ratio[l] == 4) fid_picks_recall(&rx.picks, &rs.picks, l, 0, T, 4, &hit, &tot);
        char routing[96];
        if (rs.picks.route_bad) {
            snprintf(routing, sizeof routing, "FLAGGED %lld/%lld sums off by %.3g", (long long)rs.picks.route_bad,
                     (long long)rs.picks.route_events, rs.picks.route_worst);
            flagged++;
        } else
            snprintf(routing, sizeof routing, "ok (sum = %.3g)", cfg.routed_scale);
        const char *name = specs[r].text + 6; /* past "exact," */
        char rec[24];
        if (tot) snprintf(rec, sizeof rec, "%.4f", (double)hit / (double)tot);
        else snprintf(rec, sizeof rec, "n/a");
        printf("%-34s %11.4e %11.4e %7.1f%% %9s %-34s %8.0f\n", name, mad, kl, 100.0 * agree / rx.n_samples, rec,
               routing, T / (rs.secs > 0 ? rs.secs : 1e-9));
        fflush(stdout);
        if (jf) {
            fprintf(jf, "%s\n{\"switch\":", r ? "," : "");
            fid_json_str(jf, name);
            fprintf(jf, ",\"logit_mean_abs\":%.9g,\"kl\":%.9g,\"argmax_agreement\":%.6f,\"recall\":", mad, kl,
                    (double)agree / rx.n_samples);
            if (tot) fprintf(jf, "%.6f", (double)hit / (double)tot);
            else fprintf(jf, "null");
            fprintf(jf, ",\"routing_ok\":%s,\"routing_bad_tokens\":%lld,\"routing_worst_dev\":%.9g,\"tok_s\":%.3f}",
                    rs.picks.route_bad ? "false" : "true", (long long)rs.picks.route_bad, rs.picks.route_worst,
                    T / (rs.secs > 0 ? rs.secs : 1e-9));
        }
        run_free(&rs);
        dsv4_engine_close(es);
        es = NULL;
    }
    if (flagged)
        printf("routing invariant violated by %d row(s): routed weights must sum to routed_scaling_factor %.3g\n",
               flagged, cfg.routed_scale);
    if (jf) {
        fprintf(jf, "\n]}\n");
        int bad = fclose(jf);
        jf = NULL;
        if (bad) {
            dsv4_errf(&err, "%s: write error", json);
            goto done;
        }
    }
    rc = 0;
done:
    if (rc) fprintf(stderr, "dsv4 fidelity ab: %s\n", err.msg);
    if (jf) fclose(jf);
    run_free(&rx);
    run_free(&rs);
    dsv4_engine_close(es);
    dsv4_engine_close(ex);
    free(ids);
    return rc;
}
