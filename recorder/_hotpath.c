/* The recorder's hot path in C: module enter/exit and op events written straight into the ring.
 *
 * Same slots, same strings, same counters as the Python handlers in recorder/ring_handlers.py (which
 * remain the fallback and the reference): a SlotWriter holds a writable view of the ring's
 * memory map, the ring's index counter and the global seq counter (Counter objects from _shared.c, shared
 * with the Python appenders and the C++ op observer), the string-id dict and the intern callable.  Python's own
 * time.perf_counter_ns() is clock_gettime(CLOCK_MONOTONIC) on Linux, so timestamps agree.
 * tests/perf/bench_rdr.py measures both paths.
 *
 * Also the C side of recorder/signals.py: a SIGTERM/SIGINT handler that does only async-signal-safe
 * work (write the signal number to a pipe, then chain to the handler it replaced, i.e. CPython's),
 * so a watcher thread learns of the signal even while the main thread is blocked in C; and die(),
 * which ends the process with a signal's default action from any thread.
 */
#include "_shared.h"

#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <errno.h>
#include <signal.h>
#include <unistd.h>
#include <pthread.h>

#pragma pack(push, 1)
typedef struct {
    uint64_t seq, idx;
    int64_t t;
    uint16_t kind, flags;
    int32_t a;
    int64_t b, c, d;
} Slot;
#pragma pack(pop)

_Static_assert(sizeof(Slot) == 56, "slot layout must match recorder.layout.SLOT");

enum { KIND_MODULE_ENTER = 3, KIND_MODULE_EXIT = 4, KIND_OP = 5 };

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    Py_ssize_t offset;
    unsigned long long capacity;
    PyObject *counter, *seq, *ids, *intern;      /* shared with the Python side */
    PyObject *tensor_type, *signatures, *describe, *state;  /* op events only */
    long long step;
    char track_scope;  /* push/pop scope ids for the native op observer (obs_current_scope) */
} SlotWriter;

static PyObject *str_shape, *str_dtype, *str_stack, *str_empty;

static int next_u64(PyObject *it, unsigned long long *out) {
    PyObject *v;
    if (Py_IS_TYPE(it, &CounterType)) {  /* the shared atomic counter: no Python call */
        *out = counter_take((Counter *)it);
        return 0;
    }
    v = PyIter_Next(it);
    if (v == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "ring counter exhausted");
        return -1;
    }
    *out = PyLong_AsUnsignedLongLong(v);
    Py_DECREF(v);
    return (*out == (unsigned long long)-1 && PyErr_Occurred()) ? -1 : 0;
}

static int write_slot(SlotWriter *w, uint16_t kind, uint16_t flags, int32_t a, int64_t b, int64_t c, int64_t d) {
    unsigned long long idx, seq;
    struct timespec ts;
    Slot slot;
    if (!w->has_view) return 0;  /* released: the recorder is closing */
    if (next_u64(w->counter, &idx) < 0 || next_u64(w->seq, &seq) < 0) return -1;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    slot.seq = seq;
    slot.idx = idx + 1;
    slot.t = (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
    slot.kind = kind;
    slot.flags = flags;
    slot.a = a;
    slot.b = b;
    slot.c = c;
    slot.d = d;
    memcpy((char *)w->view.buf + w->offset + (idx % w->capacity) * sizeof(Slot), &slot, sizeof(Slot));
    return 0;
}

/* The id of a string in the ring's table: the dict first, the Python intern() on a miss. */
static int string_id(SlotWriter *w, PyObject *text, long *out) {
    PyObject *v = PyDict_GetItemWithError(w->ids, text);
    if (v != NULL) {
        *out = PyLong_AsLong(v);
        return 0;
    }
    if (PyErr_Occurred()) return -1;
    v = PyObject_CallOneArg(w->intern, text);
    if (v == NULL) return -1;
    *out = PyLong_AsLong(v);
    Py_DECREF(v);
    return (*out == -1 && PyErr_Occurred()) ? -1 : 0;
}

static PyObject *module_event(SlotWriter *w, PyObject *scope, uint16_t kind, uint16_t flags) {
    long sid;
    if (string_id(w, scope, &sid) < 0) return NULL;
    if (w->track_scope) {
        if (kind == KIND_MODULE_ENTER) obs_scope_push((int32_t)sid);
        else obs_scope_pop();
    }
    if (write_slot(w, kind, flags, (int32_t)sid, w->step, 0, 0) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *w_enter(SlotWriter *w, PyObject *const *args, Py_ssize_t n) {
    if (n != 2) {
        PyErr_SetString(PyExc_TypeError, "enter(scope, module)");
        return NULL;
    }
    return module_event(w, args[0], KIND_MODULE_ENTER, 0);
}

static PyObject *w_exit(SlotWriter *w, PyObject *const *args, Py_ssize_t n) {
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "exit(scope, module, error)");
        return NULL;
    }
    return module_event(w, args[0], KIND_MODULE_EXIT, args[2] != Py_None);
}

/* (name, shape, dtype, ... or type, None) of an op's positional inputs: the signature cache key. */
static PyObject *signature_key(SlotWriter *w, PyObject *name, PyObject *seq) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq), i;
    PyObject **items = PySequence_Fast_ITEMS(seq);
    PyObject *key = PyTuple_New(1 + 2 * n);
    if (key == NULL) return NULL;
    Py_INCREF(name);
    PyTuple_SET_ITEM(key, 0, name);
    for (i = 0; i < n; i++) {
        PyObject *arg = items[i], *first, *second;
        if (PyObject_TypeCheck(arg, (PyTypeObject *)w->tensor_type)) {
            first = PyObject_GetAttr(arg, str_shape);
            second = first ? PyObject_GetAttr(arg, str_dtype) : NULL;
            if (second == NULL) {
                Py_XDECREF(first);
                Py_DECREF(key);
                return NULL;
            }
        } else {
            first = (PyObject *)Py_TYPE(arg);
            Py_INCREF(first);
            second = Py_None;
            Py_INCREF(second);
        }
        PyTuple_SET_ITEM(key, 1 + 2 * i, first);
        PyTuple_SET_ITEM(key, 2 + 2 * i, second);
    }
    return key;
}

static PyObject *w_op(SlotWriter *w, PyObject *const *args, Py_ssize_t n) {
    PyObject *name, *seq, *key, *pair, *stack, *scope;
    long nid, sigid, sid;
    int64_t duration;
    if (n != 5) {
        PyErr_SetString(PyExc_TypeError, "op(name, args, kwargs, duration_ns, error)");
        return NULL;
    }
    if (w->tensor_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "this SlotWriter was not set up for ops");
        return NULL;
    }
    name = args[0];
    seq = PySequence_Fast(args[1], "op args must be a sequence");
    if (seq == NULL) return NULL;
    key = signature_key(w, name, seq);
    if (key == NULL) {
        Py_DECREF(seq);
        return NULL;
    }
    pair = PyDict_GetItemWithError(w->signatures, key);
    if (pair != NULL) {
        Py_INCREF(pair);
    } else if (!PyErr_Occurred()) {
        pair = PyObject_CallFunctionObjArgs(w->describe, name, args[1], NULL);
        if (pair != NULL && PyDict_SetItem(w->signatures, key, pair) < 0) Py_CLEAR(pair);
    }
    Py_DECREF(key);
    Py_DECREF(seq);
    if (pair == NULL) return NULL;
    if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
        Py_DECREF(pair);
        PyErr_SetString(PyExc_TypeError, "describe() must return (name id, signature id)");
        return NULL;
    }
    nid = PyLong_AsLong(PyTuple_GET_ITEM(pair, 0));
    sigid = PyLong_AsLong(PyTuple_GET_ITEM(pair, 1));
    Py_DECREF(pair);
    if (PyErr_Occurred()) return NULL;
    stack = PyObject_GetAttr(w->state, str_stack);
    if (stack == NULL) return NULL;
    scope = (PyList_Check(stack) && PyList_GET_SIZE(stack)) ? PyList_GET_ITEM(stack, PyList_GET_SIZE(stack) - 1)
                                                            : str_empty;
    Py_INCREF(scope);
    Py_DECREF(stack);
    n = string_id(w, scope, &sid);
    Py_DECREF(scope);
    if (n < 0) return NULL;
    duration = PyLong_AsLongLong(args[3]);
    if (duration == -1 && PyErr_Occurred()) return NULL;
    if (write_slot(w, KIND_OP, args[4] != Py_None, (int32_t)nid, sid, duration, sigid) < 0) return NULL;
    Py_RETURN_NONE;
}

/* append(kind, flags, a, b, c, d): one slot of any kind, as RingWriter.appender's Python closure writes it (the
 * step, phase and memory events: a few per step, from Python handlers). */
static PyObject *w_append(SlotWriter *w, PyObject *const *args, Py_ssize_t n) {
    long long v[6];
    Py_ssize_t i;
    if (n != 6) {
        PyErr_SetString(PyExc_TypeError, "append(kind, flags, a, b, c, d)");
        return NULL;
    }
    for (i = 0; i < 6; i++) {
        v[i] = PyLong_AsLongLong(args[i]);
        if (v[i] == -1 && PyErr_Occurred()) return NULL;
    }
    if (write_slot(w, (uint16_t)v[0], (uint16_t)v[1], (int32_t)v[2], v[3], v[4], v[5]) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *w_release(SlotWriter *w, PyObject *unused) {
    (void)unused;
    if (w->has_view) {
        w->has_view = 0;
        PyBuffer_Release(&w->view);
    }
    Py_RETURN_NONE;
}

static int w_init(SlotWriter *w, PyObject *args, PyObject *kwds) {
    static char *names[] = {"buffer", "offset", "capacity", "counter", "seq", "ids", "intern", "tensor_type",
                            "signatures", "describe", "state", NULL};
    PyObject *buffer, *counter, *seq, *ids, *intern;
    PyObject *tensor_type = NULL, *signatures = NULL, *describe = NULL, *state = NULL;
    Py_ssize_t offset;
    unsigned long long capacity;
    if (w->has_view || w->counter != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "SlotWriter is already initialised");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OnKOOO!O|OO!OO", names, &buffer, &offset, &capacity, &counter,
                                     &seq, &PyDict_Type, &ids, &intern, &tensor_type, &PyDict_Type, &signatures,
                                     &describe, &state))
        return -1;
    if (capacity == 0) {
        PyErr_SetString(PyExc_ValueError, "capacity must be positive");
        return -1;
    }
    if (tensor_type == Py_None) tensor_type = NULL;
    if (tensor_type != NULL && (!PyType_Check(tensor_type) || signatures == NULL || describe == NULL ||
                                state == NULL)) {
        PyErr_SetString(PyExc_TypeError, "ops need tensor_type (a type), signatures, describe and state");
        return -1;
    }
    if (PyObject_GetBuffer(buffer, &w->view, PyBUF_WRITABLE) < 0) return -1;
    w->has_view = 1;
    if (offset < 0 || (unsigned long long)offset + capacity * sizeof(Slot) > (unsigned long long)w->view.len) {
        w_release(w, NULL);
        PyErr_SetString(PyExc_ValueError, "ring region lies outside the buffer");
        return -1;
    }
    w->offset = offset;
    w->capacity = capacity;
    w->counter = Py_NewRef(counter);
    w->seq = Py_NewRef(seq);
    w->ids = Py_NewRef(ids);
    w->intern = Py_NewRef(intern);
    if (tensor_type != NULL) {
        w->tensor_type = Py_NewRef(tensor_type);
        w->signatures = Py_NewRef(signatures);
        w->describe = Py_NewRef(describe);
        w->state = Py_NewRef(state);
    }
    return 0;
}

static void w_dealloc(SlotWriter *w) {
    w_release(w, NULL);
    Py_XDECREF(w->counter);
    Py_XDECREF(w->seq);
    Py_XDECREF(w->ids);
    Py_XDECREF(w->intern);
    Py_XDECREF(w->tensor_type);
    Py_XDECREF(w->signatures);
    Py_XDECREF(w->describe);
    Py_XDECREF(w->state);
    Py_TYPE(w)->tp_free((PyObject *)w);
}

static PyMethodDef w_methods[] = {
    {"enter", (PyCFunction)(void (*)(void))w_enter, METH_FASTCALL,
     "enter($self, scope, module, /)\n--\n\nRecord MODULE_ENTER."},
    {"exit", (PyCFunction)(void (*)(void))w_exit, METH_FASTCALL,
     "exit($self, scope, module, error, /)\n--\n\nRecord MODULE_EXIT (flags 1 when error is not None)."},
    {"op", (PyCFunction)(void (*)(void))w_op, METH_FASTCALL,
     "op($self, name, args, kwargs, duration_ns, error, /)\n--\n\nRecord one OP event."},
    {"append", (PyCFunction)(void (*)(void))w_append, METH_FASTCALL,
     "append($self, kind, flags, a, b, c, d, /)\n--\n\nRecord one slot of any kind (the step, phase and memory "
     "events)."},
    {"release", (PyCFunction)w_release, METH_NOARGS,
     "release($self, /)\n--\n\nLet go of the ring's memory (later events are dropped)."},
    {NULL, NULL, 0, NULL},
};

static PyMemberDef w_members[] = {
    {"step", T_LONGLONG, offsetof(SlotWriter, step), 0, "step number written into module slots"},
    {"track_scope", T_BOOL, offsetof(SlotWriter, track_scope), 0,
     "keep this thread's scope stack for the native op observer (module writers of its ring only)"},
    {NULL, 0, 0, 0, NULL},
};

static PyTypeObject SlotWriterType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "recorder._hotpath.SlotWriter",
    .tp_basicsize = sizeof(SlotWriter),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Writes module/op slots of one ring (see recorder/_hotpath.c).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)w_init,
    .tp_dealloc = (destructor)w_dealloc,
    .tp_methods = w_methods,
    .tp_members = w_members,
};


/* -- signals ---------------------------------------------------------------------------------- */

#define MAX_SIGNAL 65
static volatile sig_atomic_t pipe_fd = -1;
static volatile pid_t pipe_pid = 0;  /* a forked child inherits the handler: it must not write */
static struct sigaction replaced[MAX_SIGNAL];
static int hooked[MAX_SIGNAL];

static void on_signal(int signum, siginfo_t *info, void *context) {
    int saved_errno = errno;
    struct sigaction *prev = &replaced[signum];
    int fd = pipe_fd;
    if (fd >= 0 && getpid() == pipe_pid) {
        unsigned char byte = (unsigned char)signum;
        ssize_t ignored = write(fd, &byte, 1);  /* non-blocking: a full pipe already holds a wake-up */
        (void)ignored;
    }
    if (prev->sa_flags & SA_SIGINFO) {
        if (prev->sa_sigaction != NULL) prev->sa_sigaction(signum, info, context);
    } else if (prev->sa_handler != SIG_DFL && prev->sa_handler != SIG_IGN && prev->sa_handler != NULL) {
        prev->sa_handler(signum);
    }
    errno = saved_errno;
}

static int check_signal(int signum) {
    if (signum <= 0 || signum >= MAX_SIGNAL) {
        PyErr_Format(PyExc_ValueError, "signal number must be in [1, %d) (got %d)", MAX_SIGNAL, signum);
        return -1;
    }
    return 0;
}

static PyObject *m_set_signal_pipe(PyObject *self, PyObject *arg) {
    long fd = PyLong_AsLong(arg);
    (void)self;
    if (fd == -1 && PyErr_Occurred()) return NULL;
    pipe_pid = getpid();
    pipe_fd = (sig_atomic_t)fd;
    Py_RETURN_NONE;
}

static PyObject *m_hook_signal(PyObject *self, PyObject *arg) {
    int signum = (int)PyLong_AsLong(arg);
    struct sigaction action, prev;
    (void)self;
    if (signum == -1 && PyErr_Occurred()) return NULL;
    if (check_signal(signum) < 0) return NULL;
    if (hooked[signum]) {
        PyErr_Format(PyExc_RuntimeError, "signal %d is already hooked", signum);
        return NULL;
    }
    if (sigaction(signum, NULL, &prev) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    replaced[signum] = prev;
    memset(&action, 0, sizeof(action));
    action.sa_sigaction = on_signal;
    action.sa_mask = prev.sa_mask;
    /* The flags of the handler we chain to (CPython's: no SA_RESTART, so blocking calls see EINTR
     * and Python runs its handlers), plus SA_SIGINFO for our own signature. */
    action.sa_flags = (prev.sa_flags & ~(SA_RESETHAND | SA_SIGINFO)) | SA_SIGINFO | SA_ONSTACK;
    if (sigaction(signum, &action, NULL) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    hooked[signum] = 1;
    Py_RETURN_NONE;
}

static PyObject *m_unhook_signal(PyObject *self, PyObject *arg) {
    int signum = (int)PyLong_AsLong(arg);
    struct sigaction current;
    (void)self;
    if (signum == -1 && PyErr_Occurred()) return NULL;
    if (check_signal(signum) < 0) return NULL;
    if (!hooked[signum]) Py_RETURN_FALSE;
    hooked[signum] = 0;
    if (sigaction(signum, NULL, &current) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    if (!(current.sa_flags & SA_SIGINFO) || current.sa_sigaction != on_signal) Py_RETURN_FALSE;  /* replaced since */
    if (sigaction(signum, &replaced[signum], NULL) < 0) return PyErr_SetFromErrno(PyExc_OSError);
    Py_RETURN_TRUE;
}

static PyObject *m_die(PyObject *self, PyObject *arg) {
    int signum = (int)PyLong_AsLong(arg);
    struct sigaction action;
    sigset_t set;
    (void)self;
    if (signum == -1 && PyErr_Occurred()) return NULL;
    if (check_signal(signum) < 0) return NULL;
    memset(&action, 0, sizeof(action));
    action.sa_handler = SIG_DFL;
    sigemptyset(&action.sa_mask);
    sigaction(signum, &action, NULL);
    sigemptyset(&set);
    sigaddset(&set, signum);
    pthread_sigmask(SIG_UNBLOCK, &set, NULL);
    kill(getpid(), signum);
    raise(signum);
    /* Only reached when the default action does not end the process (e.g. SIGCHLD). */
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"set_signal_pipe", m_set_signal_pipe, METH_O,
     "set_signal_pipe($module, fd, /)\n--\n\nWhere hooked signals write their number (-1: nowhere)."},
    {"hook_signal", m_hook_signal, METH_O,
     "hook_signal($module, signum, /)\n--\n\nPut the pipe-writing handler in front of the current one."},
    {"unhook_signal", m_unhook_signal, METH_O,
     "unhook_signal($module, signum, /)\n--\n\nPut back the handler hook_signal replaced, if ours is still "
     "installed; True when it was."},
    {"die", m_die, METH_O,
     "die($module, signum, /)\n--\n\nEnd the process with the default action of signum (from any thread)."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_hotpath", "C hot path of the recorder.", -1,
                                     module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__hotpath(void) {
    PyObject *m;
    if (PyType_Ready(&SlotWriterType) < 0) return NULL;
    str_shape = PyUnicode_InternFromString("shape");
    str_dtype = PyUnicode_InternFromString("dtype");
    str_stack = PyUnicode_InternFromString("stack");
    str_empty = PyUnicode_InternFromString("");
    if (!str_shape || !str_dtype || !str_stack || !str_empty) return NULL;
    m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SlotWriterType);
    if (PyModule_AddObject(m, "SlotWriter", (PyObject *)&SlotWriterType) < 0) {
        Py_DECREF(&SlotWriterType);
        Py_DECREF(m);
        return NULL;
    }
    if (shared_add_to_module(m) < 0 || module_call_add_to_module(m) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
