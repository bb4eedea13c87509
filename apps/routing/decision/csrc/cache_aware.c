/* CacheAware's choice in one call (apps/routing/decision/policies.py, ``CacheAware``): each
 * target's load read from its ``RankLoad`` (load.py) as ``RankLoad.totals`` works it out, what
 * ``_costs``, ``hot``, ``movable``, ``volumes`` and ``one_sided`` work out over the candidates,
 * ``choose``'s near ties and its tie-break. The arithmetic is done operation for operation as the
 * pure code does it (the same doubles in the same order: the two give equal costs to the last bit,
 * and the same choice from the same random state; tests/routing/test_cache_aware_kernel.py runs
 * both on random fleets and compares them).
 *
 *   cache_aware_setup(load_type, session_half_life_s, recent_half_life_s)
 *   cache_aware(weights, shape, targets, matched, shared, rng, now, want)
 *
 * ``load_type``: ``RankLoad``, whose counters are read directly (``requests``,
 * ``peer_requests``, ``pending_prefill_tokens``, ``peer_prefill_tokens``, ``_sessions``,
 * ``_sessions_at``, ``_recent_n``, ``_recent_at``), with its half-lives; a load of another type,
 * or one with peers (other router processes' load, decayed in Python), is read through its
 * ``totals(now)`` and ``recent_requests(now)``. ``weights``: the policy's 13 weights
 * (``CacheAware.weights()``'s order); ``shape``: the request's ``RequestShape`` (its prompt
 * tokens, chat, hittable blocks of ``block_tokens`` each, prefix share and requests, volume
 * excesses; ``warm`` read only to break a tie); ``targets``: the candidates; ``matched``: target
 * key -> blocks the index says it holds; ``shared``: the shared prefix in blocks; ``rng``: the
 * policy's ``random.Random``, one ``random()`` drawn for each near tie, in order, as the pure
 * code draws them; ``now``: the loads' clock reading; ``want``: 0 the chosen target's index, 1 the
 * costs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>

enum {
    W_DECODE, W_STICKINESS, W_BALANCE, W_SLACK, W_NEW_SESSION_SLACK, W_REWORK_FLOOR,
    W_REWORK_CAP, W_REWORK_MAX, W_SEAT, W_VOLUME, W_VOLUME_CAP, W_MOVE_MARGIN, W_MOVE_PAYBACK,
    WEIGHTS
};

typedef struct {
    long long hit, n, seats;
    double live, queue, excess;
    int free, moves;
    double volume, cost;
    PyObject *key, *load; /* the target's key and load (new references) */
    int plain;            /* the load read directly (``plain_load``) */
} Row;

/* Python's min(a, b) and max(a, b) on floats: the first unless the second is strictly less
 * (greater); -0.0 and 0.0 stay as Python keeps them */
static inline double py_min(double a, double b) { return b < a ? b : a; }
static inline double py_max(double a, double b) { return b > a ? b : a; }

/* One request's terms: what ``_costs`` reads of the shape and the request, besides the rows. */
typedef struct {
    long long prompt, hittable, block_tokens, shared; /* shared: in tokens */
    int chat, known_share, has_excess;
    double share, requests;
} Request;

/* The costs of ``count`` rows (each row's ``hit`` and load read in), left in each row's ``cost``;
 * the cheapest is returned in ``*best`` and whether a chat request starts a session (the wider
 * slack) in ``*wide``. */
static void costs_of(const double *w, const Request *q, Row *r, Py_ssize_t count, double *best,
                     int *wide) {
    long long prompt = q->prompt, shared = q->shared;
    long long best_match = 0, total_inflight = 0;
    double total_sessions = 0.0, total_queued = 0.0, share = q->share;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (i == 0 || r[i].hit > best_match) best_match = r[i].hit;
        total_inflight += r[i].n;
        total_sessions += r[i].live;
        total_queued += r[i].queue;
    }
    double mean_inflight = (double)total_inflight / (double)count;
    double mean_sessions = total_sessions / (double)count;
    double busy = py_min(1.0, (double)total_inflight / (double)count);
    double pressure = best_match <= shared ? busy : 0.0;
    int hot = 1; /* CacheAware.hot */
    if (shared && q->known_share) {
        Py_ssize_t holders = 0;
        for (Py_ssize_t i = 0; i < count; i++) holders += r[i].hit >= shared;
        hot = share * (double)count > (double)holders;
    }
    double queued = total_queued / (double)count;
    double depth = prompt ? queued / (double)prompt : 0.0;
    double rework = busy * py_max(w[W_REWORK_FLOOR], py_min(w[W_REWORK_CAP], depth));
    if (!(pressure != 0.0 && hot)) {
        long long rest = prompt - best_match;
        double amplification = (double)prompt / (double)(rest > 1 ? rest : 1);
        rework = py_max(rework, py_min(w[W_REWORK_MAX], rework * amplification));
    }
    if (q->chat && best_match <= shared) rework = 0.0;
    /* CacheAware.movable */
    int any_moves = 0;
    for (Py_ssize_t i = 0; i < count; i++) r[i].moves = 0;
    if (q->has_excess && q->known_share && share != 0.0 && best_match && best_match <= shared &&
        !(q->requests * (double)prompt < w[W_MOVE_PAYBACK] * (double)best_match)) {
        double holders = 0.0;
        int first = 1;
        for (Py_ssize_t i = 0; i < count; i++)
            if (r[i].hit == best_match) {
                holders = first ? r[i].excess : py_min(holders, r[i].excess);
                first = 0;
            }
        double ceiling = holders - share * (double)count - w[W_MOVE_MARGIN];
        for (Py_ssize_t i = 0; i < count; i++) {
            r[i].moves = r[i].hit < best_match && r[i].excess < ceiling;
            any_moves |= r[i].moves;
        }
    }
    /* CacheAware.volumes */
    Py_ssize_t free_count = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        r[i].free = r[i].hit == best_match || (any_moves && r[i].moves);
        free_count += r[i].free;
        r[i].volume = 0.0;
    }
    if (q->has_excess && !(best_match > 0 && free_count < 2)) {
        double cap = w[W_VOLUME_CAP], shortest = 0.0, top = 0.0;
        int first = 1;
        for (Py_ssize_t i = 0; i < count; i++)
            if (r[i].free) {
                shortest = first ? r[i].queue : py_min(shortest, r[i].queue);
                first = 0;
            }
        first = 1;
        for (Py_ssize_t i = 0; i < count; i++) {
            double volume = py_max(-cap, py_min(cap, r[i].excess));
            if (r[i].queue > shortest) volume = py_max(volume, 0.0);
            r[i].volume = r[i].free ? volume : 0.0;
            if (r[i].free) {
                top = first ? r[i].volume : py_max(top, r[i].volume);
                first = 0;
            }
        }
        if (best_match > 0)
            for (Py_ssize_t i = 0; i < count; i++)
                r[i].volume = r[i].free ? r[i].volume - top : 0.0;
    }
    /* the costs (CacheAware._costs' loop) */
    double balance = w[W_BALANCE] * pressure;
    double volume_scale = w[W_VOLUME] * busy * (double)prompt;
    *best = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        Row *t = &r[i];
        long long over = t->hit > shared ? t->hit : shared;
        long long stranded = best_match - over > 0 ? best_match - over : 0;
        double cost = (double)(prompt - t->hit) + t->queue + w[W_DECODE] * (double)t->n +
                      w[W_STICKINESS] * (double)stranded;
        if (!(any_moves && t->moves)) cost += rework * (double)(best_match - t->hit);
        if (balance != 0.0) {
            double excess = ((mean_inflight > 0 ? (double)t->n / mean_inflight - 1.0 : 0.0) +
                             (mean_sessions > 0 ? t->live / mean_sessions - 1.0 : 0.0)) /
                            2.0;
            if (!hot) excess = t->hit >= shared ? py_min(excess, 0.0) : py_max(excess, 0.0);
            cost += balance * excess;
        }
        if (t->seats && t->n + 1 > t->seats) cost += w[W_SEAT] * (double)(t->n + 1 - t->seats);
        if (t->volume != 0.0) cost += volume_scale * t->volume;
        t->cost = cost;
        if (i == 0 || cost < *best) *best = cost;
    }
    /* a chat request with no private history anywhere starts a session: choose's wider slack */
    *wide = q->chat && !(best_match > shared);
}

static int read_weights(PyObject *weights, double *w) {
    if (!PyTuple_Check(weights) || PyTuple_GET_SIZE(weights) != WEIGHTS) {
        PyErr_SetString(PyExc_ValueError, "cache_aware takes a tuple of 13 weights");
        return -1;
    }
    for (int i = 0; i < WEIGHTS; i++) {
        w[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, i));
        if (w[i] == -1.0 && PyErr_Occurred()) return -1;
    }
    return 0;
}

/* ----- the rows, read from the targets themselves ------------------------------------------- */

static PyObject *load_type; /* RankLoad */
static double session_half_life = 30.0, recent_half_life = 3.0;
static PyObject *s_key, *s_load, *s_worker, *s_max_num_seqs, *s_requests, *s_peer_requests,
    *s_pending, *s_peer_prefill, *s_sessions, *s_sessions_at, *s_recent_n, *s_recent_at,
    *s_peers, *s_totals, *s_recent_requests, *s_warm, *s_random, *s_prompt_tokens, *s_chat,
    *s_hittable, *s_block_tokens, *s_prefix_share, *s_prefix_requests, *s_volume_excess;

PyObject *cache_aware_setup(PyObject *module, PyObject *args) {
    PyObject *type;
    (void)module;
    if (!PyArg_ParseTuple(args, "O!dd", &PyType_Type, &type, &session_half_life,
                          &recent_half_life))
        return NULL;
#define INTERN(var, text) if (!var && !(var = PyUnicode_InternFromString(text))) return NULL
    INTERN(s_key, "key"); INTERN(s_load, "load"); INTERN(s_worker, "worker");
    INTERN(s_max_num_seqs, "max_num_seqs"); INTERN(s_requests, "requests");
    INTERN(s_peer_requests, "peer_requests"); INTERN(s_pending, "pending_prefill_tokens");
    INTERN(s_peer_prefill, "peer_prefill_tokens"); INTERN(s_sessions, "_sessions");
    INTERN(s_sessions_at, "_sessions_at"); INTERN(s_recent_n, "_recent_n");
    INTERN(s_recent_at, "_recent_at"); INTERN(s_peers, "peers"); INTERN(s_totals, "totals");
    INTERN(s_recent_requests, "recent_requests"); INTERN(s_warm, "warm");
    INTERN(s_random, "random"); INTERN(s_prompt_tokens, "prompt_tokens"); INTERN(s_chat, "chat");
    INTERN(s_hittable, "hittable_blocks"); INTERN(s_block_tokens, "block_tokens");
    INTERN(s_prefix_share, "prefix_share"); INTERN(s_prefix_requests, "prefix_requests");
    INTERN(s_volume_excess, "volume_excess");
#undef INTERN
    Py_INCREF(type);
    Py_XSETREF(load_type, type);
    Py_RETURN_NONE;
}

static int attr_ll(PyObject *o, PyObject *name, long long *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    *out = PyLong_AsLongLong(v);
    Py_DECREF(v);
    return *out == -1 && PyErr_Occurred() ? -1 : 0;
}

static int attr_double(PyObject *o, PyObject *name, double *out) {
    PyObject *v = PyObject_GetAttr(o, name);
    if (!v) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* the load read directly: its own counters, and no peers to decay (1); else 0 (read it through
 * its methods), or -1 with an exception set */
static int plain_load(PyObject *load) {
    if (!load_type || Py_TYPE(load) != (PyTypeObject *)load_type) return 0;
    PyObject *peers = PyObject_GetAttr(load, s_peers);
    if (!peers) return -1;
    int none = PyDict_Check(peers) && PyDict_GET_SIZE(peers) == 0;
    Py_DECREF(peers);
    return none;
}

/* ``load.name(now)``: a new reference, or NULL with an exception set */
static PyObject *call_at(PyObject *load, PyObject *name, double now) {
    PyObject *at = PyFloat_FromDouble(now);
    if (!at) return NULL;
    PyObject *out = PyObject_CallMethodOneArg(load, name, at);
    Py_DECREF(at);
    return out;
}

/* RankLoad.totals(now) of a target's load into its row */
static int read_load(Row *r, double now) {
    PyObject *load = r->load;
    if ((r->plain = plain_load(load)) < 0) return -1;
    if (r->plain) {
        long long requests, peer_requests, pending, peer_prefill;
        double sessions;
        if (attr_ll(load, s_requests, &requests) < 0 ||
            attr_ll(load, s_peer_requests, &peer_requests) < 0 ||
            attr_ll(load, s_pending, &pending) < 0 ||
            attr_ll(load, s_peer_prefill, &peer_prefill) < 0 ||
            attr_double(load, s_sessions, &sessions) < 0)
            return -1;
        double own = 0.0; /* own_active_sessions: 0.0 with none */
        if (sessions != 0.0) {
            double at;
            if (attr_double(load, s_sessions_at, &at) < 0) return -1;
            own = sessions * exp2(-(now - at) / session_half_life);
        }
        r->n = requests + peer_requests;
        r->live = own + 0.0; /* + _peers_decayed: 0.0 without peers */
        r->queue = (double)(pending + peer_prefill);
        return 0;
    }
    PyObject *totals = call_at(load, s_totals, now);
    if (!totals) return -1;
    if (!PyTuple_Check(totals) || PyTuple_GET_SIZE(totals) != 3) {
        Py_DECREF(totals);
        PyErr_SetString(PyExc_TypeError, "RankLoad.totals gives (inflight, sessions, queued)");
        return -1;
    }
    r->n = PyLong_AsLongLong(PyTuple_GET_ITEM(totals, 0));
    r->live = PyFloat_AsDouble(PyTuple_GET_ITEM(totals, 1));
    r->queue = PyFloat_AsDouble(PyTuple_GET_ITEM(totals, 2));
    Py_DECREF(totals);
    return PyErr_Occurred() ? -1 : 0;
}

/* RankLoad.recent_requests(now) of a row's load */
static int recent_of(const Row *r, double now, double *out) {
    PyObject *load = r->load;
    if (r->plain) {
        double n, at;
        if (attr_double(load, s_recent_n, &n) < 0 || attr_double(load, s_recent_at, &at) < 0)
            return -1;
        *out = n * exp2(-(now - at) / recent_half_life) + 0.0;
        return 0;
    }
    PyObject *v = call_at(load, s_recent_requests, now);
    if (!v) return -1;
    *out = PyFloat_AsDouble(v);
    Py_DECREF(v);
    return *out == -1.0 && PyErr_Occurred() ? -1 : 0;
}

/* the request's terms from its shape (``RequestShape``) */
static int read_request(PyObject *shape, long long shared_blocks, Request *q, PyObject **excess) {
    PyObject *share = NULL, *chat = NULL;
    if (attr_ll(shape, s_prompt_tokens, &q->prompt) < 0 ||
        attr_ll(shape, s_hittable, &q->hittable) < 0 ||
        attr_ll(shape, s_block_tokens, &q->block_tokens) < 0 ||
        attr_double(shape, s_prefix_requests, &q->requests) < 0)
        return -1;
    q->shared = shared_blocks * q->block_tokens;
    if (!(chat = PyObject_GetAttr(shape, s_chat))) return -1;
    q->chat = PyObject_IsTrue(chat);
    Py_DECREF(chat);
    if (q->chat < 0 || !(share = PyObject_GetAttr(shape, s_prefix_share))) return -1;
    q->known_share = share != Py_None;
    q->share = q->known_share ? PyFloat_AsDouble(share) : 0.0;
    Py_DECREF(share);
    if (q->share == -1.0 && PyErr_Occurred()) return -1;
    if (!(*excess = PyObject_GetAttr(shape, s_volume_excess))) return -1;
    q->has_excess = PyObject_IsTrue(*excess);
    if (q->has_excess < 0) return -1;
    if (q->has_excess && !PyDict_Check(*excess)) {
        PyErr_SetString(PyExc_TypeError, "volume_excess is a dict or None");
        return -1;
    }
    return 0;
}

/* a target's row: its key, hit (``matched``, up to the request's hittable blocks, in tokens),
 * seats, volume excess and load (the key and the load as new references, released by the
 * caller) */
static int read_target(PyObject *target, PyObject *matched, PyObject *excess, const Request *q,
                       double now, Row *r) {
    PyObject *key = r->key = PyObject_GetAttr(target, s_key), *worker = NULL, *seats = NULL;
    if (!key) return -1;
    int rc = -1;
    PyObject *held = PyDict_GetItemWithError(matched, key);
    long long blocks = 0;
    if (held) blocks = PyLong_AsLongLong(held);
    if (PyErr_Occurred()) goto out;
    r->hit = (blocks < q->hittable ? blocks : q->hittable) * q->block_tokens;
    r->excess = 0.0;
    if (q->has_excess) {
        PyObject *more = PyDict_GetItemWithError(excess, key);
        if (more) r->excess = PyFloat_AsDouble(more);
        if (PyErr_Occurred()) goto out;
    }
    if (!(worker = PyObject_GetAttr(target, s_worker))) goto out;
    if (!(seats = PyObject_GetAttr(worker, s_max_num_seqs))) goto out;
    int some = PyObject_IsTrue(seats); /* ``max_num_seqs or 0`` */
    if (some < 0) goto out;
    r->seats = some ? PyLong_AsLongLong(seats) : 0;
    if (PyErr_Occurred()) goto out;
    if (!(r->load = PyObject_GetAttr(target, s_load))) goto out;
    rc = read_load(r, now);
out:
    Py_XDECREF(worker);
    Py_XDECREF(seats);
    return rc;
}

/* the tie-break's key of near tie ``i``, as choose's tuple (sessions + in flight, not warm,
 * recent requests, a random draw) */
typedef struct {
    double load;
    int cold;
    double recent, draw;
} Tie;

static int tie_less(const Tie *a, const Tie *b) {
    if (a->load != b->load) return a->load < b->load;
    if (a->cold != b->cold) return a->cold < b->cold;
    if (a->recent != b->recent) return a->recent < b->recent;
    return a->draw < b->draw; /* equal draws: the earlier index, as min's first of equals */
}

PyObject *cache_aware(PyObject *module, PyObject *args) {
    PyObject *weights, *shape, *targets, *matched, *rng, *excess = NULL, *warm = NULL;
    long long shared;
    double now, w[WEIGHTS];
    int want;
    Request q;
    (void)module;
    if (!PyArg_ParseTuple(args, "OOO!O!LOdi", &weights, &shape, &PyList_Type, &targets,
                          &PyDict_Type, &matched, &shared, &rng, &now, &want))
        return NULL;
    if (read_weights(weights, w) < 0) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(targets);
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "no targets");
        return NULL;
    }
    if (read_request(shape, shared, &q, &excess) < 0) {
        Py_XDECREF(excess);
        return NULL;
    }
    Row stack[16], *r = count <= 16 ? stack : PyMem_Malloc(count * sizeof(Row));
    if (!r) {
        Py_DECREF(excess);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < count; i++) r[i].key = r[i].load = NULL;
    PyObject *out = NULL;
    Py_ssize_t chosen = -1;
    for (Py_ssize_t i = 0; i < count; i++)
        if (read_target(PyList_GET_ITEM(targets, i), matched, excess, &q, now, &r[i]) < 0)
            goto done;
    double best;
    int wide;
    costs_of(w, &q, r, count, &best, &wide);
    if (want) { /* the costs */
        out = PyList_New(count);
        for (Py_ssize_t i = 0; out && i < count; i++) {
            PyObject *v = PyFloat_FromDouble(r[i].cost);
            if (!v) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, v);
        }
        goto done;
    }
    double bound = best + (wide ? w[W_NEW_SESSION_SLACK] : w[W_SLACK]);
    Py_ssize_t near = 0;
    for (Py_ssize_t i = 0; i < count; i++)
        if (r[i].cost <= bound) {
            near++;
            chosen = i;
        }
    if (near > 1) { /* the tie-break, over the near ties in order */
        if (!(warm = PyObject_GetAttr(shape, s_warm))) goto done;
        Tie least = {0}, tie;
        chosen = -1;
        for (Py_ssize_t i = 0; i < count; i++) {
            if (!(r[i].cost <= bound)) continue;
            int in = PySequence_Contains(warm, r[i].key);
            if (in < 0) goto done;
            tie.load = r[i].live + (double)r[i].n;
            tie.cold = !in;
            if (recent_of(&r[i], now, &tie.recent) < 0) goto done;
            PyObject *draw = PyObject_CallMethodNoArgs(rng, s_random);
            if (!draw) goto done;
            tie.draw = PyFloat_AsDouble(draw);
            Py_DECREF(draw);
            if (tie.draw == -1.0 && PyErr_Occurred()) goto done;
            if (chosen < 0 || tie_less(&tie, &least)) {
                least = tie;
                chosen = i;
            }
        }
    }
    out = PyLong_FromSsize_t(chosen);
done:
    for (Py_ssize_t i = 0; i < count; i++) {
        Py_XDECREF(r[i].key);
        Py_XDECREF(r[i].load);
    }
    if (r != stack) PyMem_Free(r);
    Py_XDECREF(excess);
    Py_XDECREF(warm);
    return out;
}
