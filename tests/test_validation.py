"""Bad input is refused before tracing, with an error naming the problem; what
callers commonly pass (lists, bare params, an int seed) decodes as its conversion;
the memory estimate follows XLA's buffer assignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config, validation
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter, UnigramDrafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.sampling import SamplingConfig
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


# API inputs: converted as callers commonly pass them, or refused by name.

def test_lists_bare_params_and_int_seeds_decode_as_arrays_wrapped_params_and_keys():
  from jaxspec.model import init_params
  # Wrapped as {'params': tree} (without init's params_axes): the same program as bare.
  variables = {'params': init_params(CONFIG, jax.random.PRNGKey(0))['params']}
  tokens = np.array([[5, 6, 7, 1], [9, 1, 0, 0]], np.int32)
  sampling = SamplingConfig(temperature=1.0)
  expected = generate(variables, tokens, jax.random.PRNGKey(3), config=CONFIG,
                      max_decode_length=6, sampling=sampling)
  as_python = generate(variables['params'], tokens.tolist(), 3, config=CONFIG,
                       max_decode_length=6, sampling=sampling)
  np.testing.assert_array_equal(as_python.tokens, expected.tokens)
  draft = get_config('test_tiny_1_0')
  draft_variables = {'params': init_params(draft, jax.random.PRNGKey(1))['params']}
  options = dict(target_config=CONFIG, drafter=T5Drafter(draft),
                 spec=SpeculativeConfig(gamma=2), max_decode_length=6, sampling=sampling)
  expected = speculative_generate(variables, draft_variables, tokens, jax.random.PRNGKey(3),
                                  **options)
  as_python = speculative_generate(variables['params'], draft_variables['params'],
                                   tokens.tolist(), 3, **options)
  np.testing.assert_array_equal(as_python.output.tokens, expected.output.tokens)


@pytest.mark.parametrize('params, tokens, sampling, message', [
    ({'encoder_layers': {}}, [[5, 1]], SamplingConfig(),
     r"params must be \{'params': tree\} .* got a dict with keys \['encoder_layers'\]"),
    ({'params': {}}, [[5, 6, 1], [5, 1]], SamplingConfig(), 'rows have different lengths'),
    ({'params': {}}, [[5, 1]], SamplingConfig(temperature=float('inf')),
     'temperature must be finite, got inf'),
])
def test_bad_api_inputs_are_named_before_tracing(params, tokens, sampling, message):
  with pytest.raises(ValueError, match=message):
    generate(params, tokens, config=CONFIG, max_decode_length=4, sampling=sampling)


@pytest.mark.parametrize('name, value, message', [
    ('gamma', 2.5, r'gamma must be an integer, got 2.5 \(float\)'),
    ('gamma', True, r'gamma must be an integer, got True'),
    ('gamma', 0, r'gamma must be >= 1, got 0'),
])
def test_integer_settings_are_checked_by_type_and_range(name, value, message):
  with pytest.raises(ValueError, match=message):
    validation.check_integer(name, value, 1)
  validation.check_integer(name, np.int64(3), 1)


# Memory: the estimate against XLA's own buffer assignment, and a refusal in seconds.

@pytest.mark.parametrize('max_decode_length, gamma', [(400, 0), (1000, 600)])
def test_memory_estimate_is_within_2x_of_xla_buffer_assignment(max_decode_length, gamma):
  from jaxspec.decoding import baseline, speculative
  from jaxspec.model import abstract_params
  draft = get_config('test_tiny_1_0')
  params = {'params': abstract_params(CONFIG)['params']}
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  key = jax.random.PRNGKey(0)
  if gamma:
    lowered = speculative._speculative_generate.lower(
        params, {'params': abstract_params(draft)['params']}, tokens, key,
        target_config=CONFIG, drafter=T5Drafter(draft), spec=SpeculativeConfig(gamma=gamma),
        max_decode_length=max_decode_length, sampling=SamplingConfig(), eos_id=1)
  else:
    lowered = baseline._generate.lower(
        params, tokens, key, config=CONFIG, max_decode_length=max_decode_length,
        sampling=SamplingConfig(), eos_id=1, rescale_log_probs=True)
  analysis = lowered.compile().memory_analysis()
  xla_bytes = analysis.temp_size_in_bytes + analysis.output_size_in_bytes
  estimate = validation.decode_memory_bytes(
      CONFIG, batch=2, input_length=16, max_decode_length=max_decode_length, gamma=gamma,
      draft_config=draft if gamma else None)
  assert 0.5 <= estimate / xla_bytes <= 2.0, (estimate, xla_bytes)


def test_a_decode_that_cannot_fit_is_refused_before_compiling(monkeypatch):
  # The API run: gamma 10000, max_decode_length 20000 on the local target ran
  # minutes into an out-of-memory kill; the verify step alone needs ~15 GB.
  monkeypatch.setattr(validation, 'available_memory_bytes', lambda devices=None: 8 << 30)
  target = get_config('local_target')
  with pytest.raises(ValueError, match=r'decoding a batch of 1 with gamma 10000 and '
                     r'max_decode_length 20000 needs about 1\d\.\d GiB .* more than the '
                     r'8\.0 GiB available'):
    speculative_generate({'params': {}}, None, np.array([[5, 1]], np.int32),
                         target_config=target, drafter=UnigramDrafter(target.vocab_size),
                         spec=SpeculativeConfig(gamma=10000), max_decode_length=20000)
  validation.check_decoder_memory(np.array([[5, 1]], np.int32), config=target,
                                  max_decode_length=64, gamma=3)  # The main job fits.
