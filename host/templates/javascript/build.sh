#!/usr/bin/env sh
# Builds {{name}}.wasm: the component to drop into the host's plugin directory.
set -eu
cd "$(dirname "$0")"
[ -x node_modules/.bin/componentize-js ] || npm install --no-audit --no-fund
npm run build
echo "built {{name}}.wasm"
