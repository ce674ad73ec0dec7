/* fidelity/ab: engine-level fidelity measurements against the `exact` profile.
 *
 * Owns `dsv4 fidelity indexer-recall` (recall@k of the lightning indexer's
 * selection under some switches vs exact, per compressed-sparse layer and
 * context length; table, JSON, SVG plot) and `dsv4 fidelity ab` (one row per
 * switch: logit mean |diff| and KL vs exact, argmax agreement, indexer
 * recall@k, the routing invariant, speed).  Both open engines in-process
 * (engine.h) and read picks and routing through the engine's trace.
 * Entry points take argv after the subcommand name (argv[0] = the subcommand)
 * and return a process exit status; errors are one line on stderr.
 */
#ifndef DSV4_FIDELITY_AB_H
#define DSV4_FIDELITY_AB_H

int fid_cmd_indexer_recall(int argc, char **argv);
int fid_cmd_ab(int argc, char **argv);

#endif
