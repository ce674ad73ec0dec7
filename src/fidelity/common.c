/* fidelity/common: shared helpers (contract in common.h). */
#include "fidelity/common.h"

#include <ctype.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "backend/backend.h"
#include "model/numerics.h"

/* ----- token ids ----- */
int fid_parse_ids(const char *s, const char *what, int32_t **out, int *n, dsv4_err *err) {
    int cap = 64, cnt = 0;
    int32_t *v = malloc(sizeof *v * (size_t)cap);
    if (!v) return dsv4_errf(err, "%s: out of memory", what);
    const char *p = s;
    for (;;) {
        while (*p && (isspace((unsigned char)*p) || *p == ',')) p++;
        if (!*p) break;
        char *end;
        errno = 0;
        long long x = strtoll(p, &end, 10);
        if (end == p || errno || x < 0 || x > INT32_MAX || (*end && !isspace((unsigned char)*end) && *end != ',')) {
            const char *e = p;
            while (*e && !isspace((unsigned char)*e) && *e != ',') e++;
            free(v);
            return dsv4_errf(err, "%s: token %d: '%.*s' is not a non-negative integer id", what, cnt,
                             (int)(e - p > 40 ? 40 : e - p), p);
        }
        if (cnt == cap) {
            cap *= 2;
            int32_t *nv = realloc(v, sizeof *v * (size_t)cap);
            if (!nv) {
                free(v);
                return dsv4_errf(err, "%s: out of memory", what);
            }
            v = nv;
        }
        v[cnt++] = (int32_t)x;
        p = end;
    }
    if (!cnt) {
        free(v);
        return dsv4_errf(err, "%s: no token ids", what);
    }
    *out = v;
    *n = cnt;
    return 0;
}

char *fid_read_file(const char *path, size_t *len, dsv4_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return dsv4_errf(err, "%s: %s", path, strerror(errno)), NULL;
    size_t cap = 4096, n = 0;
    char *b = malloc(cap);
    while (b) {
        if (n + 1 >= cap) {
            char *nb = realloc(b, cap * 2);
            if (!nb) {
                free(b);
                b = NULL;
                break;
            }
            b = nb;
            cap *= 2;
        }
        size_t got = fread(b + n, 1, cap - n - 1, f);
        if (!got) break;
        n += got;
    }
    int bad = ferror(f);
    fclose(f);
    if (!b || bad) {
        free(b);
        return dsv4_errf(err, "%s: %s", path, b ? "read error" : "out of memory"), NULL;
    }
    b[n] = 0;
    if (len) *len = n;
    return b;
}

int fid_load_tokens(const char *tokens, const char *tokens_file, int32_t **out, int *n, dsv4_err *err) {
    if (!!tokens + !!tokens_file != 1) return dsv4_errf(err, "give exactly one of --tokens or --tokens-file");
    if (tokens) return fid_parse_ids(tokens, "--tokens", out, n, err);
    char *text = fid_read_file(tokens_file, NULL, err);
    if (!text) return -1;
    int rc = fid_parse_ids(text, tokens_file, out, n, err);
    free(text);
    return rc;
}

void fid_synthetic_ids(int32_t *out, int n, uint64_t seed, int32_t lo, int32_t hi) {
    uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
    for (int i = 0; i < n; i++) {
        x ^= x << 13, x ^= x >> 7, x ^= x << 17; /* xorshift64 */
        out[i] = lo + (int32_t)(x % (uint64_t)(hi - lo));
    }
}

/* ----- SPECs ----- */
int fid_spec_parse(fid_spec *sp, const char *text, dsv4_err *err) {
    memset(sp, 0, sizeof *sp);
    snprintf(sp->backend, sizeof sp->backend, "cpu");
    if (!text || !*text) return dsv4_errf(err, "empty SPEC (expected profile[,name=value...], e.g. exact,mhc.gemm=bf16)");
    if (strlen(text) >= sizeof sp->text) return dsv4_errf(err, "SPEC '%.40s...' is too long", text);
    snprintf(sp->text, sizeof sp->text, "%s", text);
    char buf[512];
    snprintf(buf, sizeof buf, "%s", text);
    dsv4_numerics num;
    char *save = NULL;
    int first = 1;
    for (char *tok = strtok_r(buf, ",", &save); tok; tok = strtok_r(NULL, ",", &save), first = 0) {
        char *eq = strchr(tok, '=');
        if (first) {
            if (eq)
                return dsv4_errf(err, "SPEC '%s': must start with a profile name (exact or reference), got '%s'",
                                 text, tok);
            if (dsv4_numerics_profile(&num, tok, err)) return dsv4_err_prefix(err, "SPEC '%s'", text);
            snprintf(sp->profile, sizeof sp->profile, "%s", tok);
            continue;
        }
        if (!eq || eq == tok || !eq[1])
            return dsv4_errf(err, "SPEC '%s': '%s' is not name=value", text, tok);
        if (!strncmp(tok, "backend=", 8)) {
            const char *b = tok + 8;
            if (strcmp(b, "cpu") && strcmp(b, "cuda"))
                return dsv4_errf(err, "SPEC '%s': unknown backend '%s' (cpu or cuda)", text, b);
            if (!strcmp(b, "cuda") && !dsv4_backend_cuda_built())
                return dsv4_errf(err, "SPEC '%s': backend cuda not built (rebuild with make CUDA=1)", text);
            snprintf(sp->backend, sizeof sp->backend, "%s", b);
            continue;
        }
        if (sp->n_sets == FID_MAX_SETS) return dsv4_errf(err, "SPEC '%s': more than %d switches", text, FID_MAX_SETS);
        if (dsv4_numerics_set(&num, tok, err)) return dsv4_err_prefix(err, "SPEC '%s'", text);
        snprintf(sp->sets[sp->n_sets++], sizeof sp->sets[0], "%s", tok);
    }
    if (first) return dsv4_errf(err, "SPEC '%s': no profile name", text);
    return 0;
}

int fid_spec_open(const fid_spec *sp, const char *model_dir, dsv4_engine **out, dsv4_err *err) {
    const char *sets[FID_MAX_SETS];
    for (int i = 0; i < sp->n_sets; i++) sets[i] = sp->sets[i];
    dsv4_engine_opts o = {.model_dir = model_dir, .numerics = sp->profile, .sets = sets, .n_sets = sp->n_sets,
                          .backend = sp->backend};
    if (dsv4_engine_open(out, &o, err)) return dsv4_err_prefix(err, "SPEC '%s'", sp->text);
    return 0;
}

/* ----- escaping ----- */
void fid_json_str(FILE *f, const char *s) {
    fputc('"', f);
    for (const unsigned char *p = (const unsigned char *)s; *p; p++) {
        if (*p == '"' || *p == '\\') fprintf(f, "\\%c", *p);
        else if (*p == '\n') fputs("\\n", f);
        else if (*p == '\t') fputs("\\t", f);
        else if (*p == '\r') fputs("\\r", f);
        else if (*p < 0x20) fprintf(f, "\\u%04x", *p);
        else fputc(*p, f);
    }
    fputc('"', f);
}

void fid_html_str(FILE *f, const char *s) {
    for (; *s; s++) {
        switch (*s) {
        case '&': fputs("&amp;", f); break;
        case '<': fputs("&lt;", f); break;
        case '>': fputs("&gt;", f); break;
        case '"': fputs("&quot;", f); break;
        case '\'': fputs("&#39;", f); break;
        default: fputc(*s, f);
        }
    }
}

/* ----- indexer picks ----- */
int fid_picks_init(fid_picks *p, int n_layers, int topk, int64_t n_pos, double route_expect, dsv4_err *err) {
    memset(p, 0, sizeof *p);
    size_t cells = (size_t)n_layers * (size_t)n_pos;
    p->picks = malloc(sizeof(int32_t) * cells * (size_t)(topk > 0 ? topk : 1));
    p->count = malloc(sizeof(int16_t) * (cells ? cells : 1));
    if (!p->picks || !p->count) {
        fid_picks_free(p);
        return dsv4_errf(err, "out of memory for the indexer pick table (%d layers x %lld positions)", n_layers,
                         (long long)n_pos);
    }
    for (size_t i = 0; i < cells; i++) p->count[i] = -1;
    p->n_layers = n_layers;
    p->topk = topk;
    p->n_pos = n_pos;
    p->trace_ok = 1;
    p->route_expect = route_expect;
    return 0;
}

void fid_picks_free(fid_picks *p) {
    free(p->picks);
    free(p->count);
    memset(p, 0, sizeof *p);
}

void fid_picks_trace(const dsv4_trace_event *ev, void *user) {
    fid_picks *p = user;
    if (ev->layer >= p->n_layers) return; /* MTP layers */
    double sum = 0;
    for (int i = 0; i < ev->n_experts; i++) sum += ev->weights[i];
    double dev = fabs(sum - p->route_expect);
    p->route_events++;
    if (dev > 1e-3 * (p->route_expect > 1 ? p->route_expect : 1)) p->route_bad++;
    if (dev > p->route_worst) p->route_worst = dev;
    if (!ev->picks) return;
    if (ev->layer < 0 || ev->pos < 0 || ev->pos >= p->n_pos || ev->n_picks > p->topk) {
        p->trace_ok = 0;
        return;
    }
    size_t cell = (size_t)ev->layer * (size_t)p->n_pos + (size_t)ev->pos;
    p->count[cell] = (int16_t)ev->n_picks;
    memcpy(p->picks + cell * (size_t)p->topk, ev->picks, sizeof(int32_t) * (size_t)ev->n_picks);
}

void fid_picks_recall(const fid_picks *ref, const fid_picks *got, int l, int64_t p0, int64_t p1, int ratio,
                      int64_t *hit, int64_t *tot) {
    int k = ref->topk;
    for (int64_t pos = p0; pos < p1 && pos < ref->n_pos && pos < got->n_pos; pos++) {
        if (ratio > 0 && (pos + 1) / ratio <= k) continue; /* sees <= k rows: selects all of them */
        size_t cell = (size_t)l * (size_t)ref->n_pos + (size_t)pos;
        int nr = ref->count[cell], ng = got->count[cell];
        if (nr <= 0) continue;
        const int32_t *a = ref->picks + cell * (size_t)k, *b = got->picks + cell * (size_t)k;
        for (int i = 0; i < nr; i++) {
            for (int j = 0; j < ng; j++)
                if (b[j] == a[i]) {
                    (*hit)++;
                    break;
                }
        }
        *tot += nr;
    }
}
