# Sourced by scripts/test.d/45-lmcache.sh and 60-vllm.sh: one shared, cached
# (Variables are not named KVTIER_*: the daemon reads every KVTIER_* variable as a config key.)
# venv with PyPI torch (the CUDA build; it runs on CPU), vLLM 0.33.0 and
# LMCache 0.5.6, both `--no-deps` plus the pure-Python packages their imports
# need (recipes of reference/vllm-lmcache-api.md §5 and its addendum). One
# venv instead of two saves ~5 GB and a torch install per fresh machine.
#
# The venv lives outside the checkout so a fresh clone on the same machine
# (CI) reuses it: $KVTEST_CACHE (default ~/.cache/kvtier-test)/venv-torch,
# or $KVTEST_TORCH_VENV. Set-up is idempotent: a stamp of the package list
# decides whether to (re)install. Sets TORCH_VENV_PY to the venv's python.

_cache=${KVTEST_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/kvtier-test}
TORCH_VENV=${KVTEST_TORCH_VENV:-$_cache/venv-torch}

# Bump the stamp whenever the package list changes: the venv is then updated.
_PKGS_TORCH="torch==2.15.0"
_PKGS_VLLM="vllm==0.33.0"
_PKGS_LMCACHE="lmcache==0.5.6"
# The pins satisfy both vllm 0.33.0 and lmcache 0.5.6.
_PKGS_DEPS=(
  "numpy<=2.2.6" "protobuf>=6.33.5,<7" "prometheus_client>=0.18,<=0.24.1"
  "opentelemetry-api>=1.27,<=1.40.0" "transformers>=5.16.1,<5.21.0"
  "huggingface_hub>=1.31.0" "tokenizers>=0.23.2" "safetensors>=0.6.2"
  regex cachetools psutil requests tqdm blake3 py-cpuinfo pydantic msgspec pyzmq
  pyyaml cbor2 cloudpickle aiohttp openai openai-harmony pillow pybase64 uvloop
  "xgrammar==0.2.8" "llguidance>=1.7.0,<1.8.0" "fastapi<0.137.0,>=0.133.0"
  partial-json-parser einops sentencepiece "lark==1.2.2" "outlines_core==0.2.14"
  watchfiles python-json-logger setproctitle ijson pytest
)
_STAMP="v2 $_PKGS_TORCH $_PKGS_VLLM $_PKGS_LMCACHE ${_PKGS_DEPS[*]}"

if [ ! -x "$TORCH_VENV/bin/python" ] || [ "$(cat "$TORCH_VENV/.kvtier-stamp" 2>/dev/null)" != "$_STAMP" ]; then
  echo "setting up $TORCH_VENV (torch, vllm and lmcache --no-deps, import deps; ~5 min and ~7 GB once)"
  mkdir -p "$(dirname "$TORCH_VENV")"
  _free=$(df -Pk "$(dirname "$TORCH_VENV")" | awk 'NR == 2 { print $4 }')
  if [ "${_free:-0}" -lt $((8 << 20)) ]; then
    df -h "$(dirname "$TORCH_VENV")" >&2
    echo "the torch venv needs ~8 GB free under $(dirname "$TORCH_VENV"); free space or set KVTEST_CACHE" >&2
    exit 1
  fi
  [ -x "$TORCH_VENV/bin/python" ] || python3 -m venv "$TORCH_VENV"
  _log=$(mktemp)
  # No wheel cache: it would hold another ~3 GB next to the venv.
  _pip() { PIP_DISABLE_PIP_VERSION_CHECK=1 "$TORCH_VENV/bin/python" -m pip install -q --no-cache-dir "$@"; }
  # vllm and lmcache are installed without their (CUDA) dependencies, so pip's
  # resolver complains about them: keep its output unless a step fails.
  if ! { _pip "$_PKGS_TORCH" &&
         _pip --no-deps "$_PKGS_VLLM" "$_PKGS_LMCACHE" &&
         mapfile -t _LMREQS < <("$TORCH_VENV/bin/python" - <<'PY'
import importlib.metadata as m, re
skip = {"torch", "cupy-cuda13x", "cuda-python", "cufile-python"}
for r in m.requires("lmcache") or []:
    if "extra ==" in r:
        continue
    name = re.split(r"[<>=!~;\[ ]", r, maxsplit=1)[0].strip().lower()
    if name not in skip:
        print(r.split(";")[0].replace(" ", ""))
PY
) &&
         _pip "${_PKGS_DEPS[@]}" "${_LMREQS[@]}" "$_PKGS_TORCH" &&
         "$TORCH_VENV/bin/python" -c 'import vllm, lmcache.lmcache_redis, lmcache.v1.storage_backend'; } >"$_log" 2>&1; then
    cat "$_log"
    rm -f "$_log"
    echo "torch venv set-up failed (see above)" >&2
    exit 1
  fi
  rm -f "$_log"
  echo "$_STAMP" > "$TORCH_VENV/.kvtier-stamp"
fi
TORCH_VENV_PY=$TORCH_VENV/bin/python
