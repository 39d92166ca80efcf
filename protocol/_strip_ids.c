/* Token IDs cut out of a JSON payload without decoding it (protocol/stream_chunks.py).

   strip(payload, both) -> bytes

   Removes every compact member `,"token_ids":[1,2,3]` / `,"token_ids":null` and, with `both`,
   `,"prompt_token_ids":[...]` / `,"prompt_token_ids":null` too (without it, only the
   prompt_token_ids members), as stream_chunks._COMPACT_TOKEN_IDS.sub(b"", payload) does: the same
   members (a list of digits and commas only), left to right, never overlapping. A scan for the key
   with memmem instead of the regex's attempt at every position: ~10x faster on a relayed batch of
   events. Returns the payload itself when nothing was cut. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static PyObject *strip(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "strip(payload: bytes, both: bool)");
        return NULL;
    }
    int both = PyObject_IsTrue(args[1]);
    if (both < 0) return NULL;
    PyObject *payload = args[0];
    const char *p = PyBytes_AS_STRING(payload);
    Py_ssize_t n = PyBytes_GET_SIZE(payload);
    const char *key = both ? "token_ids\":" : "prompt_token_ids\":";
    Py_ssize_t key_len = (Py_ssize_t)strlen(key);
    char *out = NULL;  /* allocated at the first cut: most payloads are returned as they are */
    Py_ssize_t out_len = 0, copied = 0, searched = 0;
    while (searched < n) {
        const char *found = memmem(p + searched, (size_t)(n - searched), key, (size_t)key_len);
        if (found == NULL) break;
        Py_ssize_t at = found - p, begin, end;
        searched = at + key_len;
        if (at >= 2 && p[at - 2] == ',' && p[at - 1] == '"')
            begin = at - 2;
        else if (both && at >= 9 && memcmp(p + at - 9, ",\"prompt_", 9) == 0)
            begin = at - 9;
        else
            continue;
        if (n - searched >= 4 && memcmp(p + searched, "null", 4) == 0) {
            end = searched + 4;
        } else if (searched < n && p[searched] == '[') {
            Py_ssize_t j = searched + 1;
            while (j < n && ((p[j] >= '0' && p[j] <= '9') || p[j] == ',')) j++;
            if (j >= n || p[j] != ']') continue;
            end = j + 1;
        } else {
            continue;
        }
        if (out == NULL) {
            out = PyMem_Malloc((size_t)n);
            if (out == NULL) return PyErr_NoMemory();
        }
        memcpy(out + out_len, p + copied, (size_t)(begin - copied));
        out_len += begin - copied;
        copied = searched = end;
    }
    if (out == NULL) {
        Py_INCREF(payload);
        return payload;
    }
    memcpy(out + out_len, p + copied, (size_t)(n - copied));
    out_len += n - copied;
    PyObject *result = PyBytes_FromStringAndSize(out, out_len);
    PyMem_Free(out);
    return result;
}

static PyMethodDef methods[] = {
    {"strip", (PyCFunction)(void (*)(void))strip, METH_FASTCALL,
     "strip(payload, both) -> payload without its compact token_ids (and, with both, prompt_token_ids) members."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "protocol._strip_ids", NULL, -1, methods};

PyMODINIT_FUNC PyInit__strip_ids(void) { return PyModule_Create(&module); }
