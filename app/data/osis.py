"""OSIS verse markup as SWORD Bible modules store it: reading a module's verses (with pysword) and turning
their markup into clean text, optionally with, for each character, the inline elements it came from (what
``app.data.strongs`` reads Strong's numbers from).
"""

from __future__ import annotations

import functools
import html
import os
import re
from collections.abc import Iterable
from typing import Optional

from tqdm import tqdm

from app.run.errors import UserError

# Part of the prepared bible corpora's cache key (app/data/prepare.py): bump it when a change to the
# rules below changes the text of some verse, so that corpora prepared with the old rules are made again.
CLEAN_VERSION = 2  # 2: words around <transChange> no longer glued

# Footnotes and editorial labels are not translation: drop them with their content.
_DROPPED_ELEMENTS = re.compile(r"<(note|speaker)\b[^>]*>.*?</\1>", re.DOTALL)
_NONCANONICAL_TITLE = re.compile(r'<title\b(?![^>]*canonical="true")[^>]*>.*?</title>', re.DOTALL)
# Block elements separate words (poetry lines, paragraphs, list items): replace them by a space.
_BLOCK_TAG = re.compile(r"</?(div|l|lg|lb|p|title|item|list|chapter|milestone|verse)\b[^>]*>")
# Everything else (<w>, <q>, <transChange>, ...) wraps words in place: remove it without a space...
_ANY_TAG = re.compile(r"<[^>]+>")
_TAG_NAME = re.compile(r"<(/?)\s*([^\s/>]*)")
# ...except that a <transChange> (words the translator added) starts and ends words of its own: RV1909
# writes '<w>los animales</w><transChange type="added">silvestres</transChange><w>según</w>'. Only an
# added Spanish enclitic pronoun continues the word before it ('<w>sáca</w><transChange>lo</transChange>').
_OWN_WORDS = "transChange"
_ENCLITIC = re.compile(r"(?:lo|la|los|las|le|les|me|te|se|nos|os)</transChange>")
_CLOSING_PUNCT = frozenset(",.;:!?)]»”’")  # glued to the word before them


def clean_osis(raw: str) -> str:
    """OSIS verse markup -> plain text, without gluing or splitting words."""
    return clean_osis_context(raw)[0]


def clean_osis_context(raw: str) -> tuple[str, list[tuple[str, ...]]]:
    """``clean_osis``'s text and, for each of its characters, the start tags of the inline elements
    it came from (outermost first, e.g. ``('<q ...>', '<w lemma="strong:G2424">')``; ``()`` for none):
    what lets a word of the clean text be traced back to the <w> element that tagged it."""
    markup = _DROPPED_ELEMENTS.sub(" ", raw)
    markup = _NONCANONICAL_TITLE.sub(" ", markup)
    markup = _BLOCK_TAG.sub(" ", markup)
    # Text nodes between the remaining tags, each with the elements open around it. Unescaping node by
    # node is the same as unescaping the whole text: in XML an entity never spans a tag.
    chars: list[str] = []
    context: list[tuple[str, ...]] = []
    names: list[str] = []  # the open inline elements: their names and start tags
    start_tags: list[str] = []
    start = 0
    last = ""  # the last character of the text so far
    word_edge = False  # a tag since that character ends a word there if letters meet
    for tag in [*_ANY_TAG.finditer(markup), None]:
        node = html.unescape(markup[start : tag.start() if tag else len(markup)]).replace("¶", " ")
        if node:
            if word_edge and last.isalnum() and node[0].isalnum():
                chars.append(" ")
                context.append(())
            chars.append(node)
            context.extend([tuple(start_tags)] * len(node))
            last, word_edge = node[-1], False
        if tag is None:
            break
        start = tag.end()
        named = _TAG_NAME.match(tag.group())
        assert named is not None  # every tag begins with "<"
        closing, name = named.groups()
        if closing and name in names:  # closes the innermost open element of that name
            k = len(names) - 1 - names[::-1].index(name)
            del names[k:], start_tags[k:]
        elif not closing and not tag.group().endswith("/>"):
            names.append(name)
            start_tags.append(tag.group())
        if name == _OWN_WORDS and not tag.group().endswith("/>"):
            word_edge = bool(closing) or not _ENCLITIC.match(markup, tag.end())
    # Whitespace collapsed to single spaces, none before closing punctuation.
    text = "".join(chars)
    out: list[str] = []
    out_context: list[tuple[str, ...]] = []
    for word in re.finditer(r"\S+", text):
        if out and word.group()[0] not in _CLOSING_PUNCT:
            out.append(" ")
            out_context.append(())
        out.append(word.group())
        out_context.extend(context[word.start() : word.end()])
    return "".join(out), out_context


def _open_bible(sword_path: str, module: str):
    from pysword.modules import SwordModules  # deferred: only the bible source needs pysword

    if not os.path.isdir(os.path.join(sword_path, "mods.d")):
        raise UserError(
            f"data.sword_path={sword_path!r} holds no SWORD modules; "
            "install the Debian packages sword-text-sparv and sword-text-web (make setup does)"
        )
    modules = SwordModules(sword_path)
    found = modules.parse_modules()
    if module not in found:
        raise UserError(f"SWORD module {module!r} not found in {sword_path}; found {sorted(found)}")
    bible = modules.get_bible_from_module(module)
    # pysword decompresses a verse's whole block (a chapter or a book) again for each verse it reads: 3 ms a
    # verse, 70 s for a Bible on a 2-core CPU. Verses are read in order, so the last block is nearly always the
    # next verse's too. A module stored uncompressed has no blocks.
    if hasattr(bible, "_decompressed_text"):
        bible._decompressed_text = functools.lru_cache(maxsize=2)(bible._decompressed_text)
    return bible


def verse_refs(sword_path: str, module: str) -> list[str]:
    """The OSIS references of every verse of a module's versification, in its order."""
    return [
        f"{book.osis_name}.{chapter}.{verse}"
        for books in _open_bible(sword_path, module).get_structure().get_books().values()
        for book in books
        for chapter in range(1, book.num_chapters + 1)
        for verse in range(1, book.chapter_lengths[chapter - 1] + 1)
    ]


def shared_verses(sword_path: str, src_module: str, tgt_module: str, refs: Optional[Iterable[str]] = None):
    """(source verses, target verses) of the references both modules' versifications have (of ``refs``, or of
    every verse of the source): versifications differ (the WEB has the deuterocanon and 3John.1.15, the
    RV1909 neither; a New Testament lacks Genesis), and asking a module for a verse it lacks is an error."""
    src = raw_verses(sword_path, src_module, refs)
    held = set(verse_refs(sword_path, tgt_module))
    tgt = raw_verses(sword_path, tgt_module, [ref for ref in src if ref in held])
    return {ref: verse for ref, verse in src.items() if ref in tgt}, tgt


def raw_verses(sword_path: str, module: str, refs: Optional[Iterable[str]] = None) -> dict[str, str]:
    """OSIS markup of verses keyed by OSIS reference ("Gen.1.1"); all verses unless ``refs`` is given."""
    bible = _open_bible(sword_path, module)
    refs = verse_refs(sword_path, module) if refs is None else refs
    verses = {}
    for ref in tqdm(list(refs), desc=f"reading {module}", unit="verse", leave=False, mininterval=2):
        book, chapter, verse = ref.split(".")
        verses[ref] = bible.get(books=[book], chapters=[int(chapter)], verses=[int(verse)], clean=False)
    return verses


def bible_verses(sword_path: str, module: str, refs: Optional[Iterable[str]] = None) -> dict[str, str]:
    """Cleaned verse texts keyed by OSIS reference ("Gen.1.1"); all verses unless ``refs`` is given."""
    return {ref: clean_osis(raw) for ref, raw in raw_verses(sword_path, module, refs).items()}
