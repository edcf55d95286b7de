"""Structured configs: the schema behind conf/*.yaml.

Registered in Hydra's ConfigStore so a misspelled key or a wrong type fails at start-up with a message
naming the key, instead of deep inside training.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


@dataclass
class FilterConfig:
    min_chars: int = 1  # either side shorter than this (after cleaning) is dropped
    max_chars: int = 1000  # either side longer than this is dropped (catches appended glossaries etc.)
    max_ratio: float = 3.0  # char-length ratio longer/shorter above this is dropped (0 = off)
    dedup: bool = True  # drop exact duplicate (src, tgt) pairs


@dataclass
class DataConfig:
    source: str = MISSING  # bible | files | hf
    name: str = MISSING  # folder under data/
    src_lang: str = "es"
    tgt_lang: str = "en"
    dir: str = "data/${data.name}"
    # bible: SWORD modules paired by OSIS verse reference
    sword_path: str = "/usr/share/sword"
    src_module: str = "spaRV1909eb"
    tgt_module: str = "engWEB2015eb"
    # files / hf: where each split comes from (files: paths; hf: split names). A missing dev/test is
    # carved out of train with the hash split below.
    train: Optional[str] = None
    dev: Optional[str] = None
    test: Optional[str] = None
    # hf: dataset name or local path given to datasets.load_dataset, plus field mapping
    hf_path: Optional[str] = None
    hf_config: Optional[str] = None
    src_field: str = "translation.${data.src_lang}"
    tgt_field: str = "translation.${data.tgt_lang}"
    id_field: Optional[str] = None
    # deterministic split keyed on the pair id: the same verse always lands in the same split
    dev_fraction: float = 0.032
    test_fraction: float = 0.032
    max_train_pairs: int = 0  # 0 = all; otherwise keep the first N train pairs (quick experiments)
    num_proc: int = 0  # processes that tokenize into the Arrow cache; 0 = one per CPU core for big corpora
    # hf: read the dataset as a stream (no download of the whole dataset); train pairs pass through a
    # shuffle buffer of this many pairs, so data.max_train_pairs takes a shuffled sample of the stream
    streaming: bool = False
    shuffle_buffer: int = 10_000
    filters: FilterConfig = field(default_factory=FilterConfig)


@dataclass
class TokenizerConfig:
    model_type: str = "unigram"  # unigram | bpe
    vocab_size: int = 8000
    joint: bool = True  # one vocabulary for both languages (needed to tie all embeddings)
    character_coverage: float = 1.0
    max_sentence_length: int = 8192
    input_sentence_size: int = 1_000_000  # sentences SentencePiece samples to train on (its memory: ~3 GB at 1 M)


@dataclass
class ModelConfig:
    arch: str = "transformer"
    d_model: int = 512
    heads: int = 8
    enc_layers: int = 6
    dec_layers: int = 6
    ff_dim: int = 2048
    dropout: float = 0.1
    attention_dropout: float = 0.1
    activation: str = "relu"  # relu | gelu
    norm: str = "pre"  # pre | post: where the norm sits in each residual block
    norm_type: str = "layernorm"  # layernorm | rmsnorm
    pos: str = "sinusoidal"  # sinusoidal | learned | rope | alibi
    kv_heads: int = 0  # key/value heads: 0 = heads (multi-head), a divisor of heads (grouped-query), 1 (multi-query)
    window: int = 0  # encoder self-attention sees only tokens within this distance; 0 = the whole sentence
    max_len: int = 1024
    tie_embeddings: bool = True  # decoder input/output (and encoder input with a joint vocab)
    # RNN encoder-decoders (arch=rnn); enc_layers, dec_layers, dropout are shared with the Transformer
    cell: str = "gru"  # gru | lstm
    emb_dim: int = 512
    hidden: int = 1024  # encoder output size (split over both directions) and decoder state size
    bidirectional: bool = True
    attention: str = "bahdanau"  # none | bahdanau | luong
    score: str = "general"  # Luong score: dot | general | concat
    input_feeding: bool = True  # Luong: feed h̃_{t-1} into the next step


@dataclass
class TrainConfig:
    seed: int = 1234
    max_steps: int = 100_000
    max_minutes: float = 0.0  # wall-clock budget for the training loop; 0 = none
    batch_tokens: int = 8192  # source+target tokens per batch (per rank and micro-batch), padding included
    accum_steps: int = 1  # micro-batches accumulated per update on each rank
    tokens_per_update: int = 0  # if set: accum_steps = this / (batch_tokens × ranks), constant across NPROC
    lr: float = 7e-4
    warmup_steps: int = 4000
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.98])
    weight_decay: float = 0.0
    clip_norm: float = 1.0
    label_smoothing: float = 0.1
    eval_every: int = 1000
    save_every: int = 1000
    log_every: int = 100
    patience: int = 10  # validations without a better dev BLEU before stopping; 0 = never
    resume: bool = False
    amp: str = "auto"  # auto (bf16 on CUDA, fp32 on CPU) | bf16 | fp32
    max_dev_sentences: int = 0  # validate on the first N dev pairs only; 0 = all
    evaluate: bool = False  # after training, evaluate best.pt on eval.split (what make compare uses)
    keep_last: int = 5  # model snapshots step_NNNNNNN.pt kept (newest); make average reads them; 0 = none
    keep_best: int = 0  # also keep the snapshots of the N best validations (best.pt is always written)
    max_bad_steps: int = 20  # abort after this many updates in a row with a non-finite loss (each is skipped)
    oom_retry: bool = False  # out of memory on a batch: halve train.batch_tokens and go on instead of stopping
    compile: bool = False  # torch.compile the Transformer's training step, or an RNN decoder's loop step
    compile_mode: str = "default"  # torch.compile mode: default | reduce-overhead (CUDA graphs) | max-autotune | max-autotune-no-cudagraphs
    fused_optimizer: bool = True  # AdamW as one fused kernel that skips non-finite updates on the device (false: for comparison)


@dataclass
class DecodeConfig:
    beam_size: int = 5  # 1 = greedy; validation during training is always greedy
    length_penalty: float = 1.0  # GNMT α: hypotheses scored log p / ((5 + |Y|) / 6)^α
    n_best: int = 1  # translate: hypotheses printed per input
    max_len_ratio: float = 1.5  # output length limit = ratio * source length + max_len_extra
    max_len_extra: int = 10
    batch_tokens: int = 16000  # source tokens per decoding batch (divided by beam_size)


@dataclass
class EvalConfig:
    split: str = "test"
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    length_buckets: list[int] = field(default_factory=lambda: [10, 20, 30, 40, 50])  # source-word bucket edges
    gold_align: Optional[str] = None  # Pharaoh gold alignments for the split: AER/precision/recall in metrics.json


@dataclass
class TranslateConfig:
    input: Optional[str] = None  # file; default stdin
    output: Optional[str] = None  # file; default stdout
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN


@dataclass
class BenchConfig:
    steps: int = 50  # timed training steps
    warmup: int = 10  # untimed steps first (allocator, cuDNN/compile warm-up)
    decode_sentences: int = 0  # decode the first N test sentences; 0 = all
    beam_size: int = 5  # decoding is timed greedy and with this beam
    checkpoint: Optional[str] = None  # a trained run's .pt (same model= settings): decode timings of real output
    profile_steps: int = 0  # then profile this many more steps: time per kind of work, top ops, a Chrome trace
    ablate: bool = False  # also time training with each speed feature off in turn (and with train.compile)
    cpu_small: bool = True  # on a CPU, cap model, batch, steps and test sentences at a size benched in minutes


@dataclass
class VizConfig:
    sentences: int = 4  # dev sentences whose alignments go to TensorBoard at every validation
    eval_plots: int = 20  # eval: PNG heatmaps for the first N sentences (alignments.jsonl has all)
    layer: int = -1  # Transformer layer whose heads are shown (and averaged in alignments.jsonl)


@dataclass
class AverageConfig:
    last: int = 5  # average the newest N snapshots (step_*.pt) into averaged.pt


@dataclass
class CompareConfig:
    dir: Optional[str] = None  # sweep folder of a `train -m` run (make compare sets it)


@dataclass
class Config:
    name: str = "default"
    run_dir: str = "checkpoints/${name}"  # set to Hydra's output dir by conf/config.yaml
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    translate: TranslateConfig = field(default_factory=TranslateConfig)
    bench: BenchConfig = field(default_factory=BenchConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    average: AverageConfig = field(default_factory=AverageConfig)
    viz: VizConfig = field(default_factory=VizConfig)


def register_configs() -> None:
    ConfigStore.instance().store(name="config_schema", node=Config)
