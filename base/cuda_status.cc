// CPFILL_CUDA_CHECK's error (base/status.h), for every CUDA library of cpfill: built only with the
// CUDA backend (cpfill_base_cuda), so that base/ itself needs no CUDA.
#include <cuda_runtime_api.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace cpfill::internal {

absl::Status CudaCallError(int code, const char* call, const char* file, int line) {
  int device = -1;
  cudaGetDevice(&device);
  return absl::InternalError(absl::StrCat("CUDA call ", call, " failed on device ", device, ": ",
                                          cudaGetErrorString(static_cast<cudaError_t>(code)), " (",
                                          file, ":", line, ")"));
}

}  // namespace cpfill::internal
