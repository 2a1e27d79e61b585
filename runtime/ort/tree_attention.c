/* specdec.TreeAttention, an ONNX Runtime CPU operator: ONNX's Attention (opset 23/24) for what the target step asks
 * of it, Y = softmax(Q K^T * scale, masked) V, with Q [B, Hq, N, D], K [B, Hkv, L, D], V [B, Hkv, L, Dv] (grouped-query
 * heads: query head h reads key/value head h / (Hq / Hkv)), a boolean mask broadcast to [B, Hq, N, L] (true: the
 * position takes part) and Y [B, Hq, N, Dv]; the attribute scale, where nonzero, replaces 1 / sqrt(D).
 *
 * Why: ONNX Runtime's own CPU Attention spends far more than reading the cache costs at long contexts (SmolLM2-135M on
 * 2 Intel Xeon vCPUs: its one-token step 12.1 ms longer at 2,048 tokens of context than at 512, where the keys and
 * values grow by 71 MB, under 4 ms to read; 7.5 ms longer with this operator), so long prompts made both plain
 * decoding and verification slow. Here masked positions are never read and a position's score is one dot product.
 *
 * The work is split as flash-decoding splits it: a work item is one key/value head's positions in one chunk of CHUNK,
 * for every query row of every query head that reads that head, so its keys and values are read once for all of them
 * and a long context gives both threads work even at one row (9 query heads no longer split 5 to 4 over 2 threads).
 * Each row keeps, per chunk, its maximum score, the sum of its exponentials and its weighted values; the group's last
 * chunk to finish merges them in chunk order. Against one work item per query head, at 2,048 tokens of context the
 * attention of 30 layers of SmolLM2-135M's shapes took 15-18% less time at one row and 9-24% at 4-16 rows (a whole
 * target step 1-8%); at 1,024 and under the two are within noise (2 Xeon vCPUs).
 *
 * A row's arithmetic is fixed by position alone (chunks start at multiples of CHUNK; within one, its scores, their
 * maximum, the exponentials summed lane by lane, the values in position order; then the chunks in order), so a row's
 * result is the same bit for bit whichever rows share the call, however many masked slots follow and however many
 * threads run it: a token gets the same attention alone in a plain step as inside a verified tree. A row that may see
 * no position gets zeros. */
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ort_api.h"

#define LANES 16
#define CHUNK 128    /* positions one work item covers; fixed, so a row's sums never depend on the call */
#define PASS_ROWS 64 /* rows of each query head per pass (a prompt's partial results would take N x chunks x Dv) */
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
  float *part; /* the pass's [B, Hq, pass rows, chunks, Dv + 2]: a chunk's weighted values, its maximum, its sum */
  int64_t heads, kv_heads, rows, length, dim, vdim, chunks;
  int64_t first_row, pass_rows; /* the rows of each head this pass computes */
  int64_t *pending;             /* per sequence and key/value head: its chunks not yet done this pass */
  int64_t mask_stride[4];       /* elements between neighbours along B, Hq, N, L (0 where the mask is broadcast) */
  float scale;
} Work;

/* Where row n of the pass (query head h, sequence b) keeps its result for chunk c; its chunks follow one another. */
static inline float *part_of(const Work *a, int64_t b, int64_t h, int64_t n, int64_t c) {
  return a->part + (((b * a->heads + h) * a->pass_rows + n) * a->chunks + c) * (a->vdim + 2);
}

/* Which lanes of the 16 positions from ``seen`` take part (``count`` of them exist); 0 if none does. */
static inline int block_keep(const uint8_t *seen, int64_t step, int64_t count, vi16 *keep) {
  if (step == 1 && count == LANES) { /* 16 mask bytes at once */
    uint64_t halves[2];
    memcpy(halves, seen, sizeof halves);
    if (!(halves[0] | halves[1])) return 0;
    vb16 bytes;
    memcpy(&bytes, seen, sizeof bytes);
    *keep = __builtin_convertvector(bytes, vi16) != 0;
    return 1;
  }
  int32_t each[LANES] = {0};
  int any = 0;
  for (int64_t j = 0; j < count; j++) any |= each[j] = -(seen[j * step] != 0);
  memcpy(keep, each, sizeof *keep);
  return any;
}

/* One work item: the pass's rows of every query head that reads one key/value head (head by head), over one chunk of
 * its positions. */
typedef struct {
  int64_t all, count;      /* rows; positions (CHUNK but for the last chunk) */
  int64_t rest;            /* positions from the chunk's first to the head's last */
  const float *k, *v;      /* the chunk's keys and values */
  const float **queries;   /* each row's query */
  const uint8_t **masks;   /* each row's mask at the chunk's first position */
  float **parts;           /* where each row keeps its result for the chunk */
  float *scores;           /* all x CHUNK: scores, then weights */
  int64_t *seeing, seers;  /* the rows that see one of the chunk's positions */
} Item;

/* The item's scores (-inf where masked or past the keys): each block of 16 keys is scored against every row while it
 * is in the core's cache (a tail block read from a zero-padded copy, so a position's score never depends on where the
 * keys end); a head size that is no multiple of 16 takes one dot product per position. */
static void chunk_scores(const Work *a, const Item *it) {
  int64_t D = a->dim, step = a->mask_stride[3];
  for (int64_t i = 0; i < it->all * CHUNK; i++) it->scores[i] = -INFINITY;
  if (D % LANES) {
    for (int64_t r = 0; r < it->all; r++)
      for (int64_t l = 0; l < it->count; l++)
        if (it->masks[r][l * step]) it->scores[r * CHUNK + l] = dot(it->queries[r], it->k + l * D, D) * a->scale;
    return;
  }
  float tail[LANES * 128]; /* 16 keys of a head size up to 128; larger ones take the heap */
  float *spare = D <= 128 ? tail : NULL;
  for (int64_t j0 = 0; j0 < it->count; j0 += LANES) {
    const float *keys = it->k + j0 * D;
    if (j0 + 2 * LANES < it->rest) /* the keys two blocks on, past the chunk too (often the thread's next item) */
      for (int64_t i = 0; i < LANES * D; i += 16) __builtin_prefetch(keys + 2 * LANES * D + i, 0, 3);
    int64_t block = it->count - j0 < LANES ? it->count - j0 : LANES;
    if (block < LANES) {
      if (!spare) spare = malloc((size_t)(LANES * D) * sizeof(float));
      if (!spare) return; /* every score stays -inf: the rows see nothing */
      memset(spare, 0, (size_t)(LANES * D) * sizeof(float));
      memcpy(spare, keys, (size_t)(block * D) * sizeof(float));
      keys = spare;
    }
    int seen = 0;
    for (int64_t r = 0; r < it->all; r++) {
      vi16 keep;
      if (!block_keep(it->masks[r] + j0 * step, step, block, &keep)) continue;
      seen = 1;
      const float *query = it->queries[r];
      v16 s = D == 64 ? block_scores64(load(query), load(query + 16), load(query + 32), load(query + 48), keys)
                      : block_scores(query, keys, D);
      s = (v16)(((vi16)(s * splat(a->scale)) & keep) | ((vi16)splat(-INFINITY) & ~keep));
      memcpy(it->scores + r * CHUNK + j0, &s, sizeof s);
    }
    if (seen) /* the block's values, read next, on their way while its keys are scored */
      for (int64_t i = 0; i < block * a->vdim; i += 16) __builtin_prefetch(it->v + j0 * a->vdim + i, 0, 3);
  }
  if (spare != tail) free(spare);
}

/* A row's scores over a chunk -> its weights exp(score - max) in place; returns the maximum (-inf where the row sees
 * none of the chunk's positions, its weights then all 0) and sets ``sum`` to the weights' sum. */
static float chunk_weights(float *row, float *sum) {
  v16 most = splat(-INFINITY);
  for (int64_t l = 0; l < CHUNK; l += LANES) {
    v16 x = load(row + l);
    most = (v16)(((vi16)x & (x > most)) | ((vi16)most & ~(x > most)));
  }
  float top = -INFINITY; /* exact whatever the order */
  for (int j = 0; j < LANES; j++) top = most[j] > top ? most[j] : top;
  *sum = 0.0f;
  if (top == -INFINITY) return top; /* the row's part is skipped: its weights are never read */
  v16 total = splat(0.0f), shift = splat(top);
  for (int64_t l = 0; l < CHUNK; l += LANES) {
    v16 p = exp_nonpositive(load(row + l) - shift);
    memcpy(row + l, &p, sizeof p);
    total += p;
  }
  *sum = lane_sum(total);
  return top;
}

/* Rows a values tile keeps in registers: 6 x 4 accumulators and a position's 4 value vectors, of AVX-512's 32. Against
 * tiles of 4 that checked each position's weights one row at a time, 30 layers of SmolLM2-135M's attention took 11-17%
 * less at 7-24 rows and 6-11% less at one (2-core AMD EPYC, contexts of 300, 1,024 and 2,048, interleaved medians),
 * their results the same bit for bit. */
#define VALUE_ROWS 6

/* ``rows`` (1-6) rows' weighted values for a value size of 64, in position order, each value read once for the tile;
 * a position every row gives weight 0 is skipped (masked slots are never read). Which positions some row weighs is
 * found 16 at a time by vector compares, so a position costs the tile its value's loads and the products alone. */
static inline __attribute__((always_inline)) void values_tile64(int rows, const float *const *weights, const float *v,
                                                                int64_t count, float *const *out) {
  v16 acc[VALUE_ROWS][4];
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 4; c++) acc[r][c] = splat(0.0f);
  for (int64_t l0 = 0; l0 < count; l0 += LANES) { /* a row's weights fill CHUNK, zero past the chunk's positions */
    vi16 any = (vi16){0};
    for (int r = 0; r < rows; r++) any |= load(weights[r] + l0) != splat(0.0f);
    int32_t weighed[LANES];
    memcpy(weighed, &any, sizeof weighed);
    int64_t block = count - l0 < LANES ? count - l0 : LANES;
    for (int64_t j = 0; j < block; j++) {
      if (!weighed[j]) continue;
      int64_t l = l0 + j;
      const float *value = v + l * 64;
      v16 v0 = load(value), v1 = load(value + 16), v2 = load(value + 32), v3 = load(value + 48);
      for (int r = 0; r < rows; r++) {
        v16 w = splat(weights[r][l]);
        acc[r][0] += w * v0;
        acc[r][1] += w * v1;
        acc[r][2] += w * v2;
        acc[r][3] += w * v3;
      }
    }
  }
  for (int r = 0; r < rows; r++)
    for (int c = 0; c < 4; c++) memcpy(out[r] + c * 16, &acc[r][c], sizeof acc[r][c]);
}

/* The seeing rows' weighted values over the chunk, unnormalized, into their parts: for a value size of 64, in the
 * fewest tiles of at most VALUE_ROWS rows, their sizes within one of each other. */
static void chunk_values(const Work *a, const Item *it) {
  int64_t Dv = a->vdim;
  if (Dv == 64) {
    int64_t tiles = (it->seers + VALUE_ROWS - 1) / VALUE_ROWS;
    for (int64_t t = 0, i0 = 0; t < tiles; t++) {
      int64_t i1 = it->seers * (t + 1) / tiles;
      float *out[VALUE_ROWS];
      const float *w[VALUE_ROWS];
      int tile = (int)(i1 - i0);
      for (int i = 0; i < tile; i++) {
        out[i] = it->parts[it->seeing[i0 + i]];
        w[i] = it->scores + it->seeing[i0 + i] * CHUNK;
      }
      switch (tile) {
        case 1: values_tile64(1, w, it->v, it->count, out); break;
        case 2: values_tile64(2, w, it->v, it->count, out); break;
        case 3: values_tile64(3, w, it->v, it->count, out); break;
        case 4: values_tile64(4, w, it->v, it->count, out); break;
        case 5: values_tile64(5, w, it->v, it->count, out); break;
        default: values_tile64(VALUE_ROWS, w, it->v, it->count, out); break;
      }
      i0 = i1;
    }
    return;
  }
  for (int64_t i = 0; i < it->seers; i++) {
    const float *weights = it->scores + it->seeing[i] * CHUNK;
    float *out = it->parts[it->seeing[i]];
    memset(out, 0, (size_t)Dv * sizeof(float));
    for (int64_t l = 0; l < it->count; l++) {
      if (weights[l] == 0.0f) continue;
      for (int64_t d = 0; d < Dv; d++) out[d] += weights[l] * it->v[l * Dv + d];
    }
  }
}

/* One query head of one sequence: each of the pass's rows merges its chunks in chunk order (their weights rescaled to
 * the row's maximum) and divides by its sum; a row that sees no position gets zeros. */
static void merge_head(const Work *a, int64_t b, int64_t h) {
  int64_t Dv = a->vdim, stride = Dv + 2;
  for (int64_t n = 0; n < a->pass_rows; n++) {
    const float *part = part_of(a, b, h, n, 0);
    float *out = a->y + ((b * a->heads + h) * a->rows + a->first_row + n) * Dv;
    memset(out, 0, (size_t)Dv * sizeof(float));
    float top = -INFINITY;
    int lost = 0; /* a chunk whose scratch could not be had: the row's result is NaN */
    for (int64_t c = 0; c < a->chunks; c++) {
      float most = part[c * stride + Dv];
      lost |= most != most;
      top = most > top ? most : top;
    }
    if (lost)
      for (int64_t d = 0; d < Dv; d++) out[d] = NAN;
    if (lost || top == -INFINITY) continue;
    float total = 0.0f;
    for (int64_t c = 0; c < a->chunks; c++) {
      const float *chunk = part + c * stride;
      if (chunk[Dv] == -INFINITY) continue;
      float scale = expf(chunk[Dv] - top);
      total += scale * chunk[Dv + 1];
      for (int64_t d = 0; d < Dv; d++) out[d] += scale * chunk[d];
    }
    float inverse = total > 0.0f ? 1.0f / total : 0.0f;
    for (int64_t d = 0; d < Dv; d++) out[d] *= inverse;
  }
}

/* One work item: one chunk of ``CHUNK`` positions of one key/value head of one sequence, for the pass's rows of every
 * query head that reads it (its keys and values read once for all of them). Chunks are fixed by position, so a row's
 * partial results do not depend on the rows beside it, on the pass, or on how many threads share the call. */
static void chunk_item(void *data, size_t index) {
  const Work *a = data;
  int64_t c = (int64_t)index % a->chunks, g = (int64_t)index / a->chunks % a->kv_heads;
  int64_t b = (int64_t)index / a->chunks / a->kv_heads, group = a->heads / a->kv_heads;
  int64_t L = a->length, l0 = c * CHUNK, D = a->dim, Dv = a->vdim;
  Item it = {.all = group * a->pass_rows, .count = L - l0 < CHUNK ? L - l0 : CHUNK, .rest = L - l0};
  it.k = a->k + ((b * a->kv_heads + g) * L + l0) * D;
  it.v = a->v + ((b * a->kv_heads + g) * L + l0) * Dv;
  char *scratch = malloc((size_t)it.all * (CHUNK * sizeof(float) + 3 * sizeof(void *) + sizeof(int64_t)));
  if (scratch) {
    it.scores = (float *)scratch;
    it.queries = (const float **)(scratch + it.all * CHUNK * sizeof(float));
    it.masks = (const uint8_t **)(it.queries + it.all);
    it.parts = (float **)(it.masks + it.all);
    it.seeing = (int64_t *)(it.parts + it.all);
    for (int64_t r = 0; r < it.all; r++) {
      int64_t h = g * group + r / a->pass_rows, n = a->first_row + r % a->pass_rows;
      it.queries[r] = a->q + ((b * a->heads + h) * a->rows + n) * D;
      it.masks[r] = a->mask + b * a->mask_stride[0] + h * a->mask_stride[1] + n * a->mask_stride[2] +
                    l0 * a->mask_stride[3];
      it.parts[r] = part_of(a, b, h, n - a->first_row, c);
    }
    chunk_scores(a, &it);
    for (int64_t r = 0; r < it.all; r++) {
      float *part = it.parts[r];
      part[Dv] = chunk_weights(it.scores + r * CHUNK, part + Dv + 1);
      if (part[Dv] != -INFINITY) it.seeing[it.seers++] = r;
    }
    chunk_values(a, &it);
    free(scratch);
  } else /* a loud result, not a silent one */
    for (int64_t r = 0; r < it.all; r++) {
      float *part = part_of(a, b, g * group + r / a->pass_rows, r % a->pass_rows, c);
      for (int64_t d = 0; d < Dv + 2; d++) part[d] = NAN;
    }
  /* The group's last chunk to finish merges its rows (the others' parts are visible to it: acquire and release). */
  if (__atomic_sub_fetch(&a->pending[b * a->kv_heads + g], 1, __ATOMIC_ACQ_REL) == 0)
    for (int64_t h = g * (a->heads / a->kv_heads); h < (g + 1) * (a->heads / a->kv_heads); h++) merge_head(a, b, h);
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
  work.chunks = (work.length + CHUNK - 1) / CHUNK;
  if (work.chunks == 0) { /* no positions: every row sees nothing */
    memset(out, 0, (size_t)count * sizeof(float));
    return;
  }
  int64_t pass_rows = work.rows < PASS_ROWS ? work.rows : PASS_ROWS;
  size_t groups = (size_t)(qd[0] * kd[1]), items = groups * (size_t)work.chunks;
  /* the counters first, so that they are aligned whatever the parts' size */
  work.pending = malloc(groups * sizeof(int64_t) +
                        (size_t)(qd[0] * qd[1] * pass_rows * work.chunks * (work.vdim + 2)) * sizeof(float));
  if (!work.pending) {
    for (int64_t i = 0; i < count; i++) out[i] = NAN;
    return;
  }
  work.part = (float *)(work.pending + groups);
  for (work.first_row = 0; work.first_row < work.rows; work.first_row += PASS_ROWS) {
    work.pass_rows = work.rows - work.first_row < PASS_ROWS ? work.rows - work.first_row : PASS_ROWS;
    for (size_t i = 0; i < groups; i++) work.pending[i] = work.chunks;
    parallel_for(context, chunk_item, items, &work);
  }
  free(work.pending);
}

static const char *op_name(const OrtCustomOp *op) { (void)op; return "TreeAttention"; }
static int input_type(const OrtCustomOp *op, size_t index) { (void)op; return index == 3 ? TENSOR_BOOL : TENSOR_FLOAT; }
static int output_type(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return TENSOR_FLOAT; }
static size_t four(const OrtCustomOp *op) { (void)op; return 4; }

const OrtCustomOp specdec_tree_attention = {
    CUSTOM_OP_VERSION, create_kernel, op_name, op_cpu_provider, input_type, four, output_type, op_one_output,
    compute, destroy_kernel, op_required, op_required, op_default_memory,
};
