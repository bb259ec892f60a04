"""Building blocks shared by the HF-directory and GGUF tokenizers: SentencePiece-style spaces,
BOS/EOS wrapping, and BPE merges implied by a vocabulary."""

from __future__ import annotations

from collections.abc import Mapping

from tokenizers import Tokenizer as Backend
from tokenizers import decoders, pre_tokenizers, processors

SPIECE_SPACE = "\u2581"  # SentencePiece's visible space, "▁"


def set_bos_eos(backend: Backend, bos: str | None, eos: str | None, add_bos: bool, add_eos: bool) -> None:
    """Wrap every encoding in BOS/EOS as the flags say (the reference's TemplateProcessing)."""
    bos_id = backend.token_to_id(bos) if bos is not None else None
    eos_id = backend.token_to_id(eos) if eos is not None else None
    add_bos, add_eos = add_bos and bos_id is not None, add_eos and eos_id is not None
    single = (f"{bos}:0 " if add_bos else "") + "$A:0" + (f" {eos}:0" if add_eos else "")
    pair = single + (f" {bos}:1" if add_bos else "") + " $B:1" + (f" {eos}:1" if add_eos else "")
    specials = ([(bos, bos_id)] if add_bos else []) + ([(eos, eos_id)] if add_eos and eos != bos else [])
    backend.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)


def llama_text_handling(backend: Backend, add_prefix_space: bool, legacy: bool) -> None:
    """SentencePiece-style spaces as transformers' Llama class sets them (it ignores the file's own)."""
    scheme = ("always" if legacy else "first") if add_prefix_space else "never"
    backend.normalizer = None
    backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPIECE_SPACE, prepend_scheme=scheme, split=False)
    steps = [decoders.Replace(SPIECE_SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    backend.decoder = decoders.Sequence(steps)


def implied_merges(vocab: dict[str, int], scores: Mapping[str, float] | None = None) -> list[tuple[str, str]]:
    """BPE merges recovered from a vocabulary that lists none, ranked as the reference ranks them.

    Every way to cut a token into two tokens of the vocabulary is a merge. Without scores the
    merges follow the token's position in the vocabulary (shorter left part first); with scores,
    the best score first, then the longer left part, then first-listed token.
    """
    found = []
    known = vocab.__contains__  # the loop below runs millions of times for a 262k vocabulary
    for order, (token, score) in enumerate((scores if scores is not None else vocab).items()):
        for cut in range(1, len(token)):
            left = token[:cut]
            if known(left):
                right = token[cut:]
                if known(right):
                    found.append((score, cut, order, left, right))
    if scores is None:
        found.sort(key=lambda merge: (merge[0], merge[1]))
    else:
        found.sort(key=lambda merge: (-merge[0], -merge[1], merge[2]))
    return [(left, right) for _, _, _, left, right in found]
