/* ASCII text cut into GPT-2 byte-level pre-tokens, and words' IDs put together
   (tokenization/word_encoder.py).

   split(text: str) -> list[str]

   What re.compile(ASCII_BYTE_LEVEL_PATTERN).findall(text) returns for ASCII text, that is the
   pattern  's|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\s A-Za-z0-9]+|\s+(?!\S)|\s+  with
   \s the six ASCII spaces (\t \n \v \f \r and the space), in one pass over the characters. At each
   position the first alternative that matches wins:
   - a contraction: an apostrophe then s, t, m, d, re, ve or ll (lower case);
   - an optional space then a run of letters, of digits, or of other characters (none of them a
     space, letter or digit): the three classes do not overlap, so the character after the
     space picks the run;
   - a run of spaces: all of it at the end of the text; else all but its last character (which
     then starts the next piece: a space before a word, or a lone \n) when that leaves one;
     else the one character.
   word_encoder uses it only after it agrees with the tokenizer's own pattern on every ASCII
   character in several contexts (_ascii_agrees), as it does the `re` pattern. The standard
   library's engine tries each alternative at each position (~20-30 ns a character); this is
   ~2 ns a character plus the pieces' strings. ValueError for text that is not ASCII. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum { OTHER = 0, SPACE = 1, LETTER = 2, DIGIT = 3 };

static unsigned char char_class[128];

static int is_space(unsigned char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\v' || c == '\f' || c == '\r';
}

/* The length of the contraction at p[0] == '\'' (n characters left), or 0. */
static Py_ssize_t contraction(const unsigned char *p, Py_ssize_t n) {
    if (n < 2) return 0;
    unsigned char c = p[1];
    if (c == 's' || c == 't' || c == 'm' || c == 'd') return 2;
    if (n >= 3 && ((c == 'r' && p[2] == 'e') || (c == 'v' && p[2] == 'e') || (c == 'l' && p[2] == 'l'))) return 3;
    return 0;
}

static PyObject *split(PyObject *self, PyObject *text) {
    if (!PyUnicode_CheckExact(text)) {
        PyErr_SetString(PyExc_TypeError, "split(text: str)");
        return NULL;
    }
    if (PyUnicode_READY(text) < 0) return NULL;
    if (!PyUnicode_IS_ASCII(text)) {
        PyErr_SetString(PyExc_ValueError, "split: the text is not ASCII");
        return NULL;
    }
    const unsigned char *s = PyUnicode_1BYTE_DATA(text);
    Py_ssize_t n = PyUnicode_GET_LENGTH(text), i = 0;
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    while (i < n) {
        unsigned char c = s[i];
        Py_ssize_t end;
        Py_ssize_t quote = c == '\'' ? contraction(s + i, n - i) : 0;
        if (quote) {
            end = i + quote;
        } else if (char_class[c] != SPACE || (c == ' ' && i + 1 < n && char_class[s[i + 1]] != SPACE)) {
            Py_ssize_t j = char_class[c] == SPACE ? i + 1 : i;  /* a space before the run */
            unsigned char kind = char_class[s[j]];
            end = j + 1;
            while (end < n && char_class[s[end]] == kind) end++;
        } else {
            end = i + 1;
            while (end < n && char_class[s[end]] == SPACE) end++;
            if (end < n && end - i >= 2) end--;  /* the last one goes with what follows */
        }
        PyObject *piece = PyUnicode_Substring(text, i, end);
        if (piece == NULL || PyList_Append(out, piece) < 0) {
            Py_XDECREF(piece);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(piece);
        i = end;
    }
    return out;
}

/* ids(words: list[str], known: dict[str, list[int]], learn) -> list[int]: each word's IDs from
   `known`, or from learn(word) for a word it lacks, one after another (WordEncoder.encode's loop:
   ~70 ns a word in Python). */
static PyObject *ids(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyList_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "ids(words: list, known: dict, learn)");
        return NULL;
    }
    PyObject *words = args[0], *known = args[1], *learn = args[2];
    PyObject *out = PyList_New(0);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(words); i++) {
        PyObject *word = PyList_GET_ITEM(words, i);
        PyObject *found = PyDict_GetItemWithError(known, word);  /* borrowed */
        if (found != NULL) {
            Py_INCREF(found);
        } else if (PyErr_Occurred() || (found = PyObject_CallOneArg(learn, word)) == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        Py_ssize_t at = PyList_GET_SIZE(out);
        int failed = PyList_SetSlice(out, at, at, found);  /* extend: found is a list (or any sequence) */
        Py_DECREF(found);
        if (failed < 0) {
            Py_DECREF(out);
            return NULL;
        }
    }
    return out;
}

static PyMethodDef methods[] = {
    {"split", (PyCFunction)split, METH_O, "ASCII text as the GPT-2 byte-level pattern's findall cuts it."},
    {"ids", (PyCFunction)(void (*)(void))ids, METH_FASTCALL, "The words' IDs from a dict, learning the missing ones."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_word_split", NULL, -1, methods};

PyMODINIT_FUNC PyInit__word_split(void) {
    for (int c = 0; c < 128; c++) {
        char_class[c] = is_space((unsigned char)c) ? SPACE
                      : ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z')) ? LETTER
                      : (c >= '0' && c <= '9') ? DIGIT : OTHER;
    }
    return PyModule_Create(&module);
}
