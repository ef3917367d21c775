"""Punctuation token ids of a tokenizer, for SABlock's segmentation.

A token is punctuation when its decoded text, without trailing spaces or tabs, ends in one of
``. , ; : ! ?``, a newline, or their CJK / full-width forms (``。 ， ； ： ！ ？ 、 ． ｡ ､``). That covers
byte-level BPE (``Ċ``, ``).``), SentencePiece (``<0x0A>``, ``▁.``) and multi-character tokens
(``"\\n\\n"``, ``"...",``) alike, since it reads what the token writes, not how it is spelled.
Special tokens are never punctuation.
"""

from __future__ import annotations

import weakref

ENDINGS = frozenset(".,;:!?\n") | frozenset("\u3002\uff0c\uff1b\uff1a\uff01\uff1f\u3001\uff0e\uff61\uff64")

_CACHE: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def is_punctuation(text: str) -> bool:
    """Whether a token's decoded text ends a segment."""
    text = text.rstrip(" \t")
    return bool(text) and text[-1] in ENDINGS


def punctuation_ids(tokenizer) -> tuple[int, ...]:
    """Sorted ids of the punctuation tokens of a HF tokenizer (cached per tokenizer object)."""
    try:
        return _CACHE[tokenizer]
    except (KeyError, TypeError):
        pass
    special = set(getattr(tokenizer, "all_special_ids", ()) or ())
    ids = list(range(len(tokenizer)))
    texts = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    found = tuple(i for i, t in zip(ids, texts) if i not in special and is_punctuation(t))
    try:
        _CACHE[tokenizer] = found
    except TypeError:  # pragma: no cover - an object without weak references
        pass
    return found
