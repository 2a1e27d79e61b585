/* specdec.Int8MatMul, an ONNX Runtime CPU operator: what ONNX Runtime's MatMulNBits computes for 8-bit symmetric
 * weights in blocks of 32 along K with int8 compute (accuracy level 4), Y[..., N] = X[..., K] . W + bias, W[k, n] =
 * scale[b, n] * code[k, n] (b = k / 32, codes -128..127). Each row's activations are quantized per block of 32 to
 * -127..127 by the block's largest magnitude, each block's integer dot product is exact, and the float result sums
 * the blocks in order, out += float(dot) * (scale_w * scale_x), and adds the bias last.
 *
 * Why: a draft head's products are small (a few rows, SmolLM2's GRIFFIN head 12.6M weights a tree level), and
 * MatMulNBits spent 0.64-1.0 ms on one level's 11 products at 4 rows on 2 Intel Xeon vCPUs, weights in the cache:
 * about half of a draft tree's call; this operator 0.42-0.49 ms. Each 16 output columns' codes are laid out as AVX-512
 * VNNI reads them ([ceil(N / 16), K / 4, 16, 4]: four consecutive k of a column in one 32-bit lane) and multiplied
 * into every row of a tile while in a register, one VPDPBUSD per 64 weights and row.
 *
 * VPDPBUSD multiplies unsigned by signed bytes, so activations are stored offset by 128 (1..255) and the offset's
 * share, 128 times each block's column sum of codes, is taken off the block's dot product (corr, precomputed).
 * Where the compiler has no AVX-512 VNNI the same integer and float operations run in scalar C: the same results,
 * slowly (specdec_int8_matmul_vectorized() says which, and the graph rewrite uses the operator only where it is 1).
 * A row's result never depends on the other rows of the call. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#if defined(__AVX512F__) && defined(__AVX512VNNI__)
#include <immintrin.h>
#define VNNI 1
#else
#define VNNI 0
#endif

#define GROUP 16    /* output columns per group: one vector of 16 int32 or float lanes */
#define BLOCK 32    /* k per quantization block */
#define MAX_ROWS 8   /* rows a tile keeps in registers: two integer and a float accumulator each */
#define MAX_CHUNKS 8
#define PREFETCH_BYTES 4096 /* codes requested this far ahead of the products (into L2, like PackedMatMul) */

int specdec_int8_matmul_vectorized(void) { return VNNI; }

/* A row's activations as 128 + round(x / s) per block of 32 (s = the block's largest magnitude / 127, rounded to
 * nearest even like the vector conversion), and each block's s. */
static void quantize_row(const float *x, int64_t K, uint8_t *codes, float *scales) {
  for (int64_t b = 0; b < K / BLOCK; b++) {
    const float *xb = x + b * BLOCK;
#if VNNI
    __m512 lo = _mm512_loadu_ps(xb), hi = _mm512_loadu_ps(xb + 16);
    float top = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi)));
#else
    float top = 0.0f;
    for (int j = 0; j < BLOCK; j++) top = fmaxf(top, fabsf(xb[j]));
#endif
    float inverse = top > 0.0f ? 127.0f / top : 0.0f;
    scales[b] = top / 127.0f;
#if VNNI
    __m512 by = _mm512_set1_ps(inverse);
    __m512i offset = _mm512_set1_epi32(128);
    _mm_storeu_si128((__m128i *)(codes + b * BLOCK),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(lo, by)), offset)));
    _mm_storeu_si128((__m128i *)(codes + b * BLOCK + 16),
                     _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(hi, by)), offset)));
#else
    for (int j = 0; j < BLOCK; j++) codes[b * BLOCK + j] = (uint8_t)(128 + (int)rintf(xb[j] * inverse));
#endif
  }
}

typedef struct {
  const uint8_t *xq;   /* [rows, K] */
  const float *xs;     /* [rows, K / 32] */
  const int8_t *codes; /* [groups, K / 4, 16, 4] */
  const float *ws;     /* [groups, K / 32, 16] */
  const int32_t *corr; /* [groups, K / 32, 16] */
  const float *bias;   /* [N] */
  float *y;
  int64_t rows, K, N, groups;
  size_t chunks;
} Work;

#if VNNI
/* rows x 16 outputs of group g over the whole of K. */
static inline __attribute__((always_inline)) void tile(int rows, const Work *work, int64_t g, int64_t r0) {
  const int64_t K = work->K, blocks = K / BLOCK;
  const int8_t *w = work->codes + g * K * GROUP;
  const float *ws = work->ws + g * blocks * GROUP;
  const int32_t *corr = work->corr + g * blocks * GROUP;
  const uint8_t *xq = work->xq + r0 * K;
  const float *xs = work->xs + r0 * blocks;
  __m512 acc[MAX_ROWS];
  for (int r = 0; r < rows; r++) acc[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; b++) {
    /* two integer sums a row (even and odd steps), so that a few rows still keep enough products in flight */
    __m512i even[MAX_ROWS], odd[MAX_ROWS];
    for (int r = 0; r < rows; r++) even[r] = odd[r] = _mm512_setzero_si512();
    const int8_t *wb = w + b * BLOCK * GROUP;
    for (int s = 0; s < BLOCK / 4; s += 2) {
      _mm_prefetch((const char *)wb + s * 4 * GROUP + PREFETCH_BYTES, _MM_HINT_T1); /* never faults */
      _mm_prefetch((const char *)wb + (s + 1) * 4 * GROUP + PREFETCH_BYTES, _MM_HINT_T1);
      __m512i first = _mm512_loadu_si512(wb + s * 4 * GROUP), second = _mm512_loadu_si512(wb + (s + 1) * 4 * GROUP);
      for (int r = 0; r < rows; r++) {
        int32_t four[2];
        memcpy(four, xq + r * K + b * BLOCK + s * 4, sizeof four);
        even[r] = _mm512_dpbusd_epi32(even[r], _mm512_set1_epi32(four[0]), first);
        odd[r] = _mm512_dpbusd_epi32(odd[r], _mm512_set1_epi32(four[1]), second);
      }
    }
    __m512 scale = _mm512_loadu_ps(ws + b * GROUP);
    __m512i offset = _mm512_loadu_si512(corr + b * GROUP);
    for (int r = 0; r < rows; r++) {
      __m512 exact = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_add_epi32(even[r], odd[r]), offset));
      acc[r] = _mm512_fmadd_ps(exact, _mm512_mul_ps(scale, _mm512_set1_ps(xs[r * blocks + b])), acc[r]);
    }
  }
  int64_t cols = work->N - g * GROUP < GROUP ? work->N - g * GROUP : GROUP;
  __m512 bias = _mm512_maskz_loadu_ps((__mmask16)((1u << cols) - 1), work->bias + g * GROUP);
  for (int r = 0; r < rows; r++) {
    float out[GROUP];
    _mm512_storeu_ps(out, _mm512_add_ps(acc[r], bias));
    memcpy(work->y + (r0 + r) * work->N + g * GROUP, out, (size_t)cols * sizeof(float));
  }
}
#else
static void tile(int rows, const Work *work, int64_t g, int64_t r0) {
  const int64_t K = work->K, blocks = K / BLOCK;
  const int8_t *w = work->codes + g * K * GROUP;
  int64_t cols = work->N - g * GROUP < GROUP ? work->N - g * GROUP : GROUP;
  for (int r = 0; r < rows; r++) {
    const uint8_t *xq = work->xq + (r0 + r) * K;
    for (int64_t c = 0; c < cols; c++) {
      float acc = 0.0f;
      for (int64_t b = 0; b < blocks; b++) {
        int32_t dot = 0;
        for (int64_t k = b * BLOCK; k < (b + 1) * BLOCK; k++)
          dot += (int32_t)xq[k] * w[(k / 4) * GROUP * 4 + c * 4 + k % 4];
        float scale = work->ws[(g * blocks + b) * GROUP + c] * work->xs[(r0 + r) * blocks + b];
        acc = fmaf((float)(dot - work->corr[(g * blocks + b) * GROUP + c]), scale, acc);
      }
      work->y[(r0 + r) * work->N + g * GROUP + c] = acc + work->bias[g * GROUP + c];
    }
  }
}
#endif

/* Every row through one group of columns, in the fewest tiles of at most MAX_ROWS rows, of even sizes. */
static void group(const void *data, int64_t g) {
  const Work *work = data;
  for (int64_t t = 0, r0 = 0; r0 < work->rows; t++) {
    int64_t r1 = tile_start(work->rows, MAX_ROWS, t + 1);
    switch (r1 - r0) {
#define TILE_CASE(n) \
  case n: tile(n, work, g, r0); break;
      TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
      default: tile(MAX_ROWS, work, g, r0); break;
#undef TILE_CASE
    }
    r0 = r1;
  }
}

/* One thread's contiguous share of the groups. */
static void chunk(void *data, size_t i) {
  const Work *work = data;
  each_of_share(work, i, work->chunks, work->groups, group);
}

static void compute(void *kernel_data, OrtKernelContext *context) {
  const ColumnsKernel *kernel = kernel_data;
  const OrtValue *x, *codes, *ws, *corr, *bias;
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 0, &x);
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 1, &codes);
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 2, &ws);
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 3, &corr);
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 4, &bias);
  int64_t xdims[MAX_RANK], cdims[MAX_RANK], sdims[MAX_RANK];
  size_t xrank, crank, srank;
  Work work;
  work.rows = leading_rows(x, xdims, &xrank);
  leading_rows(codes, cdims, &crank);
  leading_rows(ws, sdims, &srank);
  work.K = xdims[xrank - 1];
  work.N = kernel->n;
  work.groups = cdims[0];
  xdims[xrank - 1] = work.N;
  OrtValue *y;
  ((GetOutputFn)API_FN(g_api, API_KernelContext_GetOutput))(context, 0, xdims, xrank, &y);
  work.y = data_of(y);
  /* The graph rewrite writes only consistent nodes (packed_graphs.py); anything else is left unwritten. */
  if (work.rows == 0 || work.N <= 0 || work.K % BLOCK || crank != 4 || cdims[1] * 4 != work.K ||
      cdims[2] != GROUP || cdims[3] != 4 || work.N > work.groups * GROUP || srank != 3 ||
      sdims[1] * BLOCK != work.K)
    return;
  const int64_t blocks = work.K / BLOCK;
  uint8_t *xq = malloc((size_t)(work.rows * work.K));
  float *xs = malloc((size_t)(work.rows * blocks) * sizeof(float));
  if (xq && xs) {
    const float *xf = data_of(x);
    for (int64_t r = 0; r < work.rows; r++) quantize_row(xf + r * work.K, work.K, xq + r * work.K, xs + r * blocks);
    work.xq = xq;
    work.xs = xs;
    work.codes = data_of(codes);
    work.ws = data_of(ws);
    work.corr = data_of(corr);
    work.bias = data_of(bias);
    work.chunks = work.groups < MAX_CHUNKS ? (size_t)work.groups : MAX_CHUNKS;
    parallel_for(context, chunk, work.chunks, &work);
  } else /* no scratch: a loud result, not a silent one */
    for (int64_t i = 0; i < work.rows * work.N; i++) work.y[i] = NAN;
  free(xq);
  free(xs);
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "Int8MatMul"; }
static int input_type(const OrtCustomOp *op, size_t index) {
  (void)op;
  static const int types[] = {TENSOR_FLOAT, TENSOR_INT8, TENSOR_FLOAT, TENSOR_INT32, TENSOR_FLOAT};
  return types[index];
}
static int output_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return TENSOR_FLOAT; }
static size_t five(const OrtCustomOp *op) { (void)op; return 5; }

const OrtCustomOp specdec_int8_matmul = {
    CUSTOM_OP_VERSION, create_columns_kernel, op_name, op_cpu_provider, input_type, five, output_type, op_one_output,
    compute, destroy_kernel, op_required, op_required, op_default_memory,
};
