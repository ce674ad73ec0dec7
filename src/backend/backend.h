/* backend/backend: the op table every compute backend fills (STYLE §5).
 *
 * Owns: the contract between model/forward (one graph, written once) and the
 * backends (cpu today, cuda next).  Buffers are opaque backend memory reached
 * through `void *`/`float *` handles that only the backend dereferences; the CPU
 * backend's handles are host pointers.  Activations are float32 rows, row-major,
 * `rows` rows per call (prefill chunks and several sequences batched together).
 * Weights stay in their stored formats (dsv4_weight: bf16, fp8 blocks, mxfp4,
 * nvfp4) and are dequantized by the op as it streams them.
 *
 * Which arrays are host and which are backend memory is part of each op's contract:
 * small lists the host builds from positions (counts, per-row key pointers, RoPE
 * positions, hash ids) are host arrays; whatever one op produces for another (top-k
 * picks, expert ids and weights) is backend memory, so a device backend runs a whole
 * forward call without waiting for a device result (only the logits are read back).
 *
 * Each op documents its layout; flags are ints taken from dsv4_numerics by the
 * caller, so a backend never sees profiles.  Ops do not fail: shapes are checked
 * by the forward pass when a model is opened.  A CUDA backend must give results
 * equal to the CPU op within a stated tolerance (tests/test_backend_cpu.c holds
 * scalar references for each op).
 *
 * Tracing: if `trace` is set, the forward pass calls it after every op with the
 * op name, the layer and the output buffer (the layer-diff tool hashes it).
 * Threading: one thread calls a backend at a time; ops parallelise inside.
 */
#ifndef DSV4_BACKEND_BACKEND_H
#define DSV4_BACKEND_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "model/weights.h"
#include "util/err.h"

typedef struct dsv4_backend dsv4_backend;
struct dsv4_backend_stats;
struct dsv4_op_task;

/* Quantization simulations applied in place by op `sim` on a [rows, stride]
 * buffer, to `width` values starting at column `col0` of each row. */
enum {
    DSV4_SIM_BF16 = 1,        /* round to bf16 */
    DSV4_SIM_FP8_B64 = 2,     /* fp8_sim, blocks of 64 (KV nope dims) */
    DSV4_SIM_HAD_FP4_B32 = 3, /* Hadamard over width rounded to bf16, then fp4_sim in blocks of 32 (indexer) */
    DSV4_SIM_FP8_ROW = 4,     /* e4m3 with one pow2 scale per row (indexer.keys=fp8) */
    DSV4_SIM_FP4_B32 = 5,     /* e2m1 blocks of 32 without Hadamard (indexer.keys=fp4) */
};

/* flags of the matmul ops (matmul, matmul_multi, matmul_grouped) */
enum { DSV4_LIN_ACT_FP8 = 1, DSV4_LIN_DOT_MMA = 2, DSV4_LIN_GEMM_E4M3 = 4 };
/* bits of the hc ops' iters argument above the iteration count (hc_pre, hc_post_pre_norm) */
enum { DSV4_HC_ITERS = 0xffff, DSV4_HC_COMB_LOGITS = 0x10000, DSV4_HC_COMBIN_LOGITS = 0x20000 };
/* out_bf16 of rmsnorm / norm_rope (and their op_list tasks) with this bit as well: the norm as torch
 * computes it on a bf16 tensor (x.square().mean(-1) + eps, rsqrt, the product: each step rounded to
 * bf16, the sum of squares in fp32), q's per-head RMS in the reference (spec §2.5 Q.3) */
enum { DSV4_NORM_BF16_STEPS = 2 };

/* flags of the moe and route_moe ops */
enum { DSV4_MOE_ACT_FP8 = 1, DSV4_MOE_DOT_MMA = 2, DSV4_MOE_DOT_E4M3 = 4 };

typedef struct dsv4_backend_ops {
    const char *name;

    /* ----- memory ----- */
    void *(*alloc)(dsv4_backend *b, size_t bytes); /* zero-filled; NULL on failure */
    void (*free)(dsv4_backend *b, void *p);
    void (*upload)(dsv4_backend *b, void *dst, const void *src, size_t bytes);   /* host -> backend */
    void (*download)(dsv4_backend *b, void *dst, const void *src, size_t bytes); /* backend -> host */
    void (*copy)(dsv4_backend *b, void *dst, const void *src, size_t bytes);     /* backend -> backend */

    /* ----- ops ----- */
    /* out[r][:] = embed row tokens[r] (dim floats). */
    void (*embed)(dsv4_backend *b, float *out, const int32_t *tokens, int rows, const dsv4_weight *w);
    /* out[r][o] = sum_k W[o][k] x[r][k]; x [rows, W.cols], out [rows, W.rows].  flags:
     * DSV4_LIN_ACT_FP8 (linear.act=fp8): x is act-quantized (1x128 ue8m0 e4m3) first;
     * DSV4_LIN_DOT_MMA (linear.dot=mma): a device backend may form one-row FP8 dots on tensor
     * cores (the CPU op, the reference, ignores it); DSV4_LIN_GEMM_E4M3 (linear.gemm=e4m3), with
     * DSV4_LIN_ACT_FP8: it may multiply many rows by an FP8 weight on e4m3 tensor cores (the
     * codes as they are; the MMA's reduced-precision sums within each 128-wide block), where
     * otherwise it sums the same products in fp32 as the CPU.  out_bf16: outputs rounded to bf16. */
    void (*matmul)(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                   int out_bf16);
    /* Grouped low-rank projection (wo_a): W [groups*R, C], x [rows, groups*C];
     * out[r][g*R+j] = sum_k W[g*R+j][k] x[r][g*C+k].  in_bf16 rounds x (and each dequantized
     * weight) to bf16; flags: DSV4_LIN_DOT_MMA as for matmul (DSV4_LIN_ACT_FP8 is not taken). */
    void (*matmul_grouped)(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int groups,
                           int in_bf16, int out_bf16, int flags);
    /* RMSNorm over `dim` of each row (in place allowed); w NULL = unweighted.  Rows are
     * `rows*groups` vectors of `dim` (per-head norms use groups = n_heads). */
    void (*rmsnorm)(dsv4_backend *b, float *out, const float *x, int rows, int dim, const dsv4_weight *w,
                    float eps, int out_bf16);
    /* Interleaved RoPE on the last rope_dim dims of each of n_heads heads (head_dim apart)
     * in place: pair i = (x[2i], x[2i+1]) rotated by pos[r]*freq[i] (or its conjugate when
     * inverse).  freq: rope_dim/2 floats (host pointer). */
    void (*rope)(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, int rope_dim, const int64_t *pos,
                 const double *freq, int inverse, int out_bf16);
    /* x[i] *= s for n floats, then optionally rounded to bf16. */
    void (*scale)(dsv4_backend *b, float *x, size_t n, float s, int out_bf16);
    /* In-place simulation (DSV4_SIM_*) on columns [col0, col0+width) of each row of stride. */
    void (*sim)(dsv4_backend *b, float *x, int rows, int stride, int col0, int width, int mode);
    /* mHC pre (spec §2.3): X [rows, hc*dim] -> y [rows, dim], post [rows, hc], comb [rows, hc*hc].
     * iters: the Sinkhorn iterations (iters & DSV4_HC_ITERS), with DSV4_HC_COMB_LOGITS: comb
     * receives the row softmax's inputs (the scaled, biased mixes), not the doubly stochastic
     * matrix; the op that reads them forms it (hc_post_pre_norm with DSV4_HC_COMBIN_LOGITS). */
    void (*hc_pre)(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc, int dim,
                   const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                   float norm_eps, float hc_eps, int gemm_bf16, int out_bf16);
    /* mHC post: Xout[r][k] = post[k] o[r] + sum_j comb[j][k] R[r][j]; state rounded to bf16 if asked. */
    void (*hc_post)(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post,
                    const float *comb, int rows, int hc, int dim, int state_bf16);
    /* hc_head (spec §2.7): y[r] = sum_j pre[j] X[r][j]. */
    void (*hc_head)(dsv4_backend *b, float *y, const float *X, int rows, int hc, int dim, const dsv4_weight *fn,
                    const dsv4_weight *base, const dsv4_weight *scale, float norm_eps, float hc_eps,
                    int gemm_bf16, int out_bf16);
    /* Sink attention (spec §2.5): q [rows, n_heads*head_dim]; out [rows, n_heads*head_dim].  Row r
     * attends to, in this order (K = V, head_dim floats each, all in backend memory):
     *   (a) its window keys win[r*max_win + j], j < n_win[r] (host array of pointers: fresh kv rows
     *       of this call or the sequence's ring);
     *   (b) compressed keys comp_base[r] + i*head_dim (comp_base: host array, NULL = none for that
     *       row), for i = picks[r*topk + j], j < n_picks[r] when picks is non-NULL (picks, n_picks:
     *       BACKEND memory, topk's output), else for i = 0 .. n_comp[r]-1.  With picks, n_comp[r]
     *       (host) bounds the indices: a backend may skip (and report) an index >= n_comp[r].
     * n_win, n_comp, comp_base and sink are host arrays; n_comp may be NULL when comp_base is. */
    void (*sparse_attn)(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                        const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                        const int *n_comp, const int32_t *picks, const int *n_picks, int topk, const float *sink,
                        float scale, int prob_bf16, int out_bf16);
    /* Indexer scores: score[r][j] = sum_h w[r][h] relu(q[r][h] . key_j) for j < n_keys[r], where
     * key_j = key_base[r] + j*head_dim (key_base: host array of backend pointers, one contiguous
     * block of keys per row; n_keys: host); q [rows, n_heads*head_dim]; score [rows][max_keys]
     * (entries j >= n_keys[r] are left as they are); score_bf16 rounds products and sums to bf16. */
    void (*indexer_scores)(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                           int head_dim, const float *const *key_base, const int *n_keys, int max_keys,
                           int score_bf16);
    /* Top-k per row of score[rows][stride] over the first n[r] entries: writes min(k, n[r]) indices
     * to idx[r*k ...] (ascending index order) and the count to n_out[r].  idx and n_out are BACKEND
     * memory (a device backend does not wait for them); n is a host array. */
    void (*topk)(dsv4_backend *b, int32_t *idx, int *n_out, const float *score, int rows, int stride,
                 const int *n, int k);
    /* x[i][c] += y[((first + i) mod period)][c] for rows x width (compressor position biases). */
    void (*add_cyclic)(dsv4_backend *b, float *x, const float *y, int rows, int width, int period, int first);
    /* Softmax pooling (compressor emit): for each channel c < width,
     * out[c] = sum_t softmax_t(gate[t][c]) kv[t][c] over n entries (entry t: pointers kv[t], gate[t]). */
    void (*pool)(dsv4_backend *b, float *out, const float *const *kv, const float *const *gate, int n, int width);
    /* Router (spec §2.6): logits [rows, n_routed] (fp32) -> experts/weights [rows, k], both
     * BACKEND memory (a device backend does not wait for them).  bias: host, n_routed floats or
     * NULL.  hash_ids: host tid2eid rows for each token (NULL = biased top-k with bias).
     * scale multiplies the renormalised weights (routed_scaling_factor, or 1). */
    void (*route)(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed,
                  int k, const float *bias, const int32_t *hash_ids, float scale);
    /* Routed + shared experts (clamped SwiGLU): out[r] = sum_k wgt[r][k] FFN_{e[r][k]}(x[r]) + FFN_shared(x[r]);
     * e and wgt are BACKEND memory (route's output; a device backend groups slots by expert on the
     * device), experts[] holds n_routed FFNs (ids outside [0, n_routed) are a broken invariant: a
     * device backend skips them and reports an error).  before_w2: the weight multiplies the
     * activation before w2 (else after).  out_scale multiplies the routed sum (moe.route_scale=output/both).
     * flags: DSV4_MOE_ACT_FP8 (linear.act=fp8: act-quant before quantized w1/w3 and w2), DSV4_MOE_DOT_MMA
     * (moe.dot=mma: a device backend may form MXFP4 expert dots on tensor cores; the CPU op, the
     * reference, ignores it), DSV4_MOE_DOT_E4M3 (moe.dot=e4m3, with ACT_FP8 only: a device backend
     * may form the expert dots of the act-quantized inputs on e4m3 tensor cores; the CPU ignores it). */
    void (*moe)(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_ffn_w *experts, int n_routed,
                const int32_t *e, const float *wgt, int k, const dsv4_ffn_w *shared, float limit, int before_w2,
                int flags, int act_bf16, float out_scale);

    /* ----- optional (NULL where a backend has nothing to do; the CPU backend sets none of these) ----- */
    /* Copies every weight of the model to the backend's memory once, in its stored format;
     * fails up front (bytes required vs available) if it does not fit. */
    int (*load_weights)(dsv4_backend *b, const dsv4_model_w *w, dsv4_err *err);
    /* Ops cannot fail, so a device error is sticky: this reports it (0 = none). */
    int (*check)(dsv4_backend *b, dsv4_err *err);
    /* Per-op timing for `dsv4 bench` (on: resets the counters; costs a sync per op). */
    void (*profile)(dsv4_backend *b, int on);
    void (*stats)(dsv4_backend *b, struct dsv4_backend_stats *out);
    /* Device-to-device copy bandwidth in GB/s (bytes read + written) over `bytes`; < 0 on error. */
    double (*copy_bandwidth)(dsv4_backend *b, size_t bytes);
    /* Segment mark (the forward pass calls it before the first layer of each segment with
     * that layer's index, before layer 0's MoE half with n_layers + n_mtp + 2, before the
     * embedding with n_layers + n_mtp + 1, before the head with n_layers + n_mtp, and with -1
     * when the layers end): a device backend may record the ops of one segment and replay them
     * as one unit (CUDA graphs).  Results must not depend on it. */
    void (*segment)(dsv4_backend *b, int key);

    /* ----- fused pairs (optional: NULL = the forward pass calls the two ops) -----
     * Each gives, bit for bit, what the ops it replaces give on the same backend (the CPU
     * backend's norm_rope and hc_pre_norm call them); a device backend saves launches and round
     * trips through memory. */
    /* rmsnorm(x, x, rows * n_heads, head_dim, w, eps, out_bf16), then
     * rope(x, rows, n_heads, head_dim, rope_dim, pos, freq, 0, out_bf16). */
    void (*norm_rope)(dsv4_backend *b, float *x, int rows, int n_heads, int head_dim, const dsv4_weight *w,
                      float eps, int rope_dim, const int64_t *pos, const double *freq, int out_bf16);
    /* hc_pre(...), then rmsnorm(y, y, rows, dim, y_norm, y_eps, out_bf16). */
    void (*hc_pre_norm)(dsv4_backend *b, float *y, float *post, float *comb, const float *X, int rows, int hc,
                        int dim, const dsv4_weight *fn, const dsv4_weight *base, const dsv4_weight *scale, int iters,
                        float norm_eps, float hc_eps, int gemm_bf16, int out_bf16, const dsv4_weight *y_norm,
                        float y_eps);
    /* hc_post(Xout, o, R, post_in, comb_in, rows, hc, dim, state_bf16), then
     * hc_pre_norm(y, post, comb, Xout, rows, hc, dim, fn, ..., y_norm, y_eps): the next half's
     * mHC pre on the state the last half's post wrote.  Xout aliases neither o nor R (as for
     * hc_post); y, post and comb alias none of o, R, post_in, comb_in (a device backend may
     * still read those while it writes these: the forward pass keeps two post/comb pairs).
     * iters may carry DSV4_HC_COMB_LOGITS (comb, as for hc_pre) and DSV4_HC_COMBIN_LOGITS:
     * comb_in holds an earlier hc_pre's logits, and the op forms the matrix from them (row
     * softmax, + hc_eps, iters & DSV4_HC_ITERS iterations: hc_pre's arithmetic, so the pair
     * gives the bits of the undeferred pair) before its hc_post.  The deferral takes Sinkhorn's
     * dependent iterations out of one launch's critical path into the next's (docs/CUDA.md). */
    void (*hc_post_pre_norm)(dsv4_backend *b, float *Xout, const float *o, const float *R, const float *post_in,
                             const float *comb_in, int state_bf16, float *y, float *post, float *comb, int rows,
                             int hc, int dim, const dsv4_weight *fn, const dsv4_weight *base,
                             const dsv4_weight *scale, int iters, float norm_eps, float hc_eps, int gemm_bf16,
                             int out_bf16, const dsv4_weight *y_norm, float y_eps);
    /* matmul(outs[i], x, rows, ws[i], flags[i], out_bf16[i]) for i < n, every ws[i] with the
     * same cols (one input): the values of the n matmul calls up to summation order (a device
     * backend streams several weights in one launch).  NULL: the forward pass calls matmul n
     * times; the CPU backend sets none. */
    void (*matmul_multi)(dsv4_backend *b, int n, float *const *outs, const float *x, int rows,
                         const dsv4_weight *const *ws, const int *flags, const int *out_bf16);
    /* sparse_attn(out, q, ..., prob_bf16, out_bf16), then the inverse RoPE of the output at the
     * query positions: rope(out, rows, n_heads, head_dim, rope_dim, pos, freq, 1, out_bf16).
     * NULL (the CPU backend): the forward pass calls the two ops. */
    void (*sparse_attn_rope)(dsv4_backend *b, float *out, const float *q, int rows, int n_heads, int head_dim,
                             const float *const *win, const int *n_win, int max_win, const float *const *comp_base,
                             const int *n_comp, const int32_t *picks, const int *n_picks, int topk,
                             const float *sink, float scale, int prob_bf16, int out_bf16, int rope_dim,
                             const int64_t *pos, const double *freq);
    /* The scores of indexer_scores(score, q', w', ...) where q' = rope(q, rows, n_heads, head_dim,
     * rope_dim, pos, freq, 0, out_bf16) and w' = scale(w, rows * n_heads, w_scale, out_bf16):
     * rope and scale are applied as q and w are read, and q and w are left as they are (only
     * score is written).  NULL (the CPU backend): the forward pass calls the three ops. */
    void (*indexer_scores_rs)(dsv4_backend *b, float *score, const float *q, const float *w, int rows, int n_heads,
                              int head_dim, const float *const *key_base, const int *n_keys, int max_keys,
                              int score_bf16, int rope_dim, const int64_t *pos, const double *freq, float w_scale,
                              int out_bf16);
    /* copy(dst[i], src[i], bytes[i]) for i < n (host arrays of backend pointers; no destination
     * range overlaps another range of the list), in one call: a device backend may do them in
     * one launch.  NULL: the forward pass calls copy n times. */
    void (*copy_list)(dsv4_backend *b, int n, void *const *dst, const void *const *src, const size_t *bytes);
    /* add_cyclic with each row's own phase: x[i][c] += y[pos[i] mod period][c] (pos: host array):
     * every sequence of a sub-batch in one call.  NULL: the forward pass calls add_cyclic per
     * sequence. */
    void (*add_cyclic_pos)(dsv4_backend *b, float *x, const float *y, int rows, int width, int period,
                           const int64_t *pos);
    /* Runs n independent small ops (dsv4_op_task below) as one call: the values, bit for bit, of
     * running each task as its op, in any order, on the same backend (a device backend runs them
     * in one launch).  Independent: no task reads or writes memory that another task of the list
     * writes.  Host arrays a task points to (pos, freq) are read during the call only.  NULL: the
     * forward pass runs the ops one by one; the CPU backend sets none. */
    void (*op_list)(dsv4_backend *b, const struct dsv4_op_task *tasks, int n);
    /* route(experts, weights, logits, rows, n_routed, k, bias, hash_ids, route_scale), then
     * moe(out, x, rows, ffn, n_routed, experts, weights, k, shared, limit, before_w2, flags,
     * act_bf16, out_scale): the same bits in out, experts and weights as the two ops (experts and
     * weights are still written: the routing traces read them).  A device backend routes and
     * plans in one launch where it can, else calls the two ops.  NULL (the CPU backend): the
     * forward pass calls route and moe. */
    void (*route_moe)(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed,
                      int k, const float *bias, const int32_t *hash_ids, float route_scale, float *out,
                      const float *x, const dsv4_ffn_w *ffn, const dsv4_ffn_w *shared, float limit, int before_w2,
                      int flags, int act_bf16, float out_scale);

    /* ----- optional: host buffers the device copies into directly -----
     * Page-locked host memory of `bytes` (NULL on failure; the engine then falls back to
     * malloc), freed by host_free.  A download into such a buffer is one DMA; into pageable
     * memory the driver stages it and copies it out on the host (with a 517 KB logits row the
     * H200's trace showed the device idle 56.7 us a step before the next copy, 1.3 us with a
     * page-locked row; 2026-12-04). */
    void *(*host_alloc)(dsv4_backend *b, size_t bytes);
    void (*host_free)(dsv4_backend *b, void *p);

    /* ----- optional: greedy decoding without the host in the loop (dsv4_forward_greedy) -----
     * argmax: out[r] = the index of the largest of x[r][0..n) (the first of equal ones; a NaN
     * never wins; a row of NaN only gives 0).
     * gather_ids: dst[r][j] = table[tokens[r]][j] for j < k (a [rows >= vocab][k] int32 or int64
     * weight, each value as int32: the hash layers' tid2eid), every token in [0, table rows) (argmax of a vocab row; one outside reads row 0, never past
     * the table).  Both take backend memory in place (host memory too, staged, as other ops), so
     * a pick feeds the next step's embed and gather_ids without the host.  NULL: the forward pass
     * picks on the host, reading each step's logits. */
    void (*argmax)(dsv4_backend *b, int32_t *out, const float *x, int rows, int n);
    void (*gather_ids)(dsv4_backend *b, int32_t *dst, const int32_t *tokens, int rows, const dsv4_weight *table,
                       int k);

    /* ----- optional: a second chain of ops beside the first (both NULL or both set) -----
     * side(b, 1): the ops issued from here on form a side chain that starts after every op
     * issued so far and may run beside the ops issued after side(b, 0) (the main chain);
     * side(b, 1) again while the chain is open continues it, its next ops also after every op
     * issued so far on the main chain; join(b): the ops issued after it start after both chains.
     * The forward pass puts only ops of disjoint data in the two chains, so values do not
     * depend on the overlap.  A backend may
     * run the side chain in order with the rest (the CPU backend: it counts the calls, for the
     * tests), and a device backend falls back to that whenever it must wait (a sync, the end
     * of a graph capture).  side(b, 0) and join(b) without an open side chain do nothing. */
    void (*side)(dsv4_backend *b, int on);
    void (*join)(dsv4_backend *b);

    /* ----- optional: matmul of x's rmsnorm (NULL: the forward pass runs the two ops) -----
     * matmul(out, t, rows, w, flags, out_bf16) with t = rmsnorm(x, rows, w->cols, norm_w, eps,
     * norm_bf16) formed inside the op (x is not written): the values of the two ops bit for bit
     * (the CUDA backend at one row of Flash's wq_b: docs/CUDA.md, "qa's norm inside wq_b"). */
    void (*matmul_rn)(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int flags,
                      int out_bf16, const dsv4_weight *norm_w, float eps, int norm_bf16);
    /* 1 where matmul_rn of this weight, rows and flags forms the norm inside the matmul (one launch); 0 where it
     * would run the two ops, which the forward pass then keeps as they were (both set or both NULL) */
    int (*matmul_rn_takes)(dsv4_backend *b, const dsv4_weight *w, int rows, int flags);
    /* ----- optional: op_list beside the op just before (NULL: the forward pass calls op_list) -----
     * op_list's values, with the caller's promise that every task's input was written before the op
     * just before this one and that no task reads or writes what that op writes or reads: a device
     * backend may then run the two side by side (the CUDA backend after a matmul_rn; docs/CUDA.md). */
    void (*op_list_beside)(dsv4_backend *b, const struct dsv4_op_task *tasks, int n);
    /* ----- optional: pools of several outputs in one call (NULL: the forward pass calls pool for each) -----
     * pool(outs[j], kv[j], gate[j], ns[j], widths[j]) for every j < n_jobs, the values of those calls bit for
     * bit; no job's output is another's input (a device backend may run them side by side). */
    void (*pool_multi)(dsv4_backend *b, int n_jobs, float *const *outs, const float *const *const *kv,
                       const float *const *const *gate, const int *ns, const int *widths);
} dsv4_backend_ops;

/* argmax's rule on the host (the CPU backend's op, the forward pass's host picks): the first
 * index of the largest value, NaN never winning, 0 for a row of NaN */
static inline int32_t dsv4_argmax_row(const float *x, int n) {
    int32_t best = -1;
    for (int i = 0; i < n; i++)
        if (x[i] == x[i] && (best < 0 || x[i] > x[best])) best = i;
    return best < 0 ? 0 : best;
}

/* One task of op_list: the op named by kind with these arguments (each kind reads the fields
 * beside it; the contracts are the ops' above). */
enum {
    DSV4_TASK_RMSNORM = 1, /* rmsnorm(out, in, rows, dim, w, eps, out_bf16) */
    DSV4_TASK_NORM_ROPE,   /* norm_rope(out, rows, n_heads, dim, w, eps, rope_dim, pos, freq, out_bf16) */
    DSV4_TASK_ROPE,        /* rope(out, rows, n_heads, dim, rope_dim, pos, freq, inverse, out_bf16) */
    DSV4_TASK_ADD_CYCLIC,  /* add_cyclic(out, in, rows, dim, period, first): dim = width */
    DSV4_TASK_COPY,        /* copy(out, in, n): n bytes */
    DSV4_TASK_SCALE,       /* scale(out, n, s, out_bf16): n floats */
};
typedef struct dsv4_op_task {
    int kind;                /* DSV4_TASK_* */
    void *out;               /* written (in place for norm_rope, rope, add_cyclic, scale) */
    const void *in;          /* rmsnorm's x, add_cyclic's y, copy's source */
    int rows, n_heads, dim, rope_dim;
    int period, first, inverse, out_bf16;
    size_t n;                /* copy: bytes; scale: floats */
    float eps, s;            /* norms' epsilon; scale's factor */
    const dsv4_weight *w;    /* norm weight (NULL: unweighted) */
    const int64_t *pos;      /* host, rows positions */
    const double *freq;      /* host, rope_dim / 2 */
} dsv4_op_task;

/* one task as its own op (what op_list's values are; the forward pass runs a task so where the backend has
 * no op_list): norm_rope as rmsnorm then rope where the backend lacks the fused op */
static inline void dsv4_op_task_run(const dsv4_backend_ops *op, dsv4_backend *b, const dsv4_op_task *t) {
    switch (t->kind) {
    case DSV4_TASK_RMSNORM: op->rmsnorm(b, (float *)t->out, (const float *)t->in, t->rows, t->dim, t->w, t->eps,
                                        t->out_bf16); break;
    case DSV4_TASK_NORM_ROPE:
        if (op->norm_rope) {
            op->norm_rope(b, (float *)t->out, t->rows, t->n_heads, t->dim, t->w, t->eps, t->rope_dim, t->pos, t->freq,
                          t->out_bf16);
        } else {
            op->rmsnorm(b, (float *)t->out, (const float *)t->out, t->rows * t->n_heads, t->dim, t->w, t->eps,
                        t->out_bf16);
            op->rope(b, (float *)t->out, t->rows, t->n_heads, t->dim, t->rope_dim, t->pos, t->freq, 0, t->out_bf16);
        }
        break;
    case DSV4_TASK_ROPE:
        op->rope(b, (float *)t->out, t->rows, t->n_heads, t->dim, t->rope_dim, t->pos, t->freq, t->inverse,
                 t->out_bf16);
        break;
    case DSV4_TASK_ADD_CYCLIC:
        op->add_cyclic(b, (float *)t->out, (const float *)t->in, t->rows, t->dim, t->period, t->first);
        break;
    case DSV4_TASK_COPY: op->copy(b, t->out, t->in, t->n); break;
    case DSV4_TASK_SCALE: op->scale(b, (float *)t->out, t->n, t->s, t->out_bf16); break;
    }
}

/* What a backend reports about itself (ops->stats). */
#define DSV4_BACKEND_MAX_OPS 32
typedef struct dsv4_backend_stats {
    char device[128];            /* e.g. "NVIDIA H200 (sm_90, 132 SMs)" */
    size_t mem_used, mem_total;  /* device memory in bytes (0 when not a device) */
    size_t weight_bytes;         /* weights resident on the device */
    int n_ops;
    const char *op[DSV4_BACKEND_MAX_OPS];
    double ms[DSV4_BACKEND_MAX_OPS]; /* time per op since profile(on) */
    double host_ms[DSV4_BACKEND_MAX_OPS]; /* of which the host spent issuing it (0 if not known) */
    long calls[DSV4_BACKEND_MAX_OPS];
    double weight_bytes_read;    /* weight bytes streamed by the ops since profile(on) */
    /* cumulative since init (0 where a backend has none): CUDA graphs launched, updated in
     * place, instantiated; seconds the host spent waiting for the device */
    long graph_launches, graph_updates, graph_inst;
    long side_forks, side_forced; /* side chains run beside the main one, and closed early (a wait inside) */
    long comb_fused, comb_alone;  /* MoE combines formed inside the next hc kernel / left pending, then run alone */
    double wait_s;
    double graph_gpu_s;          /* cumulative device time inside launched graphs (events around each) */
    double issue_s;              /* cumulative host time inside ops (begin to end), timed or not */
    double segment_s;            /* cumulative host time ending captures: update/instantiate + launch */
} dsv4_backend_stats;

typedef void (*dsv4_backend_trace_fn)(void *user, const char *op, int layer, const float *out, size_t n);

struct dsv4_backend {
    const dsv4_backend_ops *ops;
    void *impl;                   /* backend-private */
    int n_threads;                /* 0 = default */
    dsv4_backend_trace_fn trace;  /* optional op trace */
    void *trace_user;
};

/* The CPU reference backend (src/backend/cpu). */
int dsv4_backend_cpu_init(dsv4_backend *b, int n_threads, dsv4_err *err);
void dsv4_backend_cpu_free(dsv4_backend *b);

/* The CUDA backend (src/backend/cuda, `make CUDA=1` builds only; other builds link
 * src/backend/nocuda.c, where available() is 0 and init fails saying so).
 * available(): 1 when this build has CUDA and a device is usable. */
int dsv4_backend_cuda_available(void);
/* 1 when this dsv4 was built with CUDA (make CUDA=1), device or not. */
int dsv4_backend_cuda_built(void);
int dsv4_backend_cuda_init(dsv4_backend *b, int device, dsv4_err *err);
void dsv4_backend_cuda_free(dsv4_backend *b);

#endif
