/* The library's entry point: registers the kit's CPU operators in the "specdec" domain of a session's options. */
#include <stddef.h>
#include <stdint.h>

#include "ort_api.h"

const OrtApi *g_api;
int g_parallel;

/* Called by ONNX Runtime's register_custom_ops_library. */
OrtStatus *RegisterCustomOps(OrtSessionOptions *options, const OrtApiBase *base) {
  g_api = base->GetApi(API_WITH_PARALLEL_FOR);
  g_parallel = g_api != NULL;
  if (!g_api) g_api = base->GetApi(API_BASIC);
  OrtCustomOpDomain *domain;
  OrtStatus *status = ((CreateCustomOpDomainFn)API_FN(g_api, API_CreateCustomOpDomain))("specdec", &domain);
  if (status) return status;
  const OrtCustomOp *ops[] = {&specdec_packed_matmul, &specdec_tree_attention, &specdec_int8_matmul};
  for (size_t i = 0; i < sizeof ops / sizeof ops[0]; i++) {
    status = ((CustomOpDomainAddFn)API_FN(g_api, API_CustomOpDomain_Add))(domain, ops[i]);
    if (status) return status;
  }
  return ((AddCustomOpDomainFn)API_FN(g_api, API_AddCustomOpDomain))(options, domain);
}
