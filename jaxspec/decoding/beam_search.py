"""Beam search with T5X's semantics, as one jit-compiled while loop.

`beam_search` has T5X's `decoding.beam_search` signature and semantics:
  - `num_decodes` beams; the log-prob of a live beam is the sum of its tokens'
    log_softmax; each step expands every live beam over the vocabulary, keeps the top
    2 * beams candidates of all beams, moves those ending in EOS to the finished set
    (score = log-prob / brevity_penalty(alpha, length), length = decoded tokens
    including the EOS) and keeps the best `beams` candidates without EOS live;
  - the search stops at max_decode_len, when no live beam can still beat the worst
    finished one (its log-prob over the largest brevity penalty), when no live beam
    passes `min_log_prob`, or after `max_decode_step` steps;
  - non-zero `inputs[:, i]` (i >= 1) force token i and keep a single beam alive;
  - returns (sequences [B, beams, max_decode_len], scores [B, beams]) sorted ascending
    by score, best last; a row with no finished beam returns its live beams and their
    log-probs.
The empty beams of the start (log-prob -1e7, T5X's NEG_INF) and T5X's arithmetic
(where -1e7 is added, top_k's tie order, the flip to ascending order) are kept as they
are, so ties and near-empty vocabularies resolve as in T5X.

The search is split into two pure functions, `beam_step` (one step from the live
beams' logits) and `should_continue` (the loop condition), which the speculative beam
search (speculative_beam.py) replays over the target's verify logits; both decoders
therefore run the same arithmetic step for step.

`generate_beam` runs it on a jaxspec T5: encode once, cross-attention keys/values
once, one cached decode step for all beams of all rows per step, the cache gathered by
beam index as a functional update, all inside one `jax.jit`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import validation
from jaxspec.errors import InvalidSetting
from jaxspec.config import EOS_ID, T5Config
from jaxspec.decoding.baseline import DecodingState
from jaxspec.model import T5

# T5X's NEG_INF, a large finite value (not -inf) so arithmetic on empty beams stays finite.
NEG_INF = np.array(-1.0e7)
NEG_INF_VALUE = -1.0e7

# Cache leaves that carry no batch axis in T5X's caches (scalar indices, the shared
# relative position bias); they are not expanded or gathered by beam, as in T5X.
_UNBATCHED_CACHE_LEAVES = ('cache_index', 'cached_bias', 'position_embedder_index')


@dataclasses.dataclass(frozen=True)
class BeamConfig:
  """Static settings of beam search (T5X's names in brackets)."""
  num_beams: int = 4  # Beams kept live and finished sequences returned [num_decodes].
  alpha: float = 0.6  # Brevity penalty ((5 + length) / 6) ** alpha [alpha].
  max_decode_step: int = -1  # Stop after this many steps; <= 0: no limit.
  min_log_prob: float = NEG_INF_VALUE  # Stop when no live beam's log-prob passes this.

  def __post_init__(self):
    if self.num_beams < 1:
      raise InvalidSetting(f'num_beams must be >= 1, got {self.num_beams}')


@flax.struct.dataclass
class BeamState:
  """The search state without the model cache (T5X's BeamState minus `cache`)."""
  cur_index: jax.Array  # [] int32; live_seqs[:, :, cur_index] is each beam's pending input
  live_logprobs: jax.Array  # [b, k] float32, ascending (best live beam last)
  finished_scores: jax.Array  # [b, k] float32, ascending
  live_seqs: jax.Array  # [b, k, L + 1] int32; position 0 holds the start token 0
  finished_seqs: jax.Array  # [b, k, L + 1] int32
  finished_flags: jax.Array  # [b, k] bool, the finished slot holds a real sequence


@flax.struct.dataclass
class BeamOutput:
  tokens: jax.Array  # [b, k, L] int32, sorted by score ascending (best last), 0 after EOS
  scores: jax.Array  # [b, k] float32, log-prob / brevity penalty (live: raw log-prob)
  steps: jax.Array  # [] int32, search steps run (target decode steps for generate_beam)


def brevity_penalty(alpha: float, length):
  """((5 + length) / 6) ** alpha, T5X's length normalization."""
  return jnp.power((5.0 + length) / 6.0, alpha)


def init_state(batch: int, beams: int, max_decode_len: int) -> BeamState:
  """Beam 0 live with log-prob 0, the other beams empty (-1e7), no finished beam."""
  return BeamState(
      cur_index=jnp.array(0),
      live_logprobs=jnp.tile(jnp.array([0.0] + [NEG_INF] * (beams - 1)), [batch, 1]),
      finished_scores=jnp.ones((batch, beams)) * NEG_INF,
      live_seqs=jnp.zeros((batch, beams, max_decode_len + 1), jnp.int32),
      finished_seqs=jnp.zeros((batch, beams, max_decode_len + 1), jnp.int32),
      finished_flags=jnp.zeros((batch, beams), jnp.bool_))


def _gather(x, indices):
  """x [b, n, ...], indices [b, k] -> [b, k, ...]."""
  indices = indices.reshape(indices.shape + (1,) * (x.ndim - 2))
  return jnp.take_along_axis(x, indices, axis=1)


def _top_k_ascending(values, k: int):
  """Indices [b, k] of the k largest of values [b, n], ascending (T5X's flipped top_k)."""
  _, indices = jax.lax.top_k(values, k)
  return jnp.flip(indices, axis=1)


def beam_step(state: BeamState, logits, forced_tokens, *, eos_id: int,
              alpha: float) -> tuple[BeamState, jax.Array]:
  """One step of beam search from the live beams' next-token logits [b, k, v].

  forced_tokens [b]: the token forced at position cur_index + 1 (0: none).
  Returns the new state and parents [b, k]: the old beam each new live beam extends
  (caches are gathered by it).
  """
  batch, beams, vocab = logits.shape
  cur = state.cur_index
  # [b, k, v]: every one-token extension of every live beam.
  log_probs = jax.nn.log_softmax(logits) + state.live_logprobs[:, :, None]
  num_candidates = 2 * beams  # Enough that `beams` of them do not end in EOS.
  candidate_log_probs, flat_indices = jax.lax.top_k(
      log_probs.reshape(batch, beams * vocab), num_candidates)  # [b, 2k]
  candidate_tokens = flat_indices % vocab
  candidate_parents = flat_indices // vocab
  # A forced token keeps one candidate (log-prob 0 added) and empties the others.
  forced = forced_tokens[:, None].astype(jnp.int32)  # [b, 1]
  out_of_prompt = forced == 0
  inside_prompt_log_probs = jnp.concatenate(
      [jnp.zeros((batch, 1), candidate_log_probs.dtype),
       jnp.full_like(candidate_log_probs[:, :num_candidates - 1], NEG_INF)], axis=1)
  candidate_log_probs = (candidate_log_probs * out_of_prompt
                         + inside_prompt_log_probs * ~out_of_prompt)
  candidate_tokens = candidate_tokens * out_of_prompt + forced * ~out_of_prompt
  candidate_seqs = jax.lax.dynamic_update_slice(
      _gather(state.live_seqs, candidate_parents), candidate_tokens[:, :, None],
      (0, 0, cur + 1))  # [b, 2k, L + 1]
  newly_finished = candidate_tokens == eos_id  # [b, 2k]

  # Live: the best `beams` candidates that did not end in EOS.
  live_log_probs = candidate_log_probs + newly_finished * NEG_INF
  alive = _top_k_ascending(live_log_probs, beams)  # [b, k]
  parents = _gather(candidate_parents, alive)

  # Finished: the best `beams` of the old finished set and the new EOS candidates.
  lengths = jnp.zeros((batch, num_candidates), jnp.int32) + (cur + 1)
  new_scores = candidate_log_probs / brevity_penalty(alpha, lengths)
  new_scores += (~newly_finished) * NEG_INF
  all_scores = jnp.concatenate([state.finished_scores, new_scores], axis=1)  # [b, 3k]
  best = _top_k_ascending(all_scores, beams)
  new_state = BeamState(
      cur_index=cur + 1,
      live_logprobs=_gather(live_log_probs, alive),
      finished_scores=_gather(all_scores, best),
      live_seqs=_gather(candidate_seqs, alive),
      finished_seqs=_gather(
          jnp.concatenate([state.finished_seqs, candidate_seqs], axis=1), best),
      finished_flags=_gather(
          jnp.concatenate([state.finished_flags, newly_finished], axis=1), best))
  return new_state, parents


def should_continue(state: BeamState, *, alpha: float, max_decode_len: int,
                    max_decode_step: int = -1,
                    min_log_prob: float = NEG_INF_VALUE) -> jax.Array:
  """[] bool: T5X's loop condition, over the whole batch."""
  not_at_end = state.cur_index < max_decode_len
  exceeded_steps = (max_decode_step > 0) & jnp.all(state.cur_index >= max_decode_step)
  # The best score a live beam can still reach: its log-prob only falls, and the
  # largest brevity penalty is at the longest length (for alpha >= 0).
  min_brevity_penalty = brevity_penalty(alpha, max_decode_len + 1)
  best_live_scores = state.live_logprobs[:, -1:] / min_brevity_penalty  # [b, 1]
  worst_finished_scores = jnp.min(state.finished_scores, axis=1, keepdims=True)
  worst_finished_scores = jnp.where(state.finished_flags, worst_finished_scores, NEG_INF)
  search_terminated = jnp.all(worst_finished_scores > best_live_scores)
  none_pass_min_log_prob = jnp.all(
      best_live_scores < min_log_prob / min_brevity_penalty) & (state.cur_index > 0)
  return not_at_end & ~search_terminated & ~none_pass_min_log_prob & ~exceeded_steps


def final_output(state: BeamState):
  """(sequences [b, k, L] without the start token, scores [b, k]); live beams for rows
  without any finished beam."""
  any_finished = jnp.any(state.finished_flags, axis=1)  # [b]
  sequences = jnp.where(any_finished[:, None, None], state.finished_seqs, state.live_seqs)
  scores = jnp.where(any_finished[:, None], state.finished_scores, state.live_logprobs)
  return sequences[:, :, 1:], scores


def forced_tokens_at(inputs, index):
  """inputs [b, L] -> [b] the token at `index` (clipped to L - 1, as T5X's indexing)."""
  return jnp.take(inputs, index, axis=1, mode='clip').astype(jnp.int32)


def _leaf_name(path) -> str | None:
  last = path[-1] if path else None
  return getattr(last, 'key', getattr(last, 'name', None))


def map_beam_cache(fn, cache):
  """Applies fn to every cache leaf with a batch axis: leaves of rank >= 1 except T5X's
  unbatched ones (cache_index, cached_bias, position_embedder_index)."""
  def apply(path, leaf):
    if jnp.ndim(leaf) == 0 or _leaf_name(path) in _UNBATCHED_CACHE_LEAVES:
      return leaf
    return fn(leaf)
  return jax.tree_util.tree_map_with_path(apply, cache)


def _flatten_beams(x):  # [b, k, ...] -> [b * k, ...]
  return x.reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def search(inputs, cache, tokens_to_logits: Callable, *, eos_id: int, beams: int,
           alpha: float, max_decode_len: int, max_decode_step: int = -1,
           min_log_prob: float = NEG_INF_VALUE):
  """The loop: (final BeamState, steps). cache leaves are [b, ...] (expanded here)."""
  batch = inputs.shape[0]
  beam_cache = map_beam_cache(lambda x: jnp.repeat(x[:, None], beams, axis=1), cache)
  keep_going = functools.partial(should_continue, alpha=alpha, max_decode_len=max_decode_len,
                                 max_decode_step=max_decode_step, min_log_prob=min_log_prob)

  def body(carry):
    state, cache = carry
    cur_token = jax.lax.dynamic_slice_in_dim(state.live_seqs, state.cur_index, 1, axis=2)
    decoding_state = DecodingState(
        cur_index=state.cur_index, sequences=_flatten_beams(state.live_seqs),
        cur_token=_flatten_beams(cur_token), cache=map_beam_cache(_flatten_beams, cache))
    flat_logits, flat_cache = tokens_to_logits(decoding_state)  # [b * k, v]
    logits = flat_logits.reshape(batch, beams, -1)
    new_state, parents = beam_step(
        state, logits, forced_tokens_at(inputs, state.cur_index + 1), eos_id=eos_id,
        alpha=alpha)
    cache = map_beam_cache(
        lambda x: _gather(x.reshape((batch, beams) + x.shape[1:]), parents), flat_cache)
    return new_state, cache

  final, _ = jax.lax.while_loop(lambda carry: keep_going(carry[0]), body,
                                (init_state(batch, beams, max_decode_len), beam_cache))
  return final


def beam_search(inputs, cache, tokens_to_logits: Callable, eos_id: int,
                num_decodes: int = 4, alpha: float = 0.6, max_decode_len: int | None = None,
                max_decode_step: int = -1, min_log_prob: float = NEG_INF_VALUE,
                decode_rng=None, cache_offset: int = 0):
  """T5X's `decoding.beam_search`: (sequences [B, beams, L], scores [B, beams]).

  inputs [B, L_in] int32: position 0 is the start slot; non-zero entries at i >= 1 are
  forced tokens. cache: the model cache for batch B (leaves with a batch axis are
  expanded to B * beams; T5X's scalar cache_index and cached_bias are shared).
  tokens_to_logits(DecodingState) -> (logits [B * beams, V], new cache); DecodingState
  carries T5X's scalar cur_index, the flattened sequences [B * beams, L + 1], the
  current tokens [B * beams, 1] and the flattened cache. L = max_decode_len (default
  L_in). Sorted ascending by score, best last. decode_rng is unused (as in T5X).

  There is no `initial_index` argument: T5X checks for it to decide whether to prefill
  the cache with the decoder prompt; without it, T5X passes prompts as forced inputs.
  """
  del decode_rng
  if cache_offset:
    raise ValueError('cache_offset is not supported: scanned layers put the cache\'s batch '
                     'axis second; jaxspec\'s beam search expects it first')
  if num_decodes < 1:
    raise ValueError(f'num_decodes (beams) must be >= 1, got {num_decodes}')
  inputs = jnp.asarray(inputs)
  if max_decode_len is None:
    max_decode_len = inputs.shape[1]
  final = search(inputs, cache, tokens_to_logits, eos_id=eos_id, beams=num_decodes,
                 alpha=alpha, max_decode_len=max_decode_len,
                 max_decode_step=max_decode_step, min_log_prob=min_log_prob)
  return final_output(final)


def check_beam_settings(beam: BeamConfig, max_decode_length: int):
  validation.check_max_decode_length(max_decode_length)
  if not isinstance(beam, BeamConfig):
    raise TypeError(f'beam must be a BeamConfig, got {type(beam).__name__}')


def generate_beam(params, encoder_tokens, *, config: T5Config, beam: BeamConfig,
                  max_decode_length: int, eos_id: int = EOS_ID) -> BeamOutput:
  """Beam search over encoder_tokens [b, s] with the T5 `params`, one step per token.

  Returns BeamOutput: tokens [b, beams, max_decode_length] sorted ascending by score
  (best last), scores [b, beams], steps run. Runs as one jit.
  """
  validation.check_encoder_tokens(encoder_tokens, config.vocab_size)
  check_beam_settings(beam, max_decode_length)
  return _generate_beam(params, encoder_tokens, config=config, beam=beam,
                        max_decode_length=max_decode_length, eos_id=eos_id)


def t5_beam_cache(params, encoder_tokens, *, config: T5Config, max_length: int, role: str
                  ) -> Any:
  """Encodes and returns the model's empty decoder cache [b, ...] of max_length."""
  model = T5(config, role=role)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  return model.apply(params, encoded, encoder_tokens, max_length, method=T5.init_cache)


@functools.partial(jax.jit, static_argnames=('config', 'beam', 'max_decode_length', 'eos_id'))
def _generate_beam(params, encoder_tokens, *, config: T5Config, beam: BeamConfig,
                   max_decode_length: int, eos_id: int) -> BeamOutput:
  model = T5(config)
  cache = t5_beam_cache(params, encoder_tokens, config=config,
                        max_length=max_decode_length, role=model.role)

  def tokens_to_logits(state: DecodingState):
    logits, new_cache = model.apply(params, state.cur_token, state.cache, method=T5.decode)
    return logits[:, 0], new_cache

  inputs = jnp.zeros((encoder_tokens.shape[0], max_decode_length), jnp.int32)
  final = search(inputs, cache, tokens_to_logits, eos_id=eos_id, beams=beam.num_beams,
                 alpha=beam.alpha, max_decode_len=max_decode_length,
                 max_decode_step=beam.max_decode_step, min_log_prob=beam.min_log_prob)
  tokens, scores = final_output(final)
  return BeamOutput(tokens=tokens, scores=scores, steps=final.cur_index)
