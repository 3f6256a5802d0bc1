#!/usr/bin/env bash
# Install fsdptrain into a virtual environment (.venv by default, or the active one), with the test and plot extras.
#
# torch: a torch already installed in that environment is kept as it is (bring your own CUDA build first:
#   python -m venv .venv && .venv/bin/pip install torch --index-url <your CUDA index>; then run this script).
# With no torch there, it installs torch==${FSDPTRAIN_TORCH:-2.13.0}; on our CPU machines pip takes that CPU wheel from
# the local disk. Everything else is installed under a constraint that holds torch at the installed version, so no
# dependency can swap it for a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${VIRTUAL_ENV:-${FSDPTRAIN_VENV:-.venv}}"
PY="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)

if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  "${PIP[@]}" install "torch==${FSDPTRAIN_TORCH:-2.13.0}"
fi
TORCH_VERSION="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
CONSTRAINTS="$(mktemp)"
trap 'rm -f "$CONSTRAINTS"' EXIT
echo "torch==${TORCH_VERSION}" > "$CONSTRAINTS"
"${PIP[@]}" install -c "$CONSTRAINTS" -e ".[test]"
echo "fsdptrain installed in $VENV (torch $TORCH_VERSION)"
