"""The baseline decoder against independent references.

T5X semantics are checked with a table-driven `tokens_to_logits` (next-token logits
depend only on the current token) against a plain numpy rollout; `generate` on a T5
is checked against a teacher-forced argmax rollout of the full forward pass.
"""

import functools

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


# T5X's arguments, each against T5X's documented behaviour (tests/test_t5x_real.py
# compares the same arguments with a real t5x install).


def _chain_table():
  """Greedy successor of token t is t + 1 for 2..5, of 6, 0 and EOS it is 2."""
  table = np.full((VOCAB, VOCAB), -5.0, np.float32)
  for token in range(VOCAB):
    table[token, 2 + (token - 1) % 5 if token else 2] = 5.0
  return table


def test_initial_index_starts_each_row_at_its_prompt_end():
  """T5X's Example 3: uneven prompts after a prefilled cache; a prompt may end in EOS."""
  table = _chain_table()
  inputs = np.array([[0, 5, 2, 6, 1, 0], [0, 4, 1, 0, 0, 0], [0, 3, 0, 0, 0, 0]], np.int32)
  decodes, _ = baseline.temperature_sample(
      jnp.asarray(inputs), jnp.zeros((3,)), _table_tokens_to_logits(table), EOS,
      temperature=0.0,
      initial_index=jnp.array([4, 2, 1]))
  # Row 0 feeds its last prompt token (EOS, which does not end it) and fills 1 slot;
  # rows end at the decode length L, not at an EOS their prompt already holds.
  np.testing.assert_array_equal(np.asarray(decodes[:, 0]), [
      [5, 2, 6, 1, 2, 3], [4, 1, 2, 3, 4, 5], [3, 4, 5, 6, 2, 3]])


def test_prefill_in_one_step_equals_forcing_the_prompt_token_by_token(tiny_t5):
  config, params = tiny_t5
  model = T5(config)
  encoder_tokens = jnp.array([[5, 6, 7, EOS], [9, 10, EOS, 0], [3, EOS, 0, 0]])
  inputs = jnp.array([[0, 7, 8, 9, 0, 0, 0, 0], [0, 4, 0, 0, 0, 0, 0, 0],
                      [0, 0, 0, 0, 0, 0, 0, 0]])

  @functools.partial(jax.jit, static_argnums=0)  # One program each, encoder included.
  def decode(prefill: bool, params):
    encoded = model.apply(params, encoder_tokens, method=T5.encode)
    cache = model.apply(params, encoded, encoder_tokens, 8, method=T5.init_cache)
    initial_index = None
    if prefill:
      cache, initial_index = baseline.prefill_decoder_prompt(params, inputs, cache,
                                                             config=config)
    def tokens_to_logits(state):
      logits, cache = model.apply(params, state.cur_token, state.cache, method=T5.decode)
      return logits[:, 0], cache
    decodes, _ = baseline.temperature_sample(
        inputs, cache, tokens_to_logits, EOS, temperature=0.0, initial_index=initial_index,
        max_decode_steps=4)
    return decodes[:, 0]

  forced, prefilled = np.asarray(decode(False, params)), np.asarray(decode(True, params))
  np.testing.assert_array_equal(prefilled, forced)
  np.testing.assert_array_equal(forced[0, :3], [7, 8, 9])  # prompts kept
  assert forced[1, 0] == 4
  # At most 4 tokens after each prompt, then 0 (or 0 after an earlier EOS).
  np.testing.assert_array_equal(forced[[0, 1, 2], [7, 5, 4]], 0)
  assert np.count_nonzero(forced[:, 3:]) > 0


def test_max_decode_steps_zero_hard_limit_and_too_many_steps():
  table = _chain_table()
  table[:, EOS] = -100.0
  inputs = jnp.array([[0, 0, 0, 0, 0], [0, 4, 5, 0, 0]])
  run = lambda **kwargs: np.asarray(baseline.temperature_sample(
      inputs, jnp.zeros((2,)), _table_tokens_to_logits(table), EOS, temperature=0.0,
      **kwargs)[0][:, 0])
  # T5X quirk kept: at max_decode_steps=0 a row without prompt still draws one token at
  # position 1, which a later step of the batch overwrites with 0 if other rows go on.
  np.testing.assert_array_equal(run(max_decode_steps=0), [[0, 0, 0, 0, 0], [4, 5, 0, 0, 0]])
  alone = baseline.temperature_sample(inputs[:1], jnp.zeros((1,)),
                                      _table_tokens_to_logits(table), EOS, temperature=0.0,
                                      max_decode_steps=0)[0]
  np.testing.assert_array_equal(np.asarray(alone[:, 0]), [[2, 0, 0, 0, 0]])
  np.testing.assert_array_equal(run(max_decode_steps=3, max_decode_steps_hard_limit=1),
                                [[2, 0, 0, 0, 0], [4, 5, 6, 0, 0]])
  np.testing.assert_array_equal(run(max_decode_steps=3, max_decode_steps_hard_limit=0),
                                [[2, 3, 4, 0, 0], [4, 5, 6, 2, 3]])
  with pytest.raises(ValueError, match='max_decode_steps .* exceeds the decode length 5'):
    run(max_decode_steps=6)


def test_topk_and_topp_together_are_refused_unless_traced():
  table = _table()
  run = lambda topk, topp: baseline.temperature_sample(
      jnp.zeros((1, 4), jnp.int32), jnp.zeros((1,)), _table_tokens_to_logits(table), EOS,
      temperature=1.0, topk=topk, topp=topp)
  with pytest.raises(ValueError, match=r'at most one of topk \(2\) and topp \(0.5\)'):
    run(2, 0.5)
  jax.jit(run)(2, 0.5)  # Traced values are not checked, as in T5X.


def _sample(table, inputs, **kwargs):
  return baseline.temperature_sample(
      inputs, jnp.zeros((inputs.shape[0],)), _table_tokens_to_logits(table), EOS,
      decode_rng=jax.random.PRNGKey(7), **kwargs)


def test_traced_settings_draw_what_static_ones_draw():
  table = _table(6, scale=1.0)
  inputs = jnp.zeros((3, 6), jnp.int32)
  for settings in (dict(temperature=0.6, topk=3, topp=0.0),
                   dict(temperature=1.3, topk=0, topp=0.8),
                   dict(temperature=0.0, topk=0, topp=0.0)):
    static = _sample(table, inputs, num_decodes=2, **settings)
    # T5X quirk: a traced topp of 0 masks every token (uniform sampling), so topp is
    # traced only where it is on.
    traced_topp = settings['topp'] > 0
    traced = jax.jit(lambda t, k, p: _sample(
        table, inputs, num_decodes=2, temperature=t, topk=k,
        topp=p if traced_topp else settings['topp']))(*settings.values())
    np.testing.assert_array_equal(np.asarray(traced[0]), np.asarray(static[0]))
    np.testing.assert_allclose(np.asarray(traced[1]), np.asarray(static[1]), rtol=1e-6)


def test_per_row_temperature_and_topp():
  table = _table(7, scale=1.0)
  table[:, EOS] -= 100.0
  inputs = jnp.zeros((3, 6), jnp.int32)
  decodes, scores = _sample(table, inputs, num_decodes=4, topk=0,
                            temperature=jnp.array([0.0, 1.0, 1.0]),
                            topp=jnp.array([1.0, 1.0, 1e-6]))
  decodes = np.asarray(decodes)
  greedy = _numpy_greedy(table, np.zeros((1, 6), np.int32))[0]
  np.testing.assert_array_equal(decodes[0], [greedy] * 4)  # temperature 0: argmax
  np.testing.assert_array_equal(decodes[2], [greedy] * 4)  # topp ~0: the top token
  np.testing.assert_array_equal(np.asarray(scores)[[0, 2]], 0.0)  # prob 1 after rescaling
  # T5X quirk kept: per-row temperatures reuse one key for every row, so the copies of an
  # input (equal logits) draw equal tokens.
  assert len({tuple(row) for row in decodes[1]}) == 1 and not np.array_equal(
      decodes[1, 0], greedy)
  with pytest.raises(ValueError, match=r'temperature must be a scalar or one value per '
                                       r'input row, shape \(3,\)'):
    _sample(table, inputs, temperature=jnp.ones((2,)))


def test_callbacks_see_t5x_loop_state_and_state_edits_are_honoured():
  table = _chain_table()
  table[:, EOS] = -100.0
  seen = {}

  def state_callback(state):
    # Force token 6 at position 3 (a free position) before step 1 runs.
    assert state.sequences.shape == (2, 8 + 2) and state.ended.shape == (2, 1)
    forced = state.sequences.at[:, 3].set(jnp.where(state.step == 1, 6, state.sequences[:, 3]))
    return state.replace(sequences=forced)

  def logit_callback(logits, state):
    seen['fields'] = (state.step.shape, state.cur_index.shape, state.cur_token.shape,
                      state.log_prob.shape)
    return logits.at[:, 5].add(jnp.where(state.step == 3, 100.0, 0.0))  # step 3 draws 5

  decodes, _ = baseline.temperature_sample(
      jnp.zeros((2, 8), jnp.int32), jnp.zeros((2,)), _table_tokens_to_logits(table), EOS,
      temperature=0.0, state_callback_fn=state_callback, logit_callback_fn=logit_callback)
  # 2, 3 (free), 6 (forced by the edit), 5 (logit callback), then the chain from 5.
  np.testing.assert_array_equal(np.asarray(decodes[:, 0]), [[2, 3, 6, 5, 6, 2, 3, 4]] * 2)
  assert seen['fields'] == ((), (2,), (2, 1), (2,))


def test_num_decodes_repeats_cache_rows_in_place_as_t5x():
  """tokens_to_logits sees [b * n, ...] cache leaves, each input's copies adjacent."""
  batch, n = 2, 3
  shapes = {}

  def decode(cache, leaf, cache_offset):
    def tokens_to_logits(state):
      shapes.update(jax.tree_util.tree_map(lambda x: x.shape, state.cache))
      token = leaf(state.cache)  # [b * n]: the next token names the cache row seen
      return jax.nn.one_hot(token, VOCAB) * 10.0, state.cache
    decodes, _ = baseline.temperature_sample(
        jnp.zeros((batch, 1), jnp.int32), cache, tokens_to_logits, EOS, num_decodes=n,
        temperature=0.0, cache_offset=cache_offset)
    return np.asarray(decodes[:, :, 0])

  cache = {'decoder': {'rows': jnp.array([[2, 0], [3, 0]]),  # [b, 2]
                       'cache_index': jnp.zeros((), jnp.int32),  # shared, as T5X
                       'cached_bias': jnp.ones((1, 4))}}  # shared, as T5X
  np.testing.assert_array_equal(decode(cache, lambda c: c['decoder']['rows'][:, 0], 0),
                                [[2, 2, 2], [3, 3, 3]])
  assert shapes['decoder'] == {'rows': (6, 2), 'cache_index': (), 'cached_bias': (1, 4)}
  scanned = {'keys': jnp.array([[0, 0], [2, 3]])}  # [layers, b]: scanned layers
  np.testing.assert_array_equal(decode(scanned, lambda c: c['keys'][1], 1),
                                [[2, 2, 2], [3, 3, 3]])
  assert shapes['keys'] == (2, 6)


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
