"""jaxspec -> Hugging Face export: transformers' T5 loads it and computes our logits.

All four combinations of activation (gated GELU, ReLU) and logits (tied to the
embedding and scaled by 1/sqrt(d_model), or an own lm_head); the local models are
gated GELU with tied logits. Checks the config.json fields, transformers' loading
report, teacher-forced logits against jaxspec's, and export -> import round trips.
"""

import json

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import torch  # The test extra installs both: a missing one fails rather than skips.
import transformers

from jaxspec.checkpoints import config_from_hf, load_hf_checkpoint
from jaxspec.checkpoints.hf import hf_config_from_config, hf_state_dict, save_hf_checkpoint
from jaxspec.config import NAMED_CONFIGS, T5Config
from jaxspec.model import T5, init_params

VARIANTS = {
    'gated_gelu_tied': dict(mlp_activations=('gelu', 'linear'), logits_via_embedding=True),
    'gated_gelu_untied': dict(mlp_activations=('gelu', 'linear'), logits_via_embedding=False),
    'relu_tied': dict(mlp_activations=('relu',), logits_via_embedding=True),
    'relu_untied': dict(mlp_activations=('relu',), logits_via_embedding=False),
}
ATOL = 1e-4


def tiny_config(variant: str) -> T5Config:
  return T5Config(vocab_size=96, emb_dim=32, num_heads=4, head_dim=8, num_encoder_layers=2,
                  num_decoder_layers=3, mlp_dim=48, **VARIANTS[variant])


def random_params(config: T5Config, seed: int = 0) -> dict:
  """Bare params whose norm scales differ from 1, so every parameter matters."""
  params = init_params(config, jax.random.PRNGKey(seed))['params']
  rng = np.random.default_rng(seed)
  flat = flax.traverse_util.flatten_dict(jax.device_get(params), sep='/')
  for path, value in flat.items():
    if path.endswith('/scale'):
      flat[path] = (1.0 + 0.3 * rng.standard_normal(value.shape)).astype(value.dtype)
  return flax.traverse_util.unflatten_dict(flat, sep='/')


def make_inputs(vocab_size):
  """Encoder tokens [3, 8] of lengths 8, 5, 2 (EOS-terminated, 0-padded); decoder inputs [3, 12]."""
  rng = np.random.default_rng(1)
  encoder_tokens = rng.integers(2, vocab_size, (3, 8)).astype(np.int32)
  for row, length in enumerate([8, 5, 2]):
    encoder_tokens[row, length - 1] = 1
    encoder_tokens[row, length:] = 0
  decoder_tokens = rng.integers(1, vocab_size, (3, 12)).astype(np.int32)
  decoder_tokens[:, 0] = 0  # The start token.
  return encoder_tokens, decoder_tokens


def hf_logits(model, encoder_tokens, decoder_tokens) -> np.ndarray:
  with torch.no_grad():
    return model(input_ids=torch.tensor(encoder_tokens),
                 attention_mask=torch.tensor(encoder_tokens > 0),
                 decoder_input_ids=torch.tensor(decoder_tokens)).logits.numpy()


def assert_same_params(actual, expected):
  flat_actual = flax.traverse_util.flatten_dict(actual, sep='/')
  flat_expected = flax.traverse_util.flatten_dict(expected, sep='/')
  assert sorted(flat_actual) == sorted(flat_expected)
  for path, value in flat_expected.items():
    assert flat_actual[path].dtype == value.dtype, path
    np.testing.assert_array_equal(flat_actual[path], value, err_msg=path)


@pytest.fixture(scope='module', params=sorted(VARIANTS))
def exported(request, tmp_path_factory):
  """(config, params, directory) of a tiny random model exported in one variant."""
  config = tiny_config(request.param)
  params = random_params(config)
  directory = save_hf_checkpoint(params, config, tmp_path_factory.mktemp(request.param))
  return config, params, directory


def test_config_json_fields(exported):
  config, _, directory = exported
  written = json.loads((directory / 'config.json').read_text())
  gated = config.mlp_activations == ('gelu', 'linear')
  assert written == {**hf_config_from_config(config), 'dtype': 'float32'}
  assert {key: written[key] for key in (
      'd_model', 'd_kv', 'd_ff', 'num_layers', 'num_decoder_layers', 'num_heads',
      'feed_forward_proj', 'tie_word_embeddings', 'vocab_size', 'pad_token_id',
      'eos_token_id', 'decoder_start_token_id', 'layer_norm_epsilon')} == {
          'd_model': 32, 'd_kv': 8, 'd_ff': 48, 'num_layers': 2, 'num_decoder_layers': 3,
          'num_heads': 4, 'feed_forward_proj': 'gated-gelu' if gated else 'relu',
          'tie_word_embeddings': config.logits_via_embedding, 'vocab_size': 96,
          'pad_token_id': 0, 'eos_token_id': 1, 'decoder_start_token_id': 0,
          'layer_norm_epsilon': 1e-6}


def test_transformers_loads_every_weight(exported):
  config, _, directory = exported
  model, info = transformers.T5ForConditionalGeneration.from_pretrained(
      directory, output_loading_info=True)
  assert not info['missing_keys'] and not info['unexpected_keys'], info
  assert not info['mismatched_keys'], info
  # Tied logits read the embedding itself; untied ones a distinct lm_head.
  assert (model.lm_head.weight is model.shared.weight) == config.logits_via_embedding
  assert model.config.scale_decoder_outputs == config.logits_via_embedding
  assert model.config.is_gated_act == (config.mlp_activations == ('gelu', 'linear'))


def test_transformers_logits_equal_ours(exported):
  config, params, directory = exported
  model = transformers.T5ForConditionalGeneration.from_pretrained(directory).eval()
  encoder_tokens, decoder_tokens = make_inputs(config.vocab_size)
  ours = jax.jit(T5(config).apply)({'params': params}, encoder_tokens,
                                   decoder_tokens)  # [b, t, v]
  np.testing.assert_allclose(np.asarray(ours), hf_logits(model, encoder_tokens, decoder_tokens),
                             atol=ATOL, rtol=0)


def test_export_then_import_gives_identical_params(exported):
  config, params, directory = exported
  loaded_config, loaded_params = load_hf_checkpoint(directory)
  assert loaded_config == config
  assert_same_params(loaded_params, params)


def test_bfloat16_round_trip(tmp_path):
  config = tiny_config('gated_gelu_tied').replace(param_dtype='bfloat16')
  params = jax.tree_util.tree_map(lambda x: np.asarray(x, jnp.bfloat16),
                                  random_params(config))
  save_hf_checkpoint({'params': params}, config, tmp_path)
  assert json.loads((tmp_path / 'config.json').read_text())['dtype'] == 'bfloat16'
  loaded_config, loaded_params = load_hf_checkpoint(tmp_path, param_dtype='bfloat16')
  assert loaded_config == config
  assert_same_params(loaded_params, params)


@pytest.mark.parametrize('name', sorted(NAMED_CONFIGS))
def test_config_round_trip(name):
  config = NAMED_CONFIGS[name]
  assert config_from_hf(hf_config_from_config(config)) == config


def test_state_dict_keys_are_transformers_own():
  """Our keys are those transformers' model has, less the embedding copies it ties."""
  for variant in VARIANTS:
    config = tiny_config(variant)
    model = transformers.T5ForConditionalGeneration(
        transformers.T5Config(**hf_config_from_config(config)))
    tied = {'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight'}
    if config.logits_via_embedding:
      tied.add('lm_head.weight')
    expected = set(model.state_dict()) - tied
    assert set(hf_state_dict(random_params(config), config)) == expected, variant


def test_export_rejects_params_of_another_config(tmp_path):
  config = tiny_config('gated_gelu_tied')
  with pytest.raises(ValueError, match='mlp'):
    save_hf_checkpoint(random_params(config), config.replace(mlp_dim=64), tmp_path)
