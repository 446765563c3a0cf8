#!/usr/bin/env bash
# What benchmarks/gpu.sh carries to a GPU machine that cannot download: run once, here, in the project root.
#
#   bash benchmarks/gpu_wheels.sh            # .whl/base, .whl/suite, .whl/tokamax and .data
#
# Each set is resolved with its dependencies for the machine's Python (3.12, manylinux x86_64), and only the
# wheels of distributions its image lacks are kept (PRESENT: the image's packages as the device notes list
# them, 2026-11-17), so that nothing of the image is shadowed: its huggingface_hub (1.33), which its
# transformers accepts and datasets 5.2 too, stays. The sets, by the parts that carry them:
#   .whl/base     datasets, grain and their missing dependencies (every part: the package imports them), and
#                 our other direct dependencies at their floors, for an image older than them;
#   .whl/suite    wandb, tensorboardX, lm-eval and gguf with theirs (the suite's logger, harness and GGUF tests);
#   .whl/tokamax  tokamax 0.0.17 and its dependencies but xprof (the attention part measures its kernel);
#   .whl/qlora    bitsandbytes 0.50.2, CUDA 11.8-13.2 kernels in one wheel (the qlora part's reference side);
#   .data         ../shared/data's mnist and shakespeare (the training parts read them).
# Under 64 MiB per call: base (10 MB) + suite (36 MB); base + tokamax (6 MB); base + .data (21 MB); base + qlora
# (42 MB).
set -euo pipefail
cd "$(dirname "$0")/.."
PRESENT="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite
lxml markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13
nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax
opt-einsum opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy
portalocker prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing
pyproject-hooks pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image
scikit-learn scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six
sortedcontainers statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm
transformers treescope triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel
wrapt xarray xxhash yarl zipp"
normalize() { echo "$1" | tr '[:upper:]' '[:lower:]' | sed -E 's/[-_.]+/-/g'; }
present=" $(for name in $PRESENT; do normalize "$name"; done | tr '\n' ' ') "

built=$(mktemp -d)  # lm-eval's pure-Python dependencies published as sources only, built into wheels here
python3 -m pip wheel -q --no-deps -w "$built" sqlitedict word2number rouge-score

fetch() {  # fetch SET [--no-deps] REQUIREMENT...: the set's wheels, less the image's own distributions
  local set=$1 tmp
  shift
  tmp=$(mktemp -d)
  python3 -m pip download -q --only-binary=:all: --find-links "$built" --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp" "$@"
  rm -rf ".whl/$set" && mkdir -p ".whl/$set"
  for wheel in "$tmp"/*.whl; do
    name=$(normalize "$(basename "$wheel" | cut -d- -f1)")
    if [[ "$present" != *" $name "* ]]; then mv "$wheel" ".whl/$set/"; fi
  done
  rm -rf "$tmp"
}

exclude=$(git rev-parse --git-path info/exclude)
for ignored in /.whl/ /.data/; do grep -qxF "$ignored" "$exclude" 2>/dev/null || echo "$ignored" >>"$exclude"; done
fetch base datasets==5.2.0 grain==0.2.18
# our direct dependencies that the image has, each at its floor in pyproject.toml (a set the whole suite passed
# on together), without their own: benchmarks/gpu.sh installs one only where the image's version is older, so an
# image newer than the floors keeps its own (jax and jaxlib stay the image's; scikit-learn and pillow, 18 MB, too)
floors=$(python3 - <<'EOF'
import re, tomllib
skip = {"jax", "jaxlib", "datasets", "grain", "scikit-learn", "pillow"}
for requirement in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]:
    name, floor = re.fullmatch(r"([A-Za-z0-9_.-]+)>=([0-9.]+)", requirement.split(";")[0].strip()).groups()
    if name.lower().replace("_", "-") not in skip:
        print(f"{name}=={floor}")
EOF
)
# shellcheck disable=SC2086
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any -d .whl/base $floors
fetch suite wandb==0.31.0 tensorboardX==2.6.5 lm-eval==0.4.13 gguf==0.19.0
# tokamax without xprof (32 MB, and 40 more of its dependencies): tokamax imports it for its own profiling
# only, and benchmarks/gpu.sh gives it a stub of that one name
fetch tokamax --no-deps tokamax==0.0.17 qwix==0.1.8 einshape==1.0 immutabledict==4.3.1 pydantic==2.14.4 \
  pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 tensorboardx==2.6.5
fetch qlora --no-deps bitsandbytes==0.50.2  # needs torch, numpy and packaging: the image has them
for set in suite tokamax qlora; do  # a distribution already in base travels once: two versions of one stop pip
  for wheel in .whl/base/*.whl; do rm -f ".whl/$set/$(basename "$wheel" | cut -d- -f1)"-*.whl; done
done
rm -rf "$built"
mkdir -p .data && cp -r "${SHARED_DATA:-../shared/data}"/{mnist,shakespeare} .data/
for set in .whl/*; do echo "$set: $(ls "$set" | wc -l) wheels, $(du -sh "$set" | cut -f1): $(ls "$set" | cut -d- -f1 | tr '\n' ' ')"; done
du -sh .data
