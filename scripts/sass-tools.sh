# scripts/sass-tools.sh — sourced by scripts/sass-loops.sh and scripts/sass-ops-diff.sh (not run on its own).
# Finds cuobjdump and nvdisasm (on PATH, $CUOBJDUMP, or the nvidia-cuda-* wheels in python3's path; exits 3 when
# neither is found) and defines sass_of TREE SRC OUT: SRC (relative to TREE, a checkout's root) compiled for sm_90
# with the build's device flags, its SASS written to OUT.
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || true)}
wheel_tool() {  # wheel_tool NAME: the NAME binary of an nvidia-* wheel in python3's path, or nothing
  python3 - "$1" <<'PY' 2>/dev/null || true
import glob, os, sys
try:
    import nvidia
except ImportError:
    raise SystemExit(0)
for base in nvidia.__path__:
    for f in sorted(glob.glob(os.path.join(base, "*", "bin", sys.argv[1]))):
        print(f)
        raise SystemExit(0)
PY
}
[ -n "$CUOBJDUMP" ] || CUOBJDUMP=$(wheel_tool cuobjdump)
[ -n "$CUOBJDUMP" ] || {
  echo "cuobjdump not found: set CUOBJDUMP, or pip install nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm" >&2
  exit 3
}
if ! command -v nvdisasm >/dev/null; then
  NVDISASM=$(wheel_tool nvdisasm)
  [ -n "$NVDISASM" ] || NVDISASM=$(dirname "$CUOBJDUMP")/nvdisasm
  [ -e "$NVDISASM" ] || { echo "nvdisasm not found (cuobjdump -sass runs it): pip install nvidia-cuda-nvdisasm" >&2; exit 3; }
  export PATH=$(dirname "$NVDISASM"):$PATH
fi
sass_of() {  # sass_of TREE SRC OUT
  local cubin
  cubin=$(mktemp --suffix=.cubin)
  nvcc -I"$1/include" -I"$1/src" -arch=sm_90 --expt-relaxed-constexpr --expt-extended-lambda -O3 -DNDEBUG \
    -Xcompiler=-ffp-contract=off -std=c++17 -cubin -x cu "$1/$2" -o "$cubin"
  "$CUOBJDUMP" -sass "$cubin" > "$3"
  rm -f "$cubin"
}
