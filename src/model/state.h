/* model/state: everything one sequence carries between forward calls (spec §3.2).
 *
 * Owns, per layer (trunk layers, then MTP layers):
 *   - the K=V window ring: `window` rows of head_dim floats, slot p mod window, with
 *     the position each slot holds (-1 = empty), so a row is used only if it is
 *     really within the window of the query;
 *   - compressor state (ratio != 0; a second one for the indexer on ratio-4 layers):
 *     kv and score buffers [coff*ratio][coff*dim] in the decode layout of spec §2.5
 *     (ratio 4: rows [0,r) = previous window, [r,2r) = current window; other ratios:
 *     rows [0,r)), and the growing array of emitted compressed rows [n][dim];
 * plus the token history, the final HC state of the last token (the MTP draft's
 * input) and truncation checkpoints.
 *
 * Truncation (dsv4_state_rewind): compressed rows only ever append, so dropping
 * rows past a length is free.  The ring and the compressor buffers are not
 * invertible, so they are checkpointed every `snapshot_every` tokens (a multiple of
 * lcm(window, ratios), where the ratio-128-style buffers are empty and only the
 * ring, the ratio-4 previous-window rows and the last HC state matter).  Rewinding
 * to L restores the checkpoint C <= L and leaves tokens C..L-1 for the caller to
 * re-run (it keeps them in the history).  Position 0 needs no stored checkpoint.
 *
 * Memory: the float buffers (rings, compressor buffers, compressed rows, last HC
 * state) live in the memory of the backend given to dsv4_state_new_on (device memory
 * on a GPU; the CPU backend's memory is host memory), or in host memory when no
 * backend is given.  Ring slot positions, the token history and checkpoints stay in
 * host memory; checkpoints, clone and serialization move the buffers through the
 * backend's download/upload/copy.  Lifetime: _new .. _free (before the backend's
 * free).  Threading: the owning engine thread only.
 */
#ifndef DSV4_MODEL_STATE_H
#define DSV4_MODEL_STATE_H

#include <stddef.h>
#include <stdint.h>

#include "model/config.h"
#include "util/err.h"

typedef struct dsv4_comp_state {
    int ratio, coff, dim;      /* dim = width of one emitted row */
    float *kv, *score;         /* [coff*ratio][coff*dim] */
    float *rows;               /* [cap][dim] emitted rows */
    int64_t n_rows, cap;
} dsv4_comp_state;

typedef struct dsv4_layer_state {
    float *ring;               /* [window][head_dim] */
    int64_t *ring_pos;         /* [window], -1 = empty */
    int has_comp, has_idx;
    dsv4_comp_state comp;      /* main compressor, dim = head_dim */
    dsv4_comp_state icomp;     /* indexer compressor, dim = index_head_dim */
} dsv4_layer_state;

typedef struct dsv4_checkpoint {
    int64_t pos;
    float *f;                  /* rings, ratio-4 previous-window rows (kv, score), last HC state */
    int64_t *ipos;             /* ring slot positions of every layer */
    size_t nf, ni;
} dsv4_checkpoint;

typedef struct dsv4_state {
    struct dsv4_backend *be;   /* owner of the float buffers; NULL = host memory */
    int n_layers;              /* trunk + MTP */
    int window, head_dim, hc_dim; /* hc_dim = hc_mult * dim */
    int64_t len;               /* tokens processed */
    int32_t *tokens;           /* history [len] (capacity tok_cap) */
    int64_t tok_cap;
    float *last_x;             /* [hc_dim] HC state after the last token, before hc_head */
    dsv4_layer_state *layers;
    int64_t snapshot_every;
    dsv4_checkpoint *ckpt;
    int n_ckpt, ckpt_cap;
    int broken;                /* a failed step could not be undone (forward.c): the buffers do not
                                * match the length; forward, clone, serialize and rewinds to a length
                                * > 0 refuse it, a reset (a rewind to 0) clears it */
} dsv4_state;

/* lcm(window, every ratio != 0): checkpoints are valid at multiples of it. */
int64_t dsv4_state_period(const dsv4_config *cfg);

/* snapshot_every <= 0: the default (smallest multiple of the period >= 512). */
int dsv4_state_new(dsv4_state **out, const dsv4_config *cfg, int64_t snapshot_every, dsv4_err *err);
/* The same with the float buffers in `be`'s memory (be NULL = host memory). */
int dsv4_state_new_on(dsv4_state **out, const dsv4_config *cfg, int64_t snapshot_every, struct dsv4_backend *be,
                      dsv4_err *err);
void dsv4_state_free(dsv4_state *s);
/* Back to the empty sequence (position 0). */
void dsv4_state_reset(dsv4_state *s);

/* Ensures room for n more compressed rows / tokens (amortised doubling). */
int dsv4_state_reserve(dsv4_state *s, int64_t more_tokens, dsv4_err *err);

/* Records a checkpoint at the current length (call when len % snapshot_every == 0), then thins
 * the older ones: the DSV4_CKPT_DENSE newest stay, and further back each doubling of the
 * distance keeps half as many (state.c ckpt_keep), so a long sequence holds O(log) checkpoints
 * (each is the rings, the ratio-4 buffers' kept rows and the HC state: 12.5 MB at V4-Flash's
 * shapes, one every 512 tokens, had made 25 GB of host memory at 1M tokens) and a rewind far
 * back re-runs at most ~2/DSV4_CKPT_DENSE of the distance. */
#define DSV4_CKPT_DENSE 16
int dsv4_state_checkpoint(dsv4_state *s, dsv4_err *err);

/* Rewinds to the nearest checkpoint C <= len and returns C in *resume_from; the
 * caller re-runs tokens[C..len).  Errors for len < 0 or len > s->len. */
int dsv4_state_rewind(dsv4_state *s, int64_t len, int64_t *resume_from, dsv4_err *err);

/* The length and the compressor row counts that follow from it (n_rows = len / ratio), and
 * nothing else: for a caller whose writes past len disturbed nothing the state keeps (a failed
 * step that closed no window; forward.c). */
void dsv4_state_set_len(dsv4_state *s, int64_t len);

/* Deep copy (in the source's backend). */
int dsv4_state_clone(const dsv4_state *src, dsv4_state **out, dsv4_err *err);

/* Bytes held (allocated capacity of every buffer). */
size_t dsv4_state_bytes(const dsv4_state *s);

/* Self-contained serialization; `tag` (e.g. a hash of model shape and numerics)
 * is stored and must match on load. */
int dsv4_state_serialize(const dsv4_state *s, uint64_t tag, void **blob, size_t *n, dsv4_err *err);
int dsv4_state_deserialize(dsv4_state *s, uint64_t tag, const void *blob, size_t n, dsv4_err *err);

#endif
