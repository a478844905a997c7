"""Every drafter, and the interface they implement, in one place to import from."""

from jaxspec.decoding.drafter import DraftContext, Drafter, draw_tokens, init_drafter_state
from jaxspec.decoding.int8_drafter import Int8Drafter
from jaxspec.decoding.ngram import BigramDrafter, UnigramDrafter, fit_bigram, fit_unigram
from jaxspec.decoding.prompt_lookup import PromptLookupDrafter
from jaxspec.decoding.shared_encoder_drafter import (SharedEncoderDrafter,
                                                     SharedEncoderDrafterWithTarget)
from jaxspec.decoding.t5_drafter import T5Drafter

__all__ = ['BigramDrafter', 'DraftContext', 'Drafter', 'Int8Drafter', 'PromptLookupDrafter',
           'SharedEncoderDrafter', 'SharedEncoderDrafterWithTarget', 'T5Drafter',
           'UnigramDrafter', 'draw_tokens', 'fit_bigram', 'fit_unigram', 'init_drafter_state']
