/* fidelity/common: pieces shared by `dsv4 diff` and `dsv4 fidelity`.
 *
 * Owns: token-id lists (parse, read from a file, deterministic synthetic ids),
 * SPEC strings ("profile[,name=value...][,backend=cpu|cuda]") checked against the
 * switch table before any model is loaded, opening an engine for a SPEC, small
 * JSON/HTML string escaping, and the indexer recall@k bookkeeping that
 * `fidelity ab` and `fidelity indexer-recall` both use.
 * Lifetime: every *_free pairs with its fill function.  Threads: reentrant.
 * Errors: 0 / -1 with a dsv4_err naming the option, token or switch at fault.
 */
#ifndef DSV4_FIDELITY_COMMON_H
#define DSV4_FIDELITY_COMMON_H

#include <stdint.h>
#include <stdio.h>

#include "engine/engine.h"
#include "util/err.h"

#define FID_MAX_SETS 32

/* ----- token ids ----- */
/* Parses ids separated by commas and/or whitespace into a malloc'd array.
 * `what` names the source in messages ("--tokens", a file name). */
int fid_parse_ids(const char *s, const char *what, int32_t **out, int *n, dsv4_err *err);
/* Reads a whole file (NUL-terminated, malloc'd); *len may be NULL. */
char *fid_read_file(const char *path, size_t *len, dsv4_err *err);
/* --tokens or --tokens-file (exactly one may be non-NULL; both NULL = error). */
int fid_load_tokens(const char *tokens, const char *tokens_file, int32_t **out, int *n, dsv4_err *err);
/* n deterministic pseudo-random ids in [lo, hi) from seed (the "synthetic text"). */
void fid_synthetic_ids(int32_t *out, int n, uint64_t seed, int32_t lo, int32_t hi);

/* ----- SPECs ----- */
typedef struct fid_spec {
    char text[512];                /* as given, for tables and JSON */
    char profile[64];
    char sets[FID_MAX_SETS][96];   /* "name=value" */
    int n_sets;
    char backend[16];              /* "cpu" unless given */
} fid_spec;
/* Parses and validates a SPEC (profile and every switch are checked here). */
int fid_spec_parse(fid_spec *sp, const char *text, dsv4_err *err);
/* Opens an engine for the spec on model_dir (NULL = default model). */
int fid_spec_open(const fid_spec *sp, const char *model_dir, dsv4_engine **out, dsv4_err *err);

/* ----- escaping ----- */
void fid_json_str(FILE *f, const char *s); /* writes "s" with JSON escapes */
void fid_html_str(FILE *f, const char *s); /* writes s with &<>"' escaped */

/* ----- indexer picks (recall@k) ----- */
/* Picks of every (ratio-4 layer, position) of one run, collected through the
 * engine's routing trace. */
typedef struct fid_picks {
    int n_layers, topk;            /* n_layers: trunk layers of the model */
    int64_t n_pos;                 /* positions recorded (0..n_pos-1) */
    int32_t *picks;                /* [layer][pos][topk], -1 = none */
    int16_t *count;                /* [layer][pos] picks, -1 = layer has no indexer */
    int trace_ok;                  /* 0 if an event fell outside the table */
    /* routing invariant, checked on the same trace: sum of applied weights per token */
    double route_expect;           /* routed_scaling_factor */
    int64_t route_events, route_bad;
    double route_worst;            /* largest |sum - expect| */
} fid_picks;
int fid_picks_init(fid_picks *p, int n_layers, int topk, int64_t n_pos, double route_expect, dsv4_err *err);
void fid_picks_free(fid_picks *p);
/* The dsv4_trace_fn that fills a fid_picks (user = the fid_picks). */
void fid_picks_trace(const dsv4_trace_event *ev, void *user);

/* recall@k of `got` against `ref` over positions [p0, p1) of layer l, counting
 * only rows whose reference selected topk picks out of more visible rows
 * (rows that see <= topk rows select everything and say nothing).  Adds to
 * *hit (picks of ref also in got) and *tot (picks of ref). */
void fid_picks_recall(const fid_picks *ref, const fid_picks *got, int l, int64_t p0, int64_t p1, int ratio,
                      int64_t *hit, int64_t *tot);

#endif
