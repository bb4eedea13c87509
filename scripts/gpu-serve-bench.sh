#!/bin/bash
# The engine's HTTP server on an accelerator, measured with our bench client (for a session lent
# a GPU; the device tool runs it in the repository root): random 256 in / 64 out at 1, 16 and 64
# concurrent, then prefix_repetition (5 x 512 + 128, 32 out) at 64, beside the in-process figures
# of scripts/gpu-check.sh, so the server's own cost on a fast engine shows. The image lacks the
# server's packages: carry them as wheels and name them in GPU_CHECK_WHEELS (gpu-check.sh says
# how). Not yet run (2026-12-04: the session that wrote it was refused a second machine).
#   GPU_CHECK_WHEELS=.devwheels bash scripts/gpu-serve-bench.sh
# On this machine, as a dry run: DEV=cpu DTYPE=float32 N=8 CONCS="1 4" PY=.venv/bin/python bash scripts/gpu-serve-bench.sh
if [ -n "$GPU_CHECK_WHEELS" ]; then
    python3 -m pip install -q --no-index --find-links "$GPU_CHECK_WHEELS" -r "$GPU_CHECK_WHEELS/req.txt" 2>&1 |
        grep -v "Running pip as"
fi
DEV=${DEV:-cuda}; N=${N:-256}; PY=${PY:-python3}; OUT=${OUT:-/tmp/sb}; mkdir -p $OUT
export PYTHONUNBUFFERED=1 DJANGO_SECRET_KEY=bench
$PY manage.py runengine --device $DEV --dtype ${DTYPE:-bfloat16} --port 18200 --max-num-seqs 128 --num-kv-blocks 20000 > $OUT/engine.log 2>&1 &
EPID=$!
for i in $(seq 120); do curl -sf http://127.0.0.1:18200/health >/dev/null && break; sleep 1; done
for c in ${CONCS:-1 16 64}; do
  n=$(( c * 8 > 32 ? c * 8 : 32 ))
  $PY -m bench --base-url http://127.0.0.1:18200 --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts $n --max-concurrency $c --disable-tqdm --json $OUT/random_c$c.json 2>&1 | grep -iE "throughput|TTFT|TPOT|cached|duration" | head -12 | sed "s/^/random c=$c: /"
  if [ $c = 64 ]; then top -b -n1 | head -14 | tail -8; fi
done
$PY -m bench --base-url http://127.0.0.1:18200 --dataset-name prefix_repetition --prefix-repetition-prefix-len 512 --prefix-repetition-suffix-len 128 --prefix-repetition-num-prefixes 5 --prefix-repetition-output-len 32 --num-prompts $N --max-concurrency 64 --disable-tqdm --json $OUT/prefix.json 2>&1 | grep -iE "throughput|TTFT|cached|duration" | head -10 | sed "s/^/prefix c=64: /"
kill -INT $EPID; wait $EPID 2>/dev/null
