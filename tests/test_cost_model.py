"""jaxspec/measure/cost_model.py and scripts/cost_model.py: the fits recover known costs, the
expected calls and drafts match closed forms, a Monte Carlo run of the loop's rules and
Eq. (1) of the paper, and the required alpha is the least that reaches the speedup."""

import json
import math
import os

import numpy as np
import pytest

from jaxspec import errors
from jaxspec.measure import analysis, cost_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import cost_model as cost_model_script

BASELINE = cost_model.BaselineCosts(fixed_ms=11.5, per_token_ms=4.7)
SPECULATIVE = cost_model.SpeculativeCosts(fixed_ms=3.0, per_call_ms=13.0, per_draft_ms=1.35)


def test_fits_recover_the_costs_that_made_the_times():
  rng = np.random.default_rng(0)
  lengths = rng.integers(2, 40, size=50)
  calls = rng.integers(1, 6, size=50)
  drafts = calls * 4 + rng.integers(0, 4, size=50)
  baseline = cost_model.fit_baseline_costs(lengths, BASELINE.example_ms(lengths))
  speculative = cost_model.fit_speculative_costs(
      calls, drafts, SPECULATIVE.example_ms(calls, drafts))
  np.testing.assert_allclose([baseline.fixed_ms, baseline.per_token_ms], [11.5, 4.7])
  np.testing.assert_allclose(
      [speculative.fixed_ms, speculative.per_call_ms, speculative.per_draft_ms],
      [3.0, 13.0, 1.35])


def test_fit_refuses_counts_that_cannot_separate_the_costs():
  with pytest.raises(ValueError, match='must differ in each count'):
    cost_model.fit_speculative_costs([2, 2, 2, 2], [8, 8, 8, 8], [30.0, 31.0, 29.0, 30.0])
  with pytest.raises(ValueError, match='cannot fit'):
    cost_model.fit_baseline_costs([3], [20.0])


@pytest.mark.parametrize('gamma', [1, 3, 9])
def test_every_draft_accepted_takes_ceil_n_over_gamma_plus_one_calls(gamma):
  calls, drafts = cost_model.expected_calls_and_drafts(1.0, gamma, 40)
  for n in range(41):
    expected_calls, expected_drafts, left = 0, 0, n
    while left:  # All accepted: gamma drafts and the target's token, or the last `left`.
      expected_calls += 1
      expected_drafts += min(gamma, left)
      left -= min(gamma + 1, left)
    assert calls[n] == expected_calls == math.ceil(n / (gamma + 1))
    assert drafts[n] == expected_drafts


def test_no_draft_accepted_commits_one_token_a_call():
  calls, drafts = cost_model.expected_calls_and_drafts(0.0, 4, 20)
  np.testing.assert_array_equal(calls, np.arange(21))
  np.testing.assert_array_equal(drafts, [sum(min(4, r) for r in range(1, n + 1))
                                         for n in range(21)])


@pytest.mark.parametrize('alpha,gamma', [(0.6, 3), (0.9, 8)])
def test_long_outputs_commit_eq1_tokens_a_call(alpha, gamma):
  calls, _ = cost_model.expected_calls_and_drafts(alpha, gamma, 4000)
  tokens_per_call = analysis.expected_tokens_per_iteration(alpha, gamma)
  np.testing.assert_allclose(4000 / calls[4000], tokens_per_call, rtol=2e-3)


def test_expectations_match_a_simulation_of_the_loop():
  alpha, gamma, n, runs = 0.7, 4, 13, 40000
  rng = np.random.default_rng(1)
  calls = np.zeros(runs)
  drafts = np.zeros(runs)
  for run in range(runs):
    left = n
    while left:
      proposed = min(gamma, left)
      accepted = 0
      while accepted < proposed and rng.random() < alpha:
        accepted += 1
      calls[run] += 1
      drafts[run] += proposed
      left -= min(accepted + 1, left)
  expected_calls, expected_drafts = cost_model.expected_calls_and_drafts(alpha, gamma, n)
  for simulated, expected in ((calls, expected_calls[n]), (drafts, expected_drafts[n])):
    standard_error = simulated.std() / np.sqrt(runs)
    assert abs(simulated.mean() - expected) < 4 * standard_error


def test_expected_speedup_is_the_ratio_of_mean_example_times():
  lengths = np.array([5, 12, 30])
  # alpha = 1, gamma 9: 1, 2 and 3 calls; 5, 10 + 2 and 27 drafts.
  speculative_ms = SPECULATIVE.example_ms([1, 2, 3], [5, 11, 27]).mean()
  expected = BASELINE.example_ms(lengths).mean() / speculative_ms
  got = cost_model.expected_speedup(1.0, 9, lengths, BASELINE, SPECULATIVE)
  np.testing.assert_allclose(got, expected)


def test_required_alpha_is_the_least_that_reaches_the_speedup():
  lengths = np.arange(4, 25)
  alpha = cost_model.required_alpha(1.5, 8, lengths, BASELINE, SPECULATIVE, tolerance=1e-5)
  assert 0.0 < alpha < 1.0
  assert cost_model.expected_speedup(alpha, 8, lengths, BASELINE, SPECULATIVE) >= 1.5
  assert cost_model.expected_speedup(alpha - 2e-5, 8, lengths, BASELINE, SPECULATIVE) < 1.5
  assert cost_model.required_alpha(5.0, 8, lengths, BASELINE, SPECULATIVE) is None
  assert cost_model.required_alpha(0.1, 8, lengths, BASELINE, SPECULATIVE) == 0.0


def test_bad_inputs_are_refused():
  with pytest.raises(ValueError, match='alpha'):
    cost_model.expected_calls_and_drafts(1.5, 4, 10)
  with pytest.raises(ValueError, match='gamma'):
    cost_model.expected_calls_and_drafts(0.5, 0, 10)
  with pytest.raises(ValueError, match='lengths'):
    cost_model.expected_speedup(0.5, 4, [], BASELINE, SPECULATIVE)


def _write_run(run_dir, lengths, calls, drafts, alpha=0.9, gamma=4, chosen=None):
  """A run's records; with gamma='auto', chosen[i] is the gamma example i took."""
  os.makedirs(run_dir, exist_ok=True)
  chosen = [gamma] * len(lengths) if chosen is None else chosen
  with open(os.path.join(run_dir, 'baseline.jsonl'), 'w') as f:
    for i, n in enumerate(lengths):
      f.write(json.dumps({'index': i, 'batch_start': i, 'tokens': [7] * (n - 1) + [1],
                          'batch_seconds': BASELINE.example_ms(n) / 1e3}) + '\n')
  with open(os.path.join(run_dir, 'speculative.jsonl'), 'w') as f:
    for i, (c, d) in enumerate(zip(calls, drafts)):
      f.write(json.dumps({'index': i, 'batch_start': i, 'target_calls': int(c),
                          'gamma': chosen[i], 'batch_verified_positions': int(d),
                          'batch_seconds': SPECULATIVE.example_ms(c, d) / 1e3}) + '\n')
  with open(os.path.join(run_dir, 'summary.json'), 'w') as f:
    json.dump({'task': 'ende', 'draft': 'test draft', 'temperature': 0.0, 'gamma': gamma,
               'alpha': alpha, 'speedup': 1.2, 'examples': len(lengths)}, f)


def test_script_fits_a_run_and_writes_the_table(tmp_path, capsys):
  rng = np.random.default_rng(2)
  lengths = rng.integers(3, 30, size=40)
  calls = rng.integers(1, 5, size=40)
  drafts = calls * 3 + rng.integers(0, 3, size=40)
  run_dir = str(tmp_path / 'run')
  _write_run(run_dir, lengths, calls, drafts)
  cost_model_script.main([f'--run_dir={run_dir}', '--speedup=1.5', '--gammas=4,8',
                          '--draft_costs=1,0.5', '--call_costs=1,0.5'])
  result = json.load(open(os.path.join(run_dir, 'cost_model.json')))
  np.testing.assert_allclose(result['speculative_costs']['per_call_ms'], 13.0)
  np.testing.assert_allclose(result['baseline_costs']['per_token_ms'], 4.7)
  np.testing.assert_allclose(
      result['modelled_speedup_at_run'],
      cost_model.expected_speedup(0.9, 4, lengths, BASELINE, SPECULATIVE), rtol=1e-9)
  assert len(result['drafts']) == 4
  cheapest = result['drafts'][-1]
  assert (cheapest['draft_cost_fraction'], cheapest['call_cost_fraction']) == (0.5, 0.5)
  cheap = cost_model.SpeculativeCosts(3.0, 6.5, 0.675)
  assert cheapest['required_alpha']['8'] == cost_model.required_alpha(
      1.5, 8, lengths, BASELINE, cheap)
  assert 'Least alpha for 1.5x' in capsys.readouterr().out
  table = [line for line in open(os.path.join(run_dir, 'cost_model.md')) if ' ms (' in line]
  assert len(table) == 4


def test_an_auto_gamma_run_is_modelled_at_the_gamma_its_examples_took(tmp_path):
  # The main job's config decodes with gamma='auto'; its records say the gamma taken.
  rng = np.random.default_rng(3)
  lengths = rng.integers(3, 30, size=40)
  calls = rng.integers(1, 5, size=40)
  drafts = calls * 8 + rng.integers(0, 3, size=40)
  run_dir = str(tmp_path / 'run')
  _write_run(run_dir, lengths, calls, drafts, gamma='auto', chosen=[9] * 40)
  cost_model_script.main([f'--run_dir={run_dir}', '--gammas=9'])
  result = json.load(open(os.path.join(run_dir, 'cost_model.json')))
  assert (result['run']['gamma'], result['run']['gamma_setting']) == (9, 'auto')
  np.testing.assert_allclose(
      result['modelled_speedup_at_run'],
      cost_model.expected_speedup(0.9, 9, lengths, BASELINE, SPECULATIVE), rtol=1e-9)
  assert 'gamma 9,' in open(os.path.join(run_dir, 'cost_model.md')).read()


@pytest.mark.parametrize('chosen', [[9] * 39 + [5], [9] * 39 + [0]])
def test_an_auto_gamma_run_of_several_gammas_is_refused_in_one_line(tmp_path, chosen):
  run_dir = str(tmp_path / 'run')
  _write_run(run_dir, [5] * 40, [1] * 40, [4] * 40, gamma='auto', chosen=chosen)
  with pytest.raises(errors.InvalidSetting,
                     match=r"more than one gamma or the baseline .*GAMMA") as error:
    cost_model_script.main([f'--run_dir={run_dir}'])
  assert '\n' not in str(error.value)
  assert not os.path.exists(os.path.join(run_dir, 'cost_model.json'))


def test_script_refuses_a_directory_without_both_decoders(tmp_path):
  with pytest.raises(errors.MissingFile, match='baseline.jsonl not found'):
    cost_model_script.main([f'--run_dir={tmp_path}'])
