#!/usr/bin/env bash
# The GPU check: one command for a fresh, offline GPU machine with its own torch (at most ~6
# minutes, no download, no real weights). It prints the device, runs one `creditrl train` step
# through `python -m creditrl.cli` on it, the tests marked gpu in the files that hold them
# (GPU_TESTS: the learning smoke test's CUDA case and the CUDA-graph decode against the eager
# path among them) and benchmarks/gpu_step_time.py (rollout against HF generate on left-padded
# and unpadded prompts, update MFU, a whole GRPO step and TRL's GRPOTrainer; TRL only where
# it is importable), and writes gpu_step_time.md naming the device, the versions, the pytest
# summary and each figure. The CLI step and pytest have time limits (60 s, 120 s); the
# benchmark gets what is left of BUDGET_S (360 s) and shares it among its parts, so the whole
# stays near 6 minutes. benchmarks/gpu_smoke.py (the learning smoke run on CUDA and the CPU)
# runs apart.
#
#   scripts/gpu_check.sh                         # on a machine where torch sees CUDA
#   GPU_CHECK_ALLOW_CPU=1 scripts/gpu_check.sh   # a dry run on the CPU (says so; small shapes;
#                                                # writes gpu_step_time_dry_run.md instead)
#
# Everything it writes (gpu_step_time.md, cli.log, pytest.log, the CLI run's folder) goes to
# $OUT when set, else benchmarks/results (runs/ for a dry run), and is kept. Python: $PYTHON,
# else .venv/bin/python when present, else python3; where the checkout carries .whl/activate.sh
# (the wheels of the pure dependencies an offline GPU image lacks) it is sourced first.
# creditrl need not be installed: the checkout goes first on PYTHONPATH. The tiny model's
# tokenizer comes from the creditrl cache ($CREDITRL_CACHE or ~/.cache/creditrl) or the
# embedded model's package. Without CUDA (and without GPU_CHECK_ALLOW_CPU=1) it exits 2 with
# one line; it exits 1 when a part failed, 0 when all passed.
set -uo pipefail
start=$SECONDS
BUDGET_S=${BUDGET_S:-360}
GPU_TESTS=(tests/test_gpu_smoke.py tests/test_optim.py tests/test_packing.py
           tests/test_document_attention.py tests/test_placement.py tests/test_static_decode.py)
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root" || exit 2
if [ -f .whl/activate.sh ]; then
  # shellcheck disable=SC1091
  . .whl/activate.sh
fi
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3; fi
export PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

if ! "$PY" -c 'import torch' >/dev/null 2>&1; then
  echo "error: $PY cannot import torch: install torch for your CUDA first (see README, On a GPU)"
  exit 2
fi
if "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  dry=0 device=cuda work=${OUT:-benchmarks/results}
  result=$work/gpu_step_time.md
  bench=()
elif [ "${GPU_CHECK_ALLOW_CPU:-0}" = 1 ]; then
  dry=1 device=cpu work=${OUT:-runs}
  result=$work/gpu_step_time_dry_run.md
  bench=(--dry-run --rows 4 --prompt-len 8 --new-tokens 8 --prompts 2 --n 2 --response 8)
  echo "DRY RUN (GPU_CHECK_ALLOW_CPU=1): no CUDA device is visible; everything runs on the CPU" \
       "and no GPU is used"
else
  echo "error: no CUDA device visible to $PY (torch.cuda.is_available() is False); set" \
       "GPU_CHECK_ALLOW_CPU=1 for a dry run on the CPU"
  exit 2
fi

mkdir -p "$work" || exit 2
rm -rf "$work/cli"
failed=()
section() { printf '\n==== %s\n' "$*"; }
why() { if [ "$1" = 124 ]; then echo "timed out"; else echo "exit $1"; fi; }

section "device"
if command -v nvidia-smi >/dev/null; then nvidia-smi -L; else echo "nvidia-smi: not found"; fi
"$PY" -c 'import torch, transformers
name = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)"
print(f"torch.cuda.get_device_name(): {name}")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), transformers {transformers.__version__}")'

section "the tiny model (random weights, the SmolLM2 tokenizer)"
if ! tiny=$("$PY" -c 'from creditrl.models.tiny import tiny_model_dir; print(tiny_model_dir())' \
    2>"$work/tiny.err"); then
  echo "error: the tiny model could not be built ($(tail -n 1 "$work/tiny.err")): it needs the" \
       "SmolLM2 tokenizer, from the embedded model's package or a creditrl cache at" \
       "\$CREDITRL_CACHE holding SmolLM2-135M-Instruct-tokenizer"
  exit 2
fi
echo "$tiny"

section "one creditrl train step through python -m creditrl.cli (trainer.device=$device)"
COLUMNS=200 timeout 60 "$PY" -m creditrl.cli train "model.path=$tiny" "trainer.device=$device" \
  trainer.total_steps=1 data.train_batch_size=2 actor.ppo_mini_batch_size=2 rollout.n=2 rollout.max_response_length=8 \
  trainer.val_before_train=false trainer.test_freq=0 trainer.save_freq=0 \
  "trainer.output_dir=$work/cli" >"$work/cli.log" 2>&1
code=$?
grep -E "^trainer.device:|^error:" "$work/cli.log" || tail -n 5 "$work/cli.log"
if [ $code = 0 ]; then echo "passed"; else echo "FAILED ($(why $code))"; failed+=(cli); fi

section "pytest -m gpu ${GPU_TESTS[*]}"
opts=(-m gpu -rs -p no:cacheprovider)
if "$PY" -c 'import pytest_timeout' >/dev/null 2>&1; then opts+=(--timeout=100); fi
timeout 120 "$PY" -m pytest "${opts[@]}" "${GPU_TESTS[@]}" 2>&1 | tee "$work/pytest.log" \
  | grep -vE "^(Loading|step )"
code=${PIPESTATUS[0]}
if [ "$code" != 0 ]; then echo "pytest: FAILED ($(why "$code"))"; failed+=(pytest); fi

left=$(( BUDGET_S - (SECONDS - start) ))
if [ "$left" -lt 60 ]; then left=60; fi
section "benchmarks/gpu_step_time.py: rollout, update MFU, a GRPO step, TRL (${left} s)"
COLUMNS=200 timeout "$left" "$PY" benchmarks/gpu_step_time.py --out "$result" \
  --pytest-log "$work/pytest.log" --budget-s $(( left - 10 )) "${bench[@]}" 2>&1 \
  | tee "$work/gpu_step_time.log" | grep -vE "^(Loading|step )"
code=${PIPESTATUS[0]}
if [ "$code" != 0 ]; then echo "gpu_step_time.py: FAILED ($(why "$code"))"; failed+=(gpu_step_time); fi

section "summary"
[ $dry = 1 ] && echo "DRY RUN on the CPU: no GPU was used"
[ -f "$result" ] && echo "figures: $result"
if [ ${#failed[@]} -gt 0 ]; then echo "FAILED: ${failed[*]}"; exit 1; fi
echo "all parts passed"
