"""Staged speculation: a drafter that is itself decoded speculatively.

A cached-decoder drafter (the middle stage, e.g. the int8 draft) drafts one token per
decode step, and on a CPU its sequential steps are a large part of an iteration. A
StagedDrafter lets a cheaper `proposer` (a small T5 draft, prompt lookup, n-grams, or
another StagedDrafter: stages nest to any depth) propose `lookahead` tokens; the
middle drafter scores them in ONE decode step over lookahead + 1 positions and keeps
its own tokens, as the target does with the middle's drafts:

  round: the proposer proposes p_1..p_k after the drafts so far, d_1..d_n;
         the drafter decodes [d_n, p_1, ..., p_k] at once -> its logits after each;
         it judges p_1.. as the target judges drafts and gains a + 1 drafts, a of them
         accepted proposals and one its own (the correction, or the token after p_k);
         its cache is rolled back past what it rejected (an index update).

The drafts the target sees are the middle drafter's own, so target-level verification
stays exact and its acceptance is the middle drafter's:
  temperature 0: p_i is kept while it equals the drafter's argmax: the drafts are its
      greedy drafts token for token;
  sampling: Algorithm 1 between the drafter's q (as target) and the proposer's (as
      draft): each draft is distributed as the drafter's q given those before it, and
      that q is what the target's verification receives;
  coupled verification: the drafter's draws are argmax(adjusted logits + the noise of
      the output position), deterministic given the position, so p_i is kept while it
      equals that draw: the drafts are the drafter's coupled drafts token for token.
      The proposer draws with the same positions' noise (propose_coupled).

Rounds run until every row has gamma drafts (or drafted EOS), at most gamma - 1 of
them (DraftContext.draft_loop: a while loop that exits there, or gamma - 1 rounds with
those after every row finished discarded); a round's drafts past gamma are dropped. A
proposer's cache has read only the drafts it proposed or was handed as context, not all
those the target then accepts: each proposal starts by catching it up
(Drafter.catch_up: one step over the last gamma + 1 inputs). The middle drafter's cache
holds lookahead more positions than it would alone. Its first draft of a proposal comes
from its usual first step (consume_last_inputs), so a proposal costs 1 + rounds drafter
steps and rounds proposer calls, against gamma steps single-stage; StageStats counts
them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.decoding.drafters import loops
from jaxspec.errors import InvalidSetting
from jaxspec.decoding.drafters.base import (DraftContext, Drafter, DraftSources,
                                            drafts_through_first)
from jaxspec.decoding.drafters.t5 import CachedDecoderDrafter, consume_last_inputs
from jaxspec.decoding.verification.coupled import coupled_tokens
from jaxspec.decoding.verification.token import matching_verdict, speculative_verdict
from jaxspec.model import rollback
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.sampling import SamplingConfig, argmax, position_noise, sample_probs, standardize


@flax.struct.dataclass
class StageStats:
  """What the stages did over a decode (summed over proposals)."""
  rounds: jax.Array  # [] proposer calls, each followed by one multi-position drafter step
  drafter_steps: jax.Array  # [] drafter decode steps: one per proposal, plus one a round
  proposed: jax.Array  # [] proposals judged by the drafter (rows still drafting)
  accepted: jax.Array  # [] of them accepted
  nested: Any = None  # the proposer's StageStats where it is staged itself

  @property
  def acceptance(self):
    """The fraction of the proposer's tokens the drafter accepted."""
    return self.accepted / jnp.maximum(self.proposed, 1)

  def summary(self) -> list[dict]:
    """Host numbers for reports: each stage's calls and acceptance, outermost first."""
    stage = dict(rounds=int(self.rounds), drafter_steps=int(self.drafter_steps),
                 proposed=int(self.proposed), accepted=int(self.accepted),
                 acceptance=round(float(self.acceptance), 4))
    return [stage] + (self.nested.summary() if self.nested is not None else [])


@flax.struct.dataclass
class StagedState:
  drafter: Any  # the middle drafter's DecoderCache
  proposer: Any  # the proposer's state
  stats: StageStats


def _no_stats(proposer_state) -> StageStats:
  zero = jnp.zeros((), jnp.int32)
  nested = proposer_state.stats if isinstance(proposer_state, StagedState) else None
  return StageStats(rounds=zero, drafter_steps=zero, proposed=zero, accepted=zero,
                    nested=nested)


@dataclasses.dataclass(frozen=True)
class StagedDrafter(Drafter):
  """`drafter` decoded speculatively with `proposer`'s proposals (module docstring).

  drafter: a cached-decoder drafter (Int8Drafter, T5Drafter, SharedEncoderDrafter):
    its drafts are what the target verifies.
  proposer: any drafter over the same vocabulary, StagedDrafter included.
  lookahead: tokens the proposer proposes a round (the drafter's step covers one more).
  proposer_checkpoint: the proposer's own checkpoint, where it has one (load_params);
    the launcher's draft_checkpoint goes to `drafter`.
  params: {'drafter': ..., 'proposer': ...}.
  """
  drafter: CachedDecoderDrafter
  proposer: Drafter
  lookahead: int = 3
  proposer_checkpoint: str | None = None

  def __post_init__(self):
    if not isinstance(self.drafter, CachedDecoderDrafter):
      raise InvalidSetting('a staged drafter speculates on a drafter with a cached decoder '
                           f'(Int8Drafter, T5Drafter, SharedEncoderDrafter); got '
                           f'{type(self.drafter).__name__}')
    if self.proposer.reads_target_features:
      raise InvalidSetting(f'a {type(self.proposer).__name__} drafts from the target\'s '
                           'verify steps, which a staged drafter\'s proposer never sees; use '
                           'it as the drafter of speculative decoding itself')
    if self.lookahead < 1:
      raise InvalidSetting(f'lookahead must be >= 1 (tokens proposed a round), got '
                           f'{self.lookahead}')
    if self.proposer.vocab_size != self.drafter.vocab_size:
      raise InvalidSetting(
          f'the proposer and the drafter must share a vocabulary: proposer vocab_size '
          f'{self.proposer.vocab_size}, drafter vocab_size {self.drafter.vocab_size}')

  @property
  def vocab_size(self) -> int:
    return self.drafter.vocab_size

  @property
  def shares_target_cache(self) -> bool:
    return self.drafter.shares_target_cache or self.proposer.shares_target_cache

  # ---- state ----

  def _state(self, drafter_state, proposer_state) -> StagedState:
    return StagedState(drafter=drafter_state, proposer=proposer_state,
                       stats=_no_stats(proposer_state))

  def init_state(self, params, encoder_tokens, max_length: int) -> StagedState:
    room = max_length + self.lookahead  # a round may run lookahead past gamma
    return self._state(self.drafter.init_state(params['drafter'], encoder_tokens, room),
                       self.proposer.init_state(params['proposer'], encoder_tokens, room))

  def init_state_for_decode(self, params, encoder_tokens, target_encoded, max_length: int,
                            target_cache=None) -> StagedState:
    room = max_length + self.lookahead
    return self._state(
        self.drafter.init_state_for_decode(params['drafter'], encoder_tokens, target_encoded,
                                           room, target_cache),
        self.proposer.init_state_for_decode(params['proposer'], encoder_tokens,
                                            target_encoded, room, target_cache))

  def load_params(self, sources: DraftSources):
    proposer_sources = dataclasses.replace(sources, checkpoint=self.proposer_checkpoint)
    return {'drafter': self.drafter.load_params(sources),
            'proposer': self.proposer.load_params(proposer_sources)}

  def stats(self, state: StagedState) -> StageStats:
    return state.stats

  def catch_up(self, params, state: StagedState, context: DraftContext, window: int):
    """Both stages caught up (this drafter proposing for an outer stage)."""
    return state.replace(
        drafter=self.drafter.catch_up(params['drafter'], state.drafter, context, window),
        proposer=self.proposer.catch_up(params['proposer'], state.proposer, context, window))

  # ---- proposals ----

  def propose(self, params, state: StagedState, context: DraftContext, gamma: int,
              sampling: SamplingConfig, keys):
    """-> the drafter's gamma drafts [b, gamma], their q [b, gamma, v], state."""
    if sampling.is_greedy:
      rule = _GreedyRounds(self.proposer, params['proposer'], sampling, keys)
    else:
      rule = _SampledRounds(self.proposer, params['proposer'], sampling, keys)
    return self._propose(params, state, context, gamma, rule)

  def propose_coupled(self, params, state: StagedState, context: DraftContext, gamma: int,
                      sampling: SamplingConfig, position_keys, keys=None):
    """-> the drafter's coupled drafts [b, gamma], their noise [b, gamma, v] (None at
    temperature 0), state."""
    rule = _CoupledRounds(self.proposer, params['proposer'], sampling, position_keys, keys)
    return self._propose(params, state, context, gamma, rule)

  def _propose(self, params, state: StagedState, context: DraftContext, gamma: int, rule):
    decode = self.drafter.decoder(params['drafter'])
    k = self.lookahead
    # The proposer saw only some of the drafts the target has since accepted (and none
    # of its token): it reads the gamma + 1 inputs before length first. The drafter read
    # every draft but its last, as alone, which its first step reads.
    proposer_state = self.proposer.catch_up(params['proposer'], state.proposer, context,
                                            gamma + 1)
    width = gamma + k + 1  # room for a last round's overshoot
    batch = context.length.shape[0]
    start = context.length  # [b] the position of draft 1 in the output

    first_logits, cache = consume_last_inputs(decode, state.drafter, context)  # [b, v]
    first, first_record = rule.first(first_logits)
    drafts = jnp.zeros((batch, width), jnp.int32).at[:, 0].set(first)
    records = None
    if first_record is not None:
      records = jnp.zeros((batch, width, first_record.shape[-1]), jnp.float32)
      records = records.at[:, 0].set(first_record)
    # The committed tokens and the drafts so far, as the proposer's context sees them.
    tokens = jnp.pad(context.tokens, ((0, 0), (0, width)))
    tokens = _put(tokens, start, first[:, None], jnp.ones((batch,), jnp.int32))
    stopped = context.finished() | _is_eos(first, context.eos_id)
    count = jnp.ones((batch,), jnp.int32)  # drafts so far per row

    def drafting(carry):
      count, stopped = carry[0], carry[1]
      return jnp.any(~stopped & (count < gamma))

    def round_(index, carry, live):
      """One round (number `index`); with live False (every row done drafting: the
      early-exit loop has ended) it gains nothing and counts nothing."""
      count, stopped, drafts, records, tokens, cache, proposer_state, stats = carry
      active = ~stopped & (count < gamma)  # [b]
      inner = DraftContext(tokens=tokens, length=start + count,
                           encoder_tokens=context.encoder_tokens, eos_id=context.eos_id,
                           draft_loop=context.draft_loop)
      last = jnp.take_along_axis(drafts, (count - 1)[:, None], axis=1)  # [b, 1]
      with cpu_matmul.active_rows(active):  # rows done drafting cost no products
        proposals, proposal_record, new_proposer_state = rule.propose(
            proposer_state, inner, k, count, index)  # [b, k]
        # One step over d_n, p_1..p_k from d_n's slot: logits after each [b, k + 1, v].
        logits, cache = decode(jnp.concatenate([last, proposals], axis=1),
                               rollback(cache, start + count))
      proposed = jnp.full((batch,), k, jnp.int32)
      if context.eos_id is not None:  # a proposer may leave the rest after its EOS undrafted
        proposed = drafts_through_first(proposals == context.eos_id)
      accepted, new, new_records = rule.judge(logits, proposals, proposal_record, proposed,
                                              count, index)  # [b], [b, k + 1], [b, k + 1, v]
      gained = jnp.where(active, accepted + 1, 0)
      if context.eos_id is not None:  # drafts after a drafted EOS are never committed
        is_eos = (new == context.eos_id) & (jnp.arange(k + 1)[None, :] < gained[:, None])
        gained = jnp.where(jnp.any(is_eos, axis=1),
                           jnp.minimum(gained, jnp.argmax(is_eos, axis=1) + 1), gained)
        stopped = stopped | jnp.any(is_eos, axis=1)
      drafts = _put(drafts, count, new, gained)
      if records is not None:
        records = _put(records, count, new_records, gained)
      tokens = _put(tokens, start + count, new, gained)
      counted = loops.kept(live, 1)  # this round, where it is one the early exit runs
      stats = stats.replace(
          rounds=stats.rounds + counted, drafter_steps=stats.drafter_steps + counted,
          proposed=stats.proposed + jnp.sum(jnp.where(active, proposed, 0)),
          accepted=stats.accepted + jnp.sum(jnp.where(active, accepted, 0)))
      return (count + gained, stopped, drafts, records, tokens, cache,
              _proposer_counts_kept(live, new_proposer_state, proposer_state), stats)

    stats = state.stats.replace(drafter_steps=state.stats.drafter_steps + 1)
    carry = (count, stopped, drafts, records, tokens, cache, proposer_state, stats)
    # Every round gains an active row a draft or more, so gamma - 1 rounds fill gamma.
    count, _, drafts, records, _, cache, proposer_state, stats = loops.run_draft_steps(
        context.draft_loop, 0, gamma - 1, drafting, round_, carry)
    if isinstance(proposer_state, StagedState):
      stats = stats.replace(nested=proposer_state.stats)
    state = StagedState(drafter=cache, proposer=proposer_state, stats=stats)
    records = None if records is None else records[:, :gamma]
    return drafts[:, :gamma], records, state


def _proposer_counts_kept(live, new_state, old_state):
  """The proposer's state after a round; where the round is not live (the early-exit
  loop never ran it) a nested StagedDrafter's counts stay as they were (its caches may
  hold what the round wrote past every row's end, which nothing reads)."""
  if live is True or not isinstance(new_state, StagedState):
    return new_state
  return new_state.replace(stats=jax.tree_util.tree_map(
      lambda new, old: jnp.where(live, new, old), new_state.stats, old_state.stats))


def _put(buffer, start, values, count):
  """buffer [b, n, ...] with values[:, j] written at start[b] + j for j < count[b] (the
  rest, and positions past n, left as they were)."""
  width = values.shape[1]
  positions = start[:, None] + jnp.arange(width, dtype=jnp.int32)[None, :]  # [b, w]
  positions = jnp.where(jnp.arange(width)[None, :] < count[:, None], positions,
                        buffer.shape[1])  # past the buffer: dropped
  rows = jnp.arange(buffer.shape[0])[:, None]
  return buffer.at[rows, positions].set(values.astype(buffer.dtype), mode='drop')


def _is_eos(tokens, eos_id):
  return jnp.zeros(tokens.shape, bool) if eos_id is None else tokens == eos_id


# ---- How a round proposes and judges, by verification mode. ----
# propose(proposer_state, context, k, count [b], round) -> proposals [b, k], what the
#   judge needs of them (q, or None), proposer state;
# judge(logits [b, k+1, v], proposals, their record, proposed [b] (those past it are
#   never accepted), count, round) -> accepted [b] in 0..proposed, the drafter's tokens
#   [b, k+1] (accepted proposals, then its own), their records [b, k+1, v] or None;
# first(logits [b, v]) -> the proposal's first draft [b] and its record.


@dataclasses.dataclass(frozen=True)
class _GreedyRounds:
  """Temperature 0: proposals kept while they equal the drafter's argmax."""
  proposer: Drafter
  params: Any
  sampling: SamplingConfig
  keys: Any

  def first(self, logits):
    token = argmax(logits)
    return token, jax.nn.one_hot(token, logits.shape[-1], dtype=jnp.float32)

  def propose(self, proposer_state, context, k, count, index):
    del count, index
    proposals, _, proposer_state = self.proposer.propose(
        self.params, proposer_state, context, k, self.sampling, self.keys)
    return proposals, None, proposer_state

  def judge(self, logits, proposals, proposal_record, proposed, count, index):
    del proposal_record, count, index
    own = argmax(logits)  # [b, k + 1]
    accepted, _, _ = matching_verdict(proposals, own, proposed)
    return accepted, own, jax.nn.one_hot(own, logits.shape[-1], dtype=jnp.float32)


@dataclasses.dataclass(frozen=True)
class _SampledRounds:
  """Sampling: Algorithm 1 with the drafter's q as the target distribution."""
  proposer: Drafter
  params: Any
  sampling: SamplingConfig
  keys: Any  # [b] this proposal's key per row

  def _round_keys(self, index):
    """[b] keys for round `index` (round -1: the first draft), split in (proposer, judge)."""
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(self.keys, index + 1)
    split = jax.vmap(jax.random.split)(keys)  # [b, 2]
    return split[:, 0], split[:, 1]

  def first(self, logits):
    probs = standardize(logits, self.sampling)  # [b, v]
    _, draw_keys = self._round_keys(-1)
    return jax.vmap(sample_probs)(draw_keys, probs), probs

  def propose(self, proposer_state, context, k, count, index):
    del count
    proposer_keys, _ = self._round_keys(index)
    return self.proposer.propose(self.params, proposer_state, context, k, self.sampling,
                                 proposer_keys)

  def judge(self, logits, proposals, proposal_probs, proposed, count, index):
    del count
    _, judge_keys = self._round_keys(index)
    probs = standardize(logits, self.sampling)  # [b, k + 1, v], the drafter's q

    def one_row(key, proposals, proposal_probs, probs, proposed):
      verdict = speculative_verdict(key, proposals[None], proposal_probs[None], probs[None],
                                    num_drafts=proposed[None])
      return verdict.num_accepted[0], verdict.next_token[0]

    accepted, next_token = jax.vmap(one_row)(judge_keys, proposals, proposal_probs, probs,
                                             proposed)
    position = jnp.arange(proposals.shape[1] + 1)[None, :]
    own = jnp.where(position < accepted[:, None], jnp.pad(proposals, ((0, 0), (0, 1))),
                    next_token[:, None])  # [b, k + 1]; only the first accepted + 1 count
    return accepted, own, probs


@dataclasses.dataclass(frozen=True)
class _CoupledRounds:
  """Coupled verification: proposals kept while they equal the drafter's draw under the
  output position's noise."""
  proposer: Drafter
  params: Any
  sampling: SamplingConfig
  position_keys: Any  # [b, gamma] keys of output positions length .. (None: greedy)
  keys: Any

  def _window(self, count, width):
    """[b, width] keys of drafts count .. count + width - 1 (those past gamma, never
    kept, reuse the last key)."""
    gamma = self.position_keys.shape[1]
    index = jnp.minimum(count[:, None] + jnp.arange(width)[None, :], gamma - 1)
    return jnp.take_along_axis(self.position_keys, index.reshape(index.shape + (1,) *
                               (self.position_keys.ndim - 2)), axis=1)

  def _draws(self, logits, count):
    """The drafter's coupled draws from logits [b, w, v] of drafts count.. -> tokens
    [b, w], noise [b, w, v] (None at temperature 0)."""
    if self.sampling.is_greedy:
      return argmax(logits), None
    noise = position_noise(self._window(count, logits.shape[1]), logits.shape[-1])
    return coupled_tokens(logits, noise, self.sampling), noise

  def first(self, logits):
    tokens, noise = self._draws(logits[:, None], jnp.zeros(logits.shape[:1], jnp.int32))
    return tokens[:, 0], None if noise is None else noise[:, 0]

  def propose(self, proposer_state, context, k, count, index):
    del index
    keys = None if self.sampling.is_greedy else self._window(count, k)
    proposals, _, proposer_state = self.proposer.propose_coupled(
        self.params, proposer_state, context, k, self.sampling, keys, self.keys)
    return proposals, None, proposer_state

  def judge(self, logits, proposals, proposal_record, proposed, count, index):
    del proposal_record, index
    own, noise = self._draws(logits, count)
    accepted, _, _ = matching_verdict(proposals, own, proposed)
    return accepted, own, noise

