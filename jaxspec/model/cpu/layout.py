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

The 'tiled' layout is the transposed one with each kernel whose outputs are a multiple
of 16 stored as `kernel_tiles` [out / 16, in, 16] (jaxspec.model.cpu.matmul.tile_kernel):
the few-row kernel's AVX-512 build sums each output in a vector lane of its own, which
makes a verify step's rows cheaper than in [out, in] (docs/performance.md). It is the
CPU's decode layout where that build runs.

The fourth layout, 'fused' (jaxspec.model.accelerator.layout), keeps T5X's orientation
and stacks each decoder layer's self-attention q/k/v and gated MLP wi_0/wi_1 into one
kernel each, so a decode step on a GPU or TPU runs two products where T5X's layout runs
five (a small model's step there is bound by the kernels it launches).

  for_decoding(params)     -> tiled (AVX-512) or transposed on CPU, fused elsewhere (call
                              once, after loading)
  transposed_kernels(tree) -> every kernel as kernel_t [out, in]
  tiled_kernels(tree)      -> kernel_tiles [out / 16, in, 16] where out tiles, else kernel_t
  t5x_kernels(tree)        -> every kernel as T5X's kernel [in, out], none stacked or tiled
  fused_kernels(tree)      -> T5X's orientation with the decoder's q/k/v and wi_0/wi_1 stacked
"""

from __future__ import annotations

from typing import Any, Mapping

import jax
import numpy as np

from jaxspec.model.accelerator import layout as accelerator_layout
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.model.layers import KERNEL_PARAM, KERNEL_T_PARAM, KERNEL_TILES_PARAM

T5X = 't5x'  # kernel [in, out]
TRANSPOSED = 'transposed'  # kernel_t [out, in]
FUSED = 'fused'  # kernel [in, out]; the decoder's q/k/v and wi_0/wi_1 stacked
# kernel_tiles [out / 16, in, 16] where out is a multiple of 16, else kernel_t
TILED = 'tiled'
LAYOUTS = (T5X, TRANSPOSED, FUSED, TILED)


def decode_layout(platform: str | None = None) -> str:
  """The faster layout for decoding on `platform` (default: JAX's default backend): on
  the CPU the kernels jaxspec's CPU kernels read, tiled where their AVX-512 build runs
  (cpu_matmul.tiled_floats_apply) and transposed elsewhere; on a GPU or TPU the fused
  one."""
  platform = platform or jax.default_backend()
  if platform != 'cpu':
    return FUSED
  tiles_run_here = platform == jax.default_backend() and cpu_matmul.tiled_floats_apply()
  return TILED if tiles_run_here else TRANSPOSED


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


def _untiled(params: Mapping[str, Any]) -> Mapping[str, Any]:
  """Every `kernel_tiles` back to `kernel_t` [out, in] (params or variables)."""
  def untile(tree):
    return _rename_kernels(tree, KERNEL_TILES_PARAM, KERNEL_T_PARAM, _untile_leaf)
  if 'params' not in params:
    return untile(params)
  return {**params, 'params': untile(params['params'])}


def _untile_leaf(leaf):
  if isinstance(leaf, jax.ShapeDtypeStruct):
    count, inputs, lanes = leaf.shape
    return jax.ShapeDtypeStruct((count * lanes, inputs), leaf.dtype, sharding=None)
  return cpu_matmul.untile_kernel(leaf)


def _tile_tree(tree: Any) -> Any:
  """Each `kernel_t` leaf that tiles (cpu_matmul.tileable) as `kernel_tiles`."""
  if not isinstance(tree, Mapping):
    return tree
  tiled = {}
  for key, value in tree.items():
    if key == KERNEL_T_PARAM and not isinstance(value, Mapping) and cpu_matmul.tileable(value):
      if isinstance(value, jax.ShapeDtypeStruct):
        out, inputs = value.shape
        tiled[KERNEL_TILES_PARAM] = jax.ShapeDtypeStruct(
            (out // cpu_matmul.FLOAT_TILE_OUTPUTS, inputs, cpu_matmul.FLOAT_TILE_OUTPUTS),
            value.dtype, sharding=None)
      else:
        tiled[KERNEL_TILES_PARAM] = cpu_matmul.tile_kernel(value)
    else:
      tiled[key] = _tile_tree(value)
  return tiled


def transposed_kernels(params: Mapping[str, Any]) -> dict:
  """Every `kernel` [in, out] as `kernel_t` [out, in]; other leaves as they are.

  params: the 'params' collection or variables {'params', 'params_axes'?}. Kernels
  already transposed stay so, so the call is idempotent; stacked kernels are unstacked,
  tiled ones untiled.
  """
  return _convert(_untiled(accelerator_layout.unfused_kernels(params)), KERNEL_PARAM,
                  KERNEL_T_PARAM)


def t5x_kernels(params: Mapping[str, Any]) -> dict:
  """Every `kernel_t` [out, in] back to T5X's `kernel` [in, out] and every stacked or
  tiled kernel back to its parts (idempotent)."""
  return _convert(_untiled(accelerator_layout.unfused_kernels(params)), KERNEL_T_PARAM,
                  KERNEL_PARAM)


def tiled_kernels(params: Mapping[str, Any]) -> dict:
  """The transposed layout with every kernel_t whose outputs are a multiple of 16 tiled
  as `kernel_tiles` [out / 16, in, 16] (cpu_matmul.tile_kernel; idempotent). Variables'
  params_axes keep the kernel_t entries they had (a tiled kernel is never sharded)."""
  transposed = transposed_kernels(params)
  if 'params' not in transposed:
    return _tile_tree(transposed)
  return {**transposed, 'params': _tile_tree(transposed['params'])}


def fused_kernels(params: Mapping[str, Any]) -> dict:
  """T5X's orientation with the decoder's self-attention q/k/v and gated MLP wi_0/wi_1
  stacked into one kernel each (jaxspec.model.accelerator.layout; idempotent)."""
  return accelerator_layout.fused_kernels(t5x_kernels(params))


def has_transposed_kernels(params: Mapping[str, Any]) -> bool:
  """Whether any kernel of the tree is stored as `kernel_t` (or tiled from it)."""
  found = []
  for key in (KERNEL_T_PARAM, KERNEL_TILES_PARAM):
    _rename_kernels(params, key, key, lambda leaf: found.append(leaf) or leaf)
  return bool(found)


def to_layout(params: Mapping[str, Any], layout: str) -> dict:
  """params in `layout`: 't5x' (kernel [in, out]), 'transposed' (kernel_t [out, in]),
  'fused' (T5X's, the decoder's q/k/v and wi_0/wi_1 stacked) or 'tiled' (kernel_tiles
  [out / 16, in, 16] where out tiles, else kernel_t)."""
  if layout == T5X:
    return t5x_kernels(params)
  if layout == TRANSPOSED:
    return transposed_kernels(params)
  if layout == TILED:
    return tiled_kernels(params)
  if layout == FUSED:
    return fused_kernels(params)
  raise ValueError(f'kernel layout must be one of {LAYOUTS}, got {layout!r}')


def for_decoding(params: Mapping[str, Any], platform: str | None = None) -> dict:
  """params in the layout that decodes fastest on `platform` (see decode_layout).

  Call once after loading: the transpose copies every kernel, so doing it inside each
  generation would cost about one decode step's memory traffic per call.
  """
  return to_layout(params, decode_layout(platform))
