/* backend/cuda/moe.cu: router and mixture of experts (spec §2.6).
 *
 * route: one block per row: sqrt(softplus) of the logits in parallel, then thread 0
 *   picks the k largest of score+bias (ties to the lower id, the CPU's sort order)
 *   or takes the tid2eid row, and normalises in pick order like the CPU.
 * moe: the routed experts of every row and the shared expert run as "slots", all in
 *   one launch per stage:
 *   A) gate+up: one warp per (slot, inter feature) reads the w1 and w3 rows once,
 *      clamped SwiGLU, the routing weight when it applies before w2, bf16/fp8 as the
 *      profile says;  B) down: one warp per (slot, output feature);  C) combine:
 *      per row, the routed outputs summed in expert-id order (the CPU's order),
 *      times out_scale, plus the shared expert.
 *   Slot = (row, expert): at batch > 1 an expert picked by several rows is read once
 *   per row (a grouped kernel is future work, docs/CUDA.md).
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

__global__ void k_route(int32_t *experts, float *weights, const float *logits, int n_routed, int k, const float *bias,
                        const int32_t *hash_ids, float scale) {
    extern __shared__ float s[]; /* [n_routed] scores, then [n_routed] biased */
    float *sb = s + n_routed;
    int r = blockIdx.x;
    for (int e = threadIdx.x; e < n_routed; e += blockDim.x) {
        s[e] = d_sqrt_softplus(logits[(int64_t)r * n_routed + e]);
        sb[e] = s[e] + (bias ? bias[e] : 0.0f);
    }
    __syncthreads();
    if (threadIdx.x) return;
    int32_t *er = experts + (int64_t)r * k;
    if (hash_ids) {
        for (int j = 0; j < k; j++) er[j] = hash_ids[(int64_t)r * k + j];
    } else {
        for (int j = 0; j < k; j++) {
            int best = -1;
            for (int e = 0; e < n_routed; e++) {
                if (sb[e] == -INFINITY && best >= 0) continue;
                int taken = 0;
                for (int t = 0; t < j; t++) taken |= er[t] == e;
                if (taken) continue;
                if (best < 0 || sb[e] > sb[best]) best = e;
            }
            er[j] = best;
        }
    }
    float sum = 0.0f;
    for (int j = 0; j < k; j++) sum += s[er[j]];
    for (int j = 0; j < k; j++) weights[(int64_t)r * k + j] = s[er[j]] / (sum + 1e-20f) * scale;
}

void cu_route(dsv4_backend *b, int32_t *experts, float *weights, const float *logits, int rows, int n_routed, int k,
              const float *bias, const int32_t *hash_ids, float scale) {
    dsv4_cuda_op_begin(b);
    if (rows <= 0 || k <= 0) return;
    float *ld = (float *)dsv4_cuda_stage(b, logits, sizeof(float) * rows * n_routed);
    float *bd = bias ? (float *)dsv4_cuda_stage(b, bias, sizeof(float) * n_routed) : NULL;
    int32_t *hd = hash_ids ? (int32_t *)dsv4_cuda_stage(b, hash_ids, sizeof(int32_t) * rows * k) : NULL;
    int32_t *ed = (int32_t *)dsv4_cuda_scratch(b, sizeof(int32_t) * rows * k);
    float *wd = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * k);
    if (!ld || (bias && !bd) || (hash_ids && !hd) || !ed || !wd) return;
    k_route<<<rows, 256, sizeof(float) * 2 * n_routed, CI(b)->stream>>>(ed, wd, ld, n_routed, k, bd, hd, scale);
    if (CKL(b)) return;
    dsv4_cuda_fetch(b, experts, ed, sizeof(int32_t) * rows * k);
    dsv4_cuda_fetch(b, weights, wd, sizeof(float) * rows * k);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_ROUTE);
}

/* ----- moe ----- */
struct slot {
    dweight w1, w3, w2;
    int row;
    int quant_x, quant_h; /* act_fp8 applies to this slot's w1/w3 and w2 */
    float pre;            /* multiplies h before w2 (1 when it does not apply) */
};

/* warp dot of weight row o with x (full-length K); every lane gets the sum */
__device__ float warp_dot(const dweight &w, int64_t o, const float *__restrict__ x) {
    int lane = threadIdx.x & 31;
    int64_t K = w.cols;
    float a = 0.0f;
    if (w.fmt == DSV4_WF_MXFP4 && K % 32 == 0) {
        const uint8_t *row = w.data + o * (K / 2);
        for (int64_t k0 = (int64_t)lane * 32; k0 < K; k0 += 1024) {
            uint4 v = __ldg((const uint4 *)(row + k0 / 2));
            float s = d_e8m0_to_f32(w.scale[o * (K / 32) + k0 / 32]);
            const uint8_t *by = (const uint8_t *)&v;
            const float4 *xp = (const float4 *)(x + k0);
            float part = 0.0f;
#pragma unroll
            for (int i = 0; i < 8; i++) {
                float4 xv = __ldg(xp + i);
                part += d_e2m1_to_f32(by[2 * i] & 15u) * xv.x + d_e2m1_to_f32(by[2 * i] >> 4) * xv.y +
                        d_e2m1_to_f32(by[2 * i + 1] & 15u) * xv.z + d_e2m1_to_f32(by[2 * i + 1] >> 4) * xv.w;
            }
            a += part * s;
        }
    } else if (w.fmt == DSV4_WF_FP8 && K % 16 == 0 && w.block % 16 == 0) {
        const uint8_t *row = w.data + o * K;
        int64_t scols = (K + w.block - 1) / w.block, srow = (o / w.block) * scols;
        for (int64_t k0 = (int64_t)lane * 16; k0 < K; k0 += 512) {
            uint4 v = __ldg((const uint4 *)(row + k0));
            int64_t si = srow + k0 / w.block;
            float s = w.scale_f32 ? ((const float *)w.scale)[si] : d_e8m0_to_f32(w.scale[si]);
            const uint8_t *by = (const uint8_t *)&v;
            const float4 *xp = (const float4 *)(x + k0);
#pragma unroll
            for (int i = 0; i < 4; i++) {
                float4 xv = __ldg(xp + i);
                a += d_e4m3_to_f32(by[4 * i]) * s * xv.x + d_e4m3_to_f32(by[4 * i + 1]) * s * xv.y +
                     d_e4m3_to_f32(by[4 * i + 2]) * s * xv.z + d_e4m3_to_f32(by[4 * i + 3]) * s * xv.w;
            }
        }
    } else {
        for (int64_t k = lane; k < K; k += 32) a += d_weight_at(w, o, k) * x[k];
    }
    return warp_sum(a);
}

__global__ void k_moe_up(float *h, int64_t ldh, const float *x, const float *xq, int64_t dim, const slot *slots,
                         float limit, int act_bf16) {
    const slot &s = slots[blockIdx.y];
    int64_t o = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (o >= s.w1.rows) return;
    const float *xr = (s.quant_x ? xq : x) + (int64_t)s.row * dim;
    float g = warp_dot(s.w1, o, xr), u = warp_dot(s.w3, o, xr);
    if ((threadIdx.x & 31) == 0) {
        if (act_bf16) g = d_round_bf16(g), u = d_round_bf16(u);
        if (limit > 0) {
            g = fminf(g, limit);
            u = fminf(fmaxf(u, -limit), limit);
        }
        float v = g / (1.0f + expf(-g)) * u;
        v *= s.pre;
        h[(int64_t)blockIdx.y * ldh + o] = act_bf16 ? d_round_bf16(v) : v;
    }
}

__global__ void k_moe_down(float *y, int64_t dim, const float *h, int64_t ldh, const slot *slots, int act_bf16) {
    const slot &s = slots[blockIdx.y];
    int64_t d = (int64_t)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (d >= dim) return;
    float v = warp_dot(s.w2, d, h + (int64_t)blockIdx.y * ldh);
    if ((threadIdx.x & 31) == 0) y[(int64_t)blockIdx.y * dim + d] = act_bf16 ? d_round_bf16(v) : v;
}

/* order[r*k + i]: slot of row r's i-th expert in id order; wsum: its combine weight */
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
    size_t hb = sizeof(slot) * S + sizeof(int32_t) * nrs + sizeof(float) * nrs;
    uint8_t *hm = (uint8_t *)malloc(hb);
    if (!hm) {
        dsv4_cuda_fail(b, "moe: out of host memory", __FILE__, __LINE__, cudaSuccess);
        return;
    }
    slot *sl = (slot *)hm;
    int32_t *order = (int32_t *)(hm + sizeof(slot) * S);
    float *cw = (float *)(order + nrs);
    int64_t inter_max = 0;
    int any_q = 0;
    for (int i = 0; i < S; i++) {
        const dsv4_ffn_w *f = i < nrs ? &experts[e[i]] : shared;
        slot &s = sl[i];
        if (dsv4_cuda_weight(b, &f->w1, &s.w1) || dsv4_cuda_weight(b, &f->w3, &s.w3) ||
            dsv4_cuda_weight(b, &f->w2, &s.w2)) {
            free(hm);
            return;
        }
        s.row = i < nrs ? i / k : i - nrs;
        s.quant_x = act_fp8 && quantized(f->w1.fmt);
        s.quant_h = act_fp8 && quantized(f->w2.fmt);
        s.pre = (i < nrs && before_w2) ? wgt[i] : 1.0f;
        any_q |= s.quant_x;
        if (f->w1.rows > inter_max) inter_max = f->w1.rows;
        c->weight_bytes_read += wb(&f->w1) + wb(&f->w2) + wb(&f->w3);
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
    float *xd = (float *)dsv4_cuda_stage(b, x, sizeof(float) * rows * dim);
    float *xq = any_q ? (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * dim) : xd;
    uint8_t *md = (uint8_t *)dsv4_cuda_stage(b, hm, hb);
    float *h = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * inter_max);
    float *y = (float *)dsv4_cuda_scratch(b, sizeof(float) * S * dim);
    float *od = (float *)dsv4_cuda_scratch(b, sizeof(float) * rows * dim);
    free(hm);
    if (!xd || !xq || !md || !h || !y || !od) return;
    slot *sd = (slot *)md;
    int32_t *orderd = (int32_t *)(md + sizeof(slot) * S);
    float *cwd = (float *)(orderd + nrs);
    if (any_q) dsv4_cuda_act_quant(b, xq, xd, rows, dim, 128);
    k_moe_up<<<dim3((unsigned)((inter_max + 7) / 8), S), 256, 0, c->stream>>>(h, inter_max, xd, xq, dim, sd, limit,
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
    k_moe_down<<<dim3((unsigned)((dim + 7) / 8), S), 256, 0, c->stream>>>(y, dim, h, inter_max, sd, act_bf16);
    if (CKL(b)) return;
    k_moe_combine<<<(unsigned)((rows * dim + 255) / 256), 256, 0, c->stream>>>(od, y, dim, rows, k, orderd, cwd, nrs,
                                                                               shared != NULL, out_scale, act_bf16);
    if (CKL(b)) return;
    dsv4_cuda_fetch(b, out, od, sizeof(float) * rows * dim);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MOE);
}
