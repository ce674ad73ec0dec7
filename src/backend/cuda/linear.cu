/* backend/cuda/linear.cu: dequantizing linears (matmul, grouped wo_a, embed, act_quant).
 *
 * k_linear: out[r][o] = sum_k W[o0+o][k] x[r][k] for o < no, r < rows (<= 8 per launch;
 * the launcher walks larger batches in chunks of 8 rows).
 * Layout: W in its stored format (device), x [rows][ldx] fp32, out [rows][ldo] fp32.
 * Geometry: one warp per output feature, 8 warps per block (split-K over grid.y when
 * there are few features, partials summed in split order); each lane streams 16-byte
 * vectors of the weight row (FP8: 16 values, MXFP4/NVFP4: 32, bf16: 8, f32: 4),
 * dequantizes them in registers and multiplies them into NR fp32 accumulators, so
 * every weight byte is read once per chunk of 8 rows.  Odd shapes (K not a multiple
 * of 32, partial scale blocks, unaligned x) take the element-wise path.
 * Accumulation order differs from the CPU's (lane-strided partial sums, then a warp
 * tree): that is the only difference; the flags (w_bf16, out_bf16) round exactly.
 * Target: sm_90a.  Decode at batch 1 is memory-bound; prefill reuses nothing across
 * chunks of 8 rows (tensor-core prefill is future work, docs/CUDA.md).
 */
#include "backend/cuda/common.cuh"

template <int NR>
__device__ __forceinline__ void fma_chunk(float (&acc)[NR], const float *wv, int n, const float *x, int64_t ldx,
                                          int rows, int64_t k0, int w_bf16) {
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= rows) break;
        const float4 *xp = (const float4 *)(x + (int64_t)r * ldx + k0);
        float a = acc[r];
        for (int i = 0; i < n; i += 4) {
            float4 xv = __ldg(xp + i / 4);
            float w0 = wv[i], w1 = wv[i + 1], w2 = wv[i + 2], w3 = wv[i + 3];
            if (w_bf16) w0 = d_round_bf16(w0), w1 = d_round_bf16(w1), w2 = d_round_bf16(w2), w3 = d_round_bf16(w3);
            a += w0 * xv.x + w1 * xv.y + w2 * xv.z + w3 * xv.w;
        }
        acc[r] = a;
    }
}

template <int NR>
__global__ void __launch_bounds__(256) k_linear(float *out, int64_t ldo, const float *__restrict__ x, int64_t ldx,
                                                int rows, dweight w, int64_t o0, int64_t no, int w_bf16,
                                                int out_bf16, int vec, int64_t kspan, float *part) {
    int64_t warp = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (warp >= no) return;
    int64_t o = o0 + warp, K = w.cols;
    int64_t kb = (int64_t)blockIdx.y * kspan, ke = kb + kspan < K ? kb + kspan : K; /* split-K slice */
    float acc[NR];
#pragma unroll
    for (int r = 0; r < NR; r++) acc[r] = 0.0f;
    float wv[32];
    if (vec && w.fmt == DSV4_WF_FP8) {
        const uint8_t *row = w.data + o * K;
        int64_t scols = (K + w.block - 1) / w.block, srow = (o / w.block) * scols;
        for (int64_t k0 = kb + (int64_t)lane * 16; k0 < ke; k0 += 512) {
            uint4 v = __ldg((const uint4 *)(row + k0));
            int64_t si = srow + k0 / w.block;
            float s = w.scale_f32 ? ((const float *)w.scale)[si] : d_e8m0_to_f32(w.scale[si]);
            const uint8_t *bytes = (const uint8_t *)&v;
#pragma unroll
            for (int i = 0; i < 16; i++) wv[i] = d_e4m3_to_f32(bytes[i]) * s;
            fma_chunk<NR>(acc, wv, 16, x, ldx, rows, k0, w_bf16);
        }
    } else if (vec && (w.fmt == DSV4_WF_MXFP4 || w.fmt == DSV4_WF_NVFP4)) {
        const uint8_t *row = w.data + o * (K / 2);
        for (int64_t k0 = kb + (int64_t)lane * 32; k0 < ke; k0 += 1024) {
            uint4 v = __ldg((const uint4 *)(row + k0 / 2));
            float s0, s1;
            if (w.fmt == DSV4_WF_MXFP4) {
                s0 = s1 = d_e8m0_to_f32(w.scale[o * (K / 32) + k0 / 32]);
            } else {
                const uint8_t *sp = w.scale + o * (K / 16) + k0 / 16;
                s0 = d_e4m3_to_f32(sp[0]) * w.scale2;
                s1 = d_e4m3_to_f32(sp[1]) * w.scale2;
            }
            const uint8_t *bytes = (const uint8_t *)&v;
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float s = i < 8 ? s0 : s1;
                wv[2 * i] = d_e2m1_to_f32(bytes[i] & 15u) * s;
                wv[2 * i + 1] = d_e2m1_to_f32(bytes[i] >> 4) * s;
            }
            fma_chunk<NR>(acc, wv, 32, x, ldx, rows, k0, w_bf16);
        }
    } else if (vec && w.fmt == DSV4_WF_BF16) {
        const uint16_t *row = (const uint16_t *)w.data + o * K;
        for (int64_t k0 = kb + (int64_t)lane * 8; k0 < ke; k0 += 256) {
            uint4 v = __ldg((const uint4 *)(row + k0));
            const uint16_t *h = (const uint16_t *)&v;
#pragma unroll
            for (int i = 0; i < 8; i++) wv[i] = d_bf16_to_f32(h[i]);
            fma_chunk<NR>(acc, wv, 8, x, ldx, rows, k0, w_bf16);
        }
    } else if (vec && w.fmt == DSV4_WF_F32) {
        const float *row = (const float *)w.data + o * K;
        for (int64_t k0 = kb + (int64_t)lane * 4; k0 < ke; k0 += 128) {
            float4 v = __ldg((const float4 *)(row + k0));
            wv[0] = v.x, wv[1] = v.y, wv[2] = v.z, wv[3] = v.w;
            fma_chunk<NR>(acc, wv, 4, x, ldx, rows, k0, w_bf16);
        }
    } else {
        for (int64_t k = kb + lane; k < ke; k += 32) {
            float wk = d_weight_at(w, o, k);
            if (w_bf16) wk = d_round_bf16(wk);
#pragma unroll
            for (int r = 0; r < NR; r++)
                if (r < rows) acc[r] += wk * x[(int64_t)r * ldx + k];
        }
    }
#pragma unroll
    for (int r = 0; r < NR; r++) {
        if (r >= rows) break;
        float v = warp_sum(acc[r]);
        if (lane == 0) {
            if (gridDim.y > 1) part[((int64_t)blockIdx.y * rows + r) * no + warp] = v;
            else out[(int64_t)r * ldo + warp] = out_bf16 ? d_round_bf16(v) : v;
        }
    }
}

static size_t wbytes_rows(const dweight &w, int64_t no) {
    switch (w.fmt) {
    case DSV4_WF_F32: return (size_t)(no * w.cols * 4);
    case DSV4_WF_BF16: return (size_t)(no * w.cols * 2);
    case DSV4_WF_FP8: return (size_t)(no * w.cols + (no * w.cols) / (w.block * w.block) * (w.scale_f32 ? 4 : 1));
    case DSV4_WF_MXFP4: return (size_t)(no * w.cols / 2 + no * w.cols / 32);
    case DSV4_WF_NVFP4: return (size_t)(no * w.cols / 2 + no * w.cols / 16);
    default: return 0;
    }
}

/* sums the split-K partials in split order (deterministic) */
__global__ void k_splitk_sum(float *out, int64_t ldo, const float *part, int rows, int64_t no, int splits,
                             int out_bf16) {
    int64_t t = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= rows * no) return;
    int64_t r = t / no, o = t % no;
    float v = 0.0f;
    for (int s = 0; s < splits; s++) v += part[((int64_t)s * rows + r) * no + o];
    out[r * ldo + o] = out_bf16 ? d_round_bf16(v) : v;
}

void dsv4_cuda_linear(dsv4_backend *b, float *out_d, int64_t ldo, const float *x_d, int64_t ldx, int rows,
                      const dweight &w, int64_t o0, int64_t no, int w_bf16, int out_bf16) {
    cuda_impl *c = CI(b);
    if (c->failed || rows <= 0 || no <= 0) return;
    int64_t K = w.cols;
    int vec = K % 32 == 0 && ldx % 4 == 0 && ((uintptr_t)x_d & 15) == 0;
    if (w.fmt == DSV4_WF_FP8 && (w.block % 16 || K % w.block)) vec = 0;
    /* Few output features (q/kv LoRA, mHC mixes, wo_a groups) leave most SMs idle with
     * one warp per feature: split K into slices of a multiple of 1024 (every format's
     * per-iteration span, and FP8's block) until ~8K warps are in flight. */
    int splits = 1;
    int64_t kspan = K;
    if (vec && no < 8192 && K >= 2048) {
        int64_t want = (8192 + no - 1) / no, most = K / 1024;
        splits = (int)(want < most ? want : most);
        if (splits < 1) splits = 1;
        kspan = ((K + splits - 1) / splits + 1023) / 1024 * 1024;
        splits = (int)((K + kspan - 1) / kspan);
    }
    float *part = NULL;
    if (splits > 1 && !(part = (float *)dsv4_cuda_scratch(b, sizeof(float) * splits * (rows < 8 ? rows : 8) * no)))
        return;
    dim3 grid((unsigned)((no * 32 + 255) / 256), (unsigned)splits);
    for (int r0 = 0; r0 < rows; r0 += 8) {
        int nr = rows - r0 < 8 ? rows - r0 : 8;
        const float *xr = x_d + (int64_t)r0 * ldx;
        float *orow = out_d + (int64_t)r0 * ldo;
        if (nr == 1)
            k_linear<1><<<grid, 256, 0, c->stream>>>(orow, ldo, xr, ldx, nr, w, o0, no, w_bf16, out_bf16, vec, kspan,
                                                     part);
        else if (nr == 2)
            k_linear<2><<<grid, 256, 0, c->stream>>>(orow, ldo, xr, ldx, nr, w, o0, no, w_bf16, out_bf16, vec, kspan,
                                                     part);
        else if (nr <= 4)
            k_linear<4><<<grid, 256, 0, c->stream>>>(orow, ldo, xr, ldx, nr, w, o0, no, w_bf16, out_bf16, vec, kspan,
                                                     part);
        else
            k_linear<8><<<grid, 256, 0, c->stream>>>(orow, ldo, xr, ldx, nr, w, o0, no, w_bf16, out_bf16, vec, kspan,
                                                     part);
        if (CKL(b)) return;
        if (splits > 1) {
            k_splitk_sum<<<(unsigned)((nr * no + 255) / 256), 256, 0, c->stream>>>(orow, ldo, part, nr, no, splits,
                                                                                    out_bf16);
            if (CKL(b)) return;
        }
        c->weight_bytes_read += wbytes_rows(w, no);
    }
}

/* ----- act_quant / fp8_sim (spec §2.0): one warp per (row, block) ----- */
__global__ void k_act_quant(float *out, const float *x, int rows, int64_t K, int block) {
    int64_t nb = (K + block - 1) / block;
    int64_t wid = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (wid >= rows * nb) return;
    int64_t r = wid / nb, b0 = (wid % nb) * block;
    int64_t len = K - b0 < block ? K - b0 : block;
    const float *xp = x + r * K + b0;
    float *op = out + r * K + b0;
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = lane; i < len; i += 32) {
        float a = fabsf(xp[i]);
        bad |= !(a <= 3.40282347e38f);
        amax = fmaxf(amax, a);
    }
    amax = warp_max(amax);
    bad = __any_sync(0xffffffffu, bad);
    if (bad) {
        for (int64_t i = lane; i < len; i += 32) op[i] = __uint_as_float(0x7fc00000u);
        return;
    }
    if (amax < 1e-4f) amax = 1e-4f;
    float s = d_pow2_ceil(amax * (1.0f / 448.0f));
    float inv = 1.0f / s;
    for (int64_t i = lane; i < len; i += 32) op[i] = d_e4m3_to_f32(d_f32_to_e4m3(xp[i] * inv)) * s;
}

void dsv4_cuda_act_quant(dsv4_backend *b, float *out_d, const float *x_d, int rows, int64_t K, int block) {
    if (CI(b)->failed || rows <= 0) return;
    int64_t warps = rows * ((K + block - 1) / block);
    k_act_quant<<<(unsigned)((warps * 32 + 255) / 256), 256, 0, CI(b)->stream>>>(out_d, x_d, rows, K, block);
    CKL(b);
}

__global__ void k_round_bf16(float *x, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = d_round_bf16(x[i]);
}

void dsv4_cuda_round_bf16(dsv4_backend *b, float *x_d, size_t n) {
    if (CI(b)->failed || !n) return;
    k_round_bf16<<<(unsigned)((n + 255) / 256), 256, 0, CI(b)->stream>>>(x_d, n);
    CKL(b);
}

static int quantized(int fmt) { return fmt == DSV4_WF_FP8 || fmt == DSV4_WF_MXFP4 || fmt == DSV4_WF_NVFP4; }

/* ----- ops ----- */
void cu_matmul(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int act_fp8,
               int out_bf16) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return;
    size_t xin = (size_t)rows * w->cols, xout = (size_t)rows * w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    if (act_fp8 && quantized(w->fmt)) { /* into scratch: the caller's input stays as it is */
        float *xq = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
        if (!xq) return;
        dsv4_cuda_act_quant(b, xq, xd, rows, w->cols, 128);
        xd = xq;
    }
    dsv4_cuda_linear(b, od, w->rows, xd, w->cols, rows, dw, 0, w->rows, 0, out_bf16);
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL);
}

void cu_matmul_grouped(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int groups,
                       int in_bf16, int out_bf16) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (dsv4_cuda_weight(b, w, &dw)) return;
    int64_t R = w->rows / groups, C = w->cols;
    size_t xin = (size_t)rows * groups * C, xout = (size_t)rows * w->rows;
    float *xd = (float *)dsv4_cuda_in(b, x, sizeof(float) * xin);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * xout);
    if (!xd || !od) return;
    if (in_bf16) { /* rounded copy in scratch */
        float *xb = (float *)dsv4_cuda_scratch(b, sizeof(float) * xin);
        if (!xb || CK(b, cudaMemcpyAsync(xb, xd, sizeof(float) * xin, cudaMemcpyDeviceToDevice, CI(b)->stream)))
            return;
        dsv4_cuda_round_bf16(b, xb, xin);
        xd = xb;
    }
    for (int g = 0; g < groups; g++)
        dsv4_cuda_linear(b, od + g * R, w->rows, xd + g * C, groups * C, rows, dw, g * R, R, in_bf16, out_bf16);
    dsv4_cuda_commit(b, out, od, sizeof(float) * xout);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_MATMUL_GROUPED);
}

__global__ void k_embed(float *out, const int32_t *tok, int rows, dweight w) {
    int r = blockIdx.y;
    int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (r < rows && c < w.cols) out[(int64_t)r * w.cols + c] = d_weight_at(w, tok[r], c);
}

void cu_embed(dsv4_backend *b, float *out, const int32_t *tokens, int rows, const dsv4_weight *w) {
    dsv4_cuda_op_begin(b);
    dweight dw;
    if (rows <= 0 || dsv4_cuda_weight(b, w, &dw)) return;
    int32_t *td = (int32_t *)dsv4_cuda_stage(b, tokens, sizeof(int32_t) * rows);
    float *od = (float *)dsv4_cuda_out(b, out, sizeof(float) * rows * w->cols);
    if (!td || !od) return;
    k_embed<<<dim3((unsigned)((w->cols + 255) / 256), rows), 256, 0, CI(b)->stream>>>(od, td, rows, dw);
    if (CKL(b)) return;
    dsv4_cuda_commit(b, out, od, sizeof(float) * rows * w->cols);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_EMBED);
}
