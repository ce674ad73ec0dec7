/* tools/serve: `dsv4 serve` -- the OpenAI-compatible HTTP server.
 *
 * Opens the model (the embedded default when no --model), loads its
 * tokenizer, starts the scheduler's engine thread and the HTTP front
 * (server/http), then waits for SIGTERM/SIGINT: on either it stops accepting,
 * gives requests in flight --grace seconds to finish, cancels the rest, frees
 * everything and exits 0.  docs/SERVER.md is the user's guide.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/scheduler.h"
#include "server/http.h"
#include "text/tokenizer.h"
#include "tools/commands.h"

#define MAX_SETS 64

/* the only globals: the signal flags (STYLE §9) */
static volatile sig_atomic_t g_stop_signal;

static void on_signal(int sig) { g_stop_signal = sig; }

static void usage(FILE *f) {
    fprintf(f,
            "usage: dsv4 serve [--model DIR] [--host 127.0.0.1] [--port 8000] [--max-seqs N] [--ctx N]\n"
            "                  [--api-key K] [--numerics P] [--set NAME=VALUE ...] [options]\n"
            "  OpenAI-compatible HTTP server: POST /v1/chat/completions, POST /v1/completions,\n"
            "  GET /v1/models, GET /health, GET /metrics (Prometheus).  See docs/SERVER.md.\n"
            "  --model DIR         checkpoint directory (default: the embedded default model)\n"
            "  --host ADDR         numeric address to listen on (default 127.0.0.1)\n"
            "  --port N            TCP port (default 8000; 0 = any free port, printed at start)\n"
            "  --max-seqs N        sequences decoded together (default 8); others wait in the queue\n"
            "  --queue N           requests waiting beyond the free slots (default 64); beyond: 429 + Retry-After\n"
            "  --ctx N             context limit per request, prompt + output (default: the model's)\n"
            "  --api-key K         require \"Authorization: Bearer K\" on /v1 routes (default: $DSV4_API_KEY)\n"
            "  --numerics P        numerics profile (default exact); --set NAME=VALUE overrides (repeatable)\n"
            "  --threads N         compute threads (default: OpenMP's)\n"
            "  --prefill-chunk N   prompt tokens per sequence per step (default 256)\n"
            "  --cache-mb N        prefix cache budget in MiB (default 1024); --no-prefix-cache disables it\n"
            "  --max-body BYTES    request body limit (default 8388608); larger bodies get 413\n"
            "  --served-model-name NAME  model id listed and echoed (default deepseek-chat;\n"
            "                      requests naming deepseek-reasoner get thinking mode)\n"
            "  --grace S           seconds in-flight requests get to finish on SIGTERM (default 5)\n"
            "  --test-hooks        accept \"dsv4_forced_output\" (make the model generate given text; tests only)\n"
            "  -q, --quiet         no per-request log lines;  -v, --verbose  log every request\n");
}

static int parse_int(const char *flag, const char *v, long long lo, long long hi, long long *out) {
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (!*v || *end || errno || x < lo || x > hi) {
        fprintf(stderr, "dsv4 serve: %s: '%s' is not an integer in [%lld, %lld]\n", flag, v, lo, hi);
        return -1;
    }
    *out = x;
    return 0;
}

int dsv4_cmd_serve(int argc, char **argv) {
    dsv4_server_opts so;
    dsv4_server_opts_default(&so);
    dsv4_sched_opts sched_o;
    dsv4_sched_opts_default(&sched_o);
    dsv4_engine_opts eo = {0};
    const char *sets[MAX_SETS];
    int n_sets = 0;
    double grace = 5;
    so.api_key = getenv("DSV4_API_KEY");
    if (so.api_key && !so.api_key[0]) so.api_key = NULL;

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage(stdout);
            return 0;
        }
        if (!strcmp(a, "-q") || !strcmp(a, "--quiet")) {
            dsv4_log_level = 0;
            continue;
        }
        if (!strcmp(a, "-v") || !strcmp(a, "--verbose")) {
            dsv4_log_level = 2;
            continue;
        }
        if (!strcmp(a, "--test-hooks")) {
            so.test_hooks = 1;
            continue;
        }
        if (!strcmp(a, "--no-prefix-cache")) {
            sched_o.cache_off = 1;
            continue;
        }
        if (a[0] != '-' || i + 1 >= argc) {
            fprintf(stderr, "dsv4 serve: %s '%s'%s\n", a[0] == '-' ? "missing value for" : "unexpected argument",
                    a, a[0] == '-' ? "" : " (see --help)");
            return 2;
        }
        const char *v = argv[++i];
        long long x;
        if (!strcmp(a, "--model")) eo.model_dir = v;
        else if (!strcmp(a, "--host")) so.host = v;
        else if (!strcmp(a, "--port")) {
            if (parse_int(a, v, 0, 65535, &x)) return 2;
            so.port = (int)x;
        } else if (!strcmp(a, "--max-seqs")) {
            if (parse_int(a, v, 1, 4096, &x)) return 2;
            sched_o.max_seqs = (int)x;
        } else if (!strcmp(a, "--queue")) {
            if (parse_int(a, v, 1, 1 << 20, &x)) return 2;
            sched_o.queue_cap = (int)x;
        } else if (!strcmp(a, "--ctx")) {
            if (parse_int(a, v, 2, INT32_MAX, &x)) return 2;
            sched_o.ctx = x;
        } else if (!strcmp(a, "--api-key")) {
            so.api_key = v[0] ? v : NULL;
        } else if (!strcmp(a, "--numerics")) {
            eo.numerics = v;
        } else if (!strcmp(a, "--set")) {
            if (n_sets == MAX_SETS) {
                fprintf(stderr, "dsv4 serve: --set: at most %d overrides\n", MAX_SETS);
                return 2;
            }
            sets[n_sets++] = v;
        } else if (!strcmp(a, "--threads")) {
            if (parse_int(a, v, 0, 1024, &x)) return 2;
            eo.n_threads = (int)x;
        } else if (!strcmp(a, "--prefill-chunk")) {
            if (parse_int(a, v, 1, 1 << 20, &x)) return 2;
            sched_o.prefill_chunk = (int)x;
            if (sched_o.prefill_budget < sched_o.prefill_chunk) sched_o.prefill_budget = sched_o.prefill_chunk;
        } else if (!strcmp(a, "--cache-mb")) {
            if (parse_int(a, v, 0, 1 << 24, &x)) return 2;
            sched_o.cache_bytes = (size_t)x << 20;
            if (x == 0) sched_o.cache_off = 1;
        } else if (!strcmp(a, "--max-body")) {
            if (parse_int(a, v, 1024, (long long)1 << 32, &x)) return 2;
            so.max_body = (size_t)x;
        } else if (!strcmp(a, "--served-model-name")) {
            if (!v[0] || strlen(v) >= 128) {
                fprintf(stderr, "dsv4 serve: --served-model-name: must be 1..127 bytes\n");
                return 2;
            }
            so.model_id = v;
        } else if (!strcmp(a, "--grace")) {
            char *end;
            errno = 0;
            grace = strtod(v, &end);
            if (!*v || *end || errno || !(grace >= 0 && grace <= 3600)) {
                fprintf(stderr, "dsv4 serve: --grace: '%s' is not a number of seconds in [0, 3600]\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "dsv4 serve: unknown option '%s' (see --help)\n", a);
            return 2;
        }
    }
    eo.sets = sets;
    eo.n_sets = n_sets;

    /* signals first, so a SIGTERM during the model load still exits cleanly */
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);

    dsv4_err err;
    dsv4_engine *eng = NULL;
    dsv4_tokenizer *tok = NULL;
    dsv4_sched *sched = NULL;
    dsv4_server *srv = NULL;
    int rc = 1;
    double t0 = dsv4_now();
    if (dsv4_engine_open(&eng, &eo, &err) < 0) {
        fprintf(stderr, "dsv4 serve: %s\n", err.msg);
        return 1;
    }
    dsv4_engine_info info;
    dsv4_engine_get_info(eng, &info);
    if (dsv4_tokenizer_load(&tok, info.model_dir, &err) < 0) {
        fprintf(stderr, "dsv4 serve: tokenizer: %s\n", err.msg);
        goto out;
    }
    if (dsv4_sched_start(&sched, eng, tok, &sched_o, &err) < 0) {
        fprintf(stderr, "dsv4 serve: %s\n", err.msg);
        goto out;
    }
    if (dsv4_server_start(&srv, &so, sched, tok, &err) < 0) {
        fprintf(stderr, "dsv4 serve: %s\n", err.msg);
        goto out;
    }
    /* one line that scripts can wait for (the port matters with --port 0) */
    fprintf(stderr, "dsv4 serve: listening on http://%s%s%s:%d  model %s (%s, %s numerics), ctx %lld, max-seqs %d%s; ready in %.1fs\n",
            strchr(so.host, ':') ? "[" : "", so.host, strchr(so.host, ':') ? "]" : "", dsv4_server_port(srv),
            info.model_name, info.model_dir, info.numerics, (long long)dsv4_sched_ctx(sched), sched_o.max_seqs,
            so.api_key ? ", API key required" : "", dsv4_now() - t0);
    fflush(stderr);

    while (!g_stop_signal) usleep(50000);
    fprintf(stderr, "dsv4 serve: %s: stopping (in flight: %d; grace %.1fs)\n",
            g_stop_signal == SIGINT ? "SIGINT" : "SIGTERM", dsv4_server_inflight(srv), grace);
    dsv4_server_stop(srv, grace);
    srv = NULL;
    rc = 0;
out:
    dsv4_server_stop(srv, 0);
    dsv4_sched_stop(sched, 1);
    dsv4_tokenizer_free(tok);
    dsv4_engine_close(eng);
    if (rc == 0) fprintf(stderr, "dsv4 serve: stopped\n");
    return rc;
}
