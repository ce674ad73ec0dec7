/* model/quant: number formats and DeepSeek's quantization numerics (spec §2.0, §4).
 *
 * Every codec here works on IEEE bit patterns rather than on libm, so that the
 * results are exact and independent of the compiler's float contraction: the
 * reference computes its scales by bit tricks too (spec §2.0).  The row
 * dequantizers are on the CPU matmul hot path and go through 256-entry float
 * tables built once (pthread_once), so the inner loops are a load, a lookup and
 * a multiply.
 */
#include "model/quant.h"

#include <math.h>
#include <pthread.h>
#include <string.h>

/* ----- bit helpers ----- */

static inline uint32_t f32_bits(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static inline float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

/* ----- bf16 / f16 ----- */

float dsv4_bf16_to_f32(uint16_t h) {
    return f32_from_bits((uint32_t)h << 16);
}

uint16_t dsv4_f32_to_bf16(float f) {
    uint32_t b = f32_bits(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((b >> 16) | 0x0040u); /* quiet NaN, keep sign */
    /* Round to nearest even on the 16 dropped bits; a carry walks into the
     * exponent, which is exactly right (up to infinity for the largest values). */
    b += 0x7fffu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

float dsv4_round_bf16(float f) {
    return dsv4_bf16_to_f32(dsv4_f32_to_bf16(f));
}

void dsv4_round_bf16_n(float *x, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        x[i] = dsv4_round_bf16(x[i]);
}

float dsv4_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) { /* zero or subnormal: m * 2^-24, exact in f32 */
        float v = (float)m * 0x1p-24f;
        return f32_from_bits(f32_bits(v) | sign);
    }
    if (e == 31) return f32_from_bits(sign | 0x7f800000u | (m << 13)); /* inf / NaN (payload kept) */
    return f32_from_bits(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t dsv4_f32_to_f16(float f) {
    uint32_t b = f32_bits(f);
    uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7e00u | (uint16_t)((a >> 13) & 0x3ffu); /* quiet NaN */
    /* 65520 is halfway between 65504 (odd mantissa) and 65536: RNE goes up, to inf. */
    if (a >= 0x477ff000u) return sign | 0x7c00u;
    if (a >= 0x38800000u) { /* normal half: round the 13 dropped bits to nearest even */
        uint32_t r = a + 0xfffu + ((a >> 13) & 1u);
        return sign | (uint16_t)((r >> 13) - (112u << 10));
    }
    /* Subnormal half (or zero): |f| * 2^24 is exact in f32; round it to an
     * integer 0..1024 (1024 is the smallest normal, whose code is also 0x400). */
    float v = f32_from_bits(a) * 0x1p24f;
    return sign | (uint16_t)rintf(v);
}

/* ----- e4m3fn ----- */

float dsv4_e4m3_to_f32(uint8_t c) {
    uint32_t sign = (uint32_t)(c & 0x80u) << 24;
    uint32_t e = (c >> 3) & 0xfu, m = c & 7u;
    if (e == 15 && m == 7) return f32_from_bits(sign | 0x7fc00000u); /* 0x7F / 0xFF */
    if (e == 0) {                                                    /* subnormal m * 2^-9 */
        float v = (float)m * 0x1p-9f;
        return f32_from_bits(f32_bits(v) | sign);
    }
    return f32_from_bits(sign | ((e + 120u) << 23) | (m << 20));
}

uint8_t dsv4_f32_to_e4m3(float f) {
    uint32_t b = f32_bits(f);
    uint8_t sign = (uint8_t)((b >> 24) & 0x80u);
    uint32_t a = b & 0x7fffffffu;
    if (a > 0x7f800000u) return sign | 0x7fu;
    if (a >= 0x43e00000u) return sign | 0x7eu; /* |f| >= 448 (and inf): saturate like clamp-then-cast */
    if (a < 0x3c800000u) {                     /* below 2^-6: subnormal grid m * 2^-9, m = 0..8 */
        float v = f32_from_bits(a) * 512.0f;
        return sign | (uint8_t)rintf(v);
    }
    /* Normal: keep 3 mantissa bits with round-to-nearest-even; the carry can
     * reach the exponent.  Nothing below 448 rounds above 448. */
    uint32_t r = a + 0x7ffffu + ((a >> 20) & 1u);
    return sign | (uint8_t)((r >> 20) - (120u << 3));
}

/* ----- e8m0 ----- */

float dsv4_e8m0_to_f32(uint8_t c) {
    if (c == 0xff) return NAN;
    if (c == 0) return f32_from_bits(0x00400000u); /* 2^-127, a subnormal f32 */
    return f32_from_bits((uint32_t)c << 23);
}

/* Powers of two in [2^-127, 2^127] are exact.  Other positive values round up
 * to the next power of two (a scale must never be too small); zero, negatives
 * and values below 2^-127 give 0x00; values above 2^127, inf and NaN give 0xFF. */
uint8_t dsv4_f32_to_e8m0(float pow2) {
    if (!(pow2 > 0.0f)) return isnan(pow2) ? 0xff : 0x00;
    if (pow2 <= 0x1p-127f) return 0x00;
    uint32_t b = f32_bits(pow2);
    uint32_t e = b >> 23, m = b & 0x7fffffu;
    if (e == 0) return 0x01; /* subnormal above 2^-127: at most 2^-126 */
    e += (m != 0);
    return e >= 255 ? 0xff : (uint8_t)e;
}

/* ----- e2m1 ----- */

static const float E2M1_VALUES[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                      -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

float dsv4_e2m1_to_f32(uint8_t nibble) {
    return E2M1_VALUES[nibble & 0xfu];
}

/* RNE onto the e2m1 grid: a tie goes to the code with an even mantissa bit,
 * so 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4; above 6 saturates.
 * e2m1 has no NaN: NaN encodes as +0 (callers deal with NaN before encoding). */
static inline uint8_t e2m1_encode_abs(float a) {
    uint8_t c;
    if (a <= 0.25f)
        c = 0;
    else if (a < 0.75f)
        c = 1;
    else if (a <= 1.25f)
        c = 2;
    else if (a < 1.75f)
        c = 3;
    else if (a <= 2.5f)
        c = 4;
    else if (a < 3.5f)
        c = 5;
    else if (a <= 5.0f)
        c = 6;
    else
        c = 7;
    return c;
}

uint8_t dsv4_f32_to_e2m1(float f) {
    if (isnan(f)) return 0;
    uint8_t sign = (f32_bits(f) >> 31) ? 0x8u : 0u;
    return sign | e2m1_encode_abs(fabsf(f));
}

/* ----- tables for the hot path ----- */

static float E4M3_TABLE[256];
static float E8M0_TABLE[256];
static pthread_once_t TABLES_ONCE = PTHREAD_ONCE_INIT;

static void tables_build(void) {
    for (int c = 0; c < 256; c++) {
        E4M3_TABLE[c] = dsv4_e4m3_to_f32((uint8_t)c);
        E8M0_TABLE[c] = dsv4_e8m0_to_f32((uint8_t)c);
    }
}

static inline void tables_init(void) {
    pthread_once(&TABLES_ONCE, tables_build);
}

/* ----- weight dequantization ----- */

void dsv4_dequant_bf16_row(const uint16_t *w, int64_t row, int64_t cols, float *out) {
    const uint16_t *r = w + row * cols;
    for (int64_t c = 0; c < cols; c++)
        out[c] = f32_from_bits((uint32_t)r[c] << 16);
}

void dsv4_dequant_f32_row(const float *w, int64_t row, int64_t cols, float *out) {
    memcpy(out, w + row * cols, (size_t)cols * sizeof(float));
}

/* W[r][c] = e4m3(W_q[r][c]) * S[r/block][c/block] (spec §4.1).  The scale grid
 * has ceil(cols/block) columns; a partial last column block uses its own scale. */
void dsv4_dequant_fp8_row(const uint8_t *w, const uint8_t *scale_e8m0, const float *scale_f32, int64_t row,
                          int64_t cols, int block, float *out) {
    tables_init();
    const uint8_t *r = w + row * cols;
    int64_t scols = (cols + block - 1) / block;
    int64_t srow = (row / block) * scols;
    for (int64_t cb = 0; cb < scols; cb++) {
        float s = scale_e8m0 ? E8M0_TABLE[scale_e8m0[srow + cb]] : scale_f32[srow + cb];
        int64_t c0 = cb * block, c1 = c0 + block < cols ? c0 + block : cols;
        for (int64_t c = c0; c < c1; c++)
            out[c] = E4M3_TABLE[r[c]] * s;
    }
}

/* Row-major packing: byte j holds element 2j in the low nibble and 2j+1 in the
 * high nibble; a row takes ceil(cols/2) bytes (an odd last element leaves the
 * high nibble unused).  `group` elements share one scale; ceil(cols/group)
 * scales per row. */
static inline void fp4_row(const uint8_t *restrict wr, const float *restrict scales, int64_t cols, int group,
                           float *restrict out) {
    int64_t ngroups = (cols + group - 1) / group;
    for (int64_t g = 0; g < ngroups; g++) {
        float s = scales[g];
        int64_t c0 = g * group, c1 = c0 + group < cols ? c0 + group : cols;
        const uint8_t *b = wr + c0 / 2; /* c0 is even because group is */
        float *o = out + c0;
        int64_t pairs = (c1 - c0) / 2;
        float t[16]; /* the 16 codes pre-multiplied by this group's scale */
        for (int k = 0; k < 16; k++)
            t[k] = E2M1_VALUES[k] * s;
        for (int64_t j = 0; j < pairs; j++) {
            uint8_t v = b[j];
            o[2 * j] = t[v & 15];
            o[2 * j + 1] = t[v >> 4];
        }
        if ((c1 - c0) & 1) o[2 * pairs] = t[b[pairs] & 15];
    }
}

void dsv4_dequant_mxfp4_row(const uint8_t *w, const uint8_t *scale, int64_t row, int64_t cols, float *out) {
    tables_init();
    int64_t ngroups = (cols + 31) / 32;
    const uint8_t *sr = scale + row * ngroups;
    float s[64];
    const uint8_t *wr = w + row * ((cols + 1) / 2);
    /* Convert scales in chunks so the per-element loop never touches e8m0 codes. */
    for (int64_t g0 = 0; g0 < ngroups; g0 += 64) {
        int64_t ng = ngroups - g0 < 64 ? ngroups - g0 : 64;
        for (int64_t g = 0; g < ng; g++)
            s[g] = E8M0_TABLE[sr[g0 + g]];
        int64_t c0 = g0 * 32, c1 = c0 + ng * 32 < cols ? c0 + ng * 32 : cols;
        fp4_row(wr + c0 / 2, s, c1 - c0, 32, out + c0);
    }
}

/* W = e2m1(code) * e4m3(scale[r][c/16]) * scale2 (spec §4.2). */
void dsv4_dequant_nvfp4_row(const uint8_t *w, const uint8_t *scale, float scale2, int64_t row, int64_t cols,
                            float *out) {
    tables_init();
    int64_t ngroups = (cols + 15) / 16;
    const uint8_t *sr = scale + row * ngroups;
    float s[64];
    const uint8_t *wr = w + row * ((cols + 1) / 2);
    for (int64_t g0 = 0; g0 < ngroups; g0 += 64) {
        int64_t ng = ngroups - g0 < 64 ? ngroups - g0 : 64;
        for (int64_t g = 0; g < ng; g++)
            s[g] = E4M3_TABLE[sr[g0 + g]] * scale2;
        int64_t c0 = g0 * 16, c1 = c0 + ng * 16 < cols ? c0 + ng * 16 : cols;
        fp4_row(wr + c0 / 2, s, c1 - c0, 16, out + c0);
    }
}

/* ----- reference activation numerics ----- */

/* The reference's fast_log2_ceil + fast_pow2: take the biased exponent, add one
 * if any mantissa bit is set, rebuild a float from the exponent alone.  Sign is
 * ignored; 0 gives 0; a subnormal gives 2^-126; above 2^127 gives inf. */
float dsv4_pow2_ceil(float v) {
    uint32_t b = f32_bits(v);
    int32_t e = (int32_t)((b >> 23) & 0xffu) - 127 + ((b & 0x7fffffu) != 0);
    return f32_from_bits((uint32_t)(e + 127) << 23);
}

/* amax over a block; returns NaN if any element is NaN or infinite. */
static inline float block_amax(const float *x, int64_t n) {
    float amax = 0.0f;
    int bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        bad |= !(a <= 3.40282347e38f); /* NaN or inf */
        amax = a > amax ? a : amax;
    }
    return bad ? NAN : amax;
}

/* A block holding NaN or inf yields NaN everywhere (and a NaN scale): the
 * reference's bit trick on a non-finite amax produces garbage scales, and
 * propagating NaN is the honest equivalent.  Partial last block: amax and scale
 * over the elements present (spec §2.0, dsv4 convention). */
void dsv4_fp8_quant_dequant(const float *x, float *out, int64_t n, int block, float *scales) {
    tables_init();
    for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, bi++) {
        int64_t len = n - b0 < block ? n - b0 : block;
        float amax = block_amax(x + b0, len);
        if (isnan(amax)) {
            for (int64_t i = 0; i < len; i++)
                out[b0 + i] = NAN;
            if (scales) scales[bi] = NAN;
            continue;
        }
        if (amax < 1e-4f) amax = 1e-4f;
        /* The reference multiplies by a precomputed 1/448 (fp8_max_inv). */
        float s = dsv4_pow2_ceil(amax * (1.0f / 448.0f));
        float inv = 1.0f / s; /* exact: s is a power of two well inside range */
        for (int64_t i = 0; i < len; i++)
            out[b0 + i] = E4M3_TABLE[dsv4_f32_to_e4m3(x[b0 + i] * inv)] * s;
        if (scales) scales[bi] = s;
    }
}

void dsv4_fp4_quant_dequant(const float *x, float *out, int64_t n, int block) {
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t len = n - b0 < block ? n - b0 : block;
        float amax = block_amax(x + b0, len);
        if (isnan(amax)) {
            for (int64_t i = 0; i < len; i++)
                out[b0 + i] = NAN;
            continue;
        }
        if (amax < 6.0f * 0x1p-126f) amax = 6.0f * 0x1p-126f;
        float s = dsv4_pow2_ceil(amax / 6.0f);
        float inv = 1.0f / s;
        for (int64_t i = 0; i < len; i++) {
            float y = x[b0 + i] * inv;
            float q = E2M1_VALUES[e2m1_encode_abs(fabsf(y))];
            out[b0 + i] = (y < 0.0f ? -q : q) * s;
        }
    }
}

/* Sylvester order: stage h pairs (j, j+h) inside blocks of 2h, for h = 1, 2, 4, ...
 * The 1/sqrt(n) scale is applied once at the end, as the reference kernel does. */
void dsv4_hadamard(float *x, int n) {
    for (int h = 1; h < n; h <<= 1) {
        for (int i = 0; i < n; i += 2 * h) {
            for (int j = i; j < i + h; j++) {
                float a = x[j], b = x[j + h];
                x[j] = a + b;
                x[j + h] = a - b;
            }
        }
    }
    float scale = (float)(1.0 / sqrt((double)n));
    for (int i = 0; i < n; i++)
        x[i] *= scale;
}
