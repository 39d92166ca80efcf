/* The prefix table's lookup loop in C: PrefixTable.match_lengths for a whole prompt in one call.
 *
 * Same table layout and the same answer as the numpy path in routing/prefix_table.py
 * (PrefixTable._match_numpy, the reference; tests/test_routing_prefix_table.py checks both agree):
 *   lines   [buckets, 8] uint64: key, held, key, held, ... (4 slots, one 64-byte line per bucket)
 *   records [buckets * 4] packed {uint64 guessed; uint32 stamp} (12 bytes, no padding)
 * A key's two candidate buckets are the 32-bit halves h of key * MIX, each mapped to h * nb >> 32.
 * Per prompt block: find the key in its two buckets, take its replica bitmask (guesses past their
 * TTL removed), AND it into the running prefix mask; a replica's match ends where its bit drops.
 * Stops as soon as no wanted replica is left. Built by `pip install` when a C compiler is there
 * (optional: without it the numpy path serves, same results, ~3x slower).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#define MIX 0x9E3779B97F4A7C15ULL
#define SLOTS 4

#pragma pack(push, 1)
typedef struct {
    uint64_t guessed;
    uint32_t stamp;
} guess_record;
#pragma pack(pop)

static inline uint64_t held_of(const uint64_t *lines, const guess_record *records, uint64_t nb,
                               uint64_t key, int expire, uint32_t oldest_live) {
    uint64_t mixed = key * MIX;
    uint64_t halves[2] = {mixed & 0xFFFFFFFFULL, mixed >> 32};
    for (int c = 0; c < 2; c++) {
        uint64_t bucket = (halves[c] * nb) >> 32;
        const uint64_t *line = lines + bucket * (2 * SLOTS);
        for (int lane = 0; lane < SLOTS; lane++) {
            if (line[2 * lane] == key) {
                uint64_t held = line[2 * lane + 1];
                if (expire) {
                    const guess_record *r = records + bucket * SLOTS + lane;
                    if (r->stamp < oldest_live)
                        held &= ~r->guessed;
                }
                return held;
            }
        }
    }
    return 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    if (view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what,
                     view->len, itemsize);
        return -1;
    }
    return 0;
}

/* match_lengths(lines, records, keys, want, oldest_live, bits) -> list[int]
 *   keys: uint64 block hashes of the prompt; want: bitmask of the candidates' bits;
 *   oldest_live: stamps below it are expired guesses (0: nothing expires);
 *   bits: a tuple with each candidate's bit (-1: not in the table). */
static PyObject *match_lengths(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "match_lengths(lines, records, keys, want, oldest_live, bits)");
        return NULL;
    }
    uint64_t want = PyLong_AsUnsignedLongLong(args[3]);
    long long oldest_live = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "bits must be a tuple");
        return NULL;
    }
    Py_buffer lines, records, keys;
    if (get_buffer(args[0], &lines, 8 * 2 * SLOTS, "lines") < 0)
        return NULL;
    if (get_buffer(args[1], &records, (Py_ssize_t)sizeof(guess_record), "records") < 0) {
        PyBuffer_Release(&lines);
        return NULL;
    }
    if (get_buffer(args[2], &keys, 8, "keys") < 0) {
        PyBuffer_Release(&lines);
        PyBuffer_Release(&records);
        return NULL;
    }
    uint64_t nb = (uint64_t)(lines.len / (8 * 2 * SLOTS));
    int lengths[64] = {0};
    if (nb && (uint64_t)records.len / sizeof(guess_record) == nb * SLOTS) {
        const uint64_t *line_data = (const uint64_t *)lines.buf;
        const guess_record *record_data = (const guess_record *)records.buf;
        const uint64_t *key_data = (const uint64_t *)keys.buf;
        Py_ssize_t n = keys.len / 8;
        int expire = oldest_live > 0;
        uint32_t oldest = expire ? (uint32_t)(oldest_live > 0xFFFFFFFFLL ? 0xFFFFFFFFLL : oldest_live) : 0;
        uint64_t alive = want;
        Py_ssize_t i = 0;
        for (; i < n && alive; i++) {
            uint64_t held = held_of(line_data, record_data, nb, key_data[i], expire, oldest);
            uint64_t dropped = alive & ~held;
            alive &= held;
            while (dropped) {
                int bit = __builtin_ctzll(dropped);
                lengths[bit] = (int)i;
                dropped &= dropped - 1;
            }
        }
        while (alive) {
            int bit = __builtin_ctzll(alive);
            lengths[bit] = (int)n;
            alive &= alive - 1;
        }
    } else if (nb) {
        PyErr_SetString(PyExc_ValueError, "records must hold 4 per bucket of lines");
    }
    PyBuffer_Release(&lines);
    PyBuffer_Release(&records);
    PyBuffer_Release(&keys);
    if (PyErr_Occurred())
        return NULL;
    PyObject *bits = args[5];
    Py_ssize_t count = PyTuple_GET_SIZE(bits);
    PyObject *out = PyList_New(count);
    if (out == NULL)
        return NULL;
    for (Py_ssize_t c = 0; c < count; c++) {
        long bit = PyLong_AsLong(PyTuple_GET_ITEM(bits, c));
        if (bit == -1 && PyErr_Occurred()) {
            Py_DECREF(out);
            return NULL;
        }
        PyObject *length = PyLong_FromLong(bit >= 0 && bit < 64 ? lengths[bit] : 0);
        if (length == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, c, length);
    }
    return out;
}

static PyMethodDef methods[] = {
    {"match_lengths", (PyCFunction)(void (*)(void))match_lengths, METH_FASTCALL,
     "Matched prefix length in blocks of each candidate (see routing/prefix_table.py)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_match", NULL, -1, methods};

PyMODINIT_FUNC PyInit__prefix_match(void) { return PyModule_Create(&module); }
