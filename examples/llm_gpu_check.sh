#!/usr/bin/env bash
# The large-model paths on one GPU with nothing to download, on a random Llama-layout model and long texts made by
# examples/make_random_llm.py; prints a summary with the GPU's peak memory (nvidia-smi). Logs stay in $WORK/logs.
#
#   bash examples/llm_gpu_check.sh single      # LoRA: --auto_find_batch_size, resume, evaluate.py, --merge_lora
#   bash examples/llm_gpu_check.sh fsdp        # LoRA (resume, merge) under accelerate_configs/fsdp.yaml, 1 process
#   bash examples/llm_gpu_check.sh fsdp-full   # full fine-tuning under fsdp.yaml, 1 process
#   SIZE=8b bash examples/llm_gpu_check.sh memory   # LoRA on an 8B model, 8 x 512 tokens, with and without
#                                                   # gradient checkpointing
# SIZE=tiny runs the 'single' stage on a CPU, as a quick check of the script itself.
set -euo pipefail
STAGE=${1:?give a stage: single, fsdp, fsdp-full or memory}
SIZE=${SIZE:-1b}
WORK=${WORK:-/tmp/llm-check}
export PYTHONUNBUFFERED=1
rm -rf "$WORK" && mkdir -p "$WORK/logs"
WORDS=$([ "$STAGE" = memory ] && echo 400 || echo 200)
python examples/make_random_llm.py --size "$SIZE" --output "$WORK/model" --data "$WORK/data" --words "$WORDS" \
  --rows 2000
MAX_LENGTH=$([ "$STAGE" = memory ] && echo 512 || echo 256)
DATA=(--model_name_or_path "$WORK/model" --train_file "$WORK/data/train.csv" --validation_file "$WORK/data/dev.csv"
      --max_length "$MAX_LENGTH" --report_to none --logging_steps 5)
SINGLE=(accelerate launch --config_file accelerate_configs/single_gpu.yaml train.py "${DATA[@]}")
FSDP=(accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes 1 train.py "${DATA[@]}")

run() {  # run NAME COMMAND...: its log in $WORK/logs/NAME.log; a one-line summary with the GPU's peak memory
  local name=$1 sampler=""
  shift
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$WORK/logs/$name.mem" &
    sampler=$!
  fi
  "$@" > "$WORK/logs/$name.log" 2>&1 || { tail -40 "$WORK/logs/$name.log"; exit 1; }
  [ -n "$sampler" ] && kill "$sampler" && echo "$name: peak GPU memory $(sort -n "$WORK/logs/$name.mem" | tail -1) MiB"
  grep -hE "Parameters =|auto_find_batch_size|Total train batch|Done in" "$WORK/logs/$name.log" \
    | sed "s/^/  $name: /" || true
}

resume() {  # resume NAME COMMAND...: the run NAME again from its first checkpoint, in a fresh folder, then compared
  local name=$1
  shift
  mkdir -p "$WORK/$name-resumed" && cp -r "$WORK/$name/checkpoint-10" "$WORK/$name-resumed/"
  run "$name-resumed" "$@" --output_dir "$WORK/$name-resumed" --resume_from_checkpoint latest
  python - "$WORK/$name" "$WORK/$name-resumed" <<'PY'
import json, sys
from pathlib import Path
from safetensors.torch import load_file
a, b = map(Path, sys.argv[1:])
name = "adapter_model.safetensors" if (a / "adapter_model.safetensors").exists() else "model.safetensors"
x, y = load_file(a / name), load_file(b / name)
worst = max((x[k].float() - y[k].float()).abs().max().item() for k in x)
print(f"  resumed vs uninterrupted: max weight difference {worst:.3g}")
def losses(folder):
    records = map(json.loads, (folder / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in records if "loss" in r}
la, lb = losses(a), losses(b)
print("  losses (uninterrupted, resumed):", [(s, round(la[s], 5), round(lb[s], 5)) for s in sorted(lb)])
PY
}

evaluate() {  # evaluate NAME: evaluate.py on the run's output folder, against the run's own final metrics
  python evaluate.py --model_name_or_path "$WORK/$1" --validation_file "$WORK/data/dev.csv" \
    --output_dir "$WORK/$1-eval" > "$WORK/logs/$1-eval.log" 2>&1 || { tail -40 "$WORK/logs/$1-eval.log"; exit 1; }
  python - "$WORK/$1" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
trained = json.loads((out / "all_results.json").read_text())
evaluated = json.loads(Path(f"{out}-eval/eval_results.json").read_text())
print(f"  {out.name}: trained {trained['trainable_parameters']:,} of {trained['total_parameters']:,} parameters")
for key in ("eval_accuracy", "eval_loss"):
    print(f"  {key}: train.py {trained[key]:.6f}, evaluate.py {evaluated[key]:.6f}")
PY
}

sizes() { du -sh "$@" | sed "s/^/  size: /"; }

case "$STAGE" in
single)
  LORA=("${SINGLE[@]}" --use_peft --gradient_checkpointing --per_device_train_batch_size 16 --max_train_steps 30
        --checkpointing_steps 10)
  # A batch far too large for the GPU: the probe halves it until it fits, accumulation keeps the total of 1024.
  run auto "${SINGLE[@]}" --use_peft --auto_find_batch_size --per_device_train_batch_size 1024 --max_train_steps 2 \
    --output_dir "$WORK/auto"
  run lora "${LORA[@]}" --output_dir "$WORK/lora"
  resume lora "${LORA[@]}"
  evaluate lora
  sizes "$WORK/model" "$WORK/lora/adapter_model.safetensors" "$WORK/lora/checkpoint-10"
  run merged "${LORA[@]}" --max_train_steps 10 --merge_lora --output_dir "$WORK/merged"
  evaluate merged
  python -c "from transformers import AutoModelForSequenceClassification as A; m = A.from_pretrained('$WORK/merged');
print('  merged: plain from_pretrained gives', type(m).__name__, m.config.id2label, 'pad', m.config.pad_token_id)"
  ;;
fsdp)
  COMMON=(--gradient_checkpointing --per_device_train_batch_size 16 --max_train_steps 30 --checkpointing_steps 10)
  run fsdp-lora "${FSDP[@]}" "${COMMON[@]}" --use_peft --output_dir "$WORK/fsdp-lora"
  resume fsdp-lora "${FSDP[@]}" "${COMMON[@]}" --use_peft
  evaluate fsdp-lora
  run fsdp-merged "${FSDP[@]}" "${COMMON[@]}" --use_peft --max_train_steps 10 --merge_lora \
    --output_dir "$WORK/fsdp-merged"
  evaluate fsdp-merged
  sizes "$WORK/model" "$WORK/fsdp-lora/adapter_model.safetensors" "$WORK/fsdp-lora/checkpoint-10"
  ;;
fsdp-full)
  run fsdp-full "${FSDP[@]}" --gradient_checkpointing --per_device_train_batch_size 16 --max_train_steps 30 \
    --checkpointing_steps 30 --learning_rate 1e-5 --output_dir "$WORK/fsdp-full"
  evaluate fsdp-full
  sizes "$WORK/model" "$WORK/fsdp-full/model.safetensors" "$WORK/fsdp-full/checkpoint-30"
  ;;
memory)
  MEMORY=("${SINGLE[@]}" --use_peft --per_device_train_batch_size 8 --max_train_steps 5 --no-group_by_length)
  run lora-checkpointed "${MEMORY[@]}" --gradient_checkpointing --output_dir "$WORK/lora-checkpointed"
  run lora-plain "${MEMORY[@]}" --output_dir "$WORK/lora-plain"
  ;;
*)
  echo "unknown stage $STAGE: single, fsdp, fsdp-full or memory" >&2
  exit 2
  ;;
esac
