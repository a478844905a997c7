"""jaxspec.decoding.drafters.staged: a cached-decoder drafter decoded speculatively with
a cheaper proposer. Its drafts must be the middle drafter's own, whatever proposes:

- Greedy proposals: StagedDrafter.propose at temperature 0 returns the middle drafter's
  own greedy drafts and one-hot q, for gamma 1, 3, 5 and lookahead 1, 2, 4, with a random
  T5 proposer (rejects nearly everything), the target itself over its int8 draft
  (accepts nearly everything), prompt lookup and a nested StagedDrafter; rows at
  different lengths (0 included), finished rows, eos_id set and None; two proposals in a
  row, the second after a partial accept, so a stale cache slot after a rollback shows.
- Greedy decoding: speculative_generate with a StagedDrafter is the baseline token for
  token (verification 'token' and 'coupled'), and every SpeculativeStats counter is the
  single-stage middle drafter's (the same drafts meet the same verdicts).
- Coupled draws: propose_coupled at temperature 1 returns the middle drafter's tokens and
  noise; coupled decoding at temperature 1 is the baseline's sampled output.
- Sampling: over 50k rows the joint distribution of the staged drafts equals the middle
  drafter's exact joint (enumerated from teacher-forced passes, as in
  tests/test_speculative.py), with EOS ending a proposal and without it, under top-k too;
  the same samples reject the proposer's distribution, and a mutant judge (residual
  replaced by the drafter's q) is rejected. End to end, a staged drafter's decode follows
  the target's exact joint distribution.
- StageStats: a proposer equal to the middle drafter has every proposal accepted in
  ceil((gamma - 1) / (lookahead + 1)) rounds; drafter_steps is proposals + rounds at every
  level of nesting; a random proposer has few proposals accepted.
- Construction errors name the problem.

Helpers and the enumeration setup come from tests/test_speculative.py.
"""

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_speculative as spec_tests  # tests/test_speculative.py: enumeration, stats checks
from _wrapped_drafter import WrappedDrafter  # tests/_wrapped_drafter.py
from test_accelerator_path import _params  # random params in the kernels' layout
from jaxspec.config import EOS_ID, get_config
from jaxspec.decoding import common
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (DraftContext, Int8Drafter, PromptLookupDrafter,
                                       StagedDrafter, StageStats, T5Drafter)
from jaxspec.decoding.drafters.base import drafts_through_first
from jaxspec.decoding.drafters.t5 import CachedDecoderDrafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.verification import token as token_verification
from jaxspec.model import T5, init_params, rollback
from jaxspec.sampling import SamplingConfig, standardize

# A one-layer T5.1.1 target over 64 tokens; its int8 decoder is the middle drafter.
CONFIG = get_config('test_tiny_1_1', num_encoder_layers=1, num_decoder_layers=1)
VOCAB = CONFIG.vocab_size
MAX_LEN = 12
T1 = SamplingConfig(temperature=1.0)
GREEDY = SamplingConfig()
RNG = jax.random.PRNGKey(21)


# ----------------------------------------------------------------------------------
# Models and drafters.


@functools.cache
def _target():
  # A larger EOS column: greedy outputs of lengths [12, 5, 12, 1, 5, 1, 12, 5], and
  # drafts that end at EOS inside a proposal.
  return _params(CONFIG, 3, eos_scale=3.0)


@functools.cache
def _random_params():
  return _params(CONFIG, 5)


@functools.cache
def _int8_params():
  return Int8Drafter.draft_params(_target())


MIDDLE = Int8Drafter(CONFIG)
# Inner stage of the nested proposer: the float target judging a random T5.
INNER = StagedDrafter(T5Drafter(CONFIG), T5Drafter(CONFIG), lookahead=1)


def _proposer(name):
  """(proposer, its params) by name: 'random' (another random T5: rejected nearly
  always), 'target' (the float target over its own int8 draft: accepted nearly always),
  'lookup' (prompt lookup), 'nested' (a StagedDrafter, depth 2)."""
  if name == 'random':
    return T5Drafter(CONFIG), _random_params()
  if name == 'target':
    return T5Drafter(CONFIG), _target()
  if name == 'lookup':
    return PromptLookupDrafter(VOCAB), ()
  assert name == 'nested', name
  return INNER, {'drafter': _target(), 'proposer': _random_params()}


def _staged(name, lookahead):
  """(StagedDrafter over the int8 middle with `name`'s proposer, its params)."""
  proposer, proposer_params = _proposer(name)
  return (StagedDrafter(MIDDLE, proposer, lookahead=lookahead),
          {'drafter': _int8_params(), 'proposer': proposer_params})


# ----------------------------------------------------------------------------------
# Proposals outside the decode loop.

ENCODER_LENGTHS = (7, 4, 6, 2, 5)
# Committed lengths of the rows of the first proposal: 0, two in the middle, a row whose
# last committed token is EOS (finished when eos_id is set) and a full buffer (finished).
LENGTHS = (0, 3, 7, 4, MAX_LEN)
# Drafts each row accepts before the second proposal (at most what it drafted before an
# EOS and what fits): all of them with a bonus token, none, some.
ACCEPTS = (99, 0, 1, 2, 0)


def _padded_tokens(lengths, width, seed):
  """[len(lengths), width] random encoder tokens, row r 0-padded after lengths[r]."""
  tokens = np.random.default_rng(seed).integers(2, VOCAB, (len(lengths), width))
  for row, length in enumerate(lengths):
    tokens[row, length:] = 0
  return tokens.astype(np.int32)


@functools.cache
def _encoder_tokens():
  return _padded_tokens(ENCODER_LENGTHS, 7, seed=0)


@jax.jit
def _encode(params, encoder_tokens):
  return T5(CONFIG).apply(params, encoder_tokens, method=T5.encode)


def _consumed(drafter, params, state, context):
  """`state` after consuming each row's committed inputs x_0..x_{length-1}, as the decode
  loop leaves a drafter (a cached decoder's proposal rewrites only the slots of
  x_{length-1} and x_length; the slots before hold what it consumed earlier)."""
  if isinstance(drafter, StagedDrafter):
    return state.replace(
        drafter=_consumed(drafter.drafter, params['drafter'], state.drafter, context),
        proposer=_consumed(drafter.proposer, params['proposer'], state.proposer, context))
  if isinstance(drafter, CachedDecoderDrafter):
    inputs = jnp.pad(context.tokens, ((0, 0), (1, 0)))[:, :-1]  # [b, L] x_0..x_{L-1}
    _, cache = drafter.decoder(params)(inputs, rollback(state, jnp.zeros_like(context.length)))
    return rollback(cache, context.length)
  return state  # stateless (prompt lookup)


@functools.partial(jax.jit, static_argnames=('drafter', 'max_length'))
def _init(drafter, params, encoder_tokens, encoded, context, *, max_length):
  """The drafter's state for a decode of encoder_tokens that has committed `context`."""
  state = drafter.init_state_for_decode(params, encoder_tokens, encoded, max_length)
  return _consumed(drafter, params, state, context)


@functools.partial(jax.jit, static_argnames=('drafter', 'gamma', 'sampling', 'coupled'))
def _propose(drafter, params, state, context, keys, position_keys, *, gamma, sampling,
             coupled=False):
  """-> drafts [b, g], q (or noise) [b, g, v], state."""
  if coupled:
    return drafter.propose_coupled(params, state, context, gamma, sampling, position_keys,
                                   keys)
  return drafter.propose(params, state, context, gamma, sampling, keys)


def _first_context(eos_id):
  tokens = np.random.default_rng(1).integers(2, VOCAB, (len(LENGTHS), MAX_LEN))
  tokens[3, LENGTHS[3] - 1] = EOS_ID
  tokens[np.arange(MAX_LEN)[None, :] >= np.array(LENGTHS)[:, None]] = 0
  return DraftContext(tokens=jnp.asarray(tokens, jnp.int32),
                      length=jnp.asarray(LENGTHS, jnp.int32),
                      encoder_tokens=jnp.asarray(_encoder_tokens()), eos_id=eos_id)


def _drafted(drafts, context):
  """[b]: the drafts that count: through the first EOS with eos_id set; one for a row
  context.finished() names (the Drafter interface leaves the rest undefined)."""
  gamma = drafts.shape[1]
  counted = (np.full(drafts.shape[0], gamma) if context.eos_id is None else
             np.asarray(drafts_through_first(jnp.asarray(drafts) == context.eos_id)))
  return np.where(np.asarray(context.finished()), 1, counted)


def _next_context(context, drafts, drafted, accepts=ACCEPTS):
  """The context after the target accepted accepts[row] of `drafts` (never past an EOS
  or the buffer) and committed one token of its own: a different token than the draft
  it rejected (the drafter's cache holds the draft there), or a bonus token."""
  tokens, length = np.array(context.tokens), np.array(context.length)
  finished = np.asarray(context.finished())
  gamma = drafts.shape[1]
  for row in range(len(length)):
    if finished[row]:
      continue
    before_eos = drafted[row] - int(context.eos_id is not None
                                    and drafts[row, drafted[row] - 1] == context.eos_id)
    accepted = min(accepts[row], before_eos, MAX_LEN - length[row] - 1)
    own = 2 + row if accepted == gamma else drafts[row, accepted] % (VOCAB - 1) + 1
    if own == EOS_ID and context.eos_id is not None:
      own = 2  # the row keeps going
    new = list(drafts[row, :accepted]) + [own]
    tokens[row, length[row]:length[row] + len(new)] = new
    length[row] += len(new)
  return context.replace(tokens=jnp.asarray(tokens), length=jnp.asarray(length))


def _assert_same_drafts(got, expected, context, what):
  """got, expected: (drafts [b, g], records [b, g, v] or None); equal where they count."""
  drafts, expected_drafts = np.asarray(got[0]), np.asarray(expected[0])
  drafted = _drafted(expected_drafts, context)
  counted = np.arange(drafts.shape[1])[None, :] < drafted[:, None]  # [b, g]
  np.testing.assert_array_equal(np.where(counted, drafts, -1),
                                np.where(counted, expected_drafts, -1), err_msg=what)
  if expected[1] is None:
    assert got[1] is None, what
    return drafted
  np.testing.assert_array_equal(np.asarray(got[1])[counted], np.asarray(expected[1])[counted],
                                err_msg=what)
  return drafted


def _two_proposals(staged, staged_params, *, gamma, eos_id, sampling=GREEDY,
                   coupled=False):
  """Two proposals in a row from the staged drafter and its middle drafter alone, the
  second after a partial accept; asserts they agree. -> the staged drafter's StageStats
  after each, and the drafted counts of each proposal [2, b]."""
  middle, middle_params = staged.drafter, staged_params['drafter']
  encoder_tokens = jnp.asarray(_encoder_tokens())
  encoded = _encode(_target(), encoder_tokens)
  context = _first_context(eos_id)
  staged_state = _init(staged, staged_params, encoder_tokens, encoded, context,
                       max_length=MAX_LEN + gamma)
  middle_state = _init(middle, middle_params, encoder_tokens, encoded, context,
                       max_length=MAX_LEN + gamma)
  row_keys = jax.random.split(RNG, len(LENGTHS))
  stats, drafted_counts = [], []
  for call in range(2):
    keys = jax.vmap(jax.random.fold_in, in_axes=(0, None))(row_keys, 100 + call)
    position_keys = (None if sampling.is_greedy
                     else common.position_keys(row_keys, context.length, gamma))
    run = functools.partial(_propose, keys=keys, position_keys=position_keys, gamma=gamma,
                            sampling=sampling, coupled=coupled)
    *staged_out, staged_state = run(staged, staged_params, staged_state, context)
    *middle_out, middle_state = run(middle, middle_params, middle_state, context)
    drafted = _assert_same_drafts(staged_out, middle_out, context,
                                  f'proposal {call + 1}, eos_id {eos_id}')
    stats.append(jax.device_get(staged_state.stats))
    drafted_counts.append(drafted)
    context = _next_context(context, np.asarray(middle_out[0]), drafted)
  return stats, np.array(drafted_counts)


# (proposer, gamma, lookahead, eos_id): every gamma and lookahead with the random
# proposer; the others at a few, each with eos_id set and None.
GREEDY_PROPOSALS = (
    [('random', gamma, lookahead, EOS_ID) for gamma in (1, 3, 5) for lookahead in (1, 2, 4)]
    + [('random', 5, 2, None), ('random', 3, 4, None),
       ('target', 1, 2, EOS_ID), ('target', 3, 1, EOS_ID), ('target', 5, 4, EOS_ID),
       ('target', 5, 2, None),
       ('lookup', 3, 2, EOS_ID), ('lookup', 5, 4, EOS_ID), ('lookup', 5, 1, None),
       ('nested', 5, 2, EOS_ID), ('nested', 3, 1, None)])


@pytest.mark.parametrize('proposer, gamma, lookahead, eos_id', GREEDY_PROPOSALS)
def test_greedy_proposals_are_the_middle_drafters(proposer, gamma, lookahead, eos_id):
  staged, params = _staged(proposer, lookahead)
  stats, drafted = _two_proposals(staged, params, gamma=gamma, eos_id=eos_id)
  if gamma > 1:  # rounds ran (gamma 1: the middle drafter's first step alone)
    assert int(stats[1].rounds) > int(stats[0].rounds) > 0
    if proposer == 'target':  # the int8 draft agrees with its target nearly always
      assert int(stats[1].accepted) > 0.7 * int(stats[1].proposed)
    if proposer == 'random':
      assert int(stats[1].accepted) < 0.3 * int(stats[1].proposed)
  else:
    assert int(stats[1].rounds) == 0
  if eos_id is not None and gamma == 5:  # a row drafted EOS inside a proposal
    assert np.any((drafted > 1) & (drafted < gamma)), drafted


def test_the_greedy_proposal_setup_covers_the_cases():
  # The rows of the contexts above: which rows are finished, the drafts that count (a
  # finished row's first, through a drafted EOS), and the second context: all drafts
  # and a bonus token accepted in row 0, none in row 1, one before a drafted EOS in row
  # 2, each rejected draft replaced by a different token.
  context = _first_context(EOS_ID)
  np.testing.assert_array_equal(context.finished(), [False, False, False, True, True])
  np.testing.assert_array_equal(_first_context(None).finished(),
                                [False, False, False, False, True])
  drafts = np.array([[5, 6, 7], [8, 9, 10], [11, EOS_ID, 12], [13, 0, 0], [14, 0, 0]])
  drafted = _drafted(drafts, context)
  np.testing.assert_array_equal(drafted, [3, 3, 2, 1, 1])
  following = _next_context(context, drafts, drafted)
  np.testing.assert_array_equal(following.length, [4, 4, 9, 4, MAX_LEN])
  np.testing.assert_array_equal(following.tokens[0, :4], [5, 6, 7, 2])
  assert int(following.tokens[1, 3]) not in (8, 0, EOS_ID)
  np.testing.assert_array_equal(following.tokens[2, 7], 11)
  assert int(following.tokens[2, 8]) not in (EOS_ID, 0)  # rejected the drafted EOS


# ----------------------------------------------------------------------------------
# Greedy decoding: the baseline, with the single-stage drafter's verdicts.

DECODE_ENCODER_LENGTHS = (10, 7, 4, 9, 2, 6, 1, 8)
GAMMA = 4


@functools.cache
def _decode_encoder_tokens():
  return _padded_tokens(DECODE_ENCODER_LENGTHS, 10, seed=1)


@functools.cache
def _baseline(sampling=GREEDY):
  return generate(_target(), _decode_encoder_tokens(), RNG, config=CONFIG,
                  max_decode_length=MAX_LEN, sampling=sampling)


@dataclasses.dataclass(frozen=True)
class _CaughtUp(WrappedDrafter):
  """`inner` consuming every committed input before each proposal (_consumed), so its
  cache never holds a stale slot whatever it was called with before: a reference for
  what a T5 proposer proposes from the inputs alone."""
  inner: T5Drafter

  def propose(self, params, state, context, gamma, sampling, keys):
    width = min(context.tokens.shape[1], state.max_length)
    caught_up = _consumed(self.inner, params, state,
                          context.replace(tokens=context.tokens[:, :width]))
    return self.inner.propose(params, caught_up, context, gamma, sampling, keys)


def _agreeing(caught_up=False):
  """A T5 middle drafter and a proposer with the same params: every proposal agrees."""
  proposer = _CaughtUp(T5Drafter(CONFIG)) if caught_up else T5Drafter(CONFIG)
  return (StagedDrafter(T5Drafter(CONFIG), proposer, lookahead=2),
          {'drafter': _target(), 'proposer': _target()})


@functools.cache
def _decode(drafter_name, verification='token', sampling=GREEDY, lookahead=2):
  """speculative_generate with gamma GAMMA; drafter_name 'single' (the int8 middle
  drafter alone), 'agreeing', 'agreeing_caught_up' or a proposer name of _staged."""
  if drafter_name == 'single':
    drafter, params = MIDDLE, _int8_params()
  elif drafter_name in ('agreeing', 'agreeing_caught_up'):
    drafter, params = _agreeing(caught_up=drafter_name == 'agreeing_caught_up')
  else:
    drafter, params = _staged(drafter_name, lookahead)
  return speculative_generate(
      _target(), params, _decode_encoder_tokens(), RNG, target_config=CONFIG,
      drafter=drafter, spec=SpeculativeConfig(gamma=GAMMA, verification=verification),
      max_decode_length=MAX_LEN, sampling=sampling)


def _assert_all_stats_equal(stats, expected):
  for name, value in vars(expected).items():
    np.testing.assert_array_equal(getattr(stats, name), value, err_msg=name)


def test_decode_setup_has_early_eos_and_full_length_rows():
  # Rows that end at the first token, in the middle, one short of the limit and at it.
  np.testing.assert_array_equal(_baseline().lengths, [12, 5, 12, 1, 5, 1, 12, 5])
  np.testing.assert_array_equal(_baseline(T1).lengths, [12, 12, 2, 12, 3, 11, 12, 12])


@pytest.mark.parametrize('proposer, verification', [
    ('random', 'token'), ('target', 'token'), ('nested', 'token'), ('lookup', 'token'),
    ('random', 'coupled'), ('target', 'coupled')])
def test_greedy_decoding_is_the_baseline_with_the_middle_drafters_verdicts(proposer,
                                                                         verification):
  result = _decode(proposer, verification)
  np.testing.assert_array_equal(result.output.tokens, _baseline().tokens)
  np.testing.assert_array_equal(result.output.lengths, _baseline().lengths)
  spec_tests._check_stats(result, GAMMA)
  # The same drafts meet the same verdicts: every counter, alpha and target_calls
  # included, is the single-stage middle drafter's.
  single = _decode('single', verification)
  _assert_all_stats_equal(result.stats, single.stats)
  assert float(result.stats.alpha) == float(single.stats.alpha)
  assert single.drafter_stats is None
  assert isinstance(result.drafter_stats, StageStats)
  assert int(result.drafter_stats.rounds) > 0


# ----------------------------------------------------------------------------------
# Coupled draws at temperature 1.

COUPLED_PROPOSALS = [('random', 5, 2, EOS_ID), ('target', 5, 4, EOS_ID),
                     ('target', 3, 1, None), ('lookup', 4, 2, EOS_ID),
                     ('nested', 5, 2, EOS_ID)]


@pytest.mark.parametrize('proposer, gamma, lookahead, eos_id', COUPLED_PROPOSALS)
def test_coupled_proposals_are_the_middle_drafters_draws(proposer, gamma, lookahead, eos_id):
  # Tokens and the noise of each drafted position, in both proposals.
  staged, params = _staged(proposer, lookahead)
  stats, _ = _two_proposals(staged, params, gamma=gamma, eos_id=eos_id, sampling=T1,
                            coupled=True)
  assert int(stats[1].rounds) > int(stats[0].rounds) > 0
  if proposer == 'target':
    assert int(stats[1].accepted) > 0.5 * int(stats[1].proposed)


def test_coupled_greedy_proposals_have_no_noise():
  staged, params = _staged('random', 2)
  _two_proposals(staged, params, gamma=3, eos_id=EOS_ID, coupled=True)


@pytest.mark.parametrize('proposer', ['random', 'target', 'nested'])
def test_coupled_sampled_decoding_is_the_baselines_draws(proposer):
  result = _decode(proposer, 'coupled', T1)
  baseline = _baseline(T1)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_allclose(result.output.token_log_probs, baseline.token_log_probs,
                             atol=1e-5)
  # The middle drafter's coupled draws, so its agreement with the target.
  _assert_all_stats_equal(result.stats, _decode('single', 'coupled', T1).stats)


# ----------------------------------------------------------------------------------
# Sampled proposals follow the middle drafter's exact joint distribution.

SMALL = spec_tests.SMALL
NUM_ROWS = spec_tests.NUM_ROWS
SAMPLED_GAMMA = 3
SMALL_MAX_LEN = 6
# name -> (sampling, lookahead, eos_id, committed prefix). With eos_id set a proposal
# ends at its first EOS (zeros after), as spec_tests._exact_joint's sequences do.
SAMPLED_PROPOSALS = {
    't1_eos_lookahead1': (T1, 1, EOS_ID, ()),
    'top_k3_no_eos_lookahead2': (SamplingConfig(temperature=1.0, top_k=3), 2, None, (4, 2)),
}


@functools.cache
def _small_proposer_params():
  """Another random init: far from both small models."""
  return spec_tests._scale_logits(init_params(SMALL, jax.random.PRNGKey(103)), 2.0)


def _small_staged(middle_params, proposer_params, lookahead):
  return (StagedDrafter(T5Drafter(SMALL), T5Drafter(SMALL), lookahead=lookahead),
          {'drafter': middle_params, 'proposer': proposer_params})


@functools.partial(jax.jit, static_argnames=('drafter', 'gamma', 'sampling', 'eos_id',
                                             'variant'))
def _sampled_proposals(drafter, params, prefix, keys, *, gamma, sampling, eos_id,
                       variant='exact'):
  """One proposal per row from `prefix` [L]: -> drafts [n, g], q [n, g, v], stats.
  variant only names a program of its own (a mutant traced under a monkeypatch)."""
  del variant
  rows = keys.shape[0]
  encoder_tokens = spec_tests._small_encoder_tokens(rows)
  context = DraftContext(
      tokens=jnp.broadcast_to(jnp.pad(prefix, (0, SMALL_MAX_LEN - prefix.shape[0])),
                              (rows, SMALL_MAX_LEN)),
      length=jnp.full((rows,), prefix.shape[0], jnp.int32), encoder_tokens=encoder_tokens,
      eos_id=eos_id)
  state = _consumed(drafter, params,
                    drafter.init_state(params, encoder_tokens, SMALL_MAX_LEN + gamma), context)
  drafts, q, state = drafter.propose(params, state, context, gamma, sampling, keys)
  return drafts, q, state.stats


@functools.cache
def _sampled_run(name, variant='exact'):
  sampling, lookahead, eos_id, prefix = SAMPLED_PROPOSALS[name]
  staged, params = _small_staged(spec_tests._small_target_params(),
                                 spec_tests._small_draft_params(), lookahead)
  keys = jax.random.split(jax.random.PRNGKey(7), NUM_ROWS)
  return _sampled_proposals(staged, params, jnp.asarray(prefix, jnp.int32), keys,
                            gamma=SAMPLED_GAMMA, sampling=sampling, eos_id=eos_id,
                            variant=variant)


@functools.cache
def _exact_continuations(which, sampling, prefix, gamma=SAMPLED_GAMMA):
  """Exact distribution of the next `gamma` tokens after `prefix`, never stopping at EOS:
  (outcomes [K, gamma], probs [K]) over the outcomes of positive probability, from the
  standardized conditionals of one teacher-forced pass over all V^(gamma-1) middles.
  which: 'target' or 'draft' (spec_tests' small models)."""
  params = (spec_tests._small_target_params() if which == 'target'
            else spec_tests._small_draft_params())
  vocab = SMALL.vocab_size
  middles = np.array(list(itertools.product(range(vocab), repeat=gamma - 1)), np.int32)
  decoder_inputs = np.concatenate(  # [P, 1 + len(prefix) + gamma - 1]
      [np.zeros((len(middles), 1), np.int32),
       np.broadcast_to(np.asarray(prefix, np.int32), (len(middles), len(prefix))), middles],
      axis=1)
  logits = spec_tests._teacher_forced_logits(
      params, spec_tests._small_encoder_tokens(len(middles)), decoder_inputs)
  probs = np.asarray(standardize(logits[:, len(prefix):], sampling), np.float64)  # [P, g, v]
  outcomes = np.array(list(itertools.product(range(vocab), repeat=gamma)), np.int64)
  rows = spec_tests._codes(outcomes[:, :gamma - 1], vocab)  # the middle each outcome runs
  # Position i sees only the first i tokens, which the row's middle holds.
  masses = np.prod(probs[rows[:, None], np.arange(gamma)[None, :], outcomes], axis=1)
  np.testing.assert_allclose(masses.sum(), 1.0, atol=1e-5)
  possible = masses > 0
  return outcomes[possible], masses[possible] / masses[possible].sum()


def _middle_and_proposer_joints(name):
  sampling, _, eos_id, prefix = SAMPLED_PROPOSALS[name]
  if eos_id is not None:
    assert prefix == ()  # spec_tests._exact_joint starts from x_0 alone
    return (spec_tests._exact_joint('target', sampling, SAMPLED_GAMMA),
            spec_tests._exact_joint('draft', sampling, SAMPLED_GAMMA))
  return (_exact_continuations('target', sampling, prefix),
          _exact_continuations('draft', sampling, prefix))


def test_the_continuation_enumeration_is_the_joint_from_x0():
  # The oracle of the no-EOS case against spec_tests' enumeration where they coincide:
  # stopped at the first EOS, from x_0 alone, the two give the same distribution.
  outcomes, probs = _exact_continuations('target', T1, ())
  stopped = np.where(np.cumsum(np.cumsum(outcomes == EOS_ID, axis=1), axis=1) > 1, 0,
                     outcomes)  # zeros after the first EOS
  codes = spec_tests._codes(stopped, SMALL.vocab_size)
  expected_outcomes, expected_probs = spec_tests._exact_joint('target', T1, SAMPLED_GAMMA)
  merged = {code: 0.0 for code in spec_tests._codes(expected_outcomes, SMALL.vocab_size)}
  for code, p in zip(codes, probs):
    merged[code] += p
  np.testing.assert_allclose([merged[code] for code in spec_tests._codes(
      expected_outcomes, SMALL.vocab_size)], expected_probs, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize('name', list(SAMPLED_PROPOSALS))
def test_sampled_proposals_follow_the_middle_drafters_joint(name):
  sampling, lookahead, _, _ = SAMPLED_PROPOSALS[name]
  drafts, q, stats = _sampled_run(name)
  (outcomes, probs), (proposer_outcomes, proposer_probs) = _middle_and_proposer_joints(name)
  spec_tests._assert_matches(drafts, outcomes, probs)
  # Power: the same samples are not the proposer's, which the drafter judged.
  spec_tests._assert_rejects(drafts, proposer_outcomes, proposer_probs)
  # Both sides of the judge ran, many times, over several rounds.
  assert 1000 < int(stats.accepted) < int(stats.proposed) - 1000, stats
  assert int(stats.rounds) >= math.ceil((SAMPLED_GAMMA - 1) / (lookahead + 1)) + 1
  # The q returned is the middle drafter's conditional after the drafts before it.
  check_rows = slice(0, 500)
  expected_q = _middle_q(np.asarray(drafts[check_rows]), sampling,
                         SAMPLED_PROPOSALS[name][3])
  drafted = np.asarray(_drafts_counted(drafts[check_rows], SAMPLED_PROPOSALS[name][2]))
  counted = np.arange(SAMPLED_GAMMA)[None, :] < drafted[:, None]
  np.testing.assert_allclose(np.asarray(q[check_rows])[counted], expected_q[counted],
                             rtol=1e-4, atol=1e-6)


def _drafts_counted(drafts, eos_id):
  drafts = jnp.asarray(drafts)
  if eos_id is None:
    return jnp.full((drafts.shape[0],), drafts.shape[1])
  return drafts_through_first(drafts == eos_id)


def _middle_q(drafts, sampling, prefix):
  """The middle drafter's standardized conditionals [n, g, v] at each draft, from one
  teacher-forced pass over prefix + drafts."""
  rows = drafts.shape[0]
  decoder_inputs = np.concatenate(
      [np.zeros((rows, 1), np.int32), np.broadcast_to(np.asarray(prefix, np.int32),
                                                      (rows, len(prefix))),
       drafts[:, :-1].astype(np.int32)], axis=1)
  logits = spec_tests._teacher_forced_logits(
      spec_tests._small_target_params(), spec_tests._small_encoder_tokens(rows),
      decoder_inputs)
  return np.asarray(standardize(logits[:, len(prefix):], sampling))


def test_a_judge_without_its_residual_is_caught(monkeypatch):
  # The mutant samples a rejected position from the drafter's q instead of
  # norm(max(0, q - q_proposer)): a biased proposal the oracle must reject.
  name = 't1_eos_lookahead1'
  monkeypatch.setattr(token_verification, 'residual_distribution',
                      lambda target_probs, draft_probs, lenience=1.0: target_probs)
  drafts, _, _ = _sampled_run(name, variant='no_residual')
  (outcomes, probs), _ = _middle_and_proposer_joints(name)
  spec_tests._assert_rejects(drafts, outcomes, probs)


# End to end: the target's exact distribution with a staged drafter.
END_TO_END_GAMMA, END_TO_END_LENGTH = 2, 3


@functools.cache
def _sampled_decode():
  # The middle drafter is spec_tests' small draft; the proposer a third model.
  staged, params = _small_staged(spec_tests._small_draft_params(), _small_proposer_params(),
                                 1)
  return speculative_generate(
      spec_tests._small_target_params(), params, spec_tests._small_encoder_tokens(),
      jax.random.PRNGKey(8), target_config=SMALL, drafter=staged,
      spec=SpeculativeConfig(gamma=END_TO_END_GAMMA), max_decode_length=END_TO_END_LENGTH,
      sampling=T1)


def test_sampled_decoding_follows_the_targets_exact_distribution():
  result = _sampled_decode()
  spec_tests._assert_matches(result.output.tokens,
                             *spec_tests._exact_joint('target', T1, END_TO_END_LENGTH))
  spec_tests._assert_rejects(result.output.tokens,
                             *spec_tests._exact_joint('draft', T1, END_TO_END_LENGTH))
  spec_tests._assert_padded_after_eos(result.output)
  spec_tests._check_stats(result, END_TO_END_GAMMA)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[END_TO_END_GAMMA] > 0
  # The middle drafter's acceptance (spec_tests: alpha ~ 0.6 for this draft).
  assert 0.4 < float(result.stats.alpha) < 0.85
  stage = result.drafter_stats
  assert 0 < int(stage.accepted) < int(stage.proposed)


# ----------------------------------------------------------------------------------
# StageStats.


@pytest.mark.parametrize('gamma, lookahead', [(5, 1), (4, 2), (5, 2), (4, 4), (2, 3)])
def test_an_agreeing_proposer_is_always_accepted(gamma, lookahead):
  # Rows never finish (eos_id None, no full buffer): every row takes part in every round,
  # gains lookahead + 1 drafts a round, and every proposal is accepted: in the first
  # proposal and in the second, after the target accepted every draft it could (all of
  # them and a bonus token, where the row stays unfinished), as a target that agrees
  # with the middle drafter does.
  staged = StagedDrafter(T5Drafter(CONFIG), T5Drafter(CONFIG), lookahead=lookahead)
  params = {'drafter': _target(), 'proposer': _target()}
  middle, middle_params = staged.drafter, params['drafter']
  encoder_tokens = jnp.asarray(_encoder_tokens())
  rows = len(LENGTHS) - 1
  context = _first_context(None)
  context = DraftContext(tokens=context.tokens[:rows], length=context.length[:rows],
                         encoder_tokens=encoder_tokens[:rows])
  staged_state = _init(staged, params, encoder_tokens[:rows], None, context,
                       max_length=MAX_LEN + gamma)
  middle_state = _init(middle, middle_params, encoder_tokens[:rows], None, context,
                       max_length=MAX_LEN + gamma)
  keys = jax.random.split(RNG, rows)
  rounds = math.ceil((gamma - 1) / (lookahead + 1))
  run = functools.partial(_propose, keys=keys, position_keys=None, gamma=gamma,
                          sampling=GREEDY)
  for call in (1, 2):
    drafts, _, staged_state = run(staged, params, staged_state, context)
    expected, _, middle_state = run(middle, middle_params, middle_state, context)
    np.testing.assert_array_equal(drafts, expected)
    stats = jax.device_get(staged_state.stats)
    assert int(stats.accepted) == int(stats.proposed), (f'proposal {call}', stats)
    assert int(stats.rounds) == call * rounds, (f'proposal {call}', stats)
    assert int(stats.drafter_steps) == call * (1 + rounds)
    assert int(stats.proposed) == call * rounds * rows * lookahead
    assert stats.nested is None
    if call == 1:
      room = MAX_LEN - 2 - np.asarray(context.length)  # the rows stay unfinished
      context = _next_context(context, np.asarray(expected), np.full(rows, gamma),
                              accepts=np.minimum(gamma, room))


def test_decode_stats_count_proposals_and_rounds():
  for name in ('agreeing', 'random', 'nested'):
    result = _decode(name)
    np.testing.assert_array_equal(result.output.tokens, _baseline().tokens)
    stage, calls = result.drafter_stats, int(result.stats.target_calls)
    # One drafter step per proposal (its first draft), one per round; a round gains at
    # least one draft.
    assert int(stage.drafter_steps) == calls + int(stage.rounds), name
    assert 0 < int(stage.rounds) <= calls * (GAMMA - 1), name
    assert 0 <= int(stage.accepted) <= int(stage.proposed), name
  random = _decode('random').drafter_stats
  assert int(random.accepted) < 0.2 * int(random.proposed)
  # Nested: the inner stage proposes once per outer round.
  nested = _decode('nested').drafter_stats
  assert isinstance(nested.nested, StageStats)
  assert int(nested.nested.drafter_steps) == int(nested.rounds) + int(nested.nested.rounds)
  assert nested.nested.nested is None
  summary = nested.summary()
  assert [stage['rounds'] for stage in summary] == [int(nested.rounds),
                                                    int(nested.nested.rounds)]
  assert summary[0]['acceptance'] == round(int(nested.accepted) / int(nested.proposed), 4)
  assert set(summary[1]) == {'rounds', 'drafter_steps', 'proposed', 'accepted', 'acceptance'}


@pytest.mark.parametrize('name', ['agreeing_caught_up', 'agreeing'])
def test_an_agreeing_proposer_is_accepted_throughout_a_decode(name):
  # The proposer is the middle drafter's own model: each proposal is its greedy token,
  # so every one is accepted, in every proposal of the decode, as long as the proposer
  # conditions on the committed tokens. 'agreeing_caught_up' re-reads them all before
  # each proposal (the reference); 'agreeing' relies on its cache, which the staged
  # drafter must keep as a drafter's cache is kept in a decode: every committed input
  # consumed, but the last two.
  result = _decode(name)
  np.testing.assert_array_equal(result.output.tokens, _baseline().tokens)
  stage = result.drafter_stats
  assert int(stage.proposed) > 0
  assert int(stage.accepted) == int(stage.proposed), stage
  # Each round gains lookahead + 1 drafts: at most ceil((gamma - 1) / 3) = 1 a proposal
  # (none where every decoding row drafted EOS first).
  calls = int(result.stats.target_calls)
  assert int(stage.rounds) <= calls * math.ceil((GAMMA - 1) / 3), stage
  assert int(stage.drafter_steps) == calls + int(stage.rounds)


def test_stage_stats_acceptance_and_summary():
  stats = StageStats(rounds=jnp.int32(3), drafter_steps=jnp.int32(5), proposed=jnp.int32(8),
                     accepted=jnp.int32(6))
  assert float(stats.acceptance) == 0.75
  assert stats.summary() == [dict(rounds=3, drafter_steps=5, proposed=8, accepted=6,
                                  acceptance=0.75)]
  empty = StageStats(*(jnp.int32(0),) * 4)
  assert float(empty.acceptance) == 0.0  # no proposals: no division by zero


# ----------------------------------------------------------------------------------
# Construction errors.


def test_lookahead_must_be_positive():
  with pytest.raises(ValueError, match=r'lookahead must be >= 1.*got 0'):
    StagedDrafter(MIDDLE, T5Drafter(CONFIG), lookahead=0)


def test_proposer_must_share_the_vocabulary():
  with pytest.raises(ValueError, match=r'share a vocabulary.*proposer vocab_size 32.*'
                     r'drafter vocab_size 64'):
    StagedDrafter(MIDDLE, PromptLookupDrafter(32))


def test_the_middle_drafter_must_have_a_cached_decoder():
  with pytest.raises(ValueError, match=r'cached decoder.*got PromptLookupDrafter'):
    StagedDrafter(PromptLookupDrafter(VOCAB), T5Drafter(CONFIG))
  with pytest.raises(ValueError, match=r'cached decoder.*got StagedDrafter'):
    StagedDrafter(INNER, T5Drafter(CONFIG))
