"""jaxspec.model.cache.write against a numpy reference, and its in-place update in a loop."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model import cache


def reference_write(buffer, new, positions):
  """numpy: buffer [b, h, d, L], new [b, t, h, d] at positions [b, t]; past L dropped."""
  out = np.array(buffer)
  for b in range(positions.shape[0]):
    for j, position in enumerate(positions[b]):
      if position < out.shape[3]:
        out[b, :, :, position] = new[b, j]
  return out


@pytest.mark.parametrize('batch, starts, length', [
    (1, [0], 3), (1, [5], 3), (1, [7], 3), (1, [9], 3), (1, [10], 1),
    (2, [2, 8], 3), (3, [0, 4, 9], 2)])
def test_write_matches_reference(batch, starts, length):
  """In range, partly past the end (dropped, not clamped) and wholly past it; one row
  (the dynamic-update-slice path) and several (the scatter)."""
  rng = np.random.default_rng(0)
  buffer = rng.normal(size=(batch, 2, 4, 10)).astype(np.float32)
  new = rng.normal(size=(batch, length, 2, 4)).astype(np.float32)
  positions = np.array(starts, np.int32)[:, None] + np.arange(length, dtype=np.int32)
  written = jax.jit(cache.write)(buffer, new, positions)
  np.testing.assert_array_equal(written, reference_write(buffer, new, positions))


def test_one_row_write_is_in_place_in_a_loop():
  """A scan that reads the buffer, then writes one position a step where the write
  depends on what was read (as jaxspec.model.cpu.attention.xla_attend_and_write orders
  its writes), updates the carried buffer in place: the compiled loop body copies no
  buffer-sized array (a scatter, or a conditional choosing one, copied every cache
  buffer whole at every step)."""
  buffer = jnp.zeros((1, 8, 64, 69), jnp.float32)

  def step(carry, position):
    read = jnp.sum(carry[..., :4])
    new = jnp.full((1, 1, 8, 64), position, jnp.float32)
    carry = cache.write(carry, new, jnp.where(read == read, position, 69)[None, None])
    return carry, read

  program = jax.jit(lambda b: jax.lax.scan(step, b, jnp.arange(5, dtype=jnp.int32)))
  text = program.lower(buffer).compile().as_text()
  body_names = re.findall(r'body=%?([\w.\-]+)', text)
  assert body_names, 'no while loop in the compiled program'
  computations = {m.group(1): m.group(2) for m in re.finditer(
      r'^%?([\w.\-]+) [^\n]*\{\n(.*?)^\}', text, re.M | re.S)}
  for name in body_names:
    copies = re.findall(r'f32\[1,8,64,69\][^\n]*\bcopy\(', computations[name])
    assert not copies, (name, copies)
  written, _ = program(buffer)
  np.testing.assert_array_equal(np.asarray(written)[0, 0, 0, :6], [0, 1, 2, 3, 4, 0])
