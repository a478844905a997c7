"""Tests of the cleaning and extraction rules of jaxspec/launch/build_corpora.py."""

import ast
import gzip
import json
import struct

import pytest

from jaxspec.launch import build_corpora as build


def write_mo(path, entries, charset='UTF-8'):
  """Writes a little-endian .mo catalog of {msgid: msgstr} (plus a header)."""
  header = f'Content-Type: text/plain; charset={charset}\n'
  items = sorted({'': header, **entries}.items())
  ids = [k.encode(charset) for k, _ in items]
  strs = [v.encode(charset) for _, v in items]
  ids_at, strs_at = 28, 28 + 8 * len(items)
  data_at = strs_at + 8 * len(items)
  tables, blob = [b'', b''], b''
  for column, strings in enumerate((ids, strs)):
    for s in strings:
      tables[column] += struct.pack('<2I', len(s), data_at + len(blob))
      blob += s + b'\0'
  head = struct.pack('<7I', 0x950412de, 0, len(items), ids_at, strs_at, 0, 0)
  path.write_bytes(head + tables[0] + tables[1] + blob)


def test_catalog_pairs_cleaning(tmp_path):
  path = tmp_path / 'de' / 'LC_MESSAGES' / 'gtk20.mo'
  path.parent.mkdir(parents=True)
  write_mo(path, {
      'Open _file': 'Datei _öffnen',
      'menu\x04_Quit': '_Beenden',
      'one file\x00%d files': 'eine Datei\x00%d Dateien',
      '%s: %d': '%s: %d',
      'Same': 'Same',
      'Untranslated': '',
      'Too   many\n spaces': 'Zu  viele\tLeerzeichen',
      'x' * 401: 'y',
  }, charset='ISO-8859-1')
  source = 'de/LC_MESSAGES/gtk20.mo'
  assert sorted(build.catalog_pairs(str(path))) == [
      ('Open file', 'Datei öffnen', source),
      ('Quit', 'Beenden', source),
      ('Too many spaces', 'Zu viele Leerzeichen', source),
  ]


@pytest.mark.parametrize('english, german, expected', [
    ('_Open', '_Öffnen', ('Open', 'Öffnen')),
    ('Color _name:', 'Farb_name:', ('Color name:', 'Farbname:')),
    ('Add APT repository', 'Paketdepot _hinzufügen', ('Add APT repository', 'Paketdepot hinzufügen')),
    ('max_connections is %d', 'max_connections ist %d', ('max_connections is %d', 'max_connections ist %d')),
    ('KP_Page_Up', 'NB_Bild_auf', ('KP_Page_Up', 'NB_Bild_auf')),
])
def test_strip_mnemonics(english, german, expected):
  assert build.strip_mnemonics(english, german) == expected


@pytest.mark.parametrize('text, expected', [
    ('%s: %d', False), ('%1$s (%-10lu)', False), ('${name} {0}', False),
    ('-- %s --', False), ('%s: Datei', True), ('Ok', True),
])
def test_has_words(text, expected):
  assert build.has_words(text) is expected


SOURCE = '''
class Box:
  """A box."""

  @property
  def size(self):  # why: cached
    """Return the size of the box in
    cubic centimetres, rounded down.

    Extra detail that is also prose.
    """
    def helper():
      """Nested docs vanish too."""
      return 1
    return helper() + 1

  def empty(self):
    """Abstract, nothing to summarize here at all."""
    raise NotImplementedError
'''


def test_module_examples_strip_docstrings(tmp_path):
  path = tmp_path / 'box.py'
  path.write_text(SOURCE, encoding='utf-8')
  examples = build.module_examples(str(path), str(tmp_path))
  assert examples == [{
      'inputs': ('@property\ndef size(self):  # why: cached\n'
                 '  def helper():\n    return 1\n  return helper() + 1'),
      'targets': ('Return the size of the box in cubic centimetres, rounded down. '
                  'Extra detail that is also prose.'),
      'source': 'box.py:6:size',
  }]
  ast.parse(examples[0]['inputs'])  # still valid Python


def test_summary_stops_at_doctests_and_indented_blocks():
  doc = 'Short summary of five words.\n\n    arg: an argument\n\nMore prose.'
  assert build.summary(doc) == 'Short summary of five words.'
  assert build.summary('Does X.\n\n>>> f()\n1') == 'Does X.'


def test_split_of_and_dedupe():
  assert build.split_of('a') == build.split_of('a')
  splits = [build.split_of(str(i)) for i in range(2000)]
  assert 60 <= splits.count('test') <= 140 and 60 <= splits.count('validation') <= 140
  rows = [{'inputs': 'a', 'targets': '1'}, {'inputs': 'a', 'targets': '2'}]
  assert build.dedupe(rows) == rows[:1]


def test_write_jsonl_gz_is_byte_stable(tmp_path):
  rows = [{'inputs': 'Größe', 'targets': 'size', 'source': 's'}]
  build.write_jsonl_gz(str(tmp_path / 'a.jsonl.gz'), rows)
  build.write_jsonl_gz(str(tmp_path / 'b.jsonl.gz'), rows)
  assert (tmp_path / 'a.jsonl.gz').read_bytes() == (tmp_path / 'b.jsonl.gz').read_bytes()
  with gzip.open(tmp_path / 'a.jsonl.gz', 'rt', encoding='utf-8') as f:
    assert [json.loads(line) for line in f] == rows


def test_ende_inputs_are_untranslated_train_strings(tmp_path):
  # English strings of any language's catalogs: those ende already has as an input (in any
  # split) are left out, duplicates kept once, and only strings whose hash bucket is 'train'.
  held_out = next(f'Held out {i}' for i in range(1000) if build.split_of(f'Held out {i}') != 'train')
  train = [f'Kept {i}' for i in range(1000) if build.split_of(f'Kept {i}') == 'train'][:2]
  for language, entries in (('fr', {train[0]: 'x', 'Known': 'y', held_out: 'z'}),
                            ('ja', {train[0]: 'x', train[1]: '', 'menu\x04_Quit': 'q',
                                    '%d': 'n'})):
    path = tmp_path / language / 'LC_MESSAGES' / 'gtk20.mo'
    path.parent.mkdir(parents=True)
    write_mo(path, entries)
  examples = build.build_ende_inputs(str(tmp_path / '*' / 'LC_MESSAGES' / '*.mo'),
                                     [{'inputs': 'Known', 'targets': 'Bekannt'}])
  expected = [train[0], train[1], 'Quit'] if build.split_of('Quit') == 'train' else train
  assert [e['inputs'] for e in examples] == expected
  assert examples[0] == {'inputs': train[0], 'source': 'fr/LC_MESSAGES/gtk20.mo'}
  stats = build.write_inputs_only(str(tmp_path / 'out'), 'ende_inputs', examples)['train']
  assert stats['examples'] == len(expected) and 'targets_words' not in stats
  assert stats['inputs_words'] == round(sum(len(t.split()) for t in expected) / len(expected), 1)
  assert stats['inputs_chars'] == round(sum(map(len, expected)) / len(expected), 1)
  assert stats['bytes'] == (tmp_path / 'out' / 'ende_inputs' / 'train.jsonl.gz').stat().st_size
  with gzip.open(tmp_path / 'out' / 'ende_inputs' / 'train.jsonl.gz', 'rt') as f:
    assert [json.loads(line) for line in f] == examples
