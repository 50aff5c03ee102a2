/* Byte planes of chunk objects (SPEC.md section 4): the bytes of fixed-width elements split into
   planes (byte j of every element, one plane after another) and joined back. Each common width
   has its own loop, with the width a constant, which the compiler vectorises; the GIL is
   released while a loop runs. Where this is not built, numpy does the same in planes.py.
   Beside them, the finite minimum, maximum and float64 sum of squares of float32 and bfloat16
   elements in one pass (the statistics of SPEC.md section 6.8, used by float_pass.py; numpy's
   passes in treestore/_format/stats.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>

#if defined(_MSC_VER)
#define RESTRICT __restrict
#else
#define RESTRICT restrict
#endif

#define SPLIT(W)                                                                          \
    static void split_##W(const uint8_t *RESTRICT src, uint8_t *RESTRICT dst, Py_ssize_t m) { \
        uint8_t *p[W];                                                                    \
        for (int j = 0; j < W; j++) p[j] = dst + (Py_ssize_t)j * m;                       \
        for (Py_ssize_t i = 0; i < m; i++)                                                \
            for (int j = 0; j < W; j++) p[j][i] = src[i * W + j];                         \
    }

/* Eight-byte elements split faster plane by plane (strided loads the compiler vectorises). */
static void split_8(const uint8_t *RESTRICT src, uint8_t *RESTRICT dst, Py_ssize_t m) {
    for (int j = 0; j < 8; j++) {
        uint8_t *RESTRICT d = dst + (Py_ssize_t)j * m;
        const uint8_t *RESTRICT s = src + j;
        for (Py_ssize_t i = 0; i < m; i++) d[i] = s[i * 8];
    }
}

#define JOIN(W)                                                                           \
    static void join_##W(const uint8_t *RESTRICT src, uint8_t *RESTRICT dst, Py_ssize_t m) {  \
        const uint8_t *p[W];                                                              \
        for (int j = 0; j < W; j++) p[j] = src + (Py_ssize_t)j * m;                       \
        for (Py_ssize_t i = 0; i < m; i++)                                                \
            for (int j = 0; j < W; j++) dst[i * W + j] = p[j][i];                         \
    }

SPLIT(2) SPLIT(4) JOIN(2) JOIN(4) JOIN(8)

static void split_any(const uint8_t *src, uint8_t *dst, Py_ssize_t m, int w) {
    for (int j = 0; j < w; j++)
        for (Py_ssize_t i = 0; i < m; i++) dst[(Py_ssize_t)j * m + i] = src[i * w + j];
}

static void join_any(const uint8_t *src, uint8_t *dst, Py_ssize_t m, int w) {
    for (int j = 0; j < w; j++)
        for (Py_ssize_t i = 0; i < m; i++) dst[i * w + j] = src[(Py_ssize_t)j * m + i];
}

static PyObject *run(PyObject *args, int joining) {
    Py_buffer src, dst;
    int width;
    if (!PyArg_ParseTuple(args, "y*w*i", &src, &dst, &width)) return NULL;
    PyObject *result = NULL;
    if (width < 1 || src.len % width || dst.len < src.len) {
        PyErr_SetString(PyExc_ValueError, "planes: the source must be a whole number of elements "
                                          "and the destination at least as long");
        goto done;
    }
    Py_ssize_t m = src.len / width;
    const uint8_t *s = src.buf;
    uint8_t *d = dst.buf;
    Py_BEGIN_ALLOW_THREADS
    switch (joining * 16 + width) {
        case 2: split_2(s, d, m); break;
        case 4: split_4(s, d, m); break;
        case 8: split_8(s, d, m); break;
        case 18: join_2(s, d, m); break;
        case 20: join_4(s, d, m); break;
        case 24: join_8(s, d, m); break;
        default:
            if (joining) join_any(s, d, m, width);
            else split_any(s, d, m, width);
    }
    Py_END_ALLOW_THREADS
    Py_INCREF(Py_None);
    result = Py_None;
done:
    PyBuffer_Release(&src);
    PyBuffer_Release(&dst);
    return result;
}


/* The smallest and largest element and the sum of the squares, in double, of n float32 elements
   (bfloat16: the top halves of float32s). A NaN or an infinity makes the sum NaN or inf, which
   sends the caller to the path that counts them. On x86-64, SSE2 (every such processor has it):
   four lanes of minima and maxima and eight of sums, added at the end. Elsewhere the module has
   no float_stats (one lane is slower than numpy's passes). */
#if defined(__SSE2__) || defined(_M_X64)
#include <emmintrin.h>
#define SSE2 1

static inline float from_bf16(uint16_t b) {
    union { uint32_t u; float f; } v;
    v.u = (uint32_t)b << 16;
    return v.f;
}

static void stats_tail(const void *p, int bf16, Py_ssize_t i, Py_ssize_t n, float *lo, float *hi,
                       double *sum) {
    for (; i < n; i++) {
        float x = bf16 ? from_bf16(((const uint16_t *)p)[i]) : ((const float *)p)[i];
        *lo = x < *lo ? x : *lo;
        *hi = x > *hi ? x : *hi;
        *sum += (double)x * (double)x;
    }
}

static inline void stats_four(__m128 x, __m128 *lo, __m128 *hi, __m128d *s) {
    *lo = _mm_min_ps(x, *lo); /* x < lo ? x : lo: a NaN x leaves lo (and poisons the sum) */
    *hi = _mm_max_ps(x, *hi);
    __m128d a = _mm_cvtps_pd(x), b = _mm_cvtps_pd(_mm_movehl_ps(x, x));
    s[0] = _mm_add_pd(s[0], _mm_mul_pd(a, a));
    s[1] = _mm_add_pd(s[1], _mm_mul_pd(b, b));
}

static void float_pass(const void *p, int bf16, Py_ssize_t n, float *lo_out, float *hi_out,
                       double *sum_out) {
    float lo = INFINITY, hi = -INFINITY;
    double sum = 0.0;
    Py_ssize_t i = 0;
    __m128 vlo = _mm_set1_ps(INFINITY), vhi = _mm_set1_ps(-INFINITY);
    __m128d s[4] = {_mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd(), _mm_setzero_pd()};
    const __m128i zero = _mm_setzero_si128();
    for (; i + 8 <= n; i += 8) {
        __m128 x0, x1;
        if (bf16) {
            __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)p + i));
            x0 = _mm_castsi128_ps(_mm_unpacklo_epi16(zero, v));
            x1 = _mm_castsi128_ps(_mm_unpackhi_epi16(zero, v));
        } else {
            x0 = _mm_loadu_ps((const float *)p + i);
            x1 = _mm_loadu_ps((const float *)p + i + 4);
        }
        stats_four(x0, &vlo, &vhi, s);
        stats_four(x1, &vlo, &vhi, s + 2);
    }
    float l[4], h[4];
    double t[2];
    _mm_storeu_ps(l, vlo);
    _mm_storeu_ps(h, vhi);
    _mm_storeu_pd(t, _mm_add_pd(_mm_add_pd(s[0], s[1]), _mm_add_pd(s[2], s[3])));
    for (int j = 0; j < 4; j++) {
        lo = l[j] < lo ? l[j] : lo;
        hi = h[j] > hi ? h[j] : hi;
    }
    sum = t[0] + t[1];
    stats_tail(p, bf16, i, n, &lo, &hi, &sum);
    *lo_out = lo, *hi_out = hi, *sum_out = sum;
}

static PyObject *float_stats(PyObject *self, PyObject *args) {
    Py_buffer src;
    int width;
    if (!PyArg_ParseTuple(args, "y*i", &src, &width)) return NULL;
    if ((width != 4 && width != 2) || src.len % width) {
        PyBuffer_Release(&src);
        PyErr_SetString(PyExc_ValueError, "float_stats: float32 (4) or bfloat16 (2) elements only");
        return NULL;
    }
    float lo, hi;
    double sum;
    Py_BEGIN_ALLOW_THREADS
    float_pass(src.buf, width == 2, src.len / width, &lo, &hi, &sum);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&src);
    return Py_BuildValue("ddd", (double)lo, (double)hi, sum);
}
#endif /* SSE2 */

static PyObject *split(PyObject *self, PyObject *args) { return run(args, 0); }
static PyObject *join(PyObject *self, PyObject *args) { return run(args, 1); }

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(src, dst, width): the byte planes of src into dst."},
    {"join", join, METH_VARARGS, "join(src, dst, width): byte planes src joined into dst."},
#ifdef SSE2 /* elsewhere one lane is slower than numpy's passes: the module has no float_stats */
    {"float_stats", float_stats, METH_VARARGS,
     "float_stats(src, width): (min, max, sum of squares) of float32 (4) or bfloat16 (2) elements."},
#endif
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, 0, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
