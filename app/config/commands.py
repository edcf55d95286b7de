"""The settings of the commands that use a trained run: decoding, evaluation, translation, scoring, export,
serving, make bench, make compare, weight averaging and the figures (``viz``). Sections of the root schema
(app/config/schema.py)."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Optional

from app.config.choices import Checked, choice
from app.config.ranges import check_rules
from app.run.errors import UserError

# minimum Bayes risk's utilities (app/decode/mbr.py): decode.mbr_utility's values, and their names in print
MBR_UTILITIES = {"chrf": "chrF", "bleu": "BLEU"}


@dataclass
class DecodeConfig(Checked, section="decode"):
    beam_size: int = 5  # 1 = greedy; validation during training is always greedy
    length_penalty: float = 1.0  # GNMT α: hypotheses scored log p / ((5 + |Y|) / 6)^α
    # GNMT β: a beam search's ended hypotheses also scored β Σ_i log min(attention source piece i got, 1), which
    # lowers those that leave source pieces unread (OpenNMT's -coverage_penalty wu, CTranslate2's coverage_penalty)
    coverage_penalty: float = 0.0
    n_best: int = 1  # translate: hypotheses printed per input
    # no n-gram of this many pieces twice in a hypothesis (fairseq's and CTranslate2's setting); 0 = off
    no_repeat_ngram_size: int = 0
    # no translation of a non-empty source shorter than this many pieces: no EOS before (fairseq's --min-len,
    # CTranslate2's min_decoding_length); 0: an empty translation may win
    min_len: int = 1
    sampling: bool = False  # draw each next token at random (beam_size 1), e.g. for back-translation, from:
    sampling_topk: int = 0  # the k most probable (0: all),
    sampling_topp: float = 1.0  # then the fewest of them holding this probability,
    sampling_temperature: float = 1.0  # of softmax(log p / temperature),
    sampling_epsilon: float = 0.0  # without the tokens below this probability (epsilon sampling; 0: none)
    sampling_seed: int = 0  # the same seed, settings and device draw the same samples
    # minimum Bayes risk (app/decode/mbr.py): the translation is the one of this many candidates that agrees most
    # with the others by decode.mbr_utility; they are decode.sampling's samples, else the beam's best; 0 = off
    mbr_candidates: int = 0
    mbr_utility: str = choice(*MBR_UTILITIES)  # sacrebleu's sentence chrF, or sentence BLEU (exponential smoothing)
    max_len_ratio: float = 1.5  # output length limit = ratio * source length + max_len_extra
    max_len_extra: int = 10
    # tokens per decoding batch after the beam: sentences × beam_size × their padded source length (on a CPU)
    batch_tokens: int = 16000
    # the same on CUDA, where a step costs its launches more than its rows: the test split in one batch
    cuda_batch_tokens: int = 200_000
    cpu_onednn: bool = True  # a Transformer's decoding steps multiply through oneDNN on a CPU (false: MKL, as training)

    def __post_init__(self) -> None:
        beam, ngram, topk, topp = self.beam_size, self.no_repeat_ngram_size, self.sampling_topk, self.sampling_topp
        ratio, extra = self.max_len_ratio, self.max_len_extra
        super().__post_init__()
        mbr, n_best, epsilon = self.mbr_candidates, self.n_best, self.sampling_epsilon
        alpha, beta, temp = self.length_penalty, self.coverage_penalty, self.sampling_temperature
        rules = {  # the first one broken is the error
            f"decode.mbr_candidates={mbr} must be 0 (off) or >= 2: the candidates to choose among": mbr < 0 or mbr == 1,
            f"decode.mbr_candidates={mbr} chooses among the beam's {mbr} best: decode.beam_size must be >= {mbr} (it "
            f"is {beam}), or decode.sampling=true draws {mbr} samples": mbr > beam and not self.sampling,
            # n-best lists rank minimum Bayes risk's candidates where it chooses, else the beam's hypotheses
            f"decode.n_best={n_best} must be <= decode.mbr_candidates={mbr}: the candidates ranked": 0 < mbr < n_best,
            f"decode.beam_size={beam} must be >= 1 and >= decode.n_best={n_best}": beam < 1
            or (beam < n_best and not mbr),
            f"decode.n_best={self.n_best} must be >= 1: hypotheses per input": self.n_best < 1,
            f"decode.no_repeat_ngram_size={ngram} must be >= 0 (0: off)": ngram < 0,
            f"decode.min_len={self.min_len} must be >= 0: the fewest pieces of a translation": self.min_len < 0,
            # finite, and wide of what is used (GNMT: α 0.6-1, β 0.2-0.4): at inf, nan or α = 1000 no hypothesis
            # keeps a finite score
            f"decode.length_penalty={alpha} must be in [-10, 10] (GNMT's α; 0: off)": not -10 <= alpha <= 10,
            f"decode.coverage_penalty={beta} must be in [0, 10] (GNMT's β; 0: off)": not 0 <= beta <= 10,
            "decode.sampling=true draws one hypothesis per sentence, a beam search does not draw: set "
            f"decode.beam_size=1 (it is {beam})": self.sampling and beam != 1,
            f"decode.sampling_topk={topk} must be >= 0 (0: the whole vocabulary)": topk < 0,
            f"decode.sampling_topp={topp} must be in (0, 1] (1: no cut)": not 0 < topp <= 1,
            # below 0.001, log p / temperature is -inf for every token (greedy: decode.sampling=false)
            f"decode.sampling_temperature={temp} must be in [0.001, 1000]": not 0.001 <= temp <= 1000,
            f"decode.sampling_epsilon={epsilon} must be in [0, 1) (0: no cut)": not 0 <= epsilon < 1,
            # an output's length limit: ratio × its source's length + extra pieces
            f"decode.max_len_ratio={ratio} must be in [0, 100]: a limit per source piece": not 0 <= ratio <= 100,
            f"decode.max_len_extra={extra} must be in [0, 100000]: pieces beyond the ratio": not 0 <= extra <= 100_000,
            "decode.max_len_ratio=0 with decode.max_len_extra=0 limits every output to 0 pieces": ratio == extra == 0,
            f"decode.batch_tokens={self.batch_tokens} must be >= 1: tokens of a decoding batch": self.batch_tokens < 1,
            f"decode.cuda_batch_tokens={self.cuda_batch_tokens} must be >= 1: tokens of a decoding batch on "
            "CUDA": self.cuda_batch_tokens < 1,
        }
        check_rules(rules)

    @property
    def batch_source_tokens(self) -> int:
        """Source tokens per decoding batch: a beam search batch holds beam_size copies of every sentence."""
        return max(self.batch_tokens // self.beam_size, 1)

    def greedy(self) -> DecodeConfig:
        return dataclasses.replace(self, beam_size=1, n_best=1, sampling=False, mbr_candidates=0)


@dataclass
class EvalConfig(Checked, section="eval"):
    split: str = "test"
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    length_buckets: list[int] = field(default_factory=lambda: [10, 20, 30, 40, 50])  # source-word bucket edges
    gold_align: Optional[str] = None  # Pharaoh gold alignments for the split: AER/precision/recall in metrics.json
    engine: str = choice("torch", "ct2")  # ct2: the run's CTranslate2 export (make export)
    # AER counts the link of every target word (all) or of the words the reference links (linked); unset:
    # linked for the corpus's own reference links (Strong's numbers leave function words untagged), all for gold_align
    align_scope: Optional[str] = choice(None, "all", "linked")
    max_sentences: int = 0  # score only the first N sentences of the split (a quick look, said so everywhere); 0 = all
    # what the attention files and explorer keep: every layer's mean of heads and viz.layer's heads (layer), or
    # every layer's heads (all: files 3 to 5 times the size)
    attention: str = choice("layer", "all")
    # another system to test this one against (paired bootstrap and approximate randomization of BLEU and chrF):
    # a run (its eval/<split>/hyp.txt) or a hypothesis file, a line per sentence evaluated
    baseline: Optional[str] = None
    # the words BLEU counts (sacrebleu's tokenize): unset, sacrebleu's choice for the target language (zh for
    # Chinese, ja-mecab for Japanese, ko-mecab for Korean: sacrebleu's extras; 13a otherwise); intl: 13a with Unicode
    # punctuation split off; char: every character; none: text already tokenized. For validation and make eval alike.
    bleu_tokenize: Optional[str] = choice(None, "13a", "intl", "zh", "ja-mecab", "ko-mecab", "char", "none")
    # parallel text files, a sentence per line, evaluated instead of eval.split (a test set of your own: WMT's,
    # FLORES'; eval.gold_align: their reference links); the files go to eval/<source's file name>/
    source: Optional[str] = None
    target: Optional[str] = None
    # more reference translations of the same sentences, a file each with a line per sentence evaluated, in its
    # order (eval.target's, or the split's data/<corpus>/<split>.tsv): BLEU, chrF and TER count every reference
    references: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        super().__post_init__()
        edges = self.length_buckets
        if any(edge < 1 for edge in edges) or any(b <= a for a, b in zip(edges, edges[1:])):
            raise UserError(
                f"eval.length_buckets={list(edges)} must be source lengths in words, each >= 1 and larger than the "
                "one before: the buckets' edges (e.g. [10,20,30])"
            )
        if (self.source is None) != (self.target is None):
            raise UserError(
                "eval.source and eval.target go together: give both files, or neither to evaluate eval.split"
            )

    def set_name(self) -> str:
        """What is evaluated, and the folder eval/<it>/ its files go to: eval.split, or eval.source's file name."""
        return os.path.basename(self.source) if self.source else self.split


@dataclass
class TranslateConfig(Checked, section="translate"):
    input: Optional[str] = None  # file; default stdin
    output: Optional[str] = None  # file; default stdout
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    engine: str = choice("torch", "ct2")  # ct2: the run's CTranslate2 export (translate.checkpoint unused)
    # each line "translation ||| i-j ...": its word links to the source, read from the attention (Pharaoh format); an
    # n-best line (decode.n_best > 1) "index ||| hypothesis ||| score ||| i-j ...", each hypothesis its own
    alignments: bool = False
    prefix: Optional[str] = None  # file, a line per input line: its translation begins so (empty line: free)
    # file, a line per input line: target phrases (tab-separated) its translation contains (empty line: free)
    constraints: Optional[str] = None
    window: int = 2000  # lines read, sorted by length, translated and written at a time: memory flat in a file's length
    resume: bool = False  # continue translate.output where an interrupted run stopped (same input and settings)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.window < 1:
            raise UserError(f"translate.window={self.window}: lines translated at a time, at least 1")


@dataclass
class ScoreConfig(Checked, section="score"):
    source: Optional[str] = None  # parallel files, line by line (neither given: the references of score.split)
    target: Optional[str] = None
    split: str = "test"
    output: Optional[str] = None  # default stdout
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    engine: str = choice("torch", "ct2")  # ct2: the run's CTranslate2 export (score.checkpoint unused)
    pieces: bool = False  # each line also lists every target piece (and the final </s>) with its log p
    alignments: bool = False  # each line also holds the pair's word links read from the attention (Pharaoh)


@dataclass
class AlignConfig(Checked, section="align"):
    """make align: word links of every pair of a parallel corpus from a trained run (app/evaluation/corpus_links.py);
    reverse and method also shape make eval's AER and hyp.align."""

    split: str = "test"  # the split of the run's corpus to align (unless align.source and align.target are given)
    source: Optional[str] = None  # parallel text files, a sentence per line, to align instead of a split
    target: Optional[str] = None
    output: Optional[str] = None  # Pharaoh links, a line per pair; unset: <run>/align/<split or source name>.align
    gold: Optional[str] = None  # Pharaoh reference links of the pairs: AER; unset: the split's own reference links
    reverse: Optional[str] = None  # a run of the other direction (a name or a folder): symmetrized methods too
    # how links are read (app/evaluation/extraction.py): the best on the run's dev reference links of every method
    # (auto) or of one; without dev links, the view plots show (grow-diag-final-and with align.reverse for auto)
    method: str = choice("auto", "attention", "shift-att", "intersection", "union", "grow-diag-final-and", "agreement")
    checkpoint: str = "best"  # of both runs: best | last | averaged | step_NNNNNNN
    chunk: int = 2000  # pairs read, aligned and written at a time (in batches of decode.batch_tokens)

    def __post_init__(self) -> None:
        super().__post_init__()
        if bool(self.source) != bool(self.target):
            raise UserError("align.source and align.target go together: the two sides of the pairs, line by line")
        if self.chunk < 1:
            raise UserError(f"align.chunk={self.chunk}: pairs aligned at a time, at least 1")


@dataclass
class HeadsConfig:
    """make heads: how much each attention head of a Transformer matters (app/evaluation/head_importance.py)."""

    split: str = "dev"
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    max_sentences: int = 500  # the split's first N pairs (0: all): each head costs a teacher-forced pass over them
    prune_steps: int = 10  # the pruning curve: the least important heads masked together, in N steps (0: none)
    bleu: bool = True  # the pruning curve's BLEU too: the split's sources decoded (decode.*) at each of its steps

    def __post_init__(self) -> None:
        rules = {
            f"heads.max_sentences={self.max_sentences} must be >= 0 (0: the whole split)": self.max_sentences < 0,
            f"heads.prune_steps={self.prune_steps} must be >= 0 (0: no pruning curve)": self.prune_steps < 0,
        }
        check_rules(rules)


@dataclass
class ExportConfig(Checked, section="export"):
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN
    quantization: str = choice("int8", "int8_float16", "float16", "none")  # none: float32
    dir: Optional[str] = None  # default <run_dir>/ct2


@dataclass
class BenchConfig:
    steps: int = 50  # timed training steps
    warmup: int = 10  # untimed steps first (allocator, cuDNN/compile warm-up)
    decode_sentences: int = 0  # decode the first N test sentences (greedy and with decode.beam_size); 0 = all
    decode_rounds: int = 1  # decode that many times, the engines taking turns; the best time of each is kept
    # CTranslate2's threads on a CPU (0: its default); one call per length limit (docs/benchmarking.md)
    ct2_threads: int = 1
    checkpoint_path: Optional[str] = None  # a trained run's .pt (same model= settings): decode timings of real output
    profile_steps: int = 0  # then profile this many more steps: time per kind of work, top ops, a Chrome trace
    host_tokens: int = 256  # host_step_ms: updates on a batch of at most this many padded tokens (its compute ~ 0)
    ablate: bool = False  # also time training with each speed feature off in turn (and with train.compile)
    cpu_small: bool = True  # on a CPU, cap model, batch, steps and test sentences at a size benched in minutes
    serve: bool = False  # instead: requests/s and latency of make serve's API (app/bench/serving.py)

    def __post_init__(self) -> None:
        rules = {
            f"bench.steps={self.steps} must be >= 2: the timed steps, in two rounds": self.steps < 2,
            f"bench.warmup={self.warmup} must be >= 0: untimed steps first": self.warmup < 0,
            f"bench.decode_sentences={self.decode_sentences} must be >= 0 (0: all)": self.decode_sentences < 0,
            f"bench.decode_rounds={self.decode_rounds} must be >= 1: decodings timed": self.decode_rounds < 1,
            f"bench.ct2_threads={self.ct2_threads} must be >= 0 (0: CTranslate2's default)": self.ct2_threads < 0,
            f"bench.profile_steps={self.profile_steps} must be >= 0 (0: no profile)": self.profile_steps < 0,
            f"bench.host_tokens={self.host_tokens} must be >= 1: tokens of host_step_ms's batch": self.host_tokens < 1,
        }
        check_rules(rules)


@dataclass
class VizConfig:
    sentences: int = 4  # dev sentences whose alignments go to TensorBoard at every validation
    eval_plots: int = 20  # eval: PNG heatmaps for the first N sentences (alignments.npz has every sentence's maps)
    layer: int = -1  # Transformer layer whose heads are shown, kept in alignments.npz and the explorer
    worker: bool = True  # validation's scoring and heatmaps, make eval's TER: in a process beside (host_worker.py)
    # a Transformer's self-attention too (encoder's, decoder's over the hypothesis: a teacher-forced pass), in make
    # eval's files, explorer and figures, and in every validation's figures
    self_attention: bool = True


@dataclass
class AverageConfig:
    last: int = 5  # average the newest N snapshots (step_*.pt) into averaged.pt


@dataclass
class CompareConfig:
    dir: Optional[str] = None  # sweep folder of a `train -m` run (make compare sets it)
    out: Optional[str] = None  # where compare.md, bleu_by_length.png and tb/ go; unset: compare.dir
    baseline: Optional[str] = None  # the run the others are tested against (its folder name or label); unset: the first


@dataclass
class ServeConfig:
    host: str = "127.0.0.1"  # only this machine; 0.0.0.0 answers every interface (no authentication: mind it)
    port: int = 8000  # 0: any free port (the line printed at start names it)
    checkpoint: str = "best"  # best | last | averaged | step_NNNNNNN (translate.engine=ct2: the export's, this one)
    batch_wait_ms: float = 20.0  # how long a batch waits for requests to join it (from the first, or the last answers)
    max_batch_lines: int = 256  # lines of one decoding call at most (decode.batch_tokens splits it further)
    max_lines: int = 64  # lines of one request at most
    max_chars: int = 2000  # characters of one line at most
    max_beam: int = 16  # beam_size of a request at most
    # make bench ARGS="name=<run> bench.serve=true": concurrent clients, each sending single sentences
    bench_clients: int = 16
    bench_seconds: float = 20.0  # how long each of the two loads (1 client, bench_clients clients) runs

    def __post_init__(self) -> None:
        rules = {  # the first one broken is the error: a server that could not listen, or answer any request
            f"serve.port={self.port}: not a port; give 0 to 65535 (0: any free port)": not 0 <= self.port <= 65535,
            f"serve.max_lines={self.max_lines}: lines a request may send, at least 1": self.max_lines < 1,
            f"serve.max_chars={self.max_chars}: characters a line may have, at least 1": self.max_chars < 1,
            f"serve.max_beam={self.max_beam}: the largest beam_size a request may ask for, at least 1": (
                self.max_beam < 1
            ),
            f"serve.max_batch_lines={self.max_batch_lines}: lines of one decoding call, at least 1": (
                self.max_batch_lines < 1
            ),
            f"serve.batch_wait_ms={self.batch_wait_ms}: how long a batch waits for requests, 0 or more (finite)": not (
                0 <= self.batch_wait_ms < math.inf
            ),
            f"serve.max_lines={self.max_lines} is above serve.max_batch_lines={self.max_batch_lines}: a request's "
            "lines are decoded in one call; raise serve.max_batch_lines or lower serve.max_lines": (
                self.max_lines > self.max_batch_lines
            ),
            f"serve.bench_clients={self.bench_clients}: concurrent clients of make bench's serving load, at least 1": (
                self.bench_clients < 1
            ),
            f"serve.bench_seconds={self.bench_seconds}: how long each serving load runs, more than 0 (finite)": not (
                0 < self.bench_seconds < math.inf
            ),
        }
        check_rules(rules)
