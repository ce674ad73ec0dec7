/* fidelity/report: results of the recall suites and their JSON and HTML forms.
 *
 * Owns: fid_results (what the needle and multi-turn suites measured, including
 * partial runs), the JSON file and the self-contained HTML report (inline SVG
 * length x depth heatmap for needles, a table for multi-turn conversations, the
 * per-request answers, and a prominent note when the scores are meaningless
 * because the model has random weights).
 * Lifetime: the caller owns fid_results; writers keep nothing.  Errors: 0 / -1
 * naming the file.
 */
#ifndef DSV4_FIDELITY_REPORT_H
#define DSV4_FIDELITY_REPORT_H

#include <stdint.h>

#include "util/err.h"

#define FID_MAX_AXIS 32

/* One request: a needle cell sample or one conversation. */
typedef struct fid_item {
    int a, b;                 /* needle: length index, depth index; multiturn: turns index, conversation */
    int done;                 /* 1 when an answer came back */
    int pass;
    int64_t prompt_tokens;    /* -1 unknown */
    double secs;
    char expect[32];
    char key[64];             /* the needle's word / the codename's word */
    char answer[256];         /* excerpt */
    char error[1100];
} fid_item;

typedef struct fid_results {
    const char *suite;        /* "needle" or "multiturn" */
    char target[4400];        /* fid_client_describe */
    int local;
    int meaningless;          /* 1: local model without --real-weights */
    uint64_t seed;
    int axis_a[FID_MAX_AXIS], n_a; /* needle: lengths (approx tokens); multiturn: turns */
    int axis_b[FID_MAX_AXIS], n_b; /* needle: depths (percent); multiturn: unused (0) */
    int samples;              /* per cell (needle) or conversations per turns value */
    int tool_tokens;          /* multiturn: approx tokens per tool result */
    fid_item *items;
    int n_items;              /* planned */
    int n_run;                /* requests sent */
    int incomplete;
    char stop_reason[1200];
    double secs;
} fid_results;

/* Totals over the items that got an answer. */
void fid_results_score(const fid_results *r, int *done, int *pass);

int fid_results_write_json(const fid_results *r, const char *path, dsv4_err *err);
int fid_results_write_html(const fid_results *r, const char *path, dsv4_err *err);

#endif
