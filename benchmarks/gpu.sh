#!/usr/bin/env bash
# The GPU checks in one call, on a machine with one NVIDIA GPU (../shared/GPU.md says which wheels and data to
# carry there: .whl and .data in the project root). Carry wandb's wheels too, or its 7 tests fail; and not
# huggingface_hub 2.x, which the machine's own transformers refuses (6 harness tests then fail to import it).
# Each part writes its own file under OUT and has its own time limit, so one that hangs or fails leaves the
# others' figures:
#
#   bash benchmarks/gpu.sh OUT
#
# - env.txt: the GPU and JAX's devices;
# - attention.txt: benchmarks/attention.py (attention_core against XLA's and cuDNN's attention, bfloat16; its
#   GPT-sized shape did not finish within 80 s on an H200, 2026-11-26, after XLA's own had);
# - pytest.txt: the test suite on 12 workers (every process's GPU memory allocated as needed). On an H200
#   (2026-11-26) 97% of it ran in 280 s: 1,279 passed, 75 failed, most on float32 tolerances of 1e-4 that
#   GPU products at JAX's default precision miss by 5e-4 to 2e-3 (JAX_DEFAULT_MATMUL_PRECISION=highest
#   passed most of them again);
# - mnist_vae.txt: `nnx-train configs/mnist_vae.yaml` (30 epochs), whole process, cold (no compilation or data
#   cache) then warm, with its test negative ELBO.
# The limits keep the whole under nine minutes.
set -u
out=${1:?usage: bash benchmarks/gpu.sh OUT}
data=${DATA:-.data}
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl >"$out/install.txt" 2>&1
  export PYTHONPATH=/tmp/site
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile . >>"$out/install.txt" 2>&1
{ nvidia-smi -L; python3 -c 'import jax; print(jax.__version__, jax.devices())'; } >"$out/env.txt" 2>&1

timeout 80 python3 benchmarks/attention.py --shapes heldout,smollm2 --repeats 5 >"$out/attention.txt" 2>&1

# -v: each result as it comes, so that a run cut off by its time limit still names its failures
timeout "${PYTEST_LIMIT:-280}" python3 -m pytest -o addopts="" -n 12 -v -rfE -p no:cacheprovider --durations=10 \
  >"$out/pytest.txt" 2>&1
echo "pytest exit $?" >>"$out/pytest.txt"

for run in cold warm; do
  if [ "$run" = cold ]; then rm -rf ~/.cache/nnx; fi
  start=$(date +%s.%N)
  timeout 75 nnx-train configs/mnist_vae.yaml "data.source=$data/mnist" --workdir "/tmp/mnist_vae-$run" \
    >"$out/mnist_vae-$run.log" 2>&1
  status=$?
  end=$(date +%s.%N)
  echo "$run: exit $status, $(awk "BEGIN { printf \"%.1f\", $end - $start }") s" >>"$out/mnist_vae.txt"
  grep -i "elbo" "$out/mnist_vae-$run.log" | tail -2 >>"$out/mnist_vae.txt"
done

