/* tools/diff: `dsv4 diff` -- layer-by-layer, op-by-op comparison of two engine
 * configurations on the same tokens (issue 7).
 *
 * Both engines run the same tokens in the same chunks, so their op traces
 * (engine.h, dsv4_engine_set_op_trace) are the same sequence of events.  A's
 * events of one chunk are copied; B's are compared against them as they come
 * (only one chunk is ever held).  Statistics accumulate per (layer, op) over all
 * chunks: relative L2 error ||a-b||/||a||, cosine, max |a-b|, and for index
 * outputs (indexer picks, chosen experts) the overlap of the selected sets.
 *
 * Where a difference enters: within one layer, ops are ordered as the graph runs
 * them; across chunks, layer l of a later chunk depends only on layer l's state
 * from earlier chunks (window ring, compressor and indexer rows) and on layers
 * < l of its own chunk.  So the first diverging row of the table in (layer, op)
 * order is where the difference enters, whatever chunk first showed it.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/engine.h"
#include "fidelity/common.h"
#include "tools/commands.h"

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 diff [--model DIR] (--tokens IDS | --tokens-file F | --random N [--seed S])\n"
            "                 --a SPEC --b SPEC [--threshold X] [--json FILE] [--chunk N] [--quiet]\n"
            "  Runs both configurations on the same tokens and compares every traced op, layer\n"
            "  by layer: HC state after each sublayer, q/kv, compressed and indexer keys, indexer\n"
            "  scores and picks, router logits, routing (experts and weights as applied), MoE\n"
            "  output, logits.  Prints a table; the last line is `first divergence: layer L OP`\n"
            "  (where the difference enters) or `no divergence above X`.\n"
            "  SPEC         profile[,name=value...][,backend=cpu|cuda], e.g. exact,mhc.gemm=bf16\n"
            "               (`dsv4 switches` lists profiles and switches)\n"
            "  --threshold  relative L2 error above which an op diverges (default 1e-5; identical\n"
            "               specs are bit-identical on the CPU); any change of picks/experts diverges\n"
            "  --random N   N pseudo-random token ids (seed --seed, default 1) instead of --tokens\n"
            "  --chunk N    tokens per append (default 64; both engines use the same cut)\n"
            "  --quiet      print only diverging rows and the verdict\n"
            "  --all-logits compare the logits of every position (default: the last of each chunk;\n"
            "               the vocab-wide head dominates the cost of small models)\n"
            "  --json FILE  the table and verdict as JSON\n");
}

/* ----- the captured events of one chunk of engine A ----- */
typedef struct cap_ev {
    const char *op; /* a string literal of the forward pass */
    int layer, rows, width;
    float *f;
    int32_t *ids;
    int *nv;
} cap_ev;

/* ----- per (layer, op) statistics ----- */
typedef struct stat_row {
    const char *op;
    int layer;
    int has_f, has_ids;
    double d2, a2, b2, dot, maxabs;
    int64_t nvals, id_tot, id_hit;
    int64_t first_pos; /* position of the first row whose values differ at all (-1 none) */
} stat_row;

typedef struct diff_ctx {
    cap_ev *ev;
    int n_ev, cap_ev;
    int cursor;         /* next A event for B to compare against */
    int failed;         /* allocation failure or mismatched traces */
    char why[512];
    stat_row *rows;
    int n_rows, cap_rows;
} diff_ctx;

static void ctx_fail(diff_ctx *c, const char *fmt, const char *op, int layer) {
    if (c->failed) return;
    c->failed = 1;
    snprintf(c->why, sizeof c->why, fmt, op, layer);
}

static void clear_events(diff_ctx *c) {
    for (int i = 0; i < c->n_ev; i++) {
        free(c->ev[i].f);
        free(c->ev[i].ids);
        free(c->ev[i].nv);
    }
    c->n_ev = 0;
    c->cursor = 0;
}

static void *dup_mem(const void *p, size_t n) {
    if (!p) return NULL;
    void *q = malloc(n ? n : 1);
    if (q) memcpy(q, p, n);
    return q;
}

static void capture_a(const dsv4_op_event *e, void *user) {
    diff_ctx *c = user;
    if (c->failed) return;
    if (c->n_ev == c->cap_ev) {
        int nc = c->cap_ev ? 2 * c->cap_ev : 256;
        cap_ev *ne = realloc(c->ev, sizeof *ne * (size_t)nc);
        if (!ne) return ctx_fail(c, "out of memory capturing %s (layer %d)", e->op, e->layer);
        c->ev = ne;
        c->cap_ev = nc;
    }
    size_t n = (size_t)e->rows * (size_t)e->width;
    cap_ev *v = &c->ev[c->n_ev];
    *v = (cap_ev){.op = e->op, .layer = e->layer, .rows = e->rows, .width = e->width};
    v->f = dup_mem(e->f, sizeof(float) * n);
    v->ids = dup_mem(e->ids, sizeof(int32_t) * n);
    v->nv = dup_mem(e->n_valid, sizeof(int) * (size_t)e->rows);
    c->n_ev++;
    if ((e->f && !v->f) || (e->ids && !v->ids) || (e->n_valid && !v->nv))
        ctx_fail(c, "out of memory capturing %s (layer %d)", e->op, e->layer);
}

/* Graph order of the ops inside one layer (engine.h lists them); ops added to the
 * trace later sort after these, in the order first seen. */
static const char *const OP_ORDER[] = {
    "attn.hc_pre", "attn.q",       "attn.kv",     "attn.comp_rows",    "indexer.keys", "indexer.q",
    "indexer.scores", "indexer.picks", "attn.out", "attn.hc_post",     "ffn.hc_pre",   "moe.router_logits",
    "moe.route",   "moe.out",      "ffn.hc_post", "head.logits"};
static int op_rank(const char *op) {
    for (size_t i = 0; i < sizeof OP_ORDER / sizeof OP_ORDER[0]; i++)
        if (!strcmp(op, OP_ORDER[i])) return (int)i;
    return 1000;
}

static stat_row *row_for(diff_ctx *c, const char *op, int layer) {
    for (int i = c->n_rows - 1; i >= 0; i--)
        if (c->rows[i].layer == layer && !strcmp(c->rows[i].op, op)) return &c->rows[i];
    if (c->n_rows == c->cap_rows) {
        int nc = c->cap_rows ? 2 * c->cap_rows : 128;
        stat_row *nr = realloc(c->rows, sizeof *nr * (size_t)nc);
        if (!nr) return NULL;
        c->rows = nr;
        c->cap_rows = nc;
    }
    stat_row *r = &c->rows[c->n_rows++];
    memset(r, 0, sizeof *r);
    r->op = op;
    r->layer = layer;
    r->first_pos = -1;
    return r;
}

static int cmp_i32(const void *a, const void *b) {
    int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* |A ∩ B| of two id sets of n and m entries (sets: no repeats). */
static int64_t overlap(const int32_t *a, int n, const int32_t *b, int m) {
    if (n <= 16 && m <= 16) {
        int64_t h = 0;
        for (int i = 0; i < n; i++)
            for (int j = 0; j < m; j++)
                if (a[i] == b[j]) {
                    h++;
                    break;
                }
        return h;
    }
    int32_t *x = malloc(sizeof(int32_t) * (size_t)(n + m + 1));
    if (!x) return -1;
    memcpy(x, a, sizeof(int32_t) * (size_t)n);
    memcpy(x + n, b, sizeof(int32_t) * (size_t)m);
    qsort(x, (size_t)n, sizeof *x, cmp_i32);
    qsort(x + n, (size_t)m, sizeof *x, cmp_i32);
    int64_t h = 0;
    for (int i = 0, j = 0; i < n && j < m;) {
        if (x[i] == x[n + j]) h++, i++, j++;
        else if (x[i] < x[n + j]) i++;
        else j++;
    }
    free(x);
    return h;
}

static void compare_b(const dsv4_op_event *e, void *user) {
    diff_ctx *c = user;
    if (c->failed) return;
    if (c->cursor >= c->n_ev) return ctx_fail(c, "engine B traced %s (layer %d) that engine A did not", e->op, e->layer);
    const cap_ev *a = &c->ev[c->cursor++];
    if (strcmp(a->op, e->op) || a->layer != e->layer || a->rows != e->rows || a->width != e->width ||
        !a->f != !e->f || !a->ids != !e->ids || !a->nv != !e->n_valid)
        return ctx_fail(c, "the engines ran different graphs: B traced %s (layer %d) where A traced another op "
                           "or shape", e->op, e->layer);
    stat_row *r = row_for(c, e->op, e->layer);
    if (!r) return ctx_fail(c, "out of memory for the statistics of %s (layer %d)", e->op, e->layer);
    for (int i = 0; i < e->rows; i++) {
        int nv = e->n_valid ? e->n_valid[i] : e->width;
        if (a->nv && a->nv[i] != nv) {
            r->id_tot += nv > a->nv[i] ? nv : a->nv[i]; /* a different count is a different selection */
            if (r->first_pos < 0 && e->pos) r->first_pos = e->pos[i];
            continue;
        }
        if (nv < 0 || nv > e->width) return ctx_fail(c, "%s (layer %d): a row's valid count exceeds its width", e->op, e->layer);
        size_t o = (size_t)i * (size_t)e->width;
        int row_differs = 0;
        if (e->f) {
            r->has_f = 1;
            for (int j = 0; j < nv; j++) {
                double x = a->f[o + j], y = e->f[o + j], d = y - x;
                r->d2 += d * d, r->a2 += x * x, r->b2 += y * y, r->dot += x * y;
                if (fabs(d) > r->maxabs || d != d) r->maxabs = d != d ? INFINITY : fabs(d);
                if (d != 0) row_differs = 1;
            }
            r->nvals += nv;
        }
        if (e->ids) {
            r->has_ids = 1;
            int64_t h = overlap(a->ids + o, nv, e->ids + o, nv);
            if (h < 0) return ctx_fail(c, "out of memory comparing %s (layer %d)", e->op, e->layer);
            r->id_hit += h;
            r->id_tot += nv;
            if (h != nv) row_differs = 1;
        }
        if (row_differs && r->first_pos < 0 && e->pos) r->first_pos = e->pos[i];
    }
}

static double rel_err(const stat_row *r) {
    if (r->a2 == 0) return r->d2 == 0 ? 0 : INFINITY;
    return sqrt(r->d2 / r->a2);
}
static double cosine(const stat_row *r) {
    if (r->a2 == 0 && r->b2 == 0) return 1;
    if (r->a2 == 0 || r->b2 == 0) return 0;
    return r->dot / sqrt(r->a2 * r->b2);
}
static int diverged(const stat_row *r, double thr) {
    double e = rel_err(r);
    if (r->has_f && (e > thr || e != e)) return 1;
    return r->id_tot > 0 && r->id_hit < r->id_tot;
}
static int row_order(const void *pa, const void *pb) {
    const stat_row *a = pa, *b = pb;
    long la = a->layer < 0 ? 1L << 30 : a->layer, lb = b->layer < 0 ? 1L << 30 : b->layer;
    if (la != lb) return la < lb ? -1 : 1;
    int ra = op_rank(a->op), rb = op_rank(b->op);
    if (ra != rb) return ra - rb;
    return strcmp(a->op, b->op);
}

static void layer_name(char *buf, size_t n, int layer) {
    if (layer < 0) snprintf(buf, n, "head");
    else snprintf(buf, n, "%d", layer);
}

int dsv4_cmd_diff(int argc, char **argv) {
    const char *model = NULL, *tokens = NULL, *tokens_file = NULL, *spec_a = NULL, *spec_b = NULL, *json = NULL;
    double thr = 1e-5;
    long random_n = 0, seed = 1, chunk = 64;
    int quiet = 0, all_logits = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "--quiet") || !strcmp(a, "--all-logits")) {
            *(a[2] == 'q' ? &quiet : &all_logits) = 1;
            continue;
        }
        const char **dst = NULL;
        long *ldst = NULL;
        if (!strcmp(a, "--model")) dst = &model;
        else if (!strcmp(a, "--tokens")) dst = &tokens;
        else if (!strcmp(a, "--tokens-file")) dst = &tokens_file;
        else if (!strcmp(a, "--a")) dst = &spec_a;
        else if (!strcmp(a, "--b")) dst = &spec_b;
        else if (!strcmp(a, "--json")) dst = &json;
        else if (!strcmp(a, "--random")) ldst = &random_n;
        else if (!strcmp(a, "--seed")) ldst = &seed;
        else if (!strcmp(a, "--chunk")) ldst = &chunk;
        else if (strcmp(a, "--threshold")) {
            fprintf(stderr, "dsv4 diff: unknown option '%s' (see --help)\n", a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 diff: %s needs a value\n", a);
            return 2;
        }
        const char *v = argv[++i];
        char *end;
        if (dst) *dst = v;
        else if (ldst) {
            long x = strtol(v, &end, 10);
            if (!*v || *end || x < 0 || x > 1 << 24) {
                fprintf(stderr, "dsv4 diff: %s expects a non-negative integer, got '%s'\n", a, v);
                return 2;
            }
            *ldst = x;
        } else {
            thr = strtod(v, &end);
            if (!*v || *end || !(thr >= 0) || thr > 1e30) {
                fprintf(stderr, "dsv4 diff: --threshold expects a non-negative number, got '%s'\n", v);
                return 2;
            }
        }
    }
    if (!spec_a || !spec_b) {
        fprintf(stderr, "dsv4 diff: both --a SPEC and --b SPEC are required (e.g. --a exact --b exact,mhc.gemm=bf16)\n");
        return 2;
    }
    if (chunk < 1) {
        fprintf(stderr, "dsv4 diff: --chunk must be at least 1\n");
        return 2;
    }
    dsv4_err err = {{0}};
    fid_spec sa, sb;
    if (fid_spec_parse(&sa, spec_a, &err) || fid_spec_parse(&sb, spec_b, &err)) {
        fprintf(stderr, "dsv4 diff: %s\n", err.msg);
        return 2;
    }
    int32_t *ids = NULL;
    int T = 0;
    if (random_n) {
        if (tokens || tokens_file) {
            fprintf(stderr, "dsv4 diff: give one of --tokens, --tokens-file or --random\n");
            return 2;
        }
        T = (int)random_n;
        ids = malloc(sizeof *ids * (size_t)T);
        if (!ids) {
            fprintf(stderr, "dsv4 diff: out of memory\n");
            return 1;
        }
    } else if (fid_load_tokens(tokens, tokens_file, &ids, &T, &err)) {
        fprintf(stderr, "dsv4 diff: %s\n", err.msg);
        return 2;
    }

    int rc = 1;
    dsv4_engine *ea = NULL, *eb = NULL;
    dsv4_seq *qa = NULL, *qb = NULL;
    float *la = NULL, *lb = NULL;
    diff_ctx ctx = {0};
    if (fid_spec_open(&sa, model, &ea, &err) || fid_spec_open(&sb, model, &eb, &err)) goto fail;
    dsv4_engine_info info;
    dsv4_engine_get_info(ea, &info);
    if (random_n) fid_synthetic_ids(ids, T, (uint64_t)seed, 100, info.vocab_size > 100 ? info.vocab_size : 101);
    if (dsv4_seq_new(ea, &qa, &err) || dsv4_seq_new(eb, &qb, &err)) goto fail;
    la = malloc(sizeof(float) * (size_t)chunk * (size_t)info.vocab_size);
    lb = malloc(sizeof(float) * (size_t)chunk * (size_t)info.vocab_size);
    if (!la || !lb) {
        dsv4_errf(&err, "out of memory for %ld x %d logits", chunk, info.vocab_size);
        goto fail;
    }
    dsv4_engine_set_op_trace(ea, capture_a, &ctx);
    dsv4_engine_set_op_trace(eb, compare_b, &ctx);
    double t0 = dsv4_now();
    for (int at = 0; at < T; at += (int)chunk) {
        int n = T - at < chunk ? T - at : (int)chunk;
        clear_events(&ctx);
        if (dsv4_seq_append(qa, ids + at, n, la, all_logits, &err)) {
            dsv4_err_prefix(&err, "engine A (%s)", sa.text);
            goto fail;
        }
        if (dsv4_seq_append(qb, ids + at, n, lb, all_logits, &err)) {
            dsv4_err_prefix(&err, "engine B (%s)", sb.text);
            goto fail;
        }
        if (!ctx.failed && ctx.cursor != ctx.n_ev)
            ctx_fail(&ctx, "engine B stopped tracing before %s (layer %d): the engines ran different graphs",
                     ctx.ev[ctx.cursor].op, ctx.ev[ctx.cursor].layer);
        if (ctx.failed) {
            dsv4_errf(&err, "%s", ctx.why);
            goto fail;
        }
    }
    double secs = dsv4_now() - t0;
    qsort(ctx.rows, (size_t)ctx.n_rows, sizeof *ctx.rows, row_order);

    /* ----- report ----- */
    printf("dsv4 diff: model %s, %d tokens in chunks of %ld, %.1f s\n  A: %s\n  B: %s\n", info.model_name, T, chunk,
           secs, sa.text, sb.text);
    printf("%-6s %-18s %11s %11s %11s %9s %9s\n", "layer", "op", "rel_err", "cosine", "max_abs", "overlap",
           "first_pos");
    int first = -1;
    for (int i = 0; i < ctx.n_rows; i++) {
        const stat_row *r = &ctx.rows[i];
        int dv = diverged(r, thr);
        if (dv && first < 0) first = i;
        if (quiet && !dv) continue;
        char ln[16], ov[24], fp[24];
        layer_name(ln, sizeof ln, r->layer);
        if (r->id_tot) snprintf(ov, sizeof ov, "%.4f", (double)r->id_hit / (double)r->id_tot);
        else snprintf(ov, sizeof ov, "-");
        if (r->first_pos >= 0) snprintf(fp, sizeof fp, "%lld", (long long)r->first_pos);
        else snprintf(fp, sizeof fp, "-");
        if (r->has_f)
            printf("%-6s %-18s %11.3e %11.8f %11.3e %9s %9s%s\n", ln, r->op, rel_err(r), cosine(r), r->maxabs, ov, fp,
                   dv ? "  <" : "");
        else
            printf("%-6s %-18s %11s %11s %11s %9s %9s%s\n", ln, r->op, "-", "-", "-", ov, fp, dv ? "  <" : "");
    }
    if (json) {
        FILE *jf = fopen(json, "w");
        if (!jf) {
            dsv4_errf(&err, "%s: cannot open for writing", json);
            goto fail;
        }
        fprintf(jf, "{\"model\":");
        fid_json_str(jf, info.model_name);
        fprintf(jf, ",\"a\":");
        fid_json_str(jf, sa.text);
        fprintf(jf, ",\"b\":");
        fid_json_str(jf, sb.text);
        fprintf(jf, ",\"tokens\":%d,\"threshold\":%.9g,\"rows\":[", T, thr);
        for (int i = 0; i < ctx.n_rows; i++) {
            const stat_row *r = &ctx.rows[i];
            fprintf(jf, "%s\n{\"layer\":%d,\"op\":", i ? "," : "", r->layer);
            fid_json_str(jf, r->op);
            if (r->has_f) {
                double e = rel_err(r);
                if (isfinite(e)) fprintf(jf, ",\"rel_err\":%.9g", e);
                else fprintf(jf, ",\"rel_err\":null");
                fprintf(jf, ",\"cosine\":%.9g,\"max_abs\":%.9g", cosine(r), isfinite(r->maxabs) ? r->maxabs : -1.0);
            }
            if (r->id_tot) fprintf(jf, ",\"overlap\":%.9g", (double)r->id_hit / (double)r->id_tot);
            fprintf(jf, ",\"first_pos\":%lld,\"diverged\":%s}", (long long)r->first_pos,
                    diverged(r, thr) ? "true" : "false");
        }
        fprintf(jf, "\n],\"first_divergence\":");
        if (first >= 0) {
            fprintf(jf, "{\"layer\":%d,\"op\":", ctx.rows[first].layer);
            fid_json_str(jf, ctx.rows[first].op);
            fprintf(jf, "}}\n");
        } else
            fprintf(jf, "null}\n");
        if (fclose(jf)) {
            dsv4_errf(&err, "%s: write error", json);
            goto fail;
        }
    }
    if (first >= 0) {
        char ln[16];
        layer_name(ln, sizeof ln, ctx.rows[first].layer);
        printf("first divergence: layer %s %s\n", ln, ctx.rows[first].op);
    } else
        printf("no divergence above %g\n", thr);
    rc = 0;
fail:
    if (rc) fprintf(stderr, "dsv4 diff: %s\n", err.msg);
    clear_events(&ctx);
    free(ctx.ev);
    free(ctx.rows);
    free(la);
    free(lb);
    dsv4_seq_free(qa);
    dsv4_seq_free(qb);
    dsv4_engine_close(ea);
    dsv4_engine_close(eb);
    free(ids);
    return rc;
}
