"""Coupled verification (SpeculativeConfig(verification='coupled')).

Position j of a row is drawn with the key fold_in(row key, j), the baseline's, by the
drafter and by the target; the output must therefore be the baseline's sampled output
token for token, for any drafter and sampling setting, which is checked directly:
- T5 drafters (the target itself, where every coupled draft agrees, a near copy and an
  unrelated draft) and a drafter without `propose_coupled` (fresh noise everywhere);
  temperature, top-k and top-p; gamma 1 and 3; rows that end early and at the limit.
- The trace rebuilds each output and the statistics agree with it; alpha is the
  agreement rate of the verified positions.
- Over 50k rows of the enumeration setup the output follows the target's exact joint
  distribution (and equals the baseline's rows); NaN logits stop the rows the baseline
  stops, keeping a prefix of its tokens.
- The pieces: position keys and noise against jax.random, the verdict on a hand example.

Helpers and the tiny models come from tests/test_speculative.py.
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_speculative as spec_tests  # tests/test_speculative.py: models, enumeration
from _wrapped_drafter import WrappedDrafter  # tests/_wrapped_drafter.py
from jaxspec.decoding import common
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.sampling import SamplingConfig, position_noise, sample_logits
from jaxspec.decoding.verification.coupled import coupled_tokens, coupled_verdict

TARGET, DRAFT, MAX_LEN = spec_tests.TARGET, spec_tests.DRAFT, spec_tests.MAX_LEN
T1 = SamplingConfig(temperature=1.0)
T07_TOP_P = SamplingConfig(temperature=0.7, top_p=0.8)
TOP_K = SamplingConfig(temperature=1.0, top_k=5)
RNG = jax.random.PRNGKey(21)


@dataclasses.dataclass(frozen=True)
class _WithoutCoupledDraws(WrappedDrafter):
  """A T5 drafter without its propose_coupled (Drafter's default): coupled verification
  takes `propose`'s tokens and draws every verified position with fresh noise."""
  inner: T5Drafter


def _drafter_setup(name):
  if name == 'fallback':
    return _WithoutCoupledDraws(T5Drafter(DRAFT)), spec_tests._draft_params()
  return spec_tests._drafter_setup(name)


def _baseline(sampling, params=None):
  return generate(spec_tests._target_params() if params is None else params,
                  spec_tests._encoder_tokens(), RNG, config=TARGET,
                  max_decode_length=MAX_LEN, sampling=sampling, on_nonfinite='ignore')


def _coupled_run(drafter_name, sampling, gamma, target_params=None):
  drafter, drafter_params = _drafter_setup(drafter_name)
  return speculative_generate(
      spec_tests._target_params() if target_params is None else target_params,
      drafter_params, spec_tests._encoder_tokens(), RNG, target_config=TARGET,
      drafter=drafter, spec=SpeculativeConfig(gamma=gamma, verification='coupled'),
      max_decode_length=MAX_LEN, sampling=sampling, record_trace=True,
      on_nonfinite='ignore')


# (drafter, sampling, gamma): the self draft agrees everywhere (bonus tokens, the
# drafter's catch-up step); the others reject at varying positions.
CASES = {
    'self_t1_gamma3': ('self', T1, 3),
    'near_copy_t0.7_top_p_gamma3': ('near_copy', T07_TOP_P, 3),
    'random_top_k_gamma1': ('random', TOP_K, 1),
    'fallback_t1_gamma2': ('fallback', T1, 2),
}


@pytest.mark.parametrize('name', list(CASES))
def test_coupled_output_is_the_baselines(name):
  drafter_name, sampling, gamma = CASES[name]
  result, baseline = _coupled_run(drafter_name, sampling, gamma), _baseline(sampling)
  lengths = np.asarray(baseline.lengths)
  assert lengths.min() < 4 and lengths.max() > 8, lengths  # early ends and long rows
  if sampling == T1:
    assert lengths.max() == MAX_LEN, lengths  # rows that reach the limit
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_allclose(result.output.token_log_probs, baseline.token_log_probs,
                             atol=1e-5)
  spec_tests._assert_padded_after_eos(result.output)
  spec_tests._check_trace(result, gamma)
  spec_tests._check_stats(result, gamma)
  stats = result.stats
  # alpha is the agreement rate: every verified position counts 1 when it was accepted.
  assert float(stats.overlap_sum) == float(np.sum(stats.accepted_per_position))
  alpha = float(stats.alpha)
  if drafter_name == 'self':
    # The drafter drew each position with the target's noise: every draft agrees.
    assert alpha == 1.0
    np.testing.assert_array_equal(np.asarray(stats.num_accepted_counts)[:gamma],
                                  np.asarray(stats.num_drafted_counts)[:gamma])
  else:
    assert 0.0 < alpha < 1.0 and np.asarray(stats.num_accepted_counts)[0] > 0, alpha


def test_coupled_draws_agree_more_than_fresh_noise():
  # The same near copy, with and without its position's noise: coupling the draws is
  # what makes a close draft agree. (The coupled run shares the self case's program.)
  drafter, drafter_params = spec_tests._drafter_setup('near_copy')
  run = lambda drafter: speculative_generate(  # noqa: E731
      spec_tests._target_params(), drafter_params, spec_tests._encoder_tokens(), RNG,
      target_config=TARGET, drafter=drafter,
      spec=SpeculativeConfig(gamma=3, verification='coupled'), max_decode_length=MAX_LEN,
      sampling=T1, record_trace=True, on_nonfinite='ignore').stats
  coupled, fresh = run(drafter), run(_WithoutCoupledDraws(drafter))
  assert float(coupled.alpha) > 0.7 and float(fresh.alpha) < 0.5 * float(coupled.alpha)


def test_coupled_at_temperature_zero_is_token_wise():
  result = speculative_generate(
      spec_tests._target_params(), spec_tests._near_copy_params(),
      spec_tests._encoder_tokens(), target_config=TARGET, drafter=T5Drafter(TARGET),
      spec=SpeculativeConfig(gamma=3, verification='coupled'), max_decode_length=MAX_LEN)
  token_wise = spec_tests._greedy_run('near_copy', 3)
  np.testing.assert_array_equal(result.output.tokens, spec_tests._baseline().tokens)
  spec_tests._assert_same_stats(result.stats, token_wise.stats)


def test_coupled_nan_rows_stop_and_keep_the_baselines_tokens():
  # Rows that draw `token` read a NaN embedding at the next step. The same rows stop
  # (and would raise); the others equal the baseline; a stopped row keeps a prefix of
  # the baseline's tokens (a NaN key of a rejected draft in the same verify window can
  # reach the earlier positions through masked attention, 0 x NaN, so it may stop
  # sooner than the baseline: design.md, "Exactness").
  token, _ = spec_tests._token_reached_mid_output()
  params = spec_tests._with_nan_embedding(spec_tests._target_params(), token)
  baseline = _baseline(T1, params)
  result = _coupled_run('self', T1, 3, target_params=params)  # the self case's program
  broken = np.asarray(baseline.nonfinite_logits)
  np.testing.assert_array_equal(result.output.nonfinite_logits, broken)
  assert 0 < broken.sum() < len(broken)
  tokens, expected = np.asarray(result.output.tokens), np.asarray(baseline.tokens)
  np.testing.assert_array_equal(tokens[~broken], expected[~broken])
  for row in np.flatnonzero(broken):
    kept = int(np.sum(tokens[row] != 0))
    np.testing.assert_array_equal(tokens[row, :kept], expected[row, :kept])
    np.testing.assert_array_equal(tokens[row, kept:], 0)


def test_coupled_matches_exact_distribution():
  # The enumeration setup of tests/test_speculative.py: 50k rows, one key each.
  sampling, gamma, length = spec_tests.SAMPLED_CASES['t1_gamma2']
  small = spec_tests.SMALL
  encoder_tokens = spec_tests._small_encoder_tokens()
  result = speculative_generate(
      spec_tests._small_target_params(), spec_tests._small_draft_params(), encoder_tokens,
      jax.random.PRNGKey(3), target_config=small, drafter=T5Drafter(small),
      spec=SpeculativeConfig(gamma=gamma, verification='coupled'),
      max_decode_length=length, sampling=sampling)
  spec_tests._assert_matches(result.output.tokens,
                             *spec_tests._exact_joint('target', sampling, length))
  baseline = generate(spec_tests._small_target_params(), encoder_tokens,
                      jax.random.PRNGKey(3), config=small, max_decode_length=length,
                      sampling=sampling)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  # The check has power here: the draft's own distribution is rejected.
  spec_tests._assert_rejects(result.output.tokens,
                             *spec_tests._exact_joint('draft', sampling, length))
  assert 0.3 < float(result.stats.alpha) < 0.95


def test_position_keys_and_noise_are_the_baselines():
  row_keys = jax.random.split(jax.random.PRNGKey(4), 3)
  start = jnp.array([0, 5, 2], jnp.int32)
  keys = common.position_keys(row_keys, start, 4)  # [3, 4]
  noise = position_noise(keys, 11)  # [3, 4, 11]
  logits = jax.random.normal(jax.random.PRNGKey(5), (3, 4, 11)) * 3
  for row in range(3):
    for j in range(4):
      key = jax.random.fold_in(row_keys[row], int(start[row]) + j)
      np.testing.assert_array_equal(keys[row, j], key)
      np.testing.assert_array_equal(noise[row, j], jax.random.gumbel(key, (11,)))
      for sampling in (T1, T07_TOP_P, TOP_K, SamplingConfig()):
        assert int(coupled_tokens(logits[row, j], noise[row, j], sampling)) == int(
            sample_logits(key, logits[row, j], sampling))
  typed = jax.random.key(4)
  typed_keys = common.position_keys(jax.random.split(typed, 3), start, 2)
  np.testing.assert_array_equal(
      position_noise(typed_keys, 7)[1, 1],
      jax.random.gumbel(jax.random.fold_in(jax.random.split(typed, 3)[1], 6), (7,)))


def test_coupled_verdict_counts_agreeing_prefixes():
  drafts = jnp.array([[4, 5, 6], [4, 5, 6], [4, 9, 6], [4, 5, 6]])
  target = jnp.array([[4, 5, 6, 7], [1, 5, 6, 7], [4, 5, 6, 7], [4, 5, 6, 7]])
  num_drafts = jnp.array([3, 3, 3, 2])
  verdict = coupled_verdict(drafts, target, num_drafts)
  np.testing.assert_array_equal(verdict.num_accepted, [3, 0, 1, 2])
  np.testing.assert_array_equal(verdict.next_token, [7, 1, 5, 6])
  np.testing.assert_array_equal(verdict.overlap, [[1, 1, 1], [0, 1, 1], [1, 0, 1],
                                                  [1, 1, 0]])


@pytest.mark.parametrize('options, problem', [
    (dict(lenience=0.5), 'lenience'),
    (dict(draft_confidence_threshold=0.5), 'draft_confidence_threshold'),
    (dict(num_drafts=2), "verification='coupled'"),
])
def test_unsupported_combinations_are_refused(options, problem):
  with pytest.raises(ValueError, match=re.escape(problem)):
    SpeculativeConfig(gamma=3, verification='coupled', **options)
