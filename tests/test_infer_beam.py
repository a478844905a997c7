"""scripts/infer.py's beam decoders end to end on tiny random models: beam search and
speculative beam search write the same beams and scores as a direct generate_beam
call, the beam settings key the output directory, and bad beam settings are refused
before any model is loaded."""

import json
import os
import shutil

import gin
import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from jaxspec.launch import gin_flags
from jaxspec.launch import infer as infer_script
from jaxspec import inference  # noqa: E402
from jaxspec.config import EOS_ID  # noqa: E402
from jaxspec.data import corpora  # noqa: E402
from jaxspec.decoding.beam_search import BeamConfig, generate_beam  # noqa: E402

NUM_EXAMPLES = 5


def _config(tmp_path):
  return f"""
include 'gin/models/tiny_pair.gin'
include 'gin/tasks/ende.gin'
include 'gin/decoding/speculative.gin'
include 'gin/decoding/beam.gin'
infer.target_model = @tiny_target/jaxspec.T5Config()
infer.drafter = @jaxspec.T5Drafter()
jaxspec.T5Drafter.config = @tiny_draft/jaxspec.T5Config()
infer.draft_name = 'tiny'
infer.input_length = 16
infer.max_decode_length = 8
infer.num_examples = {NUM_EXAMPLES}
infer.batch_size = 2
NUM_BEAMS = 2
BEAM_GAMMA = 2
infer.target_checkpoint = '{tmp_path}/target'
infer.draft_checkpoint = '{tmp_path}/draft'
infer.output_dir = '{tmp_path}/out'
"""


def _parse(tmp_path, bindings=()):
  gin.clear_config()
  path = tmp_path / 'config.gin'
  path.write_text(_config(tmp_path))
  gin_flags.parse([f'--gin_file={path}'] + [f'--gin.{b}' for b in bindings])


@pytest.fixture
def tiny_checkpoints(tmp_path, tiny_pair_checkpoints):
  """(tmp_path holding a copy of _config's checkpoints: random weights of
  gin/models/tiny_pair.gin's models, tests/conftest.py; the target's config), with
  _config(tmp_path) parsed."""
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, tmp_path / name)
  _parse(tmp_path)
  target = gin.query_parameter('infer.target_model').scoped_configurable_fn()
  yield tmp_path, target
  gin.clear_config()


def _records(path):
  with open(path) as f:
    return sorted((json.loads(line) for line in f), key=lambda r: r['index'])


def _direct_beams(tmp_path, target, num_beams):
  """generate_beam on each example alone: (tokens through EOS, best last; scores)."""
  params = inference.load_model_params(str(tmp_path / 'target'), target)
  vocab = corpora.Vocabulary()
  examples = corpora.load_split('ende', 'test')[:NUM_EXAMPLES]
  inputs, _ = inference.fit_inputs([corpora.input_ids(e, 'ende', vocab) for e in examples], 16)
  output = generate_beam(params, inputs, config=target,
                         beam=BeamConfig(num_beams=num_beams, alpha=0.6), max_decode_length=8)
  beams = [[inference.trim_at_eos(np.asarray(t), EOS_ID) for t in row] for row in output.tokens]
  return beams, np.asarray(output.scores)


def test_beam_and_speculative_beam_write_generate_beams_beams(tiny_checkpoints):
  tmp_path, target = tiny_checkpoints
  summary = infer_script.infer()
  beam = _records(tmp_path / 'out' / 'beam.jsonl')
  speculative = _records(tmp_path / 'out' / 'speculative_beam.jsonl')
  expected_beams, expected_scores = _direct_beams(tmp_path, target, num_beams=2)
  for records in (beam, speculative):
    assert [r['index'] for r in records] == list(range(NUM_EXAMPLES))
    assert [r['beam_tokens'] for r in records] == expected_beams
    assert [r['tokens'] for r in records] == [b[-1] for b in expected_beams]
    np.testing.assert_allclose([r['beam_scores'] for r in records], expected_scores,
                               rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose([r['score'] for r in records], expected_scores[:, -1],
                               rtol=1e-5, atol=1e-5)
  assert all(r['batch_target_calls'] == r['batch_search_steps'] for r in beam)
  for record in speculative:  # Calls that advanced 0..gamma+1 steps add up to the steps.
    by_steps = record['batch_calls_by_steps_advanced']
    assert sum(by_steps) == record['batch_target_calls']
    assert np.dot(by_steps, np.arange(len(by_steps))) == record['batch_search_steps']
  assert summary['examples'] == NUM_EXAMPLES and summary['num_beams'] == 2
  assert summary['draft_beams'] == 4 and summary['beam_gamma'] == 2
  assert summary['identical_beam_tokens'] == NUM_EXAMPLES
  assert summary['max_beam_score_difference'] <= 1e-5
  assert summary['beam_bleu'] == summary['speculative_beam_bleu']
  tokens = sum(len(r['tokens']) for r in beam)
  batches = {r['batch_start']: r for r in beam}.values()
  assert summary['beam_target_calls'] == sum(r['batch_target_calls'] for r in batches)
  assert summary['beam_target_calls_per_token'] == summary['beam_target_calls'] / tokens
  assert summary['search_steps_per_target_call'] >= 1.0
  assert summary['beam_speedup'] > 0 and 'temperature' not in summary
  written = json.loads((tmp_path / 'out' / 'summary.json').read_text())
  assert written['identical_beam_tokens_and_scores'] == summary[
      'identical_beam_tokens_and_scores']
  assert '| identical_beam_tokens |' in (tmp_path / 'out' / 'summary.md').read_text()


def test_auto_beam_gamma_writes_plain_beam_searchs_beams(tiny_checkpoints):
  """BEAM_GAMMA='auto': plain beam search's beams whichever gamma (0 included) each batch
  ran, the choice recorded per batch and counted in the summary."""
  tmp_path, target = tiny_checkpoints
  _parse(tmp_path, ["BEAM_GAMMA='auto'"])
  summary = infer_script.infer()
  speculative = _records(tmp_path / 'out' / 'speculative_beam.jsonl')
  expected_beams, expected_scores = _direct_beams(tmp_path, target, num_beams=2)
  assert [r['beam_tokens'] for r in speculative] == expected_beams
  np.testing.assert_allclose([r['beam_scores'] for r in speculative], expected_scores,
                             rtol=1e-5, atol=1e-5)
  for record in speculative:
    assert record['gamma'] in (0, 1, 2, 3)
    assert len(record['batch_calls_by_steps_advanced']) == record['gamma'] + 2
  chosen = [r['gamma'] for r in {r['batch_start']: r for r in speculative}.values()]
  assert summary['beam_gamma'] == 'auto'
  assert summary['beam_gamma_choices'] == ' '.join(
      f'{g}:{chosen.count(g)}' for g in sorted(set(chosen)))
  assert summary['identical_beam_tokens'] == NUM_EXAMPLES


def test_a_changed_beam_setting_changes_the_fingerprint_and_is_refused(tiny_checkpoints):
  tmp_path, _ = tiny_checkpoints
  infer_script.infer()
  before = json.loads((tmp_path / 'out' / 'settings.json').read_text())
  for changed, name in (('NUM_BEAMS=3', 'beam.num_beams'),
                        ('BREVITY_ALPHA=0.0', 'beam.alpha'),
                        ('DRAFT_BEAMS=2', 'speculative_beam.draft_beams'),
                        ('BEAM_GAMMA=1', 'speculative_beam.gamma')):
    _parse(tmp_path, [changed])
    with pytest.raises(inference.SettingsChanged, match=rf'{name} differ'):
      infer_script.infer()
  assert json.loads((tmp_path / 'out' / 'settings.json').read_text()) == before
  _parse(tmp_path, ['infer.num_examples=3'])  # The same settings resume.
  assert infer_script.infer()['examples'] == 3


def test_sampling_runs_keep_their_fingerprint():
  """Beam settings enter only runs with a beam decoder: the directories of sampling
  runs written before the beam decoders existed still resume."""
  common = dict(target_model=None, target_checkpoint='', drafter=None, draft_checkpoint=None,
                input_length=16, max_decode_length=8, batch_size=1, sampling=None,
                speculative=None, seed=0, overlong_inputs='truncate')
  task = infer_script.TaskData('ende', 'ende', [], [], None, 'bleu', {'corpus': 'ende'})
  identity = lambda path: {'path': path}  # noqa: E731
  original = infer_script.inference.checkpoint_identity
  infer_script.inference.checkpoint_identity = identity
  try:
    sampling = infer_script.run_settings(task=task, **common)
    beam = infer_script.run_settings(task=task, decoders=('beam',), **common)
    wider = infer_script.run_settings(task=task, decoders=('beam',),
                                      beam=BeamConfig(num_beams=8), **common)
  finally:
    infer_script.inference.checkpoint_identity = original
  assert 'beam' not in sampling and set(beam) - set(sampling) == {'beam', 'speculative_beam'}
  assert len({inference.settings_fingerprint(s) for s in (sampling, beam, wider)}) == 3


@pytest.mark.parametrize('binding, message', [
    ('NUM_BEAMS=0', r'num_beams must be >= 1, got 0'),
    ('NUM_BEAMS=2.5', r'num_beams \(jaxspec.BeamConfig.num_beams\) must be an integer'),
    ('BREVITY_ALPHA=-1.0', r'alpha \(jaxspec.BeamConfig.alpha\) must be >= 0.0'),
    ('DRAFT_BEAMS=1', r'draft_beams \(jaxspec.SpeculativeBeamConfig.draft_beams\) must be >= '
                      r'num_beams \(2\)'),
    ('BEAM_GAMMA=8', r'gamma 8 is larger than the decode buffer allows'),
    ('TEMPERATURE=1.0', r'beam search, which is deterministic: the sampling settings'),
    ('TOP_K=40', r'beam search, which is deterministic'),
    ('infer.drafter=@jaxspec.BigramDrafter()', r'infer.drafter must be a jaxspec.T5Drafter'),
    ("infer.decoders=('beam', 'speculative_bean')", r'infer.decoders must name some of'),
    ('infer.batch_size=4096', r'speculative beam search \(10 tree rows per example, gamma 2\) '
                              r'over batches of 4096 .* needs about'),
])
def test_bad_beam_settings_fail_before_any_model_is_loaded(tiny_checkpoints, monkeypatch,
                                                           binding, message):
  tmp_path, _ = tiny_checkpoints
  def loaded(*args, **kwargs):
    raise AssertionError('a model was loaded before the settings were checked')
  monkeypatch.setattr(infer_script.inference, 'load_model_params', loaded)
  monkeypatch.setattr(infer_script.validation, 'available_memory_bytes', lambda _: 2**30)
  bindings = [binding] + (['jaxspec.BigramDrafter.vocab_size=8000'] if 'Bigram' in binding
                          else [])
  _parse(tmp_path, bindings)
  with pytest.raises(ValueError, match=message):
    infer_script.infer()
  assert not (tmp_path / 'out').exists()
