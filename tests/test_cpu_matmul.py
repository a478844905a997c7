"""jaxspec.model.cpu.matmul: the few-row CPU kernel against float64 products and XLA.

The decoders' exactness suites run through the kernel too (cpu_matmul 'kernel' is the
default and the CPU is the tests' backend); here: the kernel's own arithmetic, the
property that makes verify steps exact (a row's result does not depend on how many rows
share the product), where it applies, and what happens where it cannot be built.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxspec.config import T5Config, get_config
from jaxspec.model import T5, init_params
from jaxspec.model.cpu import matmul as cpu_matmul, layout as kernel_layout

needs_kernel = pytest.mark.skipif(not cpu_matmul.kernel_available(),
                                reason='the kernel needs x86-64 with AVX2 + FMA and a C++ compiler')

_kernel = jax.jit(cpu_matmul.few_row_matmul)


def _operands(rows, inputs, outputs, seed=0):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((rows, inputs)).astype(np.float32)
  w_t = rng.standard_normal((outputs, inputs)).astype(np.float32)
  return x, w_t


@needs_kernel
@pytest.mark.parametrize('rows,inputs,outputs', [
    (1, 64, 40),  # one row, one thread (fewer than 2 x 64 outputs)
    (3, 77, 515),  # a tail of inputs past the last 8-lane block; outputs split in parts
    (32, 512, 1030),  # the most rows; outputs not a multiple of the 8- and 4-row blocks
])
def test_kernel_matches_float64_product(rows, inputs, outputs):
  x, w_t = _operands(rows, inputs, outputs)
  expected = x.astype(np.float64) @ w_t.astype(np.float64).T
  got = np.asarray(_kernel(jnp.asarray(x), jnp.asarray(w_t)))
  scale = np.abs(x).astype(np.float64) @ np.abs(w_t).astype(np.float64).T
  assert got.shape == (rows, outputs)
  assert np.all(np.abs(got - expected) <= 1e-6 * scale + 1e-6)


@needs_kernel
def test_a_row_is_bit_identical_whatever_rows_share_the_product():
  """What keeps a verify step's logits equal to the one-position steps' logits."""
  x, w_t = _operands(32, 260, 600, seed=1)
  x, w_t = jnp.asarray(x), jnp.asarray(w_t)
  singles = np.stack([np.asarray(_kernel(x[n:n + 1], w_t))[0] for n in range(32)])
  # Every count of rows in a register block, and several passes up to the most rows.
  for k in (*range(2, 11), 13, 16, 17, 24, 31, 32):
    np.testing.assert_array_equal(np.asarray(_kernel(x[:k], w_t)), singles[:k])
  # Leading dims are rows too: [b, t, in].
  np.testing.assert_array_equal(np.asarray(_kernel(x[:8].reshape(2, 4, 260), w_t)),
                                singles[:8].reshape(2, 4, 600))


@needs_kernel
def test_where_the_kernel_applies():
  w_t = jnp.ones((32, 8), jnp.float32)
  assert cpu_matmul.applies(jnp.ones((1, 32, 8), jnp.float32), w_t)
  assert not cpu_matmul.applies(jnp.ones((3, 11, 8), jnp.float32), w_t)  # 33 rows
  assert not cpu_matmul.applies(jnp.ones((1, 4, 8), jnp.bfloat16), w_t)
  assert not cpu_matmul.applies(jnp.ones((1, 0, 8), jnp.float32), w_t)

  def calls_kernel(x, setting):
    jaxpr = jax.make_jaxpr(lambda x: cpu_matmul.matmul_transposed(x, w_t, setting))(x)
    return cpu_matmul.TARGET_NAME in str(jaxpr)

  assert calls_kernel(jnp.ones((1, 4, 8), jnp.float32), cpu_matmul.KERNEL)
  assert not calls_kernel(jnp.ones((1, 4, 8), jnp.float32), cpu_matmul.XLA)
  assert not calls_kernel(jnp.ones((3, 11, 8), jnp.float32), cpu_matmul.KERNEL)
  with pytest.raises(ValueError, match='cpu_matmul'):
    cpu_matmul.matmul_transposed(jnp.ones((1, 4, 8), jnp.float32), w_t, 'fast')
  with pytest.raises(ValueError, match='cpu_matmul'):
    T5Config(cpu_matmul='fast')


@needs_kernel
def test_a_decoder_step_takes_any_rows_in_calls_of_the_kernels_limit():
  """Within decode_step every product goes through the kernel (float32 in one call,
  which sweeps its rows in groups; int8 in calls of at most INT8_CALL_ROWS rows), each
  row bit for bit its one-row product (one matrix or several, with ended rows skipped)."""
  rows = 2 * cpu_matmul.INT8_CALL_ROWS + 44  # three int8 calls, three float32 groups
  x, w_t = (jnp.asarray(a) for a in _operands(rows, 96, 72, seed=5))
  w_q, scale = (jnp.asarray(a) for a in _int8_operands(1, 96, 56, seed=5)[1:])
  assert not cpu_matmul.applies(x[:33], w_t)
  with cpu_matmul.decode_step():
    assert cpu_matmul.applies(x, w_t) and cpu_matmul.applies_int8(x, w_q, scale)

  def products(x):
    return (cpu_matmul.matmul_transposed(x, w_t), *cpu_matmul.matmuls_transposed(x, (w_t, w_t)),
            cpu_matmul.matmul_int8(x, w_q, scale),
            *cpu_matmul.matmuls_int8(x, [(w_q, scale), (w_q, scale)]))

  def in_step(x):
    with cpu_matmul.decode_step():
      return products(x)

  jaxpr = str(jax.make_jaxpr(in_step)(x.reshape(4, rows // 4, 96)))
  for name, calls in ((cpu_matmul.TARGET_NAME, 1), (cpu_matmul.MANY_TARGET_NAMES[2], 1),
                      (cpu_matmul.INT8_TARGET_NAME, 3), (cpu_matmul.MANY_INT8_TARGET_NAMES[2], 3)):
    assert jaxpr.count(f'target_name={name}\n') == calls, name
  assert 'dot_general' not in jaxpr
  wide = jax.jit(in_step)(x.reshape(4, rows // 4, 96))
  singles = [jax.jit(products)(x[n:n + 1]) for n in range(rows)]
  for k, got in enumerate(wide):
    np.testing.assert_array_equal(np.asarray(got).reshape(rows, -1),
                                  np.concatenate([np.asarray(s[k]) for s in singles]))
  # Ended rows: zeros for them, the others unchanged, across the calls.
  active = jnp.asarray(np.arange(4) != 2)

  def masked(x):
    with cpu_matmul.decode_step(), cpu_matmul.active_rows(active):
      return products(x)

  for got, full in zip(jax.jit(masked)(x.reshape(4, rows // 4, 96)), wide):
    expected = np.asarray(full).copy()
    expected[2] = 0.0
    np.testing.assert_array_equal(np.asarray(got), expected)


@needs_kernel
@pytest.mark.parametrize('batch,width', [
    (24, 7),  # 168 rows: more than MAX_ROWS, and more than one group of the kernel's sweep
    (1, 40),  # more queries a row than MAX_QUERIES for the attention
])
def test_a_wide_decoder_step_computes_each_row_as_one_position_steps_do(batch, width):
  """A verify step over more rows x positions than the kernels take outside a decoder
  step gives every position the logits of one-position steps, bit for bit: what keeps
  speculative decoding exact at every batch size and gamma."""
  config = get_config('test_tiny_1_1')
  params = kernel_layout.transposed_kernels(
      {'params': init_params(config, jax.random.PRNGKey(0))['params']})
  rng = np.random.default_rng(6)
  encoder_tokens = jnp.asarray(rng.integers(2, config.vocab_size, (batch, 6)), jnp.int32)
  tokens = jnp.asarray(rng.integers(2, config.vocab_size, (batch, width)), jnp.int32)
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, width + 5, method=T5.init_cache)
  decode = jax.jit(lambda tokens, cache: model.apply(params, tokens, cache, method=T5.decode))
  wide, _ = decode(tokens, cache)
  steps = []
  for j in range(width):
    logits, cache = decode(tokens[:, j:j + 1], cache)
    steps.append(np.asarray(logits)[:, 0])
  np.testing.assert_array_equal(np.asarray(wide), np.stack(steps, axis=1))


@needs_kernel
def test_gradients_and_vmap_match_xla():
  x, w_t = (jnp.asarray(a) for a in _operands(4, 48, 300, seed=2))

  def loss(matmul):
    return lambda x, w_t: jnp.sum(jnp.sin(matmul(x, w_t)))

  ours = jax.grad(loss(cpu_matmul.few_row_matmul), argnums=(0, 1))(x, w_t)
  xla = jax.grad(loss(cpu_matmul.xla_matmul_transposed), argnums=(0, 1))(x, w_t)
  for a, b in zip(ours, xla):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
  batched = jax.vmap(cpu_matmul.few_row_matmul, in_axes=(0, None))(x[:, None], w_t)
  np.testing.assert_array_equal(np.asarray(batched)[:, 0], np.asarray(_kernel(x, w_t)))


@needs_kernel
def _tiny_decode_step(setting=cpu_matmul.KERNEL):
  """(params, decode(params) -> logits): a 3-token decode step of the tiny T5.1.1 model
  (transposed kernels) under cpu_matmul `setting`."""
  config = get_config('test_tiny_1_1').replace(cpu_matmul=setting)
  params = kernel_layout.transposed_kernels(
      {'params': init_params(config, jax.random.PRNGKey(0))['params']})
  encoder_tokens = jnp.asarray([[5, 6, 7, 8, 1]], jnp.int32)
  tokens = jnp.asarray([[0, 9, 10]], jnp.int32)
  model = T5(config)
  encoded = model.apply(params, encoder_tokens, method=T5.encode)
  cache = model.apply(params, encoded, encoder_tokens, 8, method=T5.init_cache)
  return params, lambda params: model.apply(params, tokens, cache, method=T5.decode)[0]


def test_decode_step_uses_the_kernels_and_agrees_with_xla():
  """Its products and its attention (jaxspec.model.cpu.attention) run through the kernels."""
  params, kernel_step = _tiny_decode_step(cpu_matmul.KERNEL)
  _, xla_step = _tiny_decode_step(cpu_matmul.XLA)
  kernel_jaxpr = str(jax.make_jaxpr(lambda: kernel_step(params))())
  xla_jaxpr = str(jax.make_jaxpr(lambda: xla_step(params))())
  for name in (cpu_matmul.MANY_TARGET_NAMES[3], cpu_matmul.ATTENTION_TARGET_NAME):
    assert name in kernel_jaxpr and name not in xla_jaxpr
  np.testing.assert_allclose(np.asarray(kernel_step(params)), np.asarray(xla_step(params)),
                             rtol=1e-5, atol=1e-5)


def test_no_compiler_or_a_failed_build_falls_back_with_one_warning(monkeypatch, tmp_path):
  check = cpu_matmul.kernel_available.__wrapped__  # uncached: the registered kernel stays
  monkeypatch.setattr(cpu_matmul, '_compiler', lambda: None)
  with pytest.warns(RuntimeWarning, match='no C\\+\\+ compiler'):
    assert check() is False
  monkeypatch.setenv('JAXSPEC_KERNEL_CACHE', str(tmp_path))
  monkeypatch.setattr(cpu_matmul, '_compiler', lambda: '/bin/false')
  with pytest.warns(RuntimeWarning, match='failed'):
    assert check() is False
  assert not list(tmp_path.glob('*.so'))  # nothing half-written is left to load
  # Unavailable, the products run through XLA and give the same numbers up to rounding.
  monkeypatch.setattr(cpu_matmul, 'kernel_available', lambda: False)
  x, w_t = (jnp.asarray(a) for a in _operands(2, 16, 24))
  np.testing.assert_allclose(np.asarray(cpu_matmul.matmul_transposed(x[None], w_t))[0],
                             np.asarray(x) @ np.asarray(w_t).T, rtol=1e-5, atol=1e-5)


def test_the_instruction_set_follows_the_cpu_and_the_environment(monkeypatch):
  monkeypatch.delenv('JAXSPEC_KERNEL_ISA', raising=False)
  avx512 = {'avx2', 'fma', 'avx512f', 'avx512bw', 'avx512_vnni'}
  monkeypatch.setattr(cpu_matmul, '_cpu_flags', lambda: avx512)
  assert cpu_matmul.kernel_isa() == 'avx512'
  monkeypatch.setattr(cpu_matmul, '_cpu_flags', lambda: avx512 - {'avx512_vnni'})
  assert cpu_matmul.kernel_isa() == 'avx2'  # AVX-512 without VNNI: the AVX2 build
  monkeypatch.setattr(cpu_matmul, '_cpu_flags', lambda: {'avx2', 'fma'})
  assert cpu_matmul.kernel_isa() == 'avx2'
  monkeypatch.setenv('JAXSPEC_KERNEL_ISA', 'avx512')  # Asked for what the CPU lacks.
  assert cpu_matmul.kernel_isa() is None
  monkeypatch.setenv('JAXSPEC_KERNEL_ISA', 'avx2')
  assert cpu_matmul.kernel_isa() == 'avx2'
  monkeypatch.setattr(cpu_matmul, '_cpu_flags', lambda: {'avx2'})
  assert cpu_matmul.kernel_isa() is None
  monkeypatch.setenv('JAXSPEC_KERNEL_ISA', 'sse')
  with pytest.raises(ValueError, match='JAXSPEC_KERNEL_ISA'):
    cpu_matmul.kernel_isa()
  # Each build is cached under its own name.
  assert cpu_matmul.library_path('g++', 'avx2') != cpu_matmul.library_path('g++', 'avx512')
  assert {'-mavx512f', '-mavx512vnni'} <= set(cpu_matmul.compile_flags('avx512'))
  assert '-mavx512f' not in cpu_matmul.compile_flags('avx2')


_OTHER_BUILD_CHECK = """
import sys
import jax, jax.numpy as jnp, numpy as np
from jaxspec.model.cpu import matmul as cpu_matmul
assert cpu_matmul.kernel_isa() == 'avx2' and cpu_matmul.kernel_available()
rng = np.random.default_rng(5)
x = rng.standard_normal((16, 260)).astype(np.float32)
w = rng.standard_normal((600, 260)).astype(np.float32)
kernel = jax.jit(cpu_matmul.few_row_matmul)
singles = np.stack([np.asarray(kernel(jnp.asarray(x[n:n + 1]), jnp.asarray(w)))[0]
                    for n in range(16)])
for k in range(2, 17):
  np.testing.assert_array_equal(np.asarray(kernel(jnp.asarray(x[:k]), jnp.asarray(w))),
                                singles[:k])
scale = np.abs(x).astype(np.float64) @ np.abs(w).astype(np.float64).T
assert np.all(np.abs(singles - x.astype(np.float64) @ w.astype(np.float64).T)
              <= 1e-6 * scale + 1e-6)
# The attention kernel keeps its exactness property in this build too.
from jaxspec.model.cpu import attention as cpu_attention
q = jnp.asarray(rng.standard_normal((1, 9, 4, 20)).astype(np.float32))
k, v = (jnp.asarray(rng.standard_normal((1, 4, 20, 40)).astype(np.float32)) for _ in 'kv')
seen = np.arange(40)[None, :] <= 11 + np.arange(9)[:, None]
b = jnp.asarray(np.where(seen, 0.0, -1e10).astype(np.float32))[None, None]
attend = jax.jit(lambda q, k, v, b, n: cpu_attention.kernel_attention(
    q, k, v, b, n, cpu_attention.query_flags(q)))
step = np.asarray(attend(q, k, v, b, jnp.asarray([20], jnp.int32)))
for i in range(9):
  np.testing.assert_array_equal(np.asarray(attend(
      q[:, i:i + 1], k, v, b[:, :, i:i + 1], jnp.asarray([12 + i], jnp.int32)))[:, 0], step[:, i])
np.testing.assert_allclose(step, np.asarray(cpu_attention.xla_cached_attention(q, k, v, b)),
                           rtol=2e-5, atol=2e-5)
# Int8 products are exact integer sums: the parent compares them with its own build's.
from jaxspec.model.quantization import quantize_rows
w_q, w_scale = quantize_rows(w)
np.save(sys.argv[1], np.asarray(jax.jit(cpu_matmul.few_row_matmul_int8)(
    jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(w_scale))))
print('avx2 build ok')
"""


@needs_kernel
@pytest.mark.skipif(cpu_matmul.kernel_isa() != 'avx512',
                    reason='the AVX2 build is the default where the CPU lacks AVX-512')
def test_the_avx2_build_on_an_avx512_cpu(tmp_path):
  """The tests above run the AVX-512 build here; the AVX2 build (CPUs without AVX-512)
  keeps its exactness property too (products and cached attention), in a process of its
  own, and computes the same int8 products bit for bit (exact integer sums in both)."""
  import os
  import subprocess
  import sys
  env = dict(os.environ, JAXSPEC_KERNEL_ISA='avx2', JAX_PLATFORMS='cpu')
  saved = tmp_path / 'int8.npy'
  result = subprocess.run([sys.executable, '-c', _OTHER_BUILD_CHECK, str(saved)], env=env,
                          capture_output=True, text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'avx2 build ok' in result.stdout
  from jaxspec.model.quantization import quantize_rows
  rng = np.random.default_rng(5)
  x = rng.standard_normal((16, 260)).astype(np.float32)
  w_q, w_scale = quantize_rows(rng.standard_normal((600, 260)).astype(np.float32))
  np.testing.assert_array_equal(
      np.asarray(_int8_kernel(jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(w_scale))),
      np.load(saved))


# The int8 handler (int8 drafts): weights int8 [out, in] with a scale per output, each
# row of x quantized to int8 on the fly.

def _int8_operands(rows, inputs, outputs, seed=3):
  from jaxspec.model.quantization import quantize_rows
  x, w_t = _operands(rows, inputs, outputs, seed)
  w_q, scale = quantize_rows(w_t)
  return x, w_q, scale


def _int8_reference(x, w_q, scale):
  """The handler's arithmetic in numpy: exact integer sums, then the two scales."""
  peak = np.max(np.abs(x), axis=-1, keepdims=True)
  x_scale = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
  xq = np.clip(np.rint(x / x_scale), -127, 127).astype(np.int64)
  sums = (xq @ w_q.astype(np.int64).T).astype(np.float32)
  return sums * scale * x_scale


def _int8_grouped_reference(x, w_q, scale, group):
  """The tiled form's arithmetic in numpy: each row's inputs in groups of `group` (the
  last one shorter), each group quantized over its own largest magnitude, its exact
  integer sums times its scale, summed over the groups, times the weights' scale."""
  y = np.zeros((x.shape[0], w_q.shape[0]), np.float64)
  for first in range(0, x.shape[1], group):
    part = x[:, first:first + group]
    peak = np.max(np.abs(part), axis=-1, keepdims=True)
    x_scale = np.where(peak > 0, peak / np.float32(127), np.float32(1)).astype(np.float32)
    xq = np.clip(np.rint(part / x_scale), -127, 127).astype(np.int64)
    y += (xq @ w_q[:, first:first + group].astype(np.int64).T) * x_scale.astype(np.float64)
  return (y * scale).astype(np.float32)


_int8_kernel = jax.jit(cpu_matmul.few_row_matmul_int8)


@needs_kernel
@pytest.mark.parametrize('rows,inputs,outputs', [
    (1, 64, 40),  # one row, one thread
    (2, 77, 515),  # a tail past the last 32-byte block; outputs split in parts
    (11, 512, 1030),  # rows in blocks of 4 and a remainder; an outputs remainder
    (32, 130, 203),  # the most rows; a tail past the last 64-byte block (VNNI)
])
def test_int8_kernel_equals_its_integer_reference_and_xla(rows, inputs, outputs):
  x, w_q, scale = _int8_operands(rows, inputs, outputs)
  got = np.asarray(_int8_kernel(jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(scale)))
  np.testing.assert_allclose(got, _int8_reference(x, w_q, scale), rtol=1e-6, atol=1e-6)
  xla = np.asarray(cpu_matmul.xla_matmul_int8(jnp.asarray(x), jnp.asarray(w_q),
                                              jnp.asarray(scale)))
  np.testing.assert_allclose(got, xla, rtol=1e-5, atol=1e-5)
  # And it approximates the float product (int8 weights and activations).
  exact = x @ (w_q * scale[:, None]).T
  assert np.max(np.abs(got - exact)) <= 0.05 * np.max(np.abs(exact))


@needs_kernel
def test_int8_rows_are_independent_and_xla_runs_where_the_kernel_cannot():
  x, w_q, scale = (jnp.asarray(a) for a in _int8_operands(9, 100, 300, seed=4))
  singles = np.stack([np.asarray(_int8_kernel(x[n:n + 1], w_q, scale))[0] for n in range(9)])
  np.testing.assert_array_equal(np.asarray(_int8_kernel(x, w_q, scale)), singles)
  zero = np.asarray(_int8_kernel(jnp.zeros((2, 100), jnp.float32), w_q, scale))
  np.testing.assert_array_equal(zero, np.zeros((2, 300), np.float32))

  def calls_kernel(x, setting):
    jaxpr = jax.make_jaxpr(lambda x: cpu_matmul.matmul_int8(x, w_q, scale, setting))(x)
    return cpu_matmul.INT8_TARGET_NAME in str(jaxpr)

  assert calls_kernel(x[None], cpu_matmul.KERNEL)
  assert not calls_kernel(x[None], cpu_matmul.XLA)
  assert not calls_kernel(jnp.ones((3, 11, 100), jnp.float32), cpu_matmul.KERNEL)  # 33 rows
  many = jnp.ones((2, 9, 100), jnp.float32)
  np.testing.assert_allclose(np.asarray(cpu_matmul.matmul_int8(many, w_q, scale)),
                             _int8_reference(np.ones((18, 100), np.float32), np.asarray(w_q),
                                             np.asarray(scale)).reshape(2, 9, 300),
                             rtol=1e-5, atol=1e-5)


needs_tiles = pytest.mark.skipif(not cpu_matmul.int8_tiles_apply(),
                                 reason='the tiled int8 form runs in the AVX-512 VNNI build')


def test_tiles_hold_each_weight_where_the_kernel_reads_it():
  from jaxspec.model.quantization import tile_int8, tileable
  q = np.arange(128 * 8, dtype=np.int64).reshape(128, 8).astype(np.int8)
  tiles = tile_int8(q)
  assert tiles.shape == (2, 2, 64, 4) and tiles.flags['C_CONTIGUOUS']
  for t, g, j, k in [(0, 0, 0, 0), (1, 0, 5, 3), (0, 1, 63, 2), (1, 1, 17, 1)]:
    assert tiles[t, g, j, k] == q[64 * t + j, 4 * g + k]
  np.testing.assert_array_equal(np.asarray(cpu_matmul.untile_int8(jnp.asarray(tiles))), q)
  assert cpu_matmul.int8_shape(tiles) == (128, 8)
  assert not tileable(np.zeros((100, 8), np.int8)) and not tileable(np.zeros((64, 6), np.int8))


def test_rows_gather_from_the_tiles():
  """The lookup of a tiled int8 table gathers row v from tile v // 64, lane v % 64."""
  from jaxspec.model.quantization import tile_int8
  table = (np.arange(192 * 8) % 251 - 125).astype(np.int8).reshape(192, 8)
  tokens = jnp.asarray([[0, 63, 64], [127, 128, 191]], jnp.int32)
  np.testing.assert_array_equal(cpu_matmul.int8_rows(jnp.asarray(tile_int8(table)), tokens),
                                table[np.asarray(tokens)])
  np.testing.assert_array_equal(cpu_matmul.int8_rows(jnp.asarray(table), tokens),
                                table[np.asarray(tokens)])


@needs_kernel
@needs_tiles
@pytest.mark.parametrize('rows', [1, 2, 3, 4, 5, 9, 32])
@pytest.mark.parametrize('inputs,outputs', [(512, 2048), (2048, 512), (12, 192), (100, 128)])
def test_tiled_int8_quantizes_activations_per_group_as_its_reference(rows, inputs, outputs,
                                                                    monkeypatch):
  """Tiled weights (outputs in the vector lanes) quantize x per 32 inputs: the kernel
  equals the grouped integer reference and XLA, for one row (two tiles side by side),
  blocks of 5 rows and a remainder, an odd tile count, an input of 3 groups of 4 and one
  whose last group is short. With one scale a row instead, they give the [out, in] form's
  products bit for bit (the same exact integer sums)."""
  from jaxspec.model.quantization import tile_int8
  x, w_q, scale = _int8_operands(rows, inputs, outputs, seed=rows)
  x[:, 3] *= 40  # an outlier, which coarsens only its own group
  tiles = jnp.asarray(tile_int8(w_q))
  x, w_q, scale = jnp.asarray(x), jnp.asarray(w_q), jnp.asarray(scale)
  assert cpu_matmul.applies_int8(x, tiles, scale) and cpu_matmul.activation_group(tiles) == 32
  got = np.asarray(cpu_matmul.few_row_matmul_int8(x, tiles, scale))
  reference = _int8_grouped_reference(np.asarray(x), np.asarray(w_q), np.asarray(scale), 32)
  np.testing.assert_allclose(got, reference, rtol=1e-5, atol=1e-5 * np.max(np.abs(reference)))
  np.testing.assert_allclose(np.asarray(cpu_matmul.xla_matmul_int8(x, tiles, scale)), got,
                             rtol=1e-5, atol=1e-5 * np.max(np.abs(reference)))
  rows_form = np.asarray(_int8_kernel(x, w_q, scale))
  if inputs > 32:  # Groups are closer to the float product than one scale a row.
    exact = np.asarray(x) @ (np.asarray(w_q) * np.asarray(scale)[:, None]).T
    assert np.mean(np.abs(got - exact)) < 0.7 * np.mean(np.abs(rows_form - exact))
  monkeypatch.setattr(cpu_matmul, 'TILED_ACTIVATION_GROUP', 0)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.few_row_matmul_int8(x, tiles, scale)),
                                rows_form)


@needs_kernel
@needs_tiles
def test_tiled_int8_in_one_call_of_several_matrices_and_with_ended_rows():
  from jaxspec.model.quantization import tile_int8
  x = jnp.asarray(np.random.default_rng(2).standard_normal((3, 256)).astype(np.float32))
  pairs = [tuple(jnp.asarray(a) for a in _int8_operands(1, 256, out, seed=out)[1:])
           for out in (256, 640, 128)]
  tiled = [(jnp.asarray(tile_int8(np.asarray(w))), s) for w, s in pairs]
  singles = [_int8_kernel(x, *pair) for pair in tiled]
  for got, expected in zip(cpu_matmul.few_row_matmuls_int8(x, tiled), singles):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))
  # A row that ended (row_flags 0) gets zeros, the others their own products.
  active = jnp.asarray([1, 0, 1], jnp.int32)
  got = jax.ffi.ffi_call(cpu_matmul.INT8_TARGET_NAME,
                         jax.ShapeDtypeStruct((3, 256), jnp.float32))(
                             x, *tiled[0], active,
                             activation_group=np.int64(cpu_matmul.TILED_ACTIVATION_GROUP))
  expected = np.asarray(singles[0]) * np.asarray([[1], [0], [1]], np.float32)
  np.testing.assert_array_equal(np.asarray(got), expected)


@needs_kernel
@pytest.mark.parametrize('threads_setting', ['spin', 'pool'])
def test_concurrent_callers_and_either_thread_setting_give_the_same_products(
    threads_setting, monkeypatch):
  """Parts go to the kernel's own helper threads (default) or to XLA's pool
  (JAXSPEC_KERNEL_THREADS=pool); callers on several threads at once (one gets the
  helpers, the others run their parts alone) all get their own, exact products."""
  import concurrent.futures
  monkeypatch.setenv('JAXSPEC_KERNEL_THREADS', threads_setting)
  operands = [_operands(1 + n % 3, 512, 1030, seed=10 + n) for n in range(6)]
  quantized = [_int8_operands(1 + n % 3, 512, 1030, seed=20 + n) for n in range(6)]
  expected = [np.asarray(_kernel(jnp.asarray(x), jnp.asarray(w))) for x, w in operands]
  expected_int8 = [_int8_reference(*ops) for ops in quantized]

  def call(start):
    for i in range(start, start + 24):  # Other operands each call: no stale output passes.
      n = i % 6
      x, w = operands[n]
      np.testing.assert_array_equal(np.asarray(_kernel(jnp.asarray(x), jnp.asarray(w))),
                                    expected[n])
      got = np.asarray(_int8_kernel(*(jnp.asarray(a) for a in quantized[n])))
      np.testing.assert_allclose(got, expected_int8[n], rtol=1e-6, atol=1e-6)

  with concurrent.futures.ThreadPoolExecutor(3) as pool:
    list(pool.map(call, range(3)))


# Several matrices against the same rows in one call (a layer's q/k/v, the MLP's
# wi_0/wi_1): each result must equal its own call's bit for bit.

@needs_kernel
@pytest.mark.parametrize('rows,outs', [(1, (512, 512, 512)), (9, (40, 515)), (32, (8, 300, 77))])
def test_several_matrices_in_one_call_equal_separate_calls(rows, outs):
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((rows, 130)).astype(np.float32))
  w_ts = [jnp.asarray(rng.standard_normal((out, 130)).astype(np.float32)) for out in outs]
  together = jax.jit(cpu_matmul.few_row_matmuls)(x, tuple(w_ts))
  for got, w_t in zip(together, w_ts):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_kernel(x, w_t)))
  from jaxspec.model.quantization import quantize_rows
  pairs = tuple(tuple(map(jnp.asarray, quantize_rows(np.asarray(w_t)))) for w_t in w_ts)
  together = jax.jit(cpu_matmul.few_row_matmuls_int8)(x, pairs)
  for got, (w_q, scale) in zip(together, pairs):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(_int8_kernel(x, w_q, scale)))


@needs_kernel
def test_several_matrices_fall_back_where_the_kernel_cannot_and_differentiate_like_xla():
  x, w_t = (jnp.asarray(a) for a in _operands(4, 48, 300, seed=2))
  w_ts = (w_t, w_t[:100] * 2.0)

  def names(x, setting, w_ts=w_ts):
    return str(jax.make_jaxpr(lambda x: cpu_matmul.matmuls_transposed(x, w_ts, setting))(x))

  assert cpu_matmul.MANY_TARGET_NAMES[2] in names(x, cpu_matmul.KERNEL)
  assert cpu_matmul.MANY_TARGET_NAMES[2] not in names(x, cpu_matmul.XLA)
  assert cpu_matmul.MANY_TARGET_NAMES[2] not in names(jnp.ones((33, 48), jnp.float32),
                                                     cpu_matmul.KERNEL)  # 33 rows
  # One matrix, or four: one product each.
  assert cpu_matmul.TARGET_NAME in names(x, cpu_matmul.KERNEL, w_ts[:1])
  assert cpu_matmul.MANY_TARGET_NAMES[2] not in names(x, cpu_matmul.KERNEL, w_ts * 2)
  assert len(cpu_matmul.matmuls_transposed(x, w_ts * 2)) == 4

  def loss(matmuls):
    return lambda x, w_ts: sum(jnp.sum(jnp.sin(y)) for y in matmuls(x, w_ts))

  ours = jax.grad(loss(cpu_matmul.few_row_matmuls), argnums=(0, 1))(x, w_ts)
  xla = jax.grad(loss(lambda x, w_ts: tuple(cpu_matmul.xla_matmul_transposed(x, w)
                                            for w in w_ts)), argnums=(0, 1))(x, w_ts)
  for a, b in zip(jax.tree_util.tree_leaves(ours), jax.tree_util.tree_leaves(xla)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


@needs_kernel
def test_a_decode_step_projects_q_k_v_and_the_mlp_inputs_in_one_call_each(monkeypatch):
  """The layers' joint projections change no logit: the same decode step with them and
  with every product in a call of its own (float32 and int8 params)."""
  from jaxspec.model import layers
  from jaxspec.model.quantization import int8_decoder
  params, decode = _tiny_decode_step()

  def one_call_each(x, projections, config):
    return tuple(projection(x) for projection in projections)

  for decode_params in (params, {'params': {**int8_decoder(params)['params'],
                                            'encoder': params['params']['encoder']}}):
    jaxpr = str(jax.make_jaxpr(lambda: decode(decode_params))())
    assert (cpu_matmul.MANY_TARGET_NAMES[3] in jaxpr
            or cpu_matmul.MANY_INT8_TARGET_NAMES[3] in jaxpr)
    joint = np.asarray(decode(decode_params))
    with monkeypatch.context() as patch:
      patch.setattr(layers, 'project_together', one_call_each)
      separate = np.asarray(decode(decode_params))
    np.testing.assert_array_equal(joint, separate)


@needs_kernel
@pytest.mark.parametrize('active', [
    [True, False, True], [False, False, False],  # gathered rows; none
    [False, True, True], [True, True, False], [False, True, False],  # one run, in place
    # per position [b, t]: a verify step's positions up to each row's last proposed one
    [[True, True, True, False], [False] * 4, [False] * 4],  # one run at the start
    [[False] * 4, [True, True, False, False], [True, False, False, False]],  # two runs
])
def test_inactive_rows_are_skipped_and_active_rows_unchanged(active):
  """Inside active_rows, each kernel product (float32 and int8, one matrix or several)
  gives the rows of inactive batch rows (or positions) zeros and the others exactly what
  a product of every row gives, whether the active rows are one run (computed where they
  stand) or several (gathered); rows not led by those axes are all computed."""
  rng = np.random.default_rng(3)
  x = jnp.asarray(rng.standard_normal((3, 4, 96)).astype(np.float32))  # [b, t, in]
  w_ts = [jnp.asarray(rng.standard_normal((out, 96)).astype(np.float32)) for out in (40, 72)]
  w_q = jnp.asarray(rng.integers(-127, 128, (56, 96)), jnp.int8)
  scale = jnp.asarray(rng.random(56).astype(np.float32) + 0.5)

  def products(x):
    return (cpu_matmul.few_row_matmul(x, w_ts[0]), *cpu_matmul.few_row_matmuls(x, w_ts),
            cpu_matmul.few_row_matmul_int8(x, w_q, scale),
            *cpu_matmul.few_row_matmuls_int8(x, [(w_q, scale), (w_q, scale)]))

  def masked(x, mask):
    with cpu_matmul.active_rows(mask):
      return products(x), products(x[0])  # x[0]: rows [t, in], not led by the batch axis

  everything = jax.jit(products)(x)
  (skipping, unbatched) = jax.jit(masked)(x, jnp.asarray(active))
  for full, got in zip(everything, skipping):
    np.testing.assert_array_equal(np.asarray(got)[np.asarray(active)],
                                  np.asarray(full)[np.asarray(active)])
    assert not np.any(np.asarray(got)[~np.asarray(active)])
  for full, got in zip(everything, unbatched):
    np.testing.assert_array_equal(got, np.asarray(full)[0])


# ---- Float32 weights tiled with the outputs in the lanes ([out / 16, in, 16]) ----

needs_float_tiles = pytest.mark.skipif(not cpu_matmul.tiled_floats_apply(),
                                       reason='the tiled float32 form runs in the AVX-512 build')


def _float64_row_order(x, w_t):
  """Each output summed over its inputs in input order, one float32 FMA at a time: what
  the tiled form computes (np.float32 products and sums, fused by rounding once)."""
  acc = np.zeros((x.shape[0], w_t.shape[0]), np.float32)
  for i in range(x.shape[1]):
    acc = (acc.astype(np.float64) + np.outer(x[:, i], w_t[:, i]).astype(np.float64)
           ).astype(np.float32)
  return acc


def test_float_tiles_hold_each_weight_where_the_kernel_reads_it():
  w_t = np.arange(48 * 5, dtype=np.float32).reshape(48, 5)
  tiles = cpu_matmul.tile_kernel(w_t)
  assert tiles.shape == (3, 5, 16) and tiles.flags['C_CONTIGUOUS']
  for t, i, lane in [(0, 0, 0), (1, 4, 15), (2, 2, 7)]:
    assert tiles[t, i, lane] == w_t[16 * t + lane, i]
  np.testing.assert_array_equal(cpu_matmul.untile_kernel(tiles), w_t)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.untile_kernel(jnp.asarray(tiles))), w_t)
  np.testing.assert_array_equal(np.asarray(cpu_matmul.tile_kernel(jnp.asarray(w_t))), tiles)
  assert cpu_matmul.tileable(w_t) and not cpu_matmul.tileable(np.zeros((40, 5), np.float32))
  x = np.random.default_rng(0).standard_normal((2, 5)).astype(np.float32)
  np.testing.assert_allclose(np.asarray(cpu_matmul.xla_matmul_tiled(x, tiles)), x @ w_t.T,
                             rtol=1e-6)


@needs_kernel
@needs_float_tiles
@pytest.mark.parametrize('rows', [1, 2, 5, 6, 7, 10, 12, 13, 40])
@pytest.mark.parametrize('inputs,outputs', [(512, 1536), (2048, 512), (7, 48), (64, 16)])
def test_tiled_float32_sums_each_output_in_input_order(rows, inputs, outputs):
  """The tiled form's products against a reference that sums each output over its inputs
  in order in float32 (within the rounding of fused multiply-adds), against float64, and
  for every row count: one row (8 tiles a block), 2..6 rows, 7..12 in one pass, more in
  passes, an odd tile count and inputs no multiple of a vector."""
  x, w_t = _operands(rows, inputs, outputs, seed=rows + inputs)
  tiles = jnp.asarray(cpu_matmul.tile_kernel(w_t))
  assert cpu_matmul.applies_tiled(jnp.asarray(x), tiles)
  got = np.asarray(jax.jit(cpu_matmul.few_row_matmul)(jnp.asarray(x), tiles))
  assert got.shape == (rows, outputs)
  scale = np.abs(x).astype(np.float64) @ np.abs(w_t).astype(np.float64).T
  expected = x.astype(np.float64) @ w_t.astype(np.float64).T
  assert np.all(np.abs(got - expected) <= 1e-6 * scale + 1e-6)
  if inputs <= 64:
    in_order = _float64_row_order(x, w_t)
    assert np.all(np.abs(got - in_order) <= 1e-6 * scale + 1e-7)


@needs_kernel
@needs_float_tiles
def test_a_tiled_row_is_bit_identical_whatever_rows_share_the_product():
  """What keeps a verify step's logits equal to the one-position steps' logits in the
  tiled layout: every block shape and pass split sums a row's outputs alike."""
  x, w_t = _operands(40, 300, 96, seed=5)
  x, tiles = jnp.asarray(x), jnp.asarray(cpu_matmul.tile_kernel(w_t))
  kernel = jax.jit(cpu_matmul.few_row_matmul)
  singles = np.stack([np.asarray(kernel(x[n:n + 1], tiles))[0] for n in range(40)])
  for k in (*range(2, 14), 16, 24, 25, 40):
    np.testing.assert_array_equal(np.asarray(kernel(x[:k], tiles)), singles[:k])
  np.testing.assert_array_equal(np.asarray(kernel(x[:10].reshape(2, 5, 300), tiles)),
                                singles[:10].reshape(2, 5, 96))


@needs_kernel
@needs_float_tiles
def test_tiled_float32_in_one_call_of_several_matrices_with_ended_rows_and_gradients():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((3, 4, 128)).astype(np.float32))  # [b, t, in]
  tiles = [jnp.asarray(cpu_matmul.tile_kernel(rng.standard_normal((out, 128)).astype(np.float32)))
           for out in (128, 320, 64)]
  separate = [np.asarray(cpu_matmul.matmul_transposed(x, t)) for t in tiles]
  for k in (2, 3):
    for got, expected in zip(cpu_matmul.matmuls_transposed(x, tiles[:k]), separate):
      np.testing.assert_array_equal(np.asarray(got), expected)
  # A mix of tiled and [out, in] matrices goes one product each, as separate calls.
  w_t = rng.standard_normal((48, 128)).astype(np.float32)
  mixed = cpu_matmul.matmuls_transposed(x, [tiles[0], jnp.asarray(w_t)])
  np.testing.assert_array_equal(np.asarray(mixed[0]), separate[0])
  np.testing.assert_array_equal(np.asarray(mixed[1]),
                                np.asarray(cpu_matmul.matmul_transposed(x, jnp.asarray(w_t))))
  active = jnp.asarray([True, False, True])
  with cpu_matmul.active_rows(active):
    masked = jax.jit(lambda x: cpu_matmul.matmuls_transposed(x, tiles))(x)
  for got, expected in zip(masked, separate):
    np.testing.assert_array_equal(np.asarray(got)[[0, 2]], expected[[0, 2]])
    assert not np.any(np.asarray(got)[1])
  # XLA where the kernel does not run (cpu_matmul 'xla'), and gradients through XLA.
  np.testing.assert_allclose(np.asarray(cpu_matmul.matmul_transposed(x, tiles[0], 'xla')),
                             separate[0], rtol=1e-5, atol=1e-5)
  grad = jax.grad(lambda x: jnp.sum(cpu_matmul.matmul_transposed(x, tiles[1]) ** 2))(x)
  grad_xla = jax.grad(lambda x: jnp.sum(cpu_matmul.xla_matmul_tiled(x, tiles[1]) ** 2))(x)
  np.testing.assert_allclose(np.asarray(grad), np.asarray(grad_xla), rtol=1e-4, atol=1e-4)
