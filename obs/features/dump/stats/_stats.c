/* Tensor statistics in one pass over a dense CPU buffer, for statistic.csv (tensor_stats.py beside this file), and
 * the text of statistic.csv from the rows statistic_csv.py records (format_rows, at the end of this file).
 *
 * reduce(address, count, dtype_code, zeros) reads `count` elements at `address` (the caller passes
 * a live tensor's data_ptr() whose elements fill [address, address + count * itemsize)) and returns
 * (min, max, sum, sumsq, nan, +inf, -inf, zero, negative zero).
 *
 * Fast path: min, max, and the sum and/or the sum of squares (those the caller's statistics need) in one
 * pass, written as lane loops the compiler vectorizes without -ffast-math (nothing is reassociated: each lane
 * is its own accumulator).
 * Floats are summed per block in the element type (32 lanes, 16 elements each) and the block sums
 * added in double, so sums are at least as exact as torch's cascade sums; float16/bfloat16 are
 * converted to float32 one block at a time.  A finite double sum or sum of squares proves every
 * element finite (a NaN or an Inf reaches either); otherwise, or when a block sum overflowed, an
 * exact pass counts NaN/+Inf/-Inf and takes min/max/sum/sumsq over the finite elements only.
 * Integers: min/max exact in their type; sums are exact in int64 per block while the block's
 * magnitude allows (checked), else summed in double.  Zero counts are a separate pass, only when
 * asked.  The GIL is released while large buffers are read.  No torch headers: codes below.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "_stats_api.h"
#include "ryu/d2d.h"

/* 32 lanes: two AVX-512 (four AVX2) vectors per accumulator, enough independent chains to keep both vector
 * ports busy; 16 lanes left the AVX-512 clone waiting on each add's latency (10.8 against 22.6 elements/ns). */
#ifndef LANES
#define LANES 32
#endif
#ifndef BLOCK
#define BLOCK (16 * LANES) /* elements per block: 16 per lane */
#endif

/* LAST_FIRST: the one-pass kernels and the NaN check's gate read their blocks from the buffer's end to its start (the
 * exact and zero-count passes, which run only when the gate fails or when asked, read front to back).  The buffer is usually an output
 * an op has just written front to back: its end is still in L2, its start already in L3.  Read front to back, each
 * line would evict one the rest of the pass still needs; read back to front, the pass starts in L2 and ends by
 * leaving the buffer's start in L2 for the next op, which reads front to back (measured on a conv's 2 MiB output:
 * the pass and the ReLU that follows cost 26% less of their extra time). */
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 11 && defined(__x86_64__) && defined(__linux__)
/* AVX-512 and AVX2/FMA/F16C clones where the CPU has them (chosen once at load by an ifunc), SSE2 elsewhere. */
#define CLONES __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CLONES
#endif
#define INLINE static inline __attribute__((always_inline))

/* Which sums a pass keeps (min and max always): the sum for avg, the sum of squares for l2norm.  At least one
 * is kept, since a finite sum proves every element finite (the gate in run()); one left out is not to be read. */
enum { NEED_SUM = 1, NEED_SQ = 2, NEED_BOTH = 3 };

typedef struct {
    double mn, mx, sum, sumsq;
    long long nan, pinf, ninf, zero, negzero;
} Stats;

static inline float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }
static inline uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* IEEE half -> float, branch-free (exact for normals, subnormals, Inf and NaN). */
static inline float half_f32(uint16_t h) {
    uint32_t w = (uint32_t)h << 16, sign = w & 0x80000000u, two_w = w + w;
    float normalized = bits_f32((two_w >> 4) + (0xE0u << 23)) * 0x1.0p-112f;
    float denormalized = bits_f32((two_w >> 17) | (126u << 23)) - 0.5f;
    uint32_t small = 0u - (uint32_t)(two_w < (1u << 27)); /* a mask, not a branch: the loop vectorizes */
    uint32_t body = (f32_bits(denormalized) & small) | (f32_bits(normalized) & ~small);
    return bits_f32(sign | body);
}

static inline float bf16_f32(uint16_t h) { return bits_f32((uint32_t)h << 16); }

/* ---- floating point: the fast pass ----------------------------------------------------------- */

/* One block of float32: lane min/max kept across blocks, block sums returned per lane.  NaN never
 * enters min/max here (a comparison with NaN is false): the sums carry it to the gate. */
INLINE void block_f32(const float *x, float *mn, float *mx, double *s, double *ss, int need) {
    float bs[LANES] = {0}, bss[LANES] = {0};
    for (int j = 0; j < BLOCK; j += LANES)
        for (int k = 0; k < LANES; k++) {
            float v = x[j + k];
            mn[k] = v < mn[k] ? v : mn[k];
            mx[k] = v > mx[k] ? v : mx[k];
            if (need & NEED_SUM) bs[k] += v;
            if (need & NEED_SQ) bss[k] += v * v;
        }
    for (int k = 0; k < LANES; k++) {
        s[k] += bs[k];
        ss[k] += bss[k];
    }
}

static inline void tail_d(double v, Stats *r) {
    r->mn = v < r->mn ? v : r->mn;
    r->mx = v > r->mx ? v : r->mx;
    r->sum += v;
    r->sumsq += v * v;
}

static void lanes_done_f(const float *mn, const float *mx, const double *s, const double *ss, Stats *r) {
    for (int k = 0; k < LANES; k++) {
        if (mn[k] < r->mn) r->mn = mn[k];
        if (mx[k] > r->mx) r->mx = mx[k];
        r->sum += s[k];
        r->sumsq += ss[k];
    }
}

#define FLOAT_INIT                                                                       \
    float mn[LANES], mx[LANES];                                                          \
    double s[LANES] = {0}, ss[LANES] = {0};                                              \
    for (int k = 0; k < LANES; k++) { mn[k] = INFINITY; mx[k] = -INFINITY; }             \
    Py_ssize_t i = 0

INLINE void fast_f32(const float *x, Py_ssize_t n, int need, Stats *r) {
    FLOAT_INIT;
    for (i = n / BLOCK * BLOCK; i > 0; i -= BLOCK) block_f32(x + i - BLOCK, mn, mx, s, ss, need); /* LAST_FIRST */
    lanes_done_f(mn, mx, s, ss, r);
    for (i = n / BLOCK * BLOCK; i < n; i++) tail_d(x[i], r);
}

/* Block conversions to float32, kept as separate plain loops so that each vectorizes. */
static inline void convert_half(const uint16_t *x, float *out) {
    for (int j = 0; j < BLOCK; j++) out[j] = half_f32(x[j]);
}

static inline void convert_bf16(const uint16_t *x, float *out) {
    for (int j = 0; j < BLOCK; j++) out[j] = bf16_f32(x[j]);
}

INLINE void fast_half(const uint16_t *x, Py_ssize_t n, int brain, int need, Stats *r) {
    float buf[BLOCK];
    FLOAT_INIT;
    for (i = n / BLOCK * BLOCK; i > 0; i -= BLOCK) { /* LAST_FIRST */
        if (brain) convert_bf16(x + i - BLOCK, buf);
        else convert_half(x + i - BLOCK, buf);
        block_f32(buf, mn, mx, s, ss, need);
    }
    lanes_done_f(mn, mx, s, ss, r);
    for (i = n / BLOCK * BLOCK; i < n; i++) tail_d(brain ? bf16_f32(x[i]) : half_f32(x[i]), r);
}

INLINE void fast_f64(const double *x, Py_ssize_t n, int need, Stats *r) {
    double mn[LANES], mx[LANES], s[LANES] = {0}, ss[LANES] = {0};
    for (int k = 0; k < LANES; k++) { mn[k] = INFINITY; mx[k] = -INFINITY; }
    const Py_ssize_t full = n / BLOCK * BLOCK;
    for (Py_ssize_t i = full - BLOCK; i >= 0; i -= BLOCK) { /* LAST_FIRST */
        double bs[LANES] = {0}, bss[LANES] = {0};
        for (int j = 0; j < BLOCK; j += LANES)
            for (int k = 0; k < LANES; k++) {
                double v = x[i + j + k];
                mn[k] = v < mn[k] ? v : mn[k];
                mx[k] = v > mx[k] ? v : mx[k];
                if (need & NEED_SUM) bs[k] += v;
                if (need & NEED_SQ) bss[k] += v * v;
            }
        for (int k = 0; k < LANES; k++) { s[k] += bs[k]; ss[k] += bss[k]; }
    }
    for (int k = 0; k < LANES; k++) {
        if (mn[k] < r->mn) r->mn = mn[k];
        if (mx[k] > r->mx) r->mx = mx[k];
        r->sum += s[k];
        r->sumsq += ss[k];
    }
    for (Py_ssize_t i = full; i < n; i++) tail_d(x[i], r);
}

/* ---- floating point: the exact pass (only when the gate fails) -------------------------------- */

static inline void exact_one(double v, Stats *r) {
    if (v != v) r->nan++;
    else if (v == INFINITY) r->pinf++;
    else if (v == -INFINITY) r->ninf++;
    else tail_d(v, r);
}

static void exact_float(const void *p, Py_ssize_t n, int code, Stats *r) {
    for (Py_ssize_t i = 0; i < n; i++) {
        double v;
        switch (code) {
        case F32: v = ((const float *)p)[i]; break;
        case F64: v = ((const double *)p)[i]; break;
        case F16: v = half_f32(((const uint16_t *)p)[i]); break;
        default: v = bf16_f32(((const uint16_t *)p)[i]); break;
        }
        exact_one(v, r);
    }
}

/* Elements whose bits other than the top one are zero (+0 and -0; for integers 0 and the most negative
 * value), and those equal to the top bit alone (-0; the most negative integer).  Lane counters per block. */
#define ZEROS(NAME, T, C, MASK, SIGN)                                                                 \
    CLONES static void NAME(const T *x, Py_ssize_t n, Stats *r) {                                    \
        long long z = 0, neg = 0;                                                                    \
        for (Py_ssize_t i = 0; i < n; i += 1 << 15) {                                                \
            Py_ssize_t end = n - i < (1 << 15) ? n - i : (1 << 15);                                  \
            C bz = 0, bn = 0; /* counters as wide as the data (or 16 bits): they vectorize best */   \
            for (Py_ssize_t j = 0; j < end; j++) {                                                   \
                T u = x[i + j];                                                                      \
                bz += (T)(u & (T)(MASK)) == 0;                                                       \
                bn += u == (T)(SIGN);                                                                \
            }                                                                                        \
            z += bz; neg += bn;                                                                      \
        }                                                                                            \
        r->zero = z; r->negzero = neg;                                                               \
    }

ZEROS(zeros_bits64, uint64_t, uint64_t, 0x7fffffffffffffffull, 0x8000000000000000ull)
ZEROS(zeros_bits32, uint32_t, uint32_t, 0x7fffffffu, 0x80000000u)
ZEROS(zeros_bits16, uint16_t, uint16_t, 0x7fffu, 0x8000u)
ZEROS(zeros_bits8, uint8_t, uint16_t, 0x7fu, 0x80u)

/* ---- integers ---------------------------------------------------------------------------------- */

/* Integer reductions vectorize as plain loops (nothing to reassociate).  Per block of 1024: min/max
 * in the type, sums in an integer accumulator, exact while the block's values allow: 8- and 16-bit
 * values always; 32- and 64-bit values when all |v| < 2^26 (squares < 2^52, taken as int32 x int32
 * -> int64), else the block is summed again one by one.  Unsigned accumulators keep the wrap of a
 * discarded block defined.  The sum is exact (128-bit) and rounded once; squares are summed in double. */
#ifdef __SIZEOF_INT128__
typedef __int128 wide_t;
#else
typedef double wide_t;
#endif
#define BLOCK_INT 1024
#define WIDE(v) ((int64_t)(int32_t)(v))
#define NARROW(v) ((int32_t)(v))
#define INT_KERNEL(NAME, T, SQ, ACC, EXACT)                                                          \
    CLONES static void NAME(const T *x, Py_ssize_t n, Stats *r) {                                    \
        T mn = x[0], mx = x[0];                                                                      \
        wide_t total = 0;                                                                            \
        for (Py_ssize_t i = (n - 1) / BLOCK_INT * BLOCK_INT; i >= 0; i -= BLOCK_INT) { /* LAST_FIRST */ \
            Py_ssize_t m = n - i < BLOCK_INT ? n - i : BLOCK_INT;                                    \
            T lo = x[i], hi = x[i];                                                                  \
            ACC s = 0, ss = 0;                                                                       \
            for (Py_ssize_t j = 0; j < m; j++) {                                                     \
                T v = x[i + j];                                                                      \
                lo = v < lo ? v : lo;                                                                \
                hi = v > hi ? v : hi;                                                                \
                s += (ACC)v;                                                                         \
                ss += (ACC)(SQ(v) * SQ(v));                                                          \
            }                                                                                        \
            mn = lo < mn ? lo : mn;                                                                  \
            mx = hi > mx ? hi : mx;                                                                  \
            if (EXACT) {                                                                             \
                total += (int64_t)s;                                                                 \
                r->sumsq += (double)(int64_t)ss;                                                     \
            } else {                                                                                 \
                for (Py_ssize_t j = 0; j < m; j++) {                                                 \
                    double v = (double)x[i + j];                                                     \
                    total += (wide_t)x[i + j];                                                       \
                    r->sumsq += v * v;                                                               \
                }                                                                                    \
            }                                                                                        \
        }                                                                                            \
        r->sum = (double)total;                                                                      \
        r->mn = (double)mn;                                                                          \
        r->mx = (double)mx;                                                                          \
    }

#define SMALL(lo, hi) ((int64_t)(lo) > -(1LL << 26) && (int64_t)(hi) < (1LL << 26))
INT_KERNEL(fast_i64, int64_t, WIDE, uint64_t, SMALL(lo, hi))
INT_KERNEL(fast_i32, int32_t, WIDE, uint64_t, SMALL(lo, hi))
INT_KERNEL(fast_i16, int16_t, NARROW, uint64_t, 1)
INT_KERNEL(fast_i8, int8_t, NARROW, int32_t, 1)
INT_KERNEL(fast_u8, uint8_t, NARROW, int32_t, 1)

/* The NaN/Inf gate: the largest magnitude's bits (sign cleared) reach the exponent's all-ones pattern only
 * for Inf and NaN.  Exact (nothing to overflow), one and + one max per element, in LANES independent
 * accumulators (one accumulator chains every max on the one before: half the speed of the statistics pass). */
#define MAXBITS(NAME, T, MASK)                                                                       \
    CLONES static T NAME(const T *x, Py_ssize_t n) {                                                 \
        T lanes[LANES] = {0}, top = 0;                                                               \
        const Py_ssize_t full = n / LANES * LANES;                                                   \
        for (Py_ssize_t i = full - LANES; i >= 0; i -= LANES) /* LAST_FIRST */                        \
            for (int k = 0; k < LANES; k++) {                                                        \
                T u = x[i + k] & (T)(MASK);                                                          \
                lanes[k] = u > lanes[k] ? u : lanes[k];                                              \
            }                                                                                        \
        for (Py_ssize_t i = full; i < n; i++) {                                                      \
            T u = x[i] & (T)(MASK);                                                                  \
            top = u > top ? u : top;                                                                 \
        }                                                                                            \
        for (int k = 0; k < LANES; k++) top = lanes[k] > top ? lanes[k] : top;                       \
        return top;                                                                                  \
    }

MAXBITS(maxbits64, uint64_t, 0x7fffffffffffffffull)
MAXBITS(maxbits32, uint32_t, 0x7fffffffu)
MAXBITS(maxbits16, uint16_t, 0x7fffu)

static int all_finite(const void *p, Py_ssize_t n, int code) {
    switch (code) {
    case F32: return maxbits32(p, n) < 0x7f800000u;
    case F64: return maxbits64(p, n) < 0x7ff0000000000000ull;
    case F16: return maxbits16(p, n) < 0x7c00u;
    case BF16: return maxbits16(p, n) < 0x7f80u;
    default: return 1; /* integers */
    }
}

static const int ITEMSIZE[] = {4, 8, 2, 2, 8, 4, 2, 1, 1};

/* One clone set per float kernel and choice of sums: `need` is a constant inside each, so a loop keeps only
 * the sums asked for. */
#define FLOAT_KERNELS(NEED, SUFFIX)                                                                   \
    CLONES static void f32_##SUFFIX(const void *p, Py_ssize_t n, Stats *r) { fast_f32(p, n, NEED, r); } \
    CLONES static void f64_##SUFFIX(const void *p, Py_ssize_t n, Stats *r) { fast_f64(p, n, NEED, r); } \
    CLONES static void f16_##SUFFIX(const void *p, Py_ssize_t n, Stats *r) { fast_half(p, n, 0, NEED, r); } \
    CLONES static void bf16_##SUFFIX(const void *p, Py_ssize_t n, Stats *r) { fast_half(p, n, 1, NEED, r); }
FLOAT_KERNELS(NEED_SUM, sum)
FLOAT_KERNELS(NEED_SQ, sq)
FLOAT_KERNELS(NEED_BOTH, both)

typedef void (*float_kernel)(const void *, Py_ssize_t, Stats *);
static const float_kernel FLOAT_KERNEL[4][4] = { /* [code][need] */
    [F32] = {NULL, f32_sum, f32_sq, f32_both},
    [F64] = {NULL, f64_sum, f64_sq, f64_both},
    [F16] = {NULL, f16_sum, f16_sq, f16_both},
    [BF16] = {NULL, bf16_sum, bf16_sq, bf16_both},
};

/* The statistics of n elements at p; `need`: the sums wanted (NEED_*); a sum not wanted is not to be read. */
static void run(const void *p, Py_ssize_t n, int code, int zeros, int need, Stats *r) {
    r->mn = INFINITY; r->mx = -INFINITY;
    r->sum = r->sumsq = 0.0;
    r->nan = r->pinf = r->ninf = r->zero = r->negzero = 0;
    if (n == 0) return;
    switch (code) {
    case F32: case F64: case F16: case BF16: FLOAT_KERNEL[code][need ? need : NEED_SQ](p, n, r); break;
    case I64: fast_i64(p, n, r); break;
    case I32: fast_i32(p, n, r); break;
    case I16: fast_i16(p, n, r); break;
    case I8: fast_i8(p, n, r); break;
    default: fast_u8(p, n, r); break;
    }
    if (code <= BF16 && !(isfinite(r->sum) && isfinite(r->sumsq))) {
        /* A NaN or an Inf, or finite values whose sum or squares overflowed: count exactly. */
        r->mn = INFINITY; r->mx = -INFINITY;
        r->sum = r->sumsq = 0.0;
        exact_float(p, n, code, r);
    }
    if (!zeros) return;
    switch (code) {
    case F32: zeros_bits32(p, n, r); break;
    case F64: zeros_bits64(p, n, r); break;
    case F16: case BF16: zeros_bits16(p, n, r); break;
    case I64: zeros_bits64(p, n, r); break;
    case I32: zeros_bits32(p, n, r); break;
    case I16: zeros_bits16(p, n, r); break;
    default: zeros_bits8(p, n, r); break; /* int8, uint8 and bool: bytes */
    }
    if (code >= I64) { /* integers have no -0: the top bit alone is the most negative value (or 128) */
        r->zero -= r->negzero;
        r->negzero = 0;
    }
}

/* run(), with the GIL released while a buffer of 256 KiB or more is read. */
static void run_unlocked(const void *p, Py_ssize_t n, int code, int zeros, int need, Stats *r) {
    if ((size_t)n * ITEMSIZE[code] >= (1u << 18)) {
        Py_BEGIN_ALLOW_THREADS
        run(p, n, code, zeros, need, r);
        Py_END_ALLOW_THREADS
    } else {
        run(p, n, code, zeros, need, r);
    }
}

/* (address, count, dtype code) of a buffer argument triple; -1 with an exception when one is bad. */
static int buffer_args(const char *fn, PyObject *const *args, void **p, Py_ssize_t *n, long *code) {
    *p = PyLong_AsVoidPtr(args[0]);
    if (*p == NULL && PyErr_Occurred()) return -1;
    *n = PyLong_AsSsize_t(args[1]);
    if (*n == -1 && PyErr_Occurred()) return -1;
    *code = PyLong_AsLong(args[2]);
    if (*code == -1 && PyErr_Occurred()) return -1;
    if (*n < 0 || *code < 0 || *code > U8 || (*p == NULL && *n > 0)) {
        PyErr_Format(PyExc_ValueError, "%s: bad count, dtype code or address", fn);
        return -1;
    }
    return 0;
}

static PyObject *m_reduce(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *p;
    Py_ssize_t n;
    long code;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "reduce(address, count, dtype_code, zeros) takes 4 arguments");
        return NULL;
    }
    if (buffer_args("reduce", args, &p, &n, &code) < 0) return NULL;
    int zeros = PyObject_IsTrue(args[3]);
    if (zeros < 0) return NULL;
    Stats r;
    run_unlocked(p, n, (int)code, zeros, NEED_BOTH, &r);
    return Py_BuildValue("(ddddLLLLL)", r.mn, r.mx, r.sum, r.sumsq, r.nan, r.pinf, r.ninf, r.zero, r.negzero);
}

/* The statistics of `n // repeat` distinct elements repeated `repeat` times, in _NATIVE_ORDER (tensor_stats.py):
 * (max, min, avg, count, l2norm, nan, +inf, -inf, zero, -zero, +zero), picked by `picks` into out.  max, min and
 * avg are None when no element is finite; l2norm is NaN with a NaN, Inf with an Inf.  The one implementation of
 * these values: tensor_stats.py calls it through `values`, the C++ row recorder through the capsule `_C_API`. */
static void stats_compute(const void *p, Py_ssize_t n, int code, int zeros, Py_ssize_t repeat, const int *picks,
                          Py_ssize_t npicks, ObsValue *out) {
    Stats r;
    Py_ssize_t distinct = repeat > 0 ? n / repeat : n;
    int need = 0;
    for (Py_ssize_t i = 0; i < npicks; i++) need |= picks[i] == 2 ? NEED_SUM : picks[i] == 4 ? NEED_SQ : 0;
    run_unlocked(p, distinct, code, zeros, need, &r);
    long long finite = (long long)distinct - r.nan - r.pinf - r.ninf, k = repeat > 0 ? repeat : 1;
    double norm = r.nan ? NAN : (r.pinf || r.ninf) ? INFINITY : sqrt(r.sumsq * (double)k);
    for (Py_ssize_t i = 0; i < npicks; i++) {
        ObsValue *v = &out[i];
        v->kind = OBS_INT;
        v->d = 0.0;
        switch (picks[i]) {
        case 0: v->kind = finite ? OBS_FLOAT : OBS_NONE; v->d = r.mx; break;
        case 1: v->kind = finite ? OBS_FLOAT : OBS_NONE; v->d = r.mn; break;
        case 2: v->kind = finite ? OBS_FLOAT : OBS_NONE; v->d = finite ? r.sum / (double)finite : 0.0; break;
        case 3: v->i = n; break;
        case 4: v->kind = OBS_FLOAT; v->d = norm; break;
        case 5: v->i = r.nan * k; break;
        case 6: v->i = r.pinf * k; break;
        case 7: v->i = r.ninf * k; break;
        case 8: v->i = r.zero * k; break;
        case 9: v->i = r.negzero * k; break;
        case 10: v->i = (r.zero - r.negzero) * k; break;
        default: v->kind = OBS_NONE; break;
        }
    }
}

/* stats_compute's values as a new list of floats, ints and Nones; NULL with an exception. */
static PyObject *stats_values(const void *p, Py_ssize_t n, int code, int zeros, Py_ssize_t repeat,
                              const int *picks, Py_ssize_t npicks) {
    ObsValue values[OBS_STATS_MAX_PICKS];
    stats_compute(p, n, code, zeros, repeat, picks, npicks, values);
    PyObject *out = PyList_New(npicks);
    if (out == NULL) return NULL;
    for (Py_ssize_t i = 0; i < npicks; i++) {
        const ObsValue *v = &values[i];
        PyObject *item = v->kind == OBS_FLOAT ? PyFloat_FromDouble(v->d)
                         : v->kind == OBS_INT ? PyLong_FromLongLong(v->i) : Py_NewRef(Py_None);
        if (item == NULL) {
            Py_DECREF(out);
            return NULL;
        }
        PyList_SET_ITEM(out, i, item);
    }
    return out;
}

static PyObject *m_values(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *p;
    Py_ssize_t n, repeat;
    long code;
    int picks[OBS_STATS_MAX_PICKS];
    if (nargs != 6 || !PyTuple_Check(args[4]) || PyTuple_GET_SIZE(args[4]) > OBS_STATS_MAX_PICKS) {
        PyErr_SetString(PyExc_TypeError,
                        "values(address, count, dtype_code, zeros, picks: tuple of at most 32 ints, repeat)");
        return NULL;
    }
    if (buffer_args("values", args, &p, &n, &code) < 0) return NULL;
    int zeros = PyObject_IsTrue(args[3]);
    repeat = PyLong_AsSsize_t(args[5]);
    if (zeros < 0 || (repeat == -1 && PyErr_Occurred())) return NULL;
    Py_ssize_t npicks = PyTuple_GET_SIZE(args[4]);
    for (Py_ssize_t i = 0; i < npicks; i++) {
        long pick = PyLong_AsLong(PyTuple_GET_ITEM(args[4], i));
        if (pick == -1 && PyErr_Occurred()) return NULL;
        picks[i] = (int)pick;
    }
    if (repeat < 1 || n % repeat) {
        PyErr_Format(PyExc_ValueError, "values: repeat must divide the count (count %zd, repeat %zd)", n, repeat);
        return NULL;
    }
    return stats_values(p, n, (int)code, zeros, repeat, picks, npicks);
}

static PyObject *m_finite(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    void *p;
    Py_ssize_t n;
    long code;
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "finite(address, count, dtype_code) takes 3 arguments");
        return NULL;
    }
    if (buffer_args("finite", args, &p, &n, &code) < 0) return NULL;
    int ok;
    if ((size_t)n * ITEMSIZE[code] >= (1u << 18)) {
        Py_BEGIN_ALLOW_THREADS
        ok = all_finite(p, n, (int)code);
        Py_END_ALLOW_THREADS
    } else {
        ok = all_finite(p, n, (int)code);
    }
    return PyBool_FromLong(ok);
}

/* ---- statistic.csv text ---------------------------------------------------------------------------
 *
 * format_rows(rows, header, whole, dtypes) -> str: the same text as the Python formatter in
 * statistic_csv.py (which stays the reference and the fallback), without an interpreter step per
 * field.  rows: [(op, io, slot, record)], op = (type, name, µs), record = [values, dtype, shape, text or
 * None]; a record's text is computed once and stored back.  whole: per category, whether an integral
 * float prints as an integer for integer tensors.  dtypes: {dtype: (itemsize, name, floating)}. */

typedef struct {
    char *data;
    Py_ssize_t len, cap;
} Buf;

static int buf_grow(Buf *b, Py_ssize_t more) {
    if (b->len + more <= b->cap) return 0;
    Py_ssize_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *data = PyMem_Realloc(b->data, cap);
    if (data == NULL) { PyErr_NoMemory(); return -1; }
    b->data = data; b->cap = cap;
    return 0;
}

static int buf_put(Buf *b, const char *s, Py_ssize_t n) {
    if (buf_grow(b, n) < 0) return -1;
    memcpy(b->data + b->len, s, n);
    b->len += n;
    return 0;
}

/* Decimal digits of v into out (snprintf's "%lld" without its format parsing: statistic.csv writes several per
 * row); the length. */
static int int_text(long long v, char *out) {
    char text[24];
    int n = sizeof text;
    unsigned long long u = v < 0 ? 0ull - (unsigned long long)v : (unsigned long long)v;
    do {
        text[--n] = (char)('0' + u % 10);
        u /= 10;
    } while (u);
    if (v < 0) text[--n] = '-';
    memcpy(out, text + n, sizeof text - n);
    return (int)sizeof text - n;
}

static int buf_int(Buf *b, long long v) {
    char text[24];
    return buf_put(b, text, int_text(v, text));
}

static int buf_str(Buf *b, PyObject *text) { /* a str, as UTF-8 */
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(text, &n);
    return s == NULL ? -1 : buf_put(b, s, n);
}

static int buf_obj(Buf *b, PyObject *value) { /* str(value) */
    PyObject *text = PyObject_Str(value);
    if (text == NULL) return -1;
    int rc = buf_str(b, text);
    Py_DECREF(text);
    return rc;
}

/* repr(d) of a finite, nonzero double into out, as Python writes it: the shortest digits that read back as d (Ryu's
 * d2d, about 40 ns where PyOS_double_to_string takes 400), in fixed notation when 1e-4 <= |d| < 1e16 ("2.0" when
 * whole), else as d.ddde-05 / de+16; the length (at most 25). */
static int repr_text(double d, char *out) {
    const uint64_t bits = double_to_bits(d);
    const uint64_t mantissa = bits & ((1ull << DOUBLE_MANTISSA_BITS) - 1);
    const uint32_t exponent = (uint32_t)(bits >> DOUBLE_MANTISSA_BITS) & ((1u << DOUBLE_EXPONENT_BITS) - 1);
    floating_decimal_64 v;
    if (d2d_small_int(mantissa, exponent, &v)) {
        while (v.mantissa % 10 == 0) { /* an integer's trailing zeros belong to the exponent */
            v.mantissa /= 10;
            v.exponent++;
        }
    } else {
        v = d2d(mantissa, exponent);
    }
    char digits[20];
    int n = 0, len = 0;
    for (uint64_t m = v.mantissa; m; m /= 10) digits[n++] = (char)('0' + m % 10); /* least significant first */
    const int point = n + v.exponent; /* d = 0.DIGITS x 10^point */
    if (bits >> 63) out[len++] = '-';
    if (point <= -4 || point > 16) {
        out[len++] = digits[n - 1];
        if (n > 1) out[len++] = '.';
        for (int i = n - 2; i >= 0; i--) out[len++] = digits[i];
        int e = point - 1;
        out[len++] = 'e';
        out[len++] = e < 0 ? '-' : '+';
        e = e < 0 ? -e : e;
        if (e >= 100) out[len++] = (char)('0' + e / 100);
        out[len++] = (char)('0' + e / 10 % 10);
        out[len++] = (char)('0' + e % 10);
    } else if (point <= 0) {
        out[len++] = '0';
        out[len++] = '.';
        for (int i = 0; i < -point; i++) out[len++] = '0';
        for (int i = n - 1; i >= 0; i--) out[len++] = digits[i];
    } else {
        for (int i = n - 1, k = 0; k < (point > n ? point : n); i--, k++) {
            if (k == point) out[len++] = '.';
            out[len++] = i >= 0 ? digits[i] : '0';
        }
        if (point >= n) {
            out[len++] = '.';
            out[len++] = '0';
        }
    }
    return len;
}

static int put_literal(char *out, const char *text) {
    int n = (int)strlen(text);
    memcpy(out, text, n);
    return n;
}

/* One statistic as statistic.csv writes it (the Python formatter's _number and repr): None as null; an integer
 * tensor's integral max/min as an integer; a float as repr() writes it.  The C++ recorder's values and the Python
 * recorder's both come here (value_text of the capsule, buf_number). */
static int value_text(const ObsValue *v, int whole, char *out) {
    if (v->kind == OBS_NONE) return put_literal(out, "null");
    if (v->kind == OBS_INT) return int_text(v->i, out);
    const double d = v->d;
    if (whole && isfinite(d) && d == floor(d)) { /* 3, not 3.0; str(int(d)) is exact, as %.0f is (<= 310 bytes) */
        if (fabs(d) < 9e18) return int_text((long long)d, out);
        int n = snprintf(out, OBS_STATS_TEXT_MAX, "%.0f", d);
        return n < 0 ? 0 : n < OBS_STATS_TEXT_MAX ? n : OBS_STATS_TEXT_MAX - 1;
    }
    if (isfinite(d) && d != 0.0) return repr_text(d, out);
    if (d == 0.0) return put_literal(out, signbit(d) ? "-0.0" : "0.0");
    return put_literal(out, isnan(d) ? "nan" : d > 0 ? "inf" : "-inf");
}

static int buf_number(Buf *b, PyObject *v, int whole) {
    ObsValue value = {OBS_NONE, 0.0, 0};
    if (PyFloat_CheckExact(v)) {
        value.kind = OBS_FLOAT;
        value.d = PyFloat_AS_DOUBLE(v);
    } else if (PyLong_CheckExact(v)) {
        int overflow;
        value.kind = OBS_INT;
        value.i = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow || (value.i == -1 && PyErr_Occurred())) {
            PyErr_Clear();
            return buf_obj(b, v);
        }
    } else if (v != Py_None) {
        return buf_obj(b, v);
    }
    if (buf_grow(b, OBS_STATS_TEXT_MAX) < 0) return -1;
    b->len += value_text(&value, whole, b->data + b->len);
    return 0;
}

/* A record's text: size, dtype, "(shape)", then its statistics. */
static PyObject *record_text(PyObject *record, PyObject *whole, PyObject *dtypes) {
    if (!PyList_Check(record) || PyList_GET_SIZE(record) != 4) {
        PyErr_SetString(PyExc_TypeError, "format_rows: a record is [values, dtype, shape, text]");
        return NULL;
    }
    PyObject *values = PyList_GET_ITEM(record, 0), *dtype = PyList_GET_ITEM(record, 1);
    PyObject *shape = PyList_GET_ITEM(record, 2);
    PyObject *info = PyDict_GetItemWithError(dtypes, dtype); /* (itemsize, name, floating) */
    if (info == NULL || !PyTuple_Check(shape) || !PyList_Check(values)) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "format_rows: unknown dtype or bad record");
        return NULL;
    }
    long long itemsize = PyLong_AsLongLong(PyTuple_GET_ITEM(info, 0));
    int floating = PyObject_IsTrue(PyTuple_GET_ITEM(info, 2));
    if ((itemsize == -1 || floating < 0) && PyErr_Occurred()) return NULL;
    Buf b = {0};
    long long size = itemsize;
    Py_ssize_t dims = PyTuple_GET_SIZE(shape);
    for (Py_ssize_t i = 0; i < dims; i++) {
        long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i));
        if (d == -1 && PyErr_Occurred()) goto fail;
        size *= d;
    }
    if (buf_int(&b, size) < 0 || buf_put(&b, ",", 1) < 0 || buf_str(&b, PyTuple_GET_ITEM(info, 1)) < 0 ||
        buf_put(&b, ",\"(", 3) < 0)
        goto fail;
    for (Py_ssize_t i = 0; i < dims; i++) {
        if ((i && buf_put(&b, ",", 1) < 0) || buf_int(&b, PyLong_AsLongLong(PyTuple_GET_ITEM(shape, i))) < 0)
            goto fail;
    }
    if (buf_put(&b, ")\"", 2) < 0) goto fail;
    Py_ssize_t count = PyList_GET_SIZE(values);
    for (Py_ssize_t i = 0; i < count; i++) {
        int w = !floating && i < PyList_GET_SIZE(whole) && PyObject_IsTrue(PyList_GET_ITEM(whole, i)) == 1;
        if (buf_put(&b, ",", 1) < 0 || buf_number(&b, PyList_GET_ITEM(values, i), w) < 0) goto fail;
    }
    PyObject *text = PyUnicode_DecodeUTF8(b.data, b.len, "strict");
    PyMem_Free(b.data);
    return text;
fail:
    PyMem_Free(b.data);
    return NULL;
}

/* A row's op prefix: "{type},{name},0,0,{µs}," of op = (type, name, µs). */
static int op_prefix(Buf *b, PyObject *op) {
    if (!PyTuple_Check(op) || PyTuple_GET_SIZE(op) != 3) {
        PyErr_SetString(PyExc_TypeError, "format_rows: an op is (type, name, stamp)");
        return -1;
    }
    if (buf_str(b, PyTuple_GET_ITEM(op, 0)) < 0 || buf_put(b, ",", 1) < 0 || buf_str(b, PyTuple_GET_ITEM(op, 1)) < 0 ||
        buf_put(b, ",0,0,", 5) < 0 || buf_obj(b, PyTuple_GET_ITEM(op, 2)) < 0 || buf_put(b, ",", 1) < 0)
        return -1;
    return 0;
}

/* The rest of a row's line: "{io},{slot},{record's text}\n"; the record keeps its text. */
static int row_rest(Buf *b, PyObject *row, PyObject *whole, PyObject *dtypes) {
    long long slot = PyLong_AsLongLong(PyTuple_GET_ITEM(row, 2));
    if (slot == -1 && PyErr_Occurred()) return -1;
    if (buf_str(b, PyTuple_GET_ITEM(row, 1)) < 0 || buf_put(b, ",", 1) < 0 || buf_int(b, slot) < 0 ||
        buf_put(b, ",", 1) < 0)
        return -1;
    PyObject *record = PyTuple_GET_ITEM(row, 3);
    if (!PyList_Check(record) || PyList_GET_SIZE(record) != 4) {
        PyErr_SetString(PyExc_TypeError, "format_rows: a record is [values, dtype, shape, text]");
        return -1;
    }
    PyObject *text = PyList_GET_ITEM(record, 3);
    if (text == Py_None) {
        text = record_text(record, whole, dtypes);
        if (text == NULL) return -1;
        PyList_SetItem(record, 3, text); /* steals the reference; the record keeps it */
    }
    return buf_str(b, text) < 0 || buf_put(b, "\n", 1) < 0 ? -1 : 0;
}

static int is_row(PyObject *row) {
    if (PyTuple_Check(row) && PyTuple_GET_SIZE(row) == 4) return 1;
    PyErr_SetString(PyExc_TypeError, "format_rows: a row is (op, io, slot, record)");
    return 0;
}

/* row_line of the capsule: one row's whole line. */
static PyObject *row_line(PyObject *row, PyObject *whole, PyObject *dtypes) {
    Buf b = {0};
    PyObject *line = NULL;
    if (is_row(row) && op_prefix(&b, PyTuple_GET_ITEM(row, 0)) == 0 && row_rest(&b, row, whole, dtypes) == 0)
        line = PyUnicode_DecodeUTF8(b.data, b.len, "strict");
    PyMem_Free(b.data);
    return line;
}

static PyObject *m_format_rows(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 4 || !PyList_Check(args[0]) || !PyUnicode_Check(args[1]) || !PyList_Check(args[2]) ||
        !PyDict_Check(args[3])) {
        PyErr_SetString(PyExc_TypeError, "format_rows(rows: list, header: str, whole: list, dtypes: dict)");
        return NULL;
    }
    PyObject *rows = args[0], *whole = args[2], *dtypes = args[3], *last_op = NULL;
    Buf b = {0};
    Py_ssize_t prefix_at = 0, prefix_len = 0;
    if (buf_str(&b, args[1]) < 0 || buf_put(&b, "\n", 1) < 0) goto fail;
    for (Py_ssize_t r = 0; r < PyList_GET_SIZE(rows); r++) {
        PyObject *row = PyList_GET_ITEM(rows, r);
        if (!is_row(row)) goto fail;
        PyObject *op = PyTuple_GET_ITEM(row, 0);
        if (op == last_op) { /* an op's rows follow one another: copy its prefix */
            if (buf_grow(&b, prefix_len) < 0) goto fail;
            memmove(b.data + b.len, b.data + prefix_at, prefix_len);
            b.len += prefix_len;
        } else {
            last_op = op;
            prefix_at = b.len;
            if (op_prefix(&b, op) < 0) goto fail;
            prefix_len = b.len - prefix_at;
        }
        if (row_rest(&b, row, whole, dtypes) < 0) goto fail;
    }
    PyObject *out = PyUnicode_DecodeUTF8(b.data, b.len, "strict");
    PyMem_Free(b.data);
    return out;
fail:
    PyMem_Free(b.data);
    return NULL;
}

static PyMethodDef methods[] = {
    {"reduce", (PyCFunction)(void (*)(void))m_reduce, METH_FASTCALL,
     "reduce(address, count, dtype_code, zeros) -> (min, max, sum, sumsq, nan, +inf, -inf, zero, -zero)"},
    {"values", (PyCFunction)(void (*)(void))m_values, METH_FASTCALL,
     "values(address, count, dtype_code, zeros, picks, repeat) -> the picked statistics (stats._NATIVE_ORDER)"},
    {"finite", (PyCFunction)(void (*)(void))m_finite, METH_FASTCALL,
     "finite(address, count, dtype_code) -> whether no element is NaN or Inf (the NaN check's gate)"},
    {"format_rows", (PyCFunction)(void (*)(void))m_format_rows, METH_FASTCALL,
     "format_rows(rows, header, whole, dtypes) -> statistic.csv's text"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_stats",
                                    "One-pass tensor statistics for the data dump.", -1, methods};

PyMODINIT_FUNC PyInit__stats(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    if (PyModule_AddIntConstant(m, "F32", F32) || PyModule_AddIntConstant(m, "F64", F64) ||
        PyModule_AddIntConstant(m, "F16", F16) || PyModule_AddIntConstant(m, "BF16", BF16) ||
        PyModule_AddIntConstant(m, "I64", I64) || PyModule_AddIntConstant(m, "I32", I32) ||
        PyModule_AddIntConstant(m, "I16", I16) || PyModule_AddIntConstant(m, "I8", I8) ||
        PyModule_AddIntConstant(m, "U8", U8)) {
        Py_DECREF(m);
        return NULL;
    }
    /* For the C++ row recorder (_fast_rows.cpp) and NaN check (../nan/_fast_nan.cpp): no Python call. */
    static ObsStatsApi api = {OBS_STATS_API_VERSION, stats_compute, all_finite, value_text, row_line};
    PyObject *capsule = PyCapsule_New(&api, "obs.features.dump.stats._stats._C_API", NULL);
    if (capsule == NULL || PyModule_AddObject(m, "_C_API", capsule) < 0) {
        Py_XDECREF(capsule);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
