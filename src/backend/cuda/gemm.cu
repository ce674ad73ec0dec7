/* backend/cuda/gemm.cu: prefill matmuls (many rows) on the GPU.
 *
 * The `matmul` entry of the CUDA op table.  Calls with few rows (decode) go to the
 * dequantizing GEMV of linear.cu (cu_matmul); calls with many rows are meant to run
 * as tiled GEMMs here.  In this version every call still goes to cu_matmul: the
 * tiled kernels are being written (docs/CUDA.md, "Prefill").
 * Target: sm_90a.
 */
#include "backend/cuda/common.cuh"

void cu_matmul(dsv4_backend *, float *, const float *, int, const dsv4_weight *, int, int);

void cu_matmul_any(dsv4_backend *b, float *out, const float *x, int rows, const dsv4_weight *w, int act_fp8,
                   int out_bf16) {
    cu_matmul(b, out, x, rows, w, act_fp8, out_bf16);
}
