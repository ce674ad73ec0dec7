/* backend/cuda/moe.cu: router and mixture of experts (spec §2.6).
 *
 * route: one block per row: sqrt(softplus) of the logits in parallel, then k block-wide
 *   argmax rounds pick the k largest of score+bias in descending order (ties to the
 *   lower id: the CPU's sort order), or the tid2eid row is taken; thread 0 normalises
 *   in pick order like the CPU.
 * moe: the routed experts of every row and the shared expert run as "slots", all in
 *   one launch per stage:
 *   A) gate+up: one warp per (slot, inter feature) reads the w1 and w3 rows once,
 *      clamped SwiGLU, the routing weight when it applies before w2, bf16/fp8 as the
 *      profile says;  B) down: one warp per (slot, output feature);  C) combine:
 *      per row, the routed outputs summed in expert-id order (the CPU's order),
 *      times out_scale, plus the shared expert.
 *   Slots are sorted by expert and cut into groups of <= 8 slots of one expert: a
 *   group's warps stream that expert's weights once for all its slots (a prefill chunk
 *   of R rows reads each active expert ceil(slots/8) times, a decode step once).
 * Layout: x, out [rows][dim] fp32; experts' weights device-resident in stored formats.
 * Target: sm_90a.
 */
#include <stdlib.h>

#include "backend/cuda/common.cuh"

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
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += s[er[j]];
    for (int j = 0; j < k; j++) weights[(int64_t)r * k + j] = s[er[j]] / (sum + 1e-20f) * scale;
}

void cu_route(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed, int k,
              const float *bias, const int32_t *hash_ids, float scale) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0) return;
    float *ld = (float *)dsv4_cuda_in(b, logits, sizeof(float) * rows * n_routed);
    float *bd = bias ? (float *)dsv4_cuda_stage(b, bias, sizeof(float) * n_routed) : NULL;
    int32_t *hd = hash_ids ? (int32_t *)dsv4_cuda_stage(b, hash_ids, sizeof(int32_t) * rows * k) : NULL;
    int32_t *ed = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * rows * k);
    float *wd = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * k);
    if (!ld || (bias && !bd) || (hash_ids && !hd) || !ed || !wd) return;
    k_route<<<rows, 256, sizeof(float) * 3 * n_routed, CI(b)->stream>>>(ed, wd, ld, n_routed, k, bd, hd, scale);
    if (CKL(b)) return;
    dsv4_cuda_fetch(b, experts, ed, sizeof(int32_t) * rows * k);
    dsv4_cuda_fetch(b, weights, wd, sizeof(float) * rows * k);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROUTE);
}

/* ----- moe ----- */
/* A group = one expert (or the shared expert) and up to 8 of the slots that use it:
 * its weights are streamed once for all of them. */
#define MOE_G 8
struct group {
    dweight w1, w3, w2;
    int n;
    int slot[MOE_G];      /* slot ids: routed r*k+j, shared rows*k + r */
    int row[MOE_G];       /* input row of each slot */
    float pre[MOE_G];     /* multiplies h before w2 (1 when it does not apply) */
    int quant_x;          /* act_fp8 applies to w1/w3 (x quantized) */
};

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

__global__ void __launch_bounds__(256) k_moe_up(float *h, int64_t ldh, const float *x, const float *xq, int64_t dim,
                                                const group *groups, float limit, int act_bf16) {
    const group &G = groups[blockIdx.y];
    int64_t o = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= G.w1.rows) return;
    const float *xs[MOE_G];
#pragma unroll
    for (int g = 0; g < MOE_G; g++) xs[g] = (G.quant_x ? xq : x) + (int64_t)G.row[g < G.n ? g : 0] * dim;
    float ga[MOE_G], ua[MOE_G];
    warp_dot_multi(G.w1, o, xs, G.n, ga);
    warp_dot_multi(G.w3, o, xs, G.n, ua);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int g = 0; g < MOE_G; g++) {
            if (g >= G.n) break;
            float gv = ga[g], uv = ua[g];
            if (act_bf16) gv = d_round_bf16(gv), uv = d_round_bf16(uv);
            if (limit > 0) {
                gv = fminf(gv, limit);
                uv = fminf(fmaxf(uv, -limit), limit);
            }
            float v = gv / (1.0f + expf(-gv)) * uv;
            v *= G.pre[g];
            h[(int64_t)G.slot[g] * ldh + o] = act_bf16 ? d_round_bf16(v) : v;
        }
    }
}

__global__ void __launch_bounds__(256) k_moe_down(float *y, int64_t dim, const float *h, int64_t ldh,
                                                  const group *groups, int act_bf16) {
    const group &G = groups[blockIdx.y];
    int64_t d = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (d >= dim) return;
    const float *hs[MOE_G];
#pragma unroll
    for (int g = 0; g < MOE_G; g++) hs[g] = h + (int64_t)G.slot[g < G.n ? g : 0] * ldh;
    float acc[MOE_G];
    warp_dot_multi(G.w2, d, hs, G.n, acc);
    if ((threadIdx.x & 31) == 0) {
#pragma unroll
        for (int g = 0; g < MOE_G; g++) {
            if (g >= G.n) break;
            float v = acc[g];
            y[(int64_t)G.slot[g] * dim + d] = act_bf16 ? d_round_bf16(v) : v;
        }
    }
}

/* order[r*k + i]: slot of row r's i-th expert in id order; cw: its combine weight */
__global__ void k_moe_combine(float *out, const float *y, int64_t dim, int rows, int k, const int32_t *order,
                              const float *cw, int n_routed_slots, int has_shared, float out_scale, int act_bf16) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= (int64_t)rows * dim) return;
    int64_t r = t / dim, d = t % dim;
    float acc = 0.0f;
    for (int i = 0; i < k; i++) {
        int sl = order[r * k + i];
        acc += cw[r * k + i] * y[(int64_t)sl * dim + d];
    }
    float v = acc * out_scale + (has_shared ? y[(int64_t)(n_routed_slots + r) * dim + d] : 0.0f);
    out[t] = act_bf16 ? d_round_bf16(v) : v;
}

static int quantized(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

static size_t wb(const dsv4_weight *w) { return dsv4_weight_bytes(w); }

void cu_moe(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_ffn_w *experts, const int32_t *e,
            const float *wgt, int k, const dsv4_ffn_w *shared, float limit, int before_w2, int act_fp8, int act_bf16,
            float out_scale) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0) return;
    cuda_impl *c = CI(b);
    int nrs = rows * k, S = nrs + (shared ? rows : 0);
    int64_t dim = shared ? shared->w1.cols : experts[e[0]].w1.cols;
    /* slots sorted by expert (counting sort over the ids present), then cut into groups */
    int max_e = 0;
    for (int i = 0; i < nrs; i++) max_e = e[i] > max_e ? e[i] : max_e;
    int max_groups = S / MOE_G + (max_e + 1) + 2;
    size_t hb = sizeof(group) * max_groups + sizeof(int32_t) * nrs + sizeof(float) * nrs;
    uint8_t *hm = (uint8_t *)calloc(1, hb);
    int *cnt = (int *)calloc((size_t)max_e + 2, sizeof(int));
    int *sorted = (int *)malloc(sizeof(int) * (nrs ? nrs : 1));
    if (!hm || !cnt || !sorted) {
        free(hm), free(cnt), free(sorted);
        dsv4_cuda_fail(b, "moe: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    group *gr = (group *)hm;
    int32_t *order = (int32_t *)(hm + sizeof(group) * max_groups);
    float *cw = (float *)(order + nrs);
    for (int i = 0; i < nrs; i++) cnt[e[i] + 1]++;
    for (int i = 0; i <= max_e; i++) cnt[i + 1] += cnt[i];
    for (int i = 0; i < nrs; i++) sorted[cnt[e[i]]++] = i; /* stable: slots of one expert in row order */
    int ng = 0, any_q = 0, fail = 0;
    int64_t inter_max = 0;
    for (int i = 0; i < S && !fail;) {
        const dsv4_ffn_w *f = i < nrs ? &experts[e[sorted[i]]] : shared;
        group &G = gr[ng++];
        if (dsv4_cuda_weight(b, &f->w1, &G.w1) || dsv4_cuda_weight(b, &f->w3, &G.w3) ||
            dsv4_cuda_weight(b, &f->w2, &G.w2)) {
            fail = 1;
            break;
        }
        G.quant_x = act_fp8 && quantized(f->w1.fmt);
        any_q |= G.quant_x;
        if (f->w1.rows > inter_max) inter_max = f->w1.rows;
        c->weight_bytes_read += wb(&f->w1) + wb(&f->w2) + wb(&f->w3);
        G.n = 0;
        while (i < S && G.n < MOE_G) {
            int sl = i < nrs ? sorted[i] : i;
            if (i < nrs && &experts[e[sl]] != f) break;
            if (i >= nrs && f != shared) break;
            G.slot[G.n] = sl;
            G.row[G.n] = i < nrs ? sl / k : sl - nrs;
            G.pre[G.n] = (i < nrs && before_w2) ? wgt[sl] : 1.0f;
            G.n++;
            i++;
        }
    }
    free(cnt);
    free(sorted);
    if (fail) {
        free(hm);
        return;
    }
    /* each row's experts in increasing id order (stable in pick order): the CPU's summation order */
    for (int r = 0; r < rows; r++) {
        for (int i = 0; i < k; i++) order[r * k + i] = r * k + i;
        for (int i = 1; i < k; i++)
            for (int j = i; j > 0 && e[order[r * k + j - 1]] > e[order[r * k + j]]; j--) {
                int32_t t = order[r * k + j];
                order[r * k + j] = order[r * k + j - 1];
                order[r * k + j - 1] = t;
            }
        for (int i = 0; i < k; i++) cw[r * k + i] = before_w2 ? 1.0f : wgt[order[r * k + i]];
    }
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * rows * dim);
    float *xq = any_q ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * dim) : xd;
    uint8_t *md = (uint8_t *)dsv4_cuda_stage(b, hm, hb);
    float *h = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * inter_max);
    float *y = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * dim);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * rows * dim);
    free(hm);
    if (!xd || !xq || !md || !h || !y || !od) return;
    group *gd = (group *)md;
    int32_t *orderd = (int32_t *)(md + sizeof(group) * max_groups);
    float *cwd = (float *)(orderd + nrs);
    if (any_q) dsv4_cuda_act_quant(b, xq, xd, rows, dim, 128);
    k_moe_up<<<dim3((unsigned)((inter_max + 7) / 8), ng), 256, 0, c->stream>>>(h, inter_max, xd, xq, dim, gd, limit,
                                                                              act_bf16);
    if (CKL(b)) return;
    if (act_fp8) { /* h of each slot quantized over its own width (routed and shared may differ) */
        int64_t ri = experts[e[0]].w1.rows;
        if (quantized(experts[e[0]].w2.fmt)) {
            if (ri == inter_max)
                dsv4_cuda_act_quant(b, h, h, nrs, ri, 128);
            else
                for (int i = 0; i < nrs; i++)
                    dsv4_cuda_act_quant(b, h + (int64_t)i * inter_max, h + (int64_t)i * inter_max, 1, ri, 128);
        }
        if (shared && quantized(shared->w2.fmt))
            for (int r = 0; r < rows; r++)
                dsv4_cuda_act_quant(b, h + (int64_t)(nrs + r) * inter_max, h + (int64_t)(nrs + r) * inter_max, 1,
                                    shared->w1.rows, 128);
    }
    k_moe_down<<<dim3((unsigned)((dim + 7) / 8), ng), 256, 0, c->stream>>>(y, dim, h, inter_max, gd, act_bf16);
    if (CKL(b)) return;
    k_moe_combine<<<(unsigned)((rows * dim + 255) / 256), 256, 0, c->stream>>>(od, y, dim, rows, k, orderd, cwd, nrs,
                                                                               shared != NULL, out_scale, act_bf16);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * rows * dim);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MOE);
}
