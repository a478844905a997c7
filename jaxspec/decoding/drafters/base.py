"""The drafter interface: what proposes gamma tokens for the target to verify.

A drafter is a frozen dataclass (hashable, static under jit) whose learned or
fitted tables live in a separate `params` pytree. Each iteration of speculative
decoding calls `propose` once; it sees the committed prefix through a DraftContext
and returns gamma tokens with the standardized distribution q each was drawn from.
Deterministic drafters return one-hot q.

Implementations: T5Drafter (t5_drafter.py); UnigramDrafter, BigramDrafter with
fit_unigram and fit_bigram (ngram.py); PromptLookupDrafter (prompt_lookup.py);
SharedEncoderDrafter (shared_encoder_drafter.py). All are importable from
`jaxspec.decoding.drafters`.

A drafter that reads the target's encoder output instead of encoding the input
itself also defines `init_state_from_target(params, encoder_tokens, target_encoded,
max_length)`; speculative decoding then calls it (through `init_drafter_state`) with
the encoding the target already computed, in place of `init_state`. A drafter whose
cross-attention keys/values are the target's own (the int8 draft) defines
`init_state_from_target_cache(params, target_cache, max_length)` instead (None where a
wrapper's drafter has none), and reuses the target's cross-attention cache rather than
projecting the encoding again.

A drafter may also define `propose_top_branches(params, state, context, gamma,
num_branches)` -> tokens [b, k, gamma], q [b, k, gamma, v], state of the branches
[b k]: a greedy token tree for multi-draft verification at temperature 0 (T5 drafters,
jaxspec/decoding/verification/tree.py). Without it, multi-draft decoding at temperature 0
runs as one draft.

A drafter may also define `propose_coupled(params, state, context, gamma, sampling,
position_keys)` -> tokens [b, gamma], noise [b, gamma, v], state: each draft drawn as
the baseline draws its position, argmax(adjusted logits + noise) with the Gumbel noise
of that position's key (coupled verification, SpeculativeConfig.verification =
'coupled'; at temperature 0 argmax picks and no noise). Without it, coupled
verification takes `propose`'s tokens.

Positions: the decoder input sequence is x_0 = 0 (start), x_j = tokens[j-1]. With
`length` committed tokens the next token to predict is tokens[length], from the
prefix x_0..x_length. The first proposal of a decode sees length 0 (only x_0): the
target verifies the drafter's first tokens too, and draws no token on its own.
"""

from __future__ import annotations

from typing import Any, Protocol

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.sampling import SamplingConfig, argmax, sample_probs


@flax.struct.dataclass
class DraftContext:
  """The committed state a drafter conditions on."""
  tokens: jax.Array  # [b, max_decode_length] committed output tokens, 0 past `length`
  length: jax.Array  # [b] int32 >= 0, number of committed tokens
  encoder_tokens: jax.Array  # [b, s] int32, 0 = padding
  # Set by callers that cut each row's proposal at its first drafted EOS (drafts after
  # it can never be committed): a drafter may then stop drafting a row there.
  eos_id: int | None = flax.struct.field(pytree_node=False, default=None)

  def last_two_inputs(self):
    """[b, 2]: decoder inputs x_{length-1}, x_length (x_0 is the start token 0); at
    length 0, where x_{-1} does not exist, [x_0, x_0]."""
    padded = jnp.pad(self.tokens, ((0, 0), (1, 0)))  # [b, 1 + L]; padded[:, j] = x_j
    positions = jnp.maximum(self.length[:, None] + jnp.array([-1, 0]), 0)  # [b, 2]
    return jnp.take_along_axis(padded, positions, axis=1)

  def last_input(self):
    """[b]: x_length, the input whose next token the drafter proposes first."""
    return self.last_two_inputs()[:, 1]

  def finished(self):
    """[b] bool: rows whose decode has ended (a committed EOS, with eos_id set, or a
    full buffer); what is drafted for them is never judged."""
    full = self.length >= self.tokens.shape[1]
    if self.eos_id is None:
      return full
    return full | ((self.length > 0) & (self.last_input() == self.eos_id))


def drafts_through_first(stops):
  """stops [b, g] bool -> [b] int32: each row's drafts up to and including its first
  stop (g without one), e.g. `drafts == eos_id`: drafts after a row's first EOS can
  never be committed, so callers that set DraftContext.eos_id treat them as not
  proposed."""
  gamma = stops.shape[1]
  return jnp.where(jnp.any(stops, axis=1), jnp.argmax(stops, axis=1) + 1,
                   gamma).astype(jnp.int32)


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

    keys [b]: one PRNG key per row for this iteration. With context.eos_id set, the
    positions after a row's first drafted EOS, and after the first draft of a row
    context.finished() names, may come back undrafted (token 0, q 0).
    """


def init_drafter_state(drafter: Drafter, params, encoder_tokens, target_encoded,
                       max_length: int, target_cache=None):
  """The drafter's per-generation state; target_encoded [b, s, e] is the target's
  encoder output, used by drafters that define `init_state_from_target`, and
  target_cache the target's DecoderCache, by drafters that define
  `init_state_from_target_cache`."""
  from_cache = getattr(drafter, 'init_state_from_target_cache', None)
  if target_cache is not None and from_cache is not None:
    return from_cache(params, target_cache, max_length)
  if hasattr(drafter, 'init_state_from_target'):
    return drafter.init_state_from_target(params, encoder_tokens, target_encoded, max_length)
  return drafter.init_state(params, encoder_tokens, max_length)


def propose_coupled(drafter: Drafter, params, state, context: DraftContext, gamma: int,
                    sampling: SamplingConfig, position_keys, keys):
  """-> drafts [b, g], their noise [b, g, v] or None, new state (coupled verification).

  position_keys [b, g]: the keys of the output positions length .. length + g - 1
  (None at temperature 0, where drafts are argmax picks and no noise is returned).
  Drafters that define `propose_coupled` (T5 drafters) draw each draft with its
  position's Gumbel noise and return it; others propose as usual with keys [b] (their
  q unused), returning no noise. Any drafts keep coupled verification exact; drafts
  drawn with the target's noise agree with its draws more often.
  """
  if hasattr(drafter, 'propose_coupled'):
    return drafter.propose_coupled(params, state, context, gamma, sampling, position_keys)
  drafts, _, state = drafter.propose(params, state, context, gamma, sampling, keys)
  return drafts, None, state


def draft_confidence(logits, probs, sampling: SamplingConfig):
  """[b]: the largest probability the draft gave at a position, from its logits [b, v]
  and standardized q [b, v]: max q when sampling; at temperature 0, where q is one-hot,
  the largest probability of the softmax of the logits."""
  if sampling.is_greedy:
    return jnp.max(jax.nn.softmax(logits.astype(jnp.float32), axis=-1), axis=-1)
  return jnp.max(probs, axis=-1)


def propose_with_confidence(drafter: Drafter, params, state, context: DraftContext,
                            gamma: int, sampling: SamplingConfig, keys, stop_below: float):
  """-> drafts [b, g], q [b, g, v], confidence [b, g], new state (adaptive gamma).

  Drafters that define `propose_with_confidence` (T5 drafters) report draft_confidence
  and may skip the steps after every row has drafted a token below stop_below (those
  positions come back as token 0, q 0, confidence 0). Others propose as usual, with
  the largest probability of q as the confidence (1 for one-hot q).
  """
  if hasattr(drafter, 'propose_with_confidence'):
    return drafter.propose_with_confidence(params, state, context, gamma, sampling, keys,
                                           stop_below)
  drafts, probs, state = drafter.propose(params, state, context, gamma, sampling, keys)
  return drafts, probs, jnp.max(probs, axis=-1), state


def draw_tokens(keys, probs, sampling: SamplingConfig):
  """keys [b], probs [b, v] -> tokens [b] (argmax of a one-hot when greedy)."""
  if sampling.is_greedy:
    return argmax(probs)
  return jax.vmap(sample_probs)(keys, probs)
