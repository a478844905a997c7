"""The accelerator decode layout: each decoder layer's self-attention q/k/v in one kernel
and its gated MLP's wi_0/wi_1 in one.

On a GPU a small model's decode step is bound by the kernels it launches, not by the
bytes it reads: T5.1.1-small's step reached 4% of an H200's memory bandwidth
(results/accelerator/nvidia-h200.json), so a draft step cost 0.11 of an XXL step where
its bytes alone would make it 0.005. In T5X's layout a decoder layer multiplies its
input by the query, key and value kernels (three products) and the MLP's input by
wi_0 and wi_1 (two). Stacked, each group is ONE product over a kernel [e, 3, h*d] or
[e, 2, f]: the same arithmetic in two products instead of five. The cross-attention
keeps its projections apart: init_cache applies its key and value kernels once per
input, a step only its query kernel.

  fused_kernels(params)     the decoder's self-attention query/key/value `kernel`s ->
                            `qkv_kernel` [e, 3, h*d] on the attention module, the gated
                            MLP's wi_0/wi_1 `kernel`s -> `wi_kernel` [e, 2, f] on the MLP
                            (T5X's orientation in; jaxspec.model.cpu.layout.to_layout
                            converts from any layout)
  unfused_kernels(params)   the stacked kernels back to T5X's separate ones (exact)
  has_fused_kernels(params) whether the tree holds any

Only the decoder is fused (the encoder runs once per input). `jaxspec.model.layers`
decodes with whichever kernels the params hold, so every decoder and drafter accepts
both trees; checkpoint writers, exporters and check_params see T5X's layout (they unfuse
first). Leaves may be jax or numpy arrays or jax.ShapeDtypeStruct; variables with
'params_axes' get the stacked kernels' logical axes (`stack` for the new axis, which
T5X's rules leave unsharded).
"""

from __future__ import annotations

from typing import Any, Mapping

from flax.linen.partitioning import AxisMetadata
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.model.layers import KERNEL_PARAM, KERNEL_QKV, KERNEL_WI

# (module name, the Dense submodules stacked in order, the stacked kernel's name, the
# logical axes of one kernel [in, out]).
FUSED_GROUPS = (
    ('self_attention', ('query', 'key', 'value'), KERNEL_QKV, ('embed', 'joined_kv')),
    ('mlp', ('wi_0', 'wi_1'), KERNEL_WI, ('embed', 'mlp')),
)
STACK_AXIS = 'stack'  # The logical name of the stacking axis (T5X's rules: unsharded).
FUSED_SUBTREE = 'decoder'  # The top-level subtree whose layers are fused.


def _stack(leaves):
  """Kernels [in, out] -> [in, n, out] (jax, numpy or shape-only leaves)."""
  first = leaves[0]
  if isinstance(first, jax.ShapeDtypeStruct):
    return jax.ShapeDtypeStruct((first.shape[0], len(leaves), first.shape[1]), first.dtype)
  if isinstance(first, jax.Array):
    return jnp.stack(leaves, axis=1)
  return np.stack([np.asarray(leaf) for leaf in leaves], axis=1)


def _unstack(stacked):
  """A stacked kernel [in, n, out] -> n kernels [in, out] (as _stack's leaves)."""
  count = stacked.shape[1]
  if isinstance(stacked, jax.ShapeDtypeStruct):
    shape = (stacked.shape[0], stacked.shape[2])
    return [jax.ShapeDtypeStruct(shape, stacked.dtype) for _ in range(count)]
  if isinstance(stacked, jax.Array):
    return [stacked[:, i, :] for i in range(count)]
  stacked = np.asarray(stacked)
  return [np.ascontiguousarray(stacked[:, i, :]) for i in range(count)]


def _group(module_name: str):
  for group in FUSED_GROUPS:
    if group[0] == module_name:
      return group
  return None


def _fusable(module: Mapping[str, Any], parts) -> bool:
  return all(isinstance(module.get(part), Mapping) and set(module[part]) == {KERNEL_PARAM}
             for part in parts)


def _fuse_params(tree: Mapping[str, Any], path: tuple[str, ...]) -> dict:
  out = {}
  for key, value in tree.items():
    out[key] = _fuse_params(value, path + (key,)) if isinstance(value, Mapping) else value
  group = _group(path[-1]) if len(path) > 1 and path[0] == FUSED_SUBTREE else None
  if group and _fusable(out, group[1]):
    _, parts, name, _ = group
    out[name] = _stack([out.pop(part)[KERNEL_PARAM] for part in parts])
  return out


def _unfuse_params(tree: Mapping[str, Any]) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out[key] = _unfuse_params(value)
      continue
    group = next((g for g in FUSED_GROUPS if g[2] == key), None)
    if group is None:
      out[key] = value
      continue
    for part, kernel in zip(group[1], _unstack(value)):
      out[part] = {KERNEL_PARAM: kernel}
  return out


def _fuse_axes(tree: Mapping[str, Any], path: tuple[str, ...]) -> dict:
  """params_axes (leaves '<name>_axes': AxisMetadata) as _fuse_params changes the params."""
  out = {}
  for key, value in tree.items():
    out[key] = _fuse_axes(value, path + (key,)) if isinstance(value, Mapping) else value
  group = _group(path[-1]) if len(path) > 1 and path[0] == FUSED_SUBTREE else None
  axes_name = f'{KERNEL_PARAM}_axes'
  if group and all(isinstance(out.get(part), Mapping) and set(out[part]) == {axes_name}
                   for part in group[1]):
    _, parts, name, (inputs, outputs) = group
    for part in parts:
      out.pop(part)
    out[f'{name}_axes'] = AxisMetadata(names=(inputs, STACK_AXIS, outputs))
  return out


def _unfuse_axes(tree: Mapping[str, Any]) -> dict:
  out = {}
  for key, value in tree.items():
    if isinstance(value, Mapping):
      out[key] = _unfuse_axes(value)
      continue
    group = next((g for g in FUSED_GROUPS if f'{g[2]}_axes' == key), None)
    if group is None:
      out[key] = value
      continue
    for part in group[1]:
      out[part] = {f'{KERNEL_PARAM}_axes': AxisMetadata(names=group[3])}
  return out


def _convert(variables: Mapping[str, Any], params_fn, axes_fn) -> dict:
  """Converts params (bare, or variables with 'params' and optional 'params_axes')."""
  if 'params' not in variables:
    return params_fn(variables)
  converted = dict(variables)
  converted['params'] = params_fn(variables['params'])
  if 'params_axes' in variables:
    converted['params_axes'] = axes_fn(variables['params_axes'])
  return converted


def fused_kernels(params: Mapping[str, Any]) -> dict:
  """The decoder's self-attention q/k/v and gated MLP wi_0/wi_1 kernels stacked into one
  kernel each (`qkv_kernel` [e, 3, h*d], `wi_kernel` [e, 2, f]); every other leaf as it
  is. params: the 'params' collection or variables {'params', 'params_axes'?}, kernels
  in T5X's layout (`kernel` [in, out]); idempotent."""
  return _convert(params, lambda tree: _fuse_params(tree, ()),
                  lambda tree: _fuse_axes(tree, ()))


def unfused_kernels(params: Mapping[str, Any]) -> dict:
  """Every stacked kernel back to T5X's separate `kernel`s [in, out] (exact; idempotent)."""
  return _convert(params, _unfuse_params, _unfuse_axes)


def has_fused_kernels(params: Mapping[str, Any]) -> bool:
  """Whether any kernel of the tree is stacked."""
  names = {group[2] for group in FUSED_GROUPS}

  def found(tree):
    return any(found(value) if isinstance(value, Mapping) else key in names
               for key, value in tree.items())

  return found(params)
