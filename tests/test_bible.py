"""The bible source: OSIS markup cleaning, and real verses from the installed SWORD modules."""

import pytest

from app.config.schema import DataConfig, FilterConfig
from app.data import osis
from app.data.osis import bible_verses, clean_osis
from app.data.prepare import cache_key, filter_pairs
from app.data.sources import Pair
from app.run.errors import UserError

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


def test_added_words_are_words_of_their_own():
    # RV1909 writes the translator's additions without a space on either side (Gen 7:14)
    raw = '<w>los animales</w><transChange type="added">silvestres</transChange><w>según sus especies</w>,'
    assert clean_osis(raw) == "los animales silvestres según sus especies,"
    raw = '<w>Estas</w><transChange type="added"><w>son las medidas</w></transChange><w>Salomón</w>'
    assert clean_osis(raw) == "Estas son las medidas Salomón"
    assert clean_osis("hay<transChange>también</transChange>bdelio") == "hay también bdelio"
    # an addition that only begins like a pronoun is words of its own too
    assert clean_osis("<w>de</w><transChange>la casa de</transChange><w>Narciso</w>") == "de la casa de Narciso"


def test_added_enclitic_pronoun_stays_on_its_verb():
    assert clean_osis("<w>sáca</w><transChange>lo</transChange> <w>de</w>") == "sácalo de"
    assert clean_osis("<w>y díjo</w><transChange>le</transChange><w>Dios</w>:") == "y díjole Dios:"
    assert clean_osis("preguntándo<transChange>les</transChange>, <w>dijo</w>") == "preguntándoles, dijo"


def test_other_tags_inside_a_word_do_not_split_it():
    assert clean_osis("<w>Solo</w><w>mon</w> <w>give</w>n <w>tear</w>s") == "Solomon given tears"
    assert clean_osis('<w>Solomon</w><transChange type="added">’s</transChange>') == "Solomon’s"


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


@pytest.mark.parametrize("module", [WEB, RV])
def test_a_compressed_block_is_decompressed_once_for_all_its_verses(module, monkeypatch):
    """A SWORD module stores its verses in compressed blocks of a chapter or a book: reading Genesis 1 and
    across the testaments (Malachi 4 to Matthew 1) decompresses each block once, and each verse is what
    pysword reads for it alone."""
    import zlib

    from pysword.modules import SwordModules

    refs = [f"Gen.1.{v}" for v in range(1, 32)] + [f"Mal.4.{v}" for v in range(1, 7)] + ["Matt.1.1", "Matt.1.2"]
    one_by_one = SwordModules(SWORD)
    one_by_one.parse_modules()
    bible = one_by_one.get_bible_from_module(module)
    expected = {}
    for ref in refs:
        book, chapter, verse = ref.split(".")
        expected[ref] = bible.get(books=[book], chapters=[int(chapter)], verses=[int(verse)], clean=False)
    blocks = []
    decompress = zlib.decompress
    monkeypatch.setattr(zlib, "decompress", lambda data, *a: blocks.append(len(data)) or decompress(data, *a))
    assert osis.raw_verses(SWORD, module, refs) == expected
    assert 3 <= len(blocks) <= 6, blocks  # Genesis, Malachi, Matthew: a block each, or one per chapter


def test_web_revelation_glossary_dropped_by_max_chars(web, rv):
    assert len(web["Rev.22.21"]) > 10000  # the WEB module appends its glossary to the last verse
    assert web["Rev.22.21"].startswith("The grace of the Lord Jesus Christ be with all the saints. Amen.")
    pairs = [Pair(ref, rv[ref], web[ref]) for ref in ("Gen.1.1", "Rev.22.21")]
    kept, dropped = filter_pairs(pairs, FilterConfig(), dedup=True)
    assert [p.id for p in kept] == ["Gen.1.1"]
    assert dropped == {"max_chars": 1}


# RV1909 verses whose words the module glues to a <transChange> (no space in the markup), and how they read
GLUED = {
    "Gen.7.14": "Ellos, y todos los animales silvestres según sus especies, y todos los animales mansos",
    "Num.16.1": "de los hijos de Rubén, tomaron gente,",
    "Josh.9.1": "Y ACONTECIÓ que como oyeron estas cosas todos los reyes",
    "Gen.2.12": "hay allí también bdelio",
    "Gen.5.3": "y engendró un hijo á su semejanza",
    "Ps.136.1": "porque para siempre es su misericordia",
    "2Chr.3.3": "Estas son las medidas de que Salomón fundó",
    # added enclitic pronouns: one word with the verb before them
    "Gen.19.12": "sácalo de este lugar",
    "1Kgs.3.5": "y díjole Dios: Pide lo que quisieres que yo te dé.",
    "Matt.14.13": "Y oyéndolo Jesús,",
}


def test_rv1909_words_around_added_words_are_apart():
    verses = bible_verses(SWORD, RV, refs=list(GLUED))
    for ref, words in GLUED.items():
        assert words in verses[ref], ref
    glued = ["animalessilvestres", "tomarongente", "oyeronestas", "allítambién", "engendróun", "siempreessu", "queyo"]
    assert not [word for verse in verses.values() for word in glued if word in verse]


def test_cleaning_rules_version_is_in_the_bible_cache_key(monkeypatch):
    bible, files = DataConfig(source="bible", name="b", dir="x"), DataConfig(source="files", name="f", dir="x")
    before = cache_key(bible), cache_key(files)
    monkeypatch.setattr("app.data.prepare.OSIS_CLEAN_VERSION", osis.CLEAN_VERSION + 1)
    assert cache_key(bible) != before[0]  # a corpus prepared with other cleaning rules is made again
    assert cache_key(files) == before[1]


def test_unknown_module_is_user_error():
    with pytest.raises(UserError, match="nosuchmodule"):
        bible_verses(SWORD, "nosuchmodule", refs=["Gen.1.1"])


def test_missing_sword_folder_is_user_error(tmp_path):
    with pytest.raises(UserError, match="sword-text"):
        bible_verses(str(tmp_path), WEB, refs=["Gen.1.1"])
