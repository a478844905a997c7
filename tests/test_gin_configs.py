"""The gin files: every one parses with the launchers' flags; the public model
fragments build jaxspec's named configs; each Table 2 config selects the paper's
models (parameter counts from the architecture formula), task, temperature and gamma.
Nothing here reads gs:// or downloads anything: models are built abstractly."""

import functools
import importlib
import pathlib

import gin
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]

# The launchers register the gin configurables the files bind (infer, train, ...).
LAUNCHERS = sorted(p.stem for p in (REPO / 'jaxspec' / 'launch').glob('*.py')
                   if '@gin.configurable' in p.read_text())
for _launcher in LAUNCHERS:
  importlib.import_module(f'jaxspec.launch.{_launcher}')

from jaxspec.launch import gin_flags
from jaxspec.config import get_config  # noqa: E402
from jaxspec.model import abstract_params  # noqa: E402

PUBLIC_CHECKPOINTS = 'gs://t5-data/pretrained_models/t5x'

# Shapes of the public T5X models, transcribed from T5X's gin files
# (t5x/examples/t5/t5_1_1/*.gin and t5_1_0/*.gin), not from jaxspec.config:
# name -> (emb_dim, num_heads, head_dim, layers per stack, mlp_dim, T5.1.1).
T5X_SHAPES = {
    't5_1_1_small': (512, 6, 64, 8, 1024, True),
    't5_1_1_base': (768, 12, 64, 12, 2048, True),
    't5_1_1_large': (1024, 16, 64, 24, 2816, True),
    't5_1_1_xl': (2048, 32, 64, 24, 5120, True),
    't5_1_1_xxl': (4096, 64, 64, 24, 10240, True),
    't5_small': (512, 8, 64, 6, 2048, False),
    't5_base': (768, 12, 64, 12, 3072, False),
    't5_large': (1024, 16, 64, 24, 4096, False),
    't5_3B': (1024, 32, 128, 24, 16384, False),
    't5_11B': (1024, 128, 128, 24, 65536, False),
}

# Paper Table 2 (Leviathan et al. 2023), transcribed:
# (task, draft, temperature) -> gamma. The target is always T5-XXL.
TABLE2 = {
    ('ende', 'small', 0): 7, ('ende', 'base', 0): 7, ('ende', 'large', 0): 7,
    ('ende', 'small', 1): 7, ('ende', 'base', 1): 5, ('ende', 'large', 1): 3,
    ('cnndm', 'small', 0): 5, ('cnndm', 'base', 0): 5, ('cnndm', 'large', 0): 3,
    ('cnndm', 'small', 1): 5, ('cnndm', 'base', 1): 3, ('cnndm', 'large', 1): 3,
}
SEQIO_TASKS = {'ende': 'wmt_t2t_ende_v003', 'cnndm': 'cnn_dailymail_v002'}
# Sizes as the paper and T5X's docs quote them.
QUOTED_PARAMS = {'t5_1_1_xxl': 11.1e9, 't5_1_1_small': 77e6, 't5_1_1_base': 248e6,
                 't5_1_1_large': 783e6}


@pytest.fixture(autouse=True)
def _unlocked_gin():
  """Parsing locks gin's config; unlock it again so later tests can register."""
  gin.clear_config()
  yield
  gin.clear_config()


def _parse(*gin_files, bindings=()):
  gin_flags.parse([f'--gin_file={f}' for f in gin_files]
                  + [f'--gin.{b}' for b in bindings])


def _gin_files(*roots):
  return sorted(str(p.relative_to(REPO)) for root in roots for p in (REPO / root).rglob('*.gin'))


def _build(parameter):
  """The object a configurable parameter bound to @scope/name() evaluates to."""
  return gin.query_parameter(parameter).scoped_configurable_fn()


def expected_param_count(emb, heads, head_dim, layers, mlp, gated, vocab=32128, buckets=32):
  """Parameters of a T5X T5 from its shapes: embedding, encoder, decoder, logits."""
  attention = 4 * emb * heads * head_dim  # query, key, value, out
  mlp_params = (3 if gated else 2) * emb * mlp  # wi_0, wi_1, wo or wi, wo
  encoder = layers * (attention + mlp_params + 2 * emb) + heads * buckets + emb
  decoder = layers * (2 * attention + mlp_params + 3 * emb) + heads * buckets + emb
  logits = 0 if not gated else emb * vocab  # T5.1.1 untied logits_dense
  return vocab * emb + encoder + decoder + logits


@functools.lru_cache(maxsize=None)
def _abstract_param_count(config) -> int:
  shapes = abstract_params(config)['params']
  import jax  # pylint: disable=g-import-not-at-top
  return sum(leaf.size for leaf in jax.tree_util.tree_leaves(shapes))


def _table2_files():
  return _gin_files('configs/table2')


# Fragments that use a macro another fragment defines, parsed after that one.
PREREQUISITES = {'gin/train_defaults.gin': ['gin/models/local_target.gin']}  # MODEL


@pytest.mark.parametrize('path', _gin_files('configs', 'gin'))
def test_every_gin_file_parses(path):
  _parse(*PREREQUISITES.get(path, []), path)


def test_there_is_one_table2_config_per_paper_row():
  names = {pathlib.Path(p).stem for p in _table2_files()}
  assert names == {f'{task}_{draft}_t{temp}' for task, draft, temp in TABLE2}


@pytest.mark.parametrize('name', sorted(T5X_SHAPES))
def test_model_fragment_builds_the_named_config(name):
  configurable = gin.get_configurable('jaxspec.T5Config')
  _parse(f'gin/models/{name}.gin')
  with gin.config_scope(name):
    assert configurable() == get_config(name, dtype='bfloat16')
  gin.clear_config()
  _parse(f'gin/models/{name}.gin', bindings=["ACTIVATION_DTYPE='float32'"])
  with gin.config_scope(name):
    assert configurable() == get_config(name, dtype='float32')


@pytest.mark.parametrize('name', sorted(T5X_SHAPES))
def test_named_config_has_t5x_shapes(name):
  emb, heads, head_dim, layers, mlp, gated = T5X_SHAPES[name]
  config = get_config(name)
  assert (config.emb_dim, config.num_heads, config.head_dim, config.num_encoder_layers,
          config.num_decoder_layers, config.mlp_dim, config.vocab_size) == (
              emb, heads, head_dim, layers, layers, mlp, 32128)
  assert config.mlp_activations == (('gelu', 'linear') if gated else ('relu',))
  assert config.logits_via_embedding == (not gated)


@pytest.mark.parametrize('path', _table2_files())
def test_table2_config_matches_the_paper_row(path):
  task, draft, temp = pathlib.Path(path).stem.split('_')
  _parse(path)
  target_config, draft_config = _build('infer.target_model'), _build('jaxspec.T5Drafter.config')
  target_name, draft_name = 't5_1_1_xxl', f't5_1_1_{draft}'
  assert target_config == get_config(target_name, dtype='bfloat16', param_dtype='bfloat16')
  assert draft_config == get_config(draft_name, dtype='bfloat16', param_dtype='bfloat16')
  for name, config in ((target_name, target_config), (draft_name, draft_config)):
    count = expected_param_count(*T5X_SHAPES[name])
    assert _abstract_param_count(config) == count
    assert count == pytest.approx(QUOTED_PARAMS[name], rel=0.01)
  sampling, spec = _build('infer.sampling'), _build('infer.speculative')
  assert sampling.temperature == float(temp[1:])
  assert spec.gamma == TABLE2[(task, draft, int(temp[1:]))]
  assert spec.lenience == 1.0  # Table 2 is exact speculative decoding.
  assert gin.query_parameter('infer.seqio_task') == SEQIO_TASKS[task]
  assert gin.query_parameter('infer.split') == 'test'
  assert gin.query_parameter('infer.batch_size') == 1
  assert gin.query_parameter('infer.target_checkpoint') == (
      f'{PUBLIC_CHECKPOINTS}/t5_1_1_xxl/checkpoint_1000000')
  assert gin.query_parameter('infer.draft_checkpoint') == (
      f'{PUBLIC_CHECKPOINTS}/{draft_name}/checkpoint_1000000')
  assert gin.query_parameter('infer.output_dir') == f'results/table2/{pathlib.Path(path).stem}'
  assert draft in gin.query_parameter('infer.draft_name')


@pytest.mark.parametrize('path', ['gin/tasks/wmt_t2t_ende.gin', 'gin/tasks/cnn_dailymail.gin'])
def test_paper_task_lengths(path):
  _parse(path)
  expected = {'gin/tasks/wmt_t2t_ende.gin': (64, 64),  # T5X's base_wmt_infer.gin
              'gin/tasks/cnn_dailymail.gin': (512, 512)}[path]
  assert (gin.query_parameter('infer.input_length'),
          gin.query_parameter('infer.max_decode_length')) == expected


def test_expected_param_count_formula_on_a_tiny_config():
  """The formula itself, against jaxspec's model for the two variants."""
  for gated in (True, False):
    config = get_config('test_tiny_1_1' if gated else 'test_tiny_1_0').replace(
        num_decoder_layers=2)
    count = expected_param_count(config.emb_dim, config.num_heads, config.head_dim, 2,
                                 config.mlp_dim, gated, vocab=config.vocab_size)
    assert _abstract_param_count(config) == count


def test_no_gin_file_reads_outside_the_repository_except_public_checkpoints():
  for path in _gin_files('configs', 'gin'):
    for line in (REPO / path).read_text().splitlines():
      if 'gs://' in line and not line.lstrip().startswith('#'):
        assert f"'{PUBLIC_CHECKPOINTS}/" in line, (path, line)
