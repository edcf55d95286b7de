import os
import sys

# test helpers (toy_tasks.py) import as top-level modules
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# The data tests read local files and local dataset folders only: never reach the Hugging Face hub.
# Set before anything imports `datasets`, which reads these once at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402

SWORD = "/usr/share/sword"
# Genesis 1-3: a few minutes of real parallel text (80 verses), read in well under a second.
GENESIS_VERSES = {1: 31, 2: 25, 3: 24}


@pytest.fixture(scope="session")
def genesis_pairs():
    """[(ref, spanish, english)] for Genesis 1-3 from the installed SWORD modules."""
    from app.data.sources import bible_verses

    refs = [f"Gen.{c}.{v}" for c, n in GENESIS_VERSES.items() for v in range(1, n + 1)]
    es = bible_verses(SWORD, "spaRV1909eb", refs)
    en = bible_verses(SWORD, "engWEB2015eb", refs)
    return [(ref, es[ref], en[ref]) for ref in refs]


@pytest.fixture
def write_tsv(tmp_path):
    """write_tsv(name, rows) -> path of a TSV file in tmp_path with one tab-joined row per line."""

    def write(name, rows):
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join("\t".join(row) + "\n" for row in rows), encoding="utf-8")
        return str(path)

    return write
