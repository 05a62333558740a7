#!/usr/bin/env bash
# One GPU, about ten minutes: calibrate it (`clustersim calibrate --quick`), measure one
# training configuration of small-gpt and of a GPT of about 0.9B parameters on it
# (TP 1 · PP 1 · DP 1, 4 micro-batches of 2, median of 10 steps after 3 of warm-up),
# and simulate both from the new profile. Everything lands in OUT_DIR: profile.yaml,
# gpu.txt (the device's name), per model measured.json, scenario.yaml and compare.txt
# (`clustersim compare`), and summary.md, the table to commit under docs/validation/.
#
#   bash benchmarks/gpu_validation.sh OUT_DIR            # on the GPU machine
#   bash benchmarks/gpu_validation.sh OUT_DIR cpu tiny   # the same steps, CPU, seconds
#
# It runs from a source checkout without installing it (PYTHONPATH); simpy and pydantic
# must be importable (benchmarks/README.md says how to carry them as wheels).
set -euo pipefail
out=${1:?usage: gpu_validation.sh OUT_DIR [cuda|cpu] [full|tiny]}
device=${2:-cuda}
size=${3:-full}
root=$(cd "$(dirname "$0")/.." && pwd)
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
mkdir -p "$out"
sim() { "$py" -m simulator.cli "$@"; }

"$py" - "$device" > "$out/gpu.txt" <<'EOF'
import sys, torch
dev = sys.argv[1]
print(torch.cuda.get_device_name(0) if dev == "cuda" else "cpu", "torch", torch.__version__)
EOF
echo "device: $(cat "$out/gpu.txt")"

if [ "$size" = tiny ]; then
    calib=--tiny steps=(--steps 3 --warmup 1)
    models=("tiny-gpt::--model tiny-gpt" "tiny-gpt-wide::--model tiny-gpt --hidden 256 --heads 4")
else
    calib=--quick steps=(--steps 10 --warmup 3)
    # ~0.9B: 12 L h^2 = 805M in the layers, 103M in the (tied) embedding
    models=("small-gpt::--model small-gpt"
            "gpt-0.9b::--model small-gpt --layers 16 --hidden 2048 --heads 16 --seq-len 1024 --vocab 50304")
fi

sim calibrate --device "$device" $calib --out "$out/profile.yaml" --timeout 300

{
    echo "# One $(cut -d' ' -f1- "$out/gpu.txt"): measured versus simulated, $(date -u +%F)"
    echo
    echo "\`bash benchmarks/gpu_validation.sh\` ($size): \`clustersim calibrate $calib\`, then per"
    echo "model TP 1 · PP 1 · DP 1, 4 micro-batches of 2, ${steps[*]}."
    echo
    echo "| model | measured step ms | simulated step ms | step error | compute error |"
    echo "| --- | ---: | ---: | ---: | ---: |"
} > "$out/summary.md"

for entry in "${models[@]}"; do
    name=${entry%%::*}
    # shellcheck disable=SC2086  # the model's flags are words on purpose
    sim measure --tp 1 --pp 1 --dp 1 --schedule 1f1b --device "$device" "${steps[@]}" \
        ${entry#*::} --out "$out/$name"
    sim compare "$out/$name" --profile "$out/profile.yaml" --no-plot | tee "$out/$name/compare.txt"
    "$py" - "$out/$name/comparison.json" "$name" >> "$out/summary.md" <<'EOF'
import json, sys
d = json.load(open(sys.argv[1]))
m, s, e = d["measured"], d["simulated"], d["relative_error"]
print(f"| {sys.argv[2]} | {m['step_time_s'] * 1e3:.1f} | {s['step_time_s'] * 1e3:.1f} "
      f"| {e['step_time_s']:+.1%} | {e['compute_s']:+.1%} |")
EOF
done
cat "$out/summary.md"
