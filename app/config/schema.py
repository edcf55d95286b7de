"""The schema behind conf/*.yaml: its defaults are the defaults a user gets.

The yaml presets only hold what they change. Registered in Hydra's ConfigStore, so a misspelled key
or a wrong type fails at start-up naming the key; ``load_config`` turns the composed config into
these dataclasses (``OmegaConf.to_object``), which is what every stage reads.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from app.config.choices import Checked, check_choices, choice
from app.config.commands import (
    AlignConfig,
    AverageConfig,
    BenchConfig,
    CompareConfig,
    DecodeConfig,
    EvalConfig,
    ExportConfig,
    HeadsConfig,
    ScoreConfig,
    ServeConfig,
    TranslateConfig,
    VizConfig,
)
from app.config.corpus_folder import corpus_folder, corpus_name
from app.config.ranges import check_align_layer, check_model_ranges, check_rules, rnn_rules, train_rules
from app.run.errors import UserError

# A setting left unset (None) in the composed configuration and derived from the others in __post_init__: OmegaConf
# sees Optional[str], mypy the str that every built dataclass holds.
if TYPE_CHECKING:
    Derived = str
else:
    Derived = Optional[str]
UNSET: Any = None  # a Derived setting's default


@dataclass
class FilterConfig:
    min_chars: int = 1  # either side shorter than this (after cleaning) is dropped
    max_chars: int = 1000  # either side longer than this is dropped (catches appended glossaries etc.)
    max_ratio: float = 3.0  # char-length ratio longer/shorter above this is dropped (0 = off)
    dedup: bool = True  # drop exact duplicate (src, tgt) pairs

    def __post_init__(self) -> None:
        least, ratio = max(self.min_chars, 1), self.max_ratio
        rules = {  # the first one broken is the error
            f"data.filters.max_chars={self.max_chars} must be >= 1 and >= data.filters.min_chars={self.min_chars}: "
            "every pair would be dropped": self.max_chars < least,
            f"data.filters.max_ratio={ratio} must be 0 (off) or at least 1: the longer side's length over the "
            "shorter's": bool(ratio) and not ratio >= 1,
        }
        check_rules(rules)


@dataclass
class DataConfig(Checked, section="data"):
    source: str = choice("bible", "files", "hf")
    name: Derived = UNSET  # folder under data/; unset: derived from the source (corpus_name)
    dir: Derived = UNSET  # unset: data/<name>
    src_lang: str = "es"
    tgt_lang: str = "en"
    # bible: SWORD modules paired by OSIS verse reference
    sword_path: str = "/usr/share/sword"
    src_module: str = "spaRV1909eb"
    tgt_module: str = "engWEB2015eb"
    # bible: <split>.align, the words of a verse pair with the same Strong's number linked (AER's reference);
    # the KJV's tags are reliable (data=bible_es_kjv), the WEB's noisy
    reference_links: bool = False
    # files / hf: where each split comes from (files: paths; hf: split names). A missing dev/test is
    # carved out of train with the hash split below.
    train: Optional[str] = None
    dev: Optional[str] = None
    test: Optional[str] = None
    # files / hf: reference word links of data.train, one Pharaoh line (i-j sure, i?j possible) per pair:
    # they travel with their pairs through filtering and the dev/test split (<split>.align)
    train_align: Optional[str] = None
    # word links of the train split from a statistical aligner (app/data/aligner.py), its forward and reverse links
    # joined by grow-diag-final-and: train.align for guided alignment on any corpus (eflomal: pip install
    # "nmt-attention[align]"); dev and test keep their reference links. Unset data.dir: data/<name>_<aligner>
    aligner: str = choice("none", "eflomal")
    # the corpus's other direction: each pair's target the source and its links i-j as j-i, in the same splits (a
    # run for align.reverse, back-translation); data.src_lang stays the corpus's. Unset data.dir: data/<name>_reverse
    reverse: bool = False
    # more training pairs, such as back-translations or a teacher's translations: a .tsv/.jsonl file or 'a.es,a.en', in
    # the corpus's direction, added to the train split only; a pair holding a dev or test sentence is dropped
    # (app/data/extra_pairs.py). Unset data.dir: data/<name>_plus_<stem>_<digest>
    extra_train: Optional[str] = None
    # a word put before each extra pair's source, one tokenizer piece (tagged back-translation, Caswell et al. 2019)
    extra_tag: Optional[str] = None
    # hf: dataset name or local path given to datasets.load_dataset, plus field mapping
    hf_path: Optional[str] = None
    hf_config: Optional[str] = None
    src_field: Derived = UNSET  # unset: translation.<src_lang>
    tgt_field: Derived = UNSET  # unset: translation.<tgt_lang>
    id_field: Optional[str] = None
    # deterministic split keyed on the pair id: the same verse always lands in the same split
    dev_fraction: float = 0.032
    test_fraction: float = 0.032
    max_train_pairs: int = 0  # 0 = all; otherwise keep the first N train pairs (quick experiments)
    num_proc: int = 0  # processes that tokenize into the Arrow cache; 0 = one per CPU core for big corpora
    # hf: stream the dataset (no whole download); train pairs pass a shuffle buffer of shuffle_buffer pairs
    streaming: bool = False
    shuffle_buffer: int = 10_000
    filters: FilterConfig = field(default_factory=FilterConfig)

    def __post_init__(self) -> None:
        check_choices(self)
        dev, test, tag = self.dev_fraction, self.test_fraction, self.extra_tag
        rules = {  # the first one broken is the error
            f"data.dev_fraction={dev} must be in [0, 1): the share of the pairs carved out of train for dev "
            "(unless data.dev is given)": not 0 <= dev < 1,
            f"data.test_fraction={test} must be in [0, 1): the share of the pairs carved out of train for test "
            "(unless data.test is given)": not 0 <= test < 1,
            f"data.dev_fraction={dev} and data.test_fraction={test} must add up to less than 1: the rest is the "
            "train split": not dev + test < 1,
            f"data.max_train_pairs={self.max_train_pairs} must be >= 0 (0: all)": self.max_train_pairs < 0,
            f"data.num_proc={self.num_proc} must be >= 0 (0: one per CPU core for big corpora)": self.num_proc < 0,
            f"data.extra_tag={tag!r} tags the pairs of data.extra_train, which is not set": tag is not None
            and not self.extra_train,
            f"data.extra_tag={tag!r} must be one word: no spaces, tabs or line breaks": tag is not None
            and (not tag or tag != "".join(tag.split())),
        }
        check_rules(rules)
        self.src_field = self.src_field or f"translation.{self.src_lang}"
        self.tgt_field = self.tgt_field or f"translation.{self.tgt_lang}"
        self.name = self.name or corpus_name(self)
        self.dir = self.dir or corpus_folder(self)
        if self.aligner != "none" and self.train_align:
            raise UserError(f"data.aligner={self.aligner} writes the train links: not with data.train_align")


def target_language(data: DataConfig) -> str:
    """The language a run translates into: data.tgt_lang, data.src_lang for data.reverse=true."""
    return data.src_lang if data.reverse else data.tgt_lang


@dataclass
class TokenizerConfig(Checked, section="tokenizer"):
    model_type: str = choice("unigram", "bpe")
    vocab_size: int = 8000
    joint: bool = True  # one vocabulary for both languages (needed to tie all embeddings)
    character_coverage: float = 1.0
    byte_fallback: bool = False  # a character the vocabulary lacks as its UTF-8 bytes (256 pieces), not <unk>
    max_sentence_length: int = 8192
    input_sentence_size: int = 1_000_000  # sentences SentencePiece samples to train on (its memory: ~3 GB at 1 M)
    # the folder of an existing SentencePiece model of these settings (another corpus's) that this corpus is
    # tokenized with instead of training its own; train.init_from sets it to the run it starts from
    dir: Optional[str] = None

    def __post_init__(self) -> None:
        super().__post_init__()
        # SentencePiece's own ranges (its trainer refuses others with a RuntimeError naming its C++ check);
        # a vocabulary smaller than the corpus's characters is only known once SentencePiece has read the corpus
        size, coverage, length, sample = (
            self.vocab_size,
            self.character_coverage,
            self.max_sentence_length,
            self.input_sentence_size,
        )
        rules = {  # the first one broken is the error
            f"tokenizer.vocab_size={size} must be at least 6: the 4 special pieces (pad, unk, bos, eos), the word "
            "boundary ▁ and a character": size < 6,
            f"tokenizer.character_coverage={coverage} must be in [0.98, 1] (SentencePiece's range; 1: every "
            "character)": not 0.98 <= coverage <= 1,
            f"tokenizer.max_sentence_length={length} must be in [10, 1073741824]: bytes of the longest sentence "
            "SentencePiece trains on (its range)": not 10 <= length <= 1 << 30,
            f"tokenizer.input_sentence_size={sample} must be 0 (every sentence) or more than 100 (SentencePiece's "
            "range)": sample < 0 or 0 < sample <= 100,
        }
        check_rules(rules)


@dataclass
class TransformerConfig(Checked, section="model"):
    """Transformer base (Vaswani et al. 2017) with the variants of docs/transformer_variants.md."""

    arch: str = "transformer"
    d_model: int = 512
    heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    ff_dim: int = 2048
    dropout: float = 0.3  # as for low-resource pairs (the Bible has ~29 k training verses)
    attention_dropout: float = 0.1  # on the attention weights
    activation_dropout: float = 0.3  # on the feed-forward's hidden activations (model.dropout: on each residual branch)
    activation: str = choice("relu", "gelu")
    norm: str = choice("pre", "post")  # where the norm sits in each residual block
    norm_type: str = choice("layernorm", "rmsnorm")
    pos: str = choice("sinusoidal", "learned", "rope", "alibi")
    kv_heads: int = 0  # key/value heads: 0 = heads (multi-head), a divisor of heads (grouped-query), 1 (multi-query)
    window: int = 0  # encoder self-attention sees only tokens within this distance; 0 = the whole sentence
    max_len: int = 1024
    tie_embeddings: bool = True  # decoder input/output (and encoder input with a joint vocab)
    # the decoder layer whose head 0 train.align_weight guides (Garg et al.: the penultimate; negative: from the last)
    align_layer: int = -2
    copy_attention: bool = False  # the pointer-generator (app/models/copy.py) through align_layer's mean of heads

    def __post_init__(self) -> None:
        super().__post_init__()
        check_model_ranges(self, ("d_model", "heads", "enc_layers", "dec_layers", "ff_dim"))
        check_align_layer(self.align_layer, self.dec_layers)
        if self.max_len < 2:
            raise UserError(f"model.max_len={self.max_len} must be at least 2: a sentence takes max_len - 1 pieces")


@dataclass
class RNNConfig(Checked, section="model"):
    """The settings every RNN preset shares (conf/model/rnn_*.yaml change what differs)."""

    arch: str = "rnn"
    attention: str = choice("bahdanau", "none", "luong")
    score: str = choice("general", "dot", "concat")  # Luong's score
    input_feeding: bool = True  # Luong: feed h̃_{t-1} into the next step
    # Luong's local attention: each target word attends within this many source words of its aligned position
    # (app/models/attention.py); 0: global, every source word
    local_window: int = 0
    # where the window is: local-m (monotonic), the target word's own position; local-p (predictive), a position
    # each target word predicts, Gaussian-weighted (in 12 CPU minutes it did not learn to: docs/attention.md)
    local_alignment: str = choice("monotonic", "predictive")
    cell: str = choice("gru", "lstm")
    emb_dim: int = 512
    hidden: int = 1024  # encoder output size (split over both directions) and decoder state size
    bidirectional: bool = True
    enc_layers: int = 2
    dec_layers: int = 1
    dropout: float = 0.3  # on embeddings, encoder outputs and between stacked RNN layers
    attention_dropout: float = 0.0  # on the attention weights that make the context (as a Transformer's)
    activation_dropout: Optional[float] = None  # on the output layer's tanh activations; unset: model.dropout
    tie_embeddings: bool = True  # decoder input/output (and encoder input with a joint vocab)
    copy_attention: bool = False  # the pointer-generator (app/models/copy.py) through the attention (tokenizer.joint)
    # the coverage mechanism (Tu et al. 2016; See et al. 2017): the attention's scores read how much attention each
    # source piece has had so far (app/models/attention.py); train.coverage_weight adds See's coverage loss
    coverage: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        check_model_ranges(self, ("emb_dim", "hidden", "enc_layers", "dec_layers"))
        check_rules(rnn_rules(self))


MODEL_SCHEMAS = {"transformer": TransformerConfig, "rnn": RNNConfig}
ModelConfig = TransformerConfig | RNNConfig

# train.compile_mode values under which torch.compile replays CUDA graphs (cudagraph trees): one per batch shape
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")


@dataclass
class TrainConfig(Checked, section="train"):
    seed: int = 1234
    max_steps: int = 100_000
    max_minutes: float = 0.0  # wall-clock budget for the training loop; 0 = none
    max_epochs: int = 0  # passes over the training data; 0 = no limit (the first limit reached stops the run)
    batch_tokens: int = 32_000  # source+target tokens per batch (per rank and micro-batch), padding included
    accum_steps: int = 1  # micro-batches accumulated per update on each rank
    tokens_per_update: int = 0  # if set: accum_steps = this / (batch_tokens × ranks), constant across NPROC
    lr: float = 1e-3
    warmup_steps: int = 1000
    # after the warm-up: ∝ 1/√step (Vaswani et al.), cosine or linear decay over train.max_steps to lr × lr_floor,
    # constant, or plateau: constant, × lr_decay after more than lr_patience validations without a gain (torch's
    # ReduceLROnPlateau patience; not below lr × lr_floor)
    lr_schedule: str = choice("inverse_sqrt", "cosine", "linear", "constant", "plateau")
    lr_floor: float = 0.0
    lr_patience: int = 4
    lr_decay: float = 0.5
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    eval_every: int = 500
    save_every: int = 500
    log_every: int = 100
    patience: int = 10  # validations without a better dev score (train.best_metric) before stopping; 0 = never
    # the dev score best.pt, early stopping, train.keep_best and average_from=best follow (loss: lower is better)
    best_metric: str = choice("bleu", "chrf", "loss")
    resume: bool = False
    # fine-tune from another run's weights and tokenizer (a run name, a run folder, a .pt file), afresh otherwise
    init_from: Optional[str] = None
    # resume where last.pt exists, else start; a finished run (train_summary.json newer than last.pt) is kept
    auto_resume: bool = False
    amp: str = choice("auto", "bf16", "fp32")  # auto: bf16 on CUDA, fp32 on a CPU
    max_dev_sentences: int = 0  # validate on the first N dev pairs only; 0 = all
    evaluate: bool = False  # after training, evaluate best.pt on eval.split (what make compare uses)
    keep_last: int = 5  # model snapshots step_NNNNNNN.pt kept (newest); make average reads them; 0 = none
    keep_best: int = 0  # also keep the snapshots of the N best validations (best.pt is always written)
    max_bad_steps: int = 20  # abort after this many updates in a row with a non-finite loss (each is skipped)
    oom_retry: bool = False  # out of memory on a batch: halve train.batch_tokens and go on instead of stopping
    compile: bool = False  # torch.compile the Transformer's training step, or an RNN decoder's loop step
    compile_mode: str = choice("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
    align_weight: float = 0.0  # guided alignment (app/train/guided_alignment.py): weight of the loss on reference links
    # See et al.'s coverage loss (app/models/coverage.py): weight of Σ_j min(α_tj, c_tj) per target piece; needs
    # model.coverage=true, the mechanism that lets the model lower it
    coverage_weight: float = 0.0
    fused_optimizer: bool = True  # AdamW in one kernel that skips non-finite updates on the device
    master_weights: bool = True  # bf16: steps on bf16 weights kept from fp32 masters (false: autocast casts each use)
    # on CUDA, the Transformer's whole update recorded as a CUDA graph per batch shape and replayed (app/train/
    # capture.py): one launch instead of a thousand; ignored on a CPU, under torchrun, with compile_mode of CUDA graphs
    capture: bool = True
    # pad every batch to one of N (sentences, source, target) shapes chosen from the training lengths (app/data/
    # shapes.py), so CUDA graphs replay N graphs; 0 = each batch padded to its longest pair (a new shape per batch)
    # on CUDA without train.capture=false: the fewest of at most 32 shapes whose pairs pad at most 8 % of their tokens
    batch_shapes: int = 0
    # with batch_shapes=K: the fewest shapes (K at most) whose pairs pad at most this share of their tokens; 0 = K
    shape_padding: float = 0.0
    # a moving average of the weights (app/train/ema.py), validated, kept and translated with in place of the trained
    # weights; 0 = off. Until step 9 / (1 - decay) it spans the last ninth of the run whatever the decay
    ema_decay: float = 0.999
    # at the end, average this many snapshots (app/train/closing_average.py), the newest (last) or those of the best
    # validations (best): best.pt is whichever of the average and the best single weights scores higher on dev
    average_snapshots: int = 5  # 0 = off
    average_from: str = choice("last", "best")
    # parts of the model not trained (app/train/freeze.py): embeddings, encoder, decoder (fine-tuning on little data)
    freeze: list[str] = field(default_factory=list)
    # subword regularization (app/data/subword_sampling.py): train on segmentations SentencePiece samples with this
    # α (unigram: ∝ P(x)^α over the subword_nbest best, -1 all; bpe: each merge dropped with probability α); 0 = off
    subword_alpha: float = 0.0
    subword_nbest: int = -1
    subword_variants: int = 8  # segmentations sampled per pair once (cached); each epoch draws one per pair

    def __post_init__(self) -> None:
        check_choices(self)
        self.check_subword_sampling()
        if self.batch_shapes < 0:
            raise UserError(f"train.batch_shapes={self.batch_shapes} must be 0 (off) or a number of shapes")
        if not 0.0 <= self.shape_padding < 1.0:
            raise UserError(f"train.shape_padding={self.shape_padding} must be in [0, 1): 0.1 is a tenth of the tokens")
        if self.shape_padding and not self.batch_shapes:
            raise UserError(
                f"train.shape_padding={self.shape_padding} chooses among fixed batch shapes: give train.batch_shapes=K,"
                " the most it may choose (16 or 32)"
            )
        if not 0.0 <= self.ema_decay < 1.0:
            raise UserError(f"train.ema_decay={self.ema_decay} must be in [0, 1): 0 is off, 0.999 a typical decay")
        if self.average_snapshots < 0:
            raise UserError(f"train.average_snapshots={self.average_snapshots}: a number of snapshots, 0 for none")
        if len(self.adam_betas) != 2:
            raise UserError(f"train.adam_betas={list(self.adam_betas)}: give two values, [beta1, beta2]")
        check_rules(train_rules(self))

    def check_subword_sampling(self) -> None:
        if not 0.0 <= self.subword_alpha <= 1.0:
            raise UserError(f"train.subword_alpha={self.subword_alpha} must be in [0, 1]: 0 is off, 0.1-0.5 typical")
        if self.subword_alpha == 0:
            return
        if self.subword_nbest in (0, 1) or self.subword_nbest < -1:
            raise UserError(f"train.subword_nbest={self.subword_nbest}: -1 (every segmentation) or at least 2")
        if self.subword_variants < 1:
            raise UserError(f"train.subword_variants={self.subword_variants} must be at least 1")
        for name, value in (("batch_shapes", self.batch_shapes), ("align_weight", self.align_weight)):
            if value:  # fixed shapes are chosen from one segmentation's lengths; reference links index its pieces
                raise UserError(f"train.subword_alpha={self.subword_alpha} does not go with train.{name}={value}")


@dataclass
class Config:
    command: Optional[str] = None  # what python -m app does: prepare | train | eval | ... (app/cli.py)
    name: str = "default"
    run_dir: Derived = UNSET  # unset: checkpoints/<name>; the CLI sets Hydra's output folder
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # checkpoints decoding with eval's, translate's, score's, serve's as one model (app/decode/ensemble.py): this run's
    # (step_0000400, last...), another run's best.pt (its name or folder), a .pt file
    ensemble: list[str] = field(default_factory=list)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: Any = field(default_factory=TransformerConfig)  # TransformerConfig | RNNConfig: model= picks it
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    translate: TranslateConfig = field(default_factory=TranslateConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    align: AlignConfig = field(default_factory=AlignConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    heads: HeadsConfig = field(default_factory=HeadsConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    viz: VizConfig = field(default_factory=VizConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)

    def __post_init__(self) -> None:
        self.run_dir = self.run_dir or os.path.join("checkpoints", self.name)
        if self.train.coverage_weight and not getattr(self.model, "coverage", False):
            raise UserError(
                f"train.coverage_weight={self.train.coverage_weight} trains the coverage mechanism: set "
                "model.coverage=true (an RNN with additive attention: model=rnn_bahdanau, or rnn_luong with "
                "model.score=concat)"
            )
        if getattr(self.model, "copy_attention", False) and not self.tokenizer.joint:
            raise UserError(
                "model.copy_attention=true copies source pieces as target pieces: it needs tokenizer.joint=true"
            )
