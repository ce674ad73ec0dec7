/* fidelity/suite: placeholder until the suites land. */
#include "fidelity/suite.h"

#include <stdio.h>

int fid_cmd_needle(int argc, char **argv) {
    fprintf(stderr, "dsv4 fidelity needle: not built yet\n");
    return 2;
}
int fid_cmd_multiturn(int argc, char **argv) {
    fprintf(stderr, "dsv4 fidelity multiturn: not built yet\n");
    return 2;
}
