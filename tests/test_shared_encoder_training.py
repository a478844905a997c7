"""Training an encoder-sharing draft against a frozen target.

- The frozen target's encoding and teacher logits are T5's own (T5.encode, T5 teacher
  forced); the distillation loss equals the cross-entropy to the target's softmax,
  computed here in numpy from both models' teacher-forced logits.
- A few steps on a fixed batch lower the loss; the target's parameters are untouched.
- scripts/train_shared_encoder_draft.py resumes to the parameters of an unbroken run,
  and trains a layer-pruned draft started from the target's own decoder layers (whose
  params must not alias the target's: the step donates them) on a mix of references and
  the target's greedy outputs for noised inputs.
"""

import functools
import os

import gin
import jax
import numpy as np
import pytest

from jaxspec.training import shared_encoder as shared_encoder_training, core as training
from jaxspec.checkpoints import shared_encoder_draft as draft_checkpoints
from jaxspec.checkpoints.t5x import save_t5x_checkpoint
from jaxspec.config import get_config
from jaxspec.model import T5, init_params
from jaxspec.model import shared_encoder_draft as draft_model

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
from jaxspec.launch import train_shared_encoder_draft as train_script

TARGET = get_config('test_tiny_1_1')  # emb_dim 32
DRAFT = get_config('test_tiny_1_0').replace(emb_dim=16, num_heads=2, head_dim=8,
                                             num_decoder_layers=1)


def _batch(seed=0, batch=4, length=8):
  rng = np.random.default_rng(seed)
  pairs = [(list(rng.integers(2, TARGET.vocab_size, rng.integers(3, length))) + [1],
            list(rng.integers(2, TARGET.vocab_size, rng.integers(2, length))) + [1])
           for _ in range(batch)]
  return training.pad_batch(pairs)


def _log_softmax(logits):
  logits = np.asarray(logits, np.float64)
  shifted = logits - logits.max(-1, keepdims=True)
  return shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))


def test_target_encoding_and_distillation_loss():
  target_params = init_params(TARGET, jax.random.PRNGKey(0))
  draft_params = draft_model.init_params(DRAFT, TARGET.emb_dim, jax.random.PRNGKey(1))
  batch = _batch()
  encoded, teacher_logits = jax.jit(functools.partial(
      shared_encoder_training.target_encoding, target_config=TARGET, with_logits=True))(
          target_params, batch)
  encode = jax.jit(functools.partial(T5(TARGET).apply, method=T5.encode))
  np.testing.assert_allclose(encoded, encode(target_params, batch['inputs']),
                             rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(
      teacher_logits,
      jax.jit(T5(TARGET).apply)(target_params, batch['inputs'], batch['decoder_inputs']),
      rtol=1e-5, atol=1e-5)

  loss_config = training.LossConfig(z_loss=0.0, distill_weight=1.0)
  optimizer = training.make_optimizer(training.OptimizerConfig(), 10)
  draft_logits = jax.jit(draft_model.SharedEncoderDraft(DRAFT, TARGET.emb_dim).apply)(
      draft_params, encoded, batch['inputs'], batch['decoder_inputs'])
  _, _, metrics = shared_encoder_training.train_step(
      dict(draft_params['params']), optimizer.init(draft_params['params']), batch,
      target_params, config=DRAFT, encoder_dim=TARGET.emb_dim, optimizer=optimizer,
      loss_config=loss_config, target_config=TARGET)
  mask = batch['targets'] > 0
  soft = -(np.exp(_log_softmax(teacher_logits)) * _log_softmax(draft_logits)).sum(-1)
  np.testing.assert_allclose(float(metrics['loss']), soft[mask].mean(), rtol=1e-4)


def test_a_few_steps_lower_the_loss_and_leave_the_target_alone():
  target_params = init_params(TARGET, jax.random.PRNGKey(0))
  target_before = jax.tree_util.tree_map(np.array, target_params)
  params = dict(draft_model.init_params(DRAFT, TARGET.emb_dim, jax.random.PRNGKey(1))['params'])
  optimizer = training.make_optimizer(
      training.OptimizerConfig(learning_rate=0.05, warmup_steps=1), 20)
  opt_state = optimizer.init(params)
  batch = _batch(seed=3)
  losses = []
  for _ in range(15):
    params, opt_state, metrics = shared_encoder_training.train_step(
        params, opt_state, batch, target_params, config=DRAFT, encoder_dim=TARGET.emb_dim,
        optimizer=optimizer, loss_config=training.LossConfig(distill_weight=0.5),
        target_config=TARGET)
    losses.append(float(metrics['loss']))
  assert losses[-1] < 0.7 * losses[0], losses
  jax.tree_util.tree_map(np.testing.assert_array_equal, target_params, target_before)
  nll, correct, agree, count = shared_encoder_training.eval_step(
      params, batch, target_params, config=DRAFT, encoder_dim=TARGET.emb_dim,
      target_config=TARGET)
  assert 0 <= int(agree) <= int(count) and 0 <= int(correct) <= int(count)
  assert float(nll) / float(count) < losses[0]


def _parse(tmp_path, checkpoint_dir, num_steps, extra=''):
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(f"""
include 'gin/models/tiny_pair.gin'
train_shared_encoder_draft.model = @tiny_draft/jaxspec.T5Config()
train_shared_encoder_draft.target_model = @tiny_target/jaxspec.T5Config()
train_shared_encoder_draft.target_checkpoint = '{tmp_path}/target'
train_shared_encoder_draft.checkpoint_dir = '{checkpoint_dir}'
train_shared_encoder_draft.input_length = 16
train_shared_encoder_draft.target_length = 16
train_shared_encoder_draft.batch_size = 8
train_shared_encoder_draft.num_steps = {num_steps}
train_shared_encoder_draft.checkpoint_every = 2
train_shared_encoder_draft.eval_every = 2
train_shared_encoder_draft.eval_examples = 8
train_shared_encoder_draft.max_train_examples = 200
train_shared_encoder_draft.log_every = 1000
""" + extra)
  gin_flags.parse([f'--gin_file={path}'])


def test_script_resumes_to_the_same_parameters(tmp_path):
  _parse(tmp_path, tmp_path / 'unused', 1)
  target = gin.query_parameter('train_shared_encoder_draft.target_model').scoped_configurable_fn()
  draft = gin.query_parameter('train_shared_encoder_draft.model').scoped_configurable_fn()
  save_t5x_checkpoint(tmp_path / 'target', init_params(target, jax.random.PRNGKey(0)), 1)
  straight, interrupted = tmp_path / 'straight', tmp_path / 'interrupted'
  try:
    for directory, steps in ((straight, 4), (interrupted, 2), (interrupted, 4)):
      _parse(tmp_path, directory, steps)
      train_script.train_shared_encoder_draft()
  finally:
    gin.clear_config()
  expected = draft_checkpoints.load(straight / 'checkpoint_4', draft, target.emb_dim)
  actual = draft_checkpoints.load(interrupted / 'checkpoint_4', draft, target.emb_dim)
  jax.tree_util.tree_map(np.testing.assert_array_equal, actual, expected)
  assert 'encoder_projection' in actual and 'encoder' not in actual


def test_script_trains_a_draft_started_from_target_layers(tmp_path):
  # The tiny target's decoder (1 layer) as the draft, started from its layer 0.
  layers = """
train_shared_encoder_draft.model = @tiny_target/jaxspec.T5Config()
train_shared_encoder_draft.init_from_target_layers = (0,)
"""
  layers += """
train_shared_encoder_draft.data_mix = @jaxspec.DataMixConfig()
jaxspec.DataMixConfig.references = 1.0
jaxspec.DataMixConfig.target_greedy = 1.0
train_shared_encoder_draft.input_noise = 0.2
"""
  _parse(tmp_path, tmp_path / 'pruned', 2, layers)
  target = gin.query_parameter('train_shared_encoder_draft.target_model').scoped_configurable_fn()
  target_params = init_params(target, jax.random.PRNGKey(0))
  save_t5x_checkpoint(tmp_path / 'target', target_params, 1)
  try:
    _parse(tmp_path, tmp_path / 'pruned', 2, layers)
    trained = train_script.train_shared_encoder_draft()
    _parse(tmp_path, tmp_path / 'mismatch', 2, layers.replace('(0,)', '(0, 0)'))
    with pytest.raises(ValueError, match='names 2 layers; the draft has num_decoder_layers=1'):
      train_script.train_shared_encoder_draft()
  finally:
    gin.clear_config()
  start = draft_model.from_target_decoder(target_params, (0,))['params']
  moved = jax.tree_util.tree_map(lambda a, b: not np.array_equal(a, b), trained, start)
  assert any(jax.tree_util.tree_leaves(moved['decoder']['layers_0']))
  saved = draft_checkpoints.load(tmp_path / 'pruned' / 'checkpoint_2', target, target.emb_dim)
  jax.tree_util.tree_map(np.testing.assert_array_equal, saved, jax.device_get(trained))
