"""Prompt lookup: draft by copying what followed an earlier occurrence of the suffix.

The parameter-less drafter of paper 3.6 ("copies tokens from the context in case we
find a matching prefix"). Per row, the history is the encoder input without its
padding followed by the committed decoder tokens x_1..x_length:

    history = [e_1 .. e_s'] ++ [x_1 .. x_length]        (N = s' + length tokens)

The query is the last n decoder tokens x_{length-n+1}..x_length; n runs from
ngram_size down to min_ngram_size and the first n with a match wins (a longer match
beats a more recent one). The start token x_0 is never part of a query, so an n larger
than `length` has no match, and encoder padding never matches anything. Among the
matches of one n the latest start wins, so the decoded prefix is preferred over the
encoder input (windows that span both count, starting in the encoder).

Drafts copy forward from the end E of the match, overlapping like an LZ77 copy:
d_k = history[E + (k mod (N - E))]. When the continuation reaches the end of the
history, the copy repeats the period it has (a repeated phrase keeps repeating).
Without any match the drafts repeat x_length (the same copy with E = N - 1): cheap,
never a special token, and often right for the repetitive outputs that make
lookup worthwhile. Drafts are deterministic: q is their one-hot.

Everything is static-shape jnp over [b, s + L] (L = max_decode_length), one compare
per query position and n: O(b (s + L) ngram_size^2) per proposal.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec.config import PAD_ID
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import DraftContext, Drafter
from jaxspec.sampling import SamplingConfig


def lookup_history(context: DraftContext):
  """-> history [b, s + L] int32 (valid tokens first, zeros after), its length N [b]."""
  max_decode_length = context.tokens.shape[1]
  values = jnp.concatenate([context.encoder_tokens, context.tokens], axis=1)  # [b, T]
  decoded = jnp.arange(max_decode_length)[None, :] < context.length[:, None]  # [b, L]
  valid = jnp.concatenate([context.encoder_tokens != PAD_ID, decoded], axis=1)  # [b, T]
  total = values.shape[1]
  destination = jnp.where(valid, jnp.cumsum(valid, axis=1) - 1, total)  # [b, T]
  rows = jnp.arange(values.shape[0])[:, None]
  history = jnp.zeros_like(values).at[rows, destination].set(values, mode='drop')
  return history.astype(jnp.int32), jnp.sum(valid, axis=1).astype(jnp.int32)


def latest_match_end(history, history_length, decoded_length, n: int):
  """End (exclusive) [b] of the latest earlier occurrence of the last n tokens, or -1.

  history [b, T], history_length [b] (N), decoded_length [b]; the query (the last n
  history tokens) must lie within the decoded tokens, and a match must start before it.
  """
  total = history.shape[1]
  query_start = history_length - n  # [b]
  query = jnp.take_along_axis(
      history, jnp.maximum(query_start, 0)[:, None] + jnp.arange(n)[None, :], axis=1)  # [b, n]
  padded = jnp.pad(history, ((0, 0), (0, n)))  # [b, T + n]
  starts = jnp.arange(total)[None, :]  # [1, T]
  matches = starts < query_start[:, None]  # [b, T]; earlier occurrences only
  for i in range(n):
    matches &= padded[:, i:i + total] == query[:, i:i + 1]
  latest = jnp.max(jnp.where(matches, starts, -1), axis=1)  # [b]
  return jnp.where((latest >= 0) & (n <= decoded_length), latest + n, -1)


def copy_forward(history, history_length, match_end, gamma: int):
  """-> [b, g]: d_k = history[E + (k mod (N - E))] for E = match_end < N."""
  period = history_length - match_end  # [b] >= 1
  offsets = jnp.arange(gamma)[None, :] % period[:, None]  # [b, g]
  return jnp.take_along_axis(history, match_end[:, None] + offsets, axis=1)


@dataclasses.dataclass(frozen=True)
class PromptLookupDrafter(Drafter):
  """Copies the continuation of the latest earlier n-gram match; no params, no state."""
  vocab_size: int
  ngram_size: int = 3  # Longest suffix searched for.
  min_ngram_size: int = 1  # Shortest; below it the drafts repeat the last token.

  def __post_init__(self):
    if not 1 <= self.min_ngram_size <= self.ngram_size:
      raise InvalidSetting('need 1 <= min_ngram_size <= ngram_size, got '
                           f'{self.min_ngram_size} and {self.ngram_size}')

  def init_state(self, params, encoder_tokens, max_length: int):
    return ()

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    history, history_length = lookup_history(context)
    match_end = history_length - 1  # No match: repeat x_length.
    found = jnp.zeros(history_length.shape, bool)
    for n in range(self.ngram_size, self.min_ngram_size - 1, -1):
      end = latest_match_end(history, history_length, context.length, n)
      match_end = jnp.where(~found & (end >= 0), end, match_end)
      found |= end >= 0
    tokens = copy_forward(history, history_length, match_end, gamma)  # [b, g]
    return tokens, jax.nn.one_hot(tokens, self.vocab_size, dtype=jnp.float32), state
