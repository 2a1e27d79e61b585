/* specdec.TreeAttention, an ONNX Runtime CPU operator: ONNX's Attention (opset 23/24) for what the target step asks
 * of it, Y = softmax(Q K^T * scale, masked) V, with Q [B, Hq, N, D], K [B, Hkv, L, D], V [B, Hkv, L, Dv] (grouped-query
 * heads: query head h reads key/value head h / (Hq / Hkv)), a boolean mask broadcast to [B, Hq, N, L] (true: the
 * position takes part) and Y [B, Hq, N, Dv]; the attribute scale, where nonzero, replaces 1 / sqrt(D).
 *
 * Why: ONNX Runtime's own CPU Attention spends far more than reading the cache costs at long contexts (SmolLM2-135M on
 * 2 Intel Xeon vCPUs: its one-token step 12.1 ms longer at 2,048 tokens of context than at 512, where the keys and
 * values grow by 71 MB, under 4 ms to read; 7.5 ms longer with this operator), so long prompts made both plain
 * decoding and verification slow. Here each key/value head's positions are read once per query head, masked
 * positions are never read, and a position's score is one dot product.
 *
 * Each query row is computed alone, in an order fixed by position (its scores, their maximum, the exponentials summed
 * lane by lane from position 0, the values summed in position order), so a row's result is the same bit for bit
 * whichever rows share the call and however many masked slots follow: a token gets the same attention alone in a
 * plain step as inside a verified tree. A row that may see no position gets zeros. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define LANES 16
#define ROW_CHUNK 64 /* query rows scored together */
typedef float v16 __attribute__((vector_size(64)));
typedef int32_t vi16 __attribute__((vector_size(64)));
typedef uint8_t vb16 __attribute__((vector_size(16)));

/* Lanes chosen by constant indices, from one vector or from two (indices 16-31 the second's): GCC's and Clang's
 * spellings. */
#ifdef __clang__
#define PICK(x, ...) __builtin_shufflevector(x, x, __VA_ARGS__)
#define PICK2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define PICK(x, ...) __builtin_shuffle(x, (vi16){__VA_ARGS__})
#define PICK2(a, b, ...) __builtin_shuffle(a, b, (vi16){__VA_ARGS__})
#endif

static inline v16 splat(float x) { return (v16){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

static inline v16 load(const float *p) {
  v16 x;
  memcpy(&x, p, sizeof x);
  return x;
}

/* The sum of a vector's lanes, always in the same order. */
static inline float lane_sum(v16 x) {
  x += PICK(x, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  x += PICK(x, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  x += PICK(x, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  x += PICK(x, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return x[0];
}

/* A generic head size's score (not a multiple of 16): one dot product, lanes then the rest. */
static inline float dot(const float *a, const float *b, int64_t d) {
  v16 acc = splat(0.0f);
  int64_t i = 0;
  for (; i + LANES <= d; i += LANES) acc += load(a + i) * load(b + i);
  float sum = lane_sum(acc);
  for (; i < d; i++) sum += a[i] * b[i];
  return sum;
}

/* Sixteen vectors of partial sums -> one vector of their sixteen sums, in order: each level adds the lanes of two
 * vectors chosen so that it halves the lanes a position holds (8, 4, 2, 1) and doubles the positions a vector holds. */
static inline v16 sums_of(const v16 *part) {
  v16 eight[8], four[4], two[2];
  for (int i = 0; i < 8; i++) {
    v16 a = part[2 * i], b = part[2 * i + 1];
    eight[i] = PICK2(a, b, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
               PICK2(a, b, 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  }
  for (int i = 0; i < 4; i++) {
    v16 a = eight[2 * i], b = eight[2 * i + 1];
    four[i] = PICK2(a, b, 0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19, 24, 25, 26, 27) +
              PICK2(a, b, 4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23, 28, 29, 30, 31);
  }
  for (int i = 0; i < 2; i++) {
    v16 a = four[2 * i], b = four[2 * i + 1];
    two[i] = PICK2(a, b, 0, 1, 4, 5, 8, 9, 12, 13, 16, 17, 20, 21, 24, 25, 28, 29) +
             PICK2(a, b, 2, 3, 6, 7, 10, 11, 14, 15, 18, 19, 22, 23, 26, 27, 30, 31);
  }
  return PICK2(two[0], two[1], 0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30) +
         PICK2(two[0], two[1], 1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
}

/* The scores of one query row against 16 consecutive keys (head size d, a multiple of 16). */
static inline __attribute__((always_inline)) v16 block_scores(const float *q, const float *keys, int64_t d) {
  v16 part[LANES];
  for (int j = 0; j < LANES; j++) {
    v16 acc = splat(0.0f);
    for (int64_t i = 0; i < d; i += LANES) acc += load(q + i) * load(keys + j * d + i);
    part[j] = acc;
  }
  return sums_of(part);
}

/* ``block_scores`` for a head size of 64, the query's four vectors held in registers. */
static inline __attribute__((always_inline)) v16 block_scores64(v16 q0, v16 q1, v16 q2, v16 q3, const float *keys) {
  v16 part[LANES];
  for (int j = 0; j < LANES; j++) {
    const float *key = keys + j * 64;
    v16 acc = q0 * load(key);
    acc += q1 * load(key + 16);
    acc += q2 * load(key + 32);
    acc += q3 * load(key + 48);
    part[j] = acc;
  }
  return sums_of(part);
}

/* exp(x) for x <= 0 (a score minus its row's maximum), within about an ulp; 0 below -87 and for -inf. Range
 * reduction to r = x - n ln 2 with |r| <= ln 2 / 2, a degree-6 Taylor polynomial, and 2^n built in the exponent. */
static inline v16 exp_nonpositive(v16 x) {
  const v16 low = splat(-87.0f);
  vi16 kept = x > low;
  x = (v16)(((vi16)x & kept) | ((vi16)low & ~kept));
  vi16 n = __builtin_convertvector(x * splat(1.44269504088896341f) - splat(0.5f), vi16); /* nearest, x <= 0 */
  v16 nf = __builtin_convertvector(n, v16);
  v16 r = x - nf * splat(0.693359375f) - nf * splat(-2.12194440e-4f);
  v16 p = splat(1.0f / 720);
  p = p * r + splat(1.0f / 120);
  p = p * r + splat(1.0f / 24);
  p = p * r + splat(1.0f / 6);
  p = p * r + splat(0.5f);
  p = p * r + splat(1.0f);
  p = p * r + splat(1.0f);
  v16 two_n = (v16)((n + 127) << 23);
  return (v16)((vi16)(p * two_n) & kept);
}

typedef struct {
  const float *q, *k, *v;
  const uint8_t *mask;
  float *y;
  int64_t heads, kv_heads, rows, length, dim, vdim;
  int64_t mask_stride[4]; /* elements between neighbours along B, Hq, N, L (0 where the mask is broadcast) */
  float scale;
} Work;

/* Each row's scores over the head's positions, -inf where masked (``scores``: rows x padded, padded a multiple of
 * 16 whose last slots are -inf): blocks of 16 positions where the head size is a multiple of 16 (a tail block read
 * from a zero-padded copy, so a position's score never depends on where the keys end), else one dot product each. */
static void head_scores(const Work *a, int64_t rows, const float *q, const float *k, const uint8_t *mask,
                        float *scores, int64_t padded) {
  int64_t L = a->length, D = a->dim;
  int64_t row_step = a->mask_stride[2], position_step = a->mask_stride[3];
  for (int64_t i = 0; i < rows * padded; i++) scores[i] = -INFINITY;
  if (D % LANES) {
    for (int64_t l = 0; l < L; l++)
      for (int64_t n = 0; n < rows; n++)
        if (mask[n * row_step + l * position_step]) scores[n * padded + l] = dot(q + n * D, k + l * D, D) * a->scale;
    return;
  }
  float *tail = NULL;
  for (int64_t l0 = 0; l0 < L; l0 += LANES) {
    const float *keys = k + l0 * D;
    int64_t count = L - l0 < LANES ? L - l0 : LANES;
    if (count < LANES) {
      tail = calloc((size_t)(LANES * D), sizeof(float));
      if (!tail) return; /* every score stays -inf: the rows see nothing */
      memcpy(tail, keys, (size_t)(count * D) * sizeof(float));
      keys = tail;
    }
    for (int64_t n = 0; n < rows; n++) {
      vi16 keep;
      const uint8_t *seen = mask + n * row_step + l0 * position_step;
      if (position_step == 1 && count == LANES) { /* 16 mask bytes at once */
        uint64_t halves[2];
        memcpy(halves, seen, sizeof halves);
        if (!(halves[0] | halves[1])) continue;
        vb16 bytes;
        memcpy(&bytes, seen, sizeof bytes);
        keep = __builtin_convertvector(bytes, vi16) != 0;
      } else {
        int32_t each[LANES] = {0};
        int any = 0;
        for (int64_t j = 0; j < count; j++) any |= each[j] = -(seen[j * position_step] != 0);
        if (!any) continue;
        memcpy(&keep, each, sizeof keep);
      }
      const float *query = q + n * D;
      v16 s = D == 64 ? block_scores64(load(query), load(query + 16), load(query + 32), load(query + 48), keys)
                      : block_scores(query, keys, D);
      s = (v16)(((vi16)(s * splat(a->scale)) & keep) | ((vi16)splat(-INFINITY) & ~keep));
      memcpy(scores + n * padded + l0, &s, sizeof s);
    }
  }
  free(tail);
}

/* Each row's scores -> its weights exp(score - max) in place; ``inverse`` gets 1 / their sum (0 for a row that
 * sees nothing, whose weights are all 0). */
static void head_weights(int64_t rows, int64_t padded, float *scores, float *inverse) {
  for (int64_t n = 0; n < rows; n++) {
    float *row = scores + n * padded;
    v16 most = splat(-INFINITY);
    for (int64_t l = 0; l < padded; l += LANES) {
      v16 x = load(row + l);
      most = (v16)(((vi16)x & (x > most)) | ((vi16)most & ~(x > most)));
    }
    float top = -INFINITY; /* exact whatever the order */
    for (int j = 0; j < LANES; j++) top = most[j] > top ? most[j] : top;
    v16 total = splat(0.0f), shift = splat(top == -INFINITY ? 0.0f : top);
    for (int64_t l = 0; l < padded; l += LANES) {
      v16 p = exp_nonpositive(load(row + l) - shift);
      memcpy(row + l, &p, sizeof p);
      total += p;
    }
    float sum = lane_sum(total);
    inverse[n] = sum > 0.0f ? 1.0f / sum : 0.0f;
  }
}

/* ``rows`` (1-4) rows' outputs for a value size of 64: the values weighted in position order, each value read once
 * for the tile; a position every row gives weight 0 is skipped (masked slots are never read). */
static inline __attribute__((always_inline)) void values_tile64(int rows, const float *weights, int64_t padded,
                                                                const float *v, int64_t L, const float *inverse,
                                                                float *y) {
  v16 acc[4][4];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = splat(0.0f);
  for (int64_t l = 0; l < L; l++) {
    float p[4];
    int any = 0;
    for (int r = 0; r < rows; r++) any |= (p[r] = weights[r * padded + l]) != 0.0f;
    if (!any) continue;
    const float *value = v + l * 64;
    v16 v0 = load(value), v1 = load(value + 16), v2 = load(value + 32), v3 = load(value + 48);
    for (int r = 0; r < rows; r++) {
      v16 w = splat(p[r]);
      acc[r][0] += w * v0;
      acc[r][1] += w * v1;
      acc[r][2] += w * v2;
      acc[r][3] += w * v3;
    }
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 4; c++) {
      v16 out = acc[r][c] * splat(inverse[r]);
      memcpy(y + r * 64 + c * 16, &out, sizeof out);
    }
}

/* Each row's output: its weights times the values, in position order, times its ``inverse``. */
static void head_values(const Work *a, int64_t rows, const float *weights, int64_t padded, const float *v,
                        const float *inverse, float *y) {
  int64_t L = a->length, Dv = a->vdim;
  if (Dv == 64) {
    for (int64_t n0 = 0; n0 < rows; n0 += 4) {
      const float *w = weights + n0 * padded;
      float *out = y + n0 * 64;
      switch (rows - n0 < 4 ? rows - n0 : 4) {
        case 1: values_tile64(1, w, padded, v, L, inverse + n0, out); break;
        case 2: values_tile64(2, w, padded, v, L, inverse + n0, out); break;
        case 3: values_tile64(3, w, padded, v, L, inverse + n0, out); break;
        default: values_tile64(4, w, padded, v, L, inverse + n0, out); break;
      }
    }
    return;
  }
  for (int64_t n = 0; n < rows; n++) {
    float *out = y + n * Dv;
    memset(out, 0, (size_t)Dv * sizeof(float));
    for (int64_t l = 0; l < L; l++) {
      float p = weights[n * padded + l];
      if (p == 0.0f) continue;
      for (int64_t d = 0; d < Dv; d++) out[d] += p * v[l * Dv + d];
    }
    for (int64_t d = 0; d < Dv; d++) out[d] *= inverse[n];
  }
}

/* One query head of one sequence: its N rows over the L positions of its key/value head, ``ROW_CHUNK`` rows at a time
 * (a long prompt's scores would otherwise take N x L floats at once). */
static void head(void *data, size_t index) {
  const Work *a = data;
  int64_t b = (int64_t)index / a->heads, h = (int64_t)index % a->heads, g = h / (a->heads / a->kv_heads);
  int64_t L = a->length, D = a->dim, Dv = a->vdim;
  int64_t padded = (L + LANES - 1) / LANES * LANES, chunk = a->rows < ROW_CHUNK ? a->rows : ROW_CHUNK;
  const float *q = a->q + (b * a->heads + h) * a->rows * D;
  const float *k = a->k + (b * a->kv_heads + g) * L * D, *v = a->v + (b * a->kv_heads + g) * L * Dv;
  const uint8_t *mask = a->mask + b * a->mask_stride[0] + h * a->mask_stride[1];
  float *y = a->y + (b * a->heads + h) * a->rows * Dv;
  float *scores = malloc((size_t)(chunk * padded + chunk) * sizeof(float));
  if (!scores) {
    for (int64_t i = 0; i < a->rows * Dv; i++) y[i] = NAN;
    return;
  }
  float *inverse = scores + chunk * padded;
  for (int64_t n0 = 0; n0 < a->rows; n0 += chunk) {
    int64_t rows = a->rows - n0 < chunk ? a->rows - n0 : chunk;
    head_scores(a, rows, q + n0 * D, k, mask + n0 * a->mask_stride[2], scores, padded);
    head_weights(rows, padded, scores, inverse);
    head_values(a, rows, scores, padded, v, inverse, y + n0 * Dv);
  }
  free(scores);
}

typedef struct {
  float scale;
} Kernel;

static void *create_kernel(const OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
  (void)op;
  Kernel *kernel = calloc(1, sizeof *kernel);
  if (kernel && ((GetAttributeFloatFn)API_FN(api, API_KernelInfoGetAttribute_float))(info, "scale", &kernel->scale))
    kernel->scale = 0.0f; /* absent: 1 / sqrt(D) */
  return kernel;
}

static const OrtValue *input(OrtKernelContext *context, size_t index, int64_t *dims, size_t *rank) {
  const OrtValue *value;
  ((GetInputFn)API_FN(g_api, API_KernelContext_GetInput))(context, index, &value);
  leading_rows(value, dims, rank);
  return value;
}

/* The mask's strides over [B, Hq, N, L], its dimensions aligned to the right and broadcast where 1; 0 if they do
 * not broadcast to ``want``. */
static int mask_strides(const int64_t *dims, size_t rank, const int64_t *want, int64_t *strides) {
  if (rank < 1 || rank > 4) return 0;
  int64_t step = 1;
  for (int axis = 3; axis >= 0; axis--) {
    int64_t mine = axis - (4 - (int)rank) >= 0 ? dims[axis - (4 - (int)rank)] : 1;
    if (mine != 1 && mine != want[axis]) return 0;
    strides[axis] = mine == 1 ? 0 : step;
    step *= mine;
  }
  return 1;
}

static void compute(void *kernel_data, OrtKernelContext *context) {
  const Kernel *kernel = kernel_data;
  int64_t qd[MAX_RANK], kd[MAX_RANK], vd[MAX_RANK], md[MAX_RANK];
  size_t qr, kr, vr, mr;
  const OrtValue *q = input(context, 0, qd, &qr), *k = input(context, 1, kd, &kr);
  const OrtValue *v = input(context, 2, vd, &vr), *m = input(context, 3, md, &mr);
  Work work = {0};
  int ok = qr == 4 && kr == 4 && vr == 4 && kd[0] == qd[0] && vd[0] == qd[0] && kd[1] == vd[1] && kd[1] > 0 &&
           qd[1] % kd[1] == 0 && kd[3] == qd[3] && vd[2] == kd[2];
  int64_t ydims[4] = {qd[0], qr > 1 ? qd[1] : 1, qr > 2 ? qd[2] : 1, vr == 4 ? vd[3] : (qr == 4 ? qd[3] : 1)};
  if (ok) {
    int64_t want[4] = {qd[0], qd[1], qd[2], kd[2]};
    ok = mask_strides(md, mr, want, work.mask_stride);
  }
  OrtValue *y;
  ((GetOutputFn)API_FN(g_api, API_KernelContext_GetOutput))(context, 0, ydims, 4, &y);
  float *out = data_of(y);
  int64_t count = ydims[0] * ydims[1] * ydims[2] * ydims[3];
  if (!ok) { /* shapes the graph rewrite never writes: a loud result, not a silent one */
    for (int64_t i = 0; i < count; i++) out[i] = NAN;
    return;
  }
  if (count == 0) return;
  work.q = data_of(q);
  work.k = data_of(k);
  work.v = data_of(v);
  work.mask = data_of(m);
  work.y = out;
  work.heads = qd[1];
  work.kv_heads = kd[1];
  work.rows = qd[2];
  work.length = kd[2];
  work.dim = qd[3];
  work.vdim = vd[3];
  work.scale = kernel->scale != 0.0f ? kernel->scale : 1.0f / sqrtf((float)qd[3]);
  size_t units = (size_t)(qd[0] * qd[1]);
  if (g_parallel && units > 1)
    ((ParallelForFn)API_FN(g_api, API_KernelContext_ParallelFor))(context, head, units, 0, &work);
  else
    for (size_t i = 0; i < units; i++) head(&work, i);
}

static void destroy_kernel(void *kernel) { free(kernel); }
static const char *op_name(const OrtCustomOp *op) { (void)op; return "TreeAttention"; }
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; return index == 3 ? TENSOR_BOOL : TENSOR_FLOAT; }
static int output_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return TENSOR_FLOAT; }
static size_t four(const OrtCustomOp *op) { (void)op; return 4; }

const OrtCustomOp specdec_tree_attention = {
    CUSTOM_OP_VERSION, create_kernel, op_name, op_cpu_provider, input_type, four, output_type, op_one_output,
    compute, destroy_kernel, op_required, op_required, op_default_memory,
};
