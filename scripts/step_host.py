"""Host work of one eager training update of the default Transformer's structure (6 + 6 layers, 8 heads, its
dropouts) at widths so narrow and a vocabulary so small (64) that a CPU's compute hardly counts: operators per
update and milliseconds per update (best of 7 x 10), one thread, 8 sentences of 16 -> 15 random pieces.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/step_host.py [noattdrop] [compile]

Run from a checkout's root; docs/benchmarking.md ("A training step's host work") compares checkouts taking turns.
"""

import json
import sys
import time

import torch

sys.path.insert(0, ".")
from app.config.schema import Config  # noqa: E402
from app.data.batching import Batch  # noqa: E402
from app.models import build_model  # noqa: E402

try:
    from app.bench.profiling import count_ops
    from app.train.update import compiled_for_training, make_optimizer, train_step
except ImportError:  # 99c1301's module layout, for the "before" column
    from app.profiling import count_ops
    from app.update import compiled_for_training, make_optimizer, train_step

VOCAB, B, S, T = 64, 8, 16, 15


class Vocab:
    src_vocab_size = tgt_vocab_size = VOCAB
    joint = True


torch.manual_seed(0)
torch.set_num_threads(1)
cfg = Config()
cfg.model.d_model, cfg.model.ff_dim = 64, 64
if "noattdrop" in sys.argv:
    cfg.model.attention_dropout = 0.0
cfg.train.compile = "compile" in sys.argv
model = build_model(cfg.model, Vocab())
optimizer, scheduler = make_optimizer(model, cfg)
model = compiled_for_training(model, cfg)
g = torch.Generator().manual_seed(0)
src, tgt = torch.randint(4, VOCAB, (B, S), generator=g), torch.randint(4, VOCAB, (B, T + 1), generator=g)
batch = Batch(src, torch.arange(B), tgt[:, :-1], tgt[:, 1:], torch.full((B,), S))


def step():
    train_step(model, [batch], B * T, optimizer, scheduler, cfg, None)


for _ in range(3):  # optimizer state, compiled graphs
    step()
out = {"operators": count_ops(step, 2, torch.device("cpu"), dispatch=not cfg.train.compile)["ops"]}
times = []
for _ in range(7):
    start = time.perf_counter()
    for _ in range(10):
        step()
    times.append((time.perf_counter() - start) / 10 * 1e3)
out["ms_per_update"] = round(min(times), 2)
print(json.dumps(out))
