"""`jaxspec-render-benchmarks`: see jaxspec/launch/render_benchmarks.py, or run with --help."""

from jaxspec.launch.render_benchmarks import main

if __name__ == '__main__':
  main()
