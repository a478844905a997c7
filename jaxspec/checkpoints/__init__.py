"""Checkpoint import and shape checking (Hugging Face import; T5X formats beside it)."""

from jaxspec.checkpoints.hf import config_from_hf, load_hf_checkpoint, params_from_hf
from jaxspec.checkpoints.validate import check_params, flatten_params
