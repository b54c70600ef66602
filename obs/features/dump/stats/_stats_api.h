/* What obs.features.dump.stats._stats lends to other extensions through its capsule
 * "obs.features.dump.stats._stats._C_API". */
#ifndef OBS_STATS_API_H
#define OBS_STATS_API_H

#include <Python.h>

#define OBS_STATS_API_VERSION 2

/* The dtype codes of the statistics pass (tensor_stats.py maps torch dtypes to them; bool reads as U8). */
enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I64 = 4, I32 = 5, I16 = 6, I8 = 7, U8 = 8 };

#define OBS_STATS_MAX_PICKS 32 /* statistics per record, at most */
#define OBS_STATS_TEXT_MAX 352 /* bytes for the text of one statistic: 24 but for an integral float as an integer */

/* One statistic: None (max, min, avg without a finite element), a float or an int. */
enum { OBS_NONE = 0, OBS_FLOAT = 1, OBS_INT = 2 };
typedef struct {
    int kind;
    double d;
    long long i;
} ObsValue;

typedef struct {
    int version;
    /* The picked statistics (stats._NATIVE_ORDER) of n elements at p (n / repeat distinct, repeated) into out. */
    void (*compute)(const void *p, Py_ssize_t n, int code, int zeros, Py_ssize_t repeat, const int *picks,
                    Py_ssize_t npicks, ObsValue *out);
    /* Whether no element of n at p is NaN or Inf (integers: always). */
    int (*finite)(const void *p, Py_ssize_t n, int code);
    /* statistic.csv's text of one statistic into out (OBS_STATS_TEXT_MAX bytes), as Python prints it; its length.
     * whole: an integral float prints as an integer (an integer tensor's max and min). */
    int (*value_text)(const ObsValue *v, int whole, char *out);
    /* The Python recorder's row (op, io, slot, record) as its statistic.csv line, "\n" included: a new str, or
     * NULL with an exception.  The record keeps its text, as format_rows does. */
    PyObject *(*row_line)(PyObject *row, PyObject *whole, PyObject *dtypes);
} ObsStatsApi;

/* For an extension that borrows the API: import obs.features.dump.stats._stats (PyCapsule_Import walks attributes, so
 * the module first) and return its API, or NULL with an exception set.  `who` names the extension in the error. */
static inline const ObsStatsApi *obs_stats_api_import(const char *who) {
    PyObject *stats = PyImport_ImportModule("obs.features.dump.stats._stats");
    if (stats == NULL) return NULL;
    Py_DECREF(stats);
    const ObsStatsApi *api = (const ObsStatsApi *)PyCapsule_Import("obs.features.dump.stats._stats._C_API", 0);
    if (api != NULL && api->version != OBS_STATS_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "obs.features.dump.stats._stats has API version %d, %s expects %d",
                     api->version, who, OBS_STATS_API_VERSION);
        return NULL;
    }
    return api;
}

#endif
