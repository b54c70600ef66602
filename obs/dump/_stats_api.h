/* What obs.dump._stats lends to other extensions through its capsule "obs.dump._stats._C_API". */
#ifndef OBS_STATS_API_H
#define OBS_STATS_API_H

#include <Python.h>

#define OBS_STATS_API_VERSION 1

/* The dtype codes of the statistics pass (stats.py maps torch dtypes to them; bool reads as U8). */
enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3, I64 = 4, I32 = 5, I16 = 6, I8 = 7, U8 = 8 };

#define OBS_STATS_MAX_PICKS 32 /* statistics per record, at most */

typedef struct {
    int version;
    /* The picked statistics (stats._NATIVE_ORDER) of n elements at p (n / repeat distinct, repeated): a new list. */
    PyObject *(*values)(const void *p, Py_ssize_t n, int code, int zeros, Py_ssize_t repeat, const int *picks,
                        Py_ssize_t npicks);
    /* Whether no element of n at p is NaN or Inf (integers: always). */
    int (*finite)(const void *p, Py_ssize_t n, int code);
} ObsStatsApi;

/* For an extension that borrows the API: import obs.dump._stats (PyCapsule_Import walks attributes, so the module
 * first) and return its API, or NULL with an exception set.  `who` names the extension in the error. */
static inline const ObsStatsApi *obs_stats_api_import(const char *who) {
    PyObject *stats = PyImport_ImportModule("obs.dump._stats");
    if (stats == NULL) return NULL;
    Py_DECREF(stats);
    const ObsStatsApi *api = (const ObsStatsApi *)PyCapsule_Import("obs.dump._stats._C_API", 0);
    if (api != NULL && api->version != OBS_STATS_API_VERSION) {
        PyErr_Format(PyExc_ImportError, "obs.dump._stats has API version %d, %s expects %d", api->version, who,
                     OBS_STATS_API_VERSION);
        return NULL;
    }
    return api;
}

#endif
