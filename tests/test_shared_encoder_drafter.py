"""The encoder-sharing draft and its drafter.

- Model: T5X's decoder paths (checked against T5's own tree) with no encoder, the
  projection only when the widths differ; with the target's own decoder it computes
  the target's logits (T5 teacher forced is the reference); with a projection its
  cross-attention keys are (encoded @ P) @ W_k, computed by hand.
- Speculative decoding: greedy output token for token the baseline's for several
  gamma; the target's decoder as draft accepts every draft (so the draft reads the
  target's encoding, not something else); sampled output follows the target's exact
  distribution (chi-square against enumeration, tests/test_speculative.py's helpers).
- No encoder pass for the draft: T5.encode is traced once per generation (twice with a
  T5Drafter, the control).
- A layer-pruned draft (`from_target_decoder(params, layers)`) is the target's own
  layers in the order named; an int8 draft decoder (weights='int8') quantizes every
  per-step matrix and decodes the baseline's greedy output.
- Checkpoints round-trip in T5X's legacy layout; bad trees and widths are refused.
- scripts/infer.py takes the drafter by gin and decodes the baseline's outputs.
"""

import functools

import flax.traverse_util
import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_speculative as spec_tests  # tests/test_speculative.py: enumeration helpers
from jaxspec.launch import gin_flags
from jaxspec.launch import infer as infer_script
from jaxspec.measure import benchmark as measure
from jaxspec.checkpoints import shared_encoder_draft as draft_checkpoints
from jaxspec.checkpoints.t5x import save_t5x_checkpoint
from jaxspec.config import EOS_ID, get_config
from jaxspec.decoding import speculative
from jaxspec.decoding.drafters import (DraftContext, SharedEncoderDrafter,
                                       SharedEncoderDrafterWithTarget, T5Drafter)
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, abstract_params, init_params, rollback
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model import shared_encoder_draft as draft_model
from jaxspec.sampling import SamplingConfig

TARGET = spec_tests.TARGET  # test_tiny_1_1: emb_dim 32
NARROW = get_config('test_tiny_1_0').replace(emb_dim=16, num_heads=2, head_dim=8,
                                              num_decoder_layers=2)  # projected from 32
MAX_LEN = spec_tests.MAX_LEN


def _flat_shapes(tree):
  return {path: tuple(leaf.shape)
          for path, leaf in flax.traverse_util.flatten_dict(tree, sep='/').items()}


@functools.cache
def _narrow_params():
  return draft_model.init_params(NARROW, TARGET.emb_dim, jax.random.PRNGKey(3))


_PRUNED = TARGET.replace(num_decoder_layers=1)


@functools.cache
def _pruned_int8_params():
  """The target's decoder layer 1 alone, int8, as scripts/infer.py loads a checkpoint."""
  pruned = draft_model.from_target_decoder(spec_tests._target_params(), (1,))['params']
  return SharedEncoderDrafter(_PRUNED, TARGET.emb_dim, weights='int8').decoding_params(
      kernel_layout.t5x_kernels(jax.device_get(pruned)))


@functools.cache
def _greedy_run(name, gamma, confidence_threshold=0.0):
  drafter, params = {
      'narrow': (SharedEncoderDrafter(NARROW, TARGET.emb_dim), _narrow_params()),
      'target_decoder': (SharedEncoderDrafter(TARGET, TARGET.emb_dim),
                         draft_model.from_target_decoder(spec_tests._target_params())),
      'pruned_int8': (SharedEncoderDrafter(_PRUNED, TARGET.emb_dim, weights='int8'),
                      _pruned_int8_params()),
  }[name]
  return speculative_generate(
      spec_tests._target_params(), params, spec_tests._encoder_tokens(),
      target_config=TARGET, drafter=drafter,
      spec=SpeculativeConfig(gamma=gamma, draft_confidence_threshold=confidence_threshold),
      max_decode_length=MAX_LEN)


# ----------------------------------------------------------------------------------
# The model.


@pytest.mark.parametrize('config', [NARROW, TARGET], ids=['projected', 'same_width'])
def test_params_are_t5x_decoder_paths_without_an_encoder(config):
  shapes = _flat_shapes(draft_model.abstract_params(config, TARGET.emb_dim)['params'])
  t5_shapes = _flat_shapes(abstract_params(config)['params'])
  decoder_paths = {p: s for p, s in t5_shapes.items() if not p.startswith('encoder/')}
  projection = {'encoder_projection/kernel': (TARGET.emb_dim, config.emb_dim)}
  expected = {**decoder_paths, **(projection if config.emb_dim != TARGET.emb_dim else {})}
  assert shapes == expected


def test_target_decoder_draft_computes_the_target_logits():
  params = spec_tests._target_params()
  tokens = spec_tests._encoder_tokens()
  decoder_inputs = np.random.default_rng(0).integers(1, TARGET.vocab_size, (8, 6))
  decoder_inputs[:, 0] = 0
  encoded = jax.jit(functools.partial(T5(TARGET).apply, method=T5.encode))(params, tokens)
  logits = jax.jit(SharedEncoderDrafter(TARGET, TARGET.emb_dim).teacher_forced_logits)(
      draft_model.from_target_decoder(params), encoded, tokens, decoder_inputs)
  expected = jax.jit(T5(TARGET).apply)(params, tokens, decoder_inputs)
  np.testing.assert_allclose(logits, expected, rtol=1e-5, atol=1e-5)


def test_pruned_draft_is_the_named_target_layers_in_order():
  params = spec_tests._target_params()
  decoder = params['params']['decoder']
  pruned = draft_model.from_target_decoder(params, (1, 0))['params']
  assert 'encoder' not in pruned and set(pruned['decoder']) == set(decoder)
  for i, layer in enumerate((1, 0)):
    jax.tree_util.tree_map(np.testing.assert_array_equal, pruned['decoder'][f'layers_{i}'],
                           decoder[f'layers_{layer}'])
  jax.tree_util.tree_map(np.testing.assert_array_equal, pruned['decoder']['decoder_norm'],
                         decoder['decoder_norm'])
  only_last = draft_model.from_target_decoder(params, (1,))['params']['decoder']
  assert sorted(n for n in only_last if n.startswith('layers_')) == ['layers_0']
  for bad in [(), (2,), (0, 0)]:
    with pytest.raises(ValueError, match='layers must name distinct target decoder layers'):
      draft_model.from_target_decoder(params, bad)


def test_int8_weights_quantize_every_step_matrix_but_the_encoding_projections():
  flat = flax.traverse_util.flatten_dict(_pruned_int8_params()['params'], sep='/')
  attention = 'decoder/layers_0/encoder_decoder_attention'
  assert flat[f'{attention}/key/kernel_t'].dtype == np.float32
  assert flat[f'{attention}/value/kernel_t'].dtype == np.float32
  assert flat[f'{attention}/query/kernel_int8'].dtype == np.int8
  assert flat['decoder/layers_0/mlp/wo/kernel_int8'].dtype == np.int8
  assert not [p for p in flat if p.endswith('/kernel') or (
      p.endswith('/kernel_t') and 'encoder_decoder_attention/key' not in p
      and 'encoder_decoder_attention/value' not in p)]
  with pytest.raises(ValueError, match="weights must be one of"):
    SharedEncoderDrafter(_PRUNED, TARGET.emb_dim, weights='int4')


def test_pruned_int8_draft_greedy_equals_baseline():
  result = _greedy_run('pruned_int8', 3)
  np.testing.assert_array_equal(result.output.tokens, spec_tests._baseline().tokens)
  spec_tests._check_stats(result, 3)


def test_projection_feeds_the_cross_attention():
  params = _narrow_params()
  tokens = spec_tests._encoder_tokens()
  encoded = np.asarray(jax.jit(functools.partial(T5(TARGET).apply, method=T5.encode))(
      spec_tests._target_params(), tokens))  # [b, s, 32]
  cache = SharedEncoderDrafter(NARROW, TARGET.emb_dim).init_state_from_target(
      params, tokens, encoded, 20)
  tree = params['params']
  projection = np.asarray(tree['encoder_projection']['kernel'])  # [32, 16]
  for i, layer_cache in enumerate(cache.layers):
    key_kernel = np.asarray(tree['decoder'][f'layers_{i}']['encoder_decoder_attention']['key']
                            ['kernel'])  # [16, h*d]
    expected = (encoded @ projection @ key_kernel).reshape(encoded.shape[:2] + (2, 8))
    # The cache layout [b, h, d, s].
    np.testing.assert_allclose(layer_cache.cross_keys, expected.transpose(0, 2, 3, 1),
                               rtol=1e-4, atol=1e-5)
    assert layer_cache.self_keys.shape == (8, NARROW.num_heads, NARROW.head_dim, 20)
  np.testing.assert_array_equal(cache.encoder_mask, tokens > 0)
  np.testing.assert_array_equal(cache.end_index, 0)
  np.testing.assert_array_equal(rollback(cache, jnp.full((8,), 3)).end_index, 3)


# ----------------------------------------------------------------------------------
# Exactness inside speculative decoding.


@pytest.mark.parametrize('gamma', [1, 4])
def test_greedy_equals_baseline(gamma):
  result = _greedy_run('narrow', gamma)
  np.testing.assert_array_equal(result.output.tokens, spec_tests._baseline().tokens)
  spec_tests._check_stats(result, gamma)


def test_greedy_adaptive_gamma_stops_on_the_draft_confidence_and_equals_baseline():
  # At temperature 0 q is one-hot; the confidence is the draft softmax's largest
  # probability, so rows stop drafting at every length (not always gamma).
  gamma = 4
  result = _greedy_run('narrow', gamma, confidence_threshold=0.5)
  np.testing.assert_array_equal(result.output.tokens, spec_tests._baseline().tokens)
  drafted = np.asarray(result.stats.num_drafted_counts)
  assert drafted[0] == 0 and drafted[1] > 0 and drafted[1:gamma].sum() > 0, drafted


@pytest.mark.parametrize('gamma', [3])
def test_target_decoder_as_draft_accepts_every_draft(gamma):
  result = _greedy_run('target_decoder', gamma)
  np.testing.assert_array_equal(result.output.tokens, spec_tests._baseline().tokens)
  # Every proposed draft is accepted (proposals end at gamma or a drafted EOS).
  counts = np.asarray(result.stats.num_accepted_counts)
  np.testing.assert_array_equal(counts, result.stats.num_drafted_counts)
  assert counts[gamma] > 0
  assert float(result.stats.alpha) == 1.0


SAMPLED_DRAFT = spec_tests.SMALL.replace(emb_dim=8, num_heads=1)


@pytest.mark.parametrize('case', ['top_k3'])
def test_sampled_output_follows_the_target_distribution(case):
  sampling, gamma, length = spec_tests.SAMPLED_CASES[case]
  params = draft_model.init_params(SAMPLED_DRAFT, spec_tests.SMALL.emb_dim,
                                   jax.random.PRNGKey(5))
  result = speculative_generate(
      spec_tests._small_target_params(), params, spec_tests._small_encoder_tokens(),
      jax.random.PRNGKey(11), target_config=spec_tests.SMALL,
      drafter=SharedEncoderDrafter(SAMPLED_DRAFT, spec_tests.SMALL.emb_dim),
      spec=SpeculativeConfig(gamma=gamma), max_decode_length=length, sampling=sampling)
  spec_tests._assert_matches(result.output.tokens,
                             *spec_tests._exact_joint('target', sampling, length))
  spec_tests._check_stats(result, gamma)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[gamma] > 0  # Both the residual and the bonus path ran.


def test_the_draft_never_runs_an_encoder(monkeypatch):
  target_params, narrow_params, draft_params = (
      spec_tests._target_params(), _narrow_params(), spec_tests._draft_params())
  encode_calls = []
  original_encode = T5.encode

  def counting_encode(self, encoder_tokens):
    encode_calls.append(self.role)
    return original_encode(self, encoder_tokens)

  monkeypatch.setattr(T5, 'encode', counting_encode)

  def trace(drafter, drafter_params):  # Traced, not compiled; shapes used nowhere else.
    encode_calls.clear()
    jax.eval_shape(functools.partial(
        speculative._speculative_generate, target_config=TARGET, drafter=drafter,
        spec=SpeculativeConfig(gamma=2), max_decode_length=5, sampling=SamplingConfig(),
        eos_id=EOS_ID), target_params, drafter_params, spec_tests._encoder_tokens()[:3, :9],
        jax.random.PRNGKey(0))
    return sorted(encode_calls)

  assert trace(SharedEncoderDrafter(NARROW, TARGET.emb_dim), narrow_params) == ['target']
  assert trace(T5Drafter(spec_tests.DRAFT), draft_params) == ['draft', 'target']  # Control.


# ----------------------------------------------------------------------------------
# Stand-alone use, checkpoints and errors.


def test_stand_alone_drafter_proposes_what_the_shared_one_does():
  tokens = spec_tests._encoder_tokens()
  drafter = SharedEncoderDrafter(NARROW, TARGET.emb_dim)
  alone = SharedEncoderDrafterWithTarget(drafter, TARGET)
  params = {'draft': _narrow_params(), 'target': spec_tests._target_params()}
  encoded = T5(TARGET).apply(spec_tests._target_params(), tokens, method=T5.encode)
  shared_state = drafter.init_state_from_target(_narrow_params(), tokens, encoded, 12)
  jax.tree_util.tree_map(np.testing.assert_array_equal,
                         alone.init_state(params, tokens, 12), shared_state)
  with pytest.raises(ValueError, match='init_state_from_target'):
    drafter.init_state(_narrow_params(), tokens, 12)
  with pytest.raises(ValueError, match='emb_dim 32 differs'):
    SharedEncoderDrafterWithTarget(SharedEncoderDrafter(NARROW, 24), TARGET)


def test_benchmark_teacher_forced_q_is_what_the_drafter_proposes():
  # The benchmark's teacher-forced alpha path against the drafter's own proposals,
  # one per prefix from a state carried along as speculative decoding carries it.
  drafter = SharedEncoderDrafterWithTarget(SharedEncoderDrafter(NARROW, TARGET.emb_dim), TARGET)
  params = {'draft': _narrow_params(), 'target': spec_tests._target_params()}
  tokens, outputs = spec_tests._encoder_tokens(), spec_tests._baseline().tokens[:, :6]
  sampling = SamplingConfig(temperature=1.0)
  teacher_forced = measure.drafter_probs(drafter, params, tokens, outputs, sampling)
  propose = jax.jit(functools.partial(drafter.propose, gamma=1, sampling=sampling))
  state = drafter.init_state(params, tokens, 8)
  keys = jax.random.split(jax.random.PRNGKey(0), len(tokens))
  for length in range(1, 6):
    context = DraftContext(tokens=outputs, length=jnp.full((len(tokens),), length),
                           encoder_tokens=tokens)
    _, probs, state = propose(params, state, context, keys=keys)
    np.testing.assert_allclose(teacher_forced[:, length], probs[:, 0], rtol=1e-5, atol=1e-6)


def test_wrong_encoder_width_is_refused():
  tokens = spec_tests._encoder_tokens()
  with pytest.raises(ValueError, match='encoder_dim=24'):
    SharedEncoderDrafter(NARROW, 24).init_state_from_target(
        _narrow_params(), tokens, jnp.zeros(tokens.shape + (32,)), 12)


def test_checkpoint_round_trip_and_checks(tmp_path):
  params = _narrow_params()
  draft_checkpoints.save(tmp_path, params, 7)
  loaded = draft_checkpoints.load(tmp_path, NARROW, TARGET.emb_dim)
  jax.tree_util.tree_map(np.testing.assert_array_equal, loaded, dict(params['params']))
  with pytest.raises(ValueError, match="unexpected 'encoder_projection/kernel'"):
    draft_checkpoints.load(tmp_path, NARROW, NARROW.emb_dim)  # Equal widths: no projection.
  with pytest.raises(ValueError, match="'encoder_projection/kernel' has shape"):
    draft_checkpoints.load(tmp_path, NARROW, 24)
  with pytest.raises(ValueError, match="unexpected 'encoder/"):
    draft_checkpoints.check_params(init_params(NARROW, jax.random.PRNGKey(0)),
                                   NARROW, NARROW.emb_dim)


def test_infer_launcher_takes_the_drafter_by_gin(tmp_path):
  config = tmp_path / 'config.gin'
  config.write_text(f"""
include 'gin/models/tiny_pair.gin'
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
infer.target_model = @tiny_target/jaxspec.T5Config()
infer.drafter = @jaxspec.SharedEncoderDrafter()
jaxspec.SharedEncoderDrafter.config = @tiny_draft/jaxspec.T5Config()
jaxspec.SharedEncoderDrafter.encoder_dim = 16
infer.draft_name = 'tiny shared encoder'
infer.max_decode_length = 8
infer.num_examples = 4
infer.batch_size = 2
GAMMA = 2
infer.target_checkpoint = '{tmp_path}/target'
infer.draft_checkpoint = '{tmp_path}/draft'
infer.output_dir = '{tmp_path}/out'
""")
  gin.clear_config()
  try:
    gin_flags.parse([f'--gin_file={config}'])
    target = gin.query_parameter('infer.target_model').scoped_configurable_fn()
    draft = gin.query_parameter(
        'jaxspec.SharedEncoderDrafter.config').scoped_configurable_fn()
    save_t5x_checkpoint(tmp_path / 'target', init_params(target, jax.random.PRNGKey(0)), 1)
    draft_checkpoints.save(tmp_path / 'draft', draft_model.init_params(
        draft, target.emb_dim, jax.random.PRNGKey(1)), 1)
    summary = infer_script.infer()
  finally:
    gin.clear_config()
  assert summary['examples'] == 4 and summary['identical_outputs'] == 4
  assert 0.0 <= summary['alpha'] <= 1.0
