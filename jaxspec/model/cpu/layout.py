"""Dense kernels in T5X's layout, transposed for decoding on XLA:CPU, or fused for
decoding where XLA computes on an accelerator.

T5X stores every projection kernel as `kernel` [in, out]. On XLA:CPU a decode step
over a few positions (a verify step, k = 2..9) runs x [k, in] @ kernel [in, out]
through a matmul path that costs about 2x the one-position step's, while the same
product computed as kernel_t [out, in] @ x^T costs close to the one-position step
(`scripts/step_costs.py` measures both; docs/performance.md has the numbers). The one-position step
costs the same in either layout, and on TPU/GPU XLA lays matmul operands out itself.

The layout belongs to the params tree and names itself: a transposed kernel is stored
under `kernel_t`, so a tree can never be read in the wrong orientation (square kernels
included). `jaxspec.model.layers.Dense` uses whichever key the params hold, so every
decoder and drafter accepts both trees. Checkpoint writers and exporters store T5X's
layout (`t5x_kernels` first), and `check_params` compares in T5X's layout.

The third layout, 'fused' (jaxspec.model.accelerator.layout), keeps T5X's orientation
and stacks each decoder layer's self-attention q/k/v and gated MLP wi_0/wi_1 into one
kernel each, so a decode step on a GPU or TPU runs two products where T5X's layout runs
five (a small model's step there is bound by the kernels it launches).

  for_decoding(params)     -> transposed on CPU, fused elsewhere (call once, after loading)
  transposed_kernels(tree) -> every kernel as kernel_t [out, in]
  t5x_kernels(tree)        -> every kernel as T5X's kernel [in, out], none stacked
  fused_kernels(tree)      -> T5X's orientation with the decoder's q/k/v and wi_0/wi_1 stacked
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jaxspec.model.accelerator import layout as accelerator_layout
from jaxspec.model.layers import KERNEL_PARAM, KERNEL_T_PARAM

T5X = 't5x'  # kernel [in, out]
TRANSPOSED = 'transposed'  # kernel_t [out, in]
FUSED = 'fused'  # kernel [in, out]; the decoder's q/k/v and wi_0/wi_1 stacked
LAYOUTS = (T5X, TRANSPOSED, FUSED)


def decode_layout(platform: str | None = None) -> str:
  """The faster layout for decoding on `platform` (default: JAX's default backend): the
  transposed kernels jaxspec's CPU kernels read, or on a GPU or TPU the fused one."""
  platform = platform or jax.default_backend()
  return TRANSPOSED if platform == 'cpu' else FUSED


def _transpose_leaf(leaf):
  """A 2-D leaf transposed into a new row-major array (shape-only leaves: the shape)."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct(leaf.shape[::-1], leaf.dtype, sharding=None)
  if isinstance(leaf, jax.Array):
    return jax.numpy.transpose(leaf)
  return np.ascontiguousarray(np.asarray(leaf).T)


def _transpose_axes(metadata):
  """params_axes leaf (flax AxisMetadata) of a kernel -> that of its transpose."""
  return type(metadata)(names=tuple(metadata.names)[::-1])


def _rename_kernels(tree: Any, old: str, new: str, convert) -> Any:
  """Copies a nested mapping, replacing each `old` leaf (2-D) by convert(leaf) under `new`."""
  if not isinstance(tree, Mapping):
    return tree
  renamed = {}
  for key, value in tree.items():
    if key == old and not isinstance(value, Mapping):
      renamed[new] = convert(value)
    else:
      renamed[key] = _rename_kernels(value, old, new, convert)
  return renamed


def _convert(variables: Mapping[str, Any], old: str, new: str) -> dict:
  """Converts params (bare, or variables with 'params' and optional 'params_axes')."""
  if 'params' not in variables:
    return _rename_kernels(variables, old, new, _transpose_leaf)
  converted = dict(variables)
  converted['params'] = _rename_kernels(variables['params'], old, new, _transpose_leaf)
  if 'params_axes' in variables:
    converted['params_axes'] = _rename_kernels(
        variables['params_axes'], f'{old}_axes', f'{new}_axes', _transpose_axes)
  return converted


def transposed_kernels(params: Mapping[str, Any]) -> dict:
  """Every `kernel` [in, out] as `kernel_t` [out, in]; other leaves as they are.

  params: the 'params' collection or variables {'params', 'params_axes'?}. Kernels
  already transposed stay so, so the call is idempotent; stacked kernels are unstacked.
  """
  return _convert(accelerator_layout.unfused_kernels(params), KERNEL_PARAM, KERNEL_T_PARAM)


def t5x_kernels(params: Mapping[str, Any]) -> dict:
  """Every `kernel_t` [out, in] back to T5X's `kernel` [in, out] and every stacked kernel
  back to its parts (idempotent)."""
  return _convert(accelerator_layout.unfused_kernels(params), KERNEL_T_PARAM, KERNEL_PARAM)


def fused_kernels(params: Mapping[str, Any]) -> dict:
  """T5X's orientation with the decoder's self-attention q/k/v and gated MLP wi_0/wi_1
  stacked into one kernel each (jaxspec.model.accelerator.layout; idempotent)."""
  return accelerator_layout.fused_kernels(t5x_kernels(params))


def has_transposed_kernels(params: Mapping[str, Any]) -> bool:
  """Whether any kernel of the tree is stored as `kernel_t`."""
  found = []
  _rename_kernels(params, KERNEL_T_PARAM, KERNEL_T_PARAM, lambda leaf: found.append(leaf) or leaf)
  return bool(found)


def to_layout(params: Mapping[str, Any], layout: str) -> dict:
  """params in `layout`: 't5x' (kernel [in, out]), 'transposed' (kernel_t [out, in]) or
  'fused' (T5X's, the decoder's q/k/v and wi_0/wi_1 stacked)."""
  if layout == T5X:
    return t5x_kernels(params)
  if layout == TRANSPOSED:
    return transposed_kernels(params)
  if layout == FUSED:
    return fused_kernels(params)
  raise ValueError(f'kernel layout must be one of {LAYOUTS}, got {layout!r}')


def for_decoding(params: Mapping[str, Any], platform: str | None = None) -> dict:
  """params in the layout that decodes fastest on `platform` (see decode_layout).

  Call once after loading: the transpose copies every kernel, so doing it inside each
  generation would cost about one decode step's memory traffic per call.
  """
  return to_layout(params, decode_layout(platform))
