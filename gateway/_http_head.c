/* The plain request head the hot path serves, read in one pass (gateway/hot_path.py).

   parse(buffer, end) -> (target, [(name, value), ...], longest) | None

   `end` is where the head's "\r\n\r\n" starts. It takes only the common, plain shape:

       POST /v1/completions HTTP/1.1        (or /v1/chat/completions)
       Name: value                          one CRLF per line

   with names of RFC 9110 token characters, values of visible ASCII with inner spaces or tabs,
   one optional space or tab after the colon and none at the value's end. Anything else (another
   method, target or version, a folded line, a bare LF, a control or non-ASCII byte, an empty value,
   space before the colon, ...) gives None, and the caller parses the head with llhttp as before:
   this fast path accepts a subset of what llhttp accepts and reads it the same way, so nothing
   changes for the heads it leaves alone. `longest` is the longest header line, name + value + 2,
   as the llhttp callbacks count it. Names and values come back as str (they are ASCII). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

static unsigned char TCHAR[256];

static void init_tchar(void) {
    const char *extra = "!#$%&'*+-.^_`|~";
    for (int c = '0'; c <= '9'; c++) TCHAR[c] = 1;
    for (int c = 'a'; c <= 'z'; c++) TCHAR[c] = 1;
    for (int c = 'A'; c <= 'Z'; c++) TCHAR[c] = 1;
    for (const char *p = extra; *p; p++) TCHAR[(unsigned char)*p] = 1;
}

static int value_byte(unsigned char c) { return (c >= 0x21 && c <= 0x7e) || c == ' ' || c == '\t'; }

static PyObject *parse(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyBytes_CheckExact(args[0])) {
        PyErr_SetString(PyExc_TypeError, "parse(buffer: bytes, end: int)");
        return NULL;
    }
    Py_ssize_t size = PyBytes_GET_SIZE(args[0]);
    Py_ssize_t end = PyLong_AsSsize_t(args[1]);
    if (end == -1 && PyErr_Occurred()) return NULL;
    if (end < 0 || end + 4 > size) Py_RETURN_NONE;
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(args[0]);
    const unsigned char *p = buf, *stop = buf + end + 2; /* stop: just past the last line's CRLF */

    static const char COMPLETIONS[] = "POST /v1/completions HTTP/1.1\r\n";
    static const char CHAT[] = "POST /v1/chat/completions HTTP/1.1\r\n";
    Py_ssize_t target_len;
    if (end + 2 >= (Py_ssize_t)sizeof(COMPLETIONS) - 1 && memcmp(p, COMPLETIONS, sizeof(COMPLETIONS) - 1) == 0) {
        target_len = 15;
        p += sizeof(COMPLETIONS) - 1;
    } else if (end + 2 >= (Py_ssize_t)sizeof(CHAT) - 1 && memcmp(p, CHAT, sizeof(CHAT) - 1) == 0) {
        target_len = 20;
        p += sizeof(CHAT) - 1;
    } else {
        Py_RETURN_NONE;
    }
    PyObject *pairs = PyList_New(0);
    if (pairs == NULL) return NULL;
    Py_ssize_t longest = 0;
    while (p < stop) {
        const unsigned char *name = p;
        while (p < stop && TCHAR[*p]) p++;
        Py_ssize_t name_len = p - name;
        if (name_len == 0 || p >= stop || *p != ':') goto fallback;
        p++;
        if (p < stop && (*p == ' ' || *p == '\t')) p++;
        const unsigned char *value = p;
        while (p < stop && value_byte(*p)) p++;
        Py_ssize_t value_len = p - value;
        if (p >= stop || p[0] != '\r' || p[1] != '\n') goto fallback; /* p < stop: p[1] is in the buffer */
        if (value_len == 0 || value[0] == ' ' || value[0] == '\t' || value[value_len - 1] == ' ' ||
            value[value_len - 1] == '\t')
            goto fallback;
        p += 2;
        if (name_len + value_len + 2 > longest) longest = name_len + value_len + 2;
        PyObject *pair = Py_BuildValue("(s#s#)", (const char *)name, name_len, (const char *)value, value_len);
        if (pair == NULL) goto error;
        int failed = PyList_Append(pairs, pair);
        Py_DECREF(pair);
        if (failed) goto error;
    }
    if (p != stop) goto fallback;
    PyObject *target = PyBytes_FromStringAndSize((const char *)buf + 5, target_len);
    if (target == NULL) goto error;
    PyObject *result = Py_BuildValue("(NNn)", target, pairs, longest);
    return result;
fallback:
    Py_DECREF(pairs);
    Py_RETURN_NONE;
error:
    Py_DECREF(pairs);
    return NULL;
}

static PyMethodDef methods[] = {
    {"parse", (PyCFunction)(void (*)(void))parse, METH_FASTCALL,
     "parse(buffer, end) -> (target, [(name, value), ...], longest) for a plain hot request head, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gateway._http_head", NULL, -1, methods};

PyMODINIT_FUNC PyInit__http_head(void) {
    init_tchar();
    return PyModule_Create(&module);
}
