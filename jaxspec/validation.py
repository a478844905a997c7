"""Checks of caller input, run before tracing so errors name the problem.

Inside jit nothing can raise on values, so the public decoders check their concrete
inputs here first; traced inputs (a caller's own jit) skip the value checks. After
the call they report the rows whose logits were non-finite (flagged inside the jit).
"""

from __future__ import annotations

import warnings

import jax
import numpy as np

# What a decoder does after a call in which some rows saw non-finite logits.
NONFINITE_ACTIONS = ('raise', 'warn', 'ignore')


def is_concrete(array) -> bool:
  """Whether this process can read the values (not traced, not spread over hosts)."""
  return (not isinstance(array, jax.core.Tracer)
          and getattr(array, 'is_fully_addressable', True))


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


def check_gamma(gamma: int, max_decode_length: int):
  """gamma drafts must fit the output: at most max_decode_length - 1 follow the first token."""
  if gamma >= max_decode_length:
    raise ValueError(
        f'gamma {gamma} is larger than the decode buffer allows: with max_decode_length '
        f'{max_decode_length} at most {max_decode_length - 1} tokens follow the first one, '
        'so use gamma <= max_decode_length - 1')


def check_nonfinite_action(action: str):
  if action not in NONFINITE_ACTIONS:
    raise ValueError(f'on_nonfinite must be one of {NONFINITE_ACTIONS}, got {action!r}')


def report_nonfinite_rows(nonfinite_rows, action: str):
  """After a decode: raises FloatingPointError (action 'raise') or warns ('warn') naming
  the rows whose logits were non-finite (NaN, +inf, or no finite logit).

  nonfinite_rows [b] bool, the decoder's per-row flag. The decoders stop such a row at
  that step and emit 0 from there, so nothing is sampled from a broken distribution.
  Reading the flag waits for the decode; 'ignore' and traced flags skip the check.
  """
  if action == 'ignore' or not is_concrete(nonfinite_rows):
    return
  rows = np.flatnonzero(np.asarray(nonfinite_rows))
  if not rows.size:
    return
  more = f' and {rows.size - 10} more' if rows.size > 10 else ''
  message = (f'non-finite logits (NaN or +inf) in rows {rows[:10].tolist()}{more} of '
             f'{np.size(nonfinite_rows)}: those rows were stopped at that step and hold 0 '
             'from there. Check the parameters (a NaN from training or a corrupt '
             'checkpoint) and the compute dtype (overflow in float16/bfloat16).')
  if action == 'raise':
    raise FloatingPointError(message)
  warnings.warn(message, RuntimeWarning, stacklevel=3)
