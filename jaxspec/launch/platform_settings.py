"""What pays on each platform, set by the launchers before JAX starts its backend.

XLA reads XLA_FLAGS once, when JAX starts its backend, so the launchers that decode
(jaxspec-infer, jaxspec-batch-sizes) call `apply()` first, on the platform JAX is
expected to start: it adds that platform's flags to XLA_FLAGS, leaving any flag the
user set as the user set it. The speculative loop's draft loop form needs no such step
(SpeculativeConfig.draft_loop 'auto' is chosen when the program is lowered); `record()`
says which form runs, with the platform and the flags, for the run's summary.

  settings_for(platform)  PlatformSettings(platform, draft_loop, xla_flags)
  expected_platform()     the platform JAX will start on, read before it starts
  apply(environ)          that platform's XLA flags added to XLA_FLAGS (unless JAX started)
  record(draft_loop)      what ran: the platform, the draft loop form, the XLA flags

The GPU's flags stay XLA's defaults until the accelerator command's profile part
(jaxspec-accelerator-bench, part p) shows a variant that pays on a device; the
mechanism and the record exist so that setting one is a change of this table.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import MutableMapping

from jaxspec.decoding.drafters import loops as draft_loops


@dataclasses.dataclass(frozen=True)
class PlatformSettings:
  """What a platform decodes with: the draft loop form SpeculativeConfig.draft_loop
  'auto' runs there (jaxspec.decoding.drafters.loops.draft_loop_for: the early exit on
  the CPU, where a proposal whose rows all stop costs only the steps it took; a trip
  count XLA sees elsewhere, no host round trip per draft step), and the XLA flags the
  launchers add."""
  platform: str
  draft_loop: str
  xla_flags: tuple[str, ...] = ()


# XLA flags the launchers add, per platform. The GPU keeps XLA's defaults until part p of
# jaxspec-accelerator-bench shows a variant that pays on a device.
PLATFORM_XLA_FLAGS: dict[str, tuple[str, ...]] = {'cpu': (), 'gpu': (), 'tpu': ()}


# Installed plugins that make JAX start on a GPU or a TPU (where JAX_PLATFORMS is unset).
_PLUGINS = {'gpu': ('jax_cuda12_plugin', 'jax_cuda13_plugin', 'jax_rocm60_plugin',
                    'jax_rocm7_plugin'),
            'tpu': ('libtpu',)}
_PLATFORM_NAMES = {'cuda': 'gpu', 'rocm': 'gpu'}


def settings_for(platform: str) -> PlatformSettings:
  """What `platform` ('cpu', 'gpu', 'cuda', 'rocm', 'tpu') decodes with."""
  platform = _PLATFORM_NAMES.get(platform, platform)
  return PlatformSettings(platform, draft_loops.draft_loop_for(platform),
                          PLATFORM_XLA_FLAGS.get(platform, ()))


def _installed(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except (ImportError, ValueError):
    return False


def expected_platform(environ: MutableMapping[str, str] = os.environ) -> str:
  """The platform JAX will start on, without starting it: JAX_PLATFORMS' first entry
  where it is set, else a GPU or TPU whose plugin is installed, else the CPU."""
  chosen = environ.get('JAX_PLATFORMS') or environ.get('JAX_PLATFORM_NAME') or ''
  first = chosen.split(',')[0].strip().lower()
  if first:
    return _PLATFORM_NAMES.get(first, first)
  for platform in ('tpu', 'gpu'):
    if any(_installed(plugin) for plugin in _PLUGINS[platform]):
      return platform
  return 'cpu'


def _flag_name(flag: str) -> str:
  return flag.split('=', 1)[0].strip()


def with_flags(xla_flags: str, flags) -> tuple[str, list[str]]:
  """(XLA_FLAGS with `flags` appended where it does not set them already, the flags
  appended): a flag the user set keeps the user's value."""
  present = {_flag_name(f) for f in xla_flags.split()}
  added = [f for f in flags if _flag_name(f) not in present]
  return ' '.join([xla_flags.strip(), *added]).strip(), added


def backend_started() -> bool:
  """Whether JAX has started its backends (XLA_FLAGS is read then, once)."""
  from jax._src import xla_bridge  # pylint: disable=import-outside-toplevel
  return xla_bridge.backends_are_initialized()


def apply(environ: MutableMapping[str, str] = os.environ) -> list[str]:
  """Adds the expected platform's XLA flags to environ['XLA_FLAGS'] -> the flags added
  (none once JAX has started: it would not read them)."""
  if backend_started():
    return []
  flags, added = with_flags(environ.get('XLA_FLAGS', ''),
                            settings_for(expected_platform(environ)).xla_flags)
  if added:
    environ['XLA_FLAGS'] = flags
  return added


def record(draft_loop: str = draft_loops.AUTO,
           environ: MutableMapping[str, str] = os.environ) -> dict:
  """What the run decodes with, for its summary (JAX started): {'platform', 'draft_loop'
  (the form `draft_loop` runs here), 'xla_flags' (XLA_FLAGS as the backend read it),
  'platform_xla_flags' (those of them the platform's settings add)}."""
  import jax  # pylint: disable=import-outside-toplevel
  platform = jax.default_backend()
  flags = environ.get('XLA_FLAGS', '')
  present = {_flag_name(f) for f in flags.split()}
  return {'platform': platform,
          'draft_loop': draft_loops.draft_loop_for(platform, draft_loop),
          'xla_flags': flags,
          'platform_xla_flags': [f for f in settings_for(platform).xla_flags
                                 if _flag_name(f) in present]}
