"""The frozen target's features for a training set, computed once and read back per batch.

A feature head (jaxspec.model.feature_draft) trains against a target that never changes,
so what the target computes for an example is the same at every epoch: its final hidden
states h [t, e] teacher forced over the example's target tokens (with `feature_layers`,
the outputs of those decoder layers after h: [t, e (1 + n)]), and its last decoder
layer's cross-attention keys/values [s, h, d] of the encoding (what the head attends to).
`compute` runs the target once over every example (length-sorted batches, a few shapes);
`batch` gathers the rows of a training batch, padded to the batch's widths, in the layout
the target's cache holds them. The target's distribution is not stored: the LM head
recomputes it from h in the step (jaxspec.training.feature_draft.stored_target_features),
at a small part of the target's cost.

On disk (`save`/`load`) the store is one .npz of flat float32 arrays (rows of all examples
end to end, with their end offsets) named by a fingerprint of the target's weights, its
config, the token ids and the feature layers, so a changed target, corpus or head input
never reads a stale store.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import time
from typing import Sequence

import jax
import numpy as np

from jaxspec.config import T5Config
from jaxspec.model import T5
from jaxspec.training import distillation
from jaxspec.training.core import LENGTH_QUANTUM, pad_batch


@dataclasses.dataclass(frozen=True)
class TargetFeatures:
  """Per-example target products, rows of all examples end to end."""
  # [sum of target lengths, e (1 + n)] float32: h after the final norm, then the
  # feature layers' outputs
  features: np.ndarray
  cross_keys: np.ndarray  # [sum of input lengths, h, d] float32, the last layer's
  cross_values: np.ndarray  # [sum of input lengths, h, d] float32
  target_ends: np.ndarray  # [n] int64, end offset of example i's rows in `features`
  input_ends: np.ndarray  # [n] int64, end offset of example i's rows in cross_*

  def __len__(self) -> int:
    return len(self.target_ends)

  def rows(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Example `index`'s features [t_i, e (1 + n)], cross keys and values [s_i, h, d]."""
    start = self.target_ends[index - 1] if index else 0
    first = self.input_ends[index - 1] if index else 0
    end = self.input_ends[index]
    return (self.features[start:self.target_ends[index]], self.cross_keys[first:end],
            self.cross_values[first:end])


@dataclasses.dataclass(frozen=True)
class JoinedFeatures:
  """Stores of a training set's parts read as one, end to end, without copying them
  (example i of the second part is len(first) + i)."""
  parts: tuple[TargetFeatures, ...]

  def __len__(self) -> int:
    return sum(len(part) for part in self.parts)

  def rows(self, index: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    for part in self.parts:
      if index < len(part):
        return part.rows(index)
      index -= len(part)
    raise IndexError('example index past the joined stores')


@functools.partial(jax.jit, static_argnames=('target_config', 'feature_layers'))
def _pass(target_params, inputs, decoder_inputs, *, target_config: T5Config,
          feature_layers: tuple[int, ...]):
  model = T5(target_config)
  encoded = model.apply(target_params, inputs, method=T5.encode)
  cache = model.apply(target_params, encoded, inputs, decoder_inputs.shape[1],
                      method=T5.init_cache)
  _, features, cache = model.apply(target_params, decoder_inputs, cache,
                                   feature_layers=feature_layers,
                                   method=T5.decode_with_features)
  last = cache.layers[-1]
  return features, last.cross_keys, last.cross_values  # [b, t, e (1 + n)], [b, h, d, s] x 2


def compute(target_params, target_config: T5Config,
            pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 64,
            quantum: int = LENGTH_QUANTUM,
            feature_layers: tuple[int, ...] = ()) -> TargetFeatures:
  """The target (params: {'params': tree}) over every (input ids, target ids) pair; with
  feature_layers, those decoder layers' outputs follow h in each row."""
  order = sorted(range(len(pairs)), key=lambda i: (len(pairs[i][1]), len(pairs[i][0])))
  features = [None] * len(pairs)
  cross = [None] * len(pairs)
  for start in range(0, len(order), batch_size):
    rows = order[start:start + batch_size]
    batch = pad_batch([pairs[i] for i in rows], quantum)
    out = jax.device_get(_pass(target_params, batch['inputs'], batch['decoder_inputs'],
                               target_config=target_config,
                               feature_layers=tuple(feature_layers)))
    batch_features, keys, values = out
    for slot, index in enumerate(rows):
      length, width = len(pairs[index][1]), len(pairs[index][0])
      features[index] = batch_features[slot, :length]
      cross[index] = (keys[slot, :, :, :width].transpose(2, 0, 1),
                      values[slot, :, :, :width].transpose(2, 0, 1))
  return TargetFeatures(
      features=np.concatenate(features).astype(np.float32),
      cross_keys=np.concatenate([k for k, _ in cross]).astype(np.float32),
      cross_values=np.concatenate([v for _, v in cross]).astype(np.float32),
      target_ends=np.cumsum([len(t) for _, t in pairs]),
      input_ends=np.cumsum([len(s) for s, _ in pairs]))


def batch(store: TargetFeatures | JoinedFeatures, example_ids: np.ndarray,
          target_width: int, input_width: int) -> dict[str, np.ndarray]:
  """The stored rows of example_ids [b], zero-padded: {'target_features' [b, t, e (1 + n)],
  'cross_keys', 'cross_values' [b, h, d, s]} (the cache's layout)."""
  examples = [store.rows(index) for index in example_ids]
  features = np.zeros((len(example_ids), target_width, examples[0][0].shape[1]), np.float32)
  keys = np.zeros((len(example_ids), input_width) + examples[0][1].shape[1:], np.float32)
  values = np.zeros_like(keys)
  for slot, (rows, example_keys, example_values) in enumerate(examples):
    features[slot, :len(rows)] = rows
    keys[slot, :len(example_keys)] = example_keys
    values[slot, :len(example_values)] = example_values
  return {'target_features': features, 'cross_keys': keys.transpose(0, 2, 3, 1),
          'cross_values': values.transpose(0, 2, 3, 1)}


def concatenate(stores: Sequence[TargetFeatures]) -> TargetFeatures | JoinedFeatures:
  """Every example of `stores` as one store, in order (example i of the second store is
  len(first) + i), the parts' arrays shared, not copied (a store is gigabytes); a single
  store is returned as it is."""
  return stores[0] if len(stores) == 1 else JoinedFeatures(tuple(stores))


def store_path(directory: str, target_params, target_config: T5Config,
               pairs: Sequence[tuple[list[int], list[int]]],
               feature_layers: tuple[int, ...] = ()) -> str:
  """Where the store of these pairs under this target (and feature layers) lives in
  `directory`."""
  details = [json.dumps([list(p) for p in pairs])]
  if feature_layers:  # h alone keeps the key it always had
    details.append(f'feature_layers={list(feature_layers)}')
  key = distillation.teacher_fingerprint(target_params, target_config, *details)
  return os.path.join(directory, f'target_features_{key[:24]}.npz')


def save(path: str, store: TargetFeatures):
  tmp = f'{path}.tmp-{os.getpid()}'
  with open(tmp, 'wb') as f:
    np.savez(f, **dataclasses.asdict(store))
  os.replace(tmp, path)


def load(path: str) -> TargetFeatures:
  with np.load(path) as stored:
    return TargetFeatures(**{field.name: stored[field.name]
                             for field in dataclasses.fields(TargetFeatures)})


def cached(directory: str, target_params, target_config: T5Config,
           pairs: Sequence[tuple[list[int], list[int]]], batch_size: int = 64,
           quantum: int = LENGTH_QUANTUM,
           feature_layers: tuple[int, ...] = ()) -> TargetFeatures:
  """The store of `pairs` (with feature_layers' outputs), read from `directory` when a
  run already computed it, else computed and written there."""
  path = store_path(directory, target_params, target_config, pairs, feature_layers)
  if os.path.exists(path):
    print(f"the target's features read from {path}", flush=True)
    return load(path)
  started = time.time()
  store = compute(target_params, target_config, pairs, batch_size, quantum, feature_layers)
  print(f"the target's features for {len(store)} examples in {time.time() - started:.0f} s "
        f'({os.path.basename(path)})', flush=True)
  os.makedirs(directory, exist_ok=True)
  save(path, store)
  return store
