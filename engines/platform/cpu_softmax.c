/* Softmax over the last axis, in place, bit for bit MLX's CPU softmax (float32). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

static const float FLOAT_MIN = -3.40282346638528859812e+38F;

/* MLX's floor(x + 0.5) adds in double, exactly; in float the sum could round up. */
static inline float round_half_up(float x) {
    float whole = floorf(x);
    return (x - whole >= 0.5f) ? whole + 1.0f : whole;
}

static inline float mlx_exp_scalar(float x_init) {
    float x = x_init * 1.442695f;
    float ipart = round_half_up(x);
    float fpart = x - ipart;
    x = 1.535336188319500e-4f;
    x = fmaf(x, fpart, 1.339887440266574e-3f);
    x = fmaf(x, fpart, 9.618437357674640e-3f);
    x = fmaf(x, fpart, 5.550332471162809e-2f);
    x = fmaf(x, fpart, 2.402264791363012e-1f);
    x = fmaf(x, fpart, 6.931472028550421e-1f);
    x = fmaf(x, fpart, 1.000000000000000f);
    if (isnan(x_init)) return x_init;
    if (x_init > 88.0f) return INFINITY;
    if (x_init < -88.0f) return 0.0f;
    int32_t epart = ((int32_t)ipart + 127) << 23;
    float two;
    memcpy(&two, &epart, sizeof two);
    return two * x;
}

/* The rows [first, last) of a (rows x cols) block, and the causal mask if any. */
typedef struct {
    float *data;
    Py_ssize_t cols, first, last;
    Py_ssize_t query_len; /* rows repeat every query_len (one per query token) */
    Py_ssize_t offset;    /* key j is visible to query i when j <= i + offset; <0: no mask */
    int wide;             /* AVX2 and FMA are there */
} Work;

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define HAVE_WIDE 1

__attribute__((target("avx2,fma"))) static inline __m256 mlx_exp8(__m256 x_init) {
    __m256 x = _mm256_mul_ps(x_init, _mm256_set1_ps(1.442695f));
    __m256 whole = _mm256_floor_ps(x);
    __m256 up = _mm256_cmp_ps(_mm256_sub_ps(x, whole), _mm256_set1_ps(0.5f), _CMP_GE_OQ);
    __m256 ipart = _mm256_add_ps(whole, _mm256_and_ps(up, _mm256_set1_ps(1.0f)));
    __m256 fpart = _mm256_sub_ps(x, ipart);
    x = _mm256_set1_ps(1.535336188319500e-4f);
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(1.339887440266574e-3f));
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(9.618437357674640e-3f));
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(5.550332471162809e-2f));
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(2.402264791363012e-1f));
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(6.931472028550421e-1f));
    x = _mm256_fmadd_ps(x, fpart, _mm256_set1_ps(1.000000000000000f));
    __m256i epart = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvttps_epi32(ipart), _mm256_set1_epi32(127)), 23);
    __m256 result = _mm256_mul_ps(_mm256_castsi256_ps(epart), x);
    result = _mm256_blendv_ps(result, x_init, _mm256_cmp_ps(x_init, x_init, _CMP_UNORD_Q));
    result = _mm256_blendv_ps(
        result, _mm256_set1_ps(INFINITY), _mm256_cmp_ps(x_init, _mm256_set1_ps(88.0f), _CMP_GT_OQ));
    result = _mm256_blendv_ps(
        result, _mm256_setzero_ps(), _mm256_cmp_ps(x_init, _mm256_set1_ps(-88.0f), _CMP_LT_OQ));
    return result;
}

/* out[j] = exp(in[j] - max) for j < n, eight at a time; returns how many were done. */
__attribute__((target("avx2,fma"))) static Py_ssize_t exps_wide(float *row, Py_ssize_t n,
                                                                 float max) {
    __m256 m = _mm256_set1_ps(max);
    Py_ssize_t j = 0;
    for (; j + 8 <= n; j += 8)
        _mm256_storeu_ps(row + j, mlx_exp8(_mm256_sub_ps(_mm256_loadu_ps(row + j), m)));
    return j;
}
#else
#define HAVE_WIDE 0
#endif

/* MLX's running maximum: a NaN sticks, and of equal values the earlier is kept. */
static inline float running_max(float value, float max) {
    if (isnan(value)) return value;
    return value > max ? value : max;
}

static void softmax_row(float *row, Py_ssize_t cols, Py_ssize_t visible, int wide) {
    float max = -INFINITY;
    for (Py_ssize_t j = 0; j < visible; j++) max = running_max(row[j], max);
    if (visible < cols) max = running_max(FLOAT_MIN, max); /* MLX's masked score */
    Py_ssize_t j = 0;
#if HAVE_WIDE
    if (wide) j = exps_wide(row, visible, max);
#endif
    for (; j < visible; j++) row[j] = mlx_exp_scalar(row[j] - max);
    /* MLX sums one value at a time, left to right */
    float sum = 0.0f;
    for (j = 0; j < visible; j++) sum += row[j];
    float masked = mlx_exp_scalar(FLOAT_MIN - max);
    if (masked != 0.0f)
        for (j = visible; j < cols; j++) sum += masked;
    float scale = 1.0f / sum;
    for (j = 0; j < visible; j++) row[j] *= scale;
    masked *= scale;
    for (j = visible; j < cols; j++) row[j] = masked;
}

static void *softmax_rows(void *arg) {
    Work *w = (Work *)arg;
    for (Py_ssize_t r = w->first; r < w->last; r++) {
        Py_ssize_t visible = w->cols;
        if (w->offset >= 0) {
            Py_ssize_t limit = r % w->query_len + w->offset + 1;
            if (limit < visible) visible = limit;
        }
        softmax_row(w->data + r * w->cols, w->cols, visible, w->wide);
    }
    return NULL;
}

#define MAX_THREADS 64

static PyObject *softmax(PyObject *self, PyObject *args) {
    Py_buffer view;
    Py_ssize_t cols, query_len, offset;
    int threads;
    if (!PyArg_ParseTuple(args, "w*nnni", &view, &cols, &query_len, &offset, &threads))
        return NULL;
    if (view.itemsize != 4 || cols <= 0 || view.len % (cols * 4) || query_len <= 0 ||
        !PyBuffer_IsContiguous(&view, 'C')) {
        PyBuffer_Release(&view);
        PyErr_SetString(PyExc_ValueError, "softmax: a C-contiguous float32 buffer of whole rows");
        return NULL;
    }
    Py_ssize_t rows = view.len / (cols * 4);
    if (threads < 1) threads = 1;
    if (threads > MAX_THREADS) threads = MAX_THREADS;
    if (threads > rows) threads = (int)(rows ? rows : 1);
    int wide = 0;
#if HAVE_WIDE
    __builtin_cpu_init();
    wide = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
    Work work[MAX_THREADS];
    pthread_t ids[MAX_THREADS];
    int started[MAX_THREADS] = {0};
    Py_BEGIN_ALLOW_THREADS
    for (int t = 0; t < threads; t++) {
        work[t] = (Work){(float *)view.buf, cols, rows * t / threads, rows * (t + 1) / threads,
                         query_len, offset, wide};
        if (t > 0) started[t] = pthread_create(&ids[t], NULL, softmax_rows, &work[t]) == 0;
    }
    softmax_rows(&work[0]);
    for (int t = 1; t < threads; t++) {
        if (started[t])
            pthread_join(ids[t], NULL);
        else
            softmax_rows(&work[t]); /* no thread to be had: do its rows here */
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"softmax", softmax, METH_VARARGS,
     "softmax(buffer, cols, query_len, offset, threads): MLX's float32 CPU softmax over "
     "rows of `cols`, in place; offset >= 0 masks key j from query row i when j > i + offset."},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_softmax", NULL, -1, methods};

PyMODINIT_FUNC PyInit__cpu_softmax(void) { return PyModule_Create(&module); }
