# Read by ctest, not CMake: tests/CMakeLists.txt names this file in TEST_INCLUDE_FILES, so
# tests/CTestTestfile.cmake includes it, after the CTestTestfile.cmake files of the modules
# added before tests/ (the top-level CMakeLists.txt adds parallel/ first). It sets how tests
# registered in those modules report a skip; CMake 3.25 cannot set another directory's test
# properties at configure time (set_tests_properties gained DIRECTORY in 3.28).
#
# A skip must show as "Skipped", not "Passed": tests/run_all.sh then fails on any skip outside
# the gpu and multigpu labels (tests/ctest_skips.py).

# parallel/ucx_transport_test: GTEST_SKIP for a transport set this machine lacks (sm,self; tcp
# never skips), a UCX without thread support, or a UCX that registers CUDA memory. Any skipped
# case marks the whole test skipped; its output names the case and why.
set_tests_properties(ucx_transport_test PROPERTIES SKIP_REGULAR_EXPRESSION "\\[  SKIPPED \\]")
