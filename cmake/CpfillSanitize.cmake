# CPFILL_SANITIZE=address,undefined (any -fsanitize= list): instruments every C++ target, compile
# and link, for CI's build-asan stage (.ci/run). UB stops the test instead of printing and going
# on, so a finding fails CI. nvcc takes no -fsanitize, hence CUDA off in such a build.
# Runtime options (leak suppressions for Open MPI's own allocations) go to the tests' environment
# in CpfillTesting.cmake as CPFILL_SANITIZE_TEST_ENV.
if(NOT CPFILL_SANITIZE)
  return()
endif()
if(CPFILL_HAVE_CUDA)
  message(FATAL_ERROR "CPFILL_SANITIZE=${CPFILL_SANITIZE} needs -DCPFILL_CUDA=OFF: nvcc-compiled "
                      "code cannot be instrumented")
endif()
set(CPFILL_SANITIZE_FLAGS -fsanitize=${CPFILL_SANITIZE} -fno-omit-frame-pointer)
if(CPFILL_SANITIZE MATCHES "undefined")
  list(APPEND CPFILL_SANITIZE_FLAGS -fno-sanitize-recover=undefined)
endif()
add_compile_options("$<$<COMPILE_LANGUAGE:CXX>:${CPFILL_SANITIZE_FLAGS}>")
add_link_options(${CPFILL_SANITIZE_FLAGS})
message(STATUS "cpfill: sanitizers ${CPFILL_SANITIZE}")
