"""Run-level pieces: loading models, decoding a list of examples, resumable JSONL.

Used by scripts/infer.py; nothing here parses flags or gin.
"""

from __future__ import annotations

import json
import os
import time
from typing import Callable, Iterable, Sequence

import jax
import numpy as np

from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.config import T5Config
from jaxspec.data import corpora


def load_model_params(checkpoint: str, config: T5Config):
  """Variables {'params': ...} from a T5X checkpoint, in config.param_dtype, on device."""
  params = t5x_checkpoints.load_t5x_checkpoint(checkpoint, config, dtype=config.param_dtype)
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
  raises ValueError naming them. The caller reports what was truncated.
  """
  if overlong not in OVERLONG_ACTIONS:
    raise ValueError(f'overlong must be one of {OVERLONG_ACTIONS}, got {overlong!r}')
  too_long = [i for i, row in enumerate(rows) if len(row) + 1 > length]
  if too_long and overlong == 'error':
    raise ValueError(
        f'{len(too_long)} of {len(rows)} inputs are longer than the input length {length} '
        f'(with EOS): rows {too_long[:10]}, the first with {len(rows[too_long[0]]) + 1} '
        "tokens; raise the input length or let them be truncated (overlong 'truncate')")
  fitted = [corpora.trim_and_append_eos(list(row), length) for row in rows]
  return pad_rows(fitted, length), too_long


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
        raise ValueError(f'{self.path}, line {number}, is not a JSON record ({error}); '
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
