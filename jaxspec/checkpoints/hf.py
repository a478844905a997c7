"""Hugging Face T5 <-> jaxspec: config, parameter conversion, checkpoint loading and export.

Hugging Face (transformers) names and layouts, and what they become here:

  shared.weight [V, E]                                   -> token_embedder/embedding [V, E]
  {encoder,decoder}.block.{i}.layer.0.SelfAttention.{q,k,v,o}.weight [out, in]
                                                         -> .../layers_{i}/{self_,}attention/
                                                            {query,key,value,out}/kernel [in, out]
  {stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight [32, H]
                                                         -> {stack}/relpos_bias/rel_embedding [H, 32]
  decoder.block.{i}.layer.1.EncDecAttention.*            -> .../encoder_decoder_attention/*
  {stack}.block.{i}.layer.{-1}.DenseReluDense.{wi | wi_0, wi_1; wo}.weight
                                                         -> .../mlp/{wi | wi_0, wi_1; wo}/kernel
  {stack}.block.{i}.layer.{j}.layer_norm.weight          -> the pre-norm `scale` of sublayer j
  {stack}.final_layer_norm.weight                        -> {encoder_norm, decoder_norm}/scale
  lm_head.weight [V, E]                                  -> decoder/logits_dense/kernel [E, V]

Neither side scales attention logits by 1/sqrt(head_dim), so no kernel is rescaled.
Export (`save_hf_checkpoint`) writes the same mapping backwards. `torch` and
`safetensors` are imported only by the readers and the writer that need them.
"""

from __future__ import annotations

import json
import pathlib
from typing import Any, Callable, Mapping

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np

from jaxspec.checkpoints.validate import check_params, flatten_params
from jaxspec.config import EOS_ID, PAD_ID, T5Config
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.layers import LAYER_NORM_EPSILON

# Hugging Face `feed_forward_proj` -> jaxspec `mlp_activations`. transformers maps
# 'gated-gelu' to its tanh approximation ('gelu_new'), which is T5X's gelu.
_ACTIVATIONS = {
    'relu': ('relu',),
    'gated-gelu': ('gelu', 'linear'),
    'gated-gelu_new': ('gelu', 'linear'),
    'gated-gelu_pytorch_tanh': ('gelu', 'linear'),
}
_MODEL_TYPES = ('t5', 'mt5')  # umt5 and longt5 have other attention layouts.
_REQUIRED_FIELDS = ('vocab_size', 'd_model', 'd_kv', 'num_heads', 'd_ff', 'num_layers')
_EMBEDDING_KEYS = ('shared.weight', 'encoder.embed_tokens.weight', 'decoder.embed_tokens.weight')
# Written by some old transformers versions; T5 has no cross-attention position bias.
_IGNORED_KEYS = ('decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight',)


def config_from_hf(hf_config: Mapping[str, Any], **overrides) -> T5Config:
  """A T5Config from a Hugging Face T5 `config.json` dict; `overrides` replace fields.

  Activation and logits are independent here: gated-gelu or relu, each with tied
  (scaled by 1/sqrt(d_model)) or untied logits, so every HF T5 combination maps.
  """
  model_type = hf_config.get('model_type', 't5')
  if model_type not in _MODEL_TYPES:
    raise ValueError(f'model_type {model_type!r} is not supported; expected one of {_MODEL_TYPES}')
  for field in _REQUIRED_FIELDS:
    if field not in hf_config:
      raise ValueError(f'HF config lacks {field!r}')
  feed_forward_proj = hf_config.get('feed_forward_proj', 'relu')
  if feed_forward_proj not in _ACTIVATIONS:
    raise ValueError(f'feed_forward_proj {feed_forward_proj!r} is not supported; '
                     f'expected one of {sorted(_ACTIVATIONS)}')
  epsilon = hf_config.get('layer_norm_epsilon', LAYER_NORM_EPSILON)
  if not np.isclose(epsilon, LAYER_NORM_EPSILON, rtol=1e-6, atol=0.0):
    raise ValueError(f'layer_norm_epsilon {epsilon!r} is not supported; jaxspec uses '
                     f'{LAYER_NORM_EPSILON} as T5X')
  num_layers = hf_config['num_layers']
  config = T5Config(
      vocab_size=hf_config['vocab_size'], emb_dim=hf_config['d_model'],
      num_heads=hf_config['num_heads'], head_dim=hf_config['d_kv'],
      num_encoder_layers=num_layers,
      num_decoder_layers=hf_config.get('num_decoder_layers') or num_layers,
      mlp_dim=hf_config['d_ff'], mlp_activations=_ACTIVATIONS[feed_forward_proj],
      logits_via_embedding=_scales_decoder_outputs(hf_config),
      relative_attention_num_buckets=hf_config.get('relative_attention_num_buckets', 32),
      relative_attention_max_distance=hf_config.get('relative_attention_max_distance', 128))
  return config.replace(**overrides)


def _scales_decoder_outputs(hf_config: Mapping[str, Any]) -> bool:
  """Whether HF multiplies the decoder output by d_model**-0.5 (T5 1.0's tied logits).

  transformers < 5 scaled iff `tie_word_embeddings` (default True). transformers >= 5
  always writes tie_word_embeddings=True and keeps the old meaning in
  `scale_decoder_outputs`.
  """
  if 'scale_decoder_outputs' in hf_config:
    return bool(hf_config['scale_decoder_outputs'])
  return bool(hf_config.get('tie_word_embeddings', True))


def _attention_keys(path: str, hf_prefix: str) -> dict[str, str]:
  names = (('query', 'q'), ('key', 'k'), ('value', 'v'), ('out', 'o'))
  return {f'{path}/{ours}/kernel': f'{hf_prefix}.{theirs}.weight' for ours, theirs in names}


def _mlp_keys(config: T5Config, path: str, hf_prefix: str) -> dict[str, str]:
  inputs = ('wi',) if config.mlp_activations == ('relu',) else ('wi_0', 'wi_1')
  return {f'{path}/{name}/kernel': f'{hf_prefix}.DenseReluDense.{name}.weight'
          for name in inputs + ('wo',)}


def _encoder_layer_keys(config: T5Config, i: int) -> dict[str, str]:
  path, hf = f'encoder/layers_{i}', f'encoder.block.{i}.layer'
  return {
      f'{path}/pre_attention_layer_norm/scale': f'{hf}.0.layer_norm.weight',
      **_attention_keys(f'{path}/attention', f'{hf}.0.SelfAttention'),
      f'{path}/pre_mlp_layer_norm/scale': f'{hf}.1.layer_norm.weight',
      **_mlp_keys(config, f'{path}/mlp', f'{hf}.1'),
  }


def _decoder_layer_keys(config: T5Config, i: int) -> dict[str, str]:
  path, hf = f'decoder/layers_{i}', f'decoder.block.{i}.layer'
  return {
      f'{path}/pre_self_attention_layer_norm/scale': f'{hf}.0.layer_norm.weight',
      **_attention_keys(f'{path}/self_attention', f'{hf}.0.SelfAttention'),
      f'{path}/pre_cross_attention_layer_norm/scale': f'{hf}.1.layer_norm.weight',
      **_attention_keys(f'{path}/encoder_decoder_attention', f'{hf}.1.EncDecAttention'),
      f'{path}/pre_mlp_layer_norm/scale': f'{hf}.2.layer_norm.weight',
      **_mlp_keys(config, f'{path}/mlp', f'{hf}.2'),
  }


def hf_keys(config: T5Config) -> dict[str, str]:
  """T5X '/'-path -> HF state-dict key, for all parameters but embedding and logits."""
  relpos = 'block.0.layer.0.SelfAttention.relative_attention_bias.weight'
  keys = {'encoder/relpos_bias/rel_embedding': f'encoder.{relpos}',
          'decoder/relpos_bias/rel_embedding': f'decoder.{relpos}',
          'encoder/encoder_norm/scale': 'encoder.final_layer_norm.weight',
          'decoder/decoder_norm/scale': 'decoder.final_layer_norm.weight'}
  for i in range(config.num_encoder_layers):
    keys.update(_encoder_layer_keys(config, i))
  for i in range(config.num_decoder_layers):
    keys.update(_decoder_layer_keys(config, i))
  return keys


def _pop_embedding(remaining: dict[str, np.ndarray]) -> tuple[str, np.ndarray]:
  """Pops the shared embedding [V, E] and its tied copies; all copies must agree."""
  present = [key for key in _EMBEDDING_KEYS if key in remaining]
  if not present:
    raise ValueError(f'HF state dict lacks {_EMBEDDING_KEYS[0]!r} (the token embedding)')
  key, embedding = present[0], np.asarray(remaining.pop(present[0]))
  for other in present[1:]:
    if not np.array_equal(np.asarray(remaining.pop(other)), embedding):
      raise ValueError(f'HF {other!r} differs from {key!r}; jaxspec has one token embedding')
  return key, embedding


def _pop_logits_kernel(remaining: dict[str, np.ndarray], embedding_key: str,
                       embedding: np.ndarray, config: T5Config) -> tuple[str, np.ndarray] | None:
  """Pops `lm_head.weight`; returns (its source key, HF weight [V, E]) when untied."""
  lm_head = remaining.pop('lm_head.weight', None)
  if config.logits_via_embedding:
    if lm_head is not None and not np.array_equal(np.asarray(lm_head), embedding):
      raise ValueError(f"HF 'lm_head.weight' differs from {embedding_key!r} but the config "
                       'ties logits to the embedding (logits_via_embedding=True)')
    return None
  # transformers >= 5 ties lm_head to the embedding unless a distinct one is stored.
  if lm_head is None:
    return embedding_key, embedding
  return 'lm_head.weight', np.asarray(lm_head)


def params_from_hf(state_dict: Mapping[str, Any], config: T5Config) -> dict:
  """Converts a HF T5 state dict (key -> array) to the nested T5X-layout `params`.

  Linear weights [out, in] become kernels [in, out]; relative_attention_bias [32, H]
  becomes rel_embedding [H, 32]. Leaves are numpy arrays of `config.param_dtype`.
  Raises ValueError naming the first missing or unexpected HF key, or the first path
  whose shape differs from `config`'s (with both shapes).
  """
  remaining = {key: value for key, value in state_dict.items() if key not in _IGNORED_KEYS}
  embedding_key, embedding = _pop_embedding(remaining)
  sources = {'token_embedder/embedding': embedding_key}
  flat = {'token_embedder/embedding': embedding}
  logits = _pop_logits_kernel(remaining, embedding_key, embedding, config)
  if logits is not None:
    sources['decoder/logits_dense/kernel'], flat['decoder/logits_dense/kernel'] = logits
  for path, key in hf_keys(config).items():
    if key not in remaining:
      raise ValueError(f'HF state dict lacks {key!r} (for {path!r})')
    sources[path], flat[path] = key, remaining.pop(key)
  if remaining:
    raise ValueError(f'unexpected HF key {sorted(remaining)[0]!r} '
                     f'({len(remaining)} unexpected in all) for this config')
  dtype = jnp.dtype(config.param_dtype)
  flat = {path: _to_t5x_layout(path, value, dtype) for path, value in flat.items()}
  params = flax.traverse_util.unflatten_dict(flat, sep='/')
  check_params(params, config, sources)
  return params


def _to_t5x_layout(path: str, value, dtype) -> np.ndarray:
  """HF [out, in] (or [buckets, heads]) -> T5X [in, out] ([heads, buckets]), as `dtype`."""
  value = np.asarray(value)
  if path != 'token_embedder/embedding' and value.ndim == 2:
    value = value.T
  return np.ascontiguousarray(value, dtype=dtype)


def _read_safetensors(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Reads a .safetensors file with the numpy API (bfloat16 tensors through jax)."""
  from safetensors import safe_open
  with safe_open(str(path), framework='numpy') as f:
    bfloat16 = [key for key in f.keys() if f.get_slice(key).get_dtype() == 'BF16']
    state = {key: f.get_tensor(key) for key in f.keys() if key not in bfloat16}
  if bfloat16:  # numpy itself has no bfloat16; jax gives ml_dtypes arrays.
    with jax.default_device(jax.devices('cpu')[0]), safe_open(str(path), framework='flax') as f:
      state.update({key: np.asarray(f.get_tensor(key)) for key in bfloat16})
  return state


def _read_torch_bin(path: pathlib.Path) -> dict[str, np.ndarray]:
  """Reads a torch-pickled state dict (weights only) into numpy arrays."""
  import torch  # Lazily: only .bin checkpoints need torch.
  state = torch.load(path, map_location='cpu', weights_only=True)

  def to_numpy(tensor):
    if tensor.dtype == torch.bfloat16:  # numpy has no bfloat16
      return tensor.float().numpy().astype(jnp.bfloat16)
    return tensor.numpy()

  return {key: to_numpy(tensor) for key, tensor in state.items()}


def _read_sharded(reader: Callable[[pathlib.Path], dict]) -> Callable[[pathlib.Path], dict]:
  """A reader of `*.index.json` (weight_map: key -> shard file) from a shard reader."""

  def read(index_path: pathlib.Path) -> dict[str, np.ndarray]:
    shards = sorted(set(json.loads(index_path.read_text())['weight_map'].values()))
    state = {}
    for shard in shards:
      state.update(reader(index_path.parent / shard))
    return state

  return read


# In transformers' order of preference.
_WEIGHT_FILES = (
    ('model.safetensors', _read_safetensors),
    ('model.safetensors.index.json', _read_sharded(_read_safetensors)),
    ('pytorch_model.bin', _read_torch_bin),
    ('pytorch_model.bin.index.json', _read_sharded(_read_torch_bin)),
)


def read_hf_state_dict(directory) -> dict[str, np.ndarray]:
  """The HF state dict (key -> numpy array) stored in a checkpoint directory."""
  directory = pathlib.Path(directory)
  for name, reader in _WEIGHT_FILES:
    if (directory / name).is_file():
      return reader(directory / name)
  raise FileNotFoundError(f'{directory}: no weights; expected one of '
                          f'{[name for name, _ in _WEIGHT_FILES]}')


def load_hf_checkpoint(directory, **config_overrides) -> tuple[T5Config, dict]:
  """Loads a HF T5 checkpoint directory -> (config, params in config.param_dtype).

  The directory holds config.json and model.safetensors or pytorch_model.bin (or
  their sharded *.index.json forms). Use the params as {'params': params}.
  """
  directory = pathlib.Path(directory)
  if not directory.is_dir():
    raise FileNotFoundError(f'{directory}: no such checkpoint directory')
  config_path = directory / 'config.json'
  if not config_path.is_file():
    raise FileNotFoundError(f'{directory}: no config.json (a HF T5 checkpoint directory '
                            'holds config.json and model.safetensors or pytorch_model.bin)')
  config = config_from_hf(json.loads(config_path.read_text()), **config_overrides)
  return config, params_from_hf(read_hf_state_dict(directory), config)


# ---------------------------------------------------------------------------
# Export: jaxspec -> Hugging Face.


def hf_config_from_config(config: T5Config) -> dict[str, Any]:
  """The transformers `T5Config` dict (config.json) of a jaxspec T5Config.

  `tie_word_embeddings` carries `logits_via_embedding`: transformers < 5 reads True
  as "logits through the shared embedding, decoder output scaled by d_model**-0.5"
  (T5 1.0) and False as "own lm_head, unscaled" (T5.1.1), for either activation.
  transformers >= 5 keeps that meaning in `scale_decoder_outputs`, written as well.
  """
  gated = config.mlp_activations == ('gelu', 'linear')
  return {
      'architectures': ['T5ForConditionalGeneration'], 'model_type': 't5',
      'vocab_size': config.vocab_size, 'd_model': config.emb_dim, 'd_kv': config.head_dim,
      'd_ff': config.mlp_dim, 'num_layers': config.num_encoder_layers,
      'num_decoder_layers': config.num_decoder_layers, 'num_heads': config.num_heads,
      'feed_forward_proj': 'gated-gelu' if gated else 'relu',
      'tie_word_embeddings': config.logits_via_embedding,
      'scale_decoder_outputs': config.logits_via_embedding,
      'relative_attention_num_buckets': config.relative_attention_num_buckets,
      'relative_attention_max_distance': config.relative_attention_max_distance,
      'layer_norm_epsilon': LAYER_NORM_EPSILON, 'dropout_rate': 0.0,
      'is_encoder_decoder': True, 'pad_token_id': PAD_ID, 'eos_token_id': EOS_ID,
      'decoder_start_token_id': PAD_ID,
  }


def _to_hf_layout(path: str, value) -> np.ndarray:
  """T5X [in, out] ([heads, buckets]) -> HF [out, in] ([buckets, heads]); dtype kept."""
  value = np.asarray(value)
  if path != 'token_embedder/embedding' and value.ndim == 2:
    value = value.T
  return np.ascontiguousarray(value)


def _bare_params(variables):
  """The 'params' collection of model variables ({'params': ..., ...}), or params as given."""
  return variables['params'] if 'params' in variables else variables


def hf_state_dict(params, config: T5Config) -> dict[str, np.ndarray]:
  """The HF state dict (key -> numpy array) of jaxspec params (bare or in variables).

  Only `shared.weight` holds the embedding (transformers ties the encoder and decoder
  copies to it); `lm_head.weight` is written when the logits are untied.
  """
  params = kernel_layout.t5x_kernels(_bare_params(params))
  check_params(params, config)
  flat = flatten_params(params)
  sources = {'token_embedder/embedding': 'shared.weight', **hf_keys(config)}
  if not config.logits_via_embedding:
    sources['decoder/logits_dense/kernel'] = 'lm_head.weight'
  return {key: _to_hf_layout(path, flat[path]) for path, key in sources.items()}


def save_hf_checkpoint(params, config: T5Config, directory) -> pathlib.Path:
  """Writes `params` as a HF T5 checkpoint: config.json and model.safetensors.

  Arrays keep their dtype (bfloat16 included). The directory is created if needed;
  transformers' `T5ForConditionalGeneration.from_pretrained(directory)` loads it.
  """
  from safetensors.numpy import save_file  # Lazily: only export needs safetensors.
  directory = pathlib.Path(directory)
  directory.mkdir(parents=True, exist_ok=True)
  hf_config = hf_config_from_config(config)
  hf_config['dtype'] = _dtype_name(params)
  (directory / 'config.json').write_text(json.dumps(hf_config, indent=2) + '\n')
  save_file(hf_state_dict(params, config), str(directory / 'model.safetensors'),
            metadata={'format': 'pt'})
  return directory


def _dtype_name(params) -> str:
  dtypes = {np.dtype(leaf.dtype) for leaf in jax.tree_util.tree_leaves(_bare_params(params))}
  return str(dtypes.pop()) if len(dtypes) == 1 else 'float32'
