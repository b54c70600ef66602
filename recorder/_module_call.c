/* nn.Module.__call__ in C: the module-event wrapper of obs/runtime/torch/_modules.py without a Python frame.
 *
 * install_module_call() returns a method descriptor of torch.nn.Module (vectorcall, no bound method
 * per call) that _modules.py puts in place of Module.__call__.  Per call it does what the Python
 * wrapper (the reference, and the fallback where OBS_NATIVE_RECORDER=0 or OBS_NATIVE=0) does:
 *   - suppressed (obs's own tensor work), compiling, or inside a torch.compile'd call (Dynamo's frame
 *     callback is set: handlers run there would be compiled as frames of their own): call the original
 *     and nothing else;
 *   - the scope, from the cache of names computed once per module instance (scope_of() on a miss);
 *   - push it on this thread's scope stack, open the step automatically (grad enabled, not in a step);
 *   - MODULE_ENTER handlers, the module itself (torch's _wrapped_call_impl inlined), MODULE_EXIT
 *     handlers, the forward PHASE of a root call, and on an exception the failure hooks and the FAULT,
 *     leaving the exception and its traceback as they were (a C function adds no traceback entry).
 * A handler's error goes to report_internal_error(site, exc), as in Python.
 * The Python helpers it calls (scope_of, auto_begin, on_phase, on_fault) run only on a cache miss, at a
 * step's first call, for a root call while PHASE is wanted, or on a failure.  The failure hooks are the
 * registry handed to install_module_call (obs._core.hooks.Hooks): a failure reads its `snapshot` (a tuple)
 * and calls its `call` only when that is not empty.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <time.h>

/* The configuration is one tuple that each call holds a reference to: a handler may uninstall the
 * wrapper (unsubscribing ends the module events) while calls are in flight on the stack. */
enum { C_STATE, C_CGLOBALS, C_SCOPES, C_SCOPE_OF, C_TRACKER, C_AUTO_BEGIN, C_GRAD, C_REPORT, C_ON_PHASE, C_ON_FAULT,
       C_FAILURES, C_REGION, C_COUNT };
enum { H_ENTER, H_EXIT, H_PHASE };

typedef struct {
    int inline_call;         /* the original is torch's _wrapped_call_impl: call _call_impl directly */
    PyObject *descriptor;    /* the method descriptor (created once per process) */
    PyObject *original;      /* kept after uninstall: a descriptor still referenced somewhere calls it */
    PyObject *config;        /* C_COUNT objects, NULL while not installed */
    PyObject *handlers;      /* (enter, exit, phase) tuples, read when used; refreshed on subscription changes */
} Hooks;

static Hooks H;
#define CFG(i) PyTuple_GET_ITEM(cfg, (i))
#define HANDLERS(i) PyTuple_GET_ITEM(H.handlers, (i))
static PyObject *s_depth, *s_stack, *s_flag, *s_in_step, *s_call_impl, *s_compiled, *s_snapshot, *s_call, *s_kind,
    *s_site_enter, *s_site_exit;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);  /* what time.perf_counter_ns() reads on Linux */
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* fn(module, *args, **kw) with the vectorcall arguments of the descriptor. */
static PyObject *call_with_self(PyObject *fn, PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames, int method) {
    Py_ssize_t total = nargs + (kwnames ? PyTuple_GET_SIZE(kwnames) : 0), i;
    PyObject *small[9], **stack = small, *result;
    if (total + 1 > 9) {
        stack = PyMem_Malloc((size_t)(total + 1) * sizeof(PyObject *));
        if (stack == NULL) return PyErr_NoMemory();
    }
    stack[0] = module;
    for (i = 0; i < total; i++) stack[i + 1] = args[i];
    result = method ? PyObject_VectorcallMethod(fn, stack, (size_t)(nargs + 1), kwnames)
                    : PyObject_Vectorcall(fn, stack, (size_t)(nargs + 1), kwnames);
    if (stack != small) PyMem_Free(stack);
    return result;
}

/* The module itself: _compiled_call_impl or _call_impl (torch's _wrapped_call_impl), else the original. */
static PyObject *call_module(PyObject *module, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *compiled, *result;
    if (!H.inline_call) return call_with_self(H.original, module, args, nargs, kwnames, 0);
    compiled = PyObject_GetAttr(module, s_compiled);
    if (compiled == NULL) return NULL;
    if (compiled != Py_None) {
        result = PyObject_Vectorcall(compiled, args, (size_t)nargs, kwnames);
        Py_DECREF(compiled);
        return result;
    }
    Py_DECREF(compiled);
    return call_with_self(s_call_impl, module, args, nargs, kwnames, 1);
}

/* Whether obs's hooks must stay out of this call: suppressed on this thread, tracing for torch.compile/export,
 * or running inside a compiled call (the module a torch.compile wrapper calls, eager code between graphs). */
static int bypass(PyObject *cfg) {
    PyObject *depth, *callback, *flag = PyDict_GetItemWithError(CFG(C_CGLOBALS), s_flag);
    int on;
    if (flag == NULL && PyErr_Occurred()) return -1;
    if (flag == Py_True) return 1;
    depth = PyObject_GetAttr(CFG(C_STATE), s_depth);
    if (depth == NULL) return -1;
    on = PyObject_IsTrue(depth);
    Py_DECREF(depth);
    if (on != 0) return on;
    callback = PyObject_CallNoArgs(CFG(C_REGION));
    if (callback == NULL) return -1;
    on = callback != Py_None && callback != Py_False;
    Py_DECREF(callback);
    return on;
}

/* Call report(site, exc) for the error raised by a handler; -1 when report() itself raises (tests' raise mode). */
static int report_error(PyObject *cfg, PyObject *site) {
    PyObject *type, *value, *tb, *r;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb != NULL && value != NULL) PyException_SetTraceback(value, tb);
    r = PyObject_CallFunctionObjArgs(CFG(C_REPORT), site, value ? value : Py_None, NULL);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

/* Each handler(*argv); errors reported.  -1 only when reporting raised. */
static int call_handlers(PyObject *cfg, int which, PyObject *const *argv, Py_ssize_t n, PyObject *site) {
    PyObject *handlers = Py_NewRef(HANDLERS(which));
    Py_ssize_t i, count = PyTuple_GET_SIZE(handlers);
    for (i = 0; i < count; i++) {
        PyObject *r = PyObject_Vectorcall(PyTuple_GET_ITEM(handlers, i), argv, (size_t)n, NULL);
        if (r != NULL) {
            Py_DECREF(r);
        } else if (report_error(cfg, site) < 0) {
            Py_DECREF(handlers);
            return -1;
        }
    }
    Py_DECREF(handlers);
    return 0;
}

/* The failure hooks (exception_dump) with the call's own arguments, as (args, kwargs):
 * failure_hooks.call(error, "module", scope, args, kwargs, module), which reports a failing hook itself. */
static int run_failed(PyObject *cfg, PyObject *error, PyObject *scope, PyObject *module, PyObject *const *args,
                      Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *hooks = PyObject_GetAttr(CFG(C_FAILURES), s_snapshot), *tuple, *kwargs, *r;
    Py_ssize_t i;
    int any;
    if (hooks == NULL) return -1;
    any = PyObject_IsTrue(hooks);
    Py_DECREF(hooks);
    if (any <= 0) return any;
    tuple = PyTuple_New(nargs);
    kwargs = PyDict_New();
    if (tuple == NULL || kwargs == NULL) goto fail;
    for (i = 0; i < nargs; i++) PyTuple_SET_ITEM(tuple, i, Py_NewRef(args[i]));
    for (i = 0; kwnames && i < PyTuple_GET_SIZE(kwnames); i++)
        if (PyDict_SetItem(kwargs, PyTuple_GET_ITEM(kwnames, i), args[nargs + i]) < 0) goto fail;
    r = PyObject_CallMethodObjArgs(CFG(C_FAILURES), s_call, error, s_kind, scope, tuple, kwargs, module, NULL);
    Py_DECREF(tuple);
    Py_DECREF(kwargs);
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
fail:
    Py_XDECREF(tuple);
    Py_XDECREF(kwargs);
    return -1;
}

static int grad_enabled(PyObject *cfg) {
    PyObject *r = PyObject_CallNoArgs(CFG(C_GRAD));
    int on;
    if (r == NULL) return -1;
    on = r == Py_True;
    Py_DECREF(r);
    return on;
}

/* The scope of this call: cached per module instance, else scope_of(module, stack). New reference. */
static PyObject *scope_for(PyObject *cfg, PyObject *module, PyObject *stack) {
    PyObject *key = PyLong_FromVoidPtr(module), *scope;
    if (key == NULL) return NULL;
    scope = PyDict_GetItemWithError(CFG(C_SCOPES), key);
    Py_DECREF(key);
    if (scope != NULL) return Py_NewRef(scope);
    if (PyErr_Occurred()) return NULL;
    return PyObject_CallFunctionObjArgs(CFG(C_SCOPE_OF), module, stack, NULL);
}

/* Open the step if none is open and grad is enabled (the first module call of a training step). */
static int maybe_begin_step(PyObject *cfg) {
    PyObject *in_step = PyObject_GetAttr(CFG(C_TRACKER), s_in_step), *r;
    int open, grad;
    if (in_step == NULL) return -1;
    open = PyObject_IsTrue(in_step);
    Py_DECREF(in_step);
    if (open) return open < 0 ? -1 : 0;
    if ((grad = grad_enabled(cfg)) <= 0) return grad;
    r = PyObject_CallNoArgs(CFG(C_AUTO_BEGIN));
    if (r == NULL) return -1;
    Py_DECREF(r);
    return 0;
}

static PyObject *module_call(PyObject *module, PyObject *const *args, Py_ssize_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf), depth = 0;
    PyObject *cfg = H.config, *stack = NULL, *scope = NULL, *result = NULL, *type = NULL, *error = NULL, *tb = NULL;
    PyObject *argv[3];
    int64_t began = 0;
    int skip, root, grad;
    if (cfg == NULL) return call_with_self(H.original, module, args, nargs, kwnames, 0);
    Py_INCREF(cfg);
    if ((skip = bypass(cfg)) != 0) {
        if (skip > 0) result = call_module(module, args, nargs, kwnames);
        goto done;
    }
    stack = PyObject_GetAttr(CFG(C_STATE), s_stack);
    if (stack == NULL) goto done;
    if (!PyList_Check(stack)) {
        PyErr_SetString(PyExc_TypeError, "obs: the scope stack must be a list");
        goto done;
    }
    root = PyList_GET_SIZE(stack) == 0;
    if ((scope = scope_for(cfg, module, stack)) == NULL) goto done;
    if (PyUnicode_GET_LENGTH(scope) == 0) {  /* code torch generated (a compiled graph), not a module of the user's */
        result = call_module(module, args, nargs, kwnames);
        goto done;
    }
    if (PyList_Append(stack, scope) < 0) goto done;
    depth = PyList_GET_SIZE(stack);
    if (maybe_begin_step(cfg) < 0 && report_error(cfg, s_site_enter) < 0) goto pop;
    if (root && PyTuple_GET_SIZE(HANDLERS(H_PHASE))) {  /* a root call with grad enabled is the step's forward */
        if ((grad = grad_enabled(cfg)) < 0) goto pop;
        if (grad) began = now_ns();
    }
    argv[0] = scope;
    argv[1] = module;
    if (call_handlers(cfg, H_ENTER, argv, 2, s_site_enter) < 0) goto pop;

    result = call_module(module, args, nargs, kwnames);
    if (result == NULL) {
        PyErr_Fetch(&type, &error, &tb);
        PyErr_NormalizeException(&type, &error, &tb);
        if (tb != NULL) PyException_SetTraceback(error, tb);
        if (run_failed(cfg, error, scope, module, args, nargs, kwnames) < 0 && report_error(cfg, s_site_exit) < 0)
            goto fail;
    }
    /* Pop our own entry (and whatever a failing call above us left). */
    if (PyList_GET_SIZE(stack) >= depth && PyList_SetSlice(stack, depth - 1, PyList_GET_SIZE(stack), NULL) < 0)
        goto fail;
    argv[2] = error ? error : Py_None;
    if (call_handlers(cfg, H_EXIT, argv, 3, s_site_exit) < 0) goto fail;
    if (began) {
        PyObject *phase = Py_NewRef(HANDLERS(H_PHASE)), *r;
        r = PyObject_CallFunction(CFG(C_ON_PHASE), "OLL", phase, (long long)began, (long long)now_ns());
        Py_DECREF(phase);
        if (r == NULL) goto fail;
        Py_DECREF(r);
    }
    if (error != NULL) {
        PyObject *r = PyObject_CallFunctionObjArgs(CFG(C_ON_FAULT), scope, error, NULL);
        if (r == NULL) goto fail;
        Py_DECREF(r);
        PyErr_Restore(type, error, tb);  /* the training sees its own exception, unchanged */
        type = error = tb = NULL;
    }
    goto done;
pop:
    if (PyList_GET_SIZE(stack) >= depth) {
        PyObject *pending_type, *pending, *pending_tb;
        PyErr_Fetch(&pending_type, &pending, &pending_tb);
        PyList_SetSlice(stack, depth - 1, PyList_GET_SIZE(stack), NULL);
        PyErr_Restore(pending_type, pending, pending_tb);
    }
    goto done;
fail:  /* our own error, in raise mode (tests): it replaces the training's, and our stack entry leaves too */
    Py_CLEAR(result);
    Py_XDECREF(type);
    Py_XDECREF(error);
    Py_XDECREF(tb);
    goto pop;
done:
    Py_XDECREF(scope);
    Py_XDECREF(stack);
    Py_DECREF(cfg);
    return result;
}

static PyMethodDef call_def = {
    "__call__", (PyCFunction)(void (*)(void))module_call, METH_FASTCALL | METH_KEYWORDS,
    "__call__($self, /, *args, **kwargs)\n--\n\nCall the module, publishing obs's module events "
    "(recorder/_module_call.c)."};

static PyObject *m_install(PyObject *self, PyObject *args, PyObject *kwds) {
    static char *names[] = {"module_type", "original", "inline", "state", "compiler_globals", "scopes", "scope_of",
                            "tracker", "auto_begin", "grad_enabled", "report", "on_phase", "on_fault",
                            "failure_hooks", "compiled_region", NULL};
    PyObject *type, *original, *o[C_COUNT], *config, *handlers;
    int inline_call, i;
    (void)self;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O!OpOO!O!OOOOOOOOO", names, &PyType_Type, &type, &original,
                                     &inline_call, &o[C_STATE], &PyDict_Type, &o[C_CGLOBALS], &PyDict_Type,
                                     &o[C_SCOPES], &o[C_SCOPE_OF], &o[C_TRACKER], &o[C_AUTO_BEGIN], &o[C_GRAD],
                                     &o[C_REPORT], &o[C_ON_PHASE], &o[C_ON_FAULT], &o[C_FAILURES], &o[C_REGION]))
        return NULL;
    if (!PyObject_HasAttr(o[C_FAILURES], s_call) || !PyObject_HasAttr(o[C_FAILURES], s_snapshot)) {
        PyErr_Format(PyExc_TypeError, "install_module_call: failure_hooks must be a hook registry "
                     "(obs._core.hooks.Hooks: a snapshot tuple and a call method), got %R", o[C_FAILURES]);
        return NULL;
    }
    if (H.descriptor == NULL) {
        H.descriptor = PyDescr_NewMethod((PyTypeObject *)type, &call_def);
        if (H.descriptor == NULL) return NULL;
    } else if (PyDescr_TYPE(H.descriptor) != (PyTypeObject *)type) {
        PyErr_SetString(PyExc_ValueError, "install_module_call: module_type differs from the first install");
        return NULL;
    }
    config = PyTuple_New(C_COUNT);
    if (config == NULL) return NULL;
    for (i = 0; i < C_COUNT; i++) PyTuple_SET_ITEM(config, i, Py_NewRef(o[i]));
    handlers = Py_BuildValue("(()()())");
    if (handlers == NULL) {
        Py_DECREF(config);
        return NULL;
    }
    Py_XSETREF(H.original, Py_NewRef(original));
    H.inline_call = inline_call;
    Py_XSETREF(H.handlers, handlers);
    Py_XSETREF(H.config, config);
    return Py_NewRef(H.descriptor);
}

static PyObject *m_set_handlers(PyObject *self, PyObject *const *args, Py_ssize_t n) {
    Py_ssize_t i;
    PyObject *handlers;
    (void)self;
    if (n != 3) {
        PyErr_SetString(PyExc_TypeError, "set_module_handlers(enter, exit, phase)");
        return NULL;
    }
    for (i = 0; i < 3; i++)
        if (!PyTuple_Check(args[i])) {
            PyErr_SetString(PyExc_TypeError, "set_module_handlers takes three tuples");
            return NULL;
        }
    if (H.config == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "set_module_handlers: the module call is not installed");
        return NULL;
    }
    if ((handlers = PyTuple_Pack(3, args[0], args[1], args[2])) == NULL) return NULL;
    Py_SETREF(H.handlers, handlers);
    Py_RETURN_NONE;
}

static PyObject *m_uninstall(PyObject *self, PyObject *unused) {
    (void)self;
    (void)unused;
    Py_CLEAR(H.config);  /* calls in flight keep their reference; new ones only call the original */
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"install_module_call", (PyCFunction)(void (*)(void))m_install, METH_VARARGS | METH_KEYWORDS,
     "install_module_call(*, module_type, original, inline, state, compiler_globals, scopes, scope_of, tracker, "
     "auto_begin, grad_enabled, report, on_phase, on_fault, failure_hooks, compiled_region)\n--\n\n"
     "Configure the C Module.__call__ and return it (a method descriptor of module_type)."},
    {"set_module_handlers", (PyCFunction)(void (*)(void))m_set_handlers, METH_FASTCALL,
     "set_module_handlers($module, enter, exit, phase, /)\n--\n\nThe handler tuples the module call runs."},
    {"uninstall_module_call", m_uninstall, METH_NOARGS,
     "uninstall_module_call($module, /)\n--\n\nDrop the configuration: the descriptor only calls the original."},
    {NULL, NULL, 0, NULL},
};

int module_call_add_to_module(PyObject *module) {
    s_depth = PyUnicode_InternFromString("depth");
    s_stack = PyUnicode_InternFromString("stack");
    s_flag = PyUnicode_InternFromString("_is_compiling_flag");
    s_in_step = PyUnicode_InternFromString("in_step");
    s_call_impl = PyUnicode_InternFromString("_call_impl");
    s_compiled = PyUnicode_InternFromString("_compiled_call_impl");
    s_snapshot = PyUnicode_InternFromString("snapshot");
    s_call = PyUnicode_InternFromString("call");
    s_kind = PyUnicode_InternFromString("module");
    s_site_enter = PyUnicode_InternFromString("MODULE_ENTER handler");
    s_site_exit = PyUnicode_InternFromString("MODULE_EXIT handler");
    if (!s_depth || !s_stack || !s_flag || !s_in_step || !s_call_impl || !s_compiled || !s_snapshot || !s_call ||
        !s_kind || !s_site_enter || !s_site_exit)
        return -1;
    return PyModule_AddFunctions(module, methods);
}
