/* Counter, StringTable and the per-thread scope stack: see _shared.h for why they are in C. */
#include "_shared.h"

#include <pthread.h>
#include <string.h>
#include <structmember.h>

/* -- Counter: itertools.count whose state another library can increment without the GIL ------------ */

static int counter_init(Counter *c, PyObject *args, PyObject *kwds) {
    static char *names[] = {"start", NULL};
    unsigned long long start = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|K", names, &start)) return -1;
    __atomic_store_n(&c->value, (uint64_t)start, __ATOMIC_RELAXED);
    return 0;
}

static PyObject *counter_next(Counter *c) { return PyLong_FromUnsignedLongLong(counter_take(c)); }

static PyObject *counter_address(Counter *c, void *unused) {
    (void)unused;
    return PyLong_FromVoidPtr(&c->value);
}

static PyObject *counter_peek(Counter *c, void *unused) {
    (void)unused;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&c->value, __ATOMIC_RELAXED));
}

static PyGetSetDef counter_getset[] = {
    {"address", (getter)counter_address, NULL, "address of the uint64 this counter increments", NULL},
    {"value", (getter)counter_peek, NULL, "the value next() returns next", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject CounterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "recorder._hotpath.Counter",
    .tp_basicsize = sizeof(Counter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Counter(start=0): next() returns start, start + 1, ...; atomic, also from C without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)counter_init,
    .tp_iter = PyObject_SelfIter,
    .tp_iternext = (iternextfunc)counter_next,
    .tp_getset = counter_getset,
};

/* -- StringTable: u32 length + UTF-8 bytes, appended under a mutex, "used" published last ---------- */

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    Py_ssize_t base, at, end, used_at;
    int32_t count;
    pthread_mutex_t lock;
} StringTable;

int32_t obs_strings_append(void *table, const char *data, uint32_t len) {
    StringTable *t = (StringTable *)table;
    int32_t id = -1;
    uint64_t used;
    pthread_mutex_lock(&t->lock);
    if (t->has_view && t->at + 4 + (Py_ssize_t)len <= t->end) {
        char *buf = (char *)t->view.buf;
        memcpy(buf + t->at, &len, 4);
        memcpy(buf + t->at + 4, data, len);
        t->at += 4 + (Py_ssize_t)len;
        used = (uint64_t)(t->at - t->base);
        /* Published after the bytes: a crash in between leaves the entry invisible, never torn. */
        __atomic_thread_fence(__ATOMIC_RELEASE);
        memcpy(buf + t->used_at, &used, 8);
        id = t->count++;
    }
    pthread_mutex_unlock(&t->lock);
    return id;
}

static int table_init(StringTable *t, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "offset", "capacity", "used_at", NULL};
    PyObject *buffer;
    Py_ssize_t offset, capacity, used_at;
    if (t->has_view) {
        PyErr_SetString(PyExc_RuntimeError, "StringTable is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Onnn", names, &buffer, &offset, &capacity, &used_at)) return -1;
    if (PyObject_GetBuffer(buffer, &t->view, PyBUF_WRITABLE) < 0) return -1;
    if (offset < 0 || capacity < 0 || used_at < 0 || offset + capacity > t->view.len || used_at + 8 > t->view.len) {
        PyBuffer_Release(&t->view);
        PyErr_SetString(PyExc_ValueError, "string table region lies outside the buffer");
        return -1;
    }
    pthread_mutex_init(&t->lock, NULL);
    t->has_view = 1;
    t->base = t->at = offset;
    t->end = offset + capacity;
    t->used_at = used_at;
    t->count = 0;
    return 0;
}

static PyObject *table_append(StringTable *t, PyObject *data) {
    char *bytes;
    Py_ssize_t len;
    int32_t id;
    if (PyBytes_AsStringAndSize(data, &bytes, &len) < 0) return NULL;
    if (len > UINT32_MAX) return PyLong_FromLong(-1);
    Py_BEGIN_ALLOW_THREADS  /* a C++ thread may hold the mutex; it never waits for the GIL */
    id = obs_strings_append(t, bytes, (uint32_t)len);
    Py_END_ALLOW_THREADS
    return PyLong_FromLong(id);
}

static PyObject *table_release(StringTable *t, PyObject *unused) {
    (void)unused;
    if (t->has_view) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&t->lock);
        Py_END_ALLOW_THREADS
        t->has_view = 0;
        pthread_mutex_unlock(&t->lock);
        PyBuffer_Release(&t->view);
    }
    Py_RETURN_NONE;
}

static void table_dealloc(StringTable *t) {
    if (t->has_view) {
        t->has_view = 0;
        PyBuffer_Release(&t->view);
        pthread_mutex_destroy(&t->lock);
    }
    Py_TYPE(t)->tp_free((PyObject *)t);
}

static PyObject *table_address(StringTable *t, void *unused) {
    (void)unused;
    return PyLong_FromVoidPtr(t);
}

static PyMethodDef table_methods[] = {
    {"append", (PyCFunction)table_append, METH_O,
     "append($self, data, /)\n--\n\nAppend UTF-8 bytes; their id, or -1 when the table is full or released."},
    {"release", (PyCFunction)table_release, METH_NOARGS,
     "release($self, /)\n--\n\nLet go of the ring's memory (later appends return -1)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef table_members[] = {
    {"count", T_INT, offsetof(StringTable, count), READONLY, "strings appended so far"},
    {NULL, 0, 0, 0, NULL},
};

static PyGetSetDef table_getset[] = {
    {"address", (getter)table_address, NULL, "the table's address, for obs_strings_append()", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

PyTypeObject StringTableType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "recorder._hotpath.StringTable",
    .tp_basicsize = sizeof(StringTable),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "StringTable(buffer, offset, capacity, used_at): the ring's string table, appendable without the GIL.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)table_init,
    .tp_dealloc = (destructor)table_dealloc,
    .tp_methods = table_methods,
    .tp_members = table_members,
    .tp_getset = table_getset,
};

/* -- the scope stack of this thread (pushed by a scope-tracking SlotWriter) ------------------------ */

#define MAX_DEPTH 256
static __thread int32_t scope_ids[MAX_DEPTH];
static __thread int scope_depth;

void obs_scope_push(int32_t sid) {
    if (scope_depth < MAX_DEPTH) scope_ids[scope_depth] = sid;
    scope_depth++;
}

void obs_scope_pop(void) {
    if (scope_depth > 0) scope_depth--;
}

int32_t obs_current_scope(void) {
    int depth = scope_depth;
    if (depth <= 0) return 0;
    return scope_ids[(depth > MAX_DEPTH ? MAX_DEPTH : depth) - 1];
}

static PyObject *m_native_api(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    return Py_BuildValue("{s:N,s:N}", "strings_append", PyLong_FromVoidPtr((void *)obs_strings_append),
                         "current_scope", PyLong_FromVoidPtr((void *)obs_current_scope));
}

static PyMethodDef shared_methods[] = {
    {"native_api", m_native_api, METH_NOARGS,
     "native_api($module, /)\n--\n\nAddresses of the C functions a native writer calls: strings_append(table, "
     "data, len) and current_scope()."},
    {NULL, NULL, 0, NULL},
};

int shared_add_to_module(PyObject *module) {
    if (PyType_Ready(&CounterType) < 0 || PyType_Ready(&StringTableType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "Counter", (PyObject *)&CounterType) < 0) return -1;
    if (PyModule_AddObjectRef(module, "StringTable", (PyObject *)&StringTableType) < 0) return -1;
    return PyModule_AddFunctions(module, shared_methods);
}
