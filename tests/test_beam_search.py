"""Beam search against T5X's documented behaviour and an exhaustive enumeration.

The T5X cases are the situations t5x/decoding_test.py's beam tests describe (a
first-order Markov toy with a tie, forced prompts, min_log_prob, max_decode_step),
with the outcomes T5X documents for them. On a tiny T5, a beam wide enough to keep
every candidate turns beam search into exhaustive search, so its finished set must be
the best EOS-terminated sequences of all, scored by teacher-forced log-probs over the
brevity penalty, enumerated here in numpy.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config
from jaxspec.decoding import beam_search as bs
from jaxspec.model import T5, init_params

EOS = 1


def _constant_logits(rows, beams):
  """tokens_to_logits returning the same logits rows [B, V] at every step."""
  rows = np.asarray(rows, np.float32)

  def tokens_to_logits(state):
    return jnp.asarray(np.repeat(rows, beams, axis=0)), state.cache
  return tokens_to_logits


def test_markov_toy_finds_both_tied_best_paths():
  # States PAD, A, B, START, END; edge potentials alternate so that START-AABBA-END
  # and START-BBAAB-END tie for the best score (T5X's test_beam_search).
  batch, beams, length = 2, 2, 7
  names = ['PAD', 'A', 'B', 'START-', '-END']
  ab = np.array([[[1, -1], [-1, 1]], [[-1, 1], [1, -1]]] * 2, np.float32)
  edges = np.full((6, 5, 5), bs.NEG_INF_VALUE, np.float32)
  edges[1:5, 1:3, 1:3] = ab
  edges[0, 3, 1:3] = 0  # START -> A or B
  edges[5, 1:3, 4] = 0  # A or B -> END
  edges[:, 0, :] = 0
  first = np.array([bs.NEG_INF_VALUE] * 3 + [0, bs.NEG_INF_VALUE], np.float32)

  def tokens_to_logits(state):
    step = state.cache['step']  # [B * beams, 1]
    potentials = jnp.asarray(edges)[jnp.maximum(step[:, 0] - 1, 0)]  # [B*k, 5, 5]
    logits = potentials[jnp.arange(batch * beams), state.cur_token[:, 0]]
    logits = jnp.where(step == 0, jnp.asarray(first), logits)
    return logits, {'step': step + 1}

  sequences, _ = bs.beam_search(np.zeros((batch, length), np.int32),
                                {'step': jnp.zeros((batch, 1), jnp.int32)},
                                tokens_to_logits, eos_id=4, num_decodes=beams, alpha=0.0)
  strings = [''.join(names[t] for t in sequences[0, i]) for i in range(beams)]
  assert strings == ['START-AABBA-END', 'START-BBAAB-END']


_TWO_TOKEN_ROWS = [[-1e7, -1e10, -0.1, -0.9], [-1e7, -1e10, -0.9, -0.1]]


def test_forced_prefix_and_scores():
  rows = [r + [-1e4] * 4 for r in _TWO_TOKEN_ROWS]
  inputs = np.array([[0, 7, 0, 0, 0], [0, 4, 5, 0, 0]], np.int32)
  sequences, scores = bs.beam_search(inputs, {}, _constant_logits(rows, 2), EOS,
                                     num_decodes=2, alpha=0)
  expected = np.array([[[7, 3, 2, 2, 2], [7, 2, 2, 2, 2]],
                       [[4, 5, 2, 3, 3], [4, 5, 3, 3, 3]]])
  np.testing.assert_array_equal(sequences, expected)
  # Score: the sum of log_softmax over the free (not forced) tokens.
  log_probs = jax.nn.log_softmax(jnp.asarray(rows, jnp.float32), axis=-1)
  prompt_lengths = [1, 2]
  expected_scores = [[float(sum(log_probs[b, t] for t in beam[prompt_lengths[b]:]))
                      for beam in expected[b]] for b in range(2)]
  np.testing.assert_allclose(scores, expected_scores, atol=1e-5)


@pytest.mark.parametrize('settings, expected', [
    ({}, [[[3, 2, 2, 2, 2], [2, 2, 2, 2, 2]], [[2, 3, 3, 3, 3], [3, 3, 3, 3, 3]]]),
    # No live beam passes -0.05 after the first step: the search stops there.
    ({'min_log_prob': -0.05}, [[[3, 0, 0, 0, 0], [2, 0, 0, 0, 0]],
                               [[2, 0, 0, 0, 0], [3, 0, 0, 0, 0]]]),
    ({'max_decode_step': 2}, [[[3, 2, 0, 0, 0], [2, 2, 0, 0, 0]],
                              [[2, 3, 0, 0, 0], [3, 3, 0, 0, 0]]]),
])
def test_no_prefix_stopping_rules(settings, expected):
  # No EOS is ever likely, so the live beams are returned, best last.
  sequences, scores = bs.beam_search(np.zeros((2, 5), np.int32), {},
                                     _constant_logits(_TWO_TOKEN_ROWS, 2), EOS,
                                     num_decodes=2, **settings)
  np.testing.assert_array_equal(sequences, expected)
  assert np.all(np.diff(scores, axis=1) >= 0)


def test_cache_expanded_by_beam_except_scalars_and_shared_bias():
  batch, beams, vocab = 3, 2, 5
  seen = []

  def tokens_to_logits(state):
    seen.append(jax.tree_util.tree_map(jnp.shape, state.cache))
    # The cache row remembers the row it came from: the beams of row b keep b.
    rows = state.cache['decoder']['cached_key'][:, 0].astype(jnp.int32)
    logits = jax.nn.one_hot((rows + 2) % vocab, vocab) * 5.0
    return logits, state.cache

  cache = {'decoder': {'cached_key': jnp.arange(batch, dtype=jnp.float32)[:, None] * jnp.ones(
      (batch, 4)), 'cache_index': jnp.array(0), 'cached_bias': jnp.ones((1, 4))}}
  # Traced once (the shapes are seen while tracing), compiled as one program.
  sequences, _ = jax.jit(lambda inputs, cache: bs.beam_search(
      inputs, cache, tokens_to_logits, EOS, num_decodes=beams))(np.zeros((batch, 3), np.int32),
                                                                cache)
  assert seen[0] == {'decoder': {'cached_key': (batch * beams, 4), 'cache_index': (),
                                 'cached_bias': (1, 4)}}
  np.testing.assert_array_equal(sequences[:, -1, 0], (np.arange(batch) + 2) % vocab)


def test_refuses_scanned_cache_offset():
  with pytest.raises(ValueError, match='cache_offset'):
    bs.beam_search(np.zeros((1, 3), np.int32), {}, _constant_logits(_TWO_TOKEN_ROWS[:1], 1),
                   EOS, num_decodes=1, cache_offset=1)


def test_bad_beam_width_is_refused():
  with pytest.raises(ValueError, match='num_beams'):
    bs.BeamConfig(num_beams=0)


# --- exhaustive search on a tiny T5 ---------------------------------------------------

VOCAB, LENGTH = 4, 4


@pytest.fixture(scope='module')
def tiny_model():
  config = get_config('test_tiny_1_1', vocab_size=VOCAB, num_encoder_layers=1,
                      num_decoder_layers=2)
  params = init_params(config, jax.random.PRNGKey(3))
  # Sharper than the initialization, so scores spread and no two sequences tie.
  params = jax.tree_util.tree_map(lambda x: x * 2.0, params)
  encoder_tokens = jnp.array([[2, 3, 2, 1], [3, 2, 1, 0]], jnp.int32)
  return config, params, encoder_tokens


@functools.partial(jax.jit, static_argnums=0)
def _teacher_forced_log_probs(config, params, encoder_tokens, decoder_inputs):
  logits = T5(config).apply(params, encoder_tokens, decoder_inputs)
  return jax.nn.log_softmax(logits.astype(jnp.float32))


def _enumerated_finished(config, params, encoder_tokens, alpha):
  """Every EOS-terminated sequence of <= LENGTH tokens with its score, per row."""
  sequences = [seq + (EOS,) for d in range(LENGTH)
               for seq in itertools.product([t for t in range(VOCAB) if t != EOS], repeat=d)]
  padded = np.array([list(s) + [0] * (LENGTH - len(s)) for s in sequences], np.int32)
  decoder_inputs = np.pad(padded, ((0, 0), (1, 0)))[:, :LENGTH]  # start token 0
  result = []
  for row in range(encoder_tokens.shape[0]):
    encoder = np.repeat(np.asarray(encoder_tokens)[row:row + 1], len(sequences), axis=0)
    log_probs = np.asarray(_teacher_forced_log_probs(config, params, encoder, decoder_inputs),
                           np.float64)
    scores = []
    for i, seq in enumerate(sequences):
      total = sum(log_probs[i, position, token] for position, token in enumerate(seq))
      scores.append(total / ((5.0 + len(seq)) / 6.0) ** alpha)
    result.append((padded, np.array(scores)))
  return result


@pytest.mark.parametrize('alpha', [0.0, 0.6, 3.0])
def test_wide_beam_equals_exhaustive_search(tiny_model, alpha):
  config, params, encoder_tokens = tiny_model
  # Wide enough to keep every candidate: the last step expands 3**3 live beams over
  # 4 tokens, all inside the top 2 * beams.
  beams = (VOCAB - 1) ** (LENGTH - 1) * VOCAB // 2
  output = bs.generate_beam(params, encoder_tokens, config=config,
                            beam=bs.BeamConfig(num_beams=beams, alpha=alpha),
                            max_decode_length=LENGTH)
  for row, (sequences, scores) in enumerate(_enumerated_finished(
      config, params, encoder_tokens, alpha)):
    order = np.argsort(scores)  # ascending, as beam search returns them
    count = len(order)  # every finished sequence; the slots below hold empty beams
    np.testing.assert_array_equal(output.tokens[row, -count:], sequences[order])
    np.testing.assert_allclose(output.scores[row, -count:], scores[order], rtol=1e-5)
    assert np.all(np.asarray(output.scores[row, :-count]) < -1e6)


def test_narrow_beam_on_t5_matches_generic_search_over_teacher_forced_logits(tiny_model):
  """generate_beam (cached decode, cache gathered by beam) equals beam_search driven by
  a cache-free tokens_to_logits that reruns the full forward pass on each prefix."""
  config, params, encoder_tokens = tiny_model
  beams, length = 2, 6
  output = bs.generate_beam(params, encoder_tokens, config=config,
                            beam=bs.BeamConfig(num_beams=beams, alpha=0.6),
                            max_decode_length=length)
  encoder = jnp.repeat(encoder_tokens, beams, axis=0)

  @jax.jit  # One program (run op by op, the search compiled ~270 small ones).
  def search(params):
    def tokens_to_logits(state):
      logits = T5(config).apply(params, encoder, state.sequences[:, :length])  # [b*k, L, v]
      return jnp.take(logits, state.cur_index, axis=1), state.cache

    return bs.beam_search(np.zeros((2, length), np.int32), {}, tokens_to_logits, EOS,
                          num_decodes=beams, alpha=0.6)

  sequences, scores = search(params)
  np.testing.assert_array_equal(output.tokens, sequences)
  np.testing.assert_allclose(output.scores, scores, rtol=1e-5)
