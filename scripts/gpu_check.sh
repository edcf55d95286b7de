#!/usr/bin/env bash
# The GPU figures the issues ask for, each part one call to a lent GPU machine (10-minute limit):
#   bash scripts/gpu_check.sh transformer  # 1-GPU torchrun (DDP over NCCL) training, greedy and beam-5
#                                          # eval of the test set, make bench with the trained weights
#                                          # and its profile
#   bash scripts/gpu_check.sh rnn          # the same for rnn_bahdanau (one process)
#   bash scripts/gpu_check.sh bench        # make bench: compiled Transformer and Bahdanau, rnn_luong, rnn_plain
#   bash scripts/gpu_check.sh ablation     # bench.ablate=true for the Transformer and Bahdanau: training speed
#                                          # with each speed feature off in turn (the before/after table)
# The machine has no internet: first, where there is, `make gpu-wheels` (the packages its image lacks,
# into .whl/) and `make data`; carry .whl and data. Results go to $OUT (default checkpoints/gpu_check):
# <part>.log and one JSON per figure. GPU_CHECK_ARGS adds Hydra overrides to every command (a tiny
# model, to try the script on a CPU).
set -uo pipefail
part=${1:?usage: $0 transformer|rnn|bench|ablation}
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
*)
    echo "usage: $0 transformer|rnn|bench|ablation"; exit 2 ;;
esac
exit $status
