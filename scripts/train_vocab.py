"""`jaxspec-train-vocab`: see jaxspec/launch/train_vocab.py, or run with --help."""

from jaxspec.launch.train_vocab import main

if __name__ == '__main__':
  main()
