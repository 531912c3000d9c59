# Test helpers. Labels: unit (CPU, one process), mpi (several ranks under mpirun on one host),
# gpu (needs a GPU; skips with a message elsewhere), multigpu.

# Open MPI refuses to run as root and to oversubscribe the 2-core CI machine without these.
# Every test's ranks share one host, so MPI's own messages take the ob1 PML over shared memory:
# probing UCX's transports cost each process about 0.2 s at MPI_Init (0.46 s to 0.22 s for a
# refused `cpfill prefill`; the suites start thousands). cpfill's own UCX (the KV hand-off) is
# not MPI's and is unaffected. (Isolated singletons, ess_singleton_isolated, saved another 0.1 s
# but failed MPI_Init now and then when several started at once.)
set(CPFILL_MPI_TEST_ENV OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
    OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
    OMPI_MCA_pml=ob1)

# In a sanitized build (CPFILL_SANITIZE) every test runs with the sanitizers' options: halt on
# the first error, stack traces for UB, leaks checked. Open MPI keeps allocations alive past
# MPI_Finalize by design; tests/sanitizer/lsan.supp suppresses them by library name. That only
# matches with full stacks (Open MPI's libraries have no frame pointers, so ASan's fast unwinder
# stops at an unnamed frame) and with its components still mapped at exit (no dlclose), hence the
# two extra settings for the mpi label. With components kept mapped, LeakSanitizer's scan of
# dynamic thread-local storage reads a bogus range and crashes ("Tracer caught signal 11") in
# 4-rank cpfill runs, so the mpi label does not scan TLS (use_tls=0); what only TLS then holds
# (OpenSSL's per-thread error state, pulled in by cpp-httplib) is suppressed by library name.
set(CPFILL_SANITIZE_TEST_ENV "")
if(CPFILL_SANITIZE)
  set(asan_options detect_leaks=1:halt_on_error=1:strict_string_checks=1)
  set(sanitizer_env
      LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tests/sanitizer/lsan.supp
      UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1)
  set(CPFILL_SANITIZE_TEST_ENV ASAN_OPTIONS=${asan_options} ${sanitizer_env})
  list(APPEND CPFILL_MPI_TEST_ENV ASAN_OPTIONS=${asan_options}:fast_unwind_on_malloc=0
       LSAN_OPTIONS=suppressions=${CMAKE_CURRENT_SOURCE_DIR}/tests/sanitizer/lsan.supp:use_tls=0
       UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
       OMPI_MCA_mca_base_component_disable_dlclose=1)
endif()

# Every test source starts from one precompiled header: parsing GoogleTest, nlohmann-json and the
# standard library took 3-5 s of each test's compile (482 of the optimized build's 1162 CPU
# seconds went to test sources, 634 of the sanitized build's 1393). It is compiled once, by an
# executable that is never run, so its flags are those of every test (-fPIE; the sanitizers);
# -Winvalid-pch warns if a test ever stops matching it and falls back to the headers.
add_executable(cpfill_test_pch ${CMAKE_CURRENT_LIST_DIR}/test_pch_main.cc)
target_link_libraries(cpfill_test_pch PRIVATE GTest::gtest nlohmann_json::nlohmann_json)
target_precompile_headers(cpfill_test_pch PRIVATE <gtest/gtest.h> <nlohmann/json.hpp>
                          <algorithm> <cmath> <cstdint> <functional> <map> <memory> <optional>
                          <random> <string> <thread> <vector>)
# In a sanitized build the test sources compile at -O0: their own code is setup and checks, and
# ASan + UBSan at -O1 made them most of that build's time (kv_handle_test.cc 49 s at -O1, 26 s
# at -O0 without the header). What they test (the libraries, the fp64 reference) stays -O1.
set(CPFILL_TEST_SOURCE_OPTIONS -Winvalid-pch)
if(CPFILL_SANITIZE)
  list(APPEND CPFILL_TEST_SOURCE_OPTIONS -O0)
endif()
target_compile_options(cpfill_test_pch PRIVATE ${CPFILL_TEST_SOURCE_OPTIONS})

function(cpfill_use_test_pch target)
  target_precompile_headers(${target} REUSE_FROM cpfill_test_pch)
  target_compile_options(${target} PRIVATE ${CPFILL_TEST_SOURCE_OPTIONS})
endfunction()

# cpfill_test(name SOURCES ... LIBS ... [LABEL unit] [TIMEOUT s]); "NAME name" also accepted.
function(cpfill_test name)
  # LABEL takes several values (a list: LABEL unit cuda).
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;LABEL" ${ARGN})
  if(name STREQUAL "NAME")
    list(GET T_UNPARSED_ARGUMENTS 0 name)
  endif()
  if(NOT T_LABEL)
    set(T_LABEL unit)
  endif()
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 300)
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest GTest::gtest_main)
  cpfill_use_test_pch(${name})
  add_test(NAME ${name} COMMAND ${name})
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABEL}" TIMEOUT ${T_TIMEOUT})
  if(CPFILL_SANITIZE_TEST_ENV)
    set_tests_properties(${name} PROPERTIES ENVIRONMENT "${CPFILL_SANITIZE_TEST_ENV}")
  endif()
endfunction()

# cpfill_mpi_test(NAME SOURCES ... LIBS ... RANKS 2 3 4 [LABEL mpi]): one CTest per rank count,
# each started by mpirun and labelled with it too (np2, np4: tests/run_all.sh runs the np2 ones in
# the optimized build, the rest under the sanitizers). The binary provides its own main (MPI
# init, verdict agreed across ranks).
function(cpfill_mpi_test name)
  cmake_parse_arguments(T "" "TIMEOUT" "SOURCES;LIBS;RANKS;LABEL" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 600)
  endif()
  if(NOT T_LABEL)
    set(T_LABEL mpi)
  endif()
  add_executable(${name} ${T_SOURCES})
  target_link_libraries(${name} PRIVATE ${T_LIBS} GTest::gtest)
  cpfill_use_test_pch(${name})
  foreach(n IN LISTS T_RANKS)
    add_test(NAME ${name}_np${n}
             COMMAND ${MPIEXEC_EXECUTABLE} ${MPIEXEC_NUMPROC_FLAG} ${n} $<TARGET_FILE:${name}>)
    set_tests_properties(${name}_np${n} PROPERTIES LABELS "${T_LABEL};np${n}" TIMEOUT ${T_TIMEOUT}
                         ENVIRONMENT "${CPFILL_MPI_TEST_ENV}" PROCESSORS ${n})
  endforeach()
endfunction()
