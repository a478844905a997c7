"""Suite-wide fixtures.

One pytest process compiles hundreds of XLA programs; kept for the whole run, their
executables used up the process's memory mappings (vm.max_map_count, 65530 here) with
most RAM free, and XLA:CPU crashed compiling late in the suite ("LLVM compilation error:
Cannot allocate memory"). Each test module's programs are dropped when the module ends
(a later module that needs one compiles it again).
"""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope='module')
def _drop_compiled_programs_after_the_module():
  yield
  jax.clear_caches()
  gc.collect()
