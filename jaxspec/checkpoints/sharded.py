"""Loading T5X checkpoints straight into sharded arrays.

Each process reads only the slices its own devices hold, and each distinct slice once
(devices that replicate a slice share the read), so no host ever materializes a full
copy of a model larger than one device. Legacy checkpoints are read per slice with
TensorStore (zarr reads only the chunks a slice touches); Orbax checkpoints are
restored by Orbax into the shardings.
"""

from __future__ import annotations

from typing import Any, Mapping

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from jaxspec.checkpoints import t5x
from jaxspec.checkpoints.validate import check_params
from jaxspec.config import T5Config


def _flat(tree: Mapping[str, Any], is_leaf=None) -> dict:
  return flax.traverse_util.flatten_dict(dict(tree), sep='/', is_leaf=is_leaf)


def _check_same_paths(stored, shardings, where: str) -> None:
  missing, extra = sorted(set(stored) - set(shardings)), sorted(set(shardings) - set(stored))
  if missing or extra:
    raise ValueError(f'{where}: the shardings do not match the checkpoint: no sharding for '
                     f'{missing[:5]}, no parameter for {extra[:5]}')


def _slice_key(index: tuple[slice, ...]) -> tuple:
  return tuple((s.start, s.stop, s.step) for s in index)


def _sharded_array(shape, sharding, read_slice, dtype) -> jax.Array:
  """A global array whose local shards come from read_slice(index) -> future-like.

  All distinct local slices are requested before any is awaited, so the reads overlap.
  """
  requests = {}
  for index in sharding.addressable_devices_indices_map(tuple(shape)).values():
    requests.setdefault(_slice_key(index), read_slice(index))

  def shard(index):
    return np.asarray(requests[_slice_key(index)].result()).astype(dtype, copy=False)

  return jax.make_array_from_callback(tuple(shape), sharding, shard)


class _Ready:
  """An already available value with a future's `result()`."""

  def __init__(self, value):
    self.value = value

  def result(self):
    return self.value


def _load_legacy(directory: str, config: T5Config | None, flat_shardings, dtype) -> dict:
  flat = _flat(t5x._read_legacy_tree(directory), is_leaf=lambda _, node: t5x.is_ts_spec(node))
  shapes = t5x._leaf_shapes(flat)
  if config is not None:  # Shapes come from the specs: check before reading.
    check_params(flax.traverse_util.unflatten_dict(shapes, sep='/'), config,
                 sources=t5x._sources(flat))
  _check_same_paths(flat, flat_shardings, directory)
  arrays = {}
  for path, leaf in flat.items():
    leaf_dtype = shapes[path].dtype if dtype is None else jnp.dtype(dtype)
    if t5x.is_ts_spec(leaf):
      store = t5x._named_errors(path, leaf, directory, lambda spec=leaf: ts.open(
          t5x.absolute_ts_spec(spec, directory), open=True, read=True).result())
      read_slice = lambda index, store=store: store[index].read()  # noqa: E731
    else:
      value = np.asarray(leaf)
      read_slice = lambda index, value=value: _Ready(value[index])  # noqa: E731
    def build(path=path, read_slice=read_slice, leaf_dtype=leaf_dtype):
      return _sharded_array(shapes[path].shape, flat_shardings[path], read_slice, leaf_dtype)
    # TensorStore's read errors surface here, named by array and parameter.
    arrays[path] = (t5x._named_errors(path, leaf, directory, build) if t5x.is_ts_spec(leaf)
                    else build())
  return arrays


def _load_orbax(directory: str, config: T5Config | None, flat_shardings, dtype) -> dict:
  import orbax.checkpoint as ocp  # Heavy import, only for the Orbax format.

  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  keys, target = t5x._orbax_target_metadata(checkpointer, directory)  # pylint: disable=protected-access
  if config is not None:
    check_params(target, config)
  flat_target = _flat(target)
  _check_same_paths(flat_target, flat_shardings, directory)

  def leaf_dtype(leaf):
    return leaf.dtype if dtype is None else jnp.dtype(dtype)

  item = flax.traverse_util.unflatten_dict(
      {path: jax.ShapeDtypeStruct(leaf.shape, leaf_dtype(leaf), sharding=flat_shardings[path])
       for path, leaf in flat_target.items()}, sep='/')
  restore_args = flax.traverse_util.unflatten_dict(
      {path: ocp.ArrayRestoreArgs(sharding=flat_shardings[path], dtype=leaf_dtype(leaf))
       for path, leaf in flat_target.items()}, sep='/')
  restored = t5x.restore_orbax_subtree(checkpointer, directory, keys, item, restore_args)
  return _flat(restored)


def load_t5x_checkpoint_sharded(path, config: T5Config | None,
                                shardings: Mapping[str, Any], *, dtype=None) -> dict:
  """Reads the params of a T5X checkpoint (legacy or Orbax) into sharded global arrays.

  path: as for `t5x.load_t5x_checkpoint` (a checkpoint_<step> directory or its parent,
    local or gs://).
  config: if given, paths and shapes are checked against it before any array is read.
  shardings: a tree like the params of jax.sharding.Sharding, e.g. from
    `jaxspec.partitioning.param_shardings`.
  dtype: the dtype of the returned arrays (cast shard by shard); default on-disk.
  Returns the nested 'params' dict of jax.Arrays, each with its sharding.
  """
  location = t5x.find_t5x_checkpoint(path)
  flat_shardings = _flat(shardings)
  if location.format == 'orbax':
    flat = _load_orbax(location.item, config, flat_shardings, dtype)
  else:
    flat = _load_legacy(location.directory, config, flat_shardings, dtype)
  return flax.traverse_util.unflatten_dict(flat, sep='/')
