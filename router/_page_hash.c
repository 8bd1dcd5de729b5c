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
 *   walk(data, n, page_bytes, parent, first_page, at) -> (hashes, fresh, touched, reused)
 *       the hashes of the n pages of `data` (page 0 is the sequence's page `first_page`),
 *       hashing pages until one is a page of a remembered run and taking the run's
 *       following hashes for as long as their tokens are byte-equal; `at` maps a chain
 *       hash to a run (attributes `start`, `hashes`: list, `data`: bytearray). Returns the
 *       hashes, the ranges [a, b) of pages hashed that no run holds, for each run used
 *       (run, cut) with cut = the run's page where the tokens differ or -1, and the number
 *       of hashes taken from runs. The runs are only read: the caller cuts them.
 *       `page_hash.walk_py` is the same in Python, with the contract in its docstring.
 *
 * Optional: `router/page_hash.py` falls back to hashlib and struct when this module was
 * not built (a source tree used without `pip install`).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t IV[8] = {
    0x6a09e667f3bcc908ULL, 0xbb67ae8584caa73bULL, 0x3c6ef372fe94f82bULL,
    0xa54ff53a5f1d36f1ULL, 0x510e527fade682d1ULL, 0x9b05688c2b3e6c1fULL,
    0x1f83d9abfb41bd6bULL, 0x5be0cd19137e2179ULL};

static const uint8_t SIGMA[12][16] = {
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3},
    {11, 8, 12, 0, 5, 2, 15, 13, 10, 14, 3, 6, 7, 1, 9, 4},
    {7, 9, 3, 1, 13, 12, 11, 14, 2, 6, 5, 10, 4, 0, 15, 8},
    {9, 0, 5, 7, 2, 4, 10, 15, 14, 1, 11, 12, 6, 8, 3, 13},
    {2, 12, 6, 10, 0, 11, 8, 3, 4, 13, 7, 5, 15, 14, 1, 9},
    {12, 5, 1, 15, 14, 13, 4, 10, 0, 7, 6, 3, 9, 2, 8, 11},
    {13, 11, 7, 14, 12, 1, 3, 9, 5, 0, 15, 4, 8, 6, 2, 10},
    {6, 15, 14, 9, 11, 3, 0, 8, 12, 2, 13, 7, 1, 4, 10, 5},
    {10, 2, 8, 4, 7, 6, 1, 5, 15, 11, 9, 14, 3, 12, 13, 0},
    {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15},
    {14, 10, 4, 8, 9, 15, 13, 6, 1, 12, 0, 2, 11, 7, 5, 3}};

static inline uint64_t rotr(uint64_t x, int n) { return (x >> n) | (x << (64 - n)); }

/* Little-endian 64-bit loads and stores as one move (a byte loop is not always folded
 * into one by the compiler); a big-endian host swaps. */
static inline uint64_t load_le64(const uint8_t *p) {
    uint64_t x;
    memcpy(&x, p, 8);
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    return x;
}

static inline void store_le64(uint8_t *p, uint64_t x) {
#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    x = __builtin_bswap64(x);
#endif
    memcpy(p, &x, 8);
}

#define G(a, b, c, d, x, y)          \
    do {                             \
        a = a + b + (x);             \
        d = rotr(d ^ a, 32);         \
        c = c + d;                   \
        b = rotr(b ^ c, 24);         \
        a = a + b + (y);             \
        d = rotr(d ^ a, 16);         \
        c = c + d;                   \
        b = rotr(b ^ c, 63);         \
    } while (0)

/* One compression of the 128-byte block `block` into state h; t = bytes hashed so far,
 * this block's included; last = the message's final block. */
static void compress(uint64_t h[8], const uint8_t block[128], uint64_t t, int last) {
    uint64_t m[16], v[16];
    for (int i = 0; i < 16; i++) m[i] = load_le64(block + 8 * i);
    for (int i = 0; i < 8; i++) {
        v[i] = h[i];
        v[i + 8] = IV[i];
    }
    v[12] ^= t; /* the counter's high word stays 0: messages are far below 2**64 bytes */
    if (last) v[14] = ~v[14];
    /* unrolled, the sigma indices are constants */
    _Pragma("GCC unroll 12") for (int r = 0; r < 12; r++) {
        const uint8_t *s = SIGMA[r];
        G(v[0], v[4], v[8], v[12], m[s[0]], m[s[1]]);
        G(v[1], v[5], v[9], v[13], m[s[2]], m[s[3]]);
        G(v[2], v[6], v[10], v[14], m[s[4]], m[s[5]]);
        G(v[3], v[7], v[11], v[15], m[s[6]], m[s[7]]);
        G(v[0], v[5], v[10], v[15], m[s[8]], m[s[9]]);
        G(v[1], v[6], v[11], v[12], m[s[10]], m[s[11]]);
        G(v[2], v[7], v[8], v[13], m[s[12]], m[s[13]]);
        G(v[3], v[4], v[9], v[14], m[s[14]], m[s[15]]);
    }
    for (int i = 0; i < 8; i++) h[i] ^= v[i] ^ v[i + 8];
}

/* BLAKE2b-64 of (prefix, 0 or 8 bytes) + (msg, len bytes): the digest as an integer. */
static uint64_t blake2b_64(const uint8_t *prefix, size_t plen, const uint8_t *msg,
                           size_t len) {
    uint64_t h[8];
    uint8_t block[128];
    memcpy(h, IV, sizeof h);
    h[0] ^= 0x01010000ULL ^ 8; /* fanout 1, depth 1, no key, 8-byte digest */
    size_t total = plen + len, done = 0, fill = plen;
    memcpy(block, prefix, plen);
    /* the final block (full or not) is compressed with the last flag, so a block is
     * compressed only once more bytes follow it */
    while (total - done > 128) {
        size_t take = 128 - fill;
        memcpy(block + fill, msg, take);
        msg += take;
        done += 128;
        compress(h, block, done, 0);
        fill = 0;
    }
    size_t rest = total - done - fill;
    memcpy(block + fill, msg, rest);
    memset(block + fill + rest, 0, 128 - fill - rest);
    compress(h, block, total, 1);
    return h[0];
}

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

/* Appends a new int h to `out`; the int (a new reference) or NULL on error. */
static PyObject *s_start, *s_hashes, *s_data; /* interned attribute names of a run */

/* The run `at` names for hash `hobj` if that run's page i = pos - run.start holds it:
 * a new reference with *hs (new reference) and *i set; NULL with no error if none. */
static PyObject *run_holding(PyObject *at, PyObject *hobj, uint64_t h, Py_ssize_t pos,
                             PyObject **hs, Py_ssize_t *i) {
    PyObject *run = PyDict_GetItemWithError(at, hobj);
    if (run == NULL) return NULL;
    Py_INCREF(run);
    PyObject *start = PyObject_GetAttr(run, s_start);
    PyObject *hashes = start ? PyObject_GetAttr(run, s_hashes) : NULL;
    if (hashes == NULL || !PyList_Check(hashes)) {
        if (hashes != NULL)
            PyErr_SetString(PyExc_TypeError, "a run's hashes must be a list");
        goto fail;
    }
    Py_ssize_t at_pos = pos - PyLong_AsSsize_t(start);
    if (PyErr_Occurred()) goto fail;
    if (at_pos >= 0 && at_pos < PyList_GET_SIZE(hashes)) {
        PyObject *item = PyList_GET_ITEM(hashes, at_pos);
        unsigned long long held = PyLong_AsUnsignedLongLong(item);
        if (held == (unsigned long long)-1 && PyErr_Occurred()) goto fail;
        if (held == h) {
            Py_DECREF(start);
            *hs = hashes;
            *i = at_pos;
            return run;
        }
    }
    Py_DECREF(start);
    Py_DECREF(hashes);
    Py_DECREF(run);
    return NULL;
fail:
    Py_XDECREF(start);
    Py_XDECREF(hashes);
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

static PyObject *walk(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer data;
    Py_ssize_t n, pb, first_page;
    PyObject *parent, *at;
    if (!PyArg_ParseTuple(args, "y*nnOnO!", &data, &n, &pb, &parent, &first_page,
                          &PyDict_Type, &at))
        return NULL;
    PyObject *out = NULL, *fresh = PyList_New(0), *touched = PyList_New(0);
    PyObject *result = NULL, *run = NULL, *hs = NULL;
    uint8_t prev[8];
    size_t plen = 0;
    Py_ssize_t k = 0, reused = 0, i = 0;
    if (fresh == NULL || touched == NULL) goto done;
    if (pb <= 0 || n < 0 || n * pb > data.len || first_page < 0) {
        PyErr_SetString(PyExc_ValueError, "pages out of the data's range");
        goto done;
    }
    out = PyList_New(n); /* slot k is filled when page k's hash is known */
    if (out == NULL) goto done;
    if (parent_prefix(parent, prev, &plen) < 0) goto done;
    const uint8_t *base = (const uint8_t *)data.buf;
    while (k < n) {
        Py_ssize_t a = k; /* hash pages until one is a remembered run's page */
        while (k < n && run == NULL) {
            uint64_t h = blake2b_64(prev, plen, base + k * pb, (size_t)pb);
            store_le64(prev, h);
            plen = 8;
            PyObject *hobj = PyLong_FromUnsignedLongLong(h);
            if (hobj == NULL) goto done;
            PyList_SET_ITEM(out, k, hobj); /* the list owns it; borrowed below */
            k++;
            run = run_holding(at, hobj, h, first_page + k - 1, &hs, &i);
            if (run == NULL && PyErr_Occurred()) goto done;
        }
        if (run == NULL) {
            if (append_new(fresh, Py_BuildValue("(nn)", a, n)) < 0) goto done;
            break;
        }
        if (a < k - 1 && append_new(fresh, Py_BuildValue("(nn)", a, k - 1)) < 0) goto done;
        /* page k-1 is the run's page i: the pages after it are the run's for as long as
         * their tokens are equal (same parent hash, same tokens) */
        Py_ssize_t limit = n - k, left = PyList_GET_SIZE(hs) - i - 1, m = 0;
        if (left < limit) limit = left;
        if (limit > 0) {
            m = equal_pages(run, base, k, i + 1, pb, limit);
            if (m < 0) goto done;
        }
        Py_ssize_t cut = limit > 0 && m < limit ? i + 1 + m : -1;
        if (append_new(touched, Py_BuildValue("(On)", run, cut)) < 0) goto done;
        for (Py_ssize_t j = i + 1; j <= i + m; j++) {
            PyObject *taken = PyList_GET_ITEM(hs, j);
            Py_INCREF(taken);
            PyList_SET_ITEM(out, k + (j - i - 1), taken);
        }
        if (m) {
            unsigned long long last = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(hs, i + m));
            if (last == (unsigned long long)-1 && PyErr_Occurred()) goto done;
            store_le64(prev, last);
            k += m;
            reused += m;
        }
        Py_CLEAR(run);
        Py_CLEAR(hs);
    }
    result = Py_BuildValue("(OOOn)", out, fresh, touched, reused);
done:
    Py_XDECREF(run);
    Py_XDECREF(hs);
    Py_XDECREF(out);
    Py_XDECREF(fresh);
    Py_XDECREF(touched);
    PyBuffer_Release(&data);
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
    return PyModule_Create(&module);
}
