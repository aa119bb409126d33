#!/usr/bin/env bash
# scripts/fetch-wheels.sh — download the pinned Python packages the H200 image lacks into .whl/ (git-ignored),
# for scripts/device-check.sh to install there (the device has no network: pass `.whl` in the run's carry).
# Pinned: diffusers 0.42.1 (the release the diffusers sites and tests are written against) and its one
# dependency missing from the image, importlib_metadata.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
mkdir -p "$ROOT/.whl"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d "$ROOT/.whl" diffusers==0.42.1 importlib_metadata==10.2.0
ls "$ROOT/.whl"
