#!/usr/bin/env bash
# The engine against transformers' continuous batching on the CPU, in rounds: each tiny config
# on both shared traces, `--policy odma,hf` then `hf,odma`, ROUNDS times (default 3), and the
# median odma/hf ratio of each config and trace (a tiny model's run is a second of steps and
# moves by a third from one time to the next on a shared machine: one run says little).
#   bash bench/engine_rounds.sh [ROUNDS]
cd "$(dirname "$0")/.." || exit 2
PY=.venv/bin/python
for round in $(seq "${1:-3}"); do
  for order in odma,hf hf,odma; do
    for model in tiny-llama tiny-qwen2 tiny-mistral; do
      $PY bench/engine_table.py --model $model --requests 24 --prompt-cap 400 --output-cap 300 \
        --max-batch 8 --kv-pool-gb 0.064 --policy $order 2>/dev/null |
        awk -F'|' -v key="$round $order $model" '$3 ~ /(odma|hf)/ {print key, $2, $3, $4}'
    done
  done
done | $PY -c '
import collections, statistics, sys
runs = collections.defaultdict(dict)
for line in sys.stdin:
    rnd, order, model, trace, policy, tps = line.split()
    runs[(rnd, order, model, trace)][policy] = float(tps)
ratios = collections.defaultdict(list)
for (_, _, model, trace), r in runs.items():
    if "odma" in r and "hf" in r:
        ratios[(model, trace)].append(r["odma"] / r["hf"])
every = [x for v in ratios.values() for x in v]
for (model, trace), v in sorted(ratios.items()):
    print(f"{model:13s} {trace:22s} odma/hf median {statistics.median(v):.2f} "
          f"({min(v):.2f}-{max(v):.2f}, {len(v)} pairs)")
if every:
    print(f"all: median {statistics.median(every):.2f} over {len(every)} pairs")
'
