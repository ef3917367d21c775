"""Text-scoring pieces that more than one benchmark's metrics use, each written once.

* ``normalize_en`` / ``normalize_zh``: answer normalisation as LongBench's ``metrics.py`` and InfiniteBench's
  ``src/compute_scores.py`` both write it (``normalize_answer`` / ``normalize_zh_answer``: the same code and the same
  Chinese punctuation list in the two repositories), and ``token_f1`` / ``qa_f1``, their token F1.
* ``lcs_indices``: one longest common subsequence, traced back with the tie rule of either ROUGE scorer.
* ``rouge_l`` / ``rouge_n``: ROUGE as the ``rouge`` package (pltrdy/rouge 1.0.1) computes it, the scorer that
  LongBench's ``metrics.py`` and LooGLE's ``automatic_metrics.py`` call. InfiniteBench scores En.Sum with Google's
  ``rouge_score`` (through 🤗 ``evaluate``), a different computation (ROUGE-Lsum: other tokens, sentences split at
  newlines, counts clipped); that one is ``infinitebench.rouge_lsum``.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_ASCII_PUNCT = frozenset(string.punctuation)
# the Chinese punctuation both repositories' normalize_zh_answer remove besides ASCII punctuation: the fullwidth forms
# of ASCII punctuation except the fullwidth full stop, the halfwidth CJK marks, quotes / dashes / ellipses (not the
# single low quotation mark U+201A), most CJK brackets (U+300B but not U+300A), the wavy and double-sided marks
ZH_PUNCT = _ASCII_PUNCT | frozenset(
    chr(c)
    for c in [
        *range(0xFF01, 0xFF65),
        0x2013,
        0x2014,
        0x2018,
        0x2019,
        *range(0x201B, 0x2020),
        0x2026,
        0x2027,
        *range(0x3001, 0x3004),
        *range(0x300B, 0x3012),
        *range(0x3014, 0x3020),
        0x3030,
        0x303E,
        0x303F,
        0xFE4F,
    ]
    if not chr(c).isalnum() and c != 0xFF0E
)


def normalize_en(text: str) -> str:
    """SQuAD-style: lowercase, ASCII punctuation removed, the articles a / an / the removed, spaces collapsed."""
    text = "".join(ch for ch in text.lower() if ch not in _ASCII_PUNCT)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh(text: str) -> str:
    """The Chinese normalisation: lowercase, ASCII and Chinese punctuation (``ZH_PUNCT``) removed, all whitespace
    removed."""
    return "".join(ch for ch in text.lower() if ch not in ZH_PUNCT and not ch.isspace())


def token_f1(prediction: list, truth: list) -> float:
    """F1 of the multiset overlap of two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction) & Counter(truth)).values())
    if same == 0:
        return 0.0
    p, r = same / len(prediction), same / len(truth)
    return 2 * p * r / (p + r)


def qa_f1(output: str, truth: str) -> float:
    """``qa_f1_score`` of LongBench and InfiniteBench: token F1 of the normalised (``normalize_en``) output and
    answer, split at whitespace."""
    return token_f1(normalize_en(output).split(), normalize_en(truth).split())


def lcs_indices(a: list, b: list, ties: str) -> list[int]:
    """Indices into ``a`` (increasing) of one longest common subsequence of ``a`` and ``b``, traced back from the ends:
    a match is taken, else the step back that keeps the longer LCS; on a tie the step back is in ``b`` for
    ``ties="b"`` (the ``rouge`` package's ``_recon_lcs``) and in ``a`` for ``ties="a"`` (``rouge_score``'s
    backtrack). The two rules can pick different subsequences, so ROUGE over sets of words can differ."""
    n, m = len(a), len(b)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        row, prev, x = table[i], table[i - 1], a[i - 1]
        for j in range(1, m + 1):
            row[j] = prev[j - 1] + 1 if x == b[j - 1] else max(prev[j], row[j - 1])
    out, i, j = [], n, m
    while i > 0 and j > 0:
        if a[i - 1] == b[j - 1]:
            out.append(i - 1)
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1] or (ties == "a" and table[i - 1][j] == table[i][j - 1]):
            i -= 1
        else:
            j -= 1
    return out[::-1]


def _sentences(text: str) -> list[str]:
    # the rouge package's split: at every ".", non-empty pieces kept, whitespace collapsed (a piece of spaces only
    # stays as an empty sentence, whose one word is "")
    return [" ".join(piece.split()) for piece in text.split(".") if piece]


def _words(sentences: list[str]) -> list[str]:
    return [w for s in sentences for w in s.split(" ")]


def rouge_l(hypothesis: str, reference: str) -> dict | None:
    """ROUGE-L ``{"f", "p", "r"}`` as the ``rouge`` package (pltrdy/rouge 1.0.1, default exclusive mode) computes
    it, or None when either text has no sentence: both split into sentences at "."; the union over every (reference
    sentence, hypothesis sentence) pair of the words of their LCS (``lcs_indices``, ties="b"), counted once; recall
    over the reference's distinct words, precision over the hypothesis's; F = 2PR / (P + R + 1e-8).

    This is the ROUGE-L of LongBench and LooGLE (both call the ``rouge`` package), not InfiniteBench's ROUGE-Lsum
    (``infinitebench.rouge_lsum``, rouge_score's), which tokenizes, splits sentences and counts differently. The
    ``rouge`` package rebuilds each LCS recursively and gives 0 past Python's recursion limit (about 1000 words in a
    sentence pair); here such a pair is scored."""
    hyp, ref = _sentences(hypothesis), _sentences(reference)
    if not hyp or not ref:
        return None
    union: set[str] = set()
    hyp_words = [h.split(" ") for h in hyp]
    for r in ref:
        r_words = r.split(" ")
        for h in hyp_words:
            union |= {r_words[k] for k in lcs_indices(r_words, h, ties="b")}
    rec, prec = len(union) / len(set(_words(ref))), len(union) / len(set(_words(hyp)))
    return {"f": 2 * prec * rec / (prec + rec + 1e-8), "p": prec, "r": rec}


def rouge_n(hypothesis: str, reference: str, n: int) -> dict | None:
    """ROUGE-N ``{"f", "p", "r"}`` as the ``rouge`` package computes it (sets of word n-grams, sentences split at
    "." and joined again), or None when either text has no sentence."""
    hyp, ref = _sentences(hypothesis), _sentences(reference)
    if not hyp or not ref:
        return None

    def grams(words):
        return {tuple(words[i : i + n]) for i in range(len(words) - n + 1)}

    h, r = grams(_words(hyp)), grams(_words(ref))
    same = len(h & r)
    prec = same / len(h) if h else 0.0
    rec = same / len(r) if r else 0.0
    return {"f": 2 * prec * rec / (prec + rec + 1e-8), "p": prec, "r": rec}


__all__ = ["ZH_PUNCT", "lcs_indices", "normalize_en", "normalize_zh", "qa_f1", "rouge_l", "rouge_n", "token_f1"]
