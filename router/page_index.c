/* PageIndex (page_index.h): chain hash -> run, for `router/page_hasher.py`.
 *
 *   PageIndex() -> an empty index
 *   .get(h, default=None)            the run of hash h, else default
 *   .set_range(hashes, start, stop, run)
 *                                    maps each of hashes[start:stop] (an array('Q')) to run
 *   .unindex(hashes, start, stop, run) -> int
 *                                    unmaps each of hashes[start:stop] that maps to run
 *                                    (by identity); returns how many it unmapped
 *   .clear(), len(ix)
 *
 * `page_hash.PageIndexPy` is the same over a dict (the fallback when this is not built).
 */
#include "page_index.h"

#include <string.h>

static char gone_marker;
#define PAGE_INDEX_GONE ((PyObject *)&gone_marker)
#define MIN_CAPACITY 8

static inline int live(PyObject *v) { return v != NULL && v != PAGE_INDEX_GONE; }

/* Chain hashes are BLAKE2b output, uniform already; the shift mixes in high bits. */
static inline size_t slot_of(const PageIndex *ix, uint64_t key) {
    return (size_t)(key ^ (key >> 32)) & (size_t)ix->mask;
}

/* The slot holding `key`, or -1; *free (when not NULL) gets the slot an insert of it
 * would take (the first deleted one on the probe, else the empty one ending it). */
static Py_ssize_t find(const PageIndex *ix, uint64_t key, Py_ssize_t *free) {
    if (ix->vals == NULL) return -1; /* cleared by the GC: empty (an insert rebuilds first) */
    size_t i = slot_of(ix, key);
    Py_ssize_t gone = -1;
    for (;;) {
        PyObject *v = ix->vals[i];
        if (v == NULL) {
            if (free != NULL) *free = gone >= 0 ? gone : (Py_ssize_t)i;
            return -1;
        }
        if (v == PAGE_INDEX_GONE) {
            if (gone < 0) gone = (Py_ssize_t)i;
        } else if (ix->keys[i] == key) {
            return (Py_ssize_t)i;
        }
        i = (i + 1) & (size_t)ix->mask;
    }
}

PyObject *page_index_get(PageIndex *ix, uint64_t key) {
    Py_ssize_t i = find(ix, key, NULL);
    return i < 0 ? NULL : ix->vals[i];
}

/* New tables of the smallest power-of-two capacity >= 3 * (used + 1), the live slots
 * moved over (references kept), the deleted ones dropped. */
static int rebuild(PageIndex *ix) {
    Py_ssize_t cap = MIN_CAPACITY;
    while (cap < 3 * (ix->used + 1)) cap <<= 1;
    uint64_t *keys = PyMem_Malloc((size_t)cap * sizeof *keys);
    PyObject **vals = PyMem_Calloc((size_t)cap, sizeof *vals);
    if (keys == NULL || vals == NULL) {
        PyMem_Free(keys);
        PyMem_Free(vals);
        PyErr_NoMemory();
        return -1;
    }
    uint64_t *old_keys = ix->keys;
    PyObject **old_vals = ix->vals;
    Py_ssize_t old_cap = old_vals != NULL ? ix->mask + 1 : 0;
    ix->keys = keys;
    ix->vals = vals;
    ix->mask = cap - 1;
    ix->filled = ix->used;
    for (Py_ssize_t j = 0; j < old_cap; j++) {
        if (!live(old_vals[j])) continue;
        Py_ssize_t at;
        find(ix, old_keys[j], &at);
        keys[at] = old_keys[j];
        vals[at] = old_vals[j];
    }
    PyMem_Free(old_keys);
    PyMem_Free(old_vals);
    return 0;
}

/* Maps key to run (a new reference); the run it replaces is released last. */
static int set(PageIndex *ix, uint64_t key, PyObject *run) {
    if ((ix->filled + 1) * 3 > (ix->mask + 1) * 2 && rebuild(ix) < 0) return -1;
    Py_ssize_t at, i = find(ix, key, &at);
    Py_INCREF(run);
    if (i >= 0) {
        PyObject *old = ix->vals[i];
        ix->vals[i] = run;
        Py_DECREF(old);
        return 0;
    }
    ix->filled += ix->vals[at] == NULL;
    ix->used++;
    ix->keys[at] = key;
    ix->vals[at] = run;
    return 0;
}

int u64_view(PyObject *obj, Py_buffer *v, const char *what) {
    int rc = PyObject_CheckBuffer(obj) ? PyObject_GetBuffer(obj, v, PyBUF_FORMAT) : -1;
    if (rc == 0 && (v->itemsize != 8 || v->format == NULL || strcmp(v->format, "Q") != 0)) {
        PyBuffer_Release(v);
        rc = -1;
    }
    if (rc < 0) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError, "%s must be an array('Q')", what);
    }
    return rc;
}

/* Parses (hashes, start, stop, run) with a view of hashes; 0 or -1. */
static int range_args(PyObject *args, Py_buffer *v, Py_ssize_t *start, Py_ssize_t *stop,
                      PyObject **run) {
    PyObject *hashes;
    if (!PyArg_ParseTuple(args, "OnnO", &hashes, start, stop, run)) return -1;
    if (u64_view(hashes, v, "hashes") < 0) return -1;
    if (*start < 0 || *stop < *start || *stop > v->len / 8) {
        PyBuffer_Release(v);
        PyErr_SetString(PyExc_ValueError, "entries out of the hashes' range");
        return -1;
    }
    return 0;
}

static PyObject *ix_set_range(PageIndex *ix, PyObject *args) {
    Py_buffer v;
    Py_ssize_t start, stop;
    PyObject *run;
    if (range_args(args, &v, &start, &stop, &run) < 0) return NULL;
    int rc = 0;
    for (Py_ssize_t i = start; i < stop && rc == 0; i++)
        rc = set(ix, ((const uint64_t *)v.buf)[i], run);
    PyBuffer_Release(&v);
    return rc < 0 ? NULL : Py_NewRef(Py_None);
}

static PyObject *ix_unindex(PageIndex *ix, PyObject *args) {
    Py_buffer v;
    Py_ssize_t start, stop, deleted = 0;
    PyObject *run;
    if (range_args(args, &v, &start, &stop, &run) < 0) return NULL;
    /* `run` is referenced by the caller's arguments: these releases never free it */
    for (Py_ssize_t k = start; k < stop; k++) {
        Py_ssize_t i = find(ix, ((const uint64_t *)v.buf)[k], NULL);
        if (i < 0 || ix->vals[i] != run) continue;
        ix->vals[i] = PAGE_INDEX_GONE;
        ix->used--;
        deleted++;
        Py_DECREF(run);
    }
    PyBuffer_Release(&v);
    return PyLong_FromSsize_t(deleted);
}

static PyObject *ix_get(PageIndex *ix, PyObject *args) {
    PyObject *key, *dflt = Py_None;
    if (!PyArg_ParseTuple(args, "O|O:get", &key, &dflt)) return NULL;
    if (!PyLong_Check(key)) {
        PyErr_SetString(PyExc_TypeError, "a page hash is an int");
        return NULL;
    }
    unsigned long long k = PyLong_AsUnsignedLongLong(key);
    PyObject *run = NULL;
    if (k == (unsigned long long)-1 && PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear(); /* outside uint64: held by no run */
    } else {
        run = page_index_get(ix, k);
    }
    return Py_NewRef(run != NULL ? run : dflt);
}

static int ix_clear(PageIndex *ix) {
    PyObject **vals = ix->vals;
    Py_ssize_t cap = vals != NULL ? ix->mask + 1 : 0;
    ix->vals = NULL;
    PyMem_Free(ix->keys);
    ix->keys = NULL;
    ix->mask = ix->used = ix->filled = 0;
    for (Py_ssize_t i = 0; i < cap; i++)
        if (live(vals[i])) Py_DECREF(vals[i]);
    PyMem_Free(vals);
    return 0;
}

static PyObject *ix_clear_py(PageIndex *ix, PyObject *unused) {
    (void)unused;
    ix_clear(ix);
    if (rebuild(ix) < 0) return NULL;
    return Py_NewRef(Py_None);
}

static int ix_traverse(PageIndex *ix, visitproc visit, void *arg) {
    Py_ssize_t cap = ix->vals != NULL ? ix->mask + 1 : 0;
    for (Py_ssize_t i = 0; i < cap; i++)
        if (live(ix->vals[i])) Py_VISIT(ix->vals[i]);
    return 0;
}

static PyObject *ix_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    if (PyTuple_GET_SIZE(args) || (kwds != NULL && PyDict_GET_SIZE(kwds))) {
        PyErr_SetString(PyExc_TypeError, "PageIndex() takes no arguments");
        return NULL;
    }
    PageIndex *ix = (PageIndex *)type->tp_alloc(type, 0);
    if (ix != NULL && rebuild(ix) < 0) Py_CLEAR(ix);
    return (PyObject *)ix;
}

static void ix_dealloc(PageIndex *ix) {
    PyObject_GC_UnTrack(ix);
    ix_clear(ix);
    Py_TYPE(ix)->tp_free((PyObject *)ix);
}

static Py_ssize_t ix_len(PageIndex *ix) { return ix->used; }

static PyMappingMethods ix_mapping = {.mp_length = (lenfunc)ix_len};

static PyMethodDef ix_methods[] = {
    {"get", (PyCFunction)ix_get, METH_VARARGS, "the run of a page hash, else default"},
    {"set_range", (PyCFunction)ix_set_range, METH_VARARGS,
     "maps hashes[start:stop] to run"},
    {"unindex", (PyCFunction)ix_unindex, METH_VARARGS,
     "unmaps those of hashes[start:stop] that map to run; returns how many"},
    {"clear", (PyCFunction)ix_clear_py, METH_NOARGS, "unmaps everything"},
    {NULL, NULL, 0, NULL}};

PyTypeObject PageIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "phalanx.router._page_hash.PageIndex",
    .tp_doc = "chain hash (uint64) -> run, an open-addressing table",
    .tp_basicsize = sizeof(PageIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = ix_new,
    .tp_dealloc = (destructor)ix_dealloc,
    .tp_free = PyObject_GC_Del,
    .tp_traverse = (traverseproc)ix_traverse,
    .tp_clear = (inquiry)ix_clear,
    .tp_as_mapping = &ix_mapping,
    .tp_methods = ix_methods,
};
