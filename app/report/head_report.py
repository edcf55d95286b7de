"""``make heads``' report of how much each attention head matters (measured by app/evaluation/head_importance.py):
printed as one grid per attention and written to ``<run>/heads/<split>/``: ``importance.json`` (every head's
figures, the pruning curve, the settings) and ``importance.png`` (the grids and the curve)."""

from __future__ import annotations

import io
import json
import os

from app.config.schema import Config
from app.evaluation.head_importance import HeadImportance, MeasuredHeads
from app.report.board import log_heads
from app.report.plots import DPI, TENSORBOARD_WIDTH
from app.run.files import atomic_write, atomic_write_text

LABELS = {"encoder": "encoder self-attention", "decoder": "decoder self-attention", "cross": "cross-attention"}


def write_heads(measured: MeasuredHeads) -> dict:
    """Print what ``measured`` found and write its files; the report as written to importance.json."""
    found, cfg = measured.found, measured.cfg
    report = as_dict(found, cfg, measured.step, measured.seconds)
    out = os.path.join(cfg.run_dir, "heads", cfg.heads.split)
    os.makedirs(out, exist_ok=True)
    atomic_write_text(os.path.join(out, "importance.json"), json.dumps(report, indent=2) + "\n")
    title = f"{cfg.name}, step {measured.step}, {cfg.heads.split}"
    png, _ = figure(found, title, across=True)
    atomic_write(os.path.join(out, "importance.png"), lambda f: f.write(png))
    tb = log_heads(cfg.run_dir, cfg.heads.split, figure(found, title, across=False), report, measured.step)
    print(text(found))
    print(f"wrote {out}/importance.json and importance.png in {report['seconds']:.1f} s; TensorBoard: {tb}")
    return report


def as_dict(found: HeadImportance, cfg: Config, step: int, seconds: float) -> dict:
    return {
        "checkpoint": cfg.heads.checkpoint,
        "step": step,
        "split": cfg.heads.split,
        "sentences": found.sentences,
        "target_tokens": found.tokens,
        "loss": round(found.base_loss, 5),
        "gradient_agreement": round(found.agreement(), 4),
        "heads": [
            {
                "kind": head.kind,
                "layer": head.layer,
                "head": head.head,
                "loss_increase": round(found.ablation[head], 5),
                "gradient": round(found.gradient[head], 6),
                "rank": rank,
            }
            for rank, head in enumerate(found.ranked(), start=1)
        ],
        "pruning": [
            {**p, "loss": round(p["loss"], 5), **({"bleu": round(p["bleu"], 2)} if "bleu" in p else {})}
            for p in found.pruning
        ],
        "seconds": round(seconds, 1),
    }


def grids(found: HeadImportance) -> dict[str, list[list[float]]]:
    """Per kind, its (layers, heads) loss increases."""
    out: dict[str, list[list[float]]] = {}
    for head, value in found.ablation.items():
        rows = out.setdefault(head.kind, [])
        while len(rows) <= head.layer:
            rows.append([])
        rows[head.layer].append(value)
    return out


def text(found: HeadImportance) -> str:
    """The grids as text, then the pruning curve, for the terminal."""
    lines = [f"loss {found.base_loss:.4f} nats per target token with every head ({found.tokens:,} tokens)"]
    lines.append("loss increase with one head masked:")
    for kind, rows in grids(found).items():
        lines.append(f"  {LABELS[kind]:<26}" + "".join(f"{f'head {h}':>9}" for h in range(len(rows[0]))))
        lines += [f"    layer {layer:<18}" + "".join(f"{v:>+9.4f}" for v in row) for layer, row in enumerate(rows)]
    lines.append(
        f"the gradient importance (one backward pass) orders the heads as masking them does: Spearman's rho "
        f"{found.agreement():.2f}"
    )
    if found.pruning:
        bleu = "bleu" in found.pruning[0]
        curve = ", ".join(
            f"{p['share']:.0%}: {p['loss']:.4f}" + (f" / {p['bleu']:.2f}" if bleu else "") for p in found.pruning
        )
        figures = "loss / BLEU" if bleu else "loss"
        lines.append(f"masking the least important heads together (share of all heads: {figures}): {curve}")
    return "\n".join(lines)


def figure(found: HeadImportance, title: str, across: bool) -> tuple[bytes, tuple[int, int]]:
    """One grid per attention (colour: the loss increase), and the pruning curve: side by side (``across``, the
    file), or one under the other, TensorBoard's width (its IMAGES tab shows every image that wide). The PNG's bytes
    and its (width, height)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = grids(found)
    panels = len(kinds) + bool(found.pruning)
    size = (3.4 * panels, 3.6) if across else (TENSORBOARD_WIDTH / DPI, 2.8 * panels)
    fig, axes = plt.subplots(
        1 if across else panels, panels if across else 1, figsize=size, dpi=DPI, layout="constrained"
    )
    top = max(max(v for row in rows for v in row) for rows in kinds.values())
    for ax, (kind, rows) in zip(axes, kinds.items()):
        image = ax.imshow(rows, cmap="viridis", vmin=min(0.0, top), vmax=max(top, 1e-9), aspect="auto")
        ax.set(title=LABELS[kind], xlabel="head", ylabel="layer", xticks=range(len(rows[0])), yticks=range(len(rows)))
        for layer, row in enumerate(rows):
            for h, value in enumerate(row):
                ink = "black" if value > 0.6 * top else "white"  # readable on viridis' bright and dark ends
                ax.text(h, layer, f"{value:.3f}", ha="center", va="center", fontsize=7, color=ink)
    fig.colorbar(image, ax=axes[: len(kinds)], label="loss increase (nats/token)", shrink=0.8)
    if found.pruning:
        ax = axes[-1]
        shares = [100 * p["share"] for p in found.pruning]
        ax.plot(shares, [p["loss"] for p in found.pruning], marker="o", label="loss")
        ax.set(title="least important heads masked", xlabel="% of heads masked", ylabel="loss (nats/token)")
        if "bleu" in found.pruning[0]:  # Michel et al.'s figure: BLEU on a second axis
            right = ax.twinx()
            right.plot(shares, [p["bleu"] for p in found.pruning], marker="s", color="tab:orange", label="BLEU")
            right.set_ylabel("BLEU", color="tab:orange")
            ax.legend(handles=ax.get_lines() + right.get_lines(), fontsize=7, loc="center left")
    fig.suptitle(title, fontsize=10 if across else 8)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    width, height = fig.canvas.get_width_height()
    plt.close(fig)
    return buffer.getvalue(), (width, height)
