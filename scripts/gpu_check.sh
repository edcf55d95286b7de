#!/usr/bin/env bash
# The GPU checks and figures the issues ask for, each part one call to a lent GPU machine (10-minute limit):
#   bash scripts/gpu_check.sh paths        # the first call: the gpu test tier (tests/test_gpu.py, test_decoding_gpu.py) in stages, each
#                                          # under `timeout` with its budget (below), PATHS_SECONDS (570) in all, the
#                                          # compiles last: families (bf16 training, greedy validation and beam-5
#                                          # eval with attention maps of every family), decoding (CUDA decodes the
#                                          # recorded float32 hypotheses), resume (SIGKILL after the first checkpoint,
#                                          # then resume: the saved step and per-step losses within a bf16 tolerance),
#                                          # capture (train.capture: captured losses = eager ones; eager fallback),
#                                          # torchrun (1 GPU, DDP over NCCL), oom (a real out-of-memory with
#                                          # oom_retry), compile (the Transformer with inductor, and with CUDA graphs
#                                          # over 4 batch shapes); after each stage $OUT/paths.json says {stage:
#                                          # {status, seconds, ...}}, and a stage cut by its timeout names the test
#                                          # it was in (timed_out_in)
#   bash scripts/gpu_check.sh compile      # the compile tests paths leaves out (rnn_bahdanau's, the Transformer's
#                                          # CUDA graphs over every shape), COMPILE_SECONDS (570) at most
#   bash scripts/gpu_check.sh tests        # the whole tier in one pytest call (pytest -m gpu, TESTS_SECONDS (570)
#                                          # at most; it needs more than one call): $OUT/tests.log, tests_all.xml, tests.json
#   bash scripts/gpu_check.sh transformer  # 1-GPU torchrun (DDP over NCCL) training, greedy and beam-5
#                                          # eval of the test set, make bench with the trained weights
#                                          # and its profile
#   bash scripts/gpu_check.sh rnn          # the same for rnn_bahdanau (one process)
#   bash scripts/gpu_check.sh bench        # make bench: compiled Transformer and Bahdanau, rnn_luong, rnn_plain
#   bash scripts/gpu_check.sh ablation     # bench.ablate=true for the Transformer and Bahdanau: training speed
#                                          # with each speed feature off in turn (the before/after table)
#   bash scripts/gpu_check.sh decoding     # on a compare run this machine trained: test-set eval greedy, beam 5,
#                                          # sampling (top-k 10, top-p 0.9, whole), a 2-run ensemble, make score:
#                                          # $OUT/decoding_<setting>_metrics.json (decode seconds), score's log
#   PLAN=docs/compare_h100 bash scripts/gpu_check.sh compare
#                                          # the next COMPARE_COUNT (1) runs of PLAN/plan.txt that have no record
#                                          # in PLAN/runs/ (so every call, in any session, takes the next ones)
#                                          # and end inside CALL_SECONDS (570) of the call's start,
#                                          # each trained and evaluated as make compare does and packed, as it
#                                          # ends, into $OUT/<name>.tar.gz: what the report reads (summary,
#                                          # validations.jsonl, metrics, hypotheses, settings, log, and
#                                          # provenance.json with the code's commit from CODE_COMMIT).
#                                          # Here: bash scripts/gpu_check.sh collect
# The machine has no internet: first, where there is, `make gpu-wheels` (the packages its image lacks,
# into .whl/; for paths and tests also pytest: GPU_WHEELS_EXTRA="pytest pluggy iniconfig pygments packaging"
# pinned as in .venv, where the image lacks it) and `make data`; carry .whl and data. Results go to $OUT
# (default checkpoints/gpu_check): <part>.log and JSON figures; for paths and tests <part>.json (each stage's
# status: passed, failed, timeout, skipped, with its seconds, test counts and the figures the tests record)
# and each stage's junit XML. GPU_CHECK_ARGS adds Hydra overrides to every command of the timed parts (a tiny
# model, to try the script on a CPU); the test tier sets its own small models, and without CUDA its tests
# skip, so paths and tests on a CPU check only the script.
set -uo pipefail
part=${1:?usage: $0 paths|compile|tests|transformer|rnn|bench|ablation|decoding|compare|collect}
OUT=${OUT:-checkpoints/gpu_check}
mkdir -p "$OUT"
if [ "$part" != collect ] && compgen -G ".whl/*.whl" >/dev/null; then  # the lent machine's missing packages
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 TQDM_DISABLE=1
PY=${PY:-python3}
EXTRA=${GPU_CHECK_ARGS:-}
TRAIN_MINUTES=${TRAIN_MINUTES:-3}
BENCH_STEPS=${BENCH_STEPS:-50}
PROFILE_STEPS=${PROFILE_STEPS:-5}  # profiled after the timed steps: where the time goes (app/bench/profiling.py)
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

gpu_tests_start() {  # before the first stage of paths/tests: pytest is there, and a fresh <part>.json
    rm -f "$OUT/$part.json" "$OUT/${part}"_*.xml
    $PY -c 'import pytest' 2>/dev/null || {
        echo "!! no pytest for $PY: make gpu-wheels GPU_WHEELS_EXTRA=\"pytest pluggy iniconfig pygments packaging\"" \
            "(pinned as in .venv) and carry .whl" | tee -a "$log"
        exit 1
    }
    cuda=$($PY -c 'import torch; print(int(torch.cuda.is_available()))')
}

GPU_TESTS=${GPU_TESTS:-"tests/test_gpu.py tests/test_decoding_gpu.py"}  # the gpu tier

gpu_tests() {  # STAGE SECONDS K: the gpu tier's tests matching `pytest -k K` (all for ""), at most SECONDS and
    # never past $deadline (seconds since the script started); junit XML in $OUT/<part>_<stage>.xml, its
    # output in $OUT/<part>_<stage>.log (verbose: each test named as it starts), the stage's result added to
    # $OUT/<part>.json. On SIGINT from timeout, pytest and the training runs it started stop (a run saves
    # first); what passed is in the XML, and the test cut short, the last one the log names without a result.
    local stage=$1 budget=$2 select=$3 left rc start xml=$OUT/${part}_$1.xml stage_log=$OUT/${part}_$1.log
    left=$((deadline - SECONDS - 25))  # 25 s: timeout's --kill-after and the JSON
    ((budget > left)) && budget=$left
    start=$SECONDS
    : >"$stage_log"
    if ((budget < 30)); then
        echo "!! $stage: no time left ($deadline s in all)" | tee -a "$log"
        rc=-1
    else
        echo "== $stage: pytest -m gpu $GPU_TESTS${select:+ -k '$select'} (at most $budget s)" | tee -a "$log"
        timeout --signal=INT --kill-after=20 "$budget" $PY -m pytest -v -m gpu $GPU_TESTS ${select:+-k "$select"} \
            -p no:cacheprovider --tb=short -o junit_family=legacy --junitxml="$xml" >"$stage_log" 2>&1
        rc=$?
        cat "$stage_log" >>"$log"
        tail -n 8 "$stage_log" | grep -v '^\s*$'
    fi
    $PY - "$OUT/$part.json" "$stage" "$rc" $((SECONDS - start)) "$budget" "$xml" "$cuda" "$stage_log" <<'PYEOF' || status=1
import json, os, re, sys
import xml.etree.ElementTree as ET

path, stage, rc, seconds, budget, xml, cuda, stage_log = sys.argv[1:]
rc = int(rc)
entry = {"seconds": int(seconds), "budget_s": max(int(budget), 0)}
tests = failed = skipped = 0
reasons, figures = set(), {}
if rc != -1 and os.path.exists(xml):
    for case in ET.parse(xml).getroot().iter("testcase"):
        tests += 1
        if case.find("failure") is not None or case.find("error") is not None:
            failed += 1
        elif case.find("skipped") is not None:
            skipped += 1
            reasons.add(case.find("skipped").get("message", ""))
        props = {}
        for prop in case.iter("property"):
            try:
                props[prop.get("name")] = json.loads(prop.get("value"))
            except ValueError:
                props[prop.get("name")] = prop.get("value")
        if props:
            figures[case.get("name")] = props
if rc == -1:
    entry["status"] = "skipped"
    reasons.add("no time left")
elif rc in (124, 137):
    entry["status"] = "timeout"
    # pytest -v writes a test's id when it starts and its result on the same line when it ends
    started = re.findall(r"^(tests/\S+::\S+)(.*)$", open(stage_log, errors="replace").read(), re.M)
    unfinished = [test for test, rest in started if not re.search(r"PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS", rest)]
    entry["timed_out_in"] = unfinished[-1] if unfinished else "(no test had started: collection or start-up)"
elif rc or failed or not tests:  # pytest exits 5 when no test matched: a failure here
    entry["status"] = "failed"
else:
    entry["status"] = "skipped" if skipped == tests else "passed"
entry.update(tests=tests, failed=failed, skipped=skipped)
if reasons:
    entry["skip_reasons"] = sorted(reasons)
if figures:
    entry["figures"] = figures
results = json.load(open(path)) if os.path.exists(path) else {}
results[stage] = entry
with open(path + ".tmp", "w") as f:
    json.dump(results, f, indent=2)
os.replace(path + ".tmp", path)
where = f", in {entry['timed_out_in']}" if "timed_out_in" in entry else ""
print(f"{stage}: {entry['status']} in {entry['seconds']} s{where} ({tests} tests, {failed} failed, {skipped} skipped)")
# a skip is a failure where there is a GPU (the tests could not run); on a CPU it is the expected outcome
sys.exit(0 if entry["status"] == "passed" or (entry["status"] == "skipped" and cuda == "0") else 1)
PYEOF
}

nvidia-smi -L 2>/dev/null || echo "no nvidia-smi: running on the CPU"
$PY -c 'import importlib.metadata as m, torch
print("cuda:", torch.cuda.is_available(), {p: m.version(p) for p in
      ("torch", "pyarrow", "datasets", "huggingface-hub", "fsspec", "hydra-core", "sentencepiece", "sacrebleu")})' \
    >>"$log" 2>&1 || {  # a machine without the packages: said in the log and on the output (a call that came back
    # with an empty log and no reason, 2026-11-26, had not carried .whl)
    echo "!! $PY lacks a package the checks need (above): make gpu-wheels here, then carry .whl" | tee -a "$log"
    exit 1
}
tail -n 1 "$log"

case $part in
paths)  # every stage bounded, the slowest last: a stage cut by its timeout still leaves the others' results.
    # Budgets (s), each with its pytest start-up (~10 s), from the H100 of 2026-11-25 (docs/benchmarking.md):
    #   families  105  7 families (6 and rnn_bahdanau with coverage since 2026-11-28), each trained and evaluated in
    #                  the one pytest process (90 s was the budget for 6; was 6 × 45 s, 2 CLI calls each)
    #   decoding   35  5 models decoded on the GPU, a few seconds each (the 8 tests it replaces took 21 s)
    #   resume     90  took 80 s: an uninterrupted run, a run killed with SIGKILL, its resumption (3 CLI calls)
    #   capture    75  train.capture: captured against eager losses (2 CLI runs), a shape that cannot be recorded
    #                  (2 runs in the pytest process); 2026-11-27: 79 s together with resume's test; since 2026-11-28
    #                  a third CLI run, train.freeze under capture (30 steps, not yet timed on a GPU)
    #   torchrun   50  took 41 s
    #   oom        40  one CLI call; its corpus of ~150 k words tokenizes in seconds (3 M words: > 220 s)
    #   compile   230  a compile test took 80-100 s (three graphs built): two of them
    #            ----
    #             625  of PATHS_SECONDS=570: compile, last, gets what is left (the deadline), about 170 s
    gpu_tests_start
    deadline=${PATHS_SECONDS:-570}
    gpu_tests families 105 "test_family"
    gpu_tests decoding 35 "test_decoding_gpu"
    gpu_tests resume 90 "test_sigkill"
    gpu_tests capture 75 "test_captured or test_an_update_that_cannot"
    gpu_tests torchrun 50 "test_torchrun"
    gpu_tests oom 40 "test_oom"
    gpu_tests compile 230 "test_compile and transformer and (inductor or 4_shapes)"
    ;;
compile)
    gpu_tests_start
    deadline=${COMPILE_SECONDS:-570}
    gpu_tests compile 570 "test_compile and not (transformer and (inductor or 4_shapes))"
    ;;
tests)
    gpu_tests_start
    deadline=${TESTS_SECONDS:-570}
    gpu_tests all 600 ""
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
    plan=${PLAN:?PLAN=<a folder with plan.txt>, e.g. PLAN=docs/compare_h100}
    [ -f "$plan/plan.txt" ] || { echo "!! $plan/plan.txt: no such file" | tee -a "$log"; exit 2; }
    common='' left=${COMPARE_COUNT:-1} pending=0
    # a run is started only if its budget and the start-up and evaluation around it end before the call's
    # limit: a run cut there comes back with nothing. 45 s until a run of this call has measured them: on the
    # H100 (2026-11-26) a 4-minute rnn_bahdanau run took about 25 s more, a 2-minute Transformer about 20 s
    call_seconds=${CALL_SECONDS:-570} overhead=45
    # plan.txt: "common <overrides>" for every run, then "<name> <overrides>" a run; fd 3, so that the
    # commands do not read the plan as their input
    while read -r -u 3 name overrides; do
        case $name in '' | '#'*) continue ;; common) common=$overrides; continue ;; esac
        [ -f "$plan/runs/$name/eval/test/metrics.json" ] && continue
        pending=$((pending + 1)) record=checkpoints/gpu_records/$name
        # a warm machine keeps checkpoints/ between calls: a run this plan already packed there at this
        # commit (a call made before its records were collected) comes back again instead of training again
        if [ -f "$record/provenance.json" ] && $PY - "$record/provenance.json" "$plan" "${CODE_COMMIT:-unknown}" <<'PYEOF'
import json, sys

path, plan, commit = sys.argv[1:]
made = json.load(open(path))
sys.exit(0 if (made["plan"], made["commit"]) == (plan, commit) and commit != "unknown" else 1)
PYEOF
        then
            tar czf "$OUT/$name.tar.gz" -C checkpoints/gpu_records "$name" &&
                echo "packed $OUT/$name.tar.gz again: this machine trained it in an earlier call" | tee -a "$log" ||
                status=1
            continue
        fi
        budget=$(echo "$common $overrides $EXTRA" | grep -o 'train\.max_minutes=[0-9.]*' | tail -n 1 | cut -d= -f2)
        budget=$(awk -v m="${budget:-10}" 'BEGIN { printf "%d", m * 60 }')  # experiment=compare: 10 minutes
        if ((left > 0 && SECONDS + budget + overhead > call_seconds)); then
            echo "$name would need about $((budget + overhead)) s; $((call_seconds - SECONDS)) s of" \
                "CALL_SECONDS=$call_seconds are left" | tee -a "$log"
            left=0
        fi
        if ((left == 0)); then echo "left in $plan: $name" | tee -a "$log"; continue; fi
        left=$((left - 1)) started=$SECONDS
        sweep=checkpoints/gpu_sweeps/$name
        rm -rf "$sweep"
        # shellcheck disable=SC2086  # the overrides are words
        run $PY -m app --multirun command=train experiment=compare hydra.sweep.dir=$sweep train.evaluate=true \
            $common $overrides $EXTRA
        overhead=$((SECONDS - started - budget > 30 ? SECONDS - started - budget : 30))
        metrics=$(compgen -G "$sweep/*/eval/test/metrics.json" | head -n 1)
        run_dir=${metrics%/eval/test/metrics.json}
        if [ -z "$metrics" ] || [ ! -f "$run_dir/train_summary.json" ]; then
            echo "!! $name: no evaluated run in $sweep" | tee -a "$log"; status=1; continue
        fi
        $PY - "$run_dir/provenance.json" "$plan" "$name" "${CODE_COMMIT:-unknown}" <<'PYEOF' || status=1
import datetime, json, sys

path, plan, name, commit = sys.argv[1:]
finished = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
json.dump({"plan": plan, "name": name, "commit": commit, "finished": finished}, open(path, "w"), indent=2)
PYEOF
        # the record, under the plan's name for the run: not the checkpoints, not the attention files
        rm -rf "$record" && mkdir -p "$record/eval/test"
        # validations.jsonl where the run validated (a plan's run with train.eval_every=0 has none)
        cp -r "$run_dir"/{train_summary.json,config.yaml,.hydra,train.log,provenance.json} "$record/" &&
            { [ ! -e "$run_dir/validations.jsonl" ] || cp "$run_dir/validations.jsonl" "$record/"; } &&
            cp "$run_dir"/eval/test/{metrics.json,hyp.txt} "$record/eval/test/" &&
            tar czf "$OUT/$name.tar.gz" -C checkpoints/gpu_records "$name" &&
            echo "packed $OUT/$name.tar.gz" | tee -a "$log" || status=1
    done 3<"$plan/plan.txt"
    ((pending == 0)) && echo "every run of $plan/plan.txt has its record in $plan/runs" | tee -a "$log"
    ;;
decoding)  # what decoding settings cost on the GPU, on a trained run: RUN=<run folder> (default: the first
    # compare run this machine trained), OTHER=<another run's best.pt> for the ensemble (default: the second)
    runs=$(compgen -G "checkpoints/gpu_sweeps/*/*/best.pt" | sort)
    RUN=${RUN:-$(dirname "$(echo "$runs" | sed -n 1p)")} OTHER=${OTHER:-$(echo "$runs" | sed -n 2p)}
    [ -f "$RUN/best.pt" ] || { echo "!! RUN=$RUN: no best.pt (train a compare run first)" | tee -a "$log"; exit 2; }
    echo "run: $RUN; ensemble member: ${OTHER:-none}" | tee -a "$log"
    for setting in "greedy decode.beam_size=1" "beam5 decode.beam_size=5" \
        "topk10 decode.beam_size=1 decode.sampling=true decode.sampling_topk=10" \
        "topp09 decode.beam_size=1 decode.sampling=true decode.sampling_topp=0.9" \
        "whole decode.beam_size=1 decode.sampling=true" ${OTHER:+"ensemble5 decode.beam_size=5 ensemble=['$OTHER']"}; do
        read -r tag overrides <<<"$setting"
        # shellcheck disable=SC2086  # the overrides are words
        # quoted for Hydra: a sweep's run folder is named by its overrides (= and , in it)
        run $PY -m app command=eval "run_dir='$RUN'" $overrides $EXTRA
        cp "$RUN/eval/test/metrics.json" "$OUT/decoding_${tag}_metrics.json" || status=1
    done
    run $PY -m app command=score "run_dir='$RUN'" score.split=test score.output=$OUT/decoding_score_test.tsv $EXTRA
    ;;
collect)  # here, after the calls: PLAN=<folder> FROM=<the calls' files_at> unpacks each record into
    # PLAN/runs/ and writes PLAN/compare.md and its figures over every record there
    plan=${PLAN:?PLAN=<a folder with plan.txt>} from=${FROM:?FROM=<the folder holding the <name>.tar.gz of the calls>}
    mkdir -p "$plan/runs"
    for archive in "$from"/*.tar.gz; do
        [ -e "$archive" ] || { echo "!! no .tar.gz in $from" | tee -a "$log"; exit 1; }
        name=$(basename "$archive" .tar.gz)
        rm -rf "${plan:?}/runs/$name"
        run tar xzf "$archive" -C "$plan/runs"
    done
    # the significance tests take the plan's first run that has a record as their baseline
    baseline=$(awk '$1 != "" && $1 !~ /^#/ && $1 != "common" { print $1 }' "$plan/plan.txt" |
        while read -r name; do [ -d "$plan/runs/$name" ] && { echo "$name"; break; }; done)
    run $PY -m app command=compare compare.dir="$plan/runs" compare.out="$plan" ${baseline:+compare.baseline=$baseline}
    ;;
*)
    echo "usage: $0 paths|compile|tests|transformer|rnn|bench|ablation|decoding|compare|collect"; exit 2 ;;
esac
exit $status
