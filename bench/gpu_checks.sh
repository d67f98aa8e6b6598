#!/usr/bin/env bash
# The CUDA path's checks and timings in one call, for a machine with a GPU (docs/benchmarks.md, "on a GPU"):
#   1. tests/shardflow/training/test_gpu.py (CUDA against the CPU, engine and reference trainer);
#   2. `shardflow train --epochs 1` of the bundled log on 2 devices, --device cuda then cpu, both encoders:
#      the same loss and metrics, and each one's examples/s;
#   3. bench/train_throughput.py --device cuda then cpu, both encoders (3 rounds of 10 steps).
# Logs go to OUT (default: a new temporary directory); the tables are printed at the end.
#
#     bash bench/gpu_checks.sh [OUT]
#
# PYTHON names the interpreter (default: .venv/bin/python, else python3); the repository root must be importable
# by it (an editable install, or PYTHONPATH).
set -u
cd "$(dirname "$0")/.."
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}
out=${1:-$(mktemp -d -t shardflow-gpu-XXXXXX)}
mkdir -p "$out"
if ! "$py" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' 2>/dev/null; then
    echo "gpu_checks: no CUDA device is visible to PyTorch ($py); accepted: a machine with a GPU" >&2
    exit 2
fi
sf() { "$py" -m cli.main "$@"; }
"$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/env.log"
"$py" -m pytest -q -p no:cacheprovider tests/shardflow/training/test_gpu.py 2>&1 | tail -3 | tee "$out/test_gpu.log"
work=$(mktemp -d -t shardflow-gpu-data-XXXXXX)
trap 'rm -rf "$work"' EXIT
printf 'intra_node_gbytes_per_s: 600\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 12.5}\n' > "$work/two.yaml"
sf import --format sasrec data/amazon-video/Video.txt "$work/ds" > /dev/null
sf profile "$work/ds" --out "$work/profile" --workers 2 > /dev/null
sf plan "$work/profile" --topology "$work/two.yaml" --strategy flexshard --out "$work/plan" > /dev/null
for encoder in mean self-attention; do
    for device in cuda cpu; do
        echo "== shardflow train, $encoder, $device" | tee -a "$out/train.log"
        sf train "$work/ds" --plan "$work/plan" --epochs 1 --device "$device" --encoder "$encoder" 2>/dev/null \
            | head -2 | tee -a "$out/train.log"
    done
done
for encoder in self-attention mean; do
    for device in cuda cpu; do
        log="$out/throughput-$encoder-$device.log"
        "$py" bench/train_throughput.py --rounds 3 --steps 10 --device "$device" --encoder "$encoder" > "$log" 2>&1
        echo "== bench/train_throughput.py, $encoder, $device (exit $?)"
        sed -n '/^load average/,$p' "$log" | grep -v '^torchrec'
    done
done
echo "logs: $out"
