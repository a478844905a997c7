"""Checks of caller input, run before tracing so errors name the problem.

Inside jit nothing can raise on values, so the public decoders check their concrete
inputs here first; traced inputs (a caller's own jit) skip the value checks. After
the call they report the rows whose logits were non-finite (flagged inside the jit).
Also here: settings checked by type and range (the launcher checks all of them before
loading anything), the API inputs callers commonly pass converted (Python lists of
ids, a parameter tree without its {'params': ...} wrapper, an integer seed), and an
estimate of a decode's memory, refused before compiling when it cannot fit.
"""

from __future__ import annotations

import math
import numbers
import warnings
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.config import T5Config
from jaxspec.errors import InvalidSetting

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
    raise InvalidSetting(f'encoder_tokens must be [batch, length], got shape {shape}')
  if shape[0] == 0 or shape[1] == 0:
    raise InvalidSetting(f'encoder_tokens is empty: shape {shape}')
  dtype = np.dtype(encoder_tokens.dtype if hasattr(encoder_tokens, 'dtype')
                   else np.asarray(encoder_tokens).dtype)
  if not np.issubdtype(dtype, np.integer):
    raise InvalidSetting(f'encoder_tokens must be integer token ids, got dtype {dtype}')
  if not is_concrete(encoder_tokens):
    return
  tokens = np.asarray(encoder_tokens)
  empty_rows = np.flatnonzero(~np.any(tokens != 0, axis=1))
  if empty_rows.size:
    raise InvalidSetting(f'encoder_tokens rows {empty_rows[:10].tolist()} are empty (all padding)')
  bad = np.argwhere((tokens < 0) | (tokens >= vocab_size))
  if bad.size:
    row, column = bad[0]
    raise InvalidSetting(f'token id {tokens[row, column]} at row {row}, position {column} is '
                         f'outside the vocabulary [0, {vocab_size})')
  if max_input_length is not None:
    lengths = np.sum(tokens != 0, axis=1)
    if lengths.max() > max_input_length:
      row = int(lengths.argmax())
      raise InvalidSetting(f'row {row} has {lengths[row]} input tokens, more than the '
                           f'configured maximum of {max_input_length}')


def check_max_decode_length(max_decode_length: int):
  if int(max_decode_length) < 1:
    raise InvalidSetting(f'max_decode_length must be >= 1, got {max_decode_length}')


AUTO_GAMMA = 'auto'  # a config's gamma chosen by measurement (jaxspec.decoding.auto_gamma)


def check_gamma_setting(name: str, gamma):
  """A config's gamma field: an integer >= 1, or 'auto'; name says which field."""
  if gamma == AUTO_GAMMA:
    return
  if isinstance(gamma, bool) or not isinstance(gamma, int):
    raise InvalidSetting(f"gamma ({name}) must be an integer, got {gamma!r} (or "
                         f"'{AUTO_GAMMA}': chosen by measurement)")
  if gamma < 1:
    raise InvalidSetting(f'gamma must be >= 1, got {gamma}')


def check_gamma(gamma: int, max_decode_length: int):
  """A proposal must fit the output: one target call commits up to gamma + 1 tokens."""
  if gamma >= max_decode_length:
    raise InvalidSetting(
        f'gamma {gamma} is larger than the decode buffer allows: a target call commits up '
        f'to gamma + 1 tokens and max_decode_length is {max_decode_length}, so use '
        f'gamma <= {max_decode_length - 1}')


def check_decode_positions(config, widest_step: int, num_drafts: int = 1):
  """The target's fixed-width steps (T5Config.decode_positions) must cover its widest
  verify step, or that step would round differently from the baseline's."""
  width = config.decode_positions
  if not width:
    return
  if num_drafts > 1:
    raise InvalidSetting(f'T5Config.decode_positions ({width}) fixes the width of sequence '
                         f'steps; a token tree of num_drafts={num_drafts} branches is not padded '
                         'to it: use decode_positions=0 or num_drafts=1')
  if widest_step > width:
    raise InvalidSetting(f'T5Config.decode_positions ({width}) is narrower than the target\'s '
                         f'verify step of {widest_step} positions (gamma + 1), whose rows would '
                         f'then round unlike the baseline\'s steps: set it to at least '
                         f'{widest_step}, or gamma to at most {width - 1}')


def check_nonfinite_action(action: str):
  if action not in NONFINITE_ACTIONS:
    raise InvalidSetting(f'on_nonfinite must be one of {NONFINITE_ACTIONS}, got {action!r}')


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


# Settings: types and ranges, checked before anything is loaded or traced.


def check_integer(name: str, value, minimum: int | None = None, maximum: int | None = None):
  """Raises ValueError unless value is an integer (bool refused) in [minimum, maximum]."""
  if isinstance(value, bool) or not isinstance(value, numbers.Integral):
    raise InvalidSetting(f'{name} must be an integer, got {value!r} ({type(value).__name__})')
  if minimum is not None and value < minimum:
    raise InvalidSetting(f'{name} must be >= {minimum}, got {value}')
  if maximum is not None and value > maximum:
    raise InvalidSetting(f'{name} must be <= {maximum}, got {value}')


def check_real(name: str, value, minimum: float | None = None, maximum: float | None = None,
               *, open_minimum: bool = False):
  """Raises ValueError unless value is a finite real number within the bounds."""
  if isinstance(value, bool) or not isinstance(value, numbers.Real):
    raise InvalidSetting(f'{name} must be a number, got {value!r} ({type(value).__name__})')
  if not math.isfinite(value):
    raise InvalidSetting(f'{name} must be finite, got {value}')
  if minimum is not None and (value <= minimum if open_minimum else value < minimum):
    bound = f'> {minimum}' if open_minimum else f'>= {minimum}'
    raise InvalidSetting(f'{name} must be {bound}, got {value}')
  if maximum is not None and value > maximum:
    raise InvalidSetting(f'{name} must be <= {maximum}, got {value}')


def check_sampling_values(temperature, top_k, top_p):
  """Temperature finite and >= 0 (inf would sample uniformly), top_k an integer >= 0
  (0 keeps all tokens), top_p in (0, 1] (1 keeps all tokens)."""
  check_real('temperature', temperature, 0.0)
  check_integer('top_k', top_k, 0)
  check_real('top_p', top_p, 0.0, 1.0, open_minimum=True)


# API inputs: what callers commonly pass, converted or refused by name.

# Top-level names of a T5 parameter tree (jaxspec.model.T5, T5X's layout).
_MODEL_TREE_KEYS = frozenset({'token_embedder', 'encoder', 'decoder'})


def model_variables(params, name: str = 'params'):
  """{'params': tree} as Flax's apply takes it: a bare T5 tree (with 'encoder',
  'decoder', 'token_embedder') is wrapped; anything else without 'params' is refused."""
  if not isinstance(params, Mapping):
    raise InvalidSetting(f"{name} must be a dict {{'params': tree}}, got {type(params).__name__}")
  if 'params' in params:
    return params
  if _MODEL_TREE_KEYS <= set(params) or {'encoder', 'decoder'} <= set(params):
    return {'params': params}
  raise InvalidSetting(f"{name} must be {{'params': tree}} (the variables of a jaxspec T5, e.g. "
                       f'from jaxspec.inference.load_model_params); got a dict with keys '
                       f'{sorted(map(str, params))[:8]}')


def token_array(encoder_tokens, name: str = 'encoder_tokens'):
  """Token ids as an array: nested Python lists become int32 [batch, length]; ragged rows
  are refused (pad them with 0). Arrays, traced values included, pass unchanged."""
  if hasattr(encoder_tokens, 'shape') and hasattr(encoder_tokens, 'dtype'):
    return encoder_tokens
  try:
    array = np.asarray(encoder_tokens)
  except ValueError as error:  # NumPy refuses ragged nested lists.
    raise InvalidSetting(f'{name} rows have different lengths; pad them with 0 to one length '
                         f'([batch, length])') from error
  if array.dtype == object:
    raise InvalidSetting(f'{name} rows have different lengths or non-integer entries; pad '
                         'them with 0 to one length ([batch, length] integer ids)')
  if array.size and not np.issubdtype(array.dtype, np.integer):
    return array  # check_encoder_tokens names the dtype.
  return jnp.asarray(array, jnp.int32)


def prng_key(rng, name: str = 'rng'):
  """None, a PRNG key or per-row keys pass unchanged; a Python int seeds PRNGKey."""
  if isinstance(rng, bool):
    raise InvalidSetting(f'{name} must be a PRNG key or an integer seed, got {rng!r}')
  if isinstance(rng, numbers.Integral):
    return jax.random.PRNGKey(int(rng))
  return rng


def decoder_inputs(params, encoder_tokens, rng):
  """(variables, tokens, rng) converted as `model_variables`, `token_array` and
  `prng_key` do: what every public decoder accepts."""
  return model_variables(params), token_array(encoder_tokens), prng_key(rng)


# Memory: a decode that cannot fit is refused before it is compiled.

_FLOAT32_BYTES = 4


def decode_memory_bytes(config, *, batch: int, input_length: int, max_decode_length: int,
                        gamma: int = 0, draft_config=None) -> int:
  """Estimated peak bytes of one decode call's caches and largest activations (without
  the parameters): the step that scores gamma + 1 positions (1 for the baseline)
  against a cache of max_decode_length + gamma slots dominates for large gamma.

  config, draft_config: T5Configs (the draft's only for a T5 draft model).
  """
  window = gamma + 1  # Positions scored by one target step.
  cache_length = max_decode_length + gamma

  def model_bytes(model, positions):
    dtype_bytes = np.dtype(model.dtype).itemsize
    heads = model.num_heads
    # Self and cross K/V, twice: the loop reads one cache and writes the next.
    caches = (2 * 2 * model.num_decoder_layers * batch * (cache_length + input_length)
              * heads * model.head_dim * dtype_bytes)
    # The self-attention bias [b, h, t, L] lives across the layers; each layer adds
    # scores and softmax weights of the same shape (XLA fuses the rest).
    self_attention = 3 * batch * heads * positions * cache_length * _FLOAT32_BYTES
    cross_attention = 3 * batch * heads * positions * input_length * _FLOAT32_BYTES
    encoder = 4 * batch * heads * input_length * input_length * _FLOAT32_BYTES
    # Logits, the standardized p and the recorded q [b, t, v], float32.
    logits = 3 * batch * positions * model.vocab_size * _FLOAT32_BYTES
    return caches + max(self_attention + cross_attention + logits, encoder)

  total = model_bytes(config, window)
  if draft_config is not None:
    total += model_bytes(draft_config, 2)  # The drafter steps one or two positions.
  return total


def available_memory_bytes(devices=None) -> int | None:
  """Bytes free for a computation on `devices` (default: the first device): the
  accelerator's limit minus what is in use, or the host's MemAvailable on CPU (CPU
  devices share it). None where the platform does not say."""
  devices = list(devices) if devices is not None else jax.devices()[:1]
  if devices and devices[0].platform == 'cpu':
    return _host_available_bytes()
  total = 0
  for device in devices:
    stats = device.memory_stats() if hasattr(device, 'memory_stats') else None
    if not stats or 'bytes_limit' not in stats:
      return None
    total += stats['bytes_limit'] - stats.get('bytes_in_use', 0)
  return total


def _host_available_bytes() -> int | None:
  try:
    with open('/proc/meminfo') as f:
      for line in f:
        if line.startswith('MemAvailable:'):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return None


def check_decode_memory(needed_bytes: int, available_bytes: int | None, what: str):
  """Raises ValueError when the estimate exceeds what is available (None: unknown)."""
  if available_bytes is None or needed_bytes <= available_bytes:
    return
  raise InvalidSetting(
      f'{what} needs about {needed_bytes / 2**30:.1f} GiB for its caches and attention '
      f'scores, more than the {available_bytes / 2**30:.1f} GiB available; lower gamma, '
      'max_decode_length or the batch size')


def check_decoder_memory(encoder_tokens, *, config, max_decode_length: int, gamma: int = 0,
                         draft_config=None, available_bytes: int | None = None):
  """check_decode_memory for a decoder call on concrete encoder_tokens [b, s]."""
  if not is_concrete(encoder_tokens):
    return  # Traced or spread over hosts: the caller placed it and knows its sizes.
  batch, input_length = np.shape(encoder_tokens)
  if not isinstance(draft_config, T5Config):
    draft_config = None  # A drafter without a T5 draft model adds little.
  devices = getattr(encoder_tokens, 'devices', lambda: None)()
  if available_bytes is None:
    available_bytes = available_memory_bytes(devices)
  needed = decode_memory_bytes(config, batch=batch, input_length=input_length,
                               max_decode_length=max_decode_length, gamma=gamma,
                               draft_config=draft_config)
  what = (f'decoding a batch of {batch} with gamma {gamma} and max_decode_length '
          f'{max_decode_length}' if gamma else
          f'decoding a batch of {batch} with max_decode_length {max_decode_length}')
  check_decode_memory(needed, available_bytes, what)


def drafter_variables(drafter_params):
  """A drafter's params: a bare T5 tree (a T5 draft's parameters without the
  {'params': ...} wrapper) is wrapped; anything else (n-gram tables, ()) passes."""
  if (isinstance(drafter_params, Mapping) and 'params' not in drafter_params
      and {'encoder', 'decoder'} <= set(drafter_params)):
    return {'params': drafter_params}
  return drafter_params


def decoder_call(params, encoder_tokens, rng, sampling):
  """What every public decoder does first: converts the API inputs as
  `decoder_inputs` does and checks the sampling values (a temperature of inf would
  sample uniformly without a word). Returns (variables, tokens, rng)."""
  check_sampling_values(sampling.temperature, sampling.top_k, sampling.top_p)
  return decoder_inputs(params, encoder_tokens, rng)
