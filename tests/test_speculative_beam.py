"""Speculative beam search against jaxspec's beam search, token for token.

For beam widths w in {1, 2, 4}, draft widths u in {w, 2w} and gamma in {1, 3, 5}, every
pair of values covered (one compile per combination), three drafts run through the same
compiled program: the target itself (most steps accepted), a slightly perturbed target
(a mix of accepted and rejected steps) and an unrelated random model (mostly one step
per call). The output must be generate_beam's: the same sequences in the same order, the
same scores (up to the float rounding of a decode over gamma + 1 positions against a
one-position one), and the same number of search steps.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config
from jaxspec.decoding import beam_search as bs
from jaxspec.decoding import speculative_beam as sb
from jaxspec.model import init_params

MAX_LENGTH = 7
CONFIG = get_config('test_tiny_1_1', vocab_size=16, num_encoder_layers=1,
                    num_decoder_layers=1)
ENCODER_TOKENS = jnp.array([[3, 4, 5, 6, 1, 0], [7, 8, 9, 1, 0, 0], [2, 2, 1, 0, 0, 0]],
                           jnp.int32)


def _scaled(params, scale):
  return jax.tree_util.tree_map(lambda x: x * scale, params)


@pytest.fixture(scope='module')
def models():
  # Scaled up so the tiny model is confident and EOS ends some beams early.
  target = _scaled(init_params(CONFIG, jax.random.PRNGKey(0)), 3.0)
  noise = init_params(CONFIG, jax.random.PRNGKey(1))
  drafts = {
      'target': target,
      'perturbed': jax.tree_util.tree_map(lambda t, n: t + 0.05 * n, target, noise),
      'unrelated': _scaled(init_params(CONFIG, jax.random.PRNGKey(2)), 3.0),
  }
  return target, drafts, {}


def _plain(models, beams):
  target, _, plain = models
  if beams not in plain:
    plain[beams] = bs.generate_beam(target, ENCODER_TOKENS, config=CONFIG,
                                    beam=bs.BeamConfig(num_beams=beams),
                                    max_decode_length=MAX_LENGTH)
  return plain[beams]


# Every pair of values of (beam width, draft width u = w or 2w, gamma) occurs: each
# width with each gamma, each width with both draft widths, each draft width with each
# gamma (9 compiles instead of the 18 of every combination).
COMBINATIONS = [(w, w * ratio, gamma)
                for w, ratios in ((1, (1, 2, 1)), (2, (2, 1, 2)), (4, (1, 2, 1)))
                for ratio, gamma in zip(ratios, (1, 3, 5))]


@pytest.mark.parametrize('beams, draft_beams, gamma', COMBINATIONS)
def test_equals_beam_search_for_every_draft(models, beams, draft_beams, gamma):
  target, drafts, _ = models
  expected = _plain(models, beams)
  assert expected.steps > 2  # The search runs long enough to draft several steps.
  for name, draft in drafts.items():
    result = sb.speculative_beam_generate(
        target, draft, ENCODER_TOKENS, target_config=CONFIG, draft_config=CONFIG,
        beam=bs.BeamConfig(num_beams=beams),
        spec=sb.SpeculativeBeamConfig(gamma=gamma, draft_beams=draft_beams),
        max_decode_length=MAX_LENGTH)
    np.testing.assert_array_equal(result.output.tokens, expected.tokens, err_msg=name)
    np.testing.assert_allclose(result.output.scores, expected.scores, rtol=1e-5, atol=1e-5,
                               err_msg=name)
    stats = result.stats
    assert int(result.output.steps) == int(expected.steps), name
    assert int(stats.steps) == int(expected.steps), name
    assert int(jnp.sum(stats.steps_per_call)) == int(stats.target_calls), name
    assert int(stats.steps_per_call[0]) == 0, name  # Every call advances.
    if name == 'target' and gamma > 1:
      # The draft that is the target has several steps accepted per call.
      assert int(stats.target_calls) < int(expected.steps), name


def test_smaller_draft_model():
  draft_config = get_config('test_tiny_1_0', vocab_size=16, num_encoder_layers=1,
                            num_decoder_layers=1)
  target = _scaled(init_params(CONFIG, jax.random.PRNGKey(0)), 3.0)
  draft = init_params(draft_config, jax.random.PRNGKey(5))
  beam = bs.BeamConfig(num_beams=2, alpha=1.0)
  expected = bs.generate_beam(target, ENCODER_TOKENS, config=CONFIG, beam=beam,
                              max_decode_length=MAX_LENGTH)
  result = sb.speculative_beam_generate(
      target, draft, ENCODER_TOKENS, target_config=CONFIG, draft_config=draft_config,
      beam=beam, spec=sb.SpeculativeBeamConfig(gamma=2), max_decode_length=MAX_LENGTH)
  np.testing.assert_array_equal(result.output.tokens, expected.tokens)
  np.testing.assert_allclose(result.output.scores, expected.scores, rtol=1e-5, atol=1e-5)


def test_bad_settings_are_refused():
  target = init_params(CONFIG, jax.random.PRNGKey(0))
  call = lambda **kw: sb.speculative_beam_generate(  # noqa: E731
      target, target, ENCODER_TOKENS, target_config=CONFIG,
      **{'draft_config': CONFIG, 'beam': bs.BeamConfig(num_beams=2),
         'spec': sb.SpeculativeBeamConfig(), 'max_decode_length': MAX_LENGTH, **kw})
  with pytest.raises(ValueError, match='draft_beams'):
    call(spec=sb.SpeculativeBeamConfig(draft_beams=1))
  with pytest.raises(ValueError, match='vocabularies differ'):
    call(draft_config=get_config('test_tiny_1_1'))
  with pytest.raises(ValueError, match='gamma'):
    sb.SpeculativeBeamConfig(gamma=0)
