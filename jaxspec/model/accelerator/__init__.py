"""Accelerator pieces of the model, where XLA computes a decode step (GPU, TPU, or the CPU
with T5Config.cpu_matmul = 'xla'): the fused decode layout (few, larger products per
step)."""
