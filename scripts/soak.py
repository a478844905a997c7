"""`jaxspec-soak`: see jaxspec/launch/soak.py, or run with --help."""

import sys

from jaxspec.launch.soak import main

if __name__ == '__main__':
  sys.exit(main())
