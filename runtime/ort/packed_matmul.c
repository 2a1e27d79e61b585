/* specdec.PackedMatMul, an ONNX Runtime CPU operator: Y[..., N] = X[..., K] . W, where W is a constant stored as
 * [ceil(N / 32), K, 32] (32 output columns at a time, contiguous over K; the last block zero-padded) and the
 * attribute n gives N.
 *
 * Why: ONNX Runtime's own float MatMul on a 2-core x86 CPU takes about 1.3x as long for the 6 rows a speculative
 * cycle verifies as for the 1 row of a plain step, though the weights, which dominate, are read once either way.
 * Here each block of 32 columns is read from memory once and multiplied into every row while it is in registers,
 * so a few rows cost little more than one. Each output is summed over K in order, in a register of its own, so a
 * row's result is the same bit for bit whichever rows share the call: a token gets the same products alone in a
 * plain step as inside a verified tree. */
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define COLS 32     /* output columns of a block: two vectors of 16 floats */
/* Rows a tile keeps in registers: 28 accumulators, the block's two weight vectors beside them, of AVX-512's 32. Each
 * tile is one pass over a block, and only the first pass streams it from memory: a second one is arithmetic the
 * cores do with nothing in flight, so rows are split into as few tiles as fit, of even sizes (16 rows: 8 + 8, not
 * 14 + 2). Measured with tiles of at most 8 (every SmolLM2 product once, 2 Intel Xeon vCPUs, interleaved medians):
 * 10 rows 32.4 ms as 8 + 2, 28.0 in one pass; 12 rows 33.3 as 8 + 4, 28.8 in one; 8 rows 26.2, 1 row 21.2 (the
 * wider trees of a speculative cycle, 9-13 tokens, are these). */
#define MAX_ROWS 14
#define MAX_CHUNKS 8
/* Weights are requested this far ahead of the product (16 KB): with several rows the cores are busy multiplying,
 * and without the request a block waits on memory (measured on the 2-core AMD EPYC, SmolLM2's LM head on one
 * thread: 6 rows took 3.15 ms without it, 2.33 ms with it, against 2.26 ms for one row). The request brings the
 * line to L2, not L1 (PREFETCH_LOCALITY 2: prefetcht1): a request to L1 holds one of the core's few L1 fill
 * buffers until the line arrives, which caps the lines in flight below what the memory can deliver (2-core Intel
 * Xeon, every SmolLM2 product once, interleaved medians: 8 rows 20.0 -> 18.7 ms, 1 row 16.3 ms either way). A second
 * request, 4 KB ahead, moves it on from L2 to L1 (prefetcht0), so the products' own loads hit L1 (the same
 * benchmark, two runs: 8 rows 17.7 -> 16.5 and 18.3 -> 16.9 ms, 1 row 15.5 -> 15.3 and 15.9 -> 15.5). */
#define PREFETCH_STEPS 128
#define PREFETCH_LOCALITY 2
#define NEAR_STEPS 32
typedef float v16 __attribute__((vector_size(64)));

/* rows x 32 outputs over the whole of K. */
static inline __attribute__((always_inline)) void tile(int rows, int64_t K, const float *x, const float *w, float *y,
                                                       int64_t ldy, int64_t cols) {
  v16 lo[MAX_ROWS], hi[MAX_ROWS];
  for (int r = 0; r < rows; r++) lo[r] = hi[r] = (v16){0};
  for (int64_t k = 0; k < K; k++) {
    v16 w0, w1;
    /* past the end: harmless, a prefetch never faults */
    __builtin_prefetch(w + (k + PREFETCH_STEPS) * COLS, 0, PREFETCH_LOCALITY);
    __builtin_prefetch(w + (k + PREFETCH_STEPS) * COLS + 16, 0, PREFETCH_LOCALITY);
    __builtin_prefetch(w + (k + NEAR_STEPS) * COLS, 0, 3);
    __builtin_prefetch(w + (k + NEAR_STEPS) * COLS + 16, 0, 3);
    memcpy(&w0, w + k * COLS, sizeof w0);
    memcpy(&w1, w + k * COLS + 16, sizeof w1);
    for (int r = 0; r < rows; r++) {
      float xv = x[r * K + k];
      lo[r] += xv * w0;
      hi[r] += xv * w1;
    }
  }
  for (int r = 0; r < rows; r++) {
    float out[COLS];
    memcpy(out, &lo[r], sizeof lo[r]);
    memcpy(out + 16, &hi[r], sizeof hi[r]);
    memcpy(y + r * ldy, out, (size_t)cols * sizeof(float));
  }
}

typedef struct {
  const float *x, *w;
  float *y;
  int64_t rows, K, N, blocks;
  size_t chunks;
} Work;

/* Every row through one block of columns, in the fewest tiles of at most MAX_ROWS rows, their sizes within one of
 * each other (a constant count each, so the tile stays in registers). */
static void block(const void *data, int64_t b) {
  const Work *work = data;
  const float *w = work->w + b * work->K * COLS;
  int64_t cols = work->N - b * COLS < COLS ? work->N - b * COLS : COLS;
  for (int64_t t = 0, r0 = 0; r0 < work->rows; t++) {
    int64_t r1 = tile_start(work->rows, MAX_ROWS, t + 1);
    const float *x = work->x + r0 * work->K;
    float *y = work->y + r0 * work->N + b * COLS;
    switch (r1 - r0) {
#define TILE_CASE(n) \
  case n: tile(n, work->K, x, w, y, work->N, cols); break;
      TILE_CASE(1) TILE_CASE(2) TILE_CASE(3) TILE_CASE(4) TILE_CASE(5) TILE_CASE(6) TILE_CASE(7)
      TILE_CASE(8) TILE_CASE(9) TILE_CASE(10) TILE_CASE(11) TILE_CASE(12) TILE_CASE(13)
      default: tile(MAX_ROWS, work->K, x, w, y, work->N, cols); break;
#undef TILE_CASE
    }
    r0 = r1;
  }
}

/* One thread's contiguous share of the column blocks. */
static void chunk(void *data, size_t i) {
  const Work *work = data;
  each_of_share(work, i, work->chunks, work->blocks, block);
}

static void compute(void *kernel_data, OrtKernelContext *context) {
  const ColumnsKernel *kernel = kernel_data;
  const OrtValue *x, *w;
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 0, &x);
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, 1, &w);
  int64_t xdims[MAX_RANK], wdims[MAX_RANK];
  size_t xrank, wrank;
  Work work;
  work.rows = leading_rows(x, xdims, &xrank);
  leading_rows(w, wdims, &wrank);
  work.K = xdims[xrank - 1];
  work.N = kernel->n;
  work.blocks = wdims[0];
  xdims[xrank - 1] = work.N;
  OrtValue *y;
  ((GetOutputFn)API_FN(g_api, API_KernelContext_GetOutput))(context, 0, xdims, xrank, &y);
  work.x = data_of(x);
  work.w = data_of(w);
  work.y = data_of(y);
  /* The graph rewrite writes only consistent nodes (packed_graphs.py); anything else is left unwritten. */
  if (work.rows == 0 || work.N <= 0 || wrank != 3 || wdims[1] != work.K || wdims[2] != COLS ||
      work.N > work.blocks * COLS)
    return;
  work.chunks = work.blocks < MAX_CHUNKS ? (size_t)work.blocks : MAX_CHUNKS;
  parallel_for(context, chunk, work.chunks, &work);
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "PackedMatMul"; }
static int float_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return TENSOR_FLOAT; }
static size_t two(const OrtCustomOp *op) { (void)op; return 2; }

const OrtCustomOp specdec_packed_matmul = {
    CUSTOM_OP_VERSION, create_columns_kernel, op_name, op_cpu_provider, float_type, two, float_type, op_one_output,
    compute, destroy_kernel, op_required, op_required, op_default_memory,
};

