#!/usr/bin/env sh
# Builds {{name}}.wasm: the component to drop into the host's plugin directory.
set -eu
cd "$(dirname "$0")"
rustup target add wasm32-wasip2 >/dev/null 2>&1 || true
cargo build --release --target wasm32-wasip2
cp "${CARGO_TARGET_DIR:-target}/wasm32-wasip2/release/{{name}}.wasm" {{name}}.wasm
echo "built {{name}}.wasm"
