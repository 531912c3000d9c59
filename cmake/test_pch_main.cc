// The target that compiles the tests' precompiled header (CpfillTesting.cmake); never run.
int main() { return 0; }
