#!/usr/bin/env bash
# The distributed tests marked `compat` on the lowest torch setup.py allows, in a second Python
# environment kept between runs on the same machine (PyPI's only torch 2.11 for x86_64 is the
# CUDA build: about 4.5 GB with its nvidia-* wheels; it runs on the CPU).
#
# Usage: bash scripts/test_lowest_torch.sh [pytest args...]
#   LOWEST_TORCH   the version to test (default: the one setup.py's range starts at)
#   LOWEST_TORCH_ENV  where the environment lives (default: ~/.cache/dynmo/torch<major.minor>)
#   COMPAT_SET     all (default): every `compat` test; api: all but the process-level ones (signals and
#                  faults: how ranks stop and report, which no torch API release changes), for a
#                  second torch in CI (docs/testing.md)
# The sparse-kernel extension is not built there (its in-tree module belongs to the main
# environment's torch); the package is imported from this checkout.
set -euo pipefail
cd "$(dirname "$0")/.."
LOWEST_TORCH="${LOWEST_TORCH:-$(python - <<'PY'
import re
text = open("setup.py").read()
print(re.search(r'"torch>=([0-9.]+)"', text).group(1))
PY
)}"
MAJOR_MINOR="$(echo "$LOWEST_TORCH" | cut -d. -f1,2)"
ENV_DIR="${LOWEST_TORCH_ENV:-$HOME/.cache/dynmo/torch$MAJOR_MINOR}"
PY="$ENV_DIR/bin/python"

if ! "$PY" -c "import torch, lightning, pytest, hydra, transformers; assert torch.__version__.startswith('$LOWEST_TORCH')" 2>/dev/null; then
  echo "test_lowest_torch: creating $ENV_DIR with torch==$LOWEST_TORCH (once per machine)"
  python -m venv "$ENV_DIR"
  "$PY" -m pip install -q "torch==$LOWEST_TORCH" "setuptools>=70" wheel
  # setup.py's dependencies and the dev extra, without building the extension or re-resolving torch
  DYNMO_SKIP_EXTENSION=1 "$PY" -m pip install -q --no-build-isolation -e ".[dev]" "torch==$LOWEST_TORCH"
fi
echo "test_lowest_torch: $("$PY" -c 'import torch, lightning; print(f"torch {torch.__version__}, lightning {lightning.__version__}")')"
case "${COMPAT_SET:-all}" in
  all) SELECT=() ;;
  api) SELECT=(--ignore tests/distributed/test_signals.py --ignore tests/distributed/test_fault.py) ;;
  *) echo "test_lowest_torch: COMPAT_SET must be all or api, not '$COMPAT_SET'" >&2; exit 2 ;;
esac
echo "test_lowest_torch: COMPAT_SET=${COMPAT_SET:-all}"
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider -m compat tests/distributed \
  ${SELECT[@]+"${SELECT[@]}"} "$@"
