/* tests for model/config: the Flash file, built-ins, round-trips through
 * to_json, every missing math key, wrong types, inconsistent values, and the
 * transformers spellings alone, mixed-consistent and mixed-contradicting. */
#include <jansson.h>

#include "model/config.h"
#include "test.h"

#define FLASH_PATH "data/tokenizer/config.json"
#define FIXTURES "tests/data/configs/"

/* ----- helpers ----- */

static json_t *load_json(const char *path) {
    json_error_t e;
    json_t *j = json_load_file(path, JSON_REJECT_DUPLICATES, &e);
    if (!j) fprintf(stderr, "  cannot load %s: %s\n", path, e.text);
    return j;
}

/* Parses a jansson value through the text interface. */
static int parse_value(dsv4_config *cfg, json_t *j, dsv4_err *err) {
    char *text = json_dumps(j, JSON_COMPACT);
    if (!text) return dsv4_errf(err, "json_dumps failed");
    int rc = dsv4_config_parse(cfg, text, strlen(text), "test", err);
    free(text);
    return rc;
}

static int parse_str(dsv4_config *cfg, const char *text, dsv4_err *err) {
    return dsv4_config_parse(cfg, text, strlen(text), "test", err);
}

/* Expects parsing j to fail with a message containing every non-NULL needle. */
static int expect_fail_(json_t *j, const char *label, const char *n1, const char *n2) {
    dsv4_config cfg;
    dsv4_err err = {{0}};
    if (parse_value(&cfg, j, &err) == 0) {
        fprintf(stderr, "  %s: parsed, expected an error\n", label);
        return 0;
    }
    if ((n1 && !strstr(err.msg, n1)) || (n2 && !strstr(err.msg, n2))) {
        fprintf(stderr, "  %s: message \"%s\" does not name \"%s\"%s%s\n", label, err.msg, n1 ? n1 : "",
                n2 ? " and " : "", n2 ? n2 : "");
        return 0;
    }
    return 1;
}
#define EXPECT_FAIL(j, label, n1, n2) CHECKF(expect_fail_((j), (label), (n1), (n2)), "%s", (label))

static int same(const dsv4_config *a, const dsv4_config *b, const char *label) {
    char diff[64];
    if (dsv4_config_equal(a, b, diff, sizeof diff)) return 1;
    fprintf(stderr, "  %s: configs differ in %s\n", label, diff);
    return 0;
}

/* ----- the Flash file ----- */

static void test_flash_file(void) {
    dsv4_config c;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_config_load(&c, FLASH_PATH, &err) == 0 || (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK_EQ_INT(c.vocab_size, 129280);
    CHECK_EQ_INT(c.dim, 4096);
    CHECK_EQ_INT(c.n_layers, 43);
    CHECK_EQ_INT(c.n_mtp, 1);
    CHECK_EQ_INT(c.n_heads, 64);
    CHECK_EQ_INT(c.head_dim, 512);
    CHECK_EQ_INT(c.rope_dim, 64);
    CHECK_EQ_INT(dsv4_config_nope_dim(&c), 448);
    CHECK_EQ_INT(c.q_lora_rank, 1024);
    CHECK_EQ_INT(c.o_lora_rank, 1024);
    CHECK_EQ_INT(c.o_groups, 8);
    CHECK_EQ_INT(c.window, 128);
    CHECK_EQ_INT(c.moe_inter, 2048);
    CHECK_EQ_INT(c.n_routed, 256);
    CHECK_EQ_INT(c.n_shared, 1);
    CHECK_EQ_INT(c.n_active, 6);
    CHECK_EQ_INT(c.n_hash_layers, 3);
    CHECK_EQ_INT(c.index_n_heads, 64);
    CHECK_EQ_INT(c.index_head_dim, 128);
    CHECK_EQ_INT(c.index_topk, 512);
    CHECK_EQ_INT(c.hc_mult, 4);
    CHECK_EQ_INT(c.hc_sinkhorn_iters, 20);
    CHECK(c.norm_eps == 1e-6 && c.hc_eps == 1e-6);
    CHECK(c.routed_scale == 1.5 && c.swiglu_limit == 10.0);
    CHECK(c.rope_theta == 10000 && c.compress_rope_theta == 160000);
    CHECK(c.yarn_factor == 16 && c.yarn_original_seq == 65536 && c.yarn_beta_fast == 32 &&
          c.yarn_beta_slow == 1);
    CHECK_EQ_INT(c.linear_dtype, DSV4_LINEAR_FP8);
    CHECK_EQ_INT(c.scale_fmt, DSV4_SCALE_UE8M0);
    CHECK_EQ_INT(c.quant_block, 128);
    CHECK_EQ_INT(c.expert_dtype, DSV4_EXPERT_FP4);
    CHECK_EQ_INT(c.bos_id, 0);
    CHECK_EQ_INT(c.eos_id, 1);
    CHECK_EQ_INT(c.max_position, 1048576);
    /* layers 0,1 and MTP: 0; even 2..42: 4 (21 layers); odd 3..41: 128 (20 layers) */
    int n0 = 0, n4 = 0, n128 = 0;
    for (int i = 0; i < 44; i++) {
        int r = c.compress_ratio[i];
        n0 += r == 0, n4 += r == 4, n128 += r == 128;
    }
    CHECK_EQ_INT(n0, 3);
    CHECK_EQ_INT(n4, 21);
    CHECK_EQ_INT(n128, 20);
    CHECK_EQ_INT(c.compress_ratio[43], 0);
    CHECK(dsv4_config_is_hash(&c, 2) && !dsv4_config_is_hash(&c, 3) && !dsv4_config_is_hash(&c, 43));
    CHECK_STR(c.name, FLASH_PATH);

    dsv4_config b;
    REQUIRE(dsv4_config_builtin(&b, "flash", &err) == 0);
    CHECK(same(&b, &c, "builtin flash vs file"));
}

static void test_load_errors(void) {
    dsv4_config c;
    dsv4_err err = {{0}};
    CHECK(dsv4_config_load(&c, "tests/data/configs/no_such_file.json", &err) == -1);
    CHECK(strstr(err.msg, "no_such_file.json") != NULL);
    CHECK(parse_str(&c, "{\"hidden_size\": 1,", &err) == -1);
    CHECK(strstr(err.msg, "invalid JSON") != NULL);
    CHECK(parse_str(&c, "[1, 2]", &err) == -1);
    CHECK(strstr(err.msg, "must be an object") != NULL);
    CHECK(parse_str(&c, "{\"hidden_size\": 1, \"hidden_size\": 2}", &err) == -1);
    CHECK(strstr(err.msg, "hidden_size") != NULL); /* jansson names the duplicate */
    CHECK(dsv4_config_parse(&c, "", 0, "empty", &err) == -1);
    CHECK(dsv4_config_parse(&c, NULL, 0, NULL, &err) == -1);
    /* embedded NUL */
    CHECK(dsv4_config_parse(&c, "{}\0{}", 5, "nul", &err) == -1);
}

/* ----- built-ins ----- */

static void test_builtins(void) {
    dsv4_config p, t;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_config_builtin(&p, "pro", &err) == 0);
    CHECK_EQ_INT(p.dim, 7168);
    CHECK_EQ_INT(p.n_layers, 61);
    CHECK_EQ_INT(p.n_heads, 128);
    CHECK_EQ_INT(p.q_lora_rank, 1536);
    CHECK_EQ_INT(p.o_groups, 16);
    CHECK_EQ_INT(p.n_routed, 384);
    CHECK_EQ_INT(p.moe_inter, 3072);
    CHECK_EQ_INT(p.index_topk, 1024);
    CHECK(p.routed_scale == 2.5);
    CHECK_EQ_INT(p.compress_ratio[0], 128);
    CHECK_EQ_INT(p.compress_ratio[1], 128);
    CHECK_EQ_INT(p.compress_ratio[2], 4);
    CHECK_EQ_INT(p.compress_ratio[3], 128);
    CHECK_EQ_INT(p.compress_ratio[59], 128);
    CHECK_EQ_INT(p.compress_ratio[60], 4);
    CHECK_EQ_INT(p.compress_ratio[61], 0); /* MTP */
    CHECK_EQ_INT(dsv4_config_total_layers(&p), 62);

    REQUIRE(dsv4_config_builtin(&t, "tiny", &err) == 0);
    static const int ratios[6] = {0, 4, 8, 4, 8, 0};
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(t.compress_ratio[i], ratios[i]);
    CHECK_EQ_INT(t.vocab_size, 129280);
    CHECK_EQ_INT(t.dim, 128);
    CHECK_EQ_INT(t.n_layers, 5);
    CHECK_EQ_INT(t.n_mtp, 1);
    CHECK_EQ_INT(t.n_hash_layers, 2);
    CHECK_EQ_INT(t.n_heads, 4);
    CHECK_EQ_INT(t.head_dim, 128);
    CHECK_EQ_INT(t.rope_dim, 32);
    CHECK_EQ_INT(t.q_lora_rank, 64);
    CHECK_EQ_INT(t.o_lora_rank, 32);
    CHECK_EQ_INT(t.o_groups, 2);
    CHECK_EQ_INT(t.window, 16);
    CHECK_EQ_INT(t.moe_inter, 64);
    CHECK_EQ_INT(t.n_routed, 8);
    CHECK_EQ_INT(t.n_active, 2);
    CHECK_EQ_INT(t.n_shared, 1);
    CHECK_EQ_INT(t.index_n_heads, 4);
    CHECK_EQ_INT(t.index_head_dim, 32);
    CHECK_EQ_INT(t.index_topk, 4);
    CHECK_EQ_INT(t.hc_mult, 4);
    CHECK_EQ_INT(t.hc_sinkhorn_iters, 20);
    CHECK(t.norm_eps == 1e-6 && t.hc_eps == 1e-6 && t.routed_scale == 1.5 && t.swiglu_limit == 10);
    CHECK(t.rope_theta == 10000 && t.compress_rope_theta == 160000);
    CHECK(t.yarn_factor == 16 && t.yarn_original_seq == 65536 && t.yarn_beta_fast == 32 &&
          t.yarn_beta_slow == 1);
    CHECK(t.linear_dtype == DSV4_LINEAR_FP8 && t.scale_fmt == DSV4_SCALE_UE8M0 && t.quant_block == 128);
    CHECK(t.expert_dtype == DSV4_EXPERT_FP4);
    CHECK(t.bos_id == 0 && t.eos_id == 1 && t.max_position == 1048576);
    CHECK_STR(t.name, "tiny");

    CHECK(dsv4_config_builtin(&t, "huge", &err) == -1);
    CHECK(strstr(err.msg, "huge") != NULL);
    CHECK(dsv4_config_builtin(&t, NULL, &err) == -1);
}

/* ----- round trips ----- */

static int roundtrip(const dsv4_config *c, const char *label) {
    char *text = dsv4_config_to_json(c);
    if (!text) {
        fprintf(stderr, "  %s: to_json returned NULL\n", label);
        return 0;
    }
    dsv4_config back;
    dsv4_err err = {{0}};
    int ok = dsv4_config_parse(&back, text, strlen(text), label, &err) == 0;
    if (!ok) fprintf(stderr, "  %s: %s\n", label, err.msg);
    ok = ok && same(c, &back, label);
    free(text);
    return ok;
}

static void test_roundtrip(void) {
    static const char *names[] = {"flash", "pro", "tiny"};
    dsv4_err err = {{0}};
    for (int i = 0; i < 3; i++) {
        dsv4_config c;
        REQUIRE(dsv4_config_builtin(&c, names[i], &err) == 0);
        CHECKF(roundtrip(&c, names[i]), "%s", names[i]);

        dsv4_config v = c;
        v.expert_dtype = DSV4_EXPERT_NVFP4;
        CHECKF(roundtrip(&v, "nvfp4"), "%s nvfp4", names[i]);
        v = c;
        v.expert_dtype = DSV4_EXPERT_FP8;
        v.scale_fmt = DSV4_SCALE_F32;
        CHECKF(roundtrip(&v, "fp8 + f32 scales"), "%s fp8/f32", names[i]);
        v = c;
        v.expert_dtype = DSV4_EXPERT_BF16;
        CHECKF(roundtrip(&v, "bf16 experts, fp8 linears"), "%s", names[i]);
        v = c;
        v.linear_dtype = DSV4_LINEAR_BF16;
        v.quant_block = 0;
        CHECKF(roundtrip(&v, "bf16 linears, fp4 experts"), "%s", names[i]);
        v.expert_dtype = DSV4_EXPERT_BF16;
        CHECKF(roundtrip(&v, "all bf16"), "%s", names[i]);
        v.expert_dtype = DSV4_EXPERT_NVFP4;
        CHECKF(roundtrip(&v, "bf16 linears, nvfp4 experts"), "%s", names[i]);
        v = c;
        v.yarn_factor = 1, v.yarn_original_seq = 0, v.yarn_beta_fast = 0, v.yarn_beta_slow = 0;
        CHECKF(roundtrip(&v, "no yarn"), "%s", names[i]);
        v = c;
        v.norm_eps = 1.0 / 3.0; /* needs 17 digits */
        v.routed_scale = 0.1;
        CHECKF(roundtrip(&v, "odd doubles"), "%s", names[i]);
    }
    /* a schedule transformers' compress_rates cannot express (two 128-style ratios) */
    dsv4_config t;
    REQUIRE(dsv4_config_builtin(&t, "tiny", &err) == 0);
    t.compress_ratio[4] = 16;
    CHECK(roundtrip(&t, "mixed hca ratios"));
    char *text = dsv4_config_to_json(&t);
    REQUIRE(text);
    CHECK(strstr(text, "\"layer_types\"") == NULL);
    free(text);

    /* the writer's output names the transformers keys, with explicit attention_factor */
    REQUIRE(dsv4_config_builtin(&t, "tiny", &err) == 0);
    text = dsv4_config_to_json(&t);
    REQUIRE(text);
    json_error_t je;
    json_t *j = json_loads(text, 0, &je);
    free(text);
    REQUIRE(j);
    json_t *lt = json_object_get(j, "layer_types");
    CHECK(json_array_size(lt) == 5);
    CHECK_STR(json_string_value(json_array_get(lt, 0)), "sliding_attention");
    CHECK_STR(json_string_value(json_array_get(lt, 1)), "compressed_sparse_attention");
    CHECK_STR(json_string_value(json_array_get(lt, 2)), "heavily_compressed_attention");
    CHECK_EQ_INT(json_integer_value(
                     json_object_get(json_object_get(j, "compress_rates"), "heavily_compressed_attention")),
                 8);
    json_t *comp = json_object_get(json_object_get(j, "rope_parameters"), "compress");
    CHECK(json_real_value(json_object_get(comp, "attention_factor")) == 1.0);
    CHECK_STR(json_string_value(json_object_get(comp, "rope_type")), "yarn");
    CHECK(json_number_value(json_object_get(comp, "rope_theta")) == 160000);
    CHECK(json_number_value(json_object_get(j, "partial_rotary_factor")) == 0.25);
    CHECK_STR(json_string_value(json_object_get(json_object_get(j, "quantization_config"), "scale_fmt")),
              "ue8m0");
    CHECK_STR(json_string_value(json_object_get(j, "model_type")), "deepseek_v4");
    CHECK_STR(json_string_value(json_array_get(json_object_get(j, "architectures"), 0)),
              "DeepseekV4ForCausalLM");
    /* short decimals stay short */
    char *compact = json_dumps(j, JSON_COMPACT);
    json_decref(j);
    text = dsv4_config_to_json(&t);
    CHECK(text && strstr(text, "\"rms_norm_eps\": 1e-6") != NULL);
    free(text);
    free(compact);
}

/* ----- missing keys, one at a time, over every key of the Flash file ----- */

/* Keys whose absence is allowed: they do not change the math, or their
 * absence has a documented meaning checked below. */
static const char *OPTIONAL_KEYS[] = {
    "architectures", "attention_bias",      "attention_dropout",
    "bos_token_id",  "eos_token_id",        "expert_dtype",
    "hidden_act",    "initializer_range",   "max_position_embeddings",
    "model_type",    "quantization_config", "tie_word_embeddings",
    "topk_method",   "torch_dtype",         "transformers_version",
    "use_cache",
};

static int is_optional(const char *k) {
    for (size_t i = 0; i < sizeof OPTIONAL_KEYS / sizeof OPTIONAL_KEYS[0]; i++)
        if (!strcmp(k, OPTIONAL_KEYS[i])) return 1;
    return 0;
}

static void test_missing_keys(void) {
    json_t *flash = load_json(FLASH_PATH);
    REQUIRE(flash);
    dsv4_config ref;
    dsv4_err err = {{0}};
    REQUIRE(parse_value(&ref, flash, &err) == 0);
    const char *key;
    json_t *val;
    int n_required = 0;
    json_object_foreach(flash, key, val) {
        json_t *j = json_deep_copy(flash);
        json_object_del(j, key);
        if (is_optional(key)) {
            dsv4_config c;
            CHECKF(parse_value(&c, j, &err) == 0, "without %s: %s", key, err.msg);
        } else {
            n_required++;
            EXPECT_FAIL(j, key, key, NULL);
            /* null counts as missing */
            json_object_set_new(j, key, json_null());
            if (strcmp(key, "rope_scaling")) EXPECT_FAIL(j, key, key, NULL);
        }
        json_decref(j);
    }
    CHECK(n_required >= 30);

    /* nested keys */
    static const char *nested[][2] = {
        {"rope_scaling", "factor"},
        {"rope_scaling", "original_max_position_embeddings"},
        {"rope_scaling", "beta_fast"},
        {"rope_scaling", "beta_slow"},
        {"rope_scaling", "type"},
        {"quantization_config", "quant_method"},
        {"quantization_config", "weight_block_size"},
    };
    for (size_t i = 0; i < sizeof nested / sizeof nested[0]; i++) {
        json_t *j = json_deep_copy(flash);
        json_object_del(json_object_get(j, nested[i][0]), nested[i][1]);
        char label[128];
        snprintf(label, sizeof label, "%s.%s", nested[i][0], nested[i][1]);
        EXPECT_FAIL(j, label, label, NULL);
        json_decref(j);
    }

    /* documented meanings of absence */
    dsv4_config c;
    json_t *j = json_deep_copy(flash);
    json_object_del(j, "expert_dtype");
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK_EQ_INT(c.expert_dtype, DSV4_EXPERT_FP8); /* reference: experts share the fp8 linears' format */
    json_object_del(j, "quantization_config");
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK(c.linear_dtype == DSV4_LINEAR_BF16 && c.expert_dtype == DSV4_EXPERT_BF16);
    json_decref(j);
    j = json_deep_copy(flash);
    json_object_del(j, "quantization_config");
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK(c.linear_dtype == DSV4_LINEAR_BF16 && c.expert_dtype == DSV4_EXPERT_FP4);
    json_object_del(j, "bos_token_id");
    json_object_del(j, "eos_token_id");
    json_object_del(j, "max_position_embeddings");
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK(c.bos_id == 0 && c.eos_id == 1 && c.max_position == 1048576);
    /* rope_scaling: null is an explicit "no YaRN" */
    json_object_set_new(j, "rope_scaling", json_null());
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK(c.yarn_original_seq == 0 && c.yarn_factor == 1);
    json_decref(j);
    json_decref(flash);
}

/* ----- wrong types and inconsistent values ----- */

typedef struct {
    const char *key;   /* top-level key to set */
    const char *value; /* JSON text */
    const char *n1, *n2;
} bad_case;

static void run_bad_cases(const bad_case *cases, size_t n) {
    json_t *flash = load_json(FLASH_PATH);
    if (!flash) {
        test_failures_++;
        return;
    }
    for (size_t i = 0; i < n; i++) {
        json_t *j = json_deep_copy(flash);
        json_error_t e;
        json_t *v = json_loads(cases[i].value, JSON_DECODE_ANY, &e);
        if (!v) {
            fprintf(stderr, "  bad test value %s\n", cases[i].value);
            test_failures_++;
            json_decref(j);
            continue;
        }
        json_object_set_new(j, cases[i].key, v);
        char label[256];
        snprintf(label, sizeof label, "%s = %s", cases[i].key, cases[i].value);
        EXPECT_FAIL(j, label, cases[i].n1, cases[i].n2);
        json_decref(j);
    }
    json_decref(flash);
}

static void test_wrong_types(void) {
    static const bad_case cases[] = {
        {"hidden_size", "\"4096\"", "hidden_size", "integer"},
        {"hidden_size", "4096.5", "hidden_size", "integer"},
        {"hidden_size", "4096.0", "hidden_size", "integer"},
        {"vocab_size", "true", "vocab_size", NULL},
        {"num_hidden_layers", "[43]", "num_hidden_layers", NULL},
        {"hc_eps", "\"1e-6\"", "hc_eps", "number"},
        {"rms_norm_eps", "{}", "rms_norm_eps", NULL},
        {"rope_theta", "\"10000\"", "rope_theta", NULL},
        {"routed_scaling_factor", "false", "routed_scaling_factor", NULL},
        {"swiglu_limit", "[10]", "swiglu_limit", NULL},
        {"compress_ratios", "\"0,0,4\"", "compress_ratios", "array"},
        {"compress_ratios", "{}", "compress_ratios", NULL},
        {"norm_topk_prob", "1", "norm_topk_prob", NULL},
        {"scoring_func", "7", "scoring_func", "string"},
        {"rope_scaling", "[16]", "rope_scaling", NULL},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": \"16\", \"original_max_position_embeddings\": 65536, "
         "\"beta_fast\": 32, \"beta_slow\": 1}",
         "rope_scaling.factor", NULL},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536.5, "
         "\"beta_fast\": 32, \"beta_slow\": 1}",
         "rope_scaling.original_max_position_embeddings", NULL},
        {"quantization_config", "\"fp8\"", "quantization_config", NULL},
        {"quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": 128}",
         "weight_block_size", NULL},
        {"quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, \"128\"]}",
         "weight_block_size[1]", NULL},
        {"expert_dtype", "4", "expert_dtype", NULL},
        {"layer_types", "\"sliding_attention\"", "layer_types", NULL},
        {"layer_types", "[0, 0, 4]", "layer_types", NULL},
        {"mlp_layer_types", "{}", "mlp_layer_types", NULL},
        {"rope_parameters", "[]", "rope_parameters", NULL},
        {"partial_rotary_factor", "\"0.125\"", "partial_rotary_factor", NULL},
        {"eos_token_id", "\"1\"", "eos_token_id", NULL},
        {"eos_token_id", "[]", "eos_token_id", NULL},
        {"max_position_embeddings", "1e6", "max_position_embeddings", NULL},
        {"model_type", "3", "model_type", NULL},
        {"num_key_value_heads", "null", "num_key_value_heads", NULL},
    };
    run_bad_cases(cases, sizeof cases / sizeof cases[0]);
}

static void test_inconsistent_values(void) {
    static const bad_case cases[] = {
        {"compress_ratios",
         "[0,0,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,4,128,"
         "4,128,4,128,4,128,4,128,4,0]",
         "compress_ratios has 40 entries, expected num_hidden_layers (43) + num_nextn_predict_layers (1)",
         NULL},
        {"head_dim", "64", "head_dim", "qk_rope_head_dim"},
        {"head_dim", "32", "head_dim", "qk_rope_head_dim"},
        {"qk_rope_head_dim", "63", "qk_rope_head_dim", "even"},
        {"num_attention_heads", "60", "num_attention_heads", "o_groups"},
        {"num_experts_per_tok", "257", "num_experts_per_tok", "n_routed_experts"},
        {"num_hash_layers", "44", "num_hash_layers", "num_hidden_layers"},
        {"hc_mult", "0", "hc_mult", NULL},
        {"index_head_dim", "96", "index_head_dim", "power of two"},
        {"num_key_value_heads", "2", "num_key_value_heads", NULL},
        {"scoring_func", "\"softmax\"", "scoring_func", "sqrtsoftplus"},
        {"topk_method", "\"greedy\"", "topk_method", NULL},
        {"norm_topk_prob", "false", "norm_topk_prob", NULL},
        {"hidden_act", "\"gelu\"", "hidden_act", NULL},
        {"tie_word_embeddings", "true", "tie_word_embeddings", NULL},
        {"model_type", "\"deepseek_v3\"", "model_type", NULL},
        {"hidden_size", "0", "hidden_size", "range"},
        {"hidden_size", "-4096", "hidden_size", "range"},
        {"hidden_size", "99999999999", "hidden_size", "range"},
        {"num_hidden_layers", "200", "num_hidden_layers", NULL},
        {"rms_norm_eps", "0", "rms_norm_eps", NULL},
        {"hc_eps", "-1e-6", "hc_eps", NULL},
        {"swiglu_limit", "-1", "swiglu_limit", NULL},
        {"rope_theta", "0", "rope_theta", NULL},
        {"rope_scaling", "{\"type\": \"linear\", \"factor\": 16}", "rope_scaling.type", NULL},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": 0.5, \"original_max_position_embeddings\": 65536, "
         "\"beta_fast\": 32, \"beta_slow\": 1}",
         "rope_scaling.factor", NULL},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536, "
         "\"beta_fast\": 1, \"beta_slow\": 32}",
         "beta_fast", NULL},
        {"rope_scaling", "{\"type\": \"yarn\", \"rope_type\": \"linear\", \"factor\": 16}", "rope_type",
         "type"},
        {"rope_scaling",
         "{\"type\": \"yarn\", \"factor\": 16, \"original_max_position_embeddings\": 65536, "
         "\"beta_fast\": 32, \"beta_slow\": 1, \"attention_factor\": 1.277}",
         "attention_factor", NULL},
        {"quantization_config", "{\"quant_method\": \"awq\"}", "quant_method", "awq"},
        {"quantization_config",
         "{\"quant_method\": \"fp8\", \"fmt\": \"e5m2\", \"weight_block_size\": [128, 128]}",
         "quantization_config.fmt", NULL},
        {"quantization_config",
         "{\"quant_method\": \"fp8\", \"scale_fmt\": \"e4m3\", \"weight_block_size\": [128, 128]}",
         "scale_fmt", NULL},
        {"quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": [128, 64]}",
         "weight_block_size", NULL},
        {"quantization_config", "{\"quant_method\": \"fp8\", \"weight_block_size\": [0, 0]}",
         "weight_block_size", NULL},
        {"quantization_config", "{\"quant_method\": \"modelopt\", \"quant_algo\": \"FP8\"}", "quant_algo",
         NULL},
        {"quantization_config", "{\"quant_method\": \"modelopt\"}", "quant_algo", NULL},
        {"expert_dtype", "\"int8\"", "expert_dtype", "int8"},
        {"bos_token_id", "129280", "bos_token_id", "vocab_size"},
        {"eos_token_id", "-1", "eos_token_id", NULL},
    };
    run_bad_cases(cases, sizeof cases / sizeof cases[0]);

    /* edits of single compress_ratios entries */
    json_t *flash = load_json(FLASH_PATH);
    REQUIRE(flash);
    static const struct {
        int index, value;
        const char *needle;
    } edits[] = {
        {5, -4, "compress_ratios[5]"},
        {5, 1, "compress_ratios[5]"},
        {43, 4, NULL}, /* MTP may be compressed: allowed */
    };
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        json_t *j = json_deep_copy(flash);
        json_array_set_new(json_object_get(j, "compress_ratios"), edits[i].index,
                           json_integer(edits[i].value));
        dsv4_config c;
        dsv4_err err = {{0}};
        if (edits[i].needle) {
            EXPECT_FAIL(j, edits[i].needle, edits[i].needle, NULL);
        } else {
            CHECKF(parse_value(&c, j, &err) == 0, "%s", err.msg);
            CHECK_EQ_INT(c.compress_ratio[43], 4);
        }
        json_decref(j);
    }
    /* expert fp8 without quantization_config: no block size */
    json_t *j = json_deep_copy(flash);
    json_object_del(j, "quantization_config");
    json_object_set_new(j, "expert_dtype", json_string("fp8"));
    EXPECT_FAIL(j, "fp8 experts without quantization_config", "quantization_config", NULL);
    json_decref(j);
    /* NVFP4 with a contradicting expert_dtype */
    j = load_json(FIXTURES "flash_nvfp4.json");
    REQUIRE(j);
    json_object_set_new(j, "expert_dtype", json_string("fp8"));
    EXPECT_FAIL(j, "nvfp4 + expert_dtype fp8", "expert_dtype", "NVFP4");
    json_decref(j);
    /* -0731 trailing entries must be 0 */
    j = load_json(FIXTURES "flash_0731_extra.json");
    REQUIRE(j);
    json_array_set_new(json_object_get(j, "compress_ratios"), 45, json_integer(4));
    EXPECT_FAIL(j, "nonzero extra trailing ratio", "compress_ratios[45]", NULL);
    json_decref(j);
    /* no CSA layers at all: index_head_dim is then free */
    j = json_deep_copy(flash);
    json_t *cr = json_object_get(j, "compress_ratios");
    for (size_t i = 0; i < json_array_size(cr); i++)
        if (json_integer_value(json_array_get(cr, i)) == 4) json_array_set_new(cr, i, json_integer(128));
    json_object_set_new(j, "index_head_dim", json_integer(96));
    dsv4_config c;
    dsv4_err err = {{0}};
    CHECKF(parse_value(&c, j, &err) == 0, "%s", err.msg);
    json_decref(j);
    json_decref(flash);
}

/* ----- fixtures: other checkpoints' configs ----- */

static void test_fixtures(void) {
    dsv4_config flash, c;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_config_builtin(&flash, "flash", &err) == 0);

    REQUIRE(dsv4_config_load(&c, FIXTURES "flash_base.json", &err) == 0 ||
            (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK(c.expert_dtype == DSV4_EXPERT_FP8 && c.scale_fmt == DSV4_SCALE_F32 &&
          c.linear_dtype == DSV4_LINEAR_FP8);

    REQUIRE(dsv4_config_load(&c, FIXTURES "flash_nvfp4.json", &err) == 0 ||
            (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK(c.expert_dtype == DSV4_EXPERT_NVFP4 && c.scale_fmt == DSV4_SCALE_UE8M0 &&
          c.linear_dtype == DSV4_LINEAR_FP8 && c.quant_block == 128);

    REQUIRE(dsv4_config_load(&c, FIXTURES "flash_0731_extra.json", &err) == 0 ||
            (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK(same(&flash, &c, "0731 extra entries"));

    REQUIRE(dsv4_config_load(&c, FIXTURES "flash_transformers.json", &err) == 0 ||
            (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK(same(&flash, &c, "transformers-only"));
    REQUIRE(dsv4_config_load(&c, FIXTURES "flash_transformers_flat.json", &err) == 0 ||
            (fprintf(stderr, "  %s\n", err.msg), 0));
    CHECK(same(&flash, &c, "transformers flat rope_parameters"));
}

/* ----- transformers keys: alone, mixed-consistent, mixed-contradicting ----- */

static json_t *tiny_json(void) {
    dsv4_config t;
    if (dsv4_config_builtin(&t, "tiny", NULL)) return NULL;
    char *text = dsv4_config_to_json(&t);
    json_error_t e;
    json_t *j = text ? json_loads(text, 0, &e) : NULL;
    free(text);
    return j;
}

static void test_transformers_only(void) {
    dsv4_config tiny, c;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_config_builtin(&tiny, "tiny", &err) == 0);
    json_t *j = tiny_json();
    REQUIRE(j);
    /* both spellings together (what to_json writes): consistent */
    REQUIRE(parse_value(&c, j, &err) == 0);
    CHECK(same(&tiny, &c, "mixed consistent"));
    /* drop every official spelling that has a transformers twin */
    static const char *official[] = {"compress_ratios", "num_hash_layers",     "qk_rope_head_dim",
                                     "rope_theta",      "compress_rope_theta", "rope_scaling"};
    for (size_t i = 0; i < sizeof official / sizeof official[0]; i++)
        json_object_del(j, official[i]);
    CHECKF(parse_value(&c, j, &err) == 0, "%s", err.msg);
    CHECK(same(&tiny, &c, "transformers only")); /* MTP ratio 0 as in tiny */

    /* and now each transformers key missing in turn names both spellings */
    static const char *tf_keys[][2] = {
        {"layer_types", "compress_ratios"},
        {"mlp_layer_types", "num_hash_layers"},
        {"rope_parameters", "rope_theta"},
    };
    for (size_t i = 0; i < sizeof tf_keys / sizeof tf_keys[0]; i++) {
        json_t *k = json_deep_copy(j);
        json_object_del(k, tf_keys[i][0]);
        EXPECT_FAIL(k, tf_keys[i][0], tf_keys[i][1], NULL);
        json_decref(k);
    }
    json_t *k = json_deep_copy(j);
    json_object_del(k, "partial_rotary_factor");
    json_object_del(json_object_get(json_object_get(k, "rope_parameters"), "main"), "partial_rotary_factor");
    json_object_del(json_object_get(json_object_get(k, "rope_parameters"), "compress"),
                    "partial_rotary_factor");
    EXPECT_FAIL(k, "no rope dims", "qk_rope_head_dim", "partial_rotary_factor");
    json_decref(k);
    k = json_deep_copy(j);
    json_object_del(k, "compress_rates");
    EXPECT_FAIL(k, "no compress_rates", "compress_rates", NULL);
    json_decref(k);
    k = json_deep_copy(j);
    json_object_del(json_object_get(k, "compress_rates"), "heavily_compressed_attention");
    EXPECT_FAIL(k, "no hca rate", "compress_rates.heavily_compressed_attention", NULL);
    json_decref(k);
    k = json_deep_copy(j);
    json_object_del(json_object_get(json_object_get(k, "rope_parameters"), "compress"), "rope_type");
    EXPECT_FAIL(k, "no compress rope_type", "rope_parameters.compress.rope_type", NULL);
    json_decref(k);
    k = json_deep_copy(j);
    json_object_del(json_object_get(json_object_get(k, "rope_parameters"), "compress"), "rope_theta");
    EXPECT_FAIL(k, "no compress rope_theta", "compress_rope_theta", NULL);
    json_decref(k);
    json_decref(j);
}

typedef struct {
    const char *path; /* dotted path of an object member to set */
    const char *value;
    const char *n1, *n2;
} tf_edit;

static json_t *member_parent(json_t *root, const char *path, char *last, size_t last_len) {
    char buf[256];
    snprintf(buf, sizeof buf, "%s", path);
    json_t *cur = root;
    char *save = NULL, *tok = strtok_r(buf, ".", &save), *next;
    while ((next = strtok_r(NULL, ".", &save))) {
        cur = json_object_get(cur, tok);
        tok = next;
    }
    snprintf(last, last_len, "%s", tok);
    return cur;
}

static void test_mixed_contradicting(void) {
    static const tf_edit edits[] = {
        {"mlp_layer_types", "[\"hash_moe\", \"moe\", \"moe\", \"moe\", \"moe\"]", "num_hash_layers",
         "mlp_layer_types"},
        {"mlp_layer_types", "[\"moe\", \"hash_moe\", \"moe\", \"moe\", \"moe\"]", "mlp_layer_types[1]", NULL},
        {"mlp_layer_types", "[\"hash_moe\", \"hash_moe\", \"dense\", \"moe\", \"moe\"]", "mlp_layer_types[2]",
         NULL},
        {"mlp_layer_types", "[\"hash_moe\", \"hash_moe\", \"moe\", \"moe\"]", "mlp_layer_types", "4 entries"},
        {"layer_types",
         "[\"sliding_attention\", \"heavily_compressed_attention\", \"heavily_compressed_attention\", "
         "\"compressed_sparse_attention\", \"heavily_compressed_attention\"]",
         "compress_ratios", "layer_types"},
        {"layer_types",
         "[\"sliding_attention\", \"full_attention\", \"heavily_compressed_attention\", "
         "\"compressed_sparse_attention\", \"heavily_compressed_attention\"]",
         "layer_types[1]", NULL},
        {"layer_types", "[\"sliding_attention\"]", "layer_types", "num_hidden_layers"},
        {"compress_rates.heavily_compressed_attention", "16", "compress_ratios", "layer_types"},
        {"compress_rates.heavily_compressed_attention", "4", "heavily_compressed_attention", NULL},
        {"compress_rates.compressed_sparse_attention", "8", "compressed_sparse_attention", NULL},
        {"compress_rates.full_attention", "1", "full_attention", NULL},
        {"rope_parameters.main.rope_theta", "20000.0", "rope_theta", "rope_parameters.main.rope_theta"},
        {"rope_parameters.main.rope_type", "\"yarn\"", "rope_parameters.main.rope_type", NULL},
        {"rope_parameters.compress.rope_theta", "40000.0", "compress_rope_theta",
         "rope_parameters.compress.rope_theta"},
        {"rope_parameters.compress.factor", "40.0", "rope_scaling", "rope_parameters"},
        {"rope_parameters.compress.beta_fast", "16.0", "rope_scaling", "rope_parameters"},
        {"rope_parameters.compress.rope_type", "\"default\"", "rope_scaling", "rope_parameters"},
        {"rope_parameters.compress.rope_type", "\"longrope\"", "rope_parameters.compress.rope_type", NULL},
        {"rope_parameters.compress.attention_factor", "1.2", "attention_factor", NULL},
        {"rope_parameters.main", "7", "rope_parameters", "main"},
        {"partial_rotary_factor", "0.5", "partial_rotary_factor", "qk_rope_head_dim"},
        {"partial_rotary_factor", "0.3", "partial_rotary_factor", "whole number"},
        {"rope_parameters.compress.partial_rotary_factor", "0.125",
         "rope_parameters.compress.partial_rotary_factor", "qk_rope_head_dim"},
        {"partial_rotary_factor", "1.5", "partial_rotary_factor", NULL},
    };
    json_t *base = tiny_json();
    REQUIRE(base);
    for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
        json_t *j = json_deep_copy(base);
        char last[64];
        json_t *parent = member_parent(j, edits[i].path, last, sizeof last);
        json_error_t e;
        json_t *v = json_loads(edits[i].value, JSON_DECODE_ANY, &e);
        if (!parent || !v) {
            fprintf(stderr, "  bad edit %s\n", edits[i].path);
            test_failures_++;
            json_decref(v);
            json_decref(j);
            continue;
        }
        json_object_set_new(parent, last, v);
        char label[256];
        snprintf(label, sizeof label, "%s = %s", edits[i].path, edits[i].value);
        EXPECT_FAIL(j, label, edits[i].n1, edits[i].n2);
        json_decref(j);
    }
    json_decref(base);
}

/* ----- truncate ----- */

static void test_truncate(void) {
    dsv4_config c;
    dsv4_err err = {{0}};
    REQUIRE(dsv4_config_builtin(&c, "flash", &err) == 0);
    c.compress_ratio[43] = 4; /* mark the MTP entry so the move is visible */
    REQUIRE(dsv4_config_truncate(&c, 4, &err) == 0);
    CHECK_EQ_INT(c.n_layers, 4);
    CHECK_EQ_INT(c.n_mtp, 1);
    CHECK_EQ_INT(c.n_hash_layers, 3);
    static const int want[6] = {0, 0, 4, 128, 4, 0};
    for (int i = 0; i < 6; i++)
        CHECK_EQ_INT(c.compress_ratio[i], want[i]);
    CHECK(roundtrip(&c, "truncated flash"));
    REQUIRE(dsv4_config_truncate(&c, 2, &err) == 0);
    CHECK_EQ_INT(c.n_hash_layers, 2);
    CHECK_EQ_INT(c.compress_ratio[2], 4);
    CHECK_EQ_INT(c.compress_ratio[3], 0);
    CHECK(dsv4_config_truncate(&c, 0, &err) == -1);
    CHECK(dsv4_config_truncate(&c, 3, &err) == -1);
    CHECK(strstr(err.msg, "3") != NULL);
    CHECK_EQ_INT(c.n_layers, 2); /* unchanged by a failed call */
}

TEST_MAIN(test_flash_file, test_load_errors, test_builtins, test_roundtrip, test_missing_keys,
          test_wrong_types, test_inconsistent_values, test_fixtures, test_transformers_only,
          test_mixed_contradicting, test_truncate)
