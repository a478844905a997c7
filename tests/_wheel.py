"""The wheel of the checkout in a fresh virtual environment, as `pip install .` makes
it: tests/conftest.py's installed_wheel fixture and the tests that run its commands
(tests/test_package.py, tests/test_readme.py)."""

import os
import subprocess
import sys
import sysconfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def make_venv(directory) -> str:
  """A fresh virtual environment at `directory` that reaches the packages of the running
  interpreter without installing them again; its python.

  It sees the base interpreter's site-packages (--system-site-packages) and, where the
  suite itself runs in a virtual environment (whose packages --system-site-packages does
  not reach), the running environment's through a .pth file, after its own."""
  subprocess.run([sys.executable, '-m', 'venv', '--system-site-packages', str(directory)],
                 check=True)
  python = os.path.join(str(directory), 'bin', 'python')
  if sys.prefix != sys.base_prefix:
    running = {sysconfig.get_paths()[key] for key in ('purelib', 'platlib')}
    venv_site = subprocess.run(
        [python, '-c', 'import sysconfig; print(sysconfig.get_paths()["purelib"])'],
        check=True, capture_output=True, text=True).stdout.strip()
    with open(os.path.join(venv_site, '_jaxspec_tests_running_environment.pth'), 'w') as f:
      f.write(''.join(f'{path}\n' for path in sorted(running)))
  return python


def venv_environment(python) -> dict:
  """os.environ for commands of the virtual environment of `python`: its bin/ first on
  PATH, and no PYTHONPATH (a checkout on it would shadow the installed package)."""
  env = {k: v for k, v in os.environ.items() if k not in ('PYTHONPATH', 'PYTHONHOME')}
  bin_dir = os.path.dirname(str(python))
  env['PATH'] = bin_dir + os.pathsep + env.get('PATH', '')
  env['VIRTUAL_ENV'] = os.path.dirname(bin_dir)
  return env
