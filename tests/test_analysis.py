"""jaxspec.measure.analysis against the numbers printed in Leviathan et al. 2023."""

import numpy as np
import pytest

from jaxspec.measure import analysis

# Table 1: (alpha, gamma, operations, speed), with c = c_hat = 0.
TABLE_1 = [
    (0.6, 2, 1.53, 1.96),
    (0.7, 3, 1.58, 2.53),
    (0.8, 2, 1.23, 2.44),
    (0.8, 5, 1.63, 3.69),
    (0.9, 2, 1.11, 2.71),
    (0.9, 10, 1.60, 6.86),
]


@pytest.mark.parametrize('alpha, gamma, operations, speed', TABLE_1)
def test_table_1(alpha, gamma, operations, speed):
  np.testing.assert_allclose(analysis.expected_speedup(alpha, gamma, 0.0), speed, atol=0.005)
  np.testing.assert_allclose(
      analysis.expected_operations_factor(alpha, gamma, 0.0), operations, atol=0.005)


@pytest.mark.parametrize('alpha, speed', [(0.75, 3.3), (0.8, 3.9), (0.87, 4.9)])
def test_appendix_a5_argmax_lenience_speedups(alpha, speed):
  # A.5: "c=0.015 and gamma=8 ... speed improvement factors of 3.3X, 3.3X, 3.9X, 4.9X".
  np.testing.assert_allclose(analysis.expected_speedup(alpha, 8, 0.015), speed, atol=0.05)


def test_section_3_6_bigram_speedup():
  # "alpha ~ 0.2 which leads to an inference speed improvement factor of 1.25X with gamma=3".
  np.testing.assert_allclose(analysis.expected_speedup(0.2, 3, 0.0), 1.25, atol=0.005)


@pytest.mark.parametrize('alpha', [0.0, 0.1, 0.5, 0.9, 0.999])
@pytest.mark.parametrize('gamma', [1, 2, 7])
def test_equation_1_closed_form(alpha, gamma):
  expected = (1 - alpha ** (gamma + 1)) / (1 - alpha)
  np.testing.assert_allclose(analysis.expected_tokens_per_iteration(alpha, gamma), expected)


def test_equation_1_limits():
  assert analysis.expected_tokens_per_iteration(1.0, 5) == 6.0  # Every draft accepted.
  assert analysis.expected_tokens_per_iteration(0.0, 5) == 1.0  # Only the corrected token.
  assert analysis.expected_tokens_per_iteration(0.7, 0) == 1.0  # Plain decoding.
  np.testing.assert_allclose(
      analysis.expected_tokens_per_iteration(np.array([0.0, 0.5, 1.0]), 2), [1.0, 1.75, 3.0])


def test_equation_1_is_mean_of_capped_geometric():
  # Tokens = 1 + number of leading accepts among gamma i.i.d. Bernoulli(alpha) draws.
  alpha, gamma = 0.65, 4
  probs = [alpha ** n * (1 - alpha) for n in range(gamma)] + [alpha ** gamma]
  mean = sum((n + 1) * prob for n, prob in enumerate(probs))
  np.testing.assert_allclose(analysis.expected_tokens_per_iteration(alpha, gamma), mean)


@pytest.mark.parametrize('alpha, c', [(0.3, 0.0), (0.6, 0.05), (0.9, 0.2), (1.0, 0.5)])
def test_corollary_3_9_gamma_one(alpha, c):
  np.testing.assert_allclose(analysis.expected_speedup(alpha, 1, c), (1 + alpha) / (1 + c))


def test_theorem_3_8_and_3_11_with_costs():
  alpha, gamma, c, c_hat = 0.7, 4, 0.05, 0.02
  tokens = (1 - alpha ** 5) / (1 - alpha)
  np.testing.assert_allclose(analysis.expected_speedup(alpha, gamma, c), tokens / (gamma * c + 1))
  np.testing.assert_allclose(
      analysis.expected_operations_factor(alpha, gamma, c_hat),
      (1 - alpha) * (gamma * c_hat + gamma + 1) / (1 - alpha ** 5))


@pytest.mark.parametrize('alpha, c', [(0.5, 0.02), (0.75, 0.02), (0.9, 0.05), (0.62, 0.015)])
def test_optimal_gamma_is_integer_argmax(alpha, c):
  gamma = analysis.optimal_gamma(alpha, c, max_gamma=40)
  speedups = [analysis.expected_speedup(alpha, g, c) for g in range(1, 41)]
  assert gamma == 1 + int(np.argmax(speedups))
  assert 1 < gamma < 40  # An interior optimum for these (alpha, c).


def test_optimal_gamma_edges():
  assert analysis.optimal_gamma(0.8, 0.0, max_gamma=12) == 12  # Free drafts: more is better.
  assert analysis.optimal_gamma(0.1, 0.5, max_gamma=12) == 1  # alpha < c: no gamma helps.
  assert analysis.optimal_gamma(0.9, 0.01) > analysis.optimal_gamma(0.6, 0.01)


def test_alpha_from_distributions():
  p = np.array([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]])
  q = np.array([[0.2, 0.5, 0.3], [0.0, 1.0, 0.0]])
  # beta = sum_x min(p, q): 0.2 + 0.3 + 0.2 = 0.7 and 0 (disjoint supports).
  np.testing.assert_allclose(analysis.acceptance_rate(p, q), [0.7, 0.0])
  np.testing.assert_allclose(analysis.alpha_from_distributions(p, q), 0.35)
  np.testing.assert_allclose(analysis.alpha_from_distributions(p, q, mask=[True, False]), 0.7)
  np.testing.assert_allclose(analysis.alpha_from_distributions(p, p), 1.0)
  # Lemma 3.3: beta = 1 - D_LK.
  np.testing.assert_allclose(analysis.acceptance_rate(p, q), 1 - analysis.lk_divergence(p, q))


def test_alpha_with_lenience_matches_appendix_a5_expectation():
  rng = np.random.default_rng(0)
  p, q = rng.dirichlet(np.ones(6), size=4), rng.dirichlet(np.ones(6), size=4)
  for lenience in [1.0, 0.5, 0.1]:
    # E_{x~q} p(x) / max(p(x), l q(x)), the other form A.5 gives.
    expected = (q * p / np.maximum(p, lenience * q)).sum(-1)
    np.testing.assert_allclose(analysis.acceptance_rate(p, q, lenience), expected)
  # Lenience can only raise alpha, and l -> 0 accepts everything.
  assert (analysis.alpha_from_distributions(p, q, 0.5)
          >= analysis.alpha_from_distributions(p, q, 1.0))
  np.testing.assert_allclose(analysis.alpha_from_distributions(p, q, 1e-9), 1.0)


@pytest.mark.parametrize('call', [
    lambda: analysis.expected_tokens_per_iteration(1.5, 2),
    lambda: analysis.expected_tokens_per_iteration(0.5, -1),
    lambda: analysis.expected_tokens_per_iteration(0.5, 2.5),
    lambda: analysis.optimal_gamma(0.5, 0.1, max_gamma=0),
    lambda: analysis.acceptance_rate(np.ones(2) / 2, np.ones(2) / 2, lenience=0.0),
])
def test_invalid_arguments(call):
  with pytest.raises(ValueError):
    call()
