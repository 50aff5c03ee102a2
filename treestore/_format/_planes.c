/* Byte planes of chunk objects (SPEC.md section 4): the bytes of fixed-width elements split into
   planes (byte j of every element, one plane after another) and joined back. Each common width
   has its own loop, with the width a constant, which the compiler vectorises; the GIL is
   released while a loop runs. Where this is not built, numpy does the same in codecs.py. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
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

static PyObject *split(PyObject *self, PyObject *args) { return run(args, 0); }
static PyObject *join(PyObject *self, PyObject *args) { return run(args, 1); }

static PyMethodDef methods[] = {
    {"split", split, METH_VARARGS, "split(src, dst, width): the byte planes of src into dst."},
    {"join", join, METH_VARARGS, "join(src, dst, width): byte planes src joined into dst."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_planes", NULL, 0, methods};

PyMODINIT_FUNC PyInit__planes(void) { return PyModule_Create(&module); }
