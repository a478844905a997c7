"""jaxspec.model.cpu.attention: the cached-attention CPU kernel against float64 and XLA.

The decoders' exactness suites run through it too (decode steps on the CPU backend use
it by default; tests/test_cpu_matmul.py checks that a decode step calls it); here: its
arithmetic, the property that keeps a verify step exact (a
query's output depends neither on the other queries of the step nor on how many slots
past the ones it sees are read), and where it applies.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.model.cpu import attention as cpu_attention, matmul as cpu_matmul
from jaxspec.model.layers import NEG_INF

needs_kernel = pytest.mark.skipif(not cpu_matmul.kernel_available(),
                                reason='the kernel needs x86-64 with AVX2 + FMA and a C++ compiler')


def _all_queries(query, keys, values, bias, num_keys):
  """The kernel computing every query (as outside cpu_matmul.active_rows)."""
  return cpu_attention.kernel_attention(query, keys, values, bias, num_keys,
                                        cpu_attention.query_flags(query))


_kernel = jax.jit(_all_queries)


def _operands(batch, queries, heads, head_dim, slots, ends, bias_heads=None, seed=0):
  """Causal decode-step operands: row b's queries sit at positions ends[b] + 0..t-1 and
  see slots up to their own position; a relative-position-like bias on top."""
  rng = np.random.default_rng(seed)
  query = rng.standard_normal((batch, queries, heads, head_dim)).astype(np.float32) * 0.3
  keys = rng.standard_normal((batch, heads, head_dim, slots)).astype(np.float32)
  values = rng.standard_normal((batch, heads, head_dim, slots)).astype(np.float32)
  positions = np.asarray(ends)[:, None] + np.arange(queries)[None, :]  # [b, t]
  visible = np.arange(slots)[None, None, :] <= positions[:, :, None]  # [b, t, L]
  bias_heads = heads if bias_heads is None else bias_heads
  bias = rng.standard_normal((batch, bias_heads, queries, slots)).astype(np.float32)
  bias = bias + np.where(visible, 0.0, NEG_INF).astype(np.float32)[:, None]
  return query, keys, values, bias


def _float64_reference(query, keys, values, bias):
  logits = np.einsum('bthd,bhds->bhts', query.astype(np.float64), keys.astype(np.float64))
  logits = logits + bias.astype(np.float64)
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights = weights / weights.sum(-1, keepdims=True)
  return np.einsum('bhts,bhds->bthd', weights, values.astype(np.float64))


@needs_kernel
@pytest.mark.parametrize('batch,queries,heads,head_dim,slots,bias_heads', [
    (1, 1, 8, 64, 72, None),  # a draft step: one query, most slots past the prefix
    (2, 9, 8, 64, 72, None),  # a verify step, two rows at different positions
    (1, 3, 2, 20, 7, 1),  # head_dim past the last 16 dims; fewer slots than a vector
    (1, 32, 3, 6, 40, 1),  # the most queries; head_dim below a vector; one bias head
])
def test_kernel_matches_float64_attention(batch, queries, heads, head_dim, slots, bias_heads):
  ends = [min(slots - queries, 5 + 11 * b) for b in range(batch)]
  operands = _operands(batch, queries, heads, head_dim, slots, ends, bias_heads)
  num_keys = jnp.asarray(np.asarray(ends) + queries, jnp.int32)
  got = np.asarray(_kernel(*map(jnp.asarray, operands), num_keys))
  expected = _float64_reference(*operands)
  assert got.shape == (batch, queries, heads, head_dim)
  np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)
  xla = np.asarray(cpu_attention.xla_cached_attention(*map(jnp.asarray, operands)))
  np.testing.assert_allclose(got, xla, rtol=2e-5, atol=2e-5)


@needs_kernel
def test_a_query_is_bit_identical_whatever_shares_the_step_and_however_many_slots_are_read():
  """What keeps a verify step's attention equal to the one-position steps' attention."""
  batch, queries, slots = 2, 9, 72
  ends = np.asarray([12, 50])
  query, keys, values, bias = map(jnp.asarray, _operands(batch, queries, 8, 64, slots, ends))
  step = np.asarray(_kernel(query, keys, values, bias, jnp.asarray(ends + queries, jnp.int32)))
  for i in range(queries):
    # The query alone, as a one-position step at its position would compute it.
    alone = _kernel(query[:, i:i + 1], keys, values, bias[:, :, i:i + 1],
                    jnp.asarray(ends + i + 1, jnp.int32))
    np.testing.assert_array_equal(np.asarray(alone)[:, 0], step[:, i])
  for num_keys in (ends + queries + 1, ends + queries + 17, np.full(batch, slots)):
    np.testing.assert_array_equal(
        np.asarray(_kernel(query, keys, values, bias, jnp.asarray(num_keys, jnp.int32))), step)


@needs_kernel
def test_where_the_kernel_applies():
  query, keys, values, bias = map(jnp.asarray, _operands(1, 2, 4, 8, 16, [3]))
  assert cpu_attention.applies(query, keys, values, bias)
  assert cpu_attention.applies(query, keys, values, bias[:, :1])  # one bias head for all
  assert not cpu_attention.applies(query.astype(jnp.bfloat16), keys, values, bias)
  assert not cpu_attention.applies(query, keys[..., :8], values, bias)  # slots differ
  many = jnp.zeros((1, cpu_attention.MAX_QUERIES + 1, 4, 8), jnp.float32)
  many_bias = jnp.zeros((1, 4, cpu_attention.MAX_QUERIES + 1, 16))
  assert not cpu_attention.applies(many, keys, values, many_bias)
  with cpu_matmul.decode_step():  # a decoder step's attention, whatever its queries
    assert cpu_attention.applies(many, keys, values, many_bias)

  def traced(setting, q=query):
    return str(jax.make_jaxpr(lambda: cpu_attention.cached_attention(
        q, keys, values, bias, None, setting))())

  assert cpu_matmul.ATTENTION_TARGET_NAME in traced(cpu_matmul.KERNEL)
  assert cpu_matmul.ATTENTION_TARGET_NAME not in traced(cpu_matmul.XLA)
  assert cpu_matmul.ATTENTION_TARGET_NAME not in traced(cpu_matmul.KERNEL,
                                                        query.astype(jnp.bfloat16))
  # No num_keys: every slot is read.
  np.testing.assert_array_equal(
      np.asarray(cpu_attention.cached_attention(query, keys, values, bias)),
      np.asarray(_kernel(query, keys, values, bias, jnp.asarray([16], jnp.int32))))


@needs_kernel
def test_no_slots_gives_zeros_and_gradients_match_xla():
  query, keys, values, bias = map(jnp.asarray, _operands(1, 2, 4, 8, 16, [3]))
  np.testing.assert_array_equal(
      np.asarray(_kernel(query, keys, values, bias, jnp.asarray([0], jnp.int32))), 0.0)

  def loss(attention):
    return lambda q, k, v: jnp.sum(jnp.sin(attention(q, k, v)))

  kernel_grads = jax.grad(loss(lambda q, k, v: cpu_attention.cached_attention(
      q, k, v, bias, jnp.asarray([5], jnp.int32))), argnums=(0, 1, 2))(query, keys, values)
  xla_grads = jax.grad(loss(lambda q, k, v: cpu_attention.xla_cached_attention(
      q, k, v, bias)), argnums=(0, 1, 2))(query, keys, values)
  for got, expected in zip(kernel_grads, xla_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


# The self-attention with its cache write (attend_and_write), as a decode step calls it.

def _write_operands(starts, queries=9, slots=24, batch=2, seed=4):
  rng = np.random.default_rng(seed)
  query, keys, values, bias = _operands(batch, queries, 4, 20, slots, starts, seed=seed)
  new_keys, new_values = (rng.standard_normal(query.shape).astype(np.float32) for _ in 'kv')
  return tuple(map(jnp.asarray, (query, new_keys, new_values, keys, values, bias)))


@needs_kernel
@pytest.mark.parametrize('starts', [[0, 7], [15, 3], [20, 0]])  # [20, 0]: row 0 runs past
def test_attend_and_write_equals_the_write_then_the_attention(starts):
  """Its buffers are cache.write_all's bit for bit (writes past the buffer dropped, rows
  at their own starts), and its attention is the attention kernel's over them."""
  operands = _write_operands(starts)
  starts = jnp.asarray(starts, jnp.int32)
  out, keys, values = jax.jit(cpu_attention.kernel_attend_and_write)(
      *operands, starts, cpu_attention.query_flags(operands[0]))
  xla_out, xla_keys, xla_values = cpu_attention.xla_attend_and_write(*operands, starts)
  np.testing.assert_array_equal(np.asarray(keys), np.asarray(xla_keys))
  np.testing.assert_array_equal(np.asarray(values), np.asarray(xla_values))
  query, bias = operands[0], operands[5]
  np.testing.assert_array_equal(
      np.asarray(out), np.asarray(_kernel(query, xla_keys, xla_values, bias,
                                          starts + query.shape[1])))
  np.testing.assert_allclose(np.asarray(out), np.asarray(xla_out), rtol=2e-5, atol=2e-5)


@needs_kernel
def test_attend_and_write_updates_the_cache_in_place_in_a_loop_and_differentiates_like_xla():
  """A loop that writes a position a step copies no cache buffer (the conditional write
  held copies of both in its branches), and its derivatives are XLA's."""
  import re
  query, new_keys, new_values, keys, values, bias = _write_operands([0], queries=1, batch=1)
  slots = keys.shape[3]

  def step(carry, position):
    keys, values = carry
    out, keys, values = cpu_attention.attend_and_write(
        query, new_keys + position, new_values, keys, values, bias, position[None])
    return (keys, values), jnp.sum(out)

  program = jax.jit(lambda k, v: jax.lax.scan(step, (k, v), jnp.arange(5, dtype=jnp.int32)))
  text = program.lower(keys, values).compile().as_text()
  buffer = r'f32\[1,4,20,%d\]' % slots
  assert not re.findall(buffer + r'[^\n]*\bcopy\(', text.split('ENTRY')[0])
  (written, _), _ = program(keys, values)
  steps = np.arange(5, dtype=np.float32)[:, None, None]  # [position, h, d]
  np.testing.assert_array_equal(np.asarray(written)[0, :, :, :5],
                                np.moveaxis(np.asarray(new_keys)[0, 0][None] + steps, 0, -1))

  def loss(attend):
    return lambda q, k, v: sum(jnp.sum(jnp.sin(y)) for y in attend(
        q, new_keys, new_values, k, v, bias, jnp.asarray([3], jnp.int32)))

  kernel_grads = jax.grad(loss(cpu_attention.attend_and_write), argnums=(0, 1, 2))(
      query, keys, values)
  xla_grads = jax.grad(loss(cpu_attention.xla_attend_and_write), argnums=(0, 1, 2))(
      query, keys, values)
  for got, expected in zip(kernel_grads, xla_grads):
    np.testing.assert_allclose(np.asarray(got), np.asarray(expected), rtol=1e-5, atol=1e-6)


@needs_kernel
@pytest.mark.parametrize('active', [
    [True, False, True],  # per batch row: row 1 has ended
    [[True, True, False, False], [False] * 4, [True, False, False, False]],  # per position
])
def test_active_rows_skip_the_queries_left_out_and_leave_the_others_bit_identical(active):
  """Within cpu_matmul.active_rows the queries of rows (or positions) left out get zeros,
  as the products' rows there; every other query is the all-queries kernel's bit for
  bit, and attend_and_write writes the kept queries' keys/values only (the others'
  slots keep what they held)."""
  active = jnp.asarray(active)
  starts = [5, 11, 2]
  query, new_keys, new_values, keys, values, bias = _write_operands(starts, queries=4,
                                                                    batch=3)
  starts = jnp.asarray(starts, jnp.int32)
  shown = np.broadcast_to(np.asarray(active).reshape(3, -1), (3, 4))[:, :, None, None]
  num_keys = starts + query.shape[1]

  def skipping(fn):
    def run(*operands):
      with cpu_matmul.active_rows(active):
        return fn(*operands)
    return jax.jit(run)

  got = skipping(cpu_attention.cached_attention)(query, keys, values, bias, num_keys)
  every = _kernel(query, keys, values, bias, num_keys)
  np.testing.assert_array_equal(np.asarray(got), np.where(shown, np.asarray(every), 0.0))

  out, written_keys, written_values = skipping(cpu_attention.attend_and_write)(
      query, new_keys, new_values, keys, values, bias, starts)
  every_out, every_keys, every_values = jax.jit(cpu_attention.attend_and_write)(
      query, new_keys, new_values, keys, values, bias, starts)
  np.testing.assert_array_equal(np.asarray(out), np.where(shown, np.asarray(every_out), 0.0))
  slot_shown = np.zeros((3, 1, 1, keys.shape[3]), bool)  # [b, h, d, L]: slots kept
  for b in range(3):
    for i in range(4):
      slot_shown[b, 0, 0, int(starts[b]) + i] = shown[b, i, 0, 0]
  for written, every_written, old in ((written_keys, every_keys, keys),
                                      (written_values, every_values, values)):
    np.testing.assert_array_equal(
        np.asarray(written), np.where(slot_shown, np.asarray(every_written), np.asarray(old)))


@needs_kernel
def test_active_flags_of_the_wrong_size_are_refused():
  query, keys, values, bias = map(jnp.asarray, _operands(2, 3, 4, 8, 16, [3, 5]))
  with pytest.raises(Exception, match='active must hold one flag per query'):
    jax.block_until_ready(cpu_attention.kernel_attention(
        query, keys, values, bias, jnp.asarray([6, 8], jnp.int32), jnp.ones((2,), jnp.int32)))
