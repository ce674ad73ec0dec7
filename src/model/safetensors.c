/* model/safetensors: mmap'd safetensors files, single or sharded; a streaming writer.
 *
 * File layout: 8-byte little-endian header length N, N bytes of JSON
 *   {"name": {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, ...,
 *    "__metadata__": {str: str}}
 * then the data section; offsets are relative to the start of the data section.
 *
 * Reading never copies tensor data: every shard is mapped read-only and each
 * dsv4_tensor points into its mapping.  Everything read from a file is checked
 * before use, with overflow-checked size arithmetic, and every failure names the
 * file and the tensor or field at fault.
 */
#include "model/safetensors.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <jansson.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#define ST_MAX_HEADER ((uint64_t)100 * 1000 * 1000) /* 100 MB: the reference reader's limit */
#define ST_INDEX_NAME "model.safetensors.index.json"

/* ----- dtypes ----- */

static const struct {
    const char *name;
    size_t size;
} DTYPES[DSV4_DT_COUNT] = {
    [DSV4_DT_BF16] = {"BF16", 2},       [DSV4_DT_F16] = {"F16", 2},         [DSV4_DT_F32] = {"F32", 4},
    [DSV4_DT_F8_E4M3] = {"F8_E4M3", 1}, [DSV4_DT_F8_E8M0] = {"F8_E8M0", 1}, [DSV4_DT_I8] = {"I8", 1},
    [DSV4_DT_U8] = {"U8", 1},           [DSV4_DT_I32] = {"I32", 4},         [DSV4_DT_I64] = {"I64", 8},
};

const char *dsv4_dtype_name(dsv4_dtype dt) {
    return (unsigned)dt < DSV4_DT_COUNT ? DTYPES[dt].name : "invalid-dtype";
}

int dsv4_dtype_parse(const char *s, dsv4_dtype *out) {
    for (int i = 0; i < DSV4_DT_COUNT; i++)
        if (s && !strcmp(s, DTYPES[i].name)) {
            *out = (dsv4_dtype)i;
            return 0;
        }
    return -1;
}

size_t dsv4_dtype_size(dsv4_dtype dt) {
    return (unsigned)dt < DSV4_DT_COUNT ? DTYPES[dt].size : 0;
}

/* ----- message helpers ----- */

/* A name as it may appear inside a one-line message: control bytes become '?'
 * and very long names are cut (names come from untrusted files). */
typedef struct {
    char s[160];
} shown;

static shown show(const char *name) {
    shown o;
    size_t i = 0;
    for (; i < sizeof o.s - 4 && name[i]; i++)
        o.s[i] = (unsigned char)name[i] < 0x20 ? '?' : name[i];
    if (name[i]) memcpy(o.s + i, "...", 3), i += 3;
    o.s[i] = 0;
    return o;
}

typedef struct {
    char s[200];
} shape_str;

static shape_str fmt_shape(const int64_t *shape, int ndim) {
    shape_str o;
    size_t at = 0;
    at += (size_t)snprintf(o.s + at, sizeof o.s - at, "[");
    for (int i = 0; i < ndim && at < sizeof o.s; i++)
        at += (size_t)snprintf(o.s + at, sizeof o.s - at, "%s%lld", i ? "," : "", (long long)shape[i]);
    if (at < sizeof o.s) snprintf(o.s + at, sizeof o.s - at, "]");
    return o;
}

/* ----- header parsing ----- */

static void table_free(dsv4_tensor *t, int n) {
    if (!t) return;
    for (int i = 0; i < n; i++)
        free((char *)t[i].name);
    free(t);
}

void dsv4_st_free_table(dsv4_tensor *tensors, int n) {
    table_free(tensors, n);
}

/* Reads a non-negative JSON integer into *out; -1 if it is not one. */
static int json_nonneg(const json_t *v, int64_t *out) {
    if (!json_is_integer(v)) return -1;
    json_int_t x = json_integer_value(v);
    if (x < 0) return -1;
    *out = (int64_t)x;
    return 0;
}

/* Validates one header entry and fills *t (name not yet set).  `data` is the
 * start of the data section (its length data_len). */
static int parse_entry(const char *what, const char *name, json_t *e, const uint8_t *data, size_t data_len,
                       dsv4_tensor *t, dsv4_err *err) {
    if (!json_is_object(e))
        return dsv4_errf(err, "%s: tensor '%s': entry is not a JSON object", what, show(name).s);
    json_t *jd = NULL, *js = NULL, *jo = NULL;
    const char *k;
    json_t *v;
    json_object_foreach(e, k, v) {
        if (!strcmp(k, "dtype"))
            jd = v;
        else if (!strcmp(k, "shape"))
            js = v;
        else if (!strcmp(k, "data_offsets"))
            jo = v;
        else
            return dsv4_errf(err, "%s: tensor '%s': unknown field '%s'", what, show(name).s, show(k).s);
    }
    if (!jd || !js || !jo)
        return dsv4_errf(err, "%s: tensor '%s': missing field '%s'", what, show(name).s,
                         !jd   ? "dtype"
                         : !js ? "shape"
                               : "data_offsets");

    if (!json_is_string(jd))
        return dsv4_errf(err, "%s: tensor '%s': dtype is not a string", what, show(name).s);
    if (dsv4_dtype_parse(json_string_value(jd), &t->dtype) < 0)
        return dsv4_errf(
            err,
            "%s: tensor '%s': unknown or unsupported dtype '%s' (supported: BF16 F16 F32 F8_E4M3 "
            "F8_E8M0 I8 U8 I32 I64)",
            what, show(name).s, show(json_string_value(jd)).s);

    if (!json_is_array(js)) return dsv4_errf(err, "%s: tensor '%s': shape is not a list", what, show(name).s);
    size_t nd = json_array_size(js);
    if (nd > DSV4_ST_MAX_DIMS)
        return dsv4_errf(err, "%s: tensor '%s': shape has %zu dimensions, at most %d supported", what,
                         show(name).s, nd, DSV4_ST_MAX_DIMS);
    t->ndim = (int)nd;
    int has_zero = 0;
    for (size_t i = 0; i < nd; i++) {
        if (json_nonneg(json_array_get(js, i), &t->shape[i]) < 0)
            return dsv4_errf(err, "%s: tensor '%s': shape[%zu] is not a non-negative integer", what,
                             show(name).s, i);
        has_zero |= t->shape[i] == 0;
    }
    /* Element count, overflow-checked.  A zero dimension makes it 0 whatever the others are. */
    size_t nelem = 1, nbytes;
    for (size_t i = 0; i < nd && !has_zero; i++)
        if ((uint64_t)t->shape[i] > SIZE_MAX || dsv4_mul_size(nelem, (size_t)t->shape[i], &nelem) < 0)
            return dsv4_errf(err, "%s: tensor '%s': shape %s has too many elements (overflows size_t)", what,
                             show(name).s, fmt_shape(t->shape, t->ndim).s);
    if (has_zero) nelem = 0;
    if (dsv4_mul_size(nelem, dsv4_dtype_size(t->dtype), &nbytes) < 0)
        return dsv4_errf(err, "%s: tensor '%s': shape %s x %s overflows size_t bytes", what, show(name).s,
                         fmt_shape(t->shape, t->ndim).s, dsv4_dtype_name(t->dtype));

    int64_t off[2];
    if (!json_is_array(jo) || json_array_size(jo) != 2 || json_nonneg(json_array_get(jo, 0), &off[0]) < 0 ||
        json_nonneg(json_array_get(jo, 1), &off[1]) < 0)
        return dsv4_errf(err, "%s: tensor '%s': data_offsets must be a list of two non-negative integers",
                         what, show(name).s);
    if (off[0] > off[1])
        return dsv4_errf(err, "%s: tensor '%s': data_offsets [%lld,%lld] begin after end", what, show(name).s,
                         (long long)off[0], (long long)off[1]);
    if ((uint64_t)off[1] > data_len)
        return dsv4_errf(err,
                         "%s: tensor '%s': data_offsets [%lld,%lld] go beyond the data section (%zu bytes)",
                         what, show(name).s, (long long)off[0], (long long)off[1], data_len);
    size_t span = (size_t)(off[1] - off[0]);
    if (span != nbytes)
        return dsv4_errf(
            err, "%s: tensor '%s': data_offsets [%lld,%lld] span %zu bytes but shape %s x %s needs %zu", what,
            show(name).s, (long long)off[0], (long long)off[1], span, fmt_shape(t->shape, t->ndim).s,
            dsv4_dtype_name(t->dtype), nbytes);
    t->data = data + off[0];
    t->nbytes = nbytes;
    /* Consumers read through typed pointers; a misaligned one would be undefined
     * behaviour.  Writers that pad the header to 8 and order tensors by element
     * size (the reference writer, ours) always satisfy this. */
    if (nbytes && (uintptr_t)t->data % dsv4_dtype_size(t->dtype) != 0)
        return dsv4_errf(
            err, "%s: tensor '%s': data at offset %lld is not aligned to its %zu-byte %s elements", what,
            show(name).s, (long long)off[0], dsv4_dtype_size(t->dtype), dsv4_dtype_name(t->dtype));
    return 0;
}

typedef struct {
    size_t begin, end;
    int i;
} span_ref;

static int span_cmp(const void *a, const void *b) {
    const span_ref *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return x->i - y->i;
}

/* Sort non-empty tensors by begin; each must start at or after the furthest
 * end seen so far.  Empty tensors occupy no bytes and overlap nothing. */
static int check_overlaps(const char *what, const dsv4_tensor *t, int n, const uint8_t *data, dsv4_err *err) {
    span_ref *s = malloc((size_t)(n ? n : 1) * sizeof *s);
    if (!s) return dsv4_errf(err, "%s: out of memory checking %d tensors for overlap", what, n);
    int m = 0;
    for (int i = 0; i < n; i++)
        if (t[i].nbytes) {
            size_t b = (size_t)((const uint8_t *)t[i].data - data);
            s[m++] = (span_ref){b, b + t[i].nbytes, i};
        }
    qsort(s, (size_t)m, sizeof *s, span_cmp);
    int rc = 0;
    for (int j = 1, far = 0; j < m; j++) {
        if (s[j].begin < s[far].end) {
            const span_ref *a = &s[far], *b = &s[j];
            rc = dsv4_errf(err, "%s: tensors '%s' [%zu,%zu] and '%s' [%zu,%zu] overlap", what,
                           show(t[a->i].name).s, a->begin, a->end, show(t[b->i].name).s, b->begin, b->end);
            break;
        }
        if (s[j].end > s[far].end) far = j;
    }
    free(s);
    return rc;
}

static int check_metadata(const char *what, json_t *meta, dsv4_err *err) {
    if (!json_is_object(meta)) return dsv4_errf(err, "%s: __metadata__ is not a JSON object", what);
    const char *k;
    json_t *v;
    json_object_foreach(meta, k, v) {
        if (!json_is_string(v))
            return dsv4_errf(err, "%s: __metadata__ value for '%s' is not a string", what, show(k).s);
    }
    return 0;
}

int dsv4_st_parse_buffer(const uint8_t *buf, size_t len, const char *what, dsv4_tensor **tensors,
                         int *n_tensors, dsv4_err *err) {
    *tensors = NULL;
    *n_tensors = 0;
    if (!what) what = "safetensors";
    if (len < 8)
        return dsv4_errf(err, "%s: truncated file: %zu bytes, shorter than the 8-byte header length", what,
                         len);
    uint64_t hlen = 0;
    for (int i = 0; i < 8; i++)
        hlen |= (uint64_t)buf[i] << (8 * i);
    if (hlen < 2)
        return dsv4_errf(err, "%s: header length %llu is too small (at least 2, '{}')", what,
                         (unsigned long long)hlen);
    if (hlen > ST_MAX_HEADER)
        return dsv4_errf(err, "%s: header length %llu exceeds the limit of %llu bytes", what,
                         (unsigned long long)hlen, (unsigned long long)ST_MAX_HEADER);
    if (hlen > len - 8)
        return dsv4_errf(err, "%s: header length %llu is beyond the file size (%zu bytes): truncated file?",
                         what, (unsigned long long)hlen, len);

    json_error_t je;
    json_t *root = json_loadb((const char *)buf + 8, (size_t)hlen, JSON_REJECT_DUPLICATES, &je);
    if (!root)
        return dsv4_errf(err, "%s: header is not valid JSON: %s (line %d, column %d)", what, je.text, je.line,
                         je.column);
    if (!json_is_object(root)) {
        json_decref(root);
        return dsv4_errf(err, "%s: header is not a JSON object", what);
    }
    const uint8_t *data = buf + 8 + hlen;
    size_t data_len = len - 8 - (size_t)hlen;
    size_t cap = json_object_size(root);
    if (cap > INT_MAX) {
        json_decref(root);
        return dsv4_errf(err, "%s: header has too many entries (%zu)", what, cap);
    }
    dsv4_tensor *t = calloc(cap ? cap : 1, sizeof *t);
    if (!t) {
        json_decref(root);
        return dsv4_errf(err, "%s: out of memory for %zu tensor entries", what, cap);
    }
    int n = 0;
    const char *key;
    json_t *val;
    json_object_foreach(root, key, val) {
        if (!strcmp(key, "__metadata__")) {
            if (check_metadata(what, val, err) < 0) goto fail;
            continue;
        }
        if (!key[0]) {
            dsv4_errf(err, "%s: a tensor has an empty name", what);
            goto fail;
        }
        if (parse_entry(what, key, val, data, data_len, &t[n], err) < 0) goto fail;
        t[n].name = strdup(key);
        if (!t[n].name) {
            dsv4_errf(err, "%s: out of memory", what);
            goto fail;
        }
        t[n].shard = 0;
        n++;
    }
    if (check_overlaps(what, t, n, data, err) < 0) goto fail;
    json_decref(root);
    *tensors = t;
    *n_tensors = n;
    return 0;
fail:
    table_free(t, n);
    json_decref(root);
    return -1;
}

/* ----- the checkpoint: shards, tensor table, hash lookup ----- */

struct dsv4_st {
    int n_shards;
    char **shard_paths;
    void **maps;
    size_t *map_lens;
    dsv4_tensor *tensors; /* all shards, shard by shard, each in header order */
    int n;
    int *slots; /* open addressing: tensor index or -1; capacity mask+1 (power of two) */
    size_t mask;
    size_t data_bytes;
};

static uint64_t name_hash(const char *s) { /* FNV-1a */
    uint64_t h = 0xcbf29ce484222325ull;
    for (; *s; s++)
        h = (h ^ (unsigned char)*s) * 0x100000001b3ull;
    return h;
}

static const char *base_name(const char *path) {
    const char *s = strrchr(path, '/');
    return s ? s + 1 : path;
}

/* Builds the name table; a name seen twice is a duplicate across shards (a
 * single header cannot repeat a key: the JSON parser rejects duplicates). */
static int build_hash(dsv4_st *st, dsv4_err *err) {
    size_t cap = 16;
    while (cap < (size_t)st->n * 2)
        cap <<= 1;
    st->slots = malloc(cap * sizeof *st->slots);
    if (!st->slots) return dsv4_errf(err, "out of memory for the tensor name table (%d tensors)", st->n);
    memset(st->slots, 0xff, cap * sizeof *st->slots);
    st->mask = cap - 1;
    for (int i = 0; i < st->n; i++) {
        size_t h = (size_t)name_hash(st->tensors[i].name) & st->mask;
        for (; st->slots[h] >= 0; h = (h + 1) & st->mask) {
            const dsv4_tensor *o = &st->tensors[st->slots[h]];
            if (!strcmp(o->name, st->tensors[i].name))
                return dsv4_errf(err, "tensor '%s' appears in two shards: %s and %s", show(o->name).s,
                                 st->shard_paths[o->shard], st->shard_paths[st->tensors[i].shard]);
        }
        st->slots[h] = i;
    }
    return 0;
}

const dsv4_tensor *dsv4_st_find(const dsv4_st *st, const char *name) {
    if (!st || !st->slots || !name) return NULL;
    for (size_t h = (size_t)name_hash(name) & st->mask; st->slots[h] >= 0; h = (h + 1) & st->mask)
        if (!strcmp(st->tensors[st->slots[h]].name, name)) return &st->tensors[st->slots[h]];
    return NULL;
}

int dsv4_st_count(const dsv4_st *st) {
    return st ? st->n : 0;
}
const dsv4_tensor *dsv4_st_at(const dsv4_st *st, int i) {
    return st && i >= 0 && i < st->n ? &st->tensors[i] : NULL;
}
int dsv4_st_n_shards(const dsv4_st *st) {
    return st ? st->n_shards : 0;
}
const char *dsv4_st_shard_path(const dsv4_st *st, int i) {
    return st && i >= 0 && i < st->n_shards ? st->shard_paths[i] : NULL;
}
size_t dsv4_st_data_bytes(const dsv4_st *st) {
    return st ? st->data_bytes : 0;
}

void dsv4_st_close(dsv4_st *st) {
    if (!st) return;
    for (int i = 0; i < st->n_shards; i++) {
        if (st->maps[i]) munmap(st->maps[i], st->map_lens[i]);
        free(st->shard_paths[i]);
    }
    free(st->shard_paths);
    free(st->maps);
    free(st->map_lens);
    table_free(st->tensors, st->n);
    free(st->slots);
    free(st);
}

/* Maps one shard read-only, validates its header and appends its tensors. */
static int add_shard(dsv4_st *st, const char *path, dsv4_err *err) {
    int si = st->n_shards;
    char **np = realloc(st->shard_paths, (size_t)(si + 1) * sizeof *np);
    if (np) st->shard_paths = np;
    void **nm = realloc(st->maps, (size_t)(si + 1) * sizeof *nm);
    if (nm) st->maps = nm;
    size_t *nl = realloc(st->map_lens, (size_t)(si + 1) * sizeof *nl);
    if (nl) st->map_lens = nl;
    if (!np || !nm || !nl) return dsv4_errf(err, "%s: out of memory", path);
    st->shard_paths[si] = strdup(path);
    st->maps[si] = NULL;
    st->map_lens[si] = 0;
    if (!st->shard_paths[si]) return dsv4_errf(err, "%s: out of memory", path);
    st->n_shards++;

    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return dsv4_errf(err, "%s: cannot open: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) < 0) {
        int e = errno;
        close(fd);
        return dsv4_errf(err, "%s: cannot stat: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return dsv4_errf(err, "%s: not a regular file", path);
    }
    if (sb.st_size < 8) {
        close(fd);
        return dsv4_errf(err, "%s: truncated file: %lld bytes, shorter than the 8-byte header length", path,
                         (long long)sb.st_size);
    }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        close(fd);
        return dsv4_errf(err, "%s: file too large to map", path);
    }
    size_t len = (size_t)sb.st_size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED) return dsv4_errf(err, "%s: cannot mmap %zu bytes: %s", path, len, strerror(e));
    st->maps[si] = map;
    st->map_lens[si] = len;

    dsv4_tensor *t;
    int n;
    if (dsv4_st_parse_buffer(map, len, path, &t, &n, err) < 0) return -1;
    size_t total;
    if (n > INT_MAX - st->n || dsv4_mul_size((size_t)(st->n + n), sizeof *t, &total) < 0) {
        table_free(t, n);
        return dsv4_errf(err, "%s: too many tensors in the checkpoint", path);
    }
    dsv4_tensor *all = realloc(st->tensors, total ? total : 1);
    if (!all) {
        table_free(t, n);
        return dsv4_errf(err, "%s: out of memory for %d tensors", path, st->n + n);
    }
    st->tensors = all;
    for (int i = 0; i < n; i++) {
        t[i].shard = si;
        st->tensors[st->n + i] = t[i];
        st->data_bytes += t[i].nbytes;
    }
    st->n += n;
    free(t); /* names now belong to st */
    return 0;
}

static int path_join(char *out, size_t cap, const char *dir, const char *name, dsv4_err *err) {
    int k = snprintf(out, cap, "%s/%s", dir, name);
    if (k < 0 || (size_t)k >= cap) return dsv4_errf(err, "%s/%s: path too long", dir, show(name).s);
    return 0;
}

/* Shard file names from an index must stay inside the checkpoint directory. */
static int shard_name_ok(const char *s) {
    return s[0] && strcmp(s, ".") && strcmp(s, "..") && !strchr(s, '/');
}

static int open_sharded(dsv4_st *st, const char *dir, const char *index_path, dsv4_err *err) {
    json_error_t je;
    json_t *idx = json_load_file(index_path, JSON_REJECT_DUPLICATES, &je);
    if (!idx)
        return dsv4_errf(err, "%s: cannot read index: %s (line %d, column %d)", index_path, je.text, je.line,
                         je.column);
    int rc = -1;
    const char **names = NULL; /* distinct shard names, borrowed from idx */
    int n_names = 0;
    json_t *wm = json_object_get(idx, "weight_map");
    json_t *meta = json_object_get(idx, "metadata");
    if (!json_is_object(idx)) {
        dsv4_errf(err, "%s: index is not a JSON object", index_path);
        goto done;
    }
    if (meta && !json_is_object(meta)) {
        dsv4_errf(err, "%s: \"metadata\" is not a JSON object", index_path);
        goto done;
    }
    if (!json_is_object(wm)) {
        dsv4_errf(err, "%s: missing \"weight_map\" object", index_path);
        goto done;
    }
    if (json_object_size(wm) == 0) {
        dsv4_errf(err, "%s: \"weight_map\" lists no tensors", index_path);
        goto done;
    }
    names = malloc(json_object_size(wm) * sizeof *names);
    if (!names) {
        dsv4_errf(err, "%s: out of memory", index_path);
        goto done;
    }
    const char *key;
    json_t *v;
    json_object_foreach(wm, key, v) {
        if (!json_is_string(v) || !shard_name_ok(json_string_value(v))) {
            dsv4_errf(err,
                      "%s: weight_map entry for tensor '%s' must be a shard file name in the same directory",
                      index_path, show(key).s);
            goto done;
        }
        const char *s = json_string_value(v);
        int found = n_names && !strcmp(names[n_names - 1], s); /* entries usually come grouped by shard */
        for (int i = 0; i < n_names && !found; i++)
            found = !strcmp(names[i], s);
        if (!found) names[n_names++] = s;
    }
    char path[PATH_MAX];
    for (int i = 0; i < n_names; i++) {
        if (path_join(path, sizeof path, dir, names[i], err) < 0) goto done;
        if (add_shard(st, path, err) < 0) {
            dsv4_err_prefix(err, "shard named by %s", ST_INDEX_NAME);
            goto done;
        }
    }
    if (build_hash(st, err) < 0) goto done;
    /* Every tensor of every shard is in the index, under that shard ... */
    for (int i = 0; i < st->n; i++) {
        const dsv4_tensor *t = &st->tensors[i];
        const char *shard = base_name(st->shard_paths[t->shard]);
        json_t *where = json_object_get(wm, t->name);
        if (!where) {
            dsv4_errf(err, "%s: tensor '%s' is not listed in %s", st->shard_paths[t->shard], show(t->name).s,
                      ST_INDEX_NAME);
            goto done;
        }
        if (strcmp(json_string_value(where), shard)) {
            dsv4_errf(err, "%s: index places tensor '%s' in %s but it is in %s", index_path, show(t->name).s,
                      show(json_string_value(where)).s, shard);
            goto done;
        }
    }
    /* ... and every tensor of the index was found. */
    json_object_foreach(wm, key, v) {
        if (!dsv4_st_find(st, key)) {
            dsv4_errf(err, "%s: index lists tensor '%s' in %s, but that shard has no such tensor", index_path,
                      show(key).s, show(json_string_value(v)).s);
            goto done;
        }
    }
    rc = 0;
done:
    free(names);
    json_decref(idx);
    return rc;
}

static int has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a > b && !strcmp(s + a - b, suf);
}

/* A directory without an index must hold exactly one .safetensors file. */
static int find_single_file(const char *dir, char *out, size_t cap, dsv4_err *err) {
    DIR *d = opendir(dir);
    if (!d) return dsv4_errf(err, "%s: cannot open directory: %s", dir, strerror(errno));
    int count = 0;
    char first[NAME_MAX + 1] = "", second[NAME_MAX + 1] = "";
    struct dirent *de;
    while ((de = readdir(d))) {
        if (de->d_name[0] == '.' || !has_suffix(de->d_name, ".safetensors")) continue;
        if (count == 0)
            snprintf(first, sizeof first, "%s", de->d_name);
        else if (count == 1)
            snprintf(second, sizeof second, "%s", de->d_name);
        count++;
    }
    closedir(d);
    if (count == 0) return dsv4_errf(err, "%s: no %s and no .safetensors file", dir, ST_INDEX_NAME);
    if (count > 1)
        return dsv4_errf(err,
                         "%s: %d .safetensors files (%s, %s, ...) but no %s to say how they fit together",
                         dir, count, first, second, ST_INDEX_NAME);
    return path_join(out, cap, dir, first, err);
}

int dsv4_st_open(dsv4_st **out, const char *path, dsv4_err *err) {
    *out = NULL;
    struct stat sb;
    if (!path || !path[0]) return dsv4_errf(err, "checkpoint path is empty");
    if (stat(path, &sb) < 0) return dsv4_errf(err, "%s: %s", path, strerror(errno));
    dsv4_st *st = calloc(1, sizeof *st);
    if (!st) return dsv4_errf(err, "%s: out of memory", path);
    int rc;
    if (S_ISDIR(sb.st_mode)) {
        char p[PATH_MAX];
        if (path_join(p, sizeof p, path, ST_INDEX_NAME, err) < 0)
            rc = -1;
        else if (access(p, F_OK) == 0)
            rc = open_sharded(st, path, p, err);
        else if ((rc = find_single_file(path, p, sizeof p, err)) == 0 && (rc = add_shard(st, p, err)) == 0)
            rc = build_hash(st, err);
    } else {
        rc = add_shard(st, path, err);
        if (rc == 0) rc = build_hash(st, err);
    }
    if (rc < 0) {
        dsv4_st_close(st);
        return -1;
    }
    *out = st;
    return 0;
}

/* ----- writer ----- */

typedef struct {
    char *name;
    dsv4_dtype dt;
    int ndim;
    int64_t shape[DSV4_ST_MAX_DIMS];
    size_t nbytes;
    size_t offset; /* in the data section, assigned by begin_data */
} wtensor;

struct dsv4_st_writer {
    char *path, *tmp_path;
    int fd;
    wtensor *t;
    int n, cap;
    json_t *seen; /* names declared so far (duplicate check) */
    int began, failed;
    int cur;         /* tensor receiving data */
    size_t cur_done; /* bytes of it written */
    uint64_t data_start;
};

static void writer_free(dsv4_st_writer *w) {
    if (!w) return;
    if (w->fd >= 0) close(w->fd);
    for (int i = 0; i < w->n; i++)
        free(w->t[i].name);
    free(w->t);
    json_decref(w->seen);
    free(w->path);
    free(w->tmp_path);
    free(w);
}

int dsv4_st_writer_open(dsv4_st_writer **out, const char *path, dsv4_err *err) {
    *out = NULL;
    if (!path || !path[0]) return dsv4_errf(err, "safetensors writer: empty output path");
    dsv4_st_writer *w = calloc(1, sizeof *w);
    if (!w) return dsv4_errf(err, "%s: out of memory", path);
    w->fd = -1;
    size_t pl = strlen(path);
    w->path = strdup(path);
    w->tmp_path = malloc(pl + 5);
    w->seen = json_object();
    if (!w->path || !w->tmp_path || !w->seen) {
        writer_free(w);
        return dsv4_errf(err, "%s: out of memory", path);
    }
    memcpy(w->tmp_path, path, pl);
    memcpy(w->tmp_path + pl, ".tmp", 5);
    w->fd = open(w->tmp_path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (w->fd < 0) {
        int e = errno;
        dsv4_errf(err, "%s: cannot create: %s", w->tmp_path, strerror(e));
        writer_free(w);
        return -1;
    }
    *out = w;
    return 0;
}

int dsv4_st_writer_add(dsv4_st_writer *w, const char *name, dsv4_dtype dt, int ndim, const int64_t *shape,
                       dsv4_err *err) {
    if (w->began) return dsv4_errf(err, "%s: tensor '%s' added after the data began", w->path, show(name).s);
    if (!name || !name[0]) return dsv4_errf(err, "%s: tensor with an empty name", w->path);
    if (!strcmp(name, "__metadata__")) return dsv4_errf(err, "%s: '__metadata__' is reserved", w->path);
    if ((unsigned)dt >= DSV4_DT_COUNT)
        return dsv4_errf(err, "%s: tensor '%s': invalid dtype %d", w->path, show(name).s, (int)dt);
    if (ndim < 0 || ndim > DSV4_ST_MAX_DIMS)
        return dsv4_errf(err, "%s: tensor '%s': %d dimensions (0..%d allowed)", w->path, show(name).s, ndim,
                         DSV4_ST_MAX_DIMS);
    if (json_object_get(w->seen, name))
        return dsv4_errf(err, "%s: tensor '%s' declared twice", w->path, show(name).s);
    wtensor t = {.dt = dt, .ndim = ndim};
    size_t nelem = 1;
    int zero = 0;
    for (int i = 0; i < ndim; i++) {
        if (shape[i] < 0)
            return dsv4_errf(err, "%s: tensor '%s': negative dimension %lld", w->path, show(name).s,
                             (long long)shape[i]);
        t.shape[i] = shape[i];
        zero |= shape[i] == 0;
    }
    for (int i = 0; i < ndim && !zero; i++)
        if ((uint64_t)shape[i] > SIZE_MAX || dsv4_mul_size(nelem, (size_t)shape[i], &nelem) < 0)
            return dsv4_errf(err, "%s: tensor '%s': shape overflows size_t", w->path, show(name).s);
    if (zero) nelem = 0;
    if (dsv4_mul_size(nelem, dsv4_dtype_size(dt), &t.nbytes) < 0)
        return dsv4_errf(err, "%s: tensor '%s': size overflows size_t", w->path, show(name).s);
    /* json_object_set_new rejects invalid UTF-8 keys, which no reader could load. */
    if (json_object_set_new(w->seen, name, json_true()) < 0)
        return dsv4_errf(err, "%s: tensor name '%s' is not valid UTF-8", w->path, show(name).s);
    if (w->n == w->cap) {
        int nc = w->cap ? w->cap * 2 : 64;
        wtensor *nt = realloc(w->t, (size_t)nc * sizeof *nt);
        if (!nt) return dsv4_errf(err, "%s: out of memory", w->path);
        w->t = nt;
        w->cap = nc;
    }
    t.name = strdup(name);
    if (!t.name) return dsv4_errf(err, "%s: out of memory", w->path);
    w->t[w->n++] = t;
    return 0;
}

static int write_all(int fd, const void *p, size_t n, uint64_t off) {
    const uint8_t *b = p;
    while (n) {
        ssize_t k = pwrite(fd, b, n, (off_t)off);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) return -1;
        b += k;
        n -= (size_t)k;
        off += (uint64_t)k;
    }
    return 0;
}

static void skip_full(dsv4_st_writer *w) {
    while (w->cur < w->n && w->cur_done == w->t[w->cur].nbytes) {
        w->cur++;
        w->cur_done = 0;
    }
}

/* Layout: tensors ordered by element size, largest first, each group in
 * declaration order, packed with no gaps.  With the header padded to a multiple
 * of 8 this puts every tensor on its element alignment, as the reference writer
 * does.  Data still arrives in declaration order: it is written with pwrite at
 * each tensor's offset. */
int dsv4_st_writer_begin_data(dsv4_st_writer *w, dsv4_err *err) {
    if (w->began) return dsv4_errf(err, "%s: begin_data called twice", w->path);
    if (w->failed) return dsv4_errf(err, "%s: writer already failed", w->path);
    w->began = 1;
    size_t off = 0;
    json_t *root = json_object(), *meta = json_object();
    int bad = json_object_set_new(meta, "format", json_string("pt")) < 0;
    bad |= json_object_set_new(root, "__metadata__", meta) < 0;
    static const size_t sizes[4] = {8, 4, 2, 1};
    for (int s = 0; s < 4 && !bad; s++)
        for (int i = 0; i < w->n && !bad; i++) {
            wtensor *t = &w->t[i];
            if (dsv4_dtype_size(t->dt) != sizes[s]) continue;
            t->offset = off;
            if (dsv4_add_size(off, t->nbytes, &off) < 0) {
                json_decref(root);
                w->failed = 1;
                return dsv4_errf(err, "%s: total tensor bytes overflow size_t", w->path);
            }
            /* Every *_new call takes ownership even when it fails (jansson
             * frees the value), so each runs unconditionally: nothing leaks. */
            json_t *shp = json_array(), *offs = json_array(), *e = json_object();
            for (int d = 0; d < t->ndim; d++)
                bad |= json_array_append_new(shp, json_integer(t->shape[d])) < 0;
            bad |= json_array_append_new(offs, json_integer((json_int_t)t->offset)) < 0;
            bad |= json_array_append_new(offs, json_integer((json_int_t)off)) < 0;
            bad |= json_object_set_new(e, "dtype", json_string(dsv4_dtype_name(t->dt))) < 0;
            bad |= json_object_set_new(e, "shape", shp) < 0;
            bad |= json_object_set_new(e, "data_offsets", offs) < 0;
            bad |= json_object_set_new(root, t->name, e) < 0;
        }
    char *hdr = bad ? NULL : json_dumps(root, JSON_COMPACT);
    json_decref(root);
    if (!hdr) {
        w->failed = 1;
        return dsv4_errf(err, "%s: cannot build the JSON header (out of memory?)", w->path);
    }
    size_t hl = strlen(hdr), padded = (hl + 7) & ~(size_t)7;
    uint8_t *buf = malloc(8 + padded);
    if (!buf) {
        free(hdr);
        w->failed = 1;
        return dsv4_errf(err, "%s: out of memory", w->path);
    }
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)padded >> (8 * i));
    memcpy(buf + 8, hdr, hl);
    memset(buf + 8 + hl, ' ', padded - hl);
    free(hdr);
    int rc = write_all(w->fd, buf, 8 + padded, 0);
    free(buf);
    if (rc < 0) {
        w->failed = 1;
        return dsv4_errf(err, "%s: write failed: %s", w->tmp_path, strerror(errno));
    }
    w->data_start = 8 + padded;
    w->cur = 0;
    w->cur_done = 0;
    skip_full(w);
    return 0;
}

/* Data is the concatenation of all tensors in declaration order; a call may
 * carry part of a tensor or span several. */
int dsv4_st_writer_data(dsv4_st_writer *w, const void *data, size_t nbytes, dsv4_err *err) {
    if (!w->began) return dsv4_errf(err, "%s: data written before begin_data", w->path);
    if (w->failed) return dsv4_errf(err, "%s: writer already failed", w->path);
    if (nbytes && !data) return dsv4_errf(err, "%s: NULL data pointer", w->path);
    const uint8_t *p = data;
    while (nbytes) {
        if (w->cur >= w->n) {
            w->failed = 1;
            return dsv4_errf(err, "%s: %zu bytes of data beyond the declared tensors", w->path, nbytes);
        }
        wtensor *t = &w->t[w->cur];
        size_t k = t->nbytes - w->cur_done;
        if (k > nbytes) k = nbytes;
        if (write_all(w->fd, p, k, w->data_start + t->offset + w->cur_done) < 0) {
            w->failed = 1;
            return dsv4_errf(err, "%s: write failed for tensor '%s': %s", w->tmp_path, show(t->name).s,
                             strerror(errno));
        }
        p += k;
        nbytes -= k;
        w->cur_done += k;
        skip_full(w);
    }
    return 0;
}

int dsv4_st_writer_close(dsv4_st_writer *w, dsv4_err *err) {
    if (!w) return 0;
    int rc = 0;
    if (w->failed)
        rc = dsv4_errf(err, "%s: not written: an earlier write failed", w->path);
    else if (!w->began)
        rc = dsv4_errf(err, "%s: closed before begin_data", w->path);
    else if (w->cur < w->n)
        rc = dsv4_errf(err, "%s: closed with tensor '%s' incomplete (%zu of %zu bytes written)", w->path,
                       show(w->t[w->cur].name).s, w->cur_done, w->t[w->cur].nbytes);
    if (rc == 0 && fsync(w->fd) < 0)
        rc = dsv4_errf(err, "%s: fsync failed: %s", w->tmp_path, strerror(errno));
    if (close(w->fd) < 0 && rc == 0)
        rc = dsv4_errf(err, "%s: close failed: %s", w->tmp_path, strerror(errno));
    w->fd = -1;
    if (rc == 0 && rename(w->tmp_path, w->path) < 0)
        rc = dsv4_errf(err, "%s: cannot rename %s into place: %s", w->path, w->tmp_path, strerror(errno));
    if (rc < 0) unlink(w->tmp_path);
    writer_free(w);
    return rc;
}
