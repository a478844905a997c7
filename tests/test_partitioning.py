"""Partitioning: T5X's logical axis rules, meshes, sharded checkpoint loading, and
decoding on simulated 8-device meshes token for token equal to one device.

The multi-device checks run tests/_sharded_worker.py once, in a subprocess whose
XLA_FLAGS give it 8 CPU devices, so this process (and every other test) keeps one.
"""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from jaxspec import partitioning
from jaxspec.checkpoints import t5x
from jaxspec.checkpoints.sharded import load_t5x_checkpoint_sharded
from jaxspec.config import get_config
from jaxspec.model import init_params

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, 'tests', '_sharded_worker.py')
# The worker compiles ten decoding programs; LLVM's optimizations would triple the
# compile time and do not matter for tiny models (both sides of each comparison use them).
WORKER_XLA_FLAGS = ('--xla_force_host_platform_device_count=8 '
                    '--xla_backend_optimization_level=0 '
                    '--xla_llvm_disable_expensive_passes=true')
RULES = partitioning.STANDARD_LOGICAL_AXIS_RULES
P = jax.sharding.PartitionSpec


def _abstract_mesh(data, model):
  return jax.sharding.AbstractMesh((data, model), partitioning.MESH_AXES)


# T5X's logical axis rules, on meshes this process does not need devices for.


@pytest.mark.parametrize('logical_axes, shape, expected', [
    (('vocab', 'embed'), (64, 32), P('model', None)),  # token_embedder/embedding
    (('embed', 'vocab'), (32, 64), P(None, 'model')),  # logits_dense
    (('embed', 'joined_kv'), (32, 32), P(None, 'model')),  # query/key/value
    (('joined_kv', 'embed'), (32, 32), P('model', None)),  # out
    (('embed', 'mlp'), (32, 48), P(None, 'model')),  # wi_0, wi_1, wi
    (('mlp', 'embed'), (48, 32), P('model', None)),  # wo
    (('heads', 'relpos_buckets'), (8, 32), P('model', None)),  # rel_embedding
    (('embed',), (32,), P(None)),  # layer norm scales
    (('batch', 'length', 'heads', 'kv'), (4, 16, 8, 4), P('data', None, 'model', None)),
])
def test_standard_rules_match_t5x(logical_axes, shape, expected):
  assert partitioning.mesh_axes(logical_axes, shape, _abstract_mesh(2, 4), RULES) == expected


def test_dimensions_the_mesh_does_not_divide_stay_replicated():
  mesh = _abstract_mesh(2, 8)
  assert partitioning.mesh_axes(('heads', 'relpos_buckets'), (4, 32), mesh, RULES) == P(
      None, None)
  assert partitioning.mesh_axes(('batch', None), (1, 16), mesh, RULES) == P(None, None)
  assert partitioning.mesh_axes(('batch', None), (6, 16), mesh, RULES) == P('data', None)


def test_replicated_rules_replicate_every_parameter_but_split_the_batch():
  mesh = _abstract_mesh(2, 4)
  rules = partitioning.REPLICATED_LOGICAL_AXIS_RULES
  for axes in (('vocab', 'embed'), ('embed', 'mlp'), ('joined_kv', 'embed'),
               ('heads', 'relpos_buckets')):
    assert partitioning.mesh_axes(axes, (64, 64), mesh, rules) == P(None, None)
  assert partitioning.mesh_axes(('batch', 'length'), (4, 8), mesh, rules) == P('data', None)


def test_config_accepts_gin_lists_and_stays_hashable():
  config = partitioning.PartitioningConfig(
      num_partitions=2, logical_axis_rules=[['batch', 'data'], ['vocab', 'model']])
  assert config.logical_axis_rules == (('batch', 'data'), ('vocab', 'model'))
  hash(config)
  with pytest.raises(ValueError, match='num_partitions'):
    partitioning.PartitioningConfig(num_partitions=0)


def test_make_mesh_shape_and_errors():
  mesh = partitioning.make_mesh(1)
  assert dict(mesh.shape) == {'data': jax.device_count(), 'model': 1}
  with pytest.raises(ValueError, match='does not divide'):
    partitioning.make_mesh(jax.device_count() + 1)


def test_create_partitioner_without_distributed_init():
  partitioner = partitioning.create_partitioner(partitioning.PartitioningConfig())
  assert partitioner.rules == RULES
  assert partitioner.draft_rules == partitioning.REPLICATED_LOGICAL_AXIS_RULES
  assert partitioner.is_output_process


# Sharded checkpoint loading on this process's single device.


@pytest.fixture(scope='module')
def tiny_params():
  config = get_config('test_tiny_1_1')
  return config, jax.device_get(init_params(config, jax.random.PRNGKey(0))['params'])


@pytest.mark.parametrize('save', ['legacy', 'orbax'])
def test_sharded_load_equals_plain_load(tmp_path, tiny_params, save):
  config, params = tiny_params
  if save == 'legacy':
    path = t5x.save_t5x_checkpoint(tmp_path, params, 3, inline_threshold=256)
  else:
    path = t5x.save_orbax_checkpoint(tmp_path, params, 3)
  partitioner = partitioning.Partitioner(partitioning.make_mesh(1, num_devices=1))
  loaded = partitioner.load_params(path, config)['params']
  plain = t5x.load_t5x_checkpoint(path, config)
  leaves = jax.tree_util.tree_leaves_with_path(plain)
  assert len(leaves) == len(jax.tree_util.tree_leaves(loaded))
  for key_path, expected in leaves:
    actual = loaded
    for key in key_path:
      actual = actual[key.key]
    assert isinstance(actual.sharding, jax.sharding.NamedSharding), key_path
    np.testing.assert_array_equal(np.asarray(actual), expected, err_msg=str(key_path))


def test_sharded_load_refuses_shardings_of_another_tree(tmp_path, tiny_params):
  config, params = tiny_params
  path = t5x.save_t5x_checkpoint(tmp_path, params, 3)
  mesh = partitioning.make_mesh(1, num_devices=1)
  shardings = partitioning.param_shardings(config, mesh, RULES)
  del shardings['decoder']['logits_dense']
  with pytest.raises(ValueError, match='logits_dense'):
    load_t5x_checkpoint_sharded(path, None, shardings)


# Decoding on 8 simulated devices (one subprocess for every mesh).


@pytest.fixture(scope='module')
def sharded_report(tmp_path_factory, tiny_launcher_run):
  env = dict(os.environ, JAX_PLATFORMS='cpu',
             XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {WORKER_XLA_FLAGS}".strip())
  scratch = tmp_path_factory.mktemp('sharded')
  # The launcher's unpartitioned run is made in this process (conftest.py), once for
  # this test and tests/test_multihost.py.
  run = subprocess.run([sys.executable, WORKER, str(scratch), str(tiny_launcher_run)],
                       env=env, cwd=REPO, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-5000:]
  return json.loads(run.stdout.strip().splitlines()[-1])


# The baseline on the 2x4 mesh only (tests/_sharded_worker.py's MESHES says why).
MESH_RUNS = [('1x8', 'speculative_greedy'),
             ('2x4', 'baseline_greedy'), ('2x4', 'speculative_greedy'),
             ('2x4', 'speculative_sampled'),
             ('8x1', 'speculative_greedy')]


@pytest.mark.parametrize('mesh, run', MESH_RUNS)
def test_sharded_decoding_equals_single_device(sharded_report, mesh, run):
  single = sharded_report['single_device']
  # Greedy speculative output is the greedy baseline's (tests/test_speculative.py).
  reference = single['baseline_greedy' if run == 'speculative_greedy' else run]
  assert sharded_report[mesh]['mesh'] == dict(zip(('data', 'model'), map(int, mesh.split('x'))))
  np.testing.assert_array_equal(np.array(sharded_report[mesh]['tokens'][run]),
                                np.array(reference))


# (spec, local shard shape) per checked parameter of the worker's target [model dim 8 or 4].
TARGET_SHARDS = {
    '1x8': {'token_embedder/embedding': ("P('model', None)", [8, 32]),
            'encoder/layers_0/attention/query/kernel': ("P(None, 'model')", [32, 4]),
            'decoder/layers_1/self_attention/out/kernel': ("P('model', None)", [4, 32]),
            'decoder/layers_0/mlp/wi_0/kernel': ("P(None, 'model')", [32, 6]),
            'decoder/layers_0/mlp/wo/kernel': ("P('model', None)", [6, 32]),
            'decoder/logits_dense/kernel': ("P(None, 'model')", [32, 8]),
            'encoder/relpos_bias/rel_embedding': ("P('model', None)", [1, 32]),
            'decoder/decoder_norm/scale': ('P(None,)', [32])},
    '2x4': {'token_embedder/embedding': ("P('model', None)", [16, 32]),
            'encoder/layers_0/attention/query/kernel': ("P(None, 'model')", [32, 8]),
            'decoder/layers_0/mlp/wi_0/kernel': ("P(None, 'model')", [32, 12]),
            'decoder/logits_dense/kernel': ("P(None, 'model')", [32, 16])},
}


@pytest.mark.parametrize('mesh', sorted(TARGET_SHARDS))
def test_target_params_are_sharded_over_model(sharded_report, mesh):
  described = sharded_report[mesh]['target_params']
  for path, (spec, shard_shape) in TARGET_SHARDS[mesh].items():
    assert (described[path]['spec'], described[path]['shard_shape']) == (spec, shard_shape), path
    assert described[path]['devices'] == 8
    assert described[path]['replicated'] == (spec == 'P(None,)'), path


def test_draft_params_follow_their_own_rules(sharded_report):
  for mesh in ('1x8', '8x1'):  # Replicated draft.
    assert all(d['replicated'] for d in sharded_report[mesh]['draft_params'].values()), mesh
  described = sharded_report['2x4']['draft_params']  # Draft with the standard rules.
  assert described['token_embedder/embedding']['shard_shape'] == [16, 16]
  assert described['decoder/layers_0/mlp/wi_0/kernel']['shard_shape'] == [16, 4]
  assert not described['decoder/logits_dense/kernel']['replicated']


# Cache [b, heads, kv, length] shardings: the target's heads over 'model', rows over
# 'data'; the draft by its own rules (replicated on 1x8 and 8x1, standard on 2x4).
CACHE_SPECS = {
    '1x8': {'target': "P(None, 'model')", 'draft': 'P()'},
    '2x4': {'target': "P('data', 'model')", 'draft': "P('data', 'model')"},
    '8x1': {'target': "P('data',)", 'draft': "P('data',)"},
}


@pytest.mark.parametrize('mesh', sorted(CACHE_SPECS))
def test_activation_sharding_lays_out_the_decoder_cache(sharded_report, mesh):
  cache = sharded_report[mesh]['cache']
  for role, spec in CACHE_SPECS[mesh].items():
    assert cache['constrained'][role] == {'self_keys': spec, 'cross_keys': spec}, role
  # Left to propagation alone, the self-attention buffers stay whole on every device.
  assert cache['unconstrained']['target']['self_keys'] == 'P()'


def test_data_parallel_mesh_splits_the_batch_and_replicates_params(sharded_report):
  report = sharded_report['8x1']
  assert report['encoder_tokens']['shard_shape'] == [1, 8]
  assert all(d['replicated'] for d in report['target_params'].values())
  assert sharded_report['2x4']['encoder_tokens']['shard_shape'] == [4, 8]


@pytest.mark.parametrize('save', ['legacy', 'orbax'])
def test_checkpoint_loads_into_its_shardings(sharded_report, save):
  report = sharded_report['checkpoint_2x4'][save]
  assert report['values_equal']
  assert report['shardings_equal']
  assert report['params']['token_embedder/embedding']['shard_shape'] == [16, 32]
  assert report['params']['decoder/layers_0/mlp/wo/kernel']['shard_shape'] == [12, 32]
  np.testing.assert_array_equal(np.array(report['baseline_greedy']),
                                np.array(sharded_report['single_device']['baseline_greedy']))


def test_checkpoint_loads_sharded_in_another_dtype(sharded_report):
  assert sharded_report['checkpoint_2x4']['legacy_bfloat16_dtypes'] == ['bfloat16']


def test_launcher_on_a_mesh_writes_what_it_writes_on_one_device(sharded_report):
  """scripts/infer.py with gin/partitioning/model_parallel_8.gin (4 partitions: 2 x 4)."""
  report = sharded_report['launcher_2x4']
  assert report['plain']['mesh'] is None
  assert report['sharded']['mesh'] == {'data': 2, 'model': 4}
  for decoder in ('baseline', 'speculative'):
    assert len(report['sharded'][decoder]) == 4
    assert report['sharded'][decoder] == report['plain'][decoder], decoder
  assert report['sharded']['identical_outputs'] == 4
