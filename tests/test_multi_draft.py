"""Multi-draft verification (SpeculativeConfig.num_drafts, jaxspec/decoding/verification/tree.py).

- Tree step: each branch's logits equal decoding that branch alone; positions by depth
  matter (flat positions give other logits); after compaction and rollback the cache
  holds the accepted tokens as a sequential decode would, and the next step agrees.
- Greedy: token for token the baseline, for k in {2, 3}, gamma in {1, 3}, a random and
  a near-copy draft; the trace and the statistics stay consistent.
- Sampling: the verdict alone and the whole loop match the target's exact distribution
  (chi-square, total variation); the same checks reject a verdict that skips the
  residual update between candidates.
- More drafts accept more tokens per target call; unsupported settings are refused.

Helpers and the tiny models come from tests/test_speculative.py.
"""

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_speculative as spec_tests  # tests/test_speculative.py: models, enumeration
from jaxspec.decoding.verification import tree as multi_draft
from jaxspec.decoding.drafters import BigramDrafter, DraftContext, T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.drafters.t5 import propose_top_branches_from_decoder
from jaxspec.model import T5, DecodeTree, DecoderCache, init_params, repeat_rows, rollback
from jaxspec.sampling import SamplingConfig
from jaxspec.decoding.verification.token import residual_distribution

TARGET, DRAFT, MAX_LEN = spec_tests.TARGET, spec_tests.DRAFT, spec_tests.MAX_LEN
SMALL = spec_tests.SMALL

# ----------------------------------------------------------------------------------
# 1. The tree step and the cache compaction.

PREFIX_LENGTHS = (3, 5)  # Cached decoder positions per row before the tree step.
K, G = 3, 3


@functools.cache
def _tree_inputs():
  """(prefix inputs [b, 6], roots [b, 1], branch tokens [b, k, g], next tokens [b, g])."""
  rng = np.random.default_rng(4)
  prefix = rng.integers(2, TARGET.vocab_size, (2, 6)).astype(np.int32)
  prefix[:, 0] = 0
  roots = rng.integers(2, TARGET.vocab_size, (2, 1)).astype(np.int32)
  drafts = rng.integers(2, TARGET.vocab_size, (2, K, G)).astype(np.int32)
  drafts[0, 1, 0] = drafts[0, 0, 0]  # Branches sharing a first token stay separate.
  return prefix, roots, drafts, rng.integers(2, TARGET.vocab_size, (2,)).astype(np.int32)


def _prefilled_cache(params):
  """The target's cache with PREFIX_LENGTHS positions of the prefix per row."""
  model = T5(TARGET)
  encoder_tokens = spec_tests._encoder_tokens()[:2]
  prefix = _tree_inputs()[0]
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, 16, method=T5.init_cache)
  _, cache = model.apply(params, prefix, cache, method=T5.decode)
  return rollback(cache, jnp.array(PREFIX_LENGTHS))


@jax.jit
def _tree_and_branches(params, tree: DecodeTree):
  """-> (tree logits along each branch [b, k, g+1, v], each branch decoded alone
  [b, k, g+1, v], the cache after the tree step)."""
  model = T5(TARGET)
  _, roots, drafts, _ = _tree_inputs()
  cache = _prefilled_cache(params)
  tree_logits, tree_cache = model.apply(params, multi_draft.flatten_tree(roots, drafts),
                                        cache, tree, method=T5.decode)
  # Every branch alone as its own row, [b k] rows in one chain step.
  chains = jnp.concatenate([jnp.repeat(roots, K, axis=0), drafts.reshape(-1, G)], axis=1)
  alone, _ = model.apply(params, chains, repeat_rows(cache, K), method=T5.decode)
  return (multi_draft.branch_values(tree_logits, K, G),
          alone.reshape((2, K) + alone.shape[1:]), tree_cache)


def test_tree_layout_is_root_then_branches():
  tree = multi_draft.tree_layout(2, 2)
  np.testing.assert_array_equal(tree.depths, [0, 1, 2, 1, 2])
  np.testing.assert_array_equal(tree.ancestors.astype(int), [
      [1, 0, 0, 0, 0],
      [1, 1, 0, 0, 0],
      [1, 1, 1, 0, 0],
      [1, 0, 0, 1, 0],
      [1, 0, 0, 1, 1]])
  np.testing.assert_array_equal(multi_draft.path_nodes(2, 2), [[0, 1, 2], [0, 3, 4]])


def test_tree_step_logits_equal_each_branch_decoded_alone():
  params = spec_tests._target_params()
  along_branches, alone, _ = _tree_and_branches(params, multi_draft.tree_layout(K, G))
  np.testing.assert_allclose(along_branches, alone, atol=2e-5, rtol=1e-5)
  # Teeth: positions by flat index instead of depth change branches 1 and 2.
  flat = multi_draft.tree_layout(K, G).replace(depths=jnp.arange(1 + K * G))
  wrong, _, _ = _tree_and_branches(params, flat)
  np.testing.assert_allclose(wrong[:, 0], alone[:, 0], atol=2e-5, rtol=1e-5)
  assert np.max(np.abs(wrong[:, 1:, 1:] - alone[:, 1:, 1:])) > 1e-3


@jax.jit
def _compacted_then_next(params, branch, num_accepted):
  """Tree step, compaction of `branch` [b], rollback past num_accepted [b] accepted
  tokens, then one more token: -> (its logits [b, v], the cache), and the same from
  decoding root + accepted tokens in sequence."""
  model = T5(TARGET)
  _, roots, drafts, next_tokens = _tree_inputs()
  cache = _prefilled_cache(params)
  start = cache.end_index
  _, tree_cache = model.apply(params, multi_draft.flatten_tree(roots, drafts), cache,
                              multi_draft.tree_layout(K, G), method=T5.decode)
  tree_cache = multi_draft.compact_branch(tree_cache, start, branch, G)
  # Poison: the decode must not read the other branches' leftovers past the new end.
  tree_cache = rollback(tree_cache, start + 1 + num_accepted)
  tree_logits, tree_cache = model.apply(params, next_tokens[:, None], tree_cache,
                                        method=T5.decode)

  accepted = multi_draft.select_branch(jnp.asarray(drafts), branch)  # [b, g]
  sequence = jnp.concatenate([roots, accepted], axis=1)  # [b, 1+g]
  _, sequential_cache = model.apply(params, sequence, cache, method=T5.decode)
  sequential_cache = rollback(sequential_cache, start + 1 + num_accepted)
  sequential_logits, sequential_cache = model.apply(params, next_tokens[:, None],
                                                    sequential_cache, method=T5.decode)
  return tree_logits[:, 0], tree_cache, sequential_logits[:, 0], sequential_cache


@pytest.mark.parametrize('branch, num_accepted', [((2, 1), (2, 3)), ((0, 2), (0, 1))])
def test_compacted_cache_equals_sequential_decode(branch, num_accepted):
  params = spec_tests._target_params()
  tree_logits, tree_cache, logits, cache = _compacted_then_next(
      params, jnp.array(branch), jnp.array(num_accepted))
  np.testing.assert_allclose(tree_logits, logits, atol=2e-5, rtol=1e-5)
  np.testing.assert_array_equal(tree_cache.end_index, cache.end_index)
  for row in range(2):
    valid = int(cache.end_index[row])  # prefix, root, accepted, next token
    for tree_layer, layer in zip(tree_cache.layers, cache.layers):
      for name in ('self_keys', 'self_values'):
        np.testing.assert_allclose(getattr(tree_layer, name)[row, ..., :valid],
                                   getattr(layer, name)[row, ..., :valid], atol=2e-5, rtol=1e-5)


# ----------------------------------------------------------------------------------
# 2. Greedy: token for token the baseline.

# (num_drafts, gamma) x drafter; both drafters share the target's config, so each
# (num_drafts, gamma) compiles once.
GREEDY_CASES = [(2, 1, 'random'), (2, 1, 'near_copy'), (3, 3, 'random'), (3, 3, 'near_copy')]


@functools.cache
def _random_draft_params():
  """An independent random init of the target's architecture (alpha well below 1)."""
  return init_params(TARGET, jax.random.PRNGKey(5))


@functools.cache
def _greedy_run(num_drafts, gamma, drafter_name):
  drafter_params = (_random_draft_params() if drafter_name == 'random'
                    else spec_tests._near_copy_params())
  return speculative_generate(
      spec_tests._target_params(), drafter_params, spec_tests._encoder_tokens(),
      target_config=TARGET, drafter=T5Drafter(TARGET),
      spec=SpeculativeConfig(gamma=gamma, num_drafts=num_drafts), max_decode_length=MAX_LEN,
      record_trace=True)


@pytest.mark.parametrize('num_drafts, gamma, drafter_name', GREEDY_CASES)
def test_greedy_multi_draft_equals_baseline(num_drafts, gamma, drafter_name):
  result = _greedy_run(num_drafts, gamma, drafter_name)
  baseline = spec_tests._baseline()
  np.testing.assert_array_equal(result.output.tokens, baseline.tokens)
  np.testing.assert_array_equal(result.output.lengths, baseline.lengths)
  spec_tests._assert_padded_after_eos(result.output)
  spec_tests._check_stats(result, gamma)
  spec_tests._check_trace(result, gamma, cut_at_eos=False)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[1:].sum() > 0  # Corrections and acceptances both ran.
  if drafter_name == 'random':
    assert float(result.stats.alpha) < 0.7


def test_nan_target_rows_stop_and_are_reported():
  # Rows that emit `token` read a NaN embedding at the next step, inside a tree; the
  # tokens judged before it are kept and the row stops, reported. (Params are traced:
  # the greedy (2, 1) program runs again.) A row may stop one token before the baseline
  # does: a draft of `token` in any branch writes NaN keys, and a masked NaN key still
  # turns the attention logits NaN (q.k + bias), so the root is already non-finite; the
  # single-draft loop shares this whenever a draft is `token`.
  token, reached = spec_tests._token_reached_mid_output()
  params = spec_tests._with_nan_embedding(spec_tests._target_params(), token)
  baseline = spec_tests.generate(params, spec_tests._encoder_tokens(), config=TARGET,
                                 max_decode_length=MAX_LEN, on_nonfinite='ignore')
  result = speculative_generate(
      params, _random_draft_params(), spec_tests._encoder_tokens(), target_config=TARGET,
      drafter=T5Drafter(TARGET), spec=SpeculativeConfig(gamma=1, num_drafts=2),
      max_decode_length=MAX_LEN, record_trace=True, on_nonfinite='ignore')
  np.testing.assert_array_equal(result.output.nonfinite_logits, reached)
  tokens, expected = np.asarray(result.output.tokens), np.asarray(baseline.tokens)
  np.testing.assert_array_equal(tokens[~reached], expected[~reached])
  lengths = np.asarray(result.trace.committed).sum(axis=1)  # [b] tokens committed
  baseline_lengths = 2 + np.argmax(np.asarray(spec_tests._baseline().tokens)[:, 1:] == token,
                                   axis=1)  # up to and including `token`
  for row in np.flatnonzero(reached):  # A prefix of the baseline's output, then 0.
    assert baseline_lengths[row] - 1 <= lengths[row] <= baseline_lengths[row]
    np.testing.assert_array_equal(tokens[row, :lengths[row]], expected[row, :lengths[row]])
    np.testing.assert_array_equal(tokens[row, lengths[row]:], 0)
  assert np.isfinite(float(result.stats.overlap_sum))


def test_nan_drafter_is_reported_not_accepted():
  # A NaN q passes the accept test (u >= NaN is False); the rows must stop instead.
  sampling, num_drafts, gamma, length = SAMPLED_CASES['t1_k3_gamma2']
  draft_params = jax.tree_util.tree_map(lambda x: x * jnp.nan,
                                        spec_tests._small_draft_params())
  result = speculative_generate(  # The program of _sampled_run, with other params.
      spec_tests._small_target_params(), draft_params,
      spec_tests._small_encoder_tokens(LOOP_ROWS), jax.random.PRNGKey(8),
      target_config=SMALL, drafter=T5Drafter(SMALL),
      spec=SpeculativeConfig(gamma=gamma, num_drafts=num_drafts), max_decode_length=length,
      sampling=sampling, record_trace=True, on_nonfinite='ignore')
  first = np.asarray(result.output.tokens)[:, 0]
  np.testing.assert_array_equal(result.output.tokens[:, 1:], 0)
  np.testing.assert_array_equal(result.output.nonfinite_logits, first != spec_tests.EOS_ID)
  assert (first != spec_tests.EOS_ID).sum() > 1000


def test_top_branches_start_with_the_draft_top_choices():
  # A decoder whose logits depend on the last input only (a bigram table): branch j
  # must start with the j-th largest logit after x_length and continue greedily.
  vocab, gamma = 7, 3
  table = jax.random.normal(jax.random.PRNGKey(6), (vocab, vocab))

  def decode(tokens, cache):  # tokens [b, t] -> logits [b, t, v]
    return table[tokens], cache.replace(end_index=cache.end_index + tokens.shape[1])

  cache = DecoderCache(layers=(), encoder_mask=jnp.ones((2, 1), bool),
                       end_index=jnp.zeros((2,), jnp.int32))
  context = DraftContext(tokens=jnp.array([[2, 5, 0], [4, 0, 0]]), length=jnp.array([2, 1]),
                         encoder_tokens=jnp.ones((2, 1), jnp.int32))
  tree, tree_probs, tree_cache = jax.jit(
      lambda cache: propose_top_branches_from_decoder(decode, cache, context, gamma, 3))(cache)
  table = np.asarray(table)
  for row, last in enumerate([5, 4]):
    for j, first in enumerate(np.argsort(-table[last], kind='stable')[:3]):
      expected = [first]
      while len(expected) < gamma:
        expected.append(int(np.argmax(table[expected[-1]])))
      np.testing.assert_array_equal(tree[row, j], expected)
  np.testing.assert_array_equal(np.asarray(tree_probs).argmax(-1), tree)
  np.testing.assert_array_equal(np.asarray(tree_probs).sum(-1), 1.0)
  # Rolled back to length - 1, two inputs, then gamma - 1 steps, per branch row [b k].
  np.testing.assert_array_equal(tree_cache.end_index, np.repeat([1 + 2 + 2, 0 + 2 + 2], 3))


def test_branches_are_the_drafter_proposals_with_split_keys():
  # Branch j of row b is the drafter's proposal for row b with key split(keys[b], k)[j]:
  # i.i.d. across branches, and independent of the other rows.
  vocab, gamma, num_drafts = 6, 3, 4
  drafter = BigramDrafter(vocab)
  sampling = SamplingConfig(temperature=1.0)
  context = DraftContext(tokens=jnp.array([[2, 3, 0], [4, 0, 0]]), length=jnp.array([2, 1]),
                         encoder_tokens=jnp.ones((2, 2), jnp.int32))
  rows = np.repeat(np.arange(2), num_drafts)  # [b k] the row of each (row, branch)

  @jax.jit
  def branches_and_each_alone(table, keys):
    drafts, probs, state = multi_draft.propose_branches(drafter, table, (), context, gamma,
                                                        num_drafts, sampling, keys)
    assert state == ()
    # Every (row, branch) alone: its row's context and its key, as a batch of 1.
    branch_keys = jax.vmap(lambda key: jax.random.split(key, num_drafts))(keys).reshape(-1, 2)
    alone = jax.vmap(lambda row_context, key: jax.tree_util.tree_map(
        lambda x: x[0], drafter.propose(
            table, (), jax.tree_util.tree_map(lambda x: x[None], row_context), gamma,
            sampling, key[None])))(jax.tree_util.tree_map(lambda x: x[rows], context),
                                   branch_keys)
    return drafts, probs, alone[0], alone[1]

  drafts, probs, alone, alone_probs = map(np.asarray, branches_and_each_alone(
      jax.random.normal(jax.random.PRNGKey(1), (vocab, vocab)),
      jax.random.split(jax.random.PRNGKey(2), 2)))
  assert drafts.shape == (2, num_drafts, gamma) and probs.shape == (2, num_drafts, gamma, vocab)
  np.testing.assert_array_equal(drafts.reshape(-1, gamma), alone)
  np.testing.assert_allclose(probs.reshape(-1, gamma, vocab), alone_probs, rtol=1e-6)
  assert len({tuple(branch) for branch in drafts.reshape(-1, gamma)}) > 4


def test_greedy_other_drafters_decode_as_one_draft():
  # A drafter without a top-k tree would propose k copies at temperature 0.
  assert not multi_draft.uses_tree(BigramDrafter(8), 3, SamplingConfig())
  assert multi_draft.uses_tree(BigramDrafter(8), 3, SamplingConfig(temperature=1.0))
  assert multi_draft.uses_tree(T5Drafter(DRAFT), 3, SamplingConfig())
  assert not multi_draft.uses_tree(T5Drafter(DRAFT), 1, SamplingConfig(temperature=1.0))


# ----------------------------------------------------------------------------------
# 3. Sampling is exact: the verdict alone, then the whole loop.

VERDICT_VOCAB, VERDICT_ROWS = 5, 20_000


def _skip_residual(probs, candidates, candidate_probs, tried, uniforms):
  """WRONG: every candidate is tried against the original p; only the last rejection
  leaves a residual. Over-weights the tokens both p and q favour."""
  original = probs
  batch, num_drafts = candidates.shape
  found = jnp.zeros((batch,), bool)
  token = jnp.zeros((batch,), jnp.int32)
  for j in range(num_drafts):
    x, q = candidates[:, j], candidate_probs[:, j]
    takes_part = tried[:, j] & ~found
    p_x = original[jnp.arange(batch), x]
    q_x = q[jnp.arange(batch), x]
    accepted = takes_part & (uniforms[:, j] < jnp.minimum(1.0, p_x / q_x))
    probs = jnp.where((takes_part & ~accepted)[:, None], residual_distribution(original, q),
                      probs)
    token = jnp.where(accepted, x, token)
    found = found | accepted
  return found, token, probs


def _verdict_samples(num_drafts, try_candidates=None):
  """One depth (gamma 1): the next committed token of VERDICT_ROWS rows, each with its
  own i.i.d. drafts from q, and the exact p [v]."""
  p = jnp.array([0.0, 0.45, 0.25, 0.2, 0.1])  # Token 0 masked, as top-k would.
  q = jnp.array([0.3, 0.3, 0.05, 0.15, 0.2])
  keys = jax.random.split(jax.random.PRNGKey(3), VERDICT_ROWS)

  def run(keys):
    draft_keys = jax.vmap(lambda key: jax.random.split(key, 2))(keys)
    drafts = jax.vmap(lambda key: jax.random.categorical(
        key, jnp.log(q), shape=(num_drafts, 1)))(draft_keys[:, 0]).astype(jnp.int32)
    draft_probs = jnp.broadcast_to(q, drafts.shape + (VERDICT_VOCAB,))
    target_probs = jnp.broadcast_to(p, (VERDICT_ROWS, num_drafts, 2, VERDICT_VOCAB))
    verdict = multi_draft.multi_draft_verdict(draft_keys[:, 1], drafts, draft_probs,
                                              target_probs)
    first = multi_draft.select_branch(drafts, verdict.branch)[:, 0]
    return jnp.where(verdict.num_accepted > 0, first, verdict.next_token), verdict

  with pytest.MonkeyPatch.context() as patch:
    if try_candidates is not None:
      patch.setattr(multi_draft, '_try_candidates', try_candidates)
    # One program (run eagerly, each operation would be a program of its own); `run`
    # is a new function each call, so it is traced anew and the patch always applies.
    tokens, verdict = jax.jit(run)(keys)
  return np.asarray(tokens), np.asarray(p), verdict


def _token_p_value(tokens, p):
  counts = np.bincount(tokens, minlength=len(p))
  return spec_tests._chi_square_p_value(counts, p * len(tokens))


@pytest.mark.parametrize('num_drafts', [2, 3])
def test_verdict_first_token_is_the_target_distribution(num_drafts):
  tokens, p, verdict = _verdict_samples(num_drafts)
  assert _token_p_value(tokens, p) > spec_tests.SIGNIFICANCE
  accepted = np.asarray(verdict.num_accepted)
  # Later candidates were reached: more accepted than one draft's beta = sum min(p, q).
  one_draft_beta = float(np.sum(np.minimum(p, [0.3, 0.3, 0.05, 0.15, 0.2])))
  assert np.all(tokens != 0)  # Never a token p rules out, though q drafts it often.
  assert accepted.mean() > one_draft_beta + 0.05


def test_verdict_check_has_power_against_a_skipped_residual():
  tokens, p, _ = _verdict_samples(2, _skip_residual)
  assert _token_p_value(tokens, p) < spec_tests.SIGNIFICANCE


# name -> (sampling, num_drafts, gamma, max_decode_length)
SAMPLED_CASES = {
    't1_k3_gamma2': (SamplingConfig(temperature=1.0), 3, 2, 3),
}


@dataclasses.dataclass(frozen=True)
class _Retraced(T5Drafter):
  """T5Drafter under another static identity, so a patched verdict is traced anew."""


LOOP_ROWS = 20_000


@functools.cache
def _sampled_run(name, wrong_residual=False):
  sampling, num_drafts, gamma, length = SAMPLED_CASES[name]
  drafter = (_Retraced if wrong_residual else T5Drafter)(SMALL)
  with pytest.MonkeyPatch.context() as patch:
    if wrong_residual:
      patch.setattr(multi_draft, '_try_candidates', _skip_residual)
    return speculative_generate(
        spec_tests._small_target_params(), spec_tests._small_draft_params(),
        spec_tests._small_encoder_tokens(LOOP_ROWS), jax.random.PRNGKey(8),
        target_config=SMALL, drafter=drafter,
        spec=SpeculativeConfig(gamma=gamma, num_drafts=num_drafts),
        max_decode_length=length, sampling=sampling, record_trace=True)


@pytest.mark.parametrize('name', list(SAMPLED_CASES))
def test_sampled_multi_draft_matches_exact_distribution(name):
  sampling, _, gamma, length = SAMPLED_CASES[name]
  result = _sampled_run(name)
  spec_tests._assert_matches(result.output.tokens,
                             *spec_tests._exact_joint('target', sampling, length))
  spec_tests._assert_padded_after_eos(result.output)
  spec_tests._check_stats(result, gamma)
  spec_tests._check_trace(result, gamma, cut_at_eos=False)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[gamma] > 0  # Both the residual and the bonus path ran.


def test_sampled_check_has_power_against_a_skipped_residual():
  sampling, _, _, length = SAMPLED_CASES['t1_k3_gamma2']
  result = _sampled_run('t1_k3_gamma2', wrong_residual=True)
  spec_tests._assert_rejects(result.output.tokens,
                             *spec_tests._exact_joint('target', sampling, length))


def _mean_and_error(counts):
  """Mean and standard error of n over iterations, from num_accepted_counts."""
  counts = np.asarray(counts, np.float64)
  values = np.arange(len(counts))
  mean = counts @ values / counts.sum()
  return mean, math.sqrt((counts @ (values - mean) ** 2) / counts.sum() / counts.sum())


def test_three_drafts_accept_more_per_target_call_than_one():
  # The same target, draft, sampling, gamma 2 and length 3 with one draft (shared with
  # tests/test_speculative.py).
  three, one = _sampled_run('t1_k3_gamma2'), spec_tests._sampled_run('t1_gamma2')
  sampling, _, gamma, length = SAMPLED_CASES['t1_k3_gamma2']
  assert (sampling, gamma, length) == spec_tests.SAMPLED_CASES['t1_gamma2']
  (mean3, error3), (mean1, error1) = map(
      _mean_and_error, (three.stats.num_accepted_counts, one.stats.num_accepted_counts))
  assert mean3 > mean1 + 4 * math.hypot(error3, error1) and mean3 > mean1 + 0.2
  tokens_per_call = [float(run.stats.tokens_per_target_call(run.output.lengths))
                     for run in (three, one)]
  # Length 3 caps a call at 2 new tokens (the first-token step counts too), hence a
  # small margin; the accepted counts above carry the statistical check.
  assert tokens_per_call[0] > tokens_per_call[1], tokens_per_call
  # alpha stays one draft's beta: the same q and p, whatever k.
  assert abs(float(three.stats.alpha) - float(one.stats.alpha)) < 0.02


# ----------------------------------------------------------------------------------
# 4. Settings.


@pytest.mark.parametrize('settings, message', [
    (dict(num_drafts=0), 'num_drafts must be >= 1'),
    (dict(num_drafts=-2), 'num_drafts must be >= 1'),
    (dict(num_drafts=2, verification='block'), "verification='block'"),
    (dict(num_drafts=3, lenience=0.5), 'lenience 0.5'),
    (dict(num_drafts=2, draft_confidence_threshold=0.3), 'draft_confidence_threshold 0.3'),
])
def test_unsupported_settings_are_refused(settings, message):
  with pytest.raises(ValueError, match=message):
    SpeculativeConfig(**settings)


def test_one_draft_combines_with_everything():
  SpeculativeConfig(num_drafts=1, verification='block', draft_confidence_threshold=0.3)
  SpeculativeConfig(num_drafts=1, lenience=0.5)


def test_top_k_tree_wider_than_the_vocabulary_is_refused():
  with pytest.raises(ValueError, match='num_drafts 65 is larger than the vocabulary'):
    speculative_generate(
        spec_tests._target_params(), spec_tests._draft_params(), spec_tests._encoder_tokens(),
        target_config=TARGET, drafter=T5Drafter(DRAFT),
        spec=SpeculativeConfig(gamma=2, num_drafts=65), max_decode_length=MAX_LEN)


def test_num_drafts_is_gin_settable():
  gin = pytest.importorskip('gin')
  from jaxspec import configurables  # noqa: F401  (registers jaxspec.SpeculativeConfig)
  gin.clear_config()
  try:
    gin.parse_config('jaxspec.SpeculativeConfig.num_drafts = 3')
    spec = gin.get_configurable('jaxspec.SpeculativeConfig')(gamma=2)
  finally:
    gin.clear_config()
  assert spec == SpeculativeConfig(gamma=2, num_drafts=3)
