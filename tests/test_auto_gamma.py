"""jaxspec.decoding.auto_gamma: the batch model against exact values, the choice against
brute force on simulated cost tables, the decoder's fallback to the baseline when a
draft cannot pay, outputs that never change, the calibration cache, and the launcher
with gamma='auto'."""

import dataclasses
import json
import math
import time

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from _wrapped_drafter import WrappedDrafter  # tests/_wrapped_drafter.py
from jaxspec.config import get_config
from jaxspec.decoding import auto_gamma
from jaxspec.decoding.auto_gamma import (AutoGammaDecoder, BatchCosts, GammaCostCache,
                                         choose_gamma, expected_batch_iterations,
                                         predicted_speedups, row_iterations)
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.beam_search import BeamConfig
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.launch import gin_flags
from jaxspec.launch import infer as infer_script
from jaxspec.measure import cost_model
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig

GREEDY = SamplingConfig(temperature=0.0)


# ----------------------------------------------------------------------------------
# The model.


@pytest.mark.parametrize('gamma', [1, 3, 9])
def test_row_iterations_at_alpha_one_and_zero_are_exact(gamma):
  lengths = np.arange(1, 40)
  rng = np.random.default_rng(0)
  np.testing.assert_array_equal(row_iterations(lengths, 1.0, gamma, rng),
                                -(-lengths // (gamma + 1)))  # ceil(L / (gamma + 1))
  np.testing.assert_array_equal(row_iterations(lengths, 0.0, gamma, rng), lengths)


@pytest.mark.parametrize('alpha, gamma, length', [(0.6, 3, 12), (0.9, 5, 20), (0.98, 9, 13)])
def test_one_row_mean_matches_the_exact_recursion(alpha, gamma, length):
  """Batch 1: the simulation's mean iterations against cost_model's exact expected
  target calls for an output of `length` tokens (an independent recursion)."""
  calls, _ = cost_model.expected_calls_and_drafts(alpha, gamma, length)
  rng = np.random.default_rng(1)
  simulated = row_iterations(np.full(20000, length), alpha, gamma, rng)
  assert abs(simulated.mean() - calls[length]) < 4 * simulated.std() / math.sqrt(20000)


@pytest.mark.parametrize('alpha, gamma, length', [(0.6, 3, 12), (0.9, 5, 20), (0.98, 9, 13)])
def test_one_row_expectation_is_the_exact_recursion(alpha, gamma, length):
  """Batch 1: expected_batch_iterations (exact) against cost_model's expected target
  calls for an output of `length` tokens (an independent recursion)."""
  calls, _ = cost_model.expected_calls_and_drafts(alpha, gamma, length)
  steps, iterations = expected_batch_iterations([length], alpha, gamma, batch_size=1)
  assert steps == length
  assert iterations == pytest.approx(calls[length], rel=1e-9)


def test_a_batch_takes_its_longest_row():
  steps, iterations = expected_batch_iterations([5, 30], 1.0, 4, batch_size=8)
  # 8 rows of 5 or 30 tokens: the longest is 30 unless all 8 drew 5.
  assert steps == pytest.approx(30 - 25 / 2**8, rel=1e-12)
  assert iterations == pytest.approx(6 - 5 / 2**8, rel=1e-12)  # ceil(30 / 5) = 6, or 1
  steps_one, iterations_one = expected_batch_iterations([5, 30], 1.0, 4, batch_size=1)
  assert steps_one == pytest.approx(17.5) and iterations_one == pytest.approx(3.5)


@pytest.mark.parametrize('seed', range(3))
def test_the_batch_expectation_is_the_simulations_mean(seed):
  """Batches of rows drawn from the lengths seen, each row's iterations drawn
  (row_iterations): their most, averaged, is the exact expectation."""
  rng = np.random.default_rng(seed)
  lengths = rng.integers(1, 40, 30)
  alpha, gamma, batch = float(rng.uniform(0.2, 0.95)), int(rng.choice([1, 3, 9])), 8
  drawn = rng.choice(lengths, size=(20000, batch))
  iterations = row_iterations(drawn, alpha, gamma, rng).max(axis=1)
  expected_steps, expected_iterations = expected_batch_iterations(lengths, alpha, gamma, batch)
  assert abs(drawn.max(axis=1).mean() - expected_steps) < 4 * drawn.max(axis=1).std() / math.sqrt(20000)
  assert abs(iterations.mean() - expected_iterations) < 4 * iterations.std() / math.sqrt(20000)


def _simulated_drafts(lengths, alpha, gamma, rng):
  """[batches] draft steps of batches of rows `lengths` [batches, b], drawn: each
  iteration every row still decoding drafts min(gamma, tokens left), the batch runs its
  longest proposal, and each row keeps its drafts up to the first rejection, plus one."""
  left = np.array(lengths, np.int64)
  steps = np.zeros(left.shape[0], np.int64)
  while np.any(left > 0):
    proposals = np.minimum(gamma, left)
    steps += proposals.max(axis=1)
    accepted = np.minimum(rng.geometric(1.0 - alpha, left.shape) - 1, proposals)
    left = np.maximum(left - (accepted + 1), 0)
  return steps


@pytest.mark.parametrize('alpha, gamma', [(0.6, 3), (0.9, 9), (0.99, 19)])
def test_one_rows_expected_drafts_are_the_simulations_mean(alpha, gamma):
  """Batch 1: a proposal drafts min(gamma, tokens left), so a 4-token output drafts 4
  with gamma 9 or 19 alike at alpha 1; the expectation (over lengths seen) against the
  drawn mean."""
  rng = np.random.default_rng(2)
  lengths = np.array([4, 11, 27, 40])
  drawn = rng.choice(lengths, size=(40000, 1))
  simulated = _simulated_drafts(drawn, alpha, gamma, rng)
  expected = auto_gamma.expected_batch_drafts(lengths, alpha, gamma, batch_size=1)
  assert abs(simulated.mean() - expected) < 4 * simulated.std() / math.sqrt(drawn.shape[0])
  for n in lengths:
    assert auto_gamma.expected_rows_work([n], alpha, gamma)[2] == pytest.approx(
        cost_model.expected_calls_and_drafts(alpha, gamma, int(n))[1][n])
  assert auto_gamma.expected_batch_drafts([4], 1.0, 9, 1) == pytest.approx(4.0)
  assert auto_gamma.expected_batch_drafts([4], 1.0, 19, 1) == pytest.approx(4.0)


@pytest.mark.parametrize('alpha, gamma', [(0.7, 3), (0.95, 9)])
def test_a_batchs_expected_drafts_are_near_the_simulations_mean(alpha, gamma):
  """Batch 4: the batch drafts while any row's proposal goes on; the model counts its
  longest row's drafts a call for every call of the batch, within 3% of the drawn mean
  and never under what the longest row alone drafts."""
  rng = np.random.default_rng(3)
  lengths = np.array([3, 8, 15, 22, 30])
  drawn = rng.choice(lengths, size=(40000, 4))
  simulated = _simulated_drafts(drawn, alpha, gamma, rng).mean()
  expected = auto_gamma.expected_batch_drafts(lengths, alpha, gamma, batch_size=4)
  assert expected == pytest.approx(simulated, rel=0.03)
  longest_alone = _simulated_drafts(drawn.max(axis=1, keepdims=True), alpha, gamma, rng).mean()
  assert expected > longest_alone
  rows = drawn[:2000]
  exact = np.mean([auto_gamma.expected_rows_work(r, alpha, gamma, 30)[2] for r in rows])
  assert exact == pytest.approx(_simulated_drafts(rows, alpha, gamma, rng).mean(), rel=0.1)


def test_the_costs_are_told_apart_over_every_decoders_batches():
  """Least squares over the baseline's and every gamma's batches: a cost a batch and a
  step, a cost a call for each gamma and one a draft step, from noisy seconds; a cost
  the batches cannot tell apart is 0 (the others carry it); none negative."""
  rng = np.random.default_rng(4)
  call = {1: 0.010, 3: 0.011, 9: 0.013}
  lengths = rng.integers(3, 60, 48)
  noise = lambda: rng.normal(0, 2e-4)  # noqa: E731
  plain = [(0.008 + n * 0.007 + noise(), int(n)) for n in lengths]
  speculative = {}
  for g in call:
    work = [(int(np.ceil(n / (g + 1))), int(n - np.ceil(n / (g + 1)) + min(g, n) // 2))
            for n in lengths]
    speculative[g] = [(0.008 + c * call[g] + d * 0.002 + noise(), c, d) for c, d in work]
  costs = auto_gamma.fit_batch_costs(1, plain, speculative)
  assert costs.batch_seconds == pytest.approx(0.008, rel=0.05)
  assert costs.step_seconds == pytest.approx(0.007, rel=0.05)
  assert costs.draft_seconds == pytest.approx(0.002, rel=0.05)
  assert costs.call_seconds == {g: pytest.approx(v, rel=0.05) for g, v in call.items()}
  # Drafts in one proportion to the calls in each gamma: no telling them apart.
  costs = auto_gamma.fit_batch_costs(
      2, [(0.02, 2), (0.04, 4)], {1: [(0.03, 2, 2), (0.06, 4, 4)], 3: [(0.05, 2, 6)]})
  assert costs.draft_seconds == 0.0 and costs.batch_seconds == pytest.approx(0.0, abs=1e-12)
  assert costs.step_seconds == pytest.approx(0.01)
  assert costs.call_seconds == {1: pytest.approx(0.015), 3: pytest.approx(0.025)}
  # Every batch of one length: its cost goes to the steps and calls.
  costs = auto_gamma.fit_batch_costs(
      1, [(0.05, 5)] * 3, {1: [(0.03, 3, 2)] * 3, 3: [(0.02, 2, 3)] * 3})
  assert costs.batch_seconds == 0.0 and costs.draft_seconds == 0.0
  assert costs.baseline_seconds(5) == pytest.approx(0.05)
  assert costs.seconds(1, 3, 2) == pytest.approx(0.03)
  # Seconds that fall with the drafts: held at 0, the calls carry them.
  costs = auto_gamma.fit_batch_costs(
      1, [(0.02, 2), (0.05, 5)],
      {1: [(0.03, 2, 1), (0.02, 2, 9)], 3: [(0.05, 2, 6), (0.04, 2, 3)]})
  assert costs.draft_seconds == 0.0 and min(costs.call_seconds.values()) > 0.0


def test_a_call_never_costs_less_than_a_step():
  """A batch of 4 drafts while any row does, so its drafts run nearly in one proportion
  to its calls and a free fit trades the two (it priced gamma 14's call at 0 on the
  Xeon). A call verifies at least a baseline step's one position: fitted as a step plus
  its excess, no call comes out under a step, and the fit stays within the noise of
  the true costs' seconds on the batches it saw."""
  rng = np.random.default_rng(0)
  step, batch, draft = 0.0095, 0.006, 0.003
  call = {g: step + 0.0004 * g for g in (1, 2, 3, 5, 9, 14, 19)}
  for _ in range(20):
    lengths = rng.integers(8, 40, 12)
    plain = [((batch + n * step) * (1 + rng.normal(0, 0.03)), int(n)) for n in lengths]
    speculative = {}
    for g in call:
      work = [(c, int(c * g * rng.uniform(0.85, 1.0)))
              for c in (int(np.ceil(n / (0.9 * g + 1))) for n in lengths)]
      speculative[g] = [((batch + c * call[g] + d * draft) * (1 + rng.normal(0, 0.03)), c, d)
                        for c, d in work]
    costs = auto_gamma.fit_batch_costs(4, plain, speculative)
    assert min(costs.call_seconds.values()) >= costs.step_seconds > 0.0
    for g, batches in speculative.items():
      fitted = np.array([costs.seconds(g, c, d) for _, c, d in batches])
      true = np.array([batch + c * call[g] + d * draft for _, c, d in batches])
      assert np.abs(fitted / true - 1).mean() < 0.05


@pytest.mark.parametrize('seed', range(30))
def test_non_negative_least_squares_is_the_best_of_every_support(seed):
  """Against enumeration: the least-squares solution on each subset of the columns,
  kept where it is non-negative, the best of them."""
  rng = np.random.default_rng(seed)
  columns = int(rng.integers(1, 6))
  design = rng.normal(size=(int(rng.integers(columns, 12)), columns))
  target = rng.normal(size=design.shape[0])
  best = np.inf
  for mask in range(1 << columns):
    support = np.array([(mask >> k) & 1 for k in range(columns)], bool)
    x = np.zeros(columns)
    if support.any():
      x[support], *_ = np.linalg.lstsq(design[:, support], target, rcond=None)
    if np.all(x >= -1e-12):
      best = min(best, float(np.sum((design @ x - target) ** 2)))
  solution = auto_gamma._non_negative_least_squares(design, target)
  assert np.all(solution >= 0.0)
  assert float(np.sum((design @ solution - target) ** 2)) == pytest.approx(best, rel=1e-9,
                                                                           abs=1e-12)


def _brute_force_best(costs: BatchCosts, length: int, min_speedup: float) -> int:
  """At alpha 1 and one output length every quantity is exact: the baseline takes
  `length` steps and gamma g takes ceil(length / (g + 1)) iterations."""
  speedups = {g: length * costs.step_seconds / (-(-length // (g + 1)) * seconds)
              for g, seconds in costs.call_seconds.items()}
  best = max(speedups, key=lambda g: (speedups[g], -g))
  return best if speedups[best] >= min_speedup else 0


@pytest.mark.parametrize('seed', range(20))
def test_choice_is_what_the_model_predicts_on_simulated_cost_tables(seed):
  rng = np.random.default_rng(seed)
  step = 0.01
  gammas = (1, 2, 3, 5, 9)
  # Iterations costing a verify step of V(g + 1) plus g draft steps of c each.
  c, v_slope = rng.uniform(0.0, 0.6), rng.uniform(0.0, 1.0)
  costs = BatchCosts(batch_size=int(rng.integers(1, 5)), step_seconds=step,
                     call_seconds={g: step * (1 + v_slope * g + c * g) for g in gammas})
  length = int(rng.integers(4, 40))
  chosen = choose_gamma(costs, 1.0, [length])
  assert chosen == _brute_force_best(costs, length, auto_gamma.MIN_SPEEDUP)


def test_the_baseline_is_chosen_where_no_gamma_pays():
  costs = BatchCosts(batch_size=8, step_seconds=0.01,
                     call_seconds={1: 0.03, 3: 0.06, 9: 0.2})
  assert choose_gamma(costs, 0.99, [12, 20, 25]) == 0
  # 3% predicted is below MIN_SPEEDUP: not worth a prediction error.
  costs = BatchCosts(batch_size=1, step_seconds=0.01, call_seconds={1: 0.0194})
  assert predicted_speedups(costs, 1.0, [20])[1] == pytest.approx(1.03, abs=0.001)
  assert choose_gamma(costs, 1.0, [20]) == 0


def test_a_switch_needs_a_clear_gain():
  costs = BatchCosts(batch_size=1, step_seconds=0.01, call_seconds={2: 0.0140, 3: 0.0182})
  # ceil(24/3) = 8 x 14 ms against ceil(24/4) = 6 x 18.2 ms: gamma 3 is 2.6% faster.
  assert choose_gamma(costs, 1.0, [24]) == 3
  assert choose_gamma(costs, 1.0, [24], current=2) == 2  # under MIN_SPEEDUP better
  costs.call_seconds[3] = 0.0170  # 6 x 17 ms: 9.8% faster
  assert choose_gamma(costs, 1.0, [24], current=2) == 3


def test_what_the_run_realized_overrides_the_prediction():
  costs = BatchCosts(batch_size=4, step_seconds=0.01, call_seconds={3: 0.015, 9: 0.04})
  assert choose_gamma(costs, 0.99, [20]) == 3
  predicted = predicted_speedups(costs, 0.99, [20])
  assert predicted[3] > predicted[9] > 1.5
  realized = lambda speedups: {g: v / predicted[g] for g, v in speedups.items()}  # noqa: E731
  # gamma 3 realized 0.9x, a third of its prediction: gamma 9's prediction falls alike.
  assert choose_gamma(costs, 0.99, [20], ratios=realized({3: 0.9})) == 0
  assert choose_gamma(costs, 0.99, [20], ratios=realized({9: 0.5 * predicted[9]})) == 3
  assert choose_gamma(costs, 0.99, [20], ratios=realized({3: 0.9, 9: 1.02})) == 0
  assert choose_gamma(costs, 0.99, [20], ratios=realized({3: 0.9, 9: 1.2})) == 9
  assert choose_gamma(costs, 0.99, [20], current=9,
                      ratios=realized({3: 0.9, 9: 0.97})) == 0


def test_a_shortfall_the_run_realized_scales_every_prediction_alike():
  """A run whose batches decode 10% slower against the calibration's baseline than the
  calibration predicted keeps its gamma: the others would fall short alike."""
  costs = BatchCosts(batch_size=4, step_seconds=0.01,
                     call_seconds={2: 0.0140, 3: 0.0175, 5: 0.0245})
  predicted = predicted_speedups(costs, 0.98, [20])
  best = max(predicted, key=predicted.get)
  runner_up = max((g for g in predicted if g not in (0, best)), key=predicted.get)
  assert predicted[runner_up] > 0.9 * predicted[best] * auto_gamma.MIN_SPEEDUP
  assert choose_gamma(costs, 0.98, [20], current=best, ratios={best: 0.9}) == best
  scaled = auto_gamma.scaled_by_ratios(predicted, {best: 0.9})
  assert scaled[runner_up] == pytest.approx(0.9 * predicted[runner_up])
  assert scaled[0] == 1.0 and scaled[best] == pytest.approx(0.9 * predicted[best])
  realized = {best: 0.9 * predicted[best]}
  assert auto_gamma.with_realized(predicted, realized) == {**scaled, **realized}


def _record_batches(decoder, gamma, rows, seconds, count):
  for _ in range(count):
    decoder._record(gamma, _lengths_output(rows), seconds)  # pylint: disable=protected-access


def _lengths_output(rows):
  """A speculative output whose only field read is its rows' lengths."""
  output = auto_gamma.DecodeOutput(
      tokens=None, token_log_probs=None, log_prob=None,
      lengths=np.asarray(rows, np.int32), nonfinite_logits=None)
  return auto_gamma.SpeculativeOutput(output=output, stats=None)


def test_the_decoder_drops_a_gamma_that_does_worse_in_the_run():
  decoder = AutoGammaDecoder(None, None, SpeculativeConfig(gamma='auto'), batch_size=1,
                             gammas=(3,), refresh_batches=1)
  decoder.costs = BatchCosts(1, 0.01, {3: 0.015})
  decoder.lengths = [20]
  decoder.overlap_sum, decoder.verified_positions = 99.0, 100  # alpha 0.99
  assert decoder.choose() == 3
  predicted = auto_gamma.predicted_batch_seconds(decoder.costs, 0.99, 3, [20])
  assert predicted == pytest.approx(
      0.015 * cost_model.expected_calls_and_drafts(0.99, 3, 20)[0][20])
  # Batches of 20-token outputs that took 0.25 s each, where the baseline's 20 steps
  # would take 0.2 s: 0.8x realized.
  _record_batches(decoder, 3, [20], 0.25, AutoGammaDecoder.REALIZED_BATCHES - 1)
  assert decoder.realized_ratios() == {} and decoder.choose() == 3  # too few yet
  _record_batches(decoder, 3, [20], 0.25, 1)
  assert decoder.realized_ratios() == {3: pytest.approx(predicted / 0.25)}
  assert decoder.choose() == 0
  # The run's own baseline batches took 1.6x the calibration's step cost: that hour the
  # baseline was dearer too, and gamma 3's 0.25 s against it pays again.
  # pylint: disable-next=protected-access
  decoder._plain_seconds, decoder._plain_steps, decoder._plain_batches = 1.6 * 0.64, 64, 4
  assert decoder.realized_ratios() == {3: pytest.approx(1.6 * predicted / 0.25)}
  assert decoder.choose() == 3


def test_gammas_are_judged_on_their_own_batches_not_on_each_others():
  """Two gammas that each ran as predicted, one on the run's short strings and the other
  on its long sentences, are at par with their predictions; their raw speedups (short
  outputs speed up less whatever the gamma) would have sent the run to the one that
  happened to decode the long ones."""
  costs = BatchCosts(1, 0.01, {9: 0.02, 19: 0.02}, draft_seconds=0.002)
  decoder = AutoGammaDecoder(None, None, SpeculativeConfig(gamma='auto'), batch_size=1,
                             gammas=(9, 19), refresh_batches=1)
  decoder.costs, decoder.lengths = costs, [4] * 10 + [40] * 10
  decoder.overlap_sum, decoder.verified_positions = 100.0, 100  # alpha 1
  short = auto_gamma.predicted_batch_seconds(costs, 1.0, 19, [4])  # 1 call, 4 drafts
  long = auto_gamma.predicted_batch_seconds(costs, 1.0, 9, [40])  # 4 calls, 36 drafts
  assert short == pytest.approx(0.02 + 4 * 0.002) and long == pytest.approx(4 * 0.02 + 36 * 0.002)
  _record_batches(decoder, 19, [4], short, 8)
  _record_batches(decoder, 9, [40], long, 8)
  assert decoder.realized_ratios() == {9: pytest.approx(1.0), 19: pytest.approx(1.0)}
  assert 0.04 / short < 0.4 / long  # 19's raw speedup is the smaller
  assert decoder.choose() == 19  # 2 calls, not 4, for the 40-token outputs


def test_beam_choice_is_plain_beam_search_unless_a_gamma_measures_clearly_faster():
  assert auto_gamma.choose_measured({1: 0.45, 2: 0.52, 3: 0.4}) == 0
  assert auto_gamma.choose_measured({1: 1.04, 2: 0.9}) == 0
  assert auto_gamma.choose_measured({1: 1.2, 2: 1.3, 3: 1.1}) == 2
  decoder = auto_gamma.AutoBeamDecoder(None, None, None)
  decoder.step_seconds, decoder.measured = 0.01, {1: 1.2, 2: 0.8, 3: 0.7}
  assert decoder.choose() == 1
  decoder._realized[1] = [0.4, 0.5, AutoGammaDecoder.REALIZED_BATCHES]  # pylint: disable=protected-access
  assert decoder.speedups()[1] == pytest.approx(0.8) and decoder.choose() == 0
  assert decoder.speedups()[2] == pytest.approx(0.8 * 0.8 / 1.2)  # the others alike


def test_measured_speedups_scale_the_model_at_their_own_alpha():
  costs = BatchCosts(batch_size=2, step_seconds=0.01, call_seconds={3: 0.02},
                     measured_speedup={3: 1.2}, alpha=0.9, lengths=(10, 14, 20))
  assert predicted_speedups(costs, 0.9, [10, 14, 20])[3] == pytest.approx(1.2)
  # A higher running alpha moves the prediction the way the model moves.
  model = auto_gamma.model_speedups(costs, 0.99, [10, 14, 20])[3]
  at_measurement = auto_gamma.model_speedups(costs, 0.9, [10, 14, 20])[3]
  assert predicted_speedups(costs, 0.99, [10, 14, 20])[3] == pytest.approx(
      1.2 * model / at_measurement)
  assert model > at_measurement


def test_calibrations_round_trip_by_key(tmp_path):
  cache = GammaCostCache(tmp_path)
  key = {'machine': {'cpu': 'x'}, 'batch_size': 4}
  costs = BatchCosts(4, 0.01, {1: 0.02, 9: 0.05}, {1: 0.9, 9: 0.7}, 0.95, (3, 4), 0.003)
  cache.save(key, costs, 0.95, [3, 4])
  data = cache.load(key)
  assert BatchCosts.from_json(data['costs']) == costs
  assert data['alpha'] == 0.95 and data['lengths'] == [3, 4]
  assert cache.load({**key, 'batch_size': 8}) is None


def test_speculative_generate_refuses_auto_with_the_way_to_use_it():
  config = get_config('test_tiny_1_1')
  params = init_params(config, jax.random.PRNGKey(0))
  with pytest.raises(ValueError, match='AutoGammaDecoder'):
    speculative_generate(params, params, [[4, 5, 1]], target_config=config,
                         drafter=T5Drafter(config), spec=SpeculativeConfig(gamma='auto'),
                         max_decode_length=4)
  with pytest.raises(ValueError, match="must be an integer, got 'fast' \\(or 'auto'"):
    SpeculativeConfig(gamma='fast')
  with pytest.raises(ValueError, match='AutoBeamDecoder'):
    speculative_beam_generate(params, params, [[4, 5, 1]], target_config=config,
                              draft_config=config, beam=BeamConfig(num_beams=2),
                              spec=SpeculativeBeamConfig(gamma='auto'), max_decode_length=4)


# ----------------------------------------------------------------------------------
# The decoder on tiny models.

TARGET = get_config('test_tiny_1_1')
DRAFT = dataclasses.replace(TARGET, num_decoder_layers=1)
MAX_LEN = 10


@dataclasses.dataclass(frozen=True)
class _SlowDrafter(WrappedDrafter):
  """A T5 drafter made artificially slow: each proposal also runs `work` dependent
  matrix products, whose result is added to q times 0 (so they cannot be skipped)."""
  inner: T5Drafter
  work: int = 40

  def propose(self, params, state, context, gamma, sampling, keys):
    x = jnp.full((256, 256), 1e-3, jnp.float32) + context.length[0].astype(jnp.float32)
    x = jax.lax.fori_loop(0, self.work, lambda _, y: jnp.tanh(y @ y), x)
    tokens, probs, state = self.inner.propose(params, state, context, gamma, sampling, keys)
    return tokens, probs + 0.0 * x[0, 0], state


def _tiny_setup():
  target = init_params(TARGET, jax.random.PRNGKey(0))
  draft = init_params(DRAFT, jax.random.PRNGKey(1))
  tokens = np.random.default_rng(0).integers(2, TARGET.vocab_size, (8, 2, 6)).astype(np.int32)
  tokens[:, :, -1] = 1
  return target, draft, [jnp.asarray(t) for t in tokens]


def _decoder(target, draft, drafter, cache=None, key=None):
  return AutoGammaDecoder(
      lambda batch: generate(target, batch, config=TARGET, max_decode_length=MAX_LEN,
                             sampling=GREEDY),
      lambda batch, spec: speculative_generate(
          target, draft, batch, target_config=TARGET, drafter=drafter, spec=spec,
          max_decode_length=MAX_LEN, sampling=GREEDY),
      SpeculativeConfig(gamma='auto', verify_lengths=(3,)), batch_size=2, gammas=(1, 3),
      cache=cache, key=key)


def test_a_draft_that_cannot_pay_falls_back_to_the_baseline(tmp_path):
  target, draft, batches = _tiny_setup()
  decoder = _decoder(target, draft, _SlowDrafter(T5Drafter(DRAFT)),
                     GammaCostCache(tmp_path), {'test': 'slow'})
  decoder.calibrate(batches[:3])
  assert all(s < 0.5 for s in decoder.costs.measured_speedup.values()), decoder.costs
  assert decoder.choose() == 0
  for batch in batches[3:]:
    output = decoder(batch)
    baseline = generate(target, batch, config=TARGET, max_decode_length=MAX_LEN,
                        sampling=GREEDY)
    np.testing.assert_array_equal(output.output.tokens, baseline.tokens)
    assert output.stats.accepted_per_position.shape == (0,)  # gamma 0: no drafts
  assert decoder.gamma_counts == {0: len(batches) - 3}
  # The calibration is on disk: a new decoder of the same key starts from it.
  again = _decoder(target, draft, _SlowDrafter(T5Drafter(DRAFT)), GammaCostCache(tmp_path),
                   {'test': 'slow'})
  assert again.load_calibration() and again.costs == decoder.costs and again.choose() == 0


@pytest.mark.parametrize('gamma', [0, 1, 3])
def test_outputs_never_depend_on_the_chosen_gamma(gamma):
  target, draft, batches = _tiny_setup()
  decoder = _decoder(target, draft, T5Drafter(DRAFT))
  # A cost table under which `gamma` is the one choice.
  iteration = {g: (0.001 if g == gamma else 1.0) for g in (1, 3)}
  decoder.costs = BatchCosts(2, 0.01 if gamma else 0.0001, iteration)
  decoder.lengths = [MAX_LEN]
  for batch in batches:
    output = decoder(batch)
    baseline = generate(target, batch, config=TARGET, max_decode_length=MAX_LEN,
                        sampling=GREEDY)
    np.testing.assert_array_equal(output.output.tokens, baseline.tokens)
    assert output.stats.accepted_per_position.shape == (gamma,)
  assert decoder.gamma_counts == {gamma: len(batches)}


# ----------------------------------------------------------------------------------
# The launcher.


def test_launcher_with_auto_gamma_records_its_choices(tmp_path, tiny_pair_checkpoints):
  import shutil  # pylint: disable=g-import-not-at-top
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, tmp_path / name)
  from test_scripts import _infer_config  # pylint: disable=g-import-not-at-top
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(_infer_config(tmp_path))
  gin_flags.parse([f'--gin_file={path}', "--gin.GAMMA='auto'", '--gin.infer.auto_gammas=(1, 2)',
                   f"--gin.infer.calibration_dir='{tmp_path / 'calibration'}'",
                   '--gin.infer.num_examples=6'])
  summary = infer_script.infer()
  assert summary['gamma'] == 'auto' and summary['identical_outputs'] == 6
  records = [json.loads(line) for line in open(tmp_path / 'out' / 'speculative.jsonl')]
  chosen = {r['gamma'] for r in records}
  assert chosen <= {0, 1, 2}
  assert summary['gamma_choices'] == ' '.join(
      f'{g}:{sum(1 for r in records[::2] if r["gamma"] == g)}' for g in sorted(chosen))
  assert len(list((tmp_path / 'calibration').glob('*.json'))) == 1
  # A retrained draft (other weights, same config) agrees otherwise: its own calibration.
  from jaxspec.checkpoints import t5x as t5x_checkpoints  # pylint: disable=g-import-not-at-top
  retrained = jax.tree_util.tree_map(lambda x: np.asarray(x) * 0.5,
                                     t5x_checkpoints.load_t5x_checkpoint(tmp_path / 'draft'))
  t5x_checkpoints.save_t5x_checkpoint(tmp_path / 'retrained', retrained, 7)
  gin.clear_config()
  gin_flags.parse([f'--gin_file={path}', "--gin.GAMMA='auto'", '--gin.infer.auto_gammas=(1, 2)',
                   f"--gin.infer.calibration_dir='{tmp_path / 'calibration'}'",
                   f"--gin.infer.draft_checkpoint='{tmp_path / 'retrained'}'",
                   f"--gin.infer.output_dir='{tmp_path / 'retrained_out'}'",
                   '--gin.infer.num_examples=2'])
  assert infer_script.infer()['identical_outputs'] == 2
  assert len(list((tmp_path / 'calibration').glob('*.json'))) == 2
  gin.clear_config()
  gin_flags.parse([f'--gin_file={path}', "--gin.GAMMA='auto'", '--gin.infer.auto_gammas=(0,)'])
  with pytest.raises(ValueError, match='infer.auto_gammas'):
    infer_script.infer()


class _CountingDecoder(auto_gamma._ChoosingDecoder):
  """Decoders that only count their calls (gamma 0 and gamma 1)."""

  def __init__(self):
    super().__init__((1,), auto_gamma.MIN_SPEEDUP)
    self.calls = 0

  def _decoder(self, gamma):
    def decode(batch):
      self.calls += 1
      return jnp.zeros(())
    return decode


@pytest.mark.parametrize('budget_seconds,rounds', [(0.0, 2), (1e9, 5)])
def test_calibration_runs_its_least_rounds_and_more_while_they_fit_the_budget(
    budget_seconds, rounds):
  decoder = _CountingDecoder()
  batches = [jnp.zeros((1,)), jnp.ones((1,))]
  fastest, outputs = decoder._time_candidates(batches, (2, 5), budget_seconds)
  compile_calls = 2  # each candidate once per batch shape (both batches share one)
  assert decoder.calls == compile_calls + rounds * 2 * len(batches)
  assert set(fastest) == {0, 1} and all(len(o) == len(batches) for o in outputs.values())


class _CompilingDecoder(auto_gamma._ChoosingDecoder):
  """gamma 1 always; a first call on a batch shape takes 0.3 s (it compiles), later ones
  nothing; 10 plain steps a batch at 10 ms each."""

  def __init__(self):
    super().__init__((1,), auto_gamma.MIN_SPEEDUP)
    self.compiled = set()

  def _decoder(self, gamma):
    def decode(batch):
      if (gamma, batch.shape) not in self.compiled:
        self.compiled.add((gamma, batch.shape))
        time.sleep(0.3)
      return jnp.zeros(())
    return decode

  def _work(self, output):
    return 10

  def _calibrated_step_seconds(self):
    return 0.01

  def choose(self):
    return 1


def test_a_call_on_new_shapes_compiles_before_its_clock_starts():
  """A caller's warm-up call (the launcher's first batch of each shape) never times a
  compile into the speedup the run realized."""
  decoder = _CompilingDecoder()
  for batch in (jnp.zeros((1,)), jnp.zeros((2,)), jnp.zeros((1,)), jnp.zeros((2,))):
    decoder(batch)
  # Four batches of 0.1 s of plain steps each, decoded in far under 0.3 s all together.
  assert decoder.realized_speedups()[1] > 4 * 0.1 / 0.3


def test_calibration_batches_spread_over_the_run():
  """A task's first examples are not its typical ones: the calibration samples the pending
  batches from the first to the last, evenly."""
  pending = [[i] for i in range(10)]
  assert infer_script.calibration_sample(pending, 4) == [[0], [3], [6], [9]]
  assert infer_script.calibration_sample(pending, 12) == pending
  assert infer_script.calibration_sample(pending[:3], 3) == pending[:3]
  assert infer_script.calibration_batch_count(4) == 12 and infer_script.calibration_batch_count(32) == 3


# ----------------------------------------------------------------------------------
# On an accelerator: asynchronous dispatch, compiles, the device in the key.


class _DeviceClock:
  """Simulated seconds: a call's compile moves it at once (the host waits for XLA); a
  decode's device work only when the caller waits for the result."""

  def __init__(self):
    self.now = 0.0

  def __call__(self):
    return self.now


class _DeviceWork:
  """A result still being computed on the device: jax.block_until_ready (which calls
  this leaf's block_until_ready) moves the clock on by its seconds, once."""

  def __init__(self, clock, seconds):
    self.clock, self.seconds = clock, seconds

  def block_until_ready(self):
    self.clock.now += self.seconds
    self.seconds = 0.0
    return self


class _SimulatedDevice:
  """The baseline and speculative decoders of a device where a batch takes
  batch_seconds once (its encoder), a baseline step step_seconds, and an iteration with
  gamma g call_seconds(g) plus draft_seconds a draft step, every draft accepted (alpha 1):
  each iteration of a batch drafts while any row's proposal goes on (min(g, tokens
  left): the loop's EOS-ended proposals). A batch is rows of `lengths[batch[0, 0]]`
  output tokens; the first call on a (gamma, shape) compiles for compile_seconds."""

  def __init__(self, step_seconds, call_seconds, draft_seconds, lengths,
               compile_seconds=100.0, batch_seconds=0.0):
    self.clock = _DeviceClock()
    self.batch_seconds = batch_seconds
    self.step_seconds, self.call_seconds = step_seconds, call_seconds
    self.draft_seconds = draft_seconds
    self.lengths = [np.asarray(rows, np.int32) for rows in lengths]
    self.compile_seconds = compile_seconds
    self.compiled = set()

  def _dispatch(self, gamma, batch, device_seconds):
    if (gamma, batch.shape) not in self.compiled:
      self.compiled.add((gamma, batch.shape))
      self.clock.now += self.compile_seconds
    return _DeviceWork(self.clock, device_seconds)

  def _output(self, work, lengths):
    rows = len(lengths)
    return auto_gamma.DecodeOutput(
        tokens=np.ones((rows, 64), np.int32), token_log_probs=np.zeros((rows, 64), np.float32),
        log_prob=work, lengths=lengths, nonfinite_logits=np.zeros((rows,), bool))

  def baseline(self, batch):
    lengths = self.lengths[int(batch[0, 0])]
    steps = int(lengths.max())
    return self._output(self._dispatch(0, batch, self.batch_seconds + steps * self.step_seconds),
                        lengths)

  def speculative(self, batch, spec):
    lengths = self.lengths[int(batch[0, 0])]
    left, iterations = lengths.copy(), np.zeros_like(lengths)
    calls = draft_steps = drafted = 0
    while np.any(left > 0):
      proposals = np.minimum(spec.gamma, left)  # [b]: 0 for rows done
      calls, draft_steps = calls + 1, draft_steps + int(proposals.max())
      drafted += int(proposals.sum())
      iterations += left > 0
      left = np.maximum(left - (spec.gamma + 1), 0)
    seconds = (self.batch_seconds + calls * self.call_seconds(spec.gamma)
               + draft_steps * self.draft_seconds)
    work = self._dispatch(spec.gamma, batch, seconds)
    stats = auto_gamma.SpeculativeStats(
        target_calls=np.int32(calls), draft_calls=np.int32(draft_steps),
        row_target_calls=iterations.astype(np.int32),
        accepted_per_position=np.zeros((spec.gamma,), np.int32),
        num_accepted_counts=np.zeros((spec.gamma + 1,), np.int32),
        overlap_sum=np.float32(drafted), verified_positions=np.int32(drafted),
        num_drafted_counts=np.zeros((spec.gamma + 1,), np.int32),
        target_positions=np.int32(calls * (spec.gamma + 1)))
    return auto_gamma.SpeculativeOutput(output=self._output(work, lengths), stats=stats)


def _batch(index, rows=2):
  return np.full((rows, 5), index, np.int32)


@pytest.mark.parametrize('draft_cost, expected', [(1.2, 0), (0.05, 3)])
def test_on_a_simulated_device_calibration_times_the_device_work_and_no_compile(
    draft_cost, expected):
  """Asynchronous dispatch: a call returns before its work is done, so a timing that did
  not wait would see no time at all; compiles (100 s each) would swamp 20 ms decodes.
  The costs measured are the device's, exactly (a call's and a draft step's, told apart
  by outputs whose proposals end early at their EOS), and the choice follows them: the
  baseline where a draft step costs more than a target step (a launch-bound draft on a
  GPU), gamma 3 where it costs 0.05 of one."""
  device = _SimulatedDevice(step_seconds=1e-3, call_seconds=lambda g: 1e-3 * (1.0 + 0.02 * g),
                            draft_seconds=1e-3 * draft_cost, lengths=[[12, 18], [5, 9]],
                            batch_seconds=2e-3)
  decoder = AutoGammaDecoder(device.baseline, device.speculative, SpeculativeConfig(gamma=3),
                             batch_size=2, gammas=(1, 3), clock=device.clock)
  batches = [_batch(0), _batch(1)]
  decoder.calibrate(batches, rounds=(2, 2))
  assert decoder.costs.step_seconds == pytest.approx(1e-3)
  assert decoder.costs.batch_seconds == pytest.approx(2e-3)
  for gamma in (1, 3):
    assert decoder.costs.call_seconds[gamma] == pytest.approx(1e-3 * (1.0 + 0.02 * gamma))
  assert decoder.costs.draft_seconds == pytest.approx(1e-3 * draft_cost)
  assert decoder.alpha == pytest.approx(1.0)
  for batch in batches * 3:
    before = device.clock.now
    decoder.ready(batch)
    decoder(batch)
    assert device.clock.now - before < 1.0  # nothing compiles once calibrated
  assert decoder.gamma_counts == {expected: 6}


def test_a_batch_on_the_baseline_reads_nothing_back_until_a_decision(monkeypatch):
  """On a GPU each read of a result back to the host waits on the device: three reads a
  batch cost the shipped pair on an H200 a fifth of its baseline's time with gamma='auto'
  on the baseline throughout. A baseline batch now leaves its output on the device; what
  the decoder keeps of it (its steps, its lengths) is read in one go when a decision or a
  caller needs it, and is the same as read batch by batch."""
  lengths = [[12, 18], [5, 9], [30, 2]]
  device = _SimulatedDevice(step_seconds=1e-3, call_seconds=lambda g: 1e-3 * (1.0 + 0.02 * g),
                            draft_seconds=1.2e-3, lengths=lengths, batch_seconds=2e-3)
  decoder = AutoGammaDecoder(device.baseline, device.speculative, SpeculativeConfig(gamma=3),
                             batch_size=2, gammas=(1, 3), clock=device.clock,
                             refresh_batches=4)
  batches = [_batch(i) for i in range(3)]
  decoder.calibrate(batches[:2], rounds=(2, 2))
  calibrated = list(decoder.lengths)
  reads = []
  real_device_get, real_host_array = jax.device_get, auto_gamma.host_array
  monkeypatch.setattr(jax, 'device_get', lambda x: reads.append('device_get') or
                      real_device_get(x))
  monkeypatch.setattr(auto_gamma, 'host_array', lambda x: reads.append('host_array') or
                      real_host_array(x))
  reads_per_call = []
  for index in range(10):
    before = len(reads)
    output = decoder(batches[index % 3])
    reads_per_call.append(len(reads) - before)
    stats = jax.device_get(output.stats)  # made on the device; read here, after the call
    assert int(stats.target_calls) == max(lengths[index % 3])
    assert int(stats.target_positions) == 2 * max(lengths[index % 3])
    np.testing.assert_array_equal(stats.row_target_calls, lengths[index % 3])
    assert int(stats.draft_calls) == 0 and stats.accepted_per_position.shape == (0,)
  assert decoder.gamma_counts == {0: 10}
  # The decisions (the first call, then every refresh_batches) read; no other call does.
  assert reads_per_call == [0, 0, 0, 0, 1, 0, 0, 0, 1, 0], reads_per_call
  decoded = [n for index in range(10) for n in lengths[index % 3]]
  assert sorted(decoder.lengths) == sorted(calibrated + decoded)
  # A decoder that never decides (plain beam search throughout) still reads them, in
  # groups of UNREAD_PLAIN: what it holds on the device is bounded.
  decoder.refresh_batches = 10**6
  reads.clear()
  for index in range(decoder.UNREAD_PLAIN):
    decoder(batches[0])
    assert len(decoder._unread_plain) < decoder.UNREAD_PLAIN  # pylint: disable=protected-access
  assert reads == ['device_get']
  decoded += lengths[0] * decoder.UNREAD_PLAIN
  plain_steps = sum(max(lengths[index % 3]) for index in range(10))
  plain_steps += max(lengths[0]) * decoder.UNREAD_PLAIN
  assert decoder._plain_steps == plain_steps  # pylint: disable=protected-access
  assert decoder.plain_step_seconds() == pytest.approx(
      1e-3 + 2e-3 * (10 + decoder.UNREAD_PLAIN) / plain_steps)
  assert sorted(decoder.lengths) == sorted(calibrated + decoded)


def test_short_outputs_after_a_calibration_on_long_ones_keep_the_long_proposals():
  """The main job's case: gammas 9 and 19 calibrated on sentences of 20-40 tokens, where
  19 takes half of 9's target calls; then the run opens with a hundred strings of 3-4
  tokens (one call and 3-4 drafts whatever the gamma) and goes on to sentences. 19 stays
  throughout: the short strings cost it what they cost 9. A price a call alone (each
  gamma's seconds over its calls, drafts and all) would charge a 4-token output a
  19-draft call and move the run to 9 on those strings."""
  sentences = [[n] for n in range(20, 41, 4)]
  strings = [[3], [4]]
  device = _SimulatedDevice(step_seconds=1e-3, call_seconds=lambda g: 1.5e-3 + 1e-5 * g,
                            draft_seconds=0.1e-3, lengths=sentences + strings,
                            batch_seconds=1e-3)
  decoder = AutoGammaDecoder(device.baseline, device.speculative,
                             SpeculativeConfig(gamma='auto'), batch_size=1, gammas=(9, 19),
                             refresh_batches=8, clock=device.clock)
  decoder.calibrate([_batch(i, rows=1) for i in range(len(sentences))], rounds=(2, 2))
  assert decoder.costs.draft_seconds == pytest.approx(0.1e-3)
  assert decoder.costs.batch_seconds == pytest.approx(1e-3)
  run = ([_batch(len(sentences) + i % 2, rows=1) for i in range(100)]
         + [_batch(i % len(sentences), rows=1) for i in range(60)])
  for batch in run:
    decoder.ready(batch)
    decoder(batch)
  assert decoder.gamma_counts == {19: len(run)}
  # The same run under a price a call alone: each gamma's calibration seconds over its
  # calls. With the calibration's lengths and 60 of the strings seen, it leaves 19 for 9.
  def mean_call(gamma):
    work = [_work(device, gamma, rows) for rows in sentences]
    return sum(decoder.costs.seconds(gamma, c, d) for c, d in work) / sum(c for c, _ in work)
  by_call = BatchCosts(1, decoder.costs.baseline_seconds(30) / 30,
                       {g: mean_call(g) for g in (9, 19)})
  seen = decoder.lengths[:len(sentences) + 60]
  assert choose_gamma(by_call, 1.0, seen, current=19) == 9
  assert choose_gamma(decoder.costs, 1.0, seen, current=19) == 19


def _work(device, gamma, rows):
  """(target calls, draft steps) of the simulated device's decode of one batch."""
  index = next(i for i, r in enumerate(device.lengths) if list(r) == list(rows))
  stats = device.speculative(_batch(index, rows=len(rows)),
                             SpeculativeConfig(gamma=gamma)).stats
  return int(stats.target_calls), int(stats.draft_calls)


class _FakeDevice:
  platform = 'gpu'

  def __init__(self, device_kind):
    self.device_kind = device_kind


def test_calibrations_are_keyed_by_the_device_and_the_dtype(monkeypatch, tmp_path):
  keys = {}
  for kind in ('NVIDIA H200', 'NVIDIA H100 80GB HBM3'):
    monkeypatch.setattr(jax, 'devices', lambda *args, kind=kind: [_FakeDevice(kind)])
    monkeypatch.setattr(jax, 'default_backend', lambda: 'gpu')
    for dtype in ('bfloat16', 'float32'):
      config = get_config('test_tiny_1_1', dtype=dtype, param_dtype=dtype)
      keys[kind, dtype] = infer_script.calibration_key(
          config, T5Drafter(get_config('test_tiny_1_0')), GREEDY,
          SpeculativeConfig(gamma='auto'), input_length=8, max_decode_length=16)
  assert keys['NVIDIA H200', 'bfloat16']['machine']['device'] == 'NVIDIA H200'
  assert keys['NVIDIA H200', 'bfloat16']['machine']['platform'] == 'gpu'
  assert 'cpu' not in keys['NVIDIA H200', 'bfloat16']['machine']  # no host CPU on a GPU
  cache = GammaCostCache(tmp_path)
  paths = {cache.path(key) for key in keys.values()}
  assert len(paths) == 4  # each device and dtype has its own calibration
