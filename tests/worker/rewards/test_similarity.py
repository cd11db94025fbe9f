"""Similarity metrics against values computed by hand (the arithmetic is in each test's comments)."""

from __future__ import annotations

import math
import random

import pytest

from worker.rewards.similarity import (
    bleu,
    edit_ratio,
    fuzzy_match,
    lcs_length,
    levenshtein,
    rouge_l,
    rouge_n,
    similarity,
    token_f1,
    words,
)


def test_words_lowercase_and_drop_punctuation():
    assert words("The CAT, sat!  on-the mat.") == ["the", "cat", "sat", "on", "the", "mat"]


def test_levenshtein_classic_cases():
    assert levenshtein("kitten", "sitting") == 3  # k->s, e->i, +g
    assert levenshtein("flaw", "lawn") == 2  # -f, +n
    assert levenshtein("", "abc") == 3 and levenshtein("abc", "") == 3 and levenshtein("same", "same") == 0
    assert levenshtein("abc", "cba") == 2  # substitute a<->c


def test_lcs_length_on_characters_and_words():
    assert lcs_length("ABCBDAB", "BDCABA") == 4  # CLRS: BCBA
    assert lcs_length(["the", "cat", "sat"], ["the", "sat"]) == 2
    assert lcs_length("", "abc") == 0


def _dp_levenshtein(a: str, b: str) -> int:
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def _dp_lcs(a, b) -> int:
    prev = [0] * (len(b) + 1)
    for ca in a:
        cur = [0]
        for j, cb in enumerate(b, 1):
            cur.append(prev[j - 1] + 1 if ca == cb else max(prev[j], cur[j - 1]))
        prev = cur
    return prev[-1]


def test_bit_parallel_algorithms_agree_with_the_textbook_tables():
    rng = random.Random(7)
    for _ in range(500):
        a = "".join(rng.choice("abc") for _ in range(rng.randint(0, 80)))  # > 64 chars crosses a word boundary
        b = "".join(rng.choice("abcd") for _ in range(rng.randint(0, 80)))
        assert levenshtein(a, b) == _dp_levenshtein(a, b), (a, b)
        assert lcs_length(a, b) == _dp_lcs(a, b), (a, b)


def test_edit_ratio():
    assert edit_ratio("kitten", "sitting") == pytest.approx(1 - 3 / 7)
    assert edit_ratio("", "") == 1.0 and edit_ratio("abc", "") == 0.0


def test_fuzzy_match_is_rapidfuzz_ratio():
    # rapidfuzz's documented example: fuzz.ratio("this is a test", "this is a test!") == 96.55
    assert fuzzy_match("this is a test", "this is a test!") == pytest.approx(0.9655, abs=1e-4)
    # LCS("abcd", "acbd") = 3 -> 2*3/8
    assert fuzzy_match("abcd", "acbd") == pytest.approx(0.75)
    assert fuzzy_match("", "") == 1.0 and fuzzy_match("a", "") == 0.0


def test_token_f1():
    # pred: the cat sat (3), ref: the cat ran away (4); common: the, cat = 2 -> P 2/3, R 2/4, F1 = 4/7
    assert token_f1("The cat sat.", "the cat ran away") == pytest.approx(4 / 7)
    assert token_f1("a a b", "a b b") == pytest.approx(2 / 3)  # common a:1, b:1 = 2; P = R = 2/3
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0 and token_f1("x", "y") == 0.0


def test_rouge_n():
    c, r = "the cat sat on the mat", "the cat lay on the mat"
    # unigrams: c {the:2,cat,sat,on,mat}, r {the:2,cat,lay,on,mat}; overlap 5 of 6 each -> F1 5/6
    assert rouge_n(c, r, 1) == pytest.approx(5 / 6)
    # bigrams: c {the cat, cat sat, sat on, on the, the mat}, r {the cat, cat lay, lay on, on the, the mat}
    # overlap 3 of 5 each -> 0.6
    assert rouge_n(c, r, 2) == pytest.approx(0.6)
    assert similarity("rouge_2", c, r) == pytest.approx(0.6)
    assert rouge_n("a b", "a b c", 3) == 0.0  # the candidate has no trigram


def test_rouge_l():
    # LCS(words) = the cat on the mat = 5; P = R = 5/6
    assert rouge_l("the cat sat on the mat", "the cat lay on the mat") == pytest.approx(5 / 6)
    # c = a b c d (4), r = a c e (3): LCS a c = 2 -> P 1/2, R 2/3, F1 = 4/7
    assert rouge_l("a b c d", "a c e") == pytest.approx(4 / 7)


def test_bleu_by_hand():
    assert bleu("the cat sat on the mat", "the cat sat on the mat") == pytest.approx(1.0)
    c, r = "the cat sat on the mat", "the cat lay on the mat"
    # p1 = 5/6; p2 = (3+1)/(5+1); p3: c trigrams 4, matches (on the mat) 1 -> 2/5;
    # p4: 3 four-grams, 0 matches -> 1/4; same length -> BP = 1
    expected = math.exp((math.log(5 / 6) + math.log(4 / 6) + math.log(2 / 5) + math.log(1 / 4)) / 4)
    assert bleu(c, r) == pytest.approx(expected)
    # shorter candidate: c = "the cat" (2), r = 4 words: p1 = 1, p2 = (1+1)/(1+1) = 1, orders 3-4 left out
    # BP = exp(1 - 4/2) = e^-1
    assert bleu("the cat", "the cat sat down") == pytest.approx(math.exp(-1))
    assert bleu("dog", "the cat") == 0.0  # no unigram matches


@pytest.mark.parametrize("metric", ["token_f1", "edit_ratio", "fuzzy_match", "bleu", "rouge_1", "rouge_5", "rouge_l"])
def test_every_metric_is_in_the_unit_interval(metric):
    rng = random.Random(metric)
    vocab = ["a", "b", "c", "the", "x"]
    for _ in range(50):
        a = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        b = " ".join(rng.choice(vocab) for _ in range(rng.randint(0, 12)))
        assert 0.0 <= similarity(metric, a, b) <= 1.0
    assert similarity(metric, "same words here ok", "same words here ok") == pytest.approx(1.0)
