"""The launchers end to end on tiny models: training resumes exactly, inference
resumes without redoing or losing records."""

import json
import os
import sys

import gin
import jax
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, 'scripts'))

import gin_flags  # noqa: E402
import infer as infer_script  # noqa: E402
import train as train_script  # noqa: E402
from jaxspec.checkpoints.t5x import load_t5x_checkpoint, save_t5x_checkpoint  # noqa: E402
from jaxspec.model import init_params  # noqa: E402

TINY_MODEL = """
MODEL = @tiny/jaxspec.T5Config()
tiny/jaxspec.T5Config:
  vocab_size = 8000
  emb_dim = 16
  num_heads = 2
  head_dim = 8
  num_encoder_layers = 1
  num_decoder_layers = 1
  mlp_dim = 32
"""


@pytest.fixture(autouse=True)
def _unlocked_gin():
  """Parsing locks gin's config; unlock it again so later tests can register."""
  yield
  gin.clear_config()


def _parse(tmp_path, text, bindings=()):
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(text)
  gin_flags.parse([f'--gin_file={path}'] + [f'--gin.{b}' for b in bindings])


def _train_config(checkpoint_dir):
  return TINY_MODEL + f"""
include 'gin/train_defaults.gin'
train.corpus = 'ende'
train.input_length = 16
train.target_length = 16
train.batch_size = 8
train.checkpoint_dir = '{checkpoint_dir}'
train.checkpoint_every = 2
train.eval_every = 1000
train.eval_examples = 16
train.max_train_examples = 400
train.log_every = 1000
"""


def test_training_resumes_to_the_same_parameters(tmp_path):
  straight, interrupted = tmp_path / 'straight', tmp_path / 'interrupted'
  _parse(tmp_path, _train_config(straight), ['train.num_steps=4'])
  train_script.train()
  _parse(tmp_path, _train_config(interrupted), ['train.num_steps=2'])
  train_script.train()
  _parse(tmp_path, _train_config(interrupted), ['train.num_steps=4'])
  train_script.train()
  expected = load_t5x_checkpoint(str(straight / 'checkpoint_4'))
  actual = load_t5x_checkpoint(str(interrupted / 'checkpoint_4'))
  jax.tree_util.tree_map(np.testing.assert_array_equal, actual, expected)
  assert (interrupted / 'optimizer_4.msgpack').exists()
  assert (interrupted / 'config.gin').exists()


def _infer_config(tmp_path):
  config = TINY_MODEL.replace('MODEL = @tiny', 'TARGET = @tiny')
  config += """
draft/jaxspec.T5Config:
  vocab_size = 8000
  emb_dim = 8
  num_heads = 1
  head_dim = 8
  num_encoder_layers = 1
  num_decoder_layers = 1
  mlp_dim = 16
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
infer.target_model = @tiny/jaxspec.T5Config()
infer.drafter = @jaxspec.T5Drafter()
jaxspec.T5Drafter.config = @draft/jaxspec.T5Config()
infer.draft_name = 'tiny'
infer.max_decode_length = 8
infer.num_examples = 5
infer.batch_size = 2
GAMMA = 2
"""
  return config + (f"infer.target_checkpoint = '{tmp_path}/target'\n"
                   f"infer.draft_checkpoint = '{tmp_path}/draft'\n"
                   f"infer.output_dir = '{tmp_path}/out'\n")


@pytest.fixture
def tiny_checkpoints(tmp_path):
  _parse(tmp_path, _infer_config(tmp_path))
  target = gin.query_parameter('infer.target_model').scoped_configurable_fn()
  draft = gin.query_parameter('jaxspec.T5Drafter.config').scoped_configurable_fn()
  save_t5x_checkpoint(tmp_path / 'target', init_params(target, jax.random.PRNGKey(0)), 1)
  save_t5x_checkpoint(tmp_path / 'draft', init_params(draft, jax.random.PRNGKey(1)), 1)
  return tmp_path


def _records(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_infer_writes_records_and_summary(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  summary = infer_script.infer()
  for name in ('baseline', 'speculative'):
    records = _records(tmp_path / 'out' / f'{name}.jsonl')
    assert sorted(r['index'] for r in records) == list(range(5))
    assert all(r['targets'] and 'prediction' in r for r in records)
  assert summary['examples'] == 5 and summary['identical_outputs'] == 5
  assert summary['baseline_bleu'] == summary['speculative_bleu']
  assert 0.0 <= summary['alpha'] <= 1.0 and summary['tokens_per_target_call'] >= 1.0
  assert json.loads((tmp_path / 'out' / 'summary.json').read_text())['examples'] == 5


def test_infer_resumes_without_redoing_or_losing_records(tiny_checkpoints):
  tmp_path = tiny_checkpoints
  _parse(tmp_path, _infer_config(tmp_path))
  infer_script.infer()
  path = tmp_path / 'out' / 'speculative.jsonl'
  complete = _records(path)
  # Simulate a kill: the last batch's records are gone and a line is torn mid-write.
  kept = [r for r in complete if r['batch_start'] != 4]
  path.write_text(''.join(json.dumps(r) + '\n' for r in kept) + '{"index": 4, "inpu')
  _parse(tmp_path, _infer_config(tmp_path))
  infer_script.infer()
  resumed = _records(path)
  assert sorted(r['index'] for r in resumed) == list(range(5))
  by_index = {r['index']: r for r in resumed}
  for record in kept:  # Finished records are kept as they were, not decoded again.
    assert by_index[record['index']] == record
  assert by_index[4]['tokens'] == {r['index']: r for r in complete}[4]['tokens']
