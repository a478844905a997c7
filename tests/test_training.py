"""jaxspec.training.core: batch padding (few distinct shapes, every token kept) and dropout."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxspec.training import core as training
from jaxspec.config import get_config
from jaxspec.model import T5, init_params


def test_length_buckets_are_few_and_hold_every_length():
  buckets = [training.length_bucket(n) for n in range(1, 513)]
  assert all(b >= n for n, b in zip(range(1, 513), buckets))
  assert sorted(set(buckets)) == [16, 32, 48, 64, 96, 128, 192, 256, 384, 512]


def test_pad_batch_shifts_targets_behind_the_start_token():
  batch = training.pad_batch([([5, 6, 1], [7, 1]), ([4] * 70 + [1], [8, 9, 1])])
  assert batch['inputs'].shape == (2, 96) and batch['targets'].shape == (2, 16)
  np.testing.assert_array_equal(batch['inputs'][1, :71], [4] * 70 + [1])
  np.testing.assert_array_equal(batch['targets'][1, :4], [8, 9, 1, 0])
  np.testing.assert_array_equal(batch['decoder_inputs'][1, :4], [0, 8, 9, 1])


def test_a_quantum_as_long_as_the_inputs_gives_one_shape():
  pairs = [([5] * n + [1], [7] * (n % 40) + [1]) for n in range(1, 60)]
  shapes = {(b['inputs'].shape, b['targets'].shape)
            for b in training.epoch_batches(pairs, 8, seed=0, epoch=0, quantum=64)}
  assert shapes == {((8, 64), (8, 64))}
  assert len({(b['inputs'].shape, b['targets'].shape)
              for b in training.epoch_batches(pairs, 8, seed=0, epoch=0)}) > 1
  stream = training.batch_stream(pairs, 8, seed=0, quantum=64)
  assert next(stream)['inputs'].shape == (8, 64)


def _dropout_setup(rate):
  config = get_config('test_tiny_1_1').replace(dropout_rate=rate)
  params = init_params(config, jax.random.PRNGKey(0))['params']
  rows = np.random.RandomState(0).randint(2, config.vocab_size, (2, 6)).astype(np.int32)
  return config, params, rows


def test_dropout_applies_only_when_training_and_follows_its_key():
  config, params, rows = _dropout_setup(0.3)
  plain = T5(config.replace(dropout_rate=0.0)).apply({'params': params}, rows, rows)
  # Decoding and evaluation (deterministic, the default) never drop.
  np.testing.assert_array_equal(T5(config).apply({'params': params}, rows, rows), plain)
  training_model = T5(config, deterministic=False)
  dropped = [training_model.apply({'params': params}, rows, rows,
                                  rngs={'dropout': jax.random.PRNGKey(seed)})
             for seed in (1, 1, 2)]
  np.testing.assert_array_equal(dropped[0], dropped[1])
  assert not np.allclose(dropped[0], plain) and not np.allclose(dropped[0], dropped[2])
  # A rate of 0 drops nothing even when training.
  np.testing.assert_array_equal(
      T5(config.replace(dropout_rate=0.0), deterministic=False).apply(
          {'params': params}, rows, rows, rngs={'dropout': jax.random.PRNGKey(1)}), plain)


def test_train_step_needs_the_dropout_key_and_steps_by_it():
  config, params, rows = _dropout_setup(0.3)
  batch = {'inputs': rows, 'targets': rows,
           'decoder_inputs': np.pad(rows[:, :-1], ((0, 0), (1, 0)))}
  optimizer = optax.sgd(0.1)
  step = lambda key: training.train_step(  # noqa: E731
      jax.tree_util.tree_map(jnp.copy, params), optimizer.init(params), batch, config=config,
      optimizer=optimizer, loss_config=training.LossConfig(), dropout_rng=key)
  with pytest.raises(ValueError, match='dropout_rng'):
    step(None)
  first, again, other = (step(training.dropout_key(0, s))[2]['loss'] for s in (5, 5, 6))
  assert first == again and first != other
  assert not np.array_equal(training.dropout_key(0, 5), training.dropout_key(1, 5))


def test_dropout_rate_is_checked():
  with pytest.raises(ValueError, match='dropout_rate'):
    get_config('test_tiny_1_1').replace(dropout_rate=1.0)
