# Sourced by the bench scripts: how busy the machine is, and waiting for it to be quiet before a timed run.
#   busy_pct                 % of all CPUs busy (not idle/iowait) over 1 s, from /proc/stat
#   wait_quiet LABEL CSV     wait until busy_pct <= QUIET_PCT (15), at most QUIET_MAX_WAIT s (20), and append
#                            "LABEL,busy %,waited s,elapsed s" to CSV (header written once); calls `say` if defined
#   cpu_mark                 "busy total children" jiffies now: all CPUs' busy and total, this shell's reaped children's
#   others_pct MARK          % of all CPUs that processes other than this shell's children kept busy since MARK (busy
#                            jiffies less the children's CPU time; children must have been waited for)
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

cpu_mark() {
    local c u n s i w q sq st f
    read -r c u n s i w q sq st _ < /proc/stat
    read -r -a f < /proc/$$/stat  # $$: this shell even in $(...); fields 16, 17: cutime, cstime
    echo "$((u + n + s + q + sq + st)) $((u + n + s + i + w + q + sq + st)) $((f[15] + f[16]))"
}

others_pct() {  # mark
    local b0 t0 c0 b1 t1 c1 o
    read -r b0 t0 c0 <<< "$1"
    read -r b1 t1 c1 <<< "$(cpu_mark)"
    o=$(( (b1 - b0) - (c1 - c0) ))
    (( o > 0 )) || o=0
    echo $(( 100 * o / ((t1 - t0) > 0 ? (t1 - t0) : 1) ))
}
