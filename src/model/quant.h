/* model/quant: number formats and DeepSeek's quantization numerics (spec §2.0, §4).
 *
 * Owns: exact decoders for every code of e4m3fn, e8m0, e2m1 and bf16/f16;
 * round-to-nearest-even encoders; dequantization of stored weight formats
 * (FP8 128x128 blocks with e8m0 or f32 scales, MXFP4, NVFP4) one row at a time;
 * and the reference's activation numerics: act_quant (1x128 ue8m0 e4m3),
 * fp8_sim (block 64), fp4_sim (block 32), hadamard128, bf16 rounding.
 * Partial blocks (test configs whose widths are not block multiples): the last
 * block's amax and scale are computed over the elements present (spec §2.0).
 * Pure functions, thread-safe, no allocation.
 */
#ifndef DSV4_MODEL_QUANT_H
#define DSV4_MODEL_QUANT_H

#include <stddef.h>
#include <stdint.h>

/* ----- scalar codecs ----- */
float dsv4_bf16_to_f32(uint16_t h);
uint16_t dsv4_f32_to_bf16(float f);      /* RNE, NaN stays NaN (quiet) */
float dsv4_round_bf16(float f);          /* f32 -> bf16 -> f32 */
float dsv4_f16_to_f32(uint16_t h);
uint16_t dsv4_f32_to_f16(float f);       /* RNE */
float dsv4_e4m3_to_f32(uint8_t c);       /* e4m3fn: 0x7F/0xFF NaN, no inf */
uint8_t dsv4_f32_to_e4m3(float f);       /* RNE, saturates to +-448 (like torch's clamp then cast) */
float dsv4_e8m0_to_f32(uint8_t c);       /* 2^(c-127); 0xFF NaN; 0x00 = 2^-127 */
uint8_t dsv4_f32_to_e8m0(float pow2);    /* exact for powers of two in range */
float dsv4_e2m1_to_f32(uint8_t nibble);  /* low 4 bits; bit 3 = sign */
uint8_t dsv4_f32_to_e2m1(float f);       /* RNE onto {0,.5,1,1.5,2,3,4,6}, saturating */

/* ----- weight dequantization, one output row of a [rows, cols] weight -----
 * All write `cols` floats to out. */
void dsv4_dequant_bf16_row(const uint16_t *w, int64_t row, int64_t cols, float *out);
void dsv4_dequant_f32_row(const float *w, int64_t row, int64_t cols, float *out);
/* FP8 e4m3 with 128x128 block scales; scale is [ceil(rows/128), ceil(cols/128)] e8m0 bytes
 * (scale_f32 == NULL) or float32 (scale_e8m0 == NULL). */
void dsv4_dequant_fp8_row(const uint8_t *w, const uint8_t *scale_e8m0, const float *scale_f32, int64_t row,
                          int64_t cols, int block, float *out);
/* MXFP4: w is [rows, cols/2] bytes (elem 2j low nibble, 2j+1 high); scale [rows, cols/32] e8m0. */
void dsv4_dequant_mxfp4_row(const uint8_t *w, const uint8_t *scale, int64_t row, int64_t cols, float *out);
/* NVFP4: w [rows, cols/2] bytes; scale [rows, cols/16] e4m3; global scale2 (f32). */
void dsv4_dequant_nvfp4_row(const uint8_t *w, const uint8_t *scale, float scale2, int64_t row, int64_t cols,
                            float *out);

/* ----- reference activation numerics ----- */
/* act_quant: per `block` elements, s = 2^ceil(log2(max(amax,1e-4)/448)), q = e4m3(clamp(x/s)).
 * Writes the dequantized values q*s to out (in-place allowed) and, if scales != NULL, the
 * scale of each block.  This is both act_quant (block 128) and fp8_sim (block 64). */
void dsv4_fp8_quant_dequant(const float *x, float *out, int64_t n, int block, float *scales);
/* fp4_sim: per `block`, s = 2^ceil(log2(max(amax, 6*2^-126)/6)), q = e2m1(clamp(x/s,+-6)), out = q*s. */
void dsv4_fp4_quant_dequant(const float *x, float *out, int64_t n, int block);
/* Power-of-two ceiling scale as the reference computes it by bit tricks:
 * 2^ceil(log2(v)) for v > 0 (exponent, +1 if mantissa != 0). */
float dsv4_pow2_ceil(float v);
/* In-place Sylvester-ordered Walsh-Hadamard over n (power of two) scaled by n^-0.5. */
void dsv4_hadamard(float *x, int n);
/* Rounds n floats to bf16 in place. */
void dsv4_round_bf16_n(float *x, int64_t n);

#endif
