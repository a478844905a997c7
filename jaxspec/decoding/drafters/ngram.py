"""Unigram and bigram drafters: negligible-cost approximation models (paper 3.6).

Each is a table lookup. The tables are fitted with numpy from target token sequences
(`fit_unigram`, `fit_bigram`) and passed as the drafter's params:
  unigram: log-probabilities [v] of the next token, whatever came before;
  bigram:  log-probabilities [v, v], row a = the next token given the previous decoder
           input a (a = 0, the start token, for the first position).
Proposals go through the target's `standardize` (temperature, top-k, top-p; one-hot
argmax when greedy), so q is exactly the distribution each draft was drawn from.

Shape letters: b batch, g gamma (drafted positions), v vocab.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import PAD_ID
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import DraftContext, Drafter, DraftSources, draw_tokens
from jaxspec.sampling import SamplingConfig, standardize

DEFAULT_SMOOTHING = 0.01  # Lidstone: small, so q stays close to the observed counts.


def _target_tokens(sequence, vocab_size: int) -> np.ndarray:
  """One target sequence -> int64 tokens before its first padding token (0)."""
  tokens = np.asarray(sequence, dtype=np.int64).reshape(-1)
  if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
    raise ValueError(f'token ids must be in [0, {vocab_size}), got '
                     f'[{tokens.min()}, {tokens.max()}]')
  padding = np.flatnonzero(tokens == PAD_ID)
  return tokens[:padding[0]] if padding.size else tokens


def _check_smoothing(smoothing: float):
  if not smoothing > 0:
    raise ValueError(f'smoothing must be > 0 (additive counts), got {smoothing}')


def fit_unigram(token_sequences: Iterable, vocab_size: int,
                smoothing: float = DEFAULT_SMOOTHING) -> np.ndarray:
  """Additively smoothed unigram log-probabilities [v] float32.

  token_sequences: 1-D int arrays of target tokens (e.g. ending with EOS); each is
  cut at its first 0, which is padding (0 is never a target token).
  log p(t) = log((count(t) + smoothing) / (total + smoothing * v)).
  """
  _check_smoothing(smoothing)
  counts = np.zeros(vocab_size, np.float64)
  for sequence in token_sequences:
    counts += np.bincount(_target_tokens(sequence, vocab_size), minlength=vocab_size)
  log_probs = np.log(counts + smoothing) - np.log(counts.sum() + smoothing * vocab_size)
  return log_probs.astype(np.float32)


def fit_bigram(token_sequences: Iterable, vocab_size: int,
               smoothing: float = DEFAULT_SMOOTHING) -> np.ndarray:
  """Additively smoothed bigram log-probabilities [v, v] float32, row = previous token.

  Each sequence t_1..t_n (cut at its first 0) contributes the transitions
  0 -> t_1 (the decoder start token), t_1 -> t_2, ..., t_{n-1} -> t_n.
  log p(b | a) = log((count(a, b) + smoothing) / (count(a) + smoothing * v)); a row
  never seen as a previous token is uniform. Only the [v, v] result is dense in memory
  (4 bytes * v^2: 4.1 GB at T5's v = 32128); the counts are kept per observed pair.
  """
  _check_smoothing(smoothing)
  pair_ids = []
  for sequence in token_sequences:
    tokens = _target_tokens(sequence, vocab_size)
    previous = np.concatenate([[PAD_ID], tokens[:-1]])
    pair_ids.append(previous * vocab_size + tokens)
  pair_ids = np.concatenate(pair_ids) if pair_ids else np.zeros(0, np.int64)
  pairs, pair_counts = np.unique(pair_ids, return_counts=True)
  previous, following = np.divmod(pairs, vocab_size)
  row_totals = np.bincount(previous, weights=pair_counts, minlength=vocab_size)
  log_denominator = np.log(row_totals + smoothing * vocab_size)  # [v]
  table = np.empty((vocab_size, vocab_size), np.float32)
  table[:] = (np.log(smoothing) - log_denominator)[:, None]
  table[previous, following] = np.log(pair_counts + smoothing) - log_denominator[previous]
  return table


def _position_keys(keys, gamma: int):
  """keys [b] -> [g, b]: one key per row and drafted position."""
  return jnp.swapaxes(jax.vmap(lambda key: jax.random.split(key, gamma))(keys), 0, 1)


def _train_targets(sources: DraftSources):
  if sources.train_targets is None:
    raise InvalidSetting(f'n-gram drafters are fitted on a shipped corpus '
                         f'({sources.setting}.corpus); with a seqio task other than '
                         'jaxspec_*_local use a T5 drafter or prompt lookup')
  return sources.train_targets()


def _check_table(params, vocab_size: int, ndim: int, name: str):
  expected = (vocab_size,) * ndim
  if tuple(params.shape) != expected:
    raise ValueError(f'{name} params must have shape {expected}, got {tuple(params.shape)}')


@dataclasses.dataclass(frozen=True)
class UnigramDrafter(Drafter):
  """Drafts each token independently from one distribution; params: logits [v]."""
  vocab_size: int

  def init_state(self, params, encoder_tokens, max_length: int):
    return ()

  def load_params(self, sources: DraftSources):
    """The table fitted on the target token sequences sources.train_targets gives."""
    return sources.replicated(fit_unigram(_train_targets(sources), self.vocab_size))

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    _check_table(params, self.vocab_size, 1, 'UnigramDrafter')
    params = jnp.asarray(params)
    batch = context.length.shape[0]
    probs = jnp.broadcast_to(standardize(params, sampling), (batch, self.vocab_size))
    tokens = jax.vmap(lambda position_keys: draw_tokens(position_keys, probs, sampling))(
        _position_keys(keys, gamma))  # [g, b]
    all_probs = jnp.broadcast_to(probs[:, None], (batch, gamma, self.vocab_size))
    return jnp.swapaxes(tokens, 0, 1), all_probs, state


@dataclasses.dataclass(frozen=True)
class BigramDrafter(Drafter):
  """Drafts a chain d_1 | x_length, d_2 | d_1, ...; params: logits [v, v], row = previous."""
  vocab_size: int

  def init_state(self, params, encoder_tokens, max_length: int):
    return ()

  def load_params(self, sources: DraftSources):
    """The table fitted on the target token sequences sources.train_targets gives."""
    return sources.replicated(fit_bigram(_train_targets(sources), self.vocab_size))

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    _check_table(params, self.vocab_size, 2, 'BigramDrafter')
    params = jnp.asarray(params)

    def step(previous, position_keys):  # previous [b], position_keys [b]
      probs = standardize(params[previous], sampling)  # [b, v]
      token = draw_tokens(position_keys, probs, sampling)
      return token, (token, probs)

    last_input = context.last_input()  # [b] x_length
    _, (tokens, probs) = jax.lax.scan(step, last_input, _position_keys(keys, gamma))
    return jnp.swapaxes(tokens, 0, 1), jnp.swapaxes(probs, 0, 1), state
