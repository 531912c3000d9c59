# Included by parallel/CMakeLists.txt. The selector is pure arithmetic (no MPI), so
# `cpfill select` and its tests build without the communication stack.
add_library(cpfill_selector selector.cc)
cpfill_use_library_pch(cpfill_selector)
target_link_libraries(cpfill_selector PUBLIC cpfill_base PRIVATE absl::str_format)

if(CPFILL_BUILD_TESTS)
  cpfill_test(selector_test SOURCES selector_test.cc LIBS cpfill_selector)
endif()
