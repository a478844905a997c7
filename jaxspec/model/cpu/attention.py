"""jaxspec's CPU kernel for a decode step's attention over the cache.

A decode step attends over the whole cache buffer (max_decode_length + gamma slots) with
one dot, a softmax and a second dot per attention; on the 2-core CPU each costs 10-30 us,
mostly on slots past the decoded prefix and on per-operation overhead, as much as one of
the draft's int8 weight products. `cpu_kernels/cached_attention.cc` (built into the
library of jaxspec.model.cpu.matmul) computes an attention in one call over the first
`num_keys[b]` slots of each row only.

  cached_attention(query, keys, values, bias, num_keys, cpu_matmul)
      query [b, t, h, d] against keys/values [b, h, d, L] (the cache layout) with the
      additive bias [b, h|1, t, L] -> [b, t, h, d]: the kernel where it applies, else
      XLA (`xla_cached_attention`); a decode step's cross-attention
  attend_and_write(query, new_keys, new_values, keys, values, bias, starts, cpu_matmul)
      a decode step's self-attention with its cache write: the step's keys/values
      [b, t, h, d] written at slots starts[b] + 0..t-1 (dropped past the buffer), then
      attended over the first starts[b] + t slots -> (out, keys, values). The kernel
      writes the buffers in place (its results alias them), where the conditional write
      of jaxspec.model.cache.write_all held copies of both in the compiled loop; else
      XLA: write_all, then xla_cached_attention

Within cpu_matmul.active_rows (the decoders' rows that ended, the verify step's positions
past a row's proposal) the kernel skips the queries left out, as the products skip their
rows: their outputs are zeros, their keys/values (from products that skipped them) are
not written, and the other queries' (row, head) pairs are shared among the threads, so a
batch whose rows ended attends at the cost of the rows still decoding. A query left out
must never be attended by one kept (the decoders leave out whole rows, or a row's
positions past its last kept one).

Where it applies: float32 operands, at most MAX_QUERIES queries a batch row (any number
within a decoder step, cpu_matmul.decode_step), the CPU backend with the kernel built, and `T5Config.cpu_matmul == 'kernel'` (the setting that routes a
decode step's products through the few-row kernel routes its attention here too).

Exactness: a query's output depends on its own logits only, summed lane by lane in a
fixed order, and slots its bias masks weigh exactly 0; so a query of a k-query verify
step equals the same query in a one-query step bit for bit, for any num_keys that
covers the slots it sees. Against XLA's softmax the results differ by float32 rounding
(its exponential is a polynomial accurate to ~2e-7; tests/test_cpu_attention.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxspec.model import cache as cache_lib
from jaxspec.model.cpu import matmul as cpu_matmul

NEG_INF = -1e10  # The additive bias of a masked slot, as T5X's.

# Queries a batch row routed to the kernel outside a decoder step; within one
# (cpu_matmul.decode_step) any number, so a verify step of any width attends as the
# one-position steps do.
MAX_QUERIES = cpu_matmul.MAX_ROWS


def xla_cached_attention(query, keys, values, bias):
  """query [b,t,h,d] against keys/values [b,h,d,s] with bias [b,h|1,t,s] -> [b,t,h,d].

  No 1/sqrt(d) scaling: T5 folds it into the query initializer.
  """
  logits = jnp.einsum('bthd,bhds->bhts', query, keys,
                      preferred_element_type=jnp.float32)  # [b, h, t, s]
  weights = jax.nn.softmax(logits + bias, axis=-1).astype(values.dtype)
  return jnp.einsum('bhts,bhds->bthd', weights, values)


def applies(query, keys, values, bias) -> bool:
  """Whether the kernel can compute this attention (shapes and dtypes)."""
  if query.ndim != 4 or keys.ndim != 4 or bias.ndim != 4:
    return False
  batch, queries, heads, head_dim = query.shape
  slots = keys.shape[3]
  return (all(x.dtype == jnp.float32 for x in (query, keys, values, bias))
          and cpu_matmul.kernel_takes(queries)
          and keys.shape == (batch, heads, head_dim, slots) and values.shape == keys.shape
          and bias.shape in ((batch, heads, queries, slots), (batch, 1, queries, slots)))


def query_flags(query):
  """int32 [b * t]: which queries of query [b, t, h, d] the kernel computes: those of the
  rows (or positions) that cpu_matmul.active_rows leaves in, all of them outside it."""
  return cpu_matmul.flags_of(query.shape[:2])


def _ffi_attention(query, keys, values, bias, num_keys, active):
  return jax.ffi.ffi_call(cpu_matmul.ATTENTION_TARGET_NAME,
                          jax.ShapeDtypeStruct(query.shape, jnp.float32),
                          vmap_method='sequential')(query, keys, values, bias, num_keys,
                                                    active)


@jax.custom_jvp
def kernel_attention(query, keys, values, bias, num_keys, active):
  """The attention through the kernel (applies(...)); num_keys [b] int32 slots per row,
  active [b * t] int32 (query_flags): the queries computed, the others zeros."""
  return _ffi_attention(query, keys, values, bias, num_keys, active)


@kernel_attention.defjvp
def _kernel_attention_jvp(primals, tangents):
  query, keys, values, bias, num_keys, active = primals
  _, tangent_out = jax.jvp(xla_cached_attention, (query, keys, values, bias), tangents[:4])
  return kernel_attention(query, keys, values, bias, num_keys, active), tangent_out


def cached_attention(query, keys, values, bias, num_keys=None,
                     cpu_matmul_setting: str = cpu_matmul.KERNEL):
  """query [b,t,h,d] against keys/values [b,h,d,s] with bias [b,h|1,t,s] -> [b,t,h,d].

  num_keys [b] int32: the slots each row's queries may see are among its first
  num_keys[b] (None: all s); every slot past them must be masked in `bias` for each
  query. The kernel reads only those slots; XLA reads all of them (same result up to
  float32 rounding). Within cpu_matmul.active_rows the kernel skips the queries of rows
  (or positions) left out, whose outputs are zeros, as the products' rows there.
  """
  if applies(query, keys, values, bias) and cpu_matmul.use_kernel(cpu_matmul_setting):
    if num_keys is None:
      num_keys = jnp.full((query.shape[0],), keys.shape[3], jnp.int32)
    return kernel_attention(query, keys, values, bias, jnp.asarray(num_keys, jnp.int32),
                            query_flags(query))
  return xla_cached_attention(query, keys, values, bias)


def xla_attend_and_write(query, new_keys, new_values, keys, values, bias, starts,
                         keys_in_slots: bool = False):
  """attend_and_write through XLA: the queries attend over the cache as it was (its
  slots from starts[b] on masked) and over the step's own keys/values, then the
  step's keys/values are written (cache.write_all) as the buffers' last use in the step,
  so XLA updates them in place; the cached slots and the step's own keys are summed in
  products of their own.

  keys_in_slots: the step's keys/values are written first and the queries attend over
  the written buffers, one product over the L slots, so every key is summed in its slot's
  place whichever step brought it. The write is the old buffers' last use and the
  products read the new ones, so XLA writes in place and copies nothing; a select of the
  step's keys into a copy of each buffer, read before the write, cost a copy of both
  buffers per layer and step, which grows with the cache's length."""
  steps, length = query.shape[1], keys.shape[3]
  new_keys, new_values = new_keys.astype(keys.dtype), new_values.astype(values.dtype)
  slots = starts[:, None] + jnp.arange(steps, dtype=jnp.int32)[None, :]  # [b, t]
  if keys_in_slots:
    keys, values = cache_lib.write_all((keys, values), (new_keys, new_values), slots)
    logits = jnp.einsum('bthd,bhds->bhts', query, keys,
                        preferred_element_type=jnp.float32) + bias  # [b, h, t, L]
    weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
    out = jnp.einsum('bhts,bhds->bthd', weights, values,
                     preferred_element_type=jnp.float32).astype(values.dtype)
    return out, keys, values
  cached_bias, new_bias = step_biases(bias, starts, slots)
  logits = jnp.concatenate([
      jnp.einsum('bthd,bhds->bhts', query, keys, preferred_element_type=jnp.float32)
      + cached_bias,
      jnp.einsum('bthd,bshd->bhts', query, new_keys, preferred_element_type=jnp.float32)
      + new_bias], axis=3)  # [b, h, t, L + t]
  weights = jax.nn.softmax(logits, axis=-1).astype(values.dtype)
  # Both parts summed in float32 and rounded once, as one product over all slots would.
  out = (jnp.einsum('bhts,bhds->bthd', weights[..., :length], values,
                    preferred_element_type=jnp.float32)
         + jnp.einsum('bhts,bshd->bthd', weights[..., length:], new_values,
                      preferred_element_type=jnp.float32)).astype(values.dtype)
  return (out,) + write_after(out, keys, values, new_keys, new_values, slots)


def step_biases(bias, starts, slots):
  """A step's bias [b, h|1, t, L] split for attending over the cache as it was and over
  the step's own keys: (cached_bias [b, h|1, t, L], the slots from starts[b] on masked;
  new_bias [b, h|1, t, t], the bias at the step's own slots [b, t], NEG_INF past the
  buffer, where their writes are dropped)."""
  length, steps = bias.shape[3], slots.shape[1]
  cached = jnp.arange(length, dtype=jnp.int32)[None, :] < starts[:, None]  # [b, L]
  cached_bias = jnp.where(cached[:, None, None, :], bias, NEG_INF)  # [b, h|1, t, L]
  new_bias = jnp.take_along_axis(
      bias, jnp.broadcast_to(slots[:, None, None, :], bias.shape[:3] + (steps,)), axis=3,
      mode='fill', fill_value=NEG_INF)  # [b, h|1, t, t]
  return cached_bias, new_bias


def write_after(out, keys, values, new_keys, new_values, slots):
  """(keys, values) [b,h,d,L] with new_keys/new_values [b,t,h,d] written at slots [b, t],
  the write made to depend on the attention's output `out`: XLA updates the buffers in
  place only where it sees every read of them ordered before the write, and a write
  whose operands did not depend on the reads made it copy both buffers whole at every
  step. The slots are dropped past the buffer if `out` is NaN, never otherwise."""
  read = jnp.sum(out)
  slots = jnp.where(read == read, slots, keys.shape[3])
  return cache_lib.write_all((keys, values), (new_keys, new_values), slots)


def applies_write(query, new_keys, new_values, keys, values, bias) -> bool:
  """Whether the kernel can compute attend_and_write (shapes and dtypes)."""
  return (applies(query, keys, values, bias)
          and new_keys.shape == query.shape and new_values.shape == query.shape
          and new_keys.dtype == jnp.float32 and new_values.dtype == jnp.float32)


@jax.custom_jvp
def kernel_attend_and_write(query, new_keys, new_values, keys, values, bias, starts, active):
  """attend_and_write through the kernel (applies_write(...)); starts [b] int32, active
  [b * t] int32 (query_flags): the queries that write their keys/values and attend."""
  return jax.ffi.ffi_call(
      cpu_matmul.ATTENTION_WRITE_TARGET_NAME,
      (jax.ShapeDtypeStruct(query.shape, jnp.float32),
       jax.ShapeDtypeStruct(keys.shape, jnp.float32),
       jax.ShapeDtypeStruct(values.shape, jnp.float32)),
      input_output_aliases={3: 1, 4: 2}, vmap_method='sequential')(
          query, new_keys, new_values, keys, values, bias, starts, active)


@kernel_attend_and_write.defjvp
def _kernel_attend_and_write_jvp(primals, tangents):
  starts = primals[6]
  _, tangents_out = jax.jvp(lambda *operands: xla_attend_and_write(*operands, starts),
                            primals[:6], tangents[:6])
  return kernel_attend_and_write(*primals), tangents_out


def attend_and_write(query, new_keys, new_values, keys, values, bias, starts,
                     cpu_matmul_setting: str = cpu_matmul.KERNEL, keys_in_slots: bool = False):
  """query [b,t,h,d] with the step's new keys/values [b,t,h,d] written into keys/values
  [b,h,d,L] at slots starts[b] + 0..t-1 (dropped past L), then attending with bias
  [b,h|1,t,L], which must mask every slot past a query's own position ->
  (out [b,t,h,d], keys, values).

  keys_in_slots (T5Config.decode_positions > 0): through XLA, every key sits at its own
  slot in the products (xla_attend_and_write), so a query's result does not depend on
  which keys its step brought; the kernel does so always."""
  starts = jnp.asarray(starts, jnp.int32)
  if (applies_write(query, new_keys, new_values, keys, values, bias)
      and cpu_matmul.use_kernel(cpu_matmul_setting)):
    return kernel_attend_and_write(query, new_keys, new_values, keys, values, bias, starts,
                                   query_flags(query))
  return xla_attend_and_write(query, new_keys, new_values, keys, values, bias, starts,
                              keys_in_slots)
