"""Export a trained Transformer to CTranslate2 (https://opennmt.net/CTranslate2): ``make export``.

    convert(model, model_cfg, src_spm, tgt_spm, out_dir, quantization)   a CTranslate2 model directory

(app/decode/ct2_engine.py translates with it.)

The spec is filled by hand from our weights (ctranslate2.specs.TransformerSpec built from a
TransformerEncoderSpec and a TransformerDecoderSpec); what each of our settings becomes:

    model.pos=sinusoidal|learned  our table in position_encodings/encodings (CTranslate2's own
                                  sinusoids are the concatenated [sin | cos] of tensor2tensor, starting
                                  at position 1: not ours, which interleave sin/cos from position 0)
    model.pos=rope                rotary_dim=0 (whole head), rotary_interleave=True: pairs (x_2i, x_2i+1),
                                  as ours; base 10000 and θ_i = base^(-2i/d_head), as ours
    model.pos=alibi               a T5-style relative_attention_bias table holding -m_h·|i-j| (see
                                  _alibi_table); CTranslate2's own `alibi` flag exists for decoders only
                                  (its encoder has none) and uses BLOOM's slopes, which are not ours
                                  for a head count that is not a power of two
    model.norm_type=rmsnorm       rms_norm=True;  model.norm=post: pre_norm=False (no final norm)
    model.kv_heads                num_heads_kv (self- and cross-attention); query head h reads key/value
                                  head h // (heads / kv_heads) in both (CTranslate2's replicate_heads)
    model.activation              RELU | GELU (the erf form, as torch's nn.GELU)

Refused with a one-line UserError: model.arch=rnn, model.window > 0 (sliding-window encoder) and
model.copy_attention (CTranslate2's decoder has no pointer-generator).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import shutil
import tempfile
from typing import Optional

import numpy as np
import torch

from app.config.ranges import check_layer
from app.data.tokenizer import BOS, EOS, PAD, UNK
from app.decode.ct2_engine import EXPORT_INFO, export_dir
from app.decode.trained import load_trained
from app.models.positions import LearnedPositions
from app.models.transformer import Transformer
from app.run.errors import UserError
from app.run.files import check_output_folder
from app.run.stopwatch import Stopwatch

# export.quantization -> what ModelSpec.optimize stores (None: float32, as trained). At load time
# CTranslate2 converts what a device cannot run: on a CPU float16 runs as float32, int8_float16 as int8_float32.
QUANTIZATIONS = {"none": None, "int8": "int8", "int8_float16": "int8_float16", "float16": "float16"}


def export_run(cfg) -> str:
    """``make export``: the run's ``export.checkpoint`` as a CTranslate2 model in ``export.dir`` (default
    ``<run>/ct2``), weights quantized as ``export.quantization``; the attention it returns is the mean of
    the heads of decoder layer ``viz.layer``. Returns the directory."""
    clock = Stopwatch()
    out_dir = export_dir(cfg)
    check_output_folder(out_dir, f"export.dir={out_dir}")
    with clock("load"):
        trained = load_trained(cfg.run_dir, cfg.export.checkpoint, torch.device("cpu"), "export.checkpoint")
    run_info = {"run_dir": cfg.run_dir, "checkpoint": cfg.export.checkpoint, "step": trained.step}
    tok = trained.tokenizer
    model_cfg = trained.config.model
    check_layer(cfg.viz.layer, model_cfg)  # the alignment layer of the export
    print(f"exporting {cfg.run_dir} {cfg.export.checkpoint} (step {trained.step}) to {out_dir} ...", flush=True)
    with clock("convert"):
        convert(
            trained.model,
            model_cfg,
            tok.src_path,
            tok.tgt_path,
            out_dir,
            cfg.export.quantization,
            run_info,
            cfg.viz.layer,
        )
    size = sum(os.path.getsize(os.path.join(out_dir, f)) for f in os.listdir(out_dir)) / 2**20
    print(
        f"exported {cfg.run_dir} {cfg.export.checkpoint} (step {trained.step}) to {out_dir} "
        f"({cfg.export.quantization}, {size:.1f} MiB) in {clock.line()}. Translate or evaluate with it:\n"
        f'  make translate ARGS="{with_export(cfg, "translate")}"\n'
        f'  make eval ARGS="{with_export(cfg, "eval")}"'
    )
    return out_dir


def with_export(cfg, command: str) -> str:
    """The settings of ``make translate`` / ``make eval`` that read this export: its folder and checkpoint."""
    settings = [f"name={cfg.name}", f"{command}.engine=ct2"]
    if cfg.export.checkpoint != "best":
        settings.append(f"{command}.checkpoint={cfg.export.checkpoint}")
    if cfg.export.dir:
        settings.append(f"export.dir={cfg.export.dir}")
    return " ".join(settings)


def _field(cfg, name: str, default=None):
    return getattr(cfg, name, default) if not isinstance(cfg, dict) else cfg.get(name, default)


def check_exportable(model: torch.nn.Module, model_cfg) -> None:
    """A UserError naming the first setting CTranslate2 cannot express."""
    if not isinstance(_unwrap(model), Transformer):
        raise UserError(
            f"model.arch={_field(model_cfg, 'arch', 'rnn')}: CTranslate2 has no recurrent "
            "encoder-decoder to export this model to; only Transformer runs export"
        )
    if _field(model_cfg, "window", 0):
        raise UserError(
            f"model.window={_field(model_cfg, 'window')}: CTranslate2 has no sliding-window encoder attention"
        )
    if _field(model_cfg, "copy_attention", False):
        raise UserError(
            "model.copy_attention=true: CTranslate2's decoder cannot copy source pieces (no pointer-generator)"
        )
    for name, allowed in (
        ("activation", ("relu", "gelu")),
        ("norm", ("pre", "post")),
        ("norm_type", ("layernorm", "rmsnorm")),
        ("pos", ("sinusoidal", "learned", "rope", "alibi")),
    ):
        if _field(model_cfg, name) not in allowed:
            raise UserError(f"model.{name}={_field(model_cfg, name)}: no CTranslate2 equivalent is known")


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile'd


def _t(x: torch.Tensor) -> torch.Tensor:
    # a copy: ModelSpec.optimize quantizes in place, through numpy views of these tensors
    return x.detach().to("cpu", torch.float32, copy=True).contiguous()


def _set_linear(spec, *layers: torch.nn.Linear) -> None:
    """One CTranslate2 Dense from our Linear layers stacked on the output axis (fused QKV or KV)."""
    spec.weight = _t(torch.cat([layer.weight for layer in layers]))
    if layers[0].bias is not None:
        spec.bias = _t(torch.cat([layer.bias for layer in layers]))


def _set_norm(spec, norm: torch.nn.Module) -> None:
    spec.gamma = _t(norm.get_parameter("weight"))
    if isinstance(norm, torch.nn.LayerNorm):
        spec.beta = _t(norm.bias)


def _set_attention(spec, attn, norm, self_attention: bool) -> None:
    # CTranslate2's layout (src/layers/attention.cc): self-attention linear_0 = [Q; K; V], linear_1 = out;
    # encoder-decoder attention linear_0 = Q, linear_1 = [K; V], linear_2 = out
    _set_norm(spec.layer_norm, norm)
    if self_attention:
        _set_linear(spec.linear[0], attn.qkv_proj)
        _set_linear(spec.linear[1], attn.out_proj)
    else:
        _set_linear(spec.linear[0], attn.q_proj)
        _set_linear(spec.linear[1], attn.kv_proj)
        _set_linear(spec.linear[2], attn.out_proj)


def _set_ffn(spec, ff, norm) -> None:
    _set_norm(spec.layer_norm, norm)
    _set_linear(spec.linear_0, ff[0])
    _set_linear(spec.linear_1, ff[3])


def _alibi_table(slopes: torch.Tensor, max_len: int, bidirectional: bool) -> tuple[torch.Tensor, int]:
    """ALiBi as a T5 relative_attention_bias table (buckets, heads) and its bucket count.

    CTranslate2 (get_relative_position_bucket in src/layers/attention.cc) gives a distance below
    max_exact a bucket of its own: |j - i| for keys at or before the query, and, in the bidirectional
    (encoder) case, num_buckets / 2 + (j - i) after it, with max_exact = num_buckets / 4 (encoder) or
    num_buckets / 2 (decoder). With max_exact = max_len every distance our model can see (inputs and
    outputs stay within model.max_len) is exact, so bucket b holds -m_h · distance(b): our bias,
    -m_h·|i - j|, added to the scaled scores as ours is."""
    buckets = (4 if bidirectional else 2) * max_len
    distance = torch.arange(buckets) % (buckets // 2) if bidirectional else torch.arange(buckets)
    return -distance[:, None].float() * slopes[None, :].float().cpu(), buckets


def build_spec(model: torch.nn.Module, model_cfg, alignment_layer: int = -1):
    """The filled ctranslate2.specs.TransformerSpec of our Transformer (no vocabularies yet)."""
    from ctranslate2.specs import common_spec, transformer_spec

    check_exportable(model, model_cfg)
    model = _unwrap(model)
    assert isinstance(model, Transformer)  # exportable
    heads, pos, max_len = _field(model_cfg, "heads"), _field(model_cfg, "pos"), _field(model_cfg, "max_len")
    kv_heads = _field(model_cfg, "kv_heads", 0) or heads
    common = dict(
        num_heads=heads,
        pre_norm=_field(model_cfg, "norm") == "pre",
        activation={"relu": common_spec.Activation.RELU, "gelu": common_spec.Activation.GELU}[
            _field(model_cfg, "activation")
        ],
        rms_norm=_field(model_cfg, "norm_type") == "rmsnorm",
        num_heads_kv=kv_heads,
        relative_attention_bias=pos == "alibi",
        # rotary_dim=0: rotate the whole head (TransformerEncoderSpec docs)
        rotary_dim=0 if pos == "rope" else None,
        rotary_interleave=True,
        rotary_base=10000,
    )
    encoder = transformer_spec.TransformerEncoderSpec(_field(model_cfg, "enc_layers"), **common)
    # alignment_heads=0: the attention CTranslate2 returns averages every head of alignment_layer
    decoder = transformer_spec.TransformerDecoderSpec(
        _field(model_cfg, "dec_layers"), alignment_layer=alignment_layer, alignment_heads=0, **common
    )

    encoder.embeddings[0].weight = _t(model.src_embed.weight)
    decoder.embeddings.weight = _t(model.tgt_embed.weight)
    encoder.scale_embeddings = decoder.scale_embeddings = True  # × sqrt(d_model), as ours
    positions = model.positions
    if positions is not None:
        table = _t(positions.table.weight if isinstance(positions, LearnedPositions) else positions.table)
        encoder.position_encodings.encodings = decoder.position_encodings.encodings = table
    if model.alibi is not None:  # model.pos=alibi
        tables = {side: _alibi_table(model.alibi.slopes, max_len, side == "encoder") for side in ("encoder", "decoder")}
    for side, stack, layers in (("encoder", encoder, model.encoder), ("decoder", decoder, model.decoder)):
        if stack.pre_norm:
            _set_norm(stack.layer_norm, model.enc_norm if side == "encoder" else model.dec_norm)
        for spec, layer in zip(stack.layer, layers):
            first = layer.attn_block if side == "encoder" else layer.self_block
            _set_attention(spec.self_attention, layer.self_attn, first.norm, self_attention=True)
            if side == "decoder":
                _set_attention(spec.attention, layer.cross_attn, layer.cross_block.norm, self_attention=False)
            _set_ffn(spec.ffn, layer.ff, layer.ff_block.norm)
            if pos == "alibi":
                table, buckets = tables[side]
                spec.self_attention.relative_attention_bias = table
                # only read beyond max_exact, where no distance of ours falls
                spec.self_attention.relative_attention_max_distance = np.int32(buckets)
    decoder.projection.weight = _t(model.out_proj.weight)  # no bias: ours has none

    spec = transformer_spec.TransformerSpec(encoder, decoder)
    spec.config.layer_norm_epsilon = 1e-5  # ours (CTranslate2's default: 1e-5 LayerNorm, 1e-6 RMSNorm)
    spec.config.add_source_eos = True  # our sources end in EOS, with no BOS; decoding starts from <s>
    spec.config.decoder_start_token = "<s>"
    return spec


def spm_pieces(path: str) -> list[str]:
    """A SentencePiece model's pieces in id order: CTranslate2's token i is our id i."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=path)
    pieces = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
    if pieces[:4] != ["<pad>", "<unk>", "<s>", "</s>"]:
        raise UserError(f"{path}: expected <pad> <unk> <s> </s> at ids {PAD} {UNK} {BOS} {EOS}, found {pieces[:4]}")
    return pieces


def convert(
    model: torch.nn.Module,
    model_cfg,
    src_spm_path: str,
    tgt_spm_path: str,
    out_dir: str,
    quantization: str = "none",
    run_info: Optional[dict] = None,
    alignment_layer: int = -1,
) -> None:
    """Write a CTranslate2 model directory: model.bin, config.json, the vocabularies (SentencePiece pieces
    in id order), the SentencePiece model(s), export.json and README.md. An earlier export in ``out_dir``
    is replaced whole; any other non-empty directory is refused."""
    import ctranslate2

    if quantization not in QUANTIZATIONS:
        raise UserError(f"export.quantization={quantization}: choose {', '.join(QUANTIZATIONS)}")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, EXPORT_INFO)):
        raise UserError(f"{out_dir}: exists and is not an earlier export (no {EXPORT_INFO}); choose another directory")
    spec = build_spec(model, model_cfg, alignment_layer)
    transformer = _unwrap(model)
    assert isinstance(transformer, Transformer)  # exportable
    joint = os.path.abspath(src_spm_path) == os.path.abspath(tgt_spm_path)
    spm_files = (
        {"source": "spm.model", "target": "spm.model"}
        if joint
        else {"source": "source.spm.model", "target": "target.spm.model"}
    )
    for side, path in (("source", src_spm_path), ("target", tgt_spm_path)):
        pieces = spm_pieces(path)
        embed = transformer.src_embed if side == "source" else transformer.tgt_embed
        if len(pieces) != embed.num_embeddings:
            raise UserError(
                f"{path}: {len(pieces)} pieces, but the model's {side} vocabulary has "
                f"{embed.num_embeddings}: not the tokenizer this model was trained with"
            )
        (spec.register_source_vocabulary if side == "source" else spec.register_target_vocabulary)(pieces)
        if side == "source" or not joint:
            spec.register_file(path, spm_files[side])
    try:
        spec.validate()
    except ValueError as err:  # a weight left unset: a bug here, or a model this code does not know
        raise UserError(f"CTranslate2 spec: {' '.join(str(err).split())}") from None
    spec.optimize(quantization=QUANTIZATIONS[quantization])

    info = {
        "engine": "ctranslate2",
        "ctranslate2_version": ctranslate2.__version__,
        "exported_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "quantization": quantization,
        "max_positions": int(_field(model_cfg, "max_len")),  # inputs and outputs stay below, as in app.decode.passes
        "alignment_layer": alignment_layer,
        "spm": spm_files,
        "model": dict(model_cfg) if isinstance(model_cfg, dict) else dataclasses.asdict(model_cfg),
        "run": run_info or {},
    }
    parent = os.path.dirname(os.path.abspath(out_dir))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".export-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp's folder is its owner's alone (0700); an export is a folder like any
    try:
        spec.save(tmp)
        with open(os.path.join(tmp, EXPORT_INFO), "w", encoding="utf-8") as f:
            json.dump(info, f, indent=2, default=str)
        with open(os.path.join(tmp, "README.md"), "w", encoding="utf-8") as f:
            f.write(_readme(info))
        shutil.rmtree(out_dir, ignore_errors=True)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _readme(info: dict) -> str:
    m, spm_files = info["model"], info["spm"]
    run = "".join(f"- {k}: {v}\n" for k, v in info["run"].items()) or "- (not given)\n"
    return f"""# CTranslate2 export

Transformer {m.get("enc_layers")}+{m.get("dec_layers")} layers, d_model {m.get("d_model")}, {m.get("heads")} heads
(kv_heads {m.get("kv_heads")}), ff {m.get("ff_dim")}, pos {m.get("pos")}, norm {m.get("norm")}/{m.get("norm_type")},
activation {m.get("activation")}; weights {info["quantization"]}; CTranslate2 {info["ctranslate2_version"]},
exported {info["exported_at"]}.

## Source run
{run}
## Use
Tokenize with `{spm_files["source"]}` and detokenize with `{spm_files["target"]}` (SentencePiece; the
vocabularies list its pieces in id order). `</s>` is appended to the source by CTranslate2
(config.json add_source_eos); decoding starts from `<s>`. Our decoders never output `<pad>` or `<s>`:

    import ctranslate2, sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file="{spm_files["source"]}")
    tr = ctranslate2.Translator(".", device="cpu")
    out = tr.translate_batch([sp.encode("...", out_type=str)], beam_size=5, max_input_length=0,
                             min_decoding_length=0, suppress_sequences=[["<pad>"], ["<s>"]])

`app.decode.ct2_engine.CT2Translator` does this with the project's decoding settings (GNMT length penalty,
length limit ratio · source length + extra). Inputs longer than {info["max_positions"] - 1} tokens
are out of this model's range. `export.json` holds the full model settings.
"""
