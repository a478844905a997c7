"""The baseline decoder against independent references.

T5X semantics are checked with a table-driven `tokens_to_logits` (next-token logits
depend only on the current token) against a plain numpy rollout; `generate` on a T5
is checked against a teacher-forced argmax rollout of the full forward pass.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config
from jaxspec.decoding import baseline
from jaxspec.model import T5, init_params
from jaxspec.sampling import SamplingConfig

EOS = 1
VOCAB = 7


def _table(seed=0, scale=3.0):
  """Next-token logits [v, v] given the current token; rows are distinct."""
  return np.random.RandomState(seed).randn(VOCAB, VOCAB).astype(np.float32) * scale


def _table_tokens_to_logits(table):
  table = jnp.asarray(table)

  def tokens_to_logits(state):
    # The cache counts calls per row, to check it is threaded through the loop.
    return table[state.cur_token[:, 0]], state.cache + 1
  return tokens_to_logits


def _numpy_greedy(table, prompt, eos=EOS):
  """Reference rollout: argmax of table[current], forced prompt tokens, stop at EOS."""
  batch, length = prompt.shape
  out = np.zeros((batch, length), np.int32)
  for b in range(batch):
    current, ended = prompt[b, 0], False
    for i in range(length):
      forced = prompt[b, i + 1] if i + 1 < length else 0
      if ended:
        token = 0
      elif forced:
        token = forced
      else:
        token = int(np.argmax(table[current]))
        ended = token == eos
      out[b, i] = token
      current = token
  return out


def test_greedy_matches_numpy_rollout_with_prompts_and_eos():
  table = _table()
  table[:, EOS] -= 100.0  # No EOS at first ...
  table[4, EOS] += 200.0  # ... except right after token 4.
  prompt = np.zeros((3, 9), np.int32)
  prompt[1, 1:3] = [4, 5]  # A forced prompt whose first token would trigger EOS.
  prompt[2, 1] = 3
  cache = jnp.zeros((3,), jnp.int32)
  decodes, scores = baseline.temperature_sample(
      jnp.asarray(prompt), cache, _table_tokens_to_logits(table), EOS, temperature=0.0)
  expected = _numpy_greedy(table, prompt)
  np.testing.assert_array_equal(np.asarray(decodes[:, 0]), expected)
  np.testing.assert_array_equal(np.asarray(scores), 0.0)  # Argmax with rescaled scores.


def test_row_stops_at_first_eos_and_pads_zero():
  table = np.full((VOCAB, VOCAB), -10.0, np.float32)
  table[0, 3] = table[3, 5] = table[5, EOS] = table[EOS, 4] = 10.0
  decodes, _ = baseline.temperature_sample(
      jnp.zeros((2, 8), jnp.int32), jnp.zeros((2,)), _table_tokens_to_logits(table), EOS,
      temperature=0.0)
  np.testing.assert_array_equal(np.asarray(decodes[:, 0]), [[3, 5, EOS, 0, 0, 0, 0, 0]] * 2)


def _log_softmax(x):
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


@pytest.mark.parametrize('rescale', [True, False])
def test_num_decodes_scores_are_sums_of_token_log_probs_sorted_best_last(rescale):
  table = _table(1, scale=1.0)
  table[:, EOS] -= 100.0
  temperature = 0.8
  decodes, scores = baseline.temperature_sample(
      jnp.zeros((2, 6), jnp.int32), jnp.zeros((2,)), _table_tokens_to_logits(table), EOS,
      decode_rng=jax.random.PRNGKey(3), num_decodes=5, temperature=temperature, topk=0,
      rescale_log_probs=rescale)
  decodes, scores = np.asarray(decodes), np.asarray(scores)
  assert decodes.shape == (2, 5, 6) and scores.shape == (2, 5)
  source = _log_softmax(table / temperature if rescale else table)
  for b in range(2):
    for n in range(5):
      previous = np.concatenate([[0], decodes[b, n, :-1]])
      expected = source[previous, decodes[b, n]].sum()
      np.testing.assert_allclose(scores[b, n], expected, rtol=1e-5, atol=1e-5)
    assert np.all(np.diff(scores[b]) >= 0)


def test_topk_one_is_greedy_and_top_p_small_is_greedy():
  table = _table(2)
  prompt = jnp.zeros((2, 6), jnp.int32)
  expected = _numpy_greedy(table, np.zeros((2, 6), np.int32))
  for kwargs in (dict(topk=1), dict(topk=0, topp=1e-6)):
    decodes, _ = baseline.temperature_sample(
        prompt, jnp.zeros((2,)), _table_tokens_to_logits(table), EOS,
        decode_rng=jax.random.PRNGKey(0), temperature=1.0, **kwargs)
    np.testing.assert_array_equal(np.asarray(decodes[:, 0]), expected)


def test_max_decode_steps_counts_after_the_prompt():
  table = _table(3)
  table[:, [0, EOS]] -= 100.0  # Neither padding nor EOS: every free step is non-zero.
  prompt = np.zeros((2, 10), np.int32)
  prompt[1, 1:4] = [2, 3, 4]
  decodes, _ = baseline.temperature_sample(
      jnp.asarray(prompt), jnp.zeros((2,)), _table_tokens_to_logits(table), EOS,
      temperature=0.0, max_decode_steps=2)
  decodes = np.asarray(decodes[:, 0])
  assert np.count_nonzero(decodes[0]) == 2 and np.all(decodes[0, 2:] == 0)
  np.testing.assert_array_equal(decodes[1, :3], [2, 3, 4])
  assert np.count_nonzero(decodes[1]) == 5 and np.all(decodes[1, 5:] == 0)


def test_sampled_first_token_follows_softmax():
  table = _table(4, scale=1.0)
  rows = 20000
  decodes, _ = baseline.temperature_sample(
      jnp.zeros((rows, 1), jnp.int32), jnp.zeros((rows,)), _table_tokens_to_logits(table),
      EOS, decode_rng=jax.random.PRNGKey(5), temperature=1.0, topk=0)
  counts = np.bincount(np.asarray(decodes[:, 0, 0]), minlength=VOCAB)
  expected = np.exp(_log_softmax(table[0])) * rows
  chi_square = np.sum((counts - expected) ** 2 / expected)
  assert chi_square < 22.46  # 99.9% quantile of chi-square with 6 degrees of freedom.


def test_rows_samples_do_not_depend_on_other_rows():
  table = _table(5, scale=1.0)
  keys = jax.random.split(jax.random.PRNGKey(0), 4)
  run = lambda k: baseline._sample_loop(
      jnp.zeros((k.shape[0], 8), jnp.int32), jnp.zeros((k.shape[0],)),
      lambda s: (jnp.asarray(table)[s.cur_token[:, 0]], s.cache), k,
      jnp.full((k.shape[0],), 8, jnp.int32), SamplingConfig(1.0), EOS, True)[0]
  full = np.asarray(run(keys))
  reordered = np.asarray(run(keys[jnp.array([3, 1])]))
  np.testing.assert_array_equal(reordered, full[[3, 1]])


def test_unsupported_t5x_arguments_are_refused():
  with pytest.raises(ValueError, match='cache_offset'):
    baseline.temperature_sample(jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,)),
                                _table_tokens_to_logits(_table()), EOS, cache_offset=2)


@pytest.fixture(scope='module')
def tiny_t5():
  config = get_config('test_tiny_1_1')
  return config, init_params(config, jax.random.PRNGKey(0))


def test_generate_equals_teacher_forced_argmax_rollout(tiny_t5):
  """The cached loop against the full forward pass, re-run from scratch per step."""
  config, params = tiny_t5
  encoder_tokens = jnp.array([[5, 6, 7, 8, 9, EOS], [9, 10, EOS, 0, 0, 0], [3, EOS, 0, 0, 0, 0]])
  length = 10
  out = baseline.generate(params, encoder_tokens, config=config, max_decode_length=length)
  forward = jax.jit(lambda dec: T5(config).apply(params, encoder_tokens, dec))
  decoder_inputs = np.zeros((3, length), np.int32)
  expected = np.zeros((3, length), np.int32)
  for i in range(length):
    logits = np.asarray(forward(jnp.asarray(decoder_inputs)))
    expected[:, i] = logits[:, i].argmax(-1)
    if i + 1 < length:
      decoder_inputs[:, i + 1] = expected[:, i]
  ended = np.cumsum(np.cumsum(expected == EOS, axis=1), axis=1) > 1  # Past the first EOS.
  expected[ended] = 0
  np.testing.assert_array_equal(np.asarray(out.tokens), expected)
  has_eos = (expected == EOS).any(1)
  np.testing.assert_array_equal(np.asarray(out.lengths),
                                np.where(has_eos, (expected == EOS).argmax(1) + 1, length))


def test_generate_is_one_while_loop_without_host_callbacks(tiny_t5):
  config, params = tiny_t5
  encoder_tokens = jnp.array([[5, 6, EOS]])
  jaxpr = jax.make_jaxpr(lambda p, e: baseline.generate(
      p, e, config=config, max_decode_length=4))(params, encoder_tokens)
  text = str(jaxpr)
  assert text.count('while[') == 1
  assert 'callback' not in text


# Non-finite logits: flagged on device, reported after the jit, never sampled from.


def _nan_params(params):
  return jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), params)


def test_nan_params_are_reported_naming_the_rows(tiny_t5):
  config, params = tiny_t5
  encoder_tokens = jnp.array([[5, 6, EOS], [9, EOS, 0], [3, EOS, 0]])
  decode = lambda action: baseline.generate(
      _nan_params(params), encoder_tokens, config=config, max_decode_length=6,
      sampling=SamplingConfig(temperature=1.0), on_nonfinite=action)
  with pytest.raises(FloatingPointError, match=r'non-finite logits .* rows \[0, 1, 2\] of 3'):
    decode('raise')
  with pytest.warns(RuntimeWarning, match=r'rows \[0, 1, 2\]'):
    out = decode('warn')
  np.testing.assert_array_equal(out.nonfinite_logits, True)
  np.testing.assert_array_equal(out.tokens, 0)  # Nothing sampled from NaN.
  np.testing.assert_array_equal(out.log_prob, 0.0)
  with pytest.raises(ValueError, match='on_nonfinite'):
    baseline.generate(params, encoder_tokens, config=config, max_decode_length=6,
                      on_nonfinite='skip')


def test_nan_logits_stop_only_their_row_and_minus_inf_is_a_mask():
  table = _table(3)
  table[:, EOS] -= 100.0  # Rows run to the end unless they reach token 2.
  table[:, 6] = -np.inf  # A legal mask: never flagged, never drawn.
  table[2] = np.nan  # The step after token 2 has NaN logits.
  prompt = np.zeros((VOCAB, 8), np.int32)
  prompt[:, 0] = np.arange(VOCAB)  # Row r starts from token r.
  sequences, _, nonfinite = baseline._sample_loop(
      jnp.asarray(prompt), jnp.zeros((VOCAB,)), _table_tokens_to_logits(table),
      jax.random.split(jax.random.PRNGKey(0), VOCAB), jnp.full((VOCAB,), 7, jnp.int32),
      SamplingConfig(0.0), EOS, True)
  # Reference: the numpy rollout, cut after the first step that reads table[2].
  expected = _numpy_greedy(np.nan_to_num(table, nan=0.0, neginf=-1e9), prompt)[:, :7]
  inputs = np.concatenate([prompt[:, :1], expected[:, :-1]], axis=1)  # token before each
  reads_nan = np.cumsum(inputs == 2, axis=1) > 0
  expected[reads_nan] = 0
  np.testing.assert_array_equal(np.asarray(sequences)[:, :7], expected)
  np.testing.assert_array_equal(nonfinite, reads_nan.any(axis=1))
  assert 0 < reads_nan.any(axis=1).sum() < VOCAB and not (expected == 6).any()
