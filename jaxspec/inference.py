"""Run-level pieces: loading models, fitting inputs, resumable JSONL, the output
directory's settings fingerprint and lock, reading users' own text.

Used by scripts/infer.py and jaxspec.pairs; nothing here parses flags or gin.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import json
import os
import sys
import time
from typing import Callable, Iterable, NamedTuple, Sequence

import jax
import numpy as np

from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec import errors
from jaxspec.config import OMIT_AT_DEFAULT, T5Config
from jaxspec.data import corpora
from jaxspec.model.cpu import layout as kernel_layout


def load_model_params(checkpoint: str, config: T5Config, *, for_decoding: bool = False):
  """Variables {'params': ...} from a T5X checkpoint, in config.param_dtype, on device.

  for_decoding: kernels in the layout in which the model decodes fastest on this
  platform (jaxspec.model.cpu.layout: tiled, or transposed without the kernel's AVX-512
  build, on CPU, where steps over a few positions run through jaxspec's few-row kernel,
  jaxspec.model.cpu.matmul; a target's
  verify step then costs about one step, and a draft's proposal less than in T5X's
  layout, scripts/step_costs.py; on a GPU or TPU the fused layout, each decoder layer's
  q/k/v and wi_0/wi_1 in one product, jaxspec.model.accelerator.layout).
  """
  params = t5x_checkpoints.load_t5x_checkpoint(checkpoint, config, dtype=config.param_dtype)
  if for_decoding:
    params = kernel_layout.for_decoding(params)
  return {'params': jax.device_put(params)}


def pad_rows(rows: Sequence[Sequence[int]], length: int) -> np.ndarray:
  """Token id lists -> [len(rows), length] int32, zero padded (rows must fit)."""
  out = np.zeros((len(rows), length), np.int32)
  for i, row in enumerate(rows):
    if len(row) > length:
      raise ValueError(f'row {i} has {len(row)} tokens, more than the length {length}')
    out[i, :len(row)] = row
  return out


OVERLONG_ACTIONS = ('truncate', 'error')


def fit_inputs(rows: Sequence[Sequence[int]], length: int,
               overlong: str = 'truncate') -> tuple[np.ndarray, list[int]]:
  """Token id lists (without EOS) -> ([len(rows), length] int32 ending in EOS, the
  indices of the rows that did not fit).

  A row fits if it and its EOS take at most `length` tokens. overlong 'truncate' cuts
  the others to length - 1 tokens plus EOS (seqio's append_eos_after_trim); 'error'
  raises jaxspec.errors.InvalidSetting (a ValueError) naming them. The caller reports
  what was truncated.
  """
  if overlong not in OVERLONG_ACTIONS:
    raise errors.InvalidSetting(f'overlong must be one of {OVERLONG_ACTIONS}, got {overlong!r}')
  too_long = [i for i, row in enumerate(rows) if len(row) + 1 > length]
  if too_long and overlong == 'error':
    raise errors.InvalidSetting(
        f'{len(too_long)} of {len(rows)} inputs are longer than the input length {length} '
        f'(with EOS): rows {too_long[:10]}, the first with {len(rows[too_long[0]]) + 1} '
        "tokens; raise the input length or let them be truncated (overlong 'truncate')")
  fitted = [corpora.trim_and_append_eos(list(row), length) for row in rows]
  return pad_rows(fitted, length), too_long


def check_length_buckets(buckets: Sequence[int], length: int, name: str = 'buckets'):
  """Raises ValueError unless buckets are increasing integers in [1, length]."""
  buckets = tuple(buckets)
  if (any(isinstance(b, bool) or not isinstance(b, (int, np.integer)) for b in buckets)
      or any(b < 1 or b > length for b in buckets)
      or any(a >= b for a, b in zip(buckets, buckets[1:]))):
    raise errors.InvalidSetting(f'{name} must be increasing integers from 1 to the input length '
                                f'{length}, got {buckets!r}')


def trim_to_bucket(tokens: np.ndarray, buckets: Sequence[int]) -> np.ndarray:
  """tokens [b, length] (0 = padding after each row's ids) -> tokens [b, bucket]: the
  shortest of `buckets` that holds every row's ids, else all `length` columns.

  The encoder then runs over the bucket's positions instead of the whole padded
  length; padding is masked everywhere, so the decode is the same up to float rounding
  while each bucket compiles a program of its own (warm each before timing)."""
  tokens = np.asarray(tokens)
  used = tokens.shape[1] - np.argmax(tokens[:, ::-1] != 0, axis=1)  # [b]
  used = np.where(np.any(tokens != 0, axis=1), used, 1)
  longest = int(used.max(initial=1))
  fitting = [b for b in buckets if longest <= b < tokens.shape[1]]
  return tokens[:, :min(fitting)] if fitting else tokens


class ResumableJsonl:
  """An append-only JSONL file of records keyed by 'index', safe to kill at any point.

  Each batch of records is appended and fsynced; on open, a torn last line (from a
  kill mid-write) is cut off, and records whose index is already stored are not
  appended again (a batch cut short is redone), so restarting never duplicates or
  loses a record.
  """

  def __init__(self, path: str):
    self.path = path
    os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
    self.records: dict[int, dict] = {}
    if os.path.exists(path):
      self._recover()

  def _recover(self):
    with open(self.path, 'rb') as f:
      data = f.read()
    keep = data.rfind(b'\n') + 1  # Bytes up to the last complete line.
    for number, line in enumerate(data[:keep].splitlines(), 1):
      try:
        record = json.loads(line)
      except json.JSONDecodeError as error:  # Only the last line can be torn by a kill.
        raise errors.InvalidSetting(f'{self.path}, line {number}, is not a JSON record ({error}); '
                                    'only a torn last line is repaired on resume') from error
      self.records[record['index']] = record
    if keep != len(data):
      with open(self.path, 'r+b') as f:
        f.truncate(keep)

  def append(self, records: Iterable[dict]):
    records = list({r['index']: r for r in records if r['index'] not in self.records}.values())
    lines = ''.join(json.dumps(r, ensure_ascii=False) + '\n' for r in records)
    with open(self.path, 'a', encoding='utf-8') as f:
      f.write(lines)
      f.flush()
      os.fsync(f.fileno())
    for record in records:
      self.records[record['index']] = record


def write_text_atomic(path: str, text: str):
  """Writes text to path through a temporary file and a rename: a kill leaves the old
  file or the new one, never a part of either."""
  directory = os.path.dirname(path) or '.'
  os.makedirs(directory, exist_ok=True)
  temporary = os.path.join(directory, f'.{os.path.basename(path)}.tmp')
  with open(temporary, 'w', encoding='utf-8') as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(temporary, path)


def timed(fn: Callable, *args):
  """(result, seconds) of fn(*args) with the device work waited for."""
  start = time.perf_counter()
  result = jax.block_until_ready(fn(*args))
  return result, time.perf_counter() - start


def trim_at_eos(tokens: np.ndarray, eos_id: int) -> list[int]:
  """Decoded ids up to and including the first EOS."""
  tokens = [int(t) for t in tokens]
  return tokens[:tokens.index(eos_id) + 1] if eos_id in tokens else tokens


def markdown_table(rows: Sequence[dict], columns: Sequence[str]) -> str:
  """A markdown table of rows' values in columns (blank where absent); floats with three
  decimals, small nonzero ones (a score's rounding difference) in scientific notation."""
  def fmt(value):
    if isinstance(value, float):
      return f'{value:.2e}' if 0 < abs(value) < 1e-3 else f'{value:.3f}'
    return str(value)
  lines = ['| ' + ' | '.join(columns) + ' |', '|' + '---|' * len(columns)]
  lines += ['| ' + ' | '.join(fmt(row.get(c, '')) for c in columns) + ' |' for row in rows]
  return '\n'.join(lines) + '\n'


# Run settings: an output directory holds the records of one set of settings.

SETTINGS_FILE = 'settings.json'
LOCK_FILE = '.lock'
SETTINGS_CHANGE_ACTIONS = ('error', 'new_dir')
_HASHED_FILE_BYTES = 1 << 20  # Files up to this size are hashed, larger ones sized.


def checkpoint_identity(path: str) -> dict:
  """What identifies a T5X checkpoint's content, cheaply: the path as given, the
  checkpoint_<step> directory it resolves to, and a digest of every file's relative
  path and size plus the content of the small ones (the msgpack, metadata). Copying a
  checkpoint keeps its digest; retraining or another step changes it. gs:// paths are
  identified by name only. Raises FileNotFoundError naming a missing checkpoint."""
  location = t5x_checkpoints.find_t5x_checkpoint(path)
  identity = {'path': str(path), 'step_directory': os.path.basename(location.directory)}
  if str(location.directory).startswith('gs://'):
    return identity
  digest = hashlib.sha256()
  for root, directories, names in os.walk(location.directory):
    directories.sort()
    for name in sorted(names):
      file_path = os.path.join(root, name)
      size = os.path.getsize(file_path)
      digest.update(f'{os.path.relpath(file_path, location.directory)}\0{size}\0'.encode())
      if size <= _HASHED_FILE_BYTES:
        with open(file_path, 'rb') as f:
          digest.update(hashlib.sha256(f.read()).digest())
  identity['content'] = digest.hexdigest()[:16]
  return identity


def _described_fields(value):
  for f in dataclasses.fields(value):
    current = getattr(value, f.name)
    if f.metadata.get('settings') == OMIT_AT_DEFAULT['settings'] and current == f.default:
      continue
    yield f.name, current


def describe(value):
  """A JSON-able description of a setting: dataclasses as {'class', fields...}
  (recursively; fields marked OMIT_AT_DEFAULT only where they differ from their
  default), tuples as lists, other objects by repr."""
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {'class': type(value).__name__,
            **{name: describe(field) for name, field in _described_fields(value)}}
  if isinstance(value, (list, tuple)):
    return [describe(v) for v in value]
  if isinstance(value, dict):
    return {str(k): describe(v) for k, v in value.items()}
  if value is None or isinstance(value, (bool, int, float, str)):
    return value
  return repr(value)


def settings_fingerprint(settings: dict) -> str:
  """A short hash of JSON-able settings, independent of key order."""
  text = json.dumps(settings, sort_keys=True, ensure_ascii=True)
  return hashlib.sha256(text.encode()).hexdigest()[:16]


def settings_differences(old, new, prefix: str = '') -> list[str]:
  """Dotted names of the settings whose values differ between two settings dicts."""
  if isinstance(old, dict) and isinstance(new, dict):
    names = []
    for key in sorted(set(old) | set(new)):
      name = f'{prefix}.{key}' if prefix else str(key)
      if key not in old or key not in new:
        names.append(name)
      else:
        names.extend(settings_differences(old[key], new[key], name))
    return names
  return [] if old == new else [prefix or '(all)']


class SettingsChanged(errors.InvalidSetting):
  """The output directory holds records written with other settings."""


class OutputDirectoryBusy(errors.UserError, RuntimeError):
  """Another process holds the output directory's lock."""


class DirectoryLock:
  """An exclusive lock on a directory (fcntl.flock on <directory>/.lock), held until
  release(); the holder's pid is written into the file for the error message. The
  operating system drops it when the holder dies, so a killed run never leaves it."""

  def __init__(self, directory: str):
    self.path = os.path.join(directory, LOCK_FILE)
    self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      holder = os.pread(self._fd, 64, 0).decode(errors='replace').strip() or 'unknown'
      os.close(self._fd)
      raise OutputDirectoryBusy(
          f'{directory} is being written by another run (pid {holder}); wait for it to '
          'finish or give this run another output_dir') from None
    os.ftruncate(self._fd, 0)
    os.pwrite(self._fd, str(os.getpid()).encode(), 0)

  def release(self):
    if self._fd is not None:
      fcntl.flock(self._fd, fcntl.LOCK_UN)
      os.close(self._fd)
      self._fd = None


def _stored_fingerprints(directory: str) -> dict[str, str | None]:
  """{file: fingerprint} of the first record of each *.jsonl file in the directory
  (None for records written without one). One set of settings writes a file whole."""
  found = {}
  for name in sorted(os.listdir(directory)):
    if not name.endswith('.jsonl'):
      continue
    with open(os.path.join(directory, name), 'rb') as f:
      line = f.readline()
    if not line.endswith(b'\n'):  # Empty, or only a torn line: nothing was finished.
      continue
    try:
      found[name] = json.loads(line).get('fingerprint')
    except (json.JSONDecodeError, AttributeError):
      found[name] = None
  return found


def check_directory_settings(directory: str, settings: dict):
  """Raises SettingsChanged, naming the settings that differ, when the directory holds
  settings or records other than `settings`'; passes for a new or empty directory."""
  fingerprint = settings_fingerprint(settings)
  path = os.path.join(directory, SETTINGS_FILE)
  if os.path.exists(path):
    with open(path, encoding='utf-8') as f:
      stored = json.load(f)
    if stored.get('fingerprint') != fingerprint:
      differing = settings_differences(stored.get('settings', {}), settings)
      raise SettingsChanged(
          f'{directory} holds records written with other settings: '
          f'{", ".join(differing) or "(unknown)"} differ (stored in {path}). Use another '
          "output_dir, or on_settings_change='new_dir' to write into a fresh directory")
  stale = {name: fp for name, fp in _stored_fingerprints(directory).items()
           if fp != fingerprint}
  if stale:
    name, stored_fingerprint = next(iter(stale.items()))
    reason = ('without a settings fingerprint (written by an older jaxspec)'
              if stored_fingerprint is None else
              f'with settings fingerprint {stored_fingerprint}, not {fingerprint}')
    raise SettingsChanged(
        f'{directory}/{name} holds records written {reason}, and {SETTINGS_FILE} does not '
        "say which settings they came from. Use another output_dir, or "
        "on_settings_change='new_dir' to write into a fresh directory")


def claim_output_dir(output_dir: str, settings: dict,
                     on_settings_change: str = 'error') -> tuple[str, DirectoryLock]:
  """Locks the output directory for this run and checks it holds only records of
  `settings`; returns (the directory written, its lock; release it at the end).

  on_settings_change 'error' raises SettingsChanged naming what differs; 'new_dir'
  writes into the sibling <output_dir>-<fingerprint> instead (resumed the same way when
  run again). A directory locked by a live process raises OutputDirectoryBusy.
  """
  if on_settings_change not in SETTINGS_CHANGE_ACTIONS:
    raise errors.InvalidSetting(f'on_settings_change must be one of {SETTINGS_CHANGE_ACTIONS}, '
                                f'got {on_settings_change!r}')
  os.makedirs(output_dir, exist_ok=True)
  lock = DirectoryLock(output_dir)
  try:
    check_directory_settings(output_dir, settings)
  except SettingsChanged:
    lock.release()
    if on_settings_change == 'error':
      raise
    fresh = f'{output_dir.rstrip(os.sep)}-{settings_fingerprint(settings)}'
    return claim_output_dir(fresh, settings, 'error')
  except BaseException:
    lock.release()
    raise
  path = os.path.join(output_dir, SETTINGS_FILE)
  if not os.path.exists(path):
    write_text_atomic(path, json.dumps(
        {'fingerprint': settings_fingerprint(settings), 'settings': settings}, indent=2))
  return output_dir, lock


# Users' own text: one input a line, or JSON lines with a field.

STDIN = '-'


class TextInput(NamedTuple):
  line: int  # 1-based line number in the file
  text: str


def read_text_inputs(data: bytes, source: str, field: str | None = None
                     ) -> tuple[list[TextInput], list[int]]:
  """(inputs, numbers of the empty lines) from a file's bytes: one input a line, or,
  with `field`, JSON lines whose `field` holds the input. Empty and whitespace-only
  inputs are returned as skipped lines, not inputs. Bad UTF-8, bad JSON or a missing
  field raise jaxspec.errors.InvalidSetting (a ValueError) naming the source and line."""
  inputs, empty = [], []
  for number, raw in enumerate(data.splitlines(), 1):
    try:
      line = raw.decode('utf-8')
    except UnicodeDecodeError as error:
      raise errors.InvalidSetting(
          f'{source}, line {number}: not valid UTF-8 (byte 0x{raw[error.start]:02x} at '
          f'column {error.start + 1})') from None
    text = line if field is None else _json_field(line, field, source, number)
    if text.strip():
      inputs.append(TextInput(number, text))
    else:
      empty.append(number)
  return inputs, empty


def _json_field(line: str, field: str, source: str, number: int) -> str:
  if not line.strip():
    return ''
  try:
    record = json.loads(line)
  except json.JSONDecodeError as error:
    raise errors.InvalidSetting(f'{source}, line {number}: not a JSON record ({error})') from None
  if not isinstance(record, dict) or field not in record:
    keys = sorted(record) if isinstance(record, dict) else type(record).__name__
    raise errors.InvalidSetting(f'{source}, line {number}: no field {field!r} (has {keys})')
  if not isinstance(record[field], str):
    raise errors.InvalidSetting(f'{source}, line {number}: field {field!r} holds '
                                f'{type(record[field]).__name__}, not text')
  return record[field]


def read_input_bytes(path: str) -> bytes:
  """The bytes of `path`, or of standard input for '-'."""
  if path == STDIN:
    return sys.stdin.buffer.read()
  with open(path, 'rb') as f:
    return f.read()
