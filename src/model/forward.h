/* model/forward: the DeepSeek-V4 graph (spec §2), written once against the
 * backend op table.
 *
 * Owns: dsv4_model (bound weights + config + numerics + backend + the run-state
 * buffers every forward call reuses) and the forward pass over a batch of
 * sequences, each appending one or more tokens at its own positions.  A batch is
 * cut into sub-batches of at most max_rows rows and at truncation-checkpoint
 * boundaries; results do not depend on the cut (chunked prefill == prefill).
 * Per layer: mHC pre -> attention (q LoRA, window ring, compressors, indexer, sink
 * attention, grouped output) -> mHC post -> mHC pre -> MoE -> mHC post; then
 * hc_head, norm, head for the rows whose logits are wanted.  The MTP block
 * (spec §2.8) is a separate entry point.
 *
 * Lifetime: dsv4_model_init .. dsv4_model_free; borrows the weights and backend.
 * Threading: one caller at a time (the engine thread); ops use OpenMP inside.
 * Errors: init validates what the hot path relies on (shapes the ops assume,
 * tid2eid entries in range, power-of-two Hadamard widths); forward validates
 * token ids before touching any state, and a failure after that (a backend error,
 * a checkpoint out of memory) takes every sequence of the call back to its length
 * before it, the sub-batches already committed included (by truncation: a restore
 * that fails too is added to the error), so a caller can re-run the same items.
 */
#ifndef DSV4_MODEL_FORWARD_H
#define DSV4_MODEL_FORWARD_H

#include <stdint.h>

#include "backend/backend.h"
#include "model/numerics.h"
#include "model/state.h"
#include "model/weights.h"
#include "util/err.h"

/* Routing/indexer trace: one call per MoE layer and row.  `tag` is the item's tag. */
typedef struct dsv4_route_info {
    void *tag;
    int layer;
    int64_t pos;
    int32_t token;
    int is_hash;
    int k;
    const int32_t *experts;
    const float *weights;   /* as applied: router weights x any output-side scale */
    int n_picks;
    const int32_t *picks;   /* indexer picks of this layer (ratio-4 layers) */
} dsv4_route_info;
typedef void (*dsv4_route_trace_fn)(void *user, const dsv4_route_info *info);

/* Op trace (the layer-diff tool, STYLE "trace hook"): one call after each traced
 * op of a sub-batch with a host copy of its output.  Ops are named
 * "<sublayer>.<op>" ("attn.hc_pre", "indexer.keys", "moe.route", ...); `layer` is
 * the global layer, or -1 for the final head ("head.logits").  Values are rows x
 * width floats (f) and/or ints (ids: indexer picks, chosen experts); n_valid
 * (NULL = all) gives the meaningful prefix of each row (indexer scores and picks
 * are ragged).  Rows are the sub-batch's rows, positions in pos.  Pointers are
 * valid only during the call.  Costs nothing when unset. */
typedef struct dsv4_op_info {
    const char *op;
    int layer;
    int rows, width;
    const float *f;
    const int32_t *ids;
    const int *n_valid;
    const int64_t *pos;
} dsv4_op_info;
typedef void (*dsv4_model_op_trace_fn)(void *user, const dsv4_op_info *info);

typedef struct dsv4_model dsv4_model;

int dsv4_model_init(dsv4_model **out, const dsv4_model_w *w, dsv4_backend *be, const dsv4_numerics *num,
                    int max_rows, dsv4_err *err);
void dsv4_model_free(dsv4_model *m);
void dsv4_model_set_trace(dsv4_model *m, dsv4_route_trace_fn fn, void *user);
const dsv4_numerics *dsv4_model_numerics(const dsv4_model *m);
void dsv4_model_set_op_trace(dsv4_model *m, dsv4_model_op_trace_fn fn, void *user);

typedef struct dsv4_fwd_item {
    dsv4_state *st;
    const int32_t *tokens;
    int n;                  /* >= 1 */
    float *logits;          /* NULL, vocab floats (last row) or n*vocab (all_logits) */
    int all_logits;
    void *tag;              /* handed to the trace */
} dsv4_fwd_item;

/* Runs every item (distinct states).  Items are advanced by n tokens each. */
int dsv4_forward(dsv4_model *m, dsv4_fwd_item *items, int n_items, dsv4_err *err);

/* Truncates st to its first len tokens (0 <= len <= st->len): back to its last checkpoint at or
 * below len, then the history's tokens up to len run again (dsv4_seq_truncate; a failed call's
 * undo).  On error the state is at the checkpoint or part way. */
int dsv4_forward_truncate(dsv4_model *m, dsv4_state *st, int64_t len, dsv4_err *err);

/* Greedy decoding of n_steps tokens from st: step s appends one token (first, then out[s - 1])
 * and out[s] is the argmax of its logits (backend.h's rule: the first of equal values), so
 * out[n_steps - 1] is the next token, not yet appended.  The same values as dsv4_forward one
 * token at a time with the host picking; where the backend has argmax and gather_ids (and no
 * trace is set) the picks stay in backend memory and the host never waits between steps.
 * On error st is back at its length (after more than one step: restored from its last
 * checkpoint and the tokens since run again; if that fails too, the message says so). */
int dsv4_forward_greedy(dsv4_model *m, dsv4_state *st, int32_t first, int n_steps, int32_t *out, dsv4_err *err);

/* MTP draft (spec §2.8): from st's last HC state and the embedding of `token`,
 * at position st->len - 1, through MTP block `mtp_index`; writes vocab logits.
 * Updates only the MTP block's window ring. */
int dsv4_forward_mtp(dsv4_model *m, dsv4_state *st, int mtp_index, int32_t token, float *logits, dsv4_err *err);

#endif
