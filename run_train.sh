#!/usr/bin/env bash
# Launch torchtitan training through torchtitan_neuron's entry point.
#
#   NGPU      ranks on this host (NeuronCores, GPUs, or CPU processes); default 2
#   MODULE    recipe module, fully qualified; default the SimpleFSDP Llama module
#   CONFIG    recipe name in that module; default the CPU rehearsal recipe
#   LOG_RANK  ranks whose output is shown (torchrun --local-ranks-filter); default 0
#   COMM_MODE plan: print the memory plan for one of NGPU ranks instead of
#             training (python -m torchtitan_neuron.plan; add --target, --sweep)
#
# Every other argument passes straight through to torchtitan's trainer, e.g.
#   NGPU=2 CONFIG=simple_fsdp_llama3_debugmodel_fullac ./run_train.sh --training.steps 10
set -euo pipefail

cd "$(dirname "$0")"

NGPU=${NGPU:-2}
LOG_RANK=${LOG_RANK:-0}
MODULE=${MODULE:-torchtitan_neuron.experiments.graph_trainer.llama3}
CONFIG=${CONFIG:-simple_fsdp_llama3_debugmodel}

# The project's virtualenv (made by `make install`) unless PYTHON names another.
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

if [ "${COMM_MODE:-}" = "plan" ]; then
    exec "$PYTHON" -m torchtitan_neuron.plan --module "$MODULE" --config "$CONFIG" --ngpu "$NGPU" "$@"
fi

# Validate the config in one process first: errors show once, before any rank.
for arg in "$@"; do
    case "$arg" in -h|--help)
        exec "$PYTHON" -m torchtitan_neuron.preflight --ngpu "$NGPU" --module "$MODULE" --config "$CONFIG" "$@" ;;
    esac
done
"$PYTHON" -m torchtitan_neuron.preflight --ngpu "$NGPU" --module "$MODULE" --config "$CONFIG" "$@"

# torchrun (in torchtitan_neuron.launch) forwards SIGINT/SIGTERM to every rank;
# exec so Ctrl-C reaches it directly.
exec "$PYTHON" -m torchtitan_neuron.launch \
    --nproc_per_node="$NGPU" \
    --rdzv_backend c10d --rdzv_endpoint="localhost:0" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan_neuron.train --module "$MODULE" --config "$CONFIG" "$@"
