/* backend/cuda/cuda.h: names shared by the CUDA backend's files (plain C, no CUDA types).
 * The public entry points are in backend/backend.h. */
#ifndef DSV4_BACKEND_CUDA_CUDA_H
#define DSV4_BACKEND_CUDA_CUDA_H

/* ops timed separately by `dsv4 bench` */
enum {
    DSV4_CUDA_OP_EMBED = 0, DSV4_CUDA_OP_MATMUL, DSV4_CUDA_OP_MATMUL_GROUPED, DSV4_CUDA_OP_RMSNORM,
    DSV4_CUDA_OP_ROPE, DSV4_CUDA_OP_SCALE, DSV4_CUDA_OP_SIM, DSV4_CUDA_OP_HC_PRE, DSV4_CUDA_OP_HC_POST,
    DSV4_CUDA_OP_HC_HEAD, DSV4_CUDA_OP_SPARSE_ATTN, DSV4_CUDA_OP_INDEXER, DSV4_CUDA_OP_TOPK, DSV4_CUDA_OP_POOL,
    DSV4_CUDA_OP_ROUTE, DSV4_CUDA_OP_MOE, DSV4_CUDA_OP_ADD, DSV4_CUDA_OP_MATMUL_MULTI, DSV4_CUDA_OP_LIST,
    DSV4_CUDA_OP_ROUTE_MOE, DSV4_CUDA_OP_ARGMAX, DSV4_CUDA_OP_GATHER_IDS,
    DSV4_CUDA_N_OPS
};

struct dsv4_backend;
/* MoE calls (up to 8 rows) that took the bulk-copy path (k_moe_bulk) on this backend: lets the
 * tests prove which kernels they exercised */
long dsv4_cuda_moe_bulk_calls(struct dsv4_backend *b);
/* the one-row MoE geometry this backend is set to (moe.cu's b1_geoms, DSV4_CUDA_MOE_B1G, read at its
 * first one-row call; a weight it does not fit still falls back to k_moe_b1_prev), or -1 (not read yet, or
 * k_moe_bulk): lets the tests prove the variable was read */
int dsv4_cuda_moe_b1_geom(struct dsv4_backend *b);
/* k_moe_bnr's rolled stage loops on this backend (bits 0 / 1: the one-slot gate/up / down, 2 / 3: the
 * multi-slot ones; DSV4_CUDA_MOE_BNR, read when the backend's MoE state is made), or -1 (not made yet): lets
 * the tests prove the variable was read */
int dsv4_cuda_moe_bnr(struct dsv4_backend *b);
/* failures of an allocation out of device or pinned memory that ops->check reported and the
 * backend recovered from (backend.cu cu_recover); other failures stay until the backend is freed */
long dsv4_cuda_recovered(struct dsv4_backend *b);
/* sparse attention's scratch budget per launch in bytes (DSV4_CUDA_ATTN_SC_MB, default 256 MB): a
 * call whose rows need more is cut into row chunks (attn.cu attn_rows_per_call); the setter returns
 * the old value; dsv4_cuda_attn_parts counts the launches (chunks) of sparse_attn and its rope form */
size_t dsv4_cuda_set_attn_scratch(struct dsv4_backend *b, size_t bytes);
long dsv4_cuda_attn_parts(struct dsv4_backend *b);
/* topk calls that took k_topk_w (rows of 8193..16384 entries; DSV4_CUDA_TOPK_W=2: all up to 16384) */
long dsv4_cuda_topk_w_calls(struct dsv4_backend *b);
/* one-row MoE calls that took k_moe_b1r's MMA instances (moe.dot=mma: MXFP4 dots on tensor cores) on this backend */
long dsv4_cuda_moe_mma_calls(struct dsv4_backend *b);
/* of those, the calls that took bm2_run or bm3_run (DSV4_CUDA_MOE_BM=2 / 3: moe.dot=mma's other kernel forms) */
long dsv4_cuda_moe_bm_form_calls(struct dsv4_backend *b);
/* one-row MoE calls that took k_moe_q8 (moe.dot=e4m3: e4m3 tensor-core dots of the act-quantized input) */
long dsv4_cuda_moe_q8_calls(struct dsv4_backend *b);
/* MoE calls of 2..32 rows that took k_moe_bnr on this backend */
long dsv4_cuda_moe_bn_calls(struct dsv4_backend *b);
/* route_moe calls that routed and planned in one launch on this backend: DSV4_RP_ALL every one
 * (k_route_plan_w, _1 or _h), DSV4_RP_ONE those on k_route_plan_1 (one row), DSV4_RP_HASH those on
 * k_route_plan_h (one row of hash ids) */
enum { DSV4_RP_ALL, DSV4_RP_ONE, DSV4_RP_HASH, DSV4_RP_KINDS };
long dsv4_cuda_route_plan_calls(struct dsv4_backend *b, int kind);
/* MoE calls that took the many-row gathered GEMMs (moe_gemm.cu) on this backend */
long dsv4_cuda_moe_gemm_calls(struct dsv4_backend *b);
/* matmuls that took the e4m3 tensor-core GEMM (gemm.cu, linear.gemm=e4m3), all backends of the process */
long dsv4_cuda_gemm_e4m3_calls(void);
/* launches of k_gemv_multi (gemv_multi.cu: matmul_multi's entries in one launch) on this backend */
long dsv4_cuda_gemv_multi_launches(struct dsv4_backend *b);
/* the reference profile's inputs fused into the kernels that read them (the same bits as the
 * separate kernels), a mask: 2 act_quant inside k_gemv_multi's staging of x, 4 grouped wo_a's bf16
 * input rounded inside k_gemv8x and its bf16 weights factored where exact (linear.cu
 * w_bf16_exact), 8 the MoE's act_quant of h in one launch.  All by default; DSV4_CUDA_AQ_FUSE=N
 * (read once) sets another (0: the separate kernels); dsv4_cuda_set_aq_fuse sets it for the process
 * (the tests' A/B).  Bit 1 (act_quant inside k_gemv8 / k_gemv8x) measured slower and is gone.  The
 * calls counter counts the one-row grouped matmuls that rounded x inside k_gemv8x, all backends of
 * the process */
enum { DSV4_CUDA_AQ_MULTI = 2, DSV4_CUDA_AQ_WOA = 4, DSV4_CUDA_AQ_MOE = 8, DSV4_CUDA_AQ_ALL = 14 };
int dsv4_cuda_aq_fuse(void);
void dsv4_cuda_set_aq_fuse(int mask);
long dsv4_cuda_aq_fused_calls(void);
/* launches of k_gemv_mma (linear.dot=mma, gemv_mma.cu) since the process started */
long dsv4_cuda_gemv_mma_calls(void);
/* pool_multi calls issued as one k_pool_jobs launch (attn.cu), all backends of the process (a graph's replay
 * does not call the op: a captured step counts once) */
long dsv4_cuda_pool_multi_calls(void);
/* grouped matmuls (wo_a) of many rows that took the SGEMM (gemm.cu), all backends of the process */
long dsv4_cuda_sgemm_grouped_calls(void);
/* op_list (oplist.cu), all backends of the process: k_op_list launches, and tasks that ran alone
 * as their op because the list kernel does not take them */
long dsv4_cuda_op_list_launches(void);
/* hc_post_pre_norm calls whose comb_in held logits (DSV4_HC_COMBIN_LOGITS, mhc.cu): formed before
 * k_hc_dec's PDL wait (*early) or after it (*late, the writer being the op just before) */
void dsv4_cuda_hc_lg_counts(struct dsv4_backend *b, long *early, long *late);
/* the MoE's combine inside the next hc kernel (moe.cu, "the combine into hc"): on or off for this
 * backend (read from DSV4_CUDA_HC_COMB=1 at init; the same bits either way), and how many combines
 * k_hc_dec took (*taken) or were launched on their own after being left pending (*flushed) */
void dsv4_cuda_set_hc_comb(struct dsv4_backend *b, int on);
void dsv4_cuda_hc_comb_counts(struct dsv4_backend *b, long *taken, long *flushed);
long dsv4_cuda_op_list_alone(void);
/* k_hc_dec launches of this backend with y and its norm spread over the blocks (DSV4_CUDA_HC_DIST=1, mhc.cu) */
long dsv4_cuda_hc_dist_count(struct dsv4_backend *b);
/* matmul_rn calls of this backend by path (linear.cu): the fused kernel, rmsnorm then matmul */
void dsv4_cuda_rn_counts(struct dsv4_backend *b, long *fused, long *alone);
/* op_list_beside calls of this backend (oplist.cu): launched early (beside the matmul_rn before them) or not */
void dsv4_cuda_ol_beside_counts(struct dsv4_backend *b, long *early, long *late);
/* out[0]: the L2 policy createpolicy.fractional.L2::evict_first 1.0 forms on the device; out[1]: the one this
 * build's weight streams carry (common.cuh d_pol_stream); 0 on success (backend.cu) */
int dsv4_cuda_pol_probe(struct dsv4_backend *b, unsigned long long out[2]);
/* the policy CUDA_EVF=2 streams the weights with: what createpolicy.fractional.L2::evict_first 1.0 forms
 * (CUTLASS's CacheHintSm90::EVICT_FIRST; test_evf_policy checks it on the device) */
#define DSV4_CUDA_POL_EVICT_FIRST 0x12F0000000000000ull

#endif
