"""T5X checkpoints without t5x: the legacy msgpack + TensorStore layout and T5X's Orbax layout.

Legacy layout (the public T5X checkpoints), for step N:

  checkpoint_N/checkpoint   flax msgpack of {'version': 3, 'optimizer': {
                              'target': params, 'state': {'step': N, 'param_states': {...}}}}
  checkpoint_N/target.encoder.layers_0.attention.key.kernel/   zarr v2 array (.zarray, chunks)

Each leaf of the msgpack tree is an inline array or a TensorStore spec dict
{'driver': 'zarr', 'dtype', 'kvstore': {'driver': 'file', 'path': <'/'-path with '.'>},
'metadata': {'shape', 'chunks', 'compressor'}} whose path is relative to checkpoint_N.

Orbax layout (T5X's CheckpointManager today): checkpoint_N/state/ is the output of
orbax's PyTreeCheckpointHandler (with OCDBT: _METADATA, manifest.ocdbt, d/,
ocdbt.process_0/) for the tree {'target': params, 'state': {'step': N}}.

What this module writes (legacy):
- Arrays smaller than `inline_threshold` bytes (default 64 KiB: every layer-norm scale and
  relative-position table of the public sizes) sit inline in the msgpack file; every other
  array is a zarr array. T5X itself writes every partitioned parameter as zarr; its
  readers accept either form, and `inline_threshold=0` writes all arrays as zarr.
- Chunks: the largest shape dividing the array with at most 64 MiB a chunk (T5X's target),
  found by shrinking the largest dimension to its next divisor. Compressor: gzip, as T5X.
- param_states: written as given, with the same naming ('state.param_states.<path>'),
  else as {}. T5X's inference state (t5x infer/eval: optimizer_def=None) reads only
  'target' and state/step. A training restore with an optimizer needs matching
  param_states, or the usual fine-tuning assignment_map ((r'state/param_states.*', None),)
  that initializes them from scratch.
- Atomic: everything is written into checkpoint_N.tmp-<id>/ in the same parent and renamed
  to checkpoint_N at the end; on failure the temporary directory is removed. An existing
  checkpoint_N is never overwritten (FileExistsError). Readers skip the .tmp- directories.

Reading resolves each spec's relative path against the checkpoint directory: a local
directory gives a 'file' kvstore, a gs://bucket/prefix directory a 'gcs' kvstore with that
bucket (T5X writes a dummy bucket), whatever driver the spec recorded.
"""

from __future__ import annotations

import copy
import os
import posixpath
import re
import shutil
import uuid
from typing import Any, Mapping, NamedTuple

import flax.serialization
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import tensorstore as ts

from jaxspec import paths
from jaxspec.errors import MissingFile
from jaxspec.checkpoints.validate import check_params
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.config import T5Config

VERSION = 3
INLINE_THRESHOLD_BYTES = 64 * 1024
_CHUNK_BYTES = 64 * 1024 * 1024
_COMPRESSOR = {'id': 'gzip'}
_MSGPACK_FILE = 'checkpoint'
_ORBAX_ITEM = 'state'
_ORBAX_METADATA = '_METADATA'
_STEP_DIR = re.compile(r'checkpoint_(\d+)')
_GCS_PATH = re.compile(r'gs://([^/]+)/?(.*)', re.DOTALL)
_LOCAL_DRIVERS = ('file', 'gfile')


class CheckpointLocation(NamedTuple):
  """Where a checkpoint is: its checkpoint_<step> directory, format and what to open."""
  directory: str  # checkpoint_<step>/
  format: str  # 'legacy' | 'orbax'
  item: str  # legacy: the msgpack file; orbax: the PyTree directory (usually directory/state)


# Saving.


def _unwrap(params: Mapping[str, Any]) -> Mapping[str, Any]:
  """The 'params' collection in T5X's kernel layout, from it or the variables
  {'params', 'params_axes'}, either kernel layout (jaxspec.model.cpu.layout)."""
  if 'params' in params and set(params) <= {'params', 'params_axes'}:
    params = params['params']
  return kernel_layout.t5x_kernels(params)


def _to_numpy(tree: Mapping[str, Any], dtype=None) -> dict:
  """Nested dict of arrays -> the same of numpy arrays, cast to `dtype` if given."""
  def convert(leaf):
    array = np.asarray(leaf)
    return array if dtype is None else array.astype(jnp.dtype(dtype))
  return jax.tree.map(convert, dict(tree))


def _largest_divisor_below(size: int, limit: int) -> int:
  """The largest divisor of `size` smaller than `limit` (`limit` > 1)."""
  return next(d for d in range(limit - 1, 0, -1) if size % d == 0)


def _chunk_shape(shape: tuple[int, ...], itemsize: int,
                 max_bytes: int | None = None) -> list[int]:
  """A chunk shape dividing `shape` with at most `max_bytes` (default 64 MiB) a chunk.

  Shrinks the currently largest chunk dimension to its next smaller divisor until the
  chunk fits; a chunk of a single element always fits.
  """
  max_bytes = _CHUNK_BYTES if max_bytes is None else max_bytes
  chunks = [max(int(size), 1) for size in shape]
  while int(np.prod(chunks)) * itemsize > max_bytes and max(chunks, default=1) > 1:
    axis = int(np.argmax(chunks))
    chunks[axis] = _largest_divisor_below(max(int(shape[axis]), 1), chunks[axis])
  return chunks


def _zarr_spec(name: str, array: np.ndarray) -> dict:
  """The relative TensorStore spec T5X records for the zarr array `name`."""
  return {
      'driver': 'zarr',
      'dtype': jnp.dtype(array.dtype).name,
      'kvstore': {'driver': 'file', 'path': name},
      'metadata': {
          'shape': [int(size) for size in array.shape],
          'chunks': _chunk_shape(array.shape, array.dtype.itemsize),
          'compressor': dict(_COMPRESSOR),
      },
  }


def _write_zarr(spec: Mapping[str, Any], array: np.ndarray) -> None:
  """Creates the zarr array of the absolute `spec` and writes `array` into it."""
  store = ts.open(dict(spec), create=True, open=False).result()
  store.write(array).result()


def _store_leaves(tree: Mapping[str, Any], prefix: str, directory: str,
                  inline_threshold: int) -> dict:
  """Writes the arrays of `tree` of `inline_threshold` bytes or more as zarr arrays
  named '<prefix>.<path with dots>' under `directory`; returns the tree for the msgpack
  file, with a spec in place of each written array.
  """
  flat = flax.traverse_util.flatten_dict(dict(tree), keep_empty_nodes=True)
  stored = {}
  for path, leaf in flat.items():
    if not isinstance(leaf, np.ndarray) or leaf.nbytes < inline_threshold:
      stored[path] = leaf
      continue
    spec = _zarr_spec('.'.join((prefix,) + path), leaf)
    _write_zarr(_with_kvstore(spec, directory), leaf)
    stored[path] = spec
  return flax.traverse_util.unflatten_dict(stored)


def _step_array(step: int) -> np.ndarray:
  """The step as T5X stores it: an int32 scalar array."""
  step = int(step)
  if not 0 <= step < 2**31:
    raise ValueError(f'step must be in [0, 2**31), got {step}')
  return np.asarray(step, np.int32)


def _step_dir_name(step: int) -> str:
  return f'checkpoint_{int(step)}'


def _write_atomically(directory, step: int, write_contents) -> str:
  """Runs `write_contents(tmp_dir)`, then renames tmp_dir to directory/checkpoint_<step>.

  The temporary directory is a sibling of the final one, so the rename is atomic; on
  any failure it is removed, so no checkpoint_<step> (whole or partial) appears. Local
  directories only.
  """
  directory = os.fspath(directory)
  if _is_gcs(directory):
    raise ValueError(f'{directory}: writing checkpoints to GCS is not supported')
  directory = os.path.abspath(directory)
  final = os.path.join(directory, _step_dir_name(step))
  if os.path.lexists(final):
    raise FileExistsError(f'{final} already exists; refusing to overwrite a checkpoint')
  os.makedirs(directory, exist_ok=True)
  tmp = f'{final}.tmp-{uuid.uuid4().hex}'
  os.mkdir(tmp)
  try:
    write_contents(tmp)
    os.rename(tmp, final)  # Fails, keeping `final`, if it appeared meanwhile.
  except BaseException:
    shutil.rmtree(tmp, ignore_errors=True)
    raise
  return final


def _write_file(path: str, contents: bytes) -> None:
  with open(path, 'wb') as file:
    file.write(contents)
    file.flush()
    os.fsync(file.fileno())


def save_t5x_checkpoint(directory, params: Mapping[str, Any], step: int, *,
                        dtype=None, inline_threshold: int = INLINE_THRESHOLD_BYTES,
                        param_states: Mapping[str, Any] | None = None) -> str:
  """Writes `params` as a legacy T5X checkpoint directory/checkpoint_<step>/; returns it.

  params: the 'params' collection (nested dict of arrays, e.g. embedding [V, E]) or the
    variables {'params', 'params_axes'} (params_axes are not stored, as in T5X).
  dtype: on-disk dtype of the params (e.g. 'bfloat16'); default: their own.
  inline_threshold: arrays with fewer bytes are stored inline in the msgpack file.
  param_states: optional optimizer state tree, written as is (not cast); default {}.
  """
  target = _to_numpy(_unwrap(params), dtype)
  states = _to_numpy(param_states or {})

  def write_contents(tmp: str) -> None:
    optimizer = {
        'target': _store_leaves(target, 'target', tmp, inline_threshold),
        'state': {
            'step': _step_array(step),
            'param_states': _store_leaves(states, 'state.param_states', tmp,
                                          inline_threshold),
        },
    }
    contents = {'version': VERSION, 'optimizer': optimizer}
    _write_file(os.path.join(tmp, _MSGPACK_FILE),
                flax.serialization.msgpack_serialize(contents))

  return _write_atomically(directory, step, write_contents)


def save_orbax_checkpoint(directory, params: Mapping[str, Any], step: int, *,
                          dtype=None) -> str:
  """Writes `params` in T5X's Orbax layout, directory/checkpoint_<step>/state/; returns
  checkpoint_<step>.

  The tree is {'target': params, 'state': {'step': step}} (T5X's inference state),
  written by orbax's PyTreeCheckpointHandler with OCDBT. dtype: on-disk dtype of params.
  """
  import orbax.checkpoint as ocp  # Heavy import, only for the Orbax format.

  tree = {'target': _to_numpy(_unwrap(params), dtype), 'state': {'step': _step_array(step)}}

  def write_contents(tmp: str) -> None:
    checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True))
    checkpointer.save(os.path.join(tmp, _ORBAX_ITEM), args=ocp.args.PyTreeSave(tree))

  return _write_atomically(directory, step, write_contents)


# Locating.


def _is_gcs(path: str) -> bool:
  return path.startswith('gs://')


def _local_location(directory: str) -> CheckpointLocation | None:
  """The checkpoint in `directory` itself, by its marker files, or None."""
  state = os.path.join(directory, _ORBAX_ITEM)
  if os.path.isfile(os.path.join(state, _ORBAX_METADATA)):
    return CheckpointLocation(directory, 'orbax', state)
  if os.path.isfile(os.path.join(directory, _ORBAX_METADATA)):
    return CheckpointLocation(directory, 'orbax', directory)
  if os.path.isfile(os.path.join(directory, _MSGPACK_FILE)):
    return CheckpointLocation(directory, 'legacy', os.path.join(directory, _MSGPACK_FILE))
  return None


def checkpoint_step(directory) -> int:
  """The step of a checkpoint_<step> directory; ValueError for a directory of another name."""
  match = _STEP_DIR.fullmatch(os.path.basename(os.path.normpath(os.fspath(directory))))
  if match is None:
    raise ValueError(f'{directory} is not a checkpoint_<step> directory')
  return int(match.group(1))


def checkpoint_steps(directory) -> list[int]:
  """The steps of the checkpoint_<step> subdirectories of a local directory, ascending."""
  return sorted(int(match.group(1)) for name in os.listdir(directory)
                if (match := _STEP_DIR.fullmatch(name)))


def _latest_local_checkpoint(directory: str) -> CheckpointLocation | None:
  """The checkpoint_<step> subdirectory holding a checkpoint with the largest step."""
  for step in reversed(checkpoint_steps(directory)):
    location = _local_location(os.path.join(directory, f'checkpoint_{step}'))
    if location is not None:
      return location
  return None


def _gcs_location(path: str) -> CheckpointLocation:
  """A gs:// checkpoint_<step> directory (listing a bucket for steps is not supported)."""
  path = path.rstrip('/')
  if not _STEP_DIR.fullmatch(posixpath.basename(path)):
    raise ValueError(f'{path}: for gs:// paths give the checkpoint_<step> directory itself')
  kvstore = _directory_kvstore(path)
  for item, metadata in ((f'{path}/{_ORBAX_ITEM}', f'{_ORBAX_ITEM}/{_ORBAX_METADATA}'),
                         (path, _ORBAX_METADATA)):
    if _key_exists(kvstore, metadata):
      return CheckpointLocation(path, 'orbax', item)
  return CheckpointLocation(path, 'legacy', f'{path}/{_MSGPACK_FILE}')


def find_t5x_checkpoint(path) -> CheckpointLocation:
  """Locates the checkpoint at `path`: a checkpoint_<step> directory, a legacy msgpack
  file of any name (as T5X accepts; its TensorStore arrays are read beside it), an Orbax
  PyTree directory, or a parent of checkpoint_<step> directories (the largest step
  holding a checkpoint wins). A relative path that does not exist from the working
  directory is looked up in the shipped checkpoints directories (jaxspec.paths:
  $JAXSPEC_CHECKPOINT_DIR, else the working directory's checkpoints/ and the package
  checkout's). Raises jaxspec.errors.MissingFile (a FileNotFoundError) naming what was
  looked for.
  """
  path = paths.resolve_checkpoint(os.fspath(path))
  if _is_gcs(path):
    return _gcs_location(path)
  if os.path.isfile(path):
    return CheckpointLocation(os.path.dirname(path) or '.', 'legacy', path)
  if not os.path.isdir(path):
    raise MissingFile(f'no checkpoint directory at {path}')
  location = _local_location(path) or _latest_local_checkpoint(path)
  if location is None:
    raise MissingFile(
        f'{path} is not a T5X checkpoint: it holds no `{_MSGPACK_FILE}` msgpack file '
        f'(legacy), no `{_ORBAX_ITEM}/{_ORBAX_METADATA}` or `{_ORBAX_METADATA}` (Orbax), '
        'and no checkpoint_<step> subdirectory with one of them')
  return location


# Reading.


def _directory_kvstore(directory: str) -> dict:
  """The TensorStore kvstore of a local or gs://bucket/prefix directory."""
  match = _GCS_PATH.fullmatch(directory)
  if match is None:
    return {'driver': 'file', 'path': os.path.abspath(directory) + '/'}
  prefix = match.group(2).strip('/')
  return {'driver': 'gcs', 'bucket': match.group(1), 'path': prefix + '/' if prefix else ''}


def _read_key(kvstore: Mapping[str, Any], key: str) -> bytes | None:
  """The bytes stored under `key` in `kvstore`, or None if there are none."""
  result = ts.KvStore.open(dict(kvstore)).result().read(key).result()
  return bytes(result.value) if result.state == 'value' else None


def _key_exists(kvstore: Mapping[str, Any], key: str) -> bool:
  return _read_key(kvstore, key) is not None


def _jsonable(value):
  """msgpack-restored spec values (numpy arrays and scalars) -> JSON values."""
  if isinstance(value, dict):
    return {key: _jsonable(item) for key, item in value.items()}
  if isinstance(value, (np.ndarray, np.generic)):
    return value.tolist()
  if isinstance(value, (list, tuple)):
    return [_jsonable(item) for item in value]
  return value


def _join(directory: str, relative: str) -> str:
  return posixpath.join(directory, relative) if directory else relative


def _with_kvstore(spec: Mapping[str, Any], checkpoint_dir: str) -> dict:
  """A copy of the T5X `spec` whose kvstore is its relative path under `checkpoint_dir`.

  checkpoint_dir local: kvstore {'driver': 'file', 'path': <dir>/<path>}.
  checkpoint_dir gs://bucket/prefix: kvstore {'driver': 'gcs', 'bucket': bucket,
  'path': prefix/<path>}. Both whatever driver the spec recorded ('file', 'gfile', or
  'gcs' with T5X's dummy bucket), so a checkpoint copied between disk and GCS reads.
  Also accepts the pre-0.1.14 TensorStore form with 'path' beside 'kvstore'.
  """
  spec = _jsonable(copy.deepcopy(dict(spec)))
  kvstore = spec.get('kvstore') or {}
  top_level_path = spec.pop('path', None)
  relative = kvstore.get('path', top_level_path)
  if kvstore.get('driver') not in _LOCAL_DRIVERS + ('gcs',) or relative is None:
    raise ValueError(f'unsupported TensorStore spec in the checkpoint: {spec}')
  spec['kvstore'] = _directory_kvstore(checkpoint_dir)
  spec['kvstore']['path'] = _join(spec['kvstore']['path'], relative)
  return spec


def absolute_ts_spec(spec: Mapping[str, Any], checkpoint_dir: str) -> dict:
  """A T5X spec read from a checkpoint's msgpack file -> a spec TensorStore can open.

  The kvstore is resolved as by `_with_kvstore` (local file, or gcs with the bucket of
  a gs:// checkpoint_dir). Metadata chunks and compressor are dropped, as T5X does: they
  are read from the array's .zarray. Raises ValueError for unsupported drivers and for
  the uint16 arrays of checkpoint versions before 3.
  """
  spec = _with_kvstore(spec, checkpoint_dir)
  if spec.get('dtype') == 'uint16' or spec.get('metadata', {}).get('dtype') == '<u2':
    raise ValueError('uint16 arrays (bfloat16 of checkpoint version < 3) are not '
                     f'supported: {spec}')
  spec['metadata'] = {key: value for key, value in spec.get('metadata', {}).items()
                      if key not in ('chunks', 'compressor')}
  return spec


def is_ts_spec(leaf) -> bool:
  """Whether a msgpack leaf is a TensorStore spec dict rather than an array."""
  return isinstance(leaf, dict) and {'driver', 'kvstore'} <= set(leaf)


def _legacy_target(contents, where: str) -> dict:
  """The params tree of a restored msgpack file (arrays and spec dicts)."""
  if not isinstance(contents, dict):
    raise ValueError(f'{where} is not a T5X checkpoint: it holds a {type(contents).__name__}')
  version = contents.get('version', 0)
  if not isinstance(version, int):
    raise ValueError(f'{where} is not a T5X checkpoint: version {version!r}')
  if 'optimizer' in contents and version >= 2:
    state = contents['optimizer']
  elif version == 0:  # A plain flax optimizer checkpoint.
    state = contents
  else:
    raise ValueError(f'{where}: unsupported T5X checkpoint version {version} '
                     f'(keys {sorted(map(str, contents))})')
  if not isinstance(state, dict) or 'target' not in state:
    raise ValueError(f'{where} is not a T5X checkpoint: no optimizer target '
                     f'(top-level keys {sorted(map(str, contents))})')
  return state['target']


def _read_legacy_tree(directory: str, msgpack_file: str = _MSGPACK_FILE) -> dict:
  """The 'target' tree of the legacy checkpoint in `directory` (its msgpack file named
  `msgpack_file`): arrays and spec dicts."""
  where = _join(directory, msgpack_file)
  raw = _read_key(_directory_kvstore(directory), msgpack_file)
  if raw is None:
    raise FileNotFoundError(f'{where} does not exist')
  try:
    contents = flax.serialization.msgpack_restore(raw)
  except Exception as error:  # msgpack raises many types on corrupt input.
    raise ValueError(f'{where} is corrupt: not a flax msgpack file '
                     f'({type(error).__name__}: {error})') from error
  return _legacy_target(contents, where)


def _leaf_shapes(flat: Mapping[str, Any]) -> dict[str, jax.ShapeDtypeStruct]:
  """Shapes and dtypes of the flat leaves, from the spec metadata where not inline."""
  def shape_of(leaf):
    if is_ts_spec(leaf):
      return jax.ShapeDtypeStruct(tuple(_jsonable(leaf['metadata']['shape'])),
                                  jnp.dtype(leaf['dtype']))
    return jax.ShapeDtypeStruct(np.shape(leaf), np.asarray(leaf).dtype)
  return {path: shape_of(leaf) for path, leaf in flat.items()}


def _read_specs(flat: Mapping[str, Any], directory: str) -> dict[str, np.ndarray]:
  """Reads every spec leaf of `flat` (all reads run concurrently); arrays pass through.

  Raises FileNotFoundError for a missing zarr array and ValueError for an unreadable
  one, naming the array's directory and the parameter.
  """
  opened = {path: ts.open(absolute_ts_spec(leaf, directory), open=True, read=True)
            for path, leaf in flat.items() if is_ts_spec(leaf)}
  reads = {path: _named_errors(path, flat[path], directory, lambda f=future: f.result().read())
           for path, future in opened.items()}
  return {path: (_named_errors(path, leaf, directory, reads[path].result) if path in reads
                 else np.asarray(leaf)) for path, leaf in flat.items()}


def _named_errors(path: str, spec: Mapping[str, Any], directory: str, get):
  """get(), with TensorStore's errors (all ValueError) naming the array and parameter."""
  try:
    return get()
  except ValueError as error:
    where = _join(directory, _sources({path: spec})[path])
    if 'NOT_FOUND' in str(error):
      raise FileNotFoundError(f'{where}: the zarr array of parameter {path} is missing; '
                              f'the checkpoint is incomplete ({error})') from error
    raise ValueError(f'{where}: the zarr array of parameter {path} is corrupt or '
                     f'unreadable ({error})') from error


def _sources(flat: Mapping[str, Any]) -> dict[str, str]:
  """'/'-path -> where the leaf is stored, for error messages."""
  return {path: leaf['kvstore'].get('path', leaf.get('path')) if is_ts_spec(leaf)
          else 'inline' for path, leaf in flat.items()}


def _load_legacy(directory: str, config: T5Config | None,
                 msgpack_file: str = _MSGPACK_FILE) -> dict[str, np.ndarray]:
  flat = flax.traverse_util.flatten_dict(_read_legacy_tree(directory, msgpack_file), sep='/',
                                        is_leaf=lambda _, node: is_ts_spec(node))
  if config is not None:  # Shapes come from the specs: check before reading.
    check_params(flax.traverse_util.unflatten_dict(_leaf_shapes(flat), sep='/'), config,
                 sources=_sources(flat))
  return _read_specs(flat, directory)


def _orbax_tree_metadata(checkpointer, directory: str) -> dict:
  """The metadata tree of an Orbax PyTree checkpoint, across orbax versions."""
  metadata = checkpointer.metadata(directory)
  metadata = getattr(metadata, 'item_metadata', metadata)
  return dict(getattr(metadata, 'tree', metadata))


def _orbax_target_metadata(checkpointer, directory: str) -> tuple[tuple[str, ...], Mapping]:
  """(keys, metadata tree) of the model parameters: ('target',) or ('optimizer', 'target')."""
  tree = _orbax_tree_metadata(checkpointer, directory)
  keys = ('optimizer', 'target') if 'optimizer' in tree else ('target',)
  target = tree
  for key in keys:
    if not isinstance(target, Mapping) or key not in target:
      raise ValueError(f'{directory}: Orbax checkpoint without {"/".join(keys)} '
                       f'(top-level keys {sorted(tree)})')
    target = target[key]
  return keys, target


def _load_orbax(directory: str, config: T5Config | None, dtype) -> dict[str, np.ndarray]:
  import orbax.checkpoint as ocp  # Heavy import, only for the Orbax format.

  checkpointer = ocp.Checkpointer(ocp.PyTreeCheckpointHandler())
  keys, target = _orbax_target_metadata(checkpointer, directory)
  if config is not None:
    check_params(target, config)
  restore_args = jax.tree.map(
      lambda _: ocp.RestoreArgs(restore_type=np.ndarray, dtype=dtype), target)
  item = jax.tree.map(lambda leaf: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype), target)
  restored = restore_orbax_subtree(checkpointer, directory, keys, item, restore_args)
  return flax.traverse_util.flatten_dict(dict(restored), sep='/')


def restore_orbax_subtree(checkpointer, directory: str, keys, item, restore_args):
  """Restores only the parameter subtree at `keys` (item / restore_args describe it)."""
  import orbax.checkpoint as ocp  # Heavy import, only for the Orbax format.

  for key in reversed(keys):
    item, restore_args = {key: item}, {key: restore_args}
  restored = checkpointer.restore(directory, args=ocp.args.PyTreeRestore(
      item=item, restore_args=restore_args, partial_restore=True))
  for key in keys:
    restored = restored[key]
  return restored


def load_t5x_checkpoint(path, config: T5Config | None = None, *, dtype=None) -> dict:
  """Reads the params (the optimizer 'target') of a T5X checkpoint; ignores optimizer state.

  path: a checkpoint_<step> directory or its parent (the latest step wins), local or
    gs://bucket/... (a checkpoint_<step> directory there); legacy or Orbax format; or a
    local legacy msgpack file of any name.
  config: if given, the params must have exactly its paths and shapes (ValueError naming
    the first mismatched path and both shapes), checked before arrays are read.
  dtype: the dtype to return (e.g. float32 from a bfloat16 checkpoint); default on-disk.
  Returns the nested 'params' dict of numpy arrays, e.g. token_embedder/embedding [V, E].
  """
  location = find_t5x_checkpoint(path)
  if location.format == 'orbax':
    flat = _load_orbax(location.item, config, dtype)
  else:
    flat = _load_legacy(location.directory, config, posixpath.basename(location.item))
  if dtype is not None:
    flat = {path: np.asarray(array).astype(jnp.dtype(dtype), copy=False)
            for path, array in flat.items()}
  return flax.traverse_util.unflatten_dict(flat, sep='/')
