# Sourced by the set-up scripts: step "what" command... runs a command quietly (its output appended to
# $LOG), says how long it took, and on failure shows the log's tail and exits.
step() {
    local what=$1 start=$SECONDS
    shift
    printf '%s: %s ... ' "${STEP_PREFIX:-setup}" "$what"
    if "$@" >>"$LOG" 2>&1; then
        echo "done ($((SECONDS - start)) s)"
    else
        echo "FAILED; the end of $LOG:"
        tail -n 40 "$LOG"
        exit 1
    fi
}
