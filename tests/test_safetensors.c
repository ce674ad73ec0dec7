/* tests/test_safetensors: writer -> reader round trips (single file, one-file
 * directory, sharded directory with an index) and a table of malformed inputs,
 * each of which must fail with a message naming what is wrong. */
#include <ftw.h>
#include <stdint.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model/safetensors.h"
#include "test.h"

/* ----- scratch directories ----- */

static char scratch[256];

static void scratch_new(void) {
    snprintf(scratch, sizeof scratch, "/tmp/dsv4_test_st_XXXXXX");
    if (!mkdtemp(scratch)) {
        perror("mkdtemp");
        exit(1);
    }
}

static int rm_entry(const char *p, const struct stat *sb, int flag, struct FTW *ftw) {
    (void)sb, (void)flag, (void)ftw;
    return remove(p);
}
static void scratch_free(void) {
    nftw(scratch, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

static const char *in_scratch(const char *name) {
    static char buf[4][512];
    static int k;
    k = (k + 1) & 3;
    snprintf(buf[k], sizeof buf[k], "%s/%s", scratch, name);
    return buf[k];
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f || fwrite(p, 1, n, f) != n || fclose(f) != 0) {
        perror(path);
        exit(1);
    }
}

/* A raw safetensors image: 8-byte length, header text, `data_len` bytes of data. */
static uint8_t *raw_image(const char *header, size_t data_len, size_t *len) {
    size_t hl = strlen(header);
    *len = 8 + hl + data_len;
    uint8_t *b = calloc(1, *len + 8); /* + 8: room for the aligned copy below */
    for (int i = 0; i < 8; i++)
        b[i] = (uint8_t)((uint64_t)hl >> (8 * i));
    memcpy(b + 8, header, hl);
    for (size_t i = 0; i < data_len; i++)
        b[8 + hl + i] = (uint8_t)i;
    return b;
}

/* ----- writing helpers ----- */

typedef struct {
    const char *name;
    dsv4_dtype dt;
    int ndim;
    int64_t shape[4];
} decl;

static size_t decl_bytes(const decl *d) {
    size_t n = dsv4_dtype_size(d->dt);
    for (int i = 0; i < d->ndim; i++)
        n *= (size_t)d->shape[i];
    return n;
}

/* Deterministic content per tensor so a mix-up between tensors shows. */
static void fill_content(uint8_t *p, size_t n, int seed) {
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)(i * 31 + (size_t)seed * 101 + 7);
}

/* Writes the tensors, data in `chunk`-byte pieces (0: one call per tensor). */
static int write_st(const char *path, const decl *d, int n, size_t chunk, dsv4_err *err) {
    dsv4_st_writer *w;
    if (dsv4_st_writer_open(&w, path, err) < 0) return -1;
    for (int i = 0; i < n; i++)
        if (dsv4_st_writer_add(w, d[i].name, d[i].dt, d[i].ndim, d[i].shape, err) < 0) {
            dsv4_st_writer_close(w, NULL);
            return -1;
        }
    if (dsv4_st_writer_begin_data(w, err) < 0) {
        dsv4_st_writer_close(w, NULL);
        return -1;
    }
    size_t total = 0;
    for (int i = 0; i < n; i++)
        total += decl_bytes(&d[i]);
    uint8_t *all = malloc(total + 1), *p = all;
    for (int i = 0; i < n; i++) {
        fill_content(p, decl_bytes(&d[i]), i);
        p += decl_bytes(&d[i]);
    }
    int rc = 0;
    if (chunk == 0) {
        p = all;
        for (int i = 0; i < n && rc == 0; i++) {
            rc = dsv4_st_writer_data(w, p, decl_bytes(&d[i]), err);
            p += decl_bytes(&d[i]);
        }
    } else {
        for (size_t o = 0; o < total && rc == 0; o += chunk)
            rc = dsv4_st_writer_data(w, all + o, total - o < chunk ? total - o : chunk, err);
    }
    free(all);
    if (rc < 0) {
        dsv4_st_writer_close(w, NULL);
        return -1;
    }
    return dsv4_st_writer_close(w, err);
}

static void check_contents(const dsv4_st *st, const decl *d, int n) {
    for (int i = 0; i < n; i++) {
        const dsv4_tensor *t = dsv4_st_find(st, d[i].name);
        CHECKF(t != NULL, "tensor %s not found", d[i].name);
        if (!t) continue;
        CHECK_STR(t->name, d[i].name);
        CHECK_EQ_INT(t->dtype, d[i].dt);
        CHECK_EQ_INT(t->ndim, d[i].ndim);
        for (int k = 0; k < d[i].ndim; k++)
            CHECK_EQ_INT(t->shape[k], d[i].shape[k]);
        size_t nb = decl_bytes(&d[i]);
        CHECK_EQ_INT(t->nbytes, nb);
        CHECKF((uintptr_t)t->data % dsv4_dtype_size(t->dtype) == 0, "%s misaligned", d[i].name);
        uint8_t *want = malloc(nb + 1);
        fill_content(want, nb, i);
        CHECKF(nb == 0 || memcmp(t->data, want, nb) == 0, "%s content differs", d[i].name);
        free(want);
    }
}

/* ----- tests ----- */

static void test_dtype_table(void) {
    static const char *names[] = {"BF16", "F16", "F32", "F8_E4M3", "F8_E8M0", "I8", "U8", "I32", "I64"};
    static const size_t sizes[] = {2, 2, 4, 1, 1, 1, 1, 4, 8};
    for (int i = 0; i < DSV4_DT_COUNT; i++) {
        dsv4_dtype dt;
        CHECK(dsv4_dtype_parse(names[i], &dt) == 0 && dt == (dsv4_dtype)i);
        CHECK_STR(dsv4_dtype_name((dsv4_dtype)i), names[i]);
        CHECK_EQ_INT(dsv4_dtype_size((dsv4_dtype)i), sizes[i]);
    }
    dsv4_dtype dt;
    CHECK(dsv4_dtype_parse("F64", &dt) < 0);
    CHECK(dsv4_dtype_parse("bf16", &dt) < 0);
}

static const decl ALL_DTYPES[] = {
    {"a.bf16", DSV4_DT_BF16, 2, {3, 5}},  {"b.f16", DSV4_DT_F16, 1, {7}},
    {"c.f32", DSV4_DT_F32, 3, {2, 3, 1}}, {"d.e4m3", DSV4_DT_F8_E4M3, 2, {4, 9}},
    {"e.e8m0", DSV4_DT_F8_E8M0, 1, {3}},  {"f.i8", DSV4_DT_I8, 2, {5, 1}},
    {"g.u8", DSV4_DT_U8, 1, {11}},        {"h.i32", DSV4_DT_I32, 1, {3}},
    {"i.i64", DSV4_DT_I64, 2, {2, 3}},    {"j.scalar", DSV4_DT_F32, 0, {0}},
    {"k.empty", DSV4_DT_BF16, 2, {0, 4}}, {"l.odd \"name\"\\/\xc3\xa9", DSV4_DT_U8, 1, {1}},
};
#define N_ALL (int)(sizeof ALL_DTYPES / sizeof ALL_DTYPES[0])

static void test_roundtrip_every_dtype(void) {
    scratch_new();
    dsv4_err err = {{0}};
    char path[512];
    snprintf(path, sizeof path, "%s", in_scratch("model.safetensors"));
    static const size_t chunks[] = {0, 1, 5, 4096};
    for (int c = 0; c < 4; c++) {
        CHECKF(write_st(path, ALL_DTYPES, N_ALL, chunks[c], &err) == 0, "%s", err.msg);
        CHECK(access(in_scratch("model.safetensors.tmp"), F_OK) != 0); /* renamed away */
        dsv4_st *st;
        int orc = dsv4_st_open(&st, path, &err);
        CHECKF(orc == 0, "%s", err.msg);
        if (orc < 0) break;
        CHECK_EQ_INT(dsv4_st_count(st), N_ALL);
        CHECK_EQ_INT(dsv4_st_n_shards(st), 1);
        CHECK_STR(dsv4_st_shard_path(st, 0), path);
        size_t total = 0;
        for (int i = 0; i < N_ALL; i++)
            total += decl_bytes(&ALL_DTYPES[i]);
        CHECK_EQ_INT(dsv4_st_data_bytes(st), total);
        check_contents(st, ALL_DTYPES, N_ALL);
        CHECK(dsv4_st_find(st, "nope") == NULL);
        CHECK(dsv4_st_at(st, N_ALL) == NULL && dsv4_st_at(st, -1) == NULL);
        for (int i = 0; i < N_ALL; i++)
            CHECK(dsv4_st_find(st, dsv4_st_at(st, i)->name) == dsv4_st_at(st, i));
        dsv4_st_close(st);
    }
    /* Header: length a multiple of 8, padded with spaces, format metadata. */
    FILE *f = fopen(path, "rb");
    REQUIRE(f);
    uint8_t len8[8];
    REQUIRE(fread(len8, 1, 8, f) == 8);
    uint64_t hl = 0;
    for (int i = 0; i < 8; i++)
        hl |= (uint64_t)len8[i] << (8 * i);
    CHECK(hl % 8 == 0);
    char *hdr = calloc(1, hl + 1);
    REQUIRE(fread(hdr, 1, hl, f) == hl);
    fclose(f);
    CHECK(strstr(hdr, "\"__metadata__\":{\"format\":\"pt\"}") != NULL);
    CHECK(hl == 0 || hdr[strlen(hdr) - 1] == ' ' || hdr[strlen(hdr) - 1] == '}');
    free(hdr);
    /* A directory holding exactly one .safetensors file opens too. */
    dsv4_st *st;
    CHECKF(dsv4_st_open(&st, scratch, &err) == 0, "%s", err.msg);
    if (st) check_contents(st, ALL_DTYPES, N_ALL);
    dsv4_st_close(st);
    scratch_free();
}

static void test_sharded_directory(void) {
    scratch_new();
    dsv4_err err = {{0}};
    static const decl s1[] = {{"embed.weight", DSV4_DT_BF16, 2, {8, 4}},
                              {"layers.0.attn.wkv.weight", DSV4_DT_F8_E4M3, 2, {4, 4}}};
    static const decl s2[] = {{"layers.0.attn.wkv.scale", DSV4_DT_F8_E8M0, 2, {1, 1}},
                              {"head.weight", DSV4_DT_BF16, 2, {8, 4}},
                              {"norm.weight", DSV4_DT_F32, 1, {4}}};
    REQUIRE(write_st(in_scratch("model-00001-of-00002.safetensors"), s1, 2, 0, &err) == 0);
    REQUIRE(write_st(in_scratch("model-00002-of-00002.safetensors"), s2, 3, 0, &err) == 0);
    const char *index = "{\"metadata\": {\"total_size\": 161},\n \"weight_map\": {\n"
                        "  \"embed.weight\": \"model-00001-of-00002.safetensors\",\n"
                        "  \"head.weight\": \"model-00002-of-00002.safetensors\",\n"
                        "  \"layers.0.attn.wkv.scale\": \"model-00002-of-00002.safetensors\",\n"
                        "  \"layers.0.attn.wkv.weight\": \"model-00001-of-00002.safetensors\",\n"
                        "  \"norm.weight\": \"model-00002-of-00002.safetensors\"}}";
    write_bytes(in_scratch("model.safetensors.index.json"), index, strlen(index));
    dsv4_st *st;
    REQUIRE(dsv4_st_open(&st, scratch, &err) == 0);
    CHECK_EQ_INT(dsv4_st_count(st), 5);
    CHECK_EQ_INT(dsv4_st_n_shards(st), 2);
    CHECK_EQ_INT(dsv4_st_data_bytes(st), 64 + 16 + 1 + 64 + 16);
    /* Contents are generated per shard with the index inside the shard. */
    const dsv4_tensor *h = dsv4_st_find(st, "head.weight");
    REQUIRE(h);
    CHECK(strstr(dsv4_st_shard_path(st, h->shard), "model-00002-of-00002.safetensors") != NULL);
    const dsv4_tensor *e = dsv4_st_find(st, "embed.weight");
    REQUIRE(e);
    CHECK(strstr(dsv4_st_shard_path(st, e->shard), "model-00001-of-00002.safetensors") != NULL);
    uint8_t want[64];
    fill_content(want, 64, 1);
    CHECK(memcmp(h->data, want, 64) == 0);
    fill_content(want, 64, 0);
    CHECK(memcmp(e->data, want, 64) == 0);
    dsv4_st_close(st);
    scratch_free();
}

/* A large header: many tensors must open quickly and all be found. */
static void test_many_tensors(void) {
    scratch_new();
    enum { N = 20000 }; /* enough to exercise the hash table; keeps the test fast under ASan */
    dsv4_err err = {{0}};
    dsv4_st_writer *w;
    char path[512];
    snprintf(path, sizeof path, "%s", in_scratch("big.safetensors"));
    REQUIRE(dsv4_st_writer_open(&w, path, &err) == 0);
    char name[64];
    int64_t shape[1] = {1};
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "layers.%d.ffn.experts.%d.w1.weight", i / 256, i % 256);
        REQUIRE(dsv4_st_writer_add(w, name, DSV4_DT_BF16, 1, shape, &err) == 0);
    }
    REQUIRE(dsv4_st_writer_begin_data(w, &err) == 0);
    uint16_t *vals = malloc(N * sizeof *vals);
    for (int i = 0; i < N; i++)
        vals[i] = (uint16_t)i;
    REQUIRE(dsv4_st_writer_data(w, vals, N * sizeof *vals, &err) == 0);
    free(vals);
    REQUIRE(dsv4_st_writer_close(w, &err) == 0);
    double t0 = dsv4_now();
    dsv4_st *st;
    REQUIRE(dsv4_st_open(&st, path, &err) == 0);
    double t1 = dsv4_now();
    printf("  opened %d tensors in %.1f ms\n", N, (t1 - t0) * 1e3);
    CHECK(t1 - t0 < 5.0);
    CHECK_EQ_INT(dsv4_st_count(st), N);
    int bad = 0;
    for (int i = 0; i < N; i++) {
        snprintf(name, sizeof name, "layers.%d.ffn.experts.%d.w1.weight", i / 256, i % 256);
        const dsv4_tensor *t = dsv4_st_find(st, name);
        if (!t || *(const uint16_t *)t->data != (uint16_t)i) bad++;
    }
    CHECK_EQ_INT(bad, 0);
    dsv4_st_close(st);
    scratch_free();
}

static void test_writer_errors(void) {
    scratch_new();
    dsv4_err err = {{0}};
    char path[512];
    snprintf(path, sizeof path, "%s", in_scratch("w.safetensors"));
    int64_t shape[2] = {2, 2};
    dsv4_st_writer *w;
    /* incomplete data: error, nothing under either name */
    REQUIRE(dsv4_st_writer_open(&w, path, &err) == 0);
    REQUIRE(dsv4_st_writer_add(w, "x", DSV4_DT_F32, 2, shape, &err) == 0);
    REQUIRE(dsv4_st_writer_begin_data(w, &err) == 0);
    float four[4] = {1, 2, 3, 4};
    REQUIRE(dsv4_st_writer_data(w, four, 8, &err) == 0);
    CHECK(dsv4_st_writer_close(w, &err) < 0);
    CHECK(strstr(err.msg, "incomplete") && strstr(err.msg, "'x'"));
    CHECK(access(path, F_OK) != 0);
    CHECK(access(in_scratch("w.safetensors.tmp"), F_OK) != 0);
    /* too much data */
    REQUIRE(dsv4_st_writer_open(&w, path, &err) == 0);
    REQUIRE(dsv4_st_writer_add(w, "x", DSV4_DT_F32, 1, shape, &err) == 0);
    REQUIRE(dsv4_st_writer_begin_data(w, &err) == 0);
    CHECK(dsv4_st_writer_data(w, four, 16, &err) < 0);
    CHECK(strstr(err.msg, "beyond the declared") != NULL);
    CHECK(dsv4_st_writer_close(w, &err) < 0);
    CHECK(access(path, F_OK) != 0);
    /* declaration errors */
    REQUIRE(dsv4_st_writer_open(&w, path, &err) == 0);
    REQUIRE(dsv4_st_writer_add(w, "x", DSV4_DT_F32, 1, shape, &err) == 0);
    CHECK(dsv4_st_writer_add(w, "x", DSV4_DT_F32, 1, shape, &err) < 0 && strstr(err.msg, "twice"));
    CHECK(dsv4_st_writer_add(w, "", DSV4_DT_F32, 1, shape, &err) < 0 && strstr(err.msg, "empty"));
    int64_t neg[1] = {-3};
    CHECK(dsv4_st_writer_add(w, "n", DSV4_DT_F32, 1, neg, &err) < 0 && strstr(err.msg, "negative"));
    int64_t huge[3] = {INT64_C(1) << 40, INT64_C(1) << 40, 4};
    CHECK(dsv4_st_writer_add(w, "h", DSV4_DT_F32, 3, huge, &err) < 0 && strstr(err.msg, "overflow"));
    CHECK(dsv4_st_writer_add(w, "\xff\xfe", DSV4_DT_F32, 1, shape, &err) < 0 && strstr(err.msg, "UTF-8"));
    CHECK(dsv4_st_writer_add(w, "d", DSV4_DT_F32, 9, shape, &err) < 0 && strstr(err.msg, "dimensions"));
    REQUIRE(dsv4_st_writer_begin_data(w, &err) == 0);
    CHECK(dsv4_st_writer_add(w, "late", DSV4_DT_F32, 1, shape, &err) < 0 && strstr(err.msg, "after"));
    REQUIRE(dsv4_st_writer_data(w, four, 8, &err) == 0);
    CHECK(dsv4_st_writer_close(w, &err) == 0);
    CHECK(access(path, F_OK) == 0);
    /* unwritable destination */
    CHECK(dsv4_st_writer_open(&w, "/nonexistent-dir/x.safetensors", &err) < 0 &&
          strstr(err.msg, "cannot create"));
    scratch_free();
}

/* ----- malformed single files ----- */

typedef struct {
    const char *label;
    const char *header; /* NULL: use raw bytes below */
    size_t data_len;
    const char *expect[3]; /* substrings the message must contain */
} bad_case;

static const bad_case BAD[] = {
    {"not json", "{\"a\": {\"dtype\": ", 0, {"not valid JSON"}},
    {"not an object", "[1, 2, 3]", 0, {"not a JSON object"}},
    {"unknown dtype",
     "{\"w.x\": {\"dtype\": \"F64\", \"shape\": [1], \"data_offsets\": [0, 8]}}",
     8,
     {"'w.x'", "dtype 'F64'"}},
    {"dtype not a string",
     "{\"w\": {\"dtype\": 3, \"shape\": [1], \"data_offsets\": [0, 1]}}",
     8,
     {"'w'", "dtype"}},
    {"size mismatch",
     "{\"layers.3.attn.wkv.weight\": {\"dtype\": \"BF16\", \"shape\": [4, 4], \"data_offsets\": [10, 20]}}",
     64,
     {"'layers.3.attn.wkv.weight'", "data_offsets [10,20] span 10 bytes but shape [4,4] x BF16 needs 32"}},
    {"beyond data",
     "{\"w\": {\"dtype\": \"F32\", \"shape\": [8], \"data_offsets\": [0, 32]}}",
     16,
     {"'w'", "beyond the data section"}},
    {"overlap",
     "{\"a\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [0, 8]},"
     " \"b\": {\"dtype\": \"U8\", \"shape\": [8], \"data_offsets\": [4, 12]}}",
     16,
     {"overlap", "'a'", "'b'"}},
    {"overlap hidden behind a short one",
     "{\"a\": {\"dtype\": \"U8\", \"shape\": [16], \"data_offsets\": [0, 16]},"
     " \"b\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [2, 4]},"
     " \"c\": {\"dtype\": \"U8\", \"shape\": [2], \"data_offsets\": [8, 10]}}",
     16,
     {"overlap"}},
    {"negative shape",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [-1], \"data_offsets\": [0, 0]}}",
     0,
     {"'w'", "shape[0]", "non-negative integer"}},
    {"float shape",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [2, 2.0], \"data_offsets\": [0, 4]}}",
     4,
     {"'w'", "shape[1]"}},
    {"shape not list", "{\"w\": {\"dtype\": \"U8\", \"shape\": 4, \"data_offsets\": [0, 4]}}", 4, {"shape"}},
    {"duplicate keys",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]},"
     " \"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [1, 2]}}",
     2,
     {"duplicate"}},
    {"shape overflow",
     "{\"w\": {\"dtype\": \"F32\", \"shape\": [4294967296, 4294967296, 16], \"data_offsets\": [0, 4]}}",
     4,
     {"'w'", "overflows"}},
    {"bytes overflow",
     "{\"w\": {\"dtype\": \"I64\", \"shape\": [4611686018427387904], \"data_offsets\": [0, 4]}}",
     4,
     {"'w'", "overflows"}},
    {"begin after end",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [0], \"data_offsets\": [4, 2]}}",
     8,
     {"begin after end"}},
    {"offsets not a pair",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0]}}",
     8,
     {"data_offsets", "two"}},
    {"negative offset",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [-1, 0]}}",
     8,
     {"data_offsets"}},
    {"missing field",
     "{\"w\": {\"shape\": [1], \"data_offsets\": [0, 1]}}",
     8,
     {"'w'", "missing field 'dtype'"}},
    {"unknown field",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1], \"x\": 1}}",
     8,
     {"unknown field 'x'"}},
    {"entry not object", "{\"w\": [1]}", 0, {"'w'", "not a JSON object"}},
    {"empty name",
     "{\"\": {\"dtype\": \"U8\", \"shape\": [1], \"data_offsets\": [0, 1]}}",
     8,
     {"empty name"}},
    {"metadata not str", "{\"__metadata__\": {\"format\": 1}}", 0, {"__metadata__", "'format'"}},
    {"metadata not object", "{\"__metadata__\": [1]}", 0, {"__metadata__"}},
    {"too many dims",
     "{\"w\": {\"dtype\": \"U8\", \"shape\": [1,1,1,1,1,1,1,1,1], \"data_offsets\": [0, 1]}}",
     8,
     {"'w'", "9 dimensions"}},
    {"misaligned",
     "{\"w\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [2, 6]}}",
     8,
     {"'w'", "aligned"}},
    {"trailing garbage", "{} x", 0, {"not valid JSON"}},
};

static void test_malformed_headers(void) {
    for (size_t i = 0; i < sizeof BAD / sizeof BAD[0]; i++) {
        size_t len;
        uint8_t *img = raw_image(BAD[i].header, BAD[i].data_len, &len);
        /* The data section must start 8-aligned for the alignment rules to be
         * what the case intends: pad the header with spaces. */
        size_t hl = strlen(BAD[i].header), pad = (8 - hl % 8) % 8;
        uint8_t *al = calloc(1, len + pad + 1);
        memcpy(al, img, 8 + hl);
        memset(al + 8 + hl, ' ', pad);
        memcpy(al + 8 + hl + pad, img + 8 + hl, BAD[i].data_len);
        for (int k = 0; k < 8; k++)
            al[k] = (uint8_t)((uint64_t)(hl + pad) >> (8 * k));
        dsv4_tensor *t = NULL;
        int n = -1;
        dsv4_err err = {{0}};
        int rc = dsv4_st_parse_buffer(al, len + pad, "case.safetensors", &t, &n, &err);
        CHECKF(rc < 0, "case '%s' was accepted", BAD[i].label);
        CHECK(t == NULL && n == 0);
        CHECKF(strncmp(err.msg, "case.safetensors: ", 18) == 0,
               "case '%s': message does not name the file: %s", BAD[i].label, err.msg);
        for (int k = 0; k < 3 && BAD[i].expect[k]; k++)
            CHECKF(strstr(err.msg, BAD[i].expect[k]) != NULL, "case '%s': message \"%s\" lacks \"%s\"",
                   BAD[i].label, err.msg, BAD[i].expect[k]);
        free(img);
        free(al);
    }
}

static void test_malformed_lengths(void) {
    dsv4_err err = {{0}};
    dsv4_tensor *t;
    int n;
    uint8_t small[5] = {1, 0, 0, 0, 0};
    CHECK(dsv4_st_parse_buffer(small, 5, "f", &t, &n, &err) < 0 && strstr(err.msg, "truncated"));
    uint8_t beyond[16] = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    CHECK(dsv4_st_parse_buffer(beyond, 16, "f", &t, &n, &err) < 0 && strstr(err.msg, "beyond the file size"));
    uint8_t huge[16] = {0, 0, 0, 0, 0, 0, 0, 0x80};
    CHECK(dsv4_st_parse_buffer(huge, 16, "f", &t, &n, &err) < 0 && strstr(err.msg, "exceeds"));
    uint8_t tiny[16] = {1, 0, 0, 0, 0, 0, 0, 0, '{'};
    CHECK(dsv4_st_parse_buffer(tiny, 16, "f", &t, &n, &err) < 0 && strstr(err.msg, "too small"));
    /* the minimal valid file: "{}" and no data */
    uint8_t empty[10] = {2, 0, 0, 0, 0, 0, 0, 0, '{', '}'};
    CHECK(dsv4_st_parse_buffer(empty, 10, "f", &t, &n, &err) == 0 && n == 0);
    dsv4_st_free_table(t, n);
    /* A file truncated in the data section, through open(). */
    scratch_new();
    static const decl d[] = {{"w", DSV4_DT_F32, 1, {16}}};
    char path[512];
    snprintf(path, sizeof path, "%s", in_scratch("t.safetensors"));
    REQUIRE(write_st(path, d, 1, 0, &err) == 0);
    REQUIRE(truncate(path, 60) == 0);
    dsv4_st *st;
    CHECK(dsv4_st_open(&st, path, &err) < 0 && strstr(err.msg, "beyond") && strstr(err.msg, path));
    REQUIRE(truncate(path, 3) == 0);
    CHECK(dsv4_st_open(&st, path, &err) < 0 && strstr(err.msg, "truncated"));
    REQUIRE(truncate(path, 0) == 0);
    CHECK(dsv4_st_open(&st, path, &err) < 0 && strstr(err.msg, "truncated"));
    CHECK(dsv4_st_open(&st, in_scratch("missing.safetensors"), &err) < 0 && strstr(err.msg, "No such file"));
    scratch_free();
}

/* ----- malformed sharded directories ----- */

static void setup_two_shards(void) {
    dsv4_err err = {{0}};
    static const decl a[] = {{"x", DSV4_DT_F32, 1, {2}}, {"y", DSV4_DT_U8, 1, {3}}};
    static const decl b[] = {{"z", DSV4_DT_BF16, 1, {4}}};
    if (write_st(in_scratch("a.safetensors"), a, 2, 0, &err) < 0 ||
        write_st(in_scratch("b.safetensors"), b, 1, 0, &err) < 0) {
        fprintf(stderr, "setup: %s\n", err.msg);
        exit(1);
    }
}

static void expect_open_fails(const char *index, const char *e1, const char *e2) {
    if (index) write_bytes(in_scratch("model.safetensors.index.json"), index, strlen(index));
    dsv4_st *st = NULL;
    dsv4_err err = {{0}};
    int rc = dsv4_st_open(&st, scratch, &err);
    CHECKF(rc < 0, "index accepted: %s", index ? index : "(none)");
    if (rc == 0) dsv4_st_close(st);
    CHECKF(strstr(err.msg, e1) != NULL, "message \"%s\" lacks \"%s\"", err.msg, e1);
    if (e2) CHECKF(strstr(err.msg, e2) != NULL, "message \"%s\" lacks \"%s\"", err.msg, e2);
}

static void test_malformed_sharded(void) {
    scratch_new();
    /* no files at all */
    expect_open_fails(NULL, "no model.safetensors.index.json", NULL);
    setup_two_shards();
    /* two files without an index */
    expect_open_fails(NULL, "2 .safetensors files", "fit together");
    /* a correct index first, to be sure the failures below come from the edits */
    const char *good =
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", \"z\": \"b.safetensors\"}}";
    write_bytes(in_scratch("model.safetensors.index.json"), good, strlen(good));
    dsv4_st *st = NULL;
    dsv4_err err = {{0}};
    CHECKF(dsv4_st_open(&st, scratch, &err) == 0, "%s", err.msg);
    CHECK_EQ_INT(dsv4_st_count(st), 3);
    dsv4_st_close(st);

    expect_open_fails(
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", \"z\": \"c.safetensors\"}}",
        "c.safetensors", "cannot open");
    expect_open_fails(
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", \"z\": \"b.safetensors\","
        " \"w\": \"b.safetensors\"}}",
        "'w'", "no such tensor");
    expect_open_fails("{\"weight_map\": {\"x\": \"a.safetensors\", \"z\": \"b.safetensors\"}}", "'y'",
                      "not listed");
    expect_open_fails(
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"b.safetensors\", \"z\": \"b.safetensors\"}}",
        "'y'", "places");
    expect_open_fails("{\"weight_map\": {\"x\": \"../a.safetensors\"}}", "'x'", "shard file name");
    expect_open_fails("{\"weight_map\": {\"x\": 3}}", "'x'", "shard file name");
    expect_open_fails("{\"weight_map\": {}}", "lists no tensors", NULL);
    expect_open_fails("{\"metadata\": {}}", "weight_map", NULL);
    expect_open_fails("{\"weight_map\": {\"x\": \"a.safetensors\", \"x\": \"a.safetensors\"}}", "duplicate",
                      NULL);
    expect_open_fails("{\"weight_map\": ", "index.json", "cannot read index");
    /* the same tensor in two shards */
    dsv4_err e2 = {{0}};
    static const decl c[] = {{"z", DSV4_DT_BF16, 1, {4}}};
    REQUIRE(write_st(in_scratch("c.safetensors"), c, 1, 0, &e2) == 0);
    expect_open_fails(
        "{\"weight_map\": {\"x\": \"a.safetensors\", \"y\": \"a.safetensors\", \"z\": \"b.safetensors\","
        " \"q\": \"c.safetensors\"}}",
        "'z'", "two shards");
    /* a bad shard: its message says which file */
    write_bytes(in_scratch("b.safetensors"), "garbage", 7);
    expect_open_fails(good, "b.safetensors", "truncated");
    scratch_free();
}

/* every message is one line (util/err.h): a control byte quoted from the input, here a newline
 * inside the JSON parser's excerpt of a header (the fuzzer's find, 2026-12-04), comes out
 * escaped; dsv4_errf and dsv4_err_prefix escape \n, \r, \t and the rest as \xHH, and a message
 * cut at the buffer's end never ends inside an escape */
static int one_line(const char *m) {
    for (const unsigned char *p = (const unsigned char *)m; *p; p++)
        if (*p < 0x20 || *p == 0x7f) return 0;
    return 1;
}

static void test_error_one_line(void) {
    const char header[] = "{\"__metadata__\":{},\"x\":{\"\\\n\":1}}";
    size_t hl = sizeof header - 1;
    uint8_t img[8 + sizeof header];
    for (int k = 0; k < 8; k++) img[k] = (uint8_t)((uint64_t)hl >> (8 * k));
    memcpy(img + 8, header, hl);
    dsv4_tensor *t = NULL;
    int n = -1;
    dsv4_err err = {{0}};
    CHECK(dsv4_st_parse_buffer(img, 8 + hl, "nl.safetensors", &t, &n, &err) < 0);
    CHECKF(one_line(err.msg), "a control byte in: %s", err.msg);
    CHECKF(strncmp(err.msg, "nl.safetensors: header is not valid JSON", 40) == 0, "%s", err.msg);
    CHECKF(strstr(err.msg, "\\n") != NULL, "the newline is not shown escaped: %s", err.msg);

    dsv4_errf(&err, "a%sb%sc%sd%se", "\n", "\t", "\x01", "\x7f");
    CHECKF(!strcmp(err.msg, "a\\nb\\tc\\x01d\\x7fe"), "%s", err.msg);
    dsv4_errf(&err, "inner\r");
    dsv4_err_prefix(&err, "outer %s", "x\ny");
    CHECKF(!strcmp(err.msg, "outer x\\ny: inner\\r"), "%s", err.msg);
    char many[DSV4_ERR_MAX];
    memset(many, '\n', sizeof many - 1);
    many[sizeof many - 1] = 0;
    dsv4_errf(&err, "%s", many);
    size_t len = strlen(err.msg);
    CHECKF(one_line(err.msg) && len >= DSV4_ERR_MAX - 3 && len <= DSV4_ERR_MAX - 1 && len % 2 == 0 &&
               err.msg[len - 1] == 'n' && err.msg[len - 2] == '\\',
           "cut inside an escape or too short: %zu bytes", len);
    dsv4_errf(&err, "plain %d", 7);
    CHECK(!strcmp(err.msg, "plain 7"));
}

TEST_MAIN(test_dtype_table, test_roundtrip_every_dtype, test_sharded_directory, test_many_tensors,
          test_writer_errors, test_malformed_headers, test_malformed_lengths, test_malformed_sharded,
          test_error_one_line)
