/* tests/test_quant: number-format codecs and the reference quantization numerics.
 *
 * Expected values are computed independently of quant.c: decoders from the bit
 * fields with ldexp, encoders by searching the whole code table for the nearest
 * value, scales with frexp instead of bit tricks. */
#include <float.h>
#include <stdint.h>

#include "model/quant.h"
#include "test.h"

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng_next(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}
static double rng_unit(void) {
    return (double)(rng_next() >> 11) * 0x1p-53;
}

static uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}
static float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}
/* Same value and same sign (so +0 and -0 differ); NaN equals NaN. */
static int same_float(float a, float b) {
    if (isnan(a) || isnan(b)) return isnan(a) && isnan(b);
    return bits_of(a) == bits_of(b);
}

/* ----- independent decoders ----- */
static double ref_e4m3(int c) {
    int s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e == 0 ? ldexp(m, -9) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}
static double ref_e8m0(int c) {
    return c == 255 ? NAN : ldexp(1.0, c - 127);
}
static double ref_e2m1(int c) {
    int s = (c >> 3) & 1, e = (c >> 1) & 3, m = c & 1;
    double v = e == 0 ? m * 0.5 : ldexp(1.0 + m / 2.0, e - 1);
    return s ? -v : v;
}

/* Nearest code by exhaustive search over the non-negative codes [0, maxcode];
 * ties go to the even code; sign applied afterwards. */
static int ref_encode_search(double x, double (*dec)(int), int maxcode, int signbit) {
    double a = fabs(x);
    int best = 0;
    double bestd = INFINITY;
    for (int c = 0; c <= maxcode; c++) {
        double d = fabs(a - dec(c));
        if (d < bestd || (d == bestd && (c & 1) == 0)) {
            best = c;
            bestd = d;
        }
    }
    return (signbit(x) ? signbit : 0) | best;
}

static void test_e4m3_decode_all(void) {
    for (int c = 0; c < 256; c++) {
        float got = dsv4_e4m3_to_f32((uint8_t)c);
        CHECKF(same_float(got, (float)ref_e4m3(c)), "code 0x%02x: got %.9g want %.9g", c, got, ref_e4m3(c));
    }
    CHECK(dsv4_e4m3_to_f32(0x7e) == 448.0f);
    CHECK(dsv4_e4m3_to_f32(0x01) == 0x1p-9f);
    CHECK(dsv4_e4m3_to_f32(0x08) == 0x1p-6f);
    CHECK(dsv4_e4m3_to_f32(0x38) == 1.0f);
    CHECK(isnan(dsv4_e4m3_to_f32(0x7f)) && isnan(dsv4_e4m3_to_f32(0xff)));
    CHECK(signbit(dsv4_e4m3_to_f32(0x80)) && dsv4_e4m3_to_f32(0x80) == 0.0f);
}

static void test_e8m0_decode_all(void) {
    for (int c = 0; c < 256; c++) {
        float got = dsv4_e8m0_to_f32((uint8_t)c);
        CHECKF(same_float(got, (float)ref_e8m0(c)), "code %d: got %.9g want %.9g", c, got, ref_e8m0(c));
    }
    CHECK(bits_of(dsv4_e8m0_to_f32(0)) == 0x00400000u);
    CHECK(dsv4_e8m0_to_f32(127) == 1.0f);
}

static void test_e2m1_decode_all(void) {
    static const float want[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (int c = 0; c < 16; c++) {
        CHECKF(same_float(dsv4_e2m1_to_f32((uint8_t)c), (float)ref_e2m1(c)), "code %d", c);
        CHECK(fabsf(dsv4_e2m1_to_f32((uint8_t)c)) == want[c & 7]);
        /* only the low nibble counts */
        CHECK(same_float(dsv4_e2m1_to_f32((uint8_t)(c | 0xa0)), dsv4_e2m1_to_f32((uint8_t)c)));
    }
}

static void test_roundtrip_all_codes(void) {
    for (int c = 0; c < 256; c++) {
        if ((c & 0x7f) == 0x7f) continue;
        CHECKF(dsv4_f32_to_e4m3(dsv4_e4m3_to_f32((uint8_t)c)) == c, "e4m3 code 0x%02x", c);
    }
    for (int c = 0; c < 255; c++)
        CHECKF(dsv4_f32_to_e8m0(dsv4_e8m0_to_f32((uint8_t)c)) == c, "e8m0 code %d", c);
    for (int c = 0; c < 16; c++)
        CHECKF(dsv4_f32_to_e2m1(dsv4_e2m1_to_f32((uint8_t)c)) == c, "e2m1 code %d", c);
    int bad_bf16 = 0, bad_f16 = 0;
    for (uint32_t h = 0; h < 65536; h++) {
        float b = dsv4_bf16_to_f32((uint16_t)h);
        if (!isnan(b) && dsv4_f32_to_bf16(b) != h) bad_bf16++;
        if (isnan(b) && !isnan(dsv4_bf16_to_f32(dsv4_f32_to_bf16(b)))) bad_bf16++;
        float f = dsv4_f16_to_f32((uint16_t)h);
        if (!isnan(f) && dsv4_f32_to_f16(f) != h) bad_f16++;
        if (isnan(f) && !isnan(dsv4_f16_to_f32(dsv4_f32_to_f16(f)))) bad_f16++;
    }
    CHECK_EQ_INT(bad_bf16, 0);
    CHECK_EQ_INT(bad_f16, 0);
}

static void test_f16_decode_values(void) {
    CHECK(dsv4_f16_to_f32(0x3c00) == 1.0f);
    CHECK(dsv4_f16_to_f32(0x7bff) == 65504.0f);
    CHECK(dsv4_f16_to_f32(0x0001) == 0x1p-24f);
    CHECK(dsv4_f16_to_f32(0x0400) == 0x1p-14f);
    CHECK(dsv4_f16_to_f32(0xc000) == -2.0f);
    CHECK(isinf(dsv4_f16_to_f32(0x7c00)) && dsv4_f16_to_f32(0xfc00) < 0);
    CHECK(isnan(dsv4_f16_to_f32(0x7e00)));
    /* all finite codes against an independent formula */
    for (int h = 0; h < 65536; h++) {
        int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
        if (e == 31) continue;
        double v = e == 0 ? ldexp(m, -24) : ldexp(1.0 + m / 1024.0, e - 15);
        if (s) v = -v;
        CHECKF(same_float(dsv4_f16_to_f32((uint16_t)h), (float)v), "f16 0x%04x", h);
    }
}

static void test_e4m3_rne_ties_and_saturation(void) {
    /* Every midpoint between neighbouring positive codes goes to the even code;
     * a hair above goes up, a hair below goes down. */
    for (int c = 0; c < 0x7e; c++) {
        float lo = dsv4_e4m3_to_f32((uint8_t)c), hi = dsv4_e4m3_to_f32((uint8_t)(c + 1));
        float mid = (lo + hi) * 0.5f; /* exact: both have few significant bits */
        int even = (c & 1) ? c + 1 : c;
        CHECKF(dsv4_f32_to_e4m3(mid) == even, "tie between 0x%02x and 0x%02x", c, c + 1);
        CHECKF(dsv4_f32_to_e4m3(-mid) == (0x80 | even), "negative tie after 0x%02x", c);
        CHECKF(dsv4_f32_to_e4m3(nextafterf(mid, INFINITY)) == c + 1, "above tie 0x%02x", c);
        CHECKF(dsv4_f32_to_e4m3(nextafterf(mid, 0.0f)) == c, "below tie 0x%02x", c);
    }
    /* random values against exhaustive search */
    for (int i = 0; i < 20000; i++) {
        float x = (float)ldexp(rng_unit() * 2 - 1, (int)(rng_next() % 24) - 14);
        int want = ref_encode_search(x, ref_e4m3, 0x7e, 0x80);
        CHECKF(dsv4_f32_to_e4m3(x) == want, "x=%.9g got 0x%02x want 0x%02x", x, dsv4_f32_to_e4m3(x), want);
    }
    CHECK(dsv4_f32_to_e4m3(448.0f) == 0x7e);
    CHECK(dsv4_f32_to_e4m3(463.99f) == 0x7e);
    CHECK(dsv4_f32_to_e4m3(464.0f) == 0x7e);
    CHECK(dsv4_f32_to_e4m3(1e30f) == 0x7e);
    CHECK(dsv4_f32_to_e4m3(INFINITY) == 0x7e);
    CHECK(dsv4_f32_to_e4m3(-INFINITY) == 0xfe);
    CHECK(dsv4_f32_to_e4m3(-1000.0f) == 0xfe);
    CHECK((dsv4_f32_to_e4m3(NAN) & 0x7f) == 0x7f);
    CHECK(dsv4_f32_to_e4m3(0x1p-10f) == 0x00);     /* tie between 0 and 2^-9 -> 0 */
    CHECK(dsv4_f32_to_e4m3(3 * 0x1p-10f) == 0x02); /* tie between 1 and 2 (x 2^-9) -> 2 */
    CHECK(dsv4_f32_to_e4m3(-0.0f) == 0x80);
    CHECK(dsv4_f32_to_e4m3(1e-30f) == 0x00);
}

static void test_e2m1_rne(void) {
    static const struct {
        float x;
        uint8_t c;
    } cases[] = {
        {0.25f, 0},      {0.2500001f, 1}, {0.75f, 2},   {0.7499999f, 1}, {1.25f, 2},
        {1.2500001f, 3}, {1.75f, 4},      {2.5f, 4},    {2.5000002f, 5}, {3.5f, 6},
        {5.0f, 6},       {5.0000005f, 7}, {6.0f, 7},    {100.0f, 7},     {INFINITY, 7},
        {-0.75f, 0xa},   {-5.0f, 0xe},    {-7.0f, 0xf}, {-0.0f, 8},      {0.1f, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECKF(dsv4_f32_to_e2m1(cases[i].x) == cases[i].c, "x=%.9g got %d want %d", cases[i].x,
               dsv4_f32_to_e2m1(cases[i].x), cases[i].c);
    for (int i = 0; i < 5000; i++) {
        float x = (float)((rng_unit() * 2 - 1) * 8);
        CHECKF(dsv4_f32_to_e2m1(x) == ref_encode_search(x, ref_e2m1, 7, 8), "x=%.9g", x);
    }
}

static void test_e8m0_encode(void) {
    CHECK(dsv4_f32_to_e8m0(1.0f) == 127);
    CHECK(dsv4_f32_to_e8m0(0x1p-127f) == 0);
    CHECK(dsv4_f32_to_e8m0(0x1p127f) == 254);
    CHECK(dsv4_f32_to_e8m0(3.0f) == 129); /* non-powers round up */
    CHECK(dsv4_f32_to_e8m0(NAN) == 255);
    CHECK(dsv4_f32_to_e8m0(0.0f) == 0);
}

static void test_bf16_rne_and_nan(void) {
    CHECK(dsv4_f32_to_bf16(1.0f) == 0x3f80);
    CHECK(dsv4_f32_to_bf16(1.0f + 0x1p-8f) == 0x3f80);     /* tie, 0x3f80 even */
    CHECK(dsv4_f32_to_bf16(1.0f + 3 * 0x1p-8f) == 0x3f82); /* tie, 0x3f81 odd -> up */
    CHECK(dsv4_f32_to_bf16(1.0f + 0x1p-8f + 0x1p-20f) == 0x3f81);
    CHECK(dsv4_f32_to_bf16(-1.0f - 0x1p-8f) == 0xbf80);
    CHECK(dsv4_f32_to_bf16(FLT_MAX) == 0x7f80); /* rounds to inf */
    CHECK(dsv4_f32_to_bf16(INFINITY) == 0x7f80);
    CHECK(dsv4_f32_to_bf16(-INFINITY) == 0xff80);
    uint16_t qn = dsv4_f32_to_bf16(float_of(0x7f800001u)); /* signalling NaN with payload in low bits */
    CHECK((qn & 0x7f80) == 0x7f80 && (qn & 0x7f) != 0);
    CHECK((dsv4_f32_to_bf16(float_of(0xffc00000u)) & 0x8000) != 0);
    CHECK(dsv4_round_bf16(1.00390625f) == 1.0f);
    float v[3] = {1.0f + 3 * 0x1p-8f, 2.0f, -1.0f - 0x1p-9f};
    dsv4_round_bf16_n(v, 3);
    CHECK(v[0] == 1.0f + 0x1p-6f && v[1] == 2.0f && v[2] == -1.0f);
    /* random values: rounding error at most half a bf16 ulp, ties to even */
    for (int i = 0; i < 20000; i++) {
        float x = float_of((uint32_t)rng_next() & 0x7f7fffffu);
        uint16_t h = dsv4_f32_to_bf16(x);
        uint32_t lo = bits_of(x) & 0xffff0000u;
        uint32_t want = lo >> 16;
        uint32_t rem = bits_of(x) & 0xffffu;
        if (rem > 0x8000u || (rem == 0x8000u && (want & 1))) want++;
        CHECKF(h == want, "x bits 0x%08x", bits_of(x));
    }
}

static void test_f16_rne(void) {
    CHECK(dsv4_f32_to_f16(1.0f + 0x1p-11f) == 0x3c00);
    CHECK(dsv4_f32_to_f16(1.0f + 3 * 0x1p-11f) == 0x3c02);
    CHECK(dsv4_f32_to_f16(65519.0f) == 0x7bff);
    CHECK(dsv4_f32_to_f16(65520.0f) == 0x7c00);
    CHECK(dsv4_f32_to_f16(0x1p-25f) == 0x0000);
    CHECK(dsv4_f32_to_f16(3 * 0x1p-25f) == 0x0002);
    CHECK(dsv4_f32_to_f16(-0x1p-14f) == 0x8400);
    CHECK(isnan(dsv4_f16_to_f32(dsv4_f32_to_f16(NAN))));
    /* random finite values against search in double */
    for (int i = 0; i < 20000; i++) {
        float x = (float)ldexp(rng_unit() * 2 - 1, (int)(rng_next() % 43) - 27);
        uint16_t h = dsv4_f32_to_f16(x);
        double got = dsv4_f16_to_f32(h), err = fabs(got - x);
        double ulp = ldexp(1.0, (fabs(x) < 0x1p-14 ? -14 : ilogb(x)) - 10);
        CHECKF(err < ulp / 2 || (err == ulp / 2 && (h & 1) == 0), "x=%.9g h=0x%04x", x, h);
    }
}

static void test_pow2_ceil(void) {
    CHECK(dsv4_pow2_ceil(1.0f) == 1.0f);
    CHECK(dsv4_pow2_ceil(1.0000001f) == 2.0f);
    CHECK(dsv4_pow2_ceil(0.75f) == 1.0f);
    CHECK(dsv4_pow2_ceil(0x1p-130f) == 0x1p-126f);
    CHECK(dsv4_pow2_ceil(0.0f) == 0.0f);
    for (int i = 0; i < 10000; i++) {
        float v = (float)ldexp(rng_unit() + 0.01, (int)(rng_next() % 100) - 50);
        int e;
        float m = frexpf(v, &e);
        float want = m == 0.5f ? ldexpf(1.0f, e - 1) : ldexpf(1.0f, e);
        CHECKF(dsv4_pow2_ceil(v) == want, "v=%.9g", v);
    }
}

/* ----- slow quant-dequant references ----- */
static float slow_pow2_ceil(float v) {
    int e;
    float m = frexpf(v, &e);
    return m == 0.5f ? ldexpf(1.0f, e - 1) : ldexpf(1.0f, e);
}

static void slow_fp8_qdq(const float *x, float *out, int64_t n, int block, float *scales) {
    for (int64_t b0 = 0, bi = 0; b0 < n; b0 += block, bi++) {
        int64_t len = n - b0 < block ? n - b0 : block;
        double amax = 0;
        for (int64_t i = 0; i < len; i++)
            amax = fmax(amax, fabs(x[b0 + i]));
        float am = (float)fmax(amax, 1e-4f);
        float s = slow_pow2_ceil(am * (1.0f / 448.0f));
        scales[bi] = s;
        for (int64_t i = 0; i < len; i++) {
            double y = (double)x[b0 + i] / s;
            if (y > 448) y = 448;
            if (y < -448) y = -448;
            out[b0 + i] = (float)(ref_e4m3(ref_encode_search(y, ref_e4m3, 0x7e, 0x80)) * s);
        }
    }
}

static void slow_fp4_qdq(const float *x, float *out, int64_t n, int block) {
    for (int64_t b0 = 0; b0 < n; b0 += block) {
        int64_t len = n - b0 < block ? n - b0 : block;
        double amax = 0;
        for (int64_t i = 0; i < len; i++)
            amax = fmax(amax, fabs(x[b0 + i]));
        float am = (float)fmax(amax, 6.0 * ldexp(1.0, -126));
        float s = slow_pow2_ceil(am / 6.0f);
        for (int64_t i = 0; i < len; i++) {
            double y = (double)x[b0 + i] / s;
            if (y > 6) y = 6;
            if (y < -6) y = -6;
            out[b0 + i] = (float)(ref_e2m1(ref_encode_search(y, ref_e2m1, 7, 8)) * s);
        }
    }
}

/* Random data with a different magnitude per block, one all-zero block and one
 * block of values below the 1e-4 floor. */
static void fill_test_vector(float *x, int64_t n, int block) {
    for (int64_t i = 0; i < n; i++) {
        int64_t b = i / block;
        int mag = (int)((b * 7) % 20) - 12;
        x[i] = (float)ldexp(rng_unit() * 2 - 1, mag);
        if (b == 1) x[i] = 0.0f;
        if (b == 2) x[i] *= 1e-7f;
    }
}

static void test_fp8_quant_dequant_vs_slow(void) {
    static const struct {
        int64_t n;
        int block;
    } cfg[] = {{128 * 5, 128}, {128 * 4 + 44, 128}, {64 * 6 + 1, 64}, {7, 64}, {300, 64}};
    float x[1024], got[1024], want[1024], gs[16], ws[16];
    for (size_t k = 0; k < sizeof cfg / sizeof cfg[0]; k++) {
        int64_t n = cfg[k].n;
        int block = cfg[k].block;
        fill_test_vector(x, n, block);
        slow_fp8_qdq(x, want, n, block, ws);
        dsv4_fp8_quant_dequant(x, got, n, block, gs);
        int bad = 0;
        for (int64_t i = 0; i < n; i++)
            if (got[i] != want[i] && bad++ < 3)
                fprintf(stderr, "  cfg %zu i=%lld x=%.9g got %.9g want %.9g\n", k, (long long)i, x[i], got[i],
                        want[i]);
        CHECKF(bad == 0, "cfg %zu: %d mismatches", k, bad);
        for (int64_t b = 0; b < (n + block - 1) / block; b++)
            CHECK(gs[b] == ws[b]);
        /* in place gives the same */
        dsv4_fp8_quant_dequant(x, x, n, block, NULL);
        CHECK(memcmp(x, got, (size_t)n * sizeof(float)) == 0);
    }
    /* Every e4m3 value, every midpoint between neighbours (ties) and a hair to
     * each side of it, with 448 in the block so the scale is 1: the whole
     * grid including subnormals, checked against the slow path. */
    {
        static float g[4 * 127], gg[4 * 127], gw[4 * 127];
        float s1, s2[8];
        int m = 0;
        for (int c = 0; c < 0x7e; c++) {
            float lo = dsv4_e4m3_to_f32((uint8_t)c), hi = dsv4_e4m3_to_f32((uint8_t)(c + 1));
            float mid = (lo + hi) * 0.5f;
            g[m++] = (c & 1) ? -mid : mid;
            g[m++] = nextafterf(mid, 0.0f);
            g[m++] = -nextafterf(mid, INFINITY);
            g[m++] = lo;
        }
        g[m++] = 448.0f;
        dsv4_fp8_quant_dequant(g, gg, m, m, &s1);
        slow_fp8_qdq(g, gw, m, m, s2);
        CHECK(s1 == 1.0f && s2[0] == 1.0f);
        int bad = 0;
        for (int i = 0; i < m; i++)
            bad += gg[i] != gw[i];
        CHECK_EQ_INT(bad, 0);
    }
    /* zero block: scale from the 1e-4 floor, outputs zero */
    float z[128] = {0}, zs;
    dsv4_fp8_quant_dequant(z, z, 128, 128, &zs);
    CHECK(zs == slow_pow2_ceil(1e-4f / 448.0f) && z[0] == 0.0f && z[127] == 0.0f);
    /* a hand case: amax 448 -> s = 1, values keep e4m3 rounding */
    float h[4] = {448.0f, 1.0625f, -3.3f, 0.0f}, hs;
    dsv4_fp8_quant_dequant(h, h, 4, 128, &hs);
    CHECK(hs == 1.0f && h[0] == 448.0f && h[1] == 1.0f && h[2] == -3.25f);
    /* NaN in a block poisons only that block */
    float nb[8] = {1, 2, NAN, 4, 5, 6, 7, 8};
    dsv4_fp8_quant_dequant(nb, nb, 8, 4, NULL);
    CHECK(isnan(nb[0]) && isnan(nb[3]) && nb[4] == 5.0f && nb[7] == 8.0f);
}

static void test_fp4_quant_dequant_vs_slow(void) {
    static const struct {
        int64_t n;
        int block;
    } cfg[] = {{32 * 8, 32}, {32 * 5 + 17, 32}, {3, 32}, {129, 16}};
    float x[512], got[512], want[512];
    for (size_t k = 0; k < sizeof cfg / sizeof cfg[0]; k++) {
        int64_t n = cfg[k].n;
        int block = cfg[k].block;
        fill_test_vector(x, n, block);
        slow_fp4_qdq(x, want, n, block);
        dsv4_fp4_quant_dequant(x, got, n, block);
        int bad = 0;
        for (int64_t i = 0; i < n; i++)
            if (got[i] != want[i] && bad++ < 3)
                fprintf(stderr, "  cfg %zu i=%lld x=%.9g got %.9g want %.9g\n", k, (long long)i, x[i], got[i],
                        want[i]);
        CHECKF(bad == 0, "cfg %zu: %d mismatches", k, bad);
    }
    float h[4] = {6.0f, 2.5f, -0.8f, 5.0f};
    dsv4_fp4_quant_dequant(h, h, 4, 32);
    CHECK(h[0] == 6.0f && h[1] == 2.0f && h[2] == -1.0f && h[3] == 4.0f);
    float t[2] = {12.0f, 5.0f}; /* s = 2: 5/2 = 2.5 ties to 2 -> 4 */
    dsv4_fp4_quant_dequant(t, t, 2, 32);
    CHECK(t[0] == 12.0f && t[1] == 4.0f);
}

static void test_hadamard(void) {
    float v2[2] = {3.0f, 1.0f};
    dsv4_hadamard(v2, 2);
    CHECK_NEAR(v2[0], 4.0 / sqrt(2.0), 1e-6);
    CHECK_NEAR(v2[1], 2.0 / sqrt(2.0), 1e-6);
    float v4[4] = {1, 0, 0, 0};
    dsv4_hadamard(v4, 4);
    for (int i = 0; i < 4; i++)
        CHECK(v4[i] == 0.5f);
    /* Sylvester order: column j of H_n is (-1)^popcount(i&j) / sqrt(n). */
    static const int ns[] = {8, 128};
    for (int k = 0; k < 2; k++) {
        int n = ns[k];
        for (int j = 0; j < n; j++) {
            float e[128] = {0};
            e[j] = 1.0f;
            dsv4_hadamard(e, n);
            for (int i = 0; i < n; i++) {
                double want = (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) / sqrt((double)n);
                CHECKF(fabs(e[i] - want) < 1e-6, "n=%d i=%d j=%d", n, i, j);
            }
        }
    }
    /* H.H = I */
    float x[128], y[128];
    for (int i = 0; i < 128; i++)
        x[i] = y[i] = (float)(rng_unit() * 2 - 1);
    dsv4_hadamard(y, 128);
    dsv4_hadamard(y, 128);
    for (int i = 0; i < 128; i++)
        CHECK_NEAR(y[i], x[i], 1e-5);
}

static void test_fp8_row_dequant(void) {
    /* 3 x 5 weight, block 2: scale grid 2 x 3 (partial blocks both ways). */
    enum { R = 3, C = 5, B = 2 };
    uint8_t w[R * C];
    for (int i = 0; i < R * C; i++)
        w[i] = (uint8_t)(0x30 + i * 5); /* various, some negative */
    w[4] = 0xb8;                        /* -1.0 */
    uint8_t se[2 * 3] = {127, 128, 120, 130, 126, 0};
    float sf[2 * 3] = {1.0f, 0.5f, 3.0f, -2.0f, 0.25f, 10.0f};
    float out[C];
    for (int r = 0; r < R; r++) {
        dsv4_dequant_fp8_row(w, se, NULL, r, C, B, out);
        for (int c = 0; c < C; c++) {
            double want = ref_e4m3(w[r * C + c]) * ref_e8m0(se[(r / B) * 3 + c / B]);
            CHECKF(same_float(out[c], (float)want), "e8m0 r=%d c=%d got %.9g want %.9g", r, c, out[c], want);
        }
        dsv4_dequant_fp8_row(w, NULL, sf, r, C, B, out);
        for (int c = 0; c < C; c++) {
            double want = ref_e4m3(w[r * C + c]) * sf[(r / B) * 3 + c / B];
            CHECKF(same_float(out[c], (float)want), "f32 r=%d c=%d", r, c);
        }
    }
    /* literal case: row 0 col 4 is -1.0 x 2^(128-127)... col 4 is in column block 2: scale 2^-7 */
    dsv4_dequant_fp8_row(w, se, NULL, 0, C, B, out);
    CHECK(out[4] == -0x1p-7f);
    /* block 128 with a NaN scale propagates NaN */
    uint8_t w2[2] = {0x38, 0x40};
    uint8_t s2[1] = {0xff};
    dsv4_dequant_fp8_row(w2, s2, NULL, 0, 2, 128, out);
    CHECK(isnan(out[0]) && isnan(out[1]));
}

static void test_fp4_row_dequant(void) {
    static const int64_t colss[] = {64, 66, 65, 7};
    for (size_t k = 0; k < sizeof colss / sizeof colss[0]; k++) {
        int64_t cols = colss[k];
        enum { R = 3 };
        int64_t bpr = (cols + 1) / 2;
        uint8_t w[R * 40] = {0};
        uint8_t codes[R][80];
        for (int r = 0; r < R; r++)
            for (int64_t c = 0; c < cols; c++) {
                codes[r][c] = (uint8_t)((r * 7 + c * 3 + (c >> 3)) & 15);
                w[r * bpr + c / 2] |= (uint8_t)(codes[r][c] << ((c & 1) * 4));
            }
        /* MXFP4: e8m0 per 32 */
        int64_t g32 = (cols + 31) / 32;
        uint8_t s32[R * 3];
        for (int i = 0; i < R * 3; i++)
            s32[i] = (uint8_t)(120 + i * 2);
        float out[80];
        for (int r = 0; r < R; r++) {
            dsv4_dequant_mxfp4_row(w, s32, r, cols, out);
            for (int64_t c = 0; c < cols; c++) {
                double want = ref_e2m1(codes[r][c]) * ref_e8m0(s32[r * g32 + c / 32]);
                CHECKF(same_float(out[c], (float)want), "mxfp4 cols=%lld r=%d c=%lld got %.9g want %.9g",
                       (long long)cols, r, (long long)c, out[c], want);
            }
        }
        /* NVFP4: e4m3 per 16, global scale2 */
        int64_t g16 = (cols + 15) / 16;
        uint8_t s16[R * 5];
        for (int i = 0; i < R * 5; i++)
            s16[i] = (uint8_t)(0x30 + i * 3);
        const float scale2 = 0x1p-12f;
        for (int r = 0; r < R; r++) {
            dsv4_dequant_nvfp4_row(w, s16, scale2, r, cols, out);
            for (int64_t c = 0; c < cols; c++) {
                double want = ref_e2m1(codes[r][c]) * ref_e4m3(s16[r * g16 + c / 16]) * scale2;
                CHECKF(same_float(out[c], (float)want), "nvfp4 cols=%lld r=%d c=%lld", (long long)cols, r,
                       (long long)c);
            }
        }
    }
    /* literal: byte 0x7a = low nibble 0xa (-1.0), high 0x7 (6.0); scale 2^1 */
    uint8_t w1[1] = {0x7a}, s1[1] = {128};
    float o[2];
    dsv4_dequant_mxfp4_row(w1, s1, 0, 2, o);
    CHECK(o[0] == -2.0f && o[1] == 12.0f);
}

static void test_plain_row_dequant(void) {
    uint16_t wb[6] = {0x3f80, 0x4000, 0xbf80, 0x4040, 0x0000, 0x8000};
    float out[3];
    dsv4_dequant_bf16_row(wb, 1, 3, out);
    CHECK(out[0] == 3.0f && out[1] == 0.0f && signbit(out[2]));
    float wf[4] = {1, 2, 3, 4};
    dsv4_dequant_f32_row(wf, 1, 2, out);
    CHECK(out[0] == 3.0f && out[1] == 4.0f);
}

TEST_MAIN(test_e4m3_decode_all, test_e8m0_decode_all, test_e2m1_decode_all, test_roundtrip_all_codes,
          test_f16_decode_values, test_e4m3_rne_ties_and_saturation, test_e2m1_rne, test_e8m0_encode,
          test_bf16_rne_and_nan, test_f16_rne, test_pow2_ceil, test_fp8_quant_dequant_vs_slow,
          test_fp4_quant_dequant_vs_slow, test_hadamard, test_fp8_row_dequant, test_fp4_row_dequant,
          test_plain_row_dequant)
