/* tools/fidelity: `dsv4 fidelity` (placeholder dispatch while the suites land). */
#include <stdio.h>
#include <string.h>

#include "tools/commands.h"

int dsv4_cmd_fidelity(int argc, char **argv) {
    fprintf(stderr, "dsv4 fidelity: no subcommand implemented yet\n");
    return 2;
}
