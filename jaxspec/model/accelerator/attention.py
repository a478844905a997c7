"""A decode step's attention through jax.nn.dot_product_attention
(T5Config.decode_attention = 'dot_product_attention').

jaxspec's own attention where XLA computes it is two products with a softmax between
them (jaxspec.model.cpu.attention's XLA path), several kernels a layer on a GPU. Here
the same attention goes to jax.nn.dot_product_attention, which runs cuDNN's fused kernel
on NVIDIA GPUs in bfloat16 or float16 (`implementation`: one kernel for the logits, the
bias, the softmax and the weighted sum) and JAX's own choice elsewhere (XLA's operations
today, the same arithmetic as jaxspec's). T5's relative position bias and every mask go
in as one additive bias [b, h, t, s]; no 1/sqrt(d) scaling (T5 folds it into the query
initializer).

  cached_attention(query, keys, values, bias)
      query [b, t, h, d] against keys/values in the cache layout [b, h, d, s] -> [b, t, h, d]
  attend_and_write(query, new_keys, new_values, keys, values, bias, starts, keys_in_slots)
      a decode step's self-attention and its cache write, as
      jaxspec.model.cpu.attention.xla_attend_and_write orders them (the write last, or
      first with keys_in_slots, so XLA updates the buffers in place) -> (out, keys, values)

Exactness: both decoders of a speculative run use the target's setting, so with
fixed-width steps (T5Config.decode_positions) every target step has the same shapes in
both and greedy outputs stay the baseline's (tests/test_accelerator_layout.py); against
jaxspec's einsums the results differ by rounding (cuDNN sums in its own order, and
takes the bias in the compute dtype).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.model import cache as cache_lib
from jaxspec.model.cpu import attention as cpu_attention

CUDNN = 'cudnn'
# cuDNN's fused attention: half-precision operands, a head dimension it tiles.
CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
CUDNN_MAX_HEAD_DIM = 128


def on_nvidia_gpu() -> bool:
  """Whether JAX's default device is an NVIDIA GPU (cuDNN's platform)."""
  device = jax.devices()[0]
  return device.platform == 'gpu' and device.device_kind.lower().startswith('nvidia')


def implementation(dtype, head_dim: int, nvidia_gpu: bool | None = None) -> str | None:
  """jax.nn.dot_product_attention's implementation for operands of `dtype` and heads of
  `head_dim`: 'cudnn' where cuDNN's fused kernel takes them (an NVIDIA GPU, bfloat16 or
  float16, head_dim a multiple of 8 up to 128), else None (JAX chooses: XLA's)."""
  nvidia_gpu = on_nvidia_gpu() if nvidia_gpu is None else nvidia_gpu
  if (nvidia_gpu and jnp.dtype(dtype) in CUDNN_DTYPES and head_dim % 8 == 0
      and head_dim <= CUDNN_MAX_HEAD_DIM):
    return CUDNN
  return None


def _sequence_major(cached):
  """Keys or values in the cache layout [b, h, d, s] -> [b, s, h, d]."""
  return jnp.transpose(cached, (0, 3, 1, 2))


def attend(query, keys, values, bias):
  """query [b, t, h, d] against keys/values [b, s, h, d] with the additive bias
  [b, h|1, t, s] -> [b, t, h, d], through jax.nn.dot_product_attention."""
  batch, queries, heads, head_dim = query.shape
  chosen = implementation(query.dtype, head_dim)
  bias = jnp.broadcast_to(bias, (batch, heads, queries, keys.shape[1]))  # [b, h, t, s]
  if chosen == CUDNN:
    bias = bias.astype(query.dtype)
  return jax.nn.dot_product_attention(
      query, keys.astype(query.dtype), values.astype(query.dtype), bias, scale=1.0,
      implementation=chosen).astype(values.dtype)


def cached_attention(query, keys, values, bias):
  """query [b, t, h, d] against keys/values [b, h, d, s] (the cache layout) with bias
  [b, h|1, t, s] -> [b, t, h, d] (a decode step's cross-attention)."""
  return attend(query, _sequence_major(keys), _sequence_major(values), bias)


def attend_and_write(query, new_keys, new_values, keys, values, bias, starts,
                     keys_in_slots: bool = False):
  """query [b, t, h, d] with the step's keys/values [b, t, h, d] written into keys/values
  [b, h, d, L] at slots starts[b] + 0..t-1 (dropped past L), attending with bias
  [b, h|1, t, L] -> (out [b, t, h, d], keys, values).

  keys_in_slots (fixed-width steps): the write first, then one attention over the L
  written slots, every key at its own slot whichever step brought it. Otherwise the
  attention over the cache as it was (its slots from starts[b] on masked) and the
  step's own keys, then the write, made to depend on the output (XLA then writes the
  buffers in place; jaxspec.model.cpu.attention.write_after)."""
  starts = jnp.asarray(starts, jnp.int32)
  steps = query.shape[1]
  new_keys, new_values = new_keys.astype(keys.dtype), new_values.astype(values.dtype)
  slots = starts[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [b, t]
  if keys_in_slots:
    keys, values = cache_lib.write_all((keys, values), (new_keys, new_values), slots)
    return cached_attention(query, keys, values, bias), keys, values
  cached_bias, new_bias = cpu_attention.step_biases(bias, starts, slots)
  out = attend(query,
               jnp.concatenate([_sequence_major(keys), new_keys], axis=1),  # [b, L + t, h, d]
               jnp.concatenate([_sequence_major(values), new_values], axis=1),
               jnp.concatenate([cached_bias, new_bias], axis=3))  # [b, h|1, t, L + t]
  return (out,) + cpu_attention.write_after(out, keys, values, new_keys, new_values, slots)
