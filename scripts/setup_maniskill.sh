#!/usr/bin/env bash
# Set up ManiSkill3 (mani-skill 3.0.1, sapien 3.0.3) on a GPU-less Debian bookworm machine.
#
# Idempotent. Steps:
#   1. apt: libvulkan1 + mesa-vulkan-drivers (Vulkan loader, libLLVM-15 and friends).
#   2. Mesa 25 lavapipe from bookworm-backports, fetched with a private apt config
#      (system sources untouched), unpacked into <repo>/.cache/mesa25, ICD json made absolute.
#   3. pip install mani-skill and its pins into $PY's environment, torch held at 2.13.0.
#   4. Print the VK_ICD_FILENAMES export line.
#
# Usage: PY=.venv/bin/python bash scripts/setup_maniskill.sh
# Env:   PY          python interpreter of the target venv (default: <repo>/.venv/bin/python)
#        VLA_RL_CACHE  folder for the driver (default: <repo>/.cache; an installed package reads
#                    $VLA_RL_CACHE or ~/.cache/vla-rl)
#        SKIP_APT=1  skip the apt-get install step
#        SKIP_PIP=1  skip the pip step
set -euo pipefail

SCRIPT_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO_ROOT="$(cd "$SCRIPT_DIR/.." && pwd)"
PY="${PY:-$REPO_ROOT/.venv/bin/python}"
MESA_DIR="${VLA_RL_CACHE:-$REPO_ROOT/.cache}/mesa25"
MESA_VERSION_PREFIX="25."
ICD_SRC="$MESA_DIR/usr/share/vulkan/icd.d/lvp_icd.json"
ICD_OUT="$MESA_DIR/lvp_icd.x86_64.json"
LVP_LIB="$MESA_DIR/usr/lib/x86_64-linux-gnu/libvulkan_lvp.so"

log() { echo "[setup_maniskill] $*" >&2; }

SUDO=""
if [ "$(id -u)" != "0" ]; then SUDO="sudo"; fi

# ---------------------------------------------------------------- 1. apt packages
if [ "${SKIP_APT:-0}" != "1" ]; then
    need=()
    for p in libvulkan1 mesa-vulkan-drivers; do
        if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
            need+=("$p")
        fi
    done
    if [ "${#need[@]}" -gt 0 ]; then
        # apt-get update only when the package lists don't know the packages yet
        if ! apt-cache show "${need[@]}" >/dev/null 2>&1; then
            log "apt-get update"
            $SUDO apt-get update -q -o DPkg::Lock::Timeout=600
        fi
        log "apt-get install ${need[*]}"
        DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q -o DPkg::Lock::Timeout=600 "${need[@]}"
    else
        log "apt packages already installed"
    fi
fi

# ---------------------------------------------------------------- 2. Mesa 25 lavapipe
if [ -f "$LVP_LIB" ] && [ -f "$ICD_OUT" ]; then
    log "Mesa 25 lavapipe already unpacked in $MESA_DIR"
else
    WORK="$(mktemp -d)"
    trap 'rm -rf "$WORK"' EXIT
    mkdir -p "$WORK/sources.list.d" "$WORK/lists/partial" "$WORK/cache/archives/partial" "$WORK/dl"
    cat > "$WORK/sources.list.d/backports.sources" <<'EOF'
Types: deb
URIs: http://deb.debian.org/debian
Suites: bookworm-backports
Components: main
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
EOF
    APTOPT=(-o "Dir::Etc::SourceList=/dev/null"
            -o "Dir::Etc::SourceParts=$WORK/sources.list.d"
            -o "Dir::State::Lists=$WORK/lists"
            -o "Dir::Cache=$WORK/cache"
            -o "APT::Sandbox::User=root")
    log "fetching bookworm-backports package list (private apt config)"
    apt-get "${APTOPT[@]}" update -q >&2
    ver="$(apt-cache "${APTOPT[@]}" madison mesa-vulkan-drivers \
           | awk -F'|' '{gsub(/ /,"",$2); print $2}' | grep "^${MESA_VERSION_PREFIX}" | head -n1)"
    if [ -z "$ver" ]; then
        log "ERROR: no mesa-vulkan-drivers ${MESA_VERSION_PREFIX}x in bookworm-backports"
        exit 1
    fi
    log "downloading mesa-vulkan-drivers=$ver"
    (cd "$WORK/dl" && apt-get "${APTOPT[@]}" download "mesa-vulkan-drivers=$ver" >&2)
    rm -rf "$MESA_DIR.tmp"
    mkdir -p "$MESA_DIR.tmp"
    dpkg -x "$WORK"/dl/mesa-vulkan-drivers_*.deb "$MESA_DIR.tmp"
    rm -rf "$MESA_DIR"
    mv "$MESA_DIR.tmp" "$MESA_DIR"
    echo "$ver" > "$MESA_DIR/VERSION"
fi
if [ ! -f "$ICD_OUT" ]; then
    # same content as Mesa's lvp_icd.json, library_path made absolute
    python3 - "$ICD_SRC" "$ICD_OUT" "$LVP_LIB" <<'EOF'
import json, sys
src, out, lib = sys.argv[1:]
d = json.load(open(src))
d["ICD"]["library_path"] = lib
json.dump(d, open(out, "w"), indent=4)
EOF
fi

# ---------------------------------------------------------------- 3. pip
if [ "${SKIP_PIP:-0}" != "1" ]; then
    if [ ! -x "$PY" ]; then
        log "ERROR: python interpreter not found: $PY (set PY=...)"
        exit 1
    fi
    CONSTRAINTS="$(mktemp)"
    # torch is pinned so that no CUDA build of torch gets pulled in
    cat > "$CONSTRAINTS" <<'EOF'
torch==2.13.0
numpy<2
opencv-python<4.12
EOF
    if ! "$PY" -c "import torch" 2>/dev/null; then
        log "installing torch==2.13.0 first"
        "$PY" -m pip install -q -c "$CONSTRAINTS" "torch==2.13.0"
    fi
    log "pip install mani-skill==3.0.1 sapien==3.0.3 (torch held at 2.13.0)"
    "$PY" -m pip install -q -c "$CONSTRAINTS" \
        "mani-skill==3.0.1" "sapien==3.0.3" "numpy<2" "opencv-python<4.12" "mplib==0.1.1"
    rm -f "$CONSTRAINTS"
fi

# ---------------------------------------------------------------- 4. export line
log "done. Use:"
echo "export VK_ICD_FILENAMES=$ICD_OUT"
