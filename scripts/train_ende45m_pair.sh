#!/usr/bin/env bash
# Trains the 45M EnDe pair end to end and exports it in bfloat16:
#   1. the target (configs/train/ende_target_45m.gin), for at most TARGET_SECONDS;
#   2. its checkpoint with the lowest validation cross-entropy becomes the teacher;
#   3. in parallel, for at most DRAFT_SECONDS: the small and base drafts by sequence-level
#      distillation with soft targets (configs/train/ende45m_draft_<size>.gin) and the
#      encoder-sharing draft (configs/train/ende45m_draft_shared_encoder.gin);
#   4. for at most ONPOLICY_SECONDS (0: skipped), both drafts go on on-policy
#      (configs/train/ende45m_draft_<size>_onpolicy.gin) from their best checkpoint;
#   5. the target's best checkpoint, each draft's checkpoint with the highest validation
#      alpha at temperature 0 and the encoder-sharing draft's latest are exported to
#      EXPORT_DIR/{target,draft_small,draft_base,draft_shared_encoder}.
# Every run checkpoints every 500 steps and resumes when the script is started again.
# TARGET_FLAGS, DRAFT_FLAGS and SHARED_FLAGS add gin flags to those runs.
#   RUN_DIR=/root/jaxspec_runs/ende45m bash scripts/train_ende45m_pair.sh
# The shipped pair (checkpoints/ende45m) came from two such runs on one H100 GPU, with
# QUANTUM=64 and time caps of about 5 minutes for the target and 3.5 for the drafts:
# the first trained a target and the sequence-level drafts (the shipped small draft);
# the second trained the target again (the shipped one, same config and seed) and the
# encoder-sharing draft over it, and took the first run's base draft on on-policy
# against it (the shipped base draft). checkpoints/README.md has their figures.
# Its target and encoder-sharing draft left checkpoints/ on 2026-11-26 for the 54M
# target (git history has them: `git checkout 0ac29d2 -- checkpoints/ende45m`); its small
# and base drafts are shipped in checkpoints/ende54m/.
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-/root/jaxspec_runs/ende45m}
EXPORT_DIR=${EXPORT_DIR:-checkpoints/ende45m}
TARGET_SECONDS=${TARGET_SECONDS:-36000}
DRAFT_SECONDS=${DRAFT_SECONDS:-36000}
ONPOLICY_SECONDS=${ONPOLICY_SECONDS:-0}
TARGET_BATCH=${TARGET_BATCH:-128}
TARGET_STEPS=${TARGET_STEPS:-8000}
# Padding quantum of the training batches: 16 on CPU; 64 (one shape, one compile) on an
# accelerator, where padding is free and each compile costs about half a minute.
QUANTUM=${QUANTUM:-16}
mkdir -p "$RUN_DIR"

best() {  # best <run dir> <metric> <min|max>
  python scripts/best_checkpoint.py "$1" --metric="$2" --mode="$3"
}

timeout "$TARGET_SECONDS" python scripts/train.py --gin_file=configs/train/ende_target_45m.gin \
  --gin.train.checkpoint_dir="'$RUN_DIR/target'" --gin.train.batch_size="$TARGET_BATCH" \
  --gin.train.num_steps="$TARGET_STEPS" --gin.train.checkpoint_every=500 \
  --gin.train.eval_every=500 --gin.train.keep_checkpoints=20 \
  --gin.train.length_quantum="$QUANTUM" ${TARGET_FLAGS:-} \
  > "$RUN_DIR/target.log" 2>&1 || echo "target run ended with status $? (124: time cap)"
teacher=$(best "$RUN_DIR/target" validation_xent min)
echo "teacher: $teacher"

export XLA_PYTHON_CLIENT_PREALLOCATE=false
draft_run() {  # draft_run <seconds> <config> <run dir> [gin flags...]
  local seconds=$1 config=$2 dir=$3
  shift 3
  timeout "$seconds" python scripts/train.py --gin_file="$config" \
    --gin.train.checkpoint_dir="'$dir'" --gin.train.teacher_checkpoint="'$teacher'" \
    --gin.train.sequence_kd_cache_dir="'$RUN_DIR/seqkd_cache'" \
    --gin.train.length_quantum="$QUANTUM" "$@" ${DRAFT_FLAGS:-} > "$dir.log" 2>&1
}
for size in small base; do
  draft_run "$DRAFT_SECONDS" "configs/train/ende45m_draft_$size.gin" "$RUN_DIR/draft_$size" &
done
timeout "$DRAFT_SECONDS" python scripts/train_shared_encoder_draft.py \
  --gin_file=configs/train/ende45m_draft_shared_encoder.gin \
  --gin.train_shared_encoder_draft.checkpoint_dir="'$RUN_DIR/draft_shared_encoder'" \
  --gin.train_shared_encoder_draft.target_checkpoint="'$teacher'" \
  --gin.train_shared_encoder_draft.length_quantum="$QUANTUM" ${SHARED_FLAGS:-} \
  > "$RUN_DIR/draft_shared_encoder.log" 2>&1 &
wait || true

final=draft
if [ "$ONPOLICY_SECONDS" -gt 0 ]; then
  final=draft_onpolicy
  for size in small base; do
    draft_run "$ONPOLICY_SECONDS" "configs/train/ende45m_draft_${size}_onpolicy.gin" \
      "$RUN_DIR/draft_onpolicy_$size" \
      --gin.train.init_checkpoint="'$(best "$RUN_DIR/draft_$size" validation_alpha_t0 max)'" &
  done
  wait || true
fi

python scripts/export_checkpoint.py "$teacher" "$EXPORT_DIR/target"
for size in small base; do
  python scripts/export_checkpoint.py "$(best "$RUN_DIR/${final}_$size" validation_alpha_t0 max)" \
    "$EXPORT_DIR/draft_$size"
done
python scripts/export_checkpoint.py "$RUN_DIR/draft_shared_encoder" \
  "$EXPORT_DIR/draft_shared_encoder"
