#!/usr/bin/env bash
# The cost budget's measurements in one run, one after the other (run nothing else meanwhile: every timing is
# interleaved with its yardstick, but two jobs on 2 cores make both void). About 15 minutes on a 2-core machine.
#   bash scripts/perf_budget.sh [pairs]
set -u
cd "$(dirname "$0")/.."
n=${1:-5}
Y="python scripts/yardstick_small.py"
B7="python -m tblock_cli check --block hf:llama --d-model 4096 --n-heads 32 --d-ff 11008"
echo "== check at its defaults"; python scripts/perf_pairs.py -n "$n" --yardstick "$Y" -- python -m tblock_cli check --threads 1 | tail -3
echo "== check --fast"; python scripts/perf_pairs.py -n "$n" --yardstick "$Y" -- python -m tblock_cli check --threads 1 --fast | tail -3
echo "== the floor: one check"; python scripts/perf_pairs.py -n "$n" --yardstick "$Y" -- python -m tblock_cli check --threads 1 --only shape | tail -3
echo "== import torch alone"; python scripts/perf_pairs.py -n "$n" --yardstick "$Y" -- python -c "import torch" | tail -3
echo "== bench: share of the process inside timed samples"
out=$(mktemp)
for i in 1 2 3; do
    /usr/bin/time -f "%e" -o "$out.t" python -m tblock_cli bench --d-model 512 --n-heads 8 --batch 4 --seq 1024 --mode train \
        --need-weights --dropout 0 --json > "$out"
    python - "$out" "$out.t" <<'PY'
import json, sys
t = json.load(open(sys.argv[1]))["timing"]
wall = float(open(sys.argv[2]).read().split()[-1])
print(f"timed {t['timed_s']:.2f} s of {wall:.2f} s process wall: {t['timed_s'] / wall:.1%} "
      f"(in-process {t['timed_s'] / t['wall_s']:.1%})")
PY
done
rm -f "$out" "$out.t"
echo "== 7B-size layer, default threads"; python scripts/perf_pairs.py -n 3 --yardstick "python scripts/yardstick_7b.py" -- $B7 | tail -3
echo "== 7B-size layer, one thread"; python scripts/perf_pairs.py -n 3 --yardstick "python scripts/yardstick_7b.py" -- $B7 --threads 1 | tail -3
