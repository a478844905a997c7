"""`jaxspec-show`: see jaxspec/launch/show.py, or run with --help."""

import sys

from jaxspec.launch.show import cli

if __name__ == '__main__':
  sys.exit(cli())
