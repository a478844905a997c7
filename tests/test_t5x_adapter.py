"""The T5X drop-in against a stand-in `t5x` with T5X's signatures (t5x is not installed).

The stand-in (`_fake_t5x_modules`) mirrors t5x/models.py (google-research/t5x, commit
0bc3617): EncoderDecoderModel's constructor, attributes (module, _decode_fn,
_output_vocabulary, _default_decoder_params) and predict_batch_with_aux, whose flow it
follows (encode once, build the cache, a one-token tokens_to_logits closure over the
network's decode, self._decode_fn called with keywords). Its network computes with
jaxspec's T5, since T5X's own network is not available; its config has T5X's fields.
References: jaxspec.decoding.baseline.generate, a teacher-forced forward pass.
"""

import dataclasses
import functools
import subprocess
import sys
import types
from typing import Any, Optional, Sequence

import gin
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec import get_config
from jaxspec.integrations import t5x as t5x_adapter
from jaxspec.config import EOS_ID
from jaxspec.decoding import baseline
from jaxspec.model import T5, init_params
from jaxspec.sampling import SamplingConfig

TARGET = get_config('test_tiny_1_1')
DRAFT = get_config('test_tiny_1_0')
ENCODER_TOKENS = jnp.array([[5, 6, 7, 8, 9, EOS_ID], [9, 10, 11, EOS_ID, 0, 0]])
LENGTH = 8  # Decode length L, from batch['decoder_input_tokens'].


@dataclasses.dataclass(frozen=True)
class NetworkConfig:
  """T5X's t5x/examples/t5/network.py T5Config: its fields and defaults."""
  vocab_size: int
  dtype: Any = jnp.float32
  emb_dim: int = 512
  num_heads: int = 8
  num_encoder_layers: int = 6
  num_decoder_layers: int = 6
  head_dim: int = 64
  mlp_dim: int = 2048
  mlp_activations: Sequence[str] = ('relu',)
  dropout_rate: float = 0.1
  logits_via_embedding: bool = False
  float32_attention_logits: bool = False


def _network_config(config) -> NetworkConfig:
  return NetworkConfig(
      vocab_size=config.vocab_size, dtype=jnp.dtype(config.dtype), emb_dim=config.emb_dim,
      num_heads=config.num_heads, num_encoder_layers=config.num_encoder_layers,
      num_decoder_layers=config.num_decoder_layers, head_dim=config.head_dim,
      mlp_dim=config.mlp_dim, mlp_activations=list(config.mlp_activations),
      logits_via_embedding=config.logits_via_embedding)


class FakeNetwork:
  """network.Transformer stand-in: T5X's config; jaxspec's T5 (same params) computes."""

  def __init__(self, config: NetworkConfig, t5: T5):
    self.config = config
    self.t5 = t5


@dataclasses.dataclass(frozen=True)
class FakeVocabulary:
  eos_id: int = EOS_ID


def _fake_t5x_modules():
  """Modules t5x, t5x.decoding, t5x.models with the pieces of T5X the adapter touches."""
  decoding = types.ModuleType('t5x.decoding')
  decoding.DecodingState = baseline.DecodingState  # Same fields as T5X's.

  def beam_search(inputs, cache, tokens_to_logits, eos_id, num_decodes=4, alpha=0.6,
                  max_decode_len=None, decode_rng=None, cache_offset=0, **kwargs):
    raise NotImplementedError('stand-in: T5X default decode_fn, never called here')
  decoding.beam_search = beam_search

  models = types.ModuleType('t5x.models')

  @dataclasses.dataclass(frozen=True)
  class DecoderParams:
    return_all_decodes: bool = False
    num_decodes: int = 1

  class BaseModel:
    def __init__(self, optimizer_def):
      self.optimizer_def = optimizer_def

  class BaseTransformerModel(BaseModel):
    def __init__(self, module, input_vocabulary, output_vocabulary, optimizer_def,
                 decode_fn=None, label_smoothing=0.0, z_loss=0.0,
                 loss_normalizing_factor=None):
      self.module = module
      self._input_vocabulary = input_vocabulary
      self._output_vocabulary = output_vocabulary
      self._decode_fn = decode_fn
      self._label_smoothing = label_smoothing
      self._z_loss = z_loss
      self._loss_normalizing_factor = loss_normalizing_factor
      super().__init__(optimizer_def=optimizer_def)

    @property
    def output_vocabulary(self):
      return self._output_vocabulary

    @property
    def decode_fn(self):
      return self._decode_fn

  class EncoderDecoderModel(BaseTransformerModel):
    def __init__(self, module, input_vocabulary, output_vocabulary, optimizer_def,
                 decode_fn=decoding.beam_search, feature_converter_cls=None,
                 label_smoothing=0.0, z_loss=0.0, loss_normalizing_factor=None,
                 default_decoder_params: Optional[DecoderParams] = None):
      self._default_decoder_params = default_decoder_params or DecoderParams()
      super().__init__(module=module, input_vocabulary=input_vocabulary,
                       output_vocabulary=output_vocabulary, optimizer_def=optimizer_def,
                       decode_fn=decode_fn, label_smoothing=label_smoothing, z_loss=z_loss,
                       loss_normalizing_factor=loss_normalizing_factor)

    def _compute_logits_from_slice(self, decoding_state, params, max_decode_length):
      """One token [B, 1] -> logits [B, V], as T5X's (which calls module.decode)."""
      del max_decode_length  # Fixed by the cache here.
      logits, cache = self.module.t5.apply({'params': params}, decoding_state.cur_token,
                                           decoding_state.cache, method=T5.decode)
      return logits[:, 0], cache

    def predict_batch(self, params, batch, rng=None):
      return self.predict_batch_with_aux(params, batch, rng=rng)[0]

    def predict_batch_with_aux(self, params, batch, rng=None, decoder_params=None,
                               return_all_decodes=None, num_decodes=None,
                               prompt_with_targets=False):
      if return_all_decodes is None:
        return_all_decodes = self._default_decoder_params.return_all_decodes
      if num_decodes is None:
        num_decodes = self._default_decoder_params.num_decodes
      encoder_tokens = batch['encoder_input_tokens']
      decoder_tokens = batch['decoder_input_tokens']
      if prompt_with_targets:
        prompt = decoder_tokens * (decoder_tokens != self.output_vocabulary.eos_id)
      else:
        prompt = jnp.zeros_like(decoder_tokens)
      variables = {'params': params}
      encoded = self.module.t5.apply(variables, encoder_tokens, method=T5.encode)
      cache = self.module.t5.apply(variables, encoded, encoder_tokens,
                                   decoder_tokens.shape[1], method=T5.init_cache)
      tokens_ids_to_logits = functools.partial(
          self._compute_logits_from_slice, params=params,
          max_decode_length=decoder_tokens.shape[1])
      decoder_params = dict(decoder_params or {})
      if rng is not None:
        if decoder_params.get('decode_rng') is not None:
          raise ValueError('Got RNG both from `rng` and decoder_params')
        decoder_params['decode_rng'] = rng
      decoder_params.setdefault('eos_id', self.output_vocabulary.eos_id)
      decodes, scores = self._decode_fn(
          inputs=prompt, cache=cache, tokens_to_logits=tokens_ids_to_logits,
          num_decodes=num_decodes, cache_offset=0, **decoder_params)
      if return_all_decodes:
        return decodes, {'scores': scores}
      return decodes[:, -1, :], {'scores': scores[:, -1]}

  for cls in (DecoderParams, BaseModel, BaseTransformerModel, EncoderDecoderModel):
    setattr(models, cls.__name__, cls)
  package = types.ModuleType('t5x')
  package.__path__ = []
  package.decoding, package.models = decoding, models
  return {'t5x': package, 't5x.decoding': decoding, 't5x.models': models}


@pytest.fixture(scope='module')
def fake_t5x():
  with pytest.MonkeyPatch.context() as patch:
    for name, module in _fake_t5x_modules().items():
      patch.setitem(sys.modules, name, module)
    t5x_adapter.make_speculative_model_class.cache_clear()
    yield sys.modules['t5x']
  t5x_adapter.make_speculative_model_class.cache_clear()


@pytest.fixture(scope='module')
def weights():
  """(target variables, draft variables): independent random tiny T5s over one vocab."""
  return init_params(TARGET, jax.random.PRNGKey(1)), init_params(DRAFT, jax.random.PRNGKey(2))


def _batch():
  return {'encoder_input_tokens': ENCODER_TOKENS,
          'decoder_input_tokens': jnp.zeros((ENCODER_TOKENS.shape[0], LENGTH), jnp.int32)}


def _speculative_model(weights, **overrides):
  target, draft = weights
  arguments = dict(
      module=FakeNetwork(_network_config(TARGET), T5(TARGET)),
      input_vocabulary=FakeVocabulary(), output_vocabulary=FakeVocabulary(),
      optimizer_def=None, draft=_network_config(DRAFT), draft_params=draft['params'],
      gamma=3)
  arguments.update(overrides)
  return t5x_adapter.make_speculative_model_class()(**arguments)


def test_import_without_t5x_and_a_clear_error_naming_it(monkeypatch):
  code = ('import sys\n'
          'sys.modules["t5x"] = None  # As if not installed, even where it is.\n'
          'from jaxspec.integrations import t5x as t5x_adapter\n'
          'assert "t5x.models" not in sys.modules\n'
          'assert callable(t5x_adapter.temperature_sample)\n')
  subprocess.run([sys.executable, '-c', code], check=True)
  t5x_adapter.make_speculative_model_class.cache_clear()
  monkeypatch.setitem(sys.modules, 't5x', None)
  with pytest.raises(ImportError, match=r'needs t5x installed.*pip install t5x'):
    t5x_adapter.make_speculative_model_class()
  with pytest.raises(ImportError, match='t5x.models.EncoderDecoderModel'):
    t5x_adapter.SpeculativeEncoderDecoderModel  # pylint: disable=pointless-statement


def test_t5config_from_t5x_network_config():
  network = NetworkConfig(
      vocab_size=32128, dtype=jnp.bfloat16, emb_dim=768, num_heads=12,
      num_encoder_layers=12, num_decoder_layers=12, head_dim=64, mlp_dim=2048,
      mlp_activations=['gelu', 'linear'], logits_via_embedding=False)
  assert (t5x_adapter.t5config_from_t5x_network_config(network)
          == get_config('t5_1_1_base', dtype='bfloat16'))
  t5_small = _network_config(get_config('t5_small'))
  assert t5x_adapter.t5config_from_t5x_network_config(t5_small) == get_config('t5_small')
  scanned = types.SimpleNamespace(**dataclasses.asdict(t5_small), scan_layers=True)
  with pytest.raises(ValueError, match='scan_layers'):
    t5x_adapter.t5config_from_t5x_network_config(scanned)
  with pytest.raises(ValueError, match='head_dim'):
    t5x_adapter.t5config_from_t5x_network_config(types.SimpleNamespace(vocab_size=8))


def test_greedy_predict_equals_baseline_generate(fake_t5x, weights):
  model = _speculative_model(weights)
  assert isinstance(model, fake_t5x.models.EncoderDecoderModel)
  # T5X compiles predict_batch_with_aux; so does this test.
  predict = jax.jit(lambda params, batch: model.predict_batch_with_aux(params, batch))
  decodes, aux = predict(weights[0]['params'], _batch())
  expected = baseline.generate(weights[0], ENCODER_TOKENS, config=TARGET,
                               max_decode_length=LENGTH)
  assert decodes.shape == (2, LENGTH) and aux['scores'].shape == (2,)
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected.tokens))
  np.testing.assert_array_equal(np.asarray(aux['scores']), 0.0)  # Rescaled, argmax.
  assert 1 < int(expected.lengths.min()) < LENGTH  # One row ends early at its EOS.


def _teacher_forced_scores(variables, encoder_tokens, decodes, temperature):
  """Sum over decodes [b, L] (up to the first EOS) of log softmax(logits / T)."""
  inputs = jnp.pad(decodes, ((0, 0), (1, 0)))[:, :-1]  # Shifted right, start token 0.
  logits = jax.jit(T5(TARGET).apply)(variables, encoder_tokens, inputs)  # [b, L, v]
  log_probs = jax.nn.log_softmax(logits / temperature, axis=-1)
  token = np.take_along_axis(np.asarray(log_probs), np.asarray(decodes)[..., None], -1)[..., 0]
  after_eos = np.cumsum(np.cumsum(np.asarray(decodes) == EOS_ID, 1), 1) > 1
  return np.where(after_eos | (np.asarray(decodes) == 0), 0.0, token).sum(1)


def test_num_decodes_sampled_sorted_scores_are_token_log_probs(fake_t5x, weights):
  model = _speculative_model(weights, draft='test_tiny_1_0', draft_params=weights[1])
  steps = LENGTH - 2
  decoder_params = {'temperature': 1.0, 'max_decode_steps': steps}
  rng = jax.random.PRNGKey(3)
  decodes, aux = model.predict_batch_with_aux(
      weights[0]['params'], _batch(), rng=rng, decoder_params=decoder_params,
      return_all_decodes=True, num_decodes=3)
  decodes, scores = np.asarray(decodes), np.asarray(aux['scores'])
  assert decodes.shape == (2, 3, LENGTH) and scores.shape == (2, 3)
  assert np.all(np.diff(scores, axis=1) >= 0)  # Ascending: best last.
  np.testing.assert_array_equal(decodes[:, :, steps:], 0)
  assert len({tuple(row) for row in decodes[0]}) > 1  # Different keys per decode.
  expected = _teacher_forced_scores(weights[0], jnp.repeat(ENCODER_TOKENS, 3, axis=0),
                                    jnp.asarray(decodes.reshape(6, LENGTH)), 1.0)
  np.testing.assert_allclose(scores.reshape(6), expected, rtol=1e-4, atol=1e-4)
  best, best_aux = model.predict_batch_with_aux(
      weights[0]['params'], _batch(), rng=rng, decoder_params=decoder_params, num_decodes=3)
  np.testing.assert_array_equal(np.asarray(best), decodes[:, -1])
  np.testing.assert_array_equal(np.asarray(best_aux['scores']), scores[:, -1])


def test_unsupported_requests_are_refused_before_decoding(fake_t5x, weights):
  model = _speculative_model(weights)
  params, batch = weights[0]['params'], _batch()
  with pytest.raises(ValueError, match='beam_size'):
    model.predict_batch_with_aux(params, batch, decoder_params={'beam_size': 2})
  with pytest.raises(ValueError, match='both'):
    model.predict_batch_with_aux(params, batch, rng=jax.random.PRNGKey(0),
                                 decoder_params={'decode_rng': jax.random.PRNGKey(1)})
  with pytest.raises(NotImplementedError, match='prompt_with_targets'):
    model.predict_batch_with_aux(params, batch, prompt_with_targets=True)
  with pytest.raises(ValueError, match='topk'):
    model.predict_batch_with_aux(params, batch, decoder_params={'topk': 5, 'topp': 0.9})
  with pytest.raises(ValueError, match='vocabularies differ'):
    _speculative_model(weights, draft=get_config('test_tiny_1_0', vocab_size=32))


@pytest.mark.parametrize('temperature', [0.0, 1.0])
def test_temperature_sample_as_t5x_decode_fn_matches_generate(fake_t5x, weights, temperature):
  model = fake_t5x.models.EncoderDecoderModel(
      module=FakeNetwork(_network_config(TARGET), T5(TARGET)),
      input_vocabulary=FakeVocabulary(), output_vocabulary=FakeVocabulary(),
      optimizer_def=None, decode_fn=t5x_adapter.temperature_sample)
  # Per-row keys (a jaxspec extension of decode_rng) draw what generate draws.
  rng = jax.random.split(jax.random.PRNGKey(4), ENCODER_TOKENS.shape[0])
  predict = jax.jit(lambda params, batch, rng: model.predict_batch_with_aux(
      params, batch, rng=rng, decoder_params={'temperature': temperature, 'topk': 0}))
  decodes, aux = predict(weights[0]['params'], _batch(), rng)
  expected = baseline.generate(weights[0], ENCODER_TOKENS, rng, config=TARGET,
                               max_decode_length=LENGTH, sampling=SamplingConfig(temperature))
  np.testing.assert_array_equal(np.asarray(decodes), np.asarray(expected.tokens))
  np.testing.assert_allclose(np.asarray(aux['scores']), np.asarray(expected.log_prob),
                             rtol=1e-5, atol=1e-5)


def test_gin_lines_from_the_readme_resolve(fake_t5x, weights):
  config = '\n'.join([
      'from __gin__ import dynamic_registration',
      'from t5x import models',
      'from jaxspec.integrations import t5x as t5x_adapter',
      'models.EncoderDecoderModel.decode_fn = @t5x_adapter.temperature_sample',
      't5x_adapter.temperature_sample.temperature = 0.0',
      'MODEL = @t5x_adapter.SpeculativeEncoderDecoderModel()',
      't5x_adapter.SpeculativeEncoderDecoderModel:',
      '  draft = "test_tiny_1_0"',
      '  gamma = 5',
      '  z_loss = 1e-4',
  ])
  try:
    gin.parse_config(config)
    decode_fn = gin.query_parameter('models.EncoderDecoderModel.decode_fn')
    assert decode_fn.configurable.wrapped is baseline.temperature_sample
    model_cls = t5x_adapter.SpeculativeEncoderDecoderModel
    assert gin.query_parameter('%MODEL').configurable.wrapped is model_cls
    model = gin.get_configurable(model_cls)(
        module=FakeNetwork(_network_config(TARGET), T5(TARGET)),
        input_vocabulary=FakeVocabulary(), output_vocabulary=FakeVocabulary(),
        optimizer_def=None, draft_params=weights[1])
    assert model.spec.gamma == 5 and model._z_loss == 1e-4
    assert model.drafter.config == DRAFT
  finally:
    gin.clear_config()
