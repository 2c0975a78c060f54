#!/bin/bash
# A DeepSeek-V3 fine-tune from the golden checkpoint on text, with multi-token prediction on,
# over pipeline 2 x expert 2 x ZeRO-1 data 2 (DeepSeek's own layout in small), run whole and
# again killed with -9 after its step-20 checkpoint and resumed: the two step-40 metric rows
# must be equal. About 3 minutes on 2 cores.   bash benchmarks/deepseek_resume.sh
set -euo pipefail
cd "$(dirname "$0")/.."
JAXPAR=${JAXPAR:-.venv/bin/jaxpar}
OUT=$(mktemp -d)
ARGS="hf:tests/golden/deepseek_v3 --set mesh.stage=2 --set mesh.expert=2 --set mesh.data=2 --set train.microbatches=2
  --set parallel.zero.stage=1 --set model.mtp_layers=1 --set data.source=text --set data.path=tests/golden/corpus.txt
  --set data.tokenizer=tests/golden/llama_tied/tokenizer.json --set data.eos_id=2 --set data.order=epochs
  --set train.steps=40 --set train.global_batch=8 --set train.seq_len=64 --set optim.lr=3e-3 --set checkpoint.every=20
  --set train.log_every=1 --no-progress"
$JAXPAR train $ARGS --set checkpoint.dir="$OUT/whole" --metrics-file "$OUT/whole.jsonl" > "$OUT/whole.log" 2>&1
$JAXPAR train $ARGS --set checkpoint.dir="$OUT/killed" --metrics-file "$OUT/killed.jsonl" > "$OUT/killed.log" 2>&1 &
pid=$!
until grep -q "^step 26/" "$OUT/killed.log" 2>/dev/null; do sleep 0.5; done
kill -9 $pid; wait $pid 2>/dev/null || true
$JAXPAR train $ARGS --set checkpoint.dir="$OUT/killed" --metrics-file "$OUT/resumed.jsonl" > "$OUT/resumed.log" 2>&1
grep "^loss" "$OUT/whole.log"; grep "^resumed" "$OUT/resumed.log"
python3 - "$OUT" <<'PY'
import json, sys
rows = [json.loads(open(f"{sys.argv[1]}/{n}.jsonl").read().splitlines()[-1]) for n in ("whole", "resumed")]
keys = ("loss", "mtp_loss", "grad_norm", "moe_load")
print("step 40, never killed:", {k: rows[0][k] for k in keys})
print("step 40, killed and resumed:", {k: rows[1][k] for k in keys})
print("equal" if all(rows[0][k] == rows[1][k] for k in keys) else "DIFFERENT")
sys.exit(0 if all(rows[0][k] == rows[1][k] for k in keys) else 1)
PY
rm -rf "$OUT"
