"""Suite-wide settings and fixtures: compile less, and never run out of mappings.

Most of the suite's CPU time is XLA:CPU compiling small programs, so for the tests:
- LLVM optimizes less (--xla_backend_optimization_level=0): the tests' models are tiny,
  their programs run in microseconds, and compiling them takes a third less CPU. It
  changes how fast the code runs, not what it computes (the exactness tests compare
  programs compiled alike, and the references carry tolerances).
- XLA:CPU emits its fusions with the LLVM IR emitters rather than the MLIR fusion
  emitters (--xla_cpu_use_fusion_emitters=false): a speculative decode loop compiles in
  less than half the CPU time. Also a code generation choice only, under the same terms.
- Compiled programs go to a persistent compilation cache in a fresh directory for the
  run, shared with the scripts the tests start in subprocesses (the environment
  carries it): a program compiled once is loaded, not compiled, by every later test
  and script that needs it.
Both are set only where the caller has not set them (XLA_FLAGS keeps what it holds).

One pytest process compiles hundreds of XLA programs; kept for the whole run, their
executables used up the process's memory mappings (vm.max_map_count, 65530 here) with
most RAM free, and XLA:CPU crashed compiling late in the suite ("LLVM compilation error:
Cannot allocate memory"). After each test, when the process holds more than
MAX_MAPPINGS mappings, the in-memory programs are dropped (a later test that needs one
loads it from the persistent cache).
"""

import atexit
import gc
import os
import shutil
import tempfile

_FAST_COMPILE_FLAGS = {'xla_backend_optimization_level': '0',
                       'xla_cpu_use_fusion_emitters': 'false'}
for _name, _value in _FAST_COMPILE_FLAGS.items():
  if _name not in os.environ.get('XLA_FLAGS', ''):
    os.environ['XLA_FLAGS'] = f"{os.environ.get('XLA_FLAGS', '')} --{_name}={_value}".strip()
if 'JAX_COMPILATION_CACHE_DIR' not in os.environ:
  _cache_dir = tempfile.mkdtemp(prefix='jaxspec-tests-xla-cache-')
  atexit.register(shutil.rmtree, _cache_dir, ignore_errors=True)
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache_dir
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0.1')
  os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '0')

import jax  # noqa: E402  (after the environment above)
import pytest  # noqa: E402

# A plugin may have imported jax before this file set the environment.
jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
jax.config.update('jax_persistent_cache_min_compile_time_secs',
                  float(os.environ.get('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', 1.0)))
jax.config.update('jax_persistent_cache_min_entry_size_bytes',
                  int(os.environ.get('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', 0)))

MAX_MAPPINGS = 30_000  # Less than half of vm.max_map_count's default, 65530.


def memory_mappings() -> int:
  """The number of memory mappings this process holds (0 where /proc is absent)."""
  try:
    with open('/proc/self/maps', 'rb') as maps:
      return sum(1 for _ in maps)
  except OSError:
    return 0


@pytest.fixture(autouse=True)
def _drop_compiled_programs_when_mappings_run_high():
  yield
  if memory_mappings() > MAX_MAPPINGS:
    jax.clear_caches()
    gc.collect()


@pytest.fixture(scope='session')
def tiny_launcher_run(tmp_path_factory):
  """scripts/infer.py's unpartitioned run of tiny random checkpoints, made once in this
  process: a directory holding the checkpoints (target/, draft/) and the run's outputs
  (plain/), tests/_sharded_worker.py's LAUNCHER_CONFIG. The sharded and multi-host
  launcher runs (tests/test_partitioning.py, tests/test_multihost.py) decode the same
  checkpoints and must write what it wrote."""
  import _sharded_worker  # pylint: disable=g-import-not-at-top  (tests/, imports the scripts)
  directory = tmp_path_factory.mktemp('launcher')
  _sharded_worker.make_launcher_run(str(directory))
  return directory
