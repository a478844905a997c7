"""End-to-end exactness of the speculative loop (Leviathan et al. 2023, Algorithm 1).

- Greedy: the speculative output equals the baseline's token for token, for a useless
  drafter, a near copy of the target and the target itself (where every draft is
  accepted, so every iteration starts with the drafter's two-input catch-up step).
- Caches: slots past a row's valid end (rolled back or never written) are never read;
  poisoning them changes nothing, poisoning a valid slot does.
- Sampling: over many independent rows, the joint distribution of the generated tokens
  matches the target's exact distribution, enumerated from teacher-forced forward passes
  (chi-square test and a total-variation bound); the same check rejects the draft.
- Statistics: alpha (Corollary 3.6) against the empirical acceptance rate, and the
  bookkeeping identities between the counters.
- Rows: a row's samples depend only on its input and key, not on its batch; NaN logits
  stop a row where the baseline stops it, and are reported.

Each distinct static configuration costs a jit compile, so runs are cached and shared.
"""

import dataclasses
import functools
import itertools
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import EOS_ID, T5Config, get_config
from jaxspec.decoding import speculative
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import Drafter, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, init_params, rollback
from jaxspec.sampling import SamplingConfig, standardize

# Greedy setup: a T5.1.1 target and a T5 1.0 draft (3 decoder layers), vocab 64.
TARGET = get_config('test_tiny_1_1')
DRAFT = get_config('test_tiny_1_0')
MAX_LEN = 16
# Encoder lengths per row (0-padded to 10). With the EOS-boosted target below the greedy
# outputs have lengths [1, 2, 16, 7, 1, 15, 16, 16]: rows ending at the first token, in
# the middle, one short of the limit, and at the limit.
ENCODER_LENGTHS = (10, 7, 4, 9, 2, 6, 1, 8)
# The one-draft edge and a typical gamma (each gamma and drafter is a compile).
GREEDY_GAMMAS = (1, 3)


# ----------------------------------------------------------------------------------
# Shared setup and cached runs.


def _scale_logits(params, factor, column=None):
  """Copy of params with the logits kernel [e, v] (or one of its columns) scaled."""
  params = jax.tree_util.tree_map(lambda x: x, params)  # new containers, shared leaves
  dense = params['params']['decoder']['logits_dense']
  if column is None:
    dense['kernel'] = dense['kernel'] * factor
  else:
    dense['kernel'] = dense['kernel'].at[:, column].multiply(factor)
  return params


@functools.cache
def _target_params():
  # A larger EOS column makes several rows end early.
  return _scale_logits(init_params(TARGET, jax.random.PRNGKey(2)), 2.0, EOS_ID)


@functools.cache
def _draft_params():
  return init_params(DRAFT, jax.random.PRNGKey(1))


@functools.cache
def _near_copy_params(noise=0.05):
  """The target's params plus noise of `noise` times each tensor's std (alpha ~ 0.8)."""
  leaves, treedef = jax.tree_util.tree_flatten(_target_params())
  keys = jax.random.split(jax.random.PRNGKey(7), len(leaves))
  noisy = [x + noise * jnp.std(x) * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)]
  return jax.tree_util.tree_unflatten(treedef, noisy)


@functools.cache
def _encoder_tokens():
  tokens = np.random.default_rng(1).integers(2, TARGET.vocab_size, (len(ENCODER_LENGTHS), 10))
  for row, length in enumerate(ENCODER_LENGTHS):
    tokens[row, length:] = 0
  return tokens.astype(np.int32)  # [b, s] numpy, so it is never a tracer under jit


@functools.cache
def _baseline():
  return generate(_target_params(), _encoder_tokens(), config=TARGET, max_decode_length=MAX_LEN)


def _drafter_setup(name):
  """(drafter, its params) for 'random' (another random T5), 'self' and 'near_copy'."""
  if name == 'random':
    return T5Drafter(DRAFT), _draft_params()
  if name == 'self':
    return T5Drafter(TARGET), _target_params()
  return T5Drafter(TARGET), _near_copy_params()


@functools.cache
def _greedy_run(drafter_name, gamma, lenience=1.0):
  drafter, drafter_params = _drafter_setup(drafter_name)
  return speculative_generate(
      _target_params(), drafter_params, _encoder_tokens(), target_config=TARGET,
      drafter=drafter, spec=SpeculativeConfig(gamma=gamma, lenience=lenience),
      max_decode_length=MAX_LEN)


def _acceptance_rate(stats):
  """Accepted drafts / verified drafted positions."""
  return float(np.sum(stats.accepted_per_position)) / float(stats.verified_positions)


def _check_stats(result, gamma):
  """The bookkeeping identities between the counters of SpeculativeStats."""
  stats = result.stats
  lengths = np.asarray(result.output.lengths)  # [b]
  row_calls = np.asarray(stats.row_target_calls)  # [b]
  counts = np.asarray(stats.num_accepted_counts)  # [g+1]
  accepted = np.asarray(stats.accepted_per_position)  # [g]
  batch = lengths.shape[0]
  # The loop runs while some row is active, so the longest-running row saw every call.
  assert int(stats.target_calls) == row_calls.max()
  # Each call proposes 1..gamma drafts (fewer once every row has drafted EOS).
  assert int(stats.target_calls) <= int(stats.draft_calls) <= int(stats.target_calls) * gamma
  # One verdict per (row, iteration) with the row active: no step decodes without drafts.
  assert counts.sum() == row_calls.sum()
  # Draft i is accepted exactly when n > i; positions 0..min(n, g-1) are verified.
  np.testing.assert_array_equal(accepted, [counts[i + 1:].sum() for i in range(gamma)])
  # A proposal cut at a drafted EOS verifies up to its length (_check_trace counts it).
  whole_proposals = sum(min(n + 1, gamma) * counts[n] for n in range(gamma + 1))
  if np.asarray(stats.num_drafted_counts)[:gamma].sum() == 0:
    assert int(stats.verified_positions) == whole_proposals
  else:
    assert accepted.sum() <= int(stats.verified_positions) <= whole_proposals
  # Every active call commits 1..g+1 tokens, the first call included.
  assert np.all(lengths >= row_calls)
  assert np.all(lengths <= row_calls * (gamma + 1))
  tokens_per_call = float(stats.tokens_per_target_call(result.output.lengths))
  assert 1.0 <= tokens_per_call <= gamma + 1
  assert 0.0 <= float(stats.alpha) <= 1.0


def _assert_padded_after_eos(output):
  """Tokens past each row's length are 0, and a row shorter than the buffer ends in EOS."""
  tokens, lengths = np.asarray(output.tokens), np.asarray(output.lengths)  # [b, L], [b]
  positions = np.arange(tokens.shape[1])[None, :]
  np.testing.assert_array_equal(np.where(positions >= lengths[:, None], tokens, 0), 0)
  ended = lengths < tokens.shape[1]
  np.testing.assert_array_equal(tokens[ended, lengths[ended] - 1], EOS_ID)


# ----------------------------------------------------------------------------------
# 1. Greedy: token for token the baseline.


def test_setup_has_early_eos_and_full_length_rows():
  lengths = np.asarray(_baseline().lengths)
  np.testing.assert_array_equal(lengths, [1, 2, 16, 7, 1, 15, 16, 16])
  _assert_padded_after_eos(_baseline())


@pytest.mark.parametrize('gamma', GREEDY_GAMMAS)
def test_greedy_with_random_draft_equals_baseline(gamma):
  result = _greedy_run('random', gamma)
  baseline = _baseline()
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  np.testing.assert_array_equal(result.output.token_log_probs, 0.0)
  _assert_padded_after_eos(result.output)
  _check_stats(result, gamma)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0  # The residual (correction) path ran.
  # Greedy acceptance is deterministic: alpha is exactly the acceptance rate.
  assert float(result.stats.alpha) == pytest.approx(_acceptance_rate(result.stats), abs=1e-6)
  assert float(result.stats.alpha) < 0.7


@pytest.mark.parametrize('gamma', GREEDY_GAMMAS)
def test_greedy_self_draft_accepts_every_draft(gamma):
  # Every draft is accepted, so every iteration after the first starts with a drafter
  # that never consumed d_gamma: alpha == 1 shows its two-input catch-up step is right.
  result = _greedy_run('self', gamma)
  baseline = _baseline()
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  _check_stats(result, gamma)
  stats = result.stats
  assert float(stats.alpha) == 1.0
  # Every proposed draft is accepted: proposals are gamma long, or end at a drafted EOS.
  np.testing.assert_array_equal(stats.num_accepted_counts, stats.num_drafted_counts)
  assert int(stats.num_accepted_counts[gamma]) > 0
  # Each call commits gamma + 1 tokens, the first included, up to EOS or the end.
  lengths = np.asarray(result.output.lengths)
  expected_calls = np.ceil(lengths / (gamma + 1)).astype(int)
  np.testing.assert_array_equal(stats.row_target_calls, expected_calls)
  assert int(stats.target_calls) == math.ceil(MAX_LEN / (gamma + 1))


@pytest.mark.parametrize('gamma', GREEDY_GAMMAS)
def test_greedy_max_length_reached_inside_an_accepted_window(gamma):
  # With every draft accepted, rows that never emit EOS fill 1 + k (gamma + 1) positions
  # after k calls; 15 is no multiple of 2 or 4, so the last window is cut by the limit.
  result = _greedy_run('self', gamma)
  full = np.asarray(_baseline().lengths) == MAX_LEN
  assert full.sum() >= 2 and (MAX_LEN - 1) % (gamma + 1) != 0
  assert result.output.tokens.shape == (len(ENCODER_LENGTHS), MAX_LEN)
  np.testing.assert_array_equal(np.asarray(result.output.lengths)[full], MAX_LEN)
  np.testing.assert_array_equal(np.asarray(result.output.tokens)[full],
                                np.asarray(_baseline().tokens)[full])


def test_greedy_near_copy_draft_full_accepts_then_continues():
  gamma = 3
  result = _greedy_run('near_copy', gamma)
  np.testing.assert_array_equal(result.output.tokens, _baseline().tokens)
  _check_stats(result, gamma)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert 0.5 < float(result.stats.alpha) < 1.0
  assert counts[:gamma].sum() > 0  # Some rejections...
  # ...and more full accepts than rows: each row has one final iteration, so some full
  # accept was followed by another iteration (the drafter catching up on d_gamma).
  assert counts[gamma] > len(ENCODER_LENGTHS)


# ----------------------------------------------------------------------------------
# 2. Stale cache slots are never read.


def _poison(cache, slots, value):
  """Sets self-attention keys and values at slots [b, L] (bool) of every layer to value."""
  def fill(x):  # [b, h, d, L]
    return jnp.where(slots[:, None, None, :], jnp.asarray(value, x.dtype), x)
  return cache.replace(layers=tuple(
      layer.replace(self_keys=fill(layer.self_keys), self_values=fill(layer.self_values))
      for layer in cache.layers))


def _slots_from(cache, start):
  """[b, L] bool: slots at or past start [b]."""
  return jnp.arange(cache.max_length)[None, :] >= start[:, None]


ROLLBACK_ENDS = (2, 4, 5)  # Valid positions per row after the rollback.


@jax.jit
def _rollback_then_decode(params, poison_slots, poison_value):
  """Decodes 6 positions with wrong tokens past each row's end, rolls back to the ends,
  sets the self-attention slots poison_slots [b, 10] to poison_value, then decodes the
  right next 3 tokens.

  Returns (logits [b, 3, v], the teacher-forced logits at the same positions [b, 3, v]).
  """
  model = T5(TARGET)
  encoder_tokens = _encoder_tokens()[:3]  # [b, s]
  ends = jnp.array(ROLLBACK_ENDS)  # [b]
  decoder_inputs = jnp.asarray(
      np.random.default_rng(3).integers(2, TARGET.vocab_size, (3, 8)), jnp.int32)
  decoder_inputs = decoder_inputs.at[:, 0].set(0)  # [b, 8], start token first
  is_past_end = jnp.arange(8)[None, :] >= ends[:, None]  # [b, 8]
  wrong_inputs = jnp.where(is_past_end, (decoder_inputs + 7) % TARGET.vocab_size,
                           decoder_inputs)

  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, 10, method=T5.init_cache)
  _, cache = model.apply(params, wrong_inputs[:, :6], cache, method=T5.decode)
  cache = _poison(rollback(cache, ends), poison_slots, poison_value)
  window = ends[:, None] + jnp.arange(3)[None, :]  # [b, 3]
  next_inputs = jnp.take_along_axis(decoder_inputs, window, axis=1)
  logits, cache = model.apply(params, next_inputs, cache, method=T5.decode)  # [b, 3, v]

  full = model.apply(params, encoder_tokens, decoder_inputs)  # [b, 8, v]
  return logits, jnp.take_along_axis(full, window[:, :, None], axis=1)


def _rollback_poison_slots(which):
  """[b, 10] bool: 'none', 'past_end' (slots >= end) or 'last_valid' (slot end - 1)."""
  slots = np.arange(10)[None, :]
  ends = np.array(ROLLBACK_ENDS)[:, None]
  return jnp.asarray({'none': slots < 0, 'past_end': slots >= ends,
                      'last_valid': slots == ends - 1}[which])


@pytest.mark.parametrize('value', [1e4, -1e4])
def test_model_rolled_back_slots_are_never_read(value):
  # Slots end..end+2 are re-written by the same decode call before being read; the
  # rest (stale keys of wrong tokens, then never-written zeros) must be masked.
  params = _target_params()
  clean, reference = _rollback_then_decode(params, _rollback_poison_slots('none'), value)
  poisoned, _ = _rollback_then_decode(params, _rollback_poison_slots('past_end'), value)
  np.testing.assert_allclose(clean, reference, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(poisoned, clean)


def test_model_poisoning_a_valid_slot_changes_logits():
  # The check above has teeth: the same poison one slot earlier changes everything.
  params = _target_params()
  clean, _ = _rollback_then_decode(params, _rollback_poison_slots('none'), 1e4)
  poisoned, _ = _rollback_then_decode(params, _rollback_poison_slots('last_valid'), 1e4)
  assert np.max(np.abs(poisoned - clean)) > 1e-2


@dataclasses.dataclass(frozen=True)
class _PoisonedDrafter(Drafter):
  """Delegates to `inner` after poisoning slots of the draft cache with `value`.

  Its params are (inner params, mode); mode 0 poisons nothing, 1 the slots >= length - 1
  (the drafter re-writes slot length - 1 and must mask the rest), 2 the valid slots
  < length - 1. The mode is traced, so the three share one compile.
  """
  inner: T5Drafter
  value: float = 1e4

  @property
  def vocab_size(self) -> int:
    return self.inner.vocab_size

  def init_state(self, params, encoder_tokens, max_length: int):
    return self.inner.init_state(params[0], encoder_tokens, max_length)

  def propose(self, params, state, context, gamma, sampling, keys):
    inner_params, mode = params
    stale = _slots_from(state, context.length - 1)  # [b, L]
    slots = jnp.where(mode == 1, stale, (mode == 2) & ~stale)
    state = _poison(state, slots, self.value)
    return self.inner.propose(inner_params, state, context, gamma, sampling, keys)


POISON_MODES = {'none': 0, 'past_end': 1, 'valid': 2}


@functools.cache
def _poisoned_runs(gamma=3):
  """mode name -> greedy run with the drafter poisoned by mode and the target's cache
  poisoned past each row's valid end right after every rollback."""
  def poisoning_rollback(cache, end_index):
    cache = rollback(cache, end_index)
    return _poison(cache, _slots_from(cache, cache.end_index), 1e4)

  # The patched rollback is traced because _PoisonedDrafter is a new static argument.
  with pytest.MonkeyPatch.context() as patch:
    patch.setattr(speculative, 'rollback', poisoning_rollback)
    return {name: speculative_generate(
        _target_params(), (_draft_params(), jnp.int32(mode)), _encoder_tokens(),
        target_config=TARGET, drafter=_PoisonedDrafter(T5Drafter(DRAFT)),
        spec=SpeculativeConfig(gamma=gamma), max_decode_length=MAX_LEN)
            for name, mode in POISON_MODES.items()}


def _assert_same_stats(stats, other):
  for field in ('target_calls', 'draft_calls', 'row_target_calls', 'accepted_per_position',
                'num_accepted_counts', 'verified_positions'):
    np.testing.assert_array_equal(getattr(stats, field), getattr(other, field), err_msg=field)
  np.testing.assert_allclose(stats.overlap_sum, other.overlap_sum, rtol=1e-6)


def test_loop_poisoned_stale_slots_change_nothing():
  runs = _poisoned_runs()
  clean = _greedy_run('random', 3)
  for name in ('none', 'past_end'):
    # Greedy output depends only on the target; the statistics also on the drafter.
    np.testing.assert_array_equal(runs[name].output.tokens, _baseline().tokens)
    _assert_same_stats(runs[name].stats, clean.stats)


def test_loop_poisoned_valid_draft_slots_change_stats_not_output():
  # Teeth for the drafter half of the test above; and exactness with a broken drafter.
  runs = _poisoned_runs()
  np.testing.assert_array_equal(runs['valid'].output.tokens, _baseline().tokens)
  assert not np.array_equal(runs['valid'].stats.num_accepted_counts,
                            runs['none'].stats.num_accepted_counts)


# ----------------------------------------------------------------------------------
# 3-5. Sampling is exact: empirical joint distribution against exact enumeration.

SMALL = T5Config(vocab_size=6, emb_dim=16, num_heads=2, head_dim=8, num_encoder_layers=1,
                 num_decoder_layers=1, mlp_dim=32)
NUM_ROWS = 50_000
SIGNIFICANCE = 1e-3  # Per check; the seeds are fixed, so each outcome is deterministic.
SMALL_ENCODER_ROW = np.array([3, 4, 5, 2, 0], np.int32)

# name -> (sampling, gamma, max_decode_length)
SAMPLED_CASES = {
    't1_gamma2': (SamplingConfig(temperature=1.0), 2, 3),
    # Length 4 with gamma 1: full accepts are followed by another iteration.
    't1_gamma1_len4': (SamplingConfig(temperature=1.0), 1, 4),
    'top_k3': (SamplingConfig(temperature=1.0, top_k=3), 2, 3),
    't0.7_top_p0.8': (SamplingConfig(temperature=0.7, top_p=0.8), 2, 3),
}


@functools.cache
def _small_target_params():
  # Sharper than the default init: joint entropy ~3.2 nats over 156 outcomes.
  return _scale_logits(init_params(SMALL, jax.random.PRNGKey(2)), 2.0)


@functools.cache
def _small_draft_params():
  """Halfway between the target and an independent init: alpha ~ 0.6 at temperature 1."""
  other = init_params(SMALL, jax.random.PRNGKey(102))
  return jax.tree_util.tree_map(lambda a, b: 0.5 * a + 0.5 * b, _small_target_params(), other)


def _small_encoder_tokens(num_rows=NUM_ROWS):
  return jnp.broadcast_to(jnp.asarray(SMALL_ENCODER_ROW), (num_rows, len(SMALL_ENCODER_ROW)))


@jax.jit
def _teacher_forced_logits(params, encoder_tokens, decoder_inputs):
  return T5(SMALL).apply(params, encoder_tokens, decoder_inputs)  # [b, t, v]


@functools.cache
def _exact_joint(which, sampling, length):
  """Exact distribution of `length` generated tokens: (outcomes [K, length], probs [K]).

  which: 'target' or 'draft'. The standardized next-token distribution at every prefix
  comes from one teacher-forced forward pass over all V^(length-1) prefixes. A sequence
  ends at its first EOS and is 0 after it.
  """
  params = _small_target_params() if which == 'target' else _small_draft_params()
  vocab = SMALL.vocab_size
  prefixes = list(itertools.product(range(vocab), repeat=length - 1))
  decoder_inputs = np.pad(np.array(prefixes, np.int32), ((0, 0), (1, 0)))  # [P, length]
  logits = _teacher_forced_logits(params, _small_encoder_tokens(len(prefixes)), decoder_inputs)
  probs = np.asarray(standardize(logits, sampling), np.float64)  # [P, length, v]
  row_of = {prefix: row for row, prefix in enumerate(prefixes)}

  outcomes, masses = [], []

  def extend(prefix, mass):
    if len(prefix) == length or (prefix and prefix[-1] == EOS_ID):
      outcomes.append(prefix + (0,) * (length - len(prefix)))
      masses.append(mass)
      return
    # Causal: position len(prefix) only sees the prefix, so any completion will do.
    row = row_of[(prefix + (0,) * length)[:length - 1]]
    for token in range(vocab):
      if probs[row, len(prefix), token] > 0:
        extend(prefix + (token,), mass * probs[row, len(prefix), token])

  extend((), 1.0)
  masses = np.array(masses)
  np.testing.assert_allclose(masses.sum(), 1.0, atol=1e-5)
  return np.array(outcomes), masses / masses.sum()


def _codes(tokens, vocab):
  """[n, length] -> [n] base-vocab integer codes."""
  return np.asarray(tokens, np.int64) @ (vocab ** np.arange(tokens.shape[1])[::-1])


def _chi_square_p_value(observed, expected):
  """Pearson's test; cells with expected count < 5 are pooled into one."""
  small = expected < 5
  observed_cells, expected_cells = list(observed[~small]), list(expected[~small])
  pooled_observed, pooled_expected = observed[small].sum(), expected[small].sum()
  if pooled_expected >= 5 or (pooled_expected > 0 and not expected_cells):
    observed_cells.append(pooled_observed)
    expected_cells.append(pooled_expected)
  elif pooled_expected > 0:  # Too little to stand alone: join the smallest cell.
    smallest = int(np.argmin(expected_cells))
    observed_cells[smallest] += pooled_observed
    expected_cells[smallest] += pooled_expected
  observed_cells, expected_cells = np.array(observed_cells), np.array(expected_cells)
  statistic = np.sum((observed_cells - expected_cells) ** 2 / expected_cells)
  dof = len(expected_cells) - 1
  return float(jax.scipy.special.gammaincc(dof / 2, statistic / 2))


def _tv_bound(probs, num_rows, delta=SIGNIFICANCE):
  """Bound on the total variation of an empirical distribution that holds w.p. 1 - delta.

  E[TV] <= 1/2 sum sqrt(p (1 - p) / n) (Jensen per cell); one row moves TV by <= 1/n,
  so McDiarmid adds sqrt(log(1 / delta) / (2 n)).
  """
  mean_bound = 0.5 * np.sum(np.sqrt(probs * (1 - probs) / num_rows))
  return mean_bound + math.sqrt(math.log(1 / delta) / (2 * num_rows))


def _compare(tokens, outcomes, probs):
  """-> (p-value, total variation, count of rows with a probability-0 outcome)."""
  tokens = np.asarray(tokens)
  vocab = SMALL.vocab_size
  counts = np.bincount(_codes(tokens, vocab), minlength=vocab ** tokens.shape[1])
  codes = _codes(outcomes, vocab)
  observed = counts[codes]
  impossible = int(counts.sum() - observed.sum())
  expected = probs * len(tokens)
  total_variation = 0.5 * (np.sum(np.abs(observed / len(tokens) - probs))
                           + impossible / len(tokens))
  return _chi_square_p_value(observed, expected), total_variation, impossible


def _assert_matches(tokens, outcomes, probs):
  p_value, total_variation, impossible = _compare(tokens, outcomes, probs)
  assert impossible == 0
  assert p_value > SIGNIFICANCE, (p_value, total_variation)
  assert total_variation < _tv_bound(probs, len(tokens)), (p_value, total_variation)


def _assert_rejects(tokens, outcomes, probs):
  p_value, total_variation, impossible = _compare(tokens, outcomes, probs)
  assert p_value < SIGNIFICANCE or impossible > 0, p_value
  assert total_variation > _tv_bound(probs, len(tokens)), total_variation


@functools.cache
def _sampled_run(case, lenience=1.0, seed=0):
  sampling, gamma, length = SAMPLED_CASES[case]
  return speculative_generate(
      _small_target_params(), _small_draft_params(), _small_encoder_tokens(),
      jax.random.PRNGKey(seed), target_config=SMALL, drafter=T5Drafter(SMALL),
      spec=SpeculativeConfig(gamma=gamma, lenience=lenience), max_decode_length=length,
      sampling=sampling)


def test_exact_distribution_is_peaked_and_draft_differs():
  # The reference itself: enough outcomes, not flat, EOS reachable, draft far from it.
  outcomes, probs = _exact_joint('target', SamplingConfig(temperature=1.0), 3)
  _, draft_probs = _exact_joint('draft', SamplingConfig(temperature=1.0), 3)
  assert len(probs) == 1 + 5 * (1 + 5 * 6)
  assert probs.max() > 5 / len(probs)
  assert probs[outcomes[:, 0] == EOS_ID].sum() > 0.01
  assert probs[outcomes[:, 1] == EOS_ID].sum() > 0.01
  assert 0.5 * np.abs(probs - draft_probs).sum() > 0.3


def test_baseline_sampling_matches_exact_distribution():
  # Sanity check of the reference on the decoder everyone trusts.
  sampling = SamplingConfig(temperature=1.0)
  result = generate(_small_target_params(), _small_encoder_tokens(), jax.random.PRNGKey(1),
                    config=SMALL, max_decode_length=3, sampling=sampling)
  _assert_matches(result.tokens, *_exact_joint('target', sampling, 3))


@pytest.mark.parametrize('case', list(SAMPLED_CASES))
def test_speculative_sampling_matches_exact_distribution(case):
  sampling, gamma, length = SAMPLED_CASES[case]
  result = _sampled_run(case)
  _assert_matches(result.output.tokens, *_exact_joint('target', sampling, length))
  _assert_padded_after_eos(result.output)
  _check_stats(result, gamma)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[gamma] > 0  # Both the residual and the bonus path ran.


@pytest.mark.parametrize('case', ['t1_gamma2', 'top_k3'])
def test_distribution_check_has_power(case):
  sampling, _, length = SAMPLED_CASES[case]
  tokens = _sampled_run(case).output.tokens
  # The draft's own distribution is rejected...
  _assert_rejects(tokens, *_exact_joint('draft', sampling, length))
  # ...and so is the target without the sampling's standardization.
  if sampling != SamplingConfig(temperature=1.0):
    _assert_rejects(tokens, *_exact_joint('target', SamplingConfig(temperature=1.0), length))


def test_token_log_probs_are_the_exact_conditionals():
  # Each row's log-prob sums to the log of its outcome's exact probability.
  sampling, _, length = SAMPLED_CASES['t1_gamma2']
  result = _sampled_run('t1_gamma2')
  outcomes, probs = _exact_joint('target', sampling, length)
  prob_of = dict(zip(_codes(outcomes, SMALL.vocab_size), probs))
  codes = _codes(np.asarray(result.output.tokens[:2000]), SMALL.vocab_size)
  expected = np.log([prob_of[code] for code in codes])
  np.testing.assert_allclose(result.output.log_prob[:2000], expected, rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------------
# 4. alpha against the acceptance rate.


@pytest.mark.parametrize('case', list(SAMPLED_CASES))
def test_alpha_matches_empirical_acceptance_rate(case):
  # At each verified position P(accept) = sum_x min(p, q) = beta, so accepted - sum(beta)
  # is a martingale with variance sum beta (1 - beta) <= m alpha (1 - alpha).
  stats = _sampled_run(case).stats
  alpha = float(stats.alpha)
  verified = int(stats.verified_positions)
  standard_error = math.sqrt(alpha * (1 - alpha) / verified)
  assert verified > 10_000 and 0.2 < alpha < 0.95
  assert abs(_acceptance_rate(stats) - alpha) < 4 * standard_error


# ----------------------------------------------------------------------------------
# 6. Input validation.


@pytest.mark.parametrize('gamma', [0, -1])
def test_gamma_must_be_positive(gamma):
  with pytest.raises(ValueError, match='gamma'):
    SpeculativeConfig(gamma=gamma)


def test_gamma_must_fit_the_decode_buffer():
  with pytest.raises(ValueError, match='gamma 4 is larger than the decode buffer allows'):
    speculative_generate(_target_params(), _target_params(), _encoder_tokens(),
                         target_config=TARGET, drafter=T5Drafter(TARGET),
                         spec=SpeculativeConfig(gamma=4), max_decode_length=4)


@pytest.mark.parametrize('lenience', [0.0, -0.5, 1.5])
def test_lenience_must_be_in_unit_interval(lenience):
  with pytest.raises(ValueError, match='lenience'):
    SpeculativeConfig(lenience=lenience)


def test_drafter_vocabulary_must_match():
  drafter = T5Drafter(DRAFT.replace(vocab_size=32))
  with pytest.raises(ValueError, match='vocab'):
    speculative_generate(_target_params(), _draft_params(), _encoder_tokens(),
                         target_config=TARGET, drafter=drafter, spec=SpeculativeConfig(),
                         max_decode_length=MAX_LEN)


# ----------------------------------------------------------------------------------
# 7. Lenience (paper A.5) accepts more drafts.


def test_sampled_lenience_accepts_more():
  # Acceptance min(1, p / (l q)) >= min(1, p / q) at every position.
  exact = _sampled_run('t1_gamma2').stats
  lenient = _sampled_run('t1_gamma2', lenience=0.5).stats
  alpha = float(exact.alpha)
  standard_error = math.sqrt(alpha * (1 - alpha) / int(lenient.verified_positions))
  assert _acceptance_rate(lenient) > alpha + 4 * standard_error


def test_greedy_lenience_accepts_more():
  # Accept when p(x) >= l max p: at least every draft that is the argmax.
  exact = _greedy_run('random', 3).stats
  lenient = _greedy_run('random', 3, lenience=0.5).stats
  assert _acceptance_rate(lenient) > float(exact.alpha)


def test_sampled_lenient_alpha_matches_acceptance_rate():
  # With lenience, alpha is sum_x min(p / l, q) (paper A.5), still the acceptance rate.
  stats = _sampled_run('t1_gamma2', lenience=0.5).stats
  alpha = float(stats.alpha)
  standard_error = math.sqrt(alpha * (1 - alpha) / int(stats.verified_positions))
  assert abs(_acceptance_rate(stats) - alpha) < 4 * standard_error


def test_greedy_lenient_alpha_is_the_acceptance_rate():
  stats = _greedy_run('random', 3, lenience=0.5).stats
  assert float(stats.alpha) == pytest.approx(_acceptance_rate(stats), abs=1e-6)


# ----------------------------------------------------------------------------------
# 8. Rows are independent and reproducible; non-finite logits stop a row, as in the
# baseline, and are reported.


@functools.cache
def _sampled_tiny_run(draft='clean', rows=tuple(range(len(ENCODER_LENGTHS)))):
  """Temperature-1 run on the greedy setup with the 'clean' or 'nan' draft params;
  `rows` picks the encoder rows and their keys."""
  draft_params = _draft_params()
  if draft == 'nan':
    draft_params = jax.tree_util.tree_map(lambda x: x * jnp.nan, draft_params)
  keys = jax.random.split(jax.random.PRNGKey(11), len(ENCODER_LENGTHS))
  rows = np.asarray(rows)
  return speculative_generate(
      _target_params(), draft_params, _encoder_tokens()[rows], keys[rows],
      target_config=TARGET, drafter=T5Drafter(DRAFT), spec=SpeculativeConfig(gamma=3),
      max_decode_length=MAX_LEN, sampling=SamplingConfig(temperature=1.0),
      on_nonfinite='ignore')


def test_sampled_rows_do_not_depend_on_their_batch():
  full = _sampled_tiny_run()
  # Each row moved, beside other rows (row 0 twice, rows 2 and 6 left out).
  rows = (5, 0, 7, 3, 1, 0, 4, 0)
  moved = _sampled_tiny_run('clean', rows)
  np.testing.assert_array_equal(moved.output.tokens, np.asarray(full.output.tokens)[list(rows)])
  np.testing.assert_allclose(moved.output.log_prob, np.asarray(full.output.log_prob)[list(rows)],
                             rtol=1e-5)
  again = _sampled_tiny_run.__wrapped__()  # Same seed, a second run.
  np.testing.assert_array_equal(again.output.tokens, full.output.tokens)
  assert len({tuple(row) for row in np.asarray(full.output.tokens)}) > 4  # Rows differ.


def _with_nan_embedding(params, token):
  params = jax.tree_util.tree_map(lambda x: x, params)  # new containers, shared leaves
  embedder = params['params']['token_embedder']
  embedder['embedding'] = embedder['embedding'].at[token].set(jnp.nan)
  return params


def _token_reached_mid_output():
  """A token absent from the inputs that some rows (not all) emit after position 0."""
  inputs, outputs = _encoder_tokens(), np.asarray(_baseline().tokens)
  for token in range(3, TARGET.vocab_size):
    reached = (outputs[:, 1:] == token).any(axis=1)
    if not (inputs == token).any() and 2 <= reached.sum() < len(reached) - 1:
      return token, reached
  raise AssertionError('no suitable token')


@pytest.mark.parametrize('gamma', [2, 3])
def test_nan_target_rows_stop_where_the_baseline_stops(gamma):
  # Rows that emit `token` read a NaN embedding at the next step, somewhere inside a
  # verify window; the tokens judged before it are kept, as the baseline keeps them.
  token, reached = _token_reached_mid_output()
  params = _with_nan_embedding(_target_params(), token)
  baseline = generate(params, _encoder_tokens(), config=TARGET, max_decode_length=MAX_LEN,
                      on_nonfinite='ignore')
  run = lambda action: speculative_generate(
      params, _draft_params(), _encoder_tokens(), target_config=TARGET,
      drafter=T5Drafter(DRAFT), spec=SpeculativeConfig(gamma=gamma),
      max_decode_length=MAX_LEN, on_nonfinite=action)
  rows = np.flatnonzero(reached).tolist()
  with pytest.raises(FloatingPointError, match=re.escape(f'rows {rows} of {len(reached)}')):
    run('raise')
  result = run('ignore')
  np.testing.assert_array_equal(result.output.nonfinite_logits, reached)
  np.testing.assert_array_equal(baseline.nonfinite_logits, reached)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  clean = np.asarray(_baseline().tokens)
  np.testing.assert_array_equal(np.asarray(result.output.tokens)[~reached], clean[~reached])
  for row in rows:  # Up to and including the token, then 0.
    end = int(np.argmax(clean[row, 1:] == token)) + 2
    np.testing.assert_array_equal(result.output.tokens[row, :end], clean[row, :end])
    np.testing.assert_array_equal(result.output.tokens[row, end:], 0)
  assert np.isfinite(float(result.stats.overlap_sum))


def test_nan_drafter_is_reported_not_accepted():
  # A NaN q passes the accept test (u >= NaN is False); the rows must stop instead.
  # The first call already verifies drafts, so every row stops before its first token.
  broken = _sampled_tiny_run('nan')
  np.testing.assert_array_equal(broken.output.tokens, 0)
  assert np.all(broken.output.nonfinite_logits)
  np.testing.assert_array_equal(broken.stats.verified_positions, 0)  # No verdict counted.


# ----------------------------------------------------------------------------------
# 9. Block verification and adaptive gamma (SpeculativeConfig.verification and
# draft_confidence_threshold) are exact by the same checks; the trace of a decode
# rebuilds its output.

OPTIONS = {
    'block': dict(verification='block'),
    'adaptive': dict(draft_confidence_threshold=0.5),
    'block_adaptive': dict(verification='block', draft_confidence_threshold=0.5),
}


def _rebuild_from_trace(trace, row):
  """The committed tokens of `row`, from its trace alone."""
  tokens = []
  for t in range(trace.committed.shape[1]):
    accepted = [int(x) for x in trace.drafts[row, t, :trace.num_accepted[row, t]]]
    tokens += (accepted + [int(trace.next_token[row, t])])[:int(trace.committed[row, t])]
  return tokens


def _check_trace(result, gamma, adaptive=False, cut_at_eos=True):
  """The trace rebuilds every row's output and agrees with the statistics. A row's
  proposal ends at its first drafted EOS (cut_at_eos; multi-draft trees keep gamma) and,
  with adaptive gamma, may end sooner."""
  trace = jax.tree_util.tree_map(np.asarray, result.trace)
  tokens, lengths = np.asarray(result.output.tokens), np.asarray(result.output.lengths)
  for row in range(tokens.shape[0]):
    assert _rebuild_from_trace(trace, row) == tokens[row, :lengths[row]].tolist(), row
  active = trace.committed > 0  # [b, L] iterations where the row committed
  drafted, accepted = trace.num_drafts[active], trace.num_accepted[active]
  assert np.all((drafted >= 1) & (drafted <= gamma) & (accepted <= drafted))
  if cut_at_eos:
    proposals = trace.drafts[active]  # [n, g]
    before_last = np.arange(gamma)[None, :] < drafted[:, None] - 1
    assert not np.any((proposals == EOS_ID) & before_last), 'drafts counted past an EOS'
    last = proposals[np.arange(len(drafted)), drafted - 1]
    if not adaptive:
      np.testing.assert_array_equal(last[drafted < gamma], EOS_ID)
  elif not adaptive:
    np.testing.assert_array_equal(drafted, gamma)
  # The draft steps of an iteration: the most drafts a decoding row proposed.
  assert int(result.stats.draft_calls) == trace.num_drafts.max(axis=0).sum()
  stats = result.stats
  np.testing.assert_array_equal(stats.num_drafted_counts,
                                np.bincount(drafted, minlength=gamma + 1))
  np.testing.assert_array_equal(stats.num_accepted_counts,
                                np.bincount(accepted, minlength=gamma + 1))
  assert int(stats.verified_positions) == np.minimum(accepted + 1, drafted).sum()


@functools.cache
def _option_greedy_run(option, drafter_name, gamma=3):
  drafter, drafter_params = _drafter_setup(drafter_name)
  return speculative_generate(
      _target_params(), drafter_params, _encoder_tokens(), target_config=TARGET,
      drafter=drafter, spec=SpeculativeConfig(gamma=gamma, **OPTIONS[option]),
      max_decode_length=MAX_LEN, record_trace=True)


@pytest.mark.parametrize('option', list(OPTIONS))
def test_greedy_options_equal_baseline(option):
  result = _option_greedy_run(option, 'near_copy')
  np.testing.assert_array_equal(result.output.tokens, _baseline().tokens)
  _assert_padded_after_eos(result.output)
  _check_trace(result, 3, adaptive='adaptive' in option)
  if option == 'block':
    # Greedy block verification keeps exactly token-wise verification's prefix.
    _assert_same_stats(result.stats, _greedy_run('near_copy', 3).stats)
    _check_stats(result, 3)
    assert _greedy_run('near_copy', 3).trace is None  # Off by default.


# name -> (case of SAMPLED_CASES or (sampling, gamma, length), option)
SAMPLED_OPTION_CASES = {
    'block_t1_gamma2': ('t1_gamma2', 'block'),
    'adaptive_t1_gamma3_len4': ((SamplingConfig(temperature=1.0), 3, 4), 'adaptive'),
}


@functools.cache
def _sampled_option_run(name):
  case, option = SAMPLED_OPTION_CASES[name]
  sampling, gamma, length = SAMPLED_CASES[case] if isinstance(case, str) else case
  result = speculative_generate(
      _small_target_params(), _small_draft_params(), _small_encoder_tokens(),
      jax.random.PRNGKey(5), target_config=SMALL, drafter=T5Drafter(SMALL),
      spec=SpeculativeConfig(gamma=gamma, **OPTIONS[option]), max_decode_length=length,
      sampling=sampling, record_trace=True)
  return result, sampling, gamma, length


@pytest.mark.parametrize('name', list(SAMPLED_OPTION_CASES))
def test_sampled_options_match_exact_distribution(name):
  result, sampling, gamma, length = _sampled_option_run(name)
  _assert_matches(result.output.tokens, *_exact_joint('target', sampling, length))
  _assert_padded_after_eos(result.output)
  _check_trace(result, gamma, adaptive='adaptive' in name)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[gamma] > 0
  drafted = np.asarray(result.stats.num_drafted_counts)
  if 'adaptive' in name:  # Rows stopped at every length, including the full gamma.
    assert np.all(drafted[1:] > 1000), drafted
  else:  # Proposals shorter than gamma end at a drafted EOS (_check_trace).
    assert drafted[0] == 0 and drafted[gamma] > 0, drafted


def test_sampled_block_accepts_more_than_token_wise():
  # Per iteration E[accepted] is larger for block verification on the same p and q.
  block = _sampled_option_run('block_t1_gamma2')[0].stats.num_accepted_counts
  token = _sampled_run('t1_gamma2').stats.num_accepted_counts
  def mean_and_error(counts):
    counts = np.asarray(counts, np.float64)
    values = np.arange(len(counts))
    mean = counts @ values / counts.sum()
    return mean, math.sqrt((counts @ (values - mean) ** 2) / counts.sum() / counts.sum())
  (block_mean, block_error), (token_mean, token_error) = map(mean_and_error, (block, token))
  assert block_mean > token_mean - 4 * math.hypot(block_error, token_error)


def test_option_values_are_checked():
  with pytest.raises(ValueError, match='verification'):
    SpeculativeConfig(verification='tree')
  with pytest.raises(ValueError, match='lenience'):
    SpeculativeConfig(verification='block', lenience=0.5)
  with pytest.raises(ValueError, match='draft_confidence_threshold'):
    SpeculativeConfig(draft_confidence_threshold=1.5)


# ----------------------------------------------------------------------------------
# Shorter verify steps (SpeculativeConfig.verify_lengths).

def _expected_target_positions(trace, gamma, verify_lengths):
  """The positions the verify steps must have run over, from the trace alone: per
  iteration the shortest of verify_lengths (else gamma + 1) holding x_length and the
  longest proposal of a decoding row."""
  lengths = np.array([*verify_lengths, gamma + 1])
  iterations = int(np.max(np.sum(trace.committed > 0, axis=1)))
  needed = np.asarray(trace.num_drafts)[:, :iterations].max(axis=0) + 1  # [iterations]
  return int(sum(lengths[np.argmax(lengths >= n)] for n in needed))


@pytest.mark.parametrize('verification, temperature',
                         [('token', 0.0), ('token', 1.0), ('coupled', 1.0)])
def test_shorter_verify_steps_change_nothing_but_the_positions_run(verification, temperature):
  # Each row alone (a batch of one: its proposals end at its drafted EOS), with the same
  # key with and without verify_lengths: every output, log-probability, statistic and
  # trace entry equal bit for bit (the positions a shorter step leaves out were never
  # proposed), and fewer target positions run.
  drafter, drafter_params = _drafter_setup('near_copy')
  spec = functools.partial(SpeculativeConfig, gamma=3, verification=verification)

  def run(row, verify_lengths):
    return speculative_generate(
        _target_params(), drafter_params, _encoder_tokens()[row:row + 1],
        jax.random.PRNGKey(row), target_config=TARGET, drafter=drafter,
        spec=spec(verify_lengths=verify_lengths), max_decode_length=MAX_LEN,
        sampling=SamplingConfig(temperature=temperature), record_trace=True)

  positions = {'full': 0, 'short': 0}
  for row in range(len(ENCODER_LENGTHS)):
    full, short = run(row, ()), run(row, (2, 3))
    for name, value in vars(full.output).items():
      np.testing.assert_array_equal(getattr(short.output, name), value, err_msg=name)
    for name, value in vars(full.trace).items():
      np.testing.assert_array_equal(getattr(short.trace, name), value, err_msg=name)
    for name, value in vars(full.stats).items():
      if name != 'target_positions':
        np.testing.assert_array_equal(getattr(short.stats, name), value, err_msg=name)
    assert int(full.stats.target_positions) == 4 * int(full.stats.target_calls)
    trace = jax.tree_util.tree_map(np.asarray, short.trace)
    assert int(short.stats.target_positions) == _expected_target_positions(trace, 3, (2, 3))
    positions['full'] += int(full.stats.target_positions)
    positions['short'] += int(short.stats.target_positions)
    if temperature == 0.0:
      np.testing.assert_array_equal(short.output.tokens[0], _baseline().tokens[row])
  assert positions['short'] < positions['full'], positions  # shorter steps ran


@pytest.mark.parametrize('lengths', ['2', (1,), (4,), (3, 2), (2, 2), (2.0,)])
def test_verify_lengths_are_checked(lengths):
  with pytest.raises(ValueError, match='verify_lengths must be a tuple of increasing integers'):
    SpeculativeConfig(gamma=3, verify_lengths=lengths)
  assert SpeculativeConfig(gamma=3, verify_lengths=[2, 3]).verify_lengths == (2, 3)  # gin's lists


def test_verify_lengths_above_gamma_say_to_leave_them_out():
  # The main job's config sets verify steps of 5 for gamma 9; --gin.GAMMA=3 over it.
  with pytest.raises(ValueError, match=r'got \(5,\); a length above gamma 3 is no shorter '
                     r'than a whole step \(4 positions\): leave it out'):
    SpeculativeConfig(gamma=3, verify_lengths=(5,))
  with pytest.raises(ValueError, match=r'got \(3, 2\)$'):
    SpeculativeConfig(gamma=3, verify_lengths=(3, 2))


def test_verify_lengths_refuse_token_trees():
  with pytest.raises(ValueError, match=r'cannot be combined with verify_lengths \(2,\)'):
    SpeculativeConfig(gamma=3, num_drafts=2, verify_lengths=(2,))


# ----------------------------------------------------------------------------------
# Rows and positions whose products are never used are marked for the kernels.


def test_the_loop_marks_what_the_kernels_may_skip(monkeypatch):
  """Traced once: every kernel product inside the loop runs under active_rows flags that
  follow the batch: the verify step's per row and position ([b, gamma + 1]), the drafter's
  per row ([b]). What the flags skip is never used: the identity tests above run with
  them."""
  from jaxspec.model.cpu import layout as kernel_layout  # pylint: disable=g-import-not-at-top
  from jaxspec.model.cpu import matmul as cpu_matmul  # pylint: disable=g-import-not-at-top
  seen = []
  row_flags = cpu_matmul.row_flags

  def recording(x):
    active = cpu_matmul._ACTIVE_ROWS.get()  # pylint: disable=protected-access
    seen.append((x.shape[:-1], None if active is None else tuple(active.shape)))
    return row_flags(x)

  monkeypatch.setattr(cpu_matmul, 'row_flags', recording)
  gamma, batch = 3, len(ENCODER_LENGTHS)
  drafter, params = _drafter_setup('random')
  loop = functools.partial(
      speculative._speculative_generate.__wrapped__,  # pylint: disable=protected-access
      target_config=TARGET, drafter=drafter, spec=SpeculativeConfig(gamma=gamma),
      max_decode_length=MAX_LEN, sampling=SamplingConfig(), eos_id=EOS_ID)
  # Both models in the kernels' layout, so every decode-step product goes through them.
  jax.make_jaxpr(loop)(kernel_layout.for_decoding(_target_params()),
                       kernel_layout.for_decoding(params), jnp.asarray(_encoder_tokens()),
                       jax.random.PRNGKey(0))  # traced afresh, not compiled
  marked = {(rows, active) for rows, active in seen if active is not None}
  assert ((batch, gamma + 1), (batch, gamma + 1)) in marked  # the verify step
  assert ((batch, 1), (batch,)) in marked  # the draft steps
  assert all(rows[:len(active)] == active for rows, active in marked)
