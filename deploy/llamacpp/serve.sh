#!/usr/bin/env bash
# Two llama-servers (plain, and n-gram speculation) and specgate in front of them, with
# deploy/llamacpp/config.yaml. Needs `make install` and `make install-llamacpp`. Each server gets
# one thread pinned to a core of its own where the machine has two or more. Ctrl-C stops all three.
set -euo pipefail
cd "$(dirname "$0")/../.."
gguf="$(.venv/bin/python -c 'from models.convert_gguf import wheel_gguf; print(wheel_gguf().path)')"
last_core=$(( $(nproc) - 1 ))
common=(-m "$gguf" --host 127.0.0.1 -t 1 -np 4 -c 8192 --alias smollm2 --metrics --no-webui)
taskset -c 0 .llamacpp/llama-server "${common[@]}" --port 8081 &
taskset -c "$last_core" .llamacpp/llama-server "${common[@]}" --port 8082 --spec-type ngram-simple &
trap 'kill $(jobs -p) 2>/dev/null' EXIT
.venv/bin/specgate serve --config deploy/llamacpp/config.yaml
