"""scripts/best_checkpoint.py: the kept checkpoint that is best by a logged metric."""

import json

import pytest


from jaxspec.launch import best_checkpoint


def _run(tmp_path, kept, records):
  for step in kept:
    (tmp_path / f'checkpoint_{step}').mkdir()
  (tmp_path / 'optimizer_500.msgpack').write_bytes(b'')  # not a checkpoint directory
  if records is not None:
    (tmp_path / 'train_log.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(tmp_path)


def test_best_of_the_kept_steps_by_the_metric(tmp_path):
  run = _run(tmp_path, [500, 1000, 1500], [
      {'step': 250, 'xent': 1.0, 'alpha': 0.9},  # its checkpoint is gone
      {'step': 500, 'xent': 3.0, 'alpha': 0.3},
      {'step': 1000, 'xent': 2.0, 'alpha': 0.5},
      {'step': 1500, 'xent': 2.5, 'alpha': 0.5}])
  assert best_checkpoint.best_step(run, 'xent', 'min') == 1000
  assert best_checkpoint.best_step(run, 'alpha', 'max') == 1500  # a tie: the latest


def test_without_a_log_the_latest(tmp_path):
  assert best_checkpoint.best_step(_run(tmp_path, [500, 1000], None), 'xent', 'min') == 1000


def test_without_the_metric_in_the_log_the_latest(tmp_path):
  run = _run(tmp_path, [500, 1000], [{'step': 500, 'xent': 1.0}])
  assert best_checkpoint.best_step(run, 'alpha', 'max') == 1000


def test_a_run_without_checkpoints_is_refused(tmp_path):
  with pytest.raises(FileNotFoundError, match='holds no checkpoint_<step> directory'):
    best_checkpoint.best_step(_run(tmp_path, [], None), 'xent', 'min')
