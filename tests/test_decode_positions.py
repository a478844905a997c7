"""T5Config.decode_positions: fixed-width target steps, so that on XLA's path (bfloat16,
accelerators) a verify step computes each position bit for bit as the baseline's
one-position steps do, and greedy speculative outputs stay the baseline's.

- The model: with a fixed width, logits of steps of any width up to it, with rollbacks
  and rows at different positions in between, equal one-position steps' bit for bit;
  without it they do not (the check has power).
- The attention with every key in its slot (written first, then attended) against numpy.
- End to end on the shipped pair in bfloat16: greedy speculative decoding is the
  baseline row for row with the setting, and is not without it.
- Settings: a width narrower than the verify step (speculative sampling or beam search),
  or a token tree, is refused by name.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import pairs
from jaxspec.config import get_config
from jaxspec.data import corpora
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.beam_search import BeamConfig
from jaxspec.decoding.drafters import Int8Drafter, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.speculative_beam import SpeculativeBeamConfig, speculative_beam_generate
from jaxspec.model import T5, init_params
from jaxspec.model.cache import rollback
from jaxspec.model.cpu import attention as cpu_attention

WIDTH = 4  # gamma 3
BFLOAT16_XLA = dict(dtype='bfloat16', param_dtype='bfloat16', cpu_matmul='xla')
# The shipped target's shapes, fewer layers: wide enough products that XLA rounds them
# differently for different numbers of rows.
CONFIG = get_config('local_target', num_encoder_layers=1, num_decoder_layers=2,
                    **BFLOAT16_XLA)


class _Model:
  """Random variables of `config` and two encoded inputs; jitted steps, as a loop runs
  them."""

  def __init__(self, config, seed=0):
    self.model = T5(config)
    self.params = init_params(config, jax.random.PRNGKey(seed))
    encoder_tokens = jnp.asarray(
        np.random.default_rng(seed).integers(2, config.vocab_size, (2, 7)), jnp.int32)
    encoded = self.model.apply(self.params, encoder_tokens, method=T5.encode)
    self.cache = self.model.apply(self.params, encoded, encoder_tokens, 16,
                                  method=T5.init_cache)
    self._decode = jax.jit(lambda params, tokens, cache: self.model.apply(
        params, tokens, cache, method=T5.decode))

  def decode(self, tokens, cache):
    return self._decode(self.params, tokens, cache)


def _one_position_logits(config, sequences):
  """Logits [b, n, v] of sequences [b, n] (b <= 2) decoded one position a step."""
  model = _Model(config)
  cache, logits = _rows(model.cache, len(sequences)), []
  for i in range(sequences.shape[1]):
    step, cache = model.decode(sequences[:, i:i + 1], cache)
    logits.append(step[:, 0])
  return np.stack(logits, axis=1)


def _rows(cache, rows):
  return jax.tree_util.tree_map(lambda x: x[:rows], cache)


def _speculative_like_logits(config, sequences):
  """The logits of sequences [b, 8] (b <= 2) decoded as a verify loop would: steps of
  1 to 4 positions with junk after each row's kept tokens, rolled back, two rows at
  different positions -> [b, 8, v] of the kept positions."""
  model = _Model(config)
  batch = len(sequences)
  cache = _rows(model.cache, batch)
  junk = jnp.full((4,), 7, jnp.int32)
  row0, row1 = sequences[0], sequences[-1]
  # (tokens of row 0, tokens of row 1, how many each row keeps)
  steps = [(row0[0:4], jnp.concatenate([row1[0:2], junk[:2]]), (4, 2)),
           (row0[4:6], row1[2:4], (2, 2)),
           (jnp.concatenate([row0[6:7], junk[:3]]), row1[4:8], (1, 4)),
           (jnp.concatenate([row0[7:8], junk[:1]]), junk[:2], (1, 0))]
  kept = [[], []]
  for tokens0, tokens1, keep in steps:
    start = cache.end_index
    logits, cache = model.decode(jnp.stack([tokens0, tokens1])[:batch], cache)
    for row in range(batch):
      kept[row] += [logits[row, j] for j in range(keep[row])]
    cache = rollback(cache, start + jnp.asarray(keep[:batch]))
  return np.stack([np.stack(rows) for rows in kept[:batch]])


@pytest.mark.parametrize('batch', [1, 2])  # a window written in place; scatters
def test_steps_of_any_width_round_as_one_position_steps(batch):
  sequences = jnp.asarray(
      np.random.default_rng(3).integers(2, CONFIG.vocab_size, (batch, 8)), jnp.int32)
  fixed = CONFIG.replace(decode_positions=WIDTH)
  np.testing.assert_array_equal(_speculative_like_logits(fixed, sequences),
                                _one_position_logits(fixed, sequences))
  free = _speculative_like_logits(CONFIG, sequences)
  np.testing.assert_allclose(free, _one_position_logits(fixed, sequences), atol=0.1)
  if batch == 1:  # As wide as their tokens, the steps round differently: power.
    assert not np.array_equal(free, _one_position_logits(CONFIG, sequences))


def test_a_padded_step_advances_the_cache_by_its_own_tokens():
  model = _Model(CONFIG.replace(decode_positions=WIDTH))
  logits, cache = model.decode(jnp.ones((2, 3), jnp.int32), model.cache)
  assert logits.shape == (2, 3, CONFIG.vocab_size)
  np.testing.assert_array_equal(cache.end_index, [3, 3])
  # Near the buffer's end the padding's slots are dropped, the tokens' kept.
  cache = rollback(cache, jnp.asarray([14, 15]))
  logits, cache = model.decode(jnp.ones((2, 1), jnp.int32), cache)
  assert np.all(np.isfinite(logits))
  np.testing.assert_array_equal(cache.end_index, [15, 16])


def _keys_in_slots(buffer, new, starts):
  """numpy: buffer [b, h, d, L] with new [b, t, h, d] at slots starts[b] + j, those past
  L dropped."""
  expected = np.array(buffer, copy=True)
  for b, start in enumerate(np.asarray(starts)):
    for j in range(new.shape[1]):
      if start + j < buffer.shape[3]:
        expected[b, :, :, start + j] = np.asarray(new)[b, j]
  return expected


@pytest.mark.parametrize('starts', [[3, 6], [2, 10], [10]])
def test_attention_with_keys_in_slots_is_attention_after_the_write(starts):
  """Rows at different slots, a row whose last new key falls past the buffer (dropped),
  and one row (the buffers' window write)."""
  rng = np.random.default_rng(len(starts) + starts[0])
  b, t, h, d, length = len(starts), 3, 2, 8, 12
  query, new_keys, new_values = (jnp.asarray(rng.standard_normal((b, t, h, d)), jnp.float32)
                                 for _ in range(3))
  keys, values = (jnp.asarray(rng.standard_normal((b, h, d, length)), jnp.float32)
                  for _ in range(2))
  starts = jnp.asarray(starts)
  positions = starts[:, None] + jnp.arange(t)[None, :]  # [b, t]
  bias = jnp.where(jnp.arange(length)[None, None, :] <= positions[:, :, None], 0.0,
                   -1e10)[:, None]  # [b, 1, t, L]
  out, written_keys, written_values = cpu_attention.xla_attend_and_write(
      query, new_keys, new_values, keys, values, bias, starts, keys_in_slots=True)
  reference_keys = _keys_in_slots(keys, new_keys, starts)
  reference_values = _keys_in_slots(values, new_values, starts)
  np.testing.assert_array_equal(written_keys, reference_keys)
  np.testing.assert_array_equal(written_values, reference_values)
  logits = np.einsum('bthd,bhds->bhts', query, reference_keys) + bias
  weights = np.exp(logits - logits.max(-1, keepdims=True))
  weights /= weights.sum(-1, keepdims=True)
  np.testing.assert_allclose(out, np.einsum('bhts,bhds->bthd', weights, reference_values),
                             rtol=1e-5, atol=1e-5)


@pytest.fixture(scope='module')
def shipped_bfloat16():
  pair = pairs.load('ende_local', 'small', dtype='bfloat16')
  examples = corpora.load_split(pair.task, 'validation')[:64]
  inputs = pair.encode([example['inputs'] for example in examples])
  return pair, inputs


def _greedy(pair, inputs, width, drafter=None, draft_params=None, batch=1):
  target_config = pair.target_config.replace(cpu_matmul='xla', decode_positions=width)
  if drafter is None:
    drafter = T5Drafter(pair.draft_config.replace(cpu_matmul='xla'))
    draft_params = pair.draft_params
  baseline, speculative = [], []
  for i in range(0, len(inputs), batch):
    rows = inputs[i:i + batch]
    baseline.append(np.asarray(generate(
        pair.target_params, rows, config=target_config,
        max_decode_length=pair.max_decode_length).tokens))
    speculative.append(np.asarray(speculative_generate(
        pair.target_params, draft_params, rows, target_config=target_config,
        drafter=drafter, spec=SpeculativeConfig(gamma=WIDTH - 1),
        max_decode_length=pair.max_decode_length).output.tokens))
  return np.concatenate(baseline), np.concatenate(speculative)


def test_greedy_speculative_is_the_baseline_in_bfloat16_with_fixed_width_steps(
    shipped_bfloat16):
  pair, inputs = shipped_bfloat16
  baseline, speculative = _greedy(pair, inputs, WIDTH)
  np.testing.assert_array_equal(speculative, baseline)
  # Steps as wide as their tokens: some row breaks a near-tie the other way.
  baseline, speculative = _greedy(pair, inputs, 0)
  assert not np.array_equal(speculative, baseline)


def test_the_int8_draft_at_batch_4_is_the_baseline_in_bfloat16(shipped_bfloat16):
  pair, inputs = shipped_bfloat16
  target_config = pair.target_config.replace(cpu_matmul='xla', decode_positions=WIDTH)
  drafter = Int8Drafter(target_config)
  baseline, speculative = _greedy(pair, inputs[:32], WIDTH, drafter,
                                  drafter.draft_params(pair.target_params), batch=4)
  np.testing.assert_array_equal(speculative, baseline)


def test_settings_that_would_lose_the_identity_are_refused():
  config = get_config('test_tiny_1_1', decode_positions=WIDTH)
  draft = get_config('test_tiny_1_0')
  tokens = np.ones((1, 4), np.int32)
  target_params = init_params(config, jax.random.PRNGKey(0))
  draft_params = init_params(draft, jax.random.PRNGKey(1))
  with pytest.raises(ValueError, match=r'decode_positions \(4\) is narrower than the '
                     r"target's verify step of 6 positions"):
    speculative_generate(target_params, draft_params, tokens, target_config=config,
                         drafter=T5Drafter(draft), spec=SpeculativeConfig(gamma=5),
                         max_decode_length=8)
  with pytest.raises(ValueError, match='token tree of num_drafts=2'):
    speculative_generate(target_params, draft_params, tokens, target_config=config,
                         drafter=T5Drafter(draft), spec=SpeculativeConfig(gamma=1, num_drafts=2),
                         max_decode_length=8)
  with pytest.raises(ValueError, match=r'decode_positions \(4\) is narrower than the '
                     r"target's verify step of 6 positions"):
    speculative_beam_generate(target_params, draft_params, tokens, target_config=config,
                              draft_config=draft, beam=BeamConfig(num_beams=2),
                              spec=SpeculativeBeamConfig(gamma=5), max_decode_length=8)
  with pytest.raises(ValueError, match='decode_positions must be >= 0'):
    get_config('test_tiny_1_1', decode_positions=-1)


def test_coupled_sampling_keeps_the_baselines_draws_in_bfloat16(shipped_bfloat16):
  """Coupled verification draws each position with the baseline's noise: with the target's
  logits bit for bit the baseline's, sampled outputs are the baseline's too."""
  from jaxspec.sampling import SamplingConfig  # pylint: disable=import-outside-toplevel
  pair, inputs = shipped_bfloat16
  config = pair.target_config.replace(cpu_matmul='xla', decode_positions=WIDTH)
  sampling = SamplingConfig(temperature=1.0)
  rows = inputs[:16]
  baseline = generate(pair.target_params, rows, jax.random.PRNGKey(7), config=config,
                      max_decode_length=pair.max_decode_length, sampling=sampling)
  result = speculative_generate(
      pair.target_params, pair.draft_params, rows, jax.random.PRNGKey(7), target_config=config,
      drafter=T5Drafter(pair.draft_config.replace(cpu_matmul='xla')),
      spec=SpeculativeConfig(gamma=WIDTH - 1, verification='coupled'),
      max_decode_length=pair.max_decode_length, sampling=sampling)
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
