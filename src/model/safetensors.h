/* model/safetensors: mmap'd safetensors files, single or sharded.
 *
 * Owns: the mappings of every shard of a checkpoint directory and a table of
 * tensors (name, dtype, shape, pointer into the mapping).  Data is never copied.
 * Validation is strict and overflow-checked: header length, JSON shape, known
 * dtype, offsets inside the data section, size == prod(shape) * dtype size,
 * no overlapping tensors, and for sharded checkpoints the index must agree with
 * the shards (a missing shard, a tensor in the wrong shard, duplicates).
 * Lifetime: dsv4_st_open .. dsv4_st_close; tensor pointers live until close.
 * Thread-safety: read-only after open.
 */
#ifndef DSV4_MODEL_SAFETENSORS_H
#define DSV4_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "util/err.h"

typedef enum {
    DSV4_DT_BF16 = 0,
    DSV4_DT_F16,
    DSV4_DT_F32,
    DSV4_DT_F8_E4M3,
    DSV4_DT_F8_E8M0,
    DSV4_DT_I8,
    DSV4_DT_U8,
    DSV4_DT_I32,
    DSV4_DT_I64,
    DSV4_DT_COUNT
} dsv4_dtype;

#define DSV4_ST_MAX_DIMS 8

typedef struct dsv4_tensor {
    const char *name;   /* owned by the dsv4_st */
    dsv4_dtype dtype;
    int ndim;
    int64_t shape[DSV4_ST_MAX_DIMS];
    const void *data;   /* into the mapping */
    size_t nbytes;
    int shard;          /* index into dsv4_st.shard_paths */
} dsv4_tensor;

typedef struct dsv4_st dsv4_st;

/* Name as written in safetensors headers ("BF16", "F8_E4M3", ...). */
const char *dsv4_dtype_name(dsv4_dtype dt);
/* Parses a header dtype string; returns -1 if unknown. */
int dsv4_dtype_parse(const char *s, dsv4_dtype *out);
/* Element size in bytes. */
size_t dsv4_dtype_size(dsv4_dtype dt);

/* Opens a checkpoint: `path` is a directory (with model.safetensors.index.json,
 * or a single *.safetensors / model.safetensors inside) or one .safetensors file. */
int dsv4_st_open(dsv4_st **out, const char *path, dsv4_err *err);
void dsv4_st_close(dsv4_st *st);

/* Validates one in-memory safetensors image (header + data).  Used by open and
 * by the fuzz harness.  On success fills a tensor table owned by the caller:
 * *tensors (malloc'd array) with names malloc'd; free with dsv4_st_free_table. */
int dsv4_st_parse_buffer(const uint8_t *buf, size_t len, const char *what, dsv4_tensor **tensors,
                         int *n_tensors, dsv4_err *err);
void dsv4_st_free_table(dsv4_tensor *tensors, int n);

int dsv4_st_count(const dsv4_st *st);
const dsv4_tensor *dsv4_st_at(const dsv4_st *st, int i);
/* Lookup by name (hash table); NULL if absent. */
const dsv4_tensor *dsv4_st_find(const dsv4_st *st, const char *name);
int dsv4_st_n_shards(const dsv4_st *st);
const char *dsv4_st_shard_path(const dsv4_st *st, int i);
/* Total bytes of tensor data across shards. */
size_t dsv4_st_data_bytes(const dsv4_st *st);

/* ----- writing (used by synth and tests) ----- */
/* A streaming writer for one .safetensors file: declare all tensors first, then
 * write their data in declaration order. */
typedef struct dsv4_st_writer dsv4_st_writer;
int dsv4_st_writer_open(dsv4_st_writer **out, const char *path, dsv4_err *err);
int dsv4_st_writer_add(dsv4_st_writer *w, const char *name, dsv4_dtype dt, int ndim, const int64_t *shape,
                       dsv4_err *err);
/* After all adds: writes the header. Then call write_data for each tensor in order. */
int dsv4_st_writer_begin_data(dsv4_st_writer *w, dsv4_err *err);
int dsv4_st_writer_data(dsv4_st_writer *w, const void *data, size_t nbytes, dsv4_err *err);
int dsv4_st_writer_close(dsv4_st_writer *w, dsv4_err *err); /* checks all bytes written; frees */

#endif
