// Compiled only to build the libraries' precompiled header (CpfillLibraryPch.cmake); nothing
// links it.
