// cpfill/runtime/model/cuda/cublaslt_library.h — cuBLASLt, opened on first use rather than linked.
//
// Linking libcublasLt costs every process ~0.14 s and ~200 MiB of static initialisation before
// main (measured on the development VM: an empty program linked with it), which every
// `cpfill --help`, every CPU-backend rank and every test paid. Opened here, only a process that
// runs GEMMs on a GPU pays it.
//
//   CPFILL_ASSIGN_OR_RETURN(const CublasLt* lt, OpenCublasLt());
//   lt->Create(&handle);
#pragma once

#include <cublasLt.h>

#include "absl/status/statusor.h"

namespace cpfill::runtime::cuda {

// The entry points cpfill calls, with cuBLASLt's own signatures.
struct CublasLt {
  decltype(&::cublasLtGetVersion) GetVersion;
  decltype(&::cublasLtCreate) Create;
  decltype(&::cublasLtDestroy) Destroy;
  decltype(&::cublasLtMatmul) Matmul;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) MatmulAlgoGetHeuristic;
  decltype(&::cublasLtMatmulDescCreate) MatmulDescCreate;
  decltype(&::cublasLtMatmulDescDestroy) MatmulDescDestroy;
  decltype(&::cublasLtMatmulDescSetAttribute) MatmulDescSetAttribute;
  decltype(&::cublasLtMatmulPreferenceCreate) MatmulPreferenceCreate;
  decltype(&::cublasLtMatmulPreferenceDestroy) MatmulPreferenceDestroy;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) MatmulPreferenceSetAttribute;
  decltype(&::cublasLtMatrixLayoutCreate) MatrixLayoutCreate;
  decltype(&::cublasLtMatrixLayoutDestroy) MatrixLayoutDestroy;
};

// Opens libcublasLt.so.<the major version compiled against> (the loader's search path, then the
// toolkit's library the build found) once per process and resolves every entry point; thread
// safe. Unavailable naming the library and the loader's error when it cannot: a fault of this
// host (its loader path), which the rank reports itself and which ends the job, not bad input.
absl::StatusOr<const CublasLt*> OpenCublasLt();

}  // namespace cpfill::runtime::cuda
