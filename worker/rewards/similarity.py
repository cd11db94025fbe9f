"""Text similarity metrics in [0, 1], written here (no nltk, rouge-score or rapidfuzz dependency).

Character metrics compare the raw strings. Word metrics first lowercase and
split on runs of letters and digits, so punctuation is dropped (as
rouge-score's default tokenizer does). Two empty texts are identical (1.0);
an empty text against a non-empty one scores 0.0.

The edit distances use bit-parallel algorithms over Python integers (one
big-integer operation per character of the second text), so 4,000-character
texts cost milliseconds, not the seconds a quadratic table would.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Hashable, Sequence

_WORD = re.compile(r"\w+")


def words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def lcs_length(a: Sequence[Hashable], b: Sequence[Hashable]) -> int:
    """Length of the longest common subsequence (Allison-Dix / Hyyrö bit-vector algorithm)."""
    if not a or not b:
        return 0
    positions: dict[Hashable, int] = {}
    for i, item in enumerate(a):
        positions[item] = positions.get(item, 0) | (1 << i)
    mask = (1 << len(a)) - 1
    v = mask
    for item in b:
        u = v & positions.get(item, 0)
        v = ((v + u) | (v - u)) & mask
    return len(a) - bin(v).count("1")


def levenshtein(a: str, b: str) -> int:
    """Edit distance with unit costs for insertion, deletion and substitution (Myers / Hyyrö bit-vector)."""
    if not a:
        return len(b)
    if not b:
        return len(a)
    peq: dict[str, int] = {}
    for i, ch in enumerate(a):
        peq[ch] = peq.get(ch, 0) | (1 << i)
    mask = (1 << len(a)) - 1
    last = 1 << (len(a) - 1)
    pv, mv, score = mask, 0, len(a)
    for ch in b:
        eq = peq.get(ch, 0)
        xv = eq | mv
        xh = (((eq & pv) + pv) ^ pv) | eq
        ph = mv | (~(xh | pv) & mask)
        mh = pv & xh
        if ph & last:
            score += 1
        elif mh & last:
            score -= 1
        ph = ((ph << 1) | 1) & mask
        mh = (mh << 1) & mask
        pv = (mh | ~(xv | ph)) & mask
        mv = ph & xv
    return score


def edit_ratio(a: str, b: str) -> float:
    """1 - levenshtein(a, b) / max(len(a), len(b))."""
    longest = max(len(a), len(b))
    return 1.0 if longest == 0 else 1.0 - levenshtein(a, b) / longest


def fuzzy_match(a: str, b: str) -> float:
    """rapidfuzz's fuzz.ratio / 100: the normalised insertion/deletion similarity, 2 * LCS / (len(a) + len(b))."""
    total = len(a) + len(b)
    return 1.0 if total == 0 else 2.0 * lcs_length(a, b) / total


def _f1(overlap: int, candidate: int, reference: int) -> float:
    if overlap == 0:
        return 0.0
    precision, recall = overlap / candidate, overlap / reference
    return 2 * precision * recall / (precision + recall)


def token_f1(candidate: str, reference: str) -> float:
    """F1 of the two bags of words (SQuAD's F1, without its article removal)."""
    c, r = words(candidate), words(reference)
    if not c or not r:
        return float(c == r)
    return _f1(sum((Counter(c) & Counter(r)).values()), len(c), len(r))


def _ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def rouge_n(candidate: str, reference: str, n: int) -> float:
    """ROUGE-N F1: clipped n-gram overlap over the candidate's (precision) and the reference's (recall) n-grams."""
    c, r = _ngrams(words(candidate), n), _ngrams(words(reference), n)
    if not c or not r:
        return float(not c and not r and words(candidate) == words(reference))
    return _f1(sum((c & r).values()), sum(c.values()), sum(r.values()))


def rouge_l(candidate: str, reference: str) -> float:
    """ROUGE-L F1: longest common subsequence of words over each text's length."""
    c, r = words(candidate), words(reference)
    if not c or not r:
        return float(c == r)
    return _f1(lcs_length(c, r), len(c), len(r))


def bleu(candidate: str, reference: str, max_n: int = 4) -> float:
    """Sentence BLEU-4 against one reference, with BLEU+1 smoothing.

    p_1 = clipped unigram matches / candidate unigrams; for n >= 2,
    p_n = (matches + 1) / (candidate n-grams + 1) (Lin & Och 2004), so one
    missing 4-gram does not zero a short sentence. Orders longer than the
    candidate are left out. BLEU = BP * exp(mean(log p_n)), with brevity
    penalty BP = 1 if c > r else exp(1 - r / c) (c, r: word counts).
    """
    c, r = words(candidate), words(reference)
    if not c or not r:
        return float(c == r)
    logs = []
    for n in range(1, min(max_n, len(c)) + 1):
        cand, ref = _ngrams(c, n), _ngrams(r, n)
        matches, total = sum((cand & ref).values()), sum(cand.values())
        if n == 1:
            if matches == 0:
                return 0.0
            logs.append(math.log(matches / total))
        else:
            logs.append(math.log((matches + 1) / (total + 1)))
    brevity = 1.0 if len(c) > len(r) else math.exp(1 - len(r) / len(c))
    return brevity * math.exp(sum(logs) / len(logs))


def similarity(metric: str, candidate: str, reference: str) -> float:
    """The named metric (service/schemas/reward_checks.SIMILARITY_METRICS)."""
    if metric.startswith("rouge_") and metric[6:].isdigit():
        return rouge_n(candidate, reference, int(metric[6:]))
    return _METRICS[metric](candidate, reference)


_METRICS = {
    "token_f1": token_f1, "edit_ratio": edit_ratio, "fuzzy_match": fuzzy_match, "bleu": bleu, "rouge_l": rouge_l,
}
