#!/usr/bin/env sh
# Builds {{name}}.wasm: the component to drop into the host's plugin directory.
# Needs componentize-py: `pip install componentize-py=={{componentize_py}}` (in a virtualenv).
set -eu
cd "$(dirname "$0")"
"${COMPONENTIZE_PY:-componentize-py}" -d wit -w obx:plugin/plugin componentize app -o {{name}}.wasm
echo "built {{name}}.wasm"
