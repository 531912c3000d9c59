# Finds every dependency from Debian packages; nothing is downloaded at build time.
# A missing one stops configure naming the package that provides it
# (launch/setup.sh installs them all).

macro(cpfill_require found what package)
  if(NOT ${found})
    message(FATAL_ERROR "cpfill needs ${what}: install it with 'apt-get install ${package}' "
                        "(or run launch/setup.sh, which installs everything)")
  endif()
endmacro()

find_package(MPI COMPONENTS CXX QUIET)
cpfill_require(MPI_CXX_FOUND "Open MPI (mpi.h, mpirun)" "libopenmpi-dev openmpi-bin")

find_package(absl CONFIG QUIET)
cpfill_require(absl_FOUND "Abseil" "libabsl-dev")

find_package(nlohmann_json 3 CONFIG QUIET)
cpfill_require(nlohmann_json_FOUND "nlohmann-json (nlohmann/json.hpp)" "nlohmann-json3-dev")

# cpp-httplib (the HTTP server of `cpfill serve`): Debian builds it as a library with TLS and
# compression on; pkg-config carries the defines the header must see to match it.
find_package(PkgConfig QUIET)
if(PkgConfig_FOUND)
  pkg_check_modules(HTTPLIB QUIET IMPORTED_TARGET cpp-httplib)
endif()
cpfill_require(HTTPLIB_FOUND "cpp-httplib (httplib.h)" "libcpp-httplib-dev pkg-config")

# PCRE2 (runtime/text/tokenizer.cc): the pre-tokenizer patterns of tokenizer.json, with Unicode
# classes (\p{L}, \p{N}) and its JIT.
if(PkgConfig_FOUND)
  pkg_check_modules(PCRE2 QUIET IMPORTED_TARGET libpcre2-8)
endif()
cpfill_require(PCRE2_FOUND "PCRE2 (pcre2.h, libpcre2-8)" "libpcre2-dev pkg-config")

find_package(ucx CONFIG QUIET)
cpfill_require(ucx_FOUND "UCX" "libucx-dev")

find_package(Threads REQUIRED)
# OpenSSL's libcrypto (libssl-dev, which cpp-httplib's package needs too): SHA-256 for the KV
# hand-off's lease records (base/secure.h).
find_package(OpenSSL REQUIRED COMPONENTS Crypto)

if(CPFILL_BUILD_TESTS)
  find_package(GTest CONFIG QUIET)
  cpfill_require(GTest_FOUND "GoogleTest" "libgtest-dev libgmock-dev")
endif()
if(CPFILL_BUILD_BENCH)
  find_package(benchmark CONFIG QUIET)
  cpfill_require(benchmark_FOUND "Google Benchmark" "libbenchmark-dev")
endif()

# CUDA is optional. AUTO builds the CUDA parts when nvcc is found; ON insists on it.
set(CPFILL_HAVE_CUDA OFF)
if(NOT CPFILL_CUDA STREQUAL "OFF")
  include(CheckLanguage)
  if(NOT CMAKE_CUDA_COMPILER AND EXISTS /usr/local/cuda/bin/nvcc)
    set(CMAKE_CUDA_COMPILER /usr/local/cuda/bin/nvcc)
  endif()
  check_language(CUDA)
  if(CMAKE_CUDA_COMPILER)
    if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
      set(CMAKE_CUDA_ARCHITECTURES 90)
    endif()
    enable_language(CUDA)
    # cpfill's headers are C++20 and nvcc 12+ compiles C++20, but CMake before 3.26 does not
    # know nvcc's flag for it: tell it.
    if(NOT CMAKE_CUDA20_STANDARD_COMPILE_OPTION)
      set(CMAKE_CUDA20_STANDARD_COMPILE_OPTION "-std=c++20")
      set(CMAKE_CUDA20_EXTENSION_COMPILE_OPTION "-std=c++20")
    endif()
    set(CMAKE_CUDA_STANDARD 20)
    set(CMAKE_CUDA_STANDARD_REQUIRED ON)
    find_package(CUDAToolkit REQUIRED)
    find_path(NCCL_INCLUDE_DIR nccl.h HINTS ${CUDAToolkit_INCLUDE_DIRS} /usr/include)
    find_library(NCCL_LIBRARY nccl HINTS ${CUDAToolkit_LIBRARY_DIR} /usr/local/cuda/lib
                 /usr/lib/x86_64-linux-gnu)
    if(NOT NCCL_INCLUDE_DIR OR NOT NCCL_LIBRARY)
      if(CPFILL_CUDA STREQUAL "ON")
        message(FATAL_ERROR "CPFILL_CUDA=ON but NCCL was not found: install libnccl-dev")
      endif()
      message(STATUS "cpfill: nvcc found but NCCL missing; CUDA backend disabled")
    else()
      set(CPFILL_HAVE_CUDA ON)
    endif()
  elseif(CPFILL_CUDA STREQUAL "ON")
    message(FATAL_ERROR "CPFILL_CUDA=ON but no nvcc was found: install the CUDA toolkit "
                        "(nvidia-cuda-toolkit) or configure with -DCPFILL_CUDA=OFF")
  endif()
endif()

# OpenBLAS for the CPU Linear layers (runtime/model/cpu/layers.cc). cblas.h sits under a
# multiarch/alternatives directory on Debian, hence the suffixes. Its thread count comes from
# OPENBLAS_NUM_THREADS, set per rank by the launcher.
find_path(CBLAS_INCLUDE_DIR cblas.h
          PATH_SUFFIXES openblas x86_64-linux-gnu x86_64-linux-gnu/openblas-pthread)
find_library(OPENBLAS_LIBRARY NAMES openblas)
if(CBLAS_INCLUDE_DIR AND OPENBLAS_LIBRARY)
  set(CPFILL_OPENBLAS_FOUND ON)
else()
  set(CPFILL_OPENBLAS_FOUND OFF)
endif()
cpfill_require(CPFILL_OPENBLAS_FOUND "OpenBLAS (cblas)" "libopenblas-dev")
