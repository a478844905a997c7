"""What machine a measurement or calibration belongs to: the CPU model, its caches, the
device, the checkout's commit. Read by the decoders' calibration (cache keys) and by
every measurement record (results/**/*.json)."""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import platform
import re
import subprocess

import jax


def cpu_model() -> str:
  """The host CPU's model name (from /proc/cpuinfo where there is one)."""
  if os.path.exists('/proc/cpuinfo'):
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          return line.split(':', 1)[1].strip()
  return platform.processor() or platform.machine()


def cpu_caches() -> dict[str, str]:
  """{'L1d', 'L1i', 'L2', 'L3': size} as lscpu reports them ({} where it cannot)."""
  try:
    text = subprocess.run(['lscpu'], capture_output=True, text=True, check=True,
                          timeout=10).stdout
  except (OSError, subprocess.SubprocessError):
    return {}
  caches = {}
  for line in text.splitlines():
    match = re.match(r'\s*(L\d\w?) cache:\s*(.+)', line)
    if match:
      caches[match.group(1)] = match.group(2).strip()
  return caches


def description(caches: bool = False) -> dict:
  """What decode costs depend on beyond the model: the platform and device (count), jax's
  version and, on a CPU, its model and cores (and caches, where asked)."""
  described = {'platform': jax.default_backend(), 'device': jax.devices()[0].device_kind,
               'devices': jax.device_count(), 'jax': jax.__version__}
  if jax.default_backend() == 'cpu':
    described.update(cpu=cpu_model(), cores=os.cpu_count(), machine=platform.machine())
    if caches:
      described['caches'] = cpu_caches()
  return described


def git_commit(directory: str | None = None) -> str | None:
  """HEAD of the checkout holding `directory` (default: this package's), or None."""
  directory = directory or os.path.dirname(os.path.abspath(__file__))
  try:
    result = subprocess.run(['git', 'rev-parse', 'HEAD'], cwd=directory, capture_output=True,
                            text=True, check=True, timeout=10)
  except (OSError, subprocess.SubprocessError):
    return None
  return result.stdout.strip() or None


@functools.cache
def code_digest() -> str:
  """A digest of jaxspec's own code (every .py, .cc and .h file of the package): what
  measurements cached across runs (gamma='auto' calibrations) are keyed by, so a change of
  the code, installed or checked out, measures anew."""
  root = pathlib.Path(__file__).parent
  digest = hashlib.sha256()
  for path in sorted(p for p in root.rglob('*') if p.suffix in ('.py', '.cc', '.h')):
    digest.update(str(path.relative_to(root)).encode() + b'\0' + path.read_bytes())
  return digest.hexdigest()[:16]
