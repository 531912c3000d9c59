// cpfill/base/status.h — error propagation and check macros used by every module.
//
// Host APIs return absl::Status / absl::StatusOr<T>. Debian's Abseil (20220623) has no
// RETURN_IF_ERROR macros, so they live here, once. Every macro records the failing call's text
// and file:line, so an error that crosses several layers still says where it started.
//
//   CPFILL_RETURN_IF_ERROR(comm.Barrier());
//   CPFILL_ASSIGN_OR_RETURN(ShardPlan plan, PlanPrefill(seqs, cp_size));
//   CPFILL_CHECK_ARG(heads % kv_heads == 0, "heads (", heads, ") not divisible by kv heads");
//
// Code choices (style.md): InvalidArgument = bad input or config, FailedPrecondition = wrong
// state, ResourceExhausted = capacity, DeadlineExceeded = a peer did not answer, Internal = a
// broken invariant.
#pragma once

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace cpfill::internal {

// Builders for the library check macros below. Each is defined by the module that owns the
// library (MPI in parallel/, CUDA in attention/cuda/), so base/ itself depends on none of them.
// The message names the call text, file:line and the world rank of the calling process.
absl::Status MpiCallError(int code, const char* call, const char* file, int line);
absl::Status CudaCallError(int code, const char* call, const char* file, int line);

}  // namespace cpfill::internal

#define CPFILL_INTERNAL_CONCAT2(a, b) a##b
#define CPFILL_INTERNAL_CONCAT(a, b) CPFILL_INTERNAL_CONCAT2(a, b)

#define CPFILL_RETURN_IF_ERROR(expr)                 \
  do {                                               \
    ::absl::Status cpfill_status_ = (expr);          \
    if (!cpfill_status_.ok()) return cpfill_status_; \
  } while (0)

#define CPFILL_ASSIGN_OR_RETURN(lhs, expr) \
  CPFILL_INTERNAL_ASSIGN_OR_RETURN(CPFILL_INTERNAL_CONCAT(cpfill_statusor_, __LINE__), lhs, expr)
#define CPFILL_INTERNAL_ASSIGN_OR_RETURN(tmp, lhs, expr) \
  auto tmp = (expr);                                     \
  if (!tmp.ok()) return std::move(tmp).status();         \
  lhs = std::move(tmp).value()

// Returns InvalidArgument with the concatenated message when `cond` is false.
#define CPFILL_CHECK_ARG(cond, ...)                                                \
  do {                                                                             \
    if (!(cond)) return ::absl::InvalidArgumentError(::absl::StrCat(__VA_ARGS__)); \
  } while (0)

// Returns Internal, naming the broken invariant and its location.
#define CPFILL_CHECK_INTERNAL(cond, ...)                                                           \
  do {                                                                                             \
    if (!(cond))                                                                                   \
      return ::absl::InternalError(::absl::StrCat(__FILE__, ":", __LINE__, ": invariant '", #cond, \
                                                  "' broken: ", __VA_ARGS__));                     \
  } while (0)

// Wraps an MPI call: non-MPI_SUCCESS becomes an Internal status naming the call and rank.
// Use only where <mpi.h> is included (parallel/).
#define CPFILL_MPI_CHECK(call)                                                            \
  do {                                                                                    \
    int cpfill_mpi_rc_ = (call);                                                          \
    if (cpfill_mpi_rc_ != MPI_SUCCESS)                                                    \
      return ::cpfill::internal::MpiCallError(cpfill_mpi_rc_, #call, __FILE__, __LINE__); \
  } while (0)

// Wraps a CUDA runtime call: an error becomes an Internal status naming the call, the CUDA error
// and the device. Use only where the CUDA runtime header is included (attention/cuda/, ...).
#define CPFILL_CUDA_CHECK(call)                                                             \
  do {                                                                                      \
    const int cpfill_cuda_rc_ = static_cast<int>(call);                                     \
    if (cpfill_cuda_rc_ != 0)                                                               \
      return ::cpfill::internal::CudaCallError(cpfill_cuda_rc_, #call, __FILE__, __LINE__); \
  } while (0)
