"""`jaxspec-accelerator-bench`: see jaxspec/launch/accelerator_bench.py, or run with --help."""

import sys

from jaxspec.launch.accelerator_bench import cli

if __name__ == '__main__':
  sys.exit(cli())
