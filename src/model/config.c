/* model/config: config.json -> dsv4_config (contract in config.h).
 *
 * Two spellings of the same model are read:
 *
 *   the checkpoint's own keys (spec §1.1), e.g. compress_ratios, num_hash_layers,
 *   qk_rope_head_dim, rope_theta / compress_rope_theta / rope_scaling;
 *
 *   the keys transformers' DeepseekV4Config writes (configuration_deepseek_v4.py,
 *   transformers 5.x).  They map onto our fields like this:
 *
 *     transformers key                                  dsv4_config field
 *     ------------------------------------------------  ---------------------------------
 *     layer_types[i] = "sliding_attention"              compress_ratio[i] = 0
 *     layer_types[i] = "compressed_sparse_attention"    compress_ratio[i] = compress_rates
 *                                                         ["compressed_sparse_attention"] (must be 4)
 *     layer_types[i] = "heavily_compressed_attention"   compress_ratio[i] = compress_rates
 *                                                         ["heavily_compressed_attention"] (>1, not 4)
 *     mlp_layer_types = ["hash_moe"]*k + ["moe"]*rest   n_hash_layers = k
 *     partial_rotary_factor (top level, or inside       rope_dim = head_dim * factor
 *       rope_parameters.main / .compress)
 *     rope_parameters.main.rope_theta                   rope_theta (main.rope_type must be "default")
 *     rope_parameters.compress.rope_theta               compress_rope_theta
 *     rope_parameters.compress.{rope_type yarn, factor, yarn_* (rope_type "default" = YaRN off;
 *       original_max_position_embeddings, beta_fast,      attention_factor, if given, must be 1:
 *       beta_slow, attention_factor}                      V4 applies no YaRN mscale, spec §2.4)
 *     rope_parameters flat (no main/compress): rope_type/type + yarn keys = rope_scaling,
 *       rope_theta = the main rope_theta (transformers folds rope_theta in there)
 *
 *   transformers lists only the trunk layers, so with layer_types alone the MTP
 *   layers' compress ratios are not stated anywhere; they are then 0 (every
 *   published V4 checkpoint has 0 there, and MTP does not touch the main logits).
 *   Every other key that changes the math is required in one of the two
 *   spellings; where both are given they must agree, else the error names both.
 */
#include "model/config.h"

#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Integers are bounded so that later size arithmetic (products of two or three
 * config values) cannot overflow int64. */
#define CFG_INT_MAX (1 << 24)
#define CFG_FILE_MAX (16u << 20)

typedef struct {
    json_t *root;
    const char *what;
    dsv4_err *err;
} cfg_ctx;

static const char *jtype(const json_t *v) {
    switch (json_typeof(v)) {
    case JSON_OBJECT:
        return "an object";
    case JSON_ARRAY:
        return "an array";
    case JSON_STRING:
        return "a string";
    case JSON_INTEGER:
        return "an integer";
    case JSON_REAL:
        return "a real number";
    case JSON_TRUE:
        return "true";
    case JSON_FALSE:
        return "false";
    case JSON_NULL:
        return "null";
    }
    return "?";
}

/* Present and not null. */
static json_t *get(json_t *obj, const char *key) {
    json_t *v = obj ? json_object_get(obj, key) : NULL;
    return (v && !json_is_null(v)) ? v : NULL;
}

/* ----- typed readers: `key` is the full dotted name used in messages ----- */

static int int_of(cfg_ctx *c, json_t *v, const char *key, int lo, int hi, int *out) {
    *out = 0;
    if (!json_is_integer(v))
        return dsv4_errf(c->err, "%s: \"%s\" must be an integer, got %s", c->what, key, jtype(v));
    json_int_t x = json_integer_value(v);
    if (x < lo || x > hi)
        return dsv4_errf(c->err, "%s: \"%s\" = %lld is out of range [%d, %d]", c->what, key, (long long)x, lo,
                         hi);
    *out = (int)x;
    return 0;
}

static int num_of(cfg_ctx *c, json_t *v, const char *key, double *out) {
    *out = 0;
    if (!json_is_number(v))
        return dsv4_errf(c->err, "%s: \"%s\" must be a number, got %s", c->what, key, jtype(v));
    double x = json_number_value(v);
    if (!isfinite(x)) return dsv4_errf(c->err, "%s: \"%s\" is not finite", c->what, key);
    *out = x;
    return 0;
}

static int str_of(cfg_ctx *c, json_t *v, const char *key, const char **out) {
    *out = "";
    if (!json_is_string(v))
        return dsv4_errf(c->err, "%s: \"%s\" must be a string, got %s", c->what, key, jtype(v));
    *out = json_string_value(v);
    return 0;
}

static int missing(cfg_ctx *c, const char *key) {
    return dsv4_errf(c->err, "%s: missing required key \"%s\"", c->what, key);
}

static int req_int(cfg_ctx *c, const char *key, int lo, int hi, int *out) {
    json_t *v = get(c->root, key);
    if (!v) return missing(c, key);
    return int_of(c, v, key, lo, hi, out);
}

/* A required positive finite number. */
static int req_pos(cfg_ctx *c, const char *key, double *out) {
    json_t *v = get(c->root, key);
    if (!v) return missing(c, key);
    if (num_of(c, v, key, out)) return -1;
    if (!(*out > 0)) return dsv4_errf(c->err, "%s: \"%s\" = %g must be > 0", c->what, key, *out);
    return 0;
}

/* An optional value that may come from two keys: official `ka` (value a, have
 * ha) and transformers' `kb`.  Both absent: error naming both.  Both present:
 * they must be equal. */
static int merge_num(cfg_ctx *c, const char *ka, int ha, double a, const char *kb, int hb, double b,
                     double *out) {
    if (!ha && !hb) return dsv4_errf(c->err, "%s: missing required key \"%s\" (or \"%s\")", c->what, ka, kb);
    if (ha && hb && a != b)
        return dsv4_errf(c->err, "%s: \"%s\" = %.17g and \"%s\" = %.17g disagree", c->what, ka, a, kb, b);
    *out = ha ? a : b;
    return 0;
}

/* ----- checkpoint-style rope: rope_scaling ----- */

typedef struct {
    int on;
    double factor, original, beta_fast, beta_slow;
} yarn_params;

/* Reads YaRN parameters from an object whose type is yarn; `prefix` names it. */
static int yarn_read(cfg_ctx *c, json_t *o, const char *prefix, yarn_params *y) {
    char key[160];
    static const char *names[4] = {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow"};
    double *dst[4] = {&y->factor, &y->original, &y->beta_fast, &y->beta_slow};
    for (int i = 0; i < 4; i++) {
        snprintf(key, sizeof key, "%s.%s", prefix, names[i]);
        json_t *v = get(o, names[i]);
        if (!v) return missing(c, key);
        if (i == 1) {
            int orig;
            if (int_of(c, v, key, 1, 1 << 30, &orig)) return -1;
            *dst[i] = orig;
        } else if (num_of(c, v, key, dst[i])) {
            return -1;
        }
    }
    if (y->factor < 1)
        return dsv4_errf(c->err, "%s: \"%s.factor\" = %g must be >= 1", c->what, prefix, y->factor);
    if (!(y->beta_slow > 0) || !(y->beta_fast >= y->beta_slow))
        return dsv4_errf(
            c->err,
            "%s: \"%s.beta_fast\" (%g) and \"%s.beta_slow\" (%g) must satisfy beta_fast >= beta_slow > 0",
            c->what, prefix, y->beta_fast, prefix, y->beta_slow);
    /* transformers would scale cos/sin by attention_factor; V4 does not (spec §2.4). */
    json_t *af = get(o, "attention_factor");
    if (af) {
        double a;
        snprintf(key, sizeof key, "%s.attention_factor", prefix);
        if (num_of(c, af, key, &a)) return -1;
        if (a != 1.0)
            return dsv4_errf(c->err,
                             "%s: \"%s\" = %g: DeepSeek-V4 applies no YaRN attention scaling, it must be 1",
                             c->what, key, a);
    }
    y->on = 1;
    return 0;
}

/* The type of a rope object: "rope_type" or legacy "type".  NULL if absent. */
static int rope_type_of(cfg_ctx *c, json_t *o, const char *prefix, const char **out) {
    char key[160];
    json_t *t = get(o, "rope_type");
    json_t *t2 = get(o, "type");
    *out = NULL;
    if (t) {
        snprintf(key, sizeof key, "%s.rope_type", prefix);
        if (str_of(c, t, key, out)) return -1;
    }
    if (t2) {
        const char *s;
        snprintf(key, sizeof key, "%s.type", prefix);
        if (str_of(c, t2, key, &s)) return -1;
        if (*out && strcmp(*out, s))
            return dsv4_errf(c->err, "%s: \"%s.rope_type\" (%s) and \"%s.type\" (%s) disagree", c->what,
                             prefix, *out, prefix, s);
        *out = s;
    }
    return 0;
}

/* A rope object meant for compressed layers: yarn, or default (YaRN off). */
static int yarn_from_object(cfg_ctx *c, json_t *o, const char *prefix, yarn_params *y) {
    const char *type;
    if (rope_type_of(c, o, prefix, &type)) return -1;
    if (!type) return dsv4_errf(c->err, "%s: missing required key \"%s.rope_type\"", c->what, prefix);
    if (!strcmp(type, "yarn")) return yarn_read(c, o, prefix, y);
    if (!strcmp(type, "default")) {
        memset(y, 0, sizeof *y);
        return 0;
    }
    return dsv4_errf(c->err,
                     "%s: \"%s.rope_type\" is \"%s\"; DeepSeek-V4 uses \"yarn\" (or \"default\" for none)",
                     c->what, prefix, type);
}

/* ----- transformers-style rope: rope_parameters ----- */

typedef struct {
    int have_theta, have_ctheta, have_yarn, n_prf;
    double theta, ctheta;
    yarn_params yarn;
    double prf[3];          /* partial_rotary_factor values found */
    const char *prf_key[3]; /* and where */
} tf_rope;

static int prf_add(cfg_ctx *c, tf_rope *r, json_t *o, const char *key) {
    json_t *v = get(o, "partial_rotary_factor");
    if (!v) return 0;
    double x;
    if (num_of(c, v, key, &x)) return -1;
    if (!(x > 0 && x <= 1)) return dsv4_errf(c->err, "%s: \"%s\" = %g must be in (0, 1]", c->what, key, x);
    r->prf[r->n_prf] = x;
    r->prf_key[r->n_prf] = key;
    r->n_prf++;
    return 0;
}

static int tf_rope_read(cfg_ctx *c, tf_rope *r) {
    memset(r, 0, sizeof *r);
    if (prf_add(c, r, c->root, "partial_rotary_factor")) return -1;
    json_t *rp = get(c->root, "rope_parameters");
    if (!rp) return 0;
    if (!json_is_object(rp))
        return dsv4_errf(c->err, "%s: \"rope_parameters\" must be an object, got %s", c->what, jtype(rp));
    json_t *main_o = get(rp, "main"), *comp = get(rp, "compress");
    if (main_o || comp) {
        if (!main_o || !comp || !json_is_object(main_o) || !json_is_object(comp))
            return dsv4_errf(c->err,
                             "%s: \"rope_parameters\" must hold both \"main\" and \"compress\" as objects",
                             c->what);
        const char *type;
        if (rope_type_of(c, main_o, "rope_parameters.main", &type)) return -1;
        if (type && strcmp(type, "default"))
            return dsv4_errf(
                c->err,
                "%s: \"rope_parameters.main.rope_type\" is \"%s\"; uncompressed layers use plain RoPE "
                "(\"default\")",
                c->what, type);
        json_t *t = get(main_o, "rope_theta");
        if (t) {
            if (num_of(c, t, "rope_parameters.main.rope_theta", &r->theta)) return -1;
            r->have_theta = 1;
        }
        t = get(comp, "rope_theta");
        if (t) {
            if (num_of(c, t, "rope_parameters.compress.rope_theta", &r->ctheta)) return -1;
            r->have_ctheta = 1;
        }
        if (yarn_from_object(c, comp, "rope_parameters.compress", &r->yarn)) return -1;
        r->have_yarn = 1;
        if (prf_add(c, r, main_o, "rope_parameters.main.partial_rotary_factor")) return -1;
        if (prf_add(c, r, comp, "rope_parameters.compress.partial_rotary_factor")) return -1;
        return 0;
    }
    /* Flat: transformers' standardised form of rope_scaling + rope_theta. */
    const char *type;
    if (rope_type_of(c, rp, "rope_parameters", &type)) return -1;
    if (type) {
        if (yarn_from_object(c, rp, "rope_parameters", &r->yarn)) return -1;
        r->have_yarn = 1;
    }
    json_t *t = get(rp, "rope_theta");
    if (t) {
        if (num_of(c, t, "rope_parameters.rope_theta", &r->theta)) return -1;
        r->have_theta = 1;
    }
    if (prf_add(c, r, rp, "rope_parameters.partial_rotary_factor")) return -1;
    return 0;
}

/* ----- per-layer schedule ----- */

static int read_compress_ratios(cfg_ctx *c, dsv4_config *cfg, int *have) {
    int total = cfg->n_layers + cfg->n_mtp;
    json_t *a = get(c->root, "compress_ratios");
    *have = 0;
    if (!a) return 0;
    if (!json_is_array(a))
        return dsv4_errf(c->err, "%s: \"compress_ratios\" must be an array, got %s", c->what, jtype(a));
    size_t n = json_array_size(a);
    /* The -0731 variant ships extra trailing entries beyond trunk + MTP; they
     * name no layer we build, so they are accepted only if they are 0 (a
     * nonzero one would mean a layer we do not know about). */
    if (n < (size_t)total)
        return dsv4_errf(c->err,
                         "%s: compress_ratios has %zu entries, expected num_hidden_layers (%d) + "
                         "num_nextn_predict_layers (%d)",
                         c->what, n, cfg->n_layers, cfg->n_mtp);
    for (size_t i = 0; i < n; i++) {
        char key[48];
        snprintf(key, sizeof key, "compress_ratios[%zu]", i);
        int r;
        if (int_of(c, json_array_get(a, i), key, -CFG_INT_MAX, CFG_INT_MAX, &r)) return -1;
        if (r < 0 || r == 1)
            return dsv4_errf(c->err, "%s: \"%s\" = %d: a ratio is 0 (uncompressed) or > 1", c->what, key, r);
        if (i >= (size_t)total) {
            if (r != 0)
                return dsv4_errf(
                    c->err,
                    "%s: \"%s\" = %d: entries past num_hidden_layers + num_nextn_predict_layers (%d) "
                    "must be 0",
                    c->what, key, r, total);
            continue;
        }
        cfg->compress_ratio[i] = r;
    }
    *have = 1;
    return 0;
}

static int read_compress_rate(cfg_ctx *c, json_t *rates, const char *type, int *out) {
    char key[96];
    snprintf(key, sizeof key, "compress_rates.%s", type);
    json_t *v = get(rates, type);
    if (!v) return missing(c, key);
    return int_of(c, v, key, 2, CFG_INT_MAX, out);
}

/* layer_types + compress_rates (transformers) -> ratios[0..n_layers). */
static int read_layer_types(cfg_ctx *c, const dsv4_config *cfg, int *ratios, int *have) {
    json_t *lt = get(c->root, "layer_types");
    *have = 0;
    if (!lt) return 0;
    if (!json_is_array(lt))
        return dsv4_errf(c->err, "%s: \"layer_types\" must be an array, got %s", c->what, jtype(lt));
    if (json_array_size(lt) != (size_t)cfg->n_layers)
        return dsv4_errf(c->err, "%s: \"layer_types\" has %zu entries, expected num_hidden_layers (%d)",
                         c->what, json_array_size(lt), cfg->n_layers);
    json_t *rates = get(c->root, "compress_rates");
    if (rates && !json_is_object(rates))
        return dsv4_errf(c->err, "%s: \"compress_rates\" must be an object, got %s", c->what, jtype(rates));
    if (rates) {
        const char *k;
        json_t *v;
        json_object_foreach(rates, k, v) {
            if (strcmp(k, "compressed_sparse_attention") && strcmp(k, "heavily_compressed_attention"))
                return dsv4_errf(c->err, "%s: \"compress_rates\" has unknown layer type \"%s\"", c->what, k);
        }
    }
    for (int i = 0; i < cfg->n_layers; i++) {
        char key[48];
        snprintf(key, sizeof key, "layer_types[%d]", i);
        const char *s;
        if (str_of(c, json_array_get(lt, i), key, &s)) return -1;
        if (!strcmp(s, "sliding_attention")) {
            ratios[i] = 0;
        } else if (!strcmp(s, "compressed_sparse_attention") || !strcmp(s, "heavily_compressed_attention")) {
            if (!rates) return missing(c, "compress_rates");
            int r;
            if (read_compress_rate(c, rates, s, &r)) return -1;
            /* dsv4 (like the reference) picks the overlapping compressor and the
             * indexer by ratio == 4, transformers by layer type: they must coincide. */
            if (s[0] == 'c' && r != 4)
                return dsv4_errf(c->err, "%s: \"compress_rates.compressed_sparse_attention\" = %d must be 4",
                                 c->what, r);
            if (s[0] == 'h' && r == 4)
                return dsv4_errf(
                    c->err,
                    "%s: \"compress_rates.heavily_compressed_attention\" = 4 would make those layers "
                    "indexed (ratio 4 means compressed_sparse_attention)",
                    c->what);
            ratios[i] = r;
        } else {
            return dsv4_errf(
                c->err,
                "%s: \"%s\" = \"%s\": expected sliding_attention, compressed_sparse_attention or "
                "heavily_compressed_attention",
                c->what, key, s);
        }
    }
    *have = 1;
    return 0;
}

/* mlp_layer_types (transformers): a prefix of hash_moe, then moe. */
static int read_mlp_layer_types(cfg_ctx *c, const dsv4_config *cfg, int *n_hash, int *have) {
    json_t *a = get(c->root, "mlp_layer_types");
    *have = 0;
    if (!a) return 0;
    if (!json_is_array(a))
        return dsv4_errf(c->err, "%s: \"mlp_layer_types\" must be an array, got %s", c->what, jtype(a));
    if (json_array_size(a) != (size_t)cfg->n_layers)
        return dsv4_errf(c->err, "%s: \"mlp_layer_types\" has %zu entries, expected num_hidden_layers (%d)",
                         c->what, json_array_size(a), cfg->n_layers);
    int k = 0, seen_moe = 0;
    for (int i = 0; i < cfg->n_layers; i++) {
        char key[48];
        snprintf(key, sizeof key, "mlp_layer_types[%d]", i);
        const char *s;
        if (str_of(c, json_array_get(a, i), key, &s)) return -1;
        if (!strcmp(s, "hash_moe")) {
            if (seen_moe)
                return dsv4_errf(c->err,
                                 "%s: \"%s\" is hash_moe after a moe layer; hash layers must come first",
                                 c->what, key);
            k++;
        } else if (!strcmp(s, "moe")) {
            seen_moe = 1;
        } else {
            return dsv4_errf(c->err, "%s: \"%s\" = \"%s\": expected hash_moe or moe", c->what, key, s);
        }
    }
    *n_hash = k;
    *have = 1;
    return 0;
}

/* ----- formats: quantization_config and expert_dtype ----- */

static int read_formats(cfg_ctx *c, dsv4_config *cfg) {
    json_t *ed = get(c->root, "expert_dtype");
    const char *eds = NULL;
    if (ed && str_of(c, ed, "expert_dtype", &eds)) return -1;
    int have_ed = eds != NULL;
    dsv4_expert_dtype e = DSV4_EXPERT_BF16;
    if (eds) {
        if (!strcmp(eds, "fp4"))
            e = DSV4_EXPERT_FP4;
        else if (!strcmp(eds, "fp8"))
            e = DSV4_EXPERT_FP8;
        else if (!strcmp(eds, "nvfp4"))
            e = DSV4_EXPERT_NVFP4;
        else if (!strcmp(eds, "bf16"))
            e = DSV4_EXPERT_BF16;
        else
            return dsv4_errf(c->err, "%s: \"expert_dtype\" = \"%s\": expected fp4, fp8, nvfp4 or bf16",
                             c->what, eds);
    }

    json_t *qc = get(c->root, "quantization_config");
    if (!qc) {
        /* No quantization_config: a plain bf16 checkpoint (test configs). */
        cfg->linear_dtype = DSV4_LINEAR_BF16;
        cfg->scale_fmt = DSV4_SCALE_UE8M0;
        cfg->quant_block = 0;
        if (e == DSV4_EXPERT_FP8)
            return dsv4_errf(
                c->err,
                "%s: \"expert_dtype\" = \"fp8\" needs \"quantization_config\" (its weight_block_size)",
                c->what);
        cfg->expert_dtype = e;
        return 0;
    }
    if (!json_is_object(qc))
        return dsv4_errf(c->err, "%s: \"quantization_config\" must be an object, got %s", c->what, jtype(qc));
    json_t *qm = get(qc, "quant_method");
    const char *method;
    if (!qm) return missing(c, "quantization_config.quant_method");
    if (str_of(c, qm, "quantization_config.quant_method", &method)) return -1;

    if (!strcmp(method, "modelopt")) {
        /* NVIDIA ModelOpt NVFP4 (spec §4.2): routed experts NVFP4, every other
         * linear stays FP8 e4m3 128x128 with e8m0 scales.  ModelOpt keeps the
         * source config's "expert_dtype": "fp4" (the experts were cast from
         * MXFP4), so fp4 is accepted beside it. */
        json_t *qa = get(qc, "quant_algo");
        const char *algo;
        if (!qa) return missing(c, "quantization_config.quant_algo");
        if (str_of(c, qa, "quantization_config.quant_algo", &algo)) return -1;
        if (strcmp(algo, "NVFP4"))
            return dsv4_errf(c->err,
                             "%s: \"quantization_config.quant_algo\" = \"%s\": only NVFP4 is supported",
                             c->what, algo);
        if (have_ed && e != DSV4_EXPERT_NVFP4 && e != DSV4_EXPERT_FP4)
            return dsv4_errf(
                c->err, "%s: \"expert_dtype\" = \"%s\" contradicts \"quantization_config.quant_algo\" NVFP4",
                c->what, eds);
        cfg->linear_dtype = DSV4_LINEAR_FP8;
        cfg->scale_fmt = DSV4_SCALE_UE8M0;
        cfg->quant_block = 128;
        cfg->expert_dtype = DSV4_EXPERT_NVFP4;
        return 0;
    }
    if (strcmp(method, "fp8"))
        return dsv4_errf(c->err,
                         "%s: \"quantization_config.quant_method\" = \"%s\": expected fp8 or modelopt",
                         c->what, method);

    /* fmt: only e4m3 exists for V4; transformers' own fp8 configs omit it. */
    json_t *fmt = get(qc, "fmt");
    if (fmt) {
        const char *s;
        if (str_of(c, fmt, "quantization_config.fmt", &s)) return -1;
        if (strcmp(s, "e4m3"))
            return dsv4_errf(c->err, "%s: \"quantization_config.fmt\" = \"%s\": expected e4m3", c->what, s);
    }
    /* scale_fmt ue8m0: official; absent / float / fp32: float32 scales (Flash-Base). */
    json_t *sf = get(qc, "scale_fmt");
    cfg->scale_fmt = DSV4_SCALE_F32;
    if (sf) {
        const char *s;
        if (str_of(c, sf, "quantization_config.scale_fmt", &s)) return -1;
        if (!strcmp(s, "ue8m0"))
            cfg->scale_fmt = DSV4_SCALE_UE8M0;
        else if (strcmp(s, "float") && strcmp(s, "fp32"))
            return dsv4_errf(c->err,
                             "%s: \"quantization_config.scale_fmt\" = \"%s\": expected ue8m0, float or fp32",
                             c->what, s);
    }
    json_t *bs = get(qc, "weight_block_size");
    if (!bs) return missing(c, "quantization_config.weight_block_size");
    if (!json_is_array(bs) || json_array_size(bs) != 2)
        return dsv4_errf(
            c->err, "%s: \"quantization_config.weight_block_size\" must be an array of 2 integers", c->what);
    int b0, b1;
    if (int_of(c, json_array_get(bs, 0), "quantization_config.weight_block_size[0]", 1, 65536, &b0))
        return -1;
    if (int_of(c, json_array_get(bs, 1), "quantization_config.weight_block_size[1]", 1, 65536, &b1))
        return -1;
    if (b0 != b1)
        return dsv4_errf(c->err, "%s: \"quantization_config.weight_block_size\" [%d, %d] must be square",
                         c->what, b0, b1);
    cfg->linear_dtype = DSV4_LINEAR_FP8;
    cfg->quant_block = b0;
    /* The reference's ModelArgs leaves expert_dtype None when absent: experts
     * then share the linears' fp8 format. */
    cfg->expert_dtype = have_ed ? e : DSV4_EXPERT_FP8;
    return 0;
}

/* ----- consistency (shared by parse, builtins and truncate) ----- */

static int is_pow2(int x) {
    return x > 0 && (x & (x - 1)) == 0;
}

static int validate(const dsv4_config *cfg, const char *what, dsv4_err *err) {
    int total = cfg->n_layers + cfg->n_mtp;
    if (cfg->n_layers < 1 || cfg->n_mtp < 0 || total > DSV4_MAX_LAYERS)
        return dsv4_errf(err, "%s: num_hidden_layers (%d) + num_nextn_predict_layers (%d) must be in [1, %d]",
                         what, cfg->n_layers, cfg->n_mtp, DSV4_MAX_LAYERS);
    if (cfg->rope_dim <= 0 || cfg->rope_dim % 2)
        return dsv4_errf(err, "%s: qk_rope_head_dim (%d) must be positive and even (RoPE rotates pairs)",
                         what, cfg->rope_dim);
    if (cfg->head_dim <= cfg->rope_dim)
        return dsv4_errf(err, "%s: head_dim (%d) must be larger than qk_rope_head_dim (%d)", what,
                         cfg->head_dim, cfg->rope_dim);
    if (cfg->n_heads % cfg->o_groups)
        return dsv4_errf(err, "%s: num_attention_heads (%d) is not divisible by o_groups (%d)", what,
                         cfg->n_heads, cfg->o_groups);
    if (cfg->n_active > cfg->n_routed)
        return dsv4_errf(err, "%s: num_experts_per_tok (%d) > n_routed_experts (%d)", what, cfg->n_active,
                         cfg->n_routed);
    if (cfg->n_hash_layers > cfg->n_layers)
        return dsv4_errf(err, "%s: num_hash_layers (%d) > num_hidden_layers (%d)", what, cfg->n_hash_layers,
                         cfg->n_layers);
    if (cfg->hc_mult < 1) return dsv4_errf(err, "%s: hc_mult (%d) must be >= 1", what, cfg->hc_mult);
    int any4 = 0;
    for (int i = 0; i < total; i++) {
        int r = cfg->compress_ratio[i];
        if (r < 0 || r == 1)
            return dsv4_errf(err, "%s: compress_ratios[%d] = %d: a ratio is 0 (uncompressed) or > 1", what, i,
                             r);
        if (r == 4) any4 = 1;
    }
    for (int i = total; i < DSV4_MAX_LAYERS; i++)
        if (cfg->compress_ratio[i])
            return dsv4_errf(err, "%s: compress_ratio[%d] is set past the last layer", what, i);
    if (any4) {
        /* The indexer rotates its queries/keys by a Hadamard transform and
         * applies RoPE to their last rope dims (spec §2.5). */
        if (!is_pow2(cfg->index_head_dim))
            return dsv4_errf(err,
                             "%s: index_head_dim (%d) must be a power of two (ratio-4 layers use a Hadamard "
                             "transform on it)",
                             what, cfg->index_head_dim);
        if (cfg->index_head_dim < cfg->rope_dim)
            return dsv4_errf(err, "%s: index_head_dim (%d) < qk_rope_head_dim (%d)", what,
                             cfg->index_head_dim, cfg->rope_dim);
    }
    if (!(cfg->norm_eps > 0) || !(cfg->hc_eps > 0))
        return dsv4_errf(err, "%s: rms_norm_eps (%g) and hc_eps (%g) must be > 0", what, cfg->norm_eps,
                         cfg->hc_eps);
    if (!(cfg->routed_scale > 0)) return dsv4_errf(err, "%s: routed_scaling_factor must be > 0", what);
    if (!(cfg->swiglu_limit >= 0)) return dsv4_errf(err, "%s: swiglu_limit must be >= 0", what);
    if (!(cfg->rope_theta > 1) || !(cfg->compress_rope_theta > 1))
        return dsv4_errf(err, "%s: rope_theta (%g) and compress_rope_theta (%g) must be > 1", what,
                         cfg->rope_theta, cfg->compress_rope_theta);
    if (cfg->yarn_original_seq != 0 &&
        (!(cfg->yarn_factor >= 1) || !(cfg->yarn_original_seq >= 1) || !(cfg->yarn_beta_slow > 0) ||
         !(cfg->yarn_beta_fast >= cfg->yarn_beta_slow)))
        return dsv4_errf(err, "%s: rope_scaling values are inconsistent (factor %g, original %g, beta %g/%g)",
                         what, cfg->yarn_factor, cfg->yarn_original_seq, cfg->yarn_beta_fast,
                         cfg->yarn_beta_slow);
    if (cfg->bos_id < 0 || cfg->bos_id >= cfg->vocab_size || cfg->eos_id < 0 ||
        cfg->eos_id >= cfg->vocab_size)
        return dsv4_errf(err, "%s: bos_token_id (%d) / eos_token_id (%d) outside vocab_size (%d)", what,
                         cfg->bos_id, cfg->eos_id, cfg->vocab_size);
    if (cfg->max_position < 1) return dsv4_errf(err, "%s: max_position_embeddings must be >= 1", what);
    if (cfg->linear_dtype == DSV4_LINEAR_FP8 && cfg->quant_block < 1)
        return dsv4_errf(err, "%s: fp8 linears need a weight_block_size", what);
    if (cfg->expert_dtype == DSV4_EXPERT_FP8 && cfg->quant_block < 1)
        return dsv4_errf(err, "%s: fp8 experts need a weight_block_size", what);
    return 0;
}

/* ----- the parser ----- */

typedef struct {
    const char *key;
    size_t off;
    int lo;
} int_key;

#define IK(k, f, lo)                                                                                         \
    { k, offsetof(dsv4_config, f), lo }
/* Integer keys read the same way in both spellings. */
static const int_key INT_KEYS[] = {
    IK("vocab_size", vocab_size, 1),
    IK("hidden_size", dim, 1),
    IK("num_hidden_layers", n_layers, 1),
    IK("num_nextn_predict_layers", n_mtp, 0),
    IK("num_attention_heads", n_heads, 1),
    IK("head_dim", head_dim, 1),
    IK("q_lora_rank", q_lora_rank, 1),
    IK("o_lora_rank", o_lora_rank, 1),
    IK("o_groups", o_groups, 1),
    IK("sliding_window", window, 1),
    IK("moe_intermediate_size", moe_inter, 1),
    IK("n_routed_experts", n_routed, 1),
    IK("n_shared_experts", n_shared, 0),
    IK("num_experts_per_tok", n_active, 1),
    IK("index_n_heads", index_n_heads, 1),
    IK("index_head_dim", index_head_dim, 1),
    IK("index_topk", index_topk, 1),
    IK("hc_mult", hc_mult, 1),
    IK("hc_sinkhorn_iters", hc_sinkhorn_iters, 1),
};
#undef IK

static int parse_root(cfg_ctx *c, dsv4_config *cfg) {
    json_t *v;
    const char *s;

    v = get(c->root, "model_type");
    if (v) {
        if (str_of(c, v, "model_type", &s)) return -1;
        if (strcmp(s, "deepseek_v4"))
            return dsv4_errf(c->err, "%s: \"model_type\" is \"%s\", expected deepseek_v4", c->what, s);
    }
    /* Keys that would change the math if set otherwise, checked when present. */
    v = get(c->root, "hidden_act");
    if (v) {
        if (str_of(c, v, "hidden_act", &s)) return -1;
        if (strcmp(s, "silu"))
            return dsv4_errf(c->err, "%s: \"hidden_act\" = \"%s\", expected silu", c->what, s);
    }
    static const char *must_be_false[] = {"tie_word_embeddings", "attention_bias", "mlp_bias"};
    for (size_t i = 0; i < sizeof must_be_false / sizeof must_be_false[0]; i++) {
        v = get(c->root, must_be_false[i]);
        if (v && !json_is_false(v))
            return dsv4_errf(c->err, "%s: \"%s\" must be false for DeepSeek-V4, got %s", c->what,
                             must_be_false[i], jtype(v));
    }
    for (size_t i = 0; i < sizeof INT_KEYS / sizeof INT_KEYS[0]; i++)
        if (req_int(c, INT_KEYS[i].key, INT_KEYS[i].lo, CFG_INT_MAX, (int *)((char *)cfg + INT_KEYS[i].off)))
            return -1;
    if (cfg->n_layers + cfg->n_mtp > DSV4_MAX_LAYERS)
        return dsv4_errf(c->err, "%s: num_hidden_layers (%d) + num_nextn_predict_layers (%d) exceeds %d",
                         c->what, cfg->n_layers, cfg->n_mtp, DSV4_MAX_LAYERS);

    /* Single shared K=V head (MQA): the only layout V4 has. */
    int kvh;
    if (req_int(c, "num_key_value_heads", 0, CFG_INT_MAX, &kvh)) return -1;
    if (kvh != 1)
        return dsv4_errf(c->err, "%s: \"num_key_value_heads\" = %d, DeepSeek-V4 has 1", c->what, kvh);

    v = get(c->root, "scoring_func");
    if (!v) return missing(c, "scoring_func");
    if (str_of(c, v, "scoring_func", &s)) return -1;
    if (strcmp(s, "sqrtsoftplus"))
        return dsv4_errf(c->err, "%s: \"scoring_func\" = \"%s\", expected sqrtsoftplus", c->what, s);
    /* topk_method: V4 has one selection rule; transformers' DeepseekV4Config has
     * no such key, so it may be absent, but any other value is rejected. */
    v = get(c->root, "topk_method");
    if (v) {
        if (str_of(c, v, "topk_method", &s)) return -1;
        if (strcmp(s, "noaux_tc"))
            return dsv4_errf(c->err, "%s: \"topk_method\" = \"%s\", expected noaux_tc", c->what, s);
    }
    v = get(c->root, "norm_topk_prob");
    if (!v) return missing(c, "norm_topk_prob");
    if (!json_is_boolean(v))
        return dsv4_errf(c->err, "%s: \"norm_topk_prob\" must be true or false, got %s", c->what, jtype(v));
    if (!json_is_true(v))
        return dsv4_errf(c->err, "%s: \"norm_topk_prob\" must be true for DeepSeek-V4", c->what);

    if (req_pos(c, "routed_scaling_factor", &cfg->routed_scale)) return -1;
    if (req_pos(c, "hc_eps", &cfg->hc_eps)) return -1;
    if (req_pos(c, "rms_norm_eps", &cfg->norm_eps)) return -1;
    v = get(c->root, "swiglu_limit");
    if (!v) return missing(c, "swiglu_limit");
    if (num_of(c, v, "swiglu_limit", &cfg->swiglu_limit)) return -1;
    if (cfg->swiglu_limit < 0)
        return dsv4_errf(c->err, "%s: \"swiglu_limit\" = %g must be >= 0", c->what, cfg->swiglu_limit);

    /* ----- both spellings: rope dims, thetas, YaRN ----- */
    tf_rope tr;
    if (tf_rope_read(c, &tr)) return -1;
    int have_rd = 0;
    v = get(c->root, "qk_rope_head_dim");
    if (v) {
        if (int_of(c, v, "qk_rope_head_dim", 1, CFG_INT_MAX, &cfg->rope_dim)) return -1;
        have_rd = 1;
    }
    for (int i = 0; i < tr.n_prf; i++) {
        double d = tr.prf[i] * cfg->head_dim;
        int rd = (int)lround(d);
        if (fabs(d - rd) > 1e-6)
            return dsv4_errf(c->err, "%s: \"%s\" (%g) times head_dim (%d) is not a whole number of dims",
                             c->what, tr.prf_key[i], tr.prf[i], cfg->head_dim);
        if (have_rd && rd != cfg->rope_dim)
            return dsv4_errf(c->err, "%s: \"%s\" (%g x head_dim %d = %d) and \"%s\" (%d) disagree", c->what,
                             tr.prf_key[i], tr.prf[i], cfg->head_dim, rd,
                             have_rd == 1 ? "qk_rope_head_dim" : tr.prf_key[0], cfg->rope_dim);
        if (!have_rd) have_rd = 2;
        cfg->rope_dim = rd;
    }
    if (!have_rd)
        return dsv4_errf(
            c->err, "%s: missing required key \"qk_rope_head_dim\" (or \"partial_rotary_factor\")", c->what);

    double theta = 0, ctheta = 0;
    int have_theta = 0, have_ctheta = 0;
    v = get(c->root, "rope_theta");
    if (v) {
        if (num_of(c, v, "rope_theta", &theta)) return -1;
        have_theta = 1;
    }
    v = get(c->root, "compress_rope_theta");
    if (v) {
        if (num_of(c, v, "compress_rope_theta", &ctheta)) return -1;
        have_ctheta = 1;
    }
    if (merge_num(c, "rope_theta", have_theta, theta, "rope_parameters.main.rope_theta", tr.have_theta,
                  tr.theta, &cfg->rope_theta))
        return -1;
    if (merge_num(c, "compress_rope_theta", have_ctheta, ctheta, "rope_parameters.compress.rope_theta",
                  tr.have_ctheta, tr.ctheta, &cfg->compress_rope_theta))
        return -1;

    /* rope_scaling: an object, or null meaning explicitly no YaRN. */
    yarn_params y = {0};
    int have_rs = json_object_get(c->root, "rope_scaling") != NULL;
    v = get(c->root, "rope_scaling");
    if (v) {
        if (!json_is_object(v))
            return dsv4_errf(c->err, "%s: \"rope_scaling\" must be an object or null, got %s", c->what,
                             jtype(v));
        const char *type;
        if (rope_type_of(c, v, "rope_scaling", &type)) return -1;
        if (!type) return missing(c, "rope_scaling.type");
        if (strcmp(type, "yarn"))
            return dsv4_errf(c->err, "%s: \"rope_scaling.type\" is \"%s\", expected yarn", c->what, type);
        if (yarn_read(c, v, "rope_scaling", &y)) return -1;
    }
    if (!have_rs && !tr.have_yarn)
        return dsv4_errf(c->err, "%s: missing required key \"rope_scaling\" (or \"rope_parameters\")",
                         c->what);
    if (have_rs && tr.have_yarn &&
        (y.on != tr.yarn.on ||
         (y.on && (y.factor != tr.yarn.factor || y.original != tr.yarn.original ||
                   y.beta_fast != tr.yarn.beta_fast || y.beta_slow != tr.yarn.beta_slow))))
        return dsv4_errf(c->err, "%s: \"rope_scaling\" and \"rope_parameters\" disagree on YaRN", c->what);
    if (!have_rs) y = tr.yarn;
    if (y.on) {
        cfg->yarn_factor = y.factor;
        cfg->yarn_original_seq = y.original;
        cfg->yarn_beta_fast = y.beta_fast;
        cfg->yarn_beta_slow = y.beta_slow;
    } else {
        cfg->yarn_factor = 1;
        cfg->yarn_original_seq = 0;
        cfg->yarn_beta_fast = 0;
        cfg->yarn_beta_slow = 0;
    }

    /* ----- both spellings: per-layer schedule ----- */
    int have_cr, have_lt, lt_ratio[DSV4_MAX_LAYERS];
    if (read_compress_ratios(c, cfg, &have_cr)) return -1;
    if (read_layer_types(c, cfg, lt_ratio, &have_lt)) return -1;
    if (!have_cr && !have_lt)
        return dsv4_errf(c->err, "%s: missing required key \"compress_ratios\" (or \"layer_types\")",
                         c->what);
    if (have_cr && have_lt) {
        for (int i = 0; i < cfg->n_layers; i++)
            if (cfg->compress_ratio[i] != lt_ratio[i])
                return dsv4_errf(c->err,
                                 "%s: \"compress_ratios\"[%d] = %d and \"layer_types\"[%d] / "
                                 "\"compress_rates\" (ratio %d) "
                                 "disagree",
                                 c->what, i, cfg->compress_ratio[i], i, lt_ratio[i]);
    } else if (have_lt) {
        for (int i = 0; i < cfg->n_layers; i++)
            cfg->compress_ratio[i] = lt_ratio[i];
        /* MTP ratios: not expressible in transformers' keys; 0 (see top). */
    }

    int have_nh = 0, have_mlt, mlt_hash = 0;
    v = get(c->root, "num_hash_layers");
    if (v) {
        if (int_of(c, v, "num_hash_layers", 0, CFG_INT_MAX, &cfg->n_hash_layers)) return -1;
        have_nh = 1;
    }
    if (read_mlp_layer_types(c, cfg, &mlt_hash, &have_mlt)) return -1;
    if (!have_nh && !have_mlt)
        return dsv4_errf(c->err, "%s: missing required key \"num_hash_layers\" (or \"mlp_layer_types\")",
                         c->what);
    if (have_nh && have_mlt && cfg->n_hash_layers != mlt_hash)
        return dsv4_errf(c->err,
                         "%s: \"num_hash_layers\" (%d) and \"mlp_layer_types\" (%d hash_moe layers) disagree",
                         c->what, cfg->n_hash_layers, mlt_hash);
    if (!have_nh) cfg->n_hash_layers = mlt_hash;

    if (read_formats(c, cfg)) return -1;

    /* ----- non-math keys with documented defaults ----- */
    cfg->bos_id = 0;
    cfg->eos_id = 1;
    cfg->max_position = 1048576; /* V4-Flash's 1M context */
    v = get(c->root, "bos_token_id");
    if (v && int_of(c, v, "bos_token_id", 0, CFG_INT_MAX, &cfg->bos_id)) return -1;
    v = get(c->root, "eos_token_id");
    if (v) {
        /* transformers allows a list; the first id is the primary one. */
        if (json_is_array(v)) {
            if (json_array_size(v) == 0)
                return dsv4_errf(c->err, "%s: \"eos_token_id\" is an empty list", c->what);
            if (int_of(c, json_array_get(v, 0), "eos_token_id[0]", 0, CFG_INT_MAX, &cfg->eos_id)) return -1;
        } else if (int_of(c, v, "eos_token_id", 0, CFG_INT_MAX, &cfg->eos_id)) {
            return -1;
        }
    }
    v = get(c->root, "max_position_embeddings");
    if (v) {
        if (!json_is_integer(v))
            return dsv4_errf(c->err, "%s: \"max_position_embeddings\" must be an integer, got %s", c->what,
                             jtype(v));
        json_int_t x = json_integer_value(v);
        if (x < 1 || x > ((json_int_t)1 << 40))
            return dsv4_errf(c->err, "%s: \"max_position_embeddings\" = %lld is out of range", c->what,
                             (long long)x);
        cfg->max_position = x;
    }
    return validate(cfg, c->what, c->err);
}

int dsv4_config_parse(dsv4_config *cfg, const char *json, size_t len, const char *what, dsv4_err *err) {
    if (!what) what = "config.json";
    if (!json) return dsv4_errf(err, "%s: no text", what);
    json_error_t jerr;
    json_t *root = json_loadb(json, len, JSON_REJECT_DUPLICATES, &jerr);
    if (!root)
        return dsv4_errf(err, "%s: invalid JSON at line %d column %d: %s", what, jerr.line, jerr.column,
                         jerr.text);
    if (!json_is_object(root)) {
        int rc = dsv4_errf(err, "%s: top level must be an object, got %s", what, jtype(root));
        json_decref(root);
        return rc;
    }
    dsv4_config tmp;
    memset(&tmp, 0, sizeof tmp);
    snprintf(tmp.name, sizeof tmp.name, "%s", what);
    cfg_ctx c = {root, what, err};
    int rc = parse_root(&c, &tmp);
    json_decref(root);
    if (rc == 0) *cfg = tmp;
    return rc;
}

int dsv4_config_load(dsv4_config *cfg, const char *path, dsv4_err *err) {
    FILE *f = fopen(path, "rb");
    if (!f) return dsv4_errf(err, "%s: cannot open: %s", path, strerror(errno));
    char *buf = malloc(CFG_FILE_MAX + 1);
    if (!buf) {
        fclose(f);
        return dsv4_errf(err, "%s: out of memory", path);
    }
    size_t n = fread(buf, 1, CFG_FILE_MAX + 1, f);
    int bad = ferror(f);
    fclose(f);
    int rc;
    if (bad)
        rc = dsv4_errf(err, "%s: read error", path);
    else if (n > CFG_FILE_MAX)
        rc = dsv4_errf(err, "%s: larger than %u bytes, not a config.json", path, CFG_FILE_MAX);
    else
        rc = dsv4_config_parse(cfg, buf, n, path, err);
    free(buf);
    return rc;
}

/* ----- built-in configs ----- */

static void common_v4(dsv4_config *c) {
    c->vocab_size = 129280;
    c->n_mtp = 1;
    c->head_dim = 512;
    c->rope_dim = 64;
    c->window = 128;
    c->n_shared = 1;
    c->n_active = 6;
    c->n_hash_layers = 3;
    c->index_n_heads = 64;
    c->index_head_dim = 128;
    c->hc_mult = 4;
    c->hc_sinkhorn_iters = 20;
    c->norm_eps = 1e-6;
    c->hc_eps = 1e-6;
    c->swiglu_limit = 10.0;
    c->rope_theta = 10000;
    c->compress_rope_theta = 160000;
    c->yarn_factor = 16;
    c->yarn_original_seq = 65536;
    c->yarn_beta_fast = 32;
    c->yarn_beta_slow = 1;
    c->linear_dtype = DSV4_LINEAR_FP8;
    c->scale_fmt = DSV4_SCALE_UE8M0;
    c->quant_block = 128;
    c->expert_dtype = DSV4_EXPERT_FP4;
    c->bos_id = 0;
    c->eos_id = 1;
    c->max_position = 1048576;
}

int dsv4_config_builtin(dsv4_config *cfg, const char *name, dsv4_err *err) {
    dsv4_config c;
    memset(&c, 0, sizeof c);
    if (!name) return dsv4_errf(err, "no built-in config name given");
    if (!strcmp(name, "flash")) {
        /* spec §1.1 */
        common_v4(&c);
        c.dim = 4096;
        c.n_layers = 43;
        c.n_heads = 64;
        c.q_lora_rank = 1024;
        c.o_lora_rank = 1024;
        c.o_groups = 8;
        c.moe_inter = 2048;
        c.n_routed = 256;
        c.index_topk = 512;
        c.routed_scale = 1.5;
        /* layers 0,1: 0; then even 4, odd 128; MTP (index 43): 0 */
        for (int i = 2; i < c.n_layers; i++)
            c.compress_ratio[i] = i % 2 ? 128 : 4;
    } else if (!strcmp(name, "pro")) {
        /* spec §1.3 */
        common_v4(&c);
        c.dim = 7168;
        c.n_layers = 61;
        c.n_heads = 128;
        c.q_lora_rank = 1536;
        c.o_lora_rank = 1024;
        c.o_groups = 16;
        c.moe_inter = 3072;
        c.n_routed = 384;
        c.index_topk = 1024;
        c.routed_scale = 2.5;
        /* layers 0,1: 128 (not 0 as in Flash); then even 4, odd 128 (layer 60: 4); MTP: 0 */
        c.compress_ratio[0] = c.compress_ratio[1] = 128;
        for (int i = 2; i < c.n_layers; i++)
            c.compress_ratio[i] = i % 2 ? 128 : 4;
    } else if (!strcmp(name, "tiny")) {
        /* Small enough for CI, yet every path is on: uncompressed, ratio-4
         * (indexer) and a non-128 "128-style" ratio, hash and routed layers, MTP,
         * shared expert, YaRN, fp8 linears and fp4 experts. */
        common_v4(&c);
        c.dim = 128;
        c.n_layers = 5;
        c.n_mtp = 1;
        c.n_heads = 4;
        c.head_dim = 128;
        c.rope_dim = 32;
        c.q_lora_rank = 64;
        c.o_lora_rank = 32;
        c.o_groups = 2;
        c.window = 16;
        c.moe_inter = 64;
        c.n_routed = 8;
        c.n_active = 2;
        c.n_shared = 1;
        c.n_hash_layers = 2;
        c.index_n_heads = 4;
        c.index_head_dim = 32;
        c.index_topk = 4;
        c.routed_scale = 1.5;
        static const int r[6] = {0, 4, 8, 4, 8, 0};
        for (int i = 0; i < 6; i++)
            c.compress_ratio[i] = r[i];
    } else {
        return dsv4_errf(err, "unknown built-in config \"%s\" (expected flash, pro or tiny)", name);
    }
    snprintf(c.name, sizeof c.name, "%s", name);
    if (validate(&c, name, err)) return -1; /* a broken table here is a bug */
    *cfg = c;
    return 0;
}

/* ----- writing ----- */

static int set_real(json_t *o, const char *k, double x) {
    return json_object_set_new(o, k, json_real(x));
}
static int set_int(json_t *o, const char *k, json_int_t x) {
    return json_object_set_new(o, k, json_integer(x));
}
static int set_str(json_t *o, const char *k, const char *s) {
    return json_object_set_new(o, k, json_string(s));
}

static json_t *yarn_json(const dsv4_config *c, int tf) {
    json_t *y = json_object();
    set_str(y, tf ? "rope_type" : "type", "yarn");
    set_real(y, "factor", c->yarn_factor);
    set_int(y, "original_max_position_embeddings", (json_int_t)c->yarn_original_seq);
    set_real(y, "beta_fast", c->yarn_beta_fast);
    set_real(y, "beta_slow", c->yarn_beta_slow);
    return y;
}

static json_t *build_json(const dsv4_config *c) {
    int total = dsv4_config_total_layers(c);
    double prf = (double)c->rope_dim / c->head_dim;
    json_t *o = json_object();
    json_t *arch = json_array();
    json_array_append_new(arch, json_string("DeepseekV4ForCausalLM"));
    json_object_set_new(o, "architectures", arch);
    set_str(o, "model_type", "deepseek_v4");
    set_str(o, "torch_dtype", "bfloat16");
    set_str(o, "dtype", "bfloat16"); /* transformers >= 5 spelling */
    set_int(o, "vocab_size", c->vocab_size);
    set_int(o, "hidden_size", c->dim);
    set_int(o, "num_hidden_layers", c->n_layers);
    set_int(o, "num_nextn_predict_layers", c->n_mtp);
    set_int(o, "num_attention_heads", c->n_heads);
    set_int(o, "num_key_value_heads", 1);
    set_int(o, "head_dim", c->head_dim);
    set_int(o, "qk_rope_head_dim", c->rope_dim);
    set_int(o, "q_lora_rank", c->q_lora_rank);
    set_int(o, "o_lora_rank", c->o_lora_rank);
    set_int(o, "o_groups", c->o_groups);
    set_int(o, "sliding_window", c->window);
    set_int(o, "moe_intermediate_size", c->moe_inter);
    set_int(o, "n_routed_experts", c->n_routed);
    set_int(o, "n_shared_experts", c->n_shared);
    set_int(o, "num_experts_per_tok", c->n_active);
    set_int(o, "num_hash_layers", c->n_hash_layers);
    set_str(o, "scoring_func", "sqrtsoftplus");
    set_str(o, "topk_method", "noaux_tc");
    json_object_set_new(o, "norm_topk_prob", json_true());
    set_real(o, "routed_scaling_factor", c->routed_scale);
    set_real(o, "swiglu_limit", c->swiglu_limit);
    set_int(o, "hc_mult", c->hc_mult);
    set_int(o, "hc_sinkhorn_iters", c->hc_sinkhorn_iters);
    set_real(o, "hc_eps", c->hc_eps);
    set_real(o, "rms_norm_eps", c->norm_eps);
    set_int(o, "index_n_heads", c->index_n_heads);
    set_int(o, "index_head_dim", c->index_head_dim);
    set_int(o, "index_topk", c->index_topk);
    set_real(o, "rope_theta", c->rope_theta);
    set_real(o, "compress_rope_theta", c->compress_rope_theta);
    int yarn_on = c->yarn_original_seq != 0;
    json_object_set_new(o, "rope_scaling", yarn_on ? yarn_json(c, 0) : json_null());
    json_t *cr = json_array();
    for (int i = 0; i < total; i++)
        json_array_append_new(cr, json_integer(c->compress_ratio[i]));
    json_object_set_new(o, "compress_ratios", cr);
    set_int(o, "bos_token_id", c->bos_id);
    set_int(o, "eos_token_id", c->eos_id);
    set_int(o, "max_position_embeddings", (json_int_t)c->max_position);
    set_str(o, "hidden_act", "silu");
    json_object_set_new(o, "tie_word_embeddings", json_false());
    json_object_set_new(o, "attention_bias", json_false());

    /* formats: quantization_config for fp8 linears; expert_dtype always stated
     * unless the whole checkpoint is bf16. */
    if (c->linear_dtype == DSV4_LINEAR_FP8) {
        json_t *q = json_object();
        set_str(q, "quant_method", "fp8");
        set_str(q, "fmt", "e4m3");
        set_str(q, "activation_scheme", "dynamic");
        if (c->scale_fmt == DSV4_SCALE_UE8M0) set_str(q, "scale_fmt", "ue8m0"); /* absent = float32 scales */
        json_t *bs = json_array();
        json_array_append_new(bs, json_integer(c->quant_block));
        json_array_append_new(bs, json_integer(c->quant_block));
        json_object_set_new(q, "weight_block_size", bs);
        json_object_set_new(o, "quantization_config", q);
    }
    static const char *ED[] = {"fp4", "fp8", "nvfp4", "bf16"};
    if (!(c->linear_dtype == DSV4_LINEAR_BF16 && c->expert_dtype == DSV4_EXPERT_BF16))
        set_str(o, "expert_dtype", ED[c->expert_dtype]);

    /* ----- transformers' DeepseekV4Config keys ----- */
    /* compress_rates holds one ratio per layer type, so it can express this
     * config only if all "128-style" layers share one ratio.  Otherwise the
     * transformers keys for the schedule are left out (transformers cannot build
     * such a model anyway). */
    int hca = 0, representable = 1;
    for (int i = 0; i < c->n_layers; i++) {
        int r = c->compress_ratio[i];
        if (r == 0 || r == 4) continue;
        if (hca && r != hca) representable = 0;
        hca = r;
    }
    if (representable) {
        json_t *lt = json_array();
        for (int i = 0; i < c->n_layers; i++) {
            int r = c->compress_ratio[i];
            json_array_append_new(lt, json_string(r == 0   ? "sliding_attention"
                                                  : r == 4 ? "compressed_sparse_attention"
                                                           : "heavily_compressed_attention"));
        }
        json_object_set_new(o, "layer_types", lt);
        json_t *rates = json_object();
        set_int(rates, "compressed_sparse_attention", 4);
        set_int(rates, "heavily_compressed_attention", hca ? hca : 128);
        json_object_set_new(o, "compress_rates", rates);
    }
    json_t *mlt = json_array();
    for (int i = 0; i < c->n_layers; i++)
        json_array_append_new(mlt, json_string(i < c->n_hash_layers ? "hash_moe" : "moe"));
    json_object_set_new(o, "mlp_layer_types", mlt);
    set_real(o, "partial_rotary_factor", prf);
    /* Nested per rope type, as DeepseekV4Config stores it.  attention_factor 1
     * must be explicit: transformers only adds it itself for the flat form. */
    json_t *rp = json_object(), *main_o = json_object();
    set_str(main_o, "rope_type", "default");
    set_real(main_o, "rope_theta", c->rope_theta);
    set_real(main_o, "partial_rotary_factor", prf);
    json_t *comp;
    if (yarn_on) {
        comp = yarn_json(c, 1);
        set_real(comp, "attention_factor", 1.0);
    } else {
        comp = json_object();
        set_str(comp, "rope_type", "default");
    }
    set_real(comp, "rope_theta", c->compress_rope_theta);
    set_real(comp, "partial_rotary_factor", prf);
    json_object_set_new(rp, "main", main_o);
    json_object_set_new(rp, "compress", comp);
    json_object_set_new(o, "rope_parameters", rp);
    return o;
}

/* Field-by-field comparison; writes the first differing field's name. */
int dsv4_config_equal(const dsv4_config *a, const dsv4_config *b, char *diff, size_t diff_len) {
#define F(f)                                                                                                 \
    do {                                                                                                     \
        if (a->f != b->f) {                                                                                  \
            if (diff && diff_len) snprintf(diff, diff_len, "%s", #f);                                        \
            return 0;                                                                                        \
        }                                                                                                    \
    } while (0)
    F(vocab_size);
    F(dim);
    F(n_layers);
    F(n_mtp);
    F(n_heads);
    F(head_dim);
    F(rope_dim);
    F(q_lora_rank);
    F(o_lora_rank);
    F(o_groups);
    F(window);
    F(moe_inter);
    F(n_routed);
    F(n_shared);
    F(n_active);
    F(n_hash_layers);
    F(index_n_heads);
    F(index_head_dim);
    F(index_topk);
    F(hc_mult);
    F(hc_sinkhorn_iters);
    F(norm_eps);
    F(hc_eps);
    F(routed_scale);
    F(swiglu_limit);
    F(rope_theta);
    F(compress_rope_theta);
    F(yarn_factor);
    F(yarn_original_seq);
    F(yarn_beta_fast);
    F(yarn_beta_slow);
    F(linear_dtype);
    F(scale_fmt);
    F(quant_block);
    F(expert_dtype);
    F(bos_id);
    F(eos_id);
    F(max_position);
#undef F
    for (int i = 0; i < DSV4_MAX_LAYERS; i++) {
        if (a->compress_ratio[i] != b->compress_ratio[i]) {
            if (diff && diff_len) snprintf(diff, diff_len, "compress_ratio[%d]", i);
            return 0;
        }
    }
    if (diff && diff_len) diff[0] = 0;
    return 1;
}

char *dsv4_config_to_json(const dsv4_config *cfg) {
    json_t *o = build_json(cfg);
    if (!o) return NULL;
    /* Prefer 15 significant digits (1e-06 stays 1e-06); fall back to 17, which
     * always reads back to the same double, if the short form would not. */
    char *text = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(15));
    if (text) {
        dsv4_config back;
        if (dsv4_config_parse(&back, text, strlen(text), "to_json", NULL) ||
            !dsv4_config_equal(&back, cfg, NULL, 0)) {
            free(text);
            text = json_dumps(o, JSON_INDENT(2) | JSON_REAL_PRECISION(17));
        }
    }
    json_decref(o);
    return text;
}

int dsv4_config_truncate(dsv4_config *cfg, int n, dsv4_err *err) {
    if (n < 1 || n > cfg->n_layers)
        return dsv4_errf(err, "%s: cannot truncate to %d layers (has %d)", cfg->name, n, cfg->n_layers);
    for (int i = 0; i < cfg->n_mtp; i++)
        cfg->compress_ratio[n + i] = cfg->compress_ratio[cfg->n_layers + i];
    for (int i = n + cfg->n_mtp; i < DSV4_MAX_LAYERS; i++)
        cfg->compress_ratio[i] = 0;
    cfg->n_layers = n;
    if (cfg->n_hash_layers > n) cfg->n_hash_layers = n;
    return validate(cfg, cfg->name, err);
}
