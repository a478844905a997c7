"""Checkpoints of feature-level draft heads (jaxspec.model.feature_draft), T5X legacy layout.

The head's tree (`fuse/kernel`, `decoder/relpos_bias`, `decoder/layers_{i}`,
`decoder/feature_norm`) is stored as any T5X checkpoint (`jaxspec.checkpoints.t5x`);
loading checks every path and shape against the head's config first.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from jaxspec.checkpoints import t5x
from jaxspec.checkpoints.validate import flatten_params
from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.model.feature_draft import abstract_params, with_feature_layers


@functools.lru_cache(maxsize=16)
def expected_shapes(config: T5Config, num_feature_layers: int = 0) -> dict[str, tuple[int, ...]]:
  """'/'-path -> shape of every parameter of the head of `config` reading
  num_feature_layers target layers' outputs, without allocating."""
  flat = flatten_params(abstract_params(config, num_feature_layers)['params'])
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def check_params(params: Mapping[str, Any], config: T5Config,
                 num_feature_layers: int = 0) -> None:
  """Raises InvalidSetting naming the first path (sorted) that is missing, unexpected or of
  the wrong shape for the head of `config` (feature_draft.head_config) reading
  num_feature_layers target layers' outputs."""
  if 'params' in params and set(params) <= {'params', 'params_axes'}:
    params = params['params']
  actual = {path: tuple(leaf.shape) for path, leaf in flatten_params(params).items()}
  expected = expected_shapes(config, num_feature_layers)
  for path in sorted(set(actual) | set(expected)):
    if path not in actual:
      raise InvalidSetting(f'feature draft head params: missing {path!r} (expected shape '
                       f'{expected[path]}); is this a head of '
                       f'{config.num_decoder_layers} layer(s)?')
    if path not in expected:
      raise InvalidSetting(f'feature draft head params: unexpected {path!r} of shape '
                       f'{actual[path]} (a head of {config.num_decoder_layers} layer(s) '
                       'over a target of this shape has no such parameter)')
    if path == 'fuse/kernel' and actual[path] != expected[path]:
      read = actual[path][0] // config.emb_dim - 2
      raise InvalidSetting(f'feature draft head params: fuse/kernel reads {read} target '
                           f'layer(s) beside h, the drafter is set to {num_feature_layers} '
                           '(FeatureDrafter.feature_layers as the head was trained)')
    if actual[path] != expected[path]:
      raise InvalidSetting(f'feature draft head params: {path!r} has shape {actual[path]}, '
                       f'the target config expects {expected[path]}')


def load(path, config: T5Config, *, dtype=None, num_feature_layers: int = 0) -> dict:
  """The head's 'params' tree from a checkpoint (a checkpoint_<step> directory or its
  parent, legacy or Orbax), checked against the config and the number of target layers
  it reads; dtype default: on disk."""
  params = t5x.load_t5x_checkpoint(path, dtype=dtype)
  check_params(params, config, num_feature_layers)
  return params


def load_widened(path, config: T5Config, num_feature_layers: int, *, dtype=None) -> dict:
  """As load, for a head trained over fewer target layers than num_feature_layers (h
  alone, say): its `fuse` gains zero rows for the rest, so it computes what it did (a
  start for training over more layers)."""
  params = t5x.load_t5x_checkpoint(path, dtype=dtype)
  try:
    params = with_feature_layers(params, config, num_feature_layers)['params']
  except ValueError as error:
    raise InvalidSetting(f'feature draft head {path}: {error}') from None
  check_params(params, config, num_feature_layers)
  return params
