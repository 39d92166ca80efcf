/* The plain HTTP/1.1 heads of the hot path, read in one pass: a client's request head
   (gateway/hot_path.py) and a replica's whole answer (gateway/http_client.py).

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
   as the llhttp callbacks count it. Names and values come back as str (they are ASCII).

   parse_response(data) -> (status, {name: value}, body) | None

   A replica's answer when `data` (one read) is all of it and nothing more: "HTTP/1.1 NNN reason",
   header lines as above, one Content-Length of digits and exactly that many body bytes after the
   head; status 200-599 but 204 and 304; no Transfer-Encoding and no Connection header (llhttp
   decides keep-alive then), and no repeated Content-Length. Names come back lower-cased, the last
   value of a repeated name wins (as the llhttp callbacks store them). Anything else gives None:
   llhttp reads it. */
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

/* The header lines from *p up to `stop` (just past the last line's CRLF): each appended to `pairs`
   as (name, value), or set in `dict` with its name lower-cased. 1: all plain; 0: one is not (the
   caller falls back to llhttp); -1: a Python error. *longest: the longest line, name + value + 2. */
static int read_lines(const unsigned char **at, const unsigned char *stop, PyObject *pairs, PyObject *dict,
                      Py_ssize_t *longest) {
    const unsigned char *p = *at;
    char lower[256];
    while (p < stop) {
        const unsigned char *name = p;
        while (p < stop && TCHAR[*p]) p++;
        Py_ssize_t name_len = p - name;
        if (name_len == 0 || p >= stop || *p != ':') return 0;
        p++;
        if (p < stop && (*p == ' ' || *p == '\t')) p++;
        const unsigned char *value = p;
        while (p < stop && value_byte(*p)) p++;
        Py_ssize_t value_len = p - value;
        if (p >= stop || p[0] != '\r' || p[1] != '\n') return 0; /* p < stop: p[1] is in the buffer */
        if (value_len == 0 || value[0] == ' ' || value[0] == '\t' || value[value_len - 1] == ' ' ||
            value[value_len - 1] == '\t')
            return 0;
        p += 2;
        if (name_len + value_len + 2 > *longest) *longest = name_len + value_len + 2;
        if (pairs != NULL) {
            PyObject *pair = Py_BuildValue("(s#s#)", (const char *)name, name_len, (const char *)value, value_len);
            if (pair == NULL) return -1;
            int failed = PyList_Append(pairs, pair);
            Py_DECREF(pair);
            if (failed) return -1;
        } else {
            if (name_len > (Py_ssize_t)sizeof(lower)) return 0;
            for (Py_ssize_t i = 0; i < name_len; i++)
                lower[i] = (char)((name[i] >= 'A' && name[i] <= 'Z') ? name[i] + 32 : name[i]);
            if (name_len == 14 && memcmp(lower, "content-length", 14) == 0 &&
                PyDict_GetItemString(dict, "content-length") != NULL)
                return 0;  /* a repeated Content-Length: llhttp refuses it */
            PyObject *key = PyUnicode_FromStringAndSize(lower, name_len);
            if (key == NULL) return -1;
            PyObject *text = PyUnicode_FromStringAndSize((const char *)value, value_len);
            if (text == NULL) {
                Py_DECREF(key);
                return -1;
            }
            int failed = PyDict_SetItem(dict, key, text);
            Py_DECREF(key);
            Py_DECREF(text);
            if (failed) return -1;
        }
    }
    *at = p;
    return 1;
}

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
    int read = read_lines(&p, stop, pairs, NULL, &longest);
    if (read < 0) goto error;
    if (read == 0) goto fallback;
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

static PyObject *parse_response(PyObject *self, PyObject *data) {
    if (!PyBytes_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "parse_response(data: bytes)");
        return NULL;
    }
    const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(data);
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    const unsigned char *end = memmem(buf, (size_t)size, "\r\n\r\n", 4);
    if (end == NULL || size < 17 || memcmp(buf, "HTTP/1.1 ", 9) != 0) Py_RETURN_NONE;
    const unsigned char *p = buf + 9;
    if (p[0] < '2' || p[0] > '5' || p[1] < '0' || p[1] > '9' || p[2] < '0' || p[2] > '9' || p[3] != ' ')
        Py_RETURN_NONE;
    long status = (p[0] - '0') * 100 + (p[1] - '0') * 10 + (p[2] - '0');
    if (status == 204 || status == 304) Py_RETURN_NONE;
    p += 4;
    while (p < end && value_byte(*p)) p++;  /* the reason phrase */
    if (p == end || p[0] != '\r' || p[1] != '\n') Py_RETURN_NONE;  /* p == end: no header lines at all */
    p += 2;
    const unsigned char *stop = end + 2;
    PyObject *headers = PyDict_New();
    if (headers == NULL) return NULL;
    Py_ssize_t longest = 0;
    int read = read_lines(&p, stop, NULL, headers, &longest);
    if (read < 0) {
        Py_DECREF(headers);
        return NULL;
    }
    if (read == 0 || PyDict_GetItemString(headers, "transfer-encoding") != NULL ||
        PyDict_GetItemString(headers, "connection") != NULL)
        goto fallback;
    PyObject *length_text = PyDict_GetItemString(headers, "content-length");  /* borrowed */
    if (length_text == NULL) goto fallback;
    Py_ssize_t digits;
    const char *length_chars = PyUnicode_AsUTF8AndSize(length_text, &digits);
    if (length_chars == NULL) {
        Py_DECREF(headers);
        return NULL;
    }
    if (digits == 0 || digits > 15) goto fallback;
    Py_ssize_t length = 0;
    for (Py_ssize_t i = 0; i < digits; i++) {
        if (length_chars[i] < '0' || length_chars[i] > '9') goto fallback;
        length = length * 10 + (length_chars[i] - '0');
    }
    Py_ssize_t body_at = (end + 4) - buf;
    if (size - body_at != length) goto fallback;
    PyObject *body = PyBytes_FromStringAndSize((const char *)buf + body_at, length);
    if (body == NULL) {
        Py_DECREF(headers);
        return NULL;
    }
    return Py_BuildValue("(lNN)", status, headers, body);
fallback:
    Py_DECREF(headers);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"parse", (PyCFunction)(void (*)(void))parse, METH_FASTCALL,
     "parse(buffer, end) -> (target, [(name, value), ...], longest) for a plain hot request head, else None."},
    {"parse_response", (PyCFunction)parse_response, METH_O,
     "parse_response(data) -> (status, {name: value}, body) for a whole plain answer in one read, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gateway._http_head", NULL, -1, methods};

PyMODINIT_FUNC PyInit__http_head(void) {
    init_tchar();
    return PyModule_Create(&module);
}
