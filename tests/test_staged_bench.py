"""jaxspec.launch.staged_bench: the cost model's prediction and the input buckets.

The side-by-side run itself decodes the 54M pair (minutes); its parts are checked here
against hand-computed values."""

import numpy as np
import pytest

from jaxspec.launch import staged_bench

COSTS = {'int8_step_ms': {1: 1.0, 2: 1.2, 3: 1.3, 4: 1.5},
         'proposer_ms': {1: 0.1, 3: 0.3},
         'target_step_ms': {1: 5.0, 10: 6.0}}


def test_predicted_gain_counts_each_part_once():
  # Single stage: 10 iterations, 80 drafter steps: 10 x (6 verify + 1.2 first) + 70 x 1.
  single = {'target_calls': 10, 'drafter_steps': 80}
  # Staged, lookahead 3: 10 first steps and 30 rounds of (0.3 proposal + 1.5 step).
  staged = {'target_calls': 10, 'drafter_steps': 40}
  expected = (10 * 7.2 + 70 * 1.0) / (10 * 7.2 + 30 * 1.8)
  assert staged_bench.predicted_gain(COSTS, single, staged, k=3, gamma=9) == pytest.approx(
      expected)
  # The same counts are no gain: every round costs more than a step.
  assert staged_bench.predicted_gain(COSTS, single, single, k=1, gamma=9) < 1.0


@pytest.mark.parametrize('used, length', [(3, 16), (16, 16), (17, 24), (40, 48), (60, 64)])
def test_bucketed_cuts_to_the_shortest_bucket_that_holds_the_input(used, length):
  tokens = np.zeros((1, 64), np.int32)
  tokens[0, :used] = 5
  assert staged_bench.bucketed(tokens).shape == (1, length)
  assert staged_bench.bucketed(tokens)[0, :used].tolist() == [5] * used
