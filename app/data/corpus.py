"""A prepared split, tokenized: what training, evaluation and plots read."""
from __future__ import annotations

import os
from dataclasses import dataclass

from app.config import Config, TokenizerConfig
from app.data.prepare import prepare, read_tsv
from app.data.tokenizer import Tokenizer, build_tokenizer, model_paths


@dataclass
class ParallelData:
    ids: list[str]
    src_texts: list[str]
    tgt_texts: list[str]
    src: list[list[int]]  # subword ids, without BOS/EOS
    tgt: list[list[int]]

    def __len__(self) -> int:
        return len(self.ids)

    def head(self, n: int) -> "ParallelData":
        if not n or n >= len(self):
            return self
        return ParallelData(self.ids[:n], self.src_texts[:n], self.tgt_texts[:n], self.src[:n], self.tgt[:n])


def prepare_data(cfg: Config) -> Tokenizer:
    """Corpus preparation and tokenizer training, each skipped when its inputs did not change."""
    prepare(cfg.data)
    return build_tokenizer(cfg.data.dir, cfg.tokenizer)


def load_tokenizer(data_dir: str, cfg: TokenizerConfig) -> Tokenizer:
    return Tokenizer(*model_paths(data_dir, cfg))


def load_split(data_dir: str, split: str, tokenizer: Tokenizer) -> ParallelData:
    pairs = read_tsv(os.path.join(data_dir, f"{split}.tsv"))
    src_texts, tgt_texts = [p.src for p in pairs], [p.tgt for p in pairs]
    return ParallelData([p.id for p in pairs], src_texts, tgt_texts, tokenizer.encode_src(src_texts), tokenizer.encode_tgt(tgt_texts))
