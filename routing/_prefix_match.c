/* The prefix table's hot loops in C: PrefixTable.match_lengths for a whole prompt in one call, and
 * PrefixTable.insert / remove (below).
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
#include <string.h>

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

static int get_buffer_flags(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what, int flags) {
    if (PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | flags) < 0)
        return -1;
    if (view->len % itemsize) {
        PyBuffer_Release(view);
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what,
                     view->len, itemsize);
        return -1;
    }
    return 0;
}

static int get_buffer(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, const char *what) {
    return get_buffer_flags(obj, view, itemsize, what, 0);
}

/* match_lengths(lines, records, keys, want, oldest_live, bits) -> list[int]
 *   keys: uint64 block hashes of the prompt; want: bitmask of the candidates' bits;
 *   oldest_live: stamps below it are expired guesses (0: nothing expires);
 *   bits: a tuple with each candidate's bit (-1: not in the table). */
static int kept_buffer(PyObject *obj, Py_buffer *out, Py_ssize_t itemsize, const char *what);

/* match_lengths' work; `keys_view`: the keys' buffer where the caller took it, else NULL. */
static PyObject *match_impl(PyObject *const *args, const Py_buffer *keys_view) {
    uint64_t want = PyLong_AsUnsignedLongLong(args[3]);
    long long oldest_live = PyLong_AsLongLong(args[4]);
    if (PyErr_Occurred())
        return NULL;
    if (!PyTuple_Check(args[5])) {
        PyErr_SetString(PyExc_TypeError, "bits must be a tuple");
        return NULL;
    }
    Py_buffer lines, records, keys;
    if (kept_buffer(args[0], &lines, 8 * 2 * SLOTS, "lines") < 0
        || kept_buffer(args[1], &records, (Py_ssize_t)sizeof(guess_record), "records") < 0)
        return NULL;
    if (keys_view != NULL)
        keys = *keys_view;
    else if (get_buffer(args[2], &keys, 8, "keys") < 0)
        return NULL;
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
    if (keys_view == NULL)
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

static PyObject *match_lengths(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6) {
        PyErr_SetString(PyExc_TypeError, "match_lengths(lines, records, keys, want, oldest_live, bits)");
        return NULL;
    }
    return match_impl(args, NULL);
}


/* ---- updates: PrefixTable.insert and .remove, step for step what the Python paths do -------------
 * (PrefixTable._insert_small, _ring_slots_small, _place_small then _place, _drop_bit_small; the
 * tests run the same operations through both and compare every array of the table). */

typedef struct {
    uint64_t *lines;       /* [nb * 8]: key, held, ... */
    guess_record *records; /* [nb * 4] */
    uint64_t nb;
    int64_t *sizes;        /* [64] blocks held per replica bit; written follows at +64 */
} table_view;

static inline uint64_t *key_at(const table_view *t, int64_t slot) {
    return t->lines + (slot >> 2) * (2 * SLOTS) + 2 * (slot & 3);
}

static inline void choices(const table_view *t, uint64_t key, uint64_t out[2]) {
    uint64_t mixed = key * MIX;
    out[0] = ((mixed & 0xFFFFFFFFULL) * t->nb) >> 32;
    out[1] = ((mixed >> 32) * t->nb) >> 32;
}

/* Flat slot of key, or -1. */
static int64_t find_slot(const table_view *t, uint64_t key) {
    uint64_t b[2];
    choices(t, key, b);
    for (int c = 0; c < 2; c++) {
        const uint64_t *line = t->lines + b[c] * (2 * SLOTS);
        for (int lane = 0; lane < SLOTS; lane++)
            if (line[2 * lane] == key)
                return (int64_t)(b[c] * SLOTS + lane);
    }
    return -1;
}

/* _drop_bit_small for one slot: 1 when the replica held it. */
static int drop_bit(table_view *t, int64_t slot, uint64_t bit) {
    uint64_t *k = key_at(t, slot);
    if (!(k[1] & bit))
        return 0;
    k[1] &= ~bit;
    t->records[slot].guessed &= ~bit;
    if (!k[1])
        k[0] = 0;
    return 1;
}

/* A set of nonzero uint64 keys, open addressing (the prompt's keys: dedupe and "protect"). */
typedef struct {
    uint64_t *cells;
    uint64_t mask;
} key_set;

static int set_init(key_set *s, Py_ssize_t n, uint64_t *stack_cells, uint64_t stack_size) {
    uint64_t size = 16;
    while (size < (uint64_t)n * 2)
        size <<= 1;
    if (size <= stack_size) {
        s->cells = stack_cells;
        memset(stack_cells, 0, size * sizeof(uint64_t));
    } else {
        s->cells = PyMem_Calloc(size, sizeof(uint64_t));
        if (s->cells == NULL)
            return -1;
    }
    s->mask = size - 1;
    return 0;
}

/* 1 if key was added, 0 if present. */
static int set_add(key_set *s, uint64_t key) {
    uint64_t i = (key * MIX) >> 40 & s->mask;
    while (s->cells[i]) {
        if (s->cells[i] == key)
            return 0;
        i = (i + 1) & s->mask;
    }
    s->cells[i] = key;
    return 1;
}

static int set_has(const key_set *s, uint64_t key) {
    uint64_t i = (key * MIX) >> 40 & s->mask;
    while (s->cells[i]) {
        if (s->cells[i] == key)
            return 1;
        i = (i + 1) & s->mask;
    }
    return 0;
}

static int count_keys(const table_view *t, uint64_t bucket) {
    const uint64_t *line = t->lines + bucket * (2 * SLOTS);
    int n = 0;
    for (int lane = 0; lane < SLOTS; lane++)
        n += line[2 * lane] != 0;
    return n;
}

/* _place_small / _place: keys (sorted, not in the table) into their less-full bucket as the buckets
 * stood before the round (first choice when equal), then the other as they stand after it; still no
 * room (_evict_into): the slot of the 8 with the oldest stamp is forgotten (every holder's size
 * drops) and taken. */
static int place(table_view *t, uint64_t *keys, Py_ssize_t n, uint64_t held, uint64_t guessed, uint32_t stamp) {
    int *fills = PyMem_Malloc(sizeof(int) * 2 * (size_t)(n ? n : 1));
    if (fills == NULL)
        return -1;
    for (int attempt = 0; attempt < 2 && n; attempt++) {
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t b[2];
            choices(t, keys[i], b);
            fills[2 * i] = count_keys(t, b[0]);
            fills[2 * i + 1] = count_keys(t, b[1]);
        }
        Py_ssize_t left = 0;
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t b[2];
            choices(t, keys[i], b);
            int f1 = fills[2 * i], f2 = fills[2 * i + 1];
            uint64_t bucket = (attempt == 0 ? f1 <= f2 : f1 > f2) ? b[0] : b[1];
            uint64_t *line = t->lines + bucket * (2 * SLOTS);
            int lane = 0;
            while (lane < SLOTS && line[2 * lane])
                lane++;
            if (lane == SLOTS) {
                keys[left++] = keys[i];
                continue;
            }
            line[2 * lane] = keys[i];
            line[2 * lane + 1] = held;
            guess_record *r = t->records + bucket * SLOTS + lane;
            r->guessed = guessed;
            r->stamp = stamp;
        }
        n = left;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        uint64_t b[2];
        choices(t, keys[i], b);
        int64_t victim = -1;
        uint32_t oldest = 0;
        for (int c = 0; c < 2; c++)
            for (int lane = 0; lane < SLOTS; lane++) {
                int64_t slot = (int64_t)(b[c] * SLOTS + lane);
                if (victim < 0 || t->records[slot].stamp < oldest) {
                    victim = slot;
                    oldest = t->records[slot].stamp;
                }
            }
        uint64_t *k = key_at(t, victim);
        for (uint64_t mask = k[1]; mask; mask &= mask - 1)
            t->sizes[__builtin_ctzll(mask)] -= 1;
        k[0] = keys[i];
        k[1] = held;
        t->records[victim].guessed = guessed;
        t->records[victim].stamp = stamp;
    }
    PyMem_Free(fills);
    return 0;
}

/* _ring_slots_small: `need` ring positions for new entries, unused ones first, then CLOCK victims
 * (a live entry touched since the hand last passed, or one of the keys being inserted, is passed
 * over and marked; the victims' bits are dropped once their window is done). */
static int ring_slots(table_view *t, uint64_t *ring_hashes, uint32_t *ring_seen, int64_t *ring_pos,
                      Py_ssize_t capacity, uint64_t bit, Py_ssize_t need, uint32_t tick,
                      const key_set *protect, int64_t *out) {
    int index = __builtin_ctzll(bit);
    Py_ssize_t fill = (Py_ssize_t)ring_pos[0], hand = (Py_ssize_t)ring_pos[1];
    Py_ssize_t take = need < capacity - fill ? need : capacity - fill;
    Py_ssize_t got = 0;
    for (; got < take; got++)
        out[got] = fill + got;
    ring_pos[0] = fill + take;
    need -= take;
    if (need <= 0)
        return 0;
    Py_ssize_t max_width = 2 * need > 64 ? 2 * need : 64;
    if (max_width > capacity)
        max_width = capacity;
    uint8_t *given = PyMem_Calloc((size_t)(capacity + 7) / 8, 1);
    int64_t *victim_pos = PyMem_Malloc(sizeof(int64_t) * 2 * (size_t)max_width);
    Py_ssize_t *recent = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)max_width);
    if (given == NULL || victim_pos == NULL || recent == NULL) {
        PyMem_Free(given);
        PyMem_Free(victim_pos);
        PyMem_Free(recent);
        PyErr_NoMemory();
        return -1;
    }
    int64_t *victim_slot = victim_pos + max_width;
    for (Py_ssize_t i = 0; i < got; i++)
        given[out[i] >> 3] |= (uint8_t)(1 << (out[i] & 7));
    int passes = 0;
    while (need > 0) {
        Py_ssize_t width = 2 * need > 64 ? 2 * need : 64;
        if (width > capacity)
            width = capacity;
        Py_ssize_t victims = 0, recents = 0;
        for (Py_ssize_t offset = 0; offset < width; offset++) {
            Py_ssize_t position = (hand + offset) % capacity;
            uint64_t key = ring_hashes[position] ? ring_hashes[position] : 1;
            int64_t slot = find_slot(t, key);
            int live = slot >= 0 && (key_at(t, slot)[1] & bit);
            if (live && ((passes < 2 && t->records[slot].stamp > ring_seen[position])
                         || (passes < 3 && set_has(protect, key)))) {
                recent[recents++] = offset;
            } else if (!(given[position >> 3] & (1 << (position & 7)))) {
                victim_pos[victims] = position;
                victim_slot[victims] = live ? slot : -1;
                victims++;
                if (victims == need)
                    break;
            }
        }
        /* the window ends at its last victim (all of it when it has none) */
        Py_ssize_t last = victims ? (victim_pos[victims - 1] - hand + capacity) % capacity + 1 : width;
        for (Py_ssize_t r = 0; r < recents; r++)
            if (recent[r] < last)
                ring_seen[(hand + recent[r]) % capacity] = tick;
        int dropped = 0;
        for (Py_ssize_t v = 0; v < victims; v++) {
            given[victim_pos[v] >> 3] |= (uint8_t)(1 << (victim_pos[v] & 7));
            if (victim_slot[v] >= 0)
                dropped += drop_bit(t, victim_slot[v], bit);
            out[got++] = victim_pos[v];
        }
        t->sizes[index] -= dropped;
        need -= victims;
        hand = (hand + last) % capacity;
        passes += last == width ? 1 : 0;
    }
    ring_pos[1] = hand;
    PyMem_Free(given);
    PyMem_Free(victim_pos);
    PyMem_Free(recent);
    return 0;
}

typedef struct {
    Py_buffer view;
    int held;
} buffer_hold;

static void release_all(buffer_hold *holds, int n) {
    for (int i = 0; i < n; i++)
        if (holds[i].held)
            PyBuffer_Release(&holds[i].view);
}

/* The table's arrays' buffers, taken once and kept while the array lives: a numpy buffer export
 * costs ~400 instructions, and a request takes one of ~10 long-lived arrays (its table's lines,
 * records and counts, the chosen replica's ring) a few times. Direct-mapped by address: the kept
 * view holds a reference, so an address names one array while it is kept. A slot whose array only
 * this cache still holds (the table grew, a ring was replaced) is released when a lookup's sweep
 * passes it, or when another array takes its slot. */
#define KEPT_SLOTS 128
static Py_buffer kept[KEPT_SLOTS];
static unsigned kept_sweep;

static void kept_release(Py_buffer *view) {
    if (view->obj != NULL)
        PyBuffer_Release(view);  /* drops view->obj */
    memset(view, 0, sizeof(*view));
}

static int kept_buffer(PyObject *obj, Py_buffer *out, Py_ssize_t itemsize, const char *what) {
    Py_buffer *slot = &kept[((uintptr_t)obj >> 4) % KEPT_SLOTS];
    if (slot->obj != obj) {
        Py_buffer *old = &kept[kept_sweep++ % KEPT_SLOTS];
        if (old->obj != NULL && old != slot && Py_REFCNT(old->obj) == 1)
            kept_release(old);
        kept_release(slot);
        if (get_buffer_flags(obj, slot, itemsize, what, PyBUF_WRITABLE) < 0) {
            memset(slot, 0, sizeof(*slot));
            return -1;
        }
    } else if (slot->len % itemsize) {  /* the same array read as another item size */
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes is not a whole number of %zd-byte items", what, slot->len,
                     itemsize);
        return -1;
    }
    *out = *slot;  /* a copy to read from: not released (held = 0) */
    return 0;
}

/* The buffers of args[0..n): the table's arrays, written (writable, kept: kept_buffer), then the
 * keys, last, only read: from `keys` where the caller took them already, else taken here. On
 * failure every buffer taken is released and the error set. */
static int hold_all(buffer_hold *h, PyObject *const *args, const char *const *names, const Py_ssize_t *itemsizes,
                    int n, const Py_buffer *keys) {
    memset(h, 0, sizeof(buffer_hold) * (size_t)n);
    for (int i = 0; i < n - 1; i++)
        if (kept_buffer(args[i], &h[i].view, itemsizes[i], names[i]) < 0)
            return -1;
    if (keys != NULL) {
        h[n - 1].view = *keys;
        return 0;
    }
    if (get_buffer_flags(args[n - 1], &h[n - 1].view, itemsizes[n - 1], names[n - 1], 0) < 0)
        return -1;
    h[n - 1].held = 1;
    return 0;
}

/* The replica bit argument, in [0, 64). */
static int index_arg(PyObject *arg, long *index) {
    *index = PyLong_AsLong(arg);
    if (*index == -1 && PyErr_Occurred())
        return -1;
    if (*index < 0 || *index >= 64) {
        PyErr_SetString(PyExc_ValueError, "index must be in [0, 64)");
        return -1;
    }
    return 0;
}

/* The table's view from its lines, records and counts buffers, checked to fit together. */
static int table_of(table_view *t, const Py_buffer *lines, const Py_buffer *records, const Py_buffer *counts) {
    t->lines = lines->buf;
    t->records = records->buf;
    t->nb = (uint64_t)(lines->len / (8 * 2 * SLOTS));
    t->sizes = counts->buf;
    if (t->nb == 0 || records->len / (Py_ssize_t)sizeof(guess_record) != (Py_ssize_t)t->nb * SLOTS
        || counts->len != 8 * 128) {
        PyErr_SetString(PyExc_ValueError, "the table's arrays do not fit together");
        return -1;
    }
    return 0;
}

/* insert(lines, records, ring_hashes, ring_seen, ring_pos, counts, keys, index, guessed, tick) -> int
 *   ring_pos: int64 [fill, hand]; counts: int64 [2, 64] (blocks held, blocks ever written, per
 *   replica bit); keys: uint64 block hashes in prompt order. Returns the entries the ring took. */
static PyObject *insert_impl(PyObject *const *args, const Py_buffer *keys_view) {
    long index;
    if (index_arg(args[7], &index) < 0)
        return NULL;
    int guessed = PyObject_IsTrue(args[8]);
    long long tick_ll = PyLong_AsLongLong(args[9]);
    if (PyErr_Occurred())
        return NULL;
    static const char *const names[7] = {"lines", "records", "ring_hashes", "ring_seen", "ring_pos", "counts", "keys"};
    static const Py_ssize_t itemsizes[7] = {8 * 2 * SLOTS, (Py_ssize_t)sizeof(guess_record), 8, 4, 8, 8, 8};
    buffer_hold h[7];
    if (hold_all(h, args, names, itemsizes, 7, keys_view) < 0)
        return NULL;
    table_view t;
    uint64_t *ring_hashes = h[2].view.buf;
    uint32_t *ring_seen = h[3].view.buf;
    int64_t *ring_pos = h[4].view.buf;
    const uint64_t *in = h[6].view.buf;
    Py_ssize_t n_in = h[6].view.len / 8, capacity = h[2].view.len / 8;
    if (table_of(&t, &h[0].view, &h[1].view, &h[5].view) < 0) {
        release_all(h, 7);
        return NULL;
    }
    if (capacity == 0 || h[3].view.len / 4 != capacity || h[4].view.len != 16) {
        release_all(h, 7);
        PyErr_SetString(PyExc_ValueError, "insert: the ring's arrays do not fit together");
        return NULL;
    }
    uint64_t bit = 1ULL << index;
    uint32_t tick = (uint32_t)(tick_ll < 0 ? 0 : tick_ll > 0xFFFFFFFFLL ? 0xFFFFFFFFLL : tick_ll);
    uint64_t stack_cells[256];
    key_set protect;
    uint64_t *keys = NULL, *entries = NULL, *fresh = NULL;
    int64_t *slots = NULL;
    Py_ssize_t added = 0;
    if (set_init(&protect, n_in, stack_cells, 256) < 0) {
        release_all(h, 7);
        return PyErr_NoMemory();
    }
    keys = PyMem_Malloc(sizeof(uint64_t) * 3 * (size_t)(n_in ? n_in : 1));
    slots = PyMem_Malloc(sizeof(int64_t) * (size_t)(n_in ? n_in : 1));
    if (keys == NULL || slots == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    entries = keys + n_in;
    fresh = entries + n_in;
    /* _ring_order: distinct keys, the prompt's last block first; the earliest `capacity` kept. */
    Py_ssize_t n = 0;
    for (Py_ssize_t i = n_in - 1; i >= 0; i--) {
        uint64_t key = in[i] ? in[i] : 1;
        if (set_add(&protect, key))
            keys[n++] = key;
    }
    if (n > capacity) {
        memmove(keys, keys + (n - capacity), sizeof(uint64_t) * (size_t)capacity);
        n = capacity;
        memset(protect.cells, 0, sizeof(uint64_t) * (size_t)(protect.mask + 1));
        for (Py_ssize_t i = 0; i < n; i++)
            set_add(&protect, keys[i]);
    }
    Py_ssize_t n_entries = 0, n_fresh = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = find_slot(&t, keys[i]);
        if (slot < 0) {
            fresh[n_fresh++] = keys[i];
            entries[n_entries++] = keys[i];
            continue;
        }
        uint64_t *k = key_at(&t, slot);
        guess_record *r = t.records + slot;
        if (!(k[1] & bit)) {
            k[1] |= bit;
            entries[n_entries++] = keys[i];
            if (guessed)
                r->guessed |= bit;
        }
        if (!guessed)
            r->guessed &= ~bit;
        r->stamp = tick;
    }
    if (n_entries == 0)
        goto done;
    if (ring_slots(&t, ring_hashes, ring_seen, ring_pos, capacity, bit, n_entries, tick, &protect, slots) < 0)
        goto done;
    for (Py_ssize_t i = 0; i < n_entries; i++) {
        ring_hashes[slots[i]] = entries[i];
        ring_seen[slots[i]] = tick;
    }
    t.sizes[index] += n_entries;
    t.sizes[64 + index] += n_entries;
    added = n_entries;
    if (n_fresh) {
        /* sorted, as the Python paths place them */
        for (Py_ssize_t i = 1; i < n_fresh; i++) {
            uint64_t key = fresh[i];
            Py_ssize_t j = i;
            while (j > 0 && fresh[j - 1] > key) {
                fresh[j] = fresh[j - 1];
                j--;
            }
            fresh[j] = key;
        }
        if (place(&t, fresh, n_fresh, bit, guessed ? bit : 0, tick) < 0)
            PyErr_NoMemory();
    }
done:
    if (protect.cells != stack_cells)
        PyMem_Free(protect.cells);
    PyMem_Free(keys);
    PyMem_Free(slots);
    release_all(h, 7);
    if (PyErr_Occurred())
        return NULL;
    return PyLong_FromSsize_t(added);
}

static PyObject *insert(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "insert(lines, records, ring_hashes, ring_seen, ring_pos, counts, keys, index, guessed, tick)");
        return NULL;
    }
    return insert_impl(args, NULL);
}

/* remove(lines, records, counts, keys, index) -> int: the replica no longer holds these blocks
 * (duplicates and blocks it did not hold are ignored). Returns how many it held. */
static PyObject *remove_keys(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "remove(lines, records, counts, keys, index)");
        return NULL;
    }
    long index;
    if (index_arg(args[4], &index) < 0)
        return NULL;
    static const char *const names[4] = {"lines", "records", "counts", "keys"};
    static const Py_ssize_t itemsizes[4] = {8 * 2 * SLOTS, (Py_ssize_t)sizeof(guess_record), 8, 8};
    buffer_hold h[4];
    if (hold_all(h, args, names, itemsizes, 4, NULL) < 0)
        return NULL;
    table_view t;
    if (table_of(&t, &h[0].view, &h[1].view, &h[2].view) < 0) {
        release_all(h, 4);
        return NULL;
    }
    const uint64_t *keys = h[3].view.buf;
    Py_ssize_t n = h[3].view.len / 8, dropped = 0;
    uint64_t bit = 1ULL << index;
    for (Py_ssize_t i = 0; i < n; i++) {
        int64_t slot = find_slot(&t, keys[i] ? keys[i] : 1);
        if (slot >= 0)
            dropped += drop_bit(&t, slot, bit);
    }
    t.sizes[index] -= dropped;
    release_all(h, 4);
    return PyLong_FromSsize_t(dropped);
}

/* ---- the table's own calls: PrefixTable.match_lengths and insert(guessed=True) over its attributes ---
 * table_match(table, keys, now, candidates) -> list[int] | None
 * table_guess(table, replica, keys, now) -> int | None
 * What the PrefixTable methods do before their C call (the candidates' bits from the table's memo,
 * the clock tick, the expiry bound, the replica's ring and bit), here instead of in ~100 Python
 * opcodes each, for cache_aware's choose and commit on every request. `keys`: a uint64 array or a
 * list of ints (take_keys). None where the method must serve (the table's native switch off, keys
 * of another kind, candidates not memoised yet): the caller then calls it. table_guess raises KeyError for a replica the table lacks, as
 * insert does. */

static PyObject *s_native, *s_bits_memo, *s_guess_ttl_ticks, *s_guessing, *s_t0, *s_lines, *s_gs, *s_rings,
    *s_index, *s_counts, *s_hashes, *s_seen, *s_pos;

/* The keys' buffer where they are a C-contiguous uint64 array (the gateway's block hashes): 1 and
 * `view` taken (the caller releases it), else 0 and nothing held. */
static int u64_keys(PyObject *keys, Py_buffer *view) {
    if (PyObject_GetBuffer(keys, view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyErr_Clear();
        return 0;
    }
    const char *f = view->format ? view->format : "B";
    if (*f == '<' || *f == '=' || *f == '@') f++;
    if (view->itemsize == 8 && (strcmp(f, "Q") == 0 || strcmp(f, "L") == 0))
        return 1;
    PyBuffer_Release(view);
    return 0;
}

/* A prompt's keys as uint64s: a uint64 array's buffer read in place, or a list or tuple of ints
 * (the gateway's block hashes as routing/hashing.py gives them: no array made a request) copied to
 * `store` or a PyMem block, each 0 read as the 1 the table stores it as (as_block_keys). */
#define KEYS_ON_STACK 64
typedef struct {
    Py_buffer view;  /* the keys: buf, len */
    int held;        /* view is an export to release */
    uint64_t *owned;
    uint64_t store[KEYS_ON_STACK];
} keys_arg;

/* An int in [0, 2**64) as a uint64: 1, else 0 (nothing set). The hashes are 64-bit: CPython 3.11
 * keeps them in three 30-bit digits, read here in place (PyLong_AsUnsignedLongLong goes through
 * _PyLong_AsByteArray for any int over one digit, ~5x the cost: 500 blocks of an 8k prompt). */
static inline int u64_of(PyObject *item, uint64_t *out) {
    if (!PyLong_CheckExact(item)) return 0;
#if PY_VERSION_HEX < 0x030C0000 && PYLONG_BITS_IN_DIGIT == 30
    Py_ssize_t size = Py_SIZE(item);
    const digit *d = ((PyLongObject *)item)->ob_digit;
    if (size >= 0 && size <= 3 && (size < 3 || d[2] < 16)) {
        uint64_t value = 0;
        for (Py_ssize_t i = size - 1; i >= 0; i--) value = (value << 30) | d[i];
        *out = value;
        return 1;
    }
    if (size > 0 && size <= 3) return 0;
#endif
    unsigned long long value = PyLong_AsUnsignedLongLong(item);
    if (value == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        return 0;
    }
    *out = value;
    return 1;
}

/* 1: `k` holds the keys (release with drop_keys); 0: not such keys, nothing held and no error (the
 * method serves them); -1: an error set. */
static int take_keys(PyObject *obj, keys_arg *k) {
    k->held = 0;
    k->owned = NULL;
    if (PyList_CheckExact(obj) || PyTuple_CheckExact(obj)) {
        Py_ssize_t n = PySequence_Fast_GET_SIZE(obj);
        uint64_t *data = k->store;
        if (n > KEYS_ON_STACK && (data = k->owned = PyMem_Malloc(sizeof(uint64_t) * (size_t)n)) == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        PyObject **items = PySequence_Fast_ITEMS(obj);
        for (Py_ssize_t i = 0; i < n; i++) {
            uint64_t key;
            if (!u64_of(items[i], &key)) {  /* not a uint64 int: the method's conversion says what is wrong */
                PyMem_Free(k->owned);
                k->owned = NULL;
                return 0;
            }
            data[i] = key ? key : 1;
        }
        memset(&k->view, 0, sizeof(k->view));
        k->view.buf = data;
        k->view.len = 8 * n;
        k->view.itemsize = 8;
        return 1;
    }
    if (!u64_keys(obj, &k->view)) return 0;
    k->held = 1;
    return 1;
}

static void drop_keys(keys_arg *k) {
    if (k->held) PyBuffer_Release(&k->view);
    PyMem_Free(k->owned);
}

/* The table's clock tick at `now` (PrefixTable._tick: its origin set by the first call). */
static int tick_of(PyObject *table, double now, long long *tick) {
    PyObject *t0_obj = PyObject_GetAttr(table, s_t0);
    if (t0_obj == NULL) return -1;
    double t0;
    if (t0_obj == Py_None) {
        PyObject *origin = PyFloat_FromDouble(now);
        int rc = origin == NULL ? -1 : PyObject_SetAttr(table, s_t0, origin);
        Py_XDECREF(origin);
        t0 = now;
        if (rc < 0) {
            Py_DECREF(t0_obj);
            return -1;
        }
    } else {
        t0 = PyFloat_AsDouble(t0_obj);
        if (t0 == -1.0 && PyErr_Occurred()) {
            Py_DECREF(t0_obj);
            return -1;
        }
    }
    Py_DECREF(t0_obj);
    long long value = (long long)((now - t0) * 100.0);  /* TICKS_PER_S; truncated as int() does */
    *tick = value > 0 ? value : 0;
    return 0;
}

/* 1 where table.native is true, 0 where not, -1 on error. */
static int native_on(PyObject *table) {
    PyObject *flag = PyObject_GetAttr(table, s_native);
    if (flag == NULL) return -1;
    int on = PyObject_IsTrue(flag);
    Py_DECREF(flag);
    return on;
}

static PyObject *table_match(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "table_match(table, keys, now, candidates)");
        return NULL;
    }
    PyObject *table = args[0], *keys = args[1];
    double now = PyFloat_AsDouble(args[2]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    int on = native_on(table);
    if (on <= 0) return on < 0 ? NULL : Py_NewRef(Py_None);
    PyObject *memo_dict = PyObject_GetAttr(table, s_bits_memo);
    if (memo_dict == NULL) return NULL;
    PyObject *key = PySequence_Tuple(args[3]);
    PyObject *memo = key == NULL || !PyDict_Check(memo_dict) ? NULL : PyDict_GetItemWithError(memo_dict, key);
    Py_XINCREF(memo);
    Py_XDECREF(key);
    Py_DECREF(memo_dict);
    if (memo == NULL) return PyErr_Occurred() ? NULL : Py_NewRef(Py_None);
    keys_arg view;
    int have_keys = take_keys(keys, &view);
    if (have_keys <= 0) {
        Py_DECREF(memo);
        return have_keys < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *out = NULL, *ttl_obj = NULL, *guessing_obj = NULL, *oldest = NULL, *lines = NULL, *gs = NULL;
    if (!PyTuple_Check(memo) || PyTuple_GET_SIZE(memo) != 2) {
        PyErr_SetString(PyExc_TypeError, "table_match: the bits memo holds (bits, want) tuples");
        goto done;
    }
    PyObject *bits = PyTuple_GET_ITEM(memo, 0), *want = PyTuple_GET_ITEM(memo, 1);
    if ((ttl_obj = PyObject_GetAttr(table, s_guess_ttl_ticks)) == NULL
        || (guessing_obj = PyObject_GetAttr(table, s_guessing)) == NULL)
        goto done;
    long long ttl = PyLong_AsLongLong(ttl_obj);
    unsigned long long guessing = PyLong_AsUnsignedLongLongMask(guessing_obj), wanted = PyLong_AsUnsignedLongLongMask(want);
    if (PyErr_Occurred()) goto done;
    long long oldest_live = 0;  /* PrefixTable._oldest_live */
    if (ttl && (guessing & wanted)) {
        long long tick;
        if (tick_of(table, now, &tick) < 0) goto done;
        oldest_live = tick - ttl > 0 ? tick - ttl : 0;
    }
    if ((oldest = PyLong_FromLongLong(oldest_live)) == NULL || (lines = PyObject_GetAttr(table, s_lines)) == NULL
        || (gs = PyObject_GetAttr(table, s_gs)) == NULL)
        goto done;
    PyObject *call[6] = {lines, gs, keys, want, oldest, bits};
    out = match_impl(call, &view.view);
done:
    drop_keys(&view);
    Py_DECREF(memo);
    Py_XDECREF(ttl_obj);
    Py_XDECREF(guessing_obj);
    Py_XDECREF(oldest);
    Py_XDECREF(lines);
    Py_XDECREF(gs);
    return out;
}

static PyObject *table_guess(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "table_guess(table, replica, keys, now)");
        return NULL;
    }
    PyObject *table = args[0], *replica = args[1], *keys = args[2];
    double now = PyFloat_AsDouble(args[3]);
    if (now == -1.0 && PyErr_Occurred()) return NULL;
    PyObject *rings = PyObject_GetAttr(table, s_rings);
    if (rings == NULL) return NULL;
    PyObject *ring = PyObject_GetItem(rings, replica);  /* KeyError: not a replica of this table */
    Py_DECREF(rings);
    if (ring == NULL) return NULL;
    PyObject *out = NULL, *index_dict = NULL, *index = NULL, *guessing = NULL, *more = NULL, *tick_obj = NULL;
    PyObject *arrays[6] = {NULL};  /* lines, records, ring hashes, ring seen, ring pos, counts */
    keys_arg view;
    int on = native_on(table), have_keys = on > 0 ? take_keys(keys, &view) : on;
    if (have_keys <= 0) {
        if (have_keys == 0) out = Py_NewRef(Py_None);
        goto done;
    }
    if (view.view.len == 0) {
        out = PyLong_FromLong(0);
        goto done;
    }
    if ((index_dict = PyObject_GetAttr(table, s_index)) == NULL || (index = PyObject_GetItem(index_dict, replica)) == NULL)
        goto done;
    long bit = PyLong_AsLong(index);
    if ((bit == -1 && PyErr_Occurred()) || (guessing = PyObject_GetAttr(table, s_guessing)) == NULL) goto done;
    if (bit < 0 || bit >= 64) {
        PyErr_SetString(PyExc_ValueError, "table_guess: a replica's bit is in [0, 64)");
        goto done;
    }
    PyObject *mask = PyLong_FromUnsignedLongLong(1ULL << bit);
    more = mask == NULL ? NULL : PyNumber_Or(guessing, mask);  /* PrefixTable._guessing |= 1 << index */
    Py_XDECREF(mask);
    if (more == NULL || PyObject_SetAttr(table, s_guessing, more) < 0) goto done;
    long long tick;
    if (tick_of(table, now, &tick) < 0 || (tick_obj = PyLong_FromLongLong(tick)) == NULL) goto done;
    PyObject *owners[6] = {table, table, ring, ring, ring, table};
    PyObject *names[6] = {s_lines, s_gs, s_hashes, s_seen, s_pos, s_counts};
    for (int i = 0; i < 6; i++)
        if ((arrays[i] = PyObject_GetAttr(owners[i], names[i])) == NULL) goto done;
    PyObject *call[10] = {arrays[0], arrays[1], arrays[2], arrays[3], arrays[4], arrays[5], keys, index, Py_True,
                          tick_obj};
    out = insert_impl(call, &view.view);
done:
    if (have_keys > 0)
        drop_keys(&view);
    Py_DECREF(ring);
    Py_XDECREF(index_dict);
    Py_XDECREF(index);
    Py_XDECREF(guessing);
    Py_XDECREF(more);
    Py_XDECREF(tick_obj);
    for (int i = 0; i < 6; i++) Py_XDECREF(arrays[i]);
    return out;
}

static PyMethodDef methods[] = {
    {"insert", (PyCFunction)(void (*)(void))insert, METH_FASTCALL,
     "Record that a replica holds these blocks (see PrefixTable.insert)."},
    {"remove", (PyCFunction)(void (*)(void))remove_keys, METH_FASTCALL,
     "A replica no longer holds these blocks (see PrefixTable.remove)."},
    {"match_lengths", (PyCFunction)(void (*)(void))match_lengths, METH_FASTCALL,
     "Matched prefix length in blocks of each candidate (see routing/prefix_table.py)."},
    {"table_match", (PyCFunction)(void (*)(void))table_match, METH_FASTCALL,
     "PrefixTable.match_lengths over the table's attributes; None where the method must serve."},
    {"table_guess", (PyCFunction)(void (*)(void))table_guess, METH_FASTCALL,
     "PrefixTable.insert(guessed=True) over the table's attributes; None where the method must serve."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_prefix_match", NULL, -1, methods};

PyMODINIT_FUNC PyInit__prefix_match(void) {
#define INTERN(var, text) if ((var = PyUnicode_InternFromString(text)) == NULL) return NULL
    INTERN(s_native, "native");
    INTERN(s_bits_memo, "_bits_memo");
    INTERN(s_guess_ttl_ticks, "guess_ttl_ticks");
    INTERN(s_guessing, "_guessing");
    INTERN(s_t0, "_t0");
    INTERN(s_lines, "_lines");
    INTERN(s_gs, "_gs");
    INTERN(s_rings, "_rings");
    INTERN(s_index, "_index");
    INTERN(s_counts, "_counts");
    INTERN(s_hashes, "hashes");
    INTERN(s_seen, "seen");
    INTERN(s_pos, "pos");
#undef INTERN
    return PyModule_Create(&module);
}
