"""Suite-wide settings and fixtures: compile less, and never run out of mappings.

Most of the suite's CPU time is XLA:CPU compiling small programs, so for the tests:
- LLVM optimizes less (--xla_backend_optimization_level=0): the tests' models are tiny,
  their programs run in microseconds, and compiling them takes a third less CPU. It
  changes how fast the code runs, not what it computes (the exactness tests compare
  programs compiled alike, and the references carry tolerances).
- XLA:CPU emits its fusions with the LLVM IR emitters rather than the MLIR fusion
  emitters (--xla_cpu_use_fusion_emitters=false): a speculative decode loop compiles in
  less than half the CPU time. Also a code generation choice only, under the same terms.
- XLA:CPU compiles each program as one LLVM module (--xla_cpu_parallel_codegen_split_count=1)
  instead of splitting it for parallel code generation: the parts cost more to make than
  the two cores win back (tests/test_speculative.py: ~10% less CPU).
- Compiled programs go to a persistent compilation cache in a fresh directory for the
  run, shared with the scripts the tests start in subprocesses (the environment
  carries it): a program compiled once is loaded, not compiled, by every later test
  and script that needs it.
These are set only where the caller has not set them (XLA_FLAGS keeps what it holds).

One pytest process compiles hundreds of XLA programs; kept for the whole run, their
executables used up the process's memory mappings (vm.max_map_count, 65530 here) with
most RAM free, and XLA:CPU crashed compiling late in the suite ("LLVM compilation error:
Cannot allocate memory"). After every CHECK_MAPPINGS_EVERY-th test, when the process
holds more than MAX_MAPPINGS mappings, the in-memory programs are dropped (a later test
that needs one loads it from the persistent cache).

Lowering shares MLIR contexts (share_mlir_contexts): jax makes a fresh context, loading
every dialect, for each program it lowers, and the suite lowers thousands (every
operation run outside jit is one); creating and destroying them took about a tenth of
the suite's CPU time. A context serves MLIR_CONTEXT_USES programs, then a fresh one is
made (MLIR keeps a context's types and attributes until the context goes). Programs
are lowered and compiled as before, in a context used by others before them.
JAXSPEC_TESTS_FRESH_MLIR_CONTEXTS=1 turns this off.

Python's full garbage collections walk the whole heap, and the heap of the run grows
with every compiled program and cached result: they took about 5% of the suite's CPU
(34 s of 650). So before each test the objects that survive a collection are frozen
(gc.freeze), and later collections walk only what was made since (the collection
itself walks only what the last test left). Freezing moves nothing and frees nothing:
reference counting still frees a frozen object when its last reference goes; only
cyclic garbage among frozen objects waits, until the mappings check below, which
unfreezes before it collects. At the end of the session the surviving objects are
frozen before pytest's and jax's final garbage collections.
JAXSPEC_TESTS_NO_GC_FREEZE=1 turns the freezing before each test off.

Random initializations are memoized for the run (memoize_init_params): the suite calls
jaxspec.model's init_params ~230 times for ~45 distinct (config, key, lengths), each an
eager forward pass of a few hundred operations (~26 CPU-s of repeats). init_params is a
deterministic function of its arguments, so a repeat returns fresh copies of the first
call's arrays (copies: training donates its parameters); a traced key or an unhashable
argument calls it as before. JAXSPEC_TESTS_FRESH_INIT=1 turns this off.
"""

import atexit
import gc
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile

_FAST_COMPILE_FLAGS = {'xla_backend_optimization_level': '0',
                       'xla_cpu_use_fusion_emitters': 'false',
                       'xla_cpu_parallel_codegen_split_count': '1'}
for _name, _value in _FAST_COMPILE_FLAGS.items():
  if _name not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix='jaxspec-tests-xla-cache-')
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache_dir
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import functools  # noqa: E402
import inspect  # noqa: E402

import jax  # noqa: E402  (after the environment above)
import numpy as np  # noqa: E402
import pytest  # noqa: E402

# A plugin may have imported jax before this file set the environment.
jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ.get('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', 1.0)))
jax.config.update('jax_persistent_cache_min_entry_size_bytes',
                  int(os.environ.get('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', 0)))

MLIR_CONTEXT_USES = 200


def share_mlir_contexts(uses: int = MLIR_CONTEXT_USES) -> None:
  """Makes jax lower `uses` programs in each MLIR context instead of one (jax's own
  make_ir_context makes each context; nothing changes where jax lacks it)."""
  try:
    from jax._src.interpreters import mlir  # pylint: disable=g-import-not-at-top
  except ImportError:
    return
  make_ir_context = getattr(mlir, 'make_ir_context', None)
  if make_ir_context is None or getattr(make_ir_context, 'shared', False):
    return
  state = {'context': None, 'uses': 0}
  lock = threading.Lock()

  def shared_ir_context():
    with lock:
      if state['context'] is None or state['uses'] >= uses:
        state['context'], state['uses'] = make_ir_context(), 0
      state['uses'] += 1
      return state['context']

  shared_ir_context.shared = True
  mlir.make_ir_context = shared_ir_context


if os.environ.get('JAXSPEC_TESTS_FRESH_MLIR_CONTEXTS', '') in ('', '0'):
  share_mlir_contexts()


def _memo_key(value):
  """A hashable stand-in for one argument of init_params; TypeError where there is none."""
  if isinstance(value, jax.core.Tracer):
    raise TypeError('traced')
  if isinstance(value, (jax.Array, np.ndarray)):
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
      return ('key', str(jax.random.key_impl(value)), value.shape,
              np.asarray(jax.random.key_data(value)).tobytes())
    return ('array', str(value.dtype), value.shape, np.asarray(value).tobytes())
  hash(value)
  return value


def memoize_init_params(function):
  """init_params, its results kept per argument values (see above)."""
  signature = inspect.signature(function)
  results = {}

  @functools.wraps(function)
  def memoized(*args, **kwargs):
    bound = signature.bind(*args, **kwargs)
    bound.apply_defaults()
    try:
      key = tuple((name, _memo_key(value)) for name, value in bound.arguments.items())
    except TypeError:
      return function(*args, **kwargs)
    if key not in results:  # Kept on the host: training donates the arrays it is given.
      results[key] = jax.device_get(function(*args, **kwargs))
    return jax.device_put(jax.tree_util.tree_map(np.array, results[key]))  # fresh copies

  return memoized


def memoize_model_initializations() -> None:
  """Replaces jaxspec.model's init_params functions (T5 and the encoder-sharing draft)
  with memoized ones, where the modules that tests import them from look them up."""
  from jaxspec import model  # pylint: disable=g-import-not-at-top
  from jaxspec.model import shared_encoder_draft, t5  # pylint: disable=g-import-not-at-top
  t5.init_params = model.init_params = memoize_init_params(t5.init_params)
  shared_encoder_draft.init_params = memoize_init_params(shared_encoder_draft.init_params)


if os.environ.get('JAXSPEC_TESTS_FRESH_INIT', '') in ('', '0'):
  memoize_model_initializations()


# The whole suite (895 tests, 2026-11-26) peaked at 39385 mappings without a drop, so it
# runs without one (a drop cost ~6 CPU-s and the recompiles after it); 20000 below
# vm.max_map_count's default, 65530.
MAX_MAPPINGS = 45_000
# Reading /proc/self/maps costs ~7 ms at the suite's usual ~7000 mappings; a few tests
# add at most hundreds, far from the ~20000 between MAX_MAPPINGS and the limit.
CHECK_MAPPINGS_EVERY = 4
_tests_since_mappings_checked = [0]


def memory_mappings() -> int:
  """The number of memory mappings this process holds (0 where /proc is absent)."""
  try:
    with open('/proc/self/maps', 'rb') as maps:
      return maps.read().count(b'\n')
  except OSError:
    return 0


@pytest.fixture(autouse=True)
def _drop_compiled_programs_when_mappings_run_high():
  yield
  _tests_since_mappings_checked[0] += 1
  if _tests_since_mappings_checked[0] < CHECK_MAPPINGS_EVERY:
    return
  _tests_since_mappings_checked[0] = 0
  if memory_mappings() > MAX_MAPPINGS:
    jax.clear_caches()
    gc.unfreeze()  # Frozen programs in reference cycles are freed too.
    gc.collect()
    if _FREEZE_PER_TEST:
      gc.freeze()


_FREEZE_PER_TEST = os.environ.get('JAXSPEC_TESTS_NO_GC_FREEZE', '') in ('', '0')


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  """Before each test (the last test's fixtures already torn down): collects, then
  freezes what survives, so later collections skip it (see above)."""
  del item
  if _FREEZE_PER_TEST:
    gc.collect()
    gc.freeze()


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session):
  """Freezes what survives the run, so the final collections skip it (see above)."""
  del session
  gc.collect()
  gc.freeze()


@pytest.fixture(scope='session')
def tiny_pair_checkpoints(tmp_path_factory):
  """Random checkpoints of gin/models/tiny_pair.gin's target (seed 0) and draft (seed 1),
  written once in this process: a directory holding target/ and draft/ (the checkpoints
  of tests/_sharded_worker.py's LAUNCHER_CONFIG). The launcher and benchmark tests copy
  them into their own directories."""
  import _sharded_worker  # pylint: disable=g-import-not-at-top  (tests/, imports the scripts)
  directory = tmp_path_factory.mktemp('tiny_pair')
  _sharded_worker.write_launcher_checkpoints(str(directory))
  return directory


@pytest.fixture(scope='session')
def tiny_launcher_run(tmp_path_factory, tiny_pair_checkpoints):
  """scripts/infer.py's unpartitioned run of the tiny random checkpoints, made once in
  this process: a directory holding the checkpoints (target/, draft/) and the run's
  outputs (plain/), tests/_sharded_worker.py's LAUNCHER_CONFIG. The sharded and
  multi-host launcher runs (tests/test_partitioning.py, tests/test_multihost.py) decode
  the same checkpoints and must write what it wrote."""
  import _sharded_worker  # pylint: disable=g-import-not-at-top  (tests/, imports the scripts)
  directory = tmp_path_factory.mktemp('launcher')
  for name in ('target', 'draft'):
    shutil.copytree(tiny_pair_checkpoints / name, directory / name)
  _sharded_worker.run_launcher(str(directory), f'{directory}/plain')
  return directory


@pytest.fixture(scope='session')
def installed_wheel(tmp_path_factory):
  """A wheel of the checkout installed into a fresh virtual environment (tests/_wheel.py:
  its dependencies from the running environment): (venv python, wheel's file names)."""
  import _wheel  # pylint: disable=g-import-not-at-top  (tests/)
  root = tmp_path_factory.mktemp('wheel')
  subprocess.run([sys.executable, '-m', 'pip', 'wheel', '-q', '--no-deps',
                  '--no-build-isolation', '-w', str(root / 'dist'), _wheel.REPO], check=True)
  [wheel] = (root / 'dist').glob('jaxspec-*.whl')
  python = _wheel.make_venv(root / 'venv')
  subprocess.run([python, '-m', 'pip', 'install', '-q', '--no-deps', '--no-index', str(wheel)],
                 check=True, env=_wheel.venv_environment(python))
  with zipfile.ZipFile(wheel) as archive:
    names = set(archive.namelist())
  return pathlib.Path(python), names
