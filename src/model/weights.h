/* model/weights: the tensor inventory of a config, and binding a checkpoint's
 * tensors into per-layer structs of named weights (STYLE §2).
 *
 * Owns: (1) the inventory: for a dsv4_config, the exact list of tensors the
 * official checkpoint holds (spec §4.1, §4.2): name, dtype, shape and a class
 * used by `inspect`; it drives `synth` (what to write), binding (what to expect)
 * and `inspect --config` (counts from shapes alone), so the three cannot
 * disagree.  (2) binding: dsv4_model_w, whose fields point into the mmap'd
 * safetensors data in their stored formats; the hot path never looks anything
 * up by name.  Every mismatch is reported together: missing, unexpected and
 * duplicate tensors, wrong dtype/shape, each naming the tensor, expected and found.
 * Lifetime: a dsv4_model_w borrows from the dsv4_st it was bound from.
 */
#ifndef DSV4_MODEL_WEIGHTS_H
#define DSV4_MODEL_WEIGHTS_H

#include <stddef.h>
#include <stdint.h>

#include "model/config.h"
#include "model/safetensors.h"
#include "util/err.h"

/* ----- stored weight formats ----- */
typedef enum {
    DSV4_WF_NONE = 0, /* absent */
    DSV4_WF_F32,      /* float32 */
    DSV4_WF_BF16,     /* bfloat16 */
    DSV4_WF_FP8,      /* e4m3 + block scales [ceil(rows/B), ceil(cols/B)], e8m0 or f32 */
    DSV4_WF_MXFP4,    /* packed e2m1 [rows, cols/2] + e8m0 [rows, cols/32] */
    DSV4_WF_NVFP4,    /* packed e2m1 [rows, cols/2] + e4m3 [rows, cols/16] + f32 scale2 */
    DSV4_WF_I32,      /* tid2eid */
    DSV4_WF_I64,      /* tid2eid */
} dsv4_wfmt;

/* One logical weight: a [rows, cols] matrix (vectors have rows = 1) in its
 * stored format.  For a linear, y = W x with W [out = rows, in = cols]. */
typedef struct dsv4_weight {
    dsv4_wfmt fmt;
    int64_t rows, cols;
    const void *data;      /* stored values */
    const void *scale;     /* FP8: block scales; MXFP4: e8m0; NVFP4: e4m3 */
    int scale_f32;         /* FP8 block scales stored as float32 (Flash-Base) */
    int block;             /* FP8 block size (128) */
    float scale2;          /* NVFP4 weight_scale_2 */
    float input_scale;     /* NVFP4 input_scale (unused by bf16/fp8 activation paths) */
    const char *name;      /* checkpoint name of the main tensor (borrowed) */
} dsv4_weight;

/* Dequantizes row r of w (cols floats) into out.  Works for every fmt except I32/I64. */
void dsv4_weight_row(const dsv4_weight *w, int64_t r, float *out);
/* Bytes this weight occupies on disk (data + scales). */
size_t dsv4_weight_bytes(const dsv4_weight *w);

typedef struct dsv4_compressor_w {
    int ratio, coff, dim;      /* coff = 2 (overlap) iff ratio == 4; dim = head width it produces */
    dsv4_weight wkv, wgate;    /* [coff*dim, model dim] bf16 (used in fp32) */
    dsv4_weight ape;           /* [ratio, coff*dim] f32 */
    dsv4_weight norm;          /* [dim] */
} dsv4_compressor_w;

typedef struct dsv4_indexer_w {
    dsv4_weight wq_b;          /* [index_n_heads*index_head_dim, q_lora_rank] FP8 */
    dsv4_weight weights_proj;  /* [index_n_heads, dim] bf16 */
    dsv4_compressor_w comp;    /* dim = index_head_dim */
} dsv4_indexer_w;

typedef struct dsv4_ffn_w {
    dsv4_weight w1, w3;        /* [inter, dim] gate, up */
    dsv4_weight w2;            /* [dim, inter] down */
} dsv4_ffn_w;

typedef struct dsv4_layer_w {
    int id;                    /* global layer id (MTP layers follow the trunk: 43 for Flash) */
    int ratio;                 /* compress ratio */
    int is_hash, is_mtp;

    dsv4_weight attn_norm, ffn_norm;                   /* [dim] */
    dsv4_weight hc_attn_fn, hc_attn_base, hc_attn_scale; /* [(2+hc)*hc, hc*dim], [(2+hc)*hc], [3] f32 */
    dsv4_weight hc_ffn_fn, hc_ffn_base, hc_ffn_scale;

    /* attention (spec §2.5) */
    dsv4_weight wq_a;          /* [q_lora_rank, dim] */
    dsv4_weight q_norm;        /* [q_lora_rank] */
    dsv4_weight wq_b;          /* [n_heads*head_dim, q_lora_rank] */
    dsv4_weight wkv;           /* [head_dim, dim] */
    dsv4_weight kv_norm;       /* [head_dim] */
    dsv4_weight wo_a;          /* [o_groups*o_lora_rank, n_heads*head_dim/o_groups] */
    dsv4_weight wo_b;          /* [dim, o_groups*o_lora_rank] */
    dsv4_weight attn_sink;     /* [n_heads] f32 */
    int has_comp, has_indexer;
    dsv4_compressor_w comp;    /* ratio != 0; dim = head_dim */
    dsv4_indexer_w idx;        /* ratio == 4 */

    /* MoE (spec §2.6) */
    dsv4_weight gate;          /* [n_routed, dim] bf16 */
    dsv4_weight gate_bias;     /* [n_routed] f32, non-hash layers */
    dsv4_weight tid2eid;       /* [vocab, n_active] I64 or I32, hash layers */
    dsv4_ffn_w *experts;       /* n_routed entries (malloc'd) */
    dsv4_ffn_w shared;         /* width n_shared*moe_inter */

    /* MTP only (spec §2.8) */
    dsv4_weight e_proj, h_proj;            /* [dim, dim] */
    dsv4_weight enorm, hnorm, norm;        /* [dim] */
    dsv4_weight hc_head_fn, hc_head_base, hc_head_scale;
} dsv4_layer_w;

typedef struct dsv4_model_w {
    dsv4_config cfg;
    dsv4_weight embed;         /* [vocab, dim] bf16 */
    dsv4_weight head;          /* [vocab, dim] */
    dsv4_weight norm;          /* [dim] */
    dsv4_weight hc_head_fn, hc_head_base, hc_head_scale; /* [hc, hc*dim], [hc], [1] */
    int n_layers;              /* trunk + MTP */
    dsv4_layer_w *layers;      /* malloc'd */
} dsv4_model_w;

/* ----- the inventory ----- */
typedef enum {
    DSV4_CLASS_EMBED_HEAD = 0, /* embed, head, final norm, hc_head */
    DSV4_CLASS_ATTENTION,      /* q/kv/o projections, attn norms, sinks */
    DSV4_CLASS_COMPRESSOR,     /* main compressor */
    DSV4_CLASS_INDEXER,        /* indexer incl. its compressor */
    DSV4_CLASS_MHC,            /* hc_attn_*, hc_ffn_* */
    DSV4_CLASS_ROUTER,         /* gate, bias, tid2eid, ffn_norm */
    DSV4_CLASS_ROUTED,         /* routed experts */
    DSV4_CLASS_SHARED,         /* shared expert */
    DSV4_CLASS_MTP,            /* everything under mtp. */
    DSV4_CLASS_COUNT
} dsv4_wclass;

const char *dsv4_wclass_name(dsv4_wclass c);

/* Which struct field an inventory entry binds to (dsv4_inv_entry.role). */
typedef enum {
    /* globals (layer = -1) */
    DSV4_W_EMBED = 0, DSV4_W_HEAD, DSV4_W_NORM, DSV4_W_HC_HEAD_FN, DSV4_W_HC_HEAD_BASE, DSV4_W_HC_HEAD_SCALE,
    /* per layer */
    DSV4_W_ATTN_NORM, DSV4_W_FFN_NORM,
    DSV4_W_HC_ATTN_FN, DSV4_W_HC_ATTN_BASE, DSV4_W_HC_ATTN_SCALE,
    DSV4_W_HC_FFN_FN, DSV4_W_HC_FFN_BASE, DSV4_W_HC_FFN_SCALE,
    DSV4_W_WQ_A, DSV4_W_Q_NORM, DSV4_W_WQ_B, DSV4_W_WKV, DSV4_W_KV_NORM, DSV4_W_WO_A, DSV4_W_WO_B,
    DSV4_W_ATTN_SINK,
    DSV4_W_COMP_WKV, DSV4_W_COMP_WGATE, DSV4_W_COMP_APE, DSV4_W_COMP_NORM,
    DSV4_W_IDX_WQ_B, DSV4_W_IDX_WPROJ,
    DSV4_W_IDX_COMP_WKV, DSV4_W_IDX_COMP_WGATE, DSV4_W_IDX_COMP_APE, DSV4_W_IDX_COMP_NORM,
    DSV4_W_GATE, DSV4_W_GATE_BIAS, DSV4_W_TID2EID,
    DSV4_W_EXP_W1, DSV4_W_EXP_W2, DSV4_W_EXP_W3,
    DSV4_W_SH_W1, DSV4_W_SH_W2, DSV4_W_SH_W3,
    /* MTP only */
    DSV4_W_E_PROJ, DSV4_W_H_PROJ, DSV4_W_ENORM, DSV4_W_HNORM, DSV4_W_MTP_NORM,
    DSV4_W_MTP_HC_HEAD_FN, DSV4_W_MTP_HC_HEAD_BASE, DSV4_W_MTP_HC_HEAD_SCALE,
    DSV4_W_COUNT
} dsv4_wrole;

/* Which part of a logical weight a tensor holds. */
typedef enum {
    DSV4_PART_DATA = 0,        /* .weight (or the bare tensor: attn_sink, ape, hc_*, bias, tid2eid) */
    DSV4_PART_SCALE,           /* FP8/MXFP4 .scale, NVFP4 .weight_scale */
    DSV4_PART_SCALE2,          /* NVFP4 .weight_scale_2 (f32 scalar) */
    DSV4_PART_INPUT_SCALE,     /* NVFP4 .input_scale (f32 scalar) */
} dsv4_wpart;

typedef struct dsv4_inv_entry {
    char name[96];
    dsv4_dtype dtype;
    int ndim;                  /* 0 for NVFP4 scalars */
    int64_t shape[4];
    dsv4_wclass cls;
    int layer;                 /* -1 for globals; MTP layer i is n_layers + i */
    int expert;                /* routed expert index, else -1 */
    int role;                  /* dsv4_wrole: which field it binds to */
    /* the logical weight this tensor belongs to (same for its data and scale tensors) */
    dsv4_wpart part;
    dsv4_wfmt fmt;
    int64_t rows, cols;        /* logical [rows, cols] (vectors: rows = 1) */
    int64_t params;            /* logical elements if part == DATA (tid2eid: 0, it is a table), else 0 */
    size_t bytes;              /* prod(shape) * dtype size */
} dsv4_inv_entry;

/* Enumerates the tensors a checkpoint of this config holds, in a stable order
 * (globals, then layers, then MTP).  Calls fn for each; stops early if fn
 * returns non-zero (and returns that value).  Returns 0 when done. */
typedef int (*dsv4_inv_fn)(const dsv4_inv_entry *e, void *user);
int dsv4_inventory(const dsv4_config *cfg, dsv4_inv_fn fn, void *user);

/* Collects the inventory into a malloc'd array (*out, *n).  Returns 0 or -1. */
int dsv4_inventory_list(const dsv4_config *cfg, dsv4_inv_entry **out, int64_t *n, dsv4_err *err);

const char *dsv4_wfmt_name(dsv4_wfmt f);

/* Binds every tensor of st into *m according to cfg.  On failure every problem
 * found is listed in err (truncated if very long), and *m is left empty. */
int dsv4_weights_bind(dsv4_model_w *m, const dsv4_config *cfg, const dsv4_st *st, dsv4_err *err);
/* Same, and on failure also returns in *report (malloc'd, caller frees; may be
 * NULL) the problems one per line: up to 20, then "... and N more".  err gets a
 * one-line summary with as many problems as fit. */
int dsv4_weights_bind_report(dsv4_model_w *m, const dsv4_config *cfg, const dsv4_st *st, char **report,
                             dsv4_err *err);
/* Compares the hyperparameters that set tensor shapes (hidden_size, vocab_size,
 * q_lora_rank, heads, experts, layer counts ...) against telltale tensors of st.
 * Returns 0 if they agree, else -1 with err naming the config key, its value and
 * the tensor that contradicts it.  Used to explain a wholesale shape mismatch. */
int dsv4_weights_check_config(const dsv4_config *cfg, const dsv4_st *st, dsv4_err *err);
void dsv4_weights_free(dsv4_model_w *m);

#endif
