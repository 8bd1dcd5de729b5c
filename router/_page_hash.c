/* Chain hashes of token pages in C: the two per-token loops of `router/page_hasher.py`.
 *
 * A page's chain hash is BLAKE2b with an 8-byte digest (RFC 7693, no key) of the parent
 * page's hash as 8 little-endian bytes (nothing for a sequence's first page) followed by
 * the page's tokens as little-endian int64; the hash, read as a little-endian integer, is
 * the first state word after the last compression. Bit-identical to
 * `hashlib.blake2b(parent + page, digest_size=8)` (tests/test_page_hash.py checks it
 * against hashlib and against `page_hashes`).
 *
 *   pack(tokens) -> bytes
 *       tokens (a list or tuple of ints in [-2**63, 2**63), or of objects with
 *       __index__) as little-endian int64;
 *       equal to struct.pack(f"<{len(tokens)}q", *tokens).
 *   chain(data, first, stop, page_bytes, parent, stop_at) -> list[int]
 *       hashes of pages first, first+1, ... < stop of `data` (page p is bytes
 *       [p * page_bytes, (p + 1) * page_bytes)), the first chained to `parent` (an int,
 *       or None for a sequence's first page); with `stop_at` (a dict, or None) the list
 *       ends at the first hash that is a key of `stop_at`, that hash included.
 *   walk(data, n, page_bytes, parent, first_page, at, out) -> (fresh, touched, reused)
 *       writes the hashes of the n pages of `data` (page 0 is the sequence's page
 *       `first_page`) into `out` (n native uint64: an array('Q')), hashing pages until
 *       one is a page of a remembered run and copying the run's following hashes for as
 *       long as their tokens are byte-equal; `at` (a PageIndex, page_index.c) maps a
 *       chain hash to a run (attributes `start`, `hashes`: array('Q'), `data`:
 *       bytearray). Returns the ranges [a, b) of
 *       pages hashed that no run holds, for each run used (run, cut) with cut = the
 *       run's page where the tokens differ or -1, and the number of hashes taken from
 *       runs. Runs are looked up only until the first page none holds (the pages after
 *       it chain to a new hash). The runs are only read: the caller cuts them.
 *       `page_hash.walk_py` is the same in Python, with the contract in its docstring.
 *   PageIndex: the map `at` (page_index.c).
 *
 * Optional: `router/page_hash.py` falls back to hashlib and struct when this module was
 * not built (a source tree used without `pip install`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "blake2b64.h"
#include "page_index.h"

/* The value of an exact int that fits in one internal digit (|x| < 2**30), read straight
 * from the object without a call: 1 if so, 0 if not (the caller takes the slow path). */
static inline int small_int(PyObject *o, long long *x) {
#if PY_VERSION_HEX >= 0x030C0000
    if (!PyUnstable_Long_IsCompact((PyLongObject *)o)) return 0;
    *x = (long long)PyUnstable_Long_CompactValue((PyLongObject *)o);
    return 1;
#else
    Py_ssize_t size = Py_SIZE(o);
    if (size > 1 || size < -1) return 0;
    *x = size * (long long)((PyLongObject *)o)->ob_digit[0];
    return 1;
#endif
}

/* Packs items[0, n) into p as little-endian int64: ints, or objects with __index__. With
 * `exact_only` (items of a list, which Python code could resize) it stops at the first
 * item that is not an exact int, before any Python code runs. Returns the number of
 * items packed (n when all are), -1 on error. */
static Py_ssize_t pack_items(PyObject **items, Py_ssize_t n, uint8_t *p, int exact_only) {
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = items[i];
        long long x;
        int exact = PyLong_CheckExact(o);
        if (!exact && exact_only) return i;
        if (!(exact && small_int(o, &x))) {
            x = PyLong_AsLongLong(o);
            if (x == -1 && PyErr_Occurred()) return -1;
        }
        store_le64(p + 8 * i, (uint64_t)x);
    }
    return n;
}

static PyObject *pack(PyObject *self, PyObject *tokens) {
    (void)self;
    /* A list is read in place, in one pass, while its items are exact ints; at the first
     * item that is not, everything is read again from a tuple copy, which no __index__
     * can resize. */
    int in_place = PyList_CheckExact(tokens);
    for (;;) {
        PyObject *seq = in_place ? Py_NewRef(tokens) : PySequence_Tuple(tokens);
        if (seq == NULL) return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        PyObject *out = PyBytes_FromStringAndSize(NULL, 8 * n);
        Py_ssize_t done = out == NULL ? -1
            : pack_items(PySequence_Fast_ITEMS(seq), n, (uint8_t *)PyBytes_AS_STRING(out),
                         in_place);
        Py_DECREF(seq);
        if (done == n) return out;
        Py_XDECREF(out);
        if (done < 0) return NULL;
        in_place = 0;
    }
}

static PyObject *s_start, *s_hashes, *s_data; /* interned attribute names of a run */

/* A view of `run.hashes` (an array('Q')): 0, or -1 with an error set. The caller
 * releases it before any Python code can run. */
static int hashes_view(PyObject *run, Py_buffer *v) {
    PyObject *hashes = PyObject_GetAttr(run, s_hashes);
    if (hashes == NULL) return -1;
    int rc = u64_view(hashes, v, "a run's hashes");
    Py_DECREF(hashes); /* the view holds its own reference */
    return rc;
}

/* The run `at` names for hash h if that run's page i = pos - run.start holds it: a new
 * reference, with *v a view of its hashes and *i set; NULL with no error if none. */
static PyObject *run_holding(PageIndex *at, uint64_t h, Py_ssize_t pos, Py_buffer *v,
                             Py_ssize_t *i) {
    PyObject *run = page_index_get(at, h);
    if (run == NULL) return NULL;
    Py_INCREF(run);
    PyObject *start = PyObject_GetAttr(run, s_start);
    if (start == NULL) goto fail;
    Py_ssize_t at_pos = pos - PyLong_AsSsize_t(start);
    Py_DECREF(start);
    if (PyErr_Occurred() || hashes_view(run, v) < 0) goto fail;
    if (at_pos >= 0 && at_pos < v->len / 8 && ((const uint64_t *)v->buf)[at_pos] == h) {
        *i = at_pos;
        return run;
    }
    PyBuffer_Release(v);
fail:
    Py_DECREF(run);
    return NULL;
}

/* How many pages (at most `limit`) from page k of `data` equal the run's from page j. */
static Py_ssize_t equal_pages(PyObject *run, const uint8_t *data, Py_ssize_t k,
                              Py_ssize_t j, Py_ssize_t pb, Py_ssize_t limit) {
    PyObject *rdata = PyObject_GetAttr(run, s_data);
    if (rdata == NULL) return -1;
    if (!PyByteArray_Check(rdata)) {
        Py_DECREF(rdata);
        PyErr_SetString(PyExc_TypeError, "a run's data must be a bytearray");
        return -1;
    }
    const uint8_t *r = (const uint8_t *)PyByteArray_AS_STRING(rdata);
    Py_ssize_t have = PyByteArray_GET_SIZE(rdata) / pb - j;
    if (limit > have) limit = have;
    Py_ssize_t m = 0;
    if (limit > 0 && memcmp(data + k * pb, r + j * pb, (size_t)(limit * pb)) == 0)
        m = limit; /* the common case: one memcmp */
    else
        while (m < limit && memcmp(data + (k + m) * pb, r + (j + m) * pb, (size_t)pb) == 0)
            m++;
    Py_DECREF(rdata);
    return m;
}

/* Appends `item` (a new reference, stolen; NULL: an error already set) to `list`. */
static int append_new(PyObject *list, PyObject *item) {
    if (item == NULL) return -1;
    int rc = PyList_Append(list, item);
    Py_DECREF(item);
    return rc;
}

/* The parent page's hash as the 8 bytes a page's message starts with (none for None). */
static int parent_prefix(PyObject *parent, uint8_t prev[8], size_t *plen) {
    *plen = 0;
    if (parent == Py_None) return 0;
    unsigned long long p = PyLong_AsUnsignedLongLong(parent);
    if (p == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    store_le64(prev, p);
    *plen = 8;
    return 0;
}

/* Layout of one walk: the packed pages, their hashes as they are found, the runs. */
typedef struct {
    const uint8_t *data;
    uint64_t *out;
    Py_ssize_t n, pb, first_page;
    PageIndex *at;
    PyObject *fresh, *touched;
} Walk;

/* Hashes pages from k on until one is the page of a run `at` names (NULL: none; else a
 * new reference with *v and *i set as by run_holding) and returns it; *k is then the
 * page after the last one hashed. Runs are looked up only until the first page no run
 * holds: past it every chain hash is new (a run holding a later page would hold this
 * one, its parent), so the pages after it are hashed without a lookup. */
static PyObject *hash_until_run(Walk *w, Py_ssize_t *k, uint8_t prev[8], size_t *plen,
                                int *lookup, Py_buffer *v, Py_ssize_t *i) {
    while (*k < w->n) {
        uint64_t h = blake2b_64(prev, *plen, w->data + *k * w->pb, (size_t)w->pb);
        store_le64(prev, h);
        *plen = 8;
        w->out[(*k)++] = h;
        if (!*lookup) continue;
        PyObject *run = run_holding(w->at, h, w->first_page + *k - 1, v, i);
        if (run != NULL || PyErr_Occurred()) return run;
        *lookup = 0;
    }
    return NULL;
}

/* Takes the hashes of the pages from k on from `run` (page k-1 is its page i) for as
 * long as their tokens are byte-equal to the run's; reports the run as touched (with
 * the page it should be cut at, or -1). Returns the pages taken, -1 on error. */
static Py_ssize_t take_from_run(Walk *w, Py_ssize_t k, PyObject *run, const Py_buffer *v,
                                Py_ssize_t i, uint8_t prev[8]) {
    const uint64_t *hs = (const uint64_t *)v->buf;
    Py_ssize_t limit = w->n - k, left = v->len / 8 - i - 1, m = 0;
    if (left < limit) limit = left;
    if (limit > 0) {
        m = equal_pages(run, w->data, k, i + 1, w->pb, limit);
        if (m < 0) return -1;
    }
    Py_ssize_t cut = limit > 0 && m < limit ? i + 1 + m : -1;
    if (append_new(w->touched, Py_BuildValue("(On)", run, cut)) < 0) return -1;
    if (m) {
        memcpy(w->out + k, hs + i + 1, (size_t)m * 8);
        store_le64(prev, hs[i + m]);
    }
    return m;
}

static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data, out;
    PyObject *parent;
    Walk w;
    if (!PyArg_ParseTuple(args, "y*nnOnO!w*", &data, &w.n, &w.pb, &parent, &w.first_page,
                          &PageIndexType, &w.at, &out))
        return NULL;
    PyObject *result = NULL;
    w.fresh = PyList_New(0);
    w.touched = PyList_New(0);
    uint8_t prev[8];
    size_t plen = 0;
    Py_ssize_t k = 0, reused = 0;
    int lookup = 1;
    if (w.fresh == NULL || w.touched == NULL) goto done;
    if (w.pb <= 0 || w.n < 0 || w.n * w.pb > data.len || w.first_page < 0) {
        PyErr_SetString(PyExc_ValueError, "pages out of the data's range");
        goto done;
    }
    if (out.len < w.n * 8 || (w.n && ((uintptr_t)out.buf & 7))) {
        PyErr_SetString(PyExc_ValueError, "out must hold n uint64 (an array('Q'))");
        goto done;
    }
    if (parent_prefix(parent, prev, &plen) < 0) goto done;
    w.data = (const uint8_t *)data.buf;
    w.out = (uint64_t *)out.buf;
    while (k < w.n) {
        Py_ssize_t a = k, i = 0;
        Py_buffer v;
        PyObject *run = hash_until_run(&w, &k, prev, &plen, &lookup, &v, &i);
        if (run == NULL) {
            if (PyErr_Occurred() ||
                append_new(w.fresh, Py_BuildValue("(nn)", a, w.n)) < 0) goto done;
            break;
        }
        int rc = a < k - 1 ? append_new(w.fresh, Py_BuildValue("(nn)", a, k - 1)) : 0;
        Py_ssize_t m = rc < 0 ? -1 : take_from_run(&w, k, run, &v, i, prev);
        PyBuffer_Release(&v);
        Py_DECREF(run);
        if (m < 0) goto done;
        k += m;
        reused += m;
    }
    result = Py_BuildValue("(OOn)", w.fresh, w.touched, reused);
done:
    Py_XDECREF(w.fresh);
    Py_XDECREF(w.touched);
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *chain(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    Py_ssize_t first, stop, page_bytes;
    PyObject *parent, *stop_at;
    if (!PyArg_ParseTuple(args, "y*nnnOO", &data, &first, &stop, &page_bytes, &parent,
                          &stop_at))
        return NULL;
    PyObject *out = NULL;
    uint8_t prev[8];
    size_t plen = 0;
    if (page_bytes <= 0 || first < 0 || stop < first || stop * page_bytes > data.len) {
        PyErr_SetString(PyExc_ValueError, "pages out of the data's range");
        goto done;
    }
    if (stop_at != Py_None && !PyDict_Check(stop_at)) {
        PyErr_SetString(PyExc_TypeError, "stop_at must be a dict or None");
        goto done;
    }
    if (parent_prefix(parent, prev, &plen) < 0) goto done;
    out = PyList_New(0);
    if (out == NULL) goto done;
    const uint8_t *base = (const uint8_t *)data.buf;
    for (Py_ssize_t k = first; k < stop; k++) {
        uint64_t h = blake2b_64(prev, plen, base + k * page_bytes, (size_t)page_bytes);
        store_le64(prev, h);
        plen = 8;
        PyObject *value = PyLong_FromUnsignedLongLong(h);
        if (value == NULL || PyList_Append(out, value) < 0) {
            Py_XDECREF(value);
            Py_CLEAR(out);
            goto done;
        }
        int found = stop_at == Py_None ? 0 : PyDict_Contains(stop_at, value);
        Py_DECREF(value);
        if (found < 0) {
            Py_CLEAR(out);
            goto done;
        }
        if (found) break;
    }
done:
    PyBuffer_Release(&data);
    return out;
}

static PyMethodDef methods[] = {
    {"pack", pack, METH_O, "tokens as little-endian int64 bytes"},
    {"chain", chain, METH_VARARGS, "chain hashes of pages of packed tokens"},
    {"walk", walk, METH_VARARGS, "chain hashes of packed pages through remembered runs"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_page_hash",
                                    "Chain hashes of token pages (BLAKE2b-64) in C.", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__page_hash(void) {
    s_start = PyUnicode_InternFromString("start");
    s_hashes = PyUnicode_InternFromString("hashes");
    s_data = PyUnicode_InternFromString("data");
    if (s_start == NULL || s_hashes == NULL || s_data == NULL) return NULL;
    if (PyType_Ready(&PageIndexType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddObjectRef(m, "PageIndex", (PyObject *)&PageIndexType) < 0)
        Py_CLEAR(m);
    return m;
}
