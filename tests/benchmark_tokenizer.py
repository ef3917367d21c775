"""A small deterministic tokenizer for the benchmark loaders' tests: one id per whitespace-separated word (ids
assigned in order of first sight), a BOS id first, ``decode`` joins the words back with single spaces."""

from __future__ import annotations

from types import SimpleNamespace


class WordTokenizer:
    bos_token_id, eos_token_id = 1, 2
    chat_template = None

    def __init__(self) -> None:
        self.vocab: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def _id(self, word: str) -> int:
        if word not in self.vocab:
            self.vocab[word] = len(self.vocab) + 3
            self.words[self.vocab[word]] = word
        return self.vocab[word]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self._id(w) for w in text.split()]
        return [self.bos_token_id] + ids if add_special_tokens else ids

    def __call__(self, text: str, add_special_tokens: bool = True):
        return SimpleNamespace(input_ids=self.encode(text, add_special_tokens))

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in ids if i in self.words)
