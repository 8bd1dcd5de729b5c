/* PageIndex: the map from a page's chain hash (uint64) to the run that remembers the
 * page, for `router/page_hasher.py`, as an open-addressing table of (hash, run) slots
 * with linear probing: no int object and no dict entry per page. Defined in
 * page_index.c; `_page_hash.c` looks pages up from its walk without Python calls. */
#ifndef PHALANX_PAGE_INDEX_H
#define PHALANX_PAGE_INDEX_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

/* Layout: `keys[i]`, `vals[i]` for i <= mask (capacity mask + 1, a power of two);
 * vals[i] NULL = empty, PAGE_INDEX_GONE = deleted (probing goes on past it), else a
 * strong reference. `used` live slots, `filled` live + deleted; filled * 3 <= capacity
 * * 2 after every insert, so a probe always reaches an empty slot. */
typedef struct {
    PyObject_HEAD
    uint64_t *keys;
    PyObject **vals;
    Py_ssize_t mask, used, filled;
} PageIndex;

extern PyTypeObject PageIndexType;

/* The run of `key` (borrowed), or NULL (no error) if none. */
PyObject *page_index_get(PageIndex *ix, uint64_t key);

/* A view of `obj` as native uint64 items (an array('Q')): 0, or -1 with TypeError
 * naming `what`. The caller releases it. */
int u64_view(PyObject *obj, Py_buffer *v, const char *what);

#endif
