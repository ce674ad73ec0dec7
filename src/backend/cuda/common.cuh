/* backend/cuda/common.cuh: what every CUDA kernel file shares (included by .cu files only).
 *
 * - CK(expr): every CUDA call goes through it (STYLE §8).  Ops cannot return
 *   errors (backend.h), so a failure is recorded in the backend's sticky error
 *   (first one wins: expression, file, line, CUDA's message) and every later op
 *   becomes a no-op until the engine reads it through ops->check.
 * - exact device codecs (bf16 RNE, e4m3fn, e8m0, e2m1): bit-for-bit the host ones
 *   in model/quant.c, so quantization simulations agree exactly with the CPU.
 * - dweight: a weight as the kernels see it (device pointers, stored format).
 * - memory: activations allocated through ops->alloc are device memory; sequence
 *   state and index lists are host memory.  An op takes device arguments as they are
 *   and stages host ones (dsv4_cuda_in/out/commit), so a chain of ops on activations
 *   runs without host synchronization; weights are uploaded once in stored formats.
 * Target: sm_90a (H100/H200); the bulk-copy pipeline below needs sm_90.
 */
#ifndef DSV4_BACKEND_CUDA_COMMON_CUH
#define DSV4_BACKEND_CUDA_COMMON_CUH

#include <cuda_runtime.h>
#include <stdint.h>
#include <string.h>

extern "C" {
#include "backend/backend.h"
#include "backend/cuda/cuda.h"
}

/* ----- device view of a weight ----- */
struct dweight {
    int fmt;               /* dsv4_wfmt */
    int64_t rows, cols;
    const uint8_t *data;   /* device */
    const uint8_t *scale;  /* device (FP8 block scales, MXFP4 e8m0, NVFP4 e4m3) */
    int scale_f32, block;
    float scale2;
    int e8_bf16; /* FP8 with e8m0 scales, every scale code in [3, 246]: each value * scale is finite and exact in bf16 */
};

/* ----- backend state ----- */
struct wentry {
    const void *key;       /* host data pointer of the weight */
    uint8_t *data, *scale; /* device copies */
    int e8_bf16;           /* dweight.e8_bf16, found at the upload */
};

/* The MoE's combine of one row r at 4 adjacent columns d (k_moe_combine_u's arithmetic, shared
 * with k_hc_dec's fused form so that both give the same bits): out[r][d] = (sum over the row's
 * first k <= 8 combine-order slots s >= 0 of cw[s] y[s][d]) * out_scale + y[nrs + r][d] (the
 * shared expert's row, if any), rounded to bf16 if act_bf16.  y, order and cw are written by
 * earlier kernels and read through L2: y after the PDL wait, order and cw (the plan's, two kernels
 * or more back) before it in k_hc_dec (moe_comb_row_load). */
struct moe_comb {
    float *out;                 /* where the combine writes (the moe op's out) */
    const float *y;             /* [nrs + rows][dim] expert outputs, routed slots then shared rows */
    const int32_t *order;       /* [rows][k] slots in combine order, -1 skipped */
    const float *cw;            /* [rows][k] their weights */
    int k, nrs, has_shared, act_bf16;
    float out_scale;
};

struct cuda_impl {
    int device;
    int nsm;                    /* the device's SMs (read once at init) */
    cudaStream_t stream;
    char errmsg[512];      /* sticky first error, "" = none */
    int failed;
    int recoverable;       /* every failure so far was an allocation out of device or pinned memory: the
                            * context is fine, so ops->check reports it and then brings the backend back */
    long recovered;        /* failures reported and recovered from (dsv4_cuda_recovered) */
    size_t attn_sc_max;    /* sparse attention's scratch per launch (attn.cu attn_rows_per_call; bytes) */
    long attn_parts;       /* sparse attention launches (a call cut into row chunks counts each) */
    int topk_w;            /* DSV4_CUDA_TOPK_W: 1 (default) rows of 8193..16384 on k_topk_w, 2 all <= 16384, 0 none */
    long topk_w_calls;     /* topk calls that took k_topk_w (dsv4_cuda_topk_w_calls) */
    /* weight map: open addressing on the host data pointer */
    wentry *map;
    size_t map_cap, map_n;
    uint8_t *pool;         /* one allocation for the weights uploaded by load_weights */
    size_t pool_bytes, pool_used;
    /* device scratch arena (bump allocator, reset at the start of every op) */
    uint8_t *scratch;
    size_t scratch_cap, scratch_top, scratch_want;
    void *spill[64];
    int n_spill;
    /* pinned staging arena: op inputs are copied here then sent asynchronously; outputs
     * land here and are copied to their host buffers once, after one sync at op end.
     * Emptied only when the stream is idle (dsv4_cuda_idle), so no op waits for the
     * previous op's uploads. */
    uint8_t *pin;
    size_t pin_cap, pin_top, pin_want;
    struct {
        void *dst;
        const void *src;
        size_t n;
    } pend[32];
    int n_pend;
    /* device allocations made by ops->alloc (the forward pass's activations) */
    /* sorted by address (binary search in dsv4_cuda_is_dev); grows with the number of
     * sequences, whose state is allocated here too */
    struct dev_range {
        uintptr_t base;
        size_t size;
    } *dev;
    int n_dev, dev_cap;
    /* host scratch for gathers (pinned) */
    uint8_t *hbuf;
    size_t hbuf_cap;
    /* per-op timing (bench): accumulated milliseconds and calls */
    int timing;
    cudaEvent_t ev0, ev1;
    double op_ms[DSV4_CUDA_N_OPS];
    double op_host_ms[DSV4_CUDA_N_OPS]; /* host time from op begin to op end (before the wait) */
    double op_t0;
    double issue_s, segment_s;  /* host seconds inside ops (always counted) / ending captures */
    long op_calls[DSV4_CUDA_N_OPS];
    size_t weight_bytes_read;   /* bytes of weights streamed by matmul/moe since the last reset */
    long gm_launches;           /* k_gemv_multi launches (gemv_multi.cu), for the tests */
    /* device-side state of the sync-free ops (moe.cu): sticky device flags, the routed
     * weight-byte counter, per-layer expert tables; NULL until first use */
    struct cuda_devside *devside;
    unsigned devside_flags;     /* the device flags as last fetched (dsv4_cuda_devside_fetch) */
    long ops_since_check;       /* ops begun since the last ops->check */
    dsv4_backend_ops ops;       /* this backend's op table (backend.cu: ops_select) */
    int flags_fetched;          /* devside_flags were fetched by a download after the last op (cu_copy) */
    /* CUDA graphs (backend.cu, "segments"): the ops between two ops->segment marks are captured
     * and launched as one graph; executables are cached per segment key and structure */
    int graphs;                 /* 1 = capture segments (DSV4_CUDA_GRAPHS=0 turns it off) */
    int graph_log;              /* DSV4_CUDA_GRAPH_LOG=1: say on stderr why an executable was made */
    int capturing, seg_key;
    uint64_t seg_sig;           /* structure of the capture in progress (dsv4_cuda_seg_note) */
    long seg_nodes;
    struct gvariant {
        cudaGraphExec_t exec;
        uint64_t sig;
        unsigned long used;
    } *gcache;                  /* [gkeys][DSV4_CUDA_GVARIANTS] */
    int gkeys;
    unsigned long gclock;
    long g_launch, g_update, g_inst; /* counters: graph launches, updates, instantiations */
    double wait_s;              /* host seconds spent in dsv4_cuda_sync */
    /* device time of launched graphs: an event pair around each launch, read at the next sync */
    cudaEvent_t gev[2][64];
    int n_gev;
    double graph_gpu_s;
    /* the side chain (ops->side / ops->join, backend.cu "side chain"): a second stream of the
     * highest priority, its fork / join events and its own scratch arena (swapped with the
     * fields above while ops go to it: stream and arena then name the side's) */
    cudaStream_t side_stream, main_stream;
    cudaEvent_t side_fork, side_join;
    int side_state;             /* 0 none open, 1 ops go to the side stream, 2 open, ops go to the main stream */
    int side_ok;                /* the stream, events and arena exist (else side chains run in order) */
    uint8_t *side_scratch;      /* the other arena (the side's while the main one is in use, and back) */
    size_t side_cap, side_top, side_want;
    long side_forks, side_forced; /* counters (stats, tests): chains opened, chains joined early */
    /* deferred Sinkhorn (mhc.cu, DSV4_HC_COMB_LOGITS): ops begun so far, and the comb the last
     * hc op left as logits with the op count it was written at; its reader forms the matrix
     * before its PDL wait unless it is the very next op */
    unsigned long op_seq;
    long rn_fused, rn_alone; /* counters (tests): matmul_rn calls by path */
    /* the last matmul_rn that launched on the main stream (op count rn_op): its input and output device
     * bytes (op_list_beside's check, oplist.cu) */
    unsigned long rn_op;
    const void *rn_x, *rn_out;
    size_t rn_x_n, rn_out_n;
    long ol_beside_early, ol_beside_late; /* counters (tests): op_list_beside calls launched early or not */
    const void *hc_lg_ptr;
    unsigned long hc_lg_op;
    long hc_lg_early, hc_lg_late; /* counters (tests): readers that formed it before / after the wait */
    /* the MoE's combine handed to the next op (DSV4_CUDA_HC_COMB=1, moe.cu "combine into hc"): the
     * moe op leaves its combine pending when it may be fused into the hc_post_pre_norm that reads
     * out; that op takes it (k_hc_dec forms o itself), anything else launches it first
     * (dsv4_cuda_comb_flush).  scratch_floor: bytes of the arena the next reset keeps (the
     * pending combine's inputs), 0 after it */
    int hc_comb;                /* the switch (read at init; dsv4_cuda_set_hc_comb for the tests) */
    int hc_dist;                /* DSV4_CUDA_HC_DIST=1: k_hc_dec's y and norm spread over its blocks (mhc.cu) */
    int pool_pre;               /* DSV4_CUDA_POOL_PRE (default on): k_pool_tab<16> loads every row first (attn.cu) */
    long hc_dist_n;             /* counter (tests): k_hc_dec launches that took it */
    struct comb_pending {
        int on;
        moe_comb m;
        int64_t dim;
        int rows;
        size_t keep;            /* the arena's top when it was left pending */
    } comb_pend;
    size_t scratch_floor;
    long hc_comb_taken, hc_comb_flushed; /* counters (tests) */
};
#define DSV4_CUDA_GVARIANTS 6

static inline cuda_impl *CI(dsv4_backend *b) { return (cuda_impl *)b->impl; }

/* records the first CUDA error; returns nonzero if this call failed */
int dsv4_cuda_fail(dsv4_backend *b, const char *expr, const char *file, int line, cudaError_t e);
#define CK(b, expr) (((expr) == cudaSuccess) ? 0 : dsv4_cuda_fail((b), #expr, __FILE__, __LINE__, cudaGetLastError()))
#define CKL(b) dsv4_cuda_fail_if((b), __FILE__, __LINE__)
int dsv4_cuda_fail_if(dsv4_backend *b, const char *file, int line); /* after a launch */

/* ----- programmatic dependent launch (PDL) -----
 * Every kernel starts with pdl_enter() (or, where it first reads only weights, issues those
 * reads and then calls pdl_enter()): griddepcontrol.wait blocks until the grids this launch
 * depends on in stream order have completed and their writes are visible, then
 * griddepcontrol.launch_dependents lets the next kernel of the stream be scheduled while this
 * one runs.  Launches go through dsv4_launch, which sets the programmatic-serialization
 * attribute unless DSV4_CUDA_PDL=0 (dsv4_cuda_pdl, read at backend init); without it the wait
 * returns at once (the launch is fully ordered).  Nothing before the wait may read an
 * activation or write anything: only weights, which no kernel writes, and the arguments.  The
 * same kernels, arguments and arithmetic run either way, so the switch changes timing only,
 * never values.  In a graph capture the attribute becomes a programmatic edge between the two
 * kernel nodes.  The multi-wave prefill GEMMs (k_sgemm, k_gemm_fp8, k_mg_up, k_mg_down) only
 * wait: a kernel that never triggers lets its dependents launch when it completes, so their
 * early-resident blocks do not take SM slots from its later waves.
 * Because the trigger comes after the wait, when a kernel starts the one before its predecessor
 * has completed; a few kernels read activations before their wait on that rule (an operand written
 * two or more kernels back: k_moe_b1r's down half, k_hc_dec's comb_in).  One kernel may trigger
 * first and wait at its end instead (early): k_op_list with p.early (op_list_beside), only where
 * the backend has seen its reads complete and nothing shared with the kernel before it
 * (oplist.cu).  The kernel after an early one may start before the early one's predecessor has
 * completed, so it must not lean on the rule above: in the forward pass the early list is
 * followed by another op list, which reads nothing before its wait. */
__device__ __forceinline__ void pdl_wait() { asm volatile("griddepcontrol.wait;" ::: "memory"); }
__device__ __forceinline__ void pdl_trigger() { asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); }
__device__ __forceinline__ void pdl_enter() {
    pdl_wait();
    pdl_trigger();
}
extern int dsv4_cuda_pdl; /* 1: launches carry the PDL attribute (default); DSV4_CUDA_PDL=0: 0 */
/* 1: k_gemv asks for its first pass's weights before its PDL wait (default); DSV4_CUDA_GEMV_EARLY=0: 0 */
extern int dsv4_cuda_gemv_early;
/* 1: kernels ask L2 before their PDL wait for activations an earlier op wrote, which the weight streams
 * since have likely evicted (default); DSV4_CUDA_L2PF=0: 0.  A prefetch returns no value, so it may
 * precede the wait whoever writes the line: L2 is where the GPU's writes meet, values never change */
extern int dsv4_cuda_l2pf;
/* DSV4_CUDA_GM_EARLY=N >= 2: k_gemv_multi asks for its weights before its PDL wait only in the blocks whose
 * index is a multiple of N, the others after it (default 2 since stop 48: the early loads of k_gemv_multi2
 * delay the hc finisher's partial sums behind them, docs/CUDA.md); 1: in every block (the default before);
 * 0: in none */
extern int dsv4_cuda_gm_early;
/* 1: DSV4_CUDA_HC_STAMP=1, k_hc_dec's phase stamps (mhc.cu), printed at the backend's free */
extern int dsv4_cuda_hc_stamp;
void dsv4_cuda_hc_stamp_dump(void);
__device__ __forceinline__ void d_prefetch_l2(const void *p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }

static inline cudaLaunchConfig_t pdl_config(cudaLaunchAttribute *at, dim3 grid, dim3 block, size_t smem,
                                            cudaStream_t st) {
    at->id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at->val.programmaticStreamSerializationAllowed = 1;
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cfg.attrs = at;
    cfg.numAttrs = dsv4_cuda_pdl ? 1 : 0;
    return cfg;
}
/* k<<<grid, block, smem, st>>>(args...) with the PDL attribute (dsv4_cuda_pdl): the arguments
 * convert to k's parameter types as in a <<<>>> launch; check it with CKL as a <<<>>> launch */
template <typename... P, typename... A>
static inline cudaError_t dsv4_launch(void (*k)(P...), dim3 grid, dim3 block, size_t smem, cudaStream_t st,
                                      A &&...args) {
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t cfg = pdl_config(at, grid, block, smem, st);
    return cudaLaunchKernelEx(&cfg, k, static_cast<A &&>(args)...);
}
/* dsv4_launch with the PDL attribute only if pdl (and dsv4_cuda_pdl) */
template <typename... P, typename... A>
static inline cudaError_t dsv4_launch_pdl(int pdl, void (*k)(P...), dim3 grid, dim3 block, size_t smem,
                                          cudaStream_t st, A &&...args) {
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t cfg = pdl_config(at, grid, block, smem, st);
    if (!pdl) cfg.numAttrs = 0;
    return cudaLaunchKernelEx(&cfg, k, static_cast<A &&>(args)...);
}
/* the same for a kernel known by address, its arguments packed (cudaLaunchKernel's form) */
static inline cudaError_t dsv4_launch_ptr(const void *k, dim3 grid, dim3 block, void **args, size_t smem,
                                          cudaStream_t st) {
    cudaLaunchAttribute at[1];
    cudaLaunchConfig_t cfg = pdl_config(at, grid, block, smem, st);
    return cudaLaunchKernelExC(&cfg, k, args);
}

/* moe.cu: the moe op leaves its combine pending (1) or not (0: the caller launches it); a pending
 * combine is launched by flush, or taken (1) by the hc_post_pre_norm whose o is its out */
int dsv4_cuda_comb_defer(dsv4_backend *b, const moe_comb *m, int64_t dim, int rows, int unrolled);
void dsv4_cuda_comb_flush(dsv4_backend *b);
int dsv4_cuda_comb_take(dsv4_backend *b, const float *o, int rows, int64_t dim, moe_comb *m);

/* closes an open side chain (ops->join's work): every later op starts after both chains */
void dsv4_cuda_side_close(dsv4_backend *b);

/* device scratch: NULL (and sticky error) on failure; valid until the next op */
void *dsv4_cuda_scratch(dsv4_backend *b, size_t bytes);
void dsv4_cuda_scratch_reset(dsv4_backend *b);
/* pinned host scratch of at least n bytes (grown, contents lost); NULL on failure */
void *dsv4_cuda_hbuf(dsv4_backend *b, size_t bytes);
/* uploads n bytes of host memory into fresh scratch and returns the device copy */
void *dsv4_cuda_stage(dsv4_backend *b, const void *host, size_t bytes);
/* 1 if p lies in a buffer of ops->alloc (device memory) */
int dsv4_cuda_is_dev(dsv4_backend *b, const void *p);
/* an op's input: p itself if it is device memory, else a staged copy */
void *dsv4_cuda_in(dsv4_backend *b, const void *p, size_t bytes);
/* an op's output: p itself if it is device memory, else scratch to be committed */
void *dsv4_cuda_out(dsv4_backend *b, void *p, size_t bytes);
/* after the kernels: copies d back to host p when they differ (queued, done at op end) */
void dsv4_cuda_commit(dsv4_backend *b, void *p, const void *d, size_t bytes);
/* queues a device -> host copy; the host buffer holds it once the op ends (dsv4_cuda_flush) */
void dsv4_cuda_fetch(dsv4_backend *b, void *host, const void *dev, size_t bytes);
void dsv4_cuda_flush(dsv4_backend *b);
/* call right after the stream was synchronized: hands out queued outputs and empties the
 * pinned arena (nothing in flight can still read it) */
void dsv4_cuda_idle(dsv4_backend *b);
/* device view of w (uploads it on first use if load_weights did not); 0 or -1 */
int dsv4_cuda_weight(dsv4_backend *b, const dsv4_weight *w, dweight *out);

/* waits for the stream (ending a graph capture in progress first: nothing may wait while
 * capturing); 0 or -1 (sticky error) */
int dsv4_cuda_sync(dsv4_backend *b);
/* ends a graph capture in progress and launches it (no-op when not capturing) */
void dsv4_cuda_seg_end(dsv4_backend *b);
/* records one node of the capture in progress in its signature: a kernel launch, a copy or
 * a memset issued into the stream (what < 16), the end of op 16 + id, or a side chain's
 * fork, re-entry or join (edges, no node: above every op's code) */
#define DSV4_SEG_KERNEL 1u
#define DSV4_SEG_COPY 2u
#define DSV4_SEG_MEMSET 3u
#define DSV4_SEG_SIDE_FORK (16u + DSV4_CUDA_N_OPS)
#define DSV4_SEG_SIDE_AGAIN (17u + DSV4_CUDA_N_OPS)
#define DSV4_SEG_SIDE_JOIN (18u + DSV4_CUDA_N_OPS)
void dsv4_cuda_seg_note(dsv4_backend *b, unsigned what);

/* Device-side state (moe.cu).  Ops that read indices from device memory check them
 * there; a bad one is skipped and sets a bit of a sticky device word, which
 * ops->check turns into the backend's sticky error. */
#define DSV4_DEVFLAG_PICK 1u   /* sparse_attn: a top-k pick outside the row's compressed rows */
#define DSV4_DEVFLAG_EXPERT 2u /* moe: an expert id outside [0, n_routed) */
unsigned *dsv4_cuda_devflags(dsv4_backend *b); /* the device word (NULL + sticky error on failure) */
/* queues a copy of the device flags into devside_flags (completed by the next sync) */
void dsv4_cuda_devside_fetch(dsv4_backend *b);
int dsv4_cuda_devside_check(dsv4_backend *b);  /* after fetch + sync: 1 if a flag was set (now the sticky error) */
/* routed expert weight bytes counted on the device since the last reset (reset: zero it) */
double dsv4_cuda_devside_weight_bytes(dsv4_backend *b, int reset);
void dsv4_cuda_devside_free(dsv4_backend *b);

/* op timing bracket for bench (no-ops unless timing is on) */
void dsv4_cuda_op_begin(dsv4_backend *b);
void dsv4_cuda_op_end(dsv4_backend *b, int op);

/* ----- exact scalar codecs (mirror model/quant.c) ----- */
__device__ __forceinline__ float d_bf16_to_f32(uint16_t h) { return __uint_as_float((uint32_t)h << 16); }
__device__ __forceinline__ float d_round_bf16(float f) {
    uint32_t b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return __uint_as_float(((b >> 16) | 0x0040u) << 16);
    b += 0x7fffu + ((b >> 16) & 1u);
    return __uint_as_float((b >> 16) << 16);
}
__device__ __forceinline__ float d_e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15 && m == 7) return __uint_as_float(sign | 0x7fc00000u);
    if (e == 0) return __uint_as_float(__float_as_uint((float)m * 0x1p-9f) | sign);
    return __uint_as_float(sign | ((e + 120u) << 23) | (m << 20));
}
__device__ __forceinline__ uint8_t d_f32_to_e4m3(float f) {
    uint32_t b = __float_as_uint(f);
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a >= 0x43e00000u) return sign | 0x7eu;
    if (a < 0x3c800000u) return sign | (uint8_t)rintf(__uint_as_float(a) * 512.0f);
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}
__device__ __forceinline__ float d_e8m0_to_f32(uint8_t c) {
    if (c == 0xff) return __uint_as_float(0x7fc00000u);
    if (c == 0) return __uint_as_float(0x00400000u);
    return __uint_as_float((uint32_t)c << 23);
}
/* e2m1 by bit assembly (a lookup array indexed at run time would live in local memory):
 * exponent field e = bits 2..1, mantissa m = bit 0; e = 0 is 0 or 0.5, else (1 + m/2) 2^(e-1). */
__device__ __forceinline__ float d_e2m1_to_f32(uint32_t nib) {
    uint32_t e = (nib >> 1) & 3u, m = nib & 1u;
    uint32_t bits = e ? (((e + 126u) << 23) | (m << 22)) : (m ? 0x3f000000u : 0u);
    return __uint_as_float(bits | ((nib & 8u) << 28));
}
__device__ __forceinline__ float d_e2m1_round_abs(float a) {
    if (a <= 0.25f) return 0.0f;
    if (a < 0.75f) return 0.5f;
    if (a <= 1.25f) return 1.0f;
    if (a < 1.75f) return 1.5f;
    if (a <= 2.5f) return 2.0f;
    if (a < 3.5f) return 3.0f;
    if (a <= 5.0f) return 4.0f;
    return 6.0f;
}
__device__ __forceinline__ float d_pow2_ceil(float v) {
    uint32_t b = __float_as_uint(v);
    int32_t e = (int32_t)((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0);
    return __uint_as_float((uint32_t)(e + 127) << 23);
}

/* One element W[r][c] of any stored format (slow path; kernels use it for
 * partial blocks and odd shapes, and small vectors). */
__device__ __forceinline__ float d_weight_at(const dweight &w, int64_t r, int64_t c) {
    switch (w.fmt) {
    case DSV4_WF_F32: return ((const float *)w.data)[r * w.cols + c];
    case DSV4_WF_BF16: return d_bf16_to_f32(((const uint16_t *)w.data)[r * w.cols + c]);
    case DSV4_WF_FP8: {
        int64_t scols = (w.cols + w.block - 1) / w.block;
        int64_t si = (r / w.block) * scols + c / w.block;
        float s = w.scale_f32 ? ((const float *)w.scale)[si] : d_e8m0_to_f32(w.scale[si]);
        return d_e4m3_to_f32(w.data[r * w.cols + c]) * s;
    }
    case DSV4_WF_MXFP4: {
        uint8_t byte = w.data[r * ((w.cols + 1) / 2) + c / 2];
        float s = d_e8m0_to_f32(w.scale[r * ((w.cols + 31) / 32) + c / 32]);
        return d_e2m1_to_f32(c & 1 ? byte >> 4 : byte & 15) * s;
    }
    case DSV4_WF_NVFP4: {
        uint8_t byte = w.data[r * ((w.cols + 1) / 2) + c / 2];
        float s = d_e4m3_to_f32(w.scale[r * ((w.cols + 15) / 16) + c / 16]) * w.scale2;
        return d_e2m1_to_f32(c & 1 ? byte >> 4 : byte & 15) * s;
    }
    default: return 0.0f;
    }
}

/* W[o][k .. k+8) dequantized with the exact codecs above (the CPU's values); k is a multiple
 * of 8 and the 8 values share one scale (the tiled GEMMs: gemm.cu, moe_gemm.cu) */
template <int FMT>
__device__ __forceinline__ void d_load_w8(const dweight &w, int64_t o, int64_t k, float (&v)[8]) {
    const int64_t K = w.cols;
    if (FMT == DSV4_WF_F32) {
        const float4 *p = (const float4 *)((const float *)w.data + o * K + k);
        float4 a = __ldg(p), b = __ldg(p + 1);
        v[0] = a.x, v[1] = a.y, v[2] = a.z, v[3] = a.w, v[4] = b.x, v[5] = b.y, v[6] = b.z, v[7] = b.w;
    } else if (FMT == DSV4_WF_BF16) {
        uint4 u = __ldg((const uint4 *)((const uint16_t *)w.data + o * K + k));
        const uint16_t *h = (const uint16_t *)&u;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = d_bf16_to_f32(h[i]);
    } else if (FMT == DSV4_WF_FP8) {
        uint2 u = __ldg((const uint2 *)(w.data + o * K + k));
        int64_t scols = (K + w.block - 1) / w.block, si = (o / w.block) * scols + k / w.block;
        float s = w.scale_f32 ? __ldg((const float *)w.scale + si) : d_e8m0_to_f32(__ldg(w.scale + si));
        const uint8_t *c = (const uint8_t *)&u;
#pragma unroll
        for (int i = 0; i < 8; i++) v[i] = d_e4m3_to_f32(c[i]) * s;
    } else { /* MXFP4 / NVFP4: byte j holds element 2j (low nibble) and 2j+1 */
        uint32_t u = __ldg((const unsigned int *)(w.data + o * (K / 2) + k / 2));
        float s = FMT == DSV4_WF_MXFP4 ? d_e8m0_to_f32(__ldg(w.scale + o * (K / 32) + k / 32))
                                       : d_e4m3_to_f32(__ldg(w.scale + o * (K / 16) + k / 16)) * w.scale2;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            uint32_t byte = (u >> (8 * i)) & 0xffu;
            v[2 * i] = d_e2m1_to_f32(byte & 15u) * s;
            v[2 * i + 1] = d_e2m1_to_f32(byte >> 4) * s;
        }
    }
}

/* ----- reductions ----- */
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
/* ----- act_quant of an input row as it is staged in shared memory ----- */

/* act_quant of the 4 values v of one lane, the warp's 32 float4s being one block of 128:
 * k_act_quant's arithmetic value for value (the same block maximum, NaN for the whole block
 * when one value is inf or NaN, the same scale, the same conversions), so the same bits */
__device__ __forceinline__ float4 d_aq128_f4(float4 v) {
    float a0 = fabsf(v.x), a1 = fabsf(v.y), a2 = fabsf(v.z), a3 = fabsf(v.w);
    int bad = !(a0 <= 3.40282347e38f) | !(a1 <= 3.40282347e38f) | !(a2 <= 3.40282347e38f) | !(a3 <= 3.40282347e38f);
    float amax = warp_max(fmaxf(fmaxf(a0, a1), fmaxf(a2, a3)));
    if (__any_sync(0xffffffffu, bad)) {
        const float n = __uint_as_float(0x7fc00000u);
        return make_float4(n, n, n, n);
    }
    if (amax < 1e-4f) amax = 1e-4f;
    const float s = d_pow2_ceil(amax * (1.0f / 448.0f)), inv = 1.0f / s;
    return make_float4(d_e4m3_to_f32(d_f32_to_e4m3(v.x * inv)) * s, d_e4m3_to_f32(d_f32_to_e4m3(v.y * inv)) * s,
                       d_e4m3_to_f32(d_f32_to_e4m3(v.z * inv)) * s, d_e4m3_to_f32(d_f32_to_e4m3(v.w * inv)) * s);
}

/* x[0, K) into xs (K floats of shared memory) by float4, every thread of the block taking its
 * share: as it is, or (aq) act_quant in blocks of 128 (d_aq128_f4: the caller guarantees
 * K % 128 == 0 and x 16-byte aligned, so a warp's 32 float4s are one block and its lanes are all
 * in the loop or all out).  A thread's loads go out four at a time before any of them is used
 * (one L2 round trip per four, not per float4).  No barrier: the caller's __syncthreads follows. */
__device__ __forceinline__ void d_stage_x(float *xs, const float *__restrict__ x, int K, int aq) {
    const int n4 = K / 4, nt = (int)blockDim.x;
    for (int i0 = (int)threadIdx.x; i0 < n4; i0 += 4 * nt) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            v[u] = i0 + u * nt < n4 ? __ldg((const float4 *)x + i0 + u * nt) : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
        for (int u = 0; u < 4; u++) {
            if (i0 + u * nt >= n4) break; /* warp-uniform (above) */
            ((float4 *)xs)[i0 + u * nt] = aq ? d_aq128_f4(v[u]) : v[u];
        }
    }
}

/* The sum over nt threads (a multiple of 32; lt this thread's index among them, sh their nt/32
 * slots): a warp xor tree, then the warps' partials in lanes, zeros past them, by a second xor
 * tree; every thread gets it.  Every thread of the block calls it (two __syncthreads), so a vector
 * summed by nt threads of a larger block (k_op_list) gets the bits of a block of its own. */
__device__ __forceinline__ float d_part_sum(float v, float *sh, int lt, int nt) {
    int lane = lt & 31, wid = lt >> 5, nw = nt >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : 0.0f;
    return warp_sum(v);
}
/* block-wide sum/max for blockDim.x a multiple of 32 (<= 1024); every thread gets the result */
__device__ __forceinline__ float block_sum(float v, float *sh /* 32 floats */) {
    return d_part_sum(v, sh, (int)threadIdx.x, (int)(blockDim.x + 31) & ~31);
}
__device__ __forceinline__ float block_max(float v, float *sh) {
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[wid] = v;
    __syncthreads();
    v = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(v);
}

/* two e4m3 bytes (low byte first) to floats by the sm_89+ e4m3x2 -> f16x2 instruction:
 * every e4m3 value, subnormals included, is exact in f16 and then in f32, and the NaN codes
 * stay NaN, so this equals d_e4m3_to_f32 at ~1 instruction per value instead of ~8 */
__device__ __forceinline__ float2 d_e4m3x2_to_f32x2(uint16_t v) {
    uint32_t h;
    float lo, hi;
    asm("cvt.rn.f16x2.e4m3x2 %0, %1;" : "=r"(h) : "h"(v));
    asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, u;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(h));
    return make_float2(lo, hi);
}

/* DSV4_CUDA_EVF (compile time: make CUDA=1 CUDA_EVF=0|1|2; the Makefile's default 2 since stop 48): the weight
 * streams of the decode kernels (d_ld_stream16; the MoE's stage copies b1_cp16 only with DSV4_CUDA_EVF_CP,
 * moe.cu) carry the L2 policy evict_first.  A step streams ~5.7 GB of weights once through a 50 MB L2, and with
 * the default policy they evict what the step reads again: the code of the latency-bound kernels, the hc
 * state, the KV rows.  Values never change (a cache hint).  Measured on an H100, 20 Flash layers
 * (docs/PERFORMANCE.md): with every MoE copy hinted too, 0.1 ms a step faster (stop 45) and 0.06 (stop 46), but
 * k_moe_bnr's hinted copies stopped on an illegal instruction (a known ptxas fault, moe.cu); with them plain
 * (DSV4_CUDA_EVF_CP=0) every GPU test passed and the step was level with no hint (stop 47); with the one-row
 * kernels' copies hinted (DSV4_CUDA_EVF_CP=1) every GPU test passed and greedy decode was 0.06 ms a step
 * faster at 2K in each of 4 rounds (stop 48), hence the default.  Without -D (a build outside the Makefile)
 * no hint. */
#ifndef DSV4_CUDA_EVF
#define DSV4_CUDA_EVF 0
#endif
/* DSV4_CUDA_EVF_CP (make CUDA_EVF_CP=0|1|2): which of the MoE's cp.async stage copies carry the hint too
 * (moe.cu B1_HINT, BN_HINT); without -D none */
#ifndef DSV4_CUDA_EVF_CP
#define DSV4_CUDA_EVF_CP 0
#endif
/* DSV4_CUDA_EVF=1 forms the policy with createpolicy at each use (inside whatever branch the use
 * sits in: bm_run's copies sit under a per-lane condition); =2 takes it as a constant, the value
 * createpolicy.fractional.L2::evict_first with fraction 1.0 gives (the encoding CUTLASS names
 * CacheHintSm90::EVICT_FIRST), so ptxas can keep it in a uniform register whatever the branch.
 * bm_run's (moe.dot=mma) copies carry no hint in either: with it they stopped on an illegal instruction
 * under =1 (stop 43) and under =2 (stop 45), so the cause is not createpolicy (moe.cu, b1_cp16_plain). */
__device__ __forceinline__ unsigned long long d_pol_stream() {
#if DSV4_CUDA_EVF == 2
    return DSV4_CUDA_POL_EVICT_FIRST;
#else
    unsigned long long p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
#endif
}

/* 16 weight bytes that are read once per call: no L1 allocation (they would only evict the
 * activations that are reused), and evict_first in L2 (DSV4_CUDA_EVF) */
__device__ __forceinline__ uint4 d_ld_stream16(const void *p) {
    uint4 v;
#if DSV4_CUDA_EVF
    asm("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p), "l"(d_pol_stream()));
#else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
#endif
    return v;
}
/* 4 f32 weights read once a step (the hc kernels' fn rows, 1.5 MB a call at Flash's shapes): under
 * DSV4_CUDA_EVF as d_ld_stream16 (evict_first), else __ldg as before */
__device__ __forceinline__ float4 d_ld_stream_f4(const float *p) {
#if DSV4_CUDA_EVF
    uint4 v = d_ld_stream16(p);
    return make_float4(__uint_as_float(v.x), __uint_as_float(v.y), __uint_as_float(v.z), __uint_as_float(v.w));
#else
    return __ldg((const float4 *)p);
#endif
}

/* ----- bulk-copy stage pipeline (sm_90: cp.async.bulk + mbarrier) -----
 * A block streams contiguous weight bytes into shared-memory stages with the bulk-copy
 * engine: no registers hold bytes in flight, so several stages per block stay in flight
 * while the warps compute on an earlier one.  Protocol (one producer thread):
 *   d_mbar_init(bar, 1) by one thread, d_mbar_fence_init(), __syncthreads();
 *   producer: d_mbar_expect(bar, total bytes of the stage), then d_bulk_g2s(...) for each
 *     piece (16-byte aligned source and destination, size a multiple of 16);
 *   consumers: d_mbar_wait(bar, phase) where phase = (use count of this stage) & 1;
 *   a stage is refilled only after a __syncthreads() that follows every read of it. */
__device__ __forceinline__ uint32_t d_smem_addr(const void *p) { return (uint32_t)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void d_mbar_init(uint64_t *bar, uint32_t count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(d_smem_addr(bar)), "r"(count) : "memory");
}
__device__ __forceinline__ void d_mbar_fence_init() { asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory"); }
__device__ __forceinline__ void d_mbar_expect(uint64_t *bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(d_smem_addr(bar)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void d_bulk_g2s(void *dst, const void *src, uint32_t bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     d_smem_addr(dst)),
                 "l"(src), "r"(bytes), "r"(d_smem_addr(bar))
                 : "memory");
}
__device__ __forceinline__ void d_mbar_wait(uint64_t *bar, uint32_t phase) {
    uint32_t a = d_smem_addr(bar), done = 0;
    while (!done)
        asm volatile("{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
                     "selp.u32 %0, 1, 0, p;\n\t}"
                     : "=r"(done)
                     : "r"(a), "r"(phase)
                     : "memory");
}

/* 16 bytes global -> shared without registers (cp.async, L1 bypassed; both addresses 16-byte
 * aligned); complete after cp.async.wait_group / wait_all for the issuing thread only */
__device__ __forceinline__ void d_cp_async16(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d_smem_addr(dst)),
                 "l"(__cvta_generic_to_global(src))
                 : "memory");
}

/* cp.async groups: close the thread's current group; wait until at most N of its groups are pending */
__device__ __forceinline__ void d_cp_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void d_cp_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

/* d = A B + c (16 x 8, f32) of one m16n8k16 f16 MMA (moe.cu's MXFP4 path, gemv_mma.cu) */
__device__ __forceinline__ void d_mma_f16(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1, const float (&c)[4]) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%10, %11, %12, %13};"
        : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
}

/* launch helpers used by several files */
void dsv4_cuda_linear(dsv4_backend *b, float *out_d, int64_t ldo, const float *x_d, int64_t ldx, int rows,
                      const dweight &w, int64_t o0, int64_t no, int w_bf16, int out_bf16);
/* the same over groups in one launch: feature o reads x columns from (o / gR) * xg on */
void dsv4_cuda_linear_grouped(dsv4_backend *b, float *out_d, int64_t ldo, const float *x_d, int64_t ldx, int rows,
                              const dweight &w, int64_t o0, int64_t no, int64_t gR, int64_t xg, int w_bf16,
                              int out_bf16);
void dsv4_cuda_act_quant(dsv4_backend *b, float *out_d, const float *x_d, int rows, int64_t K, int block);
/* linear.dot=mma (gemv_mma.cu): out = W x for one row of x on the f16 tensor cores, grouped when
 * xg (feature o reads x columns (o / gR) xg ..); 1 if launched, 0 if k_gemv_mma does not take it */
int dsv4_cuda_gemv_mma(dsv4_backend *b, float *out_d, const float *x_d, const dweight &w, int64_t gR, int64_t xg,
                       int x_bf16, int w_bf16, int out_bf16);
/* the grouped matmul of many rows on the SGEMM (gemm.cu): 1 when it ran, 0 when the GEMV must */
int dsv4_cuda_gemm_grouped(dsv4_backend *b, float *od, const float *xd, int rows, const dsv4_weight *w, int groups,
                           int in_bf16, int out_bf16);
void dsv4_cuda_round_bf16(dsv4_backend *b, float *x_d, size_t n);

/* the MoE's combine at 4 columns (struct moe_comb above) */
__device__ __forceinline__ float moe_comb_fin(float acc, float ys, float out_scale, int act_bf16) {
    float o = __fmaf_rn(acc, out_scale, ys);
    return act_bf16 ? d_round_bf16(o) : o;
}

/* row r's combine order and weights (the plan's; k_hc_dec loads them before its PDL wait: the
 * plan ran two kernels or more before it) */
struct moe_comb_row {
    int sl[8];
    float c[8];
};

__device__ __forceinline__ moe_comb_row moe_comb_row_load(const moe_comb &m, int64_t r) {
    moe_comb_row w;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        w.sl[i] = i < m.k ? __ldcg(m.order + r * m.k + i) : -1;
        w.c[i] = i < m.k ? __ldcg(m.cw + r * m.k + i) : 0.0f;
    }
    return w;
}

__device__ __forceinline__ float4 moe_comb4(const moe_comb &m, const moe_comb_row &w, int64_t dim, int64_t r,
                                           int64_t d) {
    const int *sl = w.sl;
    const float *c = w.c;
    float4 ys = m.has_shared ? __ldcg((const float4 *)(m.y + (int64_t)(m.nrs + r) * dim + d))
                             : make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    float4 v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = __ldcg((const float4 *)(m.y + (int64_t)(sl[i] > 0 ? sl[i] : 0) * dim + d));
    float4 a = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (sl[i] >= 0)
            a = make_float4(__fmaf_rn(c[i], v[i].x, a.x), __fmaf_rn(c[i], v[i].y, a.y), __fmaf_rn(c[i], v[i].z, a.z),
                            __fmaf_rn(c[i], v[i].w, a.w));
    float os = m.out_scale;
    int rb = m.act_bf16;
    return make_float4(moe_comb_fin(a.x, ys.x, os, rb), moe_comb_fin(a.y, ys.y, os, rb),
                       moe_comb_fin(a.z, ys.z, os, rb), moe_comb_fin(a.w, ys.w, os, rb));
}

/* one column (k_moe_combine_u): the same expression per element as moe_comb4, and for k > 8 the
 * later slots added in order after the first 8 */
__device__ __forceinline__ float moe_comb1(const moe_comb &m, int64_t dim, int64_t r, int64_t d) {
    int sl[8];
    float c[8], v[8];
#pragma unroll
    for (int i = 0; i < 8; i++) {
        sl[i] = i < m.k ? m.order[r * m.k + i] : -1;
        c[i] = i < m.k ? m.cw[r * m.k + i] : 0.0f;
    }
    float ys = m.has_shared ? m.y[(int64_t)(m.nrs + r) * dim + d] : 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++) v[i] = m.y[(int64_t)(sl[i] > 0 ? sl[i] : 0) * dim + d];
    float acc = 0.0f;
#pragma unroll
    for (int i = 0; i < 8; i++)
        if (sl[i] >= 0) acc = __fmaf_rn(c[i], v[i], acc);
    for (int i = 8; i < m.k; i++) {
        int s2 = m.order[r * m.k + i];
        if (s2 >= 0) acc = __fmaf_rn(m.cw[r * m.k + i], m.y[(int64_t)s2 * dim + d], acc);
    }
    return moe_comb_fin(acc, ys, m.out_scale, m.act_bf16);
}

#endif
