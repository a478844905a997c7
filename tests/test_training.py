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
