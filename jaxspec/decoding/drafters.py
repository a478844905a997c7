"""Drafters: what proposes gamma tokens for the target to verify.

A drafter is a frozen dataclass (hashable, static under jit) whose learned or
fitted tables live in a separate `params` pytree. Each iteration of speculative
decoding calls `propose` once; it sees the committed prefix through a DraftContext
and returns gamma tokens with the standardized distribution q each was drawn from.
Deterministic drafters return one-hot q.

Drafters: T5Drafter (here); UnigramDrafter, BigramDrafter with fit_unigram and
fit_bigram (ngram.py); PromptLookupDrafter (prompt_lookup.py). All are importable
from this module.

Positions: the decoder input sequence is x_0 = 0 (start), x_j = tokens[j-1]. With
`length` committed tokens the next token to predict is tokens[length], from the
prefix x_0..x_length.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.config import T5Config
from jaxspec.model import T5, rollback
from jaxspec.sampling import SamplingConfig, sample_probs, standardize


@flax.struct.dataclass
class DraftContext:
  """The committed state a drafter conditions on."""
  tokens: jax.Array  # [b, max_decode_length] committed output tokens, 0 past `length`
  length: jax.Array  # [b] int32 >= 1, number of committed tokens
  encoder_tokens: jax.Array  # [b, s] int32, 0 = padding

  def last_two_inputs(self):
    """[b, 2]: decoder inputs x_{length-1}, x_length (x_0 is the start token 0)."""
    padded = jnp.pad(self.tokens, ((0, 0), (1, 0)))  # [b, 1 + L]; padded[:, j] = x_j
    positions = self.length[:, None] + jnp.array([-1, 0])  # [b, 2]
    return jnp.take_along_axis(padded, positions, axis=1)


class Drafter(Protocol):
  """The interface every drafter implements."""

  @property
  def vocab_size(self) -> int:
    ...

  def init_state(self, params, encoder_tokens, max_length: int) -> Any:
    """Per-generation state (e.g. an encoded cache) for encoder_tokens [b, s].

    max_length: decoder positions the state must hold (max_decode_length + gamma).
    """

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys) -> tuple[jax.Array, jax.Array, Any]:
    """-> draft tokens [b, gamma] int32, their q [b, gamma, v] float32, new state.

    keys [b]: one PRNG key per row for this iteration.
    """


def draw_tokens(keys, probs, sampling: SamplingConfig):
  """keys [b], probs [b, v] -> tokens [b] (argmax of a one-hot when greedy)."""
  if sampling.is_greedy:
    return jnp.argmax(probs, axis=-1).astype(jnp.int32)
  return jax.vmap(sample_probs)(keys, probs)


@dataclasses.dataclass(frozen=True)
class T5Drafter:
  """A smaller T5 over the same vocabulary, with its own encoder pass and cache.

  Rollback is by index: each proposal starts by setting the cache's end to
  length - 1 and feeding the two inputs x_{length-1}, x_length. This re-writes the
  slot of x_{length-1}, which covers the case where every draft was accepted and the
  drafter never consumed its last draft, without a shape change.
  """
  config: T5Config

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def init_state(self, params, encoder_tokens, max_length: int):
    model = T5(self.config)
    encoded = model.apply(params, encoder_tokens, method=T5.encode)
    return model.apply(params, encoded, encoder_tokens, max_length, method=T5.init_cache)

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    model = T5(self.config)
    cache = rollback(state, context.length - 1)
    logits, cache = model.apply(params, context.last_two_inputs(), cache, method=T5.decode)
    step_keys = jax.vmap(lambda k: jax.random.split(k, gamma))(keys)  # [b, gamma]
    probs = standardize(logits[:, -1], sampling)  # [b, v]
    token = draw_tokens(step_keys[:, 0], probs, sampling)

    def step(carry, step_key):
      cache, token = carry
      logits, cache = model.apply(params, token[:, None], cache, method=T5.decode)
      probs = standardize(logits[:, 0], sampling)
      next_token = draw_tokens(step_key, probs, sampling)
      return (cache, next_token), (next_token, probs)

    (cache, _), (rest_tokens, rest_probs) = jax.lax.scan(
        step, (cache, token), jnp.swapaxes(step_keys[:, 1:], 0, 1))
    tokens = jnp.concatenate([token[:, None], jnp.swapaxes(rest_tokens, 0, 1)], axis=1)
    all_probs = jnp.concatenate([probs[:, None], jnp.swapaxes(rest_probs, 0, 1)], axis=1)
    return tokens, all_probs, cache


# The table and lookup drafters live in their own modules (ngram, prompt_lookup), which
# import DraftContext and draw_tokens from here; they are re-exported on first access
# (PEP 562) so that importing either module first cannot hit a circular import.
_REEXPORTED = {
    'UnigramDrafter': 'jaxspec.decoding.ngram',
    'BigramDrafter': 'jaxspec.decoding.ngram',
    'fit_unigram': 'jaxspec.decoding.ngram',
    'fit_bigram': 'jaxspec.decoding.ngram',
    'PromptLookupDrafter': 'jaxspec.decoding.prompt_lookup',
}


def __getattr__(name: str):
  if name in _REEXPORTED:
    return getattr(importlib.import_module(_REEXPORTED[name]), name)
  raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
