"""`jaxspec-benchmark`: see jaxspec/launch/benchmark.py, or run with --help."""

import sys

from jaxspec.launch.benchmark import cli

if __name__ == '__main__':
  sys.exit(cli())
