# Source me: sets VK_ICD_FILENAMES to the Mesa 25 lavapipe unpacked by scripts/setup_maniskill.sh.
# Usage: source scripts/maniskill_env.sh
_ms_repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
_ms_icd="${VLA_RL_CACHE:-$_ms_repo/.cache}/mesa25/lvp_icd.x86_64.json"
if [ -f "$_ms_icd" ]; then
    export VK_ICD_FILENAMES="${VK_ICD_FILENAMES:-$_ms_icd}"
else
    echo "maniskill_env.sh: $_ms_icd missing; run scripts/setup_maniskill.sh first" >&2
fi
unset _ms_repo _ms_icd
