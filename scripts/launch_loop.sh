#!/usr/bin/env bash
# Launch the default 2-rank recipe N times and count the launches that fail:
# the soak behind docs/troubleshooting.md#a-rank-aborts-on-a-corrupted-heap.
#
#   scripts/launch_loop.sh N [MODE ...]
#
# Each launch is the default recipe, 10 steps at batch 2 x 256, seed 42, on the
# bundled data, with every rank's output shown. The MODEs are taken in turn:
#   glibc     the C library's malloc
#   checked   glibc with its debugging checks (libc_malloc_debug, MALLOC_CHECK_=3,
#             MALLOC_PERTURB_=165): a write past a block or into a freed one
#             aborts at the next free
#   jemalloc  jemalloc with freed memory junk-filled (MALLOC_CONF junk:true)
# (default: glibc checked). Prints one line per launch (mode, exit code,
# seconds, first -> last loss) and a count per mode; a failed launch's output
# is kept in $LOOP_DIR (default outputs/launch_loop). Exit 1 if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."

n=${1:?usage: scripts/launch_loop.sh N [glibc|checked|jemalloc ...]}
shift
modes=("$@")
[ ${#modes[@]} -gt 0 ] || modes=(glibc checked)
dir=${LOOP_DIR:-outputs/launch_loop}
mkdir -p "$dir"
debug_malloc=$(ls /usr/lib/*-linux-gnu/libc_malloc_debug.so.0 /usr/lib64/libc_malloc_debug.so.0 2>/dev/null | head -1)
declare -A runs fails

for i in $(seq 1 "$n"); do
    mode=${modes[$(( (i - 1) % ${#modes[@]} ))]}
    case "$mode" in
        glibc) env=(TORCHTITAN_NEURON_CPU_ALLOCATOR=system) ;;
        checked)
            [ -n "$debug_malloc" ] || { echo "no libc_malloc_debug.so.0 on this host" >&2; exit 2; }
            env=(TORCHTITAN_NEURON_CPU_ALLOCATOR=system LD_PRELOAD="$debug_malloc"
                 MALLOC_CHECK_=3 MALLOC_PERTURB_=165) ;;
        jemalloc)
            env=(TORCHTITAN_NEURON_CPU_ALLOCATOR=jemalloc
                 MALLOC_CONF=background_thread:false,dirty_decay_ms:-1,muzzy_decay_ms:-1,junk:true,abort_conf:true) ;;
        *) echo "unknown mode $mode: use glibc, checked or jemalloc" >&2; exit 2 ;;
    esac
    log="$dir/launch$i.log"
    start=$(date +%s)
    env "${env[@]}" LOG_RANK=0,1 PREFLIGHT=0 ./run_train.sh --dataloader.dataset c4_test \
        --hf_assets_path=./tests/assets/tokenizer --debug.seed 42 --debug.deterministic \
        --training.local_batch_size 2 --training.seq_len 256 --training.steps 10 >"$log" 2>&1
    rc=$?
    loss=$(grep -o -m1 "loss  *[0-9.]* -> [0-9.]*" "$log" | tr -s ' ')
    echo "launch $i $mode exit $rc $(( $(date +%s) - start )) s ${loss:-no summary}"
    runs[$mode]=$(( ${runs[$mode]:-0} + 1 ))
    if [ "$rc" -ne 0 ]; then
        fails[$mode]=$(( ${fails[$mode]:-0} + 1 ))
        echo "  output kept: $log"
    else
        rm -f "$log"
    fi
done

failed=0
for mode in "${!runs[@]}"; do
    echo "$mode: ${fails[$mode]:-0} of ${runs[$mode]} launches failed"
    failed=$(( failed + ${fails[$mode]:-0} ))
done
[ "$failed" -eq 0 ]
