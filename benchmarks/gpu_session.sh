#!/usr/bin/env bash
# The GPU acceptance run, in stages that fit a device call (10 minutes) and a session's device time (15 minutes):
#
#   bash benchmarks/gpu_session.sh all       # tests, then check, then overhead, each within its share of $LIMIT s
#   bash benchmarks/gpu_session.sh tests     # every test marked gpu (tests/conftest.py): the CUDA paths
#   bash benchmarks/gpu_session.sh fit       # truth's Llama at half the GPU through the Trainer callback
#   bash benchmarks/gpu_session.sh check     # predicted against measured on the truth's configurations
#   bash benchmarks/gpu_session.sh truth     # the GPU truth again, under today's policies
#   bash benchmarks/gpu_session.sh overhead  # remat against torch's checkpoint per block, fp32 and bf16
#
# Arguments after the stage go to check's, truth's and overhead's script (``--files F``, ``--configs C``,
# check's ``--extra``; check without any runs every configuration and --extra's): the whole truth takes
# longer than one call, so it is remeasured a file or a few configurations a call, e.g.
#
#   LIMIT=540 bash benchmarks/gpu_session.sh all --files h100.json h100-bf16.json --configs gpt2-small-1024 llama-1b-2048
# Run from the repository root with remat from src/ (the device has torch, transformers and pytest).
# What a stage writes goes to $OUT (default: gpu-out/): its log, and BENCHMARKS.md where it wrote a
# table there, for the session to merge back.
#
# NOTE [A stage stopped at its limit still reports]
# The first GPU session lost the tracebacks of a test stage killed at its limit (pytest prints them at
# the end). A stage runs under ``timeout -s INT``: pytest answers the interrupt with the failures so far,
# and the scripts print each row as it is measured. ``all`` gives each stage a share of $LIMIT (default
# 540 s): tests 40%, check 35%, overhead the rest.
set -o pipefail
stage=${1:?usage: gpu_session.sh all|tests|fit|check|truth|overhead}
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
limit=${LIMIT:-540}

versions() {
  python -c 'import torch, transformers; cuda = torch.cuda.is_available()
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0) if cuda else "(no GPU)",
  "transformers", transformers.__version__)'
}

within() {  # within SECONDS COMMAND...: interrupted (then killed 15 s later) when its share is spent
  local seconds=$1
  shift
  timeout -s INT -k 15 "$seconds" "$@"
}

run_stage() {  # run_stage NAME SECONDS [ARGS...]
  local name=$1 seconds=$2
  shift 2
  versions | tee "$out/$name.log"
  case $name in
    tests)
      within "$seconds" python -m pytest -m gpu tests/ -v -rfEs --tb=short --durations=10 -p no:cacheprovider \
        2>&1 | tee -a "$out/$name.log"
      ;;
    fit)
      within "$seconds" python benchmarks/gpu_fit.py --write 2>&1 | tee -a "$out/$name.log" && cp BENCHMARKS.md "$out/"
      ;;
    check)
      (($# == 0)) && set -- --extra  # no arguments: every configuration, the truth's and --extra's
      within "$seconds" python benchmarks/gpu_check.py --write "$@" 2>&1 | tee -a "$out/$name.log" \
        && cp BENCHMARKS.md "$out/"
      ;;
    truth)
      mkdir -p "$out/truth"
      within "$seconds" python benchmarks/gpu_truth_remeasure.py --out "$out/truth" "$@" 2>&1 | tee -a "$out/$name.log"
      ;;
    overhead)
      within "$seconds" python benchmarks/overhead.py --cuda --write "$@" 2>&1 | tee -a "$out/$name.log" \
        && cp BENCHMARKS.md "$out/"
      ;;
    *)
      echo "unknown stage: $name (all, tests, fit, check, truth or overhead)" >&2
      return 2
      ;;
  esac
}

case $stage in
  all)
    start=$SECONDS
    run_stage tests $((limit * 40 / 100))
    echo "tests: rc $? after $((SECONDS - start)) s" | tee -a "$out/summary.log"
    run_stage check $((limit * 35 / 100)) "${@:2}"
    echo "check: rc $? after $((SECONDS - start)) s" | tee -a "$out/summary.log"
    left=$((limit - (SECONDS - start)))
    ((left > 30)) && run_stage overhead "$left" --rounds 4 --steps 2
    echo "overhead: rc $? after $((SECONDS - start)) s" | tee -a "$out/summary.log"
    ;;
  *)
    run_stage "$stage" "$limit" "${@:2}"
    ;;
esac
