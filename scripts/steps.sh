# Sourced by the set-up scripts. step "what" command... runs a command quietly (its output appended to
# $LOG), says how long it took, and on failure tries again after a pause that grows (STEP_PAUSE x the attempt,
# 30 s unless set; STEP_ATTEMPTS in all, 4 unless set: downloads from PyPI and npm break off now and then, sometimes
# for minutes), then shows the log's tail and exits.
# link_cached_env DIR NAME INPUT... makes a missing DIR a link to the shared copy of this set-up
# ($SPECDEC_ENV_CACHE, else ~/.cache/specdec-kit/envs, /NAME-<hash of the inputs: files by content, other words as
# they are, and the Python version>), so a second checkout, or CI's clean clone, reuses a finished one at once and a
# changed input makes a new one (the cache keeps two per name: the new one and the newest before it).
# SPECDEC_ENV_CACHE=none keeps every set-up in the checkout. Sets ENV_KEY (the hash).
# prepare_venv DIR creates the virtualenv DIR if missing (at the link's target, so its scripts name the shared
# path) and starts its set-up log (LOG=DIR/setup.log); cpu_torch_venv DIR does that, upgrades pip and installs the
# pinned CPU torch (the engines' tiers install theirs beside it).
link_cached_env() {
    local dir=$1 name=$2 cache=${SPECDEC_ENV_CACHE:-$HOME/.cache/specdec-kit/envs} input
    shift 2
    ENV_KEY=$({ "${PYTHON:-python3}" --version; for input in "$@"; do
        if [ -f "$input" ]; then sha256sum <"$input"; else echo "$input"; fi; done; } | sha256sum | cut -c1-16)
    [ "$cache" = none ] && return 0
    if [ -L "$dir" ] && [ "$(readlink "$dir")" != "$cache/$name-$ENV_KEY" ]; then
        rm "$dir"  # a link to the copy for other inputs: this set-up's inputs changed
    fi
    [ -e "$dir" ] || [ -L "$dir" ] && return 0  # the checkout's own set-up, or already linked
    mkdir -p "$cache" 2>/dev/null && [ -w "$cache" ] || return 0  # no writable cache: set up in the checkout
    if [ ! -d "$cache/$name-$ENV_KEY" ]; then  # a new copy: keep only the newest other one of this name (GBs each)
        find "$cache" -maxdepth 1 -name "$name-*" -type d -printf '%T@ %p\n' | sort -rn | tail -n +2 | cut -d' ' -f2- |
            xargs -r rm -rf
    fi
    mkdir -p "$cache/$name-$ENV_KEY" "$(dirname "$dir")"
    ln -s "$cache/$name-$ENV_KEY" "$dir"
}

# venv_python DIR: DIR's interpreter by its real path (DIR may be a link into the cache): what pip installs with it
# names that path in its scripts' first lines, so they run from any checkout that links the same copy.
venv_python() {
    echo "$(readlink -f "$1")/bin/python"
}

prepare_venv() {
    mkdir -p "$1"
    LOG=$1/setup.log
    [ -x "$1/bin/python" ] || "${PYTHON:-python3}" -m venv "$(readlink -f "$1")"
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

# point_kit_here DIR: the kit in DIR, editable and without dependencies, follows this checkout (a shared copy of a
# set-up may have followed another).
point_kit_here() {
    [ "$("$1/bin/python" -c 'import specdec_kit.runtime as r; print(r.__file__)' 2>/dev/null)" = "$PWD/runtime/__init__.py" ] ||
        step "installing the kit from this checkout (editable, no dependencies)" "$(venv_python "$1")" -m pip install -q --no-deps -e .
}

cpu_torch_venv() {
    prepare_venv "$1"
    step "upgrading pip" "$(venv_python "$1")" -m pip install -q --upgrade pip
    step "installing PyTorch (torch==2.13.0, CPU)" "$(venv_python "$1")" -m pip install -q torch==2.13.0
}
