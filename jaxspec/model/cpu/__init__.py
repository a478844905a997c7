"""CPU-only pieces of the model: the few-row matmul and cached-attention kernels (C++ XLA
FFI handlers built on first use from kernels/) and the transposed kernel layout they
read. Inert on TPU/GPU: every entry point checks the backend and falls back to XLA."""
