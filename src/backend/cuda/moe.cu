/* backend/cuda/moe.cu: router and mixture of experts (spec §2.6), and the device-side
 * state of the sync-free ops (sticky device flags, the routed weight-byte counter).
 *
 * route: one block per row: sqrt(softplus) of the logits in parallel, then k block-wide
 *   argmax rounds pick the k largest of score+bias in descending order (ties to the
 *   lower id: the CPU's sort order), or the tid2eid row is taken; thread 0 normalises
 *   in pick order like the CPU.  Experts and weights are written to the caller's
 *   device buffers: the host never reads them.  Biased top-k with k <= 32 and
 *   n_routed <= 512 runs k_route_w instead (one warp per row, picks by warp reductions,
 *   the same bits); the bias is a device copy kept per host array (route_bias), not an
 *   upload per call.  DSV4_CUDA_ROUTE_SMALL=0 turns off the warp router, the bias copies,
 *   the one-warp plan and the prefetching combine (A/B runs).
 * moe: the routed experts of every row and the shared expert run as "slots" (routed
 *   r*k+j, shared rows*k + r), all in one launch per stage:
 *   P) plan: one block reads the expert ids from device memory, counting-sorts the
 *      slots by expert (stable: row order inside an expert) and cuts them into groups
 *      of <= MOE_G slots of one expert, the shared expert's groups last; writes the
 *      groups, their count, each row's combine order (its experts by increasing id, the
 *      CPU's summation order) and weights, and adds each routed group's weight bytes to
 *      the device counter that `dsv4 bench` reads.  An id outside [0, n_routed) is
 *      skipped and sets DSV4_DEVFLAG_EXPERT (reported by ops->check).  Up to 32 slots
 *      (decode) one warp plans instead (k_moe_plan_w: the same outputs, no barrier).
 *   A) gate+up: a warp takes 2 inter features of a group (4 weight rows: w1 and w3),
 *      clamped SwiGLU, the routing weight when it applies before w2, bf16/fp8 as the
 *      profile says;  B) down: a warp takes 4 output features of a group (4 rows of w2);
 *      C) combine: per row, the routed outputs in the plan's order, times out_scale,
 *      plus the shared expert (k_moe_combine_u loads the first 8 order/weight pairs, then
 *      their outputs, before the sum: no chain of dependent loads).
 *   A and B stream each weight row once per group with linear.cu's techniques: blocks of
 *   8 warps where kw (1, 2, 4, 8) warps split one feature set's K (kw doubles while the
 *   launch has < ~8K warps over the expected groups and each warp keeps >= 2 steps); a
 *   lane issues the 16-byte loads of two steps for all its rows (ld.global.nc.L1::
 *   no_allocate) and their block scales before any math; FP8 is decoded by the
 *   e4m3x2 -> f16x2 instruction, e2m1 by a 16-entry table in shared memory (exact: the
 *   same values as d_e2m1_to_f32); x (or h) is read as float4 once per 4 columns and
 *   used for all rows of the warp.  The group's slots go NS at a time (NS = 1, 2, 4, 8
 *   from the batch, a template argument; a group with more slots takes more passes).
 *   Lane sums: a halving shuffle tree (V - 1 shuffles for V = rows x slots values), then
 *   the kw warps' sums are added in shared memory in warp order (deterministic).
 *   Weights that are not MXFP4/NVFP4 (K % 32 == 0) or FP8 (K % 16, block % 16, K % block)
 *   and unaligned x/h take the element-wise warp_dot_multi (one warp per feature).
 *   Up to MOE_G rows with FP4/FP8 experts of suitable shapes, A and B are k_moe_bulk
 *   instead (its section below: weight tiles streamed by the bulk-copy engine), and for one
 *   row k_moe_b1 for both (per-thread cp.async pipelines, its section below; k_moe_b1_prev
 *   in A/B runs and for FP8 scale blocks k_moe_b1 does not take); for one row the plan
 *   then cuts groups of one slot.  DSV4_CUDA_MOE_BULK=0 turns both off (slot-group kernels),
 *   =2 runs one row on k_moe_bulk as before k_moe_b1 (A/B runs).
 *   2..BN_ROWS (32) rows take k_moe_bnr instead (its section below: groups of <= BN_G slots, each
 *   weight chunk streamed once per group); DSV4_CUDA_MOE_BN=0 returns them to k_moe_bulk / the
 *   slot-group kernels, =2 runs groups of one slot (A/B runs).
 *   A and B launch with grid.y = an upper bound of the group count computed from the
 *   shapes alone (S/MOE_G + min(n_routed, rows*k) + 2); blocks past the device count
 *   exit at once.  Each layer's expert weights (device views) are one table in device
 *   memory, built on first use and cached by the host `experts` array (checked against
 *   the weights' data pointers on every call).  Routed experts must share one shape and
 *   format (checked when the table is built).
 * Layout: x, out [rows][dim] fp32; experts' weights device-resident in stored formats.
 * Target: sm_90a.
 */
#include <stdio.h>
#include <stdlib.h>

#include "backend/cuda/moe.cuh"
#include "backend/cuda/bm2_layout.h"

extern "C" {
#include "model/weights.h"
}

/* ----- route ----- */
__device__ __forceinline__ float d_sqrt_softplus(float z) {
    float sp = z > 20.0f ? z : log1pf(expf(z));
    return sqrtf(sp);
}

/* larger of two (score, id) candidates: higher score, ties to the lower id; -1 = none */
__device__ __forceinline__ void better(float &v, int &i, float v2, int i2) {
    if (i2 < 0) return;
    if (i < 0 || v2 > v || (v2 == v && i2 < i)) v = v2, i = i2;
}

__global__ void k_route(int32_t *experts, float *weights, const float *logits, int n_routed, int k, const float *bias,
                        const int32_t *hash_ids, float scale) {
    pdl_enter();
    extern __shared__ float s[]; /* [n_routed] scores, [n_routed] biased, [n_routed] taken flags */
    float *sb = s + n_routed;
    int *taken = (int *)(sb + n_routed);
    __shared__ float wv[32];
    __shared__ int wi[32];
    int r = blockIdx.x, lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    for (int e = threadIdx.x; e < n_routed; e += blockDim.x) {
        s[e] = d_sqrt_softplus(logits[(int64_t)r * n_routed + e]);
        sb[e] = s[e] + (bias ? bias[e] : 0.0f);
        taken[e] = 0;
    }
    __syncthreads();
    int32_t *er = experts + (int64_t)r * k;
    if (hash_ids) {
        if (threadIdx.x < k) er[threadIdx.x] = hash_ids[(int64_t)r * k + threadIdx.x];
    } else {
        for (int j = 0; j < k; j++) { /* the j-th largest: one block argmax per pick */
            float v = 0.0f;
            int i = -1;
            for (int e = threadIdx.x; e < n_routed; e += blockDim.x)
                if (!taken[e]) better(v, i, sb[e], e);
            for (int o = 16; o; o >>= 1) {
                float v2 = __shfl_xor_sync(0xffffffffu, v, o);
                int i2 = __shfl_xor_sync(0xffffffffu, i, o);
                better(v, i, v2, i2);
            }
            if (lane == 0) wv[warp] = v, wi[warp] = i;
            __syncthreads();
            if (threadIdx.x == 0) {
                for (int w = 1; w < nw; w++) better(v, i, wv[w], wi[w]);
                er[j] = i;
                if (i >= 0) taken[i] = 1;
            }
            __syncthreads();
        }
    }
    __syncthreads();
    if (threadIdx.x) return;
    float sum = 0.0f; /* an id outside [0, n_routed) (k > n_routed, or a bad hash row) weighs 0 */
    for (int j = 0; j < k; j++) sum += (unsigned)er[j] < (unsigned)n_routed ? s[er[j]] : 0.0f;
    for (int j = 0; j < k; j++)
        weights[(int64_t)r * k + j] = ((unsigned)er[j] < (unsigned)n_routed ? s[er[j]] : 0.0f) / (sum + 1e-20f) * scale;
}

/* The biased top-k router for k <= 32 picks and n_routed <= 32 * NPL experts (hash rows keep
 * k_route: their one-warp variant measured 2.49 against 2.09 us per Flash call on the H200,
 * ktrace in the decode graphs): one warp per row, no block barrier.  Lane l keeps experts l,
 * l + 32, ... (NPL of them) in registers: their scores and an order key of score+bias; a pick round is two warp reductions (the largest key, then the
 * lowest id holding it) and a rescan of the winning lane's NPL keys.  The key orders numbers
 * as floats do (-0 ties with +0, as the block kernel's compare), so the picks are the block
 * kernel's: the k largest in descending order, ties to the lower id; a NaN ranks below every
 * number (the block kernel's NaN order depends on its reduction tree; the CPU's on qsort).
 * Lane j keeps pick j and its score; every lane adds the k scores in pick order, the block
 * kernel's sum, so the weights are the same bits. */
#define ROUTE_WARPS 4
#define ROUTE_NONE 0xffffffffu

__device__ __forceinline__ unsigned route_key(float v) {
    if (v != v) return 0u;   /* NaN: below -inf (whose key is 0x007fffff) */
    if (v == 0.0f) v = 0.0f; /* -0 -> +0 */
    unsigned u = __float_as_uint(v);
    return u & 0x80000000u ? ~u : u | 0x80000000u;
}

/* a pick's weight on the calling warp (all 32 lanes; lane j < k holds pick j's score my_s, 0 for
 * no expert): its score over the picks' sum, added in pick order from 0 as the block kernel's
 * thread 0 adds it, times scale (k_route's expression) */
__device__ __forceinline__ float d_pick_weight(float my_s, int k, float scale) {
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += __shfl_sync(0xffffffffu, my_s, j);
    return my_s / (sum + 1e-20f) * scale;
}

/* The warp's picks of one row from its lanes' keys: lane holds experts e = lane + 32 m (m < NPL),
 * key[m] its score+bias key, s[m] its score, bit m of live set where e < n_routed.  k picks by
 * warp reductions (highest key, ties to the lower id), then each pick's weight, its score over
 * the picks' sum (in pick order, as the block kernel's thread 0) times scale: lane j < k gets
 * pick j (ROUTE_NONE when fewer experts are live) in *id and its weight in *w, and writes them to
 * experts / weights of row r. */
template <int NPL>
__device__ __forceinline__ void d_route_pick(const unsigned (&key)[NPL], const float (&s)[NPL], unsigned live,
                                             int32_t *experts, float *weights, int64_t r, int k, float scale,
                                             unsigned *id, float *w) {
    int lane = threadIdx.x & 31;
    unsigned my_id = ROUTE_NONE;
    float my_s = 0.0f;
    unsigned bk = 0, bi = ROUTE_NONE; /* this lane's best live (key, id) and its score */
    float bs = 0.0f;
#pragma unroll
    for (int m = 0; m < NPL; m++)
        if (((live >> m) & 1) && (bi == ROUTE_NONE || key[m] > bk)) bk = key[m], bi = lane + 32 * m, bs = s[m];
    for (int j = 0; j < k; j++) {
        unsigned mk = __reduce_max_sync(0xffffffffu, bi == ROUTE_NONE ? 0u : bk);
        unsigned wn = __reduce_min_sync(0xffffffffu, bi != ROUTE_NONE && bk == mk ? bi : ROUTE_NONE);
        float ps = __shfl_sync(0xffffffffu, bs, (int)(wn & 31));
        if (lane == j) my_id = wn, my_s = wn == ROUTE_NONE ? 0.0f : ps;
        if (wn != ROUTE_NONE && (int)(wn & 31) == lane) { /* the winner drops it and rescans */
            live &= ~(1u << (wn >> 5));
            bk = 0, bi = ROUTE_NONE, bs = 0.0f;
#pragma unroll
            for (int m = 0; m < NPL; m++)
                if (((live >> m) & 1) && (bi == ROUTE_NONE || key[m] > bk)) bk = key[m], bi = lane + 32 * m, bs = s[m];
        }
    }
    float mw = d_pick_weight(my_s, k, scale);
    if (lane < k) {
        experts[r * k + lane] = (int32_t)my_id;
        weights[r * k + lane] = mw;
    }
    *id = my_id, *w = mw;
}

/* k_route_w's body for row r, on the calling warp (all 32 lanes); k_route_plan_w calls it too */
template <int NPL>
__device__ __forceinline__ void d_route_w(int32_t *experts, float *weights, const float *logits, int64_t r,
                                          int n_routed, int k, const float *bias, float scale) {
    int lane = threadIdx.x & 31;
    const float *lr = logits + r * n_routed;
    float lv[NPL], bv[NPL], s[NPL];
    unsigned key[NPL], live = 0;
#pragma unroll
    for (int m = 0; m < NPL; m++) { /* all loads first */
        int e = lane + 32 * m;
        lv[m] = e < n_routed ? lr[e] : 0.0f;
        bv[m] = bias && e < n_routed ? bias[e] : 0.0f;
    }
#pragma unroll
    for (int m = 0; m < NPL; m++) {
        s[m] = d_sqrt_softplus(lv[m]);
        key[m] = route_key(s[m] + (bias ? bv[m] : 0.0f)); /* the block kernel's score+bias */
        if (lane + 32 * m < n_routed) live |= 1u << m;
    }
    unsigned id;
    float w;
    d_route_pick<NPL>(key, s, live, experts, weights, r, k, scale, &id, &w);
}

template <int NPL>
__global__ void __launch_bounds__(32 * ROUTE_WARPS)
    k_route_w(int32_t *experts, float *weights, const float *logits, int rows, int n_routed, int k, const float *bias,
              float scale) {
    pdl_enter();
    int64_t r = (int64_t)blockIdx.x * ROUTE_WARPS + (threadIdx.x >> 5);
    if (r >= rows) return;
    d_route_w<NPL>(experts, weights, logits, r, n_routed, k, bias, scale);
}

/* device-side state (its section below): the small-kernel switch and the router's bias copies */
struct cuda_devside;
static cuda_devside *devside(dsv4_backend *b);
static const float *route_bias(dsv4_backend *b, cuda_devside *d, const float *bias, int n);
static int small_kernels(const cuda_devside *d);

/* One route call's device operands (route_stage) and which kernel takes it (npl: k_route_w<8> or
 * <16>; 0: the block kernel k_route). */
struct route_dev {
    int32_t *ed;
    float *wd;
    const float *ld, *bd;
    const int32_t *hd;
    int rows, k, npl;
    float scale;
};

/* The bias's device copy; called before any staging, as a new copy ends a graph capture.  The
 * bias lives as long as the model: a device copy kept per host array (checked against the host
 * values on every call) instead of a 1 KB upload per call.  1 on failure (sticky error set). */
static int route_bias_dev(dsv4_backend *b, cuda_devside *d, const float *bias, int n_routed, const float **bd) {
    *bd = NULL;
    if (bias) *bd = small_kernels(d) ? route_bias(b, d, bias, n_routed)
                                     : (const float *)dsv4_cuda_stage(b, bias, sizeof(float) * n_routed);
    return bias && !*bd;
}

/* Stages the logits and hash ids and maps the outputs (device outputs, the forward pass's, are
 * written in place; host ones come back at op end, route_commit); picks the kernel.  1 on failure. */
static int route_stage(dsv4_backend *b, const cuda_devside *d, route_dev *r, int32_t *experts, float *weights,
                       const float *logits, int rows, int n_routed, int k, const float *bd, const int32_t *hash_ids,
                       float scale) {
    r->ld = (const float *)dsv4_cuda_in(b, logits, sizeof(float) * rows * n_routed);
    r->bd = bd;
    /* hash ids in backend memory (the forward pass uploads them with the embedding) are read in place */
    r->hd = hash_ids ? (const int32_t *)dsv4_cuda_in(b, hash_ids, sizeof(int32_t) * rows * k) : NULL;
    r->ed = (int32_t *)dsv4_cuda_out(b, experts, sizeof(int32_t) * rows * k);
    r->wd = (float *)dsv4_cuda_out(b, weights, sizeof(float) * rows * k);
    r->rows = rows, r->k = k, r->scale = scale;
    int npl = (n_routed + 31) / 32, warp = small_kernels(d) && !hash_ids && k <= 32;
    r->npl = warp && npl <= 8 ? 8 : warp && npl <= 16 ? 16 : 0;
    return !r->ld || (hash_ids && !r->hd) || !r->ed || !r->wd;
}

static void route_commit(dsv4_backend *b, int32_t *experts, float *weights, const route_dev *r) {
    dsv4_cuda_commit(b, experts, r->ed, sizeof(int32_t) * r->rows * r->k);
    dsv4_cuda_commit(b, weights, r->wd, sizeof(float) * r->rows * r->k);
}

void cu_route(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed, int k,
              const float *bias, const int32_t *hash_ids, float scale) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0) return;
    cuda_devside *d = devside(b);
    const float *bd;
    route_dev r;
    if (!d || route_bias_dev(b, d, bias, n_routed, &bd) ||
        route_stage(b, d, &r, experts, weights, logits, rows, n_routed, k, bd, hash_ids, scale))
        return;
    unsigned nb = (unsigned)((rows + ROUTE_WARPS - 1) / ROUTE_WARPS);
    if (r.npl == 8)
        dsv4_launch(k_route_w<8>, nb, 32 * ROUTE_WARPS, 0, CI(b)->stream, r.ed, r.wd, r.ld, rows, n_routed, k, r.bd,
                    scale);
    else if (r.npl == 16)
        dsv4_launch(k_route_w<16>, nb, 32 * ROUTE_WARPS, 0, CI(b)->stream, r.ed, r.wd, r.ld, rows, n_routed, k, r.bd,
                    scale);
    else
        dsv4_launch(k_route, rows, 256, sizeof(float) * 3 * n_routed, CI(b)->stream, r.ed, r.wd, r.ld, n_routed, k,
                    r.bd, r.hd, scale);
    if (CKL(b)) return;
    route_commit(b, experts, weights, &r);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROUTE);
}

/* ----- moe ----- */
/* A group = one expert (or the shared expert) and up to MOE_G of the slots that use it:
 * its weights are streamed once for all of them. */
#define MOE_G 8
struct group {
    int ex;               /* index into the expert table (n_routed = the shared expert) */
    int n;
    int slot[MOE_G];      /* slot ids: routed r*k+j, shared rows*k + r */
    int row[MOE_G];       /* input row of each slot */
    float pre[MOE_G];     /* multiplies h before w2 (1 when it does not apply) */
};

/* one expert as the kernels see it */
/* struct dexpert (one expert as the kernels see it): moe.cuh */

/* warp dots of weight row o with n (<= MOE_G) vectors xs[i]; every lane gets the sums */
__device__ __forceinline__ void warp_dot_multi(const dweight &w, int64_t o, const float *const *xs, int n,
                                               float (&acc)[MOE_G]) {
    int lane = threadIdx.x & 31;
    int64_t K = w.cols;
#pragma unroll
    for (int i = 0; i < MOE_G; i++) acc[i] = 0.0f;
    float wv[32];
    if ((w.fmt == DSV4_WF_MXFP4 || w.fmt == DSV4_WF_NVFP4) && K % 32 == 0) {
        const uint8_t *row = w.data + o * (K / 2);
        for (int64_t k0 = (int64_t)lane * 32; k0 < K; k0 += 1024) {
            uint4 v = __ldg((const uint4 *)(row + k0 / 2));
            float s0, s1;
            if (w.fmt == DSV4_WF_MXFP4) {
                s0 = s1 = d_e8m0_to_f32(w.scale[o * (K / 32) + k0 / 32]);
            } else {
                s0 = d_e4m3_to_f32(w.scale[o * (K / 16) + k0 / 16]) * w.scale2;
                s1 = d_e4m3_to_f32(w.scale[o * (K / 16) + k0 / 16 + 1]) * w.scale2;
            }
            const uint8_t *by = (const uint8_t *)&v;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float sc = i < 8 ? s0 : s1;
                wv[2 * i] = d_e2m1_to_f32(by[i] & 15u) * sc;
                wv[2 * i + 1] = d_e2m1_to_f32(by[i] >> 4) * sc;
            }
#pragma unroll
            for (int g = 0; g < MOE_G; g++) {
                if (g >= n) break;
                const float4 *xp = (const float4 *)(xs[g] + k0);
                float a = acc[g];
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float4 xv = __ldg(xp + i);
                    a += wv[4 * i] * xv.x + wv[4 * i + 1] * xv.y + wv[4 * i + 2] * xv.z + wv[4 * i + 3] * xv.w;
                }
                acc[g] = a;
            }
        }
    } else if (w.fmt == DSV4_WF_FP8 && K % 16 == 0 && w.block % 16 == 0 && K % w.block == 0) {
        const uint8_t *row = w.data + o * K;
        int64_t scols = K / w.block, srow = (o / w.block) * scols;
        for (int64_t k0 = (int64_t)lane * 16; k0 < K; k0 += 512) {
            uint4 v = __ldg((const uint4 *)(row + k0));
            int64_t si = srow + k0 / w.block;
            float sc = w.scale_f32 ? ((const float *)w.scale)[si] : d_e8m0_to_f32(w.scale[si]);
            const uint8_t *by = (const uint8_t *)&v;
#pragma unroll
            for (int i = 0; i < 16; i++) wv[i] = d_e4m3_to_f32(by[i]) * sc;
#pragma unroll
            for (int g = 0; g < MOE_G; g++) {
                if (g >= n) break;
                const float4 *xp = (const float4 *)(xs[g] + k0);
                float a = acc[g];
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    float4 xv = __ldg(xp + i);
                    a += wv[4 * i] * xv.x + wv[4 * i + 1] * xv.y + wv[4 * i + 2] * xv.z + wv[4 * i + 3] * xv.w;
                }
                acc[g] = a;
            }
        }
    } else {
        for (int64_t k = lane; k < K; k += 32) {
            float wk = d_weight_at(w, o, k);
#pragma unroll
            for (int g = 0; g < MOE_G; g++)
                if (g < n) acc[g] += wk * xs[g][k];
        }
    }
#pragma unroll
    for (int g = 0; g < MOE_G; g++) acc[g] = warp_sum(acc[g]);
}

/* ----- vector paths of the expert dots (the techniques of linear.cu's k_linear) ----- */
enum { MV_FP4 = 0, MV_FP8 = 1 }; /* FP4: MXFP4 and NVFP4, 32 values per 16 bytes; FP8: 16 */

/* the vector path a weight takes (-1: the element-wise warp_dot_multi) */
__device__ __forceinline__ int mv_fmt(const dweight &w) {
    if ((w.fmt == DSV4_WF_MXFP4 || w.fmt == DSV4_WF_NVFP4) && w.cols % 32 == 0) return MV_FP4;
    if (w.fmt == DSV4_WF_FP8 && w.cols % 16 == 0 && w.block % 16 == 0 && w.cols % w.block == 0) return MV_FP8;
    return -1;
}

/* the data and scale-row pointers of weight row o */
template <int FMT>
__device__ __forceinline__ void mv_row(const dweight &w, int64_t o, const uint8_t *&rp, const uint8_t *&sp) {
    int64_t K = w.cols;
    if (FMT == MV_FP4) {
        rp = w.data + o * (K / 2);
        sp = w.scale + o * (w.fmt == DSV4_WF_MXFP4 ? K / 32 : K / 16);
    } else {
        rp = w.data + o * K;
        sp = w.scale + (o / w.block) * (K / w.block) * (w.scale_f32 ? 4 : 1);
    }
}

/* block scale(s) of the vector at column k0 (FP8: s0; FP4: s0 for its first 16 values, s1 after) */
template <int FMT>
__device__ __forceinline__ void mv_scales(const dweight &w, const uint8_t *sp, float s2, int64_t k0, float &s0,
                                          float &s1) {
    if (FMT == MV_FP8) {
        int64_t i = k0 / w.block;
        s0 = s1 = w.scale_f32 ? __ldg((const float *)sp + i) : d_e8m0_to_f32(__ldg(sp + i));
    } else if (w.fmt == DSV4_WF_MXFP4) {
        s0 = s1 = d_e8m0_to_f32(__ldg(sp + k0 / 32));
    } else {
        s0 = d_e4m3_to_f32(__ldg(sp + k0 / 16)) * s2;
        s1 = d_e4m3_to_f32(__ldg(sp + k0 / 16 + 1)) * s2;
    }
}

/* weights 4i .. 4i+3 of vector v times their scale; FP4 by the 16-entry table lut (shared
 * memory: the 32 lanes read at most 16 distinct words, no bank conflict) */
template <int FMT>
__device__ __forceinline__ float4 mv_deq4(const uint4 &v, int i, float s0, float s1, const float *lut) {
    const uint32_t *wd = (const uint32_t *)&v;
    if (FMT == MV_FP8) {
        float2 a = d_e4m3x2_to_f32x2((uint16_t)wd[i]), b = d_e4m3x2_to_f32x2((uint16_t)(wd[i] >> 16));
        return make_float4(a.x * s0, a.y * s0, b.x * s0, b.y * s0);
    }
    uint32_t q = wd[i >> 1] >> (16 * (i & 1)); /* four e2m1 codes, low nibble first */
    float s = i < 4 ? s0 : s1;
    return make_float4(lut[q & 15u] * s, lut[(q >> 4) & 15u] * s, lut[(q >> 8) & 15u] * s, lut[(q >> 12) & 15u] * s);
}

/* acc[r][s] += the lane's part of row r . xs[s] for s < ns: the lane takes the 16-byte
 * vectors at columns kbeg, kbeg + stride, ..., two steps per round, every load of both steps
 * (NR rows) issued before any math; x is read as float4, once per 4 columns for all rows */
template <int FMT, int NR, int NS>
__device__ __forceinline__ void mv_dot(float (&acc)[NR][NS], const dweight &w, const uint8_t *const (&rp)[NR],
                                       const uint8_t *const (&sp)[NR], const float (&s2)[NR],
                                       const float *const (&xs)[NS], int ns, int64_t kbeg, int64_t stride,
                                       const float *lut) {
    constexpr int VN = FMT == MV_FP4 ? 32 : 16;
    int64_t K = w.cols;
    for (int64_t k0 = kbeg; k0 < K; k0 += 2 * stride) {
        int64_t k1 = k0 + stride;
        int has1 = k1 < K;
        uint4 v[2][NR];
        float a[2][NR], b[2][NR];
#pragma unroll
        for (int r = 0; r < NR; r++) {
            v[0][r] = d_ld_stream16(rp[r] + (FMT == MV_FP4 ? k0 / 2 : k0));
            if (has1) v[1][r] = d_ld_stream16(rp[r] + (FMT == MV_FP4 ? k1 / 2 : k1));
            else v[1][r] = make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int r = 0; r < NR; r++) {
            mv_scales<FMT>(w, sp[r], s2[r], k0, a[0][r], b[0][r]);
            if (has1) mv_scales<FMT>(w, sp[r], s2[r], k1, a[1][r], b[1][r]);
            else a[1][r] = b[1][r] = 0.0f;
        }
#pragma unroll
        for (int st = 0; st < 2; st++) {
            if (st && !has1) break;
            int64_t kk = st ? k1 : k0;
#pragma unroll
            for (int i = 0; i < VN / 4; i++) {
                float4 wf[NR];
#pragma unroll
                for (int r = 0; r < NR; r++) wf[r] = mv_deq4<FMT>(v[st][r], i, a[st][r], b[st][r], lut);
#pragma unroll
                for (int s = 0; s < NS; s++) {
                    if (s >= ns) break;
                    float4 xv = __ldg((const float4 *)(xs[s] + kk + 4 * i));
#pragma unroll
                    for (int r = 0; r < NR; r++)
                        acc[r][s] += wf[r].x * xv.x + wf[r].y * xv.y + wf[r].z * xv.z + wf[r].w * xv.w;
                }
            }
        }
    }
}

/* The block's sum of (row r, slot s), returned on lane r*NS + s of the group's first warp
 * (sub == 0; other lanes and warps: 0): each warp sums its lanes by a shuffle tree, then
 * the kw warps of a group are added in shared memory in warp order.  Every thread of the
 * block calls it (it synchronises when kw > 1). */
template <int NR, int NS>
__device__ __forceinline__ float mv_reduce(float (&acc)[NR][NS], float (*red)[32], int wib, int sub, int kw,
                                           int lane) {
    constexpr int V = NR * NS, L = V >= 32 ? 5 : V >= 16 ? 4 : V >= 8 ? 3 : V >= 4 ? 2 : V >= 2 ? 1 : 0;
    static_assert(V == 1 << L && V <= 32, "NR * NS: a power of two, at most 32");
    float v[V]; /* value j = r * NS + s */
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int s = 0; s < NS; s++) v[r * NS + s] = acc[r][s];
    /* halving tree: at offset 16, 8, ... each lane keeps the half of its values picked by
     * its lane bit and adds the partner's copy of that half (V - 1 shuffles, not 5 V) ... */
#pragma unroll
    for (int m = V, off = 16; m > 1; m >>= 1, off >>= 1) {
        int up = lane & off;
#pragma unroll
        for (int i = 0; i < m / 2; i++) {
            float keep = up ? v[i + m / 2] : v[i], send = up ? v[i] : v[i + m / 2];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
    }
    /* ... then the lanes that hold one value sum it over the remaining lane bits */
#pragma unroll
    for (int off = 16 >> L; off; off >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
    /* lane l holds value l >> (5 - L): move value j to lane j */
    float mine = __shfl_sync(0xffffffffu, v[0], (lane << (5 - L)) & 31);
    if (lane >= V) mine = 0.0f;
    if (kw == 1) return mine;
    red[wib][lane] = mine;
    __syncthreads();
    float t = 0.0f;
    if (sub == 0) {
        t = red[wib][lane];
        for (int j = 1; j < kw; j++) t += red[wib + j][lane];
    }
    __syncthreads();
    return t;
}

/* the feature blocks: 8 warps; kw warps share one group of OPW features and split K */
#define MOE_UP_OPW 2   /* gate+up: 2 features = 4 weight rows (w1 and w3) per warp */
#define MOE_DOWN_OPW 4 /* down: 4 rows of w2 per warp */

/* NS: slots per pass (the group's slots are taken NS at a time; 1 for one row) */
template <int NS>
__global__ void __launch_bounds__(256, NS <= 2 ? 2 : 1) k_moe_up(float *h, int64_t ldh, const float *x, const float *xq, int64_t dim,
                                                const group *groups, const int *n_groups, const dexpert *tab,
                                                int act_fp8, float limit, int act_bf16, int kw, int vec) {
    pdl_enter();
    constexpr int OPW = MOE_UP_OPW, NR = 2 * OPW;
    __shared__ float lut[16];
    __shared__ float red[8][32];
    if (threadIdx.x < 16) lut[threadIdx.x] = d_e2m1_to_f32(threadIdx.x);
    __syncthreads();
    if ((int)blockIdx.y >= *n_groups) return; /* grid.y is an upper bound */
    const group &G = groups[blockIdx.y];
    const dexpert &E = tab[G.ex];
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = wib / kw, sub = wib % kw;
    int64_t no = E.w1.rows, fpb = (int64_t)(8 / kw) * OPW;
    if ((int64_t)blockIdx.x * fpb >= no) return; /* the whole block is past this expert's rows */
    int64_t ob = (int64_t)blockIdx.x * fpb + (int64_t)grp * OPW;
    int active = ob < no;
    const float *xb = act_fp8 && E.q1 ? xq : x;
    int fmt = mv_fmt(E.w1);
    if (!vec || fmt < 0 || mv_fmt(E.w3) != fmt || E.w3.fmt != E.w1.fmt || E.w3.cols != E.w1.cols ||
        E.w3.block != E.w1.block || E.w3.scale_f32 != E.w1.scale_f32) { /* element-wise: one warp per feature */
        for (int j = sub; active && j < OPW; j += kw) {
            int64_t o = ob + j;
            if (o >= no) break;
            const float *xs[MOE_G];
#pragma unroll
            for (int g = 0; g < MOE_G; g++) xs[g] = xb + (int64_t)G.row[g < G.n ? g : 0] * dim;
            float ga[MOE_G], ua[MOE_G];
            warp_dot_multi(E.w1, o, xs, G.n, ga);
            warp_dot_multi(E.w3, o, xs, G.n, ua);
            if (lane == 0)
                for (int g = 0; g < G.n; g++)
                    h[(int64_t)G.slot[g] * ldh + o] = moe_swiglu(ga[g], ua[g], limit, act_bf16, G.pre[g]);
        }
        return;
    }
    constexpr int VN4 = 32, VN8 = 16;
    for (int c0 = 0; c0 < G.n; c0 += NS) { /* block-uniform: every warp takes the same passes */
        int ns = min(NS, G.n - c0);
        const float *xs[NS];
#pragma unroll
        for (int s = 0; s < NS; s++) xs[s] = xb + (int64_t)G.row[c0 + (s < ns ? s : 0)] * dim;
        float acc[NR][NS];
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int s = 0; s < NS; s++) acc[r][s] = 0.0f;
        if (active) {
            const uint8_t *rp[NR], *sp[NR];
            float s2[NR];
#pragma unroll
            for (int u = 0; u < OPW; u++) {
                int64_t o = ob + u < no ? ob + u : ob;
                if (fmt == MV_FP4) {
                    mv_row<MV_FP4>(E.w1, o, rp[u], sp[u]);
                    mv_row<MV_FP4>(E.w3, o, rp[OPW + u], sp[OPW + u]);
                } else {
                    mv_row<MV_FP8>(E.w1, o, rp[u], sp[u]);
                    mv_row<MV_FP8>(E.w3, o, rp[OPW + u], sp[OPW + u]);
                }
                s2[u] = E.w1.scale2;
                s2[OPW + u] = E.w3.scale2;
            }
            if (fmt == MV_FP4)
                mv_dot<MV_FP4, NR, NS>(acc, E.w1, rp, sp, s2, xs, ns, (int64_t)(sub * 32 + lane) * VN4,
                                       (int64_t)kw * 32 * VN4, lut);
            else
                mv_dot<MV_FP8, NR, NS>(acc, E.w1, rp, sp, s2, xs, ns, (int64_t)(sub * 32 + lane) * VN8,
                                       (int64_t)kw * 32 * VN8, lut);
        }
        float v = mv_reduce<NR, NS>(acc, red, wib, sub, kw, lane);
        float uv = __shfl_down_sync(0xffffffffu, v, OPW * NS); /* row OPW + u: the up projection */
        if (active && sub == 0 && lane < OPW * NS) {
            int u = lane / NS, s = lane % NS;
            if (s < ns && ob + u < no)
                h[(int64_t)G.slot[c0 + s] * ldh + ob + u] = moe_swiglu(v, uv, limit, act_bf16, G.pre[c0 + s]);
        }
    }
}

template <int NS>
__global__ void __launch_bounds__(256, NS <= 2 ? 2 : 1) k_moe_down(float *y, int64_t dim, const float *h, int64_t ldh,
                                                  const group *groups, const int *n_groups, const dexpert *tab,
                                                  int act_bf16, int kw, int vec) {
    pdl_enter();
    constexpr int NR = MOE_DOWN_OPW;
    __shared__ float lut[16];
    __shared__ float red[8][32];
    if (threadIdx.x < 16) lut[threadIdx.x] = d_e2m1_to_f32(threadIdx.x);
    __syncthreads();
    if ((int)blockIdx.y >= *n_groups) return;
    const group &G = groups[blockIdx.y];
    const dexpert &E = tab[G.ex];
    int wib = threadIdx.x >> 5, lane = threadIdx.x & 31, grp = wib / kw, sub = wib % kw;
    int64_t no = E.w2.rows < dim ? E.w2.rows : dim, fpb = (int64_t)(8 / kw) * NR;
    if ((int64_t)blockIdx.x * fpb >= no) return;
    int64_t ob = (int64_t)blockIdx.x * fpb + (int64_t)grp * NR;
    int active = ob < no;
    int fmt = mv_fmt(E.w2);
    if (!vec || fmt < 0) {
        for (int j = sub; active && j < NR; j += kw) {
            int64_t d = ob + j;
            if (d >= no) break;
            const float *hs[MOE_G];
#pragma unroll
            for (int g = 0; g < MOE_G; g++) hs[g] = h + (int64_t)G.slot[g < G.n ? g : 0] * ldh;
            float acc[MOE_G];
            warp_dot_multi(E.w2, d, hs, G.n, acc);
            if (lane == 0)
                for (int g = 0; g < G.n; g++)
                    y[(int64_t)G.slot[g] * dim + d] = act_bf16 ? d_round_bf16(acc[g]) : acc[g];
        }
        return;
    }
    for (int c0 = 0; c0 < G.n; c0 += NS) {
        int ns = min(NS, G.n - c0);
        const float *hs[NS];
#pragma unroll
        for (int s = 0; s < NS; s++) hs[s] = h + (int64_t)G.slot[c0 + (s < ns ? s : 0)] * ldh;
        float acc[NR][NS];
#pragma unroll
        for (int r = 0; r < NR; r++)
#pragma unroll
            for (int s = 0; s < NS; s++) acc[r][s] = 0.0f;
        if (active) {
            const uint8_t *rp[NR], *sp[NR];
            float s2[NR];
#pragma unroll
            for (int u = 0; u < NR; u++) {
                int64_t o = ob + u < no ? ob + u : ob;
                if (fmt == MV_FP4) mv_row<MV_FP4>(E.w2, o, rp[u], sp[u]);
                else mv_row<MV_FP8>(E.w2, o, rp[u], sp[u]);
                s2[u] = E.w2.scale2;
            }
            if (fmt == MV_FP4)
                mv_dot<MV_FP4, NR, NS>(acc, E.w2, rp, sp, s2, hs, ns, (int64_t)(sub * 32 + lane) * 32,
                                       (int64_t)kw * 32 * 32, lut);
            else
                mv_dot<MV_FP8, NR, NS>(acc, E.w2, rp, sp, s2, hs, ns, (int64_t)(sub * 32 + lane) * 16,
                                       (int64_t)kw * 32 * 16, lut);
        }
        float v = mv_reduce<NR, NS>(acc, red, wib, sub, kw, lane);
        if (active && sub == 0 && lane < NR * NS) {
            int u = lane / NS, s = lane % NS;
            if (s < ns && ob + u < no) y[(int64_t)G.slot[c0 + s] * dim + ob + u] = act_bf16 ? d_round_bf16(v) : v;
        }
    }
}

/* ----- up to MOE_G rows: the expert GEMVs on the bulk-copy pipeline (k_moe_bulk) -----
 * A unit is a tile of 16 KB of one group's weight rows (all the group's slots, <= MOE_G,
 * are computed from the staged tile, one after the other): up, nrh features = nrh rows of w1
 * then the same nrh rows of w3; down, nrh rows of w2 (nrh = 16 KB / 2 / row bytes, or
 * 16 KB / row bytes), plus their block scales.  Each block walks units blockIdx.x,
 * + gridDim.x, ... (consecutive blocks: consecutive tiles of one expert); thread 0 keeps
 * MB_STAGES units in flight with cp.async.bulk while the 8 warps compute on the oldest.
 * Thread t owns the 16-byte column vector c = t % cv of tile rows t / cv + i * (256 / cv),
 * i < 4 (the 1024 vectors of a tile, 4 per thread), with its 32 (FP4) or 16 (FP8) x values
 * in registers; a vector's products are summed first and multiplied by the block scale
 * once (the scale applies to all of them: only the rounding order differs from the
 * CPU's), then each warp sums its lanes (shuffle tree) and, after the unit's one block
 * barrier, a row's sum is the cv / 32 warp sums of its row group added in warp order. */
enum { MB_STAGES = 4, MB_TILE = 16384, MB_SCALE = 2048, MB_MAXG = 64 };

struct mb_half {
    const uint8_t *data, *scale;
    int fmt, block, scale_f32, rowb, srow; /* srow: FP4 scale bytes per row; FP8 per row of blocks */
    float scale2;
};
struct mb_group {
    mb_half w[2];  /* up: w1, w3; down: w2 */
    int n, cv, nrh, tiles, first, q1;
    int64_t rows;
    int slot[MOE_G], row[MOE_G];
    float pre[MOE_G];
};

__device__ __forceinline__ mb_half mb_make(const dweight &w) {
    mb_half m;
    int fp4 = w.fmt == DSV4_WF_MXFP4 || w.fmt == DSV4_WF_NVFP4;
    m.data = w.data;
    m.scale = w.scale;
    m.fmt = w.fmt;
    m.block = w.block;
    m.scale_f32 = w.scale_f32;
    m.scale2 = w.scale2;
    m.rowb = (int)(fp4 ? w.cols / 2 : w.cols);
    m.srow = (int)(fp4 ? (w.fmt == DSV4_WF_MXFP4 ? w.cols / 32 : w.cols / 16)
                       : w.cols / w.block * (w.scale_f32 ? 4 : 1));
    return m;
}

/* thread 0: start the copies of this block's i-th unit into stage i % MB_STAGES */
template <int UP>
__device__ __forceinline__ void mb_issue(uint8_t *stages, uint64_t *full, const mb_group *gd, int ng, int i) {
    int u = blockIdx.x + i * gridDim.x, g = 0;
    while (g + 1 < ng && u >= gd[g].first + gd[g].tiles) g++;
    const mb_group &G = gd[g];
    int64_t o0 = (int64_t)(u - G.first) * G.nrh;
    int nv = (int)(G.rows - o0 < G.nrh ? G.rows - o0 : G.nrh);
    int st = i % MB_STAGES;
    uint8_t *dst = stages + (size_t)st * (MB_TILE + MB_SCALE);
    uint32_t total = 0;
    int fp4 = G.w[0].fmt != DSV4_WF_FP8;
    for (int hh = 0; hh <= UP; hh++) {
        total += (uint32_t)(nv * G.w[hh].rowb);
        total += (uint32_t)(fp4 ? nv * G.w[hh].srow : G.w[hh].srow);
    }
    d_mbar_expect(&full[st], total);
    for (int hh = 0; hh <= UP; hh++) {
        const mb_half &W = G.w[hh];
        d_bulk_g2s(dst + (size_t)hh * G.nrh * W.rowb, W.data + o0 * W.rowb, (uint32_t)(nv * W.rowb), &full[st]);
        if (fp4)
            d_bulk_g2s(dst + MB_TILE + hh * (MB_SCALE / 2), W.scale + o0 * W.srow, (uint32_t)(nv * W.srow), &full[st]);
        else
            d_bulk_g2s(dst + MB_TILE + hh * (MB_SCALE / 2), W.scale + (o0 / W.block) * W.srow, (uint32_t)W.srow,
                       &full[st]);
    }
}

/* the 4 partial sums of thread (c, p) on the tile in stage sd/ss for x values xr */
__device__ __forceinline__ void mb_dot(float (&acc)[4], const mb_group &G, const uint8_t *sd, const uint8_t *ss,
                                       const float (&xr)[32], const float *lut, int c, int p, int P, int fp4) {
    int cv = G.cv, nrh = G.nrh;
#pragma unroll
    for (int ii = 0; ii < 4; ii++) {
        int tr = p + ii * P, hh = tr / nrh, r = tr - hh * nrh;
        const mb_half &W = G.w[hh];
        uint4 q = *(const uint4 *)(sd + ((size_t)tr * cv + c) * 16);
        const uint32_t *qw = (const uint32_t *)&q;
        const uint8_t *sh = ss + hh * (MB_SCALE / 2);
        float v;
        if (fp4) {
            float a0 = 0.0f, a1 = 0.0f, b0 = 0.0f, b1 = 0.0f; /* a: values 0..15, b: 16..31 */
#pragma unroll
            for (int w4 = 0; w4 < 4; w4++)
#pragma unroll
                for (int n = 0; n < 8; n += 2) {
                    float p0 = lut[(qw[w4] >> (4 * n)) & 15u] * xr[8 * w4 + n];
                    float p1 = lut[(qw[w4] >> (4 * n + 4)) & 15u] * xr[8 * w4 + n + 1];
                    if (w4 < 2) a0 += p0, a1 += p1;
                    else b0 += p0, b1 += p1;
                }
            if (W.fmt == DSV4_WF_MXFP4) {
                v = ((a0 + a1) + (b0 + b1)) * d_e8m0_to_f32(sh[r * W.srow + c]);
            } else {
                float s0 = d_e4m3_to_f32(sh[r * W.srow + 2 * c]) * W.scale2;
                float s1 = d_e4m3_to_f32(sh[r * W.srow + 2 * c + 1]) * W.scale2;
                v = (a0 + a1) * s0 + (b0 + b1) * s1;
            }
        } else {
            float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
            for (int w4 = 0; w4 < 4; w4++) {
                float2 e0 = d_e4m3x2_to_f32x2((uint16_t)qw[w4]), e1 = d_e4m3x2_to_f32x2((uint16_t)(qw[w4] >> 16));
                a0 += e0.x * xr[4 * w4] + e1.x * xr[4 * w4 + 2];
                a1 += e0.y * xr[4 * w4 + 1] + e1.y * xr[4 * w4 + 3];
            }
            int sci = c * 16 / W.block;
            float sc = W.scale_f32 ? ((const float *)sh)[sci] : d_e8m0_to_f32(sh[sci]);
            v = (a0 + a1) * sc;
        }
        acc[ii] = v;
    }
}

/* grid: SMs x resident blocks; dynamic shared memory: the stages, then max_groups group
 * records (the host checks max_groups <= MB_MAXG) */
template <int UP, int MULTI>
__global__ void __launch_bounds__(256, 2) k_moe_bulk(const group *groups, const int *n_groups, int max_groups,
                                                     const dexpert *tab, const float *x, const float *xq, float *h,
                                                     int64_t ldh, float *y, int64_t dim, int act_fp8, float limit,
                                                     int act_bf16) {
    pdl_enter();
    extern __shared__ __align__(128) uint8_t stages[];
    mb_group *gd = (mb_group *)(stages + (size_t)MB_STAGES * (MB_TILE + MB_SCALE));
    __shared__ uint64_t full[MB_STAGES];
    __shared__ float part[2][MOE_G][8][4];
    __shared__ float lut[16];
    __shared__ int s_ng, s_total;
    int tid = threadIdx.x, lane = tid & 31, wib = tid >> 5;
    if (tid < 16) lut[tid] = d_e2m1_to_f32(tid);
    if (tid == 32) {
        int ng = *n_groups;
        s_ng = ng < max_groups ? ng : max_groups;
    }
    if (tid < MB_STAGES) {
        d_mbar_init(&full[tid], 1);
        d_mbar_fence_init();
    }
    __syncthreads();
    int ng = s_ng;
    for (int g = tid; g < ng; g += blockDim.x) {
        const group &G = groups[g];
        const dexpert &E = tab[G.ex];
        mb_group d;
        if (UP) {
            d.w[0] = mb_make(E.w1);
            d.w[1] = mb_make(E.w3);
            d.rows = E.w1.rows;
        } else {
            d.w[0] = mb_make(E.w2);
            d.w[1] = d.w[0];
            d.rows = E.w2.rows < dim ? E.w2.rows : dim;
        }
        d.q1 = E.q1;
        d.n = G.n;
        for (int j = 0; j < MOE_G; j++) {
            d.slot[j] = G.slot[j < G.n ? j : 0];
            d.row[j] = G.row[j < G.n ? j : 0];
            d.pre[j] = G.pre[j < G.n ? j : 0];
        }
        d.cv = d.w[0].rowb / 16; /* 16-byte vectors per row */
        d.nrh = (UP ? MB_TILE / 2 : MB_TILE) / d.w[0].rowb;
        d.tiles = (int)((d.rows + d.nrh - 1) / d.nrh);
        d.first = 0;
        gd[g] = d;
    }
    __syncthreads();
    if (tid == 0) {
        int acc = 0;
        for (int g = 0; g < ng; g++) {
            gd[g].first = acc;
            acc += gd[g].tiles;
        }
        s_total = acc;
    }
    __syncthreads();
    int total = s_total;
    int n_my = (int)blockIdx.x < total ? (total - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x : 0;
    if (tid == 0)
        for (int i = 0; i < MB_STAGES && i < n_my; i++) mb_issue<UP>(stages, full, gd, ng, i);
    int gcur = 0, cvcur = 0;
    const float *xcur = NULL;
    float xr[32];
    for (int i = 0; i < n_my; i++) {
        int u = blockIdx.x + i * gridDim.x;
        while (gcur + 1 < ng && u >= gd[gcur].first + gd[gcur].tiles) gcur++;
        const mb_group &G = gd[gcur];
        int cv = G.cv, P = 256 / cv, c = tid & (cv - 1), p = tid / cv, nrh = G.nrh, n = MULTI ? G.n : 1;
        int fp4 = G.w[0].fmt != DSV4_WF_FP8, vn = fp4 ? 32 : 16;
        int64_t o0 = (int64_t)(u - G.first) * nrh;
        int nv = (int)(G.rows - o0 < nrh ? G.rows - o0 : nrh);
        int st = i % MB_STAGES;
        const uint8_t *sd = stages + (size_t)st * (MB_TILE + MB_SCALE), *ss = sd + MB_TILE;
        d_mbar_wait(&full[st], (uint32_t)(i / MB_STAGES) & 1u);
        /* the group's slots share the staged tile; at batch 1 (MULTI = 0) the one slot is a
         * straight-line path: the same body under a runtime-count loop ran 2x slower (H200,
         * opbench: 93 vs 50 us per Flash MoE call), even behind an n == 1 branch */
        auto slot = [&](int sl) {
            const float *xs = UP ? (act_fp8 && G.q1 ? xq : x) + (int64_t)G.row[sl] * dim : h + (int64_t)G.slot[sl] * ldh;
            if (xs != xcur || cv != cvcur) { /* the x values of column vector c */
                const float4 *xp = (const float4 *)(xs + (int64_t)c * vn);
#pragma unroll
                for (int j = 0; j < 8; j++)
                    if (j < vn / 4) {
                        float4 v = __ldg(xp + j);
                        xr[4 * j] = v.x, xr[4 * j + 1] = v.y, xr[4 * j + 2] = v.z, xr[4 * j + 3] = v.w;
                    }
                xcur = xs;
                cvcur = cv;
            }
            float acc[4];
            mb_dot(acc, G, sd, ss, xr, lut, c, p, P, fp4);
            /* each warp's sums of its 4 rows land on lanes 0..3 (no block barrier) */
            float a2[4][1] = {{acc[0]}, {acc[1]}, {acc[2]}, {acc[3]}};
            float wsum = mv_reduce<4, 1>(a2, nullptr, wib, 0, 1, lane); /* one warp: no shared sums */
            if (lane < 4) part[i & 1][sl][wib][lane] = wsum;
        };
        if (!MULTI) slot(0); /* the host launches MULTI = 0 for one row: every group has one slot */
        else
            for (int sl = 0; sl < n; sl++) slot(sl);
        __syncthreads(); /* stage st is read, the warp sums are in */
        if (tid == 0 && i + MB_STAGES < n_my) mb_issue<UP>(stages, full, gd, ng, i + MB_STAGES);
        /* after the unit's one barrier, the thread of (row, slot) adds the cv / 32 warp sums of
         * its row group in warp order (deterministic); part is double-buffered so unit i + 1
         * can write while a slow thread still reads unit i's */
        for (int e = tid; e < nv * n; e += blockDim.x) {
            int f = e / n, sl = e - f * n, kw = cv / 32;
            float v[2];
#pragma unroll
            for (int q = 0; q <= UP; q++) {
                int tr = f + q * nrh, pp = tr % P, ii = tr / P;
                float t = part[i & 1][sl][pp * kw][ii];
                for (int j = 1; j < kw; j++) t += part[i & 1][sl][pp * kw + j][ii];
                v[q] = t;
            }
            if (UP)
                h[(int64_t)G.slot[sl] * ldh + o0 + f] = moe_swiglu(v[0], v[1], limit, act_bf16, G.pre[sl]);
            else
                y[(int64_t)G.slot[sl] * dim + o0 + f] = act_bf16 ? d_round_bf16(v[0]) : v[0];
        }
    }
}

/* ----- one row: the expert GEMVs on per-thread cp.async pipelines (k_moe_b1_prev) -----
 * The previous one-row kernel: both halves in A/B runs (DSV4_CUDA_MOE_B1G, the geometry table
 * below) and for FP8 weights whose scale blocks k_moe_b1 does not take.
 * At batch 1 every group has one slot.  Block (chunk, group) = grid (x, y) computes FB
 * consecutive features of one group (up: w1 and w3 rows, h = SwiGLU; down: w2 rows, y).
 * Thread t owns the 16-byte column vector c = t % cv (cv = row bytes / 16) of the features
 * p, p + P, ... (p = t / cv, P = 256 / cv), M of them (up 16, down 32): every block streams
 * 256 x 32 vectors = 128 KB whatever the format.  Its 32 (FP4) or 16 (FP8) x values stay in
 * registers.  The thread copies its own vectors (and the 4-byte word holding their block
 * scales) into its own slots of B1_S shared-memory stages by cp.async, B1_V vectors per
 * stage, and waits for them with cp.async.wait_group: no block barrier until the end, and
 * (B1_S - 1) x B1_V x 16 bytes per thread are always in flight (96 KB per SM in both geometries).
 * Per stage a warp sums its lanes' B1_V vector sums (shuffle tree) into a slot of `part`;
 * after the block's one barrier a feature's sum is its cv / 32 warp sums added in warp order
 * (deterministic), as in k_moe_bulk.
 * e2m1 decode (DEC 1): the code's magnitude bits go to bits 9..11 of an f16 and its sign to
 * bit 15, which makes the f16 the e2m1 value times 2^-14 exactly (code 1 = 0.5 a subnormal
 * f16); two codes per f16x2, converted to f32 by cvt.  The vector's sum is multiplied by 2^14
 * (exact) before its block scale, so the result is the one of exact values but for x values
 * below 2^-110, whose products would underflow.  No shared-memory table: the LSU keeps to the
 * stages.  DEC 0 reads the table instead (DSV4_CUDA_MOE_LUT=1, an A/B switch).
 * Measured (H200, ktrace, Flash shapes, 6 MXFP4 experts + FP8 shared; one device session):
 * inside the decode graphs (bench, 2 layers, context 2048) gate/up 45.9 us and down 23.6 us
 * per call against 61.4 and 41.2 for k_moe_bulk<.., 0>; opbench --flush-mb 512: 44.9 / 22.5
 * against 58.1 / 38.0, with the table 48.7 / 24.1.  That is ~1.5 TB/s for both, about 10
 * weights per clock per SM: bound by instruction issue at 16 warps per SM (96 registers,
 * 80 KB of stages per block), not by the bytes in flight. */
enum { B1_MUP = 16 };
/* shared memory of S stages of V vectors (16 bytes + a 4-byte scale word) per thread, + part */
#define B1_SMEM(S, V) ((S) * (V) * 256 * 16 + (S) * (V) * 256 * 4 + 256 * 4)

/* a 16-byte cp.async without an L2 hint: bm_run's (moe.dot=mma) stage copies in every build, and b1_cp16
 * without DSV4_CUDA_EVF_CP.  With the hint bm_run's first GPU run (CUDA_EVF=1, 2026-12-05) stopped on
 * an illegal instruction, while the default kernels' copies passed test_cuda_moe's first one-row case.  With
 * the constant policy of =2 (common.cuh d_pol_stream) and the hint on bm_run's copies it stopped the same way
 * (H100, 2026-12-05, stop 45), so createpolicy under bm_run's per-lane condition was not the cause: the hinted
 * copy in bm_run is; the known ptxas fault below fits it.  bm_run's copies carry no hint in any build */
__device__ __forceinline__ void b1_cp16_plain(void *dst, const void *src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d_smem_addr(dst)), "l"(src) : "memory");
}
/* DSV4_CUDA_EVF_CP (make CUDA_EVF_CP=0|1|2; the Makefile's default 1 since stop 48; common.cuh), under
 * DSV4_CUDA_EVF: which stage copies carry the hint too.  0 none (only the ld.global streams); 1 the one-row kernels'
 * (k_moe_b1r and k_moe_b1_prev: the decode path of batch 1); 2 also k_moe_bnr's (2..32 rows: bn_run, and
 * b1f_run for its one-slot groups).  With every copy hinted (stop 46's build) a CUDA_EVF=2 build's k_moe_bnr
 * (batch 2, stage loops unrolled) stopped on an illegal instruction (H100, 2026-12-06), as bm_run's did
 * before, while every one-row case passed; with none (=0, stop 47) every MoE test passed, and with =1 too
 * (stop 48, H100: the 10 cases whole).  The same symptom is a known ptxas fault: for some sm_90 kernels it
 * drops the policy's materialization and leaves LDGSTS reading an unset uniform register as its L2
 * descriptor (IST-DASLab/marlin issue 44, CUDA 13.1; Triton stopped putting policies on cp.async for it, PR
 * 11660, until a fixed ptxas, PR 11848).  Ours: 13.0.  A hint changes no value, only where a line sits in L2.
 * The kernels without the hint compile as before (b1_cp16<0> is b1_cp16_plain). */
enum { B1_HINT = DSV4_CUDA_EVF && DSV4_CUDA_EVF_CP >= 1, BN_HINT = DSV4_CUDA_EVF && DSV4_CUDA_EVF_CP >= 2 };
template <int HINT>
__device__ __forceinline__ void b1_cp16(void *dst, const void *src) { /* weights: evict_first with HINT */
    if constexpr (HINT)
        asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;" ::"r"(d_smem_addr(dst)),
                     "l"(src), "l"(d_pol_stream())
                     : "memory");
    else
        b1_cp16_plain(dst, src);
}
__device__ __forceinline__ void b1_cp4(void *dst, const void *src) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4;" ::"r"(d_smem_addr(dst)), "l"(src) : "memory");
}

/* After the block's barrier: feature fl's sum is its kw warp partials in part (up: w1's and
 * w3's, NH = 2 per feature) added in warp order (deterministic); up writes SwiGLU of the pair,
 * down the sum (bf16-rounded under act_bf16). */
template <int UP, typename NT> /* NT: the callers' type of the feature count (int or int64_t) */
__device__ __forceinline__ void b1_write(const float *part, int kw, NT n, int tid, int64_t f0, float *out,
                                         float pre, float limit, int act_bf16) {
    constexpr int NH = UP ? 2 : 1;
    for (int fl = tid; fl < n; fl += blockDim.x) {
        float v[2] = {0.0f, 0.0f};
#pragma unroll
        for (int hh = 0; hh < NH; hh++) {
            const float *pp = part + (fl * NH + hh) * kw;
            float t = pp[0];
            for (int j = 1; j < kw; j++) t += pp[j];
            v[hh] = t;
        }
        if (UP) out[f0 + fl] = moe_swiglu(v[0], v[1], limit, act_bf16, pre);
        else out[f0 + fl] = act_bf16 ? d_round_bf16(v[0]) : v[0];
    }
}

/* the e2m1 codes at bits [O, O + 4) of both 16-bit halves of q, times 2^-14, as f32 */
template <int O>
__device__ __forceinline__ float2 b1_e2m1x2(uint32_t q) {
    uint32_t m = O <= 9 ? q << (O <= 9 ? 9 - O : 0) : q >> (O > 9 ? O - 9 : 0);
    uint32_t s = q << (12 - O);
    uint32_t hv = (m & 0x0E000E00u) | (s & 0x80008000u);
    float lo, hi;
    asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %2;\n\tcvt.f32.f16 %0, l;\n\tcvt.f32.f16 %1, u;\n\t}"
        : "=f"(lo), "=f"(hi)
        : "r"(hv));
    return make_float2(lo, hi);
}

/* thread's sum over vector q (its scale word sw) times x values xr */
template <int FP4, int DEC>
__device__ __forceinline__ float b1_vec(const uint4 &q, uint32_t sw, const mb_half &W, int c, const float *xr,
                                        const float *lut) {
    const uint32_t *qw = (const uint32_t *)&q;
    if (FP4) {
        float a0 = 0.0f, a1 = 0.0f, b0 = 0.0f, b1 = 0.0f; /* a: values 0..15, b: 16..31 */
#pragma unroll
        for (int w4 = 0; w4 < 4; w4++) {
            float2 f[4];
            if (DEC) {
                f[0] = b1_e2m1x2<0>(qw[w4]);
                f[1] = b1_e2m1x2<4>(qw[w4]);
                f[2] = b1_e2m1x2<8>(qw[w4]);
                f[3] = b1_e2m1x2<12>(qw[w4]);
            } else {
#pragma unroll
                for (int j = 0; j < 4; j++)
                    f[j] = make_float2(lut[(qw[w4] >> (4 * j)) & 15u], lut[(qw[w4] >> (4 * j + 16)) & 15u]);
            }
#pragma unroll
            for (int j = 0; j < 4; j++) { /* f[j]: values 8 w4 + j and 8 w4 + j + 4 */
                float p0 = f[j].x * xr[8 * w4 + j], p1 = f[j].y * xr[8 * w4 + j + 4];
                if (w4 < 2) a0 += p0, a1 += p1;
                else b0 += p0, b1 += p1;
            }
        }
        float a = a0 + a1, b = b0 + b1;
        if (DEC) a *= 16384.0f, b *= 16384.0f; /* 2^14: the f16 codes' scale, exact */
        if (W.fmt == DSV4_WF_MXFP4) return (a + b) * d_e8m0_to_f32((sw >> (8 * (c & 3))) & 255u);
        int sh = 8 * ((2 * c) & 3);
        float s0 = d_e4m3_to_f32((sw >> sh) & 255u) * W.scale2, s1 = d_e4m3_to_f32((sw >> (sh + 8)) & 255u) * W.scale2;
        return a * s0 + b * s1;
    }
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float2 e0 = d_e4m3x2_to_f32x2((uint16_t)qw[w4]), e1 = d_e4m3x2_to_f32x2((uint16_t)(qw[w4] >> 16));
        a0 += e0.x * xr[4 * w4] + e1.x * xr[4 * w4 + 2];
        a1 += e0.y * xr[4 * w4 + 1] + e1.y * xr[4 * w4 + 3];
    }
    float sc = W.scale_f32 ? __uint_as_float(sw) : d_e8m0_to_f32((sw >> (8 * ((c * 16 / W.block) & 3))) & 255u);
    return (a0 + a1) * sc;
}

/* the block's FB features from f0 of one group (weights W: up w1, w3; down w2) */
template <int UP, int FP4, int DEC, int B1_S, int B1_V, int M>
__device__ __forceinline__ void b1_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const float *xs, int64_t f0,
                                       float *out, float pre, float limit, int act_bf16, const float *lut) {
    constexpr int NH = UP ? 2 : 1, U = B1_V / NH, NIT = M / U, VN = FP4 ? 32 : 16;
    static_assert(NIT >= B1_S - 1 && B1_V % NH == 0 && 8 * M * NH <= 256, "b1 geometry: part holds 256 sums");
    uint4 *sd = (uint4 *)sm;
    uint32_t *ssc = (uint32_t *)(sm + B1_S * B1_V * 256 * 16);
    float *part = (float *)(ssc + B1_S * B1_V * 256);
    int tid = threadIdx.x, lane = tid & 31;
    int cv = W[0].rowb / 16, P = 256 / cv, c = tid & (cv - 1), p = tid / cv, kw = cv / 32, kwi = c >> 5;
    float xr[VN];
    const float4 *xp = (const float4 *)(xs + (int64_t)c * VN);
#pragma unroll
    for (int j = 0; j < VN / 4; j++) {
        float4 v = __ldg(xp + j);
        xr[4 * j] = v.x, xr[4 * j + 1] = v.y, xr[4 * j + 2] = v.z, xr[4 * j + 3] = v.w;
    }
    auto issue = [&](int it) { /* stage it % B1_S <- this thread's vectors of iteration it */
        int st = it % B1_S;
#pragma unroll
        for (int j = 0; j < B1_V; j++) {
            int u = j / NH, hh = j % NH;
            int64_t o = f0 + p + (int64_t)P * (it * U + u);
            if (o < rows) {
                const mb_half &H = W[hh];
                b1_cp16<B1_HINT>(&sd[(st * B1_V + j) * 256 + tid], H.data + o * H.rowb + (int64_t)c * 16);
                const uint8_t *sp;
                if (FP4) sp = H.scale + o * H.srow + (H.fmt == DSV4_WF_MXFP4 ? c : 2 * c);
                else sp = H.scale + (o / H.block) * H.srow + (int64_t)(c * 16 / H.block) * (H.scale_f32 ? 4 : 1);
                b1_cp4(&ssc[(st * B1_V + j) * 256 + tid], (const void *)((uintptr_t)sp & ~(uintptr_t)3));
            }
        }
        d_cp_commit();
    };
#pragma unroll
    for (int it = 0; it < B1_S - 1; it++) issue(it);
    for (int it = 0; it < NIT; it++) {
        if (it + B1_S - 1 < NIT) issue(it + B1_S - 1);
        else d_cp_commit(); /* an empty group keeps the count of pending groups at B1_S - 1 */
        d_cp_wait<B1_S - 1>();
        int st = it % B1_S;
        float a2[B1_V][1];
#pragma unroll
        for (int j = 0; j < B1_V; j++)
            a2[j][0] = b1_vec<FP4, DEC>(sd[(st * B1_V + j) * 256 + tid], ssc[(st * B1_V + j) * 256 + tid], W[j % NH],
                                        c, xr, lut);
        /* rows past the weight's end hold stale stage data: their sums are never written */
        float wsum = mv_reduce<B1_V, 1>(a2, nullptr, 0, 0, 1, lane); /* value j on lane j */
        if (lane < B1_V) {
            int fl = p + P * (it * U + lane / NH);
            part[(fl * NH + lane % NH) * kw + kwi] = wsum;
        }
    }
    __syncthreads();
    int64_t nvalid = rows - f0 < (int64_t)P * M ? rows - f0 : (int64_t)P * M;
    b1_write<UP>(part, kw, nvalid, tid, f0, out, pre, limit, act_bf16);
}

/* a one-slot group's weights (up: w1 and w3, down: w2), its feature count, input row (up: x or,
 * for an FP8-quantized expert under act_fp8, xq; down: the slot's h), output row, and this
 * block's first feature f0 (M features per thread); 0 when the block is past the group's
 * features (block-uniform: the block exits) */
template <int UP, int M>
__device__ __forceinline__ int b1_group(const group &G, const dexpert &E, const float *x, const float *xq, float *h,
                                        int64_t ldh, float *y, int64_t dim, int act_fp8, mb_half (&W)[2],
                                        int64_t &rows, const float *&xs, float *&out, int64_t &f0,
                                        int64_t chunk) {
    if (UP) {
        W[0] = mb_make(E.w1);
        W[1] = mb_make(E.w3);
        rows = E.w1.rows;
        xs = (act_fp8 && E.q1 ? xq : x) + (int64_t)G.row[0] * dim;
        out = h + (int64_t)G.slot[0] * ldh;
    } else {
        W[0] = W[1] = mb_make(E.w2);
        rows = E.w2.rows < dim ? E.w2.rows : dim;
        xs = h + (int64_t)G.slot[0] * ldh;
        out = y + (int64_t)G.slot[0] * dim;
    }
    f0 = chunk * (256 / (W[0].rowb / 16)) * M;
    return f0 < rows;
}

/* grid (chunks, max groups); dynamic shared memory B1_SMEM(S, V); groups of one slot (rows == 1);
 * M features per thread (up: B1_MUP), MINB resident blocks per SM (the register budget) */
template <int UP, int DEC, int S, int V, int M, int MINB>
__global__ void __launch_bounds__(256, MINB) k_moe_b1_prev(const group *groups, const int *n_groups, const dexpert *tab,
                                                        const float *x, const float *xq, float *h, int64_t ldh,
                                                        float *y, int64_t dim, int act_fp8, float limit, int act_bf16) {
    pdl_enter();
    extern __shared__ __align__(128) uint8_t b1s[];
    __shared__ float lut[16];
    if (threadIdx.x < 16) lut[threadIdx.x] = d_e2m1_to_f32(threadIdx.x);
    __syncthreads();
    if ((int)blockIdx.y >= *n_groups) return; /* grid.y is an upper bound */
    const group &G = groups[blockIdx.y];
    mb_half W[2];
    int64_t rows, f0;
    const float *xs;
    float *out;
    if (!b1_group<UP, M>(G, tab[G.ex], x, xq, h, ldh, y, dim, act_fp8, W, rows, xs, out, f0, blockIdx.x))
        return;
    if (W[0].fmt == DSV4_WF_FP8)
        b1_run<UP, 0, DEC, S, V, M>(b1s, W, rows, xs, f0, out, G.pre[0], limit, act_bf16, lut);
    else
        b1_run<UP, 1, DEC, S, V, M>(b1s, W, rows, xs, f0, out, G.pre[0], limit, act_bf16, lut);
}

/* the one-row kernels' chunks (grid.x) for weight w of rows features, m features per thread */
static unsigned b1_chunks(const dsv4_weight *w, int64_t rows, int m) {
    int fp4 = w->fmt == DSV4_WF_MXFP4 || w->fmt == DSV4_WF_NVFP4;
    int64_t cv = (fp4 ? w->cols / 2 : w->cols) / 16, fb = (256 / cv) * m;
    return (unsigned)((rows + fb - 1) / fb);
}

/* ----- one row, one pipeline per weight format (k_moe_b1) -----
 * The thread layout and pipeline of k_moe_b1_prev (above): thread t owns column vector
 * c = t % cv of the features p + P i (p = t / cv, P = 256 / cv, i < M), its x values in
 * registers, its own vectors copied by cp.async into its own slots of S stages of V vectors.
 * What changed, each to cut instructions per weight (the previous kernel issued ~7.5 per FP4
 * weight, ~240 of ~500 per 64 weights outside the decode and the products):
 * - the format (MXFP4, NVFP4, FP8) is a template argument: the block picks its instance once
 *   (w1 and w3 share a format: the expert table checks it), no format branch in the loop;
 * - feature i of a thread lies P x row bytes = 4096 bytes after feature i - 1 whatever the
 *   shape (P cv = 256 vectors of 16 bytes), so the loop, unrolled over its S stages, addresses
 *   every copy as a base pointer plus a constant;
 * - block scales do not travel per vector: the block's scale rows (one contiguous range per
 *   weight, rows f0 .. f0 + P M) are loaded once and stored as a table of 16-bit entries, entry
 *   tid + 256 i for the thread's i-th feature (up: the w1 and w3 entries in one 32-bit word):
 *   MXFP4 as the bf16 of the e8m0 scale (exact: 2^(c-127), code 0 the subnormal 2^-127, code
 *   255 NaN, d_e8m0_to_f32's values), which becomes an f32 by one shift; NVFP4 the two e4m3
 *   bytes, decoded by cvt as k_moe_b1_prev does; FP8 (128 x 128 blocks) one scale per thread
 *   and weight, in a register (the host takes this kernel only when the block's P M features
 *   lie in one row of scale blocks);
 * - the warp sums are reduced once per S stages (S V values by one shuffle tree) instead of once
 *   per stage;
 * - e2m1 (DEC 2): a code's magnitude bits go to bits 2..4 of an e4m3 byte and its sign to bit 7,
 *   which makes the byte the code's value times 2^-6 exactly (code 1 = 0.5 becomes the e4m3
 *   subnormal 2^-7); four codes per 32-bit word by two shifts and masks, then cvt e4m3x2 ->
 *   f16x2 -> f32 as for FP8 weights.  DEC 1 is k_moe_b1_prev's f16 assembly (values times
 *   2^-14).  The vector's sum is multiplied by 2^6 (2^14) exactly before its block scale, so
 *   every product is that of the exact weight and x up to a power of two, barring products
 *   that underflow (x below ~2^-119 with DEC 2).
 * Layout of the dynamic shared memory: S V 256 stage vectors of 16 bytes, the scale table
 * (256 M entries of NH x 16 bits), the warp sums (8 M NH floats).
 * Both halves run here by default: gate/up 4.67 instead of 7.52 instructions per weight (34.3
 * instead of 46.2 us on Flash), down at 4 blocks per SM 19.8 instead of 24.9 us (the geometry
 * table below). */
enum { B1F_MXFP4 = 0, B1F_NVFP4 = 1, B1F_FP8 = 2 };
#define B1F_SMEM(S, V, M, NH) ((S) * (V) * 256 * 16 + 256 * (M) * 2 * (NH) + 8 * (M) * (NH) * 4)

/* bf16 bits of the e8m0 scale c: exactly d_e8m0_to_f32(c) once shifted into an f32 */
__device__ __forceinline__ uint32_t b1_e8m0_bf16(uint32_t c) {
    return (c << 7) | (c == 0u || c == 255u ? 0x40u : 0u);
}

/* 4 e4m3 bytes of w as f32 (byte k -> f[k]); exact (cvt e4m3x2 -> f16x2, f16 -> f32) */
__device__ __forceinline__ void b1_e4m3x4(uint32_t w, float (&f)[4]) {
    asm("{\n\t.reg .b16 l, u, a, b, c, d;\n\t.reg .b32 h0, h1;\n\t"
        "mov.b32 {l, u}, %4;\n\tcvt.rn.f16x2.e4m3x2 h0, l;\n\tcvt.rn.f16x2.e4m3x2 h1, u;\n\t"
        "mov.b32 {a, b}, h0;\n\tmov.b32 {c, d}, h1;\n\t"
        "cvt.f32.f16 %0, a;\n\tcvt.f32.f16 %1, b;\n\tcvt.f32.f16 %2, c;\n\tcvt.f32.f16 %3, d;\n\t}"
        : "=f"(f[0]), "=f"(f[1]), "=f"(f[2]), "=f"(f[3])
        : "r"(w));
}

/* the 32 e2m1 products of vector q with xr, times 2^-6 (DEC 2) or 2^-14 (DEC 1), exact:
 * a = values 0..15, b = values 16..31 (byte j of the vector holds value 2j in its low nibble) */
template <int DEC>
__device__ __forceinline__ void b1f_fp4(const uint4 &q, const float *xr, float &a, float &b) {
    const uint32_t *qw = (const uint32_t *)&q;
    float a0 = 0.0f, a1 = 0.0f, b0 = 0.0f, b1 = 0.0f;
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float f[8]; /* values 8 w4 + k */
        if (DEC == 2) {
            /* e4m3 byte of code (s, m3): s << 7 | m3 << 2; low nibbles (values 0, 2, 4, 6), high (1, 3, 5, 7) */
            uint32_t lo = ((qw[w4] & 0x07070707u) << 2) | ((qw[w4] & 0x08080808u) << 4);
            uint32_t hi = ((qw[w4] >> 2) & 0x1C1C1C1Cu) | (qw[w4] & 0x80808080u);
            float l[4], u[4];
            b1_e4m3x4(lo, l);
            b1_e4m3x4(hi, u);
#pragma unroll
            for (int k = 0; k < 4; k++) f[2 * k] = l[k], f[2 * k + 1] = u[k];
        } else {
            float2 e0 = b1_e2m1x2<0>(qw[w4]), e1 = b1_e2m1x2<4>(qw[w4]), e2 = b1_e2m1x2<8>(qw[w4]),
                   e3 = b1_e2m1x2<12>(qw[w4]);
            f[0] = e0.x, f[4] = e0.y, f[1] = e1.x, f[5] = e1.y, f[2] = e2.x, f[6] = e2.y, f[3] = e3.x, f[7] = e3.y;
        }
#pragma unroll
        for (int k = 0; k < 8; k++) {
            float pr = f[k] * xr[8 * w4 + k];
            if (w4 < 2) (k & 1 ? a1 : a0) += pr;
            else (k & 1 ? b1 : b0) += pr;
        }
    }
    a = a0 + a1;
    b = b0 + b1;
}

/* the 16 products of FP8 vector q with xr (exact decode), one fma chain per accumulator (the
 * form a += p + p' compiled to FMUL + FFMA + FADD per two products) */
__device__ __forceinline__ float b1f_fp8(const uint4 &q, const float *xr) {
    const uint32_t *qw = (const uint32_t *)&q;
    float a0 = 0.0f, a1 = 0.0f;
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float f[4];
        b1_e4m3x4(qw[w4], f);
        a0 = fmaf(f[0], xr[4 * w4], a0);
        a1 = fmaf(f[1], xr[4 * w4 + 1], a1);
        a0 = fmaf(f[2], xr[4 * w4 + 2], a0);
        a1 = fmaf(f[3], xr[4 * w4 + 3], a1);
    }
    return a0 + a1;
}

/* one step of b1f_reduce's halving tree: M values left, partner lanes at offset OFF; a step per
 * template level, so every index is a constant (a loop over M here was not unrolled for N = 16:
 * nvcc put the values in local memory, and down ran 31.6 us instead of 24.7, H200, ncu) */
template <int M, int OFF, int N>
__device__ __forceinline__ void b1f_halve(float (&v)[N], int lane) {
    if constexpr (M > 1) {
        int up = lane & OFF;
#pragma unroll
        for (int i = 0; i < M / 2; i++) {
            float keep = up ? v[i + M / 2] : v[i], send = up ? v[i] : v[i + M / 2];
            v[i] = keep + __shfl_xor_sync(0xffffffffu, send, OFF);
        }
        b1f_halve<M / 2, OFF / 2, N>(v, lane);
    }
}

/* value lane / (32 / N) summed over the warp, on the lanes where lane % (32 / N) == 0 (the
 * halving tree of mv_reduce without its last shuffle) */
template <int N>
__device__ __forceinline__ float b1f_reduce(float (&v)[N], int lane) {
    static_assert(N >= 2 && N <= 32 && (N & (N - 1)) == 0, "b1f_reduce: N a power of two, 2..32");
    b1f_halve<N, 16, N>(v, lane);
#pragma unroll
    for (int off = 16 / N; off; off >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], off);
    return v[0];
}

/* b1f_run and bn_run's refill at step st of a round: the copies of iteration it0 + st + S - 1
 * (features from the round's first: ib < nvr are valid; b0 / b1 the round's first vectors) into
 * stage (st + S - 1) % S, then the wait for stage st */
template <int NH, int S, int V, int HINT>
__device__ __forceinline__ void b1f_refill(uint4 *sd, int st, int nvr, const uint8_t *b0, const uint8_t *b1) {
    constexpr int U = V / NH, FSTEP = 4096;
#pragma unroll
    for (int j = 0; j < V; j++) {
        int u = j / NH, ib = (st + S - 1) * U + u;
        if (ib < nvr) b1_cp16<HINT>(sd + (((st + S - 1) % S) * V + j) * 256, (j % NH ? b1 : b0) + ib * FSTEP);
    }
    d_cp_commit();
    d_cp_wait<S - 1>();
}

/* The start of b1f_run and bn_run (weights only: it runs before the PDL wait): the block's
 * features nfeat and this thread's valid ones nv (i < nv), its first weight vectors g0 / g1, the
 * first S - 1 stages of its copies in flight, and the scales: FP8 this thread's two block scales
 * (fsc), FP4 the block's table in shared memory (tile; read after the caller's barrier). */
template <int UP, int FMT, int S, int V, int M, int HINT>
__device__ __forceinline__ void b1f_start(uint8_t *sm, const mb_half (&W)[2], int64_t rows, int64_t f0, int &nfeat,
                                          int &nv, const uint8_t *&g0, const uint8_t *&g1, float (&fsc)[2]) {
    constexpr int NH = UP ? 2 : 1, U = V / NH;
    constexpr int FSTEP = 4096; /* bytes from one of a thread's features to the next */
    uint4 *sd = (uint4 *)sm + threadIdx.x; /* this thread's slot of stage vector 0 */
    uint8_t *tile = sm + S * V * 256 * 16;
    int tid = threadIdx.x;
    int cv = W[0].rowb / 16, P = 256 / cv, c = tid & (cv - 1), p = tid / cv;
    nfeat = (int)(rows - f0 < (int64_t)P * M ? rows - f0 : (int64_t)P * M);
    nv = (nfeat - p + P - 1) / P; /* this thread's valid features: i < nv */
    g0 = W[0].data + (f0 + p) * W[0].rowb + c * 16;
    g1 = UP ? W[1].data + (f0 + p) * W[1].rowb + c * 16 : g0;
    /* iteration it copies features it U .. it U + U - 1 (both halves for up) into stage it % S */
    auto issue = [&](int st, int ib, const uint8_t *b0, const uint8_t *b1) { /* ib: first feature, from b0/b1 */
#pragma unroll
        for (int j = 0; j < V; j++) {
            int u = j / NH;
            if (ib + u < nv) b1_cp16<HINT>(sd + (st * V + j) * 256, (j % NH ? b1 : b0) + (ib + u) * FSTEP);
        }
        d_cp_commit();
    };
#pragma unroll
    for (int st = 0; st < S - 1; st++) issue(st, st * U, g0, g1);
    /* the scale table (FP4) or this thread's two block scales (FP8) */
    fsc[0] = fsc[1] = 0.0f;
    if (FMT == B1F_FP8) {
        int64_t rb = f0 / W[0].block;
        int cb = c * 16 / W[0].block;
#pragma unroll
        for (int hh = 0; hh < NH; hh++) {
            const uint8_t *sp = W[hh].scale + rb * W[hh].srow;
            fsc[hh] = W[hh].scale_f32 ? __ldg((const float *)sp + cb) : d_e8m0_to_f32(__ldg(sp + cb));
        }
    } else {
        /* scale bytes per feature row: MXFP4 cv (one per vector), NVFP4 2 cv (two per vector); a
         * 16-byte chunk of the block's range holds 16 (MXFP4) or 8 (NVFP4) table entries and lies
         * in one row (cv >= 32) */
        constexpr int EPC = FMT == B1F_MXFP4 ? 16 : 8, NCH = 256 * M / EPC / 256;
        int srow = W[0].srow;
#pragma unroll
        for (int j = 0; j < NCH; j++) {
            int k = tid + 256 * j;
            if ((int64_t)k * 16 >= (int64_t)nfeat * srow) break;
            uint4 s0 = __ldg((const uint4 *)(W[0].scale + f0 * srow) + k);
            uint4 s1 = UP ? __ldg((const uint4 *)(W[1].scale + f0 * srow) + k) : s0;
            const uint32_t *a = (const uint32_t *)&s0, *b = (const uint32_t *)&s1;
            if (FMT == B1F_MXFP4) {
                uint32_t e[16];
#pragma unroll
                for (int i = 0; i < 16; i++) {
                    uint32_t lo = b1_e8m0_bf16((a[i / 4] >> (8 * (i % 4))) & 255u);
                    e[i] = UP ? lo | b1_e8m0_bf16((b[i / 4] >> (8 * (i % 4))) & 255u) << 16 : lo;
                }
                if (UP) {
                    uint4 *t4 = (uint4 *)tile + 4 * k;
#pragma unroll
                    for (int i = 0; i < 4; i++) t4[i] = make_uint4(e[4 * i], e[4 * i + 1], e[4 * i + 2], e[4 * i + 3]);
                } else {
                    uint4 *t4 = (uint4 *)tile + 2 * k;
#pragma unroll
                    for (int i = 0; i < 2; i++)
                        t4[i] = make_uint4(e[8 * i] | e[8 * i + 1] << 16, e[8 * i + 2] | e[8 * i + 3] << 16,
                                           e[8 * i + 4] | e[8 * i + 5] << 16, e[8 * i + 6] | e[8 * i + 7] << 16);
                }
            } else if (UP) { /* NVFP4: entry = the vector's two e4m3 bytes; w1's low, w3's high */
                uint4 *t4 = (uint4 *)tile + 2 * k;
#pragma unroll
                for (int i = 0; i < 2; i++)
                    t4[i] = make_uint4(__byte_perm(a[2 * i], b[2 * i], 0x5410), __byte_perm(a[2 * i], b[2 * i], 0x7632),
                                       __byte_perm(a[2 * i + 1], b[2 * i + 1], 0x5410),
                                       __byte_perm(a[2 * i + 1], b[2 * i + 1], 0x7632));
            } else {
                ((uint4 *)tile)[k] = s0;
            }
        }
    }
}

/* one stage vector q's sum in format FMT: the products with xr and the scale (FP8: this thread's block
 * scale fsc; FP4: the entry te of the block's table, half hh) */
template <int FMT, int DEC>
__device__ __forceinline__ float b1f_dot(const uint4 &q, const float *xr, uint32_t te, int hh, float fsc,
                                         const mb_half &H) {
    if (FMT == B1F_FP8) return b1f_fp8(q, xr) * fsc;
    float a, b;
    b1f_fp4<DEC>(q, xr, a, b);
    const float k = DEC == 2 ? 64.0f : 16384.0f; /* 2^6 / 2^14: the codes' scale, exact */
    uint32_t bits = hh ? te >> 16 : te & 0xffffu;
    if (FMT == B1F_MXFP4) return ((a + b) * k) * __uint_as_float(bits << 16);
    float2 s2 = d_e4m3x2_to_f32x2((uint16_t)bits);
    return (a * k) * (s2.x * H.scale2) + (b * k) * (s2.y * H.scale2);
}

/* the block's features f0 .. f0 + P M of one group in format FMT (up: w1, w3; down: w2) */
template <int UP, int FMT, int DEC, int S, int V, int M, int HINT>
__device__ __forceinline__ void b1f_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const float *xs, int64_t f0,
                                        float *out, float pre, float limit, int act_bf16) {
    constexpr int NH = UP ? 2 : 1, U = V / NH, NIT = M / U, VN = FMT == B1F_FP8 ? 16 : 32, NV = S * V;
    /* DEC 3: DEC 2's decode with the stage loop rolled (gate/up's default since stop 41: b1_geoms) */
    constexpr int DC = DEC == 3 ? 2 : DEC;
    constexpr int FSTEP = 4096; /* bytes from one of a thread's features to the next */
    static_assert(V % NH == 0 && M % U == 0 && NIT % S == 0 && NV <= 32 && M % 16 == 0, "b1 geometry");
    uint4 *sd = (uint4 *)sm + threadIdx.x; /* this thread's slot of stage vector 0 */
    uint8_t *tile = sm + S * V * 256 * 16;
    float *part = (float *)(tile + 256 * M * 2 * NH);
    int tid = threadIdx.x, lane = tid & 31;
    int cv = W[0].rowb / 16, P = 256 / cv, c = tid & (cv - 1), p = tid / cv, kw = cv / 32, kwi = c >> 5;
    int nfeat, nv;
    const uint8_t *g0, *g1;
    float fsc[2];
    b1f_start<UP, FMT, S, V, M, HINT>(sm, W, rows, f0, nfeat, nv, g0, g1, fsc);
    /* everything above reads weights only (copies, scales) or the plan's groups, which were
     * complete before the kernel this one follows started (k_moe_b1r's down half waits here,
     * common.cuh's PDL); x is the previous kernel's output */
    pdl_wait();
    float xr[VN];
    const float4 *xp = (const float4 *)(xs + (int64_t)c * VN);
#pragma unroll
    for (int j = 0; j < VN / 4; j++) {
        float4 v = __ldg(xp + j);
        xr[4 * j] = v.x, xr[4 * j + 1] = v.y, xr[4 * j + 2] = v.z, xr[4 * j + 3] = v.w;
    }
    __syncthreads();
    const uint32_t *t32 = (const uint32_t *)tile + tid;
    const uint16_t *t16 = (const uint16_t *)tile + tid;
    for (int it0 = 0; it0 < NIT; it0 += S) {
        const uint8_t *b0 = g0 + (int64_t)it0 * U * FSTEP, *b1 = g1 + (int64_t)it0 * U * FSTEP;
        int nvr = nv - it0 * U; /* valid features counted from this round's first */
        /* DEC 3: one stage a trip, its V sums reduced at once (the same tree, so the same bits).  The
         * stage body and the part write repeat the unrolled form's below: moving both into shared helpers
         * (tried) changed the SASS of the measured unrolled down kernel, so they stay written twice */
        if constexpr (DEC == 3) {
#pragma unroll 1
            for (int st = 0; st < S; st++) {
                b1f_refill<NH, S, V, HINT>(sd, st, nvr, b0, b1);
                float v[V];
#pragma unroll
                for (int u = 0; u < U; u++) {
                    int i = (it0 + st) * U + u;
                    uint32_t te = UP ? t32[256 * i] : (uint32_t)t16[256 * i];
#pragma unroll
                    for (int hh = 0; hh < NH; hh++)
                        v[u * NH + hh] = b1f_dot<FMT, DC>(sd[(st * V + u * NH + hh) * 256], xr, te, hh, fsc[hh], W[hh]);
                }
                float wsum = b1f_reduce<V>(v, lane);
                if ((lane & (32 / V - 1)) == 0) {
                    int j = lane / (32 / V);
                    int fl = p + P * ((it0 + st) * U + j / NH);
                    part[(fl * NH + j % NH) * kw + kwi] = wsum;
                }
            }
        } else {
            float v[NV];
#pragma unroll
            for (int st = 0; st < S; st++) {
                b1f_refill<NH, S, V, HINT>(sd, st, nvr, b0, b1); /* then compute stage st */
#pragma unroll
                for (int u = 0; u < U; u++) {
                    int i = (it0 + st) * U + u; /* the thread's feature index */
                    uint32_t te = UP ? t32[256 * i] : (uint32_t)t16[256 * i];
#pragma unroll
                    for (int hh = 0; hh < NH; hh++)
                        v[st * V + u * NH + hh] = b1f_dot<FMT, DC>(sd[(st * V + u * NH + hh) * 256], xr, te, hh,
                                                                   fsc[hh], W[hh]);
                }
            }
            /* rows past the weight's end hold stale stage data: their sums are never read */
            float wsum = b1f_reduce<NV>(v, lane);
            if ((lane & (32 / NV - 1)) == 0) {
                int jv = lane / (32 / NV), st = jv / V, j = jv % V;
                int fl = p + P * ((it0 + st) * U + j / NH);
                part[(fl * NH + j % NH) * kw + kwi] = wsum;
            }
        }
    }
    __syncthreads();
    b1_write<UP>(part, kw, nfeat, tid, f0, out, pre, limit, act_bf16);
}

/* b1f_run in the instance of the group's weight format (w1 and w3 share one: the expert table
 * checks it) */
template <int UP, int DEC, int S, int V, int M, int HINT>
__device__ __forceinline__ void b1f_format(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const float *xs,
                                           int64_t f0, float *out, float pre, float limit, int act_bf16) {
    if (W[0].fmt == DSV4_WF_MXFP4)
        b1f_run<UP, B1F_MXFP4, DEC, S, V, M, HINT>(sm, W, rows, xs, f0, out, pre, limit, act_bf16);
    else if (W[0].fmt == DSV4_WF_NVFP4)
        b1f_run<UP, B1F_NVFP4, DEC, S, V, M, HINT>(sm, W, rows, xs, f0, out, pre, limit, act_bf16);
    else
        b1f_run<UP, B1F_FP8, DEC, S, V, M, HINT>(sm, W, rows, xs, f0, out, pre, limit, act_bf16);
}

/* ----- one row on tensor cores (moe.dot=mma: k_moe_b1r's MMA instances, below) -----
 * The MXFP4 groups of k_moe_b1r's grid form their dots with mma.sync.m16n8k16 (f16 inputs, f32
 * accumulation) instead of the CUDA cores' fp32 fma: the e2m1 codes become e4m3 bytes (5 integer
 * operations a word of 8 codes) and those f16 pairs (cvt.rn.f16x2.e4m3x2, 4 a word), the values
 * times 2^-6, exact; two MMAs take 16 weight rows x the 32 k of one scale block, and the block's
 * e8m0 scale multiplies the fp32 result.  (A first version built the f16 codes by shifts and masks,
 * ~40 % more instructions: docs/CUDA.md, "MoE on tensor cores".)  x goes in
 * as B: k_moe_xsplit scales each 32-wide block of an input row by a power of two 2^-E (its max
 * |x| lands in [2^14, 2^15)) and splits every value into three f16 parts hi + mid + lo (each the
 * f16 rounding of what the parts before it left; the subtractions are exact), in B's columns 0,
 * 1 and 2; columns 3..7 are zero.  The products are then exact and the three columns hold x to 33
 * bits (its fp32 value, but for parts below f16's subnormal floor: an error under 2^-39 of the
 * block's max |x|).  What differs from the fp32 fma chain is the tensor core's own summation of
 * each MMA's 16 products (and of a block's two MMAs), whose rounding is not IEEE step by step: a
 * named switch (moe.dot, off in both profiles), its error measured against the CPU op by
 * test_cuda_moe and test_cuda_e2e.
 * Fragments (PTX ISA, mma.m16n8k16 .f16; lane = 4 g + t): A a0 / a1 row g / g + 8 at k 2t, 2t + 1,
 * a2 / a3 the same rows at k 2t + 8, 2t + 9; B b0 k 2t, 2t + 1 and b1 k 2t + 8, 2t + 9 of column
 * g; D c0, c1 row g at columns 2t, 2t + 1, c2, c3 row g + 8.  A block's sum does not depend on
 * where each k goes, so A and B share a permutation: lane t takes the 32-bit word t of a row's
 * 16-byte vector (codes 8t .. 8t + 7; byte j: code 8t + 2j low nibble, 8t + 2j + 1 high), and the
 * first MMA takes the low nibbles (k 2t, 2t + 1 = codes 8t, 8t + 2 from bytes 0, 1; k 2t + 8, 2t + 9
 * = codes 8t + 4, 8t + 6 from bytes 2, 3: one cvt each), the second the high nibbles (codes 8t + 1,
 * 8t + 3 and 8t + 5, 8t + 7); B holds x in that order.
 * Work of a block (its k_moe_b1r chunk: P M features, both halves for gate/up): passes of RP <= 64
 * weight rows (gate/up: RP / 2 features of w1, then the same of w3); warp w takes row group
 * w % NRG (16 rows) and the w / NRG-th of NKP = 8 / NRG equal parts of the scale blocks, streamed
 * by the warp alone (no block barrier inside a pass) through BM_NST stages, each 16 rows x 2
 * vectors of weights (one cp.async of 16 bytes a lane; the vector's slot swapped for rows 4..7 of
 * each 8, which keeps the fragment reads free of bank conflicts) and the two blocks' B records
 * (13 x 16 bytes each: lanes 0..11's fragments, then the block's 2^(E + 14)).  The scales of a
 * pass sit in shared memory as bf16 bits (b1_e8m0_bf16: 0 and 255 exact), rows padded by one
 * word.  Lanes t = 0 / 1 accumulate (c0 + c1) x scale x 2^(E + 14) (columns hi + mid / lo) for
 * rows g and g + 8; at the end of a pass the pair is added (t = 0 first), times 2^-8 (the codes'
 * 2^-6 against the records' 2^-14), into part, and b1_write
 * adds the NKP parts of each feature in order, as k_moe_b1r's does with its warp sums. */
enum { BM_NST = 4, BM_A = 512, BM_REC = 13 * 16, BM_STAGE = BM_A + 2 * BM_REC };
#define BM_SCT (64 * 128 * 2 + 64 * 4) /* scale table: RP x (cv + 2) bf16, RP cv <= 8192 */
#define BM_PART (512 * 4)              /* part: the chunk's rows x NKP <= 512 floats */
#define BM_SMEM (8 * BM_NST * BM_STAGE + BM_SCT + BM_PART)

/* f16x2 of the e4m3 bytes 2H, 2H + 1 of w (byte 2H in the low half; exact) */
template <int H>
__device__ __forceinline__ uint32_t bm_f16x2(uint32_t w) {
    uint32_t d;
    if (H == 0)
        asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, l;\n\t}" : "=r"(d) : "r"(w));
    else
        asm("{\n\t.reg .b16 l, u;\n\tmov.b32 {l, u}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, u;\n\t}" : "=r"(d) : "r"(w));
    return d;
}

/* the e4m3 bytes (value times 2^-6, exact) of the e2m1 codes of word w: lo = the low nibbles
 * (codes 0, 2, 4, 6 of the word, byte j = code 2j), hi = the high nibbles (codes 1, 3, 5, 7) */
__device__ __forceinline__ void bm_e4m3(uint32_t w, uint32_t &lo, uint32_t &hi) {
    lo = ((w & 0x07070707u) << 2) | ((w & 0x08080808u) << 4);
    hi = ((w >> 2) & 0x1C1C1C1Cu) | (w & 0x80808080u);
}

/* cp.async.wait_group min(n, BM_NST - 1) (the count must be an immediate; n is one in the
 * unrolled loop of bm_run) */
__device__ __forceinline__ void bm_wait(int n) {
    static_assert(BM_NST == 4, "bm_wait covers n = 1, 2 and BM_NST - 1 = 3");
    if (n >= BM_NST - 1) d_cp_wait<BM_NST - 1>();
    else if (n == 2) d_cp_wait<2>();
    else d_cp_wait<1>();
}

/* f16 bits of v, rounded to nearest even, and back */
__device__ __forceinline__ uint32_t bm_f16(float v) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v));
    return h;
}
__device__ __forceinline__ float bm_f16_f32(uint32_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"((unsigned short)h));
    return f;
}
/* 2^e as f32 for e in [-126, 127] */
__device__ __forceinline__ float bm_exp2i(int e) { return __uint_as_float((uint32_t)(e + 127) << 23); }

/* The MXFP4 scale table of a pass (bm_run) or block (bm2_run): nr weight rows, row r the half r / FP
 * at feature fb + r % FP of the block's (rows past nfeat: zero), each row's cv e8m0 codes as bf16
 * bits (b1_e8m0_bf16: 0 and 255 exact) at sst entries a row; every thread of the block takes part */
__device__ __forceinline__ void bm_scales(uint16_t *sct, int sst, const mb_half (&W)[2], int64_t f0, int fb, int FP,
                                          int nfeat, int nr, int cv) {
    for (int i = threadIdx.x; i * 16 < nr * cv; i += 256) {
        int r = i * 16 / cv, kb = i * 16 % cv, hh = r / FP, fl = fb + r % FP;
        const uint8_t *sp = (hh ? W[1].scale : W[0].scale) + (f0 + fl) * W[0].srow + kb;
        uint4 q = fl < nfeat ? __ldg((const uint4 *)sp) : make_uint4(0, 0, 0, 0);
        const uint32_t *qw = (const uint32_t *)&q;
        uint32_t *d = (uint32_t *)(sct + r * sst + kb);
#pragma unroll
        for (int j = 0; j < 8; j++) {
            uint32_t two = qw[j / 2] >> (16 * (j % 2));
            d[j] = b1_e8m0_bf16(two & 255u) | b1_e8m0_bf16((two >> 8) & 255u) << 16;
        }
    }
}

/* The B record of one 32-wide block (k_moe_xsplit's layout, below) from the warp's 32 values, v
 * on lane l = value l; pw: 3 x 32 words of shared memory for the warp (written, then read) */
__device__ __forceinline__ void bm_record(float v, uint4 *dst, uint32_t (*pw)[32], int lane) {
    float m = fabsf(v);
    if (!(m <= 3.402823466e38f)) m = isnan(v) ? 0.0f : m; /* NaN does not count; inf does */
#pragma unroll
    for (int o = 16; o; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
    int E = m > 0.0f && m <= 3.402823466e38f ? ilogbf(m) - 14 : 0;
    /* v 2^-E in two exact steps (2^-E alone may not be an f32 for tiny blocks) */
    int e1 = -E > 127 ? 127 : -E;
    float s = v * bm_exp2i(e1) * bm_exp2i(-E - e1);
    uint32_t hi = bm_f16(s), mid = 0, lo = 0;
    if (fabsf(s) <= 3.402823466e38f) {
        float r1 = s - bm_f16_f32(hi);
        mid = bm_f16(r1);
        lo = bm_f16(r1 - bm_f16_f32(mid));
    }
    __syncwarp(); /* pw's last readers are done */
    pw[0][lane] = hi, pw[1][lane] = mid, pw[2][lane] = lo;
    __syncwarp();
    if (lane < 12) {
        const uint32_t *p = pw[lane >> 2];
        int b = 8 * (lane & 3);
        dst[lane] = make_uint4(p[b] | p[b + 2] << 16, p[b + 4] | p[b + 6] << 16, p[b + 1] | p[b + 3] << 16,
                               p[b + 5] | p[b + 7] << 16);
    } else if (lane == 12) {
        /* 2^(E + 14): E + 14 lies in [-135, 127]; below -126 a subnormal power of two, exact */
        int e = E + 14;
        dst[12] = make_uint4(__float_as_uint(e >= -126 ? bm_exp2i(e) : bm_exp2i(e + 64) * bm_exp2i(-64)), 0, 0, 0);
    }
}

/* one 32-wide block of rows g, g + 8: words wa, wb (word t of each row's vector), B fragment bf,
 * the block's 2^(E + 14) pk and the rows' scales (bf16 bits in the high half), into acc0, acc1 (bm_run
 * and bm2_run: one expression for both, so both give the same bits) */
__device__ __forceinline__ void bm_block(uint32_t wa, uint32_t wb, const uint4 &bf, float pk, uint32_t s0,
                                          uint32_t s1, float &acc0, float &acc1) {
    const float z[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float d0[4], d1[4];
    uint32_t la, ha, lb, hb;
    bm_e4m3(wa, la, ha);
    bm_e4m3(wb, lb, hb);
    d_mma_f16(d0, bm_f16x2<0>(la), bm_f16x2<0>(lb), bm_f16x2<1>(la), bm_f16x2<1>(lb), bf.x, bf.y, z);
    d_mma_f16(d1, bm_f16x2<0>(ha), bm_f16x2<0>(hb), bm_f16x2<1>(ha), bm_f16x2<1>(hb), bf.z, bf.w, d0);
    acc0 = fmaf(d1[0] + d1[1], __uint_as_float(s0) * pk, acc0);
    acc1 = fmaf(d1[2] + d1[3], __uint_as_float(s1) * pk, acc1);
}

/* The block's features f0 .. f0 + P M of one MXFP4 group (up: w1, w3; down: w2) on tensor
 * cores; xf: the input row's B records (k_moe_xsplit).  hf (gate/up, or NULL): the B records of
 * the output row h, written for the block's 32-wide blocks of features (P M % 32 == 0 and f0 %
 * 32 == 0: the caller checks), so that down needs no k_moe_xsplit of h */
template <int UP, int M>
__device__ __forceinline__ void bm_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const uint4 *xf, int64_t f0,
                                       float *out, float pre, float limit, int act_bf16, uint4 *hf) {
    constexpr int NH = UP ? 2 : 1;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int cv = W[0].rowb / 16, P = 256 / cv, nrc = P * M * NH; /* the chunk's weight rows */
    const int RP = nrc < 64 ? nrc : 64, FP = RP / NH, NRG = RP / 16, NKP = 8 / NRG, KPW = cv / NKP, NSL = KPW / 2;
    const int rg = warp % NRG, kp = warp / NRG, kb0 = kp * KPW, sst = cv + 2; /* scale row stride, entries */
    const int nfeat = (int)(rows - f0 < (int64_t)P * M ? rows - f0 : (int64_t)P * M);
    uint8_t *stg = sm + warp * (BM_NST * BM_STAGE);
    uint16_t *sct = (uint16_t *)(sm + 8 * BM_NST * BM_STAGE);
    float *part = (float *)(sm + 8 * BM_NST * BM_STAGE + BM_SCT);
    /* this lane's weight copy: row lane / 2 of the warp's 16, vector lane % 2 of each slice; its
     * record copy (lanes < 26): entry lane % 13 of block lane / 13 of the slice */
    const int crow = lane >> 1, cdst = crow * 32 + (((lane & 1) ^ ((crow >> 2) & 1)) << 4);
    const int rj = lane / 13, rdst = BM_A + rj * BM_REC + (lane % 13) * 16;
    const uint4 *rsrc = xf + (int64_t)(kb0 + rj) * 13 + lane % 13; /* slice s: + 26 s */
    const int fsw = (g >> 2) & 1; /* the slot swap of rows g and g + 8 */
    for (int pass = 0; pass * RP < nrc; pass++) {
        if (pass) __syncthreads(); /* every warp is done with the last pass's scale table */
        int cr = 16 * rg + crow, chh = cr / FP, cfl = pass * FP + cr % FP;
        /* (the halves by value: W indexed at run time would go to local memory; w1 and w3 share
         * their shapes, so rowb and srow are W[0]'s) */
        const uint8_t *src = (chh ? W[1].data : W[0].data) + (f0 + cfl) * W[0].rowb + (int64_t)(kb0 + (lane & 1)) * 16;
        bool cok = cfl < nfeat;
        /* slice s into stage q = s % BM_NST (a constant where the loop is unrolled) */
        auto copy_a = [&](int s, int q) {
            if (s < NSL && cok) b1_cp16_plain(stg + q * BM_STAGE + cdst, src + s * 32);
        };
        auto copy_b = [&](int s, int q) {
            if (s < NSL && lane < 26) b1_cp16_plain(stg + q * BM_STAGE + rdst, rsrc + 26 * s);
        };
        /* weights of the first BM_NST - 1 slices, one group each (before the PDL wait on the
         * first pass: weights only), the scale table, then the wait and one group with those
         * slices' records; slice s then needs groups <= its own and the records' group */
#pragma unroll
        for (int s = 0; s < BM_NST - 1; s++) {
            copy_a(s, s);
            d_cp_commit();
        }
        bm_scales(sct, sst, W, f0, pass * FP, FP, nfeat, RP, cv);
        if (pass == 0) pdl_wait(); /* the records are the previous kernel's */
#pragma unroll
        for (int s = 0; s < BM_NST - 1; s++) copy_b(s, s);
        d_cp_commit();
        __syncthreads();
        const uint16_t *sg = sct + (16 * rg + g) * sst + kb0, *sg8 = sg + 8 * sst;
        float acc0 = 0.0f, acc1 = 0.0f;
        /* this lane's words of rows g, g + 8 (vector j: + ((j ^ fsw) << 4)), its fragments, the
         * records' factors, from a stage's start */
        const int oa = g * 32 + 4 * t, ob = BM_A + lane * 16, op = BM_A + 12 * 16;
        const bool bl = lane < 12;
        /* NSL is a multiple of BM_NST (KPW >= 16): the stage of slice s0 + q is q */
        for (int s0 = 0; s0 < NSL; s0 += BM_NST) {
#pragma unroll
            for (int q = 0; q < BM_NST; q++) {
                int s = s0 + q;
                __syncwarp(); /* the warp is done with the stage the next copies overwrite */
                copy_a(s + BM_NST - 1, (q + BM_NST - 1) % BM_NST);
                copy_b(s + BM_NST - 1, (q + BM_NST - 1) % BM_NST);
                d_cp_commit();
                if (s0 == 0) bm_wait(q + 1);
                else d_cp_wait<BM_NST - 1>();
                __syncwarp();
                const uint8_t *st = stg + q * BM_STAGE;
                uint32_t sc0 = *(const uint32_t *)(sg + 2 * s), sc1 = *(const uint32_t *)(sg8 + 2 * s);
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    const uint8_t *ra = st + oa + ((j ^ fsw) << 4);
                    uint32_t wa = *(const uint32_t *)ra, wb = *(const uint32_t *)(ra + 8 * 32);
                    uint4 bf = bl ? *(const uint4 *)(st + ob + j * BM_REC) : make_uint4(0, 0, 0, 0);
                    float pk = *(const float *)(st + op + j * BM_REC); /* 2^(E + 14) of the block */
                    bm_block(wa, wb, bf, pk, j ? sc0 & 0xffff0000u : sc0 << 16, j ? sc1 & 0xffff0000u : sc1 << 16,
                             acc0, acc1);
                }
            }
        }
        /* rows g, g + 8 of the warp's group: columns hi + mid (t = 0) + lo (t = 1) */
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
        if (t == 0) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int r = 16 * rg + g + 8 * i, hh = r / FP, fl = pass * FP + r % FP;
                if (fl < nfeat) part[(fl * NH + hh) * NKP + kp] = (i ? acc1 : acc0) * 0.00390625f; /* 2^-8 */
            }
        }
    }
    __syncthreads();
    b1_write<UP>(part, NKP, nfeat, tid, f0, out, pre, limit, act_bf16);
    /* thread tid wrote feature tid (nfeat <= 256): warp w holds the block f0 / 32 + w of h */
    if (UP && hf && warp * 32 < nfeat)
        bm_record(out[f0 + tid], hf + (f0 / 32 + warp) * 13, (uint32_t(*)[32])stg, lane);
}

/* ----- one row on tensor cores, second form (moe.dot=mma: k_moe_b1r's MMA = 2 instances) -----
 * bm_run's arithmetic bit for bit (the same A and B fragments, the same two MMAs and fp32 steps
 * per 32-wide block, each row's blocks in the same order into the same two partial sums, the two
 * k halves bm_run's NKP = 2 split), with about half the instructions around the MMAs (bm_run issued
 * ~75 a 16 x 32 tile a lane, ~40 % of them the decode, the rest copies, waits, addresses and
 * predicated record loads, per slice of 2 blocks):
 * - a block is 128 weight rows of one group (M 32 at two blocks per SM: gate/up 64 features of w1
 *   then the same of w3, K 4096; down 128 rows of w2, K 2048; 256 / 128 KB), one row group of 16
 *   per warp over the whole K, in one pass; the host takes this form only for those shapes;
 * - the row's B records of the whole K (K / 32 x 208 bytes) are staged in shared memory once,
 *   after the PDL wait; lanes 12..31 read a zero vector instead of a predicated load;
 * - a warp's slice is 16 rows x 4 vectors (1 KB: two cp.async of 16 bytes a lane), BM2_NST stages
 *   at a stage index counted at run time; vector j of row i sits at slot j ^ ((i >> 1) & 3) of the
 *   row's 64 bytes, so one ldmatrix.x4 (rows g and g + 8 of vectors j and j + 1, the words bm_run
 *   read with four loads) touches 32 distinct banks;
 * - a slice's four scale entries of a row come in one 8-byte load (table rows padded by 4 entries).
 * The two k halves are two accumulator pairs, stored as bm_run's NKP = 2 parts, so b1_write adds
 * the same two numbers in the same order. */
enum { BM2_NST = 6, BM2_ROWS = 128, BM2_SLICE = 1024 };
/* shared memory of bm2_run at cv 16-byte vectors a row: stages, records, scale table, part, zero */
#define BM2_SMEM(cv) (8 * BM2_NST * BM2_SLICE + (cv) * 13 * 16 + BM2_ROWS * ((cv) + 4) * 2 + BM2_ROWS * 2 * 4 + 16)

/* four 32-bit words of an 8 x 8 b16 matrix each (ldmatrix.x4): lane 8 m + r gives row r of
 * matrix m; lane 4 g + t receives word t of row g of each */
__device__ __forceinline__ void bm2_ldm4(uint32_t addr, uint32_t &r0, uint32_t &r1, uint32_t &r2, uint32_t &r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(addr));
}

/* a warp's slice s (its 16 rows, 64 bytes of each from src + 64 s) into stage q at sbase: the lane's two
 * copies to cd0, cd1 (bm2_layout.h); nothing past nsl or for a row past the block's features (ok) */
__device__ __forceinline__ void bm2_copy(uint32_t sbase, uint32_t cd0, uint32_t cd1, const uint8_t *src, int s, int q,
                                         int nsl, bool ok) {
    if (s < nsl && ok) {
        uint32_t d = sbase + (uint32_t)q * BM2_SLICE;
        const uint8_t *p = src + 64 * s;
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + cd0), "l"(p) : "memory");
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(d + cd1), "l"(p + 16) : "memory");
    }
}

/* the 4 blocks of the slice in stage st: fragments by two ldmatrix.x4 (lane addresses la0, la1), the
 * rows' 4 scale entries sa (row g), sb (row g + 8), the blocks' B fragments bf and factors pk */
__device__ __forceinline__ void bm2_slice(uint32_t st, uint32_t la0, uint32_t la1, uint2 sa, uint2 sb,
                                          const uint4 (&bf)[4], const float (&pk)[4], float &acc0, float &acc1) {
    uint32_t w[8];
    bm2_ldm4(st + la0, w[0], w[1], w[2], w[3]);
    bm2_ldm4(st + la1, w[4], w[5], w[6], w[7]);
#pragma unroll
    for (int j = 0; j < 4; j++) {
        uint32_t ea = j < 2 ? sa.x : sa.y, eb = j < 2 ? sb.x : sb.y;
        uint32_t s0 = j & 1 ? ea & 0xffff0000u : ea << 16, s1 = j & 1 ? eb & 0xffff0000u : eb << 16;
        /* w[2 j], w[2 j + 1]: word t of vector j of rows g, g + 8 */
        bm_block(w[2 * j], w[2 * j + 1], bf[j], pk[j], s0, s1, acc0, acc1);
    }
}

/* rows g, g + 8's sums a0, a1 (columns hi + mid on lane t = 0, lo on t = 1) into part as bm_run's part kp
 * of their features, times 2^-8 (the codes' 2^-6 against the records' 2^-14) */
template <int NH>
__device__ __forceinline__ void bm2_part(float *part, float a0, float a1, int fl0, int hh, int nfeat, int kp) {
    const int lane = threadIdx.x & 31, g = lane >> 2;
    a0 += __shfl_xor_sync(0xffffffffu, a0, 1);
    a1 += __shfl_xor_sync(0xffffffffu, a1, 1);
    if ((lane & 3) == 0) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int fl = fl0 + g + 8 * i;
            if (fl < nfeat) part[(fl * NH + hh) * 2 + kp] = (i ? a1 : a0) * 0.00390625f;
        }
    }
}

template <int UP>
__device__ __forceinline__ void bm2_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const uint4 *xf, int64_t f0,
                                        float *out, float pre, float limit, int act_bf16, uint4 *hf) {
    constexpr int NH = UP ? 2 : 1, FP = BM2_ROWS / NH;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int cv = W[0].rowb / 16, NSL = cv / 4, HSL = NSL / 2, sst = cv + 4;
    const int nfeat = (int)(rows - f0 < (int64_t)FP ? rows - f0 : (int64_t)FP);
    uint8_t *stg = sm + warp * (BM2_NST * BM2_SLICE);
    uint4 *rec = (uint4 *)(sm + 8 * BM2_NST * BM2_SLICE);
    uint16_t *sct = (uint16_t *)((uint8_t *)rec + cv * 13 * 16);
    float *part = (float *)((uint8_t *)sct + BM2_ROWS * sst * 2);
    uint4 *zero = (uint4 *)(part + BM2_ROWS * 2);
    /* the warp's 16 rows: chunk rows 16 warp .. (a half each: FP is a multiple of 16) */
    const int hh = 16 * warp / FP, fl0 = 16 * warp % FP;
    /* this lane's copies: row crow, vectors 2 (lane & 1) and + 1, into their swizzled slots (bm2_layout.h) */
    const int crow = bm2_copy_row(lane);
    const uint32_t cd0 = (uint32_t)bm2_slot_off(crow, bm2_copy_vec(lane, 0)),
                   cd1 = (uint32_t)bm2_slot_off(crow, bm2_copy_vec(lane, 1));
    const bool cok = fl0 + crow < nfeat;
    const uint8_t *src = (hh ? W[1].data : W[0].data) + (f0 + fl0 + (cok ? crow : 0)) * W[0].rowb + 32 * (lane & 1);
    const uint32_t sbase = d_smem_addr(stg);
    /* the first BM2_NST - 1 slices (weights only: before the PDL wait), the scale table */
#pragma unroll
    for (int s = 0; s < BM2_NST - 1; s++) {
        bm2_copy(sbase, cd0, cd1, src, s, s, NSL, cok);
        d_cp_commit();
    }
    bm_scales(sct, sst, W, f0, 0, FP, nfeat, BM2_ROWS, cv);
    if (tid == 0) *zero = make_uint4(0, 0, 0, 0);
    pdl_wait(); /* the records are the previous kernel's */
    for (int i = tid; i < cv * 13; i += 256) d_cp_async16(rec + i, xf + i);
    d_cp_commit();
    d_cp_wait<0>();
    __syncthreads();
    /* ldmatrix rows: lane 8 m + r of matrix m (rows r + 8 (m & 1) of vector 2 p + (m >> 1)) */
    const uint32_t la0 = (uint32_t)bm2_slot_off(bm2_ldm_row(lane), bm2_ldm_vec(lane, 0)),
                   la1 = (uint32_t)bm2_slot_off(bm2_ldm_row(lane), bm2_ldm_vec(lane, 1));
    /* B fragments: lane < 12 entry lane of each record, the others the zero vector */
    const uint8_t *bp = lane < 12 ? (const uint8_t *)rec + lane * 16 : (const uint8_t *)zero;
    const int bst = lane < 12 ? 13 * 16 : 0;
    const float *pkp = (const float *)((const uint8_t *)rec + 12 * 16);
    const uint2 *sg = (const uint2 *)(sct + (16 * warp + g) * sst),
                *sg8 = (const uint2 *)(sct + (16 * warp + g + 8) * sst);
    float acc0 = 0.0f, acc1 = 0.0f, h0 = 0.0f, h1 = 0.0f;
    for (int s = 0, qc = 0, qn = BM2_NST - 1; s < NSL; s++) { /* qc: slice s's stage, qn: slice s + NST - 1's */
        __syncwarp(); /* the warp is done with the stage the next copies overwrite */
        bm2_copy(sbase, cd0, cd1, src, s + BM2_NST - 1, qn, NSL, cok);
        d_cp_commit();
        d_cp_wait<BM2_NST - 1>();
        __syncwarp();
        if (s == HSL) { /* the second k half (bm_run's kp 1) */
            h0 = acc0, h1 = acc1;
            acc0 = 0.0f, acc1 = 0.0f;
        }
        const uint32_t st = sbase + (uint32_t)qc * BM2_SLICE;
        qc = qc == BM2_NST - 1 ? 0 : qc + 1;
        qn = qn == BM2_NST - 1 ? 0 : qn + 1;
        const uint8_t *bs = bp + 4 * s * bst;
        const float *pkr = pkp + 4 * s * 52; /* 52 floats a record */
        uint4 bf[4];
        float pk[4];
#pragma unroll
        for (int j = 0; j < 4; j++) bf[j] = *(const uint4 *)(bs + j * bst), pk[j] = pkr[j * 52];
        bm2_slice(st, la0, la1, sg[s], sg8[s], bf, pk, acc0, acc1); /* scale entries 4 s .. of rows g, g + 8 */
    }
    bm2_part<NH>(part, h0, h1, fl0, hh, nfeat, 0); /* the k halves: bm_run's parts kp 0, 1 */
    bm2_part<NH>(part, acc0, acc1, fl0, hh, nfeat, 1);
    __syncthreads();
    b1_write<UP>(part, 2, nfeat, tid, f0, out, pre, limit, act_bf16);
    /* thread tid wrote feature tid (nfeat <= FP): warp w holds the block f0 / 32 + w of h */
    if (UP && hf && warp * 32 < nfeat)
        bm_record(out[f0 + tid], hf + (f0 / 32 + warp) * 13, (uint32_t(*)[32])stg, lane);
}

/* bm3_run (DSV4_CUDA_MOE_BM=3): bm2_run's slices and fragments at bm_run's geometry, four blocks an SM.
 * bm2_run's two blocks an SM (96 registers, 110.6 KB: its whole K's records and a 128-row scale table in
 * shared memory) left 4 warps a scheduler (H100, stop 40).  Here a block is bm_run's 64 rows (M 16: grid
 * and FP8 blocks of the default geometry), warp w takes row group w % 4 over k half w / 4 (bm_run's NKP
 * = 2 split, so the same two parts and the same bits), 4 stages of 1 KB slices, and the B records come
 * through L1 (__ldg: the row's records are read by every warp of the SM), a slice's loads issued before
 * its wait; 50 KB of shared memory, at most 64 registers (__launch_bounds__(256, 4)). */
enum { BM3_NST = 4, BM3_ROWS = 64 };
/* NST stages of 1 KB a warp, the scale table, the parts; REC (bm4: DSV4_CUDA_MOE_BM=4) the row's B records */
#define BM3_SMEM_F(cv, NST, REC) \
    (8 * (NST) * BM2_SLICE + BM3_ROWS * ((cv) + 4) * 2 + BM3_ROWS * 2 * 4 + (REC) * (cv) * 13 * 16)
#define BM3_SMEM(cv) BM3_SMEM_F(cv, BM3_NST, 0)

/* NST, REC: bm3_run's 4 stages with the B records through L1 (MMA = 3), or (MMA = 4, stop 53) 3 stages with the
 * row's whole records staged in shared memory once, after the PDL wait (cp.async), so that no slice waits on
 * an L1 load: stop 53's ncu put bm3_run's gate/up at 14.65 M instructions, 44 % issue and 8.2 cycles an issued
 * instruction of long_scoreboard (H100).  Three blocks an SM (67 KB each at K 4096); the same operations on
 * the same values, so bm_run's bits (test_one_row_mma_flash, H100, stop 53).  Measured there (ncu): down 18.2-18.9
 * us against 20.3-21.0 for the fp32 kernel, gate/up 39.7-40.8 against bm3_run's 39.5-41.0 (30.2-30.9 fp32). */
template <int UP, int NST = BM3_NST, int REC = 0>
__device__ __forceinline__ void bm3_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const uint4 *xf, int64_t f0,
                                        float *out, float pre, float limit, int act_bf16, uint4 *hf) {
    constexpr int NH = UP ? 2 : 1, FP = BM3_ROWS / NH;
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2;
    const int rg = warp & 3, kp = warp >> 2;
    const int cv = W[0].rowb / 16, NSL = cv / 8, sst = cv + 4, kb0 = kp * (cv / 2); /* slices of the warp's half */
    const int nfeat = (int)(rows - f0 < (int64_t)FP ? rows - f0 : (int64_t)FP);
    uint8_t *stg = sm + warp * (NST * BM2_SLICE);
    uint16_t *sct = (uint16_t *)(sm + 8 * NST * BM2_SLICE);
    float *part = (float *)((uint8_t *)sct + BM3_ROWS * sst * 2);
    uint4 *rec = (uint4 *)(part + BM3_ROWS * 2); /* REC: the row's cv records of 13 vectors */
    const int hh = 16 * rg / FP, fl0 = 16 * rg % FP;
    const int crow = bm2_copy_row(lane);
    const uint32_t cd0 = (uint32_t)bm2_slot_off(crow, bm2_copy_vec(lane, 0)),
                   cd1 = (uint32_t)bm2_slot_off(crow, bm2_copy_vec(lane, 1));
    const bool cok = fl0 + crow < nfeat;
    const uint8_t *src = (hh ? W[1].data : W[0].data) + (f0 + fl0 + (cok ? crow : 0)) * W[0].rowb + 16 * kb0 +
                         32 * (lane & 1);
    const uint32_t sbase = d_smem_addr(stg);
#pragma unroll
    for (int s = 0; s < NST - 1; s++) { /* slices of the warp's k half */
        bm2_copy(sbase, cd0, cd1, src, s, s, NSL, cok);
        d_cp_commit();
    }
    bm_scales(sct, sst, W, f0, 0, FP, nfeat, BM3_ROWS, cv);
    pdl_wait(); /* the records are the previous kernel's */
    if (REC) {
        for (int i = tid; i < cv * 13; i += 256) d_cp_async16(rec + i, xf + i);
        d_cp_commit();
        d_cp_wait<0>();
    }
    __syncthreads();
    const uint32_t la0 = (uint32_t)bm2_slot_off(bm2_ldm_row(lane), bm2_ldm_vec(lane, 0)),
                   la1 = (uint32_t)bm2_slot_off(bm2_ldm_row(lane), bm2_ldm_vec(lane, 1));
    const uint4 *rb = (REC ? rec : xf) + (int64_t)kb0 * 13; /* record kb0 + 4 s + j: rb + 13 (4 s + j) */
    const uint2 *sg = (const uint2 *)(sct + (16 * rg + g) * sst + kb0),
                *sg8 = (const uint2 *)(sct + (16 * rg + g + 8) * sst + kb0);
    float acc0 = 0.0f, acc1 = 0.0f;
    for (int s = 0, qc = 0, qn = NST - 1; s < NSL; s++) {
        uint4 bf[4];
        float pk[4];
#pragma unroll
        for (int j = 0; j < 4; j++) { /* through L1 (REC: shared memory), before the wait */
            bf[j] = lane < 12 ? (REC ? rb[13 * (4 * s + j) + lane] : __ldg(rb + 13 * (4 * s + j) + lane))
                              : make_uint4(0, 0, 0, 0);
            const float *pp = (const float *)(rb + 13 * (4 * s + j) + 12);
            pk[j] = REC ? *pp : __ldg(pp);
        }
        __syncwarp();
        bm2_copy(sbase, cd0, cd1, src, s + NST - 1, qn, NSL, cok);
        d_cp_commit();
        d_cp_wait<NST - 1>();
        __syncwarp();
        const uint32_t st = sbase + (uint32_t)qc * BM2_SLICE;
        qc = qc == NST - 1 ? 0 : qc + 1;
        qn = qn == NST - 1 ? 0 : qn + 1;
        bm2_slice(st, la0, la1, sg[s], sg8[s], bf, pk, acc0, acc1);
    }
    bm2_part<NH>(part, acc0, acc1, fl0, hh, nfeat, kp);
    __syncthreads();
    b1_write<UP>(part, 2, nfeat, tid, f0, out, pre, limit, act_bf16);
    if (UP && hf && warp * 32 < nfeat)
        bm_record(out[f0 + tid], hf + (f0 / 32 + warp) * 13, (uint32_t(*)[32])stg, lane);
}

/* k_moe_xsplit: bm_run's B records of rows of x (grid (ceil(K / 256), rows), a warp per 32-wide
 * block kb; rows < nr1 have K1 values, the others K2; K % 32 == 0).  E: the block's max |x| times
 * 2^-E lies in [2^14, 2^15) (E = 0 when the block is all zero or holds an infinity; NaN values
 * do not count).  Record kb of row r (13 uint4 at xf + r ldf + 13 kb): entry 4 g + t (g < 3) =
 * part g (hi, mid, lo) of the scaled values 8t + {0, 2}, {4, 6}, {1, 3}, {5, 7} (f16 pairs, the
 * first in the low half); entry 12 = {2^(E + 14), 0, 0, 0}.  A non-finite value goes in as hi
 * alone (f16 inf or NaN). */
__global__ void __launch_bounds__(256) k_moe_xsplit(uint4 *xf, int64_t ldf, const float *x, int64_t ldx, int nr1,
                                                    int K1, int K2) {
    pdl_enter();
    int r = blockIdx.y, K = r < nr1 ? K1 : K2, lane = threadIdx.x & 31;
    int kb = blockIdx.x * 8 + (threadIdx.x >> 5);
    __shared__ uint32_t parts[8][3][32];
    if (kb * 32 >= K) return; /* warp-uniform; no block barrier below */
    bm_record(x[(int64_t)r * ldx + kb * 32 + lane], xf + (int64_t)r * ldf + (int64_t)kb * 13, parts[threadIdx.x >> 5],
              lane);
}

/* k_moe_b1r: b1f_run on a grid of only the real blocks (dynamic shared memory B1F_SMEM(S, V, M,
 * 1 + UP), groups of one slot, M features per thread, MINB resident blocks per SM): grid.x = rs cr + cs blocks, one per
 * 128 KB (up) / 64 KB (down) of weights, where rs bounds the routed groups (the row's slots), cr
 * is a routed expert's chunk count and cs the shared expert's (0 without one; hs = 1 with one).
 * The plan puts the shared expert's group last, so block b < nr cr (nr = groups - hs) is chunk
 * b % cr of routed group b / cr and the next cs blocks are the shared group's chunks; blocks
 * past those (bad expert ids drop routed groups) exit.  Its predecessor k_moe_b1 (the same
 * per-block work on a grid of the larger expert's chunks x max_groups, removed once k_moe_b1r was
 * measured) launched twice the blocks for Flash, half of them exiting at once after reading the
 * group count, the group and the expert table (three dependent loads).
 * MMA = 1 (moe.dot=mma): the MXFP4 groups go to bm_run (the others keep b1f_format) with the B
 * records of the gate/up input rows (up: row G.row[0] of xf) or of h (down: row G.slot[0]), ldf
 * uint4 a row; gate/up with hf (not NULL) also writes h's records there (row G.slot[0], ldhf a
 * row).  MMA = 2: the same on bm2_run (M 32, two blocks per SM), MMA = 3 on bm3_run (M 16, four), 4 on bm3_run
 * with the records staged (three); the host checks their shapes.  MMA = 0 ignores the four. */
template <int UP, int DEC, int S, int V, int M, int MINB, int MMA = 0>
__global__ void __launch_bounds__(256, MINB) k_moe_b1r(const group *groups, const int *n_groups, const dexpert *tab,
                                                    const float *x, const float *xq, float *h, int64_t ldh, float *y,
                                                    int64_t dim, int act_fp8, float limit, int act_bf16, int cr,
                                                    int cs, int hs, const uint4 *xf, int64_t ldf, uint4 *hf,
                                                    int64_t ldhf) {
    /* gate/up reads the plan's groups, written by the kernel just before: wait at once; down
     * reads them too, but they were complete before gate/up started, so down issues its group
     * lookup, first weight copies and scales before waiting for gate/up's h (b1f_run) */
    if (UP) pdl_enter();
    else pdl_trigger();
    extern __shared__ __align__(128) uint8_t b1s[];
    /* a down block that leaves early still waits: the grid must not complete before gate/up
     * has (the ordering of the kernels after it is transitive only through each grid's wait) */
    int nr = *n_groups - hs, b = (int)blockIdx.x, gi = -1, chunk = 0;
    if (nr >= 0 && b < nr * cr) gi = b / cr, chunk = b - gi * cr;
    else if (nr >= 0 && b - nr * cr < cs) gi = nr, chunk = b - nr * cr;
    mb_half W[2];
    int64_t rows, f0;
    const float *xs;
    float *out;
    if (gi < 0 || !b1_group<UP, M>(groups[gi], tab[groups[gi].ex], x, xq, h, ldh, y, dim, act_fp8, W, rows, xs, out,
                                   f0, chunk)) {
        if (!UP) pdl_wait();
        return;
    }
    const group &G = groups[gi];
    if (MMA == 4 && W[0].fmt == DSV4_WF_MXFP4)
        bm3_run<UP, 3, 1>(b1s, W, rows, xf + (int64_t)(UP ? G.row[0] : G.slot[0]) * ldf, f0, out, G.pre[0], limit,
                          act_bf16, UP && hf ? hf + (int64_t)G.slot[0] * ldhf : NULL);
    else if (MMA == 3 && W[0].fmt == DSV4_WF_MXFP4)
        bm3_run<UP>(b1s, W, rows, xf + (int64_t)(UP ? G.row[0] : G.slot[0]) * ldf, f0, out, G.pre[0], limit, act_bf16,
                    UP && hf ? hf + (int64_t)G.slot[0] * ldhf : NULL);
    else if (MMA == 2 && W[0].fmt == DSV4_WF_MXFP4)
        bm2_run<UP>(b1s, W, rows, xf + (int64_t)(UP ? G.row[0] : G.slot[0]) * ldf, f0, out, G.pre[0], limit, act_bf16,
                    UP && hf ? hf + (int64_t)G.slot[0] * ldhf : NULL);
    else if (MMA && W[0].fmt == DSV4_WF_MXFP4)
        bm_run<UP, M>(b1s, W, rows, xf + (int64_t)(UP ? G.row[0] : G.slot[0]) * ldf, f0, out, G.pre[0], limit,
                      act_bf16, UP && hf ? hf + (int64_t)G.slot[0] * ldhf : NULL);
    else
        b1f_format<UP, DEC, S, V, M, B1_HINT>(b1s, W, rows, xs, f0, out, G.pre[0], limit, act_bf16);
}

/* ----- one row on e4m3 tensor cores (moe.dot=e4m3, under linear.act=fp8: k_moe_q8x, k_moe_q8) -----
 * DeepSeek's own expert arithmetic: the act-quantized input (e4m3 codes, one power-of-two scale
 * per 128 values, k_act_quant's rounding) times the stored weight codes on the tensor cores
 * (mma.sync.m16n8k32 e4m3 x e4m3 -> f32), block scales applied in fp32 after.  Every product is
 * exact; what differs from the CPU's fp32 sum of dequantized products is the tensor core's own
 * summation inside each 128-wide segment (not IEEE step by step), hence a named switch, off in
 * both profiles, its error measured by test_cuda_moe against the CPU op.
 * A warp takes a tile of 16 weight rows (gate/up: 8 features of w1 in rows 0..7, the same of
 * w3 in rows 8..15; down: 16 rows of w2) over the whole K, segment by segment (128 values), no
 * block barrier inside; lane = 4 g + t holds rows g and g + 8 and loads 16 bytes of each per
 * 64-byte unit (unit u of a row: bytes 64 u + 16 t .. + 15, so a row's 64 bytes come in one
 * instruction of the 4 lanes).  The dot does not depend on where each k goes, so A and B share
 * a permutation:
 * - MXFP4 (a unit = one segment of 128 codes; lane t's 16 bytes = scale block t of 4): word j of
 *   the lane's vector (codes 8 j .. 8 j + 7 of the block) becomes two words of e4m3 bytes
 *   (bm_e4m3: the low nibbles, then the high; each the code's value times 2^-6, exact), A of
 *   MMA j.  B's column n holds x only at the k positions of lane t = n (block n of the
 *   segment), zero elsewhere, so D's columns 0..3 are the four blocks' sums for each row, and
 *   lanes t = 0 / 1 (columns 2t, 2t + 1) apply those blocks' e8m0 scales.
 * - FP8 (128 x 128 blocks, a unit = 64 values, two units a segment): the bytes are A as stored
 *   (MMA 2 u + j takes bytes 8 j .. 8 j + 7 of the lane's vector); B's column 0 is x, and one
 *   scale per segment and row block multiplies D's column 0 (lanes t = 0).
 * k_moe_q8x writes x in both orders, per row: the plain codes (FP8's B), then the codes with
 * each 8 in the order 0, 2, 4, 6, 1, 3, 5, 7 (MXFP4's B: low nibbles, then high), then the
 * K / 128 scales (a float each: 2^e, or NaN for a block holding inf or NaN, as k_act_quant). */
enum { Q8_FEAT_UP = 64, Q8_ROWS_DN = 128 }; /* features (gate/up) / rows (down) of a block */

/* d = A B + c (16 x 8 f32) of one m16n8k32 e4m3 MMA */
__device__ __forceinline__ void q8_mma(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0,
                                       uint32_t b1) {
    asm("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint4 q8_ld(const uint8_t *p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

/* grid (ceil(max K / 1024), rows): warp w of block x takes 128-wide block 8 x + w of row r (rows
 * < nr1 have K1 values, the others K2; K % 128 == 0).  Row r's record at q + r ldq: 2 K code
 * bytes, then K / 128 floats. */
__global__ void __launch_bounds__(256) k_moe_q8x(uint8_t *q, int64_t ldq, const float *x, int64_t ldx, int nr1,
                                                 int K1, int K2) {
    pdl_enter();
    int r = blockIdx.y, K = r < nr1 ? K1 : K2, lane = threadIdx.x & 31;
    int kb = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (kb * 128 >= K) return;
    float4 v = *(const float4 *)(x + (int64_t)r * ldx + kb * 128 + 4 * lane);
    float m = fmaxf(fmaxf(fabsf(v.x), fabsf(v.y)), fmaxf(fabsf(v.z), fabsf(v.w)));
    int bad = !(fabsf(v.x) <= 3.40282347e38f && fabsf(v.y) <= 3.40282347e38f && fabsf(v.z) <= 3.40282347e38f &&
                fabsf(v.w) <= 3.40282347e38f);
    m = warp_max(m);
    bad = __any_sync(0xffffffffu, bad);
    if (m < 1e-4f) m = 1e-4f;
    float s = d_pow2_ceil(m * (1.0f / 448.0f)), inv = 1.0f / s;
    uint32_t w = (uint32_t)d_f32_to_e4m3(v.x * inv) | (uint32_t)d_f32_to_e4m3(v.y * inv) << 8 |
                 (uint32_t)d_f32_to_e4m3(v.z * inv) << 16 | (uint32_t)d_f32_to_e4m3(v.w * inv) << 24;
    uint32_t o = __shfl_xor_sync(0xffffffffu, w, 1);
    uint8_t *row = q + (int64_t)r * ldq;
    ((uint32_t *)(row + kb * 128))[lane] = w;
    /* the 8 codes of lanes 2 i, 2 i + 1: the even lane writes codes 0, 2, 4, 6, the odd 1, 3, 5, 7 */
    ((uint32_t *)(row + K + kb * 128))[lane] = lane & 1 ? __byte_perm(o, w, 0x7531) : __byte_perm(w, o, 0x6420);
    if (lane == 0) ((float *)(row + 2 * (int64_t)K))[kb] = bad ? __uint_as_float(0x7fc00000u) : s;
}

/* f32 of an e8m0 scale byte (d_e8m0_to_f32) */
__device__ __forceinline__ float q8_e8m0(uint32_t c) { return __uint_as_float(b1_e8m0_bf16(c & 255u) << 16); }

/* The warp's dots of weight rows ra (lane rows g) and rb (g + 8) with the record of an input
 * row of K values (K % 128 == 0): s0 / s1 on lanes t = 0 (MXFP4: after the pair sum).  The
 * block's threads all enter: each warp issues its first weight loads (and their scales), WAIT
 * then waits (PDL), and the block copies the record xg (ldq bytes) into shared memory xr; warps
 * that are not live (rows past the weight's end) leave after that barrier.  The weights and
 * their scales of the next PF units are in flight while a batch's MMAs run; x comes from shared
 * memory (the first version read it through L1 inside the loop: 0.47 ms a 20-layer step
 * slower than k_moe_b1r). */
template <int FP4, int WAIT>
__device__ __forceinline__ void q8_rows(const dweight &Wa, int64_t ra, const dweight &Wb, int64_t rb, bool live,
                                        const uint8_t *xg, int64_t ldq, uint8_t *xr, int64_t K, float &s0,
                                        float &s1) {
    const int lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const int64_t rowb = FP4 ? K / 2 : K, nu = live ? rowb / 64 : 0; /* 64-byte units a row (FP8: even) */
    const uint8_t *pa = Wa.data + ra * rowb + 16 * t, *pb = Wb.data + rb * rowb + 16 * t;
    const float *xs = (const float *)(xr + 2 * K);
    /* MXFP4: the rows' e8m0 bytes; FP8: the scale rows of the two weights' row blocks (128 x 128) */
    const int64_t scols = K / 128;
    const uint8_t *sa = FP4 ? Wa.scale + ra * (K / 32) : Wa.scale + (ra / 128) * scols * (Wa.scale_f32 ? 4 : 1);
    const uint8_t *sb = FP4 ? Wb.scale + rb * (K / 32) : Wb.scale + (rb / 128) * scols * (Wb.scale_f32 ? 4 : 1);
    float acc0 = 0.0f, acc1 = 0.0f;
    constexpr int PF = 4; /* units of a batch */
    uint4 qa[PF], qb[PF];
    uint32_t ka[PF], kb[PF]; /* MXFP4: the two e8m0 bytes of lanes t < 2; FP8: the segment's scale bits */
    auto load = [&](int64_t u, uint4 &wa, uint4 &wb, uint32_t &ca, uint32_t &cb) {
        wa = q8_ld(pa + 64 * u), wb = q8_ld(pb + 64 * u);
        ca = cb = 0;
        if (FP4) {
            if (t < 2) {
                ca = __ldg((const unsigned short *)(sa + u * 4 + 2 * t));
                cb = __ldg((const unsigned short *)(sb + u * 4 + 2 * t));
            }
        } else {
            int64_t sg = u >> 1;
            ca = Wa.scale_f32 ? __float_as_uint(__ldg((const float *)sa + sg))
                              : __float_as_uint(d_e8m0_to_f32(__ldg(sa + sg)));
            cb = Wb.scale_f32 ? __float_as_uint(__ldg((const float *)sb + sg))
                              : __float_as_uint(d_e8m0_to_f32(__ldg(sb + sg)));
        }
    };
#pragma unroll
    for (int i = 0; i < PF; i++) {
        qa[i] = qb[i] = make_uint4(0, 0, 0, 0);
        ka[i] = kb[i] = 0;
        if (i < nu) load(i, qa[i], qb[i], ka[i], kb[i]);
    }
    if (WAIT) pdl_enter(); /* the first weights are in flight before the wait for the record */
    for (int64_t i = threadIdx.x; i < ldq / 16; i += blockDim.x) ((uint4 *)xr)[i] = __ldg((const uint4 *)xg + i);
    __syncthreads();
    if (!live) return;
    float d[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int64_t u0 = 0; u0 < nu; u0 += PF) {
        uint4 na[PF], nb[PF];
        uint32_t la_[PF], lb_[PF];
#pragma unroll
        for (int i = 0; i < PF; i++) {
            na[i] = nb[i] = make_uint4(0, 0, 0, 0);
            la_[i] = lb_[i] = 0;
            if (u0 + PF + i < nu) load(u0 + PF + i, na[i], nb[i], la_[i], lb_[i]);
        }
#pragma unroll
        for (int i = 0; i < PF; i++) {
            int64_t u = u0 + i;
            if (u >= nu) break;
            const uint32_t *wa = (const uint32_t *)&qa[i], *wb = (const uint32_t *)&qb[i];
            if (FP4) {
                /* segment u: B on lanes g == t (block t of the segment, the permuted codes) */
                uint4 x0 = make_uint4(0, 0, 0, 0), x1 = x0;
                if (g == t) {
                    const uint4 *xp = (const uint4 *)(xr + K + u * 128 + 32 * t);
                    x0 = xp[0], x1 = xp[1];
                }
                const uint32_t xb[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
                d[0] = d[1] = d[2] = d[3] = 0.0f;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    uint32_t la, ha, lb, hb;
                    bm_e4m3(wa[j], la, ha);
                    bm_e4m3(wb[j], lb, hb);
                    q8_mma(d, la, lb, ha, hb, xb[2 * j], xb[2 * j + 1]);
                }
                if (t < 2) { /* columns 2t, 2t + 1 = blocks 4u + 2t, + 1 of rows g, g + 8 */
                    uint32_t ca = ka[i], cb = kb[i];
                    float sx = xs[u] * 64.0f; /* the codes' 2^-6 (bm_e4m3), exact */
                    acc0 = fmaf(fmaf(d[1], q8_e8m0(ca >> 8), d[0] * q8_e8m0(ca)), sx, acc0);
                    acc1 = fmaf(fmaf(d[3], q8_e8m0(cb >> 8), d[2] * q8_e8m0(cb)), sx, acc1);
                }
            } else {
                /* unit u = half u % 2 of segment u / 2: B on lanes g == 0 (the plain codes) */
                uint4 xv = make_uint4(0, 0, 0, 0);
                if (g == 0) xv = *(const uint4 *)(xr + u * 64 + 16 * t);
                if ((i & 1) == 0) d[0] = d[1] = d[2] = d[3] = 0.0f;
                q8_mma(d, wa[0], wb[0], wa[1], wb[1], xv.x, xv.y);
                q8_mma(d, wa[2], wb[2], wa[3], wb[3], xv.z, xv.w);
                if ((i & 1) && t == 0) {
                    float sx = xs[u >> 1];
                    acc0 = fmaf(d[0] * __uint_as_float(ka[i]), sx, acc0);
                    acc1 = fmaf(d[2] * __uint_as_float(kb[i]), sx, acc1);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < PF; i++) qa[i] = na[i], qb[i] = nb[i], ka[i] = la_[i], kb[i] = lb_[i];
    }
    if (FP4) { /* lanes t = 0 and 1 hold the blocks 0, 1 and 2, 3 of each segment */
        acc0 += __shfl_xor_sync(0xffffffffu, acc0, 1);
        acc1 += __shfl_xor_sync(0xffffffffu, acc1, 1);
    }
    s0 = acc0, s1 = acc1;
}

/* k_moe_q8: k_moe_b1r's grid of the real blocks (blocks b < nr cr: chunk b % cr of routed group
 * b / cr; the next cs: the shared group's chunks), 8 warps a block, a warp a tile of 16 rows
 * (gate/up: features f, f + 8 of w1 / w3 for the 8 features from f = Q8_FEAT_UP chunk + 8 warp;
 * down: rows Q8_ROWS_DN chunk + 16 warp ..).  gate/up waits (PDL) before reading the plan's groups;
 * down reads them before (complete before gate/up started) and issues its first weight loads
 * before waiting for h's records.  xq: the input rows' records (k_moe_q8x, ldq
 * bytes a row: gate/up row G.row[0] of x, down row G.slot[0] of h).  gate/up writes h (SwiGLU,
 * the weight before w2 when the plan set it, as b1_write), down y.  A group whose weights are
 * not MXFP4 or FP8 is a broken invariant (the host checks the table): its block exits.
 * Gate/up is held to two blocks an SM (126 registers, no spills): left free, ptxas gave it 159 registers, so one
 * block an SM and its 224 blocks on Flash in 1.7 waves (ncu on an H100, stop 65: 46.3-47.4 us a call, 12 % of the
 * warps resident, against k_moe_b1r's 30.1-31.7).  Down keeps the compiler's choice (0: no minimum; 128 registers,
 * two blocks, 0.85 waves; its PTX unchanged). */
template <int UP>
__global__ void __launch_bounds__(256, UP ? 2 : 0)
    k_moe_q8(const group *groups, const int *n_groups, const dexpert *tab, const uint8_t *xq, int64_t ldq, float *h,
             int64_t ldh, float *y, int64_t dim, float limit, int act_bf16, int cr, int cs, int hs) {
    if (UP) pdl_enter(); /* the plan's groups are the previous kernel's */
    int nr = *n_groups - hs, b = (int)blockIdx.x, gi = -1, chunk = 0;
    if (nr >= 0 && b < nr * cr) gi = b / cr, chunk = b - gi * cr;
    else if (nr >= 0 && b - nr * cr < cs) gi = nr, chunk = b - nr * cr;
    if (gi < 0) {
        if (!UP) pdl_enter();
        return;
    }
    const group &G = groups[gi];
    const dexpert &E = tab[G.ex];
    const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31, g = lane >> 2, t = lane & 3;
    const dweight &Wa = UP ? E.w1 : E.w2, &Wb = UP ? E.w3 : E.w2;
    int64_t K = Wa.cols, nrow = UP ? E.w1.rows : (E.w2.rows < dim ? E.w2.rows : dim);
    int64_t r0 = UP ? (int64_t)chunk * Q8_FEAT_UP + 8 * warp : (int64_t)chunk * Q8_ROWS_DN + 16 * warp;
    int64_t ra = UP ? r0 + g : r0 + g, rb = UP ? r0 + g : r0 + g + 8;
    /* rows past the weight's end read its last row; their sums are not written */
    int64_t ca = ra < nrow ? ra : nrow - 1, cb = rb < nrow ? rb : nrow - 1;
    const uint8_t *xg = xq + (int64_t)(UP ? G.row[0] : G.slot[0]) * ldq;
    extern __shared__ __align__(16) uint8_t q8s[];
    float s0 = 0.0f, s1 = 0.0f;
    if (Wa.fmt != DSV4_WF_MXFP4 && Wa.fmt != DSV4_WF_FP8) { /* block-uniform */
        if (!UP) pdl_enter(); /* every block waits: the grid must not complete before gate/up's */
        return;
    }
    bool live = r0 < nrow;
    if (Wa.fmt == DSV4_WF_MXFP4) q8_rows<1, !UP>(Wa, ca, Wb, cb, live, xg, ldq, q8s, K, s0, s1);
    else q8_rows<0, !UP>(Wa, ca, Wb, cb, live, xg, ldq, q8s, K, s0, s1);
    if (!live) return;
    if (t != 0) return;
    if (UP) {
        if (ra < nrow) h[(int64_t)G.slot[0] * ldh + ra] = moe_swiglu(s0, s1, limit, act_bf16, G.pre[0]);
    } else {
        float *o = y + (int64_t)G.slot[0] * dim;
        if (ra < nrow) o[ra] = act_bf16 ? d_round_bf16(s0) : s0;
        if (rb < nrow) o[rb] = act_bf16 ? d_round_bf16(s1) : s1;
    }
}

/* 1 if weight w takes k_moe_q8 (rows: a multiple of mult): MXFP4, or FP8 in 128 x 128 blocks;
 * K a multiple of 128, 16-byte aligned data */
static int q8_takes(const dsv4_weight *w, const dweight &d, int64_t mult) {
    if (w->cols % 128 || w->rows % mult || ((uintptr_t)d.data & 15)) return 0;
    if (w->fmt == DSV4_WF_MXFP4) return ((uintptr_t)d.scale & 1) == 0;
    return w->fmt == DSV4_WF_FP8 && w->block == 128;
}

/* The one-row geometries, per kernel: stages S of V vectors per thread, features per thread M,
 * resident blocks per SM MINB (the register budget).  Geometry 0 is the default: k_moe_b1r (the
 * grid of the real blocks) for both, e2m1 through e4m3 bytes (DEC 2), each S 4 V 2 M 16 at 4
 * blocks per SM.  DSV4_CUDA_MOE_B1G=N picks another (A/B runs): 1 k_moe_b1_prev with gate/up as
 * before 2026-12-01 16:40Z (S 4, V 4, 2 blocks), 3 k_moe_b1_prev for both as it was the default
 * until k_moe_b1; DSV4_CUDA_MOE_LUT=1 takes k_moe_b1_prev's table decode (2).  k_moe_b1 (the
 * default before k_moe_b1r: its per-block work on a grid of the larger chunk count x max_groups)
 * is gone, its figures below.
 * Earlier geometries (f16 decode, 3 blocks per SM, down at M 32, down at S 8 V 1 / S 2 V 4 /
 * S 4 V 1, down on k_moe_b1_prev) measured no better (below) and are gone, and so are two
 * tried with k_moe_b1r: an e2m1 decode by bit placement into f32 (slower) and a diagnostic with
 * trivial math (wrong outputs), whose figures follow.  k_moe_b1 and k_moe_b1r take FP8 weights
 * only when the features of a block lie in one row of scale blocks
 * (moe_table.b1_fit); otherwise the call runs geometry 3.
 * Measured for k_moe_b1r (H200, ncu --clock-control none --graph-profiling node, 2 synth Flash
 * layers, bench --prompt 256 --gen 4, 4 calls of each kernel per variant, one device run,
 * 2026-12-01 ~20:05Z): gate/up / down in us, warp instructions
 *   k_moe_b1, grid 128 x 8 (4)             33.5-35.3 / 19.2-19.7   17.13 M / 9.39 M
 *   k_moe_b1r, DEC 2 (0)                   31.5-32.3 / 17.3-17.6   16.89 M / 9.21 M   issue 51-52 %, DRAM 48 / 43 %
 *   k_moe_b1r, bit-placement decode        35.0-36.3 / 19.0-19.7   18.55 M / 10.10 M
 *   diagnostic (same copies, trivial math) 21.8-22.9 / 12.6-13.0    4.08 M / 2.92 M   issue 18 / 22 %, DRAM 66-69 / 59 %
 * The diagnostic is the ceiling of this access pattern (one wave of 512 blocks, per-thread
 * cp.async pipelines of 3 x 2 x 16 bytes in flight): even without math gate/up stays at ~22 us
 * and down at ~12.6 us, against 16.4 / 8.2 us at the copy rate, so the goal (22 / 12 us) needs
 * a different way of streaming (more bytes in flight per SM, e.g. bulk copies) as well as fewer
 * instructions.  More bytes in flight alone did not help: with each block asking its lines into
 * L2 4 or 8 iterations ahead of its cp.async stages (branch moe-l2pf, ncu as above, 2026-12-02
 * 07:34Z) gate/up took 34.4-36.1 us against 31.1-31.4 (17.30 M instructions against 16.92 M) and
 * down 19.8-21.3 against 19.1-19.2, and the 20-layer step was slower too.  The bit-placement
 * decode (magnitude bits at f32 bits 22..24, sign at 31: the value times 2^-126, x taken times
 * 2^64) builds each f32 by one shift or mask, but its words
 * cost ~16 shifts and masks per 8 codes (SASS of gate/up: 926 LOP3, 580 SHF against 1102
 * FFMA), more than DEC 2's 7 integer operations + 4 cvt e4m3x2 + 8 cvt f16 -> f32.
 * Measured before (H200, ncu --clock-control none, 2 Flash layers of synth, decode batch 1, 4 calls
 * each, 2026-12-01, two device sessions): gate/up k_moe_b1 34.3 us, 17.13 M warp instructions
 * (4.67 per weight, 64 registers), against k_moe_b1_prev 46.2 us, 27.59 M (7.52 per weight);
 * k_moe_b1's f16 decode (4) 37.6 us, 18.96 M; 3 blocks per SM (5) 34.1 us.  Down k_moe_b1
 * 29.6 us, 8.40 M (107 registers), against k_moe_b1_prev 24.9 us, 12.65 M: fewer instructions
 * but issue slots busy 27 % against 49 % (16 warps per SM).  Down at 4 blocks per SM (M 16,
 * 64 registers, 32 warps per SM; same run, 2026-12-01 18:40Z, 4 calls each): S 4 V 2 (0)
 * 19.1-21.0 us, mean 19.8, 9.39 M instructions, issue slots 43-48 % busy, DRAM 39 %, against
 * k_moe_b1_prev (7) 24.5-25.4, mean 24.9, 12.65 M; S 2 V 4 (9) mean 19.3 (9.08 M), S 4 V 1
 * (10) 20.1 (9.33 M), S 8 V 1 (8) 20.4 (9.52 M): within the run-to-run spread of ~2 us, so
 * the default keeps gate/up's shape.  SASS (cuobjdump, all three formats): 4584 instructions
 * for down in 0 against 7704 at S 4 V 4 M 32 (gate/up 6696).  Still short of the bytes: SMs
 * are active only 78 % of the elapsed cycles (29.9 K of 38.1 K).  A suspect, not measured:
 * grid.x is the larger group's chunk count (the FP8 shared expert's 128, the MXFP4 experts'
 * 64) over max_groups 8, so 512 of the 1024 blocks exit after reading their group and the
 * table, holding block slots while the later groups' real blocks wait.  k_moe_b1r is the grid
 * of only the real blocks (7 % faster, above); not tried: FP8 blocks of 2 M features (the
 * weights of an FP4 block, so equal chunk counts; gate/up has the same 128 against 64).
 * Earlier, for k_moe_b1_prev (ktrace, opbench --flush-mb 512 on flash layer 0, 46 calls each):
 * gate/up median 44.0 us with S 4, V 2, 4 blocks (32 warps, 64 registers, no spills) against
 * 45.3 (2 blocks, 96 registers) and 44.1 / 46.3 / 47.2 with 3 blocks (S 3 V 4 / S 4 V 2 / S 5 V
 * 2); down 23.5 us (S 4, V 4, M 32, 2 blocks) against 24.4 at 4 blocks and 25.6-29.2 with M 16
 * (twice the blocks). */
struct b1_geom {
    const void *up, *dn; /* the kernels' <1, ..> and <0, ..> instances */
    int smem_up, smem_dn, mup, mdn;
    int fmt_up, fmt_dn;  /* 1: k_moe_b1r, 0: k_moe_b1_prev */
    int real;            /* 1: k_moe_b1r (grid of the real blocks, three more arguments) */
};
#define B1_GEOM_PREV(DEC, SU, VU, BU, SD, VD, MDN, BD)                                                                 \
    {(const void *)k_moe_b1_prev<1, DEC, SU, VU, B1_MUP, BU>, (const void *)k_moe_b1_prev<0, DEC, SD, VD, MDN, BD>,    \
     B1_SMEM(SU, VU), B1_SMEM(SD, VD), B1_MUP, MDN, 0, 0, 0}
#define B1_GEOM_R(DECU, DECD, SU, VU, MU, BU, SD, VD, MDN, BD)                                                        \
    {(const void *)k_moe_b1r<1, DECU, SU, VU, MU, BU>, (const void *)k_moe_b1r<0, DECD, SD, VD, MDN, BD>,              \
     B1F_SMEM(SU, VU, MU, 2), B1F_SMEM(SD, VD, MDN, 1), MU, MDN, 1, 1, 1}
/* DEC 3: b1f_run's stage loop rolled (gate/up's default since stop 41: H100, ncu, 2 synth Flash layers,
 * 4 calls: gate/up 30.3-31.0 us against 35.7-35.8 with it unrolled, 19.05 M against 16.92 M warp
 * instructions, issue slots 60 % against 46 % busy, DRAM 70 % against 61 %, no_instruction stalls 0.12
 * against 3.1-3.5 cycles an issued instruction: the unrolled rounds of the formats' instances did not
 * stay in the instruction cache; down rolled 21.9-22.4 against 20.4-20.5, so down keeps DEC 2) */
static const b1_geom b1_geoms[] = {
    B1_GEOM_R(3, 2, 4, 2, 16, 4, 4, 2, 16, 4),   /* 0: default */
    B1_GEOM_PREV(1, 4, 4, 2, 4, 4, 32, 2),       /* 1 */
    B1_GEOM_PREV(0, 4, 4, 2, 4, 4, 32, 2),       /* 2: DSV4_CUDA_MOE_LUT=1 */
    B1_GEOM_PREV(1, 4, 2, 4, 4, 4, 32, 2),       /* 3: k_moe_b1_prev */
    B1_GEOM_R(3, 3, 4, 2, 16, 4, 4, 2, 16, 4),   /* 4: both halves rolled */
    B1_GEOM_R(2, 2, 4, 2, 16, 4, 4, 2, 16, 4),   /* 5: both unrolled (the default until stop 41) */
};
enum { B1_NGEOM = (int)(sizeof(b1_geoms) / sizeof(b1_geoms[0])), B1_LUT = 2, B1_PREV = 3 };

/* 1 if k_moe_b1r takes weight w at m features per thread: FP8 needs the block's (256 / cv) m
 * features inside one row of scale blocks (its per-thread scale); FP4 always */
static int b1_fits(const dsv4_weight *w, int m) {
    if (w->fmt != DSV4_WF_FP8) return 1;
    int64_t cv = w->cols / 16, fb = cv > 0 && cv <= 256 ? (256 / cv) * m : 0;
    return fb > 0 && w->block > 0 && w->block % fb == 0;
}

/* 1 if weight w can take k_moe_bulk (up: a w1/w3 half, down: w2): FP4 or FP8, 32..256
 * 16-byte vectors per row (a power of two), 16-byte aligned data and scale rows, and the
 * scales of a tile within its area of the stage */
static int mb_ok(const dweight *w, int up) {
    int fp4 = w->fmt == DSV4_WF_MXFP4 || w->fmt == DSV4_WF_NVFP4;
    if (!fp4 && w->fmt != DSV4_WF_FP8) return 0;
    int64_t K = w->cols, vn = fp4 ? 32 : 16;
    if (K <= 0 || K % vn) return 0;
    int64_t cv = K / vn;
    if (cv < 32 || cv > 256 || (cv & (cv - 1))) return 0;
    int64_t rowb = fp4 ? K / 2 : K, nrh = (up ? MB_TILE / 2 : MB_TILE) / rowb, area = up ? MB_SCALE / 2 : MB_SCALE;
    if (((uintptr_t)w->data | (uintptr_t)w->scale) & 15) return 0;
    if (fp4) {
        int64_t srow = w->fmt == DSV4_WF_MXFP4 ? K / 32 : K / 16;
        return srow % 16 == 0 && nrh * srow <= area;
    }
    if (w->block <= 0 || w->block % 16 || K % w->block || w->block % nrh) return 0;
    int64_t sb = K / w->block * (w->scale_f32 ? 4 : 1);
    return sb % 16 == 0 && sb <= area;
}

/* ----- 2..32 rows: groups of up to BN_G slots of one expert (k_moe_bnr) -----
 * The batched decode.  The plan cuts groups of <= BN_G slots of one expert (the shared
 * expert: BN_G rows per group, its groups last), and the expert GEMVs run as two launches per
 * half over the same grid of k_moe_b1r's blocks (one per 128 KB of gate/up, 64 KB of down
 * weights of a group: grid.x = a bound of the routed groups x a routed expert's chunks + the
 * shared groups x the shared expert's chunks; blocks past the device's groups exit):
 * - k_moe_bnr<.., 1, ..> takes the groups of one slot (at 2..8 rows most routed experts get one
 *   row) with k_moe_b1r's per-block work unchanged (b1f_format: 4 blocks per SM, x in registers);
 * - k_moe_bnr<.., BN_G, ..> takes the groups of 2..BN_G slots: the block streams its chunk ONCE
 *   with b1f_run's pipeline and scale table, decodes each 16-byte vector once and forms the
 *   products with the x of every slot of the group (bn_run).  The slots' x values (NS x K
 *   floats) cannot stay in registers (32 per slot and FP4 vector): they are staged in shared
 *   memory, transposed so that the 32 lanes of a warp (consecutive column vectors c) read 32
 *   consecutive float4 (no bank conflict): float4 j of slot s's vector c at (s VN/4 + j) cv + c.
 *   A group of 2 slots runs an NS = 2 body, 3..4 the NS = 4 body (a third slot's padding
 *   repeats slot 0's x; its sums are never written).
 * Each slot's sums are those of b1f_run: the same decode (e2m1 through e4m3 bytes, DEC 2: the
 * values times 2^-6, undone by an exact multiply before the block scale), the same products in
 * the same order per vector, warp sums by the halving tree, a feature's kw warp sums added in
 * warp order.  A group of n slots costs the weight bytes once, so the MoE streams ~ (distinct
 * experts + shared groups) x an expert's bytes instead of k_moe_bulk's re-decode per slot.
 * Shared memory of the NS kernel: b1f_run's (stages, scale table) + NS warp-sum areas + the x
 * area (BN_G x K x 4 bytes: 64 KB for Flash gate/up, 32 KB down). */
enum { BN_G = 4, BN_ROWS = 32, BN_S = 4, BN_V = 2, BN_M = 16 };
/* Which k_moe_bnr instances roll their stage loop (cuda_devside.bnr's bits): only the multi-slot down (8).
 * Rolled, that instance's SASS is 91.5 KB against 202.6 (78 registers and no spills against 128 and 132
 * bytes of spill stores), and it took 31.1-36.7 us against 36.8-48.6 (ncu, H200, batch 8); 20 Flash layers
 * at 2K decode at 45.63 ms a step against 46.16 at batch 32, 13.09 against 13.21 at batch 8 (H100, 2
 * rounds each, 2026-12-05).  The one-slot instances are issue-bound at batch 8 (73-80 % of the issue
 * slots): rolled they issue ~10 % more instructions and were slower (ncu), and rolling every instance
 * cost 0.6 ms a step at batch 32 (H200).  docs/PERFORMANCE.md, stop 42. */
enum { BN_ROLL_DEFAULT = 8 };
#define BN_SMEM(NH, NS) (B1F_SMEM(BN_S, BN_V, BN_M, NH) + 8 * BN_M * (NH) * 4 * ((NS) - 1))

/* the NS slot sums of FP4 vector q (a: values 0..15, b: 16..31, times 2^-6 as b1f_fp4 with DEC 2);
 * x values of slot s: xc[(s 8 + j) cv], j < 8 */
template <int NS>
__device__ __forceinline__ void bn_fp4(const uint4 &q, const float4 *xc, int cv, float (&a)[NS], float (&b)[NS]) {
    const uint32_t *qw = (const uint32_t *)&q;
    float a0[NS], a1[NS], b0[NS], b1[NS];
#pragma unroll
    for (int s = 0; s < NS; s++) a0[s] = a1[s] = b0[s] = b1[s] = 0.0f;
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float f[8]; /* values 8 w4 + k, decoded once for every slot */
        uint32_t lo = ((qw[w4] & 0x07070707u) << 2) | ((qw[w4] & 0x08080808u) << 4);
        uint32_t hi = ((qw[w4] >> 2) & 0x1C1C1C1Cu) | (qw[w4] & 0x80808080u);
        float l[4], u[4];
        b1_e4m3x4(lo, l);
        b1_e4m3x4(hi, u);
#pragma unroll
        for (int k = 0; k < 4; k++) f[2 * k] = l[k], f[2 * k + 1] = u[k];
#pragma unroll
        for (int s = 0; s < NS; s++) {
            float4 x0 = xc[(s * 8 + 2 * w4) * cv], x1 = xc[(s * 8 + 2 * w4 + 1) * cv];
            const float xv[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
            for (int k = 0; k < 8; k++) {
                float pr = f[k] * xv[k];
                if (w4 < 2) (k & 1 ? a1[s] : a0[s]) += pr;
                else (k & 1 ? b1[s] : b0[s]) += pr;
            }
        }
    }
#pragma unroll
    for (int s = 0; s < NS; s++) a[s] = a0[s] + a1[s], b[s] = b0[s] + b1[s];
}

/* the NS slot sums of FP8 vector q (b1f_fp8's chains); x of slot s: xc[(s 4 + j) cv], j < 4 */
template <int NS>
__device__ __forceinline__ void bn_fp8(const uint4 &q, const float4 *xc, int cv, float (&r)[NS]) {
    const uint32_t *qw = (const uint32_t *)&q;
    float a0[NS], a1[NS];
#pragma unroll
    for (int s = 0; s < NS; s++) a0[s] = a1[s] = 0.0f;
#pragma unroll
    for (int w4 = 0; w4 < 4; w4++) {
        float f[4];
        b1_e4m3x4(qw[w4], f);
#pragma unroll
        for (int s = 0; s < NS; s++) {
            float4 xv = xc[(s * 4 + w4) * cv];
            a0[s] = fmaf(f[0], xv.x, a0[s]);
            a1[s] = fmaf(f[1], xv.y, a1[s]);
            a0[s] = fmaf(f[2], xv.z, a0[s]);
            a1[s] = fmaf(f[3], xv.w, a1[s]);
        }
    }
#pragma unroll
    for (int s = 0; s < NS; s++) r[s] = a0[s] + a1[s];
}

/* b1f_run for the n (<= NS) slots of one group: input rows xs[s], outputs out[s], pre[s]
 * (entries >= n repeat slot 0's input and are not written).  RL 1 rolls the stage loop (one stage
 * a trip, as b1f_run's DEC 3): every stage's body and its sums are the same, so are the bits */
template <int UP, int FMT, int NS, int RL>
__device__ __forceinline__ void bn_run(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const float *const *xs, int n,
                                       int64_t f0, float *const *out, const float *pre, float limit, int act_bf16) {
    constexpr int S = BN_S, V = BN_V, M = BN_M;
    constexpr int NH = UP ? 2 : 1, U = V / NH, NIT = M / U, VN = FMT == B1F_FP8 ? 16 : 32, VQ = VN / 4,
                  NV = V * NS, PS = 8 * M * NH; /* NV: sums per stage; PS: one slot's warp sums */
    constexpr int FSTEP = 4096;
    static_assert(V % NH == 0 && M % U == 0 && NIT % S == 0 && NV <= 32 && M % 16 == 0, "bn geometry");
    uint4 *sd = (uint4 *)sm + threadIdx.x;
    uint8_t *tile = sm + S * V * 256 * 16;
    float *part = (float *)(tile + 256 * M * 2 * NH);
    float4 *xsm = (float4 *)(part + PS * BN_G); /* the launch's x area follows BN_G warp-sum areas */
    int tid = threadIdx.x, lane = tid & 31;
    int cv = W[0].rowb / 16, P = 256 / cv, c = tid & (cv - 1), p = tid / cv, kw = cv / 32, kwi = c >> 5;
    int nfeat, nv;
    const uint8_t *g0, *g1;
    float fsc[2];
    b1f_start<UP, FMT, S, V, M, BN_HINT>(sm, W, rows, f0, nfeat, nv, g0, g1, fsc);
    /* down: h is the previous kernel's output (as in b1f_run); gate/up (k_moe_bnr's groups of 2..BN_G
     * slots) reads x, complete before the one-slot launch before it started: no wait here */
    if (!UP) pdl_wait();
    /* the slots' x vectors, transposed (the threads of column c with p = s mod P copy slot s) */
    for (int s = p; s < NS; s += P) {
        const float4 *xp = (const float4 *)(xs[s] + (int64_t)c * VN);
#pragma unroll
        for (int j = 0; j < VQ; j++) xsm[(s * VQ + j) * cv + c] = __ldg(xp + j);
    }
    __syncthreads();
    const float4 *xc = xsm + c;
    const uint32_t *t32 = (const uint32_t *)tile + tid;
    const uint16_t *t16 = (const uint16_t *)tile + tid;
    for (int it0 = 0; it0 < NIT; it0 += S) {
        const uint8_t *b0 = g0 + (int64_t)it0 * U * FSTEP, *b1 = g1 + (int64_t)it0 * U * FSTEP;
        int nvr = nv - it0 * U;
#pragma unroll(RL ? 1 : S)
        for (int st = 0; st < S; st++) {
            float v[NV]; /* value j NS + s: reduced per stage (b1f_run reduces per S stages: with
                          * NS slots that many sums spilled) */
            b1f_refill<NH, S, V, BN_HINT>(sd, st, nvr, b0, b1);
#pragma unroll
            for (int u = 0; u < U; u++) {
                int i = (it0 + st) * U + u;
                uint32_t te = UP ? t32[256 * i] : (uint32_t)t16[256 * i];
#pragma unroll
                for (int hh = 0; hh < NH; hh++) {
                    uint4 q = sd[(st * V + u * NH + hh) * 256];
                    float r[NS];
                    if (FMT == B1F_FP8) {
                        bn_fp8<NS>(q, xc, cv, r);
#pragma unroll
                        for (int s = 0; s < NS; s++) r[s] *= fsc[hh];
                    } else {
                        float a[NS], b[NS];
                        bn_fp4<NS>(q, xc, cv, a, b);
                        uint32_t bits = hh ? te >> 16 : te & 0xffffu;
                        if (FMT == B1F_MXFP4) {
                            float sc = __uint_as_float(bits << 16);
#pragma unroll
                            for (int s = 0; s < NS; s++) r[s] = ((a[s] + b[s]) * 64.0f) * sc; /* 2^6: exact */
                        } else {
                            float2 s2 = d_e4m3x2_to_f32x2((uint16_t)bits);
                            float sa = s2.x * W[hh].scale2, sb = s2.y * W[hh].scale2;
#pragma unroll
                            for (int s = 0; s < NS; s++) r[s] = (a[s] * 64.0f) * sa + (b[s] * 64.0f) * sb;
                        }
                    }
#pragma unroll
                    for (int s = 0; s < NS; s++) v[(u * NH + hh) * NS + s] = r[s];
                }
            }
            float wsum = b1f_reduce<NV>(v, lane);
            if ((lane & (32 / NV - 1)) == 0) {
                int jv = lane / (32 / NV), s = jv % NS, j = jv / NS;
                int fl = p + P * ((it0 + st) * U + j / NH);
                part[s * PS + (fl * NH + j % NH) * kw + kwi] = wsum;
            }
        }
    }
    __syncthreads();
    for (int s = 0; s < n; s++) b1_write<UP>(part + s * PS, kw, nfeat, tid, f0, out[s], pre[s], limit, act_bf16);
}

template <int UP, int NS, int RL>
__device__ __forceinline__ void bn_format(uint8_t *sm, const mb_half (&W)[2], int64_t rows, const float *const *xs,
                                          int n, int64_t f0, float *const *out, const float *pre, float limit,
                                          int act_bf16) {
    if (W[0].fmt == DSV4_WF_MXFP4)
        bn_run<UP, B1F_MXFP4, NS, RL>(sm, W, rows, xs, n, f0, out, pre, limit, act_bf16);
    else if (W[0].fmt == DSV4_WF_NVFP4)
        bn_run<UP, B1F_NVFP4, NS, RL>(sm, W, rows, xs, n, f0, out, pre, limit, act_bf16);
    else
        bn_run<UP, B1F_FP8, NS, RL>(sm, W, rows, xs, n, f0, out, pre, limit, act_bf16);
}

/* grid: nrb cr + hsg cs blocks (nrb bounds the routed groups, hsg = the shared expert's groups,
 * 0 without one); NSK 1: the groups of one slot (k_moe_b1r's work and geometry), NSK = BN_G: the
 * groups of 2..BN_G slots (bn_run); blocks of the other kind's groups exit (down ones after
 * the PDL wait, as k_moe_b1r's).  RL 1 rolls the stage loops (b1f_run's DEC 3, bn_run's RL): the
 * same bits (DSV4_CUDA_MOE_BNR, cuda_devside.bnr) */
template <int UP, int NSK, int MINB, int RL>
__global__ void __launch_bounds__(256, MINB) k_moe_bnr(const group *groups, const int *n_groups, const dexpert *tab,
                                                    const float *x, const float *xq, float *h, int64_t ldh, float *y,
                                                    int64_t dim, int act_fp8, float limit, int act_bf16, int cr,
                                                    int cs, int hsg) {
    /* The one-slot gate/up follows the plan: wait at once.  The multi-slot gate/up follows the
     * one-slot one but needs nothing it writes (the plan's groups and x were complete before the
     * one-slot launch started), so it runs alongside it; only its block 0 waits before it exits, so
     * that the grid cannot complete before its predecessor (the kernels after it rely on that,
     * common.cuh's PDL notes).  Down: waits in b1f_run / bn_run, before reading h. */
    constexpr bool OVL = UP && NSK > 1;
    if (UP && !OVL) pdl_enter();
    else pdl_trigger();
    extern __shared__ __align__(128) uint8_t bns[];
    int nr = *n_groups - hsg, b = (int)blockIdx.x, gi = -1, chunk = 0;
    if (nr >= 0 && b < nr * cr) {
        gi = b / cr, chunk = b - gi * cr;
    } else if (nr >= 0 && cs > 0 && b - nr * cr < hsg * cs) {
        int q = b - nr * cr;
        gi = nr + q / cs, chunk = q % cs;
    }
    int n = gi >= 0 ? groups[gi].n : 0;
    if (NSK == 1 ? n != 1 : n < 2) gi = -1;
    mb_half W[2];
    int64_t rows, f0;
    const float *xs0;
    float *out0;
    if (gi < 0 || !b1_group<UP, BN_M>(groups[gi], tab[groups[gi].ex], x, xq, h, ldh, y, dim, act_fp8, W, rows, xs0,
                                      out0, f0, chunk)) {
        if (!UP || (OVL && blockIdx.x == 0)) pdl_wait();
        return;
    }
    const group &G = groups[gi];
    if constexpr (NSK == 1) {
        b1f_format<UP, RL ? 3 : 2, BN_S, BN_V, BN_M, BN_HINT>(bns, W, rows, xs0, f0, out0, G.pre[0], limit,
                                                              act_bf16);
    } else {
        const float *xs[NSK];
        float *out[NSK];
        float pre[NSK];
        const float *xin = UP ? (act_fp8 && tab[G.ex].q1 ? xq : x) : h;
#pragma unroll
        for (int s = 0; s < NSK; s++) {
            int t = s < n ? s : 0;
            xs[s] = UP ? xin + (int64_t)G.row[t] * dim : xin + (int64_t)G.slot[t] * ldh;
            out[s] = UP ? h + (int64_t)G.slot[t] * ldh : y + (int64_t)G.slot[t] * dim;
            pre[s] = G.pre[t];
        }
        if (n <= 2) bn_format<UP, 2, RL>(bns, W, rows, xs, n, f0, out, pre, limit, act_bf16);
        else bn_format<UP, NSK, RL>(bns, W, rows, xs, n, f0, out, pre, limit, act_bf16);
        if (OVL && blockIdx.x == 0) pdl_wait();
    }
}

/* k_moe_bnr<UP, NSK, MINB>'s instance that the roll bits bnr (cuda_devside.bnr) pick: bit 0 / 1 the
 * one-slot gate/up / down, bit 2 / 3 the multi-slot ones */
template <int UP, int NSK, int MINB>
static auto bnr_kernel(int bnr) {
    constexpr int bit = (UP ? 0 : 1) + (NSK > 1 ? 2 : 0);
    return bnr >> bit & 1 ? k_moe_bnr<UP, NSK, MINB, 1> : k_moe_bnr<UP, NSK, MINB, 0>;
}

/* order[r*k + i]: slot of row r's i-th expert in id order (-1: a skipped bad id); cw: its
 * combine weight */
__global__ void k_moe_combine(float *out, const float *y, int64_t dim, int rows, int k, const int32_t *order,
                              const float *cw, int n_routed_slots, int has_shared, float out_scale, int act_bf16) {
    pdl_enter();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * dim) return;
    int64_t r = t / dim, d = t % dim;
    float acc = 0.0f;
    for (int i = 0; i < k; i++) {
        int sl = order[r * k + i];
        if (sl >= 0) acc += cw[r * k + i] * y[(int64_t)sl * dim + d];
    }
    float v = acc * out_scale + (has_shared ? y[(int64_t)(n_routed_slots + r) * dim + d] : 0.0f);
    out[t] = act_bf16 ? d_round_bf16(v) : v;
}

/* The plan's last part: the shared expert's gs groups of <= gmax rows after the g0 routed ones
 * (slots rows*k + r, weight 1), taken by threads first, first + stride, ...; the thread with
 * first == 0 writes the group count.  Past max_groups: the device flag, as for a bad id. */
__device__ __forceinline__ void plan_shared_groups(group *groups, int *n_groups, int g0, int gs, int first, int stride,
                                                   int max_groups, int gmax, int rows, int nrs, int n_routed,
                                                   unsigned *flags) {
    for (int q = first; q < gs; q += stride) {
        if (g0 + q >= max_groups) {
            atomicOr(flags, DSV4_DEVFLAG_EXPERT);
            break;
        }
        group &G = groups[g0 + q];
        G.ex = n_routed;
        G.n = min(gmax, rows - q * gmax);
        for (int t = 0; t < G.n; t++) {
            int r = q * gmax + t;
            G.slot[t] = nrs + r;
            G.row[t] = r;
            G.pre[t] = 1.0f;
        }
    }
    if (first == 0) *n_groups = min(g0 + gs, max_groups);
}

/* The slot plan, on the device (one block).  Shared memory: cnt, pos, gstart [n_routed
 * (+1)].  sorted: scratch [rows*k].  Writes groups[0 .. *n_groups), order and cw. */
__global__ void __launch_bounds__(1024) k_moe_plan(group *groups, int *n_groups, int max_groups, int32_t *order,
                                                   float *cw, int32_t *sorted, const int32_t *e, const float *wgt,
                                                   int rows, int k, int n_routed, int has_shared, int before_w2,
                                                   const dexpert *tab, unsigned long long *wbytes,
                                                   unsigned *flags, int gmax) {
    pdl_enter();
    extern __shared__ int sh[];
    int *cnt = sh, *pos = sh + n_routed, *gst = sh + 2 * n_routed;
    int nrs = rows * k, tid = threadIdx.x, nt = blockDim.x;
    for (int x = tid; x < n_routed; x += nt) cnt[x] = 0;
    __syncthreads();
    for (int i = tid; i < nrs; i += nt) {
        int x = e[i];
        if ((unsigned)x < (unsigned)n_routed) atomicAdd(&cnt[x], 1);
        else atomicOr(flags, DSV4_DEVFLAG_EXPERT);
    }
    __syncthreads();
    if (tid < 32) { /* exclusive scans (first slot and first group of each expert), 32 experts
                     * at a time by warp shuffles: integer sums, any order gives the same */
        int sacc = 0, gacc = 0;
        for (int x0 = 0; x0 < n_routed; x0 += 32) {
            int x = x0 + tid, cs = x < n_routed ? cnt[x] : 0, cg = (cs + gmax - 1) / gmax, is = cs, ig = cg;
            for (int off = 1; off < 32; off <<= 1) { /* inclusive scans */
                int us = __shfl_up_sync(0xffffffffu, is, off), ug = __shfl_up_sync(0xffffffffu, ig, off);
                if (tid >= off) is += us, ig += ug;
            }
            if (x < n_routed) {
                pos[x] = sacc + is - cs;
                gst[x] = gacc + ig - cg;
            }
            sacc += __shfl_sync(0xffffffffu, is, 31);
            gacc += __shfl_sync(0xffffffffu, ig, 31);
        }
        if (tid == 0) gst[n_routed] = gacc;
    }
    __syncthreads();
    if (tid < 32) { /* stable placement: warp 0 walks the slots in order, 32 at a time */
        for (int i0 = 0; i0 < nrs; i0 += 32) {
            int i = i0 + tid;
            int x = i < nrs ? e[i] : -1;
            int ok = i < nrs && (unsigned)x < (unsigned)n_routed;
            unsigned same = __match_any_sync(0xffffffffu, ok ? x : -1);
            int rank = __popc(same & ((1u << tid) - 1u));
            if (ok) sorted[pos[x] + rank] = i;
            __syncwarp();
            if (ok && rank == 0) pos[x] += __popc(same); /* the lowest lane of each expert advances it */
            __syncwarp();
        }
    }
    __syncthreads(); /* pos[x] is now the end of expert x's run */
    for (int x = tid; x < n_routed; x += nt) {
        int c = cnt[x];
        for (int q = 0; q * gmax < c; q++) {
            int g = gst[x] + q;
            if (g >= max_groups) { /* cannot happen (the bound is exact arithmetic); never write past it */
                atomicOr(flags, DSV4_DEVFLAG_EXPERT);
                break;
            }
            group &G = groups[g];
            G.ex = x;
            G.n = min(gmax, c - q * gmax);
            for (int t = 0; t < G.n; t++) {
                int sl = sorted[pos[x] - c + q * gmax + t];
                G.slot[t] = sl;
                G.row[t] = sl / k;
                G.pre[t] = before_w2 ? wgt[sl] : 1.0f;
            }
            atomicAdd(wbytes, tab[x].bytes);
        }
    }
    int g0 = gst[n_routed];
    plan_shared_groups(groups, n_groups, g0, has_shared ? (rows + gmax - 1) / gmax : 0, tid, nt, max_groups, gmax,
                       rows, nrs, n_routed, flags);
    for (int r = tid; r < rows; r += nt) { /* each row's experts by increasing id, stable in pick order */
        int32_t *o = order + (int64_t)r * k;
        for (int i = 0; i < k; i++) o[i] = r * k + i;
        for (int i = 1; i < k; i++)
            for (int j = i; j > 0 && e[o[j - 1]] > e[o[j]]; j--) {
                int32_t t = o[j];
                o[j] = o[j - 1];
                o[j - 1] = t;
            }
        for (int i = 0; i < k; i++) {
            int sl = o[i];
            cw[(int64_t)r * k + i] = before_w2 ? 1.0f : wgt[sl];
            if ((unsigned)e[sl] >= (unsigned)n_routed) o[i] = -1;
        }
    }
}

/* k_moe_combine for k <= 8 picks per row (the first 8 of a larger k): every order / cw entry
 * loaded first, then every y value, then the same sum in the same order (a chain of 2k
 * dependent loads in k_moe_combine; an invalid slot reads slot 0 and adds nothing).  The
 * arithmetic is common.cuh's moe_comb1, which k_hc_dec's fused combine (moe_comb4) repeats. */
__global__ void k_moe_combine_u(float *out, const float *y, int64_t dim, int rows, int k, const int32_t *order,
                                const float *cw, int n_routed_slots, int has_shared, float out_scale, int act_bf16) {
    pdl_enter();
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * dim) return;
    moe_comb m = {out, y, order, cw, k, n_routed_slots, has_shared, act_bf16, out_scale};
    out[t] = moe_comb1(m, dim, t / dim, t % dim);
}

/* k_moe_plan for rows * k <= 32 slots: one warp, lane i = slot i, no barrier and no shared
 * memory.  The same outputs: an expert's slots in slot order cut into groups of gmax (a
 * slot's rank among its expert's slots by __match_any_sync), the routed groups by
 * increasing expert id (a group's index: the groups of smaller ids, summed over the warp),
 * the shared expert's groups last, one weight-byte count per group; each row's combine
 * order (its slots by (id, slot): the block kernel's stable insertion sort) and weights.  tb (or
 * NULL): every expert's tab[].bytes, already loaded (k_route_plan_1's shared copy). */
__device__ __forceinline__ void d_moe_plan_w(group *groups, int *n_groups, int max_groups, int32_t *order, float *cw,
                                             const int32_t *e, const float *wgt, int rows, int k, int n_routed,
                                             int has_shared, int before_w2, const dexpert *tab,
                                             unsigned long long *wbytes, unsigned *flags, int gmax,
                                             const unsigned long long *tb = NULL) {
    int i = threadIdx.x & 31, nrs = rows * k, in = i < nrs;
    int x = in ? e[i] : 0;
    float w = in ? wgt[i] : 0.0f;
    int ok = in && (unsigned)x < (unsigned)n_routed;
    if (in && !ok) atomicOr(flags, DSV4_DEVFLAG_EXPERT);
    unsigned same = __match_any_sync(0xffffffffu, ok ? x : -1); /* ids are >= 0 */
    int c = __popc(same), rank = __popc(same & ((1u << i) - 1u));
    int ng = ok && rank == 0 ? (c + gmax - 1) / gmax : 0; /* groups of this expert (its first slot) */
    int before = 0, pos = 0, rb = in ? i / k * k : 0;
    for (int j = 0; j < nrs; j++) { /* groups of smaller ids */
        int xj = __shfl_sync(0xffffffffu, x, j), nj = __shfl_sync(0xffffffffu, ng, j);
        if (xj < x) before += nj;
    }
    for (int j = 0; j < k; j++) { /* place in the row's combine order */
        int xj = __shfl_sync(0xffffffffu, x, rb + j);
        if (xj < x || (xj == x && rb + j < i)) pos++;
    }
    int g0 = (int)__reduce_add_sync(0xffffffffu, (unsigned)ng);
    if (ok) {
        int q = rank / gmax, t = rank % gmax, g = before + q;
        if (g >= max_groups) { /* cannot happen (the bound is exact arithmetic); never write past it */
            atomicOr(flags, DSV4_DEVFLAG_EXPERT);
        } else {
            group &G = groups[g];
            if (t == 0) {
                G.ex = x;
                G.n = min(gmax, c - q * gmax);
                atomicAdd(wbytes, tb ? tb[x] : tab[x].bytes);
            }
            G.slot[t] = i;
            G.row[t] = i / k;
            G.pre[t] = before_w2 ? w : 1.0f;
        }
    }
    if (in) {
        order[rb + pos] = ok ? i : -1;
        cw[rb + pos] = before_w2 ? 1.0f : w;
    }
    plan_shared_groups(groups, n_groups, g0, has_shared ? (rows + gmax - 1) / gmax : 0, i, 32, max_groups, gmax,
                       rows, nrs, n_routed, flags);
}

__global__ void __launch_bounds__(32) k_moe_plan_w(group *groups, int *n_groups, int max_groups, int32_t *order,
                                                  float *cw, const int32_t *e, const float *wgt, int rows, int k,
                                                  int n_routed, int has_shared, int before_w2, const dexpert *tab,
                                                  unsigned long long *wbytes, unsigned *flags, int gmax) {
    pdl_enter();
    d_moe_plan_w(groups, n_groups, max_groups, order, cw, e, wgt, rows, k, n_routed, has_shared, before_w2, tab,
                 wbytes, flags, gmax);
}

/* route, then plan, in one launch (decode: the router's k_route_w<NPL> and the MoE's
 * k_moe_plan_w, two dependent launches of ~2.5 us each, where no weights stream): one block of
 * 32 * rows threads (rows <= RP_WARPS), warp r routes row r by k_route_w's body, then, after the
 * block barrier (which makes the warps' global writes of experts and weights visible to the
 * block), warp 0 plans from them by k_moe_plan_w's body: the same bits as the two kernels.
 * Every warp reaches the barrier (none returns early), after pdl_enter. */
#define RP_WARPS 8
template <int NPL>
__global__ void __launch_bounds__(32 * RP_WARPS)
    k_route_plan_w(int32_t *experts, float *weights, const float *logits, int n_routed, const float *bias,
                   float scale, group *groups, int *n_groups, int max_groups, int32_t *order, float *cw, int rows,
                   int k, int has_shared, int before_w2, const dexpert *tab, unsigned long long *wbytes,
                   unsigned *flags, int gmax) {
    pdl_enter();
    int warp = threadIdx.x >> 5;
    if (warp < rows) d_route_w<NPL>(experts, weights, logits, warp, n_routed, k, bias, scale);
    __syncthreads();
    if (warp == 0)
        d_moe_plan_w(groups, n_groups, max_groups, order, cw, experts, weights, rows, k, n_routed, has_shared,
                     before_w2, tab, wbytes, flags, gmax);
}

/* route, then plan, of one row (decode batch 1) in one launch of 32 NPL threads: k_route_plan_w's
 * results, bit for bit, with fewer dependent steps on its one warp.  Thread t < n_routed loads
 * expert t's logit, bias and table byte count (one round trip for all) and forms its score and
 * key (k_route_w's expressions) into shared memory; after the barrier warp 0 alone picks from
 * them (d_route_pick, the lanes' experts as in k_route_w), and plans from its own picks through
 * shared memory (not through the experts / weights it writes to global memory and would read
 * back) and from the staged byte counts.  Measured in the 20-layer Flash step on the H200
 * (2026-12-04, ktrace, 2K): k_route_plan_w's records averaged 5.6 us (17 a step) and, inside a
 * graph, it ended 5.7 us after the gate GEMV; k_route_plan_1 3.8 us after it, 68.4 against 93.3 us
 * a step exposed. */
template <int NPL>
__global__ void __launch_bounds__(32 * NPL)
    k_route_plan_1(int32_t *experts, float *weights, const float *logits, int n_routed, const float *bias,
                   float scale, group *groups, int *n_groups, int max_groups, int32_t *order, float *cw, int k,
                   int has_shared, int before_w2, const dexpert *tab, unsigned long long *wbytes, unsigned *flags,
                   int gmax) {
    __shared__ unsigned skey[32 * NPL];
    __shared__ float ssc[32 * NPL];
    __shared__ unsigned long long sby[32 * NPL];
    __shared__ int32_t se[32];
    __shared__ float sw[32];
    pdl_enter();
    int t = threadIdx.x, lane = t & 31;
    if (t < n_routed) {
        float lv = logits[t], bv = bias ? bias[t] : 0.0f;
        sby[t] = tab[t].bytes;
        float sc = d_sqrt_softplus(lv);
        ssc[t] = sc;
        skey[t] = route_key(sc + (bias ? bv : 0.0f)); /* the block kernel's score+bias */
    }
    __syncthreads();
    if (t >= 32) return;
    float s[NPL];
    unsigned key[NPL], live = 0;
#pragma unroll
    for (int m = 0; m < NPL; m++) {
        int e = lane + 32 * m;
        bool in = e < n_routed;
        key[m] = in ? skey[e] : 0u;
        s[m] = in ? ssc[e] : 0.0f;
        if (in) live |= 1u << m;
    }
    unsigned id;
    float w;
    d_route_pick<NPL>(key, s, live, experts, weights, 0, k, scale, &id, &w);
    if (lane < k) se[lane] = (int32_t)id, sw[lane] = w;
    __syncwarp();
    d_moe_plan_w(groups, n_groups, max_groups, order, cw, se, sw, 1, k, n_routed, has_shared, before_w2, tab, wbytes,
                 flags, gmax, sby);
}

/* route by hash ids, then plan, of one row (decode batch 1 in the first num_hash_layers layers) in
 * one launch of one warp: k_route's outputs for a hash row bit for bit (the ids as given; lane j
 * forms the score of pick j, sqrt(softplus(logit)), 0 for an id outside [0, n_routed), and its
 * weight by d_pick_weight), written to experts / weights and kept in shared memory, from which the lane plans
 * (d_moe_plan_w: k_moe_plan_w's body, which flags and skips a bad id).  It replaces k_route +
 * k_moe_plan_w, two dependent launches (3.5 + 4.2 us a call in the 20-layer Flash step's trace,
 * 2026-12-04).  DSV4_CUDA_RP1=0 keeps the two ops. */
__global__ void __launch_bounds__(32)
    k_route_plan_h(int32_t *experts, float *weights, const float *logits, int n_routed, const int32_t *hash_ids,
                   float scale, group *groups, int *n_groups, int max_groups, int32_t *order, float *cw, int k,
                   int has_shared, int before_w2, const dexpert *tab, unsigned long long *wbytes, unsigned *flags,
                   int gmax) {
    __shared__ int32_t se[32];
    __shared__ float sw[32];
    pdl_enter();
    const int lane = threadIdx.x;
    const int32_t id = lane < k ? hash_ids[lane] : 0;
    const float sc = lane < k && (unsigned)id < (unsigned)n_routed ? d_sqrt_softplus(logits[id]) : 0.0f;
    const float w = d_pick_weight(sc, k, scale);
    if (lane < k) experts[lane] = id, weights[lane] = w, se[lane] = id, sw[lane] = w;
    __syncwarp();
    d_moe_plan_w(groups, n_groups, max_groups, order, cw, se, sw, 1, k, n_routed, has_shared, before_w2, tab, wbytes,
                 flags, gmax);
}

/* warps per feature group splitting K: double while the launch has fewer than ~8K warps
 * and each warp keeps at least two steps (steps: K / 1024, the FP4 count, the fewest) */
static int moe_kw(int64_t warps, int64_t steps) {
    int kw = 1;
    while (kw < 8 && warps * kw < 8192 && steps >= 2 * kw) kw *= 2;
    return kw;
}

static int quantized(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

static size_t wb(const dsv4_weight *w) { return dsv4_weight_bytes(w); }

/* ----- device-side state: flags, counter, expert tables ----- */
/* One layer's experts on the device: n_routed routed entries, then the shared expert
 * (an all-zero entry when there is none). */
struct moe_table {
    const dsv4_ffn_w *key, *shared; /* host arrays the table was built from */
    int n_routed;
    const void **ids;               /* [3*(n_routed+1)] weight data pointers, to detect reuse */
    dexpert *dev;                   /* device [n_routed + 1] */
    int64_t inter, dim;             /* routed experts' shape */
    int q1_any, w2_quant;           /* routed w1 quantized (any), routed w2 quantized */
    int bulk;                       /* every expert's weights can take k_moe_bulk */
    int b1_fit;                     /* every expert fits k_moe_b1r (b1_fits) in the backend's geometry */
    int bn_fit;                     /* every expert fits k_moe_bnr (b1_fits at BN_M, both halves) */
    int mma_fit;                    /* every routed expert is MXFP4 (w1, w3, w2): moe.dot=mma applies */
    int q8_fit;                     /* every expert takes k_moe_q8 (q8_takes): moe.dot=e4m3 applies */
};

struct cuda_devside {
    unsigned *flags;                /* device word: DSV4_DEVFLAG_* bits (sticky) */
    unsigned long long *wbytes;     /* device: routed weight bytes streamed since the last reset */
    moe_table *tab;
    int n_tab, cap_tab;
    int mb_grid;                    /* k_moe_bulk blocks (SMs x resident blocks); 0 = not set up, -1 = off */
    int b1;                         /* one row: 0 k_moe_bulk, else 1 + the geometry (b1_geoms) */
    long mb_calls;                  /* moe calls that took k_moe_bulk or a one-row kernel, or k_moe_bnr
                                     * at <= MOE_G rows (where k_moe_bulk ran before it) */
    int bn;                         /* 2..BN_ROWS rows: 1 k_moe_bnr (groups of <= BN_G), 2 k_moe_bnr's
                                     * one-slot kernel only (groups of one slot), 0 the kernels before
                                     * it (DSV4_CUDA_MOE_BN=0 / =2, A/B runs) */
    int bn_smem;                    /* the largest dynamic shared memory a k_moe_bnr block may take */
    int bnr;                        /* k_moe_bnr's stage loops rolled, by instance: bit 0 the one-slot
                                     * gate/up, 1 the one-slot down, 2 the multi-slot gate/up, 3 the
                                     * multi-slot down (DSV4_CUDA_MOE_BNR=0..15, default 8: the same bits
                                     * either way; BN_ROLL_DEFAULT) */
    long bn_calls;                  /* moe calls that took k_moe_bnr */
    long mma_calls;                 /* moe calls that took k_moe_b1r's MMA instances */
    long q8_calls;                  /* moe calls that took k_moe_q8 (moe.dot=e4m3) */
    int hrec;                       /* 1: the MMA gate/up writes h's B records (DSV4_CUDA_MOE_HREC=0: 0) */
    int bm_form;                    /* moe.dot=mma's kernel where its shapes fit: 2 bm2_run, 3 bm3_run, 4 bm3_run
                                     * with the records staged (DSV4_CUDA_MOE_BM=2 / 3 / 4, its shared memory
                                     * granted); 0 bm_run */
    long bm_form_calls;             /* moe calls that took bm2_run or bm3_run (MMA = 2 / 3 / 4 instances) */
    long rp_calls[DSV4_RP_KINDS];   /* route_moe calls by cuda.h's DSV4_RP_* (the one-launch kernels) */
    int rp1;                        /* 1: one row takes k_route_plan_1 (DSV4_CUDA_RP1=0: k_route_plan_w) */
    int small;                      /* 1: the warp router, one-warp plan and prefetching combine
                                     * (DSV4_CUDA_ROUTE_SMALL=0: the block kernels, A/B runs) */
    struct bias_copy {              /* the router's bias arrays on the device, by host pointer */
        const float *host;
        int n;
        float *shadow;              /* host copy of what dev holds (a changed array is re-sent) */
        float *dev;
    } *bias;
    int n_bias, cap_bias;
};
#define ROUTE_BIAS_MAX 512          /* distinct arrays kept; more are staged per call */

extern "C" int dsv4_cuda_moe_bnr(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->bnr : -1;
}

extern "C" int dsv4_cuda_moe_b1_geom(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside && c->devside->b1 > 0 ? c->devside->b1 - 1 : -1;
}

long dsv4_cuda_moe_bulk_calls(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->mb_calls : 0;
}

/* moe calls that took k_moe_q8 (one row, moe.dot=e4m3; cuda.h), for the tests */
extern "C" long dsv4_cuda_moe_q8_calls(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->q8_calls : 0;
}

/* moe calls that took k_moe_b1r's MMA instances (one row, moe.dot=mma; cuda.h), for the tests */
extern "C" long dsv4_cuda_moe_mma_calls(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->mma_calls : 0;
}

/* moe calls that took bm2_run or bm3_run (DSV4_CUDA_MOE_BM; cuda.h), for the tests */
extern "C" long dsv4_cuda_moe_bm_form_calls(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->bm_form_calls : 0;
}

/* moe calls that took k_moe_bnr (2..BN_ROWS rows; cuda.h), for the tests */
extern "C" long dsv4_cuda_moe_bn_calls(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    return c->devside ? c->devside->bn_calls : 0;
}

/* route_moe calls that routed and planned in one launch, by kind (cuda.h), for the tests */
extern "C" long dsv4_cuda_route_plan_calls(dsv4_backend *b, int kind) {
    cuda_impl *c = CI(b);
    return c->devside && kind >= 0 && kind < DSV4_RP_KINDS ? c->devside->rp_calls[kind] : 0;
}

static cuda_devside *devside(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (c->devside || c->failed) return c->devside;
    dsv4_cuda_seg_end(b); /* first use: allocations are made outside a graph capture */
    cuda_devside *d = (cuda_devside *)calloc(1, sizeof *d);
    if (!d) {
        dsv4_cuda_fail(b, "device state: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return NULL;
    }
    void *p = NULL; /* zeroed in stream order: the ops' kernels run on c->stream (non-blocking) */
    if (CK(b, cudaMalloc(&p, 16)) || CK(b, cudaMemsetAsync(p, 0, 16, c->stream))) {
        if (p) cudaFree(p);
        free(d);
        return NULL;
    }
    d->flags = (unsigned *)p;
    d->wbytes = (unsigned long long *)((uint8_t *)p + 8);
    const char *rs = getenv("DSV4_CUDA_ROUTE_SMALL");
    d->small = !(rs && rs[0] == '0');
    const char *r1 = getenv("DSV4_CUDA_RP1");
    d->rp1 = !(r1 && r1[0] == '0');
    c->devside = d;
    return d;
}

static int small_kernels(const cuda_devside *d) { return d->small; }

/* The device copy of the router's bias array `bias` (n floats, host): made on first use and
 * re-sent when the host values changed (a freed array whose address was reused); the copy in
 * stream order after every kernel already issued, so no kernel sees the new values early.
 * NULL on failure (sticky error set). */
static const float *route_bias(dsv4_backend *b, cuda_devside *d, const float *bias, int n) {
    size_t bytes = sizeof(float) * (size_t)n;
    struct cuda_devside::bias_copy *bc = NULL;
    for (int i = 0; i < d->n_bias && !bc; i++)
        if (d->bias[i].host == bias && d->bias[i].n == n) bc = &d->bias[i];
    if (bc && !memcmp(bc->shadow, bias, bytes)) return bc->dev; /* every call after the first */
    if (!bc && d->n_bias == ROUTE_BIAS_MAX) return (const float *)dsv4_cuda_stage(b, bias, bytes);
    dsv4_cuda_seg_end(b); /* an allocation and a copy from pageable memory: not capturable */
    if (!bc) {
        if (d->n_bias == d->cap_bias) {
            int cap = d->cap_bias ? 2 * d->cap_bias : 64;
            struct cuda_devside::bias_copy *nb =
                (struct cuda_devside::bias_copy *)realloc(d->bias, sizeof *nb * (size_t)cap);
            if (!nb) {
                dsv4_cuda_fail(b, "route: out of host memory", __FILE__, __LINE__, cudaSuccess);
                return NULL;
            }
            d->bias = nb;
            d->cap_bias = cap;
        }
        float *sh = (float *)malloc(bytes ? bytes : 1), *dv = NULL;
        if (!sh) {
            dsv4_cuda_fail(b, "route: out of host memory", __FILE__, __LINE__, cudaSuccess);
            return NULL;
        }
        if (CK(b, cudaMalloc((void **)&dv, bytes ? bytes : 1))) {
            free(sh);
            return NULL;
        }
        bc = &d->bias[d->n_bias++];
        bc->host = bias;
        bc->n = n;
        bc->shadow = sh;
        bc->dev = dv;
    }
    memcpy(bc->shadow, bias, bytes);
    /* pageable source: taken before this returns, so the shadow may change later */
    if (CK(b, cudaMemcpyAsync(bc->dev, bc->shadow, bytes, cudaMemcpyHostToDevice, CI(b)->stream))) return NULL;
    return bc->dev;
}

unsigned *dsv4_cuda_devflags(dsv4_backend *b) {
    cuda_devside *d = devside(b);
    return d ? d->flags : NULL;
}

void dsv4_cuda_devside_fetch(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (c->devside && !c->failed) dsv4_cuda_fetch(b, &c->devside_flags, c->devside->flags, sizeof c->devside_flags);
}

int dsv4_cuda_devside_check(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    if (!c->devside || c->failed) return c->failed;
    unsigned f = c->devside_flags;
    if (f & DSV4_DEVFLAG_PICK)
        return dsv4_cuda_fail(b, "device index check: a top-k pick outside the compressed rows (skipped)", __FILE__,
                              __LINE__, cudaSuccess);
    if (f & DSV4_DEVFLAG_EXPERT)
        return dsv4_cuda_fail(b, "device index check: an expert id outside [0, n_routed) (skipped)", __FILE__,
                              __LINE__, cudaSuccess);
    return 0;
}

double dsv4_cuda_devside_weight_bytes(dsv4_backend *b, int reset) {
    cuda_impl *c = CI(b);
    if (!c->devside || c->failed) return 0;
    if (reset) {
        CK(b, cudaMemsetAsync(c->devside->wbytes, 0, sizeof(unsigned long long), c->stream));
        return 0;
    }
    unsigned long long v = 0;
    if (dsv4_cuda_sync(b) ||
        CK(b, cudaMemcpy(&v, c->devside->wbytes, sizeof v, cudaMemcpyDeviceToHost)))
        return 0;
    return (double)v;
}

void dsv4_cuda_devside_free(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    cuda_devside *d = c->devside;
    if (!d) return;
    for (int i = 0; i < d->n_tab; i++) {
        cudaFree(d->tab[i].dev);
        free(d->tab[i].ids);
    }
    free(d->tab);
    for (int i = 0; i < d->n_bias; i++) {
        cudaFree(d->bias[i].dev);
        free(d->bias[i].shadow);
    }
    free(d->bias);
    cudaFree(d->flags);
    free(d);
    c->devside = NULL;
}

/* 1 if the table's recorded weight pointers are still those of (experts, shared) */
static int same_ids(const void *const *ids, const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared) {
    for (int x = 0; x <= n_routed; x++) {
        const dsv4_ffn_w *f = x < n_routed ? &experts[x] : shared;
        if (ids[3 * x] != (f ? f->w1.data : NULL) || ids[3 * x + 1] != (f ? f->w2.data : NULL) ||
            ids[3 * x + 2] != (f ? f->w3.data : NULL))
            return 0;
    }
    return 1;
}

static void expert_ids(const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared, const void **ids) {
    for (int x = 0; x <= n_routed; x++) {
        const dsv4_ffn_w *f = x < n_routed ? &experts[x] : shared;
        ids[3 * x] = f ? f->w1.data : NULL;
        ids[3 * x + 1] = f ? f->w2.data : NULL;
        ids[3 * x + 2] = f ? f->w3.data : NULL;
    }
}

/* the dynamic shared memory of k_moe_b1r with MMA (geometry 0's or bm_run's, the larger) */
static int bm_smem(int up) {
    int g0 = up ? B1F_SMEM(4, 2, B1_MUP, 2) : B1F_SMEM(4, 2, B1_MUP, 1);
    return g0 > BM_SMEM ? g0 : BM_SMEM;
}

/* the shapes bm2_run and bm3_run take (Flash's: K 4096 for gate/up, 2048 for down) and the dynamic
 * shared memory of k_moe_b1r with MMA = 3 (rec 0) or 4 (rec 1: bm3_run with its records staged), bm3_run's or
 * b1f_run's at M 16, the larger, and with MMA = 2 (bm2_run's or b1f_run's at M 32) */
enum { BM2_M = 32, BM2_CV_UP = 128, BM2_CV_DN = 64 };
static int bm3_smem(int up, int rec = 0) {
    int f = up ? B1F_SMEM(4, 2, B1_MUP, 2) : B1F_SMEM(4, 2, B1_MUP, 1);
    int m = rec ? (up ? BM3_SMEM_F(BM2_CV_UP, 3, 1) : BM3_SMEM_F(BM2_CV_DN, 3, 1))
                : (up ? BM3_SMEM(BM2_CV_UP) : BM3_SMEM(BM2_CV_DN));
    return f > m ? f : m;
}
/* k_moe_b1r's instance for bm3_run's forms (DSV4_CUDA_MOE_BM=3, 4), gate/up (up) or down: the one choice of
 * mb_setup's shared-memory grant and of moe_body's two launches */
typedef decltype(&k_moe_b1r<1, 2, 4, 2, B1_MUP, 4, 3>) b1r_fn;
static b1r_fn bm3_kernel(int up, int form) {
    if (form == 4) return up ? k_moe_b1r<1, 2, 4, 2, B1_MUP, 4, 4> : k_moe_b1r<0, 2, 4, 2, B1_MUP, 4, 4>;
    return up ? k_moe_b1r<1, 2, 4, 2, B1_MUP, 4, 3> : k_moe_b1r<0, 2, 4, 2, B1_MUP, 4, 3>;
}
static int bm2_smem(int up) {
    int f = up ? B1F_SMEM(4, 2, BM2_M, 2) : B1F_SMEM(4, 2, BM2_M, 1);
    int m = up ? BM2_SMEM(BM2_CV_UP) : BM2_SMEM(BM2_CV_DN);
    return f > m ? f : m;
}

/* k_moe_bulk's shared memory and grid (once per backend, outside a capture): -1 if it
 * cannot run here or DSV4_CUDA_MOE_BULK=0 switches it off */

static int mb_setup(dsv4_backend *b, cuda_devside *d) {
    int dev = 0, nsm = 0, occ = 1 << 30, smem = MB_STAGES * (MB_TILE + MB_SCALE) + MB_MAXG * (int)sizeof(mb_group);
    const void *fns[4] = {(const void *)k_moe_bulk<1, 0>, (const void *)k_moe_bulk<0, 0>,
                          (const void *)k_moe_bulk<1, 1>, (const void *)k_moe_bulk<0, 1>};
    if (CK(b, cudaGetDevice(&dev)) || CK(b, cudaDeviceGetAttribute(&nsm, cudaDevAttrMultiProcessorCount, dev)))
        return -1;
    for (int i = 0; i < 4; i++) {
        int o = 0;
        if (CK(b, cudaFuncSetAttribute(fns[i], cudaFuncAttributeMaxDynamicSharedMemorySize, smem)) ||
            CK(b, cudaFuncSetAttribute(fns[i], cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared)) ||
            CK(b, cudaOccupancyMaxActiveBlocksPerMultiprocessor(&o, fns[i], 256, smem)))
            return -1;
        if (o < occ) occ = o;
    }
    for (int i = 0; i < 2 * B1_NGEOM; i++) {
        const b1_geom &g = b1_geoms[i / 2];
        if (CK(b, cudaFuncSetAttribute(i & 1 ? g.dn : g.up, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       i & 1 ? g.smem_dn : g.smem_up)) ||
            CK(b, cudaFuncSetAttribute(i & 1 ? g.dn : g.up, cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared)))
            return -1;
    }
    /* k_moe_b1r with MMA: bm_run's or geometry 0's shared memory, the larger */
    const void *bmf[2] = {(const void *)k_moe_b1r<1, 2, 4, 2, B1_MUP, 4, 1>,
                          (const void *)k_moe_b1r<0, 2, 4, 2, B1_MUP, 4, 1>};
    for (int i = 0; i < 2; i++)
        if (CK(b, cudaFuncSetAttribute(bmf[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bm_smem(1 - i))) ||
            CK(b, cudaFuncSetAttribute(bmf[i], cudaFuncAttributePreferredSharedMemoryCarveout,
                                       cudaSharedmemCarveoutMaxShared)))
            return -1;
    /* k_moe_bnr: the one-slot instances take k_moe_b1r's shared memory; the others a size that
     * depends on K (checked per call against bn_smem).  A refusal here only switches k_moe_bnr
     * off (its error cleared): the other paths do not need it */
    int optin = 0;
    if (CK(b, cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev))) return -1;
    optin -= 1024; /* a margin below the opt-in limit */
    const void *bnf[8] = {(const void *)bnr_kernel<1, 1, 4>(0),     (const void *)bnr_kernel<0, 1, 4>(0),
                          (const void *)bnr_kernel<1, BN_G, 2>(0),  (const void *)bnr_kernel<0, BN_G, 2>(0),
                          (const void *)bnr_kernel<1, 1, 4>(15),    (const void *)bnr_kernel<0, 1, 4>(15),
                          (const void *)bnr_kernel<1, BN_G, 2>(15), (const void *)bnr_kernel<0, BN_G, 2>(15)};
    const int bns[4] = {B1F_SMEM(BN_S, BN_V, BN_M, 2), B1F_SMEM(BN_S, BN_V, BN_M, 1), optin, optin};
    int bn_ok = 1;
    for (int i = 0; i < 8 && bn_ok; i++)
        bn_ok = cudaFuncSetAttribute(bnf[i], cudaFuncAttributeMaxDynamicSharedMemorySize, bns[i % 4]) == cudaSuccess &&
                cudaFuncSetAttribute(bnf[i], cudaFuncAttributePreferredSharedMemoryCarveout,
                                     cudaSharedmemCarveoutMaxShared) == cudaSuccess;
    if (!bn_ok) (void)cudaGetLastError();
    d->bn_smem = bn_ok ? optin : 0;
    const char *off = getenv("DSV4_CUDA_MOE_BULK"), *dbg = getenv("DSV4_CUDA_MOE_DEBUG"),
               *lut = getenv("DSV4_CUDA_MOE_LUT"), *geom = getenv("DSV4_CUDA_MOE_B1G"),
               *bn = getenv("DSV4_CUDA_MOE_BN");
    d->bn = bn && bn[0] == '0' ? 0 : bn && bn[0] == '2' ? 2 : 1;
    const char *bnr = getenv("DSV4_CUDA_MOE_BNR");
    char *bnr_end = NULL;
    long bnr_v = bnr ? strtol(bnr, &bnr_end, 10) : 0;
    d->bnr = bnr && bnr_end != bnr && !*bnr_end && bnr_v >= 0 && bnr_v <= 15 ? (int)bnr_v : BN_ROLL_DEFAULT;
    const char *hr = getenv("DSV4_CUDA_MOE_HREC");
    d->hrec = !(hr && hr[0] == '0');
    /* bm2_run / bm3_run (DSV4_CUDA_MOE_BM=2 / 3): their instances' shared memory, else bm_run stays
     * (error cleared) */
    const char *bmv = getenv("DSV4_CUDA_MOE_BM");
    d->bm_form = 0;
    if (bmv && (bmv[0] == '2' || bmv[0] == '3' || bmv[0] == '4')) {
        int form = bmv[0] - '0', three = form >= 3;
        const void *b2f[2] = {three ? (const void *)bm3_kernel(1, form)
                                    : (const void *)k_moe_b1r<1, 2, 4, 2, BM2_M, 2, 2>,
                              three ? (const void *)bm3_kernel(0, form)
                                    : (const void *)k_moe_b1r<0, 2, 4, 2, BM2_M, 2, 2>};
        int ok = 1;
        for (int i = 0; i < 2 && ok; i++)
            ok = cudaFuncSetAttribute(b2f[i], cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      three ? bm3_smem(1 - i, form == 4) : bm2_smem(1 - i)) == cudaSuccess &&
                 cudaFuncSetAttribute(b2f[i], cudaFuncAttributePreferredSharedMemoryCarveout,
                                      cudaSharedmemCarveoutMaxShared) == cudaSuccess;
        if (!ok) (void)cudaGetLastError();
        d->bm_form = ok ? form : 0;
    }
    if (off && off[0] == '0') return -1; /* switched off for this process (A/B runs) */
    /* one row: k_moe_b1r / k_moe_b1_prev (1 + the geometry) unless DSV4_CUDA_MOE_BULK=2 asks for k_moe_bulk (A/B runs) */
    int gi = geom ? atoi(geom) : 0;
    if (gi < 0 || gi >= B1_NGEOM) gi = 0;
    d->b1 = off && off[0] == '2' ? 0 : 1 + (lut && lut[0] == '1' ? (int)B1_LUT : gi);
    if (dbg && dbg[0] == '1')
        fprintf(stderr, "cuda moe: k_moe_bulk %d + %d x %zu B shared, %d blocks per SM, %d SMs\n",
                MB_STAGES * (MB_TILE + MB_SCALE), (int)MB_MAXG, sizeof(mb_group), occ, nsm);
    return occ > 0 && nsm > 0 ? nsm * occ : -1;
}

/* The device table of (experts, shared), built on first use (uploading weights that
 * load_weights did not); NULL on failure (sticky error set). */
static moe_table *expert_table(dsv4_backend *b, const dsv4_ffn_w *experts, int n_routed, const dsv4_ffn_w *shared) {
    cuda_devside *d = devside(b);
    if (!d) return NULL;
    moe_table *t = NULL;
    for (int i = 0; i < d->n_tab && !t; i++)
        if (d->tab[i].key == experts && d->tab[i].shared == shared && d->tab[i].n_routed == n_routed) t = &d->tab[i];
    /* the common case (every call after the first): one compare per weight, no allocation */
    if (t && same_ids(t->ids, experts, n_routed, shared)) return t;
    size_t ni = 3 * (size_t)(n_routed + 1);
    const void **ids = (const void **)malloc(sizeof(void *) * ni);
    if (!ids) {
        dsv4_cuda_fail(b, "moe: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return NULL;
    }
    expert_ids(experts, n_routed, shared, ids);
    if (!t) {
        if (d->n_tab == d->cap_tab) {
            int cap = d->cap_tab ? 2 * d->cap_tab : 64;
            moe_table *nt = (moe_table *)realloc(d->tab, sizeof *nt * (size_t)cap);
            if (!nt) {
                free(ids);
                dsv4_cuda_fail(b, "moe: out of host memory", __FILE__, __LINE__, cudaSuccess);
                return NULL;
            }
            d->tab = nt;
            d->cap_tab = cap;
        }
        t = &d->tab[d->n_tab++];
        memset(t, 0, sizeof *t);
    } else { /* same host array, other weights (a freed and reused array): rebuild */
        cudaFree(t->dev);
        free(t->ids);
        t->dev = NULL;
        t->ids = NULL;
    }
    t->key = experts;
    t->shared = shared;
    t->n_routed = n_routed;
    t->ids = ids;
    dsv4_cuda_seg_end(b); /* (re)build: an allocation and a copy from pageable memory, not capturable */
    dexpert *h = (dexpert *)calloc((size_t)n_routed + 1, sizeof *h);
    if (!h) {
        d->n_tab--; /* t is the last entry or a rebuilt one; drop it either way */
        if (t != &d->tab[d->n_tab]) *t = d->tab[d->n_tab];
        free(ids);
        dsv4_cuda_fail(b, "moe: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return NULL;
    }
    int bad = 0;
    const dsv4_weight *r1 = &experts[0].w1, *r2 = &experts[0].w2;
    t->inter = r1->rows;
    t->dim = r1->cols;
    t->w2_quant = quantized(r2->fmt);
    t->q8_fit = 1;
    for (int x = 0; x <= n_routed && !bad; x++) {
        const dsv4_ffn_w *f = x < n_routed ? &experts[x] : shared;
        if (!f) continue;
        if (x < n_routed && (f->w1.rows != r1->rows || f->w1.cols != r1->cols || f->w2.fmt != r2->fmt ||
                             f->w2.rows != r2->rows || f->w2.cols != r2->cols)) {
            dsv4_cuda_fail(b, "moe: routed experts differ in shape or w2 format (not supported)", __FILE__, __LINE__,
                           cudaSuccess);
            bad = 1;
            break;
        }
        if (dsv4_cuda_weight(b, &f->w1, &h[x].w1) || dsv4_cuda_weight(b, &f->w3, &h[x].w3) ||
            dsv4_cuda_weight(b, &f->w2, &h[x].w2)) {
            bad = 1;
            break;
        }
        h[x].bytes = wb(&f->w1) + wb(&f->w2) + wb(&f->w3);
        if (x == 0) t->bulk = 1;
        const dweight &a = h[x].w1, &c3 = h[x].w3;
        t->bulk &= mb_ok(&a, 1) && mb_ok(&c3, 1) && mb_ok(&h[x].w2, 0) && a.fmt == c3.fmt && a.cols == c3.cols &&
                   a.rows == c3.rows && a.block == c3.block && a.scale_f32 == c3.scale_f32;
        h[x].q1 = quantized(f->w1.fmt);
        if (x < n_routed) t->q1_any |= h[x].q1;
        t->q8_fit &= q8_takes(&f->w1, h[x].w1, 8) && q8_takes(&f->w3, h[x].w3, 8) && q8_takes(&f->w2, h[x].w2, 16) &&
                     f->w1.fmt == f->w3.fmt && f->w1.cols == t->dim && f->w2.cols == f->w1.rows;
    }
    if (!bad && t->bulk && !d->mb_grid) d->mb_grid = mb_setup(b, d);
    t->bn_fit = !bad && t->bulk;
    for (int x = 0; x <= n_routed && t->bn_fit; x++) {
        const dsv4_ffn_w *f = x < n_routed ? &experts[x] : shared;
        if (f) t->bn_fit &= b1_fits(&f->w1, BN_M) && b1_fits(&f->w3, BN_M) && b1_fits(&f->w2, BN_M);
    }
    t->q8_fit &= !bad;
    t->mma_fit = !bad && t->bulk;
    for (int x = 0; x < n_routed && t->mma_fit; x++)
        t->mma_fit &= experts[x].w1.fmt == DSV4_WF_MXFP4 && experts[x].w3.fmt == DSV4_WF_MXFP4 &&
                      experts[x].w2.fmt == DSV4_WF_MXFP4;
    t->b1_fit = 0;
    if (!bad && t->bulk && d->b1 > 0) {
        const b1_geom &g = b1_geoms[d->b1 - 1];
        t->b1_fit = 1;
        for (int x = 0; x <= n_routed; x++) {
            const dsv4_ffn_w *f = x < n_routed ? &experts[x] : shared;
            if (f)
                t->b1_fit &= (!g.fmt_up || (b1_fits(&f->w1, g.mup) && b1_fits(&f->w3, g.mup))) &&
                             (!g.fmt_dn || b1_fits(&f->w2, g.mdn));
        }
    }
    if (!bad && !CK(b, cudaMalloc((void **)&t->dev, sizeof *h * ((size_t)n_routed + 1))) &&
        !CK(b, cudaMemcpyAsync(t->dev, h, sizeof *h * ((size_t)n_routed + 1), cudaMemcpyHostToDevice,
                               CI(b)->stream))) { /* pageable source: taken before this returns */
        free(h);
        return t;
    }
    free(h);
    if (t->dev) cudaFree(t->dev);
    free(t->ids);
    d->n_tab--;
    if (t != &d->tab[d->n_tab]) *t = d->tab[d->n_tab];
    return NULL;
}

void dsv4_cuda_moe_combine(dsv4_backend *b, float *out, const float *y, int64_t dim, int rows, int k,
                           const int32_t *order, const float *cw, int nrs, int has_shared, float out_scale,
                           int act_bf16, int unrolled) {
    unsigned ncb = (unsigned)(((int64_t)rows * dim + 255) / 256);
    if (unrolled)
        dsv4_launch(k_moe_combine_u, ncb, 256, 0, CI(b)->stream, out, y, dim, rows, k, order, cw, nrs, has_shared,
                    out_scale, act_bf16);
    else
        dsv4_launch(k_moe_combine, ncb, 256, 0, CI(b)->stream, out, y, dim, rows, k, order, cw, nrs, has_shared,
                    out_scale, act_bf16);
}

/* ----- the combine into hc (DSV4_CUDA_HC_COMB=1) -----
 * At a decode step the MoE's combine (k_moe_combine_u: 16 blocks, one launch a layer) is the
 * kernel right before the fused hc_post_pre_norm that reads its out as o.  With the switch on,
 * the moe op leaves the combine pending instead of launching it; if the very next backend call
 * is that hc_post_pre_norm on k_hc_dec, it takes the combine's arguments and k_hc_dec forms o
 * itself with the same arithmetic (moe_comb4: the bits of k_moe_combine_u), writing out as
 * well.  Any other call launches the combine first (dsv4_cuda_comb_flush: every op's begin,
 * copies, frees, segment ends, waits, side chains, checks), so what any op or the host reads
 * is what the combine would have written.  The combine's inputs (y, order, cw) live in the moe
 * op's scratch: the arena's reset at the taker's begin keeps them (scratch_floor).  Left to
 * launch as before: timed (profiled) runs, an open side chain, out in host memory, k > 8,
 * rows > 4, an arena about to grow or spill. */
int dsv4_cuda_comb_defer(dsv4_backend *b, const moe_comb *m, int64_t dim, int rows, int unrolled) {
    cuda_impl *c = CI(b);
    if (!c->hc_comb || c->failed || c->timing || c->side_state || !unrolled || m->k > 8 || rows < 1 || rows > 4 ||
        dim % 4 || !dsv4_cuda_is_dev(b, m->out) || c->n_spill || c->scratch_want > c->scratch_cap ||
        c->scratch_top > c->scratch_cap)
        return 0;
    auto &p = c->comb_pend;
    p.on = 1;
    p.m = *m;
    p.dim = dim, p.rows = rows;
    p.keep = c->scratch_top;
    return 1;
}

void dsv4_cuda_comb_flush(dsv4_backend *b) {
    cuda_impl *c = CI(b);
    auto &p = c->comb_pend;
    if (!p.on) return;
    p.on = 0;
    if (c->failed) return;
    c->hc_comb_flushed++;
    const moe_comb &m = p.m;
    dsv4_cuda_moe_combine(b, m.out, m.y, p.dim, p.rows, m.k, m.order, m.cw, m.nrs, m.has_shared, m.out_scale,
                          m.act_bf16, 1);
    CKL(b);
}

int dsv4_cuda_comb_take(dsv4_backend *b, const float *o, int rows, int64_t dim, moe_comb *m) {
    cuda_impl *c = CI(b);
    auto &p = c->comb_pend;
    if (!p.on || c->failed || p.m.out != o || p.rows != rows || p.dim != dim || c->side_state || c->n_spill ||
        c->scratch_want > c->scratch_cap)
        return 0; /* the caller's op_begin launches it */
    *m = p.m;
    p.on = 0;
    c->scratch_floor = p.keep; /* the next reset (the taker's op_begin) keeps y, order and cw */
    c->hc_comb_taken++;
    return 1;
}

void dsv4_cuda_set_hc_comb(dsv4_backend *b, int on) {
    dsv4_cuda_comb_flush(b);
    CI(b)->hc_comb = on != 0;
}

void dsv4_cuda_hc_comb_counts(dsv4_backend *b, long *taken, long *flushed) {
    *taken = CI(b)->hc_comb_taken;
    *flushed = CI(b)->hc_comb_flushed;
}

/* The moe op on the slot kernels, after its expert table t (cu_moe, cu_route_moe): stages, plans,
 * runs the experts and the combine, and commits out; the caller ends the op (0) or not (1: a
 * failure, sticky error set).  ra NULL: the plan reads the ids and weights e / wgt (k_moe_plan_w
 * or k_moe_plan); else ra is a staged route call (route_stage: a warp router, npl 8 or 16, or one
 * row of hash ids, hd) whose outputs are the ids and weights (e / wgt unused), and one launch
 * routes and plans: k_route_plan_h (hash ids), k_route_plan_1 (one row of <= 256 experts, unless
 * DSV4_CUDA_RP1=0) or k_route_plan_w (the caller checked ds->small, rows <= RP_WARPS and rows * k
 * <= 32).  Only that launch
 * differs: the same scratch in the same order, the same kernels after it. */
static int moe_body(dsv4_backend *b, moe_table *t, float *out, const float *x, int rows, const dsv4_ffn_w *experts,
                    int n_routed, const int32_t *e, const float *wgt, int k, const dsv4_ffn_w *shared, float limit,
                    int before_w2, int act_fp8, int act_bf16, float out_scale, const route_dev *ra, int dot_mma) {
    cuda_impl *c = CI(b);
    int any_q = act_fp8 && (t->q1_any || (shared && quantized(shared->w1.fmt)));
    int nrs = rows * k, S = nrs + (shared ? rows : 0);
    int64_t dim = shared ? shared->w1.cols : t->dim;
    int64_t inter_max = t->inter;
    if (shared && shared->w1.rows > inter_max) inter_max = shared->w1.rows;
    /* 2..BN_ROWS rows with FP4/FP8 experts that k_moe_bnr takes (and its shared memory fits):
     * groups of <= BN_G slots; vec (aligned x, xq, h) is checked below */
    cuda_devside *ds0 = c->devside;
    size_t bn_smu = BN_SMEM(2, BN_G) + (size_t)BN_G * dim * sizeof(float),
           bn_smd = BN_SMEM(1, BN_G) + (size_t)BN_G * inter_max * sizeof(float);
    int bn_want = rows >= 2 && rows <= BN_ROWS && ds0 && ds0->bn > 0 && ds0->mb_grid > 0 && t->bulk && t->bn_fit &&
                  bn_smu <= (size_t)ds0->bn_smem && bn_smd <= (size_t)ds0->bn_smem;
    int bn_g = bn_want && ds0->bn == 1 ? BN_G : 1; /* DSV4_CUDA_MOE_BN=2: groups of one slot */
    /* an upper bound of the group count from shapes alone (the plan writes the real one): an
     * expert's c slots make ceil(c / g) <= 1 + c / g groups, the shared expert's rows ceil(rows / g) */
    int max_groups = S / (bn_want ? bn_g : MOE_G) + (n_routed < nrs ? n_routed : nrs) + 2;
    size_t plan_smem = sizeof(int) * (3 * (size_t)n_routed + 1);
    if (plan_smem > 48 * 1024 &&
        CK(b, cudaFuncSetAttribute(k_moe_plan, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)plan_smem)))
        return 1;
    const int32_t *ed = ra ? ra->ed : (const int32_t *)dsv4_cuda_in(b, e, sizeof(int32_t) * nrs);
    const float *wd = ra ? ra->wd : (const float *)dsv4_cuda_in(b, wgt, sizeof(float) * nrs);
    group *gd = (group *)dsv4_cuda_scratch(b, sizeof(group) * (size_t)max_groups);
    int *ngd = (int *)dsv4_cuda_scratch(b, sizeof(int));
    int32_t *orderd = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * nrs);
    float *cwd = (float *)dsv4_cuda_scratch(b, sizeof(float) * nrs);
    int32_t *sorted = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * nrs);
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * rows * dim);
    float *xq = any_q ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * dim) : xd;
    float *h = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * inter_max);
    float *y = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * dim);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * rows * dim);
    cuda_devside *ds = c->devside;
    if (!ed || !wd || !gd || !ngd || !orderd || !cwd || !sorted || !xd || !xq || !h || !y || !od || !ds) return 1;
    int vec = dim % 4 == 0 && inter_max % 4 == 0 && !(((uintptr_t)xd | (uintptr_t)xq | (uintptr_t)h) & 15);
    int bn = bn_want && vec;
    int bulk = !bn && rows <= MOE_G && t->bulk && ds->mb_grid > 0 && vec && max_groups <= MB_MAXG;
    /* one row takes k_moe_bulk<.., MULTI = 0>, which computes one slot per group: the plan then
     * cuts groups of one slot, so an expert id repeated in the row (a hash table may repeat
     * one) is two groups, not a dropped slot */
    int gmax = bn ? bn_g : bulk && rows == 1 ? 1 : MOE_G;
    if (ra && ra->hd) { /* one row of hash ids (cu_route_moe admits no other): one warp */
        dsv4_launch(k_route_plan_h, 1, 32, 0, c->stream, ra->ed, ra->wd, ra->ld, n_routed, ra->hd, ra->scale, gd, ngd,
                    max_groups, orderd, cwd, k, shared != NULL, before_w2, t->dev, ds->wbytes, ds->flags, gmax);
        ds->rp_calls[DSV4_RP_HASH]++;
    } else if (ra && rows == 1 && ds->rp1 && ra->npl == 8) { /* decode batch 1 (<= 256 experts): one launch */
        dsv4_launch(k_route_plan_1<8>, 1, 32 * 8, 0, c->stream, ra->ed, ra->wd, ra->ld, n_routed, ra->bd, ra->scale,
                    gd, ngd, max_groups, orderd, cwd, k, shared != NULL, before_w2, t->dev, ds->wbytes, ds->flags,
                    gmax);
        ds->rp_calls[DSV4_RP_ONE]++;
    } else if (ra && ra->npl == 8) /* decode: route and plan in one launch */
        dsv4_launch(k_route_plan_w<8>, 1, 32 * rows, 0, c->stream, ra->ed, ra->wd, ra->ld, n_routed, ra->bd, ra->scale,
                    gd, ngd, max_groups, orderd, cwd, rows, k, shared != NULL, before_w2, t->dev, ds->wbytes, ds->flags,
                    gmax);
    else if (ra)
        dsv4_launch(k_route_plan_w<16>, 1, 32 * rows, 0, c->stream, ra->ed, ra->wd, ra->ld, n_routed, ra->bd,
                    ra->scale, gd, ngd, max_groups, orderd, cwd, rows, k, shared != NULL, before_w2, t->dev, ds->wbytes,
                    ds->flags, gmax);
    else if (ds->small && nrs <= 32) /* decode: one warp */
        dsv4_launch(k_moe_plan_w, 1, 32, 0, c->stream, gd, ngd, max_groups, orderd, cwd, ed, wd, rows, k, n_routed,
                    shared != NULL, before_w2, t->dev, ds->wbytes, ds->flags, gmax);
    else
        dsv4_launch(k_moe_plan, 1, 1024, plan_smem, c->stream, gd, ngd, max_groups, orderd, cwd, sorted, ed, wd, rows,
                    k, n_routed, shared != NULL, before_w2, t->dev, ds->wbytes, ds->flags, gmax);
    if (CKL(b)) return 1;
    if (shared) /* the routed experts' bytes are counted by the plan, on the device */
        c->weight_bytes_read += (wb(&shared->w1) + wb(&shared->w2) + wb(&shared->w3)) * (size_t)((rows + gmax - 1) / gmax);
    /* Geometry (as k_linear's): a warp takes OPW features; while that gives fewer than ~8K
     * warps over the groups expected (one per distinct routed expert plus the shared ones),
     * kw = 2, 4 or 8 warps of a block split each K while every warp keeps >= 2 steps of
     * 32 16-byte vectors.  NS: a group's slots per pass, from the batch (one row: 1). */
    int ns = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : 8;
    int64_t est_groups = (n_routed < nrs ? n_routed : nrs) + (shared ? (rows + MOE_G - 1) / MOE_G : 0);
    int kw_up = moe_kw((inter_max + MOE_UP_OPW - 1) / MOE_UP_OPW * est_groups, dim / 1024);
    int kw_dn = moe_kw((dim + MOE_DOWN_OPW - 1) / MOE_DOWN_OPW * est_groups, t->inter / 1024);
    dim3 gup((unsigned)((inter_max + MOE_UP_OPW * (8 / kw_up) - 1) / (MOE_UP_OPW * (8 / kw_up))), max_groups);
    dim3 gdn((unsigned)((dim + MOE_DOWN_OPW * (8 / kw_dn) - 1) / (MOE_DOWN_OPW * (8 / kw_dn))), max_groups);
    int mb_smem = MB_STAGES * (MB_TILE + MB_SCALE) + max_groups * (int)sizeof(mb_group);
    ds->mb_calls += bulk || (bn && rows <= MOE_G);
    ds->bn_calls += bn;
    /* k_moe_bnr: the grid of k_moe_b1r's blocks over a bound of the routed groups (each has >= 1
     * slot; an expert's c slots make <= 1 + c / g groups) and the shared expert's groups */
    int bn_cru = 0, bn_crd = 0, bn_csu = 0, bn_csd = 0, bn_hsg = 0;
    unsigned bn_gu = 0, bn_gd = 0;
    if (bn) {
        const dsv4_weight *r2 = &experts[0].w2;
        bn_cru = (int)b1_chunks(&experts[0].w1, t->inter, BN_M);
        bn_crd = (int)b1_chunks(r2, r2->rows < dim ? r2->rows : dim, BN_M);
        if (shared) {
            bn_csu = (int)b1_chunks(&shared->w1, shared->w1.rows, BN_M);
            bn_csd = (int)b1_chunks(&shared->w2, shared->w2.rows < dim ? shared->w2.rows : dim, BN_M);
            bn_hsg = (rows + gmax - 1) / gmax;
        }
        int nrb = n_routed + nrs / gmax < nrs ? n_routed + nrs / gmax : nrs;
        bn_gu = (unsigned)(nrb * bn_cru + bn_hsg * bn_csu);
        bn_gd = (unsigned)(nrb * bn_crd + bn_hsg * bn_csd);
    }
    int b1 = bulk && rows == 1 && ds->b1 > 0; /* one row: k_moe_b1 / k_moe_b1_prev (b1_geoms) */
    const b1_geom *bg = b1 ? &b1_geoms[ds->b1 - 1] : NULL;
    if (bg && (bg->fmt_up || bg->fmt_dn) && !t->b1_fit) /* FP8 scale blocks that k_moe_b1r does not take */
        bg = &b1_geoms[B1_PREV];
    /* moe.dot=e4m3 (under linear.act=fp8): k_moe_q8 on the records of k_moe_q8x */
    int q8 = (dot_mma & DSV4_MOE_DOT_E4M3) && act_fp8 && b1 && t->q8_fit && dim % 128 == 0;
    uint8_t *q8x = NULL, *q8h = NULL;
    int64_t ldq8x = 2 * dim + dim / 128 * 4, ldq8h = 2 * inter_max + inter_max / 128 * 4;
    int q8_cru = 0, q8_csu = 0, q8_crd = 0, q8_csd = 0;
    if (q8 && ((ldq8x + 15) / 16 * 16 > 48 * 1024 || (ldq8h + 15) / 16 * 16 > 48 * 1024)) q8 = 0; /* the record in shared memory */
    if (q8) {
        ldq8x = (ldq8x + 15) / 16 * 16, ldq8h = (ldq8h + 15) / 16 * 16;
        q8x = (uint8_t *)dsv4_cuda_scratch(b, (size_t)(rows * ldq8x));
        q8h = (uint8_t *)dsv4_cuda_scratch(b, (size_t)(S * ldq8h));
        if (!q8x || !q8h) return 1;
        int64_t rdn = experts[0].w2.rows < dim ? experts[0].w2.rows : dim;
        q8_cru = (int)((t->inter + Q8_FEAT_UP - 1) / Q8_FEAT_UP), q8_crd = (int)((rdn + Q8_ROWS_DN - 1) / Q8_ROWS_DN);
        if (shared) {
            int64_t sdn = shared->w2.rows < dim ? shared->w2.rows : dim;
            q8_csu = (int)((shared->w1.rows + Q8_FEAT_UP - 1) / Q8_FEAT_UP);
            q8_csd = (int)((sdn + Q8_ROWS_DN - 1) / Q8_ROWS_DN);
        }
        ds->q8_calls++;
    }
    if (any_q && !q8) dsv4_cuda_act_quant(b, xq, xd, rows, dim, 128);
    /* moe.dot=mma: geometry 0's k_moe_b1r with MMA = 1, with the B records of its inputs */
    int mma = !q8 && (dot_mma & DSV4_MOE_DOT_MMA) && b1 && bg == &b1_geoms[0] && t->mma_fit && dim % 32 == 0 && inter_max % 32 == 0;
    int64_t ldfu = dim / 32 * 13, ldfd = inter_max / 32 * 13; /* 13 uint4 a 32-wide block */
    /* gate/up writes h's records itself (no k_moe_xsplit of h) where its blocks hold whole
     * 32-wide blocks of features (dim <= 4096: 4096 / (dim / 32) x 16 features a block; bm_run),
     * h is not act-quantized after it, and a shared expert whose w2 takes bm_run had its gate/up
     * there too; DSV4_CUDA_MOE_HREC=0 keeps the launch (A/B runs) */
    int hrec = mma && ds->hrec && !act_fp8 && dim <= 4096 &&
               (!shared || shared->w2.fmt != DSV4_WF_MXFP4 || shared->w1.fmt == DSV4_WF_MXFP4);
    /* bm2_run / bm3_run (DSV4_CUDA_MOE_BM=2 / 3) where their shapes fit: the routed experts (and an
     * MXFP4 shared one) at K 4096 / 2048; an FP8 shared expert on b1f_run at the form's M (bm2_run
     * 32, bm3_run the default geometry's 16, which b1 already checked) */
    int fm = ds->bm_form == 2 ? (int)BM2_M : (int)B1_MUP;
    int mma2 = mma && ds->bm_form && dim == BM2_CV_UP * 32 && t->inter == BM2_CV_DN * 32 &&
               experts[0].w2.rows >= dim &&
               (!shared || (shared->w1.rows == t->inter && shared->w2.rows >= dim &&
                            (shared->w1.fmt == DSV4_WF_MXFP4 ||
                             (b1_fits(&shared->w1, fm) && b1_fits(&shared->w2, fm)))));
    uint4 *xfu = NULL, *xfd = NULL;
    if (mma) {
        xfu = (uint4 *)dsv4_cuda_scratch(b, sizeof(uint4) * (size_t)(rows * ldfu));
        xfd = (uint4 *)dsv4_cuda_scratch(b, sizeof(uint4) * (size_t)(S * ldfd));
        if (!xfu || !xfd) return 1;
        ds->mma_calls++;
        ds->bm_form_calls += mma2;
    }
    unsigned b1_up = 0, b1_dn = 0;
    int b1_cru = 0, b1_csu = 0, b1_crd = 0, b1_csd = 0, b1_hs = shared != NULL; /* k_moe_b1r's chunk counts */
    dim3 b1_gu, b1_gd;
    if (b1) { /* chunks of the routed and the shared expert's features, the larger */
        const dsv4_weight *r2 = &experts[0].w2;
        b1_up = b1_chunks(&experts[0].w1, t->inter, bg->mup);
        b1_dn = b1_chunks(r2, r2->rows < dim ? r2->rows : dim, bg->mdn);
        b1_cru = (int)b1_up, b1_crd = (int)b1_dn;
        if (shared) {
            unsigned su = b1_chunks(&shared->w1, shared->w1.rows, bg->mup),
                     sd = b1_chunks(&shared->w2, shared->w2.rows < dim ? shared->w2.rows : dim, bg->mdn);
            b1_csu = (int)su, b1_csd = (int)sd;
            b1_up = su > b1_up ? su : b1_up;
            b1_dn = sd > b1_dn ? sd : b1_dn;
        }
        /* k_moe_b1r: the real blocks (one row: at most nrs routed groups of one slot, then the
         * shared one); the others: the larger chunk count x max_groups */
        b1_gu = bg->real ? dim3((unsigned)(nrs * b1_cru + b1_csu)) : dim3(b1_up, max_groups);
        b1_gd = bg->real ? dim3((unsigned)(nrs * b1_crd + b1_csd)) : dim3(b1_dn, max_groups);
    }
    /* k_moe_b1_prev's arguments, in its parameter order and types */
    const group *b1g = gd;
    const int *b1n = ngd;
    const dexpert *b1t = t->dev;
    const float *b1x = xd, *b1xq = xq;
    void *b1a[] = {&b1g, &b1n, &b1t, &b1x, &b1xq, &h, &inter_max, &y, &dim, &act_fp8, &limit, &act_bf16};
    /* k_moe_b1r's: the same, then its chunk counts (gate/up, down), hs and MMA's records (none) */
    const uint4 *b1xf = NULL;
    uint4 *b1hf = NULL;
    int64_t b1ld = 0;
    void *b1ru[] = {&b1g, &b1n, &b1t, &b1x, &b1xq, &h, &inter_max, &y, &dim, &act_fp8, &limit, &act_bf16,
                    &b1_cru, &b1_csu, &b1_hs, &b1xf, &b1ld, &b1hf, &b1ld};
    void *b1rd[] = {&b1g, &b1n, &b1t, &b1x, &b1xq, &h, &inter_max, &y, &dim, &act_fp8, &limit, &act_bf16,
                    &b1_crd, &b1_csd, &b1_hs, &b1xf, &b1ld, &b1hf, &b1ld};
    if (bn) {
        dsv4_launch(bnr_kernel<1, 1, 4>(ds->bnr), bn_gu, 256, (size_t)B1F_SMEM(BN_S, BN_V, BN_M, 2),
                    c->stream, gd, ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16,
                    bn_cru, bn_csu, bn_hsg);
        if (gmax > 1 && !CKL(b))
            dsv4_launch(bnr_kernel<1, BN_G, 2>(ds->bnr), bn_gu, 256, bn_smu, c->stream, gd, ngd, t->dev, xd,
                        xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, bn_cru, bn_csu, bn_hsg);
    } else if (q8) {
        dsv4_launch(k_moe_q8x, dim3((unsigned)((dim + 1023) / 1024), (unsigned)rows), 256, 0, c->stream, q8x, ldq8x,
                    (const float *)xd, dim, rows, (int)dim, (int)dim);
        if (!CKL(b))
            dsv4_launch(k_moe_q8<1>, dim3((unsigned)(nrs * q8_cru + q8_csu)), 256, (size_t)ldq8x, c->stream, (const group *)gd,
                        (const int *)ngd, (const dexpert *)t->dev, (const uint8_t *)q8x, ldq8x, h, inter_max, y, dim,
                        limit, act_bf16, q8_cru, q8_csu, shared != NULL);
    } else if (mma) {
        /* the MXFP4 groups read x (xq under act_fp8: MXFP4 weights are quantized) */
        const float *xsrc = act_fp8 && t->q1_any ? xq : xd;
        dsv4_launch(k_moe_xsplit, dim3((unsigned)((dim + 255) / 256), (unsigned)rows), 256, 0, c->stream, xfu, ldfu,
                    xsrc, dim, rows, (int)dim, (int)dim);
        if (!CKL(b) && mma2 && ds->bm_form >= 3) /* bm3_run, its records staged at 4 */
            dsv4_launch(bm3_kernel(1, ds->bm_form), b1_gu, 256, (size_t)bm3_smem(1, ds->bm_form == 4), c->stream, gd,
                        ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, b1_cru, b1_csu, b1_hs,
                        (const uint4 *)xfu, ldfu, hrec ? xfd : (uint4 *)NULL, ldfd);
        else if (!CKL(b) && mma2) {
            int cru = (int)b1_chunks(&experts[0].w1, t->inter, BM2_M),
                csu = shared ? (int)b1_chunks(&shared->w1, shared->w1.rows, BM2_M) : 0;
            dsv4_launch(k_moe_b1r<1, 2, 4, 2, BM2_M, 2, 2>, dim3((unsigned)(nrs * cru + csu)), 256, (size_t)bm2_smem(1),
                        c->stream, gd, ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, cru, csu,
                        b1_hs, (const uint4 *)xfu, ldfu, hrec ? xfd : (uint4 *)NULL, ldfd);
        } else if (!CKL(b))
            dsv4_launch(k_moe_b1r<1, 2, 4, 2, B1_MUP, 4, 1>, b1_gu, 256, (size_t)bm_smem(1), c->stream, gd, ngd, t->dev, xd, xq, h, inter_max,
                        y, dim, act_fp8, limit, act_bf16, b1_cru, b1_csu, b1_hs, (const uint4 *)xfu, ldfu,
                        hrec ? xfd : (uint4 *)NULL, ldfd);
    } else if (b1)
        CK(b, dsv4_launch_ptr(bg->up, b1_gu, dim3(256), bg->real ? b1ru : b1a, (size_t)bg->smem_up, c->stream));
    else if (bulk && rows == 1)
        dsv4_launch(k_moe_bulk<1, 0>, ds->mb_grid, 256, mb_smem, c->stream, gd, ngd, max_groups, t->dev, xd, xq, h,
                    inter_max, y, dim, act_fp8, limit, act_bf16);
    else if (bulk)
        dsv4_launch(k_moe_bulk<1, 1>, ds->mb_grid, 256, mb_smem, c->stream, gd, ngd, max_groups, t->dev, xd, xq, h,
                    inter_max, y, dim, act_fp8, limit, act_bf16);
    else switch (ns) {
        case 1:
            dsv4_launch(k_moe_up<1>, gup, 256, 0, c->stream, h, inter_max, xd, xq, dim, gd, ngd, t->dev, act_fp8, limit,
                        act_bf16, kw_up, vec);
            break;
        case 2:
            dsv4_launch(k_moe_up<2>, gup, 256, 0, c->stream, h, inter_max, xd, xq, dim, gd, ngd, t->dev, act_fp8, limit,
                        act_bf16, kw_up, vec);
            break;
        case 4:
            dsv4_launch(k_moe_up<4>, gup, 256, 0, c->stream, h, inter_max, xd, xq, dim, gd, ngd, t->dev, act_fp8, limit,
                        act_bf16, kw_up, vec);
            break;
        default:
            dsv4_launch(k_moe_up<8>, gup, 256, 0, c->stream, h, inter_max, xd, xq, dim, gd, ngd, t->dev, act_fp8, limit,
                        act_bf16, kw_up, vec);
            break;
    }
    if (CKL(b)) return 1;
    if (q8) { /* h's records: each slot over its own width (routed and shared may differ) */
        dsv4_launch(k_moe_q8x, dim3((unsigned)((inter_max + 1023) / 1024), (unsigned)S), 256, 0, c->stream, q8h, ldq8h,
                    (const float *)h, inter_max, nrs, (int)t->inter, (int)(shared ? shared->w1.rows : t->inter));
        if (!CKL(b))
            dsv4_launch(k_moe_q8<0>, dim3((unsigned)(nrs * q8_crd + q8_csd)), 256, (size_t)ldq8h, c->stream, (const group *)gd,
                        (const int *)ngd, (const dexpert *)t->dev, (const uint8_t *)q8h, ldq8h, h, inter_max, y, dim,
                        limit, act_bf16, q8_crd, q8_csd, shared != NULL);
    } else if (act_fp8) { /* h of each slot quantized over its own width (routed and shared may differ) */
        int64_t ri = t->inter;
        int sq = shared && quantized(shared->w2.fmt);
        /* routed and shared rows in one launch where both are inter_max wide (without bit 8 of DSV4_CUDA_AQ_FUSE: two, as before) */
        if ((dsv4_cuda_aq_fuse() & DSV4_CUDA_AQ_MOE) && t->w2_quant && sq && ri == inter_max && shared->w1.rows == inter_max) {
            dsv4_cuda_act_quant(b, h, h, nrs + rows, ri, 128);
            sq = 0;
        } else if (t->w2_quant) {
            if (ri == inter_max)
                dsv4_cuda_act_quant(b, h, h, nrs, ri, 128);
            else
                for (int i = 0; i < nrs; i++)
                    dsv4_cuda_act_quant(b, h + (int64_t)i * inter_max, h + (int64_t)i * inter_max, 1, ri, 128);
        }
        if (sq) {
            int64_t si = shared->w1.rows;
            if (si == inter_max) /* contiguous rows: one launch */
                dsv4_cuda_act_quant(b, h + (int64_t)nrs * inter_max, h + (int64_t)nrs * inter_max, rows, si, 128);
            else
                for (int r = 0; r < rows; r++)
                    dsv4_cuda_act_quant(b, h + (int64_t)(nrs + r) * inter_max, h + (int64_t)(nrs + r) * inter_max, 1,
                                        si, 128);
        }
    }
    if (q8) {
    } else if (bn) {
        dsv4_launch(bnr_kernel<0, 1, 4>(ds->bnr), bn_gd, 256, (size_t)B1F_SMEM(BN_S, BN_V, BN_M, 1),
                    c->stream, gd, ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16,
                    bn_crd, bn_csd, bn_hsg);
        if (gmax > 1 && !CKL(b))
            dsv4_launch(bnr_kernel<0, BN_G, 2>(ds->bnr), bn_gd, 256, bn_smd, c->stream, gd, ngd, t->dev, xd,
                        xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, bn_crd, bn_csd, bn_hsg);
    } else if (mma) {
        /* h's records: written by gate/up (hrec), else here (routed slots over the routed width,
         * the shared rows over theirs; after act_quant's h under act_fp8) */
        if (!hrec)
            dsv4_launch(k_moe_xsplit, dim3((unsigned)((inter_max + 255) / 256), (unsigned)S), 256, 0, c->stream, xfd,
                        ldfd, (const float *)h, inter_max, nrs, (int)t->inter,
                        (int)(shared ? shared->w1.rows : t->inter));
        if ((hrec || !CKL(b)) && mma2 && ds->bm_form >= 3) /* bm3_run, its records staged at 4 */
            dsv4_launch(bm3_kernel(0, ds->bm_form), b1_gd, 256, (size_t)bm3_smem(0, ds->bm_form == 4), c->stream, gd,
                        ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, b1_crd, b1_csd, b1_hs,
                        (const uint4 *)xfd, ldfd, (uint4 *)NULL, (int64_t)0);
        else if ((hrec || !CKL(b)) && mma2) {
            int crd = (int)b1_chunks(&experts[0].w2, dim, BM2_M),
                csd = shared ? (int)b1_chunks(&shared->w2, dim, BM2_M) : 0;
            dsv4_launch(k_moe_b1r<0, 2, 4, 2, BM2_M, 2, 2>, dim3((unsigned)(nrs * crd + csd)), 256, (size_t)bm2_smem(0),
                        c->stream, gd, ngd, t->dev, xd, xq, h, inter_max, y, dim, act_fp8, limit, act_bf16, crd, csd,
                        b1_hs, (const uint4 *)xfd, ldfd, (uint4 *)NULL, (int64_t)0);
        } else if (hrec || !CKL(b))
            dsv4_launch(k_moe_b1r<0, 2, 4, 2, B1_MUP, 4, 1>, b1_gd, 256, (size_t)bm_smem(0), c->stream, gd, ngd, t->dev, xd, xq, h, inter_max,
                        y, dim, act_fp8, limit, act_bf16, b1_crd, b1_csd, b1_hs, (const uint4 *)xfd, ldfd,
                        (uint4 *)NULL, (int64_t)0);
    } else if (b1)
        CK(b, dsv4_launch_ptr(bg->dn, b1_gd, dim3(256), bg->real ? b1rd : b1a, (size_t)bg->smem_dn, c->stream));
    else if (bulk && rows == 1)
        dsv4_launch(k_moe_bulk<0, 0>, ds->mb_grid, 256, mb_smem, c->stream, gd, ngd, max_groups, t->dev, xd, xq, h,
                    inter_max, y, dim, act_fp8, limit, act_bf16);
    else if (bulk)
        dsv4_launch(k_moe_bulk<0, 1>, ds->mb_grid, 256, mb_smem, c->stream, gd, ngd, max_groups, t->dev, xd, xq, h,
                    inter_max, y, dim, act_fp8, limit, act_bf16);
    else switch (ns) {
        case 1:
            dsv4_launch(k_moe_down<1>, gdn, 256, 0, c->stream, y, dim, h, inter_max, gd, ngd, t->dev, act_bf16, kw_dn,
                        vec);
            break;
        case 2:
            dsv4_launch(k_moe_down<2>, gdn, 256, 0, c->stream, y, dim, h, inter_max, gd, ngd, t->dev, act_bf16, kw_dn,
                        vec);
            break;
        case 4:
            dsv4_launch(k_moe_down<4>, gdn, 256, 0, c->stream, y, dim, h, inter_max, gd, ngd, t->dev, act_bf16, kw_dn,
                        vec);
            break;
        default:
            dsv4_launch(k_moe_down<8>, gdn, 256, 0, c->stream, y, dim, h, inter_max, gd, ngd, t->dev, act_bf16, kw_dn,
                        vec);
            break;
    }
    if (CKL(b)) return 1;
    moe_comb mc = {od, y, orderd, cwd, k, nrs, shared != NULL, act_bf16, out_scale};
    if (od != out || !dsv4_cuda_comb_defer(b, &mc, dim, rows, ds->small)) { /* else the next op's (above) */
        dsv4_cuda_moe_combine(b, od, y, dim, rows, k, orderd, cwd, nrs, shared != NULL, out_scale, act_bf16,
                              ds->small);
        if (CKL(b)) return 1;
    }
    dsv4_cuda_commit(b, out, od, sizeof(float) * rows * dim);
    return 0;
}

void cu_moe(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_ffn_w *experts, int n_routed,
            const int32_t *e, const float *wgt, int k, const dsv4_ffn_w *shared, float limit, int before_w2,
            int flags, int act_bf16, float out_scale) {
    int act_fp8 = flags & DSV4_MOE_ACT_FP8, dot_mma = flags & (DSV4_MOE_DOT_MMA | DSV4_MOE_DOT_E4M3);
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0 || n_routed <= 0) return;
    cuda_impl *c = CI(b);
    moe_table *t = expert_table(b, experts, n_routed, shared);
    if (!t) return;
    int any_q = act_fp8 && (t->q1_any || (shared && quantized(shared->w1.fmt)));
    int gmin = dsv4_cuda_moe_gemm_min_rows();
    if (gmin > 0 && rows >= gmin && dsv4_cuda_moe_gemm_takes(experts, n_routed, shared)) {
        /* many rows (prefill): the gathered GEMMs of moe_gemm.cu */
        int64_t gdim = experts[0].w1.cols;
        const int32_t *ed = (const int32_t *)dsv4_cuda_in(b, e, sizeof(int32_t) * rows * k);
        const float *wd = (const float *)dsv4_cuda_in(b, wgt, sizeof(float) * rows * k);
        float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * rows * gdim);
        float *xq = any_q ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * gdim) : xd;
        float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * rows * gdim);
        cuda_devside *ds = c->devside;
        if (!ed || !wd || !xd || !xq || !od || !ds) return;
        if (any_q) dsv4_cuda_act_quant(b, xq, xd, rows, gdim, 128);
        if (dsv4_cuda_moe_gemm(b, od, xd, xq, rows, experts, n_routed, shared, t->dev, ed, wd, k, limit, before_w2,
                               act_fp8, act_bf16, out_scale, ds->wbytes, ds->flags, DSV4_DEVFLAG_EXPERT)) {
            if (c->failed) return;
            dsv4_cuda_commit(b, out, od, sizeof(float) * rows * gdim);
            dsv4_cuda_op_end(b, DSV4_CUDA_OP_MOE);
            return;
        }
        /* not taken (an unaligned x): the kernels below, which stage and quantize again */
    }
    if (!moe_body(b, t, out, x, rows, experts, n_routed, e, wgt, k, shared, limit, before_w2, act_fp8, act_bf16,
                  out_scale, NULL, dot_mma))
        dsv4_cuda_op_end(b, DSV4_CUDA_OP_MOE);
}

/* route(...) then moe(...) (backend.h, route_moe).  Decode (the warp router without hash ids,
 * rows <= RP_WARPS and rows * k <= 32 slots: the one-warp plan; or one row of hash ids, unless
 * DSV4_CUDA_RP1=0) takes one launch for both, k_route_plan_w / _1 / _h, with the rest of moe_body
 * unchanged; any other call is the two ops. */
void cu_route_moe(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed,
                  int k, const float *bias, const int32_t *hash_ids, float route_scale, float *out, const float *x,
                  const dsv4_ffn_w *ffn, const dsv4_ffn_w *shared, float limit, int before_w2, int flags,
                  int act_bf16, float out_scale) {
    int act_fp8 = flags & DSV4_MOE_ACT_FP8;
    cuda_devside *d = CI(b)->failed ? NULL : devside(b);
    int gmin = dsv4_cuda_moe_gemm_min_rows();
    int fuse = d && small_kernels(d) && (!hash_ids || (rows == 1 && d->rp1)) && n_routed > 0 &&
               (n_routed + 31) / 32 <= 16 && k > 0 &&
               k <= 32 && rows > 0 && rows <= RP_WARPS && rows * k <= 32 &&
               !(gmin > 0 && rows >= gmin && dsv4_cuda_moe_gemm_takes(ffn, n_routed, shared));
    if (!fuse) {
        cu_route(b, experts, weights, logits, rows, n_routed, k, bias, hash_ids, route_scale);
        cu_moe(b, out, x, rows, ffn, n_routed, experts, weights, k, shared, limit, before_w2, flags, act_bf16,
               out_scale);
        return;
    }
    dsv4_cuda_op_begin(b);
    /* the order of the two ops: the bias copy, then the expert table (each may end a graph
     * capture: before any staging), then the router's staging, then the moe's */
    const float *bd;
    moe_table *t;
    route_dev r;
    if (route_bias_dev(b, d, bias, n_routed, &bd) || !(t = expert_table(b, ffn, n_routed, shared)) ||
        route_stage(b, d, &r, experts, weights, logits, rows, n_routed, k, bd, hash_ids, route_scale) ||
        moe_body(b, t, out, x, rows, ffn, n_routed, NULL, NULL, k, shared, limit, before_w2, act_fp8, act_bf16,
                 out_scale, &r, flags & (DSV4_MOE_DOT_MMA | DSV4_MOE_DOT_E4M3)))
        return;
    d->rp_calls[DSV4_RP_ALL]++;
    route_commit(b, experts, weights, &r);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROUTE_MOE);
}
