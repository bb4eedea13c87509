#!/usr/bin/env sh
# Prints the Python 3.11 interpreter `make venv` builds .venv with: $PYTHON when given, else the
# distribution's own /usr/bin/python3.11, else the python3.11 on PATH, else python3 (each only
# where it can make a venv and has the headers the router's native core compiles against).
#
# Why the distribution's first: Debian, Ubuntu and Fedora build CPython with profile-guided and
# link-time optimisation; pyenv, by default, builds it with neither (and as a shared library).
# The router is Python on its hot path: measured on this project's 2-core machine, the same
# router code costs 16-22 % less CPU a non-streamed request on Debian's 3.11 than on pyenv's
# default 3.11 (docs/benchmarks.md, "The interpreter").
for candidate in "${PYTHON:-}" /usr/bin/python3.11 "$(command -v python3.11 2>/dev/null)"; do
  [ -n "$candidate" ] || continue
  if [ -x "$candidate" ] && "$candidate" -c '
import os, sys, sysconfig
import ensurepip, venv  # noqa: F401 (Debian splits them off into python3.11-venv)
headers = os.path.join(sysconfig.get_paths()["include"], "Python.h")
sys.exit(sys.version_info[:2] != (3, 11) or not os.path.exists(headers))
' 2>/dev/null; then
    echo "$candidate"
    exit 0
  fi
  if [ "$candidate" = "${PYTHON:-}" ]; then
    echo "PYTHON=$PYTHON is not a Python 3.11 that can make a venv with its headers: not used" >&2
  fi
done
command -v python3.11 2>/dev/null || command -v python3
