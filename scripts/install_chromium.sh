#!/usr/bin/env bash
# Headless-browser tests (tests/test_browser.py) need two things, installed here if missing:
#   1. Debian's `chromium` package (/usr/bin/chromium), via apt-get (update first);
#   2. the `playwright` Python package in .venv, via pip (its driver only: this script never
#      runs `playwright install`, which would download a browser build).
# Idempotent and quiet: a second run does nothing. Exits 0 when both are present at the end,
# 1 otherwise (the browser tests then skip, naming what is missing).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
log() { echo "install_chromium: $*" >&2; }

if ! command -v chromium >/dev/null 2>&1; then
    if command -v apt-get >/dev/null 2>&1; then
        SUDO=""
        if [ "$(id -u)" != "0" ]; then
            if command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then
                SUDO="sudo -n"
            else
                log "not root and no password-less sudo: cannot apt-get install chromium"
            fi
        fi
        if [ "$(id -u)" = "0" ] || [ -n "$SUDO" ]; then
            export DEBIAN_FRONTEND=noninteractive
            $SUDO apt-get update -qq >/dev/null 2>&1 || log "apt-get update failed"
            $SUDO apt-get install -y -qq --no-install-recommends chromium >/dev/null 2>&1 \
                || log "apt-get install chromium failed"
        fi
    else
        log "no apt-get: install Chromium with your package manager"
    fi
fi

if [ -x "$PY" ] && ! "$PY" -c "import playwright" >/dev/null 2>&1; then
    "$PY" -m pip install -q playwright >/dev/null 2>&1 || log "pip install playwright failed"
fi

ok=0
command -v chromium >/dev/null 2>&1 || { log "chromium is still missing"; ok=1; }
if [ ! -x "$PY" ] || ! "$PY" -c "import playwright" >/dev/null 2>&1; then
    log "playwright is still missing from $PY"
    ok=1
fi
exit $ok
