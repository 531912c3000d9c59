// CPFILL_CUBLAS_CHECK: a cuBLAS(Lt) call that returns an absl::Status error from the enclosing
// function when it fails, naming the call, its status and where it was made.
#pragma once

#include <cublasLt.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

#define CPFILL_CUBLAS_CHECK(call)                                                                  \
  do {                                                                                             \
    const cublasStatus_t cpfill_cublas_rc_ = (call);                                               \
    if (cpfill_cublas_rc_ != CUBLAS_STATUS_SUCCESS)                                                \
      return absl::InternalError(absl::StrCat("cuBLASLt call ", #call, " failed with status ",     \
                                              static_cast<int>(cpfill_cublas_rc_), " (", __FILE__, \
                                              ":", __LINE__, ")"));                                \
  } while (0)
