"""`jaxspec-build-corpora`: see jaxspec/launch/build_corpora.py, or run with --help."""

from jaxspec.launch.build_corpora import main

if __name__ == '__main__':
  main()
