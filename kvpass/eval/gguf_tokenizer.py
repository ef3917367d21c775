"""The tokenizer of a converted GGUF model: transformers' reading of the GGUF when it is sound, else one
built from the GGUF's own vocabulary (``kvpass.eval.models`` converts the weights and calls
:func:`save_tokenizer`).

Every converted tokenizer must encode :data:`TOKENIZER_PROBES` as the GGUF's vocabulary does (a SentencePiece
one exactly as llama.cpp would), decode them back, and encode them the same once saved and loaded again.
The vocabulary is read from the file's ``tokenizer.*`` metadata directly (GGUF versions 2 and 3).
"""

from __future__ import annotations

import functools
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

REFERENCE_TEXT = "The capital of France is"  # the logits of this prompt are checked after conversion

# Every converted tokenizer must encode these as the GGUF's vocabulary does, decode them back, and
# encode them the same once saved and loaded again. Between them: words, digits, punctuation, runs
# of spaces, a tab, newlines, accented, CJK and emoji characters, and a Gothic letter that few
# vocabularies hold (bytes, where the vocabulary falls back to them).
TOKENIZER_PROBES = (
    REFERENCE_TEXT,
    "Hello, world! It costs $3.14 (or 42 coins) - e.g. 1,024 items.",
    "two  spaces,   three,\ta tab\nand a new line\n\nthen a paragraph.",
    "naïve café, Größe, 東京 and 🙂 plus 𐌰.",
)

# llama.cpp's token types (tokenizer.ggml.token_type)
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED, _UNUSED, _BYTE = 1, 2, 3, 4, 5, 6

_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_tokenizer_metadata(path: Path) -> dict:
    """The ``tokenizer.*`` metadata of a GGUF file (version 2 or 3), arrays as lists.

    Only the key-value header is read, and only these keys are kept: gguf's ``GGUFReader`` parses
    every tensor's description and every array element too, seconds for a 262k-token vocabulary.
    """
    import mmap
    import struct

    meta: dict = {}
    with Path(path).open("rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        magic, version, _tensors, count = struct.unpack_from("<4sIQQ", m, 0)
        if magic != b"GGUF" or version < 2:
            raise ValueError(f"{Path(path).name} is not a GGUF file of version 2 or later")
        pos = 24

        def string() -> str:
            nonlocal pos
            (n,) = struct.unpack_from("<Q", m, pos)
            pos += 8 + n
            return m[pos - n : pos].decode("utf-8")

        def value(kind: int):
            nonlocal pos
            if kind == _GGUF_STRING:
                return string()
            if kind == _GGUF_ARRAY:
                inner, n = struct.unpack_from("<IQ", m, pos)
                pos += 12
                if inner in _GGUF_SCALARS:
                    size = struct.calcsize(_GGUF_SCALARS[inner])
                    items = [x for (x,) in struct.iter_unpack(_GGUF_SCALARS[inner], m[pos : pos + size * n])]
                    pos += size * n
                    return items
                return [value(inner) for _ in range(n)]
            fmt = _GGUF_SCALARS[kind]  # KeyError: a type this reader does not know
            (x,) = struct.unpack_from(fmt, m, pos)
            pos += struct.calcsize(fmt)
            return x

        for _ in range(count):
            key = string()
            (kind,) = struct.unpack_from("<I", m, pos)
            pos += 4
            item = value(kind)
            if key.startswith("tokenizer."):
                meta[key] = item
    return meta


@dataclass(frozen=True)
class _Vocab:
    """A GGUF's tokenizer as its metadata states it, with llama.cpp's defaults for what it leaves out."""

    model: str  # tokenizer.ggml.model: "llama" is SentencePiece, "gpt2" byte-level BPE, ...
    tokens: list[str]
    scores: list[float]
    types: list[int]  # _NORMAL, _CONTROL, ... per token
    special: dict[str, int]  # "bos", "eos", "unk", "pad" -> token id, those the file names
    add_bos: bool
    add_eos: bool
    add_space_prefix: bool
    chat_template: str | None

    @functools.cached_property
    def index(self) -> dict[str, int]:
        """Token text -> id (the last of duplicates, as llama.cpp and transformers have it)."""
        return {t: i for i, t in enumerate(self.tokens)}


def _gguf_vocab(path: Path) -> _Vocab | None:
    """The vocabulary of a GGUF, or None where its metadata cannot be read or holds none."""
    import struct

    try:
        meta = _gguf_tokenizer_metadata(path)
    except (OSError, ValueError, KeyError, struct.error):
        return None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        return None
    model = str(meta.get("tokenizer.ggml.model", ""))
    n = len(tokens)
    scores = meta.get("tokenizer.ggml.scores") or [0.0] * n
    types = meta.get("tokenizer.ggml.token_type") or [_NORMAL] * n
    if len(scores) != n or len(types) != n:
        return None
    special = {}
    for name, key in (
        ("bos", "bos_token_id"),
        ("eos", "eos_token_id"),
        ("unk", "unknown_token_id"),
        ("pad", "padding_token_id"),
    ):
        tid = meta.get(f"tokenizer.ggml.{key}")
        if isinstance(tid, int) and 0 <= tid < n:
            special[name] = tid
    spm = model == "llama"
    return _Vocab(
        model=model,
        tokens=list(tokens),
        scores=[float(s) for s in scores],
        types=[int(t) for t in types],
        special=special,
        add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", spm)),
        add_eos=bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        add_space_prefix=bool(meta.get("tokenizer.ggml.add_space_prefix", spm)),
        chat_template=meta.get("tokenizer.chat_template"),
    )


def _spm_encode(text: str, vocab: _Vocab) -> list[int]:
    """``text`` as llama.cpp tokenizes it with a SentencePiece ("llama") GGUF vocabulary.

    Control and user-defined tokens are cut out whole first, longest first. Each stretch of text in
    between gets a leading space where the file asks for one (at the start and after such a token),
    its spaces written as "▁", and is then merged pairwise from single characters, always the
    adjacent pair whose concatenation is the best-scored token (the leftmost among equals), until no
    pair forms a token. A character left outside the vocabulary becomes its UTF-8 byte tokens.
    """
    import heapq

    index = vocab.index
    ids = [vocab.special["bos"]] if vocab.add_bos and "bos" in vocab.special else []
    whole = sorted(
        {
            t
            for t, kind in zip(vocab.tokens, vocab.types)
            if kind in (_CONTROL, _USER_DEFINED, _UNKNOWN) and t and t in text
        },
        key=len,
        reverse=True,
    )
    parts: list[str | int] = [text] if text else []
    for token in whole:
        split: list[str | int] = []
        for part in parts:
            if isinstance(part, int):
                split.append(part)
                continue
            for k, piece in enumerate(part.split(token)):
                if k:
                    split.append(index[token])
                if piece:
                    split.append(piece)
        parts = split

    after_special = True
    for part in parts:
        if isinstance(part, int):
            ids.append(part)
            after_special = True
            continue
        s = ((" " if vocab.add_space_prefix and after_special else "") + part).replace(" ", "▁")
        after_special = False
        # symbols: [start, length] of each; linked left to right
        start, length = list(range(len(s))), [1] * len(s)
        prev, nxt = list(range(-1, len(s) - 1)), [*range(1, len(s)), -1]
        queue: list[tuple[float, int, int, int]] = []

        def offer(left: int, right: int) -> None:
            if left < 0 or right < 0:
                return
            tid = index.get(s[start[left] : start[right] + length[right]])
            if tid is not None:
                heapq.heappush(queue, (-vocab.scores[tid], left, right, length[left] + length[right]))

        for i in range(1, len(s)):
            offer(i - 1, i)
        while queue:
            _, left, right, size = heapq.heappop(queue)
            if length[left] == 0 or length[right] == 0 or length[left] + length[right] != size:
                continue  # one of the two has merged since
            length[left], length[right] = size, 0
            nxt[left] = nxt[right]
            if nxt[left] >= 0:
                prev[nxt[left]] = left
            offer(prev[left], left)
            offer(left, nxt[left])
        i = 0 if s else -1
        while i >= 0:
            piece = s[start[i] : start[i] + length[i]]
            if piece in index:
                ids.append(index[piece])
            else:
                for byte in piece.encode("utf-8"):
                    tid = index.get(f"<0x{byte:02X}>", vocab.special.get("unk"))
                    if tid is not None:
                        ids.append(tid)
            i = nxt[i]
    if vocab.add_eos and "eos" in vocab.special:
        ids.append(vocab.special["eos"])
    return ids


def _sentencepiece_tokenizer(vocab: _Vocab):
    """A fast tokenizer built from a SentencePiece ("llama") GGUF vocabulary alone.

    It is BPE with byte fallback whose merges are every cut of a token into two tokens of the
    vocabulary, best first: a pair that forms a better-scored token merges first, as in llama.cpp.
    Spaces become "▁" (after a leading one where the file asks for it). Control tokens are special
    tokens and user-defined ones (newlines, tabs, markup, ...) added tokens, both matched whole in the
    raw text. BOS and EOS are added where the file says.

    One exception keeps this tokenizer identical to the one transformers 5.23 reads from Gemma-3's
    GGUF: without a space prefix, user-defined runs of spaces are spelled with "▁" and merged before
    all other pairs. That gives the same tokens on runs of up to 31 spaces; on longer ones it takes
    16-space tokens where llama.cpp and SentencePiece take the longest first, as Hugging Face's own
    Gemma tokenizer does.
    """
    from tokenizers import AddedToken, Tokenizer, decoders, normalizers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    spelled, first, added = list(vocab.tokens), [], []
    for i, (t, kind) in enumerate(zip(vocab.tokens, vocab.types)):
        if kind != _USER_DEFINED:
            continue
        if " " in t and not vocab.add_space_prefix and t.replace(" ", "▁") not in vocab.index:
            spelled[i] = t.replace(" ", "▁")
            first.append(i)
        else:
            added.append(t)
    index = {t: i for i, t in enumerate(spelled)}
    normal = sorted((i for i, kind in enumerate(vocab.types) if kind == _NORMAL), key=lambda i: (-vocab.scores[i], i))
    merges = []
    for i in first + normal:
        t = spelled[i]
        if index[t] == i:  # the longer left part first, as transformers orders them
            merges += [(t[:k], t[k:]) for k in range(len(t) - 1, 0, -1) if t[:k] in index and t[k:] in index]
    special = {name: vocab.tokens[tid] for name, tid in vocab.special.items()}
    backend = Tokenizer(
        BPE(
            vocab=index,
            merges=merges,
            unk_token=special.get("unk"),
            fuse_unk=True,
            byte_fallback="<0x00>" in index,
            dropout=None,
        )
    )
    steps = [normalizers.Replace(" ", "▁")]
    undo = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if vocab.add_space_prefix:
        steps.insert(0, normalizers.Prepend("▁"))
        undo.append(decoders.Strip(content=" ", left=1, right=0))
    backend.normalizer = normalizers.Sequence(steps)
    backend.decoder = decoders.Sequence(undo)
    backend.add_special_tokens(
        [
            AddedToken(t, normalized=False, special=True)
            for t, kind in zip(vocab.tokens, vocab.types)
            if kind in (_CONTROL, _UNKNOWN)
        ]
    )
    backend.add_tokens([AddedToken(t, normalized=False, special=False) for t in added])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        add_bos_token=vocab.add_bos,
        add_eos_token=vocab.add_eos,
        clean_up_tokenization_spaces=False,
        **{f"{name}_token": t for name, t in special.items()},
    )
    if vocab.chat_template:
        tokenizer.chat_template = vocab.chat_template
    return tokenizer


def _short(ids: list[int]) -> str:
    return str(ids) if len(ids) <= 12 else f"[{', '.join(map(str, ids[:12]))}, ...] ({len(ids)} ids)"


def _tokenizer_problem(tokenizer, vocab: _Vocab | None, folder: Path) -> str | None:
    """None when ``tokenizer`` encodes :data:`TOKENIZER_PROBES` with ids of the vocabulary -- for a
    SentencePiece vocabulary, exactly as llama.cpp does -- decodes them back, and, saved into
    ``folder`` and loaded from there again, encodes them the same; else what is wrong."""
    from transformers import AutoTokenizer

    encoded = [list(tokenizer(text).input_ids) for text in TOKENIZER_PROBES]
    for text, ids in zip(TOKENIZER_PROBES, encoded):
        if vocab is not None and not all(0 <= i < len(vocab.tokens) for i in ids):
            return f"it encodes {text!r} as {_short(ids)}, past the GGUF's {len(vocab.tokens)} tokens"
        if vocab is not None and vocab.model == "llama":
            want = _spm_encode(text, vocab)
            if ids != want:
                return f"it encodes {text!r} as {_short(ids)}, the GGUF's vocabulary as {_short(want)}"
        back = tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        # Where the vocabulary puts a space before every stretch of text, text after an added token
        # (a newline, say) decodes with that space: then only the words must come back.
        loose = vocab is None or vocab.add_space_prefix
        if (back.split() != text.split()) if loose else (back != text):
            return f"it decodes {text!r} back as {back!r}"
    tokenizer.save_pretrained(folder)
    again = AutoTokenizer.from_pretrained(folder)
    for text, ids in zip(TOKENIZER_PROBES, encoded):
        got = list(again(text).input_ids)
        if got != ids:
            return f"saved and loaded again, it encodes {text!r} as {_short(got)}, not {_short(ids)}"
    return None


def save_tokenizer(tokenizer, failure: str | None, gguf: Path, out: Path, label: str, say: Callable[[str], None]):
    """Save the GGUF's tokenizer into ``out`` (which holds the model); returns the tokenizer saved.

    That is ``tokenizer`` (transformers' reading of the GGUF; None with ``failure`` where it could not
    build one) when :func:`_tokenizer_problem` finds nothing wrong with it. Otherwise, for a
    SentencePiece vocabulary, it is one built from the vocabulary itself, which must pass the same
    checks: transformers 5.17, for one, reads Gemma-3's vocabulary as Unigram with BPE merge ranks for
    log-probabilities (" capital" comes out as "▁c ap it al"), without the BOS the file asks for, and
    writes files that load as BPE with no merges (single characters). A tokenizer that fails its checks
    is never kept: the conversion stops.
    """
    vocab = _gguf_vocab(gguf)
    model_files = {p.name for p in out.iterdir()}
    if tokenizer is not None:
        problem = _tokenizer_problem(tokenizer, vocab, out)
        if problem is None:
            return tokenizer
        failure = f"transformers' tokenizer is wrong ({problem})"
    if vocab is None or vocab.model != "llama":
        kind = f"a {vocab.model!r} vocabulary" if vocab is not None else "a vocabulary kvpass cannot read"
        raise RuntimeError(
            f"kvpass: converting {label}: {failure}; kvpass builds only SentencePiece "
            f"vocabularies itself, and {gguf.name} has {kind}"
        )
    say(f"  {failure}; building it from the GGUF's vocabulary")
    for stale in out.iterdir():  # what the rejected tokenizer wrote
        if stale.name not in model_files:
            if stale.is_dir():
                shutil.rmtree(stale)
            else:
                stale.unlink()
    t0 = time.perf_counter()
    tokenizer = _sentencepiece_tokenizer(vocab)
    failure = _tokenizer_problem(tokenizer, vocab, out)
    if failure is not None:
        raise RuntimeError(
            f"kvpass: converting {label}: the tokenizer built from the vocabulary of {gguf.name} "
            f"is wrong too ({failure})"
        )
    say(f"  built and checked it ({len(tokenizer)} tokens) in {time.perf_counter() - t0:.1f} s")
    return tokenizer
