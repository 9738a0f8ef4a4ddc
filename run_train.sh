#!/usr/bin/env bash
# Launch torchtitan training through torchtitan_neuron's entry point.
#
#   NGPU      ranks on this host (NeuronCores, GPUs, or CPU processes); default 2
#   MODULE    recipe module, fully qualified; default the SimpleFSDP Llama module
#   CONFIG    recipe name in that module; default the CPU rehearsal recipe
#   LOG_RANK  ranks whose output is shown (torchrun --local-ranks-filter); default 0
#   COMM_MODE unset: a real run of NGPU ranks under torchrun. Otherwise one of
#             plan: print the memory plan for one of NGPU ranks instead of
#               training (python -m torchtitan_neuron.plan; add --target, --sweep)
#             rehearse: trace the first two steps as one of NGPU ranks on the
#               neuron branch, without Trainium, and check what would go to
#               the Neuron compiler (python -m torchtitan_neuron.rehearse;
#               add --target, --json); exit 0 ready, 1 not ready, 2 bad recipe
#             fake_backend: torchtitan's dry run, as upstream's run_train.sh
#               does it: one process, no torchrun, fake process groups of NGPU
#               ranks (RANK picks the rank simulated, default 0); builds the
#               model at that layout and runs one step (--training.steps 1,
#               which later arguments override). Losses are not meaningful.
#             local_tensor: torchtitan's LocalTensor mode, one process; in
#               torchtitan 0.3.0 it parses the config and stops before training.
#             Any other value is refused (exit 2).
#   PREFLIGHT 0: skip the one-process config check (about 8 s of CPU) for a
#             config already checked, e.g. the same run launched again
#
# Several nodes (run the same command on each; NGPU is ranks per node):
#   NNODES        number of nodes; default 1 (everything below is then unused)
#   RDZV_ENDPOINT host:port of torchrun's c10d rendezvous, the same on every
#                 node; or MASTER_ADDR and MASTER_PORT (default 29500)
#   NODE_RANK     this node's index, 0..NNODES-1 (names its log folder)
#   RDZV_ID       job id shared by the nodes; default torchtitan_neuron
#   RDZV_TIMEOUT  seconds to wait for every node to join; default 600
#   LOG_DIR       where each rank's stdout/stderr files go; default
#                 ./outputs/logs/node<NODE_RANK>
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

COMM_MODE=${COMM_MODE:-}
case "$COMM_MODE" in
    ""|plan|rehearse|fake_backend|local_tensor) ;;
    *)
        echo "Error: COMM_MODE=$COMM_MODE is not a mode of this launcher. Leave" \
             "COMM_MODE unset for a real run, or set it to plan, rehearse," \
             "fake_backend or local_tensor." >&2
        exit 2 ;;
esac

if [ "$COMM_MODE" = "plan" ]; then
    exec "$PYTHON" -m torchtitan_neuron.plan --module "$MODULE" --config "$CONFIG" --ngpu "$NGPU" "$@"
fi

if [ "$COMM_MODE" = "rehearse" ]; then
    exec "$PYTHON" -m torchtitan_neuron.rehearse --module "$MODULE" --config "$CONFIG" --ngpu "$NGPU" "$@"
fi

if [ "$COMM_MODE" = "fake_backend" ] || [ "$COMM_MODE" = "local_tensor" ]; then
    # torchtitan reads the simulated world size from NGPU (and rank from RANK).
    # The fixed options come before "$@" so the caller's flags win.
    DRY_RUN=(--module "$MODULE" --config "$CONFIG" --comm.mode="$COMM_MODE" --training.steps 1 "$@")
    if [ "${PREFLIGHT:-1}" != 0 ]; then
        "$PYTHON" -m torchtitan_neuron.preflight --ngpu "$NGPU" "${DRY_RUN[@]}"
    fi
    echo "torchtitan_neuron: COMM_MODE=$COMM_MODE, one process simulating $NGPU ranks" >&2
    NGPU="$NGPU" LOCAL_RANK=0 exec "$PYTHON" -m torchtitan_neuron.train "${DRY_RUN[@]}"
fi

export NNODES=${NNODES:-1}
if [ "$NNODES" = 1 ]; then
    RDZV=(--rdzv_backend c10d --rdzv_endpoint="localhost:0")
else
    ENDPOINT=${RDZV_ENDPOINT:-}
    if [ -z "$ENDPOINT" ] && [ -n "${MASTER_ADDR:-}" ]; then
        ENDPOINT="$MASTER_ADDR:${MASTER_PORT:-29500}"
    fi
    if [ -z "$ENDPOINT" ]; then
        echo "Error: NNODES=$NNODES needs the rendezvous endpoint: set RDZV_ENDPOINT=host:port" \
             "(or MASTER_ADDR and MASTER_PORT) to the same address on every node," \
             "e.g. the first node's hostname and a free port." >&2
        exit 2
    fi
    NODE_RANK=${NODE_RANK:-0}
    LOG_DIR=${LOG_DIR:-./outputs/logs/node$NODE_RANK}
    # (c10d numbers the ranks itself; NODE_RANK only names the log folder.)
    export RDZV_ENDPOINT=$ENDPOINT
    RDZV=(--nnodes="$NNODES"
          --rdzv_backend c10d --rdzv_endpoint="$ENDPOINT"
          --rdzv_id="${RDZV_ID:-torchtitan_neuron}"
          --rdzv_conf "join_timeout=${RDZV_TIMEOUT:-600}"
          --log-dir "$LOG_DIR")
    echo "torchtitan_neuron: node $NODE_RANK of $NNODES, $NGPU ranks, rendezvous at" \
         "$ENDPOINT; rank logs in $LOG_DIR" >&2
fi

# The config is checked in one process first: errors show once, before any rank.
# --help prints tyro's help with the recipe's defaults.
for arg in "$@"; do
    case "$arg" in -h|--help)
        exec "$PYTHON" -m torchtitan_neuron.preflight --ngpu "$NGPU" --module "$MODULE" --config "$CONFIG" "$@" ;;
    esac
done

# torchrun gives each of several ranks one OpenMP thread unless told otherwise,
# and prints a banner saying so; set the same default here, without the banner.
if [ -z "${OMP_NUM_THREADS:-}" ] && [ "$NGPU" -gt 1 ] 2>/dev/null; then
    export OMP_NUM_THREADS=1
fi

# torchrun (in torchtitan_neuron.launch) forwards SIGINT/SIGTERM to every rank;
# exec so Ctrl-C reaches it directly. --preflight runs those checks
# (torchtitan_neuron.preflight) while torchrun loads; no rank starts unless
# they pass.
PREFLIGHT_ARG=(--preflight)
if [ "${PREFLIGHT:-1}" = 0 ]; then PREFLIGHT_ARG=(); fi
exec "$PYTHON" -m torchtitan_neuron.launch "${PREFLIGHT_ARG[@]}" \
    --nproc_per_node="$NGPU" "${RDZV[@]}" \
    --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
    -m torchtitan_neuron.train --module "$MODULE" --config "$CONFIG" "$@"
