/* tools/render: `dsv4 render`, the V4 chat prompt for a messages file
 * (docs/CHAT_FORMAT.md), as text or as token ids. */
#include <errno.h>
#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "text/chat.h"
#include "text/tokenizer.h"
#include "tools/commands.h"
#include "util/paths.h"

static void usage_render(FILE *f) {
    fprintf(
        f,
        "usage: dsv4 render --messages FILE.json [--tools FILE.json] [--thinking] [--effort none|high|max]\n"
        "                   [--keep-thinking] [--no-bos] [--ids [--tokenizer FILE]]\n"
        "Prints the DeepSeek-V4 prompt for a conversation exactly (no newline added).\n"
        "FILE is a list of messages, or an object with \"messages\" and optionally \"tools\", \"thinking\",\n"
        "\"reasoning_effort\", \"drop_thinking\", \"response_format\" (these override the flags).\n"
        "  --tools FILE     an OpenAI tools list ([{\"type\": \"function\", \"function\": {...}}])\n"
        "  --thinking       thinking mode (default: chat mode)\n"
        "  --effort E       reasoning effort: none (default), high, max (max adds a preamble in thinking "
        "mode)\n"
        "  --keep-thinking  keep the reasoning of earlier turns (drop_thinking off)\n"
        "  --no-bos         leave out <\xef\xbd\x9c"
        "begin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>\n"
        "  --ids            print the token ids, comma-separated, one line\n"
        "  --tokenizer F    tokenizer.json for --ids (default: $DSV4_TOKENIZER, else data/tokenizer next to\n"
        "                   the binary)\n");
}

static json_t *load_json(const char *path, const char *what) {
    json_error_t je;
    json_t *v = json_load_file(path, JSON_REJECT_DUPLICATES | JSON_DECODE_ANY, &je);
    if (!v) {
        if (je.line < 0 || je.position == 0)
            fprintf(stderr, "dsv4 render: %s %s: %s\n", what, path, je.text);
        else
            fprintf(stderr, "dsv4 render: %s %s:%d:%d: %s\n", what, path, je.line, je.column, je.text);
    }
    return v;
}


static int print_ids(const char *tok_path, const char *prompt, size_t len) {
    char path[4200];
    if (!tok_path) {
        if (dsv4_default_tokenizer_path(path, sizeof path)) {
            fprintf(stderr,
                    "dsv4 render: --ids needs a tokenizer: give --tokenizer FILE or set $DSV4_TOKENIZER\n");
            return 1;
        }
        tok_path = path;
    }
    dsv4_err err = {{0}};
    dsv4_tokenizer *tok = NULL;
    if (dsv4_tokenizer_load(&tok, tok_path, &err)) {
        fprintf(stderr, "dsv4 render: %s\n", err.msg);
        return 1;
    }
    dsv4_ids ids = {0};
    /* special tokens in the rendered text are matched: the prompt is ours */
    int rc = dsv4_tokenizer_encode(tok, prompt, len, 0, &ids, &err);
    if (rc)
        fprintf(stderr, "dsv4 render: encoding the prompt: %s\n", err.msg);
    else {
        for (size_t i = 0; i < ids.len; i++)
            printf(i ? ",%d" : "%d", ids.ids[i]);
        putchar('\n');
    }
    dsv4_ids_free(&ids);
    dsv4_tokenizer_free(tok);
    return rc ? 1 : 0;
}

int dsv4_cmd_render(int argc, char **argv) {
    const char *messages_path = NULL, *tools_path = NULL, *tok_path = NULL, *effort = NULL;
    int ids = 0;
    dsv4_chat_opts opts;
    dsv4_chat_opts_default(&opts);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        int has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            usage_render(stdout);
            return 0;
        } else if (!strcmp(a, "--messages") && has_val)
            messages_path = argv[++i];
        else if (!strcmp(a, "--tools") && has_val)
            tools_path = argv[++i];
        else if (!strcmp(a, "--tokenizer") && has_val)
            tok_path = argv[++i];
        else if (!strcmp(a, "--effort") && has_val)
            effort = argv[++i];
        else if (!strcmp(a, "--thinking"))
            opts.mode = DSV4_CHAT_MODE_THINKING;
        else if (!strcmp(a, "--keep-thinking"))
            opts.drop_thinking = 0;
        else if (!strcmp(a, "--no-bos"))
            opts.add_bos = 0;
        else if (!strcmp(a, "--ids"))
            ids = 1;
        else {
            fprintf(stderr, "dsv4 render: unknown or incomplete option '%s' (see --help)\n", a);
            return 2;
        }
    }
    if (!messages_path) {
        fprintf(stderr, "dsv4 render: --messages FILE is required (see --help)\n");
        return 2;
    }
    if (tok_path && !ids) {
        fprintf(stderr, "dsv4 render: --tokenizer is only used with --ids\n");
        return 2;
    }
    dsv4_err err = {{0}};
    if (effort && dsv4_chat_effort_parse(effort, &opts.effort, &err)) {
        fprintf(stderr, "dsv4 render: --effort: %s\n", err.msg);
        return 2;
    }
    json_t *doc = load_json(messages_path, "messages file");
    if (!doc) return 1;
    json_t *tools = NULL;
    if (tools_path && !(tools = load_json(tools_path, "tools file"))) {
        json_decref(doc);
        return 1;
    }
    char *prompt = NULL;
    size_t len = 0;
    int rc = 0;
    if (dsv4_chat_render_doc(doc, tools, &opts, &prompt, &len, &err)) {
        /* name the file the faulty part came from */
        int from_tools = tools_path && !strncmp(err.msg, "tools", 5);
        fprintf(stderr, "dsv4 render: %s: %s\n", from_tools ? tools_path : messages_path, err.msg);
        rc = 1;
    } else if (ids) {
        rc = print_ids(tok_path, prompt, len);
    } else if (fwrite(prompt, 1, len, stdout) != len || fflush(stdout)) {
        fprintf(stderr, "dsv4 render: writing stdout: %s\n", strerror(errno));
        rc = 1;
    }
    free(prompt);
    json_decref(tools);
    json_decref(doc);
    return rc;
}
