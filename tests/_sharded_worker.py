"""Decodes on simulated device meshes; run by tests/test_partitioning.py in a subprocess.

The parent sets XLA_FLAGS=--xla_force_host_platform_device_count=8 so that this
process (and only this one) sees 8 CPU devices. It decodes a tiny target/draft pair
once on a single device and then on the 1x8, 2x4 and 8x1 ('data', 'model') meshes,
loads a checkpoint into sharded arrays, runs the launcher on a 2x4 mesh, and prints one
JSON object on the last line of stdout: tokens and shardings for the parent to compare.

  python tests/_sharded_worker.py <scratch directory> [<launcher directory>]

The launcher directory holds LAUNCHER_CONFIG's checkpoints and the launcher's
unpartitioned run of them (<dir>/{target,draft,plain}, as tests/conftest.py's
tiny_launcher_run makes them in the test process); without it the worker makes both.
"""

import json
import sys

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec import partitioning
from jaxspec.checkpoints import t5x
from jaxspec.checkpoints.sharded import load_t5x_checkpoint_sharded
from jaxspec.config import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.decoding.drafters.t5 import T5Drafter
from jaxspec.model import T5, init_params
from jaxspec.sampling import SamplingConfig

# heads 8, joined_kv 32, mlp 48 and vocab 64 all divide by 8 model partitions.
TARGET = get_config('test_tiny_1_1').replace(num_heads=8, head_dim=4)
# heads 4, joined_kv 16, mlp 16, vocab 64: divisible by 4 (sharded on 2x4 only).
DRAFT = get_config('test_tiny_1_1').replace(
    emb_dim=16, num_heads=4, head_dim=4, mlp_dim=16, num_encoder_layers=1,
    num_decoder_layers=1)
MAX_DECODE_LENGTH = 12
SPEC = SpeculativeConfig(gamma=3)
GREEDY = SamplingConfig(temperature=0.0)
SPECULATIVE_RUNS = {'speculative_greedy': GREEDY,
                    'speculative_sampled': SamplingConfig(temperature=1.0)}
# Greedy speculative output equals the greedy baseline (tests/test_speculative.py), so
# the single-device run needs only the baseline and the sampled run; the sampled run is
# repeated on the 2x4 mesh only, to keep compilations few. The baseline runs on the 2x4
# mesh only (and on it again from the sharded checkpoints and in the launcher): its
# loop has no code of its own that depends on the mesh, and on 1x8 and 8x1 the target's
# model code (encoder, cache, decoder steps under the target's activation constraints)
# runs inside the greedy speculative decode, which must equal the single-device baseline.
MESHES = {  # name -> (model partitions, draft rules, speculative runs, run the baseline)
    '1x8': (8, partitioning.REPLICATED_LOGICAL_AXIS_RULES, ('speculative_greedy',), False),
    '2x4': (4, partitioning.STANDARD_LOGICAL_AXIS_RULES,
            ('speculative_greedy', 'speculative_sampled'), True),
    '8x1': (1, partitioning.REPLICATED_LOGICAL_AXIS_RULES, ('speculative_greedy',), False),
}
# Parameters whose shardings the parent checks: one per logical axis pattern.
CHECKED_PARAMS = (
    'token_embedder/embedding',  # (vocab, embed)
    'encoder/layers_0/attention/query/kernel',  # (embed, joined_kv)
    'decoder/layers_1/self_attention/out/kernel',  # (joined_kv, embed)
    'decoder/layers_0/mlp/wi_0/kernel',  # (embed, mlp)
    'decoder/layers_0/mlp/wo/kernel',  # (mlp, embed)
    'decoder/logits_dense/kernel',  # (embed, vocab)
    'encoder/relpos_bias/rel_embedding',  # (heads, relpos_buckets)
    'decoder/decoder_norm/scale',  # (embed,)
)


def _inputs():
  """encoder tokens [8, 8] with padding, per-row keys [8, 2]."""
  rng = np.random.default_rng(0)
  tokens = rng.integers(2, TARGET.vocab_size, size=(8, 8)).astype(np.int32)
  for row, length in enumerate([8, 7, 5, 8, 3, 6, 8, 4]):
    tokens[row, length:] = 0
  keys = np.asarray(jax.random.split(jax.random.PRNGKey(1), 8))
  return tokens, keys


def _decode(target_params, draft_params, tokens, keys, runs, baseline=True) -> dict:
  """Tokens [b, L] of the greedy baseline (where `baseline`) and of the speculative
  `runs` (names in SPECULATIVE_RUNS). Each decoder is one compiled program, the costly
  part here."""
  drafter = T5Drafter(DRAFT)
  outputs = {}
  if baseline:
    outputs['baseline_greedy'] = generate(target_params, tokens, keys, config=TARGET,
                                          max_decode_length=MAX_DECODE_LENGTH,
                                          sampling=GREEDY).tokens
  for name in runs:
    sampling = SPECULATIVE_RUNS[name]
    result = speculative_generate(
        target_params, draft_params, tokens, keys, target_config=TARGET, drafter=drafter,
        spec=SPEC, max_decode_length=MAX_DECODE_LENGTH, sampling=sampling)
    outputs[name] = result.output.tokens
  return {name: partitioning.to_host(value).tolist() for name, value in outputs.items()}


def _describe(array) -> dict:
  shard = array.addressable_shards[0]
  return {'spec': str(array.sharding.spec), 'shard_shape': list(shard.data.shape),
          'replicated': bool(array.sharding.is_fully_replicated),
          'devices': len(array.sharding.device_set)}


def _describe_params(variables) -> dict:
  flat = flax.traverse_util.flatten_dict(variables['params'], sep='/')
  return {path: _describe(flat[path]) for path in CHECKED_PARAMS if path in flat}


def _cache_specs(target_params, draft_params, tokens, roles=('target', 'draft')) -> dict:
  """The sharding of layer 0's self-attention key buffer and cross-attention keys
  [b, length, heads, kv], for the target and the draft (a fresh jit per call)."""
  def cache(params, config, role):
    model = T5(config, role=role)
    encoded = model.apply(params, tokens, method=T5.encode)
    return model.apply(params, encoded, tokens, MAX_DECODE_LENGTH, method=T5.init_cache)

  specs = {}
  for role, params, config in (('target', target_params, TARGET),
                               ('draft', draft_params, DRAFT)):
    if role not in roles:
      continue
    layer = jax.jit(lambda p, c=config, r=role: cache(p, c, r))(params).layers[0]
    specs[role] = {'self_keys': str(layer.self_keys.sharding.spec),
                   'cross_keys': str(layer.cross_keys.sharding.spec)}
  return specs


def _mesh_case(partitioner, target_variables, draft_variables, tokens, keys, runs,
               baseline) -> dict:
  target_params = partitioner.place_params(target_variables, TARGET)
  draft_params = partitioner.place_params(draft_variables, DRAFT, draft=True)
  sharded_tokens = partitioner.shard_batch(tokens)
  sharded_keys = partitioner.shard_batch(keys)
  # Without constraints only the target's layout is checked (propagation alone).
  unconstrained = _cache_specs(target_params, draft_params, sharded_tokens, ('target',))
  with partitioner.activation_sharding():
    constrained = _cache_specs(target_params, draft_params, sharded_tokens)
    decoded = _decode(target_params, draft_params, sharded_tokens, sharded_keys, runs,
                      baseline)
  return {'mesh': dict(partitioner.mesh.shape),
          'tokens': decoded,
          'cache': {'constrained': constrained, 'unconstrained': unconstrained},
          'target_params': _describe_params(target_params),
          'draft_params': _describe_params(draft_params),
          'encoder_tokens': _describe(sharded_tokens)}


def _checkpoint_case(scratch, partitioner, target_variables, tokens, keys) -> dict:
  """Writes the target in both formats, loads each sharded, decodes with it."""
  params = jax.device_get(target_variables['params'])
  expected = partitioner.param_shardings(TARGET)
  flat_expected = dict(jax.tree_util.tree_flatten_with_path(expected)[0])
  written = {
      'legacy': t5x.save_t5x_checkpoint(f'{scratch}/legacy', params, 7, inline_threshold=256),
      'orbax': t5x.save_orbax_checkpoint(f'{scratch}/orbax', params, 7),
  }
  result = {}
  for name, path in written.items():
    loaded = load_t5x_checkpoint_sharded(path, TARGET, expected)
    flat_loaded = dict(jax.tree_util.tree_flatten_with_path(loaded)[0])
    flat_params = dict(jax.tree_util.tree_flatten_with_path(params)[0])
    baseline = generate({'params': loaded}, partitioner.shard_batch(tokens),
                        partitioner.shard_batch(keys), config=TARGET,
                        max_decode_length=MAX_DECODE_LENGTH, sampling=GREEDY)
    result[name] = {
        'values_equal': all(np.array_equal(partitioning.to_host(flat_loaded[p]), flat_params[p])
                            for p in flat_params),
        'shardings_equal': all(
            flat_loaded[p].sharding.is_equivalent_to(flat_expected[p], flat_loaded[p].ndim)
            for p in flat_params),
        'params': _describe_params({'params': loaded}),
        'baseline_greedy': partitioning.to_host(baseline.tokens).tolist(),
    }
  bf16 = load_t5x_checkpoint_sharded(written['legacy'], TARGET, expected, dtype='bfloat16')
  result['legacy_bfloat16_dtypes'] = sorted({str(x.dtype) for x in jax.tree.leaves(bf16)})
  return result


# The task's input length (64) and what tests/test_scripts.py's in-process runs decode
# (tiny pair, batches of 2, 8 tokens, gamma 2): the same programs, compiled once.
LAUNCHER_CONFIG = """
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
include 'gin/models/tiny_pair.gin'
infer.target_model = @tiny_target/jaxspec.T5Config()
infer.drafter = @jaxspec.T5Drafter()
jaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()
infer.draft_name = 'tiny'
infer.max_decode_length = 8
infer.num_examples = 4
infer.batch_size = 2
GAMMA = 2
"""


def _launcher_modules():
  """gin, scripts/gin_flags.py and scripts/infer.py."""
  import gin  # pylint: disable=g-import-not-at-top
  from jaxspec.launch import gin_flags
  from jaxspec.launch import infer as infer_script
  return gin, gin_flags, infer_script


def write_launcher_checkpoints(scratch: str) -> None:
  """Random target and draft checkpoints of LAUNCHER_CONFIG under scratch/{target,draft}."""
  gin, gin_flags, _ = _launcher_modules()
  for name, seed in (('target', 0), ('draft', 1)):
    gin.clear_config()
    gin_flags.parse([f'--gin_bindings={LAUNCHER_CONFIG}'])
    parameter = 'infer.target_model' if name == 'target' else 'jaxspec.T5Drafter.config'
    config = gin.query_parameter(parameter).scoped_configurable_fn()
    t5x.save_t5x_checkpoint(f'{scratch}/{name}', init_params(config, jax.random.PRNGKey(seed)), 1)
  gin.clear_config()


def run_launcher(scratch: str, output_dir: str, extra_bindings=()) -> dict:
  """scripts/infer.py on LAUNCHER_CONFIG and the checkpoints under scratch; returns the
  summary ({} on processes other than 0)."""
  gin, gin_flags, infer_script = _launcher_modules()
  gin.clear_config()
  lines = list(extra_bindings) + [f"infer.target_checkpoint = '{scratch}/target'",
                                  f"infer.draft_checkpoint = '{scratch}/draft'",
                                  f"infer.output_dir = '{output_dir}'"]
  gin_flags.parse([f'--gin_bindings={LAUNCHER_CONFIG}'] +
                  [f'--gin_bindings={line}' for line in lines])
  try:
    return infer_script.infer()
  finally:
    gin.clear_config()


def written_tokens(output_dir: str) -> dict:
  """{decoder: tokens of each record in index order} from output_dir/*.jsonl."""
  result = {}
  for decoder in ('baseline', 'speculative'):
    with open(f'{output_dir}/{decoder}.jsonl') as f:
      records = sorted((json.loads(line) for line in f), key=lambda r: r['index'])
    result[decoder] = [r['tokens'] for r in records]
  return result


def written_run(output_dir: str) -> dict:
  """The mesh, identical outputs and tokens a launcher run wrote to output_dir."""
  with open(f'{output_dir}/summary.json') as f:
    summary = json.load(f)
  return {'mesh': summary.get('mesh'), 'identical_outputs': summary['identical_outputs'],
          **written_tokens(output_dir)}


def make_launcher_run(directory: str) -> None:
  """LAUNCHER_CONFIG's checkpoints under directory/{target,draft} and the launcher's
  unpartitioned run of them in directory/plain."""
  write_launcher_checkpoints(directory)
  run_launcher(directory, f'{directory}/plain')


def _launcher_case(scratch: str, launcher_dir: str | None) -> dict:
  """scripts/infer.py on a 2 x 4 mesh (gin/partitioning fragment), and the unpartitioned
  run of the same checkpoints (made here when launcher_dir is None)."""
  if launcher_dir is None:
    launcher_dir = scratch
    make_launcher_run(launcher_dir)
  run_launcher(launcher_dir, f'{scratch}/out_sharded',
               ["include 'gin/partitioning/model_parallel_8.gin'",
                'jaxspec.PartitioningConfig.num_partitions = 4'])
  return {'plain': written_run(f'{launcher_dir}/plain'),
          'sharded': written_run(f'{scratch}/out_sharded')}


def main(scratch: str, launcher_dir: str | None = None) -> None:
  assert jax.device_count() == 8, jax.devices()
  target_variables = init_params(TARGET, jax.random.PRNGKey(0))
  draft_variables = init_params(DRAFT, jax.random.PRNGKey(1))
  target_variables = {'params': target_variables['params']}
  draft_variables = {'params': draft_variables['params']}
  tokens, keys = _inputs()
  report = {'single_device': _decode(target_variables, draft_variables, jnp.asarray(tokens),
                                     jnp.asarray(keys), ('speculative_sampled',))}
  partitioners = {}
  for name, (num_partitions, draft_rules, runs, baseline) in MESHES.items():
    partitioners[name] = partitioning.Partitioner(
        partitioning.make_mesh(num_partitions), draft_rules=draft_rules)
    report[name] = _mesh_case(partitioners[name], target_variables, draft_variables,
                              tokens, keys, runs, baseline)
  report['checkpoint_2x4'] = _checkpoint_case(scratch, partitioners['2x4'],
                                               target_variables, tokens, keys)
  report['launcher_2x4'] = _launcher_case(scratch, launcher_dir)
  print(json.dumps(report))


if __name__ == '__main__':
  main(*sys.argv[1:])
