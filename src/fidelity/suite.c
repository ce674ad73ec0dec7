/* fidelity/suite: needle-in-a-haystack and multi-turn recall (contract in suite.h).
 *
 * Everything a run sends is a function of --seed: filler sentences, needle
 * words and numbers, depths, tool results.  Each request asks for one 6-digit
 * number; grading takes the first run of exactly six digits in the answer and
 * compares it with the planted one (exact match).  Runs are bounded by
 * --max-requests and --timeout; when a bound is hit or the endpoint fails, the
 * results so far are written (JSON, HTML) and marked incomplete.
 */
#include "fidelity/suite.h"

#include <ctype.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "fidelity/client.h"
#include "fidelity/common.h"
#include "fidelity/report.h"
#include "text/chat.h"

/* ----- deterministic text ----- */
static uint64_t rng_next(uint64_t *s) { /* splitmix64 */
    uint64_t z = (*s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
static int rng_below(uint64_t *s, int n) { return (int)(rng_next(s) % (uint64_t)n); }

static const char *const SUBJECTS[] = {
    "The old harbour",   "A quiet village",      "The river",      "The library",     "Our committee",
    "The northern road", "A travelling merchant", "The orchard",    "The lighthouse keeper", "The city council",
    "The baker",         "A group of students",  "The museum",     "The ferry captain", "The night watchman"};
static const char *const VERBS[] = {"noted that", "reported that", "believed that", "remembered that",
                                    "wrote that", "argued that",   "mentioned that", "explained that"};
static const char *const CLAUSES[] = {
    "the weather turned cold early that year", "the bridge needed new stones", "the market opened before dawn",
    "most visitors arrived by boat",           "the bells rang twice at noon", "the fields were planted with barley",
    "the letters arrived a week late",         "the lamps were lit at dusk",   "the school moved to the hill",
    "nobody could find the old map",           "the well water tasted of iron", "the choir practised every Tuesday",
    "the roof of the mill was repaired",       "the apple harvest was smaller than usual",
    "the path along the cliffs was closed for the winter"};
static const char *const ADJ[] = {"amber", "cobalt", "crimson", "silver", "velvet", "granite",
                                  "lunar", "hollow", "copper",  "ivory",  "misty",  "golden"};
static const char *const NOUN[] = {"falcon", "harbor", "lantern", "meadow", "quartz", "willow",
                                   "comet",  "glacier", "orchid", "canyon", "ember",  "tundra"};
#define NA(a) ((int)(sizeof(a) / sizeof((a)[0])))

/* Appends filler sentences to b until it holds about `chars` more characters. */
static void filler(dsv4_chat_buf *b, size_t chars, uint64_t *rng) {
    size_t end = b->len + chars;
    while (b->len < end && !b->oom) {
        char s[256];
        snprintf(s, sizeof s, "%s %s %s. ", SUBJECTS[rng_below(rng, NA(SUBJECTS))], VERBS[rng_below(rng, NA(VERBS))],
                 CLAUSES[rng_below(rng, NA(CLAUSES))]);
        dsv4_chat_buf_puts(b, s);
    }
}

/* A key word "adj-noun-N" and a 6-digit number, both unique within the run. */
static void new_secret(fid_results *r, int upto, uint64_t *rng, char *key, size_t kn, char *num, size_t nn) {
    for (int tries = 0;; tries++) {
        snprintf(key, kn, "%s-%s", ADJ[rng_below(rng, NA(ADJ))], NOUN[rng_below(rng, NA(NOUN))]);
        if (tries > 50) snprintf(key + strlen(key), kn - strlen(key), "-%d", upto);
        snprintf(num, nn, "%06d", 100000 + rng_below(rng, 900000));
        int dup = 0;
        for (int i = 0; i < upto; i++)
            if (!strcmp(r->items[i].key, key) || !strcmp(r->items[i].expect, num)) dup = 1;
        if (!dup) return;
    }
}

/* Exact-match grading: the first run of exactly six digits equals the number. */
static int grade(const char *answer, const char *expect) {
    for (const char *p = answer; *p; p++) {
        if (!isdigit((unsigned char)*p) || (p > answer && isdigit((unsigned char)p[-1]))) continue;
        size_t n = 0;
        while (isdigit((unsigned char)p[n])) n++;
        if (n == 6) return !strncmp(p, expect, 6);
    }
    return 0;
}

/* ----- options ----- */
typedef struct suite_opts {
    const char *endpoint, *model, *api_key, *json, *html, *lengths, *depths, *turns;
    const char *sets[FID_MAX_SETS];
    int n_sets, real_weights, max_requests, max_tokens, samples, tool_tokens;
    long seed;
    double timeout, request_timeout;
} suite_opts;

static void usage(FILE *f, int needle) {
    fprintf(f,
            "usage: dsv4 fidelity %s [--endpoint URL --model NAME [--api-key K] | --model DIR [--set N=V ...]]\n"
            "       %s\n"
            "       [--seed S] [--max-requests N] [--timeout SECS] [--request-timeout SECS] [--max-tokens N]\n"
            "       [--json FILE] [--html FILE] [--real-weights]\n",
            needle ? "needle" : "multiturn",
            needle ? "[--lengths 256,512,1024] [--depths 0,25,50,75,100] [--samples N]"
                   : "[--turns 2,4,6] [--tool-tokens N] [--conversations N]");
    if (needle)
        fprintf(f, "  Needle in a haystack: filler text of about L tokens (4 characters each) with one sentence\n"
                   "  \"The secret code for <word> is <6 digits>.\" at depth D%%, then the question; exact match\n"
                   "  of the number.  One request per length x depth x sample.\n");
    else
        fprintf(f, "  Multi-turn recall: turn 1 plants \"my project codename is <word>-<6 digits>\"; then T turns\n"
                   "  each with a tool call (search_docs) and a long tool result (--tool-tokens, with distractor\n"
                   "  numbers), all with the tools declared; finally the codename is asked for (exact match).\n");
    fprintf(f, "  --endpoint URL     an OpenAI-compatible server (POST URL/v1/chat/completions); without it the\n"
               "                     local model runs in-process (--model DIR, default: the embedded model)\n"
               "  --max-requests N   stop after N requests (default 200); --timeout SECS overall (default 1800)\n"
               "  --real-weights     the local checkpoint has real weights (otherwise the report says the\n"
               "                     scores of a local run are meaningless: synth models have random weights)\n"
               "  Partial results are written when a bound is hit or the endpoint fails (exit 1 on failure).\n");
}

static int parse_axis(const char *s, int *v, int *n, int lo, int hi, const char *what) {
    dsv4_err err;
    *n = 0;
    const char *p = s;
    while (*p) {
        char *end;
        long x = strtol(p, &end, 10);
        if (end == p || (*end && *end != ',') || x < lo || x > hi || *n == FID_MAX_AXIS) {
            dsv4_errf(&err, "%s: '%s' is not a list of at most %d integers in [%d, %d]", what, s, FID_MAX_AXIS, lo, hi);
            fprintf(stderr, "dsv4 fidelity: %s\n", err.msg);
            return -1;
        }
        v[(*n)++] = (int)x;
        p = *end ? end + 1 : end;
    }
    if (!*n) return fprintf(stderr, "dsv4 fidelity: %s is empty\n", what), -1;
    return 0;
}

static int parse_opts(int argc, char **argv, suite_opts *o, int needle) {
    memset(o, 0, sizeof *o);
    o->lengths = "256,512,1024";
    o->depths = "0,25,50,75,100";
    o->turns = "2,4,6";
    o->max_requests = 200;
    o->max_tokens = 32;
    o->samples = needle ? 1 : 2;
    o->tool_tokens = 300;
    o->seed = 1;
    o->timeout = 1800;
    o->request_timeout = 120;
    const char *name = needle ? "needle" : "multiturn";
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) return usage(stdout, needle), 1;
        if (!strcmp(a, "--real-weights")) {
            o->real_weights = 1;
            continue;
        }
        if (i + 1 >= argc) return fprintf(stderr, "dsv4 fidelity %s: %s needs a value (see --help)\n", name, a), 2;
        const char *v = argv[++i];
        const char **sd = NULL;
        int *id = NULL;
        double *dd = NULL;
        int lo = 1, hi = 1 << 24;
        if (!strcmp(a, "--endpoint")) sd = &o->endpoint;
        else if (!strcmp(a, "--model")) sd = &o->model;
        else if (!strcmp(a, "--api-key")) sd = &o->api_key;
        else if (!strcmp(a, "--json")) sd = &o->json;
        else if (!strcmp(a, "--html")) sd = &o->html;
        else if (needle && !strcmp(a, "--lengths")) sd = &o->lengths;
        else if (needle && !strcmp(a, "--depths")) sd = &o->depths;
        else if (!needle && !strcmp(a, "--turns")) sd = &o->turns;
        else if (!strcmp(a, "--max-requests")) id = &o->max_requests;
        else if (!strcmp(a, "--max-tokens")) id = &o->max_tokens, hi = 4096;
        else if (needle && !strcmp(a, "--samples")) id = &o->samples, hi = 1000;
        else if (!needle && !strcmp(a, "--conversations")) id = &o->samples, hi = 1000;
        else if (!needle && !strcmp(a, "--tool-tokens")) id = &o->tool_tokens, lo = 0;
        else if (!strcmp(a, "--timeout")) dd = &o->timeout;
        else if (!strcmp(a, "--request-timeout")) dd = &o->request_timeout;
        else if (!strcmp(a, "--seed")) {
            char *end;
            o->seed = strtol(v, &end, 10);
            if (!*v || *end || o->seed < 0)
                return fprintf(stderr, "dsv4 fidelity %s: --seed expects a non-negative integer\n", name), 2;
            continue;
        } else if (!strcmp(a, "--set")) {
            if (o->n_sets == FID_MAX_SETS) return fprintf(stderr, "dsv4 fidelity %s: too many --set\n", name), 2;
            o->sets[o->n_sets++] = v;
            continue;
        } else
            return fprintf(stderr, "dsv4 fidelity %s: unknown option '%s' (see --help)\n", name, a), 2;
        char *end;
        if (sd) *sd = v;
        else if (id) {
            long x = strtol(v, &end, 10);
            if (!*v || *end || x < lo || x > hi)
                return fprintf(stderr, "dsv4 fidelity %s: %s expects an integer in [%d, %d], got '%s'\n", name, a,
                               lo, hi, v), 2;
            *id = (int)x;
        } else {
            *dd = strtod(v, &end);
            if (!*v || *end || !(*dd > 0) || *dd > 1e7)
                return fprintf(stderr, "dsv4 fidelity %s: %s expects a positive number of seconds, got '%s'\n", name,
                               a, v), 2;
        }
    }
    if (o->endpoint && o->n_sets)
        return fprintf(stderr, "dsv4 fidelity %s: --set applies to the local model, not to --endpoint\n", name), 2;
    return 0;
}

/* ----- prompts ----- */
static json_t *needle_messages(const fid_results *r, const fid_item *it, uint64_t seed) {
    uint64_t rng = seed * 1000003u + (uint64_t)(it - r->items) * 7919u + 17;
    size_t chars = (size_t)r->axis_a[it->a] * 4;
    dsv4_chat_buf hay = {0};
    filler(&hay, chars, &rng);
    if (hay.oom) return NULL;
    /* the needle goes at a sentence boundary near depth% */
    size_t at = (size_t)((double)hay.len * r->axis_b[it->b] / 100.0);
    if (at >= hay.len) at = hay.len;
    else {
        while (at > 0 && !(hay.data[at - 1] == ' ' && at >= 2 && hay.data[at - 2] == '.')) at--;
    }
    char needle[160];
    snprintf(needle, sizeof needle, "The secret code for %s is %s. ", it->key, it->expect);
    dsv4_chat_buf b = {0};
    dsv4_chat_buf_puts(&b, "Below is a long document. Somewhere in it is a secret code. Read it carefully and answer "
                           "the question after it.\n\n");
    dsv4_chat_buf_put(&b, hay.data, at);
    dsv4_chat_buf_puts(&b, needle);
    dsv4_chat_buf_put(&b, hay.data + at, hay.len - at);
    char q[200];
    snprintf(q, sizeof q, "\n\nQuestion: What is the secret code for %s? Reply with the 6-digit code only.", it->key);
    dsv4_chat_buf_puts(&b, q);
    dsv4_chat_buf_free(&hay);
    if (b.oom) {
        dsv4_chat_buf_free(&b);
        return NULL;
    }
    json_t *m = json_pack("[{s:s, s:s}]", "role", "user", "content", b.data);
    dsv4_chat_buf_free(&b);
    return m;
}

static json_t *search_tool(void) {
    return json_pack("[{s:s, s:{s:s, s:s, s:{s:s, s:{s:{s:s, s:s}}, s:[s]}}}]", "type", "function", "function",
                     "name", "search_docs", "description", "Search the team's document archive and return the text.",
                     "parameters", "type", "object", "properties", "query", "type", "string", "description",
                     "what to look for", "required", "query");
}

static const char *const TOPICS[] = {"harbour repairs", "winter schedule", "market permits", "bridge survey",
                                     "library budget", "ferry timetable", "orchard yields", "school relocation"};

static json_t *multiturn_messages(const fid_results *r, const fid_item *it, uint64_t seed) {
    uint64_t rng = seed * 1000003u + (uint64_t)(it - r->items) * 7919u + 29;
    int turns = r->axis_a[it->a];
    json_t *m = json_array();
    char first[300];
    snprintf(first, sizeof first, "Before we start: my project codename is %s-%s. Please remember it exactly; I will "
                                  "ask you for it later.", it->key, it->expect);
    json_array_append_new(m, json_pack("{s:s, s:s}", "role", "system", "content",
                                       "You are a helpful assistant. Use the tools when asked to look something up."));
    json_array_append_new(m, json_pack("{s:s, s:s}", "role", "user", "content", first));
    json_array_append_new(m, json_pack("{s:s, s:s}", "role", "assistant", "content",
                                       "Understood. I will remember your project codename."));
    for (int t = 0; t < turns; t++) {
        const char *topic = TOPICS[rng_below(&rng, NA(TOPICS))];
        char ask[200], args[200], id[32], summary[200];
        snprintf(ask, sizeof ask, "Please look up the %s report (part %d) and summarise it.", topic, t + 1);
        snprintf(args, sizeof args, "{\"query\": \"%s part %d\"}", topic, t + 1);
        snprintf(id, sizeof id, "call_%d", t + 1);
        snprintf(summary, sizeof summary, "Part %d of the %s report is mostly routine notes; nothing needs action.",
                 t + 1, topic);
        dsv4_chat_buf res = {0};
        char head[160];
        snprintf(head, sizeof head, "Document: %s, part %d.\n", topic, t + 1);
        dsv4_chat_buf_puts(&res, head);
        size_t target = (size_t)r->tool_tokens * 4;
        while (res.len < target && !res.oom) {
            filler(&res, 240, &rng);
            char ref[64]; /* distractor numbers: the answer must be the codename's, not these */
            snprintf(ref, sizeof ref, "Reference number %06d. ", 100000 + rng_below(&rng, 900000));
            dsv4_chat_buf_puts(&res, ref);
        }
        if (res.oom) {
            dsv4_chat_buf_free(&res);
            json_decref(m);
            return NULL;
        }
        json_array_append_new(m, json_pack("{s:s, s:s}", "role", "user", "content", ask));
        json_array_append_new(m, json_pack("{s:s, s:s, s:[{s:s, s:s, s:{s:s, s:s}}]}", "role", "assistant", "content",
                                           "", "tool_calls", "id", id, "type", "function", "function", "name",
                                           "search_docs", "arguments", args));
        json_array_append_new(m, json_pack("{s:s, s:s, s:s}", "role", "tool", "tool_call_id", id, "content", res.data));
        json_array_append_new(m, json_pack("{s:s, s:s}", "role", "assistant", "content", summary));
        dsv4_chat_buf_free(&res);
    }
    json_array_append_new(m, json_pack("{s:s, s:s}", "role", "user", "content",
                                       "What is my project codename that I told you at the start? Reply with the "
                                       "codename only."));
    return m;
}

/* ----- the run ----- */
static int run_suite(int argc, char **argv, int needle) {
    const char *name = needle ? "needle" : "multiturn";
    suite_opts o;
    int prc = parse_opts(argc, argv, &o, needle);
    if (prc) return prc == 1 ? 0 : prc;
    fid_results r;
    memset(&r, 0, sizeof r);
    r.suite = name;
    r.seed = (uint64_t)o.seed;
    r.samples = o.samples;
    r.tool_tokens = o.tool_tokens;
    if (needle) {
        if (parse_axis(o.lengths, r.axis_a, &r.n_a, 16, 1 << 22, "--lengths") ||
            parse_axis(o.depths, r.axis_b, &r.n_b, 0, 100, "--depths"))
            return 2;
    } else {
        if (parse_axis(o.turns, r.axis_a, &r.n_a, 0, 1000, "--turns")) return 2;
        r.n_b = 1;
    }
    dsv4_err err = {{0}};
    fid_client *c = NULL;
    fid_client_opts co = {.endpoint = o.endpoint, .model = o.model, .api_key = o.api_key,
                          .request_timeout = o.request_timeout, .max_tokens = o.max_tokens, .sets = o.sets,
                          .n_sets = o.n_sets};
    if (fid_client_open(&c, &co, &err)) {
        fprintf(stderr, "dsv4 fidelity %s: %s\n", name, err.msg);
        return 1;
    }
    r.local = fid_client_is_local(c);
    r.meaningless = r.local && !o.real_weights;
    snprintf(r.target, sizeof r.target, "%s", fid_client_describe(c));
    r.n_items = r.n_a * r.n_b * o.samples;
    r.items = calloc((size_t)r.n_items, sizeof *r.items);
    if (!r.items) {
        fid_client_close(c);
        return fprintf(stderr, "dsv4 fidelity %s: out of memory\n", name), 1;
    }
    uint64_t rng = (uint64_t)o.seed * 2654435761u + (needle ? 1 : 2);
    int k = 0;
    for (int i = 0; i < r.n_a; i++)
        for (int j = 0; j < r.n_b; j++)
            for (int s = 0; s < o.samples; s++, k++) {
                fid_item *it = &r.items[k];
                it->a = i;
                it->b = needle ? j : s;
                it->prompt_tokens = -1;
                new_secret(&r, k, &rng, it->key, sizeof it->key, it->expect, sizeof it->expect);
            }
    printf("fidelity %s: %s, %d requests planned, seed %ld\n", name, r.target, r.n_items, o.seed);
    if (r.meaningless)
        printf("NOTE: local model without --real-weights: scores are meaningless (random weights); this run "
               "checks the harness only.\n");
    fflush(stdout);
    double t0 = dsv4_now();
    int failed = 0;
    json_t *tools = needle ? NULL : search_tool();
    for (k = 0; k < r.n_items; k++) {
        fid_item *it = &r.items[k];
        if (r.n_run >= o.max_requests) {
            r.incomplete = 1;
            snprintf(r.stop_reason, sizeof r.stop_reason, "stopped at --max-requests %d (%d of %d sent)",
                     o.max_requests, r.n_run, r.n_items);
            break;
        }
        if (dsv4_now() - t0 > o.timeout) {
            r.incomplete = 1;
            snprintf(r.stop_reason, sizeof r.stop_reason, "overall --timeout %.0f s reached (%d of %d sent)",
                     o.timeout, r.n_run, r.n_items);
            break;
        }
        json_t *msgs = needle ? needle_messages(&r, it, r.seed) : multiturn_messages(&r, it, r.seed);
        if (!msgs) {
            snprintf(it->error, sizeof it->error, "out of memory building the prompt");
            r.incomplete = failed = 1;
            snprintf(r.stop_reason, sizeof r.stop_reason, "%s", it->error);
            break;
        }
        char *ans = NULL;
        double t1 = dsv4_now();
        r.n_run++;
        int rc = fid_client_chat(c, msgs, tools, &ans, &it->prompt_tokens, &err);
        it->secs = dsv4_now() - t1;
        json_decref(msgs);
        if (rc) {
            snprintf(it->error, sizeof it->error, "%s", err.msg);
            r.incomplete = failed = 1;
            snprintf(r.stop_reason, sizeof r.stop_reason, "request %d failed: %s", r.n_run, err.msg);
            fprintf(stderr, "dsv4 fidelity %s: %s\n", name, r.stop_reason);
            break;
        }
        it->done = 1;
        it->pass = grade(ans, it->expect);
        snprintf(it->answer, sizeof it->answer, "%s", ans);
        free(ans);
        if (needle)
            printf("  length %6d depth %3d%%: %s (expected %s, prompt %lld tokens, %.2f s)\n", r.axis_a[it->a],
                   r.axis_b[it->b], it->pass ? "pass" : "FAIL", it->expect, (long long)it->prompt_tokens, it->secs);
        else
            printf("  turns %3d conversation %d: %s (expected %s, prompt %lld tokens, %.2f s)\n", r.axis_a[it->a],
                   it->b, it->pass ? "pass" : "FAIL", it->expect, (long long)it->prompt_tokens, it->secs);
        fflush(stdout);
    }
    json_decref(tools);
    r.secs = dsv4_now() - t0;
    int done, pass;
    fid_results_score(&r, &done, &pass);
    int wrc = 0;
    if (o.json && fid_results_write_json(&r, o.json, &err)) wrc = 1, fprintf(stderr, "dsv4 fidelity %s: %s\n", name, err.msg);
    if (o.html && fid_results_write_html(&r, o.html, &err)) wrc = 1, fprintf(stderr, "dsv4 fidelity %s: %s\n", name, err.msg);
    printf("%s score: %d/%d", name, pass, done);
    if (done) printf(" (%.1f%%)", 100.0 * pass / done);
    printf(" of %d planned%s%s\n", r.n_items, r.incomplete ? "; INCOMPLETE: " : "", r.incomplete ? r.stop_reason : "");
    if (r.meaningless) printf("NOTE: scores are meaningless on a random-weight model (pass --real-weights if not).\n");
    free(r.items);
    fid_client_close(c);
    return failed || wrc ? 1 : 0;
}

int fid_cmd_needle(int argc, char **argv) { return run_suite(argc, argv, 1); }
int fid_cmd_multiturn(int argc, char **argv) { return run_suite(argc, argv, 0); }
