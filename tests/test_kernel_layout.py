"""Kernels in T5X's layout and transposed (jaxspec.model.cpu.layout).

- Conversion: every Dense kernel (and only kernels) changes key and orientation, the
  axis names of params_axes are reversed, both directions are exact and idempotent.
- The model computes the same function from either tree: encoder, teacher-forced
  logits and cached decode steps of 1 and several positions, both T5 variants.
- Decoding: greedy speculative decoding on transposed trees equals the baseline on
  T5X trees token for token; a sampled run equals the same run on T5X trees.
- Padding: encoding skips the kernels' products over an input's padding, the real
  positions' encoding and cross-attention keys/values bit for bit a pass over every row's.
- Writers and checks: T5X checkpoints and HF state dicts written from a transposed tree
  hold T5X's layout; check_params accepts both and names a wrong kernel by its T5X path.
"""

import contextlib
import functools

import flax.traverse_util
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.checkpoints import check_params
from jaxspec.checkpoints import hf as hf_checkpoints
from jaxspec.checkpoints import t5x as t5x_checkpoints
from jaxspec.config import get_config
from jaxspec.decoding.baseline import generate
from jaxspec.decoding.drafters import T5Drafter
from jaxspec.decoding.speculative import SpeculativeConfig, speculative_generate
from jaxspec.model import T5, init_params
from jaxspec.model.cpu import layout as kernel_layout
from jaxspec.model.cpu import matmul as cpu_matmul
from jaxspec.model.cpu.matmul import TRANSPOSED_CONTRACTION_ROWS
from jaxspec.sampling import SamplingConfig

CONFIGS = ('test_tiny_1_1', 'test_tiny_1_0')


@functools.cache
def _variables(name):
  return init_params(get_config(name), jax.random.PRNGKey(3))


def _flat(tree):
  return flax.traverse_util.flatten_dict(tree, sep='/')


@pytest.mark.parametrize('name', CONFIGS)
def test_conversion_transposes_exactly_the_kernels(name):
  variables = _variables(name)
  transposed = kernel_layout.transposed_kernels(variables)
  before, after = _flat(variables['params']), _flat(transposed['params'])
  kernels = [path for path in before if path.endswith('/kernel')]
  assert len(kernels) >= 20
  assert len(after) == len(before)
  for path, value in before.items():
    if path.endswith('/kernel'):
      np.testing.assert_array_equal(after[path[:-len('kernel')] + 'kernel_t'], value.T)
    else:
      np.testing.assert_array_equal(after[path], value)
  axes_before = _flat(variables['params_axes'])
  axes_after = _flat(transposed['params_axes'])
  for path in kernels:
    names = axes_before[path + '_axes'].names
    assert axes_after[path[:-len('kernel')] + 'kernel_t_axes'].names == names[::-1]
  assert kernel_layout.has_transposed_kernels(transposed)
  assert not kernel_layout.has_transposed_kernels(variables)
  # Idempotent both ways, and the round trip is exact.
  again = kernel_layout.transposed_kernels(transposed)
  jax.tree.map(np.testing.assert_array_equal, again['params'], transposed['params'])
  back = kernel_layout.t5x_kernels(transposed)
  jax.tree.map(np.testing.assert_array_equal, back['params'], variables['params'])
  assert _flat(back['params_axes']).keys() == axes_before.keys()


def test_layout_by_platform():
  variables = _variables('test_tiny_1_1')
  # The CPU decodes from tiled kernels where the kernel's AVX-512 build runs, else from
  # transposed ones.
  cpu = kernel_layout.TILED if cpu_matmul.tiled_floats_apply() else kernel_layout.TRANSPOSED
  assert kernel_layout.decode_layout('cpu') == cpu
  assert kernel_layout.decode_layout('tpu') == kernel_layout.FUSED
  assert kernel_layout.decode_layout('gpu') == kernel_layout.FUSED
  assert kernel_layout.has_transposed_kernels(kernel_layout.for_decoding(variables, 'cpu'))
  assert not kernel_layout.has_transposed_kernels(kernel_layout.for_decoding(variables, 'tpu'))
  with pytest.raises(ValueError, match='kernel layout'):
    kernel_layout.to_layout(variables, 'columns')


@functools.partial(jax.jit, static_argnames=('name', 'num_steps'))
def _forward_and_steps(params, encoder_tokens, decoder_tokens, *, name, num_steps):
  """Teacher-forced logits, and the same logits from cached steps of num_steps positions."""
  model = T5(get_config(name))
  full = model.apply(params, encoder_tokens, decoder_tokens)  # [b, t, v]
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, decoder_tokens.shape[1],
                      method=T5.init_cache)
  stepped = []
  for start in range(0, decoder_tokens.shape[1], num_steps):
    logits, cache = model.apply(params, decoder_tokens[:, start:start + num_steps], cache,
                                method=T5.decode)
    stepped.append(logits)
  return encoded, full, jnp.concatenate(stepped, axis=1)


# Each variant once, one with single-position steps and one with steps of several
# (two steps each of 4 positions; four of 1, each step a copy of the model in the
# program, which the loop unrolls).
@pytest.mark.parametrize('name, num_steps, length', [('test_tiny_1_1', 4, 8),
                                                     ('test_tiny_1_0', 1, 4)])
def test_model_computes_the_same_from_either_layout(name, num_steps, length):
  variables = {'params': _variables(name)['params']}
  transposed = kernel_layout.transposed_kernels(variables)
  rng = np.random.default_rng(0)
  # Encoder inputs longer than TRANSPOSED_CONTRACTION_ROWS take the other contraction.
  encoder_tokens = jnp.asarray(rng.integers(2, 64, (2, TRANSPOSED_CONTRACTION_ROWS + 4)),
                               jnp.int32)
  decoder_tokens = jnp.asarray(rng.integers(2, 64, (2, length)), jnp.int32)
  reference = _forward_and_steps(variables, encoder_tokens, decoder_tokens, name=name,
                                 num_steps=num_steps)
  # The tiled layout (kernel_tiles where the outputs tile, kernel_t elsewhere).
  tiled = kernel_layout.tiled_kernels(variables)
  assert 'kernel_tiles' in str(jax.tree_util.tree_structure(tiled))
  for layout in (transposed, tiled):
    result = _forward_and_steps(layout, encoder_tokens, decoder_tokens, name=name,
                                num_steps=num_steps)
    for expected, actual in zip(reference, result):
      np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    # The cached steps agree with the teacher-forced pass in this layout too.
    np.testing.assert_allclose(result[2], result[1], rtol=1e-5, atol=1e-5)


def test_speculative_on_transposed_trees_equals_baseline_on_t5x_trees():
  # The runs on T5X trees have the shapes and settings of tests/test_speculative.py's
  # greedy baseline and sampled run (8 rows of 10 tokens, 16 decoded, gamma 3, variables
  # with their axes, rows stopped at non-finite logits but not raised): one program each
  # for both files.
  target_config, draft_config = get_config('test_tiny_1_1'), get_config('test_tiny_1_0')
  target = _variables('test_tiny_1_1')
  draft = init_params(draft_config, jax.random.PRNGKey(5))
  rng = np.random.default_rng(1)
  encoder_tokens = rng.integers(2, 64, (8, 10)).astype(np.int32)
  keys = jax.random.split(jax.random.PRNGKey(7), 8)
  spec = dict(target_config=target_config, drafter=T5Drafter(draft_config),
              spec=SpeculativeConfig(gamma=3), max_decode_length=16)
  greedy = SamplingConfig(temperature=0.0)
  baseline = generate(target, encoder_tokens, config=target_config, max_decode_length=16)
  fast = speculative_generate(kernel_layout.transposed_kernels(target),
                              kernel_layout.transposed_kernels(draft), encoder_tokens, keys,
                              sampling=greedy, **spec)
  np.testing.assert_array_equal(fast.output.tokens, baseline.tokens)
  sampled = dict(sampling=SamplingConfig(temperature=1.0), on_nonfinite='ignore', **spec)
  plain = speculative_generate(target, draft, encoder_tokens, keys, **sampled)
  transposed = speculative_generate(kernel_layout.transposed_kernels(target),
                                    kernel_layout.transposed_kernels(draft), encoder_tokens,
                                    keys, **sampled)
  assert not np.asarray(plain.output.nonfinite_logits).any()
  np.testing.assert_array_equal(transposed.output.tokens, plain.output.tokens)
  # Tiled trees (the CPU's decode layout where the AVX-512 build runs): the greedy
  # speculative output is the baseline's on the same trees.
  tiled_target = kernel_layout.tiled_kernels(target)
  tiled_baseline = generate(tiled_target, encoder_tokens, config=target_config,
                            max_decode_length=16)
  tiled_fast = speculative_generate(tiled_target, kernel_layout.tiled_kernels(draft),
                                    encoder_tokens, keys, sampling=greedy, **spec)
  np.testing.assert_array_equal(tiled_fast.output.tokens, tiled_baseline.tokens)


def test_writers_store_t5x_layout(tmp_path):
  name = 'test_tiny_1_1'
  config = get_config(name)
  params = _variables(name)['params']
  transposed = kernel_layout.transposed_kernels({'params': params})
  path = t5x_checkpoints.save_t5x_checkpoint(tmp_path / 'run', transposed, step=3)
  loaded = t5x_checkpoints.load_t5x_checkpoint(path, config)
  jax.tree.map(np.testing.assert_array_equal, loaded, jax.device_get(params))
  from_t5x = hf_checkpoints.hf_state_dict(params, config)
  tiled = kernel_layout.tiled_kernels({'params': params})
  path = t5x_checkpoints.save_t5x_checkpoint(tmp_path / 'tiled', tiled, step=3)
  jax.tree.map(np.testing.assert_array_equal, t5x_checkpoints.load_t5x_checkpoint(path, config),
               jax.device_get(params))
  for layout in (transposed, tiled):
    from_layout = hf_checkpoints.hf_state_dict(layout, config)
    assert from_layout.keys() == from_t5x.keys()
    for key, value in from_t5x.items():
      np.testing.assert_array_equal(from_layout[key], value)
  # Round trips through the tiled layout are exact and idempotent.
  jax.tree.map(np.testing.assert_array_equal, kernel_layout.t5x_kernels(tiled)['params'],
               jax.device_get(params))
  jax.tree.map(np.testing.assert_array_equal, kernel_layout.tiled_kernels(tiled)['params'],
               tiled['params'])
  assert kernel_layout.has_transposed_kernels(tiled)


def test_check_params_accepts_both_layouts_and_names_t5x_paths():
  name = 'test_tiny_1_1'
  config = get_config(name)
  transposed = kernel_layout.transposed_kernels({'params': _variables(name)['params']})
  check_params(transposed, config)
  check_params(kernel_layout.tiled_kernels(transposed), config)
  check_params(_variables(name)['params'], config)
  wrong = _flat(transposed['params'])
  # A kernel_t stored [in, out] by mistake (not square here: 32 -> 48).
  wrong['decoder/layers_0/mlp/wi_0/kernel_t'] = wrong['decoder/layers_0/mlp/wi_0/kernel_t'].T
  with pytest.raises(ValueError, match=r"decoder/layers_0/mlp/wi_0/kernel'.*\(48, 32\).*\(32, 48\)"):
    check_params(flax.traverse_util.unflatten_dict(wrong, sep='/'), config)


@pytest.mark.skipif(not cpu_matmul.kernel_available(),
                    reason='the CPU kernel is not available here')
def test_encoding_skips_the_padding_rows_and_keeps_the_real_ones_bit_for_bit(monkeypatch):
  """The Encoder and T5.init_cache run the kernels' products over the input's tokens only
  (cpu_matmul.active_rows): the real positions' encoding and cross-attention keys/values
  are those of a pass over every row bit for bit, the padding's keys/values zeros."""
  name = 'test_tiny_1_1'
  variables = kernel_layout.tiled_kernels({'params': _variables(name)['params']})
  model = T5(get_config(name))
  tokens = jnp.asarray([[5, 9, 3, 12, 1, 0, 0, 0], [7, 1, 0, 0, 0, 0, 0, 0]], jnp.int32)
  real = np.asarray(tokens) > 0
  encoded = np.asarray(jax.jit(lambda p, t: model.apply(p, t, method=T5.encode))(
      variables, tokens))
  with monkeypatch.context() as patch:  # The reference: every row through the kernels.
    patch.setattr(cpu_matmul, 'active_rows', lambda active: contextlib.nullcontext())
    reference = np.asarray(jax.jit(lambda p, t: model.apply(p, t, method=T5.encode))(
        variables, tokens))
  np.testing.assert_array_equal(encoded[real], reference[real])
  assert not np.allclose(encoded[~real], reference[~real])  # the padding's rows were skipped
  cache = jax.jit(lambda p, e, t: model.apply(p, e, t, 4, method=T5.init_cache))(
      variables, jnp.asarray(encoded), tokens)
  keys_values = jax.jit(lambda p, e: model.apply(
      p, e, method=lambda m, e: m.decoder.layers[0].cross_key_value(e)))(variables,
                                                                          jnp.asarray(encoded))
  for cached, computed in zip((cache.layers[0].cross_keys, cache.layers[0].cross_values),
                              keys_values):
    # [b, h, d, s] -> [b, s, h, d], indexed by the real positions and the padding.
    cached, computed = (np.moveaxis(np.asarray(a), -1, 1) for a in (cached, computed))
    np.testing.assert_array_equal(cached[real], computed[real])
    assert not cached[~real].any() and computed[~real].any()
