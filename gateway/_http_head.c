/* The plain HTTP/1.1 heads of the hot path, read in one pass: a client's request head
   (gateway/hot_path.py) and a replica's whole answer (gateway/http_client.py).

   parse(buffer, end) -> (target, [(name, value), ...], longest, content_length, keep_alive) | None

   `end` is where the head's "\r\n\r\n" starts. It takes only the common, plain shape:

       POST /v1/completions HTTP/1.1        (or /v1/chat/completions)
       Name: value                          one CRLF per line

   with names of RFC 9110 token characters, values of visible ASCII with inner spaces or tabs,
   one optional space or tab after the colon and none at the value's end. Anything else (another
   method, target or version, a folded line, a bare LF, a control or non-ASCII byte, an empty value,
   space before the colon, ...) gives None, and the caller parses the head with llhttp as before:
   this fast path accepts a subset of what llhttp accepts and reads it the same way, so nothing
   changes for the heads it leaves alone. `longest` is the longest header line, name + value + 2,
   as the llhttp callbacks count it. Names and values come back as str (they are ASCII). It also
   reads what the hot path decides on (names case-insensitive): None unless there is exactly one
   Content-Length, of 1-18 digits, and no Transfer-Encoding, Expect or Upgrade header (the hot
   path leaves such requests to aiohttp whichever parser reads them); keep_alive is False when the
   first Connection header holds "close" in any case.

   parse_response(data) -> (status, {name: value}, body) | None

   A replica's answer when `data` (one read) is all of it and nothing more: "HTTP/1.1 NNN reason",
   header lines as above, one Content-Length of digits and exactly that many body bytes after the
   head; status 200-599 but 204 and 304; no Transfer-Encoding and no Connection header (llhttp
   decides keep-alive then), and no repeated Content-Length. Names come back lower-cased, the last
   value of a repeated name wins (as the llhttp callbacks store them). Anything else gives None:
   llhttp reads it.

   Or a whole chunked answer in the one read (a stream that a replica on the gateway's cores wrote
   all of before the gateway ran again: gateway/answer.py, Answer._lead): "Transfer-Encoding:
   chunked" (that one value, any case) and no Content-Length, then chunks of "HEX\r\nDATA\r\n" (hex
   digits only, no extension), the last "0\r\n\r\n" (no trailer) ending the read; the body is the
   chunks' data joined, as llhttp's body callbacks hand it over. A chunked answer whose end is not
   in the read goes to llhttp, which keeps the state of a body that goes on.

   response_head(status_line, headers, framing, date, close, body) -> bytes | None

   A hot response's head, the way gateway/hot_path.py writes it: the status line, each header of
   the dict as "name: value", the framing line (Content-Length or Transfer-Encoding), the Date line,
   "Connection: close" when `close`, the blank line, then `body` (b"" for none): one allocation for
   the head and a short body. None when a name or value is not a str of Latin-1 characters, holds a
   CR or LF, or `headers` is not a plain dict: the caller's Python path formats it (and raises
   the errors it raises). */
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

/* What parse() learns of a request head's lines besides the pairs (see the top comment). */
struct head_facts {
    int lengths;            /* Content-Length lines */
    long long length;       /* the first one's value; -1: not 1-18 digits */
    int refused;            /* a Transfer-Encoding, Expect or Upgrade line */
    int connection_seen;
    int close;              /* the first Connection line holds "close" */
};

static int same_name(const unsigned char *name, Py_ssize_t len, const char *lower) {
    Py_ssize_t i = 0;
    for (; i < len && lower[i]; i++) {
        unsigned char c = name[i];
        if ((c >= 'A' && c <= 'Z' ? c + 32 : c) != (unsigned char)lower[i]) return 0;
    }
    return i == len && lower[i] == 0;
}

static void learn(struct head_facts *facts, const unsigned char *name, Py_ssize_t name_len,
                  const unsigned char *value, Py_ssize_t value_len) {
    if (same_name(name, name_len, "content-length")) {
        if (facts->lengths++ == 0) {
            long long length = 0;
            if (value_len > 18) length = -1;
            for (Py_ssize_t i = 0; i < value_len && length >= 0; i++) {
                if (value[i] < '0' || value[i] > '9') length = -1;
                else length = length * 10 + (value[i] - '0');
            }
            facts->length = length;
        }
    } else if (same_name(name, name_len, "transfer-encoding") || same_name(name, name_len, "expect") ||
               same_name(name, name_len, "upgrade")) {
        facts->refused = 1;
    } else if (!facts->connection_seen && same_name(name, name_len, "connection")) {
        facts->connection_seen = 1;
        for (Py_ssize_t i = 0; i + 5 <= value_len; i++) {
            if (same_name(value + i, 5, "close")) {
                facts->close = 1;
                break;
            }
        }
    }
}

/* The header lines from *p up to `stop` (just past the last line's CRLF): each appended to `pairs`
   as (name, value), or set in `dict` with its name lower-cased. 1: all plain; 0: one is not (the
   caller falls back to llhttp); -1: a Python error. *longest: the longest line, name + value + 2. */
static int read_lines(const unsigned char **at, const unsigned char *stop, PyObject *pairs, PyObject *dict,
                      Py_ssize_t *longest, struct head_facts *facts) {
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
        if (facts != NULL) learn(facts, name, name_len, value, value_len);
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
    struct head_facts facts = {0, -1, 0, 0, 0};
    int read = read_lines(&p, stop, pairs, NULL, &longest, &facts);
    if (read < 0) goto error;
    if (read == 0) goto fallback;
    if (p != stop || facts.lengths != 1 || facts.length < 0 || facts.refused) goto fallback;
    PyObject *target = PyBytes_FromStringAndSize((const char *)buf + 5, target_len);
    if (target == NULL) goto error;
    PyObject *result = Py_BuildValue("(NNnLO)", target, pairs, longest, facts.length,
                                     facts.close ? Py_False : Py_True);
    return result;
fallback:
    Py_DECREF(pairs);
    Py_RETURN_NONE;
error:
    Py_DECREF(pairs);
    return NULL;
}

/* The size line of the chunk at *at, "HEX\r\n" with 1-15 hex digits: its size, *at moved past it;
   -1 when the line is not that (or not all in the read). */
static Py_ssize_t chunk_size(const unsigned char **at, const unsigned char *stop) {
    const unsigned char *p = *at;
    Py_ssize_t size = 0;
    int digits = 0;
    for (; p < stop && digits <= 15; p++, digits++) {
        unsigned char c = *p;
        int value = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10
                    : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
        if (value < 0) break;
        size = size * 16 + value;
    }
    if (digits == 0 || digits > 15 || stop - p < 2 || p[0] != '\r' || p[1] != '\n') return -1;
    *at = p + 2;
    return size;
}

/* The joined data of the chunks from `p` when they end exactly at `stop` with "0\r\n\r\n"; NULL
   with no exception set when they do not (the caller falls back to llhttp). Two passes: the first
   checks the framing and counts the bytes, the second copies them into the one bytes object. */
static PyObject *whole_chunked(const unsigned char *p, const unsigned char *stop) {
    Py_ssize_t total = 0;
    for (const unsigned char *q = p;;) {
        Py_ssize_t size = chunk_size(&q, stop);
        if (size < 0) return NULL;
        if (size == 0) {
            if (stop - q != 2 || q[0] != '\r' || q[1] != '\n') return NULL;
            break;
        }
        if (stop - q < size + 2 || q[size] != '\r' || q[size + 1] != '\n') return NULL;
        q += size + 2;
        total += size;
    }
    PyObject *body = PyBytes_FromStringAndSize(NULL, total);
    if (body == NULL) return NULL;
    char *w = PyBytes_AS_STRING(body);
    for (Py_ssize_t size; (size = chunk_size(&p, stop)) > 0; p += size + 2) {
        memcpy(w, p, (size_t)size);
        w += size;
    }
    return body;
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
    int read = read_lines(&p, stop, NULL, headers, &longest, NULL);
    if (read < 0) {
        Py_DECREF(headers);
        return NULL;
    }
    if (read == 0 || PyDict_GetItemString(headers, "connection") != NULL) goto fallback;
    PyObject *length_text = PyDict_GetItemString(headers, "content-length");  /* borrowed */
    PyObject *coding = PyDict_GetItemString(headers, "transfer-encoding");   /* borrowed */
    if (coding != NULL) {
        if (length_text != NULL) goto fallback;
        Py_ssize_t coding_len;
        const char *coding_chars = PyUnicode_AsUTF8AndSize(coding, &coding_len);
        if (coding_chars == NULL) {
            Py_DECREF(headers);
            return NULL;
        }
        if (!same_name((const unsigned char *)coding_chars, coding_len, "chunked")) goto fallback;
        PyObject *body = whole_chunked(end + 4, buf + size);
        if (body == NULL) {
            if (PyErr_Occurred()) {
                Py_DECREF(headers);
                return NULL;
            }
            goto fallback;
        }
        return Py_BuildValue("(lNN)", status, headers, body);
    }
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

/* A str's Latin-1 bytes (*size of them), or NULL when it has a wider character or a CR or LF. */
static const char *plain_latin1(PyObject *text, Py_ssize_t *size) {
    if (!PyUnicode_Check(text) || PyUnicode_READY(text) < 0 || PyUnicode_KIND(text) != PyUnicode_1BYTE_KIND)
        return NULL;
    const char *data = (const char *)PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text);
    if (memchr(data, '\r', (size_t)n) != NULL || memchr(data, '\n', (size_t)n) != NULL) return NULL;
    *size = n;
    return data;
}

static PyObject *response_head(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyBytes_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "response_head(status_line, headers, framing, date, close, body: bytes)");
        return NULL;
    }
    PyObject *headers = args[1];
    if (!PyDict_CheckExact(headers)) Py_RETURN_NONE;
    int close = PyObject_IsTrue(args[4]);
    if (close < 0) return NULL;
    Py_ssize_t status_len, framing_len, date_len;
    const char *status = plain_latin1(args[0], &status_len);
    const char *framing = plain_latin1(args[2], &framing_len);
    const char *date = plain_latin1(args[3], &date_len);
    if (status == NULL || framing == NULL || date == NULL) Py_RETURN_NONE;
    static const char CLOSE[] = "Connection: close\r\n";
    Py_ssize_t body_len = PyBytes_GET_SIZE(args[5]);
    Py_ssize_t total = status_len + 2 + framing_len + 2 + date_len + 2 + (close ? (Py_ssize_t)sizeof(CLOSE) - 1 : 0) + 2
                       + body_len;
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(headers, &pos, &name, &value)) {
        Py_ssize_t name_len, value_len;
        if (plain_latin1(name, &name_len) == NULL || plain_latin1(value, &value_len) == NULL) Py_RETURN_NONE;
        total += name_len + 2 + value_len + 2;
    }
    PyObject *out = PyBytes_FromStringAndSize(NULL, total);
    if (out == NULL) return NULL;
    char *w = PyBytes_AS_STRING(out);
#define PUT(data, n) do { memcpy(w, (data), (size_t)(n)); w += (n); } while (0)
    PUT(status, status_len);
    PUT("\r\n", 2);
    pos = 0;
    while (PyDict_Next(headers, &pos, &name, &value)) {
        Py_ssize_t name_len, value_len;
        const char *n = plain_latin1(name, &name_len), *v = plain_latin1(value, &value_len);
        PUT(n, name_len);
        PUT(": ", 2);
        PUT(v, value_len);
        PUT("\r\n", 2);
    }
    PUT(framing, framing_len);
    PUT("\r\n", 2);
    PUT(date, date_len);
    PUT("\r\n", 2);
    if (close) PUT(CLOSE, sizeof(CLOSE) - 1);
    PUT("\r\n", 2);
    PUT(PyBytes_AS_STRING(args[5]), body_len);
#undef PUT
    return out;
}

static PyMethodDef methods[] = {
    {"parse", (PyCFunction)(void (*)(void))parse, METH_FASTCALL,
     "parse(buffer, end) -> (target, [(name, value), ...], longest, content_length, keep_alive) for a plain hot request head, else None."},
    {"parse_response", (PyCFunction)parse_response, METH_O,
     "parse_response(data) -> (status, {name: value}, body) for a whole plain answer in one read, else None."},
    {"response_head", (PyCFunction)(void (*)(void))response_head, METH_FASTCALL,
     "response_head(status_line, headers, framing, date, close, body) -> the head and body as bytes, else None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "gateway._http_head", NULL, -1, methods};

PyMODINIT_FUNC PyInit__http_head(void) {
    init_tchar();
    return PyModule_Create(&module);
}
