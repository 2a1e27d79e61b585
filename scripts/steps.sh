# Sourced by the set-up scripts. step "what" command... runs a command quietly (its output appended to
# $LOG), says how long it took, and on failure shows the log's tail and exits. prepare_venv DIR creates the
# virtualenv DIR if missing and starts its set-up log (LOG=DIR/setup.log); cpu_torch_venv DIR does that, upgrades
# pip and installs the pinned CPU torch (the engines' tiers install theirs beside it).
prepare_venv() {
    mkdir -p "$1"
    LOG=$1/setup.log
    [ -x "$1/bin/python" ] || "${PYTHON:-python3}" -m venv "$1"
    : >"$LOG"
}

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

cpu_torch_venv() {
    prepare_venv "$1"
    step "upgrading pip" "$1/bin/python" -m pip install -q --upgrade pip
    step "installing PyTorch (torch==2.13.0, CPU)" "$1/bin/python" -m pip install -q torch==2.13.0
}
