"""Checks of caller input, run before tracing so errors name the problem.

Inside jit nothing can raise on values, so the public decoders check their concrete
inputs here first; traced inputs (a caller's own jit) skip the value checks.
"""

from __future__ import annotations

import jax
import numpy as np


def is_concrete(array) -> bool:
  return not isinstance(array, jax.core.Tracer)


def check_encoder_tokens(encoder_tokens, vocab_size: int, max_input_length: int | None = None):
  """Raises ValueError for inputs the model cannot decode meaningfully.

  encoder_tokens [b, s] int: 0 is padding. Refused: a wrong rank or dtype, an empty
  batch or length, rows that are all padding, ids outside [0, vocab_size), and more
  than max_input_length tokens in a row.
  """
  shape = np.shape(encoder_tokens)
  if len(shape) != 2:
    raise ValueError(f'encoder_tokens must be [batch, length], got shape {shape}')
  if shape[0] == 0 or shape[1] == 0:
    raise ValueError(f'encoder_tokens is empty: shape {shape}')
  dtype = np.dtype(encoder_tokens.dtype if hasattr(encoder_tokens, 'dtype')
                   else np.asarray(encoder_tokens).dtype)
  if not np.issubdtype(dtype, np.integer):
    raise ValueError(f'encoder_tokens must be integer token ids, got dtype {dtype}')
  if not is_concrete(encoder_tokens):
    return
  tokens = np.asarray(encoder_tokens)
  empty_rows = np.flatnonzero(~np.any(tokens != 0, axis=1))
  if empty_rows.size:
    raise ValueError(f'encoder_tokens rows {empty_rows[:10].tolist()} are empty (all padding)')
  bad = np.argwhere((tokens < 0) | (tokens >= vocab_size))
  if bad.size:
    row, column = bad[0]
    raise ValueError(f'token id {tokens[row, column]} at row {row}, position {column} is '
                     f'outside the vocabulary [0, {vocab_size})')
  if max_input_length is not None:
    lengths = np.sum(tokens != 0, axis=1)
    if lengths.max() > max_input_length:
      row = int(lengths.argmax())
      raise ValueError(f'row {row} has {lengths[row]} input tokens, more than the '
                       f'configured maximum of {max_input_length}')


def check_max_decode_length(max_decode_length: int):
  if int(max_decode_length) < 1:
    raise ValueError(f'max_decode_length must be >= 1, got {max_decode_length}')
