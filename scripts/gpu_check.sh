#!/usr/bin/env bash
# First light on one GPU (issue #28), made for the lent device machine (one H200 or H100; PyTorch,
# Lightning, transformers, peft preinstalled; no vLLM, no network). Each step prints ONE result
# line, PASS or FAIL with its numbers, and has its own time limit, so one failure does not eat
# the others' time:
#   setup      install the carried wheels (.whl/, scripts/gpu_wheels.txt) into a --target folder
#              and mars2 with --no-deps (editable); print the GPU, the versions and what the local
#              sandbox can have there (without all of it, train and eval grade with
#              sandbox.isolation=best_effort)
#   train      make_tiny_models; a warm-started tiny_pair run with trainer=gpu (transformers backend
#              on CUDA, bf16-mixed), 3 steps with a checkpoint after each: reward > 0; then a run
#              resumed from step_000001.ckpt: every logged value and the final weights equal the
#              uninterrupted run's (trainer.deterministic=warn)
#   eval       mars2-eval of the resumed run's last.ckpt (ckpt_path) on 8 held-out problems:
#              it loads the checkpoint and solves something
#   calibrate  python -m mars2.training.calibration: random-initialised Qwen3-1.7B and Qwen3-8B
#              shapes, LoRA r=64 and full fine-tuning, 4k and 16k completion tokens, one step each:
#              the device's peak against the estimate of mars2.training.memory, per case; the
#              verdict asks for every case within 15%
#   terms      scripts/gpu_terms.py: the 32B plan's assumptions of issue #43 on the device, each
#              measured next to the plan (sharded DTensors and local bytes, the streamed sync's
#              peak rise against the largest tensor, a finite k3 KL, the chunked bf16 head against
#              fp64 and its peak against the plan's term, expandable_segments and fragmentation
#              against the 8% reserve; the engines' lengths planned only: no vLLM there)
# Outputs in $OUT (what the device tool returns, at most 8 files): gpu_check.log (the result
# lines), setup.log, train.log, eval.log, calibrate.log, calibration.json, terms.log, terms.json. Run folders go to $WORK.
#
# With the device tool (a minute or two to start the machine, then at most 570 s: the steps'
# limits, 520 s, and four verdicts of at most 12 s), from the checkout the session started in
# (the tool sends that one): first, here,
#   bash scripts/gpu_wheels.sh && bash scripts/gpu_check.sh --dry-run --python .venv/bin/python
# then one call (.whl/ is git-ignored: it travels only because carry names it):
#   run(command="bash scripts/gpu_check.sh", carry=[".whl"], kind="nvidia-h200", timeout_s=570)
# One rerun of a failed eval or calibrate step fits in the same 15 minutes if made at once (the
# machine stays warm 30 s), with what the reply's lease.budget_left_s leaves (about 220 s):
#   run(command="LIMIT_CALIBRATE=150 bash scripts/gpu_check.sh --steps calibrate", carry=[".whl"],
#       timeout_s=220)
# with less left: timeout_s = budget_left_s - 20 and LIMIT_CALIBRATE (LIMIT_EVAL) = timeout_s - 70.
# Only some cases: CALIBRATE_ARGS="--shape qwen3-8b --mode full" bash scripts/gpu_check.sh ...
# (python -m mars2.training.calibration --help). docs/gpu.md says the same for a GPU machine of your own.
#
# Here (no GPU): --dry-run checks the wheels and prints each step's commands and the calibration's
# predictions; --cpu rehearses every step on the CPU (trainer=cpu, the tiny shape calibrated: the
# bytes of its tensors against the estimate's resident terms; activations, logits, the CUDA
# context and the device's peak are GPU only), with generous limits (no device time is spent).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

usage() {
  sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
  cat <<'USAGE'
Options:
  --steps LIST     comma-separated, of setup,train,eval,calibrate,terms (default: all; in
                   that order, and setup always runs)
  --dry-run        check the wheels, print the commands and the calibration's predictions
  --cpu            run the steps on the CPU (a rehearsal; the calibration measures the tiny shape)
  --wheels DIR     the carried wheels (default: .whl)
  --site DIR       where the wheels are installed (default: /tmp/mars2-site)
  --python PY      the interpreter (default: python3, the image's one with PyTorch)
  --no-install     use src/ on PYTHONPATH instead of pip install -e . (mars2's own code)
  --work DIR       run folders (default: /tmp/mars2-gpu-check)
USAGE
}

ALL_STEPS=(setup train eval calibrate terms)
STEPS=setup,train,eval,calibrate,terms
DRY=0
CPU=0
WHEELS=.whl
SITE=/tmp/mars2-site
PY=python3
INSTALL=1
WORK=/tmp/mars2-gpu-check
while [ $# -gt 0 ]; do
  case "$1" in
    --steps) STEPS=${2:?--steps needs a list}; shift ;;
    --dry-run) DRY=1 ;;
    --cpu) CPU=1 ;;
    --wheels) WHEELS=${2:?--wheels needs a folder}; shift ;;
    --site) SITE=${2:?--site needs a folder}; shift ;;
    --python) PY=${2:?--python needs an interpreter}; shift ;;
    --no-install) INSTALL=0 ;;
    --work) WORK=${2:?--work needs a folder}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gpu_check: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
  shift
done
IFS=, read -r -a SELECTED <<<"$STEPS"
for step in "${SELECTED[@]}"; do
  case " ${ALL_STEPS[*]} " in *" $step "*) ;;
    *) echo "gpu_check: unknown step '$step': use ${ALL_STEPS[*]}" >&2; exit 2 ;; esac
done
# setup always runs first: every other step needs what it installs
case ",$STEPS," in *",setup,"*) ;; *) STEPS=setup,$STEPS; SELECTED=(setup "${SELECTED[@]}") ;; esac
selected() { case ",$STEPS," in *",$1,"*) return 0 ;; *) return 1 ;; esac; }

# Seconds each step may take (520; train's warm start runs on the CPU, as in every mars2 run); with
# at most 12 s for each verdict they stay under the device call's timeout_s=570.
# LIMIT_SETUP=... etc. change them. --cpu spends no device time: its defaults are generous (a
# shared 2-core machine takes about 10 minutes for train's two warm starts).
if [ "$CPU" = 1 ]; then
  LIMIT_setup=${LIMIT_SETUP:-300}
  LIMIT_train=${LIMIT_TRAIN:-2400}
  LIMIT_eval=${LIMIT_EVAL:-900}
  LIMIT_calibrate=${LIMIT_CALIBRATE:-600}
  LIMIT_terms=${LIMIT_TERMS:-300}
else
  LIMIT_setup=${LIMIT_SETUP:-45}
  LIMIT_train=${LIMIT_TRAIN:-245}
  LIMIT_eval=${LIMIT_EVAL:-60}
  LIMIT_calibrate=${LIMIT_CALIBRATE:-135}
  LIMIT_terms=${LIMIT_TERMS:-35}
fi

OUT=${OUT:-$(mktemp -d /tmp/mars2-gpu-check-out-XXXX)}
mkdir -p "$OUT" "$WORK"
TINY=$ROOT/.cache/tiny_models
ISOLATION=required  # setup lowers it to best_effort where the machine cannot give the sandbox all
TRAINER=gpu
DEVICE=gpu
[ "$CPU" = 1 ] && TRAINER=cpu && DEVICE=cpu
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
export MARS2_ROOT=$ROOT CUBLAS_WORKSPACE_CONFIG=:4096:8
SUMMARY=$OUT/gpu_check.log
: >"$SUMMARY"
FAILED=0
START=$(date +%s)

# Steps write everything to their log ($OUT/<step>.log); the result lines (and the calibration's
# per-case lines) also go to the console (fd 3) and to $SUMMARY.
exec 3>&1
show() { echo "$1"; echo "$1" >&3; echo "$1" >>"$SUMMARY"; }
result() {  # result PASS|FAIL|DRY STEP DETAIL: the step's one line
  show "$1 $2: $3"
  [ "$1" = FAIL ] && FAILED=$((FAILED + 1))
  return 0
}

deadline() { DEADLINE=$(($(date +%s) + $1)); }
timed() {  # timed CMD...: runs CMD with what is left of the step's time (exit 124 when it runs out)
  local left=$((DEADLINE - $(date +%s)))
  [ "$left" -le 0 ] && return 124
  timeout -k 10 "$left" "$@"
}
verdict() {  # verdict STEP CHECK ARGS...: one result line from scripts/gpu_check.py (12 s apart
  # from the step's limit, so a step that used its time still gets its verdict)
  local line
  line=$(timeout -k 3 12 "$PY" scripts/gpu_check.py "$2" --label "$1" "${@:3}" 2>&1 | tail -1)
  case "$line" in
    "PASS $1: "*) show "$line" ;;
    "FAIL $1: "*) show "$line"; FAILED=$((FAILED + 1)) ;;
    *) result FAIL "$1" "the verdict did not run: ${line:-timed out}" ;;
  esac
  return 0
}

# -- setup: the carried wheels, then mars2 -------------------------------------------------------

wheel_files() {  # the wheel of each pinned package in $WHEELS; missing ones in $MISSING
  WHEEL_FILES=()
  MISSING=()
  local line spec name version stem found
  while read -r line; do
    spec=$(echo "${line%%#*}" | tr -d '[:space:]')
    [ -z "$spec" ] && continue
    name=${spec%%==*}
    version=${spec#*==}
    stem=$(echo "$name" | tr '[:upper:]-.' '[:lower:]__')
    found=$(ls "$WHEELS/$stem-$version-"*.whl 2>/dev/null | head -1)
    if [ -n "$found" ]; then WHEEL_FILES+=("$found"); else MISSING+=("$spec"); fi
  done <scripts/gpu_wheels.txt
}

step_setup() {
  wheel_files
  if [ ${#MISSING[@]} -gt 0 ]; then
    result FAIL setup "no wheel in '$WHEELS' for ${MISSING[*]}: run 'bash scripts/gpu_wheels.sh' where pip reaches a registry and carry the folder (carry=[\"$WHEELS\"])"
    return 1
  fi
  if [ "$DRY" = 1 ]; then
    result DRY setup "would install ${#WHEEL_FILES[@]} wheels (${WHEEL_FILES[*]##*/}) into $SITE, then $([ "$INSTALL" = 1 ] && echo "pip install --no-deps -e ." || echo "use src/ on PYTHONPATH")"
    return 0
  fi
  if ! timed "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" "${WHEEL_FILES[@]}"; then
    result FAIL setup "pip could not install the wheels of '$WHEELS' into $SITE (see setup.log)"
    return 1
  fi
  export PYTHONPATH=$SITE${PYTHONPATH:+:$PYTHONPATH}
  local how="mars2 installed with --no-deps (editable)"
  if [ "$INSTALL" = 1 ]; then
    if ! timed "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e .; then
      how="pip install -e . FAILED (see setup.log): mars2 from src/ on PYTHONPATH"
      INSTALL=0
    fi
  else
    how="mars2 from src/ on PYTHONPATH"
  fi
  [ "$INSTALL" = 0 ] && export PYTHONPATH=$ROOT/src:$PYTHONPATH
  local info code
  info=$(timed "$PY" - "$DEVICE" 2>&1 <<'PY'
import sys
import hydra, lightning, mars2, omegaconf, peft, torch, transformers
line = (f"hydra {hydra.__version__}, omegaconf {omegaconf.__version__}, torch {torch.__version__}, "
        f"lightning {lightning.__version__}, transformers {transformers.__version__}, "
        f"peft {peft.__version__}")
if torch.cuda.is_available():
    props = torch.cuda.get_device_properties(0)
    line += f"; {props.name}, {props.total_memory / 2**30:.1f} GiB, bf16 {torch.cuda.is_bf16_supported()}"
elif sys.argv[1] == "gpu":
    sys.exit(f"no CUDA GPU visible ({line})")
else:
    line += "; no GPU (--cpu)"
# What the local sandbox can have here (bubblewrap's namespaces, the seccomp filter, a task limit)
try:
    from mars2.sandbox.container.policy import plan

    missing = plan("best_effort").missing
except Exception as err:  # a probe that breaks says so; the steps then use best_effort
    missing = [f"the probe ({type(err).__name__}: {err})"]
print(line)
print("ISOLATION " + ("required" if not missing else "best_effort " + "; ".join(missing)))
PY
  )
  code=$?
  if [ $code -ne 0 ]; then
    [ $code = 124 ] && info="importing mars2 and its dependencies ran out of the step's ${LIMIT_setup} s"
    result FAIL setup "$(echo "$info" | tail -1)"
    return 1
  fi
  local isolation
  isolation=$(echo "$info" | sed -n 's/^ISOLATION //p' | tail -1)
  ISOLATION=${isolation%% *}
  local sandbox="sandbox fully isolated"
  [ "$ISOLATION" = best_effort ] && sandbox="sandbox.isolation=best_effort, it lacks ${isolation#best_effort }"
  result PASS setup "$(echo "$info" | grep -v '^ISOLATION ' | tail -1); $how; $sandbox"
}

# -- train: warm start, reward > 0, exact resume -------------------------------------------------

train_run() {  # train_run FOLDER [OVERRIDES...]
  timed "$PY" -m mars2.cli.train experiment=tiny_pair trainer=$TRAINER "paths.tiny_models_dir=$TINY" \
    "sandbox.isolation=$ISOLATION" logger=csv steps=3 callbacks.checkpoint.every_n_train_steps=1 trainer.deterministic=warn \
    '~callbacks.progress' +trainer.enable_progress_bar=false "hydra.run.dir=$1" "${@:2}"
}

step_train() {
  local first=$WORK/first resumed=$WORK/resumed
  if [ "$DRY" = 1 ]; then
    result DRY train "$PY scripts/make_tiny_models.py --out $TINY; $PY -m mars2.cli.train experiment=tiny_pair trainer=$TRAINER ... steps=3 hydra.run.dir=$first; the same with ckpt_path=$first/checkpoints/step_000001.ckpt hydra.run.dir=$resumed; scripts/gpu_check.py train $first $resumed"
    return 0
  fi
  rm -rf "$first" "$resumed"
  timed "$PY" scripts/make_tiny_models.py --out "$TINY" || { result FAIL train "make_tiny_models failed (train.log)"; return 1; }
  train_run "$first" || { result FAIL train "the warm-started run failed or ran out of time (train.log)"; return 1; }
  train_run "$resumed" "ckpt_path=$first/checkpoints/step_000001.ckpt" ||
    { result FAIL train "the resumed run failed or ran out of time (train.log)"; return 1; }
  verdict train train "$first" "$resumed" --device "$DEVICE"
}

# -- eval: mars2-eval with ckpt_path -------------------------------------------------------------

step_eval() {
  local checkpoint=$WORK/resumed/checkpoints/last.ckpt eval_dir=$WORK/eval
  # the console script pip installed beside the interpreter (its bin/ need not be on PATH)
  local command=("$("$PY" -c 'import sysconfig; print(sysconfig.get_path("scripts"))')/mars2-eval")
  [ "$INSTALL" = 0 ] && command=("$PY" -m mars2.cli.eval)
  command+=(experiment=tiny_pair "paths.tiny_models_dir=$TINY" "sandbox.isolation=$ISOLATION"
    "ckpt_path=$checkpoint" logger=none
    eval.limit=8 eval.samples=2 eval.tree_budget=4 "hydra.run.dir=$eval_dir")
  if [ "$DRY" = 1 ]; then
    result DRY eval "${command[*]}; scripts/gpu_check.py eval $eval_dir"
    return 0
  fi
  [ -f "$checkpoint" ] || { result FAIL eval "no $checkpoint: the train step must run first"; return 1; }
  rm -rf "$eval_dir"
  timed "${command[@]}" || { result FAIL eval "mars2-eval failed or ran out of time (eval.log)"; return 1; }
  verdict eval eval "$eval_dir"
}

# -- calibrate: the memory estimate against one measured step per case --------------------------

step_calibrate() {
  local args=(--out "$OUT/calibration.json" --work "$WORK/calibration" --tokenizer "$TINY/tiny_qwen3"
    --budget-s $((LIMIT_calibrate - 40)))  # counted after its imports: no case starts late
  [ "$CPU" = 1 ] && args+=(--device cpu --shape tiny --completion-tokens 64 --prompt-tokens 32 --lora-r 8)
  # shellcheck disable=SC2206  # words on purpose: e.g. CALIBRATE_ARGS="--shape qwen3-8b --mode full"
  [ -n "${CALIBRATE_ARGS:-}" ] && args+=($CALIBRATE_ARGS)
  if [ "$DRY" = 1 ]; then
    local predictions
    predictions=$(timed "$PY" -m mars2.training.calibration --predict-only --gpu h200 --work "$WORK/calibration" 2>&1)
    echo "$predictions"
    local line
    while IFS= read -r line; do show "  $line"; done < <(echo "$predictions" | grep '^CASE')
    local count
    count=$(echo "$predictions" | grep -c '^CASE')
    if [ "$count" -eq 0 ]; then
      result FAIL calibrate "the prediction side did not run: $(echo "$predictions" | tail -1)"
      return 1
    fi
    result DRY calibrate "$PY -m mars2.training.calibration ${args[*]}: $count cases predicted (h200) above"
    return 0
  fi
  rm -f "$OUT/calibration.json"
  [ -d "$TINY/tiny_qwen3" ] || timed "$PY" scripts/make_tiny_models.py --out "$TINY"
  local line code
  # each case's line as it comes (a step cut short by its limit keeps the cases done)
  while IFS= read -r line; do
    echo "$line"
    case "$line" in
      CASE*) show "  $line" >/dev/null ;;
      "exit "*) code=${line#exit } ;;
    esac
  done < <(timed "$PY" -m mars2.training.calibration "${args[@]}" 2>&1; echo "exit $?")
  [ -f "$OUT/calibration.json" ] || { result FAIL calibrate "no calibration.json (exit $code, calibrate.log)"; return 1; }
  local mode=()
  [ "$CPU" = 1 ] && mode=(--cpu)
  verdict calibrate calibration "$OUT/calibration.json" "${mode[@]}"
}

# -- terms: issue #43's assumptions, measured next to the plan -----------------------------------

step_terms() {
  local args=(--out "$OUT/terms.json" --tiny "$TINY")
  [ "$CPU" = 1 ] && args+=(--device cpu --small)
  if [ "$DRY" = 1 ]; then
    result DRY terms "$PY scripts/gpu_terms.py ${args[*]}; scripts/gpu_check.py terms $OUT/terms.json"
    return 0
  fi
  rm -f "$OUT/terms.json"
  [ -d "$TINY/tiny_qwen3" ] || timed "$PY" scripts/make_tiny_models.py --out "$TINY"
  timed "$PY" scripts/gpu_terms.py "${args[@]}"
  [ -f "$OUT/terms.json" ] || { result FAIL terms "no terms.json (terms.log)"; return 1; }
  verdict terms terms "$OUT/terms.json"
}

for step in "${ALL_STEPS[@]}"; do
  selected "$step" || continue
  limit_var=LIMIT_$step
  deadline "${!limit_var}"
  if ! "step_$step" >>"$OUT/$step.log" 2>&1 && [ "$step" = setup ]; then
    show "gpu_check: setup failed, nothing else can run (setup.log)" >/dev/null
    exit 1
  fi
done
echo "gpu_check: $FAILED of ${#SELECTED[@]} step(s) failed in $(($(date +%s) - START)) s; logs in $OUT" >&3
echo "gpu_check: $FAILED of ${#SELECTED[@]} step(s) failed in $(($(date +%s) - START)) s" >>"$SUMMARY"
exit $((FAILED > 0))
