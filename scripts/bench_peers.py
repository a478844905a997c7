"""`jaxspec-bench-peers`: see jaxspec/launch/bench_peers.py, or run with --help."""

from jaxspec.launch.bench_peers import cli as main

if __name__ == '__main__':
  main()
