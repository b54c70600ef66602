/* The monitor's per-parameter norms on the CPU, one call per list of tensors (norms.py beside this file).
 *
 * norms(addresses, counts, codes): the L2 norm of each dense buffer (a live tensor's data_ptr(), numel and dtype
 *   code), as a list of floats: one pass over each, at memory speed.
 * sample(addresses, runs, lengths, spacings, codes, out): copies `runs` runs of `length` contiguous elements, one
 *   every `spacing` elements, of each buffer into the float32 buffer at `out`, one after another, and returns each
 *   sample's norm (a parameter before the step).  Runs rather than single elements spread out: a sample then reads
 *   as few cache lines as it has elements to read, where one element every few lines would read them all.
 * update(addresses, runs, lengths, spacings, codes, out): the norm of each sample's change since sample()
 *   (out - now), the buffer left as it was.
 *
 * Codes as the data dump's statistics pass (_stats_api.h): F32 0, F64 1, F16 2, BF16 3.  Sums of squares are taken
 * per block in float32 lanes (the compiler vectorizes them: each lane is its own accumulator, nothing is
 * reassociated) and the blocks added in double, as torch's cascade sums are at least.  The GIL is released while a
 * call reads 16 MiB or more (a shorter pass keeps it: released, it could go to the worker thread mid-step).  No
 * torch headers: the caller (norms.py) checks dtypes, devices and layouts.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#ifndef LANES
#define LANES 32
#endif
#define BLOCK (16 * LANES)

enum { F32 = 0, F64 = 1, F16 = 2, BF16 = 3 };

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half -> float, branch-free (exact for normals, subnormals, Inf and NaN). */
static inline float half_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t small = 0u - (uint32_t)(two_w < (1u << 27));
    uint32_t body = (f32_bits(denormalized) & small) | (f32_bits(normalized) & ~small);
    return bits_f32(sign | body);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* The sum of squares of n contiguous floats: float lanes per block (a short last block too), double across blocks. */
CLONES static double sumsq_f32(const float *x, Py_ssize_t n) {
    double total[LANES] = {0};
    Py_ssize_t i = 0;
    for (;;) {
        Py_ssize_t m = n - i >= BLOCK ? BLOCK : (n - i) / LANES * LANES;
        if (m == 0) break;
        float acc[LANES] = {0};
        for (Py_ssize_t j = 0; j < m; j += LANES)
            for (int k = 0; k < LANES; k++) acc[k] += x[i + j + k] * x[i + j + k];
        for (int k = 0; k < LANES; k++) total[k] += acc[k];
        i += m;
    }
    double sum = 0.0;
    for (int k = 0; k < LANES; k++) sum += total[k];
    for (; i < n; i++) sum += (double)x[i] * x[i];
    return sum;
}

/* sumsq_f32, redone in double when a float lane overflowed (elements above ~1.8e19: their squares are not float32;
 * torch accumulates these in double): a NaN or an Inf still comes out as one. */
static double sumsq_f32_exact(const float *x, Py_ssize_t n) {
    double sum = sumsq_f32(x, n);
    if (isfinite(sum)) return sum;
    sum = 0.0;
    for (Py_ssize_t i = 0; i < n; i++) sum += (double)x[i] * x[i];
    return sum;
}

CLONES static double sumsq_f64(const double *x, Py_ssize_t n) {
    double acc[LANES] = {0};
    Py_ssize_t full = n / LANES * LANES, i;
    for (i = 0; i < full; i += LANES)
        for (int k = 0; k < LANES; k++) acc[k] += x[i + k] * x[i + k];
    double sum = 0.0;
    for (int k = 0; k < LANES; k++) sum += acc[k];
    for (; i < n; i++) sum += x[i] * x[i];
    return sum;
}

/* Element i of a buffer of `code`, as float. */
static inline float load(const void *p, Py_ssize_t i, int code) {
    switch (code) {
    case F16: return half_f32(((const uint16_t *)p)[i]);
    case BF16: return bf16_f32(((const uint16_t *)p)[i]);
    case F64: return (float)((const double *)p)[i];
    default: return ((const float *)p)[i];
    }
}

/* 16-bit buffers: converted one block at a time, then summed as float32. */
CLONES static double sumsq_16(const uint16_t *x, Py_ssize_t n, int brain) {
    float buf[BLOCK];
    double sum = 0.0;
    for (Py_ssize_t i = 0; i < n; i += BLOCK) {
        Py_ssize_t m = n - i < BLOCK ? n - i : BLOCK;
        if (brain)
            for (Py_ssize_t j = 0; j < m; j++) buf[j] = bf16_f32(x[i + j]);
        else
            for (Py_ssize_t j = 0; j < m; j++) buf[j] = half_f32(x[i + j]);
        sum += sumsq_f32_exact(buf, m);
    }
    return sum;
}

static double sumsq(const void *p, Py_ssize_t n, int code) {
    switch (code) {
    case F64: return sumsq_f64(p, n);
    case F16: return sumsq_16(p, n, 0);
    case BF16: return sumsq_16(p, n, 1);
    default: return sumsq_f32_exact(p, n);
    }
}

/* Copy a sample (runs of len elements, spacing apart) into out (float32) and return its sum of squares. */
static double take(const void *p, Py_ssize_t runs, Py_ssize_t len, Py_ssize_t spacing, int code, float *out) {
    for (Py_ssize_t r = 0; r < runs; r++) {
        float *to = out + r * len;
        Py_ssize_t from = r * spacing;
        switch (code) {
        case F32: memcpy(to, (const float *)p + from, (size_t)len * sizeof(float)); break;
        case F16: for (Py_ssize_t j = 0; j < len; j++) to[j] = half_f32(((const uint16_t *)p)[from + j]); break;
        case BF16: for (Py_ssize_t j = 0; j < len; j++) to[j] = bf16_f32(((const uint16_t *)p)[from + j]); break;
        default: for (Py_ssize_t j = 0; j < len; j++) to[j] = (float)((const double *)p)[from + j]; break;
        }
    }
    return sumsq_f32_exact(out, runs * len);
}

/* The sum of squares of (before - now) over a sample, before in float32. */
static double change(const void *p, Py_ssize_t runs, Py_ssize_t len, Py_ssize_t spacing, int code,
                     const float *before) {
    float buf[BLOCK];
    double sum = 0.0;
    for (Py_ssize_t r = 0; r < runs; r++) {
        for (Py_ssize_t i = 0; i < len; i += BLOCK) {
            Py_ssize_t m = len - i < BLOCK ? len - i : BLOCK, from = r * spacing + i;
            const float *b = before + r * len + i;
            switch (code) {
            case F32: for (Py_ssize_t j = 0; j < m; j++) buf[j] = b[j] - ((const float *)p)[from + j]; break;
            default: for (Py_ssize_t j = 0; j < m; j++) buf[j] = b[j] - load(p, from + j, code); break;
            }
            sum += sumsq_f32_exact(buf, m);
        }
    }
    return sum;
}

/* The arguments of one call, as C arrays. */
typedef struct {
    Py_ssize_t n;
    void **address;
    Py_ssize_t *count, *runs, *spacing; /* count: elements per run (the whole buffer: one run) */
    int *code;
    size_t bytes; /* read in all, to decide on the GIL */
} Args;

static void args_free(Args *a) {
    PyMem_Free(a->address);
    PyMem_Free(a->count);
    PyMem_Free(a->runs);
    PyMem_Free(a->spacing);
    PyMem_Free(a->code);
}

static const int ITEMSIZE[] = {4, 8, 2, 2};

/* Parse (addresses, [runs,] counts, [spacings,] codes): args[0..4] or args[0..2]; -1 with an exception when one is
 * bad. */
static int parse(const char *fn, PyObject *const *args, int sampled, Args *a) {
    memset(a, 0, sizeof(*a));
    enum { NSEQ = 5 };
    PyObject *fast[NSEQ] = {NULL};
    int which[NSEQ] = {0, 1, 2, 3, 4}; /* address, runs, count, spacing, code */
    int nseq = sampled ? 5 : 3;
    int rc = -1;
    if (!sampled) { which[1] = 2; which[2] = 4; }
    PyObject *seq[NSEQ] = {NULL};
    for (int s = 0; s < nseq; s++) {
        fast[s] = PySequence_Fast(args[s], "expected a sequence");
        if (fast[s] == NULL) goto done;
        seq[which[s]] = fast[s];
    }
    a->n = PySequence_Fast_GET_SIZE(fast[0]);
    for (int s = 1; s < nseq; s++) {
        if (PySequence_Fast_GET_SIZE(fast[s]) != a->n) {
            PyErr_Format(PyExc_ValueError, "%s: the sequences differ in length", fn);
            goto done;
        }
    }
    Py_ssize_t n = a->n ? a->n : 1;
    a->address = PyMem_Malloc(n * sizeof(void *));
    a->count = PyMem_Malloc(n * sizeof(Py_ssize_t));
    a->runs = PyMem_Malloc(n * sizeof(Py_ssize_t));
    a->spacing = PyMem_Malloc(n * sizeof(Py_ssize_t));
    a->code = PyMem_Malloc(n * sizeof(int));
    if (!a->address || !a->count || !a->runs || !a->spacing || !a->code) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < a->n; i++) {
        a->address[i] = PyLong_AsVoidPtr(PySequence_Fast_GET_ITEM(seq[0], i));
        a->count[i] = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq[2], i));
        a->runs[i] = sampled ? PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq[1], i)) : 1;
        a->spacing[i] = sampled ? PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(seq[3], i)) : a->count[i];
        long code = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq[4], i));
        if (PyErr_Occurred()) goto done;
        if (code < F32 || code > BF16 || a->count[i] < 0 || a->runs[i] < 0 || a->spacing[i] < a->count[i] ||
            (a->address[i] == NULL && a->count[i] * a->runs[i] > 0)) {
            PyErr_Format(PyExc_ValueError, "%s: bad address, run, count, spacing or dtype code at %zd", fn, i);
            goto done;
        }
        a->code[i] = (int)code;
        a->bytes += (size_t)(a->count[i] * a->runs[i]) * ITEMSIZE[code];
    }
    rc = 0;
done:
    for (int s = 0; s < nseq; s++) Py_XDECREF(fast[s]);
    if (rc < 0) args_free(a);
    return rc;
}

static PyObject *as_list(const double *sums, Py_ssize_t n) {
    PyObject *out = PyList_New(n);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *v = PyFloat_FromDouble(sqrt(sums[i]));
        if (v == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, v);
    }
    return out;
}

enum { NORMS, SAMPLE, UPDATE };

static void compute(int what, const Args *a, float *out, double *sums) {
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < a->n; i++) {
        if (what == NORMS) sums[i] = sumsq(a->address[i], a->count[i], a->code[i]);
        else if (what == SAMPLE) sums[i] = take(a->address[i], a->runs[i], a->count[i], a->spacing[i], a->code[i], out + at);
        else sums[i] = change(a->address[i], a->runs[i], a->count[i], a->spacing[i], a->code[i], out + at);
        at += a->runs[i] * a->count[i];
    }
}

static PyObject *call(int what, const char *fn, PyObject *const *args, Py_ssize_t nargs) {
    Args a;
    int sampled = what != NORMS;
    if (nargs != (sampled ? 6 : 3)) {
        PyErr_Format(PyExc_TypeError, "%s takes %d arguments", fn, sampled ? 6 : 3);
        return NULL;
    }
    if (parse(fn, args, sampled, &a) < 0) return NULL;
    float *out = NULL;
    if (sampled) {
        out = PyLong_AsVoidPtr(args[5]);
        if (out == NULL) {
            if (!PyErr_Occurred()) PyErr_Format(PyExc_ValueError, "%s: the buffer's address is 0", fn);
            args_free(&a);
            return NULL;
        }
    }
    double *sums = PyMem_Malloc((a.n ? a.n : 1) * sizeof(double));
    if (sums == NULL) {
        args_free(&a);
        return PyErr_NoMemory();
    }
    if (a.bytes >= ((size_t)1 << 24)) { /* long passes only: a short one would hand the GIL to the worker mid-step */
        Py_BEGIN_ALLOW_THREADS
        compute(what, &a, out, sums);
        Py_END_ALLOW_THREADS
    } else {
        compute(what, &a, out, sums);
    }
    PyObject *result = as_list(sums, a.n);
    PyMem_Free(sums);
    args_free(&a);
    return result;
}

static PyObject *m_norms(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return call(NORMS, "norms(addresses, counts, codes)", args, nargs);
}

static PyObject *m_sample(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return call(SAMPLE, "sample(addresses, runs, lengths, spacings, codes, out)", args, nargs);
}

static PyObject *m_update(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    return call(UPDATE, "update(addresses, runs, lengths, spacings, codes, out)", args, nargs);
}

static PyMethodDef methods[] = {
    {"norms", (PyCFunction)(void (*)(void))m_norms, METH_FASTCALL,
     "norms(addresses, counts, codes) -> the L2 norm of each dense buffer"},
    {"sample", (PyCFunction)(void (*)(void))m_sample, METH_FASTCALL,
     "sample(addresses, runs, lengths, spacings, codes, out) -> copy samples to out (float32); their norms"},
    {"update", (PyCFunction)(void (*)(void))m_update, METH_FASTCALL,
     "update(addresses, runs, lengths, spacings, codes, out) -> the norm of each sample's change since sample()"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_norms",
                                    "The monitor's per-parameter norms in one pass (CPU).", -1, methods};

PyMODINIT_FUNC PyInit__norms(void) { return PyModule_Create(&module); }
