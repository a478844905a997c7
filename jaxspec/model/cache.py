"""The decoder cache: a functional pytree passed into and returned by `decode`.

Self-attention keys/values sit in fixed-size buffers; `end_index[b]` counts the
valid positions of row b. Writes overwrite, so rolling a row back is only lowering
its `end_index`: the stale slots past it are never attended to (a query at position
t attends only to keys at positions <= t, and positions end_index..t are rewritten
by the same decode call before they are read).

Cross-attention keys/values are computed once per encoding and never change.

Keys and values are stored [batch, heads, head_dim, length]: the layout XLA:CPU's
attention dots read (contracting head_dim for the logits, length for the output), so
a decode step reads the buffers in place; stored [batch, length, heads, head_dim], every
step copied every layer's four buffers into that layout first (docs/design.md).
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class LayerCache:
  self_keys: jax.Array  # [batch, heads, head_dim, max_length]
  self_values: jax.Array  # [batch, heads, head_dim, max_length]
  cross_keys: jax.Array  # [batch, heads, head_dim, encoder_length]
  cross_values: jax.Array  # [batch, heads, head_dim, encoder_length]


@flax.struct.dataclass
class DecoderCache:
  layers: tuple[LayerCache, ...]
  encoder_mask: jax.Array  # [batch, encoder_length] bool, True at real tokens
  end_index: jax.Array  # [batch] int32, number of cached decoder positions per row

  @property
  def max_length(self) -> int:
    return self.layers[0].self_keys.shape[3]

  @property
  def batch_size(self) -> int:
    return self.end_index.shape[0]


def write(buffer, new, write_positions):
  """buffer [b, h, d, L] with new [b, t, h, d] written at write_positions [b, t], which
  run contiguously in each row (end_index[b] + 0..t-1, as decode writes them).

  Positions past the buffer are dropped, never clamped onto valid slots. With one row
  the write is a dynamic update slice of a t-slot window (write_window), which XLA
  performs in place inside a decode loop, where a scatter made it copy every buffer
  whole at every step (docs/design.md).
  """
  return write_all((buffer,), (new,), write_positions)[0]


def write_all(buffers, news, write_positions):
  """`write` of news[i] into buffers[i] (one layer's keys and values) at the same
  write_positions."""
  news = tuple(new.astype(buffer.dtype) for buffer, new in zip(buffers, news))
  if buffers[0].shape[0] == 1 and news[0].shape[1] <= buffers[0].shape[3]:
    start = write_positions[0, 0]
    return tuple(write_window(buffer, new, start) for buffer, new in zip(buffers, news))
  rows = jnp.arange(buffers[0].shape[0])[:, None]  # [b, 1]
  # Indexing rows and positions (separated by the h, d slices) addresses [b, t, h, d].
  return tuple(buffer.at[rows, :, :, write_positions].set(new, mode='drop')
               for buffer, new in zip(buffers, news))


def write_window(buffer, new, start):
  """One row: buffer [1, h, d, L] with new [1, t, h, d] at slots start + 0..t-1, those
  past L dropped, as one dynamic update slice and no conditional (a lax.cond between a
  slice and a scatter made XLA copy the buffers out of it at every step).

  The window written is the t slots from min(start, L - t): its slots before `start`
  get back what they held, the rest the new positions that fit.
  """
  steps, length = new.shape[1], buffer.shape[3]
  start = jnp.asarray(start, jnp.int32)
  window_start = jnp.minimum(start, length - steps)
  held = jax.lax.dynamic_slice_in_dim(buffer, window_start, steps, axis=3)  # [1, h, d, t]
  shift = start - window_start  # slots of the window before `start`, 0..t
  slot = jnp.arange(steps, dtype=jnp.int32)
  # Window slot j holds held[j] before the shift, else new[j - shift].
  source = jnp.where(slot < shift, slot, steps + slot - shift)  # [t]
  candidates = jnp.concatenate([held, jnp.transpose(new, (0, 2, 3, 1))], axis=3)
  window = jnp.take(candidates, source, axis=3)  # [1, h, d, t]
  return jax.lax.dynamic_update_slice_in_dim(buffer, window, window_start, axis=3)


def rollback(cache: DecoderCache, end_index: jax.Array) -> DecoderCache:
  """Keeps only the first `end_index[b]` positions of each row (an index update)."""
  return cache.replace(end_index=jnp.asarray(end_index, jnp.int32))


def repeat_rows(cache: DecoderCache, repeats: int) -> DecoderCache:
  """Repeats each row `repeats` times along the batch (for several decodes per input)."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, repeats, axis=0), cache)
