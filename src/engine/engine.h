/* engine/engine: the narrow public API of dsv4 (STYLE §4).
 *
 * Owns: a loaded model (mmap'd checkpoint, bound weights), its numerics (a
 * profile plus `--set` overrides), a compute backend, and the sequences created
 * from it.  The CLI, the server and the fidelity tools talk to the model only
 * through this header: no tensors, no backend types.
 *
 * Threading: an engine and all its sequences belong to ONE thread (the engine
 * thread).  No function here may be called concurrently on the same engine or
 * on sequences of the same engine.  Compute inside a call is parallel (OpenMP
 * over rows, features and experts); callers never see those threads.  Different
 * engines are independent.
 *
 * Errors: every fallible call returns 0 / -1 and fills a dsv4_err naming the
 * file, option, token or sequence at fault.  Bad input (a model directory, a
 * token id, a switch) never aborts.
 *
 * Positions: a sequence holds tokens 0..len-1.  Appending n tokens runs them at
 * positions len..len+n-1 (a prefill when n > 1, a decode step when n == 1;
 * chunked prefill is simply several appends).  Logits row t is the next-token
 * distribution after the token at position len+t.
 */
#ifndef DSV4_ENGINE_ENGINE_H
#define DSV4_ENGINE_ENGINE_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

typedef struct dsv4_engine dsv4_engine;
typedef struct dsv4_seq dsv4_seq;

/* ----- opening a model ----- */
typedef struct dsv4_engine_opts {
    const char *model_dir;        /* checkpoint directory; NULL = the default model (see below) */
    const char *numerics;         /* profile: "exact" (default when NULL) or "reference" */
    const char *const *sets;      /* n_sets "name=value" switch overrides applied after the profile */
    int n_sets;
    const char *backend;          /* "cpu" (default when NULL), "cuda", or "auto" (cuda if built and present) */
    int n_threads;                /* 0 = OpenMP default */
    int snapshot_every;           /* truncation checkpoint interval in tokens, rounded up to a multiple of
                                     the model's state period; 0 = one period (see dsv4_seq_truncate) */
} dsv4_engine_opts;

/* Resolves the default model directory: $DSV4_DEFAULT_MODEL if set, else
 * `default-model` next to the running binary (found through /proc/self/exe).
 * Writes the path into buf (n bytes).  Fails if no config.json is there. */
int dsv4_engine_default_model(char *buf, size_t n, dsv4_err *err);

/* Opens a model.  opts may be NULL (all defaults). */
int dsv4_engine_open(dsv4_engine **out, const dsv4_engine_opts *opts, dsv4_err *err);
void dsv4_engine_close(dsv4_engine *e); /* all sequences must be freed first */

typedef struct dsv4_engine_info {
    char model_name[64];
    char model_dir[4096];
    char numerics[256];     /* profile name, "+N sets" when overridden */
    int vocab_size;
    int bos_id, eos_id;
    int n_layers, n_mtp;
    int64_t max_position;
    int state_period;       /* truncation without recompute is exact at multiples of this */
} dsv4_engine_info;
void dsv4_engine_get_info(const dsv4_engine *e, dsv4_engine_info *out);

/* ----- sequences ----- */
int dsv4_seq_new(dsv4_engine *e, dsv4_seq **out, dsv4_err *err);
void dsv4_seq_free(dsv4_seq *s);
int64_t dsv4_seq_len(const dsv4_seq *s);
/* Bytes of state this sequence holds now (window rings, compressor buffers,
 * compressed and indexer rows, truncation checkpoints, token history). */
size_t dsv4_seq_state_bytes(const dsv4_seq *s);

/* Appends n >= 1 tokens and runs them.  logits: NULL (none wanted), or
 * vocab_size floats (the last position's), or n * vocab_size floats when
 * all_logits != 0 (row t after token t).  Token ids outside [0, vocab) are an
 * error and leave the sequence unchanged. */
int dsv4_seq_append(dsv4_seq *s, const int32_t *tokens, int n, float *logits, int all_logits, dsv4_err *err);

/* One batched step over several independent sequences (continuous batching):
 * each item appends its tokens (n >= 1; a decode step or a prefill chunk) and
 * optionally receives the logits of its last new position.  Equivalent to
 * calling dsv4_seq_append on each item in turn (results equal to float rounding),
 * but weights are streamed once for all rows.  A sequence may appear once per
 * call.  On error no sequence has changed. */
typedef struct dsv4_step_item {
    dsv4_seq *seq;
    const int32_t *tokens;
    int n;
    float *logits;          /* NULL or vocab_size floats */
} dsv4_step_item;
int dsv4_engine_step(dsv4_engine *e, dsv4_step_item *items, int n_items, dsv4_err *err);

/* Greedy decoding: appends first, then each picked token but the last, n tokens in all;
 * out[i] (n ints) is the argmax of the logits after the i-th appended token, so out[n - 1]
 * is the next token and not yet appended.  Equal to n dsv4_engine_step calls of one token
 * with the host taking the argmax (the first of equal values), but on a backend with device
 * argmax the picks never leave the device between steps, so the host records the next step
 * while the device runs this one.  On error the sequence is back at its length (as after a
 * truncate: from a checkpoint where the failed steps had overwritten its window). */
int dsv4_seq_greedy(dsv4_seq *s, int32_t first, int n, int32_t *out, dsv4_err *err);

/* Truncates a sequence to its first len tokens (len <= current length).
 * Always possible: the state restores the nearest truncation checkpoint at or
 * below len (checkpoints are kept every `snapshot_every` tokens) and re-runs the
 * remaining tokens from its token history; at a checkpoint it costs no compute.
 * Fails only for len < 0 or len > current length (the sequence is unchanged). */
int dsv4_seq_truncate(dsv4_seq *s, int64_t len, dsv4_err *err);

/* Prefix reuse: a new sequence equal to the first len tokens of src
 * (len <= dsv4_seq_len(src); src is unchanged). */
int dsv4_seq_clone(dsv4_seq *src, int64_t len, dsv4_seq **out, dsv4_err *err);

/* Snapshot to a self-contained blob (malloc'd, free with free()) and restore
 * into a fresh or existing sequence of an engine with the same model and
 * numerics.  The blob carries a header checked on restore (model shape,
 * numerics, length); a mismatched or corrupt blob is an error. */
int dsv4_seq_snapshot(const dsv4_seq *s, void **blob, size_t *n_bytes, dsv4_err *err);
int dsv4_seq_restore(dsv4_seq *s, const void *blob, size_t n_bytes, dsv4_err *err);

/* MTP draft (spec §2.8): logits (vocab floats) predicting the token after
 * `next_token`, from the main model's state after the sequence's last token and
 * the embedding of next_token (the token just sampled at position len).  Does
 * not change the sequence's length; advances the MTP block's own window.
 * Fails if the model has no MTP block or the sequence is empty. */
int dsv4_seq_draft(dsv4_seq *s, int32_t next_token, float *logits, dsv4_err *err);

/* ----- invariant tracing (optional) ----- */
/* Called once per MoE layer and token, on the engine thread, during append/step.
 * Pointers are valid only during the call. */
typedef struct dsv4_trace_event {
    const dsv4_seq *seq;
    int layer;              /* global layer id (MTP layers follow the trunk) */
    int64_t pos;            /* token position */
    int32_t token;
    int is_hash;            /* routed by tid2eid */
    int n_experts;          /* num_experts_per_tok */
    const int *experts;     /* chosen expert ids */
    const float *weights;   /* their routing weights as applied (including routed_scaling_factor) */
    int n_picks;            /* indexer picks for this token (ratio-4 layers), else 0 */
    const int32_t *picks;   /* compressed-row indices selected by the indexer */
} dsv4_trace_event;
typedef void (*dsv4_trace_fn)(const dsv4_trace_event *ev, void *user);
void dsv4_engine_set_trace(dsv4_engine *e, dsv4_trace_fn fn, void *user); /* fn NULL = off */

/* ----- op tracing for the layer diff (optional) ----- */
/* Called after each traced op of the forward pass, on the engine thread, with a
 * host copy of its output: op "attn.hc_pre", "attn.q", "attn.kv",
 * "attn.comp_rows", "indexer.keys", "indexer.q", "indexer.scores",
 * "indexer.picks" (ids), "attn.out", "attn.hc_post", "ffn.hc_pre",
 * "moe.router_logits", "moe.route" (ids = experts, f = weights as applied),
 * "moe.out", "ffn.hc_post", "head.logits" (layer -1).  Values: rows x width;
 * n_valid (NULL = width) is the meaningful prefix of each ragged row.  The op
 * sequence depends only on the model and the tokens' positions, not on the
 * numerics, so two engines fed the same tokens emit matching events. */
typedef struct dsv4_op_event {
    const char *op;
    int layer;
    int rows, width;
    const float *f;         /* rows*width floats or NULL */
    const int32_t *ids;     /* rows*width ints or NULL */
    const int *n_valid;     /* per row, or NULL */
    const int64_t *pos;     /* per row, or NULL (head rows) */
} dsv4_op_event;
typedef void (*dsv4_op_trace_fn)(const dsv4_op_event *ev, void *user);
void dsv4_engine_set_op_trace(dsv4_engine *e, dsv4_op_trace_fn fn, void *user); /* fn NULL = off */

/* ----- backend introspection (dsv4 bench) ----- */
/* "cpu" or "cuda". */
const char *dsv4_engine_backend_name(const dsv4_engine *e);
/* Per-op timing on (resets the counters) or off; a no-op on backends without it. */
void dsv4_engine_profile(dsv4_engine *e, int on);
#define DSV4_ENGINE_MAX_OPS 32
typedef struct dsv4_engine_perf_info {
    char device[128];           /* "" for the CPU backend */
    size_t mem_used, mem_total; /* device memory, bytes */
    size_t weight_bytes;        /* weights resident on the device */
    int n_ops;                  /* 0 when the backend does not time ops */
    const char *op[DSV4_ENGINE_MAX_OPS];
    double ms[DSV4_ENGINE_MAX_OPS];
    double host_ms[DSV4_ENGINE_MAX_OPS]; /* host time issuing the op (part of ms) */
    long calls[DSV4_ENGINE_MAX_OPS];
    double weight_bytes_read;   /* since profiling was turned on */
    long graph_launches, graph_updates, graph_inst; /* cumulative (CUDA graphs of decode segments) */
    long side_forks, side_forced; /* cumulative: side chains on a second stream, and closed early */
    long comb_fused, comb_alone; /* cumulative: MoE combines inside the next hc kernel / pending, then alone */
    double wait_s;              /* cumulative seconds the host waited for the device */
    double graph_gpu_s;         /* cumulative device seconds inside CUDA graphs */
    double issue_s, segment_s;  /* cumulative host seconds inside ops / ending graph captures */
} dsv4_engine_perf_info;
void dsv4_engine_perf(dsv4_engine *e, dsv4_engine_perf_info *out);
/* Device-to-device copy bandwidth in GB/s (read + written) over a `bytes` buffer; < 0 if
 * the backend has no device. */
double dsv4_engine_copy_bandwidth(dsv4_engine *e, size_t bytes);
/* Host memory for logits rows (or any buffer the engine writes from the device): page-locked
 * where the backend offers it (a download is then one DMA), else malloc'd; zero-filled; NULL
 * on failure.  Free with dsv4_engine_host_free on the same engine, before closing it. */
void *dsv4_engine_host_alloc(dsv4_engine *e, size_t bytes);
void dsv4_engine_host_free(dsv4_engine *e, void *p);

/* ----- numerics ----- */
/* Writes "name=value" lines of the engine's effective switches into buf. */
void dsv4_engine_numerics_string(const dsv4_engine *e, char *buf, size_t n);

#endif
