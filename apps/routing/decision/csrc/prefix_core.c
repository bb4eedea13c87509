/* The prefix index's per-digest state in flat tables (apps/routing/decision/index.py,
 * ``NativePrefixIndex``): what the pure-Python index keeps in five dicts and one OrderedDict per
 * rank, where every digest of every request costs ~10 probes of large dicts whose keys are
 * boxed ints.
 *
 * - the digest table: digest -> its holders (a bitset of rank slots), its first child and
 *   whether it branches (a digest is in it exactly while some rank holds it);
 * - one table per rank: digest -> its last use, threaded on a doubly linked list in LRU order
 *   (the head the least recently used);
 * - the lost tables: digest -> the ranks that held it and lost it, the recent half and the one
 *   before (the index's ``lost`` and ``lost_before``).
 *
 * Digests are unsigned 64-bit ints (xxh64). Rank slots are small ints the Python side assigns
 * (never reused); the bitsets grow a word at a time as slots are assigned. Open addressing with
 * linear probing, at most half full, deleting by moving back what probed past the hole (no
 * tombstones); a rank's list links slot indices, relinked when a node moves. The
 * semantics are the pure-Python index's, operation by operation: tests/routing/test_index.py
 * runs both and compares them on random operation sequences. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define EMPTY 0
#define USED 1

static inline uint64_t mix(uint64_t x) { /* splitmix64's finalizer: tests use small digests */
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ULL;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebULL;
    x ^= x >> 31;
    return x;
}

/* ----- a table of digests, each with a bitset of ``words`` words ----------------------------- */
/* An entry and its bitset lie together (``stride`` bytes: 32 for up to 64 ranks), so a probe
 * touches one cache line, not one in the entries and one in a separate array of bitsets. */
typedef struct {
    uint64_t key;
    uint64_t first_child;
    uint8_t state, has_child, branching;
} Entry; /* followed by its ``words`` bitset words */

typedef struct {
    char *e; /* cap entries of ``stride`` bytes */
    Py_ssize_t cap, used, stride;
    int words;
} Table;

#define ENTRY(t, i) ((Entry *)((t)->e + (i) * (t)->stride))
#define BITS(t, i) ((uint64_t *)((t)->e + (i) * (t)->stride + sizeof(Entry)))

static int table_init(Table *t, Py_ssize_t cap, int words) {
    t->stride = sizeof(Entry) + words * sizeof(uint64_t);
    t->e = PyMem_Calloc(cap, t->stride);
    t->cap = cap;
    t->used = 0;
    t->words = words;
    if (!t->e) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static void table_free(Table *t) {
    PyMem_Free(t->e);
    t->e = NULL;
    t->cap = t->used = 0;
}

static inline Py_ssize_t home(const Table *t, uint64_t key) {
    return (Py_ssize_t)(mix(key) & (uint64_t)(t->cap - 1));
}

static Py_ssize_t table_find(const Table *t, uint64_t key) {
    Py_ssize_t mask = t->cap - 1, i = home(t, key);
    for (;;) {
        const Entry *e = ENTRY(t, i);
        if (e->state == EMPTY) return -1;
        if (e->state == USED && e->key == key) return i;
        i = (i + 1) & mask;
    }
}

/* the same entries in a table of ``cap`` entries with bitsets of ``words`` words (>= its own) */
static int table_resize(Table *t, Py_ssize_t cap, int words) {
    Table n;
    if (table_init(&n, cap, words) < 0) return -1;
    Py_ssize_t mask = cap - 1;
    for (Py_ssize_t i = 0; i < t->cap; i++) {
        Entry *old = ENTRY(t, i);
        if (old->state != USED) continue;
        Py_ssize_t j = home(&n, old->key);
        while (ENTRY(&n, j)->state != EMPTY) j = (j + 1) & mask;
        memcpy(ENTRY(&n, j), old, sizeof(Entry) + t->words * sizeof(uint64_t));
        n.used++;
    }
    table_free(t);
    *t = n;
    return 0;
}

/* the entry of ``key``, added (empty bitset, no child) when absent; -1 on no memory */
static Py_ssize_t table_add(Table *t, uint64_t key) {
    Py_ssize_t found = table_find(t, key);
    if (found >= 0) return found;
    if ((t->used + 1) * 2 > t->cap) { /* at most half full: a probe for an absent key is short */
        if (table_resize(t, t->cap * 2, t->words) < 0) return -1;
    }
    Py_ssize_t mask = t->cap - 1, i = home(t, key);
    while (ENTRY(t, i)->state == USED) i = (i + 1) & mask;
    Entry *e = ENTRY(t, i);
    memset(e, 0, t->stride);
    e->key = key;
    e->state = USED;
    t->used++;
    return i;
}

/* in the cyclic range (from, to]: where linear probing may move an entry of home ``k`` back */
static inline int between(Py_ssize_t from, Py_ssize_t k, Py_ssize_t to) {
    return from <= to ? (from < k && k <= to) : (from < k || k <= to);
}

/* delete entry ``i``, moving back the entries after it that probed past it (no tombstones: a
 * full index evicts as many digests as it takes, and tombstones would lengthen every probe) */
static void table_del(Table *t, Py_ssize_t i) {
    Py_ssize_t mask = t->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        Entry *e = ENTRY(t, j);
        if (e->state == EMPTY) break;
        if (between(i, home(t, e->key), j)) continue;
        memcpy(ENTRY(t, i), e, t->stride);
        i = j;
    }
    ENTRY(t, i)->state = EMPTY;
    t->used--;
}

static void table_clear(Table *t) {
    memset(t->e, 0, t->cap * t->stride);
    t->used = 0;
}

static int widen(Table *t, int words) { /* the same entries, bitsets of ``words`` words */
    return table_resize(t, t->cap, words);
}

static inline void table_prefetch(const Table *t, uint64_t key) {
    __builtin_prefetch(ENTRY(t, home(t, key)));
}

static inline int bits_empty(const uint64_t *b, int words) {
    for (int w = 0; w < words; w++)
        if (b[w]) return 0;
    return 1;
}

/* ----- one rank's LRU --------------------------------------------------------------------------- */
typedef struct {
    uint64_t key;
    double t;
    int32_t prev, next;
    uint8_t state;
} Node;

typedef struct {
    Node *n;
    Py_ssize_t cap, used;
    int32_t head, tail; /* head: least recently used */
    int present;        /* the rank has an LRU (the pure index's ``key in ranks``) */
} Rank;

static int rank_init(Rank *r, Py_ssize_t cap) {
    r->n = PyMem_Calloc(cap, sizeof(Node));
    if (!r->n) {
        PyErr_NoMemory();
        return -1;
    }
    r->cap = cap;
    r->used = 0;
    r->head = r->tail = -1;
    r->present = 1;
    return 0;
}

static void rank_free(Rank *r) {
    PyMem_Free(r->n);
    r->n = NULL;
    r->cap = r->used = 0;
    r->head = r->tail = -1;
    r->present = 0;
}

static Py_ssize_t rank_find(const Rank *r, uint64_t key) {
    if (!r->n) return -1;
    Py_ssize_t mask = r->cap - 1, i = (Py_ssize_t)(mix(key) & (uint64_t)mask);
    for (;;) {
        const Node *n = &r->n[i];
        if (n->state == EMPTY) return -1;
        if (n->state == USED && n->key == key) return i;
        i = (i + 1) & mask;
    }
}

static void rank_unlink(Rank *r, int32_t i) {
    Node *n = &r->n[i];
    if (n->prev >= 0) r->n[n->prev].next = n->next;
    else r->head = n->next;
    if (n->next >= 0) r->n[n->next].prev = n->prev;
    else r->tail = n->prev;
    n->prev = n->next = -1;
}

static void rank_link_tail(Rank *r, int32_t i) {
    Node *n = &r->n[i];
    n->prev = r->tail;
    n->next = -1;
    if (r->tail >= 0) r->n[r->tail].next = i;
    else r->head = i;
    r->tail = i;
}

static int rank_resize(Rank *r, Py_ssize_t cap) {
    Rank n;
    if (rank_init(&n, cap) < 0) return -1;
    Py_ssize_t mask = cap - 1;
    for (int32_t i = r->head; i >= 0; i = r->n[i].next) {
        Py_ssize_t j = (Py_ssize_t)(mix(r->n[i].key) & (uint64_t)mask);
        while (n.n[j].state != EMPTY) j = (j + 1) & mask;
        n.n[j].key = r->n[i].key;
        n.n[j].t = r->n[i].t;
        n.n[j].state = USED;
        rank_link_tail(&n, (int32_t)j);
        n.used++;
    }
    PyMem_Free(r->n);
    *r = n;
    return 0;
}

/* append ``key`` (absent) as the most recent, last used at ``t``; -1 on no memory */
static int rank_append(Rank *r, uint64_t key, double t) {
    if (!r->n && rank_init(r, 16) < 0) return -1;
    if ((r->used + 1) * 2 > r->cap) {
        Py_ssize_t cap = r->cap * 2;
        if (cap > INT32_MAX) {
            PyErr_SetString(PyExc_MemoryError, "a rank's index is full");
            return -1;
        }
        if (rank_resize(r, cap) < 0) return -1;
    }
    Py_ssize_t mask = r->cap - 1, i = (Py_ssize_t)(mix(key) & (uint64_t)mask);
    while (r->n[i].state == USED) i = (i + 1) & mask;
    r->n[i].key = key;
    r->n[i].t = t;
    r->n[i].state = USED;
    rank_link_tail(r, (int32_t)i);
    r->used++;
    return 0;
}

static void rank_move(Rank *r, int32_t from, int32_t to) { /* a node to another slot, relinked */
    r->n[to] = r->n[from];
    Node *n = &r->n[to];
    if (n->prev >= 0) r->n[n->prev].next = to;
    else r->head = to;
    if (n->next >= 0) r->n[n->next].prev = to;
    else r->tail = to;
}

/* delete node ``i`` (backward shift, as ``table_del``): other nodes may move to other slots */
static void rank_del(Rank *r, int32_t i) {
    rank_unlink(r, i);
    Py_ssize_t mask = r->cap - 1, j = i;
    for (;;) {
        j = (j + 1) & mask;
        if (r->n[j].state == EMPTY) break;
        if (between(i, (Py_ssize_t)(mix(r->n[j].key) & (uint64_t)mask), j)) continue;
        rank_move(r, (int32_t)j, i);
        i = (int32_t)j;
    }
    r->n[i].state = EMPTY;
    r->n[i].prev = r->n[i].next = -1;
    r->used--;
}

static inline void rank_prefetch(const Rank *r, uint64_t key) {
    if (r->n) __builtin_prefetch(&r->n[mix(key) & (uint64_t)(r->cap - 1)]);
}

#define AHEAD 16 /* digests whose table lines are asked for before they are needed */

/* ----- the core -------------------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    Table digests; /* holders, first child, branching */
    Table lost, lost_before;
    Rank *ranks;
    int nranks; /* slots with a Rank allocated (present or not) */
    int words;  /* bitset words: slots < 64 * words */
    Py_ssize_t lost_cap;
} Core;

static int ensure_slot(Core *c, int slot) {
    if (slot < 0) {
        PyErr_SetString(PyExc_ValueError, "a rank slot is a non-negative int");
        return -1;
    }
    if (slot >= c->nranks) {
        Rank *ranks = PyMem_Realloc(c->ranks, (slot + 1) * sizeof(Rank));
        if (!ranks) {
            PyErr_NoMemory();
            return -1;
        }
        for (int i = c->nranks; i <= slot; i++) {
            memset(&ranks[i], 0, sizeof(Rank));
            ranks[i].head = ranks[i].tail = -1;
        }
        c->ranks = ranks;
        c->nranks = slot + 1;
    }
    int words = slot / 64 + 1;
    if (words > c->words) {
        if (widen(&c->digests, words) < 0 || widen(&c->lost, words) < 0 ||
            widen(&c->lost_before, words) < 0)
            return -1;
        c->words = words;
    }
    return 0;
}

static inline void bit_set(uint64_t *b, int slot) { b[slot >> 6] |= 1ULL << (slot & 63); }
static inline void bit_clear(uint64_t *b, int slot) { b[slot >> 6] &= ~(1ULL << (slot & 63)); }
static inline int bit_get(const uint64_t *b, int slot) { return (b[slot >> 6] >> (slot & 63)) & 1; }

static int to_digest(PyObject *o, uint64_t *out) {
    if (!PyLong_Check(o)) {
        PyErr_SetString(PyExc_TypeError, "a digest is an int");
        return -1;
    }
    unsigned long long v = PyLong_AsUnsignedLongLong(o);
    if (v == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (uint64_t)v;
    return 0;
}

/* the digests of a list, as uint64; NULL with an exception set */
static uint64_t *digests_of(PyObject *list, Py_ssize_t *n) {
    if (!PyList_Check(list)) {
        PyErr_SetString(PyExc_TypeError, "digests are a list");
        return NULL;
    }
    *n = PyList_GET_SIZE(list);
    uint64_t *out = PyMem_Malloc((*n ? *n : 1) * sizeof(uint64_t));
    if (!out) {
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        if (to_digest(PyList_GET_ITEM(list, i), &out[i]) < 0) {
            PyMem_Free(out);
            return NULL;
        }
    }
    return out;
}

/* the digest no longer held by ``slot``: out of the digest table when nobody holds it */
static void disown(Core *c, uint64_t key, int slot) {
    Py_ssize_t i = table_find(&c->digests, key);
    if (i < 0) return;
    uint64_t *b = BITS(&c->digests, i);
    bit_clear(b, slot);
    if (bits_empty(b, c->words)) table_del(&c->digests, i);
}

/* ``slot`` held ``key`` and lost it; the recent half becomes the older one when full */
static int lose(Core *c, uint64_t key, int slot) {
    Py_ssize_t i = table_add(&c->lost, key);
    if (i < 0) return -1;
    bit_set(BITS(&c->lost, i), slot);
    Py_ssize_t half = c->lost_cap / 2 > 1 ? c->lost_cap / 2 : 1;
    if (c->lost.used >= half) {
        Table old = c->lost_before;
        c->lost_before = c->lost;
        c->lost = old;
        table_clear(&c->lost);
    }
    return 0;
}

static PyObject *Core_new(PyTypeObject *type, PyObject *args, PyObject *kwds) {
    Py_ssize_t lost_cap = 200000;
    if (!PyArg_ParseTuple(args, "|n", &lost_cap)) return NULL;
    Core *c = (Core *)type->tp_alloc(type, 0);
    if (!c) return NULL;
    c->words = 1;
    c->lost_cap = lost_cap;
    if (table_init(&c->digests, 64, 1) < 0 || table_init(&c->lost, 64, 1) < 0 ||
        table_init(&c->lost_before, 64, 1) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    return (PyObject *)c;
}

static void Core_dealloc(Core *c) {
    table_free(&c->digests);
    table_free(&c->lost);
    table_free(&c->lost_before);
    for (int i = 0; i < c->nranks; i++) rank_free(&c->ranks[i]);
    PyMem_Free(c->ranks);
    Py_TYPE(c)->tp_free((PyObject *)c);
}

static Rank *rank_of(Core *c, int slot, int create) {
    if (slot < 0 || slot >= c->nranks) {
        if (!create) return NULL;
        if (ensure_slot(c, slot) < 0) return NULL;
    }
    Rank *r = &c->ranks[slot];
    if (!r->present) {
        if (!create) return NULL;
        if (rank_init(r, 16) < 0) return NULL;
    }
    return r;
}

static Py_ssize_t trim_rank(Core *c, int slot, Py_ssize_t capacity, double deadline);

/* rank ``slot`` (its LRU ``r``) holds ``key``, used at ``now``: the most recent of its LRU, and
 * one of the digest's holders; -1 on no memory */
static int hold(Core *c, Rank *r, int slot, uint64_t key, double now) {
    Py_ssize_t at = rank_find(r, key);
    if (at >= 0) {
        rank_unlink(r, (int32_t)at);
        rank_link_tail(r, (int32_t)at);
        r->n[at].t = now;
        return 0;
    }
    Py_ssize_t e = table_add(&c->digests, key);
    if (e < 0) return -1;
    bit_set(BITS(&c->digests, e), slot);
    return rank_append(r, key, now);
}

/* insert(slot, digests, now, capacity, deadline) -> evicted: rank ``slot`` holds ``digests``
 * (the head the most recent), then is trimmed as ``trim`` does (one call, not two) */
static PyObject *Core_insert(Core *c, PyObject *args) {
    int slot;
    PyObject *list;
    double now, deadline;
    Py_ssize_t capacity;
    if (!PyArg_ParseTuple(args, "iO!dnd", &slot, &PyList_Type, &list, &now, &capacity, &deadline))
        return NULL;
    Py_ssize_t n;
    uint64_t *d = digests_of(list, &n);
    if (!d) return NULL;
    Rank *r = rank_of(c, slot, 1);
    if (!r) goto fail;
    /* each digest costs a probe of two large tables: their lines are asked for AHEAD digests
     * early, so the misses overlap instead of coming one after the other */
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) table_prefetch(&c->digests, d[i]);
    for (Py_ssize_t i = 0; i + 1 < n; i++) { /* fan-out: each parent's first child */
        if (i + AHEAD < n) table_prefetch(&c->digests, d[i + AHEAD]);
        Py_ssize_t e = table_add(&c->digests, d[i]);
        if (e < 0) goto fail;
        Entry *p = ENTRY(&c->digests, e);
        if (!p->has_child) {
            p->has_child = 1;
            p->first_child = d[i + 1];
        } else if (p->first_child != d[i + 1]) {
            p->branching = 1;
        }
    }
    for (Py_ssize_t i = n - 1; i >= n - AHEAD && i >= 0; i--) rank_prefetch(r, d[i]);
    for (Py_ssize_t i = n - 1; i >= 0; i--) { /* the head ends most recent */
        if (i >= AHEAD) rank_prefetch(r, d[i - AHEAD]);
        if (hold(c, r, slot, d[i], now) < 0) goto fail;
    }
    PyMem_Free(d);
    Py_ssize_t evicted = trim_rank(c, slot, capacity, deadline);
    return evicted < 0 ? NULL : PyLong_FromSsize_t(evicted);
fail:
    PyMem_Free(d);
    return NULL;
}

/* the least recently used of rank ``slot`` past ``capacity`` and those last used before
 * ``deadline`` leave (disowned, remembered as lost): how many, or -1 with an exception set */
static Py_ssize_t trim_rank(Core *c, int slot, Py_ssize_t capacity, double deadline) {
    Rank *r = rank_of(c, slot, 0);
    if (!r || r->head < 0) return 0;
    Py_ssize_t excess = r->used - capacity, evicted = 0;
    uint64_t batch[AHEAD];
    for (;;) { /* in batches: the LRU's oldest leave, then their tables' lines are asked for
                * together before they are disowned and remembered as lost, in order */
        int k = 0;
        while (k < AHEAD && r->head >= 0 && (excess > 0 || r->n[r->head].t < deadline)) {
            int32_t i = r->head;
            batch[k] = r->n[i].key;
            table_prefetch(&c->digests, batch[k]);
            table_prefetch(&c->lost, batch[k]);
            k++;
            rank_del(r, i);
            excess--;
        }
        for (int j = 0; j < k; j++) {
            disown(c, batch[j], slot);
            if (lose(c, batch[j], slot) < 0) return -1;
        }
        evicted += k;
        if (k < AHEAD) break;
    }
    return evicted;
}

/* trim(slot, capacity, deadline) -> evicted (``trim_rank``) */
static PyObject *Core_trim(Core *c, PyObject *args) {
    int slot;
    Py_ssize_t capacity;
    double deadline;
    if (!PyArg_ParseTuple(args, "ind", &slot, &capacity, &deadline)) return NULL;
    Py_ssize_t evicted = trim_rank(c, slot, capacity, deadline);
    return evicted < 0 ? NULL : PyLong_FromSsize_t(evicted);
}

/* remove(slot, digests) -> how many the rank had (its engine evicted them) */
static PyObject *Core_remove(Core *c, PyObject *args) {
    int slot;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "iO!", &slot, &PyList_Type, &list)) return NULL;
    Rank *r = rank_of(c, slot, 0);
    if (!r) return PyLong_FromLong(0);
    Py_ssize_t n, removed = 0;
    uint64_t *d = digests_of(list, &n);
    if (!d) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t at = rank_find(r, d[i]);
        if (at < 0) continue;
        rank_del(r, (int32_t)at);
        disown(c, d[i], slot);
        if (lose(c, d[i], slot) < 0) {
            PyMem_Free(d);
            return NULL;
        }
        removed++;
    }
    PyMem_Free(d);
    return PyLong_FromSsize_t(removed);
}

/* replace(slot, digests, now): the rank holds exactly ``digests``, all last used ``now`` */
static PyObject *Core_replace(Core *c, PyObject *args) {
    int slot;
    PyObject *list;
    double now;
    if (!PyArg_ParseTuple(args, "iO!d", &slot, &PyList_Type, &list, &now)) return NULL;
    Py_ssize_t n;
    uint64_t *d = digests_of(list, &n);
    if (!d) return NULL;
    Rank *r = rank_of(c, slot, 1);
    Table keep = {0};
    uint64_t *gone = NULL;
    if (!r || table_init(&keep, 16, 1) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n; i++)
        if (table_add(&keep, d[i]) < 0) goto fail;
    /* what it no longer holds, oldest first: listed, then removed (a removal may move nodes) */
    gone = PyMem_Malloc((r->used ? r->used : 1) * sizeof(uint64_t));
    if (!gone) {
        PyErr_NoMemory();
        goto fail;
    }
    Py_ssize_t leaving = 0;
    for (int32_t i = r->head; i >= 0; i = r->n[i].next)
        if (table_find(&keep, r->n[i].key) < 0) gone[leaving++] = r->n[i].key;
    for (Py_ssize_t i = 0; i < leaving; i++) {
        rank_del(r, (int32_t)rank_find(r, gone[i]));
        disown(c, gone[i], slot);
        if (lose(c, gone[i], slot) < 0) goto fail;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (hold(c, r, slot, d[i], now) < 0) goto fail;
    }
    table_free(&keep);
    PyMem_Free(gone);
    PyMem_Free(d);
    Py_RETURN_NONE;
fail:
    table_free(&keep);
    PyMem_Free(gone);
    PyMem_Free(d);
    return NULL;
}

/* remove_rank(slot): the rank is gone; what it held is disowned (not lost) */
static PyObject *Core_remove_rank(Core *c, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    Rank *r = rank_of(c, slot, 0);
    if (r) {
        for (int32_t i = r->head; i >= 0; i = r->n[i].next) disown(c, r->n[i].key, slot);
        rank_free(r);
    }
    Py_RETURN_NONE;
}

static inline void lookup_prefetch(const Core *c, PyObject *list, Py_ssize_t i) {
    unsigned long long v = PyLong_AsUnsignedLongLong(PyList_GET_ITEM(list, i));
    if (v == (unsigned long long)-1 && PyErr_Occurred()) PyErr_Clear(); /* told when reached */
    else table_prefetch(&c->digests, (uint64_t)v);
}

/* ``matched[keys[s]] = depth`` for every slot ``s`` of ``slots``; -1 with an exception set */
static int name_depth(PyObject *matched, PyObject *keys, const uint64_t *slots, int words,
                      Py_ssize_t depth) {
    for (int s = 0; s < 64 * words; s++) {
        if (!bit_get(slots, s)) continue;
        if (s >= PyList_GET_SIZE(keys)) {
            PyErr_SetString(PyExc_IndexError, "a slot without a key");
            return -1;
        }
        PyObject *v = PyLong_FromSsize_t(depth);
        if (!v || PyDict_SetItem(matched, PyList_GET_ITEM(keys, s), v) < 0) {
            Py_XDECREF(v);
            return -1;
        }
        Py_DECREF(v);
    }
    return 0;
}

/* lookup(digests, keys, slots) -> (matched {key: leading blocks}, shared blocks); ``keys``: slot
 * -> rank key; ``slots``: the ranks to match (None: every rank with an LRU) */
static PyObject *Core_lookup(Core *c, PyObject *args) {
    PyObject *list, *keys, *slots;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyList_Type, &list, &PyList_Type, &keys, &slots))
        return NULL;
    int words = c->words;
    uint64_t alive[words], still[words], gone[words];
    memset(alive, 0, sizeof(alive));
    if (slots == Py_None) {
        for (int s = 0; s < c->nranks && s < 64 * words; s++)
            if (c->ranks[s].present) bit_set(alive, s);
    } else {
        if (!PyList_Check(slots)) {
            PyErr_SetString(PyExc_TypeError, "slots are a list or None");
            return NULL;
        }
        for (Py_ssize_t i = 0; i < PyList_GET_SIZE(slots); i++) {
            long s = PyLong_AsLong(PyList_GET_ITEM(slots, i));
            if (s == -1 && PyErr_Occurred()) return NULL;
            if (s >= 0 && s < 64 * words) bit_set(alive, (int)s);
        }
    }
    PyObject *matched = PyDict_New();
    if (!matched) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list), depth = 0, shared = 0;
    int any = !bits_empty(alive, words);
    uint64_t d = 0, next = 0;
    if (n && to_digest(PyList_GET_ITEM(list, 0), &next) < 0) goto fail;
    for (Py_ssize_t i = 0; i < n && i < AHEAD; i++) lookup_prefetch(c, list, i);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i + AHEAD < n) lookup_prefetch(c, list, i + AHEAD);
        d = next;
        if (i + 1 < n && to_digest(PyList_GET_ITEM(list, i + 1), &next) < 0) goto fail;
        Py_ssize_t e = table_find(&c->digests, d);
        if (e < 0) break;
        const uint64_t *holders = BITS(&c->digests, e);
        if (any) {
            int changed = 0;
            for (int w = 0; w < words; w++) {
                still[w] = alive[w] & holders[w];
                gone[w] = alive[w] & ~holders[w];
                changed |= gone[w] != 0;
            }
            if (changed) { /* the ones that dropped out matched ``depth`` */
                if (depth && name_depth(matched, keys, gone, words, depth) < 0) goto fail;
                memcpy(alive, still, sizeof(alive));
                any = !bits_empty(alive, words);
            }
            if (any) depth++;
        }
        const Entry *entry = ENTRY(&c->digests, e);
        if (entry->branching) shared = i + 1;
        else if (entry->has_child && i + 1 < n && entry->first_child != next) shared = i + 1;
    }
    if (any && depth && name_depth(matched, keys, alive, words, depth) < 0) goto fail;
    return Py_BuildValue("(Nn)", matched, shared);
fail:
    Py_DECREF(matched);
    return NULL;
}

/* evicted_run(slot, digests, start) -> blocks from ``start`` on the rank held and lost, in a row */
static PyObject *Core_evicted_run(Core *c, PyObject *args) {
    int slot;
    PyObject *list;
    Py_ssize_t start;
    if (!PyArg_ParseTuple(args, "iO!n", &slot, &PyList_Type, &list, &start)) return NULL;
    if (slot < 0 || slot >= 64 * c->words) return PyLong_FromLong(0);
    Py_ssize_t run = 0, n = PyList_GET_SIZE(list);
    for (Py_ssize_t i = start < 0 ? 0 : start; i < n; i++) {
        uint64_t d;
        if (to_digest(PyList_GET_ITEM(list, i), &d) < 0) return NULL;
        Py_ssize_t a = table_find(&c->lost, d), b = table_find(&c->lost_before, d);
        int held = (a >= 0 && bit_get(BITS(&c->lost, a), slot)) ||
                   (b >= 0 && bit_get(BITS(&c->lost_before, b), slot));
        if (!held) break;
        run++;
    }
    return PyLong_FromSsize_t(run);
}

static PyObject *Core_size(Core *c, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    Rank *r = rank_of(c, slot, 0);
    return PyLong_FromSsize_t(r ? r->used : 0);
}

/* oldest(slot) -> the least recent last use, or None */
static PyObject *Core_oldest(Core *c, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    Rank *r = rank_of(c, slot, 0);
    if (!r || r->head < 0) Py_RETURN_NONE;
    return PyFloat_FromDouble(r->n[r->head].t);
}

static PyObject *Core_present(Core *c, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    return PyBool_FromLong(rank_of(c, slot, 0) != NULL);
}

static PyObject *mask_of(const uint64_t *b, int words) { /* a bitset as a Python int */
    PyObject *out = PyLong_FromLong(0);
    for (int w = words - 1; w >= 0 && out; w--) {
        PyObject *shift = PyLong_FromLong(64), *shifted = NULL, *word = NULL, *next = NULL;
        if (shift) shifted = PyNumber_Lshift(out, shift);
        if (shifted) word = PyLong_FromUnsignedLongLong(b[w]);
        if (word) next = PyNumber_Or(shifted, word);
        Py_XDECREF(shift);
        Py_XDECREF(shifted);
        Py_XDECREF(word);
        Py_DECREF(out);
        out = next;
    }
    return out;
}

/* holders(digest) -> the holders' bitset as an int (bit s: slot s) */
static PyObject *Core_holders(Core *c, PyObject *arg) {
    uint64_t d;
    if (to_digest(arg, &d) < 0) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) return NULL;
        PyErr_Clear();
        return PyLong_FromLong(0);
    }
    Py_ssize_t e = table_find(&c->digests, d);
    if (e < 0) return PyLong_FromLong(0);
    return mask_of(BITS(&c->digests, e), c->words);
}

/* items(slot) -> [(digest, last use)], least recent first */
static PyObject *Core_items(Core *c, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    PyObject *out = PyList_New(0);
    Rank *r = rank_of(c, slot, 0);
    if (!out || !r) return out;
    for (int32_t i = r->head; i >= 0; i = r->n[i].next) {
        PyObject *item = Py_BuildValue("(Kd)", (unsigned long long)r->n[i].key, r->n[i].t);
        if (!item || PyList_Append(out, item) < 0) {
            Py_XDECREF(item);
            Py_DECREF(out);
            return NULL;
        }
        Py_DECREF(item);
    }
    return out;
}

/* table_dict(which) -> {digest: bitset int} of 0: the holders, 1: lost, 2: lost before */
static PyObject *Core_table_dict(Core *c, PyObject *args) {
    int which;
    if (!PyArg_ParseTuple(args, "i", &which)) return NULL;
    Table *t = which == 0 ? &c->digests : which == 1 ? &c->lost : &c->lost_before;
    PyObject *out = PyDict_New();
    for (Py_ssize_t i = 0; out && i < t->cap; i++) {
        if (ENTRY(t, i)->state != USED) continue;
        PyObject *k = PyLong_FromUnsignedLongLong(ENTRY(t, i)->key);
        PyObject *v = mask_of(BITS(t, i), c->words);
        if (!k || !v || PyDict_SetItem(out, k, v) < 0) Py_CLEAR(out);
        Py_XDECREF(k);
        Py_XDECREF(v);
    }
    return out;
}

/* fan_out() -> ({parent: first child}, {branching digests}) */
static PyObject *Core_fan_out(Core *c, PyObject *unused) {
    PyObject *children = PyDict_New(), *branching = PySet_New(NULL);
    for (Py_ssize_t i = 0; children && branching && i < c->digests.cap; i++) {
        const Entry *e = ENTRY(&c->digests, i);
        if (e->state != USED) continue;
        PyObject *k = PyLong_FromUnsignedLongLong(e->key);
        if (!k) goto fail;
        if (e->has_child) {
            PyObject *v = PyLong_FromUnsignedLongLong(e->first_child);
            if (!v || PyDict_SetItem(children, k, v) < 0) {
                Py_XDECREF(v);
                Py_DECREF(k);
                goto fail;
            }
            Py_DECREF(v);
        }
        if (e->branching && PySet_Add(branching, k) < 0) {
            Py_DECREF(k);
            goto fail;
        }
        Py_DECREF(k);
    }
    if (!children || !branching) goto fail;
    return Py_BuildValue("(NN)", children, branching);
fail:
    Py_XDECREF(children);
    Py_XDECREF(branching);
    return NULL;
}

static PyObject *Core_lost_sizes(Core *c, PyObject *unused) {
    return Py_BuildValue("(nn)", c->lost.used, c->lost_before.used);
}

static PyObject *Core_get_lost_cap(Core *c, void *closure) { return PyLong_FromSsize_t(c->lost_cap); }

static int Core_set_lost_cap(Core *c, PyObject *value, void *closure) {
    Py_ssize_t cap = value ? PyLong_AsSsize_t(value) : -1;
    if (cap == -1 && PyErr_Occurred()) return -1;
    if (cap < 0) {
        PyErr_SetString(PyExc_ValueError, "lost_cap is a non-negative int");
        return -1;
    }
    c->lost_cap = cap;
    return 0;
}

static PyMethodDef Core_methods[] = {
    {"insert", (PyCFunction)Core_insert, METH_VARARGS, NULL},
    {"trim", (PyCFunction)Core_trim, METH_VARARGS, NULL},
    {"remove", (PyCFunction)Core_remove, METH_VARARGS, NULL},
    {"replace", (PyCFunction)Core_replace, METH_VARARGS, NULL},
    {"remove_rank", (PyCFunction)Core_remove_rank, METH_VARARGS, NULL},
    {"lookup", (PyCFunction)Core_lookup, METH_VARARGS, NULL},
    {"evicted_run", (PyCFunction)Core_evicted_run, METH_VARARGS, NULL},
    {"size", (PyCFunction)Core_size, METH_VARARGS, NULL},
    {"oldest", (PyCFunction)Core_oldest, METH_VARARGS, NULL},
    {"present", (PyCFunction)Core_present, METH_VARARGS, NULL},
    {"holders", (PyCFunction)Core_holders, METH_O, NULL},
    {"items", (PyCFunction)Core_items, METH_VARARGS, NULL},
    {"table_dict", (PyCFunction)Core_table_dict, METH_VARARGS, NULL},
    {"fan_out", (PyCFunction)Core_fan_out, METH_NOARGS, NULL},
    {"lost_sizes", (PyCFunction)Core_lost_sizes, METH_NOARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Core_getset[] = {
    {"lost_cap", (getter)Core_get_lost_cap, (setter)Core_set_lost_cap, NULL, NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "dpmesh_prefix_core.Core",
    .tp_basicsize = sizeof(Core),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = Core_new,
    .tp_dealloc = (destructor)Core_dealloc,
    .tp_methods = Core_methods,
    .tp_getset = Core_getset,
};


/* ----- XXH64 (the xxhash package's ``xxh64_intdigest``), for the chained digests ------------ */
#define P1 0x9E3779B185EBCA87ULL
#define P2 0xC2B2AE3D27D4EB4FULL
#define P3 0x165667B19E3779F9ULL
#define P4 0x85EBCA77C2B2AE63ULL
#define P5 0x27D4EB2F165667C5ULL

static inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t read64(const uint8_t *p) { /* little-endian */
    uint64_t v;
    memcpy(&v, p, 8);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap64(v);
#endif
    return v;
}

static inline uint32_t read32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
#if __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
    v = __builtin_bswap32(v);
#endif
    return v;
}

static inline uint64_t xround(uint64_t acc, uint64_t input) {
    acc += input * P2;
    acc = rotl(acc, 31);
    return acc * P1;
}

static inline uint64_t xmerge(uint64_t acc, uint64_t v) {
    acc ^= xround(0, v);
    return acc * P1 + P4;
}

static uint64_t xxh64(const uint8_t *p, size_t len, uint64_t seed) {
    const uint8_t *end = p + len;
    uint64_t h;
    if (len >= 32) {
        uint64_t v1 = seed + P1 + P2, v2 = seed + P2, v3 = seed, v4 = seed - P1;
        const uint8_t *limit = end - 32;
        do {
            v1 = xround(v1, read64(p));
            v2 = xround(v2, read64(p + 8));
            v3 = xround(v3, read64(p + 16));
            v4 = xround(v4, read64(p + 24));
            p += 32;
        } while (p <= limit);
        h = rotl(v1, 1) + rotl(v2, 7) + rotl(v3, 12) + rotl(v4, 18);
        h = xmerge(h, v1);
        h = xmerge(h, v2);
        h = xmerge(h, v3);
        h = xmerge(h, v4);
    } else {
        h = seed + P5;
    }
    h += (uint64_t)len;
    while (p + 8 <= end) {
        h ^= xround(0, read64(p));
        h = rotl(h, 27) * P1 + P4;
        p += 8;
    }
    if (p + 4 <= end) {
        h ^= (uint64_t)read32(p) * P1;
        h = rotl(h, 23) * P2 + P3;
        p += 4;
    }
    while (p < end) {
        h ^= (*p) * P5;
        h = rotl(h, 11) * P1;
        p++;
    }
    h ^= h >> 33;
    h *= P2;
    h ^= h >> 29;
    h *= P3;
    h ^= h >> 32;
    return h;
}

/* text_digests(data, seed, chunk) -> the chained digests of ``data``'s whole ``chunk``-byte
 * chunks, each hashed with the previous digest as its seed (the first with ``seed``): the
 * router's digests of a prompt it has no tokenizer for (request_shape.text_digests) */
static PyObject *text_digests(PyObject *module, PyObject *args) {
    Py_buffer data;
    unsigned long long seed;
    Py_ssize_t chunk;
    if (!PyArg_ParseTuple(args, "y*Kn", &data, &seed, &chunk)) return NULL;
    if (chunk <= 0) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "chunk must be positive");
        return NULL;
    }
    Py_ssize_t n = data.len / chunk;
    PyObject *out = PyList_New(n);
    uint64_t h = seed;
    for (Py_ssize_t i = 0; out && i < n; i++) {
        h = xxh64((const uint8_t *)data.buf + i * chunk, (size_t)chunk, h);
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    PyBuffer_Release(&data);
    return out;
}

/* chain_digests(ids, block_size, parent) -> engine/digests.py ``chain_digests``: each full block's
 * xxh64 (seed 0) over its parent's digest (8 little-endian bytes; none for a first block without
 * ``parent``) and its token ids as int32 little-endian. ``ids``: a list of ints */
static PyObject *chain_digests(PyObject *module, PyObject *args) {
    PyObject *ids, *parent_obj, *out = NULL;
    Py_ssize_t block;
    if (!PyArg_ParseTuple(args, "O!nO", &PyList_Type, &ids, &block, &parent_obj)) return NULL;
    if (block <= 0) {
        PyErr_SetString(PyExc_ValueError, "block_size must be positive");
        return NULL;
    }
    int chained = parent_obj != Py_None;
    uint64_t parent = 0;
    if (chained && to_digest(parent_obj, &parent) < 0) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(ids) / block;
    uint8_t *scratch = PyMem_Malloc(8 + 4 * block);
    if (!scratch) return PyErr_NoMemory();
    out = PyList_New(n);
    for (Py_ssize_t i = 0; out && i < n; i++) {
        uint8_t *at = scratch + 8;
        for (Py_ssize_t j = 0; j < block; j++, at += 4) {
            long id = PyLong_AsLong(PyList_GET_ITEM(ids, i * block + j));
            if ((id == -1 && PyErr_Occurred()) || id < INT32_MIN || id > INT32_MAX) {
                if (!PyErr_Occurred())
                    PyErr_SetString(PyExc_OverflowError, "a token id out of int32's range");
                Py_CLEAR(out);
                break;
            }
            uint32_t u = (uint32_t)(int32_t)id;
            at[0] = (uint8_t)u;
            at[1] = (uint8_t)(u >> 8);
            at[2] = (uint8_t)(u >> 16);
            at[3] = (uint8_t)(u >> 24);
        }
        if (!out) break;
        uint64_t h;
        if (chained) {
            for (int b = 0; b < 8; b++) scratch[b] = (uint8_t)(parent >> (8 * b));
            h = xxh64(scratch, 8 + 4 * (size_t)block, 0);
        } else {
            h = xxh64(scratch + 8, 4 * (size_t)block, 0);
        }
        parent = h;
        chained = 1;
        PyObject *v = PyLong_FromUnsignedLongLong(h);
        if (!v) Py_CLEAR(out);
        else PyList_SET_ITEM(out, i, v);
    }
    PyMem_Free(scratch);
    return out;
}

PyObject *cache_aware(PyObject *module, PyObject *args); /* cache_aware.c */
PyObject *cache_aware_setup(PyObject *module, PyObject *args);

static PyMethodDef module_methods[] = {
    {"text_digests", text_digests, METH_VARARGS, NULL},
    {"chain_digests", chain_digests, METH_VARARGS, NULL},
    {"cache_aware", cache_aware, METH_VARARGS, NULL},
    {"cache_aware_setup", cache_aware_setup, METH_VARARGS, NULL},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "dpmesh_prefix_core", NULL, -1,
                                    module_methods};

PyMODINIT_FUNC PyInit_dpmesh_prefix_core(void) {
    if (PyType_Ready(&CoreType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(m, "Core", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
