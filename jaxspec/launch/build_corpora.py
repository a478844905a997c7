"""Builds the two text corpora shipped in data/ from files installed on Debian.

`ende`   English -> German pairs from the German gettext catalogs
         (/usr/share/locale/de*/LC_MESSAGES/*.mo) plus the German debconf
         template translations (/var/cache/debconf/templates.dat): a stand-in
         for WMT EnDe.
`ende_inputs`  English strings of the catalogs of every language
         (/usr/share/locale/*/LC_MESSAGES/*.mo) that `ende` has no German
         translation of: inputs only, train split only, for drafts trained on
         the target's own outputs (scripts/train_feature_draft.py extra_inputs).
`docsum` Python function source (docstrings removed) -> the function's
         docstring summary, from the installed CPython standard library: a
         stand-in for CNN/DM summarization (the target is much shorter than
         the input and copies words from it).

Every step is deterministic (sorted inputs, hash-based splits, gzip mtime=0),
so a rebuild on the same machine gives byte-identical files. See
data/PROVENANCE.md for sources, licenses and counts.

  python scripts/build_corpora.py --out data/
"""

import argparse
import ast
import glob
import gzip
import hashlib
import io
import json
import os
import re
import struct
import sys
import sysconfig
import textwrap
import time

from jaxspec.launch import command

LOCALE_GLOB = '/usr/share/locale/de*/LC_MESSAGES/*.mo'
ALL_LOCALES_GLOB = '/usr/share/locale/*/LC_MESSAGES/*.mo'
DEBCONF_TEMPLATES = '/var/cache/debconf/templates.dat'
MAX_PAIR_CHARS = 400
# Catalogs of GUI programs, where '_' before a letter marks a keyboard mnemonic.
MNEMONIC_CATALOGS = ('gtk20', 'software-properties', 'avahi', 'gnupg2')

STDLIB_SKIP_DIRS = frozenset({
    'test', 'tests', 'idlelib', 'lib2to3', 'site-packages', 'dist-packages',
    'turtledemo', '__pycache__', 'pydoc_data', 'ensurepip'})
MAX_INPUT_CHARS = 2000
MIN_TARGET_WORDS = 5
TARGET_WORDS = 30      # Later docstring paragraphs are added up to this...
MAX_TARGET_WORDS = 100  # ...but a target never grows past this.

HELD_OUT_PERCENT = {'validation': 5, 'test': 5}
SPLITS = ('train', 'validation', 'test')


# ----------------------------------------------------------------------------
# gettext catalogs
# ----------------------------------------------------------------------------


def read_mo(path):
  """Returns the (msgid, msgstr) byte-string pairs of a compiled .mo file."""
  with open(path, 'rb') as f:
    data = f.read()
  order = '<' if struct.unpack('<I', data[:4])[0] == 0x950412de else '>'
  _, count, ids_at, strs_at = struct.unpack(order + '4I', data[4:20])

  def string(table, i):
    length, offset = struct.unpack(order + '2I', data[table + 8 * i:table + 8 * i + 8])
    return data[offset:offset + length]

  return [(string(ids_at, i), string(strs_at, i)) for i in range(count)]


def catalog_charset(pairs):
  """The charset named in the catalog header (the msgid '' entry)."""
  header = dict(pairs).get(b'', b'')
  match = re.search(rb'charset=([\w.-]+)', header)
  return match.group(1).decode('ascii') if match else 'utf-8'


def collapse_whitespace(text):
  return ' '.join(text.split())


def mnemonic_removed(text, other):
  """text without its GUI mnemonic '_' (as in '_Open'), if it has one.

  A mnemonic is the only '_' before a letter in text, either at the start of
  a word or inside a word that the other side does not copy verbatim (so
  identifiers such as max_connections stay).
  """
  if len(re.findall(r'_(?=\w)', text)) != 1:
    return text
  word = next(w for w in text.split() if re.search(r'_\w', w))
  if re.search(r'(^|\W)_\w', word) or word not in other.split():
    return re.sub(r'_(?=\w)', '', text)
  return text


def strip_mnemonics(english, german):
  """Removes GUI mnemonic markers from both sides of a pair."""
  return mnemonic_removed(english, german), mnemonic_removed(german, english)


def has_words(text):
  """True when text holds a real word once format specifiers are removed."""
  text = re.sub(r'%[-#0 +\d$.*hlLqjzt]*[a-zA-Z%]|\$\{\w+\}|\{\w*\}', ' ', text)
  return re.search(r'[^\W\d_]{2,}', text) is not None


def clean_pair(english, german):
  """The cleaned pair, or None when it is not a usable translation."""
  english, german = collapse_whitespace(english), collapse_whitespace(german)
  if not english or not german or english == german:
    return None
  if len(english) > MAX_PAIR_CHARS or len(german) > MAX_PAIR_CHARS:
    return None
  if not has_words(english) or not has_words(german):
    return None
  return english, german


def msgid_english(msgid, charset, name):
  """The English string of a catalog's msgid: decoded, without its msgctxt and, in
  gnupg2, without GnuPG's '|pinentry-label|' context prefix."""
  english = msgid.decode(charset).split('\x04')[-1]
  if name == 'gnupg2':
    english = re.sub(r'^\|[^|]*\|', '', english)
  return english


def catalog_pairs(path):
  """Cleaned (english, german, source) triples of one .mo catalog."""
  pairs = read_mo(path)
  charset = catalog_charset(pairs)
  name = os.path.basename(path)[:-len('.mo')]
  triples = []
  for msgid, msgstr in pairs:
    if not msgid or b'\x00' in msgid:  # header entry; plural forms
      continue
    english = msgid_english(msgid, charset, name)
    german = msgstr.decode(charset)
    if name in MNEMONIC_CATALOGS:
      english, german = strip_mnemonics(english, german)
    pair = clean_pair(english, german)
    if pair:
      triples.append((*pair, '/'.join(path.split(os.sep)[-3:])))  # de/LC_MESSAGES/x.mo
  return triples


def catalog_english(path):
  """Cleaned (english, source) pairs of one .mo catalog of any language, cleaned as
  catalog_pairs cleans the English side (no translation is needed)."""
  pairs = read_mo(path)
  charset = catalog_charset(pairs)
  name = os.path.basename(path)[:-len('.mo')]
  found = []
  for msgid, _ in pairs:
    if not msgid or b'\x00' in msgid:
      continue
    try:
      english = msgid_english(msgid, charset, name)
    except UnicodeDecodeError:
      continue
    if name in MNEMONIC_CATALOGS:
      english = mnemonic_removed(english, '')
    english = collapse_whitespace(english)
    if english and len(english) <= MAX_PAIR_CHARS and has_words(english):
      found.append((english, '/'.join(path.split(os.sep)[-3:])))
  return found


def build_ende_inputs(locale_glob, ende_examples):
  """Inputs-only examples {'inputs', 'source'}: the English strings of the catalogs under
  locale_glob that are no input of ende_examples, deduplicated, those whose split_of is
  'train' (so a string that later gains a German translation joins ende's train split,
  never a held-out one)."""
  known = {example['inputs'] for example in ende_examples}
  found = []
  for path in sorted(glob.glob(locale_glob)):
    found += [{'inputs': english, 'source': source}
              for english, source in catalog_english(path) if english not in known]
  return [e for e in dedupe(found) if split_of(e['inputs']) == 'train']


# ----------------------------------------------------------------------------
# debconf templates
# ----------------------------------------------------------------------------


def debconf_stanzas(path):
  """Yields each template of debconf's templates.dat as a field dict."""
  with open(path, encoding='utf-8') as f:
    for block in f.read().split('\n\n'):
      fields = {}
      for line in block.splitlines():
        key, _, value = line.partition(': ')
        fields[key] = value
      if 'Name' in fields:
        yield fields


def debconf_paragraphs(value):
  """Splits a debconf extended description ('\\n' escaped) into paragraphs."""
  return [p for p in value.replace('\\n', '\n').split('\n\n') if p.strip()]


def debconf_pairs(path):
  """(english, german, source) triples of the German debconf translations.

  The short descriptions are paired directly; extended descriptions are
  paired paragraph by paragraph when both sides have as many paragraphs.
  """
  triples = []
  for fields in debconf_stanzas(path):
    source = 'debconf:' + fields['Name']
    candidates = [(fields.get('Description', ''), fields.get('Description-de.utf-8', ''))]
    english = debconf_paragraphs(fields.get('Extended_description', ''))
    german = debconf_paragraphs(fields.get('Extended_description-de.utf-8', ''))
    if len(english) == len(german):
      candidates += zip(english, german)
    for english_text, german_text in candidates:
      pair = clean_pair(english_text, german_text)
      if pair:
        triples.append((*pair, source))
  return triples


def build_ende(locale_glob, debconf_path):
  """English -> German examples, deduplicated on the English side.

  Catalogs are visited in sorted path order and debconf last; the first
  German translation of an English string wins.
  """
  triples = []
  for path in sorted(glob.glob(locale_glob)):
    triples += catalog_pairs(path)
  if debconf_path and os.path.exists(debconf_path):
    triples += debconf_pairs(debconf_path)
  return dedupe([{'inputs': e, 'targets': g, 'source': s} for e, g, s in triples])


# ----------------------------------------------------------------------------
# Python standard library docstrings
# ----------------------------------------------------------------------------


def stdlib_files(stdlib_dir):
  """Sorted .py files of the standard library outside tests and tools."""
  paths = []
  for root, dirs, files in os.walk(stdlib_dir):
    dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIP_DIRS)
    paths += [os.path.join(root, f) for f in files if f.endswith('.py')]
  return sorted(paths)


def docstring_node(node):
  """The docstring expression of a def/class body, or None."""
  body = getattr(node, 'body', None)
  if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
    if isinstance(body[0].value.value, str):
      return body[0]
  return None


def on_own_lines(source_lines, node):
  """True when nothing but whitespace or a comment shares node's lines."""
  first = source_lines[node.lineno - 1].encode('utf-8')
  last = source_lines[node.end_lineno - 1].encode('utf-8')
  after = last[node.end_col_offset:].strip()
  return not first[:node.col_offset].strip() and (not after or after.startswith(b'#'))


def docstring_lines(source_lines, function):
  """0-based line numbers of every docstring inside function (nested too).

  Returns None when a docstring shares a line with code, which line-based
  removal cannot handle.
  """
  lines = set()
  for node in ast.walk(function):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
      continue
    doc = docstring_node(node)
    if doc is None:
      continue
    if not on_own_lines(source_lines, doc):
      return None
    lines.update(range(doc.lineno - 1, doc.end_lineno))
  return lines


def is_trivial(function):
  """True when the body without its docstring is empty, pass, ... or raise."""
  body = function.body[1:]
  if not body:
    return True
  if len(body) > 1:
    return False
  statement = body[0]
  if isinstance(statement, (ast.Pass, ast.Raise)):
    return True
  return isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Constant)


def function_source(source_lines, function):
  """The dedented source of function without any docstring, or None."""
  skip = docstring_lines(source_lines, function)
  if skip is None:
    return None
  first = min([function.lineno] + [d.lineno for d in function.decorator_list]) - 1
  kept = [source_lines[i] for i in range(first, function.end_lineno) if i not in skip]
  code = textwrap.dedent('\n'.join(kept)).strip('\n')
  return '\n'.join(line.rstrip() for line in code.splitlines())


def summary(docstring):
  """Leading prose paragraphs of a docstring, up to about TARGET_WORDS words."""
  words = []
  for paragraph in docstring.split('\n\n'):
    if not words and not paragraph.strip():
      continue
    if '>>>' in paragraph or paragraph.startswith((' ', '\t')):
      break  # doctests and indented blocks (argument tables, code) end the prose
    paragraph_words = paragraph.split()
    if words and len(words) + len(paragraph_words) > MAX_TARGET_WORDS:
      break
    words += paragraph_words
    if len(words) >= TARGET_WORDS:
      break
  return ' '.join(words)


def module_examples(path, stdlib_dir):
  """docsum examples of every documented function and method in one file."""
  with open(path, encoding='utf-8') as f:
    source = f.read()
  try:
    tree = ast.parse(source)
  except SyntaxError:
    return []
  lines = source.splitlines()
  module = os.path.relpath(path, stdlib_dir)
  examples = []
  for node in ast.walk(tree):
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
      continue
    docstring = ast.get_docstring(node, clean=True)
    if not docstring or is_trivial(node):
      continue
    target = summary(docstring)
    code = function_source(lines, node)
    if not code or len(target.split()) < MIN_TARGET_WORDS or len(target.split()) > MAX_TARGET_WORDS:
      continue
    if len(code) > MAX_INPUT_CHARS:
      continue
    examples.append({'inputs': code, 'targets': target,
                     'source': f'{module}:{node.lineno}:{node.name}'})
  examples.sort(key=lambda example: int(example['source'].split(':')[1]))
  return examples


def build_docsum(stdlib_dir):
  """Function-source -> docstring-summary examples, deduplicated on inputs."""
  examples = []
  for path in stdlib_files(stdlib_dir):
    examples += module_examples(path, stdlib_dir)
  return dedupe(examples)


# ----------------------------------------------------------------------------
# Splitting and writing
# ----------------------------------------------------------------------------


def dedupe(examples):
  """Keeps the first example of each distinct input, in order."""
  seen, unique = set(), []
  for example in examples:
    if example['inputs'] not in seen:
      seen.add(example['inputs'])
      unique.append(example)
  return unique


def split_of(inputs):
  """The split of an example, from a stable hash of its input text."""
  bucket = int(hashlib.sha256(inputs.encode('utf-8')).hexdigest(), 16) % 100
  if bucket < HELD_OUT_PERCENT['test']:
    return 'test'
  if bucket < HELD_OUT_PERCENT['test'] + HELD_OUT_PERCENT['validation']:
    return 'validation'
  return 'train'


def write_jsonl_gz(path, examples):
  """Writes examples as gzipped JSON lines, byte-identical across rebuilds."""
  text = ''.join(json.dumps(e, ensure_ascii=False) + '\n' for e in examples)
  buffer = io.BytesIO()
  with gzip.GzipFile(filename='', mode='wb', fileobj=buffer, compresslevel=9, mtime=0) as f:
    f.write(text.encode('utf-8'))
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'wb') as f:
    f.write(buffer.getvalue())


def write_inputs_only(out_dir, name, examples):
  """Writes an inputs-only corpus (its train split); returns its statistics."""
  path = os.path.join(out_dir, name, 'train.jsonl.gz')
  write_jsonl_gz(path, examples)
  return {'train': {**split_stats(examples, fields=('inputs',)),
                    'bytes': os.path.getsize(path)}}


def split_stats(examples, fields=('inputs', 'targets')):
  """Count, mean words and mean characters of each of `fields`."""
  count = max(len(examples), 1)
  mean = lambda field, size: round(sum(size(e[field]) for e in examples) / count, 1)
  return {'examples': len(examples),
          **{f'{field}_words': mean(field, lambda t: len(t.split())) for field in fields},
          **{f'{field}_chars': mean(field, len) for field in fields}}


def write_corpus(out_dir, name, examples):
  """Splits and writes one corpus; returns per-split statistics."""
  splits = {split: [] for split in SPLITS}
  for example in examples:
    splits[split_of(example['inputs'])].append(example)
  stats = {}
  for split, split_examples in splits.items():
    path = os.path.join(out_dir, name, f'{split}.jsonl.gz')
    write_jsonl_gz(path, split_examples)
    stats[split] = {**split_stats(split_examples), 'bytes': os.path.getsize(path)}
  return stats


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--out', default='data/', help='output directory')
  parser.add_argument('--locale-glob', default=LOCALE_GLOB)
  parser.add_argument('--all-locales-glob', default=ALL_LOCALES_GLOB,
                      help='catalogs whose English strings make ende_inputs')
  parser.add_argument('--debconf', default=DEBCONF_TEMPLATES,
                      help="debconf templates.dat ('' to skip)")
  parser.add_argument('--stdlib', default=sysconfig.get_paths()['stdlib'])
  parser.add_argument('--corpora', nargs='+', default=['ende', 'docsum', 'ende_inputs'],
                      choices=['ende', 'docsum', 'ende_inputs'])
  command.add_verbose_flag(parser)
  args = parser.parse_args(argv)
  ende = lambda: build_ende(args.locale_glob, args.debconf)  # noqa: E731
  builders = {'ende': lambda: write_corpus(args.out, 'ende', ende()),
              'docsum': lambda: write_corpus(args.out, 'docsum', build_docsum(args.stdlib)),
              'ende_inputs': lambda: write_inputs_only(
                  args.out, 'ende_inputs', build_ende_inputs(args.all_locales_glob, ende()))}
  report = {}
  for name in args.corpora:
    start = time.time()
    report[name] = builders[name]()
    report[name]['seconds'] = round(time.time() - start, 1)
  json.dump(report, sys.stdout, indent=2)
  print()


cli = command.entry_point(main)


if __name__ == '__main__':
  sys.exit(cli())
