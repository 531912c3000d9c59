# One precompiled header for every C++ library source: the standard library, Abseil's status and
# strings, nlohmann-json. Parsing them was about 3 s of each library source's compile, in the
# optimized and in the sanitized build alike (attention.cc 5.4 s to 3.3 s, engine.cc 16.0 to
# 13.4). It is compiled once, by an object library that nothing links, with the libraries' flags
# (-fPIC, the sanitizers) and no definitions of its own: gcc refuses a header built with a macro
# that a source lacks and accepts sources that define more (CPFILL_HAVE_CUDA, cpp-httplib's).
# -Winvalid-pch warns if a source ever stops matching it and falls back to the headers. Tests and
# executables (-fPIE) have their own (CpfillTesting.cmake).
add_library(cpfill_library_pch OBJECT ${CMAKE_CURRENT_LIST_DIR}/library_pch.cc)
target_link_libraries(cpfill_library_pch PRIVATE absl::status absl::statusor absl::strings
                      absl::str_format nlohmann_json::nlohmann_json)
target_precompile_headers(cpfill_library_pch PRIVATE
                          <algorithm> <atomic> <chrono> <cmath> <cstdint> <cstdio> <cstring>
                          <functional> <limits> <map> <memory> <mutex> <optional> <random>
                          <span> <string> <string_view> <thread> <utility> <vector>
                          <absl/status/status.h> <absl/status/statusor.h>
                          <absl/strings/str_cat.h> <absl/strings/str_format.h>
                          <nlohmann/json.hpp>)
target_compile_options(cpfill_library_pch PRIVATE -Winvalid-pch)

# cpfill_use_library_pch(target...): the C++ sources of each library start from it.
function(cpfill_use_library_pch)
  foreach(target IN LISTS ARGN)
    target_precompile_headers(${target} REUSE_FROM cpfill_library_pch)
    target_compile_options(${target} PRIVATE $<$<COMPILE_LANGUAGE:CXX>:-Winvalid-pch>)
  endforeach()
endfunction()
