"""The bible source: OSIS markup cleaning, and real verses from the installed SWORD modules."""

import pytest

from app.config import FilterConfig
from app.data.prepare import filter_pairs
from app.data.sources import Pair, bible_verses, clean_osis
from app.errors import UserError

SWORD = "/usr/share/sword"
WEB, RV = "engWEB2015eb", "spaRV1909eb"


# --- clean_osis on hand-written markup -------------------------------------------------------------


def test_footnote_dropped_with_content_without_gluing_words():
    raw = (
        'God<note placement="foot"><reference type="annotateRef">1:1 </reference>x</note>'
        '<w lemma="strong:H1254">created</w>'
    )
    assert clean_osis(raw) == "God created"


def test_multiline_footnote_dropped():
    raw = 'Christ,<note placement="foot">Messiah (Hebrew)\nand Christ (Greek)</note><w>the</w> son'
    assert clean_osis(raw) == "Christ, the son"


def test_footnote_before_punctuation_leaves_no_space():
    assert clean_osis("<w>earth</w><note>a note</note>.") == "earth."


def test_word_tags_removed_without_spaces_before_punctuation():
    raw = '<w lemma="strong:H0430">In</w> <w>the</w> <w>beginning</w>, <w>God</w> <w>spoke</w>.'
    assert clean_osis(raw) == "In the beginning, God spoke."


def test_inline_tags_do_not_split_words():
    assert clean_osis('<w>Solomon</w><transChange type="added">’s</transChange> song') == "Solomon’s song"
    assert clean_osis('said, <q marker="“">Follow me</q>') == "said, Follow me"


def test_poetry_lines_separate_words():
    raw = (
        '<l level="1" sID="a"/><w>Yahweh</w> is my shepherd;<l eID="a"/>'
        '<l level="2" sID="b"/>I shall lack nothing.<l eID="b"/>'
    )
    assert clean_osis(raw) == "Yahweh is my shepherd; I shall lack nothing."
    assert clean_osis("<l>first</l><l>second</l>") == "first second"
    assert clean_osis("<lg><l>one</l></lg><lg><l>two</l></lg>") == "one two"


def test_noncanonical_title_dropped_canonical_title_kept():
    assert clean_osis('<title type="x-gen">Creation</title><w>In</w> the beginning') == "In the beginning"
    assert clean_osis("<title>Heading</title>Text") == "Text"
    raw = '<title canonical="true" type="psalm">A Psalm by David.</title><w>Yahweh</w> is'
    assert clean_osis(raw) == "A Psalm by David. Yahweh is"
    raw = '<title type="psalm" canonical="true">For the choir.</title>Sing'
    assert clean_osis(raw) == "For the choir. Sing"


def test_speaker_dropped():
    assert clean_osis('<speaker who="Beloved">Beloved</speaker>Let him kiss me') == "Let him kiss me"


def test_html_entities_unescaped():
    assert clean_osis("Tom &amp; Jerry &quot;say&quot; 1 &lt; 2 &#8212; done") == 'Tom & Jerry "say" 1 < 2 — done'


def test_pilcrow_dropped():
    assert clean_osis("¶In the beginning") == "In the beginning"
    assert clean_osis("end.¶Next") == "end. Next"
    assert "¶" not in clean_osis("a ¶ b ¶")


def test_whitespace_collapsed_and_stripped():
    assert clean_osis("  a\n\tb   c  ") == "a b c"
    assert clean_osis('<div type="x-milestone" sID="pv1"/>  ') == ""


# --- real verses -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def web():
    return bible_verses(SWORD, WEB, refs=["Gen.1.1", "Matt.1.1", "Ps.23.1", "Rev.22.21"])


@pytest.fixture(scope="module")
def rv():
    return bible_verses(SWORD, RV, refs=["Gen.1.1", "Rev.22.21"])


def test_web_genesis_1_1(web):
    assert web["Gen.1.1"] == "In the beginning, God created the heavens and the earth."


def test_rv1909_genesis_1_1(rv):
    assert rv["Gen.1.1"] == "EN el principio crió Dios los cielos y la tierra."


def test_web_matthew_1_1_has_no_footnote(web):
    verse = web["Matt.1.1"]
    assert "Messiah" not in verse and "Anointed" not in verse
    assert "Jesus Christ, the son of David" in verse
    assert verse == "The book of the genealogy of Jesus Christ, the son of David, the son of Abraham."


def test_web_psalm_keeps_canonical_title(web):
    assert web["Ps.23.1"] == "A Psalm by David. Yahweh is my shepherd; I shall lack nothing."


def test_only_requested_refs_are_read(web):
    assert list(web) == ["Gen.1.1", "Matt.1.1", "Ps.23.1", "Rev.22.21"]


def test_web_revelation_glossary_dropped_by_max_chars(web, rv):
    assert len(web["Rev.22.21"]) > 10000  # the WEB module appends its glossary to the last verse
    assert web["Rev.22.21"].startswith("The grace of the Lord Jesus Christ be with all the saints. Amen.")
    pairs = [Pair(ref, rv[ref], web[ref]) for ref in ("Gen.1.1", "Rev.22.21")]
    kept, dropped = filter_pairs(pairs, FilterConfig(), dedup=True)
    assert [p.id for p in kept] == ["Gen.1.1"]
    assert dropped == {"max_chars": 1}


def test_unknown_module_is_user_error():
    with pytest.raises(UserError, match="nosuchmodule"):
        bible_verses(SWORD, "nosuchmodule", refs=["Gen.1.1"])


def test_missing_sword_folder_is_user_error(tmp_path):
    with pytest.raises(UserError, match="sword-text"):
        bible_verses(str(tmp_path), WEB, refs=["Gen.1.1"])
