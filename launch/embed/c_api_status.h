// cpfill/launch/embed/c_api_status.h — how the C API (cpfill.h) reports: a status becomes a
// cpfill_status code and its message the calling thread's cpfill_last_error(); an exception
// becomes CPFILL_INTERNAL. Shared by the entry points of c_api.cc and c_api_kv.cc.
#pragma once

#include <exception>
#include <string>

#include "absl/status/status.h"
#include "launch/embed/cpfill.h"

namespace cpfill::embed {

inline thread_local std::string last_error;

inline int Code(const absl::Status& status) {
  switch (status.code()) {
    case absl::StatusCode::kOk:
      return CPFILL_OK;
    case absl::StatusCode::kInvalidArgument:
    case absl::StatusCode::kOutOfRange:
      return CPFILL_INVALID_ARGUMENT;
    case absl::StatusCode::kNotFound:
      return CPFILL_NOT_FOUND;
    case absl::StatusCode::kResourceExhausted:
      return CPFILL_RESOURCE_EXHAUSTED;
    case absl::StatusCode::kUnavailable:
      return CPFILL_UNAVAILABLE;
    case absl::StatusCode::kFailedPrecondition:
      return CPFILL_FAILED_PRECONDITION;
    case absl::StatusCode::kDeadlineExceeded:
      return CPFILL_NOT_READY;
    default:
      return CPFILL_INTERNAL;
  }
}

inline int Report(const absl::Status& status) {
  if (!status.ok()) last_error = std::string(status.message());
  return Code(status);
}

// Runs `body` (returning absl::Status) with every exception turned into CPFILL_INTERNAL.
template <typename Body>
int Guarded(Body body) {
  try {
    return Report(body());
  } catch (const std::exception& e) {
    return Report(absl::InternalError(std::string("cpfill: unexpected exception: ") + e.what()));
  } catch (...) {
    return Report(absl::InternalError("cpfill: unexpected exception"));
  }
}

}  // namespace cpfill::embed
