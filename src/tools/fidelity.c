/* tools/fidelity: `dsv4 fidelity SUITE` -- dispatch to the fidelity suites
 * (src/fidelity/): indexer-recall and ab measure switches against `exact` on
 * the local model; needle and multiturn measure long-context recall of the
 * local model or of any OpenAI-compatible endpoint.  docs/FIDELITY.md. */
#include <stdio.h>
#include <string.h>

#include "fidelity/ab.h"
#include "fidelity/suite.h"
#include "tools/commands.h"

static void usage(FILE *f) {
    fprintf(f, "usage: dsv4 fidelity SUITE [options]   (dsv4 fidelity SUITE --help)\n"
               "  indexer-recall  recall@k of the indexer's picks under switches vs exact, by layer and length\n"
               "  ab              one row per switch: logit diff, KL, argmax, recall, routing invariant, speed\n"
               "  needle          needle-in-a-haystack over lengths x depths (local model or --endpoint)\n"
               "  multiturn       a fact from turn 1 recalled after tool calls and long tool results\n");
}

int dsv4_cmd_fidelity(int argc, char **argv) {
    if (argc < 2) {
        usage(stderr);
        return 2;
    }
    const char *s = argv[1];
    if (!strcmp(s, "--help") || !strcmp(s, "-h")) return usage(stdout), 0;
    if (!strcmp(s, "indexer-recall")) return fid_cmd_indexer_recall(argc - 1, argv + 1);
    if (!strcmp(s, "ab")) return fid_cmd_ab(argc - 1, argv + 1);
    if (!strcmp(s, "needle")) return fid_cmd_needle(argc - 1, argv + 1);
    if (!strcmp(s, "multiturn")) return fid_cmd_multiturn(argc - 1, argv + 1);
    fprintf(stderr, "dsv4 fidelity: unknown suite '%s' (indexer-recall, ab, needle, multiturn)\n", s);
    return 2;
}
