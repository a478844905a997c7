"""Batch padding of jaxspec.training: few distinct shapes, every token kept."""

import numpy as np

from jaxspec import training


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
