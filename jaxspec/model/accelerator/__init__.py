"""Accelerator pieces of the model, where XLA computes a decode step (GPU, TPU, or the CPU
with T5Config.cpu_matmul = 'xla'): the fused decode layout (few, larger products per
step) and the attention through jax.nn.dot_product_attention (a fused kernel where the
platform has one)."""
