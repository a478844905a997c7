"""Checkpoints of encoder-sharing draft decoders, in T5X's legacy layout.

The draft's tree is T5X's decoder tree (`token_embedder`, `decoder/...`) plus
`encoder_projection/kernel` when its width differs from the target's; it is stored as
any T5X checkpoint (`jaxspec.checkpoints.t5x`), so T5X tooling reads it as a partial
T5 tree. Loading checks every path and shape against the draft's config first.
"""

from __future__ import annotations

import functools
from typing import Any, Mapping

from jaxspec.checkpoints import t5x
from jaxspec.checkpoints.validate import flatten_params
from jaxspec.config import T5Config
from jaxspec.model.shared_encoder_draft import abstract_params


@functools.lru_cache(maxsize=16)
def expected_shapes(config: T5Config, encoder_dim: int) -> dict[str, tuple[int, ...]]:
  """'/'-path -> shape of every parameter of the draft, without allocating any."""
  flat = flatten_params(abstract_params(config, encoder_dim)['params'])
  return {path: tuple(leaf.shape) for path, leaf in flat.items()}


def check_params(params: Mapping[str, Any], config: T5Config, encoder_dim: int) -> None:
  """Raises ValueError naming the first path (sorted) that is missing, unexpected or of
  the wrong shape for the draft of `config` reading an encoder output of encoder_dim."""
  if 'params' in params and set(params) <= {'params', 'params_axes'}:
    params = params['params']  # The variables, not only the 'params' collection.
  actual = {path: tuple(leaf.shape) for path, leaf in flatten_params(params).items()}
  expected = expected_shapes(config, encoder_dim)
  for path in sorted(set(actual) | set(expected)):
    if path not in actual:
      raise ValueError(f'shared-encoder draft params: missing {path!r} (expected shape '
                       f'{expected[path]})')
    if path not in expected:
      hint = (' (a draft of equal width reads the target encoding unprojected)'
              if path.startswith('encoder_projection') else
              ' (a shared-encoder draft has no encoder)' if path.startswith('encoder/')
              else '')
      raise ValueError(f'shared-encoder draft params: unexpected {path!r} of shape '
                       f'{actual[path]}{hint}')
    if actual[path] != expected[path]:
      raise ValueError(f'shared-encoder draft params: {path!r} has shape {actual[path]}, '
                       f'the config expects {expected[path]}')


def save(directory, params: Mapping[str, Any], step: int, *, dtype=None,
         param_states: Mapping[str, Any] | None = None) -> str:
  """Writes the draft's {'params'} as directory/checkpoint_<step>/ (legacy); returns it."""
  return t5x.save_t5x_checkpoint(directory, params, step, dtype=dtype,
                                 param_states=param_states)


def load(path, config: T5Config, encoder_dim: int, *, dtype=None) -> dict:
  """The draft's 'params' tree from a checkpoint (a checkpoint_<step> directory or its
  parent, legacy or Orbax), checked against the config; dtype default: on disk."""
  params = t5x.load_t5x_checkpoint(path, dtype=dtype)
  check_params(params, config, encoder_dim)
  return params
