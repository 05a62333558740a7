#!/usr/bin/env bash
# One GPU, about ten minutes: measure one training configuration of small-gpt, of a
# GPT of about 0.9B parameters and of a Llama-style model of 1.24B (Llama 3.2 1B's
# sizes) under FSDP2 on it (TP 1 · PP 1 · DP 1, 4 micro-batches of 2, median of 10 steps
# after 3 of warm-up; each run's peak reserved memory), calibrate the device
# (`clustersim calibrate --quick`, FP8 GEMMs where it has them, then `clustersim
# host-cost`: eager PyTorch's host time per kernel), time a GEMM and causal attention in a
# burst and then sustained for 50 s each (`python -m calibration.microbench.sustained`:
# does a training-like load run them slower than short timings say?) and simulate the
# runs from the new profile and from the GPU's datasheet preset: step, compute and peak
# reserved memory. Everything lands in OUT_DIR: gpu.txt (the device), stages.txt (each
# stage's status and seconds), one log per stage, profile.yaml, sustained.json, per model
# measured.json, scenario.yaml and compare-*.txt (`clustersim compare`), and summary.md,
# the table to commit under docs/validation/ (its last line: the sustained/burst ratios).
#
#   bash benchmarks/gpu_validation.sh OUT_DIR            # on the GPU machine
#   bash benchmarks/gpu_validation.sh OUT_DIR cpu tiny   # the same steps, CPU, seconds
#
# The measured runs go first (the device time they need is short and they are what a
# later session cannot redo without a GPU), then calibration, then the sustained load
# (about two minutes; after the others, so that neither its time nor its heat touches
# their measurements); the profile and the comparisons can be redone anywhere from what
# this leaves. Each stage has its own time limit and a failed stage does not stop the
# rest. With GV_ARCHIVE=FILE.tgz set, OUT_DIR is packed into FILE after every stage, so
# what finished comes back even if the machine's limit cuts the run.
#
# It runs from a source checkout without installing it (PYTHONPATH); simpy and pydantic
# must be importable (benchmarks/README.md says how to carry them as wheels).
set -uo pipefail
out=${1:?usage: gpu_validation.sh OUT_DIR [cuda|cpu] [full|tiny]}
device=${2:-cuda}
size=${3:-full}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out"
out=$(cd "$out" && pwd)
sim=("$py" -m simulator.cli)  # an array, so that timeout can run it

pack() {  # OUT_DIR as it stands into $GV_ARCHIVE, atomically
    [ -n "${GV_ARCHIVE:-}" ] || return 0
    tar czf "$GV_ARCHIVE.tmp" -C "$(dirname "$out")" "$(basename "$out")" \
        && mv "$GV_ARCHIVE.tmp" "$GV_ARCHIVE"
}

# stage NAME SECONDS CMD...: run CMD under a time limit, its output in NAME.log;
# stages.txt records ok or the exit status, and the seconds taken.
stage() {
    local name=$1 limit=$2 began status
    shift 2
    began=$(date +%s)
    echo "== $name (limit ${limit} s)"
    if timeout --kill-after=15 "$limit" "$@" > "$out/$name.log" 2>&1; then
        status=ok
    else
        status="failed (exit $?)"
    fi
    echo "$name: $status, $(( $(date +%s) - began )) s" | tee -a "$out/stages.txt"
    tail -n 12 "$out/$name.log"
    pack
    [ "$status" = ok ]
}

"$py" - "$device" > "$out/gpu.txt" 2>&1 <<'EOF'
import sys, torch
dev = sys.argv[1]
print(torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch", torch.__version__)
EOF
echo "device: $(cat "$out/gpu.txt")"
if [ "$device" = cuda ]; then
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm \
        --format=csv >> "$out/gpu.txt" 2>&1 || true
fi

if [ "$size" = tiny ]; then
    calib=--tiny steps=(--steps 3 --warmup 1) limits=(120 240)
    models=("tiny-gpt::--model tiny-gpt" "tiny-gpt-wide::--model tiny-gpt --hidden 256 --heads 4"
            "tiny-llama-fsdp2::--model tiny-llama --zero 3")
else
    calib=--quick steps=(--steps 10 --warmup 3) limits=(120 280)
    # ~0.9B: 12 L h^2 = 805M in the layers, 103M in the (tied) embedding; at micro-batches
    # of 2 the step is mostly the host's, at 8 mostly the GPU's
    gpt09b="--model small-gpt --layers 16 --hidden 2048 --heads 16 --seq-len 1024 --vocab 50304"
    models=("small-gpt::--model small-gpt" "gpt-0.9b::$gpt09b"
            "gpt-0.9b-b8::$gpt09b --micro-batch-size 8"
            "llama-1b-fsdp2::--model llama-1b --zero 3")
fi

for entry in "${models[@]}"; do
    name=${entry%%::*}
    # shellcheck disable=SC2086  # the model's flags are words on purpose
    stage "measure-$name" "${limits[0]}" "${sim[@]}" measure --tp 1 --pp 1 --dp 1 \
        --schedule 1f1b --device "$device" "${steps[@]}" ${entry#*::} --out "$out/$name"
done

stage calibrate "${limits[1]}" "${sim[@]}" calibrate --device "$device" $calib \
    --out "$out/profile.yaml" --timeout 240 \
    && stage host-cost 120 "${sim[@]}" host-cost "$out/profile.yaml" --device "$device"
# last on the device, so that it never takes the runs' or the calibration's time: a GEMM and
# causal attention timed in a 10 ms burst after 1 s idle, then back to back (50 s each)
if [ "$size" = tiny ]; then sustain=(--seconds 2 --idle 0.1) sustain_limit=60
else sustain=(--seconds 50) sustain_limit=150; fi
stage sustained "$sustain_limit" "$py" -m calibration.microbench.sustained --device "$device" \
    "${sustain[@]}" --out "$out/sustained.json"
sheet=$("$py" -c "
import sys
from simulator.system.devices import preset_for as datasheet_preset
print(datasheet_preset(sys.argv[1]) or 'cpu-1thread')" "$(head -1 "$out/gpu.txt")")

{
    echo "# One $(head -1 "$out/gpu.txt"): measured versus simulated, $(date -u +%F)"
    echo
    echo "\`bash benchmarks/gpu_validation.sh\` ($size): per model TP 1 · PP 1 · DP 1,"
    echo "4 micro-batches, ${steps[*]}; simulated from \`clustersim calibrate $calib\`"
    echo "on the same device and from the datasheet preset \`$sheet\`. Compute is the"
    echo "forward and backward kernels' busy time (measured: one profiled step)."
    echo
    echo "| model | micro-batch | profile | measured step ms | simulated step ms | step error | measured compute ms | simulated compute ms | compute error | measured peak reserved GB | simulated GB | memory error |"
    echo "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"
} > "$out/summary.md"

for entry in "${models[@]}"; do
    name=${entry%%::*}
    [ -f "$out/$name/measured.json" ] || { echo "| $name | | (not measured) | | | | | | | | | |" \
        >> "$out/summary.md"; continue; }
    for prof in "$out/profile.yaml" "$sheet"; do
        label=$([ "$prof" = "$sheet" ] && echo "$sheet" || echo calibrated)
        [ "$label" = calibrated ] && [ ! -f "$prof" ] && continue
        stage "compare-$name-$label" 120 "${sim[@]}" compare "$out/$name" --profile "$prof" --no-plot \
            || continue
        cp "$out/compare-$name-$label.log" "$out/$name/compare-$label.txt"
        "$py" - "$out/$name/comparison.json" "$name" "$label" >> "$out/summary.md" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m, s, e = d["measured"], d["simulated"], d["relative_error"]
b = d["scenario"]["training"]["micro_batch"]
print(f"| {sys.argv[2]} | {b} | {sys.argv[3]} | {m['step_time_s'] * 1e3:.1f} "
      f"| {s['step_time_s'] * 1e3:.1f} | {e['step_time_s']:+.1%} | {m['compute_s'] * 1e3:.1f} "
      f"| {s['compute_s'] * 1e3:.1f} | {e['compute_s']:+.1%} "
      f"| {m['peak_reserved_bytes'] / 1e9 or 'n/a':.4} | {s['peak_reserved_bytes'] / 1e9:.2f} "
      f"| {'n/a' if e['peak_reserved_bytes'] is None else format(e['peak_reserved_bytes'], '+.1%')} |")
EOF
    done
done
"$py" - "$out/profile.yaml" >> "$out/summary.md" <<'EOF'
import sys, yaml
from pathlib import Path
p = Path(sys.argv[1])
gpu = yaml.safe_load(p.read_text())["gpu"] if p.exists() else {}
print(f"\nCalibrated per-kernel terms: device overhead {gpu.get('kernel_overhead_us')} us, "
      f"eager host {gpu.get('host_overhead_us')} us (optimizer {gpu.get('host_optimizer_us')} "
      "us); the datasheet preset has the stack's host figure.")
EOF
"$py" - "$out/sustained.json" >> "$out/summary.md" <<'EOF'
import json, sys
from pathlib import Path
from calibration.microbench.sustained import describe
p = Path(sys.argv[1])
print("\n" + (describe(json.loads(p.read_text())) if p.exists()
              else "Sustained load: not measured (sustained.log says why)."))
EOF
pack
cat "$out/stages.txt" "$out/summary.md"
