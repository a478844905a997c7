"""`jaxspec-accelerator-bench`: see jaxspec/launch/accelerator_bench.py, or run with --help."""

from jaxspec.launch.accelerator_bench import main

if __name__ == '__main__':
  main()
