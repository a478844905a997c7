"""T5X's own decoding tests (t5x/decoding_test.py, from the installed t5x), unmodified,
run against jaxspec's re-implementations.

The test module is loaded from t5x's source as a module of its own, and its `decoding`
global (T5X's `from t5x import decoding`) is replaced by a namespace in which the names
jaxspec re-implements are jaxspec's (JAXSPEC_NAMES: `temperature_sample`, the loop it
calls, `cache_map`, the loop states, `beam_search`); every other name is T5X's. A test's
mock.patch.object(decoding, name) lands on the module that owns the name, so T5X's mocks of
`_temperature_sample_single_trial` and `cache_map` replace jaxspec's (which jaxspec's
`temperature_sample` looks up when called, as T5X's does), and its mocks of
`jax.random.categorical` reach jaxspec's single-key draws. While a test runs, T5X's own
versions of those names raise, so no test passes on T5X's code by mistake.

Each of T5X's tests is one pytest case here. KNOWN_DIFFERENCES lists those that fail
against jaxspec and why (pinned: such a test must still fail, with that error). The
tests of T5X helpers jaxspec does not re-implement (add_beam_dim, flat_batch_beam_expand,
top_k_two_stage, the prompt aligners) run on T5X's code, as T5X runs them.

Skipped, saying so, only where t5x is not installed (CI installs it).
"""

import importlib.util
import os
import types
import unittest
from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

try:
  from t5x import decoding as t5x_decoding
except ImportError as error:  # pragma: no cover - CI installs t5x
  pytest.skip(f't5x is not importable ({error}), so T5X\'s own decoding tests cannot run '
              f'against jaxspec here: install it with `bash ../shared/vendor/install-t5x.sh` '
              f'(CI does)', allow_module_level=True)

from jaxspec.decoding import baseline, beam_search  # noqa: E402

# T5X's decoding names that jaxspec re-implements, and the jaxspec module holding each.
JAXSPEC_NAMES = {
    'temperature_sample': baseline,
    '_temperature_sample_single_trial': baseline,
    'cache_map': baseline,
    'DecodingState': baseline,
    'SamplingLoopState': baseline,
    'beam_search': beam_search,
}

# T5X test -> (text its failure must contain, why it fails against jaxspec).
KNOWN_DIFFERENCES = {
    'test_beam_search_force_decode_prefix_with_initial_index': (
        "unexpected keyword argument 'initial_index'",
        'jaxspec.decoding.beam_search.beam_search has no initial_index (a decoder prompt '
        'prefilled into the cache); jaxspec passes prompts as forced inputs'),
    'test_beam_search_force_decode_prefix_with_initial_index_max_decode_step': (
        "unexpected keyword argument 'initial_index'",
        'as above: no initial_index in jaxspec\'s beam_search'),
}

T5X_TEST_FILE = os.path.join(os.path.dirname(t5x_decoding.__file__), 'decoding_test.py')


class _DecodingOnJaxspec(types.ModuleType):
  """t5x.decoding's namespace with JAXSPEC_NAMES taken from jaxspec. Reads, writes and
  deletes go to the module owning the name, so mock.patch.object(decoding, name) patches
  jaxspec's module for jaxspec's names (and T5X's for the rest) and restores it."""

  def __getattr__(self, name):
    return getattr(JAXSPEC_NAMES.get(name, t5x_decoding), name)

  def __setattr__(self, name, value):
    setattr(JAXSPEC_NAMES.get(name, t5x_decoding), name, value)

  def __delattr__(self, name):
    delattr(JAXSPEC_NAMES.get(name, t5x_decoding), name)


def _load_t5x_tests():
  """{test name: unittest case} from T5X's decoding_test.py, wired to jaxspec."""
  spec = importlib.util.spec_from_file_location('t5x_decoding_test_on_jaxspec', T5X_TEST_FILE)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  module.decoding = _DecodingOnJaxspec('decoding')

  def flatten(suite):
    for item in suite:
      if isinstance(item, unittest.TestSuite):
        yield from flatten(item)
      else:
        yield item

  cases = {}
  for value in vars(module).values():
    if (isinstance(value, type) and issubclass(value, unittest.TestCase)
        and value.__module__ == module.__name__):
      for case in flatten(unittest.defaultTestLoader.loadTestsFromTestCase(value)):
        cases[case.id().split('.', 1)[1]] = case  # 'DecodeTest.test_...'
  return cases


CASES = _load_t5x_tests()


def _t5x_originals_disabled():
  """Context: T5X's own versions of JAXSPEC_NAMES' functions raise when called."""
  return mock.patch.multiple(t5x_decoding, **{
      name: mock.Mock(side_effect=AssertionError(
          f"T5X's {name} was called: the test did not reach jaxspec's"))
      for name in JAXSPEC_NAMES if not isinstance(getattr(t5x_decoding, name), type)})


def _run(case):
  result = unittest.TestResult()
  with _t5x_originals_disabled():
    case.run(result)
  problems = [text for _, text in result.errors + result.failures]
  problems += [f'unexpected success of {case.id()}' for _ in result.unexpectedSuccesses]
  return result, problems


def test_the_suite_is_t5x_and_routes_to_jaxspec():
  assert len(CASES) >= 30, sorted(CASES)  # t5x at the vendored commit: 35 cases
  namespace = _DecodingOnJaxspec('decoding')
  assert namespace.temperature_sample is baseline.temperature_sample
  assert namespace.beam_search is beam_search.beam_search
  assert namespace.flatten_beam_dim is t5x_decoding.flatten_beam_dim
  assert set(KNOWN_DIFFERENCES) <= {name.split('.')[-1] for name in CASES}


@pytest.mark.parametrize('name', sorted(CASES))
def test_t5x_decoding_test(name):
  result, problems = _run(CASES[name])
  known = KNOWN_DIFFERENCES.get(name.split('.')[-1])
  if known is not None:
    expected_text, why = known
    assert problems, f'{name} now passes against jaxspec: drop it from KNOWN_DIFFERENCES'
    assert any(expected_text in text for text in problems), (
        f'{name} fails otherwise than recorded ({why}):\n' + '\n'.join(problems))
    return
  if result.skipped and not problems:
    pytest.skip('; '.join(reason for _, reason in result.skipped))
  assert not problems, f'T5X\'s {name} fails against jaxspec:\n' + '\n'.join(problems)


@pytest.mark.parametrize('temperature', [0.9, np.array([0.9, 0.0, 1.3])], ids=['one', 'per_row'])
def test_one_key_draws_mocked_or_not_are_t5xs(temperature):
  # Unmocked, jaxspec draws jax.random.categorical's values through jaxspec.prng; under a
  # mock that wraps jax.random.categorical it calls it, as T5X does: the same tokens.
  logits = jax.random.normal(jax.random.PRNGKey(1), (6, 50)) * 3

  def tokens_to_logits(state):
    return logits + 0.1 * state.cur_token, state.cache

  def sample(module):
    return module.temperature_sample(np.zeros((3, 12), np.int32), {}, tokens_to_logits, 1,
                                     jax.random.PRNGKey(7), num_decodes=2,
                                     temperature=temperature, topk=0)

  plain = sample(baseline)
  with mock.patch.object(jax.random, 'categorical', wraps=jax.random.categorical) as wrapped:
    mocked = sample(baseline)
  assert wrapped.called
  t5x = sample(t5x_decoding)
  for a, b in ((plain, mocked), (plain, t5x)):
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_allclose(a[1], b[1], rtol=1e-6, atol=1e-6)
  assert int(jnp.sum(plain[0] > 1)) > 0  # something was sampled
