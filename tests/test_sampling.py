"""jaxspec.sampling against independent numpy references and exact distributions.

Statistical tests use significance SIGNIFICANCE = 1e-3 with fixed seeds, so they are
deterministic; a correct implementation fails a given seed with probability <= 1e-3.
The negative controls at the end show that the same tests reject the distributions
that common bugs (wrong residual, bonus token from the wrong position, wrong accept
test) would produce.
"""

import functools
import itertools
import math

import hypothesis
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import sampling
from jaxspec.decoding.verification import token as token_rule
from jaxspec.sampling import SamplingConfig

SIGNIFICANCE = 1e-3
NORMAL_UPPER = 3.090232306167813  # Phi^-1(1 - SIGNIFICANCE), one-sided.
NORMAL_TWO_SIDED = 3.2905267314918945  # Phi^-1(1 - SIGNIFICANCE / 2).

verdict_jit = jax.jit(token_rule.speculative_verdict, static_argnames='lenience')


# ----------------------------------------------------------------------------
# Independent references and statistics (numpy only).


def softmax(logits):
  """logits [..., v] float64 (may hold -inf) -> probs [..., v]."""
  shifted = logits - np.max(logits, axis=-1, keepdims=True)
  weights = np.exp(shifted)
  return weights / weights.sum(axis=-1, keepdims=True)


def reference_standardize(logits, config):
  """logits [v] -> probs [v] float64, written from the definitions (paper 2.2)."""
  logits = np.asarray(logits, np.float64)
  vocab = logits.shape[-1]
  if config.temperature <= sampling.MIN_TEMPERATURE:
    return np.eye(vocab)[np.argmax(logits)]  # np.argmax takes the first maximum.
  scaled = logits / config.temperature
  if 0 < config.top_k < vocab:
    kth_largest = np.sort(scaled)[::-1][config.top_k - 1]
    scaled = np.where(scaled < kth_largest, -np.inf, scaled)  # Ties with the kth stay.
  if config.top_p < 1.0:
    probs = softmax(scaled)
    order = np.argsort(-scaled, kind='stable')  # By logit: equal probs may differ there.
    mass_before = np.cumsum(probs[order]) - probs[order]
    # The smallest set of most likely tokens whose mass reaches top_p (+ ties).
    cutoff = scaled[order[mass_before < config.top_p]].min()
    scaled = np.where(scaled < cutoff, -np.inf, scaled)
  return softmax(scaled)


def top_p_margin(logits, config):
  """Distance of top_p from the nearest cumulative mass (float32 vs float64 boundary)."""
  if config.top_p >= 1.0 or config.temperature <= sampling.MIN_TEMPERATURE:
    return np.inf
  scaled = np.asarray(logits, np.float64) / config.temperature
  if 0 < config.top_k < len(scaled):
    scaled = np.where(scaled < np.sort(scaled)[::-1][config.top_k - 1], -np.inf, scaled)
  cumulative = np.cumsum(np.sort(softmax(scaled))[::-1])
  return np.min(np.abs(np.concatenate([[0.0], cumulative]) - config.top_p))


def chi_square_critical(df: int) -> float:
  """Upper SIGNIFICANCE quantile of chi-square(df), Wilson-Hilferty approximation.

  Within 3% of the exact value for df >= 1 and always a little above it, so the test's
  real level is at most SIGNIFICANCE.
  """
  h = 2.0 / (9.0 * df)
  return df * (1.0 - h + NORMAL_UPPER * math.sqrt(h)) ** 3


def chi_square(counts, probs):
  """Pearson's statistic and its critical value, counts vs exact probs (any shape).

  A count in a zero-probability cell makes the statistic infinite. Cells expected
  to hold fewer than 5 are pooled (least likely first) until the pool reaches 5.
  """
  counts = np.asarray(counts, np.float64).ravel()
  probs = np.asarray(probs, np.float64).ravel()
  if np.any(counts[probs <= 0] > 0):
    return np.inf, 0.0
  counts, expected = counts[probs > 0], probs[probs > 0] * counts.sum()
  order = np.argsort(expected)
  pooled = np.searchsorted(np.cumsum(expected[order]), 5.0) + 1 if expected.min() < 5 else 0
  observed = np.concatenate([[counts[order[:pooled]].sum()], counts[order[pooled:]]])
  expected = np.concatenate([[expected[order[:pooled]].sum()], expected[order[pooled:]]])
  observed, expected = observed[expected > 0], expected[expected > 0]
  statistic = np.sum((observed - expected) ** 2 / expected)
  return statistic, chi_square_critical(len(expected) - 1)


def total_variation(counts, probs):
  counts = np.asarray(counts, np.float64).ravel()
  return 0.5 * np.abs(counts / counts.sum() - np.asarray(probs).ravel()).sum()


def total_variation_bound(probs, num_samples):
  """TV(empirical, probs) stays below this with probability >= 1 - SIGNIFICANCE.

  E[TV] <= sum_x sqrt(p(1-p)/N) / 2, and TV moves by at most 1/N per sample, so
  McDiarmid adds sqrt(log(1/SIGNIFICANCE) / (2N)).
  """
  probs = np.asarray(probs, np.float64).ravel()
  mean_bound = 0.5 * np.sum(np.sqrt(probs * (1 - probs) / num_samples))
  return mean_bound + math.sqrt(math.log(1 / SIGNIFICANCE) / (2 * num_samples))


def assert_matches(counts, probs):
  """Chi-square and total-variation tests at level SIGNIFICANCE."""
  statistic, critical = chi_square(counts, probs)
  assert statistic < critical, f'chi-square {statistic:.1f} >= {critical:.1f}'
  tv, bound = total_variation(counts, probs), total_variation_bound(probs, np.sum(counts))
  assert tv < bound, f'total variation {tv:.4f} >= {bound:.4f}'


def assert_rejected(counts, probs):
  statistic, critical = chi_square(counts, probs)
  assert statistic > critical, f'chi-square {statistic:.1f} <= {critical:.1f}: no power'
  tv, bound = total_variation(counts, probs), total_variation_bound(probs, np.sum(counts))
  assert tv > bound, f'total variation {tv:.4f} <= {bound:.4f}: no power'


# ----------------------------------------------------------------------------
# SamplingConfig and standardize.


@pytest.mark.parametrize('kwargs', [
    dict(temperature=-0.1), dict(temperature=float('nan')), dict(top_k=-1),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.01),
])
def test_config_rejects_invalid(kwargs):
  with pytest.raises(ValueError):
    SamplingConfig(**kwargs)


def test_config_is_hashable_and_greedy_threshold():
  assert hash(SamplingConfig(1.0, 5, 0.9)) == hash(SamplingConfig(1.0, 5, 0.9))
  assert SamplingConfig(temperature=0.0).is_greedy
  assert SamplingConfig(temperature=sampling.MIN_TEMPERATURE).is_greedy
  assert not SamplingConfig(temperature=2 * sampling.MIN_TEMPERATURE).is_greedy
  SamplingConfig(top_p=1.0)  # The boundary values are valid.


def test_standardize_hand_made_cases():
  logits = np.log(np.array([0.5, 0.3, 0.15, 0.05], np.float32))
  standardize = lambda config: np.asarray(sampling.standardize(jnp.asarray(logits), config))
  np.testing.assert_allclose(standardize(SamplingConfig(1.0)), [0.5, 0.3, 0.15, 0.05], rtol=1e-6)
  np.testing.assert_allclose(standardize(SamplingConfig(1.0, top_k=2)), [0.625, 0.375, 0, 0],
                             rtol=1e-6)
  # Mass 0.5 < 0.75 after one token, 0.8 >= 0.75 after two.
  np.testing.assert_allclose(standardize(SamplingConfig(1.0, top_p=0.75)), [0.625, 0.375, 0, 0],
                             rtol=1e-6)
  np.testing.assert_allclose(standardize(SamplingConfig(1.0, top_p=0.5)), [1, 0, 0, 0])
  np.testing.assert_allclose(standardize(SamplingConfig(1.0, top_p=0.85)),
                             np.array([0.5, 0.3, 0.15, 0]) / 0.95, rtol=1e-6)
  # Temperature 0.5 squares and renormalizes the probabilities.
  np.testing.assert_allclose(standardize(SamplingConfig(0.5)),
                             np.array([0.25, 0.09, 0.0225, 0.0025]) / 0.365, rtol=1e-5)


def test_standardize_ties():
  logits = jnp.array([[1.0, 3.0, 3.0, 2.0], [3.0, 1.0, 3.0, 3.0]])
  # Argmax breaks ties toward the first index.
  np.testing.assert_array_equal(sampling.standardize(logits, SamplingConfig(0.0)),
                                [[0, 1, 0, 0], [1, 0, 0, 0]])
  # top-k keeps every token tied with the kth largest (like T5X's topk_mask).
  np.testing.assert_allclose(sampling.standardize(logits, SamplingConfig(1.0, top_k=1)),
                             [[0, 0.5, 0.5, 0], [1 / 3, 0, 1 / 3, 1 / 3]], rtol=1e-6)


@st.composite
def logits_vectors(draw, vocab, grid=False):
  """float32 logits [vocab] with some -inf / NEG_INF entries, at least one finite."""
  if grid:  # Half-integers: exact ties are common.
    values = draw(hnp.arrays(np.int32, vocab, elements=st.integers(-8, 8))) / 2.0
  else:
    # No subnormals: XLA on CPU flushes them to zero (a tie numpy would not see).
    elements = st.floats(-6, 6, width=32, allow_subnormal=False)
    values = draw(hnp.arrays(np.float32, vocab, elements=elements))
  masks = draw(hnp.arrays(np.int8, vocab, elements=st.sampled_from([0, 0, 0, 1, 2])))
  masks[draw(st.integers(0, vocab - 1))] = 0
  logits = np.where(masks == 1, -np.inf, np.where(masks == 2, sampling.NEG_INF, values))
  return logits.astype(np.float32)


sampling_configs = st.builds(
    SamplingConfig,
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(0, 9),
    top_p=st.one_of(st.just(1.0), st.floats(0.05, 1.0)))


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(data=st.data(), vocab=st.integers(2, 8), grid=st.booleans())
def test_standardize_matches_reference(data, vocab, grid):
  logits = data.draw(logits_vectors(vocab, grid))
  config = data.draw(sampling_configs)
  hypothesis.assume(top_p_margin(logits, config) > 1e-4)
  probs = np.asarray(sampling.standardize(jnp.asarray(logits), config))
  assert probs.dtype == np.float32
  np.testing.assert_allclose(probs, reference_standardize(logits, config), atol=1e-5)


@hypothesis.settings(max_examples=100, deadline=None)
@hypothesis.given(data=st.data(), vocab=st.integers(1, 8))
def test_nonfinite_logits_flags_nan_and_plus_inf_not_masks(data, vocab):
  rows = [data.draw(logits_vectors(vocab)) for _ in range(4)]
  # Row 1 gets a NaN, row 2 a +inf, row 3 only -inf; row 0 keeps its -inf masks.
  rows[1][data.draw(st.integers(0, vocab - 1))] = np.nan
  rows[2][data.draw(st.integers(0, vocab - 1))] = np.inf
  rows[3][:] = -np.inf
  flags = np.asarray(sampling.nonfinite_logits(jnp.asarray(np.stack(rows))))
  np.testing.assert_array_equal(flags, [False, True, True, True])
  probs = np.asarray(sampling.standardize(jnp.asarray(rows[0]), SamplingConfig(1.0)))
  assert np.isfinite(probs).all()  # What is not flagged can be sampled from.


# One jitted jnp.argmax for every example (a lambda made per example compiles per example).
_jnp_argmax = jax.jit(functools.partial(jnp.argmax, axis=-1))


@hypothesis.settings(max_examples=150, deadline=None)
@hypothesis.given(data=st.data(), vocab=st.integers(1, 12))
def test_argmax_is_numpys_first_largest_or_first_nan(data, vocab):
  # The first largest entry, the first NaN if any: numpy's argmax and jnp.argmax, which
  # it replaces. (Subnormals are left out: XLA:CPU flushes them to zero.)
  values = st.sampled_from([0.0, 1.0, -1.0, 2.5, np.inf, -np.inf, np.nan])
  rows = data.draw(hnp.arrays(np.float32, (3, 2, vocab), elements=st.one_of(
      values, st.floats(-4, 4, width=32, allow_subnormal=False))))
  tokens = np.asarray(jax.jit(sampling.argmax)(jnp.asarray(rows)))
  assert tokens.dtype == np.int32
  np.testing.assert_array_equal(tokens, np.argmax(rows, axis=-1))
  np.testing.assert_array_equal(tokens, _jnp_argmax(rows))


def test_argmax_on_a_vocabulary_row_with_ties_nan_and_infinities():
  row = np.random.default_rng(0).standard_normal((5, 8000)).astype(np.float32)
  row[0, [17, 4000]] = 9.0  # a tie: the first
  row[1, 7999] = np.inf
  row[2, [3, 5000]] = np.nan  # the first NaN, though larger entries follow
  row[2, 6000] = np.inf
  row[3] = -np.inf
  expected = [17, 7999, 3, 0, int(np.argmax(row[4]))]
  np.testing.assert_array_equal(jax.jit(sampling.argmax)(jnp.asarray(row)), expected)
  np.testing.assert_array_equal(jnp.argmax(jnp.asarray(row), axis=-1), expected)


def test_categorical_draws_what_jax_random_categorical_draws():
  # Draw for draw, key by key: the same Gumbel noise and the first largest index, masked
  # (-inf) entries never drawn, the first NaN where a row has one, under jit and vmap.
  logits = np.random.default_rng(1).standard_normal((64, 8000)).astype(np.float32) * 3
  logits[:, ::7] = -np.inf
  logits[5, [11, 900]] = np.nan
  keys = jax.random.split(jax.random.key(2), 64)
  ours = jax.jit(jax.vmap(sampling.categorical))(keys, logits)
  np.testing.assert_array_equal(ours, jax.jit(jax.vmap(jax.random.categorical))(keys, logits))
  assert ours.dtype == np.int32 and int(ours[5]) == 11
  assert not np.any(np.asarray(ours)[np.arange(64) != 5] % 7 == 0)
  key = jax.random.key(3)
  np.testing.assert_array_equal(sampling.categorical(key, logits[:4]),
                                jax.random.categorical(key, logits[:4]))


def test_sample_logits_draws_from_standardized_distribution():
  logits = jnp.log(jnp.array([0.4, 0.25, 0.2, 0.1, 0.05]))
  config = SamplingConfig(temperature=0.7, top_k=4, top_p=0.9)
  num_rows = 50_000
  tokens = sampling.sample_logits(jax.random.key(3), jnp.broadcast_to(logits, (num_rows, 5)),
                                  config)
  counts = np.bincount(np.asarray(tokens), minlength=5)
  assert_matches(counts, reference_standardize(np.asarray(logits), config))
  greedy = sampling.sample_logits(jax.random.key(3), logits, SamplingConfig(0.0))
  assert int(greedy) == 0


def test_sample_probs_never_draws_zero_entries():
  probs = jnp.array([0.0, 0.7, 0.0, 0.3])
  rows = jnp.broadcast_to(probs, (20_000, 4))
  tokens = np.asarray(sampling.sample_probs(jax.random.key(4), rows))
  assert_matches(np.bincount(tokens, minlength=4), np.asarray(probs))


# ----------------------------------------------------------------------------
# token_log_probs (T5X semantics).


def test_token_log_probs():
  rng = np.random.default_rng(0)
  logits = rng.normal(size=(3, 4, 7)).astype(np.float32) * 2
  # A runner-up close enough that logits / MIN_TEMPERATURE would not be one-hot.
  logits[0, 0, :2] = [10.0, 10.0 - 1e-4]
  tokens = rng.integers(0, 7, size=(3, 4))
  raw_log_probs = np.log(softmax(logits.astype(np.float64)))
  raw_expected = np.take_along_axis(raw_log_probs, tokens[..., None], -1)[..., 0]
  for config in [SamplingConfig(0.0), SamplingConfig(1.3, top_k=3, top_p=0.8)]:
    got = sampling.token_log_probs(jnp.asarray(logits), jnp.asarray(tokens), config,
                                   rescale=False)
    np.testing.assert_allclose(got, raw_expected, rtol=1e-5, atol=1e-5)
  # rescale=True, greedy: T5X reports 0 (the argmax has probability 1).
  argmax = logits.argmax(-1)
  np.testing.assert_array_equal(
      sampling.token_log_probs(jnp.asarray(logits), jnp.asarray(argmax), SamplingConfig(0.0)), 0)
  # rescale=True, sampling: log of the adjusted distribution actually sampled from.
  config = SamplingConfig(1.3, top_k=3, top_p=0.8)
  probs = np.stack([[reference_standardize(row, config) for row in rows] for rows in logits])
  got = np.asarray(sampling.token_log_probs(jnp.asarray(logits), jnp.asarray(tokens), config))
  kept = np.take_along_axis(probs, tokens[..., None], -1)[..., 0]
  np.testing.assert_allclose(got[kept > 0], np.log(kept[kept > 0]), rtol=1e-5, atol=1e-5)
  assert np.all(got[kept == 0] < -1e6)  # Masked tokens: effectively -inf.


# ----------------------------------------------------------------------------
# acceptance_probability and residual_distribution.


def test_acceptance_probability_values():
  p = jnp.array([[[0.5, 0.3, 0.2], [0.1, 0.1, 0.8]]])  # [1, 2, 3]
  q = jnp.array([[[0.25, 0.6, 0.15], [0.0, 0.5, 0.5]]])
  tokens = jnp.array([[1, 2]])
  np.testing.assert_allclose(token_rule.acceptance_probability(p, q, tokens), [[0.5, 1.0]])
  # Lenience l: min(1, p / (l q)).
  np.testing.assert_allclose(token_rule.acceptance_probability(p, q, tokens, lenience=0.6),
                             [[0.3 / 0.36, 1.0]], rtol=1e-6)
  all_tokens = jnp.arange(3)[None]  # Every token as a draft at one position.
  accept = token_rule.acceptance_probability(
      jnp.broadcast_to(p[:, :1], (1, 3, 3)), jnp.broadcast_to(q[:, :1], (1, 3, 3)), all_tokens)
  np.testing.assert_allclose(accept, [[1.0, 0.5, 1.0]])


def test_acceptance_probability_greedy_lenience():
  # A.5 for argmax: accept x when raw_p(x) >= l * max(raw_p), before standardizing.
  raw = jnp.broadcast_to(jnp.array([0.5, 0.3, 0.2]), (1, 4, 3))
  one_hot = jax.nn.one_hot(jnp.zeros((1, 4), jnp.int32), 3)
  tokens = jnp.array([[1, 2, 0, 1]])
  got = token_rule.acceptance_probability(one_hot, one_hot, tokens, lenience=0.5,
                                        raw_target_probs=raw)
  np.testing.assert_array_equal(got, [[1.0, 0.0, 1.0, 1.0]])  # 0.3 >= 0.25; 0.2 < 0.25.
  # At the boundary raw_p(x) == l * max(raw_p) the draft is accepted.
  got = token_rule.acceptance_probability(one_hot[:, :1], one_hot[:, :1], jnp.array([[1]]),
                                        lenience=0.6, raw_target_probs=raw[:, :1])
  np.testing.assert_array_equal(got, [[1.0]])


def test_residual_distribution_values():
  p = jnp.array([0.5, 0.3, 0.2])
  q = jnp.array([0.2, 0.5, 0.3])
  np.testing.assert_allclose(token_rule.residual_distribution(p, q), [1, 0, 0])
  np.testing.assert_allclose(token_rule.residual_distribution(p, q, 0.5), [0.8, 0.1, 0.1],
                             rtol=1e-6)
  # p == q leaves no residual mass: fall back to p (rejection has probability 0).
  np.testing.assert_array_equal(token_rule.residual_distribution(p, p), p)
  # q = 0 (the bonus position) gives p.
  np.testing.assert_allclose(token_rule.residual_distribution(p, jnp.zeros(3)), p)


# ----------------------------------------------------------------------------
# speculative_verdict on hand-made p and q.


def random_distributions(rng, shape, support=None):
  """Dirichlet rows [*shape, v]; zero outside `support` ([v] bool) when given."""
  probs = rng.dirichlet(np.ones(shape[-1]), size=shape[:-1])
  if support is not None:
    probs = np.where(support, probs, 0.0)
    probs /= probs.sum(-1, keepdims=True)
  return probs.astype(np.float32)


def sample_rows(rng, probs):
  """One token per row of probs [b, v] by inverse CDF (never a zero-probability token)."""
  cdf = np.cumsum(probs, axis=-1)
  uniform = rng.random((len(probs), 1)) * cdf[:, -1:]
  return (cdf <= uniform).sum(-1).astype(np.int32)


def test_verdict_p_equals_q_accepts_all_and_takes_bonus_from_last_position():
  rng = np.random.default_rng(5)
  batch, gamma, vocab = 512, 3, 6
  draft_probs = random_distributions(rng, (batch, gamma, vocab))
  drafts = np.stack([sample_rows(rng, draft_probs[:, i]) for i in range(gamma)], 1)
  bonus = rng.integers(0, vocab, batch)
  target_probs = np.concatenate([draft_probs, np.eye(vocab)[bonus][:, None]], 1)
  for seed in range(3):
    verdict = verdict_jit(jax.random.key(seed), drafts, draft_probs, target_probs)
    np.testing.assert_array_equal(verdict.num_accepted, gamma)
    np.testing.assert_array_equal(verdict.next_token, bonus)
    np.testing.assert_array_equal(verdict.accept_probability, 1.0)
    np.testing.assert_allclose(verdict.overlap, 1.0, rtol=1e-6)


def test_verdict_disjoint_supports_rejects_first_and_resamples_from_p1():
  rng = np.random.default_rng(6)
  batch, gamma, vocab = 20_000, 3, 6
  draft_probs = random_distributions(rng, (batch, gamma, vocab), np.arange(vocab) < 2)
  drafts = np.stack([sample_rows(rng, draft_probs[:, i]) for i in range(gamma)], 1)
  p_first = np.array([0, 0, 0.3, 0.7, 0, 0], np.float32)
  later = random_distributions(rng, (batch, gamma, vocab), np.arange(vocab) >= 4)
  target_probs = np.concatenate([np.broadcast_to(p_first, (batch, 1, vocab)), later], 1)
  verdict = verdict_jit(jax.random.key(0), drafts, draft_probs, target_probs)
  np.testing.assert_array_equal(verdict.num_accepted, 0)
  np.testing.assert_array_equal(verdict.accept_probability[:, 0], 0.0)
  np.testing.assert_array_equal(verdict.overlap, 0.0)
  assert_matches(np.bincount(np.asarray(verdict.next_token), minlength=vocab), p_first)


def test_verdict_one_hot_draft():
  # q = one-hot(1): accept with p(1) = 0.5, else draw from norm(p - q) = [0.4, 0, 0.6, 0].
  batch, vocab = 40_000, 4
  p = np.array([0.2, 0.5, 0.3, 0.0], np.float32)
  draft_probs = np.broadcast_to(np.eye(vocab, dtype=np.float32)[1], (batch, 1, vocab))
  target_probs = np.broadcast_to(p, (batch, 2, vocab))
  drafts = np.ones((batch, 1), np.int32)
  verdict = verdict_jit(jax.random.key(1), drafts, draft_probs, target_probs)
  np.testing.assert_allclose(verdict.accept_probability, 0.5)
  np.testing.assert_allclose(verdict.overlap, 0.5)
  accepted = np.asarray(verdict.num_accepted) == 1
  first = np.where(accepted, 1, verdict.next_token)
  assert_matches(np.bincount(first, minlength=vocab), p)
  rejected_tokens = np.asarray(verdict.next_token)[~accepted]
  assert_matches(np.bincount(rejected_tokens, minlength=vocab), [0.4, 0, 0.6, 0])


def test_verdict_greedy():
  """One-hot p and q: accept while the argmaxes agree; the next token is the target's."""
  rng = np.random.default_rng(7)
  batch, gamma, vocab = 1024, 4, 5
  target_logits = rng.normal(size=(batch, gamma + 1, vocab)).astype(np.float32)
  noise = rng.normal(size=(batch, gamma, vocab)) * rng.choice([0.0, 0.3, 3.0], (batch, 1, 1))
  draft_logits = (target_logits[:, :gamma] + noise).astype(np.float32)
  greedy = SamplingConfig(temperature=0.0)
  target_probs = sampling.standardize(jnp.asarray(target_logits), greedy)
  draft_probs = sampling.standardize(jnp.asarray(draft_logits), greedy)
  drafts = draft_logits.argmax(-1)
  target_argmax = target_logits.argmax(-1)  # [b, g+1]
  agree = drafts == target_argmax[:, :gamma]
  expected_accepted = np.where(agree.all(1), gamma, np.argmin(agree, 1))
  expected_next = target_argmax[np.arange(batch), expected_accepted]
  assert 0 < np.mean(expected_accepted == gamma) < 1 and np.any(expected_accepted == 0)
  for seed in range(3):
    verdict = verdict_jit(jax.random.key(seed), drafts, draft_probs, target_probs)
    np.testing.assert_array_equal(verdict.num_accepted, expected_accepted)
    np.testing.assert_array_equal(verdict.next_token, expected_next)
    np.testing.assert_array_equal(verdict.accept_probability, agree.astype(np.float32))


# ----------------------------------------------------------------------------
# Exactness in closed form (paper A.1), over random standardized p and q.


MAX_VOCAB = 8  # Property tests pad to this vocab (with -inf logits) to compile once.


@functools.partial(jax.jit, static_argnames='lenience')
def speculative_terms(p, q, lenience):
  """p, q [v] -> a(x) for every token x as the draft [v], the residual [v], and a
  16-row verdict (drafted from q, p at both positions)."""
  vocab, batch = p.shape[-1], 16
  accept = token_rule.acceptance_probability(
      jnp.broadcast_to(p, (1, vocab, vocab)), jnp.broadcast_to(q, (1, vocab, vocab)),
      jnp.arange(vocab)[None], lenience)[0]
  residual = token_rule.residual_distribution(p, q, lenience)
  draft_rng, verdict_rng = jax.random.split(jax.random.key(0))
  drafts = sampling.sample_probs(draft_rng, jnp.broadcast_to(q, (batch, vocab)))[:, None]
  verdict = token_rule.speculative_verdict(
      verdict_rng, drafts, jnp.broadcast_to(q, (batch, 1, vocab)),
      jnp.broadcast_to(p, (batch, 2, vocab)), lenience)
  return accept, residual, drafts[:, 0], verdict


def draw_standardized(data, vocab):
  """A random standardized distribution over `vocab` tokens, padded to MAX_VOCAB."""
  logits = np.full(MAX_VOCAB, -np.inf, np.float32)
  logits[:vocab] = data.draw(logits_vectors(vocab))
  probs = sampling.standardize(jnp.asarray(logits), data.draw(sampling_configs))
  assert np.all(np.asarray(probs)[vocab:] == 0)
  return probs


def first_token_distribution(p, q, lenience):
  """P(first committed token = x) [v] = q(x) a(x) + (1 - sum q a) r(x), float64.

  Also checks the residual and a few verdict rows: finite, valid, and the tokens
  committed after a rejection (or as the bonus) lie in the support of p.
  """
  accept, residual, drafts, verdict = jax.tree_util.tree_map(
      np.asarray, speculative_terms(p, q, lenience))
  p, q, residual = (np.asarray(x, np.float64) for x in (p, q, residual))
  np.testing.assert_allclose(residual.sum(), 1.0, rtol=1e-5)
  assert np.all(residual >= 0) and np.all(residual[p == 0] == 0)
  assert np.all(np.isfinite(verdict.accept_probability)) and np.all(np.isfinite(verdict.overlap))
  assert np.all(p[verdict.next_token] > 0)
  if lenience == 1.0:  # Without lenience even accepted drafts have p > 0.
    assert np.all(p[np.where(verdict.num_accepted == 1, drafts, verdict.next_token)] > 0)
  accepted = q * np.asarray(accept, np.float64)
  return accepted + (1.0 - accepted.sum()) * residual, accepted


@hypothesis.settings(max_examples=120, deadline=None)
@hypothesis.given(data=st.data(), vocab=st.integers(3, MAX_VOCAB))
def test_speculative_sampling_is_exact(data, vocab):
  p, q = draw_standardized(data, vocab), draw_standardized(data, vocab)
  first, accepted = first_token_distribution(p, q, 1.0)
  np.testing.assert_allclose(first, p, atol=2e-6)
  np.testing.assert_allclose(accepted, np.minimum(p, q), atol=1e-7)  # Theorem 3.5's terms.


@hypothesis.settings(max_examples=60, deadline=None)
@hypothesis.given(data=st.data(), vocab=st.integers(3, MAX_VOCAB),
                  lenience=st.sampled_from([0.1, 0.3, 0.5, 0.9]))
def test_lenience_bounds_each_token_by_p_over_l(data, vocab, lenience):
  p, q = draw_standardized(data, vocab), draw_standardized(data, vocab)
  first, accepted = first_token_distribution(p, q, lenience)
  p, q = np.asarray(p, np.float64), np.asarray(q, np.float64)
  np.testing.assert_allclose(accepted, np.minimum(q, p / lenience), atol=1e-6)
  np.testing.assert_allclose(first.sum(), 1.0, atol=1e-5)
  assert np.all(first <= p / lenience + 1e-6)  # Appendix A.5's guarantee.


# ----------------------------------------------------------------------------
# Monte Carlo: speculative_verdict on an autoregressive toy model.
#
# p and q depend on the whole prefix through tables: target_tables[i][x_1..x_i] is
# p_{i+1}, a distribution over the next token, and likewise draft_tables for q. So
# using p or q from the wrong position changes the distribution. The exact law of
# one verdict, P(n, x_1..x_n, t), is computed by enumeration below.

VOCAB, GAMMA, NUM_ROWS = 4, 3, 200_000
OUTCOME_SHAPE = (GAMMA + 1,) + (VOCAB,) * (GAMMA + 1)  # [n, token 1, ..., token g+1]


def random_tables(rng, depth):
  """[table_0 [v], table_1 [v, v], ...]: Dirichlet rows with ~30% of entries zeroed."""
  tables = []
  for i in range(depth):
    probs = rng.dirichlet(np.full(VOCAB, 0.7), size=(VOCAB,) * i)
    zero = rng.random(probs.shape) < 0.3
    zero &= probs < probs.max(-1, keepdims=True)  # Keep each row's largest entry.
    probs = np.where(zero, 0.0, probs)
    tables.append(probs / probs.sum(-1, keepdims=True))
  return tables


@functools.cache
def toy_models():
  rng = np.random.default_rng(2023)
  return random_tables(rng, GAMMA + 1), random_tables(rng, GAMMA)


def lookup(table, prefixes):
  """table [v]*(i+1), prefixes [b, i] -> next-token distributions [b, v]."""
  return np.broadcast_to(table[tuple(prefixes.T)], (len(prefixes), VOCAB))


def target_joint(target_tables):
  """P_p(x_1..x_{g+1}) [v]*(g+1), the target's own autoregressive distribution."""
  joint = target_tables[0]
  for table in target_tables[1:]:
    joint = joint[..., None] * table
  return joint


def correct_accepted_mass(p, q, lenience):
  return q * np.minimum(1.0, p / np.maximum(lenience * q, 1e-300))  # min(q, p / l)


def correct_residual(p, q, lenience):
  residual = np.maximum(p - lenience * q, 0.0)
  return residual / residual.sum() if residual.sum() > 0 else p


def correct_bonus(target_tables, prefix):
  return target_tables[GAMMA][prefix]


def exact_outcomes(lenience=1.0, accepted_mass=correct_accepted_mass,
                   residual=correct_residual, bonus=correct_bonus):
  """P(n, x_1..x_n, t) [g+1, v, ..., v] of one verdict; positions after t hold index 0.

  P = prod_{i<=n} accepted_mass_i(x_i) * (reject mass_{n+1} * residual_{n+1}(t) if
  n < g else p_{g+1}(t)); the rules are arguments so wrong ones can be plugged in.
  """
  target_tables, draft_tables = toy_models()
  outcomes = np.zeros(OUTCOME_SHAPE)
  for n in range(GAMMA + 1):
    for prefix in itertools.product(range(VOCAB), repeat=n):
      reach = 1.0
      for i, token in enumerate(prefix):
        p, q = target_tables[i][prefix[:i]], draft_tables[i][prefix[:i]]
        reach *= accepted_mass(p, q, lenience)[token]
      if n < GAMMA:
        p, q = target_tables[n][prefix], draft_tables[n][prefix]
        last = (1.0 - accepted_mass(p, q, lenience).sum()) * residual(p, q, lenience)
      else:
        last = bonus(target_tables, prefix)
      outcomes[(n,) + prefix + (slice(None),) + (0,) * (GAMMA - n)] = reach * last
  return outcomes


def complete_with_target(outcomes):
  """Outcome law -> law of g+1 tokens when later tokens are drawn from p [v]*(g+1)."""
  target_tables, _ = toy_models()
  joint = np.zeros((VOCAB,) * (GAMMA + 1))
  for n in range(GAMMA + 1):
    part = outcomes[(n,) + (slice(None),) * (n + 1) + (0,) * (GAMMA - n)]  # [v]*(n+1)
    for table in target_tables[n + 1:]:
      part = part[..., None] * table
    joint += part
  return joint


@functools.cache
def simulate(lenience):
  """Runs speculative_verdict once on NUM_ROWS rows drafted from q; numpy outputs."""
  target_tables, draft_tables = toy_models()
  rng = np.random.default_rng(11)
  drafts = np.zeros((NUM_ROWS, GAMMA), np.int32)
  for i in range(GAMMA):
    drafts[:, i] = sample_rows(rng, lookup(draft_tables[i], drafts[:, :i]))
  draft_probs = np.stack([lookup(draft_tables[i], drafts[:, :i]) for i in range(GAMMA)], 1)
  target_probs = np.stack([lookup(target_tables[i], drafts[:, :i]) for i in range(GAMMA + 1)], 1)
  verdict = verdict_jit(jax.random.key(12), drafts, draft_probs.astype(np.float32),
                        target_probs.astype(np.float32), lenience=lenience)
  return drafts, jax.tree_util.tree_map(np.asarray, verdict)


def committed_tokens(drafts, verdict):
  """[b, g+1]: x_1..x_n, t, then -1."""
  rows = np.arange(len(drafts))
  committed = np.where(np.arange(GAMMA + 1) < verdict.num_accepted[:, None],
                       np.pad(drafts, ((0, 0), (0, 1))), -1)
  committed[rows, verdict.num_accepted] = verdict.next_token
  return committed


def outcome_counts(lenience):
  drafts, verdict = simulate(lenience)
  committed = np.maximum(committed_tokens(drafts, verdict), 0)
  index = np.ravel_multi_index((verdict.num_accepted,) + tuple(committed.T), OUTCOME_SHAPE)
  return np.bincount(index, minlength=np.prod(OUTCOME_SHAPE)).reshape(OUTCOME_SHAPE)


def test_exact_outcomes_reproduce_target_in_closed_form():
  """Appendix A.1 by enumeration: one verdict followed by p is exactly p."""
  outcomes = exact_outcomes()
  np.testing.assert_allclose(outcomes.sum(), 1.0, rtol=1e-12)
  np.testing.assert_allclose(complete_with_target(outcomes), target_joint(toy_models()[0]),
                             atol=1e-12)


@pytest.mark.parametrize('lenience', [0.5, 0.2])
def test_lenient_outcomes_bound_every_conditional_by_p_over_l(lenience):
  target_tables, _ = toy_models()
  joint = complete_with_target(exact_outcomes(lenience))
  np.testing.assert_allclose(joint.sum(), 1.0, rtol=1e-12)
  for position in range(GAMMA + 1):
    marginal = joint.sum(axis=tuple(range(position + 1, GAMMA + 1)))  # [v]*(position+1)
    prefix_mass = marginal.sum(-1, keepdims=True)
    conditional = np.divide(marginal, prefix_mass, out=np.zeros_like(marginal),
                            where=prefix_mass > 0)
    assert np.all(conditional <= target_tables[position] / lenience + 1e-12)
  assert np.abs(joint - target_joint(target_tables)).sum() > 1e-3  # Lenience does change it.


@pytest.mark.parametrize('lenience', [1.0, 0.5])
def test_verdict_outcomes_match_exact_law(lenience):
  assert_matches(outcome_counts(lenience), exact_outcomes(lenience))


def test_committed_tokens_follow_target():
  """First token, first pair and all g+1 tokens (later ones drawn from p) ~ p."""
  target_tables, _ = toy_models()
  drafts, verdict = simulate(1.0)
  sequences = committed_tokens(drafts, verdict)
  rng = np.random.default_rng(13)
  for position in range(1, GAMMA + 1):  # Continue each row with the target itself.
    missing = sequences[:, position] < 0
    prefixes = np.maximum(sequences[:, :position], 0)
    drawn = sample_rows(rng, lookup(target_tables[position], prefixes))
    sequences[:, position] = np.where(missing, drawn, sequences[:, position])
  joint = target_joint(target_tables)
  for length in [1, 2, GAMMA + 1]:
    index = np.ravel_multi_index(tuple(sequences[:, :length].T), (VOCAB,) * length)
    counts = np.bincount(index, minlength=VOCAB ** length)
    assert_matches(counts, joint.sum(axis=tuple(range(length, GAMMA + 1))))


@pytest.mark.parametrize('lenience', [1.0, 0.5])
def test_acceptance_rates_match_theorem_3_5(lenience):
  """P(n >= 1) = sum_x min(p_1 / l, q_1) (Theorem 3.5; A.5 with lenience)."""
  target_tables, draft_tables = toy_models()
  _, verdict = simulate(lenience)
  beta = np.minimum(target_tables[0] / lenience, draft_tables[0]).sum()
  accepted_first = np.mean(verdict.num_accepted >= 1)
  assert abs(accepted_first - beta) < NORMAL_TWO_SIDED * math.sqrt(beta * (1 - beta) / NUM_ROWS)
  np.testing.assert_allclose(verdict.overlap[:, 0], beta, rtol=1e-5)
  # The whole law of n (number of accepted drafts) against the enumeration.
  law_of_n = exact_outcomes(lenience).reshape(GAMMA + 1, -1).sum(-1)
  assert_matches(np.bincount(verdict.num_accepted, minlength=GAMMA + 1), law_of_n)


# ----------------------------------------------------------------------------
# Negative controls: the tests above have power against real bugs.


def wrong_residual(p, q, lenience):
  return p  # norm(p) instead of norm(max(0, p - q)).


def wrong_bonus(target_tables, prefix):
  return target_tables[GAMMA - 1][prefix[:-1]]  # p_g instead of p_{g+1}.


def wrong_accepted_mass(p, q, lenience):
  return q * p  # Accept with probability p(x) instead of min(1, p(x) / q(x)).


BUGS = {
    'residual_is_p': dict(residual=wrong_residual),
    'bonus_from_p_gamma': dict(bonus=wrong_bonus),
    'accept_with_p': dict(accepted_mass=wrong_accepted_mass),
}


@pytest.mark.parametrize('bug', list(BUGS))
def test_negative_control_library_counts_reject_buggy_law(bug):
  assert_rejected(outcome_counts(1.0), exact_outcomes(**BUGS[bug]))


@pytest.mark.parametrize('bug', list(BUGS))
def test_negative_control_buggy_sampler_fails_target_test(bug):
  """A sampler with the bug, run for NUM_ROWS rows, fails the test vs p."""
  buggy_joint = complete_with_target(exact_outcomes(**BUGS[bug]))
  np.testing.assert_allclose(buggy_joint.sum(), 1.0, rtol=1e-12)
  counts = np.random.default_rng(14).multinomial(NUM_ROWS, buggy_joint.ravel())
  assert_rejected(counts, target_joint(toy_models()[0]))


@pytest.mark.parametrize('seed', range(4))
@pytest.mark.parametrize('one_hot_q', [True, False])
@pytest.mark.parametrize('with_num_drafts', [False, True])
def test_greedy_verdict_equals_speculative_verdict_at_temperature_zero(seed, one_hot_q,
                                                                      with_num_drafts):
  """The argmax shortcut the loop takes at temperature 0 decides as Algorithm 1 does on
  standardized (one-hot) p, for one-hot or arbitrary q, with or without adaptive gamma;
  ties in the logits included (the first maximum wins in both)."""
  batch, gamma, vocab = 64, 4, 5
  keys = jax.random.split(jax.random.PRNGKey(seed), 5)
  logits = jnp.round(jax.random.normal(keys[0], (batch, gamma + 1, vocab)))  # many ties
  target_tokens = jnp.argmax(logits, axis=-1)
  # Drafts that agree with the argmax at the first positions most of the time.
  agree = jax.random.uniform(keys[1], (batch, gamma)) < 0.7
  drafts = jnp.where(agree, target_tokens[:, :gamma],
                     jax.random.randint(keys[2], (batch, gamma), 0, vocab)).astype(jnp.int32)
  if one_hot_q:
    draft_probs = jax.nn.one_hot(drafts, vocab)
  else:
    draft_probs = jax.nn.softmax(jax.random.normal(keys[3], (batch, gamma, vocab)), axis=-1)
  num_drafts = (jax.random.randint(keys[4], (batch,), 1, gamma + 1) if with_num_drafts
                else None)
  greedy = SamplingConfig(temperature=0.0)
  expected = token_rule.speculative_verdict(
      jax.random.PRNGKey(seed + 100), drafts, draft_probs,
      sampling.standardize(logits, greedy), num_drafts=num_drafts)
  shortcut = token_rule.greedy_verdict(drafts, draft_probs, logits, num_drafts)
  np.testing.assert_array_equal(shortcut.num_accepted, expected.num_accepted)
  np.testing.assert_array_equal(shortcut.next_token, expected.next_token)
  np.testing.assert_allclose(shortcut.overlap, expected.overlap, atol=1e-6)
  assert 0 < int(jnp.sum(shortcut.num_accepted)) < batch * gamma  # both outcomes occur
