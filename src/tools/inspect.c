/* tools/inspect: `dsv4 inspect DIR` and `dsv4 inspect --config NAME|FILE`.
 *
 * Everything shown is computed from the tensor inventory of the config
 * (model/weights.h), so `inspect --config flash` and `inspect DIR` of a
 * checkpoint of that config print the same table; for a DIR the checkpoint is
 * also bound and the verdict says whether it matches.
 *
 * Counting conventions (docs/CHECKPOINT.md):
 *  - a parameter is a logical weight element: an MXFP4/NVFP4 byte holds two;
 *    scale tensors count as bytes, never as parameters; tid2eid is a lookup
 *    table, not a parameter.
 *  - total parameters are shown with and without MTP: the published V4-Flash
 *    figure (284B) is the trunk + embedding + head, without the MTP block.
 *  - active parameters per token: every trunk tensor except the embedding (one
 *    row is read, not multiplied), routed experts at n_active/n_routed; the MTP
 *    block is not counted (it is a draft model run on the side).  This gives
 *    13.3B for V4-Flash, published as 13B.
 */
#include <inttypes.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "model/config.h"
#include "model/safetensors.h"
#include "model/weights.h"
#include "tools/commands.h"
#include "util/err.h"

/* A built-in name, a config.json, or a directory holding one. */
static int load_config_arg(dsv4_config *cfg, const char *what, dsv4_err *err) {
    if (!strcmp(what, "tiny") || !strcmp(what, "flash") || !strcmp(what, "pro"))
        return dsv4_config_builtin(cfg, what, err);
    struct stat sb;
    if (stat(what, &sb) == 0 && S_ISDIR(sb.st_mode)) {
        char p[4096];
        if ((size_t)snprintf(p, sizeof p, "%s/config.json", what) >= sizeof p) return dsv4_errf(err, "%s: path too long", what);
        return dsv4_config_load(cfg, p, err);
    }
    return dsv4_config_load(cfg, what, err);
}

/* ----- statistics over the inventory ----- */
#define MAX_GROUPS 16
typedef struct {
    int64_t tensors;
    size_t bytes;
    int64_t params, params_mtp, active;
    int64_t cls_params[DSV4_CLASS_COUNT], cls_tensors[DSV4_CLASS_COUNT];
    size_t cls_bytes[DSV4_CLASS_COUNT];
    int64_t fmt_weights[DSV4_WF_I64 + 1];
    int64_t fmt_params[DSV4_WF_I64 + 1];
    int fp8_scale_f32;
    int64_t globals;
    int64_t layer_tensors[DSV4_MAX_LAYERS];
    double kv_per_token;   /* bytes of cache growth per token of context (bf16 rows) */
    double state_fixed;    /* fixed bytes per sequence: window rings + compressor state */
} inv_stats;

static int stats_fn(const dsv4_inv_entry *e, void *user) {
    inv_stats *s = user;
    s->tensors++;
    s->bytes += e->bytes;
    s->cls_tensors[e->cls]++;
    s->cls_bytes[e->cls] += e->bytes;
    s->cls_params[e->cls] += e->params;
    if (e->layer < 0)
        s->globals++;
    else if (e->layer < DSV4_MAX_LAYERS)
        s->layer_tensors[e->layer]++;
    if (e->part == DSV4_PART_DATA) {
        s->fmt_weights[e->fmt]++;
        s->fmt_params[e->fmt] += e->params;
    }
    if (e->part == DSV4_PART_SCALE && e->fmt == DSV4_WF_FP8 && e->dtype == DSV4_DT_F32) s->fp8_scale_f32 = 1;
    return 0;
}

static void stats_compute(const dsv4_config *cfg, inv_stats *s) {
    memset(s, 0, sizeof *s);
    dsv4_inventory(cfg, stats_fn, s);
    s->params_mtp = s->cls_params[DSV4_CLASS_MTP];
    for (int c = 0; c < DSV4_CLASS_COUNT; c++) s->params += s->cls_params[c];
    /* active: trunk without the embedding lookup; routed experts at n_active/n_routed */
    double act = 0;
    for (int c = 0; c < DSV4_CLASS_COUNT; c++) {
        if (c == DSV4_CLASS_MTP) continue;
        if (c == DSV4_CLASS_ROUTED)
            act += (double)s->cls_params[c] * cfg->n_active / (cfg->n_routed ? cfg->n_routed : 1);
        else
            act += (double)s->cls_params[c];
    }
    act -= (double)cfg->vocab_size * cfg->dim; /* embed.weight */
    s->active = (int64_t)(act + 0.5);
    /* caches, spec §3.2: bf16 rows; fp32 compressor state (kv + score) */
    for (int L = 0; L < dsv4_config_total_layers(cfg); L++) {
        int r = cfg->compress_ratio[L];
        s->state_fixed += (double)cfg->window * cfg->head_dim * 2;
        if (r == 0) continue;
        int coff = r == 4 ? 2 : 1;
        s->kv_per_token += (double)cfg->head_dim * 2 / r;
        s->state_fixed += 2.0 * coff * r * coff * cfg->head_dim * 4;
        if (r == 4) {
            s->kv_per_token += (double)cfg->index_head_dim * 2 / r;
            s->state_fixed += 2.0 * 2 * r * 2 * cfg->index_head_dim * 4;
        }
    }
}

/* ----- text helpers ----- */
static const char *human_params(int64_t p, char *buf, size_t cap) {
    double v = (double)p;
    if (v >= 1e12) snprintf(buf, cap, "%.2fT", v / 1e12);
    else if (v >= 1e9) snprintf(buf, cap, "%.1fB", v / 1e9);
    else if (v >= 1e6) snprintf(buf, cap, "%.1fM", v / 1e6);
    else if (v >= 1e3) snprintf(buf, cap, "%.1fK", v / 1e3);
    else snprintf(buf, cap, "%" PRId64, p);
    return buf;
}

static const char *human_bytes(double b, char *buf, size_t cap) {
    if (b >= 1024.0 * 1024 * 1024) snprintf(buf, cap, "%.2f GiB", b / (1024.0 * 1024 * 1024));
    else if (b >= 1024.0 * 1024) snprintf(buf, cap, "%.2f MiB", b / (1024.0 * 1024));
    else if (b >= 1024.0) snprintf(buf, cap, "%.2f KiB", b / 1024.0);
    else snprintf(buf, cap, "%.0f B", b);
    return buf;
}

/* "0 0 (4 128)x20 4": runs of a value or of an alternating pair of values. */
static void ratio_summary(const dsv4_config *cfg, char *buf, size_t cap) {
    size_t o = 0;
    const int *a = cfg->compress_ratio;
    int n = cfg->n_layers;
    buf[0] = 0;
    for (int i = 0; i < n && o + 24 < cap;) {
        int run1 = 1;
        while (i + run1 < n && a[i + run1] == a[i]) run1++;
        int run2 = 0;
        if (i + 1 < n && a[i + 1] != a[i])
            while (i + 2 * run2 + 1 < n && a[i + 2 * run2] == a[i] && a[i + 2 * run2 + 1] == a[i + 1]) run2++;
        if (run2 >= 3) {
            o += (size_t)snprintf(buf + o, cap - o, "%s(%d %d)x%d", o ? " " : "", a[i], a[i + 1], run2);
            i += 2 * run2;
        } else if (run1 >= 4) {
            o += (size_t)snprintf(buf + o, cap - o, "%s%dx%d", o ? " " : "", a[i], run1);
            i += run1;
        } else {
            o += (size_t)snprintf(buf + o, cap - o, "%s%d", o ? " " : "", a[i]);
            i++;
        }
    }
    if (cfg->n_mtp > 0) {
        o += (size_t)snprintf(buf + o, cap - o, " | mtp");
        for (int i = 0; i < cfg->n_mtp && o + 8 < cap; i++)
            o += (size_t)snprintf(buf + o, cap - o, " %d", a[cfg->n_layers + i]);
    }
}

static const char *fmt_label(dsv4_wfmt f, const dsv4_config *cfg, int scale_f32, char *buf, size_t cap) {
    switch (f) {
    case DSV4_WF_FP8:
        snprintf(buf, cap, "FP8 e4m3 + %s %dx%d", scale_f32 ? "f32" : "e8m0", cfg->quant_block, cfg->quant_block);
        break;
    case DSV4_WF_MXFP4: snprintf(buf, cap, "MXFP4 e2m1 + e8m0/32"); break;
    case DSV4_WF_NVFP4: snprintf(buf, cap, "NVFP4 e2m1 + e4m3/16 + f32"); break;
    default: snprintf(buf, cap, "%s", dsv4_wfmt_name(f));
    }
    return buf;
}

/* Per-layer tensor counts grouped by (mtp, ratio, count). */
typedef struct {
    int mtp, ratio;
    int64_t tensors;
    int layers;
} layer_group;

static int layer_groups(const dsv4_config *cfg, const inv_stats *s, layer_group *g) {
    int ng = 0;
    for (int L = 0; L < dsv4_config_total_layers(cfg) && L < DSV4_MAX_LAYERS; L++) {
        int mtp = L >= cfg->n_layers, r = cfg->compress_ratio[L], k;
        for (k = 0; k < ng; k++)
            if (g[k].mtp == mtp && g[k].ratio == r && g[k].tensors == s->layer_tensors[L]) break;
        if (k == ng) {
            if (ng == MAX_GROUPS) continue;
            g[ng++] = (layer_group){mtp, r, s->layer_tensors[L], 0};
        }
        g[k].layers++;
    }
    return ng;
}

/* ----- output ----- */
typedef struct {
    const char *dir;       /* NULL for --config */
    int bound;             /* DIR: 1 OK, 0 broken */
    int64_t n_bound;
    size_t file_bytes;
    char *report;          /* binding problems, one per line */
    char error[DSV4_ERR_MAX + 64];
    char hint[DSV4_ERR_MAX + 4200];
} verdict;

static void print_text(const dsv4_config *cfg, const inv_stats *s, const verdict *v) {
    char a[64], b[64], c[64], ratios[1024];
    printf("config: %s\n", cfg->name);
    printf("  vocab %d, hidden %d, layers %d + %d MTP, heads %d x %d (rope %d), q_lora %d, o_lora %d x %d groups\n",
           cfg->vocab_size, cfg->dim, cfg->n_layers, cfg->n_mtp, cfg->n_heads, cfg->head_dim, cfg->rope_dim,
           cfg->q_lora_rank, cfg->o_lora_rank, cfg->o_groups);
    printf("  window %d, experts %d routed (top %d, scale %g) + %d shared, inter %d, hc %d (sinkhorn %d)\n",
           cfg->window, cfg->n_routed, cfg->n_active, cfg->routed_scale, cfg->n_shared, cfg->moe_inter, cfg->hc_mult,
           cfg->hc_sinkhorn_iters);
    printf("  indexer %d heads x %d, top %d; rope theta %g / %g (compressed, yarn x%g from %g)\n", cfg->index_n_heads,
           cfg->index_head_dim, cfg->index_topk, cfg->rope_theta, cfg->compress_rope_theta, cfg->yarn_factor,
           cfg->yarn_original_seq);
    ratio_summary(cfg, ratios, sizeof ratios);
    printf("  ratios: %s\n", ratios);
    if (cfg->n_hash_layers > 0)
        printf("  hash layers: %d (layers 0..%d route by tid2eid)\n", cfg->n_hash_layers, cfg->n_hash_layers - 1);
    else
        printf("  hash layers: none\n");

    layer_group g[MAX_GROUPS];
    int ng = layer_groups(cfg, s, g);
    printf("tensors per layer:");
    for (int k = 0; k < ng; k++)
        printf("%s %s r=%d: %" PRId64 " x%d", k ? "," : "", g[k].mtp ? "mtp" : "layer", g[k].ratio, g[k].tensors,
               g[k].layers);
    printf(", globals: %" PRId64 "\n", s->globals);

    printf("\n%-16s %10s %16s %10s %8s\n", "class", "params", "params (exact)", "bytes", "tensors");
    for (int k = 0; k < DSV4_CLASS_COUNT; k++) {
        if (!s->cls_tensors[k]) continue;
        printf("%-16s %10s %16" PRId64 " %10s %8" PRId64 "\n", dsv4_wclass_name((dsv4_wclass)k),
               human_params(s->cls_params[k], a, sizeof a), s->cls_params[k],
               human_bytes((double)s->cls_bytes[k], b, sizeof b), s->cls_tensors[k]);
    }
    printf("%-16s %10s %16" PRId64 " %10s %8" PRId64 "\n\n", "total", human_params(s->params, a, sizeof a), s->params,
           human_bytes((double)s->bytes, b, sizeof b), s->tensors);

    printf("formats:");
    int first = 1;
    for (int f = DSV4_WF_F32; f <= DSV4_WF_I64; f++) {
        if (!s->fmt_weights[f]) continue;
        printf("%s %s (%" PRId64 " weights, %s params)", first ? "" : ",", fmt_label((dsv4_wfmt)f, cfg, s->fp8_scale_f32, c, sizeof c),
               s->fmt_weights[f], human_params(s->fmt_params[f], a, sizeof a));
        first = 0;
    }
    printf("\n");
    printf("parameters: %s total (%" PRId64 "); %s without MTP (the published total)\n",
           human_params(s->params, a, sizeof a), s->params, human_params(s->params - s->params_mtp, b, sizeof b));
    printf("active per token: %s (%" PRId64 "; trunk without the embedding lookup and MTP, routed experts at %d/%d)\n",
           human_params(s->active, a, sizeof a), s->active, cfg->n_active, cfg->n_routed);
    printf("  (a parameter is a logical element: an FP4 byte holds two; scales are bytes, not parameters)\n");
    printf("weight memory: %zu bytes (%s) in %" PRId64 " tensors\n", s->bytes, human_bytes((double)s->bytes, a, sizeof a),
           s->tensors);
    printf("kv cache: %.0f B per token of context (bf16 compressed rows); fixed per sequence %s "
           "(window rings + compressor state)\n",
           s->kv_per_token, human_bytes(s->state_fixed, a, sizeof a));
    if (!v->dir) return;
    if (v->bound) {
        printf("verdict: OK (%" PRId64 " tensors bound, %s)\n", v->n_bound,
               human_bytes((double)v->file_bytes, a, sizeof a));
    } else {
        printf("verdict: BROKEN\n");
        if (v->hint[0]) printf("  %s\n", v->hint);
        if (v->report) {
            for (const char *p = v->report; *p;) {
                const char *nl = strchr(p, '\n');
                int len = nl ? (int)(nl - p) : (int)strlen(p);
                printf("  %.*s\n", len, p);
                p += len + (nl ? 1 : 0);
            }
        } else if (v->error[0]) {
            printf("  %s\n", v->error);
        }
    }
}

static void print_json(const dsv4_config *cfg, const inv_stats *s, const verdict *v) {
    json_t *o = json_object();
    json_object_set_new(o, "config", json_string(cfg->name));
    char ratios[1024];
    ratio_summary(cfg, ratios, sizeof ratios);
    json_object_set_new(o, "ratios", json_string(ratios));
    json_t *ra = json_array();
    for (int L = 0; L < dsv4_config_total_layers(cfg); L++) json_array_append_new(ra, json_integer(cfg->compress_ratio[L]));
    json_object_set_new(o, "compress_ratios", ra);
    json_object_set_new(o, "n_layers", json_integer(cfg->n_layers));
    json_object_set_new(o, "n_mtp", json_integer(cfg->n_mtp));
    json_object_set_new(o, "n_hash_layers", json_integer(cfg->n_hash_layers));
    json_object_set_new(o, "tensors", json_integer(s->tensors));
    json_object_set_new(o, "bytes", json_integer((json_int_t)s->bytes));
    json_object_set_new(o, "params", json_integer(s->params));
    json_object_set_new(o, "params_without_mtp", json_integer(s->params - s->params_mtp));
    json_object_set_new(o, "params_active", json_integer(s->active));
    json_object_set_new(o, "globals", json_integer(s->globals));
    json_t *cl = json_object();
    for (int k = 0; k < DSV4_CLASS_COUNT; k++) {
        if (!s->cls_tensors[k]) continue;
        json_t *e = json_object();
        json_object_set_new(e, "params", json_integer(s->cls_params[k]));
        json_object_set_new(e, "bytes", json_integer((json_int_t)s->cls_bytes[k]));
        json_object_set_new(e, "tensors", json_integer(s->cls_tensors[k]));
        json_object_set_new(cl, dsv4_wclass_name((dsv4_wclass)k), e);
    }
    json_object_set_new(o, "classes", cl);
    json_t *fm = json_object();
    for (int f = DSV4_WF_F32; f <= DSV4_WF_I64; f++) {
        if (!s->fmt_weights[f]) continue;
        char c[64];
        json_t *e = json_object();
        json_object_set_new(e, "weights", json_integer(s->fmt_weights[f]));
        json_object_set_new(e, "params", json_integer(s->fmt_params[f]));
        json_object_set_new(e, "label", json_string(fmt_label((dsv4_wfmt)f, cfg, s->fp8_scale_f32, c, sizeof c)));
        json_object_set_new(fm, dsv4_wfmt_name((dsv4_wfmt)f), e);
    }
    json_object_set_new(o, "formats", fm);
    layer_group g[MAX_GROUPS];
    int ng = layer_groups(cfg, s, g);
    json_t *lg = json_array();
    for (int k = 0; k < ng; k++) {
        json_t *e = json_object();
        json_object_set_new(e, "mtp", json_boolean(g[k].mtp));
        json_object_set_new(e, "ratio", json_integer(g[k].ratio));
        json_object_set_new(e, "tensors", json_integer(g[k].tensors));
        json_object_set_new(e, "layers", json_integer(g[k].layers));
        json_array_append_new(lg, e);
    }
    json_object_set_new(o, "layer_tensors", lg);
    json_object_set_new(o, "kv_bytes_per_token", json_real(s->kv_per_token));
    json_object_set_new(o, "state_bytes_fixed", json_real(s->state_fixed));
    if (v->dir) {
        json_object_set_new(o, "dir", json_string(v->dir));
        json_object_set_new(o, "verdict", json_string(v->bound ? "OK" : "BROKEN"));
        if (v->bound) {
            json_object_set_new(o, "tensors_bound", json_integer(v->n_bound));
            json_object_set_new(o, "file_bytes", json_integer((json_int_t)v->file_bytes));
        }
        json_t *errs = json_array();
        if (v->hint[0]) json_array_append_new(errs, json_string(v->hint));
        if (v->report) {
            for (const char *p = v->report; *p;) {
                const char *nl = strchr(p, '\n');
                size_t len = nl ? (size_t)(nl - p) : strlen(p);
                json_array_append_new(errs, json_stringn(p, len));
                p += len + (nl ? 1 : 0);
            }
        } else if (v->error[0]) {
            json_array_append_new(errs, json_string(v->error));
        }
        json_object_set_new(o, "errors", errs);
    }
    char *txt = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(12));
    if (txt) printf("%s\n", txt);
    free(txt);
    json_decref(o);
}

static void inspect_usage(FILE *f) {
    fprintf(f, "usage: dsv4 inspect DIR [--json]\n"
               "       dsv4 inspect --config flash|pro|tiny|FILE [--json]\n"
               "Shows the config, parameters and bytes by class, formats, active parameters, KV-cache size and,\n"
               "for a checkpoint directory, whether every tensor binds (exit status 1 if not).\n");
}

int dsv4_cmd_inspect(int argc, char **argv) {
    const char *dir = NULL, *config = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            inspect_usage(stdout);
            return 0;
        } else if (!strcmp(argv[i], "--json")) {
            json = 1;
        } else if (!strcmp(argv[i], "--config")) {
            if (++i >= argc) {
                fprintf(stderr, "dsv4 inspect: --config needs a value\n");
                return 2;
            }
            config = argv[i];
        } else if (argv[i][0] == '-' || dir) {
            fprintf(stderr, "dsv4 inspect: unexpected argument %s\n", argv[i]);
            inspect_usage(stderr);
            return 2;
        } else {
            dir = argv[i];
        }
    }
    if (!dir == !config) {
        fprintf(stderr, "dsv4 inspect: give either a checkpoint DIR or --config NAME|FILE\n");
        inspect_usage(stderr);
        return 2;
    }
    dsv4_err err;
    dsv4_config cfg;
    verdict v;
    memset(&v, 0, sizeof v);
    if (config) {
        if (load_config_arg(&cfg, config, &err)) {
            fprintf(stderr, "dsv4 inspect: %s\n", err.msg);
            return 1;
        }
    } else {
        struct stat sb;
        if (stat(dir, &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            fprintf(stderr, "dsv4 inspect: %s: not a directory\n", dir);
            return 1;
        }
        char path[4096];
        if ((size_t)snprintf(path, sizeof path, "%s/config.json", dir) >= sizeof path) {
            fprintf(stderr, "dsv4 inspect: %s: path too long\n", dir);
            return 1;
        }
        if (dsv4_config_load(&cfg, path, &err)) {
            fprintf(stderr, "dsv4 inspect: %s\n", err.msg);
            return 1;
        }
        v.dir = dir;
    }
    inv_stats s;
    stats_compute(&cfg, &s);
    dsv4_st *st = NULL;
    if (dir) {
        if (dsv4_st_open(&st, dir, &err)) {
            snprintf(v.error, sizeof v.error, "%s", err.msg);
        } else {
            dsv4_model_w m;
            if (dsv4_weights_bind_report(&m, &cfg, st, &v.report, &err) == 0) {
                v.bound = 1;
                v.n_bound = dsv4_st_count(st);
                v.file_bytes = dsv4_st_data_bytes(st);
                dsv4_weights_free(&m);
            } else {
                snprintf(v.error, sizeof v.error, "%s", err.msg);
                if (dsv4_weights_check_config(&cfg, st, &err))
                    snprintf(v.hint, sizeof v.hint, "%.4096s/config.json disagrees with the tensors: %s", dir, err.msg);
            }
            dsv4_st_close(st);
        }
    }
    if (json)
        print_json(&cfg, &s, &v);
    else
        print_text(&cfg, &s, &v);
    if (dir && !v.bound) {
        fprintf(stderr, "dsv4 inspect: %s: %s\n", dir, v.hint[0] ? v.hint : v.error);
        free(v.report);
        return 1;
    }
    free(v.report);
    return 0;
}
