"""`jaxspec-staged-bench`: see jaxspec/launch/staged_bench.py, or run with --help."""

from jaxspec.launch.staged_bench import main

if __name__ == '__main__':
  main()
