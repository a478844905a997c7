"""Run-level pieces: input fitting, the resumable JSONL writer, and the errors of
loading a missing or damaged checkpoint."""

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jaxspec import inference
from jaxspec.checkpoints.t5x import save_t5x_checkpoint
from jaxspec.config import EOS_ID, get_config
from jaxspec.model import init_params

CONFIG = get_config('test_tiny_1_1')


def test_fit_inputs_pads_and_truncates_over_long_rows():
  rows = [[5, 6], [5, 6, 7], [5, 6, 7, 8, 9]]
  inputs, truncated = inference.fit_inputs(rows, 4, 'truncate')
  np.testing.assert_array_equal(inputs, [[5, 6, EOS_ID, 0], [5, 6, 7, EOS_ID],
                                         [5, 6, 7, EOS_ID]])
  assert truncated == [2]
  assert inference.fit_inputs(rows[:2], 4, 'error')[1] == []


def test_fit_inputs_refuses_over_long_rows_by_config():
  rows = [[5] * 3, [5] * 8, [5] * 2, [5] * 6]
  with pytest.raises(ValueError, match=r'2 of 4 inputs are longer than the input length 4 '
                     r'\(with EOS\): rows \[1, 3\], the first with 9 tokens'):
    inference.fit_inputs(rows, 4, 'error')
  with pytest.raises(ValueError, match='overlong must be one of'):
    inference.fit_inputs(rows, 4, 'drop')


def _record(index):
  return {'index': index, 'prediction': f'Satz {index} ü'}


def test_resumable_jsonl_drops_a_torn_last_line(tmp_path):
  path = str(tmp_path / 'out.jsonl')
  inference.ResumableJsonl(path).append([_record(0), _record(1)])
  with open(path, 'ab') as f:
    f.write(json.dumps(_record(2)).encode()[:9])  # A kill mid-write.
  writer = inference.ResumableJsonl(path)
  assert sorted(writer.records) == [0, 1]
  writer.append([_record(2)])
  with open(path, encoding='utf-8') as f:
    assert [json.loads(line) for line in f] == [_record(0), _record(1), _record(2)]


def test_resumable_jsonl_never_appends_a_stored_index(tmp_path):
  # A batch cut short by a kill is redone; its stored records are not written twice.
  path = str(tmp_path / 'out.jsonl')
  inference.ResumableJsonl(path).append([_record(0), _record(1)])
  inference.ResumableJsonl(path).append([_record(1), _record(2), _record(2)])
  with open(path) as f:
    assert [json.loads(line)['index'] for line in f] == [0, 1, 2]


def test_resumable_jsonl_names_a_damaged_complete_line(tmp_path):
  path = tmp_path / 'out.jsonl'
  path.write_text('{"index": 0}\n{"index": 1, \n{"index": 2}\n')
  with pytest.raises(ValueError, match=r'out.jsonl, line 2, is not a JSON record'):
    inference.ResumableJsonl(str(path))


@pytest.fixture(scope='module')
def checkpoint_dir(tmp_path_factory):
  directory = tmp_path_factory.mktemp('checkpoints')
  params = jax.device_get(init_params(CONFIG, jax.random.PRNGKey(0)))
  return save_t5x_checkpoint(directory, params, 1, inline_threshold=256)


def _damage(checkpoint, how):
  embedding = os.path.join(checkpoint, 'target.token_embedder.embedding')
  if how == 'not_a_checkpoint':
    os.remove(os.path.join(checkpoint, 'checkpoint'))
  elif how == 'truncated_msgpack':
    path = os.path.join(checkpoint, 'checkpoint')
    with open(path, 'rb') as f:
      data = f.read()
    with open(path, 'wb') as f:
      f.write(data[:len(data) // 2])
  elif how == 'missing_zarr_array':
    shutil.rmtree(embedding)
  elif how == 'corrupt_zarr_chunk':
    with open(os.path.join(embedding, '0.0'), 'wb') as f:
      f.write(b'not gzip')


@pytest.mark.parametrize('how, error, message', [
    ('not_a_checkpoint', FileNotFoundError, r'is not a T5X checkpoint: it holds no `checkpoint`'),
    ('truncated_msgpack', ValueError, r'checkpoint_1/checkpoint is corrupt'),
    ('missing_zarr_array', FileNotFoundError,
     r'target.token_embedder.embedding: the zarr array of parameter token_embedder/embedding '
     r'is missing'),
    ('corrupt_zarr_chunk', ValueError,
     r'target.token_embedder.embedding: the zarr array of parameter token_embedder/embedding '
     r'is corrupt'),
])
def test_load_model_params_names_what_is_wrong(checkpoint_dir, tmp_path, how, error, message):
  damaged = str(tmp_path / 'checkpoint_1')
  shutil.copytree(checkpoint_dir, damaged)
  inference.load_model_params(damaged, CONFIG)  # Intact, it loads.
  _damage(damaged, how)
  with pytest.raises(error, match=message):
    inference.load_model_params(damaged, CONFIG)


def test_write_text_atomic_replaces_whole_files_and_leaves_no_temporary(tmp_path, monkeypatch):
  path = tmp_path / 'out' / 'summary.json'
  inference.write_text_atomic(str(path), 'old')
  inference.write_text_atomic(str(path), 'new')
  assert path.read_text() == 'new' and sorted(p.name for p in path.parent.iterdir()) == [
      'summary.json']

  def killed(*args):  # The process dies between writing the temporary and renaming it.
    raise KeyboardInterrupt
  monkeypatch.setattr(inference.os, 'replace', killed)
  with pytest.raises(KeyboardInterrupt):
    inference.write_text_atomic(str(path), 'newer')
  assert path.read_text() == 'new'


# The output directory: settings fingerprint, lock, and users' own text.

SETTINGS = {'sampling': {'temperature': 0.0, 'top_k': 0}, 'speculative': {'gamma': 3},
            'seed': 0}


def _changed(**changes):
  settings = json.loads(json.dumps(SETTINGS))
  for dotted, value in changes.items():
    group, key = dotted.split('__')
    settings[group][key] = value
  return settings


def test_an_output_dir_refuses_other_settings_naming_them(tmp_path):
  out = str(tmp_path / 'out')
  directory, lock = inference.claim_output_dir(out, SETTINGS)
  inference.ResumableJsonl(os.path.join(out, 'baseline.jsonl')).append(
      [{'index': 0, 'fingerprint': inference.settings_fingerprint(SETTINGS)}])
  lock.release()
  assert inference.claim_output_dir(out, SETTINGS)[1].release() is None  # Same: resumes.
  other = _changed(sampling__temperature=1.0, speculative__gamma=7)
  with pytest.raises(inference.SettingsChanged,
                     match=r'sampling.temperature, speculative.gamma differ'):
    inference.claim_output_dir(out, other)
  fresh, lock = inference.claim_output_dir(out, other, 'new_dir')
  lock.release()
  assert fresh == f'{out}-{inference.settings_fingerprint(other)}' and directory == out
  with open(os.path.join(fresh, inference.SETTINGS_FILE)) as f:
    assert json.load(f)['settings'] == other


def test_records_without_settings_are_refused(tmp_path):
  # A directory written before settings were recorded: its records say nothing of them.
  (tmp_path / 'out').mkdir()
  (tmp_path / 'out' / 'baseline.jsonl').write_text('{"index": 0}\n')
  with pytest.raises(inference.SettingsChanged, match=r'baseline.jsonl holds records '
                     r'written without a settings fingerprint'):
    inference.claim_output_dir(str(tmp_path / 'out'), SETTINGS)
  # Records with this fingerprint (e.g. seeded from another directory) are adopted.
  (tmp_path / 'out' / 'baseline.jsonl').write_text(json.dumps(
      {'index': 0, 'fingerprint': inference.settings_fingerprint(SETTINGS)}) + '\n')
  inference.claim_output_dir(str(tmp_path / 'out'), SETTINGS)[1].release()


def test_a_second_writer_is_refused_until_the_first_releases(tmp_path):
  out = str(tmp_path / 'out')
  _, lock = inference.claim_output_dir(out, SETTINGS)
  with pytest.raises(inference.OutputDirectoryBusy,
                     match=rf'out is being written by another run \(pid {os.getpid()}\)'):
    inference.claim_output_dir(out, SETTINGS)
  lock.release()
  inference.claim_output_dir(out, SETTINGS)[1].release()


def test_checkpoint_identity_follows_content_not_copies(checkpoint_dir, tmp_path):
  copy = shutil.copytree(checkpoint_dir, tmp_path / 'copy' / 'checkpoint_1')
  original = inference.checkpoint_identity(checkpoint_dir)
  copied = inference.checkpoint_identity(str(copy))
  assert copied['content'] == original['content'] and copied['path'] != original['path']
  with open(os.path.join(copy, 'checkpoint'), 'r+b') as f:  # Another training result.
    data = f.read()
    f.seek(len(data) // 2)
    f.write(bytes([data[len(data) // 2] ^ 1]))
  assert inference.checkpoint_identity(str(copy))['content'] != original['content']


def test_text_inputs_skip_empty_lines_and_name_bad_ones():
  inputs, empty = inference.read_text_inputs(b'Hallo\n\n  \nWelt\n', 'in.txt')
  assert inputs == [(1, 'Hallo'), (4, 'Welt')] and empty == [2, 3]
  inputs, empty = inference.read_text_inputs(
      b'{"text": "a", "id": 1}\n\n{"text": ""}\n', 'in.jsonl', 'text')
  assert inputs == [(1, 'a')] and empty == [2, 3]
  with pytest.raises(ValueError, match=r'in.txt, line 3: not valid UTF-8 \(byte 0xe4 at '
                     r'column 2\)'):
    inference.read_text_inputs('a\nb\n'.encode() + 'Käse'.encode('latin-1'), 'in.txt')
  with pytest.raises(ValueError, match=r"in.jsonl, line 1: field 'text' holds int, not text"):
    inference.read_text_inputs(b'{"text": 3}\n', 'in.jsonl', 'text')


def test_trim_to_bucket_takes_the_shortest_bucket_holding_every_row():
  tokens = np.zeros((2, 10), np.int32)
  tokens[0, :3] = [5, 6, 1]
  tokens[1, :5] = [7, 8, 9, 4, 1]
  np.testing.assert_array_equal(inference.trim_to_bucket(tokens, (4, 6, 8)), tokens[:, :6])
  assert inference.trim_to_bucket(tokens, (2, 4)).shape == (2, 10)  # None holds row 1.
  assert inference.trim_to_bucket(tokens, ()).shape == (2, 10)
  assert inference.trim_to_bucket(tokens[:1], (2, 3, 4)).shape == (1, 3)
  assert inference.trim_to_bucket(np.zeros((1, 10), np.int32), (2,)).shape == (1, 2)


@pytest.mark.parametrize('buckets', [(0,), (4, 4), (8, 4), (11,), (2.5,), (True,)])
def test_bad_length_buckets_are_named(buckets):
  with pytest.raises(ValueError, match='must be increasing integers from 1 to the input length 10'):
    inference.check_length_buckets(buckets, 10)
