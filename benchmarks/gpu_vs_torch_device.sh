#!/bin/bash
# The prepared GPU run of benchmarks/gpu_vs_torch.py on a machine that has JAX, Flax,
# PyTorch and transformers but lacks some of Workbench's own packages (Grain, ArrayRecord,
# portpicker), which travel as wheels in .whl/ (and a pinned Flax/Optax/Orbax in
# .whl/pinned/, used only when the machine's own cannot import Workbench). Arguments go to
# gpu_vs_torch.py; results land in $OUT (or ./gpu-out), the profiles bundled in one file.
#   MEMFRAC  share of GPU memory the JAX side may take (default: gpu_vs_torch.sizing's,
#            from nvidia-smi's memory: on an H200 both sides run beside each other, the JAX
#            side capped at what PyTorch leaves; on an H100 (80 GB) the 1b case runs each
#            side alone, windows still interleaved, as its rows say)
#   LIMIT    seconds before the run is stopped (default 450: one device call under 8
#            minutes with the install and the transfers)
# The lent session's command (both cases, the held-out rows; about 6 minutes on an H200):
#   bash benchmarks/gpu_vs_torch_device.sh --cases 1b small --windows 3 --steps 10 --predict
set -o pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/wb-site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/wb-site
  if [ -d .whl/pinned ] && ! JAX_PLATFORMS=cpu python3 -c "import workbench.train._trainer" \
      2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/wb-pinned .whl/pinned/*.whl || exit 3
    export PYTHONPATH=/tmp/wb-pinned:/tmp/wb-site
    echo "using the carried Flax/Optax/Orbax (the machine's could not import Workbench)"
  fi
fi
export PYTHONUNBUFFERED=1
if [ -n "$MEMFRAC" ]; then export XLA_PYTHON_CLIENT_MEM_FRACTION=$MEMFRAC; fi
python3 -c "import jax; print('jax', jax.__version__)"
timeout "${LIMIT:-450}" python3 benchmarks/gpu_vs_torch.py "$@" --out "$OUT" 2>&1 \
  | grep -v "cuda_timer.cc" | tee "$OUT/log.txt"
status=$?
shopt -s nullglob
extra=("$OUT"/profile-* "$OUT"/hlo-* "$OUT"/trace-*)
if [ ${#extra[@]} -gt 0 ]; then
  tar czf "$OUT/profiles.tgz" -C "$OUT" "${extra[@]##*/}" && rm -f "${extra[@]}"
fi
exit $status
