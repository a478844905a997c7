"""Every drafter, and the interface they implement, in one place to import from."""

from jaxspec.decoding.drafters.base import (DraftContext, Drafter, draw_tokens,
                                            init_drafter_state)
from jaxspec.decoding.drafters.int8 import Int8Drafter
from jaxspec.decoding.drafters.ngram import (BigramDrafter, UnigramDrafter, fit_bigram,
                                             fit_unigram)
from jaxspec.decoding.drafters.prompt_lookup import PromptLookupDrafter
from jaxspec.decoding.drafters.shared_encoder import (SharedEncoderDrafter,
                                                      SharedEncoderDrafterWithTarget)
from jaxspec.decoding.drafters.t5 import T5Drafter

__all__ = ['BigramDrafter', 'DraftContext', 'Drafter', 'Int8Drafter', 'PromptLookupDrafter',
           'SharedEncoderDrafter', 'SharedEncoderDrafterWithTarget', 'T5Drafter',
           'UnigramDrafter', 'draw_tokens', 'fit_bigram', 'fit_unigram', 'init_drafter_state']
