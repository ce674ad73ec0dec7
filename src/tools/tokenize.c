/* tools/tokenize: `dsv4 tokenize` and `dsv4 detokenize` (docs/TOKENIZER.md). */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "text/tokenizer.h"
#include "tools/commands.h"
#include "util/paths.h"

typedef struct {
    const char *model, *tokenizer, *bench;
    int lines, no_special, lossy, raw, skip_special, repeat;
} tok_opts;

static void usage_tokenize(FILE *f) {
    fprintf(
        f, "usage: dsv4 tokenize [--model DIR | --tokenizer FILE] [--lines] [--no-special] [--lossy]\n"
           "       dsv4 tokenize [--model DIR | --tokenizer FILE] --bench FILE [--repeat N]\n"
           "Reads UTF-8 text on stdin and prints its token ids, comma-separated, on one line.\n"
           "  --lines       encode each input line alone (its trailing \"\\n\" removed; a \"\\r\" before it\n"
           "                is kept and encoded) and print one line of ids per input line\n"
           "  --no-special  treat added/special tokens such as <\xef\xbd\x9cUser\xef\xbd\x9c> as plain text "
           "(for untrusted text)\n"
           "  --lossy       replace invalid UTF-8 by U+FFFD instead of failing\n"
           "  --bench FILE  time encoding FILE (best of --repeat N runs, default 3) and print MB/s\n"
           "Without --model/--tokenizer: $DSV4_TOKENIZER, else data/tokenizer/tokenizer.json next to the "
           "binary.\n");
}

static void usage_detokenize(FILE *f) {
    fprintf(f, "usage: dsv4 detokenize [--model DIR | --tokenizer FILE] [--lines] [--skip-special] [--raw]\n"
               "Reads token ids (separated by commas and/or whitespace; [ ] are ignored) on stdin and writes "
               "the text.\n"
               "  --lines         each input line is one sequence; write one output line per input line\n"
               "  --skip-special  leave out tokens marked special\n"
               "  --raw           write the bytes as they are (no U+FFFD for invalid UTF-8)\n");
}


static int parse_opts(const char *cmd, int argc, char **argv, tok_opts *o, int detok) {
    memset(o, 0, sizeof *o);
    o->repeat = 3;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            detok ? usage_detokenize(stdout) : usage_tokenize(stdout);
            return 1;
        } else if (!strcmp(a, "--model") && has_val)
            o->model = argv[++i];
        else if (!strcmp(a, "--tokenizer") && has_val)
            o->tokenizer = argv[++i];
        else if (!strcmp(a, "--lines"))
            o->lines = 1;
        else if (!detok && !strcmp(a, "--no-special"))
            o->no_special = 1;
        else if (!detok && !strcmp(a, "--lossy"))
            o->lossy = 1;
        else if (!detok && !strcmp(a, "--bench") && has_val)
            o->bench = argv[++i];
        else if (!detok && !strcmp(a, "--repeat") && has_val) {
            char *end;
            long r = strtol(argv[++i], &end, 10);
            if (*end || r < 1 || r > 1000) {
                fprintf(stderr, "dsv4 %s: --repeat wants an integer in 1..1000, got '%s'\n", cmd, argv[i]);
                return -1;
            }
            o->repeat = (int)r;
        } else if (detok && !strcmp(a, "--skip-special"))
            o->skip_special = 1;
        else if (detok && !strcmp(a, "--raw"))
            o->raw = 1;
        else {
            fprintf(stderr, "dsv4 %s: unknown or incomplete option '%s' (see --help)\n", cmd, a);
            return -1;
        }
    }
    if (o->model && o->tokenizer) {
        fprintf(stderr, "dsv4 %s: give --model or --tokenizer, not both\n", cmd);
        return -1;
    }
    return 0;
}

static dsv4_tokenizer *open_tokenizer(const char *cmd, const tok_opts *o) {
    char path[4200];
    const char *p = o->tokenizer ? o->tokenizer : o->model;
    if (!p) {
        if (dsv4_default_tokenizer_path(path, sizeof path)) {
            fprintf(stderr,
                    "dsv4 %s: no tokenizer given and none found (set --tokenizer FILE, --model DIR or "
                    "$DSV4_TOKENIZER)\n",
                    cmd);
            return NULL;
        }
        p = path;
    }
    dsv4_tokenizer *tok;
    dsv4_err err;
    if (dsv4_tokenizer_load(&tok, p, &err)) {
        fprintf(stderr, "dsv4 %s: %s\n", cmd, err.msg);
        return NULL;
    }
    return tok;
}

static int read_all(FILE *f, dsv4_bytes *b, const char *what, const char *cmd) {
    char buf[65536];
    size_t n;
    dsv4_err err;
    while ((n = fread(buf, 1, sizeof buf, f)) > 0)
        if (dsv4_bytes_append(b, buf, n, &err)) {
            fprintf(stderr, "dsv4 %s: reading %s: %s\n", cmd, what, err.msg);
            return -1;
        }
    if (ferror(f)) {
        fprintf(stderr, "dsv4 %s: reading %s: %s\n", cmd, what, strerror(errno));
        return -1;
    }
    return dsv4_bytes_append(b, "", 0, &err);
}

static void print_ids(const dsv4_ids *ids) {
    for (size_t i = 0; i < ids->len; i++)
        printf(i ? ",%d" : "%d", ids->ids[i]);
    putchar('\n');
}

static double thread_cpu_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int run_bench(const dsv4_tokenizer *tok, const tok_opts *o, unsigned flags) {
    FILE *f = fopen(o->bench, "rb");
    if (!f) {
        fprintf(stderr, "dsv4 tokenize: %s: %s\n", o->bench, strerror(errno));
        return 1;
    }
    dsv4_bytes text = {0};
    int rc = read_all(f, &text, o->bench, "tokenize");
    fclose(f);
    if (rc) {
        dsv4_bytes_free(&text);
        return 1;
    }
    dsv4_ids ids = {0};
    dsv4_err err;
    double best = 1e30, first = 0, best_cpu = 1e30;
    for (int r = 0; r < o->repeat; r++) {
        ids.len = 0;
        double t0 = dsv4_now(), c0 = thread_cpu_seconds();
        if (dsv4_tokenizer_encode(tok, text.data, text.len, flags, &ids, &err)) {
            fprintf(stderr, "dsv4 tokenize: %s: %s\n", o->bench, err.msg);
            dsv4_ids_free(&ids);
            dsv4_bytes_free(&text);
            return 1;
        }
        double dt = dsv4_now() - t0, dc = thread_cpu_seconds() - c0;
        if (r == 0) first = dt;
        if (dt < best) best = dt;
        if (dc < best_cpu) best_cpu = dc;
    }
    /* CPU time is reported too: on a shared machine wall time includes waiting */
    printf("bench %s: %zu bytes -> %zu tokens (%.2f bytes/token); first run %.1f ms = %.1f MB/s; best of %d: "
           "wall %.1f ms = %.1f MB/s, cpu %.1f ms = %.1f MB/s\n",
           o->bench, text.len, ids.len, ids.len ? (double)text.len / (double)ids.len : 0.0, first * 1e3,
           (double)text.len / first / 1e6, o->repeat, best * 1e3, (double)text.len / best / 1e6,
           best_cpu * 1e3, (double)text.len / best_cpu / 1e6);
    dsv4_ids_free(&ids);
    dsv4_bytes_free(&text);
    return 0;
}

int dsv4_cmd_tokenize(int argc, char **argv) {
    tok_opts o;
    int r = parse_opts("tokenize", argc, argv, &o, 0);
    if (r) return r > 0 ? 0 : 2;
    dsv4_tokenizer *tok = open_tokenizer("tokenize", &o);
    if (!tok) return 1;
    unsigned flags = (o.no_special ? DSV4_TOK_NO_ADDED : 0) | (o.lossy ? DSV4_TOK_LOSSY : 0);
    if (o.bench) {
        int rc = run_bench(tok, &o, flags);
        dsv4_tokenizer_free(tok);
        return rc;
    }
    dsv4_bytes in = {0};
    dsv4_ids ids = {0};
    dsv4_err err;
    int rc = 0;
    if (read_all(stdin, &in, "stdin", "tokenize")) {
        rc = 1;
        goto done;
    }
    if (!o.lines) {
        if (dsv4_tokenizer_encode(tok, in.data, in.len, flags, &ids, &err)) {
            fprintf(stderr, "dsv4 tokenize: stdin: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        print_ids(&ids);
        goto done;
    }
    size_t start = 0, line = 1;
    while (start < in.len) {
        const char *nl = memchr(in.data + start, '\n', in.len - start);
        size_t end = nl ? (size_t)(nl - in.data) : in.len;
        ids.len = 0;
        if (dsv4_tokenizer_encode(tok, in.data + start, end - start, flags, &ids, &err)) {
            fprintf(stderr, "dsv4 tokenize: stdin line %zu: %s\n", line, err.msg);
            rc = 1;
            goto done;
        }
        print_ids(&ids);
        start = end + 1;
        line++;
    }
done:
    if (fflush(stdout)) {
        fprintf(stderr, "dsv4 tokenize: writing stdout: %s\n", strerror(errno));
        rc = 1;
    }
    dsv4_ids_free(&ids);
    dsv4_bytes_free(&in);
    dsv4_tokenizer_free(tok);
    return rc;
}

/* Parses the ids of S[0..n) into IDS; separators are commas, whitespace and
 * brackets.  Errors name the 1-based position of the bad item. */
static int parse_ids(const char *s, size_t n, dsv4_ids *ids, const dsv4_tokenizer *tok, char *msg,
                     size_t msgcap) {
    size_t i = 0, item = 0;
    while (i < n) {
        char c = s[i];
        if (c == ',' || c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '[' || c == ']') {
            i++;
            continue;
        }
        size_t j = i;
        while (j < n && !(s[j] == ',' || s[j] == ' ' || s[j] == '\t' || s[j] == '\n' || s[j] == '\r' ||
                          s[j] == '[' || s[j] == ']'))
            j++;
        item++;
        int neg = 0;
        size_t k = i;
        if (s[k] == '-') neg = 1, k++;
        long long v = 0;
        int ok = k < j;
        for (; k < j && ok; k++) {
            if (s[k] < '0' || s[k] > '9')
                ok = 0;
            else if ((v = v * 10 + (s[k] - '0')) > 1LL << 40)
                ok = 0;
        }
        if (!ok) {
            snprintf(msg, msgcap, "item %zu '%.*s' is not a token id", item, (int)(j - i > 40 ? 40 : j - i),
                     s + i);
            return -1;
        }
        if (neg) v = -v;
        if (v < 0 || v >= dsv4_tokenizer_n_vocab(tok)) {
            snprintf(msg, msgcap, "item %zu: token id %lld is out of range [0, %d)", item, v,
                     dsv4_tokenizer_n_vocab(tok));
            return -1;
        }
        dsv4_err err;
        if (dsv4_ids_push(ids, (int32_t)v, &err)) {
            snprintf(msg, msgcap, "%.200s", err.msg);
            return -1;
        }
        i = j;
    }
    return 0;
}

int dsv4_cmd_detokenize(int argc, char **argv) {
    tok_opts o;
    int r = parse_opts("detokenize", argc, argv, &o, 1);
    if (r) return r > 0 ? 0 : 2;
    dsv4_tokenizer *tok = open_tokenizer("detokenize", &o);
    if (!tok) return 1;
    unsigned flags = (o.skip_special ? DSV4_TOK_SKIP_SPECIAL : 0) | (o.raw ? DSV4_TOK_RAW : 0);
    dsv4_bytes in = {0}, text = {0};
    dsv4_ids ids = {0};
    dsv4_err err;
    char msg[256];
    int rc = 0;
    if (read_all(stdin, &in, "stdin", "detokenize")) {
        rc = 1;
        goto done;
    }
    size_t start = 0, line = 1;
    while (start < in.len || (start == 0 && in.len == 0)) {
        const char *nl = o.lines ? memchr(in.data + start, '\n', in.len - start) : NULL;
        size_t end = nl ? (size_t)(nl - in.data) : in.len;
        ids.len = 0;
        text.len = 0;
        if (parse_ids(in.data + start, end - start, &ids, tok, msg, sizeof msg)) {
            if (o.lines)
                fprintf(stderr, "dsv4 detokenize: stdin line %zu: %s\n", line, msg);
            else
                fprintf(stderr, "dsv4 detokenize: stdin: %s\n", msg);
            rc = 1;
            goto done;
        }
        if (dsv4_tokenizer_decode(tok, ids.ids, ids.len, flags, &text, &err)) {
            fprintf(stderr, "dsv4 detokenize: %s\n", err.msg);
            rc = 1;
            goto done;
        }
        fwrite(text.data, 1, text.len, stdout);
        if (o.lines) putchar('\n');
        start = end + 1;
        line++;
        if (!o.lines) break;
    }
done:
    if (fflush(stdout)) {
        fprintf(stderr, "dsv4 detokenize: writing stdout: %s\n", strerror(errno));
        rc = 1;
    }
    dsv4_ids_free(&ids);
    dsv4_bytes_free(&in);
    dsv4_bytes_free(&text);
    dsv4_tokenizer_free(tok);
    return rc;
}
