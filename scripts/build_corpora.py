"""`jaxspec-build-corpora`: see jaxspec/launch/build_corpora.py, or run with --help."""

import sys

from jaxspec.launch.build_corpora import cli

if __name__ == '__main__':
  sys.exit(cli())
