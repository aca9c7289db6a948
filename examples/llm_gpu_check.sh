#!/usr/bin/env bash
# The large-model paths on GPUs with nothing to download, on a random Llama-layout model and long texts made by
# examples/make_random_llm.py. Each check compares numbers (examples/llm_gpu_check.py) and the script stops with
# status 1 and a "llm_gpu_check: FAILED ..." line at the first that is off; status 0 means every check passed.
# Logs and each run's GPU memory samples stay in $WORK/logs.
#
#   bash examples/llm_gpu_check.sh single      # 1 GPU, LoRA: --auto_find_batch_size keeps the total batch, resume
#                                              # equals the uninterrupted run, evaluate.py reproduces the metrics,
#                                              # --merge_lora's plain model too
#   bash examples/llm_gpu_check.sh fsdp        # LoRA under accelerate_configs/fsdp.yaml: resume, evaluate.py, merge
#   bash examples/llm_gpu_check.sh fsdp-full   # full fine-tuning under fsdp.yaml: resume, evaluate.py
#   SIZE=8b bash examples/llm_gpu_check.sh memory   # LoRA on 8B, 8 x 512 tokens: gradient checkpointing peaks lower
#
# GPUS (default: every GPU nvidia-smi lists) sets the FSDP stages' processes. With 2 or more the model is sharded
# over them; with 1, FSDP runs as a single process that shards nothing: a smoke test of the config and of the
# sharded checkpoints, which says so. SIZE=tiny runs 'single' on a CPU in minutes; DRY_RUN=1 prints the commands a
# stage would run, and checks nothing.
set -euo pipefail
STAGE=${1:?give a stage: single, fsdp, fsdp-full or memory}
SIZE=${SIZE:-1b}
WORK=${WORK:-/tmp/llm-check}
GPUS=${GPUS:-$(nvidia-smi --list-gpus 2> /dev/null | wc -l || true)} # 0 without nvidia-smi
DRY_RUN=${DRY_RUN:-}
export PYTHONUNBUFFERED=1
case "$STAGE" in single | fsdp | fsdp-full | memory) ;; *)
  echo "llm_gpu_check: unknown stage $STAGE: give single, fsdp, fsdp-full or memory" >&2
  exit 2
  ;;
esac

sampler=""
stop_sampler() {
  [ -z "$sampler" ] || kill "$sampler" 2> /dev/null || true
  sampler=""
}
trap stop_sampler EXIT # a failed run, a failed check or Ctrl-C leaves no nvidia-smi behind

fail() {
  echo "llm_gpu_check: FAILED $*" >&2
  exit 1
}

run() { # run NAME COMMAND...: its log in $WORK/logs/NAME.log, its GPU memory every 100 ms in NAME.mem
  local name=$1
  shift
  if [ -n "$DRY_RUN" ]; then echo "$name: $*"; return; fi
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 100 > "$WORK/logs/$name.mem" &
    sampler=$!
  fi
  "$@" > "$WORK/logs/$name.log" 2>&1 || {
    local status=$?
    tail -40 "$WORK/logs/$name.log"
    fail "$name: exit status $status, log in $WORK/logs/$name.log"
  }
  stop_sampler
  local peak=""
  [ -s "$WORK/logs/$name.mem" ] && peak=", peak GPU memory $(sort -n "$WORK/logs/$name.mem" | tail -1) MiB"
  echo "$name: done$peak"
}

check() { # check CHECK ARGS...: examples/llm_gpu_check.py, which exits 1 with its reason when a number is off
  if [ -n "$DRY_RUN" ]; then echo "check: $*"; return; fi
  python examples/llm_gpu_check.py "$@" || exit 1
}

resume() { # resume NAME COMMAND...: NAME again from its checkpoint-10 in a fresh folder, then compared with NAME
  local name=$1
  shift
  if [ -z "$DRY_RUN" ]; then # moved, and NAME's later checkpoints deleted: a full 1B model's are 15 GB each
    mkdir -p "$WORK/$name-resumed" && mv "$WORK/$name/checkpoint-10" "$WORK/$name-resumed/"
    rm -rf "$WORK/$name"/checkpoint-*
  fi
  run "$name-resumed" "$@" --output_dir "$WORK/$name-resumed" --resume_from_checkpoint latest
  check resume "$WORK/$name" "$WORK/$name-resumed"
}

evaluate() { # evaluate NAME: evaluate.py on one process on NAME's output folder, against NAME's own final metrics
  run "$1-eval" python evaluate.py --model_name_or_path "$WORK/$1" --validation_file "$WORK/data/dev.csv" \
    --output_dir "$WORK/$1-eval"
  check evaluate "$WORK/$1" "$WORK/$1-eval"
}

fsdp_processes() { # the FSDP stages' process count, and what a single one can show
  if [ "$GPUS" -ge 2 ]; then
    echo "$STAGE: FSDP sharded over $GPUS GPUs" >&2
    echo "$GPUS"
  else
    echo "$STAGE: 1 GPU: FSDP as a single process shards nothing, a smoke test only (GPUS=2 or more shards)" >&2
    echo 1
  fi
}

if [ -z "$DRY_RUN" ]; then rm -rf "$WORK" && mkdir -p "$WORK/logs"; fi
WORDS=$([ "$STAGE" = memory ] && echo 400 || echo 200)
run make-model python examples/make_random_llm.py --size "$SIZE" --output "$WORK/model" --data "$WORK/data" \
  --words "$WORDS" --rows 2000
MAX_LENGTH=$([ "$STAGE" = memory ] && echo 512 || echo 256)
DATA=(--model_name_or_path "$WORK/model" --train_file "$WORK/data/train.csv" --validation_file "$WORK/data/dev.csv"
  --max_length "$MAX_LENGTH" --report_to none --logging_steps 5)
SINGLE=(accelerate launch --config_file accelerate_configs/single_gpu.yaml train.py "${DATA[@]}")
STEPS=(--gradient_checkpointing --per_device_train_batch_size 16 --max_train_steps 30 --checkpointing_steps 10)

case "$STAGE" in
single)
  LORA=("${SINGLE[@]}" "${STEPS[@]}" --use_peft)
  # A batch far too large for the GPU: the probe halves it until it fits, accumulation keeps the total of 1024.
  run auto "${SINGLE[@]}" --use_peft --auto_find_batch_size --per_device_train_batch_size 1024 --max_train_steps 2 \
    --output_dir "$WORK/auto"
  check batch "$WORK/auto" 1024
  run lora "${LORA[@]}" --output_dir "$WORK/lora"
  resume lora "${LORA[@]}"
  evaluate lora
  run merged "${LORA[@]}" --max_train_steps 10 --merge_lora --output_dir "$WORK/merged"
  evaluate merged # a plain model: evaluate.py loads it with from_pretrained, and refuses it without its head
  ;;
fsdp)
  LORA=(accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes "$(fsdp_processes)" train.py
    "${DATA[@]}" "${STEPS[@]}" --use_peft)
  run fsdp-lora "${LORA[@]}" --output_dir "$WORK/fsdp-lora"
  resume fsdp-lora "${LORA[@]}"
  evaluate fsdp-lora
  run fsdp-merged "${LORA[@]}" --max_train_steps 10 --merge_lora --output_dir "$WORK/fsdp-merged"
  evaluate fsdp-merged
  ;;
fsdp-full)
  FULL=(accelerate launch --config_file accelerate_configs/fsdp.yaml --num_processes "$(fsdp_processes)" train.py
    "${DATA[@]}" "${STEPS[@]}" --learning_rate 1e-5)
  FULL+=(--max_train_steps 20) # at most 2 checkpoints on disk, 15 GB each for 1B (fp32 weights, AdamW)
  run fsdp-full "${FULL[@]}" --output_dir "$WORK/fsdp-full"
  resume fsdp-full "${FULL[@]}"
  evaluate fsdp-full
  ;;
memory)
  command -v nvidia-smi > /dev/null || [ -n "$DRY_RUN" ] || fail "memory: nvidia-smi is needed to measure GPU memory"
  MEMORY=("${SINGLE[@]}" --use_peft --per_device_train_batch_size 8 --max_train_steps 5 --no-group_by_length)
  run lora-checkpointed "${MEMORY[@]}" --gradient_checkpointing --output_dir "$WORK/lora-checkpointed"
  run lora-plain "${MEMORY[@]}" --output_dir "$WORK/lora-plain"
  check less-memory "$WORK/logs/lora-checkpointed.mem" "$WORK/logs/lora-plain.mem"
  ;;
esac
if [ -n "$DRY_RUN" ]; then echo "llm_gpu_check $STAGE: dry run, nothing was run"; else echo "llm_gpu_check $STAGE: every check passed"; fi
