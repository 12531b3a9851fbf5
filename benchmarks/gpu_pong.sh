#!/usr/bin/env bash
# Pong runs on a lent GPU machine, in one call: every LABEL=SUITE pair given runs at the same time (`learn.py --jobs 1`
# each, seed 1, cut at SECONDS), then each run directory comes back as one tarball in $OUT without its checkpoints
# (over the device tool's file limit). Example, from the repository root on the GPU machine:
#   bash benchmarks/gpu_pong.sh 500 cleanba_ppo=atari-smoke cleanba_ppo_32envs=pong-gpu
set -uo pipefail
seconds=$1
shift
out=${OUT:-/tmp/gpu_pong_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L || true
python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.cuda.is_available())'
pids=()
for pair in "$@"; do
    label=${pair%%=*}
    suite=${pair#*=}
    python3 benchmarks/learn.py --suite "$suite" --only "$label" --seeds 1 --jobs 1 --time-limit "$seconds" \
        --out "/tmp/gpu_pong/$label" >"$out/learn_$label.log" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
for pair in "$@"; do
    label=${pair%%=*}
    tar czf "$out/$label.tgz" --exclude='checkpoint*' -C /tmp/gpu_pong "$label"
    tail -3 "$out/learn_$label.log"
    grep -h "finished\|stopped" /tmp/gpu_pong/"$label"/logs/*.log | tail -2
done
ls -la "$out"
