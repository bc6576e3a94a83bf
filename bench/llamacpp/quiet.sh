# Sourced by the bench scripts: how busy the machine is, and waiting for it to be quiet before a timed run.
#   busy_pct                 % of all CPUs busy (not idle/iowait) over 1 s, from /proc/stat
#   wait_quiet LABEL CSV     wait until busy_pct <= QUIET_PCT (15), at most QUIET_MAX_WAIT s (20), and append
#                            "LABEL,busy %,waited s,elapsed s" to CSV (header written once); calls `say` if defined
QUIET_PCT=${QUIET_PCT:-15}
QUIET_MAX_WAIT=${QUIET_MAX_WAIT:-20}
QUIET_T0=${QUIET_T0:-$(date +%s)}

busy_pct() {
    local c u n s i w q sq st t1 i1 t2 i2
    read -r c u n s i w q sq st _ < /proc/stat
    t1=$((u + n + s + i + w + q + sq + st)); i1=$((i + w))
    sleep 1
    read -r c u n s i w q sq st _ < /proc/stat
    t2=$((u + n + s + i + w + q + sq + st)); i2=$((i + w))
    echo $(( 100 * ((t2 - t1) - (i2 - i1)) / ((t2 - t1) > 0 ? (t2 - t1) : 1) ))
}

wait_quiet() {  # label csv
    local waited=0 b
    [[ -f $2 ]] || echo "run,busy_pct_before,waited_s,elapsed_s" > "$2"
    while :; do
        b=$(busy_pct)
        if (( b <= QUIET_PCT || waited >= QUIET_MAX_WAIT )); then break; fi
        if (( waited == 0 )) && declare -F say > /dev/null; then
            say "$1: machine ${b}% busy, waiting (up to ${QUIET_MAX_WAIT}s)"
        fi
        sleep 4
        waited=$((waited + 5))
    done
    echo "$1,$b,$waited,$(( $(date +%s) - QUIET_T0 ))" >> "$2"
}
