"""Suite-wide fixtures.

One pytest process compiles hundreds of XLA programs; kept for the whole run, their
executables and JAX's tracing caches grew its memory past 10 GB, and XLA:CPU crashed
compiling late in the suite. Each test module's programs are dropped when the module
ends (a later module that needs one compiles it again).
"""

import gc

import jax
import pytest


@pytest.fixture(autouse=True, scope='module')
def _drop_compiled_programs_after_the_module():
  yield
  jax.clear_caches()
  gc.collect()
