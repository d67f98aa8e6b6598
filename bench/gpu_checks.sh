#!/usr/bin/env bash
# The CUDA path's checks and timings in one call, for a machine with a GPU (docs/benchmarks.md, "on a GPU"),
# short enough to run twice in a lent machine's 15 minutes (about 5 on a 16-core H200 host):
#   1. tests/shardflow/training/test_gpu.py (CUDA against the CPU: the engine over both transports, and the
#      reference trainer);
#   2. `shardflow train --epochs 1` of the bundled log on 2 devices: the mean encoder with --device cuda then
#      cpu (the same loss and metrics), the self-attention encoder with --device cuda; each one's examples/s;
#   3. bench/train_throughput.py --device cuda, both encoders (3 rounds of 10 steps): the engine on 1 and 2
#      devices (2 devices share the one GPU, their messages over gloo through the host) beside one PyTorch
#      process on that GPU.
# Every command has its own time limit (LIMIT_S seconds, default 240), so one that hangs costs no more.
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
limit=${LIMIT_S:-240}
sf() { timeout "$limit" "$py" -m cli.main "$@"; }
started=$SECONDS
"$py" -c 'import torch; print(torch.__version__, torch.cuda.get_device_name(0))' | tee "$out/env.log"
timeout "$limit" "$py" -m pytest -q -p no:cacheprovider tests/shardflow/training/test_gpu.py 2>&1 | tail -3 \
    | tee "$out/test_gpu.log"
work=$(mktemp -d -t shardflow-gpu-data-XXXXXX)
trap 'rm -rf "$work"' EXIT
printf 'intra_node_gbytes_per_s: 600\nnodes:\n  - {name: a, devices: 2, uplink_gbytes_per_s: 12.5}\n' > "$work/two.yaml"
sf import --format sasrec data/amazon-video/Video.txt "$work/ds" > /dev/null
sf profile "$work/ds" --out "$work/profile" --workers 2 > /dev/null
sf plan "$work/profile" --topology "$work/two.yaml" --strategy flexshard --out "$work/plan" > /dev/null
for run in "mean cuda" "mean cpu" "self-attention cuda"; do
    set -- $run
    echo "== shardflow train, $1, $2 ($((SECONDS - started)) s in)" | tee -a "$out/train.log"
    sf train "$work/ds" --plan "$work/plan" --epochs 1 --device "$2" --encoder "$1" 2>/dev/null \
        | head -2 | tee -a "$out/train.log"
done
for encoder in mean self-attention; do
    log="$out/throughput-$encoder-cuda.log"
    timeout "$limit" "$py" bench/train_throughput.py --rounds 3 --steps 10 --device cuda --encoder "$encoder" \
        > "$log" 2>&1
    echo "== bench/train_throughput.py, $encoder, cuda (exit $?, $((SECONDS - started)) s in)"
    sed -n '/^load average/,$p' "$log" | grep -v '^torchrec'
done
echo "logs: $out"
