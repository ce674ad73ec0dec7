/* tools/generate: `dsv4 generate` (one completion, streamed) and `dsv4 chat`
 * (an interactive multi-turn REPL in the V4 chat format).
 *
 * Both go through the scheduler like the server does: the main thread submits
 * a request and prints its events while the engine thread computes.  The chat
 * renders the whole conversation every turn; the scheduler's prefix cache
 * finds the previous turn's sequence, so only the new text is prefilled.
 * Signals: SIGINT only sets a flag (STYLE §9); the event loop polls it and
 * cancels the request.
 */
#include <errno.h>
#include <jansson.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "engine/engine.h"
#include "engine/scheduler.h"
#include "text/chat.h"
#include "text/tokenizer.h"
#include "tools/commands.h"

static volatile sig_atomic_t g_interrupted;

static void on_sigint(int sig) {
    (void)sig;
    g_interrupted = 1;
}

/* ----- options shared by both commands ----- */
typedef struct gen_opts {
    const char *cmd;
    const char *model, *numerics, *prompt, *system;
    const char **sets;
    int n_sets;
    int chat, thinking, threads, max_tokens;
    long long ctx;
    dsv4_sampling_params sp;
} gen_opts;

static void usage_generate(FILE *f) {
    fprintf(f, "usage: dsv4 generate -p TEXT [--chat] [--thinking] [-n N] [sampling] [model]\n"
               "  Streams a completion of TEXT to stdout, then tokens/s on stderr.\n"
               "  -p, --prompt TEXT  the prompt (raw text after BOS; with --chat: a user message)\n"
               "  --chat             wrap TEXT as a user message in the DeepSeek-V4 chat format\n"
               "  --thinking         thinking mode (with --chat): reasoning is shown dimmed\n"
               "  --system TEXT      a system message (with --chat)\n");
}

static void usage_chat(FILE *f) {
    fprintf(f, "usage: dsv4 chat [--thinking] [--system TEXT] [-n N] [sampling] [model]\n"
               "  An interactive conversation in the DeepSeek-V4 chat format, one line per turn.\n"
               "  Commands: /think toggles thinking mode, /reset starts over, /quit (or EOF) leaves.\n"
               "  Ctrl-C stops an answer; Ctrl-C twice at the prompt leaves.\n"
               "  --thinking         start in thinking mode (reasoning is shown dimmed)\n"
               "  --system TEXT      a system message for the conversation\n");
}

static void usage_common(FILE *f) {
    fprintf(f, "  -n, --max-tokens N new tokens at most per answer (default 256)\n"
               "  --temperature T    0 = greedy (default 1)\n"
               "  --top-p P          nucleus sampling (default 1 = off)\n"
               "  --top-k K          keep the K best tokens (default 0 = off)\n"
               "  --seed S           sampler seed (default: drawn, and printed)\n"
               "  --model DIR        checkpoint directory (default: the embedded default model)\n"
               "  --numerics P       numerics profile: exact (default) or reference\n"
               "  --set NAME=VALUE   override one numerics switch (repeatable; see dsv4 switches)\n"
               "  --threads N        compute threads (default: all)\n"
               "  --ctx N            context limit in tokens (default: the model's)\n");
}

static int parse_num(const char *cmd, const char *flag, const char *v, double lo, double hi, double *out) {
    char *end;
    errno = 0;
    double x = strtod(v, &end);
    if (end == v || *end || errno || !(x >= lo && x <= hi)) {
        fprintf(stderr, "dsv4 %s: %s expects a number in [%g, %g], got '%s'\n", cmd, flag, lo, hi, v);
        return -1;
    }
    *out = x;
    return 0;
}

static int parse_int(const char *cmd, const char *flag, const char *v, double lo, double hi, double *out) {
    if (parse_num(cmd, flag, v, lo, hi, out)) return -1;
    if (*out != (double)(long long)*out) {
        fprintf(stderr, "dsv4 %s: %s expects a whole number, got '%s'\n", cmd, flag, v);
        return -1;
    }
    return 0;
}

/* Returns 0 to go on, 1 after --help, 2 on a bad flag. */
static int parse_opts(gen_opts *o, int argc, char **argv, int is_chat) {
    memset(o, 0, sizeof *o);
    o->cmd = is_chat ? "chat" : "generate";
    o->chat = is_chat;
    o->max_tokens = 256;
    dsv4_sampling_params_default(&o->sp);
    o->sets = calloc((size_t)argc + 1, sizeof *o->sets);
    if (!o->sets) return 2;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            if (is_chat)
                usage_chat(stdout);
            else
                usage_generate(stdout);
            usage_common(stdout);
            return 1;
        }
        if (!strcmp(a, "--chat") && !is_chat) {
            o->chat = 1;
            continue;
        }
        if (!strcmp(a, "--thinking")) {
            o->thinking = 1;
            continue;
        }
        static const char *const valued[] = {
            "-p",           "--prompt",      "--model", "--numerics", "--set",  "--system",  "-n",
            "--max-tokens", "--temperature", "--top-p", "--top-k",    "--seed", "--threads", "--ctx"};
        int known = 0;
        for (size_t k = 0; k < sizeof valued / sizeof valued[0]; k++)
            if (!strcmp(a, valued[k])) known = 1;
        if (is_chat && (!strcmp(a, "-p") || !strcmp(a, "--prompt"))) known = 0;
        if (!known) {
            fprintf(stderr, "dsv4 %s: unknown option '%s' (see --help)\n", o->cmd, a);
            return 2;
        }
        if (i + 1 >= argc) {
            fprintf(stderr, "dsv4 %s: %s needs a value\n", o->cmd, a);
            return 2;
        }
        const char *v = argv[++i];
        double x;
        if (!strcmp(a, "-p") || !strcmp(a, "--prompt"))
            o->prompt = v;
        else if (!strcmp(a, "--model"))
            o->model = v;
        else if (!strcmp(a, "--numerics"))
            o->numerics = v;
        else if (!strcmp(a, "--set"))
            o->sets[o->n_sets++] = v;
        else if (!strcmp(a, "--system"))
            o->system = v;
        else if (!strcmp(a, "-n") || !strcmp(a, "--max-tokens")) {
            if (parse_int(o->cmd, a, v, 1, 1 << 24, &x)) return 2;
            o->max_tokens = (int)x;
        } else if (!strcmp(a, "--temperature")) {
            if (parse_num(o->cmd, a, v, 0, 100, &x)) return 2;
            o->sp.temperature = (float)x;
        } else if (!strcmp(a, "--top-p")) {
            if (parse_num(o->cmd, a, v, 0, 1, &x)) return 2;
            o->sp.top_p = (float)x;
        } else if (!strcmp(a, "--top-k")) {
            if (parse_int(o->cmd, a, v, 0, 1 << 30, &x)) return 2;
            o->sp.top_k = (int)x;
        } else if (!strcmp(a, "--seed")) {
            char *end;
            errno = 0;
            unsigned long long s = strtoull(v, &end, 10);
            if (end == v || *end || errno || v[0] == '-') {
                fprintf(stderr, "dsv4 %s: --seed expects a non-negative integer, got '%s'\n", o->cmd, v);
                return 2;
            }
            o->sp.has_seed = 1;
            o->sp.seed = s;
        } else if (!strcmp(a, "--threads")) {
            if (parse_int(o->cmd, a, v, 0, 4096, &x)) return 2;
            o->threads = (int)x;
        } else if (!strcmp(a, "--ctx")) {
            if (parse_int(o->cmd, a, v, 2, 1e12, &x)) return 2;
            o->ctx = (long long)x;
        }
    }
    if (!is_chat && !o->prompt) {
        fprintf(stderr, "dsv4 generate: -p TEXT is required (see --help)\n");
        return 2;
    }
    if (!is_chat && !o->chat && (o->thinking || o->system)) {
        fprintf(stderr, "dsv4 generate: %s needs --chat\n", o->thinking ? "--thinking" : "--system");
        return 2;
    }
    return 0;
}

/* ----- a progress line on stderr (only when stderr is a terminal) ----- */
static int g_tty_err, g_tty_out;

static void progress_draw(const char *what, long long done, long long total) {
    if (!g_tty_err) return;
    int width = 30, fill = total > 0 ? (int)(width * done / total) : 0;
    char bar[64];
    for (int i = 0; i < width; i++)
        bar[i] = i < fill ? '#' : '.';
    bar[width] = 0;
    fprintf(stderr, "\r\033[2K%s [%s] %lld/%lld", what, bar, done, total);
    fflush(stderr);
}

static void progress_clear(void) {
    if (!g_tty_err) return;
    fprintf(stderr, "\r\033[2K");
    fflush(stderr);
}

/* ----- the session: engine + tokenizer + scheduler ----- */
typedef struct session {
    dsv4_engine *e;
    dsv4_tokenizer *tok;
    dsv4_sched *s;
    dsv4_engine_info info;
} session;

static int session_open(session *ss, const gen_opts *o) {
    memset(ss, 0, sizeof *ss);
    dsv4_err err = {{0}};
    char dir[4096];
    if (o->model)
        snprintf(dir, sizeof dir, "%s", o->model);
    else if (dsv4_engine_default_model(dir, sizeof dir, &err)) {
        fprintf(stderr, "dsv4 %s: %s\n", o->cmd, err.msg);
        return -1;
    }
    if (g_tty_err) {
        fprintf(stderr, "loading %s ...", dir);
        fflush(stderr);
    }
    dsv4_engine_opts eo = {.model_dir = dir,
                           .numerics = o->numerics,
                           .sets = o->sets,
                           .n_sets = o->n_sets,
                           .n_threads = o->threads};
    if (dsv4_engine_open(&ss->e, &eo, &err)) {
        progress_clear();
        fprintf(stderr, "dsv4 %s: %s\n", o->cmd, err.msg);
        return -1;
    }
    if (dsv4_tokenizer_load(&ss->tok, dir, &err)) {
        progress_clear();
        fprintf(stderr, "dsv4 %s: tokenizer: %s\n", o->cmd, err.msg);
        dsv4_engine_close(ss->e);
        return -1;
    }
    dsv4_engine_get_info(ss->e, &ss->info);
    dsv4_sched_opts so;
    dsv4_sched_opts_default(&so);
    so.max_seqs = 1;
    so.queue_cap = 1;
    so.ctx = o->ctx;
    so.cache_max_seqs = 4;
    if (dsv4_sched_start(&ss->s, ss->e, ss->tok, &so, &err)) {
        progress_clear();
        fprintf(stderr, "dsv4 %s: %s\n", o->cmd, err.msg);
        dsv4_tokenizer_free(ss->tok);
        dsv4_engine_close(ss->e);
        return -1;
    }
    progress_clear();
    return 0;
}

static void session_close(session *ss) {
    dsv4_sched_stop(ss->s, 1);
    dsv4_tokenizer_free(ss->tok);
    dsv4_engine_close(ss->e);
}

/* ----- one answer, streamed ----- */
typedef struct answer {
    dsv4_chat_buf content, reasoning;
    dsv4_usage usage;
    dsv4_finish_reason why;
    char error[DSV4_ERR_MAX];
    int in_reasoning;
} answer;

static void print_reasoning(answer *a, const char *t, size_t n) {
    if (!a->in_reasoning) {
        fputs(g_tty_out ? "\033[2m" : "<think>", stdout);
        a->in_reasoning = 1;
    }
    fwrite(t, 1, n, stdout);
}

static void end_reasoning(answer *a) {
    if (!a->in_reasoning) return;
    fputs(g_tty_out ? "\033[0m\n" : "</think>\n", stdout);
    a->in_reasoning = 0;
}

/* Submits and prints until the request finishes.  Returns 0, or -1 if the
 * request was refused (message printed). */
static int run_request(session *ss, const gen_opts *o, const dsv4_request_params *p, answer *a) {
    memset(a, 0, sizeof *a);
    dsv4_request *r = NULL;
    dsv4_err err = {{0}};
    if (dsv4_sched_submit(ss->s, p, &r, &err) != DSV4_SCHED_OK) {
        fprintf(stderr, "dsv4 %s: %s\n", o->cmd, err.msg);
        return -1;
    }
    int cancelled = 0, progress_shown = 0;
    for (;;) {
        if (g_interrupted && !cancelled) {
            dsv4_request_cancel(r);
            cancelled = 1;
        }
        dsv4_event ev;
        int got = dsv4_request_next_event(r, &ev, 0.1);
        if (got < 0) break;
        if (got == 0) continue;
        if (progress_shown && ev.type != DSV4_EV_PROGRESS) {
            progress_clear();
            progress_shown = 0;
        }
        switch (ev.type) {
        case DSV4_EV_REASONING:
            print_reasoning(a, ev.text, ev.len);
            dsv4_chat_buf_put(&a->reasoning, ev.text, ev.len);
            break;
        case DSV4_EV_CONTENT:
            end_reasoning(a);
            fwrite(ev.text, 1, ev.len, stdout);
            dsv4_chat_buf_put(&a->content, ev.text, ev.len);
            break;
        case DSV4_EV_PROGRESS:
            /* only worth a bar for long prefills */
            if (ev.progress_total > 256 && ev.progress_done < ev.progress_total) {
                progress_draw("prefill", ev.progress_done, ev.progress_total);
                progress_shown = 1;
            }
            break;
        case DSV4_EV_FINISHED:
            a->why = ev.finish;
            a->usage = ev.usage;
            if (ev.message) snprintf(a->error, sizeof a->error, "%s", ev.message);
            break;
        default:
            break;
        }
        fflush(stdout);
        int fin = ev.type == DSV4_EV_FINISHED;
        dsv4_event_clear(&ev);
        if (fin) break;
    }
    if (progress_shown) progress_clear();
    end_reasoning(a);
    dsv4_request_release(r);
    return 0;
}

static void print_stats(const answer *a) {
    const dsv4_usage *u = &a->usage;
    if (a->why == DSV4_FINISH_ERROR) fprintf(stderr, "error: %s\n", a->error);
    fprintf(stderr,
            "%s[%lld tokens, %.1f tok/s; prompt %lld tokens (%lld cached), %.2f s to first token; seed %llu; "
            "%s]%s\n",
            g_tty_err ? "\033[2m" : "", (long long)u->completion_tokens, u->decode_tps,
            (long long)u->prompt_tokens, (long long)u->cached_tokens, u->ttft_s, (unsigned long long)u->seed,
            dsv4_finish_reason_name(a->why), g_tty_err ? "\033[0m" : "");
}

static void answer_free(answer *a) {
    dsv4_chat_buf_free(&a->content);
    dsv4_chat_buf_free(&a->reasoning);
}

static void install_sigint(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_sigint;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = 0; /* no SA_RESTART: a read at the prompt returns EINTR */
    sigaction(SIGINT, &sa, NULL);
}

/* Renders MESSAGES and fills the request fields for a chat turn; *prompt is
 * malloc'd and must outlive the submit. */
static int chat_params(const gen_opts *o, int thinking, json_t *messages, char **prompt,
                       dsv4_request_params *p) {
    dsv4_chat_opts co;
    dsv4_chat_opts_default(&co);
    co.mode = thinking ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    dsv4_err err = {{0}};
    size_t len = 0;
    if (dsv4_chat_render(messages, NULL, &co, prompt, &len, &err)) {
        fprintf(stderr, "dsv4 %s: %s\n", o->cmd, err.msg);
        return -1;
    }
    dsv4_request_params_default(p);
    p->prompt_text = *prompt;
    p->prompt_text_len = len;
    p->text_flags = 0; /* the rendered prompt spells its special tokens */
    p->output = DSV4_OUTPUT_CHAT;
    p->start_mode =
        dsv4_chat_prompt_opens_thinking(*prompt, len) ? DSV4_CHAT_MODE_THINKING : DSV4_CHAT_MODE_CHAT;
    p->sampling = o->sp;
    p->max_tokens = o->max_tokens;
    p->want_progress = 1;
    p->client = o->cmd;
    return 0;
}

static json_t *message(const char *role, const char *content) {
    return json_pack("{s:s, s:s}", "role", role, "content", content);
}

/* ----- dsv4 generate ----- */
int dsv4_cmd_generate(int argc, char **argv) {
    gen_opts o;
    int rc = parse_opts(&o, argc, argv, 0);
    if (rc) {
        free(o.sets);
        return rc == 1 ? 0 : 2;
    }
    g_tty_err = isatty(2);
    g_tty_out = isatty(1);
    session ss;
    if (session_open(&ss, &o)) {
        free(o.sets);
        return 1;
    }
    install_sigint();
    dsv4_request_params p;
    char *prompt = NULL;
    int32_t *ids = NULL;
    rc = 1;
    if (o.chat) {
        json_t *msgs = json_array();
        if (o.system) json_array_append_new(msgs, message("system", o.system));
        json_array_append_new(msgs, message("user", o.prompt));
        int bad = chat_params(&o, o.thinking, msgs, &prompt, &p);
        json_decref(msgs);
        if (bad) goto done;
    } else {
        /* raw completion: BOS, then the text (special tokens in it are honoured) */
        dsv4_ids v = {0};
        dsv4_err err = {{0}};
        if (dsv4_ids_push(&v, ss.info.bos_id, &err) ||
            dsv4_tokenizer_encode(ss.tok, o.prompt, strlen(o.prompt), 0, &v, &err)) {
            fprintf(stderr, "dsv4 generate: prompt: %s\n", err.msg);
            dsv4_ids_free(&v);
            goto done;
        }
        ids = v.ids;
        dsv4_request_params_default(&p);
        p.prompt_ids = ids;
        p.n_prompt = (int)v.len;
        p.sampling = o.sp;
        p.max_tokens = o.max_tokens;
        p.want_progress = 1;
        p.client = "generate";
    }
    answer a;
    if (run_request(&ss, &o, &p, &a) == 0) {
        fputc('\n', stdout);
        fflush(stdout);
        print_stats(&a);
        rc = a.why == DSV4_FINISH_ERROR ? 1 : a.why == DSV4_FINISH_CANCELLED ? 130 : 0;
        answer_free(&a);
    }
done:
    free(prompt);
    free(ids);
    session_close(&ss);
    free(o.sets);
    return rc;
}

/* ----- dsv4 chat ----- */
static json_t *new_conversation(const gen_opts *o) {
    json_t *m = json_array();
    if (o->system) json_array_append_new(m, message("system", o->system));
    return m;
}

int dsv4_cmd_chat(int argc, char **argv) {
    gen_opts o;
    int rc = parse_opts(&o, argc, argv, 1);
    if (rc) {
        free(o.sets);
        return rc == 1 ? 0 : 2;
    }
    g_tty_err = isatty(2);
    g_tty_out = isatty(1);
    int tty_in = isatty(0);
    session ss;
    if (session_open(&ss, &o)) {
        free(o.sets);
        return 1;
    }
    install_sigint();
    int thinking = o.thinking;
    json_t *msgs = new_conversation(&o);
    if (tty_in)
        fprintf(stderr, "dsv4 chat on %s (%s mode). /think toggles thinking, /reset, /quit.\n",
                ss.info.model_name, thinking ? "thinking" : "chat");
    char *line = NULL;
    size_t cap = 0;
    int interrupts = 0;
    rc = 0;
    for (;;) {
        if (tty_in) {
            fputs(thinking ? "think> " : "> ", stdout);
            fflush(stdout);
        }
        g_interrupted = 0;
        errno = 0;
        ssize_t n = getline(&line, &cap, stdin);
        if (n < 0) {
            if (g_interrupted || errno == EINTR) {
                clearerr(stdin);
                if (++interrupts >= 2) {
                    fputc('\n', stdout);
                    break;
                }
                fprintf(stderr, "\n(Ctrl-C again or /quit to leave)\n");
                continue;
            }
            if (tty_in) fputc('\n', stdout);
            break; /* EOF */
        }
        interrupts = 0;
        while (n > 0 && (line[n - 1] == '\n' || line[n - 1] == '\r'))
            line[--n] = 0;
        if (n == 0) continue;
        if (!strcmp(line, "/quit") || !strcmp(line, "/exit")) break;
        if (!strcmp(line, "/reset")) {
            json_decref(msgs);
            msgs = new_conversation(&o);
            fprintf(stderr, "(conversation reset)\n");
            continue;
        }
        if (!strcmp(line, "/think")) {
            thinking = !thinking;
            fprintf(stderr, "(thinking %s)\n", thinking ? "on" : "off");
            continue;
        }
        if (!strcmp(line, "/help")) {
            fprintf(
                stderr,
                "/think toggles thinking mode, /reset starts over, /quit leaves; Ctrl-C stops an answer\n");
            continue;
        }
        if (line[0] == '/') {
            fprintf(stderr, "unknown command %s (try /help)\n", line);
            continue;
        }
        size_t bad_at;
        if (dsv4_utf8_validate(line, (size_t)n, &bad_at)) {
            fprintf(stderr, "input is not valid UTF-8 (byte %zu); line ignored\n", bad_at);
            continue;
        }
        json_array_append_new(msgs, message("user", line));
        char *prompt = NULL;
        dsv4_request_params p;
        answer a;
        if (chat_params(&o, thinking, msgs, &prompt, &p) || run_request(&ss, &o, &p, &a)) {
            json_array_remove(msgs, json_array_size(msgs) - 1); /* the turn did not happen */
            free(prompt);
            continue;
        }
        free(prompt);
        fputc('\n', stdout);
        fflush(stdout);
        if (a.why == DSV4_FINISH_CANCELLED) fprintf(stderr, "(interrupted)\n");
        print_stats(&a);
        if (a.why == DSV4_FINISH_ERROR) {
            json_array_remove(msgs, json_array_size(msgs) - 1);
        } else {
            /* keep what was shown; the renderer drops earlier reasoning itself */
            json_t *m = message("assistant", a.content.data ? a.content.data : "");
            if (a.reasoning.len) json_object_set_new(m, "reasoning_content", json_string(a.reasoning.data));
            json_array_append_new(msgs, m);
        }
        answer_free(&a);
        g_interrupted = 0;
    }
    free(line);
    json_decref(msgs);
    session_close(&ss);
    free(o.sets);
    return rc;
}
