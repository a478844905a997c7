"""jax.random's Gumbel draws, bit for bit, with the threefry rounds unrolled.

Every sampled token (the baseline's, each draft's, the verdict's residual and bonus
draws) adds Gumbel noise over the whole vocabulary. JAX lowers its threefry2x32 hash
on CPU as a rolled loop of five iterations, which XLA:CPU runs as separate passes over
the counters: ~55 us for 8000 draws on one core, against ~14 us for the same twenty
rounds written out, which XLA fuses into one pass (every platform but CPU gets the
unrolled form from JAX already). `gumbel` computes jax.random.gumbel's values exactly
(the same counters, rounds, key schedule and float conversion), so no draw changes.

It covers the case jaxspec decodes with: a raw uint32 [2] threefry key (jax.random.PRNGKey,
or one row of a vmapped batch of them), jax_threefry_partitionable on (JAX's default),
float32 noise, fewer than 2**32 draws. Anything else is handed to jax.random.gumbel.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

# Rotation distances of threefry2x32's rounds, alternating every four rounds.
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_KEY_SCHEDULE_PARITY = np.uint32(0x1BD11BDA)
_FLOAT32_ONE_BITS = np.uint32(0x3F800000)
_FLOAT32_MANTISSA_BITS = 23


def _rotate_left(x, distance: int):
  return (x << np.uint32(distance)) | (x >> np.uint32(32 - distance))


def threefry2x32(key, high, low):
  """Threefry-2x32 with 20 rounds (Salmon et al. 2011) of the counter words high, low
  [...] uint32 under key [2] uint32 -> the two hashed words, each [...] uint32."""
  schedule = (key[0], key[1], key[0] ^ key[1] ^ _KEY_SCHEDULE_PARITY)
  x0, x1 = high + schedule[0], low + schedule[1]
  for block in range(5):
    for distance in _ROTATIONS[block % 2]:
      x0 = x0 + x1
      x1 = _rotate_left(x1, distance) ^ x0
    x0 = x0 + schedule[(block + 1) % 3]
    x1 = x1 + schedule[(block + 2) % 3] + np.uint32(block + 1)
  return x0, x1


def _fast_path(key, shape, dtype) -> bool:
  key = jnp.asarray(key)
  return (jax.config.jax_threefry_partitionable
          and jax.config.jax_default_prng_impl == 'threefry2x32'
          and key.dtype == jnp.uint32 and key.shape == (2,)
          and jnp.dtype(dtype) == jnp.float32 and math.prod(shape) < 2**32)


def bits(key, shape):
  """jax.random.bits(key, shape) [shape] uint32 for a raw threefry key [2] with
  jax_threefry_partitionable: counter n is the row-major position (high word 0 below
  2**32 draws), the two hashed words XORed."""
  position = jax.lax.iota(jnp.uint32, math.prod(shape)).reshape(shape)
  high, low = threefry2x32(key, jnp.zeros_like(position), position)
  return high ^ low


def _uniform(key, shape, minval, maxval):
  """jax.random.uniform(key, shape, float32, minval, maxval): 23 random mantissa bits
  under exponent 0 give [1, 2), shifted and scaled, clipped below at minval."""
  minval, maxval = np.float32(minval), np.float32(maxval)
  mantissas = bits(key, shape) >> np.uint32(32 - _FLOAT32_MANTISSA_BITS)
  unit = jax.lax.bitcast_convert_type(mantissas | _FLOAT32_ONE_BITS, jnp.float32)
  return jnp.maximum(minval, (unit - np.float32(1.0)) * (maxval - minval) + minval)


def gumbel(key, shape, dtype=jnp.float32):
  """jax.random.gumbel(key, shape, dtype) [shape], draw for draw: -log(-log(u)) of
  uniform u in [tiny, 1)."""
  shape = tuple(shape)
  if not _fast_path(key, shape, dtype):
    return jax.random.gumbel(key, shape, dtype)
  tiny = np.finfo(np.float32).tiny
  return -jnp.log(-jnp.log(_uniform(key, shape, tiny, 1.0)))
