#!/usr/bin/env bash
# The GPU figures the issues ask for, each part one call to a lent GPU machine (10-minute limit):
#   bash scripts/gpu_check.sh paths        # the first call: every GPU path for a few steps, so breakage shows
#                                          # before the long runs (bf16 training and beam-5 eval of every family,
#                                          # 1-GPU torchrun, compile and CUDA graphs, SIGKILL then resume with
#                                          # the per-step loss difference, a real out-of-memory with oom_retry)
#   bash scripts/gpu_check.sh transformer  # 1-GPU torchrun (DDP over NCCL) training, greedy and beam-5
#                                          # eval of the test set, make bench with the trained weights
#                                          # and its profile
#   bash scripts/gpu_check.sh rnn          # the same for rnn_bahdanau (one process)
#   bash scripts/gpu_check.sh bench        # make bench: compiled Transformer and Bahdanau, rnn_luong, rnn_plain
#   bash scripts/gpu_check.sh ablation     # bench.ablate=true for the Transformer and Bahdanau: training speed
#                                          # with each speed feature off in turn (the before/after table)
#   bash scripts/gpu_check.sh compare      # make compare for COMPARE_MODELS (one model per call fits) with
#                                          # COMPARE_ARGS; each run comes back as $OUT/run_<settings>.tar.gz
#                                          # (summary, metrics, hypotheses, settings, log). Here, unpack those
#                                          # of every call into one folder and run
#                                          # python -m app command=compare compare.dir=<that folder>
# The machine has no internet: first, where there is, `make gpu-wheels` (the packages its image lacks,
# into .whl/) and `make data`; carry .whl and data. Results go to $OUT (default checkpoints/gpu_check):
# <part>.log and one JSON per figure. GPU_CHECK_ARGS adds Hydra overrides to every command (a tiny
# model, to try the script on a CPU).
set -uo pipefail
part=${1:?usage: $0 paths|transformer|rnn|bench|ablation|compare}
OUT=${OUT:-checkpoints/gpu_check}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY=${PY:-python3}
EXTRA=${GPU_CHECK_ARGS:-}
TRAIN_MINUTES=${TRAIN_MINUTES:-3}
BENCH_STEPS=${BENCH_STEPS:-50}
PROFILE_STEPS=${PROFILE_STEPS:-5}  # profiled after the timed steps: where the time goes (app/profiling.py)
status=0

log=$OUT/$part.log
: >"$log"
run() {  # run COMMAND...: output appended to the part's log; a failure is noted, the next stage still runs
    echo "== $*" | tee -a "$log"
    "$@" >>"$log" 2>&1 || { echo "!! failed (exit $?): $*" | tee -a "$log"; status=1; }
    tail -n 15 "$log" | grep -v '^\s*$'
}

train_eval_bench() {  # NAME LAUNCHER OVERRIDES...: train, eval greedy and beam 5, bench with the weights
    local name=$1 launcher=$2; shift 2
    rm -rf "checkpoints/$name"
    run $launcher app command=train name=$name train.max_minutes=$TRAIN_MINUTES train.eval_every=500 \
        train.save_every=500 train.max_dev_sentences=300 "$@" $EXTRA
    cp "checkpoints/$name/train_summary.json" "$OUT/${name}_train_summary.json" || status=1
    for beam in 1 5; do
        run $PY -m app command=eval name=$name decode.beam_size=$beam $EXTRA
        cp "checkpoints/$name/eval/test/metrics.json" "$OUT/${name}_beam${beam}_metrics.json" || status=1
    done
    run $PY -m app command=bench name=$name "$@" bench.steps=$BENCH_STEPS bench.profile_steps=$PROFILE_STEPS \
        bench.checkpoint_path=checkpoints/$name/best.pt $EXTRA
    cp "checkpoints/bench/$name.json" "$OUT/${name}_bench.json" || status=1
    cp "checkpoints/bench/${name}_profile.txt" "$OUT/" || status=1
}

nvidia-smi -L 2>/dev/null || echo "no nvidia-smi: running on the CPU"
$PY -c 'import importlib.metadata as m, torch
print("cuda:", torch.cuda.is_available(), {p: m.version(p) for p in
      ("torch", "pyarrow", "datasets", "huggingface-hub", "fsspec", "hydra-core", "sentencepiece", "sacrebleu")})' || exit 1

case $part in
paths)
    short="train.max_steps=40 train.eval_every=40 train.save_every=20 train.log_every=1 train.max_dev_sentences=50"
    i=0
    for preset in "model=transformer" "model=rnn_plain" "model=rnn_bahdanau" "model=rnn_luong" \
        "model=rnn_luong model.score=dot model.input_feeding=false" "model=rnn_luong model.score=concat"; do
        i=$((i + 1))
        rm -rf checkpoints/paths_$i
        run $PY -m app command=train name=paths_$i $preset $short train.evaluate=true decode.beam_size=5 $EXTRA
        cp "checkpoints/paths_$i/eval/test/metrics.json" "$OUT/paths_${i}_metrics.json" || status=1
        [ -s "checkpoints/paths_$i/eval/test/alignments.jsonl" ] || [ "$preset" = model=rnn_plain ] ||
            { echo "!! no alignments.jsonl for $preset" | tee -a "$log"; status=1; }
    done
    rm -rf checkpoints/paths_ddp checkpoints/paths_compiled checkpoints/paths_graphs checkpoints/paths_oom
    run $PY -m torch.distributed.run --standalone --nproc_per_node=1 -m app command=train name=paths_ddp $short $EXTRA
    run $PY -m app command=train name=paths_compiled train.compile=true $short $EXTRA
    run $PY -m app command=train name=paths_graphs train.compile=true train.compile_mode=reduce-overhead $short $EXTRA
    if $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'; then  # a CPU would swap, not fail
        run $PY -m app command=train name=paths_oom train.batch_tokens=2000000 train.oom_retry=true \
            train.max_steps=3 train.eval_every=0 $EXTRA
        grep -q "train.batch_tokens halved" "$log" || { echo "!! no out-of-memory retry seen" | tee -a "$log"; status=1; }
    fi
    # SIGKILL after the first checkpoint, then resume: per-step losses against the uninterrupted paths_1
    rm -rf checkpoints/paths_killed
    $PY -m app command=train name=paths_killed model=transformer $short $EXTRA >>"$log" 2>&1 &
    pid=$!
    while kill -0 $pid 2>/dev/null && [ ! -f checkpoints/paths_killed/last.pt ]; do sleep 0.2; done
    kill -9 $pid; wait $pid
    run $PY -m app command=train name=paths_killed model=transformer $short train.resume=true $EXTRA
    run $PY - "$OUT/resume_losses.json" <<'PYEOF'
import json, re, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
def losses(run):
    events = EventAccumulator(f"checkpoints/{run}/tb", size_guidance={"scalars": 0}); events.Reload()
    return {e.step: e.value for e in events.Scalars("train/loss")}  # a resumed step's last value wins
full, resumed = losses("paths_1"), losses("paths_killed")
diff = [abs(full[s] - resumed[s]) for s in sorted(full) if s in resumed]
log = open("checkpoints/paths_killed/train.log").read()
out = {"resumed_at": re.findall(r"resumed from .* at step (\d+)", log), "steps_compared": len(diff),
       "max_abs_loss_diff": max(diff), "final_loss": [full[max(full)], resumed[max(resumed)]]}
json.dump(out, open(sys.argv[1], "w"), indent=2); print(out)
PYEOF
    ;;
transformer)
    train_eval_bench gpu_transformer "$PY -m torch.distributed.run --standalone --nproc_per_node=1 -m" \
        model=transformer train.batch_tokens=16000 train.lr=1e-3 train.warmup_steps=1000
    ;;
rnn)
    train_eval_bench gpu_rnn_bahdanau "$PY -m" model=rnn_bahdanau train.batch_tokens=8000 train.lr=1e-3 \
        train.warmup_steps=500
    ;;
bench)
    for preset in "model=transformer train.compile=true" "model=rnn_bahdanau train.compile=true" "model=rnn_luong" \
        "model=rnn_plain"; do
        name=bench_$(echo "$preset" | tr -c 'a-z0-9\n' '_' | sed 's/_*$//')
        run $PY -m app command=bench name=$name $preset bench.steps=$BENCH_STEPS bench.profile_steps=$PROFILE_STEPS $EXTRA
        cp "checkpoints/bench/$name.json" "checkpoints/bench/${name}_profile.txt" "$OUT/" || status=1
    done
    ;;
ablation)
    for preset in "model=transformer" "model=rnn_bahdanau"; do
        name=ablation_$(echo "$preset" | tr -c 'a-z0-9\n' '_' | sed 's/_*$//')
        run $PY -m app command=bench name=$name $preset bench.steps=$BENCH_STEPS bench.ablate=true bench.decode_sentences=50 $EXTRA
        cp "checkpoints/bench/$name.json" "checkpoints/bench/${name}_ablation.md" "$OUT/" || status=1
    done
    ;;
compare)
    sweep=checkpoints/compare_gpu
    run $PY -m app --multirun command=train model=${COMPARE_MODELS:-transformer} experiment=compare \
        hydra.sweep.dir=$sweep train.evaluate=true train.auto_resume=true ${COMPARE_ARGS:-train.max_minutes=4} $EXTRA
    run $PY -m app command=compare compare.dir=$sweep
    # one archive per run (files come back flat and plainly named): not the checkpoints, what the report reads
    for run_dir in "$sweep"/*/; do
        run=$(basename "$run_dir")
        [ -f "$sweep/$run/train_summary.json" ] || continue
        tar czf "$OUT/run_$(echo "$run" | tr -c 'A-Za-z0-9._\n-' '_').tar.gz" --exclude='*.png' --exclude='*.html' \
            --exclude='*.jsonl' -C "$sweep" "$run/train_summary.json" "$run/config.yaml" "$run/.hydra" \
            "$run/train.log" "$run/eval" || status=1
    done
    ;;
*)
    echo "usage: $0 paths|transformer|rnn|bench|ablation|compare"; exit 2 ;;
esac
exit $status
