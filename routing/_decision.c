/* A routing decision's per-candidate loops in C: the load estimate (routing/load.py,
   LoadTracker.loads_and_delays) and cache_aware's choice from it (routing/policies.py, decide below).

   loads_and_delays(tracker, names, now[, estimate]) -> (loads, delays[, estimates]) | None

   Read from the tracker's slots: its dict of ReplicaLoad by name and its model's terms. None when
   one of `names` has no load yet (the Python loop then makes it). The same arithmetic as the Python
   loop, in the same order, on the same doubles: equal results to the bit (tests compare the two),
   ints where it gives ints (a load with no traffic from elsewhere stays an int in the decision's
   log). A decision reads ~10 fields of each candidate: ~90 Python opcodes a candidate against a few
   attribute reads here. With `estimate` (routing/load.py EstimateLog) it also makes each
   candidate's record of the estimate, the request log's `routing.load_estimate`, as the Python loop
   does; with estimate=bytes, that object's JSON instead, written in the same pass.

   decide(matched, loads, delays, prompt_tokens, block, min_match, prefill_weight, queue_weight, tracker,
          balance_factor, balance_slack, follow_slack, follow_abs_slack, candidates, hashes, name_hash,
          table, policy, now) -> (chosen, why, scores, allowed, tied, skip_cache)

   cache_aware's choice once the matches and loads are known (CacheAware._decide, the reference):
   the scores, the balance guard, the best allowed, and a tie's steps: least load, the caches' fill
   and turnover (read from the table's counts, on the policy's own turnover state, which it updates
   as turnover() does), turns for a prompt shorter than a block, the rendezvous hash. `tied` (not
   None, chosen -1) is a tie left to Python: a replica name not hashed yet, or a table or state of a
   shape not read here; skip_cache says the cache steps are done (or every tied replica holds the
   whole prompt).

   explain(policy, reason, chosen, candidates, matched_names, matched, load_names, loads, scored, scores,
           predicted_cached_tokens, mode, estimates, retried_after) -> bytes

   The request record's `routing` field as JSON, the object routing/policy.py routing_log() makes plus
   the gateway's `mode`, `load_estimate` (a dict of name -> EstimateLog, or None) and `retried_after`
   (a list of names, or None), in that key order: written here rather than built as four dicts and
   encoded (~7% of a cache_aware request's instructions). Scores to 6 decimals as routing_log rounds
   them; floats read back as the values repr() writes (put_double), a non-finite one as null, as
   msgspec does. `estimates` may also be their JSON object already written (bytes: cache_aware's,
   from loads_and_delays with estimate=bytes).

   explain_cache_aware(decision, mode, estimates, retried_after) -> msgspec.Raw

   explain() of a CacheAwareDecision (routing/policies.py), its fields read at their slots and its
   reason worded here as the `reason` property (the reference) words it: no reason string, no
   argument lists built in Python (~150 opcodes a request). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <string.h>
#include <limits.h>

static PyObject *s_prefill_tokens_per_s, *s_pending_prefill_tokens, *s_backlog_at, *s_backlog_tokens,
    *s_waiting, *s_decoding, *s_scraped, *s_extra, *s_at_s, *s_decode_step_scale, *s_routed,
    *s_decoding_context_tokens, *s_running_prompts, *s_replicas, *s_clock, *s_model, *s_tickets, *s_own_total,
    *s_stale_after_s, *s_decode_step_base_s, *s_decode_step_s_per_seq, *s_running_prefix;

/* obj.name, read the way LOAD_ATTR reads a slot: a field of a class with __slots__ (ReplicaLoad,
   ScrapedLoad: dataclass(slots=True)) or a msgspec Struct (EstimateLog) is a member descriptor at
   a fixed offset, found once per type (`cache`); any other type, or one whose attribute lookup is
   not the generic one, goes through PyObject_GetAttr. ~4x cheaper than the lookup a read. */
typedef struct {
    PyTypeObject *type;  /* a strong reference: the address names this type while cached */
    PyMemberDef *member;
} Field;

/* Whether obj's type reads (and, `set`, writes) `name` as a slot (then cached), else 0. */
static int is_slot(PyObject *obj, PyObject *name, Field *cache, int set) {
    PyTypeObject *type = Py_TYPE(obj);
    if (cache->type == type) return 1;
    if (type->tp_getattro != PyObject_GenericGetAttr || (set && type->tp_setattro != PyObject_GenericSetAttr))
        return 0;
    PyObject *descr = _PyType_Lookup(type, name);
    if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)
        || ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX
        || (((PyMemberDescrObject *)descr)->d_member->flags & READONLY))
        return 0;
    Py_INCREF(type);
    Py_XSETREF(cache->type, type);
    cache->member = ((PyMemberDescrObject *)descr)->d_member;
    return 1;
}

static PyObject *get_field_found(PyObject *obj, PyObject *name, Field *cache) {
    if (!is_slot(obj, name, cache, 0)) return PyObject_GetAttr(obj, name);
    PyObject *value = *(PyObject **)((char *)obj + cache->member->offset);  /* T_OBJECT_EX: set, or unset */
    if (value == NULL) return PyMember_GetOne((const char *)obj, cache->member);  /* its AttributeError */
    return Py_NewRef(value);
}

static inline PyObject *get_field(PyObject *obj, PyObject *name, Field *cache) {
    if (cache->type == Py_TYPE(obj)) {  /* the slot, read in place (most reads) */
        PyObject *value = *(PyObject **)((char *)obj + cache->member->offset);
        if (value != NULL) return Py_NewRef(value);
    }
    return get_field_found(obj, name, cache);
}

/* A number as a double, as PyFloat_AsDouble gives it (a float or an int read in place). */
static inline double as_double(PyObject *value) {
    if (PyFloat_CheckExact(value)) return PyFloat_AS_DOUBLE(value);
    if (PyLong_CheckExact(value)) return PyLong_AsDouble(value);
    return PyFloat_AsDouble(value);
}

/* obj.name = value, as STORE_ATTR: 0, or -1 with an exception set. */
static int set_field(PyObject *obj, PyObject *name, Field *cache, PyObject *value) {
    return is_slot(obj, name, cache, 1) ? PyMember_SetOne((char *)obj, cache->member, value)
                                        : PyObject_SetAttr(obj, name, value);
}

enum { F_PREFILL_RATE, F_PENDING, F_BACKLOG_AT, F_BACKLOG_TOKENS, F_WAITING, F_DECODING, F_SCRAPED, F_EXTRA, F_AT_S,
       F_STEP_SCALE, F_EST_WAITING, F_EST_PENDING, F_EST_DECODING, F_EST_IN_FLIGHT, F_EST_DELAY, F_EST_FRESH,
       F_ROUTED, F_CONTEXT, F_RUNNING, T_REPLICAS, T_CLOCK, T_MODEL, T_TICKETS, T_OWN_TOTAL, M_RATE,
       M_STALE, M_STEP_BASE, M_STEP_PER_SEQ,
       D_REPLICA, D_CANDIDATES, D_PREDICTED, D_MATCHED, D_LOADS, D_SCORES, D_ALLOWED, D_WHY, D_FACTOR, D_SHARED,
       N_FIELDS };
static Field fields[N_FIELDS];
#define GET(obj, field, name) get_field(obj, name, &fields[field])
#define SET(obj, field, name, value) set_field(obj, name, &fields[field], value)

static int read_double(PyObject *obj, PyObject *name, int field, double *out) {
    PyObject *value = GET(obj, field, name);
    if (value == NULL) return -1;
    *out = as_double(value);
    Py_DECREF(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* obj.name as a C long (an int field); -1 with an exception set on failure. */
static int read_long(PyObject *obj, PyObject *name, int field, long *out) {
    PyObject *value = GET(obj, field, name);
    if (value == NULL) return -1;
    *out = PyLong_AsLong(value);
    Py_DECREF(value);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

/* An optional float field: 0 and *present = 0 for None. */
static int read_optional(PyObject *obj, PyObject *name, int field, double *out, int *present) {
    PyObject *value = GET(obj, field, name);
    if (value == NULL) return -1;
    if (value == Py_None) {
        *present = 0;
        *out = 0.0;
        Py_DECREF(value);
        return 0;
    }
    *present = 1;
    *out = as_double(value);
    Py_DECREF(value);
    return (*out == -1.0 && PyErr_Occurred()) ? -1 : 0;
}

/* ---- JSON: the record's routing field (explain, below) and the load estimates in it ---------------- */

/* Written into `stack` (a record's field for 4 candidates is ~1 KB), then a PyMem block past it.
   BUF_INIT(b) before use; buf_free(b) after. */
#define BUF_STACK 2048
typedef struct {
    char *data;
    Py_ssize_t len, cap;
    char stack[BUF_STACK];
} Buf;

#define BUF_INIT(b) ((b)->data = (b)->stack, (b)->len = 0, (b)->cap = BUF_STACK)

static void buf_free(Buf *b) {
    if (b->data != b->stack) PyMem_Free(b->data);
}

static int buf_grow(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap;
    while (cap < b->len + more) cap *= 2;
    char *data = b->data == b->stack ? PyMem_Malloc(cap) : PyMem_Realloc(b->data, cap);
    if (data == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    if (b->data == b->stack) memcpy(data, b->stack, b->len);
    b->data = data;
    b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const char *text, Py_ssize_t n) {
    if (b->len + n > b->cap && buf_grow(b, n) < 0) return -1;
    memcpy(b->data + b->len, text, n);
    b->len += n;
    return 0;
}

#define PUT(b, literal) buf_put(b, literal, sizeof(literal) - 1)

/* Bytes a JSON string writes escaped: '"', '\\' and the control characters. */
static unsigned char escaped[256];

/* A str's text escaped for a JSON string, in quotes unless `bare` (a part of a longer string). */
static int put_text(Buf *b, PyObject *obj, int bare) {
    if (!PyUnicode_Check(obj)) {
        PyErr_SetString(PyExc_TypeError, "explain: a name or text is not a str");
        return -1;
    }
    Py_ssize_t n;
    const char *text = PyUnicode_AsUTF8AndSize(obj, &n);
    if (text == NULL || buf_grow(b, n * 6 + 2) < 0) return -1;  /* the worst case: every byte \u00XX */
    char *out = b->data + b->len;
    if (!bare) *out++ = '"';
    Py_ssize_t i = 0;
    while (i < n) {
        Py_ssize_t start = i;  /* a run that needs no escape (most names and texts: all of them), copied whole */
        while (i < n && !escaped[(unsigned char)text[i]]) i++;
        memcpy(out, text + start, i - start);
        out += i - start;
        if (i == n) break;
        unsigned char c = (unsigned char)text[i++];
        if (c == '"' || c == '\\') {
            *out++ = '\\';
            *out++ = (char)c;
            continue;
        }
        static const char hex[] = "0123456789abcdef";
        switch (c) {
        case '\n': *out++ = '\\'; *out++ = 'n'; break;
        case '\r': *out++ = '\\'; *out++ = 'r'; break;
        case '\t': *out++ = '\\'; *out++ = 't'; break;
        case '\b': *out++ = '\\'; *out++ = 'b'; break;
        case '\f': *out++ = '\\'; *out++ = 'f'; break;
        default:
            memcpy(out, "\\u00", 4);
            out += 4;
            *out++ = hex[c >> 4];
            *out++ = hex[c & 15];
        }
    }
    if (!bare) *out++ = '"';
    b->len = out - b->data;
    return 0;
}

#define put_str(b, obj) put_text(b, obj, 0)

/* A non-negative integer's digits, at least `min_digits` of them (zeros in front); two at a time
   from a table (a record's numbers are mostly one or two digits). */
static const char digit_pairs[201] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

static int put_digits(Buf *b, unsigned long long value, int min_digits) {
    if (value < 10 && min_digits <= 1) {
        if (buf_grow(b, 1) < 0) return -1;
        b->data[b->len++] = (char)('0' + value);
        return 0;
    }
    char digits[24];
    int at = 24;
    while (value >= 100) {
        unsigned pair = (unsigned)(value % 100) * 2;
        value /= 100;
        digits[--at] = digit_pairs[pair + 1];
        digits[--at] = digit_pairs[pair];
    }
    if (value >= 10) {
        digits[--at] = digit_pairs[value * 2 + 1];
        digits[--at] = digit_pairs[value * 2];
    } else {
        digits[--at] = (char)('0' + value);
    }
    while (24 - at < min_digits) digits[--at] = '0';
    return buf_put(b, digits + at, 24 - at);
}

static int put_long(Buf *b, long long value) {
    if (value < 0 && PUT(b, "-") < 0) return -1;
    return put_digits(b, value < 0 ? 0ULL - (unsigned long long)value : (unsigned long long)value, 1);
}

/* A float as JSON: the value repr() gives, not always its text (1.5e-05 as 0.000015). A value on
   the microsecond grid (scores to 6 decimals, delays in ms to the microsecond: most of a record's
   floats) is written from its integer count of millionths: ~20x cheaper than repr's dtoa. Such a
   decimal, with at most 15 significant digits, is the only one that short for its double, so it
   reads back as the same value. Others go through repr. */
static int put_double(Buf *b, double value) {
    if (!isfinite(value)) return PUT(b, "null");
    double millionths = nearbyint(value * 1e6);
    if (fabs(value) < 1e9 && millionths / 1e6 == value) {
        long long count = (long long)millionths;
        unsigned long long magnitude = count < 0 ? 0ULL - (unsigned long long)count : (unsigned long long)count;
        if (count < 0 && PUT(b, "-") < 0) return -1;
        if (put_digits(b, magnitude / 1000000, 1) < 0 || PUT(b, ".") < 0) return -1;
        unsigned long long fraction = magnitude % 1000000;
        int width = 6;
        while (width > 1 && fraction % 10 == 0) {
            fraction /= 10;
            width--;
        }
        return put_digits(b, fraction, width);
    }
    char *text = PyOS_double_to_string(value, 'r', 0, Py_DTSF_ADD_DOT_0, NULL);
    if (text == NULL) return -1;
    int rc = buf_put(b, text, (Py_ssize_t)strlen(text));
    PyMem_Free(text);
    return rc;
}

/* An int, float, bool or None as JSON (`round6`: a float to 6 decimals, as routing_log rounds scores). */
static int put_number(Buf *b, PyObject *obj, int round6) {
    if (obj == Py_None) return PUT(b, "null");
    if (obj == Py_True) return PUT(b, "true");
    if (obj == Py_False) return PUT(b, "false");
    if (PyLong_Check(obj)) {
        int overflow;
        long long value = PyLong_AsLongLongAndOverflow(obj, &overflow);
        if (value == -1 && PyErr_Occurred()) return -1;
        if (!overflow) return put_long(b, value);
        PyObject *text = PyObject_Str(obj);
        if (text == NULL) return -1;
        Py_ssize_t n;
        const char *utf8 = PyUnicode_AsUTF8AndSize(text, &n);
        int rc = utf8 == NULL ? -1 : buf_put(b, utf8, n);
        Py_DECREF(text);
        return rc;
    }
    double value = as_double(obj);
    if (value == -1.0 && PyErr_Occurred()) return -1;
    if (round6 && isfinite(value)) value = nearbyint(value * 1e6) / 1e6;
    return put_double(b, value);
}

/* {"name": value, ...} from two aligned sequences. */
static int put_object(Buf *b, PyObject *names, PyObject *values, int round6) {
    PyObject *keys = PySequence_Fast(names, "explain: names must be a sequence");
    if (keys == NULL) return -1;
    PyObject *vals = PySequence_Fast(values, "explain: values must be a sequence");
    if (vals == NULL) {
        Py_DECREF(keys);
        return -1;
    }
    int rc = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(keys);
    if (PySequence_Fast_GET_SIZE(vals) != n) {
        PyErr_SetString(PyExc_ValueError, "explain: names and values differ in length");
        goto done;
    }
    if (PUT(b, "{") < 0) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        if ((i && PUT(b, ",") < 0) || put_str(b, PySequence_Fast_GET_ITEM(keys, i)) < 0 || PUT(b, ":") < 0
            || put_number(b, PySequence_Fast_GET_ITEM(vals, i), round6) < 0)
            goto done;
    }
    rc = PUT(b, "}");
done:
    Py_DECREF(keys);
    Py_DECREF(vals);
    return rc;
}

static int put_names(Buf *b, PyObject *names) {
    PyObject *items = PySequence_Fast(names, "explain: names must be a sequence");
    if (items == NULL) return -1;
    int rc = PUT(b, "[");
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    for (Py_ssize_t i = 0; i < n && rc == 0; i++)
        rc = ((i && PUT(b, ",") < 0) || put_str(b, PySequence_Fast_GET_ITEM(items, i)) < 0) ? -1 : 0;
    Py_DECREF(items);
    return rc < 0 ? -1 : PUT(b, "]");
}

/* estimate(waiting, pending_prefill_tokens, decoding, int(in_flight), ms(delay), scraped fresh):
   the record's view of one candidate (routing/load.py EstimateLog), as the Python loop makes it.
   ms() is round(seconds * 1e6) / 1000: nearbyint rounds half to even as round() does. */
static int estimate_record(PyObject *load, PyObject *scraped, double fresh_after_s, PyObject *estimate,
                           long in_flight, double delay, PyObject **out) {
    double at_s;
    if (read_double(scraped, s_at_s, F_AT_S, &at_s) < 0) return -1;
    PyObject *args[6] = {GET(load, F_WAITING, s_waiting), GET(load, F_PENDING, s_pending_prefill_tokens),
                         GET(load, F_DECODING, s_decoding), PyLong_FromLong(in_flight),
                         PyFloat_FromDouble(nearbyint(delay * 1e6) / 1000.0), NULL};
    args[5] = at_s >= fresh_after_s ? Py_True : Py_False;
    Py_INCREF(args[5]);
    *out = NULL;
    int ok = 1;
    for (int i = 0; i < 6; i++) ok = ok && args[i] != NULL;
    if (ok) *out = PyObject_Vectorcall(estimate, args, 6, NULL);
    for (int i = 0; i < 6; i++) Py_XDECREF(args[i]);
    return *out == NULL ? -1 : 0;
}

/* The same estimate written as `"name":{...}`, EstimateLog's JSON object (its fields in order, its
   numbers as put_estimate writes the record's): the request record's load_estimate entry, written
   with the decision instead of made as an object and written later. */
static int estimate_json(Buf *b, PyObject *name, PyObject *load, PyObject *scraped, double fresh_after_s,
                         long in_flight, double delay) {
    double at_s;
    if (read_double(scraped, s_at_s, F_AT_S, &at_s) < 0) return -1;
    PyObject *values[3] = {GET(load, F_WAITING, s_waiting), GET(load, F_PENDING, s_pending_prefill_tokens),
                           GET(load, F_DECODING, s_decoding)};
    int rc = values[0] && values[1] && values[2] && put_str(b, name) == 0 && PUT(b, ":{\"waiting\":") == 0
             && put_number(b, values[0], 0) == 0 && PUT(b, ",\"pending_prefill_tokens\":") == 0
             && put_number(b, values[1], 0) == 0 && PUT(b, ",\"decoding\":") == 0 && put_number(b, values[2], 0) == 0
             && PUT(b, ",\"in_flight\":") == 0 && put_long(b, in_flight) == 0 && PUT(b, ",\"queue_delay_ms\":") == 0
             && put_double(b, nearbyint(delay * 1e6) / 1000.0) == 0
             && (at_s >= fresh_after_s ? PUT(b, ",\"scraped_fresh\":true}") : PUT(b, ",\"scraped_fresh\":false}")) == 0
             ? 0 : -1;
    for (int i = 0; i < 3; i++) Py_XDECREF(values[i]);
    return rc;
}

/* One candidate's (in_flight, delay), and its estimate: a record (`estimate`, the EstimateLog type)
   or its JSON entry appended to `json` (named `name`), or neither. */
static int one(PyObject *load, double now, double stale_after_s, double configured_rate, double step_base_s,
               double step_per_seq_s, PyObject *estimate, Buf *json, PyObject *name, PyObject **in_flight_out,
               double *delay_out, PyObject **estimate_out) {
    double tokens_per_s, own_rate;
    int has_rate;
    if (read_optional(load, s_prefill_tokens_per_s, F_PREFILL_RATE, &own_rate, &has_rate) < 0) return -1;
    tokens_per_s = (has_rate && own_rate != 0.0) ? own_rate : configured_rate;  /* `rate or configured` */
    double pending;
    if (read_double(load, s_pending_prefill_tokens, F_PENDING, &pending) < 0) return -1;
    if (pending != 0.0) {
        double backlog_at, backlog_tokens;
        if (read_double(load, s_backlog_at, F_BACKLOG_AT, &backlog_at) < 0
            || read_double(load, s_backlog_tokens, F_BACKLOG_TOKENS, &backlog_tokens) < 0)
            return -1;
        double elapsed = now - backlog_at;
        double left = elapsed > 0 ? backlog_tokens - elapsed * tokens_per_s : backlog_tokens;
        if (left < pending) pending = left > 0.0 ? left : 0.0;
    }
    long waiting, running;
    if (read_long(load, s_waiting, F_WAITING, &waiting) < 0 || read_long(load, s_decoding, F_DECODING, &running) < 0)
        return -1;
    long in_flight = waiting + running;
    int as_float = 0;
    double in_flight_f = 0.0;
    PyObject *scraped = GET(load, F_SCRAPED, s_scraped);
    if (scraped == NULL) return -1;
    PyObject *extra = GET(scraped, F_EXTRA, s_extra);
    if (extra == NULL) {
        Py_DECREF(scraped);
        return -1;
    }
    if (!PyTuple_Check(extra) || PyTuple_GET_SIZE(extra) != 2) {
        Py_DECREF(extra);
        Py_DECREF(scraped);
        PyErr_SetString(PyExc_TypeError, "ScrapedLoad.extra must be a (waiting, running) tuple");
        return -1;
    }
    double extra_waiting = as_double(PyTuple_GET_ITEM(extra, 0));
    double extra_running = as_double(PyTuple_GET_ITEM(extra, 1));
    Py_DECREF(extra);
    if (PyErr_Occurred()) {
        Py_DECREF(scraped);
        return -1;
    }
    if (extra_waiting != 0.0 || extra_running != 0.0) {
        double at_s;
        int failed = read_double(scraped, s_at_s, F_AT_S, &at_s);
        if (failed < 0) {
            Py_DECREF(scraped);
            return -1;
        }
        if (now - at_s <= stale_after_s) {
            /* Traffic we did not route: its waiting requests as long as ours on average. */
            in_flight_f = (double)in_flight + (extra_waiting + extra_running);
            as_float = 1;
            if (extra_waiting != 0.0)
                pending += extra_waiting * (waiting ? pending / (double)waiting : 512.0);
            running += (long)extra_running;
        }
    }
    double scale;
    int has_scale;
    if (read_optional(load, s_decode_step_scale, F_STEP_SCALE, &scale, &has_scale) < 0) {
        Py_DECREF(scraped);
        return -1;
    }
    double steps = running ? (step_base_s + step_per_seq_s * (double)running) * (has_scale ? scale : 1.0) : 0.0;
    *delay_out = pending / tokens_per_s + steps;
    *in_flight_out = as_float ? PyFloat_FromDouble(in_flight_f) : PyLong_FromLong(in_flight);
    if (*in_flight_out == NULL) {
        Py_DECREF(scraped);
        return -1;
    }
    long logged = as_float ? (long)in_flight_f : in_flight;
    if ((estimate != NULL
         && estimate_record(load, scraped, now - stale_after_s, estimate, logged, *delay_out, estimate_out) < 0)
        || (json != NULL && estimate_json(json, name, load, scraped, now - stale_after_s, logged, *delay_out) < 0)) {
        Py_DECREF(scraped);
        Py_CLEAR(*in_flight_out);
        return -1;
    }
    Py_DECREF(scraped);
    return 0;
}

/* The tracker's model's terms: params[1..4] = stale_after_s, prefill_tokens_per_s, decode_step_base_s,
   decode_step_s_per_seq (params[0] is `now`). */
static int model_params(PyObject *tracker, double *params) {
    PyObject *model = GET(tracker, T_MODEL, s_model);
    if (model == NULL) return -1;
    int rc = read_double(model, s_stale_after_s, M_STALE, &params[1]) < 0
             || read_double(model, s_prefill_tokens_per_s, M_RATE, &params[2]) < 0
             || read_double(model, s_decode_step_base_s, M_STEP_BASE, &params[3]) < 0
             || read_double(model, s_decode_step_s_per_seq, M_STEP_PER_SEQ, &params[4]) < 0 ? -1 : 0;
    Py_DECREF(model);
    return rc;
}

static PyObject *loads_and_delays(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 && nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "loads_and_delays(tracker, names, now[, estimate])");
        return NULL;
    }
    double params[5];
    params[0] = as_double(args[2]);
    if ((params[0] == -1.0 && PyErr_Occurred()) || model_params(args[0], params) < 0) return NULL;
    PyObject *replicas = GET(args[0], T_REPLICAS, s_replicas);
    if (replicas == NULL) return NULL;
    if (!PyDict_Check(replicas)) {
        Py_DECREF(replicas);
        PyErr_SetString(PyExc_TypeError, "loads_and_delays: the tracker's replicas must be a dict");
        return NULL;
    }
    PyObject *estimate = nargs == 4 && args[3] != Py_None ? args[3] : NULL;
    Buf json, *as_json = NULL;
    BUF_INIT(&json);
    if (estimate == (PyObject *)&PyBytes_Type) {  /* the estimates as the record's JSON object */
        estimate = NULL;
        as_json = &json;
    }
    PyObject *names = PySequence_Fast(args[1], "names must be a sequence");
    if (names == NULL) {
        Py_DECREF(replicas);
        return NULL;
    }
    Py_ssize_t n = PySequence_Fast_GET_SIZE(names);
    PyObject **items = PySequence_Fast_ITEMS(names);
    PyObject *loads = PyList_New(n), *delays = PyList_New(n), *estimates = estimate ? PyList_New(n) : NULL;
    PyObject *out = NULL;
    if (loads == NULL || delays == NULL || (estimate && estimates == NULL) || (as_json && PUT(as_json, "{") < 0))
        goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *load = PyDict_GetItemWithError(replicas, items[i]);  /* borrowed */
        if (load == NULL) {
            if (!PyErr_Occurred()) out = Py_NewRef(Py_None);  /* not tracked yet: the Python loop adds it */
            goto done;
        }
        PyObject *in_flight, *record = NULL;
        double delay;
        if ((as_json && i && PUT(as_json, ",") < 0)
            || one(load, params[0], params[1], params[2], params[3], params[4], estimate, as_json, items[i],
                   &in_flight, &delay, &record) < 0)
            goto done;
        PyList_SET_ITEM(loads, i, in_flight);
        if (estimates) PyList_SET_ITEM(estimates, i, record);
        PyObject *d = PyFloat_FromDouble(delay);
        if (d == NULL) goto done;
        PyList_SET_ITEM(delays, i, d);
    }
    if (as_json) {
        PyObject *written = PUT(as_json, "}") < 0 ? NULL : PyBytes_FromStringAndSize(json.data, json.len);
        if (written == NULL) goto done;
        out = PyTuple_Pack(3, loads, delays, written);
        Py_DECREF(written);
    } else {
        out = estimates ? PyTuple_Pack(3, loads, delays, estimates) : PyTuple_Pack(2, loads, delays);
    }
done:
    buf_free(&json);
    Py_DECREF(replicas);
    Py_DECREF(names);
    Py_XDECREF(loads);
    Py_XDECREF(delays);
    Py_XDECREF(estimates);
    return out;
}

/* ---- the tracker's accounting: LoadTracker.on_routed, on_first_token, on_finished --------------

   routed(tracker, replica, prompt_tokens, cached_tokens, block_hashes) -> ticket | None
   first_token(tracker, replica, prompt_tokens, cached_tokens) -> True | None
   finished(tracker, replica, prompt_tokens, cached_tokens, started_decoding, ticket) -> True | None

   The steps of routing/load.py's Python lines (the reference; tests compare the two), on the
   ReplicaLoad's slots: the same ints (counts stay ints), the same doubles for the backlog, the
   clock's own value stored as backlog_at. None: the replica has no ReplicaLoad yet (the Python
   lines make one). Every request makes each call once: ~230 Python opcodes a request, most of
   them attribute reads and writes. */

static int store_long(PyObject *obj, int field, PyObject *name, long long value) {
    PyObject *number = PyLong_FromLongLong(value);
    if (number == NULL) return -1;
    int rc = SET(obj, field, name, number);
    Py_DECREF(number);
    return rc;
}

static int store_float(PyObject *obj, int field, PyObject *name, double value) {
    PyObject *number = PyFloat_FromDouble(value);
    if (number == NULL) return -1;
    int rc = SET(obj, field, name, number);
    Py_DECREF(number);
    return rc;
}

static int add_long(PyObject *obj, int field, PyObject *name, long long delta) {
    long value;
    if (read_long(obj, name, field, &value) < 0) return -1;
    return store_long(obj, field, name, (long long)value + delta);
}

/* The replica's ReplicaLoad (a new reference), or NULL: none (no exception) or an error. */
static PyObject *load_of(PyObject *tracker, PyObject *replica) {
    PyObject *replicas = GET(tracker, T_REPLICAS, s_replicas);
    if (replicas == NULL) return NULL;
    PyObject *load = NULL;
    if (PyDict_Check(replicas))
        load = Py_XNewRef(PyDict_GetItemWithError(replicas, replica));
    else
        PyErr_SetString(PyExc_TypeError, "tracker.replicas must be a dict");
    Py_DECREF(replicas);
    return load;
}

/* LoadTracker._drain: what the replica prefilled since backlog_at, at its rate (else the model's),
   taken off the backlog, never below 0. */
static int drain(PyObject *tracker, PyObject *load) {
    PyObject *clock = GET(tracker, T_CLOCK, s_clock);
    if (clock == NULL) return -1;
    PyObject *now_obj = PyObject_CallNoArgs(clock);
    Py_DECREF(clock);
    if (now_obj == NULL) return -1;
    int rc = -1;
    double now = as_double(now_obj), at, backlog, rate;
    int has_rate;
    if ((now == -1.0 && PyErr_Occurred()) || read_double(load, s_backlog_at, F_BACKLOG_AT, &at) < 0) goto done;
    if (!(now > at)) {
        rc = 0;
        goto done;
    }
    if (read_double(load, s_backlog_tokens, F_BACKLOG_TOKENS, &backlog) < 0
        || read_optional(load, s_prefill_tokens_per_s, F_PREFILL_RATE, &rate, &has_rate) < 0)
        goto done;
    if (!has_rate || rate == 0.0) {  /* `load's rate or the model's` */
        PyObject *model = GET(tracker, T_MODEL, s_model);
        if (model == NULL) goto done;
        int failed = read_double(model, s_prefill_tokens_per_s, M_RATE, &rate);
        Py_DECREF(model);
        if (failed < 0) goto done;
    }
    double left = backlog - (now - at) * rate;
    if (store_float(load, F_BACKLOG_TOKENS, s_backlog_tokens, left > 0.0 ? left : 0.0) < 0
        || SET(load, F_BACKLOG_AT, s_backlog_at, now_obj) < 0)
        goto done;
    rc = 0;
done:
    Py_DECREF(now_obj);
    return rc;
}

static int read_tokens(PyObject *const *args, long long *prompt, long long *cached) {
    *prompt = PyLong_AsLongLong(args[0]);
    *cached = PyLong_AsLongLong(args[1]);
    return PyErr_Occurred() ? -1 : 0;
}

static PyObject *routed(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "routed(tracker, replica, prompt_tokens, cached_tokens, block_hashes)");
        return NULL;
    }
    PyObject *tracker = args[0];
    long long prompt, cached;
    if (read_tokens(args + 2, &prompt, &cached) < 0) return NULL;
    PyObject *load = load_of(tracker, args[1]);
    if (load == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *ticket = NULL, *tickets = NULL;
    long long uncached = prompt > cached ? prompt - cached : 0;
    double backlog;
    if (add_long(load, F_WAITING, s_waiting, 1) < 0 || add_long(load, F_ROUTED, s_routed, 1) < 0
        || add_long(tracker, T_OWN_TOTAL, s_own_total, 1) < 0
        || add_long(load, F_PENDING, s_pending_prefill_tokens, uncached) < 0 || drain(tracker, load) < 0
        || read_double(load, s_backlog_tokens, F_BACKLOG_TOKENS, &backlog) < 0
        || store_float(load, F_BACKLOG_TOKENS, s_backlog_tokens, backlog + (double)uncached) < 0)
        goto done;
    tickets = GET(tracker, T_TICKETS, s_tickets);
    if (tickets == NULL) goto done;
    ticket = PyIter_Next(tickets);
    if (ticket == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "the tracker's tickets ran out");
        goto done;
    }
    Py_ssize_t blocks = PyObject_Length(args[4]);
    if (blocks < 0) {
        Py_CLEAR(ticket);
        goto done;
    }
    if (blocks) {  /* remembered while it runs (running_prefix) */
        PyObject *running = GET(load, F_RUNNING, s_running_prompts);
        int rc = running == NULL ? -1 : PyObject_SetItem(running, ticket, args[4]);
        Py_XDECREF(running);
        if (rc < 0) Py_CLEAR(ticket);
    }
done:
    Py_XDECREF(tickets);
    Py_DECREF(load);
    return ticket;
}

/* on_first_token's steps on a load the caller holds: 0, or -1 with an exception set. */
static int first_token_of(PyObject *tracker, PyObject *load, long long prompt, long long cached) {
    long waiting, pending;
    if (read_long(load, s_waiting, F_WAITING, &waiting) < 0) return -1;
    if (waiting ? store_long(load, F_WAITING, s_waiting, (long long)waiting - 1)
                : add_long(tracker, T_OWN_TOTAL, s_own_total, 1))  /* decoding, never counted as waiting */
        return -1;
    if (prompt > cached) {
        if (read_long(load, s_pending_prefill_tokens, F_PENDING, &pending) < 0) return -1;
        long long left = (long long)pending - (prompt - cached);
        if (store_long(load, F_PENDING, s_pending_prefill_tokens, left > 0 ? left : 0) < 0) return -1;
    }
    if (drain(tracker, load) < 0) return -1;
    double backlog;
    PyObject *pending_obj = GET(load, F_PENDING, s_pending_prefill_tokens);
    if (pending_obj == NULL) return -1;
    double pending_d = as_double(pending_obj);
    int rc = -1;
    if ((pending_d == -1.0 && PyErr_Occurred()) || read_double(load, s_backlog_tokens, F_BACKLOG_TOKENS, &backlog) < 0)
        goto done;
    if (backlog > pending_d && SET(load, F_BACKLOG_TOKENS, s_backlog_tokens, pending_obj) < 0) goto done;
    if (add_long(load, F_DECODING, s_decoding, 1) < 0
        || add_long(load, F_CONTEXT, s_decoding_context_tokens, prompt) < 0)
        goto done;
    rc = 0;
done:
    Py_DECREF(pending_obj);
    return rc;
}

static PyObject *first_token(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "first_token(tracker, replica, prompt_tokens, cached_tokens)");
        return NULL;
    }
    long long prompt, cached;
    if (read_tokens(args + 2, &prompt, &cached) < 0) return NULL;
    PyObject *load = load_of(args[0], args[1]);
    if (load == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    int rc = first_token_of(args[0], load, prompt, cached);
    Py_DECREF(load);
    return rc < 0 ? NULL : Py_NewRef(Py_True);
}

static PyObject *finished(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "finished(tracker, replica, prompt_tokens, cached_tokens, "
                                         "started_decoding, ticket)");
        return NULL;
    }
    PyObject *tracker = args[0], *ticket = args[5];
    long long prompt, cached;
    if (read_tokens(args + 2, &prompt, &cached) < 0) return NULL;
    int started = PyObject_IsTrue(args[4]);
    if (started < 0) return NULL;
    PyObject *load = load_of(tracker, args[1]);
    if (load == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    PyObject *out = NULL;
    long decoding, context;
    if (!started && first_token_of(tracker, load, prompt, cached) < 0) goto done;
    if (read_long(load, s_decoding, F_DECODING, &decoding) < 0) goto done;
    if (decoding && (store_long(load, F_DECODING, s_decoding, (long long)decoding - 1) < 0
                     || add_long(tracker, T_OWN_TOTAL, s_own_total, -1) < 0))
        goto done;
    if (read_long(load, s_decoding_context_tokens, F_CONTEXT, &context) < 0) goto done;
    long long left = (long long)context - prompt;
    if (store_long(load, F_CONTEXT, s_decoding_context_tokens, left > 0 ? left : 0) < 0) goto done;
    if (ticket != Py_None) {  /* running_prompts.pop(ticket, None): a dict's item deleted, none there is no error */
        PyObject *running = GET(load, F_RUNNING, s_running_prompts);
        if (running == NULL) goto done;
        int rc = PyDict_Check(running) ? PyDict_DelItem(running, ticket) : PyObject_DelItem(running, ticket);
        Py_DECREF(running);
        if (rc < 0) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
            PyErr_Clear();
        }
    }
    out = Py_NewRef(Py_True);
done:
    Py_DECREF(load);
    return out;
}

/* The score of candidate i, as cache_aware's comprehension computes it:
   per_token_s * (prompt_tokens - blocks * block if blocks >= min_match else prompt_tokens)
   + queue_weight * delay, the uncached count in integers, then the same two products and sum. */
typedef struct {
    long long prompt_tokens, block, min_match;
    double per_token_s, queue_weight;
} ScoreParams;

static double score_of(const ScoreParams *p, long long blocks, double delay) {
    long long uncached = blocks >= p->min_match ? p->prompt_tokens - blocks * p->block : p->prompt_tokens;
    return p->per_token_s * (double)uncached + p->queue_weight * delay;
}

static int read_score_params(PyObject *const *args, ScoreParams *p) {
    p->prompt_tokens = PyLong_AsLongLong(args[0]);
    p->block = PyLong_AsLongLong(args[1]);
    p->min_match = PyLong_AsLongLong(args[2]);
    p->per_token_s = as_double(args[3]);
    p->queue_weight = as_double(args[4]);
    return PyErr_Occurred() ? -1 : 0;
}

/* The scores of n candidates from their matched blocks (ints) and queueing delays (floats), as a new
   list, with the matches and scores into `matched_out` and `score_out` (n long); NULL with an
   exception set on failure, or when there are not n of each. */
static PyObject *scored(PyObject *matched_seq, PyObject *delays_seq, const ScoreParams *p, Py_ssize_t n,
                        long long *matched_out, double *score_out) {
    PyObject *matched = PySequence_Fast(matched_seq, "matched must be a sequence");
    if (matched == NULL) return NULL;
    PyObject *delays = PySequence_Fast(delays_seq, "delays must be a sequence");
    if (delays == NULL) {
        Py_DECREF(matched);
        return NULL;
    }
    PyObject *out = NULL;
    if (PySequence_Fast_GET_SIZE(matched) != n || PySequence_Fast_GET_SIZE(delays) != n) {
        PyErr_SetString(PyExc_ValueError, "decide: matched or delays not one a candidate");
        goto done;
    }
    out = PyList_New(n);
    if (out == NULL) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long blocks = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(matched, i));
        double delay = as_double(PySequence_Fast_GET_ITEM(delays, i));
        if (PyErr_Occurred()) {
            Py_CLEAR(out);
            goto done;
        }
        double value = score_of(p, blocks, delay);
        matched_out[i] = blocks;
        score_out[i] = value;
        PyObject *score = PyFloat_FromDouble(value);
        if (score == NULL) {
            Py_CLEAR(out);
            goto done;
        }
        PyList_SET_ITEM(out, i, score);
    }
done:
    Py_DECREF(matched);
    Py_DECREF(delays);
    return out;
}

/* decide(matched, loads, delays, prompt_tokens, block, min_match, prefill_weight, queue_weight, tracker,
          balance_factor, balance_slack, follow_slack, follow_abs_slack, candidates, hashes, name_hash)
          -> (chosen, why, scores, allowed, tied, holding)

   cache_aware's choice once the matches and the loads are known (routing/policies.py
   CacheAware.choose, its Python lines the reference, the same doubles in the same order): the
   scores (a prefill token weighs prefill_weight / the tracker's prefill_rate of the first candidate;
   the candidates serve one model), the balance guard (the load's sum here, `tracker.running_prefix(
   name, hashes, depth)` asked only where
   the guard binds, in the same order), the best score among the allowed, and of a tie the
   least-loaded step and, where every tied candidate holds the whole prompt, the rendezvous hash of
   its last block (`name_hash`: name -> the policy's 32-bit hash of it). `allowed` is None when the
   guard allows every candidate, else the list of their indices. `tied` is None when the choice is
   made; else the tied indices left after the load step, for the Python steps that follow (the
   caches' fill and turnover, turns for a prompt shorter than a block, a name not hashed yet), and
   `holding` says whether every tied candidate held the whole prompt. */
#define MIX32 0x9E3779B1ULL
#define MASK32 0xFFFFFFFFULL
#define SMALL 64

/* tracker.prefill_rate(name) (routing/load.py): the replica's learned rate where it has one (not 0),
   else the model's. */
static int prefill_rate_of(PyObject *tracker, PyObject *name, double *rate) {
    PyObject *replicas = GET(tracker, T_REPLICAS, s_replicas);
    if (replicas == NULL) return -1;
    PyObject *load = PyDict_Check(replicas) ? PyDict_GetItemWithError(replicas, name) : NULL;  /* borrowed */
    int present = 0, rc = 0;
    *rate = 0.0;
    if (load != NULL) rc = read_optional(load, s_prefill_tokens_per_s, F_PREFILL_RATE, rate, &present);
    else if (PyErr_Occurred() || !PyDict_Check(replicas)) rc = -1;
    Py_DECREF(replicas);
    if (rc < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "decide: the tracker's replicas must be a dict");
        return -1;
    }
    if (present && *rate != 0.0) return 0;
    PyObject *model = GET(tracker, T_MODEL, s_model);
    if (model == NULL) return -1;
    rc = read_double(model, s_prefill_tokens_per_s, M_RATE, rate);
    Py_DECREF(model);
    return rc;
}

/* The tie's cache steps, CacheAware._by_cache and turnover (routing/policies.py, the reference):
   the same comparisons on the same doubles. Constants: set_tie_constants(), called once by
   routing/policies.py with its own. */
static double fill_tolerance_prompts = -1, fill_spread_below = -1, rebase_halvings = -1;
static PyObject *s__index, *s__capacities, *s__counts, *s__new_blocks, *s__turnover_origin,
    *s_turnover_half_life_s, *s__turn;

static PyObject *set_tie_constants(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "set_tie_constants(fill_tolerance_prompts, fill_spread_below, "
                                         "rebase_halvings)");
        return NULL;
    }
    double values[3];
    for (int i = 0; i < 3; i++) {
        values[i] = PyFloat_AsDouble(args[i]);
        if (values[i] == -1.0 && PyErr_Occurred()) return NULL;
    }
    fill_tolerance_prompts = values[0];
    fill_spread_below = values[1];
    rebase_halvings = values[2];
    Py_RETURN_NONE;
}

/* A table's counts (PrefixTable._counts, int64 [2][columns]: blocks held, blocks written), its
   _index and _capacities dicts. 0: not that shape (the Python steps then run). */
typedef struct {
    Py_buffer view;
    PyObject *index, *capacities;
    const long long *sizes, *written;
    Py_ssize_t columns;
} TableView;

static void table_view_release(TableView *t) {
    if (t->view.obj != NULL) PyBuffer_Release(&t->view);
    Py_CLEAR(t->index);
    Py_CLEAR(t->capacities);
}

static int table_view(PyObject *table, TableView *t) {
    memset(t, 0, sizeof(*t));
    PyObject *counts = PyObject_GetAttr(table, s__counts);
    if (counts == NULL) return -1;
    int rc = PyObject_GetBuffer(counts, &t->view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT);
    Py_DECREF(counts);
    if (rc < 0) {
        PyErr_Clear();
        return 0;
    }
    if (t->view.ndim != 2 || t->view.itemsize != 8 || t->view.shape[0] != 2 || t->view.format == NULL
        || (strcmp(t->view.format, "l") && strcmp(t->view.format, "q") && strcmp(t->view.format, "<q")
            && strcmp(t->view.format, "<l") && strcmp(t->view.format, "=q"))) {
        return 0;
    }
    t->columns = t->view.shape[1];
    t->sizes = (const long long *)t->view.buf;
    t->written = t->sizes + t->columns;
    if ((t->index = PyObject_GetAttr(table, s__index)) == NULL) return -1;
    if ((t->capacities = PyObject_GetAttr(table, s__capacities)) == NULL) return -1;
    return PyDict_Check(t->index) && PyDict_Check(t->capacities);
}

/* name's column in the table and its capacity. 0: not known there, or not ints (Python's steps
   raise what they raise). */
static int column_of(TableView *t, PyObject *name, Py_ssize_t *column, long long *capacity) {
    PyObject *bit = PyDict_GetItemWithError(t->index, name);
    if (bit == NULL) return PyErr_Occurred() ? -1 : 0;
    PyObject *cap = PyDict_GetItemWithError(t->capacities, name);
    if (cap == NULL) return PyErr_Occurred() ? -1 : 0;
    if (!PyLong_CheckExact(bit) || !PyLong_CheckExact(cap)) return 0;
    *column = PyLong_AsSsize_t(bit);
    *capacity = PyLong_AsLongLong(cap);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    return *column >= 0 && *column < t->columns && *capacity > 0;
}

/* turnover()'s pass over every replica of the table: the policy's _new_blocks brought up to date
   at `now` (rebased past rebase_halvings). 0: a state not of the reference's shape. */
static int turnover_update(TableView *t, PyObject *policy, double now) {
    PyObject *seen = PyObject_GetAttr(policy, s__new_blocks), *origin_obj = NULL, *half_obj = NULL;
    int rc = -1;
    if (seen == NULL) return -1;
    if (!PyDict_Check(seen)) {
        rc = 0;
        goto out;
    }
    if ((origin_obj = PyObject_GetAttr(policy, s__turnover_origin)) == NULL) goto out;
    if ((half_obj = PyObject_GetAttr(policy, s_turnover_half_life_s)) == NULL) goto out;
    double half_life = PyFloat_AsDouble(half_obj), origin;
    if (half_life == -1.0 && PyErr_Occurred()) goto out;
    if (origin_obj == Py_None) {
        PyObject *value = PyFloat_FromDouble(now);
        if (value == NULL || PyObject_SetAttr(policy, s__turnover_origin, value) < 0) {
            Py_XDECREF(value);
            goto out;
        }
        Py_DECREF(value);
        origin = now;
    } else {
        origin = PyFloat_AsDouble(origin_obj);
        if (origin == -1.0 && PyErr_Occurred()) goto out;
    }
    double halvings = (now - origin) / half_life;
    Py_ssize_t pos = 0;
    PyObject *key, *entry;
    if (halvings > rebase_halvings) {  /* the sums start again from now */
        double scale = halvings < 1000 ? pow(2.0, -halvings) : 0.0;
        while (PyDict_Next(seen, &pos, &key, &entry)) {
            if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 2) {
                rc = 0;
                goto out;
            }
            double sum = PyFloat_AsDouble(PyList_GET_ITEM(entry, 1));
            if (sum == -1.0 && PyErr_Occurred()) goto out;
            PyObject *value = PyFloat_FromDouble(sum * scale);
            if (value == NULL) goto out;
            PyList_SetItem(entry, 1, value);  /* steals value */
        }
        PyObject *value = PyFloat_FromDouble(now);
        if (value == NULL || PyObject_SetAttr(policy, s__turnover_origin, value) < 0) {
            Py_XDECREF(value);
            goto out;
        }
        Py_DECREF(value);
        halvings = 0.0;
    }
    double weight = pow(2.0, halvings);
    pos = 0;
    PyObject *bit;
    while (PyDict_Next(t->index, &pos, &key, &bit)) {
        Py_ssize_t column = PyLong_AsSsize_t(bit);
        if (column == -1 && PyErr_Occurred()) goto out;
        if (column < 0 || column >= t->columns) {
            rc = 0;
            goto out;
        }
        long long written = t->written[column];
        entry = PyDict_GetItemWithError(seen, key);
        if (entry == NULL) {
            if (PyErr_Occurred()) goto out;
            PyObject *fresh = Py_BuildValue("[Ld]", written, (double)written * weight);
            if (fresh == NULL) goto out;
            int failed = PyDict_SetItem(seen, key, fresh);
            Py_DECREF(fresh);
            if (failed) goto out;
            continue;
        }
        if (!PyList_CheckExact(entry) || PyList_GET_SIZE(entry) != 2 || !PyLong_CheckExact(PyList_GET_ITEM(entry, 0))) {
            rc = 0;
            goto out;
        }
        long long before = PyLong_AsLongLong(PyList_GET_ITEM(entry, 0));
        if (before == -1 && PyErr_Occurred()) goto out;
        if (written == before) continue;
        double sum = PyFloat_AsDouble(PyList_GET_ITEM(entry, 1));
        if (sum == -1.0 && PyErr_Occurred()) goto out;
        /* re-added (the count went back): what it holds counts anew */
        PyObject *value = PyFloat_FromDouble(sum + (double)(written > before ? written - before : written) * weight);
        if (value == NULL) goto out;
        PyList_SetItem(entry, 1, value);
        if ((value = PyLong_FromLongLong(written)) == NULL) goto out;
        PyList_SetItem(entry, 0, value);
    }
    rc = 1;
out:
    Py_DECREF(seen);
    Py_XDECREF(origin_obj);
    Py_XDECREF(half_obj);
    return rc;
}

/* Narrows tied[0..*n_tied) to the emptiest caches, then the slowest turnover; *why once one is
   left. 1: done, 0: declined before the policy's state changed in a way Python's steps would not
   repeat (the Python steps then run from the start), -1: an error. */
static int cache_steps(PyObject *table, PyObject *policy, double now, PyObject *candidates,
                       Py_ssize_t *tied, Py_ssize_t *n_tied, Py_ssize_t n_blocks, const char **why) {
    if (fill_tolerance_prompts < 0) return 0;  /* set_tie_constants not called */
    TableView t;
    int rc = table_view(table, &t);
    if (rc <= 0) goto out;
    Py_ssize_t n = *n_tied, column;
    double value_small[SMALL], *value = n > SMALL ? PyMem_Malloc(n * sizeof(double)) : value_small;
    long long capacity_small[SMALL], *capacity = n > SMALL ? PyMem_Malloc(n * sizeof(long long)) : capacity_small;
    if (value == NULL || capacity == NULL) {
        PyErr_NoMemory();
        rc = -1;
        goto freed;
    }
    double low = 0, high = 0;
    long long least_capacity = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        rc = column_of(&t, PySequence_Fast_GET_ITEM(candidates, tied[k]), &column, &capacity[k]);
        if (rc <= 0) goto freed;
        value[k] = (double)t.sizes[column] / (double)capacity[k];
        if (k == 0 || value[k] < low) low = value[k];
        if (k == 0 || value[k] > high) high = value[k];
        if (k == 0 || capacity[k] < least_capacity) least_capacity = capacity[k];
    }
    /* A clearly emptier cache: by more than part of this prompt (small differences are noise). */
    double part = fill_tolerance_prompts * (double)n_blocks;
    double tolerance = (part < 1.0 ? 1.0 : part) / (double)least_capacity;
    if (low < fill_spread_below && high > low + tolerance) {
        Py_ssize_t kept = 0;
        for (Py_ssize_t k = 0; k < n; k++)
            if (value[k] <= low + tolerance) {
                tied[kept] = tied[k];
                capacity[kept++] = capacity[k];
            }
        n = kept;
        if (n == 1) *why = "emptiest cache";
    }
    if (n > 1 && n_blocks) {  /* then where the fewest new blocks went of late */
        rc = turnover_update(&t, policy, now);
        if (rc <= 0) goto freed;
        PyObject *seen = PyObject_GetAttr(policy, s__new_blocks);
        if (seen == NULL) {
            rc = -1;
            goto freed;
        }
        for (Py_ssize_t k = 0; k < n && rc > 0; k++) {
            PyObject *entry = PyDict_GetItemWithError(seen, PySequence_Fast_GET_ITEM(candidates, tied[k]));
            if (entry == NULL) {
                rc = PyErr_Occurred() ? -1 : 0;
                break;
            }
            double sum = PyFloat_AsDouble(PyList_GET_ITEM(entry, 1));  /* a list of 2: turnover_update checked */
            if (sum == -1.0 && PyErr_Occurred()) rc = -1;
            value[k] = sum / (double)capacity[k];
            if (k == 0 || value[k] < low) low = value[k];
            if (k == 0 || value[k] > high) high = value[k];
        }
        Py_DECREF(seen);
        if (rc <= 0) goto freed;
        if (high > low) {
            Py_ssize_t kept = 0;
            for (Py_ssize_t k = 0; k < n; k++)
                if (value[k] == low) tied[kept++] = tied[k];
            n = kept;
            if (n == 1) *why = "slowest cache turnover";
        }
    }
    *n_tied = n;
    rc = 1;
freed:
    if (value != value_small) PyMem_Free(value);
    if (capacity != capacity_small) PyMem_Free(capacity);
out:
    table_view_release(&t);
    return rc;
}

static PyObject *decide(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 19) {
        PyErr_SetString(PyExc_TypeError, "decide(matched, loads, delays, prompt_tokens, block, min_match, "
                                         "prefill_weight, queue_weight, tracker, balance_factor, balance_slack, "
                                         "follow_slack, follow_abs_slack, candidates, hashes, name_hash, table, "
                                         "policy, now)");
        return NULL;
    }
    ScoreParams p;
    if (read_score_params(args + 3, &p) < 0) return NULL;  /* p.per_token_s: the prefill weight, for now */
    double balance_factor = as_double(args[9]), balance_slack = as_double(args[10]),
           follow_slack = as_double(args[11]), follow_abs_slack = as_double(args[12]), rate;
    double now = as_double(args[18]);
    if (PyErr_Occurred()) return NULL;
    PyObject *tracker = args[8], *candidates_seq = args[13], *hashes = args[14], *name_hash = args[15];
    PyObject *first = PySequence_GetItem(candidates_seq, 0);
    if (first == NULL) return NULL;
    int failed = prefill_rate_of(tracker, first, &rate);
    Py_DECREF(first);
    if (failed) return NULL;
    if (rate == 0.0) {
        PyErr_SetString(PyExc_ZeroDivisionError, "decide: a prefill rate of 0 tokens/s");
        return NULL;
    }
    p.per_token_s = p.per_token_s / rate;
    if (!PyDict_Check(name_hash)) {
        PyErr_SetString(PyExc_TypeError, "decide: name_hash must be a dict");
        return NULL;
    }
    Py_ssize_t n_blocks = PyObject_Length(hashes);
    if (n_blocks < 0) return NULL;
    PyObject *candidates = PySequence_Fast(candidates_seq, "candidates must be a sequence");
    if (candidates == NULL) return NULL;
    PyObject *loads = PySequence_Fast(args[1], "loads must be a sequence");
    if (loads == NULL) {
        Py_DECREF(candidates);
        return NULL;
    }
    long long matched_small[SMALL];
    double score_small[SMALL], load_small[SMALL];
    Py_ssize_t index_small[SMALL];
    long long *matched = matched_small;
    double *score = score_small, *load = load_small;
    Py_ssize_t *tied = index_small;
    PyObject *scores_list = NULL, *allowed = NULL, *tied_list = NULL, *out = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(candidates);
    if (n == 0 || PySequence_Fast_GET_SIZE(loads) != n) {
        PyErr_SetString(PyExc_ValueError, "decide: no candidates, or loads not one a candidate");
        goto done;
    }
    if (n > SMALL) {
        matched = PyMem_Malloc(n * sizeof(long long));
        score = PyMem_Malloc(n * sizeof(double));
        load = PyMem_Malloc(n * sizeof(double));
        tied = PyMem_Malloc(n * sizeof(Py_ssize_t));
        if (!matched || !score || !load || !tied) {
            PyErr_NoMemory();
            goto done;
        }
    }
    scores_list = scored(args[0], args[2], &p, n, matched, score);
    if (scores_list == NULL) goto done;
    long long deepest = matched[0], shallowest = matched[0];
    double least = 0, most = 0, loads_sum = 0.0;  /* sum(loads): the same additions in the same order */
    for (Py_ssize_t i = 0; i < n; i++) {
        load[i] = as_double(PySequence_Fast_GET_ITEM(loads, i));
        if (load[i] == -1.0 && PyErr_Occurred()) goto done;
        loads_sum += load[i];
        if (matched[i] > deepest) deepest = matched[i];
        if (matched[i] < shallowest) shallowest = matched[i];
        if (i == 0 || load[i] < least) least = load[i];
        if (i == 0 || load[i] > most) most = load[i];
    }
    /* The balance guard, as "load <= cap" (cap = factor x mean after this request + slack - 1). */
    double mean_after = (loads_sum + 1) / (double)n;
    double strict_cap = balance_factor * mean_after + balance_slack - 1;
    double follow_cap = balance_factor * mean_after + follow_slack - 1;
    if (follow_cap < least + follow_abs_slack) follow_cap = least + follow_abs_slack;
    double bound = least > strict_cap ? least : strict_cap;
    int everyone = most <= bound || deepest < p.min_match || shallowest == deepest;
    if (!everyone) {
        allowed = PyList_New(0);
        if (allowed == NULL) goto done;
    }
    double best = 0;
    int any = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!everyone) {
            int ok = load[i] <= bound;
            if (!ok && matched[i] >= p.min_match && load[i] <= follow_cap) {
                PyObject *depth = PyLong_FromLongLong((matched[i] + 1) / 2);
                if (depth == NULL) goto done;
                PyObject *running = PyObject_CallMethodObjArgs(
                    tracker, s_running_prefix, PySequence_Fast_GET_ITEM(candidates, i), hashes, depth, NULL);
                Py_DECREF(depth);
                if (running == NULL) goto done;
                int truth = PyObject_IsTrue(running);
                Py_DECREF(running);
                if (truth < 0) goto done;
                ok = !truth;
            }
            if (!ok) {
                tied[i] = -1;  /* not allowed */
                continue;
            }
            PyObject *index = PyLong_FromSsize_t(i);
            if (index == NULL) goto done;
            int rc = PyList_Append(allowed, index);
            Py_DECREF(index);
            if (rc < 0) goto done;
        }
        tied[i] = i;
        if (!any || score[i] < best) best = score[i];
        any = 1;
    }
    /* The tied: allowed, at the best score, in order. */
    Py_ssize_t n_tied = 0;
    for (Py_ssize_t i = 0; i < n; i++)
        if (tied[i] >= 0 && score[i] == best) tied[n_tied++] = i;
    Py_ssize_t chosen = tied[0];
    const char *why = "";
    int holding = 0, decided = 1, skip_cache = 0;
    if (n_tied > 1) {
        long long held = matched[tied[0]];
        for (Py_ssize_t k = 1; k < n_tied; k++)
            if (matched[tied[k]] < held) held = matched[tied[k]];
        holding = n_blocks && held == n_blocks;
        skip_cache = holding;
        double low = load[tied[0]], high = low;
        for (Py_ssize_t k = 1; k < n_tied; k++) {
            if (load[tied[k]] < low) low = load[tied[k]];
            if (load[tied[k]] > high) high = load[tied[k]];
        }
        if (high != low) {
            Py_ssize_t kept = 0;
            for (Py_ssize_t k = 0; k < n_tied; k++)
                if (load[tied[k]] == low) tied[kept++] = tied[k];
            n_tied = kept;
        }
        if (n_tied == 1) {
            chosen = tied[0];
            why = "least load";
        } else {
            if (!holding) {  /* the cache steps: tied replicas that would take in new content */
                int rc = cache_steps(args[16], args[17], now, candidates, tied, &n_tied, n_blocks, &why);
                if (rc < 0) goto done;
                skip_cache = rc;  /* done here; else (declined) Python's steps run from the start */
                decided = rc;
                chosen = tied[0];
            }
            if (decided && n_tied > 1 && !n_blocks) {  /* a prompt shorter than a block caches nothing: turns */
                PyObject *turn_obj = PyObject_GetAttr(args[17], s__turn);
                if (turn_obj == NULL) goto done;
                long long turn = PyLong_CheckExact(turn_obj) ? PyLong_AsLongLong(turn_obj) : -1;
                Py_DECREF(turn_obj);
                if (turn < 0 || turn == LLONG_MAX) {  /* not a small int: Python's step */
                    PyErr_Clear();
                    decided = 0;
                } else {
                    PyObject *next = PyLong_FromLongLong(turn + 1);
                    if (next == NULL) goto done;
                    int failed = PyObject_SetAttr(args[17], s__turn, next);
                    Py_DECREF(next);
                    if (failed) goto done;
                    chosen = tied[(turn + 1) % n_tied];
                    why = "rotation";
                    n_tied = 1;
                }
            }
            if (decided && n_tied > 1) {  /* rendezvous: the lowest rank of (name hash ^ a block's hash) */
                PyObject *item = PySequence_GetItem(hashes, deepest < n_blocks - 1 ? deepest : n_blocks - 1);
                if (item == NULL) goto done;
                PyObject *number = PyNumber_Index(item);
                Py_DECREF(item);
                if (number == NULL) goto done;
                unsigned long long key = PyLong_AsUnsignedLongLongMask(number) & MASK32;
                Py_DECREF(number);
                if (key == (unsigned long long)-1 && PyErr_Occurred()) goto done;
                unsigned long long low_rank = 0;
                for (Py_ssize_t k = 0; k < n_tied && decided; k++) {
                    PyObject *h = PyDict_GetItemWithError(name_hash, PySequence_Fast_GET_ITEM(candidates, tied[k]));
                    if (h == NULL) {
                        if (PyErr_Occurred()) goto done;
                        decided = 0;  /* a name not hashed yet: Python hashes it */
                        break;
                    }
                    unsigned long long value = PyLong_AsUnsignedLongLongMask(h);
                    if (value == (unsigned long long)-1 && PyErr_Occurred()) goto done;
                    if (value == 0) {  /* as `get(name) or learn(name)`: Python's step */
                        decided = 0;
                        break;
                    }
                    unsigned long long rank = ((value ^ key) * MIX32) & MASK32;
                    if (k == 0 || rank < low_rank) {
                        low_rank = rank;
                        chosen = tied[k];
                    }
                }
                why = "prefix hash";
            }
        }
        if (!decided) {
            tied_list = PyList_New(n_tied);
            if (tied_list == NULL) goto done;
            for (Py_ssize_t k = 0; k < n_tied; k++) {
                PyObject *index = PyLong_FromSsize_t(tied[k]);
                if (index == NULL) goto done;
                PyList_SET_ITEM(tied_list, k, index);
            }
            chosen = -1;
            why = "";
        }
    }
    out = Py_BuildValue("(nsOOOO)", chosen, why, scores_list, allowed ? allowed : Py_None,
                        tied_list ? tied_list : Py_None, skip_cache ? Py_True : Py_False);
done:
    if (matched != matched_small) {  /* more than SMALL candidates: allocated (or NULL) */
        PyMem_Free(matched);
        PyMem_Free(score);
        PyMem_Free(load);
        PyMem_Free(tied);
    }
    Py_DECREF(candidates);
    Py_DECREF(loads);
    Py_XDECREF(scores_list);
    Py_XDECREF(allowed);
    Py_XDECREF(tied_list);
    return out;
}

static PyObject *s_in_flight, *s_queue_delay_ms, *s_scraped_fresh, *s_replica, *s_candidates,
    *s_predicted_cached_tokens, *s__matched, *s__loads, *s__scores, *s__allowed, *s__why, *s__balance_factor,
    *s__shared_prefix;

/* One EstimateLog (routing/load.py) as its JSON object, fields in its order. */
static int put_estimate(Buf *b, PyObject *estimate) {
    static const char *keys[6] = {"{\"waiting\":", ",\"pending_prefill_tokens\":", ",\"decoding\":",
                                  ",\"in_flight\":", ",\"queue_delay_ms\":", ",\"scraped_fresh\":"};
    PyObject *names[6] = {s_waiting, s_pending_prefill_tokens, s_decoding, s_in_flight, s_queue_delay_ms,
                          s_scraped_fresh};
    static const Py_ssize_t lengths[6] = {11, 26, 12, 13, 18, 17};
    for (int i = 0; i < 6; i++) {
        PyObject *value = GET(estimate, F_EST_WAITING + i, names[i]);
        if (value == NULL) return -1;
        int rc = buf_put(b, keys[i], lengths[i]) < 0 ? -1 : put_number(b, value, 0);
        Py_DECREF(value);
        if (rc < 0) return -1;
    }
    return PUT(b, "}");
}

/* ,"load_estimate":{name: EstimateLog, ...} from a dict of them by name, or as written already
   (bytes: loads_and_delays' JSON); nothing for None. */
static int put_estimates(Buf *b, PyObject *estimates) {
    if (estimates == Py_None) return 0;
    if (PyBytes_Check(estimates))  /* written with the decision (loads_and_delays, estimate=bytes) */
        return PUT(b, ",\"load_estimate\":") < 0 ? -1
               : buf_put(b, PyBytes_AS_STRING(estimates), PyBytes_GET_SIZE(estimates));
    if (PUT(b, ",\"load_estimate\":{") < 0) return -1;
    if (PyDict_Check(estimates)) {
        Py_ssize_t pos = 0, i = 0;
        PyObject *name, *estimate;
        while (PyDict_Next(estimates, &pos, &name, &estimate)) {
            if ((i++ && PUT(b, ",") < 0) || put_str(b, name) < 0 || PUT(b, ":") < 0 || put_estimate(b, estimate) < 0)
                return -1;
        }
    } else {
        PyErr_SetString(PyExc_TypeError, "explain: estimates must be bytes, a dict or None");
        return -1;
    }
    return PUT(b, "}");
}

/* What follows the scores in every routing field, and the closing brace. */
static int put_tail(Buf *b, PyObject *predicted, PyObject *mode, PyObject *estimates,
                    PyObject *retried) {
    if (PUT(b, ",\"predicted_cached_tokens\":") < 0 || put_number(b, predicted, 0) < 0
        || PUT(b, ",\"mode\":") < 0 || put_str(b, mode) < 0 || put_estimates(b, estimates) < 0)
        return -1;
    if (retried != Py_None && (PUT(b, ",\"retried_after\":") < 0 || put_names(b, retried) < 0)) return -1;
    return PUT(b, "}");
}

static PyObject *finish_buf(Buf *b, int rc) {
    PyObject *out = rc < 0 ? NULL : PyBytes_FromStringAndSize(b->data, b->len);
    buf_free(b);
    return out;
}

static PyObject *explain(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 14) {
        PyErr_SetString(PyExc_TypeError, "explain(policy, reason, chosen, candidates, matched_names, matched, "
                                         "load_names, loads, scored, scores, predicted_cached_tokens, mode, "
                                         "estimates, retried_after)");
        return NULL;
    }
    Buf b;
    BUF_INIT(&b);
    int rc = (PUT(&b, "{\"policy\":") < 0 || put_str(&b, args[0]) < 0 || PUT(&b, ",\"reason\":") < 0
              || put_str(&b, args[1]) < 0 || PUT(&b, ",\"chosen\":") < 0 || put_str(&b, args[2]) < 0
              || PUT(&b, ",\"candidates\":") < 0 || put_names(&b, args[3]) < 0
              || PUT(&b, ",\"matched_blocks\":") < 0 || put_object(&b, args[4], args[5], 0) < 0
              || PUT(&b, ",\"load\":") < 0 || put_object(&b, args[6], args[7], 0) < 0
              || PUT(&b, ",\"scores\":") < 0 || put_object(&b, args[8], args[9], 1) < 0
              || put_tail(&b, args[10], args[11], args[12], args[13]) < 0) ? -1 : 0;
    return finish_buf(&b, rc);
}

/* A cache_aware decision's reason, as CacheAwareDecision.reason (routing/policies.py, the reference)
   words it, written escaped into the JSON string. */
enum { R_REPLICA, R_CANDIDATES, R_PREDICTED, R_MATCHED, R_LOADS, R_SCORES, R_ALLOWED, R_WHY, R_FACTOR, R_SHARED,
       N_DECISION_FIELDS };

static int put_reason(Buf *b, PyObject **d) {
    PyObject *matched = PySequence_Fast(d[R_MATCHED], "explain: matched blocks must be a sequence");
    if (matched == NULL) return -1;
    int rc = -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(matched), chosen = PySequence_Index(d[R_CANDIDATES], d[R_REPLICA]);
    if (chosen < 0) goto done;
    if (chosen >= n) {
        PyErr_SetString(PyExc_IndexError, "explain: fewer matched blocks than candidates");
        goto done;
    }
    Py_ssize_t best = 0;
    long long deepest = 0, at_chosen = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        long long blocks = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(matched, i));
        if (blocks == -1 && PyErr_Occurred()) goto done;
        if (i == 0 || blocks > deepest) {  /* the first of the deepest */
            best = i;
            deepest = blocks;
        }
        if (i == chosen) at_chosen = blocks;
    }
    if (deepest == at_chosen) {
        if (at_chosen ? (PUT(b, "longest prefix (") < 0 || put_long(b, at_chosen) < 0
                         || PUT(b, " blocks) at lowest cost") < 0)
                      : PUT(b, "no cached prefix; lowest queueing delay") < 0)
            goto done;
    } else {
        int shared = PyObject_IsTrue(d[R_SHARED]), guarded = 0;
        if (shared < 0) goto done;
        if (!shared && d[R_ALLOWED] != Py_None) {
            PyObject *index = PyLong_FromSsize_t(best);
            if (index == NULL) goto done;
            int in = PySequence_Contains(d[R_ALLOWED], index);
            Py_DECREF(index);
            if (in < 0) goto done;
            guarded = !in;
        }
        PyObject *name = PySequence_GetItem(d[R_CANDIDATES], best);
        if (name == NULL) goto done;
        int failed;
        if (shared) {
            failed = PUT(b, "new content: the ") < 0 || put_long(b, deepest) < 0
                     || PUT(b, " cached blocks are a prefix other requests share (a system prompt), too small a "
                               "part of this prompt to follow") < 0;
        } else if (guarded) {
            PyObject *factor = PyObject_Str(d[R_FACTOR]);
            failed = factor == NULL || PUT(b, "balance guard: ") < 0 || put_text(b, name, 1) < 0
                     || PUT(b, " holds ") < 0 || put_long(b, deepest) < 0 || PUT(b, " blocks but is over ") < 0
                     || put_text(b, factor, 1) < 0 || PUT(b, "x mean load") < 0;
            Py_XDECREF(factor);
        } else {
            failed = PUT(b, "queueing at ") < 0 || put_text(b, name, 1) < 0 || PUT(b, " outweighs its ") < 0
                     || put_long(b, deepest - at_chosen) < 0 || PUT(b, " extra cached blocks") < 0;
        }
        Py_DECREF(name);
        if (failed) goto done;
    }
    int why = PyObject_IsTrue(d[R_WHY]);
    if (why < 0 || (why && (PUT(b, "; tie broken by ") < 0 || put_text(b, d[R_WHY], 1) < 0))) goto done;
    rc = 0;
done:
    Py_DECREF(matched);
    return rc;
}

static PyObject *raw_type;  /* msgspec.Raw */

static PyObject *explain_cache_aware(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "explain_cache_aware(decision, mode, estimates, retried_after)");
        return NULL;
    }
    PyObject *names[N_DECISION_FIELDS] = {s_replica, s_candidates, s_predicted_cached_tokens, s__matched, s__loads,
                                          s__scores, s__allowed, s__why, s__balance_factor, s__shared_prefix};
    PyObject *d[N_DECISION_FIELDS] = {NULL};
    Buf b;
    BUF_INIT(&b);
    int rc = -1;
    for (int i = 0; i < N_DECISION_FIELDS; i++) {
        if ((d[i] = GET(args[0], D_REPLICA + i, names[i])) == NULL) goto done;
    }
    PyObject *candidates = d[R_CANDIDATES];
    rc = (PUT(&b, "{\"policy\":\"cache_aware\",\"reason\":\"") < 0 || put_reason(&b, d) < 0
          || PUT(&b, "\",\"chosen\":") < 0 || put_str(&b, d[R_REPLICA]) < 0
          || PUT(&b, ",\"candidates\":") < 0 || put_names(&b, candidates) < 0
          || PUT(&b, ",\"matched_blocks\":") < 0 || put_object(&b, candidates, d[R_MATCHED], 0) < 0
          || PUT(&b, ",\"load\":") < 0 || put_object(&b, candidates, d[R_LOADS], 0) < 0
          || PUT(&b, ",\"scores\":") < 0 || put_object(&b, candidates, d[R_SCORES], 1) < 0
          || put_tail(&b, d[R_PREDICTED], args[1], args[2], args[3]) < 0) ? -1 : 0;
done:
    for (int i = 0; i < N_DECISION_FIELDS; i++) Py_XDECREF(d[i]);
    PyObject *written = finish_buf(&b, rc);
    if (written == NULL) return NULL;
    PyObject *raw = PyObject_CallOneArg(raw_type, written);  /* msgspec.Raw: the record's encoder copies it in */
    Py_DECREF(written);
    return raw;
}

/* ---- cache_aware's whole choice and its commit, one call each ------------------------------------

   choose_cache_aware(policy, candidates, request, estimate) -> CacheAwareDecision | None
   commit_cache_aware(policy, decision) -> True | None

   CacheAware.choose and CacheAware.commit (routing/policies.py, their Python lines the reference;
   tests compare the two) without the Python between the C calls they make: the policy's and the
   request's attributes read here, table_match (routing/_prefix_match.c), loads_and_delays and
   decide above called in place, the branch point looked up, the decision made. A tie decide
   leaves goes to the policy's _after_load_step, as in choose. None where the Python lines serve,
   before anything is changed: no candidates, no block hashes given, no table for the model yet, a
   table or tracker the C calls decline; for commit, a guess table_guess declines. Each saves ~200
   (choose) and ~70 (commit) Python opcodes a request (bench/README, "Thirty-fourth session"). */

static PyObject *table_match_fn, *table_guess_fn, *decision_type;  /* set_choose_parts */
static long long branch_shared = 1, branch_points_kept = 1 << 16;
static PyObject *s_state, *s_tracker, *s_block_hashes, *s_tables, *s_block_size, *s_prompt_token_ids,
    *s_min_match_blocks, *s_follow_min_fraction, *s__branch_points, *s_prefill_weight, *s_queue_weight,
    *s_balance_factor, *s_balance_slack, *s_follow_slack, *s_follow_abs_slack, *s__name_hash,
    *s__after_load_step, *s_learn_from_routing, *s_table, *s_hashes, *s_pop, *s_popitem, *s_last;

static PyObject *set_choose_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "set_choose_parts(table_match, table_guess, decision_type, branch_shared, branch_points_kept)");
        return NULL;
    }
    long long shared = PyLong_AsLongLong(args[3]), kept = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred()) return NULL;
    Py_XSETREF(table_match_fn, Py_NewRef(args[0]));
    Py_XSETREF(table_guess_fn, Py_NewRef(args[1]));
    Py_XSETREF(decision_type, Py_NewRef(args[2]));
    branch_shared = shared;
    branch_points_kept = kept;
    Py_RETURN_NONE;
}

/* The list of ints `matched`'s deepest value (0 for an empty one); -1 with an exception set. */
static long long deepest_of(PyObject *matched) {
    if (!PyList_Check(matched)) {
        PyErr_SetString(PyExc_TypeError, "cache_aware: the matches must be a list");
        return -1;
    }
    long long deepest = 0;
    for (Py_ssize_t i = 0; i < PyList_GET_SIZE(matched); i++) {
        long long value = PyLong_AsLongLong(PyList_GET_ITEM(matched, i));
        if (value == -1 && PyErr_Occurred()) return -1;
        if (i == 0 || value > deepest) deepest = value;
    }
    return deepest;
}

enum { C_STATE, C_TRACKER, C_HASHES, C_TABLES, C_MODEL, C_TABLE, C_CLOCK, C_NOW, C_MATCHED, C_LAD, C_PROMPT,
       C_BLOCK, C_MIN_MATCH, C_FRACTION, C_POINTS, C_KEY, C_PROMPT_TOKENS, C_PREFILL_WEIGHT, C_QUEUE_WEIGHT,
       C_FACTOR, C_SLACK, C_FOLLOW_SLACK, C_FOLLOW_ABS, C_NAME_HASH, C_DECIDED, C_AFTER, C_DEEPEST, C_N_BLOCKS,
       C_CACHED, C_TUPLE, C_COUNT };

static PyObject *choose_cache_aware(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "choose_cache_aware(policy, candidates, request, estimate)");
        return NULL;
    }
    if (decision_type == NULL) Py_RETURN_NONE;
    PyObject *policy = args[0], *candidates = args[1], *request = args[2];
    PyObject *o[C_COUNT] = {NULL};
    PyObject *out = NULL;
    Py_ssize_t n = PyObject_Length(candidates), n_blocks;
    if (n < 0) return NULL;
    if (n == 0) Py_RETURN_NONE;  /* the Python lines say why */
    if ((o[C_STATE] = PyObject_GetAttr(policy, s_state)) == NULL
        || (o[C_HASHES] = PyObject_GetAttr(request, s_block_hashes)) == NULL
        || (n_blocks = PyObject_Length(o[C_HASHES])) < 0)
        goto done;
    if (n_blocks == 0) {  /* hashes to make (state.hashes), or none to match: the Python lines */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if ((o[C_TABLES] = PyObject_GetAttr(o[C_STATE], s_tables)) == NULL
        || (o[C_MODEL] = PyObject_GetAttr(request, s_model)) == NULL)
        goto done;
    if (PyDict_CheckExact(o[C_TABLES])) {
        o[C_TABLE] = PyDict_GetItemWithError(o[C_TABLES], o[C_MODEL]);
        Py_XINCREF(o[C_TABLE]);
        if (o[C_TABLE] == NULL && PyErr_Occurred()) goto done;
    }
    if (o[C_TABLE] == NULL) {  /* the model's first request: state.table() makes its table */
        out = Py_NewRef(Py_None);
        goto done;
    }
    if ((o[C_TRACKER] = PyObject_GetAttr(o[C_STATE], s_tracker)) == NULL
        || (o[C_CLOCK] = PyObject_GetAttr(o[C_STATE], s_clock)) == NULL
        || (o[C_NOW] = PyObject_CallNoArgs(o[C_CLOCK])) == NULL)
        goto done;
    PyObject *match_args[4] = {o[C_TABLE], o[C_HASHES], o[C_NOW], candidates};
    if ((o[C_MATCHED] = PyObject_Vectorcall(table_match_fn, match_args, 4, NULL)) == NULL) goto done;
    if (o[C_MATCHED] == Py_None) {  /* a table the C match declines */
        out = Py_NewRef(Py_None);
        goto done;
    }
    PyObject *lad_args[4] = {o[C_TRACKER], candidates, o[C_NOW], args[3]};
    if ((o[C_LAD] = loads_and_delays(NULL, lad_args, 4)) == NULL) goto done;
    if (o[C_LAD] == Py_None) {  /* a replica not tracked yet */
        out = Py_NewRef(Py_None);
        goto done;
    }
    long long deepest = deepest_of(o[C_MATCHED]);
    if (deepest < 0) goto done;
    if (PyList_GET_SIZE(o[C_MATCHED]) != n) {
        PyErr_SetString(PyExc_ValueError, "choose_cache_aware: not one match a candidate");
        goto done;
    }
    Py_ssize_t prompt_tokens;
    if ((o[C_PROMPT] = PyObject_GetAttr(request, s_prompt_token_ids)) == NULL
        || (prompt_tokens = PyObject_Length(o[C_PROMPT])) < 0
        || (o[C_BLOCK] = PyObject_GetAttr(o[C_STATE], s_block_size)) == NULL
        || (o[C_MIN_MATCH] = PyObject_GetAttr(policy, s_min_match_blocks)) == NULL
        || (o[C_FRACTION] = PyObject_GetAttr(policy, s_follow_min_fraction)) == NULL
        || (o[C_POINTS] = PyObject_GetAttr(policy, s__branch_points)) == NULL)
        goto done;
    long long block = PyLong_AsLongLong(o[C_BLOCK]);
    double fraction = as_double(o[C_FRACTION]);
    int truth = PyObject_IsTrue(o[C_MIN_MATCH]);
    if (truth < 0 || PyErr_Occurred()) goto done;
    if (!truth) Py_SETREF(o[C_MIN_MATCH], PyLong_FromLong(1));  /* `self.min_match_blocks or 1` */
    int shared_prefix = 0;
    if (deepest && (double)(deepest * block) < fraction * (double)prompt_tokens) {
        /* All that is cached is a prefix other requests branch off too, and a small part of this
           prompt: it does not steer (see CacheAware.choose). */
        PyObject *item = PySequence_GetItem(o[C_HASHES], (Py_ssize_t)(deepest - 1));
        if (item == NULL) goto done;
        o[C_KEY] = PyNumber_Long(item);
        Py_DECREF(item);
        if (o[C_KEY] == NULL || !PyDict_Check(o[C_POINTS])) {
            if (o[C_KEY] != NULL) PyErr_SetString(PyExc_TypeError, "cache_aware: _branch_points must be a dict");
            goto done;
        }
        PyObject *count = PyDict_GetItemWithError(o[C_POINTS], o[C_KEY]);  /* borrowed */
        if (count == NULL && PyErr_Occurred()) goto done;
        long long seen = count == NULL ? 0 : PyLong_AsLongLong(count);
        if (seen == -1 && PyErr_Occurred()) goto done;
        if (seen >= branch_shared) {
            Py_SETREF(o[C_MIN_MATCH], PyLong_FromSsize_t(n_blocks + 1));
            shared_prefix = 1;
        }
    }
    if (o[C_MIN_MATCH] == NULL || (o[C_PROMPT_TOKENS] = PyLong_FromSsize_t(prompt_tokens)) == NULL
        || (o[C_PREFILL_WEIGHT] = PyObject_GetAttr(policy, s_prefill_weight)) == NULL
        || (o[C_QUEUE_WEIGHT] = PyObject_GetAttr(policy, s_queue_weight)) == NULL
        || (o[C_FACTOR] = PyObject_GetAttr(policy, s_balance_factor)) == NULL
        || (o[C_SLACK] = PyObject_GetAttr(policy, s_balance_slack)) == NULL
        || (o[C_FOLLOW_SLACK] = PyObject_GetAttr(policy, s_follow_slack)) == NULL
        || (o[C_FOLLOW_ABS] = PyObject_GetAttr(policy, s_follow_abs_slack)) == NULL
        || (o[C_NAME_HASH] = PyObject_GetAttr(policy, s__name_hash)) == NULL)
        goto done;
    PyObject *loads = PyTuple_GET_ITEM(o[C_LAD], 0), *delays = PyTuple_GET_ITEM(o[C_LAD], 1),
             *estimates = PyTuple_GET_SIZE(o[C_LAD]) > 2 ? PyTuple_GET_ITEM(o[C_LAD], 2) : Py_None;
    PyObject *decide_args[19] = {o[C_MATCHED], loads, delays, o[C_PROMPT_TOKENS], o[C_BLOCK], o[C_MIN_MATCH],
                                 o[C_PREFILL_WEIGHT], o[C_QUEUE_WEIGHT], o[C_TRACKER], o[C_FACTOR], o[C_SLACK],
                                 o[C_FOLLOW_SLACK], o[C_FOLLOW_ABS], candidates, o[C_HASHES], o[C_NAME_HASH],
                                 o[C_TABLE], policy, o[C_NOW]};
    if ((o[C_DECIDED] = decide(NULL, decide_args, 19)) == NULL) goto done;
    PyObject *chosen_obj = PyTuple_GET_ITEM(o[C_DECIDED], 0), *why = PyTuple_GET_ITEM(o[C_DECIDED], 1),
             *scores = PyTuple_GET_ITEM(o[C_DECIDED], 2), *allowed = PyTuple_GET_ITEM(o[C_DECIDED], 3),
             *tied = PyTuple_GET_ITEM(o[C_DECIDED], 4);
    if (tied != Py_None) {  /* a tie decide leaves: the policy's steps past the load step */
        if ((o[C_DEEPEST] = PyLong_FromLongLong(deepest)) == NULL
            || (o[C_N_BLOCKS] = PyLong_FromSsize_t(n_blocks)) == NULL)
            goto done;
        PyObject *after_args[9] = {policy, candidates, tied, o[C_TABLE], o[C_HASHES], o[C_DEEPEST], o[C_N_BLOCKS],
                                   PyTuple_GET_ITEM(o[C_DECIDED], 5), o[C_NOW]};
        o[C_AFTER] = PyObject_VectorcallMethod(s__after_load_step, after_args,
                                               9 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
        if (o[C_AFTER] == NULL) goto done;
        if (!PyTuple_Check(o[C_AFTER]) || PyTuple_GET_SIZE(o[C_AFTER]) != 2) {
            PyErr_SetString(PyExc_TypeError, "cache_aware: _after_load_step gives (chosen, why)");
            goto done;
        }
        chosen_obj = PyTuple_GET_ITEM(o[C_AFTER], 0);
        why = PyTuple_GET_ITEM(o[C_AFTER], 1);
    }
    Py_ssize_t chosen = PyLong_AsSsize_t(chosen_obj);
    if (chosen == -1 && PyErr_Occurred()) goto done;
    if (chosen < 0 || chosen >= n) {
        PyErr_SetString(PyExc_IndexError, "cache_aware: the chosen index is not a candidate's");
        goto done;
    }
    long long held = PyLong_AsLongLong(PyList_GET_ITEM(o[C_MATCHED], chosen));
    if (held == -1 && PyErr_Occurred()) goto done;
    long long cached = held * block > (long long)prompt_tokens ? (long long)prompt_tokens : held * block;
    PyObject *name = PySequence_GetItem(candidates, chosen);
    if (name == NULL) goto done;
    if ((o[C_CACHED] = PyLong_FromLongLong(cached)) == NULL
        || (o[C_TUPLE] = PySequence_Tuple(candidates)) == NULL) {
        Py_DECREF(name);
        goto done;
    }
    PyObject *fields[13] = {name, o[C_TUPLE], o[C_CACHED], o[C_MATCHED], loads, scores, allowed, why, o[C_FACTOR],
                            o[C_TABLE], o[C_HASHES], shared_prefix ? Py_True : Py_False, estimates};
    out = PyObject_Vectorcall(decision_type, fields, 13, NULL);
    Py_DECREF(name);
done:
    for (int i = 0; i < C_COUNT; i++) Py_XDECREF(o[i]);
    return out;
}

/* commit: the branch point where the prompt's match ended (moved last, counted; the oldest past
   branch_points_kept dropped), and in approximate mode (learn_from_routing) the prompt's blocks
   guessed on the chosen replica (table_guess; a replica that left the table since: nothing).
   The guess first: where table_guess declines (None), nothing is changed and None returned. */
static PyObject *commit_cache_aware(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "commit_cache_aware(policy, decision)");
        return NULL;
    }
    if (table_guess_fn == NULL) Py_RETURN_NONE;
    PyObject *policy = args[0], *decision = args[1];
    PyObject *matched = NULL, *hashes = NULL, *learn = NULL, *table = NULL, *replica = NULL, *state = NULL,
             *clock = NULL, *now = NULL, *guessed = NULL, *points = NULL, *key = NULL, *count = NULL, *out = NULL;
    Py_ssize_t n_blocks;
    if ((matched = GET(decision, D_MATCHED, s__matched)) == NULL
        || (hashes = PyObject_GetAttr(decision, s_hashes)) == NULL || (n_blocks = PyObject_Length(hashes)) < 0
        || (learn = PyObject_GetAttr(policy, s_learn_from_routing)) == NULL)
        goto done;
    long long deepest = deepest_of(matched);
    int learning = PyObject_IsTrue(learn);
    if (deepest < 0 || learning < 0) goto done;
    if (learning && n_blocks) {
        if ((table = PyObject_GetAttr(decision, s_table)) == NULL || (replica = GET(decision, D_REPLICA, s_replica)) == NULL
            || (state = PyObject_GetAttr(policy, s_state)) == NULL || (clock = PyObject_GetAttr(state, s_clock)) == NULL
            || (now = PyObject_CallNoArgs(clock)) == NULL)
            goto done;
        PyObject *guess_args[4] = {table, replica, hashes, now};
        guessed = PyObject_Vectorcall(table_guess_fn, guess_args, 4, NULL);
        if (guessed == NULL) {
            if (!PyErr_ExceptionMatches(PyExc_KeyError)) goto done;
            PyErr_Clear();  /* the replica left the table since (removed from the pool) */
        } else if (guessed == Py_None) {  /* table.insert serves: the Python lines, all of them */
            out = Py_NewRef(Py_None);
            goto done;
        }
    }
    if (deepest) {
        PyObject *item = PySequence_GetItem(hashes, (Py_ssize_t)(deepest - 1));
        if (item == NULL) goto done;
        key = PyNumber_Long(item);
        Py_DECREF(item);
        if (key == NULL || (points = PyObject_GetAttr(policy, s__branch_points)) == NULL) goto done;
        PyObject *zero = PyLong_FromLong(0);
        if (zero == NULL) goto done;
        count = PyObject_CallMethodObjArgs(points, s_pop, key, zero, NULL);  /* (re)inserted: the most recent */
        Py_DECREF(zero);
        if (count == NULL) goto done;
        PyObject *one = PyLong_FromLong(1);
        PyObject *more = one == NULL ? NULL : PyNumber_Add(count, one);
        Py_XDECREF(one);
        if (more == NULL) goto done;
        int failed = PyObject_SetItem(points, key, more);
        Py_DECREF(more);
        if (failed) goto done;
        Py_ssize_t size = PyObject_Length(points);
        if (size < 0) goto done;
        if (size > branch_points_kept) {
            PyObject *popitem_args[2] = {points, Py_False};
            PyObject *kwnames = PyTuple_Pack(1, s_last);
            if (kwnames == NULL) goto done;
            PyObject *dropped = PyObject_VectorcallMethod(s_popitem, popitem_args, 1 | PY_VECTORCALL_ARGUMENTS_OFFSET,
                                                          kwnames);
            Py_DECREF(kwnames);
            if (dropped == NULL) goto done;
            Py_DECREF(dropped);
        }
    }
    out = Py_NewRef(Py_True);
done:
    Py_XDECREF(matched);
    Py_XDECREF(hashes);
    Py_XDECREF(learn);
    Py_XDECREF(table);
    Py_XDECREF(replica);
    Py_XDECREF(state);
    Py_XDECREF(clock);
    Py_XDECREF(now);
    Py_XDECREF(guessed);
    Py_XDECREF(points);
    Py_XDECREF(key);
    Py_XDECREF(count);
    return out;
}

/* ---- a routed try, made in one call ------------------------------------------------------------

   set_attempt_parts(cls, names) -> None
   new_attempt(cls, router, state, decision, model, prompt_tokens, hashes, estimates, native_load) -> cls | None

   gateway/router.py RoutedAttempt.__init__ (with routing/attempt.py Attempt.__init__; the Python
   lines the reference, tests compare the two): a try of `decision` on its replica, counted in the
   load tracker (its C `routed` above where `native_load`, else tracker.on_routed), its slots set
   in place (`names`: the class's slots, as set_attempt_parts was told them; each a member
   descriptor at a fixed offset). None where `cls` is not the class set_attempt_parts was given. */

enum { A_STATE, A_DECISION, A_REPLICA, A_MODEL, A_PROMPT_TOKENS, A_HASHES, A_PREDICTED, A_STARTED_DECODING, A_DONE,
       A_TICKET, A_ROUTER, A_CACHED_TOKENS, A_FIRST_TOKEN_S, A_ROUTED_S, A_PREFILL_SAMPLE, A_BATCH, A_DECODE_SAMPLE,
       A_RETRIED_AFTER, A_MODE, A_ESTIMATES, A_LOG, A_SLOTS };
static const char *const attempt_slots[A_SLOTS] = {
    "state", "decision", "replica", "model", "prompt_tokens", "hashes", "predicted_cached_tokens",
    "started_decoding", "done", "_ticket", "router", "cached_tokens", "first_token_s", "routed_s", "prefill_sample",
    "batch", "decode_sample", "retried_after", "_mode", "_estimates", "_log"};
static PyTypeObject *attempt_type;
static Py_ssize_t attempt_offsets[A_SLOTS];
static PyObject *perf_counter_fn, *s_precise, *s_on_routed, *s_approximate, *one_int;

static PyObject *set_attempt_parts(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2 || !PyType_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "set_attempt_parts(cls, perf_counter)");
        return NULL;
    }
    PyTypeObject *type = (PyTypeObject *)args[0];
    Py_ssize_t offsets[A_SLOTS];
    for (int i = 0; i < A_SLOTS; i++) {
        PyObject *name = PyUnicode_InternFromString(attempt_slots[i]);
        if (name == NULL) return NULL;
        PyObject *descr = _PyType_Lookup(type, name);  /* borrowed */
        Py_DECREF(name);
        if (descr == NULL || !Py_IS_TYPE(descr, &PyMemberDescr_Type)
            || ((PyMemberDescrObject *)descr)->d_member->type != T_OBJECT_EX) {
            PyErr_Format(PyExc_TypeError, "set_attempt_parts: %s.%s is not a slot", type->tp_name, attempt_slots[i]);
            return NULL;
        }
        offsets[i] = ((PyMemberDescrObject *)descr)->d_member->offset;
    }
    memcpy(attempt_offsets, offsets, sizeof(offsets));
    Py_INCREF(type);
    Py_XSETREF(attempt_type, type);
    Py_XSETREF(perf_counter_fn, Py_NewRef(args[1]));
    Py_RETURN_NONE;
}

static PyObject *new_attempt(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "new_attempt(cls, router, state, decision, model, prompt_tokens, hashes, "
                                         "estimates, native_load)");
        return NULL;
    }
    if (attempt_type == NULL || args[0] != (PyObject *)attempt_type) Py_RETURN_NONE;
    PyObject *router = args[1], *state = args[2], *decision = args[3];
    PyObject *v[A_SLOTS] = {NULL};  /* new references, moved into the slots at the end */
    PyObject *out = NULL, *tracker = NULL, *replicas = NULL, *precise = NULL;
    int native_load = PyObject_IsTrue(args[8]);
    if (native_load < 0) return NULL;
    v[A_STATE] = Py_NewRef(state);
    v[A_DECISION] = Py_NewRef(decision);
    v[A_MODEL] = Py_NewRef(args[4]);
    v[A_PROMPT_TOKENS] = Py_NewRef(args[5]);
    v[A_HASHES] = Py_NewRef(args[6]);
    v[A_STARTED_DECODING] = Py_NewRef(Py_False);
    v[A_DONE] = Py_NewRef(Py_False);
    v[A_ROUTER] = Py_NewRef(router);
    v[A_CACHED_TOKENS] = Py_NewRef(Py_None);
    v[A_FIRST_TOKEN_S] = Py_NewRef(Py_None);
    v[A_BATCH] = Py_NewRef(one_int);
    v[A_DECODE_SAMPLE] = Py_NewRef(Py_None);
    v[A_RETRIED_AFTER] = Py_NewRef(Py_None);
    v[A_ESTIMATES] = Py_NewRef(args[7]);
    v[A_LOG] = Py_NewRef(Py_None);
    if ((v[A_REPLICA] = PyObject_GetAttr(decision, s_replica)) == NULL
        || (v[A_PREDICTED] = PyObject_GetAttr(decision, s_predicted_cached_tokens)) == NULL
        || (tracker = PyObject_GetAttr(state, s_tracker)) == NULL)
        goto done;
    if (native_load) {  /* tracker.on_routed's C steps; None: not tracked yet, the method makes its load */
        PyObject *routed_args[5] = {tracker, v[A_REPLICA], args[5], v[A_PREDICTED], args[6]};
        if ((v[A_TICKET] = routed(NULL, routed_args, 5)) == NULL) goto done;
        if (v[A_TICKET] == Py_None) Py_CLEAR(v[A_TICKET]);
    }
    if (v[A_TICKET] == NULL) {
        PyObject *call[5] = {tracker, v[A_REPLICA], args[5], v[A_PREDICTED], args[6]};
        if ((v[A_TICKET] = PyObject_VectorcallMethod(s_on_routed, call, 5 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL)) == NULL)
            goto done;
    }
    if ((v[A_ROUTED_S] = PyObject_CallNoArgs(perf_counter_fn)) == NULL
        || (replicas = GET(tracker, T_REPLICAS, s_replicas)) == NULL)
        goto done;
    /* Its first token can time the replica's prefill: nothing of ours queued ahead of it. */
    int sample = 0;
    PyObject *load = PyDict_Check(replicas) ? PyDict_GetItemWithError(replicas, v[A_REPLICA]) : NULL;  /* borrowed */
    if (load == NULL && PyErr_Occurred()) goto done;
    if (load != NULL) {
        long waiting;
        if (read_long(load, s_waiting, F_WAITING, &waiting) < 0) goto done;
        sample = waiting <= 1;
    }
    v[A_PREFILL_SAMPLE] = Py_NewRef(sample ? Py_True : Py_False);
    if ((precise = PyObject_GetAttr(router, s_precise)) == NULL) goto done;
    int is_precise;
    if (PyDict_CheckExact(precise)) {
        PyObject *flag = PyDict_GetItemWithError(precise, v[A_REPLICA]);  /* borrowed */
        if (flag == NULL && PyErr_Occurred()) goto done;
        is_precise = flag == NULL ? 0 : PyObject_IsTrue(flag);
    } else {  /* router.precise.get(replica), whatever mapping it is */
        PyObject *flag = PyObject_CallMethod(precise, "get", "O", v[A_REPLICA]);
        if (flag == NULL) goto done;
        is_precise = PyObject_IsTrue(flag);
        Py_DECREF(flag);
    }
    if (is_precise < 0) goto done;
    v[A_MODE] = Py_NewRef(is_precise ? s_precise : s_approximate);
    out = attempt_type->tp_alloc(attempt_type, 0);
    if (out == NULL) goto done;
    for (int i = 0; i < A_SLOTS; i++) {  /* a new object's slots are empty: each takes its reference */
        *(PyObject **)((char *)out + attempt_offsets[i]) = v[i];
        v[i] = NULL;
    }
done:
    for (int i = 0; i < A_SLOTS; i++) Py_XDECREF(v[i]);
    Py_XDECREF(tracker);
    Py_XDECREF(replicas);
    Py_XDECREF(precise);
    return out;
}

static PyMethodDef methods[] = {
    {"loads_and_delays", (PyCFunction)(void (*)(void))loads_and_delays, METH_FASTCALL,
     "(in_flight, queue_delay_s[, estimate records]) of each named replica; None if one is not tracked yet."},
    {"routed", (PyCFunction)(void (*)(void))routed, METH_FASTCALL, "LoadTracker.on_routed's steps; None: not tracked yet."},
    {"first_token", (PyCFunction)(void (*)(void))first_token, METH_FASTCALL,
     "LoadTracker.on_first_token's steps; None: not tracked yet."},
    {"finished", (PyCFunction)(void (*)(void))finished, METH_FASTCALL,
     "LoadTracker.on_finished's steps; None: not tracked yet."},
    {"decide", (PyCFunction)(void (*)(void))decide, METH_FASTCALL,
     "cache_aware's choice from the matches and loads: (chosen, why, scores, allowed, tied, skip_cache)."},
    {"set_tie_constants", (PyCFunction)(void (*)(void))set_tie_constants, METH_FASTCALL,
     "cache_aware's tie constants (routing/policies.py's): fill tolerance, fill spread bound, rebase halvings."},
    {"explain", (PyCFunction)(void (*)(void))explain, METH_FASTCALL, "The request record's routing field as JSON."},
    {"explain_cache_aware", (PyCFunction)(void (*)(void))explain_cache_aware, METH_FASTCALL,
     "explain() of a CacheAwareDecision, its reason worded here, as msgspec.Raw."},
    {"set_attempt_parts", (PyCFunction)(void (*)(void))set_attempt_parts, METH_FASTCALL,
     "The try class new_attempt makes (gateway/router.py RoutedAttempt) and the clock it reads."},
    {"new_attempt", (PyCFunction)(void (*)(void))new_attempt, METH_FASTCALL,
     "RoutedAttempt(...) in one call; None where the class is not the one set."},
    {"set_choose_parts", (PyCFunction)(void (*)(void))set_choose_parts, METH_FASTCALL,
     "What choose_cache_aware and commit_cache_aware call and make (routing/policies.py's)."},
    {"choose_cache_aware", (PyCFunction)(void (*)(void))choose_cache_aware, METH_FASTCALL,
     "CacheAware.choose in one call; None where the Python lines serve."},
    {"commit_cache_aware", (PyCFunction)(void (*)(void))commit_cache_aware, METH_FASTCALL,
     "CacheAware.commit in one call; None where the Python lines serve."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_decision", NULL, -1, methods};

PyMODINIT_FUNC PyInit__decision(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_prefill_tokens_per_s, "prefill_tokens_per_s");
    INTERN(s_pending_prefill_tokens, "pending_prefill_tokens");
    INTERN(s_backlog_at, "backlog_at");
    INTERN(s_backlog_tokens, "backlog_tokens");
    INTERN(s_waiting, "waiting");
    INTERN(s_decoding, "decoding");
    INTERN(s_scraped, "scraped");
    INTERN(s_extra, "extra");
    INTERN(s_at_s, "at_s");
    INTERN(s_decode_step_scale, "decode_step_scale");
    INTERN(s_in_flight, "in_flight");
    INTERN(s_queue_delay_ms, "queue_delay_ms");
    INTERN(s_scraped_fresh, "scraped_fresh");
    INTERN(s_routed, "routed");
    INTERN(s_decoding_context_tokens, "decoding_context_tokens");
    INTERN(s_running_prompts, "running_prompts");
    INTERN(s_replicas, "replicas");
    INTERN(s_clock, "clock");
    INTERN(s_model, "model");
    INTERN(s_tickets, "_tickets");
    INTERN(s_own_total, "own_total");
    INTERN(s_stale_after_s, "stale_after_s");
    INTERN(s_decode_step_base_s, "decode_step_base_s");
    INTERN(s_decode_step_s_per_seq, "decode_step_s_per_seq");
    INTERN(s_running_prefix, "running_prefix");
    INTERN(s_replica, "replica");
    INTERN(s_candidates, "candidates");
    INTERN(s_predicted_cached_tokens, "predicted_cached_tokens");
    INTERN(s__matched, "_matched");
    INTERN(s__loads, "_loads");
    INTERN(s__scores, "_scores");
    INTERN(s__allowed, "_allowed");
    INTERN(s__why, "_why");
    INTERN(s__balance_factor, "_balance_factor");
    INTERN(s__shared_prefix, "_shared_prefix");
    INTERN(s__index, "_index");
    INTERN(s__capacities, "_capacities");
    INTERN(s__counts, "_counts");
    INTERN(s__new_blocks, "_new_blocks");
    INTERN(s__turnover_origin, "_turnover_origin");
    INTERN(s_turnover_half_life_s, "turnover_half_life_s");
    INTERN(s__turn, "_turn");
    INTERN(s_state, "state");
    INTERN(s_tracker, "tracker");
    INTERN(s_block_hashes, "block_hashes");
    INTERN(s_tables, "tables");
    INTERN(s_block_size, "block_size");
    INTERN(s_prompt_token_ids, "prompt_token_ids");
    INTERN(s_min_match_blocks, "min_match_blocks");
    INTERN(s_follow_min_fraction, "follow_min_fraction");
    INTERN(s__branch_points, "_branch_points");
    INTERN(s_prefill_weight, "prefill_weight");
    INTERN(s_queue_weight, "queue_weight");
    INTERN(s_balance_factor, "balance_factor");
    INTERN(s_balance_slack, "balance_slack");
    INTERN(s_follow_slack, "follow_slack");
    INTERN(s_follow_abs_slack, "follow_abs_slack");
    INTERN(s__name_hash, "_name_hash");
    INTERN(s__after_load_step, "_after_load_step");
    INTERN(s_learn_from_routing, "learn_from_routing");
    INTERN(s_table, "table");
    INTERN(s_hashes, "hashes");
    INTERN(s_pop, "pop");
    INTERN(s_popitem, "popitem");
    INTERN(s_last, "last");
    INTERN(s_precise, "precise");
    INTERN(s_on_routed, "on_routed");
    INTERN(s_approximate, "approximate");
    if ((one_int = PyLong_FromLong(1)) == NULL) return NULL;
#undef INTERN
    PyObject *msgspec = PyImport_ImportModule("msgspec");
    if (msgspec == NULL) return NULL;
    raw_type = PyObject_GetAttrString(msgspec, "Raw");
    Py_DECREF(msgspec);
    if (raw_type == NULL) return NULL;
    for (int c = 0; c < 0x20; c++) escaped[c] = 1;
    escaped['"'] = escaped['\\'] = 1;
    return PyModule_Create(&module);
}
