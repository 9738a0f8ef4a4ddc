#!/usr/bin/env bash
# Train the debug recipes on this machine's accelerator and report what ran.
#
#   scripts/device_check.sh [--dry-run] [--steps N] [--timeout S] [--log PATH]
#
# For a machine with an accelerator (the CPU branch has the test suite). The
# platform is picked as torchtitan_neuron.devices.detect() picks it: neuron if
# torch_neuronx is installed, else cuda if torch.cuda.is_available(); with
# neither it says so and exits 2.
#
#   cuda    NGPU=1: simple_fsdp_llama3_debugmodel (SimpleFSDP on one rank) and
#           llama3_debugmodel_neuron_compiled (torchtitan's Trainer, compiled)
#   neuron  NGPU = the NeuronCores torchtitan_neuron.devices.device_count()
#           counts: simple_fsdp_llama3_debugmodel and
#           simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 (TP2, so it needs
#           an even count), then the rehearsal's verdict on each
#           (python -m torchtitan_neuron.rehearse ... --json), where this
#           checkout has the rehearsal
#
# Each run trains --steps steps (default 10) on the bundled c4_test data and
# tokenizer under a time limit (--timeout seconds, default 1800: a cold
# neuronx-cc compile is slow). It prints each run's step lines and exit code,
# then one summary line per run: passed or failed, loss first -> last. The
# whole output of every run goes to the log (default
# outputs/device_check/<UTC date and time>.log, its path printed at the end),
# whose header names the date, commit, host and device: the README's status
# table is updated from it. Exit 0 when every run passed, 1 when one failed,
# 2 for bad usage or no accelerator. A rehearsal verdict other than ready
# counts as a failed run.
#
#   --dry-run  print the commands for this platform and run nothing (no log)
#   DEVICE_CHECK_PLATFORM=cuda|neuron   force the branch, for --dry-run only
#   DEVICE_CHECK_NEURON_CORES=N         the NeuronCore count to use instead of
#                                       counting them (e.g. for a dry run)
#   PYTHON     interpreter; default .venv/bin/python if present, else python3
set -uo pipefail

cd "$(dirname "$0")/.."

LLAMA=torchtitan_neuron.experiments.graph_trainer.llama3
DEEPSEEK=torchtitan_neuron.experiments.graph_trainer.deepseek_v3
PLAIN_LLAMA=torchtitan_neuron.models.llama3
DATA=(--dataloader.dataset c4_test --hf_assets_path=./tests/assets/tokenizer)
# The DeepSeek debug recipe pins a global batch of 4 (its 4-rank layout); at N
# ranks, TP2 gives N/2 data-parallel ranks, so one batch per rank per step.
DEEPSEEK_LAYOUT=(--training.global_batch_size=-1)

DRY_RUN=0 STEPS=10 TIMEOUT=1800 LOG=""

usage() {
    sed -n '2,/^set -uo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'
}

die() {
    echo "device_check: $*" >&2
    exit 2
}

fail_usage() {
    echo "device_check: $*" >&2
    echo "Usage: scripts/device_check.sh [--dry-run] [--steps N] [--timeout S] [--log PATH]" >&2
    exit 2
}

positive_int() { [[ "$1" =~ ^[1-9][0-9]*$ ]]; }

while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --steps) positive_int "${2:-}" || fail_usage "--steps needs a positive integer"; STEPS=$2; shift ;;
        --timeout) positive_int "${2:-}" || fail_usage "--timeout needs seconds, a positive integer"; TIMEOUT=$2; shift ;;
        --log) [ -n "${2:-}" ] || fail_usage "--log needs a file path"; LOG=$2; shift ;;
        -h|--help) usage; exit 0 ;;
        *) fail_usage "unknown argument '$1'" ;;
    esac
    shift
done

if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python3; fi
fi

# say: to the terminal and, on a real run, to the log.
say() {
    echo "$*"
    if [ -n "$LOG" ]; then echo "$*" >>"$LOG"; fi
}

strip_ansi() { sed -u 's/\x1b\[[0-9;]*m//g'; }

# Prints "<platform> <device count> <description>", as platform.py sees it.
detect_platform() {
    "$PYTHON" - <<'EOF'
import torch
from torchtitan_neuron.devices import detect, device_count

p = detect()
n = device_count(p.name)
desc = f"torch {torch.__version__}"
if p.name == "cuda":
    desc += f", {torch.cuda.get_device_name(0)}, CUDA {torch.version.cuda}"
elif p.name == "neuron":
    try:
        import torch_neuronx
        desc += f", torch-neuronx {getattr(torch_neuronx, '__version__', 'unknown')}"
    except Exception as e:  # device_count() then says None: reported below
        desc += f", torch_neuronx does not import ({type(e).__name__}: {e})"
print(p.name, n if n is not None else 0, desc)
EOF
}

no_accelerator() {
    echo "device_check: no accelerator on this machine (torch_neuronx is not installed" \
         "and torch.cuda.is_available() is False). This script checks the recipes on a" \
         "Trainium or CUDA machine; it is not a CPU test: on CPU, run make test and" \
         "make train. To see the commands it would run elsewhere:" \
         "DEVICE_CHECK_PLATFORM=cuda|neuron scripts/device_check.sh --dry-run" >&2
    exit 2
}

PLATFORM="" COUNT=0 DESCRIPTION=""
choose_platform() {
    local forced=${DEVICE_CHECK_PLATFORM:-}
    if [ -n "$forced" ]; then
        case "$forced" in cuda|neuron) ;; *)
            fail_usage "DEVICE_CHECK_PLATFORM=$forced: use cuda or neuron" ;;
        esac
        [ "$DRY_RUN" = 1 ] || fail_usage "DEVICE_CHECK_PLATFORM forces the branch for --dry-run" \
            "only; unset it to check the accelerator this machine has"
        PLATFORM=$forced DESCRIPTION="forced by DEVICE_CHECK_PLATFORM (dry run)"
        return
    fi
    local found
    if ! found=$(detect_platform 2>"$WORK/detect.err" | tail -n 1); then
        tail -n 5 "$WORK/detect.err" >&2
        die "could not run torchtitan_neuron.platform's detection with $PYTHON" \
            "(set PYTHON to the interpreter torchtitan_neuron is installed in)"
    fi
    read -r PLATFORM COUNT DESCRIPTION <<<"$found"
    [ "$PLATFORM" = cpu ] && no_accelerator
}

NGPU=1
choose_ngpu() {
    [ "$PLATFORM" = neuron ] || { NGPU=1; return; }
    local cores=${DEVICE_CHECK_NEURON_CORES:-}
    if [ -n "$cores" ]; then
        positive_int "$cores" || fail_usage "DEVICE_CHECK_NEURON_CORES=$cores: a positive integer"
        NGPU=$cores
    elif [ "$COUNT" -gt 0 ] 2>/dev/null; then
        NGPU=$COUNT
    else
        die "torchtitan_neuron.devices.device_count('neuron') found no NeuronCores" \
            "(torch_neuronx did not import or reported none); set DEVICE_CHECK_NEURON_CORES=N" \
            "to name the count"
    fi
}

RESULTS=() FAILED=0

# run_recipe NGPU MODULE CONFIG [trainer args...]
run_recipe() {
    local ngpu=$1 module=$2 config=$3; shift 3
    local args=(--training.steps "$STEPS" "${DATA[@]}" "$@")
    local shown="NGPU=$ngpu MODULE=$module CONFIG=$config ./run_train.sh ${args[*]}"
    if [ "$DRY_RUN" = 1 ]; then
        echo "$shown   (time limit ${TIMEOUT} s)"
        return
    fi
    say ""
    say "=== $config, NGPU=$ngpu: $shown"
    local out="$WORK/$config.out" start=$SECONDS rc
    # --foreground: Ctrl-C reaches the launcher, which stops every rank; at
    # the limit the launcher gets SIGTERM and forwards it the same way.
    # The whole output goes to the log, its step lines to the terminal too.
    # The filters ignore Ctrl-C, so the launcher can still print while it
    # stops the ranks; they end when it exits.
    NGPU=$ngpu MODULE=$module CONFIG=$config PYTHON=$PYTHON \
        timeout --foreground --kill-after=60 "$TIMEOUT" ./run_train.sh "${args[@]}" 2>&1 \
        | (trap '' INT; strip_ansi | tee "$out" | tee -a "$LOG" | grep --line-buffered "step:")
    rc=${PIPESTATUS[0]}
    say "exit code: $rc"
    summarize "$config" "$ngpu" "$rc" "$out" $((SECONDS - start))
}

# summarize CONFIG NGPU RC OUTPUT SECONDS: one line; passed means exit 0 and
# a step line for the last step.
summarize() {
    local config=$1 ngpu=$2 rc=$3 out=$4 took=$5 losses first last last_step verdict why=""
    losses=$(grep -v "validate" "$out" | grep -oE 'step: *[0-9]+ +loss: *[^ ]+' \
             | awk '{print $2, $4}')
    first=$(echo "$losses" | head -n 1 | awk '{print $2}')
    last=$(echo "$losses" | tail -n 1 | awk '{print $2}')
    last_step=$(echo "$losses" | tail -n 1 | awk '{print $1}')
    if [ "$rc" = 0 ] && [ "$last_step" = "$STEPS" ]; then
        verdict=passed
    else
        verdict=FAILED FAILED=$((FAILED + 1))
        if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then why=", stopped at the ${TIMEOUT} s limit"
        elif [ "$rc" = 0 ]; then why=", no step $STEPS line"; fi
        echo "--- last lines of its output:"
        tail -n 15 "$out"
    fi
    RESULTS+=("$verdict  $config  NGPU=$ngpu  steps ${last_step:-none}/$STEPS  loss ${first:-none} -> ${last:-none}  exit $rc  ${took} s$why")
}

# rehearse NGPU MODULE CONFIG [overrides...]: the rehearsal's verdict.
rehearse() {
    local ngpu=$1 module=$2 config=$3; shift 3
    local cmd=("$PYTHON" -m torchtitan_neuron.rehearse --module "$module" --config "$config"
               --ngpu "$ngpu" --json "$@")
    if [ "$DRY_RUN" = 1 ]; then
        echo "${cmd[*]}$([ "$REHEARSAL" = 1 ] || echo "   (skipped: not in this checkout)")"
        return
    fi
    if [ "$REHEARSAL" = 0 ]; then
        RESULTS+=("skipped  rehearsal of $config: torchtitan_neuron.rehearse does not import here")
        return
    fi
    say ""
    say "=== rehearsal of $config, NGPU=$ngpu: ${cmd[*]}"
    local json="${LOG%.log}-rehearse-$config.json" rc verdict
    timeout --foreground --kill-after=60 "$TIMEOUT" "${cmd[@]}" >"$json" 2>"$WORK/rehearse.err"
    rc=$?
    strip_ansi <"$WORK/rehearse.err" >>"$LOG"
    cat "$json" >>"$LOG"
    verdict=$("$PYTHON" - "$json" <<'EOF'
import json, sys

text, found = open(sys.argv[1]).read(), None
decoder = json.JSONDecoder()
for i, ch in enumerate(text):  # the last JSON object with a verdict
    if ch == "{" and (i == 0 or text[i - 1] == "\n"):
        try:
            obj = decoder.raw_decode(text, i)[0]
        except ValueError:
            continue
        if "ready" in obj:
            found = obj
if found is None:
    print("no verdict in its output")
else:
    reasons = "; ".join(map(str, found.get("reasons") or []))
    print(("ready" if found["ready"] else "not ready") + (f": {reasons}" if reasons else ""))
EOF
)
    say "rehearsal verdict: $verdict (exit $rc; JSON in $json)"
    local result=passed
    if [ "$rc" != 0 ] || [ "${verdict%%:*}" != ready ]; then result=FAILED FAILED=$((FAILED + 1)); fi
    RESULTS+=("$result  rehearsal of $config  NGPU=$ngpu  $verdict  exit $rc")
}

# REHEARSAL=1 when the rehearsal (another part of the project) imports here.
REHEARSAL=0
check_rehearsal() {
    local err
    if err=$("$PYTHON" -c "import torchtitan_neuron.rehearse" 2>&1); then
        REHEARSAL=1
    else
        REHEARSAL=0
        say "rehearsal: not available in this checkout ('import torchtitan_neuron.rehearse'" \
            "fails: $(echo "$err" | tail -n 1)); its verdicts are skipped"
    fi
}

check_cuda() {
    run_recipe 1 "$LLAMA" simple_fsdp_llama3_debugmodel
    run_recipe 1 "$PLAIN_LLAMA" llama3_debugmodel_neuron_compiled
}

check_neuron() {
    local deepseek=1
    if [ $((NGPU % 2)) != 0 ]; then
        deepseek=0
        say "simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 skipped: TP2 needs an even" \
            "number of NeuronCores, and $NGPU is odd"
        RESULTS+=("skipped  simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2: $NGPU NeuronCores, TP2 needs an even count")
    fi
    run_recipe "$NGPU" "$LLAMA" simple_fsdp_llama3_debugmodel
    [ "$deepseek" = 1 ] && run_recipe "$NGPU" "$DEEPSEEK" \
        simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 "${DEEPSEEK_LAYOUT[@]}"
    check_rehearsal
    rehearse "$NGPU" "$LLAMA" simple_fsdp_llama3_debugmodel
    [ "$deepseek" = 1 ] && rehearse "$NGPU" "$DEEPSEEK" \
        simple_fsdp_deepseek_v3_debugmodel_nki_tp2_fsdp2 "${DEEPSEEK_LAYOUT[@]}"
    return 0
}

commit() {
    local head
    head=$(git rev-parse --short HEAD 2>/dev/null) || { echo "unknown (not a git checkout)"; return; }
    if git diff --quiet HEAD 2>/dev/null; then echo "$head"
    else echo "$head, with uncommitted changes"; fi
}

header() {
    say "device_check $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    say "commit: $(commit)"
    say "host: $(hostname), $(uname -sm)"
    say "platform: $PLATFORM, $COUNT devices seen; $DESCRIPTION"
    say "runs: NGPU=$NGPU, $STEPS steps each, time limit $TIMEOUT s each"
}

WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
# Bash runs this once the run in progress has stopped (the launcher stops
# its ranks on the same Ctrl-C).
trap 'say "device_check: interrupted"; exit 130' INT
choose_platform
choose_ngpu
if [ "$DRY_RUN" = 1 ]; then
    echo "device_check --dry-run: platform $PLATFORM ($DESCRIPTION), NGPU=$NGPU; would run:"
    if [ "$PLATFORM" = cuda ]; then check_cuda; else check_neuron; fi
    exit 0
fi

LOG=${LOG:-outputs/device_check/$(date -u +%Y-%m-%d-%H%M%S).log}
mkdir -p "$(dirname "$LOG")" || die "cannot create the folder of the log $LOG"
: >"$LOG" || die "cannot write the log $LOG"
header
if [ "$PLATFORM" = cuda ]; then check_cuda; else check_neuron; fi

say ""
say "=== summary ($PLATFORM)"
for line in "${RESULTS[@]}"; do say "$line"; done
say "log: $LOG"
[ "$FAILED" = 0 ] || exit 1
