"""`jaxspec-batch-sizes`: see jaxspec/launch/batch_sizes.py, or run with --help."""

import sys

from jaxspec.launch.batch_sizes import cli

if __name__ == '__main__':
  sys.exit(cli())
