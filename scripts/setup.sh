#!/usr/bin/env bash
# Sets up everything stalwart needs on a fresh Debian machine: etcd, a virtual
# environment in .venv, the CPU build of torch 2.13.0, then stalwart itself.
# Safe to run again: each step is skipped when already done.
set -euo pipefail
cd "$(dirname "$0")/.."

if ! command -v etcd >/dev/null 2>&1; then
    echo "setup: installing etcd (Debian packages etcd-server, etcd-client)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq etcd-server etcd-client >/dev/null
fi
# The Debian package starts a system etcd on the default ports; stalwart's tests use
# their own on free ports, so it is harmless, but it is not needed either.

# For the tests only: a real Slurm (slurmctld, slurmd, sbatch: tests/slurm start their own on
# free ports) and promtool (checks deploy/prometheus/alerts.yml). Without them those tests are
# skipped with the reason, so a failed install is a warning, not an error.
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v promtool >/dev/null 2>&1; then
    echo "setup: installing Slurm and promtool for the tests (Debian packages slurm-wlm, prometheus)"
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    { $SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq \
        --no-install-recommends slurm-wlm prometheus >/dev/null; } \
        || echo "setup: warning: could not install slurm-wlm/prometheus; their tests will be skipped"
fi

PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
    echo "setup: creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
# torch first, pinned: an unpinned torch (asked for by deepspeed) would pull a CUDA build.
if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__.split("+")[0] != "2.13.0")' 2>/dev/null; then
    echo "setup: installing torch==2.13.0"
    .venv/bin/pip install -q torch==2.13.0
fi
if ! .venv/bin/python -c 'import stalwart.cli, pytest_timeout, importlinter, mypy' 2>/dev/null \
   || [ ! -x .venv/bin/ruff ] \
   || [ pyproject.toml -nt .venv/.stalwart-installed ] || [ constraints.txt -nt .venv/.stalwart-installed ]; then
    echo "setup: installing stalwart and its dependencies"
    .venv/bin/pip install -q -c constraints.txt -e '.[test]'
    touch .venv/.stalwart-installed
fi
# mypy cannot follow the editable install's import hook: it finds stalwart.* through links.
.venv/bin/python scripts/typecheck_tree.py >/dev/null
# DeepSpeed on the CPU compiles C++ ops on first use (minutes on 2 cores). Build the ones every
# run and test needs once, into .venv/torch_extensions, which tests and the demo use.
export TORCH_EXTENSIONS_DIR="$PWD/.venv/torch_extensions"
if [ ! -f .venv/.ds-ops-built ]; then
    echo "setup: building DeepSpeed's CPU ops (once; a few minutes)"
    DS_ACCELERATOR=cpu .venv/bin/python -c '
from deepspeed.ops.op_builder.cpu.comm import ShareMemCommBuilder
from deepspeed.ops.op_builder.cpu.cpu_adam import CPUAdamBuilder
ShareMemCommBuilder().load(verbose=False)
CPUAdamBuilder().load(verbose=False)
' >/dev/null 2>&1 && touch .venv/.ds-ops-built || echo "setup: warning: DeepSpeed op build failed; runs will build them on first use"
fi
echo "setup: ready ($(.venv/bin/stalwart version --short))"
