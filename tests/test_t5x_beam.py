"""The T5X beam routes against jaxspec's generate_beam, on the stand-in t5x.

The stand-in (tests/test_t5x_adapter.py) follows T5X's predict_batch_with_aux: a
one-token tokens_to_logits over the network's cache and self._decode_fn called with
T5X's keywords. Route 1: `t5x_adapter.beam_search` as EncoderDecoderModel.decode_fn.
Route 2: SpeculativeEncoderDecoderModel(decoder='beam').
"""

import numpy as np
import pytest

from jaxspec.integrations import t5x as t5x_adapter
from jaxspec.decoding import beam_search as bs
from test_t5x_adapter import (DRAFT, ENCODER_TOKENS, LENGTH, TARGET,  # noqa: F401
                              FakeNetwork, FakeVocabulary, _batch, _network_config,
                              _speculative_model, fake_t5x, weights)
from jaxspec.model import T5

BEAMS = 2


@pytest.fixture(scope='module')
def expected(weights):
  return bs.generate_beam(weights[0], ENCODER_TOKENS, config=TARGET,
                          beam=bs.BeamConfig(num_beams=BEAMS, alpha=0.8),
                          max_decode_length=LENGTH)


def test_beam_search_as_t5x_decode_fn(fake_t5x, weights, expected):
  model = fake_t5x.models.EncoderDecoderModel(
      module=FakeNetwork(_network_config(TARGET), T5(TARGET)),
      input_vocabulary=FakeVocabulary(), output_vocabulary=FakeVocabulary(),
      optimizer_def=None, decode_fn=t5x_adapter.beam_search)
  decodes, aux = model.predict_batch_with_aux(
      weights[0]['params'], _batch(), decoder_params={'alpha': 0.8}, num_decodes=BEAMS,
      return_all_decodes=True)
  np.testing.assert_array_equal(decodes, expected.tokens)
  np.testing.assert_allclose(aux['scores'], expected.scores, rtol=1e-5)


def test_speculative_model_beam_route(fake_t5x, weights, expected):
  model = _speculative_model(weights, decoder='beam', alpha=0.8)
  decodes, aux = model.predict_batch_with_aux(weights[0]['params'], _batch(),
                                              num_decodes=BEAMS, return_all_decodes=True)
  np.testing.assert_array_equal(decodes, expected.tokens)
  np.testing.assert_allclose(aux['scores'], expected.scores, rtol=1e-5, atol=1e-5)
  best, best_aux = model.predict_batch_with_aux(weights[0]['params'], _batch(),
                                                num_decodes=BEAMS)
  np.testing.assert_array_equal(best, expected.tokens[:, -1])
  with pytest.raises(ValueError, match='temperature'):
    model.predict_batch_with_aux(weights[0]['params'], _batch(), num_decodes=BEAMS,
                                 decoder_params={'temperature': 1.0})
  with pytest.raises(ValueError, match="'sample' or 'beam'"):
    _speculative_model(weights, decoder='greedy')
