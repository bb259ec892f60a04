"""The model classes `lmcli.load` builds: the architectures of lmcli.models with `generate()` bound to
this layer's loop.

The models know nothing of generation (they run slots: models/slots.py); a loaded model's
`model.generate(...)` is `lmcli.generation.generate(model, ...)`, here, one layer above them, so no
import runs from the models up. lmcli.loading (above this layer) builds these classes.
"""

from __future__ import annotations

from typing import Any

import torch

from lmcli.models.base import BaseModel
from lmcli.models.encoder_decoder import EncoderDecoderModel, encoder_mask
from lmcli.models.encoder_decoder_run import DecoderRun


class GeneratingModel(BaseModel):
    """A decoder-only BaseModel that generates."""

    def generate(self, *args: Any, **kwargs: Any) -> torch.Tensor | None:
        """Prompt ids [B, T] (left-padded, with `attention_mask`) -> [B, T + n], under inference mode:
        `lmcli.generation.generate(self, ...)`, whose docstring is the contract (speculation included)."""
        from lmcli.generation import generate

        result: torch.Tensor | None = generate(self, *args, **kwargs)
        return result


class GeneratingEncoderDecoder(EncoderDecoderModel):
    """An encoder-decoder (T5, BART, Marian) that generates."""

    @torch.inference_mode()
    def generate(self, x: torch.Tensor, max_new_tokens: int, do_sample: bool, temperature: float = 1.0,
                 top_k: int | None = None, top_p: float | None = None, use_cache: bool = True,
                 attention_mask: torch.Tensor | None = None, eos_token_id: Any = None,
                 pad_token_id: int | None = None, **kwargs: Any) -> torch.Tensor | None:
        """Encoder input ids [B, S] (padded on either side, with `attention_mask`) -> decoder ids
        [B, 1 + n], starting with decoder_start_token_id. The other arguments and the contract are
        `lmcli.generation.loop.generate`'s; the encoder runs once, before the first step."""
        from lmcli.generation import generate  # beams, speculation or the plain loop, as for decoders

        mask = encoder_mask(x, attention_mask)  # [B, S]
        run = DecoderRun(self, self.encode(x.to(self.device), mask.to(self.device)), mask.to(self.device))
        max_new_tokens = run.fit_to_positions(max_new_tokens)
        start = self.decoder_start(x.shape[0], self.device)  # [B, 1]
        return generate(run, start, max_new_tokens, do_sample, temperature, top_k, top_p, use_cache,
                        None, eos_token_id, pad_token_id, **kwargs)
