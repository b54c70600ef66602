/* What the ring's writers share across languages: atomic counters, the string table, the scope stack.
 *
 * Python (recorder/ring.py), the C hot path (_hotpath.c) and the C++ op observer
 * (recorder/_op_observer.cpp, which never holds the GIL) append to the same ring.  They must
 * draw slot indices and seq numbers from the same counters and string ids from the same table,
 * so those live here, as C objects whose state can be reached without the GIL: a Counter is one
 * uint64 incremented atomically; a StringTable appends under a pthread mutex (never the GIL).
 */
#ifndef OBS_RECORDER_SHARED_H
#define OBS_RECORDER_SHARED_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

typedef struct {
    PyObject_HEAD
    uint64_t value;  /* the next value next() returns; only touched with __atomic builtins */
} Counter;

extern PyTypeObject CounterType;
extern PyTypeObject StringTableType;

/* Next value of a Counter, without the GIL. */
static inline uint64_t counter_take(Counter *c) { return __atomic_fetch_add(&c->value, 1, __ATOMIC_RELAXED); }

/* The id of text appended to a StringTable (-1 when full or released); callable without the GIL. */
int32_t obs_strings_append(void *table, const char *data, uint32_t len);

/* The innermost module scope id recorded on this thread by a scope-tracking SlotWriter (0: none). */
int32_t obs_current_scope(void);
void obs_scope_push(int32_t sid);
void obs_scope_pop(void);

/* The functions and types the shared part adds to the _hotpath module. */
int shared_add_to_module(PyObject *module);

/* The C nn.Module.__call__ (recorder/_module_call.c) adds its functions to the _hotpath module. */
int module_call_add_to_module(PyObject *module);

#endif
