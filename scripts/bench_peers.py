"""`jaxspec-bench-peers`: see jaxspec/launch/bench_peers.py, or run with --help."""

import sys

from jaxspec.launch.bench_peers import cli

if __name__ == '__main__':
  sys.exit(cli())
