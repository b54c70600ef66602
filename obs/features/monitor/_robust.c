/* The monitor's robust rule over many series at once (detect.py's Robust, the same arithmetic, in C).
 *
 * Bank(window, warmup, threshold): one state per series, created on first use: the last `window` finite values in
 *   arrival order (a ring) and the same values sorted, and how many values the series has seen.
 * judge(indices, values) -> [(position, baseline, score), ...]: judges values[i] as the next value of series
 *   indices[i], for every i in order, and returns the flagged ones (their position in `values`, the median they were
 *   judged against, how many robust standard deviations off, inf for a non-finite value).  Exactly Robust.judge:
 *   the first `warmup` values of a series and any value seen with fewer than 3 before it are not judged; the scale
 *   is 1.4826 x the MAD, never below 5% of the median's size (or 1e-12); only finite values join the window.
 *
 * The worker thread calls it once per step with every series of the step: the Python rule costs ~3 us a value on
 * this class of machine, this ~20 ns.  The Python rule stays the reference (obs monitor explain, other rules).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#define MAD_SIGMA 1.4826
#define REL_FLOOR 0.05
#define ABS_FLOOR 1e-12

typedef struct {
    Py_ssize_t count, head; /* values in the window; where the oldest is in the ring */
    long long seen;
} Series;

typedef struct {
    PyObject_HEAD
    Py_ssize_t window, warmup, size, capacity;
    double threshold;
    Series *series;
    double *ring, *sorted; /* window doubles per series, each */
} Bank;

static double median_of(const double *s, Py_ssize_t n) {
    Py_ssize_t mid = n / 2;
    return n % 2 ? s[mid] : (s[mid - 1] + s[mid]) / 2;
}

/* bisect_left / bisect_right over a sorted array */
static Py_ssize_t lower(const double *s, Py_ssize_t n, double v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (s[mid] < v) lo = mid + 1; else hi = mid;
    }
    return lo;
}

static Py_ssize_t upper(const double *s, Py_ssize_t n, double v) {
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (v < s[mid]) hi = mid; else lo = mid + 1;
    }
    return lo;
}

/* detect.py's _mad: the median of |v - median|, merging the two halves outwards from the median */
static double mad_of(const double *s, Py_ssize_t n, double median) {
    Py_ssize_t hi = lower(s, n, median), lo = hi - 1, want = n / 2, taken = 0;
    double last = 0.0, before = 0.0;
    while (taken <= want) {
        before = last;
        if (lo >= 0 && (hi >= n || median - s[lo] <= s[hi] - median)) {
            last = median - s[lo];
            lo--;
        } else {
            last = s[hi] - median;
            hi++;
        }
        taken++;
    }
    return n % 2 ? last : (before + last) / 2;
}

static int grow(Bank *b, Py_ssize_t need) {
    if (need <= b->capacity) return 0;
    Py_ssize_t cap = b->capacity ? b->capacity : 16;
    while (cap < need) cap *= 2;
    Series *series = PyMem_Realloc(b->series, (size_t)cap * sizeof(Series));
    if (!series) return -1;
    b->series = series;
    double *ring = PyMem_Realloc(b->ring, (size_t)(cap * b->window) * sizeof(double));
    if (!ring) return -1;
    b->ring = ring;
    double *sorted = PyMem_Realloc(b->sorted, (size_t)(cap * b->window) * sizeof(double));
    if (!sorted) return -1;
    b->sorted = sorted;
    b->capacity = cap;
    return 0;
}

/* One value of one series: 1 and the verdict when flagged, 0 when not */
static int judge_one(Bank *b, Py_ssize_t k, double value, double *baseline, double *score) {
    Series *st = &b->series[k];
    double *ring = b->ring + k * b->window, *s = b->sorted + k * b->window;
    Py_ssize_t n = st->count;
    int flagged = 0;
    if (st->seen >= b->warmup && n >= 3) {
        double median = median_of(s, n);
        if (!isfinite(value)) {
            *baseline = median;
            *score = INFINITY;
            flagged = 1;
        } else {
            double off = fabs(value - median), floor = fmax(REL_FLOOR * fabs(median), ABS_FLOOR);
            if (off > b->threshold * floor) {
                double scale = fmax(MAD_SIGMA * mad_of(s, n, median), floor);
                if (off / scale > b->threshold) {
                    *baseline = median;
                    *score = off / scale;
                    flagged = 1;
                }
            }
        }
    }
    st->seen++;
    if (isfinite(value)) {
        if (n == b->window) { /* the oldest leaves the window */
            double oldest = ring[st->head];
            Py_ssize_t at = lower(s, n, oldest);
            memmove(s + at, s + at + 1, (size_t)(n - at - 1) * sizeof(double));
            ring[st->head] = value;
            st->head = (st->head + 1) % b->window;
            n--;
        } else {
            ring[(st->head + n) % b->window] = value;
            st->count = n + 1;
        }
        Py_ssize_t at = upper(s, n, value);
        memmove(s + at + 1, s + at, (size_t)(n - at) * sizeof(double));
        s[at] = value;
    }
    return flagged;
}

static PyObject *bank_judge(Bank *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "judge(indices, values): two arguments");
        return NULL;
    }
    PyObject *ix = PySequence_Fast(args[0], "judge: indices must be a sequence");
    if (!ix) return NULL;
    PyObject *vs = PySequence_Fast(args[1], "judge: values must be a sequence");
    if (!vs) { Py_DECREF(ix); return NULL; }
    PyObject *found = NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(ix);
    if (PySequence_Fast_GET_SIZE(vs) != n) {
        PyErr_Format(PyExc_ValueError, "judge: %zd indices but %zd values", n, PySequence_Fast_GET_SIZE(vs));
        goto done;
    }
    PyObject **iv = PySequence_Fast_ITEMS(ix), **vv = PySequence_Fast_ITEMS(vs);
    if (!(found = PyList_New(0))) goto done;
    for (Py_ssize_t i = 0; i < n; i++) {
        Py_ssize_t k = PyLong_AsSsize_t(iv[i]);
        if (k == -1 && PyErr_Occurred()) goto fail;
        if (k < 0) {
            PyErr_Format(PyExc_ValueError, "judge: series index %zd is negative", k);
            goto fail;
        }
        double value = PyFloat_AsDouble(vv[i]);
        if (value == -1.0 && PyErr_Occurred()) goto fail;
        if (k >= b->size) {
            if (grow(b, k + 1) < 0) { PyErr_NoMemory(); goto fail; }
            memset(b->series + b->size, 0, (size_t)(k + 1 - b->size) * sizeof(Series));
            b->size = k + 1;
        }
        double baseline, score;
        if (judge_one(b, k, value, &baseline, &score)) {
            PyObject *t = Py_BuildValue("(ndd)", i, baseline, score);
            if (!t || PyList_Append(found, t) < 0) { Py_XDECREF(t); goto fail; }
            Py_DECREF(t);
        }
    }
    goto done;
fail:
    Py_CLEAR(found);
done:
    Py_DECREF(ix);
    Py_DECREF(vs);
    return found;
}

static int bank_init(Bank *b, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"window", "warmup", "threshold", NULL};
    Py_ssize_t window, warmup;
    double threshold;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "nnd", names, &window, &warmup, &threshold)) return -1;
    if (window < 1 || warmup < 0) {
        PyErr_Format(PyExc_ValueError, "Bank: window must be >= 1 and warmup >= 0, got %zd and %zd", window, warmup);
        return -1;
    }
    b->window = window;
    b->warmup = warmup;
    b->threshold = threshold;
    return 0;
}

static void bank_dealloc(Bank *b) {
    PyMem_Free(b->series);
    PyMem_Free(b->ring);
    PyMem_Free(b->sorted);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

static PyObject *bank_size(Bank *b, void *closure) { return PyLong_FromSsize_t(b->size); }

static PyMethodDef bank_methods[] = {
    {"judge", (PyCFunction)(void (*)(void))bank_judge, METH_FASTCALL,
     "judge(indices, values) -> [(position, baseline, score)]: each value as its series' next, the flagged ones"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef bank_getset[] = {{"size", (getter)bank_size, NULL, "series with a state", NULL},
                                    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject BankType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "obs.features.monitor._robust.Bank",
    .tp_basicsize = sizeof(Bank),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Bank(window, warmup, threshold): the robust rule's state of many series",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)bank_init,
    .tp_dealloc = (destructor)bank_dealloc,
    .tp_methods = bank_methods,
    .tp_getset = bank_getset,
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_robust",
                                    "The monitor's robust rule over many series at once.", -1, NULL};

PyMODINIT_FUNC PyInit__robust(void) {
    if (PyType_Ready(&BankType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m) return NULL;
    Py_INCREF(&BankType);
    if (PyModule_AddObject(m, "Bank", (PyObject *)&BankType) < 0) {
        Py_DECREF(&BankType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
