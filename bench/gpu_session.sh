#!/usr/bin/env bash
# One device call for the GPU figures: the move bench, the control-plane overhead on a 2 GiB
# spill, and the 8B-shape multi-turn TTFT. Run through the `device` tool with `.whl` carried:
#   bash bench/gpu_session.sh      (writes JSON under $OUT)
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi -L
timeout 260 python3 bench/moves.py --reps 3 --latency-iters 100 --out "$OUT/moves.json" 2>&1 | tail -45
timeout 130 python3 bench/control.py --device cuda --spill-bytes 2GiB --moves 300 --sustained 3000 --repeat 1 \
  --engines real --out "$OUT/control.json" 2>&1 | tail -8
timeout 150 python3 bench/serve_model.py --gpu --ttft-only --out "$OUT/serve-ttft.json" 2>&1 | tail -8
ls -la "$OUT"
