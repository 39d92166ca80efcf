/* A request record's log line in one C call: observability/request_log.py RequestRecord.as_line (its
   Python lines the reference; tests compare the two) for the token-ID policies "full" and "off".

   set_parts(record_type, line_type, line_names, astuple, perf_counter) -> None
   line(record, full_ids, routing_json) -> RecordLine

   The record's fields are read at once (msgspec.structs.astuple, in RequestRecord's field order),
   the times turned into milliseconds to the microsecond as ms() does (round half to even, then
   / 1000), the optional fields left UNSET where as_line leaves them out, and the RecordLine made
   with every field after `worker` as a keyword (line_names, in its order). One line is made per
   request: ~200 Python opcodes (the keywords' loads, three ms() calls, the optional fields' tests)
   against one call here. A record of another type, or one whose fields do not read as expected,
   gets as_line's own error from the Python lines (None returned: the caller runs them). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

/* RequestRecord's fields, in its order (checked against __struct_fields__ by set_parts). */
enum { R_REQUEST_ID, R_ENDPOINT, R_STARTED, R_MODEL, R_REPLICA, R_STREAM, R_STATUS, R_PROMPT_IDS, R_OUTPUT_IDS,
       R_PROMPT_TOKENS, R_COMPLETION_TOKENS, R_CACHED_TOKENS, R_FINISH_REASON, R_ERROR, R_ROUTING, R_ROUTED,
       R_FIRST_TOKEN, R_LAST_TOKEN, R_ITL, R_FINISHED, R_FAILOVER, R_FAILED_AFTER_HEADERS, R_PD, R_KEY, R_TENANT,
       R_PANIC, R_EMITTED, R_FIELDS };
static const char *const record_fields[R_FIELDS] = {
    "request_id", "endpoint", "started_s", "model", "replica", "stream", "status", "prompt_token_ids",
    "output_token_ids", "prompt_tokens", "completion_tokens", "cached_tokens", "finish_reason", "error", "routing",
    "routed_s", "first_token_s", "last_token_s", "itl_s", "finished_s", "failover", "failed_after_headers", "pd",
    "key", "tenant", "panic_routing", "_emitted"};

/* RecordLine's keyword fields (after event, level, timestamp, worker), in its order. */
enum { L_REQUEST_ID, L_MODEL, L_REPLICA, L_ENDPOINT, L_STREAM, L_STATUS, L_PROMPT_TOKENS, L_COMPLETION_TOKENS,
       L_CACHED_TOKENS, L_ROUTED_MS, L_TTFT_MS, L_E2E_MS, L_ITL_MEAN_MS, L_ITL_MAX_MS, L_FINISH_REASON, L_ROUTING,
       L_KEY, L_TENANT, L_ERROR, L_FAILOVER, L_FAILED_AFTER_HEADERS, L_PD, L_PANIC, L_PROMPT_IDS, L_OUTPUT_IDS,
       L_FIELDS };
static const char *const line_fields[L_FIELDS] = {
    "request_id", "model", "replica", "endpoint", "stream", "status", "prompt_tokens", "completion_tokens",
    "cached_tokens", "routed_ms", "ttft_ms", "e2e_ms", "itl_mean_ms", "itl_max_ms", "finish_reason", "routing",
    "key", "tenant", "error", "failover", "failed_after_headers", "pd", "panic_routing", "prompt_token_ids",
    "output_token_ids"};

static PyObject *record_type, *line_type, *line_names, *astuple, *perf_counter, *unset;
static PyObject *s_log_json, *s_log;

/* Whether `names` (a tuple of str) is `expected`, in order. */
static int names_are(PyObject *names, const char *const *expected, Py_ssize_t n) {
    if (!PyTuple_Check(names) || PyTuple_GET_SIZE(names) != n) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        if (!PyUnicode_Check(name) || PyUnicode_CompareWithASCIIString(name, expected[i]) != 0) return 0;
    }
    return 1;
}

static PyObject *set_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "set_parts(record_type, line_type, line_names, astuple, perf_counter)");
        return NULL;
    }
    PyObject *fields = PyObject_GetAttrString(args[0], "__struct_fields__");
    if (fields == NULL) return NULL;
    int same = names_are(fields, record_fields, R_FIELDS);
    Py_DECREF(fields);
    if (!same || !names_are(args[2], line_fields, L_FIELDS)) {
        PyErr_SetString(PyExc_ValueError, "set_parts: RequestRecord's or RecordLine's fields are not the ones "
                                          "observability/_record_line.c reads (update both)");
        return NULL;
    }
    Py_XSETREF(record_type, Py_NewRef(args[0]));
    Py_XSETREF(line_type, Py_NewRef(args[1]));
    Py_XSETREF(line_names, Py_NewRef(args[2]));
    Py_XSETREF(astuple, Py_NewRef(args[3]));
    Py_XSETREF(perf_counter, Py_NewRef(args[4]));
    Py_RETURN_NONE;
}

/* ms(seconds): round(seconds * 1e6) / 1000 as a new float; NULL with round()'s error where it has one. */
static PyObject *ms_of(double seconds) {
    double micro = seconds * 1e6;
    if (!isfinite(micro)) {
        PyErr_SetString(isnan(micro) ? PyExc_ValueError : PyExc_OverflowError,
                        isnan(micro) ? "cannot convert float NaN to integer"
                                     : "cannot convert float infinity to integer");
        return NULL;
    }
    double count = nearbyint(micro);  /* round half to even, as round() */
    if (fabs(count) >= 9007199254740992.0) {  /* past 2**53: int / 1000 is Python's exact division */
        PyObject *whole = PyLong_FromDouble(count), *thousand = PyLong_FromLong(1000), *out = NULL;
        if (whole != NULL && thousand != NULL) out = PyNumber_TrueDivide(whole, thousand);
        Py_XDECREF(whole);
        Py_XDECREF(thousand);
        return out;
    }
    return PyFloat_FromDouble(count / 1000.0);
}

/* ms(later - started) of two float fields, or None where `later` is None. */
static PyObject *ms_since(PyObject *later, double started) {
    if (later == Py_None) return Py_NewRef(Py_None);
    double value = PyFloat_AsDouble(later);
    if (value == -1.0 && PyErr_Occurred()) return NULL;
    return ms_of(value - started);
}

/* ms(f(itl)) for the builtin f (sum or max, looked up once at import), as the Python lines compute
   it; mean: divided by len. */
static PyObject *builtin_sum, *builtin_max;

static PyObject *ms_of_itl(PyObject *itl, PyObject *f, int mean) {
    PyObject *value = PyObject_CallOneArg(f, itl);
    if (value == NULL) return NULL;
    double seconds = PyFloat_AsDouble(value);
    Py_DECREF(value);
    if (seconds == -1.0 && PyErr_Occurred()) return NULL;
    if (mean) seconds /= (double)PyList_GET_SIZE(itl);
    return ms_of(seconds);
}

static PyObject *line(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "line(record, full_ids, routing_json)");
        return NULL;
    }
    PyObject *record = args[0];
    if (record_type == NULL || Py_TYPE(record) != (PyTypeObject *)record_type) Py_RETURN_NONE;
    int full_ids = PyObject_IsTrue(args[1]), routing_json = PyObject_IsTrue(args[2]);
    if (full_ids < 0 || routing_json < 0) return NULL;
    PyObject *fields = PyObject_CallOneArg(astuple, record);
    if (fields == NULL) return NULL;
    if (!PyTuple_Check(fields) || PyTuple_GET_SIZE(fields) != R_FIELDS) {
        Py_DECREF(fields);
        Py_RETURN_NONE;
    }
#define F(i) PyTuple_GET_ITEM(fields, i)
    PyObject *v[L_FIELDS] = {NULL};  /* new references */
    PyObject *out = NULL, *itl = F(R_ITL);
    double started = PyFloat_AsDouble(F(R_STARTED));
    if ((started == -1.0 && PyErr_Occurred()) || !PyList_Check(itl)) {
        PyErr_Clear();
        out = Py_NewRef(Py_None);
        goto done;
    }
    static const int copied[][2] = {{L_REQUEST_ID, R_REQUEST_ID}, {L_MODEL, R_MODEL}, {L_REPLICA, R_REPLICA},
                                    {L_ENDPOINT, R_ENDPOINT}, {L_STREAM, R_STREAM}, {L_STATUS, R_STATUS},
                                    {L_PROMPT_TOKENS, R_PROMPT_TOKENS}, {L_COMPLETION_TOKENS, R_COMPLETION_TOKENS},
                                    {L_CACHED_TOKENS, R_CACHED_TOKENS}, {L_FINISH_REASON, R_FINISH_REASON}};
    for (size_t i = 0; i < sizeof(copied) / sizeof(copied[0]); i++) v[copied[i][0]] = Py_NewRef(F(copied[i][1]));
    PyObject *routing = F(R_ROUTING);
    if (routing != Py_None && !PyDict_CheckExact(routing)) {  /* the gateway's try: its log, as JSON if it can */
        PyObject *log_json = NULL;
        if (routing_json && _PyObject_LookupAttr(routing, s_log_json, &log_json) < 0) goto done;
        if (log_json != NULL) {
            v[L_ROUTING] = PyObject_CallNoArgs(log_json);
            Py_DECREF(log_json);
        } else {
            v[L_ROUTING] = PyObject_GetAttr(routing, s_log);
        }
        if (v[L_ROUTING] == NULL) goto done;
    } else {
        v[L_ROUTING] = Py_NewRef(routing);
    }
    PyObject *finished = F(R_FINISHED), *now = NULL;
    if (finished == Py_None && (finished = now = PyObject_CallNoArgs(perf_counter)) == NULL) goto done;
    v[L_E2E_MS] = ms_since(finished, started);
    Py_XDECREF(now);
    if (v[L_E2E_MS] == NULL || (v[L_ROUTED_MS] = ms_since(F(R_ROUTED), started)) == NULL
        || (v[L_TTFT_MS] = ms_since(F(R_FIRST_TOKEN), started)) == NULL)
        goto done;
    if (PyList_GET_SIZE(itl)) {
        if ((v[L_ITL_MEAN_MS] = ms_of_itl(itl, builtin_sum, 1)) == NULL || (v[L_ITL_MAX_MS] = ms_of_itl(itl, builtin_max, 0)) == NULL)
            goto done;
    } else {
        v[L_ITL_MEAN_MS] = Py_NewRef(Py_None);
        v[L_ITL_MAX_MS] = Py_NewRef(Py_None);
    }
    int key = F(R_KEY) != Py_None, failover = PyObject_IsTrue(F(R_FAILOVER)),
        failed_after_headers = PyObject_IsTrue(F(R_FAILED_AFTER_HEADERS)), panic = PyObject_IsTrue(F(R_PANIC));
    if (failover < 0 || failed_after_headers < 0 || panic < 0) goto done;
    v[L_KEY] = Py_NewRef(key ? F(R_KEY) : unset);
    v[L_TENANT] = Py_NewRef(key ? F(R_TENANT) : unset);
    v[L_ERROR] = Py_NewRef(F(R_ERROR) != Py_None ? F(R_ERROR) : unset);
    v[L_FAILOVER] = Py_NewRef(failover ? F(R_FAILOVER) : unset);
    v[L_FAILED_AFTER_HEADERS] = Py_NewRef(failed_after_headers ? Py_True : unset);
    v[L_PD] = Py_NewRef(F(R_PD) != Py_None ? F(R_PD) : unset);
    v[L_PANIC] = Py_NewRef(panic ? Py_True : unset);
    v[L_PROMPT_IDS] = Py_NewRef(full_ids ? F(R_PROMPT_IDS) : unset);
    v[L_OUTPUT_IDS] = Py_NewRef(full_ids ? F(R_OUTPUT_IDS) : unset);
    out = PyObject_Vectorcall(line_type, v, 0, line_names);
done:
#undef F
    for (int i = 0; i < L_FIELDS; i++) Py_XDECREF(v[i]);
    Py_DECREF(fields);
    return out;
}

static PyMethodDef methods[] = {
    {"set_parts", (PyCFunction)(void (*)(void))set_parts, METH_FASTCALL,
     "The types and calls line() uses (observability/request_log.py's)."},
    {"line", (PyCFunction)(void (*)(void))line, METH_FASTCALL,
     "RequestRecord.as_line for full or no token IDs; None where the Python lines serve."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_record_line", NULL, -1, methods};

PyMODINIT_FUNC PyInit__record_line(void) {
    if ((s_log_json = PyUnicode_InternFromString("log_json")) == NULL
        || (s_log = PyUnicode_InternFromString("log")) == NULL)
        return NULL;
    PyObject *builtins = PyImport_ImportModule("builtins");
    if (builtins == NULL) return NULL;
    builtin_sum = PyObject_GetAttrString(builtins, "sum");
    builtin_max = PyObject_GetAttrString(builtins, "max");
    Py_DECREF(builtins);
    if (builtin_sum == NULL || builtin_max == NULL) return NULL;
    PyObject *msgspec = PyImport_ImportModule("msgspec");
    if (msgspec == NULL) return NULL;
    unset = PyObject_GetAttrString(msgspec, "UNSET");
    Py_DECREF(msgspec);
    if (unset == NULL) return NULL;
    return PyModule_Create(&module);
}
