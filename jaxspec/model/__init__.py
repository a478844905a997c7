"""The T5 model: layers, the encoder-decoder and its functional decoder cache."""

from jaxspec.model.cache import DecoderCache, LayerCache, repeat_rows, rollback
from jaxspec.model.t5 import T5, DecodeTree, abstract_params, init_params
from jaxspec.model.cpu import layout as kernel_layout
