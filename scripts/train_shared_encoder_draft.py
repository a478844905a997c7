"""`jaxspec-train-shared-encoder-draft`: see jaxspec/launch/train_shared_encoder_draft.py, or run with --help."""

import sys

from jaxspec.launch.train_shared_encoder_draft import cli

if __name__ == '__main__':
  sys.exit(cli())
