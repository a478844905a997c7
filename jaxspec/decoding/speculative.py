"""Speculative decoding (Algorithm 1) for T5, as one jit-compiled while loop.

Each iteration, for every row independently:
  1. the drafter proposes gamma tokens d_1..d_g with their standardized q;
  2. the target scores [x_length, d_1..d_g] in ONE cached decode step (g+1 positions
     at the row's own cache offset), giving p_1..p_{g+1};
  3. speculative sampling accepts n drafts and draws the next token (residual
     sample at the first rejection, bonus sample from p_{g+1} if all pass); with
     verification='coupled' drafts count while they equal the target's own draws with
     the baseline's per-position noise, and the next token is the target's draw;
  4. d_1..d_n and the next token are committed (clipped at EOS and the max length);
     both caches are rolled back by index at their next use.

With SpeculativeConfig.verify_lengths, step 2 runs over fewer positions when every
row's proposal ended early (at a drafted EOS, or an adaptive stop): the shortest listed
length that holds the longest proposal, chosen per iteration by lax.switch among
target steps compiled for each length.

With SpeculativeConfig.num_drafts = k > 1 steps 1-3 run on k branches of drafts
verified in one tree-shaped target step (jaxspec/decoding/verification/tree.py).

There is no separate first-token step: the first iteration starts from x_0 alone
(length 0), the drafter proposes d_1..d_g after it and the target verifies
[x_0, d_1..d_g], so even the first call can commit up to g + 1 tokens.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from jaxspec.decoding import verification
from jaxspec.decoding.verification import block as block_verification
from jaxspec import validation
from jaxspec.errors import InvalidSetting
from jaxspec.config import EOS_ID, OMIT_AT_DEFAULT, T5Config
from jaxspec.decoding import common
from jaxspec.decoding.verification import tree as multi_draft
from jaxspec.decoding.drafters import loops as draft_loops
from jaxspec.decoding.drafters.base import DraftContext, Drafter, drafts_through_first
from jaxspec.model import T5, DecoderCache, rollback
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.sampling import (SamplingConfig, gather_probs, nonfinite_logits, position_noise,
                              standardize, token_log_probs)
from jaxspec.decoding.verification.coupled import coupled_tokens, coupled_verdict
from jaxspec.decoding.verification.token import (greedy_verdict, mask_unproposed,
                                                 speculative_verdict)

AUTO = validation.AUTO_GAMMA  # gamma chosen per batch (jaxspec.decoding.auto_gamma)
VERIFICATIONS = tuple(verification.RULES)  # ('token', 'block', 'coupled')


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
  """Static settings of speculative decoding."""
  # Drafted tokens per target call; 'auto': chosen per batch from measured costs (0, the
  # baseline, included) by jaxspec.decoding.auto_gamma, which the launcher and
  # jaxspec.pairs use; speculative_generate itself takes an integer.
  gamma: int | str = 4
  # Lenience l in (0, 1] (paper A.5). 1 is exact; l < 1 CHANGES THE OUTPUT: it accepts
  # more drafts (for sampling, p/(l q); for argmax, p(x) >= l max p).
  lenience: float = 1.0
  # 'token': Algorithm 1, drafts judged one by one up to the first rejection. 'block':
  # block verification (Sun et al. 2025, jaxspec/decoding/verification/block.py), the drafts
  # judged jointly; also exact, never fewer accepted drafts in expectation.
  # 'coupled': the drafter draws each position with the Gumbel noise of that position's
  # key, as the baseline does, and the target draws every verified position with the
  # same noise; drafts count while they equal the target's draws, and the next token is
  # the target's draw. The output is the baseline's for the same PRNG key, token for
  # token (so exactly the target's distribution), with no q, residual or accept draws;
  # a draft passes with probability P(coupled draws agree), at least
  # (1 - TV) / (1 + TV) against Algorithm 1's 1 - TV. At temperature 0 it decides as
  # 'token' does, without building the drafts' one-hot q.
  verification: str = 'token'
  # Adaptive gamma: a row stops drafting after the first draft whose confidence (the
  # largest probability of q; at temperature 0 of the draft's softmax, see
  # drafter.draft_confidence) is below this threshold. That draft is still proposed,
  # so rows draft 1..gamma tokens, gamma the static maximum; T5 drafters skip the
  # steps after every row stopped. 0 always drafts gamma. Exact for any threshold:
  # drafts a row did not propose are never accepted.
  draft_confidence_threshold: float = 0.0
  # Multi-draft verification (jaxspec/decoding/verification/tree.py): k branches of gamma
  # drafts per row, verified in ONE target step over a token tree of 1 + k * gamma
  # positions. Sampling: k i.i.d. drafts and recursive rejection sampling (exact).
  # Temperature 0: a top-k tree from T5 drafters (branch j starts with the draft's j-th
  # choice); other drafters would propose k equal drafts and decode as with k = 1.
  # 1 is Algorithm 1 unchanged. Token-wise, exact only, no adaptive gamma.
  num_drafts: int = 1
  # Shorter verify steps: lengths k in [2, gamma], increasing. An iteration whose
  # longest proposal among the decoding rows has n < gamma drafts (a drafted EOS ends a
  # proposal; so does an adaptive stop) runs the target over the shortest listed k >=
  # n + 1 positions instead of gamma + 1; each length is a target step compiled of its
  # own, picked by lax.switch. The output is unchanged: a position's logits depend only
  # on the positions before it, and the positions left out were never proposed. It pays
  # where a step's cost grows with its positions (the CPU kernel: 5 rows a pass with
  # AVX-512), for outputs short against gamma; () always verifies gamma + 1.
  verify_lengths: tuple[int, ...] = dataclasses.field(default=(), metadata=OMIT_AT_DEFAULT)
  # How a drafter's proposal loops over its draft steps (jaxspec/decoding/drafters/loops.py):
  # 'early_exit' ends them once every row has stopped (a while loop whose trip count XLA
  # cannot see: XLA:GPU waits on the host for its condition at every step); 'static'
  # runs gamma steps, those after every row stopped discarded (a trip count XLA sees);
  # 'auto': early exit on the CPU, static elsewhere. The output is the same either way.
  draft_loop: str = dataclasses.field(default=draft_loops.AUTO, metadata=OMIT_AT_DEFAULT)

  def __post_init__(self):
    validation.check_gamma_setting('jaxspec.SpeculativeConfig.gamma', self.gamma)
    draft_loops.check_draft_loop(self.draft_loop, 'jaxspec.SpeculativeConfig.draft_loop')
    if not 0.0 < self.lenience <= 1.0:
      raise InvalidSetting(f'lenience must be in (0, 1] (1 is exact), got {self.lenience}')
    if self.verification not in verification.RULES:
      raise InvalidSetting(f'verification must be one of {VERIFICATIONS}, '
                           f'got {self.verification!r}')
    if not 0.0 <= self.draft_confidence_threshold <= 1.0:
      raise InvalidSetting('draft_confidence_threshold must be in [0, 1] (0 always drafts '
                           f'gamma), got {self.draft_confidence_threshold}')
    if self.num_drafts < 1:
      raise InvalidSetting(f'num_drafts must be >= 1 (1 is a single draft), got {self.num_drafts}')
    lengths = self.verify_lengths
    if isinstance(lengths, list):  # as gin may write it; hashable for jit
      object.__setattr__(self, 'verify_lengths', lengths := tuple(lengths))
    most = self.gamma if self.gamma != AUTO else max(lengths, default=2)
    if (not isinstance(lengths, tuple) or not all(type(k) is int for k in lengths)
        or any(not 2 <= k <= most for k in lengths)
        or any(a >= b for a, b in zip(lengths, lengths[1:]))):
      above = (isinstance(lengths, tuple) and self.gamma != AUTO
               and any(type(k) is int and k > most for k in lengths))
      raise InvalidSetting(
          f'verify_lengths must be a tuple of increasing integers in [2, gamma '
          f'{self.gamma}] (positions of a shorter verify step), got {lengths!r}'
          + (f'; a length above gamma {self.gamma} is no shorter than a whole step '
             f'({self.gamma + 1} positions): leave it out (VERIFY_LENGTHS in the shipped '
             'gin configs)' if above else ''))
    self._check_rule(verification.RULES[self.verification])
    if self.num_drafts > 1:
      self._check_rule(verification.TREE_RULE)

  def _check_rule(self, rule: verification.VerificationRule):
    """Refuses the options `rule` cannot take (each verification module's RULE)."""
    unsupported = rule.unsupported(
        lenience=self.lenience, draft_confidence_threshold=self.draft_confidence_threshold,
        num_drafts=self.num_drafts, verify_lengths=self.verify_lengths)
    if rule is verification.TREE_RULE and self.verification != 'token':
      unsupported.insert(0, f"verification='{self.verification}'")
    if not unsupported:
      return
    if rule is verification.TREE_RULE:
      raise InvalidSetting(f'num_drafts {self.num_drafts} (multi-draft verification) supports '
                           'exact token-wise verification with a fixed gamma only; it cannot '
                           f'be combined with {", ".join(unsupported)}')
    raise InvalidSetting(f"verification='{rule.name}' cannot be combined with "
                         f'{", ".join(unsupported)}; what it takes: {rule.describe()}')


@flax.struct.dataclass
class SpeculativeStats:
  """Per-call statistics; arrays with a batch axis are per row."""
  target_calls: jax.Array  # [] target decode steps run (one per iteration)
  # [] drafts proposed: per iteration the most any decoding row proposed (a T5
  # drafter's decode steps; gamma unless rows stopped at EOS or adaptive gamma).
  draft_calls: jax.Array
  row_target_calls: jax.Array  # [b] target steps while the row was still decoding
  accepted_per_position: jax.Array  # [g] times the draft at position i was accepted
  num_accepted_counts: jax.Array  # [g+1] iterations that accepted n = 0..g drafts
  overlap_sum: jax.Array  # [] sum over verified positions of sum_x min(p, q)
  verified_positions: jax.Array  # [] number of verified drafted positions
  # [g+1] iterations in which a row proposed k = 0..g drafts (g unless it drafted EOS
  # before position g, or draft_confidence_threshold > 0); sum_k k * counts[k] drafts
  # were proposed.
  num_drafted_counts: jax.Array
  # [] positions the target's verify steps ran over: gamma + 1 a call (1 + k gamma for
  # a tree of k drafts), fewer where SpeculativeConfig.verify_lengths shortened a call.
  target_positions: jax.Array

  @property
  def alpha(self):
    """Corollary 3.6's estimate of E[beta] over the verified positions."""
    return self.overlap_sum / jnp.maximum(self.verified_positions, 1)

  def tokens_per_target_call(self, lengths):
    return jnp.sum(lengths) / jnp.maximum(jnp.sum(self.row_target_calls), 1)


@flax.struct.dataclass
class SpeculativeTrace:
  """What every iteration did, per row (speculative_generate(..., record_trace=True)).

  Iteration t is the loop's (t+1)-th iteration (the first proposes after x_0 alone).
  Arrays are [b, L] or [b, L, g], L the
  max_decode_length (the most iterations a row can take part in), zero where a row was
  done or the loop had stopped. The committed tokens of row b are, over t,
  (drafts[b, t, :num_accepted[b, t]] + [next_token[b, t]])[:committed[b, t]].
  """
  drafts: jax.Array  # [b, L, g] int32, the proposal (only the first num_drafts count)
  num_drafts: jax.Array  # [b, L] int32, drafts the row proposed (0 at iteration 0)
  num_accepted: jax.Array  # [b, L] int32, drafts accepted
  next_token: jax.Array  # [b, L] int32, the correction after a rejection, else the bonus
  committed: jax.Array  # [b, L] int32, tokens written (cut at EOS / the length limit)


@flax.struct.dataclass
class SpeculativeOutput:
  output: common.DecodeOutput
  stats: SpeculativeStats
  trace: SpeculativeTrace | None = None  # With record_trace=True.
  drafter_stats: Any = None  # Drafter.stats of the final drafter state (e.g. StageStats).


@flax.struct.dataclass
class _LoopState:
  tokens: jax.Array  # [b, L] committed tokens
  token_log_probs: jax.Array  # [b, L] log p of each committed token (0 when argmax)
  length: jax.Array  # [b] committed count
  done: jax.Array  # [b] bool
  target_cache: DecoderCache
  drafter_state: Any
  row_keys: jax.Array  # [b]
  iteration: jax.Array  # []
  stats: SpeculativeStats
  nonfinite: jax.Array  # [b] bool, the row met non-finite logits and was stopped
  trace: SpeculativeTrace | None  # None unless record_trace




def _log_prob_of(probs, tokens, *, sampling: SamplingConfig):
  """log of standardized probs at tokens (T5X's rescaled log-prob; 0 for argmax)."""
  if sampling.is_greedy:
    return jnp.zeros(tokens.shape, jnp.float32)
  return jnp.log(jnp.maximum(gather_probs(probs, tokens), 1e-38))


def _argmax_verdict(spec: SpeculativeConfig, sampling: SamplingConfig) -> bool:
  """Whether the verdict is token.greedy_verdict (exact token-wise, temperature 0)."""
  return sampling.is_greedy and spec.lenience == 1.0 and spec.verification == 'token'


def _verdict(keys, drafts, draft_probs, target_logits, target_probs, num_drafts, *,
             spec: SpeculativeConfig, sampling: SamplingConfig):
  """The accept step of every row: keys [b], drafts [b, g], q [b, g, v], logits and p
  [b, g+1, v], num_drafts [b] or None -> Verdict with [b] / [b, g] fields."""
  if spec.verification == 'block':
    return jax.vmap(lambda k, d, q, p, n: jax.tree_util.tree_map(
        lambda x: x[0], block_verification.block_verdict(
            k, d[None], q[None], p[None], None if n is None else n[None])),
        in_axes=(0, 0, 0, 0, None if num_drafts is None else 0))(
            keys, drafts, draft_probs, target_probs, num_drafts)
  if _argmax_verdict(spec, sampling):
    return greedy_verdict(drafts, draft_probs, target_logits, num_drafts)
  raw_target_probs = None
  if sampling.is_greedy and spec.lenience < 1.0:
    raw_target_probs = jax.nn.softmax(target_logits.astype(jnp.float32), axis=-1)
  return jax.vmap(
      lambda k, d, q, p, r, n: jax.tree_util.tree_map(
          lambda x: x[0], speculative_verdict(
              k, d[None], q[None], p[None], spec.lenience, None if r is None else r[None],
              None if n is None else n[None])),
      in_axes=(0, 0, 0, 0, None if raw_target_probs is None else 0,
               None if num_drafts is None else 0))(
          keys, drafts, draft_probs, target_probs, raw_target_probs, num_drafts)


def _record(trace: SpeculativeTrace, iteration, drafts, num_drafts, num_accepted, next_token,
            committed):
  """Writes one iteration's [b] / [b, g] values at column `iteration` of the trace."""
  def put(buffer, values):
    return buffer.at[:, iteration].set(values, mode='drop')
  return trace.replace(drafts=put(trace.drafts, drafts),
                       num_drafts=put(trace.num_drafts, num_drafts),
                       num_accepted=put(trace.num_accepted, num_accepted),
                       next_token=put(trace.next_token, next_token),
                       committed=put(trace.committed, committed))


def _nonfinite_positions(target_logits, draft_probs):
  """target_logits [b, g+1, v], draft q [b, g, v] -> [b, g+1] bool: p or q is not finite."""
  nan_q = jnp.any(jnp.isnan(draft_probs), axis=-1)  # [b, g]
  return nonfinite_logits(target_logits) | jnp.pad(nan_q, ((0, 0), (0, 1)))


def _commit(state: _LoopState, candidates, candidate_log_probs, count, eos_id: int):
  """Writes candidates[:, :count] after each row's committed tokens.

  candidates [b, c]; count [b] (0 for finished rows). Stops at the first EOS and at
  the buffer's end. Returns (tokens, log_probs, new_length, done).
  """
  max_length = state.tokens.shape[1]
  offsets = jnp.arange(candidates.shape[1])[None, :]  # [1, c]
  is_eos = (candidates == eos_id) & (offsets < count[:, None])
  first_eos = jnp.where(jnp.any(is_eos, axis=1), jnp.argmax(is_eos, axis=1) + 1, count)
  count = jnp.minimum(jnp.minimum(count, first_eos), max_length - state.length)
  positions = state.length[:, None] + offsets  # [b, c]
  positions = jnp.where(offsets < count[:, None], positions, max_length)  # dropped
  rows = jnp.arange(candidates.shape[0])[:, None]
  tokens = state.tokens.at[rows, positions].set(candidates, mode='drop')
  log_probs = state.token_log_probs.at[rows, positions].set(candidate_log_probs, mode='drop')
  new_length = state.length + count
  done = state.done | jnp.any(is_eos & (offsets < count[:, None]), axis=1) | (
      new_length >= max_length)
  return tokens, log_probs, new_length, done


def _iteration_keys(state: _LoopState):
  """-> (draft keys [b], verdict keys [b]) of this iteration, per row."""
  keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(state.row_keys, state.iteration)
  keys = jax.vmap(lambda k: jax.random.split(k, 2))(keys)  # [b, 2]
  return keys[:, 0], keys[:, 1]


def _iteration(state: _LoopState, target_params, drafter_params, encoder_tokens, *,
               target_config: T5Config, drafter: Drafter, spec: SpeculativeConfig,
               sampling: SamplingConfig, eos_id: int) -> _LoopState:
  """One iteration; the rows that have ended cost no kernel products (their results are
  never used; cpu_matmul.active_rows)."""
  with cpu_matmul.active_rows(~state.done):
    return _iteration_of_rule(
        state, target_params, drafter_params, encoder_tokens, target_config=target_config,
        drafter=drafter, spec=spec, sampling=sampling, eos_id=eos_id)


def _iteration_of_rule(state: _LoopState, target_params, drafter_params, encoder_tokens, *,
                       target_config: T5Config, drafter: Drafter, spec: SpeculativeConfig,
                       sampling: SamplingConfig, eos_id: int) -> _LoopState:
  if multi_draft.uses_tree(drafter, spec.num_drafts, sampling):
    return _multi_draft_iteration(
        state, target_params, drafter_params, encoder_tokens, target_config=target_config,
        drafter=drafter, spec=spec, sampling=sampling, eos_id=eos_id)
  if spec.verification == 'coupled':  # at temperature 0 too: argmax drafts, no q
    return _coupled_iteration(
        state, target_params, drafter_params, encoder_tokens, target_config=target_config,
        drafter=drafter, spec=spec, sampling=sampling, eos_id=eos_id)
  gamma = spec.gamma
  draft_keys, verdict_keys = _iteration_keys(state)

  # Drafts after a row's first drafted EOS are never committed: the drafter may stop
  # there, and they count as not proposed.
  context = DraftContext(tokens=state.tokens, length=state.length,
                         encoder_tokens=encoder_tokens, eos_id=eos_id,
                         draft_loop=spec.draft_loop)
  if spec.draft_confidence_threshold > 0.0:
    drafts, draft_probs, confidence, drafter_state = drafter.propose_with_confidence(
        drafter_params, state.drafter_state, context, gamma, sampling, draft_keys,
        spec.draft_confidence_threshold)
    # Each row proposes up to and including its first unsure draft or EOS.
    num_drafts = drafts_through_first((confidence < spec.draft_confidence_threshold)
                                      | (drafts == eos_id))
  else:
    drafts, draft_probs, drafter_state = drafter.propose(
        drafter_params, state.drafter_state, context, gamma, sampling, draft_keys)
    num_drafts = drafts_through_first(drafts == eos_id)  # [b] each row's proposed drafts

  logits, features, target_cache, positions = _verify(
      state, target_params, context, drafts, num_drafts, target_config, spec.verify_lengths,
      _features_of(drafter))
  drafter_state = _observed(drafter, drafter_params, drafter_state, features, state.length)
  # [b, g+1, v]; the token-wise verdict at temperature 0 needs only the argmax.
  target_probs = None if _argmax_verdict(spec, sampling) else standardize(logits, sampling)
  verdict = _verdict(verdict_keys, drafts, draft_probs, logits, target_probs, num_drafts,
                     spec=spec, sampling=sampling)
  nonfinite = _nonfinite_positions(logits, mask_unproposed(draft_probs, num_drafts))
  return _settle(state, drafts, num_drafts, nonfinite,
                 functools.partial(_log_prob_of, target_probs, sampling=sampling), verdict,
                 drafter_state, target_cache, positions, gamma=gamma, eos_id=eos_id)


def _verify(state: _LoopState, target_params, context: DraftContext, drafts, num_drafts,
            target_config: T5Config, verify_lengths: tuple[int, ...] = (),
            features_of: tuple[int, ...] | None = None):
  """The target's ONE decode step over x_length (the last committed token) and the
  drafts [b, g], at each row's offset -> (logits [b, g+1, v], features: the final hidden
  states then the outputs of the decoder layers features_of lists, [b, g+1, e (1 + n)]
  (None where features_of is None), target cache, positions the step ran over []).

  With verify_lengths the step runs over the shortest listed length k that holds
  x_length and the longest proposal among the decoding rows (num_drafts [b]), and the
  logits past k are 0: positions no decoding row proposed, never accepted or committed.
  """
  verify_tokens = jnp.concatenate([context.last_input()[:, None], drafts], axis=1)
  target_cache = rollback(state.target_cache, state.length)
  full = verify_tokens.shape[1]
  # The kernels compute the positions a decoding row proposed and the one after them;
  # the rest (after a drafted EOS, or of ended rows) are never accepted or committed.
  needed_positions = ~state.done[:, None] & (
      True if num_drafts is None
      else jnp.arange(full)[None, :] <= num_drafts[:, None])  # [b, g+1]

  def step(length):
    def run():
      with cpu_matmul.active_rows(needed_positions[:, :length]):
        logits, features, cache = T5(target_config).apply(
            target_params, verify_tokens[:, :length], target_cache,
            feature_layers=features_of or (), method=T5.decode_with_features)
      pad = ((0, 0), (0, full - length), (0, 0))
      features = None if features_of is None else jnp.pad(features, pad)
      return jnp.pad(logits, pad), features, cache
    return run

  if not verify_lengths:
    return (*step(full)(), jnp.asarray(full, jnp.int32))
  lengths = (*verify_lengths, full)
  needed = jnp.max(jnp.where(state.done, 0, num_drafts)) + 1  # [] positions to verify
  branch = jnp.sum(needed > jnp.asarray(lengths[:-1]))  # the shortest length >= needed
  logits, features, cache = jax.lax.switch(branch, [step(length) for length in lengths])
  return logits, features, cache, jnp.asarray(lengths, jnp.int32)[branch]


def _features_of(drafter: Drafter) -> tuple[int, ...] | None:
  """The target decoder layers whose outputs the drafter reads beside h, () for h alone;
  None where it reads no features (the verify step then returns none)."""
  return drafter.target_feature_layers if drafter.reads_target_features else None


def _observed(drafter: Drafter, drafter_params, drafter_state, features, length):
  """The drafter state once it has the verify step's target features [b, k, e] from
  positions length [b] on (Drafter.observe_target_features); unchanged without them."""
  if features is None:
    return drafter_state
  return drafter.observe_target_features(drafter_params, drafter_state, features, length)


def _coupled_iteration(state: _LoopState, target_params, drafter_params, encoder_tokens, *,
                       target_config: T5Config, drafter: Drafter, spec: SpeculativeConfig,
                       sampling: SamplingConfig, eos_id: int) -> _LoopState:
  """One iteration of coupled verification (SpeculativeConfig.verification): position
  length + j of a row is drawn with the key fold_in(row key, length + j), the
  baseline's, by the drafter and by the target alike."""
  gamma = spec.gamma
  draft_keys, _ = _iteration_keys(state)
  # [b, g+1] the keys of positions length .. length + g (none needed when greedy).
  keys = None if sampling.is_greedy else common.position_keys(state.row_keys, state.length,
                                                               gamma + 1)
  context = DraftContext(tokens=state.tokens, length=state.length,
                         encoder_tokens=encoder_tokens, eos_id=eos_id,
                         draft_loop=spec.draft_loop)
  drafts, draft_noise, drafter_state = drafter.propose_coupled(
      drafter_params, state.drafter_state, context, gamma, sampling,
      None if keys is None else keys[:, :gamma], draft_keys)
  num_drafts = drafts_through_first(drafts == eos_id)  # [b]
  logits, features, target_cache, positions = _verify(
      state, target_params, context, drafts, num_drafts, target_config, spec.verify_lengths,
      _features_of(drafter))
  drafter_state = _observed(drafter, drafter_params, drafter_state, features, state.length)
  vocab = logits.shape[-1]
  if sampling.is_greedy:
    noise = None
  elif draft_noise is None:
    noise = position_noise(keys, vocab)  # [b, g+1, v]
  else:
    # The drafter's noise at the drafted positions (0 after a row's drafted EOS, where
    # the target's draw is never committed), fresh noise for the bonus position.
    noise = jnp.concatenate([draft_noise, position_noise(keys[:, gamma:], vocab)], axis=1)
  verdict = coupled_verdict(drafts, coupled_tokens(logits, noise, sampling), num_drafts)
  return _settle(state, drafts, num_drafts, nonfinite_logits(logits),
                 lambda tokens: token_log_probs(logits, tokens, sampling), verdict,
                 drafter_state, target_cache, positions, gamma=gamma, eos_id=eos_id)


def _multi_draft_iteration(state: _LoopState, target_params, drafter_params, encoder_tokens,
                           *, target_config: T5Config, drafter: Drafter,
                           spec: SpeculativeConfig, sampling: SamplingConfig,
                           eos_id: int) -> _LoopState:
  """One iteration with spec.num_drafts branches verified in one tree step
  (jaxspec/decoding/verification/tree.py); the chosen branch then settles as one draft does."""
  gamma, num_branches = spec.gamma, spec.num_drafts
  draft_keys, verdict_keys = _iteration_keys(state)
  context = DraftContext(tokens=state.tokens, length=state.length,
                         encoder_tokens=encoder_tokens, draft_loop=spec.draft_loop)
  # [b, k, g], [b, k, g, v], the drafter state of every branch [b k].
  drafts, draft_probs, branch_state = multi_draft.propose_tree(
      drafter, drafter_params, state.drafter_state, context, gamma, num_branches, sampling,
      draft_keys)

  # Verify: the root x_length and every branch in one step, positions by depth.
  batch = drafts.shape[0]
  tree_tokens = multi_draft.flatten_tree(context.last_input()[:, None], drafts)  # [b, t]
  target_cache = rollback(state.target_cache, state.length)
  tree_logits, tree_features, target_cache = T5(target_config).apply(
      target_params, tree_tokens, target_cache,
      multi_draft.tree_layout(num_branches, gamma), drafter.target_feature_layers,
      method=T5.decode_with_features)  # [b, t, v], [b, t, e (1 + n)]
  logits = multi_draft.branch_values(tree_logits, num_branches, gamma)  # [b, k, g+1, v]
  if sampling.is_greedy:
    target_probs = None
    verdict = multi_draft.greedy_tree_verdict(drafts, draft_probs, logits)
  else:
    target_probs = standardize(logits, sampling)  # [b, k, g+1, v]
    verdict = multi_draft.multi_draft_verdict(verdict_keys, drafts, draft_probs, target_probs)
  branch = verdict.branch  # [b]
  target_cache = multi_draft.compact_branch(target_cache, state.length, branch, gamma)
  drafter_state = multi_draft.select_branch_state(branch_state, branch, num_branches)
  if drafter.reads_target_features:  # [b, g+1, e (1 + n)] along the chosen branch's path
    features = multi_draft.select_branch(
        multi_draft.branch_values(tree_features, num_branches, gamma), branch)
    drafter_state = _observed(drafter, drafter_params, drafter_state, features, state.length)

  # Non-finite p on the chosen path, or a NaN q in any branch (every branch's q at a
  # depth may have been tried there).
  nan_q = jnp.any(jnp.isnan(draft_probs), axis=(1, 3))  # [b, g]
  nonfinite = _nonfinite_positions(multi_draft.select_branch(logits, branch),
                                   multi_draft.select_branch(draft_probs, branch)) | jnp.pad(
                                       nan_q, ((0, 0), (0, 1)))  # [b, g+1]
  return _settle(state, multi_draft.select_branch(drafts, branch),
                 jnp.full((batch,), gamma, jnp.int32), nonfinite,
                 functools.partial(_log_prob_of, multi_draft.path_of(target_probs, branch),
                                   sampling=sampling),
                 verdict, drafter_state, target_cache, tree_tokens.shape[1], gamma=gamma,
                 eos_id=eos_id)


def _settle(state: _LoopState, drafts, drafted, nonfinite, log_probs_of, verdict,
            drafter_state, target_cache, step_positions, *, gamma: int,
            eos_id: int) -> _LoopState:
  """Commits a verdict and updates the statistics and trace: the shared end of an
  iteration. drafts [b, g] (the chosen branch's with several drafts), drafted [b],
  nonfinite [b, g+1] (p or q not finite there), log_probs_of(candidates [b, g+1]) ->
  their log-probabilities under the target [b, g+1], verdict with num_accepted,
  next_token [b] and overlap [b, g], step_positions [] the target's step ran over."""
  n = verdict.num_accepted  # [b]
  # The verdict used p and q at positions 0..n, and a NaN there passes the accept test
  # (u >= NaN is False). A row keeps the tokens judged before its first non-finite
  # position and stops there, as the baseline would; the wrapper reports it. (Block
  # verification never keeps a prefix through a NaN p: its weights turn NaN there.)
  invalid = nonfinite & (jnp.arange(gamma + 1)[None, :] <= n[:, None])  # [b, g+1]
  broken = ~state.done & jnp.any(invalid, axis=1)  # [b]
  kept = jnp.where(broken, jnp.argmax(invalid, axis=1), n + 1)  # [b]

  offsets = jnp.arange(gamma + 1)[None, :]
  padded_drafts = jnp.pad(drafts, ((0, 0), (0, 1)))
  candidates = jnp.where(offsets < n[:, None], padded_drafts,
                         jnp.where(offsets == n[:, None], verdict.next_token[:, None], 0))
  candidate_log_probs = log_probs_of(candidates)
  count = jnp.where(state.done, 0, kept)
  active = ~state.done & ~broken  # Rows whose verdict counts in the statistics.
  tokens, log_probs, length, done = _commit(state, candidates, candidate_log_probs, count,
                                            eos_id)

  stats = state.stats
  positions = jnp.arange(gamma)[None, :]
  verified = ((positions <= n[:, None]) & (positions < drafted[:, None])
              & active[:, None])  # [b, g] the accept test was run on a proposed draft
  accepted = (positions < n[:, None]) & active[:, None]
  stats = stats.replace(
      target_calls=stats.target_calls + 1,
      target_positions=stats.target_positions + step_positions,
      draft_calls=stats.draft_calls + jnp.max(jnp.where(state.done, 0, drafted)),
      row_target_calls=stats.row_target_calls + active.astype(jnp.int32),
      accepted_per_position=stats.accepted_per_position + jnp.sum(accepted, axis=0),
      num_accepted_counts=stats.num_accepted_counts + jnp.sum(
          jax.nn.one_hot(n, gamma + 1, dtype=jnp.int32) * active[:, None], axis=0),
      overlap_sum=stats.overlap_sum + jnp.sum(jnp.where(verified, verdict.overlap, 0.0)),
      verified_positions=stats.verified_positions + jnp.sum(verified),
      num_drafted_counts=stats.num_drafted_counts + jnp.sum(
          jax.nn.one_hot(drafted, gamma + 1, dtype=jnp.int32) * active[:, None], axis=0))
  trace = state.trace
  if trace is not None:
    trace = _record(trace, state.iteration, drafts, jnp.where(state.done, 0, drafted),
                    jnp.where(state.done, 0, jnp.minimum(n, kept)),
                    jnp.where(state.done, 0, verdict.next_token), length - state.length)
  return state.replace(tokens=tokens, token_log_probs=log_probs, length=length,
                       done=done | broken, target_cache=target_cache,
                       drafter_state=drafter_state, iteration=state.iteration + 1,
                       stats=stats, nonfinite=state.nonfinite | broken, trace=trace)


def check_compatible(target_config: T5Config, drafter: Drafter):
  if not isinstance(drafter, Drafter):
    raise TypeError(f'drafter must be a jaxspec Drafter (jaxspec.decoding.drafters.base), '
                    f'got {type(drafter).__name__}')
  if drafter.vocab_size != target_config.vocab_size:
    raise ValueError(
        f'draft and target vocabularies differ: the drafter has vocab_size '
        f'{drafter.vocab_size}, the target {target_config.vocab_size}; speculative '
        'decoding needs both over the same token ids')


def _encode(target_params, encoder_tokens, *, target_config, cache_length):
  """Encodes once with the target -> (its empty DecoderCache of cache_length positions,
  the encoder output [b, s, e], for drafters that share it)."""
  model = T5(target_config)
  encoded = model.apply(target_params, encoder_tokens, method=T5.encode)
  cache = model.apply(target_params, encoded, encoder_tokens, cache_length,
                      method=T5.init_cache)
  return cache, encoded


def _initial_stats(batch: int, gamma: int) -> SpeculativeStats:
  zero = jnp.zeros((), jnp.int32)
  return SpeculativeStats(
      target_calls=zero, draft_calls=zero, row_target_calls=jnp.zeros((batch,), jnp.int32),
      accepted_per_position=jnp.zeros((gamma,), jnp.int32),
      num_accepted_counts=jnp.zeros((gamma + 1,), jnp.int32),
      overlap_sum=jnp.zeros((), jnp.float32), verified_positions=zero,
      num_drafted_counts=jnp.zeros((gamma + 1,), jnp.int32), target_positions=zero)


def _target_cache_length(spec: SpeculativeConfig, max_decode_length: int) -> int:
  """Room for a full verify window (a tree of 1 + k gamma tokens with several drafts)
  even from the last position; drafters need only max_decode_length + gamma."""
  return max_decode_length + spec.num_drafts * spec.gamma


def _initial_trace(batch: int, max_decode_length: int, gamma: int) -> SpeculativeTrace:
  zeros = jnp.zeros((batch, max_decode_length), jnp.int32)
  return SpeculativeTrace(
      drafts=jnp.zeros((batch, max_decode_length, gamma), jnp.int32), num_drafts=zeros,
      num_accepted=zeros, next_token=zeros, committed=zeros)


def speculative_generate(target_params, drafter_params, encoder_tokens, rng=None, *,
                         target_config: T5Config, drafter: Drafter,
                         spec: SpeculativeConfig, max_decode_length: int,
                         sampling: SamplingConfig = SamplingConfig(),
                         eos_id: int = EOS_ID,
                         on_nonfinite: str = 'raise',
                         record_trace: bool = False) -> SpeculativeOutput:
  """Decodes encoder_tokens [b, s] from the target, with the drafter proposing.

  The output distribution is the target's under `sampling` (token for token the
  baseline's when argmax), for any drafter, as long as spec.lenience == 1.
  rng: one PRNG key (row b uses fold_in(rng, b)) or per-row keys [b]. Runs as one jit.
  on_nonfinite: 'raise' (FloatingPointError naming the rows), 'warn' or 'ignore' when
  a row met NaN/+inf target logits or NaN draft q (output.nonfinite_logits; the row
  stopped there).
  record_trace: also return a SpeculativeTrace of every iteration (drafts, accepted
  count, next token), for jaxspec.measure.decode_view; costs [b, L, gamma] of loop state.
  """
  check_compatible(target_config, drafter)
  if spec.gamma == AUTO:
    raise ValueError("speculative_generate takes an integer gamma; gamma='auto' is chosen "
                     'per batch by jaxspec.decoding.auto_gamma.AutoGammaDecoder (as the '
                     'launcher and jaxspec.pairs do)')
  target_params, encoder_tokens, rng = validation.decoder_call(
      target_params, encoder_tokens, rng, sampling)
  drafter_params = validation.drafter_variables(drafter_params)
  validation.check_encoder_tokens(encoder_tokens, target_config.vocab_size)
  validation.check_max_decode_length(max_decode_length)
  validation.check_gamma(spec.gamma, max_decode_length)
  validation.check_decode_positions(target_config, spec.gamma + 1, spec.num_drafts)
  validation.check_nonfinite_action(on_nonfinite)
  validation.check_decoder_memory(
      encoder_tokens, config=target_config, max_decode_length=max_decode_length,
      gamma=spec.num_drafts * spec.gamma, draft_config=getattr(drafter, 'config', None))
  if sampling.is_greedy and spec.num_drafts > drafter.vocab_size:
    raise ValueError(f'num_drafts {spec.num_drafts} is larger than the vocabulary '
                     f'({drafter.vocab_size} tokens) a top-k token tree branches over')
  result = _speculative_generate(
      target_params, drafter_params, encoder_tokens, rng, target_config=target_config,
      drafter=drafter, spec=spec, max_decode_length=max_decode_length, sampling=sampling,
      eos_id=eos_id, record_trace=record_trace)
  validation.report_nonfinite_rows(result.output.nonfinite_logits, on_nonfinite)
  return result


@functools.partial(jax.jit, static_argnames=(
    'target_config', 'drafter', 'spec', 'max_decode_length', 'sampling', 'eos_id',
    'record_trace'))
def _speculative_generate(target_params, drafter_params, encoder_tokens, rng, *,
                          target_config: T5Config, drafter: Drafter,
                          spec: SpeculativeConfig, max_decode_length: int,
                          sampling: SamplingConfig, eos_id: int,
                          record_trace: bool = False) -> SpeculativeOutput:
  batch = encoder_tokens.shape[0]
  row_keys = common.row_keys(rng, batch)
  # The drafter's room for gamma drafts from the last position; writes past it drop.
  cache_length = max_decode_length + spec.gamma
  target_cache, encoded = _encode(
      target_params, encoder_tokens, target_config=target_config,
      cache_length=_target_cache_length(spec, max_decode_length))
  zeros = jnp.zeros((batch,), jnp.int32)
  initial = _LoopState(
      tokens=jnp.zeros((batch, max_decode_length), jnp.int32),
      token_log_probs=jnp.zeros((batch, max_decode_length), jnp.float32),
      length=zeros, done=zeros.astype(bool), target_cache=target_cache,
      drafter_state=drafter.init_state_for_decode(drafter_params, encoder_tokens, encoded,
                                                  cache_length, target_cache),
      row_keys=row_keys, iteration=jnp.zeros((), jnp.int32),
      stats=_initial_stats(batch, spec.gamma), nonfinite=zeros.astype(bool),
      trace=_initial_trace(batch, max_decode_length, spec.gamma) if record_trace else None)
  body = functools.partial(
      _iteration, target_params=target_params, drafter_params=drafter_params,
      encoder_tokens=encoder_tokens, target_config=target_config, drafter=drafter,
      spec=spec, sampling=sampling, eos_id=eos_id)
  final = jax.lax.while_loop(lambda s: ~jnp.all(s.done), body, initial)
  output = common.DecodeOutput.from_tokens(final.tokens, final.token_log_probs, eos_id,
                                           final.nonfinite)
  return SpeculativeOutput(output=output, stats=final.stats, trace=final.trace,
                           drafter_stats=drafter.stats(final.drafter_state))
