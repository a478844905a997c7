"""Checks a params tree against the tree `init_params` would create for a config."""

from __future__ import annotations

import functools
from typing import Any, Mapping

import flax.traverse_util
import jax
import numpy as np

from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting
from jaxspec.model import abstract_params
from jaxspec.model.accelerator import layout as accelerator_layout
from jaxspec.model.layers import KERNEL_PARAM, KERNEL_T_PARAM, KERNEL_TILES_PARAM


def flatten_params(params: Mapping[str, Any]) -> dict[str, Any]:
  """Nested params -> {'encoder/layers_0/attention/query/kernel': leaf, ...}."""
  return flax.traverse_util.flatten_dict(dict(params), sep='/')


@functools.lru_cache(maxsize=16)
def expected_shapes(config: T5Config) -> dict[str, tuple[int, ...]]:
  """The '/'-path -> shape of every parameter of `config`, without allocating any."""
  flat = flatten_params(abstract_params(config)['params'])
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def _shape(leaf) -> tuple[int, ...]:
  return tuple(leaf.shape) if hasattr(leaf, 'shape') else np.shape(leaf)


def _t5x_path_and_shape(path: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
  """A transposed or tiled kernel's path and shape as T5X's (kernel_t [out, in] and
  kernel_tiles [out / 16, in, 16] -> kernel [in, out])."""
  head, _, name = path.rpartition('/')
  if name == KERNEL_T_PARAM:
    return f'{head}/{KERNEL_PARAM}', shape[::-1]
  if name == KERNEL_TILES_PARAM and len(shape) == 3:
    return f'{head}/{KERNEL_PARAM}', (shape[1], shape[0] * shape[2])
  return path, shape


def check_params(params: Mapping[str, Any], config: T5Config,
                 sources: Mapping[str, str] | None = None) -> None:
  """Raises ValueError unless `params` has exactly the paths and shapes of `config`.

  `params` is the nested 'params' collection (or {'params': ...}); leaves are any
  arrays (numpy, jax, ShapeDtypeStruct); kernels in any layout
  (jaxspec.model.cpu.layout), reported by their T5X path. The error names the first
  path, in sorted order, that is missing, unexpected or of the wrong shape, with both
  shapes.
  `sources` optionally maps a path to where its value came from, for the message.
  """
  if set(params) == {'params'}:
    params = params['params']
  # Stacked kernels (the accelerator layout) as T5X's separate ones, by shape alone.
  params = accelerator_layout.unfused_kernels(jax.tree_util.tree_map(
      lambda leaf: jax.ShapeDtypeStruct(_shape(leaf), np.float32), params))
  actual = dict(_t5x_path_and_shape(path, _shape(leaf))
                for path, leaf in flatten_params(params).items())
  expected = expected_shapes(config)
  sources = sources or {}
  for path in sorted(set(actual) | set(expected)):
    origin = f' (from {sources[path]!r})' if path in sources else ''
    if path not in actual:
      raise InvalidSetting(f'params: missing {path!r} (expected shape {expected[path]})')
    if path not in expected:
      raise InvalidSetting(f'params: unexpected {path!r}{origin} of shape {actual[path]}')
    if actual[path] != expected[path]:
      raise InvalidSetting(f'params: {path!r}{origin} has shape {actual[path]}, '
                           f'the config expects {expected[path]}')
