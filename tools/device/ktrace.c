/*
 * ktrace: a CUPTI injection library that records every kernel, copy and memset the GPU runs,
 * including the nodes of CUDA graphs, with device start and end times.  The device image has
 * no Nsight; this is how dsv4 sees where the time inside its decode graphs goes.
 *
 *   CUDA_INJECTION64_PATH=$PWD/ktrace.so KTRACE_OUT=trace.csv dsv4 bench ...
 *
 * The driver loads the library and calls InitializeInjection().  Records are written as CSV
 * lines as CUPTI hands back full buffers and once more at exit:
 *   kind,start_ns,end_ns,graph_id,stream_id,grid,block,name
 * tools/device/ktrace_report.py turns the file into per-kernel totals per decode step.
 *
 * Build (needs cupti.h and libcupti from the CUDA toolkit):
 *   cc -O2 -shared -fPIC -I$CUDA/include tools/device/ktrace.c -L$CUDA/lib -lcupti -o ktrace.so
 */
#include <cupti.h>

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define KT_BUF_BYTES (4u << 20)

static FILE *kt_out;

static void kt_check(CUptiResult r, const char *what)
{
    if (r == CUPTI_SUCCESS) return;
    const char *msg = NULL;
    cuptiGetResultString(r, &msg);
    fprintf(stderr, "ktrace: %s failed: %s\n", what, msg ? msg : "unknown CUPTI error");
}

static void CUPTIAPI kt_buffer_requested(uint8_t **buffer, size_t *size, size_t *max_records)
{
    /* CUPTI wants 8-byte alignment; aligned_alloc gives more */
    *buffer = aligned_alloc(64, KT_BUF_BYTES);
    *size = *buffer ? KT_BUF_BYTES : 0;
    *max_records = 0;
}

static void kt_write(const CUpti_Activity *rec)
{
    if (!kt_out) return;
    switch (rec->kind) {
    case CUPTI_ACTIVITY_KIND_KERNEL:
    case CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL: {
        const CUpti_ActivityKernel10 *k = (const CUpti_ActivityKernel10 *)rec;
        fprintf(kt_out, "K,%llu,%llu,%u,%u,%dx%dx%d,%dx%dx%d,%s\n",
                (unsigned long long)k->start, (unsigned long long)k->end, k->graphId, k->streamId,
                k->gridX, k->gridY, k->gridZ, k->blockX, k->blockY, k->blockZ,
                k->name ? k->name : "?");
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMCPY: {
        const CUpti_ActivityMemcpy6 *m = (const CUpti_ActivityMemcpy6 *)rec;
        fprintf(kt_out, "C,%llu,%llu,%u,%u,%llu,0,memcpy_kind%u\n", (unsigned long long)m->start,
                (unsigned long long)m->end, m->graphId, m->streamId, (unsigned long long)m->bytes,
                (unsigned)m->copyKind);
        break;
    }
    case CUPTI_ACTIVITY_KIND_MEMSET: {
        const CUpti_ActivityMemset4 *m = (const CUpti_ActivityMemset4 *)rec;
        fprintf(kt_out, "S,%llu,%llu,%u,%u,%llu,0,memset\n", (unsigned long long)m->start,
                (unsigned long long)m->end, m->graphId, m->streamId, (unsigned long long)m->bytes);
        break;
    }
    default:
        break;
    }
}

static void CUPTIAPI kt_buffer_completed(CUcontext ctx, uint32_t stream, uint8_t *buffer, size_t size,
                                         size_t valid)
{
    (void)ctx;
    (void)stream;
    (void)size;
    CUpti_Activity *rec = NULL;
    for (;;) {
        CUptiResult r = cuptiActivityGetNextRecord(buffer, valid, &rec);
        if (r != CUPTI_SUCCESS) {
            if (r != CUPTI_ERROR_MAX_LIMIT_REACHED) kt_check(r, "cuptiActivityGetNextRecord");
            break;
        }
        kt_write(rec);
    }
    size_t dropped = 0;
    if (cuptiActivityGetNumDroppedRecords(ctx, stream, &dropped) == CUPTI_SUCCESS && dropped)
        fprintf(stderr, "ktrace: %zu records dropped\n", dropped);
    free(buffer);
}

static void kt_finish(void)
{
    kt_check(cuptiActivityFlushAll(CUPTI_ACTIVITY_FLAG_FLUSH_FORCED), "cuptiActivityFlushAll");
    if (kt_out) {
        fclose(kt_out);
        kt_out = NULL;
    }
}

int InitializeInjection(void);

int InitializeInjection(void)
{
    const char *path = getenv("KTRACE_OUT");
    kt_out = fopen(path && *path ? path : "ktrace.csv", "w");
    if (!kt_out) {
        fprintf(stderr, "ktrace: cannot open %s\n", path && *path ? path : "ktrace.csv");
        return 0;
    }
    kt_check(cuptiActivityRegisterCallbacks(kt_buffer_requested, kt_buffer_completed),
             "cuptiActivityRegisterCallbacks");
    kt_check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL), "enable kernels");
    kt_check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMCPY), "enable memcpy");
    kt_check(cuptiActivityEnable(CUPTI_ACTIVITY_KIND_MEMSET), "enable memset");
    atexit(kt_finish);
    fprintf(stderr, "ktrace: recording kernels, copies and memsets\n");
    return 1;
}
