"""`jaxspec-staged-bench`: see jaxspec/launch/staged_bench.py, or run with --help."""

import sys

from jaxspec.launch.staged_bench import cli

if __name__ == '__main__':
  sys.exit(cli())
