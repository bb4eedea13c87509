/* CacheAware's costs in one call (apps/routing/decision/policies.py, ``CacheAware``): what
 * ``_costs``, ``hot``, ``movable``, ``volumes`` and ``one_sided`` work out over the candidates,
 * and ``choose``'s near ties. The Python side reads each target's load once into a row; this
 * does the arithmetic, operation for operation as the pure code does it (the same doubles in
 * the same order: the two give equal costs to the last bit, and the same choice;
 * tests/routing/test_cache_aware_kernel.py runs both on random fleets and compares them).
 *
 *   cache_aware(weights, prompt, chat, hittable, block_tokens, shared, share, requests,
 *               has_excess, rows, want)
 *
 * ``weights``: the policy's 13 weights (``CacheAware.weights()``'s order); ``prompt``: the
 * prompt's tokens; ``hittable``: its blocks an engine can have cached, of ``block_tokens`` each;
 * ``shared``: the shared prefix in blocks; ``share``: the prefix's share of recent requests
 * (None: not known); ``requests``: its recent requests; ``has_excess``: the shape has volume
 * excesses; ``rows``: a list of one tuple per target (blocks the index says it holds, requests
 * in flight, active sessions, queued prefill tokens, seats or 0, volume excess); ``want``: 0
 * the indices of the targets within the slack of the cheapest, 1 the costs. */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

enum {
    W_DECODE, W_STICKINESS, W_BALANCE, W_SLACK, W_NEW_SESSION_SLACK, W_REWORK_FLOOR,
    W_REWORK_CAP, W_REWORK_MAX, W_SEAT, W_VOLUME, W_VOLUME_CAP, W_MOVE_MARGIN, W_MOVE_PAYBACK,
    WEIGHTS
};

typedef struct {
    long long hit, n, seats;
    double live, queue, excess;
    int free, moves;
    double volume;
} Row;

/* Python's min(a, b) and max(a, b) on floats: the first unless the second is strictly less
 * (greater); -0.0 and 0.0 stay as Python keeps them */
static inline double py_min(double a, double b) { return b < a ? b : a; }
static inline double py_max(double a, double b) { return b > a ? b : a; }

static int read_row(PyObject *item, Row *r, long long hittable, long long block_tokens) {
    if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 6) {
        PyErr_SetString(PyExc_TypeError, "a row is (matched, n, live, queue, seats, excess)");
        return -1;
    }
    long long matched = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 0));
    r->hit = (matched < hittable ? matched : hittable) * block_tokens;
    r->n = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 1));
    r->live = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 2));
    r->queue = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 3));
    r->seats = PyLong_AsLongLong(PyTuple_GET_ITEM(item, 4));
    r->excess = PyFloat_AsDouble(PyTuple_GET_ITEM(item, 5));
    return PyErr_Occurred() ? -1 : 0;
}

PyObject *cache_aware(PyObject *module, PyObject *args) {
    PyObject *weights, *share_obj, *rows;
    long long prompt, hittable, block_tokens, shared;
    int chat, has_excess, want;
    double requests, w[WEIGHTS];
    (void)module;
    if (!PyArg_ParseTuple(args, "O!LpLLLOdpO!i", &PyTuple_Type, &weights, &prompt, &chat,
                          &hittable, &block_tokens, &shared, &share_obj, &requests, &has_excess,
                          &PyList_Type, &rows, &want))
        return NULL;
    shared *= block_tokens; /* in tokens from here on, as the hits */
    if (PyTuple_GET_SIZE(weights) != WEIGHTS) {
        PyErr_SetString(PyExc_ValueError, "cache_aware takes 13 weights");
        return NULL;
    }
    for (int i = 0; i < WEIGHTS; i++) {
        w[i] = PyFloat_AsDouble(PyTuple_GET_ITEM(weights, i));
        if (w[i] == -1.0 && PyErr_Occurred()) return NULL;
    }
    int known_share = share_obj != Py_None;
    double share = known_share ? PyFloat_AsDouble(share_obj) : 0.0;
    if (share == -1.0 && PyErr_Occurred()) return NULL;
    Py_ssize_t count = PyList_GET_SIZE(rows);
    if (count == 0) {
        PyErr_SetString(PyExc_ValueError, "no targets");
        return NULL;
    }
    Row stack[16], *r = count <= 16 ? stack : PyMem_Malloc(count * sizeof(Row));
    if (!r) return PyErr_NoMemory();
    PyObject *out = NULL;
    long long best_match = 0, total_inflight = 0;
    double total_sessions = 0.0, total_queued = 0.0;
    for (Py_ssize_t i = 0; i < count; i++) {
        if (read_row(PyList_GET_ITEM(rows, i), &r[i], hittable, block_tokens) < 0) goto done;
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
    if (shared && known_share) {
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
    if (chat && best_match <= shared) rework = 0.0;
    /* CacheAware.movable */
    int any_moves = 0;
    for (Py_ssize_t i = 0; i < count; i++) r[i].moves = 0;
    if (has_excess && known_share && share != 0.0 && best_match && best_match <= shared &&
        !(requests * (double)prompt < w[W_MOVE_PAYBACK] * (double)best_match)) {
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
    if (has_excess && !(best_match > 0 && free_count < 2)) {
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
    double best = 0.0;
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
        t->volume = cost; /* the cost, from here on */
        if (i == 0 || cost < best) best = cost;
    }
    if (want) {
        out = PyList_New(count);
        for (Py_ssize_t i = 0; out && i < count; i++) {
            PyObject *v = PyFloat_FromDouble(r[i].volume);
            if (!v) Py_CLEAR(out);
            else PyList_SET_ITEM(out, i, v);
        }
        goto done;
    }
    /* choose's near ties: within the slack of the cheapest (a wider one where a chat request
     * with no private history anywhere starts a session) */
    double slack = chat && !(best_match > shared) ? w[W_NEW_SESSION_SLACK] : w[W_SLACK];
    double bound = best + slack;
    out = PyList_New(0);
    for (Py_ssize_t i = 0; out && i < count; i++)
        if (r[i].volume <= bound) {
            PyObject *v = PyLong_FromSsize_t(i);
            if (!v || PyList_Append(out, v) < 0) Py_CLEAR(out);
            Py_XDECREF(v);
        }
done:
    if (r != stack) PyMem_Free(r);
    return out;
}
