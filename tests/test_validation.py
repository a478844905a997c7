"""Bad input is refused before tracing, with an error naming the problem."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import UnigramDrafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.validation import check_encoder_tokens, report_nonfinite_rows

CONFIG = get_config('test_tiny_1_1')


@pytest.mark.parametrize('tokens, message', [
    (np.zeros((0, 4), np.int32), 'empty'),
    (np.zeros((2, 0), np.int32), 'empty'),
    (np.array([5, 1], np.int32), r'\[batch, length\]'),
    (np.array([[5.0, 1.0]]), 'integer'),
    (np.array([[5, 1], [0, 0]], np.int32), r'rows \[1\] are empty'),
    (np.array([[5, 64]], np.int32), 'token id 64 at row 0, position 1 is outside the vocabulary'),
    (np.array([[-3, 1]], np.int32), 'token id -3'),
])
def test_bad_encoder_tokens_are_named(tokens, message):
  with pytest.raises(ValueError, match=message):
    check_encoder_tokens(tokens, CONFIG.vocab_size)


def test_over_long_inputs_are_refused():
  tokens = np.array([[5, 6, 7, 1], [5, 1, 0, 0]], np.int32)
  check_encoder_tokens(tokens, CONFIG.vocab_size, max_input_length=4)
  with pytest.raises(ValueError, match='row 0 has 4 input tokens, more than the configured '
                     'maximum of 3'):
    check_encoder_tokens(tokens, CONFIG.vocab_size, max_input_length=3)


def test_decoders_validate_before_tracing():
  params = {'params': {}}  # Never reached: validation fails first.
  empty_row = jnp.array([[5, 1], [0, 0]], jnp.int32)
  with pytest.raises(ValueError, match='empty'):
    generate(params, empty_row, config=CONFIG, max_decode_length=4)
  with pytest.raises(ValueError, match='max_decode_length must be >= 1'):
    generate(params, empty_row[:1], config=CONFIG, max_decode_length=0)
  with pytest.raises(ValueError, match='empty'):
    speculative_generate(params, None, empty_row, target_config=CONFIG,
                         drafter=UnigramDrafter(CONFIG.vocab_size),
                         spec=SpeculativeConfig(gamma=2), max_decode_length=4)
  with pytest.raises(ValueError, match='vocab'):
    speculative_generate(params, None, empty_row[:1], target_config=CONFIG,
                         drafter=UnigramDrafter(CONFIG.vocab_size + 1),
                         spec=SpeculativeConfig(gamma=2), max_decode_length=4)


def test_nonfinite_rows_are_named_and_counted():
  flags = np.zeros(30, bool)
  flags[[2, 5] + list(range(12, 24))] = True
  with pytest.raises(FloatingPointError,
                     match=r'rows \[2, 5, 12, 13, 14, 15, 16, 17, 18, 19\] and 4 more of 30'):
    report_nonfinite_rows(flags, 'raise')
  with pytest.warns(RuntimeWarning, match=r'rows \[2, 5,'):
    report_nonfinite_rows(flags, 'warn')
  report_nonfinite_rows(flags, 'ignore')
  report_nonfinite_rows(np.zeros(3, bool), 'raise')  # Nothing to report.
