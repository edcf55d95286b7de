#!/usr/bin/env bash
# Issue 63's GPU figures, each part one call to a lent H100 (carry .whl from `make gpu-wheels` and data/bible_es_en):
#   bash scripts/capture_h100.sh check   # the capture tests of the gpu tier (captured losses = eager ones step by
#                                        # step, a shape that cannot be recorded runs eagerly, SIGKILL + resume), then
#                                        # make bench eager (train.capture=false) against captured, one after the other
#   bash scripts/capture_h100.sh train   # the default make train for TRAIN_MINUTES (7) captured, then make eval;
#                                        # TRAIN_ARGS adds settings (TRAIN_ARGS=train.compile=true: compiled layers)
#   bash scripts/capture_h100.sh fused   # the capture tests with eager and with compiled kernels, then make bench
#                                        # captured against captured with train.compile=true (both profiled)
# Results in $OUT (default checkpoints/capture_h100): logs, junit XML, the bench JSONs, train_summary.json,
# validations, the test metrics; the last lines printed are a short table.
set -uo pipefail
part=${1:?usage: $0 check|train|fused}
OUT=${OUT:-checkpoints/capture_h100}
mkdir -p "$OUT"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
{ date -u +%FT%TZ; git rev-parse HEAD 2>/dev/null; nvidia-smi -L; python3 -c 'import torch; print(torch.__version__)'; } \
    >"$OUT/${part}_provenance.txt" 2>&1
status=0
gpu_tests() {  # gpu_tests NAME KEYWORDS: the gpu tier's tests matching KEYWORDS, their log and junit XML as NAME.*
    timeout --signal=INT --kill-after=15 "${TESTS_SECONDS:-240}" python3 -m pytest -v -m gpu tests/test_gpu.py \
        -k "$2" -p no:cacheprovider --tb=short -o junit_family=legacy \
        --junitxml="$OUT/$1.xml" >"$OUT/$1.log" 2>&1 || status=1
    grep -E "PASSED|FAILED|ERROR|passed|failed" "$OUT/$1.log" | tail -n 8
}
case $part in
check)
    gpu_tests capture_tests "captured or recorded or sigkill"
    for capture in false true; do
        timeout "${BENCH_SECONDS:-150}" python3 -m app command=bench name="bench_capture_$capture" \
            "train.capture=$capture" bench.steps="${BENCH_STEPS:-40}" bench.decode_sentences=20 \
            >"$OUT/bench_capture_$capture.log" 2>&1 || { status=1; tail -n 20 "$OUT/bench_capture_$capture.log"; }
        cp "checkpoints/bench/bench_capture_$capture.json" "$OUT/" || status=1
    done
    python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
keys = ("steps_per_s", "step_steps_per_s", "train_tgt_tokens_per_s", "mfu", "host_step_ms", "padding_ratio",
        "peak_memory_gib", "train_step_operators", "capture")
for capture in ("false", "true"):
    path = os.path.join(out, f"bench_capture_{capture}.json")
    if os.path.exists(path):
        row = json.load(open(path))
        print(f"capture={capture}:", {k: row.get(k) for k in keys})
EOF
    ;;
fused)
    gpu_tests fused_tests "captured or recorded"
    for compiled in false true; do
        name=bench_fused_compile_$compiled
        timeout "${BENCH_SECONDS:-200}" python3 -m app command=bench name=$name train.capture=true \
            train.compile=$compiled bench.steps="${BENCH_STEPS:-30}" bench.profile_steps=5 \
            bench.decode_sentences=5 >"$OUT/$name.log" 2>&1 || { status=1; tail -n 20 "$OUT/$name.log"; }
        cp checkpoints/bench/$name.json "$OUT/" || status=1
        cp checkpoints/bench/${name}_profile.txt "$OUT/" 2>/dev/null
    done
    grep -h "torch.compile:\|train.capture:" "$OUT"/bench_fused_*.log | cut -c1-300
    python3 - "$OUT" <<'EOF'
import json, os, sys
keys = ("steps_per_s", "step_steps_per_s", "train_tgt_tokens_per_s", "mfu", "host_step_ms", "peak_memory_gib")
for compiled in ("false", "true"):
    path = os.path.join(sys.argv[1], f"bench_fused_compile_{compiled}.json")
    if os.path.exists(path):
        row = json.load(open(path))
        print(f"compile={compiled}:", {k: row.get(k) for k in keys}, row.get("profile", {}).get("ms_per_step"))
EOF
    ;;
train)
    name=capture_train
    rm -rf "checkpoints/$name"
    # shellcheck disable=SC2086 # TRAIN_ARGS: settings, split at spaces
    timeout "${TRAIN_SECONDS:-500}" python3 -m app command=train name=$name train.max_minutes="${TRAIN_MINUTES:-7}" ${TRAIN_ARGS:-} \
        2>&1 | tee "$OUT/train.log" | grep -E "capture|shapes|training stopped|Error" | cut -c1-400 || status=1
    cp "checkpoints/$name/train_summary.json" "checkpoints/$name/validations.jsonl" "$OUT/" 2>/dev/null || status=1
    timeout "${EVAL_SECONDS:-90}" python3 -m app command=eval name=$name >"$OUT/eval.log" 2>&1 || status=1
    cp "checkpoints/$name/eval/test/metrics.json" "$OUT/test_metrics.json" || status=1
    python3 -c "
import json; s = json.load(open('$OUT/train_summary.json')); m = json.load(open('$OUT/test_metrics.json'))
print({k: s.get(k) for k in ('steps', 'train_minutes', 'tgt_tokens_per_s', 'best_dev_bleu', 'capture', 'peak_memory_gib')})
print({k: m.get(k) for k in ('bleu', 'chrf', 'ter', 'decoding')})" || status=1
    ;;
esac
exit $status
