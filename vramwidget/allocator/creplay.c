/*
 * The caching-allocator replay of vramwidget.allocator.caching, compiled: the same rules as
 * ``CachingAllocator`` with the default settings (best fit over the pool's free blocks sorted
 * by (size, address), a block split when over 512 B (small pool) or 1 MiB (large pool) would
 * be left, merged with free neighbours on free, segments of 2 MiB / 20 MiB / the request
 * rounded to 2 MiB, the free-and-retry at a capacity that releases every cached whole
 * segment).  The mechanism is PyTorch's DeviceCachingAllocator
 * (c10/cuda/CUDACachingAllocator.cpp: round_size, get_pool, get_free_block, should_split,
 * alloc_block, free_block / try_merge_blocks, release_cached_blocks); the Python replay in
 * caching.py cites it rule by rule and is the reference this file is tested against, event
 * stream for event stream (tests/test_creplay.py).
 *
 * Two entry points.  ``replay(parts, limit, stop_at_repeat, growth_log)``:
 *
 *   parts           a list; each item is either a list of events (kind, key, nbytes, label)
 *                   or a tuple (events, n_steps, renames) standing for a caching.StepRun
 *                   (step m replays ``events`` = (kind, key, c0, c1, label) with sizes
 *                   c0 + c1 * m, then renames live keys), as caching.expand_runs writes out;
 *   limit           bytes the allocator may reserve, or -1 for none;
 *   stop_at_repeat  stop at a "step_end" event whose state equals the previous one's (and, with
 *                   a limit, no retry since), as caching.replay does;
 *   growth_log      None or a list: (event index, small pool?, that pool's reserved bytes)
 *                   appended at every new segment.
 *
 * Returns (max_reserved, max_requested, max_block_allocated, reserved, allocated,
 * fragmentation_at_max, segments, num_events, retries, oom) with oom None or
 * (event index, size, reserved, allocated, label).  ``replay_program(codes, slots, sizes,
 * limit, stop_at_repeat)``: the same for a stream given as three columns (a step plan's
 * events, without a Python object per event).
 *
 * Portable C99 (GCC, Clang, MSVC); no floating-point contraction in the size arithmetic
 * (a decode step's size is c0 + c1 * m computed as Python computes it).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MIN_BLOCK ((int64_t)512)
#define SMALL_SIZE ((int64_t)1 << 20)
#define SMALL_BUFFER ((int64_t)2 << 20)
#define MIN_LARGE_ALLOC ((int64_t)10 << 20)
#define LARGE_BUFFER ((int64_t)20 << 20)
#define ROUND_LARGE ((int64_t)2 << 20)

typedef struct {
    int64_t addr, size, requested;
    int32_t prev, next;
    uint8_t allocated, small, inuse;
} Block;

typedef struct {
    int64_t size, addr;
    int32_t blk;
} Key;

typedef struct {
    Key *a;
    Py_ssize_t n, cap;
} FreeList;

typedef struct {
    Block *b;
    Py_ssize_t nb, capb;
    int32_t *spare;
    Py_ssize_t nspare, capspare;
    FreeList fl[2]; /* [small] */
    int64_t reserved, allocated, requested, max_reserved, max_allocated, max_requested, frag;
    int64_t segs, retries, next_addr, limit;
    int64_t pool_reserved[2];
    int has_limit;
} Alloc;

/* ---- blocks and free lists ------------------------------------------------------------ */

/* room for one more of ``*n`` elements of ``elem`` bytes in ``*buf`` (capacity ``*cap``,
 * doubled from ``first`` when full); -1 when out of host memory */
static int grow(void **buf, Py_ssize_t n, Py_ssize_t *cap, size_t elem, Py_ssize_t first) {
    if (n < *cap) return 0;
    Py_ssize_t c = *cap ? *cap * 2 : first;
    void *nb = realloc(*buf, elem * (size_t)c);
    if (!nb) return -1;
    *buf = nb;
    *cap = c;
    return 0;
}

static int32_t new_block(Alloc *A, int64_t addr, int64_t size, int small) {
    int32_t i;
    if (A->nspare > 0) {
        i = A->spare[--A->nspare];
    } else {
        if (grow((void **)&A->b, A->nb, &A->capb, sizeof(Block), 1024) < 0) return -1;
        i = (int32_t)A->nb++;
    }
    Block *b = &A->b[i];
    b->addr = addr;
    b->size = size;
    b->requested = 0;
    b->prev = b->next = -1;
    b->allocated = 0;
    b->small = (uint8_t)small;
    b->inuse = 1;
    return i;
}

static int drop_block(Alloc *A, int32_t i) {
    A->b[i].inuse = 0;
    if (grow((void **)&A->spare, A->nspare, &A->capspare, sizeof(int32_t), 256) < 0) return -1;
    A->spare[A->nspare++] = i;
    return 0;
}

/* the first position whose (size, addr) is >= (size, addr): bisect_left */
static Py_ssize_t fl_lower(const FreeList *L, int64_t size, int64_t addr) {
    Py_ssize_t lo = 0, hi = L->n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) >> 1;
        const Key *k = &L->a[mid];
        if (k->size < size || (k->size == size && k->addr < addr))
            lo = mid + 1;
        else
            hi = mid;
    }
    return lo;
}

static int fl_insert(FreeList *L, int64_t size, int64_t addr, int32_t blk) {
    if (grow((void **)&L->a, L->n, &L->cap, sizeof(Key), 64) < 0) return -1;
    Py_ssize_t i = fl_lower(L, size, addr);
    memmove(&L->a[i + 1], &L->a[i], sizeof(Key) * (size_t)(L->n - i));
    L->a[i].size = size;
    L->a[i].addr = addr;
    L->a[i].blk = blk;
    L->n++;
    return 0;
}

static void fl_remove_at(FreeList *L, Py_ssize_t i) {
    memmove(&L->a[i], &L->a[i + 1], sizeof(Key) * (size_t)(L->n - i - 1));
    L->n--;
}

static void fl_remove(FreeList *L, int64_t size, int64_t addr) {
    fl_remove_at(L, fl_lower(L, size, addr));
}

/* release_cached_blocks: every cached block that is a whole segment, large pool first */
static int release_cached(Alloc *A) {
    for (int small = 0; small < 2; small++) {
        FreeList *L = &A->fl[small];
        Py_ssize_t w = 0;
        for (Py_ssize_t r = 0; r < L->n; r++) {
            Key k = L->a[r];
            Block *b = &A->b[k.blk];
            if (b->prev < 0 && b->next < 0) {
                A->reserved -= b->size;
                A->pool_reserved[small] -= b->size;
                if (drop_block(A, k.blk) < 0) return -1;
            } else {
                L->a[w++] = k;
            }
        }
        L->n = w;
    }
    return 0;
}

/* ---- malloc / free -------------------------------------------------------------------- */

#define OOM_FAIL (-2)
#define MEM_FAIL (-1)

static int64_t seg_size(int64_t size, int small) {
    if (small) return SMALL_BUFFER;
    if (size < MIN_LARGE_ALLOC) return LARGE_BUFFER;
    return (size + ROUND_LARGE - 1) / ROUND_LARGE * ROUND_LARGE;
}

/* DeviceCachingAllocator::malloc for a request already rounded by round_size; the block
 * index, OOM_FAIL past the limit after the retry, MEM_FAIL when out of host memory.
 * *grew is set to the pool (0 / 1) that got a new segment, else -1. */
static int32_t a_malloc(Alloc *A, int64_t size, int *grew) {
    int small = size <= SMALL_SIZE;
    FreeList *L = &A->fl[small];
    Py_ssize_t i = fl_lower(L, size, -1);
    int32_t bi;
    *grew = -1;
    if (i < L->n) {
        bi = L->a[i].blk;
        fl_remove_at(L, i);
    } else {
        int64_t seg = seg_size(size, small);
        if (A->has_limit && A->reserved + seg > A->limit) {
            A->retries++;
            if (release_cached(A) < 0) return MEM_FAIL;
            if (A->reserved + seg > A->limit) return OOM_FAIL;
        }
        bi = new_block(A, A->next_addr, seg, small);
        if (bi < 0) return MEM_FAIL;
        A->next_addr += seg + ((int64_t)1 << 21);
        A->reserved += seg;
        A->pool_reserved[small] += seg;
        A->segs++;
        *grew = small;
    }
    int64_t remaining = A->b[bi].size - size;
    if (small ? remaining >= MIN_BLOCK : remaining > SMALL_SIZE) {
        int32_t ri = new_block(A, A->b[bi].addr + size, remaining, small);
        if (ri < 0) return MEM_FAIL;
        Block *b = &A->b[bi], *r = &A->b[ri];
        r->prev = bi;
        r->next = b->next;
        if (b->next >= 0) A->b[b->next].prev = ri;
        b->next = ri;
        b->size = size;
        if (fl_insert(L, remaining, r->addr, ri) < 0) return MEM_FAIL;
    }
    Block *b = &A->b[bi];
    b->allocated = 1;
    b->requested = size;
    A->allocated += b->size;
    A->requested += size;
    if (A->requested > A->max_requested) A->max_requested = A->requested;
    if (A->allocated > A->max_allocated) A->max_allocated = A->allocated;
    if (*grew >= 0 && A->reserved > A->max_reserved) {
        A->max_reserved = A->reserved;
        A->frag = A->reserved - A->allocated;
    }
    return bi;
}

/* torch.cuda.reset_peak_memory_stats(): the peaks restart from the current values */
static void reset_peak(Alloc *A) {
    A->max_reserved = A->reserved;
    A->max_allocated = A->allocated;
    A->max_requested = A->requested;
    A->frag = A->reserved - A->allocated;
}

/* free_block: back to its pool, merged with free neighbours */
static int a_free(Alloc *A, int32_t bi) {
    Block *b = &A->b[bi];
    b->allocated = 0;
    A->allocated -= b->size;
    A->requested -= b->requested;
    FreeList *L = &A->fl[b->small];
    int32_t ni = b->prev;
    if (ni >= 0 && !A->b[ni].allocated) {
        Block *nb = &A->b[ni];
        fl_remove(L, nb->size, nb->addr);
        b->addr = nb->addr;
        b->prev = nb->prev;
        if (b->prev >= 0) A->b[b->prev].next = bi;
        b->size += nb->size;
        if (drop_block(A, ni) < 0) return -1;
    }
    ni = b->next;
    if (ni >= 0 && !A->b[ni].allocated) {
        Block *nb = &A->b[ni];
        fl_remove(L, nb->size, nb->addr);
        b->next = nb->next;
        if (b->next >= 0) A->b[b->next].prev = bi;
        b->size += nb->size;
        if (drop_block(A, ni) < 0) return -1;
    }
    return fl_insert(L, b->size, b->addr, bi);
}

/* round_size with the default settings */
static int64_t round_int(int64_t raw) {
    return raw >= MIN_BLOCK ? (raw + 511) & ~(int64_t)511 : MIN_BLOCK;
}

static int64_t round_double(double raw) {
    return raw >= (double)MIN_BLOCK ? (((int64_t)raw) + 511) & ~(int64_t)511 : MIN_BLOCK;
}

/* ---- the state at a step's end (caching.CachingAllocator.signature) ------------------- */

typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Sig;

static int sig_push(Sig *s, int64_t x) {
    if (grow((void **)&s->v, s->n, &s->cap, sizeof(int64_t), 1024) < 0) return -1;
    s->v[s->n++] = x;
    return 0;
}

static int cmp_pair(const void *a, const void *b) {
    const int64_t *x = (const int64_t *)a, *y = (const int64_t *)b;
    if (x[0] != y[0]) return x[0] < y[0] ? -1 : 1;
    if (x[1] != y[1]) return x[1] < y[1] ? -1 : 1;
    return 0;
}

/* the live blocks' (addr, size) in address order, the large then the small free list, the
 * reserved bytes: equal signatures replay equal streams identically */
static int signature(Alloc *A, Sig *s) {
    s->n = 0;
    Py_ssize_t nlive = 0;
    for (int32_t i = 0; i < (int32_t)A->nb; i++) {
        Block *b = &A->b[i];
        if (b->inuse && b->allocated) {
            if (sig_push(s, b->addr) < 0 || sig_push(s, b->size) < 0) return -1;
            nlive++;
        }
    }
    qsort(s->v, (size_t)nlive, 2 * sizeof(int64_t), cmp_pair);
    if (sig_push(s, -1) < 0) return -1;
    for (int pool = 0; pool < 2; pool++) {
        FreeList *L = &A->fl[pool];
        for (Py_ssize_t i = 0; i < L->n; i++)
            if (sig_push(s, L->a[i].size) < 0 || sig_push(s, L->a[i].addr) < 0) return -1;
        if (sig_push(s, -2) < 0) return -1;
    }
    return sig_push(s, A->reserved);
}

/* a step_end: 0 when the state equals the previous step end's (no retry since): stop */
static int step_end(Alloc *A, long long step, Sig *last, Sig *now, int *have_last, int64_t *last_retries) {
    if (signature(A, now) < 0) {
        PyErr_NoMemory();
        return -1;
    }
    if (step >= 2 && *have_last && now->n == last->n &&
        memcmp(now->v, last->v, sizeof(int64_t) * (size_t)now->n) == 0 && A->retries == *last_retries)
        return 0;
    Sig t = *last;
    *last = *now;
    *now = t;
    *have_last = 1;
    *last_retries = A->retries;
    return 1;
}

/* ---- the replay ------------------------------------------------------------------------ */

static PyObject *S_alloc, *S_free, *S_step_end, *S_reset_peak, *S_empty_cache;

static int kind_is(PyObject *kind, PyObject *name) {
    if (kind == name) return 1;
    if (!PyUnicode_Check(kind)) return 0;
    return PyUnicode_Compare(kind, name) == 0;
}

static int read_num(PyObject *o, int64_t *iv, double *dv, int *is_int) {
    if (PyLong_Check(o) || (!PyFloat_Check(o) && PyIndex_Check(o))) {
        PyObject *i = PyNumber_Index(o);
        if (!i) return -1;
        long long v = PyLong_AsLongLong(i);
        Py_DECREF(i);
        if (v == -1 && PyErr_Occurred()) return -1;
        *iv = (int64_t)v;
        *dv = (double)v;
        *is_int = 1;
        return 0;
    }
    double d = PyFloat_AsDouble(o);
    if (d == -1.0 && PyErr_Occurred()) return -1;
    *dv = d;
    *iv = 0;
    *is_int = 0;
    return 0;
}

/* a size in bytes as caching.replay reads it: int(nbytes) rounded, the 512 B floor read on
 * the value itself (an int, a float, or anything with __index__ / __float__) */
static int read_size(PyObject *o, int64_t *out) {
    int64_t iv;
    double dv;
    int is_int;
    if (read_num(o, &iv, &dv, &is_int) < 0) return -1;
    if (is_int) {
        *out = round_int(iv);
        return 0;
    }
    if (!(dv < 4e18)) {
        PyErr_SetString(PyExc_OverflowError, "a request too large for the compiled replay");
        return -1;
    }
    *out = round_double(dv);
    return 0;
}

typedef struct {
    int kind; /* 0 alloc, 1 free */
    int is_int;
    int32_t lk;
    int64_t c0i, c1i;
    double c0d, c1d;
    int c1_int; /* c1 an int (its product with m exact), c0 a float */
    PyObject *label;
} RunEvent;

static void set_key_error(PyObject *key) {
    PyObject *t = PyTuple_Pack(1, key);
    if (t) {
        PyErr_SetObject(PyExc_KeyError, t);
        Py_DECREF(t);
    }
}

/* the local index of ``key`` in a run, added to ``keys`` (a list) and ``index`` (a dict) */
static int32_t local_key(PyObject *index, PyObject *keys, PyObject *key) {
    PyObject *v = PyDict_GetItemWithError(index, key);
    if (v) return (int32_t)PyLong_AsLong(v);
    if (PyErr_Occurred()) return -1;
    Py_ssize_t n = PyList_GET_SIZE(keys);
    PyObject *nv = PyLong_FromSsize_t(n);
    if (!nv) return -1;
    int rc = PyDict_SetItem(index, key, nv);
    Py_DECREF(nv);
    if (rc < 0 || PyList_Append(keys, key) < 0) return -1;
    return (int32_t)n;
}

typedef struct {
    Alloc A;
    PyObject *live;       /* key -> block index (int) */
    PyObject *growth_log; /* None or a list */
    int64_t g;            /* index of the next event in the written-out stream */
    int64_t oom_index, oom_size;
    PyObject *oom_label;  /* borrowed */
    int stopped;
} Replay;

/* an empty allocator (addresses from 2^40, as caching.CachingAllocator's) with ``limit``
 * bytes to reserve (-1: none) */
static void init_replay(Replay *R, long long limit) {
    memset(R, 0, sizeof(*R));
    R->A.next_addr = (int64_t)1 << 40;
    R->A.has_limit = limit >= 0;
    R->A.limit = (int64_t)limit;
    R->oom_index = -1;
}

static int log_growth(Replay *R, int pool) {
    if (pool < 0 || R->growth_log == Py_None) return 0;
    PyObject *t = Py_BuildValue("(LOL)", (long long)R->g, pool ? Py_True : Py_False,
                                (long long)R->A.pool_reserved[pool]);
    if (!t) return -1;
    int rc = PyList_Append(R->growth_log, t);
    Py_DECREF(t);
    return rc;
}

/* 1: went on, 0: stopped (out of memory or a repeated step), -1: error */
static int replay_events(Replay *R, PyObject *events, int stop_at_repeat, Sig *last, Sig *now,
                         int *have_last, int64_t *last_retries) {
    Alloc *A = &R->A;
    PyObject *seq = PySequence_Fast(events, "a part of the stream must be a list of events");
    if (!seq) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    int rc = 1;
    for (Py_ssize_t e = 0; e < n; e++, R->g++) {
        PyObject *ev = items[e];
        PyObject *kind, *key, *nbytes, *label;
        if (PyTuple_Check(ev) && PyTuple_GET_SIZE(ev) == 4) {
            kind = PyTuple_GET_ITEM(ev, 0);
            key = PyTuple_GET_ITEM(ev, 1);
            nbytes = PyTuple_GET_ITEM(ev, 2);
            label = PyTuple_GET_ITEM(ev, 3);
        } else if (PyList_Check(ev) && PyList_GET_SIZE(ev) == 4) {
            kind = PyList_GET_ITEM(ev, 0);
            key = PyList_GET_ITEM(ev, 1);
            nbytes = PyList_GET_ITEM(ev, 2);
            label = PyList_GET_ITEM(ev, 3);
        } else {
            PyErr_SetString(PyExc_ValueError, "a replay event is (kind, key, nbytes, label)");
            rc = -1;
            break;
        }
        if (kind_is(kind, S_alloc)) {
            int64_t size;
            int grew;
            if (read_size(nbytes, &size) < 0) { rc = -1; break; }
            int32_t bi = a_malloc(A, size, &grew);
            if (bi == OOM_FAIL) {
                R->oom_index = R->g;
                R->oom_size = size;
                R->oom_label = label;
                rc = 0;
                break;
            }
            if (bi < 0) { PyErr_NoMemory(); rc = -1; break; }
            if (log_growth(R, grew) < 0) { rc = -1; break; }
            PyObject *v = PyLong_FromLong(bi);
            if (!v || PyDict_SetItem(R->live, key, v) < 0) { Py_XDECREF(v); rc = -1; break; }
            Py_DECREF(v);
        } else if (kind_is(kind, S_free)) {
            PyObject *v = PyDict_GetItemWithError(R->live, key);
            if (!v) {
                if (!PyErr_Occurred()) set_key_error(key);
                rc = -1;
                break;
            }
            int32_t bi = (int32_t)PyLong_AsLong(v);
            if (PyDict_DelItem(R->live, key) < 0 || a_free(A, bi) < 0) { rc = -1; break; }
        } else if (kind_is(kind, S_step_end)) {
            if (!stop_at_repeat) continue;
            long long step = PyLong_AsLongLong(key);
            if (step == -1 && PyErr_Occurred()) { rc = -1; break; }
            int go = step_end(A, step, last, now, have_last, last_retries);
            if (go <= 0) { rc = go; break; }
        } else if (kind_is(kind, S_reset_peak)) {
            reset_peak(A);
        } else if (kind_is(kind, S_empty_cache)) {
            if (release_cached(A) < 0) { PyErr_NoMemory(); rc = -1; break; }
        } else {
            PyObject *r = PyObject_Repr(kind);
            if (r) {
                PyErr_Format(PyExc_ValueError, "unknown replay event %U", r);
                Py_DECREF(r);
            }
            rc = -1;
            break;
        }
    }
    Py_DECREF(seq);
    return rc;
}

/* a StepRun (events, n_steps, renames): its keys made local, the steps replayed on arrays */
static int replay_run(Replay *R, PyObject *run) {
    Alloc *A = &R->A;
    PyObject *events, *renames;
    Py_ssize_t n_steps;
    if (!PyArg_ParseTuple(run, "OnO", &events, &n_steps, &renames)) return -1;
    PyObject *evs = PySequence_Fast(events, "a run's events must be a sequence");
    if (!evs) return -1;
    PyObject *rns = PySequence_Fast(renames, "a run's renames must be a sequence");
    if (!rns) { Py_DECREF(evs); return -1; }
    Py_ssize_t width = PySequence_Fast_GET_SIZE(evs), nren = PySequence_Fast_GET_SIZE(rns);
    PyObject *index = PyDict_New(), *keys = PyList_New(0);
    RunEvent *re = (RunEvent *)calloc((size_t)(width ? width : 1), sizeof(RunEvent));
    int32_t *ren = (int32_t *)calloc((size_t)(2 * nren + 1), sizeof(int32_t));
    int32_t *lb = NULL;
    int rc = -1;
    if (!index || !keys || !re || !ren) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t j = 0; j < width; j++) {
        PyObject *ev = PySequence_Fast_GET_ITEM(evs, j);
        if (!PyTuple_Check(ev) || PyTuple_GET_SIZE(ev) != 5) {
            PyErr_SetString(PyExc_ValueError, "a run's event is (kind, key, c0, c1, label)");
            goto done;
        }
        RunEvent *x = &re[j];
        x->kind = kind_is(PyTuple_GET_ITEM(ev, 0), S_alloc) ? 0 : 1;
        x->lk = local_key(index, keys, PyTuple_GET_ITEM(ev, 1));
        if (x->lk < 0) goto done;
        x->label = PyTuple_GET_ITEM(ev, 4);
        if (x->kind == 0) {
            int i0, i1;
            if (read_num(PyTuple_GET_ITEM(ev, 2), &x->c0i, &x->c0d, &i0) < 0 ||
                read_num(PyTuple_GET_ITEM(ev, 3), &x->c1i, &x->c1d, &i1) < 0)
                goto done;
            x->is_int = i0 && i1;
            x->c1_int = i1;
        }
    }
    for (Py_ssize_t j = 0; j < nren; j++) {
        PyObject *p = PySequence_Fast_GET_ITEM(rns, j);
        PyObject *a, *b;
        if (!PyArg_ParseTuple(p, "OO", &a, &b)) goto done;
        if ((ren[2 * j] = local_key(index, keys, a)) < 0 || (ren[2 * j + 1] = local_key(index, keys, b)) < 0)
            goto done;
    }
    Py_ssize_t nk = PyList_GET_SIZE(keys);
    lb = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nk ? nk : 1));
    if (!lb) { PyErr_NoMemory(); goto done; }
    /* keys live before the run (the previous step's tensors) move into the run's table */
    for (Py_ssize_t k = 0; k < nk; k++) {
        PyObject *key = PyList_GET_ITEM(keys, k);
        PyObject *v = PyDict_GetItemWithError(R->live, key);
        if (v) {
            lb[k] = (int32_t)PyLong_AsLong(v);
            if (PyDict_DelItem(R->live, key) < 0) goto done;
        } else {
            if (PyErr_Occurred()) goto done;
            lb[k] = -1;
        }
    }
    rc = 1;
    for (Py_ssize_t m = 0; m < n_steps && rc == 1; m++) {
        for (Py_ssize_t j = 0; j < width; j++, R->g++) {
            RunEvent *x = &re[j];
            if (x->kind == 0) {
                int64_t size;
                if (x->is_int) {
                    size = round_int(x->c0i + x->c1i * (int64_t)m);
                } else {
                    volatile double prod = x->c1_int ? (double)(x->c1i * (int64_t)m) : x->c1d * (double)m;
                    volatile double raw = x->c0d + prod;
                    size = round_double(raw);
                }
                int grew;
                int32_t bi = a_malloc(A, size, &grew);
                if (bi == OOM_FAIL) {
                    R->oom_index = R->g;
                    R->oom_size = size;
                    R->oom_label = x->label;
                    rc = 0;
                    break;
                }
                if (bi < 0) { PyErr_NoMemory(); rc = -1; break; }
                if (log_growth(R, grew) < 0) { rc = -1; break; }
                lb[x->lk] = bi;
            } else {
                int32_t bi = lb[x->lk];
                if (bi < 0) {
                    set_key_error(PyList_GET_ITEM(keys, x->lk));
                    rc = -1;
                    break;
                }
                lb[x->lk] = -1;
                if (a_free(A, bi) < 0) { PyErr_NoMemory(); rc = -1; break; }
            }
        }
        if (rc != 1) break;
        for (Py_ssize_t j = 0; j < nren; j++) {
            int32_t a = ren[2 * j], b = ren[2 * j + 1];
            if (lb[a] < 0) {
                set_key_error(PyList_GET_ITEM(keys, a));
                rc = -1;
                break;
            }
            lb[b] = lb[a];
            if (a != b) lb[a] = -1;
        }
    }
    if (rc >= 0) {
        /* what is still live goes back to the stream's table, under the run's key names */
        for (Py_ssize_t k = 0; k < nk; k++) {
            if (lb[k] < 0) continue;
            PyObject *v = PyLong_FromLong(lb[k]);
            if (!v || PyDict_SetItem(R->live, PyList_GET_ITEM(keys, k), v) < 0) {
                Py_XDECREF(v);
                rc = -1;
                break;
            }
            Py_DECREF(v);
        }
    }
done:
    free(lb);
    free(ren);
    free(re);
    Py_XDECREF(index);
    Py_XDECREF(keys);
    Py_DECREF(rns);
    Py_DECREF(evs);
    return rc;
}

/* the replay's statistics as the Python wrapper reads them (rc 0: it stopped early) */
static PyObject *result(Replay *R, int rc) {
    Alloc *A = &R->A;
    /* num_events as caching.replay counts it: the index of the last event replayed, plus one */
    long long num_events = rc == 0 ? (long long)R->g + 1 : (R->g > 0 ? (long long)R->g : 1);
    PyObject *oom;
    if (R->oom_index >= 0) {
        oom = Py_BuildValue("(LLLLO)", (long long)R->oom_index, (long long)R->oom_size, (long long)A->reserved,
                            (long long)A->allocated, R->oom_label ? R->oom_label : Py_None);
        if (!oom) return NULL;
    } else {
        oom = Py_None;
        Py_INCREF(oom);
    }
    return Py_BuildValue("(LLLLLLLLLN)", (long long)A->max_reserved, (long long)A->max_requested,
                         (long long)A->max_allocated, (long long)A->reserved, (long long)A->allocated,
                         (long long)A->frag, (long long)A->segs, num_events, (long long)A->retries, oom);
}

static void free_alloc(Alloc *A) {
    free(A->b);
    free(A->spare);
    free(A->fl[0].a);
    free(A->fl[1].a);
}

static PyObject *py_replay(PyObject *self, PyObject *args) {
    PyObject *parts, *growth_log;
    long long limit;
    int stop_at_repeat;
    (void)self;
    if (!PyArg_ParseTuple(args, "OLpO", &parts, &limit, &stop_at_repeat, &growth_log)) return NULL;
    if (growth_log != Py_None && !PyList_Check(growth_log)) {
        PyErr_SetString(PyExc_TypeError, "growth_log must be None or a list");
        return NULL;
    }
    Replay R;
    init_replay(&R, limit);
    R.growth_log = growth_log;
    R.live = PyDict_New();
    if (!R.live) return NULL;
    Sig last = {0}, now = {0};
    int have_last = 0;
    int64_t last_retries = 0;
    PyObject *seq = PySequence_Fast(parts, "parts must be a sequence");
    PyObject *out = NULL;
    int rc = 1;
    if (!seq) goto done;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    for (Py_ssize_t p = 0; p < n && rc == 1; p++) {
        PyObject *part = PySequence_Fast_GET_ITEM(seq, p);
        if (PyTuple_Check(part))
            rc = replay_run(&R, part);
        else
            rc = replay_events(&R, part, stop_at_repeat, &last, &now, &have_last, &last_retries);
    }
    if (rc < 0) goto done;
    out = result(&R, rc);
done:
    Py_XDECREF(seq);
    Py_DECREF(R.live);
    free(last.v);
    free(now.v);
    free_alloc(&R.A);
    return out;
}

/* replay_program(codes, slots, sizes, limit, stop_at_repeat): a stream as three columns
 * (a step plan's events, vramwidget.plan.views.program_at): codes int8 (0 alloc, 1 free,
 * 2 step_end, 3 reset_peak, 4 empty_cache), slots int64 (the allocation's key, a step_end's
 * step), sizes int64 (an allocation's bytes).  The same replay and result as replay() on
 * the events (kind, key, size, label), the out-of-memory label left to the caller (None). */
static PyObject *py_replay_program(PyObject *self, PyObject *args) {
    Py_buffer kb, sb, zb;
    long long limit;
    int stop_at_repeat;
    (void)self;
    if (!PyArg_ParseTuple(args, "y*y*y*Lp", &kb, &sb, &zb, &limit, &stop_at_repeat)) return NULL;
    Py_ssize_t n = kb.len;
    const int8_t *codes = (const int8_t *)kb.buf;
    const int64_t *slots = (const int64_t *)sb.buf, *sizes = (const int64_t *)zb.buf;
    Replay R;
    init_replay(&R, limit);
    Sig last = {0}, now = {0};
    int have_last = 0;
    int64_t last_retries = 0;
    int32_t *table = NULL;
    PyObject *out = NULL;
    int rc = 1;
    if (sb.len != 8 * n || zb.len != 8 * n) {
        PyErr_SetString(PyExc_ValueError, "codes (int8), slots and sizes (int64) must have one entry per event");
        goto done;
    }
    int64_t nslots = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (codes[i] <= 1) {
            if (slots[i] < 0) {
                PyErr_SetString(PyExc_ValueError, "an allocation's slot must be >= 0");
                goto done;
            }
            if (slots[i] >= nslots) nslots = slots[i] + 1;
        }
    }
    table = (int32_t *)malloc(sizeof(int32_t) * (size_t)(nslots ? nslots : 1));
    if (!table) { PyErr_NoMemory(); goto done; }
    for (int64_t k = 0; k < nslots; k++) table[k] = -1;
    Alloc *A = &R.A;
    for (Py_ssize_t i = 0; i < n && rc == 1; i++, R.g++) {
        switch (codes[i]) {
        case 0: {
            int grew;
            int64_t size = round_int(sizes[i]);
            int32_t bi = a_malloc(A, size, &grew);
            if (bi == OOM_FAIL) {
                R.oom_index = R.g;
                R.oom_size = size;
                rc = 0;
                break;
            }
            if (bi < 0) { PyErr_NoMemory(); rc = -1; break; }
            table[slots[i]] = bi;
            break;
        }
        case 1: {
            int32_t bi = table[slots[i]];
            if (bi < 0) {
                PyObject *k = PyLong_FromLongLong((long long)slots[i]);
                if (k) { set_key_error(k); Py_DECREF(k); }
                rc = -1;
                break;
            }
            table[slots[i]] = -1;
            if (a_free(A, bi) < 0) { PyErr_NoMemory(); rc = -1; }
            break;
        }
        case 2:
            if (stop_at_repeat) rc = step_end(A, (long long)slots[i], &last, &now, &have_last, &last_retries);
            break;
        case 3:
            reset_peak(A);
            break;
        case 4:
            if (release_cached(A) < 0) { PyErr_NoMemory(); rc = -1; }
            break;
        default:
            PyErr_Format(PyExc_ValueError, "unknown replay event code %d", (int)codes[i]);
            rc = -1;
        }
        if (rc != 1) break;
    }
    if (rc >= 0) out = result(&R, rc);
done:
    free(table);
    free(last.v);
    free(now.v);
    free_alloc(&R.A);
    PyBuffer_Release(&kb);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&zb);
    return out;
}

static PyMethodDef methods[] = {
    {"replay", py_replay, METH_VARARGS,
     "replay(parts, limit, stop_at_repeat, growth_log): the caching allocator's replay of an event "
     "stream with the default settings (see vramwidget/allocator/creplay.c)."},
    {"replay_program", py_replay_program, METH_VARARGS,
     "replay_program(codes, slots, sizes, limit, stop_at_repeat): the same replay of a stream given as "
     "three columns (int8 codes, int64 slots, int64 sizes)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "creplay", NULL, -1, methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit_creplay(void) {
    S_alloc = PyUnicode_InternFromString("alloc");
    S_free = PyUnicode_InternFromString("free");
    S_step_end = PyUnicode_InternFromString("step_end");
    S_reset_peak = PyUnicode_InternFromString("reset_peak");
    S_empty_cache = PyUnicode_InternFromString("empty_cache");
    if (!S_alloc || !S_free || !S_step_end || !S_reset_peak || !S_empty_cache) return NULL;
    return PyModule_Create(&module);
}
