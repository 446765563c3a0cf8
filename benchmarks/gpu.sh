#!/usr/bin/env bash
# The GPU figures (issue 34), a part per call, each within 8 minutes on one H100 and ending with its table:
#
#   bash benchmarks/gpu.sh PART[:SECONDS][,PART...] [OUT]   # OUT: where the logs go (default $OUT, else /tmp/gpu-PARTS)
#
# Parts run in the order given; SECONDS caps a part's steps together (a stretch of GPU time that holds less than
# two whole parts can hold the first figures of two: `train:220,suite` with FIGURES=gpt2). A step that reaches
# its limit gets SIGINT first, so pytest still prints the failures it has seen, and KILL 30 s later.
#
# Once, here: `bash benchmarks/gpu_wheels.sh` (the wheels the machine lacks, and the data). Then one `run`
# per part, timeout_s 540, carrying what the part needs (every part installs .whl/*/*.whl that came along):
#
# | part | carry | what it measures |
# | --- | --- | --- |
# | suite | .whl/base .whl/suite | the test suite on 12 workers (CLI runs on the CPU: cli_support.CLI_PLATFORM), then benchmarks/decode_gap.py |
# | attention | .whl/base .whl/tokamax | the GPT-2-small attention: each implementation and pass compiled and run apart, the old harness and XLA's autotuner off beside them (benchmarks/attention.py) |
# | train | .whl/base .data | GPT-2 small's model-FLOPs utilisation and shakespeare_char, against PyTorch (benchmarks/gpt.py) |
# | profile | .whl/base | where GPT-2 small's bfloat16 step spends its time (each operation named; the head's gradient recomputing the logits, remat dots, unrolled), and shakespeare_char's |
# | lora | .whl/base | LoRA and full fine-tuning against transformers + peft, bfloat16 both (benchmarks/lora.py --part 1) |
# | qlora | .whl/base .whl/qlora | QLoRA, the bfloat16 and float32 bases against transformers + peft + bitsandbytes QLoRA (benchmarks/qlora.py --part 1) |
# | apps | .whl/base .data | mnist_vae cold and warm against the plain on-device script; nnx-generate against transformers |
#
# GPU_SH_CPU=1 runs a part's commands at tiny sizes on this machine's CPU, installing nothing (a smoke test of
# the script: PYTHONPATH at the checkout, REFERENCE a Python with torch, DATA a directory holding mnist and
# shakespeare):
#
#   GPU_SH_CPU=1 REFERENCE=/work/refvenv/bin/python DATA=/work/shared/data bash benchmarks/gpu.sh apps
set -u
parts=${1:?usage: bash benchmarks/gpu.sh suite|attention|train|profile|lora|qlora|apps[:SECONDS][,...] [OUT]}
out=${2:-${OUT:-/tmp/gpu-${parts//[:,]/-}}}
cpu=${GPU_SH_CPU:-0}
data=$(realpath "${DATA:-.data}")
for spec in ${parts//,/ }; do
  case "${spec%%:*}" in
  suite | attention | train | profile | lora | qlora | apps) ;;
  *)
    echo "unknown part ${spec%%:*}: suite, attention, train, profile, lora, qlora or apps" >&2
    exit 2
    ;;
  esac
done
mkdir -p "$out"
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
start=$(date +%s)

if [ "$cpu" = 1 ]; then
  export JAX_PLATFORMS=cpu
  py=${PYTHON:-python}
  reference=${REFERENCE:-$py}
  device=cpu
else
  py=python3
  reference=python3  # the machine's own Python holds torch, transformers and peft
  device=cuda
  site=/tmp/site
  mkdir -p "$site"
  declare -A seen=()
  wheels=()
  for wheel in .whl/*/*.whl; do  # one version of a distribution: two stop pip
    [ -e "$wheel" ] || continue
    name=$(basename "$wheel" | cut -d- -f1 | tr '[:upper:]' '[:lower:]')
    [ -n "${seen[$name]:-}" ] && continue
    seen[$name]=1
    wheels+=("$wheel")
  done
  # a wheel of a distribution the image has at the same version or newer stays behind (the floors in .whl/base)
  mapfile -t wheels < <(python3 - "${wheels[@]}" <<'EOF'
import os, sys
from importlib import metadata
from packaging.version import Version
for wheel in sys.argv[1:]:
    name, version = os.path.basename(wheel).split("-")[:2]
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        print(wheel)
        continue
    if Version(have) < Version(version):
        print(wheel)
        print(f"{name}: the image's {have} is older than {version}, installing the carried wheel", file=sys.stderr)
EOF
  )
  install() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" "$@"; }
  # one pip for them all (a second a wheel apart); wheel by wheel only if that fails, to name the one at fault
  if [ "${#wheels[@]}" -gt 0 ] && ! install "${wheels[@]}" >>"$out/install.txt" 2>&1; then
    for wheel in "${wheels[@]}"; do
      install "$wheel" >>"$out/install.txt" 2>&1 || echo "could not install $wheel" | tee -a "$out/install.txt"
    done
  fi
  if [ -d .whl/tokamax ] && ! PYTHONPATH=$site python3 -c "import xprof.cli.tools" 2>/dev/null; then
    # tokamax imports this one name of xprof (its own profiling, unused here) when it loads
    mkdir -p "$site/xprof/cli" && touch "$site/xprof/__init__.py" "$site/xprof/cli/__init__.py"
    echo "get_kernel_stats_tool = None" >"$site/xprof/cli/tools.py"
  fi
  export PYTHONPATH=$site
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile . >>"$out/install.txt" 2>&1
fi
{
  nvidia-smi -L 2>/dev/null
  $py - <<'EOF'
import importlib
import jax
print("jax", jax.__version__, jax.devices())
for name in "datasets grain wandb tensorboardX lm_eval tokamax torch transformers peft bitsandbytes".split():
    try:
        print(name, getattr(importlib.import_module(name), "__version__", "?"))
    except Exception as error:  # what the part lacks, said
        print(name, "missing:", repr(error)[:200])
from importlib import metadata
for name in "optax orbax-checkpoint typer rich pyyaml safetensors huggingface_hub jinja2 xxhash".split():
    try:
        print(name, metadata.version(name))
    except metadata.PackageNotFoundError:
        print(name, "missing")
EOF
} >"$out/env.txt" 2>&1
cat "$out/env.txt"

step() {  # step SECONDS NAME COMMAND...: the command under its time limit (and the part's), output in OUT/NAME.log
  local limit=$1 name=$2
  shift 2
  if [ -n "$cap" ]; then
    local left=$((part_start + cap - $(date +%s)))
    [ "$left" -lt "$limit" ] && limit=$left
    [ "$limit" -lt 10 ] && echo "$name: skipped, its part's $cap s are spent" | tee -a "$out/status.txt" && return 0
  fi
  echo "== $name (limit ${limit} s, $(($(date +%s) - start)) s into the call)"
  timeout -s INT -k 30 "$limit" "$@" >"$out/$name.log" 2>&1
  local status=$?
  [ "$status" = 0 ] || echo "$name: exit $status$([ "$status" = 124 ] && echo ' (time limit)')" | tee -a "$out/status.txt"
  return 0
}
tables() {  # the markdown tables of the logs named
  for name in "$@"; do
    [ -e "$out/$name.log" ] || continue
    echo
    echo "### $name"
    grep -E '^\|' "$out/$name.log" || tail -3 "$out/$name.log"
  done
}

run_part() {
case "$part" in
suite)
  if [ "$cpu" = 1 ]; then
    step 600 pytest $py -m pytest -o addopts="" -n 2 -q -p no:cacheprovider tests/test_lm_attention.py \
      tests/test_data_pipeline.py -k "implementation or on_device or workers"
  else
    # the one failure the H200 runs left open, first (the suite may reach its cap): bfloat16 cached decoding
    # against a full pass. On 2026-11-28 the core's full pass equalled cuDNN's bit for bit and decoding differed
    # alike with either: the core's rows, the products table and the child with excess precision off tell what
    # is left apart (about 20 s a table there)
    step 90 decode_gap $py benchmarks/decode_gap.py --attentions core
    # -v: each result as it comes, so that a run cut off by its time limit still names its failures
    # TESTS: what to run (default all); e.g. the files a cut-off run did not reach
    step 450 pytest $py -m pytest -o addopts="" -n 12 --dist loadscope -v -rfE -p no:cacheprovider --durations=15 \
      ${TESTS:-tests}
  fi
  echo
  echo "| suite | result |"
  echo "| --- | --- |"
  summary=$(grep -E '(passed|failed|error).* in [0-9.]+s' "$out/pytest.log" | tail -1 | tr -d '=')
  echo "| ${summary:-no summary: cut off by its time limit, see pytest.log} | $(grep -c '^FAILED' "$out/pytest.log") failed tests named in pytest.log |"
  tables decode_gap
  ;;
attention)
  if [ "$cpu" = 1 ]; then
    step 300 attention $py benchmarks/attention.py --shapes smollm2 --implementations jax-xla,core,core-closed \
      --repeats 1 --timeout 120
  else
    step 400 attention $py benchmarks/attention.py --shapes gpt --timeout 60 \
      --implementations jax-xla,xla,core,core-closed,cudnn,tokamax
    step 100 attention-autotune-off $py benchmarks/attention.py --shapes gpt --implementations core --timeout 45 \
      --xla-flags=--xla_gpu_autotune_level=0
  fi
  tables attention attention-autotune-off
  ;;
train)
  tiny=$([ "$cpu" = 1 ] && echo --tiny)
  step 470 gpt $py benchmarks/gpt.py --data "$data/shakespeare" --reference "$reference" --figures "${FIGURES:-gpt2,shakespeare}" $tiny
  tables gpt
  ;;
profile)
  # where GPT-2 small's bfloat16 step spends its time (benchmarks/gpt.py's MFU figure: 32.7% against
  # torch.compile's 53.3% on an H200, 2026-11-28). Each run prints its step's wall time, tokens/s (MFU scales with
  # them) and how much of the step the GPU was busy; the first with XLA's command buffers (CUDA graphs) off, so
  # that the trace names each operation (with them on it names only the buffers)
  shape=$([ "$cpu" = 1 ] && echo "--layers 2 --seq-len 128 --batch 2" || echo "--batch 16")
  common="benchmarks/profile_step.py --shape gpt2 --dtype bfloat16 $shape --warmup 3 --time-steps 5 --trace-steps 3"
  step 60 profile-gpt2-ops env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" $py $common --top 40 --details
  step 60 profile-gpt2 $py $common --top 10
  # the head's gradient computing the logits again, as before 2026-11-30 (now from the 1.6 GB the chunks keep)
  step 60 profile-gpt2-recompute $py $common --loss-keep-mb 0 --top 10
  step 60 profile-gpt2-remat-dots $py $common --remat dots --top 10
  step 120 profile-gpt2-unrolled $py $common --unrolled --top 10  # did not compile within 60 s on an H200
  # shakespeare_char's step (did not reach 5,000 steps in 165 s there: under 0.55 M tokens/s, PyTorch 0.91 M;
  # its bare step ran 9.8 ms at batch 64, 1.68 M tokens/s, on 2026-11-28)
  small=$([ "$cpu" = 1 ] && echo "--layers 1 --batch 4" || echo "--batch 64")
  step 60 profile-shakespeare env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" $py \
    benchmarks/profile_step.py --shape shakespeare --dtype bfloat16 --dropout 0.2 $small --warmup 3 --time-steps 5 \
    --trace-steps 5 --top 20 --details
  names="profile-gpt2-ops profile-gpt2 profile-gpt2-recompute profile-gpt2-remat-dots profile-gpt2-unrolled"
  for name in $names profile-shakespeare; do
    echo "$name: $(grep -h 'one step' "$out/$name.log" 2>/dev/null)"
  done
  tables profile-gpt2-ops profile-shakespeare
  ;;
lora)
  if [ "$cpu" = 1 ]; then
    step 400 lora $py benchmarks/lora.py --reference "$reference" --part 1 --shapes tiny --speed-steps 4 --force
  else
    step 470 lora $py benchmarks/lora.py --reference "$reference" --part 1 --device cuda --speed-steps 30
  fi
  tables lora
  ;;
qlora)
  # issue 35's GPU figure: a QLoRA step's tokens/s against bitsandbytes' (and the 16-bit bases'), one Qwen2.5-0.5B
  # shape for both sides, computing in bfloat16; the peaks are each side's GPU memory
  if [ "$cpu" = 1 ]; then
    step 400 qlora $py benchmarks/qlora.py --reference "$reference" --part 1 --tiny --speed-steps 4 --force
  else
    step 480 qlora $py benchmarks/qlora.py --reference "$reference" --part 1 --device cuda --speed-steps 20
  fi
  tables qlora
  grep -E 'tokens/s / |memory / ' "$out/qlora.log"
  ;;
apps)
  epochs=$([ "$cpu" = 1 ] && echo 1 || echo 30)
  # cold: an empty data cache (the PNGs decoded, on every core) and an empty compilation cache; then warm
  HF_HOME=$(mktemp -d) && export HF_HOME  # never under OUT: what is there comes back from the machine
  step 150 mnist_vae $py benchmarks/time_to_result.py configs/mnist_vae.yaml "data.source=$data/mnist" \
    "train.epochs=$epochs" --no-baseline
  step 100 plain_vae $py benchmarks/plain_vae.py --source "$data/mnist" --epochs "$epochs" --on-device
  if [ "$cpu" = 1 ]; then
    step 300 generate $py benchmarks/hf_generate.py --reference "$reference" --tiny --runs 1 --max-tokens 8
  else
    step 250 generate $py benchmarks/hf_generate.py --reference "$reference" --device cuda --runs 2
  fi
  # the cold run's compiling (11.2 s of its 20.2 on an H200) with XLA's GPU autotuner off: the data cache is warm
  # by now, the compilation cache empty again, so its compile phase compares with the first run's
  step 60 mnist_vae-autotune-off env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_autotune_level=0" \
    $py benchmarks/time_to_result.py configs/mnist_vae.yaml "data.source=$data/mnist" "train.epochs=$epochs" --no-baseline
  cold=$(awk '/nnx-train, cold/ {print $3}' "$out/mnist_vae.log")
  warm=$(awk '/nnx-train, warm/ {print $3}' "$out/mnist_vae.log")
  plain=$(grep -o '"seconds": [0-9.]*' "$out/plain_vae.log" | awk '{printf "%.1f", $2}')
  echo
  echo "| figure | nnx | baseline | target |"
  echo "| --- | --- | --- | --- |"
  echo "| mnist_vae, $epochs epochs, cold (data and compilation caches empty) | ${cold:-?} s | plain on-device script ${plain:-?} s | at most 15 s |"
  echo "| mnist_vae, warm | ${warm:-?} s | | at most 8 s |"
  grep -E '^\| [0-9]+ \|' "$out/generate.log" | sed 's/^| \([0-9]*\) | \(.*\) | \(.*\) | \(.*\) |$/| nnx-generate batch \1 tokens\/s | \2 | transformers \3 (\4) | |/'
  grep -E 'cold|warm' "$out/mnist_vae.log"
  grep -E 'cold|warm' "$out/mnist_vae-autotune-off.log" 2>/dev/null | sed 's/^/autotuner off: /'
  ;;
esac
echo
echo "part $part: $(($(date +%s) - part_start)) s; logs in $out"
}

for spec in ${parts//,/ }; do
  part=${spec%%:*}
  cap=$([ "$spec" != "$part" ] && echo "${spec#*:}")
  part_start=$(date +%s)
  run_part
done
if [ -s "$out/status.txt" ]; then  # the steps that failed or reached their limit: the call's status says so
  cat "$out/status.txt"
  exit 1
fi
