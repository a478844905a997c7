"""jaxspec.training.target_features: the frozen target's features, computed once per
training example and gathered per batch, against the target run in the step.

- A batch's stored rows equal what the target computes on that batch (features, with the
  feature layers' outputs where asked, the last layer's cross keys/values, the logits the
  LM head makes of them), in any row order and padding; the store survives its file;
  `cached` computes once and reads back after; stores of a set's parts, joined, read as
  the store of the whole set.
- A training step on a stored batch moves the head exactly as one that runs the target.
- epoch_batches names each batch's rows ('example_ids'), which the gathering relies on.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import test_speculative as spec_tests  # tests/test_speculative.py: the tiny target
from jaxspec.model import feature_draft
from jaxspec.training import core as training, feature_draft as feature_training
from jaxspec.training import target_features

TARGET = spec_tests.TARGET


def _pairs(count=40, seed=0):
  rng = np.random.default_rng(seed)
  return [(rng.integers(2, TARGET.vocab_size, rng.integers(1, 12)).tolist() + [1],
           rng.integers(2, TARGET.vocab_size, rng.integers(1, 10)).tolist() + [1])
          for _ in range(count)]


def _stored_batch(store, batch):
  return {**batch, **target_features.batch(store, batch['example_ids'],
                                           batch['targets'].shape[1], batch['inputs'].shape[1])}


def test_epoch_batches_name_their_rows():
  pairs = _pairs()
  for batch in training.epoch_batches(pairs, 8, seed=3, epoch=1, quantum=8):
    for row, index in enumerate(batch['example_ids']):
      target = pairs[index][1]
      assert batch['targets'][row, :len(target)].tolist() == target
      assert not batch['targets'][row, len(target):].any()


@pytest.mark.parametrize('feature_layers', [(), (1, 0)], ids=['h', 'fused'])
def test_stored_rows_equal_the_target_run_on_the_batch(feature_layers):
  pairs = _pairs()
  params = spec_tests._target_params()
  # A store computed in batches of 16 in length order, read back in batches of 8 in the
  # training order, padded to other widths (quantum 8 against 16).
  store = target_features.compute(params, TARGET, pairs, batch_size=16, quantum=16,
                                  feature_layers=feature_layers)
  assert store.features.shape[1] == TARGET.emb_dim * (1 + len(feature_layers))
  for batch in training.epoch_batches(pairs, 8, seed=0, epoch=0, quantum=8):
    stored = _stored_batch(store, batch)
    features, logits, cache = feature_training.target_features(
        params, batch, target_config=TARGET, feature_layers=feature_layers)
    s_features, s_logits, s_cache = feature_training.stored_target_features(
        params, stored, target_config=TARGET, feature_layers=feature_layers)
    decoded = batch['targets'] > 0  # [b, t]
    np.testing.assert_allclose(np.asarray(s_features)[decoded], np.asarray(features)[decoded],
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(s_logits)[decoded], np.asarray(logits)[decoded],
                               atol=1e-4)
    encoded = np.asarray(batch['inputs'] > 0)[:, None, None, :]  # [b, 1, 1, s]
    for name in ('cross_keys', 'cross_values'):
      np.testing.assert_allclose(np.asarray(getattr(s_cache.layers[-1], name)) * encoded,
                                 np.asarray(getattr(cache.layers[-1], name)) * encoded,
                                 atol=2e-5)
    assert not np.asarray(s_features)[~decoded].any()  # padding stays zero
    np.testing.assert_array_equal(np.asarray(s_cache.encoder_mask),
                                  np.asarray(cache.encoder_mask))


def test_store_survives_its_file_and_is_computed_once(tmp_path, monkeypatch):
  pairs = _pairs(12)
  params = spec_tests._target_params()
  store = target_features.cached(str(tmp_path), params, TARGET, pairs, batch_size=8)
  path = target_features.store_path(str(tmp_path), params, TARGET, pairs)
  monkeypatch.setattr(target_features, 'compute', lambda *a, **k: pytest.fail('recomputed'))
  again = target_features.cached(str(tmp_path), params, TARGET, pairs, batch_size=8)
  for name in ('features', 'cross_keys', 'cross_values', 'target_ends', 'input_ends'):
    np.testing.assert_array_equal(getattr(again, name), getattr(store, name))
  # Other pairs (or another target, or other feature layers) name another file; h alone
  # keeps the name stores had before feature layers.
  assert target_features.store_path(str(tmp_path), params, TARGET, pairs[1:]) != path
  assert target_features.store_path(str(tmp_path), params, TARGET, pairs, (0,)) != path
  assert target_features.store_path(str(tmp_path), params, TARGET, pairs, ()) == path
  with pytest.raises(ValueError, match='width 32, the head reads 64'):
    feature_training.stored_target_features(
        params, _stored_batch(store, next(training.batch_stream(pairs, 4, seed=0))),
        target_config=TARGET, feature_layers=(0,))


def test_concatenated_stores_read_as_the_store_of_all_pairs():
  # Stores of two parts of a training set, end to end: every batch gathers what the store
  # computed over all the pairs at once gathers (example ids past the first part included).
  pairs = _pairs(30)
  params = spec_tests._target_params()
  whole = target_features.compute(params, TARGET, pairs, batch_size=8)
  joined = target_features.concatenate([
      target_features.compute(params, TARGET, pairs[:11], batch_size=8),
      target_features.compute(params, TARGET, pairs[11:], batch_size=8)])
  assert len(joined) == len(whole) == 30
  for index in range(30):
    for got, want in zip(joined.rows(index), whole.rows(index)):
      np.testing.assert_allclose(got, want, atol=2e-5)
  with pytest.raises(IndexError):
    joined.rows(30)
  for batch in training.epoch_batches(pairs, 8, seed=1, epoch=0, quantum=8):
    got, want = _stored_batch(joined, batch), _stored_batch(whole, batch)
    for name in ('target_features', 'cross_keys', 'cross_values'):
      np.testing.assert_allclose(got[name], want[name], atol=2e-5)


@pytest.mark.parametrize('feature_layers', [(), (0,)], ids=['h', 'fused'])
def test_a_step_on_a_stored_batch_equals_one_that_runs_the_target(feature_layers):
  pairs = _pairs()
  params = spec_tests._target_params()
  store = target_features.compute(params, TARGET, pairs, batch_size=16,
                                  feature_layers=feature_layers)
  config = feature_draft.head_config(TARGET, 1)
  optimizer = training.make_optimizer(training.OptimizerConfig(name='adamw',
                                                               learning_rate=1e-2), 10)
  loss = feature_training.FeatureLossConfig(unroll=2, feature_noise=0.1)
  start = feature_draft.init_params(config, jax.random.PRNGKey(0),
                                    num_feature_layers=len(feature_layers))['params']
  results = []
  for stored in (False, True):
    head = jax.tree_util.tree_map(jnp.array, start)
    state = optimizer.init(head)
    for step, batch in zip(range(3), training.batch_stream(pairs, 8, seed=0)):
      batch = _stored_batch(store, batch) if stored else batch
      head, state, metrics = feature_training.train_step(
          head, state, batch, params, jax.random.PRNGKey(step), config=config,
          target_config=TARGET, optimizer=optimizer, loss=loss, feature_layers=feature_layers)
    results.append((jax.device_get(head), float(metrics['loss'])))
  (computed, computed_loss), (stored, stored_loss) = results
  assert stored_loss == pytest.approx(computed_loss, rel=1e-4)
  for a, b in zip(jax.tree_util.tree_leaves(computed), jax.tree_util.tree_leaves(stored)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-3, atol=1e-5)
