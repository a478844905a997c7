"""jaxspec.prng against jax.random (draw for draw) and threefry's published test vectors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import prng

# Threefry-2x32, 20 rounds: (key, counter) -> output words, from the Random123 suite's
# known-answer vectors (Salmon et al. 2011).
KNOWN_ANSWERS = [
    ((0x00000000, 0x00000000), (0x00000000, 0x00000000), (0x6b200159, 0x99ba4efe)),
    ((0xffffffff, 0xffffffff), (0xffffffff, 0xffffffff), (0x1cb996fc, 0xbb002be7)),
    ((0x13198a2e, 0x03707344), (0x243f6a88, 0x85a308d3), (0xc4923a9c, 0x483df7a0)),
]


@pytest.mark.parametrize('key, counter, expected', KNOWN_ANSWERS)
def test_threefry2x32_known_answers(key, counter, expected):
  words = prng.threefry2x32(jnp.array(key, jnp.uint32), jnp.uint32(counter[0]),
                            jnp.uint32(counter[1]))
  assert tuple(int(w) for w in words) == expected


SHAPES = [(), (1,), (7,), (8000,), (1, 8000), (3, 5, 17)]


@pytest.mark.parametrize('shape', SHAPES)
def test_bits_and_gumbel_equal_jax_random(shape):
  gumbel = jax.jit(lambda k: prng.gumbel(k, shape))  # one compile for every seed
  for seed in (0, 1, 2**31 - 1, 987654321):
    key = jax.random.PRNGKey(seed)
    np.testing.assert_array_equal(prng.bits(key, shape), jax.random.bits(key, shape))
    np.testing.assert_array_equal(gumbel(key), jax.random.gumbel(key, shape))


def test_gumbel_equals_jax_random_under_vmap():
  keys = jax.random.split(jax.random.PRNGKey(11), 5)  # [5, 2]
  np.testing.assert_array_equal(
      jax.jit(jax.vmap(lambda k: prng.gumbel(k, (2, 300))))(keys),
      jax.vmap(lambda k: jax.random.gumbel(k, (2, 300)))(keys))


def test_gumbel_noise_is_finite_and_gumbel_distributed():
  noise = np.asarray(prng.gumbel(jax.random.PRNGKey(5), (200_000,)))
  assert np.all(np.isfinite(noise))
  # Gumbel(0, 1): mean Euler-Mascheroni, variance pi^2 / 6 (standard errors ~0.003).
  np.testing.assert_allclose(noise.mean(), np.euler_gamma, atol=0.015)
  np.testing.assert_allclose(noise.var(), np.pi**2 / 6, atol=0.04)


@pytest.mark.parametrize('case', ['typed_key', 'bfloat16', 'not_partitionable'])
def test_other_keys_and_dtypes_fall_back_to_jax_random(case):
  key, dtype = jax.random.PRNGKey(3), jnp.float32
  if case == 'typed_key':
    key = jax.random.key(3)
  if case == 'bfloat16':
    dtype = jnp.bfloat16
  flag = jax.config.jax_threefry_partitionable
  try:
    if case == 'not_partitionable':
      jax.config.update('jax_threefry_partitionable', False)
    noise = prng.gumbel(key, (4, 9), dtype)
    np.testing.assert_array_equal(noise, jax.random.gumbel(key, (4, 9), dtype))
    assert noise.dtype == dtype
  finally:
    jax.config.update('jax_threefry_partitionable', flag)
