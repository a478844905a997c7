"""scripts/bench_peers.py end to end on tiny random models: every decoder runs, the
results have their structure, all greedy outputs are token-identical, and a
difference is diagnosed with both frameworks' logits."""

import json
import os

import jax
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import bench_peers
from jaxspec.checkpoints.t5x import save_t5x_checkpoint  # noqa: E402
from jaxspec.model import init_params  # noqa: E402

MODELS = {  # name -> (gin scope, emb_dim, layers); the local models' variant.
    'target': ('tiny_target', 32, 2),
    'draft': ('tiny_draft', 16, 1),
}
NUM_EXAMPLES = 3
DECODERS = ('hf_greedy', 'jaxspec_baseline', 'hf_assisted[draft]', 'hf_assisted_gamma[draft]',
            'jaxspec_speculative[draft]')


def model_gin(scope: str, emb_dim: int, layers: int) -> str:
  return f"""
MODEL = @{scope}/jaxspec.T5Config()
{scope}/jaxspec.T5Config:
  vocab_size = 8000
  emb_dim = {emb_dim}
  num_heads = 2
  head_dim = 8
  num_encoder_layers = {layers}
  num_decoder_layers = {layers}
  mlp_dim = {2 * emb_dim}
  mlp_activations = ('gelu', 'linear')
  logits_via_embedding = True
"""


@pytest.fixture(scope='module')
def model_specs(tmp_path_factory) -> dict[str, str]:
  """name -> 'GIN_FILE:CHECKPOINT' of tiny random models, as bench_peers takes them."""
  tmp_path = tmp_path_factory.mktemp('models')
  specs = {}
  for seed, (name, (scope, emb_dim, layers)) in enumerate(MODELS.items()):
    gin_file = tmp_path / f'{name}.gin'
    gin_file.write_text(model_gin(scope, emb_dim, layers))
    config = bench_peers.model_config_from_gin(str(gin_file))
    save_t5x_checkpoint(tmp_path / name, init_params(config, jax.random.PRNGKey(seed)), 1)
    specs[name] = f'{gin_file}:{tmp_path / name}'
  return specs


@pytest.fixture(scope='module')
def results(model_specs, tmp_path_factory):
  output_dir = tmp_path_factory.mktemp('peers')
  returned = bench_peers.main([
      f'--target={model_specs["target"]}', f'--draft=draft={model_specs["draft"]}',
      f'--num_examples={NUM_EXAMPLES}', '--repeats=1', '--gamma=2', '--max_new_tokens=10',
      '--input_length=24', f'--output_dir={output_dir}'])
  written = json.loads((output_dir / 'peers.json').read_text())
  return returned, written, (output_dir / 'peers.md').read_text()


def test_json_holds_what_main_returned(results):
  returned, written, _ = results
  assert json.loads(json.dumps(returned)) == written


def test_every_decoder_is_reported(results):
  _, written, markdown = results
  rows = {row['decoder']: row for row in written['decoders']}
  assert sorted(rows) == sorted(DECODERS)
  for name, row in rows.items():
    assert row['tokens'] == sum(len(t) for t in written['outputs'][name])
    assert 0 < row['tokens'] <= NUM_EXAMPLES * 10
    assert row['tokens_per_second'] > 0 and row['compile_seconds'] >= 0
    assert len(row['seconds_per_repeat']) == 1
    assert f'| {name} |' in markdown
  assert rows['jaxspec_speculative[draft]']['tokens_per_target_call'] >= 1.0
  assert sorted(written['ratios']) == [
      'jaxspec_baseline / hf_greedy',
      'jaxspec_speculative[draft] / hf_assisted[draft]',
      'jaxspec_speculative[draft] / hf_assisted_gamma[draft]']


def test_assistant_settings(results):
  settings = results[1]['assistant_settings']
  fixed = settings['hf_assisted_gamma[draft]']
  assert fixed['num_assistant_tokens'] == 2
  assert fixed['num_assistant_tokens_schedule'] == 'constant'
  assert fixed['assistant_confidence_threshold'] == 0.0
  assert settings['hf_assisted[draft]']['num_assistant_tokens'] >= 1


def test_greedy_outputs_are_token_identical(results):
  _, written, _ = results
  outputs = written['outputs']
  assert all(len(tokens) == NUM_EXAMPLES for tokens in outputs.values())
  for name in DECODERS:
    assert outputs[name] == outputs['hf_greedy'], name
  assert all(rows == [] for rows in written['differences'].values())
  for row in written['decoders']:
    assert row['identical_to_hf_greedy'] == NUM_EXAMPLES
  assert written['machine']['cores'] >= 1 and written['machine']['transformers']


def test_diagnose_reports_both_frameworks_logits_at_the_first_difference(model_specs, results,
                                                                         tmp_path):
  """A made-up difference at position 2: both frameworks' argmax is hf_greedy's token."""
  target = bench_peers.load_jaxspec_model(model_specs['target'])
  hf_target = bench_peers.load_transformers(
      bench_peers.save_hf_checkpoint(target[1], target[0], tmp_path))
  args = bench_peers.parse_args(['--num_examples=1', '--input_length=24',
                                 '--max_new_tokens=10'])
  row = bench_peers.encoded_examples(args)[0]
  reference = results[1]['outputs']['hf_greedy'][0]
  tokens = reference[:2] + [(reference[2] + 1) % 8000] + reference[3:]
  report = bench_peers.diagnose(0, row, tokens, reference, target, hf_target)
  assert report['position'] == 2 and report['hf_greedy_token'] == reference[2]
  assert report['jaxspec_argmax'] == report['transformers_argmax'] == reference[2]
  assert report['jaxspec_logit_gap'] > 0 and report['transformers_logit_gap'] > 0
  assert report['max_abs_logit_difference'] < 1e-3
