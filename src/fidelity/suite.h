/* fidelity/suite: long-context recall suites, `dsv4 fidelity needle` and
 * `dsv4 fidelity multiturn`, against the local model or an OpenAI-compatible
 * endpoint (fidelity/client.h).  Entry points take argv after the subcommand
 * name and return a process exit status. */
#ifndef DSV4_FIDELITY_SUITE_H
#define DSV4_FIDELITY_SUITE_H

int fid_cmd_needle(int argc, char **argv);
int fid_cmd_multiturn(int argc, char **argv);

#endif
