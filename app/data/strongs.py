"""Reference word alignments from Strong's numbers.

Bible modules such as spaRV1909eb and engKJV2006eb tag words with the Strong's number of the Hebrew or
Greek word they translate: ``<w lemma="strong:H7225">EN el principio</w>``. Two words of a verse pair
that carry the same number translate the same original word, so they are linked: a *sure* link when
each side has exactly one word with that number, a *possible* one otherwise. The links are written in
the Pharaoh format that ``app.data.links.read_pharaoh`` reads, over the words of the cleaned verse texts
(``app.data.osis.clean_osis``).
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from functools import cache
from typing import Optional

from app.data.osis import clean_osis_context, shared_verses

Links = set[tuple[int, int]]

_W_START_TAG = re.compile(r"<w[\s/>]")
_LEMMA = re.compile(r"""\slemma\s*=\s*(["'])(.*?)\1""")
_STRONG = re.compile(r"([HG])0*(\d+)")


@cache  # a module has some tens of thousands of distinct <w> start tags
def _numbers(start_tag: str) -> frozenset[str]:
    """The Strong's numbers of a <w> start tag, as "H430" / "G2424" (none for other tags).

    The lemma attribute is a list of prefixed values: KJV writes ``strong:H0430 strong:H1254``,
    RV1909 ``strong:G2424 G5547`` (a value without a prefix takes the one before it). Zero padding is
    dropped so that H0430 and H430 match.
    """
    if not _W_START_TAG.match(start_tag):
        return frozenset()
    numbers = set()
    for _, value in _LEMMA.findall(start_tag):
        prefix = ""
        for token in value.split():
            if ":" in token:
                prefix, token = token.split(":", 1)
            match = _STRONG.fullmatch(token)
            if prefix.lower() == "strong" and match:
                numbers.add(match.group(1) + match.group(2))
    return frozenset(numbers)


def tagged_words(raw_osis: str) -> tuple[str, list[frozenset[str]]]:
    """The clean text of a verse (exactly ``clean_osis(raw_osis)``) and, for each of its space-separated
    words, the Strong's numbers of the <w> elements any of its characters came from (empty if none)."""
    text, context = clean_osis_context(raw_osis)
    tags: list[frozenset[str]] = []
    start = 0
    for word in text.split(" ") if text else []:
        start_tags = {tag for tags_of_char in set(context[start : start + len(word)]) for tag in tags_of_char}
        tags.append(frozenset().union(*map(_numbers, start_tags)))
        start += len(word) + 1
    return text, tags


def strong_links(src_tags: list[frozenset[str]], tgt_tags: list[frozenset[str]]) -> tuple[Links, Links]:
    """(sure, possible) links (source word, target word) between words that share a Strong's number;
    sure where the number is on exactly one word of each side. possible includes sure."""
    src_words, tgt_words = defaultdict(list), defaultdict(list)
    for i, numbers in enumerate(src_tags):
        for number in numbers:
            src_words[number].append(i)
    for j, numbers in enumerate(tgt_tags):
        for number in numbers:
            tgt_words[number].append(j)
    sure: set[tuple[int, int]] = set()
    possible: set[tuple[int, int]] = set()
    for number in src_words.keys() & tgt_words.keys():
        src, tgt = src_words[number], tgt_words[number]
        possible.update((i, j) for i in src for j in tgt)
        if len(src) == 1 and len(tgt) == 1:
            sure.add((src[0], tgt[0]))
    return sure, possible


def pharaoh_line(sure: Links, possible: Links) -> str:
    """``i-j`` for sure links and ``i?j`` for possible-only ones, sorted, space-separated."""
    return " ".join(f"{i}-{j}" if (i, j) in sure else f"{i}?{j}" for i, j in sorted(sure | possible))


def bible_links(
    sword_path: str, src_module: str, tgt_module: str, refs: Optional[Iterable[str]] = None
) -> dict[str, tuple[Links, Links]]:
    """(sure, possible) links of each verse pair of two SWORD modules, keyed by OSIS reference, over
    ``refs`` or every verse of the source module. Word indices count the words of ``clean_osis``'s
    texts, which are those of ``read_bible``'s pairs."""
    src_raw, tgt_raw = shared_verses(sword_path, src_module, tgt_module, refs)
    return {ref: strong_links(tagged_words(src_raw[ref])[1], tagged_words(tgt_raw[ref])[1]) for ref in src_raw}
