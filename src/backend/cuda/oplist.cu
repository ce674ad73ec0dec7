/* backend/cuda/oplist.cu: op_list, independent small ops (rmsnorm, norm_rope, rope, add_cyclic,
 * copy, scale) in one launch of k_op_list (norm.cu; the task table: oplist.cuh).
 *
 * A decode step runs a dozen such ops around the attention projections, each a launch of 1-3 us
 * of exposed device time (or a memcpy node, which also breaks the chain of programmatic
 * launches); here they share one launch.  Values: each task runs the device functions of its
 * standalone kernel, so the list gives the bits of the ops one by one (tests/test_cuda_ops.c,
 * test_op_list).  A task the list kernel cannot take runs alone, as its op, before the list (the
 * tasks are independent, so the order does not matter): host buffers, a norm shape the standalone
 * op runs on its generic kernel (k_rmsnorm, or rmsnorm then rope), norm weights other than aligned
 * f32 / bf16, more rows of positions than a launch holds, sizes past 2^31.  A list longer than a
 * launch's table (OL_MAX tasks, OL_POS positions, OL_FREQ frequencies, blockDim 1024) takes
 * several launches.  DSV4_CUDA_OPLIST=0 removes the op from the table (backend.cu): the forward
 * pass then runs every task as its op.
 * Geometry: blockDim T = 128, raised to the least common multiple of the norm tasks' dim/4;
 * a norm task takes ceil(vectors / (T / (dim/4))) blocks, an elementwise one ceil(elements / T)
 * up to 1024 (then strides).  Target: sm_90a. */
#include "backend/cuda/oplist.cuh"

static long ol_launches, ol_alone; /* process-wide, for the tests (cuda.h) */
long dsv4_cuda_op_list_launches(void) { return ol_launches; }
long dsv4_cuda_op_list_alone(void) { return ol_alone; }

/* the task as its own op (the table's, so a switched-off fused pair runs as its two ops) */
static void run_alone(dsv4_backend *b, const dsv4_op_task *t) {
    ol_alone++;
    dsv4_op_task_run(b->ops, b, t);
}

/* What one task needs of a launch: its table entry (positions and frequencies not yet placed),
 * its norm threads nt (0: elementwise), its rows of positions and pairs of frequencies. */
struct ol_entry {
    ol_task t;
    int nt, npos, nfreq;
    const int64_t *pos;
    const double *freq;
};

/* 1 when the list kernel takes the task as its standalone op would run it (then *e is filled),
 * 0 when it must run alone; -1 for a task that does nothing (an empty shape, as the op) */
static int ol_classify(dsv4_backend *b, const dsv4_op_task *t, ol_entry *e) {
    memset(e, 0, sizeof *e);
    ol_task &d = e->t;
    d.x = t->out;
    d.y = t->in;
    d.flags = (t->out_bf16 ? 1 : 0) | ((t->out_bf16 & DSV4_NORM_BF16_STEPS) ? 16 : 0);
    int dev = dsv4_cuda_is_dev(b, t->out);
    switch (t->kind) {
    case DSV4_TASK_RMSNORM:
    case DSV4_TASK_NORM_ROPE: {
        int nr = t->kind == DSV4_TASK_NORM_ROPE;
        int64_t nvec = (int64_t)t->rows * (nr ? t->n_heads : 1);
        if (t->rows <= 0) return -1;
        if (nr && (t->n_heads <= 0 || t->rope_dim <= 0 || t->rope_dim % 4 || t->rope_dim > t->dim))
            return 0; /* the op runs these as rmsnorm then rope */
        const void *in = nr ? t->out : t->in;
        int th = 0;
        if (!dev || !dsv4_cuda_is_dev(b, in) || nvec > 0x7fffffff || !rmsnorm_vec_threads(t->dim, in, t->out, &th))
            return 0;
        if (nr && (t->rows > OL_POS || t->rope_dim / 2 > OL_FREQ / 2)) return 0;
        int vw = 0;
        if (t->w) {
            dweight dw;
            memset(&dw, 0, sizeof dw);
            if (dsv4_cuda_weight(b, t->w, &dw)) return 0; /* the op reports it */
            vw = rmsnorm_vw(t->w, dw);
            if (!vw) return 0;
            d.w = dw.data;
        }
        d.kind = nr ? OL_NORM_ROPE : OL_RMSNORM;
        d.y = in;
        d.flags |= vw << 2;
        d.n0 = t->rows, d.n1 = nr ? t->n_heads : 1, d.n2 = t->dim, d.n3 = nr ? t->rope_dim : 0;
        d.f = t->eps;
        e->nt = th;
        if (nr) e->npos = t->rows, e->pos = t->pos, e->nfreq = t->rope_dim / 2, e->freq = t->freq;
        return 1;
    }
    case DSV4_TASK_ROPE:
        if (t->rows <= 0 || t->rope_dim / 2 <= 0) return -1;
        if (!dev || t->n_heads <= 0 || t->rows > OL_POS || t->rope_dim / 2 > OL_FREQ / 2 ||
            (int64_t)t->rows * t->n_heads * (t->rope_dim / 2) > 0x7fffffff)
            return 0;
        d.kind = OL_ROPE;
        d.flags |= t->inverse ? 2 : 0;
        d.n0 = t->rows, d.n1 = t->n_heads, d.n2 = t->dim, d.n3 = t->rope_dim;
        e->npos = t->rows, e->pos = t->pos, e->nfreq = t->rope_dim / 2, e->freq = t->freq;
        return 1;
    case DSV4_TASK_ADD_CYCLIC:
        if (t->rows <= 0 || t->dim <= 0 || t->period <= 0) return -1;
        if (!dev || !dsv4_cuda_is_dev(b, t->in) || (int64_t)t->rows * t->dim > 0x7fffffff) return 0;
        d.kind = OL_ADD_CYCLIC;
        d.n0 = t->rows, d.n1 = t->dim, d.n2 = t->period, d.n3 = t->first;
        return 1;
    case DSV4_TASK_COPY:
        if (!t->n) return -1;
        if (!dev || !dsv4_cuda_is_dev(b, t->in) || t->n > 0x7fffffff) return 0;
        d.kind = (((uintptr_t)t->out | (uintptr_t)t->in | t->n) & 15) ? OL_COPY1 : OL_COPY16;
        d.n0 = (int)(d.kind == OL_COPY16 ? t->n / 16 : t->n);
        return 1;
    case DSV4_TASK_SCALE:
        if (!t->n) return -1;
        if (!dev || t->n > 0x7fffffff) return 0;
        d.kind = OL_SCALE;
        d.n0 = (int)t->n;
        d.f = t->s;
        return 1;
    default: return -1;
    }
}

static int gcd(int a, int b) { return b ? gcd(b, a % b) : a; }

/* one launch being filled: its table, the least common multiple of its norm tasks' threads (0:
 * none yet), and where each task's positions and frequencies went (by host pointer: q and kv of a
 * layer share theirs) */
struct ol_fill {
    ol_params p;
    int threads, npos, nfreq;
    int n_pk, n_fk;
    const int64_t *pk[8];
    int pk_rows[8], pk_at[8];
    const double *fk[8];
    int fk_half[8], fk_at[8];
};

static void fill_reset(ol_fill *f) {
    f->p.n = 0;
    f->threads = 0;
    f->npos = f->nfreq = f->n_pk = f->n_fk = 0;
}

static int blocks_of(const ol_task &t, int nt, int threads) {
    int64_t n;
    if (nt) {
        int64_t nvec = (int64_t)t.n0 * t.n1, per = threads / nt;
        return (int)((nvec + per - 1) / per);
    }
    switch (t.kind) {
    case OL_ROPE: n = (int64_t)t.n0 * t.n1 * (t.n3 / 2); break;
    case OL_ADD_CYCLIC: n = (int64_t)t.n0 * t.n1; break;
    default: n = t.n0; break;
    }
    n = (n + threads - 1) / threads;
    return (int)(n < 1 ? 1 : n > 1024 ? 1024 : n);
}

/* blockDim: the norm tasks' common multiple, times the least factor that makes it >= 128 (the
 * elementwise tasks' share a block); 128 without norm tasks */
static int fill_threads(const ol_fill *f) {
    int t = f->threads ? f->threads : 128;
    for (int k = 2; t < 128 && k * f->threads <= 1024; k++) t = k * f->threads;
    return t;
}

static void fill_launch(dsv4_backend *b, ol_fill *f, const int *nts) {
    ol_params &p = f->p;
    if (!p.n) return;
    int threads = fill_threads(f);
    int64_t total = 0;
    for (int i = 0; i < p.n; i++) {
        p.first[i] = (int)total;
        total += blocks_of(p.t[i], nts[i], threads);
    }
    p.first[p.n] = (int)total;
    if (total <= 0x7fffffff && !dsv4_cuda_op_list_launch(b, p, (unsigned)total, threads)) ol_launches++;
    fill_reset(f);
}

/* places the entry in the launch being filled; 0 when it does not fit (the caller launches and
 * retries in an empty one, where every entry the classifier took fits) */
static int fill_add(ol_fill *f, const ol_entry &e, int *nts) {
    ol_params &p = f->p;
    if (p.n == OL_MAX) return 0;
    int threads = f->threads;
    if (e.nt) {
        int l = threads ? threads / gcd(threads, e.nt) * e.nt : e.nt;
        if (l > 1024) return 0;
        threads = l;
    }
    int pos_at = -1, freq_at = -1;
    if (e.npos) {
        for (int i = 0; i < f->n_pk && pos_at < 0; i++)
            if (f->pk[i] == e.pos && f->pk_rows[i] >= e.npos) pos_at = f->pk_at[i];
        if (pos_at < 0 && (f->npos + e.npos > OL_POS || f->n_pk == 8)) return 0;
        for (int i = 0; i < f->n_fk && freq_at < 0; i++)
            if (f->fk[i] == e.freq && f->fk_half[i] >= e.nfreq) freq_at = f->fk_at[i];
        if (freq_at < 0 && (f->nfreq + e.nfreq > OL_FREQ || f->n_fk == 8)) return 0;
        if (pos_at < 0) {
            pos_at = f->npos;
            memcpy(p.pos + pos_at, e.pos, sizeof(int64_t) * e.npos);
            f->pk[f->n_pk] = e.pos, f->pk_rows[f->n_pk] = e.npos, f->pk_at[f->n_pk++] = pos_at;
            f->npos += e.npos;
        }
        if (freq_at < 0) {
            freq_at = f->nfreq;
            for (int i = 0; i < e.nfreq; i++) p.freq[freq_at + i] = (float)e.freq[i];
            f->fk[f->n_fk] = e.freq, f->fk_half[f->n_fk] = e.nfreq, f->fk_at[f->n_fk++] = freq_at;
            f->nfreq += e.nfreq;
        }
    }
    f->threads = threads;
    p.t[p.n] = e.t;
    p.t[p.n].pos_at = pos_at < 0 ? 0 : pos_at;
    p.t[p.n].freq_at = freq_at < 0 ? 0 : freq_at;
    nts[p.n++] = e.nt;
    return 1;
}

/* [p, p + n bytes) and [q, q + m bytes) share a byte */
static int overlaps(const void *p, size_t n, const void *q, size_t m) {
    uintptr_t a = (uintptr_t)p, b = (uintptr_t)q;
    return p && q && a < b + m && b < a + n;
}

/* the bytes a task reads at in and writes at out (0 where it has no such operand) */
static void task_spans(const dsv4_op_task *t, size_t *in_n, size_t *out_n) {
    size_t v = 0;
    switch (t->kind) {
    case DSV4_TASK_RMSNORM: v = sizeof(float) * (size_t)t->rows * t->dim, *in_n = v, *out_n = v; return;
    case DSV4_TASK_NORM_ROPE:
    case DSV4_TASK_ROPE: v = sizeof(float) * (size_t)t->rows * t->n_heads * t->dim, *in_n = 0, *out_n = v; return;
    case DSV4_TASK_ADD_CYCLIC:
        *in_n = sizeof(float) * (size_t)t->period * t->dim, *out_n = sizeof(float) * (size_t)t->rows * t->dim;
        return;
    case DSV4_TASK_COPY: *in_n = t->n, *out_n = t->n; return;
    case DSV4_TASK_SCALE: *in_n = 0, *out_n = sizeof(float) * t->n; return;
    }
    *in_n = 0, *out_n = 0;
}

/* op_list_beside's early launch (backend.h): where the op just before was matmul_rn on the main
 * stream (its kernels wait before they let the next launch, so when this list starts every op
 * before matmul_rn has completed), and no task reads or writes what that op read or wrote (its x
 * and out; weights no task writes).  Then the tasks' inputs, written before matmul_rn, are there,
 * and nothing the two kernels share can race. */
static int beside_ok(cuda_impl *c, const dsv4_op_task *tasks, int n) {
    if (!c->rn_out || c->rn_op != c->op_seq - 1 || c->side_state != 0) return 0;
    for (int i = 0; i < n; i++) {
        size_t in_n, out_n;
        task_spans(&tasks[i], &in_n, &out_n);
        const void *in = tasks[i].in, *out = tasks[i].out;
        if (overlaps(in, in_n, c->rn_x, c->rn_x_n) || overlaps(in, in_n, c->rn_out, c->rn_out_n) ||
            overlaps(out, out_n, c->rn_x, c->rn_x_n) || overlaps(out, out_n, c->rn_out, c->rn_out_n))
            return 0;
    }
    return 1;
}

static void op_list_go(dsv4_backend *b, const dsv4_op_task *tasks, int n, int beside) {
    cuda_impl *c = CI(b);
    ol_entry e;
    int taken = 0;
    for (int i = 0; i < n && !c->failed; i++) { /* first the tasks that run alone */
        int k = ol_classify(b, &tasks[i], &e);
        if (k == 0) run_alone(b, &tasks[i]);
        taken += k > 0;
    }
    if (!taken || c->failed) return;
    dsv4_cuda_op_begin(b);
    ol_fill f;
    int nts[OL_MAX];
    fill_reset(&f);
    f.p.early = beside && beside_ok(c, tasks, n);
    if (beside) (f.p.early ? c->ol_beside_early : c->ol_beside_late)++;
    for (int i = 0; i < n && !c->failed; i++) {
        if (ol_classify(b, &tasks[i], &e) <= 0) continue;
        if (!fill_add(&f, e, nts)) {
            fill_launch(b, &f, nts);
            if (!fill_add(&f, e, nts)) /* every entry the classifier takes fits an empty launch */
                dsv4_cuda_fail(b, "op_list: a task does not fit an empty launch (internal)", __FILE__, __LINE__,
                               cudaSuccess);
        }
    }
    if (!c->failed) fill_launch(b, &f, nts);
    dsv4_cuda_op_end(b, DSV4_CUDA_OP_LIST);
}

void cu_op_list(dsv4_backend *b, const dsv4_op_task *tasks, int n) { op_list_go(b, tasks, n, 0); }
void cu_op_list_beside(dsv4_backend *b, const dsv4_op_task *tasks, int n) { op_list_go(b, tasks, n, 1); }

void dsv4_cuda_ol_beside_counts(dsv4_backend *b, long *early, long *late) {
    *early = CI(b)->ol_beside_early, *late = CI(b)->ol_beside_late;
}
