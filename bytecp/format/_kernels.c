/* bytecp.format._kernels: the compiled kernels of serving deltas (FORMAT.md section 13).
 *
 * Optional: pyproject.toml's ext-modules builds it where a C compiler is
 * (optional = true), and bytecp.format.kernels loads it only when its ABI
 * matches and it agrees with the NumPy reference (bytecp.format.serving_elements)
 * on a self-check; else every caller runs the NumPy code, which computes the
 * same values. Each function works on buffers (NumPy arrays, bytes), checks
 * their sizes, and releases the GIL for its loop, so that a follower's apply
 * threads run on every core.
 *
 *   decode_positions(buf, count, numel, out) -> int
 *       the LEB128 gaps of buf into `count` int64 positions in `out`;
 *       0: done, checked; 1: not `count` values, or the last one unfinished;
 *       2: a gap longer than 9 bytes; 3: a gap >= numel or a repeat (a gap
 *       of 0 after the first); 4: a position >= numel. (The first failure in
 *       that order, as the NumPy decoder classifies them.)
 *   change_sum(g, new, old, itemsize) -> int
 *       sum(w(g[k]) * (new[k] - old[k])) mod 2**64 (w: SplitMix64, as
 *       serving_elements.element_weights), the bits as unsigned integers.
 *   swap_change_sum(held, q, new, g, g_add, itemsize, old[, journal, tag]) -> int
 *       the same with old[k] = held[q[k]] (g None: g[k] = q[k] + g_add),
 *       writing new[k] into held[q[k]] as it goes and the value it replaced
 *       into old[k] (every position checked first: a bad one changes
 *       nothing); scatter(held, q, old) undoes it. With a journal (a list),
 *       (tag, held, q, old) is appended to it before the call returns.
 *   scatter(dst, pos, new, itemsize) -> None
 *       dst[pos[k]] = new[k].
 *   apply_deltas(jobs) -> [(code, change or None)]
 *       a follower's apply thread's boxes in one call, the GIL released once
 *       (not twice a box: on a 2-core host the hand-backs of the GIL between
 *       two apply threads cost more than their Python). A job is (held, raw,
 *       count, numel, itemsize, start, g_add, q, old, recs, tag, group): the
 *       delta part raw (count values, then their positions' gaps) of a box
 *       of numel elements at element `start` of held, decoded into q (each
 *       plus start) as decode_positions does (code 1 to 4 on failure,
 *       nothing written), then swap_change_sum(held, q, values, None, g_add)
 *       with (tag, held, q, old) appended to the list recs; a job after a
 *       failed one of its group (one box's steps, in order) is not applied
 *       (code 6). Every record is made before the call returns; if one cannot
 *       be, the changes not yet recorded are undone, the latest first, and
 *       the call raises.
 *
 * The element checksum's definition and the position encoding are in
 * bytecp/format/serving_elements.py; this file implements them, nothing more.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

/* bytecp.format.kernels.ABI: bumped with any change of these functions' arguments or results */
#define BYTECP_KERNELS_ABI 3
/* elements read this many ahead are asked for (prefetched): positions far apart come from memory,
 * and on the benchmark host 64 ahead took a cold gather of 480,000 of 36M elements from 7.8 to 4.7 ms.
 * With locality 1 (prefetcht2: kept in the outer caches), not 0 (non-temporal): 540,000 changes in 36M
 * elements, none of them cached, 4.8 -> 4.1 ms (locality 3 and 2: 4.4 and 4.1; 32 or 128 ahead: as 64;
 * 256: slower) */
#ifndef AHEAD
#define AHEAD 64
#endif

static inline uint64_t weight(int64_t i) {
    uint64_t z = ((uint64_t)i + 1u) * 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static inline uint64_t load_bits(const char *base, Py_ssize_t k, int itemsize) {
    switch (itemsize) {
    case 1: return ((const uint8_t *)base)[k];
    case 2: { uint16_t v; memcpy(&v, base + 2 * k, 2); return v; }
    case 4: { uint32_t v; memcpy(&v, base + 4 * k, 4); return v; }
    default: { uint64_t v; memcpy(&v, base + 8 * k, 8); return v; }
    }
}

static int check_itemsize(int itemsize) {
    if (itemsize != 1 && itemsize != 2 && itemsize != 4 && itemsize != 8) {
        PyErr_Format(PyExc_ValueError, "itemsize must be 1, 2, 4 or 8, got %d", itemsize);
        return -1;
    }
    return 0;
}

/* a buffer's length in elements of `size` bytes, -1 with an error when it is not whole ones */
static Py_ssize_t elements(Py_buffer *b, Py_ssize_t size, const char *what) {
    if (b->len % size) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes are not whole %zd-byte elements", what, b->len, size);
        return -1;
    }
    return b->len / size;
}

/* A LEB128 gap decoder over a buffer, resumable: decode_some() takes up to m more values. The flags
 * say what was wrong with any value so far (decode_positions' codes 2 to 4); `unfinished`: the bytes
 * ended inside a value. */
typedef struct {
    const uint8_t *b;
    Py_ssize_t len, i, n;
    uint64_t pos, lim;
    int too_long, bad_gap, outside, unfinished;
} decoder;

static void decoder_init(decoder *d, const void *buf, Py_ssize_t len, uint64_t lim) {
    memset(d, 0, sizeof *d);
    d->b = (const uint8_t *)buf;
    d->len = len;
    d->lim = lim;
}

/* up to m positions (plus `add`) into o; returns how many (fewer only where the bytes end) */
static Py_ssize_t decode_some(decoder *d, int64_t *o, Py_ssize_t m, int64_t add) {
    const uint8_t *b = d->b;
    const Py_ssize_t len = d->len;
    const uint64_t lim = d->lim;
    Py_ssize_t i = d->i, got = 0;
    uint64_t pos = d->pos;
    int too_long = 0, bad_gap = 0, outside = 0;
    while (got < m && i < len) {
        uint64_t val, c0 = b[i], c1 = i + 1 < len ? b[i + 1] : 0x80;
        uint64_t two = c0 >> 7;
        if (!(two & (c1 >> 7))) {  /* one or two bytes (the usual gaps), without a branch on which */
            val = (c0 & 0x7F) | ((c1 << 7) & (0 - two));
            i += 1 + (Py_ssize_t)two;
        } else {  /* three bytes or more, or a last value left unfinished */
            int nb = 0;
            val = 0;
            while (i < len && (b[i] & 0x80)) {
                if (nb < 9)
                    val |= (uint64_t)(b[i] & 0x7F) << (7 * nb);
                nb++;
                i++;
            }
            if (i == len) {
                d->unfinished = 1;
                break;
            }
            if (nb < 9)
                val |= (uint64_t)b[i] << (7 * nb);
            nb++;
            i++;
            too_long |= nb > 9;
        }
        bad_gap |= val >= lim || (d->n + got > 0 && val == 0);
        pos = d->n + got ? pos + val : val;
        outside |= pos >= lim;
        o[got++] = (int64_t)(pos + (uint64_t)add);
    }
    d->i = i;
    d->n += got;
    d->pos = pos;
    d->too_long |= too_long;
    d->bad_gap |= bad_gap;
    d->outside |= outside;
    return got;
}

/* decode_positions' code for a decoder that was asked for `count` values */
static int decoder_code(const decoder *d, Py_ssize_t count) {
    if (d->n != count || d->unfinished || d->i != d->len)
        return 1;
    if (d->too_long)
        return 2;
    if (d->bad_gap)
        return 3;
    return d->outside ? 4 : 0;
}

/* the first of n positions outside [0, size), or -1 (called without the GIL) */
static Py_ssize_t first_outside(const int64_t *p, Py_ssize_t n, Py_ssize_t size) {
    /* blocks without a branch a position (one unsigned compare catches both sides: the loop vectorizes),
     * then the first bad one of the block that has one */
    enum { BLOCK = 256 };
    for (Py_ssize_t b = 0; b < n; b += BLOCK) {
        Py_ssize_t e = n - b < BLOCK ? n : b + BLOCK;
        uint64_t any = 0;
        for (Py_ssize_t k = b; k < e; k++)
            any |= (uint64_t)((uint64_t)p[k] >= (uint64_t)size);
        if (any)
            for (Py_ssize_t k = b; k < e; k++)
                if (p[k] < 0 || p[k] >= size)
                    return k;
    }
    return -1;
}

static void outside_error(const char *fn, int64_t at, Py_ssize_t size) {
    PyErr_Format(PyExc_IndexError, "%s: position %lld of %zd elements", fn, (long long)at, size);
}

static PyObject *decode_positions(PyObject *self, PyObject *args) {
    Py_buffer buf, out;
    Py_ssize_t count;
    long long numel;
    if (!PyArg_ParseTuple(args, "y*nLw*", &buf, &count, &numel, &out))
        return NULL;
    PyObject *ret = NULL;
    if (count < 0 || numel < 0 || count > out.len / 8) {
        PyErr_SetString(PyExc_ValueError, "decode_positions: a negative count or numel, or `out` too small");
        goto done;
    }
    int code;
    Py_BEGIN_ALLOW_THREADS
    decoder d;
    decoder_init(&d, buf.buf, buf.len, (uint64_t)numel);
    decode_some(&d, (int64_t *)out.buf, count, 0);
    code = decoder_code(&d, count);
    Py_END_ALLOW_THREADS
    ret = PyLong_FromLong(code);
done:
    PyBuffer_Release(&buf);
    PyBuffer_Release(&out);
    return ret;
}

static inline __attribute__((always_inline)) uint64_t sum_loop(const int64_t *gp, const char *nb, const char *ob,
                                                               Py_ssize_t n, const int itemsize) {
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++)
        total += weight(gp[k]) * (load_bits(nb, k, itemsize) - load_bits(ob, k, itemsize));
    return total;
}

static PyObject *change_sum(PyObject *self, PyObject *args) {
    Py_buffer g, nw, old;
    int itemsize;
    if (!PyArg_ParseTuple(args, "y*y*y*i", &g, &nw, &old, &itemsize))
        return NULL;
    PyObject *ret = NULL;
    Py_ssize_t n = elements(&g, 8, "change_sum: g");
    if (n < 0 || check_itemsize(itemsize) < 0)
        goto done;
    if (nw.len != n * itemsize || old.len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "change_sum: %zd positions but %zd new and %zd old bytes of %d-byte elements",
                     n, nw.len, old.len, itemsize);
        goto done;
    }
    uint64_t total = 0;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *gp = (const int64_t *)g.buf;
    switch (itemsize) {  /* as swap_change_sum: a loop per element size */
    case 1: total = sum_loop(gp, nw.buf, old.buf, n, 1); break;
    case 2: total = sum_loop(gp, nw.buf, old.buf, n, 2); break;
    case 4: total = sum_loop(gp, nw.buf, old.buf, n, 4); break;
    default: total = sum_loop(gp, nw.buf, old.buf, n, 8); break;
    }
    Py_END_ALLOW_THREADS
    ret = PyLong_FromUnsignedLongLong(total);
done:
    PyBuffer_Release(&g);
    PyBuffer_Release(&nw);
    PyBuffer_Release(&old);
    return ret;
}

/* swap_change_sum's loop for `itemsize`-byte elements; inlined into a switch on constant sizes, so that
 * every copy is one load or store, not a call of memcpy (which took most of the time per element) */
static inline __attribute__((always_inline)) uint64_t swap_loop(
        char *hb, const int64_t *qp, const char *nb, const int64_t *gp, int64_t g_add, char *ob, Py_ssize_t n,
        const int itemsize) {
    uint64_t total = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        int64_t at = qp[k];
        if (k + AHEAD < n)
            __builtin_prefetch(hb + qp[k + AHEAD] * itemsize, 1, 1);
        uint64_t was = load_bits(hb, at, itemsize), now = load_bits(nb, k, itemsize);
        memcpy(ob + (Py_ssize_t)itemsize * k, hb + (Py_ssize_t)itemsize * at, itemsize);
        memcpy(hb + (Py_ssize_t)itemsize * at, nb + (Py_ssize_t)itemsize * k, itemsize);
        total += weight(gp ? gp[k] : at + g_add) * (now - was);
    }
    return total;
}

/* swap_loop for an element size known only at run time: one compiled loop per size */
static uint64_t swap_sized(char *hb, const int64_t *qp, const char *nb, const int64_t *gp, int64_t g_add, char *ob,
                           Py_ssize_t n, int itemsize) {
    switch (itemsize) {
    case 1: return swap_loop(hb, qp, nb, gp, g_add, ob, n, 1);
    case 2: return swap_loop(hb, qp, nb, gp, g_add, ob, n, 2);
    case 4: return swap_loop(hb, qp, nb, gp, g_add, ob, n, 4);
    default: return swap_loop(hb, qp, nb, gp, g_add, ob, n, 8);
    }
}

/* held[q[k]] = old[k] for the n elements a swap changed, the latest first: its change undone */
static void unswap(char *hb, const int64_t *qp, const char *ob, Py_ssize_t n, int itemsize) {
    for (Py_ssize_t k = n - 1; k >= 0; k--)
        memcpy(hb + (Py_ssize_t)itemsize * qp[k], ob + (Py_ssize_t)itemsize * k, itemsize);
}

static PyObject *swap_change_sum(PyObject *self, PyObject *args) {
    Py_buffer held, q, nw, old, g = {0};
    PyObject *gobj, *journal = Py_None, *tag = Py_None;
    long long g_add;
    int itemsize;
    if (!PyArg_ParseTuple(args, "w*y*y*OLiw*|OO", &held, &q, &nw, &gobj, &g_add, &itemsize, &old, &journal, &tag))
        return NULL;
    PyObject *ret = NULL;
    int have_g = gobj != Py_None;
    if (have_g && PyObject_GetBuffer(gobj, &g, PyBUF_C_CONTIGUOUS) < 0) {
        have_g = 0;
        goto done;
    }
    if (journal != Py_None && !PyList_Check(journal)) {
        PyErr_SetString(PyExc_TypeError, "swap_change_sum: journal must be a list or None");
        goto done;
    }
    if (check_itemsize(itemsize) < 0)
        goto done;
    Py_ssize_t n = elements(&q, 8, "swap_change_sum: q");
    Py_ssize_t size = elements(&held, itemsize, "swap_change_sum: held");
    if (n < 0 || size < 0)
        goto done;
    if (nw.len != n * itemsize || old.len != n * itemsize || (have_g && g.len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "swap_change_sum: %zd positions but %zd new and %zd old bytes of %d-byte "
                     "elements%s", n, nw.len, old.len, itemsize, have_g ? " or another number of linear indices" : "");
        goto done;
    }
    uint64_t total = 0;
    Py_ssize_t bad;
    char *hb = (char *)held.buf, *ob = (char *)old.buf;
    const int64_t *qp = (const int64_t *)q.buf;
    Py_BEGIN_ALLOW_THREADS
    const int64_t *gp = have_g ? (const int64_t *)g.buf : NULL;
    bad = first_outside(qp, n, size);  /* every position checked before anything is written */
    if (bad < 0)
        total = swap_sized(hb, qp, (const char *)nw.buf, gp, g_add, ob, n, itemsize);
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        outside_error("swap_change_sum", qp[bad], size);
        goto done;
    }
    /* the change recorded in the journal within this call: no Python code (nor a signal's handler)
     * runs between the writes and their record; if the record cannot be made, the writes are undone.
     * (A buffer's obj is the object it came from: the arrays themselves.) */
    if (journal != Py_None) {
        PyObject *rec = Py_BuildValue("(OOOO)", tag, held.obj, q.obj, old.obj);
        if (rec == NULL || PyList_Append(journal, rec) < 0) {
            Py_XDECREF(rec);
            unswap(hb, qp, ob, n, itemsize);
            goto done;
        }
        Py_DECREF(rec);
    }
    ret = PyLong_FromUnsignedLongLong(total);
done:
    PyBuffer_Release(&held);
    PyBuffer_Release(&q);
    PyBuffer_Release(&nw);
    PyBuffer_Release(&old);
    if (have_g)
        PyBuffer_Release(&g);
    return ret;
}

/* apply_deltas: one job of the batch (see the file's header) */
typedef struct {
    Py_buffer held, raw, q, old;
    int have[4], owns;
    Py_ssize_t count, group;
    long long numel, start, g_add;
    int itemsize;
    PyObject *recs, *tag;
    int code;
    uint64_t total;
} job_t;

static void release_jobs(job_t *jobs, Py_ssize_t n) {
    for (Py_ssize_t j = 0; j < n; j++) {
        Py_buffer *b[4] = {&jobs[j].held, &jobs[j].raw, &jobs[j].q, &jobs[j].old};
        for (int i = 0; i < 4; i++)
            if (jobs[j].have[i])
                PyBuffer_Release(b[i]);
        if (jobs[j].owns) {
            Py_DECREF(jobs[j].recs);
            Py_DECREF(jobs[j].tag);
        }
    }
    PyMem_Free(jobs);
}

/* one job's arguments, its buffers' sizes checked; -1 with an error */
static int parse_job(PyObject *t, job_t *jb) {
    PyObject *objs[4];
    if (!PyTuple_Check(t) || !PyArg_ParseTuple(t, "OOnLiLLOOOOn", &objs[0], &objs[1], &jb->count, &jb->numel,
                                               &jb->itemsize, &jb->start, &jb->g_add, &objs[2], &objs[3],
                                               &jb->recs, &jb->tag, &jb->group)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "apply_deltas: a job is not a tuple");
        return -1;
    }
    Py_buffer *b[4] = {&jb->held, &jb->raw, &jb->q, &jb->old};
    const int flags[4] = {PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS, PyBUF_C_CONTIGUOUS,
                          PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS};
    for (int i = 0; i < 4; i++) {
        if (PyObject_GetBuffer(objs[i], b[i], flags[i]) < 0)
            return -1;
        jb->have[i] = 1;
    }
    Py_INCREF(jb->recs);  /* held until the call returns: the list could lose the tuple meanwhile */
    Py_INCREF(jb->tag);
    jb->owns = 1;
    if (!PyList_Check(jb->recs)) {
        PyErr_SetString(PyExc_TypeError, "apply_deltas: a job's records must be a list");
        return -1;
    }
    if (check_itemsize(jb->itemsize) < 0)
        return -1;
    Py_ssize_t size = elements(&jb->held, jb->itemsize, "apply_deltas: held");
    if (size < 0)
        return -1;
    /* (divisions, not products: a count or start near 2**63 must not wrap into a check that passes) */
    if (jb->count < 0 || jb->numel < 0 || jb->start < 0 || jb->raw.len / jb->itemsize < jb->count
            || jb->q.len % 8 || jb->q.len / 8 != jb->count || jb->old.len % jb->itemsize
            || jb->old.len / jb->itemsize != jb->count || jb->start > size || jb->numel > size - jb->start) {
        PyErr_Format(PyExc_ValueError, "apply_deltas: a job of %zd changes of a %lld-element box at %lld does not "
                     "fit its buffers (%zd held elements, %zd bytes of changes)", jb->count, jb->numel, jb->start,
                     size, jb->raw.len);
        return -1;
    }
    return 0;
}

static PyObject *apply_deltas(PyObject *self, PyObject *args) {
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    job_t *jobs = PyMem_Calloc(n ? n : 1, sizeof(job_t));
    if (jobs == NULL)
        return PyErr_NoMemory();
    for (Py_ssize_t j = 0; j < n; j++)
        if (parse_job(PyList_GET_ITEM(list, j), &jobs[j]) < 0) {
            release_jobs(jobs, n);
            return NULL;
        }
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t j = 0; j < n; j++) {
        job_t *jb = &jobs[j];
        if (jb->code == 6)  /* a box whose earlier step failed takes no later one */
            continue;
        const char *vals = (const char *)jb->raw.buf;
        int64_t *qp = (int64_t *)jb->q.buf;
        decoder d;
        decoder_init(&d, vals + jb->count * jb->itemsize, jb->raw.len - jb->count * jb->itemsize, (uint64_t)jb->numel);
        decode_some(&d, qp, jb->count, jb->start);
        jb->code = decoder_code(&d, jb->count);
        if (jb->code) {
            for (Py_ssize_t k = j + 1; k < n; k++)  /* (rare: a scan of the rest only on a failure) */
                if (jobs[k].group == jb->group)
                    jobs[k].code = 6;
            continue;
        }
        /* (the positions are inside the box, the box inside held: checked above) */
        jb->total = swap_sized(jb->held.buf, qp, vals, NULL, jb->g_add, jb->old.buf, jb->count, jb->itemsize);
    }
    Py_END_ALLOW_THREADS
    /* every change recorded before the call returns; a record that cannot be made undoes the changes
     * not yet recorded (the latest first) and raises */
    PyObject *ret = PyList_New(n);
    Py_ssize_t j = 0;
    for (; ret != NULL && j < n; j++) {
        job_t *jb = &jobs[j];
        PyObject *item = jb->code ? Py_BuildValue("(iO)", jb->code, Py_None) : Py_BuildValue("(iK)", 0, jb->total);
        if (item == NULL)
            break;
        PyList_SET_ITEM(ret, j, item);
        if (jb->code == 0) {
            PyObject *rec = Py_BuildValue("(OOOO)", jb->tag, jb->held.obj, jb->q.obj, jb->old.obj);
            if (rec == NULL || PyList_Append(jb->recs, rec) < 0) {
                Py_XDECREF(rec);
                break;
            }
            Py_DECREF(rec);
        }
    }
    if (j < n) {  /* (an error is set) */
        for (Py_ssize_t k = n - 1; k >= j; k--) {
            job_t *jb = &jobs[k];
            if (jb->code == 0)
                unswap(jb->held.buf, jb->q.buf, jb->old.buf, jb->count, jb->itemsize);
        }
        Py_CLEAR(ret);
    }
    release_jobs(jobs, n);
    return ret;
}

/* dst[pos[k]] = new[k] for elements of `size` bytes (stores wait in the store buffer: no prefetch gained here) */
#define SCATTER(size)                                                          \
    for (Py_ssize_t k = 0; k < n; k++)                                        \
        memcpy(d + (size) * pp[k], s + (size) * k, (size));

static PyObject *scatter(PyObject *self, PyObject *args) {
    Py_buffer dst, pos, nw;
    int itemsize;
    if (!PyArg_ParseTuple(args, "w*y*y*i", &dst, &pos, &nw, &itemsize))
        return NULL;
    PyObject *ret = NULL;
    if (check_itemsize(itemsize) < 0)
        goto done;
    Py_ssize_t n = elements(&pos, 8, "scatter: pos");
    Py_ssize_t size = elements(&dst, itemsize, "scatter: dst");
    if (n < 0 || size < 0)
        goto done;
    if (nw.len != n * itemsize) {
        PyErr_Format(PyExc_ValueError, "scatter: %zd positions but %zd new bytes of %d-byte elements",
                     n, nw.len, itemsize);
        goto done;
    }
    Py_ssize_t bad;
    const int64_t *pp = (const int64_t *)pos.buf;
    Py_BEGIN_ALLOW_THREADS
    bad = first_outside(pp, n, size);  /* every position checked before anything is written */
    if (bad < 0) {
        char *d = (char *)dst.buf;
        const char *s = (const char *)nw.buf;
        switch (itemsize) {
        case 1: SCATTER(1); break;
        case 2: SCATTER(2); break;
        case 4: SCATTER(4); break;
        default: SCATTER(8); break;
        }
    }
    Py_END_ALLOW_THREADS
    if (bad >= 0) {
        outside_error("scatter", pp[bad], size);
        goto done;
    }
    ret = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&dst);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&nw);
    return ret;
}

static PyMethodDef methods[] = {
    {"decode_positions", decode_positions, METH_VARARGS, "LEB128 gaps -> checked int64 positions (see the file)."},
    {"change_sum", change_sum, METH_VARARGS, "sum(w(g) * (new - old)) mod 2**64."},
    {"swap_change_sum", swap_change_sum, METH_VARARGS,
     "held[q] = new in place, the values replaced into old; returns their change_sum."},
    {"scatter", scatter, METH_VARARGS, "dst[pos] = new, every position checked first."},
    {"apply_deltas", apply_deltas, METH_VARARGS,
     "A batch of deltas decoded and swapped in place without the GIL, each recorded (see the file)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "bytecp.format._kernels", "Compiled kernels of serving deltas (bytecp.format.kernels).", -1, methods,
};

PyMODINIT_FUNC PyInit__kernels(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI", BYTECP_KERNELS_ABI) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
