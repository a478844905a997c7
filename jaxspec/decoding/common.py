"""What the baseline and the speculative decoder share: outputs and per-row keys."""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp


@flax.struct.dataclass
class DecodeOutput:
  tokens: jax.Array  # [b, max_decode_length] int32, 0 after the first EOS
  token_log_probs: jax.Array  # [b, max_decode_length] float32, 0 after the end
  log_prob: jax.Array  # [b] float32, sum of token_log_probs
  lengths: jax.Array  # [b] int32, tokens up to and including the first EOS
  # [b] bool: the row met non-finite logits (NaN, +inf) and was stopped there, 0 after.
  nonfinite_logits: jax.Array

  @classmethod
  def from_tokens(cls, tokens, token_log_probs, eos_id: int,
                  nonfinite_logits=None) -> 'DecodeOutput':
    if nonfinite_logits is None:
      nonfinite_logits = jnp.zeros(tokens.shape[:1], bool)
    return cls(tokens=tokens, token_log_probs=token_log_probs,
               log_prob=jnp.sum(token_log_probs, axis=1),
               lengths=sequence_lengths(tokens, eos_id), nonfinite_logits=nonfinite_logits)


def sequence_lengths(tokens, eos_id: int):
  """tokens [b, L] -> [b] number of tokens up to and including the first EOS (or L)."""
  is_eos = tokens == eos_id
  first_eos = jnp.argmax(is_eos, axis=1)
  return jnp.where(jnp.any(is_eos, axis=1), first_eos + 1, tokens.shape[1]).astype(jnp.int32)


def row_keys(rng, batch: int):
  """One PRNG key per row: fold_in(rng, row) for a single key, or the given [b] keys.

  A row's samples depend only on its own key, never on the other rows of the batch.
  """
  if rng is None:
    rng = jax.random.PRNGKey(0)
  rng = jnp.asarray(rng)
  if rng.ndim == 2 or (jax.dtypes.issubdtype(rng.dtype, jax.dtypes.prng_key) and rng.ndim == 1):
    if rng.shape[0] != batch:
      raise ValueError(f'got {rng.shape[0]} per-row PRNG keys for a batch of {batch}')
    return rng
  return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(batch))


def position_keys(row_keys, start, count: int):
  """row_keys [b], start [b] int32 -> [b, count] keys: row b's key of output position
  start[b] + j is fold_in(row_keys[b], start[b] + j), the key the baseline samples that
  position with (so coupled verification draws the baseline's tokens)."""
  positions = start[:, None] + jnp.arange(count, dtype=jnp.int32)[None, :]  # [b, count]
  return jax.vmap(jax.vmap(jax.random.fold_in, in_axes=(None, 0)))(row_keys, positions)
