#!/usr/bin/env sh
# Builds the plugin and puts it through the host's conformance check.
set -eu
cd "$(dirname "$0")"
./build.sh
obx plugin test {{name}}.wasm
