"""scripts/export_checkpoint.py: a run's latest or chosen checkpoint, written in
bfloat16 to the destination, the destination's old contents kept when the step is
missing."""

import os

import numpy as np
import pytest


from jaxspec.launch import export_checkpoint
from jaxspec.checkpoints import t5x as t5x_checkpoints  # noqa: E402


def _run(tmp_path):
  """A run directory with checkpoints at steps 100 and 200, each with its own values."""
  run = tmp_path / 'run'
  for step in (100, 200):
    params = {'token_embedder': {'embedding': np.full((4, 3), step / 64, np.float32)}}
    t5x_checkpoints.save_t5x_checkpoint(str(run), params, step)
  return run


def _exported(destination):
  location = t5x_checkpoints.find_t5x_checkpoint(str(destination))
  params = t5x_checkpoints.load_t5x_checkpoint(location.directory)
  return os.path.basename(location.directory), params['token_embedder']['embedding']


@pytest.mark.parametrize('step, expected', [(None, 200), (100, 100)])
def test_the_latest_or_the_chosen_step_in_bfloat16(tmp_path, step, expected):
  destination = tmp_path / 'shipped'
  (destination / 'checkpoint_7').mkdir(parents=True)  # an earlier export, replaced
  argv = [str(_run(tmp_path)), str(destination)] + ([] if step is None else [f'--step={step}'])
  export_checkpoint.main(argv)
  assert sorted(os.listdir(destination)) == [f'checkpoint_{expected}']
  name, embedding = _exported(destination)
  assert name == f'checkpoint_{expected}'
  np.testing.assert_array_equal(embedding, np.full((4, 3), expected / 64, np.float32))
  stored = t5x_checkpoints.find_t5x_checkpoint(str(destination))
  assert 'bfloat16' in open(os.path.join(stored.directory, 'checkpoint'), 'rb').read().decode(
      'latin-1')


def test_a_missing_step_is_named_and_the_destination_kept(tmp_path):
  destination = tmp_path / 'shipped'
  export_checkpoint.main([str(_run(tmp_path)), str(destination), '--step=100'])
  with pytest.raises(FileNotFoundError, match=r'no checkpoint_300; its steps: \[100, 200\]'):
    export_checkpoint.main([str(tmp_path / 'run'), str(destination), '--step=300'])
  assert _exported(destination)[0] == 'checkpoint_100'


def test_a_checkpoint_without_a_step_in_its_name_is_refused(tmp_path):
  # A checkpoint saved straight into a directory of another name carries no step to keep.
  named = tmp_path / 'run' / 'checkpoint_100'
  t5x_checkpoints.save_t5x_checkpoint(str(tmp_path / 'run'), {'x': np.zeros(2, np.float32)}, 100)
  os.rename(named, tmp_path / 'target')
  with pytest.raises(ValueError, match='is not a checkpoint_<step> directory'):
    export_checkpoint.main([str(tmp_path / 'target'), str(tmp_path / 'shipped')])
  assert not (tmp_path / 'shipped').exists()
