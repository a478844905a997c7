"""`jaxspec-train-shared-encoder-draft`: see jaxspec/launch/train_shared_encoder_draft.py, or run with --help."""

from jaxspec.launch.train_shared_encoder_draft import main

if __name__ == '__main__':
  main()
