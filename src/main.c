/* dsv4: subcommand dispatch only. */
#include <stdio.h>
#include <string.h>

#include "tools/commands.h"

typedef struct {
    const char *name;
    int (*fn)(int, char **);
    const char *summary;
} command;

static const command COMMANDS[] = {
    {"inspect", dsv4_cmd_inspect, "describe a checkpoint or config: shapes, parameters, bytes, verdict"},
    {"logits", dsv4_cmd_logits, "next-token logits of a token sequence (float32 T x vocab)"},
    {"switches", dsv4_cmd_switches, "list numerics switches and profiles; --measure their distance from exact"},
    {"synth", dsv4_cmd_synth, "write a synthetic checkpoint in the official layout"},
    {"tokenize", dsv4_cmd_tokenize, "text on stdin -> token ids (comma-separated)"},
    {"detokenize", dsv4_cmd_detokenize, "token ids on stdin -> text"},
    {"render", dsv4_cmd_render, "messages JSON -> the DeepSeek-V4 chat prompt (or its token ids)"},
    {"generate", dsv4_cmd_generate, "stream a completion of a prompt (raw, or --chat as a user message)"},
    {"chat", dsv4_cmd_chat, "interactive multi-turn chat in the DeepSeek-V4 format"},
    {"serve", dsv4_cmd_serve, "OpenAI-compatible HTTP server (chat/completions, completions, models, metrics)"},
    {"diff", dsv4_cmd_diff, "compare two numerics/backend SPECs op by op, layer by layer: where a difference enters"},
    {"bench", dsv4_cmd_bench, "prefill/decode throughput, per-op time and bandwidth on a backend (cpu, cuda)"},
    {"opbench", dsv4_cmd_opbench, "time each weight-reading decode op of one layer against the copy bandwidth"},
    {"fidelity", dsv4_cmd_fidelity, "indexer-recall, switch A/B, needle and multi-turn recall (local or any endpoint)"},
};

static void usage(FILE *f) {
    fprintf(f, "usage: dsv4 COMMAND [options]   (dsv4 COMMAND --help for details)\n\ncommands:\n");
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        fprintf(f, "  %-12s %s\n", COMMANDS[i].name, COMMANDS[i].summary);
}

int main(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    if (!strcmp(argv[1], "--help") || !strcmp(argv[1], "-h") || !strcmp(argv[1], "help")) {
        usage(stdout);
        return 0;
    }
    for (size_t i = 0; i < sizeof COMMANDS / sizeof COMMANDS[0]; i++)
        if (!strcmp(argv[1], COMMANDS[i].name)) return COMMANDS[i].fn(argc - 1, argv + 1);
    fprintf(stderr, "dsv4: unknown command '%s'\n", argv[1]);
    usage(stderr);
    return 2;
}
