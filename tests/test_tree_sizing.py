"""jaxspec.measure.tree_sizing: the expected tokens against an enumeration of a tree's
outcomes, the chosen shape against brute force over a grid of measured costs, and the
two regimes: a flat verify cost makes a tree win, a linear one the chain."""

import itertools

import numpy as np
import pytest

from jaxspec.measure import analysis, tree_sizing


def _enumerated_tokens(alpha, gamma, rates):
  """E[tokens] by the tree's outcomes: no branch right at depth 1 (one token, the
  target's); branch j right (rates[j]), then n more of its drafts accepted before the
  first rejection (or all gamma - 1), each with probability alpha: n + 2 tokens."""
  expected = (1.0 - sum(rates)) * 1.0
  for rate in rates:
    for more in range(gamma):
      stop = alpha ** more * ((1.0 - alpha) if more < gamma - 1 else 1.0)
      expected += rate * stop * (more + 2)
  return expected


@pytest.mark.parametrize('alpha', [0.0, 0.35, 0.8, 1.0])
def test_expected_tokens_enumerate_the_trees_outcomes(alpha):
  for gamma, num_drafts in itertools.product((1, 2, 5), (1, 2, 4)):
    rates = tree_sizing.branch_acceptance_model(alpha, num_drafts)
    assert tree_sizing.expected_tokens(alpha, gamma, num_drafts) == pytest.approx(
        _enumerated_tokens(alpha, gamma, rates))
    measured = [alpha] + [0.1 * (1 - alpha)] * (num_drafts - 1)
    assert tree_sizing.expected_tokens(alpha, gamma, num_drafts, measured) == pytest.approx(
        _enumerated_tokens(alpha, gamma, measured))
  # One branch is Equation 1.
  for gamma in (1, 3, 7):
    assert tree_sizing.expected_tokens(alpha, gamma) == pytest.approx(
        float(analysis.expected_tokens_per_iteration(alpha, gamma)))
  # Independent candidates: one of m is right with probability 1 - (1 - alpha)^m.
  assert sum(tree_sizing.branch_acceptance_model(alpha, 3)) == pytest.approx(
      1 - (1 - alpha) ** 3)


def test_the_interpolated_verify_cost_never_extrapolates():
  costs = {2: 1.0, 4: 1.2, 8: 2.0}
  assert tree_sizing.interpolated_cost(costs, 1) == 1.0
  assert tree_sizing.interpolated_cost(costs, 3) == pytest.approx(1.1)
  assert tree_sizing.interpolated_cost(costs, 6) == pytest.approx(1.6)
  assert tree_sizing.interpolated_cost(costs, 9) is None
  # 2 branches of 3: a step over 7 positions (between V(4) and V(8)) and 3 draft steps.
  assert tree_sizing.iteration_cost(costs, 0.1, 2, 3) == pytest.approx(1.2 + 0.8 * 3 / 4 + 0.3)
  # A drafter's cost given per number of branches: the others are not measured.
  assert tree_sizing.iteration_cost(costs, {1: 0.1}, 2, 3) is None


@pytest.mark.parametrize('seed', range(6))
def test_the_best_shape_is_brute_forces(seed):
  rng = np.random.default_rng(seed)
  widths = sorted(rng.choice(np.arange(2, 25), size=5, replace=False).tolist())
  increments = rng.uniform(0.0, 0.3, size=len(widths))
  costs = dict(zip(widths, 1.0 + np.cumsum(increments)))  # non-decreasing V(k)
  alpha, c = float(rng.uniform(0.3, 0.95)), float(rng.uniform(0.01, 0.3))
  best = None
  for num_drafts, gamma in itertools.product(range(1, 5), range(1, 25)):
    positions = 1 + num_drafts * gamma
    if positions > max(widths):
      continue
    known = {1: 1.0, **costs}
    below = max(k for k in known if k <= positions)
    above = min(k for k in known if k >= positions)
    verify = known[below] if below == above else known[below] + (
        known[above] - known[below]) * (positions - below) / (above - below)
    speedup = _enumerated_tokens(
        alpha, gamma, tree_sizing.branch_acceptance_model(alpha, num_drafts)) / (
            verify + gamma * c)
    if best is None or speedup > best[0] + 1e-12:
      best = (speedup, num_drafts, gamma)
  chosen = tree_sizing.best_shape(costs, c, alpha, max_drafts=4)
  assert (chosen.num_drafts, chosen.gamma) == best[1:]
  assert chosen.speedup == pytest.approx(best[0])
  assert chosen.positions == 1 + chosen.num_drafts * chosen.gamma <= max(widths)


def test_a_flat_verify_cost_makes_a_tree_win_and_a_linear_one_the_chain():
  positions = (2, 4, 6, 8, 9, 16, 32, 64)
  flat = {k: 1.0 for k in positions}  # memory-bound: an XXL step on an H200
  chain, tree = tree_sizing.best_chain_and_tree(flat, 0.02, 0.75)
  assert chain.num_drafts == 1 and tree.num_drafts > 1
  assert tree.speedup > chain.speedup * 1.05
  assert tree.positions <= 64
  linear = {k: float(k) for k in positions}  # compute-bound: every position costs a step
  chain, tree = tree_sizing.best_chain_and_tree(linear, 0.02, 0.75)
  assert tree == chain and chain.num_drafts == 1
  # A measured acceptance vector whose later choices are rarely right keeps the chain.
  chain, tree = tree_sizing.best_chain_and_tree(flat, 0.02, 0.75,
                                                branch_acceptance=[0.75] + [0.0] * 7)
  assert tree == chain
  assert tree_sizing.best_shape({}, 0.02, 0.75) is None  # nothing measured past k = 1


def test_rates_are_checked():
  with pytest.raises(ValueError, match='sum to at most 1'):
    tree_sizing.expected_tokens(0.8, 3, 2, [0.8, 0.5])
  with pytest.raises(ValueError, match='need 3 acceptance rates'):
    tree_sizing.expected_tokens(0.8, 3, 3, [0.8, 0.1])
  with pytest.raises(ValueError, match='alpha must be in'):
    tree_sizing.expected_tokens(1.5, 3)
