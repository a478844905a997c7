"""Block verification (jaxspec/decoding/verification/block.py) against exact enumeration.

On small random autoregressive p and q (tables over every prefix, vocab 3 to 4,
gamma up to 3), every draft block is enumerated with its probability under q, the
library's weights, stop probabilities and block residuals give the exact distribution
of (accepted prefix, next token), and the output, continued from the target, must be
the target's joint distribution over gamma + 1 tokens. The expected accepted length
is compared with token-wise verification's, computed independently.
The sampler itself (block_verdict) is checked end to end in tests/test_speculative.py.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.decoding.verification import block as block_verification
from jaxspec.sampling import SamplingConfig
from jaxspec.decoding.verification.token import speculative_verdict


def _random_tables(seed, vocab, gamma, concentration):
  """{prefix: p(. | prefix)}, {prefix: q(. | prefix)} for all prefixes up to gamma tokens.

  A Dirichlet concentration below 1 gives peaked rows; some q rows get exact zeros, so
  the draft cannot propose every token the target can.
  """
  rng = np.random.default_rng(seed)
  p, q = {}, {}
  for length in range(gamma + 1):
    for prefix in itertools.product(range(vocab), repeat=length):
      p[prefix] = rng.dirichlet(np.full(vocab, concentration))
      draft = rng.dirichlet(np.full(vocab, concentration))
      if rng.random() < 0.3:  # A draft that never proposes one token.
        draft[rng.integers(vocab)] = 0.0
        draft /= draft.sum()
      q[prefix] = draft
  return p, q


def _blocks(p, q, vocab, gamma):
  """Every draft block: (blocks [n, g], Q(block) [n], draft q [n, g, v], target p
  [n, g+1, v]), float64 numpy. Blocks with Q = 0 carry no mass."""
  blocks, masses, draft_probs, target_probs = [], [], [], []
  for block in itertools.product(range(vocab), repeat=gamma):
    mass = np.prod([q[block[:i]][block[i]] for i in range(gamma)])
    blocks.append(block)
    masses.append(mass)
    draft_probs.append([q[block[:i]] for i in range(gamma)])
    target_probs.append([p[block[:i]] for i in range(gamma + 1)])
  return (np.array(blocks), np.array(masses), np.array(draft_probs),
          np.array(target_probs))


@jax.jit
def _library_rule(blocks, draft_probs, target_probs, num_drafts):
  weights = block_verification.prefix_weights(blocks, draft_probs, target_probs, num_drafts)
  residuals = block_verification.block_residuals(weights, draft_probs, target_probs,
                                                 num_drafts)
  mass = jnp.sum(residuals, axis=-1)
  return block_verification.stop_probabilities(weights, mass), residuals, mass


_verdict = jax.jit(block_verification.block_verdict)


def _block_rule(blocks, draft_probs, target_probs, num_drafts=None):
  """The library's rule as exact probabilities: (P(tau = i | block) [n, g+1],
  normalized residual at each i [n, g+1, v]), float64."""
  if num_drafts is None:
    num_drafts = np.full(len(blocks), blocks.shape[1])
  with jax.enable_x64(True):
    stop, residuals, mass = map(np.asarray, _library_rule(
        *[jnp.asarray(x) for x in (blocks, draft_probs, target_probs, num_drafts)]))
  gamma = blocks.shape[1]
  tau = np.zeros((len(blocks), gamma + 1))
  not_longer = np.ones(len(blocks))  # P(no prefix longer than i was kept | block)
  for i in range(gamma, 0, -1):
    tau[:, i] = not_longer * stop[:, i - 1]
    not_longer = not_longer * (1 - stop[:, i - 1])
  tau[:, 0] = not_longer
  safe_mass = np.where(mass > 0, mass, 1.0)[..., None]
  next_probs = np.where(mass[..., None] > 0, residuals / safe_mass, target_probs)
  return tau, next_probs


def _output_distribution(p, vocab, gamma, blocks, masses, tau, next_probs):
  """{sequence of gamma + 1 tokens: probability} of the accepted prefix, the next token
  and target samples after it."""
  out = {}
  for row, block in enumerate(blocks):
    if masses[row] == 0:
      continue
    for accepted in range(gamma + 1):
      for token in range(vocab):
        mass = masses[row] * tau[row, accepted] * next_probs[row, accepted, token]
        if mass == 0:
          continue
        prefix = tuple(block[:accepted]) + (token,)
        for rest in itertools.product(range(vocab), repeat=gamma - accepted):
          sequence = prefix + rest
          tail = np.prod([p[sequence[:j]][sequence[j]] for j in range(len(prefix), gamma + 1)])
          out[sequence] = out.get(sequence, 0.0) + mass * tail
  return out


def _target_joint(p, vocab, length):
  return {seq: np.prod([p[seq[:j]][seq[j]] for j in range(length)])
          for seq in itertools.product(range(vocab), repeat=length)}


CASES = [(seed, vocab, gamma, concentration)
         for seed, (vocab, gamma) in enumerate([(3, 1), (3, 2), (3, 3), (4, 2), (4, 3)])
         for concentration in (0.3, 1.0)]


@pytest.mark.parametrize('seed,vocab,gamma,concentration', CASES)
def test_block_output_is_the_target_distribution(seed, vocab, gamma, concentration):
  p, q = _random_tables(seed, vocab, gamma, concentration)
  blocks, masses, draft_probs, target_probs = _blocks(p, q, vocab, gamma)
  np.testing.assert_allclose(masses.sum(), 1.0, rtol=1e-12)
  expected = _target_joint(p, vocab, gamma + 1)
  # Every drafted length k (adaptive gamma): drafts past k must never be accepted.
  for num_drafts in [None] + list(range(1, gamma)):
    lengths = None if num_drafts is None else np.full(len(blocks), num_drafts)
    tau, next_probs = _block_rule(blocks, draft_probs, target_probs, lengths)
    np.testing.assert_allclose(tau.sum(axis=1), 1.0, rtol=1e-12)
    if num_drafts is not None:
      np.testing.assert_array_equal(tau[:, num_drafts + 1:], 0.0)
    got = _output_distribution(p, vocab, gamma, blocks, masses, tau, next_probs)
    assert set(got) <= set(expected)
    np.testing.assert_allclose([got.get(s, 0.0) for s in expected], list(expected.values()),
                               atol=1e-12, err_msg=f'num_drafts={num_drafts}')


def _expected_accepted(blocks, masses, draft_probs, target_probs):
  """(block's E[tau], token-wise E[n]); token-wise from min(1, p/q) products."""
  tau, _ = _block_rule(blocks, draft_probs, target_probs)
  block = np.sum(masses * (tau @ np.arange(tau.shape[1])))
  rows = np.arange(len(blocks))[:, None]
  positions = np.arange(blocks.shape[1])[None, :]
  drafted = draft_probs[rows, positions, blocks]
  ratio = target_probs[rows, positions, blocks] / np.where(drafted > 0, drafted, 1.0)
  survive = np.cumprod(np.minimum(1.0, ratio), axis=1)  # P(n >= i) given the block
  return block, np.sum(masses * survive.sum(axis=1))


def test_block_accepts_at_least_as_many_drafts_as_token_wise():
  gains = []
  for seed in range(40):
    vocab, gamma = (3, 3) if seed % 2 else (4, 2)
    concentration = (0.2, 0.5, 1.0, 3.0)[seed % 4]
    p, q = _random_tables(100 + seed, vocab, gamma, concentration)
    block, token = _expected_accepted(*_blocks(p, q, vocab, gamma))
    assert block >= token - 1e-12, (seed, block, token)
    gains.append(block - token)
  assert max(gains) > 0.02  # Strictly more on some, so the comparison is not vacuous.


def test_block_equals_token_wise_for_one_draft_and_for_one_hot():
  # gamma 1: the block rule is Algorithm 1 (w_1 = min(1, p/q), h_1 = w_1).
  p, q = _random_tables(7, 4, 1, 1.0)
  block, token = _expected_accepted(*_blocks(p, q, 4, 1))
  np.testing.assert_allclose(block, token, rtol=1e-12)
  # Greedy: one-hot p and q; block keeps exactly the matching prefix and then p's argmax.
  rng = np.random.default_rng(3)
  target_tokens = rng.integers(0, 5, (64, 4))  # argmax of p at the 4 positions
  draft_tokens = np.where(rng.random((64, 3)) < 0.6, target_tokens[:, :3],
                          rng.integers(0, 5, (64, 3)))
  target_probs = jax.nn.one_hot(target_tokens, 5)
  draft_probs = jax.nn.one_hot(draft_tokens, 5)
  verdict = _verdict(jax.random.PRNGKey(0), draft_tokens, draft_probs, target_probs)
  token_wise = jax.jit(speculative_verdict)(jax.random.PRNGKey(1), draft_tokens, draft_probs,
                                            target_probs)
  matches = np.cumprod(draft_tokens == target_tokens[:, :3], axis=1).sum(axis=1)
  np.testing.assert_array_equal(verdict.num_accepted, matches)
  np.testing.assert_array_equal(token_wise.num_accepted, matches)
  np.testing.assert_array_equal(verdict.next_token, target_tokens[np.arange(64), matches])
  assert SamplingConfig().is_greedy


def test_nan_target_never_keeps_a_prefix_through_it():
  p, q = _random_tables(5, 3, 3, 1.0)
  blocks, _, draft_probs, target_probs = _blocks(p, q, 3, 3)
  target_probs = target_probs.copy()
  target_probs[:, 2] = np.nan  # p_3, the distribution of the third token, is NaN.
  verdict = _verdict(jax.random.PRNGKey(0), jnp.asarray(blocks),
                     jnp.asarray(draft_probs, jnp.float32), jnp.asarray(target_probs, jnp.float32))
  assert np.all(np.asarray(verdict.num_accepted) <= 1)
