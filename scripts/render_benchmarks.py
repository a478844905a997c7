"""`jaxspec-render-benchmarks`: see jaxspec/launch/render_benchmarks.py, or run with --help."""

import sys

from jaxspec.launch.render_benchmarks import cli

if __name__ == '__main__':
  sys.exit(cli())
