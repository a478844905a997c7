"""`jaxspec-benchmark`: see jaxspec/launch/benchmark.py, or run with --help."""

from jaxspec.launch.benchmark import main

if __name__ == '__main__':
  main()
