"""A T5 draft model: a smaller T5 over the target's vocabulary."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxspec import inference
from jaxspec.config import T5Config
from jaxspec.decoding.drafters import loops
from jaxspec.decoding.drafters.base import (DraftContext, Drafter, DraftSources,
                                            draft_confidence, draw_tokens)
from jaxspec.model import T5, DecoderCache, repeat_rows, rollback
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.model.sharding import DRAFT
from jaxspec.sampling import SamplingConfig, argmax, position_noise, standardize
from jaxspec.decoding.verification.coupled import coupled_tokens


class CachedDecoderDrafter(Drafter):
  """The proposal routes of a drafter that decodes with a cached decoder: subclasses
  define `decoder(params)` -> decode(tokens [b, k], cache) -> (logits [b, k, v], cache)
  and keep their DecoderCache as the drafter state."""

  proposes_top_branches = True

  def decoder(self, params):
    raise NotImplementedError

  def propose(self, params, state, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    return propose_from_decoder(self.decoder(params), state, context, gamma, sampling, keys)

  def propose_with_confidence(self, params, state, context: DraftContext, gamma: int,
                              sampling: SamplingConfig, keys, stop_below: float):
    """propose, plus the confidence of each draft; the draft steps stop once every row
    has drafted a token whose confidence is below stop_below (adaptive gamma)."""
    return propose_until_unsure(self.decoder(params), state, context, gamma, sampling, keys,
                                stop_below)

  def propose_coupled(self, params, state, context: DraftContext, gamma: int,
                      sampling: SamplingConfig, position_keys, keys=None):
    """propose, each draft drawn with its position's Gumbel noise (coupled
    verification): -> tokens [b, gamma], noise [b, gamma, v], state. keys unused."""
    del keys
    return propose_coupled_from_decoder(self.decoder(params), state, context, gamma,
                                        sampling, position_keys)

  def catch_up(self, params, state: DecoderCache, context: DraftContext, window: int):
    """The cache with x_{length-window}..x_{length-1} decoded in one step
    (catch_up_inputs)."""
    return catch_up_inputs(self.decoder(params), state, context, window)

  def propose_top_branches(self, params, state, context: DraftContext, gamma: int,
                           num_branches: int):
    """A greedy token tree for multi-draft verification (propose_top_branches_from_decoder)."""
    return propose_top_branches_from_decoder(self.decoder(params), state, context, gamma,
                                             num_branches)


@dataclasses.dataclass(frozen=True)
class T5Drafter(CachedDecoderDrafter):
  """A smaller T5 over the same vocabulary, with its own encoder pass and cache.

  Rollback is by index: each proposal starts by consuming x_{length-1}, x_length in
  one step (`consume_last_inputs`), which re-writes the slot of x_{length-1} and so
  covers the case where every draft was accepted and the drafter never consumed its
  last draft, without a shape change.
  """
  config: T5Config

  @property
  def vocab_size(self) -> int:
    return self.config.vocab_size

  def init_state(self, params, encoder_tokens, max_length: int):
    model = T5(self.config, role=DRAFT)
    encoded = model.apply(params, encoder_tokens, method=T5.encode)
    return model.apply(params, encoded, encoder_tokens, max_length, method=T5.init_cache)

  def decoder(self, params):
    """decode(tokens [b, k], cache) -> (logits [b, k, v], cache) of this draft model."""
    model = T5(self.config, role=DRAFT)
    return lambda tokens, cache: model.apply(params, tokens, cache, method=T5.decode)

  def load_params(self, sources: DraftSources):
    """The draft's own T5X checkpoint, laid out for decoding (sharded with a
    partitioner)."""
    checkpoint = sources.require_checkpoint('a T5 drafter')
    if sources.partitioner:
      return sources.partitioner.load_params(checkpoint, self.config, draft=True)
    return inference.load_model_params(checkpoint, self.config, for_decoding=True)


def consume_last_inputs(decode, cache: DecoderCache, context: DraftContext):
  """The first step of a proposal: -> logits after x_length [b, v], the cache with
  x_0..x_length and its end at length + 1 (where d_1 goes).

  One two-token step over [x_{length-1}, x_length] from position length - 1. At
  length 0 (the decode's first proposal) it runs over [x_0, x_0] from position 0 and
  keeps the first position's logits: causal attention makes them those of x_0 alone,
  and the second slot is overwritten by d_1 (the end is set back to 1).
  """
  start = jnp.maximum(context.length - 1, 0)  # [b]
  logits, cache = decode(context.last_two_inputs(), rollback(cache, start))  # [b, 2, v]
  last_logits = jnp.where((context.length > 0)[:, None], logits[:, 1], logits[:, 0])
  return last_logits, rollback(cache, context.length + 1)


def catch_up_inputs(decode, cache: DecoderCache, context: DraftContext, window: int):
  """The cache after one step over `window` decoder inputs from x_s, s = max(length -
  window, 0): every slot before length then holds its committed input. Inputs past
  x_length (a window running past it near the start) are written at slots the next
  proposal rewrites before reading (consume_last_inputs)."""
  start = jnp.maximum(context.length - window, 0)  # [b]
  padded = jnp.pad(context.tokens, ((0, 0), (1, 0)))  # [b, 1 + L]; padded[:, j] = x_j
  positions = jnp.minimum(start[:, None] + jnp.arange(window)[None, :], padded.shape[1] - 1)
  _, cache = decode(jnp.take_along_axis(padded, positions, axis=1), rollback(cache, start))
  return rollback(cache, context.length)


def propose_until_unsure(decode, cache: DecoderCache, context: DraftContext, gamma: int,
                         sampling: SamplingConfig, keys, stop_below: float, *,
                         first_step=consume_last_inputs):
  """As propose_from_decoder, plus the draft_confidence of each draft: -> tokens
  [b, gamma], q [b, gamma, v], confidence [b, gamma], cache. A row also stops after a
  draft whose confidence is below stop_below (adaptive gamma); positions not drafted are
  0 in all three. The keys are propose_from_decoder's, so the drafts up to each row's
  stop are its drafts.
  """
  return _propose_steps(decode, cache, context, gamma, _sampled_draw(sampling, keys, gamma),
                        sampling=sampling, stop_below=stop_below, first_step=first_step)


def propose_from_decoder(decode, cache: DecoderCache, context: DraftContext, gamma: int,
                         sampling: SamplingConfig, keys, *, first_step=consume_last_inputs):
  """gamma drafts from a cached decoder: -> tokens [b, gamma], q [b, gamma, v], cache.

  decode(tokens [b, k], cache) -> (logits [b, k, v], cache), e.g. T5.decode. The cache
  consumes [x_{length-1}, x_length] in one step (consume_last_inputs), then up to
  gamma - 1 single steps run in a while loop. With context.eos_id set, the loop ends
  once every row has drafted EOS or was finished (context.finished()); the positions
  not drafted are token 0, q 0. keys [b]: one PRNG key per row.
  first_step(decode, cache, context) -> (logits after x_length [b, v], cache at length + 1):
  how the proposal starts (consume_last_inputs; a feature-level head reads a window).
  """
  tokens, probs, _, cache = _propose_steps(decode, cache, context, gamma,
                                           _sampled_draw(sampling, keys, gamma),
                                           sampling=sampling, stop_below=None,
                                           first_step=first_step)
  return tokens, probs, cache


def propose_coupled_from_decoder(decode, cache: DecoderCache, context: DraftContext,
                                 gamma: int, sampling: SamplingConfig, position_keys, *,
                                 first_step=consume_last_inputs):
  """As propose_from_decoder, each draft i drawn as the baseline draws its position:
  argmax(adjusted logits + the Gumbel noise of position_keys[:, i]) (coupled
  verification); at temperature 0 the argmax alone. -> tokens [b, gamma], noise
  [b, gamma, v] (0 where not drafted; None at temperature 0), cache.
  """
  def draw(i, logits):
    if sampling.is_greedy:
      return argmax(logits), None
    noise = position_noise(position_keys[:, i], logits.shape[-1])  # [b, v]
    return coupled_tokens(logits, noise, sampling), noise

  tokens, noise, _, cache = _propose_steps(decode, cache, context, gamma, draw,
                                           sampling=sampling, stop_below=None,
                                           first_step=first_step)
  return tokens, noise, cache


def _sampled_draw(sampling: SamplingConfig, keys, gamma: int):
  """draw(i, logits [b, v]) -> (token [b], q [b, v]): draft i from the standardized q
  with the i-th of gamma keys split from each row's key keys [b]."""
  step_keys = jax.vmap(lambda k: jax.random.split(k, gamma))(keys)  # [b, gamma]

  def draw(i, logits):
    if sampling.is_greedy:  # standardize's one-hot q, without taking its argmax again
      token = argmax(logits)
      return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)
    probs = standardize(logits, sampling)  # [b, v]
    return draw_tokens(step_keys[:, i], probs, sampling), probs
  return draw


def _propose_steps(decode, cache: DecoderCache, context: DraftContext, gamma: int, draw, *,
                   sampling: SamplingConfig, stop_below: float | None,
                   first_step=consume_last_inputs):
  """The draft steps of a proposal: draw(i, logits [b, v]) -> (token [b], record [b, v]
  or None) picks draft i. -> tokens [b, g], records [b, g, v] (what draw returned with
  each token: q, or the coupled draws' noise; None if it returns none), confidence
  [b, g] (None without stop_below), cache. A row stops after a drafted EOS
  (context.eos_id set) or a draft whose confidence is below stop_below; finished rows
  after their first draft; the steps end when every row has stopped or gamma are
  drafted (context.draft_loop: a while loop that exits there, or gamma - 1 steps with
  those after every row stopped discarded; the same drafts either way)."""
  last_logits, cache = first_step(decode, cache, context)  # [b, v]
  batch, vocab = last_logits.shape
  first_token, first_record = draw(0, last_logits)
  tokens = jnp.zeros((batch, gamma), jnp.int32)
  records = None if first_record is None else jnp.zeros((batch, gamma, vocab), jnp.float32)
  confidences = None if stop_below is None else jnp.zeros((batch, gamma), jnp.float32)

  def record(i, logits, token, draw_record, tokens, records, confidences, stopped,
             live=True):
    """Records draft i, drawn from logits [b, v] (nothing where the step is not live:
    every row had stopped before it)."""
    stopped = stopped | (False if context.eos_id is None else token == context.eos_id)
    if confidences is not None:
      confidence = draft_confidence(logits, draw_record, sampling)  # [b]
      confidences = confidences.at[:, i].set(loops.kept(live, confidence))
      stopped = stopped | (confidence < stop_below)
    if records is not None:
      records = records.at[:, i].set(loops.kept(live, draw_record))
    return tokens.at[:, i].set(loops.kept(live, token)), records, confidences, stopped

  def drafting(carry):
    return ~jnp.all(carry[-1])  # some row has not stopped

  def step(i, carry, live):
    cache, tokens, records, confidences, stopped = carry
    with cpu_matmul.active_rows(~stopped):  # a stopped row's steps are never used
      logits, cache = decode(tokens[:, i - 1][:, None], cache)  # [b, 1, v]
    token, draw_record = draw(i, logits[:, 0])
    return (cache,) + record(i, logits[:, 0], token, draw_record, tokens, records,
                             confidences, stopped, live)

  first = record(0, last_logits, first_token, first_record, tokens, records, confidences,
                 context.finished())
  cache, tokens, records, confidences, _ = loops.run_draft_steps(
      context.draft_loop, 1, gamma, drafting, step, (cache,) + first)
  return tokens, records, confidences, cache


def propose_top_branches_from_decoder(decode, cache: DecoderCache, context: DraftContext,
                                      gamma: int, num_branches: int, *,
                                      first_step=consume_last_inputs):
  """k greedy branches from a cached decoder (multi-draft verification at temperature 0).

  Branch j starts with the draft's j-th most likely token after x_length (branch 0 is
  the greedy draft; lax.top_k puts the lower index first on ties, as argmax) and
  continues greedily. -> tokens [b, k, g], q [b, k, g, v] (one-hot at the tokens: each
  was chosen deterministically), cache [b k] (row b's branch j at b k + j).
  """
  last_logits, cache = first_step(decode, cache, context)  # [b, v]
  batch, vocab = last_logits.shape
  _, first = jax.lax.top_k(last_logits, num_branches)  # [b, k]
  cache = repeat_rows(cache, num_branches)  # [b k]

  def step(carry, _):
    cache, token = carry  # token [b k]
    logits, cache = decode(token[:, None], cache)
    next_token = argmax(logits[:, 0])
    return (cache, next_token), next_token

  first = first.reshape(-1).astype(jnp.int32)  # [b k]
  (cache, _), rest = jax.lax.scan(step, (cache, first), None, length=gamma - 1)  # [g-1, b k]
  tokens = jnp.concatenate([first[:, None], jnp.swapaxes(rest, 0, 1)], axis=1)  # [b k, g]
  tokens = tokens.reshape(batch, num_branches, gamma)
  return tokens, jax.nn.one_hot(tokens, vocab, dtype=jnp.float32), cache
