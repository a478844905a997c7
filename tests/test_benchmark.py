"""jaxspec.measure.benchmark against independent computations, and scripts/benchmark.py end to end."""

import collections
import dataclasses
import json
import os
import shutil

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.measure import benchmark as measure
from jaxspec.checkpoints.t5x import save_t5x_checkpoint
from jaxspec.config import EOS_ID, get_config
from jaxspec.data import corpora
from jaxspec.decoding import baseline
from jaxspec.decoding.beam_search import BeamOutput
from jaxspec.decoding.speculative_beam import SpeculativeBeamOutput, SpeculativeBeamStats
from jaxspec.decoding.drafters.base import DraftContext
from jaxspec.decoding.drafters import (BigramDrafter, Int8Drafter, PromptLookupDrafter,
                                       T5Drafter, UnigramDrafter)
from jaxspec.model import T5, init_params
from jaxspec.sampling import SamplingConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import benchmark as benchmark_script
from jaxspec.launch import gin_flags

CONFIG = get_config('test_tiny_1_1')
GREEDY, SAMPLED = SamplingConfig(temperature=0.0), SamplingConfig(temperature=1.0)


@pytest.fixture(scope='module')
def params():
  return {'params': init_params(CONFIG, jax.random.PRNGKey(0))['params']}


@pytest.fixture(scope='module')
def encoder_tokens():
  tokens = np.random.RandomState(0).randint(3, CONFIG.vocab_size, (5, 9)).astype(np.int32)
  tokens[1, 6:] = 0  # Padding.
  return tokens


def _softmax(x):
  x = np.asarray(x, np.float64)
  e = np.exp(x - x.max(axis=-1, keepdims=True))
  return e / e.sum(axis=-1, keepdims=True)


@jax.jit
def _teacher_forced_logits(params, encoder_tokens, decoder_inputs):
  return T5(CONFIG).apply(params, encoder_tokens, decoder_inputs)


def _target_probs(params, encoder_tokens, tokens):
  """The target's softmax at every prefix of tokens, from one full forward pass."""
  decoder_inputs = np.pad(tokens, ((0, 0), (1, 0)))[:, :-1]
  return _softmax(_teacher_forced_logits(params, encoder_tokens, decoder_inputs))


@pytest.mark.parametrize('sampling', [GREEDY, SAMPLED])
def test_t5x_style_loop_decodes_what_the_baseline_decodes(params, encoder_tokens, sampling):
  rng = jax.random.PRNGKey(7)
  reference = measure.t5x_style_generate(params, encoder_tokens, rng, config=CONFIG,
                                         max_decode_length=10, sampling=sampling)
  ours = baseline.generate(params, encoder_tokens, rng, config=CONFIG, max_decode_length=10,
                           sampling=sampling)
  np.testing.assert_array_equal(np.asarray(reference), np.asarray(ours.tokens))


def test_target_samples_are_the_targets_outputs_and_count_drafted_positions(
    params, encoder_tokens):
  rng = jax.random.PRNGKey(3)
  samples = measure.sample_target_outputs(params, CONFIG, encoder_tokens, 10, SAMPLED, rng,
                                          min_tokens=1, batch_size=2)
  assert samples.batches == ((0, 2),)  # One batch already holds more than 1 position.
  keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(rng, jnp.arange(2))
  expected = baseline.generate(params, encoder_tokens[:2], keys, config=CONFIG,
                               max_decode_length=10, sampling=SAMPLED)
  np.testing.assert_array_equal(samples.tokens, np.asarray(expected.tokens))
  for row, length in enumerate(np.asarray(expected.lengths)):
    np.testing.assert_array_equal(samples.mask[row],
                                  np.arange(10) < length)  # The first position too.
  everything = measure.sample_target_outputs(params, CONFIG, encoder_tokens, 10, SAMPLED, rng,
                                             min_tokens=10**6, batch_size=2)
  assert everything.batches == ((0, 2), (2, 4), (4, 5)) and len(everything.tokens) == 5


def test_bigram_proposals_per_prefix_are_its_table_rows(params, encoder_tokens):
  table = np.random.RandomState(1).randn(CONFIG.vocab_size, CONFIG.vocab_size)
  tokens = np.random.RandomState(2).randint(3, CONFIG.vocab_size, (2, 6)).astype(np.int32)
  probs = measure.drafter_probs(BigramDrafter(CONFIG.vocab_size), jnp.asarray(table),
                                encoder_tokens[:2], tokens, SAMPLED)
  previous = np.pad(tokens[:, :-1], ((0, 0), (1, 0)))  # x_j; x_0 is the start token 0.
  np.testing.assert_allclose(np.asarray(probs), _softmax(table[previous]), rtol=1e-5, atol=1e-7)


def test_prompt_lookup_proposals_per_prefix_match_direct_calls(encoder_tokens):
  drafter = PromptLookupDrafter(CONFIG.vocab_size)
  tokens = np.array([list(encoder_tokens[0, :4]) + [5, 6]], np.int32)
  probs = measure.drafter_probs(drafter, (), encoder_tokens[:1], tokens, GREEDY)
  for length in range(6):  # Length 0: the proposal after the start token alone.
    context = DraftContext(tokens=jnp.asarray(np.where(np.arange(6) < length, tokens, 0)),
                           length=jnp.array([length]), encoder_tokens=encoder_tokens[:1])
    drafts, _, _ = drafter.propose((), (), context, 1, GREEDY, jax.random.split(
        jax.random.PRNGKey(0), 1))
    assert int(np.argmax(probs[0, length])) == int(drafts[0, 0])


def test_t5_drafter_probs_are_teacher_forced_softmax(params, encoder_tokens):
  tokens = np.random.RandomState(4).randint(3, CONFIG.vocab_size, (5, 7)).astype(np.int32)
  probs = measure.drafter_probs(T5Drafter(CONFIG), params, encoder_tokens, tokens, SAMPLED)
  np.testing.assert_allclose(np.asarray(probs), _target_probs(params, encoder_tokens, tokens),
                             rtol=1e-4, atol=1e-6)


def _samples(params, encoder_tokens, sampling):
  return measure.sample_target_outputs(params, CONFIG, encoder_tokens, 10, sampling,
                                       jax.random.PRNGKey(5), min_tokens=10**6, batch_size=2)


@pytest.mark.parametrize('sampling', [GREEDY, SAMPLED])
def test_alpha_of_the_target_drafting_for_itself_is_one(params, encoder_tokens, sampling):
  samples = _samples(params, encoder_tokens, sampling)
  result = measure.measured_alpha(samples, params, CONFIG, T5Drafter(CONFIG), params,
                                  sampling, lenience=(1.0, 0.5), batch_size=2)
  assert result.positions == int(samples.mask.sum()) > 0
  np.testing.assert_allclose(list(result.alpha_by_lenience.values()), [1.0, 1.0], rtol=1e-5)


def test_sampled_alpha_is_the_mean_overlap_of_p_and_q(params, encoder_tokens):
  table = np.random.RandomState(6).randn(CONFIG.vocab_size, CONFIG.vocab_size) * 3
  samples = _samples(params, encoder_tokens, SAMPLED)
  result = measure.measured_alpha(samples, params, CONFIG, BigramDrafter(CONFIG.vocab_size),
                                  jnp.asarray(table), SAMPLED, lenience=(1.0, 0.3),
                                  batch_size=2)
  p = _target_probs(params, samples.encoder_tokens, samples.tokens)
  q = _softmax(table[np.pad(samples.tokens, ((0, 0), (1, 0)))[:, :-1]])
  for lenience in (1.0, 0.3):
    beta = np.minimum(p / lenience, q).sum(-1)
    np.testing.assert_allclose(result.alpha_by_lenience[lenience], beta[samples.mask].mean(),
                               rtol=1e-4)
  assert 0.0 < result.alpha < result.alpha_by_lenience[0.3] < 1.0


def test_greedy_alpha_is_the_argmax_agreement_rate(params, encoder_tokens):
  other = {'params': init_params(CONFIG, jax.random.PRNGKey(9))['params']}
  samples = _samples(params, encoder_tokens, GREEDY)
  result = measure.measured_alpha(samples, params, CONFIG, T5Drafter(CONFIG), other, GREEDY,
                                  lenience=(1.0, 0.5), batch_size=2)
  p = _target_probs(params, samples.encoder_tokens, samples.tokens)
  q = _target_probs(other, samples.encoder_tokens, samples.tokens)
  draft_argmax = q.argmax(-1)
  agree = draft_argmax == p.argmax(-1)
  np.testing.assert_allclose(result.alpha, agree[samples.mask].mean(), rtol=1e-6)
  # Lenient argmax (A.5): the draft passes when p(draft) >= l * max p.
  lenient = np.take_along_axis(p, draft_argmax[..., None], -1)[..., 0] >= 0.5 * p.max(-1)
  np.testing.assert_allclose(result.alpha_by_lenience[0.5], lenient[samples.mask].mean(),
                             rtol=1e-6)


def test_unigram_alpha_uses_its_one_distribution(params, encoder_tokens):
  logits = np.random.RandomState(8).randn(CONFIG.vocab_size)
  samples = _samples(params, encoder_tokens, SAMPLED)
  result = measure.measured_alpha(samples, params, CONFIG, UnigramDrafter(CONFIG.vocab_size),
                                  jnp.asarray(logits), SAMPLED, batch_size=2)
  p = _target_probs(params, samples.encoder_tokens, samples.tokens)
  beta = np.minimum(p, _softmax(logits)).sum(-1)
  np.testing.assert_allclose(result.alpha, beta[samples.mask].mean(), rtol=1e-4)


def test_timed_decode_loop_runs_every_step(params, encoder_tokens):
  """The loop whose slope is the step time really decodes num_steps times."""
  model = T5(CONFIG)

  @jax.jit  # The reference steps, each as a program of its own (not op by op).
  def empty_cache(params, encoder_tokens):
    encoded = model.apply(params, encoder_tokens, method=T5.encode)
    return model.apply(params, encoded, encoder_tokens, 12, method=T5.init_cache)

  @jax.jit
  def step(params, tokens, cache, end_index):
    cache = cache.replace(end_index=jnp.full((1,), end_index, jnp.int32))
    logits, cache = model.apply(params, tokens, cache, method=T5.decode)
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), cache

  cache = empty_cache(params, encoder_tokens[:1])
  tokens = jnp.ones((1, 3), jnp.int32)
  for i in range(5):
    tokens, cache = step(params, tokens, cache, i % 10)
  looped = measure._decode_steps(params, encoder_tokens[:1], 5, config=CONFIG,  # pylint: disable=protected-access
                                 tokens_per_step=3, cache_length=12)
  np.testing.assert_array_equal(np.asarray(looped), np.asarray(tokens))
  seconds = measure.decode_step_seconds(params, CONFIG, encoder_tokens[:1], 3, 12, (1, 3), 1)
  proposal = measure.propose_seconds(T5Drafter(CONFIG), params, encoder_tokens[:1], 3, 16,
                                     GREEDY, (1, 3), 1)
  assert np.isfinite(seconds) and np.isfinite(proposal)


def test_side_by_side_interleaves_decoders_item_by_item_in_balanced_orders():
  calls = []
  decoders = {name: (lambda n: lambda i: calls.append((n, i)) or jnp.zeros(()))(name)
              for name in 'abc'}
  totals = measure.time_side_by_side(decoders, num_items=2, repeats=3)
  warmup, timed = calls[:3], calls[3:]
  assert warmup == [('a', 0), ('b', 0), ('c', 0)]
  assert [i for _, i in timed] == [0, 0, 0, 1, 1, 1] * 3  # item by item, every decoder
  assert timed[:6] == [('a', 0), ('b', 0), ('c', 0), ('c', 1), ('b', 1), ('a', 1)]
  assert timed[6:9] == [('b', 0), ('c', 0), ('a', 0)]
  assert set(totals) == set('abc') and all(len(t) == 3 and min(t) >= 0
                                           for t in totals.values())


@pytest.mark.parametrize('count', [1, 2, 3, 4, 5, 6, 7])
def test_balanced_order_puts_every_decoder_after_every_other_equally_often(count):
  names = [chr(ord('a') + n) for n in range(count)]
  orders = [measure.balanced_order(names, k) for k in range(2 * count)]  # whole cycles
  assert all(sorted(order) == names for order in orders)
  after = collections.Counter((order[n], order[n + 1]) for order in orders
                              for n in range(count - 1))
  assert set(after) == {(x, y) for x in names for y in names if x != y}
  assert len(set(after.values())) <= 1  # each ordered pair equally often
  kept = {}
  measure.time_side_by_side({'a': lambda i: jnp.full((), i)}, num_items=3, repeats=2,
                            outputs=kept)
  assert [int(o) for o in kept['a']] == [0, 1, 2]  # The last repetition's outputs, in order.


# scripts/benchmark.py on tiny random models.

TINY = """
include 'gin/models/tiny_pair.gin'
benchmark.task = 'ende'
benchmark.target_model = @tiny_target/jaxspec.T5Config()
benchmark.t5_drafts = {'tiny': @tiny_draft/jaxspec.T5Config()}
benchmark.input_length = 16
benchmark.max_decode_length = 6
benchmark.max_gamma = 2
benchmark.alpha_tokens = 20
benchmark.lenience = (1.0, 0.5)
benchmark.other_drafters = ('bigram',)
benchmark.walltime_examples = 2
benchmark.repeats = 1
benchmark.step_repeats = 1
benchmark.sweep_examples = 2
benchmark.batch_sizes = (1, 2)
benchmark.batch_examples = 2
benchmark.reference_examples = 2
benchmark.options_gamma = 2
benchmark.options_temperatures = (0.0,)
benchmark.options_examples = 2
benchmark.options_num_drafts = (2,)  # k = 3: tests/test_multi_draft.py
"""


@pytest.fixture
def _unlocked_gin():
  yield
  gin.clear_config()


def _run_benchmark_script(tmp_path, checkpoints, bindings: str = ''):
  """scripts/benchmark.py's benchmark() on the TINY pair (random weights: the T5X
  checkpoints of tests/conftest.py's tiny_pair_checkpoints, copied under tmp_path) with
  extra gin bindings, output in tmp_path/out. -> (results, target config, draft config)."""
  for name in ('target', 'draft'):
    shutil.copytree(checkpoints / name, tmp_path / name)
  gin.clear_config()
  config = tmp_path / 'bench.gin'
  config.write_text(TINY + bindings + f"benchmark.target_checkpoint = '{tmp_path}/target'\n"
                    f"benchmark.draft_checkpoints = {{'tiny': '{tmp_path}/draft'}}\n"
                    f"benchmark.output_dir = '{tmp_path}/out'\n")
  gin_flags.parse([f'--gin_file={config}'])
  target = gin.query_parameter('benchmark.target_model').scoped_configurable_fn()
  draft = gin.query_parameter('benchmark.t5_drafts')['tiny'].scoped_configurable_fn()
  return benchmark_script.benchmark(), target, draft


def test_benchmark_script_writes_every_table(tmp_path, tiny_pair_checkpoints, _unlocked_gin):
  results, target, draft = _run_benchmark_script(tmp_path, tiny_pair_checkpoints)

  written = json.loads((tmp_path / 'out' / 'results.json').read_text())
  assert written['task'] == 'ende' and written['machine']['platform'] == 'cpu'
  drafters = {'t5 tiny', 'bigram'}
  assert {(r['drafter'], r['temperature']) for r in results['alpha']} == {
      (d, t) for d in drafters for t in (0.0, 1.0)}
  assert all(0.0 <= r['alpha'] <= 1.0 and r['positions'] >= 20 for r in results['alpha'])
  assert [(r['drafter'], r['temperature']) for r in results['table2']] == [
      ('t5 tiny', 0.0), ('t5 tiny', 1.0)]
  greedy = results['table2'][0]
  assert greedy['identical_outputs'] == greedy['examples'] == 2
  assert 1 <= greedy['gamma'] <= 2 and greedy['tokens_per_target_call'] >= 1.0
  assert [r['gamma'] for r in results['sweep']['rows']] == [1, 2]
  assert [r['batch_size'] for r in results['batch']] == [1, 2]
  assert all(r['identical_outputs'] == 2 for r in results['reference'])
  for row in results['table4']:
    assert np.isfinite([row['theorem_3_8_speedup'], row['verify_cost'], row['c']]).all()
  options = {r['option']: r for r in results['options']}
  assert list(options) == ['plain', 'block', 'coupled', 'adaptive', 'block + adaptive',
                           'multi-draft k=2']
  assert options['multi-draft k=2']['num_drafts'] == 2
  # Greedy block verification keeps token-wise verification's prefix exactly.
  assert options['block']['tokens_per_target_call'] == options['plain']['tokens_per_target_call']
  assert options['adaptive']['drafted_per_iteration'] <= 2.0
  for row in options.values():  # A call commits 1..gamma + 1 tokens; gamma is 2.
    assert 1.0 <= row['tokens_per_target_call'] <= 3.0 and 0.0 <= row['alpha'] <= 1.0
    assert row['seconds'] > 0 and row['speedup_vs_baseline'] > 0
    assert (row['examples'], row['repeats']) == (2, 1)
  assert options['plain']['speedup_vs_plain'] == 1.0
  markdown = (tmp_path / 'out' / 'results.md').read_text()
  assert '### Table 2' in markdown and '### Figure 3' in markdown
  assert '### Verification options' in markdown
  assert (tmp_path / 'out' / 'figure3_gamma.png').stat().st_size > 0
  assert (tmp_path / 'out' / 'batch_size.png').stat().st_size > 0

  # Alpha over more held-out inputs than the test split holds: test, then validation.
  setup = benchmark_script.Setup('ende', target, f'{tmp_path}/target', {'tiny': draft},
                                 {'tiny': f'{tmp_path}/draft'}, (), 16, 6,
                                 ('test', 'validation'))
  assert len(setup.alpha_inputs) == sum(len(corpora.load_split('ende', split))
                                        for split in ('test', 'validation'))
  np.testing.assert_array_equal(setup.alpha_inputs[:len(setup.inputs)], setup.inputs)
  with pytest.raises(ValueError, match='held out'):
    benchmark_script.benchmark(alpha_splits=('test', 'train'))


def test_verification_options_have_one_multi_draft_row_per_k():
  specs = measure.verification_option_specs(4, 0.5, (2, 3))
  assert list(specs) == ['plain', 'block', 'coupled', 'adaptive', 'block + adaptive',
                         'multi-draft k=2', 'multi-draft k=3']
  assert [specs[f'multi-draft k={k}'].num_drafts for k in (2, 3)] == [2, 3]
  assert {spec.gamma for spec in specs.values()} == {4}
  assert specs['block + adaptive'].verification == 'block'
  assert specs['block + adaptive'].draft_confidence_threshold == 0.5
  assert specs['coupled'].verification == 'coupled'


def test_benchmark_runs_the_int8_draft_made_from_the_target(tmp_path):
  """configs/benchmark/ende54m_int8.gin's route on the TINY target: an Int8Drafter among
  shared_encoder_drafts, named 'int8 <name>', made from the target's params (no
  checkpoint), decodes greedily as the baseline does."""
  target = dataclasses.replace(get_config('test_tiny_1_1'), vocab_size=8000)  # the corpus'
  save_t5x_checkpoint(tmp_path / 'target', init_params(target, jax.random.PRNGKey(0)), 1)
  drafter = Int8Drafter(target)
  assert benchmark_script.shared_encoder_label('decoder', drafter) == 'int8 decoder'
  setup = benchmark_script.Setup('ende', target, f'{tmp_path}/target', {}, {}, (), 16, 6,
                                 shared_encoder_drafts={'decoder': drafter})
  assert list(setup.drafters) == ['int8 decoder']
  rows = np.arange(2)
  greedy = SamplingConfig()
  speculative = setup.speculative(rows, greedy, 'int8 decoder', 2)
  np.testing.assert_array_equal(speculative.output.tokens, setup.baseline(rows, greedy).tokens)


def test_benchmark_beam_rows_compare_beam_and_speculative_beam(tmp_path, tiny_pair_checkpoints,
                                                               _unlocked_gin):
  beam_bindings = ("include 'gin/decoding/beam.gin'\n"
                   "benchmark.sections = ('beam',)\n"
                   "benchmark.other_drafters = ()\n"
                   "benchmark.beam = @jaxspec.BeamConfig()\n"
                   "benchmark.speculative_beam = @jaxspec.SpeculativeBeamConfig()\n"
                   "benchmark.beam_examples = 3\n"
                   "NUM_BEAMS = 2\nBEAM_GAMMA = 2\n")
  results, _, _ = _run_benchmark_script(tmp_path, tiny_pair_checkpoints, beam_bindings)

  assert set(results) >= {'beam'} and 'table2' not in results and 'alpha' not in results
  row = results['beam']
  assert (row['drafter'], row['num_beams'], row['draft_beams'], row['gamma']) == (
      't5 tiny', 2, 4, 2)
  assert row['examples'] == 3 and row['identical_tokens'] == 3
  assert row['max_score_difference'] <= 1e-5
  assert row['beam_bleu'] == row['speculative_beam_bleu']
  assert row['speculative_beam_target_calls'] <= row['beam_target_calls']
  assert row['beam_target_calls_per_token'] == row['beam_target_calls'] / row['tokens']
  assert row['search_steps_per_target_call'] >= 1.0 and row['speedup'] > 0
  markdown = (tmp_path / 'out' / 'results.md').read_text()
  assert '### Beam search against speculative beam search' in markdown


def test_beam_comparison_counts_calls_tokens_and_agreement():
  """Two items: the first identical, the second equal in tokens only."""
  plain = [BeamOutput(tokens=np.array([[[5, 1, 0], [4, 6, 1]]]), scores=np.array([[-2.0, -1.0]]),
                      steps=np.array(3)),
           BeamOutput(tokens=np.array([[[7, 1, 0], [7, 7, 7]]]), scores=np.array([[-3.0, -0.5]]),
                      steps=np.array(3))]
  speculative = [
      SpeculativeBeamOutput(output=plain[0], stats=SpeculativeBeamStats(
          target_calls=np.array(2), draft_calls=np.array(2), steps_per_call=np.array([0, 1, 1]))),
      SpeculativeBeamOutput(
          output=BeamOutput(tokens=plain[1].tokens, scores=np.array([[-3.0, -0.5 + 1e-6]]),
                            steps=np.array(3)),
          stats=SpeculativeBeamStats(target_calls=np.array(3), draft_calls=np.array(3),
                                     steps_per_call=np.array([0, 3, 0])))]
  row = measure.beam_comparison(plain, speculative, eos_id=1)
  assert row['tokens'] == 3 + 3  # [4, 6, 1] through EOS, and [7, 7, 7] without one.
  assert (row['beam_target_calls'], row['speculative_beam_target_calls']) == (6, 5)
  assert row['beam_target_calls_per_token'] == 1.0
  assert row['speculative_beam_target_calls_per_token'] == 5 / 6
  assert row['search_steps_per_target_call'] == 6 / 5
  assert (row['identical_tokens'], row['identical_tokens_and_scores']) == (2, 1)
  np.testing.assert_allclose(row['max_score_difference'], 1e-6, rtol=1e-3)
