#!/usr/bin/env bash
# The GPU acceptance run, in stages that each fit one device call (10 minutes):
#
#   bash benchmarks/gpu_session.sh tests   # every test that runs only with CUDA, then the rest of them
#   bash benchmarks/gpu_session.sh fit     # truth's Llama at half the GPU through the Trainer callback
#   bash benchmarks/gpu_session.sh check   # predicted against measured on the truth's configurations
#   bash benchmarks/gpu_session.sh truth   # the GPU truth again, under today's policies
#   bash benchmarks/gpu_session.sh overhead  # remat against torch's checkpoint per block, fp32 and bf16
#
# Arguments after the stage go to check's, truth's and overhead's script (``--files F``, ``--configs C``): the
# whole truth takes longer than one call, so it is remeasured a file or a few configurations a call.
# Run from the repository root with remat from src/ (the device has torch, transformers and pytest).
# What a stage writes goes to $OUT (default: gpu-out/): its log, and BENCHMARKS.md where it wrote a
# table there, for the session to merge back.
set -o pipefail
stage=${1:?usage: gpu_session.sh tests|fit|check|truth|overhead}
out=${OUT:-gpu-out}
mkdir -p "$out"
export PYTHONPATH=src PYTHONUNBUFFERED=1
python -c 'import torch, transformers; print("torch", torch.__version__, "cuda", torch.version.cuda,
  torch.cuda.get_device_name(0), "transformers", transformers.__version__)' | tee "$out/$stage.log"
case $stage in
  tests)
    cuda_tests=(tests/core/test_cuda_gradients.py tests/profiling/test_cuda_profile.py
      tests/profiling/test_fsdp_fake.py tests/planning/test_fit.py tests/planning/test_sub_batch.py
      tests/core/test_compiled.py
      tests/core/test_measure.py tests/core/test_rng.py tests/cli/test_cli.py)
    python -m pytest -q -rs -p no:cacheprovider "${cuda_tests[@]}" 2>&1 | tee -a "$out/$stage.log"
    ;;
  fit)
    python benchmarks/gpu_fit.py --write 2>&1 | tee -a "$out/$stage.log" && cp BENCHMARKS.md "$out/"
    ;;
  check)
    python benchmarks/gpu_check.py --extra --write "${@:2}" 2>&1 | tee -a "$out/$stage.log" && cp BENCHMARKS.md "$out/"
    ;;
  truth)
    mkdir -p "$out/truth" && python benchmarks/gpu_truth_remeasure.py --out "$out/truth" "${@:2}" 2>&1 | tee -a "$out/$stage.log"
    ;;
  overhead)
    python benchmarks/overhead.py --cuda --write "${@:2}" 2>&1 | tee -a "$out/$stage.log" && cp BENCHMARKS.md "$out/"
    ;;
  *)
    echo "unknown stage: $stage (tests, fit, check, truth or overhead)" >&2
    exit 2
    ;;
esac
