/* The part of ONNX Runtime's C API the kit's CPU operators call, reached through its function table (entries are
 * only ever appended, so an entry's index is stable across versions); only the entries the operators call are named.
 * Shared by the operators' sources (packed_matmul.c, tree_attention.c, int8_matmul.c) and their registration
 * (register_ops.c). */
#ifndef SPECDEC_ORT_API_H
#define SPECDEC_ORT_API_H
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct OrtStatus OrtStatus;
typedef struct OrtApi OrtApi;
typedef struct OrtValue OrtValue;
typedef struct OrtKernelInfo OrtKernelInfo;
typedef struct OrtKernelContext OrtKernelContext;
typedef struct OrtSessionOptions OrtSessionOptions;
typedef struct OrtCustomOpDomain OrtCustomOpDomain;
typedef struct OrtTensorTypeAndShapeInfo OrtTensorTypeAndShapeInfo;
typedef struct OrtApiBase {
  const OrtApi *(*GetApi)(uint32_t version);
  const char *(*GetVersionString)(void);
} OrtApiBase;

/* The custom-operator record as of API version 13: ONNX Runtime reads no field past those of the declared version. */
typedef struct OrtCustomOp {
  uint32_t version;
  void *(*CreateKernel)(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info);
  const char *(*GetName)(const struct OrtCustomOp *op);
  const char *(*GetExecutionProviderType)(const struct OrtCustomOp *op);
  int (*GetInputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetInputTypeCount)(const struct OrtCustomOp *op);
  int (*GetOutputType)(const struct OrtCustomOp *op, size_t index);
  size_t (*GetOutputTypeCount)(const struct OrtCustomOp *op);
  void (*KernelCompute)(void *kernel, OrtKernelContext *context);
  void (*KernelDestroy)(void *kernel);
  int (*GetInputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetOutputCharacteristic)(const struct OrtCustomOp *op, size_t index);
  int (*GetInputMemoryType)(const struct OrtCustomOp *op, size_t index);
} OrtCustomOp;

enum {
  CUSTOM_OP_VERSION = 13,
  API_WITH_PARALLEL_FOR = 17,
  API_BASIC = 13,
  TENSOR_FLOAT = 1,
  TENSOR_INT8 = 3,
  TENSOR_INT32 = 6,
  TENSOR_BOOL = 9,
};
enum {
  API_CreateCustomOpDomain = 26,
  API_CustomOpDomain_Add = 27,
  API_AddCustomOpDomain = 28,
  API_GetTensorMutableData = 51,
  API_GetDimensionsCount = 61,
  API_GetDimensions = 62,
  API_GetTensorTypeAndShape = 65,
  API_KernelInfoGetAttribute_float = 85,
  API_KernelInfoGetAttribute_int64 = 86,
  API_KernelContext_GetInput = 90,
  API_KernelContext_GetOutput = 91,
  API_ReleaseTensorTypeAndShapeInfo = 99,
  API_KernelContext_ParallelFor = 274,
};
#define API_FN(api, index) (((void *const *)(api))[index])

typedef OrtStatus *(*CreateCustomOpDomainFn)(const char *, OrtCustomOpDomain **);
typedef OrtStatus *(*CustomOpDomainAddFn)(OrtCustomOpDomain *, const OrtCustomOp *);
typedef OrtStatus *(*AddCustomOpDomainFn)(OrtSessionOptions *, OrtCustomOpDomain *);
typedef OrtStatus *(*GetTensorMutableDataFn)(OrtValue *, void **);
typedef OrtStatus *(*GetDimensionsCountFn)(const OrtTensorTypeAndShapeInfo *, size_t *);
typedef OrtStatus *(*GetDimensionsFn)(const OrtTensorTypeAndShapeInfo *, int64_t *, size_t);
typedef OrtStatus *(*GetTensorTypeAndShapeFn)(const OrtValue *, OrtTensorTypeAndShapeInfo **);
typedef OrtStatus *(*GetAttributeFloatFn)(const OrtKernelInfo *, const char *, float *);
typedef OrtStatus *(*GetAttributeInt64Fn)(const OrtKernelInfo *, const char *, int64_t *);
typedef OrtStatus *(*GetInputFn)(const OrtKernelContext *, size_t, const OrtValue **);
typedef OrtStatus *(*GetOutputFn)(OrtKernelContext *, size_t, const int64_t *, size_t, OrtValue **);
typedef void (*ReleaseShapeFn)(OrtTensorTypeAndShapeInfo *);
typedef OrtStatus *(*ParallelForFn)(const OrtKernelContext *, void (*)(void *, size_t), size_t, size_t, void *);

extern const OrtApi *g_api;  /* set by RegisterCustomOps */
extern int g_parallel;       /* whether g_api has KernelContext_ParallelFor */

#define MAX_RANK 16

/* A tensor's dimensions; returns the product of all but the last (the rows of a MatMul's left side). */
static inline int64_t leading_rows(const OrtValue *value, int64_t *dims, size_t *rank) {
  OrtTensorTypeAndShapeInfo *info;
  ((GetTensorTypeAndShapeFn)API_FN(g_api, API_GetTensorTypeAndShape))(value, &info);
  ((GetDimensionsCountFn)API_FN(g_api, API_GetDimensionsCount))(info, rank);
  if (*rank > MAX_RANK) *rank = MAX_RANK;
  ((GetDimensionsFn)API_FN(g_api, API_GetDimensions))(info, dims, *rank);
  ((ReleaseShapeFn)API_FN(g_api, API_ReleaseTensorTypeAndShapeInfo))(info);
  int64_t rows = 1;
  for (size_t d = 0; d + 1 < *rank; d++) rows *= dims[d];
  return rows;
}

static inline void *data_of(const OrtValue *value) {
  void *data;
  ((GetTensorMutableDataFn)API_FN(g_api, API_GetTensorMutableData))((OrtValue *)value, &data);
  return data;
}

/* ``fn`` over ``units`` work items, on ONNX Runtime's threads where it lends them (one at a time otherwise). */
static inline void parallel_for(OrtKernelContext *context, void (*fn)(void *, size_t), size_t units, void *data) {
  if (g_parallel && units > 1)
    ((ParallelForFn)API_FN(g_api, API_KernelContext_ParallelFor))(context, fn, units, 0, data);
  else
    for (size_t i = 0; i < units; i++) fn(data, i);
}

/* ``unit`` over part ``i`` of ``parts`` contiguous, even shares of ``total`` units (one thread's share of a product's
 * column blocks). */
static inline void each_of_share(const void *work, size_t i, size_t parts, int64_t total,
                                 void (*unit)(const void *, int64_t)) {
  for (int64_t u = total * (int64_t)i / (int64_t)parts; u < total * (int64_t)(i + 1) / (int64_t)parts; u++)
    unit(work, u);
}

/* Where tile ``t`` of ``rows`` rows starts, the rows split into the fewest tiles of at most ``most`` rows whose sizes
 * are within one of each other (t = the tile count: the end). A second pass over a weight block is arithmetic with
 * nothing in flight, so 16 rows under a limit of 14 go as 8 + 8, not 14 + 2. */
static inline int64_t tile_start(int64_t rows, int64_t most, int64_t t) {
  return rows * t / ((rows + most - 1) / most);
}

/* A product operator's kernel: its attribute n, the output columns (-1 where the node has none). */
typedef struct {
  int64_t n;
} ColumnsKernel;

static inline void *create_columns_kernel(const struct OrtCustomOp *op, const OrtApi *api, const OrtKernelInfo *info) {
  (void)op;
  ColumnsKernel *kernel = calloc(1, sizeof *kernel);
  if (kernel && ((GetAttributeInt64Fn)API_FN(api, API_KernelInfoGetAttribute_int64))(info, "n", &kernel->n) != NULL)
    kernel->n = -1;
  return kernel;
}

static inline void destroy_kernel(void *kernel) { free(kernel); }

/* The callbacks every operator record shares: CPU kernels, one output, every input and output required, inputs in CPU
 * memory. */
static inline const char *op_cpu_provider(const OrtCustomOp *op) { (void)op; return "CPUExecutionProvider"; }
static inline size_t op_one_output(const OrtCustomOp *op) { (void)op; return 1; }
static inline int op_required(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return 0; }
static inline int op_default_memory(const OrtCustomOp *op, size_t index) { (void)op; (void)index; return 0; }

/* The operators the library registers in the "specdec" domain. */
extern const OrtCustomOp specdec_packed_matmul;
extern const OrtCustomOp specdec_tree_attention;
extern const OrtCustomOp specdec_int8_matmul;

#endif
