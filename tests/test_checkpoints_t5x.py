"""T5X checkpoints: legacy and Orbax round trips, the on-disk layout read without our
reader, dtype handling, step selection, errors and atomic writes."""

import functools
import json
import os

import flax.serialization
import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tensorstore as ts

from jaxspec.checkpoints import t5x
from jaxspec.config import get_config
from jaxspec.model import T5, init_params

CONFIG_NAMES = ('test_tiny_1_1', 'test_tiny_1_0')
# Tiny params: scales [32] (128 B) stay inline, everything else ([4, 32] and up) is zarr.
THRESHOLD = 256


@pytest.fixture(scope='module')
def models():
  """name -> (config, params)."""
  result = {}
  for name in CONFIG_NAMES:
    config = get_config(name)
    result[name] = config, jax.device_get(init_params(config, jax.random.PRNGKey(0))['params'])
  return result


def _read_msgpack(checkpoint_dir):
  return flax.serialization.msgpack_restore((checkpoint_dir / 'checkpoint').read_bytes())


def _flat(tree):
  return flax.traverse_util.flatten_dict(tree, sep='/')


def _assert_same_arrays(actual, expected, dtype=None):
  actual, expected = _flat(actual), _flat(expected)
  assert sorted(actual) == sorted(expected)
  for path, value in expected.items():
    value = np.asarray(value) if dtype is None else np.asarray(value).astype(dtype)
    assert actual[path].dtype == value.dtype, path
    np.testing.assert_array_equal(actual[path], value, err_msg=path)


@functools.partial(jax.jit, static_argnums=0)
def _jitted_logits(config, params, encoder_tokens, decoder_tokens):
  return T5(config).apply({'params': params}, encoder_tokens, decoder_tokens)


def _logits(config, params):
  """Teacher-forced logits [2, 5, V] on a fixed batch with padding."""
  encoder_tokens = jnp.array([[5, 9, 3, 1, 0, 0], [7, 2, 8, 6, 4, 1]], jnp.int32)
  decoder_tokens = jnp.array([[0, 11, 12, 13, 1], [0, 3, 3, 9, 2]], jnp.int32)
  return np.asarray(_jitted_logits(config, params, encoder_tokens, decoder_tokens))


@pytest.mark.parametrize('name', CONFIG_NAMES)
@pytest.mark.parametrize('save', ['legacy', 'orbax'])
def test_round_trip_gives_identical_arrays_and_logits(models, tmp_path, name, save):
  config, params = models[name]
  if save == 'legacy':
    written = t5x.save_t5x_checkpoint(tmp_path, params, 42, inline_threshold=THRESHOLD)
  else:
    written = t5x.save_orbax_checkpoint(tmp_path, params, 42)
  assert written == str(tmp_path / 'checkpoint_42')
  assert t5x.find_t5x_checkpoint(written).format == save
  loaded = t5x.load_t5x_checkpoint(written, config)
  _assert_same_arrays(loaded, params)
  np.testing.assert_array_equal(_logits(config, loaded), _logits(config, params))


def test_legacy_layout_read_with_flax_and_tensorstore_only(models, tmp_path):
  _, params = models['test_tiny_1_1']
  directory = tmp_path / 'checkpoint_7'
  t5x.save_t5x_checkpoint(tmp_path, params, 7, inline_threshold=THRESHOLD)
  contents = _read_msgpack(directory)
  assert set(contents) == {'version', 'optimizer'} and contents['version'] == 3
  assert set(contents['optimizer']) == {'target', 'state'}
  assert int(contents['optimizer']['state']['step']) == 7
  assert contents['optimizer']['state']['param_states'] == {}
  target = contents['optimizer']['target']
  leaf_is_spec = lambda x: isinstance(x, dict) and 'driver' in x
  on_disk = flax.traverse_util.flatten_dict(target, sep='/', is_leaf=lambda _, x: leaf_is_spec(x))
  assert sorted(on_disk) == sorted(_flat(params))
  for path, value in _flat(params).items():
    leaf = on_disk[path]
    if value.nbytes < THRESHOLD:
      assert isinstance(leaf, np.ndarray), path
      np.testing.assert_array_equal(leaf, value)
      continue
    name = 'target.' + path.replace('/', '.')
    assert leaf['driver'] == 'zarr' and leaf['dtype'] == 'float32'
    assert leaf['kvstore'] == {'driver': 'file', 'path': name}
    assert list(leaf['metadata']['shape']) == list(value.shape)
    assert leaf['metadata']['compressor']['id'] == 'gzip'
    zarray = json.loads((directory / name / '.zarray').read_text())
    assert zarray['compressor']['id'] == 'gzip' and zarray['shape'] == list(value.shape)
    kvstore = {'driver': 'file', 'path': str(directory / name)}
    store = ts.open({'driver': 'zarr', 'kvstore': kvstore}, open=True).result()
    np.testing.assert_array_equal(store.read().result(), value)
  assert sum(t5x.is_ts_spec(leaf) for leaf in on_disk.values()) > 0
  assert sum(isinstance(leaf, np.ndarray) for leaf in on_disk.values()) > 0


def test_orbax_layout_read_with_orbax_only(models, tmp_path):
  import orbax.checkpoint as ocp

  _, params = models['test_tiny_1_0']
  t5x.save_orbax_checkpoint(tmp_path, params, 12)
  state_dir = tmp_path / 'checkpoint_12' / 'state'
  assert (state_dir / '_METADATA').is_file() and (state_dir / 'manifest.ocdbt').is_file()
  assert not (tmp_path / 'checkpoint_12' / 'checkpoint').exists()
  assert os.listdir(tmp_path) == ['checkpoint_12']
  restored = ocp.PyTreeCheckpointer().restore(state_dir)
  assert set(restored) == {'target', 'state'} and int(restored['state']['step']) == 12
  _assert_same_arrays(jax.device_get(restored['target']), params)


def test_many_chunks_and_chunk_shapes(models, tmp_path, monkeypatch):
  config, params = models['test_tiny_1_0']
  monkeypatch.setattr(t5x, '_CHUNK_BYTES', 1024)
  t5x.save_t5x_checkpoint(tmp_path, params, 1, inline_threshold=0)
  embedding = tmp_path / 'checkpoint_1' / 'target.token_embedder.embedding'
  zarray = json.loads((embedding / '.zarray').read_text())
  assert zarray['shape'] == [64, 32] and np.prod(zarray['chunks']) * 4 <= 1024
  _assert_same_arrays(t5x.load_t5x_checkpoint(tmp_path, config), params)
  mib_64 = 64 * 1024 * 1024
  assert t5x._chunk_shape((4096, 10240), 4, mib_64) == [4096, 2560]  # 40 MiB.
  assert t5x._chunk_shape((32128, 4096), 2, mib_64) == [8032, 4096]  # 32128 = 4 * 8032.
  assert t5x._chunk_shape((7,), 4, max_bytes=4) == [1]
  assert t5x._chunk_shape((), 4) == []


def test_bfloat16_on_disk_loads_as_float32(models, tmp_path):
  config, params = models['test_tiny_1_1']
  t5x.save_t5x_checkpoint(tmp_path, params, 3, dtype='bfloat16', inline_threshold=THRESHOLD)
  t5x.save_orbax_checkpoint(tmp_path / 'orbax', params, 3, dtype='bfloat16')
  contents = _read_msgpack(tmp_path / 'checkpoint_3')
  spec = contents['optimizer']['target']['token_embedder']['embedding']
  assert spec['dtype'] == 'bfloat16'
  assert contents['optimizer']['target']['encoder']['encoder_norm']['scale'].dtype == jnp.bfloat16
  rounded = jax.tree.map(lambda x: np.asarray(x).astype(jnp.bfloat16), params)
  for path in (tmp_path, tmp_path / 'orbax'):
    _assert_same_arrays(t5x.load_t5x_checkpoint(path), rounded)
    as_float32 = t5x.load_t5x_checkpoint(path, config, dtype=jnp.float32)
    _assert_same_arrays(as_float32, rounded, dtype=np.float32)
    np.testing.assert_allclose(_logits(config, as_float32), _logits(config, params),
                               rtol=0.05, atol=0.05)


def test_parent_directory_picks_the_latest_step(models, tmp_path):
  config, params = models['test_tiny_1_1']
  doubled = jax.tree.map(lambda x: 2 * x, params)
  t5x.save_t5x_checkpoint(tmp_path, params, 3)
  t5x.save_orbax_checkpoint(tmp_path, params, 5)
  t5x.save_t5x_checkpoint(tmp_path, doubled, 10)
  (tmp_path / 'checkpoint_20.tmp-abc').mkdir()  # An interrupted write.
  (tmp_path / 'checkpoint_30').mkdir()  # Not a checkpoint.
  (tmp_path / 'checkpoint_40.tmp-abc').mkdir()
  (tmp_path / 'checkpoint_40.tmp-abc' / 'checkpoint').write_bytes(b'')
  assert t5x.find_t5x_checkpoint(tmp_path).directory == str(tmp_path / 'checkpoint_10')
  _assert_same_arrays(t5x.load_t5x_checkpoint(tmp_path, config), doubled)
  # The `checkpoint` file itself is accepted too, and, as T5X does, under any name.
  _assert_same_arrays(t5x.load_t5x_checkpoint(tmp_path / 'checkpoint_3' / 'checkpoint'), params)
  (tmp_path / 'checkpoint_10' / 'checkpoint').rename(tmp_path / 'checkpoint_10' / 'model.msgpack')
  _assert_same_arrays(
      t5x.load_t5x_checkpoint(tmp_path / 'checkpoint_10' / 'model.msgpack', config), doubled)


def test_not_a_checkpoint_raises_clearly(tmp_path):
  with pytest.raises(FileNotFoundError, match=r'not a T5X checkpoint.*checkpoint_<step>'):
    t5x.load_t5x_checkpoint(tmp_path)
  with pytest.raises(FileNotFoundError, match='no checkpoint directory'):
    t5x.load_t5x_checkpoint(tmp_path / 'missing')


@pytest.mark.parametrize('contents', [b'\xc1\x00garbage', b'\x93\x01\x02', b''])
def test_corrupt_msgpack_names_the_file(models, tmp_path, contents):
  _, params = models['test_tiny_1_1']
  t5x.save_t5x_checkpoint(tmp_path, params, 1)
  path = tmp_path / 'checkpoint_1' / 'checkpoint'
  path.write_bytes(contents)
  with pytest.raises(ValueError, match=str(path)):
    t5x.load_t5x_checkpoint(tmp_path)


def test_truncated_msgpack_names_the_file(models, tmp_path):
  _, params = models['test_tiny_1_1']
  t5x.save_t5x_checkpoint(tmp_path, params, 1)
  path = tmp_path / 'checkpoint_1' / 'checkpoint'
  path.write_bytes(path.read_bytes()[:-100])
  with pytest.raises(ValueError, match=f'{path} is corrupt'):
    t5x.load_t5x_checkpoint(tmp_path)


@pytest.mark.parametrize('save', ['legacy', 'orbax'])
def test_config_mismatch_names_the_path_and_shapes(models, tmp_path, save):
  config, params = models['test_tiny_1_1']
  writer = t5x.save_t5x_checkpoint if save == 'legacy' else t5x.save_orbax_checkpoint
  writer(tmp_path, params, 1)
  wider = config.replace(mlp_dim=64)
  message = r"'decoder/layers_0/mlp/wi_0/kernel'.*\(32, 48\).*\(32, 64\)"
  with pytest.raises(ValueError, match=message):
    t5x.load_t5x_checkpoint(tmp_path, wider)


def test_failed_write_leaves_no_partial_checkpoint(models, tmp_path, monkeypatch):
  config, params = models['test_tiny_1_1']
  t5x.save_t5x_checkpoint(tmp_path, params, 1, inline_threshold=0)
  real_write = t5x._write_zarr
  calls = []

  def write_then_fail(spec, array):
    calls.append(spec['kvstore']['path'])
    if len(calls) > 1:
      raise OSError('disk full')
    real_write(spec, array)

  monkeypatch.setattr(t5x, '_write_zarr', write_then_fail)
  with pytest.raises(OSError, match='disk full'):
    t5x.save_t5x_checkpoint(tmp_path, params, 2, inline_threshold=0)
  assert len(calls) == 2 and os.listdir(tmp_path) == ['checkpoint_1']
  with pytest.raises(FileExistsError):
    t5x.save_t5x_checkpoint(tmp_path, params, 1)
  _assert_same_arrays(t5x.load_t5x_checkpoint(tmp_path, config), params)


def test_param_states_are_written_under_state_and_ignored_on_load(models, tmp_path):
  config, params = models['test_tiny_1_1']
  param_states = {'token_embedder': {'embedding': {
      'v_row': np.full((64,), 0.5, np.float32), 'v_col': np.full((8,), 0.25, np.float32)}}}
  t5x.save_t5x_checkpoint(tmp_path, params, 9, dtype='bfloat16', inline_threshold=THRESHOLD,
                          param_states=param_states)
  directory = tmp_path / 'checkpoint_9'
  state = _read_msgpack(directory)['optimizer']['state']
  written = state['param_states']['token_embedder']['embedding']
  assert written['v_row']['kvstore']['path'] == 'state.param_states.token_embedder.embedding.v_row'
  assert written['v_row']['dtype'] == 'float32'  # Only the target is cast.
  np.testing.assert_array_equal(written['v_col'], np.full((8,), 0.25, np.float32))
  assert (directory / 'state.param_states.token_embedder.embedding.v_row' / '.zarray').is_file()
  loaded = t5x.load_t5x_checkpoint(tmp_path, config)
  assert sorted(_flat(loaded)) == sorted(_flat(params))


def test_absolute_ts_spec_rewrites_paths_and_drivers():
  spec = {'driver': 'zarr', 'dtype': 'bfloat16',
          'kvstore': {'driver': 'file', 'path': 'target.decoder.logits_dense.kernel'},
          'metadata': {'shape': np.array([8, 4]), 'chunks': np.array([8, 4]),
                       'compressor': {'id': 'gzip'}}}
  local = t5x.absolute_ts_spec(spec, '/ckpt/checkpoint_5')
  assert local == {'driver': 'zarr', 'dtype': 'bfloat16',
                   'kvstore': {'driver': 'file',
                               'path': '/ckpt/checkpoint_5/target.decoder.logits_dense.kernel'},
                   'metadata': {'shape': [8, 4]}}
  assert spec['kvstore']['path'] == 'target.decoder.logits_dense.kernel'  # Not mutated.
  model = 'pretrained_models/t5x/t5_1_1_xxl/checkpoint_1000000'
  gcs = t5x.absolute_ts_spec(spec, f'gs://t5-data/{model}')
  assert gcs['kvstore'] == {'driver': 'gcs', 'bucket': 't5-data',
                            'path': f'{model}/target.decoder.logits_dense.kernel'}
  # T5X writing to GCS records a dummy bucket and, in older versions, 'path' beside 'kvstore'.
  written_on_gcs = {'driver': 'zarr', 'dtype': 'float32', 'path': 'target.a',
                    'kvstore': {'driver': 'gcs', 'bucket': 't5x-dummy-bucket'},
                    'metadata': {'shape': [2]}}
  assert t5x.absolute_ts_spec(written_on_gcs, 'gs://b/m/checkpoint_1')['kvstore'] == {
      'driver': 'gcs', 'bucket': 'b', 'path': 'm/checkpoint_1/target.a'}
  read_locally = t5x.absolute_ts_spec(written_on_gcs, '/m/checkpoint_1')
  assert read_locally['kvstore'] == {'driver': 'file', 'path': '/m/checkpoint_1/target.a'}
  assert 'path' not in read_locally
  assert t5x._directory_kvstore('gs://bucket') == {'driver': 'gcs', 'bucket': 'bucket', 'path': ''}
  with pytest.raises(ValueError, match='uint16'):
    t5x.absolute_ts_spec(dict(spec, dtype='uint16'), '/x')
  with pytest.raises(ValueError, match='unsupported TensorStore spec'):
    t5x.absolute_ts_spec(dict(spec, kvstore={'driver': 'http', 'path': 'a'}), '/x')
  with pytest.raises(ValueError, match='checkpoint_<step> directory itself'):
    t5x.find_t5x_checkpoint('gs://bucket/model_dir')
