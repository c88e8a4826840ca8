# Sourced by gpu_check.sh and gpu_calibrate.sh (from the repository root, after `set -euo pipefail`): the Python
# to use and the device it needs, then megatron-core and hetu_ext importable. Needs SCRIPT (the caller's name, for
# its error lines) and DOCS (the page that says where to run it). Exits 2 with one line where a step fails.
#
# PYTHON: $PYTHON if set, else the first of .venv/bin/python, python3 that imports torch. Wheels carried in .whl/
# (megatron-core: the GPU image has torch only) are installed into /tmp/hetu_site. hetu_ext runs from a copy of
# this working tree with patches/ as hetu_ext.patches (what setup.py's package_dir does: a plain PYTHONPATH=$PWD
# leaves hetu_ext.patches unimportable, and hetu_ext.megatron imports it); benchmarks/ from the tree.

if [[ -z "${PYTHON:-}" ]]; then
    for candidate in .venv/bin/python python3; do
        if command -v "$candidate" >/dev/null 2>&1 && "$candidate" -c 'import torch' >/dev/null 2>&1; then
            PYTHON="$candidate"
            break
        fi
    done
fi
if [[ -z "${PYTHON:-}" ]]; then
    echo "$SCRIPT: no python that imports torch (tried .venv/bin/python, python3); set PYTHON=..." >&2
    exit 2
fi
if ! "$PYTHON" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' >/dev/null 2>&1; then
    echo "$SCRIPT: no CUDA device (torch.cuda.is_available() is False for $PYTHON); run it on an" \
         "H100/H200 machine ($DOCS)" >&2
    exit 2
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/hetu_site \
        .whl/*.whl
    export PYTHONPATH="/tmp/hetu_site:${PYTHONPATH:-}"
fi
rm -rf /tmp/hetu_src && mkdir -p /tmp/hetu_src && cp -r hetu_ext /tmp/hetu_src/ && cp -r patches /tmp/hetu_src/hetu_ext/
export PYTHONPATH="/tmp/hetu_src:$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
if ! "$PYTHON" -c 'import megatron.core, hetu_ext.megatron, hetu_ext.patches.megatron_cpu' >/dev/null 2>&1; then
    echo "$SCRIPT: megatron-core or hetu_ext.patches is not importable by $PYTHON; carry megatron-core's wheel in" \
         ".whl/ (see the header of $SCRIPT)" >&2
    exit 2
fi
