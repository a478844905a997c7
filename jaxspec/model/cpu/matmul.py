"""jaxspec's CPU kernel for products of a few rows with a weight matrix.

A decode step multiplies 1..gamma+1 positions by every weight matrix. XLA:CPU runs one
row at memory speed but 2..9 rows through a matrix-matrix path that costs about twice
as much, so a verify step costs ~2x a one-position step (docs/performance.md, "Kernel layout
and the cost of a verify step"). `cpu_kernels/few_row_matmul.cc` is an XLA FFI handler
that reads each weight once and keeps every row in registers (AVX2 + FMA, or AVX-512
where the CPU has it: `kernel_isa`; the outputs split across the kernel's helper
threads): k rows cost little more than one, and the one-row product is faster than
XLA's.

  few_row_matmul(x, w_t)             x [..., in] @ w_t [out, in]^T through the kernel
  matmul_transposed(x, w_t, kernel)  the kernel where it applies, else XLA's einsum
  matmuls_transposed(x, w_ts, kernel)
                                     x against 2 or 3 matrices in ONE kernel call (a
                                     layer's q/k/v), each result bit-identical to its
                                     own call's; else one product each
  matmul_int8(x, w_q, scale, kernel) x @ (w_q * scale)^T for int8 w_q [out, in], x's rows
                                     quantized to int8 on the fly (int8 drafts,
                                     jaxspec.model.quantization): the kernel's int8
                                     handler where it applies, else XLA
  matmuls_int8(x, pairs, kernel)     matmul_int8 against 2 or 3 (w_q, scale) pairs in ONE
                                     call (the rows quantized once)
  active_rows(active)                within it, products and the attention kernels skip
                                     the rows of finished batch rows
  decode_step()                      within it (a decoder step), products of any rows
                                     go through the kernel
  kernel_available()                 builds (once) and registers the kernel; False if not
  kernel_status(cpu_matmul)          'kernel (avx512)' or 'XLA (why)': what steps use here

Where it applies: float32 operands (int8 weights for matmul_int8), at most MAX_ROWS rows
(the product of x's leading dims) or any rows within a decoder step (decode_step), JAX's
default backend is the CPU, and `T5Config.cpu_matmul == 'kernel'`.
Elsewhere (prefill, training, bfloat16, TPU/GPU) XLA's einsum runs as before.

Exactness: the kernel sums every output in the same order whatever the number of rows,
so a row of a k-row product is bit-identical to its one-row product; a verify step
and the baseline's steps compute the same logits bit for bit. Against XLA's einsum
the results differ by float32 rounding only (tests/test_cpu_matmul.py).

The sources (with the cached-attention kernel of jaxspec.model.cpu.attention: one
library) are compiled on first use with the C++ compiler found as $CXX, g++ or c++,
against the FFI headers jaxlib ships, into a cache directory ($JAXSPEC_KERNEL_CACHE,
default ~/.cache/jaxspec/kernels) under a name keyed by the sources, the compiler
flags (the instruction set among them) and the jaxlib version. Without a compiler,
AVX2 or FMA, or when the build fails, one warning says why and every product runs
through XLA (same results up to rounding, slower verify steps).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import hashlib
import os
import pathlib
import platform
import shutil
import subprocess
import tempfile
import warnings

import jax
import jax.numpy as jnp
import jaxlib
import numpy as np

from jaxspec.config import CPU_MATMUL_KERNEL as KERNEL
from jaxspec.config import CPU_MATMUL_XLA as XLA
from jaxspec.config import check_cpu_matmul
# Products of at most MAX_ROWS rows go through the kernel anywhere (a batch-1 encoder's
# too); within a decoder step (decode_step) every product does, so that a step's logits
# are bit for bit the same at every width: a verify step over many rows x positions
# computes each row as the baseline's one-position steps do. The float32 handlers take
# any rows; the int8 handlers at most INT8_CALL_ROWS (kMaxRows in the source), more
# running in several calls.
MAX_ROWS = 32
INT8_CALL_ROWS = 128
TRANSPOSED_CONTRACTION_ROWS = 16  # XLA's [b, out, t] contraction up to this many positions.
TARGET_NAME = 'jaxspec_few_row_matmul'
INT8_TARGET_NAME = 'jaxspec_few_row_matmul_int8'
ATTENTION_TARGET_NAME = 'jaxspec_cached_attention'  # jaxspec.model.cpu.attention
ATTENTION_WRITE_TARGET_NAME = 'jaxspec_cached_attention_write'  # ... with the cache write
# Two or three weight matrices against the same rows in one call (a layer's q/k/v, the
# MLP's wi_0/wi_1), float32 and int8.
MANY_TARGET_NAMES = {2: 'jaxspec_few_row_matmul_2', 3: 'jaxspec_few_row_matmul_3'}
MANY_INT8_TARGET_NAMES = {2: 'jaxspec_few_row_matmul_int8_2', 3: 'jaxspec_few_row_matmul_int8_3'}
KERNEL_DIR = pathlib.Path(__file__).parent / 'kernels'
# One library holds every CPU kernel: these sources, compiled together, and the header
# they share (its bytes key the build too).
SOURCES = (KERNEL_DIR / 'few_row_matmul.cc', KERNEL_DIR / 'cached_attention.cc')
HEADERS = (KERNEL_DIR / 'float_vectors.h', KERNEL_DIR / 'spin_pool.h')
COMPILE_FLAGS = ('-O3', '-std=c++17', '-shared', '-fPIC', '-pthread', '-w')
# The instruction sets the kernel is built for: AVX-512 (16-lane float32 vectors, 32
# registers; int8 products by VNNI) where the CPU has it, else AVX2 + FMA.
# $JAXSPEC_KERNEL_ISA ('avx2' or 'avx512') chooses one; a row's float32 results depend on
# the choice (its lanes of summation), so compare decoders only within one build (int8
# products are exact integer sums, the same in both).
ISA_FLAGS = {'avx2': ('-mavx2', '-mfma'),
             'avx512': ('-mavx2', '-mfma', '-mavx512f', '-mavx512bw', '-mavx512vnni')}
ISA_CPU_FLAGS = {'avx2': {'avx2', 'fma'},
                 'avx512': {'avx2', 'fma', 'avx512f', 'avx512bw', 'avx512_vnni'}}
_SYMBOLS = {TARGET_NAME: 'JaxspecFewRowMatmul', INT8_TARGET_NAME: 'JaxspecFewRowMatmulInt8',
            ATTENTION_TARGET_NAME: 'JaxspecCachedAttention',
            ATTENTION_WRITE_TARGET_NAME: 'JaxspecCachedAttentionWrite',
            MANY_TARGET_NAMES[2]: 'JaxspecFewRowMatmul2',
            MANY_TARGET_NAMES[3]: 'JaxspecFewRowMatmul3',
            MANY_INT8_TARGET_NAMES[2]: 'JaxspecFewRowMatmulInt8x2',
            MANY_INT8_TARGET_NAMES[3]: 'JaxspecFewRowMatmulInt8x3'}


def xla_matmul_transposed(x, w_t):
  """x [..., in] @ w_t [out, in]^T -> [..., out] through XLA.

  A [b, t, in] input with t <= TRANSPOSED_CONTRACTION_ROWS is contracted into
  [b, out, t] and swapped: for such shapes XLA:CPU picks a faster matmul than for
  x @ w_t.T.
  """
  if x.ndim == 3 and x.shape[1] <= TRANSPOSED_CONTRACTION_ROWS:
    return jnp.swapaxes(jnp.einsum('bti,oi->bot', x, w_t), 1, 2)  # [b, t, out]
  return jnp.einsum('...i,oi->...o', x, w_t)


def _cpu_flags() -> set[str]:
  """This CPU's feature flags (/proc/cpuinfo; empty off x86-64 Linux)."""
  if platform.machine().lower() not in ('x86_64', 'amd64'):
    return set()
  try:
    with open('/proc/cpuinfo') as cpuinfo:
      for line in cpuinfo:
        if line.startswith('flags'):
          return set(line.split(':', 1)[1].split())
  except OSError:
    pass
  return set()


def kernel_isa() -> str | None:
  """The instruction set the kernel is built for here ($JAXSPEC_KERNEL_ISA, else the
  widest this CPU has), or None where the CPU lacks AVX2 or FMA."""
  flags = _cpu_flags()
  chosen = os.environ.get('JAXSPEC_KERNEL_ISA')
  if chosen is not None:
    if chosen not in ISA_FLAGS:
      raise ValueError(f'JAXSPEC_KERNEL_ISA must be one of {sorted(ISA_FLAGS)}, got {chosen!r}')
    return chosen if ISA_CPU_FLAGS[chosen] <= flags else None
  for isa in ('avx512', 'avx2'):
    if ISA_CPU_FLAGS[isa] <= flags:
      return isa
  return None


def compile_flags(isa: str) -> tuple[str, ...]:
  return COMPILE_FLAGS + ISA_FLAGS[isa]


def _compiler() -> str | None:
  for name in (os.environ.get('CXX'), 'g++', 'c++', 'clang++'):
    if name and shutil.which(name):
      return shutil.which(name)
  return None


def cache_dir() -> pathlib.Path:
  """Where built kernels are kept ($JAXSPEC_KERNEL_CACHE or ~/.cache/jaxspec/kernels)."""
  default = pathlib.Path(os.environ.get('XDG_CACHE_HOME', pathlib.Path.home() / '.cache'))
  return pathlib.Path(os.environ.get('JAXSPEC_KERNEL_CACHE', default / 'jaxspec' / 'kernels'))


def library_path(compiler: str, isa: str) -> pathlib.Path:
  """The built library's path, keyed by sources, compiler, flags and jaxlib version."""
  key = hashlib.sha256()
  for part in (*(path.read_bytes() for path in SOURCES + HEADERS), compiler.encode(),
               ' '.join(compile_flags(isa)).encode(), jaxlib.__version__.encode()):
    key.update(part)
    key.update(b'\0')
  return cache_dir() / f'few_row_matmul-{key.hexdigest()[:16]}.so'


def build(compiler: str, path: pathlib.Path, isa: str) -> None:
  """Compiles SOURCES into `path` (atomically: concurrent builders never see half a file)."""
  path.parent.mkdir(parents=True, exist_ok=True)
  with tempfile.TemporaryDirectory(dir=path.parent) as scratch:
    built = pathlib.Path(scratch) / path.name
    command = [compiler, *compile_flags(isa), f'-I{jax.ffi.include_dir()}',
               *(str(source) for source in SOURCES), '-o', str(built)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
      raise RuntimeError(f'{" ".join(command)} failed:\n{result.stderr[-2000:]}')
    os.replace(built, path)


@functools.cache
def kernel_available() -> bool:
  """Builds (first call per cache) and registers the kernel; False, warning once, if it can't."""
  isa = kernel_isa()
  if isa is None:
    return _unavailable('this CPU lacks AVX2 or FMA (or the instructions of '
                        '$JAXSPEC_KERNEL_ISA)')
  compiler = _compiler()
  if compiler is None:
    return _unavailable('no C++ compiler ($CXX, g++, c++ or clang++) is on PATH')
  try:
    path = library_path(compiler, isa)
    if not path.exists():
      build(compiler, path, isa)
    library = ctypes.cdll.LoadLibrary(str(path))
    for target, symbol in _SYMBOLS.items():
      jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, symbol)),
                                  platform='cpu')
  except (OSError, RuntimeError, AttributeError) as error:
    return _unavailable(f'building or loading it failed: {error}')
  return True


_UNAVAILABLE_REASON: list[str] = []  # Why kernel_available() said False, once it has.


def kernel_status(cpu_matmul: str = KERNEL) -> str:
  """What decode steps use here, in words: 'kernel (avx512)' / 'kernel (avx2)', or
  'XLA (...)' with the reason (the setting, the platform, or why the kernel is
  unavailable). Launchers report it so a lost kernel is never silent."""
  if cpu_matmul != KERNEL:
    return f'XLA (T5Config.cpu_matmul={cpu_matmul!r})'
  if jax.default_backend() != 'cpu':
    return f'XLA (platform {jax.default_backend()}: the kernel is CPU-only)'
  if kernel_available():
    return f'kernel ({kernel_isa()})'
  return f'XLA (kernel unavailable: {_UNAVAILABLE_REASON[-1]})'


def _unavailable(reason: str) -> bool:
  _UNAVAILABLE_REASON.append(reason)
  warnings.warn(f'jaxspec CPU matmul kernel unavailable ({reason}); decode steps use '
                "XLA's matmul (same results up to rounding, slower verify steps)",
                RuntimeWarning, stacklevel=3)
  return False


_DECODE_STEP = contextvars.ContextVar('jaxspec_decode_step', default=False)


@contextlib.contextmanager
def decode_step():
  """Within it (a decoder step, jaxspec.model.t5.Decoder) products of any number of rows
  go through the kernel: each row's result is its one-row product's bit for bit,
  whatever the step's width. Outside it only products of at most MAX_ROWS rows do
  (XLA's einsum takes encoders' many rows)."""
  token = _DECODE_STEP.set(True)
  try:
    yield
  finally:
    _DECODE_STEP.reset(token)


def kernel_takes(rows: int) -> bool:
  """Whether a product of `rows` rows (or an attention of `rows` queries a batch row,
  jaxspec.model.cpu.attention) goes through the kernels (decode_step)."""
  return rows >= 1 and (rows <= MAX_ROWS or _DECODE_STEP.get())


def _in_calls(compute, x, flags):
  """compute(x [r, in], flags [r]) -> a tuple of [r, out_k], over the rows of x [..., in]
  in calls of at most INT8_CALL_ROWS rows of nearly equal size -> a tuple of
  [..., out_k] (the int8 handlers' limit; a row's result depends on that row alone)."""
  rows = flags.shape[0]
  if rows <= INT8_CALL_ROWS:
    return compute(x, flags)
  lead = x.shape[:-1]
  flat = x.reshape(rows, x.shape[-1])  # [rows, in]
  calls = -(-rows // INT8_CALL_ROWS)
  size = -(-rows // calls)
  parts = [compute(flat[start:start + size], flags[start:start + size])
           for start in range(0, rows, size)]
  return tuple(jnp.concatenate(outputs, axis=0).reshape(lead + outputs[0].shape[-1:])
               for outputs in zip(*parts))


def applies(x, w_t) -> bool:
  """Whether the kernel can compute x [..., in] @ w_t [out, in]^T (shapes and dtypes;
  rows: decode_step), or x against tiles [out / 16, in, 16] (applies_tiled)."""
  if w_t.ndim == 3:
    return applies_tiled(x, w_t)
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  return (x.dtype == jnp.float32 and w_t.dtype == jnp.float32 and w_t.ndim == 2
          and x.ndim >= 1 and x.shape[-1] == w_t.shape[1] and kernel_takes(rows))


# Rows that need no product: inside `active_rows(active)` the kernel computes only the
# rows of x [b, t, ..., in] that `active` ([b] per batch row, or [b, t] per position) marks,
# as in a product of all rows, and gives the others zeros. The decoding loops mark the
# rows still decoding (and the verify step the positions a row proposed): once a step's
# products are compute-bound (several rows, each over the verify step's positions) a
# finished row then costs nothing.
_ACTIVE_ROWS = contextvars.ContextVar('jaxspec_active_rows', default=None)


@contextlib.contextmanager
def active_rows(active):
  """Within the block, kernel products skip the rows `active` ([b] or [b, t] bool) leaves
  out, and the attention kernels those queries, which write no keys/values to the cache
  (jaxspec.model.cpu.attention); their outputs are zeros. Products whose rows do not lead
  with those axes compute every row. What is left out must be unused: rows that ended, a
  row's positions after its last one kept, or an encoder input's padding (masked wherever
  it is read: jaxspec.model.t5.Encoder)."""
  token = _ACTIVE_ROWS.set(active)
  try:
    yield
  finally:
    _ACTIVE_ROWS.reset(token)


def row_flags(x):
  """int32 [rows]: which rows of x [..., in] the kernel computes (active_rows)."""
  return flags_of(x.shape[:-1])


def flags_of(rows_shape):
  """int32 [prod(rows_shape)]: which rows of that shape [b, t, ...] the kernels compute
  under active_rows (all of them outside it, or where the active flags' shape does not
  lead it)."""
  rows_shape = tuple(rows_shape)
  rows = int(np.prod(rows_shape, dtype=np.int64))
  active = _ACTIVE_ROWS.get()
  if active is None or tuple(active.shape) != rows_shape[:active.ndim]:
    return jnp.ones((rows,), jnp.int32)
  active = active.reshape(active.shape + (1,) * (len(rows_shape) - active.ndim))
  return jnp.broadcast_to(active, rows_shape).reshape(rows).astype(jnp.int32)


# Float32 weights tiled with the outputs in the vector lanes, [out / 16, in, 16]: the
# kernel's AVX-512 build sums each output over its inputs in order, one lane an output,
# with no sum across lanes, and loads each weight vector once for up to 12 rows, so a
# verify step's rows cost less than in the [out, in] form (docs/performance.md; the
# sums differ from that form's by float32 rounding). jaxspec.model.cpu.layout stores the
# decode layout's kernels so (`kernel_tiles`) where tiled_floats_apply().
FLOAT_TILE_OUTPUTS = 16


def tiled_floats_apply() -> bool:
  """Whether float32 products here run through the kernel's tiled form: the CPU, the
  kernel built, for AVX-512."""
  return use_kernel(KERNEL) and kernel_isa() == 'avx512'


def tileable(w_t) -> bool:
  """Whether weights w_t [out, in] tile (tile_kernel): out a multiple of 16."""
  return w_t.ndim == 2 and w_t.shape[0] > 0 and w_t.shape[0] % FLOAT_TILE_OUTPUTS == 0


def tile_kernel(w_t):
  """w_t [out, in] (tileable) -> tiles [out / 16, in, 16]: element [t, i, l] is
  w_t[16 t + l, i], each tile's 16 outputs side by side for each input."""
  out, inputs = w_t.shape
  tiles = w_t.reshape(out // FLOAT_TILE_OUTPUTS, FLOAT_TILE_OUTPUTS, inputs)
  if isinstance(w_t, jax.Array):
    return jnp.transpose(tiles, (0, 2, 1))
  return np.ascontiguousarray(np.asarray(tiles).transpose(0, 2, 1))


def untile_kernel(tiles):
  """tiles [out / 16, in, 16] -> w_t [out, in] (the inverse of tile_kernel)."""
  count, inputs, lanes = tiles.shape
  if isinstance(tiles, jax.Array):
    return jnp.transpose(tiles, (0, 2, 1)).reshape(count * lanes, inputs)
  return np.ascontiguousarray(np.asarray(tiles).transpose(0, 2, 1).reshape(count * lanes, inputs))


def _outputs(w):
  """The outputs of float32 weights [out, in] or tiled [out / 16, in, 16]."""
  return w.shape[0] * (FLOAT_TILE_OUTPUTS if w.ndim == 3 else 1)


def xla_matmul_tiled(x, tiles):
  """x [..., in] against tiles [out / 16, in, 16] through XLA -> [..., out]."""
  y = jnp.einsum('...i,til->...tl', x, tiles)  # [..., out / 16, 16]
  return y.reshape(x.shape[:-1] + (_outputs(tiles),))


def _xla_product(x, w):
  """x [..., in] against w [out, in] or tiled through XLA -> [..., out]."""
  return xla_matmul_tiled(x, w) if w.ndim == 3 else xla_matmul_transposed(x, w)


@jax.custom_jvp
def _kernel_matmul(x, w_t, active):
  return jax.ffi.ffi_call(TARGET_NAME,
                          jax.ShapeDtypeStruct(x.shape[:-1] + (_outputs(w_t),), jnp.float32),
                          vmap_method='sequential')(x, w_t, active)


@_kernel_matmul.defjvp
def _kernel_matmul_jvp(primals, tangents):
  x, w_t, active = primals
  dx, dw_t, _ = tangents
  return (_kernel_matmul(x, w_t, active), _xla_product(dx, w_t) + _xla_product(x, dw_t))


def few_row_matmul(x, w_t):
  """x [..., in] @ w_t [out, in]^T -> [..., out] through the kernel (applies(x, w_t)); or
  against tiles [out / 16, in, 16] (applies_tiled, tiled_floats_apply)."""
  return _kernel_matmul(x, w_t, row_flags(x))


def use_kernel(cpu_matmul: str) -> bool:
  """Whether products of a few rows go through the kernel under this setting."""
  check_cpu_matmul(cpu_matmul)
  return cpu_matmul == KERNEL and jax.default_backend() == 'cpu' and kernel_available()


def exact_across_widths(dtype, cpu_matmul: str) -> bool:
  """Whether decode steps of `dtype` compute each row bit for bit alike whatever the
  step's width without fixed-width steps (T5Config.decode_positions): float32 through
  the kernels. XLA rounds products of different widths differently."""
  return jnp.dtype(dtype) == jnp.float32 and use_kernel(cpu_matmul)


def matmul_transposed(x, w_t, cpu_matmul: str = KERNEL):
  """x [..., in] @ w_t [out, in]^T -> [..., out], w_t also tiled [out / 16, in, 16]: the
  kernel where it applies, else XLA (same results up to float32 rounding)."""
  if applies(x, w_t) and use_kernel(cpu_matmul):
    return few_row_matmul(x, w_t)
  return _xla_product(x, w_t)


def applies_tiled(x, tiles) -> bool:
  """Whether the kernel can compute x [..., in] against tiles [out / 16, in, 16]: where
  its tiled form runs (tiled_floats_apply), any number of rows (the tiled form outran
  XLA's product at every width measured, 1-64)."""
  return (x.dtype == jnp.float32 and tiles.dtype == jnp.float32 and tiles.ndim == 3
          and tiles.shape[2] == FLOAT_TILE_OUTPUTS and x.ndim >= 1
          and x.shape[-1] == tiles.shape[1] and int(np.prod(x.shape[:-1])) >= 1
          and tiled_floats_apply())


def quantize_activations(x, group: int = 0):
  """x [..., in] float32 -> (xq [..., in] int8-valued float32, scale [..., 1]): each row
  over its largest magnitude, scale = max |x| / 127 (1 for a zero row), xq = round(x / scale).

  group > 0: each row's inputs in groups of `group` (the last one shorter where in is not
  a multiple), each over its own largest magnitude -> scale [..., ceil(in / group)]."""
  if group <= 0:
    peak = jnp.max(jnp.abs(x), axis=-1, keepdims=True)
    scale = jnp.where(peak > 0, peak / 127.0, 1.0)
    return jnp.clip(jnp.round(x / scale), -127, 127), scale
  inputs = x.shape[-1]
  groups = -(-inputs // group)
  padded = _pad_inputs(x, groups * group).reshape(x.shape[:-1] + (groups, group))
  peak = jnp.max(jnp.abs(padded), axis=-1, keepdims=True)
  scale = jnp.where(peak > 0, peak / 127.0, 1.0)  # [..., groups, 1]
  xq = jnp.clip(jnp.round(padded / scale), -127, 127)
  return xq.reshape(x.shape[:-1] + (groups * group,))[..., :inputs], scale[..., 0]


def _pad_inputs(x, length: int):
  """x [..., in] zero-padded to [..., length]."""
  return jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, length - x.shape[-1])])


# Products with tiled int8 weights (the AVX-512 VNNI build's form) quantize x's rows per
# this many inputs, each group over its own largest magnitude (quantize_activations): an
# outlier then coarsens only its own group. On the main job's draft this took 2-3% fewer
# target calls and drafts than one scale a row (docs/performance.md, "The int8 draft").
# Weights [out, in] (the AVX2 build, accelerators) keep one scale a row.
TILED_ACTIVATION_GROUP = 32


def activation_group(w_q) -> int:
  """How many inputs share an activation scale in products with w_q: TILED_ACTIVATION_GROUP
  for tiled weights [out / 64, in / 4, 64, 4], 0 (the whole row) for [out, in]."""
  return TILED_ACTIVATION_GROUP if w_q.ndim == 4 else 0


# Tiled int8 weights [out / 64, in / 4, 64, 4] (jaxspec.model.quantization.tile_int8): the
# kernel's VNNI build sums 16 outputs per vector lane by lane, with no sum across lanes.
TILE_OUTPUTS, TILE_INPUTS = 64, 4


def int8_tiles_apply() -> bool:
  """Whether int8 products here run through the kernel's tiled form: the CPU, the
  kernel built, for AVX-512 VNNI."""
  return use_kernel(KERNEL) and kernel_isa() == 'avx512'


def tiled_int8_shape(out: int, inputs: int) -> tuple[int, int, int, int]:
  """The tiled form's shape [out / 64, in / 4, 64, 4] of int8 weights [out, in]."""
  return out // TILE_OUTPUTS, inputs // TILE_INPUTS, TILE_OUTPUTS, TILE_INPUTS


def int8_shape(w_q) -> tuple[int, int]:
  """(out, in) of int8 weights [out, in] or tiled [out / 64, in / 4, 64, 4]."""
  if w_q.ndim == 4:
    return w_q.shape[0] * w_q.shape[2], w_q.shape[1] * w_q.shape[3]
  return tuple(w_q.shape)


def untile_int8(w_q):
  """int8 weights [out, in] from either form (jnp; tiled ones are transposed back)."""
  if w_q.ndim != 4:
    return w_q
  out, inputs = int8_shape(w_q)
  return jnp.transpose(w_q, (0, 2, 1, 3)).reshape(out, inputs)


def int8_rows(w_q, indices):
  """Rows `indices` [...] of int8 weights w_q [out, in] or tiled [out / 64, in / 4, 64, 4]
  (row o: tile o // 64, lane o % 64) -> [..., in] int8, e.g. an int8 embedding's lookup."""
  w_q = jnp.asarray(w_q)
  if w_q.ndim != 4:
    return jnp.take(w_q, indices, axis=0)
  rows = w_q[indices // TILE_OUTPUTS, :, indices % TILE_OUTPUTS, :]  # [..., in / 4, 4]
  return rows.reshape(indices.shape + (int8_shape(w_q)[1],))


def xla_matmul_int8(x, w_q, scale):
  """matmul_int8 through XLA: x's rows quantized to int8 (quantize_activations, per
  activation_group(w_q) inputs), their products with the int8 w_q [out, in] (or tiled)
  summed in float32, times scale [out] and the row's (or each group's) scale ->
  [..., out] float32."""
  group = activation_group(w_q)
  weights = untile_int8(w_q).astype(jnp.float32)  # [out, in]
  if not group:
    xq, x_scale = quantize_activations(x)
    return xla_matmul_transposed(xq, weights) * scale * x_scale
  xq, x_scale = quantize_activations(x, group)  # [..., in], [..., groups]
  groups = x_scale.shape[-1]
  xq = _pad_inputs(xq, groups * group).reshape(xq.shape[:-1] + (groups, group))
  weights = _pad_inputs(weights, groups * group).reshape(weights.shape[0], groups, group)
  # Each group's integer sums (exact in float32: |sum| <= 32 * 127 * 127 < 2^24), then
  # their scales.
  sums = jnp.einsum('...gk,ogk->...og', xq, weights)  # [..., out, groups]
  return jnp.sum(sums * x_scale[..., None, :], axis=-1) * scale


def applies_int8(x, w_q, scale) -> bool:
  """Whether the kernel can compute (x @ w_q^T) * scale (shapes and dtypes; tiled
  weights only where the kernel's tiled form runs)."""
  rows = int(np.prod(x.shape[:-1], dtype=np.int64))
  tiled = (w_q.ndim == 4 and w_q.shape[2:] == (TILE_OUTPUTS, TILE_INPUTS)
           and int8_tiles_apply())
  out, inputs = int8_shape(w_q) if w_q.ndim in (2, 4) else (None, None)
  return (x.dtype == jnp.float32 and w_q.dtype == jnp.int8 and (w_q.ndim == 2 or tiled)
          and scale.dtype == jnp.float32 and scale.shape == (out,)
          and x.ndim >= 1 and x.shape[-1] == inputs and kernel_takes(rows))


def few_row_matmul_int8(x, w_q, scale):
  """(x [..., in] @ w_q [out, in]^T) * scale [out] through the kernel (applies_int8)."""
  def compute(rows, flags):
    return (jax.ffi.ffi_call(INT8_TARGET_NAME,
                             jax.ShapeDtypeStruct(rows.shape[:-1] + (int8_shape(w_q)[0],),
                                                  jnp.float32),
                             vmap_method='sequential')(
                                 rows, w_q, scale, flags,
                                 activation_group=np.int64(activation_group(w_q))),)
  return _in_calls(compute, x, row_flags(x))[0]


def matmul_int8(x, w_q, scale, cpu_matmul: str = KERNEL):
  """x [..., in] @ (w_q [out, in] * scale [out, None])^T with x's rows quantized to int8
  on the fly (int8 weights and activations; quantize_activations, one scale a row, or per
  activation_group(w_q) inputs for tiled weights): the kernel's int8 handler where it
  applies, else XLA -> [..., out] float32.

  The kernel sums the int8 products exactly in int32; XLA sums the same integers in
  float32 (exact while partial sums stay below 2^24: an input of <= 1040, or a group), so
  the two differ by float32 rounding at most."""
  x = x.astype(jnp.float32)
  if applies_int8(x, w_q, scale) and use_kernel(cpu_matmul):
    return few_row_matmul_int8(x, w_q, scale)
  return xla_matmul_int8(x, w_q, scale)


# Several matrices against the same rows in one call: a decode step's q/k/v projections
# and the MLP's two input projections. Each result equals its own call's bit for bit
# (outputs never depend on each other); the step saves a call and a thread hand-off per
# extra matrix (and, in int8, a quantization of the rows).


def _many_shapes(x, outs):
  return tuple(jax.ShapeDtypeStruct(x.shape[:-1] + (out,), jnp.float32) for out in outs)


@jax.custom_jvp
def _kernel_matmuls(x, w_ts, active):
  return tuple(jax.ffi.ffi_call(MANY_TARGET_NAMES[len(w_ts)],
                                _many_shapes(x, [_outputs(w) for w in w_ts]),
                                vmap_method='sequential')(x, *w_ts, active))


@_kernel_matmuls.defjvp
def _kernel_matmuls_jvp(primals, tangents):
  x, w_ts, active = primals
  dx, dw_ts, _ = tangents
  return (_kernel_matmuls(x, w_ts, active),
          tuple(_xla_product(dx, w) + _xla_product(x, dw) for w, dw in zip(w_ts, dw_ts)))


def few_row_matmuls(x, w_ts):
  """(x @ w_t^T for w_t in w_ts) through one kernel call: 2 or 3 float32 matrices
  [out_k, in] that each satisfy applies(x, w_t), or all tiled (applies_tiled)."""
  return _kernel_matmuls(x, tuple(w_ts), row_flags(x))


def matmuls_transposed(x, w_ts, cpu_matmul: str = KERNEL):
  """(matmul_transposed(x, w_t) for w_t in w_ts): one kernel call for 2 or 3 matrices in
  one form ([out_k, in], or all tiled) where the kernel applies to each, else one product
  each."""
  w_ts = tuple(w_ts)
  if (len(w_ts) in MANY_TARGET_NAMES and len({w.ndim for w in w_ts}) == 1
      and all(applies(x, w) for w in w_ts) and use_kernel(cpu_matmul)):
    return few_row_matmuls(x, w_ts)
  return tuple(matmul_transposed(x, w, cpu_matmul) for w in w_ts)


def few_row_matmuls_int8(x, pairs):
  """(few_row_matmul_int8(x, w_q, scale) for (w_q, scale) in pairs) in one kernel call."""
  operands = [operand for pair in pairs for operand in pair]

  def compute(rows, flags):
    return tuple(jax.ffi.ffi_call(MANY_INT8_TARGET_NAMES[len(pairs)],
                                  _many_shapes(rows, [int8_shape(w_q)[0] for w_q, _ in pairs]),
                                  vmap_method='sequential')(
                                      rows, *operands, flags,
                                      activation_group=np.int64(activation_group(pairs[0][0]))))
  return _in_calls(compute, x, row_flags(x))


def matmuls_int8(x, pairs, cpu_matmul: str = KERNEL):
  """(matmul_int8(x, w_q, scale) for (w_q, scale) in pairs): one kernel call for 2 or 3
  pairs where the kernel applies to each, else one product each."""
  pairs = tuple(pairs)
  x = x.astype(jnp.float32)
  if (len(pairs) in MANY_INT8_TARGET_NAMES and len({w_q.ndim for w_q, _ in pairs}) == 1
      and all(applies_int8(x, *pair) for pair in pairs) and use_kernel(cpu_matmul)):
    return few_row_matmuls_int8(x, pairs)
  return tuple(matmul_int8(x, *pair, cpu_matmul) for pair in pairs)
