/* tools/commands: one entry point per `dsv4` subcommand.
 *
 * Each takes the arguments after the subcommand name (argv[0] is the
 * subcommand) and returns a process exit status.  Every command answers
 * --help.  Errors go to stderr as one line "dsv4 CMD: message".
 */
#ifndef DSV4_TOOLS_COMMANDS_H
#define DSV4_TOOLS_COMMANDS_H

int dsv4_cmd_inspect(int argc, char **argv);
int dsv4_cmd_synth(int argc, char **argv);
int dsv4_cmd_tokenize(int argc, char **argv);
int dsv4_cmd_detokenize(int argc, char **argv);
int dsv4_cmd_render(int argc, char **argv);
int dsv4_cmd_logits(int argc, char **argv);
int dsv4_cmd_switches(int argc, char **argv);
int dsv4_cmd_generate(int argc, char **argv);
int dsv4_cmd_chat(int argc, char **argv);
int dsv4_cmd_serve(int argc, char **argv);
int dsv4_cmd_diff(int argc, char **argv);
int dsv4_cmd_fidelity(int argc, char **argv);
int dsv4_cmd_bench(int argc, char **argv);
int dsv4_cmd_opbench(int argc, char **argv);

#endif
