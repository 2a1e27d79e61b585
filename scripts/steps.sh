# Sourced by the set-up scripts. step "what" command... runs a command quietly (its output appended to
# $LOG), says how long it took, and on failure tries again after a pause that grows (STEP_PAUSE x the attempt,
# 30 s unless set; STEP_ATTEMPTS in all, 4 unless set: downloads from PyPI and npm break off now and then, sometimes
# for minutes), then shows the log's tail and exits.
# prepare_venv DIR creates the virtualenv DIR if missing and starts its set-up log (LOG=DIR/setup.log);
# cpu_torch_venv DIR does that, upgrades pip and installs the pinned CPU torch (the engines' tiers install theirs
# beside it).
prepare_venv() {
    mkdir -p "$1"
    LOG=$1/setup.log
    [ -x "$1/bin/python" ] || "${PYTHON:-python3}" -m venv "$1"
    : >"$LOG"
}

# pip: resume a broken-off download many times before giving up, and retry a failed connection more often.
export PIP_RESUME_RETRIES=${PIP_RESUME_RETRIES:-20} PIP_RETRIES=${PIP_RETRIES:-10}

step() {
    local what=$1 start=$SECONDS attempt=1 attempts=${STEP_ATTEMPTS:-4} pause
    shift
    printf '%s: %s ... ' "${STEP_PREFIX:-setup}" "$what"
    until "$@" >>"$LOG" 2>&1; do
        if [ "$attempt" -ge "$attempts" ]; then
            echo "FAILED after $attempts attempts; the end of $LOG:"
            tail -n 40 "$LOG"
            exit 1
        fi
        pause=$((${STEP_PAUSE:-30} * attempt))
        printf 'failed; trying again in %d s (attempt %d of %d) ... ' "$pause" "$((attempt + 1))" "$attempts"
        sleep "$pause"
        attempt=$((attempt + 1))
    done
    echo "done ($((SECONDS - start)) s)"
}

cpu_torch_venv() {
    prepare_venv "$1"
    step "upgrading pip" "$1/bin/python" -m pip install -q --upgrade pip
    step "installing PyTorch (torch==2.13.0, CPU)" "$1/bin/python" -m pip install -q torch==2.13.0
}
