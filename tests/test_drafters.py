"""The n-gram and prompt-lookup drafters: fitted tables against hand counts, proposals
against numpy references, and speculative decoding with each equal to the baseline.

Statistical checks use fixed seeds and a 4-sigma bound per token, so they are
deterministic and a correct implementation fails a given seed with tiny probability.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (BigramDrafter, DraftContext, PromptLookupDrafter,
                                       UnigramDrafter, fit_bigram, fit_unigram)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import init_params
from jaxspec.sampling import SamplingConfig

VOCAB = 8
# Targets end with EOS (1); the second is padded with 0, which fitting must ignore.
CORPUS = [np.array([5, 3, 1]), np.array([3, 3, 1, 0, 0]), np.array([4, 1])]


def softmax(logits):
  shifted = logits - np.max(logits, axis=-1, keepdims=True)
  weights = np.exp(shifted)
  return weights / weights.sum(axis=-1, keepdims=True)


def reference_standardize(logits, temperature, top_k):
  """logits [v] -> probs [v] float64: softmax(logits / t) over the top_k tokens."""
  logits = np.asarray(logits, np.float64) / temperature
  kth_largest = np.sort(logits)[-top_k]
  return softmax(np.where(logits >= kth_largest, logits, -np.inf))


def make_context(encoder_rows, decoded_rows, encoder_length=8, max_decode_length=8):
  """Lists of token lists -> DraftContext with zero padding (length = len(decoded))."""
  def pad(rows, width):
    return jnp.array([list(row) + [0] * (width - len(row)) for row in rows], jnp.int32)
  return DraftContext(tokens=pad(decoded_rows, max_decode_length),
                      length=jnp.array([len(row) for row in decoded_rows], jnp.int32),
                      encoder_tokens=pad(encoder_rows, encoder_length))


@functools.partial(jax.jit, static_argnames=('drafter', 'gamma', 'sampling'))
def propose(drafter, params, context, keys, *, gamma, sampling):
  tokens, probs, _ = drafter.propose(params, drafter.init_state(params, None, 0), context,
                                     gamma, sampling, keys)
  return tokens, probs


def row_keys(batch, seed=0):
  return jax.random.split(jax.random.PRNGKey(seed), batch)


def assert_follows(samples, probs, vocab):
  """samples [n] drawn i.i.d. from probs [v]: every token frequency within 4 sigma."""
  n = samples.shape[0]
  frequency = np.bincount(samples, minlength=vocab) / n
  bound = 4 * np.sqrt(probs * (1 - probs) / n) + 1.0 / n
  np.testing.assert_array_less(np.abs(frequency - probs), bound)


# ----------------------------------------------------------------------------
# Fitting.


def test_fit_unigram_matches_hand_counts():
  # Target tokens 5 3 1 | 3 3 1 | 4 1: counts 1: 3, 3: 3, 4: 1, 5: 1; total 8.
  counts = np.array([0, 3, 0, 3, 1, 1, 0, 0])
  expected = np.log((counts + 0.5) / (8 + 0.5 * VOCAB))
  table = fit_unigram(CORPUS, VOCAB, smoothing=0.5)
  assert table.dtype == np.float32
  np.testing.assert_allclose(table, expected, rtol=1e-6)


def test_fit_bigram_matches_hand_counts():
  # Transitions (start token 0 first): 0>5 5>3 3>1 | 0>3 3>3 3>1 | 0>4 4>1.
  transitions = {(0, 5): 1, (5, 3): 1, (3, 1): 2, (0, 3): 1, (3, 3): 1, (0, 4): 1,
                 (4, 1): 1}
  smoothing = 0.25
  expected = np.zeros((VOCAB, VOCAB))
  for previous in range(VOCAB):
    row_total = sum(c for (a, _), c in transitions.items() if a == previous)
    for following in range(VOCAB):
      count = transitions.get((previous, following), 0)
      expected[previous, following] = np.log(
          (count + smoothing) / (row_total + smoothing * VOCAB))
  table = fit_bigram(CORPUS, VOCAB, smoothing=smoothing)
  assert table.dtype == np.float32
  np.testing.assert_allclose(table, expected, rtol=1e-6)
  np.testing.assert_allclose(table[7], np.full(VOCAB, -np.log(VOCAB)), rtol=1e-6)


def test_fit_rejects_bad_input():
  with pytest.raises(ValueError, match='smoothing'):
    fit_unigram(CORPUS, VOCAB, smoothing=0.0)
  with pytest.raises(ValueError, match='token ids'):
    fit_bigram([np.array([3, VOCAB])], VOCAB)


# ----------------------------------------------------------------------------
# Unigram and bigram proposals.

# Hand-made bigram logits: from a, the most likely next token is (3a + 1) mod 8.
BIGRAM_TABLE = np.asarray(
    np.random.default_rng(0).normal(size=(VOCAB, VOCAB))
    + 4.0 * np.eye(VOCAB)[(3 * np.arange(VOCAB) + 1) % VOCAB], np.float32)
UNIGRAM_TABLE = np.log(np.array([1, 2, 3, 4, 5, 6, 7, 8], np.float32) / 36)
# Rows at different lengths; the last committed tokens x_length are 6, 2 and 0.
CONTEXT = make_context([[9, 10], [11], [12, 13, 14]], [[4, 6], [2], [7, 3, 5, 0]])
LAST_INPUTS = np.array([6, 2, 0])


def test_greedy_bigram_follows_the_argmax_chain():
  tokens, probs = propose(BigramDrafter(VOCAB), BIGRAM_TABLE, CONTEXT, row_keys(3),
                          gamma=4, sampling=SamplingConfig())
  expected = [LAST_INPUTS]
  for _ in range(4):
    expected.append(np.argmax(BIGRAM_TABLE[expected[-1]], axis=-1))
  expected = np.stack(expected[1:], axis=1)  # [b, g]
  np.testing.assert_array_equal(tokens, expected)
  np.testing.assert_array_equal(probs, np.eye(VOCAB)[expected])


def test_greedy_unigram_repeats_the_argmax():
  tokens, probs = propose(UnigramDrafter(VOCAB), UNIGRAM_TABLE, CONTEXT, row_keys(3),
                          gamma=3, sampling=SamplingConfig())
  np.testing.assert_array_equal(tokens, np.full((3, 3), 7))
  np.testing.assert_array_equal(probs, np.broadcast_to(np.eye(VOCAB)[7], (3, 3, VOCAB)))


SAMPLING = SamplingConfig(temperature=0.7, top_k=5)


@pytest.mark.parametrize('sampling', [SamplingConfig(temperature=1.0), SAMPLING])
def test_bigram_q_is_the_standardized_row_of_the_previous_token(sampling):
  tokens, probs = propose(BigramDrafter(VOCAB), BIGRAM_TABLE, CONTEXT, row_keys(3),
                          gamma=3, sampling=sampling)
  previous = np.concatenate([LAST_INPUTS[:, None], np.asarray(tokens)[:, :-1]], axis=1)
  top_k = sampling.top_k or VOCAB
  expected = np.array([[reference_standardize(BIGRAM_TABLE[a], sampling.temperature, top_k)
                        for a in row] for row in previous])
  np.testing.assert_allclose(probs, expected, rtol=1e-5, atol=1e-7)


def test_unigram_q_is_the_standardized_table():
  _, probs = propose(UnigramDrafter(VOCAB), UNIGRAM_TABLE, CONTEXT, row_keys(3),
                     gamma=2, sampling=SAMPLING)
  expected = reference_standardize(UNIGRAM_TABLE, SAMPLING.temperature, SAMPLING.top_k)
  np.testing.assert_allclose(probs, np.broadcast_to(expected, (3, 2, VOCAB)), rtol=1e-5,
                             atol=1e-7)


def test_drawn_tokens_follow_q():
  batch = 4000
  context = make_context([[9]] * batch, [[3]] * batch)
  keys = row_keys(batch, seed=1)
  sampling = SamplingConfig(temperature=1.0)
  tokens, probs = map(np.asarray, propose(UnigramDrafter(VOCAB), UNIGRAM_TABLE, context,
                                          keys, gamma=2, sampling=sampling))
  q = probs[0, 0].astype(np.float64)
  assert_follows(tokens[:, 0], q, VOCAB)
  assert_follows(tokens[:, 1], q, VOCAB)
  # Positions draw with different keys: d_1 == d_2 has probability sum q^2.
  assert_follows((tokens[:, 0] == tokens[:, 1]).astype(int),
                 np.array([1 - np.sum(q ** 2), np.sum(q ** 2)]), 2)

  tokens, probs = map(np.asarray, propose(BigramDrafter(VOCAB), BIGRAM_TABLE, context,
                                          keys, gamma=2, sampling=sampling))
  assert_follows(tokens[:, 0], softmax(BIGRAM_TABLE[3].astype(np.float64)), VOCAB)
  # d_2 given d_1 is drawn from the recorded q_2, so its marginal is the mean of q_2.
  assert_follows(tokens[:, 1], probs[:, 1].astype(np.float64).mean(axis=0), VOCAB)


# ----------------------------------------------------------------------------
# Prompt lookup: one batch of hand-made rows, each row one case.

LOOKUP_CASES = [
    # (name, encoder tokens, decoded tokens, expected drafts for gamma = 4)
    # [8, 9] (n = 3 needs 3 decoded tokens) found in the encoder: copy 10, 11, then on
    # through the history (encoder then decoded prefix).
    ('in encoder', [7, 8, 9, 10, 11], [8, 9], [10, 11, 8, 9]),
    # [5, 6] found at the start of the decoded prefix; the copy runs into the query
    # itself and wraps with period N - E = 4.
    ('in decoded prefix', [20, 21, 22], [5, 6, 7, 30, 5, 6], [7, 30, 5, 6]),
    # 1-gram [4] occurs at encoder positions 0, 2 and decoded position 4: the latest
    # (in the decoded prefix) wins, followed by 11, 4, then period 2.
    ('most recent', [4, 9, 4, 10], [4, 11, 4], [11, 4, 11, 4]),
    # [5, 6] in the encoder beats the more recent 1-gram [6] (which would give 13).
    ('longest first', [3, 5, 6, 12], [6, 13, 5, 6], [12, 6, 13, 5]),
    # 3 never occurred before: repeat the last token.
    ('no match', [40, 41], [2, 3], [3, 3, 3, 3]),
    # The continuation of [7] is only [8, 7]: it repeats with period 2.
    ('short continuation', [50], [7, 8, 7], [8, 7, 8, 7]),
    # x_0 and the padding inside the encoder never match: with n = 1 the latest 9 is
    # in the encoder (compacted history 9 15 9 16 | 9), followed by 16.
    ('padding ignored', [9, 15, 0, 9, 16], [9], [16, 9, 16, 9]),
]


def test_prompt_lookup_cases():
  names, encoder_rows, decoded_rows, expected = zip(*LOOKUP_CASES)
  context = make_context(encoder_rows, decoded_rows)
  # Entries past `length` must be ignored.
  context = context.replace(tokens=context.tokens.at[0, 5:].set(8))
  drafter = PromptLookupDrafter(64, ngram_size=3)
  tokens, probs = propose(drafter, None, context, row_keys(len(names)), gamma=4,
                          sampling=SamplingConfig(temperature=1.0))
  for name, row_tokens, row_expected in zip(names, np.asarray(tokens), expected):
    np.testing.assert_array_equal(row_tokens, row_expected, err_msg=name)
  np.testing.assert_array_equal(probs, np.eye(64, dtype=np.float32)[np.asarray(tokens)])


def test_prompt_lookup_min_ngram_size_limits_the_search():
  # Only 2-grams. Row 0: [x_0, 9] would match padding followed by 9 if x_0 or padding
  # counted. Row 1: [8, 9] is found. Row 2: only the 1-gram [9] occurs earlier (then 22).
  context = make_context([[9, 15, 0, 9, 16], [9, 20, 8, 9, 21], [9, 22]],
                         [[9], [8, 9], [5, 9]])
  drafter = PromptLookupDrafter(64, ngram_size=2, min_ngram_size=2)
  tokens, _ = propose(drafter, None, context, row_keys(3), gamma=3,
                      sampling=SamplingConfig())
  np.testing.assert_array_equal(tokens, [[9, 9, 9], [21, 8, 9], [9, 9, 9]])


def test_prompt_lookup_rejects_bad_sizes():
  with pytest.raises(ValueError, match='min_ngram_size'):
    PromptLookupDrafter(64, ngram_size=2, min_ngram_size=3)


# ----------------------------------------------------------------------------
# End to end: speculative decoding with each drafter equals the baseline at argmax.

MAX_DECODE_LENGTH = 12


@pytest.fixture(scope='module')
def target():
  config = get_config('test_tiny_1_1')
  params = init_params(config, jax.random.PRNGKey(0))
  encoder_tokens = np.zeros((3, 10), np.int32)
  for row, length in enumerate([10, 6, 3]):
    encoder_tokens[row, :length] = np.random.default_rng(row).integers(
        2, config.vocab_size, length)
  encoder_tokens = jnp.asarray(encoder_tokens)
  baseline = generate(params, encoder_tokens, jax.random.PRNGKey(1), config=config,
                      max_decode_length=MAX_DECODE_LENGTH, sampling=SamplingConfig())
  return config, params, encoder_tokens, baseline


def drafter_and_params(name, config, baseline_tokens):
  # Fitted on the target's own greedy outputs, so the drafts are often accepted.
  outputs = list(np.asarray(baseline_tokens))
  if name == 'unigram':
    return UnigramDrafter(config.vocab_size), fit_unigram(outputs, config.vocab_size)
  if name == 'bigram':
    return BigramDrafter(config.vocab_size), fit_bigram(outputs, config.vocab_size)
  return PromptLookupDrafter(config.vocab_size, ngram_size=2), ()


@pytest.mark.parametrize('gamma', [1, 3])
@pytest.mark.parametrize('name', ['unigram', 'bigram', 'prompt_lookup'])
def test_speculative_equals_baseline_at_argmax(target, name, gamma):
  config, params, encoder_tokens, baseline = target
  drafter, drafter_params = drafter_and_params(name, config, baseline.tokens)
  result = speculative_generate(
      params, drafter_params, encoder_tokens, jax.random.PRNGKey(2), target_config=config,
      drafter=drafter, spec=SpeculativeConfig(gamma=gamma),
      max_decode_length=MAX_DECODE_LENGTH, sampling=SamplingConfig())
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  assert float(result.stats.alpha) > 0


# ----------------------------------------------------------------------------
# Cached-decoder proposals cut at a drafted EOS (DraftContext.eos_id).

CHAIN_EOS = 1
# A bigram decoder over 7 tokens: the argmax after 2 is EOS (1), after 3 is 2, after 1
# is 3, after 4 is 5, after 5 is 6 and after 6 is 4 (a cycle without EOS).
CHAIN_NEXT = {0: 4, 1: 3, 2: CHAIN_EOS, 3: 2, 4: 5, 5: 6, 6: 4}
CHAIN_LOGITS = 3.0 * jax.nn.one_hot(jnp.array([CHAIN_NEXT[t] for t in range(7)]), 7)


def chain_decode(tokens, cache):
  """tokens [b, t] -> logits [b, t, v] of the bigram table; the cache counts positions."""
  return CHAIN_LOGITS[tokens], cache.replace(end_index=cache.end_index + tokens.shape[1])


def chain_proposal(decoded_rows, gamma, eos_id, sampling=SamplingConfig(), seed=0):
  from jaxspec.decoding.drafters.t5 import propose_from_decoder
  from jaxspec.model import DecoderCache
  context = make_context([[5]] * len(decoded_rows), decoded_rows).replace(eos_id=eos_id)
  cache = DecoderCache(layers=(), encoder_mask=jnp.ones((len(decoded_rows), 1), bool),
                       end_index=jnp.zeros((len(decoded_rows),), jnp.int32))
  tokens, probs, cache = jax.jit(lambda cache, keys: propose_from_decoder(
      chain_decode, cache, context, gamma, sampling, keys))(cache, row_keys(len(decoded_rows),
                                                                              seed))
  return np.asarray(tokens), np.asarray(probs), np.asarray(cache.end_index), context


def test_proposal_steps_end_once_every_row_drafted_eos():
  from jaxspec.decoding.drafters.base import drafts_through_first
  gamma = 5
  # Row 0 drafts EOS first; row 1 drafts 2, then EOS; the steps end after the second.
  tokens, probs, end_index, _ = chain_proposal([[4, 2], [3]], gamma, eos_id=CHAIN_EOS)
  np.testing.assert_array_equal(tokens, [[CHAIN_EOS, 3, 0, 0, 0], [2, CHAIN_EOS, 0, 0, 0]])
  np.testing.assert_array_equal(probs.argmax(-1)[:, :2], tokens[:, :2])
  np.testing.assert_array_equal(probs[:, 2:], 0.0)
  # Rolled back to length - 1, two inputs, then one single step.
  np.testing.assert_array_equal(end_index, [1 + 2 + 1, 0 + 2 + 1])
  np.testing.assert_array_equal(drafts_through_first(tokens == CHAIN_EOS), [1, 2])
  # Without eos_id every row drafts gamma tokens, the same ones up to the cut.
  whole, _, whole_end, _ = chain_proposal([[4, 2], [3]], gamma, eos_id=None)
  np.testing.assert_array_equal(whole, [[CHAIN_EOS, 3, 2, CHAIN_EOS, 3],
                                        [2, CHAIN_EOS, 3, 2, CHAIN_EOS]])
  np.testing.assert_array_equal(whole_end, [1 + 2 + 4, 0 + 2 + 4])
  np.testing.assert_array_equal(drafts_through_first(whole == CHAIN_EOS), [1, 2])


def test_a_row_without_eos_keeps_the_steps_going():
  gamma = 4
  tokens, _, end_index, _ = chain_proposal([[4, 2], [6]], gamma, eos_id=CHAIN_EOS)
  np.testing.assert_array_equal(tokens, [[CHAIN_EOS, 3, 2, CHAIN_EOS], [4, 5, 6, 4]])
  np.testing.assert_array_equal(end_index, [1 + 2 + 3, 0 + 2 + 3])


def test_finished_rows_do_not_keep_the_steps_going():
  # Row 1 has committed EOS: finished, so row 0's EOS ends the steps after one draft.
  gamma = 4
  tokens, _, end_index, context = chain_proposal([[4, 2], [5, 6, CHAIN_EOS]], gamma,
                                                 eos_id=CHAIN_EOS)
  np.testing.assert_array_equal(context.finished(), [False, True])
  np.testing.assert_array_equal(tokens[0], [CHAIN_EOS, 0, 0, 0])
  np.testing.assert_array_equal(end_index, [1 + 2, 2 + 2])
  # A full buffer is finished too; x_0 (length 0) is not, whatever the EOS id.
  full = make_context([[5]], [[4] * 8]).replace(eos_id=CHAIN_EOS)
  assert bool(full.finished()[0])
  assert not bool(make_context([[5]], [[]]).replace(eos_id=0).finished()[0])


def test_sampled_proposal_cut_at_eos_keeps_the_drafts_before_the_cut():
  sampling = SamplingConfig(temperature=1.0)
  for seed in range(8):
    cut, cut_probs, _, _ = chain_proposal([[4, 2], [3], [6]], 6, CHAIN_EOS, sampling, seed)
    whole, whole_probs, _, _ = chain_proposal([[4, 2], [3], [6]], 6, None, sampling, seed)
    drafted = (cut_probs.sum(-1) > 0).sum(axis=1).max()  # steps run for the batch
    np.testing.assert_array_equal(cut[:, :drafted], whole[:, :drafted])
    np.testing.assert_array_equal(cut_probs[:, :drafted], whole_probs[:, :drafted])
    np.testing.assert_array_equal(cut[:, drafted:], 0)
    # The steps ran until every row had drafted EOS, or to gamma.
    assert drafted == 6 or np.all(np.any(cut[:, :drafted] == CHAIN_EOS, axis=1))
