"""The native CPU backend: C kernels compiled on the machine that runs them (csrc/), the
builder that compiles and caches them (build.py), and one ctypes wrapper per kernel."""
