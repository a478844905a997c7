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


def rollback(cache: DecoderCache, end_index: jax.Array) -> DecoderCache:
  """Keeps only the first `end_index[b]` positions of each row (an index update)."""
  return cache.replace(end_index=jnp.asarray(end_index, jnp.int32))


def repeat_rows(cache: DecoderCache, repeats: int) -> DecoderCache:
  """Repeats each row `repeats` times along the batch (for several decodes per input)."""
  return jax.tree_util.tree_map(lambda x: jnp.repeat(x, repeats, axis=0), cache)
