"""Tests of the shipped corpora, their vocabulary and T5-style encoding."""

import gzip
import hashlib
import itertools
import json
import pathlib
import re

import pytest

from jaxspec.data import corpora

PROVENANCE = corpora.default_data_dir() / 'PROVENANCE.md'


@pytest.fixture(scope='module')
def splits():
  return {(c, s): corpora.load_split(c, s) for c in corpora.CORPORA for s in corpora.SPLITS}


@pytest.fixture(scope='module')
def vocab():
  return corpora.Vocabulary()


def provenance_counts():
  """{(corpus, split): examples} from the counts table of PROVENANCE.md."""
  rows = re.findall(r'^\| (ende|docsum) \| (train|validation|test) \| ([\d,]+) \|',
                    PROVENANCE.read_text(encoding='utf-8'), flags=re.MULTILINE)
  return {(c, s): int(n.replace(',', '')) for c, s, n in rows}


def test_splits_load_with_string_fields(splits):
  for examples in splits.values():
    assert examples
    for example in examples:
      assert set(example) == {'inputs', 'targets', 'source'}
      assert all(isinstance(v, str) and v for v in example.values())


def test_counts_match_provenance(splits):
  assert provenance_counts() == {key: len(examples) for key, examples in splits.items()}


def test_inputs_unique_and_splits_disjoint(splits):
  for corpus in corpora.CORPORA:
    inputs = {s: [e['inputs'] for e in splits[corpus, s]] for s in corpora.SPLITS}
    for split, texts in inputs.items():
      assert len(set(texts)) == len(texts), (corpus, split)
    for a, b in itertools.combinations(corpora.SPLITS, 2):
      assert not set(inputs[a]) & set(inputs[b]), (corpus, a, b)


def test_split_is_the_sha256_bucket_of_the_input(splits):
  # Buckets 0-4 are test, 5-9 validation, the rest train.
  expected = lambda text: ['test', 'validation', 'train'][min(
      int(hashlib.sha256(text.encode('utf-8')).hexdigest(), 16) % 100 // 5, 2)]
  for (_, split), examples in splits.items():
    assert {expected(e['inputs']) for e in examples} == {split}


def test_files_are_reproducible_gzip():
  for path in sorted(corpora.default_data_dir().glob('*/*.jsonl.gz')):
    header = path.read_bytes()[:10]
    assert header[4:8] == b'\0\0\0\0', path  # mtime 0
    assert not header[3] & 0x08, path  # no file name stored


def test_vocab_special_ids(vocab):
  assert (vocab.pad_id, vocab.eos_id, vocab.unk_id) == (0, 1, 2)
  processor = vocab._processor  # pylint: disable=protected-access
  assert [processor.id_to_piece(i) for i in range(3)] == ['<pad>', '</s>', '<unk>']
  assert processor.bos_id() == -1
  assert vocab.vocab_size == 8000


@pytest.mark.parametrize('text', [
    'Größenänderung fehlgeschlagen: Überprüfen Sie die Datei »%s«.',
    'ÄÖÜ äöü ß – „Anführungszeichen“',
    'def f(x, *args):\n    if x >= 0:\n\treturn {"a": [x, 1.5e-3]}  # ok\n    return None',
])
def test_vocab_round_trips(vocab, text):
  ids = vocab.encode(text)
  assert corpora.EOS_ID not in ids and corpora.PAD_ID not in ids
  assert vocab.decode(ids) == text


def test_german_letters_are_pieces_not_bytes(vocab):
  pieces = [vocab._processor.id_to_piece(i) for i in vocab.encode('äöüßÄÖÜ')]  # pylint: disable=protected-access
  assert not [p for p in pieces if p.startswith('<0x')]


def test_decode_stops_at_eos_and_skips_pad(vocab):
  ids = vocab.encode('Hallo Welt')
  assert vocab.decode([0] + ids[:1] + [0] + ids[1:] + [1] + ids) == 'Hallo Welt'
  assert vocab.decode([1] + ids) == ''


def test_encode_example_adds_prefix_and_eos(vocab):
  example = {'inputs': 'Open file', 'targets': 'Datei öffnen', 'source': 'x'}
  inputs, targets = corpora.encode_example(example, 'ende', vocab, 64, 64)
  assert inputs == vocab.encode('translate English to German: Open file') + [1]
  assert targets == vocab.encode('Datei öffnen') + [1]
  inputs, _ = corpora.encode_example(example, 'docsum', vocab, 64, 64)
  assert vocab.decode(inputs) == 'summarize: Open file'


def test_encode_example_truncates_before_eos(vocab):
  example = {'inputs': 'one two three four five six', 'targets': 'eins zwei drei vier fünf'}
  full_inputs, full_targets = corpora.encode_example(example, 'ende', vocab, 10**6, 10**6)
  inputs, targets = corpora.encode_example(example, 'ende', vocab, 4, 3)
  assert inputs == full_inputs[:3] + [1]
  assert targets == full_targets[:2] + [1]


def test_load_split_honours_data_dir_env(tmp_path, monkeypatch):
  (tmp_path / 'ende').mkdir()
  rows = [{'inputs': 'a', 'targets': 'b', 'source': 'c'}]
  with gzip.open(tmp_path / 'ende' / 'test.jsonl.gz', 'wt', encoding='utf-8') as f:
    f.write(json.dumps(rows[0]) + '\n')
  monkeypatch.setenv(corpora.DATA_DIR_ENV, str(tmp_path))
  assert corpora.default_data_dir() == pathlib.Path(tmp_path)
  assert corpora.load_split('ende', 'test') == rows
  with pytest.raises(ValueError):
    corpora.load_split('ende', 'dev')


def test_ende_inputs_are_new_train_inputs_of_ende(splits, vocab):
  # The inputs-only corpus: English strings ende has no example of, all in the train
  # bucket, each once, encoded as ende's inputs with an empty target.
  extra = corpora.load_split('ende_inputs', 'train')
  texts = [e['inputs'] for e in extra]
  assert len(texts) > 20000 and len(set(texts)) == len(texts)
  assert set(extra[0]) == {'inputs', 'source'}
  known = {e['inputs'] for s in corpora.SPLITS for e in splits['ende', s]}
  assert not known & set(texts)
  assert {min(int(hashlib.sha256(t.encode('utf-8')).hexdigest(), 16) % 100 // 5, 2)
          for t in texts} == {2}
  encoded = corpora.encoded_split('ende_inputs', 'train', vocab, 64, 64, limit=3)
  for (inputs, targets), example in zip(encoded, extra):
    assert inputs == corpora.encode_example({**example, 'targets': ''}, 'ende', vocab, 64, 64)[0]
    assert targets == [corpora.EOS_ID]
  with pytest.raises(corpora.InvalidSetting, match="'ende_inputs'/'test'"):
    corpora.load_split('ende_inputs', 'test')
