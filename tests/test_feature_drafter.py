"""jaxspec.decoding.drafters.feature (FeatureDrafter), jaxspec.model.feature_draft and
jaxspec.training.feature_draft: a feature-level draft head over the target's hidden states.

- Training: the head, trained a few hundred steps against a tiny target, agrees with the
  target's argmax far more often than at its start (on the target's own greedy outputs).
- Proposals: every proposal of a speculative decode equals a from-scratch reference that
  runs the target teacher forced over the committed prefix and the head over every slot
  again (no cache, no catch-up): a stale feature, a missed catch-up after a full accept or
  a stale cache slot changes a draft. Poisoned slots past the committed length change none.
- Exactness: greedy output token for token the baseline's in every verification mode
  (token, block, coupled, adaptive gamma, shorter verify steps, a token tree); coupled
  sampling the baseline's draws; token-wise and block sampling the target's exact
  distribution (the enumeration of tests/test_speculative.py).
- Fused features (feature_layers, as EAGLE-3): the verify step's layer outputs are those
  of the target cut after each layer; a head trained on h alone, widened, drafts as it
  did; trained over the layers it proposes as the from-scratch reference does, and is
  exact in every verification mode.
- Params: the checkpoint round trip and the errors of a wrong head.
"""

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_scripts  # tests/test_scripts.py: the tiny pair's launcher configs
import test_speculative as spec_tests  # tests/test_speculative.py: models, enumeration
from test_scripts import _unlocked_gin, tiny_checkpoints  # noqa: F401  (fixtures)
from jaxspec.checkpoints import feature_draft as head_checkpoints
from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import (DraftSources, FeatureDrafter, Int8Drafter,
                                       StagedDrafter)
from jaxspec.decoding.drafters.base import DraftContext
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, feature_draft
from jaxspec.sampling import SamplingConfig
from jaxspec.training import core as training, feature_draft as feature_training

TARGET = spec_tests.TARGET
MAX_LEN = spec_tests.MAX_LEN
GREEDY = SamplingConfig(temperature=0.0)
TRAIN_STEPS = 300


def _random_inputs(rows, seed):
  rng = np.random.default_rng(seed)
  tokens = rng.integers(2, TARGET.vocab_size, (rows, 10)).astype(np.int32)
  lengths = rng.integers(1, 11, rows)
  tokens[np.arange(10)[None, :] >= lengths[:, None]] = 0
  return tokens


def _greedy_batches(target_params, inputs, batch_size=64):
  """Batches of inputs and the target's greedy outputs (training's teacher forcing)."""
  outputs = generate(target_params, inputs, config=TARGET, max_decode_length=MAX_LEN,
                     sampling=GREEDY)
  tokens, lengths = np.asarray(outputs.tokens), np.asarray(outputs.lengths)
  pairs = [(list(row[row > 0]), list(out[:n])) for row, out, n in zip(inputs, tokens, lengths)]
  return [training.pad_batch(pairs[i:i + batch_size])
          for i in range(0, len(pairs), batch_size)]


def _agreement(head, batches, target_params, config, feature_layers=()):
  sums = [feature_training.eval_step(head, b, target_params, config=config,
                                     target_config=TARGET, unroll=2,
                                     feature_layers=feature_layers) for b in batches]
  return np.sum([s[0] for s in sums], axis=0) / np.sum([s[1] for s in sums])


@functools.cache
def _batches():
  """(training batches, held-out batches) on the target's greedy outputs."""
  target_params = spec_tests._target_params()
  return (_greedy_batches(target_params, _random_inputs(512, 0)),
          _greedy_batches(target_params, _random_inputs(128, 1)))


def _train(head, config, num_steps, feature_layers=()):
  target_params = spec_tests._target_params()
  train = _batches()[0]
  optimizer = training.make_optimizer(
      training.OptimizerConfig(name='adamw', learning_rate=3e-3, warmup_steps=20,
                               decay='cosine'), num_steps)
  loss = feature_training.FeatureLossConfig()
  head = jax.tree_util.tree_map(jnp.array, head)
  state = optimizer.init(head)
  for step in range(num_steps):
    head, state, _ = feature_training.train_step(
        head, state, train[step % len(train)], target_params, jax.random.PRNGKey(step),
        config=config, target_config=TARGET, optimizer=optimizer, loss=loss,
        feature_layers=feature_layers)
  return jax.device_get(head)


@functools.cache
def _training():
  """(head config, initial head, trained head, agreement before, agreement after)."""
  target_params = spec_tests._target_params()
  config = feature_draft.head_config(TARGET, 1)
  head = feature_draft.from_target(target_params, config, jax.random.PRNGKey(0))['params']
  initial = jax.tree_util.tree_map(np.array, jax.device_get(head))
  held_out = _batches()[1]
  before = _agreement(head, held_out, target_params, config)
  trained = _train(head, config, TRAIN_STEPS)
  return config, initial, trained, before, _agreement(trained, held_out, target_params, config)


FUSED = (1, 0)  # the target's decoder layers a fused head reads beside h (out of order)
FUSED_STEPS = 150


@functools.cache
def _fused_training():
  """(the trained head widened to read FUSED, its agreement, that head trained further
  over FUSED, its agreement), agreements on the held-out batches."""
  config, _, trained, _, _ = _training()
  target_params = spec_tests._target_params()
  widened = feature_draft.with_feature_layers(trained, config, len(FUSED))['params']
  held_out = _batches()[1]
  fused = _train(widened, config, FUSED_STEPS, FUSED)
  return (widened, _agreement(widened, held_out, target_params, config, FUSED), fused,
          _agreement(fused, held_out, target_params, config, FUSED))


@functools.cache
def _drafter_params(feature_layers=()):
  head = _fused_training()[2] if feature_layers else _training()[2]
  return FeatureDrafter.make_params(head, spec_tests._target_params())


def test_training_raises_agreement_with_the_target():
  _, _, _, before, after = _training()
  assert after[0] > before[0] + 0.3, (before, after)
  assert after[0] > 0.5 and after[1] > 0.4, after


def test_feature_layers_are_the_outputs_of_the_target_cut_after_them():
  # decode_with_features(feature_layers=(1, 0)): h, then layer 1's output, then layer 0's,
  # each RMS-normalized without a scale; times the final norm's scale, layer i's is the
  # final hidden state of the target cut after layer i (the same weights, fewer layers).
  params = spec_tests._target_params()
  encoder_tokens = jnp.asarray(spec_tests._encoder_tokens()[:3])
  tokens = jnp.asarray(np.random.default_rng(0).integers(2, TARGET.vocab_size, (3, 5)),
                       jnp.int32)

  def run(config, variables, feature_layers=()):
    model = T5(config)
    encoded = model.apply(variables, encoder_tokens, method=T5.encode)
    cache = model.apply(variables, encoded, encoder_tokens, 8, method=T5.init_cache)
    return model.apply(variables, tokens, cache, feature_layers=feature_layers,
                       method=T5.decode_with_features)

  logits, h, _ = run(TARGET, params)
  fused_logits, fused, _ = run(TARGET, params, FUSED)
  width = TARGET.emb_dim
  assert fused.shape == (3, 5, 3 * width)
  np.testing.assert_array_equal(np.asarray(fused_logits), np.asarray(logits))
  np.testing.assert_array_equal(np.asarray(fused[..., :width]), np.asarray(h))
  scale = np.asarray(params['params']['decoder']['decoder_norm']['scale'])
  cut = jax.tree_util.tree_map(lambda x: x, params)
  del cut['params']['decoder']['layers_1']
  _, cut_h, _ = run(TARGET.replace(num_decoder_layers=1), cut)
  for column, want in ((1, h), (2, cut_h)):  # layer 1 (the last), then layer 0
    got = np.asarray(fused[..., column * width:(column + 1) * width]) * scale
    np.testing.assert_allclose(got, np.asarray(want), rtol=1e-5, atol=1e-5)
  assert not np.allclose(np.asarray(cut_h), np.asarray(h), atol=1e-2)


def test_a_widened_head_drafts_as_it_did_and_trains_over_the_layers():
  widened, widened_agreement, fused, fused_agreement = _fused_training()
  config, _, trained, _, trained_agreement = _training()
  kernel = np.asarray(widened['fuse']['kernel'])
  assert kernel.shape == (4 * TARGET.emb_dim, TARGET.emb_dim)
  assert not kernel[2 * TARGET.emb_dim:].any()
  np.testing.assert_array_equal(kernel[:2 * TARGET.emb_dim],
                                np.asarray(trained['fuse']['kernel']))
  np.testing.assert_allclose(widened_agreement, trained_agreement, atol=0.01)
  # Trained over the layers' outputs: the new rows are used, and agreement holds or rises.
  assert np.abs(np.asarray(fused['fuse']['kernel'])[2 * TARGET.emb_dim:]).max() > 1e-3
  assert fused_agreement[0] >= widened_agreement[0] - 0.02, (widened_agreement,
                                                              fused_agreement)
  # A prediction (h alone) reads zeros for the layers; any other width is refused.
  predicted = jnp.ones((1, 2, TARGET.emb_dim))
  np.testing.assert_array_equal(
      np.asarray(feature_draft.as_read(predicted, TARGET.emb_dim, 2))[..., TARGET.emb_dim:], 0)
  with pytest.raises(ValueError, match='reads 32 or 96'):
    feature_draft.as_read(jnp.ones((1, 2, 64)), TARGET.emb_dim, 2)
  with pytest.raises(ValueError, match='more target layers than 1'):
    feature_draft.with_feature_layers(widened, config, 1)
  # Started from the target over two layers: the head of h alone, with zero rows for them.
  target_params = spec_tests._target_params()
  alone, over_two = (feature_draft.from_target(target_params, config, jax.random.PRNGKey(0),
                                               num_feature_layers=n)['params'] for n in (0, 2))
  head_checkpoints.check_params(over_two, config, 2)
  np.testing.assert_array_equal(
      np.asarray(over_two['fuse']['kernel']),
      np.concatenate([alone['fuse']['kernel'], np.zeros((2 * TARGET.emb_dim, TARGET.emb_dim))]))
  assert jax.tree_util.tree_all(jax.tree_util.tree_map(
      np.array_equal, alone['decoder'], over_two['decoder']))


# ----------------------------------------------------------------------------------
# Proposals against a from-scratch reference.


REFERENCE_LENGTH = MAX_LEN + 4  # every committed prefix and a proposal after it


@functools.cache
def _reference_programs(feature_layers=()):
  """(target features over fixed-length inputs, the head over every slot and its logits),
  jitted at REFERENCE_LENGTH: causal attention makes slot j's values those of the slots up
  to j alone, whatever the padding after them."""
  config, target_params = _training()[0], spec_tests._target_params()
  model = T5(TARGET)
  head = feature_draft.FeatureDraft(config, num_feature_layers=len(feature_layers))

  @jax.jit
  def target_features(encoder_row, inputs):  # [1, s], [1, T] -> [1, T, e (1 + n)], cache
    encoded = model.apply(target_params, encoder_row, method=T5.encode)
    cache = model.apply(target_params, encoded, encoder_row, REFERENCE_LENGTH,
                        method=T5.init_cache)
    _, features, cache = model.apply(target_params, inputs, cache,
                                     feature_layers=feature_layers,
                                     method=T5.decode_with_features)
    return features, cache

  @jax.jit
  def head_over_slots(head_params, slot_features, inputs, target_cache):
    """[1, T, e] features and [1, T] inputs of slots 0..T-1 -> predicted [1, T, e],
    logits [1, T, v], with no cache carried over: every slot computed afresh."""
    head_cache = feature_draft.init_cache(config, target_cache, REFERENCE_LENGTH)
    embeddings = model.apply(target_params, inputs, method=T5.embed)
    predicted, _ = head.apply({'params': head_params}, slot_features, embeddings, head_cache)
    return predicted, model.apply(target_params, predicted, method=T5.logits_from_features)

  return target_features, head_over_slots


def _reference_drafts(encoder_row, prefix, gamma, feature_layers=()):
  """The greedy drafts after `prefix` (committed tokens x_1..x_L), computed from scratch:
  the target teacher forced over x_0..x_L for h_0..h_{L-1} (and the feature layers'
  outputs), then for each draft the head over every slot (the target's features up to
  slot L, its own predictions after it, with zeros for the layers' outputs).
  -> (drafts [gamma], the margin of each draft's logit over the runner-up)."""
  target_features, head_over_slots = _reference_programs(feature_layers)
  head = _fused_training()[2] if feature_layers else _training()[2]
  length = len(prefix)
  inputs = np.zeros((1, REFERENCE_LENGTH), np.int32)
  inputs[0, 1:length + 1] = prefix  # x_0 = 0
  true_features, cache = target_features(jnp.asarray(encoder_row)[None], jnp.asarray(inputs))
  width = TARGET.emb_dim * (1 + len(feature_layers))
  slot_features = np.zeros((1, REFERENCE_LENGTH, width), np.float32)
  slot_features[0, 1:length + 1] = np.asarray(true_features)[0, :length]  # slot j: h_{j-1}
  drafts, margins = [], []
  for i in range(gamma):
    predicted, logits = head_over_slots(head, jnp.asarray(slot_features),
                                        jnp.asarray(inputs), cache)
    slot = length + i  # the slot whose prediction is draft i + 1
    row = np.asarray(logits)[0, slot]
    top = np.sort(row)[-2:]
    drafts.append(int(np.argmax(row)))
    margins.append(float(top[1] - top[0]))
    inputs[0, slot + 1] = drafts[-1]
    slot_features[0, slot + 1, :TARGET.emb_dim] = np.asarray(predicted)[0, slot]
  return drafts, margins


@functools.cache
def _traced_run(gamma, feature_layers=()):
  return speculative_generate(
      spec_tests._target_params(), _drafter_params(feature_layers),
      spec_tests._encoder_tokens(), target_config=TARGET,
      drafter=FeatureDrafter(TARGET, feature_layers=feature_layers),
      spec=SpeculativeConfig(gamma=gamma), max_decode_length=MAX_LEN, sampling=GREEDY,
      record_trace=True)


@pytest.mark.parametrize('feature_layers', [(), FUSED], ids=['h', 'fused'])
def test_every_proposal_equals_the_from_scratch_reference(feature_layers):
  gamma = 3
  result = _traced_run(gamma, feature_layers)
  trace = jax.device_get(result.trace)
  encoder_tokens = spec_tests._encoder_tokens()
  compared = full_accepts = caught_up_windows = 0
  for row in range(encoder_tokens.shape[0]):
    prefix = []
    for t in range(MAX_LEN):
      if trace.committed[row, t] == 0:
        break
      proposed = int(trace.num_drafts[row, t])
      reference, margins = _reference_drafts(encoder_tokens[row], prefix, gamma,
                                             feature_layers)
      for i in range(proposed):
        if margins[i] > 1e-4:  # a near tie may round either way in another shape
          assert trace.drafts[row, t, i] == reference[i], (row, t, i, prefix)
          compared += 1
        if trace.drafts[row, t, i] != reference[i]:
          break  # later reference drafts follow another prefix
      accepted = int(trace.num_accepted[row, t])
      full_accepts += accepted == gamma
      caught_up_windows += accepted > 0
      step = list(trace.drafts[row, t, :accepted]) + [int(trace.next_token[row, t])]
      prefix += [int(x) for x in step[:int(trace.committed[row, t])]]
  np.testing.assert_array_equal(np.asarray(result.output.tokens),
                                np.asarray(spec_tests._baseline().tokens))
  # The reference was compared where it matters: after full accepts (a window of gamma + 1
  # true features next) and after partial ones.
  assert compared > 30 and full_accepts >= 2 and caught_up_windows >= 5, (
      compared, full_accepts, caught_up_windows)


def test_slots_past_the_committed_length_are_never_read():
  # A state mid-decode: poison every feature slot past `length` and every cache slot at
  # or past `caught_up`; the proposal must not change. (Large finite values: a masked
  # NaN would still reach the attention's output as 0 * NaN, in any implementation.)
  drafter, params = FeatureDrafter(TARGET), _drafter_params()
  target_params = spec_tests._target_params()
  encoder_tokens = spec_tests._encoder_tokens()[:4]
  model = T5(TARGET)
  encoded = model.apply(target_params, encoder_tokens, method=T5.encode)
  target_cache = model.apply(target_params, encoded, encoder_tokens, MAX_LEN + 4,
                             method=T5.init_cache)
  state = drafter.init_state_for_decode(params, encoder_tokens, encoded, MAX_LEN + 3,
                                        target_cache)
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, TARGET.vocab_size, (4, MAX_LEN)).astype(np.int32)
  length = np.array([0, 2, 5, 3], np.int32)
  tokens[np.arange(MAX_LEN)[None, :] >= length[:, None]] = 0
  caught_up = np.maximum(length - np.array([0, 1, 3, 0]), 0).astype(np.int32)
  features = rng.standard_normal(state.slot_features.shape).astype(np.float32)
  context = DraftContext(tokens=jnp.asarray(tokens), length=jnp.asarray(length),
                         encoder_tokens=jnp.asarray(encoder_tokens))

  def propose(poison):
    slots = np.arange(features.shape[1])[None, :, None]
    slot_features = np.where(slots > length[:, None, None], poison, features)
    cache = state.cache
    if poison != 0:  # slots from caught_up on hold whatever the head last wrote there
      layers = []
      for layer in cache.layers:
        poisoned = lambda x: jnp.where(  # noqa: E731
            jnp.arange(x.shape[3])[None, None, None, :] >= caught_up[:, None, None, None],
            poison, x)
        layers.append(layer.replace(self_keys=poisoned(layer.self_keys),
                                    self_values=poisoned(layer.self_values)))
      cache = cache.replace(layers=tuple(layers))
    poisoned_state = state.replace(slot_features=jnp.asarray(slot_features),
                                   caught_up=jnp.asarray(caught_up), cache=cache)
    drafts, probs, new_state = drafter.propose(params, poisoned_state, context, 3, GREEDY,
                                               jax.random.split(jax.random.PRNGKey(0), 4))
    return np.asarray(drafts), np.asarray(probs), new_state

  clean, clean_probs, new_state = propose(0.0)
  poisoned, poisoned_probs, _ = propose(1e4)
  np.testing.assert_array_equal(poisoned, clean)
  np.testing.assert_array_equal(poisoned_probs, clean_probs)
  np.testing.assert_array_equal(np.asarray(new_state.caught_up), length + 1)
  # A feature at or before `length` is read: poisoning slot `length` changes the drafts.
  features[:, :, :] = np.where(np.arange(features.shape[1])[None, :, None] == length[:, None, None],
                               features * 5.0, features)
  moved, _, _ = propose(0.0)
  assert (moved != clean).any()


# ----------------------------------------------------------------------------------
# Exactness in every mode.


GREEDY_SPECS = {
    'token_gamma1': SpeculativeConfig(gamma=1),
    'token_gamma4': SpeculativeConfig(gamma=4),
    'block': SpeculativeConfig(gamma=3, verification='block'),
    'coupled': SpeculativeConfig(gamma=3, verification='coupled'),
    'adaptive': SpeculativeConfig(gamma=4, draft_confidence_threshold=0.6),
    'verify_lengths': SpeculativeConfig(gamma=4, verify_lengths=(2, 3)),
    'tree': SpeculativeConfig(gamma=2, num_drafts=3),
}


# A fused head in the modes whose verify steps differ (one step, one of several lengths,
# a tree) and in coupled verification.
FUSED_GREEDY = ('token_gamma4', 'coupled', 'verify_lengths', 'tree')


@pytest.mark.parametrize('name,feature_layers',
                         [pytest.param(name, (), id=name) for name in GREEDY_SPECS]
                         + [pytest.param(name, FUSED, id=f'{name}-fused')
                            for name in FUSED_GREEDY])
def test_greedy_output_is_the_baselines(name, feature_layers):
  result = speculative_generate(
      spec_tests._target_params(), _drafter_params(feature_layers),
      spec_tests._encoder_tokens(), target_config=TARGET,
      drafter=FeatureDrafter(TARGET, feature_layers=feature_layers), spec=GREEDY_SPECS[name],
      max_decode_length=MAX_LEN, sampling=GREEDY, record_trace=True)
  np.testing.assert_array_equal(np.asarray(result.output.tokens),
                                np.asarray(spec_tests._baseline().tokens))
  np.testing.assert_array_equal(np.asarray(result.output.lengths),
                                np.asarray(spec_tests._baseline().lengths))
  assert float(result.stats.alpha) > 0.4  # the trained head drafts, not chance
  spec = GREEDY_SPECS[name]
  spec_tests._check_trace(result, spec.gamma, adaptive=name == 'adaptive',
                          cut_at_eos=name != 'tree')


def test_int8_head_is_exact_and_agrees_as_the_float32_head():
  params = FeatureDrafter.make_params(_training()[2], spec_tests._target_params(), 'int8')
  leaves = jax.tree_util.tree_leaves(params)
  assert any(leaf.dtype == jnp.int8 for leaf in leaves)
  spec = SpeculativeConfig(gamma=3)
  runs = [speculative_generate(
      spec_tests._target_params(), p, spec_tests._encoder_tokens(), target_config=TARGET,
      drafter=FeatureDrafter(TARGET, weights=w), spec=spec, max_decode_length=MAX_LEN,
      sampling=GREEDY) for p, w in ((params, 'int8'), (_drafter_params(), 'float32'))]
  np.testing.assert_array_equal(np.asarray(runs[0].output.tokens),
                                np.asarray(spec_tests._baseline().tokens))
  assert abs(float(runs[0].stats.alpha) - float(runs[1].stats.alpha)) < 0.1
  with pytest.raises(ValueError, match='weights in'):
    FeatureDrafter(TARGET, weights='int4')


def test_head_in_the_accelerators_fused_layout_drafts_as_in_t5xs():
  # On GPUs and TPUs for_decoding stacks the head's q/k/v and wi_0/wi_1 (the accelerator
  # decode layout); with XLA's products on the CPU both layouts draft alike.
  from jaxspec.model.accelerator import layout as accelerator_layout
  config = TARGET.replace(cpu_matmul='xla')
  head = {'params': _training()[2]}
  fused = accelerator_layout.fused_kernels(head)
  assert accelerator_layout.has_fused_kernels(fused)
  target_head = FeatureDrafter.make_params(head, spec_tests._target_params())['target']
  runs = [speculative_generate(
      spec_tests._target_params(), {'head': h, 'target': target_head},
      spec_tests._encoder_tokens(), target_config=TARGET, drafter=FeatureDrafter(config),
      spec=SpeculativeConfig(gamma=3), max_decode_length=MAX_LEN, sampling=GREEDY,
      record_trace=True) for h in (fused, head)]
  for run in runs:
    np.testing.assert_array_equal(np.asarray(run.output.tokens),
                                  np.asarray(spec_tests._baseline().tokens))
  agree = np.mean(np.asarray(runs[0].trace.drafts) == np.asarray(runs[1].trace.drafts))
  assert agree > 0.95, agree


def test_coupled_sampling_gives_the_baselines_draws():
  sampling = SamplingConfig(temperature=1.0)
  key = jax.random.PRNGKey(4)
  baseline = generate(spec_tests._target_params(), spec_tests._encoder_tokens(), key,
                      config=TARGET, max_decode_length=MAX_LEN, sampling=sampling)
  result = speculative_generate(
      spec_tests._target_params(), _drafter_params(), spec_tests._encoder_tokens(), key,
      target_config=TARGET, drafter=FeatureDrafter(TARGET),
      spec=SpeculativeConfig(gamma=3, verification='coupled'), max_decode_length=MAX_LEN,
      sampling=sampling)
  np.testing.assert_array_equal(np.asarray(result.output.tokens), np.asarray(baseline.tokens))


@functools.cache
def _small_head_params(feature_layers=()):
  """A random head over tests/test_speculative.py's SMALL target (vocab 6)."""
  config = feature_draft.head_config(spec_tests.SMALL, 1)
  head = feature_draft.init_params(config, jax.random.PRNGKey(9),
                                   num_feature_layers=len(feature_layers))
  return FeatureDrafter.make_params(head, spec_tests._small_target_params())


SAMPLED_SPECS = {
    'token': (SpeculativeConfig(gamma=2), ()),
    'block': (SpeculativeConfig(gamma=2, verification='block'), ()),
    'adaptive': (SpeculativeConfig(gamma=2, draft_confidence_threshold=0.5), ()),
    'token_fused': (SpeculativeConfig(gamma=2), (0,)),
}


@pytest.mark.parametrize('name', list(SAMPLED_SPECS))
def test_sampling_matches_the_exact_distribution(name):
  sampling, gamma, length = spec_tests.SAMPLED_CASES['t1_gamma2']
  spec, feature_layers = SAMPLED_SPECS[name]
  result = speculative_generate(
      spec_tests._small_target_params(), _small_head_params(feature_layers),
      spec_tests._small_encoder_tokens(), jax.random.PRNGKey(0),
      target_config=spec_tests.SMALL,
      drafter=FeatureDrafter(spec_tests.SMALL, feature_layers=feature_layers),
      spec=spec, max_decode_length=length, sampling=sampling)
  outcomes, probs = spec_tests._exact_joint('target', sampling, length)
  spec_tests._assert_matches(result.output.tokens, outcomes, probs)
  counts = np.asarray(result.stats.num_accepted_counts)
  assert counts[0] > 0 and counts[gamma] > 0  # both the residual and the bonus path ran
  # The check has power: the draft-side distribution of another model is rejected.
  spec_tests._assert_rejects(result.output.tokens,
                             *spec_tests._exact_joint('draft', sampling, length))


# ----------------------------------------------------------------------------------
# Params.


def test_checkpoint_round_trip_and_wrong_heads(tmp_path):
  config, _, trained, _, _ = _training()
  t5x_checkpoints.save_t5x_checkpoint(str(tmp_path), trained, 7)
  sources = DraftSources(checkpoint=str(tmp_path), target_params=spec_tests._target_params())
  params = FeatureDrafter(TARGET).load_params(sources)
  flat = jax.tree_util.tree_leaves(feature_draft_layout(params['head']['params']))
  expected = jax.tree_util.tree_leaves(feature_draft_layout(trained))
  for got, want in zip(flat, expected):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match='missing .*layers_1'):
    FeatureDrafter(TARGET, num_layers=2).load_params(sources)
  with pytest.raises(ValueError, match='needs infer.draft_checkpoint'):
    FeatureDrafter(TARGET).load_params(DraftSources(target_params=sources.target_params))
  with pytest.raises(ValueError, match="target's params"):
    FeatureDrafter(TARGET).load_params(DraftSources(checkpoint=str(tmp_path)))
  with pytest.raises(ValueError, match='only inside speculative decoding'):
    FeatureDrafter(TARGET).init_state(params, spec_tests._encoder_tokens(), MAX_LEN)
  with pytest.raises(ValueError, match='at least one layer'):
    FeatureDrafter(TARGET, num_layers=0)
  head_checkpoints.check_params(trained, config)
  with pytest.raises(ValueError, match="target's verify steps"):
    StagedDrafter(drafter=Int8Drafter(TARGET), proposer=FeatureDrafter(TARGET))


def test_fused_checkpoints_and_wrong_feature_layers(tmp_path):
  config, _, trained, _, _ = _training()
  fused = _fused_training()[2]
  t5x_checkpoints.save_t5x_checkpoint(str(tmp_path / 'fused'), fused, 3)
  t5x_checkpoints.save_t5x_checkpoint(str(tmp_path / 'h'), trained, 3)
  target_params = spec_tests._target_params()
  sources = DraftSources(checkpoint=str(tmp_path / 'fused'), target_params=target_params)
  params = FeatureDrafter(TARGET, feature_layers=FUSED).load_params(sources)
  np.testing.assert_array_equal(
      np.asarray(feature_draft_layout(params['head']['params'])['fuse']['kernel']),
      np.asarray(fused['fuse']['kernel']))
  with pytest.raises(ValueError, match=r'fuse/kernel reads 2 target layer\(s\) beside h, the '
                     'drafter is set to 0'):
    FeatureDrafter(TARGET).load_params(sources)
  for wrong in ((2,), (0, 0), (-1,)):
    with pytest.raises(ValueError, match='distinct decoder layers 0..1 of the target'):
      FeatureDrafter(TARGET, feature_layers=wrong)
  # A head of h alone starts a run over more layers with zero rows; not the other way.
  widened = head_checkpoints.load_widened(str(tmp_path / 'h'), config, 2)
  np.testing.assert_array_equal(np.asarray(widened['fuse']['kernel']),
                                np.asarray(_fused_training()[0]['fuse']['kernel']))
  with pytest.raises(ValueError, match='reads more target layers than 1'):
    head_checkpoints.load_widened(str(tmp_path / 'fused'), config, 1)


def feature_draft_layout(tree):
  """Every kernel in T5X's layout, for comparing a decoding tree with a checkpoint's."""
  from jaxspec.model.cpu import layout as kernel_layout
  return kernel_layout.t5x_kernels(tree)


# ----------------------------------------------------------------------------------
# The launchers: jaxspec-train-feature-draft, then jaxspec-infer with the head.


def _train_head(tmp_path, directory, num_steps, extra=''):
  """jaxspec-train-feature-draft's run on the tiny target, into tmp_path/directory;
  `extra`: more gin bindings."""
  from jaxspec.launch import train_feature_draft
  test_scripts._parse(tmp_path, test_scripts.TINY_MODEL + f"""
train_feature_draft.target_model = @tiny_target/jaxspec.T5Config()
train_feature_draft.target_checkpoint = '{tmp_path}/target'
train_feature_draft.checkpoint_dir = '{tmp_path}/{directory}'
train_feature_draft.input_length = 16
train_feature_draft.target_length = 16
train_feature_draft.batch_size = 8
train_feature_draft.num_steps = {num_steps}
train_feature_draft.checkpoint_every = 2
train_feature_draft.eval_every = 2
train_feature_draft.eval_examples = 8
train_feature_draft.max_train_examples = 64
""" + extra)
  return jax.device_get(train_feature_draft.train_feature_draft())


def test_training_resumes_to_the_same_head(tiny_checkpoints):
  # 4 steps at once, and 2 steps then 2 more from the checkpoint: the same head.
  straight = _train_head(tiny_checkpoints, 'straight', 4)
  _train_head(tiny_checkpoints, 'resumed', 2)
  resumed = _train_head(tiny_checkpoints, 'resumed', 4)
  for a, b in zip(jax.tree_util.tree_leaves(straight), jax.tree_util.tree_leaves(resumed)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_training_on_stored_features_trains_the_same_head(tiny_checkpoints, monkeypatch):
  # The target's features stored once (feature_store_dir) against the target run in every
  # step: the same head; on the target's greedy outputs (sequence_kd) a different one, and
  # a second run reads both stores back instead of computing them.
  tmp_path = tiny_checkpoints
  store = f"train_feature_draft.feature_store_dir = '{tmp_path}/store'\n"
  computed = _train_head(tmp_path, 'computed', 3)
  stored = _train_head(tmp_path, 'stored', 3, store)
  for a, b in zip(jax.tree_util.tree_leaves(computed), jax.tree_util.tree_leaves(stored)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
  kd = store + ("train_feature_draft.sequence_kd = True\n"
                f"train_feature_draft.sequence_kd_cache_dir = '{tmp_path}/kd'\n")
  on_greedy = _train_head(tmp_path, 'greedy', 3, kd)
  assert len(os.listdir(tmp_path / 'store')) == 2 and len(os.listdir(tmp_path / 'kd')) == 1
  assert any(not np.allclose(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree_util.tree_leaves(computed), jax.tree_util.tree_leaves(on_greedy)))
  from jaxspec.training import target_features
  monkeypatch.setattr(target_features, 'compute',
                      lambda *a, **k: pytest.fail('the store was computed again'))
  again = _train_head(tmp_path, 'greedy_again', 3, kd)
  for a, b in zip(jax.tree_util.tree_leaves(on_greedy), jax.tree_util.tree_leaves(again)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-7)


def test_extra_inputs_and_init_checkpoint(tiny_checkpoints, monkeypatch, capsys):
  # extra_inputs adds an inputs-only corpus's inputs with the target's greedy outputs
  # (decoded and stored apart from the corpus's own); init_checkpoint starts the head from
  # a trained one. The step is replaced by one that keeps the head, so the run returns
  # exactly what it started from.
  from jaxspec.errors import InvalidSetting
  from jaxspec.launch import train_feature_draft
  tmp_path = tiny_checkpoints
  with pytest.raises(InvalidSetting, match='sequence_kd = True'):
    _train_head(tmp_path, 'no_kd', 2, "train_feature_draft.extra_inputs = 'ende_inputs'\n")
  with pytest.raises(InvalidSetting, match="inputs-only corpus of 'ende' .ende_inputs., got 'ende'"):
    _train_head(tmp_path, 'not_extra', 2, "train_feature_draft.extra_inputs = 'ende'\n"
                "train_feature_draft.sequence_kd = True\n")
  trained = _train_head(tmp_path, 'first', 2)
  monkeypatch.setattr(train_feature_draft.feature_training, 'train_step',
                      lambda params, opt_state, batch, *a, **k: (params, opt_state, {
                          'loss': 0.0, 'regression': [0.0], 'cross_entropy': [0.0],
                          'agreement': [0.0], 'grad_norm': 0.0}))
  extra = ("train_feature_draft.extra_inputs = 'ende_inputs'\n"
           "train_feature_draft.sequence_kd = True\n"
           f"train_feature_draft.sequence_kd_cache_dir = '{tmp_path}/extra_kd'\n"
           f"train_feature_draft.feature_store_dir = '{tmp_path}/extra_store'\n")
  capsys.readouterr()
  started = _train_head(tmp_path, 'second', 2,
                        extra + f"train_feature_draft.init_checkpoint = '{tmp_path}/first'\n")
  assert '128 training examples' in capsys.readouterr().out  # 64 of ende, 64 extra
  assert len(os.listdir(tmp_path / 'extra_kd')) == 2
  assert len(os.listdir(tmp_path / 'extra_store')) == 2
  for a, b in zip(jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(started)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  fresh = _train_head(tmp_path, 'third', 2, extra)  # no init_checkpoint: the target's layer
  assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(
      jax.tree_util.tree_leaves(trained), jax.tree_util.tree_leaves(fresh)))


def test_trained_head_decodes_through_the_launcher(tiny_checkpoints):
  from jaxspec.launch import infer as infer_script
  tmp_path = tiny_checkpoints
  _train_head(tmp_path, 'head', 3)
  assert (tmp_path / 'head' / 'checkpoint_3').is_dir()
  config = test_scripts._infer_config(tmp_path).replace(
      "infer.drafter = @jaxspec.T5Drafter()\njaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()",
      "infer.drafter = @jaxspec.FeatureDrafter()\n"
      "jaxspec.FeatureDrafter.config = @tiny_target/jaxspec.T5Config()\n"
      "jaxspec.FeatureDrafter.weights = 'int8'")
  config = config.replace(f"infer.draft_checkpoint = '{tmp_path}/draft'",
                          f"infer.draft_checkpoint = '{tmp_path}/head'")
  test_scripts._parse(tmp_path, config)
  summary = infer_script.infer()
  assert summary['identical_outputs'] == 5, summary


def test_the_shipped_head_fits_the_shipped_target():
  # checkpoints/ende54m/feature_head (configs/infer/ende54m_feature.gin): a one-layer head
  # over the 54M EnDe target, read and checked against its shapes.
  from jaxspec.config import get_config
  target = get_config('local_target_54m')
  repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  head = head_checkpoints.load(os.path.join(repo, 'checkpoints/ende54m/feature_head'),
                               feature_draft.head_config(target, 1))
  assert head['fuse']['kernel'].shape == (2 * target.emb_dim, target.emb_dim)
  assert all(np.isfinite(np.asarray(leaf, np.float32)).all()
             for leaf in jax.tree_util.tree_leaves(head))


def test_fused_head_through_the_launchers(tiny_checkpoints):
  # jaxspec-train-feature-draft with feature_layers: on stored features (a store of its
  # own, beside h alone's) as on the target run in every step; then jaxspec-infer drafts
  # with it where FeatureDrafter.feature_layers matches, and names the mismatch where not.
  from jaxspec.errors import InvalidSetting
  from jaxspec.launch import infer as infer_script
  tmp_path = tiny_checkpoints
  fused = "train_feature_draft.feature_layers = (0,)\n"
  store = f"train_feature_draft.feature_store_dir = '{tmp_path}/fused_store'\n"
  computed = _train_head(tmp_path, 'fused_computed', 3, fused)
  stored = _train_head(tmp_path, 'fused_stored', 3, fused + store)
  for a, b in zip(jax.tree_util.tree_leaves(computed), jax.tree_util.tree_leaves(stored)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
  assert computed['fuse']['kernel'].shape == (3 * 16, 16)  # h, the embedding, layer 0
  _train_head(tmp_path, 'h_stored', 1, store)
  assert len(os.listdir(tmp_path / 'fused_store')) == 2
  with pytest.raises(InvalidSetting, match=r'distinct decoder layers 0..0 of the target, '
                     r'got \(1,\)'):
    _train_head(tmp_path, 'wrong', 1, "train_feature_draft.feature_layers = (1,)\n")
  base = test_scripts._infer_config(tmp_path).replace(
      "infer.drafter = @jaxspec.T5Drafter()\n"
      "jaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()",
      "infer.drafter = @jaxspec.FeatureDrafter()\n"
      "jaxspec.FeatureDrafter.config = @tiny_target/jaxspec.T5Config()\n")
  base = base.replace(f"infer.draft_checkpoint = '{tmp_path}/draft'",
                      f"infer.draft_checkpoint = '{tmp_path}/fused_stored'")
  test_scripts._parse(tmp_path, base + "jaxspec.FeatureDrafter.feature_layers = (0,)\n")
  assert infer_script.infer()['identical_outputs'] == 5
  test_scripts._parse(tmp_path, base + f"infer.output_dir = '{tmp_path}/out_h'\n")
  with pytest.raises(InvalidSetting, match=r'reads 1 target layer\(s\) beside h'):
    infer_script.infer()
